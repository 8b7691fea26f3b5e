// holdfast kernel portability header: one kernel source for NVRTC (CUDA) and hipRTC (HIP).
// The HAL prepends it to every kernel source. It needs no toolkit headers, so kernels compile
// with a bare NVRTC or hipRTC (no CUDA/ROCm include directory at run time or in CI).
//
// Provides: fixed-width integer types; `hf_bf16` / `hf_f16` 16-bit storage types with
// round-to-nearest-even f32 conversions (bit-identical to the `half` crate); HF_WARP_SIZE (32 on
// NVIDIA, 64 on CDNA; the HAL passes -DHF_WARP_SIZE=<device warp size>); warp shuffles and
// warp-wide sum/max; HF_KERNEL for `extern "C" __global__`; on NVIDIA sm_80+ (HF_HAS_MMA) the
// tensor-core primitives: cp.async 16-byte copies into shared memory, ldmatrix, and the bf16
// m16n8k16 mma with f32 accumulators; on NVIDIA sm_90+ (HF_HAS_CLUSTERS) thread-block cluster
// ranks, barriers and reads of another block's shared memory.
#pragma once
#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP__)
#define HF_HIP 1
#ifndef HF_WARP_SIZE
#define HF_WARP_SIZE 64
#endif
#define hf_shfl_xor(v, m) __shfl_xor((v), (m), HF_WARP_SIZE)
#define hf_shfl(v, l) __shfl((v), (l), HF_WARP_SIZE)
#else
#define HF_CUDA 1
#ifndef HF_WARP_SIZE
#define HF_WARP_SIZE 32
#endif
#define hf_shfl_xor(v, m) __shfl_xor_sync(0xffffffffu, (v), (m))
#define hf_shfl(v, l) __shfl_sync(0xffffffffu, (v), (l))
#endif

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define HF_KERNEL extern "C" __global__

// bf16 storage: the upper 16 bits of an IEEE f32.
struct hf_bf16 { uint16_t bits; };
// f16 storage (IEEE binary16); conversions are added with the first kernel that needs them.
struct hf_f16 { uint16_t bits; };

__device__ __forceinline__ float hf_bf16_to_f32(hf_bf16 x) { return __uint_as_float(((uint32_t)x.bits) << 16); }
// The definition of the f32 -> bf16 rounding, in integer steps: a NaN becomes the quiet NaN of
// its sign and upper bits, everything else rounds to nearest, ties to even (subnormals and the
// overflow to infinity included).
__device__ __forceinline__ uint16_t hf_f32_to_bf16_bits_soft(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    return (uint16_t)(u >> 16);
}
// f32 -> bf16 as the definition above. On NVIDIA sm_80+ a number takes the hardware conversion
// (cvt.rn.bf16.f32: IEEE round to nearest even, subnormals kept, one instruction); NaNs keep the
// integer path, whose payload rule the hardware does not follow.
__device__ __forceinline__ hf_bf16 hf_f32_to_bf16(float f) {
    hf_bf16 r;
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (uint16_t)((u >> 16) | 0x0040u);
    } else {
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        r.bits = h;
    }
#else
    r.bits = hf_f32_to_bf16_bits_soft(__float_as_uint(f));
#endif
    return r;
}

// Two f32 -> bf16 conversions, round to nearest even, `lo` in the low half, where a NaN's payload
// does not matter (operands of a product, whose result is NaN whatever the payload): a number
// converts as hf_f32_to_bf16 does; a NaN becomes some quiet NaN. One cvt.rn.bf16x2.f32 on NVIDIA
// sm_80+, hf_f32_to_bf16 per element elsewhere.
__device__ __forceinline__ uint32_t hf_pack_bf16x2_any_nan(float lo, float hi) {
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (uint32_t)hf_f32_to_bf16(lo).bits | ((uint32_t)hf_f32_to_bf16(hi).bits << 16);
#endif
}
// Two f32 -> bf16 conversions (hf_f32_to_bf16) packed into one word, `lo` in the low half: on
// NVIDIA sm_80+ the paired conversion above, then a NaN's half replaced by the definition's quiet
// NaN (predicated, no branch), so the bits are hf_f32_to_bf16's for every input.
__device__ __forceinline__ uint32_t hf_pack_bf16x2(float lo, float hi) {
    uint32_t r = hf_pack_bf16x2_any_nan(lo, hi);
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
    if (lo != lo) r = (r & 0xffff0000u) | (__float_as_uint(lo) >> 16) | 0x0040u;
    if (hi != hi) r = (r & 0x0000ffffu) | (__float_as_uint(hi) & 0xffff0000u) | 0x00400000u;
#endif
    return r;
}

