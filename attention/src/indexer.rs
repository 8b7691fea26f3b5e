//! The DeepSeek-V4 c4a indexer (spec §5.6): per token, a logit for every visible compressed
//! entry of its request, then the exact top-k of them.
//!
//! Per real token `t` at position `pos`, `n_t = min((pos + 1) / 4, max_compressed)` compressed
//! entries exist. Their logits are
//! `logit[c] = Σ_h w[t, h] · relu(scale · q[t, h, :] · k[slot(c), :])` for `c < n_t`, with `k`
//! read from the indexer's own ratio-4 [`crate::Compressor`] cache through the main block table
//! (`slot(c) = block_table_kv[table_rows[req]][c / cbs]·cbs + c % cbs`, `cbs = kv_block_size / 4`). The
//! output row is the `topk` entries ordered by logit descending, then index ascending (ties go to
//! the lower index), `-1` after; padding tokens and tokens with `n_t = 0` get a row of `-1`.
//! These are *local* compressed positions; [`crate::C4aBuilder`] maps them to global slots.
//!
//! Two launches on the step's stream, no host sync, launch shapes from the layout's padded token
//! count and the construction sizes only:
//! 1. **logits** into a persistent workspace `[max_num_batched_tokens, max_compressed]` f32
//!    (`max_compressed = ceil(max_model_len / 4)`): one block per token (grid-y blocks split its
//!    entries), one warp per entry, `q` and `w` of the token staged in shared memory. Each
//!    entry's sum over heads runs in head order; the dot product is a warp reduction on the GPU
//!    and a sequential sum on the CPU, so the two agree to rounding, and each with itself bit for
//!    bit.
//! 2. **top-k** by an exact radix select, one block of [`TOPK_THREADS`] (1024) threads per token
//!    ([`topk_launch_config`]). Entry `c` becomes the unique 64-bit item
//!    `key(logit[c]) << 32 | !c`, where `key` is a total-order key of the logit (`−0` equals
//!    `+0`, a NaN ranks below every number); items in descending order are the output order.
//!    Up to six digit levels (11 bits each from the top of the item, fewer at the bottom) each
//!    build a shared-memory histogram of the items that match the prefix found so far and narrow
//!    the prefix to the bin holding the k-th largest item (a search over items in shared memory
//!    starts below the bits they all share); the search stops at the first level where every
//!    item on the prefix is taken (the last level's prefix is one whole item), so ties at the cut
//!    go to the lower index by construction. The levels run over the items in shared memory
//!    ([`TOPK_SHARED_CANDIDATES`]) when they hold the row's top k: the whole row when it fits,
//!    else the items at or above a threshold `tau` gathered in one pass over the row, where `tau`
//!    is a high logit of a fixed sample of the row ([`TOPK_SAMPLES`] entries at
//!    `c = floor(j · n_t / TOPK_SAMPLES)`; about `1.5 k + 16 n_t / TOPK_SAMPLES` entries pass it),
//!    and the pass found at least `k` and at most the capacity. Otherwise (a sample that
//!    misrepresents the row, or more ties at `tau` than fit) the first levels read the row from
//!    the workspace until the prefix's group fits, and one more pass over the row moves the
//!    items above the prefix into the selection and the group into shared memory. The sample
//!    only decides which way a row is searched: every path selects the same exact items. The
//!    `min(n_t, k)` selected items (all of them when `n_t ≤ k`, with no search) are put in order
//!    and written, `-1` after: each goes to the first position of its bin of the 11 bits below the
//!    prefix they all share (bins in descending order) plus its rank among that bin's items;
//!    where a bin holds more than 64 items, a merge sort (each warp's by a bitonic network over
//!    shuffles, then runs merged pairwise by rank) orders them instead. Histogram counts are
//!    order-independent and items are unique, so the output depends only on the row's values,
//!    not on thread timing. Static shared memory: a 2048-bin histogram (8 KiB), the selection
//!    ([`TOPK_MAX`] = 1024 items, 8 KiB) and the candidates (3584 items, 28 KiB), 45 KiB in all;
//!    no workspace beyond the logits. A typical row costs one read from the workspace and the
//!    sample; a row that falls back, two to seven reads. The CPU reference sorts, which gives
//!    the identical order.
//!
//!    Optionally ([`Indexer::with_topk_segments`]; for few tokens, so that more blocks share the
//!    work) each token's row is cut into up to [`TOPK_MAX_SEGMENTS`] contiguous segments, the
//!    same kernel selects each segment's own top-k into a small persistent list, and a merge
//!    kernel places every listed entry at its rank in the union (its place in its own list plus
//!    a binary search in each other list). The global top-k lies inside the union and items are
//!    unique, so the result is the same exact top-k whatever the segment count: the count may
//!    follow the padded row count without changing a bit.
//!
//! A compressed slot outside the cache cannot occur for a staged step (the block ids a token can
//! reach are validated by [`CommonAttentionMetadata::stage`]); the GPU kernel would score such an
//! entry 0, the CPU reference reports it as a kernel failure.
//!
//! Batch invariance: a token's row depends only on its own `q`, `w`, position, request and the
//! cache. The workspace is `max_num_batched_tokens · max_compressed · 4` bytes (8 GiB for 8192
//! tokens at a 1M context), sized once at construction.

use std::collections::HashMap;
use std::sync::OnceLock;

use holdfast_hal::{
    bf16, Buffer, CpuLaunch, Device, Kernel, KernelEntry, KernelSource, LaunchConfig, Param, ScalarKind, Stream, View,
};
use rayon::prelude::*;

use crate::common::{counting_syncs, BlockTableConfig, BuildStats, CommonAttentionMetadata, CommonConfig, TableKind};
use crate::error::{AttentionError, Result};

/// Tokens per indexer compressed entry (the c4a ratio).
const RATIO: usize = 4;

const CODE: &str = r#"
#define HF_IDX_WARPS 4

// Compressed entries token t sees: min((pos + 1) / 4, width); 0 for padding / slot -1 tokens.
__device__ __forceinline__ int32_t hf_idx_visible(const int32_t* positions, const int32_t* slots,
                                                  const int32_t* tok_req, uint32_t t, uint32_t width) {
    if (slots[t] < 0 || tok_req[t] < 0) return 0;
    uint32_t c = ((uint32_t)positions[t] + 1u) / 4u;
    return (int32_t)(c < width ? c : width);
}

// scores[t, c] = sum_h w[t, h] * relu(scale * q[t, h, :] . k[slot(c), :]) for c < n_t.
// Blocks of HF_IDX_WARPS warps; dynamic shared memory (heads * dim + heads + HF_IDX_WARPS * dim) floats.
HF_KERNEL void hf_dsv4_indexer_logits(const hf_bf16* q, const float* w, const hf_bf16* k_cache,
                                      const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                                      const int32_t* table_rows, const int32_t* block_table, float* scores,
                                      uint32_t n, uint32_t heads,
                                      uint32_t dim, uint32_t width, uint32_t cbs, uint32_t bt_width,
                                      uint32_t cache_rows, float scale) {
    hf_dependent_kernel_start();
    extern __shared__ float sm[];
    float* qs = sm;
    float* wsh = sm + heads * dim;
    const uint32_t warp = threadIdx.x / HF_WARP_SIZE, lane = threadIdx.x % HF_WARP_SIZE;
    // This warp's K row; every lane reads back only the channels it wrote, so no sync is needed.
    float* ks = wsh + heads + warp * dim;
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        const int32_t cn = hf_idx_visible(positions, slots, tok_req, t, width);
        if (cn == 0) continue;
        const int32_t* row = block_table + (uint64_t)table_rows[tok_req[t]] * bt_width;
        __syncthreads();  // the previous token's readers of qs / wsh are done
        for (uint32_t i = threadIdx.x; i < heads * dim; i += blockDim.x)
            qs[i] = hf_bf16_to_f32(q[(uint64_t)t * heads * dim + i]);
        for (uint32_t h = threadIdx.x; h < heads; h += blockDim.x) wsh[h] = w[(uint64_t)t * heads + h];
        __syncthreads();
        for (int32_t c = (int32_t)(blockIdx.y * HF_IDX_WARPS + warp); c < cn; c += (int32_t)(gridDim.y * HF_IDX_WARPS)) {
            const int64_t slot = (int64_t)row[(uint32_t)c / cbs] * cbs + (uint32_t)c % cbs;
            float acc = 0.0f;
            if (slot >= 0 && slot < (int64_t)cache_rows) {
                for (uint32_t d = lane; d < dim; d += HF_WARP_SIZE) ks[d] = hf_bf16_to_f32(k_cache[(uint64_t)slot * dim + d]);
                for (uint32_t h = 0; h < heads; ++h) {
                    const float* qh = qs + h * dim;
                    float part = 0.0f;
                    for (uint32_t d = lane; d < dim; d += HF_WARP_SIZE) part += qh[d] * ks[d];
                    acc += wsh[h] * fmaxf(scale * hf_warp_sum(part), 0.0f);
                }
            }
            if (lane == 0) scores[(uint64_t)t * width + c] = acc;
        }
    }
}

