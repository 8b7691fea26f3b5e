//! The DeepSeek-V4 KV compressor (spec §5.7): per-token states into an f32 state cache, and for
//! every window of `ratio` tokens that completes, gated pooling → RMSNorm → RoPE → one bf16 entry
//! of the compressed cache.
//!
//! Per step the caller hands [`Compressor::run`] each token's projection `kv_score [T, 2·dim]`
//! (kv = first `dim`, score = last `dim`). Two launches on the step's stream, no host sync, launch
//! shapes from the layout's padded token count only:
//! 1. **store**: every real token (slot ≥ 0, request ≥ 0) copies its row to `state` at its
//!    main-table slot `block_table_kv[table_rows[req]][pos / bs]·bs + pos % bs`.
//! 2. **pool**: every real token with `(pos + 1) % ratio == 0` reads the `ratio` states of its
//!    window (positions `pos + 1 − ratio ..= pos`; earlier steps may have written some of them)
//!    and per channel `c` computes, in f32 and in the fixed order `j = 0 .. ratio`,
//!    `m = max_j s_j`, `s_j = score_j[c] + ape[j][c]`, `e[c] = Σ_j exp(s_j − m)·kv_j[c] /
//!    Σ_j exp(s_j − m)`; then `y = e · (Σ_c e[c]² / dim + eps)^{-1/2} · norm`, RoPE on the last
//!    `rope_dim` channels (interleaved pairs `(2i, 2i + 1)` of that part, angle `cpos ·
//!    theta^(−2i / rope_dim)`, `cpos = pos + 1 − ratio`, the window's first position), rounded to
//!    bf16 and written at compressed slot `i = (pos + 1) / ratio − 1` →
//!    `block_table_kv[table_rows[req]][i / cbs]·cbs + i % cbs`, `cbs = bs / ratio`.
//!
//! Because `bs` is a multiple of `ratio` and windows start at multiples of `ratio`, a window never
//! straddles a block: its states are `ratio` consecutive rows of the state cache.
//!
//! ## Simplifications against vLLM
//! - **No overlapping windows.** vLLM's ratio-4 compressor projects `coff = 2` halves and pools
//!   overlapping windows of 8 tokens; here every compressed entry pools exactly its own `ratio`
//!   tokens (`coff = 1` for both ratios).
//! - **The state cache keeps every token's state**, addressed like the main KV cache (same block
//!   table, same slots), where vLLM keeps only the open window per request. It costs
//!   `2·dim·4` bytes per cached token, but it needs no separate block table or per-request ring
//!   buffer, a window spanning several steps (or chunks) is always readable, and prefix-cached
//!   blocks stay consistent with the compressed entries made from them.
//! - No FP8 quantisation of the compressed entries: the cache is bf16.
//!
//! Batch invariance: a token's output depends only on its own window's states and the weights;
//! every reduction runs in a fixed order inside one block. The sum of squares is a block
//! reduction on the GPU and a sequential sum on the CPU, so the two agree to rounding (bf16 within
//! 1e-2 relative L2), and each agrees with itself bit for bit.

use std::sync::OnceLock;

use holdfast_hal::{
    bf16, CpuLaunch, CpuPtr, Device, Kernel, KernelEntry, KernelSource, LaunchConfig, Param, ScalarKind, Stream, View,
};
use rayon::prelude::*;

use crate::common::{counting_syncs, BlockTableConfig, BuildStats, CommonAttentionMetadata, CommonConfig, TableKind};
use crate::error::{AttentionError, Result};

const CODE: &str = r#"
#define HF_CMP_THREADS 128

__device__ __forceinline__ int64_t hf_cmp_slot(const int32_t* row, int32_t p, int32_t bs) {
    return (int64_t)row[p / bs] * bs + p % bs;
}

