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
//! Three device kernels compute this ([`AttentionKernel`]):
//! - **tensor cores** (CUDA, sm_80 and newer, `head_dim` 64, 128, 256 or 512): one block per
//!   (row, group of 16 or 32 heads), `8 × heads-per-block` threads. The row's entries stream
//!   through shared memory in tiles of 32 (`cp.async`, two tiles staged, about 85 KiB of shared
//!   memory at `head_dim` 512, or three where the grid is one block per multiprocessor at most);
//!   `q·kᵀ` and `p·v` run as bf16 `mma.sync` with f32 accumulation, `q` held in registers. Per
//!   tile the scores are the sum of four `head_dim / 4` slices in slice order, the online softmax
//!   runs in f32 and `p` is rounded to bf16 both for `p·v` and for the running sum `l`. Relative
//!   to the f32 definition this costs the bf16 rounding of `p` (the tests bound the relative L2
//!   error by 1e-2). Which entry runs follows the padded row count
//!   ([`SparseAttention`]'s launch: 32 heads and three stages while that grid fits the
//!   multiprocessors once, then 32 heads and two stages; 16 heads for up to 16 heads while their
//!   grid would not fill the device); every output element's arithmetic depends on its own row
//!   and head only, and the pipeline depth changes no arithmetic, so the choice changes no bit.
//! - **warpgroup** ([`AttentionKernel::Warpgroup`], and what [`AttentionKernel::Auto`] picks on
//!   `sm_90a` at `head_dim` 512 with 64 heads or more): each (row, group of 64 heads) goes to a
//!   cluster of [`WG_DEFAULT_SPLIT`] blocks ([`SparseAttention::with_warpgroup_split`]; a runner
//!   whose batches fill the device takes 1, [`SparseAttention::throughput_split`]) of two
//!   warpgroups; block `r` of the cluster takes the row's 64-entry tiles `r, r + split, ..`, and
//!   the cluster combines the blocks' maxima, running sums and f32 partial outputs in block order
//!   through distributed shared memory (each block finishes `64 / split` heads); an unsplit
//!   row's bf16 outputs are staged in shared memory and written in 16-byte pieces, whole lines
//!   per warp. Q is staged in shared memory (a `cp.async` group of its own, so that warpgroup 0
//!   reads it into its registers while the first tile still lands) and read once into warpgroup
//!   0's registers; its shared memory then serves as the third of three K buffers: the entries
//!   stream through `cp.async`-staged tiles of 64, two tiles ahead (their slots loaded three
//!   tiles ahead), in the 128-byte-swizzled layout, so every warp's copy
//!   moves whole 128-byte lines at both ends (the no-swizzle layout scattered each row's 16-byte
//!   pieces 128 bytes apart, which split every 32-byte sector into two requests);
//!   the warpgroups take turns: warpgroup 0 runs `q·kᵀ` over the whole tile as `wgmma`
//!   m64n64k16 with `q` from registers (so it reads only the tile from shared memory) and the
//!   softmax (a row's 64 scores in the four lanes of a quad: running maximum and sum in
//!   registers), writes `p` (rounded to bf16 as above, double-buffered) and the rescale factors,
//!   then `p·v` for `head_dim` 0 .. 127 (`wgmma` m64n128k16); warpgroup 1 runs `p·v` for 128 ..
//!   511 (m64n256k16 + m64n128k16) from the same `p` and stages the tiles after the first. The
//!   hand-offs are named barriers (a tile landed, `p` written) and mbarriers (a buffer free of
//!   both warpgroups' reads, Q read), so neither waits for the other more than the data
//!   requires; `tests/wg_handoffs.rs` runs a model of them under thousands of interleavings. f32
//!   accumulation, the scores kept in base 2 (`s·scale·log2 e`) and exponentiated by the
//!   multi-function unit's `2^x` (relative error below 2⁻²²). 215 328 bytes of shared memory,
//!   one block per multiprocessor. Its summation order differs from the `mma.sync` kernel's (and
//!   with the split), so they agree within the bf16 bound, not bit for bit; each kernel at a
//!   given split is batch-invariant on its own.
//! - **portable** (any device, `head_dim` a multiple of the warp width up to 16 × warp): one block
//!   per (row, group of 8 heads), `4 × warp` threads, one entry at a time through `D × 4` bytes of
//!   shared memory, CUDA-core f32 arithmetic in exactly the CPU reference's order.
//!
//! Both launch shapes depend only on the padded row count and the static sizes, and a row's
//! result depends on nothing but its own inputs (batch-invariant). The CPU backend runs the
//! reference (the portable kernel's arithmetic).

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
    hf_dependent_kernel_start();
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
    hf_dependent_kernel_start();
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

// ---- Tensor-core path (sm_80+): mma.sync m16n8k16 bf16 -> f32, K tiles staged by cp.async ----
//
// One block per (row, group of 16·MG heads), 4·MG warps: warp w owns m-group w / 4 (16 heads)
// and d-slice w % 4 (head_dim / 4 columns). The row's entries (main, then extra) go by tiles
// of 32, ST-buffered in shared memory (the next ST - 1 tiles' cp.async run under this tile's
// math; the pipeline depth changes no arithmetic). Per tile: (1) each warp's partial scores over its d-slice, Q held in registers as
// mma A fragments; (2) scores summed over the 4 slices in slice order, scaled, masked, online
// softmax per head (P rounded to bf16, l summed from the rounded P); (3) O = O·corr + P·V per
// warp's (heads, d-slice). Every output element's arithmetic depends on its own row and head
// only, so the head grouping (MG) may follow the row count without changing a bit.
#define HF_MMA_NT 32
#define HF_MMA_KPAD 8
#define HF_MMA_SROW (HF_MMA_NT + 1)
#define HF_MMA_PROW (HF_MMA_NT + 8)
#define HF_MMA_MAXKS 8
#define HF_MMA_MAXNT 16

#if defined(HF_HAS_MMA)
#define HF_ATTN_MMA 1

template <int MG, int D, int ST>
__device__ __forceinline__ void hf_sparse_attn_mma(const hf_bf16* __restrict__ q, const hf_bf16* __restrict__ main_cache,
                                                   const int32_t* __restrict__ main_idx,
                                                   const int32_t* __restrict__ main_indptr,
                                                   const hf_bf16* __restrict__ extra_cache,
                                                   const int32_t* __restrict__ extra_idx,
                                                   const int32_t* __restrict__ extra_indptr,
                                                   const float* __restrict__ sink, hf_bf16* __restrict__ out,
                                                   uint32_t T, uint32_t H, uint32_t S_main,
                                                   uint32_t S_extra, uint32_t has_extra, float scale) {
    constexpr uint32_t HB = 16u * MG, NTH = 128u * MG, NT = HF_MMA_NT;
    constexpr uint32_t kstride = D + HF_MMA_KPAD;  // bf16 elements per staged K row
    constexpr uint32_t slice = D / 4u, ksteps = D / 64u, ntd = D / 32u;
    extern __shared__ __align__(16) unsigned char hf_smem[];
    const uint32_t groups = (H + HB - 1u) / HB;
    const uint32_t t = blockIdx.x / groups, hbase = (blockIdx.x % groups) * HB;
    if (t >= T) return;
    hf_bf16* kbuf = (hf_bf16*)hf_smem;                                         // [ST][NT][kstride]
    float* sp = (float*)(hf_smem + (uint32_t)ST * NT * kstride * 2u);          // [4][HB][SROW]
    hf_bf16* pb = (hf_bf16*)((unsigned char*)sp + 4u * HB * HF_MMA_SROW * 4u);  // [HB][PROW]
    int32_t* vld = (int32_t*)((unsigned char*)pb + HB * HF_MMA_PROW * 2u);     // [ST][NT]
    float* corr_s = (float*)(vld + (uint32_t)ST * NT);                          // [HB]
    float* m_s = corr_s + HB;                                                   // [HB]
    float* l_s = m_s + HB;                                                      // [HB]

    const uint32_t tid = threadIdx.x, warp = tid / 32u, lane = tid % 32u, g = lane >> 2, c4 = lane & 3u;
    const uint32_t mg = warp >> 2, ds = warp & 3u;
    const uint32_t d_lo = ds * slice;
    const float NEG_INF = __int_as_float(0xff800000);

    // Q of this warp's 16 heads over its d-slice as A fragments (zero for heads >= H).
    uint32_t qa[HF_MMA_MAXKS][4];
#pragma unroll
    for (int ks = 0; ks < HF_MMA_MAXKS; ++ks) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const uint32_t h = hbase + mg * 16u + g + ((r & 1) ? 8u : 0u);
            const uint32_t d = d_lo + (uint32_t)ks * 16u + 2u * c4 + ((r & 2) ? 8u : 0u);
            qa[ks][r] = ((uint32_t)ks < ksteps && h < H)
                            ? *(const uint32_t*)(q + ((uint64_t)t * H + h) * D + d)
                            : 0u;
        }
    }
    float o[HF_MMA_MAXNT][4];
