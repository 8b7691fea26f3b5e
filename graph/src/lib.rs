//! Graph mode selection for holdfast: which graphs exist, and which one a step replays.
//!
//! The selection logic (modes, support resolution, sizes, padding, dispatch) is pure: it knows
//! nothing of devices, is tested on any machine, and the whole start-up decision can be made
//! before a device is opened. On top of it and of `holdfast-hal` sit the parts that touch a
//! device: the [`PersistentArena`] (graph-stable buffers, allocated once and locked), the
//! [`GraphRunner`] (warm-up, fresh per-step state, capture and checked replay of a [`Forward`])
//! and the [`PiecewiseRunner`] (pieces captured per size around eager splitting ops).
//!
//! The flow, once per model:
//! 1. The configured [`GraphMode`] is a `(decode, mixed)` pair of [`RuntimeMode`]s.
//! 2. Each attention backend declares a [`CgSupport`]; [`resolve`] applies the reference's
//!    ordered downgrade rules against the weakest one and returns the mode to use with every
//!    [`Downgrade`] spelled out. A configuration no rule can rescue is a [`GraphError`] that says
//!    what to change.
//! 3. [`CaptureSizes::build`] turns the scheduler limits and the user's size settings into the
//!    token counts to capture, rounded to whole spec-decode requests when full decode graphs
//!    need it; [`PaddingTable`] maps any token count to its capture size in one load.
//! 4. [`Dispatcher::initialize_keys`] derives every graph key ([`BatchDescriptor`]);
//!    [`Dispatcher::capture_descs`] is the capture list and [`Dispatcher::dispatch`] the per-step
//!    choice: FULL if its key exists, else PIECEWISE under the relaxed key, else eager, and eager
//!    unpadded above the largest size.
//! 5. Every graph-visible buffer lives in a locked [`PersistentArena`]; a [`GraphRunner`] captures
//!    the keys of [`Dispatcher::capture_descs`] for one [`Forward`] and runs each step as
//!    dispatched: eagerly, by replaying one FULL graph, or by replaying pieces around eager
//!    splitting ops ([`PiecewiseRunner`], [`PieceCtx`]).
//!
//! Who validates what: everything that comes from configuration (mode strings, size lists, LoRA
//! counts, query lengths, the caller's mode sets) is checked here and rejected with an error,
//! never a panic. Once keys are built the dispatcher trusts them: dispatch does a table load and
//! at most two lookups in small hash sets, and its statistics are plain counters behind
//! `&mut self`. Keeping the keys in one place is the point: a graph is captured for exactly the
//! descriptors dispatch can return, so a step can never ask for a graph that was not captured.
//!
//! ```
//! use holdfast_graph::*;
//!
//! let ctx = ResolveContext {
//!     backend: "SparseSwa",
//!     uniform_decode_query_len: 1,
//!     attention_is_splitting_op: true,
//! };
//! let resolved = resolve(GraphMode::default(), CgSupport::UniformBatch, &ctx)?;
//! let sizes = CaptureSizes::build(&CaptureSizeConfig::new(resolved.mode, 16, 1024))?;
//! assert_eq!(sizes.sizes(), &[1, 2, 4, 8, 16, 24, 32]);
//!
//! let mut dispatcher = Dispatcher::new(DispatcherConfig {
//!     capture_sizes: sizes,
//!     max_num_seqs: 16,
//!     lora: LoraConfig::Disabled,
//!     attention_is_splitting_op: true,
//! })?;
//! dispatcher.initialize_keys(resolved.mode, resolved.uniform_decode_query_len)?;
//! // 3 decode requests replay the FULL graph captured for 4 tokens.
//! let (mode, desc) = dispatcher.dispatch(3, true, false, 0, ModeSet::ALL, ModeSet::EMPTY)?;
//! assert_eq!((mode, desc.num_tokens, desc.num_reqs), (RuntimeMode::Full, 4, Some(4)));
//! # Ok::<(), GraphError>(())
//! ```
//!
//! Names follow the reference's spelling where a user will meet them (`FULL_AND_PIECEWISE` in
//! logs and displays, `max_num_batched_tokens`, `cudagraph_capture_sizes` in messages).

mod arena;
mod descriptor;
mod dispatcher;
mod error;
mod key_set;
mod lora;
mod mode;
mod mode_set;
mod padding;
mod piecewise;
mod runner;
mod sizes;
mod stats;
mod support;

pub use arena::{PersistentArena, WORKSPACE};
pub use descriptor::BatchDescriptor;
pub use dispatcher::{Dispatched, Dispatcher, DispatcherConfig};
pub use error::{GraphError, SharedHalError};
pub use lora::LoraConfig;
pub use mode::{GraphMode, RuntimeMode};
pub use mode_set::ModeSet;
pub use padding::PaddingTable;
pub use piecewise::{PieceCtx, PiecewiseRunner};
pub use runner::{Forward, GraphRunner, RunnerConfig, RunnerStats, StepKind};
pub use sizes::{CaptureSizeConfig, CaptureSizes, SizeWarning, DEFAULT_MAX_CAPTURE_SIZE_CAP, MAX_CAPTURE_SIZE};
pub use stats::{DispatchStats, FallbackReason};
pub use support::{min_support, resolve, CgSupport, Downgrade, DowngradeRule, ResolveContext, Resolved};
