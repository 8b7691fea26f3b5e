//! KV insert and ragged sparse attention with a per-head attention sink (DeepSeek-V4 MQA latent).
//!
//! Caches are paged by slot: a cache of `S` slots is `[S, D]` bf16, slot `s` at row `s`
//! (`s = block · block_size + offset`). Each query row `t` attends over two ragged lists of slots:
//! *main* (the sliding window) `main_idx[main_indptr[t] .. main_indptr[t + 1]]`, then *extra*
//! (compressed entries). A slot outside `[0, S)` (−1 padding included) is skipped. Values are the
//! keys (MQA latent, V = K). Softmax is online in f32 and ends with the sink of head `h`:
//! `m' = max(m, sink_h)`, `l' = l·e^{m−m'} + e^{sink_h−m'}`, `out = acc·e^{m−m'} / l'`, so a row
//! with no entries yields zeros, never NaN.
//!
//! Launch shape: one block per (row, group of 8 heads); `4 × warp` threads; the K row is staged in
//! `D × 4` bytes of shared memory. It depends only on the padded row count and the static sizes,
//! and a row's result depends on nothing but its own inputs (batch-invariant).

use std::sync::OnceLock;

use crate::error::{AttentionError, Result};
use holdfast_hal::{
    bf16, CpuLaunch, Device, Kernel, KernelEntry, KernelSource, LaunchConfig, Param, ScalarKind, Stream, View,
};
use rayon::prelude::*;

const CODE: &str = r#"
#define HF_ATTN_WARPS 4
#define HF_ATTN_HPW 2
#define HF_ATTN_HPB (HF_ATTN_WARPS * HF_ATTN_HPW)
#define HF_ATTN_MAXC 16

// cache[slots[t]] = kv[t] for t < T; slots outside [0, S) are skipped. One block per token.
HF_KERNEL void hf_kv_insert_bf16(const hf_bf16* kv, const int32_t* slots, hf_bf16* cache,
                                 uint32_t T, uint32_t D, uint32_t S) {
    for (uint32_t t = blockIdx.x; t < T; t += gridDim.x) {
        int32_t s = slots[t];
        if (s < 0 || (uint32_t)s >= S) continue;
        for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) cache[(uint64_t)s * D + d] = kv[(uint64_t)t * D + d];
    }
}

