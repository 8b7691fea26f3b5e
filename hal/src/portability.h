// holdfast kernel portability header: one kernel source for NVRTC (CUDA) and hipRTC (HIP).
// Prepended by the HAL to every kernel source; kernels include nothing else.
#pragma once
#if defined(__HIPCC_RTC__) || defined(__HIP_PLATFORM_AMD__)
#define HF_HIP 1
#include <hip/hip_bf16.h>
#include <hip/hip_fp16.h>
typedef __hip_bfloat16 hf_bf16;
typedef __half hf_f16;
#ifndef HF_WARP_SIZE
#define HF_WARP_SIZE 64
#endif
#define HF_FULL_MASK 0xffffffffffffffffull
#define hf_shfl_xor(v, m) __shfl_xor((v), (m))
#define hf_shfl(v, l) __shfl((v), (l))
#else
#define HF_CUDA 1
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef __nv_bfloat16 hf_bf16;
typedef __half hf_f16;
#define HF_WARP_SIZE 32
#define HF_FULL_MASK 0xffffffffu
#define hf_shfl_xor(v, m) __shfl_xor_sync(HF_FULL_MASK, (v), (m))
#define hf_shfl(v, l) __shfl_sync(HF_FULL_MASK, (v), (l))
#endif

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define HF_KERNEL extern "C" __global__

__device__ __forceinline__ float hf_bf16_to_f32(hf_bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ hf_bf16 hf_f32_to_bf16(float x) { return __float2bfloat16(x); }
__device__ __forceinline__ float hf_f16_to_f32(hf_f16 x) { return __half2float(x); }
__device__ __forceinline__ hf_f16 hf_f32_to_f16(float x) { return __float2half(x); }

// Sum over the lanes of one warp/wavefront (every lane gets the total).
__device__ __forceinline__ float hf_warp_sum(float v) {
    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) v += hf_shfl_xor(v, m);
    return v;
}
// Max over the lanes of one warp/wavefront (every lane gets the max).
__device__ __forceinline__ float hf_warp_max(float v) {
    for (int m = HF_WARP_SIZE / 2; m > 0; m >>= 1) v = fmaxf(v, hf_shfl_xor(v, m));
    return v;
}