#pragma unroll
    for (int i = 0; i < HF_MMA_MAXNT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    const int32_t mb = main_indptr[t], me = main_indptr[t + 1u];
    const int32_t eb = has_extra ? extra_indptr[t] : 0, ee = has_extra ? extra_indptr[t + 1u] : 0;
    const uint32_t nm = me > mb ? (uint32_t)(me - mb) : 0u, ne = ee > eb ? (uint32_t)(ee - eb) : 0u;
    const uint32_t n = nm + ne, ntiles = (n + NT - 1u) / NT;

    // Stage tile `tile` in buffer `b`: invalid or missing entries become zero rows, vld[b][e] = 0.
    auto load_tile = [&](uint32_t tile, uint32_t b) {
        // TPE threads per entry, each moving PPT 16-byte pieces of its row: one index read each.
        constexpr uint32_t TPE = NTH / NT, PPT = (D / 8u) / TPE;
        const uint32_t e = tid / TPE, sub = tid % TPE, j = tile * NT + e;
        const hf_bf16* src = main_cache;
        uint32_t ok = 0u;
        if (j < nm) {
            const int32_t slot = main_idx[mb + (int32_t)j];
            ok = (slot >= 0 && (uint32_t)slot < S_main) ? 1u : 0u;
            if (ok) src = main_cache + (uint64_t)slot * D;
        } else if (j < n) {
            const int32_t slot = extra_idx[eb + (int32_t)(j - nm)];
            ok = (slot >= 0 && (uint32_t)slot < S_extra) ? 1u : 0u;
            if (ok) src = extra_cache + (uint64_t)slot * D;
        }
        const uint32_t dst = hf_smem_addr(kbuf + ((uint64_t)b * NT + e) * kstride);
#pragma unroll
        for (uint32_t k = 0; k < PPT; ++k) {
            const uint32_t part = sub + k * TPE;
            hf_cp_async16(dst + part * 16u, src + (ok ? part * 8u : 0u), ok ? 16u : 0u);
        }
        if (sub == 0u) vld[b * NT + e] = (int32_t)ok;
        hf_cp_async_commit();
    };

    // Softmax state of head `hl = tid / 8` (identical in its 8 lanes).
    const uint32_t hl = tid >> 3, e0 = (tid & 7u) * 4u;
    float m_run = NEG_INF, l_run = 0.0f;

    // ST - 1 tiles in flight ahead of the one being computed (one commit group per tile, empty
    // groups past the end keep the count uniform).
#pragma unroll
    for (uint32_t s0 = 0; s0 + 1u < (uint32_t)ST; ++s0) {
        if (s0 < ntiles) load_tile(s0, s0);
        else hf_cp_async_commit();
    }
    for (uint32_t tile = 0; tile < ntiles; ++tile) {
        const uint32_t b = tile % (uint32_t)ST;
        hf_cp_async_wait<ST - 2>();
        __syncthreads();  // tile visible to all; everyone is done with the buffer refilled next
        const uint32_t ahead = tile + (uint32_t)ST - 1u;
        if (ahead < ntiles) load_tile(ahead, ahead % (uint32_t)ST);
        else hf_cp_async_commit();
        const hf_bf16* kt = kbuf + (uint64_t)b * NT * kstride;

        // (1) partial scores of 16 heads x 32 entries over this warp's d-slice.
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const uint32_t erow = (uint32_t)nt * 8u + (lane & 7u);
#pragma unroll
            for (int ks = 0; ks < HF_MMA_MAXKS; ks += 2) {
                if ((uint32_t)ks + 1u < ksteps) {
                    uint32_t b0, b1, b2, b3;
                    hf_ldsm_x4(hf_smem_addr(kt + erow * kstride + d_lo + (uint32_t)ks * 16u + (lane >> 3) * 8u), b0, b1, b2, b3);
                    hf_mma_bf16(acc, qa[ks], b0, b1);
                    hf_mma_bf16(acc, qa[ks + 1], b2, b3);
                } else if ((uint32_t)ks < ksteps) {
                    uint32_t b0, b1;
                    hf_ldsm_x2(hf_smem_addr(kt + erow * kstride + d_lo + (uint32_t)ks * 16u + ((lane >> 3) & 1u) * 8u), b0, b1);
                    hf_mma_bf16(acc, qa[ks], b0, b1);
                }
            }
            float* row0 = sp + ((uint64_t)ds * HB + mg * 16u + g) * HF_MMA_SROW + (uint32_t)nt * 8u + 2u * c4;
            row0[0] = acc[0];
            row0[1] = acc[1];
            row0[8u * HF_MMA_SROW] = acc[2];
            row0[8u * HF_MMA_SROW + 1u] = acc[3];
        }
        __syncthreads();

        // (2) scores summed over the slices in order, online softmax, P as bf16.
        {
            float s[4], mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint32_t at = hl * HF_MMA_SROW + e0 + (uint32_t)i, stride = HB * HF_MMA_SROW;
                const float v = ((sp[at] + sp[at + stride]) + sp[at + 2u * stride]) + sp[at + 3u * stride];
                s[i] = vld[b * NT + e0 + (uint32_t)i] ? v * scale : NEG_INF;
                mx = fmaxf(mx, s[i]);
            }
            mx = fmaxf(mx, hf_shfl_xor(mx, 1));
            mx = fmaxf(mx, hf_shfl_xor(mx, 2));
            mx = fmaxf(mx, hf_shfl_xor(mx, 4));
            const float mn = fmaxf(m_run, mx);
            const float corr = m_run == NEG_INF ? 0.0f : expf(m_run - mn);
            float rs = 0.0f;
            uint32_t packed[2];
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const float p0 = s[i] == NEG_INF ? 0.0f : expf(s[i] - mn);
                const float p1 = s[i + 1] == NEG_INF ? 0.0f : expf(s[i + 1] - mn);
                const hf_bf16 q0 = hf_f32_to_bf16(p0), q1 = hf_f32_to_bf16(p1);
                rs += hf_bf16_to_f32(q0);
                rs += hf_bf16_to_f32(q1);
                packed[i / 2] = (uint32_t)q0.bits | ((uint32_t)q1.bits << 16);
            }
            rs += hf_shfl_xor(rs, 1);
            rs += hf_shfl_xor(rs, 2);
            rs += hf_shfl_xor(rs, 4);
            l_run = l_run * corr + rs;
            m_run = mn;
            uint32_t* prow = (uint32_t*)(pb + hl * HF_MMA_PROW + e0);
            prow[0] = packed[0];
            prow[1] = packed[1];
            if ((tid & 7u) == 0u) corr_s[hl] = corr;
        }
        __syncthreads();

        // (3) O = O·corr + P·V over this warp's heads and d-slice.
        {
            const float c0 = corr_s[mg * 16u + g], c1 = corr_s[mg * 16u + g + 8u];
#pragma unroll
            for (int i = 0; i < HF_MMA_MAXNT; ++i) {
                o[i][0] *= c0;
                o[i][1] *= c0;
                o[i][2] *= c1;
                o[i][3] *= c1;
            }
#pragma unroll
            for (int kk = 0; kk < (int)(NT / 16u); ++kk) {
                uint32_t a[4];
                hf_ldsm_x4(hf_smem_addr(pb + (mg * 16u + (lane & 7u) + ((lane >> 3) & 1u) * 8u) * HF_MMA_PROW
                                        + (uint32_t)kk * 16u + (lane >> 4) * 8u),
                           a[0], a[1], a[2], a[3]);
                const uint32_t erow = (uint32_t)kk * 16u + ((lane >> 3) & 1u) * 8u + (lane & 7u);
#pragma unroll
                for (int np = 0; np < HF_MMA_MAXNT; np += 2) {
                    if ((uint32_t)np < ntd) {
                        uint32_t b0, b1, b2, b3;
                        hf_ldsm_x4_t(hf_smem_addr(kt + erow * kstride + d_lo + (uint32_t)np * 8u + (lane >> 4) * 8u), b0, b1,
                                     b2, b3);
                        hf_mma_bf16(o[np], a, b0, b1);
                        hf_mma_bf16(o[np + 1], a, b2, b3);
                    }
                }
            }
        }
    }

    // Sink and normalisation: m' = max(m, sink), l' = l·e^(m−m') + e^(sink−m'), out = O·e^(m−m')/l'.
    if ((tid & 7u) == 0u) {
        m_s[hl] = m_run;
        l_s[hl] = l_run;
    }
    __syncthreads();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const uint32_t hr = mg * 16u + g + (uint32_t)half * 8u, h = hbase + hr;
        if (h >= H) continue;
        const float m = m_s[hr], sk = sink[h];
        const float mn = fmaxf(m, sk);
        const float corr = m == NEG_INF ? 0.0f : expf(m - mn);
        const float lp = l_s[hr] * corr + expf(sk - mn);
        const float f = lp > 0.0f ? corr / fmaxf(lp, 1e-30f) : 0.0f;
        uint32_t* orow = (uint32_t*)(out + ((uint64_t)t * H + h) * D + d_lo + 2u * c4);
#pragma unroll
        for (int i = 0; i < HF_MMA_MAXNT; ++i)
            if ((uint32_t)i < ntd) orow[i * 4] = hf_pack_bf16x2(o[i][half * 2] * f, o[i][half * 2 + 1] * f);
    }
}
#endif

// Entry points per (heads per block, head_dim): hf_sparse_attn_mma<16·MG>_d<D>_bf16. The D
// parameter must equal the template's head_dim (the launcher guarantees it).
#ifdef HF_ATTN_MMA
#define HF_ATTN_MMA_ENTRY(NAME, MG, DIM, MINB, ST)                                                                     \
    HF_KERNEL void __launch_bounds__(128 * MG, MINB)                                                                   \
        NAME(const hf_bf16* q, const hf_bf16* main_cache, const int32_t* main_idx, const int32_t* main_indptr,          \
             const hf_bf16* extra_cache, const int32_t* extra_idx, const int32_t* extra_indptr, const float* sink,      \
             hf_bf16* out, uint32_t T, uint32_t H, uint32_t D, uint32_t S_main, uint32_t S_extra, uint32_t has_extra,  \
             float scale) {                                                                                            \
        hf_dependent_kernel_start();                                                                                   \
        if (D != DIM) return;                                                                                          \
        hf_sparse_attn_mma<MG, DIM, ST>(q, main_cache, main_idx, main_indptr, extra_cache, extra_idx, extra_indptr, sink,   \
                                    out, T, H, S_main, S_extra, has_extra, scale);                                     \
    }
