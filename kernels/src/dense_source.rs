//! The dense ops' kernel source (`dense.cu`, `dense_mma.cu`) and its CPU references.
//!
//! The references follow the device kernels' arithmetic: the SIMT matmul (tiled and small-t) runs
//! one `mul_add` chain per output over k in order and `rms_norm` the same 256 partial sums and
//! tree as the device block, so both agree with a GPU bit for bit; the tensor-core matmul's
//! reference runs its split order as `mul_add` chains and agrees to f32 rounding (the hardware
//! orders the sums inside one 16-wide k step itself); `argmax`, `embed`, `repeat_rows` and
//! `to_bf16` are exact by construction. `rope` and `swiglu` call libm (`powf`, `sin`/`cos`, `exp`), whose last-ulp results
//! differ between the CPU and a GPU's math library, so those two match within a few ulps of f32
//! before the bf16 rounding (tests compare them with a tolerance).

use std::sync::OnceLock;

use holdfast_hal::{bf16, CpuLaunch, KernelEntry, KernelSource, Param, Result, ScalarKind};
use rayon::prelude::*;

const CODE: &str = concat!(include_str!("dense.cu"), include_str!("dense_mma.cu"));

/// Rows of a matmul block tile (tokens).
pub const MATMUL_BM: usize = 32;
/// Columns of a matmul block tile (output features).
pub const MATMUL_BN: usize = 128;
/// Threads of a matmul block.
pub const MATMUL_THREADS: u32 = 256;
/// Most token rows that run the small-t (decode) matmul kernel; larger `t` runs the tiled one.
pub const MATMUL_SMALL_T_MAX: usize = 8;
/// Output columns of a small-t matmul block (one per thread).
pub const MATMUL_SMALL_T_BN: usize = 128;
/// Threads of a small-t matmul block.
pub const MATMUL_SMALL_T_THREADS: u32 = 128;
/// Warps of a tensor-core matmul block (each takes one k range and 16 output columns).
pub const MATMUL_MMA_WARPS: usize = 8;
/// Most token rows that run the 16-row tensor-core matmul block; larger `t` runs 64-row blocks.
pub const MATMUL_MMA_SMALL_T_MAX: usize = 16;
/// Fewest token rows that may run the tiled (64 × 128 block tile) tensor-core matmul, which
/// also needs [`MATMUL_MMA_TILED_MIN_BLOCKS`] blocks.
pub const MATMUL_MMA_TILED_MIN_T: usize = 65;
/// Fewest blocks (`⌈n / 128⌉ · ⌈t / 64⌉ · groups`) for which the tiled kernel runs instead of
/// the 64-row one (a shape rule, the same on every device).
pub const MATMUL_MMA_TILED_MIN_BLOCKS: usize = 128;

/// The split order's k ranges for reduction length `k`: `(splits, split_len)`. One range below
/// k = 1024, else the largest power of two ≤ k / 512, at most [`MATMUL_MMA_WARPS`]; ranges of
/// `⌈k / splits⌉` rounded up to 32 (the last one ends at k, and may be empty). A function of k
/// alone, so every t, tile and grid sums in the same order.
pub const fn mma_splits(k: usize) -> (usize, usize) {
    let mut splits = 1;
    if k >= 1024 {
        while splits * 2 <= k / 512 && splits * 2 <= MATMUL_MMA_WARPS {
            splits *= 2;
        }
    }
    (splits, k.div_ceil(splits).div_ceil(32) * 32)
}

/// Threads of an `rms_norm` block (one block per row); also the number of partial sums the CPU
/// reference forms, in the same order.
pub const NORM_THREADS: usize = 256;
/// Threads of an `argmax` block (one block per row).
pub const ARGMAX_THREADS: u32 = 256;

fn to_f32(v: Vec<bf16>) -> Vec<f32> {
    v.into_iter().map(bf16::to_f32).collect()
}

