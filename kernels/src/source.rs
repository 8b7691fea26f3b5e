//! The kernel source: CUDA C that is also valid HIP, and the CPU references.
//!
//! Every kernel here moves or rearranges 32-bit integers (indices, lengths, slots), so the CPU
//! references and the device kernels agree bit for bit by construction.

use std::sync::OnceLock;

use holdfast_hal::{CpuLaunch, KernelEntry, KernelSource, Param, Result, ScalarKind};

const CODE: &str = r#"
// Every entry is launched dependent and waits for the kernel before it as its first statement,
// without letting the next launch begin early (see dense.cu).
// out[i] = value for i < n.
HF_KERNEL void hf_fill_i32(int32_t* out, int32_t value, uint32_t n) {
    hf_grid_dependency_wait();
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = value;
}

// dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows, c < cols (one block per row).
HF_KERNEL void hf_copy_rows_i32(const int32_t* src, int32_t* dst, uint32_t rows, uint32_t cols,
                                uint32_t src_stride, uint32_t dst_stride) {
    hf_grid_dependency_wait();
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
        for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x)
            dst[(uint64_t)r * dst_stride + c] = src[(uint64_t)r * src_stride + c];
}

// out[i] = 0 <= idx[i] < src_len ? src[idx[i]] : -1 for i < n.
HF_KERNEL void hf_gather_i32(const int32_t* src, const int32_t* idx, int32_t* out, uint32_t n, uint32_t src_len) {
    hf_grid_dependency_wait();
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int32_t j = idx[i];
        out[i] = (j >= 0 && (uint32_t)j < src_len) ? src[j] : -1;
    }
}

// indptr[0] = 0, indptr[r + 1] = len[0] + ... + len[r] for r < n. One block of HF_SCAN_THREADS
// threads; thread t owns a contiguous chunk of ceil(n / threads) lengths.
#define HF_SCAN_THREADS 1024
HF_KERNEL void hf_exclusive_scan_i32(const int32_t* len, int32_t* indptr, uint32_t n) {
    hf_grid_dependency_wait();
    __shared__ int32_t sums[HF_SCAN_THREADS];
    uint32_t t = threadIdx.x;
    uint32_t chunk = (n + HF_SCAN_THREADS - 1) / HF_SCAN_THREADS;
    uint32_t begin = t * chunk;
    uint32_t end = begin + chunk < n ? begin + chunk : n;
    int32_t local = 0;
    for (uint32_t i = begin; i < end; ++i) local += len[i];
    sums[t] = local;
    __syncthreads();
    // Inclusive Hillis-Steele scan over the per-thread sums.
    for (uint32_t off = 1; off < HF_SCAN_THREADS; off <<= 1) {
        int32_t v = t >= off ? sums[t - off] : 0;
        __syncthreads();
        sums[t] += v;
        __syncthreads();
    }
    int32_t run = t == 0 ? 0 : sums[t - 1];
    if (t == 0) indptr[0] = 0;
    for (uint32_t i = begin; i < end; ++i) {
        run += len[i];
        indptr[i + 1] = run;
    }
}

// flat[indptr[r] + j] = dense[r * width + j] for j < len[r] (one block per row). With check != 0,
// values outside [lo, hi) are written as -1.
HF_KERNEL void hf_ragged_pack_i32(const int32_t* dense, const int32_t* len, const int32_t* indptr, int32_t* flat,
                                  uint32_t rows, uint32_t width, int32_t lo, int32_t hi, uint32_t check) {
    hf_grid_dependency_wait();
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        int32_t l = len[r];
        uint32_t n = l < 0 ? 0u : ((uint32_t)l < width ? (uint32_t)l : width);
        int32_t base = indptr[r];
        for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
            int32_t v = dense[(uint64_t)r * width + j];
            if (check != 0u && (v < lo || v >= hi)) v = -1;
            flat[base + j] = v;
        }
    }
}

// The scan and the pack in one launch: indptr[0] = 0, indptr[r + 1] = n_0 + ... + n_r with
// n_q = clamp(len[q], 0, width), and flat[indptr[r] + j] = dense[r * width + j] for j < n_r
// (range-checked as hf_ragged_pack_i32). One block of HF_RFD_THREADS threads per row (a
// grid-stride loop): the block sums the clamped lengths before its row (integers, so the order
// does not matter), then copies the row.
#define HF_RFD_THREADS 128
HF_KERNEL void hf_ragged_from_dense_i32(const int32_t* dense, const int32_t* len, int32_t* indptr, int32_t* flat,
                                        uint32_t rows, uint32_t width, int32_t lo, int32_t hi, uint32_t check) {
    hf_grid_dependency_wait();
    __shared__ int32_t part[HF_RFD_THREADS];
    if (blockIdx.x == 0 && threadIdx.x == 0) indptr[0] = 0;
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const int32_t before = hf_thread_sum_below(r, [&](uint32_t q) { return hf_clamp_len(len[q], width); });
        const int32_t base = hf_block_sum_i32(before, part);
        const int32_t n = hf_clamp_len(len[r], width);
        if (threadIdx.x == 0) indptr[r + 1] = base + n;
        for (uint32_t j = threadIdx.x; j < (uint32_t)n; j += HF_RFD_THREADS) {
            int32_t v = dense[(uint64_t)r * width + j];
            if (check != 0u && (v < lo || v >= hi)) v = -1;
            flat[base + j] = v;
        }
    }
}
"#;

/// Threads of a `ragged_from_dense_i32` block (one block per row).
pub const RAGGED_FROM_DENSE_THREADS: u32 = 128;

