// The memory-system ceiling of the mHC projection pass's loads, without its arithmetic.
//
// The streamed projection (mhc/src/kernels.cu, `mhc_project_mma` with RING) reads the residual
// [T, 4, H] bf16 one m-tile of 16 tokens at a time: block (split, run) takes 512 bytes of each of
// the 4 streams of a token (a split's 256 h) through a ring of ST stages of 32 KiB, one block of 8
// warps per multiprocessor, a block barrier per m-tile. It has measured 59-65% of the copy rate;
// the finish pass, reading whole rows, 83-92%. This probe times the same loads with the
// arithmetic replaced by a shared-memory read (and optionally a spin of SPIN cycles per m-tile
// standing in for it: by the projection's share of the op's time, the pass spends about 3000
// cycles per m-tile and block on an H200 at H 4096, T 16384, its loads' wait included), so the
// gap between the two is the access scheme's or the arithmetic's:
//
//   proj      cp.async, 16 bytes a lane, as the pass issues them (ST stages, blocks per SM);
//   proj flat the same bytes per block but a split as 2 KiB of the flattened 4 H row;
//   proj ilv  a split's blocks taking every per-th m-tile instead of a contiguous run of them;
//   tma       one 3D tensor copy {256 h, 4 streams, 16 tokens} per m-tile, issued by one thread,
//             completion on an mbarrier.
//
// Against a contiguous read and a copy of the same buffer (rates in GB/s; the fraction is of
// the copy's read + write rate, the report's convention). Build and run on a GPU host:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -o mhc_loads benches/probes/mhc_loads.cu \
//       -L/usr/local/cuda/lib64/stubs -lcuda && ./mhc_loads
//
// (`benches/open-rows.sh` does so where `nvcc` is found.) It measures the memory system, not a
// holdfast kernel: nothing here computes a result.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include <cuda.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
template <bool PF> __device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
    if (PF) asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    else asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void waitg() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// A contiguous streaming read of n 16-byte words (the XOR only keeps the loads alive).
__global__ void read_contig(const uint4* __restrict__ p, size_t n, uint32_t* out) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[0] = acc;
}
// A contiguous copy of n 16-byte words: the copy rate the fractions are of.
__global__ void copy_contig(const uint4* __restrict__ p, uint4* __restrict__ q, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) q[i] = p[i];
}

// The projection's m-tile loads through a ring of ST cp.async stages. FLAT: split s covers bytes
// [2048 s, 2048 s + 2048) of a token's flattened 4 H row; else 512 bytes of each stream. SPIN:
// cycles spent per m-tile before the block barrier (the arithmetic's stand-in). ILV: block k of a
// split takes m-tiles k, k + per, k + 2 per, ... (the splits' blocks all near the same tokens)
// instead of the k-th contiguous run of them.
template <int ST, bool FLAT, int SPIN, bool ILV = false>
__global__ void __launch_bounds__(256) proj(const uint16_t* __restrict__ res, uint32_t T, uint32_t H, uint32_t* out) {
    extern __shared__ __align__(16) unsigned char sm[];
    const uint32_t S = H / 256, M = T / 16;
    const uint32_t per = gridDim.x / S, split = blockIdx.x / per, k = blockIdx.x % per;
    if (split >= S) return;
    const uint32_t m0 = (uint32_t)((uint64_t)M * k / per), m1 = (uint32_t)((uint64_t)M * (k + 1) / per);
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const uint32_t stage = 32768, slot = smem_addr(sm) + warp * 4096 + lane * 16;
    auto issue = [&](uint32_t m, uint32_t st) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            const uint64_t t = 16 * m + g + 8 * rr;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const uint64_t e = FLAT ? t * 4 * H + split * 1024 + c * 256 + warp * 32 + q * 8
                                        : (t * 4 + c) * H + split * 256 + warp * 32 + q * 8;
                cp16<true>(slot + st * stage + 512u * (2 * c + rr), res + e);
            }
        }
    };
    const uint32_t Mb = ILV ? (k < M ? (M - k + per - 1) / per : 0u) : m1 - m0;
    auto mtile = [&](uint32_t i) { return ILV ? k + per * i : m0 + i; };
