//! Ragged sparse attention at decode (head_dim 512, MQA latent V = K, attention sink): the SWA
//! window of 128 plus the compressed entries of a 64K context (512: c128a, or c4a top-512), of a
//! c4a layer at top-1024 (1024) and of a 1M context (8192: c128a), 64 heads (V4-Flash) and 128
//! heads (V4-Pro), batch 1, 8, 64, 256.
//!
//! Bytes per call, counted here (the kernel does not report them): every KV row each query row
//! lists, read once (`rows × entries × head_dim × 2`; each row reads its own distinct slots, so
//! these bytes are really moved), the queries and outputs (`rows × heads × head_dim × 2` each),
//! the slot lists (`rows × entries × 4`) and the two indptr arrays.
//!
//! Each shape is timed with the kernel [`SparseAttention::new`] picks at the row split a model
//! runner built for that batch (`max_num_seqs` = batch) runs it with
//! ([`SparseAttention::throughput_split`]: 1 where the batch's rows fill the device, else the
//! kernel's [`holdfast_attention::WG_DEFAULT_SPLIT`]; the row's note names it) and, on a device
//! with warpgroup MMA at head_dim 512 (where `new` picks the warpgroup kernel), also with the
//! tensor-core kernel (case suffix ` mma`) and with the warpgroup kernel at every other row split
//! of [`WG_SPLITS`] (suffix ` wg/N`), side by side on the same inputs. [`attend_case`] is the
//! only place that calls the kernel's API.

use holdfast_attention::{AttentionKernel, RaggedKv, SparseAttention, WG_HEAD_DIM, WG_SPLITS};
use holdfast_hal::bf16;

use crate::ctx::{Ctx, Scale};
use crate::error::Result;
use crate::report::{Bound, Row, Target};

/// Section name.
pub const SECTION: &str = "attention";
/// Least fraction of copy bandwidth at batch ≥ 64.
pub const BANDWIDTH_TARGET: f64 = 0.5;

/// One attention shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Head dim (the latent of K = V).
    pub head_dim: usize,
    /// SWA entries per row.
    pub window: usize,
    /// Compressed entries per row.
    pub extra: usize,
    /// Query rows (decode tokens).
    pub batch: usize,
}

impl AttnShape {
    /// The case name (also the PyTorch key's case).
    pub fn case(&self) -> String {
        format!("h{}_d{} swa{}+{} B={}", self.heads, self.head_dim, self.window, self.extra, self.batch)
    }

    /// Bytes one call must move (see the module docs).
    pub fn bytes(&self) -> u64 {
        let (b, e, h, d) =
            (self.batch as u64, (self.window + self.extra) as u64, self.heads as u64, self.head_dim as u64);
        b * e * d * 2 + 2 * b * h * d * 2 + b * e * 4 + 2 * (b + 1) * 4
    }

    /// FLOPs of one call: `q·k` and `p·v` per head and entry (`4 · rows · heads · entries · d`).
    pub fn flops(&self) -> u64 {
        4 * (self.batch * self.heads * (self.window + self.extra) * self.head_dim) as u64
    }
}

