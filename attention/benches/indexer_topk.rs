//! The c4a indexer's top-k alone (`hf_dsv4_indexer_topk` over a filled logit workspace): 64 rows
//! of 65536 candidates (a 256K-token context) with top-512 and top-1024, for logits spread over
//! a few octaves and for logits crowded into one octave (more of its rows need several digit
//! levels). Throughput is in rows (tokens) per second. Each case runs with one segment per row
//! (what the indexer uses) and with four (each segment's top-k, then the merge: what
//! `Indexer::auto_topk_segments` gives for 64 rows on a 132-SM device), side by side. `HOLDFAST_DEVICE` picks the device (default `cpu`, where only a tiny
//! shape runs).

use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use holdfast_attention::indexer::topk_launch_config;
use holdfast_attention::indexer_source;
use holdfast_hal::{BackendKind, Device};

/// xorshift64 in [0, 1).
fn unit(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 24) as f32
}

fn bench(c: &mut Criterion) {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let dev = Device::open(&name).unwrap_or_else(|e| panic!("HOLDFAST_DEVICE={name}: {e}"));
    let gpu = dev.backend() != BackendKind::Cpu;
    let s = dev.create_stream().expect("stream");
    let module = dev.compile(indexer_source()).expect("compile");
    let kernel = module.kernel("hf_dsv4_indexer_topk").expect("kernel");
    let merge = module.kernel("hf_dsv4_indexer_topk_merge").expect("merge kernel");
    let (rows, width, ks): (usize, usize, &[usize]) = if gpu { (64, 65_536, &[512, 1024]) } else { (4, 4096, &[512]) };
    let mut g = c.benchmark_group(format!("indexer_topk/{}", dev.backend()));
    g.throughput(Throughput::Elements(rows as u64));
    for (tag, spread) in [("spread", true), ("one_octave", false)] {
        let mut st = 0x2545_f491_4f6c_dd1d_u64;
        // Spread: a bell of sums of uniforms over [0, 8); one octave: uniform in [1, 2).
        let scores: Vec<f32> = (0..rows * width)
            .map(|_| if spread { (0..4).map(|_| 2.0 * unit(&mut st)).sum() } else { 1.0 + unit(&mut st) })
            .collect();
        let scores = dev.alloc_from_slice("bench.scores", &scores, true).expect("scores");
        // Every row sees all `width` entries: n_t = (pos + 1) / 4.
        let pos = dev.alloc_from_slice("bench.pos", &vec![4 * width as i32 - 1; rows], true).expect("pos");
        let zeros = dev.alloc_from_slice("bench.zeros", &vec![0i32; rows], true).expect("zeros");
        for (&k, segs) in ks.iter().flat_map(|k| [1usize, 4].map(move |s| (k, s))) {
            let out = dev.alloc_zeroed::<i32>("bench.out", rows * k, true).expect("out");
            let seg_out = dev.alloc_zeroed::<i32>("bench.seg_out", rows * segs * k, true).expect("seg_out");
            let scalars = [(rows as u32).into(), (width as u32).into(), (k as u32).into(), (segs as u32).into()];
            let (sc, p, z, o, so) = (scores.view(), pos.view(), zeros.view(), out.view(), seg_out.view());
            let mut args = vec![(&sc).into(), (&p).into(), (&z).into(), (&z).into(), (&o).into(), (&so).into()];
            args.extend(scalars.clone());
            let mut margs = vec![(&sc).into(), (&p).into(), (&z).into(), (&z).into(), (&so).into(), (&o).into()];
            margs.extend(scalars);
            g.bench_function(BenchmarkId::new(format!("{tag}_n{width}_top{k}_segs{segs}"), rows), |b| {
                b.iter_custom(|iters| {
                    s.synchronize().expect("sync");
                    let t = Instant::now();
                    for _ in 0..iters {
                        s.launch(&kernel, topk_launch_config(rows * segs), &args).expect("launch");
                        if segs > 1 {
                            s.launch(&merge, topk_launch_config(rows), &margs).expect("merge");
                        }
                    }
                    s.synchronize().expect("sync");
                    t.elapsed()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