// Order-preserving key of a logit: -0 equals +0, every NaN is 0 (below -inf).
__device__ __forceinline__ uint32_t hf_topk_key(float x) {
    x = x + 0.0f;
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// ---- top-k: exact radix select on a unique 64-bit item ------------------------------------------
// item(c) = key(logit[c]) << 32 | ~c: distinct for distinct c, and item order descending is the
// output order (logit descending, index ascending). The top k items are found digit by digit from
// the top (11 bits at a time, fewer at the bottom), each digit's histogram narrowing to the bin
// that holds the k-th largest item.
#define HF_TOPK_THREADS 1024
#define HF_TOPK_WARPS (HF_TOPK_THREADS / HF_WARP_SIZE)
#define HF_TOPK_BINS 2048
#define HF_TOPK_LEVELS 6
#define HF_TOPK_MAXK 1024
#define HF_TOPK_CAP 3584
#define HF_TOPK_BUCKET_MAX 64

static_assert(HF_TOPK_BINS == 2 * HF_TOPK_THREADS, "hf_topk_find: each thread owns two bins");
static_assert(HF_TOPK_MAXK == HF_TOPK_THREADS, "the final sort holds one selected item per thread");
static_assert(HF_TOPK_WARPS <= HF_WARP_SIZE, "hf_topk_above: one warp scans the per-warp sums");

struct alignas(16) hf_idx_f4 { float v[4]; };

__device__ __forceinline__ uint64_t hf_topk_item(float x, uint32_t c) {
    return ((uint64_t)hf_topk_key(x) << 32) | (uint64_t)(~c);
}

// hf_topk_item(x, c) for a number x (not a NaN), without branches.
__device__ __forceinline__ uint64_t hf_topk_number_item(float x, uint32_t c) {
    const uint32_t u = __float_as_uint(x + 0.0f);
    const uint32_t key = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
    return ((uint64_t)key << 32) | (uint64_t)(~c);
}

// Sum of v over the lanes >= this lane of the warp.
__device__ __forceinline__ uint32_t hf_topk_suffix_sum(uint32_t v) {
    const int lane = (int)(threadIdx.x % HF_WARP_SIZE);
    for (int d = 1; d < HF_WARP_SIZE; d <<= 1) {
        const uint32_t y = hf_shfl(v, lane + d < HF_WARP_SIZE ? lane + d : lane);
        if (lane + d < HF_WARP_SIZE) v += y;
    }
    return v;
}

// Calls f(item(base0 + c)) once for every c < cn (row points at entry `base0`), c owned by this
// thread (which thread owns which c is irrelevant to the result). The aligned body is read as
// 16-byte vectors, four per thread in flight.
template <typename F>
__device__ __forceinline__ void hf_topk_each_row(const float* row, uint32_t cn, uint32_t base0, F& f) {
    const uint32_t tid = threadIdx.x;
    uint32_t head = (4u - (uint32_t)((reinterpret_cast<uint64_t>(row) >> 2) & 3u)) & 3u;
    if (head > cn) head = cn;
    if (tid < head) f(hf_topk_item(row[tid], base0 + tid));
    const uint32_t nv = (cn - head) / 4u;
    const hf_idx_f4* body = reinterpret_cast<const hf_idx_f4*>(row + head);
    for (uint32_t base = 0; base < nv; base += 4u * HF_TOPK_THREADS) {
        hf_idx_f4 v[4];
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) {
            const uint32_t j = base + u * HF_TOPK_THREADS + tid;
            if (j < nv) v[u] = body[j];
        }
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) {
            const uint32_t j = base + u * HF_TOPK_THREADS + tid;
            if (j < nv) {
#pragma unroll
                for (uint32_t e = 0; e < 4u; ++e) f(hf_topk_item(v[u].v[e], base0 + head + 4u * j + e));
            }
        }
    }
    for (uint32_t c = head + 4u * nv + tid; c < cn; c += HF_TOPK_THREADS) f(hf_topk_item(row[c], base0 + c));
}

// Appends item(base0 + c) for every c < cn with row[c] >= tau to cand (in no particular order;
// *count counts them, the writes stop at HF_TOPK_CAP), and folds them into this thread's all
// (AND) and any (OR). The aligned body is read as 16-byte vectors, four per thread in flight (the
// next four loading while these are written), and a thread claims the slots of a round's passes
// with one atomic (the passes are few and scattered: one atomic per pass would serialise on the
// counter).
__device__ __forceinline__ void hf_topk_gather(const float* row, uint32_t cn, uint32_t base0, float tau,
                                               uint64_t* cand, uint32_t* count, uint64_t& all, uint64_t& any) {
    const uint32_t tid = threadIdx.x;
    auto keep = [&](uint32_t at, uint64_t it) {
        if (at < HF_TOPK_CAP) cand[at] = it;
        all &= it;
        any |= it;
    };
    auto one = [&](float x, uint32_t c) {
        if (x >= tau) keep(atomicAdd(count, 1u), hf_topk_item(x, c));
    };
    uint32_t head = (4u - (uint32_t)((reinterpret_cast<uint64_t>(row) >> 2) & 3u)) & 3u;
    if (head > cn) head = cn;
    if (tid < head) one(row[tid], base0 + tid);
    const uint32_t nv = (cn - head) / 4u;
    const hf_idx_f4* body = reinterpret_cast<const hf_idx_f4*>(row + head);
    hf_idx_f4 next[4] = {};  // a vector past the row keeps an earlier value and is never counted
#pragma unroll
    for (uint32_t u = 0; u < 4u; ++u) {
        const uint32_t j = u * HF_TOPK_THREADS + tid;
        if (j < nv) next[u] = body[j];
    }
    for (uint32_t base = 0; base < nv; base += 4u * HF_TOPK_THREADS) {
        hf_idx_f4 v[4];
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) {
            v[u] = next[u];
            const uint32_t j = base + (4u + u) * HF_TOPK_THREADS + tid;
            if (j < nv) next[u] = body[j];
        }
        // Bit 4 u + e of pass: entry e of vector u passes.
        uint32_t pass = 0u;
#pragma unroll
        for (uint32_t u = 0; u < 4u; ++u) {
            const bool in = base + u * HF_TOPK_THREADS + tid < nv;
#pragma unroll
            for (uint32_t e = 0; e < 4u; ++e) pass |= in && v[u].v[e] >= tau ? 1u << (4u * u + e) : 0u;
        }
        if (pass == 0u) continue;
        uint32_t at = atomicAdd(count, (uint32_t)__popc(pass));
        // Only the passing entries (about 2%): each picked from the registers by the bits of its
        // number, which costs less than visiting all 16 when some lane of the warp passes.
        while (pass != 0u) {
            const uint32_t i = (uint32_t)__ffs(pass) - 1u;
            pass &= pass - 1u;
            float q[8];
#pragma unroll
            for (uint32_t r = 0; r < 8u; ++r) q[r] = (i & 1u) ? v[r / 2u].v[2u * (r % 2u) + 1u] : v[r / 2u].v[2u * (r % 2u)];
#pragma unroll
            for (uint32_t r = 0; r < 4u; ++r) q[r] = (i & 2u) ? q[2u * r + 1u] : q[2u * r];
#pragma unroll
            for (uint32_t r = 0; r < 2u; ++r) q[r] = (i & 4u) ? q[2u * r + 1u] : q[2u * r];
            const float x = (i & 8u) ? q[1] : q[0];
            keep(at++, hf_topk_number_item(x, base0 + head + 4u * (base + (i / 4u) * HF_TOPK_THREADS + tid) + i % 4u));
        }
    }
    for (uint32_t c = head + 4u * nv + tid; c < cn; c += HF_TOPK_THREADS) one(row[c], base0 + c);
}