/// Threads of the single scan block (also the CPU reference's chunking).
pub const SCAN_THREADS: u32 = 1024;

fn fill_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let out = l.ptr::<i32>(0)?;
    let (v, n) = (l.i32(1)?, l.count(2)?);
    out.fill(0, n, v)
}

fn copy_rows_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let (src, dst) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?);
    let (rows, cols, ss, ds) = (l.count(2)?, l.count(3)?, l.count(4)?, l.count(5)?);
    for r in 0..rows {
        let row = src.read(r * ss, cols)?;
        dst.write(r * ds, &row)?;
    }
    Ok(())
}

fn gather_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let (src, idx, out) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?);
    let (n, src_len) = (l.count(3)?, l.count(4)?);
    let ids = idx.read(0, n)?;
    for (i, j) in ids.into_iter().enumerate() {
        let v = if j >= 0 && (j as usize) < src_len { src.get(j as usize)? } else { -1 };
        out.set(i, v)?;
    }
    Ok(())
}

fn exclusive_scan_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let (len, indptr) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?);
    let n = l.count(2)?;
    let lens = len.read(0, n)?;
    let mut out = Vec::with_capacity(n + 1);
    let mut run = 0i32;
    out.push(0);
    for v in lens {
        // Two's-complement wrap, as the device's int32 adds do.
        run = run.wrapping_add(v);
        out.push(run);
    }
    indptr.write(0, &out)
}

fn ragged_pack_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let (len, indptr) = (l.ptr::<i32>(1)?, l.ptr::<i32>(2)?);
    let rows = l.count(4)?;
    pack_rows(l, &len.read(0, rows)?, &indptr.read(0, rows)?)
}

/// The packs' row copies (arguments as `hf_ragged_pack_i32`'s): row r's first `clamp(lens[r], 0,
/// width)` entries of `dense` to `flat[starts[r]..]`, range-checked when asked.
fn pack_rows(l: &CpuLaunch<'_>, lens: &[i32], starts: &[i32]) -> Result<()> {
    let (dense, flat) = (l.ptr::<i32>(0)?, l.ptr::<i32>(3)?);
    let (rows, width) = (l.count(4)?, l.count(5)?);
    let (lo, hi, check) = (l.i32(6)?, l.i32(7)?, l.u32(8)? != 0);
    for r in 0..rows {
        let n = (lens[r].max(0) as usize).min(width);
        if n == 0 {
            continue;
        }
        let mut row = dense.read(r * width, n)?;
        if check {
            row.iter_mut().filter(|v| **v < lo || **v >= hi).for_each(|v| *v = -1);
        }
        let base =
            usize::try_from(starts[r]).map_err(|_| l.fail(format!("indptr[{r}] = {} is negative", starts[r])))?;
        flat.write(base, &row)?;
    }
    Ok(())
}

/// The scan of the clamped lengths, then the pack (the device kernel's result, exactly).
fn ragged_from_dense_i32(l: &CpuLaunch<'_>) -> Result<()> {
    let (len, indptr) = (l.ptr::<i32>(1)?, l.ptr::<i32>(2)?);
    let (rows, width) = (l.count(4)?, l.count(5)?);
    let lens = len.read(0, rows)?;
    let mut starts = Vec::with_capacity(rows + 1);
    starts.push(0i32);
    for (r, v) in lens.iter().enumerate() {
        starts.push(starts[r].wrapping_add((*v).clamp(0, i32::try_from(width).unwrap_or(i32::MAX))));
    }
    pack_rows(l, &lens, &starts[..rows])?;
    indptr.write(0, &starts)
}

/// The `holdfast_kernels` source with all entry points.
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        let i = |n| Param::scalar(n, ScalarKind::I32);
        // The ragged pack's signature; `indptr` is read by the pack and written by the fused scan.
        let pack = |indptr: Param| {
            vec![
                Param::input::<i32>("dense"),
                Param::input::<i32>("len"),
                indptr,
                Param::output::<i32>("flat"),
                u("rows"),
                u("width"),
                i("lo"),
                i("hi"),
                u("check"),
            ]
        };
        KernelSource {
            name: "holdfast_kernels",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_fill_i32",
                    params: vec![Param::output::<i32>("out"), i("value"), u("n")],
                    cpu: fill_i32,
                },
                KernelEntry {
                    name: "hf_copy_rows_i32",
                    params: vec![
                        Param::input::<i32>("src"),
                        Param::output::<i32>("dst"),
                        u("rows"),
                        u("cols"),
                        u("src_stride"),
                        u("dst_stride"),
                    ],
                    cpu: copy_rows_i32,
                },
                KernelEntry {
                    name: "hf_gather_i32",
                    params: vec![
                        Param::input::<i32>("src"),
                        Param::input::<i32>("idx"),
                        Param::output::<i32>("out"),
                        u("n"),
                        u("src_len"),
                    ],
                    cpu: gather_i32,
                },
                KernelEntry {
                    name: "hf_exclusive_scan_i32",
                    params: vec![Param::input::<i32>("len"), Param::output::<i32>("indptr"), u("n")],
                    cpu: exclusive_scan_i32,
                },
                KernelEntry {
                    name: "hf_ragged_pack_i32",
                    params: pack(Param::input::<i32>("indptr")),
                    cpu: ragged_pack_i32,
                },
                KernelEntry {
                    name: "hf_ragged_from_dense_i32",
                    params: pack(Param::output::<i32>("indptr")),
                    cpu: ragged_from_dense_i32,
                },
            ],
        }
    })
}
