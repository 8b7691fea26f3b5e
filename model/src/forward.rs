//! The DeepSeek-V4-shaped forward over persistent buffers, as the graph runner drives it.
//!
//! One step of `T` token rows (padded for graph steps) runs, in order:
//! 1. **metadata** (a splitting op: eager in PIECEWISE steps, recorded in FULL graphs): upload the
//!    staged common metadata, token ids and sample rows; build the SWA and c128a ragged lists;
//! 2. **piece 0**: embed → `n` residual copies → `mhc_pre` of layer 0's attention;
//! 3. per layer: **attention** (a splitting op): RMSNorm, q low-rank projection with its norm,
//!    latent KV with its norm, RoPE, KV insert, compressor (c4a/c128a), indexer and c4a ragged
//!    build (c4a), ragged sparse attention with sink, inverse RoPE, grouped low-rank output
//!    projection; then **piece l+1**: `mhc_fused_post_pre` → FFN (RMSNorm, SwiGLU) → the next
//!    layer's `mhc_fused_post_pre`, or for the last layer `mhc_post` → `hc_head` → final RMSNorm →
//!    gather of the sampled rows → LM head → greedy argmax.
//!
//! Every token, prefill or decode, is one row of the ragged attention (one kernel serves both), so
//! the attention metadata uses a decode threshold that covers every query, and every view and
//! launch shape depends on `T` alone. That is why the model declares
//! [`CgSupport::Always`](holdfast_graph::CgSupport::Always): a FULL graph captured at `T` rows is
//! correct for any batch of `T` padded rows, mixed or not.

use std::sync::Arc;

use half::bf16;
use holdfast_attention::{
    C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, Compressor, CompressorWeights, Indexer, LayerKind,
    RaggedKv, SparseAttention, SwaBuilder,
};
use holdfast_graph::{BatchDescriptor, Forward, GraphError, PersistentArena, PieceCtx, RuntimeMode, StepKind};
use holdfast_hal::{Buffer, Communicator, Device, MappedBuffer, ReduceOp, Stream, View};
use holdfast_kernels::{DenseKernels, Gemm};
use holdfast_mhc::{
    HcHeadParams, HcHeadWeights, MhcConfig, MhcKernels, MhcOps, MhcPostInputs, MhcPreOutputs, MhcPreParams,
    MhcPreWeights,
};

use crate::config::{ModelConfig, HC_POST_ALPHA};
use crate::error::{first_zero, to_graph, ModelError, Result};
use crate::scheduler::Step;
use crate::weights::{CompressorTensors, HcTensors, Weights};

/// Sizes the forward is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardLimits {
    /// Most token rows of one step (padded).
    pub max_num_batched_tokens: usize,
    /// Most requests of one step; also the most sampled rows.
    pub max_num_seqs: usize,
    /// Longest sequence, in tokens.
    pub max_model_len: usize,
}

/// The per-layer caches (persistent device buffers).
#[derive(Debug)]
struct LayerCaches {
    /// Sliding-window latent KV `[swa slots, head_dim]` bf16.
    swa: Buffer<bf16>,
    /// Compressor state and compressed entries (compressed layers).
    compressed: Option<(Buffer<f32>, Buffer<bf16>)>,
    /// The indexer's compressor state and K cache (c4a layers).
    indexer: Option<(Buffer<f32>, Buffer<bf16>)>,
}

/// Per-layer compiled ops that depend on the layer's kind.
#[derive(Debug)]
struct LayerOps {
    compressor: Option<Compressor>,
    indexer_compressor: Option<Compressor>,
}

/// Rows whose logits are computed for `t` token rows: `min(t, max_num_seqs)`.
pub fn sample_rows(t: usize, max_num_seqs: usize) -> usize {
    t.min(max_num_seqs)
}

/// The DeepSeek-V4-shaped forward: weights, caches, compiled ops and the persistent activation
/// buffers (in the arena). Implements [`Forward`] for the graph runner.
pub struct ModelForward {
    cfg: ModelConfig,
    limits: ForwardLimits,
    arena: Arc<PersistentArena>,
    weights: Weights,
    dense: DenseKernels,
    attn: SparseAttention,
    mhc: MhcOps,
    pre_params: MhcPreParams,
    head_params: HcHeadParams,
    common: CommonAttentionMetadata,
    swa: SwaBuilder,
    c128a: Option<C128aBuilder>,
    c4a: Option<C4aBuilder>,
    indexer: Option<Indexer>,
    layer_ops: Vec<LayerOps>,
    caches: Vec<LayerCaches>,
    /// `[max_num_batched_tokens]` token ids of the step, in mapped host memory: the embedding
    /// reads them in place (no copy node in a graph).
    ids: MappedBuffer<i32>,
    /// `[max_num_seqs]` token row sampled for each request (-1 for padding), mapped likewise: the
    /// sampler reads them in place.
    sample_rows: MappedBuffer<i32>,
    /// Token rows of the step [`ModelForward::stage_step`] staged, taken by the next real
    /// [`Forward::prepare`].
    staged: Option<usize>,
    scratch: Vec<i32>,
    /// Per layer, the names of its attention op and its FFN piece (error context).
    op_names: Vec<(String, String)>,
    /// This rank's communicator under tensor parallelism.
    tp: Option<Communicator>,
    /// Query heads, output groups and FFN columns of this rank (the whole model's without
    /// tensor parallelism).
    local: LocalDims,
    /// A captured step's c128a metadata build runs on this branch, concurrently with the SWA
    /// build (eager steps run both on the step's stream).
    side: Stream,
}

