//! Per-step common attention metadata: validated on the host, padded, staged in mapped host memory
//! and uploaded into persistent device buffers (spec §3.4); and the persistent device block tables,
//! indexed by a stable table row per request and written only where a step changes them.

use std::sync::atomic::{AtomicUsize, Ordering};

use holdfast_hal::{Buffer, Device, LaunchConfig, MappedBuffer, Stream, View};

use crate::error::{invalid, AttentionError, Result};
use crate::source::{AttnKernels, UPLOAD_THREADS};

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

impl BlockTableConfig {
    /// Most cells of this table one step writes when every block it hands out covers a token
    /// scheduled in that step: `ceil(max_num_batched_tokens / block_size) + max_num_seqs` (a
    /// request of `q` new tokens crosses at most `floor((q − 1) / block_size) + 1` block starts).
    pub fn growth_cells(&self, max_num_batched_tokens: usize, max_num_seqs: usize) -> usize {
        max_num_batched_tokens.div_ceil(self.block_size.max(1)) + max_num_seqs
    }
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
    /// Most block-table cells (both tables together) one step's [`StepInput::table_updates`] may
    /// write; the update staging holds this many `(cell, block)` pairs (8 bytes each).
    ///
    /// A step of at most [`CommonConfig::step_update_cells`] cells (the growth of a scheduler that
    /// hands out blocks only for the tokens it schedules) rides in the fixed-size part every
    /// upload copies, so a captured graph applies it. A larger step (whole rows of requests that
    /// arrive with long contexts) is applied by
    /// [`CommonAttentionMetadata::apply_bulk_table_updates`], eagerly, copying exactly its cells.
    /// `swa_table.growth_cells(..) + kv_table.growth_cells(..)` never needs the bulk path.
    pub max_table_updates: usize,
}

impl CommonConfig {
    /// Query tokens at or below which a request is a decode: `1 + num_spec_tokens`.
    pub fn decode_threshold(&self) -> usize {
        self.num_spec_tokens.saturating_add(1)
    }

    /// Update cells every upload copies and applies (the fixed-size, capturable part):
    /// `min(max_table_updates, swa_table.growth_cells(..) + kv_table.growth_cells(..))`.
    pub fn step_update_cells(&self) -> usize {
        let (t, s) = (self.max_num_batched_tokens, self.max_num_seqs);
        self.max_table_updates.min(self.swa_table.growth_cells(t, s) + self.kv_table.growth_cells(t, s))
    }

    /// Rows of each device block table: one per possible running request plus the null row.
    pub fn table_rows(&self) -> usize {
        self.max_num_seqs + 1
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(AttentionError::Config(m));
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.max_model_len == 0 {
            return bad(format!("sizes must be positive: {self:?}"));
        }
        if self.num_spec_tokens >= self.max_num_batched_tokens {
            return bad(format!(
                "num_spec_tokens {} must be below max_num_batched_tokens {} (a decode row holds 1 + \
                 num_spec_tokens tokens)",
                self.num_spec_tokens, self.max_num_batched_tokens
            ));
        }
        if self.max_table_updates == 0 || self.max_table_updates > (i32::MAX as usize - 1) / 2 {
            return bad(format!("max_table_updates {} must lie in [1, (i32::MAX − 1) / 2]", self.max_table_updates));
        }
        for (name, v) in [
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_num_seqs", self.max_num_seqs),
            ("max_model_len", self.max_model_len),
        ] {
            if v > i32::MAX as usize {
                return bad(format!("{name} {v} must fit in i32 (at most {})", i32::MAX));
            }
        }
        for (name, t) in [("swa_table", self.swa_table), ("kv_table", self.kv_table)] {
            if t.block_size == 0 || t.max_blocks_per_seq == 0 || t.num_blocks == 0 {
                return bad(format!("{name}: sizes must be positive: {t:?}"));
            }
            if t.num_blocks.checked_mul(t.block_size).is_none_or(|slots| slots > i32::MAX as usize) {
                return bad(format!("{name}: {} blocks × {} tokens overflow i32 slot ids", t.num_blocks, t.block_size));
            }
            if self.table_rows().checked_mul(t.max_blocks_per_seq).is_none_or(|n| n > i32::MAX as usize) {
                return bad(format!("{name}: [max_num_seqs + 1, max_blocks_per_seq] overflows i32 cell indices"));
            }
        }
        let cells = self.table_cells(TableKind::Swa) + self.table_cells(TableKind::Kv);
        if cells > i32::MAX as usize {
            return bad(format!("the two block tables hold {cells} cells together, more than i32 cell indices reach"));
        }
        Ok(())
    }

