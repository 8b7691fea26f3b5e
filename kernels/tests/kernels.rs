//! Every kernel against a plain reference on fresh random inputs with poisoned outputs, edge
//! cases (empty rows, width 1, full rows, scans across the chunk boundaries), shape errors, a
//! capture/replay test, and the sanitizer catching a consumer that reads past `indptr`. Written
//! once against `&Device`; runs on `cpu` always and on `cuda:0` when present.

use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_hal::{Buffer, Device, HalError, LaunchConfig, View};
use holdfast_kernels::{Kernels, KernelsError};

/// Unwritten i32 outputs read as this (0x7B7B7B7B), never a plausible index or -1.
const POISON: i32 = 0x7B7B_7B7B;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> i64 {
        (self.next() % n.max(1)) as i64
    }
}

fn poisoned(dev: &Device, label: &str, n: usize) -> Buffer<i32> {
    dev.alloc_from_slice(label, &vec![POISON; n], true).expect("alloc")
}

fn scan_ref(lens: &[i32]) -> Vec<i32> {
    let mut out = vec![0];
    for l in lens {
        out.push(out.last().copied().unwrap_or(0) + l);
    }
    out
}

fn fill_copy_and_gather_match_their_definitions(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(7);
    let out = poisoned(dev, "fill", 1000);
    k.fill_i32(&s, &out.prefix(999).expect("view"), -1).expect("fill");
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    assert!(got[..999].iter().all(|&v| v == -1) && got[999] == POISON, "fill writes exactly its view");

    let (rows, cols, ss, ds) = (37usize, 5usize, 9usize, 6usize);
    let src_h: Vec<i32> = (0..rows * ss).map(|_| rng.below(1000) as i32).collect();
    let src = dev.alloc_from_slice("src", &src_h, true).expect("src");
    let dst = poisoned(dev, "dst", rows * ds);
    k.copy_rows_i32(&s, &src.view(), &dst.view(), rows, cols, ss, ds).expect("copy");
    let got = s.copy_to_host_sync(&dst.view()).expect("read");
    for r in 0..rows {
        assert_eq!(&got[r * ds..r * ds + cols], &src_h[r * ss..r * ss + cols]);
        assert!(got[r * ds + cols..(r + 1) * ds].iter().all(|&v| v == POISON), "row {r}: padding untouched");
    }

    let n = 4097;
    let table_h: Vec<i32> = (0..300).map(|i| i * 3 + 1).collect();
    let idx_h: Vec<i32> = (0..n).map(|_| rng.below(340) as i32 - 20).collect();
    let table = dev.alloc_from_slice("table", &table_h, true).expect("table");
    let idx = dev.alloc_from_slice("idx", &idx_h, true).expect("idx");
    let out = poisoned(dev, "out", n);
    k.gather_i32(&s, &table.view(), &idx.view(), &out.view()).expect("gather");
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    for (i, (&j, &g)) in idx_h.iter().zip(&got).enumerate() {
        let want = if (0..300).contains(&j) { table_h[j as usize] } else { -1 };
        assert_eq!(g, want, "element {i} (idx {j})");
    }
}

fn exclusive_scan_matches_its_definition_at_every_size_class(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(11);
    for n in [0usize, 1, 2, 1023, 1024, 1025, 2048, 3000, 8192, 16385] {
        let lens_h: Vec<i32> = (0..n).map(|_| rng.below(600) as i32).collect();
        let lens = dev.alloc_from_slice("lens", &lens_h, true).expect("lens");
        let indptr = poisoned(dev, "indptr", n + 2);
        k.exclusive_scan_i32(&s, &lens.view(), &indptr.prefix(n + 1).expect("view")).expect("scan");
        let got = s.copy_to_host_sync(&indptr.view()).expect("read");
        assert_eq!(&got[..n + 1], &scan_ref(&lens_h)[..], "n = {n}");
        assert_eq!(got[n + 1], POISON, "n = {n}: nothing written past indptr[n]");
    }
}

