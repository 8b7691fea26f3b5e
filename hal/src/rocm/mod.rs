//! The ROCm backend: HIP and hipRTC through `cubecl-hip-sys`, loaded at run time.
//!
//! A file-for-file twin of the CUDA backend (`loader.rs`, `compile.rs`, this file), with the same
//! strategy per concept: device memory from `hipMalloc`/`hipFree` (never stream-ordered, so a
//! capture never contains memory nodes), non-blocking HAL-created streams, hipRTC code objects
//! for the device's `gfxNNN` cached per device by the front end, thread-local stream capture with
//! a scan that rejects memory alloc/free nodes, then instantiate, upload and launch. HIP's current
//! device is per thread, so every call sets it first.
//!
//! No AMD GPU is reachable where this project is built and tested: this backend is compile-checked
//! and reports [`HalError::BackendUnavailable`] cleanly when the HIP libraries are absent.

mod compile;
mod loader;

pub use compile::compile;

use std::ffi::{c_void, CStr, CString};
use std::sync::Arc;

use cubecl_hip_sys as hip;

use crate::backend::{
    wrong_backend, DeviceImpl, DeviceOps, EventImpl, EventOps, GraphImpl, GraphOps, HostRegion, KernelImpl, LaunchArg,
    MemImpl, MemOps, PinnedImpl, PinnedOps, StreamImpl, StreamOps,
};
use crate::device::{BackendKind, DeviceInfo};
use crate::error::{CaptureOp, HalError, Result};
use crate::kernel::{Arg, KernelEntry, KernelSource, LaunchConfig, LaunchMode};
use crate::stream::StreamPriority;

/// Why the ROCm backend is unusable on this machine, or `None` if HIP and hipRTC load.
pub fn unavailable_reason() -> Option<String> {
    loader::unavailable_reason()
}

fn check(call: &'static str, rc: hip::hipError_t) -> Result<()> {
    if rc == hip::HIP_SUCCESS {
        return Ok(());
    }
    // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
    let message = unsafe { CStr::from_ptr(hip::hipGetErrorString(rc)) }.to_string_lossy().into_owned();
    if rc == hip::hipError_t_hipErrorOutOfMemory {
        return Err(HalError::OutOfMemory { bytes: 0, label: call.to_string() });
    }
    Err(HalError::Driver { call, code: i64::from(rc), message })
}

#[derive(Clone, Copy)]
struct Ordinal(i32);

impl Ordinal {
    fn bind(self) -> Result<()> {
        // SAFETY: the ordinal was validated at open.
        check("hipSetDevice", unsafe { hip::hipSetDevice(self.0) })
    }
}

/// One HIP device.
pub(crate) struct RocmDevice {
    dev: Ordinal,
    arch: String,
    warp: u32,
    upload: Arc<StreamHandle>,
}

