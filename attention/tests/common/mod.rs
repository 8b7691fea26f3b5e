//! Shared test helpers: random DeepSeek-V4 batches and plain references written from spec §5.

#![allow(dead_code, unused_imports)]

pub mod sched;

use holdfast_attention::{
    c128a_max_compressed, AttentionError, BlockTableConfig, BlockTableUpdates, C128aBuilder, C4aBuilder,
    CommonAttentionMetadata, CommonConfig, StepInput, StepLayout, SwaBuilder, TableKind, C128A_RATIO, C4A_RATIO,
};
use holdfast_hal::{Buffer, Device, Stream};

/// Unwritten i32 outputs read as this (0x7B7B7B7B), never a plausible index or -1.
pub const POISON: i32 = 0x7B7B_7B7B;

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> i64 {
        (self.next() % n.max(1)) as i64
    }
    pub fn range(&mut self, lo: i64, hi_inclusive: i64) -> i64 {
        lo + self.below((hi_inclusive - lo + 1) as u64)
    }
}

pub fn config(
    max_tokens: usize,
    max_seqs: usize,
    max_model_len: usize,
    spec: usize,
    swa_bs: usize,
    kv_bs: usize,
) -> CommonConfig {
    let (ws, wk) = (max_model_len.div_ceil(swa_bs), max_model_len.div_ceil(kv_bs));
    CommonConfig {
        max_num_batched_tokens: max_tokens,
        max_num_seqs: max_seqs,
        max_model_len,
        num_spec_tokens: spec,
        swa_table: BlockTableConfig { block_size: swa_bs, max_blocks_per_seq: ws, num_blocks: 4096 },
        kv_table: BlockTableConfig { block_size: kv_bs, max_blocks_per_seq: wk, num_blocks: 4096 },
        // Room for every request's whole rows in one step (tests write them at once).
        max_table_updates: max_seqs * (ws + wk),
    }
}

/// One rejected call of an error table (the HAL's shared test support).
pub type ErrorCase = holdfast_hal::testing::ErrorCase<AttentionError>;
pub use holdfast_hal::testing::{check_errors, words};

/// One step's host inputs, owned. `swa_bt` / `kv_bt` are the spec's full-width per-request rows
/// (`[num_reqs, max_blocks_per_seq]`, what the references read); the step hands attention only
/// `table_rows` and `updates`, which [`Batch::set_table_rows`] derives from them.
#[derive(Clone, Debug)]
pub struct Batch {
    pub qsl: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub positions: Vec<i32>,
    pub slots: Vec<i32>,
    pub swa_bt: Vec<i32>,
    pub kv_bt: Vec<i32>,
    pub table_rows: Vec<u32>,
    pub updates: BlockTableUpdates,
    pub reqs_padded: usize,
    pub tokens_padded: usize,
}

impl Batch {
    pub fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            positions: &self.positions,
            slot_mapping: &self.slots,
            table_rows: &self.table_rows,
            table_updates: &self.updates,
            num_reqs_padded: self.reqs_padded,
            num_tokens_padded: self.tokens_padded,
        }
    }
    /// Gives request `r` table row `rows[r]` and makes this step's updates write the columns
    /// each request uses (`ceil(seq_len / block_size)`) of both its rows from `swa_bt` / `kv_bt`.
    pub fn set_table_rows(&mut self, cfg: &CommonConfig, rows: Vec<u32>) {
        assert_eq!(rows.len(), self.num_reqs(), "one table row per request");
        self.updates.clear();
        for (r, &row) in rows.iter().enumerate() {
            for (kind, t, table) in
                [(TableKind::Swa, cfg.swa_table, &self.swa_bt), (TableKind::Kv, cfg.kv_table, &self.kv_bt)]
            {
                let w = t.max_blocks_per_seq;
                let need = (self.seq_lens[r] as usize).div_ceil(t.block_size).min(w);
                self.updates.push(kind, row as usize, 0, &table[r * w..r * w + need]);
            }
        }
        self.table_rows = rows;
    }
    pub fn num_reqs(&self) -> usize {
        self.qsl.len() - 1
    }
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }
}