#pragma unroll
    for (int s = 0; s < ST - 1; ++s) { if ((uint32_t)s < Mb) issue(mtile(s), s); commit(); }
    uint32_t acc = 0;
    for (uint32_t i = 0; i < Mb; ++i) {
        if (i + ST - 1 < Mb) issue(mtile(i + ST - 1), (i + ST - 1) % ST);
        commit();
        waitg<ST - 1>();
        const uint32_t base = slot + (i % ST) * stage;
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            uint32_t x, y, z, w;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "r"(base + 512u * p));
            acc ^= x ^ y ^ z ^ w;
        }
        if (SPIN) { long long c0 = clock64(); while (clock64() - c0 < SPIN) {} }
        __syncthreads();
    }
    if (acc == 0x12345678u) out[0] = acc;
}


__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n .reg .pred p;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap* tm, uint32_t x, uint32_t y, uint32_t z, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(tm), "r"(x), "r"(y), "r"(z), "r"(bar) : "memory");
}
// The same m-tiles as proj, each one 3D TMA box {256 h, 4 streams, 16 tokens} (32 KB) issued by thread 0.
template <int ST, int SPIN>
__global__ void __launch_bounds__(256) proj_tma(const __grid_constant__ CUtensorMap tm, uint32_t T, uint32_t H, uint32_t* out) {
    extern __shared__ __align__(1024) unsigned char smt[];  // its own name: one alignment per symbol
    const uint32_t S = H / 256, M = T / 16;
    const uint32_t per = gridDim.x / S, split = blockIdx.x / per, k = blockIdx.x % per;
    if (split >= S) return;
    const uint32_t m0 = (uint32_t)((uint64_t)M * k / per), m1 = (uint32_t)((uint64_t)M * (k + 1) / per);
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const uint32_t stage = 32768, base0 = smem_addr(smt), bars = base0 + ST * stage;
    const uint32_t Mb = m1 - m0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) mbar_init(bars + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int s = 0; s < ST - 1; ++s)
            if ((uint32_t)s < Mb) { mbar_expect_tx(bars + 8 * s, stage); tma3(base0 + s * stage, &tm, split * 256, 0, 16 * (m0 + s), bars + 8 * s); }
    uint32_t acc = 0;
    for (uint32_t i = 0; i < Mb; ++i) {
        if (threadIdx.x == 0 && i + ST - 1 < Mb) {
            const uint32_t st = (i + ST - 1) % ST;
            mbar_expect_tx(bars + 8 * st, stage);
            tma3(base0 + st * stage, &tm, split * 256, 0, 16 * (m0 + i + ST - 1), bars + 8 * st);
        }
        mbar_wait(bars + 8 * (i % ST), (i / ST) & 1u);
        const uint32_t base = base0 + (i % ST) * stage;
#pragma unroll
        for (int rr = 0; rr < 2; ++rr)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                uint32_t x, y, z, w;
                const uint32_t a = base + (((g + 8 * rr) * 4 + c) * 256 + warp * 32 + q * 8) * 2;
                asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(x), "=r"(y), "=r"(z), "=r"(w) : "r"(a));
                acc ^= x ^ y ^ z ^ w;
            }
        if (SPIN) { long long c0 = clock64(); while (clock64() - c0 < SPIN) {} }
        __syncthreads();
    }
    if (acc == 0x12345678u) out[0] = acc;
}

// Median time of `iters` runs of f (after two warm-up runs), microseconds.
template <typename F> float timeit(F f, int iters = 20) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    f(); f(); CK(cudaDeviceSynchronize());
    std::vector<float> v;
    for (int i = 0; i < iters; ++i) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); v.push_back(ms); }
    std::sort(v.begin(), v.end()); CK(cudaGetLastError()); return v[v.size() / 2] * 1000.0f;
}

