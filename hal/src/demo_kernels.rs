//! A few small kernels used by the HAL's example, tests and benches: each has a CUDA/HIP source
//! and a CPU reference with the same arguments. Shapes are 1-D `[n]` unless noted.

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::bf16;
use crate::cpu::CpuLaunch;
use crate::error::Result;
use crate::kernel::{KernelEntry, KernelSource, Param, ScalarKind};

const CODE: &str = r#"
HF_KERNEL void hf_axpy(const float* x, float* y, float a, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
HF_KERNEL void hf_scale(const float* x, float* out, float s, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = s * x[i];
}
HF_KERNEL void hf_add(const float* a, const float* b, float* out, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
HF_KERNEL void hf_gather(const float* src, const int32_t* idx, float* out, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { int32_t j = idx[i]; out[i] = j < 0 ? 0.0f : src[j]; }
}
HF_KERNEL void hf_touch(float* x, uint32_t n) {
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
// hf_touch for Stream::launch_dependent: lets the next launch begin, then waits for the previous.
HF_KERNEL void hf_touch_dependent(float* x, uint32_t n) {
    hf_grid_dependents_launch();
    hf_grid_dependency_wait();
    uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
HF_KERNEL void hf_row_sum_bf16(const hf_bf16* x, float* out, uint32_t rows, uint32_t cols) {
    uint32_t r = blockIdx.x;
    if (r >= rows) return;
    float acc = 0.0f;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) acc += hf_bf16_to_f32(x[(uint64_t)r * cols + c]);
    __shared__ float part[32];
    acc = hf_warp_sum(acc);
    uint32_t lane = threadIdx.x % HF_WARP_SIZE, warp = threadIdx.x / HF_WARP_SIZE;
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (uint32_t w = 0; w < (blockDim.x + HF_WARP_SIZE - 1) / HF_WARP_SIZE; ++w) t += part[w];
        out[r] = t;
    }
}
// Every f32 bit pattern p = (hi << 16) | lo for hi in [hi_first, hi_first + hi_count), lo < 2^16,
// through hf_f32_to_bf16 against the integer definition, and through the pair conversions with p
// in the low half and its halves swapped (every pattern again, NaN beside number included) in the
// high half: hf_pack_bf16x2 against the definition in both halves, hf_pack_bf16x2_any_nan in every
// half that is not a NaN's and a NaN in every half that is. out[0] += the mismatches, out[1] = min(out[1], the smallest pattern p
// with one). out starts as {0, 0xffffffff}.
HF_KERNEL void hf_bf16_round_check(uint32_t* out, uint32_t hi_first, uint32_t hi_count) {
    const uint64_t total = (uint64_t)hi_count << 16;
    uint32_t bad = 0u, first = 0xffffffffu;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t p = (hi_first << 16) + (uint32_t)i;
        const uint32_t q = (p >> 16) | (p << 16);
        const uint32_t want = (uint32_t)hf_f32_to_bf16_bits_soft(p) | ((uint32_t)hf_f32_to_bf16_bits_soft(q) << 16);
        const float fp = __uint_as_float(p), fq = __uint_as_float(q);
        const uint32_t any = hf_pack_bf16x2_any_nan(fp, fq);
        const bool p_nan = (p & 0x7fffffffu) > 0x7f800000u, q_nan = (q & 0x7fffffffu) > 0x7f800000u;
        const uint32_t any_lo = any & 0xffffu, any_hi = any >> 16;
        const bool ok = hf_f32_to_bf16(fp).bits == hf_f32_to_bf16_bits_soft(p) && hf_pack_bf16x2(fp, fq) == want &&
                        (p_nan ? (any_lo & 0x7fffu) > 0x7f80u : any_lo == (want & 0xffffu)) &&
                        (q_nan ? (any_hi & 0x7fffu) > 0x7f80u : any_hi == (want >> 16));
        if (!ok) {
            ++bad;
            first = p < first ? p : first;
        }
    }
    if (bad) {
        atomicAdd(&out[0], bad);
        atomicMin(&out[1], first);
    }
}
// For Stream::launch_cluster with clusters of `cluster` blocks: out[b] = the sum, in rank order from
// 0.0, of x[j] (0 for j >= n) over the blocks j of block b's cluster, for every block b < n; each
// block shares its x[b] through its shared memory, which the others read. A launch without the
// clusters asked for, or any launch on a device without clusters, writes NaN instead (`cluster`
// 1 asks for none). The shared value is first -x[b], summed, then overwritten with x[b] (both
// exchanges over hf_cluster_sync_shared; the overwrite waits for every block's first reads): a
// second sum that is not the first's negation (an ordering bug) writes +inf.
HF_KERNEL void hf_cluster_sum(const float* x, float* out, uint32_t cluster, uint32_t n) {
    const uint32_t b = blockIdx.x;
#if defined(HF_HAS_CLUSTERS)
    __shared__ float mine;
    const uint32_t blocks = hf_cluster_blocks();
    const float v = b < n ? x[b] : 0.0f;
    auto sum = [&]() {
        float s = 0.0f;
        for (uint32_t r = 0; r < blocks; ++r) s += hf_cluster_load_f32(&mine, r);
        return s;
    };
    __shared__ float negated;
    if (threadIdx.x == 0) mine = -v;
    hf_cluster_sync_shared();
    // The first sum's values are stored and a block barrier passed before the next arrival (the
    // pattern hf_cluster_sync_shared's users rely on for reads of another block's memory).
    if (threadIdx.x == 0) negated = sum();
    __syncthreads();
    hf_cluster_sync_shared();  // every block's reads of -x are done
    if (threadIdx.x == 0) mine = v;
    hf_cluster_sync_shared();
    if (threadIdx.x == 0 && b < n) {
        const float s = sum();
        const float checked = s == -negated ? s : __int_as_float(0x7f800000);
        out[b] = blocks == cluster && hf_cluster_rank() == b % cluster ? checked : __int_as_float(0x7fc00000);
    }
    hf_cluster_sync();  // no block leaves while the others may still read its shared memory
#else
    if (threadIdx.x == 0 && b < n) out[b] = __int_as_float(0x7fc00000);
#endif
}
// Warpgroup MMA with the operand layouts of portability.h (HF_HAS_WGMMA), one block of 256 threads
// (two warpgroups) and WGMMA_CHECK_SHARED_BYTES of dynamic shared memory: s [64, 64] = a · bkᵀ
// (a [64, 64], bk [64, 64] whose rows are s's columns: K-major B, 32 columns per warpgroup) and
// o [64, 512] = a · v (v [64, 512] whose rows run along K: N-major B, 256 columns per
// warpgroup), f32. `swizzle` 0: the no-swizzle layout, element (r, k) of an R x K tile at byte
// (r / 8)·16K + (k / 8)·128 + (r % 8)·16 + (k % 8)·2. `swizzle` 1: the 128-byte swizzle, element
// (r, k) at (k / 64)·128R + 128r + (((k % 64) / 8) ^ (r % 8))·16 + (k % 8)·2 from a 1024-aligned
// base. Bit 1 of `swizzle` (values 2, 3): s instead comes from warpgroup 0 alone (wgmma
// m64n64k16 over all 64 columns), handed to warpgroup 1 through shared memory and an mbarrier,
// which writes it. Bit 2 (values 4 .. 7): o's 256 columns per warpgroup as two m64n128k16, and
// with bit 1 warpgroup 0's a from registers (ldmatrix; hf_wgmma_m64n64k16_rs). Without warpgroup
// MMA, s and o are NaN.
HF_KERNEL void hf_wgmma_check(const hf_bf16* a, const hf_bf16* bk, const hf_bf16* v, float* s, float* o,
                              uint32_t swizzle) {
    const uint32_t tid = threadIdx.x;
#if defined(HF_HAS_WGMMA)
    extern __shared__ __align__(1024) unsigned char hf_smem_raw[];
    unsigned char* hf_smem = hf_smem_raw + ((1024u - (hf_smem_addr(hf_smem_raw) & 1023u)) & 1023u);
    const uint32_t a_s = hf_smem_addr(hf_smem), b_s = a_s + 8192u, v_s = a_s + 16384u;
    const bool sw = (swizzle & 1u) != 0u, whole = (swizzle & 2u) != 0u, regs = (swizzle & 4u) != 0u;
    __shared__ float s_handoff[64 * 64];
    __shared__ __align__(8) unsigned long long s_bar;
    if (tid == 0u) hf_mbar_init(hf_smem_addr(&s_bar), 128u);
    // Byte offset of (r, k) in an R x K tile.
    auto off = [&](uint32_t r, uint32_t k, uint32_t R, uint32_t K) -> uint32_t {
        return sw ? (k >> 6) * 128u * R + r * 128u + ((((k & 63u) >> 3) ^ (r & 7u)) << 4) + (k & 7u) * 2u
                  : (r >> 3) * 16u * K + (k >> 3) * 128u + (r & 7u) * 16u + (k & 7u) * 2u;
    };
    for (uint32_t i = tid; i < 64u * 64u; i += blockDim.x) {
        *(hf_bf16*)(hf_smem + off(i / 64u, i % 64u, 64u, 64u)) = a[i];
        *(hf_bf16*)(hf_smem + 8192u + off(i / 64u, i % 64u, 64u, 64u)) = bk[i];
    }
    for (uint32_t i = tid; i < 64u * 512u; i += blockDim.x) *(hf_bf16*)(hf_smem + 16384u + off(i / 512u, i % 512u, 64u, 512u)) = v[i];
    hf_fence_proxy_async();
    __syncthreads();
    const uint32_t wg = tid >> 7, row = ((tid >> 5) & 3u) * 16u + ((tid & 31u) >> 2), col = 2u * (tid & 3u);
    // K-major operands: a k-step is 256 bytes on (no swizzle) or 32 bytes inside the 128-byte row.
    auto kmajor = [&](uint32_t base, uint32_t ks) -> uint64_t {
        return sw ? hf_wgmma_desc_sw128(base + ks * 32u, 16u, 1024u) : hf_wgmma_desc(base + ks * 256u, 128u, 1024u);
    };
    if (whole) {
        if (wg == 0u) {
            float acc[32];
            // With bit 2, a from registers (ldmatrix, the layout hf_wgmma_m64n64k16_rs documents).
            uint32_t af[4][4];
            if (regs) {
                const uint32_t lane = tid & 31u, r = ((tid >> 5) & 3u) * 16u + ((lane >> 3) & 1u) * 8u + (lane & 7u);
#pragma unroll
                for (uint32_t ks = 0; ks < 4u; ++ks)
                    hf_ldsm_x4(a_s + off(r, ks * 16u + (lane >> 4) * 8u, 64u, 64u), af[ks][0], af[ks][1], af[ks][2], af[ks][3]);
            }
            hf_wgmma_fence();
#pragma unroll
            for (uint32_t ks = 0; ks < 4u; ++ks) {
                if (regs)
                    hf_wgmma_m64n64k16_rs(acc, af[ks], kmajor(b_s, ks), ks > 0u ? 1u : 0u);
                else
                    hf_wgmma_m64n64k16(acc, kmajor(a_s, ks), kmajor(b_s, ks), ks > 0u ? 1u : 0u);
            }
            hf_wgmma_commit();
            hf_wgmma_wait<0>();
#pragma unroll
            for (uint32_t j = 0; j < 8u; ++j)
#pragma unroll
                for (uint32_t e = 0; e < 4u; ++e)
                    s_handoff[(row + (e >> 1) * 8u) * 64u + j * 8u + col + (e & 1u)] = acc[j * 4u + e];
            hf_mbar_arrive(hf_smem_addr(&s_bar));
        } else {
            hf_mbar_wait(hf_smem_addr(&s_bar), 0u);
            for (uint32_t i = tid - 128u; i < 64u * 64u; i += 128u) s[i] = s_handoff[i];
        }
    } else {
        float acc[16];
        hf_wgmma_fence();
#pragma unroll
        for (uint32_t ks = 0; ks < 4u; ++ks)
            hf_wgmma_m64n32k16(acc, kmajor(a_s, ks), kmajor(b_s + wg * (sw ? 32u * 128u : 4u * 1024u), ks), ks > 0u ? 1u : 0u);
        hf_wgmma_commit();
        hf_wgmma_wait<0>();
#pragma unroll
        for (uint32_t j = 0; j < 4u; ++j)
#pragma unroll
            for (uint32_t e = 0; e < 4u; ++e)
                s[(row + (e >> 1) * 8u) * 64u + wg * 32u + j * 8u + col + (e & 1u)] = acc[j * 4u + e];
    }
    float acc2[128];
    hf_wgmma_fence();
#pragma unroll
    for (uint32_t kk = 0; kk < 4u; ++kk) {
        // N-major v: 16 rows of K per step; this warpgroup's 256 columns.
        const uint64_t dv = sw ? hf_wgmma_desc_sw128(v_s + kk * 2u * 1024u + wg * 4u * 8192u, 8192u, 1024u)
                               : hf_wgmma_desc(v_s + kk * 2u * 8192u + wg * 32u * 128u, 8192u, 128u);
        if (regs) {  // with bit 2, the same 256 columns as two m64n128k16 (128 columns = 2 blocks apart)
            const uint64_t dv2 = dv + (sw ? (2u * 8192u) >> 4 : (16u * 128u) >> 4);
            hf_wgmma_m64n128k16_tb(acc2, kmajor(a_s, kk), dv, kk > 0u ? 1u : 0u);
            hf_wgmma_m64n128k16_tb(acc2 + 64, kmajor(a_s, kk), dv2, kk > 0u ? 1u : 0u);
        } else {
            hf_wgmma_m64n256k16_tb(acc2, kmajor(a_s, kk), dv, kk > 0u ? 1u : 0u);
        }
    }
    hf_wgmma_commit();
    hf_wgmma_wait<0>();
#pragma unroll
    for (uint32_t j = 0; j < 32u; ++j)
#pragma unroll
        for (uint32_t e = 0; e < 4u; ++e)
            o[(row + (e >> 1) * 8u) * 512u + wg * 256u + j * 8u + col + (e & 1u)] = acc2[j * 4u + e];
#else
    for (uint32_t i = tid; i < 64u * 64u; i += blockDim.x) s[i] = __int_as_float(0x7fc00000);
    for (uint32_t i = tid; i < 64u * 512u; i += blockDim.x) o[i] = __int_as_float(0x7fc00000);
#endif
}
"#;

fn n_arg(l: &CpuLaunch<'_>, i: usize, views: &[usize]) -> Result<usize> {
    let n = l.count(i)?;
    if let Some(&short) = views.iter().find(|&&len| len < n) {
        // The GPU kernel would read or write past the view: report it as the sanitizer does.
        return Err(crate::HalError::OutOfBounds {
            kernel: l.kernel_name().to_string(),
            arg: "n".into(),
            index: i64::try_from(short).unwrap_or(i64::MAX),
            len: short,
            buffer: "a view shorter than n".into(),
        });
    }
    Ok(n)
}

fn axpy(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, y, a) = (l.ptr::<f32>(0)?, l.ptr::<f32>(1)?, l.f32(2)?);
    let n = n_arg(l, 3, &[x.len(), y.len()])?;
    let xs = x.read(0, n)?;
    let mut ys = y.read(0, n)?;
    ys.par_iter_mut().zip(&xs).for_each(|(y, x)| *y += a * x);
    y.write(0, &ys)
}

