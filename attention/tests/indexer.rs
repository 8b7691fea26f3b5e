//! The c4a indexer against an f64 definition with an exact sorted top-k: integer-valued inputs
//! (every f32 sum is exact in any order, and ties are frequent), rows with fewer entries than
//! `topk`, no entries, padding, long rows, real-valued inputs (checked up to rounding), batch
//! invariance and input validation. One test captures compressor + indexer + c4a build in a graph
//! and replays it over fresh steps, bit for bit equal to eager. The top-k kernel also runs alone
//! on crafted logits (heavy ties, NaNs, infinities, signed zeros, values crowded into one
//! histogram bin; rows shorter and longer than `topk`, up to 70000 entries) against a sorted
//! definition, bit for bit. Runs on `cpu` always and on `cuda:0` when present.

mod common;

use std::cell::RefCell;

use common::sched::*;
use common::{check_errors, token, words, Batch, ErrorCase, Rng, POISON};
use holdfast_attention::indexer::{topk_launch_config, TOPK_MAX, TOPK_SAMPLES};
use holdfast_attention::{
    indexer_max_compressed, indexer_source, AttentionError, C4aBuilder, CommonAttentionMetadata, CommonConfig,
    Compressor, CompressorWeights, Indexer, TOPK_THREADS,
};
use holdfast_hal::{bf16, Buffer, Device, Stream};

struct Rig {
    cfg: CommonConfig,
    common: CommonAttentionMetadata,
    idx: Indexer,
    kh: Vec<bf16>,
    k: Buffer<bf16>,
    q: Buffer<bf16>,
    w: Buffer<f32>,
    out: Buffer<i32>,
    heads: usize,
    dim: usize,
    topk: usize,
}

impl Rig {
    fn new(dev: &Device, cfg: CommonConfig, heads: usize, dim: usize, topk: usize, kh: Vec<bf16>) -> Rig {
        let idx = Indexer::new(dev, &cfg, heads, dim, topk).expect("indexer");
        assert_eq!(kh.len(), idx.cache_rows() * dim);
        let t = cfg.max_num_batched_tokens;
        Rig {
            common: CommonAttentionMetadata::new(dev, cfg).expect("common"),
            k: dev.alloc_from_slice("test.k_cache", &kh, true).expect("k"),
            q: dev.alloc_persistent("test.q", t * heads * dim).expect("q"),
            w: dev.alloc_persistent("test.w", t * heads).expect("w"),
            out: dev.alloc_from_slice("test.out", &vec![POISON; t * topk], true).expect("out"),
            idx,
            kh,
            cfg,
            heads,
            dim,
            topk,
        }
    }

    /// Stages `b`, runs the indexer and returns the whole (poisoned first) output buffer.
    fn run(&mut self, s: &Stream, b: &Batch, q: &[bf16], w: &[f32], scale: f32) -> Vec<i32> {
        let l = self.common.stage(&b.input()).expect("stage");
        let t = l.num_tokens_padded;
        self.common.upload(s).expect("upload");
        let qv = self.q.prefix(t * self.heads * self.dim).expect("q");
        let wv = self.w.prefix(t * self.heads).expect("w");
        s.copy_from_host(q, &qv).expect("q upload");
        s.copy_from_host(w, &wv).expect("w upload");
        let stats = self
            .idx
            .select_with_stats(
                s,
                &self.common,
                &qv,
                &wv,
                &self.k.view(),
                scale,
                &self.out.prefix(t * self.topk).expect("out"),
            )
            .expect("select");
        let launches = 2 + usize::from(self.idx.topk_segments(t) > 1);
        assert_eq!((stats.launches, stats.host_syncs), (launches, 0));
        s.copy_to_host_sync(&self.out.view()).expect("read out")
    }

    /// The f64 logits of every padded token (empty for tokens that see nothing).
    fn logits(&self, b: &Batch, q: &[bf16], w: &[f32], scale: f64) -> Vec<Vec<f64>> {
        let (h, d) = (self.heads, self.dim);
        let kt = self.cfg.kv_table;
        let cbs = kt.block_size / 4;
        let mc = indexer_max_compressed(self.cfg.max_model_len);
        (0..b.tokens_padded)
            .map(|t| {
                let (valid, p, r) = token(b, t);
                let n = if valid { (((p + 1) / 4) as usize).min(mc) } else { 0 };
                (0..n)
                    .map(|c| {
                        let slot = b.kv_bt[r * kt.max_blocks_per_seq + c / cbs] as usize * cbs + c % cbs;
                        let k = &self.kh[slot * d..(slot + 1) * d];
                        (0..h)
                            .map(|hh| {
                                let qh = &q[(t * h + hh) * d..(t * h + hh + 1) * d];
                                let dot: f64 =
                                    qh.iter().zip(k).map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32())).sum();
                                f64::from(w[t * h + hh]) * (scale * dot).max(0.0)
                            })
                            .sum()
                    })
                    .collect()
            })
            .collect()
    }
}

/// Top-`k` of `logits` by (value descending, index ascending), `-1` padded to `k`.
fn sorted_topk(logits: &[f64], k: usize) -> Vec<i32> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mut r: Vec<i32> = order.into_iter().take(k).map(|c| c as i32).collect();
    r.resize(k, -1);
    r
}

/// Checks rows `< tokens_padded` against `want` and that the rest stayed poison.
fn check_rows(out: &[i32], want: &[Vec<i32>], k: usize, what: &str) {
    for (t, w) in want.iter().enumerate() {
        assert_eq!(&out[t * k..(t + 1) * k], &w[..], "{what}: token {t}");
    }
    assert!(out[want.len() * k..].iter().all(|&v| v == POISON), "{what}: rows past the padded count were written");
}

fn int_bf16(rng: &mut Rng, n: usize, lo: i64, hi: i64) -> Vec<bf16> {
    (0..n).map(|_| bf16::from_f32(rng.range(lo, hi) as f32)).collect()
}

