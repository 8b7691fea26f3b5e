//! Every builder against plain references written from spec §5, over random batches (mixes of
//! decode and prefill, windows, positions around multiples of 4 and 128, random block ids,
//! requests on random table rows of the persistent block tables, padding) with poisoned outputs;
//! host-input errors; zero host syncs. Written once against `&Device`; runs on `cpu` always and on
//! `cuda:0` when present.

mod common;

use common::*;
use holdfast_attention::{
    AttentionError, C128aBuilder, C4aBuilder, CommonAttentionMetadata, LayerKind, Ragged, StepLayout, SwaBuilder,
};
use holdfast_hal::{Device, Stream, View};

fn read(s: &Stream, v: &View<i32>) -> Vec<i32> {
    s.copy_to_host_sync(v).expect("read back")
}

/// Checks a ragged form row by row against `want` (exact entries and lengths).
fn check_ragged(s: &Stream, r: &Ragged, want: &[Vec<i32>], what: &str) {
    assert_eq!(r.rows, want.len(), "{what}: rows");
    assert_eq!(r.indices.len(), (r.rows * r.max_entries_per_row).max(1), "{what}: indices view depends on rows only");
    let indptr = read(s, &r.indptr);
    let flat = read(s, &r.indices);
    assert_eq!(indptr[0], 0, "{what}: indptr[0]");
    for (row, w) in want.iter().enumerate() {
        let (a, b) = (indptr[row] as usize, indptr[row + 1] as usize);
        assert_eq!(b - a, w.len(), "{what}: row {row} length");
        assert_eq!(&flat[a..b], &w[..], "{what}: row {row} entries");
    }
}

/// Checks a dense `[rows, width]` form and its lengths: exact prefix, -1 after.
fn check_dense(s: &Stream, dense: &View<i32>, lens: &View<i32>, want: &[Vec<i32>], width: usize, what: &str) {
    let (d, l) = (read(s, dense), read(s, lens));
    assert_eq!(d.len(), want.len() * width, "{what}: dense view");
    for (row, w) in want.iter().enumerate() {
        assert_eq!(l[row] as usize, w.len(), "{what}: row {row} len");
        let got = &d[row * width..(row + 1) * width];
        assert_eq!(&got[..w.len()], &w[..], "{what}: row {row} entries");
        assert!(got[w.len()..].iter().all(|&v| v == -1), "{what}: row {row} tail must be -1: {:?}", &got[w.len()..]);
    }
}

type Rig = BuilderRig;

