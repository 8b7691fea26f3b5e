//! The physical limits every other row is a fraction of: device-to-device copy bandwidth and the
//! rate of a large bf16 GEMM (holdfast's own, and cuBLAS where it loads).

use holdfast_hal::bf16;
use holdfast_kernels::{DenseKernels, Gemm};

use crate::ctx::{Ctx, Scale};
use crate::error::Result;
use crate::report::{Bound, Row};

/// Section name.
pub const SECTION: &str = "ceilings";

/// Bytes of each of the two copy buffers: 1 GiB on the GPU, 4 MiB for `--quick`.
pub fn copy_bytes(scale: Scale) -> usize {
    match scale {
        Scale::Full => 1 << 30,
        Scale::Quick => 4 << 20,
    }
}

/// `m = n = k` of the ceiling GEMM.
pub fn gemm_size(scale: Scale) -> usize {
    match scale {
        Scale::Full => 8192,
        Scale::Quick => 128,
    }
}

/// The copy case name (also the PyTorch key's case).
pub fn copy_case(scale: Scale) -> String {
    format!("copy {} MiB d2d", copy_bytes(scale) >> 20)
}

/// The holdfast GEMM ceiling case name.
pub fn gemm_case(scale: Scale) -> String {
    let n = gemm_size(scale);
    format!("bf16 gemm {n}x{n}x{n} holdfast")
}

/// Copy bandwidth: `Stream::copy` of one buffer into another, counting read + write bytes
/// (`2 × size`), timed eagerly (each call is long enough that launch gaps do not matter).
pub fn copy(ctx: &mut Ctx) -> Result<Row> {
    let bytes = copy_bytes(ctx.scale);
    let len = bytes / 4;
    let src = ctx.filled::<u32>("copy.src", len, 0x3c)?;
    let dst = ctx.filled::<u32>("copy.dst", len, 0)?;
    let (sv, dv) = (src.view(), dst.view());
    let s = &ctx.s;
    let stat = ctx.clock.eager(s, &mut || Ok(s.copy(&sv, &dv)?))?;
    let row = Row::timed(SECTION, copy_case(ctx.scale), stat.median_us, stat.samples)
        .with_bytes(2 * bytes as u64)
        .with_bound(Bound::Copy)
        .with_note("read + write bytes; the ceiling of every GB/s fraction");
    ctx.ceilings.copy_gbps = Some(2.0 * bytes as f64 / (stat.median_us * 1e-6) / 1e9);
    Ok(row)
}

/// holdfast's bf16 GEMM at `n × n × n` (`2n³` FLOPs), timed eagerly.
pub fn gemm(ctx: &mut Ctx) -> Result<Row> {
    let n = gemm_size(ctx.scale);
    let dk = DenseKernels::new(&ctx.dev)?;
    // 0x3c3c as bf16 is about 0.0115: finite sums at any k.
    let x = ctx.filled::<bf16>("gemm.x", n * n, 0x3c)?;
    let w = ctx.filled::<bf16>("gemm.w", n * n, 0x3c)?;
    let y = ctx.filled::<bf16>("gemm.y", n * n, 0)?;
    let (xv, wv, yv) = (x.view(), w.view(), y.view());
    let s = &ctx.s;
    let shape = Gemm::new(n, n, n);
    let stat = ctx.clock.eager(s, &mut || Ok(dk.matmul(s, &xv, &wv, &yv, shape)?))?;
    let flops = 2 * shape.macs();
    ctx.ceilings.gemm_tflops_holdfast = Some(flops as f64 / (stat.median_us * 1e-6) / 1e12);
    Ok(Row::timed(SECTION, gemm_case(ctx.scale), stat.median_us, stat.samples)
        .with_flops(flops)
        .with_bound(Bound::Gemm)
        .with_note("GEMM ceiling when cuBLAS is not available"))
}

/// cuBLAS bf16 GEMM at the same size (CUDA only), or a note saying why it did not run.
pub fn cublas(ctx: &mut Ctx) -> Option<Row> {
    let n = gemm_size(ctx.scale);
    match crate::cublas::gemm_us(&ctx.dev, n, ctx.clock.effort) {
        Ok(stat) => {
            let flops = 2 * (n as u64).pow(3);
            ctx.ceilings.gemm_tflops_cublas = Some(flops as f64 / (stat.median_us * 1e-6) / 1e12);
            Some(
                Row::timed(SECTION, format!("bf16 gemm {n}x{n}x{n} cuBLAS"), stat.median_us, stat.samples)
                    .with_flops(flops)
                    .with_bound(Bound::Gemm)
                    .with_note("cublasGemmEx bf16 in/out, f32 compute; the GEMM ceiling"),
            )
        }
        Err(why) => {
            ctx.note(format!("cuBLAS: not available ({why})"));
            None
        }
    }
}
