//! Kernel sources, signatures, launch configurations and arguments.
//!
//! A [`KernelSource`] is one translation unit of CUDA C that is also valid HIP, plus, for every
//! entry point, its declared [`Param`] list and the Rust reference function the CPU backend runs in
//! its place. The signature is checked on every launch, on every backend, before anything reaches a
//! driver, so a wrong argument count or type is an error that names the kernel and the parameter.

use std::fmt;
use std::sync::Arc;

use crate::cpu::CpuLaunch;
use crate::dtype::{DType, Element};
use crate::error::{HalError, Result};
use crate::memory::RawView;

/// How a kernel uses a pointer parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// Only read.
    Read,
    /// Only written (contents on entry are ignored).
    Write,
    /// Read and written.
    ReadWrite,
}

impl Access {
    /// True if the kernel may read through this parameter.
    pub const fn reads(self) -> bool {
        matches!(self, Access::Read | Access::ReadWrite)
    }
    /// True if the kernel may write through this parameter.
    pub const fn writes(self) -> bool {
        matches!(self, Access::Write | Access::ReadWrite)
    }
}

/// Type of a scalar (by-value) kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScalarKind {
    /// `int32_t`.
    I32,
    /// `uint32_t`.
    U32,
    /// `int64_t`.
    I64,
    /// `uint64_t`.
    U64,
    /// `float`.
    F32,
}

impl fmt::Display for ScalarKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScalarKind::I32 => "i32",
            ScalarKind::U32 => "u32",
            ScalarKind::I64 => "i64",
            ScalarKind::U64 => "u64",
            ScalarKind::F32 => "f32",
        })
    }
}

/// Kind of one kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A device pointer to elements of `dtype`, used as `access` says.
    Ptr {
        /// Element type pointed to.
        dtype: DType,
        /// How the kernel uses it.
        access: Access,
    },
    /// A scalar passed by value.
    Scalar(ScalarKind),
}

impl fmt::Display for ParamKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParamKind::Ptr { dtype, access } => write!(f, "{access:?} pointer to {dtype}"),
            ParamKind::Scalar(s) => write!(f, "{s} scalar"),
        }
    }
}

/// One declared kernel parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    /// Name used in error messages (match the source's parameter name).
    pub name: &'static str,
    /// Its kind.
    pub kind: ParamKind,
}

impl Param {
    /// A read-only pointer to `T`.
    pub const fn input<T: Element>(name: &'static str) -> Self {
        Param { name, kind: ParamKind::Ptr { dtype: T::DTYPE, access: Access::Read } }
    }
    /// A write-only pointer to `T`.
    pub const fn output<T: Element>(name: &'static str) -> Self {
        Param { name, kind: ParamKind::Ptr { dtype: T::DTYPE, access: Access::Write } }
    }
    /// A read-write pointer to `T`.
    pub const fn inout<T: Element>(name: &'static str) -> Self {
        Param { name, kind: ParamKind::Ptr { dtype: T::DTYPE, access: Access::ReadWrite } }
    }
    /// A scalar by value.
    pub const fn scalar(name: &'static str, kind: ScalarKind) -> Self {
        Param { name, kind: ParamKind::Scalar(kind) }
    }
}

