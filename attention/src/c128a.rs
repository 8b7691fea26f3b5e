//! c128a (heavily compressed attention) metadata builder (spec §5.2, ragged form of §5.4).

use holdfast_graph::CgSupport;
use holdfast_hal::{Buffer, Device, Stream, View};
use holdfast_kernels::Kernels;

use crate::common::{
    counting_syncs, persistent_alloc, BufferAlloc, BuildStats, CommonAttentionMetadata, CommonConfig, Ragged,
    RaggedBuffers, StepLayout, TableKind,
};
use crate::error::{AttentionError, Result};
use crate::source::{row_grid, AttnKernels};

/// Tokens per c128a compressed entry.
pub const C128A_RATIO: usize = 128;
/// Row-width alignment of the c128a index buffers (FlashMLA's `B_TOPK`).
pub const C128A_ALIGN: usize = 128;
/// Blocks per compute unit to hold the c128a decode build to ([`C128aBuilder::with_grid_cap`])
/// when the c4a build runs beside it on another stream (a step's metadata captured with the
/// builds on forked branches). One block per row gives the c128a build every register file at
/// 1024 rows (8 blocks of 128 threads at 62 registers per multiprocessor), so the c4a build
/// waits for it; with 3 per unit both run at once. On an H100, the upload and all three builds
/// at 1024 rows took 32.98–33.39 µs against 35.89–36.61 uncapped (2 per unit: 34.18–34.75, 4:
/// 33.73–35.07, 5: 34.26–35.04), while the upload and the c128a build alone took 29.5–30.0 µs
/// against 26.5–27.0; at up to 256 rows the grid is the same.
pub const C128A_SHARED_BLOCKS_PER_UNIT: u32 = 3;

/// `round_up(ceil(max_model_len / 128), 128)`: the width of every c128a index row.
pub fn c128a_max_compressed(max_model_len: usize) -> usize {
    max_model_len.div_ceil(C128A_RATIO).div_ceil(C128A_ALIGN) * C128A_ALIGN
}

/// Decode-row c128a metadata (rows `[0, num_decode_tokens)`).
#[derive(Clone, Debug)]
pub struct C128aDecode {
    /// `[num_decode_tokens, max_compressed]` global c128a slots, -1 after each row's length.
    pub indices: View<i32>,
    /// `[num_decode_tokens]` valid entries: `min((pos + 1) / 128, max_compressed)`, 0 for invalid.
    pub lens: View<i32>,
    /// The same rows in ragged form, `max_entries_per_row = max_compressed`.
    pub ragged: Ragged,
}

/// Everything the c128a builder produced for one step.
#[derive(Clone, Debug)]
pub struct C128aMetadata {
    /// The step's shape.
    pub layout: StepLayout,
    /// Present when the step has decode rows.
    pub decode: Option<C128aDecode>,
    /// `[num_prefill_tokens, max_compressed]` local compressed indices `0 .. n − 1`, -1 after;
    /// present when the step has prefill tokens.
    pub prefill_indices: Option<View<i32>>,
    /// Launches and host syncs of this build.
    pub stats: BuildStats,
}

/// Builds, per token, the list of every compressed c128a entry visible to it.
pub struct C128aBuilder {
    width: usize,
    cbs: usize,
    max_tokens: usize,
    kernels: Kernels,
    attn: AttnKernels,
    decode: Buffer<i32>,
    lens: Buffer<i32>,
    prefill: Buffer<i32>,
    ragged: RaggedBuffers,
    grid_cap: Option<u32>,
}

impl std::fmt::Debug for C128aBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "C128aBuilder(width {}, {} tokens, grid cap {:?})", self.width, self.max_tokens, self.grid_cap)
    }
}

