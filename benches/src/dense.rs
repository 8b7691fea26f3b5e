//! The dense ops at the model's shapes: every GEMM of a V4-Flash layer (q/kv projections, grouped
//! output projection, FFN, indexer query) and the LM head, at t = 1, 8, 64, 256 tokens, plus
//! RMSNorm over the hidden size.
//!
//! Bytes per GEMM: `x`, `w` and `y` once each (`2·t·g·k + 2·g·n·k + 2·t·g·n`, the output 4 bytes
//! per element for the f32 LM head); FLOPs `2·t·g·n·k`. The fraction is against the roofline:
//! the faster of moving the bytes at copy bandwidth and doing the FLOPs at the GEMM ceiling.

use holdfast_hal::{bf16, Buffer};
use holdfast_kernels::{DenseKernels, Gemm};
use holdfast_model::ModelConfig;

use crate::ctx::{Ctx, Scale};
use crate::error::Result;
use crate::report::{Bound, Row};

/// Section name.
pub const SECTION: &str = "dense";

/// One GEMM of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    /// The weight's name.
    pub name: &'static str,
    /// The shape.
    pub gemm: Gemm,
    /// f32 output (the LM head) rather than bf16.
    pub f32_out: bool,
}

impl GemmShape {
    /// The case name (also the PyTorch key's case).
    pub fn case(&self) -> String {
        let g = self.gemm;
        if g.groups > 1 {
            format!("gemm {} t={} n={} k={} groups={}", self.name, g.t, g.n, g.k, g.groups)
        } else {
            format!("gemm {} t={} n={} k={}", self.name, g.t, g.n, g.k)
        }
    }

    /// Bytes moved (module docs).
    pub fn bytes(&self) -> u64 {
        let g = self.gemm;
        let (t, n, k, gr) = (g.t as u64, g.n as u64, g.k as u64, g.groups as u64);
        2 * t * gr * k + 2 * gr * n * k + if self.f32_out { 4 } else { 2 } * t * gr * n
    }
}

/// The model config whose shapes are used.
pub fn config(scale: Scale) -> ModelConfig {
    match scale {
        Scale::Full => ModelConfig::flash_slice(),
        Scale::Quick => ModelConfig::tiny(),
    }
}

/// Token counts measured.
pub fn tokens(scale: Scale) -> Vec<usize> {
    match scale {
        Scale::Full => vec![1, 8, 64, 256],
        Scale::Quick => vec![1, 8],
    }
}

/// Every GEMM shape at every token count.
pub fn gemm_shapes(scale: Scale) -> Vec<GemmShape> {
    let c = config(scale);
    let (h, heads, d, q, gq, r, f) = (
        c.hidden_size,
        c.num_attention_heads,
        c.head_dim,
        c.q_lora_rank,
        c.o_groups,
        c.o_lora_rank,
        c.moe_intermediate_size,
    );
    let mut v = Vec::new();
    for t in tokens(scale) {
        let g = |name, n, k, groups| GemmShape { name, gemm: Gemm { t, n, k, groups }, f32_out: false };
        v.push(g("wq_a", q, h, 1));
        v.push(g("wq_b", heads * d, q, 1));
        v.push(g("wkv", d, h, 1));
        v.push(g("wo_a", r, heads * d / gq, gq));
        v.push(g("wo_b", h, gq * r, 1));
        v.push(g("w13", 2 * f, h, 1));
        v.push(g("w2", h, f, 1));
        v.push(g("indexer_wq", c.index_n_heads * c.index_head_dim, q, 1));
        v.push(GemmShape { name: "lm_head", gemm: Gemm::new(t, c.vocab_size, h), f32_out: true });
    }
    v
}

/// The RMSNorm case name at `rows × dim`.
pub fn rms_case(rows: usize, dim: usize) -> String {
    format!("rms_norm rows={rows} dim={dim}")
}

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let dk = DenseKernels::new(&ctx.dev)?;
    let shapes = gemm_shapes(ctx.scale);
    let (mut mx, mut mw, mut my) = (1usize, 1usize, 1usize);
    for sh in &shapes {
        let g = sh.gemm;
        mx = mx.max(g.t * g.groups * g.k);
        mw = mw.max(g.groups * g.n * g.k);
        my = my.max(g.t * g.groups * g.n);
    }
    // One set of buffers for all shapes; each case uses prefixes.
    let x: Buffer<bf16> = ctx.filled("dense.x", mx, 0x3c)?;
    let w: Buffer<bf16> = ctx.filled("dense.w", mw, 0x3c)?;
    let y: Buffer<bf16> = ctx.filled("dense.y", my, 0)?;
    let yf: Buffer<f32> = ctx.filled("dense.yf", my, 0)?;
    let s = &ctx.s;
    let mut rows = Vec::new();
    for sh in shapes {
        if !ctx.wants(&sh.case()) {
            continue;
        }
        let g = sh.gemm;
        let (xv, wv) = (x.prefix(g.t * g.groups * g.k)?, w.prefix(g.groups * g.n * g.k)?);
        let out = g.t * g.groups * g.n;
        let (yv, yfv) = (y.prefix(out)?, yf.prefix(out)?);
        let mut call = || -> Result<()> {
            if sh.f32_out {
                dk.matmul_f32(s, &xv, &wv, &yfv, g)?;
            } else {
                dk.matmul(s, &xv, &wv, &yv, g)?;
            }
            Ok(())
        };
        let row = ctx.kernel_row(SECTION, sh.case(), &mut call)?;
        rows.push(row.with_bytes(sh.bytes()).with_flops(2 * g.macs()).with_bound(Bound::Roofline));
    }
    let hdim = config(ctx.scale).hidden_size;
    let nw: Buffer<bf16> = ctx.filled("dense.norm_w", hdim, 0x3f)?;
    let nwv = nw.view();
    for t in tokens(ctx.scale) {
        if !ctx.wants(&rms_case(t, hdim)) {
            continue;
        }
        let (xv, yv) = (x.prefix(t * hdim)?, y.prefix(t * hdim)?);
        let mut call = || -> Result<()> { Ok(dk.rms_norm(s, &xv, &nwv, &yv, t, hdim, 1e-6)?) };
        let row = ctx.kernel_row(SECTION, rms_case(t, hdim), &mut call)?;
        rows.push(row.with_bytes((4 * t * hdim + 2 * hdim) as u64).with_bound(Bound::Copy));
    }
    Ok(rows)
}
