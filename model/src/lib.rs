//! # holdfast-model: a DeepSeek-V4-shaped decoder and its model runner
//!
//! - [`config`]: [`ModelConfig`] read and validated from a Hugging Face-style `config.json`, with
//!   the `tiny`, `flash-slice` and `pro-slice` presets;
//! - [`weights`]: device weights filled from a [`WeightSource`] (seeded by default);
//! - [`kv`]: the paged KV cache's block manager; [`scheduler`]: continuous batching with chunked
//!   prefill, producing each step's host arrays;
//! - [`forward`]: the forward over persistent buffers (attention as splitting ops, every other op
//!   in pieces), run eagerly, piecewise or as one full graph by the graph crate's runner;
//! - [`runner`]: [`ModelRunner`]: dispatch, staging, capture at start-up, execution, sampling.
//!
//! Greedy decoding on batch-invariant kernels: a request's tokens do not depend on the graph
//! mode, on the other requests in its batches, or on how its prompt was chunked.

pub mod config;
mod error;
pub mod forward;
pub mod kv;
pub mod runner;
pub mod scheduler;
pub mod weights;

pub use config::ModelConfig;
pub use error::{ModelError, Result};
pub use forward::{ForwardLimits, ModelForward};
pub use runner::{
    serve_tensor_parallel, ModelRunner, RankStep, RunnerSettings, ServeReport, StepResult, TensorParallelReport,
};
pub use weights::{CachedSource, SeededInit, Shard, WeightSource, Weights};
