//! Graph costs: capture + instantiate + upload time per node, and the dispatcher's host time per
//! step (the mode and padded descriptor lookup every step makes).

use std::hint::black_box;
use std::time::Instant;

use holdfast_graph::{CaptureSizeConfig, CaptureSizes, Dispatcher, DispatcherConfig, GraphMode, LoraConfig, ModeSet};
use holdfast_hal::{demo_kernels, LaunchConfig};

use crate::ctx::Ctx;
use crate::error::{ReportError, Result};
use crate::report::Row;
use crate::timing::median;

/// Section name.
pub const SECTION: &str = "graph";

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let m = ctx.dev.compile(demo_kernels::source())?;
    let touch = m.kernel("hf_touch")?;
    let x = ctx.dev.alloc_zeroed::<f32>("graph.x", 1, true)?;
    let s = &ctx.s;
    let (k, samples) = if ctx.quick() { (50usize, 3usize) } else { (400, 20) };
    let mut v = Vec::new();
    for i in 0..=samples {
        let t = Instant::now();
        s.begin_capture("graph")?;
        for _ in 0..k {
            if let Err(e) = s.launch(&touch, LaunchConfig::for_elements(1, 32), &[(&x).into(), 1u32.into()]) {
                s.abort_capture()?;
                return Err(e.into());
            }
        }
        let g = s.end_capture()?;
        let us = t.elapsed().as_secs_f64() * 1e6 / g.node_count().max(1) as f64;
        drop(g);
        if i > 0 {
            v.push(us);
        }
    }
    let mut rows = vec![Row::timed(
        SECTION,
        format!("capture + instantiate + upload, per node ({k} kernels)"),
        median(&mut v),
        samples,
    )
    .with_note("host wall time from begin_capture to the uploaded graph, / nodes")];

    // The dispatcher of a DeepSeek-V4 serving config: FULL_AND_PIECEWISE, 256 seqs, 8192 tokens.
    let cfg = CaptureSizeConfig::new(GraphMode::FullAndPiecewise, 256, 8192);
    let sizes = CaptureSizes::build(&cfg)?;
    let mut d = Dispatcher::new(DispatcherConfig {
        capture_sizes: sizes,
        max_num_seqs: 256,
        lora: LoraConfig::Disabled,
        attention_is_splitting_op: true,
    })?;
    d.initialize_keys(GraphMode::FullAndPiecewise, 1)?;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let batches: Vec<(u32, bool)> = (0..1024)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1 + (x % 600) as u32, i % 2 == 0)
        })
        .collect();
    let calls = if ctx.quick() { 10_000 } else { 200_000 };
    let mut v = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for i in 0..calls {
            let (n, uniform) = batches[i & 1023];
            black_box(d.dispatch(black_box(n), uniform, false, 0, ModeSet::ALL, ModeSet::EMPTY))
                .map_err(|e| ReportError::Other(format!("dispatch: {e}")))?;
        }
        v.push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    rows.push(
        Row::timed(
            SECTION,
            format!("dispatch, host per step (FULL_AND_PIECEWISE, {} sizes)", d.capture_sizes().len()),
            median(&mut v),
            5,
        )
        .with_note("Dispatcher::dispatch over a fixed mix of 1..600 tokens"),
    );
    Ok(rows)
}
