
// ---- tensor-core matmul (NVIDIA sm_80+): y[m, g, c] = sum_k x[m, g, k] * w[g, c, k] ----------
// Order of every output (the "split order"; `splits` and `split_len` come from k alone, see
// dense.rs): k is cut into `splits` ranges of `split_len` (a multiple of 32; the last range ends
// at k). Per range: acc = 0, then acc = mma(x[m, kk..kk+16], w[c, kk..kk+16], acc) for kk = start,
// start + 16, ... (bf16 m16n8k16 with f32 accumulators; k past the range reads zeros). Then
// total = 0, total += acc_s for s = 0, 1, ..., splits - 1, stored as f32 or rounded once to bf16.
// An mma's element (i, j) depends on row i of x, column j of w and its own accumulator only, so
// a row's bits depend on neither t, nor the block's row tile (MT), nor the grid.
//
// Block: 8 warps; warp w takes k range s = w % splits and the 16 output columns
// 16 (w / splits) of the block's 16 (8 / splits) columns, for the block's 16 MT rows. Each warp
// streams its own x and w tiles (32 k per stage, STAGES stages in flight) through its own slice
// of shared memory by cp.async, so the main loop needs no block barrier; fragments come from
// ldmatrix (rows padded to 40 bf16: conflict-free). At the end every warp leaves its
// accumulators in shared memory and the block sums the ranges in order and stores.
// Requirements (checked by the launcher): k % 8 == 0 and x, w 16-byte aligned.
#define HF_MMT_BK 32
#define HF_MMT_PITCH 40
#define HF_MMT_WARPS 8