/// Weights that are multiples of 0.5, so every product and sum stays exact in f32.
fn int_weights(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.range(-2, 4) as f32 * 0.5).collect()
}

/// One step over requests with contexts `ctx` and `new` tokens left each (decodes or chunks).
fn one_step(rng: &mut Rng, cfg: &CommonConfig, ctx: &[usize], new: &[usize], max_pad: usize) -> Batch {
    let lens: Vec<usize> = ctx.iter().zip(new).map(|(c, n)| c + n).collect();
    let mut reqs = requests(rng, cfg, &lens);
    for (r, &c) in reqs.iter_mut().zip(ctx) {
        r.done = c;
    }
    plan(rng, cfg, &mut reqs, 64, max_pad).expect("a step").batch
}

fn integer_logits_select_the_exact_top_k_with_ties_to_the_lower_index(dev: &Device) {
    let mut rng = Rng(0x1D3);
    let (heads, dim, topk) = (4, 32, 8);
    let cfg = small_config(96, 6, 512, 16, 64);
    let rows = 64 * 4;
    let rig_k = int_bf16(&mut rng, rows * dim, -1, 1);
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, rig_k);
    let s = dev.create_stream().expect("stream");
    let mut ties_at_cut = 0;
    for i in 0..8 {
        let ctx: Vec<usize> = (0..4).map(|_| rng.range(0, 120) as usize).collect();
        let new: Vec<usize> = (0..4).map(|_| rng.range(1, 20) as usize).collect();
        let b = one_step(&mut rng, &cfg, &ctx, &new, 4);
        let t = b.tokens_padded;
        let q = int_bf16(&mut rng, t * heads * dim, -2, 2);
        let w = int_weights(&mut rng, t * heads);
        let got = rig.run(&s, &b, &q, &w, 0.5);
        let logits = rig.logits(&b, &q, &w, 0.5);
        let want: Vec<Vec<i32>> = logits.iter().map(|l| sorted_topk(l, topk)).collect();
        for (l, w) in logits.iter().zip(&want) {
            if l.len() > topk {
                let cut = l[w[topk - 1] as usize];
                ties_at_cut += usize::from(l.iter().filter(|&&v| v == cut).count() > 1);
            }
        }
        check_rows(&got, &want, topk, &format!("step {i}"));
        dev.write_sync(&rig.out, &vec![POISON; rig.out.len()]).expect("re-poison");
    }
    assert!(ties_at_cut > 0, "the inputs produced no tie at the top-k boundary");
}

fn short_rows_empty_rows_and_padding_get_minus_one(dev: &Device) {
    let mut rng = Rng(0x5EED);
    let (heads, dim, topk) = (2, 32, 16);
    let cfg = small_config(64, 4, 256, 16, 32);
    let kh = int_bf16(&mut rng, 32 * 4 * dim, -3, 3);
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, kh);
    let s = dev.create_stream().expect("stream");
    // A request starting at position 0 (n_t = 0 for positions 0..=2), one with n_t < topk, padding.
    let b = one_step(&mut rng, &cfg, &[0, 30, 9], &[7, 1, 1], 5);
    let t = b.tokens_padded;
    let q = int_bf16(&mut rng, t * heads * dim, -2, 2);
    let w = int_weights(&mut rng, t * heads);
    let got = rig.run(&s, &b, &q, &w, 0.25);
    let logits = rig.logits(&b, &q, &w, 0.25);
    assert!(logits.iter().any(|l| l.is_empty()) && logits.iter().any(|l| !l.is_empty() && l.len() < topk));
    let want: Vec<Vec<i32>> = logits.iter().map(|l| sorted_topk(l, topk)).collect();
    for (tok, w) in want.iter().enumerate() {
        if !token(&b, tok).0 {
            assert!(w.iter().all(|&v| v == -1), "padding row {tok}");
        }
    }
    check_rows(&got, &want, topk, "short rows");
}

fn equal_logits_keep_index_order(dev: &Device) {
    let mut rng = Rng(11);
    let (heads, dim, topk) = (3, 32, 12);
    let cfg = small_config(32, 2, 256, 16, 16);
    let row = int_bf16(&mut rng, dim, 1, 2);
    let kh: Vec<bf16> = (0..16 * 4).flat_map(|_| row.clone()).collect();
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, kh);
    let s = dev.create_stream().expect("stream");
    let b = one_step(&mut rng, &cfg, &[60, 20], &[3, 1], 2);
    let t = b.tokens_padded;
    let q = int_bf16(&mut rng, t * heads * dim, 0, 2);
    let w = vec![1.0f32; t * heads];
    let got = rig.run(&s, &b, &q, &w, 1.0);
    let want: Vec<Vec<i32>> = (0..t)
        .map(|tok| {
            let (valid, p, _) = token(&b, tok);
            let n = if valid { ((p + 1) / 4) as usize } else { 0 };
            (0..topk).map(|j| if j < n { j as i32 } else { -1 }).collect()
        })
        .collect();
    check_rows(&got, &want, topk, "equal logits");
}

