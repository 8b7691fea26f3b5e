// holdfast dense ops: bf16 matmul (a tiled kernel, and a small-t kernel for decode steps; bf16 or
// f32 out), RMSNorm, RoPE, SwiGLU, embedding lookup, argmax, row repeat. CUDA C that is also
// valid HIP; only the portability header's primitives are used. Every reduction has one fixed
// order, independent of how many rows share a launch or which matmul kernel runs, so results are
// batch-invariant; the CPU references in dense_source.rs follow the same
// orders (matmul, rms_norm, argmax exactly; rope and swiglu use libm and match within ulps).
//
// Every entry is launched dependent (Stream::launch_dependent) and waits for the kernel before it
// as its first statement, but none lets the next launch begin early: with that trigger, the
// decode-sized matmuls and rms_norm ran up to 1.3x slower (H100, timed side by side), while a
// wait alone keeps most of the hidden launch gap.

struct alignas(16) hf_f4 { float v[4]; };
struct alignas(16) hf_u4 { uint32_t v[4]; };

__device__ __forceinline__ void hf_store_f32(hf_bf16* p, float v) { *p = hf_f32_to_bf16(v); }
__device__ __forceinline__ void hf_store_f32(float* p, float v) { *p = v; }

// ---- matmul: y[m, g, c] = sum_k x[m, g, k] * w[g, c, k] ------------------------------------
// Block tile HF_MM_BM rows x HF_MM_BN columns, k in steps of HF_MM_BK; 256 threads, each owning a
// 4 x 4 register tile (rows 4 ty + i, columns 4 tx + j). Tiles of x and w are converted to f32
// into shared memory, k-major, so the inner loop reads one 16-byte vector of each per k.
// Summation order of every output: acc = 0, then acc = fmaf(x[k], w[k], acc) for k = 0, 1, ...,
// K - 1, one chain, whatever the tile position, T, N or the grid. Partial k tiles run only their
// valid k (no padded terms).
#define HF_MM_BM 32
#define HF_MM_BN 128
#define HF_MM_BK 32
#define HF_MM_THREADS 256

template <typename Out>
__device__ __forceinline__ void hf_matmul_body(const hf_bf16* __restrict__ x, const hf_bf16* __restrict__ w,
                                               Out* __restrict__ y, uint32_t t, uint32_t n, uint32_t k,
                                               uint32_t groups) {
    __shared__ __attribute__((aligned(16))) float xs[HF_MM_BK][HF_MM_BM + 4];
    __shared__ __attribute__((aligned(16))) float ws[HF_MM_BK][HF_MM_BN + 4];
    const uint32_t tid = threadIdx.x;
    const uint32_t tx = tid % 32, ty = tid / 32;
    const uint32_t n0 = blockIdx.x * HF_MM_BN, m0 = blockIdx.y * HF_MM_BM, g = blockIdx.z;
    const uint64_t x_stride = (uint64_t)groups * k;  // elements between tokens of x
    const hf_bf16* wg = w + (uint64_t)g * n * k;
    // Loader roles: x rows tid % 32 (k quarter-chunk tid / 32 of 4), w rows tid % 128 (k half tid / 128 of 16).
    const uint32_t xr = tid % HF_MM_BM, xk = (tid / HF_MM_BM) * 4;
    const uint32_t wr = tid % HF_MM_BN, wk = (tid / HF_MM_BN) * 16;
    const bool x_ok = m0 + xr < t, w_ok = n0 + wr < n;
    const hf_bf16* xp = x + (uint64_t)(m0 + xr) * x_stride + (uint64_t)g * k;
    const hf_bf16* wp = wg + (uint64_t)(n0 + wr) * k;

    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (uint32_t k0 = 0; k0 < k; k0 += HF_MM_BK) {
        const uint32_t kn = k - k0 < HF_MM_BK ? k - k0 : HF_MM_BK;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const uint32_t kk = xk + e;
            xs[kk][xr] = (x_ok && kk < kn) ? hf_bf16_to_f32(xp[k0 + kk]) : 0.0f;
        }
        const hf_bf16* wsrc = wp + k0 + wk;
        if (w_ok && kn == HF_MM_BK && ((uint64_t)wsrc & 15u) == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const hf_u4 q = reinterpret_cast<const hf_u4*>(wsrc)[h];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    ws[wk + 8 * h + 2 * e][wr] = __uint_as_float(q.v[e] << 16);
                    ws[wk + 8 * h + 2 * e + 1][wr] = __uint_as_float(q.v[e] & 0xffff0000u);
                }
            }
        } else {
#pragma unroll
            for (int e = 0; e < 16; ++e) {
                const uint32_t kk = wk + e;
                ws[kk][wr] = (w_ok && kk < kn) ? hf_bf16_to_f32(wsrc[e]) : 0.0f;
            }
        }
        __syncthreads();
        if (kn == HF_MM_BK) {
#pragma unroll
            for (uint32_t kk = 0; kk < HF_MM_BK; ++kk) {
                const hf_f4 a = *reinterpret_cast<const hf_f4*>(&xs[kk][4 * ty]);
                const hf_f4 b = *reinterpret_cast<const hf_f4*>(&ws[kk][4 * tx]);
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a.v[i], b.v[j], acc[i][j]);
            }
        } else {
            for (uint32_t kk = 0; kk < kn; ++kk) {
                const hf_f4 a = *reinterpret_cast<const hf_f4*>(&xs[kk][4 * ty]);
                const hf_f4 b = *reinterpret_cast<const hf_f4*>(&ws[kk][4 * tx]);
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a.v[i], b.v[j], acc[i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t m = m0 + 4 * ty + i;
        if (m >= t) continue;
        Out* yr = y + ((uint64_t)m * groups + g) * n;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t c = n0 + 4 * tx + j;
            if (c < n) hf_store_f32(yr + c, acc[i][j]);
        }
    }
}