impl RocmDevice {
    pub(crate) fn open(ordinal: usize) -> Result<(DeviceImpl, DeviceInfo)> {
        if let Some(reason) = loader::unavailable_reason() {
            return Err(HalError::BackendUnavailable { backend: "rocm", reason });
        }
        let mut count = 0;
        // SAFETY: out-parameter; the libraries are loaded.
        let rc = unsafe { hip::hipGetDeviceCount(&mut count) };
        let why = match rc {
            // No GPU (or none this process may use): as plain a miss as an ordinal past the end.
            hip::hipError_t_hipErrorNoDevice => {
                count = 0;
                " (hipGetDeviceCount: hipErrorNoDevice)"
            }
            hip::hipError_t_hipErrorInsufficientDriver => {
                return Err(HalError::BackendUnavailable {
                    backend: "rocm",
                    reason: "the HIP runtime loaded but no AMD GPU driver answered (hipErrorInsufficientDriver)".into(),
                })
            }
            _ => {
                check("hipGetDeviceCount", rc)?;
                ""
            }
        };
        if ordinal >= count.max(0) as usize {
            return Err(HalError::UnknownDevice {
                name: format!("rocm:{ordinal}"),
                reason: format!("this machine has {count} HIP device(s){why}"),
            });
        }
        let dev = Ordinal(ordinal as i32);
        dev.bind()?;
        // SAFETY: the all-zero bit pattern is a valid value of this plain C struct.
        let mut prop: hip::hipDeviceProp_tR0600 = unsafe { std::mem::zeroed() };
        // SAFETY: out-parameter for a valid ordinal.
        check("hipGetDeviceProperties", unsafe { hip::hipGetDevicePropertiesR0600(&mut prop, dev.0) })?;
        // SAFETY: HIP NUL-terminates both strings within their arrays.
        let arch_full = unsafe { CStr::from_ptr(prop.gcnArchName.as_ptr()) }.to_string_lossy().into_owned();
        // SAFETY: as above.
        let name = unsafe { CStr::from_ptr(prop.name.as_ptr()) }.to_string_lossy().into_owned();
        let arch = arch_full.split(':').next().unwrap_or("gfx000").to_string();
        let warp = prop.warpSize.max(1) as u32;
        let info = DeviceInfo {
            name,
            backend: BackendKind::Rocm,
            ordinal,
            total_memory: prop.totalGlobalMem as u64,
            arch: arch.clone(),
            compute_units: prop.multiProcessorCount.max(0) as u32,
            warp_size: warp,
            max_shared_mem_per_block: u32::try_from(prop.sharedMemPerBlock).unwrap_or(u32::MAX),
            dependent_launch: false,
        };
        let upload = Arc::new(StreamHandle::new(dev, StreamPriority::Normal)?);
        Ok((DeviceImpl::Rocm(RocmDevice { dev, arch, warp, upload }), info))
    }
}

impl DeviceOps for RocmDevice {
    fn alloc(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.dev.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; owned by the returned handle.
        check("hipMalloc", unsafe { hip::hipMalloc(&mut ptr, bytes.max(256)) }).map_err(|e| match e {
            HalError::OutOfMemory { .. } => HalError::OutOfMemory { bytes, label: label.to_string() },
            other => other,
        })?;
        Ok(MemImpl::Rocm(RocmMem { dev: self.dev, ptr: DevPtr(ptr), mapped: None }))
    }