// state[slot(t)] = kv_score[t] (2 * dim floats) for every real token t < n. One block per token.
HF_KERNEL void hf_dsv4_compressor_store(const float* kv_score, const int32_t* positions, const int32_t* slots,
                                        const int32_t* tok_req, const int32_t* table_rows,
                                        const int32_t* block_table, float* state, uint32_t n, uint32_t dim,
                                        uint32_t bs, uint32_t bt_width,
                                        uint32_t state_rows) {
    hf_dependent_kernel_start();
    const uint32_t w = 2u * dim;
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        int32_t req = tok_req[t];
        if (slots[t] < 0 || req < 0) continue;
        int64_t s = hf_cmp_slot(block_table + (uint64_t)table_rows[req] * bt_width, positions[t], (int32_t)bs);
        if (s < 0 || s >= (int64_t)state_rows) continue;
        for (uint32_t c = threadIdx.x; c < w; c += blockDim.x)
            state[(uint64_t)s * w + c] = kv_score[(uint64_t)t * w + c];
    }
}

// One block per token; a token whose position completes a window pools it into one bf16 entry.
// Dynamic shared memory: dim floats (the pooled row).
HF_KERNEL void hf_dsv4_compressor_pool(const float* state, const float* ape, const hf_bf16* norm,
                                       const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                       const int32_t* table_rows, const int32_t* block_table, hf_bf16* cache,
                                       uint32_t n, uint32_t ratio,
                                       uint32_t dim, uint32_t rope_dim, uint32_t bs, uint32_t bt_width,
                                       uint32_t state_rows, uint32_t cache_rows, float rope_theta, float eps) {
    hf_dependent_kernel_start();
    extern __shared__ float pooled[];
    __shared__ float part[HF_CMP_THREADS / 16];
    __shared__ float inv_rms;
    const uint32_t w = 2u * dim;
    const uint32_t cbs = bs / ratio;
    const uint32_t nope = dim - rope_dim;
    const uint32_t warp = threadIdx.x / HF_WARP_SIZE, lane = threadIdx.x % HF_WARP_SIZE;
    const uint32_t warps = (blockDim.x + HF_WARP_SIZE - 1) / HF_WARP_SIZE;
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        int32_t req = tok_req[t];
        if (slots[t] < 0 || req < 0) continue;
        int32_t pos = positions[t];
        if (((uint32_t)pos + 1u) % ratio != 0u) continue;
        const int32_t* row = block_table + (uint64_t)table_rows[req] * bt_width;
        int32_t start = pos + 1 - (int32_t)ratio;
        int64_t base = hf_cmp_slot(row, start, (int32_t)bs);  // the window's ratio consecutive rows
        int32_t ci = (pos + 1) / (int32_t)ratio - 1;
        int64_t dst = hf_cmp_slot(row, ci, (int32_t)cbs);
        if (base < 0 || base + ratio > (int64_t)state_rows || dst < 0 || dst >= (int64_t)cache_rows) continue;
        const float* win = state + (uint64_t)base * w;
        __syncthreads();  // the previous token's readers of pooled / inv_rms are done
        float ss = 0.0f;
        for (uint32_t c = threadIdx.x; c < dim; c += blockDim.x) {
            float m = win[dim + c] + ape[c];
            for (uint32_t j = 1; j < ratio; ++j) m = fmaxf(m, win[(uint64_t)j * w + dim + c] + ape[(uint64_t)j * dim + c]);
            float num = 0.0f, den = 0.0f;
            for (uint32_t j = 0; j < ratio; ++j) {
                float p = expf(win[(uint64_t)j * w + dim + c] + ape[(uint64_t)j * dim + c] - m);
                num += p * win[(uint64_t)j * w + c];
                den += p;
            }
            float e = num / den;
            pooled[c] = e;
            ss += e * e;
        }
        ss = hf_warp_sum(ss);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            float tot = 0.0f;
            for (uint32_t i = 0; i < warps; ++i) tot += part[i];
            inv_rms = 1.0f / sqrtf(tot / (float)dim + eps);
        }
        __syncthreads();
        const float r = inv_rms;
        const float cpos = (float)start;
        for (uint32_t c = threadIdx.x; c < dim; c += blockDim.x) {
            float y = pooled[c] * r * hf_bf16_to_f32(norm[c]);
            if (c >= nope) {
                uint32_t k = c - nope, i = k / 2u;
                uint32_t pc = nope + (k ^ 1u);
                float yp = pooled[pc] * r * hf_bf16_to_f32(norm[pc]);
                float ang = cpos * powf(rope_theta, -(float)(2u * i) / (float)rope_dim);
                float cs = cosf(ang), sn = sinf(ang);
                y = (k & 1u) == 0u ? y * cs - yp * sn : yp * sn + y * cs;
            }
            cache[(uint64_t)dst * dim + c] = hf_f32_to_bf16(y);
        }
    }
}
"#;

