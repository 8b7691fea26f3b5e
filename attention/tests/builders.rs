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
/// earlier ones finish), and rows whose c4a look-back crosses many windows of a warp's width.
fn many_rows_are_built_past_what_the_device_holds_at_once(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0xB10C);
    // 16 blocks of 128 threads fill a multiprocessor's 2048 thread slots.
    let rows = 16 * dev.info().compute_units.max(1) as usize + 2048 + 173;
    let cfg = config(rows, rows, 2048, 0, 64, 256);
    let mut rig = Rig::new(dev, cfg, 128, 64);
    for _ in 0..2 {
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
