//! A model of the hand-offs of `hc_head` on thread-block clusters (`mhc_hc_head_cluster_n4` in
//! `src/kernels.cu`), run on the CPU under many interleavings of a cluster's blocks.
//!
//! Each block is one actor running the kernel's sequence of synchronising operations for the
//! cluster's `tiles` tiles: the slot barriers' initialisation and arming, the cluster barriers,
//! the pushes of a tile's partials into every block's inbox (`st.async`: each store is in flight
//! from its issue until the scheduler delivers it, writing the slot and completing its bytes on the
//! destination's mbarrier), the parity waits, the reads of a slot and its re-arming. The block
//! barriers inside a block order its own operations and are implicit in its program. Operations
//! are atomic and the scheduler picks the next block or in-flight store at random (seeded), so
//! every order the hand-offs allow can come up. Reported: a store into a block whose barriers are
//! not initialised; a store that overwrites partials not yet read, or completes bytes of a phase
//! that is not armed or is meant for another tile; a slot read that does not hold the tile from
//! every block; a parity wait that passes on another phase than the one it waits for; a block
//! that leaves with stores to or from it in flight; a deadlock.

/// What the kernel does, a variant that also holds (two slots), or a deliberate fault (to show
/// that the model reports it).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    None,
    /// Two slots instead of three (the fewest that hold).
    TwoSlots,
    /// One slot.
    OneSlot,
    /// The first tile's partials pushed before the cluster barrier that follows the barriers'
    /// initialisation.
    PushBeforeInit,
    /// Warp 0 waits for a slot with the other parity.
    FlippedParity,
    /// No cluster barrier at the end.
    NoFinalBarrier,
}

