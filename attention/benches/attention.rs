//! Host time per step to build all DeepSeek-V4 attention metadata of a decode step: stage +
//! upload of the common metadata, SWA (window 128), c128a (width from max_model_len: 1,048,576 →
//! 8192 on GPUs; 65,536 → 512 on the CPU backend so it runs quickly) and c4a (top-k 512), at 1, 8,
//! 64, 256 and 1024 decode rows, on the device named by `HOLDFAST_DEVICE` (default `cpu`).
//!
//! `builders_only` times the three builders on an already uploaded step (synchronised inside the
//! timed region). `host_build` times the host side only (on the CPU backend that includes the kernels, which run
//! inline); the stream is synchronised outside the timed region so the staging is never rewritten
//! under an in-flight copy. On GPUs `device_build` also times the device work, synchronising
//! inside the timed region.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use holdfast_attention::{
    BlockTableConfig, C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, StepInput, SwaBuilder,
};
use holdfast_hal::{BackendKind, Device, Stream};

const ROWS: [usize; 5] = [1, 8, 64, 256, 1024];
const WINDOW: usize = 128;
const TOPK: usize = 512;

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

struct Batch {
    qsl: Vec<i32>,
    seq: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    swa_bt: Vec<i32>,
    kv_bt: Vec<i32>,
    rows: usize,
}

impl Batch {
    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq,
            positions: &self.pos,
            slot_mapping: &self.slots,
            swa_block_table: &self.swa_bt,
            kv_block_table: &self.kv_bt,
            num_reqs_padded: self.rows,
            num_tokens_padded: self.rows,
        }
    }
}

fn batch(rng: &mut Rng, cfg: &CommonConfig, rows: usize) -> Batch {
    let seq: Vec<i32> = (0..rows).map(|_| 1 + rng.below(cfg.max_model_len as u64) as i32).collect();
    let table = |rng: &mut Rng, t: BlockTableConfig| -> Vec<i32> {
        (0..rows * t.max_blocks_per_seq).map(|_| rng.below(t.num_blocks as u64) as i32).collect()
    };
    Batch {
        qsl: (0..=rows as i32).collect(),
        pos: seq.iter().map(|s| s - 1).collect(),
        slots: (0..rows as i32).collect(),
        swa_bt: table(rng, cfg.swa_table),
        kv_bt: table(rng, cfg.kv_table),
        seq,
        rows,
    }
}

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
        let cfg = CommonConfig {
            max_num_batched_tokens: 1024,
            max_num_seqs: 1024,
            max_model_len,
            num_spec_tokens: 0,
            swa_table: BlockTableConfig { block_size: 64, max_blocks_per_seq: max_model_len / 64, num_blocks: 1 << 20 },
            kv_table: BlockTableConfig {
                block_size: 256,
                max_blocks_per_seq: max_model_len / 256,
                num_blocks: 1 << 18,
            },
        };
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
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

    /// One step: stage + upload + the three builds (what the model runner does per decode step).
    fn step(&mut self, b: &Batch) -> usize {
        self.common.stage(&b.input()).expect("stage");
        self.common.upload(&self.s).expect("upload") + self.builds()
    }
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
    let mut rng = Rng(42);
    let mut g = c.benchmark_group(format!("attention_metadata/{name}"));
    g.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for rows in ROWS {
        let batches: Vec<Batch> = (0..4).map(|_| batch(&mut rng, &cfg, rows)).collect();
        let syncs = rig.dev.stats().host_syncs;
        let launches = rig.step(&batches[0]);
        assert_eq!(rig.dev.stats().host_syncs, syncs, "a build never syncs");
        eprintln!("rows {rows}: {launches} launches/copies per step, 0 host syncs");
        rig.s.synchronize().expect("sync");
        g.bench_with_input(BenchmarkId::new("host_build", rows), &rows, |bch, _| {
            bch.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for i in 0..iters as usize {
                    let t = Instant::now();
                    black_box(rig.step(&batches[i % batches.len()]));
                    total += t.elapsed();
                    rig.s.synchronize().expect("sync");
                }
                total
            })
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
                bch.iter_custom(|iters| {
                    let t = Instant::now();
                    for i in 0..iters as usize {
                        black_box(rig.step(&batches[i % batches.len()]));
                        rig.s.synchronize().expect("sync");
                    }
                    t.elapsed()
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