// Sum over the lanes of one warp/wavefront (every lane gets the total, same order on every lane).
__device__ __forceinline__ float hf_warp_sum(float v) {
    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) v += hf_shfl_xor(v, m);
    return v;
}
// Max over the lanes of one warp/wavefront (every lane gets the max).
__device__ __forceinline__ float hf_warp_max(float v) {
    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, hf_shfl_xor(v, m));
    return v;
}
// A length clamped to [0, width].
__device__ __forceinline__ int32_t hf_clamp_len(int32_t len, uint32_t width) {
    return len < 0 ? 0 : ((uint32_t)len < width ? len : (int32_t)width);
}
// Sum of v over the block's threads (blockDim.x a power of two; `part` a shared array of
// blockDim.x entries), returned to every thread; the block may reuse `part` right after. Warp
// shuffles, then one shared-memory round over the warps' totals (two barriers in all); integer
// sums, so the result does not depend on the order.
__device__ __forceinline__ int32_t hf_block_sum_i32(int32_t v, int32_t* part) {
    if (blockDim.x < HF_WARP_SIZE) {
        part[threadIdx.x] = v;
        __syncthreads();
        for (uint32_t s = blockDim.x / 2; s > 0; s >>= 1) {
            if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
            __syncthreads();
        }
        const int32_t total = part[0];
        __syncthreads();
        return total;
    }
    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) v += hf_shfl_xor(v, m);
    if (threadIdx.x % HF_WARP_SIZE == 0) part[threadIdx.x / HF_WARP_SIZE] = v;
    __syncthreads();
    int32_t total = 0;
    for (uint32_t w = 0; w < blockDim.x / HF_WARP_SIZE; ++w) total += part[w];
    __syncthreads();
    return total;
}

// Exclusive prefix sum of v over the block's threads in thread order (blockDim.x a multiple of
// the warp size, at most HF_WARP_SIZE warps; `part` a shared array of one entry per warp), and the
// block's total in *total, for every thread; the block may reuse `part` right after.
__device__ __forceinline__ int32_t hf_block_exclusive_scan_i32(int32_t v, int32_t* part, int32_t* total) {
    const int lane = (int)(threadIdx.x % HF_WARP_SIZE);
    const uint32_t warp = threadIdx.x / HF_WARP_SIZE;
    int32_t x = v;  // inclusive within the warp
    for (int d = 1; d < HF_WARP_SIZE; d <<= 1) {
        const int32_t y = hf_shfl(x, lane >= d ? lane - d : lane);
        if (lane >= d) x += y;
    }
    if (lane == HF_WARP_SIZE - 1) part[warp] = x;
    __syncthreads();
    int32_t before = 0, all = 0;
    for (uint32_t w = 0; w < blockDim.x / HF_WARP_SIZE; ++w) {
        const int32_t p = part[w];
        if (w < warp) before += p;
        all += p;
    }
    __syncthreads();
    *total = all;
    return before + x - v;
}

// This thread's share of sum_{q < t} f(q): the q with q % blockDim.x == threadIdx.x, four per
// round so that their loads are in flight together (f is called for in-range q only). Integers:
// the block's total does not depend on the split.
template <typename F>
__device__ __forceinline__ int32_t hf_thread_sum_below(uint32_t t, F f) {
    const uint32_t b = blockDim.x;
    int32_t s = 0;
    uint32_t q = threadIdx.x;
    for (; q + 3u * b < t; q += 4u * b) {
        const int32_t x0 = f(q), x1 = f(q + b), x2 = f(q + 2u * b), x3 = f(q + 3u * b);
        s += (x0 + x1) + (x2 + x3);
    }
    for (; q < t; q += b) s += f(q);
    return s;
}

// Cross-block signalling within one launch, for blocks that are all resident at once (the caller
// sizes its grid so). hf_block_release_add_u32, called by every thread of a block, publishes what
// the block wrote and then adds 1 to a counter; hf_acquire_until_u32, called by one thread, waits
// until the counter reaches a target (that thread's block barrier then passes the guarantee on).
// NVIDIA sm_70+: a block barrier, then red.release.gpu by one thread, and ld.acquire.gpu polls (no
// full fence); elsewhere every thread fences before the barrier, and the poll is volatile, then
// fenced.
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
#define HF_RELEASE_ACQUIRE 1
#endif
__device__ __forceinline__ void hf_block_release_add_u32(uint32_t* counter) {
#if defined(HF_RELEASE_ACQUIRE)
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
#else
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(counter, 1u);
#endif
}

