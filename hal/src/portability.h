// holdfast kernel portability header: one kernel source for NVRTC (CUDA) and hipRTC (HIP).
// The HAL prepends it to every kernel source. It needs no toolkit headers, so kernels compile
// with a bare NVRTC or hipRTC (no CUDA/ROCm include directory at run time or in CI).
//
// Provides: fixed-width integer types; `hf_bf16` / `hf_f16` 16-bit storage types with
// round-to-nearest-even f32 conversions (bit-identical to the `half` crate); HF_WARP_SIZE (32 on
// NVIDIA, 64 on CDNA; the HAL passes -DHF_WARP_SIZE=<device warp size>); warp shuffles and
// warp-wide sum/max; HF_KERNEL for `extern "C" __global__`.
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
__device__ __forceinline__ hf_bf16 hf_f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    hf_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) { r.bits = (uint16_t)((u >> 16) | 0x0040u); return r; }  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    r.bits = (uint16_t)(u >> 16);
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
