//! The mHC device suite: every test is written once against `&Device` and instantiated per backend
//! by `device_suite!` (always on `cpu`; on `cuda:0` with the `cuda` feature, printing a skip line
//! when no CUDA device is usable).
//!
//! Sizes: H ∈ {256, 4096, 7168} (plus 300, a hidden size that is not a multiple of 8, and 1000,
//! whose last split is partial), T ∈ {0, 1,
//! 3, 64, 1000}. On the CPU backend in an unoptimised build (the default `cargo test` profile) the
//! H = 7168 cases stop at T = 250 and the batch-invariance test uses H = 1024: the CPU kernels are
//! the reference itself, about 3·10⁶ fmas per token of `mhc_pre` at H = 7168 and 10-15 ns each
//! unoptimised, and the suite must stay well under two minutes on two cores (it takes about 30 s).
//! Optimised builds and GPU backends run every case.

mod common;

use common::{Rng, Weights, M, N};
use half::bf16;
use holdfast_hal::{BackendKind, Buffer, Device, Element, Stream, View};
use holdfast_mhc::reference::{self, PreOutput};
use holdfast_mhc::{
    HcHeadParams, HcHeadWeights, MhcConfig, MhcError, MhcKernels, MhcOp, MhcOps, MhcPasses, MhcPostInputs,
    MhcPreOutputs, MhcPreParams, MhcPreWeights, MhcProjection,
};

const HIDDEN: [usize; 3] = [256, 4096, 7168];
const BF16_TOL: f64 = 1e-2;
const F32_TOL: f64 = 1e-4;

fn token_cases(dev: &Device, hidden: usize) -> Vec<usize> {
    if hidden == 300 || hidden == 1000 {
        return vec![1, 3, 64];
    }
    if dev.backend() == BackendKind::Cpu && cfg!(debug_assertions) && hidden >= 7168 {
        return vec![0, 1, 3, 64, 250];
    }
    vec![0, 1, 3, 64, 1000]
}

/// Rows compared with the reference and the f64 model. On a GPU every row (a kernel bug may hit
/// one tile only); on the CPU backend, whose kernels *are* the reference, up to 48 rows spread over
/// the batch (the reference is per token, so the sample checks the wrapper and the math alike).
fn sample_rows(dev: &Device, t: usize) -> Vec<usize> {
    if !is_cpu(dev) || t <= 48 {
        return (0..t).collect();
    }
    let mut rows: Vec<usize> = (0..40).map(|k| k * t / 40).collect();
    rows.extend([1, t / 2 + 1, t - 2, t - 1]);
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Rows `rows` of a `[T, width]` array.
fn gather<T: Copy>(v: &[T], width: usize, rows: &[usize]) -> Vec<T> {
    rows.iter().flat_map(|&r| v[r * width..(r + 1) * width].iter().copied()).collect()
}

fn gather_post_inputs(i: &common::PostInputs, hidden: usize, rows: &[usize]) -> common::PostInputs {
    common::PostInputs {
        x: gather(&i.x, hidden, rows),
        residual: gather(&i.residual, N * hidden, rows),
        post: gather(&i.post, N, rows),
        comb: gather(&i.comb, N * N, rows),
    }
}

fn gather_pre(o: &PreOutput, hidden: usize, rows: &[usize]) -> PreOutput {
    PreOutput {
        post: gather(&o.post, N, rows),
        comb: gather(&o.comb, N * N, rows),
        layer_input: gather(&o.layer_input, hidden, rows),
    }
}

/// [`HIDDEN`], plus 300 (not a multiple of 8: element loads) and 1000 (a multiple of 8 whose last
/// split is partial: 232 of 256 h, down to one 8-h piece of the last warp).
fn hidden_cases() -> Vec<usize> {
    let mut h = HIDDEN.to_vec();
    h.extend([300, 1000]);
    h
}

struct Fx {
    dev: Device,
    s: Stream,
    kernels: MhcKernels,
}

impl Fx {
    fn new(dev: &Device) -> Self {
        Fx {
            dev: dev.clone(),
            s: dev.create_stream().expect("stream"),
            kernels: MhcKernels::new(dev).expect("kernels"),
        }
    }
    fn ops(&self, hidden: usize, max_tokens: usize) -> MhcOps {
        MhcOps::new(&self.dev, &self.kernels, MhcConfig { hc_mult: N, hidden, max_tokens }).expect("ops")
    }
    fn up<T: Element>(&self, label: &str, data: &[T]) -> Buffer<T> {
        self.dev.alloc_from_slice(label, data, true).expect("upload")
    }
    /// A persistent buffer full of NaN, so unwritten outputs show.
    fn poisoned_bf16(&self, label: &str, n: usize) -> Buffer<bf16> {
        self.up(label, &vec![bf16::from_bits(0xFFFF); n])
    }
    fn poisoned_f32(&self, label: &str, n: usize) -> Buffer<f32> {
        self.up(label, &vec![f32::NAN; n])
    }
    fn read<T: Element>(&self, b: &View<T>) -> Vec<T> {
        self.s.copy_to_host_sync(b).expect("read back")
    }
    fn write<T: Element>(&self, b: &Buffer<T>, data: &[T]) {
        self.s.copy_from_host(data, &b.view()).expect("write")
    }
}

/// Whether `ops` (built with `projection`) takes two passes for `mhc_pre` and the fused op under
/// [`MhcPasses::Two`]: on tensor cores, and on the CPU backend, which emulates the streamed
/// projection, unless the portable path is chosen.
fn streams(dev: &Device, ops: &MhcOps, projection: MhcProjection) -> bool {
    ops.uses_tensor_cores(MhcOp::Pre) || (is_cpu(dev) && projection != MhcProjection::Portable)
}

fn is_cpu(dev: &Device) -> bool {
    dev.backend() == BackendKind::Cpu
}

/// Device output against the reference: bit for bit on the CPU backend (it runs the reference),
/// within the bf16 bound elsewhere; never NaN.
fn check_bf16(dev: &Device, what: &str, got: &[bf16], want: &[bf16]) {
    assert!(got.iter().all(|v| v.to_f32().is_finite()), "{what}: non-finite output (unwritten?)");
    if is_cpu(dev) {
        assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: differs from the reference");
    } else {
        let e = common::rel_l2_bf16(got, &common::to_f64_bf16(want));
        assert!(e <= BF16_TOL, "{what}: relative L2 {e:e} against the reference");
    }
}

fn check_f32(dev: &Device, what: &str, got: &[f32], want: &[f32]) {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite output (unwritten?)");
    if is_cpu(dev) {
        assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: differs from the reference");
    } else {
        let e = common::rel_l2_f32(got, &common::to_f64_f32(want));
        assert!(e <= F32_TOL, "{what}: relative L2 {e:e} against the reference");
    }
}

fn bits_bf16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}
fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---- device buffers of one op's call ----------------------------------------------------------

