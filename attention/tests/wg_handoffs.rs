//! A model of the warpgroup attention kernel's hand-offs (`hf_sparse_attn_wg` in
//! `src/sparse_attention.rs`), run on the CPU under many interleavings of its two warpgroups.
//!
//! Each warpgroup is one actor running the kernel's sequence of synchronising operations for a
//! block of `nloc` tiles: `cp.async` staging into the three K buffers (Q's buffer included) and
//! its commit groups and waits, the `wgmma` reads of a K buffer and of a P buffer from issue to
//! the wait that completes them, the writes of P and of the rescale factors, the reads of a
//! buffer's validity flags, the mbarriers (a KFREE per K buffer, QFREE) with their arrival
//! counts and parity waits, and the named barriers of both warpgroups (the block's, the first
//! tile's, the KREADY and PFULL pairs), each arrival counted per warpgroup. Operations are
//! atomic and the scheduler picks the next actor at random (seeded), so every order of the two
//! programs that the hand-offs allow can come up. Reported: a read of a buffer that does not hold
//! the expected tile, or whose copies did not land; a staging or a P write into a buffer with a
//! read still in flight; a parity wait that passes on another phase than the one it waits for;
//! a warpgroup arriving twice at a named barrier before the other; a deadlock; arrivals left over
//! at the end.

/// What the kernel does, or a deliberate fault (to show that the model reports it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// Warpgroup 1 waits for KFREE with the other parity.
    FlippedKfreeParity,
    /// Warpgroup 1 stages into a K buffer without waiting for KFREE.
    NoKfreeWait,
    /// Warpgroup 1 gives KREADY before waiting for the tile's copies.
    ReadyBeforeLanded,
    /// KREADY on the named barriers of PFULL.
    SharedNamedBarriers,
}

/// The kernel's mbarriers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bar {
    KFree(usize),
    QFree,
}

impl Bar {
    fn index(self) -> usize {
        match self {
            Bar::KFree(i) => i,
            Bar::QFree => 3,
        }
    }
    fn count(self) -> u32 {
        match self {
            Bar::KFree(_) => 256,
            Bar::QFree => 128,
        }
    }
}

/// The kernel's named barriers of both warpgroups: 0 (the block), 1 (the first tile), PFULL of
/// tile parity b (3 + b), KREADY of the tile after one of parity b (5 + b). (Named barrier 2 is
/// warpgroup 0's alone: inside one actor here.)
const NAMED: usize = 7;
fn pfull(b: usize) -> usize {
    3 + b
}
fn kready(b: usize, fault: Fault) -> usize {
    if fault == Fault::SharedNamedBarriers {
        pfull(b)
    } else {
        5 + b
    }
}

/// Q's content in buffer 0 (a tile index otherwise).
const Q: i64 = -1;

#[derive(Clone, Copy, Debug)]
enum Op {
    /// `cp.async` of this warpgroup's part of `tile` into K buffer `buf` (and the tile's validity
    /// flags, plain stores).
    Stage {
        buf: usize,
        tile: i64,
    },
    Commit,
    /// `cp.async.wait_group n`: every group of this warpgroup but the newest `n` landed.
    WaitGroups(usize),
    /// `mbarrier.arrive` of the whole warpgroup (128 arrivals).
    Arrive(Bar),
    /// Parity wait for the `k`-th completion (from 0) of the barrier: parity `k % 2`.
    Wait(Bar, u64),
    /// Named barrier `id` over both warpgroups: arrive and wait, or arrive only.
    Sync(usize),
    ArriveNamed(usize),
    /// Q into warpgroup 0's registers (`ldmatrix` from buffer 0).
    LoadQ,
    /// A `wgmma` issued: reads K buffer `k` (expected tile) and P buffer `p` (expected tile).
    Mma {
        k: (usize, i64),
        p: Option<(usize, i64)>,
    },
    /// `wgmma.wait_group 0`: this warpgroup's MMAs complete.
    MmaWait,
    /// The validity flags of K buffer `buf` read (warpgroup 0's softmax) for `tile`.
    ReadFlags {
        buf: usize,
        tile: i64,
    },
    /// P and the rescale factors of `tile` written into P buffer `p`.
    WriteP {
        p: usize,
        tile: i64,
    },
    /// The rescale factors of P buffer `p` read (warpgroup 1) for `tile`.
    ReadFactors {
        p: usize,
        tile: i64,
    },
}

