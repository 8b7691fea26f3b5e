//! mHC op benches on the device named by `HOLDFAST_DEVICE` (default `cpu`): each op at
//! H ∈ {4096, 7168} and T ∈ {1, 8, 64, 256, 1024, 4096, 16384} on a GPU (T ≤ 64 on the CPU
//! backend), plus `hc_head` at T = 1 replayed from a graph (its latency target is inside a graph).
//! On a device with tensor cores the split-reduction ops run on both paths side by side
//! (`<op>/H=<h>/tensor_cores/<T>` and `…/portable/<T>`); `HOLDFAST_MHC_TILE=N` forces the tile.
//!
//! Timing uses `iter_custom` with the stream synchronised inside the timed region, so it measures
//! the device work, not the enqueue. Each case prints the bytes the op moves
//! ([`MhcOp::bytes_moved`]) and reports them as criterion throughput: divide by the device's
//! copy bandwidth for the fraction reached.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use holdfast_hal::{bf16, Buffer, Device, Element, Stream};
use holdfast_mhc::{
    HcHeadParams, HcHeadWeights, MhcConfig, MhcKernels, MhcOp, MhcOps, MhcPostInputs, MhcPreOutputs, MhcPreParams,
    MhcPreWeights, MhcProjection, HC_MULT,
};

const N: usize = HC_MULT;
const M: usize = N * (N + 2);

fn device() -> Device {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    match Device::open(&name) {
        Ok(d) => d,
        Err(e) => panic!("HOLDFAST_DEVICE={name}: {e}"),
    }
}

fn tokens(dev: &Device) -> Vec<usize> {
    if dev.backend() == holdfast_hal::BackendKind::Cpu {
        vec![1, 8, 64]
    } else {
        vec![1, 8, 64, 256, 1024, 4096, 16_384]
    }
}

/// Every buffer the four ops touch, sized for `max_t` tokens.
struct Bufs {
    residual: Buffer<bf16>,
    x: Buffer<bf16>,
    out_row: Buffer<bf16>,
    out_residual: Buffer<bf16>,
    post: Buffer<f32>,
    comb: Buffer<f32>,
    post_out: Buffer<f32>,
    comb_out: Buffer<f32>,
    head_w: [Buffer<f32>; 3],
    pre_w: [Buffer<f32>; 3],
}

fn filled<T: Element>(dev: &Device, s: &Stream, label: &str, len: usize, byte: u8) -> Buffer<T> {
    let b = dev.alloc_persistent::<T>(label, len).expect("alloc");
    s.memset(&b.view(), byte).expect("memset");
    b
}

fn weights(dev: &Device, rows: usize, hidden: usize, scales: usize) -> [Buffer<f32>; 3] {
    let d = N * hidden;
    let w: Vec<f32> = (0..rows * d).map(|i| ((i % 97) as f32 - 48.0) / (48.0 * (d as f32).sqrt())).collect();
    [
        dev.alloc_from_slice("fn", &w, true).expect("fn"),
        dev.alloc_from_slice("scale", &vec![0.7f32; scales], true).expect("scale"),
        dev.alloc_from_slice("base", &vec![0.1f32; rows], true).expect("base"),
    ]
}

impl Bufs {
    fn new(dev: &Device, s: &Stream, hidden: usize, max_t: usize) -> Self {
        let (d, h) = (N * hidden, hidden);
        Bufs {
            residual: filled(dev, s, "residual", max_t * d, 0x3c),
            x: filled(dev, s, "x", max_t * h, 0x3d),
            out_row: filled(dev, s, "out_row", max_t * h, 0),
            out_residual: filled(dev, s, "out_residual", max_t * d, 0),
            post: filled(dev, s, "post", max_t * N, 0x3f),
            comb: filled(dev, s, "comb", max_t * N * N, 0x3e),
            post_out: filled(dev, s, "post_out", max_t * N, 0),
            comb_out: filled(dev, s, "comb_out", max_t * N * N, 0),
            head_w: weights(dev, N, hidden, 1),
            pre_w: weights(dev, M, hidden, 3),
        }
    }