fn long_rows_match_a_sorted_reference_exactly(dev: &Device) {
    let mut rng = Rng(0x10_0000);
    let (heads, dim, topk) = (2, 32, 300);
    let cfg = small_config(16, 2, 8192, 256, 64);
    let kh = int_bf16(&mut rng, 64 * 64 * dim, -3, 3);
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, kh);
    let s = dev.create_stream().expect("stream");
    // n_t around 1500 (more than the top-k: the GPU runs its radix search) and near 300.
    let b = one_step(&mut rng, &cfg, &[6000, 1190], &[2, 3], 1);
    let t = b.tokens_padded;
    let q = int_bf16(&mut rng, t * heads * dim, -3, 3);
    let w = int_weights(&mut rng, t * heads);
    let got = rig.run(&s, &b, &q, &w, 0.5);
    let logits = rig.logits(&b, &q, &w, 0.5);
    assert!(logits.iter().map(|l| l.len()).max().unwrap_or(0) > 1024);
    let want: Vec<Vec<i32>> = logits.iter().map(|l| sorted_topk(l, topk)).collect();
    check_rows(&got, &want, topk, "long rows");
    // Every fixed segment count selects the same entries through the whole indexer.
    for segs in 1..=holdfast_attention::indexer::TOPK_MAX_SEGMENTS {
        rig.idx = Indexer::new(dev, &cfg, heads, dim, topk)
            .and_then(|i| i.with_topk_segments(dev, segs))
            .expect("indexer with fixed segments");
        assert_eq!(rig.idx.topk_segments(t), segs);
        let again = rig.run(&s, &b, &q, &w, 0.5);
        assert_eq!(again, got, "{segs} segments");
    }
    for bad in [0, holdfast_attention::indexer::TOPK_MAX_SEGMENTS + 1] {
        let e = Indexer::new(dev, &cfg, heads, dim, topk).and_then(|i| i.with_topk_segments(dev, bad));
        assert!(matches!(e, Err(AttentionError::Config(_))), "{bad} segments");
    }
    // By default one segment; the device-filling count is about two blocks per multiprocessor.
    let auto = Indexer::new(dev, &cfg, heads, dim, topk).expect("indexer");
    let units = dev.info().compute_units.max(1) as usize;
    for rows in [1usize, 2, 3, 64, 1000] {
        assert_eq!(auto.topk_segments(rows), 1);
        assert_eq!(auto.auto_topk_segments(rows), (2 * units / rows).clamp(1, 4), "{rows} rows");
    }
}

fn real_valued_logits_select_a_valid_top_k(dev: &Device) {
    let mut rng = Rng(0xF10A7);
    let (heads, dim, topk) = (8, 64, 10);
    let cfg = small_config(64, 4, 512, 16, 48);
    let kh: Vec<bf16> = (0..48 * 4 * dim).map(|_| bf16::from_f32(uniform(&mut rng, -1.0, 1.0))).collect();
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, kh);
    let s = dev.create_stream().expect("stream");
    for i in 0..4 {
        let b = one_step(&mut rng, &cfg, &[150, 90, 7], &[12, 1, 20], 3);
        let t = b.tokens_padded;
        let q: Vec<bf16> = (0..t * heads * dim).map(|_| bf16::from_f32(uniform(&mut rng, -1.0, 1.0))).collect();
        let w: Vec<f32> = (0..t * heads).map(|_| uniform(&mut rng, -0.5, 1.0)).collect();
        let scale = (dim as f32).powf(-0.5);
        let got = rig.run(&s, &b, &q, &w, scale);
        let logits = rig.logits(&b, &q, &w, f64::from(scale));
        for (tok, l) in logits.iter().enumerate() {
            let row = &got[tok * topk..(tok + 1) * topk];
            let kept = l.len().min(topk);
            assert!(row[kept..].iter().all(|&v| v == -1), "step {i} token {tok}: tail {row:?}");
            let sel: Vec<usize> = row[..kept].iter().map(|&v| usize::try_from(v).expect("an entry")).collect();
            let mut uniq = sel.clone();
            uniq.sort_unstable();
            uniq.dedup();
            assert_eq!(uniq.len(), kept, "step {i} token {tok}: repeated entries {row:?}");
            let tol = 1e-4 * (1.0 + l.iter().fold(0f64, |m, v| m.max(v.abs())));
            for pair in sel.windows(2) {
                assert!(l[pair[0]] >= l[pair[1]] - tol, "step {i} token {tok}: order {row:?}");
            }
            let min_sel = sel.iter().map(|&c| l[c]).fold(f64::INFINITY, f64::min);
            let max_rest = (0..l.len()).filter(|c| !sel.contains(c)).map(|c| l[c]).fold(f64::NEG_INFINITY, f64::max);
            assert!(min_sel >= max_rest - tol, "step {i} token {tok}: {min_sel} selected below {max_rest}");
        }
        assert!(got[logits.len() * topk..].iter().all(|&v| v == POISON), "step {i}: rows past the padded count");
        dev.write_sync(&rig.out, &vec![POISON; rig.out.len()]).expect("re-poison");
    }
}

fn a_row_does_not_depend_on_the_rest_of_the_batch(dev: &Device) {
    let mut rng = Rng(0xBA7C4);
    let (heads, dim, topk) = (4, 64, 8);
    let cfg = small_config(64, 4, 512, 16, 48);
    let kh: Vec<bf16> = (0..48 * 4 * dim).map(|_| bf16::from_f32(uniform(&mut rng, -1.0, 1.0))).collect();
    let mut rig = Rig::new(dev, cfg, heads, dim, topk, kh);
    let s = dev.create_stream().expect("stream");
    // Request A alone (unpadded), then A behind a decode, with extra padding; same inputs for A.
    let mut reqs = requests(&mut rng, &cfg, &[100, 90]);
    reqs[0].done = 80;
    reqs[1].done = 89;
    let mut a = Batch {
        qsl: vec![0, 20],
        seq_lens: vec![100],
        positions: (80..100).collect(),
        slots: (80..100).map(|p| reqs[0].blocks[p / 16] * 16 + (p % 16) as i32).collect(),
        swa_bt: vec![0; cfg.swa_table.max_blocks_per_seq],
        kv_bt: reqs[0].blocks.clone(),
        table_rows: vec![],
        updates: Default::default(),
        reqs_padded: 1,
        tokens_padded: 20,
    };
    a.set_table_rows(&cfg, vec![0]);
    let qa: Vec<bf16> = (0..20 * heads * dim).map(|_| bf16::from_f32(uniform(&mut rng, -1.0, 1.0))).collect();
    let wa: Vec<f32> = (0..20 * heads).map(|_| uniform(&mut rng, -0.5, 1.0)).collect();
    let alone = rig.run(&s, &a, &qa, &wa, 0.125);
    let mut ab = a.clone();
    ab.qsl = vec![0, 1, 21];
    ab.seq_lens = vec![90, 100];
    ab.positions.insert(0, 89);
    ab.slots.insert(0, reqs[1].blocks[89 / 16] * 16 + 89 % 16);
    ab.swa_bt = vec![0; 2 * cfg.swa_table.max_blocks_per_seq];
    ab.kv_bt = [reqs[1].blocks.clone(), reqs[0].blocks.clone()].concat();
    // Request i keeps table row i: A stays on row 0 behind the other request's row 1.
    ab.set_table_rows(&cfg, vec![1, 0]);
    ab.reqs_padded = 3;
    ab.tokens_padded = 29;
    let mut qb: Vec<bf16> = (0..heads * dim).map(|_| bf16::from_f32(uniform(&mut rng, -1.0, 1.0))).collect();
    qb.extend_from_slice(&qa);
    qb.resize(29 * heads * dim, bf16::from_f32(0.5));
    let mut wb: Vec<f32> = (0..heads).map(|_| uniform(&mut rng, -0.5, 1.0)).collect();
    wb.extend_from_slice(&wa);
    wb.resize(29 * heads, 1.0);
    let batched = rig.run(&s, &ab, &qb, &wb, 0.125);
    assert_eq!(&batched[topk..21 * topk], &alone[..20 * topk], "request A's rows changed with the batch");
}

