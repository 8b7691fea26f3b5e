//! Host time per step to build all DeepSeek-V4 attention metadata of a decode step: stage +
//! upload of the common metadata, SWA (window 128), c128a (width from max_model_len: 1,048,576 →
//! 8192 on GPUs; 65,536 → 512 on the CPU backend so it runs quickly) and c4a (top-k 512), at 1, 8,
//! 64, 256 and 1024 decode rows, on the device named by `HOLDFAST_DEVICE` (default `cpu`).
//!
//! The block tables live on the device: every request's rows are written once before the
//! measurements, and a decode step appends a block to a table only when a request's new token
//! starts one. `stage_upload/decode` times stage + upload of such a step; `stage_upload/admit_N`
//! a step in which `N = max(1, rows / 64)` requests are newly admitted with long contexts (their
//! whole rows written, the rare case). `builders_only` times the three builders on an already
//! uploaded step (synchronised inside the timed region). `host_build` times the host side of a
//! whole decode step (on the CPU backend that includes the kernels, which run inline); the stream
//! is synchronised outside the timed region so the staging is never rewritten under an in-flight
//! copy. On GPUs `device_build` also times the device work, synchronising inside the timed region.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use holdfast_attention::sim::{admitted, DecodeBatch, XorShift};
use holdfast_attention::{
    BlockTableConfig, C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, SwaBuilder,
};
use holdfast_hal::{BackendKind, Device, Stream};

const ROWS: [usize; 5] = [1, 8, 64, 256, 1024];
const WINDOW: usize = 128;
const TOPK: usize = 512;

struct Rig {
    dev: Device,
    s: Stream,
    common: CommonAttentionMetadata,
    swa: SwaBuilder,
    c128a: C128aBuilder,
    c4a: C4aBuilder,
    topk: holdfast_hal::Buffer<i32>,
}

impl Rig {
    fn new(dev: Device) -> Rig {
        let max_model_len = if dev.backend() == BackendKind::Cpu { 65_536 } else { 1 << 20 };
        let (t, n) = (1024, 1024);
        let swa_table =
            BlockTableConfig { block_size: 64, max_blocks_per_seq: max_model_len / 64, num_blocks: 1 << 20 };
        let kv_table =
            BlockTableConfig { block_size: 256, max_blocks_per_seq: max_model_len / 256, num_blocks: 1 << 18 };
        let cfg = CommonConfig {
            max_num_batched_tokens: t,
            max_num_seqs: n,
            max_model_len,
            num_spec_tokens: 0,
            swa_table,
            kv_table,
            // Decode growth, plus whole rows for the admission step.
            max_table_updates: swa_table.growth_cells(t, n)
                + kv_table.growth_cells(t, n)
                + admitted(n) * (swa_table.max_blocks_per_seq + kv_table.max_blocks_per_seq),
        };
        let mut rng = XorShift::new(0x9e37_79b9_7f4a_7c15);
        let topk_h: Vec<i32> =
            (0..cfg.max_num_batched_tokens * TOPK).map(|_| rng.below((max_model_len / 4) as u64) as i32).collect();
        Rig {
            s: dev.create_stream().expect("stream"),
            common: CommonAttentionMetadata::new(&dev, cfg).expect("common"),
            swa: SwaBuilder::new(&dev, &cfg, WINDOW).expect("swa"),
            c128a: C128aBuilder::new(&dev, &cfg).expect("c128a"),
            c4a: C4aBuilder::new(&dev, &cfg, TOPK).expect("c4a"),
            topk: dev.alloc_from_slice("indexer.topk", &topk_h, true).expect("topk"),
            dev,
        }
    }

    /// The three builds of the staged, uploaded step.
    fn builds(&self) -> usize {
        self.swa.build(&self.s, &self.common).expect("swa").stats.launches
            + self.c128a.build(&self.s, &self.common).expect("c128a").stats.launches
            + self.c4a.build(&self.s, &self.common, &self.topk.view()).expect("c4a").stats.launches
    }

    /// Stage + upload of the batch's current step.
    fn stage_upload(&mut self, b: &DecodeBatch) -> usize {
        self.common.stage(&b.input()).expect("stage");
        self.common.upload(&self.s).expect("upload")
    }

    /// One step: stage + upload + the three builds (what the model runner does per decode step).
    fn step(&mut self, b: &DecodeBatch) -> usize {
        self.stage_upload(b) + self.builds()
    }
}

/// Times `op` over `iters` steps of `b`, each advanced first (untimed) with `admit` admissions;
/// the stream is synchronised outside the timed region unless `sync_inside`.
fn timed_steps(
    rig: &mut Rig,
    b: &mut DecodeBatch,
    admit: usize,
    iters: u64,
    sync_inside: bool,
    op: fn(&mut Rig, &DecodeBatch) -> usize,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        b.advance(admit, &mut rig.common).expect("advance");
        let t = Instant::now();
        black_box(op(rig, b));
        if sync_inside {
            rig.s.synchronize().expect("sync");
        }
        total += t.elapsed();
        rig.s.synchronize().expect("sync");
    }
    total
}

fn bench(c: &mut Criterion) {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    let dev = match Device::open(&name) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: device `{name}` is not usable here ({e})");
            return;
        }
    };
    let gpu = dev.backend() != BackendKind::Cpu;
    let mut rig = Rig::new(dev);
    let cfg = *rig.common.config();
    let mut g = c.benchmark_group(format!("attention_metadata/{name}"));
    g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for rows in ROWS {
        rig.common.release_all_table_rows();
        let mut b = DecodeBatch::new(cfg, 42 + rows as u64, rows);
        b.fill(&mut rig.common, &rig.s).expect("fill");
        b.advance(0, &mut rig.common).expect("advance");
        let syncs = rig.dev.stats().host_syncs;
        let launches = rig.step(&b);
        assert_eq!(rig.dev.stats().host_syncs, syncs, "a build never syncs");
        eprintln!("rows {rows}: {launches} launches/copies per step, 0 host syncs");
        rig.s.synchronize().expect("sync");
        let n = admitted(rows);
        // Stage + upload alone: a steady decode step, and a step that admits `n` requests.
        g.bench_with_input(BenchmarkId::new("stage_upload/decode", rows), &rows, |bch, _| {
            bch.iter_custom(|iters| timed_steps(&mut rig, &mut b, 0, iters, false, Rig::stage_upload))
        });
        g.bench_with_input(BenchmarkId::new(format!("stage_upload/admit_{n}"), rows), &rows, |bch, _| {
            bch.iter_custom(|iters| timed_steps(&mut rig, &mut b, n, iters, false, Rig::stage_upload))
        });
        g.bench_with_input(BenchmarkId::new("host_build", rows), &rows, |bch, _| {
            bch.iter_custom(|iters| timed_steps(&mut rig, &mut b, 0, iters, false, Rig::step))
        });
        // The three builders alone on an uploaded step (no staging, no upload), synchronised
        // inside the timed region.
        g.bench_with_input(BenchmarkId::new("builders_only", rows), &rows, |bch, _| {
            bch.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    black_box(rig.builds());
                    rig.s.synchronize().expect("sync");
                }
                t.elapsed()
            })
        });
        if gpu {
            g.bench_with_input(BenchmarkId::new("device_build", rows), &rows, |bch, _| {
                bch.iter_custom(|iters| timed_steps(&mut rig, &mut b, 0, iters, true, Rig::step))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