struct HeadBufs {
    residual: Buffer<bf16>,
    w: [Buffer<f32>; 3],
    out: Buffer<bf16>,
}

impl HeadBufs {
    fn new(fx: &Fx, residual: &[bf16], w: &Weights, hidden: usize) -> Self {
        let t = residual.len() / (N * hidden);
        HeadBufs {
            residual: fx.up("residual", residual),
            w: [fx.up("hc_fn", &w.hc_fn), fx.up("scale", &w.scale), fx.up("base", &w.base)],
            out: fx.poisoned_bf16("out", t * hidden),
        }
    }
    fn run(&self, fx: &Fx, ops: &MhcOps, p: &HcHeadParams) -> Result<(), MhcError> {
        let (f, s, b) = (self.w[0].view(), self.w[1].view(), self.w[2].view());
        ops.hc_head(
            &fx.s,
            &self.residual.view(),
            &HcHeadWeights { hc_fn: &f, scale: &s, base: &b },
            p,
            &self.out.view(),
        )
    }
}

struct PreBufs {
    residual: Buffer<bf16>,
    w: [Buffer<f32>; 3],
    post: Buffer<f32>,
    comb: Buffer<f32>,
    li: Buffer<bf16>,
}

impl PreBufs {
    fn new(fx: &Fx, residual: &[bf16], w: &Weights, hidden: usize) -> Self {
        let t = residual.len() / (N * hidden);
        PreBufs {
            residual: fx.up("residual", residual),
            w: [fx.up("hc_fn", &w.hc_fn), fx.up("scale", &w.scale), fx.up("base", &w.base)],
            post: fx.poisoned_f32("post", t * N),
            comb: fx.poisoned_f32("comb", t * N * N),
            li: fx.poisoned_bf16("layer_input", t * hidden),
        }
    }
    fn run(&self, fx: &Fx, ops: &MhcOps, p: &MhcPreParams) -> Result<(), MhcError> {
        let (f, s, b) = (self.w[0].view(), self.w[1].view(), self.w[2].view());
        let (po, co, li) = (self.post.view(), self.comb.view(), self.li.view());
        ops.pre(
            &fx.s,
            &self.residual.view(),
            &MhcPreWeights { hc_fn: &f, scale: &s, base: &b },
            p,
            &MhcPreOutputs { post: &po, comb: &co, layer_input: &li },
        )
    }
    fn outputs(&self, fx: &Fx) -> PreOutput {
        PreOutput {
            post: fx.read(&self.post.view()),
            comb: fx.read(&self.comb.view()),
            layer_input: fx.read(&self.li.view()),
        }
    }
}

struct PostBufs {
    x: Buffer<bf16>,
    residual: Buffer<bf16>,
    post: Buffer<f32>,
    comb: Buffer<f32>,
    out: Buffer<bf16>,
}

impl PostBufs {
    fn new(fx: &Fx, i: &common::PostInputs) -> Self {
        PostBufs {
            x: fx.up("x", &i.x),
            residual: fx.up("residual", &i.residual),
            post: fx.up("post_in", &i.post),
            comb: fx.up("comb_in", &i.comb),
            out: fx.poisoned_bf16("out", i.residual.len()),
        }
    }
    fn write(&self, fx: &Fx, i: &common::PostInputs) {
        fx.write(&self.x, &i.x);
        fx.write(&self.residual, &i.residual);
        fx.write(&self.post, &i.post);
        fx.write(&self.comb, &i.comb);
    }
    fn run_post(&self, fx: &Fx, ops: &MhcOps) -> Result<(), MhcError> {
        ops.post(&fx.s, &self.x.view(), &self.residual.view(), &self.post.view(), &self.comb.view(), &self.out.view())
    }
    fn run_fused(&self, fx: &Fx, ops: &MhcOps, pre: &PreBufs, p: &MhcPreParams) -> Result<(), MhcError> {
        let (x, r, po, co) = (self.x.view(), self.residual.view(), self.post.view(), self.comb.view());
        let (f, s, b) = (pre.w[0].view(), pre.w[1].view(), pre.w[2].view());
        let (opo, oco, oli) = (pre.post.view(), pre.comb.view(), pre.li.view());
        ops.fused_post_pre(
            &fx.s,
            &MhcPostInputs { x: &x, residual: &r, post: &po, comb: &co },
            &MhcPreWeights { hc_fn: &f, scale: &s, base: &b },
            p,
            &self.out.view(),
            &MhcPreOutputs { post: &opo, comb: &oco, layer_input: &oli },
        )
    }
}

// ---- each op against its reference, and the reference against f64 ------------------------------

fn hc_head_matches_its_reference_and_the_f64_spec(dev: &Device) {
    let fx = Fx::new(dev);
    let p = HcHeadParams::default();
    let mut rng = Rng::new(1);
    for hidden in hidden_cases() {
        let ops = fx.ops(hidden, 1000);
        let w = Weights::random(&mut rng, N, hidden, 1);
        for t in token_cases(dev, hidden) {
            let residual = rng.bf16s(t * N * hidden, 1.5);
            let b = HeadBufs::new(&fx, &residual, &w, hidden);
            b.run(&fx, &ops, &p).expect("hc_head");
            let rows = sample_rows(dev, t);
            let got = gather(&fx.read(&b.out.view()), hidden, &rows);
            let residual = gather(&residual, N * hidden, &rows);
            let want = reference::hc_head(&residual, &w.hc_fn, &w.scale, &w.base, hidden, &p).expect("reference");
            check_bf16(dev, &format!("hc_head H={hidden} T={t}"), &got, &want);
            let e = common::rel_l2_bf16(&want, &common::hc_head_f64(&residual, &w, hidden, &p));
            assert!(e <= BF16_TOL, "hc_head reference H={hidden} T={t}: relative L2 {e:e} against f64");
        }
    }
}

fn check_pre(dev: &Device, what: &str, got: &PreOutput, want: &PreOutput, f64s: &common::PreF64) {
    check_f32(dev, &format!("{what} post"), &got.post, &want.post);
    check_f32(dev, &format!("{what} comb"), &got.comb, &want.comb);
    check_bf16(dev, &format!("{what} layer_input"), &got.layer_input, &want.layer_input);
    let e = common::rel_l2_f32(&want.post, &f64s.0);
    assert!(e <= F32_TOL, "{what} reference post: relative L2 {e:e} against f64");
    let e = common::rel_l2_f32(&want.comb, &f64s.1);
    assert!(e <= F32_TOL, "{what} reference comb: relative L2 {e:e} against f64");
    let e = common::rel_l2_bf16(&want.layer_input, &f64s.2);
    assert!(e <= BF16_TOL, "{what} reference layer_input: relative L2 {e:e} against f64");
    let defect = common::sinkhorn_defect(&got.comb);
    assert!(defect <= 1e-3, "{what}: Sinkhorn rows/columns miss 1 by {defect:e}");
}