/// Threads per block of the compressor kernels.
pub const COMPRESSOR_THREADS: u32 = 128;

fn store_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (kv, pos, slots, req) = (l.ptr::<f32>(0)?, l.ptr::<i32>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let (table_rows, bt, state) = (l.ptr::<i32>(4)?, l.ptr::<i32>(5)?, l.ptr::<f32>(6)?);
    let (n, dim, bs, btw, rows) = (l.count(7)?, l.count(8)?, l.count(9)? as i64, l.count(10)?, l.count(11)? as i64);
    let w = 2 * dim;
    for t in 0..n {
        let r = req.get(t)?;
        if slots.get(t)? < 0 || r < 0 {
            continue;
        }
        let tr = i64::from(table_rows.get_signed(i64::from(r))?);
        let s = table_slot(&bt, tr, btw, i64::from(pos.get(t)?), bs)?;
        if s < 0 || s >= rows {
            continue;
        }
        state.write(s as usize * w, &kv.read(t * w, w)?)?;
    }
    Ok(())
}

fn table_slot(bt: &CpuPtr<'_, i32>, row: i64, width: usize, p: i64, bs: i64) -> holdfast_hal::Result<i64> {
    Ok(i64::from(bt.get_signed(row * width as i64 + p / bs)?) * bs + p % bs)
}

/// Shape of one pooling launch.
#[derive(Clone, Copy)]
struct PoolShape {
    ratio: usize,
    dim: usize,
    rope_dim: usize,
    theta: f32,
    eps: f32,
}

/// One window's entry, in the kernel's order: `win` is `[ratio, 2·dim]` states, `ape [ratio, dim]`,
/// `norm [dim]` as f32, `start` the window's first position.
fn pool_row(win: &[f32], ape: &[f32], norm: &[f32], start: i64, p: PoolShape) -> Vec<bf16> {
    let (dim, ratio) = (p.dim, p.ratio);
    let w = 2 * dim;
    let mut pooled = vec![0f32; dim];
    let mut ss = 0f32;
    for (c, e_out) in pooled.iter_mut().enumerate() {
        let s = |j: usize| win[j * w + dim + c] + ape[j * dim + c];
        let m = (1..ratio).fold(s(0), |m, j| m.max(s(j)));
        let (mut num, mut den) = (0f32, 0f32);
        for j in 0..ratio {
            let e = (s(j) - m).exp();
            num += e * win[j * w + c];
            den += e;
        }
        let e = num / den;
        *e_out = e;
        ss += e * e;
    }
    let r = 1.0 / (ss / dim as f32 + p.eps).sqrt();
    let nope = dim - p.rope_dim;
    let cpos = start as f32;
    (0..dim)
        .map(|c| {
            let mut y = pooled[c] * r * norm[c];
            if c >= nope {
                let k = c - nope;
                let i = k / 2;
                let pc = nope + (k ^ 1);
                let yp = pooled[pc] * r * norm[pc];
                let ang = cpos * p.theta.powf(-((2 * i) as f32) / p.rope_dim as f32);
                let (sn, cs) = ang.sin_cos();
                y = if k & 1 == 0 { y * cs - yp * sn } else { yp * sn + y * cs };
            }
            bf16::from_f32(y)
        })
        .collect()
}

