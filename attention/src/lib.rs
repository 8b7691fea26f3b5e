//! # holdfast-attention: DeepSeek-V4 sparse MLA and SWA metadata
//!
//! Per step, the host hands [`CommonAttentionMetadata::stage`] the scheduler's inputs (query
//! offsets, sequence lengths, positions, slot mapping, each request's table row and the step's
//! block-table updates). They are validated and padded on the host — bad input is an
//! [`AttentionError::InvalidInput`] before anything is enqueued — and written to staging in mapped
//! host memory. Everything after that is device work on the step's stream:
//! [`CommonAttentionMetadata::upload`] is one kernel that reads the staging in place, copies it
//! into persistent buffers and writes the updates into the persistent block tables, and the builders ([`SwaBuilder`], [`C128aBuilder`], [`C4aBuilder`]) turn it into dense and ragged index
//! lists with kernels of [`source`] and the generic scan / pack of `holdfast-kernels`.
//!
//! The kernels that consume the metadata live here too: [`SparseAttention`] inserts each token's
//! latent KV into a paged cache by slot mapping and runs the ragged sparse attention (main = SWA,
//! extra = compressed entries) with a per-head attention sink.
//!
//! ## Design choices
//! - **Zero host syncs.** vLLM reads `nnz` back (`.item()`) once per ragged builder per step. Here
//!   the flat buffer of a ragged form is sized for the worst case at construction (`rows ×
//!   max_entries_per_row`), `indptr` is an on-device exclusive scan, and consumers bound each row
//!   by `indptr`; nothing needs the total on the host. [`BuildStats::host_syncs`] measures it.
//! - **Views depend only on the padded row count.** Every view handed out is a prefix (or a fixed
//!   slice) of a persistent buffer whose length is a function of [`StepLayout`]'s padded counts,
//!   never of the data, and a ragged `indices` view is never empty. A FULL graph captured at `n`
//!   rows therefore replays with any batch of `n` padded rows staged into the same mapped memory.
//! - **Uniform batches only in FULL graphs.** The builders declare
//!   [`holdfast_graph::CgSupport::UniformBatch`]: the decode/prefill split (threshold
//!   `1 + num_spec_tokens`) is decided on the host from the staged step, and on the fast path
//!   (every query ≤ threshold) all padded rows are decode rows, so the split is the captured one.
//! - **Block tables stay on the device.** Each of the two tables is `[max_num_seqs + 1,
//!   max_blocks_per_seq]`, indexed by a stable table row per request plus a null row for padding;
//!   a step stages only the block ids that changed ([`BlockTableUpdates`]), so its host and copy
//!   cost does not grow with the table width (80 KB per request per step at a 1M-token context
//!   when whole tables were uploaded).
//! - **Padding reads nothing.** Padded tokens have slot -1 and request -1; every kernel gives them
//!   length 0 and a row of -1.
//! - **Who validates what.** [`CommonAttentionMetadata::stage`] validates host data (lengths,
//!   positions against sequence lengths, updated block ids against the cache, table rows and the
//!   columns each request uses against what was written to its row, sizes against the
//!   construction limits). Device data (the indexer's top-k) cannot be checked on the host, so the
//!   c4a kernels keep only entries that name an existing compressed position.
//! - Builders allocate only at construction ([`holdfast_hal::Device::alloc_persistent`] by
//!   default; the `new_with_alloc` constructors exist so tests can plant a non-persistent buffer
//!   and see the capture reject it).

mod c128a;
mod c4a;
mod common;
pub mod compressor;
mod error;
pub mod indexer;
mod layer;
pub mod sim;
pub mod source;
mod sparse_attention;
mod swa;

pub use c128a::{
    c128a_max_compressed, C128aBuilder, C128aDecode, C128aMetadata, C128A_ALIGN, C128A_RATIO,
    C128A_SHARED_BLOCKS_PER_UNIT,
};
pub use c4a::{C4aBuilder, C4aDecode, C4aMetadata, C4A_RATIO};
pub use common::{
    persistent_alloc, ragged_capacity, BlockTableConfig, BlockTableUpdate, BlockTableUpdates, BufferAlloc, BuildStats,
    CommonAttentionMetadata, CommonConfig, Ragged, StepInput, StepLayout, TableKind,
};
pub use compressor::{source as compressor_source, Compressor, CompressorWeights, COMPRESSOR_THREADS};
pub use error::{AttentionError, Result};
pub use indexer::{
    indexer_max_compressed, indexer_staged_floats, source as indexer_source, Indexer, INDEXER_MAX_SHARED_FLOATS,
    INDEXER_WARPS, TOPK_MAX, TOPK_THREADS,
};
pub use layer::LayerKind;
pub use source::C4A_THREADS;
pub use sparse_attention::{
    source as sparse_attention_source, AttentionKernel, RaggedKv, SparseAttention, HEADS_PER_BLOCK,
    MAX_CHUNKS_PER_LANE, MAX_HEADS, TENSOR_CORE_HEAD_DIMS, WG_DEFAULT_SPLIT, WG_HEAD_DIM, WG_SPLITS,
};
pub use swa::{SwaBuilder, SwaDecode, SwaMetadata, SwaPrefill};
