//! The capture/replay engine for one forward function (DESIGN.md 4, "Graph runner").
//!
//! A [`Forward`] reads its inputs from, and writes its outputs to, persistent arena buffers; the
//! [`GraphRunner`] decides per step whether it runs eagerly, replays one FULL graph, or replays its
//! pieces around eager splitting ops. Start-up ([`GraphRunner::capture_all`]) walks the
//! dispatcher's keys in capture order (PIECEWISE before FULL, largest first); for each key it
//! runs `warmups` eager forwards, rebuilds the forward's per-step state
//! ([`Forward::refresh_state`], the #42444 lesson: whatever a kernel initialises lazily must be
//! initialised *inside* the capture, or the graph replays a stale plan forever), then captures.
//!
//! Who validates what: the HAL rejects anything illegal inside a capture (allocation, host reads,
//! non-persistent buffers) and checks bound input views at replay; the runner checks that a step's
//! descriptor is exactly a captured key, binds the forward's declared inputs at capture and hands
//! them back at every replay, aborts a failed capture so the stream stays usable, and counts
//! everything. Recaptures after start-up indicate a bug in the caller and are counted, never
//! hidden.
//!
//! ```
//! use std::sync::Arc;
//! use holdfast_graph::*;
//! use holdfast_hal::{demo_kernels, Device, Kernel, LaunchConfig, Stream};
//!
//! /// `y = 2·x` over `[num_tokens]` rows, one piece.
//! struct Double {
//!     arena: Arc<PersistentArena>,
//!     scale: Kernel,
//!     input: Vec<f32>,
//! }
//!
//! impl Forward for Double {
//!     fn prepare(&mut self, s: &Stream, d: &BatchDescriptor, kind: StepKind) -> Result<(), GraphError> {
//!         let n = d.num_tokens as usize;
//!         let mut x = if kind == StepKind::Step { self.input.clone() } else { Vec::new() };
//!         x.resize(n, 0.0); // pad to the graph's size
//!         Ok(s.copy_from_host(&x, &self.arena.view::<f32>("x", n)?)?)
//!     }
//!     fn run(&mut self, s: &Stream, d: &BatchDescriptor, _: RuntimeMode, p: &mut PieceCtx<'_>) -> Result<(), GraphError> {
//!         let (n, a, k) = (d.num_tokens as usize, p.arena(), &self.scale);
//!         p.piece(s, |s| {
//!             let (x, y) = (a.view::<f32>("x", n)?, a.view::<f32>("y", n)?);
//!             let args = [(&x).into(), (&y).into(), 2.0f32.into(), (n as u32).into()];
//!             Ok(s.launch(k, LaunchConfig::for_elements(n, 128), &args)?)
//!         })
//!     }
//! }
//!
//! let dev = Device::cpu()?;
//! let mut arena = PersistentArena::new(&dev);
//! arena.alloc::<f32>("x", 8)?;
//! arena.alloc::<f32>("y", 8)?;
//! arena.lock();
//! let arena = Arc::new(arena);
//! let scale = dev.compile(demo_kernels::source())?.kernel("hf_scale")?;
//!
//! let mut d = Dispatcher::new(DispatcherConfig {
//!     capture_sizes: CaptureSizes::new([4, 8])?,
//!     max_num_seqs: 8,
//!     lora: LoraConfig::Disabled,
//!     attention_is_splitting_op: true,
//! })?;
//! d.initialize_keys(GraphMode::Full, 1)?;
//! let fwd = Double { arena: arena.clone(), scale, input: Vec::new() };
//! let mut runner = GraphRunner::new(fwd, arena.clone(), &d, RunnerConfig::default())?;
//! let s = dev.create_stream()?;
//! runner.capture_all(&s, |done, total, desc| println!("captured {done}/{total}: {desc}"))?;
//!
//! runner.forward_mut().input = vec![1.0, 2.0, 3.0];
//! let (mode, desc) = d.dispatch(3, false, false, 0, ModeSet::ALL, ModeSet::EMPTY)?;
//! runner.execute(&s, mode, &desc)?; // replays the FULL graph captured for 4 tokens
//! assert_eq!((mode, desc.num_tokens), (RuntimeMode::Full, 4));
//! assert_eq!(s.copy_to_host_sync(&arena.view::<f32>("y", 3)?)?, vec![2.0, 4.0, 6.0]);
//! assert_eq!((runner.stats().replays(RuntimeMode::Full), runner.stats().recaptures), (1, 0));
//! # Ok::<(), GraphError>(())
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use holdfast_hal::{Graph, RawView, Stream};