impl BuilderRig {
    /// Stages, uploads and builds everything on poisoned outputs; checks each output against the
    /// references and that the build made no host sync.
    fn check(&mut self, dev: &Device, s: &Stream, b: &Batch, rng: &mut Rng) -> StepLayout {
        let cfg = *self.common.config();
        let window = self.swa.window();
        let (l, topk_h) = self.prepare(s, b, rng, "random batch");
        let syncs = dev.stats().host_syncs;
        let swa = self.swa.build(s, &self.common).expect("swa build");
        let c128a = self.c128a.build(s, &self.common).expect("c128a build");
        let c4a = self.c4a.build(s, &self.common, &self.topk.view()).expect("c4a build");
        assert_eq!(dev.stats().host_syncs, syncs, "builds never sync with the host");
        assert_eq!((swa.stats.host_syncs, c128a.stats.host_syncs, c4a.stats.host_syncs), (0, 0, 0));

        // Common metadata as padded on the device.
        let qsl = read(s, &self.common.query_start_loc().expect("qsl"));
        assert_eq!(&qsl[..b.qsl.len()], &b.qsl[..]);
        assert!(qsl[b.qsl.len()..].iter().all(|&v| v as usize == b.num_tokens()), "padded requests: query length 0");
        let seq = read(s, &self.common.seq_lens().expect("seq"));
        assert!(seq[b.num_reqs()..].iter().all(|&v| v == 0), "padded requests: seq len 0");
        let slots = read(s, &self.common.slot_mapping().expect("slots"));
        assert!(slots[b.num_tokens()..].iter().all(|&v| v == -1), "padded tokens: slot -1");

        let swa_want = swa_ref(b, &cfg, &l, window);
        match &swa.decode {
            Some(d) => {
                check_dense(s, &d.indices, &d.lens, &swa_want, window, "swa");
                check_ragged(s, &d.ragged, &swa_want, "swa ragged");
            }
            None => assert_eq!(l.num_decode_tokens, 0),
        }
        match &swa.prefill {
            Some(p) => assert_eq!(read(s, &p.gather_lens), gather_lens_ref(b, &l, window), "gather lens"),
            None => assert_eq!(l.num_prefills, 0),
        }
        let c128_want = c128a_decode_ref(b, &cfg, &l);
        let w = self.c128a.max_compressed();
        match &c128a.decode {
            Some(d) => {
                check_dense(s, &d.indices, &d.lens, &c128_want, w, "c128a");
                check_ragged(s, &d.ragged, &c128_want, "c128a ragged");
            }
            None => assert_eq!(l.num_decode_tokens, 0),
        }
        match &c128a.prefill_indices {
            Some(p) => {
                let got = read(s, p);
                for (row, n) in c128a_prefill_ref(b, &cfg, &l).into_iter().enumerate() {
                    let want: Vec<i32> = (0..w as i32).map(|j| if (j as usize) < n { j } else { -1 }).collect();
                    assert_eq!(&got[row * w..(row + 1) * w], &want[..], "c128a prefill row {row}");
                }
            }
            None => assert_eq!(l.num_prefill_tokens, 0),
        }
        let c4_want = c4a_ref(b, &cfg, &l, &topk_h, self.k);
        match &c4a.decode {
            Some(d) => {
                let lens = read(s, &d.lens);
                assert_eq!(lens, c4_want.iter().map(|r| r.len() as i32).collect::<Vec<_>>(), "c4a lens");
                check_ragged(s, &d.ragged, &c4_want, "c4a ragged");
            }
            None => assert_eq!(l.num_decode_tokens, 0),
        }
        l
    }
}

fn builders_match_the_reference_on_random_batches(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0x5eed_1234);
    for (window, spec, swa_bs, kv_bs, k) in [(128, 0, 64, 256, 16), (8, 1, 16, 128, 8), (4, 2, 16, 256, 130)] {
        let cfg = config(256, 16, 2048, spec, swa_bs, kv_bs);
        let mut rig = Rig::new(dev, cfg, window, k);
        for step in 0..12 {
            let (d, p) = (rng.below(7) as usize, if step % 3 == 0 { 0 } else { rng.below(3) as usize });
            let (pr, pt) = (rng.below(3) as usize, rng.below(4) as usize);
            let b = random_batch(&mut rng, &cfg, d, p, pr, pt);
            rig.check(dev, &s, &b, &mut rng);
        }
    }
}

fn uniform_padded_decode_rows_are_all_decode_rows_of_length_zero(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(77);
    let cfg = config(64, 16, 4096, 0, 64, 256);
    let mut rig = Rig::new(dev, cfg, 128, 32);
    let mut b = random_batch(&mut rng, &cfg, 5, 0, 0, 0);
    b.reqs_padded = 8;
    b.tokens_padded = 8;
    let l = rig.check(dev, &s, &b, &mut rng);
    assert_eq!((l.num_decodes, l.num_decode_tokens, l.num_prefills), (8, 8, 0), "fast path keeps padded counts");
    let swa = rig.swa.build(&s, &rig.common).expect("swa");
    let lens = read(&s, &swa.decode.expect("decode").lens);
    assert!(lens[5..].iter().all(|&v| v == 0), "padding rows length 0: {lens:?}");
}