// dst[c] = item(base0 + c) for every c < cn, folded into this thread's all (AND) and any (OR).
__device__ __forceinline__ void hf_topk_load_row(const float* row, uint32_t cn, uint32_t base0, uint64_t* dst,
                                                 uint64_t& all, uint64_t& any) {
    for (uint32_t c = threadIdx.x; c < cn; c += HF_TOPK_THREADS) {
        const uint64_t it = hf_topk_item(row[c], base0 + c);
        dst[c] = it;
        all &= it;
        any |= it;
    }
}

// Folds this warp's all (AND) and any (OR) into span[0] and span[1] (shared atomics, one per warp;
// span starts at ~0 and 0). Every lane of the warp calls it; the caller's next barrier makes the
// block's AND and OR visible.
__device__ __forceinline__ void hf_topk_fold_span(uint64_t all, uint64_t any, unsigned long long* span) {
    for (int d = HF_WARP_SIZE / 2; d > 0; d >>= 1) {
        all &= ((uint64_t)hf_shfl_xor((uint32_t)(all >> 32), d) << 32) | hf_shfl_xor((uint32_t)all, d);
        any |= ((uint64_t)hf_shfl_xor((uint32_t)(any >> 32), d) << 32) | hf_shfl_xor((uint32_t)any, d);
    }
    if (threadIdx.x % HF_WARP_SIZE == 0) {
        atomicAnd(&span[0], (unsigned long long)all);
        atomicOr(&span[1], (unsigned long long)any);
    }
}

// The digit position below the bits that every item shares, from their AND and OR: 64 minus the
// shared leading bits (at least 1).
__device__ __forceinline__ uint32_t hf_topk_span_top(uint64_t all, uint64_t any) {
    const uint64_t differ = all ^ any;
    return differ ? 64u - (uint32_t)__clzll((long long)differ) : 1u;
}

// Block-wide: the sum of own over the threads above this one (thread i owns bins 2i and 2i + 1,
// so this counts the items in bins > 2i + 1). One barrier, after wsum is written.
__device__ __forceinline__ uint32_t hf_topk_above(uint32_t own, uint32_t* wsum) {
    const uint32_t lane = threadIdx.x % HF_WARP_SIZE, warp = threadIdx.x / HF_WARP_SIZE;
    const uint32_t s = hf_topk_suffix_sum(own);  // over lanes >= lane of this warp
    if (lane == 0) wsum[warp] = s;
    __syncthreads();
    // Items in the warps above this one: every warp scans the per-warp sums itself.
    const uint32_t ws = hf_topk_suffix_sum(lane < HF_TOPK_WARPS ? wsum[lane] : 0u);
    const uint32_t next = hf_shfl(ws, (int)(warp + 1u < HF_WARP_SIZE ? warp + 1u : warp));
    return s - own + (warp + 1u < HF_TOPK_WARPS ? next : 0u);
}

// Block-wide: the bin b holding the need-th largest counted item (need >= 1, at most the total of
// hist) and the count gt of items in bins above it: res = {b, gt, hist[b]}. Thread i owns bins
// 2i and 2i + 1; exactly one thread finds b inside its pair. Starts reading hist without a
// barrier (the caller syncs after the histogram), ends with a barrier after res is written.
__device__ __forceinline__ void hf_topk_find(const uint32_t* hist, uint32_t need, uint32_t* wsum, uint32_t* res) {
    const uint32_t tid = threadIdx.x;
    const uint32_t lo = hist[2u * tid], hi = hist[2u * tid + 1u], own = lo + hi;
    const uint32_t above = hf_topk_above(own, wsum);
    if (above < need && need <= above + own) {
        const bool upper = above + hi >= need;
        res[0] = upper ? 2u * tid + 1u : 2u * tid;
        res[1] = upper ? above : above + hi;
        res[2] = upper ? hi : lo;
    }
    __syncthreads();
}

// Block-wide: a logit threshold tau such that probably between k and HF_TOPK_CAP of the row's cn
// entries (cn > HF_TOPK_CAP) are >= tau, or NaN when the sample gives none. The sample is the
// HF_TOPK_SAMPLES entries at c = floor(j cn / HF_TOPK_SAMPLES), two per thread; tau is its r-th
// largest logit (by key) with r = rs + rs / 2 + 16, rs = ceil(k HF_TOPK_SAMPLES / cn), to 22
// bits: the lower edge of the 22-bit key bin (two digit levels) that holds it, so at least r
// samples pass. A row typically holds about 1.5 k + 16 cn / HF_TOPK_SAMPLES entries >= tau;
// the caller checks the count it finds, so tau only decides how fast a row is searched, never
// what is selected. For keys, tau is exact: a number x has key(x) >= key(tau) exactly when
// x >= tau (-0 equals +0 in both), and a NaN never passes. Clears hist before its first
// barrier; ends with a barrier.
#define HF_TOPK_SAMPLES (2 * HF_TOPK_THREADS)
__device__ __forceinline__ float hf_topk_threshold(const float* row, uint32_t cn, uint32_t k, uint32_t* hist,
                                                   uint32_t* wsum, uint32_t* res) {
    const uint32_t tid = threadIdx.x;
    uint32_t key[2];
#pragma unroll
    for (uint32_t u = 0; u < 2u; ++u) {
        const uint64_t j = 2u * tid + u;
        key[u] = hf_topk_key(row[(uint32_t)(j * cn / HF_TOPK_SAMPLES)]);
    }
    const uint32_t rs = (uint32_t)(((uint64_t)k * HF_TOPK_SAMPLES + cn - 1u) / cn);
    uint32_t need = rs + rs / 2u + 16u;
    if (need > HF_TOPK_SAMPLES) need = HF_TOPK_SAMPLES;
    uint32_t pval = 0u, pmask = 0u;
    for (uint32_t l = 0; l < 2u; ++l) {
        const uint32_t shift = l == 0u ? 21u : 10u, mask = 2047u;
        for (uint32_t i = tid; i < HF_TOPK_BINS; i += HF_TOPK_THREADS) hist[i] = 0u;
        __syncthreads();
#pragma unroll
        for (uint32_t u = 0; u < 2u; ++u)
            if ((key[u] & pmask) == pval) atomicAdd(&hist[(key[u] >> shift) & mask], 1u);
        __syncthreads();
        hf_topk_find(hist, need, wsum, res);
        need -= res[1];
        pval |= res[0] << shift;
        pmask |= mask << shift;
    }
    // pval is the smallest key of the r-th largest sample's bin: back to a logit. A prefix of a
    // NaN's key (0) or of -inf's comes back as a NaN: no threshold.
    return __uint_as_float((pval & 0x80000000u) ? (pval & 0x7fffffffu) : ~pval);
}