fn pool_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (state, ape, norm) = (l.ptr::<f32>(0)?, l.ptr::<f32>(1)?, l.ptr::<bf16>(2)?);
    let (pos, slots, req, table_rows) = (l.ptr::<i32>(3)?, l.ptr::<i32>(4)?, l.ptr::<i32>(5)?, l.ptr::<i32>(6)?);
    let (bt, cache) = (l.ptr::<i32>(7)?, l.ptr::<bf16>(8)?);
    let (n, ratio, dim, rope_dim) = (l.count(9)?, l.count(10)?, l.count(11)?, l.count(12)?);
    let (bs, btw, srows, crows) = (l.count(13)? as i64, l.count(14)?, l.count(15)? as i64, l.count(16)? as i64);
    let shape = PoolShape { ratio, dim, rope_dim, theta: l.f32(17)?, eps: l.f32(18)? };
    let cbs = bs / ratio as i64;
    let w = 2 * dim;
    // Gather the windows through the checked pointers, pool them in parallel, then write.
    let mut jobs = Vec::new();
    for t in 0..n {
        let r = req.get(t)?;
        if slots.get(t)? < 0 || r < 0 {
            continue;
        }
        let p = i64::from(pos.get(t)?);
        if (p + 1) % ratio as i64 != 0 {
            continue;
        }
        let start = p + 1 - ratio as i64;
        let tr = i64::from(table_rows.get_signed(i64::from(r))?);
        let base = table_slot(&bt, tr, btw, start, bs)?;
        let dst = table_slot(&bt, tr, btw, (p + 1) / ratio as i64 - 1, cbs)?;
        if base < 0 || base + ratio as i64 > srows || dst < 0 || dst >= crows {
            continue;
        }
        jobs.push((dst as usize, start, state.read(base as usize * w, ratio * w)?));
    }
    if jobs.is_empty() {
        return Ok(());
    }
    let ape = ape.read(0, ratio * dim)?;
    let norm: Vec<f32> = norm.read(0, dim)?.iter().map(|x| x.to_f32()).collect();
    let rows: Vec<Vec<bf16>> =
        jobs.par_iter().map(|(_, start, win)| pool_row(win, &ape, &norm, *start, shape)).collect();
    for ((dst, _, _), row) in jobs.iter().zip(&rows) {
        cache.write(dst * dim, row)?;
    }
    Ok(())
}

/// The compressor's kernel source (`hf_dsv4_compressor_store`, `hf_dsv4_compressor_pool`).
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        let f = |n| Param::scalar(n, ScalarKind::F32);
        let inp = Param::input::<i32>;
        KernelSource {
            name: "holdfast_compressor",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_dsv4_compressor_store",
                    params: vec![
                        Param::input::<f32>("kv_score"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        Param::output::<f32>("state"),
                        u("n"),
                        u("dim"),
                        u("bs"),
                        u("bt_width"),
                        u("state_rows"),
                    ],
                    cpu: store_ref,
                },
                KernelEntry {
                    name: "hf_dsv4_compressor_pool",
                    params: vec![
                        Param::input::<f32>("state"),
                        Param::input::<f32>("ape"),
                        Param::input::<bf16>("norm"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        Param::output::<bf16>("cache"),
                        u("n"),
                        u("ratio"),
                        u("dim"),
                        u("rope_dim"),
                        u("bs"),
                        u("bt_width"),
                        u("state_rows"),
                        u("cache_rows"),
                        f("rope_theta"),
                        f("eps"),
                    ],
                    cpu: pool_ref,
                },
            ],
        }
    })
}

fn shape(op: &'static str, detail: String) -> AttentionError {
    AttentionError::Shape { op, detail }
}

