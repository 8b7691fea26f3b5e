//! Paged KV-cache block manager (host side only).
//!
//! The device caches are arrays of fixed-size blocks; this module decides which blocks each request
//! holds and turns that into the block-table updates and slot mappings attention reads (spec §3.4,
//! §5.1).
//!
//! # Policies
//!
//! - **Two pools, one table per pool per request.** DeepSeek-V4 has an SWA cache (64 tokens per
//!   block) and a main compressed-MLA cache (256 uncompressed tokens per block, i.e. 64 compressed
//!   entries for c4a layers and 2 for c128a layers). Every layer of a kind indexes its own cache
//!   tensor with the same block ids, so one table per pool serves all layers.
//! - **Both tables cover every position `0..len`.** Blocks of the SWA cache that fell out of the
//!   sliding window are kept until the request ends; freeing them early (and caching only the
//!   blocks that can serve a prefix hit, spec §8.3) is a later optimisation.
//! - **Block 0 is the null block.** It is never handed out; attention's null table row (the row
//!   of padded requests) holds only it. Usable ids are `[1, num_blocks)`.
//! - **Tables live on the device.** A request's block ids are written once into its row of
//!   attention's persistent block tables: [`KvManager::push_table_updates`] turns the blocks
//!   handed out since the last call into block-table updates, so a step carries only new blocks.
//! - **All-or-nothing growth.** [`KvManager::ensure`] checks both pools before taking a block, so a
//!   failed call changes nothing; the scheduler preempts and retries.
//! - **Deterministic ids.** Free blocks form a LIFO stack (initially `1, 2, 3, …` in handing-out
//!   order), so the same sequence of calls always yields the same block ids.
//! - Validation sits here: every id, length and row width from a caller is checked and answered
//!   with a [`KvError`], never a panic.

use std::collections::BTreeMap;

use holdfast_attention::{BlockTableConfig, BlockTableUpdates, TableKind};

/// Errors of the block manager.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// A construction-time size is unusable.
    #[error("kv config: {0}")]
    Config(String),
    /// A pool has too few free blocks; nothing was allocated.
    #[error("{pool} pool exhausted: request {id} needs {need} more blocks, {free} are free")]
    Exhausted {
        /// The pool that ran out (`"swa"` or `"kv"`, or the name given to [`BlockPool::new`]).
        pool: &'static str,
        /// The request that asked (0 for a bare [`BlockPool::allocate`]).
        id: u64,
        /// Blocks asked for.
        need: usize,
        /// Blocks free at the time.
        free: usize,
    },
    /// A request would need more blocks than its block-table row has columns.
    #[error(
        "request {id}: {len} tokens need {need} blocks of {block_size} tokens in the {pool} cache, \
         its block-table row has {max_blocks_per_seq} columns"
    )]
    TooLong {
        /// The table's pool.
        pool: &'static str,
        /// The request.
        id: u64,
        /// Tokens asked for.
        len: usize,
        /// Blocks those tokens need.
        need: usize,
        /// Tokens per block of the pool.
        block_size: usize,
        /// Columns of the row.
        max_blocks_per_seq: usize,
    },
    /// A request would need more blocks than the whole pool has.
    #[error(
        "request {id}: {len} tokens need {need} blocks of {block_size} tokens in the {pool} cache, \
         which has {capacity} usable blocks"
    )]
    ExceedsCapacity {
        /// The pool.
        pool: &'static str,
        /// The request.
        id: u64,
        /// Tokens asked for.
        len: usize,
        /// Blocks those tokens need.
        need: usize,
        /// Tokens per block of the pool.
        block_size: usize,
        /// Usable blocks of the pool.
        capacity: usize,
    },
    /// The request holds no blocks (never ensured, or freed).
    #[error("request {0} holds no KV blocks")]
    UnknownRequest(u64),
    /// A position at or past the tokens the request holds blocks for.
    #[error("request {id}: position {pos} outside the {len} tokens it holds blocks for")]
    PositionOutOfRange {
        /// The request.
        id: u64,
        /// The position asked for.
        pos: usize,
        /// Tokens held.
        len: usize,
    },
    /// An output row of the wrong width.
    #[error("{pool} block-table row: buffer holds {got} entries, expected max_blocks_per_seq = {want}")]
    RowWidth {
        /// The table's pool.
        pool: &'static str,
        /// Entries in the buffer given.
        got: usize,
        /// Entries expected.
        want: usize,
    },
    /// Block-table columns said to be written already, past the blocks the request holds.
    #[error("request {id}: {sent} columns of its {pool} table row said written, it holds {held} blocks")]
    ColumnsPastHeld {
        /// The request.
        id: u64,
        /// The table's pool.
        pool: &'static str,
        /// Columns said written.
        sent: usize,
        /// Blocks held.
        held: usize,
    },
    /// A block id given back that is not currently handed out (null, out of range, or free).
    #[error("{pool} pool: block {block} is not handed out ({why})")]
    BadRelease {
        /// The pool.
        pool: &'static str,
        /// The offending id.
        block: i32,
        /// Why it was refused.
        why: &'static str,
    },
}

