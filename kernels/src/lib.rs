//! # holdfast-kernels: generic device kernels
//!
//! Small kernels the metadata builders and the model are made of: fill, row copy, gather with a
//! range check, exclusive scan (lengths → `indptr`), and ragged-from-dense pack. Each is one entry
//! point of one portable kernel source ([`source`]), with a CPU reference (the definition) and a
//! typed launcher on [`Kernels`] that validates shapes before anything is enqueued.
//!
//! Launch shapes depend only on the lengths of the views passed in, never on their contents, so a
//! launch over the padded prefix of a persistent buffer is capturable and replays correctly with
//! any data. Nothing here synchronises with the host.
//!
//! The dense ops a decoder is made of (matmul, RMSNorm, RoPE, SwiGLU, embedding, argmax, row
//! repeat) are a second module, [`DenseKernels`] over [`dense_source`]: batch-invariant, with a
//! fixed reduction order per output that the CPU references follow (see [`dense`]).

pub mod dense;
mod dense_source;
mod source;

pub use dense::{has_bf16_tensor_cores, mma_shared_bytes, DenseKernels, Gemm, MatmulKernel, MmaKernel};
pub use dense_source::{dense_source, ARGMAX_THREADS, MATMUL_BM, MATMUL_BN, MATMUL_THREADS, NORM_THREADS};
pub use source::{source, RAGGED_FROM_DENSE_THREADS, SCAN_THREADS};

use holdfast_hal::{Device, HalError, Kernel, LaunchConfig, Stream, View};