HF_KERNEL void __launch_bounds__(HF_MM_THREADS)
hf_matmul_bf16(const hf_bf16* x, const hf_bf16* w, hf_bf16* y, uint32_t t, uint32_t n, uint32_t k, uint32_t groups) {
    hf_grid_dependency_wait();
    hf_matmul_body<hf_bf16>(x, w, y, t, n, k, groups);
}

HF_KERNEL void __launch_bounds__(HF_MM_THREADS)
hf_matmul_f32(const hf_bf16* x, const hf_bf16* w, float* y, uint32_t t, uint32_t n, uint32_t k, uint32_t groups) {
    hf_grid_dependency_wait();
    hf_matmul_body<float>(x, w, y, t, n, k, groups);
}

// ---- small-t matmul (decode steps): t <= HF_MV_MAX_T rows per pass ------------------------------
// The tiled kernel above always computes a 32-row tile, so at t = 1..8 it issues up to 32x the
// FMAs it needs and is compute-bound. This kernel is built for weight bandwidth instead. Grid
// (ceil(n / HF_MV_BN), 1, groups), HF_MV_THREADS = HF_MV_BN threads: thread i owns output column
// c = n0 + i and keeps the chains of that column for every row (up to 8) in registers. The block
// streams the w rows of its slab through shared memory HF_MV_BK k at a time:
// - k % 8 == 0 and w 16-byte aligned (the usual case): each thread issues eight 16-byte loads per
//   chunk (a warp reads four whole 128-byte row segments), and the loads of chunk j + 1 are in
//   flight while chunk j is computed (register double buffering);
// - otherwise element loads, coalesced along k, no prefetch.
// w stays bf16 in shared memory, rows padded to 144 bytes so that each thread's 16-byte reads of its
// own row are bank-conflict-free; x is staged as f32, k-major, 8 floats per k, so a k step reads the
// row values with one or two broadcast 16-byte loads. More than 8 rows (never launched so by the
// host, but correct) run as passes of 8 over the slab.
// Summation order: exactly the tiled kernel's, acc = 0 then acc = fmaf(x[k], w[k], acc) for
// k = 0, 1, ..., K - 1 (a partial chunk runs only its valid k), the same bf16 -> f32 conversion
// and the same final store, so both kernels (and the CPU reference) give the same bits.
#define HF_MV_MAX_T 8
#define HF_MV_BN 128
#define HF_MV_THREADS 128
#define HF_MV_BK 64
#define HF_MV_WPITCH (HF_MV_BK + 8)  // bf16 per shared w row: 144 bytes
#define HF_MV_XROWS (HF_MV_THREADS / HF_MV_BK)  // x rows one loader pass covers
static_assert(HF_MV_THREADS == HF_MV_BN, "one output column per thread");
static_assert(HF_MV_BN * HF_MV_BK / 8 == 8 * HF_MV_THREADS, "eight 16-byte w pieces per thread");
static_assert(HF_MV_XROWS * 4 == HF_MV_MAX_T, "four x values per thread");

