// mHC kernels for hc_mult = 4: hc_head, mhc_pre, mhc_fused_post_pre (split reductions) and mhc_post
// (elementwise). The CPU references in reference.rs define the numbers. The portable projection
// below and everything else (finish items, mhc_post) twin them operation for operation: every
// summation order, fused multiply-add and rounding has its twin there, so keep the two in step.
// The tensor-core projection (NVIDIA sm_80+, further down) has its own fixed order and matches the
// references within rounding; it too depends on H only.
//
// Reduction structure of the portable projection (fixed; it depends on H only, never on T or on
// the launch shape):
//   h is cut into quads of 4; split s owns quads [64 s, 64 s + 64), so S = ceil(H / 256). Within a
//   split, lane k of SUB owns quads 64 s + k + SUB r for r = 0 .. 64 / SUB and accumulates, quad by
//   quad (r), stream by stream (i) and element by element, fmaf(x, x, ss) and fmaf(x, fn[j], dot_j)
//   from 0. The SUB lanes are summed with the xor tree (masks SUB/2, ..., 2, 1), giving one partial
//   per (token, split, value); the S partials are summed in split order. SUB is 32 for hc_head and
//   8 for mhc_pre / mhc_fused_post_pre, whose 24 weight rows are shared by the 4 tokens of a warp
//   slot (8 lanes x 16 bytes = one 128-byte line of fn per load instruction).
//
// Work items of the portable path (one per block, claimed from a ticket counter so that a block
// only ever waits for items claimed before its own; the resident items further down are the
// tensor-core path's): a projection item (tile of tokens, split) writes partials; a
// finish item (tile, group of tokens) waits until all S projection items of its tile arrived, sums
// the partials, computes the gates (and Sinkhorn) and writes the outputs. Items are ordered
// A(0) A(1) F(0) A(2) F(1) ... F(Q-1), so a finish item rarely waits. At decode sizes hc_head
// takes self-finishing projection items instead (MHC_SELF_FINISH: each writes its own 256 h of
// the tile after the tile's projections are in; no finish items). Counters live in `sync`: [0]
// ticket; finish items: [1 + 2q] arrivals of tile q, [2 + 2q] departures of its finish items;
// self-finishing and resident items: [1 + 2q] S arrivals, then S departures (2 + 2q unused). The
// last block to use a counter resets it, so every launch leaves `sync` zeroed for the next (graph
// replays included).

#define MHC_N 4
#define MHC_CHUNK 8
#define MHC_QUAD 4          // h per projection unit (8-byte bf16 load, 16-byte fn load)
#define MHC_SPLIT_QUADS 64  // quads per split
#define MHC_SPLIT_H (MHC_QUAD * MHC_SPLIT_QUADS)
#define MHC_THREADS 256
#define MHC_SUB_HEAD 32     // lanes per token and split: hc_head (2 rounds each)
#define MHC_SUB_PRE 8       // mhc_pre and fused (8 rounds each; 4 tokens share each weight load)
#define MHC_FINISH_MAX 16
#define MHC_POST_THREADS 128
#ifndef MHC_FINISH_UNROLL
#define MHC_FINISH_UNROLL 4  // chunks per thread in flight in a finish item
#endif
// Projection register tiles: tokens per lane (reuse of each fn load) and rounds in flight (loads
// issued ahead), and the blocks per multiprocessor the register budget must allow.
#ifndef MHC_TUNE
#define MHC_TT_HEAD 2
#define MHC_UNROLL_HEAD 2
#define MHC_BLOCKS_HEAD 2
#define MHC_TT_PRE 2
#define MHC_UNROLL_PRE 1
#define MHC_BLOCKS_PRE 1
#define MHC_TT_FUSED 2
#define MHC_UNROLL_FUSED 1
#define MHC_BLOCKS_FUSED 1
#define MHC_BLOCKS_FINISH 2
#endif

static_assert(HF_WARP_SIZE % 32 == 0, "32-lane groups must not straddle warps");
static_assert(MHC_THREADS / (MHC_N * MHC_N) >= MHC_FINISH_MAX, "one 16-lane Sinkhorn group per finished token");

struct alignas(16) mhc_u32x4 {
    uint32_t x, y, z, w;
};
struct alignas(16) mhc_f32x4 {
    float x, y, z, w;
};

__device__ __forceinline__ float mhc_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float mhc_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
// Per element, not hf_pack_bf16x2: mhc_post, which is bound by memory, measured 5% slower on an
// H200 with the paired conversion (fewer registers, a different schedule of its loads).
__device__ __forceinline__ uint32_t mhc_pack(float a, float b) {
    return (uint32_t)hf_f32_to_bf16(a).bits | ((uint32_t)hf_f32_to_bf16(b).bits << 16);
}
__device__ __forceinline__ void mhc_unpack(mhc_u32x4 u, float v[8]) {
    v[0] = mhc_lo(u.x); v[1] = mhc_hi(u.x); v[2] = mhc_lo(u.y); v[3] = mhc_hi(u.y);
    v[4] = mhc_lo(u.z); v[5] = mhc_hi(u.z); v[6] = mhc_lo(u.w); v[7] = mhc_hi(u.w);
}
__device__ __forceinline__ mhc_u32x4 mhc_repack(const float v[8]) {
    mhc_u32x4 u;
    u.x = mhc_pack(v[0], v[1]); u.y = mhc_pack(v[2], v[3]); u.z = mhc_pack(v[4], v[5]); u.w = mhc_pack(v[6], v[7]);
    return u;
}
__device__ __forceinline__ bool mhc_aligned16(const void* p) { return (((uint64_t)p) & 15u) == 0; }

// Splits rounded up to 4 (rows of the gate copy, see mhc_gate_copy).
__device__ __forceinline__ uint32_t mhc_split_pad(uint32_t S) { return (S + 3u) & ~3u; }
// A float / 16 bytes another block wrote during this launch, read after the acquire that
// published them: from L2 (NVIDIA: ld.global.cg, never an L1 line; volatile asm, so it stays after
// the acquire's barrier, as a volatile load would), else volatile loads.
__device__ __forceinline__ float mhc_ldcg(const float* p) {
#if defined(HF_CUDA)
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
#else
    return *(const volatile float*)p;
#endif
}
__device__ __forceinline__ float4 mhc_ldcg4(const float4* p) {
    float4 r;
#if defined(HF_CUDA)
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p));
#else
    const volatile float* f = reinterpret_cast<const volatile float*>(p);
    r.x = f[0];
    r.y = f[1];
    r.z = f[2];
    r.w = f[3];
#endif
    return r;
}

// 8 bf16 of one row starting at h0 (VEC: one 16-byte load; else element loads, zero past H).
template <bool VEC>
__device__ __forceinline__ mhc_u32x4 mhc_load8(const hf_bf16* row, uint32_t h0, uint32_t H) {
    mhc_u32x4 u;
    if (VEC) {
        u = *reinterpret_cast<const mhc_u32x4*>(row + h0);
    } else {
        uint32_t b[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) b[e] = (h0 + e < H) ? (uint32_t)row[h0 + e].bits : 0u;
        u.x = b[0] | (b[1] << 16); u.y = b[2] | (b[3] << 16); u.z = b[4] | (b[5] << 16); u.w = b[6] | (b[7] << 16);
    }
    return u;
}
template <bool VEC>
__device__ __forceinline__ void mhc_store8(hf_bf16* row, uint32_t h0, uint32_t H, mhc_u32x4 u) {
    if (VEC) {
        *reinterpret_cast<mhc_u32x4*>(row + h0) = u;
    } else {
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            if (h0 + e < H) {
                hf_bf16 v;
                v.bits = (uint16_t)((e & 1) ? (w[e / 2] >> 16) : (w[e / 2] & 0xffffu));
                row[h0 + e] = v;
            }
        }
    }
}
template <bool VEC>
__device__ __forceinline__ void mhc_load_f8(const float* p, uint32_t ne, float f[8]) {
    if (VEC) {
        const mhc_f32x4 a = reinterpret_cast<const mhc_f32x4*>(p)[0];
        const mhc_f32x4 b = reinterpret_cast<const mhc_f32x4*>(p)[1];
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = ((uint32_t)e < ne) ? p[e] : 0.0f;
    }
}

__device__ __forceinline__ float mhc_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

// Post-mix of one chunk: out_j = x * post_j, then out_j = fmaf(comb[i][j], r_i, out_j) for i in
// order; rounded to bf16. `coef` is post[t] (4) followed by comb[t] (16, row i = input stream).
__device__ __forceinline__ void mhc_post_mix(const mhc_u32x4 xu, const mhc_u32x4 ru[MHC_N], const float* coef,
                                             mhc_u32x4 out[MHC_N]) {
    float xv[8], rv[MHC_N][8];
    mhc_unpack(xu, xv);
#pragma unroll
    for (int i = 0; i < MHC_N; ++i) mhc_unpack(ru[i], rv[i]);
#pragma unroll
    for (int j = 0; j < MHC_N; ++j) {
        const float pj = coef[j];
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = xv[e] * pj;
#pragma unroll
        for (int i = 0; i < MHC_N; ++i) {
            const float c = coef[MHC_N + i * MHC_N + j];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = fmaf(c, rv[i][e], o[e]);
        }
        out[j] = mhc_repack(o);
    }
}

// ---- quads (4 h): the projection's unit, so the 8 subgroup lanes read one 128-byte line of fn ----

struct alignas(8) mhc_u32x2 {
    uint32_t x, y;
};

template <bool VEC>
__device__ __forceinline__ mhc_u32x2 mhc_load4(const hf_bf16* row, uint32_t h0, uint32_t H) {
    mhc_u32x2 u;
    if (VEC) {
        u = *reinterpret_cast<const mhc_u32x2*>(row + h0);
    } else {
        uint32_t b[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = (h0 + e < H) ? (uint32_t)row[h0 + e].bits : 0u;
        u.x = b[0] | (b[1] << 16); u.y = b[2] | (b[3] << 16);
    }
    return u;
}
__device__ __forceinline__ void mhc_unpack4(mhc_u32x2 u, float v[4]) {
    v[0] = mhc_lo(u.x); v[1] = mhc_hi(u.x); v[2] = mhc_lo(u.y); v[3] = mhc_hi(u.y);
}
template <bool VEC>
__device__ __forceinline__ void mhc_load_f4(const float* p, uint32_t ne, float f[4]) {
    if (VEC) {
        const mhc_f32x4 a = *reinterpret_cast<const mhc_f32x4*>(p);
        f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = ((uint32_t)e < ne) ? p[e] : 0.0f;
    }
}
// mhc_post_mix on a quad (same operations, element for element).
__device__ __forceinline__ void mhc_post_mix4(const mhc_u32x2 xu, const mhc_u32x2 ru[MHC_N], const float* coef,
                                              mhc_u32x2 out[MHC_N]) {
    float xv[4], rv[MHC_N][4];
    mhc_unpack4(xu, xv);
#pragma unroll
    for (int i = 0; i < MHC_N; ++i) mhc_unpack4(ru[i], rv[i]);
#pragma unroll
    for (int j = 0; j < MHC_N; ++j) {
        const float pj = coef[j];
        float o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) o[e] = xv[e] * pj;
#pragma unroll
        for (int i = 0; i < MHC_N; ++i) {
            const float c = coef[MHC_N + i * MHC_N + j];
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = fmaf(c, rv[i][e], o[e]);
        }
        out[j].x = mhc_pack(o[0], o[1]);
        out[j].y = mhc_pack(o[2], o[3]);
    }
}

// Sum of P values over the lanes of a subgroup with the xor tree M, M/2, ..., 1. While more than one
// value is left, each step halves the values a lane holds (the lane with the mask bit set keeps the
// upper half), so the shuffles total about P instead of P log2(2M). Every lane pair adds the same
// two operands as a plain butterfly would, so the bits equal the plain tree. With M = 4 and P >= 8,
// on return a[0 .. P/8) of subgroup lane k are the totals of values k P/8 + (0 .. P/8).
template <int P, int M>
struct MhcGroupSum {
    static __device__ __forceinline__ void run(float* a, uint32_t lane) {
        constexpr int H2 = P / 2;
        const bool up = (lane & M) != 0;
#pragma unroll
        for (int k = 0; k < H2; ++k) {
            const float send = up ? a[k] : a[k + H2];
            const float keep = up ? a[k + H2] : a[k];
            a[k] = keep + hf_shfl_xor(send, M);
        }
        MhcGroupSum<H2, M / 2>::run(a, lane);
    }
};
template <int M>
struct MhcGroupSum<1, M> {
    static __device__ __forceinline__ void run(float* a, uint32_t lane) {
        a[0] = a[0] + hf_shfl_xor(a[0], M);
        MhcGroupSum<1, M / 2>::run(a, lane);
    }
};
template <>
struct MhcGroupSum<1, 0> {
    static __device__ __forceinline__ void run(float*, uint32_t) {}
};
template <int P>
struct MhcGroupSum<P, 0> {
    static __device__ __forceinline__ void run(float*, uint32_t) {}
};