    fn table(&self, kind: TableKind) -> BlockTableConfig {
        match kind {
            TableKind::Swa => self.swa_table,
            TableKind::Kv => self.kv_table,
        }
    }

    /// Cells of the device table of `kind`: `(max_num_seqs + 1) × max_blocks_per_seq`.
    fn table_cells(&self, kind: TableKind) -> usize {
        self.table_rows() * self.table(kind).max_blocks_per_seq
    }
}

/// Which block table a builder reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableKind {
    /// The SWA cache's table.
    Swa,
    /// The main compressed-MLA cache's table.
    Kv,
}

impl TableKind {
    /// Both tables.
    pub const ALL: [TableKind; 2] = [TableKind::Swa, TableKind::Kv];

    /// `"swa"` or `"kv"` (used in error messages).
    pub fn name(self) -> &'static str {
        match self {
            TableKind::Swa => "swa",
            TableKind::Kv => "kv",
        }
    }

    fn index(self) -> usize {
        match self {
            TableKind::Swa => 0,
            TableKind::Kv => 1,
        }
    }
}

/// One write of consecutive columns of one table row, as [`BlockTableUpdates::iter`] yields it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTableUpdate<'a> {
    /// The table written.
    pub table: TableKind,
    /// The table row: a request's stable row in `[0, max_num_seqs)`, not its batch row.
    pub row: usize,
    /// First column written, in blocks.
    pub first_col: usize,
    /// Block ids for columns `first_col .. first_col + blocks.len()`, each in `[0, num_blocks)`.
    pub blocks: &'a [i32],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UpdateEntry {
    table: TableKind,
    row: usize,
    first_col: usize,
    start: usize,
    len: usize,
}

/// One step's block-table writes, in order: the blocks a request was newly given (appended after
/// the columns it already has), or a request's whole row once when it is given a table row.
/// Block ids are kept in one flat vector, so a step owns its updates without borrowing.
///
/// Checked when staged ([`CommonAttentionMetadata::stage`]): rows in `[0, max_num_seqs)`, columns
/// within the row width, ids in `[0, num_blocks)`, at most one update per row and table per step,
/// no update starting past the columns the row already has (rows are written front to back), and
/// at most `max_table_updates` cells in all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTableUpdates {
    entries: Vec<UpdateEntry>,
    blocks: Vec<i32>,
}

impl BlockTableUpdates {
    /// No updates.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a write of `blocks` to columns `first_col ..` of table row `row` of `table`. An empty
    /// `blocks` adds nothing.
    pub fn push(&mut self, table: TableKind, row: usize, first_col: usize, blocks: &[i32]) {
        if blocks.is_empty() {
            return;
        }
        self.entries.push(UpdateEntry { table, row, first_col, start: self.blocks.len(), len: blocks.len() });
        self.blocks.extend_from_slice(blocks);
    }

    /// Updates (runs of columns) held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// No update held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Cells written by all updates together (the count `max_table_updates` bounds).
    pub fn cells(&self) -> usize {
        self.blocks.len()
    }

    /// Removes every update (keeps the allocations).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.blocks.clear();
    }

    /// The updates in the order they were pushed.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = BlockTableUpdate<'_>> + '_ {
        self.entries.iter().map(|e| BlockTableUpdate {
            table: e.table,
            row: e.row,
            first_col: e.first_col,
            blocks: &self.blocks[e.start..e.start + e.len],
        })
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
    /// `[num_reqs]` table row of each request: distinct, in `[0, max_num_seqs)`. The first
    /// `ceil(seq_len / block_size)` columns of the row must have been written in both tables (by
    /// this step's or earlier steps' updates) since the row was last released.
    pub table_rows: &'a [u32],
    /// Block-table writes, applied on the device by [`CommonAttentionMetadata::upload`] before
    /// this step's builders read the tables.
    pub table_updates: &'a BlockTableUpdates,
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

// The per-step fields, packed back to back in one staging and one device buffer at offsets that
// depend only on the padded counts: [qsl | seq | rows | pos | slot | req | updates].
const QSL: usize = 0;
const SEQ: usize = 1;
const ROWS: usize = 2;
const POS: usize = 3;
const SLOT: usize = 4;
const REQ: usize = 5;
const UPD: usize = 6;