/// `out [t, n] = x [t, k] · w [n, k]ᵀ`, each element one `mul_add` chain over k from 0 (the
/// device kernel's order). On x86-64 with AVX and FMA the chains run eight columns to a vector
/// (a fused multiply-add rounds once, as `mul_add` and the device's `fmaf` do, so the bits are
/// the same); elsewhere a portable 4 × 4 scalar tile. Column panels are spread over rayon.
fn gemm_f32(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
    if k == 0 {
        return vec![0f32; t * n];
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("fma") {
        return avx::gemm(x, w, t, n, k);
    }
    gemm_portable(x, w, t, n, k)
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use std::arch::x86_64::{
        __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };

    use rayon::prelude::*;

    /// Columns per panel (one 256-bit vector of f32).
    const W: usize = 8;

    /// `R` rows of x (`[R, k]`) against one packed panel (`[k, 8]`): eight chains per row.
    #[target_feature(enable = "avx,fma")]
    fn panel<const R: usize>(x: &[f32], k: usize, wp: &[f32], out: &mut [[f32; W]]) {
        assert!(x.len() >= R * k && wp.len() >= W * k && out.len() >= R, "panel shapes");
        let mut acc: [__m256; R] = [_mm256_setzero_ps(); R];
        for (kk, wk) in wp.chunks_exact(W).take(k).enumerate() {
            // SAFETY: `wk` holds exactly 8 f32 (chunks_exact), the width of an unaligned load.
            let wv = unsafe { _mm256_loadu_ps(wk.as_ptr()) };
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_set1_ps(x[i * k + kk]), wv, *a);
            }
        }
        for (a, o) in acc.iter().zip(out.iter_mut()) {
            // SAFETY: `o` is an array of 8 f32, the width of an unaligned store.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), *a) };
        }
    }

    /// The rows of one panel, four at a time, then the 1–3 left.
    fn rows(x: &[f32], t: usize, k: usize, wp: &[f32], out: &mut [[f32; W]]) {
        let mut r = 0;
        while r + 4 <= t {
            // SAFETY: `gemm` only calls this after detecting AVX and FMA.
            unsafe { panel::<4>(&x[r * k..], k, wp, &mut out[r..]) };
            r += 4;
        }
        let (xr, or) = (&x[r * k..], &mut out[r..]);
        // SAFETY: as above.
        unsafe {
            match t - r {
                3 => panel::<3>(xr, k, wp, or),
                2 => panel::<2>(xr, k, wp, or),
                1 => panel::<1>(xr, k, wp, or),
                _ => {}
            }
        }
    }

    /// Call only when AVX and FMA are present.
    pub(super) fn gemm(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
        let panels = n.div_ceil(W);
        // w packed k-major per panel of 8 columns, zero columns past n.
        let mut packed = vec![0f32; panels * k * W];
        packed.par_chunks_mut(k * W).enumerate().for_each(|(p, dst)| {
            for j in 0..W.min(n - p * W) {
                let col = &w[(p * W + j) * k..(p * W + j + 1) * k];
                for (kk, v) in col.iter().enumerate() {
                    dst[kk * W + j] = *v;
                }
            }
        });
        let mut yp = vec![[0f32; W]; panels * t];
        if t > 0 {
            yp.par_chunks_mut(t).zip(packed.par_chunks(k * W)).for_each(|(out, wp)| rows(x, t, k, wp, out));
        }
        let mut y = vec![0f32; t * n];
        for (p, out) in yp.chunks(t.max(1)).enumerate() {
            for (r, o) in out.iter().enumerate() {
                let cols = W.min(n - p * W);
                y[r * n + p * W..r * n + p * W + cols].copy_from_slice(&o[..cols]);
            }
        }
        y
    }
}