// Smallest power of two >= V.
template <int V>
struct MhcPow2 {
    static constexpr int value = 2 * MhcPow2<(V + 1) / 2>::value;
};
template <>
struct MhcPow2<1> {
    static constexpr int value = 1;
};

// Sinkhorn on a 4x4 matrix held one element per lane of a 16-lane group (lane = 4 i + j); every lane
// of the warp must call it (shuffles). A row's four elements come to each of its lanes with xor 1,
// 2, 3 and a column's with xor 4, 8, 12, three independent shuffles in flight together (the chain
// of 20 normalisations is latency-bound); the sum is (own + xor 1) + (xor 2 + xor 3), which is
// the row's (c0 + c1) + (c2 + c3) in every lane, as the butterfly over xor 1 then 2 gave.
__device__ __forceinline__ float mhc_group4_sum(float c, int o) {
    const float a = hf_shfl_xor(c, o), b = hf_shfl_xor(c, 2 * o), d = hf_shfl_xor(c, 3 * o);
    return (c + a) + (b + d);
}
__device__ __forceinline__ float mhc_sinkhorn(float c, uint32_t iters, float eps) {
    const float m1 = hf_shfl_xor(c, 1), m2 = hf_shfl_xor(c, 2), m3 = hf_shfl_xor(c, 3);
    const float mx = fmaxf(fmaxf(c, m1), fmaxf(m2, m3));
    const float e = expf(c - mx);
    c = e / mhc_group4_sum(e, 1) + eps;
    c = c / (mhc_group4_sum(c, 4) + eps);
    for (uint32_t it = 1; it < iters; ++it) {
        c = c / (mhc_group4_sum(c, 1) + eps);
        c = c / (mhc_group4_sum(c, 4) + eps);
    }
    return c;
}

// ---- work items ------------------------------------------------------------------------------

struct MhcItem {
    bool project;     // projection item (else finish item)
    uint32_t tile;    // tile q
    uint32_t index;   // split (projection) or token group (finish)
};

// Item p of the sequence A(0) A(1) F(0) A(2) F(1) ... A(Q-1) F(Q-2) F(Q-1).
__device__ __forceinline__ MhcItem mhc_item(uint32_t p, uint32_t S, uint32_t F, uint32_t Q) {
    MhcItem it;
    if (p < S) {
        it.project = true; it.tile = 0; it.index = p;
        return it;
    }
    p -= S;
    const uint32_t k = p / (S + F) + 1, r = p % (S + F);
    if (k < Q && r < S) {
        it.project = true; it.tile = k; it.index = r;
    } else {
        it.project = false; it.tile = k - 1; it.index = (k < Q) ? r - S : r;
    }
    return it;
}

// Bits of the kernels' `resident` argument: the whole grid is resident at once; hc_head's
// projection items finish their own h (grid = tiles x S, no finish items; decode sizes).
#define MHC_RESIDENT_GRID 1u
#define MHC_SELF_FINISH 2u
// mhc_pre / fused with tensor cores, large T: the launch is the streamed projection pass (partials
// only; the fused op's residual_out too), and mhc_pre_finish_n4 follows it (see below).
#define MHC_STREAM 4u

// A block's ticket. When the host says the whole grid is resident at once (bit MHC_RESIDENT_GRID
// of the `resident` flags: at most
// half the device's multiprocessors, each of which holds a block of any kernel here), no block can
// wait on one that never starts, so the block index serves and the claim's round trip to L2 is
// saved (decode-size launches); otherwise tickets come from the counter in launch order of claim.
__device__ __forceinline__ uint32_t mhc_claim(uint32_t* sync, uint32_t resident) {
    if ((resident & MHC_RESIDENT_GRID) != 0u) return blockIdx.x;
    __shared__ uint32_t s_ticket;
    if (threadIdx.x == 0) {
        const uint32_t t = atomicAdd(&sync[0], 1u);
        if (t == gridDim.x - 1) atomicExch(&sync[0], 0u);
        s_ticket = t;
    }
    __syncthreads();
    return s_ticket;
}

__device__ __forceinline__ void mhc_arrive(uint32_t* sync, uint32_t tile) {
    hf_block_release_add_u32(&sync[1 + 2 * tile]);
}

__device__ __forceinline__ void mhc_wait(uint32_t* sync, uint32_t tile, uint32_t S) {
    if (threadIdx.x == 0) hf_acquire_until_u32(sync + 1 + 2 * tile, S);
    __syncthreads();
}

__device__ __forceinline__ void mhc_depart(uint32_t* sync, uint32_t tile, uint32_t F) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t d = atomicAdd(&sync[2 + 2 * tile], 1u);
        if (d == F - 1) {
            atomicExch(&sync[1 + 2 * tile], 0u);
            atomicExch(&sync[2 + 2 * tile], 0u);
        }
    }
}

// The source quad (4 h at h0) of TT tokens and every stream; FUSED: the post-mix of (x_in,
// residual), rounded to bf16 as mhc_post stores it. Tokens at or past t_end, and h0 >= H, read as 0.
template <int TT, bool VEC, bool FUSED>
__device__ __forceinline__ void mhc_source(const hf_bf16* __restrict__ residual, const hf_bf16* __restrict__ x_in,
                                           const float* __restrict__ post_in, const float* __restrict__ comb_in,
                                           uint32_t H, const uint32_t t[TT], uint32_t t_end, uint32_t h0,
                                           mhc_u32x2 src[TT][MHC_N]) {
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
        const uint64_t tk = t[tt];
        if (tk < t_end && h0 < H) {
#pragma unroll
            for (int i = 0; i < MHC_N; ++i) src[tt][i] = mhc_load4<VEC>(residual + (tk * MHC_N + i) * H, h0, H);
            if (FUSED) {
                float coef[MHC_N + MHC_N * MHC_N];
#pragma unroll
                for (int i = 0; i < MHC_N; ++i) coef[i] = post_in[tk * MHC_N + i];
#pragma unroll
                for (int i = 0; i < MHC_N * MHC_N; ++i) coef[MHC_N + i] = comb_in[tk * MHC_N * MHC_N + i];
                mhc_u32x2 ru[MHC_N];
#pragma unroll
                for (int i = 0; i < MHC_N; ++i) ru[i] = src[tt][i];
                mhc_post_mix4(mhc_load4<VEC>(x_in + tk * H, h0, H), ru, coef, src[tt]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < MHC_N; ++i) src[tt][i] = mhc_u32x2{0u, 0u};
        }
    }
}

// One round of a lane: accumulate the quad `src` (every stream) of TT tokens into acc.
template <int J, int TT, int P, bool VEC>
__device__ __forceinline__ void mhc_accumulate(const float* __restrict__ fn, uint32_t H, uint32_t h0,
                                               const mhc_u32x2 src[TT][MHC_N], float acc[TT][P]) {
    if (h0 >= H) return;
    const uint32_t D = MHC_N * H;
    const uint32_t ne = min((uint32_t)MHC_QUAD, H - h0);
#pragma unroll
    for (int i = 0; i < MHC_N; ++i) {
        float xv[TT][4];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) mhc_unpack4(src[tt][i], xv[tt]);
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (VEC || (uint32_t)e < ne)
#pragma unroll
                for (int tt = 0; tt < TT; ++tt) acc[tt][0] = fmaf(xv[tt][e], xv[tt][e], acc[tt][0]);
#pragma unroll
        for (int j = 0; j < J; ++j) {
            float f[4];
            mhc_load_f4<VEC>(fn + (uint64_t)j * D + (uint64_t)i * H + h0, ne, f);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (VEC || (uint32_t)e < ne)
#pragma unroll
                    for (int tt = 0; tt < TT; ++tt) acc[tt][1 + j] = fmaf(xv[tt][e], f[e], acc[tt][1 + j]);
        }
    }
}

// Projection item: partials[t][split][0] = sum of x^2, [1 + j] = sum of x * fn[j] over the split,
// for tokens [t_begin, t_end). SUB lanes (subgroup k) share a token; 32 / SUB token groups (g)
// share a warp slot and so read the same weights at once. The lane's TT tokens are
// tb + g TT + (0 .. TT); round r reads quad 64 split + k + SUB r; UNROLL rounds are in flight.
template <int J, int SUB, int TT, int UNROLL, bool VEC, bool FUSED>
__device__ void mhc_project(const hf_bf16* __restrict__ residual, const hf_bf16* __restrict__ x_in,
                            const float* __restrict__ post_in, const float* __restrict__ comb_in,
                            const float* __restrict__ fn, float* __restrict__ partials, uint32_t H, uint32_t S,
                            uint32_t split, uint32_t t_begin, uint32_t t_end) {
    constexpr int V = J + 1;
    constexpr int P = MhcPow2<V>::value;
    constexpr int ROUNDS = MHC_SPLIT_QUADS / SUB;
    constexpr int GROUPS = 32 / SUB;
    static_assert(ROUNDS % UNROLL == 0, "rounds come in groups of UNROLL");
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t k = lane % SUB, g = lane / SUB;
    constexpr uint32_t step = (MHC_THREADS / 32) * GROUPS * TT;
    for (uint32_t tb = t_begin + warp * GROUPS * TT; tb < t_end; tb += step) {
        uint32_t t[TT];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) t[tt] = tb + g * TT + tt;
        float acc[TT][P];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int v = 0; v < P; ++v) acc[tt][v] = 0.0f;
        const uint32_t q0 = split * MHC_SPLIT_QUADS + k;
#pragma unroll 1
        for (uint32_t r0 = 0; r0 < (uint32_t)ROUNDS; r0 += UNROLL) {
            mhc_u32x2 src[UNROLL][TT][MHC_N];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                mhc_source<TT, VEC, FUSED>(residual, x_in, post_in, comb_in, H, t, t_end,
                                           (q0 + SUB * (r0 + u)) * MHC_QUAD, src[u]);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
                mhc_accumulate<J, TT, P, VEC>(fn, H, (q0 + SUB * (r0 + u)) * MHC_QUAD, src[u], acc);
        }
        // After the subgroup sum, lane k holds P / SUB values (P >= SUB) starting at k P / SUB, or
        // (P < SUB) value k / (SUB / P), held alike by SUB / P lanes of which the first writes.
        constexpr int PL = P >= SUB ? P / SUB : 1;
        constexpr uint32_t stride = P >= SUB ? 1u : (uint32_t)(SUB / P);
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            MhcGroupSum<P, SUB / 2>::run(acc[tt], k);
            if (t[tt] < t_end && k % stride == 0) {
#pragma unroll
                for (int q = 0; q < PL; ++q) {
                    const uint32_t v = (k / stride) * PL + q;
                    if (v < (uint32_t)V) partials[((uint64_t)t[tt] * S + split) * V + v] = acc[tt][q];
                }
            }
        }
    }
}

#if defined(HF_HAS_MMA)
// ---- tensor-core projection (NVIDIA sm_80+) -------------------------------------------------------
//
// Used by the resident items below (not by the items above). Warp w of the block owns h
// [256 split + 32 w, + 32) of all four streams, lane (g = lane / 4, q = lane % 4) the 8 h at
// 256 split + 32 w + 8 q, so a warp's k-range is 4 streams x 32 h = 128 k, read as 16-byte pieces.
// fn is split into bf16 hi = bf16(fn) and lo = bf16(fn - hi) (fn = hi + lo to about 2^-17) and held
// in registers as mma B fragments for the warp's k-range, for the whole item. Tokens go through in
// m-tiles of 16 (rows g and g + 8 per lane): the pieces are copied global -> shared with cp.async
// into a per-lane slot (only the lane that copies a piece reads it: no barrier), MHC_ST_* - 1
// m-tiles ahead, and each m-tile costs, per stream, two m16n8k16 mma for hi and two for lo per 8
// outputs (the lane's 8 h form two k16 halves: a k permutation applied alike to A and B). x^2 is
// the diagonal of X Xᵀ, by two more m16n8k16 per stream and k16 half with the lane's own pieces
// as B (the bf16 products are exact, the f32 sums in the tensor cores' order). The 8 warps'
// results per (token, value) are summed in warp order through shared memory, giving the (token,
// split) partial. Nothing depends on the token count or the tile: a row's partials are a function
// of its own data and H.
//
// Dynamic shared memory: one stage per m-tile of the item (8 warps x PC pieces x 2 rows x 32 lanes
// x 16 bytes; PC = 4 streams, + x for the fused op), then two [8 warps][16 rows][V] f32 reduction
// buffers (plan.rs `resident_shared_bytes`).
#define MHC_MMA_WARPS (MHC_THREADS / 32)
#ifndef MHC_TUNE
#define MHC_ST_HEAD 3
#define MHC_ST_PRE 4
#define MHC_ST_FUSED 4
#define MHC_ST_STREAM_PRE 3    // the streamed projection's ring (plan.rs `stream_stages`)
#define MHC_ST_STREAM_FUSED 4
#endif