fn scale(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, out, s) = (l.ptr::<f32>(0)?, l.ptr::<f32>(1)?, l.f32(2)?);
    let n = n_arg(l, 3, &[x.len(), out.len()])?;
    let v: Vec<f32> = x.read(0, n)?.iter().map(|x| s * x).collect();
    out.write(0, &v)
}

fn add(l: &CpuLaunch<'_>) -> Result<()> {
    let (a, b, out) = (l.ptr::<f32>(0)?, l.ptr::<f32>(1)?, l.ptr::<f32>(2)?);
    let n = n_arg(l, 3, &[a.len(), b.len(), out.len()])?;
    let (av, bv) = (a.read(0, n)?, b.read(0, n)?);
    out.write(0, &av.iter().zip(&bv).map(|(a, b)| a + b).collect::<Vec<_>>())
}

fn gather(l: &CpuLaunch<'_>) -> Result<()> {
    let (src, idx, out) = (l.ptr::<f32>(0)?, l.ptr::<i32>(1)?, l.ptr::<f32>(2)?);
    let n = n_arg(l, 3, &[idx.len(), out.len()])?;
    for i in 0..n {
        let j = idx.get(i)?;
        // Every index is checked against `src`'s view: an out-of-range one is an error, not garbage.
        out.set(i, if j < 0 { 0.0 } else { src.get(j as usize)? })?;
    }
    Ok(())
}