/// The portable matmul: 4 × 4 scalar tiles of `mul_add` chains over column quads.
fn gemm_portable(x: &[f32], w: &[f32], t: usize, n: usize, k: usize) -> Vec<f32> {
    let t4 = t.div_ceil(4) * 4;
    let n4 = n.div_ceil(4) * 4;
    // Zero rows pad t and n to multiples of 4; their outputs are dropped.
    let mut xp = x[..t * k].to_vec();
    xp.resize(t4 * k, 0.0);
    let mut wp = w[..n * k].to_vec();
    wp.resize(n4 * k, 0.0);
    // Column-quad-major result: quad q holds [t4, 4].
    let mut quads = vec![0f32; n4 * t4];
    quads.par_chunks_mut(4 * t4).enumerate().for_each(|(q, out)| {
        let wq = &wp[4 * q * k..4 * (q + 1) * k];
        let (w0, rest) = wq.split_at(k);
        let (w1, rest) = rest.split_at(k);
        let (w2, w3) = rest.split_at(k);
        for (rq, o) in out.chunks_exact_mut(16).enumerate() {
            let xq = &xp[4 * rq * k..4 * (rq + 1) * k];
            let (x0, rest) = xq.split_at(k);
            let (x1, rest) = rest.split_at(k);
            let (x2, x3) = rest.split_at(k);
            let mut acc = [0f32; 16];
            for kk in 0..k {
                let xv = [x0[kk], x1[kk], x2[kk], x3[kk]];
                let wv = [w0[kk], w1[kk], w2[kk], w3[kk]];
                for i in 0..4 {
                    for j in 0..4 {
                        acc[4 * i + j] = xv[i].mul_add(wv[j], acc[4 * i + j]);
                    }
                }
            }
            o.copy_from_slice(&acc);
        }
    });
    let mut y = vec![0f32; t * n];
    for (q, out) in quads.chunks_exact(4 * t4).enumerate() {
        for r in 0..t {
            for j in 0..4 {
                let c = 4 * q + j;
                if c < n {
                    y[r * n + c] = out[4 * r + j];
                }
            }
        }
    }
    y
}

/// The grouped matmul shared by both output types: `y [t, groups, n]` in f32.
fn matmul_cpu(l: &CpuLaunch<'_>) -> Result<Vec<f32>> {
    let (x, w) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?);
    let (t, n, k, groups) = (l.count(3)?, l.count(4)?, l.count(5)?, l.count(6)?);
    let xs = to_f32(x.read(0, t * groups * k)?);
    let mut y = vec![0f32; t * groups * n];
    for g in 0..groups {
        let wg = to_f32(w.read(g * n * k, n * k)?);
        let xg: Vec<f32> = if groups == 1 {
            xs.clone()
        } else {
            (0..t).flat_map(|m| xs[(m * groups + g) * k..(m * groups + g + 1) * k].iter().copied()).collect()
        };
        let yg = gemm_f32(&xg, &wg, t, n, k);
        for m in 0..t {
            y[(m * groups + g) * n..(m * groups + g + 1) * n].copy_from_slice(&yg[m * n..(m + 1) * n]);
        }
    }
    Ok(y)
}

/// The tensor-core kernels' split order (`splits` and `split_len` in arguments 7 and 8): per k
/// range an f32 `mul_add` chain from 0, then the ranges summed in order from 0. The device sums
/// each 16-wide k step inside an mma, whose internal order is the hardware's, so the device agrees
/// with this reference to f32 rounding (a few ulps), not bit for bit.
fn matmul_split_cpu(l: &CpuLaunch<'_>) -> Result<Vec<f32>> {
    let (x, w) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?);
    let (t, n, k, groups) = (l.count(3)?, l.count(4)?, l.count(5)?, l.count(6)?);
    let (splits, split_len) = (l.count(7)?.max(1), l.count(8)?);
    let xs = to_f32(x.read(0, t * groups * k)?);
    let mut y = vec![0f32; t * groups * n];
    for g in 0..groups {
        let wg = to_f32(w.read(g * n * k, n * k)?);
        for sp in 0..splits {
            let (kb, ke) = ((sp * split_len).min(k), ((sp + 1) * split_len).min(k));
            let len = ke - kb;
            let xr: Vec<f32> =
                (0..t).flat_map(|m| xs[(m * groups + g) * k + kb..(m * groups + g) * k + ke].iter().copied()).collect();
            let wr: Vec<f32> = (0..n).flat_map(|c| wg[c * k + kb..c * k + ke].iter().copied()).collect();
            let part = if len == 0 { vec![0f32; t * n] } else { gemm_f32(&xr, &wr, t, n, len) };
            for m in 0..t {
                for (o, p) in
                    y[(m * groups + g) * n..(m * groups + g + 1) * n].iter_mut().zip(&part[m * n..(m + 1) * n])
                {
                    *o += p;
                }
            }
        }
    }
    Ok(y)
}

