//! The backend interface: one trait per concept, one enum per concept over the compiled-in
//! backends, dispatched statically with `enum_dispatch`.
//!
//! Backends speak in device addresses and bytes, like a driver. Everything typed, every check of
//! the capture rules and every bookkeeping (retention, stats, sanitizer generations) lives in the
//! backend-neutral front end, so it is written once and behaves the same on every backend.

use std::sync::Arc;

use enum_dispatch::enum_dispatch;

use crate::comm::CollectiveCall;
use crate::cpu::{CpuComm, CpuDevice, CpuEvent, CpuGraph, CpuKernel, CpuMem, CpuPinned, CpuStream};
#[cfg(feature = "cuda")]
use crate::cuda::{CudaComm, CudaDevice, CudaEvent, CudaGraph, CudaKernel, CudaMem, CudaPinned, CudaStream};
use crate::error::Result;
use crate::kernel::{Arg, KernelEntry, KernelSource, LaunchConfig, LaunchMode};
#[cfg(feature = "rocm")]
use crate::rocm::{RocmDevice, RocmEvent, RocmGraph, RocmKernel, RocmMem, RocmPinned, RocmStream};
use crate::stream::StreamPriority;

/// A launch argument reduced to its value: what a recorded CPU launch keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum LaunchArg {
    /// Device address and the length of the view in elements (CPU bounds checks use it).
    Ptr {
        addr: u64,
        len: usize,
    },
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F32(f32),
}

impl LaunchArg {
    pub(crate) fn of(a: &Arg) -> Self {
        match a {
            Arg::Ptr(v) => LaunchArg::Ptr { addr: v.addr(), len: v.len() },
            Arg::I32(x) => LaunchArg::I32(*x),
            Arg::U32(x) => LaunchArg::U32(*x),
            Arg::I64(x) => LaunchArg::I64(*x),
            Arg::U64(x) => LaunchArg::U64(*x),
            Arg::F32(x) => LaunchArg::F32(*x),
        }
    }

    /// The argument as the 8-byte slot a driver launch reads (4-byte values in the low half).
    #[allow(dead_code)]
    pub(crate) fn slot(a: &Arg) -> u64 {
        match a {
            Arg::Ptr(v) => v.addr(),
            Arg::I32(x) => u64::from(*x as u32),
            Arg::U32(x) => u64::from(*x),
            Arg::I64(x) => *x as u64,
            Arg::U64(x) => *x,
            Arg::F32(x) => u64::from(x.to_bits()),
        }
    }
}

#[enum_dispatch]
pub(crate) trait DeviceOps {
    /// Allocates `bytes` (a zero-byte request still yields a unique address).
    fn alloc(&self, bytes: usize, label: &str) -> Result<MemImpl>;
    /// Synchronous host→device write (used by uploads at setup).
    fn write_sync(&self, addr: u64, data: &[u8]) -> Result<()>;
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedImpl>;
    /// Allocates `bytes` of zero-filled page-locked host memory mapped into the device's address
    /// space (kernels and copies use its [`MemOps::addr`]; the host writes it in place).
    fn alloc_mapped(&self, bytes: usize, label: &str) -> Result<MemImpl>;
    /// Creates an in-order non-blocking stream whose kernels are scheduled at `priority`.
    fn create_stream(&self, priority: StreamPriority) -> Result<StreamImpl>;
    fn create_event(&self) -> Result<EventImpl>;
    /// Compiles every entry of `src`, in order.
    fn compile(&self, src: &KernelSource) -> Result<Vec<KernelImpl>>;
    fn synchronize(&self) -> Result<()>;
    /// How many clusters of `cluster` blocks of `kernel` with `cfg`'s block shape and dynamic
    /// shared memory the whole device runs at once (checked by the front end: the device has
    /// clusters, `cluster` is in range).
    fn max_active_clusters(&self, kernel: &KernelImpl, cfg: &LaunchConfig, cluster: u32) -> Result<u32>;
}

#[enum_dispatch(DeviceOps)]
pub(crate) enum DeviceImpl {
    Cpu(CpuDevice),
    #[cfg(feature = "cuda")]
    Cuda(CudaDevice),
    #[cfg(feature = "rocm")]
    Rocm(RocmDevice),
}