fn touch(l: &CpuLaunch<'_>) -> Result<()> {
    let x = l.ptr::<f32>(0)?;
    let n = n_arg(l, 1, &[x.len()])?;
    let v: Vec<f32> = x.read(0, n)?.iter().map(|x| x + 1.0).collect();
    x.write(0, &v)
}

fn cluster_sum(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, out) = (l.ptr::<f32>(0)?, l.ptr::<f32>(1)?);
    let cluster = l.count(2)?;
    let n = n_arg(l, 3, &[x.len(), out.len()])?;
    let xs = x.read(0, n)?;
    let launched = l.cluster_blocks() as usize;
    let sums: Vec<f32> = (0..n)
        .map(|b| {
            let first = b / launched * launched;
            let sum = (first..first + launched).fold(0.0f32, |s, j| s + xs.get(j).copied().unwrap_or(0.0));
            if launched == cluster {
                sum
            } else {
                f32::NAN
            }
        })
        .collect();
    out.write(0, &sums)
}

fn row_sum_bf16(l: &CpuLaunch<'_>) -> Result<()> {
    let (x, out) = (l.ptr::<bf16>(0)?, l.ptr::<f32>(1)?);
    let (rows, cols) = (l.count(2)?, l.count(3)?);
    let xs = x.read(0, rows * cols)?;
    let sums: Vec<f32> = xs.chunks(cols.max(1)).take(rows).map(|r| r.iter().map(|v| v.to_f32()).sum()).collect();
    out.write(0, &sums)
}

