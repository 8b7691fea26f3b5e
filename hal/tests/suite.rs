//! The cross-backend suite: every test is written once against `&Device` and instantiated per
//! backend by `device_suite!` (always on `cpu`; on `cuda` when built with the feature, printing a
//! skip line when no CUDA driver or device is present).

use holdfast_hal::demo_kernels;
use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_hal::{
    bf16, Arg, BackendKind, CaptureOp, CaptureStatus, Device, HalError, Kernel, LaunchConfig, Module, Stream,
    StreamPriority,
};

fn module(dev: &Device) -> Module {
    dev.compile(demo_kernels::source()).expect("demo kernels compile")
}

/// Compiles the demo module before a test runs (tests capture, and compilation during capture is
/// illegal).
pub fn module_for_setup(dev: &Device) {
    module(dev);
}

fn kernel(dev: &Device, name: &str) -> Kernel {
    module(dev).kernel(name).expect("kernel exists")
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 128)
}

fn seq(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32) * 0.5 + k).collect()
}

fn eager_kernels_match_their_host_definition(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let n = 1000;
    let (xs, ys) = (seq(n, 1.0), seq(n, -3.0));
    let x = dev.alloc_from_slice("x", &xs, false).expect("x");
    let y = dev.alloc_from_slice("y", &ys, false).expect("y");
    let out = dev.alloc::<f32>("out", n).expect("out");
    s.launch(&kernel(dev, "hf_axpy"), cfg(n), &[(&x).into(), (&y).into(), 2.0f32.into(), (n as u32).into()])
        .expect("axpy");
    s.launch(&kernel(dev, "hf_scale"), cfg(n), &[(&y).into(), (&out).into(), 0.25f32.into(), (n as u32).into()])
        .expect("scale");
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    let want: Vec<f32> = xs.iter().zip(&ys).map(|(x, y)| 0.25 * (2.0 * x + y)).collect();
    assert_eq!(got, want);

    // bf16 input, reduction across a block.
    let (rows, cols) = (7usize, 300usize);
    let host: Vec<bf16> = (0..rows * cols).map(|i| bf16::from_f32(((i % 17) as f32) * 0.125 - 1.0)).collect();
    let xb = dev.alloc_from_slice("xb", &host, false).expect("xb");
    let sums = dev.alloc::<f32>("sums", rows).expect("sums");
    s.launch(
        &kernel(dev, "hf_row_sum_bf16"),
        LaunchConfig::blocks(rows as u32, 256),
        &[(&xb).into(), (&sums).into(), (rows as u32).into(), (cols as u32).into()],
    )
    .expect("row sum");
    let got = s.copy_to_host_sync(&sums.view()).expect("read");
    for (r, g) in got.iter().enumerate() {
        let want: f64 = host[r * cols..(r + 1) * cols].iter().map(|v| f64::from(v.to_f32())).sum();
        assert!((f64::from(*g) - want).abs() < 1e-3, "row {r}: {g} vs {want}");
    }
}

fn memset_copy_and_views_keep_addresses(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let a = dev.alloc_from_slice("a", &[1u32, 2, 3, 4, 5, 6], false).expect("a");
    let b = dev.alloc_zeroed::<u32>("b", 6, false).expect("b");
    let v = a.slice(2, 3).expect("view");
    assert_eq!(v.addr(), a.addr() + 8, "a view's address is base + offset * size");
    assert_eq!(a.prefix(4).expect("prefix").addr(), a.addr(), "prefix views share the base address");
    s.copy(&v, &b.slice(0, 3).expect("dst")).expect("copy");
    s.memset(&b.slice(3, 3).expect("tail"), 0xFF).expect("memset");
    assert_eq!(s.copy_to_host_sync(&b.view()).expect("read"), vec![3, 4, 5, u32::MAX, u32::MAX, u32::MAX]);
    let mut pinned = dev.alloc_pinned::<u32>(6).expect("pinned");
    pinned.write(0, &[9, 8, 7, 6, 5, 4]).expect("stage");
    s.copy_from_pinned(&pinned, 1, &b.slice(0, 2).expect("dst")).expect("h2d");
    s.copy_from_host(&[42u32], &b.slice(5, 1).expect("last")).expect("pageable");
    assert_eq!(s.copy_to_host_sync(&b.view()).expect("read"), vec![8, 7, 5, u32::MAX, u32::MAX, 42]);
    assert!(matches!(s.copy(&a.view(), &b.slice(0, 2).expect("v")), Err(HalError::LengthMismatch { .. })));
}

/// One step: stage `input` through pinned memory, then y = 2·x + y; out = y·0.5 + x.
fn record_step(
    dev: &Device,
    s: &Stream,
    pinned: &holdfast_hal::PinnedBuffer<f32>,
    x: &holdfast_hal::Buffer<f32>,
    y: &holdfast_hal::Buffer<f32>,
    out: &holdfast_hal::Buffer<f32>,
) {
    let n = x.len() as u32;
    s.copy_from_pinned(pinned, 0, &x.view()).expect("stage");
    s.launch(&kernel(dev, "hf_axpy"), cfg(x.len()), &[x.into(), y.into(), 2.0f32.into(), n.into()]).expect("axpy");
    s.launch(&kernel(dev, "hf_scale"), cfg(x.len()), &[y.into(), out.into(), 0.5f32.into(), n.into()]).expect("scale");
    s.launch(&kernel(dev, "hf_add"), cfg(x.len()), &[out.into(), x.into(), out.into(), n.into()]).expect("add");
}

fn capture_then_replay_with_new_inputs_equals_eager(dev: &Device) {
    let n = 513;
    let s = dev.create_stream().expect("stream");
    let mk = |tag: &str| -> [holdfast_hal::Buffer<f32>; 3] {
        [
            dev.alloc_zeroed(&format!("{tag}.x"), n, true).expect("x"),
            dev.alloc_zeroed(&format!("{tag}.y"), n, true).expect("y"),
            dev.alloc_zeroed(&format!("{tag}.out"), n, true).expect("out"),
        ]
    };
    let [ex, ey, eout] = mk("eager");
    let [gx, gy, gout] = mk("graph");
    let mut pin_e = dev.alloc_pinned::<f32>(n).expect("pinned");
    let mut pin_g = dev.alloc_pinned::<f32>(n).expect("pinned");
    s.begin_capture("step").expect("begin");
    assert!(matches!(s.capture_status(), CaptureStatus::Capturing { .. }));
    record_step(dev, &s, &pin_g, &gx, &gy, &gout);
    let graph = s.end_capture().expect("end");
    assert_eq!(graph.op_count(), 4);
    assert_eq!(s.capture_status(), CaptureStatus::Idle);
    for step in 0..4 {
        let input = seq(n, step as f32 * 3.0 - 1.0);
        pin_e.write(0, &input).expect("stage");
        pin_g.write(0, &input).expect("stage");
        record_step(dev, &s, &pin_e, &ex, &ey, &eout);
        graph.replay(&s).expect("replay");
        let (e, g) = (s.copy_to_host_sync(&eout.view()).expect("e"), s.copy_to_host_sync(&gout.view()).expect("g"));
        assert_eq!(e, g, "step {step}: replay must equal eager bit for bit");
        assert_eq!(s.copy_to_host_sync(&ey.view()).expect("ey"), s.copy_to_host_sync(&gy.view()).expect("gy"));
    }
    assert_eq!(graph.replays(), 4);
}