fn ragged_pack_matches_its_definition(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(23);
    for (rows, width, case) in [
        (1usize, 1usize, "random"),
        (64, 1, "random"),
        (50, 128, "random"),
        (33, 512, "empty"),
        (17, 64, "full"),
        (300, 16, "random"),
    ] {
        let dense_h: Vec<i32> = (0..rows * width).map(|_| rng.below(5000) as i32 - 100).collect();
        let lens_h: Vec<i32> = (0..rows)
            .map(|_| match case {
                "empty" => 0,
                "full" => width as i32,
                _ => rng.below(width as u64 + 1) as i32,
            })
            .collect();
        let dense = dev.alloc_from_slice("dense", &dense_h, true).expect("dense");
        let lens = dev.alloc_from_slice("lens", &lens_h, true).expect("lens");
        let indptr = poisoned(dev, "indptr", rows + 1);
        let flat = poisoned(dev, "flat", rows * width);
        k.exclusive_scan_i32(&s, &lens.view(), &indptr.view()).expect("scan");
        for range in [None, Some((0, 4000))] {
            k.ragged_pack_i32(&s, &dense.view(), &lens.view(), &indptr.view(), &flat.view(), width, range)
                .expect("pack");
            let got = s.copy_to_host_sync(&flat.view()).expect("read");
            let mut want = Vec::new();
            for r in 0..rows {
                for &v in &dense_h[r * width..r * width + lens_h[r] as usize] {
                    want.push(match range {
                        Some((lo, hi)) if v < lo || v >= hi => -1,
                        _ => v,
                    });
                }
            }
            assert_eq!(&got[..want.len()], &want[..], "{rows}×{width} {case} {range:?}");
            assert!(got[want.len()..].iter().all(|&v| v == POISON), "{rows}×{width} {case}: nothing past indptr[rows]");
        }
    }
}

/// The fused scan + pack equals the two-launch result (indptr of the clamped lengths, packed rows)
/// for lengths in and out of `[0, width]`, with and without the range check, at row counts that
/// cross the grid's 65535-block loop; nothing is written past `indptr[rows]`.
fn ragged_from_dense_equals_scan_then_pack(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(31);
    for (rows, width) in [(0usize, 4usize), (1, 1), (7, 128), (300, 16), (1000, 3), (70_000, 2)] {
        let dense_h: Vec<i32> = (0..rows * width).map(|_| rng.below(5000) as i32 - 100).collect();
        // Lengths from -2 to width + 2: the kernel clamps them.
        let lens_h: Vec<i32> = (0..rows).map(|_| rng.below(width as u64 + 5) as i32 - 2).collect();
        let clamped: Vec<i32> = lens_h.iter().map(|&l| l.clamp(0, width as i32)).collect();
        let want_indptr = scan_ref(&clamped);
        let dense = dev.alloc_from_slice("dense", &dense_h, true).expect("dense");
        let lens = dev.alloc_from_slice("lens", &lens_h, true).expect("lens");
        for range in [None, Some((0, 4000))] {
            let indptr = poisoned(dev, "indptr", rows + 2);
            let flat = poisoned(dev, "flat", rows * width + 3);
            let (iv, fv) = (indptr.prefix(rows + 1).expect("v"), flat.prefix(rows * width).expect("v"));
            k.ragged_from_dense_i32(&s, &dense.view(), &lens.view(), &iv, &fv, width, range).expect("fused");
            let got_indptr = s.copy_to_host_sync(&indptr.view()).expect("read");
            assert_eq!(&got_indptr[..rows + 1], &want_indptr[..], "{rows}×{width} {range:?}: indptr");
            assert_eq!(got_indptr[rows + 1], POISON, "{rows}×{width}: nothing past indptr");
            let got = s.copy_to_host_sync(&flat.view()).expect("read");
            let mut want = Vec::new();
            for r in 0..rows {
                for &v in &dense_h[r * width..r * width + clamped[r] as usize] {
                    want.push(match range {
                        Some((lo, hi)) if v < lo || v >= hi => -1,
                        _ => v,
                    });
                }
            }
            assert_eq!(&got[..want.len()], &want[..], "{rows}×{width} {range:?}: flat");
            assert!(got[want.len()..].iter().all(|&v| v == POISON), "{rows}×{width}: nothing past indptr[rows]");
        }
    }
}

