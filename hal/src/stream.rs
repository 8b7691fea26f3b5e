//! Streams (in-order queues) and events.
//!
//! Every operation checks the capture rules of DESIGN.md 3.1 here, before any backend call, so
//! the rules and their errors are the same on every backend. Operations on a capturing stream are
//! recorded (not executed) and must only touch persistent buffers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::backend::{DeviceOps, EventImpl, EventOps, StreamImpl, StreamOps};
use crate::capture::{CaptureLog, CaptureState, CaptureStatus, ViewRecord};
use crate::device::{lock, DeviceShared};
use crate::dtype::Element;
use crate::error::{CaptureOp, HalError, Result};
use crate::graph::Graph;
use crate::kernel::{check_args, Arg, Kernel, LaunchConfig, LaunchMode, MAX_CLUSTER_BLOCKS};
use crate::memory::{PinnedBuffer, RawView, View};

/// How a stream's kernels are scheduled against other streams' kernels on the device.
///
/// The device prefers the pending blocks of higher-priority kernels to those of lower-priority
/// ones as resources free up (whether running work is preempted is up to the device), so a
/// kernel on the critical path of concurrent branches can be given the device first. A priority
/// changes when work runs, never what it computes. A captured graph's kernels keep the priority
/// of the stream that captured them, whatever stream replays the graph (CUDA copies a stream's
/// priority into the kernels it captures; a HIP runtime that does not runs them at the default).
/// The CPU emulator runs every stream in order and ignores it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StreamPriority {
    /// The default priority (0: the lowest on CUDA).
    #[default]
    Normal,
    /// The device's greatest priority.
    High,
}

/// An in-order queue of device work.
pub struct Stream {
    pub(crate) device: Arc<DeviceShared>,
    pub(crate) inner: Arc<StreamImpl>,
    id: u64,
    priority: StreamPriority,
    capture: Mutex<CaptureState>,
}

impl Drop for Stream {
    /// A stream dropped while its capture is open aborts it (releasing the streams forked into
    /// it and the device's capture rules); a forked branch dropped before its join stays alive in
    /// its capture until that ends.
    fn drop(&mut self) {
        if matches!(&*self.state(), CaptureState::Capturing(_)) {
            let _ = self.abort_capture();
        }
    }
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(device {}, {:?}, {:?})", self.device.id, self.priority, self.capture_status())
    }
}

impl Stream {
    pub(crate) fn new(device: Arc<DeviceShared>, inner: StreamImpl, priority: StreamPriority) -> Self {
        let id = device.next_id();
        Stream { device, inner: Arc::new(inner), id, priority, capture: Mutex::new(CaptureState::Idle) }
    }

    /// The priority the stream was created with.
    pub fn priority(&self) -> StreamPriority {
        self.priority
    }

    /// The id of the device this stream belongs to.
    pub fn device_id(&self) -> u64 {
        self.device.id
    }

