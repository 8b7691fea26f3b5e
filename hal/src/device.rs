//! Devices: opening by name, device info, allocation, modules, stats.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{DeviceImpl, DeviceOps, MemImpl};
use crate::dtype::Element;
use crate::error::{CaptureOp, HalError, Result};
use crate::kernel::{Kernel, KernelSource, LaunchConfig, Module};
use crate::memory::{Allocation, Buffer, MappedBuffer, MemStats, PinnedAlloc, PinnedBuffer};
use crate::stream::{Event, Stream, StreamPriority};

/// Which backend a device runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The CPU emulator (always compiled).
    Cpu,
    /// NVIDIA GPUs through the CUDA driver API and NVRTC (feature `cuda`).
    Cuda,
    /// AMD GPUs through HIP and hipRTC (feature `rocm`).
    Rocm,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Rocm => "rocm",
        })
    }
}

/// A parsed device name: `cpu`, `cuda:N` or `rocm:N` (`cuda`/`rocm` alone mean ordinal 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceName {
    /// The backend.
    pub backend: BackendKind,
    /// The device ordinal within the backend (0 for `cpu`).
    pub ordinal: usize,
}

impl FromStr for DeviceName {
    type Err = HalError;
    fn from_str(s: &str) -> Result<Self> {
        let unknown = |reason: &str| HalError::UnknownDevice { name: s.to_string(), reason: reason.to_string() };
        let lower = s.trim().to_ascii_lowercase();
        let (head, ordinal) = match lower.split_once(':') {
            Some((h, n)) => {
                let n =
                    n.parse::<usize>().map_err(|_| unknown("the part after `:` must be a device ordinal such as 0"))?;
                (h.to_string(), n)
            }
            None => (lower.clone(), 0),
        };
        let backend = match head.as_str() {
            "cpu" => BackendKind::Cpu,
            "cuda" => BackendKind::Cuda,
            "rocm" | "hip" => BackendKind::Rocm,
            _ => return Err(unknown("expected `cpu`, `cuda:N` or `rocm:N`")),
        };
        if backend == BackendKind::Cpu && ordinal != 0 {
            return Err(unknown("there is one cpu device: `cpu` (or `cpu:0`)"));
        }
        Ok(DeviceName { backend, ordinal })
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.backend {
            BackendKind::Cpu => f.write_str("cpu"),
            b => write!(f, "{b}:{}", self.ordinal),
        }
    }
}

/// What a device is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: String,
    /// The backend.
    pub backend: BackendKind,
    /// Ordinal within the backend.
    pub ordinal: usize,
    /// Total device memory, bytes.
    pub total_memory: u64,
    /// Compilation target: `sm_90a` (compute capability 9.0), `sm_80`, `gfx90a`, or `cpu`.
    pub arch: String,
    /// Streaming multiprocessors / compute units (host threads for the CPU backend).
    pub compute_units: u32,
    /// Warp (NVIDIA: 32) or wavefront (CDNA: 64) width; 1 on the CPU backend.
    pub warp_size: u32,
    /// Most dynamic shared memory one block may use, bytes (NVIDIA: the opt-in limit, which the
    /// HAL enables on every kernel it loads; 227 KiB on sm_90). The CPU backend reports the sm_90
    /// figure, so launches it accepts are launches an sm_90 GPU accepts.
    pub max_shared_mem_per_block: u32,
    /// Whether [`crate::Stream::launch_dependent`] issues programmatic dependent launches here
    /// (CUDA, compute capability 9.0 and newer, unless `HOLDFAST_DEPENDENT_LAUNCH=off`); where
    /// `false` (the CPU and ROCm backends, older GPUs) it is an ordinary launch.
    pub dependent_launch: bool,
}

impl DeviceInfo {
    /// Whether the device runs bf16 `mma.sync` (NVIDIA `sm_80` and later): the condition under
    /// which kernel sources see `HF_HAS_MMA` (portability.h).
    pub fn has_bf16_mma(&self) -> bool {
        self.backend == BackendKind::Cuda && self.sm().is_some_and(|v| v >= 80)
    }

    /// Whether kernel sources see `HF_HAS_WGMMA` (portability.h): warpgroup MMA, compiled for the
    /// architecture-specific `sm_90a` target of compute capability 9.0 (H100, H200).
    pub fn has_wgmma(&self) -> bool {
        self.backend == BackendKind::Cuda && self.arch == "sm_90a"
    }

    /// Whether the device runs thread-block clusters ([`crate::Stream::launch_cluster`]): NVIDIA
    /// `sm_90` and later, and the CPU backend, which stands for such a device (the condition under
    /// which kernel sources see `HF_HAS_CLUSTERS` on a GPU).
    pub fn has_clusters(&self) -> bool {
        match self.backend {
            BackendKind::Cpu => true,
            BackendKind::Cuda => self.sm().is_some_and(|v| v >= 90),
            BackendKind::Rocm => false,
        }
    }