/// Every shape a launcher refuses is an error naming the launcher, the argument at fault and what
/// it needs, found before anything is enqueued.
fn shape_errors_are_reported_before_launch(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let b = poisoned(dev, "b", 16);
    let v = |n| b.prefix(n).expect("view");
    let shape: fn(&KernelsError) -> bool = |e| matches!(e, KernelsError::Shape { .. });
    let big = 1usize << 32;
    let mut cases: Vec<ErrorCase<KernelsError>> = vec![
        (
            "indptr not len + 1",
            k.exclusive_scan_i32(&s, &v(8), &v(8)),
            shape,
            words(&["exclusive_scan_i32: indptr holds 8 elements, expected len + 1 = 9"]),
        ),
        (
            "idx shorter than out",
            k.gather_i32(&s, &v(4), &v(3), &v(4)),
            shape,
            words(&["gather_i32: idx holds 3 elements, out needs 4"]),
        ),
        (
            "cols above a stride",
            k.copy_rows_i32(&s, &v(16), &v(16), 4, 5, 4, 5),
            shape,
            words(&["copy_rows_i32: cols 5 exceeds a stride (src 4, dst 5)"]),
        ),
        (
            // The block's extent overflows usize: an error, not an arithmetic overflow.
            "extent past usize",
            k.copy_rows_i32(&s, &v(16), &v(16), 3, 1, 1 << 63, 1),
            shape,
            words(&["copy_rows_i32: [3, 1] with strides 9223372036854775808/1 spans more elements than usize counts"]),
        ),
        (
            "dst too small",
            k.copy_rows_i32(&s, &v(16), &v(8), 4, 4, 4, 4),
            shape,
            words(&["copy_rows_i32: [4, 4] with strides 4/4 needs 16/16 elements, views hold 16/8"]),
        ),
        (
            "cols past 32 bits",
            k.copy_rows_i32(&s, &v(0), &v(0), 0, big, big, big),
            shape,
            words(&["copy_rows_i32: cols = 4294967296 does not fit in 32 bits"]),
        ),
    ];
    for (op, pack) in [
        ("ragged_pack_i32", Kernels::ragged_pack_i32 as Pack),
        ("ragged_from_dense_i32", Kernels::ragged_from_dense_i32 as Pack),
    ] {
        let run = |dense, len, indptr, flat, width, range| {
            pack(&k, &s, &v(dense), &v(len), &v(indptr), &v(flat), width, range)
        };
        cases.extend([
            (
                "dense too small",
                run(15, 4, 5, 16, 4, None),
                shape,
                vec![format!("{op}: dense holds 15 elements, [4, 4] needs 16")],
            ),
            (
                "indptr too small",
                run(16, 4, 4, 16, 4, None),
                shape,
                vec![format!("{op}: indptr holds 4 elements, needs rows + 1 = 5")],
            ),
            (
                "flat too small",
                run(16, 4, 5, 15, 4, None),
                shape,
                vec![format!("{op}: flat holds 15 elements, needs rows × width = 16")],
            ),
            ("empty range", run(16, 4, 5, 16, 4, Some((3, 2))), shape, vec![format!("{op}: empty range [3, 2)")]),
            (
                "width past 32 bits",
                run(0, 0, 1, 0, big, None),
                shape,
                vec![format!("{op}: width = 4294967296 does not fit in 32 bits")],
            ),
            (
                "rows × width overflows",
                run(0, 2, 3, 0, usize::MAX, None),
                shape,
                vec![format!("{op}: 2 × {} overflows", usize::MAX)],
            ),
        ]);
    }
    check_errors(cases);
    let got = s.copy_to_host_sync(&b.view()).expect("read");
    assert!(got.iter().all(|&x| x == POISON), "no rejected launch wrote anything");
}