fn bad_configs_and_views_are_errors(dev: &Device) {
    let cfg = small_config(16, 2, 128, 16, 8);
    for (h, d) in [(0, 64), (4, 0), (64, 192)] {
        let e = Indexer::new(dev, &cfg, h, d, 8).expect_err("bad shape");
        assert!(matches!(e, AttentionError::Shape { op: "Indexer::new", .. }), "{e}");
    }
    for topk in [0, TOPK_MAX + 1] {
        let e = Indexer::new(dev, &cfg, 4, 64, topk).expect_err("topk out of range");
        assert!(matches!(e, AttentionError::Config(ref m) if m.contains("index_topk")), "{e}");
    }
    assert_eq!(Indexer::new(dev, &cfg, 4, 64, TOPK_MAX).expect("the largest top-k").topk(), TOPK_MAX);
    let mut odd = cfg;
    odd.kv_table.block_size = 18;
    assert!(matches!(Indexer::new(dev, &odd, 4, 64, 8), Err(AttentionError::Config(_))));

    let idx = Indexer::new(dev, &cfg, 4, 64, 8).expect("indexer");
    assert_eq!((idx.max_compressed(), idx.cache_rows(), idx.topk()), (32, 32, 8));
    let s = dev.create_stream().expect("stream");
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let q = dev.alloc_zeroed::<bf16>("t.q", 16 * 4 * 64, true).expect("q");
    let w = dev.alloc_zeroed::<f32>("t.w", 16 * 4, true).expect("w");
    let k = dev.alloc_zeroed::<bf16>("t.k", 32 * 64, true).expect("k");
    let out = dev.alloc_zeroed::<i32>("t.out", 16 * 8, true).expect("out");
    let e = idx.select(&s, &common, &q.view(), &w.view(), &k.view(), 1.0, &out.view()).expect_err("not staged");
    assert!(matches!(e, AttentionError::NotStaged), "{e}");
    let mut rng = Rng(4);
    let b = one_step(&mut rng, &cfg, &[10], &[6], 0);
    common.stage(&b.input()).expect("stage");
    common.upload(&s).expect("upload");
    let t = b.tokens_padded;
    let qs = q.prefix(t * 256 - 1).expect("q");
    let ws = w.prefix(t * 4 - 1).expect("w");
    let ks = k.prefix(32 * 64 - 1).expect("k");
    let os = out.prefix(t * 8 - 1).expect("out");
    let cases = [
        ("q", idx.select(&s, &common, &qs, &w.view(), &k.view(), 1.0, &out.view())),
        ("w", idx.select(&s, &common, &q.view(), &ws, &k.view(), 1.0, &out.view())),
        ("k_cache", idx.select(&s, &common, &q.view(), &w.view(), &ks, 1.0, &out.view())),
        ("out", idx.select(&s, &common, &q.view(), &w.view(), &k.view(), 1.0, &os)),
    ];
    for (name, r) in cases {
        let e = r.expect_err("short view");
        assert!(
            matches!(&e, AttentionError::Shape { op: "Indexer::select", detail } if detail.starts_with(name)),
            "{name}: {e}"
        );
    }
    let bigger = small_config(32, 2, 128, 16, 8);
    let common2 = CommonAttentionMetadata::new(dev, bigger).expect("common");
    let e = idx.select(&s, &common2, &q.view(), &w.view(), &k.view(), 1.0, &out.view()).expect_err("mismatch");
    assert!(matches!(e, AttentionError::Mismatch(_)), "{e}");
}

