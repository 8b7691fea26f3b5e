//! A synthetic forward of ~100 demo kernels over arena buffers, with two "attention" splitting ops
//! (gathers whose indices are rebuilt per step) and a lazily-planned kernel; shared by the runner
//! tests and the bench. `Bug` plants one capture bug at a time.
#![allow(dead_code)]

use std::sync::Arc;

use holdfast_graph::{
    BatchDescriptor, CaptureSizeConfig, CaptureSizes, Dispatcher, DispatcherConfig, Forward, GraphError, GraphMode,
    LoraConfig, PersistentArena, PieceCtx, RuntimeMode, StepKind,
};
use holdfast_hal::{demo_kernels, Arg, Buffer, Device, Kernel, LaunchConfig, RawView, Stream, View};

/// Layers (5 kernels each) per piece.
pub const LAYERS_PER_PIECE: usize = 6;
/// Workspace slots of `max_tokens` elements each.
const SLOTS: usize = 3;

/// The capture bug a [`Synthetic`] forward carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// Correct forward.
    None,
    /// `prepare` allocates a fresh (transient) buffer every step and a captured piece uses it.
    FreshBufferPerStep,
    /// The bound input view of `x` has the step's real length instead of the padded one.
    DataDependentView,
    /// The first attention op writes a freshly allocated buffer instead of an arena buffer.
    SplittingOpFreshOutput,
    /// Real steps forget to upload `x` (the graph would replay the previous step's input).
    ForgetsInput,
    /// Real steps skip the last piece (control flow that differs from the captured run).
    SkipsLastPieceInSteps,
}

struct Kernels {
    axpy: Kernel,
    scale: Kernel,
    add: Kernel,
    gather: Kernel,
    touch: Kernel,
}

/// The synthetic forward. Per token row `i` (rows are independent except through the gathers,
/// whose indices stay below the step's real token count): `h = x`, 6 layers, `attn = h[idx0]`,
/// `h = (attn + h) / 2 + plan`, 6 layers, `attn = h[idx1]`, `h = (attn + h) / 2`, 6 layers,
/// `out = h`. `plan` is computed from the per-step `meta` by a kernel that only runs when the
/// forward has no plan yet (a lazily initialised schedule, as FlashMLA's in #42444).
pub struct Synthetic {
    pub dev: Device,
    pub arena: Arc<PersistentArena>,
    k: Kernels,
    pub bug: Bug,
    host_x: Vec<f32>,
    step: u32,
    real: usize,
    planned: bool,
    fresh: Option<Buffer<f32>>,
    max_tokens: usize,
    /// Every `prepare` call: what for, and the descriptor.
    pub log: Vec<(StepKind, BatchDescriptor)>,
    /// Kernel launches of the last `run`.
    pub launches: usize,
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig::for_elements(n, 128)
}

impl Synthetic {
    /// Allocates the arena for `max_tokens` rows, locks it, compiles the demo kernels.
    pub fn new(dev: &Device, max_tokens: usize, bug: Bug) -> Result<Synthetic, GraphError> {
        let mut a = PersistentArena::new(dev);
        a.alloc_input::<f32>("x", max_tokens)?;
        a.alloc_input::<f32>("meta", max_tokens)?;
        a.alloc_input::<i32>("idx0", max_tokens)?;
        a.alloc_input::<i32>("idx1", max_tokens)?;
        for name in ["h", "plan", "attn", "out"] {
            a.alloc::<f32>(name, max_tokens)?;
        }
        a.alloc_workspace(SLOTS * max_tokens)?;
        a.lock();
        let m = dev.compile(demo_kernels::source())?;
        let k = Kernels {
            axpy: m.kernel("hf_axpy")?,
            scale: m.kernel("hf_scale")?,
            add: m.kernel("hf_add")?,
            gather: m.kernel("hf_gather")?,
            touch: m.kernel("hf_touch")?,
        };
        Ok(Synthetic {
            dev: dev.clone(),
            arena: Arc::new(a),
            k,
            bug,
            host_x: Vec::new(),
            step: 0,
            real: 0,
            planned: false,
            fresh: None,
            max_tokens,
            log: Vec::new(),
            launches: 0,
        })
    }

    /// Sets the next step's inputs: one value per real token, and a step number that varies the
    /// gather indices and the plan's metadata.
    pub fn set_step(&mut self, x: Vec<f32>, step: u32) {
        self.host_x = x;
        self.step = step;
    }

    /// Reads the first `n` rows of the output.
    pub fn read_out(&self, stream: &Stream, n: usize) -> Result<Vec<f32>, GraphError> {
        Ok(stream.copy_to_host_sync(&self.arena.view::<f32>("out", n)?)?)
    }
}

