//! Executing a kernel's CPU reference: argument resolution, locking, checked element access.

use std::marker::PhantomData;
use std::sync::{Arc, MutexGuard};

use super::{bad_addr, CpuAllocation, CpuCore};
use crate::backend::LaunchArg;
use crate::device::lock;
use crate::dtype::Element;
use crate::error::{HalError, Result};
use crate::kernel::{Access, CpuKernelFn, KernelEntry, LaunchConfig, ParamKind};

enum CpuArg {
    Ptr { base: *mut u8, len: usize, label: String, access: Access },
    Scalar(LaunchArg),
}

/// What a CPU reference kernel sees: its launch configuration and its arguments, resolved to live
/// allocations and locked for the duration of the call.
///
/// Pointer arguments are reached through [`CpuLaunch::ptr`], whose accessors check every index
/// against the view the caller passed; reading past it is [`HalError::OutOfBounds`], writing to a
/// parameter declared read-only is [`HalError::ReadOnlyArgument`].
pub struct CpuLaunch<'a> {
    entry: &'a KernelEntry,
    cfg: &'a LaunchConfig,
    cluster: u32,
    args: Vec<CpuArg>,
}

impl CpuLaunch<'_> {
    /// The entry point being run.
    pub fn kernel_name(&self) -> &str {
        self.entry.name
    }

    /// The launch configuration (grid, block, shared memory) the caller chose.
    pub fn config(&self) -> &LaunchConfig {
        self.cfg
    }

    /// Blocks per thread-block cluster in x: the `cluster` of [`crate::Stream::launch_cluster`],
    /// 1 for every other launch.
    pub fn cluster_blocks(&self) -> u32 {
        self.cluster
    }

    fn scalar(&self, i: usize) -> Result<LaunchArg> {
        match self.args.get(i) {
            Some(CpuArg::Scalar(s)) => Ok(*s),
            _ => Err(self.arg_error(i, "is not a scalar")),
        }
    }

    fn arg_error(&self, i: usize, what: &str) -> HalError {
        let name = self.entry.params.get(i).map_or("?", |p| p.name);
        HalError::KernelArgs {
            kernel: self.entry.name.to_string(),
            detail: format!("CPU reference: argument {i} (`{name}`) {what}"),
        }
    }

    /// Scalar argument `i` as `i32`.
    pub fn i32(&self, i: usize) -> Result<i32> {
        match self.scalar(i)? {
            LaunchArg::I32(x) => Ok(x),
            _ => Err(self.arg_error(i, "is not an i32")),
        }
    }
    /// Scalar argument `i` as `u32`.
    pub fn u32(&self, i: usize) -> Result<u32> {
        match self.scalar(i)? {
            LaunchArg::U32(x) => Ok(x),
            _ => Err(self.arg_error(i, "is not a u32")),
        }
    }
    /// Scalar argument `i` as `i64`.
    pub fn i64(&self, i: usize) -> Result<i64> {
        match self.scalar(i)? {
            LaunchArg::I64(x) => Ok(x),
            _ => Err(self.arg_error(i, "is not an i64")),
        }
    }
    /// Scalar argument `i` as `u64`.
    pub fn u64(&self, i: usize) -> Result<u64> {
        match self.scalar(i)? {
            LaunchArg::U64(x) => Ok(x),
            _ => Err(self.arg_error(i, "is not a u64")),
        }
    }
    /// Scalar argument `i` as `f32`.
    pub fn f32(&self, i: usize) -> Result<f32> {
        match self.scalar(i)? {
            LaunchArg::F32(x) => Ok(x),
            _ => Err(self.arg_error(i, "is not an f32")),
        }
    }
    /// Scalar argument `i` (a `u32`, `i32` ≥ 0 or `u64`) as a `usize` count.
    pub fn count(&self, i: usize) -> Result<usize> {
        match self.scalar(i)? {
            LaunchArg::U32(x) => Ok(x as usize),
            LaunchArg::U64(x) => usize::try_from(x).map_err(|_| self.arg_error(i, "does not fit usize")),
            LaunchArg::I32(x) if x >= 0 => Ok(x as usize),
            LaunchArg::I64(x) if x >= 0 => usize::try_from(x).map_err(|_| self.arg_error(i, "does not fit usize")),
            _ => Err(self.arg_error(i, "is not a non-negative count")),
        }
    }

    /// Pointer argument `i`, as elements of `T` (must match the declared element type).
    pub fn ptr<T: Element>(&self, i: usize) -> Result<CpuPtr<'_, T>> {
        match (self.args.get(i), self.entry.params.get(i).map(|p| p.kind)) {
            (Some(CpuArg::Ptr { base, len, label, access }), Some(ParamKind::Ptr { dtype, .. }))
                if dtype == T::DTYPE =>
            {
                Ok(CpuPtr {
                    base: base.cast::<T>(),
                    len: *len,
                    access: *access,
                    kernel: self.entry.name,
                    arg: self.entry.params[i].name,
                    label: label.as_str(),
                    _lt: PhantomData,
                })
            }
            (Some(CpuArg::Ptr { .. }), _) => Err(self.arg_error(i, &format!("is not a pointer to {}", T::DTYPE))),
            _ => Err(self.arg_error(i, "is not a pointer")),
        }
    }

    /// A [`HalError::KernelFailed`] for this kernel (for references that validate their inputs).
    pub fn fail(&self, message: impl Into<String>) -> HalError {
        HalError::KernelFailed { kernel: self.entry.name.to_string(), message: message.into() }
    }
}

