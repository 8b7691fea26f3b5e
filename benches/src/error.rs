//! The report's error type: every layer's error, plus the report's own.

/// Errors of the report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A bad command line or option value (exit code 2).
    #[error("{0}")]
    Usage(String),
    /// A device error.
    #[error(transparent)]
    Hal(#[from] holdfast_hal::HalError),
    /// A kernel launcher error.
    #[error(transparent)]
    Kernels(#[from] holdfast_kernels::KernelsError),
    /// An mHC op error.
    #[error(transparent)]
    Mhc(#[from] holdfast_mhc::MhcError),
    /// An attention error.
    #[error(transparent)]
    Attention(#[from] holdfast_attention::AttentionError),
    /// A graph-layer error.
    #[error(transparent)]
    Graph(#[from] holdfast_graph::GraphError),
    /// A model or runner error.
    #[error(transparent)]
    Model(#[from] holdfast_model::ModelError),
    /// A scheduler error.
    #[error(transparent)]
    Schedule(#[from] holdfast_model::scheduler::ScheduleError),
    /// Reading or writing a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Anything else, with its reason.
    #[error("{0}")]
    Other(String),
}

/// Result alias of the report.
pub type Result<T, E = ReportError> = std::result::Result<T, E>;