/// Element offsets of the packed fields for `rp` request rows and `tp` token rows (index 7: the
/// end of the token fields, where the updates start).
fn offsets(rp: usize, tp: usize) -> [usize; 7] {
    let lens = [rp + 1, rp, rp, tp, tp, tp];
    let mut out = [0; 7];
    for i in 0..6 {
        out[i + 1] = out[i] + lens[i];
    }
    out
}

/// Per-row host bookkeeping of the two device tables, and the per-step stamps that check
/// distinctness in O(1) per entry.
struct TableRows {
    /// `[2][max_num_seqs]` columns written since each row was last released.
    written: [Vec<u32>; 2],
    /// `[2][max_num_seqs]` the written count after this step's update of the row.
    next: [Vec<u32>; 2],
    /// `[2][max_num_seqs]` epoch of the step that last updated the row.
    touched: [Vec<u32>; 2],
    /// `[max_num_seqs]` (epoch, request) of the step request that last named the row.
    seen: Vec<(u32, u32)>,
    epoch: u32,
}

impl TableRows {
    fn new(rows: usize) -> Self {
        TableRows {
            written: [vec![0; rows], vec![0; rows]],
            next: [vec![0; rows], vec![0; rows]],
            touched: [vec![0; rows], vec![0; rows]],
            seen: vec![(0, 0); rows],
            epoch: 0,
        }
    }

    /// Starts a step's checks: a fresh epoch (stamps of earlier steps no longer match).
    fn begin(&mut self) -> u32 {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.touched.iter_mut().for_each(|t| t.fill(0));
            self.seen.fill((0, 0));
            self.epoch = 1;
        }
        self.epoch
    }

    /// Columns of `row` of table `k` once the step being checked is applied.
    fn columns(&self, k: usize, row: usize) -> u32 {
        if self.touched[k][row] == self.epoch {
            self.next[k][row]
        } else {
            self.written[k][row]
        }
    }
}

/// Persistent device copies of a step's common metadata, the persistent block tables, and the
/// mapped host staging they are uploaded from.
///
/// **Block tables** live on the device for the lifetime of a request: each table is
/// `[max_num_seqs + 1, max_blocks_per_seq]` block ids, row-major, indexed by a stable *table row*
/// the caller gives each running request (not by its batch row). Row `max_num_seqs` is the null
/// row ([`CommonAttentionMetadata::null_table_row`]): all block 0, never written, and the row of
/// every padded request. Ids enter only through [`StepInput::table_updates`]; a step uploads what
/// changed, so its cost does not depend on the table width. When a request finishes or is
/// preempted its row is given back with [`CommonAttentionMetadata::release_table_row`].
///
/// [`CommonAttentionMetadata::stage`] validates and pads on the host and writes the staging;
/// [`CommonAttentionMetadata::upload`] enqueues one kernel that reads the staging in place and
/// writes the fields and the block-table updates on the step's stream (capturable: a graph
/// re-reads the staging at every replay).
/// Views handed out are prefixes whose lengths depend only on the padded counts, or whole
/// buffers. The host must not stage the next step while the previous upload may still be reading
/// the staging (wait on an event first), and every staged step must be uploaded: the host's
/// record of written columns counts a step's updates from the moment it is staged.
pub struct CommonAttentionMetadata {
    cfg: CommonConfig,
    device: Device,
    /// Mapped host staging of the packed per-step fields and updates (`attn.common.staging`):
    /// the upload kernel reads it in place.
    staging: MappedBuffer<i32>,
    /// The device copy of the fields (`attn.common.step`), same layout up to the updates.
    step: Buffer<i32>,
    /// `[max_num_seqs + 1, max_blocks_per_seq]` per table (SWA, KV).
    tables: [Buffer<i32>; 2],
    rows: TableRows,
    attn: AttnKernels,
    /// Cells staged beyond the fixed-size part that [`CommonAttentionMetadata::apply_bulk_table_updates`]
    /// has not applied yet (0 when none).
    bulk_pending: AtomicUsize,
    scratch: Vec<i32>,
    layout: Option<StepLayout>,
}

impl std::fmt::Debug for CommonAttentionMetadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommonAttentionMetadata").field("cfg", &self.cfg).field("layout", &self.layout).finish()
    }
}