fn bad_inputs_are_errors_before_any_kernel(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(3);
    let cfg = config(32, 4, 1024, 0, 64, 256);
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let swa = SwaBuilder::new(dev, &cfg, 128).expect("swa");
    assert!(matches!(swa.build(&s, &common), Err(AttentionError::NotStaged)));
    let good = random_batch(&mut rng, &cfg, 2, 1, 0, 0);
    let staged = common.stage(&good.input()).expect("good input");
    let field = |b: &Batch, common: &mut CommonAttentionMetadata| match common.stage(&b.input()) {
        Err(AttentionError::InvalidInput { field, .. }) => field,
        other => panic!("expected an invalid-input error, got {other:?}"),
    };
    let mut b = good.clone();
    b.positions[0] = -1;
    assert_eq!(field(&b, &mut common), "positions");
    let mut b = good.clone();
    b.positions[0] += 1;
    assert_eq!(field(&b, &mut common), "positions");
    let mut b = good.clone();
    b.swa_bt[0] = 4096;
    b.set_table_rows(&cfg, good.table_rows.clone());
    assert_eq!(field(&b, &mut common), "table_updates");
    let mut b = good.clone();
    b.kv_bt[0] = -3;
    b.set_table_rows(&cfg, good.table_rows.clone());
    assert_eq!(field(&b, &mut common), "table_updates");
    let mut b = good.clone();
    b.table_rows.pop();
    assert_eq!(field(&b, &mut common), "table_rows");
    let mut b = good.clone();
    b.seq_lens[0] = 2000;
    assert_eq!(field(&b, &mut common), "seq_lens");
    let mut b = good.clone();
    b.slots[0] = -2;
    assert_eq!(field(&b, &mut common), "slot_mapping");
    let mut b = good.clone();
    b.tokens_padded = 33;
    assert_eq!(field(&b, &mut common), "num_tokens");
    let mut b = good.clone();
    b.reqs_padded = 5;
    assert_eq!(field(&b, &mut common), "num_reqs");
    let mut b = good.clone();
    b.tokens_padded = 0;
    assert_eq!(field(&b, &mut common), "num_tokens_padded");
    let mut b = good.clone();
    b.qsl[1] = -1;
    assert_eq!(field(&b, &mut common), "query_start_loc");
    let many = random_batch(&mut rng, &cfg, 3, 0, 0, 0);
    let mut b = many.clone();
    b.qsl = vec![0, 1, 2, 3, 4, 5];
    assert!(matches!(common.stage(&b.input()), Err(AttentionError::InvalidInput { .. })), "5 requests > 4");
    // A decode after a prefill.
    let mut b = random_batch(&mut rng, &cfg, 0, 1, 0, 0);
    let extra = random_batch(&mut rng, &cfg, 1, 0, 0, 0);
    let n = b.num_tokens() as i32;
    b.qsl.push(n + 1);
    b.seq_lens.extend(&extra.seq_lens);
    b.positions.extend(&extra.positions);
    b.slots.extend(&extra.slots);
    b.swa_bt.extend(&extra.swa_bt);
    b.kv_bt.extend(&extra.kv_bt);
    b.set_table_rows(&cfg, vec![0, 1]);
    b.reqs_padded = 2;
    b.tokens_padded = b.num_tokens();
    assert_eq!(field(&b, &mut common), "query_start_loc");
    assert_eq!(common.layout().expect("still staged"), staged, "a rejected step changes nothing");
    // Configuration errors.
    assert!(matches!(LayerKind::from_compress_ratio(8), Err(AttentionError::UnsupportedCompressRatio(8))));
    assert!(matches!(SwaBuilder::new(dev, &cfg, 0), Err(AttentionError::Config(_))));
    let mut odd = cfg;
    odd.kv_table.block_size = 100;
    assert!(matches!(C128aBuilder::new(dev, &odd), Err(AttentionError::Config(_))));
    assert!(matches!(C4aBuilder::new(dev, &cfg, 0), Err(AttentionError::Config(_))));
}