template <int ST, int PC, int V>
struct MhcMmaSmem {
    static constexpr uint32_t warp_bytes = PC * 2 * 32 * 16;
    static constexpr uint32_t stage_bytes = warp_bytes * MHC_MMA_WARPS;
    static constexpr uint32_t bytes = ST * stage_bytes + 2 * MHC_MMA_WARPS * 16 * V * 4;
};

__device__ __forceinline__ uint32_t mhc_dynamic_smem() {
    uint32_t r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// The 8 h at h0 of `row` (zero past H, or all zero if !valid) into the lane's shared slot `dst`.
// PF: the copy asks L2 for the whole 256-byte block (the block's other warps read its neighbours).
template <bool VEC, bool PF = false>
__device__ __forceinline__ void mhc_piece(uint32_t dst, const hf_bf16* row, const hf_bf16* safe, uint32_t h0,
                                          uint32_t H, bool valid) {
    if (VEC) {
        hf_cp_async16<PF>(dst, valid ? (const void*)(row + h0) : (const void*)safe, valid ? 16u : 0u);
    } else {
        const mhc_u32x4 u = valid ? mhc_load8<false>(row, h0, H) : mhc_u32x4{0u, 0u, 0u, 0u};
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
                     : "memory");
    }
}

__device__ __forceinline__ mhc_u32x4 mhc_lds16(uint32_t a) {
    mhc_u32x4 u;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "r"(a)
                 : "memory");
    return u;
}

__device__ __forceinline__ void mhc_sts16(uint32_t a, mhc_u32x4 u) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w) : "memory");
}

// Copies the pieces of m-tile tokens [tm, tm + 16) for this lane: piece p = 2 c + rr is stream c
// (c = 4: x, fused only) of token tm + g + 8 rr, at slot + 512 p.
template <int PC, bool VEC, bool PF = false>
__device__ __forceinline__ void mhc_mma_issue(uint32_t slot, const hf_bf16* residual, const hf_bf16* x_in,
                                              uint32_t H, uint32_t tm, uint32_t t_end, uint32_t g, uint32_t h0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const uint64_t t = tm + g + 8 * rr;
        const bool valid = t < t_end && h0 < H;
#pragma unroll
        for (int c = 0; c < MHC_N; ++c)
            mhc_piece<VEC, PF>(slot + 512u * (2 * c + rr), valid ? residual + (t * MHC_N + c) * H : residual,
                               residual, h0, H, valid);
        if (PC > MHC_N)
            mhc_piece<VEC, PF>(slot + 512u * (2 * MHC_N + rr), valid ? x_in + t * H : x_in, x_in, h0, H, valid);
    }
}

// The resident mhc_pre / fused items also keep a copy of each (token, split)'s gate partials (the
// sum of squares and the n pre dots) as rows [T][1 + n][S_pad] after the partials of T tokens (at
// a 16-byte boundary), so a gate loads its token's splits with 16-byte loads (MhcOps sizes the
// workspace for it: plan.rs `workspace_floats`).
template <int V>
__device__ __forceinline__ float* mhc_gate_copy(float* partials, uint32_t T, uint32_t S) {
    return partials + ((((uint64_t)T * S * V) + 3u) & ~(uint64_t)3u);
}

// VEC: 16-byte copies and loads (H % 8 == 0, aligned pointers), else element loads; the same
// values either way, so the same bits (a template parameter, so each executed path is one straight
// run of instructions: at decode sizes the kernel's time goes to fetching them).
// Every m-tile keeps its own stage (`stages` of them): the item's pieces stay in shared memory for
// its outputs, the fused op's replaced by the post-mixed streams. ST - 1 m-tiles are in flight.
// RING (the streamed projection pass): the m-tiles cycle through ST stages instead (m-tile m in
// stage m % ST), and the fused op's post-mixed pieces go straight to residual_out; the arithmetic
// is the same, so are the partials.
template <int J, int ST, bool FUSED, bool VEC, bool RING = false>
__device__ void mhc_project_mma(const hf_bf16* __restrict__ residual, const hf_bf16* __restrict__ x_in,
                                const float* __restrict__ post_in, const float* __restrict__ comb_in,
                                const float* __restrict__ fn, float* __restrict__ partials, uint32_t H, uint32_t S,
                                uint32_t split, uint32_t t_begin, uint32_t t_end, uint32_t stages,
                                float* __restrict__ gcopy = nullptr, hf_bf16* __restrict__ residual_out = nullptr) {
    constexpr int V = J + 1;
    constexpr int NT = (J + 7) / 8;
    constexpr int PC = FUSED ? MHC_N + 1 : MHC_N;
    using Smem = MhcMmaSmem<ST, PC, V>;
    extern __shared__ __align__(16) unsigned char mhc_dyn[];
    float* red = reinterpret_cast<float*>(mhc_dyn + stages * Smem::stage_bytes);  // [2][8][16][V]
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const uint32_t h0 = split * MHC_SPLIT_H + warp * 32 + q * 8;
    const uint32_t D = MHC_N * H;
    const uint32_t slot = hf_smem_addr(mhc_dyn) + warp * Smem::warp_bytes + lane * 16;
    const uint32_t M = (t_end - t_begin + 15) / 16;

    // The first m-tiles' copies go out before the weights are read.
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if ((uint32_t)s < M)
            mhc_mma_issue<PC, VEC, RING>(slot + s * Smem::stage_bytes, residual, x_in, H, t_begin + 16 * s, t_end, g,
                                         h0);
        hf_cp_async_commit();
    }

    // B fragments: column n = 8 nt + g, the lane's 8 k of stream c; word w holds elements 2w, 2w+1.
    uint32_t bhi[MHC_N][NT][4], blo[MHC_N][NT][4];
#pragma unroll
    for (int c = 0; c < MHC_N; ++c)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint32_t n = nt * 8 + g;
            float f[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (n < (uint32_t)J && h0 < H) {
                const float* src = fn + (uint64_t)n * D + (uint64_t)c * H + h0;
                mhc_load_f8<VEC>(src, VEC ? 8u : H - h0, f);
            }
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const uint32_t hi = hf_pack_bf16x2_any_nan(f[2 * w], f[2 * w + 1]);
                bhi[c][nt][w] = hi;
                blo[c][nt][w] = hf_pack_bf16x2_any_nan(f[2 * w] - mhc_lo(hi), f[2 * w + 1] - mhc_hi(hi));
            }
        }

#pragma unroll 1
    for (uint32_t m = 0; m < M; ++m) {
        {
            const uint32_t nm = m + ST - 1;
            if (nm < M)
                mhc_mma_issue<PC, VEC, RING>(slot + (RING ? nm % ST : nm) * Smem::stage_bytes, residual, x_in, H,
                                             t_begin + 16 * nm, t_end, g, h0);
            hf_cp_async_commit();
        }
        hf_cp_async_wait<ST - 1>();
        const uint32_t base = slot + (RING ? m % ST : m) * Smem::stage_bytes;
        const uint32_t tm = t_begin + 16 * m;
        mhc_u32x4 p[MHC_N][2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
            for (int c = 0; c < MHC_N; ++c) p[c][rr] = mhc_lds16(base + 512u * (2 * c + rr));
            if (FUSED) {
                const uint64_t t = tm + g + 8 * rr;
                if (t < t_end) {
                    float coef[MHC_N + MHC_N * MHC_N];
#pragma unroll
                    for (int i = 0; i < MHC_N; ++i) coef[i] = post_in[t * MHC_N + i];
#pragma unroll
                    for (int i = 0; i < MHC_N * MHC_N; ++i) coef[MHC_N + i] = comb_in[t * MHC_N * MHC_N + i];
                    mhc_u32x4 ru[MHC_N], mixed[MHC_N];
#pragma unroll
                    for (int c = 0; c < MHC_N; ++c) ru[c] = p[c][rr];
                    mhc_post_mix(mhc_lds16(base + 512u * (2 * MHC_N + rr)), ru, coef, mixed);
#pragma unroll
                    for (int c = 0; c < MHC_N; ++c) {
                        p[c][rr] = mixed[c];
                        if (!RING)
                            mhc_sts16(base + 512u * (2 * c + rr), mixed[c]);
                        else if (h0 < H)
                            mhc_store8<VEC>(residual_out + (t * MHC_N + c) * H, h0, H, mixed[c]);
                    }
                }
            }
        }
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        // Σx² of the warp's 128 k per token on the tensor cores too: X·Xᵀ of the m-tile, whose B
        // fragments are the lane's own A pieces (row g of rows 0-7, then of rows 8-15); token g's
        // sum is diagonal element (g, g) of the first, token g + 8's (g + 8, g) of the second,
        // both held by lane (g, q = g / 2).
        float sq[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int c = 0; c < MHC_N; ++c) {
            const uint32_t a0[4] = {p[c][0].x, p[c][1].x, p[c][0].y, p[c][1].y};
            const uint32_t a1[4] = {p[c][0].z, p[c][1].z, p[c][0].w, p[c][1].w};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                hf_mma_bf16(acc[nt], a0, bhi[c][nt][0], bhi[c][nt][1]);
                hf_mma_bf16(acc[nt], a1, bhi[c][nt][2], bhi[c][nt][3]);
                hf_mma_bf16(acc[nt], a0, blo[c][nt][0], blo[c][nt][1]);
                hf_mma_bf16(acc[nt], a1, blo[c][nt][2], blo[c][nt][3]);
            }
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                hf_mma_bf16(sq[rr], a0, p[c][rr].x, p[c][rr].y);
                hf_mma_bf16(sq[rr], a1, p[c][rr].z, p[c][rr].w);
            }
        }
        const bool odd = (g & 1u) != 0u;
        const float ss[2] = {odd ? sq[0][1] : sq[0][0], odd ? sq[1][3] : sq[1][2]};
        const bool holds_ss = q == (g >> 1);
        float* r = red + ((m & 1) * MHC_MMA_WARPS + warp) * 16 * V;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const uint32_t n = nt * 8 + 2 * q + e;
                if (n < (uint32_t)J) {
                    r[g * V + 1 + n] = acc[nt][e];
                    r[(g + 8) * V + 1 + n] = acc[nt][2 + e];
                }
            }
        if (holds_ss) {
            r[g * V] = ss[0];
            r[(g + 8) * V] = ss[1];
        }
        __syncthreads();
        const float* rb = red + (m & 1) * MHC_MMA_WARPS * 16 * V;
        for (uint32_t idx = threadIdx.x; idx < 16u * V; idx += MHC_THREADS) {
            const uint32_t row = idx / V, v = idx % V;
            const uint64_t t = tm + row;
            if (t < t_end) {
                float a = rb[row * V + v];
#pragma unroll
                for (int w = 1; w < MHC_MMA_WARPS; ++w) a = a + rb[(w * 16 + row) * V + v];
                partials[(t * S + split) * V + v] = a;
                if (gcopy != nullptr && v <= MHC_N) gcopy[(t * (1 + MHC_N) + v) * mhc_split_pad(S) + split] = a;
            }
        }
    }
    hf_cp_async_wait_all();
}
#endif

