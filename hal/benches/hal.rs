//! HAL overheads: eager launch, capture, replay; on GPUs also host enqueue vs device time for
//! steps of 20 and 400 kernels, capture + instantiate cost, a 4-byte pinned upload, and the same
//! measurements through raw cudarc in the same run for comparison.
//!
//! `HOLDFAST_DEVICE` picks the device (default `cpu`). GPU timings synchronise inside the timed
//! region where they measure device work (`iter_custom`); "host" timings measure the enqueue and
//! synchronise outside it, once per step.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use holdfast_hal::{demo_kernels, BackendKind, Buffer, Device, Graph, Kernel, LaunchConfig, Stream};

fn device() -> Device {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    Device::open(&name).unwrap_or_else(|e| panic!("HOLDFAST_DEVICE={name}: {e}"))
}

struct Setup {
    dev: Device,
    s: Stream,
    touch: Kernel,
}

fn setup() -> Setup {
    let dev = device();
    let m = dev.compile(demo_kernels::source()).expect("compile");
    let touch = m.kernel("hf_touch").expect("kernel");
    let s = dev.create_stream().expect("stream");
    Setup { dev, s, touch }
}

/// Threads per block: 256 for real work, one warp for the near-empty kernels.
fn block_for(n: usize) -> u32 {
    if n < 256 {
        32
    } else {
        256
    }
}

fn launch(st: &Setup, x: &Buffer<f32>) {
    let n = x.len();
    st.s.launch(&st.touch, LaunchConfig::for_elements(n, block_for(n)), &[x.into(), (n as u32).into()])
        .expect("launch");
}

fn capture(st: &Setup, x: &Buffer<f32>, k: usize) -> Graph {
    st.s.begin_capture("bench").expect("begin");
    for _ in 0..k {
        launch(st, x);
    }
    st.s.end_capture().expect("end")
}

fn bench_common(c: &mut Criterion) {
    let st = setup();
    let x = st.dev.alloc_zeroed::<f32>("x", 64, true).expect("x");
    let mut g = c.benchmark_group(format!("hal/{}", st.dev.backend()));
    g.throughput(Throughput::Elements(1));
    g.bench_function("eager_launch", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                launch(&st, &x);
            }
            st.s.synchronize().expect("sync");
            t.elapsed()
        })
    });
    for n in [10usize, 100, 1000] {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::new("capture", n), &n, |b, &n| b.iter(|| black_box(capture(&st, &x, n))));
        let graph = capture(&st, &x, n);
        g.bench_with_input(BenchmarkId::new("replay", n), &n, |b, _| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    graph.replay(&st.s).expect("replay");
                }
                st.s.synchronize().expect("sync");
                t.elapsed()
            })
        });
    }
    g.finish();
}

/// Per step of `k` kernels over `n` elements: host enqueue and device time, eager and graph.
fn bench_gpu_steps(c: &mut Criterion) {
    let st = setup();
    if st.dev.backend() == BackendKind::Cpu {
        return;
    }
    let mut g = c.benchmark_group("hal/gpu_step");
    for (k, n) in [(20usize, 65536usize), (400, 1)] {
        let x = st.dev.alloc_zeroed::<f32>("x", n, true).expect("x");
        let tag = format!("{k}x{n}");
        g.throughput(Throughput::Elements(k as u64));
        g.bench_function(BenchmarkId::new("eager_host_enqueue", &tag), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    for _ in 0..k {
                        launch(&st, &x);
                    }
                    total += t.elapsed();
                    st.s.synchronize().expect("sync");
                }
                total
            })
        });
        g.bench_function(BenchmarkId::new("eager_device", &tag), |b| {
            b.iter_custom(|iters| {
                st.s.synchronize().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    for _ in 0..k {
                        launch(&st, &x);
                    }
                }
                st.s.synchronize().expect("sync");
                t.elapsed()
            })
        });
        let graph = capture(&st, &x, k);
        g.bench_function(BenchmarkId::new("graph_host_launch", &tag), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    graph.replay(&st.s).expect("replay");
                    total += t.elapsed();
                    st.s.synchronize().expect("sync");
                }
                total
            })
        });
        g.bench_function(BenchmarkId::new("graph_device", &tag), |b| {
            b.iter_custom(|iters| {
                st.s.synchronize().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    graph.replay(&st.s).expect("replay");
                }
                st.s.synchronize().expect("sync");
                t.elapsed()
            })
        });
        g.bench_function(BenchmarkId::new("capture_instantiate", &tag), |b| b.iter(|| black_box(capture(&st, &x, k))));
    }
    let pinned = st.dev.alloc_pinned::<u32>(1).expect("pinned");
    let dst = st.dev.alloc_zeroed::<u32>("dst", 1, true).expect("dst");
    g.throughput(Throughput::Elements(1));
    g.bench_function("pinned_h2d_4B_sync", |b| {
        b.iter(|| {
            st.s.copy_from_pinned(&pinned, 0, &dst.view()).expect("copy");
            st.s.synchronize().expect("sync");
        })
    });
    g.finish();
}