HF_KERNEL void hf_sparse_attn_bf16(const hf_bf16* q, const hf_bf16* main_cache, const int32_t* main_idx,
                                   const int32_t* main_indptr, const hf_bf16* extra_cache, const int32_t* extra_idx,
                                   const int32_t* extra_indptr, const float* sink, hf_bf16* out, uint32_t T,
                                   uint32_t H, uint32_t D, uint32_t S_main, uint32_t S_extra, uint32_t has_extra,
                                   float scale) {
    extern __shared__ float krow[];
    const uint32_t t = blockIdx.x;
    if (t >= T) return;
    const uint32_t warp = threadIdx.x / HF_WARP_SIZE, lane = threadIdx.x % HF_WARP_SIZE;
    const uint32_t nc = D / HF_WARP_SIZE;
    const float NEG_INF = __int_as_float(0xff800000);
    float qv[HF_ATTN_HPW][HF_ATTN_MAXC], acc[HF_ATTN_HPW][HF_ATTN_MAXC], m[HF_ATTN_HPW], l[HF_ATTN_HPW];
#pragma unroll
    for (int hh = 0; hh < HF_ATTN_HPW; ++hh) {
        const uint32_t h = blockIdx.y * HF_ATTN_HPB + warp * HF_ATTN_HPW + hh;
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int i = 0; i < HF_ATTN_MAXC; ++i) {
            acc[hh][i] = 0.0f;
            qv[hh][i] = (h < H && (uint32_t)i < nc) ? hf_bf16_to_f32(q[((uint64_t)t * H + h) * D + lane + i * HF_WARP_SIZE]) : 0.0f;
        }
    }
    for (int pass = 0; pass < 2; ++pass) {
        if (pass == 1 && has_extra == 0u) break;
        const int32_t* idx = pass == 0 ? main_idx : extra_idx;
        const int32_t* indptr = pass == 0 ? main_indptr : extra_indptr;
        const hf_bf16* cache = pass == 0 ? main_cache : extra_cache;
        const uint32_t S = pass == 0 ? S_main : S_extra;
        const int32_t b = indptr[t], e = indptr[t + 1];
        for (int32_t k = b; k < e; ++k) {
            const int32_t slot = idx[k];
            if (slot < 0 || (uint32_t)slot >= S) continue;  // uniform across the block
            __syncthreads();
            for (uint32_t d = threadIdx.x; d < D; d += blockDim.x) krow[d] = hf_bf16_to_f32(cache[(uint64_t)slot * D + d]);
            __syncthreads();
#pragma unroll
            for (int hh = 0; hh < HF_ATTN_HPW; ++hh) {
                float part = 0.0f;
#pragma unroll
                for (int i = 0; i < HF_ATTN_MAXC; ++i)
                    if ((uint32_t)i < nc) part += qv[hh][i] * krow[lane + i * HF_WARP_SIZE];
                const float s = hf_warp_sum(part) * scale;
                const float mn = fmaxf(m[hh], s);
                const float corr = expf(m[hh] - mn);
                const float p = expf(s - mn);
                l[hh] = l[hh] * corr + p;
#pragma unroll
                for (int i = 0; i < HF_ATTN_MAXC; ++i)
                    if ((uint32_t)i < nc) acc[hh][i] = acc[hh][i] * corr + p * krow[lane + i * HF_WARP_SIZE];
                m[hh] = mn;
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < HF_ATTN_HPW; ++hh) {
        const uint32_t h = blockIdx.y * HF_ATTN_HPB + warp * HF_ATTN_HPW + hh;
        if (h >= H) continue;
        const float sk = sink[h];
        const float mn = fmaxf(m[hh], sk);
        const float corr = expf(m[hh] - mn);
        const float lp = l[hh] * corr + expf(sk - mn);
        const float f = lp > 0.0f ? corr / fmaxf(lp, 1e-30f) : 0.0f;
#pragma unroll
        for (int i = 0; i < HF_ATTN_MAXC; ++i)
            if ((uint32_t)i < nc) out[((uint64_t)t * H + h) * D + lane + i * HF_WARP_SIZE] = hf_f32_to_bf16(acc[hh][i] * f);
    }
}
"#;

/// Heads handled by one block (4 warps × 2 heads).
pub const HEADS_PER_BLOCK: u32 = 8;
/// Largest supported `head_dim` is `MAX_CHUNKS_PER_LANE × warp size` (512 on NVIDIA).
pub const MAX_CHUNKS_PER_LANE: u32 = 16;

fn kv_insert_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (kv, slots, cache) = (l.ptr::<bf16>(0)?, l.ptr::<i32>(1)?, l.ptr::<bf16>(2)?);
    let (t, d, s) = (l.count(3)?, l.count(4)?, l.count(5)?);
    let slots = slots.read(0, t)?;
    for (row, slot) in slots.into_iter().enumerate() {
        if slot < 0 || slot as usize >= s {
            continue;
        }
        cache.write(slot as usize * d, &kv.read(row * d, d)?)?;
    }
    Ok(())
}

/// One row's attention in f32, in the kernel's order: `keys` are the row's valid key rows (main
/// entries, then extra), each `[head_dim]`; `q` is `[heads, head_dim]`.
pub(crate) fn attend_row(q: &[f32], keys: &[Vec<f32>], sink: &[f32], heads: usize, d: usize, scale: f32) -> Vec<bf16> {
    let mut out = vec![bf16::ZERO; heads * d];
    for h in 0..heads {
        let qh = &q[h * d..(h + 1) * d];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut acc = vec![0f32; d];
        for k in keys {
            let s = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
            let mn = m.max(s);
            let (corr, p) = ((m - mn).exp(), (s - mn).exp());
            l = l * corr + p;
            for (a, kv) in acc.iter_mut().zip(k) {
                *a = *a * corr + p * kv;
            }
            m = mn;
        }
        let mn = m.max(sink[h]);
        let corr = (m - mn).exp();
        let lp = l * corr + (sink[h] - mn).exp();
        let f = if lp > 0.0 { corr / lp.max(1e-30) } else { 0.0 };
        for (o, a) in out[h * d..(h + 1) * d].iter_mut().zip(&acc) {
            *o = bf16::from_f32(a * f);
        }
    }
    out
}