/// Every per-step input check of [`CommonAttentionMetadata::stage`] (and the row release): an
/// `InvalidInput` naming the field, whose detail gives the offending request or token, its value
/// and the bound it breaks. The block-table and table-row checks are in `block_tables.rs`.
fn every_bad_step_input_names_the_field_and_the_bound(dev: &Device) {
    let mut rng = Rng(5);
    let cfg = config(32, 4, 1024, 0, 64, 256);
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let good = random_batch(&mut rng, &cfg, 2, 1, 0, 0);
    let staged = common.stage(&good.input()).expect("good input");
    let (nt, q2) = (good.num_tokens(), (good.qsl[3] - good.qsl[2]) as usize);
    assert!(q2 > 1 && nt == q2 + 2, "two decodes of one token, then one prefill");
    assert!(good.seq_lens[1] as usize >= nt, "request 1's context holds num_tokens query tokens");
    let mut stage = |f: &dyn Fn(&mut Batch)| {
        let mut b = good.clone();
        f(&mut b);
        common.stage(&b.input()).map(|_| ())
    };
    macro_rules! field {
        ($name:literal) => {
            |e: &AttentionError| matches!(e, AttentionError::InvalidInput { field: $name, .. })
        };
    }
    let cases: Vec<ErrorCase> = vec![
        (
            "no query_start_loc",
            stage(&|b| b.qsl.clear()),
            field!("query_start_loc"),
            words(&["`query_start_loc`", "num_reqs + 1 entries, got 0"]),
        ),
        (
            "more requests than max_num_seqs",
            stage(&|b| b.qsl = vec![0, 1, 2, 3, 4, 5]),
            field!("num_reqs"),
            words(&["5 requests (3 padded) exceed max_num_seqs 4"]),
        ),
        (
            "more padded requests than max_num_seqs",
            stage(&|b| b.reqs_padded = 5),
            field!("num_reqs"),
            words(&["3 requests (5 padded) exceed max_num_seqs 4"]),
        ),
        (
            "more padded tokens than max_num_batched_tokens",
            stage(&|b| b.tokens_padded = 33),
            field!("num_tokens"),
            vec![format!("{nt} tokens (33 padded) exceed max_num_batched_tokens 32")],
        ),
        (
            "padded tokens below the real ones",
            stage(&|b| b.tokens_padded = 1),
            field!("num_tokens_padded"),
            vec![format!("1 padded tokens, below the {nt} real ones")],
        ),
        (
            "padded requests below the real ones",
            stage(&|b| b.reqs_padded = 2),
            field!("num_reqs_padded"),
            words(&["2 padded requests, below the 3 real ones"]),
        ),
        (
            "seq_lens too short",
            stage(&|b| {
                b.seq_lens.pop();
            }),
            field!("seq_lens"),
            words(&["`seq_lens`", "holds 2 entries, expected 3"]),
        ),
        (
            "slot_mapping too long",
            stage(&|b| b.slots.push(0)),
            field!("slot_mapping"),
            vec![format!("holds {} entries, expected {nt}", nt + 1)],
        ),
        (
            "table_rows too short",
            stage(&|b| {
                b.table_rows.pop();
            }),
            field!("table_rows"),
            words(&["holds 2 entries, expected 3"]),
        ),
        (
            "query_start_loc not starting at 0",
            stage(&|b| b.qsl[0] = 1),
            field!("query_start_loc"),
            vec![format!("must run from 0 to num_tokens {nt}, runs from 1 to {nt}")],
        ),
        (
            "query_start_loc not ending at num_tokens",
            stage(&|b| b.qsl[3] -= 1),
            field!("query_start_loc"),
            vec![format!("must run from 0 to num_tokens {nt}, runs from 0 to {}", nt - 1)],
        ),
        (
            "query_start_loc decreasing",
            stage(&|b| b.qsl[1] = -1),
            field!("query_start_loc"),
            words(&["decreases at request 0 (0 → -1)"]),
        ),
        (
            // Request 1 runs past the last token (then the offsets come back down to num_tokens),
            // with a seq len and positions that fit its claimed tokens: refused, not read past the
            // end of the positions.
            "query_start_loc passing num_tokens",
            stage(&|b| {
                let (n, s1) = (b.positions.len() as i32, b.seq_lens[1]);
                b.qsl[2] = n + 1;
                for t in 1..n as usize {
                    b.positions[t] = s1 - n + t as i32 - 1;
                }
            }),
            field!("query_start_loc"),
            vec![format!("request 1 ends at token {}, past num_tokens {nt}", nt + 1)],
        ),
        (
            "negative seq len",
            stage(&|b| b.seq_lens[0] = -1),
            field!("seq_lens"),
            words(&["request 0: seq len -1 must lie in [query len 1, max_model_len 1024]"]),
        ),
        (
            "seq len below the query length",
            stage(&|b| b.seq_lens[2] = q2 as i32 - 1),
            field!("seq_lens"),
            vec![format!("request 2: seq len {} must lie in [query len {q2}, max_model_len 1024]", q2 - 1)],
        ),
        (
            "seq len past max_model_len",
            stage(&|b| b.seq_lens[1] = 1025),
            field!("seq_lens"),
            words(&["request 1: seq len 1025 must lie in [query len 1, max_model_len 1024]"]),
        ),
        (
            "negative position",
            stage(&|b| b.positions[1] = -1),
            field!("positions"),
            words(&["token 1: negative position -1"]),
        ),
        (
            "position off its request's context",
            stage(&|b| b.positions[nt - 1] += 1),
            field!("positions"),
            vec![format!(
                "token {} (request 2, query {}): position {}, seq lens imply {}",
                nt - 1,
                q2 - 1,
                good.positions[nt - 1] + 1,
                good.positions[nt - 1]
            )],
        ),
        (
            "slot below -1",
            stage(&|b| b.slots[2] = -2),
            field!("slot_mapping"),
            words(&["token 2: slot -2 (only -1 marks no slot)"]),
        ),
        (
            "decode after a prefill",
            stage(&|b| {
                // Requests: decode, prefill, then the second decode moved last.
                let q = |b: &Batch, r: usize| b.qsl[r + 1] - b.qsl[r];
                let (q0, q1) = (q(b, 0), q(b, 1));
                b.qsl = vec![0, q0, q0 + q2 as i32, q0 + q2 as i32 + q1];
                b.seq_lens.swap(1, 2);
                b.table_rows.swap(1, 2);
                let tail: Vec<i32> = b.positions.drain(2..).collect();
                let decode = b.positions.pop().expect("decode token");
                b.positions.extend(tail);
                b.positions.push(decode);
                let tail: Vec<i32> = b.slots.drain(2..).collect();
                let slot = b.slots.pop().expect("decode slot");
                b.slots.extend(tail);
                b.slots.push(slot);
            }),
            field!("query_start_loc"),
            words(&["request 2 is a decode after the first prefill 1: decodes must come first"]),
        ),
        (
            "release of the null row",
            common.release_table_row(4),
            field!("release_table_row"),
            words(&["row 4 outside [0, max_num_seqs 4)"]),
        ),
    ];
    check_errors(cases);
    assert_eq!(common.layout().expect("still staged"), staged, "a rejected step changes nothing");
}

