//! The mHC ops (`hc_head`, `mhc_pre` with 20 Sinkhorn iterations, `mhc_post`, the fused
//! post + pre) at V4-Flash's hidden size 4096 (T = 1 … 16384 tokens) and V4-Pro's 7168 (T = 1, 64,
//! 1024, 4096, 16384). Bytes per call are the
//! ops' own traffic model ([`MhcOp::bytes_moved`]: each input read once, each output written once,
//! weights once).

use holdfast_hal::{bf16, Buffer};
use holdfast_mhc::{
    HcHeadParams, HcHeadWeights, MhcConfig, MhcKernels, MhcOp, MhcOps, MhcPostInputs, MhcPreOutputs, MhcPreParams,
    MhcPreWeights, HC_MULT,
};

use crate::ctx::{Ctx, Scale};
use crate::error::Result;
use crate::report::{Bound, Row, Target};

/// Section name.
pub const SECTION: &str = "mhc";
const N: usize = HC_MULT;
const M: usize = N * (N + 2);

/// `(hidden, token counts)` measured.
pub fn shapes(scale: Scale) -> Vec<(usize, Vec<usize>)> {
    match scale {
        Scale::Full => vec![(4096, vec![1, 8, 64, 256, 1024, 4096, 16_384]), (7168, vec![1, 64, 1024, 4096, 16_384])],
        Scale::Quick => vec![(256, vec![1, 8])],
    }
}

/// The case name of `op` at `t` tokens (also the PyTorch key's case).
pub fn case(op: MhcOp, hidden: usize, t: usize) -> String {
    format!("{} H={hidden} T={t}", op.name())
}

/// The target of `op` at `t` tokens: at T ≥ 1024, `hc_head`, `mhc_post` and the fused op ≥ 70%
/// and `mhc_pre` ≥ 50% of copy bandwidth; at T = 1, `hc_head` ≤ 6 µs and `mhc_pre` ≤ 10 µs
/// (replayed from a graph, the row's time).
pub fn target(op: MhcOp, t: usize) -> Option<Target> {
    match op {
        MhcOp::HcHead | MhcOp::Post | MhcOp::FusedPostPre if t >= 1024 => Some(Target::FractionAtLeast(0.7)),
        MhcOp::Pre if t >= 1024 => Some(Target::FractionAtLeast(0.5)),
        MhcOp::HcHead if t == 1 => Some(Target::AtMost(6.0)),
        MhcOp::Pre if t == 1 => Some(Target::AtMost(10.0)),
        _ => None,
    }
}

fn weights(ctx: &Ctx, rows: usize, hidden: usize, scales: usize) -> Result<[Buffer<f32>; 3]> {
    let d = N * hidden;
    let w: Vec<f32> = (0..rows * d).map(|i| ((i % 97) as f32 - 48.0) / (48.0 * (d as f32).sqrt())).collect();
    Ok([
        ctx.dev.alloc_from_slice("fn", &w, true)?,
        ctx.dev.alloc_from_slice("scale", &vec![0.7f32; scales], true)?,
        ctx.dev.alloc_from_slice("base", &vec![0.1f32; rows], true)?,
    ])
}

/// The launches `op` makes at `t` tokens, for the row's note: each grid's blocks × threads and
/// dynamic shared memory, and whether they run on thread-block clusters (how many blocks the
/// grid holds is what bounds the ops whose tiles take turns on the device).
fn launches(ops: &MhcOps, op: MhcOp, t: usize) -> String {
    let grids: Vec<String> = ops
        .launch_configs(op, t)
        .iter()
        .map(|c| {
            let blocks = u64::from(c.grid.0) * u64::from(c.grid.1) * u64::from(c.grid.2);
            format!("{blocks} × {}, {} B shared", c.threads_per_block(), c.shared_mem_bytes)
        })
        .collect();
    let clusters = if ops.uses_clusters(op) { " (thread-block clusters)" } else { "" };
    format!("launches: {}{clusters}", grids.join(" then "))
}

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (h, ts) in shapes(ctx.scale) {
        // A hidden size none of whose cases is wanted allocates nothing.
        if MhcOp::ALL.iter().any(|&op| ts.iter().any(|&t| ctx.wants(&case(op, h, t)))) {
            rows.extend(run_hidden(ctx, h, &ts)?);
        }
    }
    Ok(rows)
}