// One k step of every row chain: acc[r] = fmaf(x[r][k], w[k], acc[r]).
template <int T>
__device__ __forceinline__ void hf_mv_step(const float* xk, float wv, float (&acc)[T]) {
    const hf_f4 a = *reinterpret_cast<const hf_f4*>(xk);
#pragma unroll
    for (int r = 0; r < T && r < 4; ++r) acc[r] = fmaf(a.v[r], wv, acc[r]);
    if constexpr (T > 4) {
        const hf_f4 b = *reinterpret_cast<const hf_f4*>(xk + 4);
#pragma unroll
        for (int r = 4; r < T; ++r) acc[r] = fmaf(b.v[r - 4], wv, acc[r]);
    }
}

// The kn valid k of one staged chunk, in order, for this thread's row of ws.
template <int T>
__device__ __forceinline__ void hf_mv_chunk(const uint16_t* wrow, const float (*xs)[HF_MV_MAX_T], uint32_t kn,
                                            float (&acc)[T]) {
    if (kn == HF_MV_BK) {
#pragma unroll
        for (int q = 0; q < HF_MV_BK / 8; ++q) {
            const hf_u4 wq = *reinterpret_cast<const hf_u4*>(wrow + 8 * q);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const uint32_t u = wq.v[e / 2];
                hf_mv_step<T>(xs[8 * q + e], __uint_as_float((e & 1) ? (u & 0xffff0000u) : (u << 16)), acc);
            }
        }
    } else {
        for (uint32_t kk = 0; kk < kn; ++kk) hf_mv_step<T>(xs[kk], __uint_as_float((uint32_t)wrow[kk] << 16), acc);
    }
}

// x loader: this thread takes k = k0 + tid % HF_MV_BK of rows tid / HF_MV_BK + HF_MV_XROWS * i.
template <int T>
__device__ __forceinline__ void hf_mv_load_x(const hf_bf16* xg, uint64_t x_stride, uint32_t k0, uint32_t kn,
                                             float (&v)[4]) {
    const uint32_t kk = threadIdx.x % HF_MV_BK, r0 = threadIdx.x / HF_MV_BK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t r = r0 + HF_MV_XROWS * i;
        v[i] = (r < (uint32_t)T && kk < kn) ? hf_bf16_to_f32(xg[r * x_stride + k0 + kk]) : 0.0f;
    }
}

template <int T>
__device__ __forceinline__ void hf_mv_store_x(float (*xs)[HF_MV_MAX_T], const float (&v)[4]) {
    const uint32_t kk = threadIdx.x % HF_MV_BK, r0 = threadIdx.x / HF_MV_BK;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t r = r0 + HF_MV_XROWS * i;
        if (r < (uint32_t)T) xs[kk][r] = v[i];
    }
}

// w loader, vector path: this thread takes the 16-byte piece tid % 8 (k0 + 8 (tid % 8) ...) of slab
// rows tid / 8 + 16 i; rows past n and pieces past kn (a multiple of 8 here) read as zero.
__device__ __forceinline__ void hf_mv_load_w(const hf_bf16* wg, uint32_t n0, uint32_t n, uint32_t k, uint32_t k0,
                                             uint32_t kn, hf_u4 (&q)[8]) {
    const uint32_t kk = 8 * (threadIdx.x % 8), r0 = threadIdx.x / 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t c = n0 + r0 + (HF_MV_THREADS / 8) * i;
        if (c < n && kk < kn) {
            q[i] = *reinterpret_cast<const hf_u4*>(wg + (uint64_t)c * k + k0 + kk);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) q[i].v[e] = 0u;
        }
    }
}

__device__ __forceinline__ void hf_mv_store_w(uint16_t (*ws)[HF_MV_WPITCH], const hf_u4 (&q)[8]) {
    const uint32_t kk = 8 * (threadIdx.x % 8), r0 = threadIdx.x / 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<hf_u4*>(&ws[r0 + (HF_MV_THREADS / 8) * i][kk]) = q[i];
}