/// `hf_wgmma_check`'s definition: `s = a · bkᵀ` (`[64, 64]`) and `o = a · v` (`[64, 512]`) in f32
/// (the same for every operand layout).
fn wgmma_check(l: &CpuLaunch<'_>) -> Result<()> {
    let (a, bk, v) = (l.ptr::<bf16>(0)?.read(0, 64 * 64)?, l.ptr::<bf16>(1)?.read(0, 64 * 64)?, l.ptr::<bf16>(2)?);
    let v = v.read(0, 64 * 512)?;
    let dot = |r: usize, f: &dyn Fn(usize) -> f32| (0..64).fold(0.0f32, |acc, k| acc + a[r * 64 + k].to_f32() * f(k));
    let s: Vec<f32> = (0..64 * 64).map(|i| dot(i / 64, &|k| bk[(i % 64) * 64 + k].to_f32())).collect();
    let o: Vec<f32> = (0..64 * 512).map(|i| dot(i / 512, &|k| v[k * 512 + i % 512].to_f32())).collect();
    l.ptr::<f32>(3)?.write(0, &s)?;
    l.ptr::<f32>(4)?.write(0, &o)
}

/// Dynamic shared memory `hf_wgmma_check` needs, bytes: its three operands and up to 1024 bytes
/// of padding to a 1024-aligned base.
pub const WGMMA_CHECK_SHARED_BYTES: u32 = (64 * 64 * 2 + 64 * 512) * 2 + 1024;