/// Whether the c128a decode build of `rows` rows stores each dense row's -1 tail before its
/// table row and the lengths before it have loaded (`early_tail` of `hf_dsv4_c128a_decode`; the
/// outputs are the same either way). At up to two rows per multiprocessor the stores overlap the
/// loads' latency: on an H100 the upload + c128a build at 1 row took 8.5–8.9 µs against
/// 10.1–10.4, at 64 and 256 rows 3% less; at 1024 rows, where the stores already fill the
/// memory system, the upload + SWA + c128a builds took 2% longer with them.
fn early_tail(rows: usize, compute_units: u32) -> bool {
    rows <= 2 * compute_units.max(1) as usize
}

/// Blocks of the c128a decode build of `rows` rows: one per row, or at most `cap` per compute
/// unit (each block then builds every grid-th row). At least 1.
fn decode_blocks(rows: usize, compute_units: u32, cap: Option<u32>) -> usize {
    let rows = rows.max(1);
    match cap {
        Some(k) => rows.min(k as usize * compute_units.max(1) as usize),
        None => rows,
    }
}

impl C128aBuilder {
    /// The graph support this builder declares.
    pub const CG_SUPPORT: CgSupport = CgSupport::UniformBatch;

    /// A builder whose rows are `c128a_max_compressed(cfg.max_model_len)` wide; the compressed
    /// block size is `cfg.kv_table.block_size / 128` entries.
    pub fn new(dev: &Device, cfg: &CommonConfig) -> Result<Self> {
        Self::new_with_alloc(dev, cfg, &persistent_alloc)
    }

    /// As [`C128aBuilder::new`], allocating every output buffer with `alloc`.
    pub fn new_with_alloc(dev: &Device, cfg: &CommonConfig, alloc: BufferAlloc<'_>) -> Result<Self> {
        let bs = cfg.kv_table.block_size;
        if !bs.is_multiple_of(C128A_RATIO) {
            return Err(AttentionError::Config(format!("KV block size {bs} is not a multiple of {C128A_RATIO}")));
        }
        let width = c128a_max_compressed(cfg.max_model_len);
        let t = cfg.max_num_batched_tokens;
        let ragged = RaggedBuffers::new(dev, alloc, "attn.c128a.ragged", t, width)?;
        Ok(C128aBuilder {
            width,
            cbs: bs / C128A_RATIO,
            max_tokens: t,
            kernels: Kernels::new(dev)?,
            attn: AttnKernels::new(dev)?,
            decode: alloc(dev, "attn.c128a.global_decode", (t * width).max(1))?,
            lens: alloc(dev, "attn.c128a.decode_lens", t)?,
            prefill: alloc(dev, "attn.c128a.prefill", (t * width).max(1))?,
            ragged,
            grid_cap: None,
        })
    }

    /// Holds the decode build's grid to `blocks_per_unit` blocks per compute unit (`None`, the
    /// default: one block per row). The outputs are the same either way; capped, the build
    /// leaves room for kernels that run beside it, such as the c4a build on another stream
    /// ([`C128A_SHARED_BLOCKS_PER_UNIT`]). A cap of 0 is a configuration error.
    pub fn with_grid_cap(mut self, blocks_per_unit: Option<u32>) -> Result<Self> {
        if blocks_per_unit == Some(0) {
            return Err(AttentionError::Config(
                "c128a grid cap of 0 blocks per compute unit: it must be at least 1 (or none)".into(),
            ));
        }
        self.grid_cap = blocks_per_unit;
        Ok(self)
    }

    /// The decode build's blocks per compute unit, if capped ([`C128aBuilder::with_grid_cap`]).
    pub fn grid_cap(&self) -> Option<u32> {
        self.grid_cap
    }

    /// Row width: `round_up(ceil(max_model_len / 128), 128)` entries.
    pub fn max_compressed(&self) -> usize {
        self.width
    }

    /// Fills every output buffer, whole, with `value` (tests poison outputs so that unwritten
    /// elements show). One launch per buffer on `s`.
    pub fn fill_outputs(&self, s: &Stream, value: i32) -> Result<()> {
        for b in [&self.decode, &self.lens, &self.prefill, &self.ragged.indptr, &self.ragged.flat] {
            self.kernels.fill_i32(s, &b.view(), value)?;
        }
        Ok(())
    }