    fn run(&self, ops: &MhcOps, s: &Stream, op: MhcOp, t: usize) {
        let h = ops.config().hidden;
        let d = N * h;
        let r = self.residual.prefix(t * d).expect("view");
        let row = self.out_row.prefix(t * h).expect("view");
        let (po, co) = (self.post_out.prefix(t * N).expect("v"), self.comb_out.prefix(t * N * N).expect("v"));
        let outs = MhcPreOutputs { post: &po, comb: &co, layer_input: &row };
        let (pf, ps, pb) = (self.pre_w[0].view(), self.pre_w[1].view(), self.pre_w[2].view());
        let pw = MhcPreWeights { hc_fn: &pf, scale: &ps, base: &pb };
        let res = match op {
            MhcOp::HcHead => {
                let (f, sc, b) = (self.head_w[0].view(), self.head_w[1].view(), self.head_w[2].view());
                ops.hc_head(s, &r, &HcHeadWeights { hc_fn: &f, scale: &sc, base: &b }, &HcHeadParams::default(), &row)
            }
            MhcOp::Pre => ops.pre(s, &r, &pw, &MhcPreParams::default(), &outs),
            MhcOp::Post => {
                let (x, p, c) = (
                    self.x.prefix(t * h).expect("v"),
                    self.post.prefix(t * N).expect("v"),
                    self.comb.prefix(t * N * N).expect("v"),
                );
                ops.post(s, &x, &r, &p, &c, &self.out_residual.prefix(t * d).expect("v"))
            }
            MhcOp::FusedPostPre => {
                let (x, p, c) = (
                    self.x.prefix(t * h).expect("v"),
                    self.post.prefix(t * N).expect("v"),
                    self.comb.prefix(t * N * N).expect("v"),
                );
                let input = MhcPostInputs { x: &x, residual: &r, post: &p, comb: &c };
                ops.fused_post_pre(
                    s,
                    &input,
                    &pw,
                    &MhcPreParams::default(),
                    &self.out_residual.prefix(t * d).expect("v"),
                    &outs,
                )
            }
        };
        res.expect("op");
    }
}

fn timed(iters: u64, s: &Stream, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    s.synchronize().expect("sync");
    start.elapsed()
}

fn bench(c: &mut Criterion) {
    let dev = device();
    let s = dev.create_stream().expect("stream");
    let kernels = MhcKernels::new(&dev).expect("kernels");
    let ts = tokens(&dev);
    let max_t = ts.iter().copied().max().unwrap_or(1);
    // `HOLDFAST_MHC_TILE=N` forces the projection tile (a tuning knob; the bits do not change).
    let tile = std::env::var("HOLDFAST_MHC_TILE").ok().map(|v| v.parse::<usize>().expect("HOLDFAST_MHC_TILE"));
    for hidden in [4096usize, 7168] {
        let cfg = MhcConfig { hc_mult: N, hidden, max_tokens: max_t };
        let with = |p: MhcProjection| {
            MhcOps::new(&dev, &kernels, cfg).expect("ops").with_projection(p).with_tile_tokens(tile).expect("tile")
        };
        // Both paths side by side where the device has tensor cores (the default takes, per op,
        // the one that measured faster); the portable path alone elsewhere; and `hc_head` on
        // thread-block clusters (the default's choice) where the device has them.
        let tensor = with(MhcProjection::TensorCores);
        let portable = with(MhcProjection::Portable);
        let clusters = with(MhcProjection::Auto);
        let bufs = Bufs::new(&dev, &s, hidden, max_t);
        for op in MhcOp::ALL {
            let mut g = c.benchmark_group(format!("{}/H={hidden}", op.name()));
            g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
            let mut variants = vec![];
            if tensor.uses_tensor_cores(op) {
                variants.push(("tensor_cores", &tensor));
            }
            variants.push(("portable", &portable));
            if clusters.uses_clusters(op) {
                variants.push(("clusters", &clusters));
            }
            for &t in &ts {
                let bytes = op.bytes_moved(t, hidden);
                g.throughput(Throughput::Bytes(bytes));
                for &(name, o) in &variants {
                    println!(
                        "mhc bytes: op={} H={hidden} T={t} path={name} bytes={bytes} launches={:?}",
                        op.name(),
                        o.launch_configs(op, t)
                    );
                    g.bench_with_input(BenchmarkId::new(name, t), &t, |b, &t| {
                        b.iter_custom(|iters| timed(iters, &s, || bufs.run(o, &s, op, t)))
                    });
                }
            }
            g.finish();
        }

        // hc_head at T = 1 from a graph: the decode-step latency target.
        let ops = with(MhcProjection::Auto);
        bufs.run(&ops, &s, MhcOp::HcHead, 1);
        s.begin_capture("hc_head T=1").expect("capture");
        bufs.run(&ops, &s, MhcOp::HcHead, 1);
        let graph = s.end_capture().expect("end capture");
        let mut g = c.benchmark_group(format!("hc_head_graph/H={hidden}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        g.throughput(Throughput::Bytes(MhcOp::HcHead.bytes_moved(1, hidden)));
        g.bench_function("1", |b| b.iter_custom(|iters| timed(iters, &s, || graph.replay(&s).expect("replay"))));
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