/// Every rejected indexer setting and common metadata of another size class: the variant, and a
/// message naming the setting (or the sizes that disagree) and what it must be.
fn every_rejected_indexer_setting_or_common_names_it(dev: &Device) {
    use holdfast_attention::indexer::TOPK_MAX_SEGMENTS;
    let cfg = small_config(16, 2, 128, 16, 8);
    let with = |f: &dyn Fn(&mut CommonConfig)| {
        let mut c = cfg;
        f(&mut c);
        c
    };
    let new = |c: &CommonConfig, heads, dim, topk| Indexer::new(dev, c, heads, dim, topk).map(|_| ());
    let shape: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "Indexer::new", .. });
    let config_error: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Config(_));
    let segments = |n| Indexer::new(dev, &cfg, 4, 64, 8).and_then(|i| i.with_topk_segments(dev, n)).map(|_| ());
    let s = dev.create_stream().expect("stream");
    let idx = Indexer::new(dev, &cfg, 4, 64, 8).expect("indexer");
    let select = |c: CommonConfig| {
        let common = CommonAttentionMetadata::new(dev, c).expect("common");
        let v = |n| dev.alloc_zeroed::<bf16>("t.bf16", n, true).expect("bf16");
        let (w, out) =
            (dev.alloc_zeroed::<f32>("t.w", 64, true).expect("w"), dev.alloc_zeroed::<i32>("t.o", 8, true).expect("o"));
        idx.select(&s, &common, &v(256).view(), &w.view(), &v(64).view(), 1.0, &out.view())
    };
    let mismatch: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Mismatch(_));
    let cases: Vec<ErrorCase> = vec![
        ("no heads", new(&cfg, 0, 64, 8), shape, words(&["heads 0 and head_dim 64 must be positive"])),
        ("no head_dim", new(&cfg, 4, 0, 8), shape, words(&["heads 4 and head_dim 0 must be positive"])),
        (
            "heads past shared memory",
            new(&cfg, 64, 192, 8),
            shape,
            words(&["64 heads × 192 (+ 64 weights + 4 K rows) exceed the 12288 floats"]),
        ),
        (
            // The K rows alone overflow usize: an error, not an arithmetic overflow.
            "head_dim past usize",
            new(&cfg, 1, usize::MAX / 2, 8),
            shape,
            vec![format!("1 heads × {} (+ 1 weights + 4 K rows) exceed", usize::MAX / 2)],
        ),
        ("top-k 0", new(&cfg, 4, 64, 0), config_error, vec![format!("index_topk 0 must lie in [1, {TOPK_MAX}]")]),
        (
            "top-k past the maximum",
            new(&cfg, 4, 64, TOPK_MAX + 1),
            config_error,
            vec![format!("index_topk {} must lie in [1, {TOPK_MAX}]", TOPK_MAX + 1)],
        ),
        (
            "block size not a multiple of 4",
            new(&with(&|c| c.kv_table.block_size = 18), 4, 64, 8),
            config_error,
            words(&["Indexer::new: KV block size 18 is not a multiple of 4"]),
        ),
        (
            "K cache past 32 bits",
            new(&with(&|c| c.kv_table.num_blocks = 1 << 30), 4, 64, 8),
            config_error,
            words(&["Indexer::new: the key cache (1073741824 blocks × 4 entries × head_dim 64)", "2^32"]),
        ),
        (
            "compressed width past i32",
            new(&with(&|c| c.max_model_len = 1 << 34), 4, 64, 8),
            config_error,
            words(&["Indexer::new: max_model_len 17179869184 gives", "past i32"]),
        ),
        (
            "workspace overflowing usize",
            new(
                &with(&|c| {
                    c.max_num_batched_tokens = 1 << 40;
                    c.max_model_len = (1 << 33) - 4;
                }),
                4,
                64,
                8,
            ),
            config_error,
            words(&["Indexer::new: workspace [1099511627776, 2147483647] overflows"]),
        ),
        (
            "no top-k segment",
            segments(0),
            config_error,
            vec![format!("0 segments; 1 to {TOPK_MAX_SEGMENTS} are supported")],
        ),
        (
            "too many top-k segments",
            segments(TOPK_MAX_SEGMENTS + 1),
            config_error,
            vec![format!("{} segments; 1 to {TOPK_MAX_SEGMENTS} are supported", TOPK_MAX_SEGMENTS + 1)],
        ),
        (
            "common metadata of more tokens",
            select(with(&|c| c.max_num_batched_tokens = 32)),
            mismatch,
            words(&[
                "Indexer::select: common metadata (32 tokens, max_model_len 128",
                "indexer (16 tokens, 32 compressed",
            ]),
        ),
        (
            "common metadata of longer sequences",
            select(with(&|c| c.max_model_len = 256)),
            mismatch,
            words(&["common metadata (16 tokens, max_model_len 256", "indexer (16 tokens, 32 compressed entries"]),
        ),
        (
            "common metadata of another KV table",
            select(with(&|c| c.kv_table.num_blocks = 9)),
            mismatch,
            words(&["num_blocks: 9", "does not fit the indexer", "num_blocks: 8"]),
        ),
    ];
    check_errors(cases);
}

