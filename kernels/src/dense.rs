//! Dense ops of a decoder: matmul (bf16 or f32 out, optionally grouped), RMSNorm, RoPE, SwiGLU,
//! embedding lookup, argmax, row repeat, f32 → bf16.
//!
//! ## Numerics and batch invariance
//! bf16 storage, f32 math. Each output's reduction order is fixed by the op and the shape and never
//! depends on the number of rows in the launch, on the grid, on padding, or on which kernel of the
//! path runs; no atomics. So row r of a T = 37 launch equals the same row of a T = 1 launch bit
//! for bit, and a captured launch replays exactly what ran eagerly.
//!
//! - **matmul**, two paths, picked per [`DenseKernels`] ([`MatmulKernel`]) and, for the tensor
//!   cores, per call site by `k % 8 == 0` and 8-element-aligned views (a function of the shape and
//!   the views, never of t or the data):
//!   - *tensor cores* (NVIDIA sm_80+, [`MatmulKernel::Auto`]): the **split order** — k cut into
//!     [`mma_splits`]`(k)` ranges (a function of k alone); per range an f32 accumulator from 0
//!     through bf16 `mma.sync` m16n8k16 steps in k order; the ranges summed in order from 0; one
//!     round to nearest even for bf16 out. Both block shapes (16 and 64 rows) run the same steps
//!     per output, and an mma's output element depends only on its own row and column, so rows
//!     are batch-invariant. The CPU reference of these entries runs the same ranges as `mul_add`
//!     chains; the hardware's order inside one 16-wide step differs, so device and reference agree
//!     to f32 rounding, not bit for bit.
//!   - *SIMT* (every backend; the CPU backend's matmul): `acc = 0; for k in 0..K { acc =
//!     fmaf(x[k], w[k], acc) }`, one chain per output, then (for bf16 out) one round to nearest
//!     even. The CPU reference runs the same chain with `f32::mul_add`, so CPU and GPU agree bit
//!     for bit.
//! - **rms_norm**: 256 partial sums of squares (thread j takes columns j, j + 256, …, each an
//!   `fmaf` chain), a fixed shared-memory tree, `inv = 1 / sqrt(ss / dim + eps)` with IEEE division
//!   and square root, `y = (x · inv) · w`; the CPU reference does the same, bit for bit.
//! - **argmax**, **embed**, **repeat_rows**: exact by construction.
//! - **rope**, **swiglu**: elementwise, but they call `powf`/`sinf`/`cosf`/`expf`, whose last-ulp
//!   results differ between libm and a GPU math library, so CPU and GPU agree within a few f32 ulps
//!   (tests compare them with a tolerance). Batch invariance still holds exactly on each backend.
//!
//! ## The matmul kernels
//! The tensor-core kernels (`dense_mma.cu`): a block of 8 warps covers 16 (t ≤ 16) or 64 rows
//! and `16 · 8 / splits` output columns; warp w takes k range `w % splits` and 16 columns, streams
//! its own x and w tiles (32 k per stage, four or three stages in flight) into its own slice of
//! shared memory with `cp.async`, reads fragments with `ldmatrix`, and at the end the block sums
//! the ranges in order. Splitting k across warps gives decode-sized shapes enough loads in flight
//! to stream the weights (n = 1024, k = 4096 runs 64 blocks of 8 warps instead of 8 columns
//! panels); [`Gemm::mma_launch_config`] has the grid.
//!
//! Two SIMT kernels (no tensor cores; ROCm, the CPU backend, [`MatmulKernel::Portable`], and
//! calls the tensor cores do not take), chosen by t alone ([`Gemm::uses_small_t_kernel`]):
//!
//! - **Tiled** (`t > 8`): block tile 32 rows (tokens) × 128 columns (outputs), k in steps of 32;
//!   256 threads, each with a 4 × 4 register tile. Tiles of x and w are loaded as bf16 (w with
//!   16-byte vector loads when aligned and the k tile is full), converted to f32 and stored
//!   k-major, so the inner loop reads one 16-byte vector of each per k step and issues 16 FMAs.
//!   Grid `(⌈n / 128⌉, ⌈t / 32⌉, groups)`.
//! - **Small-t** (`t ≤ 8`, decode steps): the tiled kernel would compute a whole 32-row tile (up
//!   to 32× the FMAs needed) and be compute-bound; this one is built to stream the weights. 128
//!   threads own a slab of 128 outputs, one column each, and keep that column's chains for all t
//!   rows in registers. The block streams the slab's w rows through shared memory 64 k at a time:
//!   with `k % 8 == 0` and an aligned w, eight coalesced 16-byte loads per thread per chunk (a warp
//!   reads whole 128-byte row segments), with the next chunk's loads in flight while the current
//!   one is computed; otherwise element loads. w stays bf16 in shared memory (rows padded so each
//!   thread's 16-byte reads of its own row are conflict-free); the x rows of the chunk are staged
//!   as f32, k-major, and read with broadcast 16-byte loads. Grid `(⌈n / 128⌉, 1, groups)`. Every
//!   weight byte is read once per launch, and the FMAs issued are exactly `t · n · k`.
//!
//! Why the bits are the same: both kernels run, for every output, the same chain (`acc = 0`, then
//! `acc = fmaf(x[k], w[k], acc)` for k = 0, 1, …, K − 1, only valid k, no padded terms), with the
//! same exact bf16 → f32 conversion and the same final store (f32, or one round to nearest even
//! for bf16). Tiling only decides which thread runs a chain and when, never its order, so the
//! kernels agree with each other and with the CPU reference bit for bit, and a row's bits do not
//! depend on t even where t crosses the threshold.
//!
//! The threshold, 8: the small-t kernel issues t FMAs and ⌈t / 4⌉ broadcast 16-byte x loads per
//! weight element, with no reuse of x across columns. By an issue-rate estimate for an H200-class
//! SM (4 FMA warp-instructions and about one shared-memory wavefront per cycle) both limits sit
//! about 1.6× above HBM bandwidth at t = 8, so the kernel stays weight-bandwidth-bound; near t = 16
//! it would become compute-bound, where the tiled kernel's 4 × 4 register reuse is the better
//! design. Eight rows are also two 16-byte x vectors per k step and eight accumulators per thread,
//! well clear of spilling (the PTX test checks). This is an estimate, not a measurement; the
//! criterion bench (`benches/dense.rs`, t = 1, 8 and 64) times both kernels. Both grids depend only on the sizes,
//! so launches are capturable. Any t, n, k (partial tiles are guarded).

