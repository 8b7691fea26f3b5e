//! Piecewise graphs: a forward is a sequence of pieces separated by splitting ops (attention).
//!
//! In PIECEWISE mode each piece (the work between two splitting ops) is captured per size as its
//! own HAL graph and replayed, while the splitting ops run eagerly in between, reading and writing
//! persistent arena buffers. In FULL mode the same sequence, pieces and splitting ops alike, is
//! recorded into one graph. A forward is written once against [`PieceCtx`]:
//!
//! ```text
//! pieces.piece(stream, |s| { /* projections, norms: captured per size */ Ok(()) })?;
//! pieces.splitting_op(stream, "attn0", &[attn_out.raw()], |s| { /* attention: eager */ Ok(()) })?;
//! pieces.piece(stream, |s| { /* the rest */ Ok(()) })?;
//! ```
//!
//! On a PIECEWISE replay the piece closures are not called at all: the captured graph for that
//! position replays instead. Splitting ops must write into arena buffers, because the next piece's
//! graph baked in the address it reads: a splitting op that declares any other output is a
//! [`GraphError::SplittingOpOutputNotPersistent`], checked in every mode so the bug shows up in an
//! eager test already.

use std::collections::HashMap;

use holdfast_hal::{Graph, RawView, Stream};

use crate::arena::PersistentArena;
use crate::descriptor::BatchDescriptor;
use crate::error::GraphError;

/// What a [`PieceCtx`] does with pieces and splitting ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Run everything now (NONE steps and warm-up runs).
    Eager,
    /// The runner is capturing one FULL graph around the whole forward: run (record) everything.
    CaptureFull,
    /// Capture each piece as its own graph; run splitting ops eagerly.
    CapturePieces,
    /// Replay each piece's graph; run splitting ops eagerly.
    ReplayPieces,
}

/// Counters a [`PieceCtx`] accumulates over one forward.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PieceCounts {
    pub(crate) piece_replays: u64,
    pub(crate) splitting_op_runs: u64,
}

/// The per-forward handle through which a forward runs its pieces and splitting ops; the graph
/// runner decides, per phase, whether a piece runs, is captured or is replayed.
pub struct PieceCtx<'a> {
    arena: &'a PersistentArena,
    desc: BatchDescriptor,
    phase: Phase,
    inputs: &'a [(String, RawView)],
    /// `inputs` in the form replays take, built once per forward.
    given: Vec<(&'a str, RawView)>,
    replay: &'a [Graph],
    captured: Vec<Graph>,
    next_piece: usize,
    pub(crate) counts: PieceCounts,
}

impl std::fmt::Debug for PieceCtx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PieceCtx")
            .field("desc", &self.desc)
            .field("phase", &self.phase)
            .field("next_piece", &self.next_piece)
            .finish()
    }
}