fn every_capture_rule_is_enforced_and_the_capture_stays_usable(dev: &Device) {
    use HalError as E;
    let s = dev.create_stream().expect("stream");
    let other = dev.create_stream().expect("stream");
    let x = dev.alloc_from_slice("x", &seq(64, 0.0), true).expect("x");
    let scratch = dev.alloc::<f32>("scratch", 4).expect("scratch");
    let ev = dev.create_event().expect("event");
    s.begin_capture("earlier").expect("begin");
    let earlier = s.end_capture().expect("end");
    s.begin_capture("rules").expect("begin");
    s.launch(&kernel(dev, "hf_touch"), cfg(64), &[(&x).into(), 64u32.into()]).expect("first launch");
    s.bind_input("x", &x).expect("bind");
    let mut uncompiled = demo_kernels::source().clone();
    uncompiled.name = "hal_demo_not_yet_compiled";
    let cases: Vec<ErrorCase<HalError>> = vec![
        (
            "allocation",
            dev.alloc::<f32>("late", 4).map(drop),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Allocate, .. }),
            words(&["allocation is illegal while stream capture is active (buffer `late`)"]),
        ),
        (
            "mapped allocation",
            dev.alloc_mapped::<f32>("late_mapped", 4).map(drop),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Allocate, .. }),
            words(&["allocation is illegal", "(buffer `late_mapped`)"]),
        ),
        (
            "pinned allocation",
            dev.alloc_pinned::<f32>(4).map(drop),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Allocate, .. }),
            words(&["allocation is illegal", "(pinned host buffer)"]),
        ),
        (
            "free",
            scratch.free(),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Free, .. }),
            words(&["free is illegal while stream capture is active (buffer `scratch`)"]),
        ),
        (
            "stream synchronize",
            s.synchronize(),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Synchronize, .. }),
            words(&["synchronize is illegal", "(stream synchronize)"]),
        ),
        (
            "synchronize of another stream of the device",
            other.synchronize(),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Synchronize, .. }),
            words(&["synchronize is illegal", "(stream synchronize)"]),
        ),
        (
            "device synchronize",
            dev.synchronize(),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Synchronize, .. }),
            words(&["synchronize is illegal", "(device synchronize)"]),
        ),
        (
            "event synchronize",
            ev.synchronize(),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Synchronize, .. }),
            words(&["synchronize is illegal", "(event synchronize)"]),
        ),
        (
            "device-to-host read",
            s.copy_to_host_sync(&x.view()).map(drop),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::DeviceToHost, .. }),
            words(&["device-to-host read is illegal", "(from `x`)"]),
        ),
        (
            "pageable copy",
            s.copy_from_host(&[1.0f32; 64], &x.view()),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::PageableCopy, .. }),
            words(&["pageable host-to-device copy is illegal", "(into `x`)"]),
        ),
        (
            "synchronous upload",
            dev.write_sync(&x, &[1.0f32; 64]),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::PageableCopy, .. }),
            words(&["pageable host-to-device copy is illegal", "(upload into `x`)"]),
        ),
        (
            "compilation",
            dev.compile(&uncompiled).map(drop),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Compile, .. }),
            words(&["module compilation is illegal", "(module `hal_demo_not_yet_compiled`)"]),
        ),
        (
            "event record",
            ev.record(&s),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Event, .. }),
            words(&["event record/wait is illegal", "(event record (order streams"]),
        ),
        (
            "stream wait",
            s.wait_event(&ev),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Event, .. }),
            words(&["event record/wait is illegal", "(stream wait (order streams"]),
        ),
        (
            "replay into the capturing stream",
            earlier.replay(&s),
            |e| matches!(e, E::IllegalDuringCapture { op: CaptureOp::Replay, .. }),
            words(&["graph replay is illegal", "(into a capturing stream)"]),
        ),
        (
            "an input bound twice",
            s.bind_input("x", &x),
            |e| matches!(e, E::Unsupported(_)),
            words(&["graph input `x` is bound twice"]),
        ),
    ];
    check_errors(cases);
    dev.compile(demo_kernels::source()).expect("a module cache hit is a lookup, legal during capture");
    // The memory of the rejected free stays allocated until the capture ends.
    assert_eq!(dev.stats().deferred_frees, 1);
    // The capture is still usable: record more, end it, and replay.
    s.launch(&kernel(dev, "hf_touch"), cfg(64), &[(&x).into(), 64u32.into()]).expect("second launch");
    let g = s.end_capture().expect("end");
    assert_eq!(g.op_count(), 2, "rejected operations are not recorded");
    assert_eq!(dev.stats().deferred_frees, 0, "deferred frees are released when the capture ends");
    g.replay(&s).expect("replay");
    let got = s.copy_to_host_sync(&x.view()).expect("read");
    assert_eq!(got, seq(64, 2.0), "two recorded touches, each +1");
}

fn an_aborted_capture_records_nothing(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let x = dev.alloc_from_slice("x", &[0.0f32; 8], true).expect("x");
    s.begin_capture("doomed").expect("begin");
    s.launch(&kernel(dev, "hf_touch"), cfg(8), &[(&x).into(), 8u32.into()]).expect("launch");
    s.abort_capture().expect("abort");
    assert_eq!(s.capture_status(), CaptureStatus::Idle);
    assert!(!dev.is_capturing());
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("read"), vec![0.0; 8], "captured work never ran");
    dev.alloc::<f32>("after", 1).expect("allocation is legal again");
}

fn a_rejected_transition_changes_nothing(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    assert!(matches!(s.end_capture(), Err(HalError::CaptureTransition { state: "idle", .. })));
    assert!(matches!(s.abort_capture(), Err(HalError::CaptureTransition { state: "idle", .. })));
    s.begin_capture("a").expect("begin");
    assert!(matches!(s.begin_capture("b"), Err(HalError::CaptureTransition { state: "capturing", .. })));
    assert_eq!(s.capture_status(), CaptureStatus::Capturing { label: "a".into(), ops: 0 });
    let g = s.end_capture().expect("end");
    assert_eq!(g.label(), "a");
    g.replay(&s).expect("an empty graph replays");
}

fn a_transient_buffer_in_a_capture_is_rejected(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let fresh = dev.alloc_from_slice("fresh_per_step_metadata", &[1.0f32; 16], false).expect("fresh");
    let out = dev.alloc_zeroed::<f32>("out", 16, true).expect("out");
    s.begin_capture("bug").expect("begin");
    let err = s
        .launch(&kernel(dev, "hf_scale"), cfg(16), &[(&fresh).into(), (&out).into(), 1.0f32.into(), 16u32.into()])
        .expect_err("must be rejected");
    match &err {
        HalError::NotGraphStable { kernel, arg, buffer } => {
            assert_eq!((kernel.as_str(), arg.as_str(), buffer.as_str()), ("hf_scale", "x", "fresh_per_step_metadata"));
        }
        other => panic!("wrong error {other:?}"),
    }
    assert!(err.to_string().contains("persistent"), "{err}");
    assert!(matches!(s.copy(&fresh.view(), &out.view()), Err(HalError::NotGraphStable { .. })));
    s.abort_capture().expect("abort");
}

fn graphs_retain_the_buffers_they_use(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let base = dev.stats().live_allocations;
    let x = dev.alloc_from_slice("x", &[1.0f32; 32], true).expect("x");
    s.begin_capture("retain").expect("begin");
    s.launch(&kernel(dev, "hf_touch"), cfg(32), &[(&x).into(), 32u32.into()]).expect("launch");
    let g = s.end_capture().expect("end");
    let view = x.view();
    drop(x);
    assert_eq!(dev.stats().live_allocations, base + 1, "the graph keeps the buffer alive");
    assert_eq!(g.retained_buffers(), 1);
    g.replay(&s).expect("replay after the buffer handle is gone");
    assert_eq!(s.copy_to_host_sync(&view).expect("read"), vec![2.0; 32]);
    drop(view);
    assert_eq!(dev.stats().live_allocations, base + 1);
    drop(g);
    assert_eq!(dev.stats().live_allocations, base, "dropping the graph frees it");
}

