//! Attention metadata build per decode step: the common metadata's stage + upload, then the SWA
//! (window 128), c128a and c4a (top-k 512) builders; host µs of each, host syncs per builder per
//! step (counted by the HAL), and on GPUs the device µs of upload + the three builds: between
//! events around the eager calls (so the host's enqueue gaps count), and from a graph of them
//! replayed with a fresh step staged each time (the device work alone; the row that carries the
//! bytes and the target). In the graph the c128a and c4a builds run on branches forked after the
//! upload, concurrently with the SWA build. Four more graphs time its parts: the upload alone,
//! the upload with the c128a build (the critical path; the rest of the step is what the SWA and
//! c4a builds beside it add), the upload with the c4a build, and the upload with the SWA and
//! c128a builds (what the model runs at a step's start: its c4a builds follow each c4a layer's
//! indexer).
//!
//! The block tables live on the device (written once per request): a steady decode step stages
//! each request's next token and appends a block to a table only when that token starts one. The
//! rarer step where `n` requests are newly admitted (each with a long context, so its whole rows
//! are written) is timed on its own: `n = max(1, rows / 64)`.

use std::time::Instant;

use holdfast_attention::sim::{admitted, DecodeBatch, XorShift};
use holdfast_attention::{
    c128a_max_compressed, BlockTableConfig, C128aBuilder, C4aBuilder, CommonAttentionMetadata, CommonConfig, StepInput,
    SwaBuilder, C128A_SHARED_BLOCKS_PER_UNIT,
};
use holdfast_hal::{Buffer, Stream, View};

use crate::ctx::Ctx;
use crate::error::Result;
use crate::report::{Bound, Row, Target};
use crate::timing::median;

/// Section name.
pub const SECTION: &str = "metadata";
/// Most host µs per builder per step.
pub const HOST_TARGET_US: f64 = 10.0;
/// vLLM's host µs per step of its ROCm DeepSeek-V4 metadata path on an H200 (a builder's
/// dense → ragged kernel, the `.item()` sync that sizes it and the copies into graph buffers,
/// measured at 170–210 µs whatever the batch): the lower end.
pub const VLLM_STEP_US: f64 = 170.0;
/// Least ratio of [`VLLM_STEP_US`] to our host µs per builder per step (`170 / 15 ≈ 11 µs`, the
/// bound that [`HOST_TARGET_US`] rounds down to 10).
pub const VLLM_SPEEDUP_TARGET: f64 = 15.0;
const WINDOW: usize = 128;
const TOPK: usize = 512;

/// The device traffic of one decode step's upload and three builds, bytes: what the builders
/// must read and write for `input`'s rows, by their output layout. Per row at position `p`: SWA
/// reads the block-table entries of its window and writes its dense `[WINDOW]` row and
/// `min(p + 1, WINDOW)` ragged entries; c128a reads the table entry of every other compressed
/// entry (two per 256-token block) and writes its dense row of `width` entries and
/// `n = min((p + 1) / 128, width)` ragged ones; c4a reads its top-k row once (its one-pass build
/// holds the row in registers from the count to the pack) and one table entry per selected index,
/// and writes them ragged; each writes a length and an indptr entry; the upload copies the
/// per-request and per-token fields and the update cells.
pub fn step_bytes(input: &StepInput<'_>, cfg: &CommonConfig) -> u64 {
    let width = c128a_max_compressed(cfg.max_model_len) as u64;
    let (w, k, i) = (WINDOW as u64, TOPK as u64, 4u64);
    let mut bytes = (input.seq_lens.len() as u64 * 3 + input.positions.len() as u64 * 3) * i
        + input.table_updates.cells() as u64 * 2 * i;
    for &p in input.positions {
        let p = p.max(0) as u64;
        let swa = (p + 1).min(w);
        bytes += (swa.div_ceil(cfg.swa_table.block_size as u64) + 1) * i + (w + swa + 2) * i;
        let n = ((p + 1) / 128).min(width);
        bytes += n.div_ceil(2) * i + (width + n + 2) * i;
        let kept = k.min((p + 1) / 4);
        bytes += k * i + kept * i + (kept + 2) * i;
    }
    bytes
}

/// Which parts of a step a graph holds: the upload always, then the builds named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Parts {
    /// The upload and the three builds (the row with the target).
    All,
    /// The upload alone.
    Upload,
    /// The upload and the c128a build (the critical path of `All`).
    UploadC128a,
    /// The upload and the c4a build.
    UploadC4a,
    /// The upload, the SWA and the c128a builds: what the model runs at the start of a step (its
    /// c4a builds follow each c4a layer's indexer).
    StepStart,
}