fn mhc_pre_matches_its_reference_and_the_f64_spec(dev: &Device) {
    let fx = Fx::new(dev);
    let p = MhcPreParams::default();
    let mut rng = Rng::new(2);
    for hidden in hidden_cases() {
        let ops = fx.ops(hidden, 1000);
        let w = Weights::random(&mut rng, M, hidden, 3);
        for t in token_cases(dev, hidden) {
            let residual = rng.bf16s(t * N * hidden, 1.5);
            let b = PreBufs::new(&fx, &residual, &w, hidden);
            b.run(&fx, &ops, &p).expect("mhc_pre");
            let rows = sample_rows(dev, t);
            let got = gather_pre(&b.outputs(&fx), hidden, &rows);
            let residual = gather(&residual, N * hidden, &rows);
            let want = reference::pre(&residual, &w.hc_fn, &w.scale, &w.base, hidden, &p).expect("reference");
            check_pre(
                dev,
                &format!("mhc_pre H={hidden} T={t}"),
                &got,
                &want,
                &common::pre_f64(&residual, &w, hidden, &p),
            );
        }
    }
}

fn mhc_post_matches_its_reference_and_the_f64_spec(dev: &Device) {
    let fx = Fx::new(dev);
    let mut rng = Rng::new(3);
    for hidden in hidden_cases() {
        let ops = fx.ops(hidden, 1000);
        for t in token_cases(dev, hidden) {
            let inp = common::PostInputs::random(&mut rng, t, hidden);
            let b = PostBufs::new(&fx, &inp);
            b.run_post(&fx, &ops).expect("mhc_post");
            let rows = sample_rows(dev, t);
            let got = gather(&fx.read(&b.out.view()), N * hidden, &rows);
            let inp = gather_post_inputs(&inp, hidden, &rows);
            let want = reference::post(&inp.x, &inp.residual, &inp.post, &inp.comb, hidden).expect("reference");
            check_bf16(dev, &format!("mhc_post H={hidden} T={t}"), &got, &want);
            let e = common::rel_l2_bf16(&want, &common::post_f64(&inp, hidden));
            assert!(e <= BF16_TOL, "mhc_post reference H={hidden} T={t}: relative L2 {e:e} against f64");
        }
    }
}

fn fused_post_pre_matches_its_reference_the_f64_spec_and_post_then_pre(dev: &Device) {
    let fx = Fx::new(dev);
    let p = MhcPreParams::default();
    let mut rng = Rng::new(4);
    for hidden in hidden_cases() {
        let ops = fx.ops(hidden, 1000);
        let w = Weights::random(&mut rng, M, hidden, 3);
        for t in token_cases(dev, hidden) {
            let what = format!("mhc_fused_post_pre H={hidden} T={t}");
            let inp = common::PostInputs::random(&mut rng, t, hidden);
            let b = PostBufs::new(&fx, &inp);
            let pre = PreBufs::new(&fx, &vec![bf16::ZERO; t * N * hidden], &w, hidden);
            b.run_fused(&fx, &ops, &pre, &p).expect("fused");
            let (got_r, got) = (fx.read(&b.out.view()), pre.outputs(&fx));
            let rows = sample_rows(dev, t);
            let sampled = gather_post_inputs(&inp, hidden, &rows);
            let (want_r, want) = reference::fused_post_pre(
                &sampled.x,
                &sampled.residual,
                &sampled.post,
                &sampled.comb,
                &w.hc_fn,
                &w.scale,
                &w.base,
                hidden,
                &p,
            )
            .expect("reference");
            check_bf16(dev, &format!("{what} residual_out"), &gather(&got_r, N * hidden, &rows), &want_r);
            let (f_r, f_pre) = common::fused_f64(&sampled, &w, hidden, &p);
            let e = common::rel_l2_bf16(&want_r, &f_r);
            assert!(e <= BF16_TOL, "{what} reference residual_out: relative L2 {e:e} against f64");
            check_pre(dev, &what, &gather_pre(&got, hidden, &rows), &want, &f_pre);
            if is_cpu(dev) && t > 64 {
                continue; // on the CPU backend both paths run the same reference code
            }

            // The same device, unfused: post into a second buffer, then pre of it.
            let b2 = PostBufs::new(&fx, &inp);
            b2.run_post(&fx, &ops).expect("post");
            let pre2 = PreBufs { residual: b2.out, ..PreBufs::new(&fx, &[], &w, hidden) };
            let pre2 = PreBufs {
                post: fx.poisoned_f32("post", t * N),
                comb: fx.poisoned_f32("comb", t * N * N),
                li: fx.poisoned_bf16("li", t * hidden),
                ..pre2
            };
            pre2.run(&fx, &ops, &p).expect("pre");
            let sep = pre2.outputs(&fx);
            assert_eq!(
                bits_bf16(&fx.read(&pre2.residual.view())),
                bits_bf16(&got_r),
                "{what}: residual differs from post"
            );
            assert_eq!(bits_f32(&sep.post), bits_f32(&got.post), "{what}: post differs from post+pre");
            assert_eq!(bits_f32(&sep.comb), bits_f32(&got.comb), "{what}: comb differs from post+pre");
            assert_eq!(
                bits_bf16(&sep.layer_input),
                bits_bf16(&got.layer_input),
                "{what}: layer input differs from post+pre"
            );
        }
    }
}

// ---- projection paths and tiles -------------------------------------------------------------------