/// Compressor (indexer K, ratio 4) + indexer + c4a build, captured once at a padded decode size
/// and replayed over fresh steps: each replay equals an eager run from the same state bit for bit.
fn compressor_indexer_and_c4a_build_replay_equals_eager(dev: &Device) {
    let mut rng = Rng(0x6EA9);
    let (heads, dim, rope, topk, rows) = (4, 64, 16, 6, 4);
    let cfg = small_config(32, 4, 512, 16, 40);
    let s = dev.create_stream().expect("stream");
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let comp = Compressor::new(dev, &cfg, 4, dim, rope, 10000.0, 1e-6).expect("compressor");
    let idx = Indexer::new(dev, &cfg, heads, dim, topk).expect("indexer");
    let c4a = C4aBuilder::new(dev, &cfg, topk).expect("c4a");
    let t_max = cfg.max_num_batched_tokens;
    let ape: Vec<f32> = (0..4 * dim).map(|_| uniform(&mut rng, -1.0, 1.0)).collect();
    let norm: Vec<bf16> = (0..dim).map(|_| bf16::from_f32(uniform(&mut rng, 0.5, 1.5))).collect();
    let ape = dev.alloc_from_slice("g.ape", &ape, true).expect("ape");
    let norm = dev.alloc_from_slice("g.norm", &norm, true).expect("norm");
    let state = dev.alloc_zeroed::<f32>("g.state", comp.state_len(), true).expect("state");
    let cache = dev.alloc_zeroed::<bf16>("g.cache", comp.cache_len(), true).expect("cache");
    let kv = dev.alloc_persistent::<f32>("g.kv", t_max * 2 * dim).expect("kv");
    let q = dev.alloc_persistent::<bf16>("g.q", t_max * heads * dim).expect("q");
    let w = dev.alloc_persistent::<f32>("g.w", t_max * heads).expect("w");
    let out = dev.alloc_from_slice("g.topk", &vec![-1; t_max * topk], true).expect("out");
    // Staging written between steps and copied from inside the captured step.
    let (kv_pin, q_pin, w_pin) = (
        RefCell::new(dev.alloc_pinned::<f32>(t_max * 2 * dim).expect("pinned")),
        RefCell::new(dev.alloc_pinned::<bf16>(t_max * heads * dim).expect("pinned")),
        RefCell::new(dev.alloc_pinned::<f32>(t_max * heads).expect("pinned")),
    );
    let (state_bak, cache_bak) = (
        dev.alloc::<f32>("g.state_bak", comp.state_len()).expect("bak"),
        dev.alloc::<bf16>("g.cache_bak", comp.cache_len()).expect("bak"),
    );
    let forward = |s: &Stream, common: &CommonAttentionMetadata| {
        common.upload(s).expect("upload");
        let kvv = kv.prefix(rows * 2 * dim).expect("kv");
        let (qv, wv, ov) = (
            q.prefix(rows * heads * dim).expect("q"),
            w.prefix(rows * heads).expect("w"),
            out.prefix(rows * topk).expect("out"),
        );
        s.copy_from_pinned(&kv_pin.borrow(), 0, &kvv).expect("kv");
        s.copy_from_pinned(&q_pin.borrow(), 0, &qv).expect("q");
        s.copy_from_pinned(&w_pin.borrow(), 0, &wv).expect("w");
        let wts = CompressorWeights { ape: &ape.view(), norm: &norm.view() };
        comp.run(s, common, &kvv, &wts, &state.view(), &cache.view()).expect("compress");
        idx.select(s, common, &qv, &wv, &cache.view(), 0.125, &ov).expect("select");
        c4a.build(s, common, &ov).expect("c4a").decode.expect("decode rows")
    };
    // Three requests: a prefill of their contexts (eager), then decode steps padded to `rows`.
    let mut reqs = requests(&mut rng, &cfg, &[200, 200, 200]);
    let ctx = [37usize, 50, 2];
    for (r, &c) in reqs.iter_mut().zip(&ctx) {
        r.len = c;
    }
    let stage_inputs = |rng: &mut Rng, tokens: usize| {
        let kvh: Vec<f32> = (0..tokens * 2 * dim).map(|_| uniform(rng, -1.0, 1.0)).collect();
        let qh: Vec<bf16> = (0..tokens * heads * dim).map(|_| bf16::from_f32(uniform(rng, -1.0, 1.0))).collect();
        let wh: Vec<f32> = (0..tokens * heads).map(|_| uniform(rng, 0.0, 1.0)).collect();
        kv_pin.borrow_mut().write(0, &kvh).expect("pin");
        q_pin.borrow_mut().write(0, &qh).expect("pin");
        w_pin.borrow_mut().write(0, &wh).expect("pin");
    };
    while let Some(step) = plan(&mut rng, &cfg, &mut reqs, 10, 0) {
        let l = common.stage(&step.batch.input()).expect("stage prefill");
        stage_inputs(&mut rng, l.num_tokens_padded);
        // A prefill step is not `rows` tokens; run its pieces eagerly with its own sizes.
        common.upload(&s).expect("upload");
        let t = l.num_tokens_padded;
        let kvv = kv.prefix(t * 2 * dim).expect("kv");
        s.copy_from_pinned(&kv_pin.borrow(), 0, &kvv).expect("kv");
        let wts = CompressorWeights { ape: &ape.view(), norm: &norm.view() };
        comp.run(&s, &common, &kvv, &wts, &state.view(), &cache.view()).expect("compress");
    }
    let decode_step = |rng: &mut Rng, common: &mut CommonAttentionMetadata, reqs: &mut Vec<Req>| {
        for r in reqs.iter_mut() {
            r.len = r.done + usize::from(rng.below(4) != 0);
        }
        if reqs.iter().all(|r| r.len == r.done) {
            reqs[0].len += 1;
        }
        let mut step = plan(rng, &cfg, reqs, 1, 0).expect("a decode step");
        step.batch.tokens_padded = rows;
        step.batch.reqs_padded = rows;
        let l = common.stage(&step.batch.input()).expect("stage decode");
        assert_eq!(l.num_decode_tokens, rows);
        stage_inputs(rng, rows);
    };
    decode_step(&mut rng, &mut common, &mut reqs);
    let views = forward(&s, &common); // warm-up; the views are the same at every step
    s.synchronize().expect("sync");
    let syncs = dev.stats().host_syncs;
    s.begin_capture("compressor + indexer + c4a").expect("begin");
    forward(&s, &common); // the same staged step again: the state writes are idempotent
    let graph = s.end_capture().expect("end capture");
    assert_eq!(dev.stats().host_syncs, syncs, "capture made no host sync");
    let read_all = |s: &Stream, r: &holdfast_attention::Ragged| {
        (
            s.copy_to_host_sync(&state.view()).expect("state"),
            s.copy_to_host_sync(&cache.view()).expect("cache").iter().map(|x| x.to_bits()).collect::<Vec<u16>>(),
            s.copy_to_host_sync(&out.view()).expect("out"),
            s.copy_to_host_sync(&r.indptr).expect("indptr"),
            s.copy_to_host_sync(&r.indices).expect("indices"),
        )
    };
    let mut selected = 0;
    for i in 0..16 {
        decode_step(&mut rng, &mut common, &mut reqs);
        s.copy(&state.view(), &state_bak.view()).expect("backup");
        s.copy(&cache.view(), &cache_bak.view()).expect("backup");
        graph.replay(&s).expect("replay");
        let replayed = read_all(&s, &views.ragged);
        s.copy(&state_bak.view(), &state.view()).expect("restore");
        s.copy(&cache_bak.view(), &cache.view()).expect("restore");
        c4a.fill_outputs(&s, POISON).expect("poison");
        dev.write_sync(&out, &vec![POISON; out.len()]).expect("poison");
        let eager = forward(&s, &common);
        let eager = read_all(&s, &eager.ragged);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&replayed.0), bits(&eager.0), "step {i}: state");
        assert_eq!(replayed.1, eager.1, "step {i}: compressed cache");
        assert_eq!(replayed.2[..rows * topk], eager.2[..rows * topk], "step {i}: top-k");
        let nnz = eager.3[rows] as usize;
        assert_eq!((&replayed.3, &replayed.4[..nnz]), (&eager.3, &eager.4[..nnz]), "step {i}: c4a ragged");
        selected += eager.3[rows];
    }
    assert!(selected > 0, "the replays selected no compressed entry");
    assert_eq!(graph.replays(), 16);
}

