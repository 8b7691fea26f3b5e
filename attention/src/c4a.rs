//! c4a (compressed sparse attention) decode metadata: indexer top-k → global ragged (spec §5.4,
//! `compute_global_topk_ragged_indices_and_indptr`), entirely on the device.

use holdfast_graph::CgSupport;
use holdfast_hal::{Buffer, Device, LaunchConfig, Stream, View};
use holdfast_kernels::Kernels;

use crate::common::{
    counting_syncs, persistent_alloc, BufferAlloc, BuildStats, CommonAttentionMetadata, CommonConfig, Ragged,
    RaggedBuffers, StepLayout, TableKind,
};
use crate::error::{AttentionError, Result};
use crate::source::{row_grid, AttnKernels, C4A_MAX_ENTRIES, C4A_SYNC_WORDS, C4A_THREADS};

/// Tokens per c4a compressed entry.
pub const C4A_RATIO: usize = 4;

/// Decode-row c4a metadata (rows `[0, num_decode_tokens)`).
#[derive(Clone, Debug)]
pub struct C4aDecode {
    /// `[num_decode_tokens]` kept top-k entries per row (0 for invalid tokens).
    pub lens: View<i32>,
    /// Global c4a slots of the kept entries in row order, `max_entries_per_row = topk`.
    pub ragged: Ragged,
}

/// Everything the c4a builder produced for one step.
#[derive(Clone, Debug)]
pub struct C4aMetadata {
    /// The step's shape.
    pub layout: StepLayout,
    /// Present when the step has decode rows.
    pub decode: Option<C4aDecode>,
    /// Launches and host syncs of this build.
    pub stats: BuildStats,
}

/// Turns the indexer's local top-k compressed positions into global ragged slot lists.
///
/// An entry `v` of token `t`'s row is kept iff `t` is valid and `0 ≤ v < (pos + 1) / 4` (the
/// compressed entries that exist for it); kept entries keep their row order.
pub struct C4aBuilder {
    topk: usize,
    cbs: usize,
    max_tokens: usize,
    kernels: Kernels,
    attn: AttnKernels,
    lens: Buffer<i32>,
    ragged: RaggedBuffers,
    /// The kernel's block counters (zero between launches).
    sync: Buffer<i32>,
    /// `[max_num_batched_tokens]` chained-scan status word per row (zero between launches).
    status: Buffer<i32>,
}

impl std::fmt::Debug for C4aBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "C4aBuilder(topk {}, {} tokens)", self.topk, self.max_tokens)
    }
}

impl C4aBuilder {
    /// The graph support this builder declares.
    pub const CG_SUPPORT: CgSupport = CgSupport::UniformBatch;

    /// A builder for `topk` (`index_topk`) entries per token; the compressed block size is
    /// `cfg.kv_table.block_size / 4` entries.
    pub fn new(dev: &Device, cfg: &CommonConfig, topk: usize) -> Result<Self> {
        Self::new_with_alloc(dev, cfg, topk, &persistent_alloc)
    }

    /// As [`C4aBuilder::new`], allocating every output buffer with `alloc`.
    pub fn new_with_alloc(dev: &Device, cfg: &CommonConfig, topk: usize, alloc: BufferAlloc<'_>) -> Result<Self> {
        let bs = cfg.kv_table.block_size;
        if !bs.is_multiple_of(C4A_RATIO) {
            return Err(AttentionError::Config(format!("KV block size {bs} is not a multiple of {C4A_RATIO}")));
        }
        if topk == 0 {
            return Err(AttentionError::Config("index_topk must be positive".into()));
        }
        let t = cfg.max_num_batched_tokens;
        if t.checked_mul(topk).is_none_or(|e| e > C4A_MAX_ENTRIES) {
            return Err(AttentionError::Config(format!(
                "max_num_batched_tokens {t} × index_topk {topk} exceeds the {C4A_MAX_ENTRIES} entries a c4a build counts"
            )));
        }
        let ragged = RaggedBuffers::new(dev, alloc, "attn.c4a.ragged", t, topk)?;
        let sync = dev.alloc_zeroed::<i32>("attn.c4a.sync", C4A_SYNC_WORDS, true)?;
        let status = dev.alloc_zeroed::<i32>("attn.c4a.scan_status", t.max(1), true)?;
        Ok(C4aBuilder {
            sync,
            status,
            topk,
            cbs: bs / C4A_RATIO,
            max_tokens: t,
            kernels: Kernels::new(dev)?,
            attn: AttnKernels::new(dev)?,
            lens: alloc(dev, "attn.c4a.decode_lens", t)?,
            ragged,
        })
    }