/// The host side of a mapped allocation on a GPU backend: `bytes` of page-locked memory at `ptr`,
/// valid while the owning handle lives (the owner frees it).
#[cfg(any(feature = "cuda", feature = "rocm"))]
pub(crate) struct HostRegion {
    ptr: *mut u8,
    bytes: usize,
}
// SAFETY: page-locked host memory is plain memory; every access goes through `write` / `read`,
// which check the range.
#[cfg(any(feature = "cuda", feature = "rocm"))]
unsafe impl Send for HostRegion {}
// SAFETY: as above.
#[cfg(any(feature = "cuda", feature = "rocm"))]
unsafe impl Sync for HostRegion {}

#[cfg(any(feature = "cuda", feature = "rocm"))]
impl HostRegion {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `bytes` bytes for the life of the region.
    pub(crate) unsafe fn new(ptr: *mut u8, bytes: usize) -> HostRegion {
        HostRegion { ptr, bytes }
    }
    /// The start address (for freeing).
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn at(&self, offset: usize, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len) {
            // SAFETY: `[offset, offset + len)` lies inside the region.
            Some(end) if end <= self.bytes => Ok(unsafe { self.ptr.add(offset) }),
            _ => Err(crate::error::HalError::InvalidView {
                buffer: "mapped host memory".into(),
                offset,
                len,
                capacity: self.bytes,
            }),
        }
    }
    /// Copies `data` in at byte `offset`.
    pub(crate) fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let at = self.at(offset, data.len())?;
        // SAFETY: in range (checked); `data` is ordinary host memory, not overlapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len()) };
        Ok(())
    }
    /// Copies `out.len()` bytes out from byte `offset`.
    pub(crate) fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let at = self.at(offset, out.len())?;
        // SAFETY: in range (checked); `out` is ordinary host memory, not overlapping.
        unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    /// The region of a mapped allocation, or the error for device memory.
    pub(crate) fn of(region: &Option<HostRegion>) -> Result<&HostRegion> {
        region.as_ref().ok_or_else(|| crate::error::HalError::Unsupported("host access to device memory".into()))
    }
}

#[enum_dispatch]
pub(crate) trait MemOps {
    fn addr(&self) -> u64;
    /// Host-side write of `data` at byte `offset` of a mapped allocation (in range: the front end
    /// checks); device memory refuses.
    fn host_write(&self, offset: usize, data: &[u8]) -> Result<()>;
    /// Host-side read into `out` from byte `offset` of a mapped allocation.
    fn host_read(&self, offset: usize, out: &mut [u8]) -> Result<()>;
}

#[enum_dispatch(MemOps)]
pub(crate) enum MemImpl {
    Cpu(CpuMem),
    #[cfg(feature = "cuda")]
    Cuda(CudaMem),
    #[cfg(feature = "rocm")]
    Rocm(RocmMem),
}

#[enum_dispatch]
pub(crate) trait PinnedOps {
    /// Host-side write of `data` at byte `offset`.
    fn write(&self, offset: usize, data: &[u8]);
    /// Host-side read into `out` from byte `offset`.
    fn read(&self, offset: usize, out: &mut [u8]);
}

#[enum_dispatch(PinnedOps)]
pub(crate) enum PinnedImpl {
    Cpu(CpuPinned),
    #[cfg(feature = "cuda")]
    Cuda(CudaPinned),
    #[cfg(feature = "rocm")]
    Rocm(RocmPinned),
}