/// The programs of warpgroups 0 and 1 for a block of `nloc` tiles.
fn programs(nloc: usize, fault: Fault) -> [Vec<Op>; 2] {
    use Op::*;
    let n = nloc as i64;
    let kbuf = |tile: i64| ((tile + 1) % 3) as usize;
    let (mut w0, mut w1) = (Vec::new(), Vec::new());
    // Prologue: Q (group 1) and the first tile (group 2) by the whole block, the second tile by
    // warpgroup 1 (its group 3).
    for w in [&mut w0, &mut w1] {
        w.push(Stage { buf: 0, tile: Q });
        w.push(Commit);
        if n > 0 {
            w.push(Stage { buf: 1, tile: 0 });
        }
        w.push(Commit);
    }
    if n > 1 {
        w1.push(Stage { buf: 2, tile: 1 });
    }
    w1.push(Commit);
    // Q landed (each warpgroup its own copies), then the block barrier.
    w0.push(WaitGroups(1));
    w1.push(WaitGroups(2));
    w0.push(Sync(0));
    w1.push(Sync(0));

    // Warpgroup 0.
    w0.push(LoadQ);
    w0.push(Arrive(Bar::QFree));
    // The first tile: warpgroup 0's copies, then warpgroup 1's on named barrier 1.
    w0.push(WaitGroups(0));
    w0.push(Sync(1));
    for it in 0..n {
        let (b, kb) = ((it % 2) as usize, kbuf(it));
        if it > 0 {
            w0.push(Sync(kready(((it - 1) % 2) as usize, fault)));
        }
        w0.push(Mma { k: (kb, it), p: None });
        w0.push(MmaWait);
        w0.push(ReadFlags { buf: kb, tile: it });
        w0.push(WriteP { p: b, tile: it });
        w0.push(ArriveNamed(pfull(b)));
        w0.push(Mma { k: (kb, it), p: Some((b, it)) });
        w0.push(MmaWait);
        if it + 3 < n {
            w0.push(Arrive(Bar::KFree(kb)));
        }
    }
    w0.push(WaitGroups(0));
    w0.push(Sync(0));

    // Warpgroup 1.
    w1.push(WaitGroups(1));
    w1.push(ArriveNamed(1));
    for it in 0..n {
        let (b, kb) = ((it % 2) as usize, kbuf(it));
        if it + 2 < n {
            if it == 0 {
                w1.push(Wait(Bar::QFree, 0));
            } else if fault != Fault::NoKfreeWait {
                let use_ = ((it - 1) / 3) as u64 + u64::from(fault == Fault::FlippedKfreeParity);
                w1.push(Wait(Bar::KFree((it % 3) as usize), use_));
            }
            w1.push(Stage { buf: (it % 3) as usize, tile: it + 2 });
        }
        w1.push(Commit);
        w1.push(Sync(pfull(b)));
        w1.push(ReadFactors { p: b, tile: it });
        w1.push(Mma { k: (kb, it), p: Some((b, it)) });
        // Tile it + 1 (all groups but tile it + 2's landed) to warpgroup 0.
        if it + 1 < n {
            if fault == Fault::ReadyBeforeLanded {
                w1.push(ArriveNamed(kready(b, fault)));
                w1.push(WaitGroups(1));
            } else {
                w1.push(WaitGroups(1));
                w1.push(ArriveNamed(kready(b, fault)));
            }
        }
        w1.push(MmaWait);
        if it + 3 < n {
            w1.push(Arrive(Bar::KFree(kb)));
        }
    }
    w1.push(WaitGroups(0));
    w1.push(Sync(0));
    [w0, w1]
}

#[derive(Clone, Debug, Default)]
struct KBuf {
    tile: Option<i64>,
    /// Per warpgroup: its part of the content still in flight.
    pending: [bool; 2],
    flags: Option<i64>,
}

/// An MMA's reads: (K buffer, P buffer).
type Read = (usize, Option<usize>);

#[derive(Default)]
struct Actor {
    pc: usize,
    /// Committed groups (each the buffers it staged into), oldest first, and the open one.
    groups: Vec<Vec<usize>>,
    open: Vec<usize>,
    /// In-flight MMA reads.
    reads: Vec<Read>,
    /// The named barrier generation this actor waits for.
    waiting: Option<(usize, u64)>,
}