// Rows m0 .. m0 + T - 1 of the block's slab (T <= 8).
template <int T, typename Out>
__device__ __forceinline__ void hf_mv_rows(const hf_bf16* __restrict__ x, const hf_bf16* __restrict__ w,
                                           Out* __restrict__ y, uint32_t m0, uint32_t n, uint32_t k,
                                           uint32_t groups, uint16_t (*ws)[HF_MV_WPITCH],
                                           float (*xs)[HF_MV_MAX_T]) {
    const uint32_t tid = threadIdx.x, n0 = blockIdx.x * HF_MV_BN, g = blockIdx.z;
    const uint64_t x_stride = (uint64_t)groups * k;  // elements between tokens of x
    const hf_bf16* xg = x + (uint64_t)m0 * x_stride + (uint64_t)g * k;
    const hf_bf16* wg = w + (uint64_t)g * n * k;
    float acc[T];
#pragma unroll
    for (int r = 0; r < T; ++r) acc[r] = 0.0f;

    if (k % 8 == 0 && ((uint64_t)wg & 15u) == 0) {
        hf_u4 wq[8];
        float xv[4];
        uint32_t kn = k < HF_MV_BK ? k : HF_MV_BK;
        hf_mv_load_w(wg, n0, n, k, 0, kn, wq);
        hf_mv_load_x<T>(xg, x_stride, 0, kn, xv);
        for (uint32_t k0 = 0; k0 < k; k0 += HF_MV_BK) {
            __syncthreads();  // the previous chunk (or pass) is consumed
            hf_mv_store_w(ws, wq);
            hf_mv_store_x<T>(xs, xv);
            __syncthreads();
            const uint32_t cur = kn;
            if (k0 + HF_MV_BK < k) {  // chunk j + 1 in flight while chunk j runs
                const uint32_t k1 = k0 + HF_MV_BK;
                kn = k - k1 < HF_MV_BK ? k - k1 : HF_MV_BK;
                hf_mv_load_w(wg, n0, n, k, k1, kn, wq);
                hf_mv_load_x<T>(xg, x_stride, k1, kn, xv);
            }
            hf_mv_chunk<T>(ws[tid], xs, cur, acc);
        }
    } else {
        for (uint32_t k0 = 0; k0 < k; k0 += HF_MV_BK) {
            const uint32_t kn = k - k0 < HF_MV_BK ? k - k0 : HF_MV_BK;
            float xv[4];
            hf_mv_load_x<T>(xg, x_stride, k0, kn, xv);
            __syncthreads();  // the previous chunk (or pass) is consumed
            const uint32_t kk = tid % HF_MV_BK;
#pragma unroll 8
            for (uint32_t r = tid / HF_MV_BK; r < HF_MV_BN; r += HF_MV_XROWS) {
                const uint32_t c = n0 + r;
                ws[r][kk] = (c < n && kk < kn) ? wg[(uint64_t)c * k + k0 + kk].bits : (uint16_t)0;
            }
            hf_mv_store_x<T>(xs, xv);
            __syncthreads();
            hf_mv_chunk<T>(ws[tid], xs, kn, acc);
        }
    }
    const uint32_t c = n0 + tid;
    if (c < n) {
#pragma unroll
        for (int r = 0; r < T; ++r) hf_store_f32(y + ((uint64_t)(m0 + r) * groups + g) * n + c, acc[r]);
    }
}

template <typename Out>
__device__ __forceinline__ void hf_matmul_small_t_body(const hf_bf16* __restrict__ x, const hf_bf16* __restrict__ w,
                                                       Out* __restrict__ y, uint32_t t, uint32_t n, uint32_t k,
                                                       uint32_t groups) {
    __shared__ __attribute__((aligned(16))) uint16_t ws[HF_MV_BN][HF_MV_WPITCH];
    __shared__ __attribute__((aligned(16))) float xs[HF_MV_BK][HF_MV_MAX_T];
    for (uint32_t m0 = 0; m0 < t; m0 += HF_MV_MAX_T) {
        switch (t - m0 < HF_MV_MAX_T ? t - m0 : HF_MV_MAX_T) {
            case 1: hf_mv_rows<1, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 2: hf_mv_rows<2, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 3: hf_mv_rows<3, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 4: hf_mv_rows<4, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 5: hf_mv_rows<5, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 6: hf_mv_rows<6, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            case 7: hf_mv_rows<7, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
            default: hf_mv_rows<8, Out>(x, w, y, m0, n, k, groups, ws, xs); break;
        }
    }
}

