//! The dense ops against straightforward f64 references on fresh random inputs (odd shapes, t = 1,
//! n and k off the tile sizes), with poisoned outputs so unwritten elements show; matmul against a
//! sequential f32 FMA chain bit for bit, on both matmul kernels (small-t for t ≤ 8, tiled above:
//! t ∈ {1, 2, 5, 8, 9} at odd n and k, both w load paths, groups 2); batch invariance bit for bit
//! (a row of a t = 37 launch equals it in t = 1, t = 3 and t = 64 launches, crossing the two
//! kernels); argmax ties and NaN; embed with out-of-range ids;
//! shape errors before launch; graph replay equal to eager. The tensor-core matmul (where the
//! device has one) against the f64 reference and its split order at decode and prefill shapes,
//! rows bit-identical across t = 1 … 300 (both of its block shapes), poisoned outputs. Written
//! once against `&Device`.

use holdfast_hal::testing::{check_errors, words, ErrorCase};
use holdfast_hal::{bf16, BackendKind, Buffer, Device, Element, Stream, View};
use holdfast_kernels::dense::{mma_splits, MATMUL_MMA_SMALL_T_MAX, MATMUL_SMALL_T_MAX};
use holdfast_kernels::{DenseKernels, Gemm, KernelsError, MatmulKernel, MmaKernel};

/// Unwritten bf16 outputs read as this NaN pattern.
const POISON_BF16: u16 = 0xFFFF;
/// Unwritten i32 outputs read as this, never a plausible index.
const POISON_I32: i32 = 0x7B7B_7B7B;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn bf16s(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.unit() * scale)).collect()
    }
    fn below(&mut self, n: u64) -> i64 {
        (self.next() % n.max(1)) as i64
    }
}

fn upload<T: Element>(dev: &Device, label: &str, data: &[T]) -> Buffer<T> {
    dev.alloc_from_slice(label, data, true).expect("alloc")
}

fn poisoned_bf16(dev: &Device, label: &str, n: usize) -> Buffer<bf16> {
    upload(dev, label, &vec![bf16::from_bits(POISON_BF16); n])
}

fn poisoned_f32(dev: &Device, label: &str, n: usize) -> Buffer<f32> {
    upload(dev, label, &vec![f32::from_bits(0xFFFF_FFFF); n])
}

fn f64s(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| f64::from(x.to_f32())).collect()
}

/// Relative L2 error of `got` against `want`; NaN (never passes a `≤` check) if `got` has a NaN.
fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if got.iter().any(|g| g.is_nan()) {
        return f64::NAN;
    }
    (num / den.max(1e-300)).sqrt()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    let e = rel_l2(got, want);
    assert!(e <= tol, "{what}: relative L2 error {e:e} above {tol:e}");
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn matmul_ref(x: &[bf16], w: &[bf16], g: Gemm) -> Vec<f64> {
    let (x, w) = (f64s(x), f64s(w));
    let mut y = vec![0.0; g.t * g.groups * g.n];
    for m in 0..g.t {
        for gr in 0..g.groups {
            let xr = &x[(m * g.groups + gr) * g.k..][..g.k];
            for c in 0..g.n {
                let wr = &w[(gr * g.n + c) * g.k..][..g.k];
                y[(m * g.groups + gr) * g.n + c] = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
            }
        }
    }
    y
}

/// The matmul's defined order: one f32 FMA chain over k from 0.
fn matmul_chain(x: &[bf16], w: &[bf16], g: Gemm) -> Vec<f32> {
    let mut y = vec![0f32; g.t * g.groups * g.n];
    for m in 0..g.t {
        for gr in 0..g.groups {
            let xr = &x[(m * g.groups + gr) * g.k..][..g.k];
            for c in 0..g.n {
                let wr = &w[(gr * g.n + c) * g.k..][..g.k];
                let mut acc = 0f32;
                for (a, b) in xr.iter().zip(wr) {
                    acc = a.to_f32().mul_add(b.to_f32(), acc);
                }
                y[(m * g.groups + gr) * g.n + c] = acc;
            }
        }
    }
    y
}

const SHAPES: [Gemm; 7] = [
    Gemm { t: 1, n: 1, k: 1, groups: 1 },
    Gemm { t: 1, n: 300, k: 257, groups: 1 },
    Gemm { t: 37, n: 130, k: 67, groups: 1 },
    Gemm { t: 5, n: 129, k: 32, groups: 1 },
    Gemm { t: 64, n: 128, k: 256, groups: 1 },
    Gemm { t: 33, n: 17, k: 40, groups: 3 },
    Gemm { t: 3, n: 5, k: 0, groups: 1 },
];

fn matmul_matches_the_f64_reference_at_odd_shapes(dev: &Device) {
    for kind in [MatmulKernel::Portable, MatmulKernel::Auto] {
        matmul_odd_shapes(dev, kind);
    }
}