fn a_stale_host_refreshed_input_is_caught(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let ids = dev.alloc_zeroed::<f32>("input_ids", 8, true).expect("ids");
    ids.set_host_refreshed(true);
    let out = dev.alloc_zeroed::<f32>("out", 8, true).expect("out");
    s.begin_capture("decode").expect("begin");
    s.launch(&kernel(dev, "hf_scale"), cfg(8), &[(&ids).into(), (&out).into(), 3.0f32.into(), 8u32.into()])
        .expect("launch");
    let g = s.end_capture().expect("end");
    s.copy_from_host(&[1.0f32; 8], &ids.view()).expect("step 1 upload");
    g.replay(&s).expect("fresh input replays");
    match g.replay(&s) {
        Err(HalError::StaleHostInput { graph, buffer }) => {
            assert_eq!((graph.as_str(), buffer.as_str()), ("decode", "input_ids"))
        }
        other => panic!("expected StaleHostInput, got {other:?}"),
    }
    let mut pinned = dev.alloc_pinned::<f32>(8).expect("pinned");
    pinned.write(0, &[2.0; 8]).expect("stage");
    s.copy_from_pinned(&pinned, 0, &ids.view()).expect("step 2 upload");
    g.replay(&s).expect("a pinned upload refreshes too");
    assert_eq!(s.copy_to_host_sync(&out.view()).expect("read"), vec![6.0; 8]);
}

fn replay_with_different_input_views_is_caught(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let x = dev.alloc_zeroed::<f32>("positions", 64, true).expect("x");
    let other = dev.alloc_zeroed::<f32>("positions_copy", 64, true).expect("other");
    s.begin_capture("g32").expect("begin");
    let v = x.prefix(32).expect("prefix");
    s.bind_input("positions", &v).expect("bind");
    s.launch(&kernel(dev, "hf_touch"), cfg(32), &[(&v).into(), 32u32.into()]).expect("launch");
    let g = s.end_capture().expect("end");
    g.replay_with_inputs(&s, &[("positions", x.prefix(32).expect("p").raw())]).expect("same view");
    let err =
        g.replay_with_inputs(&s, &[("positions", x.prefix(31).expect("p").raw())]).expect_err("data-dependent length");
    assert!(matches!(&err, HalError::InputViewMismatch { input, .. } if input == "positions"), "{err}");
    let err = g.replay_with_inputs(&s, &[("positions", other.prefix(32).expect("p").raw())]).expect_err("fresh buffer");
    assert!(matches!(err, HalError::InputViewMismatch { .. }));
    assert!(matches!(g.replay_with_inputs(&s, &[]), Err(HalError::InputViewMismatch { .. })), "missing input");
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("read")[..33], [[1.0f32; 32].as_slice(), &[0.0]].concat()[..]);
}

fn bad_arguments_are_precise_errors(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let k = kernel(dev, "hf_scale");
    let x = dev.alloc_zeroed::<f32>("x", 8, false).expect("x");
    let xi = dev.alloc_zeroed::<i32>("xi", 8, false).expect("xi");
    let err = s.launch(&k, cfg(8), &[(&x).into(), (&x).into()]).expect_err("count");
    assert!(err.to_string().contains("expects 4 arguments, got 2"), "{err}");
    let err = s.launch(&k, cfg(8), &[(&xi).into(), (&x).into(), 1.0f32.into(), 8u32.into()]).expect_err("dtype");
    assert!(err.to_string().contains("argument 0 (`x`)"), "{err}");
    let err = s.launch(&k, cfg(8), &[(&x).into(), (&x).into(), 1i32.into(), 8u32.into()]).expect_err("scalar kind");
    assert!(err.to_string().contains("argument 2 (`s`) expects a f32 scalar"), "{err}");
    let err = s
        .launch(&k, LaunchConfig::blocks(1, 2048), &[(&x).into(), (&x).into(), 1.0f32.into(), 8u32.into()])
        .expect_err("block");
    assert!(matches!(err, HalError::InvalidLaunch { .. }));
    // Dynamic shared memory: the device's whole limit is usable, one byte more is refused up front.
    let max = dev.info().max_shared_mem_per_block;
    assert!(max >= 48 * 1024, "{max} bytes of shared memory per block");
    let args: [Arg; 4] = [(&x).into(), (&x).into(), 1.0f32.into(), 8u32.into()];
    let at = |bytes: u32| LaunchConfig { shared_mem_bytes: bytes, ..cfg(8) };
    s.launch(&k, at(max), &args).expect("the whole shared memory limit");
    let err = s.launch(&k, at(max + 1), &args).expect_err("over the limit");
    assert!(matches!(err, HalError::InvalidLaunch { .. }), "{err}");
    assert!(err.to_string().contains("dynamic shared memory"), "{err}");
    s.synchronize().expect("the accepted launch ran");
    assert!(matches!(module(dev).kernel("nope"), Err(HalError::UnknownKernel { .. })));
    assert!(matches!(x.slice(4, 5), Err(HalError::InvalidView { offset: 4, len: 5, capacity: 8, .. })));
    assert!(matches!(x.slice(usize::MAX, 2), Err(HalError::InvalidView { .. })));
    let _: Arg = 1u64.into();
}

