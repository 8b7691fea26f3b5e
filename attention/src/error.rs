//! The crate's error type.

use holdfast_hal::HalError;
use holdfast_kernels::KernelsError;

/// Everything a metadata build can report. Host-input problems are [`AttentionError::InvalidInput`]
/// and are found before anything is enqueued.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    /// A device error (including the capture rules and the CPU sanitizer's findings).
    #[error(transparent)]
    Hal(#[from] HalError),
    /// A generic kernel launcher rejected its views.
    #[error(transparent)]
    Kernels(#[from] KernelsError),
    /// A per-step host input that violates its contract; nothing was staged or enqueued.
    #[error("invalid step input `{field}`: {detail}")]
    InvalidInput {
        /// The input field (`seq_lens`, `swa_block_table`, ...).
        field: &'static str,
        /// What is wrong, with the offending index and value.
        detail: String,
    },
    /// A construction-time configuration that cannot work.
    #[error("invalid attention config: {0}")]
    Config(String),
    /// A compress ratio that names no DeepSeek-V4 layer kind.
    #[error("unsupported compress ratio {0}: DeepSeek-V4 layers use 0/1 (SWA only), 4 (c4a) or 128 (c128a)")]
    UnsupportedCompressRatio(u32),
    /// A builder was asked to build before any step was staged.
    #[error("no step is staged: call CommonAttentionMetadata::stage first")]
    NotStaged,
    /// Views whose lengths do not fit a kernel launch, or a shape its tiling does not support.
    #[error("{op}: {detail}")]
    Shape {
        /// The operation.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
    /// A builder was handed common metadata of another size class than it was built for.
    #[error("common metadata mismatch: {0}")]
    Mismatch(String),
}

/// Result alias of this crate.
pub type Result<T, E = AttentionError> = std::result::Result<T, E>;

pub(crate) fn invalid(field: &'static str, detail: String) -> AttentionError {
    AttentionError::InvalidInput { field, detail }
}