/// The split dimensions one rank computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LocalDims {
    heads: usize,
    o_groups: usize,
    ffn: usize,
}

impl std::fmt::Debug for ModelForward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelForward")
            .field("limits", &self.limits)
            .field("layers", &self.cfg.num_hidden_layers)
            .finish()
    }
}

/// Names of the arena buffers, with their element counts per token row (`T` multiples) or fixed
/// (and of the two mapped step inputs, `IDS` and `ROWS`).
mod buf {
    pub const IDS: &str = "ids";
    pub const ROWS: &str = "sample_rows";
    pub const H: &str = "h";
    pub const RESIDUAL: &str = "residual";
    pub const POST: [&str; 2] = ["post.a", "post.b"];
    pub const COMB: [&str; 2] = ["comb.a", "comb.b"];
    pub const X: &str = "x";
    pub const XN: &str = "xn";
    pub const QA: &str = "q_a";
    pub const Q: &str = "q";
    pub const KV: &str = "kv";
    pub const KV_SCORE: &str = "kv_score";
    pub const O: &str = "attn_o";
    pub const OA: &str = "attn_o_a";
    pub const Y: &str = "y";
    /// f32 partial sums of a row-parallel projection (tensor parallelism), all-reduced in place.
    pub const YP: &str = "y_partial";
    pub const GU: &str = "ffn_gate_up";
    pub const ACT: &str = "ffn_act";
    pub const IQ: &str = "index_q";
    pub const IW: &str = "index_w";
    pub const IKV: &str = "index_kv_score";
    pub const TOPK: &str = "topk";
    pub const HS: &str = "sampled_hidden";
    pub const LOGITS: &str = "logits";
    pub const TOKENS: &str = "tokens";
}

fn g(op: &str) -> impl FnOnce(ModelError) -> GraphError + '_ {
    move |e| to_graph(op, e)
}

impl ModelForward {
    /// Builds the forward on `dev`: compiles every kernel, allocates caches and the arena's
    /// activation buffers for `limits`, and locks the arena. `kv_table`/`swa_table` shapes come
    /// from the block manager the scheduler uses.
    pub fn new(
        dev: &Device,
        cfg: &ModelConfig,
        weights: Weights,
        limits: ForwardLimits,
        swa_table: holdfast_attention::BlockTableConfig,
        kv_table: holdfast_attention::BlockTableConfig,
    ) -> Result<Self> {
        Self::new_tp(dev, cfg, weights, limits, swa_table, kv_table, None)
    }