/// The default paths, tensor cores for every op where the device has them, the portable path
/// forced, forced tiles of 1, 16, 48 and 128 tokens and forced two passes: each path matches the
/// reference (bit for bit on the CPU backend), and within a path every tile and either number of
/// passes gives the same bits (a token's reduction order is a function of H alone).
fn both_projection_paths_match_the_reference_and_every_tile_gives_the_same_bits(dev: &Device) {
    let fx = Fx::new(dev);
    let (hp, pp) = (HcHeadParams::default(), MhcPreParams::default());
    let mut rng = Rng::new(11);
    // The CPU backend's kernels are the reference whatever the path or tile: one small case.
    let cases: &[(usize, usize)] = if is_cpu(dev) { &[(1000, 20)] } else { &[(300, 40), (1000, 150), (4096, 150)] };
    for &(hidden, t) in cases {
        let w_head = Weights::random(&mut rng, N, hidden, 1);
        let w_pre = Weights::random(&mut rng, M, hidden, 3);
        let residual = rng.bf16s(t * N * hidden, 1.5);
        let inp = common::PostInputs::random(&mut rng, t, hidden);
        let head_want =
            reference::hc_head(&residual, &w_head.hc_fn, &w_head.scale, &w_head.base, hidden, &hp).expect("reference");
        let pre_want =
            reference::pre(&residual, &w_pre.hc_fn, &w_pre.scale, &w_pre.base, hidden, &pp).expect("reference");
        let (fused_r_want, fused_want) = reference::fused_post_pre(
            &inp.x,
            &inp.residual,
            &inp.post,
            &inp.comb,
            &w_pre.hc_fn,
            &w_pre.scale,
            &w_pre.base,
            hidden,
            &pp,
        )
        .expect("reference");
        let pre_f64 = common::pre_f64(&residual, &w_pre, hidden, &pp);
        let fused_f64 = common::fused_f64(&inp, &w_pre, hidden, &pp).1;
        for projection in [MhcProjection::Auto, MhcProjection::TensorCores, MhcProjection::Portable] {
            let base = fx.ops(hidden, t).with_projection(projection);
            // Clusters of 8 blocks up to H = 4096, of 16 past it: H/8 h a block, in 16-byte chunks.
            let nb = if hidden > 4096 { 16 } else { 8 };
            let clusters = projection == MhcProjection::Auto
                && dev.info().has_clusters()
                && hidden % (8 * nb) == 0
                && hidden <= 8192;
            assert_eq!(base.uses_clusters(MhcOp::HcHead), clusters, "{projection:?} at H {hidden}");
            assert!(!base.uses_clusters(MhcOp::Pre) && !base.uses_clusters(MhcOp::FusedPostPre));
            let mma = dev.info().has_bf16_mma();
            let tc = projection != MhcProjection::Portable && mma;
            assert_eq!(base.uses_tensor_cores(MhcOp::Pre), tc, "{projection:?} on {}", dev.info().arch);
            assert_eq!(base.uses_tensor_cores(MhcOp::FusedPostPre), tc, "{projection:?}");
            let head_tc = projection == MhcProjection::TensorCores && mma;
            assert_eq!(base.uses_tensor_cores(MhcOp::HcHead), head_tc, "{projection:?}");
            assert!(!base.uses_tensor_cores(MhcOp::Post));
            let mut first: Option<Vec<u32>> = None;
            let variants = [
                (None, MhcPasses::Auto),
                (Some(1), MhcPasses::One),
                (Some(16), MhcPasses::One),
                (Some(48), MhcPasses::One),
                (Some(128), MhcPasses::One),
                (None, MhcPasses::Two),
            ];
            for (tile, passes) in variants {
                let what = format!("H={hidden} T={t} {projection:?} tile {tile:?} {passes:?}");
                let ops = fx
                    .ops(hidden, t)
                    .with_projection(projection)
                    .with_tile_tokens(tile)
                    .expect("tile")
                    .with_passes(passes);
                let two = passes == MhcPasses::Two && streams(dev, &ops, projection);
                for op in [MhcOp::Pre, MhcOp::FusedPostPre] {
                    assert_eq!(ops.launch_configs(op, t).len(), 1 + usize::from(two), "{what} {op:?}");
                }
                let head = HeadBufs::new(&fx, &residual, &w_head, hidden);
                head.run(&fx, &ops, &hp).expect("hc_head");
                let head_got = fx.read(&head.out.view());
                check_bf16(dev, &format!("hc_head {what}"), &head_got, &head_want);
                let pre = PreBufs::new(&fx, &residual, &w_pre, hidden);
                pre.run(&fx, &ops, &pp).expect("pre");
                let pre_got = pre.outputs(&fx);
                check_pre(dev, &format!("mhc_pre {what}"), &pre_got, &pre_want, &pre_f64);
                let post = PostBufs::new(&fx, &inp);
                let fused = PreBufs::new(&fx, &vec![bf16::ZERO; t * N * hidden], &w_pre, hidden);
                post.run_fused(&fx, &ops, &fused, &pp).expect("fused");
                let fused_got = fused.outputs(&fx);
                check_bf16(dev, &format!("fused residual_out {what}"), &fx.read(&post.out.view()), &fused_r_want);
                check_pre(dev, &format!("fused {what}"), &fused_got, &fused_want, &fused_f64);
                let wide = |v: Vec<u16>| v.into_iter().map(u32::from).collect::<Vec<u32>>();
                let bits = [
                    wide(bits_bf16(&head_got)),
                    bits_f32(&pre_got.post),
                    bits_f32(&pre_got.comb),
                    wide(bits_bf16(&pre_got.layer_input)),
                    bits_f32(&fused_got.post),
                    bits_f32(&fused_got.comb),
                    wide(bits_bf16(&fused_got.layer_input)),
                ]
                .concat();
                match &first {
                    None => first = Some(bits),
                    Some(f) => assert!(*f == bits, "{what}: bits differ from the plan's own tile"),
                }
            }
        }
    }
}

// ---- batch invariance ----------------------------------------------------------------------

fn invariance_sizes(dev: &Device) -> (usize, usize) {
    if is_cpu(dev) && cfg!(debug_assertions) {
        (1024, 1000)
    } else {
        (7168, 1000)
    }
}

const ROWS: [usize; 4] = [0, 1, 517, 999];

fn hc_head_on_clusters_matches_the_reference_is_batch_invariant_and_replays_as_eager(dev: &Device) {
    let fx = Fx::new(dev);
    let hp = HcHeadParams::default();
    let mut rng = Rng::new(12);
    let light = is_cpu(dev) && cfg!(debug_assertions);
    let hiddens: &[usize] = if light { &[64, 1024] } else { &[64, 4096, 7168] };
    for &hidden in hiddens {
        let t = if light { 40 } else { 1000 };
        let d = N * hidden;
        let ops = fx.ops(hidden, t);
        assert_eq!(ops.uses_clusters(MhcOp::HcHead), dev.info().has_clusters(), "H {hidden}");
        let w = Weights::random(&mut rng, N, hidden, 1);
        let residual = rng.bf16s(t * d, 1.5);
        let head = HeadBufs::new(&fx, &residual, &w, hidden);
        head.run(&fx, &ops, &hp).expect("hc_head");
        let all = fx.read(&head.out.view());
        let want = reference::hc_head(&residual, &w.hc_fn, &w.scale, &w.base, hidden, &hp).expect("reference");
        check_bf16(dev, &format!("hc_head on clusters H={hidden} T={t}"), &all, &want);
        // A row alone, and runs of rows that fill part of a tile of 8 or straddle two, give the
        // same bits.
        for r in [0, 1, 3, t / 2 + 1, t - 1] {
            for take in [1, 2, 5, 11] {
                let rows = take.min(t - r);
                let one = HeadBufs::new(&fx, &residual[r * d..(r + rows) * d], &w, hidden);
                one.run(&fx, &ops, &hp).expect("hc_head alone");
                assert_eq!(
                    bits_bf16(&fx.read(&one.out.view())),
                    bits_bf16(&all[r * hidden..(r + rows) * hidden]),
                    "rows {r}..{} of {t} (H={hidden})",
                    r + rows
                );
            }
        }
        // Captured once, replayed over fresh rows: the eager bits each time.
        let g_in = HeadBufs::new(&fx, &residual, &w, hidden);
        fx.s.begin_capture("hc_head clusters").expect("begin");
        g_in.run(&fx, &ops, &hp).expect("captured hc_head");
        let g = fx.s.end_capture().expect("end");
        assert_eq!(g.op_count(), 1, "one launch");
        for step in 0..2 {
            let fresh = rng.bf16s(t * d, 1.0);
            fx.write(&g_in.residual, &fresh);
            fx.write(&head.residual, &fresh);
            g.replay(&fx.s).expect("replay");
            head.run(&fx, &ops, &hp).expect("eager");
            assert_eq!(
                bits_bf16(&fx.read(&g_in.out.view())),
                bits_bf16(&fx.read(&head.out.view())),
                "replay {step} (H={hidden})"
            );
        }
    }
}

