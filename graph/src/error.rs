//! The crate's one error type.
//!
//! Everything here is reachable from configuration (a mode string, a size list, a backend's
//! declared support) or from a caller's dispatch request, so each message names the setting at
//! fault and what to change. Nothing in this crate panics on such input.

use crate::mode::GraphMode;
use crate::mode_set::ModeSet;
use crate::support::CgSupport;

/// Errors from graph mode parsing, resolution, capture-size building and dispatch.
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
}
