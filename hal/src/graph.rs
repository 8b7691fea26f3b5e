//! Replayable graphs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::backend::{GraphImpl, GraphOps};
use crate::capture::{CaptureLog, ViewRecord};
use crate::comm::CommShared;
use crate::device::{lock, DeviceShared};
use crate::error::{HalError, Result};
use crate::memory::{Allocation, PinnedAlloc, RawView};
use crate::stream::Stream;

/// An instantiated capture: replays the recorded work with the recorded addresses.
///
/// A graph holds every allocation and pinned buffer it touched, and every communicator whose
/// collectives it recorded, so none of them can be freed (or their addresses reused) while it
/// lives; replay is therefore memory-safe by construction. What replay cannot know is whether the
/// *contents* are what the caller meant: the sanitizer checks host-refreshed inputs
/// ([`crate::Buffer::set_host_refreshed`]) and bound input views ([`Stream::bind_input`]).
pub struct Graph {
    device: Arc<DeviceShared>,
    label: String,
    inner: GraphImpl,
    // Declared after `inner`, so the backend graph is destroyed before the communicators and the
    // memory it references.
    _comms: Vec<Arc<CommShared>>,
    _retained: Vec<Arc<Allocation>>,
    _pinned: Vec<Arc<PinnedAlloc>>,
    /// (allocation, host generation it last saw).
    host_inputs: Mutex<Vec<(Arc<Allocation>, u64)>>,
    inputs: Vec<(String, ViewRecord)>,
    ops: usize,
    replays: AtomicU64,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Graph(`{}`, {} ops, {} buffers)", self.label, self.ops, self._retained.len())
    }
}

impl Graph {
    pub(crate) fn new(device: Arc<DeviceShared>, inner: GraphImpl, log: CaptureLog) -> Self {
        let host_inputs = log
            .host_inputs
            .into_values()
            .map(|a| {
                let g = a.host_gen.load(Ordering::Acquire);
                (a, g)
            })
            .collect();
        Graph {
            device,
            label: log.label,
            inner,
            _comms: log.comms,
            _retained: log.retained.into_values().collect(),
            _pinned: log.pinned,
            host_inputs: Mutex::new(host_inputs),
            inputs: log.inputs,
            ops: log.ops,
            replays: AtomicU64::new(0),
        }
    }

    /// The label given at capture.
    pub fn label(&self) -> &str {
        &self.label
    }
    /// Operations recorded (kernel launches, copies, memsets, collectives).
    pub fn op_count(&self) -> usize {
        self.ops
    }
    /// Nodes in the backend graph.
    pub fn node_count(&self) -> usize {
        self.inner.node_count()
    }
    /// Number of distinct device allocations the graph keeps alive.
    pub fn retained_buffers(&self) -> usize {
        self._retained.len()
    }
    /// Bytes of device memory the graph keeps alive.
    pub fn retained_bytes(&self) -> u64 {
        self._retained.iter().map(|a| a.bytes as u64).sum()
    }
    /// Times replayed.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }
    /// Names of the bound inputs, in binding order.
    pub fn input_names(&self) -> impl Iterator<Item = &str> {
        self.inputs.iter().map(|(n, _)| n.as_str())
    }

    /// Replays on `stream`. Errors: the stream is of another device or capturing, or a
    /// host-refreshed input was not rewritten since the last replay.
    pub fn replay(&self, stream: &Stream) -> Result<()> {
        if stream.device.id != self.device.id {
            return Err(HalError::DeviceMismatch(format!(
                "graph `{}` replayed on a stream of another device",
                self.label
            )));
        }
        stream.replay_guard()?;
        {
            let mut inputs = lock(&self.host_inputs);
            for (alloc, seen) in inputs.iter() {
                if alloc.host_gen.load(Ordering::Acquire) == *seen {
                    return Err(HalError::StaleHostInput { graph: self.label.clone(), buffer: alloc.label.clone() });
                }
            }
            self.inner.replay(&stream.inner)?;
            for (alloc, seen) in inputs.iter_mut() {
                *seen = alloc.host_gen.load(Ordering::Acquire);
            }
        }
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Checks `given` against the inputs bound at capture (every bound name exactly once, same
    /// address, length and type), then replays.
    pub fn replay_with_inputs(&self, stream: &Stream, given: &[(&str, RawView)]) -> Result<()> {
        self.check_inputs(given)?;
        self.replay(stream)
    }

    /// The input-view check of [`Graph::replay_with_inputs`], without replaying.
    pub fn check_inputs(&self, given: &[(&str, RawView)]) -> Result<()> {
        let mismatch = |input: &str, recorded: String, g: String| HalError::InputViewMismatch {
            graph: self.label.clone(),
            input: input.to_string(),
            recorded,
            given: g,
        };
        for (name, view) in given {
            let Some((_, rec)) = self.inputs.iter().find(|(n, _)| n == name) else {
                return Err(mismatch(name, "no such input".into(), view.describe()));
            };
            let now = ViewRecord::of(view);
            if now.alloc_id != rec.alloc_id
                || now.addr != rec.addr
                || now.len != rec.len
                || now.describe != rec.describe
            {
                return Err(mismatch(name, rec.describe.clone(), now.describe));
            }
        }
        for (name, rec) in &self.inputs {
            if !given.iter().any(|(n, _)| n == name) {
                return Err(mismatch(name, rec.describe.clone(), "nothing".into()));
            }
        }
        Ok(())
    }
}
