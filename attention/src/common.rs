//! Per-step common attention metadata: validated on the host, padded, staged in pinned memory and
//! uploaded into persistent device buffers (spec §3.4).

use holdfast_hal::{Buffer, Device, PinnedBuffer, Stream, View};

use crate::error::{invalid, AttentionError, Result};

/// Shape of one paged block table (one KV-cache group).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTableConfig {
    /// Tokens per block of this cache group (64 for the SWA cache, 256 for the main MLA cache).
    pub block_size: usize,
    /// Columns of the table: blocks a request may hold (row width, in blocks).
    pub max_blocks_per_seq: usize,
    /// Blocks in the cache; ids must lie in `[0, num_blocks)` (block 0 is the null block).
    pub num_blocks: usize,
}

/// Sizes fixed at construction; every persistent buffer is sized from them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonConfig {
    /// Largest token count of a step (rows of every per-token buffer).
    pub max_num_batched_tokens: usize,
    /// Largest request count of a step (rows of every per-request buffer).
    pub max_num_seqs: usize,
    /// Longest sequence, in tokens.
    pub max_model_len: usize,
    /// Speculative tokens per decode; the decode threshold is `1 + num_spec_tokens` query tokens.
    pub num_spec_tokens: usize,
    /// The SWA cache's block table (block size 64 in DeepSeek-V4).
    pub swa_table: BlockTableConfig,
    /// The main (compressed) MLA cache's block table, in uncompressed tokens per block (256).
    pub kv_table: BlockTableConfig,
}

impl CommonConfig {
    /// Query tokens at or below which a request is a decode: `1 + num_spec_tokens`.
    pub fn decode_threshold(&self) -> usize {
        1 + self.num_spec_tokens
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(AttentionError::Config(m));
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.max_model_len == 0 {
            return bad(format!("sizes must be positive: {self:?}"));
        }
        if self.max_num_batched_tokens > i32::MAX as usize || self.max_model_len > i32::MAX as usize {
            return bad("token counts must fit in i32".into());
        }
        for (name, t) in [("swa_table", self.swa_table), ("kv_table", self.kv_table)] {
            if t.block_size == 0 || t.max_blocks_per_seq == 0 || t.num_blocks == 0 {
                return bad(format!("{name}: sizes must be positive: {t:?}"));
            }
            if t.num_blocks.checked_mul(t.block_size).is_none_or(|slots| slots > i32::MAX as usize) {
                return bad(format!("{name}: {} blocks × {} tokens overflow i32 slot ids", t.num_blocks, t.block_size));
            }
            if self.max_num_seqs.checked_mul(t.max_blocks_per_seq).is_none_or(|n| n > u32::MAX as usize) {
                return bad(format!("{name}: [max_num_seqs, max_blocks_per_seq] overflows 32-bit indexing"));
            }
        }
        Ok(())
    }
}