// Split sums of tokens [t0, t0 + count) into s_sum[u][v], in split order (no barrier: the caller
// syncs before reading s_sum). The partials were written by other blocks during this launch:
// loads from L2 (never a stale L1 line), MHC_SUM_BATCH of them issued before the first add, so a
// split count up to that (H <= 4096) costs one round trip.
#define MHC_SUM_BATCH 16
// Partials other blocks wrote during this launch, indexed as an array (mhc_ldcg).
struct MhcFresh {
    const float* p;
    __device__ __forceinline__ float operator[](uint64_t i) const { return mhc_ldcg(p + i); }
};
template <int V>
__device__ __noinline__ void mhc_split_sums(const float* partials, uint32_t S, uint32_t t0, uint32_t count,
                                               float (*s_sum)[32]) {
    for (uint32_t idx = threadIdx.x; idx < count * V; idx += MHC_THREADS) {
        const uint32_t u = idx / V, v = idx % V;
        const MhcFresh p{partials + (uint64_t)(t0 + u) * S * V + v};
        float a = 0.0f;
        for (uint32_t s0 = 0; s0 < S; s0 += MHC_SUM_BATCH) {
            float b[MHC_SUM_BATCH];
#pragma unroll
            for (int q = 0; q < MHC_SUM_BATCH; ++q) b[q] = (s0 + q < S) ? p[(uint64_t)(s0 + q) * V] : 0.0f;
#pragma unroll
            for (int q = 0; q < MHC_SUM_BATCH; ++q)
                if (s0 + q < S) a = (s0 + q == 0) ? b[q] : a + b[q];
        }
        s_sum[u][v] = a;
    }
}

// The block's buffer of split sums, [MHC_FINISH_MAX][32] (one static allocation, whichever
// path of a kernel asks for it).
__device__ __forceinline__ float (*mhc_sum_buffer())[32] {
    __shared__ float s_sum[MHC_FINISH_MAX][32];
    return s_sum;
}

__device__ __forceinline__ float mhc_rms_factor(float ss, uint32_t D, float eps) {
    return 1.0f / sqrtf(ss / (float)D + eps);
}

// A stream gate from the split sums of its token: sigmoid(dot · rms factor · scale + base) + eps
// (hc_head's gates, mhc_pre's pre gates). Every item that needs a gate computes it with this.
__device__ __forceinline__ float mhc_stream_gate(float ss, float dot, uint32_t H, float scale, float base,
                                                 float rms_eps, float eps) {
    const float r = mhc_rms_factor(ss, MHC_N * H, rms_eps);
    return mhc_sigmoid(fmaf(dot * r, scale, base)) + eps;
}

struct MhcPreArgs {
    const hf_bf16* x_in;      // fused only: sublayer output [T, H]
    const hf_bf16* residual;  // [T, n, H]
    const float* post_in;     // fused only: [T, n]
    const float* comb_in;     // fused only: [T, n, n]
    const float* fn;          // [n (n + 2), n H]
    const float* scale;       // [3]
    const float* base;        // [n (n + 2)]
    hf_bf16* residual_out;    // fused only: [T, n, H]
    float* post_out;          // [T, n]
    float* comb_out;          // [T, n, n]
    hf_bf16* layer_input;     // [T, H]
    float* partials;
    uint32_t* sync;
    uint32_t T, H, iters, tile_tokens, finish_tokens, resident;
    float rms_eps, pre_eps, sinkhorn_eps, post_mult;
};

// ---- hc_head -----------------------------------------------------------------------------------

// out[t] = sum_i gate[t][i] rows_i[t] for tokens [t0, t0 + count) (FUSED: rows = the post-mix of
// (x_in, residual) by coef, also stored to residual_out; else rows = residual), chunks [c0, c0 +
// chunks) of h (8 h each), MHC_FINISH_UNROLL chunks per thread in flight (all their loads go out
// before any store).
template <bool VEC, bool FUSED>
__device__ __forceinline__ void mhc_weighted_rows(const hf_bf16* residual,  // may be residual_out
                                                  const hf_bf16* __restrict__ x_in,
                                                  const float (*coef)[MHC_N + MHC_N * MHC_N],
                                                  hf_bf16* residual_out, const float (*gate)[MHC_N],
                                                  hf_bf16* __restrict__ out, uint32_t H, uint32_t t0,
                                                  uint32_t count, uint32_t c0, uint32_t chunks) {
    const uint32_t HC = chunks, total = count * HC;
    constexpr int PC = FUSED ? MHC_N + 1 : MHC_N;  // the streams, then x (fused)
    for (uint32_t i0 = threadIdx.x; i0 < total; i0 += MHC_THREADS * MHC_FINISH_UNROLL) {
        mhc_u32x4 src[MHC_FINISH_UNROLL][PC];
#pragma unroll
        for (int k = 0; k < MHC_FINISH_UNROLL; ++k) {
            const uint32_t idx = i0 + k * MHC_THREADS;
            if (idx < total) {
                const uint64_t t = t0 + idx / HC;
                const uint32_t h0 = (c0 + idx % HC) * MHC_CHUNK;
#pragma unroll
                for (int i = 0; i < MHC_N; ++i) src[k][i] = mhc_load8<VEC>(residual + (t * MHC_N + i) * H, h0, H);
                if (FUSED) src[k][PC - 1] = mhc_load8<VEC>(x_in + t * H, h0, H);
            }
        }
#pragma unroll
        for (int k = 0; k < MHC_FINISH_UNROLL; ++k) {
            const uint32_t idx = i0 + k * MHC_THREADS;
            if (idx >= total) continue;
            const uint32_t u = idx / HC, h0 = (c0 + idx % HC) * MHC_CHUNK;
            const uint64_t t = t0 + u;
            mhc_u32x4 rows[MHC_N];
#pragma unroll
            for (int i = 0; i < MHC_N; ++i) rows[i] = src[k][i];
            if (FUSED) {
                mhc_post_mix(src[k][PC - 1], src[k], coef[u], rows);
#pragma unroll
                for (int i = 0; i < MHC_N; ++i) mhc_store8<VEC>(residual_out + (t * MHC_N + i) * H, h0, H, rows[i]);
            }
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < MHC_N; ++i) {
                float v[8];
                mhc_unpack(rows[i], v);
                const float p = gate[u][i];
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, v[e], acc[e]);
            }
            mhc_store8<VEC>(out + t * H, h0, H, mhc_repack(acc));
        }
    }
}

// The gates of tokens [t0, t0 + count) into s_gate (then a barrier).
__device__ __forceinline__ void mhc_head_gates(const float* __restrict__ scale, const float* __restrict__ base,
                                               const float* partials, uint32_t H, uint32_t S, uint32_t t0,
                                               uint32_t count, float rms_eps, float hc_eps,
                                               float (*s_gate)[MHC_N]) {
    float (*s_sum)[32] = mhc_sum_buffer();
    mhc_split_sums<MHC_N + 1>(partials, S, t0, count, s_sum);
    __syncthreads();
    if (threadIdx.x < count * MHC_N) {
        const uint32_t u = threadIdx.x / MHC_N, i = threadIdx.x % MHC_N;
        s_gate[u][i] = mhc_stream_gate(s_sum[u][0], s_sum[u][1 + i], H, scale[0], base[i], rms_eps, hc_eps);
    }
    __syncthreads();
}

// The stream gates of tokens [t0, t0 + count) into s_gate (then a barrier), for any count a thread
// block covers: value 0 (sum of squares) and 1 + i of each token's partials (V values per split),
// each summed in split order with MHC_SUM_BATCH loads before the first add, as mhc_split_sums
// does, and the gate as mhc_stream_gate gives it: the bits of mhc_head_gates / mhc_pre_gates.
// FROM_TOP: the work goes to the block's threads from the last one down, so that loads the low
// threads issue just before (mhc_split_sums) are in flight together with these. COPY: the values
// load from the gate copy `gcopy` (mhc_gate_copy; 16-byte loads of a row's splits) instead.
template <int V, bool FROM_TOP = false, bool COPY = false>
__device__ __forceinline__ void mhc_tile_gates(const float* partials, uint32_t S, uint32_t t0, uint32_t count,
                                               uint32_t H, const float* __restrict__ scale,
                                               const float* __restrict__ base, float rms_eps, float eps,
                                               float (*s_gate)[MHC_N], const float* gcopy = nullptr) {
    const uint32_t tid = FROM_TOP ? MHC_THREADS - 1 - threadIdx.x : threadIdx.x;
    const uint32_t pad = mhc_split_pad(S);
    for (uint32_t idx = tid; idx < count * MHC_N; idx += MHC_THREADS) {
        const uint32_t u = idx / MHC_N, i = idx % MHC_N;
        const MhcFresh p{partials + (uint64_t)(t0 + u) * S * V};
        // The gate copy's rows of this gate (sum of squares, dot i), when there is one.
        const uint64_t row = (uint64_t)(t0 + u) * (1 + MHC_N);
        const float4* rs = reinterpret_cast<const float4*>(gcopy + row * pad);
        const float4* rd = reinterpret_cast<const float4*>(gcopy + (row + 1 + i) * pad);
        float ss = 0.0f, d = 0.0f;
        for (uint32_t s0 = 0; s0 < S; s0 += MHC_SUM_BATCH) {
            float bs[MHC_SUM_BATCH], bd[MHC_SUM_BATCH];
            if (COPY) {
#pragma unroll
                for (int j = 0; j < MHC_SUM_BATCH / 4; ++j) {
                    const bool in = s0 + 4 * j < S;
                    const float4 x = in ? mhc_ldcg4(rs + s0 / 4 + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    const float4 y = in ? mhc_ldcg4(rd + s0 / 4 + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    bs[4 * j] = x.x, bs[4 * j + 1] = x.y, bs[4 * j + 2] = x.z, bs[4 * j + 3] = x.w;
                    bd[4 * j] = y.x, bd[4 * j + 1] = y.y, bd[4 * j + 2] = y.z, bd[4 * j + 3] = y.w;
                }
            } else {
#pragma unroll
                for (int k = 0; k < MHC_SUM_BATCH; ++k) {
                    const bool in = s0 + k < S;
                    bs[k] = in ? p[(uint64_t)(s0 + k) * V] : 0.0f;
                    bd[k] = in ? p[(uint64_t)(s0 + k) * V + 1 + i] : 0.0f;
                }
            }
#pragma unroll
            for (int k = 0; k < MHC_SUM_BATCH; ++k)
                if (s0 + k < S) {
                    ss = (s0 + k == 0) ? bs[k] : ss + bs[k];
                    d = (s0 + k == 0) ? bd[k] : d + bd[k];
                }
        }
        s_gate[u][i] = mhc_stream_gate(ss, d, H, scale[0], base[i], rms_eps, eps);
    }
    __syncthreads();
}

// The tile's last item to leave resets its counter (S arrivals, then S departures) for the next
// launch.
__device__ __forceinline__ void mhc_leave(uint32_t* sync, uint32_t tile, uint32_t S) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const uint32_t d = atomicAdd(&sync[1 + 2 * tile], 1u);
        if (d == 2 * S - 1) atomicExch(&sync[1 + 2 * tile], 0u);
    }
}

template <bool VEC>
__device__ void mhc_head_finish(const hf_bf16* __restrict__ residual, const float* __restrict__ scale,
                                const float* __restrict__ base, hf_bf16* __restrict__ out,
                                const float* partials, uint32_t H, uint32_t S, uint32_t t0, uint32_t count,
                                float rms_eps, float hc_eps) {
    __shared__ float s_gate[MHC_FINISH_MAX][MHC_N];
    mhc_head_gates(scale, base, partials, H, S, t0, count, rms_eps, hc_eps, s_gate);
    mhc_weighted_rows<VEC, false>(residual, nullptr, nullptr, nullptr, s_gate, out, H, t0, count, 0u,
                                  (H + MHC_CHUNK - 1) / MHC_CHUNK);
}

