//! The CLI's error: a usage problem (exit 2) or a runtime failure (exit 1).

use std::fmt;
use std::process::ExitCode;

use holdfast_attention::AttentionError;
use holdfast_graph::GraphError;
use holdfast_hal::HalError;
use holdfast_mhc::MhcError;
use holdfast_model::scheduler::ScheduleError;
use holdfast_model::ModelError;

/// What went wrong, classified by who can fix it.
#[derive(Debug)]
pub enum CliError {
    /// The options or the configuration: the user fixes them (exit 2).
    Usage(String),
    /// Something failed while running (exit 1).
    Runtime(String),
}

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Usage(_) => ExitCode::from(2),
            CliError::Runtime(_) => ExitCode::from(1),
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Runtime(m) => f.write_str(m),
        }
    }
}

/// Whether a graph-layer error comes from configuration (mode, sizes, LoRA) rather than a run.
fn graph_is_config(e: &GraphError) -> bool {
    matches!(
        e,
        GraphError::UnknownGraphMode { .. }
            | GraphError::NotARuntimeMode { .. }
            | GraphError::UnsupportedGraphMode { .. }
            | GraphError::InvalidSetting { .. }
            | GraphError::CaptureSizeTooLarge { .. }
            | GraphError::NoCaptureSizeFits { .. }
            | GraphError::InconsistentCaptureSizes { .. }
            | GraphError::NoSizeAfterSpecDecodeRounding { .. }
            | GraphError::SizeNotMultipleOfQueryLen { .. }
            | GraphError::PiecewiseNeedsSplittingAttention { .. }
            | GraphError::InvalidLora { .. }
    )
}

/// Whether opening a device failed because of the name or the build, not the machine.
pub fn hal_is_config(e: &HalError) -> bool {
    matches!(e, HalError::UnknownDevice { .. } | HalError::BackendNotCompiled { .. })
}

impl From<ModelError> for CliError {
    fn from(e: ModelError) -> Self {
        let usage = match &e {
            ModelError::Config { .. } | ModelError::Setting { .. } => true,
            // Configurations the attention and mHC layers reject at construction (top-k, window,
            // batch sizes their buffers cannot hold, a hidden size they have no kernels for).
            ModelError::Attention(AttentionError::Config(_) | AttentionError::UnsupportedCompressRatio(_)) => true,
            ModelError::Mhc(MhcError::Unsupported(_)) => true,
            ModelError::Graph(g) => graph_is_config(g),
            ModelError::Hal(h) => hal_is_config(h),
            ModelError::Schedule(s) => {
                matches!(
                    s,
                    ScheduleError::Config(_) | ScheduleError::BadRequest { .. } | ScheduleError::NeverFits { .. }
                )
            }
            _ => false,
        };
        if usage {
            CliError::Usage(e.to_string())
        } else {
            CliError::Runtime(e.to_string())
        }
    }
}

impl From<HalError> for CliError {
    fn from(e: HalError) -> Self {
        if hal_is_config(&e) {
            CliError::Usage(e.to_string())
        } else {
            CliError::Runtime(e.to_string())
        }
    }
}

impl From<ScheduleError> for CliError {
    fn from(e: ScheduleError) -> Self {
        ModelError::from(e).into()
    }
}
