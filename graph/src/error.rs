//! The crate's one error type.
//!
//! Everything here is reachable from configuration (a mode string, a size list, a backend's
//! declared support) or from a caller's dispatch request, so each message names the setting at
//! fault and what to change. Nothing in this crate panics on such input.

use std::fmt;
use std::sync::Arc;

use holdfast_hal::HalError;

use crate::descriptor::BatchDescriptor;
use crate::mode::{GraphMode, RuntimeMode};
use crate::mode_set::ModeSet;
use crate::support::CgSupport;

/// A [`HalError`] shared behind an `Arc`, so that [`GraphError`] stays `Clone` and comparable.
///
/// Two values are equal when they print the same `Debug` form (the HAL error's every field).
#[derive(Clone)]
pub struct SharedHalError(pub Arc<HalError>);

impl SharedHalError {
    /// The HAL error.
    pub fn get(&self) -> &HalError {
        &self.0
    }
}

impl fmt::Debug for SharedHalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for SharedHalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for SharedHalError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

impl PartialEq for SharedHalError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || format!("{:?}", self.0) == format!("{:?}", other.0)
    }
}
impl Eq for SharedHalError {}

/// Errors from graph mode parsing, resolution, capture-size building, dispatch, the persistent
/// arena and the graph runners.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// A graph mode string matched no mode.
    #[error(
        "unknown graph mode `{input}`: expected one of none, piecewise, full, full_decode_only, \
         full_and_piecewise (any case; `-` may replace `_`)"
    )]
    UnknownGraphMode {
        /// The string as given.
        input: String,
    },

    /// A composite mode was used where only a runtime mode (NONE, PIECEWISE, FULL) is meaningful.
    #[error(
        "graph mode {mode} is not a runtime mode: only NONE, PIECEWISE and FULL can be handed to a \
         graph runner; use decode_mode() or mixed_mode() to pick one"
    )]
    NotARuntimeMode {
        /// The composite mode.
        mode: GraphMode,
    },

    /// The configured mode needs full graphs that the attention backend cannot capture, and no
    /// downgrade rule applies.
    #[error(
        "graph mode {mode} is not supported by attention backend `{backend}` (support: {support}): \
         {advice}"
    )]
    UnsupportedGraphMode {
        /// The mode at the point the rule rejected it.
        mode: GraphMode,
        /// Name of the attention backend with the lowest support level.
        backend: String,
        /// That backend's support level.
        support: CgSupport,
        /// What to change.
        advice: &'static str,
    },

    /// A numeric setting is out of range.
    #[error("invalid {setting} = {value}: {reason}")]
    InvalidSetting {
        /// The setting's name, as a user would write it.
        setting: &'static str,
        /// Its value.
        value: String,
        /// Why it is rejected and what is expected.
        reason: &'static str,
    },

    /// A capture size is larger than the padding table supports.
    #[error(
        "capture size {size} exceeds the supported maximum of {limit} tokens; \
         lower cudagraph_capture_sizes / max_cudagraph_capture_size"
    )]
    CaptureSizeTooLarge {
        /// The offending size, in tokens.
        size: u64,
        /// The largest size this crate accepts, in tokens.
        limit: u32,
    },

    /// Every user-given capture size is above the token budget.
    #[error(
        "no capture size fits: every entry of cudagraph_capture_sizes {sizes:?} exceeds \
         max_num_batched_tokens = {max_num_batched_tokens}; add smaller sizes or raise the budget"
    )]
    NoCaptureSizeFits {
        /// The sizes given, deduplicated and sorted.
        sizes: Vec<u32>,
        /// The per-step token budget.
        max_num_batched_tokens: u32,
    },

    /// The user set both a maximum capture size and a size list, and they disagree.
    #[error(
        "max_cudagraph_capture_size = {max} disagrees with the largest usable entry of \
         cudagraph_capture_sizes ({largest}, after dropping sizes above max_num_batched_tokens); \
         set only one of the two, or make them equal"
    )]
    InconsistentCaptureSizes {
        /// The user's maximum, in tokens.
        max: u32,
        /// The largest size kept from the user's list, in tokens.
        largest: u32,
    },

    /// Rounding the sizes to multiples of the uniform decode query length left none.
    #[error(
        "no capture size is left after rounding to multiples of {multiple} (1 + num_spec_tokens) \
         within the maximum {max}: sizes were {sizes:?}; lower num_spec_tokens or raise \
         max_cudagraph_capture_size / cudagraph_capture_sizes"
    )]
    NoSizeAfterSpecDecodeRounding {
        /// The multiple, `1 + num_spec_tokens`.
        multiple: u32,
        /// The maximum capture size, in tokens.
        max: u32,
        /// The sizes before rounding.
        sizes: Vec<u32>,
    },

    /// A FULL uniform-decode graph would have a token count that is not a whole number of
    /// requests.
    #[error(
        "capture size {size} is not a multiple of the uniform decode query length {query_len}; \
         build the sizes with CaptureSizes::build for the resolved mode (it rounds them) or call \
         CaptureSizes::round_for_spec_decode"
    )]
    SizeNotMultipleOfQueryLen {
        /// The capture size, in tokens.
        size: u32,
        /// `1 + num_spec_tokens`.
        query_len: u32,
    },

    /// A mode with piecewise graphs was given to a dispatcher whose attention is not a splitting
    /// op, so no piecewise graph could be captured.
    #[error(
        "graph mode {mode} needs piecewise graphs, but attention is not a splitting op here; \
         use FULL_DECODE_ONLY, FULL or NONE, or compile attention as a splitting op"
    )]
    PiecewiseNeedsSplittingAttention {
        /// The rejected mode.
        mode: GraphMode,
    },

    /// A LoRA configuration is unusable.
    #[error("invalid LoRA graph configuration: {reason}")]
    InvalidLora {
        /// What is wrong.
        reason: &'static str,
    },

    /// The caller's valid and invalid mode sets leave nothing to choose from.
    #[error("dispatch has no allowed mode: valid_modes = {valid}, invalid_modes = {invalid}")]
    NoAllowedMode {
        /// The caller's valid set (empty means all).
        valid: ModeSet,
        /// The caller's invalid set.
        invalid: ModeSet,
    },

    /// No captured graph matches the batch and the caller forbade running eagerly.
    #[error(
        "no graph matches a batch of {num_tokens} tokens in the allowed modes {allowed}, \
         and NONE (eager) is not allowed; add NONE to valid_modes"
    )]
    EagerNotAllowed {
        /// The unpadded token count of the batch.
        num_tokens: u32,
        /// The allowed set after removing invalid modes.
        allowed: ModeSet,
    },

    /// A device operation failed (the HAL's error, unchanged).
    #[error(transparent)]
    Hal(SharedHalError),

    /// A failure while warming up or capturing one graph; `source` is what went wrong.
    #[error("capturing the {mode} graph for {desc} failed: {source}")]
    CaptureFailed {
        /// The runtime mode being captured.
        mode: RuntimeMode,
        /// The graph key being captured.
        desc: BatchDescriptor,
        /// The underlying error.
        #[source]
        source: Box<GraphError>,
    },

    /// An allocation was attempted after [`crate::PersistentArena::lock`].
    #[error(
        "persistent arena is locked: cannot allocate buffer `{buffer}` after start-up; allocate every \
         graph-visible buffer before locking (graphs have baked in the arena's addresses)"
    )]
    ArenaLocked {
        /// The buffer that was requested.
        buffer: String,
    },

    /// Two arena buffers were given the same name.
    #[error("persistent arena already has a buffer named `{buffer}`")]
    DuplicateBuffer {
        /// The repeated name.
        buffer: String,
    },

    /// An arena lookup by a name that was never allocated.
    #[error("persistent arena has no buffer named `{buffer}` (it has: {available})")]
    UnknownBuffer {
        /// The requested name.
        buffer: String,
        /// The names it does have, comma separated.
        available: String,
    },

    /// An arena lookup with the wrong element type.
    #[error("persistent arena buffer `{buffer}` holds {actual} elements, not {requested}")]
    BufferTypeMismatch {
        /// The buffer's name.
        buffer: String,
        /// The type it was allocated with.
        actual: holdfast_hal::DType,
        /// The type asked for.
        requested: holdfast_hal::DType,
    },

    /// The runner needs a locked arena (so no buffer can appear after capture).
    #[error("the persistent arena must be locked before graphs are captured")]
    ArenaNotLocked,

    /// A splitting op declared an output outside the persistent arena: the next piece's graph
    /// baked in an arena address, so a fresh buffer would never be read by the replay.
    #[error(
        "splitting op `{op}` writes `{buffer}`, which is not a persistent arena buffer: splitting \
         ops must write their outputs into arena buffers that the captured pieces read"
    )]
    SplittingOpOutputNotPersistent {
        /// The splitting op's name.
        op: String,
        /// The label of the buffer it declared.
        buffer: String,
    },

    /// A step asked for a descriptor that is not a graph key of that mode.
    #[error("no {mode} graph key equals {desc}: dispatch must hand the runner one of its keys exactly")]
    UnknownGraphKey {
        /// The requested mode.
        mode: RuntimeMode,
        /// The requested descriptor.
        desc: BatchDescriptor,
    },

    /// A step asked for a graph key that has not been captured and lazy capture is off.
    #[error("the {mode} graph for {desc} has not been captured (call capture_all, or enable lazy capture)")]
    GraphNotCaptured {
        /// The requested mode.
        mode: RuntimeMode,
        /// The requested descriptor.
        desc: BatchDescriptor,
    },

    /// A piecewise step ran a different sequence of pieces than the one captured for its size.
    #[error("piecewise graph for {desc}: {detail}")]
    PieceMismatch {
        /// The descriptor being replayed or captured.
        desc: BatchDescriptor,
        /// What differs.
        detail: String,
    },

    /// An error of the forward itself (a layer above this crate: a kernel launcher's shape check,
    /// a metadata builder's validation), carried through the runner. `op` says where, `message`
    /// is the full error text; the HAL error at its root, if any, stays reachable through
    /// [`GraphError::hal`].
    #[error("{op}: {message}")]
    Forward {
        /// Where in the forward it failed (layer and op).
        op: String,
        /// The error's message, with its sources.
        message: String,
        /// The HAL error at the root, when there is one.
        hal: Option<SharedHalError>,
    },
}

impl From<HalError> for GraphError {
    fn from(e: HalError) -> Self {
        GraphError::Hal(SharedHalError(Arc::new(e)))
    }
}

impl GraphError {
    /// The HAL error at the root of this error, if any (looks through [`GraphError::CaptureFailed`]).
    pub fn hal(&self) -> Option<&HalError> {
        match self {
            GraphError::Hal(e) => Some(e.get()),
            GraphError::Forward { hal: Some(e), .. } => Some(e.get()),
            GraphError::CaptureFailed { source, .. } => source.hal(),
            _ => None,
        }
    }

    /// This error without its [`GraphError::CaptureFailed`] wrappers.
    pub fn root(&self) -> &GraphError {
        match self {
            GraphError::CaptureFailed { source, .. } => source.root(),
            e => e,
        }
    }
}

/// A unit test's error-table row: the HAL's, with a static word list.
#[cfg(test)]
pub(crate) type ErrorCase = holdfast_hal::testing::ErrorCase<GraphError, &'static [&'static str]>;