impl Parts {
    fn c128a(self) -> bool {
        matches!(self, Parts::All | Parts::UploadC128a | Parts::StepStart)
    }
    fn c4a(self) -> bool {
        matches!(self, Parts::All | Parts::UploadC4a)
    }
    fn swa(self) -> bool {
        matches!(self, Parts::All | Parts::StepStart)
    }
}

/// The three builders of a step, the top-k rows the c4a one reads, and two side streams.
struct Builds<'a> {
    swa: &'a SwaBuilder,
    c128a: &'a C128aBuilder,
    c4a: &'a C4aBuilder,
    topk: &'a View<i32>,
    side: [&'a Stream; 2],
}

impl Builds<'_> {
    /// Upload of the staged step, then the builds of `parts`. While `s` captures, the c128a and
    /// c4a builds go on branches forked after the upload and joined at the end, so the graph runs
    /// the three concurrently (they only share the uploaded inputs); eagerly all run on `s`.
    fn enqueue(&self, s: &Stream, common: &CommonAttentionMetadata, parts: Parts) -> Result<()> {
        common.upload(s)?;
        if parts == Parts::Upload {
            return Ok(());
        }
        let forked = s.is_capturing();
        let [a, b] = if forked { self.side } else { [s, s] };
        let (with_c128a, with_c4a) = (parts.c128a(), parts.c4a());
        if with_c128a {
            if forked {
                s.fork_capture(a)?;
            }
            self.c128a.build(a, common)?;
        }
        if with_c4a {
            if forked {
                s.fork_capture(b)?;
            }
            self.c4a.build(b, common, self.topk)?;
        }
        if parts.swa() {
            self.swa.build(s, common)?;
        }
        if forked && with_c4a {
            s.join_capture(b)?;
        }
        if forked && with_c128a {
            s.join_capture(a)?;
        }
        Ok(())
    }
}

