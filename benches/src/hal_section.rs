//! HAL overheads: eager launch cost on the host, graph launch on the host, graph and eager time
//! per kernel on the device (graphs of ordinary and of dependent launches), a 4-byte pinned
//! upload, and (CUDA) the same launches through raw cudarc in the same run, so the HAL's own cost
//! per launch is the difference.

use std::time::Instant;

use holdfast_hal::{demo_kernels, Buffer, Graph, Kernel, LaunchConfig};

use crate::ctx::Ctx;
use crate::error::Result;
use crate::report::{Row, Target};
use crate::timing::median;

/// Section name.
pub const SECTION: &str = "hal";

/// Most HAL overhead per eager launch over raw cudarc, µs.
pub const OVERHEAD_TARGET_US: f64 = 0.3;
/// Least device-time speed-up of a replayed step of near-empty kernels over the same step
/// launched eagerly.
pub const REPLAY_SPEEDUP_TARGET: f64 = 5.0;

fn block_for(n: usize) -> u32 {
    if n < 256 {
        32
    } else {
        256
    }
}

fn launch(ctx: &Ctx, touch: &Kernel, x: &Buffer<f32>) -> Result<()> {
    let n = x.len();
    ctx.s.launch(touch, LaunchConfig::for_elements(n, block_for(n)), &[x.into(), (n as u32).into()])?;
    Ok(())
}

/// `hf_touch_dependent` through [`holdfast_hal::Stream::launch_dependent`].
fn launch_dependent(ctx: &Ctx, touch: &Kernel, x: &Buffer<f32>) -> Result<()> {
    let n = x.len();
    ctx.s.launch_dependent(touch, LaunchConfig::for_elements(n, block_for(n)), &[x.into(), (n as u32).into()])?;
    Ok(())
}

/// A graph of `k` launches of `touch` on `x`, each made by `one`.
fn capture(
    ctx: &Ctx,
    touch: &Kernel,
    x: &Buffer<f32>,
    k: usize,
    one: fn(&Ctx, &Kernel, &Buffer<f32>) -> Result<()>,
) -> Result<Graph> {
    ctx.s.begin_capture("hal")?;
    for _ in 0..k {
        if let Err(e) = one(ctx, touch, x) {
            ctx.s.abort_capture()?;
            return Err(e);
        }
    }
    Ok(ctx.s.end_capture()?)
}

/// Kernels per step in the launch measurements.
pub fn kernels_per_step(ctx: &Ctx) -> usize {
    if ctx.quick() {
        50
    } else {
        400
    }
}

fn samples(ctx: &Ctx) -> usize {
    if ctx.quick() {
        5
    } else {
        50
    }
}

/// Median host µs per launch of `k` eager launches, synchronising outside the timed region.
fn host_per_launch(
    ctx: &Ctx,
    k: usize,
    mut one: impl FnMut() -> Result<()>,
    sync: &dyn Fn() -> Result<()>,
) -> Result<f64> {
    let mut v = Vec::new();
    for i in 0..samples(ctx) + 1 {
        let t = Instant::now();
        for _ in 0..k {
            one()?;
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / k as f64;
        sync()?;
        if i > 0 {
            v.push(us);
        }
    }
    Ok(median(&mut v))
}

/// Runs the section.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let m = ctx.dev.compile(demo_kernels::source())?;
    let touch = m.kernel("hf_touch")?;
    let k = kernels_per_step(ctx);
    let n_samples = samples(ctx);
    let tiny = ctx.dev.alloc_zeroed::<f32>("hal.x", 1, true)?;
    let mut rows = Vec::new();

    let s = &ctx.s;
    let hal_us = host_per_launch(ctx, k, || launch(ctx, &touch, &tiny), &|| Ok(s.synchronize()?))?;
    rows.push(
        Row::timed(SECTION, format!("eager launch, host per kernel ({k} near-empty)"), hal_us, n_samples)
            .with_note("host wall time of the enqueue; stream synchronised outside"),
    );

    let mut eager_per_kernel = None;
    if ctx.gpu() {
        let ev = ctx.clock.eager(s, &mut || {
            for _ in 0..k {
                launch(ctx, &touch, &tiny)?;
            }
            Ok(())
        })?;
        eager_per_kernel = Some(ev.median_us / k as f64);
        rows.push(Row::timed(
            SECTION,
            format!("eager, device per kernel ({k} near-empty)"),
            ev.median_us / k as f64,
            ev.samples,
        ));
    }

    for kk in [20usize, k] {
        let g = capture(ctx, &touch, &tiny, kk, launch)?;
        let host = ctx.clock.host(s, n_samples, &mut || Ok(g.replay(s)?))?;
        rows.push(
            Row::timed(SECTION, format!("graph launch, host ({kk} kernels)"), host.median_us, host.samples)
                .with_note("host wall time of Graph::replay"),
        );
        if kk == k {
            let dev = ctx.clock.eager(s, &mut || Ok(g.replay(s)?))?;
            let per_node = dev.median_us / kk as f64;
            rows.push(
                Row::timed(SECTION, format!("graph replay, per node ({kk} near-empty)"), per_node, dev.samples)
                    .with_note(if ctx.gpu() { "device time / nodes" } else { "wall time / nodes" }),
            );
            // The same step with each launch allowed to begin before the previous ends.
            let touch_dep = m.kernel("hf_touch_dependent")?;
            let gd = capture(ctx, &touch_dep, &tiny, kk, launch_dependent)?;
            let dd = ctx.clock.eager(s, &mut || Ok(gd.replay(s)?))?;
            let per_dep = dd.median_us / kk as f64;
            rows.push(
                Row::timed(
                    SECTION,
                    format!("graph replay, per node ({kk} near-empty, dependent launches)"),
                    per_dep,
                    dd.samples,
                )
                .with_note("Stream::launch_dependent: programmatic dependent launch edges (sm_90)"),
            );
            if let Some(eager) = eager_per_kernel {
                for (what, node) in [("", per_node), (", dependent launches", per_dep)] {
                    rows.push(
                        Row::value(
                            SECTION,
                            format!("graph replay over eager, device ({kk} near-empty{what})"),
                            eager / node,
                            "×",
                        )
                        .with_target(Target::AtLeast(REPLAY_SPEEDUP_TARGET)),
                    );
                }
            }
        }
    }

    if ctx.gpu() {
        let pinned = ctx.dev.alloc_pinned::<u32>(1)?;
        let dst = ctx.dev.alloc_zeroed::<u32>("hal.dst", 1, true)?;
        let dv = dst.view();
        let up = ctx.clock.host(s, n_samples, &mut || {
            s.copy_from_pinned(&pinned, 0, &dv)?;
            Ok(s.synchronize()?)
        })?;
        rows.push(Row::timed(SECTION, "pinned upload 4 B + stream sync, host", up.median_us, up.samples));
    }

    // The comparison with raw cudarc alternates the two, round by round, so a host whose speed
    // drifts over the run (frequency, other load) shifts both sides of each pair alike; the
    // overhead is the median of the per-round differences.
    let rounds = if ctx.quick() { 1 } else { 5 };
    let (mut pairs, mut why) = (Vec::new(), None);
    for _ in 0..rounds {
        let hal = host_per_launch(ctx, k, || launch(ctx, &touch, &tiny), &|| Ok(s.synchronize()?))?;
        match raw_cudarc_per_launch(ctx, k) {
            Ok(raw) => pairs.push((hal, raw)),
            Err(w) => {
                why = Some(w);
                break;
            }
        }
    }
    if !pairs.is_empty() {
        let mut raw: Vec<f64> = pairs.iter().map(|p| p.1).collect();
        let mut diff: Vec<f64> = pairs.iter().map(|p| p.0 - p.1).collect();
        rows.push(
            Row::timed(
                SECTION,
                format!("raw cudarc eager launch, host per kernel ({k} near-empty)"),
                median(&mut raw),
                n_samples * pairs.len(),
            )
            .with_note("the same kernel and launch shape through cudarc directly"),
        );
        rows.push(
            Row::value(SECTION, "HAL overhead per eager launch over raw cudarc", median(&mut diff), "µs")
                .with_target(Target::AtMost(OVERHEAD_TARGET_US))
                .with_note(format!("median of {} interleaved rounds of HAL − raw", pairs.len())),
        );
    } else if let (Some(why), true) = (why, ctx.gpu()) {
        ctx.note(format!("hal: raw cudarc baseline skipped ({why})"));
        rows.push(
            Row::value(SECTION, "HAL overhead per eager launch over raw cudarc", f64::NAN, "µs")
                .with_target(Target::AtMost(OVERHEAD_TARGET_US))
                .with_note(format!("not measured: {why}")),
        );
    } // (the CPU backend has no raw-driver baseline)
    Ok(rows)
}

