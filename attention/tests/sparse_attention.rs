//! The KV insert and ragged sparse attention kernels against f64 definitions on fresh random
//! inputs with poisoned outputs, batch invariance, graph replay over a growing sequence, and
//! construction errors. Runs on `cpu` always and on `cuda:0` when present.

mod common;

use common::{check_errors, words, ErrorCase};
use holdfast_attention::{
    AttentionError, AttentionKernel, RaggedKv, SparseAttention, MAX_CHUNKS_PER_LANE, TENSOR_CORE_HEAD_DIMS,
    WG_DEFAULT_SPLIT, WG_HEAD_DIM, WG_SPLITS,
};
use holdfast_hal::{bf16, Buffer, Device, Stream};

/// A kernel choice and, for the warpgroup kernel, its row split (`None`: the constructor's).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pick(AttentionKernel, Option<usize>);

impl From<AttentionKernel> for Pick {
    fn from(k: AttentionKernel) -> Self {
        Pick(k, None)
    }
}

fn build(dev: &Device, heads: usize, d: usize, pick: Pick) -> SparseAttention {
    let k = SparseAttention::with_kernel(dev, heads, d, pick.0).expect("kernel");
    match pick.1 {
        Some(n) => k.with_warpgroup_split(dev, n).expect("split"),
        None => k,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }
}

fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// The f64 definition of one row: softmax over the valid keys and the sink, values = keys.
fn row_f64(q: &[bf16], keys: &[&[bf16]], sink: &[f32], heads: usize, d: usize, scale: f64) -> Vec<f64> {
    let mut out = vec![0f64; heads * d];
    for h in 0..heads {
        let qh = &q[h * d..(h + 1) * d];
        let logits: Vec<f64> = keys
            .iter()
            .map(|k| {
                qh.iter().zip(k.iter()).map(|(a, b)| f64::from(a.to_f32()) * f64::from(b.to_f32())).sum::<f64>() * scale
            })
            .collect();
        let m = logits.iter().copied().fold(f64::from(sink[h]), f64::max);
        let den: f64 = logits.iter().map(|s| (s - m).exp()).sum::<f64>() + (f64::from(sink[h]) - m).exp();
        for (s, k) in logits.iter().zip(keys) {
            let p = (s - m).exp() / den;
            for i in 0..d {
                out[h * d + i] += p * f64::from(k[i].to_f32());
            }
        }
    }
    out
}