use crate::arena::PersistentArena;
use crate::descriptor::BatchDescriptor;
use crate::dispatcher::Dispatcher;
use crate::error::GraphError;
use crate::mode::RuntimeMode;
use crate::piecewise::{Phase, PieceCtx, PiecewiseRunner};

/// Why [`Forward::prepare`] is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepKind {
    /// A real step: upload the caller's inputs.
    Step,
    /// An eager warm-up run before a capture: dummy inputs of the descriptor's shape.
    WarmUp,
    /// The run that is captured: dummy inputs of the descriptor's shape.
    Capture,
}

/// One forward function over persistent buffers, as the graph runner drives it.
///
/// Per step the runner calls, in order: [`refresh_state`](Self::refresh_state) (unless the step
/// replays a FULL graph), [`prepare`](Self::prepare) (always, outside any capture), then either
/// [`run`](Self::run) or a replay. Everything a graph reads must be in arena buffers whose views
/// depend only on the descriptor (padded sizes), never on the data.
pub trait Forward {
    /// Eager per-step work outside any graph: upload this step's inputs (or dummy inputs for
    /// warm-up and capture) into persistent buffers, build attention metadata. Host→device copies
    /// from pageable memory are legal here and nowhere else.
    fn prepare(&mut self, stream: &Stream, desc: &BatchDescriptor, kind: StepKind) -> Result<(), GraphError>;

    /// The views a graph of `desc` reads as inputs, by name: bound at capture
    /// ([`Stream::bind_input`]) and handed back at every replay, which the HAL rejects with
    /// `InputViewMismatch` if any differs. Default: none.
    fn graph_inputs(&self, desc: &BatchDescriptor) -> Result<Vec<(String, RawView)>, GraphError> {
        let _ = desc;
        Ok(Vec::new())
    }

    /// Discards per-step state (attention schedules, plans, lazily-initialised tables) so that
    /// the next [`run`](Self::run) initialises it again, as a new step would. Called before every
    /// eager or piecewise forward, and between warm-up and capture so the capture records the
    /// initialisation. Default: nothing to rebuild.
    fn refresh_state(&mut self, desc: &BatchDescriptor) -> Result<(), GraphError> {
        let _ = desc;
        Ok(())
    }

    /// The forward itself: launches on `stream`, pieces and splitting ops through `pieces`.
    /// `mode` is how this run executes (NONE for eager steps and warm-ups), so attention can pick
    /// its capture-safe path.
    fn run(
        &mut self,
        stream: &Stream,
        desc: &BatchDescriptor,
        mode: RuntimeMode,
        pieces: &mut PieceCtx<'_>,
    ) -> Result<(), GraphError>;
}

/// Settings of a [`GraphRunner`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerConfig {
    /// Eager runs before each capture (the reference's `cudagraph_num_of_warmups`, default 1).
    pub warmups: u32,
    /// Call [`Forward::refresh_state`] between warm-up and capture (default true). Turning it off
    /// reproduces the #42444 bug for tests; there is no other reason to.
    pub fresh_state_before_capture: bool,
    /// Capture a key on its first use instead of in [`GraphRunner::capture_all`] (default false).
    pub lazy_capture: bool,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig { warmups: 1, fresh_state_before_capture: true, lazy_capture: false }
    }
}