/// The CPU backend's stand-in for a device kernel: it computes what the kernel computes.
pub type CpuKernelFn = fn(&CpuLaunch<'_>) -> Result<()>;

/// One entry point of a kernel source.
#[derive(Clone, Debug)]
pub struct KernelEntry {
    /// The `extern "C" __global__` function name.
    pub name: &'static str,
    /// Its parameters in order.
    pub params: Vec<Param>,
    /// The CPU reference with the same argument list.
    pub cpu: CpuKernelFn,
}

/// A kernel translation unit: CUDA C (valid HIP too) plus its entry points.
#[derive(Clone, Debug)]
pub struct KernelSource {
    /// A unique name (used as the module cache key together with a hash of `code`).
    pub name: &'static str,
    /// The source text; the HAL prepends [`PORTABILITY_HEADER`] when compiling for a GPU.
    pub code: &'static str,
    /// The entry points.
    pub entries: Vec<KernelEntry>,
}

impl KernelSource {
    /// A stable 64-bit hash of the name and code (FNV-1a), used in cache keys.
    pub fn content_hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.name.bytes().chain([0u8]).chain(self.code.bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }

    /// Checks that entry names are unique and non-empty.
    pub fn validate(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for e in &self.entries {
            if e.name.is_empty() || !seen.insert(e.name) {
                return Err(HalError::Compile {
                    source_name: self.name.to_string(),
                    arch: "any".into(),
                    log: format!("entry point name `{}` is empty or repeated", e.name),
                });
            }
        }
        Ok(())
    }
}

/// Definitions every kernel source may rely on, on NVRTC and hipRTC alike: fixed-width integer
/// types, `hf_bf16`/`hf_f16` storage types with f32 conversions, the warp width and shuffles.
pub const PORTABILITY_HEADER: &str = include_str!("portability.h");

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// Most threads per block any supported device accepts.
    pub const MAX_THREADS_PER_BLOCK: u32 = 1024;

    /// A 1-D launch covering `n` elements with `block` threads per block (at least one block,
    /// so the launch shape is valid even for `n == 0`).
    pub fn for_elements(n: usize, block: u32) -> Self {
        let block = block.max(1);
        let blocks = n.div_ceil(block as usize).max(1);
        LaunchConfig {
            grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
            block: (block, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Whether a grid of `blocks` blocks is resident all at once with room to spare on a device of
    /// `compute_units` multiprocessors: at most half of them, each able to hold a block. A kernel
    /// whose blocks wait for blocks of lower index (a chained scan, a tile barrier) may then order
    /// them by block index instead of tickets claimed from a counter: no block can wait on one
    /// that never starts.
    pub const fn grid_resident_at_once(blocks: usize, compute_units: usize) -> bool {
        2 * blocks <= compute_units
    }

    /// A launch of `grid` blocks of `block` threads in x.
    pub const fn blocks(grid: u32, block: u32) -> Self {
        LaunchConfig { grid: (grid, 1, 1), block: (block, 1, 1), shared_mem_bytes: 0 }
    }

    /// Total threads per block.
    pub fn threads_per_block(&self) -> u64 {
        u64::from(self.block.0) * u64::from(self.block.1) * u64::from(self.block.2)
    }

    /// Rejects zero dimensions and blocks above [`Self::MAX_THREADS_PER_BLOCK`].
    pub fn validate(&self, kernel: &str) -> Result<()> {
        let (g, b) = (self.grid, self.block);
        let bad = |detail: String| HalError::InvalidLaunch { kernel: kernel.to_string(), detail };
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return Err(bad(format!("grid {g:?} and block {b:?} must have no zero dimension")));
        }
        if self.threads_per_block() > u64::from(Self::MAX_THREADS_PER_BLOCK) {
            return Err(bad(format!(
                "block {b:?} has {} threads, more than {}",
                self.threads_per_block(),
                Self::MAX_THREADS_PER_BLOCK
            )));
        }
        if g.1 > 65535 || g.2 > 65535 {
            return Err(bad(format!("grid {g:?}: y and z are limited to 65535")));
        }
        Ok(())
    }
}

/// Most blocks one thread-block cluster may hold ([`crate::Stream::launch_cluster`]): NVIDIA
/// sm_90's non-portable cluster size, which the HAL allows on every kernel it loads for such a
/// device. Clusters of up to [`PORTABLE_CLUSTER_BLOCKS`] run on every sm_90 device; whether a larger
/// one fits a given kernel and device is what [`crate::Device::max_active_clusters`] answers (0
/// when it does not).
pub const MAX_CLUSTER_BLOCKS: u32 = 16;

/// The cluster size every NVIDIA sm_90 device schedules for any kernel whose blocks fit.
pub const PORTABLE_CLUSTER_BLOCKS: u32 = 8;

/// How a launch runs beside the work around it, past its grid and block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaunchMode {
    /// Programmatic dependent launch ([`crate::Stream::launch_dependent`]).
    pub(crate) dependent: bool,
    /// Blocks per thread-block cluster in x; 1 for none ([`crate::Stream::launch_cluster`]).
    pub(crate) cluster: u32,
}

impl LaunchMode {
    pub(crate) const PLAIN: LaunchMode = LaunchMode { dependent: false, cluster: 1 };
}

/// One launch argument.
#[derive(Clone, Debug)]
pub enum Arg {
    /// A buffer or view (its address, length and element type).
    Ptr(RawView),
    /// `int32_t`.
    I32(i32),
    /// `uint32_t`.
    U32(u32),
    /// `int64_t`.
    I64(i64),
    /// `uint64_t`.
    U64(u64),
    /// `float`.
    F32(f32),
}

impl Arg {
    fn describe(&self) -> String {
        match self {
            Arg::Ptr(v) => format!("pointer to {} ({} elements of `{}`)", v.dtype(), v.len(), v.label()),
            Arg::I32(_) => "i32 scalar".into(),
            Arg::U32(_) => "u32 scalar".into(),
            Arg::I64(_) => "i64 scalar".into(),
            Arg::U64(_) => "u64 scalar".into(),
            Arg::F32(_) => "f32 scalar".into(),
        }
    }

    fn scalar_kind(&self) -> Option<ScalarKind> {
        Some(match self {
            Arg::Ptr(_) => return None,
            Arg::I32(_) => ScalarKind::I32,
            Arg::U32(_) => ScalarKind::U32,
            Arg::I64(_) => ScalarKind::I64,
            Arg::U64(_) => ScalarKind::U64,
            Arg::F32(_) => ScalarKind::F32,
        })
    }
}

macro_rules! scalar_arg {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Arg {
            fn from(x: $t) -> Self { Arg::$v(x) }
        }
    )*};
}
scalar_arg!(i32 => I32, u32 => U32, i64 => I64, u64 => U64, f32 => F32);