#else
// Without tensor cores (hipRTC, or CUDA below sm_80) the entries exist but the launcher never
// picks them: the portable kernel above serves those devices.
#define HF_ATTN_MMA_ENTRY(NAME, MG, DIM, MINB, ST)                                                                     \
    HF_KERNEL void NAME(const hf_bf16* q, const hf_bf16* main_cache, const int32_t* main_idx,                           \
                        const int32_t* main_indptr, const hf_bf16* extra_cache, const int32_t* extra_idx,              \
                        const int32_t* extra_indptr, const float* sink, hf_bf16* out, uint32_t T, uint32_t H,          \
                        uint32_t D, uint32_t S_main, uint32_t S_extra, uint32_t has_extra, float scale) { hf_dependent_kernel_start(); }
#endif
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma16_d64_bf16, 1, 64, 4, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32_d64_bf16, 2, 64, 2, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma16_d128_bf16, 1, 128, 4, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32_d128_bf16, 2, 128, 2, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma16_d256_bf16, 1, 256, 4, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32_d256_bf16, 2, 256, 2, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma16_d512_bf16, 1, 512, 4, 2)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32_d512_bf16, 2, 512, 2, 2)
// Three stages, one block per multiprocessor (where the grid fits the device once).
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32s3_d64_bf16, 2, 64, 1, 3)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32s3_d128_bf16, 2, 128, 1, 3)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32s3_d256_bf16, 2, 256, 1, 3)
HF_ATTN_MMA_ENTRY(hf_sparse_attn_mma32s3_d512_bf16, 2, 512, 1, 3)

// ---- Warpgroup path (sm_90a, HF_HAS_WGMMA): head_dim 512, 64 heads per block ----
//
// One cluster of blocks per (row, group of 64 heads) (block r of a cluster of ns takes the row's
// tiles r, r + ns, ..), two warpgroups (256 threads) per block. Q of the 64 heads sits in
// shared memory until warpgroup 0 read it into its registers, and is then the third of three K
// buffers; the row's entries (main, then extra) stream through them in cp.async-staged tiles of
// 64 entries, two tiles ahead. Q and the K tiles use the 128-byte swizzle (see the
// staging below), P the no-swizzle layout of 8 x 8 core matrices (hf_wg_off). The warpgroups
// take turns: per tile, warpgroup 0 (1) scores all 64 entries against the 64 heads (32 wgmma
// m64n64k16 over head_dim, Q from registers, loaded once per row, and K from shared memory), (2)
// keeps the row maxima and the running sums of the rounded P (a row's 64 entries sit in the four
// lanes of a quad) and writes P (bf16) and the rescale factors, then (3) accumulates
// O[:, 0..127] += P · V with four wgmma m64n128k16 (V is the K tile read N-major); warpgroup 1
// rescales and accumulates O[:, 128..511] (m64n256k16 + m64n128k16 per 16 entries) from the same
// P while warpgroup 0 scores the next tile, and stages the tiles after the first.
// Every output element's arithmetic depends on its own row and head only.
#define HF_WG_HEADS 64
#define HF_WG_NT 64
#define HF_WG_MAX_SPLIT 8
#define HF_WG_MBARS 4  // KFREE (one per K buffer) and QFREE
#define HF_WG_DW0 128  // head_dim columns of O accumulated by warpgroup 0 (the rest: warpgroup 1)

