//! Attention metadata build per decode step: the common metadata's stage + upload, then the SWA
//! (window 128), c128a and c4a (top-k 512) builders; host µs of each, host syncs per builder per
//! step (counted by the HAL), and on GPUs the device µs of upload + the three builds (events).

use std::time::Instant;

use holdfast_attention::{
    BlockTableConfig, C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, StepInput, SwaBuilder,
};
use holdfast_hal::Buffer;

use crate::ctx::Ctx;
use crate::error::Result;
use crate::report::{Row, Target};
use crate::timing::median;

/// Section name.
pub const SECTION: &str = "metadata";
/// Most host µs per builder per step.
pub const HOST_TARGET_US: f64 = 10.0;
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
    fn new(rng: &mut Rng, cfg: &CommonConfig, rows: usize) -> Batch {
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

/// Decode rows per step measured.
pub fn rows(ctx: &Ctx) -> Vec<usize> {
    if ctx.quick() {
        vec![1, 8]
    } else {
        vec![1, 8, 64, 256, 1024]
    }
}

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let max_rows = rows(ctx).into_iter().max().unwrap_or(1);
    let max_model_len = if ctx.quick() { 4096 } else { 1 << 20 };
    let cfg = CommonConfig {
        max_num_batched_tokens: max_rows,
        max_num_seqs: max_rows,
        max_model_len,
        num_spec_tokens: 0,
        swa_table: BlockTableConfig { block_size: 64, max_blocks_per_seq: max_model_len / 64, num_blocks: 1 << 20 },
        kv_table: BlockTableConfig { block_size: 256, max_blocks_per_seq: max_model_len / 256, num_blocks: 1 << 18 },
    };
    let dev = ctx.dev.clone();
    let s = &ctx.s;
    let mut common = CommonAttentionMetadata::new(&dev, cfg)?;
    let swa = SwaBuilder::new(&dev, &cfg, WINDOW)?;
    let c128a = C128aBuilder::new(&dev, &cfg)?;
    let c4a = C4aBuilder::new(&dev, &cfg, TOPK)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let topk_h: Vec<i32> = (0..max_rows * TOPK).map(|_| rng.below((max_model_len / 4) as u64) as i32).collect();
    let topk: Buffer<i32> = dev.alloc_from_slice("indexer.topk", &topk_h, true)?;
    let tv = topk.view();
    let steps = if ctx.quick() { 5 } else { 50 };
    let gpu = ctx.gpu();
    let mut out = Vec::new();
    for rows in rows(ctx) {
        let batches: Vec<Batch> = (0..4).map(|_| Batch::new(&mut rng, &cfg, rows)).collect();
        // [stage + upload, swa, c128a, c4a] host µs; syncs per builder; device µs.
        let mut host: [Vec<f64>; 4] = Default::default();
        let mut syncs = [0u64; 3];
        let mut device = Vec::new();
        for i in 0..steps + 1 {
            let b = &batches[i % batches.len()];
            let t = Instant::now();
            common.stage(&b.input())?;
            let t_stage = t.elapsed();
            // The device window starts after the host-only staging.
            if gpu {
                ctx.clock_start()?;
            }
            let t = Instant::now();
            common.upload(s)?;
            let t_up = t_stage + t.elapsed();
            let mut per = [0f64; 3];
            for (j, p) in per.iter_mut().enumerate() {
                let before = dev.stats().host_syncs;
                let t = Instant::now();
                std::hint::black_box(match j {
                    0 => swa.build(s, &common)?.stats.launches,
                    1 => c128a.build(s, &common)?.stats.launches,
                    _ => c4a.build(s, &common, &tv)?.stats.launches,
                });
                *p = t.elapsed().as_secs_f64() * 1e6;
                if i > 0 {
                    syncs[j] += dev.stats().host_syncs - before;
                }
            }
            let dev_us = if gpu { Some(ctx.clock_stop()?) } else { None };
            s.synchronize()?;
            if i == 0 {
                continue; // warm-up step
            }
            host[0].push(t_up.as_secs_f64() * 1e6);
            for j in 0..3 {
                host[j + 1].push(per[j]);
            }
            device.extend(dev_us);
        }
        let names = ["stage + upload", "swa build", "c128a build", "c4a build"];
        for (j, name) in names.iter().enumerate() {
            let mut r = Row::timed(SECTION, format!("{name}, host, rows={rows}"), median(&mut host[j]), steps);
            if j > 0 {
                r = r.with_target(Target::AtMost(HOST_TARGET_US));
                if !gpu {
                    r = r.with_note("CPU backend: includes the kernels, which run inline");
                }
            }
            out.push(r);
        }
        for (j, name) in ["swa", "c128a", "c4a"].iter().enumerate() {
            out.push(
                Row::value(
                    SECTION,
                    format!("{name} host syncs per step, rows={rows}"),
                    syncs[j] as f64 / steps as f64,
                    "",
                )
                .with_portable_target(Target::AtMost(0.0)),
            );
        }
        if gpu {
            out.push(
                Row::timed(SECTION, format!("upload + 3 builds, device, rows={rows}"), median(&mut device), steps)
                    .with_note("events around upload and the builds (includes host enqueue gaps)"),
            );
        }
    }
    Ok(out)
}
