//! Attention metadata build per decode step: the common metadata's stage + upload, then the SWA
//! (window 128), c128a and c4a (top-k 512) builders; host µs of each, host syncs per builder per
//! step (counted by the HAL), and on GPUs the device µs of upload + the three builds (events).
//!
//! The block tables live on the device (written once per request): a steady decode step stages
//! each request's next token and appends a block to a table only when that token starts one. The
//! rarer step where `n` requests are newly admitted (each with a long context, so its whole rows
//! are written) is timed on its own: `n = max(1, rows / 64)`.

use std::time::Instant;

use holdfast_attention::{
    BlockTableConfig, BlockTableUpdates, C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, StepInput,
    SwaBuilder, TableKind,
};
use holdfast_hal::{Buffer, Stream};

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

/// Requests admitted in the admission step of a batch of `rows`.
fn admitted(rows: usize) -> usize {
    (rows / 64).max(1)
}

/// A decode batch of `rows` requests on table rows `0..rows`, one token each per step.
struct Decode {
    cfg: CommonConfig,
    rng: Rng,
    qsl: Vec<i32>,
    seq: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    table_rows: Vec<u32>,
    /// Each request's blocks, per table (what its device rows hold).
    blocks: [Vec<Vec<i32>>; 2],
    updates: BlockTableUpdates,
}

impl Decode {
    fn new(cfg: CommonConfig, seed: u64, rows: usize) -> Decode {
        let mut d = Decode {
            cfg,
            rng: Rng(seed),
            qsl: (0..=rows as i32).collect(),
            seq: Vec::new(),
            pos: vec![0; rows],
            slots: (0..rows as i32).collect(),
            table_rows: (0..rows as u32).collect(),
            blocks: [vec![Vec::new(); rows], vec![Vec::new(); rows]],
            updates: BlockTableUpdates::new(),
        };
        for r in 0..rows {
            d.fresh(r);
        }
        d
    }

    fn tables(&self) -> [(TableKind, BlockTableConfig); 2] {
        [(TableKind::Swa, self.cfg.swa_table), (TableKind::Kv, self.cfg.kv_table)]
    }

    /// Request `r` becomes a fresh one with a random context (its rows are to be written whole).
    fn fresh(&mut self, r: usize) {
        // Room for the steps that follow.
        let s = 1 + self.rng.below(self.cfg.max_model_len as u64 - 256) as i32;
        if r < self.seq.len() {
            self.seq[r] = s;
        } else {
            self.seq.push(s);
        }
        for (k, (_, t)) in self.tables().into_iter().enumerate() {
            let need = (s as usize).div_ceil(t.block_size);
            let ids = (0..need).map(|_| 1 + self.rng.below(t.num_blocks as u64 - 1) as i32).collect();
            self.blocks[k][r] = ids;
        }
    }

    /// Writes every request's whole rows into `common`'s tables: steps without requests, each
    /// at most `max_table_updates` cells.
    fn fill(&mut self, common: &mut CommonAttentionMetadata, s: &Stream) -> Result<()> {
        let rows = self.seq.len();
        let mut r = 0;
        while r < rows {
            self.updates.clear();
            while r < rows {
                let cells = self.blocks[0][r].len() + self.blocks[1][r].len();
                if self.updates.cells() + cells > self.cfg.max_table_updates {
                    break;
                }
                for (k, (kind, _)) in self.tables().into_iter().enumerate() {
                    self.updates.push(kind, r, 0, &self.blocks[k][r]);
                }
                r += 1;
            }
            let input = StepInput {
                query_start_loc: &[0],
                seq_lens: &[],
                positions: &[],
                slot_mapping: &[],
                table_rows: &[],
                table_updates: &self.updates,
                num_reqs_padded: 1,
                num_tokens_padded: 1,
            };
            common.stage(&input)?;
            common.upload(s)?;
            s.synchronize()?;
        }
        Ok(())
    }

