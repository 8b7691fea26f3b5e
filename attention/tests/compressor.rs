//! The KV compressor against its f64 definition over multi-step schedules (windows that span
//! steps, chunked prefill completing several windows at once, decodes, padding rows, requests
//! with different block tables), with poisoned caches whose untouched slots must stay poison;
//! and its input validation. Runs on `cpu` always and on `cuda:0` when present.

mod common;

use std::collections::HashMap;

use common::sched::*;
use common::{check_errors, words, ErrorCase, Rng};
use holdfast_attention::{
    AttentionError, CommonAttentionMetadata, CommonConfig, Compressor, CompressorWeights, StepLayout,
};
use holdfast_hal::{bf16, Buffer, Device, Stream};

const STATE_POISON: u32 = 0x7B7B_7B7B;
const CACHE_POISON: u16 = 0x7B7B;

struct Rig {
    cfg: CommonConfig,
    common: CommonAttentionMetadata,
    comp: Compressor,
    ape: Vec<f32>,
    norm: Vec<bf16>,
    ape_d: Buffer<f32>,
    norm_d: Buffer<bf16>,
    state: Buffer<f32>,
    cache: Buffer<bf16>,
    kv: Buffer<f32>,
    ratio: usize,
    dim: usize,
    rope: usize,
    theta: f32,
    eps: f32,
}

impl Rig {
    #[allow(clippy::too_many_arguments)]
    fn new(dev: &Device, rng: &mut Rng, cfg: CommonConfig, ratio: usize, dim: usize, rope: usize, theta: f32) -> Rig {
        let eps = 1e-6;
        let comp = Compressor::new(dev, &cfg, ratio, dim, rope, theta, eps).expect("compressor");
        let ape: Vec<f32> = (0..ratio * dim).map(|_| uniform(rng, -1.0, 1.0)).collect();
        let norm: Vec<bf16> = (0..dim).map(|_| bf16::from_f32(uniform(rng, 0.5, 1.5))).collect();
        let state = dev
            .alloc_from_slice("test.state", &vec![f32::from_bits(STATE_POISON); comp.state_len()], true)
            .expect("state");
        let cache = dev
            .alloc_from_slice("test.cache", &vec![bf16::from_bits(CACHE_POISON); comp.cache_len()], true)
            .expect("cache");
        Rig {
            common: CommonAttentionMetadata::new(dev, cfg).expect("common"),
            ape_d: dev.alloc_from_slice("test.ape", &ape, true).expect("ape"),
            norm_d: dev.alloc_from_slice("test.norm", &norm, true).expect("norm"),
            kv: dev.alloc_persistent("test.kv_score", cfg.max_num_batched_tokens * 2 * dim).expect("kv"),
            comp,
            ape,
            norm,
            state,
            cache,
            cfg,
            ratio,
            dim,
            rope,
            theta,
            eps,
        }
    }

    fn run(&mut self, s: &Stream, b: &common::Batch, kv: &[f32]) -> StepLayout {
        let l = self.common.stage(&b.input()).expect("stage");
        self.common.upload(s).expect("upload");
        let view = self.kv.prefix(l.num_tokens_padded * 2 * self.dim).expect("kv view");
        s.copy_from_host(kv, &view).expect("kv upload");
        let w = CompressorWeights { ape: &self.ape_d.view(), norm: &self.norm_d.view() };
        let stats = self
            .comp
            .run_with_stats(s, &self.common, &view, &w, &self.state.view(), &self.cache.view())
            .expect("compressor run");
        assert_eq!((stats.launches, stats.host_syncs), (2, 0));
        l
    }
}

