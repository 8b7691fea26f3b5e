//! A tiny scheduler for multi-step tests: requests with their own block tables advance by decode
//! tokens or prefill chunks, decodes first, with padding; plus the f64 compressor definition.

use super::{Batch, Rng};
use holdfast_attention::CommonConfig;

/// A config with a small cache (`num_blocks` blocks per table), so whole caches can be poisoned
/// and checked.
pub fn small_config(
    max_tokens: usize,
    max_seqs: usize,
    max_model_len: usize,
    kv_bs: usize,
    num_blocks: usize,
) -> CommonConfig {
    let mut c = super::config(max_tokens, max_seqs, max_model_len, 0, 64, kv_bs);
    c.swa_table.num_blocks = num_blocks;
    c.kv_table.num_blocks = num_blocks;
    c
}

/// One request: its main-table row and progress.
#[derive(Clone, Debug)]
pub struct Req {
    /// `[kv_table.max_blocks_per_seq]` block ids (distinct across requests).
    pub blocks: Vec<i32>,
    /// Total tokens.
    pub len: usize,
    /// Tokens computed so far.
    pub done: usize,
}

/// `n` requests of the given lengths with disjoint random blocks from `[1, num_blocks)`.
pub fn requests(rng: &mut Rng, cfg: &CommonConfig, lens: &[usize]) -> Vec<Req> {
    let t = cfg.kv_table;
    let mut free: Vec<i32> = (1..t.num_blocks as i32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i as u64 + 1) as usize);
    }
    lens.iter()
        .map(|&len| {
            let need = len.div_ceil(t.block_size);
            assert!(need <= free.len(), "test config has too few blocks");
            let mut blocks: Vec<i32> = free.drain(..need).collect();
            blocks.resize(t.max_blocks_per_seq, 0);
            Req { blocks, len, done: 0 }
        })
        .collect()
}

/// One planned step: the batch and, per real token, its request index (into the request list).
pub struct Step {
    pub batch: Batch,
    pub token_req: Vec<usize>,
}

/// Advances every unfinished request by 1 token (decode) or a chunk of `2..=max_chunk` tokens,
/// decodes first; pads by up to `max_pad` tokens and one request. `None` when all are done.
pub fn plan(rng: &mut Rng, cfg: &CommonConfig, reqs: &mut [Req], max_chunk: usize, max_pad: usize) -> Option<Step> {
    let mut picks: Vec<(usize, usize)> = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let left = r.len - r.done;
        if left == 0 {
            continue;
        }
        let q = if left >= 2 && rng.below(2) == 0 { rng.range(2, left.min(max_chunk) as i64) as usize } else { 1 };
        picks.push((i, q));
    }
    if picks.is_empty() {
        return None;
    }
    picks.sort_by_key(|&(_, q)| q > 1);
    let t = cfg.kv_table;
    let mut b = Batch {
        qsl: vec![0],
        seq_lens: vec![],
        positions: vec![],
        slots: vec![],
        swa_bt: vec![],
        kv_bt: vec![],
        table_rows: vec![],
        updates: Default::default(),
        reqs_padded: 0,
        tokens_padded: 0,
    };
    let mut token_req = Vec::new();
    let mut rows = Vec::new();
    assert!(reqs.len() <= cfg.max_num_seqs, "one table row per request");
    for &(i, q) in &picks {
        // Request i keeps table row i for its whole life.
        rows.push(i as u32);
        let r = &mut reqs[i];
        for p in r.done..r.done + q {
            b.positions.push(p as i32);
            let bs = t.block_size;
            b.slots.push(r.blocks[p / bs] * bs as i32 + (p % bs) as i32);
            token_req.push(i);
        }
        r.done += q;
        b.qsl.push(b.qsl.last().copied().unwrap_or(0) + q as i32);
        b.seq_lens.push(r.done as i32);
        b.kv_bt.extend_from_slice(&r.blocks);
        b.swa_bt.extend(std::iter::repeat_n(0, cfg.swa_table.max_blocks_per_seq));
    }
    b.set_table_rows(cfg, rows);
    let nt = b.positions.len();
    assert!(nt <= cfg.max_num_batched_tokens, "plan exceeds the token budget");
    b.tokens_padded = (nt + rng.below(max_pad as u64 + 1) as usize).min(cfg.max_num_batched_tokens);
    b.reqs_padded = (picks.len() + rng.below(2) as usize).min(cfg.max_num_seqs);
    Some(Step { batch: b, token_req })
}

/// Uniform in `[lo, hi)`.
pub fn uniform(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * ((rng.next() >> 11) as f64 / (1u64 << 53) as f64) as f32
}

/// The f64 definition of one compressed entry from its window's `ratio` rows `[2·dim]` (kv then
/// score): gated softmax pooling with `ape [ratio, dim]`, RMSNorm with `norm [dim]`, RoPE of the
/// last `rope_dim` channels at `cpos`.
#[allow(clippy::too_many_arguments)]
pub fn compress_ref(
    rows: &[&[f32]],
    ape: &[f32],
    norm: &[f32],
    dim: usize,
    rope_dim: usize,
    theta: f64,
    eps: f64,
    cpos: f64,
) -> Vec<f64> {
    let ratio = rows.len();
    let e: Vec<f64> = (0..dim)
        .map(|c| {
            let s: Vec<f64> = (0..ratio).map(|j| f64::from(rows[j][dim + c]) + f64::from(ape[j * dim + c])).collect();
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let den: f64 = s.iter().map(|x| (x - m).exp()).sum();
            (0..ratio).map(|j| (s[j] - m).exp() / den * f64::from(rows[j][c])).sum()
        })
        .collect();
    let ms = e.iter().map(|x| x * x).sum::<f64>() / dim as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    let mut y: Vec<f64> = e.iter().zip(norm).map(|(x, n)| x * inv * f64::from(*n)).collect();
    let nope = dim - rope_dim;
    for i in 0..rope_dim / 2 {
        let ang = cpos * theta.powf(-((2 * i) as f64) / rope_dim as f64);
        let (a, b) = (y[nope + 2 * i], y[nope + 2 * i + 1]);
        y[nope + 2 * i] = a * ang.cos() - b * ang.sin();
        y[nope + 2 * i + 1] = a * ang.sin() + b * ang.cos();
    }
    y
}

/// `‖got − want‖ / ‖want‖`.
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(1e-300)).sqrt()
}