/// A pool of fixed-size blocks; block 0 is the reserved null block and never handed out, so ids are
/// in `[1, num_blocks)`.
#[derive(Clone, Debug)]
pub struct BlockPool {
    name: &'static str,
    num_blocks: usize,
    block_size: usize,
    /// Free ids; the next one handed out is the last element.
    free: Vec<i32>,
    /// `[num_blocks]`: whether each id is handed out (entry 0 stays false).
    in_use: Vec<bool>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (the null block included) of `block_size` tokens each.
    ///
    /// Errors when `block_size` is 0, `num_blocks < 2` (no usable block), or a slot id
    /// (`num_blocks × block_size`) would not fit in `i32`.
    pub fn new(name: &'static str, num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::Config(format!("{name}: block_size must be positive")));
        }
        if num_blocks < 2 {
            return Err(KvError::Config(format!(
                "{name}: num_blocks {num_blocks} leaves no usable block (block 0 is the null block)"
            )));
        }
        if num_blocks.checked_mul(block_size).is_none_or(|slots| slots > i32::MAX as usize) {
            return Err(KvError::Config(format!(
                "{name}: {num_blocks} blocks × {block_size} tokens overflow i32 slot ids"
            )));
        }
        // Reverse order so that the first blocks handed out are 1, 2, 3, ….
        let free = (1..num_blocks as i32).rev().collect();
        Ok(BlockPool { name, num_blocks, block_size, free, in_use: vec![false; num_blocks] })
    }

    /// The name given at construction (used in error messages).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks free now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks handed out now.
    pub fn num_used(&self) -> usize {
        self.capacity() - self.num_free()
    }

    /// Usable blocks: `num_blocks − 1` (the null block is not usable).
    pub fn capacity(&self) -> usize {
        self.num_blocks - 1
    }

    /// Blocks in the device cache, the null block included (the table's id bound).
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks needed to hold `tokens` tokens: `ceil(tokens / block_size)`.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Whether `id` is handed out now.
    pub fn is_allocated(&self, id: i32) -> bool {
        usize::try_from(id).ok().and_then(|i| self.in_use.get(i)).copied().unwrap_or(false)
    }

    /// Hands out `n` blocks, or none: [`KvError::Exhausted`] (with `id` 0) when fewer are free.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<i32>, KvError> {
        self.allocate_for(0, n)
    }

    fn allocate_for(&mut self, id: u64, n: usize) -> Result<Vec<i32>, KvError> {
        if n > self.free.len() {
            return Err(KvError::Exhausted { pool: self.name, id, need: n, free: self.free.len() });
        }
        let taken = self.free.split_off(self.free.len() - n);
        // Pop order: the top of the stack first.
        let taken: Vec<i32> = taken.into_iter().rev().collect();
        for &b in &taken {
            self.in_use[b as usize] = true;
        }
        Ok(taken)
    }

    /// Gives `blocks` back. All-or-nothing: every id is checked first (not the null block, in
    /// range, handed out, not repeated), and on error nothing is released.
    pub fn release(&mut self, blocks: &[i32]) -> Result<(), KvError> {
        let bad = |block, why| Err(KvError::BadRelease { pool: self.name, block, why });
        for (i, &b) in blocks.iter().enumerate() {
            if b == 0 {
                return bad(b, "the null block is never handed out");
            }
            if b < 0 || b as usize >= self.num_blocks {
                return bad(b, "out of range");
            }
            if !self.in_use[b as usize] {
                return bad(b, "it is free");
            }
            if blocks[..i].contains(&b) {
                return bad(b, "listed twice");
            }
        }
        // Last allocated goes back on top, so a release-then-allocate returns the same ids.
        for &b in blocks.iter().rev() {
            self.in_use[b as usize] = false;
            self.free.push(b);
        }
        Ok(())
    }
}