/// `steps` decode steps of `batch` replayed from one graph of the upload and the builds (captured
/// at the batch's padded size after an eager warm-up step), each step advanced on the host first,
/// then staged, its oversized table updates (if any) applied eagerly and the graph launched, as
/// the FULL runner does. Per step: (device µs of the replay, host µs of stage + launch).
fn replayed(
    ctx: &Ctx,
    common: &mut CommonAttentionMetadata,
    batch: &mut DecodeBatch,
    builds: &Builds<'_>,
    parts: Parts,
    steps: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let s = &ctx.s;
    let stage = |common: &mut CommonAttentionMetadata, batch: &DecodeBatch| -> Result<()> {
        common.stage(&batch.input())?;
        common.apply_bulk_table_updates(s)?;
        Ok(())
    };
    batch.advance(0, common)?;
    stage(common, batch)?;
    builds.enqueue(s, common, parts)?;
    s.synchronize()?;
    batch.advance(0, common)?;
    stage(common, batch)?;
    s.begin_capture("metadata step")?;
    builds.enqueue(s, common, parts)?;
    let graph = s.end_capture()?;
    // Capture ran nothing: the staged step runs in the first replay.
    graph.replay(s)?;
    s.synchronize()?;
    let (mut device, mut host) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
    for _ in 0..steps {
        batch.advance(0, common)?;
        let t = Instant::now();
        stage(common, batch)?;
        let staged = t.elapsed();
        ctx.clock_start()?;
        let t = Instant::now();
        graph.replay(s)?;
        host.push((staged + t.elapsed()).as_secs_f64() * 1e6);
        device.push(ctx.clock_stop()?);
        s.synchronize()?;
    }
    Ok((device, host))
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
    // The graph runs the c4a build beside the c128a one (`Builds::enqueue`).
    let c128a = C128aBuilder::new(&dev, &cfg)?.with_grid_cap(Some(C128A_SHARED_BLOCKS_PER_UNIT))?;
    let c4a = C4aBuilder::new(&dev, &cfg, TOPK)?;
    let mut rng = XorShift::new(0x9e37_79b9_7f4a_7c15);
    let topk_h: Vec<i32> = (0..max_rows * TOPK).map(|_| rng.below((max_model_len / 4) as u64) as i32).collect();
    let topk: Buffer<i32> = dev.alloc_from_slice("indexer.topk", &topk_h, true)?;
    let tv = topk.view();
    let side = [dev.create_stream()?, dev.create_stream()?];
    let steps = if ctx.quick() { 5 } else { 50 };
    let gpu = ctx.gpu();
    let mut out = Vec::new();
    for rows in rows(ctx) {
        common.release_all_table_rows();
        let mut batch = DecodeBatch::new(cfg, rng.below(u64::MAX) | 1, rows);
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
            let mut slowest = 0f64;
            for (j, name) in names.iter().enumerate() {
                let us = median(&mut host[j + 1]);
                slowest = slowest.max(us);
                let mut r = Row::timed(SECTION, format!("{name}, host, rows={rows}"), us, steps)
                    .with_target(Target::AtMost(HOST_TARGET_US));
                if !gpu {
                    r = r.with_note("CPU backend: includes the kernels, which run inline");
                }
                out.push(r);
            }
            if gpu {
                out.push(
                    Row::value(
                        SECTION,
                        format!("vLLM's {VLLM_STEP_US:.0} µs over our slowest builder, rows={rows}"),
                        VLLM_STEP_US / slowest,
                        "×",
                    )
                    .with_target(Target::AtLeast(VLLM_SPEEDUP_TARGET))
                    .with_note("per builder per step, as the ≤ 10 µs target"),
                );
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
                        .with_note("events around the eager upload and builds (includes host enqueue gaps)"),
                );
                let builds = Builds { swa: &swa, c128a: &c128a, c4a: &c4a, topk: &tv, side: [&side[0], &side[1]] };
                let (mut graph_us, mut graph_host) =
                    replayed(ctx, &mut common, &mut batch, &builds, Parts::All, steps)?;
                let host_us = median(&mut graph_host);
                out.push(
                    Row::timed(SECTION, format!("stage + graph launch, host, rows={rows}"), host_us, steps)
                        .with_note("the step's whole metadata host cost when it rides in the FULL graph"),
                );
                out.push(Row::value(
                    SECTION,
                    format!("vLLM's {VLLM_STEP_US:.0} µs over stage + graph launch, rows={rows}"),
                    VLLM_STEP_US / host_us,
                    "×",
                ));
                let mut r = Row::timed(
                    SECTION,
                    format!("upload + 3 builds, graph replay, device, rows={rows}"),
                    median(&mut graph_us),
                    steps,
                )
                .with_note(
                    "one graph: upload, then the three builds on parallel branches; a fresh step staged each time",
                )
                .with_bytes(step_bytes(&batch.input(), &cfg))
                .with_bound(Bound::Copy);
                if rows == 1024 {
                    // Within 2× of the bytes at the copy rate.
                    r = r.with_target(Target::FractionAtLeast(0.5));
                }
                out.push(r);
                // Its parts: the upload alone, the upload with the c128a build (the critical
                // path; the rest is what the SWA and c4a builds beside it add), the upload with
                // the c4a build, and the upload with the SWA and c128a builds (the step's start
                // in the model).
                for (parts, what) in [
                    (Parts::Upload, "upload"),
                    (Parts::UploadC128a, "upload + c128a build"),
                    (Parts::UploadC4a, "upload + c4a build"),
                    (Parts::StepStart, "upload + swa + c128a builds"),
                ] {
                    let (mut us, _) = replayed(ctx, &mut common, &mut batch, &builds, parts, steps)?;
                    out.push(
                        Row::timed(
                            SECTION,
                            format!("{what}, graph replay, device, rows={rows}"),
                            median(&mut us),
                            steps,
                        )
                        .with_note("a part of the row above, in a graph of its own"),
                    );
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use holdfast_attention::BlockTableUpdates;
    use holdfast_hal::Device;

    #[test]
    fn every_part_of_the_step_graph_replays_as_its_eager_enqueue() -> Result<()> {
        let dev = Device::cpu()?;
        let s = dev.create_stream()?;
        let table = |bs: usize| BlockTableConfig { block_size: bs, max_blocks_per_seq: 4096 / bs, num_blocks: 512 };
        let (swa_table, kv_table) = (table(64), table(256));
        let cfg = CommonConfig {
            max_num_batched_tokens: 8,
            max_num_seqs: 8,
            max_model_len: 4096,
            num_spec_tokens: 0,
            swa_table,
            kv_table,
            max_table_updates: 8 * (swa_table.max_blocks_per_seq + kv_table.max_blocks_per_seq),
        };
        let mut common = CommonAttentionMetadata::new(&dev, cfg)?;
        let (swa, c128a, c4a) =
            (SwaBuilder::new(&dev, &cfg, WINDOW)?, C128aBuilder::new(&dev, &cfg)?, C4aBuilder::new(&dev, &cfg, 8)?);
        let topk: Buffer<i32> =
            dev.alloc_from_slice("topk", &(0..64).map(|i| i % 9 - 1).collect::<Vec<i32>>(), true)?;
        let tv = topk.view();
        let side = [dev.create_stream()?, dev.create_stream()?];
        let builds = Builds { swa: &swa, c128a: &c128a, c4a: &c4a, topk: &tv, side: [&side[0], &side[1]] };
        let mut batch = DecodeBatch::new(cfg, 11, 8);
        batch.fill(&mut common, &s)?;
        for parts in [Parts::All, Parts::Upload, Parts::UploadC128a, Parts::UploadC4a, Parts::StepStart] {
            batch.advance(0, &mut common)?;
            common.stage(&batch.input())?;
            common.apply_bulk_table_updates(&s)?;
            builds.enqueue(&s, &common, parts)?;
            // The same views every build hands out.
            let dense = c128a.build(&s, &common)?.decode.map(|d| d.indices);
            let ragged4 = c4a.build(&s, &common, &tv)?.decode.map(|d| d.ragged.indptr);
            let want = (
                s.copy_to_host_sync(&common.positions()?)?,
                dense.as_ref().map(|v| s.copy_to_host_sync(v)).transpose()?,
                ragged4.as_ref().map(|v| s.copy_to_host_sync(v)).transpose()?,
            );
            s.begin_capture("parts")?;
            builds.enqueue(&s, &common, parts)?;
            let g = s.end_capture()?;
            c128a.fill_outputs(&s, -7)?;
            c4a.fill_outputs(&s, -7)?;
            g.replay(&s)?;
            s.synchronize()?;
            let got = s.copy_to_host_sync(&common.positions()?)?;
            assert_eq!(got, want.0, "{parts:?}: uploaded positions");
            let built = |v: &View<i32>, w: &Vec<i32>, expected: bool, what: &str| -> Result<()> {
                let got = s.copy_to_host_sync(v)?;
                if expected {
                    assert_eq!(&got, w, "{parts:?}: {what}");
                } else {
                    assert!(got.iter().all(|&x| x == -7), "{parts:?}: no {what}");
                }
                Ok(())
            };
            if let (Some(v), Some(w)) = (dense.as_ref(), want.1.as_ref()) {
                built(v, w, parts.c128a(), "c128a rows")?;
            }
            if let (Some(v), Some(w)) = (ragged4.as_ref(), want.2.as_ref()) {
                built(v, w, parts.c4a(), "c4a indptr")?;
            }
        }
        Ok(())
    }

    #[test]
    fn step_bytes_follow_the_builders_layout() {
        let table = |bs: usize| BlockTableConfig { block_size: bs, max_blocks_per_seq: 1 << 14, num_blocks: 1 << 20 };
        let cfg = CommonConfig {
            max_num_batched_tokens: 4,
            max_num_seqs: 4,
            max_model_len: 1 << 20,
            num_spec_tokens: 0,
            swa_table: table(64),
            kv_table: table(256),
            max_table_updates: 64,
        };
        let upd = BlockTableUpdates::new();
        let input = |pos: &'static [i32], seq: &'static [i32]| StepInput {
            query_start_loc: &[0, 1],
            seq_lens: seq,
            positions: pos,
            slot_mapping: &[0],
            table_rows: &[0],
            table_updates: &upd,
            num_reqs_padded: 1,
            num_tokens_padded: 1,
        };
        // Position 0: SWA 1 entry (2 table reads), c128a none, c4a none; dense rows written whole.
        let fields = 6 * 4;
        let swa = 2 * 4 + (128 + 1 + 2) * 4;
        let c128a = (8192 + 2) * 4;
        let c4a = 512 * 4 + 2 * 4;
        assert_eq!(step_bytes(&input(&[0], &[1]), &cfg), (fields + swa + c128a + c4a) as u64);
        // Deep in a 1M context the dense c128a row and its ragged copy dominate.
        let deep = step_bytes(&input(&[1 << 19], &[(1 << 19) + 1]), &cfg);
        assert!(deep > 8192 * 4 + 4096 * 4 && deep < 80_000, "{deep}");
    }
}