/// Every call refused outside a capture names what is at fault (the argument, buffer, kernel,
/// module, graph or event) and the bound it breaks or the state it needs; nothing runs.
fn rejected_calls_name_what_is_at_fault_and_what_is_allowed(dev: &Device) {
    use HalError as E;
    let s = dev.create_stream().expect("stream");
    let side = dev.create_stream().expect("side");
    let touch = kernel(dev, "hf_touch");
    let x = dev.alloc_from_slice("x", &[0.0f32; 8], true).expect("x");
    let mut pinned = dev.alloc_pinned::<f32>(4).expect("pinned");
    let ev = dev.create_event().expect("event");
    s.begin_capture("g").expect("begin");
    s.bind_input("positions", &x.prefix(4).expect("prefix")).expect("bind");
    let g = s.end_capture().expect("end");
    let other = Device::cpu().expect("cpu");
    assert_ne!(other.id(), dev.id());
    let other_stream = other.create_stream().expect("stream");
    let foreign = other.alloc_from_slice("foreign", &[0.0f32; 8], true).expect("foreign");
    let other_pinned = other.alloc_pinned::<f32>(8).expect("pinned");
    let mut repeated = demo_kernels::source().clone();
    repeated.name = "hal_demo_repeated";
    repeated.entries.push(repeated.entries[0].clone());
    let shaped = |grid, block| LaunchConfig { grid, block, shared_mem_bytes: 0 };
    let args: [Arg; 2] = [(&x).into(), 8u32.into()];
    let cases: Vec<ErrorCase<HalError>> = vec![
        (
            "allocation whose byte size overflows",
            dev.alloc::<f32>("huge", usize::MAX / 2).map(drop),
            |e| matches!(e, E::SizeOverflow { label, elem_bytes: 4, .. } if label == "huge"),
            words(&["`huge`", "elements of 4 bytes overflow the address space"]),
        ),
        (
            "mapped allocation whose byte size overflows",
            dev.alloc_mapped::<f32>("huge_mapped", usize::MAX / 2).map(drop),
            |e| matches!(e, E::SizeOverflow { label, elem_bytes: 4, .. } if label == "huge_mapped"),
            words(&["`huge_mapped`", "elements of 4 bytes overflow the address space"]),
        ),
        (
            "pinned allocation whose byte size overflows",
            dev.alloc_pinned::<f32>(usize::MAX / 2).map(drop),
            |e| matches!(e, E::SizeOverflow { label, .. } if label == "pinned host buffer"),
            words(&["`pinned host buffer`", "overflow the address space"]),
        ),
        (
            "upload of the wrong length",
            dev.write_sync(&x, &[0.0f32; 3]),
            |e| matches!(e, E::LengthMismatch { op: "write_sync", src: 3, dst: 8 }),
            words(&["write_sync: source has 3 elements, destination has 8"]),
        ),
        (
            "upload into another device's buffer",
            dev.write_sync(&foreign, &[0.0f32; 8]),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["`foreign` belongs to another device"]),
        ),
        (
            "copy between views of different lengths",
            s.copy(&x.view(), &x.prefix(2).expect("prefix")),
            |e| matches!(e, E::LengthMismatch { op: "copy", src: 8, dst: 2 }),
            words(&["copy: source has 8 elements, destination has 2"]),
        ),
        (
            "pageable copy of the wrong length",
            s.copy_from_host(&[1.0f32; 3], &x.view()),
            |e| matches!(e, E::LengthMismatch { op: "copy_from_host", src: 3, dst: 8 }),
            words(&["copy_from_host: source has 3 elements, destination has 8"]),
        ),
        (
            "memset of another device's buffer",
            s.memset(&foreign.view(), 0),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["memset: buffer `foreign` belongs to another device"]),
        ),
        (
            "copy from another device's buffer",
            s.copy(&foreign.view(), &x.view()),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy: buffer `foreign` belongs to another device"]),
        ),
        (
            "copy into another device's buffer",
            s.copy(&x.view(), &foreign.view()),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy: buffer `foreign` belongs to another device"]),
        ),
        (
            "pageable copy into another device's buffer",
            s.copy_from_host(&[0.0f32; 8], &foreign.view()),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy_from_host: buffer `foreign` belongs to another device"]),
        ),
        (
            "read of another device's buffer",
            s.copy_to_host_sync(&foreign.view()).map(drop),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy_to_host_sync: buffer `foreign` belongs to another device"]),
        ),
        (
            "pinned copy into another device's buffer",
            s.copy_from_pinned(&pinned, 0, &foreign.prefix(4).expect("prefix")),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy_from_pinned: buffer `foreign` belongs to another device"]),
        ),
        (
            "pinned copy from another device's pinned buffer",
            s.copy_from_pinned(&other_pinned, 0, &x.view()),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["copy_from_pinned: pinned buffer belongs to another device"]),
        ),
        (
            "pinned copy past the end of the staging buffer",
            s.copy_from_pinned(&pinned, 2, &x.prefix(4).expect("prefix")),
            |e| matches!(e, E::InvalidView { offset: 2, len: 4, capacity: 4, .. }),
            words(&["view [2, 2+4) is out of range for buffer `pinned staging` of 4 elements"]),
        ),
        (
            "host write past the end of the staging buffer",
            pinned.write(3, &[1.0, 2.0]),
            |e| matches!(e, E::InvalidView { offset: 3, len: 2, capacity: 4, .. }),
            words(&["view [3, 3+2) is out of range for buffer `pinned staging` of 4 elements"]),
        ),
        (
            "view past the end of its buffer",
            x.slice(4, 5).map(drop),
            |e| matches!(e, E::InvalidView { offset: 4, len: 5, capacity: 8, .. }),
            words(&["view [4, 4+5) is out of range for buffer `x` of 8 elements"]),
        ),
        (
            "sub-view past the end of its view",
            x.slice(2, 4).and_then(|v| v.slice(3, 2)).map(drop),
            |e| matches!(e, E::InvalidSubView { offset: 5, len: 2, view_offset: 2, view_len: 4, .. }),
            words(&["view [5, 5+2) runs past the view [2, 2+4) of buffer `x` it is cut from"]),
        ),
        (
            "launch with another device's buffer",
            s.launch(&touch, cfg(8), &[(&foreign).into(), 8u32.into()]),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["hf_touch: buffer `foreign` belongs to another device"]),
        ),
        (
            "launch with a zero grid dimension",
            s.launch(&touch, shaped((0, 1, 1), (128, 1, 1)), &args),
            |e| matches!(e, E::InvalidLaunch { kernel, .. } if kernel == "hf_touch"),
            words(&["invalid launch of `hf_touch`: grid (0, 1, 1) and block (128, 1, 1) must have no zero dimension"]),
        ),
        (
            "launch with a zero block dimension",
            s.launch(&touch, shaped((1, 1, 1), (128, 1, 0)), &args),
            |e| matches!(e, E::InvalidLaunch { kernel, .. } if kernel == "hf_touch"),
            words(&["invalid launch of `hf_touch`: grid (1, 1, 1) and block (128, 1, 0) must have no zero dimension"]),
        ),
        (
            "launch with grid z past 65535",
            s.launch(&touch, shaped((1, 1, 65536), (128, 1, 1)), &args),
            |e| matches!(e, E::InvalidLaunch { kernel, .. } if kernel == "hf_touch"),
            words(&["invalid launch of `hf_touch`: grid (1, 1, 65536): y and z are limited to 65535"]),
        ),
        (
            "launch with more threads per block than any device runs",
            s.launch(&touch, shaped((1, 1, 1), (32, 32, 2)), &args),
            |e| matches!(e, E::InvalidLaunch { kernel, .. } if kernel == "hf_touch"),
            words(&["invalid launch of `hf_touch`: block (32, 32, 2) has 2048 threads, more than 1024"]),
        ),
        (
            "unknown kernel",
            module(dev).kernel("nope").map(drop),
            |e| matches!(e, E::UnknownKernel { name, .. } if name == "nope"),
            words(&["module `hal_demo` has no kernel `nope`", "(it has: hf_axpy, hf_scale, "]),
        ),
        (
            "module with a repeated entry point",
            dev.compile(&repeated).map(drop),
            |e| matches!(e, E::Compile { source_name, .. } if source_name == "hal_demo_repeated"),
            words(&["compiling `hal_demo_repeated`", "entry point name `hf_axpy` is empty or repeated"]),
        ),
        (
            "event recorded on another device's stream",
            ev.record(&other_stream),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["event recorded on a stream of another device"]),
        ),
        (
            "elapsed time between two devices' events",
            {
                let (a, b) = (dev.create_event().expect("a"), other.create_event().expect("b"));
                a.record(&s).and_then(|()| b.record(&other_stream)).and_then(|()| a.elapsed_ms(&b)).map(drop)
            },
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["elapsed time between events of two devices"]),
        ),
        (
            "synchronize on an event never recorded",
            ev.synchronize(),
            |e| matches!(e, E::EventNotRecorded),
            words(&["event was never recorded"]),
        ),
        (
            "graph replayed on another device's stream",
            g.replay(&other_stream),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["graph `g` replayed on a stream of another device"]),
        ),
        (
            "replay given an input the graph does not have",
            g.replay_with_inputs(&s, &[("positions", x.prefix(4).expect("prefix").raw()), ("nope", x.view().raw())]),
            |e| matches!(e, E::InputViewMismatch { input, .. } if input == "nope"),
            words(&["graph `g` input `nope`: captured with no such input, replayed with `x`"]),
        ),
        (
            "input bound outside a capture",
            s.bind_input("late", &x),
            |e| matches!(e, E::CaptureTransition { state: "idle", .. }),
            words(&["cannot bind a graph input on a stream whose capture state is idle"]),
        ),
        (
            "branch joined into a stream that is not capturing",
            s.join_capture(&side),
            |e| matches!(e, E::CaptureTransition { state: "idle", .. }),
            words(&["cannot join a branch into a stream whose capture state is idle"]),
        ),
        (
            "branch of another device forked",
            s.fork_capture(&other_stream),
            |e| matches!(e, E::DeviceMismatch(_)),
            words(&["fork_capture: the branch belongs to another device"]),
        ),
    ];
    check_errors(cases);
    assert_eq!(g.replays(), 0);
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("read"), vec![0.0f32; 8], "nothing ran");
}

fn zero_length_buffers_are_valid_and_empty(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let a = dev.alloc::<f32>("empty_a", 0).expect("zero-size allocation succeeds");
    let b = dev.alloc::<f32>("empty_b", 0).expect("zero-size allocation succeeds");
    assert!(a.is_empty());
    assert_ne!(a.addr(), b.addr(), "each zero-size buffer has its own address");
    assert_eq!(s.copy_to_host_sync(&a.view()).expect("read"), Vec::<f32>::new());
    s.launch(&kernel(dev, "hf_touch"), cfg(0), &[(&a).into(), 0u32.into()]).expect("a zero-element launch is fine");
    s.copy(&a.view(), &b.view()).expect("empty copy");
}