/// Sizes of the two pools and of the block-table rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvConfig {
    /// Tokens per SWA-cache block (64 in DeepSeek-V4).
    pub swa_block_size: usize,
    /// SWA-cache blocks, the null block included.
    pub swa_num_blocks: usize,
    /// Uncompressed tokens per main-cache block (256 in DeepSeek-V4).
    pub kv_block_size: usize,
    /// Main-cache blocks, the null block included.
    pub kv_num_blocks: usize,
    /// Columns of a request's SWA block-table row (blocks one request may hold).
    pub max_blocks_per_seq_swa: usize,
    /// Columns of a request's main block-table row.
    pub max_blocks_per_seq_kv: usize,
}

impl KvConfig {
    /// The SWA table's shape, as attention's [`holdfast_attention::CommonConfig`] wants it.
    pub fn swa_table(&self) -> BlockTableConfig {
        BlockTableConfig {
            block_size: self.swa_block_size,
            max_blocks_per_seq: self.max_blocks_per_seq_swa,
            num_blocks: self.swa_num_blocks,
        }
    }

    /// The main table's shape, as attention's [`holdfast_attention::CommonConfig`] wants it.
    pub fn kv_table(&self) -> BlockTableConfig {
        BlockTableConfig {
            block_size: self.kv_block_size,
            max_blocks_per_seq: self.max_blocks_per_seq_kv,
            num_blocks: self.kv_num_blocks,
        }
    }
}

/// Block usage, per pool, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvStats {
    /// SWA blocks handed out.
    pub swa_used: usize,
    /// SWA blocks free.
    pub swa_free: usize,
    /// Usable SWA blocks (`swa_num_blocks − 1`).
    pub swa_capacity: usize,
    /// Main-cache blocks handed out.
    pub kv_used: usize,
    /// Main-cache blocks free.
    pub kv_free: usize,
    /// Usable main-cache blocks (`kv_num_blocks − 1`).
    pub kv_capacity: usize,
    /// Requests holding an entry (possibly with zero blocks).
    pub requests: usize,
}

#[derive(Clone, Debug, Default)]
struct Held {
    /// Tokens covered, in tokens.
    len: usize,
    swa: Vec<i32>,
    kv: Vec<i32>,
}

/// Two block tables per request (DeepSeek-V4: the SWA cache, block 64 tokens, and the main
/// compressed-MLA cache, 256 tokens per block). Both cover every position `0..len`; freeing
/// out-of-window SWA blocks is a later optimisation (see the module docs).
#[derive(Clone, Debug)]
pub struct KvManager {
    cfg: KvConfig,
    swa: BlockPool,
    kv: BlockPool,
    held: BTreeMap<u64, Held>,
}

/// Blocks of `pool` that `len` tokens need, or [`KvError::TooLong`] when they exceed a table row
/// of `max` blocks.
fn row_blocks(pool: &BlockPool, max: usize, id: u64, len: usize) -> Result<usize, KvError> {
    let need = pool.blocks_for(len);
    if need > max {
        return Err(KvError::TooLong {
            pool: pool.name,
            id,
            len,
            need,
            block_size: pool.block_size,
            max_blocks_per_seq: max,
        });
    }
    Ok(need)
}

impl KvManager {
    /// Builds both pools. Errors on a zero size or a pool whose slot ids overflow `i32`.
    pub fn new(cfg: KvConfig) -> Result<Self, KvError> {
        if let Some(name) = crate::error::first_zero(&[
            ("max_blocks_per_seq_swa", cfg.max_blocks_per_seq_swa),
            ("max_blocks_per_seq_kv", cfg.max_blocks_per_seq_kv),
        ]) {
            return Err(KvError::Config(format!("{name} must be positive, got 0")));
        }
        let swa = BlockPool::new("swa", cfg.swa_num_blocks, cfg.swa_block_size)?;
        let kv = BlockPool::new("kv", cfg.kv_num_blocks, cfg.kv_block_size)?;
        Ok(KvManager { cfg, swa, kv, held: BTreeMap::new() })
    }

    /// The construction-time sizes.
    pub fn config(&self) -> &KvConfig {
        &self.cfg
    }

    /// The SWA pool.
    pub fn swa_pool(&self) -> &BlockPool {
        &self.swa
    }