/// Every rejected builder setting, common metadata of another size class, and short top-k input:
/// the variant, and a message naming the setting or argument and what it must be.
fn every_rejected_builder_config_or_common_names_it(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(8);
    let cfg = config(32, 4, 1024, 0, 64, 256);
    let with = |f: &dyn Fn(&mut holdfast_attention::CommonConfig)| {
        let mut c = cfg;
        f(&mut c);
        c
    };
    let (fewer_tokens, fewer_seqs, longer) = (
        with(&|c| c.max_num_batched_tokens = 16),
        with(&|c| c.max_num_seqs = 2),
        with(&|c| c.max_model_len = 129 * 128),
    );
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let c128a = C128aBuilder::new(dev, &cfg).expect("c128a");
    let c4a = C4aBuilder::new(dev, &cfg, 8).expect("c4a");
    let topk = dev.alloc_zeroed::<i32>("t.topk", 32 * 8, true).expect("topk");
    let c128a_unstaged = c128a.build(&s, &common).map(|_| ());
    let c4a_unstaged = c4a.build(&s, &common, &topk.view()).map(|_| ());
    let l = common.stage(&random_batch(&mut rng, &cfg, 3, 0, 1, 1).input()).expect("stage");
    assert_eq!(l.num_decode_tokens, 4);
    let short_topk = topk.prefix(4 * 8 - 1).expect("prefix");
    let config_error: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Config(_));
    let mismatch: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Mismatch(_));
    let big = i32::MAX as usize + 1;
    let cases: Vec<ErrorCase> = vec![
        (
            "compress ratio 8",
            LayerKind::from_compress_ratio(8).map(|_| ()),
            |e| matches!(e, AttentionError::UnsupportedCompressRatio(8)),
            words(&["compress ratio 8", "0/1 (SWA only), 4 (c4a) or 128 (c128a)"]),
        ),
        (
            "c128a grid cap 0",
            C128aBuilder::new(dev, &cfg).and_then(|b| b.with_grid_cap(Some(0))).map(|_| ()),
            config_error,
            words(&["c128a grid cap of 0 blocks per compute unit", "at least 1"]),
        ),
        (
            "SWA window 0",
            SwaBuilder::new(dev, &cfg, 0).map(|_| ()),
            config_error,
            words(&["SWA window 0 must lie in [1, i32::MAX]"]),
        ),
        (
            "SWA window past i32",
            SwaBuilder::new(dev, &cfg, big).map(|_| ()),
            config_error,
            words(&["SWA window 2147483648 must lie in [1, i32::MAX]"]),
        ),
        (
            "SWA lists past 32-bit offsets",
            SwaBuilder::new(dev, &cfg, 1 << 27).map(|_| ()),
            config_error,
            words(&["attn.swa.ragged: 32 × 134217728 ragged entries overflow the 32-bit offsets"]),
        ),
        (
            "c128a block size",
            C128aBuilder::new(dev, &with(&|c| c.kv_table.block_size = 100)).map(|_| ()),
            config_error,
            words(&["KV block size 100 is not a multiple of 128"]),
        ),
        (
            "c128a lists past 32-bit offsets",
            C128aBuilder::new(dev, &with(&|c| c.max_model_len = 1 << 40)).map(|_| ()),
            config_error,
            words(&["attn.c128a.ragged: 32 × 8589934592 ragged entries overflow the 32-bit offsets"]),
        ),
        (
            "c4a block size",
            C4aBuilder::new(dev, &with(&|c| c.kv_table.block_size = 102), 8).map(|_| ()),
            config_error,
            words(&["KV block size 102 is not a multiple of 4"]),
        ),
        (
            "c4a top-k 0",
            C4aBuilder::new(dev, &cfg, 0).map(|_| ()),
            config_error,
            words(&["index_topk must be positive"]),
        ),
        (
            "c4a entries past what a build counts",
            C4aBuilder::new(dev, &cfg, 1 << 25).map(|_| ()),
            config_error,
            words(&["max_num_batched_tokens 32 × index_topk 33554432 exceeds the 1073741823 entries"]),
        ),
        (
            "ragged capacity overflowing usize",
            holdfast_attention::ragged_capacity("the lists", 2, usize::MAX).map(|_| ()),
            config_error,
            vec![format!("the lists: 2 × {} ragged entries overflow the 32-bit offsets", usize::MAX)],
        ),
        (
            "ragged capacity past i32",
            holdfast_attention::ragged_capacity("the lists", 1, big).map(|_| ()),
            config_error,
            words(&["the lists: 1 × 2147483648 ragged entries overflow the 32-bit offsets"]),
        ),
        (
            "SWA builder for fewer tokens",
            SwaBuilder::new(dev, &fewer_tokens, 128).and_then(|b| b.build(&s, &common)).map(|_| ()),
            mismatch,
            words(&["common metadata sized for 32 tokens / 4 requests, SWA builder for 16 / 4"]),
        ),
        (
            "SWA builder for fewer requests",
            SwaBuilder::new(dev, &fewer_seqs, 128).and_then(|b| b.build(&s, &common)).map(|_| ()),
            mismatch,
            words(&["common metadata sized for 32 tokens / 4 requests, SWA builder for 32 / 2"]),
        ),
        (
            "c128a builder for fewer tokens",
            C128aBuilder::new(dev, &fewer_tokens).and_then(|b| b.build(&s, &common)).map(|_| ()),
            mismatch,
            words(&["common metadata sized for 32 tokens / width 128, c128a builder for 16 / 128"]),
        ),
        (
            "c128a builder of wider rows",
            C128aBuilder::new(dev, &longer).and_then(|b| b.build(&s, &common)).map(|_| ()),
            mismatch,
            words(&["common metadata sized for 32 tokens / width 128, c128a builder for 32 / 256"]),
        ),
        (
            "c4a builder for fewer tokens",
            C4aBuilder::new(dev, &fewer_tokens, 8).and_then(|b| b.build(&s, &common, &topk.view())).map(|_| ()),
            mismatch,
            words(&["common metadata sized for 32 tokens, c4a builder for 16"]),
        ),
        (
            "c4a top-k indices short of the decode rows",
            c4a.build(&s, &common, &short_topk).map(|_| ()),
            mismatch,
            words(&["top-k indices hold 31 entries, [4, 8] needs 32"]),
        ),
        ("c128a build before staging", c128a_unstaged, |e| matches!(e, AttentionError::NotStaged), words(&["stage"])),
        ("c4a build before staging", c4a_unstaged, |e| matches!(e, AttentionError::NotStaged), words(&["stage"])),
    ];
    check_errors(cases);
}