/// One step's host inputs, unpadded: `num_reqs = query_start_loc.len() - 1` requests (decodes
/// first, as the scheduler orders them) and `num_tokens = positions.len()` tokens.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    /// `[num_reqs + 1]` cumulative query lengths, starting at 0 and ending at `num_tokens`.
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]` tokens of each request after this step (context + new queries).
    pub seq_lens: &'a [i32],
    /// `[num_tokens]` absolute position of each query token; must equal
    /// `seq_len − query_len + (t − query_start)` of its request.
    pub positions: &'a [i32],
    /// `[num_tokens]` KV slot each token writes; -1 marks a token that writes nothing.
    pub slot_mapping: &'a [i32],
    /// `[num_reqs, swa_table.max_blocks_per_seq]` row-major SWA block ids; the first
    /// `ceil(seq_len / block_size)` columns of each row must lie in `[0, num_blocks)` (the others
    /// are never read).
    pub swa_block_table: &'a [i32],
    /// `[num_reqs, kv_table.max_blocks_per_seq]` row-major main-cache block ids, same contract.
    pub kv_block_table: &'a [i32],
    /// Request rows after padding (the captured size's request count), `≥ num_reqs`.
    pub num_reqs_padded: usize,
    /// Token rows after padding (the captured size's token count), `≥ num_tokens`.
    pub num_tokens_padded: usize,
}

/// The shape of the staged step: what the builders' launch shapes and views depend on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepLayout {
    /// Real requests.
    pub num_reqs: usize,
    /// Request rows including padding.
    pub num_reqs_padded: usize,
    /// Real tokens.
    pub num_tokens: usize,
    /// Token rows including padding.
    pub num_tokens_padded: usize,
    /// Decode requests (rows `[0, num_decodes)`); padded requests count as decodes on the fast path.
    pub num_decodes: usize,
    /// Decode tokens (rows `[0, num_decode_tokens)` of every per-token buffer).
    pub num_decode_tokens: usize,
    /// Prefill requests (rows `[num_decodes, num_decodes + num_prefills)`).
    pub num_prefills: usize,
    /// Prefill tokens (rows `[num_decode_tokens, num_tokens_padded)`).
    pub num_prefill_tokens: usize,
    /// Longest real query.
    pub max_query_len: usize,
}

/// Which block table a builder reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableKind {
    /// The SWA cache's table.
    Swa,
    /// The main compressed-MLA cache's table.
    Kv,
}

struct Field {
    name: &'static str,
    pinned: PinnedBuffer<i32>,
    device: Buffer<i32>,
}

const QSL: usize = 0;
const SEQ: usize = 1;
const POS: usize = 2;
const SLOT: usize = 3;
const REQ: usize = 4;
const SWA_BT: usize = 5;
const KV_BT: usize = 6;

/// Persistent device copies of a step's common metadata, and the pinned staging they are
/// uploaded from.
///
/// [`CommonAttentionMetadata::stage`] validates and pads on the host and writes the staging;
/// [`CommonAttentionMetadata::upload`] enqueues one pinned→device copy per field on the step's
/// stream (capturable: a graph re-reads the staging at every replay). Views handed out are
/// prefixes whose lengths depend only on the padded counts. The host must not stage the next
/// step while the previous upload may still be reading the staging (wait on an event first).
pub struct CommonAttentionMetadata {
    cfg: CommonConfig,
    device: Device,
    fields: Vec<Field>,
    scratch: Vec<i32>,
    layout: Option<StepLayout>,
}

impl std::fmt::Debug for CommonAttentionMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommonAttentionMetadata").field("cfg", &self.cfg).field("layout", &self.layout).finish()
    }
}

impl CommonAttentionMetadata {
    /// Allocates the persistent device buffers and pinned staging for `cfg`.
    pub fn new(dev: &Device, cfg: CommonConfig) -> Result<Self> {
        cfg.validate()?;
        let (t, r) = (cfg.max_num_batched_tokens, cfg.max_num_seqs);
        let sizes = [
            ("query_start_loc", r + 1),
            ("seq_lens", r),
            ("positions", t),
            ("slot_mapping", t),
            ("token_to_req", t),
            ("swa_block_table", r * cfg.swa_table.max_blocks_per_seq),
            ("kv_block_table", r * cfg.kv_table.max_blocks_per_seq),
        ];
        let mut fields = Vec::with_capacity(sizes.len());
        for (name, len) in sizes {
            let device = dev.alloc_zeroed::<i32>(&format!("attn.common.{name}"), len, true)?;
            fields.push(Field { name, pinned: dev.alloc_pinned::<i32>(len)?, device });
        }
        Ok(CommonAttentionMetadata { cfg, device: dev.clone(), fields, scratch: Vec::new(), layout: None })
    }

    /// The construction-time sizes.
    pub fn config(&self) -> &CommonConfig {
        &self.cfg
    }

    /// The device the buffers live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The layout of the staged step, or [`AttentionError::NotStaged`].
    pub fn layout(&self) -> Result<StepLayout> {
        self.layout.ok_or(AttentionError::NotStaged)
    }

    /// Validates `input`, pads it (padded requests: query length 0, seq len 0, block-table rows of
    /// the null block 0; padded tokens: slot -1, position 0, request -1) and writes the pinned
    /// staging. Host work only; on error nothing is written and the previous step stays staged.
    pub fn stage(&mut self, input: &StepInput<'_>) -> Result<StepLayout> {
        let layout = self.validate(input)?;
        let StepLayout { num_reqs: nr, num_reqs_padded: rp, num_tokens: nt, num_tokens_padded: tp, .. } = layout;
        let mut scratch = std::mem::take(&mut self.scratch);
        // Real rows straight into the staging, then the padding rows after them.
        let mut put = |field: usize, real: &[i32], pad: i32, padded_len: usize| -> Result<()> {
            let pinned = &self.fields[field].pinned;
            pinned.write(0, real)?;
            scratch.clear();
            scratch.resize(padded_len - real.len(), pad);
            pinned.write(real.len(), &scratch)?;
            Ok(())
        };
        put(QSL, input.query_start_loc, nt as i32, rp + 1)?;
        put(SEQ, input.seq_lens, 0, rp)?;
        put(POS, input.positions, 0, tp)?;
        put(SLOT, input.slot_mapping, -1, tp)?;
        put(SWA_BT, input.swa_block_table, 0, rp * self.cfg.swa_table.max_blocks_per_seq)?;
        put(KV_BT, input.kv_block_table, 0, rp * self.cfg.kv_table.max_blocks_per_seq)?;
        let mut req = Vec::with_capacity(tp);
        for r in 0..nr {
            let q = (input.query_start_loc[r + 1] - input.query_start_loc[r]) as usize;
            req.extend(std::iter::repeat_n(r as i32, q));
        }
        put(REQ, &req, -1, tp)?;
        self.scratch = scratch;
        self.layout = Some(layout);
        Ok(layout)
    }

    fn validate(&self, input: &StepInput<'_>) -> Result<StepLayout> {
        let cfg = &self.cfg;
        let qsl = input.query_start_loc;
        if qsl.is_empty() {
            return Err(invalid("query_start_loc", "must hold num_reqs + 1 entries, got 0".into()));
        }
        let nr = qsl.len() - 1;
        let nt = input.positions.len();
        if nr > cfg.max_num_seqs || input.num_reqs_padded > cfg.max_num_seqs {
            return Err(invalid(
                "num_reqs",
                format!("{nr} requests ({} padded) exceed max_num_seqs {}", input.num_reqs_padded, cfg.max_num_seqs),
            ));
        }
        if nt > cfg.max_num_batched_tokens || input.num_tokens_padded > cfg.max_num_batched_tokens {
            return Err(invalid(
                "num_tokens",
                format!(
                    "{nt} tokens ({} padded) exceed max_num_batched_tokens {}",
                    input.num_tokens_padded, cfg.max_num_batched_tokens
                ),
            ));
        }
        if input.num_reqs_padded < nr || input.num_tokens_padded < nt {
            return Err(invalid(
                "num_tokens_padded",
                format!(
                    "padded counts ({} requests, {} tokens) below the real ones ({nr}, {nt})",
                    input.num_reqs_padded, input.num_tokens_padded
                ),
            ));
        }
        let expect = |field: &'static str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(invalid(field, format!("holds {got} entries, expected {want}")))
            }
        };
        expect("seq_lens", input.seq_lens.len(), nr)?;
        expect("slot_mapping", input.slot_mapping.len(), nt)?;
        expect("swa_block_table", input.swa_block_table.len(), nr * cfg.swa_table.max_blocks_per_seq)?;
        expect("kv_block_table", input.kv_block_table.len(), nr * cfg.kv_table.max_blocks_per_seq)?;
        if qsl[0] != 0 || qsl[nr] as i64 != nt as i64 {
            return Err(invalid(
                "query_start_loc",
                format!("must run from 0 to num_tokens {nt}, runs from {} to {}", qsl[0], qsl[nr]),
            ));
        }
        let mut max_q = 0usize;
        let mut num_decodes = None;
        for r in 0..nr {
            let q = qsl[r + 1] as i64 - qsl[r] as i64;
            if q < 0 {
                return Err(invalid(
                    "query_start_loc",
                    format!("decreases at request {r} ({} → {})", qsl[r], qsl[r + 1]),
                ));
            }
            let q = q as usize;
            max_q = max_q.max(q);
            let s = input.seq_lens[r];
            if s < 0 || (s as usize) < q || s as usize > cfg.max_model_len {
                return Err(invalid(
                    "seq_lens",
                    format!(
                        "request {r}: seq len {s} must lie in [query len {q}, max_model_len {}]",
                        cfg.max_model_len
                    ),
                ));
            }
            for (name, t, table) in [
                ("swa_block_table", cfg.swa_table, input.swa_block_table),
                ("kv_block_table", cfg.kv_table, input.kv_block_table),
            ] {
                let need = (s as usize).div_ceil(t.block_size);
                if need > t.max_blocks_per_seq {
                    return Err(invalid(
                        name,
                        format!(
                            "request {r}: seq len {s} needs {need} blocks of {}, the table has {} columns",
                            t.block_size, t.max_blocks_per_seq
                        ),
                    ));
                }
                // Only the columns the request uses are ever read; the rest are neither read nor checked.
                let row = &table[r * t.max_blocks_per_seq..r * t.max_blocks_per_seq + need];
                if let Some((c, b)) = row.iter().enumerate().find(|(_, &b)| b < 0 || b as usize >= t.num_blocks) {
                    return Err(invalid(
                        name,
                        format!("request {r} column {c}: block id {b} outside [0, {})", t.num_blocks),
                    ));
                }
            }
            let first = s - q as i32;
            for j in 0..q {
                let tok = qsl[r] as usize + j;
                let p = input.positions[tok];
                if p < 0 {
                    return Err(invalid("positions", format!("token {tok}: negative position {p}")));
                }
                if p != first + j as i32 {
                    return Err(invalid(
                        "positions",
                        format!(
                            "token {tok} (request {r}, query {j}): position {p}, seq lens imply {}",
                            first + j as i32
                        ),
                    ));
                }
                let slot = input.slot_mapping[tok];
                if slot < -1 {
                    return Err(invalid("slot_mapping", format!("token {tok}: slot {slot} (only -1 marks no slot)")));
                }
            }
            if q > cfg.decode_threshold() && num_decodes.is_none() {
                num_decodes = Some(r);
            }
        }
        let threshold = cfg.decode_threshold();
        let (rp, tp) = (input.num_reqs_padded, input.num_tokens_padded);
        let layout = if max_q <= threshold {
            // Fast path (§3.4): every row, padding included, is a decode row.
            StepLayout {
                num_reqs: nr,
                num_reqs_padded: rp,
                num_tokens: nt,
                num_tokens_padded: tp,
                num_decodes: rp,
                num_decode_tokens: tp,
                num_prefills: 0,
                num_prefill_tokens: 0,
                max_query_len: max_q,
            }
        } else {
            let nd = num_decodes.unwrap_or(nr);
            if let Some(r) = (nd..nr).find(|&r| ((qsl[r + 1] - qsl[r]) as usize) <= threshold) {
                return Err(invalid(
                    "query_start_loc",
                    format!("request {r} is a decode after the first prefill {nd}: decodes must come first"),
                ));
            }
            let ndt = qsl[nd] as usize;
            StepLayout {
                num_reqs: nr,
                num_reqs_padded: rp,
                num_tokens: nt,
                num_tokens_padded: tp,
                num_decodes: nd,
                num_decode_tokens: ndt,
                num_prefills: rp - nd,
                num_prefill_tokens: tp - ndt,
                max_query_len: max_q,
            }
        };
        Ok(layout)
    }

    /// Enqueues the pinned→device copies of the staged step on `s` (7 copies, no host sync).
    /// Returns the number of operations enqueued.
    pub fn upload(&self, s: &Stream) -> Result<usize> {
        let l = self.layout()?;
        let lens = [
            l.num_reqs_padded + 1,
            l.num_reqs_padded,
            l.num_tokens_padded,
            l.num_tokens_padded,
            l.num_tokens_padded,
            l.num_reqs_padded * self.cfg.swa_table.max_blocks_per_seq,
            l.num_reqs_padded * self.cfg.kv_table.max_blocks_per_seq,
        ];
        for (f, len) in self.fields.iter().zip(lens) {
            s.copy_from_pinned(&f.pinned, 0, &f.device.prefix(len)?)?;
        }
        Ok(lens.len())
    }

    fn field(&self, i: usize, len: usize) -> Result<View<i32>> {
        Ok(self.fields[i].device.prefix(len)?)
    }

    /// `[num_reqs_padded + 1]` query start offsets on the device.
    pub fn query_start_loc(&self) -> Result<View<i32>> {
        self.field(QSL, self.layout()?.num_reqs_padded + 1)
    }
    /// `[num_reqs_padded]` sequence lengths on the device (0 for padded requests).
    pub fn seq_lens(&self) -> Result<View<i32>> {
        self.field(SEQ, self.layout()?.num_reqs_padded)
    }
    /// `[num_tokens_padded]` positions on the device (0 for padded tokens).
    pub fn positions(&self) -> Result<View<i32>> {
        self.field(POS, self.layout()?.num_tokens_padded)
    }
    /// `[num_tokens_padded]` slot mapping on the device (-1 for padded tokens).
    pub fn slot_mapping(&self) -> Result<View<i32>> {
        self.field(SLOT, self.layout()?.num_tokens_padded)
    }
    /// `[num_tokens_padded]` request index of each token on the device (-1 for padded tokens).
    pub fn token_to_req(&self) -> Result<View<i32>> {
        self.field(REQ, self.layout()?.num_tokens_padded)
    }
    /// `[num_reqs_padded, max_blocks_per_seq]` block table of `kind` on the device.
    pub fn block_table(&self, kind: TableKind) -> Result<View<i32>> {
        let l = self.layout()?;
        match kind {
            TableKind::Swa => self.field(SWA_BT, l.num_reqs_padded * self.cfg.swa_table.max_blocks_per_seq),
            TableKind::Kv => self.field(KV_BT, l.num_reqs_padded * self.cfg.kv_table.max_blocks_per_seq),
        }
    }
    /// The configuration of the block table of `kind`.
    pub fn table_config(&self, kind: TableKind) -> BlockTableConfig {
        match kind {
            TableKind::Swa => self.cfg.swa_table,
            TableKind::Kv => self.cfg.kv_table,
        }
    }

    /// Labels of the persistent device buffers, in upload order.
    pub fn buffer_labels(&self) -> Vec<&'static str> {
        self.fields.iter().map(|f| f.name).collect()
    }
}

/// Work and synchronisation counters of one build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BuildStats {
    /// Kernel launches and copies enqueued.
    pub launches: usize,
    /// Host synchronisations during the build (always 0; measured, not assumed).
    pub host_syncs: u64,
}

/// A ragged index set in fixed-capacity persistent buffers (§5.4): row `r`'s entries are
/// `indices[indptr[r] .. indptr[r + 1]]`.
#[derive(Clone, Debug)]
pub struct Ragged {
    /// `[rows + 1]` exclusive-scan offsets, `indptr[0] = 0`.
    pub indptr: View<i32>,
    /// `[max(rows × max_entries_per_row, 1)]` packed entries; the tail past `indptr[rows]` is
    /// stale and never read. Its length depends only on `rows`, never on the data.
    pub indices: View<i32>,
    /// Rows (the padded row count).
    pub rows: usize,
    /// Capacity per row (the dense width).
    pub max_entries_per_row: usize,
}

/// Persistent `indptr` / flat buffers for a ragged form with up to `max_rows` rows of
/// `max_entries_per_row` entries.
pub(crate) struct RaggedBuffers {
    pub(crate) indptr: Buffer<i32>,
    pub(crate) flat: Buffer<i32>,
    pub(crate) width: usize,
}

/// How a builder allocates its output buffers (normally [`Device::alloc_persistent`]).
pub type BufferAlloc<'a> = &'a dyn Fn(&Device, &str, usize) -> holdfast_hal::Result<Buffer<i32>>;

/// The default [`BufferAlloc`]: persistent (graph-stable) buffers.
pub fn persistent_alloc(dev: &Device, label: &str, len: usize) -> holdfast_hal::Result<Buffer<i32>> {
    dev.alloc_persistent(label, len)
}

impl RaggedBuffers {
    pub(crate) fn new(dev: &Device, alloc: BufferAlloc<'_>, name: &str, max_rows: usize, width: usize) -> Result<Self> {
        let cells = max_rows.checked_mul(width).filter(|&c| c <= i32::MAX as usize).ok_or_else(|| {
            AttentionError::Config(format!("{name}: {max_rows} × {width} ragged entries overflow i32"))
        })?;
        Ok(RaggedBuffers {
            indptr: alloc(dev, &format!("{name}.indptr"), max_rows + 1)?,
            flat: alloc(dev, &format!("{name}.indices"), cells.max(1))?,
            width,
        })
    }

    /// The views for `rows` rows (lengths depend only on `rows`).
    pub(crate) fn views(&self, rows: usize) -> Result<Ragged> {
        Ok(Ragged {
            indptr: self.indptr.prefix(rows + 1)?,
            indices: self.flat.prefix((rows * self.width).max(1))?,
            rows,
            max_entries_per_row: self.width,
        })
    }
}

/// Counts host syncs of `dev` across `f`.
pub(crate) fn counting_syncs<T>(dev: &Device, f: impl FnOnce() -> Result<T>) -> Result<(T, u64)> {
    let before = dev.stats().host_syncs;
    let out = f()?;
    Ok((out, dev.stats().host_syncs - before))
}