/// Drives a schedule over `lens` and checks state and cache against the definition after every step.
fn drive(dev: &Device, rig: &mut Rig, rng: &mut Rng, lens: &[usize], max_chunk: usize) -> Coverage {
    let s = dev.create_stream().expect("stream");
    let (dim, ratio) = (rig.dim, rig.ratio);
    let mut reqs = requests(rng, &rig.cfg, lens);
    // Host mirror: every token's row by request and position; expected state rows and cache entries by slot.
    let mut history: Vec<Vec<Vec<f32>>> = lens.iter().map(|_| Vec::new()).collect();
    let mut want_state: HashMap<usize, Vec<f32>> = HashMap::new();
    let mut want_cache: HashMap<usize, Vec<f64>> = HashMap::new();
    let (mut steps, mut multi_window_chunks, mut spanning) = (0, 0, 0);
    let bs = rig.cfg.kv_table.block_size;
    let cbs = bs / ratio;
    while let Some(step) = plan(rng, &rig.cfg, &mut reqs, max_chunk, 3) {
        let b = &step.batch;
        let tp = b.tokens_padded;
        let kv: Vec<f32> = (0..tp * 2 * dim)
            .map(|i| if i % (2 * dim) < dim { uniform(rng, -1.0, 1.0) } else { uniform(rng, -2.0, 2.0) })
            .collect();
        let mut windows_in_req: HashMap<usize, usize> = HashMap::new();
        for (t, &r) in step.token_req.iter().enumerate() {
            let p = b.positions[t] as usize;
            let row = kv[t * 2 * dim..(t + 1) * 2 * dim].to_vec();
            assert_eq!(history[r].len(), p);
            history[r].push(row.clone());
            want_state.insert(b.slots[t] as usize, row);
            if (p + 1).is_multiple_of(ratio) {
                let start = p + 1 - ratio;
                let rows: Vec<&[f32]> = history[r][start..=p].iter().map(|v| v.as_slice()).collect();
                let norm: Vec<f32> = rig.norm.iter().map(|x| x.to_f32()).collect();
                let e = compress_ref(
                    &rows,
                    &rig.ape,
                    &norm,
                    dim,
                    rig.rope,
                    f64::from(rig.theta),
                    f64::from(rig.eps),
                    start as f64,
                );
                let i = (p + 1) / ratio - 1;
                let slot = reqs[r].blocks[i / cbs] as usize * cbs + i % cbs;
                assert!(want_cache.insert(slot, e).is_none(), "slot {slot} written twice");
                *windows_in_req.entry(r).or_default() += 1;
                // A window whose first token was computed in an earlier step.
                if start < b.positions[b.qsl[step_req_index(b, t)] as usize] as usize {
                    spanning += 1;
                }
            }
        }
        multi_window_chunks += windows_in_req.values().filter(|&&n| n >= 2).count();
        rig.run(&s, b, &kv);
        check(&s, rig, &want_state, &want_cache, steps);
        steps += 1;
    }
    Coverage { steps, spanning, multi_window_chunks }
}

/// What a schedule exercised.
struct Coverage {
    steps: usize,
    /// Windows completed in a later step than their first token.
    spanning: usize,
    /// Prefill chunks that completed at least two windows.
    multi_window_chunks: usize,
}

/// The request row (in the batch) of token `t`.
fn step_req_index(b: &common::Batch, t: usize) -> usize {
    (0..b.qsl.len() - 1).find(|&r| (b.qsl[r] as usize..b.qsl[r + 1] as usize).contains(&t)).expect("token's request")
}

fn check(
    s: &Stream,
    rig: &Rig,
    want_state: &HashMap<usize, Vec<f32>>,
    want_cache: &HashMap<usize, Vec<f64>>,
    step: usize,
) {
    let dim = rig.dim;
    let state = s.copy_to_host_sync(&rig.state.view()).expect("read state");
    for (row, got) in state.chunks(2 * dim).enumerate() {
        match want_state.get(&row) {
            Some(w) => assert!(
                got.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step}: state row {row} is not the token's projection"
            ),
            None => {
                assert!(got.iter().all(|v| v.to_bits() == STATE_POISON), "step {step}: state row {row} was touched")
            }
        }
    }
    let cache = s.copy_to_host_sync(&rig.cache.view()).expect("read cache");
    for (row, got) in cache.chunks(dim).enumerate() {
        match want_cache.get(&row) {
            Some(w) => {
                let g: Vec<f64> = got.iter().map(|x| f64::from(x.to_f32())).collect();
                assert!(g.iter().all(|x| x.is_finite()), "step {step}: cache row {row} is not finite");
                let e = rel_l2(&g, w);
                assert!(e <= 1e-2, "step {step}: cache row {row}: relative L2 {e}");
            }
            None => {
                assert!(got.iter().all(|v| v.to_bits() == CACHE_POISON), "step {step}: cache row {row} was touched")
            }
        }
    }
}