fn views_depend_only_on_the_padded_row_count(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(99);
    let cfg = config(64, 16, 4096, 0, 64, 256);
    let mut rig = Rig::new(dev, cfg, 128, 32);
    let mut seen: Option<Vec<(u64, usize)>> = None;
    for real in [1usize, 8, 3, 6] {
        let mut b = random_batch(&mut rng, &cfg, real, 0, 0, 0);
        b.reqs_padded = 8;
        b.tokens_padded = 8;
        rig.check(dev, &s, &b, &mut rng);
        let swa = rig.swa.build(&s, &rig.common).expect("swa").decode.expect("decode");
        let c128 = rig.c128a.build(&s, &rig.common).expect("c128a").decode.expect("decode");
        let c4 = rig.c4a.build(&s, &rig.common, &rig.topk.view()).expect("c4a").decode.expect("decode");
        let views: Vec<(u64, usize)> = [
            &swa.indices,
            &swa.lens,
            &swa.ragged.indptr,
            &swa.ragged.indices,
            &c128.indices,
            &c128.ragged.indptr,
            &c128.ragged.indices,
            &c4.lens,
            &c4.ragged.indptr,
            &c4.ragged.indices,
        ]
        .iter()
        .map(|v| (v.addr(), v.len()))
        .collect();
        match &seen {
            Some(first) => assert_eq!(&views, first, "{real} real rows: same addresses and lengths"),
            None => seen = Some(views),
        }
    }
}

