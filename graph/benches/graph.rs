//! Benches for graph mode selection (`Dispatcher::dispatch`, `PaddingTable::pad`) and for the
//! graph runner over the synthetic ~100-kernel forward of `tests/common`.
//!
//! Dispatch and padding are host-only, so plain `iter` timing is right (nothing to synchronise).
//! Inputs cycle through a fixed pseudo-random batch mix so the branch predictor sees a realistic
//! spread. The runner benches use the device named by `HOLDFAST_DEVICE` (default `cpu`): first a
//! one-shot start-up report (every default capture size for max_num_seqs 256 / 8192 tokens, in
//! PIECEWISE and in FULL: capture seconds and graph memory against the largest single graph),
//! then replay steps timed with `iter_custom`, synchronising inside the timed region.

use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use holdfast_graph::{
    BatchDescriptor, CaptureSizeConfig, CaptureSizes, Dispatcher, DispatcherConfig, GraphMode, GraphRunner, LoraConfig,
    ModeSet, RunnerConfig, RuntimeMode,
};
use holdfast_hal::Device;

#[path = "../tests/common/mod.rs"]
mod common;

/// 1024 token counts in `1..=600` (some above the 512 maximum), uniform every other step.
fn batches() -> Vec<(u32, bool)> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..1024)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + (x % 600) as u32, i % 2 == 0)
        })
        .collect()
}

fn dsv4_dispatcher() -> Dispatcher {
    let cfg = CaptureSizeConfig::new(GraphMode::FullAndPiecewise, 256, 8192);
    let sizes = match CaptureSizes::build(&cfg) {
        Ok(s) => s,
        Err(e) => panic!("sizes: {e}"),
    };
    let config = DispatcherConfig {
        capture_sizes: sizes,
        max_num_seqs: 256,
        lora: LoraConfig::Disabled,
        attention_is_splitting_op: true,
    };
    let mut d = match Dispatcher::new(config) {
        Ok(d) => d,
        Err(e) => panic!("dispatcher: {e}"),
    };
    if let Err(e) = d.initialize_keys(GraphMode::FullAndPiecewise, 1) {
        panic!("keys: {e}");
    }
    d
}

fn bench(c: &mut Criterion) {
    let inputs = batches();
    let mut d = dsv4_dispatcher();
    let mut i = 0usize;
    c.bench_function("dispatch/full_and_piecewise_512", |b| {
        b.iter(|| {
            let (n, uniform) = inputs[i & 1023];
            i = i.wrapping_add(1);
            black_box(d.dispatch(black_box(n), black_box(uniform), false, 0, ModeSet::ALL, ModeSet::EMPTY))
        })
    });

    let table = d.padding_table().clone();
    let mut j = 0usize;
    c.bench_function("padding_table/pad_512", |b| {
        b.iter(|| {
            let (n, _) = inputs[j & 1023];
            j = j.wrapping_add(1);
            black_box(table.pad(black_box(n)))
        })
    });
}

const MAX_SEQS: u32 = 256;
const MAX_TOKENS: u32 = 8192;

fn device() -> Device {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    Device::open(&name).unwrap_or_else(|e| panic!("HOLDFAST_DEVICE={name}: {e}"))
}

/// A runner for `mode` with every default capture size captured, and the dispatcher.
fn captured_runner(
    dev: &Device,
    mode: GraphMode,
) -> (GraphRunner<common::Synthetic>, Dispatcher, holdfast_hal::Stream) {
    let s = dev.create_stream().expect("stream");
    let fwd = common::Synthetic::new(dev, MAX_TOKENS as usize, common::Bug::None).expect("forward");
    let d = common::dispatcher(mode, MAX_SEQS, MAX_TOKENS).expect("dispatcher");
    let arena = fwd.arena.clone();
    let mut r = GraphRunner::new(fwd, arena, &d, RunnerConfig::default()).expect("runner");
    r.capture_all(&s, |_, _, _| {}).expect("capture");
    (r, d, s)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Start-up report: one capture of every key per mode (not repeated: it is a start-up cost).
fn capture_report(dev: &Device) {
    for mode in [GraphMode::Piecewise, GraphMode::Full] {
        let t = Instant::now();
        let (r, d, _s) = captured_runner(dev, mode);
        let wall = t.elapsed().as_secs_f64();
        let st = r.stats();
        let arena = r.arena();
        println!(
            "runner/capture {mode} on {}: {} sizes (max {}), {} graphs, capture {:.3} s (wall incl. setup {:.3} s, {} \
             warm-ups); graph memory {:.3} MiB distinct vs largest single graph {:.3} MiB (arena {:.3} MiB, \
             workspace {:.3} MiB); per-graph sum would be {:.3} MiB",
            dev.info().name,
            d.capture_sizes().len(),
            d.capture_sizes().max(),
            st.graphs,
            st.capture_seconds,
            wall,
            st.warmup_runs,
            mib(st.graph_bytes),
            mib(st.largest_graph_bytes),
            mib(arena.total_bytes() as u64),
            mib(arena.bytes(holdfast_graph::WORKSPACE).unwrap_or(0) as u64),
            mib(st.graph_retained_bytes_sum),
        );
    }
}

fn bench_runner(c: &mut Criterion) {
    let dev = device();
    capture_report(&dev);
    let mut g = c.benchmark_group("runner");
    for mode in [GraphMode::Piecewise, GraphMode::Full] {
        let (mut r, mut d, s) = captured_runner(&dev, mode);
        for n in [1u32, 64, 512] {
            let (m, desc) = d.dispatch(n, false, false, 0, ModeSet::ALL, ModeSet::EMPTY).expect("dispatch");
            assert_ne!(m, RuntimeMode::None, "{n} tokens have a graph");
            let x = vec![0.5f32; n as usize];
            g.bench_with_input(BenchmarkId::new(format!("replay_{mode}"), n), &n, |b, _| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for i in 0..iters {
                        r.forward_mut().set_step(x.clone(), i as u32);
                        r.execute(&s, m, &desc).expect("replay");
                    }
                    s.synchronize().expect("sync");
                    t.elapsed()
                })
            });
            if mode == GraphMode::Full {
                let eager = BatchDescriptor::unpadded(n);
                g.bench_with_input(BenchmarkId::new("eager", n), &n, |b, _| {
                    b.iter_custom(|iters| {
                        let t = Instant::now();
                        for i in 0..iters {
                            r.forward_mut().set_step(x.clone(), i as u32);
                            r.execute(&s, RuntimeMode::None, &eager).expect("eager");
                        }
                        s.synchronize().expect("sync");
                        t.elapsed()
                    })
                });
            }
        }
        assert_eq!(r.stats().recaptures, 0);
    }
    g.finish();
}

criterion_group!(benches, bench, bench_runner);
criterion_main!(benches);