/// A sequence length near a multiple of 4 or 128 (the compression boundaries), at least `q`.
fn seq_len(rng: &mut Rng, q: usize, max_model_len: usize) -> usize {
    let base = match rng.below(4) {
        0 => rng.below((max_model_len / 128) as u64 + 1) * 128,
        1 => rng.below((max_model_len / 4) as u64 + 1) * 4,
        2 => rng.below(300),
        _ => rng.below(max_model_len as u64 + 1),
    };
    let s = (base + rng.range(-2, 2)).clamp(0, max_model_len as i64) as usize;
    s.max(q).min(max_model_len)
}

/// `decodes` requests of 1..=1+spec queries, then `prefills` requests of longer queries; random
/// block ids, some slot -1 tokens, padded by `pad_reqs` / `pad_tokens`.
pub fn random_batch(
    rng: &mut Rng,
    cfg: &CommonConfig,
    decodes: usize,
    prefills: usize,
    pad_reqs: usize,
    pad_tokens: usize,
) -> Batch {
    let thr = cfg.decode_threshold();
    let mut qsl = vec![0i32];
    let (mut seq_lens, mut positions, mut slots) = (vec![], vec![], vec![]);
    let (mut swa_bt, mut kv_bt) = (vec![], vec![]);
    for r in 0..decodes + prefills {
        let q = if r < decodes {
            rng.range(1, thr as i64) as usize
        } else {
            rng.range(thr as i64 + 1, thr as i64 + 24) as usize
        };
        let s = seq_len(rng, q, cfg.max_model_len);
        for j in 0..q {
            positions.push((s - q + j) as i32);
            slots.push(if rng.below(10) == 0 { -1 } else { rng.below(100_000) as i32 });
        }
        qsl.push(qsl[r] + q as i32);
        seq_lens.push(s as i32);
        for _ in 0..cfg.swa_table.max_blocks_per_seq {
            swa_bt.push(rng.below(cfg.swa_table.num_blocks as u64) as i32);
        }
        for _ in 0..cfg.kv_table.max_blocks_per_seq {
            kv_bt.push(rng.below(cfg.kv_table.num_blocks as u64) as i32);
        }
    }
    let nr = decodes + prefills;
    let nt = positions.len();
    let mut b = Batch {
        qsl,
        seq_lens,
        positions,
        slots,
        swa_bt,
        kv_bt,
        table_rows: vec![],
        updates: BlockTableUpdates::new(),
        reqs_padded: (nr + pad_reqs).min(cfg.max_num_seqs),
        tokens_padded: (nt + pad_tokens).min(cfg.max_num_batched_tokens),
    };
    b.set_table_rows(cfg, random_rows(rng, cfg.max_num_seqs, nr));
    b
}

/// `n` distinct table rows drawn from `[0, max_num_seqs)` in random order.
pub fn random_rows(rng: &mut Rng, max_num_seqs: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..max_num_seqs as u32).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i as u64 + 1) as usize);
    }
    all.truncate(n);
    all
}

/// A decode batch whose host rows (`swa_bt` / `kv_bt`, by batch row) are the spec's tables and
/// whose table rows are `rows`; `updates` start empty.
pub fn decode_batch(cfg: &CommonConfig, rng: &mut Rng, seq: &[usize], rows: &[u32], pad: usize) -> Batch {
    let (ws, wk) = (cfg.swa_table.max_blocks_per_seq, cfg.kv_table.max_blocks_per_seq);
    let nr = seq.len();
    let ids =
        |rng: &mut Rng, n: usize, blocks: usize| (0..n).map(|_| 1 + rng.below(blocks as u64 - 1) as i32).collect();
    Batch {
        qsl: (0..=nr as i32).collect(),
        seq_lens: seq.iter().map(|&s| s as i32).collect(),
        positions: seq.iter().map(|&s| s as i32 - 1).collect(),
        slots: (0..nr as i32).collect(),
        swa_bt: ids(rng, nr * ws, cfg.swa_table.num_blocks),
        kv_bt: ids(rng, nr * wk, cfg.kv_table.num_blocks),
        table_rows: rows.to_vec(),
        updates: BlockTableUpdates::new(),
        reqs_padded: nr + pad,
        tokens_padded: nr + pad,
    }
}