/// A bounds-checked typed pointer into one locked allocation.
///
/// Accesses go through raw pointers (never references), so two arguments that alias the same
/// memory, as an in-place kernel's input and output do, behave as on a GPU.
pub struct CpuPtr<'a, T: Element> {
    base: *mut T,
    len: usize,
    access: Access,
    kernel: &'a str,
    arg: &'a str,
    label: &'a str,
    _lt: PhantomData<&'a ()>,
}

impl<T: Element> CpuPtr<'_, T> {
    /// Length of the view, in elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn oob(&self, index: usize) -> HalError {
        self.oob_signed(i64::try_from(index).unwrap_or(i64::MAX))
    }

    fn oob_signed(&self, index: i64) -> HalError {
        HalError::OutOfBounds {
            kernel: self.kernel.to_string(),
            arg: self.arg.to_string(),
            index,
            len: self.len,
            buffer: self.label.to_string(),
        }
    }

    fn check_range(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(self.oob(offset.saturating_add(n).saturating_sub(1).max(offset))),
        }
    }

    fn check_write(&self) -> Result<()> {
        if !self.access.writes() {
            return Err(HalError::ReadOnlyArgument { kernel: self.kernel.to_string(), arg: self.arg.to_string() });
        }
        Ok(())
    }

    /// Element `i`.
    pub fn get(&self, i: usize) -> Result<T> {
        if i >= self.len {
            return Err(self.oob(i));
        }
        // SAFETY: `i < len` and the view lies inside a live allocation that this launch holds
        // locked; the allocation is 8-byte aligned and views are element-aligned.
        Ok(unsafe { self.base.add(i).read() })
    }

    /// Element `i` with a signed index (negative indices are out of bounds, reported as such).
    pub fn get_signed(&self, i: i64) -> Result<T> {
        usize::try_from(i).map_err(|_| self.oob_signed(i)).and_then(|i| self.get(i))
    }

    /// Stores `v` at element `i`.
    pub fn set(&self, i: usize, v: T) -> Result<()> {
        self.check_write()?;
        if i >= self.len {
            return Err(self.oob(i));
        }
        // SAFETY: as in `get`; the lock gives this launch exclusive access to the allocation.
        unsafe { self.base.add(i).write(v) };
        Ok(())
    }

    /// Elements `[offset, offset + n)` copied out.
    pub fn read(&self, offset: usize, n: usize) -> Result<Vec<T>> {
        self.check_range(offset, n)?;
        let mut out = Vec::with_capacity(n);
        // SAFETY: range checked above; source and destination cannot overlap (fresh Vec).
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.add(offset), out.as_mut_ptr(), n);
            out.set_len(n);
        }
        Ok(out)
    }

    /// The whole view copied out.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        self.read(0, self.len)
    }

    /// Writes `data` at element `offset`.
    pub fn write(&self, offset: usize, data: &[T]) -> Result<()> {
        self.check_write()?;
        self.check_range(offset, data.len())?;
        // SAFETY: range checked; `data` is a host slice, never device memory, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(offset), data.len()) };
        Ok(())
    }

    /// Sets elements `[offset, offset + n)` to `v`.
    pub fn fill(&self, offset: usize, n: usize, v: T) -> Result<()> {
        self.check_write()?;
        self.check_range(offset, n)?;
        for i in offset..offset + n {
            // SAFETY: range checked above.
            unsafe { self.base.add(i).write(v) };
        }
        Ok(())
    }
}