/// The top-k kernels alone over `scores [visible.len(), width]`: row `t` sees `visible[t]` entries
/// (`None`: a padding token), cut into `segs` segments (then merged when `segs > 1`). The output
/// buffer is poisoned, one row longer than the launch writes; returns the written rows after
/// checking that the extra row stayed poison.
fn run_topk(
    dev: &Device,
    s: &Stream,
    width: usize,
    k: usize,
    scores: &[f32],
    visible: &[Option<usize>],
    segs: usize,
) -> Vec<i32> {
    let t = visible.len();
    assert_eq!(scores.len(), t * width);
    let module = dev.compile(indexer_source()).expect("compile");
    let kernel = module.kernel("hf_dsv4_indexer_topk").expect("kernel");
    let merge = module.kernel("hf_dsv4_indexer_topk_merge").expect("merge kernel");
    // n_t = (pos + 1) / 4, so pos = 4 n + 2 gives n (and 0 for n = 0).
    let pos: Vec<i32> = visible.iter().map(|v| v.map_or(0, |n| 4 * n as i32 + 2)).collect();
    let slots: Vec<i32> = visible.iter().map(|v| if v.is_some() { 0 } else { -1 }).collect();
    let req: Vec<i32> = visible.iter().map(|v| if v.is_some() { 0 } else { -1 }).collect();
    let up = |l: &str, v: &[i32]| dev.alloc_from_slice(l, v, true).expect("upload");
    let (pos, slots, req) = (up("t.pos", &pos), up("t.slots", &slots), up("t.req", &req));
    let sc = dev.alloc_from_slice("t.scores", scores, true).expect("scores");
    let out = dev.alloc_from_slice("t.out", &vec![POISON; (t + 1) * k], true).expect("out");
    let seg_out = dev.alloc_from_slice("t.seg_out", &vec![POISON; t * segs * k], true).expect("seg_out");
    let outv = out.prefix(t * k).expect("out");
    let scalars = || -> [holdfast_hal::Arg; 4] {
        [(t as u32).into(), (width as u32).into(), (k as u32).into(), (segs as u32).into()]
    };
    let mut args = vec![
        (&sc.view()).into(),
        (&pos.view()).into(),
        (&slots.view()).into(),
        (&req.view()).into(),
        (&outv).into(),
        (&seg_out.view()).into(),
    ];
    args.extend(scalars());
    s.launch(&kernel, topk_launch_config(t * segs), &args).expect("launch");
    if segs > 1 {
        let mut margs = vec![
            (&sc.view()).into(),
            (&pos.view()).into(),
            (&slots.view()).into(),
            (&req.view()).into(),
            (&seg_out.view()).into(),
            (&outv).into(),
        ];
        margs.extend(scalars());
        s.launch(&merge, topk_launch_config(t), &margs).expect("merge");
    }
    let mut got = s.copy_to_host_sync(&out.view()).expect("read out");
    assert!(got[t * k..].iter().all(|&v| v == POISON), "the top-k wrote past its {t} rows");
    got.truncate(t * k);
    got
}

/// The definition of the top-k order on f32 logits: value descending with `−0 == +0` and every
/// NaN below every number, then index ascending; `-1` padded to `k`.
fn sorted_topk_f32(row: &[f32], k: usize) -> Vec<i32> {
    let rank = |a: f32, b: f32| match (a.is_nan(), b.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Less,
        (false, true) => std::cmp::Ordering::Greater,
        (false, false) => a.partial_cmp(&b).expect("numbers compare"),
    };
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| rank(row[b], row[a]).then(a.cmp(&b)));
    let mut r: Vec<i32> = order.into_iter().take(k).map(|c| c as i32).collect();
    r.resize(k, -1);
    r
}

/// Row value patterns for the top-k alone: mostly ties of every kind, plus distinct values that
/// crowd into one histogram bin (the search re-reads the row) and plain spread values.
/// "sampled spikes" puts the row's largest values exactly on the entries the kernel samples for
/// its gathering threshold, so the threshold passes too few entries and the search falls back;
/// "one outlier" puts one value far above a crowd, so the selected items share few bits and one
/// bin of the output ordering holds most of them (its merge-sort path).
const TIE_PATTERNS: [&str; 9] = [
    "one outlier",
    "all equal",
    "three values",
    "signed zeros",
    "nan and inf",
    "crowded ties",
    "crowded distinct",
    "spread",
    "sampled spikes",
];

fn pattern_row(rng: &mut Rng, pattern: &str, n: usize) -> Vec<f32> {
    let neg_nan = f32::from_bits(0xFFC0_0001);
    let mut sampled = vec![false; n];
    for j in 0..TOPK_SAMPLES {
        if let Some(s) = sampled.get_mut(j * n / TOPK_SAMPLES) {
            *s = true;
        }
    }
    (0..n)
        .map(|i| match pattern {
            "all equal" => 1.5,
            "three values" => [-1.0, 0.25, 3.0][rng.below(3) as usize],
            "signed zeros" => [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, 1.0, -1.0][rng.below(10) as usize],
            "nan and inf" => match rng.below(8) {
                0 => f32::NAN,
                1 => neg_nan,
                2 => f32::INFINITY,
                3 => f32::NEG_INFINITY,
                4 => -0.0,
                5 => 0.0,
                _ => uniform(rng, -2.0, 2.0),
            },
            // ~1300 distinct values of one quarter-octave: one first-level bin, many ties.
            "crowded ties" => 100.0 + uniform(rng, 0.0, 0.01),
            // Distinct consecutive floats of [1, 1.25), in a scrambled order.
            "crowded distinct" => f32::from_bits(1.0f32.to_bits() + ((i as u32).wrapping_mul(40_503) & 0x1_FFFF)),
            "one outlier" if i == n / 2 => 1000.0,
            "one outlier" => uniform(rng, 1.0, 1.001),
            "sampled spikes" if sampled[i] => uniform(rng, 10.0, 11.0),
            "sampled spikes" => uniform(rng, -1.0, 0.0),
            _ => uniform(rng, -4.0, 4.0),
        })
        .collect()
}