fn matmul_odd_shapes(dev: &Device, kind: MatmulKernel) {
    let dk = DenseKernels::with_matmul(dev, kind).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(3);
    for g in SHAPES {
        let (xh, wh) = (rng.bf16s(g.t * g.groups * g.k, 1.0), rng.bf16s(g.groups * g.n * g.k, 0.5));
        let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
        let len = g.t * g.groups * g.n;
        let y = poisoned_bf16(dev, "y", len + 7);
        let yf = poisoned_f32(dev, "yf", len + 7);
        dk.matmul(&s, &x.view(), &w.view(), &y.prefix(len).expect("view"), g).expect("matmul");
        dk.matmul_f32(&s, &x.view(), &w.view(), &yf.prefix(len).expect("view"), g).expect("matmul_f32");
        let got = s.copy_to_host_sync(&y.view()).expect("read");
        let gotf = s.copy_to_host_sync(&yf.view()).expect("read");
        let want = matmul_ref(&xh, &wh, g);
        if g.k == 0 {
            assert!(got[..len].iter().all(|v| v.to_f32() == 0.0), "{g:?}: k = 0 writes zeros");
        } else {
            assert_close(&format!("matmul {g:?}"), &f64s(&got[..len]), &want, 1e-2);
            let gf: Vec<f64> = gotf[..len].iter().map(|&v| f64::from(v)).collect();
            assert_close(&format!("matmul_f32 {g:?}"), &gf, &want, 1e-4);
        }
        assert!(got[len..].iter().all(|v| v.to_bits() == POISON_BF16), "{g:?}: nothing written past y");
        assert!(gotf[len..].iter().all(|v| v.to_bits() == 0xFFFF_FFFF), "{g:?}: nothing written past y (f32)");
        // The defined order, bit for bit, on every backend; bf16 out is its rounding.
        if dk.matmul_uses_tensor_cores(&x.view(), &w.view(), g) {
            check_split_order(&gotf[..len], &got[..len], &xh, &wh, g);
            continue;
        }
        let chain = matmul_chain(&xh, &wh, g);
        let gotf_bits: Vec<u32> = gotf[..len].iter().map(|v| v.to_bits()).collect();
        assert_eq!(gotf_bits, chain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{g:?}: f32 FMA chain");
        assert_eq!(bits(&got[..len]), chain.iter().map(|&v| bf16::from_f32(v).to_bits()).collect::<Vec<_>>());
    }
}

fn matmul_rows_are_batch_invariant_bit_for_bit(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(17);
    for groups in [1usize, 2] {
        let (n, k) = (130usize, 100usize);
        let xh = rng.bf16s(64 * groups * k, 1.0);
        let wh = rng.bf16s(groups * n * k, 0.3);
        let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
        let run = |t: usize, x: &Buffer<bf16>| {
            let y = poisoned_bf16(dev, "y", t * groups * n);
            let yf = poisoned_f32(dev, "yf", t * groups * n);
            let g = Gemm { t, n, k, groups };
            let xv = x.prefix(t * groups * k).expect("view");
            dk.matmul(&s, &xv, &w.view(), &y.view(), g).expect("matmul");
            dk.matmul_f32(&s, &xv, &w.view(), &yf.view(), g).expect("matmul_f32");
            let f: Vec<u32> = s.copy_to_host_sync(&yf.view()).expect("read").iter().map(|v| v.to_bits()).collect();
            (bits(&s.copy_to_host_sync(&y.view()).expect("read")), f)
        };
        let (b64, f64_) = run(64, &x);
        let (b37, f37) = run(37, &x);
        let row = groups * n;
        for r in [0usize, 1, 17, 31, 32, 36] {
            let single = upload(dev, "x1", &xh[r * groups * k..(r + 1) * groups * k]);
            let (b1, f1) = run(1, &single);
            assert_eq!(&b37[r * row..(r + 1) * row], &b1[..], "groups {groups} row {r}: t=37 vs t=1 (bf16)");
            assert_eq!(&b37[r * row..(r + 1) * row], &b64[r * row..(r + 1) * row], "row {r}: t=37 vs t=64");
            assert_eq!(&f37[r * row..(r + 1) * row], &f1[..], "row {r}: t=37 vs t=1 (f32)");
            assert_eq!(&f37[r * row..(r + 1) * row], &f64_[r * row..(r + 1) * row], "row {r}: t=37 vs t=64 (f32)");
        }
    }
}

/// Small-t shapes `(n, k, groups)`: odd n; k off the 64-wide chunk and a multiple of 8 (16-byte
/// w loads, partial last chunk), k odd (element loads), whole chunks; groups 2; k = 1.
const SMALL_T_SHAPES: [(usize, usize, usize); 6] =
    [(131, 200, 1), (77, 67, 2), (129, 256, 2), (257, 1, 1), (3, 520, 1), (1, 9, 3)];

/// Runs both outputs of `g` on `x`, `w` (views into longer buffers) and checks them against the
/// f32 FMA chain bit for bit, and that nothing is written past y.
fn check_chain(dk: &DenseKernels, dev: &Device, s: &Stream, x: &View<bf16>, w: &View<bf16>, g: Gemm, what: &str) {
    let len = g.t * g.groups * g.n;
    let (xh, wh) = (s.copy_to_host_sync(x).expect("read"), s.copy_to_host_sync(w).expect("read"));
    let y = poisoned_bf16(dev, "y", len + 5);
    let yf = poisoned_f32(dev, "yf", len + 5);
    dk.matmul(s, x, w, &y.prefix(len).expect("view"), g).expect("matmul");
    dk.matmul_f32(s, x, w, &yf.prefix(len).expect("view"), g).expect("matmul_f32");
    let got = s.copy_to_host_sync(&y.view()).expect("read");
    let gotf = s.copy_to_host_sync(&yf.view()).expect("read");
    let chain = matmul_chain(&xh, &wh, g);
    let gotf_bits: Vec<u32> = gotf[..len].iter().map(|v| v.to_bits()).collect();
    assert_eq!(gotf_bits, chain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{what} {g:?}: f32 FMA chain");
    let want: Vec<u16> = chain.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    assert_eq!(bits(&got[..len]), want, "{what} {g:?}: bf16 of the chain");
    assert!(got[len..].iter().all(|v| v.to_bits() == POISON_BF16), "{what} {g:?}: nothing written past y");
    assert!(gotf[len..].iter().all(|v| v.to_bits() == 0xFFFF_FFFF), "{what} {g:?}: nothing written past y (f32)");
}

fn matmul_small_t_is_the_fma_chain_bit_for_bit(dev: &Device) {
    let dk = DenseKernels::with_matmul(dev, MatmulKernel::Portable).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(19);
    for t in [1usize, 2, 5, 8, 9] {
        for (n, k, groups) in SMALL_T_SHAPES {
            let g = Gemm { t, n, k, groups };
            assert_eq!(g.uses_small_t_kernel(), t <= MATMUL_SMALL_T_MAX);
            let (xh, wh) = (rng.bf16s(t * groups * k + 1, 1.0), rng.bf16s(groups * n * k + 1, 0.5));
            let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
            let (xv, wv) = (x.prefix(t * groups * k).expect("v"), w.prefix(groups * n * k).expect("v"));
            check_chain(&dk, dev, &s, &xv, &wv, g, "aligned");
            // Views one element in: w is no longer 16-byte aligned, so the element-load path runs.
            let (xv, wv) = (x.slice(1, t * groups * k).expect("v"), w.slice(1, groups * n * k).expect("v"));
            check_chain(&dk, dev, &s, &xv, &wv, g, "offset by one");
        }
    }
}

fn matmul_rows_match_across_the_small_t_and_tiled_kernels(dev: &Device) {
    let dk = DenseKernels::with_matmul(dev, MatmulKernel::Portable).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(23);
    for (n, k, groups) in SMALL_T_SHAPES {
        let row = groups * n;
        let xh = rng.bf16s(37 * groups * k, 1.0);
        let wh = rng.bf16s(groups * n * k, 0.3);
        let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
        let run = |t: usize, xv: &View<bf16>| {
            let y = poisoned_bf16(dev, "y", t * row);
            let yf = poisoned_f32(dev, "yf", t * row);
            let g = Gemm { t, n, k, groups };
            dk.matmul(&s, xv, &w.view(), &y.view(), g).expect("matmul");
            dk.matmul_f32(&s, xv, &w.view(), &yf.view(), g).expect("matmul_f32");
            let f: Vec<u32> = s.copy_to_host_sync(&yf.view()).expect("read").iter().map(|v| v.to_bits()).collect();
            (bits(&s.copy_to_host_sync(&y.view()).expect("read")), f)
        };
        let (b37, f37) = run(37, &x.view());
        assert!(
            !Gemm { t: 37, n, k, groups }.uses_small_t_kernel() && Gemm { t: 3, n, k, groups }.uses_small_t_kernel()
        );
        for start in [0usize, 17, 34] {
            let (b3, f3) = run(3, &x.slice(start * groups * k, 3 * groups * k).expect("v"));
            let rows = start * row..(start + 3) * row;
            assert_eq!(&b37[rows.clone()], &b3[..], "{n}×{k}×{groups}: rows {start}.. of t=37 vs t=3 (bf16)");
            assert_eq!(&f37[rows], &f3[..], "{n}×{k}×{groups}: rows {start}.. of t=37 vs t=3 (f32)");
        }
    }
}

/// The tensor-core kernels' split order on the host: per k range of [`mma_splits`] a sequential
/// f32 FMA chain from 0, the ranges summed in order from 0.
fn matmul_split_order(x: &[bf16], w: &[bf16], g: Gemm) -> Vec<f32> {
    let (splits, len) = mma_splits(g.k);
    let mut y = vec![0f32; g.t * g.groups * g.n];
    for m in 0..g.t {
        for gr in 0..g.groups {
            let xr = &x[(m * g.groups + gr) * g.k..][..g.k];
            for c in 0..g.n {
                let wr = &w[(gr * g.n + c) * g.k..][..g.k];
                let mut total = 0f32;
                for sp in 0..splits {
                    let range = (sp * len).min(g.k)..((sp + 1) * len).min(g.k);
                    let mut acc = 0f32;
                    for (a, b) in xr[range.clone()].iter().zip(&wr[range]) {
                        acc = a.to_f32().mul_add(b.to_f32(), acc);
                    }
                    total += acc;
                }
                y[(m * g.groups + gr) * g.n + c] = total;
            }
        }
    }
    y
}

/// A tensor-core result against the split order: the hardware sums inside a 16-wide k step in
/// its own order, so f32 outputs agree to f32 rounding and bf16 outputs to one bf16 ulp.
fn check_split_order(gotf: &[f32], got: &[bf16], x: &[bf16], w: &[bf16], g: Gemm) {
    let want = matmul_split_order(x, w, g);
    let scale = (want.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / want.len().max(1) as f64).sqrt();
    for (i, ((f, b), r)) in gotf.iter().zip(got).zip(&want).enumerate() {
        let tol = 1e-5 * scale.max(1e-30) + 1e-6 * f64::from(r.abs());
        assert!((f64::from(*f) - f64::from(*r)).abs() <= tol, "{g:?} element {i}: f32 {f} vs split order {r}");
        let ulp = f64::from(bf16::from_f32(*r).to_f32().abs()) / 128.0;
        assert!(
            (f64::from(b.to_f32()) - f64::from(*r)).abs() <= ulp + tol,
            "{g:?} element {i}: bf16 {b} vs split order {r}"
        );
    }
}

/// Shapes the tensor cores take `(n, k, groups)`: one k range and several (2, 4, 8), n off the
/// block's columns, groups, a k range shorter than the rest.
const MMA_SHAPES: [(usize, usize, usize); 5] =
    [(70, 4096, 1), (131, 1048, 2), (64, 2048, 1), (17, 520, 3), (300, 64, 1)];

/// The decode and prefill row counts: both block shapes, their edges, partial blocks.
const MMA_TS: [usize; 8] = [1, 3, 16, 17, 37, 64, 65, 300];

fn tensor_core_matmul_matches_the_split_order_and_rows_are_batch_invariant(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let expect_tc = dev.info().backend == BackendKind::Cuda && holdfast_kernels::has_bf16_tensor_cores(dev.info());
    assert_eq!(dk.uses_tensor_cores(), expect_tc, "{}", dev.info().arch);
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(29);
    // On tensor cores, also a shape whose t = 300 rows run the tiled kernel (t = 65 the 64-row
    // one, t ≤ 16 the 16-row one); too slow for the CPU backend's references.
    let mut shapes = MMA_SHAPES.to_vec();
    if expect_tc {
        shapes.push((4096, 520, 1));
        assert_eq!(Gemm { t: 300, n: 4096, k: 520, groups: 1 }.mma_kernel(), MmaKernel::Tiled);
        assert_eq!(Gemm { t: 65, n: 4096, k: 520, groups: 1 }.mma_kernel(), MmaKernel::Rows64);
    }
    for (n, k, groups) in shapes {
        let row = groups * n;
        let tmax = *MMA_TS.iter().max().expect("ts");
        let xh = rng.bf16s(tmax * groups * k, 1.0);
        let wh = rng.bf16s(groups * n * k, 0.05);
        let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
        let full = Gemm { t: tmax, n, k, groups };
        assert_eq!(dk.matmul_uses_tensor_cores(&x.view(), &w.view(), full), expect_tc);
        let run = |t: usize| {
            let g = Gemm { t, n, k, groups };
            let y = poisoned_bf16(dev, "y", t * row + 3);
            let yf = poisoned_f32(dev, "yf", t * row + 3);
            let xv = x.prefix(t * groups * k).expect("view");
            dk.matmul(&s, &xv, &w.view(), &y.prefix(t * row).expect("v"), g).expect("matmul");
            dk.matmul_f32(&s, &xv, &w.view(), &yf.prefix(t * row).expect("v"), g).expect("matmul_f32");
            let (b, f) =
                (s.copy_to_host_sync(&y.view()).expect("read"), s.copy_to_host_sync(&yf.view()).expect("read"));
            assert!(b[t * row..].iter().all(|v| v.to_bits() == POISON_BF16), "{g:?}: nothing written past y");
            assert!(f[t * row..].iter().all(|v| v.to_bits() == 0xFFFF_FFFF), "{g:?}: nothing written past y");
            (b[..t * row].to_vec(), f[..t * row].to_vec())
        };
        let (b_all, f_all) = run(tmax);
        let gf: Vec<f64> = f_all.iter().map(|&v| f64::from(v)).collect();
        assert_close(&format!("matmul_f32 {full:?}"), &gf, &matmul_ref(&xh, &wh, full), 1e-4);
        if expect_tc {
            check_split_order(&f_all, &b_all, &xh, &wh, full);
        }
        for t in MMA_TS {
            let (b, f) = run(t);
            assert_eq!(bits(&b), bits(&b_all[..t * row]), "{n}×{k}×{groups}: rows of t={t} vs t={tmax} (bf16)");
            let fb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(fb(&f), fb(&f_all[..t * row]), "{n}×{k}×{groups}: rows of t={t} vs t={tmax} (f32)");
        }
    }
    // Calls the tensor cores do not take run the SIMT chain: k off a multiple of 8, a view that
    // starts off an 8-element boundary.
    if expect_tc {
        let (x, w) = (upload(dev, "x", &rng.bf16s(4 * 100, 1.0)), upload(dev, "w", &rng.bf16s(9 * 100, 1.0)));
        assert!(!dk.matmul_uses_tensor_cores(&x.view(), &w.view(), Gemm::new(4, 9, 100)));
        let (xv, wv) = (x.slice(4, 4 * 96).expect("v"), w.view());
        assert!(!dk.matmul_uses_tensor_cores(&xv, &wv, Gemm::new(4, 9, 96)));
        check_chain(&dk, dev, &s, &xv, &w.prefix(9 * 96).expect("v"), Gemm::new(4, 9, 96), "offset x");
    }
}

fn rms_ref(x: &[bf16], w: &[bf16], dim: usize, eps: f64) -> Vec<f64> {
    let (x, w) = (f64s(x), f64s(w));
    x.chunks(dim)
        .flat_map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / dim as f64 + eps).sqrt();
            r.iter().zip(&w).map(move |(v, w)| v * inv * w).collect::<Vec<_>>()
        })
        .collect()
}