    /// The NVIDIA compute capability of `sm_XY` as `XY`.
    fn sm(&self) -> Option<u32> {
        self.arch
            .strip_prefix("sm_")
            .and_then(|v| v.trim_end_matches(|c: char| c.is_ascii_alphabetic()).parse::<u32>().ok())
    }
}

/// Dynamic shared memory limit per block of sm_90 (H100/H200), bytes; the CPU backend's figure.
pub const SM90_MAX_SHARED_MEM_PER_BLOCK: u32 = 227 * 1024;

#[derive(Default)]
pub(crate) struct Stats {
    live_allocations: AtomicU64,
    live_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    total_allocations: AtomicU64,
    pinned_bytes: AtomicU64,
    pub(crate) host_syncs: AtomicU64,
}

impl Stats {
    pub(crate) fn on_alloc(&self, bytes: usize) {
        self.live_allocations.fetch_add(1, Ordering::Relaxed);
        self.total_allocations.fetch_add(1, Ordering::Relaxed);
        let live = self.live_bytes.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak_bytes.fetch_max(live, Ordering::Relaxed);
    }
    pub(crate) fn on_free(&self, bytes: usize) {
        self.live_allocations.fetch_sub(1, Ordering::Relaxed);
        self.live_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn on_pinned_alloc(&self, bytes: usize) {
        self.pinned_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn on_pinned_free(&self, bytes: usize) {
        self.pinned_bytes.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
    pub(crate) fn on_host_sync(&self) {
        self.host_syncs.fetch_add(1, Ordering::Relaxed);
    }
}

/// State shared by a device and every object created from it.
pub(crate) struct DeviceShared {
    pub(crate) id: u64,
    pub(crate) info: DeviceInfo,
    pub(crate) inner: DeviceImpl,
    pub(crate) stats: Stats,
    /// Number of streams of this device currently capturing.
    capturing: AtomicUsize,
    /// Frees that arrived while a capture was active; released when the last capture ends.
    deferred: Mutex<Vec<MemImpl>>,
    modules: Mutex<HashMap<(&'static str, u64), Module>>,
    next_id: AtomicU64,
}

impl DeviceShared {
    pub(crate) fn capture_active(&self) -> bool {
        self.capturing.load(Ordering::Acquire) > 0
    }
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
    pub(crate) fn capture_started(&self) {
        self.capturing.fetch_add(1, Ordering::AcqRel);
    }
    pub(crate) fn capture_finished(&self) {
        if self.capturing.fetch_sub(1, Ordering::AcqRel) == 1 {
            let released = std::mem::take(&mut *lock(&self.deferred));
            drop(released);
        }
    }
    /// Frees backend memory now, or later if a capture is active.
    pub(crate) fn release(&self, mem: MemImpl) {
        if self.capture_active() {
            lock(&self.deferred).push(mem);
        } else {
            drop(mem);
        }
    }
    /// Fails with `IllegalDuringCapture` if any stream of the device is capturing.
    pub(crate) fn forbid_during_capture(&self, op: CaptureOp, detail: impl FnOnce() -> String) -> Result<()> {
        if self.capture_active() {
            return Err(HalError::IllegalDuringCapture { op, detail: detail() });
        }
        Ok(())
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it (the HAL's
/// own critical sections leave the data consistent at every point).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

/// A device opened by name. Cheap to clone; all clones are the same device.
#[derive(Clone)]
pub struct Device {
    pub(crate) shared: Arc<DeviceShared>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({} {:?}, arch {})", self.shared.info.backend, self.shared.info.name, self.shared.info.arch)
    }
}

impl Device {
    /// Opens `cpu`, `cuda:N` or `rocm:N`.
    ///
    /// Errors: [`HalError::UnknownDevice`] for a malformed name or a missing ordinal,
    /// [`HalError::BackendNotCompiled`] when the backend's feature is off, and
    /// [`HalError::BackendUnavailable`] when its driver library cannot be loaded.
    pub fn open(name: &str) -> Result<Device> {
        let parsed: DeviceName = name.parse()?;
        let (inner, info) = match parsed.backend {
            BackendKind::Cpu => crate::cpu::CpuDevice::open()?,
            BackendKind::Cuda => open_cuda(name, parsed.ordinal)?,
            BackendKind::Rocm => open_rocm(name, parsed.ordinal)?,
        };
        Ok(Device {
            shared: Arc::new(DeviceShared {
                id: NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed),
                info,
                inner,
                stats: Stats::default(),
                capturing: AtomicUsize::new(0),
                deferred: Mutex::new(Vec::new()),
                modules: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
            }),
        })
    }

    /// The CPU device (never fails in practice; returns `Result` for uniformity).
    pub fn cpu() -> Result<Device> {
        Device::open("cpu")
    }

    /// Process-unique id of this device.
    pub fn id(&self) -> u64 {
        self.shared.id
    }
    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.shared.info
    }
    /// Its backend.
    pub fn backend(&self) -> BackendKind {
        self.shared.info.backend
    }
    /// True while any stream of the device is capturing.
    pub fn is_capturing(&self) -> bool {
        self.shared.capture_active()
    }

    /// Memory and synchronisation counters.
    pub fn stats(&self) -> MemStats {
        let s = &self.shared.stats;
        MemStats {
            live_allocations: s.live_allocations.load(Ordering::Relaxed),
            live_bytes: s.live_bytes.load(Ordering::Relaxed),
            peak_bytes: s.peak_bytes.load(Ordering::Relaxed),
            total_allocations: s.total_allocations.load(Ordering::Relaxed),
            pinned_bytes: s.pinned_bytes.load(Ordering::Relaxed),
            deferred_frees: lock(&self.shared.deferred).len() as u64,
            host_syncs: s.host_syncs.load(Ordering::Relaxed),
        }
    }

    fn alloc_impl<T: Element>(&self, label: &str, len: usize, persistent: bool) -> Result<Buffer<T>> {
        let bytes = byte_size::<T>(label, len)?;
        let alloc = Allocation::new(self.shared.clone(), bytes, label, persistent)?;
        Ok(Buffer::from_alloc(alloc, len))
    }

    /// Allocates `len` elements of uninitialised (backend-defined garbage) memory, transient:
    /// it may not be used by a captured operation.
    pub fn alloc<T: Element>(&self, label: &str, len: usize) -> Result<Buffer<T>> {
        self.alloc_impl(label, len, false)
    }

    /// Allocates `len` elements of persistent (graph-stable) memory: its address is meant to be
    /// baked into graphs, so it should live as long as they do (arena buffers, weights, caches).
    pub fn alloc_persistent<T: Element>(&self, label: &str, len: usize) -> Result<Buffer<T>> {
        self.alloc_impl(label, len, true)
    }

    /// Allocates and zero-fills (synchronously).
    pub fn alloc_zeroed<T: Element>(&self, label: &str, len: usize, persistent: bool) -> Result<Buffer<T>> {
        let buf = self.alloc_impl::<T>(label, len, persistent)?;
        self.write_sync_bytes(&buf, &vec![0u8; buf.bytes()])?;
        Ok(buf)
    }

    /// Allocates and uploads `data` (synchronously).
    pub fn alloc_from_slice<T: Element>(&self, label: &str, data: &[T], persistent: bool) -> Result<Buffer<T>> {
        let buf = self.alloc_impl::<T>(label, data.len(), persistent)?;
        self.write_sync_bytes(&buf, bytemuck::cast_slice(data))?;
        Ok(buf)
    }

    /// Overwrites the whole buffer with `data`, synchronously (a host sync; setup paths only).
    pub fn write_sync<T: Element>(&self, buf: &Buffer<T>, data: &[T]) -> Result<()> {
        if data.len() != buf.len() {
            return Err(HalError::LengthMismatch { op: "write_sync", src: data.len(), dst: buf.len() });
        }
        self.write_sync_bytes(buf, bytemuck::cast_slice(data))
    }

    fn write_sync_bytes<T: Element>(&self, buf: &Buffer<T>, data: &[u8]) -> Result<()> {
        self.check_owner(buf.device_id(), buf.label())?;
        self.shared.forbid_during_capture(CaptureOp::PageableCopy, || format!("upload into `{}`", buf.label()))?;
        self.shared.inner.write_sync(buf.addr(), data)?;
        buf.alloc.bump_host_gen();
        Ok(())
    }

    /// Allocates `len` elements of pinned host memory (zero-filled).
    pub fn alloc_pinned<T: Element>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        self.shared.forbid_during_capture(CaptureOp::Allocate, || "pinned host buffer".into())?;
        let bytes = byte_size::<T>("pinned host buffer", len)?;
        let inner = self.shared.inner.alloc_pinned(bytes)?;
        self.shared.stats.on_pinned_alloc(bytes);
        Ok(PinnedBuffer::from_alloc(Arc::new(PinnedAlloc { bytes, device: self.shared.clone(), inner }), len))
    }

    /// Allocates `len` elements of zero-filled page-locked host memory mapped into the device's
    /// address space (a [`MappedBuffer`]: kernels read and write it in place, the host writes it
    /// directly). Persistent: captured work may use it.
    pub fn alloc_mapped<T: Element>(&self, label: &str, len: usize) -> Result<MappedBuffer<T>> {
        let bytes = byte_size::<T>(label, len)?;
        let alloc = Allocation::new_mapped(self.shared.clone(), bytes, label)?;
        Ok(MappedBuffer::from_alloc(alloc, len))
    }

    /// Creates an in-order stream (never the legacy default stream) at the default priority.
    pub fn create_stream(&self) -> Result<Stream> {
        self.create_stream_with_priority(StreamPriority::Normal)
    }

    /// Creates an in-order stream whose kernels are scheduled at `priority` (see
    /// [`StreamPriority`]): e.g. the branch of a captured step that is its critical path.
    pub fn create_stream_with_priority(&self, priority: StreamPriority) -> Result<Stream> {
        Ok(Stream::new(self.shared.clone(), self.shared.inner.create_stream(priority)?, priority))
    }

    /// Creates a timing-capable event.
    pub fn create_event(&self) -> Result<Event> {
        Ok(Event::new(self.shared.clone(), self.shared.inner.create_event()?))
    }

    /// Compiles `src` for this device, or returns the cached module compiled earlier from the
    /// same source (keyed by name and content hash). A cache hit is a lookup and is legal during
    /// capture; an actual compilation during capture is [`HalError::IllegalDuringCapture`]
    /// (`Compile`): compile every module before capturing.
    pub fn compile(&self, src: &KernelSource) -> Result<Module> {
        let key = (src.name, src.content_hash());
        if let Some(m) = lock(&self.shared.modules).get(&key) {
            return Ok(m.clone());
        }
        self.shared.forbid_during_capture(CaptureOp::Compile, || format!("module `{}`", src.name))?;
        src.validate()?;
        let impls = self.shared.inner.compile(src)?;
        let kernels = src
            .entries
            .iter()
            .zip(impls)
            .map(|(e, inner)| Kernel { device_id: self.shared.id, entry: Arc::new(e.clone()), inner })
            .collect();
        let module = Module { device_id: self.shared.id, source_name: src.name, kernels };
        lock(&self.shared.modules).insert(key, module.clone());
        Ok(module)
    }

    /// How many clusters of `cluster` blocks of `kernel`, each block shaped as `cfg` (its block
    /// and dynamic shared memory; the grid is ignored), this device runs at once (NVIDIA:
    /// `cuOccupancyMaxActiveClusters`, which counts the processing clusters a cluster must fit
    /// in). A grid of persistent clusters sized by it never leaves a cluster waiting for another
    /// to finish. 0 when one cluster does not fit. The CPU backend models an sm_90 device with
    /// one multiprocessor per host thread and reports at least 1 where a block fits. Refused as
    /// [`Stream::launch_cluster`] refuses: a device without clusters, a cluster size outside
    /// `1..=`[`crate::MAX_CLUSTER_BLOCKS`], a kernel of another device, an invalid block shape.
    pub fn max_active_clusters(&self, kernel: &Kernel, cfg: LaunchConfig, cluster: u32) -> Result<u32> {
        self.check_owner(kernel.device_id, kernel.name())?;
        crate::stream::check_cluster(&self.shared.info, kernel.name(), cluster)?;
        LaunchConfig { grid: (cluster, 1, 1), ..cfg }.validate(kernel.name())?;
        self.shared.inner.max_active_clusters(&kernel.inner, &cfg, cluster)
    }

    /// Number of modules in this device's cache.
    pub fn cached_modules(&self) -> usize {
        lock(&self.shared.modules).len()
    }

    /// Waits for all work on the device. Illegal during capture.
    pub fn synchronize(&self) -> Result<()> {
        self.shared.forbid_during_capture(CaptureOp::Synchronize, || "device synchronize".into())?;
        self.shared.stats.on_host_sync();
        self.shared.inner.synchronize()
    }

    pub(crate) fn check_owner(&self, device_id: u64, what: &str) -> Result<()> {
        if device_id != self.shared.id {
            return Err(HalError::DeviceMismatch(format!("`{what}` belongs to another device")));
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(_name: &str, ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
    crate::cuda::CudaDevice::open(ordinal)
}
#[cfg(not(feature = "cuda"))]
fn open_cuda(_name: &str, _ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
    Err(HalError::BackendNotCompiled { backend: "cuda", feature: "cuda" })
}
#[cfg(feature = "rocm")]
fn open_rocm(_name: &str, ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
    crate::rocm::RocmDevice::open(ordinal)
}
#[cfg(not(feature = "rocm"))]
fn open_rocm(_name: &str, _ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
    Err(HalError::BackendNotCompiled { backend: "rocm", feature: "rocm" })
}

/// Bytes of `len` elements of `T`, or [`HalError::SizeOverflow`] naming `label`.
fn byte_size<T: Element>(label: &str, len: usize) -> Result<usize> {
    len.checked_mul(T::DTYPE.size()).ok_or_else(|| HalError::SizeOverflow {
        label: label.to_string(),
        len,
        elem_bytes: T::DTYPE.size(),
    })
}
