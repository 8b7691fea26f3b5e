//! The CUDA backend: the driver API through cudarc (loaded at run time) and NVRTC.
//!
//! Strategy per concept:
//! - **Context**: the device's primary context, with cudarc's per-buffer event tracking turned off
//!   (it would insert waits on events recorded outside a capture); the HAL orders streams itself.
//!   Every call binds the context to the calling thread first.
//! - **Memory**: `cuMemAlloc`/`cuMemFree` (never stream-ordered allocation, which would create
//!   memory nodes inside a capture). Zero-byte requests allocate 256 bytes so each buffer still has
//!   a unique address. Frees that arrive during a capture are deferred by the front end.
//! - **Streams**: non-blocking streams created by the HAL; the legacy default stream is never
//!   used (it cannot be captured).
//! - **Modules**: NVRTC compiles each source once per device for `sm_XY` to CUBIN (PTX is kept
//!   and loaded if the CUBIN does not load); the front end caches modules per device.
//! - **Capture**: `cuStreamBeginCapture` (thread-local mode; the front end enforces the capture
//!   rules for every thread), `cuStreamEndCapture`, a scan that rejects graphs containing memory
//!   alloc/free nodes, `cuGraphInstantiateWithFlags`, `cuGraphUpload`; replay is `cuGraphLaunch`.
//! - **Collectives**: NCCL, opened at run time by the HAL itself (`nccl.rs` says why and where it
//!   looks), one communicator per device from `ncclCommInitAll`, each collective issued on the
//!   HAL stream (`comm.rs`).

pub(crate) mod comm;
mod compile;
mod cubin;
mod kcache;
mod loader;
mod nccl;

pub(crate) use comm::CudaComm;
pub use compile::{compile, compile_log, nvrtc_unavailable_reason, nvrtc_version, ptx_entry_waits_for_prior};
pub(crate) use compile::{compile_cached, Compiled};
pub use cubin::{kernel_resources, KernelResources};
pub use kcache::{kernel_cache_dir, KERNEL_CACHE_ENV};

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream as CuStream, DriverError};

use crate::backend::{
    wrong_backend, DeviceImpl, DeviceOps, EventImpl, EventOps, GraphImpl, GraphOps, HostRegion, KernelImpl, LaunchArg,
    MemImpl, MemOps, PinnedImpl, PinnedOps, StreamImpl, StreamOps,
};
use crate::device::{BackendKind, DeviceInfo};
use crate::error::{CaptureOp, HalError, Result};
use crate::kernel::{Arg, KernelEntry, KernelSource, LaunchConfig, LaunchMode};
use crate::stream::StreamPriority;

fn drv(call: &'static str) -> impl Fn(DriverError) -> HalError {
    move |e| match e.0 {
        sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => HalError::OutOfMemory { bytes: 0, label: call.to_string() },
        sys::cudaError_enum::CUDA_ERROR_ILLEGAL_ADDRESS
        | sys::cudaError_enum::CUDA_ERROR_LAUNCH_FAILED
        | sys::cudaError_enum::CUDA_ERROR_ECC_UNCORRECTABLE => HalError::DeviceLost(format!("{call}: {e}")),
        code => HalError::Driver { call, code: code as i64, message: e.to_string() },
    }
}

/// Why the CUDA backend is unusable on this machine, or `None` if `libcuda` and `libnvrtc` load.
pub fn unavailable_reason() -> Option<String> {
    loader::unavailable_reason()
}

/// Why NCCL (needed by [`crate::Communicator`] on CUDA devices) cannot be loaded here, with what
/// was searched, or `None` if it loads. Set `HOLDFAST_NCCL_PATH` to a `:`-separated list of
/// directories (or library files) to search first.
pub fn nccl_unavailable_reason() -> Option<String> {
    nccl::load().err()
}

/// The NCCL version code of the library collectives use (e.g. 22703 for 2.27.3), if it loads.
pub fn nccl_version() -> Option<i32> {
    nccl::load().ok().map(|n| n.version)
}