#[cfg(feature = "cuda")]
fn bench_raw_cudarc(c: &mut Criterion) {
    use cudarc::driver::{sys, CudaContext, LaunchConfig as CuCfg, PushKernelArg};
    let dev = device();
    if dev.backend() != BackendKind::Cuda {
        return;
    }
    let ordinal = dev.info().ordinal;
    let ctx = CudaContext::new(ordinal).expect("ctx");
    // SAFETY: no allocation has been made through this handle of the primary context yet.
    unsafe { ctx.disable_event_tracking() };
    let (cubin, _ptx) = holdfast_hal::cuda::compile(demo_kernels::source(), &dev.info().arch, 32).expect("nvrtc");
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin)).expect("module");
    let f = module.load_function("hf_touch").expect("function");
    let stream = ctx.new_stream().expect("stream");
    let mut g = c.benchmark_group("hal/raw_cudarc");
    for (k, n) in [(20usize, 65536usize), (400, 1)] {
        let mut x = stream.alloc_zeros::<f32>(n).expect("alloc");
        let nn = n as u32;
        let block = block_for(n);
        let cfg = CuCfg {
            grid_dim: (n.div_ceil(block as usize) as u32, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        let tag = format!("{k}x{n}");
        g.throughput(Throughput::Elements(k as u64));
        let raw_launch = |x: &mut cudarc::driver::CudaSlice<f32>| {
            let mut b = stream.launch_builder(&f);
            b.arg(x).arg(&nn);
            // SAFETY: `hf_touch(float*, uint32_t)` with a buffer of `n` floats.
            unsafe { b.launch(cfg) }.expect("launch");
        };
        g.bench_function(BenchmarkId::new("eager_host_enqueue", &tag), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    for _ in 0..k {
                        raw_launch(&mut x);
                    }
                    total += t.elapsed();
                    stream.synchronize().expect("sync");
                }
                total
            })
        });
        g.bench_function(BenchmarkId::new("eager_device", &tag), |b| {
            b.iter_custom(|iters| {
                stream.synchronize().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    for _ in 0..k {
                        raw_launch(&mut x);
                    }
                }
                stream.synchronize().expect("sync");
                t.elapsed()
            })
        });
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin");
        for _ in 0..k {
            raw_launch(&mut x);
        }
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).expect("end").expect("graph");
        graph.upload().expect("upload");
        g.bench_function(BenchmarkId::new("graph_host_launch", &tag), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    graph.launch().expect("launch");
                    total += t.elapsed();
                    stream.synchronize().expect("sync");
                }
                total
            })
        });
        g.bench_function(BenchmarkId::new("graph_device", &tag), |b| {
            b.iter_custom(|iters| {
                stream.synchronize().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    graph.launch().expect("launch");
                }
                stream.synchronize().expect("sync");
                t.elapsed()
            })
        });
    }
    g.finish();
}

#[cfg(not(feature = "cuda"))]
fn bench_raw_cudarc(_c: &mut Criterion) {}

criterion_group!(benches, bench_common, bench_gpu_steps, bench_raw_cudarc);
criterion_main!(benches);