fn ratio4_multi_step_schedules_match_the_definition(dev: &Device) {
    let mut rng = Rng(0xA11CE);
    let cfg = small_config(48, 4, 256, 16, 40);
    let (mut spanning, mut multi) = (0, 0);
    for _ in 0..3 {
        let mut rig = Rig::new(dev, &mut rng, cfg, 4, 64, 16, 10000.0);
        let lens = [rng.range(20, 60) as usize, rng.range(5, 40) as usize, rng.range(1, 9) as usize];
        let c = drive(dev, &mut rig, &mut rng, &lens, 14);
        assert!(c.steps >= 2);
        (spanning, multi) = (spanning + c.spanning, multi + c.multi_window_chunks);
    }
    assert!(spanning > 0 && multi > 0, "coverage: {spanning} spanning windows, {multi} multi-window chunks");
}

fn ratio128_chunked_prefill_and_decodes_match_the_definition(dev: &Device) {
    let mut rng = Rng(0xBEEF);
    let cfg = small_config(200, 3, 1024, 256, 8);
    let mut rig = Rig::new(dev, &mut rng, cfg, 128, 64, 32, 160000.0);
    let c = drive(dev, &mut rig, &mut rng, &[300, 140], 180);
    assert!(c.spanning > 0, "a 128-token window spans steps");
}

fn full_rope_and_no_rope_entries_match(dev: &Device) {
    let mut rng = Rng(7);
    let cfg = small_config(32, 2, 128, 16, 12);
    for rope in [0, 32] {
        let mut rig = Rig::new(dev, &mut rng, cfg, 4, 32, rope, 10000.0);
        drive(dev, &mut rig, &mut rng, &[37, 21], 9);
    }
}