__device__ __forceinline__ void hf_acquire_until_u32(const uint32_t* counter, uint32_t target) {
#if defined(HF_RELEASE_ACQUIRE)
    uint32_t v;
    do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    } while (v < target);
#else
    while (*(const volatile uint32_t*)counter < target) {
    }
    __threadfence();
#endif
}

// Called by every thread of a block: publishes what the block wrote (as
// hf_block_release_add_u32), counts the block on `counter`, and returns true in every thread of
// the block that arrives last of `blocks`, whose later reads and writes are ordered after every
// counted block's writes. No block waits, so the grid need not be resident at once. `flag` is a
// shared word of the caller's. NVIDIA sm_70+: one atom.acq_rel.gpu by thread 0; elsewhere fences
// around a plain atomic.
__device__ __forceinline__ bool hf_block_arrives_last(uint32_t* counter, uint32_t blocks, uint32_t* flag) {
#if defined(HF_RELEASE_ACQUIRE)
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
        *flag = old == blocks - 1u;
    }
#else
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *flag = atomicAdd(counter, 1u) == blocks - 1u;
        if (*flag) __threadfence();
    }
#endif
    __syncthreads();
    return *flag != 0u;
}

// Programmatic dependent launch (Stream::launch_dependent): hf_grid_dependency_wait() returns once
// the kernel launched before this one on its stream has finished and its writes are visible (and
// so every kernel before that, as long as each dependent kernel's blocks wait before they end);
// hf_grid_dependents_launch() lets the next dependent launch begin early. No-ops where the device
// or backend has no such launch (it was then an ordinary, fully ordered launch).
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
__device__ __forceinline__ void hf_grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void hf_grid_dependents_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#else
__device__ __forceinline__ void hf_grid_dependency_wait() {}
__device__ __forceinline__ void hf_grid_dependents_launch() {}
#endif
// The first statement of a kernel launched with Stream::launch_dependent: lets the next
// dependent launch begin (its blocks then wait in their own start), then waits for the kernel
// before this one. Every block runs it before any memory access and before any early return: a
// kernel whose blocks could finish before that wait would let the kernel after it pass its own
// wait while the one before still runs.
__device__ __forceinline__ void hf_dependent_kernel_start() {
    hf_grid_dependents_launch();
    hf_grid_dependency_wait();
}

#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
#define HF_HAS_MMA 1
// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t hf_smem_addr(const void* p) {
    uint32_t r;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// 16 bytes global -> shared, asynchronously; bytes past `src_bytes` (0 or 16) are zero-filled.
// L2_256: also asks L2 to fetch the whole 256-byte block around `src` from memory (for copies
// whose neighbours other threads ask for at about the same time).
template <bool L2_256 = false>
__device__ __forceinline__ void hf_cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    if constexpr (L2_256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                     : "memory");
    else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void hf_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N committed cp.async groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void hf_cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void hf_cp_async_wait_all() { hf_cp_async_wait<0>(); }
__device__ __forceinline__ void hf_ldsm_x4(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
}
__device__ __forceinline__ void hf_ldsm_x2(uint32_t a, uint32_t& r0, uint32_t& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(a) : "memory");
}
__device__ __forceinline__ void hf_ldsm_x4_t(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a) : "memory");
}
// c += a · b for one m16n8k16 tile (row-major A, column-major B, f32 accumulators). Element
// (i, j) of the result depends on row i of A, column j of B and c[i][j] only.
__device__ __forceinline__ void hf_mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
// Shared-memory barriers (mbarrier, sm_90): an 8-byte object at shared address `a` whose phase
// completes when `count` arrivals came (hf_mbar_init by one thread, then a block barrier before
// use). hf_mbar_arrive releases the arriving thread's earlier writes; hf_mbar_wait(a, parity)
// waits until the phase of that parity (0 for the first completion, then 1, 0, ..) completed and
// acquires them.
__device__ __forceinline__ void hf_mbar_init(uint32_t a, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void hf_mbar_arrive(uint32_t a) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void hf_mbar_wait(uint32_t a, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tHF_MBAR_WAIT:\n\t"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra HF_MBAR_WAIT;\n\t}" ::"r"(a), "r"(parity) : "memory");
}
#endif