    /// Entries per top-k row.
    pub fn topk(&self) -> usize {
        self.topk
    }

    /// Fills every output buffer, whole, with `value` (tests poison outputs so that unwritten
    /// elements show). One launch per buffer on `s`.
    pub fn fill_outputs(&self, s: &Stream, value: i32) -> Result<()> {
        for b in [&self.lens, &self.ragged.indptr, &self.ragged.flat] {
            self.kernels.fill_i32(s, &b.view(), value)?;
        }
        Ok(())
    }

    /// Enqueues the step's c4a decode build on `s` from `topk_indices` (`[≥ num_decode_tokens,
    /// topk]` local compressed positions, -1 padded; the indexer's persistent output): 1 launch of
    /// one block per row (the lengths, their scan and the pack in one pass: a chained scan over
    /// per-row status words, rows taken in the order blocks start), no host sync. The scan's
    /// counters and status words are this builder's, so one build per builder may be in flight
    /// at a time (enqueue builds of one builder on one stream, or on one branch of a graph).
    pub fn build(&self, s: &Stream, common: &CommonAttentionMetadata, topk_indices: &View<i32>) -> Result<C4aMetadata> {
        let c = common.config();
        if c.max_num_batched_tokens > self.max_tokens {
            return Err(AttentionError::Mismatch(format!(
                "common metadata sized for {} tokens, c4a builder for {}",
                c.max_num_batched_tokens, self.max_tokens
            )));
        }
        let layout = common.layout()?;
        let (d, k) = (layout.num_decode_tokens, self.topk);
        if topk_indices.len() < d * k {
            return Err(AttentionError::Mismatch(format!(
                "top-k indices hold {} entries, [{d}, {k}] needs {}",
                topk_indices.len(),
                d * k
            )));
        }
        let dev = common.device().clone();
        let ((decode, launches), host_syncs) = counting_syncs(&dev, || {
            if d == 0 {
                return Ok((None, 0));
            }
            let bt = common.table_config(TableKind::Kv);
            let topk = topk_indices.slice(0, d * k)?;
            let (pos, slots, req) = (
                common.positions()?.slice(0, d)?,
                common.slot_mapping()?.slice(0, d)?,
                common.token_to_req()?.slice(0, d)?,
            );
            let lens = self.lens.slice(0, d)?;
            let ragged = self.ragged.views(d)?;
            let args = [
                (&topk).into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&common.table_rows()?).into(),
                (&common.block_table(TableKind::Kv)?).into(),
                (&lens).into(),
                (&ragged.indptr).into(),
                (&ragged.indices).into(),
                (&self.sync).into(),
                (&self.status).into(),
                (d as u32).into(),
                (k as u32).into(),
                (C4A_RATIO as u32).into(),
                (self.cbs as u32).into(),
                (bt.max_blocks_per_seq as u32).into(),
                // Block b takes row b where the grid (a block per row) is resident at once: no block
                // spends its two round trips to L2 on tickets (the row's and the one that ends its
                // loop), and no look-back waits on a block that never started; past that, tickets.
                // The outputs are the same either way. On an H100 (three alternations) the upload
                // + c4a build took 0.98× at 1 row, 0.97× at 8 and 0.99× at 64, and the step's
                // upload + three builds 0.96–0.97×.
                u32::from(LaunchConfig::grid_resident_at_once(d, dev.info().compute_units as usize)).into(),
            ];
            s.launch_dependent(&self.attn.c4a_decode, row_grid(d, C4A_THREADS), &args)?;
            Ok((Some(C4aDecode { lens, ragged }), 1))
        })?;
        Ok(C4aMetadata { layout, decode, stats: BuildStats { launches, host_syncs } })
    }
}