fn bad_configs_and_views_are_errors(dev: &Device) {
    let cfg = small_config(16, 2, 128, 16, 8);
    for (ratio, dim, rope) in [(3, 64, 16), (4, 0, 0), (4, 64, 15), (4, 64, 66), (1, 64, 0)] {
        let e = Compressor::new(dev, &cfg, ratio, dim, rope, 10000.0, 1e-6).expect_err("bad shape");
        assert!(matches!(e, AttentionError::Shape { op: "Compressor::new", .. }), "{e}");
    }
    let e = Compressor::new(dev, &cfg, 128, 64, 0, 10000.0, 1e-6).expect_err("block 16 is not a multiple of 128");
    assert!(matches!(e, AttentionError::Config(_)), "{e}");
    assert!(Compressor::new(dev, &cfg, 4, 64, 16, -1.0, 1e-6).is_err());

    let comp = Compressor::new(dev, &cfg, 4, 64, 16, 10000.0, 1e-6).expect("compressor");
    assert_eq!(comp.state_len(), 8 * 16 * 2 * 64);
    assert_eq!(comp.cache_len(), 8 * 4 * 64);
    let s = dev.create_stream().expect("stream");
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let f = |n| dev.alloc_zeroed::<f32>("t.f", n, true).expect("f32");
    let h = |n| dev.alloc_zeroed::<bf16>("t.h", n, true).expect("bf16");
    let (ape, norm, state, cache, kv) = (f(4 * 64), h(64), f(comp.state_len()), h(comp.cache_len()), f(16 * 128));
    let w = CompressorWeights { ape: &ape.view(), norm: &norm.view() };
    let e = comp.run(&s, &common, &kv.view(), &w, &state.view(), &cache.view()).expect_err("not staged");
    assert!(matches!(e, AttentionError::NotStaged), "{e}");
    let mut rng = Rng(3);
    let mut reqs = requests(&mut rng, &cfg, &[10]);
    let step = plan(&mut rng, &cfg, &mut reqs, 8, 0).expect("step");
    let l = common.stage(&step.batch.input()).expect("stage");
    common.upload(&s).expect("upload");
    let t = l.num_tokens_padded;
    let short = |b: &Buffer<f32>, n: usize| b.prefix(n).expect("prefix");
    let cases = [
        ("kv_score", short(&kv, t * 128 - 1), state.view(), cache.view()),
        ("state", kv.view(), short(&state, comp.state_len() - 1), cache.view()),
        ("cache", kv.view(), state.view(), cache.prefix(comp.cache_len() - 1).expect("prefix")),
    ];
    for (name, kvv, st, ca) in cases {
        let e = comp.run(&s, &common, &kvv, &w, &st, &ca).expect_err("short view");
        assert!(
            matches!(&e, AttentionError::Shape { op: "Compressor::run", detail } if detail.starts_with(name)),
            "{name}: {e}"
        );
    }
    let short_ape = ape.prefix(4 * 64 - 1).expect("prefix");
    let w2 = CompressorWeights { ape: &short_ape, norm: &norm.view() };
    assert!(comp.run(&s, &common, &kv.view(), &w2, &state.view(), &cache.view()).is_err());
    // Common metadata of another KV table.
    let other = small_config(16, 2, 128, 16, 9);
    let comp2 = Compressor::new(dev, &other, 4, 64, 16, 10000.0, 1e-6).expect("compressor");
    let e = comp2.run(&s, &common, &kv.view(), &w, &state.view(), &cache.view()).expect_err("mismatch");
    assert!(matches!(e, AttentionError::Mismatch(_)), "{e}");
}