    /// As [`ModelForward::new`] for one rank of a tensor-parallel group: `weights` are the rank's
    /// shard ([`crate::weights::Shard`]) and `comm` its communicator (its rank and size must be
    /// the shard's). The rank computes its query heads (attention is per head), its output
    /// groups and its FFN columns; the two row-parallel projections (`wo_b`, `w2`) produce f32
    /// partial sums that one all-reduce per sublayer adds across the ranks, then one round to
    /// bf16. Everything else (norms, latent KV, compressors, indexer, mHC, LM head) is
    /// replicated, so every rank holds the same activations and samples the same tokens.
    pub fn new_tp(
        dev: &Device,
        cfg: &ModelConfig,
        weights: Weights,
        limits: ForwardLimits,
        swa_table: holdfast_attention::BlockTableConfig,
        kv_table: holdfast_attention::BlockTableConfig,
        tp: Option<Communicator>,
    ) -> Result<Self> {
        cfg.validate()?;
        let shard = weights.shard;
        let size = tp.as_ref().map_or(1, Communicator::size);
        if tp.as_ref().map_or(shard.rank != 0 || shard.size != 1, |c| c.rank() != shard.rank || c.size() != shard.size)
        {
            return Err(ModelError::Setting {
                setting: "tensor_parallel",
                detail: format!(
                    "the weights are shard {} of {} but the communicator is rank {} of {size}",
                    shard.rank,
                    shard.size,
                    tp.as_ref().map_or(0, Communicator::rank)
                ),
            });
        }
        cfg.validate_tp(size)?;
        let local = LocalDims {
            heads: cfg.num_attention_heads / size,
            o_groups: cfg.o_groups / size,
            ffn: cfg.moe_intermediate_size / size,
        };
        let ForwardLimits { max_num_batched_tokens: tm, max_num_seqs: sm, max_model_len } = limits;
        if let Some(name) =
            first_zero(&[("max_num_batched_tokens", tm), ("max_num_seqs", sm), ("max_model_len", max_model_len)])
        {
            return Err(ModelError::Setting { setting: "limits", detail: format!("{name} must be positive, got 0") });
        }
        if max_model_len > cfg.max_position_embeddings {
            return Err(ModelError::Setting {
                setting: "max_model_len",
                detail: format!("{max_model_len} exceeds max_position_embeddings {}", cfg.max_position_embeddings),
            });
        }
        let common_cfg = CommonConfig {
            max_num_batched_tokens: tm,
            max_num_seqs: sm,
            max_model_len,
            // Every query is a row of the ragged attention (see the module docs).
            num_spec_tokens: tm.saturating_sub(1),
            swa_table,
            kv_table,
            // The scheduler hands out blocks only for the tokens it schedules.
            max_table_updates: swa_table.growth_cells(tm, sm) + kv_table.growth_cells(tm, sm),
        };
        let (h, d, heads, n) = (cfg.hidden_size, cfg.head_dim, local.heads, cfg.hc_mult);
        let common = CommonAttentionMetadata::new(dev, common_cfg)?;
        let swa = SwaBuilder::new(dev, &common_cfg, cfg.sliding_window)?;
        let c128a = if cfg.has_c128a() { Some(C128aBuilder::new(dev, &common_cfg)?) } else { None };
        let (c4a, indexer) = if cfg.has_c4a() {
            (
                Some(C4aBuilder::new(dev, &common_cfg, cfg.index_topk)?),
                Some(Indexer::new(dev, &common_cfg, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk)?),
            )
        } else {
            (None, None)
        };
        let swa_slots = swa_table.num_blocks * swa_table.block_size;
        let mut layer_ops = Vec::new();
        let mut caches = Vec::new();
        for l in 0..cfg.num_hidden_layers {
            let theta = cfg.layer_rope_theta(l);
            let kind = cfg.layer_kind(l);
            let compressor = match kind {
                LayerKind::SwaOnly => None,
                _ => Some(Compressor::new(
                    dev,
                    &common_cfg,
                    cfg.ratio(l),
                    d,
                    cfg.qk_rope_head_dim,
                    cfg.compress_rope_theta,
                    cfg.rms_norm_eps,
                )?),
            };
            let indexer_compressor = if kind == LayerKind::C4a {
                Some(Compressor::new(
                    dev,
                    &common_cfg,
                    4,
                    cfg.index_head_dim,
                    cfg.qk_rope_head_dim,
                    theta,
                    cfg.rms_norm_eps,
                )?)
            } else {
                None
            };
            let alloc_pair = |c: &Compressor, what: &str| -> Result<(Buffer<f32>, Buffer<bf16>)> {
                Ok((
                    dev.alloc_persistent::<f32>(&format!("layers.{l}.{what}.state"), c.state_len())?,
                    dev.alloc_persistent::<bf16>(&format!("layers.{l}.{what}.cache"), c.cache_len())?,
                ))
            };
            caches.push(LayerCaches {
                swa: dev.alloc_persistent::<bf16>(&format!("layers.{l}.swa_cache"), swa_slots * d)?,
                compressed: compressor.as_ref().map(|c| alloc_pair(c, "compressed")).transpose()?,
                indexer: indexer_compressor.as_ref().map(|c| alloc_pair(c, "indexer")).transpose()?,
            });
            layer_ops.push(LayerOps { compressor, indexer_compressor });
        }

        let mut arena = PersistentArena::new(dev);
        let (q, f, r, gq) = (cfg.q_lora_rank, local.ffn, cfg.o_lora_rank, local.o_groups);
        arena.alloc::<bf16>(buf::H, tm * h)?;
        arena.alloc::<bf16>(buf::RESIDUAL, tm * n * h)?;
        for i in 0..2 {
            arena.alloc::<f32>(buf::POST[i], tm * n)?;
            arena.alloc::<f32>(buf::COMB[i], tm * n * n)?;
        }
        arena.alloc::<bf16>(buf::X, tm * h)?;
        arena.alloc::<bf16>(buf::XN, tm * h)?;
        arena.alloc::<bf16>(buf::QA, tm * q)?;
        arena.alloc::<bf16>(buf::Q, tm * heads * d)?;
        arena.alloc::<bf16>(buf::KV, tm * d)?;
        arena.alloc::<f32>(buf::KV_SCORE, tm * 2 * d)?;
        arena.alloc::<bf16>(buf::O, tm * heads * d)?;
        arena.alloc::<bf16>(buf::OA, tm * gq * r)?;
        arena.alloc::<bf16>(buf::Y, tm * h)?;
        if tp.is_some() {
            arena.alloc::<f32>(buf::YP, tm * h)?;
        }
        arena.alloc::<bf16>(buf::GU, tm * 2 * f)?;
        arena.alloc::<bf16>(buf::ACT, tm * f)?;
        if cfg.has_c4a() {
            let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
            arena.alloc::<bf16>(buf::IQ, tm * ih * id)?;
            arena.alloc::<f32>(buf::IW, tm * ih)?;
            arena.alloc::<f32>(buf::IKV, tm * 2 * id)?;
            arena.alloc::<i32>(buf::TOPK, tm * cfg.index_topk)?;
        }
        arena.alloc::<bf16>(buf::HS, sm * h)?;
        arena.alloc::<f32>(buf::LOGITS, sm * cfg.vocab_size)?;
        arena.alloc::<i32>(buf::TOKENS, sm)?;
        arena.lock();

        let mhc_kernels = MhcKernels::new(dev)?;
        let mhc = MhcOps::new(dev, &mhc_kernels, MhcConfig { hc_mult: n, hidden: h, max_tokens: tm })?;
        Ok(ModelForward {
            cfg: cfg.clone(),
            limits,
            arena: Arc::new(arena),
            weights,
            dense: DenseKernels::new(dev)?,
            attn: SparseAttention::new(dev, heads, d)?,
            mhc,
            pre_params: MhcPreParams {
                rms_eps: cfg.rms_norm_eps,
                pre_eps: cfg.hc_eps,
                sinkhorn_eps: cfg.hc_eps,
                post_mult: HC_POST_ALPHA,
                sinkhorn_iters: cfg.hc_sinkhorn_iters as u32,
            },
            head_params: HcHeadParams { rms_eps: cfg.rms_norm_eps, hc_eps: cfg.hc_eps },
            common,
            swa,
            c128a,
            c4a,
            indexer,
            layer_ops,
            caches,
            ids: dev.alloc_mapped::<i32>(buf::IDS, tm)?,
            sample_rows: dev.alloc_mapped::<i32>(buf::ROWS, sm)?,
            staged: None,
            scratch: Vec::new(),
            op_names: (0..cfg.num_hidden_layers)
                .map(|l| (format!("layers.{l}.attention"), format!("layers.{l}.ffn")))
                .collect(),
            tp,
            local,
            side: dev.create_stream()?,
        })
    }