fn events_time_device_work(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let (e0, e1) = (dev.create_event().expect("e0"), dev.create_event().expect("e1"));
    assert!(matches!(e0.elapsed_ms(&e1), Err(HalError::EventNotRecorded)));
    let x = dev.alloc_zeroed::<f32>("x", 1 << 16, false).expect("x");
    e0.record(&s).expect("record");
    for _ in 0..10 {
        s.launch(&kernel(dev, "hf_touch"), cfg(1 << 16), &[(&x).into(), (1u32 << 16).into()]).expect("launch");
    }
    e1.record(&s).expect("record");
    let other = dev.create_stream().expect("stream");
    other.wait_event(&e1).expect("cross-stream wait");
    let ms = e0.elapsed_ms(&e1).expect("elapsed");
    assert!(ms >= 0.0 && ms.is_finite(), "{ms}");
    assert_eq!(other.copy_to_host_sync(&x.slice(0, 2).expect("v")).expect("read"), vec![10.0, 10.0]);
}

fn modules_are_compiled_once_per_device(dev: &Device) {
    let before = dev.cached_modules();
    let m1 = dev.compile(demo_kernels::source()).expect("compile");
    let m2 = dev.compile(demo_kernels::source()).expect("cached");
    assert_eq!(m1.source_name(), m2.source_name());
    assert_eq!(dev.cached_modules(), before.max(1));
    let other = Device::cpu().expect("cpu");
    let s = other.create_stream().expect("stream");
    let x = other.alloc_zeroed::<f32>("x", 4, false).expect("x");
    let err = s.launch(&m1.kernel("hf_touch").expect("k"), cfg(4), &[(&x).into(), 4u32.into()]);
    if other.id() != dev.id() {
        assert!(matches!(err, Err(HalError::DeviceMismatch(_))), "kernels are per device: {err:?}");
    }
}

/// A step of two branches: `a = 2·x` on the capturing stream; forked, `b = 3·a` on `side` while
/// the origin makes `c = x + x`; joined, `out = b + c`. Recorded on `s` (and `side`) eagerly or
/// into a capture: the same enqueue calls.
fn forked_step(dev: &Device, s: &Stream, side: &Stream, bufs: &[holdfast_hal::Buffer<f32>; 5], fork: bool) {
    let [x, a, b, c, out] = bufs;
    let n = x.len() as u32;
    let k = |name| kernel(dev, name);
    s.launch(&k("hf_scale"), cfg(x.len()), &[x.into(), a.into(), 2.0f32.into(), n.into()]).expect("a");
    let branch = if fork {
        s.fork_capture(side).expect("fork");
        side
    } else {
        s
    };
    branch.launch(&k("hf_scale"), cfg(x.len()), &[a.into(), b.into(), 3.0f32.into(), n.into()]).expect("b");
    s.launch(&k("hf_add"), cfg(x.len()), &[x.into(), x.into(), c.into(), n.into()]).expect("c");
    if fork {
        s.join_capture(side).expect("join");
    }
    s.launch(&k("hf_add"), cfg(x.len()), &[b.into(), c.into(), out.into(), n.into()]).expect("out");
}

fn a_forked_capture_replays_both_branches_in_order(dev: &Device) {
    let n = 1000;
    let s = dev.create_stream().expect("stream");
    let side = dev.create_stream().expect("side stream");
    let mk = |tag: &str| -> [holdfast_hal::Buffer<f32>; 5] {
        ["x", "a", "b", "c", "out"].map(|f| dev.alloc_zeroed(&format!("{tag}.{f}"), n, true).expect("buffer"))
    };
    let (eager, graph_bufs) = (mk("eager"), mk("graph"));
    s.begin_capture("forked").expect("begin");
    forked_step(dev, &s, &side, &graph_bufs, true);
    assert!(side.is_capturing(), "a joined branch stays part of the open capture");
    let err = side.launch(&kernel(dev, "hf_touch"), cfg(n), &[(&graph_bufs[0]).into(), (n as u32).into()]);
    assert!(matches!(err, Err(HalError::CaptureTransition { .. })), "a joined branch records nothing: {err:?}");
    let g = s.end_capture().expect("end");
    assert_eq!(g.op_count(), 4);
    assert_eq!(side.capture_status(), CaptureStatus::Idle, "the capture's end releases its branches");
    for step in 0..5 {
        let x = seq(n, step as f32 - 2.0);
        s.copy_from_host(&x, &eager[0].view()).expect("x");
        s.copy_from_host(&x, &graph_bufs[0].view()).expect("x");
        s.copy_from_host(&vec![f32::NAN; n], &graph_bufs[4].view()).expect("poison");
        forked_step(dev, &s, &side, &eager, false);
        g.replay(&s).expect("replay");
        let (e, r) =
            (s.copy_to_host_sync(&eager[4].view()).expect("e"), s.copy_to_host_sync(&graph_bufs[4].view()).expect("g"));
        let want: Vec<f32> = x.iter().map(|v| 3.0 * (2.0 * v) + (v + v)).collect();
        assert_eq!(e, want, "step {step}: eager");
        assert_eq!(r, want, "step {step}: the replay ran both branches, joined");
    }
    // After the capture the side stream runs eagerly again.
    side.launch(&kernel(dev, "hf_touch"), cfg(n), &[(&eager[0]).into(), (n as u32).into()]).expect("eager side");
    side.synchronize().expect("sync");
}

/// The device's f32 → bf16 conversions (hardware rounding where the device has it; single and
/// paired, `hf_pack_bf16x2*`) equal the integer definition for every f32 bit pattern on a GPU (2³²
/// of them, each in both halves of a pair), and the definition
/// equals the `half` crate's on the CPU backend (every pattern whose top half is one of a set
/// covering zeros, subnormals, normals, the largest finite values, infinities and NaNs).
fn bf16_rounding_follows_its_definition_for_every_pattern(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let out = dev.alloc_from_slice("round.check", &[0u32, u32::MAX], true).expect("buffer");
    let ranges: &[(u32, u32)] = if dev.info().backend == BackendKind::Cpu {
        &[(0x0000, 1), (0x0080, 1), (0x3f80, 1), (0x7f7f, 2), (0x8000, 1), (0x807f, 2), (0xff7f, 2), (0x1234, 1)]
    } else {
        &[(0, 1 << 16)]
    };
    for &(first, count) in ranges {
        s.launch(
            &kernel(dev, "hf_bf16_round_check"),
            LaunchConfig::blocks(1024, 256),
            &[(&out).into(), first.into(), count.into()],
        )
        .expect("launch");
    }
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    assert_eq!(got, vec![0, u32::MAX], "[mismatches, smallest mismatching pattern]");
}