/// Every rejected compressor setting and short weight view: the variant, and a message naming
/// the setting or view and what it must be.
fn every_rejected_compressor_setting_or_view_names_it(dev: &Device) {
    let cfg = small_config(16, 2, 128, 16, 8);
    let new =
        |cfg: &CommonConfig, ratio, dim, rope, theta, eps| Compressor::new(dev, cfg, ratio, dim, rope, theta, eps);
    let shape: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "Compressor::new", .. });
    let config_error: fn(&AttentionError) -> bool =
        |e| matches!(e, AttentionError::Config(m) if m.starts_with("Compressor::new"));
    let run_shape: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "Compressor::run", .. });
    let mut cases: Vec<ErrorCase> = vec![
        (
            "ratio 3",
            new(&cfg, 3, 64, 16, 1e4, 1e-6).map(|_| ()),
            shape,
            words(&["ratio 3 is not a DeepSeek-V4 compress ratio (4 or 128)"]),
        ),
        ("dim 0", new(&cfg, 4, 0, 0, 1e4, 1e-6).map(|_| ()), shape, words(&["dim 0 must lie in [1, 2^31)"])),
        (
            "dim 2^31",
            new(&cfg, 4, 1 << 31, 0, 1e4, 1e-6).map(|_| ()),
            shape,
            words(&["dim 2147483648 must lie in [1, 2^31)"]),
        ),
        (
            "odd rope_dim",
            new(&cfg, 4, 64, 15, 1e4, 1e-6).map(|_| ()),
            shape,
            words(&["rope_dim 15 must be even and at most dim 64"]),
        ),
        (
            "rope_dim past dim",
            new(&cfg, 4, 64, 66, 1e4, 1e-6).map(|_| ()),
            shape,
            words(&["rope_dim 66 must be even and at most dim 64"]),
        ),
        (
            "dim past shared memory",
            new(&cfg, 4, 12290, 0, 1e4, 1e-6).map(|_| ()),
            shape,
            words(&["dim 12290 exceeds the 12288 channels"]),
        ),
        (
            "negative rope_theta",
            new(&cfg, 4, 64, 16, -1.0, 1e-6).map(|_| ()),
            shape,
            words(&["rope_theta -1 must be positive"]),
        ),
        (
            "NaN rope_theta",
            new(&cfg, 4, 64, 16, f32::NAN, 1e-6).map(|_| ()),
            shape,
            words(&["rope_theta NaN must be positive"]),
        ),
        ("negative eps", new(&cfg, 4, 64, 16, 1e4, -1.0).map(|_| ()), shape, words(&["eps -1 non-negative"])),
        (
            "block size not a multiple of the ratio",
            new(&cfg, 128, 64, 0, 1e4, 1e-6).map(|_| ()),
            config_error,
            words(&["KV block size 16 is not a multiple of ratio 128"]),
        ),
        (
            "state rows past 32 bits",
            new(&small_config(16, 2, 128, 16, 1 << 30), 4, 64, 16, 1e4, 1e-6).map(|_| ()),
            config_error,
            words(&["1073741824 blocks × 16 tokens × 2·64 state floats overflow"]),
        ),
    ];
    let comp = new(&cfg, 4, 64, 16, 1e4, 1e-6).expect("compressor");
    let s = dev.create_stream().expect("stream");
    let mut common = CommonAttentionMetadata::new(dev, cfg).expect("common");
    let mut rng = Rng(3);
    let mut reqs = requests(&mut rng, &cfg, &[10]);
    let step = plan(&mut rng, &cfg, &mut reqs, 8, 0).expect("step");
    let t = common.stage(&step.batch.input()).expect("stage").num_tokens_padded;
    let f = |n| dev.alloc_zeroed::<f32>("t.f", n, true).expect("f32");
    let h = |n| dev.alloc_zeroed::<bf16>("t.h", n, true).expect("bf16");
    let (ape, norm, state, cache, kv) = (f(4 * 64), h(64), f(comp.state_len()), h(comp.cache_len()), f(t * 128));
    let (ape_v, norm_v) = (ape.view(), norm.view());
    let (short_ape, short_norm) = (ape.prefix(4 * 64 - 1).expect("ape"), norm.prefix(63).expect("norm"));
    let run = |ape, norm| {
        let w = CompressorWeights { ape, norm };
        comp.run(&s, &common, &kv.view(), &w, &state.view(), &cache.view())
    };
    cases.push((
        "short ape",
        run(&short_ape, &norm_v),
        run_shape,
        words(&["ape holds 255 elements, [ratio 4, 64] needs 256"]),
    ));
    cases.push(("short norm", run(&ape_v, &short_norm), run_shape, words(&["norm holds 63 elements, [64] needs 64"])));
    let other = new(&small_config(16, 2, 128, 16, 9), 4, 64, 16, 1e4, 1e-6).expect("compressor");
    let w = CompressorWeights { ape: &ape_v, norm: &norm_v };
    cases.push((
        "common metadata of another KV table",
        other.run(&s, &common, &kv.view(), &w, &state.view(), &cache.view()),
        |e| matches!(e, AttentionError::Mismatch(_)),
        words(&[
            "Compressor::run: common metadata's KV table",
            "num_blocks: 8",
            "compressor built for",
            "num_blocks: 9",
        ]),
    ));
    check_errors(cases);
}

holdfast_hal::device_suite!(
    ratio4_multi_step_schedules_match_the_definition,
    ratio128_chunked_prefill_and_decodes_match_the_definition,
    full_rope_and_no_rope_entries_match,
    every_rejected_compressor_setting_or_view_names_it,
    bad_configs_and_views_are_errors
);

#[cfg(feature = "cuda")]
#[test]
fn compressor_kernels_compile_for_sm_90_with_nvrtc() {
    holdfast_hal::testing::assert_compiles_for_sm_90(holdfast_attention::compressor_source());
}

#[cfg(feature = "rocm")]
#[test]
fn compressor_kernels_compile_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_attention::compressor_source());
}