struct Case {
    rows: usize,
    heads: usize,
    d: usize,
    q: Vec<bf16>,
    main: Vec<bf16>,
    extra: Vec<bf16>,
    main_lists: Vec<Vec<i32>>,
    extra_lists: Vec<Vec<i32>>,
    sink: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn case(
    rng: &mut Rng,
    rows: usize,
    heads: usize,
    d: usize,
    s_main: usize,
    s_extra: usize,
    max_main: usize,
    max_extra: usize,
) -> Case {
    let list = |rng: &mut Rng, max: usize, slots: usize| -> Vec<i32> {
        (0..rng.below(max + 1))
            .map(|_| match rng.below(10) {
                0 => -1,
                1 => (slots + rng.below(5)) as i32, // out of range: skipped
                _ => rng.below(slots) as i32,
            })
            .collect()
    };
    Case {
        rows,
        heads,
        d,
        q: bf(&(0..rows * heads * d).map(|_| rng.unit() * 2.0).collect::<Vec<_>>()),
        main: bf(&(0..s_main * d).map(|_| rng.unit()).collect::<Vec<_>>()),
        extra: bf(&(0..s_extra * d).map(|_| rng.unit()).collect::<Vec<_>>()),
        main_lists: (0..rows).map(|_| list(rng, max_main, s_main)).collect(),
        extra_lists: (0..rows).map(|_| list(rng, max_extra, s_extra)).collect(),
        sink: (0..heads).map(|_| rng.unit() * 3.0).collect(),
    }
}

fn ragged(lists: &[Vec<i32>]) -> (Vec<i32>, Vec<i32>) {
    let mut indptr = vec![0i32];
    let mut flat = Vec::new();
    for l in lists {
        flat.extend_from_slice(l);
        indptr.push(flat.len() as i32);
    }
    flat.push(-1); // never zero-length
    (flat, indptr)
}

struct Dev {
    q: Buffer<bf16>,
    main: Buffer<bf16>,
    extra: Buffer<bf16>,
    mi: Buffer<i32>,
    mp: Buffer<i32>,
    ei: Buffer<i32>,
    ep: Buffer<i32>,
    sink: Buffer<f32>,
    out: Buffer<bf16>,
}

fn upload(dev: &Device, c: &Case) -> Dev {
    let (mi, mp) = ragged(&c.main_lists);
    let (ei, ep) = ragged(&c.extra_lists);
    let up = |l: &str, v: &[bf16]| dev.alloc_from_slice(l, v, true).expect("upload");
    let upi = |l: &str, v: &[i32]| dev.alloc_from_slice(l, v, true).expect("upload");
    Dev {
        q: up("q", &c.q),
        main: up("swa_cache", &c.main),
        extra: up("compressed_cache", &c.extra),
        mi: upi("main_idx", &mi),
        mp: upi("main_indptr", &mp),
        ei: upi("extra_idx", &ei),
        ep: upi("extra_indptr", &ep),
        sink: dev.alloc_from_slice("sink", &c.sink, true).expect("sink"),
        out: up("out", &vec![bf16::NAN; (c.rows * c.heads * c.d).max(1)]),
    }
}

fn run(k: &SparseAttention, s: &Stream, b: &Dev, rows: usize, cells: usize, scale: f32) {
    let (mc, mi, mp) = (b.main.view(), b.mi.view(), b.mp.prefix(rows + 1).expect("p"));
    let (ec, ei, ep) = (b.extra.view(), b.ei.view(), b.ep.prefix(rows + 1).expect("p"));
    let main = RaggedKv { cache: &mc, indices: &mi, indptr: &mp };
    let extra = RaggedKv { cache: &ec, indices: &ei, indptr: &ep };
    k.attend(
        s,
        &b.q.prefix(cells.max(1)).expect("q"),
        &main,
        Some(&extra),
        &b.sink.view(),
        &b.out.prefix(cells.max(1)).expect("o"),
        scale,
    )
    .expect("attend");
}

/// A case of the f64 comparison: (rows, heads, head_dim, main slots, extra slots, longest main
/// list, longest extra list).
type CaseSpec = (usize, usize, usize, usize, usize, usize, usize);

/// One entry to many 32-entry tiles, head counts that leave a partial head group, every
/// tensor-core head_dim and one the portable kernel alone serves (192).
const CASES: [CaseSpec; 10] = [
    (1, 1, 64, 40, 10, 16, 8),
    (7, 13, 64, 300, 64, 128, 40),
    (16, 8, 512, 256, 64, 128, 64),
    (3, 64, 512, 128, 32, 64, 32),
    (5, 64, 512, 700, 400, 300, 200),
    (4, 40, 128, 200, 100, 90, 70),
    (6, 128, 256, 150, 90, 70, 33),
    (3, 17, 192, 100, 50, 40, 40),
    (2, 64, 512, 64, 64, 31, 1),
    (3, 128, 512, 400, 300, 200, 150),
];

fn attention_matches_its_f64_definition(dev: &Device) {
    matches_f64_with(dev, AttentionKernel::Auto.into());
}

/// Lists of up to 33 tiles of 64 entries at head_dim 512, so that the warpgroup kernel's three K
/// buffers are each reused many times over (its hand-offs cycle through their phases).
const LONG_CASES: [CaseSpec; 2] = [(4, 64, 512, 2400, 1500, 1200, 900), (2, 128, 512, 1800, 900, 1100, 500)];

fn matches_f64_with(dev: &Device, choice: Pick) {
    matches_f64_in(dev, choice, &CASES);
}

fn matches_f64_in(dev: &Device, choice: Pick, cases: &[CaseSpec]) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(0x5EED);
    for &(rows, heads, d, s_main, s_extra, max_main, max_extra) in cases {
        if (choice.0 == AttentionKernel::Warpgroup && d != WG_HEAD_DIM)
            || (choice.0 == AttentionKernel::TensorCore && !TENSOR_CORE_HEAD_DIMS.contains(&d))
        {
            continue;
        }
        let mut c = case(&mut rng, rows, heads, d, s_main, s_extra, max_main, max_extra);
        if rows > 2 {
            // A row whose every entry is skipped: the sink-only result.
            c.main_lists[1] = vec![-1, s_main as i32, -7];
            c.extra_lists[1] = vec![s_extra as i32 + 3];
        }
        let b = upload(dev, &c);
        let k = build(dev, heads, d, choice);
        let scale = 1.0 / (d as f32).sqrt();
        run(&k, &s, &b, rows, rows * heads * d, scale);
        let got = s.copy_to_host_sync(&b.out.view()).expect("read");
        let (mut num, mut den) = (0f64, 0f64);
        for r in 0..rows {
            let keys: Vec<&[bf16]> = c.main_lists[r]
                .iter()
                .filter(|&&x| x >= 0 && (x as usize) < s_main)
                .map(|&x| &c.main[x as usize * d..(x as usize + 1) * d])
                .chain(
                    c.extra_lists[r]
                        .iter()
                        .filter(|&&x| x >= 0 && (x as usize) < s_extra)
                        .map(|&x| &c.extra[x as usize * d..(x as usize + 1) * d]),
                )
                .collect();
            let want = row_f64(&c.q[r * heads * d..(r + 1) * heads * d], &keys, &c.sink, heads, d, f64::from(scale));
            let g = &got[r * heads * d..(r + 1) * heads * d];
            assert!(g.iter().all(|v| !v.is_nan()), "row {r}: NaN (unwritten or invalid)");
            if keys.is_empty() {
                assert!(
                    g.iter().all(|v| v.to_f32() == 0.0),
                    "row {r}: no entries must give the sink-only result, zeros"
                );
            }
            for (a, w) in g.iter().zip(&want) {
                num += (f64::from(a.to_f32()) - w).powi(2);
                den += w * w;
            }
        }
        let rel = (num / den.max(1e-30)).sqrt();
        assert!(rel <= 1e-2, "{choice:?} rows {rows} heads {heads} d {d}: relative L2 {rel}");
    }
}