struct Sim {
    k: [KBuf; 3],
    p: [Option<i64>; 2],
    bars: [(u32, u64); 4], // (arrivals in the current phase, completed phases)
    /// Per named barrier: the warpgroups arrived in the current generation, completed ones.
    named: [([bool; 2], u64); NAMED],
    actors: [Actor; 2],
}

impl Sim {
    fn new() -> Self {
        Sim {
            k: Default::default(),
            p: [None; 2],
            bars: [(0, 0); 4],
            named: [([false; 2], 0); NAMED],
            actors: [Actor::default(), Actor::default()],
        }
    }

    fn land(&mut self, a: usize, keep: usize) {
        let n = self.actors[a].groups.len().saturating_sub(keep);
        for g in self.actors[a].groups.drain(..n).collect::<Vec<_>>() {
            for buf in g {
                self.k[buf].pending[a] = false;
            }
        }
    }

    /// Whether actor `a` can run `op` now.
    fn runnable(&self, a: usize, op: &Op) -> bool {
        match *op {
            Op::Wait(bar, k) => self.bars[bar.index()].1 % 2 != k % 2,
            Op::Sync(id) => match self.actors[a].waiting {
                Some((i, gen)) => i != id || self.named[id].1 >= gen,
                None => true,
            },
            _ => true,
        }
    }

    /// Runs `op` for actor `a`: Ok(true) when it completed (the program counter moves on).
    fn step(&mut self, a: usize, op: Op) -> Result<bool, String> {
        match op {
            Op::Stage { buf, tile } => {
                if self.in_flight(|r| r.0 == buf) {
                    return Err(format!("tile {tile} staged into K buffer {buf} while an MMA still reads it"));
                }
                let kb = &mut self.k[buf];
                if kb.tile != Some(tile) {
                    kb.tile = Some(tile);
                    kb.pending = [false; 2];
                }
                kb.pending[a] = true;
                kb.flags = Some(tile);
                self.actors[a].open.push(buf);
            }
            Op::Commit => {
                let g = std::mem::take(&mut self.actors[a].open);
                self.actors[a].groups.push(g);
            }
            Op::WaitGroups(n) => self.land(a, n),
            Op::Arrive(bar) => {
                let (arr, done) = &mut self.bars[bar.index()];
                *arr += 128;
                if *arr == bar.count() {
                    *arr = 0;
                    *done += 1;
                }
            }
            Op::Wait(bar, k) => {
                let done = self.bars[bar.index()].1;
                if done != k + 1 {
                    return Err(format!("{bar:?}: the wait for completion {k} passed after {done} completions"));
                }
            }
            Op::Sync(id) => match self.actors[a].waiting {
                Some(_) => self.actors[a].waiting = None,
                None => {
                    let gen = self.arrive_named(a, id)?;
                    self.actors[a].waiting = Some((id, gen));
                    return Ok(false);
                }
            },
            Op::ArriveNamed(id) => {
                self.arrive_named(a, id)?;
            }
            Op::LoadQ => self.check_k(0, Q, "Q loaded")?,
            Op::Mma { k: (kb, kt), p } => {
                self.check_k(kb, kt, "MMA")?;
                if let Some((pb, pt)) = p {
                    if self.p[pb] != Some(pt) {
                        return Err(format!("MMA of tile {pt} reads P buffer {pb} holding {:?}", self.p[pb]));
                    }
                }
                self.actors[a].reads.push((kb, p.map(|x| x.0)));
            }
            Op::MmaWait => self.actors[a].reads.clear(),
            Op::ReadFlags { buf, tile } => {
                if self.k[buf].flags != Some(tile) {
                    return Err(format!(
                        "flags of tile {tile} read from K buffer {buf} holding {:?}",
                        self.k[buf].flags
                    ));
                }
            }
            Op::WriteP { p, tile } => {
                if self.in_flight(|r| r.1 == Some(p)) {
                    return Err(format!("P of tile {tile} written into P buffer {p} while an MMA still reads it"));
                }
                self.p[p] = Some(tile);
            }
            Op::ReadFactors { p, tile } => {
                if self.p[p] != Some(tile) {
                    return Err(format!("factors of tile {tile} read from P buffer {p} holding {:?}", self.p[p]));
                }
            }
        }
        Ok(true)
    }

    /// Whether an MMA read in flight (either warpgroup's) matches `f`.
    fn in_flight(&self, f: impl Fn(&Read) -> bool) -> bool {
        self.actors.iter().any(|x| x.reads.iter().any(&f))
    }