/// Counters of a [`GraphRunner`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RunnerStats {
    /// HAL graphs held: one per FULL key plus one per piece of each PIECEWISE key.
    pub graphs: usize,
    /// FULL graphs held.
    pub full_graphs: usize,
    /// PIECEWISE keys captured.
    pub piecewise_keys: usize,
    /// Wall-clock seconds spent in warm-up and capture.
    pub capture_seconds: f64,
    /// Bytes of the distinct arena buffers the graphs use: the graph memory, which does not grow
    /// with the number of graphs because they share the arena.
    pub graph_bytes: u64,
    /// Sum over graphs of the bytes each keeps alive (shared buffers counted once per graph): what
    /// graph memory would be if every graph had its own buffers.
    pub graph_retained_bytes_sum: u64,
    /// Bytes kept alive by the single largest graph (FULL graph, or one piece).
    pub largest_graph_bytes: u64,
    /// Steps per runtime mode (NONE: eager steps), indexed by `RuntimeMode as usize`.
    pub steps: [u64; 3],
    /// Piece graph replays inside PIECEWISE steps.
    pub piece_replays: u64,
    /// Splitting ops run eagerly inside PIECEWISE steps.
    pub splitting_op_runs: u64,
    /// Eager warm-up forwards before captures.
    pub warmup_runs: u64,
    /// Keys captured a second time (must stay 0 after start-up).
    pub recaptures: u64,
    /// Keys captured on first use (lazy capture).
    pub lazy_captures: u64,
}

impl RunnerStats {
    /// Steps run in `mode`: eager steps for NONE, graph replays otherwise.
    pub fn steps(&self, mode: RuntimeMode) -> u64 {
        self.steps[mode as usize]
    }

    /// Graph replay steps in `mode` (0 for NONE).
    pub fn replays(&self, mode: RuntimeMode) -> u64 {
        match mode {
            RuntimeMode::None => 0,
            m => self.steps(m),
        }
    }

    /// Eager (NONE) steps.
    pub fn eager_steps(&self) -> u64 {
        self.steps(RuntimeMode::None)
    }
}

/// Captures and replays the graphs of one [`Forward`] for a dispatcher's keys.
pub struct GraphRunner<F: Forward> {
    forward: F,
    arena: Arc<PersistentArena>,
    config: RunnerConfig,
    order: Vec<(RuntimeMode, BatchDescriptor)>,
    keys: HashSet<(RuntimeMode, BatchDescriptor)>,
    full: HashMap<BatchDescriptor, Graph>,
    piecewise: PiecewiseRunner,
    stats: RunnerStats,
}

impl<F: Forward> std::fmt::Debug for GraphRunner<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphRunner").field("config", &self.config).field("stats", &self.stats()).finish()
    }
}

impl<F: Forward> GraphRunner<F> {
    /// A runner for `forward` over `arena` (which must be locked) and the keys of `dispatcher`
    /// (which must be initialised). Captures nothing yet.
    pub fn new(
        forward: F,
        arena: Arc<PersistentArena>,
        dispatcher: &Dispatcher,
        config: RunnerConfig,
    ) -> Result<GraphRunner<F>, GraphError> {
        if !arena.is_locked() {
            return Err(GraphError::ArenaNotLocked);
        }
        let order: Vec<(RuntimeMode, BatchDescriptor)> = dispatcher
            .capture_descs()
            .into_iter()
            .flat_map(|(mode, descs)| descs.into_iter().map(move |d| (mode, d)))
            .collect();
        let keys = order.iter().copied().collect();
        Ok(GraphRunner {
            forward,
            arena,
            config,
            order,
            keys,
            full: HashMap::new(),
            piecewise: PiecewiseRunner::new(),
            stats: RunnerStats::default(),
        })
    }