/// A high-priority stream is an ordinary stream that the device schedules first: eager work on
/// it, a capture whose branch it is, and a replay into it all compute what the default priority
/// does.
fn a_high_priority_branch_runs_and_replays_like_any_other(dev: &Device) {
    let n = 777;
    let s = dev.create_stream().expect("stream");
    let hi = dev.create_stream_with_priority(StreamPriority::High).expect("high-priority stream");
    assert_eq!((s.priority(), hi.priority()), (StreamPriority::Normal, StreamPriority::High));
    assert!(format!("{hi:?}").contains("High"), "{hi:?}");
    let bufs = ["x", "a", "b", "c", "out"].map(|f| dev.alloc_zeroed(&format!("prio.{f}"), n, true).expect("buffer"));
    // Eagerly on the high-priority stream alone.
    let x = seq(n, 0.5);
    hi.copy_from_host(&x, &bufs[0].view()).expect("x");
    hi.launch(
        &kernel(dev, "hf_scale"),
        cfg(n),
        &[(&bufs[0]).into(), (&bufs[1]).into(), 4.0f32.into(), (n as u32).into()],
    )
    .expect("eager launch");
    let got = hi.copy_to_host_sync(&bufs[1].view()).expect("read");
    assert_eq!(got, x.iter().map(|v| 4.0 * v).collect::<Vec<f32>>(), "eager work on a high-priority stream");
    // Captured with the high-priority stream as the forked branch; replayed into either stream.
    s.begin_capture("prioritised branch").expect("begin");
    forked_step(dev, &s, &hi, &bufs, true);
    let g = s.end_capture().expect("end");
    assert_eq!(g.op_count(), 4);
    for (step, on) in [&s, &hi, &s].into_iter().enumerate() {
        let x = seq(n, step as f32 - 1.5);
        on.copy_from_host(&x, &bufs[0].view()).expect("x");
        on.copy_from_host(&vec![f32::NAN; n], &bufs[4].view()).expect("poison");
        g.replay(on).expect("replay");
        let got = on.copy_to_host_sync(&bufs[4].view()).expect("read");
        let want: Vec<f32> = x.iter().map(|v| 3.0 * (2.0 * v) + (v + v)).collect();
        assert_eq!(got, want, "replay {step} into a {:?} stream", on.priority());
    }
}

fn fork_and_join_misuse_is_a_precise_error_that_changes_nothing(dev: &Device) {
    let (s, side, third) =
        (dev.create_stream().expect("s"), dev.create_stream().expect("side"), dev.create_stream().expect("third"));
    let x = dev.alloc_from_slice("x", &[0.0f32; 8], true).expect("x");
    let transient = dev.alloc_from_slice("transient", &[0.0f32; 8], false).expect("transient");
    let touch = |st: &Stream, b: &holdfast_hal::Buffer<f32>| {
        st.launch(&kernel(dev, "hf_touch"), cfg(8), &[b.into(), 8u32.into()])
    };
    let transition = |r: Result<(), HalError>| assert!(matches!(r, Err(HalError::CaptureTransition { .. })), "{r:?}");
    transition(s.fork_capture(&side)); // s is not capturing
    s.begin_capture("g").expect("begin");
    transition(s.fork_capture(&s)); // into itself
    transition(s.join_capture(&side)); // never forked
    s.fork_capture(&side).expect("fork");
    transition(s.fork_capture(&side)); // already a branch
    transition(side.begin_capture("nested")); // a branch cannot begin its own capture
    transition(side.end_capture().map(drop)); // only the origin ends the capture
    transition(side.abort_capture());
    // The branch follows the capture rules.
    assert!(matches!(touch(&side, &transient), Err(HalError::NotGraphStable { .. })));
    assert!(matches!(side.synchronize(), Err(HalError::IllegalDuringCapture { op: CaptureOp::Synchronize, .. })));
    touch(&side, &x).expect("branch records");
    // A branch can fork further branches of the same capture; each must be joined.
    side.fork_capture(&third).expect("nested fork");
    touch(&third, &x).expect("third records");
    match s.end_capture() {
        Err(HalError::CaptureTransition { state, .. }) => assert!(state.contains("not yet joined"), "{state}"),
        other => panic!("ending with unjoined branches must fail, got {other:?}"),
    }
    assert!(s.is_capturing() && side.is_capturing(), "the failed end changed nothing");
    side.join_capture(&third).expect("join third");
    s.join_capture(&side).expect("join side");
    touch(&s, &x).expect("origin records after the join");
    let g = s.end_capture().expect("end");
    assert_eq!(g.op_count(), 3);
    g.replay(&s).expect("replay");
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![3.0f32; 8]);
    // Abort with a branch still forked: both are released and nothing ran.
    s.begin_capture("doomed").expect("begin");
    s.fork_capture(&side).expect("fork");
    touch(&side, &x).expect("recorded");
    s.abort_capture().expect("abort joins and releases the branch");
    assert!(!s.is_capturing() && !side.is_capturing() && !dev.is_capturing());
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![3.0f32; 8], "aborted work never ran");
    touch(&side, &x).expect("the released branch runs eagerly");
    assert_eq!(side.copy_to_host_sync(&x.view()).expect("x"), vec![4.0f32; 8]);
    // Dropping the stream that began a capture aborts it and releases its branches.
    {
        let origin = dev.create_stream().expect("origin");
        origin.begin_capture("dropped").expect("begin");
        origin.fork_capture(&side).expect("fork");
        touch(&side, &x).expect("recorded");
    }
    assert!(!side.is_capturing() && !dev.is_capturing(), "the drop aborted the capture");
    touch(&side, &x).expect("eager again");
    assert_eq!(side.copy_to_host_sync(&x.view()).expect("x"), vec![5.0f32; 8], "the aborted touch never ran");
}

/// Back-to-back dependent launches touching one buffer, eagerly and from a graph: every touch
/// waits for the one before (on CUDA sm_90 each may start early and waits in the kernel).
fn dependent_launches_keep_their_order(dev: &Device) {
    let (n, k) = (4096usize, 64usize);
    let s = dev.create_stream().expect("stream");
    let x = dev.alloc_zeroed::<f32>("x", n, true).expect("x");
    let touch = kernel(dev, "hf_touch_dependent");
    let step = || {
        for _ in 0..k {
            s.launch_dependent(&touch, cfg(n), &[(&x).into(), (n as u32).into()]).expect("dependent launch");
        }
    };
    step();
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![k as f32; n], "eager");
    s.begin_capture("dependent").expect("begin");
    step();
    let g = s.end_capture().expect("end");
    assert_eq!(g.op_count(), k);
    for r in 1..=3 {
        g.replay(&s).expect("replay");
        assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![((r + 1) * k) as f32; n], "replay {r}");
    }
    // An ordinary kernel after dependent ones still sees all their writes.
    s.launch(&kernel(dev, "hf_scale"), cfg(n), &[(&x).into(), (&x).into(), 0.5f32.into(), (n as u32).into()])
        .expect("scale");
    assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![(2 * k) as f32; n]);
    // A kernel with no wait in its code is refused where the launch would be dependent (it
    // would run beside the kernel before it); elsewhere the launch is ordinary and runs.
    let info = dev.info();
    let dependent = launches_are_dependent(dev);
    let plain = kernel(dev, "hf_touch");
    match s.launch_dependent(&plain, cfg(n), &[(&x).into(), (n as u32).into()]) {
        Err(HalError::InvalidLaunch { kernel, detail }) if dependent => {
            assert_eq!(kernel, "hf_touch");
            assert!(detail.contains("hf_grid_dependency_wait"), "{detail}");
            assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![(2 * k) as f32; n], "nothing ran");
        }
        Ok(()) if !dependent => {
            assert_eq!(s.copy_to_host_sync(&x.view()).expect("x"), vec![(2 * k + 1) as f32; n], "ordinary launch");
        }
        other => panic!("dependent launch of a kernel without a wait on {} ({}): {other:?}", info.name, info.arch),
    }
}

/// Whether `Stream::launch_dependent` issues dependent launches on `dev` (CUDA sm_90, not turned
/// off), so that a kernel without a wait is refused there; checked against what the device
/// reports.
fn launches_are_dependent(dev: &Device) -> bool {
    let info = dev.info();
    let off = std::env::var("HOLDFAST_DEPENDENT_LAUNCH")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no"));
    let sm = info.arch.trim_start_matches("sm_").trim_end_matches(char::is_alphabetic).parse::<u32>().ok();
    let expected = info.backend == BackendKind::Cuda && sm.is_some_and(|v| v >= 90) && !off;
    assert_eq!(info.dependent_launch, expected, "DeviceInfo::dependent_launch on {} ({})", info.name, info.arch);
    expected
}

