//! A synthetic decode batch for benchmarks: `rows` requests on table rows `0..rows`, one token
//! each per step, with random contexts and block ids, driving a [`CommonAttentionMetadata`] the
//! way a scheduler does (whole rows written once, then a block appended only where a token starts
//! one; admitted requests replace old ones and have their whole rows written).

use holdfast_hal::Stream;

use crate::common::{BlockTableConfig, BlockTableUpdates, CommonAttentionMetadata, CommonConfig, StepInput, TableKind};
use crate::error::Result;

/// A xorshift64 generator: fast, reproducible from its seed, not for anything but test data.
#[derive(Clone, Debug)]
pub struct XorShift(u64);

impl XorShift {
    /// A generator from `seed` (0 is replaced by 1: xorshift has no zero state).
    pub fn new(seed: u64) -> Self {
        XorShift(seed.max(1))
    }

    /// The next value in `[0, n)` (0 for `n = 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// Requests a benchmark's admission step admits in a batch of `rows`: `max(1, rows / 64)`.
pub fn admitted(rows: usize) -> usize {
    (rows / 64).max(1)
}

/// A decode batch (see the module docs). Each request's context is drawn in
/// `[1, max_model_len − 256]`; a request that reaches `max_model_len` starts over as a fresh one.
#[derive(Debug)]
pub struct DecodeBatch {
    cfg: CommonConfig,
    rng: XorShift,
    qsl: Vec<i32>,
    seq: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    table_rows: Vec<u32>,
    /// Each request's blocks, per table (what its device rows hold).
    blocks: [Vec<Vec<i32>>; 2],
    updates: BlockTableUpdates,
}

impl DecodeBatch {
    /// `rows` fresh requests (`rows <= cfg.max_num_seqs`), drawn from `seed`.
    pub fn new(cfg: CommonConfig, seed: u64, rows: usize) -> DecodeBatch {
        let mut d = DecodeBatch {
            cfg,
            rng: XorShift::new(seed),
            qsl: (0..=rows as i32).collect(),
            seq: vec![0; rows],
            pos: vec![0; rows],
            slots: (0..rows as i32).collect(),
            table_rows: (0..rows as u32).collect(),
            blocks: [vec![Vec::new(); rows], vec![Vec::new(); rows]],
            updates: BlockTableUpdates::new(),
        };
        for r in 0..rows {
            d.fresh(r);
        }
        d
    }

    /// Requests in the batch.
    pub fn rows(&self) -> usize {
        self.seq.len()
    }

    fn tables(&self) -> [(TableKind, BlockTableConfig); 2] {
        [(TableKind::Swa, self.cfg.swa_table), (TableKind::Kv, self.cfg.kv_table)]
    }

    /// Request `r` becomes a fresh one with a random context (its rows are to be written whole).
    fn fresh(&mut self, r: usize) {
        let room = (self.cfg.max_model_len as u64).saturating_sub(256).max(1);
        self.seq[r] = 1 + self.rng.below(room) as i32;
        for (k, (_, t)) in self.tables().into_iter().enumerate() {
            let need = (self.seq[r] as usize).div_ceil(t.block_size);
            self.blocks[k][r] = (0..need).map(|_| 1 + self.rng.below(t.num_blocks as u64 - 1) as i32).collect();
        }
        self.pos[r] = self.seq[r] - 1;
    }

    /// Writes every request's whole rows into `common`'s tables: steps without requests, each at
    /// most `max_table_updates` cells, each uploaded and waited for.
    pub fn fill(&mut self, common: &mut CommonAttentionMetadata, s: &Stream) -> Result<()> {
        let rows = self.rows();
        let mut r = 0;
        while r < rows {
            self.updates.clear();
            while r < rows
                && self.updates.cells() + self.blocks[0][r].len() + self.blocks[1][r].len()
                    <= self.cfg.max_table_updates
            {
                for (k, (kind, _)) in self.tables().into_iter().enumerate() {
                    self.updates.push(kind, r, 0, &self.blocks[k][r]);
                }
                r += 1;
            }
            let input = StepInput {
                query_start_loc: &[0],
                seq_lens: &[],
                positions: &[],
                slot_mapping: &[],
                table_rows: &[],
                table_updates: &self.updates,
                num_reqs_padded: 1,
                num_tokens_padded: 1,
            };
            common.stage(&input)?;
            common.upload(s)?;
            s.synchronize()?;
        }
        Ok(())
    }

    /// The next decode step: every request decodes one token; a table gets the request's next
    /// block when that token starts one. Requests `0..admit`, and any that reached
    /// `max_model_len`, are replaced by fresh ones (their table rows released and written whole).
    pub fn advance(&mut self, admit: usize, common: &mut CommonAttentionMetadata) -> Result<()> {
        self.updates.clear();
        for r in 0..self.rows() {
            if r < admit || self.seq[r] as usize >= self.cfg.max_model_len {
                common.release_table_row(r)?;
                self.fresh(r);
                for (k, (kind, _)) in self.tables().into_iter().enumerate() {
                    self.updates.push(kind, r, 0, &self.blocks[k][r]);
                }
                continue;
            }
            self.seq[r] += 1;
            let p = self.seq[r] as usize - 1;
            for (k, (kind, t)) in self.tables().into_iter().enumerate() {
                if p.is_multiple_of(t.block_size) {
                    let id = 1 + self.rng.below(t.num_blocks as u64 - 1) as i32;
                    self.blocks[k][r].push(id);
                    self.updates.push(kind, r, p / t.block_size, &[id]);
                }
            }
            self.pos[r] = p as i32;
        }
        Ok(())
    }

    /// The current step's input (unpadded: padded counts equal the real ones).
    pub fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq,
            positions: &self.pos,
            slot_mapping: &self.slots,
            table_rows: &self.table_rows,
            table_updates: &self.updates,
            num_reqs_padded: self.rows(),
            num_tokens_padded: self.rows(),
        }
    }
}