/// On a GPU the portable kernel and the tensor-core kernel meet the same bound; `new` picks tensor
/// cores wherever the device and head_dim allow them (the warpgroup kernel, at its default split,
/// for 64 heads of 512 on a device with warpgroup MMA); an explicit tensor-core choice where they
/// do not is a clear error.
fn the_portable_kernel_matches_too_and_tensor_cores_are_picked_where_they_fit(dev: &Device) {
    matches_f64_with(dev, AttentionKernel::Portable.into());
    for d in [64usize, 128, 192, 256, 512] {
        let k = SparseAttention::new(dev, 64, d).expect("kernel");
        let want = dev.info().has_bf16_mma() && TENSOR_CORE_HEAD_DIMS.contains(&d);
        assert_eq!(k.uses_tensor_cores(), want, "head_dim {d} on {}", dev.info().arch);
        let wg = dev.info().has_wgmma() && d == WG_HEAD_DIM;
        assert_eq!(k.warpgroup_split(), if wg { WG_DEFAULT_SPLIT } else { 1 }, "head_dim {d}");
        assert!(!SparseAttention::with_kernel(dev, 64, d, AttentionKernel::Portable).expect("k").uses_tensor_cores());
        match SparseAttention::with_kernel(dev, 64, d, AttentionKernel::TensorCore) {
            Ok(k) => assert!(want && k.uses_tensor_cores() && k.warpgroup_split() == 1, "head_dim {d}"),
            Err(e) => assert!(!want && e.to_string().contains("tensor-core kernel needs"), "head_dim {d}: {e}"),
        }
    }
    // The throughput split: 1 from the fewest rows whose blocks (one per 64-head group) fill
    // three quarters of the device, the current split below that and for kernels without splits.
    let units = dev.info().compute_units.max(1) as usize;
    for heads in [64usize, 128] {
        let k = SparseAttention::new(dev, heads, WG_HEAD_DIM).expect("kernel");
        let fill = (3 * units).div_ceil(4 * heads.div_ceil(64));
        let below = fill.saturating_sub(1);
        assert_eq!(k.throughput_split(below), k.warpgroup_split(), "{heads} heads, {below} rows");
        let want = if k.uses_warpgroup() { 1 } else { k.warpgroup_split() };
        assert_eq!(k.throughput_split(fill), want, "{heads} heads, {fill} rows");
        assert_eq!(k.throughput_split(usize::MAX), want, "{heads} heads, every row");
    }
    if dev.info().has_bf16_mma() {
        matches_f64_with(dev, AttentionKernel::TensorCore.into());
        row_alone_vs_batch(dev, 64, 512, 160, 96, AttentionKernel::TensorCore.into());
    }
    // A row split is the warpgroup kernel's alone.
    let portable = SparseAttention::with_kernel(dev, 64, 512, AttentionKernel::Portable).expect("portable");
    let err = portable.with_warpgroup_split(dev, 2).expect_err("not the warpgroup kernel");
    assert!(err.to_string().contains("needs the warpgroup kernel"), "{err}");
}