fn matmul_mma_bf16(l: &CpuLaunch<'_>) -> Result<()> {
    let out: Vec<bf16> = matmul_split_cpu(l)?.into_iter().map(bf16::from_f32).collect();
    l.ptr::<bf16>(2)?.write(0, &out)
}

fn matmul_mma_f32(l: &CpuLaunch<'_>) -> Result<()> {
    let y = matmul_split_cpu(l)?;
    l.ptr::<f32>(2)?.write(0, &y)
}

fn matmul_bf16(l: &CpuLaunch<'_>) -> Result<()> {
    let y = matmul_cpu(l)?;
    let out: Vec<bf16> = y.into_iter().map(bf16::from_f32).collect();
    l.ptr::<bf16>(2)?.write(0, &out)
}

fn matmul_f32(l: &CpuLaunch<'_>) -> Result<()> {
    let y = matmul_cpu(l)?;
    l.ptr::<f32>(2)?.write(0, &y)
}

/// One row of `rms_norm` in the device block's order (see `dense.cu`).
fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [bf16]) {
    let mut part = [0f32; NORM_THREADS];
    for (c, v) in x.iter().enumerate() {
        let p = &mut part[c % NORM_THREADS];
        *p = v.mul_add(*v, *p);
    }
    let mut s = NORM_THREADS / 2;
    while s > 0 {
        for i in 0..s {
            part[i] += part[i + s];
        }
        s /= 2;
    }
    let inv = 1.0f32 / (part[0] / x.len() as f32 + eps).sqrt();
    for ((o, v), wv) in out.iter_mut().zip(x).zip(w) {
        *o = bf16::from_f32((v * inv) * wv);
    }
}

fn rms_norm(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, w, y) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?, l.ptr::<bf16>(2)?);
    let (rows, dim, eps) = (l.count(3)?, l.count(4)?, l.f32(5)?);
    let xs = to_f32(x.read(0, rows * dim)?);
    let ws = to_f32(w.read(0, dim)?);
    let mut out = vec![bf16::ZERO; rows * dim];
    if dim > 0 {
        out.par_chunks_mut(dim).zip(xs.par_chunks(dim)).for_each(|(o, xr)| rms_row(xr, &ws, eps, o));
    }
    y.write(0, &out)
}

fn rope(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, pos) = (l.ptr::<bf16>(0)?, l.ptr::<i32>(1)?);
    let (tokens, heads, head_dim, rope_dim) = (l.count(2)?, l.count(3)?, l.count(4)?, l.count(5)?);
    let (theta, sign) = (l.f32(6)?, l.f32(7)?);
    let half = rope_dim / 2;
    if half == 0 {
        return Ok(());
    }
    let ps = pos.read(0, tokens)?;
    let mut xs = x.read(0, tokens * heads * head_dim)?;
    let inv_freq: Vec<f32> = (0..half).map(|p| theta.powf(-((2 * p) as f32) / rope_dim as f32)).collect();
    let row = heads * head_dim;
    if row > 0 {
        xs.par_chunks_mut(row).zip(ps.par_iter()).filter(|(_, &p)| p >= 0).for_each(|(xt, &p)| {
            let sc: Vec<(f32, f32)> = inv_freq.iter().map(|f| (sign * (p as f32 * f)).sin_cos()).collect();
            for head in xt.chunks_exact_mut(head_dim) {
                for (pair, &(sn, cs)) in head[head_dim - rope_dim..].chunks_exact_mut(2).zip(&sc) {
                    let (a, b) = (pair[0].to_f32(), pair[1].to_f32());
                    pair[0] = bf16::from_f32(a * cs - b * sn);
                    pair[1] = bf16::from_f32(a * sn + b * cs);
                }
            }
        });
    }
    x.write(0, &xs)
}

/// `silu(min(g, limit)) · clamp(u, −limit, limit)` with NaN kept (as the device kernel writes it).
fn swiglu_one(g: f32, u: f32, limit: f32) -> f32 {
    let g = if g > limit { limit } else { g };
    let u = if u > limit {
        limit
    } else if u < -limit {
        -limit
    } else {
        u
    };
    g / (1.0 + (-g).exp()) * u
}