/// Resolves, locks and runs one CPU kernel launch.
pub(super) fn execute(
    core: &CpuCore,
    f: CpuKernelFn,
    entry: &KernelEntry,
    cfg: &LaunchConfig,
    cluster: u32,
    args: &[LaunchArg],
) -> Result<()> {
    // Resolve every pointer to (allocation, byte offset).
    let mut resolved: Vec<Option<(Arc<CpuAllocation>, usize)>> = Vec::with_capacity(args.len());
    for (p, a) in entry.params.iter().zip(args) {
        match (p.kind, a) {
            (ParamKind::Ptr { dtype, .. }, LaunchArg::Ptr { addr, len }) => {
                let bytes = len * dtype.size();
                let r = core.resolve(*addr, bytes).map_err(|why| bad_addr(entry.name, p.name, *addr, bytes, why))?;
                resolved.push(Some(r));
            }
            _ => resolved.push(None),
        }
    }
    // Lock each distinct allocation once, in address order (no lock-order inversion between
    // streams driven from different threads).
    let mut allocs: Vec<&Arc<CpuAllocation>> = resolved.iter().flatten().map(|(a, _)| a).collect();
    allocs.sort_by_key(|a| a.base);
    allocs.dedup_by_key(|a| a.base);
    let mut guards: Vec<(u64, MutexGuard<'_, Box<[u64]>>)> = allocs.iter().map(|a| (a.base, lock(&a.data))).collect();
    let mut bases: Vec<(u64, *mut u8)> = guards.iter_mut().map(|(b, g)| (*b, g.as_mut_ptr().cast::<u8>())).collect();
    bases.sort_by_key(|(b, _)| *b);

    let mut cpu_args = Vec::with_capacity(args.len());
    for ((p, a), r) in entry.params.iter().zip(args).zip(&resolved) {
        cpu_args.push(match (p.kind, a, r) {
            (ParamKind::Ptr { access, .. }, LaunchArg::Ptr { len, .. }, Some((alloc, off))) => {
                let idx = bases
                    .binary_search_by_key(&alloc.base, |(b, _)| *b)
                    .map_err(|_| bad_addr(entry.name, p.name, alloc.base, 0, "lost its lock".into()))?;
                // SAFETY: `off + len * size` was checked to lie inside the allocation by `resolve`.
                let base = unsafe { bases[idx].1.add(*off) };
                CpuArg::Ptr { base, len: *len, label: alloc.label.clone(), access }
            }
            (_, s, _) => CpuArg::Scalar(*s),
        });
    }
    let launch = CpuLaunch { entry, cfg, cluster, args: cpu_args };
    let result = f(&launch);
    drop(launch);
    drop(guards);
    result
}