    fn alloc_mapped(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.dev.bind()?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter; page-locked and mapped, owned by the returned handle.
        check("hipHostMalloc", unsafe {
            hip::hipHostMalloc(
                &mut host,
                bytes.max(8),
                hip::hipHostMallocMapped | hip::hipHostMallocPortable | hip::hipHostMallocCoherent,
            )
        })
        .map_err(|e| match e {
            HalError::OutOfMemory { .. } => HalError::OutOfMemory { bytes, label: label.to_string() },
            other => other,
        })?;
        // SAFETY: fresh allocation of at least `bytes` bytes, freed only with the handle below.
        let mapped = unsafe { HostRegion::new(host.cast(), bytes) };
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(mapped.ptr(), 0, bytes) };
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `host` came from hipHostMalloc with the mapped flag; out-parameter. On failure
        // `mapped` is dropped with the handle below, which frees it.
        let got = check("hipHostGetDevicePointer", unsafe { hip::hipHostGetDevicePointer(&mut ptr, host, 0) });
        let mem = RocmMem { dev: self.dev, ptr: DevPtr(ptr), mapped: Some(mapped) };
        got?;
        Ok(MemImpl::Rocm(mem))
    }

    fn write_sync(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: `addr` is a live allocation of at least `data.len()` bytes; synchronised below.
        check("hipMemcpyHtoDAsync", unsafe {
            hip::hipMemcpyHtoDAsync(addr as hip::hipDeviceptr_t, data.as_ptr().cast(), data.len(), self.upload.0)
        })?;
        // SAFETY: live stream.
        check("hipStreamSynchronize", unsafe { hip::hipStreamSynchronize(self.upload.0) })
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedImpl> {
        self.dev.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter.
        check("hipHostMalloc", unsafe { hip::hipHostMalloc(&mut ptr, bytes.max(8), hip::hipHostMallocDefault) })?;
        // SAFETY: fresh allocation of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(PinnedImpl::Rocm(RocmPinned(Arc::new(PinnedHost { ptr: ptr.cast(), bytes }))))
    }

    fn create_stream(&self, priority: StreamPriority) -> Result<StreamImpl> {
        Ok(StreamImpl::Rocm(RocmStream { dev: self.dev, stream: Arc::new(StreamHandle::new(self.dev, priority)?) }))
    }

    fn create_event(&self) -> Result<EventImpl> {
        self.dev.bind()?;
        let mut ev: hip::hipEvent_t = std::ptr::null_mut();
        // SAFETY: out-parameter.
        check("hipEventCreateWithFlags", unsafe { hip::hipEventCreateWithFlags(&mut ev, hip::hipEventDefault) })?;
        Ok(EventImpl::Rocm(RocmEvent { dev: self.dev, ev }))
    }

    fn compile(&self, src: &KernelSource) -> Result<Vec<KernelImpl>> {
        let code = compile::compile(src, &self.arch, self.warp)?;
        self.dev.bind()?;
        let mut module: hip::hipModule_t = std::ptr::null_mut();
        // SAFETY: `code` is a complete code object produced by hipRTC.
        check("hipModuleLoadData", unsafe { hip::hipModuleLoadData(&mut module, code.as_ptr().cast()) })?;
        let module = Arc::new(ModuleHandle { dev: self.dev, module });
        src.entries
            .iter()
            .map(|e| {
                let name = CString::new(e.name).map_err(|_| HalError::UnknownKernel {
                    module: src.name.to_string(),
                    name: e.name.to_string(),
                    available: String::new(),
                })?;
                let mut f: hip::hipFunction_t = std::ptr::null_mut();
                // SAFETY: loaded module; valid name.
                check("hipModuleGetFunction", unsafe {
                    hip::hipModuleGetFunction(&mut f, module.module, name.as_ptr())
                })?;
                Ok(KernelImpl::Rocm(RocmKernel { _module: module.clone(), f: FnHandle(f) }))
            })
            .collect()
    }

    fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: no arguments.
        check("hipDeviceSynchronize", unsafe { hip::hipDeviceSynchronize() })
    }

    /// Unreachable through the front end, which refuses clusters on devices without them.
    fn max_active_clusters(&self, _kernel: &KernelImpl, _cfg: &LaunchConfig, _cluster: u32) -> Result<u32> {
        Ok(0)
    }
}

struct ModuleHandle {
    dev: Ordinal,
    module: hip::hipModule_t,
}
// SAFETY: module handles may be used from any thread once the device is set there.
unsafe impl Send for ModuleHandle {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for ModuleHandle {}
impl Drop for ModuleHandle {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: unloaded once, after every kernel handle that used it is gone.
            unsafe { hip::hipModuleUnload(self.module) };
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct FnHandle(hip::hipFunction_t);
// SAFETY: function handles are immutable and valid on any thread.
unsafe impl Send for FnHandle {}
// SAFETY: as above.
unsafe impl Sync for FnHandle {}

/// A kernel entry point (keeps its module loaded).
#[derive(Clone)]
pub(crate) struct RocmKernel {
    _module: Arc<ModuleHandle>,
    f: FnHandle,
}
impl std::fmt::Debug for RocmKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RocmKernel({:?})", self.f.0)
    }
}

#[derive(Clone, Copy)]
struct DevPtr(*mut c_void);
// SAFETY: a device address is plain data.
unsafe impl Send for DevPtr {}
// SAFETY: as above.
unsafe impl Sync for DevPtr {}