#if defined(HF_HAS_WGMMA)
#define HF_ATTN_WG 1
// Byte offset of element (r, k) in a no-swizzle K-major tile with K columns of bf16: core matrix
// (r / 8, k / 8) of 128 bytes, rows of 16 bytes.
__device__ __forceinline__ uint32_t hf_wg_off(uint32_t r, uint32_t k, uint32_t K) {
    return (r >> 3) * (K * 16u) + (k >> 3) * 128u + (r & 7u) * 16u + (k & 7u) * 2u;
}
// 2^x on the multi-function unit (relative error below 2^-22; 2^-inf = 0). The kernel keeps its
// scores in base 2: e^(s·scale) = 2^(s·scale·log2 e).
#define HF_WG_LOG2E 1.4426950408889634f
// A block barrier that the warpgroups may reach from different code (barrier.sync without
// .aligned; __syncthreads compiles to the aligned form, which all threads must reach at one place).
__device__ __forceinline__ void hf_wg_block_barrier() { asm volatile("barrier.sync 0;" ::: "memory"); }
// Named barrier `id` of `n` threads: wait for all of them (sync), or arrive without waiting.
__device__ __forceinline__ void hf_wg_named_sync(uint32_t id, uint32_t n) {
    asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void hf_wg_named_arrive(uint32_t id, uint32_t n) {
    asm volatile("barrier.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ float hf_wg_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// O·corr, skipped by warps whose every corr is 1 (the maximum did not move): multiplying by 1
// changes no bit, so the skip changes none either. N accumulators per thread (m64 x 2N).
template <uint32_t N>
__device__ __forceinline__ void hf_wg_rescale(float (&acc)[N], float corr0, float corr1) {
    if (__any_sync(0xffffffffu, corr0 != 1.0f || corr1 != 1.0f)) {
#pragma unroll
        for (uint32_t i = 0; i < N; ++i) acc[i] *= (i & 2u) ? corr1 : corr0;
    }
}
// acc += P · V over a 64-entry tile (P at descriptor dp, K-major; V at dv, N-major 128-byte
// swizzle, 64-column blocks 8192 bytes apart), waited for: N = 64, one m64n128k16 per 16
// entries; N = 192, an m64n256k16 and an m64n128k16 four column blocks on.
// WAIT false: issued and committed only (hf_wgmma_wait<0>() completes it).
template <uint32_t N, bool WAIT = true>
__device__ __forceinline__ void hf_wg_pv(float (&acc)[N], uint64_t dp, uint64_t dv) {
    static_assert(N == 64u || N == 192u, "128 or 384 columns");
    hf_wgmma_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < HF_WG_NT / 16u; ++kk) {
        if constexpr (N == 64u) {
            hf_wgmma_m64n128k16_tb(acc, dp + kk * 16u, dv + kk * (2048u >> 4), 1u);
        } else {
            hf_wgmma_m64n256k16_tb(acc, dp + kk * 16u, dv + kk * (2048u >> 4), 1u);
            hf_wgmma_m64n128k16_tb(acc + 128, dp + kk * 16u, dv + ((4u * 8192u) >> 4) + kk * (2048u >> 4), 1u);
        }
    }
    hf_wgmma_commit();
    if constexpr (WAIT) hf_wgmma_wait<0>();
}
// A thread's two rows of a warpgroup's accumulators (N per thread: 2N columns, n8 chunk j at
// columns 8j + 2c) scaled by f0 / f1 into bf16 output rows (skipped where null).
template <uint32_t N>
__device__ __forceinline__ void hf_wg_store_bf16(const float (&acc)[N], uint32_t* row0, uint32_t* row1, float f0, float f1) {
#pragma unroll
    for (uint32_t half = 0; half < 2u; ++half) {
        uint32_t* row = half ? row1 : row0;
        const float f = half ? f1 : f0;
        if (row == nullptr) continue;
#pragma unroll
        for (uint32_t j = 0; j < N / 4u; ++j) row[j * 4u] = hf_pack_bf16x2(acc[j * 4u + half * 2u] * f, acc[j * 4u + half * 2u + 1u] * f);
    }
}
// The same rows in f32 (shared memory, a split row's published O).
template <uint32_t N>
__device__ __forceinline__ void hf_wg_store_f32(const float (&acc)[N], float* row0, float* row1) {
#pragma unroll
    for (uint32_t half = 0; half < 2u; ++half) {
        float* row = half ? row1 : row0;
#pragma unroll
        for (uint32_t j = 0; j < N / 4u; ++j)
            *(float2*)(row + j * 8u) = make_float2(acc[j * 4u + half * 2u], acc[j * 4u + half * 2u + 1u]);
    }
}

__device__ __forceinline__ void hf_sparse_attn_wg(const hf_bf16* __restrict__ q, const hf_bf16* __restrict__ main_cache,
                                                  const int32_t* __restrict__ main_idx,
                                                  const int32_t* __restrict__ main_indptr,
                                                  const hf_bf16* __restrict__ extra_cache,
                                                  const int32_t* __restrict__ extra_idx,
                                                  const int32_t* __restrict__ extra_indptr,
                                                  const float* __restrict__ sink, hf_bf16* __restrict__ out, uint32_t T,
                                                  uint32_t H, uint32_t S_main, uint32_t S_extra, uint32_t has_extra,
                                                  float scale) {
    constexpr uint32_t D = 512u, HB = HF_WG_HEADS, NT = HF_WG_NT, NTH = 256u;
    constexpr uint32_t QB = HB * D * 2u, TB = NT * D * 2u, PB = HB * NT * 2u;
    constexpr uint32_t ATOM = NT * 128u;                   // bytes per 64-column block of a K tile
    constexpr uint32_t OST = D + 8u;                       // f32 row stride of O when published
    constexpr uint32_t DW0 = HF_WG_DW0;                    // warpgroup 0's columns of O
    extern __shared__ __align__(1024) unsigned char hf_smem_wg[];
    // The K tiles' 128-byte swizzle follows address bits 4-9: the layout starts 1024-aligned.
    unsigned char* hf_smem = hf_smem_wg + ((1024u - (hf_smem_addr(hf_smem_wg) & 1023u)) & 1023u);
    const uint32_t groups = (H + HB - 1u) / HB;
    // A cluster of `ns` blocks shares one (row, head group); block `rank` takes the row's tiles
    // rank, rank + ns, ... (an unclustered launch is a cluster of one).
    const uint32_t ns = hf_cluster_blocks(), rank = hf_cluster_rank(), cta = blockIdx.x / ns;
    const uint32_t t = cta / groups, hbase = (cta % groups) * HB;
    if (t >= T) return;  // the whole cluster: its blocks share the row
    // Three K buffers of TB bytes each at qs_a + k·TB: buffer 0 is Q's, free once warpgroup 0 holds
    // Q in its registers; tile i goes to buffer (i + 1) % 3 (tiles 0 and 1 into buffers 1 and 2,
    // beside Q; tile 2 over Q).
    static_assert(QB == TB, "Q's shared memory is the third K buffer");
    float* bias = (float*)(hf_smem + QB + 2u * TB + 2u * PB);  // [3][NT], per K buffer: 0, or -inf for a skipped entry
    float* red = bias + 3u * NT;                           // [2][HB]
    const uint32_t qs_a = hf_smem_addr(hf_smem), ps_a = qs_a + QB + 2u * TB;
    unsigned char* ps = hf_smem + QB + 2u * TB;  // [2] P tiles

    // The warpgroup index through a shuffle, so the compiler sees it uniform across the warp and
    // keeps the operand descriptors in uniform registers.
    const uint32_t tid = threadIdx.x, wg = hf_shfl(tid >> 7, 0), warp = (tid >> 5) & 3u, lane = tid & 31u;
    const uint32_t g = lane >> 2, c = lane & 3u;
    const uint32_t r0 = warp * 16u + g, r1 = r0 + 8u;  // this thread's two heads (block rows)
    const float NEG_INF = __int_as_float(0xff800000);

    const int32_t mb = main_indptr[t], me = main_indptr[t + 1u];
    const int32_t eb = has_extra ? extra_indptr[t] : 0, ee = has_extra ? extra_indptr[t + 1u] : 0;
    const uint32_t nm = me > mb ? (uint32_t)(me - mb) : 0u, ne = ee > eb ? (uint32_t)(ee - eb) : 0u;
    const uint32_t n = nm + ne, ntiles = (n + NT - 1u) / NT;
    const uint32_t nloc = ntiles > rank ? (ntiles - rank + ns - 1u) / ns : 0u;  // this block's tiles

    // Q in the K tiles' layout (below): thread t stages heads t / 8 + 32u of chunk t % 8 of every
    // 64-column block (heads past H are zero rows). Its own cp.async group (the first).
#pragma unroll
    for (uint32_t u = 0; u < HB / 32u; ++u) {
        const uint32_t r = (tid >> 3) + 32u * u, cq = tid & 7u, h = hbase + r;
        const bool ok = h < H;
        const hf_bf16* src = q + (ok ? ((uint64_t)t * H + h) * D + cq * 8u : 0u);
#pragma unroll
        for (uint32_t a = 0; a < D / 64u; ++a)
            hf_cp_async16(qs_a + a * (HB * 128u) + r * 128u + ((cq ^ (r & 7u)) << 4), src + (ok ? a * 64u : 0u), ok ? 16u : 0u);
    }
    hf_cp_async_commit();
    // K tiles use the 128-byte-swizzled K-major layout: column block a (head_dim 64a .. 64a + 63)
    // of entry e sits at a·ATOM + 128·e, its 16-byte chunk c at chunk c ^ (e % 8). Eight threads
    // stage each entry (chunk k % 8 of every column block for thread k), so a warp's copy reads
    // four whole 128-byte lines and writes 512 contiguous bytes. The first tile is staged by the
    // whole block (entries k / 8 and k / 8 + 32 of thread k; the second cp.async group), every
    // later one by warpgroup 1 (entries k / 8 + 16u, u < 4, of its thread k; one group per tile).
    // The slots (-1 past the list) are plain loads fetched ahead (three tiles ahead in the loop),
    // so that staging does not wait on them.
    auto fetch = [&](uint32_t tile, uint32_t e) -> int32_t {
        const uint32_t j = tile * NT + e;
        const int32_t* at = j < nm ? main_idx + mb + (int32_t)j : extra_idx + eb + (int32_t)(j - nm);
        return j < n ? *at : -1;
    };
    // Entry e of tile `tile` into K buffer `kb` (an invalid or missing entry is a zero row with
    // bias -inf), chunk c8 of every column block.
    auto stage_entry = [&](uint32_t tile, uint32_t kb, uint32_t e, uint32_t c8, int32_t slot) {
        const uint32_t j = tile * NT + e;
        const bool in_main = j < nm;
        const bool ok = j < n && slot >= 0 && (uint32_t)slot < (in_main ? S_main : S_extra);
        const hf_bf16* src = (in_main ? main_cache : extra_cache) + (ok ? (uint64_t)slot * D + c8 * 8u : 0u);
        const uint32_t dst = qs_a + kb * TB + e * 128u + ((c8 ^ (e & 7u)) << 4), bytes = ok ? 16u : 0u;
        const uint32_t step = ok ? 64u : 0u;
#pragma unroll
        for (uint32_t a = 0; a < D / 64u; ++a) hf_cp_async16(dst + a * ATOM, src + a * step, bytes);
        if (c8 == 0u) bias[kb * NT + e] = ok ? 0.0f : NEG_INF;
    };
    if (nloc > 0u) {
        const uint32_t se = tid >> 3;
        const int32_t s0 = fetch(rank, se), s1 = fetch(rank, se + 32u);
        stage_entry(rank, 1u, se, tid & 7u, s0);
        stage_entry(rank, 1u, se + 32u, tid & 7u, s1);
    }
    hf_cp_async_commit();
    // Warpgroup 1's four entries of local tile `i`: their slots (into one of three sets), then their
    // copies.
    const uint32_t u1 = tid - 128u, se1 = u1 >> 3, c81 = u1 & 7u;
    int32_t sl[4], sl2[4], sl3[4];
    auto fetch4 = [&](uint32_t i, int32_t(&dst)[4]) {
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) dst[u] = fetch(rank + i * ns, se1 + 16u * u);
    };
    auto stage4 = [&](uint32_t i, uint32_t kb, const int32_t(&src)[4]) {
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) stage_entry(rank + i * ns, kb, se1 + 16u * u, c81, src[u]);
    };
    // The second tile, by warpgroup 1 into buffer 2 (its third cp.async group; empty past the list).
    if (wg == 1u) {
        if (nloc > 1u) {
            fetch4(1u, sl);
            stage4(1u, 2u, sl);
        }
        hf_cp_async_commit();
    }
    // The warpgroups' mbarrier hand-offs (below): KFREE's of 256 arrivals, QFREE's of 128.
    const uint32_t mbar = hf_smem_addr(red + 2u * HB);
    const uint32_t BAR_KFREE = mbar, BAR_QFREE = mbar + 24u;
    if (tid == 0u) {
#pragma unroll
        for (uint32_t i = 0; i < HF_WG_MBARS; ++i) hf_mbar_init(mbar + 8u * i, i < 3u ? 256u : 128u);
    }
    // Q landed (this thread's copies; the tiles' groups may still be in flight: warpgroup 0 loads
    // Q into its registers while the first tile, three dependent loads behind (row pointers,
    // slots, rows), still lands, and each warpgroup then waits for that tile in its branch).
    if (wg == 0u) hf_cp_async_wait<1>(); else hf_cp_async_wait<2>();
    __syncthreads();  // Q visible; the mbarriers initialised

    // O's columns: warpgroup 0 accumulates head_dim 0 .. DW0 - 1, warpgroup 1 the rest (each in
    // its own register array, declared in its branch: 64 x DW0 and 64 x (D - DW0) f32).
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    // Operand descriptors at k-step 0 of K buffer 0: P (no swizzle) and this warpgroup's columns
    // of V (the K tile read N-major, 128-byte swizzle: 64-column blocks ATOM bytes apart, 8-entry
    // groups 1024); the K tile's (K-major) is warpgroup 0's, below. Buffer kb is kb·TB / 16 on.
    const uint64_t dp0 = hf_wgmma_desc(ps_a, 128u, NT * 16u),
                   dv0 = hf_wgmma_desc_sw128(qs_a + (wg ? DW0 / 64u : 0u) * ATOM, ATOM, 1024u);

    // The two warpgroups in turn. Warpgroup 0 scores each whole tile (S = Q · K^T, 32 wgmma
    // m64n64k16, Q from registers), keeps the row maxima and sums (a row's 64 entries sit in the
    // four lanes of a quad), writes P (bf16) and the rescale factors, then accumulates O's first
    // DW0 columns. Warpgroup 1 accumulates the rest of O from the same P and stages the tiles
    // after the first two, two tiles ahead. The hand-offs: KREADY (a tile's copies landed: 1
    // arrives, 0 syncs) and PFULL (P and factors written: 0 arrives, 1 syncs) are named barriers
    // of both warpgroups (256 threads), a pair per signal used by tile parity (PFULL of tile it is
    // barrier 3 + it % 2, KREADY of tile it barrier 5 + (it - 1) % 2): neither side can arrive at
    // one twice before the other synced on it, as each side's next arrival there needs a signal
    // of the other's that follows that sync. KFREE (an mbarrier per K buffer, 256 arrivals: both
    // warpgroups done with the buffer's tile; 1 waits before staging tile + 3 into it; phase
    // (tile / 3) % 2) and QFREE (an mbarrier: Q read into warpgroup 0's registers, buffer 0 free
    // for tile 2). Warpgroup 0's own P is written before its P · V reads it by named barrier 2
    // (its 128 threads); the first tile goes to warpgroup 0 on named barrier 1.
    // P and the factors are double-buffered: warpgroup 0 rewrites those of tile it only after
    // KREADY of tile it + 2, which warpgroup 1 gives once its P · V of tile it completed.
    float* corr_s = red;  // [2][HB]: the rescale factors of the tile of each parity
    // The end of the row, which each warpgroup reaches in its own branch with its accumulators
    // (N per thread: O's columns dbase .. dbase + 2N - 1): finish_sums, then for an unsplit row
    // the scaled outputs (stage_row, out_factor and hf_wg_store_bf16, then copy_out), for a
    // split row O published (hf_wg_store_f32 into `os`) and finish_combine. Their block barriers
    // are the unaligned form.
    float* ms = bias;                          // [HB] maxima (the validity flags are no longer read)
    float* os = (float*)(hf_smem + QB);        // a split row's O in f32 (rows of OST floats over K buffers 1, 2 and P)
    auto finish_sums = [&]() {
        hf_cp_async_wait<0>();
        // Sink and normalisation with warpgroup 0's running maxima and sums.
        hf_wg_block_barrier();  // every MMA of both warpgroups is done with K and P
        if (wg == 0u && c == 0u) {
            ms[r0] = m0;
            ms[r1] = m1;
            red[r0] = l0;
            red[r1] = l1;
        }
        hf_wg_block_barrier();
    };
    // An unsplit row's outputs are staged in bf16 over the K tiles (free once finish_sums ran),
    // rows of OSB bytes (16 bytes of padding: a warp's 4-byte stores of 8 rows x 4 columns hit
    // 32 distinct banks), then copied out in 16-byte pieces, a warp writing 512 contiguous bytes:
    // the accumulators' layout would give each store instruction 8 rows x 16 bytes (half sectors).
    constexpr uint32_t OSB = D * 2u + 16u;
    static_assert(HB * OSB <= 2u * TB, "the staged outputs fit over the two K tiles");
    unsigned char* ob = hf_smem + QB;
    // Row `half` of this thread's (r0, r1) in the staged outputs at column dbase + 2c, or null
    // past H.
    auto stage_row = [&](uint32_t half, uint32_t dbase) -> uint32_t* {
        const uint32_t hr = half ? r1 : r0;
        return hbase + hr < H ? (uint32_t*)(ob + hr * OSB + (dbase + 2u * c) * 2u) : nullptr;
    };
    // The staged rows (heads below H) to the output, once both warpgroups staged theirs.
    auto copy_out = [&]() {
        hf_wg_block_barrier();
        for (uint32_t i = tid; i < HB * (D / 8u); i += NTH) {
            const uint32_t hr = i / (D / 8u), ch = i % (D / 8u), h = hbase + hr;
            if (h < H)
                *(uint4*)(out + ((uint64_t)t * H + h) * D + ch * 8u) = *(const uint4*)(ob + hr * OSB + ch * 16u);
        }
    };
    // The factor of an unsplit row's outputs: corr / (l·corr + 2^(sink - m')), m' = max(m, sink).
    auto out_factor = [&](uint32_t half) -> float {
        const uint32_t hr = half ? r1 : r0, h = hbase + hr;
        if (h >= H) return 0.0f;
        const float m = ms[hr], sk = sink[h] * HF_WG_LOG2E;
        const float mn = fmaxf(m, sk);
        const float corr = m == NEG_INF ? 0.0f : hf_wg_exp2(m - mn);
        const float lp = red[hr] * corr + hf_wg_exp2(sk - mn);
        return lp > 0.0f ? corr / fmaxf(lp, 1e-30f) : 0.0f;
    };
    // A split row, once every block published its maxima (`ms`), running sums (`red`) and O
    // (`os`): block `rank` finishes heads [rank·HB/ns, (rank+1)·HB/ns) from all of them, in block
    // order: M = max(m_0, .., m_{ns-1}, sink), L = sum_c l_c·2^(m_c - M) + 2^(sink - M), and
    // out = sum_c O_c·(2^(m_c - M) / L). The weights go over Q (no longer read).
    auto finish_combine = [&]() {
        hf_cluster_sync();
        const uint32_t share = HB / ns, h0 = rank * share;
        float* wsm = (float*)hf_smem;  // [HF_WG_MAX_SPLIT][HB]
        if (tid < share) {
            const uint32_t hr = h0 + tid, h = hbase + hr;
            const float sk = h < H ? sink[h] * HF_WG_LOG2E : 0.0f;
            float mc[HF_WG_MAX_SPLIT];
            float mx = sk;
#pragma unroll
            for (uint32_t k = 0; k < HF_WG_MAX_SPLIT; ++k) {
                mc[k] = k < ns ? hf_cluster_load_f32(ms + hr, k) : NEG_INF;
                mx = fmaxf(mx, mc[k]);
            }
            float lt = 0.0f;
#pragma unroll
            for (uint32_t k = 0; k < HF_WG_MAX_SPLIT; ++k) {
                mc[k] = mc[k] == NEG_INF ? 0.0f : hf_wg_exp2(mc[k] - mx);
                if (k < ns) lt += hf_cluster_load_f32(red + hr, k) * mc[k];
            }
            lt += hf_wg_exp2(sk - mx);
            const float f = lt > 0.0f ? 1.0f / fmaxf(lt, 1e-30f) : 0.0f;
#pragma unroll
            for (uint32_t k = 0; k < HF_WG_MAX_SPLIT; ++k)
                if (k < ns) wsm[k * HB + tid] = mc[k] * f;
        }
        hf_wg_block_barrier();
        for (uint32_t i = tid; i < share * (D / 4u); i += NTH) {
            const uint32_t hl = i / (D / 4u), d4 = (i % (D / 4u)) * 4u, h = hbase + h0 + hl;
            float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (uint32_t k = 0; k < HF_WG_MAX_SPLIT; ++k) {
                if (k >= ns) break;
                const float w = wsm[k * HB + hl];
                const float4 v = hf_cluster_load_f32x4(os + (h0 + hl) * OST + d4, k);
                acc.x = fmaf(v.x, w, acc.x);
                acc.y = fmaf(v.y, w, acc.y);
                acc.z = fmaf(v.z, w, acc.z);
                acc.w = fmaf(v.w, w, acc.w);
            }
            if (h < H) {
                uint32_t* orow = (uint32_t*)(out + ((uint64_t)t * H + h) * D + d4);
                orow[0] = hf_pack_bf16x2(acc.x, acc.y);
                orow[1] = hf_pack_bf16x2(acc.z, acc.w);
            }
        }
        hf_cluster_sync();  // no block leaves while the others may still read its shared memory
    };
    // Each warpgroup's end of the row with its accumulators.
#define HF_WG_FINISH(acc, dbase)                                                                        \
    do {                                                                                                \
        finish_sums();                                                                                  \
        if (ns == 1u) {                                                                                 \
            hf_wg_store_bf16(acc, stage_row(0u, dbase), stage_row(1u, dbase), out_factor(0u), out_factor(1u)); \
            copy_out();                                                                                 \
        } else {                                                                                        \
            hf_wg_store_f32(acc, os + r0 * OST + (dbase) + 2u * c, os + r1 * OST + (dbase) + 2u * c);   \
            finish_combine();                                                                           \
        }                                                                                               \
    } while (0)
    if (wg == 0u) {
        const float scale2 = scale * HF_WG_LOG2E;
        const uint64_t dk0 = hf_wgmma_desc_sw128(qs_a, 16u, 1024u);
        // Q as wgmma A fragments in registers for the whole row, k-step ks in qf[ks] (ldmatrix from
        // the swizzled Q tile: lane l reads row (l / 8 % 2)·8 + l % 8 of its warp's 16, columns
        // 16·ks + (l / 16)·8 ..): the scores then read only K from shared memory.
        uint32_t qf[D / 16u][4];
        {
            const uint32_t rq = warp * 16u + ((lane >> 3) & 1u) * 8u + (lane & 7u);
#pragma unroll
            for (uint32_t ks = 0; ks < D / 16u; ++ks) {
                const uint32_t k = ks * 16u + (lane >> 4) * 8u;
                hf_ldsm_x4(qs_a + (k >> 6) * (HB * 128u) + rq * 128u + ((((k & 63u) >> 3) ^ (rq & 7u)) << 4), qf[ks][0],
                           qf[ks][1], qf[ks][2], qf[ks][3]);
            }
        }
        hf_mbar_arrive(BAR_QFREE);  // buffer 0 (Q's) may take tile 2
        // The first tile: this thread's copies, then every thread's (warpgroup 1 arrives).
        hf_cp_async_wait<0>();
        hf_fence_proxy_async();
        hf_wg_named_sync(1u, 256u);
        float o[DW0 / 2u];  // 64 x DW0 f32 accumulators: O[:, 0 .. DW0 - 1]
#pragma unroll
        for (uint32_t i = 0; i < DW0 / 2u; ++i) o[i] = 0.0f;
        for (uint32_t it = 0; it < nloc; ++it) {
            const uint32_t b = it & 1u, kb = (it + 1u) % 3u;
            if (it > 0u) hf_wg_named_sync(5u + ((it - 1u) & 1u), 256u);  // KREADY of tile it
            // (1) S = Q · K^T over the tile's 64 entries, Q from registers. The K descriptor
            // advances by its start address (bytes / 16): 32 bytes per k-step within a 64-column
            // block (the swizzle applies to the final address), a block's bytes across.
            float s[32];
            const uint64_t dk = dk0 + (uint64_t)(kb * (TB >> 4));
            hf_wgmma_fence();
#pragma unroll
            for (uint32_t ks = 0; ks < D / 16u; ++ks)
                hf_wgmma_m64n64k16_rs(s, qf[ks], dk + (ks >> 2) * (ATOM >> 4) + (ks & 3u) * 2u, ks > 0u ? 1u : 0u);
            hf_wgmma_commit();
            hf_wgmma_wait<0>();

            // (2) masked, scaled scores in base 2 (s·scale·log2 e + bias); row maxima; P in bf16.
            const float* vb = bias + kb * NT;
            float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
            for (uint32_t j = 0; j < 8u; ++j) {
                const float2 bb = *(const float2*)(vb + j * 8u + 2u * c);
#pragma unroll
                for (uint32_t u = 0; u < 2u; ++u) {
                    const float bu = u ? bb.y : bb.x;
                    s[j * 4u + u] = fmaf(s[j * 4u + u], scale2, bu);
                    s[j * 4u + 2u + u] = fmaf(s[j * 4u + 2u + u], scale2, bu);
                    mx0 = fmaxf(mx0, s[j * 4u + u]);
                    mx1 = fmaxf(mx1, s[j * 4u + 2u + u]);
                }
            }
            mx0 = fmaxf(mx0, hf_shfl_xor(mx0, 1));
            mx0 = fmaxf(mx0, hf_shfl_xor(mx0, 2));
            mx1 = fmaxf(mx1, hf_shfl_xor(mx1, 1));
            mx1 = fmaxf(mx1, hf_shfl_xor(mx1, 2));
            const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
            // With a finite reference (0 while nothing is valid yet), e^(-inf - ref) = 0 covers
            // the masked entries and the empty start without branches.
            const float f0 = n0 == NEG_INF ? 0.0f : n0, f1 = n1 == NEG_INF ? 0.0f : n1;
            const float corr0 = hf_wg_exp2(m0 - f0), corr1 = hf_wg_exp2(m1 - f1);
            unsigned char* pb = ps + b * PB;
            float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
            for (uint32_t j = 0; j < 8u; ++j) {
                const uint32_t e = j * 8u + 2u * c;
                const float a0 = hf_wg_exp2(s[j * 4u] - f0), a1 = hf_wg_exp2(s[j * 4u + 1u] - f0);
                const float b0 = hf_wg_exp2(s[j * 4u + 2u] - f1), b1 = hf_wg_exp2(s[j * 4u + 3u] - f1);
                // One paired conversion per two entries (2^x is never NaN here: x is -inf or at
                // most 0 for finite scores, and NaN scores make NaN outputs whatever the payload).
                const uint32_t qa = hf_pack_bf16x2_any_nan(a0, a1), qb = hf_pack_bf16x2_any_nan(b0, b1);
                rs0 += __uint_as_float(qa << 16);
                rs0 += __uint_as_float(qa & 0xffff0000u);
                rs1 += __uint_as_float(qb << 16);
                rs1 += __uint_as_float(qb & 0xffff0000u);
                *(uint32_t*)(pb + hf_wg_off(r0, e, NT)) = qa;
                *(uint32_t*)(pb + hf_wg_off(r1, e, NT)) = qb;
            }
            if (c == 0u) {
                corr_s[b * HB + r0] = corr0;
                corr_s[b * HB + r1] = corr1;
            }
            hf_fence_proxy_async();
            hf_wg_named_arrive(3u + b, 256u);  // PFULL: P and factors of tile it, to warpgroup 1
            rs0 += hf_shfl_xor(rs0, 1);
            rs0 += hf_shfl_xor(rs0, 2);
            rs1 += hf_shfl_xor(rs1, 1);
            rs1 += hf_shfl_xor(rs1, 2);
            l0 = l0 * corr0 + rs0;
            l1 = l1 * corr1 + rs1;
            m0 = n0;
            m1 = n1;
            hf_wg_rescale(o, corr0, corr1);
            hf_wg_named_sync(2u, 128u);  // P of the whole warpgroup written (warpgroup 0 only)

            // (3) O[:, 0 .. DW0 - 1] += P · V
            hf_wg_pv(o, dp0 + (uint64_t)(b * (PB >> 4)), dv0 + (uint64_t)(kb * (TB >> 4)));
            if (it + 3u < nloc) hf_mbar_arrive(BAR_KFREE + 8u * kb);
        }
        HF_WG_FINISH(o, 0u);
    } else {
        // The first tile: this thread's copies (its second group; the third, the second tile's,
        // may still be in flight), then to warpgroup 0 on named barrier 1.
        hf_cp_async_wait<1>();
        hf_fence_proxy_async();
        hf_wg_named_arrive(1u, 256u);
        float o[(D - DW0) / 2u];  // 64 x (D - DW0) f32 accumulators: O[:, DW0 .. D - 1]
#pragma unroll
        for (uint32_t i = 0; i < (D - DW0) / 2u; ++i) o[i] = 0.0f;
        // The slots of tile it + 2 are in sl, sl2 or sl3 by it % 3, loaded three iterations ahead:
        // their loads queue behind the K rows' copies in flight, so a tile's lead is not enough.
        // The loop is unrolled by three so that each set stays in its registers (a copy from one
        // set to another would wait for its loads).
        if (nloc > 2u) fetch4(2u, sl);
        if (nloc > 3u) fetch4(3u, sl2);
        if (nloc > 4u) fetch4(4u, sl3);
#define HF_WG1_STEP(it, sx)                                                                              \
    do {                                                                                                 \
        const uint32_t b = (it) & 1u, kb = ((it) + 1u) % 3u;                                             \
        /* Tile it + 2 into buffer it % 3 (tile it - 1's, or Q's for tile 2) once both warpgroups   */   \
        /* are done with what it holds; a group per iteration (empty past the list).                 */   \
        if ((it) + 2u < nloc) {                                                                          \
            if ((it) == 0u) hf_mbar_wait(BAR_QFREE, 0u);                                                 \
            else hf_mbar_wait(BAR_KFREE + 8u * ((it) % 3u), (((it) - 1u) / 3u) & 1u);                    \
            stage4((it) + 2u, (it) % 3u, sx);                                                            \
            if ((it) + 5u < nloc) fetch4((it) + 5u, sx);                                                 \
        }                                                                                                \
        hf_cp_async_commit();                                                                            \
        /* P · V of tile it issued, then tile it + 1 to warpgroup 0 once it landed: a tile whose      */ \
        /* copies are late holds back no P · V.                                                       */ \
        hf_wg_named_sync(3u + b, 256u); /* PFULL of tile it */                                           \
        hf_wg_rescale(o, corr_s[b * HB + r0], corr_s[b * HB + r1]);                                      \
        /* (3) O[:, DW0 .. D - 1] += P · V */                                                            \
        hf_wg_pv<(D - DW0) / 2u, false>(o, dp0 + (uint64_t)(b * (PB >> 4)), dv0 + (uint64_t)(kb * (TB >> 4))); \
        if ((it) + 1u < nloc) {                                                                          \
            hf_cp_async_wait<1>();                                                                       \
            hf_fence_proxy_async();                                                                      \
            hf_wg_named_arrive(5u + b, 256u); /* KREADY of tile it + 1 */                                \
        }                                                                                                \
        hf_wgmma_wait<0>();                                                                              \
        if ((it) + 3u < nloc) hf_mbar_arrive(BAR_KFREE + 8u * kb);                                       \
    } while (0)
        for (uint32_t it = 0; it < nloc; it += 3u) {
            HF_WG1_STEP(it, sl);
            if (it + 1u < nloc) HF_WG1_STEP(it + 1u, sl2);
            if (it + 2u < nloc) HF_WG1_STEP(it + 2u, sl3);
        }
#undef HF_WG1_STEP
        HF_WG_FINISH(o, DW0);
#undef HF_WG_FINISH
    }
}
#endif