    /// The capture state, a branch whose capture has ended settled back to idle.
    fn state(&self) -> std::sync::MutexGuard<'_, CaptureState> {
        let mut s = lock(&self.capture);
        s.settle();
        s
    }

    /// Whether the stream takes part in a capture (began it, or was forked into it and not yet
    /// released by its end), and how much that capture has recorded.
    pub fn capture_status(&self) -> CaptureStatus {
        match self.state().log() {
            None => CaptureStatus::Idle,
            Some(log) => {
                let l = lock(log);
                CaptureStatus::Capturing { label: l.label.clone(), ops: l.ops }
            }
        }
    }

    /// True while the stream takes part in a capture (see [`Stream::capture_status`]).
    pub fn is_capturing(&self) -> bool {
        self.state().log().is_some()
    }

    fn same_device(&self, v: &RawView, what: &str) -> Result<()> {
        if v.alloc.device.id != self.device.id {
            return Err(HalError::DeviceMismatch(format!("{what}: buffer `{}` belongs to another device", v.label())));
        }
        Ok(())
    }

    /// Runs the backend call `op`; while capturing, first checks that every view `uses` yields is
    /// persistent, and afterwards logs it (retention, host-refreshed reads) and calls `on_log`.
    /// `uses` is only evaluated while capturing, so eager operations allocate nothing here.
    pub(crate) fn enqueue<'v, U>(
        &self,
        what: &str,
        uses: impl Fn() -> U,
        on_log: impl FnOnce(&mut CaptureLog),
        op: impl FnOnce() -> Result<()>,
    ) -> Result<()>
    where
        U: Iterator<Item = (&'v str, &'v RawView, bool)>,
    {
        let state = self.state();
        let log = match &*state {
            CaptureState::Idle => None,
            CaptureState::Capturing(log) | CaptureState::Branch(log) => Some(log.clone()),
            CaptureState::Joined(_) => {
                return Err(HalError::CaptureTransition { attempted: "record work on", state: state.name() })
            }
        };
        if let Some(log) = log {
            let mut log = lock(&log);
            for (arg, v, _) in uses() {
                if !v.is_persistent() {
                    return Err(HalError::NotGraphStable {
                        kernel: what.to_string(),
                        arg: arg.to_string(),
                        buffer: v.label().to_string(),
                    });
                }
            }
            op()?;
            for (_, v, reads) in uses() {
                log.retain(&v.alloc);
                if reads {
                    log.note_read(&v.alloc);
                }
            }
            on_log(&mut log);
            log.ops += 1;
            Ok(())
        } else {
            drop(state);
            op()
        }
    }

    /// Launches `kernel` with `args`, checked against its declared signature.
    pub fn launch(&self, kernel: &Kernel, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        self.launch_with(kernel, cfg, args, LaunchMode::PLAIN)
    }

    /// As [`Stream::launch`], letting the kernel begin before the kernel launched before it on
    /// this stream has finished (CUDA programmatic dependent launch, sm_90 and newer; also inside
    /// a capture, as a programmatic graph edge), which hides the launch latency between
    /// back-to-back kernels. Every block of the kernel must call `hf_grid_dependency_wait()` (the
    /// portability header) before its first memory access and before any return: that call
    /// returns once the kernel before has finished and its writes are visible, and a kernel whose
    /// blocks could all end without waiting would let the kernel after it pass its own wait while
    /// the one before still runs (the chain of waits is what orders every earlier kernel). Elsewhere
    /// (other devices, HIP, the CPU backend) this is an ordinary launch and the call is a no-op.
    /// On a device where the launch is dependent, a kernel whose compiled code has no such wait is
    /// refused ([`HalError::InvalidLaunch`]; nothing runs). `HOLDFAST_DEPENDENT_LAUNCH=off` turns
    /// dependent launches into ordinary ones for the process (`cuda::DEPENDENT_LAUNCH_ENV`).
    pub fn launch_dependent(&self, kernel: &Kernel, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        self.launch_with(kernel, cfg, args, LaunchMode { dependent: true, cluster: 1 })
    }

    /// As [`Stream::launch`], with the grid's blocks grouped into thread-block clusters of
    /// `cluster` consecutive blocks in x (NVIDIA sm_90 and newer): a cluster's blocks run at the
    /// same time on one processing cluster, read each other's shared memory
    /// (`hf_cluster_load_f32`) and wait for each other (`hf_cluster_sync`, which every thread of
    /// each block reaches; see the portability header, `HF_HAS_CLUSTERS`). `cluster` must lie in
    /// `1..=`[`MAX_CLUSTER_BLOCKS`] and divide `grid.0`; capturable like any launch. On a device
    /// without clusters (HIP, NVIDIA before sm_90; [`crate::DeviceInfo::has_clusters`]) this is
    /// an [`HalError::InvalidLaunch`] and nothing runs. The CPU backend, which stands for an
    /// sm_90 device, checks the same and runs the kernel's reference as for any launch.
    pub fn launch_cluster(&self, kernel: &Kernel, cfg: LaunchConfig, cluster: u32, args: &[Arg]) -> Result<()> {
        self.cluster_launch(kernel, cfg, cluster, args, false)
    }

    /// [`Stream::launch_cluster`] as a dependent launch ([`Stream::launch_dependent`]: the kernel
    /// must wait for the kernel before it).
    pub fn launch_cluster_dependent(
        &self,
        kernel: &Kernel,
        cfg: LaunchConfig,
        cluster: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.cluster_launch(kernel, cfg, cluster, args, true)
    }

    fn cluster_launch(
        &self,
        kernel: &Kernel,
        cfg: LaunchConfig,
        cluster: u32,
        args: &[Arg],
        dependent: bool,
    ) -> Result<()> {
        check_cluster(&self.device.info, kernel.name(), cluster)?;
        if !cfg.grid.0.is_multiple_of(cluster) {
            return Err(HalError::InvalidLaunch {
                kernel: kernel.name().to_string(),
                detail: format!("grid {:?}: x must be a multiple of the cluster's {cluster} blocks", cfg.grid),
            });
        }
        self.launch_with(kernel, cfg, args, LaunchMode { dependent, cluster })
    }

    fn launch_with(&self, kernel: &Kernel, cfg: LaunchConfig, args: &[Arg], mode: LaunchMode) -> Result<()> {
        if kernel.device_id != self.device.id {
            return Err(HalError::DeviceMismatch(format!(
                "kernel `{}` was compiled for another device",
                kernel.name()
            )));
        }
        cfg.validate(kernel.name())?;
        let smem_max = self.device.info.max_shared_mem_per_block;
        if cfg.shared_mem_bytes > smem_max {
            return Err(HalError::InvalidLaunch {
                kernel: kernel.name().to_string(),
                detail: format!(
                    "{} bytes of dynamic shared memory per block; this device allows at most {smem_max}",
                    cfg.shared_mem_bytes
                ),
            });
        }
        check_args(kernel.name(), kernel.params(), args)?;
        for a in args {
            if let Arg::Ptr(v) = a {
                self.same_device(v, kernel.name())?;
            }
        }
        let uses = || {
            kernel.params().iter().zip(args).filter_map(|(p, a)| match (p.kind, a) {
                (crate::ParamKind::Ptr { access, .. }, Arg::Ptr(v)) => Some((p.name, v, access.reads())),
                _ => None,
            })
        };
        self.enqueue(kernel.name(), uses, |_| {}, || self.inner.launch(&kernel.inner, &kernel.entry, &cfg, args, mode))
    }

    /// Sets every byte of `dst` to `value`.
    pub fn memset<T: Element>(&self, dst: &View<T>, value: u8) -> Result<()> {
        let v = dst.raw();
        self.same_device(&v, "memset")?;
        self.enqueue(
            "memset",
            || [("dst", &v, false)].into_iter(),
            |_| {},
            || self.inner.memset(v.addr(), v.bytes(), value),
        )
    }

    /// Device-to-device copy of equal-length views.
    pub fn copy<T: Element>(&self, src: &View<T>, dst: &View<T>) -> Result<()> {
        if src.len() != dst.len() {
            return Err(HalError::LengthMismatch { op: "copy", src: src.len(), dst: dst.len() });
        }
        let (s, d) = (src.raw(), dst.raw());
        self.same_device(&s, "copy")?;
        self.same_device(&d, "copy")?;
        self.enqueue(
            "copy",
            || [("src", &s, true), ("dst", &d, false)].into_iter(),
            |_| {},
            || self.inner.copy_d2d(s.addr(), d.addr(), s.bytes()),
        )
    }

    /// Copies from pageable host memory. Illegal during capture (it would bake in a host pointer
    /// the driver must stage synchronously); use [`Stream::copy_from_pinned`] instead.
    pub fn copy_from_host<T: Element>(&self, src: &[T], dst: &View<T>) -> Result<()> {
        self.device.forbid_during_capture(CaptureOp::PageableCopy, || format!("into `{}`", dst.label()))?;
        if src.len() != dst.len() {
            return Err(HalError::LengthMismatch { op: "copy_from_host", src: src.len(), dst: dst.len() });
        }
        let d = dst.raw();
        self.same_device(&d, "copy_from_host")?;
        self.inner.copy_h2d(bytemuck::cast_slice(src), d.addr())?;
        d.alloc.bump_host_gen();
        Ok(())
    }

    /// Asynchronous copy of `dst.len()` elements from `src` starting at element `src_offset`.
    /// Legal during capture: the graph then reads the pinned buffer at every replay.
    pub fn copy_from_pinned<T: Element>(&self, src: &PinnedBuffer<T>, src_offset: usize, dst: &View<T>) -> Result<()> {
        src.check(src_offset, dst.len())?;
        let d = dst.raw();
        self.same_device(&d, "copy_from_pinned")?;
        if src.alloc.device.id != self.device.id {
            return Err(HalError::DeviceMismatch("copy_from_pinned: pinned buffer belongs to another device".into()));
        }
        let offset = src_offset * T::DTYPE.size();
        let capturing = self.is_capturing();
        self.enqueue(
            "copy_from_pinned",
            || [("dst", &d, false)].into_iter(),
            |log| {
                log.pinned.push(src.alloc.clone());
                log.refreshed_in_graph.insert(d.alloc.id);
                log.host_inputs.remove(&d.alloc.id);
            },
            || self.inner.copy_pinned_h2d(&src.alloc.inner, offset, d.addr(), d.bytes()),
        )?;
        if !capturing {
            d.alloc.bump_host_gen();
        }
        Ok(())
    }

    /// Reads a view back to the host, waiting for all earlier work on the stream: a host sync,
    /// illegal during capture.
    pub fn copy_to_host_sync<T: Element>(&self, src: &View<T>) -> Result<Vec<T>> {
        self.device.forbid_during_capture(CaptureOp::DeviceToHost, || format!("from `{}`", src.label()))?;
        let s = src.raw();
        self.same_device(&s, "copy_to_host_sync")?;
        let mut out = vec![T::default(); src.len()];
        self.device.stats.on_host_sync();
        self.inner.copy_d2h_sync(s.addr(), bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Waits until all work on the stream has completed. Illegal during capture.
    pub fn synchronize(&self) -> Result<()> {
        self.device.forbid_during_capture(CaptureOp::Synchronize, || "stream synchronize".into())?;
        self.device.stats.on_host_sync();
        self.inner.synchronize()
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        if self.is_capturing() {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Event,
                detail: "stream wait (order streams inside a capture with fork_capture / join_capture)".into(),
            });
        }
        self.inner.wait_event(&event.inner)
    }

    /// Starts recording: until [`Stream::end_capture`], work on this stream is recorded, not run.
    pub fn begin_capture(&self, label: &str) -> Result<()> {
        let mut state = self.state();
        // Validate the transition first so a rejected one changes nothing.
        if !matches!(&*state, CaptureState::Idle) {
            return Err(HalError::CaptureTransition { attempted: "begin capture on", state: state.name() });
        }
        self.inner.begin_capture()?;
        state.begin(label)?;
        self.device.capture_started();
        Ok(())
    }

    /// Finishes recording and returns the replayable graph. Only the stream that began the
    /// capture ends it, and only once every stream forked into it has been joined back
    /// ([`Stream::join_capture`]); the forked streams are idle again afterwards.
    pub fn end_capture(&self) -> Result<Graph> {
        let mut state = self.state();
        let CaptureState::Capturing(log) = &*state else {
            return Err(HalError::CaptureTransition { attempted: "end capture on", state: state.name() });
        };
        if !lock(log).unjoined.is_empty() {
            return Err(HalError::CaptureTransition {
                attempted: "end capture on",
                state: "capturing with a forked stream not yet joined back",
            });
        }
        let result = self.inner.end_capture();
        let log = state.finish("end capture on")?;
        drop(state);
        self.device.capture_finished();
        Ok(Graph::new(self.device.clone(), result?, log))
    }

    /// Discards the capture in progress (Capturing → Idle); nothing recorded survives. Streams
    /// forked into it and not yet joined are joined first, then released with it.
    pub fn abort_capture(&self) -> Result<()> {
        let mut state = self.state();
        let CaptureState::Capturing(log) = &*state else {
            return Err(HalError::CaptureTransition { attempted: "abort capture on", state: state.name() });
        };
        let mut result = Ok(());
        {
            let mut l = lock(log);
            let unjoined: Vec<Arc<StreamImpl>> =
                std::mem::take(&mut l.unjoined).iter().filter_map(|id| l.branches.get(id).cloned()).collect();
            for b in unjoined {
                let joined = self.device.inner.create_event().and_then(|e| {
                    self.inner.join_capture(&b, &e)?;
                    l.edges.push(e);
                    Ok(())
                });
                result = result.and(joined);
            }
        }
        let aborted = self.inner.abort_capture();
        let _log = state.finish("abort capture on")?;
        drop(state);
        self.device.capture_finished();
        result.and(aborted)
    }

    /// Forks `branch` into this stream's capture: work enqueued on `branch` from now on is recorded
    /// into the same graph, ordered after everything recorded on this stream so far, and free to
    /// run concurrently with what this stream records next. `branch` must be another idle stream
    /// of the same device (or a branch of this capture that was joined back); it follows every
    /// capture rule while forked, and must be joined back before the capture ends.
    pub fn fork_capture(&self, branch: &Stream) -> Result<()> {
        if branch.device.id != self.device.id {
            return Err(HalError::DeviceMismatch("fork_capture: the branch belongs to another device".into()));
        }
        if branch.id == self.id {
            return Err(HalError::CaptureTransition { attempted: "fork itself into", state: "capturing" });
        }
        let log = match &*self.state() {
            CaptureState::Capturing(l) | CaptureState::Branch(l) => l.clone(),
            s => return Err(HalError::CaptureTransition { attempted: "fork a branch from", state: s.name() }),
        };
        let mut b = branch.state();
        match &*b {
            CaptureState::Idle => {}
            CaptureState::Joined(l) if Arc::ptr_eq(l, &log) => {}
            s => return Err(HalError::CaptureTransition { attempted: "fork into a capture", state: s.name() }),
        }
        {
            // Under the log's lock, so the capture cannot end between the check and the fork.
            let mut l = lock(&log);
            if l.closed {
                return Err(HalError::CaptureTransition { attempted: "fork a branch from", state: "idle" });
            }
            let edge = self.device.inner.create_event()?;
            self.inner.fork_capture(&branch.inner, &edge)?;
            l.unjoined.insert(branch.id);
            l.branches.insert(branch.id, branch.inner.clone());
            l.edges.push(edge);
        }
        *b = CaptureState::Branch(log);
        Ok(())
    }

    /// Joins `branch` (forked into this stream's capture) back: what this stream records next is
    /// ordered after everything recorded on `branch`. `branch` records nothing more until it is
    /// forked again or the capture ends.
    pub fn join_capture(&self, branch: &Stream) -> Result<()> {
        let log = match &*self.state() {
            CaptureState::Capturing(l) | CaptureState::Branch(l) => l.clone(),
            s => return Err(HalError::CaptureTransition { attempted: "join a branch into", state: s.name() }),
        };
        let mut b = branch.state();
        match &*b {
            CaptureState::Branch(l) if Arc::ptr_eq(l, &log) && branch.id != self.id => {}
            s => {
                return Err(HalError::CaptureTransition {
                    attempted: "join (it is not a forked branch of this capture)",
                    state: s.name(),
                })
            }
        }
        {
            let mut l = lock(&log);
            if l.closed {
                return Err(HalError::CaptureTransition { attempted: "join a branch into", state: "idle" });
            }
            let edge = self.device.inner.create_event()?;
            self.inner.join_capture(&branch.inner, &edge)?;
            l.unjoined.remove(&branch.id);
            l.edges.push(edge);
        }
        *b = CaptureState::Joined(log);
        Ok(())
    }

    /// Names `view` as an input of the graph being captured; [`Graph::replay_with_inputs`] then
    /// requires the caller to hand the same view (address, length, type) under that name.
    pub fn bind_input(&self, name: &str, view: impl Into<RawView>) -> Result<()> {
        let view = view.into();
        let state = self.state();
        match &*state {
            CaptureState::Capturing(log) | CaptureState::Branch(log) => {
                let mut log = lock(log);
                if log.inputs.iter().any(|(n, _)| n == name) {
                    return Err(HalError::Unsupported(format!("graph input `{name}` is bound twice")));
                }
                log.inputs.push((name.to_string(), ViewRecord::of(&view)));
                log.retain(&view.alloc);
                Ok(())
            }
            s => Err(HalError::CaptureTransition { attempted: "bind a graph input on", state: s.name() }),
        }
    }

    pub(crate) fn replay_guard(&self) -> Result<()> {
        if self.is_capturing() {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Replay,
                detail: "into a capturing stream".into(),
            });
        }
        Ok(())
    }
}