/// Many decode rows: more blocks than the device holds at once (later rows' blocks start as
/// earlier ones finish), rows whose c4a look-back crosses many windows of a warp's width, and
/// more than two rows per multiprocessor (the c128a build stores its -1 tails in its passes, where
/// the small batches above store them first). Then the c128a build with its grid capped at 1 and
/// at 3 blocks per compute unit, so that each block builds many rows in turn.
fn many_rows_are_built_past_what_the_device_holds_at_once(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0xB10C);
    // 16 blocks of 128 threads fill a multiprocessor's 2048 thread slots.
    let rows = 16 * dev.info().compute_units.max(1) as usize + 2048 + 173;
    let cfg = config(rows, rows, 2048, 0, 64, 256);
    let mut rig = Rig::new(dev, cfg, 128, 64);
    for cap in [None, None, Some(1), Some(holdfast_attention::C128A_SHARED_BLOCKS_PER_UNIT)] {
        rig.c128a = C128aBuilder::new(dev, &cfg).and_then(|b| b.with_grid_cap(cap)).expect("c128a");
        assert_eq!(rig.c128a.grid_cap(), cap);
        let b = random_batch(&mut rng, &cfg, rows, 0, 0, 0);
        let l = rig.check(dev, &s, &b, &mut rng);
        assert_eq!(l.num_decode_tokens, rows);
    }
}