// The warpgroup entry (head_dim 512). Without warpgroup MMA the entry exists but the launcher never
// picks it.
HF_KERNEL void
#if defined(HF_ATTN_WG)
__launch_bounds__(256, 1)
#endif
hf_sparse_attn_wg64_d512_bf16(const hf_bf16* q, const hf_bf16* main_cache, const int32_t* main_idx,
                              const int32_t* main_indptr, const hf_bf16* extra_cache, const int32_t* extra_idx,
                              const int32_t* extra_indptr, const float* sink, hf_bf16* out, uint32_t T, uint32_t H,
                              uint32_t D, uint32_t S_main, uint32_t S_extra, uint32_t has_extra, float scale) {
    hf_dependent_kernel_start();
#if defined(HF_ATTN_WG)
    if (D != 512u) return;
    hf_sparse_attn_wg(q, main_cache, main_idx, main_indptr, extra_cache, extra_idx, extra_indptr, sink, out, T, H,
                      S_main, S_extra, has_extra, scale);
#endif
}
"#;

/// Most query heads [`SparseAttention`] takes.
pub const MAX_HEADS: usize = 1 << 12;

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

/// An attention entry point: every attention kernel takes the same parameters.
fn attend_entry(name: &'static str) -> KernelEntry {
    let u = |n| Param::scalar(n, ScalarKind::U32);
    KernelEntry {
        name,
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
    }
}