    /// Warpgroup `a`'s 128 arrivals at named barrier `id` (256 complete it): the generation it
    /// completes. A warpgroup arriving twice in one generation would complete it without the
    /// other, so that is reported.
    fn arrive_named(&mut self, a: usize, id: usize) -> Result<u64, String> {
        let (arrived, gen) = &mut self.named[id];
        if arrived[a] {
            return Err(format!("named barrier {id}: warpgroup {a} arrived twice before the other warpgroup"));
        }
        arrived[a] = true;
        let target = *gen + 1;
        if arrived.iter().all(|&x| x) {
            *arrived = [false; 2];
            *gen += 1;
        }
        Ok(target)
    }

    fn check_k(&self, buf: usize, tile: i64, what: &str) -> Result<(), String> {
        let kb = &self.k[buf];
        if kb.tile != Some(tile) {
            return Err(format!("{what}: tile {tile} read from K buffer {buf} holding {:?}", kb.tile));
        }
        if kb.pending.iter().any(|&p| p) {
            return Err(format!("{what}: tile {tile} read from K buffer {buf} before its copies landed"));
        }
        Ok(())
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Runs both programs to the end under the schedule of `seed` (warpgroup 0 picked with
/// probability `bias` / 8 where both can run).
fn run(nloc: usize, fault: Fault, seed: u64, bias: u64) -> Result<(), String> {
    let progs = programs(nloc, fault);
    let mut sim = Sim::new();
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    loop {
        let ready: Vec<usize> =
            (0..2).filter(|&a| progs[a].get(sim.actors[a].pc).is_some_and(|op| sim.runnable(a, op))).collect();
        let a = match ready.as_slice() {
            [] => {
                if (0..2).all(|a| sim.actors[a].pc == progs[a].len()) {
                    break;
                }
                let at: Vec<_> = (0..2).map(|a| progs[a].get(sim.actors[a].pc)).collect();
                return Err(format!("deadlock: warpgroup 0 at {:?}, warpgroup 1 at {:?}", at[0], at[1]));
            }
            [a] => *a,
            _ => usize::from(rng.next() % 8 >= bias),
        };
        let op = progs[a][sim.actors[a].pc];
        if sim.step(a, op).map_err(|e| format!("warpgroup {a}, op {}: {e}", sim.actors[a].pc))? {
            sim.actors[a].pc += 1;
        }
    }
    if let Some((i, b)) = sim.bars.iter().enumerate().find(|(_, b)| b.0 != 0) {
        return Err(format!("barrier {i}: {} arrivals left in an unfinished phase", b.0));
    }
    if let Some(id) = (0..NAMED).find(|&id| sim.named[id].0.iter().any(|&x| x)) {
        return Err(format!("named barrier {id}: an arrival left in an unfinished generation"));
    }
    Ok(())
}

/// Every (tiles, seed, bias) case: 0 to 15 tiles, 100 seeds, four biases (6 400 runs).
fn sweep(fault: Fault) -> Vec<String> {
    let mut errors = Vec::new();
    for nloc in 0..16 {
        for seed in 0..100u64 {
            for bias in [1u64, 4, 7, 8] {
                if let Err(e) = run(nloc, fault, seed, bias) {
                    errors.push(format!("{nloc} tiles, seed {seed}, bias {bias}: {e}"));
                }
            }
        }
    }
    errors
}

#[test]
fn the_hand_offs_hold_under_every_explored_interleaving() {
    let errors = sweep(Fault::None);
    assert!(errors.is_empty(), "{} failures, first: {}", errors.len(), errors[0]);
}

#[test]
fn the_model_reports_a_flipped_parity_an_unguarded_buffer_an_early_ready_and_shared_named_barriers() {
    for (fault, words) in [
        (Fault::FlippedKfreeParity, &["KFree", "deadlock"][..]),
        (Fault::NoKfreeWait, &["staged into K buffer", "while an MMA still reads it", "holding"][..]),
        (Fault::ReadyBeforeLanded, &["before its copies landed"][..]),
        (Fault::SharedNamedBarriers, &["arrived twice", "holding", "deadlock"][..]),
    ] {
        let errors = sweep(fault);
        assert!(!errors.is_empty(), "{fault:?} went unreported");
        if let Some(e) = errors.iter().find(|e| !words.iter().any(|w| e.contains(w))) {
            panic!("{fault:?}: an unexpected report: {e}");
        }
    }
}