/// The signature the two ragged packs share.
type Pack = fn(
    &Kernels,
    &holdfast_hal::Stream,
    &View<i32>,
    &View<i32>,
    &View<i32>,
    &View<i32>,
    usize,
    Option<(i32, i32)>,
) -> holdfast_kernels::Result<()>;

fn scan_and_pack_replay_with_fresh_inputs_equal_eager(dev: &Device) {
    let k = Kernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let (rows, width) = (64usize, 32usize);
    let mk = |tag: &str| {
        (
            poisoned(dev, &format!("{tag}.dense"), rows * width),
            poisoned(dev, &format!("{tag}.len"), rows),
            poisoned(dev, &format!("{tag}.indptr"), rows + 1),
            poisoned(dev, &format!("{tag}.flat"), rows * width),
        )
    };
    let (gd, gl, gi, gf) = mk("graph");
    let (ed, el, ei, ef) = mk("eager");
    s.begin_capture("pack").expect("begin");
    k.exclusive_scan_i32(&s, &gl.view(), &gi.view()).expect("scan");
    k.ragged_pack_i32(&s, &gd.view(), &gl.view(), &gi.view(), &gf.view(), width, Some((0, 1 << 20))).expect("pack");
    let g = s.end_capture().expect("end");
    let mut rng = Rng(5);
    for step in 0..20 {
        let dense: Vec<i32> = (0..rows * width).map(|_| rng.below(1 << 21) as i32).collect();
        let lens: Vec<i32> = (0..rows).map(|_| rng.below(width as u64 + 1) as i32).collect();
        for (d, l) in [(&gd, &gl), (&ed, &el)] {
            s.copy_from_host(&dense, &d.view()).expect("upload");
            s.copy_from_host(&lens, &l.view()).expect("upload");
        }
        g.replay(&s).expect("replay");
        k.exclusive_scan_i32(&s, &el.view(), &ei.view()).expect("scan");
        k.ragged_pack_i32(&s, &ed.view(), &el.view(), &ei.view(), &ef.view(), width, Some((0, 1 << 20))).expect("pack");
        let total = lens.iter().sum::<i32>() as usize;
        let (a, b) = (s.copy_to_host_sync(&gf.view()).expect("g"), s.copy_to_host_sync(&ef.view()).expect("e"));
        assert_eq!(&a[..total], &b[..total], "step {step}");
        assert_eq!(s.copy_to_host_sync(&gi.view()).expect("g"), s.copy_to_host_sync(&ei.view()).expect("e"));
    }
}

holdfast_hal::device_suite!(
    fill_copy_and_gather_match_their_definitions,
    exclusive_scan_matches_its_definition_at_every_size_class,
    ragged_pack_matches_its_definition,
    ragged_from_dense_equals_scan_then_pack,
    shape_errors_are_reported_before_launch,
    scan_and_pack_replay_with_fresh_inputs_equal_eager,
);