/// The warpgroup kernel meets the same bound at head_dim 512 (8 to 128 heads, lists of one to
/// many 64-entry tiles, a row whose entries are all skipped), gives a row the same bits alone and
/// in a padded batch, and replays from a graph like eager. Elsewhere (no warpgroup MMA, other
/// head sizes) construction is a clear error.
fn the_warpgroup_kernel_matches_f64_and_is_batch_invariant_where_the_device_has_it(dev: &Device) {
    let err = SparseAttention::with_kernel(dev, 64, 256, AttentionKernel::Warpgroup).expect_err("head_dim 256");
    assert!(err.to_string().contains("warpgroup kernel needs"), "{err}");
    if !dev.info().has_wgmma() {
        let err = SparseAttention::with_kernel(dev, 64, WG_HEAD_DIM, AttentionKernel::Warpgroup).expect_err("no wgmma");
        assert!(err.to_string().contains(&dev.info().arch), "{err}");
        eprintln!("skipped: {} ({}) has no warpgroup MMA; the refusal was checked", dev.info().name, dev.info().arch);
        return;
    }
    let wg = SparseAttention::with_kernel(dev, 64, WG_HEAD_DIM, AttentionKernel::Warpgroup).expect("wg");
    assert!(wg.uses_tensor_cores());
    assert_eq!(wg.warpgroup_split(), WG_DEFAULT_SPLIT);
    let err = wg.clone().with_warpgroup_split(dev, 3).expect_err("split 3");
    assert!(err.to_string().contains("supported"), "{err}");
    // It reads q and writes out in 16-byte pieces: a view of either starting off that grid (here
    // an even element, which the other kernels accept) is refused before anything runs.
    {
        let s = dev.create_stream().expect("stream");
        let c = case(&mut Rng(3), 2, 64, WG_HEAD_DIM, 64, 32, 16, 8);
        let b = upload(dev, &c);
        let cells = 2 * 64 * WG_HEAD_DIM;
        let (mc, mi, mp) = (b.main.view(), b.mi.view(), b.mp.view());
        let (ec, ei, ep) = (b.extra.view(), b.ei.view(), b.ep.view());
        let main = RaggedKv { cache: &mc, indices: &mi, indptr: &mp };
        let extra = RaggedKv { cache: &ec, indices: &ei, indptr: &ep };
        let big = dev.alloc_zeroed::<bf16>("out+2", cells + 2, true).expect("out");
        let (q, out) = (b.q.view(), big.slice(2, cells).expect("offset view"));
        let err = wg.attend(&s, &q, &main, Some(&extra), &b.sink.view(), &out, 0.05).expect_err("out at element 2");
        assert!(err.to_string().contains("16-byte pieces") && err.to_string().contains("out at 2"), "{err}");
    }
    // Every split: the bound (lists of one to many tiles, so some blocks of a cluster have none),
    // batch invariance, and graph replay.
    for n in WG_SPLITS {
        let pick = Pick(AttentionKernel::Warpgroup, Some(n));
        matches_f64_with(dev, pick);
        matches_f64_in(dev, pick, &LONG_CASES);
        row_alone_vs_batch(dev, 64, WG_HEAD_DIM, 160, 96, pick);
        replay_like_eager(dev, 64, WG_HEAD_DIM, 200, pick);
    }
    // 128 heads (two head groups per row, each its own cluster).
    row_alone_vs_batch(dev, 128, WG_HEAD_DIM, 200, 300, AttentionKernel::Warpgroup.into());
}

fn kv_insert_matches_its_definition(dev: &Device) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(77);
    let (t, d, slots) = (37usize, 64usize, 100usize);
    let k = SparseAttention::new(dev, 1, d).expect("kernel");
    let kv = bf(&(0..t * d).map(|_| rng.unit()).collect::<Vec<_>>());
    let mut perm: Vec<i32> = (0..slots as i32).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i + 1));
    }
    let slot_map: Vec<i32> = (0..t)
        .map(|i| {
            if i % 5 == 4 {
                -1
            } else if i % 11 == 10 {
                slots as i32 + 3
            } else {
                perm[i]
            }
        })
        .collect();
    let kvb = dev.alloc_from_slice("kv", &kv, true).expect("kv");
    let sb = dev.alloc_from_slice("slot_mapping", &slot_map, true).expect("slots");
    let cache = dev.alloc_from_slice("cache", &vec![bf16::NAN; slots * d], true).expect("cache");
    k.insert(&s, &kvb.view(), &sb.view(), &cache.view()).expect("insert");
    let got = s.copy_to_host_sync(&cache.view()).expect("read");
    let mut want = vec![bf16::NAN; slots * d];
    for (i, &sl) in slot_map.iter().enumerate() {
        if sl >= 0 && (sl as usize) < slots {
            want[sl as usize * d..(sl as usize + 1) * d].copy_from_slice(&kv[i * d..(i + 1) * d]);
        }
    }
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "insert writes exactly the valid slots");
}