impl CommonAttentionMetadata {
    /// Allocates the persistent device buffers (the block tables zeroed: every row reads the null
    /// block) and mapped host staging for `cfg`.
    pub fn new(dev: &Device, cfg: CommonConfig) -> Result<Self> {
        cfg.validate()?;
        let (t, r) = (cfg.max_num_batched_tokens, cfg.max_num_seqs);
        let len = offsets(r, t)[UPD] + 1 + 2 * cfg.max_table_updates;
        // Zero-filled: an upload before the first stage applies no update.
        let staging = dev.alloc_mapped::<i32>("attn.common.staging", len)?;
        let step = dev.alloc_zeroed::<i32>("attn.common.step", offsets(r, t)[UPD], true)?;
        let tables = [
            dev.alloc_zeroed::<i32>("attn.common.swa_block_table", cfg.table_cells(TableKind::Swa), true)?,
            dev.alloc_zeroed::<i32>("attn.common.kv_block_table", cfg.table_cells(TableKind::Kv), true)?,
        ];
        Ok(CommonAttentionMetadata {
            cfg,
            device: dev.clone(),
            staging,
            step,
            tables,
            rows: TableRows::new(r),
            attn: AttnKernels::new(dev)?,
            bulk_pending: AtomicUsize::new(0),
            scratch: Vec::new(),
            layout: None,
        })
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

    /// The null table row, `max_num_seqs`: all block 0, never written; padded requests use it.
    pub fn null_table_row(&self) -> usize {
        self.cfg.max_num_seqs
    }

    /// Columns of table row `row` of `kind` written since the row was last released (staged
    /// updates included), or `None` for a row outside `[0, max_num_seqs)`.
    pub fn table_row_columns(&self, kind: TableKind, row: usize) -> Option<usize> {
        self.rows.written[kind.index()].get(row).map(|&c| c as usize)
    }

    /// Gives table row `row` back (its request finished or was preempted): in both tables its
    /// columns count as never written, so whichever request is given the row next must write
    /// every column it uses before its first step. Host only: the device row keeps stale ids,
    /// which no request reads. Errors for a row outside `[0, max_num_seqs)`.
    pub fn release_table_row(&mut self, row: usize) -> Result<()> {
        if row >= self.cfg.max_num_seqs {
            return Err(invalid(
                "release_table_row",
                format!("row {row} outside [0, max_num_seqs {})", self.cfg.max_num_seqs),
            ));
        }
        for w in &mut self.rows.written {
            w[row] = 0;
        }
        Ok(())
    }

    /// Gives every table row back (a fresh scheduler takes over the rows).
    pub fn release_all_table_rows(&mut self) {
        for w in &mut self.rows.written {
            w.fill(0);
        }
    }

    /// Validates `input`, pads it (padded requests: query length 0, seq len 0, the null table
    /// row; padded tokens: slot -1, position 0, request -1) and writes the mapped staging,
    /// block-table updates included. Host work proportional to the requests, tokens and updated
    /// cells, never to the table width. On error nothing is written or recorded and the previous
    /// step stays staged.
    pub fn stage(&mut self, input: &StepInput<'_>) -> Result<StepLayout> {
        let layout = self.validate(input)?;
        let StepLayout { num_reqs: nr, num_reqs_padded: rp, num_tokens: nt, num_tokens_padded: tp, .. } = layout;
        let mut scratch = std::mem::take(&mut self.scratch);
        // The packed fields, real rows then padding, built once and written with one memcpy.
        scratch.clear();
        let pad = |scratch: &mut Vec<i32>, real: &[i32], value: i32, padded_len: usize| {
            let end = scratch.len() + padded_len;
            scratch.extend_from_slice(real);
            scratch.resize(end, value);
        };
        pad(&mut scratch, input.query_start_loc, nt as i32, rp + 1);
        pad(&mut scratch, input.seq_lens, 0, rp);
        // Table rows fit in i32: checked against max_num_seqs (validated ≤ i32::MAX cells).
        scratch.extend(input.table_rows.iter().map(|&r| r as i32));
        scratch.resize(offsets(rp, tp)[POS], self.cfg.max_num_seqs as i32);
        pad(&mut scratch, input.positions, 0, tp);
        pad(&mut scratch, input.slot_mapping, -1, tp);
        for r in 0..nr {
            let q = (input.query_start_loc[r + 1] - input.query_start_loc[r]) as usize;
            scratch.extend(std::iter::repeat_n(r as i32, q));
        }
        scratch.resize(offsets(rp, tp)[UPD], -1);
        // Updates: [count, (cell, block) × count]; cells index the SWA table, then the KV table.
        let upd = input.table_updates;
        scratch.push(upd.cells() as i32);
        let kv_base = self.cfg.table_cells(TableKind::Swa);
        for u in upd.iter() {
            let width = self.cfg.table(u.table).max_blocks_per_seq;
            let base = if u.table == TableKind::Kv { kv_base } else { 0 } + u.row * width + u.first_col;
            for (j, &b) in u.blocks.iter().enumerate() {
                scratch.push((base + j) as i32);
                scratch.push(b);
            }
        }
        self.staging.write(0, &scratch)?;
        let bulk = if upd.cells() > self.cfg.step_update_cells() { upd.cells() } else { 0 };
        self.bulk_pending.store(bulk, Ordering::Release);
        for u in upd.iter() {
            let k = u.table.index();
            self.rows.written[k][u.row] = self.rows.next[k][u.row];
        }
        self.scratch = scratch;
        self.layout = Some(layout);
        Ok(layout)
    }

    /// Checks the step's updates: capacity, ranges, one update per row and table, no gap.
    fn validate_updates(&mut self, upd: &BlockTableUpdates) -> Result<()> {
        let cfg = self.cfg;
        if upd.cells() > cfg.max_table_updates {
            return Err(invalid(
                "table_updates",
                format!(
                    "{} cells in {} updates exceed the staging capacity max_table_updates = {}",
                    upd.cells(),
                    upd.len(),
                    cfg.max_table_updates
                ),
            ));
        }
        let epoch = self.rows.epoch;
        for (i, u) in upd.iter().enumerate() {
            let (t, k, name) = (cfg.table(u.table), u.table.index(), u.table.name());
            if u.row >= cfg.max_num_seqs {
                return Err(invalid(
                    "table_updates",
                    format!(
                        "update {i} ({name} table): row {} outside [0, max_num_seqs {}) (row {} is the null row)",
                        u.row, cfg.max_num_seqs, cfg.max_num_seqs
                    ),
                ));
            }
            let end = u.first_col.saturating_add(u.blocks.len());
            if end > t.max_blocks_per_seq {
                return Err(invalid(
                    "table_updates",
                    format!(
                        "update {i} ({name} table, row {}): columns {}..{end} run past the row's {} columns",
                        u.row, u.first_col, t.max_blocks_per_seq
                    ),
                ));
            }
            if self.rows.touched[k][u.row] == epoch {
                return Err(invalid(
                    "table_updates",
                    format!(
                        "update {i} ({name} table): row {} is already written by an earlier update of this step; \
                         merge them into one run of columns",
                        u.row
                    ),
                ));
            }
            let have = self.rows.written[k][u.row] as usize;
            if u.first_col > have {
                return Err(invalid(
                    "table_updates",
                    format!(
                        "update {i} ({name} table, row {}): starts at column {}, past the {have} columns written \
                         since the row was released (a row is written front to back)",
                        u.row, u.first_col
                    ),
                ));
            }
            if let Some((j, &b)) = u.blocks.iter().enumerate().find(|(_, &b)| b < 0 || b as usize >= t.num_blocks) {
                return Err(invalid(
                    "table_updates",
                    format!(
                        "update {i} ({name} table, row {}) column {}: block id {b} outside [0, {})",
                        u.row,
                        u.first_col + j,
                        t.num_blocks
                    ),
                ));
            }
            self.rows.touched[k][u.row] = epoch;
            self.rows.next[k][u.row] = have.max(end) as u32;
        }
        Ok(())
    }

    fn validate(&mut self, input: &StepInput<'_>) -> Result<StepLayout> {
        let cfg = self.cfg;
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
        if input.num_reqs_padded < nr {
            return Err(invalid(
                "num_reqs_padded",
                format!("{} padded requests, below the {nr} real ones", input.num_reqs_padded),
            ));
        }
        if input.num_tokens_padded < nt {
            return Err(invalid(
                "num_tokens_padded",
                format!("{} padded tokens, below the {nt} real ones", input.num_tokens_padded),
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
        expect("table_rows", input.table_rows.len(), nr)?;
        if qsl[0] != 0 || qsl[nr] as i64 != nt as i64 {
            return Err(invalid(
                "query_start_loc",
                format!("must run from 0 to num_tokens {nt}, runs from {} to {}", qsl[0], qsl[nr]),
            ));
        }
        let epoch = self.rows.begin();
        self.validate_updates(input.table_updates)?;
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
            if qsl[r + 1] as i64 > nt as i64 {
                return Err(invalid(
                    "query_start_loc",
                    format!("request {r} ends at token {}, past num_tokens {nt}", qsl[r + 1]),
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
            let row = input.table_rows[r] as usize;
            if row >= cfg.max_num_seqs {
                return Err(invalid(
                    "table_rows",
                    format!(
                        "request {r}: table row {row} outside [0, max_num_seqs {}) (row {} is the null row)",
                        cfg.max_num_seqs, cfg.max_num_seqs
                    ),
                ));
            }
            let (seen, other) = self.rows.seen[row];
            if seen == epoch {
                return Err(invalid("table_rows", format!("requests {other} and {r} both name table row {row}")));
            }
            self.rows.seen[row] = (epoch, r as u32);
            for kind in TableKind::ALL {
                let t = cfg.table(kind);
                // Compared in tokens (multiplications: no division per request on the fast path).
                let have = self.rows.columns(kind.index(), row) as usize;
                if (s as usize) <= have * t.block_size {
                    continue;
                }
                let need = (s as usize).div_ceil(t.block_size);
                if need > t.max_blocks_per_seq {
                    return Err(invalid(
                        "seq_lens",
                        format!(
                            "request {r}: seq len {s} needs {need} blocks of {} in the {} table, rows have {} columns",
                            t.block_size,
                            kind.name(),
                            t.max_blocks_per_seq
                        ),
                    ));
                }
                // Only the columns the request uses are ever read; the rest need never be written.
                if need > have {
                    return Err(invalid(
                        "table_rows",
                        format!(
                            "request {r} (table row {row}): seq len {s} uses {need} columns of the {} table, \
                             only {have} were written since the row was released",
                            kind.name()
                        ),
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

    /// Applies a staged step's updates that exceed the fixed-size part
    /// ([`CommonConfig::step_update_cells`]) on `s`: one upload launch sized by the cells that writes
    /// them from the mapped staging into the tables. Eager only (its shape depends on the data):
    /// a caller replaying a graph that holds the upload calls it before the replay;
    /// [`CommonAttentionMetadata::upload`] calls it itself when it runs eagerly. A no-op when
    /// nothing is pending. Returns the launches enqueued (0 or 1).
    pub fn apply_bulk_table_updates(&self, s: &Stream) -> Result<usize> {
        let n = self.bulk_pending.load(Ordering::Acquire);
        if n == 0 {
            return Ok(0);
        }
        if s.is_capturing() {
            return Err(AttentionError::Shape {
                op: "CommonAttentionMetadata::apply_bulk_table_updates",
                detail: format!(
                    "{n} staged update cells exceed the {} a captured upload applies; apply them eagerly \
                     before the capture or replay",
                    self.cfg.step_update_cells()
                ),
            });
        }
        let at = self.updates_offset()?;
        self.launch_upload(s, 0, at, n)?;
        self.bulk_pending.store(0, Ordering::Release);
        Ok(1)
    }

    /// Where the staged step's updates start in the packed fields.
    fn updates_offset(&self) -> Result<usize> {
        let l = self.layout()?;
        Ok(offsets(l.num_reqs_padded, l.num_tokens_padded)[UPD])
    }

    /// One upload launch: the first `words` staged words into the device step buffer, and the
    /// first `capacity` update pairs at word `at` of the staging into the tables (the kernel reads
    /// the count there; the launch shape depends only on `words` and `capacity`).
    fn launch_upload(&self, s: &Stream, words: usize, at: usize, capacity: usize) -> Result<()> {
        let args = [
            (&self.staging.view()).into(),
            (&self.step.view()).into(),
            (&self.tables[0].view()).into(),
            (&self.tables[1].view()).into(),
            (words as u32).into(),
            (at as u32).into(),
            (capacity as u32).into(),
            (self.tables[0].len() as u32).into(),
            (self.tables[1].len() as u32).into(),
        ];
        let threads = words.div_ceil(4).max(capacity);
        s.launch_dependent(&self.attn.step_upload, LaunchConfig::for_elements(threads, UPLOAD_THREADS), &args)?;
        Ok(())
    }

    /// Enqueues the staged step on `s`, no host sync: one kernel that reads the mapped staging in
    /// place (no copy engine, which in a graph costs a round trip of its own), copies the packed
    /// per-request and per-token fields into the persistent device buffer and writes the
    /// fixed-size part of the updates (up to `step_update_cells`; it reads the count from the
    /// staging) into the device block tables. Every length and offset, and so the launch shape,
    /// depends only on the padded counts. A step with more update cells first applies them with
    /// [`CommonAttentionMetadata::apply_bulk_table_updates`] (an error while capturing: apply
    /// them before). Returns the number of launches enqueued (1, or 2 with bulk).
    pub fn upload(&self, s: &Stream) -> Result<usize> {
        let bulk = self.apply_bulk_table_updates(s)?;
        let at = self.updates_offset()?;
        // A bulk step's first cells are written again, with the same ids.
        self.launch_upload(s, at, at, self.cfg.step_update_cells())?;
        Ok(bulk + 1)
    }

    /// The device view of packed field `i` of the staged step.
    fn field(&self, i: usize) -> Result<View<i32>> {
        let l = self.layout()?;
        let (rp, tp) = (l.num_reqs_padded, l.num_tokens_padded);
        let o = offsets(rp, tp);
        Ok(self.step.slice(o[i], o[i + 1] - o[i])?)
    }

    /// `[num_reqs_padded + 1]` query start offsets on the device.
    pub fn query_start_loc(&self) -> Result<View<i32>> {
        self.field(QSL)
    }
    /// `[num_reqs_padded]` sequence lengths on the device (0 for padded requests).
    pub fn seq_lens(&self) -> Result<View<i32>> {
        self.field(SEQ)
    }
    /// `[num_tokens_padded]` positions on the device (0 for padded tokens).
    pub fn positions(&self) -> Result<View<i32>> {
        self.field(POS)
    }
    /// `[num_tokens_padded]` slot mapping on the device (-1 for padded tokens).
    pub fn slot_mapping(&self) -> Result<View<i32>> {
        self.field(SLOT)
    }
    /// `[num_tokens_padded]` request (batch row) of each token on the device (-1 for padded tokens).
    pub fn token_to_req(&self) -> Result<View<i32>> {
        self.field(REQ)
    }
    /// `[num_reqs_padded]` table row of each request on the device (the null row for padded
    /// requests). A kernel reads request `r`'s block `c` at
    /// `block_table[table_rows[r] · max_blocks_per_seq + c]`.
    pub fn table_rows(&self) -> Result<View<i32>> {
        self.field(ROWS)
    }
    /// `[max_num_seqs + 1, max_blocks_per_seq]` persistent block table of `kind` on the device,
    /// row-major by table row (the last row is the null row). The whole table: the view is the
    /// same at every step.
    pub fn block_table(&self, kind: TableKind) -> Result<View<i32>> {
        Ok(self.tables[kind.index()].view())
    }
    /// The configuration of the block table of `kind`.
    pub fn table_config(&self, kind: TableKind) -> BlockTableConfig {
        self.cfg.table(kind)
    }

    /// Labels of the persistent device buffers: the packed per-step fields, then the two tables.
    pub fn buffer_labels(&self) -> Vec<&'static str> {
        vec!["attn.common.step", "attn.common.swa_block_table", "attn.common.kv_block_table"]
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

/// Entries of a ragged list of `max_rows` rows of up to `width` each (what a builder allocates):
/// an error naming `name` where they pass the lists' 32-bit offsets. Device-free, so a caller can
/// check its limits before building anything.
pub fn ragged_capacity(name: &str, max_rows: usize, width: usize) -> Result<usize> {
    max_rows.checked_mul(width).filter(|&c| c <= i32::MAX as usize).ok_or_else(|| {
        AttentionError::Config(format!("{name}: {max_rows} × {width} ragged entries overflow the 32-bit offsets"))
    })
}

impl RaggedBuffers {
    pub(crate) fn new(dev: &Device, alloc: BufferAlloc<'_>, name: &str, max_rows: usize, width: usize) -> Result<Self> {
        let cells = ragged_capacity(name, max_rows, width)?;
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