HF_KERNEL void __launch_bounds__(HF_MV_THREADS)
hf_matmul_small_t_bf16(const hf_bf16* x, const hf_bf16* w, hf_bf16* y, uint32_t t, uint32_t n, uint32_t k,
                       uint32_t groups) {
    hf_grid_dependency_wait();
    hf_matmul_small_t_body<hf_bf16>(x, w, y, t, n, k, groups);
}

HF_KERNEL void __launch_bounds__(HF_MV_THREADS)
hf_matmul_small_t_f32(const hf_bf16* x, const hf_bf16* w, float* y, uint32_t t, uint32_t n, uint32_t k,
                      uint32_t groups) {
    hf_grid_dependency_wait();
    hf_matmul_small_t_body<float>(x, w, y, t, n, k, groups);
}

// ---- rms_norm: one block of HF_NORM_THREADS per row -------------------------------------------
// Thread j sums x[c]^2 for c = j, j + 256, ... with fmaf from 0; the 256 partials are added in the
// shared-memory tree (s = 128, 64, ..., 1: p[i] += p[i + s]). inv = 1 / sqrtf(p[0] / dim + eps)
// (IEEE division and square root), y = bf16((x * inv) * w). x may equal y.
#define HF_NORM_THREADS 256
HF_KERNEL void __launch_bounds__(HF_NORM_THREADS)
hf_rms_norm_bf16(const hf_bf16* x, const hf_bf16* w, hf_bf16* y, uint32_t rows, uint32_t dim, float eps) {
    hf_grid_dependency_wait();
    __shared__ float part[HF_NORM_THREADS];
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const hf_bf16* xr = x + (uint64_t)r * dim;
        hf_bf16* yr = y + (uint64_t)r * dim;
        float ss = 0.0f;
        for (uint32_t c = threadIdx.x; c < dim; c += HF_NORM_THREADS) {
            const float v = hf_bf16_to_f32(xr[c]);
            ss = fmaf(v, v, ss);
        }
        part[threadIdx.x] = ss;
        __syncthreads();
        for (uint32_t s = HF_NORM_THREADS / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
            __syncthreads();
        }
        const float inv = 1.0f / sqrtf(part[0] / (float)dim + eps);
        __syncthreads();  // part is rewritten by the next row
        for (uint32_t c = threadIdx.x; c < dim; c += HF_NORM_THREADS) {
            const float v = hf_bf16_to_f32(xr[c]) * inv;
            yr[c] = hf_f32_to_bf16(v * hf_bf16_to_f32(w[c]));
        }
    }
}

// ---- rope: one thread per (token, head, pair), grid-stride --------------------------------------
// Pair p of the last rope_dim dims of each head: (a, b) at dims head_dim - rope_dim + 2p, + 1.
// angle = sign * (pos * powf(theta, -(2p) / rope_dim)); (a, b) -> (a cos - b sin, a sin + b cos).
HF_KERNEL void hf_rope_bf16(hf_bf16* x, const int32_t* pos, uint32_t tokens, uint32_t heads, uint32_t head_dim,
                            uint32_t rope_dim, float theta, float sign) {
    hf_grid_dependency_wait();
    const uint32_t half = rope_dim / 2;
    const uint64_t total = (uint64_t)tokens * heads * half;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t p = (uint32_t)(i % half);
        const uint64_t th = i / half;
        const int32_t ps = pos[th / heads];
        if (ps < 0) continue;
        const float inv_freq = powf(theta, -(float)(2u * p) / (float)rope_dim);
        const float ang = sign * ((float)ps * inv_freq);
        const float sn = sinf(ang), cs = cosf(ang);
        hf_bf16* e = x + th * head_dim + (head_dim - rope_dim) + 2u * p;
        const float a = hf_bf16_to_f32(e[0]), b = hf_bf16_to_f32(e[1]);
        e[0] = hf_f32_to_bf16(a * cs - b * sn);
        e[1] = hf_f32_to_bf16(a * sn + b * cs);
    }
}