use holdfast_hal::{bf16, Device, DeviceInfo, Kernel, LaunchConfig, Stream, View};

use crate::dense_source::{dense_source, ARGMAX_THREADS, MATMUL_BM, MATMUL_BN, MATMUL_THREADS, NORM_THREADS};
pub use crate::dense_source::{
    mma_splits, MATMUL_MMA_SMALL_T_MAX, MATMUL_MMA_TILED_MIN_BLOCKS, MATMUL_MMA_TILED_MIN_T, MATMUL_MMA_WARPS,
    MATMUL_SMALL_T_BN, MATMUL_SMALL_T_MAX, MATMUL_SMALL_T_THREADS,
};
use crate::{shape, u32_of, Result};

/// Shape of a (grouped) matmul: `x [t, groups, k] · w[g] [n, k]ᵀ → y [t, groups, n]`, with `w`
/// stored `[groups, n, k]`; `groups = 1` is a plain `x · wᵀ`. Sizes are in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// Rows of x and y (tokens).
    pub t: usize,
    /// Output features per group (rows of each `w[g]`).
    pub n: usize,
    /// Input features per group (the reduction length).
    pub k: usize,
    /// Independent groups (at least 1).
    pub groups: usize,
}

impl Gemm {
    /// A plain `[t, k] · [n, k]ᵀ → [t, n]` matmul (`groups = 1`).
    pub const fn new(t: usize, n: usize, k: usize) -> Self {
        Gemm { t, n, k, groups: 1 }
    }

    /// Multiply-adds of the whole op (`t · groups · n · k`).
    pub fn macs(&self) -> u64 {
        (self.t as u64) * (self.groups as u64) * (self.n as u64) * (self.k as u64)
    }

