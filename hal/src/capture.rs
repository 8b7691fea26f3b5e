//! The capture lifecycle, written once for every backend.
//!
//! A stream is `Idle` or `Capturing`; `begin` moves Idle → Capturing, `end` Capturing → Idle and
//! yields a graph, `abort` Capturing → Idle and yields nothing. Any other transition is a
//! [`HalError::CaptureTransition`] that changes nothing. While capturing, the log collects what
//! the finished graph must hold on to (every allocation and pinned buffer it touched), which
//! host-refreshed buffers it reads, the input views the caller bound by name, and the communicators
//! whose collectives it recorded.
//!
//! Other streams take part through `fork_capture` (Idle → `Branch`: the stream records into the
//! same log and graph) and `join_capture` (Branch → `Joined`: its work is ordered before what the
//! joining stream records next; it records nothing more unless forked again). The capture ends
//! only on the stream that began it, once no branch is left unjoined; its branches are then idle.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use crate::backend::{EventImpl, StreamImpl};
use crate::comm::CommShared;
use crate::device::lock;
use crate::error::{HalError, Result};
use crate::memory::{Allocation, PinnedAlloc, RawView};

/// A recorded input view: what a replay must be handed again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ViewRecord {
    pub(crate) alloc_id: u64,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) describe: String,
}

impl ViewRecord {
    pub(crate) fn of(v: &RawView) -> Self {
        ViewRecord { alloc_id: v.alloc.id, addr: v.addr(), len: v.len(), describe: v.describe() }
    }
}

/// What a capture accumulates besides the backend's own recording.
#[derive(Default)]
pub(crate) struct CaptureLog {
    pub(crate) label: String,
    pub(crate) retained: BTreeMap<u64, Arc<Allocation>>,
    pub(crate) pinned: Vec<Arc<PinnedAlloc>>,
    /// Host-refreshed allocations read by the capture (by id).
    pub(crate) host_inputs: BTreeMap<u64, Arc<Allocation>>,
    /// Allocations the capture itself refreshes from pinned staging (exempt from the stale check).
    pub(crate) refreshed_in_graph: std::collections::BTreeSet<u64>,
    pub(crate) inputs: Vec<(String, ViewRecord)>,
    /// Communicators whose collectives were captured (a graph must not outlive them).
    pub(crate) comms: Vec<Arc<CommShared>>,
    pub(crate) ops: usize,
    /// Every stream forked into the capture, by id, kept alive until it closes (a CUDA stream
    /// stays part of the capture after its join, so it must not be destroyed before the end).
    pub(crate) branches: BTreeMap<u64, Arc<StreamImpl>>,
    /// The ids of the forked streams not yet joined back.
    pub(crate) unjoined: BTreeSet<u64>,
    /// The fork / join events, kept until the capture ends.
    pub(crate) edges: Vec<EventImpl>,
    /// Set when the capture ended or was aborted: its branches are idle again.
    pub(crate) closed: bool,
}

/// A capture's log, shared by the stream that began it and the streams forked into it.
pub(crate) type SharedLog = Arc<Mutex<CaptureLog>>;

impl CaptureLog {
    pub(crate) fn retain(&mut self, a: &Arc<Allocation>) {
        self.retained.entry(a.id).or_insert_with(|| a.clone());
    }
    pub(crate) fn keep_comm(&mut self, c: Arc<CommShared>) {
        if !self.comms.iter().any(|k| Arc::ptr_eq(k, &c)) {
            self.comms.push(c);
        }
    }
    pub(crate) fn note_read(&mut self, a: &Arc<Allocation>) {
        if a.host_refreshed.load(std::sync::atomic::Ordering::Acquire) && !self.refreshed_in_graph.contains(&a.id) {
            self.host_inputs.entry(a.id).or_insert_with(|| a.clone());
        }
    }
}

/// Capture state of a stream.
pub(crate) enum CaptureState {
    Idle,
    /// The stream began the capture and owns its end.
    Capturing(SharedLog),
    /// Forked into a capture: records into its log.
    Branch(SharedLog),
    /// Joined back into its capture: records nothing until forked again or the capture ends.
    Joined(SharedLog),
}

impl CaptureState {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            CaptureState::Idle => "idle",
            CaptureState::Capturing(_) => "capturing",
            CaptureState::Branch(_) => "a forked capture branch",
            CaptureState::Joined(_) => "a joined capture branch (its capture is still open)",
        }
    }

    /// The log this stream records into or belongs to, if any.
    pub(crate) fn log(&self) -> Option<&SharedLog> {
        match self {
            CaptureState::Idle => None,
            CaptureState::Capturing(l) | CaptureState::Branch(l) | CaptureState::Joined(l) => Some(l),
        }
    }

    /// A branch whose capture has ended is idle again.
    pub(crate) fn settle(&mut self) {
        if let CaptureState::Branch(l) | CaptureState::Joined(l) = self {
            if lock(l).closed {
                *self = CaptureState::Idle;
            }
        }
    }

    /// Idle → Capturing.
    pub(crate) fn begin(&mut self, label: &str) -> Result<()> {
        match self {
            CaptureState::Idle => {
                let log = CaptureLog { label: label.to_string(), ..CaptureLog::default() };
                *self = CaptureState::Capturing(Arc::new(Mutex::new(log)));
                Ok(())
            }
            s => Err(HalError::CaptureTransition { attempted: "begin capture on", state: s.name() }),
        }
    }

    /// Capturing → Idle, handing back the log (the capture's branches become idle).
    pub(crate) fn finish(&mut self, attempted: &'static str) -> Result<CaptureLog> {
        match self {
            CaptureState::Capturing(log) => {
                let taken = {
                    let mut l = lock(log);
                    let taken = std::mem::take(&mut *l);
                    l.closed = true;
                    taken
                };
                *self = CaptureState::Idle;
                Ok(taken)
            }
            s => Err(HalError::CaptureTransition { attempted, state: s.name() }),
        }
    }
}

/// What a caller can observe of a stream's capture state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    /// Not capturing: operations execute.
    Idle,
    /// Capturing: operations are recorded into the graph being built.
    Capturing {
        /// The label given to `begin_capture`.
        label: String,
        /// Operations recorded so far.
        ops: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rejected_transition_changes_nothing() {
        let mut s = CaptureState::Idle;
        assert!(matches!(s.finish("end capture on"), Err(HalError::CaptureTransition { state: "idle", .. })));
        assert_eq!(s.name(), "idle");
        s.begin("g").expect("idle -> capturing");
        assert!(matches!(s.begin("h"), Err(HalError::CaptureTransition { state: "capturing", .. })));
        match &s {
            CaptureState::Capturing(log) => assert_eq!(lock(log).label, "g", "the failed begin must not reset the log"),
            _ => panic!("state changed"),
        }
        let log = s.finish("end capture on").expect("capturing -> idle");
        assert_eq!(log.label, "g");
        assert_eq!(s.name(), "idle");
    }
}