fn a_row_alone_equals_the_same_row_in_a_batch_of_1000(dev: &Device) {
    let fx = Fx::new(dev);
    let (hidden, t) = invariance_sizes(dev);
    let ops = fx.ops(hidden, t);
    let mut rng = Rng::new(5);
    let (d, n) = (N * hidden, N);
    let hp = HcHeadParams::default();
    let pp = MhcPreParams::default();
    let wh = Weights::random(&mut rng, N, hidden, 1);
    let wp = Weights::random(&mut rng, M, hidden, 3);
    let residual = rng.bf16s(t * d, 1.5);
    let inp = common::PostInputs::random(&mut rng, t, hidden);

    let head = HeadBufs::new(&fx, &residual, &wh, hidden);
    head.run(&fx, &ops, &hp).expect("hc_head");
    let head_all = fx.read(&head.out.view());
    let pre = PreBufs::new(&fx, &residual, &wp, hidden);
    pre.run(&fx, &ops, &pp).expect("pre");
    let pre_all = pre.outputs(&fx);
    let post = PostBufs::new(&fx, &inp);
    post.run_post(&fx, &ops).expect("post");
    let post_all = fx.read(&post.out.view());
    let fused_pre = PreBufs::new(&fx, &[], &wp, hidden);
    let fused_pre = PreBufs {
        post: fx.poisoned_f32("post", t * n),
        comb: fx.poisoned_f32("comb", t * n * n),
        li: fx.poisoned_bf16("li", t * hidden),
        ..fused_pre
    };
    let fused = PostBufs::new(&fx, &inp);
    fused.run_fused(&fx, &ops, &fused_pre, &pp).expect("fused");
    let (fused_r_all, fused_all) = (fx.read(&fused.out.view()), fused_pre.outputs(&fx));

    for r in ROWS {
        let what = format!("row {r} of {t} (H={hidden})");
        let one = &residual[r * d..(r + 1) * d];
        let h1 = HeadBufs::new(&fx, one, &wh, hidden);
        h1.run(&fx, &ops, &hp).expect("hc_head alone");
        assert_eq!(
            bits_bf16(&fx.read(&h1.out.view())),
            bits_bf16(&head_all[r * hidden..(r + 1) * hidden]),
            "hc_head {what}"
        );

        let p1 = PreBufs::new(&fx, one, &wp, hidden);
        p1.run(&fx, &ops, &pp).expect("pre alone");
        let o = p1.outputs(&fx);
        assert_eq!(bits_f32(&o.post), bits_f32(&pre_all.post[r * n..(r + 1) * n]), "mhc_pre post {what}");
        assert_eq!(bits_f32(&o.comb), bits_f32(&pre_all.comb[r * n * n..(r + 1) * n * n]), "mhc_pre comb {what}");
        assert_eq!(
            bits_bf16(&o.layer_input),
            bits_bf16(&pre_all.layer_input[r * hidden..(r + 1) * hidden]),
            "mhc_pre {what}"
        );

        let one_in = common::PostInputs {
            x: inp.x[r * hidden..(r + 1) * hidden].to_vec(),
            residual: inp.residual[r * d..(r + 1) * d].to_vec(),
            post: inp.post[r * n..(r + 1) * n].to_vec(),
            comb: inp.comb[r * n * n..(r + 1) * n * n].to_vec(),
        };
        let q1 = PostBufs::new(&fx, &one_in);
        q1.run_post(&fx, &ops).expect("post alone");
        assert_eq!(bits_bf16(&fx.read(&q1.out.view())), bits_bf16(&post_all[r * d..(r + 1) * d]), "mhc_post {what}");

        let f1 = PostBufs::new(&fx, &one_in);
        let f1_pre = PreBufs::new(&fx, &vec![bf16::ZERO; d], &wp, hidden);
        f1.run_fused(&fx, &ops, &f1_pre, &pp).expect("fused alone");
        let o = f1_pre.outputs(&fx);
        assert_eq!(
            bits_bf16(&fx.read(&f1.out.view())),
            bits_bf16(&fused_r_all[r * d..(r + 1) * d]),
            "fused residual {what}"
        );
        assert_eq!(bits_f32(&o.post), bits_f32(&fused_all.post[r * n..(r + 1) * n]), "fused post {what}");
        assert_eq!(bits_f32(&o.comb), bits_f32(&fused_all.comb[r * n * n..(r + 1) * n * n]), "fused comb {what}");
        assert_eq!(
            bits_bf16(&o.layer_input),
            bits_bf16(&fused_all.layer_input[r * hidden..(r + 1) * hidden]),
            "fused {what}"
        );
    }
}

// ---- capture and replay ----------------------------------------------------------------------

/// Captures all four ops at `t` tokens, then replays with fresh inputs three times; each replay
/// must equal an eager run on the same inputs, bit for bit.
fn graph_replays_with_fresh_inputs_equal_eager_runs(dev: &Device) {
    for passes in [MhcPasses::Auto, MhcPasses::Two] {
        graph_replays_equal_eager_runs(dev, passes);
    }
}