    /// The arena holding every activation buffer.
    pub fn arena(&self) -> &Arc<PersistentArena> {
        &self.arena
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The layers' attention kernels (for this shard's heads): which kernel runs, its row split.
    pub fn sparse_attention(&self) -> &SparseAttention {
        &self.attn
    }

    /// Spreads each attention row over `split` blocks of the warpgroup attention kernel (one of
    /// [`holdfast_attention::WG_SPLITS`]; see `RunnerSettings::attention_row_split`). Call it
    /// before any step is captured: captured graphs keep the kernel they were captured with.
    /// Errors: a split outside that list, or a device or shape without the warpgroup kernel.
    pub fn set_attention_row_split(&mut self, dev: &Device, split: usize) -> Result<()> {
        self.attn = self
            .attn
            .clone()
            .with_warpgroup_split(dev, split)
            .map_err(|e| ModelError::Setting { setting: "attention_row_split", detail: e.to_string() })?;
        Ok(())
    }

    /// The limits it was built for.
    pub fn limits(&self) -> ForwardLimits {
        self.limits
    }

    /// The weights.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Bytes of the KV caches (SWA, compressed, compressor states, indexer), all layers.
    pub fn cache_bytes(&self) -> usize {
        self.caches
            .iter()
            .map(|c| {
                c.swa.bytes()
                    + c.compressed.as_ref().map_or(0, |(s, k)| s.bytes() + k.bytes())
                    + c.indexer.as_ref().map_or(0, |(s, k)| s.bytes() + k.bytes())
            })
            .sum()
    }

    /// Stages the host data of the next step for `t` token rows (its padded size, as dispatched)
    /// into the mapped inputs; the next real [`Forward::prepare`] checks it was staged for its
    /// size. The caller must have waited for the previous step (its kernels read the same memory
    /// in place, up to the sampler at its end).
    pub fn stage_step(&mut self, step: &Step, t: usize) -> Result<()> {
        self.staged = None;
        self.stage(t, Some(step))?;
        self.staged = Some(t);
        Ok(())
    }

    /// Applies, on `s`, the block-table updates of the staged step that exceed the fixed-size part
    /// every upload carries ([`holdfast_attention::CommonAttentionMetadata::apply_bulk_table_updates`]):
    /// a graph replay's captured upload only carries the fixed-size part, so the runner calls this
    /// before every step (a no-op, returning 0, when nothing is pending).
    pub fn apply_pending_table_updates(&self, s: &Stream) -> Result<usize> {
        Ok(self.common.apply_bulk_table_updates(s)?)
    }

    /// The sampled token of each of the first `rows` sample rows of the last step (syncs).
    pub fn read_tokens(&self, s: &Stream, rows: usize) -> Result<Vec<i32>> {
        Ok(s.copy_to_host_sync(&self.arena.view::<i32>(buf::TOKENS, rows)?)?)
    }

    /// The logits `[rows, vocab]` of the first `rows` sample rows of the last step (syncs).
    pub fn read_logits(&self, s: &Stream, rows: usize) -> Result<Vec<f32>> {
        let len = rows
            .checked_mul(self.cfg.vocab_size)
            .ok_or_else(|| ModelError::Step(format!("logits of {rows} rows of {} overflow", self.cfg.vocab_size)))?;
        Ok(s.copy_to_host_sync(&self.arena.view::<f32>(buf::LOGITS, len)?)?)
    }