/// A device allocation.
pub(crate) struct RocmMem {
    dev: Ordinal,
    ptr: DevPtr,
    /// The host side of a mapped allocation (`ptr` is then its device address).
    mapped: Option<HostRegion>,
}
impl MemOps for RocmMem {
    fn addr(&self) -> u64 {
        self.ptr.0 as u64
    }
    fn host_write(&self, offset: usize, data: &[u8]) -> Result<()> {
        HostRegion::of(&self.mapped)?.write(offset, data)
    }
    fn host_read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        HostRegion::of(&self.mapped)?.read(offset, out)
    }
}
impl Drop for RocmMem {
    fn drop(&mut self) {
        match self.mapped.take() {
            Some(m) => {
                // SAFETY: allocated by hipHostMalloc, freed once; graphs that use it hold it alive.
                unsafe { hip::hipHostFree(m.ptr().cast()) };
            }
            None => {
                if self.dev.bind().is_ok() {
                    // SAFETY: allocated by hipMalloc, freed once; graphs that use it hold it alive.
                    unsafe { hip::hipFree(self.ptr.0) };
                }
            }
        }
    }
}

struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
}
// SAFETY: page-locked host memory is plain memory.
unsafe impl Send for PinnedHost {}
// SAFETY: host accesses are bounds-checked by the front end.
unsafe impl Sync for PinnedHost {}
impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by hipHostMalloc, freed once.
        unsafe { hip::hipHostFree(self.ptr.cast()) };
    }
}

/// Page-locked host memory.
#[derive(Clone)]
pub(crate) struct RocmPinned(Arc<PinnedHost>);
impl PinnedOps for RocmPinned {
    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.0.bytes, "pinned write out of range (front end checks this)");
        // SAFETY: in range (asserted); no overlap with host slices.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.0.ptr.add(offset), data.len()) };
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        assert!(offset + out.len() <= self.0.bytes, "pinned read out of range (front end checks this)");
        // SAFETY: in range (asserted).
        unsafe { std::ptr::copy_nonoverlapping(self.0.ptr.add(offset), out.as_mut_ptr(), out.len()) };
    }
}

struct StreamHandle(hip::hipStream_t);
// SAFETY: HIP streams may be used from any thread.
unsafe impl Send for StreamHandle {}
// SAFETY: as above.
unsafe impl Sync for StreamHandle {}
impl StreamHandle {
    fn new(dev: Ordinal, priority: StreamPriority) -> Result<Self> {
        dev.bind()?;
        let mut s: hip::hipStream_t = std::ptr::null_mut();
        match priority {
            StreamPriority::Normal => {
                // SAFETY: out-parameter.
                check("hipStreamCreateWithFlags", unsafe {
                    hip::hipStreamCreateWithFlags(&mut s, hip::hipStreamNonBlocking)
                })?
            }
            StreamPriority::High => {
                let (mut least, mut greatest) = (0i32, 0i32);
                // SAFETY: out-parameters; the greatest priority is the numerically lowest value.
                check("hipDeviceGetStreamPriorityRange", unsafe {
                    hip::hipDeviceGetStreamPriorityRange(&mut least, &mut greatest)
                })?;
                // SAFETY: out-parameter; `greatest` is in the device's range.
                check("hipStreamCreateWithPriority", unsafe {
                    hip::hipStreamCreateWithPriority(&mut s, hip::hipStreamNonBlocking, greatest)
                })?
            }
        }
        Ok(StreamHandle(s))
    }
}
impl Drop for StreamHandle {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe { hip::hipStreamDestroy(self.0) };
    }
}

/// A non-blocking stream.
pub(crate) struct RocmStream {
    dev: Ordinal,
    stream: Arc<StreamHandle>,
}

impl RocmStream {
    fn raw(&self) -> Result<hip::hipStream_t> {
        self.dev.bind()?;
        Ok(self.stream.0)
    }
}