impl<'a> PieceCtx<'a> {
    pub(crate) fn new(
        arena: &'a PersistentArena,
        desc: BatchDescriptor,
        phase: Phase,
        inputs: &'a [(String, RawView)],
        replay: &'a [Graph],
    ) -> PieceCtx<'a> {
        let given = match phase {
            Phase::ReplayPieces => inputs.iter().map(|(n, v)| (n.as_str(), v.clone())).collect(),
            _ => Vec::new(),
        };
        PieceCtx {
            arena,
            desc,
            phase,
            inputs,
            given,
            replay,
            captured: Vec::new(),
            next_piece: 0,
            counts: PieceCounts::default(),
        }
    }

    /// A context that runs everything eagerly (for tests of a forward outside any runner).
    pub fn eager(arena: &'a PersistentArena, desc: BatchDescriptor) -> PieceCtx<'a> {
        PieceCtx::new(arena, desc, Phase::Eager, &[], &[])
    }

    /// The arena the forward's buffers live in.
    pub fn arena(&self) -> &'a PersistentArena {
        self.arena
    }

    /// The descriptor this forward runs for (padded for graph steps).
    pub fn desc(&self) -> &BatchDescriptor {
        &self.desc
    }

    /// True while this forward is being captured (FULL or piecewise): work is recorded, and a
    /// piece's results are not available to the host.
    pub fn is_capturing(&self) -> bool {
        matches!(self.phase, Phase::CaptureFull | Phase::CapturePieces)
    }

    /// Pieces run so far in this forward.
    pub fn pieces_run(&self) -> usize {
        self.next_piece
    }

    /// Runs one piece: eagerly, recorded into the enclosing FULL capture, captured as its own
    /// graph (PIECEWISE capture: the inputs bound by the runner are bound to it), or replayed
    /// from the graph captured at this position (PIECEWISE replay: `f` is not called).
    pub fn piece(
        &mut self,
        stream: &Stream,
        f: impl FnOnce(&Stream) -> Result<(), GraphError>,
    ) -> Result<(), GraphError> {
        let i = self.next_piece;
        self.next_piece += 1;
        match self.phase {
            Phase::Eager | Phase::CaptureFull => f(stream),
            Phase::CapturePieces => {
                stream.begin_capture(&format!("piecewise {} piece {i}", self.desc))?;
                let recorded = (|| {
                    for (name, view) in self.inputs {
                        self.arena.note_captured(view);
                        stream.bind_input(name, view.clone())?;
                    }
                    f(stream)
                })();
                match recorded {
                    Ok(()) => {
                        self.captured.push(stream.end_capture()?);
                        Ok(())
                    }
                    Err(e) => {
                        // Leave the stream usable; the recorded work is discarded.
                        let _ = stream.abort_capture();
                        Err(e)
                    }
                }
            }
            Phase::ReplayPieces => {
                let Some(graph) = self.replay.get(i) else {
                    return Err(GraphError::PieceMismatch {
                        desc: self.desc,
                        detail: format!("the forward ran piece {i}, but only {} were captured", self.replay.len()),
                    });
                };
                graph.replay_with_inputs(stream, &self.given)?;
                self.counts.piece_replays += 1;
                Ok(())
            }
        }
    }

    /// Runs a splitting op (attention) named `name` that writes `outputs`: eagerly, except inside
    /// a FULL capture where it is recorded with everything else. Every output must be a view of a
    /// persistent arena buffer ([`GraphError::SplittingOpOutputNotPersistent`] otherwise).
    pub fn splitting_op(
        &mut self,
        stream: &Stream,
        name: &str,
        outputs: &[RawView],
        f: impl FnOnce(&Stream) -> Result<(), GraphError>,
    ) -> Result<(), GraphError> {
        if let Some(bad) = outputs.iter().find(|v| self.arena.owner_of(v).is_none()) {
            return Err(GraphError::SplittingOpOutputNotPersistent {
                op: name.to_owned(),
                buffer: bad.label().to_owned(),
            });
        }
        f(stream)?;
        self.counts.splitting_op_runs += 1;
        Ok(())
    }

    /// Ends the forward: checks a replay consumed every captured piece, and hands back the graphs
    /// a piecewise capture produced.
    pub(crate) fn finish(self) -> Result<(Vec<Graph>, PieceCounts), GraphError> {
        if self.phase == Phase::ReplayPieces && self.next_piece != self.replay.len() {
            return Err(GraphError::PieceMismatch {
                desc: self.desc,
                detail: format!("the forward ran {} pieces, but {} were captured", self.next_piece, self.replay.len()),
            });
        }
        if self.phase == Phase::CapturePieces && self.captured.is_empty() {
            return Err(GraphError::PieceMismatch {
                desc: self.desc,
                detail: "the forward ran no piece, so there is nothing to capture".into(),
            });
        }
        Ok((self.captured, self.counts))
    }
}

/// The piecewise graphs of one forward: for each PIECEWISE key, one HAL graph per piece, in order.
#[derive(Debug, Default)]
pub struct PiecewiseRunner {
    graphs: HashMap<BatchDescriptor, Vec<Graph>>,
}

impl PiecewiseRunner {
    /// No graphs yet.
    pub fn new() -> PiecewiseRunner {
        PiecewiseRunner::default()
    }

    /// The piece graphs captured for `desc` (exact key), in forward order.
    pub fn pieces(&self, desc: &BatchDescriptor) -> Option<&[Graph]> {
        self.graphs.get(desc).map(Vec::as_slice)
    }

    /// Number of descriptors captured.
    pub fn descriptor_count(&self) -> usize {
        self.graphs.len()
    }

    /// Number of HAL graphs held (pieces over all descriptors).
    pub fn graph_count(&self) -> usize {
        self.graphs.values().map(Vec::len).sum()
    }

    /// Sum over all piece graphs of the bytes each keeps alive (buffers shared by several graphs
    /// are counted once per graph).
    pub fn retained_bytes_sum(&self) -> u64 {
        self.graphs.values().flatten().map(Graph::retained_bytes).sum()
    }