/// `head_dim`s the tensor-core kernel is instantiated for.
pub const TENSOR_CORE_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];
const MMA_DIMS: [usize; 4] = TENSOR_CORE_HEAD_DIMS;

/// One tensor-core entry: `16 · mg` heads per block, `stages` K tiles staged (the kernel's `MG` and
/// `ST`; the pipeline depth changes no arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MmaShape {
    mg: usize,
    stages: usize,
}

/// 16 heads per block, two stages (up to four blocks per multiprocessor).
const MMA16: MmaShape = MmaShape { mg: 1, stages: 2 };
/// 32 heads per block, two stages (two blocks per multiprocessor at `head_dim` 512).
const MMA32: MmaShape = MmaShape { mg: 2, stages: 2 };
/// 32 heads per block, three stages (one block per multiprocessor at `head_dim` 512): where the
/// grid fits the device once. On the H200 at 64 heads, `head_dim` 512 (one run): batch 64 took
/// 60.7 µs over 640 entries per row and 672 µs over 8320, against 72.9 and 859 µs with 16 heads
/// and two stages (the choice before) and 68.6 and 769 with 32 heads and two stages; batch 1 took
/// 53.6 and 610 µs against 56.4 and 641, batch 8 about the same (56.2 / 714 against 56.8 / 709).
/// At batch 256 (four blocks per multiprocessor's worth) it is slower than two stages (231
/// against 174 µs), so that batch keeps [`MMA32`]. (Blocks of 64 heads, which read each row's
/// entries once instead of twice, were slower at batch 1 to 64 and level at 256.)
const MMA32_DEEP: MmaShape = MmaShape { mg: 2, stages: 3 };
/// The tensor-core shape for `rows` rows of `heads` heads on a device of `units`
/// multiprocessors: more than 16 heads, 32 per block with three stages while that grid fits the
/// multiprocessors once (one block each), two stages past it (two blocks each); up to 16 heads,
/// 16 per block while 32-head blocks would not fill the device.
fn mma_shape(rows: usize, heads: usize, units: usize) -> MmaShape {
    let blocks32 = rows.max(1) * heads.div_ceil(32);
    if heads > 16 && blocks32 <= units {
        MMA32_DEEP
    } else if heads > 16 || blocks32 >= units {
        MMA32
    } else {
        MMA16
    }
}

