//! Dense matmul benches on the device named by `HOLDFAST_DEVICE` (default `cpu`).
//!
//! On a GPU: `x [t, 4096] · w [4096, 4096]ᵀ` at t ∈ {1, 8, 64, 256} and the vocab head
//! `x [t, 4096] · w [129280, 4096]ᵀ` (f32 logits) at t ∈ {1, 64}. On the CPU backend the same cases
//! run at the `tiny` model's shapes (n = k = 256, vocab 1024; t ≤ 64) so a run stays quick.
//!
//! Timing uses `iter_custom` with the stream synchronised inside the timed region, so it measures
//! the device work, not the enqueue. Throughput is reported as elements = floating-point operations
//! (2 · t · n · k per launch); each case also prints the bytes of weights it streams. Where the
//! device has tensor cores, every case runs twice, side by side: `tensor_cores` (the default
//! kernels) and `portable` (the SIMT chain kernels), plus the decode shapes of a DeepSeek-V4 Flash
//! layer whose n is small (`wq_a` 1024 × 4096, `wkv` 512 × 4096) at t = 1 and 8.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use holdfast_hal::{bf16, BackendKind, Buffer, Device, Element, Stream};
use holdfast_kernels::{DenseKernels, Gemm, MatmulKernel};

fn device() -> Device {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    match Device::open(&name) {
        Ok(d) => d,
        Err(e) => panic!("HOLDFAST_DEVICE={name}: {e}"),
    }
}

/// `(label, ts, n, k, f32 output)` per case.
fn cases(dev: &Device) -> Vec<(&'static str, Vec<usize>, usize, usize, bool)> {
    if dev.backend() == BackendKind::Cpu {
        vec![("square", vec![1, 8, 64], 256, 256, false), ("vocab_head", vec![1, 64], 1024, 256, true)]
    } else {
        vec![
            ("square", vec![1, 8, 64, 256], 4096, 4096, false),
            ("wq_a", vec![1, 8], 1024, 4096, false),
            ("wkv", vec![1, 8], 512, 4096, false),
            ("vocab_head", vec![1, 64], 129_280, 4096, true),
        ]
    }
}

fn filled<T: Element>(dev: &Device, s: &Stream, label: &str, len: usize, byte: u8) -> Buffer<T> {
    let b = dev.alloc_persistent::<T>(label, len).expect("alloc");
    s.memset(&b.view(), byte).expect("memset");
    b
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
    let auto = DenseKernels::new(&dev).expect("kernels");
    let mut kinds = vec![("portable", DenseKernels::with_matmul(&dev, MatmulKernel::Portable).expect("kernels"))];
    if auto.uses_tensor_cores() {
        kinds.insert(0, ("tensor_cores", auto));
    }
    for (label, ts, n, k, f32_out) in cases(&dev) {
        let max_t = ts.iter().copied().max().unwrap_or(1);
        // 0x3c3c as bf16 is about 0.0115: finite sums at any k.
        let x = filled::<bf16>(&dev, &s, "x", max_t * k, 0x3c);
        let w = filled::<bf16>(&dev, &s, "w", n * k, 0x3c);
        let y = filled::<bf16>(&dev, &s, "y", max_t * n, 0);
        let yf = filled::<f32>(&dev, &s, "yf", max_t * n, 0);
        let mut g = c.benchmark_group(format!("matmul/{label}/n={n}/k={k}"));
        g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
        for (&t, (kind, dk)) in ts.iter().flat_map(|t| kinds.iter().map(move |k| (t, k))) {
            let shape = Gemm::new(t, n, k);
            let (xv, yv, yfv) =
                (x.prefix(t * k).expect("view"), y.prefix(t * n).expect("view"), yf.prefix(t * n).expect("view"));
            let launch = if dk.matmul_uses_tensor_cores(&xv, &w.view(), shape) {
                shape.mma_launch_config()
            } else {
                shape.launch_config()
            };
            println!("dense matmul: {label} {kind} t={t} n={n} k={k} weight_bytes={} launch={launch:?}", n * k * 2);
            g.throughput(Throughput::Elements(2 * shape.macs()));
            g.bench_with_input(BenchmarkId::new(*kind, t), &t, |b, _| {
                b.iter_custom(|iters| {
                    timed(iters, &s, || {
                        if f32_out {
                            dk.matmul_f32(&s, &xv, &w.view(), &yfv, shape).expect("matmul_f32");
                        } else {
                            dk.matmul(&s, &xv, &w.view(), &yv, shape).expect("matmul");
                        }
                    })
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