/// One CUDA device (its primary context).
pub(crate) struct CudaDevice {
    ctx: Arc<CudaContext>,
    arch: String,
    /// A stream for synchronous uploads.
    upload: Arc<CuStream>,
    /// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, bytes.
    smem_optin: i32,
    /// Compute capability major version.
    sm_major: i32,
    /// Programmatic dependent launches are issued as such (sm_90 and newer, unless
    /// [`DEPENDENT_LAUNCH_ENV`] turns them off).
    dependent_launch: bool,
}

/// Environment variable that turns programmatic dependent launch off for the process when set to
/// `off`, `0`, `false` or `no` (any case): [`crate::Stream::launch_dependent`] then issues
/// ordinary, fully ordered launches (the kernels' waits return at once). `on`, `1`, `true`, `yes`
/// or empty leave it on; any other value makes opening a CUDA device fail with an error that says
/// so. For ruling it out when chasing a bug, and for timing a step with and without it on one
/// binary.
pub const DEPENDENT_LAUNCH_ENV: &str = "HOLDFAST_DEPENDENT_LAUNCH";

/// Whether `value` (of [`DEPENDENT_LAUNCH_ENV`]) leaves programmatic dependent launch on: unset,
/// empty, `on`, `1`, `true` or `yes` do, `off`, `0`, `false` or `no` do not (any case, spaces
/// ignored); anything else is an error that says what is accepted, not a silent default.
fn dependent_launch_allowed(value: Option<&std::ffi::OsStr>) -> std::result::Result<bool, String> {
    let Some(raw) = value else { return Ok(true) };
    let v = raw.to_str().map(|v| v.trim().to_ascii_lowercase());
    match v.as_deref() {
        Some("" | "on" | "1" | "true" | "yes") => Ok(true),
        Some("off" | "0" | "false" | "no") => Ok(false),
        _ => Err(format!(
            "{DEPENDENT_LAUNCH_ENV}={raw:?} is neither on nor off (accepted: on, off, 1, 0, true, false, yes, no)"
        )),
    }
}

impl CudaDevice {
    pub(crate) fn open(ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
        if let Some(reason) = loader::unavailable_reason() {
            return Err(HalError::BackendUnavailable { backend: "cuda", reason });
        }
        let count = CudaContext::device_count().map_err(drv("cuDeviceGetCount"))?;
        if ordinal >= count.max(0) as usize {
            return Err(HalError::UnknownDevice {
                name: format!("cuda:{ordinal}"),
                reason: format!("this machine has {count} CUDA device(s)"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: no buffer has been allocated through this context yet; the HAL orders streams.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(drv("cuDeviceGetAttribute"))?;
        // sm_90 compiles for its architecture-specific target (`sm_90a`: warpgroup MMA), which
        // runs on compute capability 9.0 exactly; other devices get the portable `sm_XY`.
        let arch = if (major, minor) == (9, 0) { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv("cuDeviceGetAttribute"))?;
        let smem_optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv("cuDeviceGetAttribute"))?
            .max(0);
        let allowed = dependent_launch_allowed(std::env::var_os(DEPENDENT_LAUNCH_ENV).as_deref())
            .map_err(|reason| HalError::UnknownDevice { name: format!("cuda:{ordinal}"), reason })?;
        let dependent_launch = major >= 9 && allowed;
        let info = DeviceInfo {
            name: ctx.name().map_err(drv("cuDeviceGetName"))?,
            backend: BackendKind::Cuda,
            ordinal,
            total_memory: ctx.total_mem().map_err(drv("cuDeviceTotalMem"))? as u64,
            arch: arch.clone(),
            compute_units: sms.max(0) as u32,
            warp_size: 32,
            max_shared_mem_per_block: smem_optin as u32,
            dependent_launch,
        };
        let upload = ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        Ok((DeviceImpl::Cuda(CudaDevice { ctx, arch, upload, smem_optin, sm_major: major, dependent_launch }), info))
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    /// Page-locked host memory allocated with `flags`, and its device address.
    fn alloc_host_mapped(&self, bytes: usize, label: &str, flags: u32) -> Result<MemImpl> {
        // SAFETY: page-locked allocation; owned by the returned handle (freed with cuMemFreeHost).
        let host = unsafe { result::malloc_host(bytes.max(8), flags) }.map_err(|e| match drv("cuMemHostAlloc")(e) {
            HalError::OutOfMemory { .. } => HalError::OutOfMemory { bytes, label: label.to_string() },
            other => other,
        })?;
        // SAFETY: fresh allocation of at least `bytes` bytes, freed only with the handle below.
        let mapped = unsafe { HostRegion::new(host.cast(), bytes) };
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(mapped.ptr(), 0, bytes) };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc; out-parameter. On failure `mapped` is dropped
        // with the handle below, which frees it.
        let got = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ptr, host, 0) }.result();
        let mem = CudaMem { ctx: self.ctx.clone(), ptr, mapped: Some(mapped) };
        got.map_err(drv("cuMemHostGetDevicePointer"))?;
        Ok(MemImpl::Cuda(mem))
    }
}

impl DeviceOps for CudaDevice {
    fn alloc(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.bind()?;
        // SAFETY: the context is current; the pointer is owned by the returned handle.
        let ptr = unsafe { result::malloc_sync(bytes.max(256)) }.map_err(|e| match drv("cuMemAlloc")(e) {
            HalError::OutOfMemory { .. } => HalError::OutOfMemory { bytes, label: label.to_string() },
            other => other,
        })?;
        Ok(MemImpl::Cuda(CudaMem { ctx: self.ctx.clone(), ptr, mapped: None }))
    }