// SELF (decode sizes, tiles of at most MHC_FINISH_MAX tokens): item (tile q, split s) = ticket q S
// + s projects its split, waits for the tile's S projections, computes the tile's gates from the
// partials and writes its own 256 h of every token, so no block reads whole rows; the outputs'
// arithmetic is the finish items', so the bits are the same.
template <bool VEC>
__device__ void mhc_head_body(const hf_bf16* residual, const float* fn, const float* scale, const float* base,
                              hf_bf16* out, float* partials, uint32_t* sync, uint32_t T, uint32_t H, float rms_eps,
                              float hc_eps, uint32_t tile_tokens, uint32_t finish_tokens, uint32_t ticket,
                              bool self) {
    const uint32_t S = (H + MHC_SPLIT_H - 1) / MHC_SPLIT_H;
    const uint32_t Q = (T + tile_tokens - 1) / tile_tokens;
    if (self) {
        const uint32_t q = ticket / S, split = ticket % S;
        const uint32_t t_begin = q * tile_tokens, t_end = min(T, t_begin + tile_tokens);
        mhc_project<MHC_N, MHC_SUB_HEAD, MHC_TT_HEAD, MHC_UNROLL_HEAD, VEC, false>(
            residual, nullptr, nullptr, nullptr, fn, partials, H, S, split, t_begin, t_end);
        mhc_arrive(sync, q);
        mhc_wait(sync, q, S);
        __shared__ float s_gate[MHC_FINISH_MAX][MHC_N];
        mhc_tile_gates<MHC_N + 1>(partials, S, t_begin, t_end - t_begin, H, scale, base, rms_eps, hc_eps, s_gate);
        const uint32_t HC = (H + MHC_CHUNK - 1) / MHC_CHUNK, c0 = split * (MHC_SPLIT_H / MHC_CHUNK);
        mhc_weighted_rows<VEC, false>(residual, nullptr, nullptr, nullptr, s_gate, out, H, t_begin, t_end - t_begin,
                                      c0, min(HC - c0, (uint32_t)(MHC_SPLIT_H / MHC_CHUNK)));
        mhc_leave(sync, q, S);
        return;
    }
    const uint32_t F = (tile_tokens + finish_tokens - 1) / finish_tokens;
    const MhcItem it = mhc_item(ticket, S, F, Q);
    const uint32_t t_begin = it.tile * tile_tokens;
    const uint32_t t_end = min(T, t_begin + tile_tokens);
    if (it.project) {
        mhc_project<MHC_N, MHC_SUB_HEAD, MHC_TT_HEAD, MHC_UNROLL_HEAD, VEC, false>(
            residual, nullptr, nullptr, nullptr, fn, partials, H, S, it.index, t_begin, t_end);
        mhc_arrive(sync, it.tile);
        return;
    }
    mhc_wait(sync, it.tile, S);
    const uint32_t t0 = t_begin + it.index * finish_tokens;
    const uint32_t count = t0 < t_end ? min(finish_tokens, t_end - t0) : 0u;
    mhc_head_finish<VEC>(residual, scale, base, out, partials, H, S, t0, count, rms_eps, hc_eps);
    mhc_depart(sync, it.tile, F);
}


// ---- mhc_pre and mhc_fused_post_pre --------------------------------------------------------------


// post and comb of tokens [t0, t0 + count) (count <= MHC_FINISH_MAX) into the outputs from their
// split sums s_sum (all J + 1 values), and their pre gates into s_pre (when given). 16 lanes per
// token: lane l holds comb element (l / 4, l % 4); lanes 0..3 also pre and post. Only the warps
// that hold tokens take part (no barrier).
__device__ __forceinline__ void mhc_post_comb(const MhcPreArgs& a, uint32_t t0, uint32_t count,
                                              const float (*s_sum)[32], float (*s_pre)[MHC_N]) {
    constexpr uint32_t L = MHC_N * MHC_N;
    if (threadIdx.x / 32 >= (count * L + 31) / 32) return;  // warp-uniform
    const uint32_t u = threadIdx.x / L, l = threadIdx.x % L;
    const bool valid = u < count;
    const float ss = valid ? s_sum[u][0] : 1.0f;
    const float r = mhc_rms_factor(ss, MHC_N * a.H, a.rms_eps);
    const float m = valid ? s_sum[u][1 + 2 * MHC_N + l] : 0.0f;
    float c = fmaf(m * r, a.scale[2], a.base[2 * MHC_N + l]);
    c = mhc_sinkhorn(c, a.iters, a.sinkhorn_eps);
    if (valid) {
        const uint64_t t = t0 + u;
        a.comb_out[t * L + l] = c;
        if (l < MHC_N) {
            const float pre = mhc_stream_gate(ss, s_sum[u][1 + l], a.H, a.scale[0], a.base[l], a.rms_eps, a.pre_eps);
            const float post = mhc_sigmoid(fmaf(s_sum[u][1 + MHC_N + l] * r, a.scale[1], a.base[MHC_N + l])) * a.post_mult;
            if (s_pre != nullptr) s_pre[u][l] = pre;
            a.post_out[t * MHC_N + l] = post;
        }
    }
}

// post and comb of tokens [t0, t0 + count) into the outputs and their pre gates into s_pre (then a
// barrier).
__device__ __forceinline__ void mhc_pre_gates(const MhcPreArgs& a, uint32_t S, uint32_t t0, uint32_t count,
                                              float (*s_pre)[MHC_N]) {
    constexpr int J = MHC_N * (MHC_N + 2);
    float (*s_sum)[32] = mhc_sum_buffer();
    mhc_split_sums<J + 1>(a.partials, S, t0, count, s_sum);
    __syncthreads();
    mhc_post_comb(a, t0, count, s_sum, s_pre);
    __syncthreads();
}

template <bool VEC, bool FUSED>
__device__ void mhc_pre_finish(const MhcPreArgs& a, uint32_t S, uint32_t t0, uint32_t count) {
    __shared__ float s_pre[MHC_FINISH_MAX][MHC_N];
    mhc_pre_gates(a, S, t0, count, s_pre);
    __shared__ float s_coef[MHC_FINISH_MAX][MHC_N + MHC_N * MHC_N];
    if (FUSED) {
        for (uint32_t idx = threadIdx.x; idx < count * (MHC_N + MHC_N * MHC_N); idx += MHC_THREADS) {
            const uint32_t u = idx / (MHC_N + MHC_N * MHC_N), q = idx % (MHC_N + MHC_N * MHC_N);
            const uint64_t t = t0 + u;
            s_coef[u][q] = q < MHC_N ? a.post_in[t * MHC_N + q] : a.comb_in[t * MHC_N * MHC_N + (q - MHC_N)];
        }
    }
    __syncthreads();
    mhc_weighted_rows<VEC, FUSED>(a.residual, a.x_in, s_coef, a.residual_out, s_pre, a.layer_input, a.H, t0, count,
                                  0u, (a.H + MHC_CHUNK - 1) / MHC_CHUNK);
}

#if defined(HF_HAS_MMA)
// ---- resident items (tensor cores): no finish items, no second read of the residual -------------
//
// Selected by finish_tokens = 0. Item (tile q, split s) = ticket q S + s; grid = tiles x S. The item
// projects its tile's tokens over its split with every m-tile's pieces kept in shared memory, so
// once all partials of the tile are written (one barrier among the tile's S items: a spin on
// counter 1 + 2q) every item sums the stream-gate partials of the tile's tokens in split order
// itself (the same sums and the same gate arithmetic as the finish items, so the same bits in every
// item) and writes its own 256 h of the outputs from the resident pieces. Only then does item s
// compute post and comb (mhc_pre; Sinkhorn) for its share of the tile's tokens (ceil(tile / S) <= 16
// of them), so no item waits for another's Sinkhorn; the share's partials load in the same round
// trip as the gates' (other threads of the block). The items of a tile hold consecutive tickets
// and tickets are claimed by resident blocks, so a tile's items can all be resident as long as the
// device holds S blocks at once (the host takes this path only where it holds at least 2 S). The
// counter counts S arrivals then S departures; the last item to leave resets it.
// Outputs use the finish items' arithmetic (gates, then the same fma chain per element).

// Largest resident tile per kernel (plan.rs: Reduce::resident_tile_max): hc_head 32, mhc_pre 96,
// the fused op 64; s_tile is sized by it.
template <int J, bool FUSED>
struct MhcResTile {
    static constexpr uint32_t max = J == MHC_N ? 32u : (FUSED ? 64u : 96u);
};

template <int J, bool FUSED>
__device__ __forceinline__ bool mhc_resident_launch_ok(uint32_t T, uint32_t S, uint32_t tile) {
    using Smem = MhcMmaSmem<1, FUSED ? MHC_N + 1 : MHC_N, J + 1>;
    const uint32_t need = ((tile + 15) / 16) * Smem::stage_bytes + (Smem::bytes - Smem::stage_bytes);
    const uint32_t Q = (T + tile - 1) / tile;
    return tile <= MhcResTile<J, FUSED>::max && tile <= 16 * S && gridDim.x == Q * S && mhc_dynamic_smem() >= need;
}

template <int J, bool FUSED, bool VEC>
__device__ void mhc_resident_item(const MhcPreArgs& a, uint32_t ticket) {
    constexpr int V = J + 1;
    constexpr bool HEAD = J == MHC_N;
    using Smem = MhcMmaSmem<1, FUSED ? MHC_N + 1 : MHC_N, V>;
    const uint32_t H = a.H, S = (H + MHC_SPLIT_H - 1) / MHC_SPLIT_H;
    const uint32_t q = ticket / S, split = ticket % S;
    const uint32_t t_begin = q * a.tile_tokens, t_end = min(a.T, t_begin + a.tile_tokens);
    const uint32_t count = t_end - t_begin, M = (count + 15) / 16;
    float* gcopy = HEAD ? nullptr : mhc_gate_copy<V>(a.partials, a.T, S);
    mhc_project_mma<J, HEAD ? MHC_ST_HEAD : (FUSED ? MHC_ST_FUSED : MHC_ST_PRE), FUSED, VEC>(
        a.residual, a.x_in, a.post_in, a.comb_in, a.fn, a.partials, H, S, split, t_begin, t_end,
        (a.tile_tokens + 15) / 16, gcopy);
    mhc_arrive(a.sync, q);
    mhc_wait(a.sync, q, S);

    // The split sums of this item's share of the tile's tokens for post and comb (mhc_pre; at most
    // 16 tokens) load from the low threads while the tile's stream gates load from the high ones,
    // so both sets of loads are in flight at once; one barrier covers the two.
    float (*s_sum)[32] = mhc_sum_buffer();
    const uint32_t per = (count + S - 1) / S, g0 = t_begin + split * per;
    const uint32_t gc = HEAD || g0 >= t_end ? 0u : min(per, t_end - g0);
    if (gc > 0) mhc_split_sums<V>(a.partials, S, g0, gc, s_sum);
    __shared__ float s_tile[MhcResTile<J, FUSED>::max][MHC_N];
    mhc_tile_gates<V, true, !HEAD>(a.partials, S, t_begin, count, H, a.scale, a.base, a.rms_eps, a.pre_eps, s_tile,
                                   gcopy);
    extern __shared__ __align__(16) unsigned char mhc_dyn[];
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, qd = lane % 4;
    const uint32_t h0 = split * MHC_SPLIT_H + warp * 32 + qd * 8;
    const uint32_t slot = hf_smem_addr(mhc_dyn) + warp * Smem::warp_bytes + lane * 16;
    if (h0 < H) {
        for (uint32_t m = 0; m < M; ++m) {
            const uint32_t base = slot + m * Smem::stage_bytes;
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const uint32_t u = 16 * m + g + 8 * rr;
                if (u >= count) continue;
                const uint64_t t = t_begin + u;
                float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int i = 0; i < MHC_N; ++i) {
                    const mhc_u32x4 piece = mhc_lds16(base + 512u * (2 * i + rr));
                    if (FUSED) {
                        hf_bf16* row = a.residual_out + (t * MHC_N + i) * H;
                        mhc_store8<VEC>(row, h0, H, piece);
                    }
                    float v[8];
                    mhc_unpack(piece, v);
                    const float gi = s_tile[u][i];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[e] = fmaf(gi, v[e], acc[e]);
                }
                mhc_store8<VEC>(a.layer_input + t * H, h0, H, mhc_repack(acc));
            }
        }
    }
    // Post and comb (Sinkhorn) of this item's share of the tile's tokens.
    if (gc > 0) mhc_post_comb(a, g0, gc, s_sum, nullptr);
    mhc_leave(a.sync, q, S);
}
#endif