/// Views of one run, taken inside the region that uses them (so the arena sees them captured).
struct Views {
    n: usize,
    x: View<f32>,
    meta: View<f32>,
    h: View<f32>,
    plan: View<f32>,
    attn: View<f32>,
    out: View<f32>,
    ws: [View<f32>; SLOTS],
}

impl Views {
    fn new(a: &PersistentArena, n: usize, max_tokens: usize) -> Result<Views, GraphError> {
        let v = |name: &str| a.view::<f32>(name, n);
        Ok(Views {
            n,
            x: v("x")?,
            meta: v("meta")?,
            h: v("h")?,
            plan: v("plan")?,
            attn: v("attn")?,
            out: v("out")?,
            ws: [a.workspace_slice(0, n)?, a.workspace_slice(max_tokens, n)?, a.workspace_slice(2 * max_tokens, n)?],
        })
    }
}

fn launch(k: &Kernel, s: &Stream, n: usize, args: &[Arg], count: &mut usize) -> Result<(), GraphError> {
    *count += 1;
    Ok(s.launch(k, cfg(n), args)?)
}

impl Kernels {
    fn scale(
        &self,
        s: &Stream,
        x: &View<f32>,
        out: &View<f32>,
        c: f32,
        n: usize,
        cnt: &mut usize,
    ) -> Result<(), GraphError> {
        launch(&self.scale, s, n, &[x.into(), out.into(), c.into(), (n as u32).into()], cnt)
    }
    fn add(
        &self,
        s: &Stream,
        a: &View<f32>,
        b: &View<f32>,
        out: &View<f32>,
        n: usize,
        cnt: &mut usize,
    ) -> Result<(), GraphError> {
        launch(&self.add, s, n, &[a.into(), b.into(), out.into(), (n as u32).into()], cnt)
    }

    /// 5 kernels: `ws0 = c·h + x/4; ws1 = ws0 + h; h = ws1/2 + 1`.
    fn layers(&self, s: &Stream, v: &Views, first: usize, cnt: &mut usize) -> Result<(), GraphError> {
        let n = v.n;
        for l in first..first + LAYERS_PER_PIECE {
            let c = 0.5 + 0.01 * l as f32;
            self.scale(s, &v.h, &v.ws[0], c, n, cnt)?;
            launch(&self.axpy, s, n, &[(&v.x).into(), (&v.ws[0]).into(), 0.25f32.into(), (n as u32).into()], cnt)?;
            self.add(s, &v.ws[0], &v.h, &v.ws[1], n, cnt)?;
            self.scale(s, &v.ws[1], &v.h, 0.5, n, cnt)?;
            launch(&self.touch, s, n, &[(&v.h).into(), (n as u32).into()], cnt)?;
        }
        Ok(())
    }
}

impl Forward for Synthetic {
    fn prepare(&mut self, stream: &Stream, desc: &BatchDescriptor, kind: StepKind) -> Result<(), GraphError> {
        let n = desc.num_tokens as usize;
        self.log.push((kind, *desc));
        let (xs, meta, real) = match kind {
            StepKind::Step => {
                let real = self.host_x.len().min(n);
                let mut xs = self.host_x[..real].to_vec();
                xs.resize(n, 0.0);
                (xs, vec![0.125 * (1 + self.step % 7) as f32; n], real)
            }
            // Dummy inputs for warm-up and capture; dummy "lengths" give an all-zero plan.
            StepKind::WarmUp | StepKind::Capture => (vec![0.5; n], vec![0.0; n], n),
        };
        self.real = real;
        let a = &self.arena;
        if !(self.bug == Bug::ForgetsInput && kind == StepKind::Step) {
            stream.copy_from_host(&xs, &a.view::<f32>("x", n)?)?;
        }
        stream.copy_from_host(&meta, &a.view::<f32>("meta", n)?)?;
        for (k, name) in ["idx0", "idx1"].into_iter().enumerate() {
            let idx: Vec<i32> = (0..n)
                .map(|i| if i < real { ((i * (7 + 2 * k) + self.step as usize) % real) as i32 } else { -1 })
                .collect();
            stream.copy_from_host(&idx, &a.view::<i32>(name, n)?)?;
        }
        if self.bug == Bug::FreshBufferPerStep {
            self.fresh = Some(self.dev.alloc::<f32>("fresh per-step scratch", n)?);
        }
        Ok(())
    }

    fn graph_inputs(&self, desc: &BatchDescriptor) -> Result<Vec<(String, RawView)>, GraphError> {
        let n = desc.num_tokens as usize;
        let x_len = if self.bug == Bug::DataDependentView { self.real } else { n };
        let a = &self.arena;
        Ok(vec![
            ("x".into(), a.view::<f32>("x", x_len)?.raw()),
            ("meta".into(), a.view::<f32>("meta", n)?.raw()),
            ("idx0".into(), a.view::<i32>("idx0", n)?.raw()),
            ("idx1".into(), a.view::<i32>("idx1", n)?.raw()),
        ])
    }