// out[t, :] = the min(n_t, k) largest items of token t's row in descending order (their indices),
// -1 after. Blocks of exactly HF_TOPK_THREADS threads, one (token, segment) per block at a time;
// the launcher guarantees k <= HF_TOPK_MAXK. With segs > 1 the row's n_t entries are cut into
// segs contiguous segments of ceil(n_t / segs), and each segment's own top-k (global indices,
// descending, -1 after) goes to seg_out[t, segment, :] for hf_dsv4_indexer_topk_merge; the
// global top-k is inside their union, so the merged result is the same exact top-k.
//
// Levels l = 0 .. 5 refine a prefix (pval under pmask) of the k-th largest item; need counts the
// items still to take among those matching the prefix (1 <= need <= eq, the prefix's count). When
// need == eq, every item whose prefix is >= pval is selected and the search stops (at the latest
// at l = 5, where the prefix is a whole item and eq = 1; a search that starts in cand starts
// below the bits all of cand's items share). When cand can start with a set of items that holds
// the top k (the whole row if it fits, else the items >= the sampled threshold of
// hf_topk_threshold when there are k to HF_TOPK_CAP of them), every level reads cand. Otherwise
// items are read from the global row until the prefix's group fits in cand: one more pass over
// the row then stores the items above the prefix in sel and the group in cand, and later levels
// read cand. Selected items land in sel at atomic slots (order irrelevant: they are put in order before the
// write-out, and items are unique), so the output depends on the row's values alone.
HF_KERNEL void __launch_bounds__(HF_TOPK_THREADS)
hf_dsv4_indexer_topk(const float* scores, const int32_t* positions, const int32_t* slots, const int32_t* tok_req,
                     int32_t* out, int32_t* seg_out, uint32_t n, uint32_t width, uint32_t k, uint32_t segs) {
    hf_dependent_kernel_start();
    __shared__ uint32_t hist[HF_TOPK_BINS];
    __shared__ uint64_t sel[HF_TOPK_MAXK];
    __shared__ uint64_t cand[HF_TOPK_CAP];
    __shared__ uint32_t wsum[HF_TOPK_WARPS];
    __shared__ uint32_t res[3];
    __shared__ uint32_t cnt[2];  // items in sel, items in cand
    // AND and OR of cand's starting items, and of the selected items.
    __shared__ unsigned long long span[4];
    if (k == 0u || k > HF_TOPK_MAXK || blockDim.x != HF_TOPK_THREADS) return;
    const uint32_t tid = threadIdx.x;
    for (uint32_t item = blockIdx.x; item < n * segs; item += gridDim.x) {
        const uint32_t t = item / segs, sg = item % segs;
        const uint32_t full = (uint32_t)hf_idx_visible(positions, slots, tok_req, t, width);
        const uint32_t seg_len = (full + segs - 1u) / segs;
        const uint32_t lo = sg * seg_len < full ? sg * seg_len : full;
        const uint32_t cn = full - lo < seg_len ? full - lo : seg_len;
        const float* row = scores + (uint64_t)t * width + lo;
        __syncthreads();  // the previous token's readers of sel, cnt and span are done
        if (tid == 0) {
            cnt[0] = cnt[1] = 0u;
            span[0] = span[2] = ~0ull;
            span[1] = span[3] = 0ull;
        }
        __syncthreads();
        const uint32_t m = cn < k ? cn : k;
        uint64_t sel_all = ~(uint64_t)0, sel_any = 0u;  // this thread's selected items
        if (cn <= k) {
            hf_topk_load_row(row, cn, lo, sel, sel_all, sel_any);
        } else {
            uint64_t pmask = 0, pval = 0;
            uint32_t need = k;
            bool global = true, done = false;
            // The search starts from the row's items >= a sampled threshold, gathered in cand in
            // one pass, when there are at least k and at most HF_TOPK_CAP of them (the whole row
            // when it fits); else from the whole row, re-read level by level.
            uint64_t all = ~(uint64_t)0, any = 0u;  // this thread's items in cand
            if (cn <= HF_TOPK_CAP) {
                hf_topk_load_row(row, cn, lo, cand, all, any);
                if (tid == 0) cnt[1] = cn;
                global = false;
                hf_topk_fold_span(all, any, span);
                __syncthreads();  // cand, cnt[1] and span complete
            } else {
                const float tau = hf_topk_threshold(row, cn, k, hist, wsum, res);
                if (tau == tau) {
                    hf_topk_gather(row, cn, lo, tau, cand, &cnt[1], all, any);
                    hf_topk_fold_span(all, any, span);
                    __syncthreads();  // cnt[1] and span complete
                    const uint32_t nc = cnt[1];
                    global = nc < k || nc > HF_TOPK_CAP;
                    __syncthreads();  // every thread has read cnt[1]
                    if (global && tid == 0) cnt[1] = 0u;  // ordered by the first level's barrier
                }
            }
            // Takes items above the prefix, and those on it when done, into sel; when not done,
            // stores those on the prefix in cand.
            auto emit = [&](uint64_t it) {
                const uint64_t x = it & pmask;
                if (x > pval || (done && x == pval)) {
                    const uint32_t at = atomicAdd(&cnt[0], 1u);
                    if (at < HF_TOPK_MAXK) sel[at] = it;
                    sel_all &= it;
                    sel_any |= it;
                } else if (x == pval) {
                    const uint32_t at = atomicAdd(&cnt[1], 1u);
                    if (at < HF_TOPK_CAP) cand[at] = it;
                }
            };
            // Digits are the 11 bits (fewer at the bottom) below `top`. Items that all start in
            // cand share a prefix (the bits where their AND and OR agree): the search starts
            // below it, so no level only confirms a bit that every item has.
            uint32_t top = 64u;
            if (!global) {
                top = hf_topk_span_top(span[0], span[1]);
                pmask = top < 64u ? ~(uint64_t)0 << top : 0u;
                pval = span[0] & pmask;
            }
            for (uint32_t l = 0; l < HF_TOPK_LEVELS; ++l) {
                const uint32_t width = top < 11u ? top : 11u;
                const uint32_t shift = top - width, mask = (1u << width) - 1u;
                top = shift;
                for (uint32_t i = tid; i < HF_TOPK_BINS; i += HF_TOPK_THREADS) hist[i] = 0u;
                __syncthreads();  // hist cleared; cnt reset; cand and sel written by the last pass
                // Histogram of this level's digit over the items on the prefix. Runs of one bin
                // are added at once: equal values do not serialise on one shared counter.
                uint32_t cur = 0u, run = 0u;
                auto add = [&](uint32_t d) {
                    if (d != cur) {
                        if (run) atomicAdd(&hist[cur], run);
                        cur = d;
                        run = 0u;
                    }
                    ++run;
                };
                auto count = [&](uint64_t it) {
                    if ((it & pmask) == pval) add((uint32_t)(it >> shift) & mask);
                };
                // Level 0 (every item, the key's top 11 bits) with constants: the hottest pass.
                auto count0 = [&](uint64_t it) { add((uint32_t)(it >> 53)); };
                if (!global) {
                    const uint32_t nc = cnt[1];
                    for (uint32_t i = tid; i < nc; i += HF_TOPK_THREADS) count(cand[i]);
                } else if (l == 0u) {
                    hf_topk_each_row(row, cn, lo, count0);
                } else {
                    hf_topk_each_row(row, cn, lo, count);
                }
                if (run) atomicAdd(&hist[cur], run);
                __syncthreads();  // hist complete
                hf_topk_find(hist, need, wsum, res);
                const uint32_t eq = res[2];
                need -= res[1];
                pval |= (uint64_t)res[0] << shift;
                pmask |= (uint64_t)mask << shift;
                done = need == eq;
                if (done && !global) {
                    // Every item of cand on or above the prefix, each thread claiming the slots of
                    // its own with one atomic (a shared counter per item would serialise).
                    const uint32_t nc = cnt[1];
                    uint32_t mine = 0u;
                    for (uint32_t i = tid; i < nc; i += HF_TOPK_THREADS) mine += (cand[i] & pmask) >= pval ? 1u : 0u;
                    uint32_t at = mine ? atomicAdd(&cnt[0], mine) : 0u;
                    for (uint32_t i = tid; i < nc && mine; i += HF_TOPK_THREADS) {
                        const uint64_t it = cand[i];
                        if ((it & pmask) >= pval) {
                            if (at < HF_TOPK_MAXK) sel[at] = it;
                            ++at;
                            sel_all &= it;
                            sel_any |= it;
                        }
                    }
                } else if (global && (done || eq <= HF_TOPK_CAP)) {
                    hf_topk_each_row(row, cn, lo, emit);
                    global = false;
                }
                if (done) break;
            }
        }
        hf_topk_fold_span(sel_all, sel_any, span + 2);
        __syncthreads();  // sel holds the m selected items; span[2..4) their AND and OR
        // Output order of the m selected items (one per thread, 0 past m: below every item). By
        // buckets first: the 11 bits below the prefix the items share spread them over the
        // histogram's bins; bins in descending order give each item's first possible position,
        // and its rank among the items of its bin (gathered in cand, which is free now) the
        // rest. Where a bin holds more than HF_TOPK_BUCKET_MAX items, a merge sort instead.
        int32_t* orow = segs == 1u ? out + (uint64_t)t * k : seg_out + ((uint64_t)t * segs + sg) * k;
        uint64_t v = tid < m ? sel[tid] : 0u;
        const uint32_t top = hf_topk_span_top(span[2], span[3]);
        const uint32_t width = top < 11u ? top : 11u, shift = top - width;
        const uint32_t d = (uint32_t)(v >> shift) & ((1u << width) - 1u);
        uint32_t* bucket_end = reinterpret_cast<uint32_t*>(cand);  // [HF_TOPK_BINS]
        uint64_t* bucketed = cand + HF_TOPK_BINS / 2;             // [HF_TOPK_MAXK]
        for (uint32_t i = tid; i < HF_TOPK_BINS; i += HF_TOPK_THREADS) hist[i] = 0u;
        if (tid == 0) cnt[0] = 0u;  // becomes: some bin is too full
        __syncthreads();
        if (tid < m) atomicAdd(&hist[d], 1u);
        __syncthreads();
        {
            const uint32_t lo = hist[2u * tid], hi = hist[2u * tid + 1u];
            if (lo > HF_TOPK_BUCKET_MAX || hi > HF_TOPK_BUCKET_MAX) cnt[0] = 1u;
            const uint32_t above = hf_topk_above(lo + hi, wsum);
            bucket_end[2u * tid + 1u] = above;  // the bin's first position; its end after the scatter
            bucket_end[2u * tid] = above + hi;
        }
        __syncthreads();
        if (cnt[0] == 0u) {
            if (tid < m) bucketed[atomicAdd(&bucket_end[d], 1u)] = v;
            __syncthreads();
            if (tid < m) {
                const uint32_t end = bucket_end[d], first = end - hist[d];
                uint32_t at = first;
                for (uint32_t j = first; j < end; ++j) at += bucketed[j] > v ? 1u : 0u;
                orow[at] = (int32_t)~(uint32_t)v;
            }
            for (uint32_t i = m + tid; i < k; i += HF_TOPK_THREADS) orow[i] = -1;
            continue;
        }
        // Merge sort, one item per thread in a register (HF_TOPK_MAXK == HF_TOPK_THREADS): each
        // warp sorts its items (a bitonic network over shuffles), then runs of a warp's width and
        // up merge pairwise through sel, each item moving to its index in its run plus its rank
        // in the other run (a binary search; ties, which only padding has, put the first run's
        // items first).
        uint32_t p2 = 1u;
        while (p2 < m) p2 <<= 1;
        const uint32_t lane = tid % HF_WARP_SIZE;
        for (uint32_t size = 2u; size <= (uint32_t)HF_WARP_SIZE; size <<= 1) {
            for (uint32_t stride = size >> 1; stride > 0u; stride >>= 1) {
                const uint32_t blo = hf_shfl_xor((uint32_t)v, (int)stride);
                const uint32_t bhi = hf_shfl_xor((uint32_t)(v >> 32), (int)stride);
                const uint64_t b = ((uint64_t)bhi << 32) | blo;
                // The lower lane of a pair keeps the larger item where the run is descending.
                const bool keep_max = ((lane & stride) == 0u) == ((lane & size) == 0u);
                v = keep_max == (v > b) ? v : b;
            }
        }
        if ((uint32_t)HF_WARP_SIZE < p2) {
            sel[tid] = v;  // the slot this thread read
            __syncthreads();
        }
        for (uint32_t run = HF_WARP_SIZE; run < p2; run <<= 1) {
            // sel holds the runs of `run` items; this thread's item is sel[tid] == v.
            const bool second = (tid & run) != 0u;
            const uint32_t own = tid & (run - 1u), first = tid & ~(2u * run - 1u);
            const uint64_t* other = sel + (second ? first : first + run);
            // Items of the other run ahead of v: larger (or equal, from the first run).
            uint32_t pos = 0u;
            for (uint32_t step = run >> 1; step > 0u; step >>= 1) {
                const uint64_t o = other[pos + step - 1u];
                if (o > v || (second && o == v)) pos += step;
            }
            const uint64_t o = other[pos];
            if (o > v || (second && o == v)) ++pos;
            __syncthreads();  // every search is done
            sel[first + own + pos] = v;
            __syncthreads();
            v = sel[tid];
        }
        if (tid < k) orow[tid] = tid < m ? (int32_t)~(uint32_t)v : -1;
    }
}