    fn alloc_mapped(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.bind()?;
        // Plain page-locked memory first (with unified addressing it is mapped already, and it is
        // what the host writes fastest); explicitly mapped memory where that has no device address.
        match self.alloc_host_mapped(bytes, label, 0) {
            Ok(mem) => Ok(mem),
            Err(oom @ HalError::OutOfMemory { .. }) => Err(oom),
            Err(_) => {
                self.alloc_host_mapped(bytes, label, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
            }
        }
    }

    fn write_sync(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `addr` is a live allocation of at least `data.len()` bytes (checked by the front
        // end); the stream is synchronised before `data` can go away.
        unsafe { result::memcpy_htod_async(addr, data, self.upload.cu_stream()) }.map_err(drv("cuMemcpyHtoDAsync"))?;
        self.upload.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedImpl> {
        self.bind()?;
        // SAFETY: plain page-locked allocation (not write-combined: the host reads it too).
        let ptr = unsafe { result::malloc_host(bytes.max(8), 0) }.map_err(drv("cuMemHostAlloc"))?;
        // SAFETY: fresh allocation of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedImpl::Cuda(CudaPinned(Arc::new(PinnedHost { ctx: self.ctx.clone(), ptr: ptr.cast(), bytes }))))
    }

    fn create_stream(&self, priority: StreamPriority) -> Result<StreamImpl> {
        let stream = match priority {
            StreamPriority::Normal => self.ctx.new_stream().map_err(drv("cuStreamCreate"))?,
            StreamPriority::High => {
                self.bind()?;
                // (least, greatest): the greatest priority is the numerically lowest value.
                let (_, greatest) = result::stream::get_priority_range().map_err(drv("cuCtxGetStreamPriorityRange"))?;
                self.ctx.new_stream_with_priority(greatest).map_err(drv("cuStreamCreateWithPriority"))?
            }
        };
        Ok(StreamImpl::Cuda(CudaStream { ctx: self.ctx.clone(), stream, dependent_launch: self.dependent_launch }))
    }

    fn create_event(&self) -> Result<EventImpl> {
        self.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(drv("cuEventCreate"))?;
        Ok(EventImpl::Cuda(CudaEvent { ctx: self.ctx.clone(), ev }))
    }

    fn compile(&self, src: &KernelSource) -> Result<Vec<KernelImpl>> {
        let compiled = compile::compile_cached(src, &self.arch, 32)?;
        self.bind()?;
        let module = load_module(&compiled.cubin).or_else(|cubin_err| {
            load_module(&compiled.ptx).map_err(|ptx_err| HalError::Compile {
                source_name: src.name.to_string(),
                arch: self.arch.clone(),
                log: format!("the CUBIN did not load ({cubin_err}) and neither did the PTX ({ptx_err})"),
            })
        })?;
        let module = Arc::new(ModuleHandle { ctx: self.ctx.clone(), module });
        let ptx = String::from_utf8_lossy(&compiled.ptx);
        src.entries
            .iter()
            .map(|e| {
                let name = CString::new(e.name).map_err(|_| HalError::UnknownKernel {
                    module: src.name.to_string(),
                    name: e.name.to_string(),
                    available: String::new(),
                })?;
                // SAFETY: the module is loaded in the current context.
                let f =
                    unsafe { result::module::get_function(module.module, name) }.map_err(drv("cuModuleGetFunction"))?;
                // Opt in to the device's whole dynamic shared memory (the default stops at 48 KiB);
                // launches are checked against `DeviceInfo::max_shared_mem_per_block` up front.
                use sys::CUfunction_attribute_enum as A;
                // SAFETY: `f` was just returned by the driver for a loaded module.
                let fixed =
                    unsafe { result::function::get_function_attribute(f, A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) }
                        .map_err(drv("cuFuncGetAttribute"))?;
                let dynamic = (self.smem_optin - fixed).max(0);
                // SAFETY: as above; the value is within the device's opt-in limit.
                unsafe {
                    result::function::set_function_attribute(
                        f,
                        A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        dynamic,
                    )
                }
                .map_err(drv("cuFuncSetAttribute"))?;
                if self.sm_major >= 9 {
                    // Clusters past the portable 8 blocks (up to MAX_CLUSTER_BLOCKS) where they fit.
                    // SAFETY: as above; sm_90 and newer accept the attribute.
                    unsafe {
                        result::function::set_function_attribute(
                            f,
                            A::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                            1,
                        )
                    }
                    .map_err(drv("cuFuncSetAttribute"))?;
                }
                let waits_for_prior = ptx_entry_waits_for_prior(&ptx, e.name);
                Ok(KernelImpl::Cuda(CudaKernel { _module: module.clone(), f: FnHandle(f), waits_for_prior }))
            })
            .collect()
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx.synchronize().map_err(drv("cuCtxSynchronize"))
    }

    fn max_active_clusters(&self, kernel: &KernelImpl, cfg: &LaunchConfig, cluster: u32) -> Result<u32> {
        #[allow(unreachable_patterns)]
        let f = match kernel {
            KernelImpl::Cuda(k) => k.f.0,
            _ => return Err(wrong_backend("kernel")),
        };
        self.bind()?;
        let mut attr = cluster_attribute(cluster);
        let config = sys::CUlaunchConfig {
            gridDimX: cluster,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: cfg.block.0,
            blockDimY: cfg.block.1,
            blockDimZ: cfg.block.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: `f` belongs to this (current) context; `config` and `attr` outlive the call;
        // out-parameter.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, f, &config) }
            .result()
            .map_err(drv("cuOccupancyMaxActiveClusters"))?;
        Ok(u32::try_from(n).unwrap_or(0))
    }
}

/// The launch attribute grouping a grid's blocks into clusters of `cluster` consecutive blocks in x.
fn cluster_attribute(cluster: u32) -> sys::CUlaunchAttribute {
    // SAFETY: a plain C struct (an id, padding and a union of plain values): all-zero is valid.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 };
    attr
}

fn load_module(image: &[u8]) -> std::result::Result<sys::CUmodule, DriverError> {
    if image.is_empty() {
        return Err(DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_IMAGE));
    }
    // SAFETY: `image` is a complete CUBIN or NUL-terminated PTX produced by NVRTC.
    unsafe { result::module::load_data(image.as_ptr().cast()) }
}

struct ModuleHandle {
    ctx: Arc<CudaContext>,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule handle may be used from any thread once the context is current there.
unsafe impl Send for ModuleHandle {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for ModuleHandle {}

impl Drop for ModuleHandle {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: loaded once, unloaded once, after every kernel handle that used it is gone.
            let _ = unsafe { result::module::unload(self.module) };
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct FnHandle(sys::CUfunction);
// SAFETY: CUfunction handles are immutable and valid on any thread with the context current.
unsafe impl Send for FnHandle {}
// SAFETY: as above.
unsafe impl Sync for FnHandle {}

/// A kernel entry point (keeps its module loaded).
#[derive(Clone)]
pub(crate) struct CudaKernel {
    _module: Arc<ModuleHandle>,
    f: FnHandle,
    /// Its code waits for the kernel before it (`griddepcontrol.wait`), so it may be launched as a
    /// programmatic dependent launch.
    waits_for_prior: bool,
}

impl std::fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaKernel({:?})", self.f.0)
    }
}

/// A device allocation.
pub(crate) struct CudaMem {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    /// The host side of a mapped allocation (`ptr` is then its device address).
    mapped: Option<HostRegion>,
}

impl MemOps for CudaMem {
    fn addr(&self) -> u64 {
        self.ptr
    }
    fn host_write(&self, offset: usize, data: &[u8]) -> Result<()> {
        HostRegion::of(&self.mapped)?.write(offset, data)
    }
    fn host_read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        HostRegion::of(&self.mapped)?.read(offset, out)
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            match self.mapped.take() {
                Some(m) => {
                    // SAFETY: allocated by `cuMemHostAlloc`, freed once; graphs that use it hold
                    // it alive.
                    let _ = unsafe { result::free_host(m.ptr().cast()) };
                }
                None => {
                    // SAFETY: allocated by `cuMemAlloc`, freed once; graphs that use it hold it alive.
                    let _ = unsafe { result::free_sync(self.ptr) };
                }
            }
        }
    }
}

struct PinnedHost {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: page-locked host memory is plain memory, usable from any thread.
unsafe impl Send for PinnedHost {}
// SAFETY: host-side accesses go through `write`/`read` with bounds checked by the front end.
unsafe impl Sync for PinnedHost {}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc`, freed once, after every graph copying from it.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// Page-locked host memory.
#[derive(Clone)]
pub(crate) struct CudaPinned(Arc<PinnedHost>);

impl PinnedOps for CudaPinned {
    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.0.bytes, "pinned write out of range (front end checks this)");
        // SAFETY: in range (asserted); `data` is ordinary host memory, not overlapping.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.0.ptr.add(offset), data.len()) };
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.0.bytes, "pinned read out of range (front end checks this)");
        // SAFETY: in range (asserted).
        unsafe { std::ptr::copy_nonoverlapping(self.0.ptr.add(offset), out.as_mut_ptr(), out.len()) };
    }
}

/// A non-blocking stream.
pub(crate) struct CudaStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CuStream>,
    /// Dependent launches are issued as such: sm_90 and newer, unless [`DEPENDENT_LAUNCH_ENV`]
    /// turns them off.
    dependent_launch: bool,
}

impl CudaStream {
    fn raw(&self) -> Result<sys::CUstream> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        Ok(self.stream.cu_stream())
    }
}

impl StreamOps for CudaStream {
    fn launch(
        &self,
        kernel: &KernelImpl,
        entry: &Arc<KernelEntry>,
        cfg: &LaunchConfig,
        args: &[Arg],
        mode: LaunchMode,
    ) -> Result<()> {
        #[allow(unreachable_patterns)]
        let (f, waits_for_prior) = match kernel {
            KernelImpl::Cuda(k) => (k.f.0, k.waits_for_prior),
            _ => return Err(wrong_backend("kernel")),
        };
        if mode.dependent && self.dependent_launch && !waits_for_prior {
            // It would run beside the kernel before it with nothing ordering their memory.
            return Err(HalError::InvalidLaunch {
                kernel: entry.name.to_string(),
                detail: "a dependent launch of a kernel that never waits for the kernel before it (no \
                         hf_grid_dependency_wait() in its code): add the wait before its first memory \
                         access, or launch it with Stream::launch"
                    .to_string(),
            });
        }
        // Each parameter points at its own 8-byte slot; 4-byte parameters read the low half,
        // which is where little-endian stores put them. Up to 32 arguments stay on the stack.
        let mut stack_values = [0u64; 32];
        let mut heap_values;
        let values: &mut [u64] = if args.len() <= stack_values.len() {
            &mut stack_values[..args.len()]
        } else {
            heap_values = vec![0u64; args.len()];
            &mut heap_values
        };
        for (slot, a) in values.iter_mut().zip(args) {
            *slot = LaunchArg::slot(a);
        }
        let mut stack_params = [std::ptr::null_mut::<c_void>(); 32];
        let mut heap_params;
        let params: &mut [*mut c_void] = if args.len() <= stack_params.len() {
            &mut stack_params[..args.len()]
        } else {
            heap_params = vec![std::ptr::null_mut::<c_void>(); args.len()];
            &mut heap_params
        };
        for (p, v) in params.iter_mut().zip(values.iter_mut()) {
            *p = (v as *mut u64).cast::<c_void>();
        }
        let stream = self.raw()?;
        // SAFETY: plain C structs (an id, padding and a union of plain values): all-zero is valid.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n_attrs = 0usize;
        if mode.dependent && self.dependent_launch {
            attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs].value.programmaticStreamSerializationAllowed = 1;
            n_attrs += 1;
        }
        if mode.cluster > 1 {
            attrs[n_attrs] = cluster_attribute(mode.cluster);
            n_attrs += 1;
        }
        if n_attrs > 0 {
            let config = sys::CUlaunchConfig {
                gridDimX: cfg.grid.0,
                gridDimY: cfg.grid.1,
                gridDimZ: cfg.grid.2,
                blockDimX: cfg.block.0,
                blockDimY: cfg.block.1,
                blockDimZ: cfg.block.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream,
                attrs: attrs.as_mut_ptr(),
                numAttrs: n_attrs as u32,
            };
            // SAFETY: as below; `config` and `attrs` outlive the call.
            return unsafe { sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut()) }
                .result()
                .map_err(drv("cuLaunchKernelEx"));
        }
        // SAFETY: `f` belongs to this context; argument count and types were checked against the
        // declared signature; `values` outlives the call (the driver copies parameters).
        unsafe { result::launch_kernel(f, cfg.grid, cfg.block, cfg.shared_mem_bytes, stream, params) }
            .map_err(drv("cuLaunchKernel"))
    }

    fn memset(&self, addr: u64, bytes: usize, value: u8) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.raw()?;
        // SAFETY: range checked by the front end.
        unsafe { result::memset_d8_async(addr, value, bytes, stream) }.map_err(drv("cuMemsetD8Async"))
    }

    fn copy_d2d(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.raw()?;
        // SAFETY: ranges checked by the front end.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream) }.map_err(drv("cuMemcpyDtoDAsync"))
    }

    fn copy_h2d(&self, src: &[u8], dst: u64) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let stream = self.raw()?;
        // SAFETY: pageable source: the driver stages it before returning, so `src` may go away.
        unsafe { result::memcpy_htod_async(dst, src, stream) }.map_err(drv("cuMemcpyHtoDAsync"))
    }

    fn copy_pinned_h2d(&self, src: &PinnedImpl, offset: usize, dst: u64, bytes: usize) -> Result<()> {
        #[allow(unreachable_patterns)]
        let src = match src {
            PinnedImpl::Cuda(p) => p,
            _ => return Err(wrong_backend("pinned buffer")),
        };
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.raw()?;
        // SAFETY: the pinned range was checked by the front end, which (and any graph recording
        // this copy) keeps the pinned allocation alive until the copy has run.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.0.ptr.add(offset).cast(), bytes, stream) }
            .result()
            .map_err(drv("cuMemcpyHtoDAsync"))
    }

    fn copy_d2h_sync(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            // Nothing to copy, but the call still promises the stream's earlier work is done.
            return self.stream.synchronize().map_err(drv("cuStreamSynchronize"));
        }
        let stream = self.raw()?;
        // SAFETY: range checked by the front end; synchronised before `dst` is returned.
        unsafe { result::memcpy_dtoh_async(dst, src, stream) }.map_err(drv("cuMemcpyDtoHAsync"))?;
        self.stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("cuStreamSynchronize"))
    }

    fn wait_event(&self, event: &EventImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let ev = match event {
            EventImpl::Cuda(e) => e.ev,
            _ => return Err(wrong_backend("event")),
        };
        let stream = self.raw()?;
        // SAFETY: both handles belong to this context.
        unsafe { result::stream::wait_event(stream, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(drv("cuStreamWaitEvent"))
    }

    fn begin_capture(&self) -> Result<()> {
        let stream = self.raw()?;
        // SAFETY: a HAL-created (non-legacy) stream that is not capturing (front end state).
        unsafe { result::stream::begin_capture(stream, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(drv("cuStreamBeginCapture"))
    }

    fn end_capture(&self) -> Result<GraphImpl> {
        let stream = self.raw()?;
        // SAFETY: the stream is capturing (front end state).
        let graph = unsafe { result::stream::end_capture(stream) }.map_err(drv("cuStreamEndCapture"))?;
        let g = GraphHandles { ctx: self.ctx.clone(), graph, exec: std::ptr::null_mut() };
        let (nodes, memory_nodes) = scan_nodes(graph)?;
        if memory_nodes > 0 {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Allocate,
                detail: format!("the captured graph contains {memory_nodes} memory alloc/free node(s); it would fail on its second launch"),
            });
        }
        let mut g = g;
        if nodes == 0 {
            // An empty capture replays as a no-op (the driver does not instantiate empty graphs).
            return Ok(GraphImpl::Cuda(CudaGraph { handles: g, nodes }));
        }
        // Its kernels keep the priorities of the streams that captured them (copied into the
        // nodes during capture).
        let flags = sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
        // SAFETY: `graph` is a complete captured graph.
        g.exec = unsafe { result::graph::instantiate(graph, flags) }.map_err(drv("cuGraphInstantiateWithFlags"))?;
        // SAFETY: fresh executable graph, uploaded on the capturing stream.
        unsafe { result::graph::upload(g.exec, stream) }.map_err(drv("cuGraphUpload"))?;
        Ok(GraphImpl::Cuda(CudaGraph { handles: g, nodes }))
    }

    fn fork_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()> {
        edge_between(self.raw()?, cuda_stream(branch)?.raw()?, edge)
    }

    fn join_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()> {
        edge_between(cuda_stream(branch)?.raw()?, self.raw()?, edge)
    }

    fn abort_capture(&self) -> Result<()> {
        let stream = self.raw()?;
        // SAFETY: the stream is capturing; the partial graph is destroyed at once.
        match unsafe { result::stream::end_capture(stream) } {
            Ok(graph) if !graph.is_null() => {
                // SAFETY: destroyed exactly once.
                let _ = unsafe { result::graph::destroy(graph) };
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => Ok(()),
            Err(e) => Err(drv("cuStreamEndCapture")(e)),
        }
    }
}

fn cuda_stream(s: &StreamImpl) -> Result<&CudaStream> {
    #[allow(unreachable_patterns)]
    match s {
        StreamImpl::Cuda(s) => Ok(s),
        _ => Err(wrong_backend("stream")),
    }
}

/// `to` waits for everything enqueued on `from` so far (in a capture: a graph edge, and `to`
/// joins the capture), through the event `edge`.
fn edge_between(from: sys::CUstream, to: sys::CUstream, edge: &EventImpl) -> Result<()> {
    #[allow(unreachable_patterns)]
    let ev = match edge {
        EventImpl::Cuda(e) => e.ev,
        _ => return Err(wrong_backend("event")),
    };
    // SAFETY: all three handles belong to the current context (the callers bound it).
    unsafe { result::event::record(ev, from) }.map_err(drv("cuEventRecord"))?;
    // SAFETY: as above.
    unsafe { result::stream::wait_event(to, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
        .map_err(drv("cuStreamWaitEvent"))
}

/// Counts the nodes of `graph` and how many of them are memory alloc/free nodes.
fn scan_nodes(graph: sys::CUgraph) -> Result<(usize, usize)> {
    if graph.is_null() {
        return Ok((0, 0));
    }
    let mut n = 0usize;
    // SAFETY: query the node count.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }.result().map_err(drv("cuGraphGetNodes"))?;
    if n == 0 {
        return Ok((0, 0));
    }
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) }.result().map_err(drv("cuGraphGetNodes"))?;
    let mut memory = 0;
    for &node in &nodes[..n] {
        let mut t = std::mem::MaybeUninit::<sys::CUgraphNodeType>::uninit();
        // SAFETY: `node` belongs to `graph`.
        unsafe { sys::cuGraphNodeGetType(node, t.as_mut_ptr()) }.result().map_err(drv("cuGraphNodeGetType"))?;
        // SAFETY: initialised by the successful call above.
        let t = unsafe { t.assume_init() };
        if matches!(
            t,
            sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC | sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE
        ) {
            memory += 1;
        }
    }
    Ok((n, memory))
}

struct GraphHandles {
    ctx: Arc<CudaContext>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

impl Drop for GraphHandles {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: each handle is destroyed exactly once; null handles are skipped.
        unsafe {
            if !self.exec.is_null() {
                let _ = result::graph::exec_destroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = result::graph::destroy(self.graph);
            }
        }
    }
}

/// An instantiated, uploaded graph.
pub(crate) struct CudaGraph {
    handles: GraphHandles,
    nodes: usize,
}

// SAFETY: the front end serialises replays of one graph (it holds a lock across `replay`), and
// launching an executable graph from any thread with the context current is allowed.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl GraphOps for CudaGraph {
    fn replay(&self, stream: &StreamImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let stream = match stream {
            StreamImpl::Cuda(s) => s.raw()?,
            _ => return Err(wrong_backend("stream")),
        };
        if self.handles.exec.is_null() {
            return Ok(());
        }
        // SAFETY: `exec` is live; every buffer it references is retained by the front end's Graph.
        unsafe { result::graph::launch(self.handles.exec, stream) }.map_err(drv("cuGraphLaunch"))
    }
    fn node_count(&self) -> usize {
        self.nodes
    }
}

/// A timing event.
pub(crate) struct CudaEvent {
    ctx: Arc<CudaContext>,
    ev: sys::CUevent,
}

// SAFETY: CUevent handles may be used from any thread with the context current.
unsafe impl Send for CudaEvent {}
// SAFETY: as above.
unsafe impl Sync for CudaEvent {}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: destroyed exactly once.
            let _ = unsafe { result::event::destroy(self.ev) };
        }
    }
}

impl EventOps for CudaEvent {
    fn record(&self, stream: &StreamImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let stream = match stream {
            StreamImpl::Cuda(s) => s.raw()?,
            _ => return Err(wrong_backend("stream")),
        };
        // SAFETY: both handles belong to this context.
        unsafe { result::event::record(self.ev, stream) }.map_err(drv("cuEventRecord"))
    }
    fn synchronize(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: live event.
        unsafe { result::event::synchronize(self.ev) }.map_err(drv("cuEventSynchronize"))
    }
    fn elapsed_ms(&self, end: &EventImpl) -> Result<f32> {
        #[allow(unreachable_patterns)]
        let end = match end {
            EventImpl::Cuda(e) => e.ev,
            _ => return Err(wrong_backend("event")),
        };
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: both events were recorded and `end` has completed (front end synchronises it).
        unsafe { result::event::elapsed(self.ev, end) }.map_err(drv("cuEventElapsedTime"))
    }
}

#[cfg(test)]
mod tests {
    use super::dependent_launch_allowed;
    use std::ffi::OsStr;

    #[test]
    fn dependent_launch_is_on_unless_turned_off_and_a_typo_is_an_error() {
        for off in ["off", "0", "false", "no", " OFF ", "False"] {
            assert_eq!(dependent_launch_allowed(Some(OsStr::new(off))), Ok(false), "{off:?}");
        }
        for on in ["on", "1", "", "yes", " True"] {
            assert_eq!(dependent_launch_allowed(Some(OsStr::new(on))), Ok(true), "{on:?}");
        }
        assert_eq!(dependent_launch_allowed(None), Ok(true));
        for typo in ["of", "disable", "2"] {
            let e = dependent_launch_allowed(Some(OsStr::new(typo))).expect_err(typo);
            assert!(e.contains("HOLDFAST_DEPENDENT_LAUNCH") && e.contains(typo) && e.contains("accepted"), "{e}");
        }
    }
}