    /// The main-cache pool.
    pub fn kv_pool(&self) -> &BlockPool {
        &self.kv
    }

    /// Blocks `(swa, kv)` needed for `len` tokens.
    pub fn blocks_for(&self, len: usize) -> (usize, usize) {
        (self.swa.blocks_for(len), self.kv.blocks_for(len))
    }

    /// Checks that a request of `len` tokens fits an empty cache and its table rows; the error
    /// names the first limit it breaks ([`KvError::TooLong`] or [`KvError::ExceedsCapacity`]).
    pub fn check_fits_alone(&self, id: u64, len: usize) -> Result<(), KvError> {
        for (pool, max) in [(&self.swa, self.cfg.max_blocks_per_seq_swa), (&self.kv, self.cfg.max_blocks_per_seq_kv)] {
            let need = row_blocks(pool, max, id, len)?;
            if need > pool.capacity() {
                return Err(KvError::ExceedsCapacity {
                    pool: pool.name,
                    id,
                    len,
                    need,
                    block_size: pool.block_size,
                    capacity: pool.capacity(),
                });
            }
        }
        Ok(())
    }

    /// Extra blocks `(swa, kv)` request `id` needs to hold `len` tokens, or the table-width error.
    fn growth(&self, id: u64, len: usize) -> Result<(usize, usize), KvError> {
        let (have_swa, have_kv) = self.held.get(&id).map_or((0, 0), |h| (h.swa.len(), h.kv.len()));
        let mut out = [0usize; 2];
        for (i, (pool, max, have)) in [
            (&self.swa, self.cfg.max_blocks_per_seq_swa, have_swa),
            (&self.kv, self.cfg.max_blocks_per_seq_kv, have_kv),
        ]
        .into_iter()
        .enumerate()
        {
            let need = row_blocks(pool, max, id, len)?;
            out[i] = need.saturating_sub(have);
        }
        Ok((out[0], out[1]))
    }

    /// Makes request `id` hold blocks for `len` tokens (allocating as it grows; never shrinks, a
    /// smaller `len` is a no-op). All-or-nothing: on [`KvError::Exhausted`] or
    /// [`KvError::TooLong`] nothing changed.
    pub fn ensure(&mut self, id: u64, len: usize) -> Result<(), KvError> {
        let (add_swa, add_kv) = self.growth(id, len)?;
        for (pool, add) in [(&self.swa, add_swa), (&self.kv, add_kv)] {
            if add > pool.num_free() {
                return Err(KvError::Exhausted { pool: pool.name, id, need: add, free: pool.num_free() });
            }
        }
        // Both fit: neither allocation can fail now.
        let swa = self.swa.allocate_for(id, add_swa)?;
        let kv = self.kv.allocate_for(id, add_kv)?;
        let h = self.held.entry(id).or_default();
        h.swa.extend(swa);
        h.kv.extend(kv);
        h.len = h.len.max(len);
        Ok(())
    }

    /// Whether [`KvManager::ensure`]`(id, len)` would succeed now.
    pub fn can_fit(&self, id: u64, len: usize) -> bool {
        match self.growth(id, len) {
            Ok((s, k)) => s <= self.swa.num_free() && k <= self.kv.num_free(),
            Err(_) => false,
        }
    }

    /// Gives back every block of request `id` (on finish or preemption); unknown ids are a no-op.
    pub fn free(&mut self, id: u64) {
        if let Some(h) = self.held.remove(&id) {
            // The ids came from these pools and were held once, so release cannot refuse them;
            // should it ever, the blocks stay marked in use (a leak, never a double hand-out).
            let _ = self.swa.release(&h.swa);
            let _ = self.kv.release(&h.kv);
        }
    }

    /// Whether request `id` holds an entry.
    pub fn holds(&self, id: u64) -> bool {
        self.held.contains_key(&id)
    }

    /// Tokens request `id` holds blocks for, or `None`.
    pub fn held_len(&self, id: u64) -> Option<usize> {
        self.held.get(&id).map(|h| h.len)
    }

    /// Request `id`'s SWA block ids in position order, or `None`.
    pub fn swa_blocks(&self, id: u64) -> Option<&[i32]> {
        self.held.get(&id).map(|h| h.swa.as_slice())
    }

    /// Request `id`'s main-cache block ids in position order, or `None`.
    pub fn kv_blocks(&self, id: u64) -> Option<&[i32]> {
        self.held.get(&id).map(|h| h.kv.as_slice())
    }