#[enum_dispatch]
pub(crate) trait StreamOps {
    /// Launches with `args` already checked against `entry.params` by the front end, and
    /// `mode.cluster` checked against the device. `mode.dependent`: the launch may begin before
    /// the stream's previous kernel has finished (programmatic dependent launch; the kernel waits
    /// with `hf_grid_dependency_wait`); backends without it launch as usual. `mode.cluster > 1`:
    /// the grid's blocks run in thread-block clusters of that many consecutive blocks in x.
    fn launch(
        &self,
        kernel: &KernelImpl,
        entry: &Arc<KernelEntry>,
        cfg: &LaunchConfig,
        args: &[Arg],
        mode: LaunchMode,
    ) -> Result<()>;
    fn memset(&self, addr: u64, bytes: usize, value: u8) -> Result<()>;
    fn copy_d2d(&self, src: u64, dst: u64, bytes: usize) -> Result<()>;
    /// Copy from pageable host memory (never called during capture).
    fn copy_h2d(&self, src: &[u8], dst: u64) -> Result<()>;
    /// Copy `bytes` from pinned memory at byte `offset` to `dst`.
    fn copy_pinned_h2d(&self, src: &PinnedImpl, offset: usize, dst: u64, bytes: usize) -> Result<()>;
    /// Enqueues a copy into `dst` and waits for it (never called during capture).
    fn copy_d2h_sync(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    fn wait_event(&self, event: &EventImpl) -> Result<()>;
    fn begin_capture(&self) -> Result<()>;
    fn end_capture(&self) -> Result<GraphImpl>;
    fn abort_capture(&self) -> Result<()>;
    /// Capture fork (this stream capturing, `branch` idle): `branch` records into this stream's
    /// capture from now on, ordered after everything recorded here so far. `edge` is a fresh event
    /// the backend may use for the dependency.
    fn fork_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()>;
    /// Capture join (`branch` forked into this stream's capture): what this stream records next
    /// is ordered after everything `branch` recorded. `edge` as for `fork_capture`.
    fn join_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()>;
}

#[enum_dispatch(StreamOps)]
pub(crate) enum StreamImpl {
    Cpu(CpuStream),
    #[cfg(feature = "cuda")]
    Cuda(CudaStream),
    #[cfg(feature = "rocm")]
    Rocm(RocmStream),
}

#[enum_dispatch]
pub(crate) trait EventOps {
    fn record(&self, stream: &StreamImpl) -> Result<()>;
    fn synchronize(&self) -> Result<()>;
    /// Milliseconds from `self` to `end`, both recorded and complete.
    fn elapsed_ms(&self, end: &EventImpl) -> Result<f32>;
}

#[enum_dispatch(EventOps)]
pub(crate) enum EventImpl {
    Cpu(CpuEvent),
    #[cfg(feature = "cuda")]
    Cuda(CudaEvent),
    #[cfg(feature = "rocm")]
    Rocm(RocmEvent),
}

#[enum_dispatch]
pub(crate) trait GraphOps {
    fn replay(&self, stream: &StreamImpl) -> Result<()>;
    fn node_count(&self) -> usize;
}

#[enum_dispatch(GraphOps)]
pub(crate) enum GraphImpl {
    Cpu(CpuGraph),
    #[cfg(feature = "cuda")]
    Cuda(CudaGraph),
    #[cfg(feature = "rocm")]
    Rocm(RocmGraph),
}

#[enum_dispatch]
pub(crate) trait CommOps {
    /// Enqueues `call` (checked by the front end) on `stream`, a stream of this rank's device.
    fn collective(&self, stream: &StreamImpl, call: &CollectiveCall) -> Result<()>;
    /// How long this rank waits for the others, where the backend enforces a timeout.
    fn timeout(&self) -> Option<std::time::Duration>;
    fn set_timeout(&self, timeout: std::time::Duration);
}

/// One rank of a communicator group (ROCm has none yet: forming a group there is an error).
#[enum_dispatch(CommOps)]
pub(crate) enum CommImpl {
    Cpu(CpuComm),
    #[cfg(feature = "cuda")]
    Cuda(CudaComm),
}

/// Compiled kernel handle (no trait: the owning backend's stream matches on it).
#[derive(Clone, Debug)]
pub(crate) enum KernelImpl {
    Cpu(CpuKernel),
    #[cfg(feature = "cuda")]
    Cuda(CudaKernel),
    #[cfg(feature = "rocm")]
    Rocm(RocmKernel),
}

/// Error for a handle of one backend handed to another (the front end checks device ids first,
/// so this is a defensive check).
#[allow(dead_code)]
pub(crate) fn wrong_backend(what: &str) -> crate::HalError {
    crate::HalError::DeviceMismatch(format!("{what} belongs to another backend"))
}