// out[t, :] = the top-k of the union of token t's segs segment lists (seg_out[t, s, :], each
// descending, -1 after), -1 after min(n_t, k): one block per token; every listed entry's rank in
// the union is its place in its own list plus, for every other list, how many of its items are
// larger (a binary search; items are unique, so ranks are too), and it lands at out[t, rank] when
// the rank is below k. Integers and comparisons only: exact, in any order.
__device__ __forceinline__ uint32_t hf_topk_count_above(const float* row, const int32_t* list, uint32_t k,
                                                        uint64_t it) {
    uint32_t lo = 0u, hi = k;  // list[0 .. lo) are above it, list[hi ..) are not
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2u;
        const int32_t c = list[mid];
        if (c >= 0 && hf_topk_item(row[c], (uint32_t)c) > it) lo = mid + 1u;
        else hi = mid;
    }
    return lo;
}

HF_KERNEL void __launch_bounds__(HF_TOPK_THREADS)
hf_dsv4_indexer_topk_merge(const float* scores, const int32_t* positions, const int32_t* slots,
                           const int32_t* tok_req, const int32_t* seg_out, int32_t* out, uint32_t n, uint32_t width,
                           uint32_t k, uint32_t segs) {
    hf_dependent_kernel_start();
    for (uint32_t t = blockIdx.x; t < n; t += gridDim.x) {
        const uint32_t full = (uint32_t)hf_idx_visible(positions, slots, tok_req, t, width);
        const uint32_t m = full < k ? full : k;
        const float* row = scores + (uint64_t)t * width;
        const int32_t* lists = seg_out + (uint64_t)t * segs * k;
        int32_t* orow = out + (uint64_t)t * k;
        for (uint32_t i = m + threadIdx.x; i < k; i += blockDim.x) orow[i] = -1;
        for (uint32_t i = threadIdx.x; i < segs * k; i += blockDim.x) {
            const uint32_t own = i / k, at = i % k;
            const int32_t c = lists[i];
            if (c < 0) continue;
            const uint64_t it = hf_topk_item(row[c], (uint32_t)c);
            uint32_t rank = at;
            for (uint32_t o = 0; o < segs && rank < k; ++o)
                if (o != own) rank += hf_topk_count_above(row, lists + (uint64_t)o * k, k, it);
            if (rank < k) orow[rank] = c;
        }
    }
}
"#;

/// Warps per block of the logits kernel.
pub const INDEXER_WARPS: u32 = 4;
/// Threads per block of the top-k kernel (its launcher uses exactly this many; see
/// [`topk_launch_config`]).
pub const TOPK_THREADS: u32 = 1024;
/// Largest `index_topk` the top-k kernel supports (its sorted selection lives in shared memory).
pub const TOPK_MAX: usize = 1024;
/// Most segments one token's top-k is cut into (then merged; see [`Indexer::topk_segments`]).
pub const TOPK_MAX_SEGMENTS: usize = 4;
/// Items (compressed entries) the top-k kernel keeps in shared memory once the search has
/// narrowed to them; a larger group is searched by re-reading the row from the workspace.
pub const TOPK_SHARED_CANDIDATES: usize = 3584;
/// Entries of a row the top-k kernel samples for its gathering threshold: entry
/// `floor(j · n_t / TOPK_SAMPLES)` for `j < TOPK_SAMPLES`, in rows of more than
/// [`TOPK_SHARED_CANDIDATES`] entries (see the module docs).
pub const TOPK_SAMPLES: usize = 2048;