impl StreamOps for RocmStream {
    fn launch(
        &self,
        kernel: &KernelImpl,
        _entry: &Arc<KernelEntry>,
        cfg: &LaunchConfig,
        args: &[Arg],
        _mode: LaunchMode, // HIP has no programmatic dependent launch (an ordinary launch); clusters are refused up front
    ) -> Result<()> {
        #[allow(unreachable_patterns)]
        let f = match kernel {
            KernelImpl::Rocm(k) => k.f.0,
            _ => return Err(wrong_backend("kernel")),
        };
        let mut values: Vec<u64> = args.iter().map(LaunchArg::slot).collect();
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| (v as *mut u64).cast::<c_void>()).collect();
        let stream = self.raw()?;
        // SAFETY: arguments checked against the declared signature; `values` outlives the call.
        check("hipModuleLaunchKernel", unsafe {
            hip::hipModuleLaunchKernel(
                f,
                cfg.grid.0,
                cfg.grid.1,
                cfg.grid.2,
                cfg.block.0,
                cfg.block.1,
                cfg.block.2,
                cfg.shared_mem_bytes,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn memset(&self, addr: u64, bytes: usize, value: u8) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let s = self.raw()?;
        // SAFETY: range checked by the front end.
        check("hipMemsetD8Async", unsafe { hip::hipMemsetD8Async(addr as hip::hipDeviceptr_t, value, bytes, s) })
    }

    fn copy_d2d(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let s = self.raw()?;
        // SAFETY: ranges checked by the front end.
        check("hipMemcpyDtoDAsync", unsafe {
            hip::hipMemcpyDtoDAsync(dst as hip::hipDeviceptr_t, src as hip::hipDeviceptr_t, bytes, s)
        })
    }

    fn copy_h2d(&self, src: &[u8], dst: u64) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let s = self.raw()?;
        // SAFETY: pageable source; synchronised so `src` may go away afterwards.
        check("hipMemcpyHtoDAsync", unsafe {
            hip::hipMemcpyHtoDAsync(dst as hip::hipDeviceptr_t, src.as_ptr().cast(), src.len(), s)
        })?;
        // SAFETY: live stream.
        check("hipStreamSynchronize", unsafe { hip::hipStreamSynchronize(s) })
    }

    fn copy_pinned_h2d(&self, src: &PinnedImpl, offset: usize, dst: u64, bytes: usize) -> Result<()> {
        #[allow(unreachable_patterns)]
        let src = match src {
            PinnedImpl::Rocm(p) => p,
            _ => return Err(wrong_backend("pinned buffer")),
        };
        if bytes == 0 {
            return Ok(());
        }
        let s = self.raw()?;
        // SAFETY: range checked; the pinned allocation outlives the copy (front end retention).
        check("hipMemcpyHtoDAsync", unsafe {
            hip::hipMemcpyHtoDAsync(dst as hip::hipDeviceptr_t, src.0.ptr.add(offset).cast(), bytes, s)
        })
    }

    fn copy_d2h_sync(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        if dst.is_empty() {
            // Nothing to copy, but the call still promises the stream's earlier work is done.
            return self.synchronize();
        }
        let s = self.raw()?;
        // SAFETY: range checked; synchronised before `dst` is returned.
        check("hipMemcpyDtoHAsync", unsafe {
            hip::hipMemcpyDtoHAsync(dst.as_mut_ptr().cast(), src as hip::hipDeviceptr_t, dst.len(), s)
        })?;
        // SAFETY: live stream.
        check("hipStreamSynchronize", unsafe { hip::hipStreamSynchronize(s) })
    }

    fn synchronize(&self) -> Result<()> {
        let s = self.raw()?;
        // SAFETY: live stream.
        check("hipStreamSynchronize", unsafe { hip::hipStreamSynchronize(s) })
    }

    fn wait_event(&self, event: &EventImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let ev = match event {
            EventImpl::Rocm(e) => e.ev,
            _ => return Err(wrong_backend("event")),
        };
        let s = self.raw()?;
        // SAFETY: live handles.
        check("hipStreamWaitEvent", unsafe { hip::hipStreamWaitEvent(s, ev, 0) })
    }

    fn begin_capture(&self) -> Result<()> {
        let s = self.raw()?;
        // SAFETY: a HAL-created stream that is not capturing.
        check("hipStreamBeginCapture", unsafe {
            hip::hipStreamBeginCapture(s, hip::hipStreamCaptureMode_hipStreamCaptureModeThreadLocal)
        })
    }

    fn end_capture(&self) -> Result<GraphImpl> {
        let s = self.raw()?;
        let mut graph: hip::hipGraph_t = std::ptr::null_mut();
        // SAFETY: the stream is capturing.
        check("hipStreamEndCapture", unsafe { hip::hipStreamEndCapture(s, &mut graph) })?;
        let mut handles = GraphHandles { dev: self.dev, graph, exec: std::ptr::null_mut() };
        let (nodes, memory_nodes) = scan_nodes(graph)?;
        if memory_nodes > 0 {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Allocate,
                detail: format!("the captured graph contains {memory_nodes} memory alloc/free node(s); it would fail on its second launch"),
            });
        }
        if nodes == 0 {
            // An empty capture replays as a no-op.
            return Ok(GraphImpl::Rocm(RocmGraph { handles, nodes }));
        }
        // Its kernels keep the priorities of the streams that captured them.
        let flags = hip::hipGraphInstantiateFlags_hipGraphInstantiateFlagUseNodePriority as u64;
        // SAFETY: complete captured graph.
        check("hipGraphInstantiateWithFlags", unsafe {
            hip::hipGraphInstantiateWithFlags(&mut handles.exec, graph, flags)
        })?;
        // SAFETY: fresh executable graph.
        check("hipGraphUpload", unsafe { hip::hipGraphUpload(handles.exec, s) })?;
        Ok(GraphImpl::Rocm(RocmGraph { handles, nodes }))
    }

    fn fork_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()> {
        edge_between(self.raw()?, rocm_stream(branch)?.raw()?, edge)
    }

    fn join_capture(&self, branch: &StreamImpl, edge: &EventImpl) -> Result<()> {
        edge_between(rocm_stream(branch)?.raw()?, self.raw()?, edge)
    }

    fn abort_capture(&self) -> Result<()> {
        let s = self.raw()?;
        let mut graph: hip::hipGraph_t = std::ptr::null_mut();
        // SAFETY: the stream is capturing; the partial graph is destroyed at once.
        let rc = unsafe { hip::hipStreamEndCapture(s, &mut graph) };
        if !graph.is_null() {
            // SAFETY: destroyed once.
            unsafe { hip::hipGraphDestroy(graph) };
        }
        if rc == hip::HIP_SUCCESS || rc == hip::hipError_t_hipErrorStreamCaptureInvalidated {
            Ok(())
        } else {
            check("hipStreamEndCapture", rc)
        }
    }
}