    /// Writes the mapped inputs for `t` token rows: `step`'s data, or for warm-up and capture
    /// (`None`) a step of padding rows only.
    fn stage(&mut self, t: usize, step: Option<&Step>) -> Result<()> {
        let sm = self.limits.max_num_seqs;
        let rp = sample_rows(t, sm);
        let mut scratch = std::mem::take(&mut self.scratch);
        match step {
            Some(step) => {
                let nr = step.query_start_loc.len().saturating_sub(1);
                if step.req_ids.len() != nr || step.samples.len() != nr {
                    return Err(ModelError::Step(format!(
                        "a step of {nr} requests (query_start_loc) has {} request ids and {} sample flags",
                        step.req_ids.len(),
                        step.samples.len()
                    )));
                }
                if step.num_tokens() > t || step.num_reqs() > rp {
                    return Err(ModelError::Step(format!(
                        "a step of {} tokens / {} requests does not fit {t} rows ({rp} requests)",
                        step.num_tokens(),
                        step.num_reqs()
                    )));
                }
                let vocab = self.cfg.vocab_size;
                if let Some((i, &id)) =
                    step.token_ids.iter().enumerate().find(|(_, &id)| id < 0 || id as usize >= vocab)
                {
                    return Err(ModelError::Step(format!(
                        "token {i} of the step has id {id}, outside the vocabulary [0, {vocab})"
                    )));
                }
                for &row in &step.released_rows {
                    self.common.release_table_row(row as usize)?;
                }
                self.common.stage(&step.step_input(rp, t))?;
                scratch.clear();
                scratch.extend_from_slice(&step.token_ids);
                scratch.resize(t, -1);
                self.ids.write(0, &scratch)?;
                scratch.clear();
                scratch.extend(step.sample_rows().into_iter().map(|r| r as i32));
                scratch.resize(rp, -1);
                self.sample_rows.write(0, &scratch)?;
            }
            None => {
                // Warm-up and capture: no request, every row padding (reads nothing, writes nothing).
                let empty: [i32; 0] = [];
                let input = holdfast_attention::StepInput {
                    query_start_loc: &[0],
                    seq_lens: &empty,
                    positions: &empty,
                    slot_mapping: &empty,
                    table_rows: &[],
                    table_updates: &holdfast_attention::BlockTableUpdates::new(),
                    num_reqs_padded: rp,
                    num_tokens_padded: t,
                };
                self.common.stage(&input)?;
                scratch.clear();
                scratch.resize(t.max(rp), -1);
                self.ids.write(0, &scratch[..t])?;
                self.sample_rows.write(0, &scratch[..rp])?;
            }
        }
        self.scratch = scratch;
        Ok(())
    }

    fn v<T: holdfast_hal::Element>(&self, name: &str, len: usize) -> Result<View<T>> {
        Ok(self.arena.view::<T>(name, len)?)
    }

    fn pre_weights(hc: &HcTensors) -> (View<f32>, View<f32>, View<f32>) {
        (hc.hc_fn.view(), hc.scale.view(), hc.base.view())
    }

    /// Upload + SWA/c128a builds; returns the SWA and c128a ragged lists.
    fn metadata(&self, s: &Stream) -> Result<StepMeta> {
        self.common.upload(s)?;
        // Captured: the c128a build on a branch forked after the upload, joined after the SWA
        // build (the same kernels on the same data either way, so the same bits).
        let fork = self.c128a.is_some() && s.is_capturing();
        if fork {
            s.fork_capture(&self.side)?;
        }
        let c128a = match &self.c128a {
            Some(b) => Some(
                b.build(if fork { &self.side } else { s }, &self.common)?
                    .decode
                    .ok_or_else(|| ModelError::Step("the c128a builder produced no rows".into()))?
                    .ragged,
            ),
            None => None,
        };
        let swa = self.swa.build(s, &self.common)?;
        let swa = swa.decode.ok_or_else(|| ModelError::Step("the SWA builder produced no rows".into()))?.ragged;
        if fork {
            s.join_capture(&self.side)?;
        }
        Ok(StepMeta { swa, c128a })
    }

    /// Piece 0: embed, residual copies, layer 0's attention `mhc_pre`.
    fn head_piece(&self, s: &Stream, t: usize) -> Result<()> {
        let (h, n) = (self.cfg.hidden_size, self.cfg.hc_mult);
        let hid = self.v::<bf16>(buf::H, t * h)?;
        self.dense.embed(
            s,
            &self.weights.embed.view(),
            &self.ids.buffer().prefix(t)?,
            &hid,
            t,
            h,
            self.cfg.vocab_size,
        )?;
        let res = self.v::<bf16>(buf::RESIDUAL, t * n * h)?;
        self.dense.repeat_rows(s, &hid, &res, t, n, h)?;
        let (f, sc, b) = Self::pre_weights(&self.weights.layers[0].hc_attn);
        let (post, comb, x) = (self.v(buf::POST[0], t * n)?, self.v(buf::COMB[0], t * n * n)?, self.v(buf::X, t * h)?);
        self.mhc.pre(
            s,
            &res,
            &MhcPreWeights { hc_fn: &f, scale: &sc, base: &b },
            &self.pre_params,
            &MhcPreOutputs { post: &post, comb: &comb, layer_input: &x },
        )?;
        Ok(())
    }