/// Weights of one compressor.
#[derive(Clone, Copy, Debug)]
pub struct CompressorWeights<'a> {
    /// `[ratio, dim]` f32 positional bias added to the scores of window position `j`.
    pub ape: &'a View<f32>,
    /// `[dim]` bf16 RMSNorm weight.
    pub norm: &'a View<bf16>,
}

/// One DeepSeek-V4 KV compressor (ratio 4 or 128) compiled for one device; see the
/// [module docs](self) for what a step computes.
#[derive(Clone, Debug)]
pub struct Compressor {
    ratio: usize,
    dim: usize,
    rope_dim: usize,
    rope_theta: f32,
    eps: f32,
    table: BlockTableConfig,
    store: Kernel,
    pool: Kernel,
}

impl Compressor {
    /// A compressor of `ratio` (4 or 128) tokens per entry, entries of `dim` channels (512 for the
    /// main KV, 128 for the indexer K) of which the last `rope_dim` (even, ≤ `dim`) are rotated with
    /// base `rope_theta`; `eps` is the RMSNorm epsilon. `cfg.kv_table.block_size` (tokens per main
    /// block) must be a multiple of `ratio`.
    pub fn new(
        dev: &Device,
        cfg: &CommonConfig,
        ratio: usize,
        dim: usize,
        rope_dim: usize,
        rope_theta: f32,
        eps: f32,
    ) -> Result<Self> {
        const OP: &str = "Compressor::new";
        if ratio != 4 && ratio != 128 {
            return Err(shape(OP, format!("ratio {ratio} is not a DeepSeek-V4 compress ratio (4 or 128)")));
        }
        if dim == 0 || dim > u32::MAX as usize / 2 {
            return Err(shape(OP, format!("dim {dim} must lie in [1, 2^31)")));
        }
        if rope_dim > dim || !rope_dim.is_multiple_of(2) {
            return Err(shape(OP, format!("rope_dim {rope_dim} must be even and at most dim {dim}")));
        }
        if dim * 4 > 48 * 1024 {
            return Err(shape(OP, format!("dim {dim} exceeds the 12288 channels one block pools in shared memory")));
        }
        if !(rope_theta.is_finite() && rope_theta > 0.0 && eps.is_finite() && eps >= 0.0) {
            return Err(shape(OP, format!("rope_theta {rope_theta} must be positive and eps {eps} non-negative")));
        }
        let table = cfg.kv_table;
        if !table.block_size.is_multiple_of(ratio) {
            return Err(AttentionError::Config(format!(
                "{OP}: KV block size {} is not a multiple of ratio {ratio}",
                table.block_size
            )));
        }
        let rows = table.num_blocks.checked_mul(table.block_size).filter(|r| r.checked_mul(2 * dim).is_some());
        if rows.is_none_or(|r| r > u32::MAX as usize) {
            return Err(AttentionError::Config(format!(
                "{OP}: {} blocks × {} tokens × 2·{dim} state floats overflow",
                table.num_blocks, table.block_size
            )));
        }
        let m = dev.compile(source())?;
        Ok(Compressor {
            ratio,
            dim,
            rope_dim,
            rope_theta,
            eps,
            table,
            store: m.kernel("hf_dsv4_compressor_store")?,
            pool: m.kernel("hf_dsv4_compressor_pool")?,
        })
    }

    /// Tokens per compressed entry.
    pub fn ratio(&self) -> usize {
        self.ratio
    }

    /// Channels per entry.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Rows of the state cache: `kv_table.num_blocks · block_size` (one per main-cache slot).
    pub fn state_rows(&self) -> usize {
        self.table.num_blocks * self.table.block_size
    }

    /// Rows of the compressed cache: `kv_table.num_blocks · (block_size / ratio)`.
    pub fn cache_rows(&self) -> usize {
        self.table.num_blocks * (self.table.block_size / self.ratio)
    }

    /// Elements (f32) of the state cache: `state_rows · 2·dim` (kv then score per row).
    pub fn state_len(&self) -> usize {
        self.state_rows() * 2 * self.dim
    }