    /// Ids of the requests holding an entry, ascending.
    pub fn request_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.held.keys().copied()
    }

    fn slot(&self, id: u64, pos: usize, swa: bool) -> Result<i32, KvError> {
        let h = self.held.get(&id).ok_or(KvError::UnknownRequest(id))?;
        if pos >= h.len {
            return Err(KvError::PositionOutOfRange { id, pos, len: h.len });
        }
        let (blocks, bs) = if swa { (&h.swa, self.swa.block_size) } else { (&h.kv, self.kv.block_size) };
        let block = blocks.get(pos / bs).ok_or(KvError::PositionOutOfRange { id, pos, len: h.len })?;
        // In range of i32: checked at construction (num_blocks × block_size ≤ i32::MAX).
        Ok(*block * bs as i32 + (pos % bs) as i32)
    }

    /// Slot (global token index) of position `pos` (tokens) of request `id` in the SWA cache:
    /// `block_id · block_size + pos % block_size`. Errors for an unknown request or a position at
    /// or past its held length.
    pub fn swa_slot(&self, id: u64, pos: usize) -> Result<i32, KvError> {
        self.slot(id, pos, true)
    }

    /// Slot of position `pos` in the main cache, in uncompressed tokens (`block_id · kv_block_size
    /// + pos % kv_block_size`); compressed slots are derived from it on the device.
    pub fn kv_slot(&self, id: u64, pos: usize) -> Result<i32, KvError> {
        self.slot(id, pos, false)
    }

    fn write_row(&self, id: u64, out: &mut [i32], swa: bool) -> Result<(), KvError> {
        let (pool, want) =
            if swa { ("swa", self.cfg.max_blocks_per_seq_swa) } else { ("kv", self.cfg.max_blocks_per_seq_kv) };
        if out.len() != want {
            return Err(KvError::RowWidth { pool, got: out.len(), want });
        }
        let h = self.held.get(&id).ok_or(KvError::UnknownRequest(id))?;
        let blocks = if swa { &h.swa } else { &h.kv };
        // `ensure` never lets a request hold more than `want` blocks.
        let n = blocks.len().min(want);
        out[..n].copy_from_slice(&blocks[..n]);
        out[n..].fill(0);
        Ok(())
    }

    /// Appends to `out` the blocks request `id` holds past `sent = (swa, kv)` columns (those its
    /// table row `row` already has) as at most one update per table, and returns the columns the
    /// row has afterwards (every block it holds). From `(0, 0)` that is the whole row, as a
    /// request given a table row needs. Errors for an unknown request, or `sent` past what it holds.
    pub fn push_table_updates(
        &self,
        id: u64,
        row: usize,
        sent: (usize, usize),
        out: &mut BlockTableUpdates,
    ) -> Result<(usize, usize), KvError> {
        let h = self.held.get(&id).ok_or(KvError::UnknownRequest(id))?;
        for (have, blocks, pool) in [(sent.0, &h.swa, "swa"), (sent.1, &h.kv, "kv")] {
            if have > blocks.len() {
                return Err(KvError::ColumnsPastHeld { id, pool, sent: have, held: blocks.len() });
            }
        }
        out.push(TableKind::Swa, row, sent.0, &h.swa[sent.0..]);
        out.push(TableKind::Kv, row, sent.1, &h.kv[sent.1..]);
        Ok((h.swa.len(), h.kv.len()))
    }

    /// Row of the SWA block table for request `id`, padded with 0 (the null block) to
    /// `max_blocks_per_seq_swa` entries; `out` must hold exactly that many.
    pub fn write_swa_row(&self, id: u64, out: &mut [i32]) -> Result<(), KvError> {
        self.write_row(id, out, true)
    }

    /// Row of the main block table for request `id`, padded with 0 to `max_blocks_per_seq_kv`
    /// entries; `out` must hold exactly that many.
    pub fn write_kv_row(&self, id: u64, out: &mut [i32]) -> Result<(), KvError> {
        self.write_row(id, out, false)
    }

    /// Used and free blocks per pool, and requests held.
    pub fn stats(&self) -> KvStats {
        KvStats {
            swa_used: self.swa.num_used(),
            swa_free: self.swa.num_free(),
            swa_capacity: self.swa.capacity(),
            kv_used: self.kv.num_used(),
            kv_free: self.kv.num_free(),
            kv_capacity: self.kv.capacity(),
            requests: self.held.len(),
        }
    }
}