#if defined(HF_HAS_MMA)
// ---- two passes (tensor cores, large T): a streamed projection, then finish blocks ---------------
//
// Where a tile's items would spend more time on their fixed phases (the `fn` fragments, the tile
// barrier, the gates' round trips) than on their bytes, mhc_pre and the fused op run as two
// launches that read the residual twice but never wait for each other inside a launch:
//   1. the projection pass (MHC_STREAM): gridDim.x = S · per blocks (at most one per
//      multiprocessor); block b takes split b / per and the (b % per)-th of `per` equal runs of
//      the M m-tiles of 16 tokens. It loads its split's `fn` fragments once and streams its
//      m-tiles through a ring of ST stages, writing each (token, split)'s partials exactly as the
//      resident items do (same fragments, same MMA order, same cross-warp sums: the same bits);
//      the fused op also writes the post-mixed streams to residual_out.
//   2. mhc_pre_finish_n4: block (g, p) takes tokens [16 g, 16 g + 16) and the p-th of gridDim.y
//      equal runs of 8-h chunks; it sums the tokens' partials in split order, computes the pre
//      gates (block p = 0 also post and comb, Sinkhorn) and writes its chunks of layer_input from
//      the (post-mixed) residual, with the finish items' arithmetic: the bits of the resident
//      items again, so a token's outputs do not depend on which path T selects.
template <int J, bool FUSED, bool VEC>
__device__ void mhc_stream_project(const MhcPreArgs& a) {
    constexpr int ST = FUSED ? MHC_ST_STREAM_FUSED : MHC_ST_STREAM_PRE;
    const uint32_t S = (a.H + MHC_SPLIT_H - 1) / MHC_SPLIT_H, M = (a.T + 15) / 16;
    const uint32_t per = gridDim.x / S, split = blockIdx.x / per, k = blockIdx.x % per;
    const uint32_t m0 = (uint32_t)((uint64_t)M * k / per), m1 = (uint32_t)((uint64_t)M * (k + 1) / per);
    if (split >= S || m0 >= m1) return;
    mhc_project_mma<J, ST, FUSED, VEC, true>(a.residual, a.x_in, a.post_in, a.comb_in, a.fn, a.partials, a.H, S, split,
                                             16 * m0, min(a.T, 16 * m1), ST, nullptr, a.residual_out);
}

template <bool FUSED>
__device__ __forceinline__ bool mhc_stream_launch_ok() {
    using Smem = MhcMmaSmem<FUSED ? MHC_ST_STREAM_FUSED : MHC_ST_STREAM_PRE, FUSED ? MHC_N + 1 : MHC_N,
                            MHC_N * (MHC_N + 2) + 1>;
    return mhc_dynamic_smem() >= Smem::bytes;
}
#endif

template <bool VEC, bool FUSED>
__device__ void mhc_pre_body(const MhcPreArgs& a, uint32_t ticket) {
    constexpr int J = MHC_N * (MHC_N + 2);
    const uint32_t S = (a.H + MHC_SPLIT_H - 1) / MHC_SPLIT_H;
    const uint32_t Q = (a.T + a.tile_tokens - 1) / a.tile_tokens;
    const uint32_t F = (a.tile_tokens + a.finish_tokens - 1) / a.finish_tokens;
    const MhcItem it = mhc_item(ticket, S, F, Q);
    const uint32_t t_begin = it.tile * a.tile_tokens;
    const uint32_t t_end = min(a.T, t_begin + a.tile_tokens);
    if (it.project) {
        mhc_project<J, MHC_SUB_PRE, FUSED ? MHC_TT_FUSED : MHC_TT_PRE, FUSED ? MHC_UNROLL_FUSED : MHC_UNROLL_PRE, VEC,
                    FUSED>(a.residual, a.x_in, a.post_in, a.comb_in, a.fn, a.partials, a.H, S, it.index, t_begin,
                           t_end);
        mhc_arrive(a.sync, it.tile);
        return;
    }
    mhc_wait(a.sync, it.tile, S);
    const uint32_t t0 = t_begin + it.index * a.finish_tokens;
    const uint32_t count = t0 < t_end ? min(a.finish_tokens, t_end - t0) : 0u;
    mhc_pre_finish<VEC, FUSED>(a, S, t0, count);
    mhc_depart(a.sync, it.tile, F);
}

template <bool FUSED>
__device__ __forceinline__ void mhc_pre_entry(const MhcPreArgs& a) {
    const uint32_t S = (a.H + MHC_SPLIT_H - 1) / MHC_SPLIT_H;
    if (a.T == 0 || a.tile_tokens == 0) return;  // host bug: never hang
    const uint32_t Q = (a.T + a.tile_tokens - 1) / a.tile_tokens;
    bool vec = (a.H % MHC_CHUNK == 0) && mhc_aligned16(a.residual) && mhc_aligned16(a.fn) && mhc_aligned16(a.layer_input);
    if (FUSED) vec = vec && mhc_aligned16(a.x_in) && mhc_aligned16(a.residual_out);
#if defined(HF_HAS_MMA)
    constexpr int J = MHC_N * (MHC_N + 2);
    if (a.finish_tokens == 0 && (a.resident & MHC_STREAM) != 0u) {
        if (!mhc_stream_launch_ok<FUSED>()) return;
        if (vec)
            mhc_stream_project<J, FUSED, true>(a);
        else
            mhc_stream_project<J, FUSED, false>(a);
        return;
    }
    if (a.finish_tokens == 0) {
        if (!mhc_resident_launch_ok<J, FUSED>(a.T, S, a.tile_tokens)) return;
        const uint32_t ticket = mhc_claim(a.sync, a.resident);
        if (vec)
            mhc_resident_item<J, FUSED, true>(a, ticket);
        else
            mhc_resident_item<J, FUSED, false>(a, ticket);
        return;
    }
#endif
    if (a.finish_tokens == 0 || a.finish_tokens > MHC_FINISH_MAX) return;
    const uint32_t F = (a.tile_tokens + a.finish_tokens - 1) / a.finish_tokens;
    if (gridDim.x != Q * (S + F)) return;
    const uint32_t ticket = mhc_claim(a.sync, a.resident);
    if (vec)
        mhc_pre_body<true, FUSED>(a, ticket);
    else
        mhc_pre_body<false, FUSED>(a, ticket);
}

// out [T, H] = sum_i g_i residual[t, i, :], g = sigmoid(rms(x) (x . fn^T) scale + base) + hc_eps.
HF_KERNEL void __launch_bounds__(MHC_THREADS, MHC_BLOCKS_HEAD) mhc_hc_head_n4(
    const hf_bf16* residual, const float* fn, const float* scale, const float* base, hf_bf16* out, float* partials,
    uint32_t* sync, uint32_t T, uint32_t H, float rms_eps, float hc_eps, uint32_t tile_tokens, uint32_t finish_tokens,
    uint32_t resident) {
    hf_dependent_kernel_start();
    const uint32_t S = (H + MHC_SPLIT_H - 1) / MHC_SPLIT_H;
    if (T == 0 || tile_tokens == 0) return;  // host bug: never hang
    const uint32_t Q = (T + tile_tokens - 1) / tile_tokens;
    const bool vec = (H % MHC_CHUNK == 0) && mhc_aligned16(residual) && mhc_aligned16(fn) && mhc_aligned16(out);
#if defined(HF_HAS_MMA)
    if (finish_tokens == 0) {
        if (!mhc_resident_launch_ok<MHC_N, false>(T, S, tile_tokens)) return;
        MhcPreArgs a = {};
        a.residual = residual; a.fn = fn; a.scale = scale; a.base = base; a.layer_input = out;
        a.partials = partials; a.sync = sync; a.T = T; a.H = H; a.tile_tokens = tile_tokens;
        a.resident = resident; a.rms_eps = rms_eps; a.pre_eps = hc_eps;
        const uint32_t ticket = mhc_claim(sync, resident);
        if (vec)
            mhc_resident_item<MHC_N, false, true>(a, ticket);
        else
            mhc_resident_item<MHC_N, false, false>(a, ticket);
        return;
    }
#endif
    if (finish_tokens == 0 || finish_tokens > MHC_FINISH_MAX) return;
    const bool self = (resident & MHC_SELF_FINISH) != 0u;
    const uint32_t F = (tile_tokens + finish_tokens - 1) / finish_tokens;
    if (self ? (tile_tokens > MHC_FINISH_MAX || gridDim.x != Q * S) : gridDim.x != Q * (S + F)) return;
    const uint32_t ticket = mhc_claim(sync, resident);
    if (vec)
        mhc_head_body<true>(residual, fn, scale, base, out, partials, sync, T, H, rms_eps, hc_eps, tile_tokens,
                            finish_tokens, ticket, self);
    else
        mhc_head_body<false>(residual, fn, scale, base, out, partials, sync, T, H, rms_eps, hc_eps, tile_tokens,
                             finish_tokens, ticket, self);
}

// (post [T, n], comb [T, n, n], layer_input [T, H]) = mhc_pre(residual [T, n, H]).
HF_KERNEL void __launch_bounds__(MHC_THREADS, MHC_BLOCKS_PRE) mhc_pre_n4(
    const hf_bf16* residual, const float* fn, const float* scale, const float* base, float* post_out, float* comb_out,
    hf_bf16* layer_input, float* partials, uint32_t* sync, uint32_t T, uint32_t H, float rms_eps, float pre_eps,
    float sinkhorn_eps, float post_mult, uint32_t iters, uint32_t tile_tokens, uint32_t finish_tokens,
    uint32_t resident) {
    hf_dependent_kernel_start();
    MhcPreArgs a;
    a.x_in = nullptr; a.residual = residual; a.post_in = nullptr; a.comb_in = nullptr;
    a.fn = fn; a.scale = scale; a.base = base; a.residual_out = nullptr;
    a.post_out = post_out; a.comb_out = comb_out; a.layer_input = layer_input; a.partials = partials; a.sync = sync;
    a.T = T; a.H = H; a.iters = iters; a.tile_tokens = tile_tokens; a.finish_tokens = finish_tokens;
    a.resident = resident;
    a.rms_eps = rms_eps; a.pre_eps = pre_eps; a.sinkhorn_eps = sinkhorn_eps; a.post_mult = post_mult;
    mhc_pre_entry<false>(a);
}

// residual_out = mhc_post(x, residual, post_in, comb_in); (post_out, comb_out, layer_input) =
// mhc_pre(residual_out). residual_out may be residual itself (in place).
HF_KERNEL void __launch_bounds__(MHC_THREADS, MHC_BLOCKS_FUSED) mhc_fused_post_pre_n4(
    const hf_bf16* x_in, const hf_bf16* residual, const float* post_in, const float* comb_in, const float* fn,
    const float* scale, const float* base, hf_bf16* residual_out, float* post_out, float* comb_out,
    hf_bf16* layer_input, float* partials, uint32_t* sync, uint32_t T, uint32_t H, float rms_eps, float pre_eps,
    float sinkhorn_eps, float post_mult, uint32_t iters, uint32_t tile_tokens, uint32_t finish_tokens,
    uint32_t resident) {
    hf_dependent_kernel_start();
    MhcPreArgs a;
    a.x_in = x_in; a.residual = residual; a.post_in = post_in; a.comb_in = comb_in;
    a.fn = fn; a.scale = scale; a.base = base; a.residual_out = residual_out;
    a.post_out = post_out; a.comb_out = comb_out; a.layer_input = layer_input; a.partials = partials; a.sync = sync;
    a.T = T; a.H = H; a.iters = iters; a.tile_tokens = tile_tokens; a.finish_tokens = finish_tokens;
    a.resident = resident;
    a.rms_eps = rms_eps; a.pre_eps = pre_eps; a.sinkhorn_eps = sinkhorn_eps; a.post_mult = post_mult;
    mhc_pre_entry<true>(a);
}

// The second pass after a streamed projection (MHC_STREAM): (post [T, n], comb [T, n, n],
// layer_input [T, H]) from the partials and the residual [T, n, H] (the fused op's residual_out).
// Grid (ceil(T / 16), parts): block (g, p) owns tokens [16 g, 16 g + 16) and the p-th run of 8-h
// chunks.
HF_KERNEL void __launch_bounds__(MHC_THREADS, MHC_BLOCKS_FINISH) mhc_pre_finish_n4(
    const hf_bf16* residual, const float* scale, const float* base, float* post_out, float* comb_out,
    hf_bf16* layer_input, const float* partials, uint32_t T, uint32_t H, float rms_eps, float pre_eps,
    float sinkhorn_eps, float post_mult, uint32_t iters) {
    hf_dependent_kernel_start();
    constexpr int J = MHC_N * (MHC_N + 2);
    const uint32_t t0 = blockIdx.x * MHC_FINISH_MAX;
    if (t0 >= T || H == 0) return;
    MhcPreArgs a = {};
    a.residual = residual; a.scale = scale; a.base = base; a.post_out = post_out; a.comb_out = comb_out;
    a.layer_input = layer_input; a.partials = const_cast<float*>(partials); a.T = T; a.H = H; a.iters = iters;
    a.rms_eps = rms_eps; a.pre_eps = pre_eps; a.sinkhorn_eps = sinkhorn_eps; a.post_mult = post_mult;
    const uint32_t S = (H + MHC_SPLIT_H - 1) / MHC_SPLIT_H, count = min((uint32_t)MHC_FINISH_MAX, T - t0);
    const uint32_t HC = (H + MHC_CHUNK - 1) / MHC_CHUNK, P = gridDim.y, p = blockIdx.y;
    const uint32_t c0 = (uint32_t)((uint64_t)HC * p / P), c1 = (uint32_t)((uint64_t)HC * (p + 1) / P);
    __shared__ float s_pre[MHC_FINISH_MAX][MHC_N];
    if (p == 0)
        mhc_pre_gates(a, S, t0, count, s_pre);
    else
        mhc_tile_gates<J + 1>(a.partials, S, t0, count, H, scale, base, rms_eps, pre_eps, s_pre);
    const bool vec = (H % MHC_CHUNK == 0) && mhc_aligned16(residual) && mhc_aligned16(layer_input);
    if (vec)
        mhc_weighted_rows<true, false>(residual, nullptr, nullptr, nullptr, s_pre, layer_input, H, t0, count, c0,
                                       c1 - c0);
    else
        mhc_weighted_rows<false, false>(residual, nullptr, nullptr, nullptr, s_pre, layer_input, H, t0, count, c0,
                                        c1 - c0);
}