    /// Whether this shape runs the small-t kernel (`t ≤ 8`, [`MATMUL_SMALL_T_MAX`]) rather than
    /// the tiled one; both give the same bits (see the module docs).
    pub const fn uses_small_t_kernel(&self) -> bool {
        self.t <= MATMUL_SMALL_T_MAX
    }

    /// The launch configuration of this shape: for `t ≤ 8` (small-t kernel) grid
    /// `(⌈n / 128⌉, 1, groups)` with 128 threads, else (tiled) grid `(⌈n / 128⌉, ⌈t / 32⌉, groups)`
    /// with 256 threads.
    pub fn launch_config(&self) -> LaunchConfig {
        let dim = |v: usize, tile: usize| v.div_ceil(tile).max(1).min(u32::MAX as usize) as u32;
        if self.uses_small_t_kernel() {
            return LaunchConfig {
                grid: (dim(self.n, MATMUL_SMALL_T_BN), 1, dim(self.groups, 1)),
                block: (MATMUL_SMALL_T_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
        }
        LaunchConfig {
            grid: (dim(self.n, MATMUL_BN), dim(self.t, MATMUL_BM), dim(self.groups, 1)),
            block: (MATMUL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// Bf16 elements per row of a tensor-core matmul stage in shared memory (32 k + 8 padding).
const MMA_PITCH: usize = 40;

/// The tensor-core kernel a shape runs (all three give a row the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaKernel {
    /// 16 rows per block, k split across the block's warps (`t ≤ 16`).
    Rows16,
    /// 64 rows per block, k split across the block's warps.
    Rows64,
    /// 64 × 128 block tiles, k walked in order by the block (many rows and columns).
    Tiled,
}

impl Gemm {
    /// The tensor-core kernel of this shape: [`MmaKernel::Rows16`] for `t ≤ 16`,
    /// [`MmaKernel::Tiled`] for `t ≥ 65` with at least [`MATMUL_MMA_TILED_MIN_BLOCKS`] of its
    /// blocks, else [`MmaKernel::Rows64`].
    pub fn mma_kernel(&self) -> MmaKernel {
        let tiled_blocks = self.n.div_ceil(128) * self.t.div_ceil(64) * self.groups;
        if self.t <= MATMUL_MMA_SMALL_T_MAX {
            MmaKernel::Rows16
        } else if self.t >= MATMUL_MMA_TILED_MIN_T && tiled_blocks >= MATMUL_MMA_TILED_MIN_BLOCKS {
            MmaKernel::Tiled
        } else {
            MmaKernel::Rows64
        }
    }

    /// Rows of x per tensor-core block: 16 for `t ≤ 16`, else 64.
    pub fn mma_rows_per_block(&self) -> usize {
        if self.mma_kernel() == MmaKernel::Rows16 {
            16
        } else {
            64
        }
    }

    /// The launch configuration of the tensor-core kernels, 256 threads: for the 16- and 64-row
    /// kernels grid `(⌈n / (16 · 8 / splits)⌉, ⌈t / rows⌉, groups)` with `splits` from
    /// [`mma_splits`], dynamic shared memory for the warps' stages (four of 32 rows × 80 bytes per
    /// warp at 16 rows, three of 80 rows at 64); for the tiled kernel grid `(⌈n / 128⌉, ⌈t /
    /// 64⌉, groups)` and three stages of 192 rows × 80 bytes.
    pub fn mma_launch_config(&self) -> LaunchConfig {
        let dim = |v: usize, tile: usize| v.div_ceil(tile).max(1).min(u32::MAX as usize) as u32;
        let kernel = self.mma_kernel();
        let (splits, _) = mma_splits(self.k);
        let (cols, rows) = match kernel {
            MmaKernel::Tiled => (128, 64),
            _ => (16 * (MATMUL_MMA_WARPS / splits), self.mma_rows_per_block()),
        };
        LaunchConfig {
            grid: (dim(self.n, cols), dim(self.t, rows), dim(self.groups, 1)),
            block: (32 * MATMUL_MMA_WARPS as u32, 1, 1),
            shared_mem_bytes: mma_shared_bytes(kernel) as u32,
        }
    }
}

/// Dynamic shared memory of a tensor-core matmul block: the stages (per warp for the 16- and
/// 64-row kernels, whose end-of-block reduction reuses them; shared for the tiled one).
pub const fn mma_shared_bytes(kernel: MmaKernel) -> usize {
    let rows = match kernel {
        MmaKernel::Rows16 => 16,
        MmaKernel::Rows64 => 64,
        MmaKernel::Tiled => return 3 * (64 + 128) * MMA_PITCH * 2,
    };
    let stages = if rows <= 16 { 4 } else { 3 };
    let pipeline = MATMUL_MMA_WARPS * stages * (rows + 16) * MMA_PITCH * 2;
    let reduction = MATMUL_MMA_WARPS * rows * 16 * 4;
    if pipeline > reduction {
        pipeline
    } else {
        reduction
    }
}

/// Whether `info` is an NVIDIA device with bf16 tensor cores (`mma.sync` m16n8k16, sm_80 or newer).
pub fn has_bf16_tensor_cores(info: &DeviceInfo) -> bool {
    info.has_bf16_mma()
}

/// Which matmul kernels [`DenseKernels`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulKernel {
    /// Tensor cores where the device has them ([`has_bf16_tensor_cores`] and room for the
    /// 64-row block's shared memory), in the split order; the SIMT chain kernels elsewhere.
    #[default]
    Auto,
    /// The SIMT kernels (one FMA chain per output, bit for bit the CPU reference) on every device.
    Portable,
}

/// Checks `a · b · …` for overflow.
fn product(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| shape(op, format!("{dims:?} overflows")))
}

fn need(op: &'static str, what: &str, len: usize, dims: &[usize]) -> Result<()> {
    let n = product(op, dims)?;
    if len < n {
        return Err(shape(op, format!("{what} holds {len} elements, {dims:?} needs {n}")));
    }
    Ok(())
}

/// Blocks for a grid-stride loop over `n` elements (at least one, at most 8192).
fn stride_grid(n: usize, block: u32) -> LaunchConfig {
    LaunchConfig::blocks(n.div_ceil(block as usize).clamp(1, 8192) as u32, block)
}

/// One block per row (at least one, at most 65535; kernels loop over the rest).
fn row_grid(rows: usize, block: u32) -> LaunchConfig {
    LaunchConfig::blocks(rows.clamp(1, 65535) as u32, block)
}

/// The compiled dense kernels of one device (one module; cheap to clone).
#[derive(Clone, Debug)]
pub struct DenseKernels {
    matmul_bf16: Kernel,
    matmul_f32: Kernel,
    matmul_small_t_bf16: Kernel,
    matmul_small_t_f32: Kernel,
    /// Tensor-core entries `[16-row, 64-row, tiled]` × `[bf16, f32]`, when selected.
    mma: Option<[Kernel; 6]>,
    rms_norm: Kernel,
    rope: Kernel,
    swiglu: Kernel,
    embed: Kernel,
    argmax: Kernel,
    repeat_rows: Kernel,
    to_bf16: Kernel,
}

impl DenseKernels {
    /// Compiles (or fetches from the device's cache) the dense kernel source for `dev`. Not
    /// allowed during capture (compilation never is).
    pub fn new(dev: &Device) -> Result<Self> {
        Self::with_matmul(dev, MatmulKernel::Auto)
    }

    /// As [`DenseKernels::new`], choosing the matmul kernels.
    pub fn with_matmul(dev: &Device, matmul: MatmulKernel) -> Result<Self> {
        let m = dev.compile(dense_source())?;
        let info = dev.info();
        let mma = if matmul == MatmulKernel::Auto
            && has_bf16_tensor_cores(info)
            && mma_shared_bytes(MmaKernel::Rows64) <= info.max_shared_mem_per_block as usize
        {
            Some([
                m.kernel("hf_matmul_mma16_bf16")?,
                m.kernel("hf_matmul_mma16_f32")?,
                m.kernel("hf_matmul_mma64_bf16")?,
                m.kernel("hf_matmul_mma64_f32")?,
                m.kernel("hf_matmul_mma_tiled_bf16")?,
                m.kernel("hf_matmul_mma_tiled_f32")?,
            ])
        } else {
            None
        };
        Ok(DenseKernels {
            mma,
            matmul_bf16: m.kernel("hf_matmul_bf16")?,
            matmul_f32: m.kernel("hf_matmul_f32")?,
            matmul_small_t_bf16: m.kernel("hf_matmul_small_t_bf16")?,
            matmul_small_t_f32: m.kernel("hf_matmul_small_t_f32")?,
            rms_norm: m.kernel("hf_rms_norm_bf16")?,
            rope: m.kernel("hf_rope_bf16")?,
            swiglu: m.kernel("hf_swiglu_bf16")?,
            embed: m.kernel("hf_embed_bf16")?,
            argmax: m.kernel("hf_argmax_f32")?,
            repeat_rows: m.kernel("hf_repeat_rows_bf16")?,
            to_bf16: m.kernel("hf_to_bf16_f32")?,
        })
    }

    /// True when the matmuls run on tensor cores (for views and shapes they accept: `k % 8 == 0`
    /// and `x`, `w` starting at a multiple of 8 elements; other calls run the SIMT kernels).
    pub fn uses_tensor_cores(&self) -> bool {
        self.mma.is_some()
    }

    /// True when a matmul of `g` over `x` and `w` runs on tensor cores: a function of the shape and
    /// the views' offsets, never of the data.
    pub fn matmul_uses_tensor_cores(&self, x: &View<bf16>, w: &View<bf16>, g: Gemm) -> bool {
        self.mma.is_some() && g.k.is_multiple_of(8) && x.offset().is_multiple_of(8) && w.offset().is_multiple_of(8)
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        op: &'static str,
        (tiled, small_t, f32_out): (&Kernel, &Kernel, bool),
        s: &Stream,
        x: &View<bf16>,
        w: &View<bf16>,
        y: holdfast_hal::Arg,
        y_len: usize,
        g: Gemm,
    ) -> Result<()> {
        if g.groups == 0 {
            return Err(shape(op, "groups must be at least 1".into()));
        }
        need(op, "x", x.len(), &[g.t, g.groups, g.k])?;
        need(op, "w", w.len(), &[g.groups, g.n, g.k])?;
        need(op, "y", y_len, &[g.t, g.groups, g.n])?;
        if g.t.div_ceil(MATMUL_BM) > 65535 || g.groups > 65535 {
            return Err(shape(
                op,
                format!(
                    "t = {} or groups = {} exceeds the grid (t ≤ {}, groups ≤ 65535)",
                    g.t,
                    g.groups,
                    65535 * MATMUL_BM
                ),
            ));
        }
        // The SIMT kernels take the first seven; the tensor-core ones also the split order's ranges.
        let (splits, split_len) = mma_splits(g.k);
        let args = [
            x.into(),
            w.into(),
            y,
            u32_of(op, "t", g.t)?.into(),
            u32_of(op, "n", g.n)?.into(),
            u32_of(op, "k", g.k)?.into(),
            u32_of(op, "groups", g.groups)?.into(),
            u32_of(op, "splits", splits)?.into(),
            u32_of(op, "split_len", split_len)?.into(),
        ];
        if let (Some(mma), true) = (&self.mma, self.matmul_uses_tensor_cores(x, w, g)) {
            let base = match g.mma_kernel() {
                MmaKernel::Rows16 => 0,
                MmaKernel::Rows64 => 2,
                MmaKernel::Tiled => 4,
            };
            let kernel = &mma[base + usize::from(f32_out)];
            s.launch_dependent(kernel, g.mma_launch_config(), &args)?;
            return Ok(());
        }
        let kernel = if g.uses_small_t_kernel() { small_t } else { tiled };
        s.launch_dependent(kernel, g.launch_config(), &args[..7])?;
        Ok(())
    }

    /// `y [t, groups, n] = x [t, groups, k] · w [groups, n, k]ᵀ` per group: bf16 inputs, f32
    /// accumulation (the split order on tensor cores, else one `fmaf` chain over k per output; see
    /// the module docs), bf16 output rounded to nearest even. Views may be longer than the shape
    /// needs (prefixes of persistent buffers). Every t gives a row the same bits.
    pub fn matmul(&self, s: &Stream, x: &View<bf16>, w: &View<bf16>, y: &View<bf16>, g: Gemm) -> Result<()> {
        let kernels = (&self.matmul_bf16, &self.matmul_small_t_bf16, false);
        self.gemm("matmul", kernels, s, x, w, y.into(), y.len(), g)
    }

    /// As [`DenseKernels::matmul`] with an f32 output `y [t, groups, n]` (logits, compressor
    /// projections): the same accumulator, not rounded.
    pub fn matmul_f32(&self, s: &Stream, x: &View<bf16>, w: &View<bf16>, y: &View<f32>, g: Gemm) -> Result<()> {
        let kernels = (&self.matmul_f32, &self.matmul_small_t_f32, true);
        self.gemm("matmul_f32", kernels, s, x, w, y.into(), y.len(), g)
    }

    /// `y[r, :] = x[r, :] · rsqrt(mean(x[r, :]²) + eps) · w` for `x, y [rows, dim]`, `w [dim]`:
    /// bf16 in and out, f32 math (the fixed order in the module docs). `x` and `y` may be the same
    /// view (in place).
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        s: &Stream,
        x: &View<bf16>,
        w: &View<bf16>,
        y: &View<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        need(OP, "x", x.len(), &[rows, dim])?;
        need(OP, "w", w.len(), &[dim])?;
        need(OP, "y", y.len(), &[rows, dim])?;
        let args = [
            x.into(),
            w.into(),
            y.into(),
            u32_of(OP, "rows", rows)?.into(),
            u32_of(OP, "dim", dim)?.into(),
            eps.into(),
        ];
        s.launch_dependent(&self.rms_norm, row_grid(rows, NORM_THREADS as u32), &args)?;
        Ok(())
    }

    /// In place on `x [tokens, heads, head_dim]` (bf16): rotates the last `rope_dim` dims of each
    /// head as interleaved pairs `(2i, 2i + 1)` by the angle `positions[t] · theta^(−2i / rope_dim)`
    /// radians (`inverse` rotates by the negated angle). Tokens with a negative position are left
    /// untouched. `positions [tokens]`; `rope_dim` must be even and at most `head_dim`.
    ///
    /// f32 math: `inv_freq = powf(theta, −(2i) / rope_dim)`, `angle = ±(pos · inv_freq)`, then
    /// `sinf`/`cosf`. The CPU reference evaluates the same formula with Rust's libm, so CPU and GPU
    /// agree within a few f32 ulps, not bit for bit (compare with a tolerance).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        s: &Stream,
        x: &View<bf16>,
        positions: &View<i32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        rope_dim: usize,
        theta: f32,
        inverse: bool,
    ) -> Result<()> {
        const OP: &str = "rope";
        if !rope_dim.is_multiple_of(2) || rope_dim > head_dim {
            return Err(shape(OP, format!("rope_dim {rope_dim} must be even and at most head_dim {head_dim}")));
        }
        need(OP, "x", x.len(), &[tokens, heads, head_dim])?;
        need(OP, "positions", positions.len(), &[tokens])?;
        let args = [
            x.into(),
            positions.into(),
            u32_of(OP, "tokens", tokens)?.into(),
            u32_of(OP, "heads", heads)?.into(),
            u32_of(OP, "head_dim", head_dim)?.into(),
            u32_of(OP, "rope_dim", rope_dim)?.into(),
            theta.into(),
            (if inverse { -1.0f32 } else { 1.0f32 }).into(),
        ];
        s.launch_dependent(&self.rope, stride_grid(product(OP, &[tokens, heads, rope_dim / 2])?, 256), &args)?;
        Ok(())
    }

    /// `gate_up [tokens, 2·ffn]` (gate = the first `ffn` columns, up = the last `ffn`) →
    /// `out [tokens, ffn] = silu(min(gate, limit)) · clamp(up, −limit, limit)`, f32 math, bf16 in
    /// and out. `limit = f32::INFINITY` disables the clamp (DeepSeek-V4's `swiglu_limit` is 10). A
    /// NaN input gives NaN. CPU and GPU `expf` differ in the last ulp (compare with a tolerance).
    pub fn swiglu(
        &self,
        s: &Stream,
        gate_up: &View<bf16>,
        out: &View<bf16>,
        tokens: usize,
        ffn: usize,
        limit: f32,
    ) -> Result<()> {
        const OP: &str = "swiglu";
        if limit.is_nan() || limit < 0.0 {
            return Err(shape(OP, format!("limit {limit} must be ≥ 0 (or +inf)")));
        }
        need(OP, "gate_up", gate_up.len(), &[tokens, 2, ffn])?;
        need(OP, "out", out.len(), &[tokens, ffn])?;
        let args = [
            gate_up.into(),
            out.into(),
            u32_of(OP, "tokens", tokens)?.into(),
            u32_of(OP, "ffn", ffn)?.into(),
            limit.into(),
        ];
        s.launch_dependent(&self.swiglu, stride_grid(product(OP, &[tokens, ffn])?, 256), &args)?;
        Ok(())
    }

    /// `out[t, :] = table[ids[t], :]` for `t < tokens`, with `table [vocab, hidden]`,
    /// `ids [tokens]`, `out [tokens, hidden]` (bf16 copied bit for bit). An id outside
    /// `[0, vocab)` (−1 is padding) writes a zero row.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        s: &Stream,
        table: &View<bf16>,
        ids: &View<i32>,
        out: &View<bf16>,
        tokens: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<()> {
        const OP: &str = "embed";
        need(OP, "table", table.len(), &[vocab, hidden])?;
        need(OP, "ids", ids.len(), &[tokens])?;
        need(OP, "out", out.len(), &[tokens, hidden])?;
        let args = [
            table.into(),
            ids.into(),
            out.into(),
            u32_of(OP, "tokens", tokens)?.into(),
            u32_of(OP, "hidden", hidden)?.into(),
            u32_of(OP, "vocab", vocab)?.into(),
        ];
        s.launch_dependent(&self.embed, stride_grid(product(OP, &[tokens, hidden])?, 256), &args)?;
        Ok(())
    }

    /// `out[r]` = index of the largest of `logits[r, 0..cols]` (f32, `logits [rows, cols]`,
    /// `out [rows]`): the lowest index on ties, NaN never wins, an all-NaN row gives 0. One block
    /// per row; exact on every backend.
    pub fn argmax(&self, s: &Stream, logits: &View<f32>, out: &View<i32>, rows: usize, cols: usize) -> Result<()> {
        const OP: &str = "argmax";
        need(OP, "logits", logits.len(), &[rows, cols])?;
        need(OP, "out", out.len(), &[rows])?;
        let args = [logits.into(), out.into(), u32_of(OP, "rows", rows)?.into(), u32_of(OP, "cols", cols)?.into()];
        s.launch_dependent(&self.argmax, row_grid(rows, ARGMAX_THREADS), &args)?;
        Ok(())
    }

    /// `y[t, j, :] = x[t, :]` for `j < copies`: `x [tokens, hidden]` → `y [tokens, copies,
    /// hidden]` (the n residual streams), bf16 copied bit for bit.
    pub fn repeat_rows(
        &self,
        s: &Stream,
        x: &View<bf16>,
        y: &View<bf16>,
        tokens: usize,
        copies: usize,
        hidden: usize,
    ) -> Result<()> {
        const OP: &str = "repeat_rows";
        need(OP, "x", x.len(), &[tokens, hidden])?;
        need(OP, "y", y.len(), &[tokens, copies, hidden])?;
        let args = [
            x.into(),
            y.into(),
            u32_of(OP, "tokens", tokens)?.into(),
            u32_of(OP, "copies", copies)?.into(),
            u32_of(OP, "hidden", hidden)?.into(),
        ];
        s.launch_dependent(&self.repeat_rows, stride_grid(product(OP, &[tokens, copies, hidden])?, 256), &args)?;
        Ok(())
    }

    /// `y[i] = bf16(x[i])` for `i < n` (round to nearest even, NaN stays NaN): `x [n]` f32 →
    /// `y [n]` bf16 (for example an all-reduced f32 partial sum back to the activation type).
    pub fn to_bf16(&self, s: &Stream, x: &View<f32>, y: &View<bf16>, n: usize) -> Result<()> {
        const OP: &str = "to_bf16";
        need(OP, "x", x.len(), &[n])?;
        need(OP, "y", y.len(), &[n])?;
        let args = [x.into(), y.into(), u32_of(OP, "n", n)?.into()];
        s.launch_dependent(&self.to_bf16, stride_grid(n, 256), &args)?;
        Ok(())
    }
}
