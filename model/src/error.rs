//! Errors of the model crate.

use std::sync::Arc;

use holdfast_attention::AttentionError;
use holdfast_graph::{GraphError, SharedHalError};
use holdfast_hal::HalError;
use holdfast_kernels::KernelsError;
use holdfast_mhc::MhcError;

/// Everything that can go wrong building or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A configuration field is missing, malformed or inconsistent.
    #[error("model config: `{field}` {detail}")]
    Config {
        /// The field (as named in `config.json`, or the runtime setting).
        field: &'static str,
        /// What is wrong and what is allowed.
        detail: String,
    },
    /// A runtime setting (batch limits, cache sizes, graph mode) is invalid.
    #[error("runner setting `{setting}`: {detail}")]
    Setting {
        /// The setting.
        setting: &'static str,
        /// What is wrong and what is allowed.
        detail: String,
    },
    /// A step's inputs do not fit what the runner was built for.
    #[error("step input: {0}")]
    Step(String),
    /// A weight tensor cannot be made (its size overflows or does not fit host memory) or holds a
    /// value that is not finite; the message names the weight.
    #[error("weights: {0}")]
    Weights(String),
    /// A device error.
    #[error(transparent)]
    Hal(#[from] HalError),
    /// A graph-layer error (dispatch, capture, replay).
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// A generic kernel's launcher rejected its arguments.
    #[error(transparent)]
    Kernels(#[from] KernelsError),
    /// Attention metadata or kernels.
    #[error(transparent)]
    Attention(#[from] AttentionError),
    /// The hyper-connection ops.
    #[error(transparent)]
    Mhc(#[from] MhcError),
    /// The KV-cache block manager.
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    /// The scheduler.
    #[error(transparent)]
    Schedule(#[from] crate::scheduler::ScheduleError),
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    /// The HAL error at the root, taken out of whichever layer wrapped it.
    fn into_hal(self) -> std::result::Result<HalError, ModelError> {
        match self {
            ModelError::Hal(e)
            | ModelError::Kernels(KernelsError::Hal(e))
            | ModelError::Attention(AttentionError::Hal(e))
            | ModelError::Attention(AttentionError::Kernels(KernelsError::Hal(e)))
            | ModelError::Mhc(MhcError::Hal(e)) => Ok(e),
            other => Err(other),
        }
    }
}

/// Carries a model error through the graph runner, keeping its HAL root reachable.
pub(crate) fn to_graph(op: impl Into<String>, e: ModelError) -> GraphError {
    match e {
        ModelError::Graph(g) => g,
        e => match e.into_hal() {
            Ok(hal) => {
                let message = hal.to_string();
                GraphError::Forward { op: op.into(), message, hal: Some(SharedHalError(Arc::new(hal))) }
            }
            Err(other) => GraphError::Forward { op: op.into(), message: other.to_string(), hal: None },
        },
    }
}

/// The first of `limits` (name, value) that is 0, for an error of the form "`name` must be
/// positive, got 0".
pub(crate) fn first_zero<'a>(limits: &[(&'a str, usize)]) -> Option<&'a str> {
    limits.iter().find(|(_, v)| *v == 0).map(|(name, _)| *name)
}