fn a_row_is_the_same_alone_and_in_a_padded_batch_of_256(dev: &Device) {
    // 16 heads × 128 (short lists) and the model's 64 × 512 (several tiles per row): on a GPU the
    // lone row runs 16 heads per block (16 heads) or 32 heads with three staged tiles (64 heads),
    // and the batch 32 heads with two, so this also pins the head grouping and the pipeline depth.
    row_alone_vs_batch(dev, 16, 128, 128, 32, AttentionKernel::Auto.into());
    row_alone_vs_batch(dev, 64, 512, 160, 96, AttentionKernel::Auto.into());
}

fn row_alone_vs_batch(dev: &Device, heads: usize, d: usize, max_main: usize, max_extra: usize, kernel: Pick) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(99);
    let k = build(dev, heads, d, kernel);
    let big = case(&mut rng, 256, heads, d, 512, 64, max_main, max_extra);
    let mut padded = case(&mut rng, 0, heads, d, 0, 0, 0, 0);
    padded.rows = 260;
    padded.q = big.q.clone();
    padded.q.extend(std::iter::repeat_n(bf16::ZERO, 4 * heads * d));
    padded.main = big.main.clone();
    padded.extra = big.extra.clone();
    padded.main_lists = big.main_lists.clone();
    padded.extra_lists = big.extra_lists.clone();
    padded.main_lists.extend(vec![Vec::new(); 4]);
    padded.extra_lists.extend(vec![Vec::new(); 4]);
    padded.sink = big.sink.clone();
    let row = 137;
    let mut alone = case(&mut rng, 0, heads, d, 0, 0, 0, 0);
    alone.rows = 1;
    alone.q = big.q[row * heads * d..(row + 1) * heads * d].to_vec();
    alone.main = big.main.clone();
    alone.extra = big.extra.clone();
    alone.main_lists = vec![big.main_lists[row].clone()];
    alone.extra_lists = vec![big.extra_lists[row].clone()];
    alone.sink = big.sink.clone();
    let scale = 0.1;
    let mut outs = Vec::new();
    for c in [&big, &padded, &alone] {
        let b = upload(dev, c);
        run(&k, &s, &b, c.rows, c.rows * heads * d, scale);
        outs.push(s.copy_to_host_sync(&b.out.view()).expect("read"));
    }
    let cells = heads * d;
    let pick = |o: &Vec<bf16>, r: usize| o[r * cells..(r + 1) * cells].iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(pick(&outs[0], row), pick(&outs[2], 0), "{heads}x{d}: alone vs in a batch of 256");
    assert_eq!(pick(&outs[0], row), pick(&outs[1], row), "{heads}x{d}: unpadded vs padded batch");
    assert!(outs[1][256 * cells..].iter().all(|v| v.to_f32() == 0.0), "padding rows give zeros");
}

/// q, kv, slot, cache, indices, indptr, sink, out.
type StepBuffers =
    (Buffer<bf16>, Buffer<bf16>, Buffer<i32>, Buffer<bf16>, Buffer<i32>, Buffer<i32>, Buffer<f32>, Buffer<bf16>);

fn a_captured_decode_step_replays_a_growing_sequence_like_eager(dev: &Device) {
    replay_like_eager(dev, 8, 64, 16, AttentionKernel::Auto.into());
}