/// One graph of the four ops at T = 64 ([`MhcPasses::Two`]: `mhc_pre` and the fused op in two
/// launches each on tensor cores), replayed over fresh inputs.
fn graph_replays_equal_eager_runs(dev: &Device, passes: MhcPasses) {
    let fx = Fx::new(dev);
    let (hidden, t) = (if is_cpu(dev) && cfg!(debug_assertions) { 512 } else { 4096 }, 64);
    let ops = fx.ops(hidden, t).with_passes(passes);
    let mut rng = Rng::new(6);
    let d = N * hidden;
    let (hp, pp) = (HcHeadParams::default(), MhcPreParams::default());
    let wh = Weights::random(&mut rng, N, hidden, 1);
    let wp = Weights::random(&mut rng, M, hidden, 3);
    let head = HeadBufs::new(&fx, &rng.bf16s(t * d, 1.0), &wh, hidden);
    let pre = PreBufs::new(&fx, &rng.bf16s(t * d, 1.0), &wp, hidden);
    let post = PostBufs::new(&fx, &common::PostInputs::random(&mut rng, t, hidden));
    let fused = PostBufs::new(&fx, &common::PostInputs::random(&mut rng, t, hidden));
    let fused_pre = PreBufs::new(&fx, &vec![bf16::ZERO; t * d], &wp, hidden);
    let run_all = || {
        head.run(&fx, &ops, &hp).expect("hc_head");
        pre.run(&fx, &ops, &pp).expect("pre");
        post.run_post(&fx, &ops).expect("post");
        fused.run_fused(&fx, &ops, &fused_pre, &pp).expect("fused");
    };
    let snapshot = || {
        (
            bits_bf16(&fx.read(&head.out.view())),
            pre.outputs(&fx),
            bits_bf16(&fx.read(&post.out.view())),
            bits_bf16(&fx.read(&fused.out.view())),
            fused_pre.outputs(&fx),
        )
    };
    run_all(); // warm-up, eager
    fx.s.begin_capture("mhc").expect("begin capture");
    run_all();
    let g = fx.s.end_capture().expect("end capture");
    let launches: usize = [MhcOp::HcHead, MhcOp::Pre, MhcOp::Post, MhcOp::FusedPostPre]
        .map(|op| ops.launch_configs(op, t).len())
        .iter()
        .sum();
    let two = passes == MhcPasses::Two && streams(dev, &ops, MhcProjection::Auto);
    assert_eq!(launches, if two { 6 } else { 4 }, "{passes:?}");
    assert_eq!(g.op_count(), launches, "the launches the ops report");
    for step in 0..3 {
        fx.write(&head.residual, &rng.bf16s(t * d, 1.0));
        fx.write(&pre.residual, &rng.bf16s(t * d, 1.0));
        post.write(&fx, &common::PostInputs::random(&mut rng, t, hidden));
        fused.write(&fx, &common::PostInputs::random(&mut rng, t, hidden));
        g.replay(&fx.s).expect("replay");
        let replayed = snapshot();
        run_all();
        let eager = snapshot();
        assert_eq!(replayed.0, eager.0, "hc_head replay {step} {passes:?}");
        assert_eq!(bits_f32(&replayed.1.post), bits_f32(&eager.1.post), "pre post replay {step}");
        assert_eq!(bits_f32(&replayed.1.comb), bits_f32(&eager.1.comb), "pre comb replay {step}");
        assert_eq!(bits_bf16(&replayed.1.layer_input), bits_bf16(&eager.1.layer_input), "pre replay {step}");
        assert_eq!(replayed.2, eager.2, "post replay {step}");
        assert_eq!(replayed.3, eager.3, "fused residual replay {step}");
        assert_eq!(bits_f32(&replayed.4.post), bits_f32(&eager.4.post), "fused post replay {step}");
        assert_eq!(bits_f32(&replayed.4.comb), bits_f32(&eager.4.comb), "fused comb replay {step}");
        assert_eq!(bits_bf16(&replayed.4.layer_input), bits_bf16(&eager.4.layer_input), "fused replay {step}");
        assert!(replayed.0.iter().all(|&b| b != 0xFFFF), "hc_head replay {step} left poison");
    }
}

fn zero_tokens_launch_nothing(dev: &Device) {
    let fx = Fx::new(dev);
    let hidden = 256;
    let ops = fx.ops(hidden, 8);
    let mut rng = Rng::new(7);
    let (hp, pp) = (HcHeadParams::default(), MhcPreParams::default());
    let head = HeadBufs::new(&fx, &[], &Weights::random(&mut rng, N, hidden, 1), hidden);
    let wp = Weights::random(&mut rng, M, hidden, 3);
    let pre = PreBufs::new(&fx, &[], &wp, hidden);
    let post = PostBufs::new(&fx, &common::PostInputs::random(&mut rng, 0, hidden));
    let fused_pre = PreBufs::new(&fx, &[], &wp, hidden);
    fx.s.begin_capture("empty").expect("begin");
    head.run(&fx, &ops, &hp).expect("hc_head");
    pre.run(&fx, &ops, &pp).expect("pre");
    post.run_post(&fx, &ops).expect("post");
    post.run_fused(&fx, &ops, &fused_pre, &pp).expect("fused");
    let g = fx.s.end_capture().expect("end");
    assert_eq!(g.op_count(), 0, "T = 0 must enqueue nothing");
    for op in MhcOp::ALL {
        assert_eq!(ops.launch_config(op, 0), None);
        assert_eq!(ops.launch_config(op, 37), ops.launch_config(op, 37), "{op:?}: the shape is a function of T");
    }
}

// ---- in place, alignment ----------------------------------------------------------------------

fn in_place_post_and_fused_equal_out_of_place(dev: &Device) {
    let fx = Fx::new(dev);
    let (hidden, t) = (512, 9);
    let ops = fx.ops(hidden, t);
    let mut rng = Rng::new(8);
    let pp = MhcPreParams::default();
    let inp = common::PostInputs::random(&mut rng, t, hidden);
    let wp = Weights::random(&mut rng, M, hidden, 3);

    let a = PostBufs::new(&fx, &inp);
    a.run_post(&fx, &ops).expect("post");
    let want = bits_bf16(&fx.read(&a.out.view()));
    let r = a.residual.view();
    ops.post(&fx.s, &a.x.view(), &r, &a.post.view(), &a.comb.view(), &r).expect("in-place post");
    assert_eq!(bits_bf16(&fx.read(&r)), want, "in-place post");

    let b = PostBufs::new(&fx, &inp);
    let bp = PreBufs::new(&fx, &vec![bf16::ZERO; t * N * hidden], &wp, hidden);
    b.run_fused(&fx, &ops, &bp, &pp).expect("fused");
    let (want_r, want) = (bits_bf16(&fx.read(&b.out.view())), bp.outputs(&fx));
    let c = PostBufs::new(&fx, &inp);
    let cp = PreBufs::new(&fx, &vec![bf16::ZERO; t * N * hidden], &wp, hidden);
    let (x, r, po, co) = (c.x.view(), c.residual.view(), c.post.view(), c.comb.view());
    let (f, s, bb) = (cp.w[0].view(), cp.w[1].view(), cp.w[2].view());
    let (opo, oco, oli) = (cp.post.view(), cp.comb.view(), cp.li.view());
    ops.fused_post_pre(
        &fx.s,
        &MhcPostInputs { x: &x, residual: &r, post: &po, comb: &co },
        &MhcPreWeights { hc_fn: &f, scale: &s, base: &bb },
        &pp,
        &r,
        &MhcPreOutputs { post: &opo, comb: &oco, layer_input: &oli },
    )
    .expect("in-place fused");
    let got = cp.outputs(&fx);
    assert_eq!(bits_bf16(&fx.read(&r)), want_r, "in-place fused residual");
    assert_eq!(got, want, "in-place fused outputs");
}