/// Host µs per eager launch of `hf_touch` on one float through raw cudarc (CUDA only).
#[cfg(feature = "cuda")]
fn raw_cudarc_per_launch(ctx: &Ctx, k: usize) -> std::result::Result<f64, String> {
    use cudarc::driver::{CudaContext, LaunchConfig as CuCfg, PushKernelArg};
    if ctx.dev.backend() != holdfast_hal::BackendKind::Cuda {
        return Err(format!("the device is {}", ctx.dev.backend()));
    }
    let e = |w: &'static str| move |x: cudarc::driver::DriverError| format!("{w}: {x}");
    let info = ctx.dev.info();
    let cu = CudaContext::new(info.ordinal).map_err(e("cuDevicePrimaryCtxRetain"))?;
    // SAFETY: no allocation has been made through this handle of the primary context yet.
    unsafe { cu.disable_event_tracking() };
    let (cubin, _ptx) =
        holdfast_hal::cuda::compile(demo_kernels::source(), &info.arch, info.warp_size).map_err(|x| x.to_string())?;
    let module = cu.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).map_err(e("cuModuleLoadData"))?;
    let f = module.load_function("hf_touch").map_err(e("cuModuleGetFunction"))?;
    let stream = cu.new_stream().map_err(e("cuStreamCreate"))?;
    let mut x = stream.alloc_zeros::<f32>(1).map_err(e("cuMemAlloc"))?;
    let nn = 1u32;
    let cfg = CuCfg { grid_dim: (1, 1, 1), block_dim: (block_for(1), 1, 1), shared_mem_bytes: 0 };
    let mut v = Vec::new();
    for i in 0..samples(ctx) + 1 {
        let t = Instant::now();
        for _ in 0..k {
            let mut b = stream.launch_builder(&f);
            b.arg(&mut x).arg(&nn);
            // SAFETY: `hf_touch(float*, uint32_t)` with a buffer of one float and n = 1.
            unsafe { b.launch(cfg) }.map_err(e("cuLaunchKernel"))?;
        }
        let us = t.elapsed().as_secs_f64() * 1e6 / k as f64;
        stream.synchronize().map_err(e("cuStreamSynchronize"))?;
        if i > 0 {
            v.push(us);
        }
    }
    Ok(median(&mut v))
}

/// Without the `cuda` feature there is no raw baseline.
#[cfg(not(feature = "cuda"))]
fn raw_cudarc_per_launch(ctx: &Ctx, _k: usize) -> std::result::Result<f64, String> {
    if ctx.gpu() {
        Err("built without the `cuda` feature".into())
    } else {
        Err("no raw-driver baseline on the CPU backend".into())
    }
}