/// A decode step (insert, then attend over a sliding window of `window` slots) captured once and
/// replayed for 100 steps of a growing sequence equals eager bit for bit.
fn replay_like_eager(dev: &Device, heads: usize, d: usize, window: usize, kernel: Pick) {
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng(4242);
    let slots = 2 * window.max(64);
    let k = build(dev, heads, d, kernel);
    let mk = |tag: &str| {
        (
            dev.alloc_zeroed::<bf16>(&format!("{tag}.q"), heads * d, true).expect("q"),
            dev.alloc_zeroed::<bf16>(&format!("{tag}.kv"), d, true).expect("kv"),
            dev.alloc_zeroed::<i32>(&format!("{tag}.slot"), 1, true).expect("slot"),
            dev.alloc_zeroed::<bf16>(&format!("{tag}.cache"), slots * d, true).expect("cache"),
            dev.alloc_zeroed::<i32>(&format!("{tag}.idx"), window, true).expect("idx"),
            dev.alloc_zeroed::<i32>(&format!("{tag}.indptr"), 2, true).expect("indptr"),
            dev.alloc_from_slice(&format!("{tag}.sink"), &vec![0.5f32; heads], true).expect("sink"),
            dev.alloc_zeroed::<bf16>(&format!("{tag}.out"), heads * d, true).expect("out"),
        )
    };
    let g = mk("graph");
    let e = mk("eager");
    let step = |b: &StepBuffers| {
        k.insert(&s, &b.1.view(), &b.2.view(), &b.3.view()).expect("insert");
        let (c, i, p) = (b.3.view(), b.4.view(), b.5.view());
        k.attend(
            &s,
            &b.0.view(),
            &RaggedKv { cache: &c, indices: &i, indptr: &p },
            None,
            &b.6.view(),
            &b.7.view(),
            0.125,
        )
        .expect("attend");
    };
    s.begin_capture("decode_step").expect("begin");
    step(&g);
    let graph = s.end_capture().expect("end");
    for pos in 0..100usize {
        let q = bf(&(0..heads * d).map(|_| rng.unit()).collect::<Vec<_>>());
        let kv = bf(&(0..d).map(|_| rng.unit()).collect::<Vec<_>>());
        let start = pos.saturating_sub(window - 1);
        let idx: Vec<i32> =
            (0..window).map(|j| if start + j <= pos { ((start + j) % slots) as i32 } else { -1 }).collect();
        let len = (pos + 1 - start) as i32;
        for b in [&g, &e] {
            s.copy_from_host(&q, &b.0.view()).expect("q");
            s.copy_from_host(&kv, &b.1.view()).expect("kv");
            s.copy_from_host(&[(pos % slots) as i32], &b.2.view()).expect("slot");
            s.copy_from_host(&idx, &b.4.view()).expect("idx");
            s.copy_from_host(&[0, len], &b.5.view()).expect("indptr");
        }
        graph.replay(&s).expect("replay");
        step(&e);
        let (a, b) = (s.copy_to_host_sync(&g.7.view()).expect("g"), s.copy_to_host_sync(&e.7.view()).expect("e"));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "step {pos}: replay differs from eager");
    }
}

fn unsupported_shapes_are_errors_at_construction(dev: &Device) {
    for (heads, d) in [(0usize, 64usize), (8, 48), (8, 0), (8, 1024)] {
        let err = SparseAttention::new(dev, heads, d).expect_err("unsupported");
        assert!(err.to_string().contains("SparseAttention::new"), "{err}");
    }
}