/// Views that start 2 bytes into their buffers (not 16-byte aligned) take the scalar path, which
/// must give the same bits as the vector path.
fn unaligned_views_give_the_same_bits(dev: &Device) {
    let fx = Fx::new(dev);
    // Two tiles of `hc_head` on clusters, the second partial (and 138 tiles further down).
    let (hidden, t) = (1024, 13);
    let ops = fx.ops(hidden, t);
    let mut rng = Rng::new(9);
    let d = N * hidden;
    let (hp, pp) = (HcHeadParams::default(), MhcPreParams::default());
    let residual = rng.bf16s(t * d, 1.0);
    let wh = Weights::random(&mut rng, N, hidden, 1);
    let wp = Weights::random(&mut rng, M, hidden, 3);
    let shifted = |label: &str, data: &[bf16]| {
        let mut v = vec![bf16::ZERO];
        v.extend_from_slice(data);
        fx.up(label, &v)
    };

    let aligned = HeadBufs::new(&fx, &residual, &wh, hidden);
    aligned.run(&fx, &ops, &hp).expect("hc_head");
    let r1 = shifted("residual+1", &residual);
    let o1 = shifted("out+1", &vec![bf16::from_bits(0xFFFF); t * hidden]);
    let (f, s, b) = (aligned.w[0].view(), aligned.w[1].view(), aligned.w[2].view());
    let rv = r1.slice(1, t * d).expect("view");
    let ov = o1.slice(1, t * hidden).expect("view");
    ops.hc_head(&fx.s, &rv, &HcHeadWeights { hc_fn: &f, scale: &s, base: &b }, &hp, &ov).expect("unaligned hc_head");
    assert_eq!(bits_bf16(&fx.read(&ov)), bits_bf16(&fx.read(&aligned.out.view())), "hc_head");
    // hc_head again over more tiles than the clusters a device runs at once (138 tiles: every
    // cluster takes several in turn, through reused buffers and partial slots), the last partial.
    let t2 = 1100;
    let ops2 = fx.ops(hidden, t2);
    let residual2 = rng.bf16s(t2 * d, 1.0);
    let aligned2 = HeadBufs::new(&fx, &residual2, &wh, hidden);
    aligned2.run(&fx, &ops2, &hp).expect("hc_head, many tiles");
    let r2 = shifted("residual2+1", &residual2);
    let o2 = shifted("out2+1", &vec![bf16::from_bits(0xFFFF); t2 * hidden]);
    let (rv2, ov2) = (r2.slice(1, t2 * d).expect("view"), o2.slice(1, t2 * hidden).expect("view"));
    ops2.hc_head(&fx.s, &rv2, &HcHeadWeights { hc_fn: &f, scale: &s, base: &b }, &hp, &ov2)
        .expect("unaligned hc_head, many tiles");
    assert_eq!(bits_bf16(&fx.read(&ov2)), bits_bf16(&fx.read(&aligned2.out.view())), "hc_head, many tiles");

    let pa = PreBufs::new(&fx, &residual, &wp, hidden);
    pa.run(&fx, &ops, &pp).expect("pre");
    let li1 = shifted("li+1", &vec![bf16::from_bits(0xFFFF); t * hidden]);
    let lv = li1.slice(1, t * hidden).expect("view");
    let (f, s, b) = (pa.w[0].view(), pa.w[1].view(), pa.w[2].view());
    let (po, co) = (fx.poisoned_f32("post", t * N), fx.poisoned_f32("comb", t * N * N));
    let (pov, cov) = (po.view(), co.view());
    ops.pre(
        &fx.s,
        &rv,
        &MhcPreWeights { hc_fn: &f, scale: &s, base: &b },
        &pp,
        &MhcPreOutputs { post: &pov, comb: &cov, layer_input: &lv },
    )
    .expect("unaligned pre");
    assert_eq!(bits_bf16(&fx.read(&lv)), bits_bf16(&fx.read(&pa.li.view())), "mhc_pre layer input");
    assert_eq!(bits_f32(&fx.read(&pov)), bits_f32(&fx.read(&pa.post.view())), "mhc_pre post");
    assert_eq!(bits_f32(&fx.read(&cov)), bits_f32(&fx.read(&pa.comb.view())), "mhc_pre comb");

    let inp = common::PostInputs::random(&mut rng, t, hidden);
    let qa = PostBufs::new(&fx, &inp);
    qa.run_post(&fx, &ops).expect("post");
    let x1 = shifted("x+1", &inp.x);
    let xr1 = shifted("r+1", &inp.residual);
    let out1 = shifted("o+1", &vec![bf16::from_bits(0xFFFF); t * d]);
    let (xv, xrv, outv) =
        (x1.slice(1, t * hidden).expect("v"), xr1.slice(1, t * d).expect("v"), out1.slice(1, t * d).expect("v"));
    ops.post(&fx.s, &xv, &xrv, &qa.post.view(), &qa.comb.view(), &outv).expect("unaligned post");
    assert_eq!(bits_bf16(&fx.read(&outv)), bits_bf16(&fx.read(&qa.out.view())), "mhc_post");
}

// ---- validation ----------------------------------------------------------------------------