    /// The forward.
    pub fn forward(&self) -> &F {
        &self.forward
    }
    /// The forward, to hand it a step's host inputs.
    pub fn forward_mut(&mut self) -> &mut F {
        &mut self.forward
    }
    /// The arena.
    pub fn arena(&self) -> &Arc<PersistentArena> {
        &self.arena
    }
    /// The settings.
    pub fn config(&self) -> &RunnerConfig {
        &self.config
    }
    /// Every key in capture order: PIECEWISE before FULL, largest first within each.
    pub fn capture_order(&self) -> &[(RuntimeMode, BatchDescriptor)] {
        &self.order
    }
    /// The piecewise graphs.
    pub fn piecewise(&self) -> &PiecewiseRunner {
        &self.piecewise
    }
    /// The FULL graph of `desc` (exact key), if captured.
    pub fn full_graph(&self, desc: &BatchDescriptor) -> Option<&Graph> {
        self.full.get(desc)
    }
    /// Whether the graph(s) of `(mode, desc)` are captured.
    pub fn is_captured(&self, mode: RuntimeMode, desc: &BatchDescriptor) -> bool {
        match mode {
            RuntimeMode::None => false,
            RuntimeMode::Piecewise => self.piecewise.pieces(desc).is_some(),
            RuntimeMode::Full => self.full.contains_key(desc),
        }
    }

    /// Counters, with graph memory computed now.
    pub fn stats(&self) -> RunnerStats {
        let full_bytes = self.full.values().map(Graph::retained_bytes);
        let mut s = self.stats;
        s.full_graphs = self.full.len();
        s.piecewise_keys = self.piecewise.descriptor_count();
        s.graphs = self.full.len() + self.piecewise.graph_count();
        s.graph_retained_bytes_sum = full_bytes.clone().sum::<u64>() + self.piecewise.retained_bytes_sum();
        s.largest_graph_bytes = full_bytes.max().unwrap_or(0).max(self.piecewise.max_retained_bytes());
        s.graph_bytes = self.arena.captured_bytes() as u64;
        s
    }

    /// Captures every key in capture order, calling `progress(done, total, desc)` after each.
    /// Start-up only: a key captured already is captured again and counted as a recapture.
    pub fn capture_all(
        &mut self,
        stream: &Stream,
        mut progress: impl FnMut(usize, usize, &BatchDescriptor),
    ) -> Result<(), GraphError> {
        let order = self.order.clone();
        for (i, (mode, desc)) in order.iter().enumerate() {
            self.capture(stream, *mode, desc)?;
            progress(i + 1, order.len(), desc);
        }
        Ok(())
    }

    /// Warms up and captures the graph(s) of one key. Errors are wrapped in
    /// [`GraphError::CaptureFailed`]; on error the stream is left idle and no graph is stored.
    pub fn capture(&mut self, stream: &Stream, mode: RuntimeMode, desc: &BatchDescriptor) -> Result<(), GraphError> {
        if !self.keys.contains(&(mode, *desc)) {
            return Err(GraphError::UnknownGraphKey { mode, desc: *desc });
        }
        let t0 = Instant::now();
        let result = self.capture_inner(stream, mode, desc);
        self.stats.capture_seconds += t0.elapsed().as_secs_f64();
        if stream.is_capturing() {
            let _ = stream.abort_capture();
        }
        result.map_err(|e| GraphError::CaptureFailed { mode, desc: *desc, source: Box::new(e) })
    }