    fn compress(
        &self,
        s: &Stream,
        t: usize,
        c: &Compressor,
        w: &CompressorTensors,
        caches: &(Buffer<f32>, Buffer<bf16>),
        out_name: &str,
    ) -> Result<()> {
        let (h, dim) = (self.cfg.hidden_size, c.dim());
        let kvs = self.v::<f32>(out_name, t * 2 * dim)?;
        let xn = self.v::<bf16>(buf::XN, t * h)?;
        self.dense.matmul_f32(s, &xn, &w.wkv_gate.view(), &kvs, Gemm { t, n: 2 * dim, k: h, groups: 1 })?;
        let (ape, norm) = (w.ape.view(), w.norm.view());
        c.run(
            s,
            &self.common,
            &kvs,
            &CompressorWeights { ape: &ape, norm: &norm },
            &caches.0.view(),
            &caches.1.view(),
        )?;
        Ok(())
    }

    /// Layer `l`'s attention: reads `x`, writes `y`.
    fn attention(&self, s: &Stream, l: usize, t: usize, meta: &StepMeta) -> Result<()> {
        let c = &self.cfg;
        let w = &self.weights.layers[l];
        let (h, d, heads, q, rope, eps) =
            (c.hidden_size, c.head_dim, self.local.heads, c.q_lora_rank, c.qk_rope_head_dim, c.rms_norm_eps);
        let theta = c.layer_rope_theta(l);
        let dk = &self.dense;
        let positions = self.common.positions()?.slice(0, t)?;
        let (x, xn) = (self.v::<bf16>(buf::X, t * h)?, self.v::<bf16>(buf::XN, t * h)?);
        dk.rms_norm(s, &x, &w.attn_norm.view(), &xn, t, h, eps)?;
        let qa = self.v::<bf16>(buf::QA, t * q)?;
        dk.matmul(s, &xn, &w.wq_a.view(), &qa, Gemm { t, n: q, k: h, groups: 1 })?;
        dk.rms_norm(s, &qa, &w.q_norm.view(), &qa, t, q, eps)?;
        let qh = self.v::<bf16>(buf::Q, t * heads * d)?;
        dk.matmul(s, &qa, &w.wq_b.view(), &qh, Gemm { t, n: heads * d, k: q, groups: 1 })?;
        dk.rope(s, &qh, &positions, t, heads, d, rope, theta, false)?;
        let kv = self.v::<bf16>(buf::KV, t * d)?;
        dk.matmul(s, &xn, &w.wkv.view(), &kv, Gemm { t, n: d, k: h, groups: 1 })?;
        dk.rms_norm(s, &kv, &w.kv_norm.view(), &kv, t, d, eps)?;
        dk.rope(s, &kv, &positions, t, 1, d, rope, theta, false)?;
        let caches = &self.caches[l];
        let slots = self.common.slot_mapping()?.slice(0, t)?;
        self.attn.insert(s, &kv, &slots, &caches.swa.view())?;

        let ops = &self.layer_ops[l];
        if let (Some(comp), Some(wc), Some(cc)) = (&ops.compressor, &w.compressor, &caches.compressed) {
            self.compress(s, t, comp, wc, cc, buf::KV_SCORE)?;
        }
        let c4a_ragged = match (&ops.indexer_compressor, &w.indexer, &caches.indexer, &self.indexer, &self.c4a) {
            (Some(icomp), Some(wi), Some(ic), Some(indexer), Some(c4a)) => {
                let (ih, id, k) = (c.index_n_heads, c.index_head_dim, c.index_topk);
                self.compress(s, t, icomp, &wi.compressor, ic, buf::IKV)?;
                let iq = self.v::<bf16>(buf::IQ, t * ih * id)?;
                dk.matmul(s, &qa, &wi.wq.view(), &iq, Gemm { t, n: ih * id, k: q, groups: 1 })?;
                dk.rope(s, &iq, &positions, t, ih, id, rope, theta, false)?;
                let iw = self.v::<f32>(buf::IW, t * ih)?;
                dk.matmul_f32(s, &xn, &wi.head_weights.view(), &iw, Gemm { t, n: ih, k: h, groups: 1 })?;
                let topk = self.v::<i32>(buf::TOPK, t * k)?;
                indexer.select(s, &self.common, &iq, &iw, &ic.1.view(), 1.0 / (id as f32).sqrt(), &topk)?;
                let meta = c4a.build(s, &self.common, &topk)?;
                Some(meta.decode.ok_or_else(|| ModelError::Step("the c4a builder produced no rows".into()))?.ragged)
            }
            _ => None,
        };
        let swa_cache = caches.swa.view();
        let main = RaggedKv { cache: &swa_cache, indices: &meta.swa.indices, indptr: &meta.swa.indptr };
        let comp_cache = caches.compressed.as_ref().map(|(_, k)| k.view());
        let extra_lists = match c.layer_kind(l) {
            LayerKind::SwaOnly => None,
            LayerKind::C128a => meta.c128a.as_ref(),
            LayerKind::C4a => c4a_ragged.as_ref(),
        };
        let extra = match (extra_lists, &comp_cache) {
            (Some(r), Some(cache)) => Some(RaggedKv { cache, indices: &r.indices, indptr: &r.indptr }),
            _ => None,
        };
        let o = self.v::<bf16>(buf::O, t * heads * d)?;
        let sink = w.attn_sink.view();
        self.attn.attend(s, &qh, &main, extra.as_ref(), &sink, &o, 1.0 / (d as f32).sqrt())?;
        dk.rope(s, &o, &positions, t, heads, d, rope, theta, true)?;
        let (gq, r) = (self.local.o_groups, c.o_lora_rank);
        let oa = self.v::<bf16>(buf::OA, t * gq * r)?;
        dk.matmul(s, &o, &w.wo_a.view(), &oa, Gemm { t, n: r, k: heads * d / gq, groups: gq })?;
        self.row_parallel(s, &oa, &w.wo_b, Gemm { t, n: h, k: gq * r, groups: 1 })
    }

