//! Captures a small multi-kernel step into a graph, replays it with new inputs written into the
//! same persistent buffers, and checks every replay against eager execution and against a plain
//! host computation. Then plants the bug class the graph sanitizer exists for and shows it caught.
//!
//! `cargo run --release -p holdfast-hal --example capture_step [-- DEVICE]` (default `cpu`).

use std::process::ExitCode;

use holdfast_hal::{demo_kernels, Device, HalError, LaunchConfig, PinnedBuffer, Result};

fn run(device: &str) -> Result<()> {
    let dev = Device::open(device)?;
    let info = dev.info();
    println!("device: {} ({}, arch {}, {} compute units)", info.name, info.backend, info.arch, info.compute_units);
    let m = dev.compile(demo_kernels::source())?;
    let (axpy, scale, add, gather) =
        (m.kernel("hf_axpy")?, m.kernel("hf_scale")?, m.kernel("hf_add")?, m.kernel("hf_gather")?);
    let s = dev.create_stream()?;
    let n = 4096usize;
    let nn = n as u32;
    let cfg = LaunchConfig::for_elements(n, 256);

    // Persistent step buffers: the graph bakes in their addresses.
    let x = dev.alloc_zeroed::<f32>("step.x", n, true)?;
    let y = dev.alloc_zeroed::<f32>("step.y", n, true)?;
    let idx = dev.alloc_zeroed::<i32>("step.idx", n, true)?;
    let out = dev.alloc_zeroed::<f32>("step.out", n, true)?;
    let mut staging = dev.alloc_pinned::<f32>(n)?;
    let mut idx_staging = dev.alloc_pinned::<i32>(n)?;

    let step = |staging: &PinnedBuffer<f32>, idx_staging: &PinnedBuffer<i32>| -> Result<()> {
        s.copy_from_pinned(staging, 0, &x.view())?;
        s.copy_from_pinned(idx_staging, 0, &idx.view())?;
        s.memset(&y.view(), 0)?;
        s.launch(&axpy, cfg, &[(&x).into(), (&y).into(), 3.0f32.into(), nn.into()])?; // y = 3x
        s.launch(&gather, cfg, &[(&y).into(), (&idx).into(), (&out).into(), nn.into()])?; // out = y[idx]
        s.launch(&add, cfg, &[(&out).into(), (&x).into(), (&out).into(), nn.into()])?; // out += x
        s.launch(&scale, cfg, &[(&out).into(), (&out).into(), 0.5f32.into(), nn.into()])
        // out *= 0.5
    };
    let host_step = |xs: &[f32], is: &[i32]| -> Vec<f32> {
        (0..n).map(|i| 0.5 * ((if is[i] < 0 { 0.0 } else { 3.0 * xs[is[i] as usize] }) + xs[i])).collect()
    };

    s.begin_capture("step")?;
    step(&staging, &idx_staging)?;
    let graph = s.end_capture()?;
    println!(
        "captured `{}`: {} operations, {} backend nodes, {} buffers retained",
        graph.label(),
        graph.op_count(),
        graph.node_count(),
        graph.retained_buffers()
    );

    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let replays = 8;
    for r in 0..replays {
        let xs: Vec<f32> = (0..n).map(|_| (rand() % 2000) as f32 / 100.0 - 10.0).collect();
        let is: Vec<i32> = (0..n).map(|_| (rand() % (n as u64 + 1)) as i32 - 1).collect();
        staging.write(0, &xs)?;
        idx_staging.write(0, &is)?;
        graph.replay(&s)?;
        let replayed = s.copy_to_host_sync(&out.view())?;
        step(&staging, &idx_staging)?;
        let eager = s.copy_to_host_sync(&out.view())?;
        let host = host_step(&xs, &is);
        let bitwise = replayed.iter().zip(&eager).all(|(a, b)| a.to_bits() == b.to_bits());
        let max_err = replayed.iter().zip(&host).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if !bitwise || max_err > 1e-4 {
            return Err(HalError::KernelFailed {
                kernel: "step".into(),
                message: format!("replay {r}: bitwise={bitwise} max_err={max_err}"),
            });
        }
    }
    println!("verified: {replays} replays with fresh inputs equal eager execution bit for bit and the host reference (max |err| <= 1e-4)");

    // Planted bug (the class PR #42604 fixed): per-step metadata in a freshly allocated buffer.
    let fresh = dev.alloc_from_slice("fresh_per_step_indices", &vec![0i32; n], false)?;
    s.begin_capture("buggy_step")?;
    let err = s.launch(&gather, cfg, &[(&y).into(), (&fresh).into(), (&out).into(), nn.into()]);
    s.abort_capture()?;
    match err {
        Err(e @ HalError::NotGraphStable { .. }) => {
            println!("verified: a transient buffer in a capture is rejected: {e}")
        }
        other => {
            return Err(HalError::KernelFailed {
                kernel: "sanitizer".into(),
                message: format!("expected NotGraphStable, got {other:?}"),
            })
        }
    }

    // Planted bug: a host-refreshed input that a step forgot to upload.
    x.set_host_refreshed(true);
    s.begin_capture("reads_x")?;
    s.launch(&scale, cfg, &[(&x).into(), (&out).into(), 1.0f32.into(), nn.into()])?;
    let g2 = s.end_capture()?;
    s.copy_from_pinned(&staging, 0, &x.view())?;
    g2.replay(&s)?;
    match g2.replay(&s) {
        Err(e @ HalError::StaleHostInput { .. }) => {
            println!("verified: a replay over stale host inputs is rejected: {e}")
        }
        other => {
            return Err(HalError::KernelFailed {
                kernel: "sanitizer".into(),
                message: format!("expected StaleHostInput, got {other:?}"),
            })
        }
    }
    let stats = dev.stats();
    println!(
        "device memory: {} allocations live, {} bytes, {} host syncs",
        stats.live_allocations, stats.live_bytes, stats.host_syncs
    );
    Ok(())
}

fn main() -> ExitCode {
    let device = std::env::args().nth(1).unwrap_or_else(|| "cpu".into());
    match run(&device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}