fn rms_norm_matches_the_reference_in_place_and_per_row(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(29);
    for (rows, dim) in [(1usize, 1usize), (1, 4096), (37, 256), (5, 300), (64, 513)] {
        let (xh, wh) = (rng.bf16s(rows * dim, 3.0), rng.bf16s(dim, 1.0));
        let (x, w) = (upload(dev, "x", &xh), upload(dev, "w", &wh));
        let y = poisoned_bf16(dev, "y", rows * dim + 3);
        dk.rms_norm(&s, &x.view(), &w.view(), &y.prefix(rows * dim).expect("v"), rows, dim, 1e-6).expect("norm");
        let got = s.copy_to_host_sync(&y.view()).expect("read");
        assert_close(&format!("rms_norm {rows}×{dim}"), &f64s(&got[..rows * dim]), &rms_ref(&xh, &wh, dim, 1e-6), 1e-2);
        assert!(got[rows * dim..].iter().all(|v| v.to_bits() == POISON_BF16), "nothing written past y");
        // In place equals out of place, bit for bit.
        dk.rms_norm(&s, &x.view(), &w.view(), &x.view(), rows, dim, 1e-6).expect("in place");
        assert_eq!(bits(&s.copy_to_host_sync(&x.view()).expect("read")), bits(&got[..rows * dim]), "in place");
        // Each row alone gives the same bits.
        let r = rows / 2;
        let one = upload(dev, "x1", &xh[r * dim..(r + 1) * dim]);
        let y1 = poisoned_bf16(dev, "y1", dim);
        dk.rms_norm(&s, &one.view(), &w.view(), &y1.view(), 1, dim, 1e-6).expect("one row");
        assert_eq!(bits(&s.copy_to_host_sync(&y1.view()).expect("read")), bits(&got[r * dim..(r + 1) * dim]));
    }
}