fn heavy_ties_nans_and_signed_zeros_give_the_sorted_order_bit_for_bit(dev: &Device) {
    let mut rng = Rng(0x70_9C);
    let s = dev.create_stream().expect("stream");
    // An odd width: rows start at every alignment of a 16-byte vector.
    let width = 70_001;
    for k in [1usize, 512, 1024] {
        let mut visible: Vec<Option<usize>> = [1, k - 1, k, k + 1, 5000, 70_000].map(Some).to_vec();
        visible.insert(3, None);
        for pattern in TIE_PATTERNS {
            let mut scores = Vec::with_capacity(visible.len() * width);
            for v in &visible {
                let n = v.unwrap_or(0);
                scores.extend(pattern_row(&mut rng, pattern, n));
                scores.extend(std::iter::repeat_n(f32::NAN, width - n)); // never visible
            }
            // One segment, and three uneven ones merged: the same exact order.
            for segs in [1, 3] {
                let got = run_topk(dev, &s, width, k, &scores, &visible, segs);
                for (t, v) in visible.iter().enumerate() {
                    let n = v.unwrap_or(0);
                    let want = sorted_topk_f32(&scores[t * width..t * width + n], k);
                    let what = format!("{pattern}, k {k}, {segs} segments, row {t} with {v:?} entries");
                    assert_eq!(&got[t * k..(t + 1) * k], &want[..], "{what}");
                }
            }
        }
    }
}

fn a_top_k_row_does_not_depend_on_the_rest_of_the_batch(dev: &Device) {
    let mut rng = Rng(0xB47C);
    let s = dev.create_stream().expect("stream");
    let (width, k) = (65_536, 1024);
    // Values on a 1/64 grid: ties all over the row, and at the cut.
    let a: Vec<f32> = (0..width).map(|_| (uniform(&mut rng, -8.0, 8.0) * 64.0).round() / 64.0).collect();
    let alone = run_topk(dev, &s, width, k, &a, &[Some(width)], 1);
    assert_eq!(alone, sorted_topk_f32(&a, k), "row A alone");
    for segs in [2, 4] {
        assert_eq!(run_topk(dev, &s, width, k, &a, &[Some(width)], segs), alone, "row A in {segs} segments");
    }
    let mut visible = Vec::new();
    let mut scores = Vec::new();
    for r in 0..9 {
        if r == 4 {
            visible.push(Some(width));
            scores.extend_from_slice(&a);
            continue;
        }
        let pattern = TIE_PATTERNS[rng.below(TIE_PATTERNS.len() as u64) as usize];
        visible.push(if r == 7 { None } else { Some(rng.below(width as u64 + 1) as usize) });
        scores.extend(pattern_row(&mut rng, pattern, width));
    }
    for segs in [1, 4] {
        let batched = run_topk(dev, &s, width, k, &scores, &visible, segs);
        assert_eq!(&batched[4 * k..5 * k], &alone[..], "row A changed with the batch ({segs} segments)");
    }
}

holdfast_hal::device_suite!(
    integer_logits_select_the_exact_top_k_with_ties_to_the_lower_index,
    short_rows_empty_rows_and_padding_get_minus_one,
    equal_logits_keep_index_order,
    long_rows_match_a_sorted_reference_exactly,
    real_valued_logits_select_a_valid_top_k,
    a_row_does_not_depend_on_the_rest_of_the_batch,
    bad_configs_and_views_are_errors,
    every_rejected_indexer_setting_or_common_names_it,
    compressor_indexer_and_c4a_build_replay_equals_eager,
    heavy_ties_nans_and_signed_zeros_give_the_sorted_order_bit_for_bit,
    a_top_k_row_does_not_depend_on_the_rest_of_the_batch
);

/// One top-k block per token up to the grid limit (then grid-stride), whatever the row lengths.
#[test]
fn the_top_k_launch_shape_follows_the_padded_token_count_only() {
    for (t, grid) in [(0, 1), (1, 1), (64, 64), (65_535, 65_535), (70_000, 65_535)] {
        let cfg = topk_launch_config(t);
        assert_eq!((cfg.grid, cfg.block, cfg.shared_mem_bytes), ((grid, 1, 1), (TOPK_THREADS, 1, 1), 0), "{t}");
    }
}

#[cfg(feature = "cuda")]
#[test]
fn indexer_kernels_compile_for_sm_90_with_nvrtc() {
    holdfast_hal::testing::assert_compiles_for_sm_90(holdfast_attention::indexer_source());
}

#[cfg(feature = "rocm")]
#[test]
fn indexer_kernels_compile_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_attention::indexer_source());
}

/// Both warp widths compile, and the top-k keeps its loaded vectors and digit state in registers
/// (no local memory in its PTX) and reads the row as 16-byte vectors.
#[cfg(feature = "cuda")]
#[test]
fn the_top_k_compiles_at_both_warp_widths_without_local_memory() {
    use holdfast_hal::cuda;
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    for warp in [32, 64] {
        let (cubin, ptx) = cuda::compile(indexer_source(), "sm_90", warp).expect("compiles");
        assert!(!cubin.is_empty(), "no CUBIN at warp {warp}");
        let ptx = String::from_utf8_lossy(&ptx);
        let entry = ptx.split(".entry ").find(|e| e.starts_with("hf_dsv4_indexer_topk(")).expect("the top-k entry");
        assert!(!entry.contains(".local"), "the top-k uses local memory at warp {warp}");
        assert!(entry.lines().any(|l| l.contains("ld.global") && l.contains(".v4.")), "no 16-byte row loads");
    }
}