fn scan_nodes(graph: hip::hipGraph_t) -> Result<(usize, usize)> {
    if graph.is_null() {
        return Ok((0, 0));
    }
    let mut n = 0usize;
    // SAFETY: node count query.
    check("hipGraphGetNodes", unsafe { hip::hipGraphGetNodes(graph, std::ptr::null_mut(), &mut n) })?;
    if n == 0 {
        return Ok((0, 0));
    }
    let mut nodes: Vec<hip::hipGraphNode_t> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries.
    check("hipGraphGetNodes", unsafe { hip::hipGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n) })?;
    let mut memory = 0;
    for &node in &nodes[..n] {
        let mut t: hip::hipGraphNodeType = 0;
        // SAFETY: `node` belongs to `graph`.
        check("hipGraphNodeGetType", unsafe { hip::hipGraphNodeGetType(node, &mut t) })?;
        if t == hip::hipGraphNodeType_hipGraphNodeTypeMemAlloc || t == hip::hipGraphNodeType_hipGraphNodeTypeMemFree {
            memory += 1;
        }
    }
    Ok((n, memory))
}

struct GraphHandles {
    dev: Ordinal,
    graph: hip::hipGraph_t,
    exec: hip::hipGraphExec_t,
}
impl Drop for GraphHandles {
    fn drop(&mut self) {
        if self.dev.bind().is_err() {
            return;
        }
        // SAFETY: each handle destroyed once; nulls skipped.
        unsafe {
            if !self.exec.is_null() {
                hip::hipGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                hip::hipGraphDestroy(self.graph);
            }
        }
    }
}