#[allow(clippy::too_many_arguments)]
fn rope_ref(x: &[bf16], pos: &[i32], heads: usize, hd: usize, rd: usize, theta: f64, inverse: bool) -> Vec<f64> {
    let mut out = f64s(x);
    for (t, &p) in pos.iter().enumerate() {
        if p < 0 {
            continue;
        }
        for h in 0..heads {
            let base = (t * heads + h) * hd + hd - rd;
            for i in 0..rd / 2 {
                let mut ang = f64::from(p) * theta.powf(-(2.0 * i as f64) / rd as f64);
                if inverse {
                    ang = -ang;
                }
                let (a, b) = (out[base + 2 * i], out[base + 2 * i + 1]);
                out[base + 2 * i] = a * ang.cos() - b * ang.sin();
                out[base + 2 * i + 1] = a * ang.sin() + b * ang.cos();
            }
        }
    }
    out
}

fn rope_matches_the_reference_and_skips_negative_positions(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(31);
    for (tokens, heads, hd, rd) in [(1usize, 1usize, 2usize, 2usize), (37, 3, 96, 64), (5, 8, 64, 64), (16, 1, 512, 64)]
    {
        let xh = rng.bf16s(tokens * heads * hd, 2.0);
        let pos_h: Vec<i32> = (0..tokens).map(|t| if t % 5 == 3 { -1 } else { rng.below(5000) as i32 }).collect();
        for inverse in [false, true] {
            let x = upload(dev, "x", &xh);
            let pos = upload(dev, "pos", &pos_h);
            dk.rope(&s, &x.view(), &pos.view(), tokens, heads, hd, rd, 10000.0, inverse).expect("rope");
            let got = s.copy_to_host_sync(&x.view()).expect("read");
            let want = rope_ref(&xh, &pos_h, heads, hd, rd, 10000.0, inverse);
            assert_close(&format!("rope {tokens}×{heads}×{hd}/{rd} inverse={inverse}"), &f64s(&got), &want, 1e-2);
            let row = heads * hd;
            for (t, &p) in pos_h.iter().enumerate() {
                let r = t * row..(t + 1) * row;
                if p < 0 {
                    assert_eq!(bits(&got[r.clone()]), bits(&xh[r.clone()]), "token {t} (position -1) untouched");
                }
                for h in 0..heads {
                    let nope = (t * heads + h) * hd..(t * heads + h) * hd + hd - rd;
                    assert_eq!(bits(&got[nope.clone()]), bits(&xh[nope]), "dims before rope_dim untouched");
                }
            }
        }
        // The inverse undoes the rotation (up to bf16 rounding).
        let x = upload(dev, "x", &xh);
        let pos = upload(dev, "pos", &pos_h);
        dk.rope(&s, &x.view(), &pos.view(), tokens, heads, hd, rd, 10000.0, false).expect("rope");
        dk.rope(&s, &x.view(), &pos.view(), tokens, heads, hd, rd, 10000.0, true).expect("inverse");
        assert_close("rope then inverse", &f64s(&s.copy_to_host_sync(&x.view()).expect("read")), &f64s(&xh), 1e-2);
    }
}