#if defined(HF_HAS_MMA)
template <int MT, int STAGES, typename Out>
__device__ __forceinline__ void hf_matmul_mma_body(const hf_bf16* __restrict__ x, const hf_bf16* __restrict__ w,
                                                   Out* __restrict__ y, uint32_t t, uint32_t n, uint32_t k,
                                                   uint32_t groups, uint32_t splits, uint32_t split_len) {
    extern __shared__ __align__(16) unsigned char hf_mmt_smem[];
    constexpr uint32_t XR = 16 * MT;              // x rows per stage
    constexpr uint32_t ROWS = XR + 16;            // then 16 w rows
    constexpr uint32_t STAGE = ROWS * HF_MMT_PITCH;  // bf16 per stage
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t s = warp % splits, j = warp / splits;
    const uint32_t bn = 16 * (HF_MMT_WARPS / splits);
    const uint32_t c0 = blockIdx.x * bn, n0 = c0 + 16 * j, m0 = blockIdx.y * XR, g = blockIdx.z;
    hf_bf16* buf = reinterpret_cast<hf_bf16*>(hf_mmt_smem) + (uint64_t)warp * STAGES * STAGE;
    const uint32_t kb = min(k, s * split_len), ke = min(k, kb + split_len);
    const uint32_t tiles = (ke - kb + HF_MMT_BK - 1) / HF_MMT_BK;
    const uint64_t xs = (uint64_t)groups * k;
    const hf_bf16* xg = x + (uint64_t)g * k;
    const hf_bf16* wg = w + (uint64_t)g * n * k;

    auto load = [&](uint32_t tile, uint32_t slot) {
        const uint32_t k0 = kb + tile * HF_MMT_BK;
        hf_bf16* st = buf + slot * STAGE;
#pragma unroll
        for (uint32_t c = lane; c < ROWS * 4; c += 32) {
            const uint32_t r = c / 4, kc = k0 + (c % 4) * 8;
            const hf_bf16* src = x;
            bool ok = kc < ke;
            if (r < XR) {
                ok = ok && m0 + r < t;
                if (ok) src = xg + (uint64_t)(m0 + r) * xs + kc;
            } else {
                ok = ok && n0 + (r - XR) < n;
                if (ok) src = wg + (uint64_t)(n0 + (r - XR)) * k + kc;
            }
            hf_cp_async16(hf_smem_addr(st + r * HF_MMT_PITCH + (c % 4) * 8), src, ok ? 16u : 0u);
        }
    };

    float acc[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][q][e] = 0.f;

#pragma unroll
    for (uint32_t i = 0; i < STAGES - 1; ++i) {
        if (i < tiles) load(i, i);
        hf_cp_async_commit();
    }
    // ldmatrix row addresses: A (x) rows lane % 16, k half lane / 16; B (w) rows lane % 8 (+8 for
    // lanes 16..31), k half (lane / 8) % 2 — matrices 0..3 are b0, b1 of columns 0..7, then 8..15.
    const uint32_t ar = lane % 16, ac = (lane / 16) * 8;
    const uint32_t br = XR + lane % 8 + (lane / 16) * 8, bc = ((lane / 8) % 2) * 8;
    for (uint32_t i = 0; i < tiles; ++i) {
        hf_cp_async_wait<STAGES - 2>();
        __syncwarp();
        const hf_bf16* st = buf + (i % STAGES) * STAGE;
#pragma unroll
        for (uint32_t kk = 0; kk < HF_MMT_BK; kk += 16) {
            uint32_t b[4];
            hf_ldsm_x4(hf_smem_addr(st + br * HF_MMT_PITCH + kk + bc), b[0], b[1], b[2], b[3]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                uint32_t a[4];
                hf_ldsm_x4(hf_smem_addr(st + (16 * mt + ar) * HF_MMT_PITCH + kk + ac), a[0], a[1], a[2], a[3]);
                hf_mma_bf16(acc[mt][0], a, b[0], b[1]);
                hf_mma_bf16(acc[mt][1], a, b[2], b[3]);
            }
        }
        __syncwarp();
        const uint32_t next = i + STAGES - 1;
        if (next < tiles) load(next, next % STAGES);
        hf_cp_async_commit();
    }
    hf_cp_async_wait_all();
    __syncthreads();

    // Every warp's [16 MT, 16] accumulators, then the ranges summed in order.
    float* red = reinterpret_cast<float*>(hf_mmt_smem);
    float* mine = red + warp * (XR * 16);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t r = 16 * mt + lane / 4 + (e >= 2 ? 8 : 0), c = 8 * q + 2 * (lane % 4) + (e & 1);
                mine[r * 16 + c] = acc[mt][q][e];
            }
    __syncthreads();
    for (uint32_t o = threadIdx.x; o < XR * bn; o += blockDim.x) {
        const uint32_t r = o / bn, cb = o % bn, jj = cb / 16, cc = cb % 16;
        float total = 0.f;
        for (uint32_t ss = 0; ss < splits; ++ss) total += red[(jj * splits + ss) * (XR * 16) + r * 16 + cc];
        const uint32_t m = m0 + r, col = c0 + cb;
        if (m < t && col < n) hf_store_f32(y + ((uint64_t)m * groups + g) * n + col, total);
    }
}
// The tiled kernel (many rows): a 64 × 128 block tile, 8 warps as 2 × 4 with 32 × 32 warp tiles,
// x and w tiles shared by the block (32 k per stage, three stages of cp.async in flight, one
// barrier per stage). The block walks k in order; at the end of each k range it adds the range's
// accumulators to the total and restarts them, which is the split order step for step: the same
// mma k steps from the same zeros per range, the ranges added in order (trailing empty ranges
// add their zeros too), so its rows equal the 16- and 64-row kernels' bit for bit.
#define HF_MMG_BM 64
#define HF_MMG_BN 128
#define HF_MMG_STAGES 3
template <typename Out>
__device__ __forceinline__ void hf_matmul_mma_tiled_body(const hf_bf16* __restrict__ x, const hf_bf16* __restrict__ w,
                                                         Out* __restrict__ y, uint32_t t, uint32_t n, uint32_t k,
                                                         uint32_t groups, uint32_t splits, uint32_t split_len) {
    extern __shared__ __align__(16) unsigned char hf_mmg_smem[];
    constexpr uint32_t ROWS = HF_MMG_BM + HF_MMG_BN;
    constexpr uint32_t STAGE = ROWS * HF_MMT_PITCH;
    hf_bf16* buf = reinterpret_cast<hf_bf16*>(hf_mmg_smem);
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, wm = warp / 4, wn = warp % 4;
    const uint32_t m0 = blockIdx.y * HF_MMG_BM, n0 = blockIdx.x * HF_MMG_BN, g = blockIdx.z;
    const uint32_t tiles = (k + HF_MMT_BK - 1) / HF_MMT_BK;
    const uint32_t per_split = split_len / HF_MMT_BK > 0 ? split_len / HF_MMT_BK : 1;
    const uint64_t xs = (uint64_t)groups * k;
    const hf_bf16* xg = x + (uint64_t)g * k;
    const hf_bf16* wg = w + (uint64_t)g * n * k;

    auto load = [&](uint32_t tile, uint32_t slot) {
        const uint32_t k0 = tile * HF_MMT_BK;
        hf_bf16* st = buf + slot * STAGE;
#pragma unroll
        for (uint32_t c = threadIdx.x; c < ROWS * 4; c += 256) {
            const uint32_t r = c / 4, kc = k0 + (c % 4) * 8;
            const hf_bf16* src = x;
            bool ok = kc < k;
            if (r < HF_MMG_BM) {
                ok = ok && m0 + r < t;
                if (ok) src = xg + (uint64_t)(m0 + r) * xs + kc;
            } else {
                ok = ok && n0 + (r - HF_MMG_BM) < n;
                if (ok) src = wg + (uint64_t)(n0 + (r - HF_MMG_BM)) * k + kc;
            }
            hf_cp_async16(hf_smem_addr(st + r * HF_MMT_PITCH + (c % 4) * 8), src, ok ? 16u : 0u);
        }
    };

    float acc[2][4][4], total[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][q][e] = total[i][q][e] = 0.f;

#pragma unroll
    for (uint32_t i = 0; i < HF_MMG_STAGES - 1; ++i) {
        if (i < tiles) load(i, i);
        hf_cp_async_commit();
    }
    const uint32_t ar = 32 * wm + lane % 16, ac = (lane / 16) * 8;
    const uint32_t br = HF_MMG_BM + 32 * wn + lane % 8 + (lane / 16) * 8, bc = ((lane / 8) % 2) * 8;
    uint32_t done = 0;
    for (uint32_t i = 0; i < tiles; ++i) {
        hf_cp_async_wait<HF_MMG_STAGES - 2>();
        __syncthreads();
        const uint32_t next = i + HF_MMG_STAGES - 1;
        if (next < tiles) load(next, next % HF_MMG_STAGES);
        hf_cp_async_commit();
        const hf_bf16* st = buf + (i % HF_MMG_STAGES) * STAGE;
#pragma unroll
        for (uint32_t kk = 0; kk < HF_MMT_BK; kk += 16) {
            uint32_t b[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h)
                hf_ldsm_x4(hf_smem_addr(st + (br + 16 * h) * HF_MMT_PITCH + kk + bc), b[h][0], b[h][1], b[h][2],
                           b[h][3]);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                uint32_t a[4];
                hf_ldsm_x4(hf_smem_addr(st + (ar + 16 * mt) * HF_MMT_PITCH + kk + ac), a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    hf_mma_bf16(acc[mt][2 * h], a, b[h][0], b[h][1]);
                    hf_mma_bf16(acc[mt][2 * h + 1], a, b[h][2], b[h][3]);
                }
            }
        }
        if ((i + 1) % per_split == 0 || i + 1 == tiles) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int q = 0; q < 4; ++q)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        total[mt][q][e] += acc[mt][q][e];
                        acc[mt][q][e] = 0.f;
                    }
            ++done;
        }
    }
    hf_cp_async_wait_all();
    for (; done < splits; ++done)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int e = 0; e < 4; ++e) total[mt][q][e] += acc[mt][q][e];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t m = m0 + 32 * wm + 16 * mt + lane / 4 + (e >= 2 ? 8 : 0);
                const uint32_t col = n0 + 32 * wn + 8 * q + 2 * (lane % 4) + (e & 1);
                if (m < t && col < n) hf_store_f32(y + ((uint64_t)m * groups + g) * n + col, total[mt][q][e]);
            }
}
#define HF_MMG_ENTRY(NAME, OUT)                                                                                    \
    HF_KERNEL void __launch_bounds__(256) NAME(const hf_bf16* x, const hf_bf16* w, OUT* y, uint32_t t, uint32_t n, \
                                               uint32_t k, uint32_t groups, uint32_t splits, uint32_t split_len) {  \
        hf_grid_dependency_wait();                                                                                \
        hf_matmul_mma_tiled_body<OUT>(x, w, y, t, n, k, groups, splits, split_len);                               \
    }