    fn capture_inner(&mut self, stream: &Stream, mode: RuntimeMode, desc: &BatchDescriptor) -> Result<(), GraphError> {
        let arena = &*self.arena;
        for _ in 0..self.config.warmups {
            self.forward.refresh_state(desc)?;
            self.forward.prepare(stream, desc, StepKind::WarmUp)?;
            let mut ctx = PieceCtx::new(arena, *desc, Phase::Eager, &[], &[]);
            self.forward.run(stream, desc, RuntimeMode::None, &mut ctx)?;
            ctx.finish()?;
            stream.synchronize()?;
            self.stats.warmup_runs += 1;
        }
        if self.config.fresh_state_before_capture || self.config.warmups == 0 {
            self.forward.refresh_state(desc)?;
        }
        self.forward.prepare(stream, desc, StepKind::Capture)?;
        let inputs = self.forward.graph_inputs(desc)?;
        let replaced = match mode {
            RuntimeMode::None => return Err(GraphError::UnknownGraphKey { mode, desc: *desc }),
            RuntimeMode::Full => {
                stream.begin_capture(&format!("full {desc}"))?;
                for (name, view) in &inputs {
                    arena.note_captured(view);
                    stream.bind_input(name, view.clone())?;
                }
                let mut ctx = PieceCtx::new(arena, *desc, Phase::CaptureFull, &[], &[]);
                self.forward.run(stream, desc, RuntimeMode::Full, &mut ctx)?;
                ctx.finish()?;
                let graph = stream.end_capture()?;
                self.full.insert(*desc, graph).is_some()
            }
            RuntimeMode::Piecewise => {
                let mut ctx = PieceCtx::new(arena, *desc, Phase::CapturePieces, &inputs, &[]);
                self.forward.run(stream, desc, RuntimeMode::Piecewise, &mut ctx)?;
                let (graphs, _) = ctx.finish()?;
                self.piecewise.insert(*desc, graphs)
            }
        };
        stream.synchronize()?;
        if replaced {
            self.stats.recaptures += 1;
        }
        Ok(())
    }

    /// Runs one step as `(mode, desc)`, as [`Dispatcher::dispatch`] chose: eagerly for NONE (with
    /// `desc` unpadded), else by replaying the graph(s) whose key equals `desc` exactly, after
    /// checking the forward's input views against those recorded at capture. A key not captured
    /// yet is captured now under lazy capture, and is [`GraphError::GraphNotCaptured`] otherwise.
    pub fn execute(&mut self, stream: &Stream, mode: RuntimeMode, desc: &BatchDescriptor) -> Result<(), GraphError> {
        if mode != RuntimeMode::None {
            if !self.keys.contains(&(mode, *desc)) {
                return Err(GraphError::UnknownGraphKey { mode, desc: *desc });
            }
            if !self.is_captured(mode, desc) {
                if !self.config.lazy_capture {
                    return Err(GraphError::GraphNotCaptured { mode, desc: *desc });
                }
                self.capture(stream, mode, desc)?;
                self.stats.lazy_captures += 1;
            }
        }
        let arena = &*self.arena;
        match mode {
            RuntimeMode::None => {
                self.forward.refresh_state(desc)?;
                self.forward.prepare(stream, desc, StepKind::Step)?;
                let mut ctx = PieceCtx::new(arena, *desc, Phase::Eager, &[], &[]);
                self.forward.run(stream, desc, RuntimeMode::None, &mut ctx)?;
                ctx.finish()?;
            }
            RuntimeMode::Full => {
                self.forward.prepare(stream, desc, StepKind::Step)?;
                let inputs = self.forward.graph_inputs(desc)?;
                let given: Vec<(&str, RawView)> = inputs.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
                let graph = self.full.get(desc).ok_or(GraphError::GraphNotCaptured { mode, desc: *desc })?;
                graph.replay_with_inputs(stream, &given)?;
            }
            RuntimeMode::Piecewise => {
                self.forward.refresh_state(desc)?;
                self.forward.prepare(stream, desc, StepKind::Step)?;
                let inputs = self.forward.graph_inputs(desc)?;
                let mut ctx = self
                    .piecewise
                    .replay_ctx(arena, *desc, &inputs)
                    .ok_or(GraphError::GraphNotCaptured { mode, desc: *desc })?;
                self.forward.run(stream, desc, RuntimeMode::Piecewise, &mut ctx)?;
                let (_, counts) = ctx.finish()?;
                self.stats.piece_replays += counts.piece_replays;
                self.stats.splitting_op_runs += counts.splitting_op_runs;
            }
        }
        self.stats.steps[mode as usize] += 1;
        Ok(())
    }

    /// Gives the forward back, dropping the graphs.
    pub fn into_forward(self) -> F {
        self.forward
    }
}