fn swiglu(l: &CpuLaunch<'_>) -> Result<()> {
    let (gu, out) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?);
    let (tokens, ffn, limit) = (l.count(2)?, l.count(3)?, l.f32(4)?);
    let xs = gu.read(0, tokens * 2 * ffn)?;
    let mut ys = vec![bf16::ZERO; tokens * ffn];
    if ffn > 0 {
        ys.par_chunks_mut(ffn).zip(xs.par_chunks(2 * ffn)).for_each(|(y, x)| {
            let (g, u) = x.split_at(ffn);
            for ((o, g), u) in y.iter_mut().zip(g).zip(u) {
                *o = bf16::from_f32(swiglu_one(g.to_f32(), u.to_f32(), limit));
            }
        });
    }
    out.write(0, &ys)
}

fn embed(l: &CpuLaunch<'_>) -> Result<()> {
    let (table, ids, out) = (l.ptr::<bf16>(0)?, l.ptr::<i32>(1)?, l.ptr::<bf16>(2)?);
    let (tokens, hidden, vocab) = (l.count(3)?, l.count(4)?, l.count(5)?);
    let ids = ids.read(0, tokens)?;
    for (t, &id) in ids.iter().enumerate() {
        if id >= 0 && (id as usize) < vocab {
            out.write(t * hidden, &table.read(id as usize * hidden, hidden)?)?;
        } else {
            out.fill(t * hidden, hidden, bf16::ZERO)?;
        }
    }
    Ok(())
}

/// Index of the largest non-NaN value, lowest on ties, 0 when there is none.
fn argmax_row(row: &[f32]) -> i32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    best.map_or(0, |(_, i)| i as i32)
}

fn argmax(l: &CpuLaunch<'_>) -> Result<()> {
    let (logits, out) = (l.ptr::<f32>(0)?, l.ptr::<i32>(1)?);
    let (rows, cols) = (l.count(2)?, l.count(3)?);
    let xs = logits.read(0, rows * cols)?;
    let idx: Vec<i32> = if cols == 0 { vec![0; rows] } else { xs.par_chunks(cols).map(argmax_row).collect() };
    out.write(0, &idx)
}

fn repeat_rows(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, y) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?);
    let (tokens, copies, hidden) = (l.count(2)?, l.count(3)?, l.count(4)?);
    let xs = x.read(0, tokens * hidden)?;
    let mut ys = Vec::with_capacity(tokens * copies * hidden);
    for t in 0..tokens {
        for _ in 0..copies {
            ys.extend_from_slice(&xs[t * hidden..(t + 1) * hidden]);
        }
    }
    y.write(0, &ys)
}

fn to_bf16(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, y, n) = (l.ptr::<f32>(0)?, l.ptr::<bf16>(1)?, l.count(2)?);
    let out: Vec<bf16> = x.read(0, n)?.into_iter().map(bf16::from_f32).collect();
    y.write(0, &out)
}