/// Errors of this crate's launchers.
#[derive(Debug, thiserror::Error)]
pub enum KernelsError {
    /// A device error (including the sanitizer's findings on the CPU backend).
    #[error(transparent)]
    Hal(#[from] HalError),
    /// Views whose lengths do not fit the operation.
    #[error("{op}: {detail}")]
    Shape {
        /// The launcher.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = KernelsError> = std::result::Result<T, E>;

fn shape(op: &'static str, detail: String) -> KernelsError {
    KernelsError::Shape { op, detail }
}

fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{what} = {v} does not fit in 32 bits")))
}

/// The shape rules of the ragged packs; returns the kernels' `(lo, hi, check)` arguments.
fn pack_checks(
    op: &'static str,
    dense: &View<i32>,
    rows: usize,
    indptr: &View<i32>,
    flat: &View<i32>,
    width: usize,
    range: Option<(i32, i32)>,
) -> Result<(i32, i32, u32)> {
    let cells = rows.checked_mul(width).ok_or_else(|| shape(op, format!("{rows} × {width} overflows")))?;
    if dense.len() < cells {
        return Err(shape(op, format!("dense holds {} elements, [{rows}, {width}] needs {cells}", dense.len())));
    }
    if indptr.len() <= rows {
        return Err(shape(op, format!("indptr holds {} elements, needs rows + 1 = {}", indptr.len(), rows + 1)));
    }
    if flat.len() < cells {
        return Err(shape(op, format!("flat holds {} elements, needs rows × width = {cells}", flat.len())));
    }
    match range {
        Some((lo, hi)) if lo <= hi => Ok((lo, hi, 1)),
        Some((lo, hi)) => Err(shape(op, format!("empty range [{lo}, {hi})"))),
        None => Ok((0, 0, 0)),
    }
}

/// Checks and launches one of the ragged packs (`kernel` with blocks of `threads`, one per row).
#[allow(clippy::too_many_arguments)]
fn launch_pack(
    op: &'static str,
    (kernel, threads): (&Kernel, u32),
    s: &Stream,
    dense: &View<i32>,
    len: &View<i32>,
    indptr: &View<i32>,
    flat: &View<i32>,
    width: usize,
    range: Option<(i32, i32)>,
) -> Result<()> {
    let rows = len.len();
    let (lo, hi, check) = pack_checks(op, dense, rows, indptr, flat, width, range)?;
    let args = [
        dense.into(),
        len.into(),
        indptr.into(),
        flat.into(),
        u32_of(op, "rows", rows)?.into(),
        u32_of(op, "width", width)?.into(),
        lo.into(),
        hi.into(),
        check.into(),
    ];
    s.launch_dependent(kernel, row_grid(rows, threads), &args)?;
    Ok(())
}

/// Blocks for a grid-stride loop over `n` elements (at least one, at most 4096).
fn stride_grid(n: usize, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(block as usize).clamp(1, 4096) as u32;
    LaunchConfig::blocks(blocks, block)
}

/// One block per row (at least one, at most 65535 blocks; kernels loop over the rest).
fn row_grid(rows: usize, block: u32) -> LaunchConfig {
    LaunchConfig::blocks(rows.clamp(1, 65535) as u32, block)
}

/// The compiled kernels of one device.
#[derive(Clone, Debug)]
pub struct Kernels {
    fill_i32: Kernel,
    copy_rows_i32: Kernel,
    gather_i32: Kernel,
    scan_i32: Kernel,
    ragged_pack_i32: Kernel,
    ragged_from_dense_i32: Kernel,
}

impl Kernels {
    /// Compiles (or fetches from the device's cache) the kernel source for `dev`.
    pub fn new(dev: &Device) -> Result<Self> {
        let m = dev.compile(source())?;
        Ok(Kernels {
            fill_i32: m.kernel("hf_fill_i32")?,
            copy_rows_i32: m.kernel("hf_copy_rows_i32")?,
            gather_i32: m.kernel("hf_gather_i32")?,
            scan_i32: m.kernel("hf_exclusive_scan_i32")?,
            ragged_pack_i32: m.kernel("hf_ragged_pack_i32")?,
            ragged_from_dense_i32: m.kernel("hf_ragged_from_dense_i32")?,
        })
    }

    /// Sets every element of `out` to `value`.
    pub fn fill_i32(&self, s: &Stream, out: &View<i32>, value: i32) -> Result<()> {
        let n = u32_of("fill_i32", "out.len()", out.len())?;
        s.launch_dependent(&self.fill_i32, stride_grid(out.len(), 256), &[out.into(), value.into(), n.into()])?;
        Ok(())
    }

    /// Copies a `[rows, cols]` block: `dst[r·dst_stride + c] = src[r·src_stride + c]`. Strides and
    /// sizes are in elements; both views must hold the whole block.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_rows_i32(
        &self,
        s: &Stream,
        src: &View<i32>,
        dst: &View<i32>,
        rows: usize,
        cols: usize,
        src_stride: usize,
        dst_stride: usize,
    ) -> Result<()> {
        const OP: &str = "copy_rows_i32";
        if cols > src_stride || cols > dst_stride {
            return Err(shape(OP, format!("cols {cols} exceeds a stride (src {src_stride}, dst {dst_stride})")));
        }
        // Elements a view must hold; None where the block's extent overflows.
        let extent =
            |stride: usize| if rows == 0 { Some(0) } else { (rows - 1).checked_mul(stride)?.checked_add(cols) };
        let (Some(need_src), Some(need_dst)) = (extent(src_stride), extent(dst_stride)) else {
            return Err(shape(
                OP,
                format!(
                    "[{rows}, {cols}] with strides {src_stride}/{dst_stride} spans more elements than usize counts"
                ),
            ));
        };
        if src.len() < need_src || dst.len() < need_dst {
            return Err(shape(
                OP,
                format!(
                    "[{rows}, {cols}] with strides {src_stride}/{dst_stride} needs {need_src}/{need_dst} elements, \
                     views hold {}/{}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        let args = [
            src.into(),
            dst.into(),
            u32_of(OP, "rows", rows)?.into(),
            u32_of(OP, "cols", cols)?.into(),
            u32_of(OP, "src_stride", src_stride)?.into(),
            u32_of(OP, "dst_stride", dst_stride)?.into(),
        ];
        s.launch_dependent(&self.copy_rows_i32, row_grid(rows, 128), &args)?;
        Ok(())
    }

    /// `out[i] = src[idx[i]]` for every `i < out.len()`, and -1 where `idx[i]` is outside
    /// `[0, src.len())`. `idx` must hold at least `out.len()` elements.
    pub fn gather_i32(&self, s: &Stream, src: &View<i32>, idx: &View<i32>, out: &View<i32>) -> Result<()> {
        const OP: &str = "gather_i32";
        if idx.len() < out.len() {
            return Err(shape(OP, format!("idx holds {} elements, out needs {}", idx.len(), out.len())));
        }
        let args = [
            src.into(),
            idx.into(),
            out.into(),
            u32_of(OP, "out.len()", out.len())?.into(),
            u32_of(OP, "src.len()", src.len())?.into(),
        ];
        s.launch_dependent(&self.gather_i32, stride_grid(out.len(), 256), &args)?;
        Ok(())
    }

    /// `indptr[0] = 0`, `indptr[r + 1] = Σ_{q ≤ r} len[q]`; `indptr.len()` must be `len.len() + 1`.
    /// One block; any length (the block walks it in [`SCAN_THREADS`] contiguous chunks).
    pub fn exclusive_scan_i32(&self, s: &Stream, len: &View<i32>, indptr: &View<i32>) -> Result<()> {
        const OP: &str = "exclusive_scan_i32";
        if indptr.len() != len.len() + 1 {
            return Err(shape(
                OP,
                format!("indptr holds {} elements, expected len + 1 = {}", indptr.len(), len.len() + 1),
            ));
        }
        let n = u32_of(OP, "len.len()", len.len())?;
        s.launch_dependent(
            &self.scan_i32,
            LaunchConfig::blocks(1, SCAN_THREADS),
            &[len.into(), indptr.into(), n.into()],
        )?;
        Ok(())
    }

    /// Packs the first `len[r]` entries (clamped to `[0, width]`) of each row of `dense [rows,
    /// width]` to `flat[indptr[r]..]`, with `rows = len.len()`. `indptr` must be the exclusive scan
    /// of the clamped lengths (at least `rows + 1` elements) and `flat` must hold `rows × width`,
    /// so every valid input fits whatever the lengths. With `range = Some((lo, hi))`, values
    /// outside `[lo, hi)` are written as -1. Entries of `flat` past `indptr[rows]` are untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn ragged_pack_i32(
        &self,
        s: &Stream,
        dense: &View<i32>,
        len: &View<i32>,
        indptr: &View<i32>,
        flat: &View<i32>,
        width: usize,
        range: Option<(i32, i32)>,
    ) -> Result<()> {
        let k = (&self.ragged_pack_i32, 128);
        launch_pack("ragged_pack_i32", k, s, dense, len, indptr, flat, width, range)
    }

    /// [`Kernels::exclusive_scan_i32`] of the clamped lengths into `indptr`, then
    /// [`Kernels::ragged_pack_i32`], in one launch (one block per row, each summing the clamped
    /// lengths before its row): `indptr[0] = 0`, `indptr[r + 1] = Σ_{q ≤ r} clamp(len[q], 0,
    /// width)`, and row r's first `clamp(len[r], 0, width)` entries of `dense [rows, width]` at
    /// `flat[indptr[r]..]`, with `rows = len.len()`. Same shape rules and `range` as the pack.
    #[allow(clippy::too_many_arguments)]
    pub fn ragged_from_dense_i32(
        &self,
        s: &Stream,
        dense: &View<i32>,
        len: &View<i32>,
        indptr: &View<i32>,
        flat: &View<i32>,
        width: usize,
        range: Option<(i32, i32)>,
    ) -> Result<()> {
        let k = (&self.ragged_from_dense_i32, RAGGED_FROM_DENSE_THREADS);
        launch_pack("ragged_from_dense_i32", k, s, dense, len, indptr, flat, width, range)
    }
}