/// An instantiated, uploaded graph.
pub(crate) struct RocmGraph {
    handles: GraphHandles,
    nodes: usize,
}
// SAFETY: the front end serialises replays of one graph; launching from any thread is allowed.
unsafe impl Send for RocmGraph {}
// SAFETY: as above.
unsafe impl Sync for RocmGraph {}

impl GraphOps for RocmGraph {
    fn replay(&self, stream: &StreamImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let s = match stream {
            StreamImpl::Rocm(s) => s.raw()?,
            _ => return Err(wrong_backend("stream")),
        };
        if self.handles.exec.is_null() {
            return Ok(());
        }
        // SAFETY: live executable graph; its buffers are retained by the front end.
        check("hipGraphLaunch", unsafe { hip::hipGraphLaunch(self.handles.exec, s) })
    }
    fn node_count(&self) -> usize {
        self.nodes
    }
}

/// A timing event.
pub(crate) struct RocmEvent {
    dev: Ordinal,
    ev: hip::hipEvent_t,
}
// SAFETY: HIP events may be used from any thread.
unsafe impl Send for RocmEvent {}
// SAFETY: as above.
unsafe impl Sync for RocmEvent {}
impl Drop for RocmEvent {
    fn drop(&mut self) {
        // SAFETY: destroyed once.
        unsafe { hip::hipEventDestroy(self.ev) };
    }
}

fn rocm_stream(s: &StreamImpl) -> Result<&RocmStream> {
    #[allow(unreachable_patterns)]
    match s {
        StreamImpl::Rocm(s) => Ok(s),
        _ => Err(wrong_backend("stream")),
    }
}

/// `to` waits for everything enqueued on `from` so far (in a capture: a graph edge, and `to`
/// joins the capture), through the event `edge`.
fn edge_between(from: hip::hipStream_t, to: hip::hipStream_t, edge: &EventImpl) -> Result<()> {
    #[allow(unreachable_patterns)]
    let ev = match edge {
        EventImpl::Rocm(e) => e.ev,
        _ => return Err(wrong_backend("event")),
    };
    // SAFETY: live handles of the current device (the callers bound it).
    check("hipEventRecord", unsafe { hip::hipEventRecord(ev, from) })?;
    // SAFETY: as above.
    check("hipStreamWaitEvent", unsafe { hip::hipStreamWaitEvent(to, ev, 0) })
}

impl EventOps for RocmEvent {
    fn record(&self, stream: &StreamImpl) -> Result<()> {
        #[allow(unreachable_patterns)]
        let s = match stream {
            StreamImpl::Rocm(s) => s.raw()?,
            _ => return Err(wrong_backend("stream")),
        };
        // SAFETY: live handles.
        check("hipEventRecord", unsafe { hip::hipEventRecord(self.ev, s) })
    }
    fn synchronize(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: live event.
        check("hipEventSynchronize", unsafe { hip::hipEventSynchronize(self.ev) })
    }
    fn elapsed_ms(&self, end: &EventImpl) -> Result<f32> {
        #[allow(unreachable_patterns)]
        let end = match end {
            EventImpl::Rocm(e) => e.ev,
            _ => return Err(wrong_backend("event")),
        };
        let mut ms = 0f32;
        // SAFETY: both recorded; `end` completed.
        check("hipEventElapsedTime", unsafe { hip::hipEventElapsedTime(&mut ms, self.ev, end) })?;
        Ok(ms)
    }
}