/// The top-k kernel's launch shape for `num_tokens_padded` tokens: one block of [`TOPK_THREADS`]
/// per token (grid-stride past 65535), static shared memory only.
pub fn topk_launch_config(num_tokens_padded: usize) -> LaunchConfig {
    LaunchConfig::blocks(num_tokens_padded.clamp(1, 65535) as u32, TOPK_THREADS)
}
/// Most f32 values the logits kernel stages in shared memory (48 KiB):
/// `heads·head_dim + heads + INDEXER_WARPS·head_dim` must not exceed it.
pub const INDEXER_MAX_SHARED_FLOATS: usize = 12288;

/// The total-order key of a logit used by the top-k (as the kernel's `hf_topk_key`).
fn topk_key(x: f32) -> u32 {
    let x = x + 0.0;
    if x.is_nan() {
        return 0;
    }
    let u = x.to_bits();
    if u >> 31 == 1 {
        !u
    } else {
        u | 0x8000_0000
    }
}

/// `(t, request, n_t)` of every token that sees at least one compressed entry.
fn visible_tokens(
    l: &CpuLaunch<'_>,
    first: usize,
    n: usize,
    width: usize,
) -> holdfast_hal::Result<Vec<(usize, i32, usize)>> {
    let (pos, slots, req) = (l.ptr::<i32>(first)?, l.ptr::<i32>(first + 1)?, l.ptr::<i32>(first + 2)?);
    let (pos, slots, req) = (pos.read(0, n)?, slots.read(0, n)?, req.read(0, n)?);
    Ok((0..n)
        .filter(|&t| slots[t] >= 0 && req[t] >= 0)
        .map(|t| (t, req[t], (((pos[t] as u32).wrapping_add(1) / RATIO as u32) as usize).min(width)))
        .filter(|&(_, _, c)| c > 0)
        .collect())
}

fn logits_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (q, w, kc, table_rows) = (l.ptr::<bf16>(0)?, l.ptr::<f32>(1)?, l.ptr::<bf16>(2)?, l.ptr::<i32>(6)?);
    let (bt, scores) = (l.ptr::<i32>(7)?, l.ptr::<f32>(8)?);
    let (n, heads, dim, width, cbs, btw, rows) =
        (l.count(9)?, l.count(10)?, l.count(11)?, l.count(12)?, l.count(13)?, l.count(14)?, l.count(15)?);
    let scale = l.f32(16)?;
    // Keyed by table row from here on: a request's block-table row.
    let mut jobs = visible_tokens(l, 3, n, width)?;
    for job in &mut jobs {
        job.1 = table_rows.get_signed(i64::from(job.1))?;
    }
    // Each request's K rows once, as f32 (`[n_max, dim]`), gathered through the checked pointers.
    let mut keys: HashMap<i32, Vec<f32>> = HashMap::new();
    for &(_, r, cn) in &jobs {
        let have = keys.get(&r).map_or(0, |k| k.len() / dim);
        if cn <= have {
            continue;
        }
        let k = keys.entry(r).or_default();
        for c in have..cn {
            let block = bt.get_signed(i64::from(r) * btw as i64 + (c / cbs) as i64)?;
            let slot = i64::from(block) * cbs as i64 + (c % cbs) as i64;
            if slot < 0 || slot >= rows as i64 {
                return Err(
                    l.fail(format!("compressed entry {c} of table row {r}: slot {slot} outside the {rows}-row cache"))
                );
            }
            k.extend(kc.read(slot as usize * dim, dim)?.iter().map(|x| x.to_f32()));
        }
    }
    let mut inputs = Vec::with_capacity(jobs.len());
    for &(t, r, cn) in &jobs {
        let qt: Vec<f32> = q.read(t * heads * dim, heads * dim)?.iter().map(|x| x.to_f32()).collect();
        inputs.push((t, r, cn, qt, w.read(t * heads, heads)?));
    }
    let out: Vec<Vec<f32>> = inputs
        .par_iter()
        .map(|(_, r, cn, qt, wt)| {
            let k = &keys[r];
            (0..*cn)
                .map(|c| {
                    let kr = &k[c * dim..(c + 1) * dim];
                    let mut acc = 0f32;
                    for (h, wh) in wt.iter().enumerate() {
                        let dot = qt[h * dim..(h + 1) * dim].iter().zip(kr).fold(0f32, |s, (a, b)| s + a * b);
                        acc += wh * (scale * dot).max(0.0);
                    }
                    acc
                })
                .collect()
        })
        .collect();
    for ((t, ..), row) in inputs.iter().zip(&out) {
        scores.write(t * width, row)?;
    }
    Ok(())
}

/// The `k` largest of `candidates` (indices into `row`) by (logit key descending, index
/// ascending), -1 padded to `k`.
fn top_of(row: &[f32], candidates: impl Iterator<Item = usize>, k: usize) -> Vec<i32> {
    let mut order: Vec<(u32, usize)> = candidates.map(|c| (topk_key(row[c]), c)).collect();
    order.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut r: Vec<i32> = order.iter().take(k).map(|&(_, c)| c as i32).collect();
    r.resize(k, -1);
    r
}

/// Each token's visible scores `[n_t]`.
fn visible_rows(l: &CpuLaunch<'_>, n: usize, width: usize) -> holdfast_hal::Result<Vec<Vec<f32>>> {
    let scores = l.ptr::<f32>(0)?;
    let mut cn = vec![0usize; n];
    for (t, _, c) in visible_tokens(l, 1, n, width)? {
        cn[t] = c;
    }
    cn.iter().enumerate().map(|(t, &c)| scores.read(t * width, c)).collect()
}

fn topk_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (out, seg_out) = (l.ptr::<i32>(4)?, l.ptr::<i32>(5)?);
    let (n, width, k, segs) = (l.count(6)?, l.count(7)?, l.count(8)?, l.count(9)?.max(1));
    let rows = visible_rows(l, n, width)?;
    // Per token, each segment's top-k (one segment: the whole row's).
    let picked: Vec<Vec<Vec<i32>>> = rows
        .par_iter()
        .map(|row| {
            let seg_len = row.len().div_ceil(segs);
            (0..segs)
                .map(|sg| {
                    let lo = (sg * seg_len).min(row.len());
                    top_of(row, lo..(lo + seg_len).min(row.len()), k)
                })
                .collect()
        })
        .collect();
    for (t, lists) in picked.iter().enumerate() {
        if segs == 1 {
            out.write(t * k, &lists[0])?;
        } else {
            for (sg, r) in lists.iter().enumerate() {
                seg_out.write((t * segs + sg) * k, r)?;
            }
        }
    }
    Ok(())
}

fn topk_merge_ref(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (seg_out, out) = (l.ptr::<i32>(4)?, l.ptr::<i32>(5)?);
    let (n, width, k, segs) = (l.count(6)?, l.count(7)?, l.count(8)?, l.count(9)?.max(1));
    let rows = visible_rows(l, n, width)?;
    for (t, row) in rows.iter().enumerate() {
        let lists = seg_out.read(t * segs * k, segs * k)?;
        let union = lists.iter().filter(|&&c| c >= 0).map(|&c| c as usize);
        if let Some(bad) = lists.iter().find(|&&c| c >= 0 && c as usize >= row.len()) {
            return Err(l.fail(format!("token {t}: segment entry {bad} past its {} visible entries", row.len())));
        }
        out.write(t * k, &top_of(row, union, k))?;
    }
    Ok(())
}