fn sparse_attn_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (q, mc, mi, mp) = (l.ptr::<bf16>(0)?, l.ptr::<bf16>(1)?, l.ptr::<i32>(2)?, l.ptr::<i32>(3)?);
    let (ec, ei, ep) = (l.ptr::<bf16>(4)?, l.ptr::<i32>(5)?, l.ptr::<i32>(6)?);
    let (sink, out) = (l.ptr::<f32>(7)?, l.ptr::<bf16>(8)?);
    let (t, h, d, s_main, s_extra) = (l.count(9)?, l.count(10)?, l.count(11)?, l.count(12)?, l.count(13)?);
    let (has_extra, scale) = (l.u32(14)? != 0, l.f32(15)?);
    let sink = sink.read(0, h)?;
    let lists = if has_extra {
        vec![(&mc, &mi, &mp, s_main, "main"), (&ec, &ei, &ep, s_extra, "extra")]
    } else {
        vec![(&mc, &mi, &mp, s_main, "main")]
    };
    // Gather every row's inputs through the checked pointers, then compute rows in parallel.
    let mut rows = Vec::with_capacity(t);
    for r in 0..t {
        let mut keys = Vec::new();
        for (cache, idx, indptr, slots, name) in &lists {
            let (b, e) = (indptr.get(r)?, indptr.get(r + 1)?);
            if b < 0 || e < b {
                return Err(l.fail(format!("{name}_indptr[{r}..={}] = [{b}, {e}] is not a range", r + 1)));
            }
            for slot in idx.read(b as usize, (e - b) as usize)? {
                if slot >= 0 && (slot as usize) < *slots {
                    keys.push(cache.read(slot as usize * d, d)?.iter().map(|x| x.to_f32()).collect::<Vec<f32>>());
                }
            }
        }
        let qr: Vec<f32> = q.read(r * h * d, h * d)?.iter().map(|x| x.to_f32()).collect();
        rows.push((qr, keys));
    }
    let results: Vec<Vec<bf16>> = rows.par_iter().map(|(qr, keys)| attend_row(qr, keys, &sink, h, d, scale)).collect();
    for (r, res) in results.iter().enumerate() {
        out.write(r * h * d, res)?;
    }
    Ok(())
}

/// The kernel source (`hf_kv_insert_bf16`, `hf_sparse_attn_bf16`).
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        KernelSource {
            name: "holdfast_sparse_attention",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_kv_insert_bf16",
                    params: vec![
                        Param::input::<bf16>("kv"),
                        Param::input::<i32>("slots"),
                        Param::inout::<bf16>("cache"),
                        u("T"),
                        u("D"),
                        u("S"),
                    ],
                    cpu: kv_insert_ref,
                },
                KernelEntry {
                    name: "hf_sparse_attn_bf16",
                    params: vec![
                        Param::input::<bf16>("q"),
                        Param::input::<bf16>("main_cache"),
                        Param::input::<i32>("main_idx"),
                        Param::input::<i32>("main_indptr"),
                        Param::input::<bf16>("extra_cache"),
                        Param::input::<i32>("extra_idx"),
                        Param::input::<i32>("extra_indptr"),
                        Param::input::<f32>("sink"),
                        Param::output::<bf16>("out"),
                        u("T"),
                        u("H"),
                        u("D"),
                        u("S_main"),
                        u("S_extra"),
                        u("has_extra"),
                        Param::scalar("scale", ScalarKind::F32),
                    ],
                    cpu: sparse_attn_ref,
                },
            ],
        }
    })
}

fn shape(op: &'static str, detail: String) -> AttentionError {
    AttentionError::Shape { op, detail }
}

fn u32_of(op: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape(op, format!("{what} = {v} does not fit in 32 bits")))
}

/// One paged bf16 cache and its ragged slot lists for a batch of rows.
#[derive(Clone, Debug)]
pub struct RaggedKv<'a> {
    /// `[S, head_dim]` bf16 cache.
    pub cache: &'a View<bf16>,
    /// Flat slot lists (`i32`, −1 or out-of-range entries are skipped).
    pub indices: &'a View<i32>,
    /// `[rows + 1]` offsets into `indices`.
    pub indptr: &'a View<i32>,
}

/// KV insert and ragged sparse attention for a fixed `heads × head_dim`, compiled for one device.
#[derive(Clone, Debug)]
pub struct SparseAttention {
    heads: usize,
    head_dim: usize,
    warp: u32,
    insert: Kernel,
    attend: Kernel,
}

