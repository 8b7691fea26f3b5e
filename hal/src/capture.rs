//! The capture lifecycle, written once for every backend.
//!
//! A stream is `Idle` or `Capturing`; `begin` moves Idle → Capturing, `end` Capturing → Idle and
//! yields a graph, `abort` Capturing → Idle and yields nothing. Any other transition is a
//! [`HalError::CaptureTransition`] that changes nothing. While capturing, the log collects what
//! the finished graph must hold on to (every allocation and pinned buffer it touched), which
//! host-refreshed buffers it reads, the input views the caller bound by name, and the communicators
//! whose collectives it recorded.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::comm::CommShared;
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
}

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
    Capturing(CaptureLog),
}

impl CaptureState {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            CaptureState::Idle => "idle",
            CaptureState::Capturing(_) => "capturing",
        }
    }

    /// Idle → Capturing.
    pub(crate) fn begin(&mut self, label: &str) -> Result<()> {
        match self {
            CaptureState::Idle => {
                *self = CaptureState::Capturing(CaptureLog { label: label.to_string(), ..CaptureLog::default() });
                Ok(())
            }
            s => Err(HalError::CaptureTransition { attempted: "begin capture on", state: s.name() }),
        }
    }

    /// Capturing → Idle, handing back the log.
    pub(crate) fn finish(&mut self, attempted: &'static str) -> Result<CaptureLog> {
        match std::mem::replace(self, CaptureState::Idle) {
            CaptureState::Capturing(log) => Ok(log),
            CaptureState::Idle => Err(HalError::CaptureTransition { attempted, state: "idle" }),
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
            CaptureState::Capturing(log) => assert_eq!(log.label, "g", "the failed begin must not reset the log"),
            CaptureState::Idle => panic!("state changed"),
        }
        let log = s.finish("end capture on").expect("capturing -> idle");
        assert_eq!(log.label, "g");
        assert_eq!(s.name(), "idle");
    }
}