#define HF_MMT_ENTRY(NAME, MT, STAGES, OUT)                                                                        \
    HF_KERNEL void __launch_bounds__(256) NAME(const hf_bf16* x, const hf_bf16* w, OUT* y, uint32_t t, uint32_t n, \
                                               uint32_t k, uint32_t groups, uint32_t splits, uint32_t split_len) {  \
        hf_grid_dependency_wait();                                                                                \
        hf_matmul_mma_body<MT, STAGES, OUT>(x, w, y, t, n, k, groups, splits, split_len);                         \
    }
#else
// No tensor cores on this target: the entries exist (one module for every device) but are never
// picked.
#define HF_MMT_ENTRY(NAME, MT, STAGES, OUT)                                                                       \
    HF_KERNEL void NAME(const hf_bf16* x, const hf_bf16* w, OUT* y, uint32_t t, uint32_t n, uint32_t k,            \
                        uint32_t groups, uint32_t splits, uint32_t split_len) { hf_grid_dependency_wait(); }
#define HF_MMG_ENTRY(NAME, OUT) HF_MMT_ENTRY(NAME, 1, 1, OUT)
#endif

// 16 rows per block (decode steps), four stages in flight; 64 rows per block, three stages.
HF_MMT_ENTRY(hf_matmul_mma16_bf16, 1, 4, hf_bf16)
HF_MMT_ENTRY(hf_matmul_mma16_f32, 1, 4, float)
HF_MMT_ENTRY(hf_matmul_mma64_bf16, 4, 3, hf_bf16)
HF_MMT_ENTRY(hf_matmul_mma64_f32, 4, 3, float)
// 64 × 128 block tiles for many rows.
HF_MMG_ENTRY(hf_matmul_mma_tiled_bf16, hf_bf16)
HF_MMG_ENTRY(hf_matmul_mma_tiled_f32, float)