/// The shapes measured.
pub fn shapes(scale: Scale) -> Vec<AttnShape> {
    let mut v = Vec::new();
    match scale {
        Scale::Full => {
            for heads in [64usize, 128] {
                for extra in [512usize, 1024, 8192] {
                    for batch in [1usize, 8, 64, 256] {
                        v.push(AttnShape { heads, head_dim: 512, window: 128, extra, batch });
                    }
                }
            }
        }
        Scale::Quick => {
            for batch in [1usize, 4] {
                v.push(AttnShape { heads: 4, head_dim: 64, window: 16, extra: 32, batch });
            }
        }
    }
    v
}

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let warpgroup = ctx.dev.info().has_wgmma();
    for shape in shapes(ctx.scale) {
        // The default row: the kernel and split a runner built for batches of `shape.batch` rows
        // runs (`RunnerSettings::attention_row_split` unset: `throughput_split(max_num_seqs)`).
        let auto = SparseAttention::new(&ctx.dev, shape.heads, shape.head_dim)?;
        let auto_split = auto.uses_warpgroup().then(|| auto.throughput_split(shape.batch));
        let mut kernels = vec![(AttentionKernel::Auto, auto_split)];
        if warpgroup && shape.head_dim == WG_HEAD_DIM {
            kernels.push((AttentionKernel::TensorCore, None));
            let others = WG_SPLITS.iter().filter(|&&n| Some(n) != auto_split);
            kernels.extend(others.map(|&n| (AttentionKernel::Warpgroup, Some(n))));
        }
        for (kernel, split) in kernels {
            if !ctx.wants(&case_name(shape, kernel, split)) {
                continue;
            }
            let mut row = attend_case(ctx, shape, kernel, split)?
                .with_bytes(shape.bytes())
                .with_flops(shape.flops())
                .with_bound(Bound::Copy);
            // The target is the default kernel's; the other rows are comparisons.
            if kernel == AttentionKernel::Auto {
                if let Some(n) = split {
                    row = row.with_note(format!("warpgroup kernel, rows split in {n}"));
                }
                if shape.batch >= 64 {
                    row = row.with_target(Target::FractionAtLeast(BANDWIDTH_TARGET));
                }
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// The case name of `sh` run with `kernel` at `split` (see [`attend_case`]).
pub fn case_name(sh: AttnShape, kernel: AttentionKernel, split: Option<usize>) -> String {
    match (kernel, split) {
        (AttentionKernel::Auto, _) => sh.case(),
        (AttentionKernel::TensorCore, _) => format!("{} mma", sh.case()),
        (AttentionKernel::Warpgroup, Some(n)) => format!("{} wg/{n}", sh.case()),
        (AttentionKernel::Warpgroup, None) => format!("{} wg", sh.case()),
        (AttentionKernel::Portable, _) => format!("{} portable", sh.case()),
    }
}

/// Builds the inputs of one shape and times `SparseAttention::attend` with `kernel` on them, its
/// rows split in `split` blocks where given (the warpgroup kernel). The case name gains ` mma` for
/// [`AttentionKernel::TensorCore`], ` wg/N` for the warpgroup kernel split in N, ` wg` for it
/// at its default split and ` portable` for the portable kernel.
pub fn attend_case(ctx: &Ctx, sh: AttnShape, kernel: AttentionKernel, split: Option<usize>) -> Result<Row> {
    let AttnShape { heads, head_dim: d, window, extra, batch } = sh;
    let mut k = SparseAttention::with_kernel(&ctx.dev, heads, d, kernel)?;
    if let Some(n) = split {
        k = k.with_warpgroup_split(&ctx.dev, n)?;
    }
    let per_row = window + extra;
    let slots = (batch * per_row).max(1);
    // Filled on the device (every element 0x3c3c ≈ 0.0115): the values do not change the work,
    // and a host-side pattern for the 2 GiB caches of the 1M-context shapes would dominate setup.
    let cache = ctx.filled::<bf16>("attn.cache", slots * d, 0x3c)?;
    // Row r's SWA entries are slots [r·per_row, r·per_row + window), its compressed entries the
    // next `extra` slots: every row reads distinct KV rows.
    let main_idx: Vec<i32> = (0..batch).flat_map(|r| (0..window).map(move |j| (r * per_row + j) as i32)).collect();
    let extra_idx: Vec<i32> =
        (0..batch).flat_map(|r| (0..extra).map(move |j| (r * per_row + window + j) as i32)).collect();
    let mp: Vec<i32> = (0..=batch).map(|r| (r * window) as i32).collect();
    let ep: Vec<i32> = (0..=batch).map(|r| (r * extra) as i32).collect();
    let up = |l: &str, v: &[i32]| ctx.dev.alloc_from_slice(l, if v.is_empty() { &[0] } else { v }, true);
    let (mi, mpb, ei, epb) =
        (up("main_idx", &main_idx)?, up("main_indptr", &mp)?, up("extra_idx", &extra_idx)?, up("extra_indptr", &ep)?);
    let q = ctx.dev.alloc_from_slice("attn.q", &vec![bf16::from_f32(0.01); batch * heads * d], true)?;
    let out = ctx.dev.alloc_zeroed::<bf16>("attn.out", batch * heads * d, true)?;
    let sink = ctx.dev.alloc_from_slice("attn.sink", &vec![0.0f32; heads], true)?;
    let (cv, miv, mpv, eiv, epv) = (cache.view(), mi.view(), mpb.view(), ei.view(), epb.view());
    let (qv, ov, sv) = (q.view(), out.view(), sink.view());
    let main = RaggedKv { cache: &cv, indices: &miv, indptr: &mpv };
    let ex = RaggedKv { cache: &cv, indices: &eiv, indptr: &epv };
    let scale = 1.0 / (d as f32).sqrt();
    let s = &ctx.s;
    let case = case_name(sh, kernel, split);
    ctx.kernel_row(SECTION, case, &mut || Ok(k.attend(s, &qv, &main, Some(&ex), &sv, &ov, scale)?))
}