    /// The next decode step: every request decodes one token; a table gets the request's next
    /// block when that token starts one. Requests `0..admit` are replaced by fresh ones (their
    /// table rows released and written whole).
    fn advance(&mut self, admit: usize, common: &mut CommonAttentionMetadata) -> Result<()> {
        self.updates.clear();
        for r in 0..self.seq.len() {
            if r < admit {
                common.release_table_row(r)?;
                self.fresh(r);
                for (k, (kind, _)) in self.tables().into_iter().enumerate() {
                    self.updates.push(kind, r, 0, &self.blocks[k][r]);
                }
            } else {
                self.seq[r] += 1;
                let p = self.seq[r] as usize - 1;
                for (k, (kind, t)) in self.tables().into_iter().enumerate() {
                    if p.is_multiple_of(t.block_size) {
                        let id = 1 + self.rng.below(t.num_blocks as u64 - 1) as i32;
                        self.blocks[k][r].push(id);
                        self.updates.push(kind, r, p / t.block_size, &[id]);
                    }
                }
            }
            self.pos[r] = self.seq[r] - 1;
        }
        Ok(())
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq,
            positions: &self.pos,
            slot_mapping: &self.slots,
            table_rows: &self.table_rows,
            table_updates: &self.updates,
            num_reqs_padded: self.seq.len(),
            num_tokens_padded: self.seq.len(),
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
    let swa_table = BlockTableConfig { block_size: 64, max_blocks_per_seq: max_model_len / 64, num_blocks: 1 << 20 };
    let kv_table = BlockTableConfig { block_size: 256, max_blocks_per_seq: max_model_len / 256, num_blocks: 1 << 18 };
    let cfg = CommonConfig {
        max_num_batched_tokens: max_rows,
        max_num_seqs: max_rows,
        max_model_len,
        num_spec_tokens: 0,
        swa_table,
        kv_table,
        // Decode growth, plus whole rows for the admission step.
        max_table_updates: swa_table.growth_cells(max_rows, max_rows)
            + kv_table.growth_cells(max_rows, max_rows)
            + admitted(max_rows) * (swa_table.max_blocks_per_seq + kv_table.max_blocks_per_seq),
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
        common.release_all_table_rows();
        let mut batch = Decode::new(cfg, rng.below(u64::MAX) | 1, rows);
        batch.fill(&mut common, s)?;
        // Steady decode steps, then admission steps. [stage + upload, swa, c128a, c4a] host µs;
        // syncs per builder; device µs.
        let n = admitted(rows);
        for admit in [0, n] {
            let mut host: [Vec<f64>; 4] = Default::default();
            let mut syncs = [0u64; 3];
            let mut device = Vec::new();
            for i in 0..steps + 1 {
                batch.advance(admit, &mut common)?;
                let t = Instant::now();
                common.stage(&batch.input())?;
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
            let step = if admit == 0 { String::new() } else { format!(", {admit} admitted") };
            out.push(
                Row::timed(SECTION, format!("stage + upload{step}, host, rows={rows}"), median(&mut host[0]), steps)
                    .with_note(if admit == 0 {
                        "decode step: a block appended only where a token starts one"
                    } else {
                        "whole block-table rows of the admitted requests written"
                    }),
            );
            if admit > 0 {
                if gpu {
                    out.push(Row::timed(
                        SECTION,
                        format!("upload + 3 builds{step}, device, rows={rows}"),
                        median(&mut device),
                        steps,
                    ));
                }
                continue;
            }
            let names = ["swa build", "c128a build", "c4a build"];
            for (j, name) in names.iter().enumerate() {
                let mut r = Row::timed(SECTION, format!("{name}, host, rows={rows}"), median(&mut host[j + 1]), steps)
                    .with_target(Target::AtMost(HOST_TARGET_US));
                if !gpu {
                    r = r.with_note("CPU backend: includes the kernels, which run inline");
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
    }
    Ok(out)
}
