//! CPU-backend-only checks: the emulator's bounds and argument checking, device-name errors,
//! poisoning, and a property test that capture + replay equals eager execution for random programs.

use holdfast_hal::demo_kernels;
use holdfast_hal::testing::{check_errors, words};
use holdfast_hal::{
    Buffer, CpuLaunch, Device, HalError, KernelEntry, KernelSource, LaunchConfig, Param, PinnedBuffer, ScalarKind,
    Stream,
};
use proptest::prelude::*;

fn cpu() -> Device {
    Device::cpu().expect("cpu")
}

#[test]
fn a_read_past_the_declared_view_is_reported_with_kernel_arg_index_and_buffer() {
    let dev = cpu();
    let s = dev.create_stream().expect("stream");
    let m = dev.compile(demo_kernels::source()).expect("compile");
    // The allocation holds 64 elements but the kernel is handed a 16-element view: index 20 is
    // inside the allocation and still out of bounds.
    let src = dev.alloc_zeroed::<f32>("kv_slots", 64, false).expect("src");
    let idx = dev.alloc_from_slice("indices", &[0i32, 5, 20, 1], false).expect("idx");
    let out = dev.alloc_zeroed::<f32>("out", 4, false).expect("out");
    let err = s
        .launch(
            &m.kernel("hf_gather").expect("k"),
            LaunchConfig::for_elements(4, 64),
            &[(&src.prefix(16).expect("view")).into(), (&idx).into(), (&out).into(), 4u32.into()],
        )
        .expect_err("index 20 is past the view");
    match err {
        HalError::OutOfBounds { kernel, arg, index, len, buffer } => {
            assert_eq!(
                (kernel.as_str(), arg.as_str(), index, len, buffer.as_str()),
                ("hf_gather", "src", 20, 16, "kv_slots")
            );
        }
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
}

#[test]
fn a_count_larger_than_the_view_is_reported() {
    let dev = cpu();
    let s = dev.create_stream().expect("stream");
    let m = dev.compile(demo_kernels::source()).expect("compile");
    let x = dev.alloc_zeroed::<f32>("x", 8, false).expect("x");
    let err =
        s.launch(&m.kernel("hf_touch").expect("k"), LaunchConfig::for_elements(9, 64), &[(&x).into(), 9u32.into()]);
    check_errors(vec![(
        "count of 9 over a view of 8",
        err,
        |e| matches!(e, HalError::OutOfBounds { index: 8, len: 8, .. }),
        words(&["kernel `hf_touch` argument `n`: index 8 is out of bounds for a view of 8 elements"]),
    )]);
}

fn buggy_writes_its_input(l: &holdfast_hal::CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    l.ptr::<f32>(0)?.set(0, 1.0)
}

#[test]
fn a_write_through_a_read_only_parameter_is_reported() {
    let dev = cpu();
    let src = KernelSource {
        name: "planted_read_only_write",
        code: "HF_KERNEL void bad(const float* x, uint32_t n) { }",
        entries: vec![KernelEntry {
            name: "bad",
            params: vec![Param::input::<f32>("x"), Param::scalar("n", ScalarKind::U32)],
            cpu: buggy_writes_its_input,
        }],
    };
    let m = dev.compile(&src).expect("compile");
    let s = dev.create_stream().expect("stream");
    let x = dev.alloc_zeroed::<f32>("x", 4, false).expect("x");
    let err = s.launch(&m.kernel("bad").expect("k"), LaunchConfig::blocks(1, 32), &[(&x).into(), 4u32.into()]);
    assert!(matches!(err, Err(HalError::ReadOnlyArgument { ref arg, .. }) if arg == "x"), "{err:?}");
}

#[test]
fn new_allocations_are_poisoned_so_unwritten_outputs_show() {
    let dev = cpu();
    let s = dev.create_stream().expect("stream");
    let f = dev.alloc::<f32>("f", 4).expect("f");
    assert!(s.copy_to_host_sync(&f.view()).expect("read").iter().all(|v| v.is_nan()));
    let b = dev.alloc::<holdfast_hal::bf16>("b", 4).expect("b");
    assert!(s.copy_to_host_sync(&b.view()).expect("read").iter().all(|v| v.is_nan()));
    let z = dev.alloc_zeroed::<f32>("z", 4, false).expect("z");
    assert_eq!(s.copy_to_host_sync(&z.view()).expect("read"), vec![0.0; 4]);
}

#[test]
fn bad_device_names_are_clear_errors() {
    let unknown: fn(&HalError) -> bool = |e| matches!(e, HalError::UnknownDevice { .. });
    let open = |name: &str| Device::open(name).map(drop);
    check_errors(vec![
        (
            "unknown backend",
            open("gpu"),
            unknown,
            words(&["unknown device `gpu`: expected `cpu`, `cuda:N` or `rocm:N`"]),
        ),
        (
            "malformed ordinal",
            open("cuda:x"),
            unknown,
            words(&["unknown device `cuda:x`: the part after `:` must be a device ordinal"]),
        ),
        ("second cpu device", open("cpu:1"), unknown, words(&["unknown device `cpu:1`: there is one cpu device"])),
        ("empty name", open(""), unknown, words(&["unknown device ``: expected `cpu`, `cuda:N` or `rocm:N`"])),
        (
            "negative ordinal",
            open("rocm:-1"),
            unknown,
            words(&["unknown device `rocm:-1`: the part after `:` must be a device ordinal"]),
        ),
        ("unknown backend with an ordinal", open("tpu:0"), unknown, words(&["unknown device `tpu:0`: expected `cpu`"])),
    ]);
    assert!(Device::open("CPU").is_ok(), "names are case-insensitive");
    assert!(Device::open("cpu:0").is_ok());
}

/// A CPU reference that reads argument `i` as a kind its signature does not declare, or past the
/// view it was given, gets an error naming the kernel, the argument and what it is; one that
/// gives up says why.
#[test]
fn a_reference_that_misreads_its_arguments_is_told_which_and_how() {
    let dev = cpu();
    let entry = |name: &'static str, cpu: holdfast_hal::CpuKernelFn| KernelEntry {
        name,
        params: vec![
            Param::input::<f32>("x"),
            Param::scalar("n", ScalarKind::U32),
            Param::scalar("k", ScalarKind::I32),
        ],
        cpu,
    };
    let src = KernelSource {
        name: "planted_misreads",
        code: "HF_KERNEL void planted(const float* x, uint32_t n, int32_t k) { }",
        entries: vec![
            entry("n_as_i32", |l: &CpuLaunch<'_>| l.i32(1).map(drop)),
            entry("k_as_u32", |l: &CpuLaunch<'_>| l.u32(2).map(drop)),
            entry("n_as_i64", |l: &CpuLaunch<'_>| l.i64(1).map(drop)),
            entry("n_as_u64", |l: &CpuLaunch<'_>| l.u64(1).map(drop)),
            entry("n_as_f32", |l: &CpuLaunch<'_>| l.f32(1).map(drop)),
            entry("x_as_scalar", |l: &CpuLaunch<'_>| l.u32(0).map(drop)),
            entry("x_as_i32_pointer", |l: &CpuLaunch<'_>| l.ptr::<i32>(0).map(drop)),
            entry("n_as_pointer", |l: &CpuLaunch<'_>| l.ptr::<f32>(1).map(drop)),
            entry("negative_k_as_count", |l: &CpuLaunch<'_>| l.count(2).map(drop)),
            entry("read_past_x", |l: &CpuLaunch<'_>| l.ptr::<f32>(0)?.read(2, 4).map(drop)),
            entry("read_x_at_minus_one", |l: &CpuLaunch<'_>| l.ptr::<f32>(0)?.get_signed(-1).map(drop)),
            entry("gives_up", |l: &CpuLaunch<'_>| Err(l.fail("the planted reference gives up"))),
        ],
    };
    let m = dev.compile(&src).expect("compile");
    let s = dev.create_stream().expect("stream");
    let x = dev.alloc_zeroed::<f32>("x", 4, false).expect("x");
    let run = |name: &str| {
        s.launch(&m.kernel(name).expect("k"), LaunchConfig::blocks(1, 32), &[(&x).into(), 4u32.into(), (-1i32).into()])
    };
    let args: fn(&HalError) -> bool = |e| matches!(e, HalError::KernelArgs { .. });
    let oob: fn(&HalError) -> bool = |e| matches!(e, HalError::OutOfBounds { .. });
    check_errors(vec![
        (
            "u32 read as i32",
            run("n_as_i32"),
            args,
            words(&["kernel `n_as_i32`: CPU reference: argument 1 (`n`) is not an i32"]),
        ),
        (
            "i32 read as u32",
            run("k_as_u32"),
            args,
            words(&["kernel `k_as_u32`: CPU reference: argument 2 (`k`) is not a u32"]),
        ),
        (
            "u32 read as i64",
            run("n_as_i64"),
            args,
            words(&["kernel `n_as_i64`: CPU reference: argument 1 (`n`) is not an i64"]),
        ),
        (
            "u32 read as u64",
            run("n_as_u64"),
            args,
            words(&["kernel `n_as_u64`: CPU reference: argument 1 (`n`) is not a u64"]),
        ),
        (
            "u32 read as f32",
            run("n_as_f32"),
            args,
            words(&["kernel `n_as_f32`: CPU reference: argument 1 (`n`) is not an f32"]),
        ),
        (
            "pointer read as a scalar",
            run("x_as_scalar"),
            args,
            words(&["CPU reference: argument 0 (`x`) is not a scalar"]),
        ),
        (
            "f32 pointer read as i32",
            run("x_as_i32_pointer"),
            args,
            words(&["kernel `x_as_i32_pointer`: CPU reference: argument 0 (`x`) is not a pointer to i32"]),
        ),
        (
            "scalar read as a pointer",
            run("n_as_pointer"),
            args,
            words(&["CPU reference: argument 1 (`n`) is not a pointer"]),
        ),
        (
            "negative count",
            run("negative_k_as_count"),
            args,
            words(&["CPU reference: argument 2 (`k`) is not a non-negative count"]),
        ),
        (
            "range read past the view",
            run("read_past_x"),
            oob,
            words(&[
                "kernel `read_past_x` argument `x`: index 5 is out of bounds for a view of 4 elements of buffer `x`",
            ]),
        ),
        (
            "negative index",
            run("read_x_at_minus_one"),
            oob,
            words(&[
                "kernel `read_x_at_minus_one` argument `x`: index -1 is out of bounds for a view of 4 elements of \
                 buffer `x`",
            ]),
        ),
        (
            "reference that gives up",
            run("gives_up"),
            |e| matches!(e, HalError::KernelFailed { .. }),
            words(&["kernel `gives_up` failed: the planted reference gives up"]),
        ),
    ]);
}

#[test]
fn a_gpu_backend_without_its_feature_or_library_is_a_clear_error() {
    for (name, feature_on) in [("cuda:0", cfg!(feature = "cuda")), ("rocm:0", cfg!(feature = "rocm"))] {
        match Device::open(name) {
            Err(HalError::BackendNotCompiled { feature, .. }) => {
                assert!(!feature_on, "{name}: feature is on but the backend says it is not compiled");
                assert!(name.starts_with(feature));
            }
            Err(e @ HalError::BackendUnavailable { .. }) => {
                assert!(feature_on);
                assert!(!e.to_string().is_empty());
                eprintln!("{name}: {e}");
            }
            Err(HalError::UnknownDevice { .. }) => {
                assert!(feature_on, "the library loaded but has no device 0")
            }
            Ok(dev) => {
                assert!(feature_on);
                eprintln!("{name} is present here: {}", dev.info().name);
            }
            Err(other) => panic!("{name}: unexpected error {other:?}"),
        }
    }
}

// ---- property test: random programs, eager vs capture + replay ----

const N: usize = 48;
const BUFS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    Memset { dst: usize, off: usize, len: usize, byte: u8 },
    Copy { src: usize, dst: usize, soff: usize, doff: usize, len: usize },
    Axpy { x: usize, y: usize, a: f32 },
    Scale { x: usize, out: usize, s: f32 },
    Add { a: usize, b: usize, out: usize },
    Touch { x: usize },
    Gather { src: usize, out: usize },
    Stage { dst: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let b = 0..BUFS;
    prop_oneof![
        (b.clone(), 0..N, 0..N, any::<u8>()).prop_map(|(dst, off, len, byte)| Op::Memset {
            dst,
            off,
            len: len.min(N - off),
            byte
        }),
        (b.clone(), b.clone(), 0..N, 0..N, 1..N).prop_map(|(src, dst, soff, doff, len)| {
            let len = len.min(N - soff).min(N - doff);
            Op::Copy { src, dst, soff, doff, len }
        }),
        (b.clone(), b.clone(), -2.0f32..2.0).prop_map(|(x, y, a)| Op::Axpy { x, y, a }),
        (b.clone(), b.clone(), -2.0f32..2.0).prop_map(|(x, out, s)| Op::Scale { x, out, s }),
        (b.clone(), b.clone(), b.clone()).prop_map(|(a, b, out)| Op::Add { a, b, out }),
        b.clone().prop_map(|x| Op::Touch { x }),
        (b.clone(), b.clone()).prop_map(|(src, out)| Op::Gather { src, out }),
        b.prop_map(|dst| Op::Stage { dst }),
    ]
}

struct World {
    bufs: Vec<Buffer<f32>>,
    idx: Buffer<i32>,
    stage: PinnedBuffer<f32>,
}

fn world(dev: &Device, tag: &str, idx: &[i32]) -> World {
    World {
        bufs: (0..BUFS).map(|i| dev.alloc_zeroed(&format!("{tag}{i}"), N, true).expect("buf")).collect(),
        idx: dev.alloc_from_slice(&format!("{tag}.idx"), idx, true).expect("idx"),
        stage: dev.alloc_pinned(N).expect("pinned"),
    }
}

fn run(dev: &Device, s: &Stream, w: &World, prog: &[Op]) {
    let m = dev.compile(demo_kernels::source()).expect("compile");
    let k = |n: &str| m.kernel(n).expect("kernel");
    let c = LaunchConfig::for_elements(N, 32);
    let n = N as u32;
    let b = |i: usize| &w.bufs[i];
    for op in prog {
        match *op {
            Op::Memset { dst, off, len, byte } => s.memset(&b(dst).slice(off, len).expect("v"), byte),
            Op::Copy { src, dst, soff, doff, len } => {
                if src == dst {
                    Ok(()) // overlapping device copies are undefined on GPUs; not generated
                } else {
                    s.copy(&b(src).slice(soff, len).expect("v"), &b(dst).slice(doff, len).expect("v"))
                }
            }
            Op::Axpy { x, y, a } => s.launch(&k("hf_axpy"), c, &[b(x).into(), b(y).into(), a.into(), n.into()]),
            Op::Scale { x, out, s: f } => {
                s.launch(&k("hf_scale"), c, &[b(x).into(), b(out).into(), f.into(), n.into()])
            }
            Op::Add { a, b: bb, out } => {
                s.launch(&k("hf_add"), c, &[b(a).into(), b(bb).into(), b(out).into(), n.into()])
            }
            Op::Touch { x } => s.launch(&k("hf_touch"), c, &[b(x).into(), n.into()]),
            Op::Gather { src, out } => {
                s.launch(&k("hf_gather"), c, &[b(src).into(), (&w.idx).into(), b(out).into(), n.into()])
            }
            Op::Stage { dst } => s.copy_from_pinned(&w.stage, 0, &b(dst).view()),
        }
        .expect("op");
    }
}

fn snapshot(s: &Stream, w: &World) -> Vec<Vec<u32>> {
    w.bufs.iter().map(|b| s.copy_to_host_sync(&b.view()).expect("read").iter().map(|v| v.to_bits()).collect()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn capture_and_replay_equal_eager_for_random_programs(
        prog in prop::collection::vec(op(), 1..24),
        idx in prop::collection::vec(-1i32..N as i32, N),
        inputs in prop::collection::vec(prop::collection::vec(-4.0f32..4.0, N), 1..4),
    ) {
        let dev = cpu();
        let s = dev.create_stream().expect("stream");
        let mut eager = world(&dev, "e", &idx);
        let mut graph_w = world(&dev, "g", &idx);
        let mut full = vec![Op::Stage { dst: 0 }];
        full.extend(prog);
        dev.compile(demo_kernels::source()).expect("compile before capture");
        s.begin_capture("prop").expect("begin");
        run(&dev, &s, &graph_w, &full);
        let g = s.end_capture().expect("end");
        prop_assert_eq!(g.op_count(), full.iter().filter(|o| !matches!(o, Op::Copy { src, dst, .. } if src == dst)).count());
        for input in &inputs {
            eager.stage.write(0, input).expect("stage");
            graph_w.stage.write(0, input).expect("stage");
            run(&dev, &s, &eager, &full);
            g.replay(&s).expect("replay");
            prop_assert_eq!(snapshot(&s, &eager), snapshot(&s, &graph_w));
        }
    }
}