fn long_c128a_rows_past_the_shared_table_stage_read_the_table_directly(dev: &Device) {
    // KV blocks of 128 tokens: one compressed entry per block, so a row at a 1M-token context
    // reads up to 8192 table entries, more than the 4096 the kernel stages in shared memory.
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0x10C6);
    let cfg = config(16, 16, 1 << 20, 0, 64, 128);
    let mut rig = Rig::new(dev, cfg, 128, 64);
    for _ in 0..2 {
        let b = random_batch(&mut rng, &cfg, 16, 0, 0, 0);
        let long = b.positions.iter().filter(|&&p| (p as usize + 1) / 128 > 4096).count();
        assert!(long > 0 && long < 16, "rows on both paths ({long} long)");
        rig.check(dev, &s, &b, &mut rng);
    }
}

holdfast_hal::device_suite!(
    long_c128a_rows_past_the_shared_table_stage_read_the_table_directly,
    builders_match_the_reference_on_random_batches,
    uniform_padded_decode_rows_are_all_decode_rows_of_length_zero,
    bad_inputs_are_errors_before_any_kernel,
    every_bad_step_input_names_the_field_and_the_bound,
    every_rejected_builder_config_or_common_names_it,
    views_depend_only_on_the_padded_row_count,
    many_rows_are_built_past_what_the_device_holds_at_once,
);

#[test]
fn layer_kinds_follow_the_compress_ratio() {
    assert_eq!(LayerKind::from_compress_ratio(0).expect("0"), LayerKind::SwaOnly);
    assert_eq!(LayerKind::from_compress_ratio(1).expect("1"), LayerKind::SwaOnly);
    assert_eq!(LayerKind::from_compress_ratio(4).expect("4"), LayerKind::C4a);
    assert_eq!(LayerKind::from_compress_ratio(128).expect("128"), LayerKind::C128a);
    for r in [2, 3, 5, 64, 127, 129, 256] {
        assert!(LayerKind::from_compress_ratio(r).is_err(), "ratio {r}");
    }
    assert_eq!(holdfast_attention::c128a_max_compressed(1 << 20), 8192);
    assert_eq!(holdfast_attention::c128a_max_compressed(17 * 128), 128);
    assert_eq!(holdfast_attention::c128a_max_compressed(129 * 128 + 1), 256);
    assert_eq!(SwaBuilder::CG_SUPPORT, holdfast_graph::CgSupport::UniformBatch);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        #[test]
        fn every_entry_and_length_matches_the_reference(
            seed in 1u64..u64::MAX,
            window in prop::sample::select(vec![1usize, 4, 7, 64, 128]),
            spec in 0usize..3,
            swa_bs in prop::sample::select(vec![16usize, 64]),
            kv_bs in prop::sample::select(vec![128usize, 256, 512]),
            k in prop::sample::select(vec![1usize, 5, 64, 200]),
            decodes in 0usize..8,
            prefills in 0usize..3,
            pad_reqs in 0usize..4,
            pad_tokens in 0usize..6,
        ) {
            let dev = Device::cpu().expect("cpu");
            let s = dev.create_stream().expect("stream");
            let cfg = config(200, 16, 3000, spec, swa_bs, kv_bs);
            let mut rig = Rig::new(&dev, cfg, window, k);
            let mut rng = Rng(seed);
            let b = random_batch(&mut rng, &cfg, decodes, prefills, pad_reqs, pad_tokens);
            rig.check(&dev, &s, &b, &mut rng);
        }
    }
}