    /// Enqueues the step's c128a build on `s`: at most 2 launches (decode rows: one for the per-row lists and their ragged form; prefill rows: one), no host sync.
    pub fn build(&self, s: &Stream, common: &CommonAttentionMetadata) -> Result<C128aMetadata> {
        let c = common.config();
        if c.max_num_batched_tokens > self.max_tokens || c128a_max_compressed(c.max_model_len) != self.width {
            return Err(AttentionError::Mismatch(format!(
                "common metadata sized for {} tokens / width {}, c128a builder for {} / {}",
                c.max_num_batched_tokens,
                c128a_max_compressed(c.max_model_len),
                self.max_tokens,
                self.width
            )));
        }
        let layout = common.layout()?;
        let dev = common.device().clone();
        let ((decode, prefill_indices, launches), host_syncs) = counting_syncs(&dev, || {
            let mut launches = 0;
            let (d, w) = (layout.num_decode_tokens, self.width);
            let bt = common.table_config(TableKind::Kv);
            let decode = if d > 0 {
                let ragged = self.ragged.views(d)?;
                let (indices, lens) = (self.decode.prefix(d * w)?, self.lens.slice(0, d)?);
                let args = [
                    (&common.positions()?.slice(0, d)?).into(),
                    (&common.slot_mapping()?.slice(0, d)?).into(),
                    (&common.token_to_req()?.slice(0, d)?).into(),
                    (&common.table_rows()?).into(),
                    (&common.block_table(TableKind::Kv)?).into(),
                    (&indices).into(),
                    (&lens).into(),
                    (&ragged.indptr).into(),
                    (&ragged.indices).into(),
                    (d as u32).into(),
                    (w as u32).into(),
                    (C128A_RATIO as u32).into(),
                    (self.cbs as u32).into(),
                    (bt.max_blocks_per_seq as u32).into(),
                    u32::from(early_tail(d, dev.info().compute_units)).into(),
                ];
                let blocks = decode_blocks(d, dev.info().compute_units, self.grid_cap);
                s.launch_dependent(&self.attn.c128a_decode, row_grid(blocks, 128), &args)?;
                launches += 1;
                Some(C128aDecode { indices, lens, ragged })
            } else {
                None
            };
            let p = layout.num_prefill_tokens;
            let prefill = if p > 0 {
                let out = self.prefill.prefix(p * w)?;
                let args = [
                    (&common.positions()?.slice(d, p)?).into(),
                    (&common.slot_mapping()?.slice(d, p)?).into(),
                    (&common.token_to_req()?.slice(d, p)?).into(),
                    (&out).into(),
                    (p as u32).into(),
                    (w as u32).into(),
                    (C128A_RATIO as u32).into(),
                ];
                s.launch_dependent(&self.attn.c128a_prefill, row_grid(p, 128), &args)?;
                launches += 1;
                Some(out)
            } else {
                None
            };
            Ok((decode, prefill, launches))
        })?;
        Ok(C128aMetadata { layout, decode, prefill_indices, stats: BuildStats { launches, host_syncs } })
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_blocks, early_tail};

    #[test]
    fn a_capped_decode_grid_holds_at_most_cap_blocks_per_unit() {
        assert_eq!(decode_blocks(1024, 132, None), 1024);
        assert_eq!(decode_blocks(1024, 132, Some(3)), 396);
        assert_eq!(decode_blocks(256, 132, Some(3)), 256);
        assert_eq!(decode_blocks(1024, 132, Some(1)), 132);
        assert_eq!(decode_blocks(0, 132, Some(3)), 1);
        // A device that reports no units counts as one.
        assert_eq!(decode_blocks(1024, 0, Some(3)), 3);
    }

    #[test]
    fn early_tail_stores_up_to_two_rows_per_multiprocessor() {
        assert!(early_tail(1, 132));
        assert!(early_tail(264, 132));
        assert!(!early_tail(265, 132));
        assert!(!early_tail(1024, 132));
        // A device that reports no units counts as one.
        assert!(early_tail(2, 0));
        assert!(!early_tail(3, 0));
    }
}