    /// Elements (bf16) of the compressed cache: `cache_rows · dim`.
    pub fn cache_len(&self) -> usize {
        self.cache_rows() * self.dim
    }

    /// One step on `s`: stores every real token's `kv_score` row (`[num_tokens_padded, 2·dim]`
    /// f32) into `state` (`[≥ state_len]` f32) and writes one bf16 entry into `cache`
    /// (`[≥ cache_len]`) per completed window. Two launches, no host sync.
    pub fn run(
        &self,
        s: &Stream,
        common: &CommonAttentionMetadata,
        kv_score: &View<f32>,
        w: &CompressorWeights<'_>,
        state: &View<f32>,
        cache: &View<bf16>,
    ) -> Result<()> {
        self.run_with_stats(s, common, kv_score, w, state, cache).map(|_| ())
    }

    /// As [`Compressor::run`], returning the launches enqueued and the host syncs measured.
    pub fn run_with_stats(
        &self,
        s: &Stream,
        common: &CommonAttentionMetadata,
        kv_score: &View<f32>,
        w: &CompressorWeights<'_>,
        state: &View<f32>,
        cache: &View<bf16>,
    ) -> Result<BuildStats> {
        const OP: &str = "Compressor::run";
        let (ratio, dim) = (self.ratio, self.dim);
        let got = common.table_config(TableKind::Kv);
        if got != self.table {
            return Err(AttentionError::Mismatch(format!(
                "{OP}: common metadata's KV table {got:?}, compressor built for {:?}",
                self.table
            )));
        }
        let layout = common.layout()?;
        let t = layout.num_tokens_padded;
        let checks = [
            ("kv_score", kv_score.len(), t * 2 * dim, format!("[{t} padded tokens, 2·{dim}]")),
            ("ape", w.ape.len(), ratio * dim, format!("[ratio {ratio}, {dim}]")),
            ("norm", w.norm.len(), dim, format!("[{dim}]")),
            ("state", state.len(), self.state_len(), format!("{} rows × 2·{dim}", self.state_rows())),
            ("cache", cache.len(), self.cache_len(), format!("{} rows × {dim}", self.cache_rows())),
        ];
        for (name, len, need, what) in checks {
            if len < need {
                return Err(shape(OP, format!("{name} holds {len} elements, {what} needs {need}")));
            }
        }
        let dev = common.device().clone();
        let (launches, host_syncs) = counting_syncs(&dev, || {
            let (pos, slots, req, rows, bt) = (
                common.positions()?,
                common.slot_mapping()?,
                common.token_to_req()?,
                common.table_rows()?,
                common.block_table(TableKind::Kv)?,
            );
            let grid = t.clamp(1, 65535) as u32;
            let u = |v: usize| v as u32;
            let store = [
                kv_score.into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&rows).into(),
                (&bt).into(),
                state.into(),
                u(t).into(),
                u(dim).into(),
                u(self.table.block_size).into(),
                u(self.table.max_blocks_per_seq).into(),
                u(self.state_rows()).into(),
            ];
            s.launch_dependent(&self.store, LaunchConfig::blocks(grid, COMPRESSOR_THREADS), &store)?;
            let pool = [
                state.into(),
                w.ape.into(),
                w.norm.into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&rows).into(),
                (&bt).into(),
                cache.into(),
                u(t).into(),
                u(ratio).into(),
                u(dim).into(),
                u(self.rope_dim).into(),
                u(self.table.block_size).into(),
                u(self.table.max_blocks_per_seq).into(),
                u(self.state_rows()).into(),
                u(self.cache_rows()).into(),
                self.rope_theta.into(),
                self.eps.into(),
            ];
            let cfg =
                LaunchConfig { shared_mem_bytes: (dim * 4) as u32, ..LaunchConfig::blocks(grid, COMPRESSOR_THREADS) };
            s.launch_dependent(&self.pool, cfg, &pool)?;
            Ok(2)
        })?;
        Ok(BuildStats { launches, host_syncs })
    }
}