/// The dense ops' source: `hf_matmul_bf16`, `hf_matmul_f32` (tiled), `hf_matmul_small_t_bf16`,
/// `hf_matmul_small_t_f32` (decode-sized t; the same chains, so the same CPU references as the tiled
/// pair), `hf_matmul_mma{16,64,_tiled}_{bf16,f32}` (tensor cores, the split order; empty where the target
/// has none), `hf_rms_norm_bf16`, `hf_rope_bf16`, `hf_swiglu_bf16`, `hf_embed_bf16`, `hf_argmax_f32`,
/// `hf_repeat_rows_bf16`, `hf_to_bf16_f32`, each with its CPU reference (argument lists as in `dense.cu`; launch them through [`crate::DenseKernels`]).
pub fn dense_source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        let f = |n| Param::scalar(n, ScalarKind::F32);
        let mm = |name, cpu, y: Param| KernelEntry {
            name,
            params: vec![Param::input::<bf16>("x"), Param::input::<bf16>("w"), y, u("t"), u("n"), u("k"), u("groups")],
            cpu,
        };
        let mma = |name, cpu, y: Param| KernelEntry {
            name,
            params: vec![
                Param::input::<bf16>("x"),
                Param::input::<bf16>("w"),
                y,
                u("t"),
                u("n"),
                u("k"),
                u("groups"),
                u("splits"),
                u("split_len"),
            ],
            cpu,
        };
        KernelSource {
            name: "holdfast_dense",
            code: CODE,
            entries: vec![
                mm("hf_matmul_bf16", matmul_bf16, Param::output::<bf16>("y")),
                mm("hf_matmul_f32", matmul_f32, Param::output::<f32>("y")),
                // The small-t kernels compute the same chains, so they share the references.
                mm("hf_matmul_small_t_bf16", matmul_bf16, Param::output::<bf16>("y")),
                mm("hf_matmul_small_t_f32", matmul_f32, Param::output::<f32>("y")),
                mma("hf_matmul_mma16_bf16", matmul_mma_bf16, Param::output::<bf16>("y")),
                mma("hf_matmul_mma16_f32", matmul_mma_f32, Param::output::<f32>("y")),
                mma("hf_matmul_mma64_bf16", matmul_mma_bf16, Param::output::<bf16>("y")),
                mma("hf_matmul_mma64_f32", matmul_mma_f32, Param::output::<f32>("y")),
                mma("hf_matmul_mma_tiled_bf16", matmul_mma_bf16, Param::output::<bf16>("y")),
                mma("hf_matmul_mma_tiled_f32", matmul_mma_f32, Param::output::<f32>("y")),
                KernelEntry {
                    name: "hf_rms_norm_bf16",
                    params: vec![
                        Param::input::<bf16>("x"),
                        Param::input::<bf16>("w"),
                        Param::output::<bf16>("y"),
                        u("rows"),
                        u("dim"),
                        f("eps"),
                    ],
                    cpu: rms_norm,
                },
                KernelEntry {
                    name: "hf_rope_bf16",
                    params: vec![
                        Param::inout::<bf16>("x"),
                        Param::input::<i32>("pos"),
                        u("tokens"),
                        u("heads"),
                        u("head_dim"),
                        u("rope_dim"),
                        f("theta"),
                        f("sign"),
                    ],
                    cpu: rope,
                },
                KernelEntry {
                    name: "hf_swiglu_bf16",
                    params: vec![
                        Param::input::<bf16>("gate_up"),
                        Param::output::<bf16>("out"),
                        u("tokens"),
                        u("ffn"),
                        f("limit"),
                    ],
                    cpu: swiglu,
                },
                KernelEntry {
                    name: "hf_embed_bf16",
                    params: vec![
                        Param::input::<bf16>("table"),
                        Param::input::<i32>("ids"),
                        Param::output::<bf16>("out"),
                        u("tokens"),
                        u("hidden"),
                        u("vocab"),
                    ],
                    cpu: embed,
                },
                KernelEntry {
                    name: "hf_argmax_f32",
                    params: vec![Param::input::<f32>("logits"), Param::output::<i32>("out"), u("rows"), u("cols")],
                    cpu: argmax,
                },
                KernelEntry {
                    name: "hf_repeat_rows_bf16",
                    params: vec![
                        Param::input::<bf16>("x"),
                        Param::output::<bf16>("y"),
                        u("tokens"),
                        u("copies"),
                        u("hidden"),
                    ],
                    cpu: repeat_rows,
                },
                KernelEntry {
                    name: "hf_to_bf16_f32",
                    params: vec![Param::input::<f32>("x"), Param::output::<bf16>("y"), u("n")],
                    cpu: to_bf16,
                },
            ],
        }
    })
}

/// The portable path and the vector path agree bit for bit.
#[cfg(test)]
mod tests {
    #[test]
    fn the_vector_and_portable_matmuls_agree_bit_for_bit() {
        let mut s = 12345u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        for (t, n, k) in [(1usize, 1usize, 1usize), (5, 13, 67), (8, 17, 3), (3, 9, 200)] {
            let x: Vec<f32> = (0..t * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let a: Vec<u32> = super::gemm_f32(&x, &w, t, n, k).iter().map(|v| v.to_bits()).collect();
            let b: Vec<u32> = super::gemm_portable(&x, &w, t, n, k).iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b, "{t}×{n}×{k}");
        }
    }
}