/// Every rejected shape at construction and every view `insert` and `attend` refuse: a `Shape`
/// error of the operation, whose message names the argument or view and what it must hold.
fn every_rejected_shape_or_view_names_it(dev: &Device) {
    let warp = dev.info().warp_size.max(32) as usize;
    let top = MAX_CHUNKS_PER_LANE as usize * warp;
    let new: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "SparseAttention::new", .. });
    let insert: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "kv_insert", .. });
    let attend: fn(&AttentionError) -> bool = |e| matches!(e, AttentionError::Shape { op: "sparse_attention", .. });
    let mut cases: Vec<ErrorCase> = vec![(
        "no heads",
        SparseAttention::new(dev, 0, 64).map(|_| ()),
        new,
        words(&["heads must lie in [1, 4096], got 0"]),
    )];
    cases.push((
        "too many heads",
        SparseAttention::new(dev, usize::MAX, 64).map(|_| ()),
        new,
        vec![format!("heads must lie in [1, 4096], got {}", usize::MAX)],
    ));
    for d in [0, warp + warp / 2, top + warp] {
        cases.push((
            "unsupported head_dim",
            SparseAttention::new(dev, 2, d).map(|_| ()),
            new,
            vec![format!("head_dim {d} is not supported: it must be a positive multiple of {warp} up to {top}")],
        ));
    }
    let (h, d) = (2usize, 64usize);
    let k = SparseAttention::with_kernel(dev, h, d, AttentionKernel::Portable).expect("kernel");
    let s = dev.create_stream().expect("stream");
    let bf = |n| dev.alloc_zeroed::<bf16>("t.bf16", n, true).expect("bf16");
    let int = |v: &[i32]| {
        let b = dev.alloc_zeroed::<i32>("t.i32", v.len(), true).expect("i32");
        s.copy_from_host(v, &b.view()).expect("upload");
        b
    };
    let (cache, odd_cache, q, out, sink) = (
        bf(4 * d),
        bf(4 * d + 1),
        bf(2 * h * d),
        bf(2 * h * d),
        dev.alloc_zeroed::<f32>("t.sink", h, true).expect("sink"),
    );
    let (idx, indptr, short_indptr, empty) = (int(&[0, 1, 2]), int(&[0, 1, 3]), int(&[0]), int(&[0]));
    let (slots, kv) = (int(&[0, 1, 2]), bf(3 * d - 1));
    cases.push((
        "short kv",
        k.insert(&s, &kv.view(), &slots.view(), &cache.view()),
        insert,
        vec![format!("kv holds {} elements, 3 rows × {d} need {}", 3 * d - 1, 3 * d)],
    ));
    cases.push((
        "cache not whole rows",
        k.insert(&s, &bf(3 * d).view(), &slots.view(), &odd_cache.view()),
        insert,
        vec![format!("cache length {} is not a multiple of head_dim {d}", 4 * d + 1)],
    ));
    let (cv, ocv, iv, pv, spv) = (cache.view(), odd_cache.view(), idx.view(), indptr.view(), short_indptr.view());
    let main = RaggedKv { cache: &cv, indices: &iv, indptr: &pv };
    let odd_main = RaggedKv { cache: &ocv, indices: &iv, indptr: &pv };
    let short = RaggedKv { cache: &cv, indices: &iv, indptr: &spv };
    let empty_indptr = empty.prefix(0).expect("empty view");
    let no_rows = RaggedKv { cache: &cv, indices: &iv, indptr: &empty_indptr };
    let (qv, ov, sv) = (q.view(), out.view(), sink.view());
    let short_q = q.prefix(2 * h * d - 1).expect("q");
    let short_out = out.prefix(2 * h * d - 2).expect("out");
    let short_sink = sink.prefix(h - 1).expect("sink");
    let cells = 2 * h * d;
    let run = |q: &holdfast_hal::View<bf16>, main: &RaggedKv<'_>, extra: Option<&RaggedKv<'_>>, sink, out| {
        k.attend(&s, q, main, extra, sink, out, 0.1)
    };
    cases.push(("no indptr", run(&qv, &no_rows, None, &sv, &ov), attend, words(&["main.indptr is empty"])));
    cases.push((
        "short q",
        run(&short_q, &main, None, &sv, &ov),
        attend,
        vec![format!("q/out hold {}/{cells} elements, 2 rows × {h} heads × {d} need {cells}", cells - 1)],
    ));
    cases.push((
        "short out",
        run(&qv, &main, None, &sv, &short_out),
        attend,
        vec![format!("q/out hold {cells}/{} elements, 2 rows × {h} heads × {d} need {cells}", cells - 2)],
    ));
    cases.push((
        "short sink",
        run(&qv, &main, None, &short_sink, &ov),
        attend,
        vec![format!("sink holds {} elements, {h} heads need one each", h - 1)],
    ));
    cases.push((
        "main cache not whole rows",
        run(&qv, &odd_main, None, &sv, &ov),
        attend,
        vec![format!("main cache length {} is not a multiple of head_dim {d}", 4 * d + 1)],
    ));
    cases.push((
        "extra cache not whole rows",
        run(&qv, &main, Some(&odd_main), &sv, &ov),
        attend,
        vec![format!("extra cache length {} is not a multiple of head_dim {d}", 4 * d + 1)],
    ));
    cases.push((
        "extra indptr short of the rows",
        run(&qv, &main, Some(&short), &sv, &ov),
        attend,
        words(&["extra.indptr holds 1 elements, 2 rows need 3"]),
    ));
    check_errors(cases);
}

holdfast_hal::device_suite!(
    attention_matches_its_f64_definition,
    the_portable_kernel_matches_too_and_tensor_cores_are_picked_where_they_fit,
    kv_insert_matches_its_definition,
    a_row_is_the_same_alone_and_in_a_padded_batch_of_256,
    a_captured_decode_step_replays_a_growing_sequence_like_eager,
    unsupported_shapes_are_errors_at_construction,
    every_rejected_shape_or_view_names_it,
    the_warpgroup_kernel_matches_f64_and_is_batch_invariant_where_the_device_has_it,
);

#[cfg(feature = "cuda")]
#[test]
fn sparse_attention_compiles_for_sm_90_with_nvrtc() {
    holdfast_hal::testing::assert_compiles_for_sm_90(holdfast_attention::sparse_attention_source());
}

/// Every launcher of this crate launches dependent (`Stream::launch_dependent`), which needs every
/// entry of its four kernel sources to wait for the kernel before it.
#[cfg(feature = "cuda")]
#[test]
fn every_attention_kernel_waits_for_the_kernel_before_it() {
    use holdfast_hal::testing::assert_entries_wait_for_prior;
    assert_entries_wait_for_prior(holdfast_attention::sparse_attention_source());
    assert_entries_wait_for_prior(holdfast_attention::source::source());
    assert_entries_wait_for_prior(holdfast_attention::compressor_source());
    assert_entries_wait_for_prior(holdfast_attention::indexer_source());
}

