//! Ragged sparse attention at decode: SWA window 128 plus the compressed entries of a 64K or 1M
//! context (c128a: 512 or 8192 entries per row; c4a: top-k 512 / 1024), head_dim 512, 64 and 128
//! heads, batch 1–256. Throughput is the unique KV bytes each step must read (rows × entries ×
//! head_dim × 2), so criterion's GB/s compares directly with the copy bandwidth, which the
//! `copy` case measures in the same run (a 1 GiB device-to-device copy, read + write bytes).
//! On a GPU the tensor-core kernel runs every shape and the portable kernel a few of them
//! (`portable/...`), side by side. `HOLDFAST_DEVICE` picks the device (default `cpu`, where only
//! the smallest shapes run).

use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use holdfast_attention::{AttentionKernel, RaggedKv, SparseAttention};
use holdfast_hal::{bf16, BackendKind, Device};

fn bench(c: &mut Criterion) {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let dev = Device::open(&name).unwrap_or_else(|e| panic!("HOLDFAST_DEVICE={name}: {e}"));
    let gpu = dev.backend() != BackendKind::Cpu;
    let s = dev.create_stream().expect("stream");
    let d = 512usize;
    let window = 128usize;
    let mut g = c.benchmark_group(format!("attention_kernels/{}", dev.backend()));
    if gpu {
        let n = 1usize << 29; // 1 GiB of bf16 each way
        let (a, b) =
            (dev.alloc_zeroed::<bf16>("copy.src", n, true).expect("a"), dev.alloc::<bf16>("copy.dst", n).expect("b"));
        g.throughput(Throughput::Bytes(4 * n as u64));
        g.bench_function("copy/1GiB", |bch| {
            bch.iter_custom(|iters| {
                s.synchronize().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    s.copy(&a.view(), &b.view()).expect("copy");
                }
                s.synchronize().expect("sync");
                t.elapsed()
            })
        });
    }
    let shapes: Vec<(usize, usize, &str, usize)> = if gpu {
        let mut v = Vec::new();
        for heads in [64usize, 128] {
            for (tag, extra) in
                [("c128a_64k", 512usize), ("c128a_1m", 8192), ("c4a_top512", 512), ("c4a_top1024", 1024)]
            {
                for batch in [1usize, 8, 64, 256] {
                    v.push((heads, batch, tag, extra));
                }
            }
        }
        v
    } else {
        vec![(64, 1, "c128a_64k", 512), (64, 8, "c128a_64k", 512)]
    };
    for (heads, batch, tag, extra) in shapes {
        let k = SparseAttention::new(&dev, heads, d).expect("kernel");
        let portable = (gpu && heads == 64 && batch != 8 && (tag == "c128a_64k" || tag == "c4a_top1024"))
            .then(|| SparseAttention::with_kernel(&dev, heads, d, AttentionKernel::Portable).expect("portable"));
        let slots = (batch * (window + extra)).max(1);
        // Every row reads its own distinct slots: the bytes below are really moved.
        let cache: Vec<bf16> = (0..slots * d).map(|i| bf16::from_f32(((i % 97) as f32 - 48.0) / 64.0)).collect();
        let cache = dev.alloc_from_slice("cache", &cache, true).expect("cache");
        let main_idx: Vec<i32> =
            (0..batch).flat_map(|r| (0..window).map(move |j| (r * (window + extra) + j) as i32)).collect();
        let extra_idx: Vec<i32> =
            (0..batch).flat_map(|r| (0..extra).map(move |j| (r * (window + extra) + window + j) as i32)).collect();
        let mp: Vec<i32> = (0..=batch).map(|r| (r * window) as i32).collect();
        let ep: Vec<i32> = (0..=batch).map(|r| (r * extra) as i32).collect();
        let up = |l: &str, v: &[i32]| dev.alloc_from_slice(l, v, true).expect("upload");
        let (mi, mpb, ei, epb) =
            (up("main_idx", &main_idx), up("main_indptr", &mp), up("extra_idx", &extra_idx), up("extra_indptr", &ep));
        let q = dev.alloc_from_slice("q", &vec![bf16::from_f32(0.01); batch * heads * d], true).expect("q");
        let out = dev.alloc_zeroed::<bf16>("out", batch * heads * d, true).expect("out");
        let sink = dev.alloc_from_slice("sink", &vec![0.0f32; heads], true).expect("sink");
        let (cv, miv, mpv, eiv, epv) = (cache.view(), mi.view(), mpb.view(), ei.view(), epb.view());
        let main = RaggedKv { cache: &cv, indices: &miv, indptr: &mpv };
        let ex = RaggedKv { cache: &cv, indices: &eiv, indptr: &epv };
        let bytes = (batch * (window + extra) * d * 2) as u64;
        g.throughput(Throughput::Bytes(bytes));
        let kernels =
            [(if k.uses_tensor_cores() { "tensor_cores" } else { "auto" }, Some(&k)), ("portable", portable.as_ref())];
        for (kind, k) in kernels.into_iter().filter_map(|(n, k)| k.map(|k| (n, k))) {
            g.bench_function(BenchmarkId::new(format!("{kind}/h{heads}_{tag}"), batch), |b| {
                b.iter_custom(|iters| {
                    s.synchronize().expect("sync");
                    let t = Instant::now();
                    for _ in 0..iters {
                        k.attend(&s, &q.view(), &main, Some(&ex), &sink.view(), &out.view(), 0.04).expect("attend");
                    }
                    s.synchronize().expect("sync");
                    t.elapsed()
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_millis(1500))
        .sample_size(10);
    targets = bench
}
criterion_main!(benches);