/// Writes request `r`'s columns `from..` up to what its seq len uses, in both tables.
pub fn push_used(cfg: &CommonConfig, b: &mut Batch, r: usize, from: [usize; 2]) {
    for (k, (kind, t)) in [(TableKind::Swa, cfg.swa_table), (TableKind::Kv, cfg.kv_table)].into_iter().enumerate() {
        let w = t.max_blocks_per_seq;
        let need = (b.seq_lens[r] as usize).div_ceil(t.block_size);
        let table = if k == 0 { &b.swa_bt } else { &b.kv_bt };
        let blocks = table[r * w + from[k]..r * w + need].to_vec();
        b.updates.push(kind, b.table_rows[r] as usize, from[k], &blocks);
    }
}

/// `(valid, position, request)` of padded token `t` per §3.4 padding.
pub fn token(b: &Batch, t: usize) -> (bool, i64, usize) {
    if t >= b.num_tokens() || b.slots[t] < 0 {
        return (false, 0, 0);
    }
    let r = (0..b.num_reqs())
        .find(|&r| (b.qsl[r] as usize..b.qsl[r + 1] as usize).contains(&t))
        .expect("token in a request");
    (true, i64::from(b.positions[t]), r)
}

fn slot(table: &[i32], width: usize, r: usize, p: i64, bs: i64) -> i32 {
    (i64::from(table[r * width + (p / bs) as usize]) * bs + p % bs) as i32
}

/// §5.3: per decode token the window's global SWA slots (exactly `len` of them).
pub fn swa_ref(b: &Batch, cfg: &CommonConfig, l: &StepLayout, window: usize) -> Vec<Vec<i32>> {
    let t = cfg.swa_table;
    (0..l.num_decode_tokens)
        .map(|tok| {
            let (valid, p, r) = token(b, tok);
            if !valid {
                return vec![];
            }
            let start = (p - window as i64 + 1).max(0);
            (start..=p).map(|q| slot(&b.swa_bt, t.max_blocks_per_seq, r, q, t.block_size as i64)).collect()
        })
        .collect()
}

/// §5.3 step 5: `query_len + min(prefix_len, window − 1)` per prefill request (padded ones 0).
pub fn gather_lens_ref(b: &Batch, l: &StepLayout, window: usize) -> Vec<i32> {
    (l.num_decodes..l.num_decodes + l.num_prefills)
        .map(|r| {
            if r >= b.num_reqs() {
                return 0;
            }
            let q = b.qsl[r + 1] - b.qsl[r];
            q + (b.seq_lens[r] - q).min(window as i32 - 1)
        })
        .collect()
}

/// §5.2: per decode token the global slots of its first `min((pos + 1) / 128, width)` entries.
pub fn c128a_decode_ref(b: &Batch, cfg: &CommonConfig, l: &StepLayout) -> Vec<Vec<i32>> {
    let (t, w) = (cfg.kv_table, c128a_max_compressed(cfg.max_model_len));
    let cbs = (t.block_size / C128A_RATIO) as i64;
    (0..l.num_decode_tokens)
        .map(|tok| {
            let (valid, p, r) = token(b, tok);
            let n = if valid { (((p + 1) / C128A_RATIO as i64) as usize).min(w) } else { 0 };
            (0..n as i64).map(|j| slot(&b.kv_bt, t.max_blocks_per_seq, r, j, cbs)).collect()
        })
        .collect()
}

