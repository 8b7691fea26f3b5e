//! Staging throughput of 1 KiB rows (a head_dim-512 bf16 KV row) into shared memory, the
//! attention kernels' copy pattern without their arithmetic: one block of 256 threads per row
//! list of 8320 entries, tiles of 64 rows (padded to 1040 bytes) with one or two tiles in flight,
//! staged either by `cp.async` (each warp copies 512 contiguous bytes per instruction) or by
//! `cp.async.bulk` (one copy per row, completed on an mbarrier); and, two tiles ahead, by
//! `cp.async` in three other shapes per warp instruction: 8 rows × 64 bytes into contiguous
//! shared memory, the same into pieces 128 bytes apart (the no-swizzle wgmma layout), and 4 rows ×
//! 128 bytes. Prints GB/s in all and per block
//! at 1, 64, 132 and 264 blocks. Needs an sm_90 GPU:
//!
//! ```text
//! cargo run --release -p holdfast-attention --features cuda --example stage_rows
//! ```
//!
//! `COMPILE_ONLY=1` compiles the kernel with NVRTC for sm_90a and exits (no GPU needed).

use holdfast_hal::{bf16, Arg, CpuLaunch, Device, KernelEntry, KernelSource, LaunchConfig, Param, ScalarKind};

const CODE: &str = r#"
#define ROWB 1040u
#define NT 64u
#define TILEB (NT * ROWB)
__device__ __forceinline__ void bar_init(uint32_t a) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(a) : "memory"); }
__device__ __forceinline__ void bar_expect(uint32_t a, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(a), "r"(bytes) : "memory"); }
__device__ __forceinline__ void bar_wait(uint32_t a, uint32_t parity) {
    asm volatile("{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}" :: "r"(a), "r"(parity) : "memory"); }
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory"); }

// mode 0: cp.async, mode 1: cp.async.bulk (one per row); `ahead` (1 or 2) tiles in flight, in `ahead + 1`
// buffers of 64 padded rows (three fill 200 KiB of shared memory).
HF_KERNEL void stage(const hf_bf16* cache, const int32_t* idx, const int32_t* indptr, float* out, uint32_t T,
                     uint32_t mode, uint32_t ahead) {
    extern __shared__ __align__(128) unsigned char sm[];
    __shared__ __align__(8) uint64_t bars[3];
    const uint32_t t = blockIdx.x, tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    if (t >= T) return;
    const int32_t b0 = indptr[t];
    const uint32_t ntiles = (uint32_t)(indptr[t + 1] - b0) / NT;
    const uint32_t base = hf_smem_addr(sm), bar0 = hf_smem_addr(&bars[0]);
    if (tid < 3u) bar_init(bar0 + tid * 8u);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    const uint32_t nbuf = ahead + 1u;
    auto issue = [&](uint32_t tile) {
        const uint32_t buf = tile % nbuf;
        if (mode == 1u) {
            if (warp == 0u) {
                if (lane == 0u) bar_expect(bar0 + buf * 8u, NT * 1024u);
                __syncwarp();
                for (uint32_t r = lane; r < NT; r += 32u) {
                    const int32_t slot = idx[b0 + (int32_t)(tile * NT + r)];
                    bulk(base + buf * TILEB + r * ROWB, cache + (uint64_t)slot * 512u, 1024u, bar0 + buf * 8u);
                }
            }
        } else if (mode >= 2u) {
            // Warp w stages rows 8w .. 8w + 7. Mode 2: 8 rows x 64 bytes per instruction, each row's
            // pieces contiguous in shared memory; mode 3: the same reads, pieces 128 bytes apart
            // (the no-swizzle core-matrix layout); mode 4: 4 rows x 128 bytes (whole lines).
            const uint32_t lanes = mode == 4u ? 8u : 4u, r = warp * 8u + lane / lanes, p0 = lane % lanes;
            for (uint32_t rq = 0; rq < (mode == 4u ? 2u : 1u); ++rq) {
                const uint32_t row = r + rq * 4u;
                const int32_t slot = idx[b0 + (int32_t)(tile * NT + row)];
                for (uint32_t k = 0; k < 64u / lanes; ++k) {
                    const uint32_t piece = p0 + lanes * k;
                    const uint32_t dst = mode == 3u ? (row >> 3) * 8192u + piece * 128u + (row & 7u) * 16u
                                                    : row * ROWB + piece * 16u;
                    hf_cp_async16(base + buf * TILEB + dst, cache + (uint64_t)slot * 512u + piece * 8u, 16u);
                }
            }
            hf_cp_async_commit();
        } else {
            for (uint32_t r = warp; r < NT; r += 8u) {
                const int32_t slot = idx[b0 + (int32_t)(tile * NT + r)];
                for (uint32_t h = 0; h < 2u; ++h)
                    hf_cp_async16(base + buf * TILEB + r * ROWB + (h * 32u + lane) * 16u,
                                  cache + (uint64_t)slot * 512u + (h * 32u + lane) * 8u, 16u);
            }
            hf_cp_async_commit();
        }
    };
    float acc = 0.0f;
    for (uint32_t i = 0; i < ahead && i < ntiles; ++i) issue(i);
    for (uint32_t tile = 0; tile < ntiles; ++tile) {
        if (tile + ahead < ntiles) issue(tile + ahead);
        else if (mode == 0u) hf_cp_async_commit();
        const uint32_t buf = tile % nbuf;
        if (mode == 1u) bar_wait(bar0 + buf * 8u, (tile / nbuf) & 1u);
        else {
            if (ahead == 2u) hf_cp_async_wait<2>(); else hf_cp_async_wait<1>();
        }
        __syncthreads();
        acc += hf_bf16_to_f32(*(const hf_bf16*)(sm + buf * TILEB + (tid & 63u) * ROWB + (tid >> 6) * 2u));
        __syncthreads();
    }
    if (tid == 0u) out[t] = acc;
}
"#;