/// A consumer that trusts a length the builder never wrote (reads `flat` past `indptr[rows]`) is
/// reported by the CPU sanitizer when the flat view it was handed is the valid prefix.
#[test]
fn a_consumer_reading_past_indptr_is_reported_on_the_cpu_backend() {
    let dev = Device::cpu().expect("cpu");
    let k = Kernels::new(&dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let flat = dev.alloc_from_slice("flat", &[5i32, 6, 7, 8], true).expect("flat");
    let idx = dev.alloc_from_slice("consumer_idx", &[0i32, 1, 2], true).expect("idx");
    let out = dev.alloc_zeroed::<i32>("out", 3, true).expect("out");
    // The valid entries are flat[0..2]; the consumer's third index points past them.
    let valid = flat.prefix(2).expect("valid prefix");
    // `gather_i32` maps out-of-range to -1 by design; the raw read below is the buggy consumer.
    k.gather_i32(&s, &valid, &idx.view(), &out.view()).expect("range-checked gather is safe");
    assert_eq!(s.copy_to_host_sync(&out.view()).expect("read"), vec![5, 6, -1]);
    let bad = dev.compile(&buggy_consumer()).expect("compile");
    let err = s
        .launch(
            &bad.kernel("consume").expect("k"),
            LaunchConfig::blocks(1, 32),
            &[(&valid).into(), (&out).into(), 3u32.into()],
        )
        .expect_err("reads past indptr");
    assert!(matches!(err, HalError::OutOfBounds { index: 2, len: 2, ref buffer, .. } if buffer == "flat"), "{err}");
}

/// The CPU reference of the pack refuses an `indptr` entry below 0, naming the row and the value.
#[test]
fn a_negative_indptr_entry_is_reported_on_the_cpu_backend() {
    let dev = Device::cpu().expect("cpu");
    let k = Kernels::new(&dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let dense = dev.alloc_from_slice("dense", &[1i32, 2, 3, 4], true).expect("dense");
    let len = dev.alloc_from_slice("len", &[2i32, 2], true).expect("len");
    let indptr = dev.alloc_from_slice("indptr", &[0i32, -5, 4], true).expect("indptr");
    let flat = poisoned(&dev, "flat", 4);
    check_errors(vec![(
        "row 1 starting at -5",
        k.ragged_pack_i32(&s, &dense.view(), &len.view(), &indptr.view(), &flat.view(), 2, None),
        |e| matches!(e, KernelsError::Hal(HalError::KernelFailed { .. })),
        words(&["kernel `hf_ragged_pack_i32` failed: indptr[1] = -5 is negative"]),
    )]);
}

fn consume(l: &holdfast_hal::CpuLaunch<'_>) -> holdfast_hal::Result<()> {
    let (flat, out, n) = (l.ptr::<i32>(0)?, l.ptr::<i32>(1)?, l.count(2)?);
    for i in 0..n {
        out.set(i, flat.get(i)?)?;
    }
    Ok(())
}

fn buggy_consumer() -> holdfast_hal::KernelSource {
    use holdfast_hal::{KernelEntry, Param, ScalarKind};
    holdfast_hal::KernelSource {
        name: "planted_consumer_past_indptr",
        code: "HF_KERNEL void consume(const int32_t* flat, int32_t* out, uint32_t n) { for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = flat[i]; }",
        entries: vec![KernelEntry {
            name: "consume",
            params: vec![Param::input::<i32>("flat"), Param::output::<i32>("out"), Param::scalar("n", ScalarKind::U32)],
            cpu: consume,
        }],
    }
}

#[cfg(feature = "cuda")]
#[test]
fn kernels_compile_for_sm_90_with_nvrtc() {
    holdfast_hal::testing::assert_compiles_for_sm_90(holdfast_kernels::source());
}

/// No generic or dense kernel uses local memory on sm_90a but RoPE (the frame of `sinf` / `cosf`'s
/// reduction of large arguments) and the small-`t` matmuls (8 bytes).
#[cfg(feature = "cuda")]
#[test]
fn no_kernel_spills_to_local_memory() {
    use holdfast_hal::testing::assert_sm90a_frames_within;
    assert_sm90a_frames_within(holdfast_kernels::source(), &[]);
    assert_sm90a_frames_within(
        holdfast_kernels::dense_source(),
        &[("hf_rope_bf16", 32), ("hf_matmul_small_t_bf16", 8), ("hf_matmul_small_t_f32", 8)],
    );
}

/// Every launcher of this crate launches dependent (`Stream::launch_dependent`), which needs every
/// entry to wait for the kernel before it.
#[cfg(feature = "cuda")]
#[test]
fn every_kernel_waits_for_the_kernel_before_it() {
    holdfast_hal::testing::assert_entries_wait_for_prior(holdfast_kernels::source());
    holdfast_hal::testing::assert_entries_wait_for_prior(holdfast_kernels::dense_source());
}

#[cfg(feature = "rocm")]
#[test]
fn kernels_compile_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_kernels::source());
}
