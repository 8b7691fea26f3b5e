//! Collectives: the CPU emulation against a host reference computed the documented way (f32, rank
//! order, rounded once), bit for bit, for 1, 2 and 4 ranks on threads; capture + replay equals
//! eager; disagreeing ranks, missing ranks and malformed calls are precise errors. A one-rank
//! group also runs on every backend through `device_suite!` (on CUDA it needs NCCL).

use std::time::{Duration, Instant, SystemTime};

use holdfast_hal::testing::{self, check_errors};
use holdfast_hal::{
    bf16, f16, Buffer, Communicator, Device, Element, HalError, ReduceOp, Stream, View, COMM_TIMEOUT_ENV,
    DEFAULT_COMM_TIMEOUT,
};

/// xorshift64*, seeded per test from the clock (printed, so a failure can be replayed).
struct Rng(u64);

impl Rng {
    fn fresh(test: &str) -> Rng {
        let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        let seed = nanos | 1;
        eprintln!("{test}: seed {seed:#x}");
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Signed values over several binades, so that rounding and cancellation occur.
    fn value(&mut self) -> f32 {
        let r = self.next();
        let mantissa = (r >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        let exp = ((r >> 8) % 12) as i32 - 6;
        let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
        sign * (1.0 + mantissa) * 2f32.powi(exp)
    }
}

/// The float element types collectives take, with exact conversions for the host reference.
trait Float: Element + Copy {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    fn bits(self) -> u32;
}
impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}
impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

fn random<T: Float>(rng: &mut Rng, n: usize) -> Vec<T> {
    (0..n).map(|_| T::from_f32(rng.value())).collect()
}

/// The documented reduction: f32, rank order, rounded to `T` once; one rank is a copy.
fn reference_sum<T: Float>(parts: &[&[T]]) -> Vec<T> {
    if parts.len() == 1 {
        return parts[0].to_vec();
    }
    (0..parts[0].len())
        .map(|i| {
            let mut acc = parts[0][i].to_f32();
            for p in &parts[1..] {
                acc += p[i].to_f32();
            }
            T::from_f32(acc)
        })
        .collect()
}

fn reference_all_gather<T: Float>(sends: &[Vec<T>]) -> Vec<T> {
    sends.concat()
}

fn reference_reduce_scatter<T: Float>(sends: &[Vec<T>], rank: usize) -> Vec<T> {
    let block = sends[0].len() / sends.len();
    let parts: Vec<&[T]> = sends.iter().map(|s| &s[rank * block..(rank + 1) * block]).collect();
    reference_sum(&parts)
}

#[track_caller]
fn assert_bits<T: Float>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.bits(), w.bits(), "{what}: element {i}: got {g:?}, want {w:?}");
    }
}

/// `n` CPU devices (one per rank) and their group.
fn cpu_group(n: usize) -> (Vec<Device>, Vec<Communicator>) {
    let devices: Vec<Device> = (0..n).map(|_| Device::open("cpu").expect("cpu")).collect();
    let comms = Communicator::group(&devices).expect("group");
    (devices, comms)
}