/// The kernel has no CPU reference: this example runs on a GPU only.
fn gpu_only(l: &CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    Err(l.fail("stage_rows measures a GPU; it has no CPU reference"))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("stage_rows: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let u = |n| Param::scalar(n, ScalarKind::U32);
    let src = KernelSource {
        name: "stage_rows",
        code: CODE,
        entries: vec![KernelEntry {
            name: "stage",
            params: vec![
                Param::input::<bf16>("cache"),
                Param::input::<i32>("idx"),
                Param::input::<i32>("indptr"),
                Param::output::<f32>("out"),
                u("T"),
                u("mode"),
                u("ahead"),
            ],
            cpu: gpu_only,
        }],
    };
    if std::env::var_os("COMPILE_ONLY").is_some() {
        let (c, _) = holdfast_hal::cuda::compile(&src, "sm_90a", 32)?;
        println!("compiled: {} bytes of CUBIN", c.len());
        return Ok(());
    }
    let dev = Device::open(&std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cuda:0".into()))?;
    if !dev.info().has_wgmma() {
        return Err(format!("{} ({}) is not an sm_90 GPU", dev.info().name, dev.info().arch).into());
    }
    let s = dev.create_stream()?;
    let m = dev.compile(&src)?;
    let k = m.kernel("stage")?;
    let per_row = 8320usize;
    let rows_max = 264usize;
    let cache = dev.alloc_zeroed::<bf16>("cache", rows_max * per_row * 512, true)?;
    let idx: Vec<i32> = (0..rows_max * per_row).map(|i| i as i32).collect();
    let ip: Vec<i32> = (0..=rows_max).map(|r| (r * per_row) as i32).collect();
    let (ib, pb) = (dev.alloc_from_slice("idx", &idx, true)?, dev.alloc_from_slice("ip", &ip, true)?);
    let out = dev.alloc_zeroed::<f32>("out", rows_max, true)?;
    for rows in [1usize, 64, 132, 264] {
        // mode 0: cp.async; mode 1: cp.async.bulk. Three 66.5 KB buffers at most fit in 227 KiB.
        // Modes 2-4 (cp.async, two tiles ahead): the same bytes in other per-instruction shapes.
        for (mode, ahead) in [(0u32, 1u32), (0, 2), (1, 1), (1, 2), (2, 2), (3, 2), (4, 2)] {
            let cfg = LaunchConfig {
                grid: (rows as u32, 1, 1),
                block: (256, 1, 1),
                shared_mem_bytes: (ahead + 1) * 64 * 1040,
            };
            let args: Vec<Arg> = vec![
                (&cache).into(),
                (&ib).into(),
                (&pb).into(),
                (&out).into(),
                (rows as u32).into(),
                mode.into(),
                ahead.into(),
            ];
            for _ in 0..3 {
                s.launch(&k, cfg, &args)?;
            }
            s.synchronize()?;
            let t = std::time::Instant::now();
            for _ in 0..5 {
                s.launch(&k, cfg, &args)?;
            }
            s.synchronize()?;
            let us = t.elapsed().as_secs_f64() * 1e6 / 5.0;
            let bytes = (rows * (per_row / 64 * 64) * 1024) as f64;
            println!(
                "{} blocks, {:16}, {ahead} tile(s) ahead: {us:8.1} µs, {:7.1} GB/s, {:5.1} GB/s per block",
                rows,
                ["cp.async", "cp.async.bulk", "8 rows x 64 B", "64 B, 128 apart", "4 rows x 128 B"][mode as usize],
                bytes / us / 1e3,
                bytes / us / 1e3 / rows as f64
            );
        }
    }
    Ok(())
}