/// No attention or metadata kernel uses local memory on sm_90a (register spills or local arrays),
/// the warpgroup kernel at 254 registers included; the compressor's pooling has the frame of
/// `sinf` / `cosf`'s reduction of large arguments (its RoPE).
#[cfg(feature = "cuda")]
#[test]
fn no_attention_kernel_spills_to_local_memory() {
    use holdfast_hal::testing::assert_sm90a_frames_within;
    assert_sm90a_frames_within(holdfast_attention::sparse_attention_source(), &[]);
    assert_sm90a_frames_within(holdfast_attention::source::source(), &[]);
    assert_sm90a_frames_within(holdfast_attention::compressor_source(), &[("hf_dsv4_compressor_pool", 32)]);
    assert_sm90a_frames_within(holdfast_attention::indexer_source(), &[]);
}

/// The warpgroup kernel's MMAs run as written: ptxas neither serialises them nor inserts waits
/// (a register of an MMA in flight touched by another instruction would do either).
#[cfg(feature = "cuda")]
#[test]
fn warpgroup_mmas_are_not_serialised() {
    holdfast_hal::testing::assert_sm90a_wgmma_not_serialised(holdfast_attention::sparse_attention_source());
}

#[cfg(feature = "rocm")]
#[test]
fn sparse_attention_compiles_for_gfx90a_with_hiprtc() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_attention::sparse_attention_source());
}

/// The tensor-core entries compile for sm_90 to `mma.sync` with `cp.async` staging and keep
/// everything in registers (no local memory in their PTX).
#[cfg(feature = "cuda")]
#[test]
fn the_tensor_core_entries_use_mma_and_do_not_spill() {
    use holdfast_hal::cuda;
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    let (cubin, ptx) = cuda::compile(holdfast_attention::sparse_attention_source(), "sm_90", 32).expect("compiles");
    assert!(!cubin.is_empty());
    let ptx = String::from_utf8_lossy(&ptx);
    let entries: Vec<&str> = ptx.split(".entry ").skip(1).filter(|e| e.starts_with("hf_sparse_attn_mma")).collect();
    assert_eq!(entries.len(), 3 * TENSOR_CORE_HEAD_DIMS.len(), "one entry per (grouping, stages) and head_dim");
    for e in entries {
        let name = e.split('(').next().unwrap_or("?").trim();
        assert!(e.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"), "{name} lacks mma.sync");
        assert!(e.contains("cp.async.cg.shared.global"), "{name} lacks cp.async staging");
        assert!(e.contains("ldmatrix.sync.aligned.m8n8.x4.trans"), "{name} lacks the transposed V loads");
        assert!(!e.contains(".local"), "{name} uses local memory");
    }
}

/// The warpgroup entry compiles for sm_90a to warpgroup MMA (Q·Kᵀ with K-major B, P·V with
/// N-major B) with cp.async staging and no local memory in its PTX; for plain sm_90 it is an empty
/// stub the launcher never picks.
#[cfg(feature = "cuda")]
#[test]
fn the_warpgroup_entry_uses_wgmma_on_sm_90a() {
    use holdfast_hal::cuda;
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    let entry = |arch: &str| {
        let (_, ptx) = cuda::compile(holdfast_attention::sparse_attention_source(), arch, 32).expect("compiles");
        let ptx = String::from_utf8_lossy(&ptx).into_owned();
        let e =
            ptx.split(".entry ").find(|e| e.starts_with("hf_sparse_attn_wg64_d512_bf16")).expect("entry").to_string();
        e
    };
    let e = entry("sm_90a");
    assert!(e.contains("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"), "lacks the Q·Kᵀ wgmma");
    assert!(e.contains("mbarrier.try_wait.parity"), "lacks the warpgroups' hand-offs");
    assert!(e.contains("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"), "lacks the P·V wgmma");
    assert!(e.contains("fence.proxy.async.shared::cta"), "lacks the proxy fence");
    assert!(e.contains("cp.async.cg.shared.global"), "lacks cp.async staging");
    assert!(e.contains("mapa.shared::cluster") && e.contains("barrier.cluster.wait"), "lacks the split's combine");
    assert!(!e.contains(".local"), "uses local memory");
    assert!(!entry("sm_90").contains("wgmma"), "sm_90 has no warpgroup MMA");
}