// ---- mhc_post ----------------------------------------------------------------------------------

template <bool VEC>
__device__ __forceinline__ void mhc_post_body(const hf_bf16* x, const hf_bf16* residual, const float* post,
                                              const float* comb, hf_bf16* out, uint32_t T, uint32_t H,
                                              uint32_t tokens_per_block) {
    const uint32_t HC = (H + MHC_CHUNK - 1) / MHC_CHUNK;
    const uint32_t c = blockIdx.x * MHC_POST_THREADS + threadIdx.x;
    if (c >= HC) return;
    const uint32_t h0 = c * MHC_CHUNK;
    const uint32_t t_begin = blockIdx.y * tokens_per_block;
    const uint32_t t_end = min(T, t_begin + tokens_per_block);
    for (uint32_t t = t_begin; t < t_end; ++t) {
        float coef[MHC_N + MHC_N * MHC_N];
#pragma unroll
        for (int i = 0; i < MHC_N; ++i) coef[i] = post[(uint64_t)t * MHC_N + i];
#pragma unroll
        for (int i = 0; i < MHC_N * MHC_N; ++i) coef[MHC_N + i] = comb[(uint64_t)t * MHC_N * MHC_N + i];
        mhc_u32x4 ru[MHC_N], o[MHC_N];
#pragma unroll
        for (int i = 0; i < MHC_N; ++i) ru[i] = mhc_load8<VEC>(residual + ((uint64_t)t * MHC_N + i) * H, h0, H);
        mhc_post_mix(mhc_load8<VEC>(x + (uint64_t)t * H, h0, H), ru, coef, o);
#pragma unroll
        for (int j = 0; j < MHC_N; ++j) mhc_store8<VEC>(out + ((uint64_t)t * MHC_N + j) * H, h0, H, o[j]);
    }
}

// out [T, n, H]: out[t, j] = post[t, j] x[t] + sum_i comb[t, i, j] residual[t, i]. out may be
// residual itself (in place): each thread reads its chunk of every stream before writing it.
HF_KERNEL void __launch_bounds__(MHC_POST_THREADS) mhc_post_n4(
    const hf_bf16* x, const hf_bf16* residual, const float* post, const float* comb, hf_bf16* out, uint32_t T,
    uint32_t H, uint32_t tokens_per_block) {
    hf_dependent_kernel_start();
    const bool vec = (H % MHC_CHUNK == 0) && mhc_aligned16(x) && mhc_aligned16(residual) && mhc_aligned16(out);
    if (vec)
        mhc_post_body<true>(x, residual, post, comb, out, T, H, tokens_per_block);
    else
        mhc_post_body<false>(x, residual, post, comb, out, T, H, tokens_per_block);
}

// ---- hc_head on thread-block clusters (NVIDIA sm_90+; Stream::launch_cluster) -------------------
// Clusters of nb blocks (8, or 16 past H = 4096: the host's choice, a function of H alone); block
// `rank` of a cluster owns h in [rank Hs, (rank + 1) Hs) of every stream (Hs = H / nb <= 512; H a
// multiple of 8 nb, at most 8192: the host checks). Thread q of a block owns chunk q of its slice
// (stream i = q / (Hs / 8), h 8c .. 8c + 8 with c = q % (Hs / 8): at most 256 chunks) and keeps
// that chunk's fn weights in registers for the whole launch. Clusters take tiles of MHC_CL_TILE
// tokens in turn (the grid holds only clusters that run at once). Per tile every block
//   1. forms each token's partial Σx² and 4 dots over its slice of the rows, one 16-byte chunk
//      per thread and token, then sums them over the block: butterflies within each warp (the 32 dots of the tile's 8 tokens
//      × 4 gates; the 8 Σx², then across the lane groups; every value of a butterfly takes the same
//      tree over the lanes) and the warps in order;
//      Those 40 values go out to every block of the cluster (st.async into the tile's slot of
//      their inboxes, completing bytes on that slot's mbarrier): no block waits on a cluster
//      barrier, and the values are in each block's own shared memory when it needs them;
//   2. once its slot's mbarrier completed, sums the cluster's nb block partials in rank order
//      (the same bits in every block) and forms the gates (mhc_stream_gate; warp 0);
//   3. writes its slice of the tile's outputs, Σ_i g_i x_i in stream order (as the reference).
// The tiles go through a pipeline of MHC_CL_BUFS row buffers and partial slots: while warp 0
// forms tile k's gates, the other warps form their partials of tile k + 1 (copied a tile ahead,
// cp.async), and the copies of tile k + 2 are in flight.
// A token's arithmetic depends on neither T nor its place in a tile: batch-invariant. One
// cluster barrier after the slots' barriers are initialised (before any store into them) and
// one at the end (no block leaves while stores into it may be in flight).
#define MHC_CL_TILE 8
#define MHC_CL_BUFS 3  // tile buffers (and partial slots) in the pipeline
static_assert(MHC_CL_BUFS == 3, "the loop's buffer rotation and its copies two tiles ahead assume three");
#define MHC_CL_THREADS 256
#define MHC_CL_DOTS (MHC_CL_TILE * MHC_N)        // a tile's dots: value k·4 + g
#define MHC_CL_VALUES (MHC_CL_DOTS + MHC_CL_TILE)  // then its Σx², value 32 + k
static_assert(MHC_CL_DOTS == 32, "one butterfly reduces the tile's dots, one value per lane");
static_assert(MHC_CL_VALUES % 4 == 0, "a tile's partials go out in 16-byte stores");
#define MHC_CL_MAX_BLOCKS 16  // blocks per cluster at most (NVIDIA's non-portable size)
#define MHC_CL_ITEMS 2  // output items a thread: 8 tokens × at most 64 chunks of 8 h
static_assert(MHC_CL_ITEMS * MHC_CL_THREADS >= MHC_CL_TILE * 64, "two output items a thread cover a tile");

// One butterfly step over v[0 .. 2 O): lanes with bit O keep the upper half, the others the
// lower, each adding its partner's copy (the same pairs of lanes for every value).
template <int O, int N>
__device__ __forceinline__ void mhc_cl_fold(float (&v)[N], uint32_t lane) {
    const bool upper = (lane & (uint32_t)O) != 0u;
#pragma unroll
    for (int j = 0; j < O; ++j) {
        const float send = upper ? v[j] : v[j + O];
        const float keep = upper ? v[j + O] : v[j];
        v[j] = keep + hf_shfl_xor(send, O);
    }
}

#if defined(HF_HAS_CLUSTERS)
// 16 bytes to global memory in one instruction, whatever the compiler proves about the address's
// alignment (a plain store of an mhc_u32x4 through an offset it cannot prove a multiple of 16
// becomes four 4-byte stores).
__device__ __forceinline__ void mhc_cl_store16(hf_bf16* p, mhc_u32x4 v) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; st.global.v4.b32 [g], {%1, %2, %3, %4}; }" ::"l"(p),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
#endif