    fn refresh_state(&mut self, _desc: &BatchDescriptor) -> Result<(), GraphError> {
        self.planned = false;
        Ok(())
    }

    fn run(
        &mut self,
        stream: &Stream,
        desc: &BatchDescriptor,
        _mode: RuntimeMode,
        pieces: &mut PieceCtx<'_>,
    ) -> Result<(), GraphError> {
        let n = desc.num_tokens as usize;
        let (a, t) = (pieces.arena(), self.max_tokens);
        let k = &self.k;
        let mut cnt = 0usize;
        pieces.piece(stream, |s| {
            let v = Views::new(a, n, t)?;
            k.scale(s, &v.x, &v.h, 1.0, n, &mut cnt)?;
            k.layers(s, &v, 0, &mut cnt)
        })?;

        let fresh_out = if self.bug == Bug::SplittingOpFreshOutput {
            Some(self.dev.alloc::<f32>("fresh attention output", n)?)
        } else {
            None
        };
        let attn_out = match &fresh_out {
            Some(b) => b.view(),
            None => a.view::<f32>("attn", n)?,
        };
        pieces.splitting_op(stream, "attn0", &[attn_out.raw()], |s| {
            let (h, idx) = (a.view::<f32>("h", n)?, a.view::<i32>("idx0", n)?);
            launch(&k.gather, s, n, &[(&h).into(), (&idx).into(), (&attn_out).into(), (n as u32).into()], &mut cnt)
        })?;

        let planned = &mut self.planned;
        let fresh = self.fresh.as_ref();
        pieces.piece(stream, |s| {
            let v = Views::new(a, n, t)?;
            k.add(s, &v.attn, &v.h, &v.ws[2], n, &mut cnt)?;
            k.scale(s, &v.ws[2], &v.h, 0.5, n, &mut cnt)?;
            if !*planned {
                // The lazily built "schedule": computed from this step's metadata on first use.
                k.scale(s, &v.meta, &v.plan, 1.0, n, &mut cnt)?;
                *planned = true;
            }
            k.add(s, &v.plan, &v.h, &v.ws[0], n, &mut cnt)?;
            k.scale(s, &v.ws[0], &v.h, 1.0, n, &mut cnt)?;
            if let Some(f) = fresh {
                let f = f.prefix(n)?;
                k.scale(s, &v.h, &f, 1.0, n, &mut cnt)?;
                k.scale(s, &f, &v.h, 1.0, n, &mut cnt)?;
            }
            k.layers(s, &v, LAYERS_PER_PIECE, &mut cnt)
        })?;

        pieces.splitting_op(stream, "attn1", &[a.view::<f32>("attn", n)?.raw()], |s| {
            let (h, idx, out) = (a.view::<f32>("h", n)?, a.view::<i32>("idx1", n)?, a.view::<f32>("attn", n)?);
            launch(&k.gather, s, n, &[(&h).into(), (&idx).into(), (&out).into(), (n as u32).into()], &mut cnt)
        })?;

        if self.bug == Bug::SkipsLastPieceInSteps && self.log.last().map(|l| l.0) == Some(StepKind::Step) {
            self.launches = cnt;
            return Ok(());
        }
        pieces.piece(stream, |s| {
            let v = Views::new(a, n, t)?;
            k.add(s, &v.attn, &v.h, &v.ws[2], n, &mut cnt)?;
            k.scale(s, &v.ws[2], &v.h, 0.5, n, &mut cnt)?;
            k.layers(s, &v, 2 * LAYERS_PER_PIECE, &mut cnt)?;
            k.scale(s, &v.h, &v.out, 1.0, n, &mut cnt)
        })?;
        self.launches = cnt;
        Ok(())
    }
}

/// Capture sizes and an initialised dispatcher for `mode` (query length 1, no LoRA).
pub fn dispatcher(mode: GraphMode, max_num_seqs: u32, max_tokens: u32) -> Result<Dispatcher, GraphError> {
    let sizes = CaptureSizes::build(&CaptureSizeConfig::new(mode, max_num_seqs, max_tokens))?;
    let mut d = Dispatcher::new(DispatcherConfig {
        capture_sizes: sizes,
        max_num_seqs,
        lora: LoraConfig::Disabled,
        attention_is_splitting_op: true,
    })?;
    d.initialize_keys(mode, 1)?;
    Ok(d)
}

/// A small xorshift generator (deterministic, no dependency).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        lo + (self.next() % u64::from(hi - lo + 1)) as u32
    }
    /// `n` values in `[-1, 1)`.
    pub fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next() % 2048) as f32 / 1024.0 - 1.0).collect()
    }
}