/// Every tensor-core shape the kernel source instantiates.
const MMA_SHAPES: [MmaShape; 3] = [MMA16, MMA32, MMA32_DEEP];

/// The tensor-core entry of `shape` at `head_dim` `d` (one of [`MMA_DIMS`]).
fn mma_entry(shape: MmaShape, d: usize) -> &'static str {
    match (shape.mg, shape.stages, d) {
        (1, _, 64) => "hf_sparse_attn_mma16_d64_bf16",
        (1, _, 128) => "hf_sparse_attn_mma16_d128_bf16",
        (1, _, 256) => "hf_sparse_attn_mma16_d256_bf16",
        (1, _, _) => "hf_sparse_attn_mma16_d512_bf16",
        (_, 2, 64) => "hf_sparse_attn_mma32_d64_bf16",
        (_, 2, 128) => "hf_sparse_attn_mma32_d128_bf16",
        (_, 2, 256) => "hf_sparse_attn_mma32_d256_bf16",
        (_, 2, _) => "hf_sparse_attn_mma32_d512_bf16",
        (_, _, 64) => "hf_sparse_attn_mma32s3_d64_bf16",
        (_, _, 128) => "hf_sparse_attn_mma32s3_d128_bf16",
        (_, _, 256) => "hf_sparse_attn_mma32s3_d256_bf16",
        _ => "hf_sparse_attn_mma32s3_d512_bf16",
    }
}
/// Entries per shared-memory tile of the tensor-core kernel (`HF_MMA_NT`).
const MMA_TILE: usize = 32;

/// Dynamic shared memory of one tensor-core block of `shape` at `head_dim` `d`, bytes (the
/// kernel's layout: the staged K tiles, four score slices, P, validity flags, three per-head
/// stats). Four stages for 16-head blocks were measured slower on the H200 (batch 64 at 64 heads,
/// 640 entries: 120 against 75 µs, one block per multiprocessor instead of two).
fn mma_shared_bytes(shape: MmaShape, d: usize) -> usize {
    let (hb, st) = (16 * shape.mg, shape.stages);
    st * MMA_TILE * (d + 8) * 2 + 4 * hb * (MMA_TILE + 1) * 4 + hb * (MMA_TILE + 8) * 2 + st * MMA_TILE * 4 + 3 * hb * 4
}

/// The warpgroup kernel's entry point.
const WG_ENTRY: &str = "hf_sparse_attn_wg64_d512_bf16";
/// The warpgroup kernel's `head_dim`.
pub const WG_HEAD_DIM: usize = 512;
/// Heads per warpgroup-kernel block (`HF_WG_HEADS`).
const WG_HEADS: usize = 64;
/// Row splits the warpgroup kernel supports ([`SparseAttention::with_warpgroup_split`]; at most
/// `HF_WG_MAX_SPLIT`, and each divides its 64 heads).
pub const WG_SPLITS: [usize; 4] = [1, 2, 4, 8];
/// The row split the warpgroup kernel starts with (where the device runs clusters of that many
/// of its blocks; see [`SparseAttention::with_warpgroup_split`]). On the H100 (head_dim 512,
/// SWA 128 + 512 or + 8192 entries per row, 64 or 128 heads), 2 took one half to two thirds of
/// the time of 1 at batch 1 and 8, and from batch 64 between 43% less and 22% more; 4 and 8 were
/// faster still at batch 1 and 8 but up to 2.8× slower from batch 64.
pub const WG_DEFAULT_SPLIT: usize = 2;
/// Entries per warpgroup-kernel tile (`HF_WG_NT`).
const WG_TILE: usize = 64;
/// Dynamic shared memory of a warpgroup-kernel block, bytes: up to 1024 of padding (the layout
/// starts 1024-aligned for the K tiles' swizzle), Q (`64 × 512` bf16, the third K buffer once
/// read), two K tiles (`64 × 512` bf16 each), two P tiles (`64 × 64` bf16 each), the three K
/// buffers' validity flags (`3 × 64` f32), the per-head exchange (`2 × 64` f32) and four 8-byte
/// mbarriers: 215 328 bytes.
const WG_SHARED_BYTES: usize = 1024
    + WG_HEADS * WG_HEAD_DIM * 2
    + 2 * WG_TILE * WG_HEAD_DIM * 2
    + 2 * WG_HEADS * WG_TILE * 2
    + 3 * WG_TILE * 4
    + 2 * WG_HEADS * 4
    + 4 * 8;

/// The kernel source (`hf_kv_insert_bf16`, `hf_sparse_attn_bf16`, the tensor-core
/// `hf_sparse_attn_mma{16,32,32s3}_d{64,128,256,512}_bf16` and the warpgroup
/// `hf_sparse_attn_wg64_d512_bf16`).
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
                attend_entry("hf_sparse_attn_bf16"),
            ]
            .into_iter()
            .chain(MMA_DIMS.iter().flat_map(|&d| MMA_SHAPES.map(|shape| attend_entry(mma_entry(shape, d)))))
            .chain(std::iter::once(attend_entry(WG_ENTRY)))
            .collect(),
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

/// Which attention kernel a [`SparseAttention`] launches on a GPU (the CPU backend always runs the
/// reference).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum AttentionKernel {
    /// The fastest kernel measured for the device and shape: the warpgroup kernel where the
    /// device has warpgroup MMA, `head_dim` is 512 and there are at least 64 heads (on the H100 it
    /// took less time than the tensor-core kernel at every batch from 1 to 256, at 64 and 128
    /// heads), else the tensor-core kernel where the device and `head_dim` allow it, else the
    /// portable one. The choice follows the device and the construction sizes only.
    #[default]
    Auto,
    /// The tensor-core (`mma.sync`) kernel; construction fails where the device or `head_dim`
    /// does not allow it.
    TensorCore,
    /// Always the portable CUDA-core kernel (for comparisons and for devices without tensor cores).
    Portable,
    /// The warpgroup-MMA kernel (`wgmma`, [`DeviceInfo::has_wgmma`]: H100 / H200) at `head_dim`
    /// 512: 64 heads per block, Q in shared memory, tiles of 64 entries, each row split over a
    /// cluster of [`WG_DEFAULT_SPLIT`] blocks (where the device runs such clusters; else 1);
    /// construction fails on other devices and head sizes.
    ///
    /// [`DeviceInfo::has_wgmma`]: holdfast_hal::DeviceInfo::has_wgmma
    Warpgroup,
}

/// KV insert and ragged sparse attention for a fixed `heads × head_dim`, compiled for one device.
#[derive(Clone, Debug)]
pub struct SparseAttention {
    heads: usize,
    head_dim: usize,
    warp: u32,
    compute_units: usize,
    insert: Kernel,
    attend: Kernel,
    /// Tensor-core entries of [`MMA16`], [`MMA32`] and [`MMA32_DEEP`], when selected.
    mma: Option<[Kernel; 3]>,
    /// The warpgroup entry, when selected ([`AttentionKernel::Warpgroup`]).
    wg: Option<Kernel>,
    /// Blocks (one cluster) sharing each row of the warpgroup kernel ([`WG_SPLITS`]); 1 without it
    /// (only [`SparseAttention::with_warpgroup_split`] changes it, and only with `wg`).
    wg_split: usize,
}

/// True when `dev` runs the tensor-core kernel at `head_dim`: CUDA sm_80 or newer, `head_dim` one
/// of [`TENSOR_CORE_HEAD_DIMS`], and room for every entry's shared memory.
fn tensor_cores_fit(dev: &Device, head_dim: usize) -> bool {
    let info = dev.info();
    holdfast_kernels::has_bf16_tensor_cores(info)
        && MMA_DIMS.contains(&head_dim)
        && MMA_SHAPES.iter().all(|&shape| mma_shared_bytes(shape, head_dim) <= info.max_shared_mem_per_block as usize)
}

impl SparseAttention {
    /// Compiles the kernels for `heads` query heads of `head_dim` (a multiple of the warp width,
    /// at most [`MAX_CHUNKS_PER_LANE`] × warp width), with the tensor-core kernel where the device
    /// allows it. Unsupported shapes are errors here.
    pub fn new(dev: &Device, heads: usize, head_dim: usize) -> Result<Self> {
        Self::with_kernel(dev, heads, head_dim, AttentionKernel::Auto)
    }