int main() {
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp pr; CK(cudaGetDeviceProperties(&pr, 0));
    printf("device %s, %d SMs\n", pr.name, sms);
    const uint32_t T = 16384;
    for (uint32_t H : {4096u, 7168u}) {
        size_t bytes = (size_t)T * 4 * H * 2;
        uint16_t* r; uint4* w; uint32_t* o;
        CK(cudaMalloc(&r, bytes)); CK(cudaMalloc(&w, bytes)); CK(cudaMalloc(&o, 64)); CK(cudaMemset(r, 1, bytes));
        size_t n = bytes / 16;
        float tc = timeit([&] { copy_contig<<<sms * 8, 256>>>((const uint4*)r, w, n); });
        float tr = timeit([&] { read_contig<<<sms * 8, 256>>>((const uint4*)r, n, o); });
        double copy_rate = 2.0 * bytes / tc / 1e3;  // GB/s counting read + write
        printf("H %u T %u: %.1f MB; copy %.1f us (%.0f GB/s r+w); contiguous read %.1f us (%.0f GB/s, %.1f%% of copy)\n",
               H, T, bytes / 1e6, tc, copy_rate, tr, bytes / tr / 1e3, 100.0 * bytes / tr / 1e3 / copy_rate);
        const uint32_t S = H / 256;
#define RUN(ST, FLAT, SPIN, BPS) RUNI(ST, FLAT, SPIN, BPS, false)
#define RUNI(ST, FLAT, SPIN, BPS, ILV) { auto k = proj<ST, FLAT, SPIN, ILV>; int sb = ST * 32768; \
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sb)); \
        uint32_t per = (sms * BPS) / S; float t = timeit([&] { k<<<S * per, 256, sb>>>(r, T, H, o); }); \
        printf("  proj ST %d flat %d ilv %d spin %4d blocks/SM %d grid %u: %.1f us (%.0f GB/s, %.1f%% of copy)\n", ST, (int)FLAT, (int)ILV, SPIN, BPS, S * per, t, bytes / t / 1e3, 100.0 * bytes / t / 1e3 / copy_rate); }
        RUN(2, false, 0, 1) RUN(3, false, 0, 1) RUN(4, false, 0, 1) RUN(6, false, 0, 1)
        RUN(3, true, 0, 1) RUN(4, true, 0, 1)
        RUNI(3, false, 0, 1, true) RUNI(3, false, 1000, 1, true) RUNI(3, true, 0, 1, true)
        RUN(3, false, 500, 1) RUN(3, false, 1000, 1) RUN(4, false, 1000, 1) RUN(6, false, 1000, 1)
        RUN(3, false, 2000, 1) RUN(6, false, 2000, 1)
        RUN(3, false, 0, 2) RUN(3, false, 1000, 2) RUN(2, false, 1000, 3)

        CUtensorMap tm;
        {
            cuuint64_t dims[3] = {H, 4, T};
            cuuint64_t strides[2] = {(cuuint64_t)H * 2, (cuuint64_t)H * 8};
            cuuint32_t box[3] = {256, 4, 16}, es[3] = {1, 1, 1};
            CUresult cr = cuTensorMapEncodeTiled(&tm, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, r, dims, strides, box, es,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
            if (cr != CUDA_SUCCESS) {
                printf("  tma: cuTensorMapEncodeTiled failed (%d); skipped\n", (int)cr);
                cudaFree(r); cudaFree(w); cudaFree(o);
                continue;
            }
        }
#define RUNT(ST, SPIN, BPS) { auto k = proj_tma<ST, SPIN>; int sb = ST * 32768 + 64; \
        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sb)); \
        uint32_t per = (sms * BPS) / S; float t = timeit([&] { k<<<S * per, 256, sb>>>(tm, T, H, o); }); \
        printf("  tma  ST %d              spin %4d blocks/SM %d grid %u: %.1f us (%.0f GB/s, %.1f%% of copy)\n", ST, SPIN, BPS, S * per, t, bytes / t / 1e3, 100.0 * bytes / t / 1e3 / copy_rate); }
        RUNT(2, 0, 1) RUNT(3, 0, 1) RUNT(4, 0, 1) RUNT(6, 0, 1) RUNT(3, 1000, 1) RUNT(6, 1000, 1)
        RUNT(3, 2000, 1) RUNT(6, 2000, 1) RUNT(3, 0, 2) RUNT(3, 1000, 2)
        cudaFree(r); cudaFree(w); cudaFree(o);
    }
    return 0;
}