fn swiglu_ref(gu: &[bf16], ffn: usize, limit: f64) -> Vec<f64> {
    f64s(gu)
        .chunks(2 * ffn)
        .flat_map(|r| {
            (0..ffn)
                .map(|j| {
                    let g = r[j].min(limit);
                    let u = r[ffn + j].clamp(-limit, limit);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn swiglu_matches_the_reference_with_and_without_the_limit(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(37);
    for (tokens, ffn) in [(1usize, 1usize), (37, 100), (64, 512)] {
        let gh = rng.bf16s(tokens * 2 * ffn, 20.0);
        let gu = upload(dev, "gu", &gh);
        for limit in [10.0f32, f32::INFINITY] {
            let out = poisoned_bf16(dev, "out", tokens * ffn + 5);
            dk.swiglu(&s, &gu.view(), &out.prefix(tokens * ffn).expect("v"), tokens, ffn, limit).expect("swiglu");
            let got = s.copy_to_host_sync(&out.view()).expect("read");
            let want = swiglu_ref(&gh, ffn, f64::from(limit));
            assert_close(&format!("swiglu {tokens}×{ffn} limit {limit}"), &f64s(&got[..tokens * ffn]), &want, 1e-2);
            assert!(got[tokens * ffn..].iter().all(|v| v.to_bits() == POISON_BF16), "nothing written past out");
        }
    }
    // The clamp: gate 30 → 10, up ±30 → ±10; a NaN stays NaN.
    let gu = upload(dev, "gu", &[30.0f32, 1.0, f32::NAN, 30.0, -30.0, 2.0].map(bf16::from_f32));
    let out = poisoned_bf16(dev, "out", 3);
    dk.swiglu(&s, &gu.view(), &out.view(), 1, 3, 10.0).expect("swiglu");
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    let silu = |g: f64| g / (1.0 + (-g).exp());
    assert!((got[0].to_f32() as f64 - silu(10.0) * 10.0).abs() < 0.1, "{got:?}");
    assert!((got[1].to_f32() as f64 - silu(1.0) * -10.0).abs() < 0.05, "{got:?}");
    assert!(got[2].to_f32().is_nan(), "NaN gate stays NaN: {got:?}");
}

fn embed_copies_rows_and_zeroes_out_of_range_ids(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(41);
    let (vocab, hidden, tokens) = (50usize, 33usize, 40usize);
    let th = rng.bf16s(vocab * hidden, 1.0);
    let ids_h: Vec<i32> = (0..tokens)
        .map(|t| match t % 7 {
            0 => -1,
            1 => vocab as i32,
            2 => i32::MIN,
            _ => rng.below(vocab as u64) as i32,
        })
        .collect();
    let (table, ids) = (upload(dev, "table", &th), upload(dev, "ids", &ids_h));
    let out = poisoned_bf16(dev, "out", tokens * hidden + 4);
    dk.embed(&s, &table.view(), &ids.view(), &out.prefix(tokens * hidden).expect("v"), tokens, hidden, vocab)
        .expect("embed");
    let got = s.copy_to_host_sync(&out.view()).expect("read");
    for (t, &id) in ids_h.iter().enumerate() {
        let row = bits(&got[t * hidden..(t + 1) * hidden]);
        if (0..vocab as i32).contains(&id) {
            assert_eq!(row, bits(&th[id as usize * hidden..(id as usize + 1) * hidden]), "token {t}");
        } else {
            assert!(row.iter().all(|&b| b == 0), "token {t}: id {id} writes a zero row");
        }
    }
    assert!(got[tokens * hidden..].iter().all(|v| v.to_bits() == POISON_BF16), "nothing written past out");
}

fn argmax_ref(row: &[f32]) -> i32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, &v) in row.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((b, _)) if v <= b => {}
            _ => best = Some((v, i)),
        }
    }
    best.map_or(0, |(_, i)| i as i32)
}

fn argmax_takes_the_lowest_index_on_ties_and_nan_never_wins(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(43);
    for (rows, cols) in [(1usize, 1usize), (37, 1000), (3, 129_280), (64, 257)] {
        // Coarse values make ties common.
        let lh: Vec<f32> =
            (0..rows * cols).map(|i| if i % 11 == 5 { f32::NAN } else { (rng.unit() * 8.0).round() }).collect();
        let logits = upload(dev, "logits", &lh);
        let out = upload(dev, "out", &vec![POISON_I32; rows + 2]);
        dk.argmax(&s, &logits.view(), &out.prefix(rows).expect("v"), rows, cols).expect("argmax");
        let got = s.copy_to_host_sync(&out.view()).expect("read");
        let want: Vec<i32> = lh.chunks(cols).map(argmax_ref).collect();
        assert_eq!(&got[..rows], &want[..], "{rows}×{cols}");
        assert_eq!(&got[rows..], &[POISON_I32; 2], "nothing written past out");
    }
    let nan = f32::NAN;
    let cases: [(&[f32], i32); 7] = [
        (&[1.0, 3.0, 3.0, 2.0], 1),
        (&[nan, nan, nan], 0),
        (&[nan, -1.0, nan, -1.0], 1),
        (&[nan, f32::NEG_INFINITY], 1),
        (&[f32::NEG_INFINITY; 5], 0),
        (&[0.0, -0.0, 5.0, f32::INFINITY, nan, f32::INFINITY], 3),
        (&[-0.0, 0.0], 0),
    ];
    for (row, want) in cases {
        let logits = upload(dev, "logits", row);
        let out = upload(dev, "out", &[POISON_I32]);
        dk.argmax(&s, &logits.view(), &out.view(), 1, row.len()).expect("argmax");
        assert_eq!(s.copy_to_host_sync(&out.view()).expect("read")[0], want, "{row:?}");
    }
    // A long row whose maximum ties across block lanes (columns 700, 701 and 95_000).
    let mut row = vec![0.5f32; 100_000];
    row[95_000] = 2.0;
    row[701] = 2.0;
    row[700] = 2.0;
    row[3] = nan;
    let logits = upload(dev, "logits", &row);
    let out = upload(dev, "out", &[POISON_I32]);
    dk.argmax(&s, &logits.view(), &out.view(), 1, row.len()).expect("argmax");
    assert_eq!(s.copy_to_host_sync(&out.view()).expect("read")[0], 700);
}

fn repeat_rows_copies_every_row(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(47);
    for (tokens, copies, hidden) in [(1usize, 1usize, 1usize), (37, 4, 65), (64, 4, 256)] {
        let xh = rng.bf16s(tokens * hidden, 1.0);
        let x = upload(dev, "x", &xh);
        let n = tokens * copies * hidden;
        let y = poisoned_bf16(dev, "y", n + 3);
        dk.repeat_rows(&s, &x.view(), &y.prefix(n).expect("v"), tokens, copies, hidden).expect("repeat");
        let got = s.copy_to_host_sync(&y.view()).expect("read");
        for t in 0..tokens {
            for j in 0..copies {
                let o = (t * copies + j) * hidden;
                assert_eq!(bits(&got[o..o + hidden]), bits(&xh[t * hidden..(t + 1) * hidden]), "token {t} copy {j}");
            }
        }
        assert!(got[n..].iter().all(|v| v.to_bits() == POISON_BF16), "nothing written past y");
    }
}

/// Every shape a launcher refuses is an error naming the op, the argument at fault and the shape it
/// needs (or the bound it breaks), found before anything is enqueued.
fn shape_errors_are_reported_before_launch(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let b = poisoned_bf16(dev, "b", 64);
    let f = poisoned_f32(dev, "f", 64);
    let i = upload(dev, "i", &[POISON_I32; 16]);
    let v = |n| b.prefix(n).expect("view");
    let vf = |n| f.prefix(n).expect("view");
    let vi = |n| i.prefix(n).expect("view");
    let shape: fn(&KernelsError) -> bool = |e| matches!(e, KernelsError::Shape { .. });
    let g = Gemm { t: 2, n: 3, k: 4, groups: 1 };
    let big = 1usize << 32;
    let huge = Gemm { t: usize::MAX / 2, n: 3, k: 4, groups: 1 };
    let past_grid = Gemm { t: 65535 * 32 + 1, n: 0, k: 0, groups: 1 };
    let cases: Vec<ErrorCase<KernelsError>> = vec![
        (
            "x too short",
            dk.matmul(&s, &v(7), &v(12), &v(6), g),
            shape,
            words(&["matmul: x holds 7 elements, [2, 1, 4] needs 8"]),
        ),
        (
            "w too short",
            dk.matmul(&s, &v(8), &v(11), &v(6), g),
            shape,
            words(&["matmul: w holds 11 elements, [1, 3, 4] needs 12"]),
        ),
        (
            "y too short",
            dk.matmul(&s, &v(8), &v(12), &v(5), g),
            shape,
            words(&["matmul: y holds 5 elements, [2, 1, 3] needs 6"]),
        ),
        (
            "zero groups",
            dk.matmul(&s, &v(8), &v(12), &v(6), Gemm { groups: 0, ..g }),
            shape,
            words(&["matmul: groups must be at least 1"]),
        ),
        (
            "y short for 2 groups",
            dk.matmul(&s, &v(16), &v(24), &v(6), Gemm { groups: 2, ..g }),
            shape,
            words(&["matmul: y holds 6 elements, [2, 2, 3] needs 12"]),
        ),
        (
            "f32 y too short",
            dk.matmul_f32(&s, &v(8), &v(12), &vf(5), g),
            shape,
            words(&["matmul_f32: y holds 5 elements, [2, 1, 3] needs 6"]),
        ),
        (
            "overflowing shape",
            dk.matmul(&s, &v(8), &v(12), &v(6), huge),
            shape,
            words(&["matmul: [9223372036854775807, 1, 4] overflows"]),
        ),
        (
            "t past the grid",
            dk.matmul(&s, &v(0), &v(0), &v(0), past_grid),
            shape,
            words(&["matmul: t = 2097121 or groups = 1 exceeds the grid (t ≤ 2097120, groups ≤ 65535)"]),
        ),
        (
            "groups past the grid",
            dk.matmul_f32(&s, &v(0), &v(0), &vf(0), Gemm { t: 0, n: 0, k: 0, groups: 65536 }),
            shape,
            words(&["matmul_f32: t = 0 or groups = 65536 exceeds the grid"]),
        ),
        (
            "n past 32 bits",
            dk.matmul(&s, &v(0), &v(0), &v(0), Gemm { t: 0, n: big, k: 0, groups: 1 }),
            shape,
            words(&["matmul: n = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "k past 32 bits",
            dk.matmul(&s, &v(0), &v(0), &v(0), Gemm { t: 0, n: 0, k: big, groups: 1 }),
            shape,
            words(&["matmul: k = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "norm x too short",
            dk.rms_norm(&s, &v(15), &v(8), &v(16), 2, 8, 1e-6),
            shape,
            words(&["rms_norm: x holds 15 elements, [2, 8] needs 16"]),
        ),
        (
            "norm w too short",
            dk.rms_norm(&s, &v(16), &v(7), &v(16), 2, 8, 1e-6),
            shape,
            words(&["rms_norm: w holds 7 elements, [8] needs 8"]),
        ),
        (
            "norm y too short",
            dk.rms_norm(&s, &v(16), &v(8), &v(15), 2, 8, 1e-6),
            shape,
            words(&["rms_norm: y holds 15 elements, [2, 8] needs 16"]),
        ),
        (
            "norm rows past 32 bits",
            dk.rms_norm(&s, &v(0), &v(0), &v(0), big, 0, 1e-6),
            shape,
            words(&["rms_norm: rows = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "rope x too short",
            dk.rope(&s, &v(31), &vi(2), 2, 2, 8, 4, 1e4, false),
            shape,
            words(&["rope: x holds 31 elements, [2, 2, 8] needs 32"]),
        ),
        (
            "rope positions too short",
            dk.rope(&s, &v(32), &vi(1), 2, 2, 8, 4, 1e4, false),
            shape,
            words(&["rope: positions holds 1 elements, [2] needs 2"]),
        ),
        (
            "odd rope_dim",
            dk.rope(&s, &v(32), &vi(2), 2, 2, 8, 3, 1e4, false),
            shape,
            words(&["rope: rope_dim 3 must be even and at most head_dim 8"]),
        ),
        (
            "rope_dim above head_dim",
            dk.rope(&s, &v(32), &vi(2), 2, 2, 8, 10, 1e4, false),
            shape,
            words(&["rope: rope_dim 10 must be even and at most head_dim 8"]),
        ),
        (
            "rope heads past 32 bits",
            dk.rope(&s, &v(0), &vi(0), 0, big, 8, 4, 1e4, false),
            shape,
            words(&["rope: heads = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "gate_up too short",
            dk.swiglu(&s, &v(15), &v(4), 2, 4, 10.0),
            shape,
            words(&["swiglu: gate_up holds 15 elements, [2, 2, 4] needs 16"]),
        ),
        (
            "swiglu out too short",
            dk.swiglu(&s, &v(16), &v(7), 2, 4, 10.0),
            shape,
            words(&["swiglu: out holds 7 elements, [2, 4] needs 8"]),
        ),
        (
            "NaN limit",
            dk.swiglu(&s, &v(16), &v(8), 2, 4, f32::NAN),
            shape,
            words(&["swiglu: limit NaN must be ≥ 0 (or +inf)"]),
        ),
        (
            "negative limit",
            dk.swiglu(&s, &v(16), &v(8), 2, 4, -1.0),
            shape,
            words(&["swiglu: limit -1 must be ≥ 0 (or +inf)"]),
        ),
        (
            "swiglu ffn past 32 bits",
            dk.swiglu(&s, &v(0), &v(0), 0, big, 10.0),
            shape,
            words(&["swiglu: ffn = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "table too short",
            dk.embed(&s, &v(29), &vi(2), &v(6), 2, 3, 10),
            shape,
            words(&["embed: table holds 29 elements, [10, 3] needs 30"]),
        ),
        (
            "ids too short",
            dk.embed(&s, &v(30), &vi(1), &v(6), 2, 3, 10),
            shape,
            words(&["embed: ids holds 1 elements, [2] needs 2"]),
        ),
        (
            "embed out too short",
            dk.embed(&s, &v(30), &vi(2), &v(5), 2, 3, 10),
            shape,
            words(&["embed: out holds 5 elements, [2, 3] needs 6"]),
        ),
        (
            "vocab past 32 bits",
            dk.embed(&s, &v(0), &vi(0), &v(0), 0, 0, big),
            shape,
            words(&["embed: vocab = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "logits too short",
            dk.argmax(&s, &vf(11), &vi(3), 3, 4),
            shape,
            words(&["argmax: logits holds 11 elements, [3, 4] needs 12"]),
        ),
        (
            "argmax out too short",
            dk.argmax(&s, &vf(12), &vi(2), 3, 4),
            shape,
            words(&["argmax: out holds 2 elements, [3] needs 3"]),
        ),
        (
            "argmax cols past 32 bits",
            dk.argmax(&s, &vf(0), &vi(0), 0, big),
            shape,
            words(&["argmax: cols = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "repeat x too short",
            dk.repeat_rows(&s, &v(5), &v(24), 2, 4, 3),
            shape,
            words(&["repeat_rows: x holds 5 elements, [2, 3] needs 6"]),
        ),
        (
            "repeat y too short",
            dk.repeat_rows(&s, &v(6), &v(23), 2, 4, 3),
            shape,
            words(&["repeat_rows: y holds 23 elements, [2, 4, 3] needs 24"]),
        ),
        (
            "copies past 32 bits",
            dk.repeat_rows(&s, &v(0), &v(0), 0, big, 3),
            shape,
            words(&["repeat_rows: copies = 4294967296 does not fit in 32 bits"]),
        ),
        (
            "to_bf16 x too short",
            dk.to_bf16(&s, &vf(7), &v(8), 8),
            shape,
            words(&["to_bf16: x holds 7 elements, [8] needs 8"]),
        ),
        (
            "to_bf16 y too short",
            dk.to_bf16(&s, &vf(8), &v(7), 8),
            shape,
            words(&["to_bf16: y holds 7 elements, [8] needs 8"]),
        ),
    ];
    check_errors(cases);
    assert!(bits(&s.copy_to_host_sync(&b.view()).expect("read")).iter().all(|&x| x == POISON_BF16));
    assert!(s.copy_to_host_sync(&f.view()).expect("read").iter().all(|x| x.to_bits() == 0xFFFF_FFFF));
    assert!(s.copy_to_host_sync(&i.view()).expect("read").iter().all(|&x| x == POISON_I32));
}

/// Embed → repeat → rms_norm → matmul → swiglu → rope → matmul_f32 → argmax, the buffers of one
/// chain: a forward-shaped sequence of every op.
struct Chain {
    ids: Buffer<i32>,
    pos: Buffer<i32>,
    table: Buffer<bf16>,
    norm_w: Buffer<bf16>,
    up_w: Buffer<bf16>,
    head_w: Buffer<bf16>,
    h: Buffer<bf16>,
    rep: Buffer<bf16>,
    gu: Buffer<bf16>,
    act: Buffer<bf16>,
    logits: Buffer<f32>,
    out: Buffer<i32>,
}

const T: usize = 19;
const HID: usize = 48;
const FFN: usize = 40;
const VOCAB: usize = 70;

impl Chain {
    fn new(dev: &Device, rng: &mut Rng) -> Self {
        Chain {
            ids: upload(dev, "ids", &[0i32; T]),
            pos: upload(dev, "pos", &[0i32; T]),
            table: upload(dev, "table", &rng.bf16s(VOCAB * HID, 1.0)),
            norm_w: upload(dev, "norm_w", &rng.bf16s(HID, 1.0)),
            up_w: upload(dev, "up_w", &rng.bf16s(2 * FFN * HID, 0.3)),
            head_w: upload(dev, "head_w", &rng.bf16s(VOCAB * FFN, 0.3)),
            h: poisoned_bf16(dev, "h", T * HID),
            rep: poisoned_bf16(dev, "rep", T * 2 * HID),
            gu: poisoned_bf16(dev, "gu", T * 2 * FFN),
            act: poisoned_bf16(dev, "act", T * FFN),
            logits: poisoned_f32(dev, "logits", T * VOCAB),
            out: upload(dev, "out", &[POISON_I32; T]),
        }
    }

    fn run(&self, dk: &DenseKernels, s: &Stream) {
        dk.embed(s, &self.table.view(), &self.ids.view(), &self.h.view(), T, HID, VOCAB).expect("embed");
        dk.repeat_rows(s, &self.h.view(), &self.rep.view(), T, 2, HID).expect("repeat");
        dk.rms_norm(s, &self.h.view(), &self.norm_w.view(), &self.h.view(), T, HID, 1e-6).expect("norm");
        dk.matmul(s, &self.h.view(), &self.up_w.view(), &self.gu.view(), Gemm::new(T, 2 * FFN, HID)).expect("up");
        dk.swiglu(s, &self.gu.view(), &self.act.view(), T, FFN, 10.0).expect("swiglu");
        dk.rope(s, &self.act.view(), &self.pos.view(), T, 2, FFN / 2, 8, 10000.0, false).expect("rope");
        dk.matmul_f32(s, &self.act.view(), &self.head_w.view(), &self.logits.view(), Gemm::new(T, VOCAB, FFN))
            .expect("head");
        dk.argmax(s, &self.logits.view(), &self.out.view(), T, VOCAB).expect("argmax");
    }

    fn outputs(&self, s: &Stream) -> (Vec<u16>, Vec<u32>, Vec<i32>) {
        let rep = bits(&s.copy_to_host_sync(&self.rep.view()).expect("read"));
        let logits = s.copy_to_host_sync(&self.logits.view()).expect("read").iter().map(|v| v.to_bits()).collect();
        (rep, logits, s.copy_to_host_sync(&self.out.view()).expect("read"))
    }
}

fn graph_replay_with_fresh_inputs_equals_eager_bit_for_bit(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(53);
    let graph_chain = Chain::new(dev, &mut rng);
    let mut rng = Rng(53);
    let eager_chain = Chain::new(dev, &mut rng);
    s.begin_capture("dense chain").expect("begin");
    graph_chain.run(&dk, &s);
    let g = s.end_capture().expect("end");
    for step in 0..5 {
        let ids: Vec<i32> = (0..T).map(|_| rng.below(VOCAB as u64 + 4) as i32 - 2).collect();
        let pos: Vec<i32> = (0..T).map(|_| rng.below(3000) as i32 - 1).collect();
        for c in [&graph_chain, &eager_chain] {
            s.copy_from_host(&ids, &c.ids.view()).expect("ids");
            s.copy_from_host(&pos, &c.pos.view()).expect("pos");
        }
        g.replay(&s).expect("replay");
        eager_chain.run(&dk, &s);
        assert_eq!(graph_chain.outputs(&s), eager_chain.outputs(&s), "step {step}");
    }
}

/// `to_bf16` rounds to nearest even (the `half` crate's rounding, ties included) and keeps NaN
/// and infinities; nothing is written past n.
fn to_bf16_rounds_to_nearest_even(dev: &Device) {
    let dk = DenseKernels::new(dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(61);
    let mut xh: Vec<f32> = (0..1000).map(|_| rng.unit() * 100.0).collect();
    // Exact ties between two bf16 values, both parities, and the specials.
    xh.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -0.0, 1e-40]);
    let n = xh.len();
    let x = upload(dev, "x", &xh);
    let y = poisoned_bf16(dev, "y", n + 3);
    dk.to_bf16(&s, &x.view(), &y.prefix(n).expect("v"), n).expect("to_bf16");
    let got = s.copy_to_host_sync(&y.view()).expect("read");
    for (i, (g, v)) in got.iter().zip(&xh).enumerate() {
        let want = bf16::from_f32(*v);
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "element {i}: {v} → {g}, want {want}");
    }
    assert!(got[n..].iter().all(|v| v.to_bits() == POISON_BF16), "nothing written past n");
}

holdfast_hal::device_suite!(
    to_bf16_rounds_to_nearest_even,
    matmul_matches_the_f64_reference_at_odd_shapes,
    matmul_rows_are_batch_invariant_bit_for_bit,
    matmul_small_t_is_the_fma_chain_bit_for_bit,
    matmul_rows_match_across_the_small_t_and_tiled_kernels,
    tensor_core_matmul_matches_the_split_order_and_rows_are_batch_invariant,
    rms_norm_matches_the_reference_in_place_and_per_row,
    rope_matches_the_reference_and_skips_negative_positions,
    swiglu_matches_the_reference_with_and_without_the_limit,
    embed_copies_rows_and_zeroes_out_of_range_ids,
    argmax_takes_the_lowest_index_on_ties_and_nan_never_wins,
    repeat_rows_copies_every_row,
    shape_errors_are_reported_before_launch,
    graph_replay_with_fresh_inputs_equals_eager_bit_for_bit,
);

/// The CPU reference of `rms_norm` follows the device block's order, so it equals a test-side
/// model of that order (256 strided FMA partials, halving tree) bit for bit.
#[test]
fn rms_norm_on_the_cpu_follows_the_device_summation_order() {
    let dev = Device::cpu().expect("cpu");
    let dk = DenseKernels::new(&dev).expect("kernels");
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(59);
    let (rows, dim, eps) = (3usize, 1000usize, 1e-5f32);
    let (xh, wh) = (rng.bf16s(rows * dim, 2.0), rng.bf16s(dim, 1.0));
    let (x, w, y) = (upload(&dev, "x", &xh), upload(&dev, "w", &wh), poisoned_bf16(&dev, "y", rows * dim));
    dk.rms_norm(&s, &x.view(), &w.view(), &y.view(), rows, dim, eps).expect("norm");
    let got = bits(&s.copy_to_host_sync(&y.view()).expect("read"));
    let threads = holdfast_kernels::NORM_THREADS;
    for r in 0..rows {
        let xr: Vec<f32> = xh[r * dim..(r + 1) * dim].iter().map(|v| v.to_f32()).collect();
        let mut part = vec![0f32; threads];
        for (c, v) in xr.iter().enumerate() {
            part[c % threads] = v.mul_add(*v, part[c % threads]);
        }
        let mut width = threads;
        while width > 1 {
            width /= 2;
            for i in 0..width {
                part[i] += part[i + width];
            }
        }
        let inv = 1.0 / (part[0] / dim as f32 + eps).sqrt();
        let want: Vec<u16> = xr.iter().zip(&wh).map(|(v, w)| bf16::from_f32(v * inv * w.to_f32()).to_bits()).collect();
        assert_eq!(&got[r * dim..(r + 1) * dim], &want[..], "row {r}");
    }
}

#[cfg(feature = "cuda")]
#[test]
fn dense_kernels_compile_for_sm_90_with_nvrtc() {
    holdfast_hal::testing::assert_compiles_for_sm_90(holdfast_kernels::dense_source());
}

#[cfg(feature = "rocm")]
#[test]
fn dense_kernels_compile_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_kernels::dense_source());
}

/// Both warp widths compile, and the four matmul entry points (tiled and small-t) keep their
/// accumulators in registers (no local memory in their PTX) and read shared memory as 16-byte
/// vectors; the small-t ones also load w from global memory as 16-byte vectors.
#[cfg(feature = "cuda")]
#[test]
fn dense_kernels_compile_at_both_warp_widths_and_the_matmul_does_not_spill() {
    use holdfast_hal::cuda;
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    for warp in [32, 64] {
        let (cubin, ptx) = cuda::compile(holdfast_kernels::dense_source(), "sm_90", warp).expect("compiles");
        assert!(!cubin.is_empty(), "no CUBIN at warp {warp}");
        let ptx = String::from_utf8_lossy(&ptx);
        let mut names = Vec::new();
        for entry in ptx.split(".entry ").skip(1).filter(|e| e.starts_with("hf_matmul")) {
            let name = entry.split('(').next().unwrap_or("?").trim();
            assert!(!entry.contains(".local"), "{name} uses local memory at warp {warp}");
            if name.starts_with("hf_matmul_mma") {
                for op in
                    ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global", "ldmatrix"]
                {
                    assert!(entry.contains(op), "{name} lacks {op} at warp {warp}");
                }
                names.push(name.to_string());
                continue;
            }
            assert!(entry.contains("ld.shared.v4.f32"), "{name} lacks 16-byte shared loads");
            if name.starts_with("hf_matmul_small_t") {
                let vec_global = entry.lines().any(|l| l.contains("ld.global") && l.contains(".v4."));
                assert!(vec_global, "{name} lacks 16-byte global loads of w at warp {warp}");
            }
            names.push(name.to_string());
        }
        names.sort();
        let want = [
            "hf_matmul_bf16",
            "hf_matmul_f32",
            "hf_matmul_mma16_bf16",
            "hf_matmul_mma16_f32",
            "hf_matmul_mma64_bf16",
            "hf_matmul_mma64_f32",
            "hf_matmul_mma_tiled_bf16",
            "hf_matmul_mma_tiled_f32",
            "hf_matmul_small_t_bf16",
            "hf_matmul_small_t_f32",
        ];
        assert_eq!(names, want, "matmul entries at warp {warp}");
    }
}

/// The launch shape follows t alone: the small-t kernel up to 8 rows, the tiled one above.
#[test]
fn the_matmul_launch_shape_switches_kernels_at_the_threshold() {
    let small = Gemm { t: MATMUL_SMALL_T_MAX, n: 300, k: 64, groups: 2 }.launch_config();
    assert_eq!((small.grid, small.block), ((3, 1, 2), (128, 1, 1)));
    let one = Gemm::new(1, 129_280, 4096).launch_config();
    assert_eq!((one.grid, one.block), ((1010, 1, 1), (128, 1, 1)));
    let tiled = Gemm { t: MATMUL_SMALL_T_MAX + 1, n: 300, k: 64, groups: 2 }.launch_config();
    assert_eq!((tiled.grid, tiled.block), ((3, 1, 2), (256, 1, 1)));
    let big = Gemm::new(37, 129, 8).launch_config();
    assert_eq!((big.grid, big.block), ((2, 2, 1), (256, 1, 1)));
}

/// The tensor cores' k ranges follow k alone; their grid follows the shape (16-row blocks up to
/// t = 16, 64-row blocks above; `16 · 8 / splits` columns per block).
#[test]
fn the_tensor_core_split_order_and_launch_shape_follow_the_shape() {
    assert_eq!(mma_splits(0), (1, 0));
    assert_eq!(mma_splits(64), (1, 64));
    assert_eq!(mma_splits(1000), (1, 1024));
    assert_eq!(mma_splits(1024), (2, 512));
    assert_eq!(mma_splits(1048), (2, 544));
    assert_eq!(mma_splits(2048), (4, 512));
    assert_eq!(mma_splits(4096), (8, 512));
    assert_eq!(mma_splits(8192), (8, 1024));
    let decode = Gemm::new(1, 1024, 4096).mma_launch_config();
    assert_eq!((decode.grid, decode.block, decode.shared_mem_bytes), ((64, 1, 1), (256, 1, 1), 81_920));
    let edge = Gemm::new(MATMUL_MMA_SMALL_T_MAX, 32_768, 1024).mma_launch_config();
    assert_eq!(edge.grid, (512, 1, 1));
    let rows64 = Gemm { t: 100, n: 1024, k: 4096, groups: 1 };
    assert_eq!(rows64.mma_kernel(), MmaKernel::Rows64);
    let c = rows64.mma_launch_config();
    assert_eq!((c.grid, c.shared_mem_bytes), ((64, 2, 1), 153_600));
    assert!(c.shared_mem_bytes <= holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK);
    let prefill = Gemm { t: 300, n: 1024, k: 4096, groups: 8 };
    assert_eq!(prefill.mma_kernel(), MmaKernel::Tiled);
    let c = prefill.mma_launch_config();
    assert_eq!((c.grid, c.block, c.shared_mem_bytes), ((8, 5, 8), (256, 1, 1), 46_080));
    assert_eq!(Gemm::new(MATMUL_MMA_SMALL_T_MAX, 1 << 20, 64).mma_kernel(), MmaKernel::Rows16);
    assert_eq!(Gemm::new(64, 1 << 20, 64).mma_kernel(), MmaKernel::Rows64, "t < 65 never tiles");
    assert_eq!(Gemm::new(65, 128 * 64, 64).mma_kernel(), MmaKernel::Tiled);
    assert_eq!(Gemm::new(65, 128 * 63, 64).mma_kernel(), MmaKernel::Rows64, "too few tiled blocks");
}