/// The integer definition of the f32 → bf16 rounding (portability.h's `hf_f32_to_bf16_bits_soft`).
fn bf16_bits_soft(u: u32) -> u16 {
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x0040) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn bf16_round_check(l: &CpuLaunch<'_>) -> Result<()> {
    let (out, first_hi, count) = (l.ptr::<u32>(0)?, l.u32(1)?, l.u32(2)?);
    let (mut bad, mut first) = (out.get(0)?, out.get(1)?);
    for i in 0..(u64::from(count) << 16) {
        let p = (first_hi << 16).wrapping_add(i as u32);
        if half::bf16::from_f32(f32::from_bits(p)).to_bits() != bf16_bits_soft(p) {
            bad += 1;
            first = first.min(p);
        }
    }
    out.write(0, &[bad, first])
}

/// The demo kernel source: `hf_axpy` (y = a·x + y), `hf_scale` (out = s·x), `hf_add`
/// (out = a + b), `hf_gather` (`out[i] = src[idx[i]]`, 0 for idx < 0), `hf_touch` (x += 1, a
/// near-empty kernel for overhead measurements), `hf_touch_dependent` (the same, for
/// [`crate::Stream::launch_dependent`]), `hf_row_sum_bf16` (`x [rows, cols]` bf16 →
/// `out [rows]` f32, one block per row; the CPU sum order differs, so compare within tolerance) and
/// `hf_bf16_round_check` (the device's f32 → bf16 conversions, single and paired, against their
/// integer definition over `hi_count · 2¹⁶` bit patterns from `hi_first << 16`; the CPU checks
/// the definition against the `half` crate), `hf_cluster_sum` (clusters' shared memory) and
/// `hf_wgmma_check` (warpgroup MMA's operand layouts, no swizzle or the 128-byte swizzle by bit 0
/// of its `swizzle` argument, with bit 1 the first product from one warpgroup's m64n64k16
/// handed to the other through an mbarrier, and with bit 2 the second product as m64n128k16 pairs
/// and (with bit 1) the first with its A operand in registers: `[64, 64] · [64, 64]ᵀ` and `[64, 64] · [64, 512]` in
/// f32, one block of 256 threads with [`WGMMA_CHECK_SHARED_BYTES`]).
pub fn source() -> &'static KernelSource {
    static SRC: OnceLock<KernelSource> = OnceLock::new();
    SRC.get_or_init(|| {
        let n = || Param::scalar("n", ScalarKind::U32);
        KernelSource {
            name: "hal_demo",
            code: CODE,
            entries: vec![
                KernelEntry {
                    name: "hf_axpy",
                    params: vec![
                        Param::input::<f32>("x"),
                        Param::inout::<f32>("y"),
                        Param::scalar("a", ScalarKind::F32),
                        n(),
                    ],
                    cpu: axpy,
                },
                KernelEntry {
                    name: "hf_scale",
                    params: vec![
                        Param::input::<f32>("x"),
                        Param::output::<f32>("out"),
                        Param::scalar("s", ScalarKind::F32),
                        n(),
                    ],
                    cpu: scale,
                },
                KernelEntry {
                    name: "hf_add",
                    params: vec![Param::input::<f32>("a"), Param::input::<f32>("b"), Param::output::<f32>("out"), n()],
                    cpu: add,
                },
                KernelEntry {
                    name: "hf_gather",
                    params: vec![
                        Param::input::<f32>("src"),
                        Param::input::<i32>("idx"),
                        Param::output::<f32>("out"),
                        n(),
                    ],
                    cpu: gather,
                },
                KernelEntry { name: "hf_touch", params: vec![Param::inout::<f32>("x"), n()], cpu: touch },
                KernelEntry { name: "hf_touch_dependent", params: vec![Param::inout::<f32>("x"), n()], cpu: touch },
                KernelEntry {
                    name: "hf_cluster_sum",
                    params: vec![
                        Param::input::<f32>("x"),
                        Param::output::<f32>("out"),
                        Param::scalar("cluster", ScalarKind::U32),
                        n(),
                    ],
                    cpu: cluster_sum,
                },
                KernelEntry {
                    name: "hf_row_sum_bf16",
                    params: vec![
                        Param::input::<bf16>("x"),
                        Param::output::<f32>("out"),
                        Param::scalar("rows", ScalarKind::U32),
                        Param::scalar("cols", ScalarKind::U32),
                    ],
                    cpu: row_sum_bf16,
                },
                KernelEntry {
                    name: "hf_wgmma_check",
                    params: vec![
                        Param::input::<bf16>("a"),
                        Param::input::<bf16>("bk"),
                        Param::input::<bf16>("v"),
                        Param::output::<f32>("s"),
                        Param::output::<f32>("o"),
                        Param::scalar("swizzle", ScalarKind::U32),
                    ],
                    cpu: wgmma_check,
                },
                KernelEntry {
                    name: "hf_bf16_round_check",
                    params: vec![
                        Param::inout::<u32>("out"),
                        Param::scalar("hi_first", ScalarKind::U32),
                        Param::scalar("hi_count", ScalarKind::U32),
                    ],
                    cpu: bf16_round_check,
                },
            ],
        }
    })
}