/// Runs `f(rank's communicator)` on one thread per rank; results in rank order.
fn on_ranks<R: Send>(comms: &[Communicator], f: impl Fn(&Communicator) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let handles: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// A buffer filled with `data`, persistent so that captures may use it.
fn upload<T: Element>(dev: &Device, label: &str, data: &[T]) -> Buffer<T> {
    dev.alloc_from_slice(label, data, true).expect("upload")
}

/// A persistent buffer of `n` poisoned elements (all bits set: NaN for every float type).
fn poisoned<T: Element>(dev: &Device, s: &Stream, label: &str, n: usize) -> Buffer<T> {
    let b = dev.alloc_persistent::<T>(label, n).expect("alloc");
    s.memset(&b.view(), 0xFF).expect("poison");
    b
}

fn read<T: Element>(s: &Stream, v: &View<T>) -> Vec<T> {
    s.copy_to_host_sync(v).expect("read back")
}

/// Per-rank inputs of one collective step.
struct Inputs<T> {
    /// all_reduce input, `[len]` per rank.
    reduce: Vec<Vec<T>>,
    /// all_gather input, `[block]` per rank.
    gather: Vec<Vec<T>>,
    /// reduce_scatter input, `[n · block]` per rank.
    scatter: Vec<Vec<T>>,
    /// in-place all_reduce input, `[len]` per rank.
    in_place: Vec<Vec<T>>,
}

impl<T: Float> Inputs<T> {
    fn random(rng: &mut Rng, n: usize, len: usize, block: usize) -> Self {
        let mut per_rank = |k: usize| (0..n).map(|_| random::<T>(rng, k)).collect::<Vec<_>>();
        Inputs { reduce: per_rank(len), gather: per_rank(block), scatter: per_rank(n * block), in_place: per_rank(len) }
    }

    /// What rank `r` must receive from each of the four collectives.
    fn expected(&self, r: usize) -> [Vec<T>; 4] {
        fn refs<T>(v: &[Vec<T>]) -> Vec<&[T]> {
            v.iter().map(Vec::as_slice).collect()
        }
        [
            reference_sum(&refs(&self.reduce)),
            reference_all_gather(&self.gather),
            reference_reduce_scatter(&self.scatter, r),
            reference_sum(&refs(&self.in_place)),
        ]
    }
}

/// One rank's buffers for the four collectives of a step.
struct RankBuffers<T: Element> {
    reduce_in: Buffer<T>,
    reduce_out: Buffer<T>,
    gather_in: Buffer<T>,
    gather_out: Buffer<T>,
    scatter_in: Buffer<T>,
    scatter_out: Buffer<T>,
    in_place: Buffer<T>,
}

impl<T: Float> RankBuffers<T> {
    fn new(dev: &Device, s: &Stream, tag: &str, n: usize, len: usize, block: usize) -> Self {
        RankBuffers {
            reduce_in: poisoned(dev, s, &format!("{tag}.reduce_in"), len),
            reduce_out: poisoned(dev, s, &format!("{tag}.reduce_out"), len),
            gather_in: poisoned(dev, s, &format!("{tag}.gather_in"), block),
            gather_out: poisoned(dev, s, &format!("{tag}.gather_out"), n * block),
            scatter_in: poisoned(dev, s, &format!("{tag}.scatter_in"), n * block),
            scatter_out: poisoned(dev, s, &format!("{tag}.scatter_out"), block),
            in_place: poisoned(dev, s, &format!("{tag}.in_place"), len),
        }
    }

    /// Writes rank `r`'s inputs into the input buffers (and re-poisons the outputs).
    fn load(&self, s: &Stream, inputs: &Inputs<T>, r: usize) {
        s.copy_from_host(&inputs.reduce[r], &self.reduce_in.view()).expect("write");
        s.copy_from_host(&inputs.gather[r], &self.gather_in.view()).expect("write");
        s.copy_from_host(&inputs.scatter[r], &self.scatter_in.view()).expect("write");
        s.copy_from_host(&inputs.in_place[r], &self.in_place.view()).expect("write");
        for out in [&self.reduce_out, &self.gather_out, &self.scatter_out] {
            s.memset(&out.view(), 0xFF).expect("poison");
        }
    }

    /// The four collectives of a step, in the order every rank issues them.
    fn record(&self, c: &Communicator, s: &Stream) {
        c.all_reduce(s, &self.reduce_in.view(), &self.reduce_out.view(), ReduceOp::Sum).expect("all_reduce");
        c.all_gather(s, &self.gather_in.view(), &self.gather_out.view()).expect("all_gather");
        c.reduce_scatter(s, &self.scatter_in.view(), &self.scatter_out.view(), ReduceOp::Sum).expect("reduce_scatter");
        let v = self.in_place.view();
        c.all_reduce(s, &v, &v, ReduceOp::Sum).expect("in-place all_reduce");
    }

    fn outputs(&self, s: &Stream) -> [Vec<T>; 4] {
        [
            read(s, &self.reduce_out.view()),
            read(s, &self.gather_out.view()),
            read(s, &self.scatter_out.view()),
            read(s, &self.in_place.view()),
        ]
    }
}

const NAMES: [&str; 4] = ["all_reduce", "all_gather", "reduce_scatter", "in-place all_reduce"];

fn eager_collectives_match_the_reference<T: Float>(test: &str) {
    let mut rng = Rng::fresh(test);
    for n in [1, 2, 4] {
        let (len, block) = (1000 + (rng.next() % 64) as usize, 131);
        let inputs = Inputs::<T>::random(&mut rng, n, len, block);
        let (_devices, comms) = cpu_group(n);
        let got = on_ranks(&comms, |c| {
            let dev = c.device();
            let s = dev.create_stream().expect("stream");
            let b = RankBuffers::<T>::new(dev, &s, "eager", n, len, block);
            b.load(&s, &inputs, c.rank());
            b.record(c, &s);
            b.outputs(&s)
        });
        for (r, outs) in got.iter().enumerate() {
            for ((o, w), name) in outs.iter().zip(inputs.expected(r)).zip(NAMES) {
                assert_bits(o, &w, &format!("{test}: {name}, rank {r} of {n}"));
            }
        }
        // Every rank received the same all_reduce bits.
        for r in 1..n {
            assert_bits(&got[r][0], &got[0][0], "all_reduce is identical on every rank");
        }
    }
}

#[test]
fn f32_collectives_equal_the_rank_order_f32_reference_bit_for_bit() {
    eager_collectives_match_the_reference::<f32>("f32");
}

#[test]
fn bf16_collectives_equal_the_rank_order_f32_reference_bit_for_bit() {
    eager_collectives_match_the_reference::<bf16>("bf16");
}

#[test]
fn f16_collectives_equal_the_rank_order_f32_reference_bit_for_bit() {
    eager_collectives_match_the_reference::<f16>("f16");
}

#[test]
fn in_place_all_gather_and_reduce_scatter_use_their_rank_slices() {
    let mut rng = Rng::fresh("in_place_gather_scatter");
    let (n, block) = (4, 77);
    let gathers: Vec<Vec<bf16>> = (0..n).map(|_| random(&mut rng, block)).collect();
    let scatters: Vec<Vec<bf16>> = (0..n).map(|_| random(&mut rng, n * block)).collect();
    let (_devices, comms) = cpu_group(n);
    let got = on_ranks(&comms, |c| {
        let (dev, r) = (c.device(), c.rank());
        let s = dev.create_stream().expect("stream");
        let g = poisoned::<bf16>(dev, &s, "gather", n * block);
        let own = g.slice(r * block, block).expect("own slice");
        s.copy_from_host(&gathers[r], &own).expect("write");
        c.all_gather(&s, &own, &g.view()).expect("in-place all_gather");
        let sc = upload(dev, "scatter", &scatters[r]);
        let own = sc.slice(r * block, block).expect("own slice");
        c.reduce_scatter(&s, &sc.view(), &own, ReduceOp::Sum).expect("in-place reduce_scatter");
        (read(&s, &g.view()), read(&s, &own))
    });
    for (r, (g, sc)) in got.iter().enumerate() {
        assert_bits(g, &reference_all_gather(&gathers), "in-place all_gather");
        assert_bits(sc, &reference_reduce_scatter(&scatters, r), "in-place reduce_scatter");
    }
}

#[test]
fn captured_collectives_replayed_with_new_inputs_equal_eager_bit_for_bit() {
    let mut rng = Rng::fresh("capture");
    for n in [1, 2, 4] {
        let (len, block) = (515, 96);
        let steps: Vec<(Inputs<f32>, Inputs<bf16>)> = (0..3)
            .map(|_| (Inputs::random(&mut rng, n, len, block), Inputs::random(&mut rng, n, len, block)))
            .collect();
        let (_devices, comms) = cpu_group(n);
        let results = on_ranks(&comms, |c| {
            let (dev, r) = (c.device(), c.rank());
            let s = dev.create_stream().expect("stream");
            let (gf, gb) = (
                RankBuffers::<f32>::new(dev, &s, "g32", n, len, block),
                RankBuffers::new(dev, &s, "g16", n, len, block),
            );
            let (ef, eb) = (
                RankBuffers::<f32>::new(dev, &s, "e32", n, len, block),
                RankBuffers::new(dev, &s, "e16", n, len, block),
            );
            s.begin_capture("tp step").expect("begin");
            gf.record(c, &s);
            gb.record(c, &s);
            let graph = s.end_capture().expect("end");
            assert_eq!(graph.op_count(), 8, "every collective is recorded");
            assert_eq!(graph.retained_buffers(), 14, "the graph retains every buffer its collectives touch");
            assert!(
                read(&s, &gf.reduce_out.view()).iter().all(|v| v.is_nan()),
                "capturing records; it does not execute"
            );
            let mut per_step = Vec::new();
            for (i32s, i16s) in &steps {
                gf.load(&s, i32s, r);
                gb.load(&s, i16s, r);
                graph.replay(&s).expect("replay");
                ef.load(&s, i32s, r);
                eb.load(&s, i16s, r);
                ef.record(c, &s);
                eb.record(c, &s);
                per_step.push((gf.outputs(&s), gb.outputs(&s), ef.outputs(&s), eb.outputs(&s)));
            }
            assert_eq!(graph.replays(), 3);
            per_step
        });
        for (r, per_step) in results.iter().enumerate() {
            for (k, ((g32, g16, e32, e16), (i32s, i16s))) in per_step.iter().zip(&steps).enumerate() {
                for (i, name) in NAMES.iter().enumerate() {
                    let what = format!("n={n} rank {r} step {k} {name}");
                    assert_bits(&g32[i], &e32[i], &format!("{what} f32: replay vs eager"));
                    assert_bits(&g16[i], &e16[i], &format!("{what} bf16: replay vs eager"));
                    assert_bits(&g32[i], &i32s.expected(r)[i], &format!("{what} f32: replay vs reference"));
                    assert_bits(&g16[i], &i16s.expected(r)[i], &format!("{what} bf16: replay vs reference"));
                }
            }
        }
    }
}

#[test]
fn ranks_that_disagree_all_get_an_error_naming_who_called_what_and_nothing_is_written() {
    let (_devices, comms) = cpu_group(4);
    let results = on_ranks(&comms, |c| {
        let dev = c.device();
        let s = dev.create_stream().expect("stream");
        // Rank 2 reduces 6 elements, the others 8.
        let len = if c.rank() == 2 { 6 } else { 8 };
        let x = upload(dev, "x", &vec![1.0f32; len]);
        let y = poisoned::<f32>(dev, &s, "y", len);
        let first = c.all_reduce(&s, &x.view(), &y.view(), ReduceOp::Sum).expect_err("counts disagree");
        let untouched = read(&s, &y.view()).iter().all(|v| v.is_nan());
        // Rank 1 gathers where the others reduce; element types agree.
        let second = if c.rank() == 1 {
            let g = poisoned::<f32>(dev, &s, "g", 4 * 2);
            c.all_gather(&s, &x.slice(0, 2).expect("v"), &g.view())
        } else {
            c.all_reduce(&s, &x.slice(0, 2).expect("v"), &y.slice(0, 2).expect("v"), ReduceOp::Sum)
        }
        .expect_err("kinds disagree");
        // Rank 3 reduces bf16 where the others reduce f32.
        let third = if c.rank() == 3 {
            let xb = upload(dev, "xb", &[bf16::ONE; 4]);
            let yb = poisoned::<bf16>(dev, &s, "yb", 4);
            c.all_reduce(&s, &xb.view(), &yb.view(), ReduceOp::Sum)
        } else {
            c.all_reduce(&s, &x.slice(0, 4).expect("v"), &y.slice(0, 4).expect("v"), ReduceOp::Sum)
        }
        .expect_err("types disagree");
        // The group stays in step: the next agreeing collective works.
        let z = upload(dev, "z", &[c.rank() as f32; 3]);
        let w = poisoned::<f32>(dev, &s, "w", 3);
        c.all_reduce(&s, &z.view(), &w.view(), ReduceOp::Sum).expect("agreeing collective after a mismatch");
        (first, untouched, second, third, read(&s, &w.view()))
    });
    for (r, (first, untouched, second, third, after)) in results.iter().enumerate() {
        match first {
            HalError::CollectiveMismatch { op, rank, seq, detail } => {
                assert_eq!((*op, *rank, *seq), ("all_reduce", r, 0));
                assert_eq!(
                    detail,
                    "ranks [0, 1, 3] called all_reduce(sum) of 8 f32 elements; rank 2 called all_reduce(sum) of 6 f32 elements"
                );
            }
            other => panic!("rank {r}: expected CollectiveMismatch, got {other:?}"),
        }
        assert!(untouched, "rank {r}: a failed collective writes nothing");
        let s = second.to_string();
        assert!(s.contains("rank 1 called all_gather of 2 f32 elements per rank"), "{s}");
        assert!(s.contains("ranks [0, 2, 3] called all_reduce(sum) of 2 f32 elements"), "{s}");
        assert!(matches!(second, HalError::CollectiveMismatch { seq: 1, .. }), "{second:?}");
        let t = third.to_string();
        assert!(t.contains("rank 3 called all_reduce(sum) of 4 bf16 elements"), "{t}");
        assert!(t.contains(&format!("on rank {r}:")), "{t}");
        assert_eq!(after, &vec![6.0f32; 3], "rank {r}: 0 + 1 + 2 + 3");
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_it_and_a_late_rank_is_told_why() {
    let timeout = Duration::from_millis(200);
    let (_devices, comms) = cpu_group(3);
    if std::env::var_os(COMM_TIMEOUT_ENV).is_none() {
        assert_eq!(comms[0].timeout(), Some(DEFAULT_COMM_TIMEOUT));
    }
    let comms: Vec<Communicator> = comms.into_iter().map(|c| c.with_timeout(timeout)).collect();
    assert_eq!(comms[1].timeout(), Some(timeout));
    let results = on_ranks(&comms[..2], |c| {
        let dev = c.device();
        let s = dev.create_stream().expect("stream");
        let x = upload(dev, "x", &[1.0f32; 4]);
        let y = poisoned::<f32>(dev, &s, "y", 4);
        let t0 = Instant::now();
        let err = c.all_reduce(&s, &x.view(), &y.view(), ReduceOp::Sum).expect_err("rank 2 never arrives");
        (err, t0.elapsed(), read(&s, &y.view()))
    });
    for (r, (err, took, y)) in results.iter().enumerate() {
        match err {
            HalError::CollectiveTimeout { op, rank, seq, waited, missing } => {
                assert_eq!((*op, *rank, *seq, missing.as_slice()), ("all_reduce", r, 0, &[2][..]));
                // The rank that gave up waited its whole timeout; the other stopped with it.
                assert!(*waited > Duration::ZERO);
            }
            other => panic!("rank {r}: expected CollectiveTimeout, got {other:?}"),
        }
        assert!(*took < Duration::from_secs(10), "rank {r} took {took:?}");
        assert!(err.to_string().contains("rank(s) [2] did not arrive"), "{err}");
        assert!(y.iter().all(|v| v.is_nan()), "nothing is written");
    }
    let longest = results
        .iter()
        .map(|(e, ..)| match e {
            HalError::CollectiveTimeout { waited, .. } => *waited,
            _ => Duration::ZERO,
        })
        .max();
    assert!(longest >= Some(timeout), "someone waited the whole timeout: {longest:?}");
    // Rank 2 finally arrives: it learns at once that the others gave up.
    let c = &comms[2];
    let dev = c.device();
    let s = dev.create_stream().expect("stream");
    let x = upload(dev, "x", &[1.0f32; 4]);
    let t0 = Instant::now();
    let err = c.all_reduce(&s, &x.view(), &x.view(), ReduceOp::Sum).expect_err("abandoned");
    assert!(t0.elapsed() < timeout, "the late rank does not wait");
    assert!(matches!(err, HalError::CollectiveAborted { rank: 2, seq: 0, .. }), "{err:?}");
    assert!(err.to_string().contains("when rank(s) [2] had not arrived"), "{err}");
}

#[test]
fn malformed_collectives_are_precise_errors_found_before_anything_runs() {
    let (devices, comms) = cpu_group(2);
    let c = &comms[1];
    let dev = &devices[1];
    let s = dev.create_stream().expect("stream");
    let a = upload(dev, "a", &[0.0f32; 8]);
    let b = upload(dev, "b", &[0.0f32; 8]);
    let check = |r: holdfast_hal::Result<()>, op: &str, needle: &str| {
        let e = r.expect_err(needle);
        match &e {
            HalError::InvalidCollective { op: o, rank: 1, size: 2, detail } => {
                assert_eq!(*o, op, "{e}");
                assert!(detail.contains(needle), "{e}");
            }
            other => panic!("expected InvalidCollective, got {other:?}"),
        }
    };
    check(
        c.all_reduce(&s, &a.view(), &b.prefix(7).expect("v"), ReduceOp::Sum),
        "all_reduce",
        "send has 8 elements and recv has 7",
    );
    check(
        c.all_gather(&s, &a.prefix(3).expect("v"), &b.view()),
        "all_gather",
        "send has 3 elements, so recv must have 2 × 3 = 6, but it has 8",
    );
    check(
        c.reduce_scatter(&s, &a.prefix(7).expect("v"), &b.prefix(4).expect("v"), ReduceOp::Sum),
        "reduce_scatter",
        "recv has 4 elements, so send must have 2 × 4 = 8, but it has 7",
    );
    let ints = upload(dev, "ints", &[0i32; 4]);
    check(
        c.all_reduce(&s, &ints.view(), &ints.view(), ReduceOp::Sum),
        "all_reduce",
        "element type i32 is not supported",
    );
    let words = upload(dev, "words", &[0u32; 4]);
    check(c.all_gather(&s, &words.prefix(2).expect("v"), &words.view()), "all_gather", "element type u32");
    // Overlaps other than the in-place forms.
    check(
        c.all_reduce(&s, &a.slice(0, 4).expect("v"), &a.slice(2, 4).expect("v"), ReduceOp::Sum),
        "all_reduce",
        "in place, send and recv must be the same view",
    );
    check(
        c.all_gather(&s, &a.slice(0, 4).expect("v"), &a.view()),
        "all_gather",
        "in place, send must be the slice of recv at element rank × send.len()",
    );
    check(
        c.reduce_scatter(&s, &a.view(), &a.slice(0, 4).expect("v"), ReduceOp::Sum),
        "reduce_scatter",
        "in place, recv must be the slice of send at element rank × recv.len()",
    );
    // Streams and views of another device than the rank's.
    let other = devices[0].create_stream().expect("stream");
    check(
        c.all_reduce(&other, &a.view(), &b.view(), ReduceOp::Sum),
        "all_reduce",
        "the stream belongs to another device",
    );
    let foreign = upload(&devices[0], "foreign", &[0.0f32; 8]);
    check(c.all_reduce(&s, &foreign.view(), &b.view(), ReduceOp::Sum), "all_reduce", "send (buffer `foreign`)");
    check(c.all_reduce(&s, &a.view(), &foreign.view(), ReduceOp::Sum), "all_reduce", "recv (buffer `foreign`)");
    check_errors(vec![(
        "a group of no devices",
        Communicator::group(&[]).map(drop),
        |e| matches!(e, HalError::InvalidGroup(_)),
        testing::words(&["cannot form a communicator group: no devices given: a group needs at least one"]),
    )]);
    // Nothing reached the rendezvous: the group is still in step (rank 0 would otherwise wait for a
    // call rank 1 already made).
    let ok = on_ranks(&comms, |c| {
        let s = c.device().create_stream().expect("stream");
        let x = upload(c.device(), "x", &[1.0f32; 2]);
        c.all_reduce(&s, &x.view(), &x.view(), ReduceOp::Sum).expect("in step");
        read(&s, &x.view())
    });
    assert_eq!(ok, vec![vec![2.0f32; 2]; 2]);
}

#[test]
fn captured_collectives_follow_the_graph_stability_and_sanitizer_rules() {
    let dev = Device::cpu().expect("cpu");
    let c = &Communicator::group(std::slice::from_ref(&dev)).expect("group")[0];
    assert_eq!((c.rank(), c.size()), (0, 1));
    let s = dev.create_stream().expect("stream");
    // A transient buffer in a captured collective is rejected, and the capture stays usable.
    let transient = dev.alloc_from_slice("transient", &[1.0f32; 4], false).expect("t");
    let recv = poisoned::<f32>(&dev, &s, "recv", 4);
    let send = upload(&dev, "send", &[1.0f32, 2.0, 3.0, 4.0]);
    send.set_host_refreshed(true);
    s.begin_capture("tp").expect("begin");
    let err = c.all_reduce(&s, &transient.view(), &recv.view(), ReduceOp::Sum).expect_err("transient send");
    assert!(
        matches!(&err, HalError::NotGraphStable { kernel, arg, buffer } if kernel == "all_reduce" && arg == "send" && buffer == "transient"),
        "{err:?}"
    );
    // A host-refreshed input must be rewritten before every replay; the graph keeps its buffers.
    c.all_reduce(&s, &send.view(), &recv.view(), ReduceOp::Sum).expect("captured");
    let graph = s.end_capture().expect("end");
    assert_eq!(graph.op_count(), 1);
    s.copy_from_host(&[5.0f32, 6.0, 7.0, 8.0], &send.view()).expect("refresh");
    assert_eq!(graph.retained_buffers(), 2);
    let live = dev.stats().live_allocations;
    drop((send, recv));
    assert_eq!(dev.stats().live_allocations, live, "the graph keeps the collective's buffers alive");
    graph.replay(&s).expect("first replay");
    let err = graph.replay(&s).expect_err("input not rewritten");
    assert!(matches!(&err, HalError::StaleHostInput { buffer, .. } if buffer == "send"), "{err:?}");
    drop(graph);
    assert_eq!(dev.stats().live_allocations, live - 2, "dropping the graph frees them");
}

/// On every backend: a one-rank group, whose collectives are copies, eagerly and inside a capture
/// replayed with new inputs. On CUDA this needs NCCL and skips with a line when it is absent.
fn a_one_rank_group_copies_eagerly_and_inside_a_capture(dev: &Device) {
    let comms = match Communicator::group(std::slice::from_ref(dev)) {
        Ok(c) => c,
        Err(e @ HalError::BackendUnavailable { .. }) => {
            eprintln!("skipped: no collectives on {} here ({e})", dev.info().name);
            return;
        }
        Err(e) => panic!("group: {e}"),
    };
    let c = &comms[0];
    let s = dev.create_stream().expect("stream");
    let mut rng = Rng::fresh("one_rank");
    let n = 4099;
    let x32 = poisoned::<f32>(dev, &s, "x32", n);
    let y32 = poisoned::<f32>(dev, &s, "y32", n);
    let xb = poisoned::<bf16>(dev, &s, "xb", n);
    let gb = poisoned::<bf16>(dev, &s, "gb", n);
    let rb = poisoned::<bf16>(dev, &s, "rb", n);
    let ip = poisoned::<f32>(dev, &s, "ip", n);
    let record = |s: &Stream| {
        c.all_reduce(s, &x32.view(), &y32.view(), ReduceOp::Sum).expect("all_reduce");
        c.all_gather(s, &xb.view(), &gb.view()).expect("all_gather");
        c.reduce_scatter(s, &xb.view(), &rb.view(), ReduceOp::Sum).expect("reduce_scatter");
        c.all_reduce(s, &ip.view(), &ip.view(), ReduceOp::Sum).expect("in place");
    };
    let check = |what: &str, a: &[f32], b: &[bf16], p: &[f32]| {
        assert_bits(&read(&s, &y32.view()), a, &format!("{what}: all_reduce"));
        assert_bits(&read(&s, &gb.view()), b, &format!("{what}: all_gather"));
        assert_bits(&read(&s, &rb.view()), b, &format!("{what}: reduce_scatter"));
        assert_bits(&read(&s, &ip.view()), p, &format!("{what}: in-place all_reduce"));
    };
    let step = |rng: &mut Rng| {
        let (a, b, p) = (random::<f32>(rng, n), random::<bf16>(rng, n), random::<f32>(rng, n));
        s.copy_from_host(&a, &x32.view()).expect("write");
        s.copy_from_host(&b, &xb.view()).expect("write");
        s.copy_from_host(&p, &ip.view()).expect("write");
        s.memset(&y32.view(), 0xFF).expect("poison");
        s.memset(&gb.view(), 0xFF).expect("poison");
        s.memset(&rb.view(), 0xFF).expect("poison");
        (a, b, p)
    };
    let (a, b, p) = step(&mut rng);
    record(&s);
    check("eager", &a, &b, &p);
    s.begin_capture("one rank").expect("begin");
    record(&s);
    let graph = s.end_capture().expect("end");
    assert_eq!(graph.op_count(), 4);
    for k in 0..3 {
        let (a, b, p) = step(&mut rng);
        graph.replay(&s).expect("replay");
        check(&format!("replay {k}"), &a, &b, &p);
    }
}

holdfast_hal::device_suite!(a_one_rank_group_copies_eagerly_and_inside_a_capture);

/// Without NCCL, the reason names what was searched; with it, the version is known.
#[cfg(feature = "cuda")]
#[test]
fn nccl_is_found_or_its_absence_names_what_was_searched() {
    match holdfast_hal::cuda::nccl_unavailable_reason() {
        Some(reason) => {
            eprintln!("NCCL is not available here: {reason}");
            assert!(reason.contains("libnccl.so.2") && reason.contains("$HOLDFAST_NCCL_PATH"), "{reason}");
            assert!(holdfast_hal::cuda::nccl_version().is_none());
        }
        None => {
            let v = holdfast_hal::cuda::nccl_version().expect("loaded");
            eprintln!("NCCL version code {v}");
            assert!(v >= 21000, "{v}");
        }
    }
}