/// The indexer's kernel source (`hf_dsv4_indexer_logits`, `hf_dsv4_indexer_topk`).
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let u = |n| Param::scalar(n, ScalarKind::U32);
        let inp = Param::input::<i32>;
        KernelSource {
            name: "holdfast_indexer",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_dsv4_indexer_logits",
                    params: vec![
                        Param::input::<bf16>("q"),
                        Param::input::<f32>("w"),
                        Param::input::<bf16>("k_cache"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("table_rows"),
                        inp("block_table"),
                        Param::output::<f32>("scores"),
                        u("n"),
                        u("heads"),
                        u("dim"),
                        u("width"),
                        u("cbs"),
                        u("bt_width"),
                        u("cache_rows"),
                        Param::scalar("scale", ScalarKind::F32),
                    ],
                    cpu: logits_ref,
                },
                KernelEntry {
                    name: "hf_dsv4_indexer_topk",
                    params: vec![
                        Param::input::<f32>("scores"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        Param::output::<i32>("out"),
                        Param::output::<i32>("seg_out"),
                        u("n"),
                        u("width"),
                        u("k"),
                        u("segs"),
                    ],
                    cpu: topk_ref,
                },
                KernelEntry {
                    name: "hf_dsv4_indexer_topk_merge",
                    params: vec![
                        Param::input::<f32>("scores"),
                        inp("positions"),
                        inp("slots"),
                        inp("tok_req"),
                        inp("seg_out"),
                        Param::output::<i32>("out"),
                        u("n"),
                        u("width"),
                        u("k"),
                        u("segs"),
                    ],
                    cpu: topk_merge_ref,
                },
            ],
        }
    })
}

fn shape(op: &'static str, detail: String) -> AttentionError {
    AttentionError::Shape { op, detail }
}

/// Floats of shared memory one indexer block stages for `heads` heads of `head_dim`: the
/// queries (`heads × head_dim`), the head weights (`heads`) and a K row per warp
/// (`INDEXER_WARPS × head_dim`); `None` past `usize`. [`Indexer::new`] takes at most
/// [`INDEXER_MAX_SHARED_FLOATS`].
pub fn indexer_staged_floats(heads: usize, head_dim: usize) -> Option<usize> {
    heads.checked_mul(head_dim)?.checked_add(heads)?.checked_add((INDEXER_WARPS as usize).checked_mul(head_dim)?)
}

/// Compressed entries per sequence the indexer scores: `ceil(max_model_len / 4)`.
pub fn indexer_max_compressed(max_model_len: usize) -> usize {
    max_model_len.div_ceil(RATIO)
}

/// The c4a indexer for `heads × head_dim` query heads and `topk` selected entries, compiled for
/// one device, with its persistent score workspace; see the [module docs](self).
pub struct Indexer {
    heads: usize,
    head_dim: usize,
    topk: usize,
    max_tokens: usize,
    max_compressed: usize,
    table: BlockTableConfig,
    warp: u32,
    scores: Buffer<f32>,
    logits: Kernel,
    select: Kernel,
    merge: Kernel,
    /// Multiprocessors of the device (the automatic segment count fills about twice as many).
    units: usize,
    /// A fixed segment count, or `None` for [`Indexer::topk_segments`]'s automatic one.
    forced_segments: Option<usize>,
    /// `[max_num_batched_tokens, segments, topk]` segment lists for the merge (one element when
    /// the top-k runs in one segment).
    seg_out: Buffer<i32>,
}

impl std::fmt::Debug for Indexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Indexer({} × {} heads, top-{}, workspace [{}, {}])",
            self.heads, self.head_dim, self.topk, self.max_tokens, self.max_compressed
        )
    }
}

impl Indexer {
    /// An indexer of `heads` query heads of `head_dim` (64 × 128 in V4) selecting `topk`
    /// (`index_topk`) entries per token. Allocates the persistent workspace
    /// `[max_num_batched_tokens, ceil(max_model_len / 4)]` f32. `cfg.kv_table.block_size` must be
    /// a multiple of 4.
    pub fn new(dev: &Device, cfg: &CommonConfig, heads: usize, head_dim: usize, topk: usize) -> Result<Self> {
        const OP: &str = "Indexer::new";
        if heads == 0 || head_dim == 0 {
            return Err(shape(OP, format!("heads {heads} and head_dim {head_dim} must be positive")));
        }
        if indexer_staged_floats(heads, head_dim).is_none_or(|v| v > INDEXER_MAX_SHARED_FLOATS) {
            return Err(shape(
                OP,
                format!(
                    "{heads} heads × {head_dim} (+ {heads} weights + {INDEXER_WARPS} K rows) exceed the \
                     {INDEXER_MAX_SHARED_FLOATS} floats of shared memory one block stages"
                ),
            ));
        }
        if topk == 0 || topk > TOPK_MAX {
            return Err(AttentionError::Config(format!("{OP}: index_topk {topk} must lie in [1, {TOPK_MAX}]")));
        }
        let table = cfg.kv_table;
        if !table.block_size.is_multiple_of(RATIO) {
            return Err(AttentionError::Config(format!(
                "{OP}: KV block size {} is not a multiple of {RATIO}",
                table.block_size
            )));
        }
        let (t, mc) = (cfg.max_num_batched_tokens, indexer_max_compressed(cfg.max_model_len));
        let cache_rows = table.num_blocks.checked_mul(table.block_size / RATIO);
        if cache_rows.and_then(|r| r.checked_mul(head_dim)).is_none_or(|v| v > u32::MAX as usize) {
            return Err(AttentionError::Config(format!(
                "{OP}: the key cache ({} blocks × {} entries × head_dim {head_dim}) passes the 2^32 elements \
                 its 32-bit offsets reach",
                table.num_blocks,
                table.block_size / RATIO
            )));
        }
        if t.checked_mul(topk).is_none() || t.checked_mul(heads * head_dim).is_none() {
            return Err(AttentionError::Config(format!(
                "{OP}: max_num_batched_tokens {t} × index_topk {topk} or × {heads} heads × {head_dim} overflows"
            )));
        }
        if mc > i32::MAX as usize {
            return Err(AttentionError::Config(format!(
                "{OP}: max_model_len {} gives {mc} compressed entries per row, past i32",
                cfg.max_model_len
            )));
        }
        let cells = t
            .checked_mul(mc)
            .ok_or_else(|| AttentionError::Config(format!("{OP}: workspace [{t}, {mc}] overflows")))?;
        let m = dev.compile(source())?;
        Ok(Indexer {
            heads,
            head_dim,
            topk,
            max_tokens: t,
            max_compressed: mc,
            table,
            warp: dev.info().warp_size.max(32),
            scores: dev.alloc_persistent("attn.indexer.scores", cells.max(1))?,
            logits: m.kernel("hf_dsv4_indexer_logits")?,
            select: m.kernel("hf_dsv4_indexer_topk")?,
            merge: m.kernel("hf_dsv4_indexer_topk_merge")?,
            units: dev.info().compute_units.max(1) as usize,
            forced_segments: None,
            // One segment by default: no lists (`with_topk_segments` allocates them).
            seg_out: dev.alloc_persistent("attn.indexer.topk_segments", 1)?,
        })
    }

    /// The same indexer with the top-k cut into exactly `segments` (1 to [`TOPK_MAX_SEGMENTS`])
    /// segments per token at every row count (the result is the same exact top-k; tests use this to
    /// check every segment count). Allocates the segment lists for every token.
    pub fn with_topk_segments(mut self, dev: &Device, segments: usize) -> Result<Self> {
        if segments == 0 || segments > TOPK_MAX_SEGMENTS {
            return Err(AttentionError::Config(format!(
                "Indexer::with_topk_segments: {segments} segments; 1 to {TOPK_MAX_SEGMENTS} are supported"
            )));
        }
        let cells = self.max_tokens * segments * self.topk;
        self.seg_out = dev.alloc_persistent("attn.indexer.topk_segments", cells.max(1))?;
        self.forced_segments = Some(segments);
        Ok(self)
    }