/// A marker in a stream: for ordering between streams and for timing.
pub struct Event {
    device: Arc<DeviceShared>,
    pub(crate) inner: EventImpl,
    recorded: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event(device {})", self.device.id)
    }
}

impl Event {
    pub(crate) fn new(device: Arc<DeviceShared>, inner: EventImpl) -> Self {
        Event { device, inner, recorded: std::sync::atomic::AtomicBool::new(false) }
    }

    /// Records the event at the current end of `stream`. Not allowed on a capturing stream.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if stream.device.id != self.device.id {
            return Err(HalError::DeviceMismatch("event recorded on a stream of another device".into()));
        }
        if stream.is_capturing() {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Event,
                detail: "event record (order streams inside a capture with fork_capture / join_capture)".into(),
            });
        }
        self.inner.record(&stream.inner)?;
        self.recorded.store(true, Ordering::Release);
        Ok(())
    }

    /// Waits on the host until the event has completed (a host sync).
    pub fn synchronize(&self) -> Result<()> {
        self.device.forbid_during_capture(CaptureOp::Synchronize, || "event synchronize".into())?;
        if !self.recorded.load(Ordering::Acquire) {
            return Err(HalError::EventNotRecorded);
        }
        self.device.stats.on_host_sync();
        self.inner.synchronize()
    }

    /// Milliseconds of device time between `self` and `end` (both recorded on one device; waits
    /// for `end`).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if self.device.id != end.device.id {
            return Err(HalError::DeviceMismatch("elapsed time between events of two devices".into()));
        }
        if !self.recorded.load(Ordering::Acquire) || !end.recorded.load(Ordering::Acquire) {
            return Err(HalError::EventNotRecorded);
        }
        end.synchronize()?;
        self.inner.elapsed_ms(&end.inner)
    }
}

/// Refuses clusters of `cluster` blocks of `kernel` on a device without clusters or outside
/// `1..=MAX_CLUSTER_BLOCKS`, naming the kernel.
pub(crate) fn check_cluster(info: &crate::DeviceInfo, kernel: &str, cluster: u32) -> Result<()> {
    let bad = |detail: String| Err(HalError::InvalidLaunch { kernel: kernel.to_string(), detail });
    if !info.has_clusters() {
        return bad(format!(
            "thread-block clusters need an NVIDIA sm_90 or newer device; this is {} ({}:{}, {})",
            info.name, info.backend, info.ordinal, info.arch
        ));
    }
    if cluster == 0 || cluster > MAX_CLUSTER_BLOCKS {
        return bad(format!("a cluster of {cluster} blocks; 1 to {MAX_CLUSTER_BLOCKS} are supported"));
    }
    Ok(())
}