// ---- swiglu: out[t, j] = silu(min(gate, limit)) * clamp(up, -limit, limit), grid-stride ---------
// The comparisons are written so that a NaN input stays NaN (fminf would drop it).
HF_KERNEL void hf_swiglu_bf16(const hf_bf16* gate_up, hf_bf16* out, uint32_t tokens, uint32_t ffn, float limit) {
    hf_grid_dependency_wait();
    const uint64_t total = (uint64_t)tokens * ffn;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t t = i / ffn, j = i % ffn;
        float g = hf_bf16_to_f32(gate_up[t * 2 * ffn + j]);
        float u = hf_bf16_to_f32(gate_up[t * 2 * ffn + ffn + j]);
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        const float silu = g / (1.0f + expf(-g));
        out[i] = hf_f32_to_bf16(silu * u);
    }
}

// ---- embed: out[t, c] = table[ids[t], c], zero for ids outside [0, vocab), grid-stride ----------
HF_KERNEL void hf_embed_bf16(const hf_bf16* table, const int32_t* ids, hf_bf16* out, uint32_t tokens, uint32_t hidden,
                             uint32_t vocab) {
    hf_grid_dependency_wait();
    const uint64_t total = (uint64_t)tokens * hidden;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t t = i / hidden, c = i % hidden;
        const int32_t id = ids[t];
        hf_bf16 v;
        v.bits = 0;
        if (id >= 0 && (uint32_t)id < vocab) v = table[(uint64_t)id * hidden + c];
        out[i] = v;
    }
}

// ---- argmax: one block of HF_ARGMAX_THREADS per row ---------------------------------------------
// Candidates (value, index) with index HF_NONE for "no non-NaN value yet". better() is a total
// order (larger value, then lower index; NaN never a candidate), so the result does not depend on
// the scan or tree order. An all-NaN (or empty) row gives 0.
#define HF_ARGMAX_THREADS 256
#define HF_NONE 0xffffffffu
__device__ __forceinline__ bool hf_better(float v, uint32_t i, float bv, uint32_t bi) {
    if (i == HF_NONE) return false;
    if (bi == HF_NONE) return true;
    return v > bv || (v == bv && i < bi);
}
HF_KERNEL void __launch_bounds__(HF_ARGMAX_THREADS)
hf_argmax_f32(const float* logits, int32_t* out, uint32_t rows, uint32_t cols) {
    hf_grid_dependency_wait();
    __shared__ float sv[HF_ARGMAX_THREADS];
    __shared__ uint32_t si[HF_ARGMAX_THREADS];
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* lr = logits + (uint64_t)r * cols;
        float bv = 0.0f;
        uint32_t bi = HF_NONE;
        for (uint32_t c = threadIdx.x; c < cols; c += HF_ARGMAX_THREADS) {
            const float v = lr[c];
            if (v == v && hf_better(v, c, bv, bi)) { bv = v; bi = c; }
        }
        sv[threadIdx.x] = bv;
        si[threadIdx.x] = bi;
        __syncthreads();
        for (uint32_t s = HF_ARGMAX_THREADS / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s && hf_better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x])) {
                sv[threadIdx.x] = sv[threadIdx.x + s];
                si[threadIdx.x] = si[threadIdx.x + s];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) out[r] = si[0] == HF_NONE ? 0 : (int32_t)si[0];
        __syncthreads();  // sv/si are rewritten by the next row
    }
}

// ---- repeat_rows: y[t, j, c] = x[t, c] for j < copies, grid-stride -------------------------------
HF_KERNEL void hf_repeat_rows_bf16(const hf_bf16* x, hf_bf16* y, uint32_t tokens, uint32_t copies, uint32_t hidden) {
    hf_grid_dependency_wait();
    const uint64_t total = (uint64_t)tokens * copies * hidden;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t c = i % hidden, t = i / ((uint64_t)copies * hidden);
        y[i] = x[t * hidden + c];
    }
}

// ---- to_bf16: y[i] = bf16(x[i]) (round to nearest even), grid-stride ------------------------------
HF_KERNEL void hf_to_bf16_f32(const float* x, hf_bf16* y, uint32_t n) {
    hf_grid_dependency_wait();
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = hf_f32_to_bf16(x[i]);
}