// Warpgroup MMA (NVIDIA sm_90a, HF_HAS_WGMMA: the device's architecture-specific target, which the
// HAL compiles for on sm_90): 128 threads (a warpgroup, four consecutive warps) multiply a 64-row A
// by an N-column B from shared-memory descriptors into f32 accumulators held across the warpgroup.
// Operands use the no-swizzle layout of 8-row x 16-byte core matrices (128 contiguous bytes each):
// hf_wgmma_desc(start, lbo, sbo) with `lbo` the byte step between core matrices along K and `sbo`
// along M/N for a K-major operand, and the reverse for an MN-major one (_tb: B is N-major). The
// accumulator of thread i of the warpgroup holds rows 16·(i/32) + (i%32)/4 (+8) and columns
// 8·j + 2·(i%4) (+1) of n-chunk j, as mma.sync's m16n8 C fragment per warp. `accumulate` 0
// overwrites d. hf_wgmma_fence() before the first MMA that reads registers written since; then
// hf_wgmma_commit() and hf_wgmma_wait<N>() (at most N groups left in flight) before d is read.
// Shared memory written by ordinary stores or cp.async must be published to the MMA's async proxy
// first: hf_fence_proxy_async() by the writing threads, then a barrier.
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HF_HAS_WGMMA 1
__device__ __forceinline__ uint64_t hf_wgmma_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((smem_addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFFu) << 16)
           | ((uint64_t)((sbo >> 4) & 0x3FFFu) << 32);
}
// The same for the 128-byte-swizzled layout (swizzle mode 1): rows of 128 bytes whose 16-byte
// chunk c sits at chunk c ^ (address bits 7-9), so the operand's 1024-byte atoms must start
// 1024-aligned. K-major: `sbo` the byte step between 8-row groups (`lbo` unused, pass 16), and a
// k-step inside a 128-byte row advances the start address by its bytes. MN-major: `lbo` the byte
// step between 64-element column blocks, `sbo` between 8-row groups along K.
__device__ __forceinline__ uint64_t hf_wgmma_desc_sw128(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
    return hf_wgmma_desc(smem_addr, lbo, sbo) | (1ull << 62);
}
__device__ __forceinline__ void hf_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void hf_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void hf_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void hf_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The accumulator operands of the wgmma wrappers below: HF_WGMMA_DN(i) is "+f"(d[j]) for j in
// [i, i + N), in order (operands %i .. of the instruction's accumulator list).
#define HF_WGMMA_D8(i)                                                                                      \
    "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
        "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define HF_WGMMA_D16(i) HF_WGMMA_D8(i), HF_WGMMA_D8((i) + 8)