/// §5.2: per prefill token the count of visible compressed entries (row = `0..n`).
pub fn c128a_prefill_ref(b: &Batch, cfg: &CommonConfig, l: &StepLayout) -> Vec<usize> {
    let w = c128a_max_compressed(cfg.max_model_len);
    (l.num_decode_tokens..l.num_tokens_padded)
        .map(|tok| {
            let (valid, p, _) = token(b, tok);
            if valid {
                (((p + 1) / C128A_RATIO as i64) as usize).min(w)
            } else {
                0
            }
        })
        .collect()
}

/// A random indexer output `[rows, k]`: valid local positions, -1s and out-of-range entries
/// interleaved.
pub fn random_topk(rng: &mut Rng, b: &Batch, rows: usize, k: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(rows * k);
    for tok in 0..rows {
        let (_, p, _) = token(b, tok);
        let avail = (p + 1) / C4A_RATIO as i64;
        for _ in 0..k {
            out.push(match rng.below(8) {
                0 => -1,
                1 => (avail + rng.below(50)) as i32,
                _ if avail > 0 => rng.below(avail as u64) as i32,
                _ => -1,
            });
        }
    }
    out
}

/// §5.4 c4a: kept entries (`0 ≤ v < (pos + 1) / 4`) mapped to global slots, in row order.
pub fn c4a_ref(b: &Batch, cfg: &CommonConfig, l: &StepLayout, topk: &[i32], k: usize) -> Vec<Vec<i32>> {
    let t = cfg.kv_table;
    let cbs = (t.block_size / C4A_RATIO) as i64;
    (0..l.num_decode_tokens)
        .map(|tok| {
            let (valid, p, r) = token(b, tok);
            if !valid {
                return vec![];
            }
            let avail = (p + 1) / C4A_RATIO as i64;
            topk[tok * k..(tok + 1) * k]
                .iter()
                .filter(|&&v| v >= 0 && i64::from(v) < avail)
                .map(|&v| slot(&b.kv_bt, t.max_blocks_per_seq, r, i64::from(v), cbs))
                .collect()
        })
        .collect()
}

/// The three decode builders over one common metadata, with the top-k buffer c4a reads.
pub struct BuilderRig {
    pub common: CommonAttentionMetadata,
    pub swa: SwaBuilder,
    pub c128a: C128aBuilder,
    pub c4a: C4aBuilder,
    pub topk: Buffer<i32>,
    pub k: usize,
}

impl BuilderRig {
    /// Builders for `cfg` with an SWA window of `window` and a c4a top-k of `k`.
    pub fn new(dev: &Device, cfg: CommonConfig, window: usize, k: usize) -> BuilderRig {
        BuilderRig {
            common: CommonAttentionMetadata::new(dev, cfg).expect("common"),
            swa: SwaBuilder::new(dev, &cfg, window).expect("swa"),
            c128a: C128aBuilder::new(dev, &cfg).expect("c128a"),
            c4a: C4aBuilder::new(dev, &cfg, k).expect("c4a"),
            topk: dev.alloc_persistent::<i32>("indexer.topk", cfg.max_num_batched_tokens * k).expect("topk"),
            k,
        }
    }

    /// Stages `b` and uploads it, uploads a random top-k for its decode tokens, and poisons every
    /// builder output; returns the layout and the top-k rows (`[decode tokens, k]`).
    pub fn prepare(&mut self, s: &Stream, b: &Batch, rng: &mut Rng, what: &str) -> (StepLayout, Vec<i32>) {
        let l = self.common.stage(&b.input()).unwrap_or_else(|e| panic!("{what}: stage: {e}"));
        self.common.upload(s).expect("upload");
        let topk = random_topk(rng, b, l.num_decode_tokens, self.k);
        if !topk.is_empty() {
            s.copy_from_host(&topk, &self.topk.prefix(topk.len()).expect("view")).expect("topk upload");
        }
        self.swa.fill_outputs(s, POISON).expect("poison");
        self.c128a.fill_outputs(s, POISON).expect("poison");
        self.c4a.fill_outputs(s, POISON).expect("poison");
        (l, topk)
    }
}