/// Checks `args` against `params`: count, pointer element types, scalar kinds.
pub(crate) fn check_args(kernel: &str, params: &[Param], args: &[Arg]) -> Result<()> {
    if params.len() != args.len() {
        return Err(HalError::KernelArgs {
            kernel: kernel.to_string(),
            detail: format!("expects {} arguments, got {}", params.len(), args.len()),
        });
    }
    for (i, (p, a)) in params.iter().zip(args).enumerate() {
        let ok = match (p.kind, a) {
            (ParamKind::Ptr { dtype, .. }, Arg::Ptr(v)) => v.dtype() == dtype,
            (ParamKind::Scalar(k), a) => a.scalar_kind() == Some(k),
            _ => false,
        };
        if !ok {
            return Err(HalError::KernelArgs {
                kernel: kernel.to_string(),
                detail: format!("argument {i} (`{}`) expects a {}, got a {}", p.name, p.kind, a.describe()),
            });
        }
    }
    Ok(())
}

/// A compiled kernel entry point, ready to launch on streams of its device.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub(crate) device_id: u64,
    pub(crate) entry: Arc<KernelEntry>,
    pub(crate) inner: crate::backend::KernelImpl,
}

impl Kernel {
    /// The entry point name.
    pub fn name(&self) -> &'static str {
        self.entry.name
    }
    /// The declared parameters.
    pub fn params(&self) -> &[Param] {
        &self.entry.params
    }
}

/// A compiled kernel source on one device.
#[derive(Clone, Debug)]
pub struct Module {
    pub(crate) device_id: u64,
    pub(crate) source_name: &'static str,
    pub(crate) kernels: Vec<Kernel>,
}

impl Module {
    /// The entry point `name`, or [`HalError::UnknownKernel`].
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        self.kernels.iter().find(|k| k.name() == name).cloned().ok_or_else(|| HalError::UnknownKernel {
            module: self.source_name.to_string(),
            name: name.to_string(),
            available: self.kernels.iter().map(|k| k.name()).collect::<Vec<_>>().join(", "),
        })
    }

    /// The source name this module was compiled from.
    pub fn source_name(&self) -> &'static str {
        self.source_name
    }

    /// The device this module belongs to (its id, as [`crate::Device::id`]).
    pub fn device_id(&self) -> u64 {
        self.device_id
    }
}

#[cfg(test)]
mod tests {
    use super::LaunchConfig;

    #[test]
    fn a_grid_is_resident_at_once_up_to_half_the_multiprocessors() {
        assert!(LaunchConfig::grid_resident_at_once(1, 132));
        assert!(LaunchConfig::grid_resident_at_once(66, 132));
        assert!(!LaunchConfig::grid_resident_at_once(67, 132));
        assert!(!LaunchConfig::grid_resident_at_once(1024, 132));
        // A device that reports no units holds no grid at once.
        assert!(!LaunchConfig::grid_resident_at_once(1, 0));
    }
}