#define HF_WGMMA_D32(i) HF_WGMMA_D16(i), HF_WGMMA_D16((i) + 16)
#define HF_WGMMA_D64(i) HF_WGMMA_D32(i), HF_WGMMA_D32((i) + 32)
__device__ __forceinline__ void hf_wgmma_m64n32k16(float* d, uint64_t a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
        "}, %16, %17, p, 1, 1, 0, 0;\n\t}"
        : HF_WGMMA_D16(0)
        : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void hf_wgmma_m64n64k16(float* d, uint64_t a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %34, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, %32, %33, p, 1, 1, 0, 0;\n\t}"
        : HF_WGMMA_D32(0)
        : "l"(a), "l"(b), "r"(accumulate));
}
// A from registers (wgmma's RS form): the warpgroup's 64 x 16 A tile as four b32 registers per
// thread in mma.sync's m16n8k16 A fragment layout, warp w holding rows 16w .. 16w + 15 (a[0]: row
// (lane/4), columns 2·(lane%4) +0/1; a[1]: the row + 8; a[2], a[3]: the same rows, columns + 8):
// what hf_ldsm_x4 gives with lane l addressing row (l/8 % 2)·8 + l%8, column (l/16)·8 of the tile.
// The registers must not change until the MMA completed (hf_wgmma_wait).
__device__ __forceinline__ void hf_wgmma_m64n64k16_rs(float* d, const uint32_t* a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
        "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n\t}"
        : HF_WGMMA_D32(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void hf_wgmma_m64n128k16_tb(float* d, uint64_t a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %66, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
        "}, %64, %65, p, 1, 1, 0, 1;\n\t}"
        : HF_WGMMA_D64(0)
        : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void hf_wgmma_m64n256k16_tb(float* d, uint64_t a, uint64_t b, uint32_t accumulate) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %130, 0;\n\t"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
        "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
        "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
        "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
        "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
        "}, %128, %129, p, 1, 1, 0, 1;\n\t}"
        : HF_WGMMA_D64(0), HF_WGMMA_D64(64)
        : "l"(a), "l"(b), "r"(accumulate));
}
#endif

// Thread-block clusters (Stream::launch_cluster; NVIDIA sm_90+, HF_HAS_CLUSTERS): the block's rank
// in its cluster and the cluster's block count; a barrier over the cluster's blocks that every
// thread of each block reaches, which also orders each block's shared-memory writes before the
// other blocks' reads after it (release/acquire); and a read of a shared-memory variable in
// another block of the cluster. A block must not exit while others may still read its shared
// memory (end with hf_cluster_sync). Elsewhere the HAL refuses cluster launches, so these are
// absent.
#if defined(HF_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define HF_HAS_CLUSTERS 1
__device__ __forceinline__ uint32_t hf_cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t hf_cluster_blocks() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void hf_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// hf_cluster_sync in two halves whose release covers only this block's shared-memory accesses:
// the barrier orders them (writes the other blocks read after it, reads whose values were used
// before it) but waits for none of the thread's global stores or copies in flight
// (hf_cluster_sync's release is GPU-wide: MEMBAR.ALL.GPU, which does; this one compiles to
// MEMBAR.ALL.CTA). Every thread of each block calls them in turn (arrive, wait, arrive, ...), so
// a block can work between its arrival and its wait. For loops whose blocks exchange
// shared-memory values while their global traffic streams on; a global write that another block
// reads after the barrier needs hf_cluster_sync. The release does not order this thread's reads
// of other blocks' shared memory (ld.shared::cluster): before a block rewrites memory that
// others read, their reads must have completed before their arrival (their values used, e.g.
// stored, ahead of a block barrier that precedes it), or they must use hf_cluster_sync.
__device__ __forceinline__ void hf_cluster_arrive_shared() {
    asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n\tbarrier.cluster.arrive.relaxed.aligned;" :::
                     "memory");
}
__device__ __forceinline__ void hf_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ void hf_cluster_sync_shared() {
    hf_cluster_arrive_shared();
    hf_cluster_wait();
}
// The cluster address of shared-memory pointer p (of this block's shared memory) in block `rank`.
__device__ __forceinline__ uint32_t hf_cluster_map(const void* p, uint32_t rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(hf_smem_addr(p)), "r"(rank));
    return remote;
}
// Shared-memory barriers that other blocks of the cluster complete (sm_90): after
// hf_mbar_init, hf_mbar_fence_init_cluster makes the initialisation visible to the cluster's
// asynchronous stores (then a cluster barrier before any block stores into this one).
// hf_mbar_arrive_expect_tx arrives once and expects `bytes` more of asynchronous stores in the
// current phase; hf_mbar_wait_cluster waits for the phase of that parity and acquires what the
// cluster's stores that completed it wrote.
__device__ __forceinline__ void hf_mbar_fence_init_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void hf_mbar_arrive_expect_tx(uint32_t a, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void hf_mbar_wait_cluster(uint32_t a, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n\tHF_MBAR_WAIT_CL:\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra HF_MBAR_WAIT_CL;\n\t}" ::"r"(a), "r"(parity) : "memory");
}
// Stores four f32 at 16-byte-aligned shared-memory pointer p (of this block's shared memory) in
// block `rank` of the cluster, completing 16 bytes of the current phase of that block's barrier
// at `bar` (the same offset as this block's): no wait, and the barrier's waiters see the values.
__device__ __forceinline__ void hf_cluster_store_async_f32x4(float* p, uint32_t rank, float4 v, const void* bar) {
    const uint32_t remote = hf_cluster_map(p, rank), remote_bar = hf_cluster_map(bar, rank);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                     remote),
                 "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
                 "r"(__float_as_uint(v.w)), "r"(remote_bar)
                 : "memory");
}
// The f32 at shared-memory pointer p (of this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ float hf_cluster_load_f32(const float* p, uint32_t rank) {
    const uint32_t remote = hf_cluster_map(p, rank);
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
// The four f32 at 16-byte-aligned shared-memory pointer p in block `rank` of the cluster.
__device__ __forceinline__ float4 hf_cluster_load_f32x4(const float* p, uint32_t rank) {
    const uint32_t remote = hf_cluster_map(p, rank);
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
    return v;
}
#endif