impl SparseAttention {
    /// Compiles the kernels for `heads` query heads of `head_dim` (a multiple of the warp width,
    /// at most [`MAX_CHUNKS_PER_LANE`] × warp width). Unsupported shapes are errors here.
    pub fn new(dev: &Device, heads: usize, head_dim: usize) -> Result<Self> {
        const OP: &str = "SparseAttention::new";
        let warp = dev.info().warp_size.max(32);
        if heads == 0 {
            return Err(shape(OP, "heads must be at least 1".into()));
        }
        if head_dim == 0 || !head_dim.is_multiple_of(warp as usize) || head_dim > (MAX_CHUNKS_PER_LANE * warp) as usize
        {
            return Err(shape(
                OP,
                format!(
                    "head_dim {head_dim} is not supported: it must be a positive multiple of {warp} up to {}",
                    MAX_CHUNKS_PER_LANE * warp
                ),
            ));
        }
        let m = dev.compile(source())?;
        Ok(SparseAttention {
            heads,
            head_dim,
            warp,
            insert: m.kernel("hf_kv_insert_bf16")?,
            attend: m.kernel("hf_sparse_attn_bf16")?,
        })
    }

    /// Writes row `t` of `kv [T, head_dim]` to slot `slots[t]` of `cache [S, head_dim]` for
    /// `T = slots.len()`; slots outside `[0, S)` (−1 for padding) are skipped.
    pub fn insert(&self, s: &Stream, kv: &View<bf16>, slots: &View<i32>, cache: &View<bf16>) -> Result<()> {
        const OP: &str = "kv_insert";
        let (t, d) = (slots.len(), self.head_dim);
        if kv.len() < t * d {
            return Err(shape(OP, format!("kv holds {} elements, {t} rows × {d} need {}", kv.len(), t * d)));
        }
        if !cache.len().is_multiple_of(d) {
            return Err(shape(OP, format!("cache length {} is not a multiple of head_dim {d}", cache.len())));
        }
        let cfg = LaunchConfig::blocks(t.clamp(1, 65535) as u32, 128);
        let args = [
            kv.into(),
            slots.into(),
            cache.into(),
            u32_of(OP, "T", t)?.into(),
            u32_of(OP, "D", d)?.into(),
            u32_of(OP, "S", cache.len() / d)?.into(),
        ];
        s.launch(&self.insert, cfg, &args)?;
        Ok(())
    }

    /// `out [rows, heads, head_dim]` = attention of `q [rows, heads, head_dim]` over `main` then
    /// `extra` (optional), with `sink [heads]` and logit `scale`; `rows = main.indptr.len() − 1`.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        s: &Stream,
        q: &View<bf16>,
        main: &RaggedKv<'_>,
        extra: Option<&RaggedKv<'_>>,
        sink: &View<f32>,
        out: &View<bf16>,
        scale: f32,
    ) -> Result<()> {
        const OP: &str = "sparse_attention";
        let (h, d) = (self.heads, self.head_dim);
        let rows = main.indptr.len().checked_sub(1).ok_or_else(|| shape(OP, "main.indptr is empty".into()))?;
        let cells = rows * h * d;
        if q.len() < cells || out.len() < cells {
            return Err(shape(
                OP,
                format!("q/out hold {}/{} elements, {rows} rows × {h} heads × {d} need {cells}", q.len(), out.len()),
            ));
        }
        if sink.len() < h {
            return Err(shape(OP, format!("sink holds {} elements, {h} heads need one each", sink.len())));
        }
        let ex = extra.unwrap_or(main);
        for (name, kv) in [("main", main), ("extra", ex)] {
            if !kv.cache.len().is_multiple_of(d) {
                return Err(shape(
                    OP,
                    format!("{name} cache length {} is not a multiple of head_dim {d}", kv.cache.len()),
                ));
            }
            if kv.indptr.len() < rows + 1 {
                return Err(shape(
                    OP,
                    format!("{name}.indptr holds {} elements, {rows} rows need {}", kv.indptr.len(), rows + 1),
                ));
            }
        }
        let cfg = LaunchConfig {
            grid: (rows.clamp(1, i32::MAX as usize) as u32, (h as u32).div_ceil(HEADS_PER_BLOCK), 1),
            block: (4 * self.warp, 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        let args = [
            q.into(),
            main.cache.into(),
            main.indices.into(),
            main.indptr.into(),
            ex.cache.into(),
            ex.indices.into(),
            ex.indptr.into(),
            sink.into(),
            out.into(),
            u32_of(OP, "rows", rows)?.into(),
            u32_of(OP, "heads", h)?.into(),
            u32_of(OP, "head_dim", d)?.into(),
            u32_of(OP, "S_main", main.cache.len() / d)?.into(),
            u32_of(OP, "S_extra", ex.cache.len() / d)?.into(),
            u32::from(extra.is_some()).into(),
            scale.into(),
        ];
        s.launch(&self.attend, cfg, &args)?;
        Ok(())
    }
}