impl Fault {
    fn slots(self) -> usize {
        match self {
            Fault::OneSlot => 1,
            Fault::TwoSlots => 2,
            _ => 3,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    /// Thread 0: the slots' mbarriers initialised (one arrival each) and armed for their first
    /// tiles (`arrive.expect_tx` of one store per block).
    Init,
    ClusterArrive,
    ClusterWait,
    /// The block's partials of local tile `j` to every block of the cluster, slot `j % slots`.
    Push(usize),
    /// Warp 0's wait for local tile `j` with parity `p` (`(j / slots) % 2`).
    Wait(usize, usize),
    /// Warp 0 sums slot `j % slots` (every block's partials of tile `j`), then arms the slot for
    /// tile `j + slots`.
    ReadAndArm(usize),
    Exit,
}

/// The kernel's synchronising operations for one block (`hf_cluster_arrive_shared` after the
/// barriers' initialisation, the wait after the first tile's partials, the loop, the last
/// cluster barrier).
fn program(tiles: usize, fault: Fault) -> Vec<Op> {
    let mut p = vec![Op::Init, Op::ClusterArrive];
    if tiles > 0 {
        if fault == Fault::PushBeforeInit {
            p.extend([Op::Push(0), Op::ClusterWait]);
        } else {
            p.extend([Op::ClusterWait, Op::Push(0)]);
        }
    } else {
        p.push(Op::ClusterWait);
    }
    let slots = fault.slots();
    for j in 0..tiles {
        let parity = (j / slots + usize::from(fault == Fault::FlippedParity)) % 2;
        p.extend([Op::Wait(j, parity), Op::ReadAndArm(j)]);
        if j + 1 < tiles {
            p.push(Op::Push(j + 1));
        }
    }
    if fault != Fault::NoFinalBarrier {
        p.extend([Op::ClusterArrive, Op::ClusterWait]);
    }
    p.push(Op::Exit);
    p
}

/// One slot mbarrier: phases completed, arrivals still due and bytes (stores) still expected in
/// the current phase (negative: stores came before the phase was armed).
#[derive(Clone, Copy, Debug, Default)]
struct Barrier {
    completed: usize,
    arrivals: u32,
    tx: i64,
}

impl Barrier {
    fn complete_if_done(&mut self) {
        if self.arrivals == 0 && self.tx == 0 {
            self.completed += 1;
            self.arrivals = 1;
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    pc: usize,
    init: bool,
    bars: Vec<Barrier>,
    /// inbox[slot][source block]: the local tile whose partials it holds.
    inbox: Vec<Vec<Option<usize>>>,
    /// The last tile read from each slot.
    read: Vec<Option<usize>>,
    /// Cluster barriers this block arrived at and passed.
    arrived: usize,
    passed: usize,
    exited: bool,
}

/// A push in flight: block `src`'s partials of tile `tile` into block `dst`.
#[derive(Clone, Copy, Debug)]
struct Store {
    src: usize,
    dst: usize,
    tile: usize,
}

struct Sim {
    slots: usize,
    blocks: Vec<Block>,
    stores: Vec<Store>,
}

impl Sim {
    fn new(nb: usize, slots: usize) -> Self {
        let block = Block {
            bars: vec![Barrier::default(); slots],
            inbox: vec![vec![None; nb]; slots],
            read: vec![None; slots],
            ..Block::default()
        };
        Sim { slots, blocks: vec![block; nb], stores: Vec::new() }
    }

    fn runnable(&self, b: usize, op: Op) -> bool {
        let me = &self.blocks[b];
        match op {
            // The cluster barrier's phase `passed` completes once every block arrived at it.
            Op::ClusterWait => self.blocks.iter().all(|x| x.arrived > me.passed),
            // try_wait.parity(p) passes once the current phase's parity differs from p.
            Op::Wait(j, parity) => me.bars[j % self.slots].completed % 2 != parity,
            _ => true,
        }
    }

    fn step(&mut self, b: usize, op: Op) -> Result<(), String> {
        let nb = self.blocks.len();
        match op {
            Op::Init => {
                let me = &mut self.blocks[b];
                me.init = true;
                for bar in &mut me.bars {
                    bar.arrivals = 0;
                    bar.tx += nb as i64;
                    bar.complete_if_done();
                }
            }
            Op::ClusterArrive => self.blocks[b].arrived += 1,
            Op::ClusterWait => self.blocks[b].passed += 1,
            Op::Push(j) => self.stores.extend((0..nb).map(|dst| Store { src: b, dst, tile: j })),
            Op::Wait(j, _) => {
                let done = self.blocks[b].bars[j % self.slots].completed;
                if done != j / self.slots + 1 {
                    return Err(format!("the wait for tile {j} passed with {done} phases of its slot completed"));
                }
            }
            Op::ReadAndArm(j) => {
                let s = j % self.slots;
                let me = &mut self.blocks[b];
                if let Some(src) = me.inbox[s].iter().position(|&t| t != Some(j)) {
                    return Err(format!("slot {s} read for tile {j} holds {:?} from block {src}", me.inbox[s][src]));
                }
                me.read[s] = Some(j);
                let bar = &mut me.bars[s];
                if bar.arrivals == 0 {
                    return Err(format!("slot {s} armed twice in one phase"));
                }
                bar.arrivals -= 1;
                bar.tx += nb as i64;
                bar.complete_if_done();
            }
            Op::Exit => {
                if let Some(st) = self.stores.iter().find(|st| st.src == b || st.dst == b) {
                    return Err(format!("block {b} left with a store in flight: {st:?}"));
                }
                self.blocks[b].exited = true;
            }
        }
        Ok(())
    }

    /// Lands store `i`: the slot written, one store's bytes completed on the destination's barrier.
    fn deliver(&mut self, i: usize) -> Result<(), String> {
        let st = self.stores.swap_remove(i);
        let s = st.tile % self.slots;
        let dst = &mut self.blocks[st.dst];
        if dst.exited {
            return Err(format!("{st:?} reached a block that has left"));
        }
        if !dst.init {
            return Err(format!("{st:?} reached a block whose barriers are not initialised"));
        }
        if let Some(held) = dst.inbox[s][st.src] {
            if dst.read[s] != Some(held) {
                return Err(format!("{st:?} overwrote tile {held}'s partials before they were read"));
            }
        }
        dst.inbox[s][st.src] = Some(st.tile);
        let bar = &mut dst.bars[s];
        if bar.completed != st.tile / self.slots {
            return Err(format!("{st:?} completes bytes of phase {} of slot {s}", bar.completed));
        }
        if bar.arrivals != 0 {
            return Err(format!("{st:?} reached slot {s} before its phase was armed"));
        }
        bar.tx -= 1;
        bar.complete_if_done();
        Ok(())
    }
}

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// Runs every block's program to the end under the schedule of `seed`: at each step a runnable
/// block or an in-flight store, stores picked with weight `store_weight` against 1 for a block.
fn run(nb: usize, tiles: usize, fault: Fault, seed: u64, store_weight: usize) -> Result<(), String> {
    let prog = program(tiles, fault);
    let mut sim = Sim::new(nb, fault.slots());
    let mut rng = Rng(seed);
    loop {
        let ready: Vec<usize> =
            (0..nb).filter(|&b| prog.get(sim.blocks[b].pc).is_some_and(|&op| sim.runnable(b, op))).collect();
        let choices = ready.len() + store_weight * sim.stores.len();
        if choices == 0 {
            if sim.blocks.iter().all(|x| x.pc == prog.len()) {
                return Ok(());
            }
            let at: Vec<_> = sim.blocks.iter().map(|x| prog.get(x.pc)).collect();
            return Err(format!("deadlock: blocks at {at:?}"));
        }
        let pick = rng.below(choices);
        if pick < ready.len() {
            let b = ready[pick];
            let op = prog[sim.blocks[b].pc];
            sim.step(b, op).map_err(|e| format!("block {b}, {op:?}: {e}"))?;
            sim.blocks[b].pc += 1;
        } else {
            sim.deliver((pick - ready.len()) / store_weight)?;
        }
    }
}

/// Every case: clusters of 2 to 4 blocks, 0 to 11 tiles, 50 seeds, stores landing eagerly or
/// late (7 200 runs).
fn sweep(fault: Fault) -> Vec<String> {
    let mut errors = Vec::new();
    for nb in 2..5 {
        for tiles in 0..12 {
            for seed in 0..50u64 {
                for store_weight in [1, 4] {
                    if let Err(e) = run(nb, tiles, fault, seed * 7 + nb as u64, store_weight) {
                        errors.push(format!("{nb} blocks, {tiles} tiles, seed {seed}, weight {store_weight}: {e}"));
                    }
                }
            }
        }
    }
    errors
}

#[test]
fn the_pushed_partials_hold_under_every_explored_interleaving() {
    // The kernel's three slots, and two: a block pushes tile j + 1 only after every block pushed
    // tile j, which each did after reading its slot for tile j - 1.
    for fault in [Fault::None, Fault::TwoSlots] {
        let errors = sweep(fault);
        assert!(errors.is_empty(), "{fault:?}: {} failures, first: {}", errors.len(), errors[0]);
    }
}

#[test]
fn the_model_reports_one_slot_an_early_push_a_flipped_parity_and_no_final_barrier() {
    for (fault, words) in [
        (Fault::OneSlot, &["overwrote", "before its phase was armed", "completes bytes of phase", "holds"][..]),
        (Fault::PushBeforeInit, &["not initialised"][..]),
        (Fault::FlippedParity, &["phases of its slot completed", "holds", "deadlock"][..]),
        (Fault::NoFinalBarrier, &["left with a store in flight", "has left"][..]),
    ] {
        let errors = sweep(fault);
        assert!(!errors.is_empty(), "{fault:?} went unreported");
        if let Some(e) = errors.iter().find(|e| !words.iter().any(|w| e.contains(w))) {
            panic!("{fault:?}: an unexpected report: {e}");
        }
    }
}