HF_KERNEL void __launch_bounds__(MHC_CL_THREADS, 2)
    mhc_hc_head_cluster_n4(const hf_bf16* __restrict__ residual, const float* __restrict__ hc_fn,
                           const float* __restrict__ scale, const float* __restrict__ base,
                           hf_bf16* __restrict__ out, uint32_t T, uint32_t H, float rms_eps, float hc_eps) {
    hf_dependent_kernel_start();
#if defined(HF_HAS_CLUSTERS)
    // Dynamic: MHC_CL_BUFS tile buffers [MHC_CL_TILE][4][Hs] bf16.
    extern __shared__ __align__(16) unsigned char mhc_cl_smem[];
    __shared__ __align__(16) float red[MHC_CL_THREADS / 32][MHC_CL_VALUES];  // read 16 bytes at a time
    // Every block's partials of a tile, pushed by their owners: inbox[slot][rank], completing
    // `full[slot]` (one local arrival and nb · MHC_CL_VALUES floats of stores per phase).
    __shared__ __align__(16) float inbox[MHC_CL_BUFS][MHC_CL_MAX_BLOCKS][MHC_CL_VALUES];
    __shared__ __align__(8) uint64_t full[MHC_CL_BUFS];
    __shared__ __align__(16) float gate[MHC_CL_TILE][MHC_N];  // read a token's four at once
    const uint32_t tid = threadIdx.x, lane = tid % 32u, warp = tid / 32u;
    const uint32_t rank = hf_cluster_rank();
    const uint32_t nb = hf_cluster_blocks(), Hs = H / nb, cols = Hs / 8u, chunks = MHC_N * cols;
    const uint32_t h_lo = rank * Hs;
    const uint64_t D = (uint64_t)MHC_N * H;
    // Never: the host launches clusters of 8 or 16 blocks (st.async into the cluster needs two or
    // more, and the inboxes hold 16).
    if (nb < 2u || nb > MHC_CL_MAX_BLOCKS) __trap();
    const uint32_t full_a = hf_smem_addr(&full[0]), push_bytes = nb * MHC_CL_VALUES * (uint32_t)sizeof(float);
    hf_bf16* tiles_rows = reinterpret_cast<hf_bf16*>(mhc_cl_smem);
    const uint32_t tile_elems = MHC_CL_TILE * MHC_N * Hs;
    const uint32_t tiles = (T + MHC_CL_TILE - 1u) / MHC_CL_TILE;
    const uint32_t clusters = gridDim.x / nb;
    // Views that are not 16-byte aligned are copied and written element by element (the same
    // values in shared memory, so the same arithmetic and bits); the branches are uniform.
    const bool vec = mhc_aligned16(residual) && mhc_aligned16(hc_fn) && mhc_aligned16(out);
    // The gate threads' weights, read once: the cluster barrier's acquire empties the L1 cache.
    const float gate_scale = tid < MHC_CL_DOTS ? scale[0] : 0.0f;
    const float gate_base = tid < MHC_CL_DOTS ? base[tid % MHC_N] : 0.0f;
    // The thread's chunk q = tid (chunks <= MHC_CL_THREADS: Hs <= 512) and its weights, kept in
    // registers for the whole launch: wg[g][e] = fn[g][chunk's element e] (0 past the chunks).
    if (chunks > MHC_CL_THREADS) __trap();  // never: the host keeps Hs <= 512 (a chunk per thread)
    const bool has_chunk = tid < chunks;
    const uint32_t my_i = has_chunk ? tid / cols : 0u, my_c = has_chunk ? tid % cols : 0u;
    float wg[MHC_N][8];
#pragma unroll
    for (uint32_t g = 0; g < MHC_N; ++g) {
        const float* src = hc_fn + g * D + (uint64_t)my_i * H + h_lo + 8u * my_c;
        if (has_chunk && vec) {
            const mhc_f32x4 lo = *reinterpret_cast<const mhc_f32x4*>(src);
            const mhc_f32x4 hi = *reinterpret_cast<const mhc_f32x4*>(src + 4);
            wg[g][0] = lo.x, wg[g][1] = lo.y, wg[g][2] = lo.z, wg[g][3] = lo.w;
            wg[g][4] = hi.x, wg[g][5] = hi.y, wg[g][6] = hi.z, wg[g][7] = hi.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) wg[g][e] = has_chunk ? src[e] : 0.0f;
        }
    }
    // The thread's chunk in a token's row of `residual` and in a tile buffer (token 0).
    const uint32_t chunk_in_row = my_i * H + h_lo + 8u * my_c, chunk_in_tile = my_i * Hs + 8u * my_c;
    const uint32_t tile_bytes = tile_elems * (uint32_t)sizeof(hf_bf16);
    const uint32_t token_stride = MHC_N * Hs * (uint32_t)sizeof(hf_bf16);  // a token's rows in a buffer
    const uint32_t rows_smem = has_chunk && vec ? hf_smem_addr(tiles_rows + chunk_in_tile) : 0u;
    // Copies tile `tile`'s rows into buffer `b` (rows past T zero-filled) as one commit group;
    // every thread copies the chunks it reads in `partials`, so its own wait suffices there.
    auto fetch = [&](uint32_t tile, uint32_t b) {
        if (has_chunk) {
            // Token k's chunk is k rows of D on in `residual` and k token strides on in the buffer;
            // tile < tiles, so token 0 is below T and stands in as the source of the zero fills.
            const hf_bf16* src = residual + (uint64_t)tile * MHC_CL_TILE * D + chunk_in_row;
            const uint32_t n = min(T - tile * MHC_CL_TILE, (uint32_t)MHC_CL_TILE);  // tokens below T
            if (vec) {
                const uint32_t dst = rows_smem + b * tile_bytes;
                if (n == MHC_CL_TILE) {
#pragma unroll
                    for (uint32_t k = 0; k < MHC_CL_TILE; ++k) hf_cp_async16(dst + k * token_stride, src + k * D, 16u);
                } else {
#pragma unroll
                    for (uint32_t k = 0; k < MHC_CL_TILE; ++k)
                        hf_cp_async16(dst + k * token_stride, k < n ? src + k * D : src, k < n ? 16u : 0u);
                }
            } else {
                hf_bf16* dst = tiles_rows + b * tile_elems + chunk_in_tile;
#pragma unroll
                for (uint32_t k = 0; k < MHC_CL_TILE; ++k) {
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        dst[k * MHC_N * Hs + e].bits = k < n ? src[k * D + e].bits : (uint16_t)0u;
                }
            }
        }
        hf_cp_async_commit();
    };
    // 1. The warps' partials of the tile in buffer `b` into `red` (this thread's copies of it have
    //    landed; the caller's block barrier orders the last use of `red`) ...
    auto partials = [&](uint32_t b) {
        const hf_bf16* rows = tiles_rows + b * tile_elems;
        float dots[MHC_CL_DOTS], ss[MHC_CL_TILE];
#pragma unroll
        for (int j = 0; j < MHC_CL_DOTS; ++j) dots[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < MHC_CL_TILE; ++k) ss[k] = 0.0f;
        if (has_chunk) {
#pragma unroll
            for (uint32_t k = 0; k < MHC_CL_TILE; ++k) {
                float x[8];
                mhc_unpack(*reinterpret_cast<const mhc_u32x4*>(rows + k * MHC_N * Hs + chunk_in_tile), x);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss[k] = fmaf(x[e], x[e], ss[k]);
#pragma unroll
                for (uint32_t g = 0; g < MHC_N; ++g) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) dots[k * MHC_N + g] = fmaf(x[e], wg[g][e], dots[k * MHC_N + g]);
                }
            }
        }
        // Lane l ends with the warp's sum of dot l, and lanes l and l ^ 8, l ^ 16, l ^ 24 with
        // that of Σx² l % 8.
        mhc_cl_fold<16>(dots, lane);
        mhc_cl_fold<8>(dots, lane);
        mhc_cl_fold<4>(dots, lane);
        mhc_cl_fold<2>(dots, lane);
        mhc_cl_fold<1>(dots, lane);
        mhc_cl_fold<4>(ss, lane);
        mhc_cl_fold<2>(ss, lane);
        mhc_cl_fold<1>(ss, lane);
        ss[0] += hf_shfl_xor(ss[0], 8);
        ss[0] += hf_shfl_xor(ss[0], 16);
        red[warp][lane] = dots[0];
        if (lane < MHC_CL_TILE) red[warp][MHC_CL_DOTS + lane] = ss[0];
    };
    // ... then, after a block barrier, their sums over the warps in order, pushed into slot b of
    //    every block's inbox: thread q + 10·r sums values 4q .. 4q + 3 and stores them in block r.
    auto push = [&](uint32_t b) {
        if (tid < (MHC_CL_VALUES / 4u) * nb) {
            const uint32_t q = tid % (MHC_CL_VALUES / 4u), r = tid / (MHC_CL_VALUES / 4u);
            float4 v = *reinterpret_cast<const float4*>(&red[0][4u * q]);
#pragma unroll
            for (uint32_t w = 1; w < MHC_CL_THREADS / 32u; ++w) {
                const float4 u = *reinterpret_cast<const float4*>(&red[w][4u * q]);
                v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
            }
            hf_cluster_store_async_f32x4(&inbox[b][rank][4u * q], r, v, &full[b]);
        }
    };
    // 2. Warp 0: the tile's gates from every block's partials in slot b, summed in rank order (the
    //    same bits in every block), lane k·4 + i gate i of token k; then slot b is armed for the
    //    tile MHC_CL_BUFS on, whose partials no block pushes before this block pushed its next.
    auto gates = [&](uint32_t b, uint32_t parity) {
        hf_mbar_wait_cluster(full_a + 8u * b, parity);
        const uint32_t k = lane / MHC_N, i = lane % MHC_N;
        float sum_sq = 0.0f, dot = 0.0f;
        for (uint32_t r = 0; r < nb; ++r) {
            sum_sq += inbox[b][r][MHC_CL_DOTS + k];
            dot += inbox[b][r][lane];
        }
        gate[k][i] = mhc_stream_gate(sum_sq, dot, H, gate_scale, gate_base, rms_eps, hc_eps);
        if (lane == 0u) hf_mbar_arrive_expect_tx(full_a + 8u * b, push_bytes);
    };
    // The thread's output items w = tid + MHC_CL_THREADS j (token k = w / cols, chunk c = w % cols
    // of each stream: at most two, 8 cols <= 512) are the same in every tile: their token (past
    // the tile: no item) and their offsets in a tile buffer and in the tile's output rows.
    uint32_t item_k[MHC_CL_ITEMS], item_row[MHC_CL_ITEMS], item_out[MHC_CL_ITEMS];
#pragma unroll
    for (uint32_t j = 0; j < MHC_CL_ITEMS; ++j) {
        const uint32_t w = tid + MHC_CL_THREADS * j, k = w / cols, c8 = 8u * (w % cols);
        item_k[j] = w < MHC_CL_TILE * cols ? k : MHC_CL_TILE;
        item_row[j] = k * MHC_N * Hs + c8;
        item_out[j] = k * H + c8;
    }
    // 3. The block's slice of the tile's outputs, Σ_i g_i x_i in stream order.
    auto outputs = [&](uint32_t tile, uint32_t b) {
        const hf_bf16* rows = tiles_rows + b * tile_elems;
        hf_bf16* tile_out = out + (uint64_t)tile * MHC_CL_TILE * H + h_lo;
        const uint32_t t0 = tile * MHC_CL_TILE;
#pragma unroll
        for (uint32_t j = 0; j < MHC_CL_ITEMS; ++j) {
            const uint32_t k = item_k[j];
            if (k >= MHC_CL_TILE || t0 + k >= T) continue;
            const mhc_f32x4 gk = *reinterpret_cast<const mhc_f32x4*>(gate[k]);
            const float g[MHC_N] = {gk.x, gk.y, gk.z, gk.w};
            float o[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = 0.0f;
#pragma unroll
            for (uint32_t i = 0; i < MHC_N; ++i) {
                float x[8];
                mhc_unpack(*reinterpret_cast<const mhc_u32x4*>(rows + item_row[j] + i * Hs), x);
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = fmaf(g[i], x[e], o[e]);
            }
            hf_bf16* dst = tile_out + item_out[j];
            if (vec) {
                // This kernel is bound by issue: paired conversions (cvt.rn.bf16x2.f32, hf_f32_to_bf16's
                // bits for every number), and only a chunk holding a NaN, whose payload the paired
                // conversion does not keep, converts element by element (hf_f32_to_bf16 itself).
                bool nan = false;
#pragma unroll
                for (int e = 0; e < 8; ++e) nan |= o[e] != o[e];
                if (nan) {
                    mhc_cl_store16(dst, mhc_repack(o));
                } else {
                    const mhc_u32x4 paired{hf_pack_bf16x2_any_nan(o[0], o[1]), hf_pack_bf16x2_any_nan(o[2], o[3]),
                                           hf_pack_bf16x2_any_nan(o[4], o[5]), hf_pack_bf16x2_any_nan(o[6], o[7])};
                    mhc_cl_store16(dst, paired);
                }
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) dst[e] = hf_f32_to_bf16(o[e]);
            }
        }
    };
    // The pipeline: tile k's buffer (and partial slot) is k % MHC_CL_BUFS; tile k + 2 is copied
    // while the block works on tiles k and k + 1. Warp 0 waits for tile k's partials (its slot's
    // mbarrier) and forms its gates while the other warps form their partials of tile k + 1
    // (copied a tile ahead); then warp 0 forms its partials. One block barrier then covers the
    // gates and `red`. The gates' latency (the wait, then a division, square root, exponential
    // and reciprocals in one dependent chain) thus overlaps the other warps' partials instead of
    // holding seven warps at a block barrier of its own. Gates in every warp would hold each warp
    // on the same chain and issue it eight times; a ninth (gate) warp leaves 96 registers a thread
    // for two blocks a multiprocessor (ptxas spills), and outputs a tile behind the gates would
    // need a fourth row buffer (one block a multiprocessor).
    const uint32_t first = blockIdx.x / nb;
    if (first >= tiles) return;  // never: the grid holds at most one cluster per tile
    // The slots' barriers, armed for their first tiles and visible to the cluster's stores before
    // any block pushes (the cluster barrier below).
    if (tid == 0u) {
#pragma unroll
        for (uint32_t i = 0; i < MHC_CL_BUFS; ++i) {
            hf_mbar_init(full_a + 8u * i, 1u);
            hf_mbar_arrive_expect_tx(full_a + 8u * i, push_bytes);
        }
        hf_mbar_fence_init_cluster();
    }
    hf_cluster_arrive_shared();
    fetch(first, 0u);
    if (first + clusters < tiles)
        fetch(first + clusters, 1u);
    else
        hf_cp_async_commit();
    hf_cp_async_wait<1>();  // the first tile (this thread's copies: all that `partials` reads)
    partials(0u);
    __syncthreads();    // every warp's partials in `red`
    hf_cluster_wait();  // every block's barriers initialised
    push(0u);
    uint32_t b = 0u, j = 0u;
    for (uint32_t tile = first; tile < tiles; tile += clusters, ++j) {
        const bool more = tile + clusters < tiles;
        const uint32_t b1 = b + 1u == MHC_CL_BUFS ? 0u : b + 1u, b2 = b1 + 1u == MHC_CL_BUFS ? 0u : b1 + 1u;
        __syncthreads();  // the last tile's outputs are done with buffer b2 and `gate`; `red` is free
        if (tile + 2u * clusters < tiles)
            fetch(tile + 2u * clusters, b2);
        else
            hf_cp_async_commit();  // an empty group: the wait below always leaves one group
        if (warp == 0u) gates(b, (j / MHC_CL_BUFS) & 1u);  // every block's partials of this tile
        if (more) {
            hf_cp_async_wait<1>();  // this thread's copies of the next tile have landed
            partials(b1);
        }
        __syncthreads();  // gates and `red` ready; warp 0's reads of slot b are done
        // The next tile's partials to the cluster. A block pushes tile j + 1 after its gates of
        // tile j, which waited for every block's push of tile j, which each block made after its
        // gates of tile j - 1 and thus after reading slot (j + 1) % 3 for tile j - 2 and arming
        // it again: no push overwrites partials still to be read or reaches an unarmed phase
        // (two slots would do; tests/cluster_handoffs.rs models these hand-offs). The stores'
        // completion releases at cluster scope what the pushing block did before.
        if (more) push(b1);
        outputs(tile, b);
        b = b1;
    }
    hf_cp_async_wait_all();  // the last (empty) groups: no copy outlives the block
    hf_cluster_sync();  // no block leaves before every store into the inboxes landed
#endif
}