    /// The largest number of bytes one descriptor's pieces keep alive (a buffer counted once per
    /// piece that uses it).
    pub fn max_retained_bytes(&self) -> u64 {
        self.graphs.values().map(|g| g.iter().map(Graph::retained_bytes).max().unwrap_or(0)).max().unwrap_or(0)
    }

    pub(crate) fn insert(&mut self, desc: BatchDescriptor, pieces: Vec<Graph>) -> bool {
        self.graphs.insert(desc, pieces).is_some()
    }

    /// Runs `forward` over a PIECEWISE replay of `desc`'s pieces.
    pub(crate) fn replay_ctx<'a>(
        &'a self,
        arena: &'a PersistentArena,
        desc: BatchDescriptor,
        inputs: &'a [(String, RawView)],
    ) -> Option<PieceCtx<'a>> {
        let graphs = self.graphs.get(&desc)?;
        Some(PieceCtx::new(arena, desc, Phase::ReplayPieces, inputs, graphs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use holdfast_hal::Device;

    /// A locked arena on the CPU device, a stream, and one (empty) piece graph captured on it.
    fn setup() -> (PersistentArena, Stream, Graph) {
        let dev = Device::cpu().expect("cpu device");
        let mut arena = PersistentArena::new(&dev);
        arena.alloc::<f32>("attn out", 8).expect("alloc");
        arena.lock();
        let s = dev.create_stream().expect("stream");
        s.begin_capture("piece 0").expect("begin");
        let g = s.end_capture().expect("end");
        (arena, s, g)
    }

    /// Every way a forward can disagree with the piecewise capture or replay it runs under: the
    /// variant, and the words its message must contain (the descriptor and the piece counts).
    #[test]
    fn every_piece_count_mismatch_names_the_descriptor_and_the_counts() {
        let (arena, s, g) = setup();
        let desc = BatchDescriptor::unpadded(8);
        let graphs = [g];
        let mut cases: Vec<crate::error::ErrorCase> = Vec::new();
        // Non-capturing, so a plain function: the descriptor is rebuilt.
        let names_desc: fn(&GraphError) -> bool =
            |e| matches!(e, GraphError::PieceMismatch { desc: d, .. } if *d == BatchDescriptor::unpadded(8));

        // A replay whose forward runs one piece more than was captured.
        let mut ctx = PieceCtx::new(&arena, desc, Phase::ReplayPieces, &[], &graphs);
        ctx.piece(&s, |_| Ok(())).expect("the captured piece replays");
        let extra = ctx.piece(&s, |_| panic!("a replayed piece's closure is not called"));
        cases.push((
            "extra piece on replay",
            extra,
            names_desc,
            &["num_tokens=8", "ran piece 1", "only 1 were captured"],
        ));

        // A replay whose forward runs fewer pieces than were captured.
        let ctx = PieceCtx::new(&arena, desc, Phase::ReplayPieces, &[], &graphs);
        cases.push((
            "missing piece on replay",
            ctx.finish().map(|_| ()),
            names_desc,
            &["ran 0 pieces, but 1 were captured"],
        ));

        // A piecewise capture of a forward that runs no piece at all.
        let ctx = PieceCtx::new(&arena, desc, Phase::CapturePieces, &[], &[]);
        cases.push(("no piece to capture", ctx.finish().map(|_| ()), names_desc, &["num_tokens=8", "ran no piece"]));

        holdfast_hal::testing::check_errors(cases);
        assert!(!s.is_capturing());
    }

    #[test]
    fn a_splitting_op_output_outside_the_arena_names_the_op_and_the_buffer() {
        let (arena, s, _) = setup();
        let inside = arena.get::<f32>("attn out").expect("buffer").view().raw();
        let fresh = arena.device().alloc_persistent::<f32>("scratch out", 8).expect("fresh");
        let mut ctx = PieceCtx::eager(&arena, BatchDescriptor::unpadded(8));
        let r = ctx.splitting_op(&s, "attn3", &[inside, fresh.view().raw()], |_| panic!("must not run"));
        let Err(e) = r else { panic!("expected an error") };
        assert_eq!(e, GraphError::SplittingOpOutputNotPersistent { op: "attn3".into(), buffer: "scratch out".into() });
        let msg = e.to_string();
        assert!(msg.contains("`attn3`") && msg.contains("`scratch out`") && msg.contains("arena buffers"), "{msg}");
        assert_eq!(ctx.finish().map(|(_, c)| c.splitting_op_runs).ok(), Some(0));
    }
}