    /// As [`SparseAttention::new`], choosing the attention kernel.
    ///
    /// `heads` must lie in `[1, MAX_HEADS]` (4096: the launch grids and the row sizes stay far
    /// from their 32-bit limits).
    pub fn with_kernel(dev: &Device, heads: usize, head_dim: usize, kernel: AttentionKernel) -> Result<Self> {
        const OP: &str = "SparseAttention::new";
        let warp = dev.info().warp_size.max(32);
        if heads == 0 || heads > MAX_HEADS {
            return Err(shape(OP, format!("heads must lie in [1, {MAX_HEADS}], got {heads}")));
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
        let info = dev.info();
        let wg_fits =
            info.has_wgmma() && head_dim == WG_HEAD_DIM && WG_SHARED_BYTES <= info.max_shared_mem_per_block as usize;
        let wg_auto = kernel == AttentionKernel::Auto && wg_fits && heads >= WG_HEADS;
        if kernel == AttentionKernel::TensorCore && !tensor_cores_fit(dev, head_dim) {
            return Err(shape(
                OP,
                format!(
                    "the tensor-core kernel needs bf16 mma.sync (NVIDIA sm_80+) and head_dim one of \
                     {TENSOR_CORE_HEAD_DIMS:?}; this is {} ({}) at head_dim {head_dim}",
                    info.name, info.arch
                ),
            ));
        }
        let wg = if kernel == AttentionKernel::Warpgroup || wg_auto {
            if !wg_fits {
                return Err(shape(
                    OP,
                    format!(
                        "the warpgroup kernel needs warpgroup MMA (sm_90a), head_dim {WG_HEAD_DIM} and {WG_SHARED_BYTES} \
                         bytes of shared memory per block; this is {} ({}) at head_dim {head_dim} with {} bytes",
                        info.name, info.arch, info.max_shared_mem_per_block
                    ),
                ));
            }
            Some(m.kernel(WG_ENTRY)?)
        } else {
            None
        };
        let mma = if wg.is_none()
            && matches!(kernel, AttentionKernel::Auto | AttentionKernel::TensorCore)
            && tensor_cores_fit(dev, head_dim)
        {
            Some([
                m.kernel(mma_entry(MMA16, head_dim))?,
                m.kernel(mma_entry(MMA32, head_dim))?,
                m.kernel(mma_entry(MMA32_DEEP, head_dim))?,
            ])
        } else {
            None
        };
        let k = SparseAttention {
            heads,
            head_dim,
            warp,
            compute_units: dev.info().compute_units.max(1) as usize,
            insert: m.kernel("hf_kv_insert_bf16")?,
            attend: m.kernel("hf_sparse_attn_bf16")?,
            mma,
            wg,
            wg_split: 1,
        };
        // The warpgroup kernel starts at the default split where the device runs its clusters,
        // else at none (a fixed choice per device, never per batch).
        if k.wg.is_some() {
            if let Ok(split) = k.clone().with_warpgroup_split(dev, WG_DEFAULT_SPLIT) {
                return Ok(split);
            }
        }
        Ok(k)
    }

    /// The warpgroup kernel with each (row, group of 64 heads) shared by a cluster of `split`
    /// blocks (one of [`WG_SPLITS`]): block `r` takes the row's 64-entry tiles `r, r + split, ..`
    /// and the cluster adds the blocks' partial results in block order through distributed shared
    /// memory. The split is fixed per instance, never chosen by batch, so a row's bits depend on
    /// its own inputs and `split` only. Errors: not the warpgroup kernel, a split outside
    /// [`WG_SPLITS`], or a cluster of `split` such blocks `dev` (the device this was built for)
    /// cannot run.
    pub fn with_warpgroup_split(mut self, dev: &Device, split: usize) -> Result<Self> {
        const OP: &str = "SparseAttention::with_warpgroup_split";
        let Some(k) = &self.wg else {
            let running = if self.mma.is_some() { "the tensor-core kernel" } else { "the portable kernel" };
            return Err(shape(
                OP,
                format!(
                    "a row split needs the warpgroup kernel (warpgroup MMA, NVIDIA sm_90a, head_dim {WG_HEAD_DIM}; \
                     AttentionKernel::Auto picks it from {WG_HEADS} heads); this instance runs {running} \
                     ({} heads of {})",
                    self.heads, self.head_dim
                ),
            ));
        };
        if !WG_SPLITS.contains(&split) {
            return Err(shape(OP, format!("a split of {split} blocks per row; supported: {WG_SPLITS:?}")));
        }
        if split > 1 {
            let (_, cfg) = self.attend_launch(1);
            let fits = dev.max_active_clusters(k, cfg, split as u32)?;
            if fits == 0 {
                return Err(shape(
                    OP,
                    format!(
                        "the device cannot run a cluster of {split} blocks of {WG_SHARED_BYTES} bytes of shared memory"
                    ),
                ));
            }
        }
        self.wg_split = split;
        Ok(self)
    }

    /// The row split for an instance that serves batches of up to `max_rows` rows and favours
    /// throughput: 1 where `max_rows` rows of one block per 64-head group would fill at least
    /// three quarters of the device's multiprocessors (no cluster combine, no per-block fixed
    /// cost paid twice), else the current split; the current split for the other kernels. It
    /// depends on the construction sizes and `max_rows` only, never on a batch: the caller fixes
    /// it per instance ([`SparseAttention::with_warpgroup_split`]).
    ///
    /// Measured on an H100 (132 multiprocessors, head_dim 512, SWA 128 + 512, 1024 or 8192
    /// entries per row): split 1 took 0.81–0.95× the time of split 2 at 128 heads from batch 64
    /// (128 and more blocks) and at 64 heads at batch 256, 1.2× at 64 heads and batch 64 (64
    /// blocks), and 1.45–1.6× at batch 1.
    pub fn throughput_split(&self, max_rows: usize) -> usize {
        if self.wg.is_none() {
            return self.wg_split;
        }
        let blocks = max_rows.saturating_mul(self.heads.div_ceil(WG_HEADS));
        if blocks.saturating_mul(4) >= self.compute_units.saturating_mul(3) {
            1
        } else {
            self.wg_split
        }
    }

    /// Blocks sharing each row of the warpgroup kernel (1 for the other kernels).
    pub fn warpgroup_split(&self) -> usize {
        self.wg_split
    }

    /// True when [`SparseAttention::attend`] runs the warpgroup kernel (whose rows
    /// [`SparseAttention::with_warpgroup_split`] spreads).
    pub fn uses_warpgroup(&self) -> bool {
        self.wg.is_some()
    }

    /// Which kernel [`SparseAttention::attend`] runs, in words: `warpgroup MMA, rows split in N`,
    /// `tensor cores (mma.sync)` or `portable`.
    pub fn kernel_description(&self) -> String {
        if self.wg.is_some() {
            format!("warpgroup MMA, rows split in {}", self.wg_split)
        } else if self.mma.is_some() {
            "tensor cores (mma.sync)".to_owned()
        } else {
            "portable".to_owned()
        }
    }

    /// True when [`SparseAttention::attend`] runs a tensor-core kernel (`mma.sync` or warpgroup).
    pub fn uses_tensor_cores(&self) -> bool {
        self.mma.is_some() || self.wg.is_some()
    }

    /// The kernel and launch shape `attend` uses for `rows` rows: it depends on `rows` and the
    /// construction sizes only.
    fn attend_launch(&self, rows: usize) -> (&Kernel, LaunchConfig) {
        let (h, d) = (self.heads, self.head_dim);
        let rows = rows.max(1);
        if let Some(k) = &self.wg {
            let blocks = rows * h.div_ceil(WG_HEADS) * self.wg_split;
            let cfg = LaunchConfig {
                grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
                block: (256, 1, 1),
                shared_mem_bytes: WG_SHARED_BYTES as u32,
            };
            return (k, cfg);
        }
        match &self.mma {
            Some([k16, k32, k32_deep]) => {
                let shape = mma_shape(rows, h, self.compute_units);
                let kernel = match shape {
                    MMA16 => k16,
                    MMA32 => k32,
                    _ => k32_deep,
                };
                let blocks = rows * h.div_ceil(16 * shape.mg);
                let cfg = LaunchConfig {
                    grid: (u32::try_from(blocks).unwrap_or(u32::MAX), 1, 1),
                    block: (128 * shape.mg as u32, 1, 1),
                    shared_mem_bytes: mma_shared_bytes(shape, d) as u32,
                };
                (kernel, cfg)
            }
            None => {
                let cfg = LaunchConfig {
                    grid: (rows.min(i32::MAX as usize) as u32, (h as u32).div_ceil(HEADS_PER_BLOCK), 1),
                    block: (4 * self.warp, 1, 1),
                    shared_mem_bytes: (d * 4) as u32,
                };
                (&self.attend, cfg)
            }
        }
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
        s.launch_dependent(&self.insert, cfg, &args)?;
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
        if self.uses_tensor_cores() {
            // cp.async moves 16-byte rows pieces and q is read as bf16 pairs.
            for (name, off) in [("main cache", main.cache.offset()), ("extra cache", ex.cache.offset())] {
                if !off.is_multiple_of(8) {
                    return Err(shape(OP, format!("the {name} view starts at element {off}, not a multiple of 8")));
                }
            }
            if !q.offset().is_multiple_of(2) || !out.offset().is_multiple_of(2) {
                return Err(shape(OP, "q and out views must start at an even element".into()));
            }
            if self.wg.is_some() && !(q.offset().is_multiple_of(8) && out.offset().is_multiple_of(8)) {
                return Err(shape(
                    OP,
                    format!(
                        "the warpgroup kernel reads q and writes out in 16-byte pieces: q starts at element {}, \
                         out at {}",
                        q.offset(),
                        out.offset()
                    ),
                ));
            }
        }
        let (kernel, cfg) = self.attend_launch(rows);
        let split = self.warpgroup_split();
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
        if split > 1 {
            s.launch_cluster_dependent(kernel, cfg, split as u32, &args)?;
        } else {
            s.launch_dependent(kernel, cfg, &args)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensor_core_shape_follows_the_rows_and_heads_only() {
        // 64 heads on 132 multiprocessors: three stages up to 66 rows (132 blocks of 32 heads).
        assert_eq!(mma_shape(1, 64, 132), MMA32_DEEP);
        assert_eq!(mma_shape(66, 64, 132), MMA32_DEEP);
        assert_eq!(mma_shape(67, 64, 132), MMA32);
        assert_eq!(mma_shape(256, 64, 132), MMA32);
        // 0 rows launch as 1.
        assert_eq!(mma_shape(0, 64, 132), MMA32_DEEP);
        // Up to 16 heads: 16 per block until 32-head blocks fill the device.
        assert_eq!(mma_shape(1, 16, 132), MMA16);
        assert_eq!(mma_shape(131, 16, 132), MMA16);
        assert_eq!(mma_shape(132, 16, 132), MMA32);
        assert_eq!(mma_shape(1, 17, 132), MMA32_DEEP);
        // Every shape fits the H200's 227 KiB of shared memory at every head_dim.
        for d in MMA_DIMS {
            for shape in MMA_SHAPES {
                assert!(mma_shared_bytes(shape, d) <= 227 * 1024, "{shape:?} at {d}");
            }
        }
        // The three stages hold one more K tile than two.
        assert_eq!(
            mma_shared_bytes(MMA32_DEEP, 512) - mma_shared_bytes(MMA32, 512),
            MMA_TILE * (512 + 8) * 2 + MMA_TILE * 4
        );
    }
}