fn mapped_host_memory_is_used_in_place(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let n = 300;
    let pinned_before = dev.stats().pinned_bytes;
    let mut m = dev.alloc_mapped::<f32>("step.staging", n).expect("mapped");
    assert_eq!(dev.stats().pinned_bytes, pinned_before + 4 * n as u64, "counted as pinned memory");
    assert_eq!(m.read(0, n).expect("read"), vec![0.0; n], "zero-filled");
    let out = dev.alloc_persistent::<f32>("out", n).expect("out");
    // A kernel reads the host's writes in place, eagerly and in every replay of a graph.
    s.launch(&kernel(dev, "hf_scale"), cfg(n), &[(&m.view()).into(), (&out).into(), 2.0f32.into(), (n as u32).into()])
        .expect("eager read");
    assert_eq!(s.copy_to_host_sync(&out.view()).expect("read"), vec![0.0; n]);
    m.buffer().set_host_refreshed(true);
    s.begin_capture("mapped").expect("begin");
    s.launch(&kernel(dev, "hf_scale"), cfg(n), &[(&m.view()).into(), (&out).into(), 2.0f32.into(), (n as u32).into()])
        .expect("captured read");
    let g = s.end_capture().expect("end");
    for step in 0..5 {
        let xs = seq(n, step as f32 * 7.0 - 3.0);
        m.write(0, &xs).expect("host write");
        s.memset(&out.view(), 0xff).expect("poison");
        g.replay(&s).expect("a host write refreshes the mapped input");
        let want: Vec<f32> = xs.iter().map(|x| 2.0 * x).collect();
        assert_eq!(s.copy_to_host_sync(&out.view()).expect("read"), want, "step {step}");
    }
    assert!(matches!(g.replay(&s), Err(HalError::StaleHostInput { .. })), "no write since the last replay");
    // Kernels and copies write it too; the host reads the result after a sync.
    s.launch(&kernel(dev, "hf_touch"), cfg(n), &[(&m.view()).into(), (n as u32).into()]).expect("device write");
    s.copy(&out.slice(0, 1).expect("one"), &m.buffer().slice(0, 1).expect("one")).expect("copy into mapped");
    s.synchronize().expect("sync");
    let got = m.read(0, n).expect("read");
    let last = seq(n, 4.0 * 7.0 - 3.0);
    assert_eq!(got[0], 2.0 * last[0], "copied element");
    assert_eq!(&got[1..], &last[1..].iter().map(|x| x + 1.0).collect::<Vec<_>>()[..], "touched elements");
    // Out-of-range host accesses are precise errors and change nothing.
    assert!(matches!(m.write(n - 1, &[1.0, 2.0]), Err(HalError::InvalidView { .. })));
    assert!(matches!(m.read(n, 1), Err(HalError::InvalidView { .. })));
    assert_eq!(m.read(0, n).expect("read"), got);
    // No allocation while capturing.
    s.begin_capture("alloc").expect("begin");
    assert!(matches!(dev.alloc_mapped::<f32>("late", 4), Err(HalError::IllegalDuringCapture { .. })));
    s.abort_capture().expect("abort");
    drop((g, m));
    assert_eq!(dev.stats().pinned_bytes, pinned_before, "freed with its last handle");
}

/// The sums `hf_cluster_sum` writes for clusters of `cluster` blocks: each block's cluster's `x`
/// in rank order from 0.0 (0 past `x`).
fn cluster_sums(x: &[f32], cluster: usize) -> Vec<f32> {
    (0..x.len())
        .map(|b| {
            let first = b / cluster * cluster;
            (first..first + cluster).fold(0.0f32, |s, j| s + x.get(j).copied().unwrap_or(0.0))
        })
        .collect()
}

fn a_cluster_launch_reads_the_shared_memory_of_its_blocks(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let sum = kernel(dev, "hf_cluster_sum");
    // 250 live blocks in a grid of 256: the last cluster of 4, 8 and 16 holds blocks past n.
    let (n, grid) = (250usize, 256u32);
    let x = dev.alloc_from_slice("x", &seq(n, -40.25), true).expect("x");
    let out = dev.alloc_from_slice("out", &vec![-7.0f32; n + 1], true).expect("out");
    let outv = out.prefix(n).expect("out view");
    let launch = |cluster: u32| {
        let args: [Arg; 4] = [(&x).into(), (&outv).into(), cluster.into(), (n as u32).into()];
        s.launch_cluster(&sum, LaunchConfig::blocks(grid, 64), cluster, &args)
    };
    if !dev.info().has_clusters() {
        let e = launch(4).expect_err("a device without clusters refuses them");
        assert!(matches!(e, HalError::InvalidLaunch { .. }), "{e}");
        return;
    }
    for cluster in [1u32, 2, 4, 8, 16] {
        launch(cluster).expect("cluster launch");
        let got = s.copy_to_host_sync(&out.view()).expect("out");
        assert_eq!(
            got[..n],
            cluster_sums(&s.copy_to_host_sync(&x.view()).expect("x"), cluster as usize)[..],
            "{cluster}"
        );
        assert_eq!(got[n], -7.0, "written past n");
    }
    // A plain launch of a kernel that needs clusters of 4 sees clusters of one block.
    let args: [Arg; 4] = [(&x).into(), (&outv).into(), 4u32.into(), (n as u32).into()];
    s.launch(&sum, LaunchConfig::blocks(grid, 64), &args).expect("plain launch");
    assert!(s.copy_to_host_sync(&outv).expect("out").iter().all(|v| v.is_nan()), "clusters it was not given");
    // Captured, and replayed over fresh inputs.
    s.begin_capture("cluster").expect("begin");
    launch(8).expect("captured cluster launch");
    let g = s.end_capture().expect("end");
    for r in 0..3 {
        let fresh = seq(n, r as f32 * 3.5 - 1.0);
        s.copy_from_host(&fresh, &x.view()).expect("fresh x");
        g.replay(&s).expect("replay");
        assert_eq!(s.copy_to_host_sync(&outv).expect("out"), cluster_sums(&fresh, 8), "replay {r}");
    }
    // As a dependent launch: refused where launches are dependent (this kernel never waits for
    // the one before it), elsewhere the same cluster launch.
    s.copy_from_host(&vec![-7.0f32; n], &outv).expect("poison");
    let args: [Arg; 4] = [(&x).into(), (&outv).into(), 4u32.into(), (n as u32).into()];
    match s.launch_cluster_dependent(&sum, LaunchConfig::blocks(grid, 64), 4, &args) {
        Err(HalError::InvalidLaunch { kernel, .. }) if launches_are_dependent(dev) => {
            assert_eq!(kernel, "hf_cluster_sum");
            assert_eq!(s.copy_to_host_sync(&outv).expect("out"), vec![-7.0f32; n], "nothing ran");
        }
        Ok(()) if !launches_are_dependent(dev) => {
            let xs = s.copy_to_host_sync(&x.view()).expect("x");
            assert_eq!(s.copy_to_host_sync(&outv).expect("out"), cluster_sums(&xs, 4)[..n]);
        }
        other => panic!("dependent cluster launch of a kernel without a wait: {other:?}"),
    }
}

fn cluster_launch_misuse_is_an_error_and_launches_nothing(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let sum = kernel(dev, "hf_cluster_sum");
    let n = 24usize;
    let x = dev.alloc_from_slice("x", &seq(n, 1.0), true).expect("x");
    let out = dev.alloc_from_slice("out", &vec![-7.0f32; n], true).expect("out");
    let args: [Arg; 4] = [(&x).into(), (&out).into(), 4u32.into(), (n as u32).into()];
    for (grid, cluster, what) in [(24u32, 0u32, "1 to 16"), (34, 17, "1 to 16"), (22, 4, "multiple of the cluster")] {
        let e = s.launch_cluster(&sum, LaunchConfig::blocks(grid, 64), cluster, &args).expect_err("misuse");
        let msg = e.to_string();
        assert!(matches!(e, HalError::InvalidLaunch { .. }), "{msg}");
        if dev.info().has_clusters() {
            assert!(msg.contains(what) && msg.contains("hf_cluster_sum"), "grid {grid}, cluster {cluster}: {msg}");
        }
    }
    assert_eq!(s.copy_to_host_sync(&out.view()).expect("out"), vec![-7.0f32; n], "nothing ran");
}