fn misuse_is_a_precise_error_and_launches_nothing(dev: &Device) {
    let fx = Fx::new(dev);
    let hidden = 256;
    let ops = fx.ops(hidden, 4);
    let mut rng = Rng::new(10);
    let (hp, pp) = (HcHeadParams::default(), MhcPreParams::default());
    let w = Weights::random(&mut rng, N, hidden, 1);
    let head = HeadBufs::new(&fx, &rng.bf16s(2 * N * hidden, 1.0), &w, hidden);
    let (f, s, b) = (head.w[0].view(), head.w[1].view(), head.w[2].view());
    let hw = HcHeadWeights { hc_fn: &f, scale: &s, base: &b };
    let r = head.residual.view();

    let short = head.out.slice(0, hidden).expect("short");
    assert!(matches!(ops.hc_head(&fx.s, &r, &hw, &hp, &short), Err(MhcError::Shape { arg: "out", .. })));
    let ragged = head.residual.slice(0, N * hidden + 3).expect("ragged");
    assert!(matches!(ops.hc_head(&fx.s, &ragged, &hw, &hp, &head.out.view()), Err(MhcError::PartialToken { .. })));
    let f_short = head.w[0].slice(0, 10).expect("v");
    let bad_w = HcHeadWeights { hc_fn: &f_short, ..hw };
    assert!(matches!(ops.hc_head(&fx.s, &r, &bad_w, &hp, &head.out.view()), Err(MhcError::Shape { arg: "hc_fn", .. })));
    let bad_p = HcHeadParams { rms_eps: f32::NAN, ..hp };
    assert!(matches!(
        ops.hc_head(&fx.s, &r, &hw, &bad_p, &head.out.view()),
        Err(MhcError::InvalidParam { name: "rms_eps", .. })
    ));
    let big = fx.up("big", &rng.bf16s(5 * N * hidden, 1.0));
    let big_out = fx.poisoned_bf16("big_out", 5 * hidden);
    assert!(matches!(
        ops.hc_head(&fx.s, &big.view(), &hw, &hp, &big_out.view()),
        Err(MhcError::TooManyTokens { tokens: 5, max_tokens: 4, .. })
    ));
    // An output overlapping an input: hc_head writing over its own residual.
    let alias = head.residual.slice(0, 2 * hidden).expect("alias");
    assert!(matches!(
        ops.hc_head(&fx.s, &r, &hw, &hp, &alias),
        Err(MhcError::Overlap { output: "out", input: "residual", .. })
    ));

    let wp = Weights::random(&mut rng, M, hidden, 3);
    let pre = PreBufs::new(&fx, &rng.bf16s(2 * N * hidden, 1.0), &wp, hidden);
    let bad = MhcPreParams { sinkhorn_iters: 0, ..pp };
    assert!(matches!(pre.run(&fx, &ops, &bad), Err(MhcError::InvalidParam { name: "sinkhorn_iters", .. })));
    let (f, s, b) = (pre.w[0].view(), pre.w[1].view(), pre.w[2].view());
    let s2 = pre.w[1].slice(0, 2).expect("v");
    let (po, co, li) = (pre.post.view(), pre.comb.view(), pre.li.view());
    let outs = MhcPreOutputs { post: &po, comb: &co, layer_input: &li };
    assert!(matches!(
        ops.pre(&fx.s, &pre.residual.view(), &MhcPreWeights { hc_fn: &f, scale: &s2, base: &b }, &pp, &outs),
        Err(MhcError::Shape { arg: "scale", .. })
    ));
    let empty = po.slice(0, 0).expect("v");
    let same = MhcPreOutputs { post: &po, comb: &empty, layer_input: &li };
    assert!(matches!(
        ops.pre(&fx.s, &pre.residual.view(), &MhcPreWeights { hc_fn: &f, scale: &s, base: &b }, &pp, &same),
        Err(MhcError::Shape { arg: "comb", .. })
    ));
    let comb_over_post = co.slice(0, 8).expect("v");
    let post_over = MhcPreOutputs { post: &comb_over_post, comb: &co, layer_input: &li };
    assert!(matches!(
        ops.pre(&fx.s, &pre.residual.view(), &MhcPreWeights { hc_fn: &f, scale: &s, base: &b }, &pp, &post_over),
        Err(MhcError::Overlap { .. })
    ));

    // Configurations the kernels cannot take are refused before anything is allocated, naming
    // the value and the allowed range.
    for (bad, needle) in [
        (MhcConfig { hc_mult: 2, hidden, max_tokens: 4 }, "hc_mult 2"),
        (MhcConfig { hc_mult: N, hidden: 0, max_tokens: 4 }, "hidden 0"),
        (MhcConfig { hc_mult: N, hidden: 1 << 23, max_tokens: 4 }, "2^24"),
        (MhcConfig { hc_mult: N, hidden, max_tokens: 1 << 33 }, "32 bits"),
    ] {
        match MhcOps::new(dev, &fx.kernels, bad) {
            Err(MhcError::Unsupported(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    for tile in [0, 129] {
        match fx.ops(hidden, 4).with_tile_tokens(Some(tile)) {
            Err(MhcError::Unsupported(m)) => {
                assert!(m.contains(&format!("tile_tokens {tile}")) && m.contains("1..=128"), "{m}")
            }
            other => panic!("tile {tile}: {:?}", other.map(|_| ())),
        }
    }
    // Nothing above reached the device: the poisoned output is untouched.
    assert!(fx.read(&head.out.view()).iter().all(|v| v.to_bits() == 0xFFFF));
}

/// The two passes' finish kernel on partials given to it: split 0 holds each token's projection
/// sums (the reference's), the other splits zeros, laid out `[T, S, 25]`; T = 37 (a partial group
/// of 16) at H = 1000 (4 splits, the last partial), in two runs of chunks. Its outputs are the
/// reference's: bit for bit on the CPU backend, within the bounds elsewhere.
fn the_finish_kernel_sums_the_partials_it_is_given(dev: &Device) {
    let fx = Fx::new(dev);
    let (hidden, t, pp) = (1000usize, 37usize, MhcPreParams::default());
    let (s, v) = (hidden.div_ceil(256), M + 1);
    let mut rng = Rng::new(17);
    let w = Weights::random(&mut rng, M, hidden, 3);
    let residual = rng.bf16s(t * N * hidden, 1.5);
    let sums = reference::pre_sums(&residual, &w.hc_fn, hidden).expect("sums");
    let mut partials = vec![0.0f32; t * s * v];
    for k in 0..t {
        partials[k * s * v..k * s * v + v].copy_from_slice(&sums[k * v..(k + 1) * v]);
    }
    let want = reference::pre(&residual, &w.hc_fn, &w.scale, &w.base, hidden, &pp).expect("reference");
    let f64s = common::pre_f64(&residual, &w, hidden, &pp);
    let pre = PreBufs::new(&fx, &residual, &w, hidden);
    let part = fx.up("partials", &partials);
    let module = dev.compile(holdfast_mhc::source()).expect("module");
    let kernel = module.kernel("mhc_pre_finish_n4").expect("kernel");
    let cfg =
        holdfast_hal::LaunchConfig { grid: (t.div_ceil(16) as u32, 2, 1), block: (256, 1, 1), shared_mem_bytes: 0 };
    fx.s.launch(
        &kernel,
        cfg,
        &[
            (&pre.residual).into(),
            (&pre.w[1]).into(),
            (&pre.w[2]).into(),
            (&pre.post).into(),
            (&pre.comb).into(),
            (&pre.li).into(),
            (&part).into(),
            (t as u32).into(),
            (hidden as u32).into(),
            pp.rms_eps.into(),
            pp.pre_eps.into(),
            pp.sinkhorn_eps.into(),
            pp.post_mult.into(),
            pp.sinkhorn_iters.into(),
        ],
    )
    .expect("launch");
    check_pre(dev, "finish from given partials", &pre.outputs(&fx), &want, &f64s);
}

holdfast_hal::device_suite!(
    hc_head_matches_its_reference_and_the_f64_spec,
    mhc_pre_matches_its_reference_and_the_f64_spec,
    mhc_post_matches_its_reference_and_the_f64_spec,
    fused_post_pre_matches_its_reference_the_f64_spec_and_post_then_pre,
    a_row_alone_equals_the_same_row_in_a_batch_of_1000,
    graph_replays_with_fresh_inputs_equal_eager_runs,
    zero_tokens_launch_nothing,
    in_place_post_and_fused_equal_out_of_place,
    unaligned_views_give_the_same_bits,
    misuse_is_a_precise_error_and_launches_nothing,
    both_projection_paths_match_the_reference_and_every_tile_gives_the_same_bits,
    hc_head_on_clusters_matches_the_reference_is_batch_invariant_and_replays_as_eager,
    the_finish_kernel_sums_the_partials_it_is_given,
);