    /// Segments per token the top-k of `num_tokens_padded` tokens uses: the count fixed by
    /// [`Indexer::with_topk_segments`], else one. (Segmenting so the (token, segment) blocks fill
    /// the device, [`Indexer::auto_topk_segments`], is correct at every count but slower: on an
    /// H200, 64 rows of 65536 candidates, the `indexer_topk` bench measured 41.0 µs at four
    /// segments vs 16.6 µs in one pass for k = 512, 58.3 vs 18.2 µs for k = 1024, since the
    /// per-segment select costs nearly what the whole row does and the merge comes on top.) A
    /// function of the padded row count and the device only; the selected entries never depend
    /// on it.
    pub fn topk_segments(&self, _num_tokens_padded: usize) -> usize {
        self.forced_segments.unwrap_or(1)
    }

    /// The segment count that gives about two (token, segment) blocks per multiprocessor for
    /// `num_tokens_padded` tokens, 1 to [`TOPK_MAX_SEGMENTS`] (what `with_topk_segments` would be
    /// given to fill the device).
    pub fn auto_topk_segments(&self, num_tokens_padded: usize) -> usize {
        (2 * self.units / num_tokens_padded.max(1)).clamp(1, TOPK_MAX_SEGMENTS)
    }

    /// Entries per output row.
    pub fn topk(&self) -> usize {
        self.topk
    }

    /// Width of the score workspace: `ceil(max_model_len / 4)` compressed entries.
    pub fn max_compressed(&self) -> usize {
        self.max_compressed
    }

    /// Rows of the indexer K cache it reads: `kv_table.num_blocks · block_size / 4`.
    pub fn cache_rows(&self) -> usize {
        self.table.num_blocks * (self.table.block_size / RATIO)
    }

    /// One step on `s`: `out [num_tokens_padded, topk]` i32 local compressed positions from
    /// `q [T, heads, head_dim]` bf16 (RoPE applied), `w [T, heads]` f32 head weights and
    /// `k_cache [≥ cache_rows, head_dim]` bf16, with logit `scale` (`T = num_tokens_padded`).
    /// Two launches (three when the top-k runs in segments), no host sync.
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        s: &Stream,
        common: &CommonAttentionMetadata,
        q: &View<bf16>,
        w: &View<f32>,
        k_cache: &View<bf16>,
        scale: f32,
        out: &View<i32>,
    ) -> Result<()> {
        self.select_with_stats(s, common, q, w, k_cache, scale, out).map(|_| ())
    }

    /// As [`Indexer::select`], returning the launches enqueued and the host syncs measured.
    #[allow(clippy::too_many_arguments)]
    pub fn select_with_stats(
        &self,
        s: &Stream,
        common: &CommonAttentionMetadata,
        q: &View<bf16>,
        w: &View<f32>,
        k_cache: &View<bf16>,
        scale: f32,
        out: &View<i32>,
    ) -> Result<BuildStats> {
        const OP: &str = "Indexer::select";
        let c = common.config();
        if c.max_num_batched_tokens > self.max_tokens
            || indexer_max_compressed(c.max_model_len) > self.max_compressed
            || c.kv_table != self.table
        {
            return Err(AttentionError::Mismatch(format!(
                "{OP}: common metadata ({} tokens, max_model_len {}, KV table {:?}) does not fit the indexer \
                 ({} tokens, {} compressed entries, KV table {:?})",
                c.max_num_batched_tokens, c.max_model_len, c.kv_table, self.max_tokens, self.max_compressed, self.table
            )));
        }
        let layout = common.layout()?;
        let (t, h, d, k) = (layout.num_tokens_padded, self.heads, self.head_dim, self.topk);
        let checks = [
            ("q", q.len(), t * h * d, format!("[{t} padded tokens, {h}, {d}]")),
            ("w", w.len(), t * h, format!("[{t} padded tokens, {h}]")),
            ("k_cache", k_cache.len(), self.cache_rows() * d, format!("[{} rows, {d}]", self.cache_rows())),
            ("out", out.len(), t * k, format!("[{t} padded tokens, top-{k}]")),
        ];
        for (name, len, need, what) in checks {
            if len < need {
                return Err(shape(OP, format!("{name} holds {len} elements, {what} needs {need}")));
            }
        }
        let dev = common.device().clone();
        let (launches, host_syncs) = counting_syncs(&dev, || {
            let (pos, slots, req, table_rows, bt) = (
                common.positions()?,
                common.slot_mapping()?,
                common.token_to_req()?,
                common.table_rows()?,
                common.block_table(TableKind::Kv)?,
            );
            let scores = self.scores.prefix((t * self.max_compressed).max(1))?;
            let u = |v: usize| v as u32;
            let rows = t.clamp(1, 65535) as u32;
            let split = self.max_compressed.div_ceil(8 * INDEXER_WARPS as usize).clamp(1, 16) as u32;
            let logits = [
                q.into(),
                w.into(),
                k_cache.into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&table_rows).into(),
                (&bt).into(),
                (&scores).into(),
                u(t).into(),
                u(h).into(),
                u(d).into(),
                u(self.max_compressed).into(),
                u(self.table.block_size / RATIO).into(),
                u(self.table.max_blocks_per_seq).into(),
                u((k_cache.len() / d).min(u32::MAX as usize)).into(),
                scale.into(),
            ];
            let cfg = LaunchConfig {
                grid: (rows, split, 1),
                block: (INDEXER_WARPS * self.warp, 1, 1),
                shared_mem_bytes: ((h * d + h + INDEXER_WARPS as usize * d) * 4) as u32,
            };
            s.launch_dependent(&self.logits, cfg, &logits)?;
            let out = out.slice(0, (t * k).max(1).min(out.len()))?;
            let segs = self.topk_segments(t);
            let seg_out = self.seg_out.prefix((t * segs * k).max(1).min(self.seg_out.len()))?;
            let topk = [
                (&scores).into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&out).into(),
                (&seg_out).into(),
                u(t).into(),
                u(self.max_compressed).into(),
                u(k).into(),
                u(segs).into(),
            ];
            s.launch_dependent(&self.select, topk_launch_config(t * segs), &topk)?;
            if segs == 1 {
                return Ok(2);
            }
            let merge = [
                (&scores).into(),
                (&pos).into(),
                (&slots).into(),
                (&req).into(),
                (&seg_out).into(),
                (&out).into(),
                u(t).into(),
                u(self.max_compressed).into(),
                u(k).into(),
                u(segs).into(),
            ];
            s.launch_dependent(&self.merge, topk_launch_config(t), &merge)?;
            Ok(3)
        })?;
        Ok(BuildStats { launches, host_syncs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host constants describe the kernel source's own.
    #[test]
    fn the_top_k_constants_match_the_kernel_source() {
        for (name, v) in [
            ("HF_TOPK_THREADS", TOPK_THREADS as usize),
            ("HF_TOPK_MAXK", TOPK_MAX),
            ("HF_TOPK_CAP", TOPK_SHARED_CANDIDATES),
            ("HF_IDX_WARPS", INDEXER_WARPS as usize),
        ] {
            assert!(CODE.contains(&format!("#define {name} {v}\n")), "{name} is not {v} in the kernel source");
        }
    }

    /// The CPU reference's key orders like the definition: NaN lowest, `−0 == +0`.
    #[test]
    fn the_top_k_key_is_a_total_order_with_signed_zeros_equal() {
        let xs = [f32::NAN, f32::NEG_INFINITY, -3.0, -f32::MIN_POSITIVE, -0.0, 0.0, 1e-45, 2.0, f32::INFINITY];
        let keys: Vec<u32> = xs.iter().map(|&x| topk_key(x)).collect();
        assert_eq!(keys[0], 0);
        assert_eq!(topk_key(f32::from_bits(0xFFC0_0001)), 0);
        assert_eq!(keys[4], keys[5]);
        for (i, w) in keys.windows(2).enumerate() {
            assert!(w[0] < w[1] || i == 4, "{} vs {}", xs[i], xs[i + 1]);
        }
    }
}