fn active_clusters_shrink_with_the_blocks_and_refuse_misuse(dev: &Device) {
    let sum = kernel(dev, "hf_cluster_sum");
    let shaped = |threads: u32, smem: u32| LaunchConfig { shared_mem_bytes: smem, ..LaunchConfig::blocks(1, threads) };
    if !dev.info().has_clusters() {
        let e = dev.max_active_clusters(&sum, shaped(64, 0), 2).expect_err("no clusters here");
        assert!(matches!(e, HalError::InvalidLaunch { .. }), "{e}");
        return;
    }
    let count = |threads: u32, smem: u32, cluster: u32| {
        dev.max_active_clusters(&sum, shaped(threads, smem), cluster)
            .unwrap_or_else(|e| panic!("{threads} threads, {smem} B, clusters of {cluster}: {e}"))
    };
    let units = dev.info().compute_units;
    for cluster in [1u32, 2, 4, 8, 16] {
        let small = count(64, 0, cluster);
        // A fat block (most of a multiprocessor's shared memory) leaves room for fewer clusters.
        let fat = count(64, 150 * 1024, cluster);
        // Every device with clusters schedules portable ones whose blocks fit; a larger cluster
        // of fat blocks may find no processing cluster with that many multiprocessors.
        assert!(small >= 1, "clusters of {cluster}: {small} small");
        assert!(fat >= 1 || cluster > holdfast_hal::PORTABLE_CLUSTER_BLOCKS, "clusters of {cluster}: {fat} fat");
        assert!(fat <= small, "clusters of {cluster}: {fat} fat > {small} small");
        if dev.info().backend != holdfast_hal::BackendKind::Cpu {
            // One fat block per multiprocessor at most: never more blocks than multiprocessors.
            assert!(fat * cluster <= units, "clusters of {cluster}: {fat} fat over {units} units");
        }
        eprintln!("{}: clusters of {cluster}: {small} of 64-thread blocks, {fat} of 150 KiB blocks", dev.info().name);
    }
    for (cfg, cluster, what) in [
        (shaped(64, 0), 0u32, "1 to 16"),
        (shaped(64, 0), 17, "1 to 16"),
        (shaped(2048, 0), 2, "threads"),
        (shaped(64, 0), 2, ""),
    ] {
        let got = dev.max_active_clusters(&sum, cfg, cluster);
        if what.is_empty() {
            assert!(got.is_ok());
            continue;
        }
        let e = got.expect_err("misuse");
        assert!(matches!(e, HalError::InvalidLaunch { .. }) && e.to_string().contains(what), "{e}");
    }
    let other = Device::cpu().expect("cpu");
    if other.id() != dev.id() {
        let e = other.max_active_clusters(&sum, shaped(64, 0), 2).expect_err("a kernel of another device");
        assert!(matches!(e, HalError::DeviceMismatch(_)), "{e}");
    }
}

/// Warpgroup MMA with portability.h's operand layouts (K-major and N-major B) against the f32
/// definition, exactly: small integer inputs make every product and sum exact in f32, so any
/// misplaced element shows. A device without warpgroup MMA writes NaN (and the test says so).
fn warpgroup_mma_layouts_match_the_definition(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let ints = |n: usize, seed: usize| -> Vec<bf16> {
        (0..n).map(|i| bf16::from_f32(((i * 7 + seed * 13 + i / 64 * 3) % 9) as f32 - 4.0)).collect()
    };
    let (a, bk, v) = (ints(64 * 64, 1), ints(64 * 64, 2), ints(64 * 512, 3));
    let up = |l: &str, x: &[bf16]| dev.alloc_from_slice(l, x, true).expect("input");
    let (ab, bb, vb) = (up("a", &a), up("bk", &bk), up("v", &v));
    let sb = dev.alloc::<f32>("s", 64 * 64).expect("s");
    let ob = dev.alloc::<f32>("o", 64 * 512).expect("o");
    let cfg =
        LaunchConfig { grid: (1, 1, 1), block: (256, 1, 1), shared_mem_bytes: demo_kernels::WGMMA_CHECK_SHARED_BYTES };
    // Both layouts: no swizzle, then the 128-byte swizzle; then both again with a·bkᵀ from one
    // warpgroup's m64n64k16, handed to the other through an mbarrier; then all four with a·v as
    // m64n128k16 pairs, and (with the hand-off) a from registers (ldmatrix, the RS form).
    for swizzle in 0u32..8 {
        s.memset(&sb.view(), 0xff).expect("poison s");
        s.memset(&ob.view(), 0xff).expect("poison o");
        let args: [Arg; 6] = [(&ab).into(), (&bb).into(), (&vb).into(), (&sb).into(), (&ob).into(), swizzle.into()];
        s.launch(&kernel(dev, "hf_wgmma_check"), cfg, &args).expect("launch");
        let (got_s, got_o) = (s.copy_to_host_sync(&sb.view()).expect("s"), s.copy_to_host_sync(&ob.view()).expect("o"));
        if dev.backend() == BackendKind::Cuda && !dev.info().has_wgmma() {
            assert!(got_s.iter().chain(&got_o).all(|x| x.is_nan()), "no warpgroup MMA: NaN");
            eprintln!("skipped: {} ({}) has no warpgroup MMA", dev.info().name, dev.info().arch);
            return;
        }
        let f = |x: &bf16| x.to_f32();
        for r in 0..64 {
            for n in 0..64 {
                let want: f32 = (0..64).map(|k| f(&a[r * 64 + k]) * f(&bk[n * 64 + k])).sum();
                assert_eq!(got_s[r * 64 + n], want, "a·bkᵀ at ({r}, {n}) (K-major B, swizzle {swizzle})");
            }
            for n in 0..512 {
                let want: f32 = (0..64).map(|k| f(&a[r * 64 + k]) * f(&v[k * 512 + n])).sum();
                assert_eq!(got_o[r * 512 + n], want, "a·v at ({r}, {n}) (N-major B, swizzle {swizzle})");
            }
        }
    }
}

holdfast_hal::device_suite!(
    setup = super::module_for_setup;     eager_kernels_match_their_host_definition,
    warpgroup_mma_layouts_match_the_definition,
    memset_copy_and_views_keep_addresses,
    capture_then_replay_with_new_inputs_equals_eager,
    every_capture_rule_is_enforced_and_the_capture_stays_usable,
    an_aborted_capture_records_nothing,
    a_rejected_transition_changes_nothing,
    a_transient_buffer_in_a_capture_is_rejected,
    graphs_retain_the_buffers_they_use,
    a_stale_host_refreshed_input_is_caught,
    replay_with_different_input_views_is_caught,
    bad_arguments_are_precise_errors,
    rejected_calls_name_what_is_at_fault_and_what_is_allowed,
    zero_length_buffers_are_valid_and_empty,
    events_time_device_work,
    modules_are_compiled_once_per_device,
    a_forked_capture_replays_both_branches_in_order,
    a_high_priority_branch_runs_and_replays_like_any_other,
    bf16_rounding_follows_its_definition_for_every_pattern,
    fork_and_join_misuse_is_a_precise_error_that_changes_nothing,
    dependent_launches_keep_their_order,
    mapped_host_memory_is_used_in_place,
    a_cluster_launch_reads_the_shared_memory_of_its_blocks,
    cluster_launch_misuse_is_an_error_and_launches_nothing,
    active_clusters_shrink_with_the_blocks_and_refuse_misuse,
);