    /// `y [t, H] = x · wᵀ` for a projection whose input features are split across the
    /// tensor-parallel ranks: without tensor parallelism one bf16 matmul; with it, this rank's
    /// f32 partial sums, one all-reduce (in place), then one round to bf16.
    fn row_parallel(&self, s: &Stream, x: &View<bf16>, w: &Buffer<bf16>, g: Gemm) -> Result<()> {
        let y = self.v::<bf16>(buf::Y, g.t * g.n)?;
        let Some(comm) = &self.tp else {
            self.dense.matmul(s, x, &w.view(), &y, g)?;
            return Ok(());
        };
        let yp = self.v::<f32>(buf::YP, g.t * g.n)?;
        self.dense.matmul_f32(s, x, &w.view(), &yp, g)?;
        comm.all_reduce(s, &yp, &yp, ReduceOp::Sum)?;
        self.dense.to_bf16(s, &yp, &y, g.t * g.n)?;
        Ok(())
    }

    /// This rank's communicator, under tensor parallelism.
    pub fn communicator(&self) -> Option<&Communicator> {
        self.tp.as_ref()
    }

    /// `residual ← post(y)`, then the pre of `next` into `x` and post/comb set `to`.
    fn post_pre(&self, s: &Stream, t: usize, from: usize, next: &HcTensors) -> Result<()> {
        let (h, n) = (self.cfg.hidden_size, self.cfg.hc_mult);
        let to = 1 - from;
        let (y, res) = (self.v::<bf16>(buf::Y, t * h)?, self.v::<bf16>(buf::RESIDUAL, t * n * h)?);
        let (post_in, comb_in) = (self.v(buf::POST[from], t * n)?, self.v(buf::COMB[from], t * n * n)?);
        let (post, comb, x) =
            (self.v(buf::POST[to], t * n)?, self.v(buf::COMB[to], t * n * n)?, self.v(buf::X, t * h)?);
        let (f, sc, b) = Self::pre_weights(next);
        self.mhc.fused_post_pre(
            s,
            &MhcPostInputs { x: &y, residual: &res, post: &post_in, comb: &comb_in },
            &MhcPreWeights { hc_fn: &f, scale: &sc, base: &b },
            &self.pre_params,
            &res,
            &MhcPreOutputs { post: &post, comb: &comb, layer_input: &x },
        )?;
        Ok(())
    }

