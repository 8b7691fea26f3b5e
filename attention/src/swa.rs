//! SWA metadata builder (spec §5.3, ragged form of §5.4).

use holdfast_graph::CgSupport;
use holdfast_hal::{Buffer, Device, Stream, View};
use holdfast_kernels::Kernels;

use crate::common::{
    counting_syncs, persistent_alloc, BufferAlloc, BuildStats, CommonAttentionMetadata, CommonConfig, Ragged,
    RaggedBuffers, StepLayout, TableKind,
};
use crate::error::{AttentionError, Result};
use crate::source::{row_grid, AttnKernels};

/// Decode-row SWA metadata of one step (rows `[0, num_decode_tokens)`).
#[derive(Clone, Debug)]
pub struct SwaDecode {
    /// `[num_decode_tokens, window]` global SWA slots, -1 after each row's length.
    pub indices: View<i32>,
    /// `[num_decode_tokens]` valid entries per row: `min(pos + 1, window)`, 0 for invalid tokens.
    pub lens: View<i32>,
    /// The same rows in ragged form, `max_entries_per_row = window`.
    pub ragged: Ragged,
}

/// Prefill SWA metadata of one step (requests `[num_decodes, num_decodes + num_prefills)`).
#[derive(Clone, Debug)]
pub struct SwaPrefill {
    /// `[num_prefills]` tokens to gather per request: `query_len + min(prefix_len, window − 1)`.
    pub gather_lens: View<i32>,
    /// `[num_prefills]` sequence lengths of the prefill requests.
    pub seq_lens: View<i32>,
}

/// Everything the SWA builder produced for one step.
#[derive(Clone, Debug)]
pub struct SwaMetadata {
    /// The step's shape.
    pub layout: StepLayout,
    /// Present when the step has decode rows.
    pub decode: Option<SwaDecode>,
    /// Present when the step has prefill requests.
    pub prefill: Option<SwaPrefill>,
    /// Launches and host syncs of this build.
    pub stats: BuildStats,
}

/// Builds the sliding-window indices of every decode token into persistent buffers.
pub struct SwaBuilder {
    window: usize,
    max_tokens: usize,
    max_seqs: usize,
    kernels: Kernels,
    attn: AttnKernels,
    indices: Buffer<i32>,
    lens: Buffer<i32>,
    ragged: RaggedBuffers,
    gather_lens: Buffer<i32>,
}

impl std::fmt::Debug for SwaBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SwaBuilder(window {}, {} tokens)", self.window, self.max_tokens)
    }
}

impl SwaBuilder {
    /// The graph support this builder declares.
    pub const CG_SUPPORT: CgSupport = CgSupport::UniformBatch;

    /// A builder for `window` tokens (the config's `sliding_window`), with persistent buffers for
    /// `cfg.max_num_batched_tokens` rows.
    pub fn new(dev: &Device, cfg: &CommonConfig, window: usize) -> Result<Self> {
        Self::new_with_alloc(dev, cfg, window, &persistent_alloc)
    }

    /// As [`SwaBuilder::new`], allocating every output buffer with `alloc` (tests plant
    /// non-persistent buffers through it).
    pub fn new_with_alloc(dev: &Device, cfg: &CommonConfig, window: usize, alloc: BufferAlloc<'_>) -> Result<Self> {
        if window == 0 || window > i32::MAX as usize {
            return Err(AttentionError::Config(format!("SWA window {window} must lie in [1, i32::MAX]")));
        }
        let t = cfg.max_num_batched_tokens;
        let ragged = RaggedBuffers::new(dev, alloc, "attn.swa.ragged", t, window)?;
        Ok(SwaBuilder {
            window,
            max_tokens: t,
            max_seqs: cfg.max_num_seqs,
            kernels: Kernels::new(dev)?,
            attn: AttnKernels::new(dev)?,
            indices: alloc(dev, "attn.swa.decode_indices", (t * window).max(1))?,
            lens: alloc(dev, "attn.swa.decode_lens", t)?,
            ragged,
            gather_lens: alloc(dev, "attn.swa.prefill_gather_lens", cfg.max_num_seqs)?,
        })
    }

    /// The window, in tokens.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Fills every output buffer, whole, with `value` (tests poison outputs so that unwritten
    /// elements show). One launch per buffer on `s`.
    pub fn fill_outputs(&self, s: &Stream, value: i32) -> Result<()> {
        for b in [&self.indices, &self.lens, &self.ragged.indptr, &self.ragged.flat, &self.gather_lens] {
            self.kernels.fill_i32(s, &b.view(), value)?;
        }
        Ok(())
    }

    /// Enqueues the step's SWA metadata build on `s`: at most 2 launches (decode rows: one for the per-row lists and their ragged form; prefill rows: one), no host sync.
    pub fn build(&self, s: &Stream, common: &CommonAttentionMetadata) -> Result<SwaMetadata> {
        let c = common.config();
        if c.max_num_batched_tokens > self.max_tokens || c.max_num_seqs > self.max_seqs {
            return Err(AttentionError::Mismatch(format!(
                "common metadata sized for {} tokens / {} requests, SWA builder for {} / {}",
                c.max_num_batched_tokens, c.max_num_seqs, self.max_tokens, self.max_seqs
            )));
        }
        let layout = common.layout()?;
        let dev = common.device().clone();
        let ((decode, prefill, launches), host_syncs) = counting_syncs(&dev, || {
            let mut launches = 0;
            let d = layout.num_decode_tokens;
            let decode = if d > 0 {
                let w = self.window;
                let bt = common.table_config(TableKind::Swa);
                let ragged = self.ragged.views(d)?;
                let (indices, lens) = (self.indices.prefix(d * w)?, self.lens.slice(0, d)?);
                let args = [
                    (&common.positions()?.slice(0, d)?).into(),
                    (&common.slot_mapping()?.slice(0, d)?).into(),
                    (&common.token_to_req()?.slice(0, d)?).into(),
                    (&common.table_rows()?).into(),
                    (&common.block_table(TableKind::Swa)?).into(),
                    (&indices).into(),
                    (&lens).into(),
                    (&ragged.indptr).into(),
                    (&ragged.indices).into(),
                    (d as u32).into(),
                    (w as u32).into(),
                    (bt.block_size as u32).into(),
                    (bt.max_blocks_per_seq as u32).into(),
                ];
                s.launch_dependent(&self.attn.swa_decode, row_grid(d, 128), &args)?;
                launches += 1;
                Some(SwaDecode { indices, lens, ragged })
            } else {
                None
            };
            let (nd, p) = (layout.num_decodes, layout.num_prefills);
            let prefill = if p > 0 {
                let gather_lens = self.gather_lens.prefix(p)?;
                let seq_lens = common.seq_lens()?.slice(nd, p)?;
                let args = [
                    (&common.query_start_loc()?.slice(nd, p + 1)?).into(),
                    (&seq_lens).into(),
                    (&gather_lens).into(),
                    (p as u32).into(),
                    (self.window as u32).into(),
                ];
                s.launch_dependent(
                    &self.attn.swa_prefill_gather_lens,
                    holdfast_hal::LaunchConfig::for_elements(p, 128),
                    &args,
                )?;
                launches += 1;
                Some(SwaPrefill { gather_lens, seq_lens })
            } else {
                None
            };
            Ok((decode, prefill, launches))
        })?;
        Ok(SwaMetadata { layout, decode, prefill, stats: BuildStats { launches, host_syncs } })
    }
}