fn run_hidden(ctx: &mut Ctx, h: usize, ts: &[usize]) -> Result<Vec<Row>> {
    let max_t = ts.iter().copied().max().unwrap_or(1);
    let kernels = MhcKernels::new(&ctx.dev)?;
    let ops = MhcOps::new(&ctx.dev, &kernels, MhcConfig { hc_mult: N, hidden: h, max_tokens: max_t })?;
    let d = N * h;
    let residual = ctx.filled::<bf16>("residual", max_t * d, 0x3c)?;
    let x = ctx.filled::<bf16>("x", max_t * h, 0x3d)?;
    let out_row = ctx.filled::<bf16>("out_row", max_t * h, 0)?;
    let out_residual = ctx.filled::<bf16>("out_residual", max_t * d, 0)?;
    let post = ctx.filled::<f32>("post", max_t * N, 0x3f)?;
    let comb = ctx.filled::<f32>("comb", max_t * N * N, 0x3e)?;
    let post_out = ctx.filled::<f32>("post_out", max_t * N, 0)?;
    let comb_out = ctx.filled::<f32>("comb_out", max_t * N * N, 0)?;
    let head_w = weights(ctx, N, h, 1)?;
    let pre_w = weights(ctx, M, h, 3)?;
    let (hf, hs, hb) = (head_w[0].view(), head_w[1].view(), head_w[2].view());
    let (pf, ps, pb) = (pre_w[0].view(), pre_w[1].view(), pre_w[2].view());
    let head = HcHeadWeights { hc_fn: &hf, scale: &hs, base: &hb };
    let pre = MhcPreWeights { hc_fn: &pf, scale: &ps, base: &pb };
    let s = &ctx.s;
    let mut rows = Vec::new();
    for op in MhcOp::ALL {
        for &t in ts {
            if !ctx.wants(&case(op, h, t)) {
                continue;
            }
            let r = residual.prefix(t * d)?;
            let row = out_row.prefix(t * h)?;
            let (po, co) = (post_out.prefix(t * N)?, comb_out.prefix(t * N * N)?);
            let outs = MhcPreOutputs { post: &po, comb: &co, layer_input: &row };
            let (xv, pv, cv) = (x.prefix(t * h)?, post.prefix(t * N)?, comb.prefix(t * N * N)?);
            let res_out = out_residual.prefix(t * d)?;
            let mut call = || -> Result<()> {
                match op {
                    MhcOp::HcHead => ops.hc_head(s, &r, &head, &HcHeadParams::default(), &row)?,
                    MhcOp::Pre => ops.pre(s, &r, &pre, &MhcPreParams::default(), &outs)?,
                    MhcOp::Post => ops.post(s, &xv, &r, &pv, &cv, &res_out)?,
                    MhcOp::FusedPostPre => {
                        let input = MhcPostInputs { x: &xv, residual: &r, post: &pv, comb: &cv };
                        ops.fused_post_pre(s, &input, &pre, &MhcPreParams::default(), &res_out, &outs)?
                    }
                }
                Ok(())
            };
            let mut row = ctx
                .kernel_row(SECTION, case(op, h, t), &mut call)?
                .with_bytes(op.bytes_moved(t, h))
                .with_bound(Bound::Copy);
            if let Some(tg) = target(op, t) {
                row = row.with_target(tg);
            }
            rows.push(row.with_note(launches(&ops, op, t)));
        }
    }
    Ok(rows)
}