    /// Piece `l + 1`: post/pre around layer `l`'s FFN, then the next layer's pre or the LM head.
    fn ffn_piece(&self, s: &Stream, l: usize, t: usize) -> Result<()> {
        let c = &self.cfg;
        let w = &self.weights.layers[l];
        let (h, n, f, eps) = (c.hidden_size, c.hc_mult, self.local.ffn, c.rms_norm_eps);
        let dk = &self.dense;
        // After attention the live post/comb set is 0; after the FFN's pre it is 1.
        self.post_pre(s, t, 0, &w.hc_ffn)?;
        let (x, xn) = (self.v::<bf16>(buf::X, t * h)?, self.v::<bf16>(buf::XN, t * h)?);
        dk.rms_norm(s, &x, &w.ffn_norm.view(), &xn, t, h, eps)?;
        let gu = self.v::<bf16>(buf::GU, t * 2 * f)?;
        dk.matmul(s, &xn, &w.w13.view(), &gu, Gemm { t, n: 2 * f, k: h, groups: 1 })?;
        let act = self.v::<bf16>(buf::ACT, t * f)?;
        dk.swiglu(s, &gu, &act, t, f, c.swiglu_limit)?;
        self.row_parallel(s, &act, &w.w2, Gemm { t, n: h, k: f, groups: 1 })?;
        let y = self.v::<bf16>(buf::Y, t * h)?;
        if l + 1 < c.num_hidden_layers {
            return self.post_pre(s, t, 1, &self.weights.layers[l + 1].hc_attn);
        }
        let res = self.v::<bf16>(buf::RESIDUAL, t * n * h)?;
        let (post, comb) = (self.v(buf::POST[1], t * n)?, self.v(buf::COMB[1], t * n * n)?);
        self.mhc.post(s, &y, &res, &post, &comb, &res)?;
        let hid = self.v::<bf16>(buf::H, t * h)?;
        let (hf, hs, hb) =
            (self.weights.hc_head_fn.view(), self.weights.hc_head_scale.view(), self.weights.hc_head_base.view());
        self.mhc.hc_head(s, &res, &HcHeadWeights { hc_fn: &hf, scale: &hs, base: &hb }, &self.head_params, &hid)?;
        dk.rms_norm(s, &hid, &self.weights.norm.view(), &hid, t, h, eps)?;
        let rows = sample_rows(t, self.limits.max_num_seqs);
        let sampled = self.v::<bf16>(buf::HS, rows * h)?;
        // The gather of the sampled rows is an embedding lookup into the T rows of `h`.
        dk.embed(s, &hid, &self.sample_rows.buffer().prefix(rows)?, &sampled, rows, h, t)?;
        let logits = self.v::<f32>(buf::LOGITS, rows * c.vocab_size)?;
        dk.matmul_f32(
            s,
            &sampled,
            &self.weights.head.view(),
            &logits,
            Gemm { t: rows, n: c.vocab_size, k: h, groups: 1 },
        )?;
        dk.argmax(s, &logits, &self.v(buf::TOKENS, rows)?, rows, c.vocab_size)?;
        Ok(())
    }
}

/// The step's shared ragged lists.
struct StepMeta {
    swa: holdfast_attention::Ragged,
    c128a: Option<holdfast_attention::Ragged>,
}

impl Forward for ModelForward {
    fn prepare(&mut self, _stream: &Stream, desc: &BatchDescriptor, kind: StepKind) -> Result<(), GraphError> {
        let t = desc.num_tokens as usize;
        if t == 0 || t > self.limits.max_num_batched_tokens {
            return Err(to_graph(
                "prepare",
                ModelError::Step(format!(
                    "a step of {t} token rows; this model runs 1 to {} (max_num_batched_tokens)",
                    self.limits.max_num_batched_tokens
                )),
            ));
        }
        if kind != StepKind::Step {
            // A warm-up or capture stages padding into the same mapped inputs: it would replace a
            // staged step, which would then run on padding. Capture before staging (this forward
            // does not support the graph runner's lazy capture).
            if let Some(s) = self.staged {
                return Err(to_graph(
                    "prepare",
                    ModelError::Step(format!(
                        "a {kind:?} run would overwrite the step staged for {s} token rows: capture graphs before staging a step (lazy capture is not supported)"
                    )),
                ));
            }
            return self.stage(t, None).map_err(g("prepare"));
        }
        match self.staged.take() {
            Some(staged) if staged == t => Ok(()),
            staged => Err(to_graph(
                "prepare",
                ModelError::Step(match staged {
                    Some(s) => format!("the step was staged for {s} token rows but runs with {t}"),
                    None => "no step was staged before running the forward".into(),
                }),
            )),
        }
    }

    fn run(
        &mut self,
        stream: &Stream,
        desc: &BatchDescriptor,
        _mode: RuntimeMode,
        pieces: &mut PieceCtx<'_>,
    ) -> Result<(), GraphError> {
        let t = desc.num_tokens as usize;
        let this = &*self;
        let mut meta = None;
        pieces.splitting_op(stream, "attention metadata", &[], |s| {
            meta = Some(this.metadata(s).map_err(g("attention metadata"))?);
            Ok(())
        })?;
        let meta = meta.ok_or_else(|| to_graph("attention metadata", ModelError::Step("not built".into())))?;
        pieces.piece(stream, |s| this.head_piece(s, t).map_err(g("embed + layer 0 mhc_pre")))?;
        let h = this.cfg.hidden_size;
        for l in 0..this.cfg.num_hidden_layers {
            // The op writes y, and under tensor parallelism the f32 partial sums too.
            let y = this.arena.view::<bf16>(buf::Y, t * h)?.raw();
            let outputs = match this.tp {
                Some(_) => [y, this.arena.view::<f32>(buf::YP, t * h)?.raw()],
                None => [y.clone(), y],
            };
            let outputs = &outputs[..if this.tp.is_some() { 2 } else { 1 }];
            let (attn, ffn) = &this.op_names[l];
            pieces.splitting_op(stream, attn, outputs, |s| this.attention(s, l, t, &meta).map_err(g(attn)))?;
            pieces.piece(stream, |s| this.ffn_piece(s, l, t).map_err(g(ffn)))?;
        }
        Ok(())
    }
}
