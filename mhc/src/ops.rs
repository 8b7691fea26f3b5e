//! [`MhcOps`]: the launchers, their configuration and their workspace.

use holdfast_hal::{bf16, BackendKind, Buffer, Device, LaunchConfig, RawView, Stream, View};

use crate::error::{MhcError, Result};
use crate::kernels::MhcKernels;
use crate::params::{MhcOp, MhcPreParams};
use crate::plan::{self, Reduce};
use crate::reference::{splits, PRE_ROWS};
use crate::HC_MULT;

/// What an [`MhcOps`] is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MhcConfig {
    /// Residual streams `n` (config `hc_mult`); only 4 has kernels.
    pub hc_mult: usize,
    /// Hidden size `H` (4096 for V4-Flash, 7168 for V4-Pro); any `H >= 1` with `n·H <= 2^24`.
    pub hidden: usize,
    /// Most tokens `T` of one call (the largest captured size, or `max_num_batched_tokens`). Sizes
    /// the workspace: `max_tokens · S · 25` f32 of partials plus a `max_tokens · 5 · S` copy of the gate
    /// partials (`S = ceil(H / 256)`, rounded up to 4 there), and `1 + 2·max_tokens` u32.
    pub max_tokens: usize,
}

/// The kernel path of the split-reduction ops (`hc_head`, `mhc_pre`, `mhc_fused_post_pre`): the
/// tensor-core resident items, the portable projection + finish items, or (`hc_head`) thread-block
/// clusters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MhcProjection {
    /// What measured fastest on an H200: tensor cores for `mhc_pre` and the fused op (1.3–1.6×
    /// the portable path at T ≥ 1024); `hc_head` on thread-block clusters where the device runs
    /// them (NVIDIA sm_90+) and `H` fits (a multiple of 64 up to 4096, of 128 up to 8192), else
    /// the portable path (on an H200, against the portable path, clusters are faster at every T
    /// at H 4096, 1.43× at T 1024; at H 7168 at every T up to 4096, 0.91× at T 16384). On
    /// clusters, 8 blocks (16 past H 4096) each own `H/8` (`H/16`) of every stream, read the
    /// residual once and exchange their partial sums through distributed shared memory (f32 fused
    /// multiply-adds in their own fixed order, batch-invariant); the grid holds only the clusters
    /// the device runs at once ([`holdfast_hal::Device::max_active_clusters`], asked once in
    /// [`MhcOps::new`]), each taking tiles of 8 tokens in turn; residual, `fn` and output views
    /// that are not 16-byte aligned are copied and written element by element (the same bits).
    /// The portable path everywhere on devices without bf16 `mma.sync` and without clusters.
    #[default]
    Auto,
    /// Tensor cores for all three ops where the device has them (bf16 `mma.sync`, f32
    /// accumulation, each `fn` weight split into two bf16 terms that carry it to about 2⁻¹⁷
    /// relative).
    TensorCores,
    /// f32 fused multiply-adds in the CPU reference's order on every device.
    Portable,
}

/// How many launches `mhc_pre` and the fused op make on tensor cores (the portable path and
/// `hc_head` always make one; the CPU backend, which emulates the streamed projection, makes two
/// under [`MhcPasses::Two`] unless the portable path is chosen). Every choice gives the same
/// bits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MhcPasses {
    /// Two where every multiprocessor has enough work for them to pay (`T · ceil(H / 256)` at
    /// least 96 times the multiprocessors for `mhc_pre`, 48 times for the fused op: with 132
    /// multiprocessors from T = 1024 / 512 at H = 4096 and T = 512 / 256 at H = 7168), else one.
    #[default]
    Auto,
    /// One launch: resident items, each tile's items waiting for each other and keeping the
    /// tile's rows in shared memory (the residual is read once).
    One,
    /// Two launches: a streamed projection (at most one block per multiprocessor, each loading
    /// one split's weights once; partials only, and the fused op's updated residual), then finish
    /// blocks that read the (updated) residual again for `layer_input`. More bytes, no waits
    /// inside a launch.
    Two,
}

/// The weights of `hc_head` (§6.5), all f32.
#[derive(Clone, Copy, Debug)]
pub struct HcHeadWeights<'a> {
    /// `hc_head_fn [n, n·H]`.
    pub hc_fn: &'a View<f32>,
    /// `hc_head_scale [1]`.
    pub scale: &'a View<f32>,
    /// `hc_head_base [n]`.
    pub base: &'a View<f32>,
}

/// The weights of one `mhc_pre` (§6.2; per layer and sublayer: `hc_attn_*`, `hc_ffn_*`), all f32.
#[derive(Clone, Copy, Debug)]
pub struct MhcPreWeights<'a> {
    /// `fn [n(n+2), n·H]` (24 rows for `n = 4`): rows `[0, n)` pre, `[n, 2n)` post, then the `n×n`
    /// comb logits row-major.
    pub hc_fn: &'a View<f32>,
    /// `scale [3]`: pre, post, comb.
    pub scale: &'a View<f32>,
    /// `base [n(n+2)]`.
    pub base: &'a View<f32>,
}

/// Where `mhc_pre` (and the pre half of `mhc_fused_post_pre`) writes.
#[derive(Clone, Copy, Debug)]
pub struct MhcPreOutputs<'a> {
    /// `post [T, n]` f32.
    pub post: &'a View<f32>,
    /// `comb [T, n, n]` f32 (`comb[t][i][j]`: input stream `i` to output stream `j`).
    pub comb: &'a View<f32>,
    /// `layer_input [T, H]` bf16.
    pub layer_input: &'a View<bf16>,
}

/// The mHC ops on one device, for one [`MhcConfig`].
///
/// Every op takes caller-provided views (exact lengths for the call's `T`, derived from the
/// residual's length), validates them, and enqueues one kernel launch on the stream (none for
/// `T = 0`; two for `mhc_pre` and the fused op where they take [`MhcPasses::Two`], both on the
/// caller's stream). Launch shapes depend on `T` alone, so the ops are capturable: capture at a
/// padded `T` with views of persistent buffers and replay with fresh contents.
///
/// The split-reduction ops (`hc_head`, `mhc_pre`, `mhc_fused_post_pre`) share one persistent
/// workspace owned here. Launches on one stream are ordered and leave it ready for the next, but
/// two launches of the same `MhcOps` must not run concurrently on different streams: build one
/// `MhcOps` per stream.
#[derive(Debug)]
pub struct MhcOps {
    pub(crate) kernels: MhcKernels,
    pub(crate) config: MhcConfig,
    /// Multiprocessors (compute units) of the device, for the launch shapes.
    units: usize,
    /// The projection items' kernel path and tile (see [`MhcProjection`], [`MhcOps::with_tile_tokens`]).
    shape: plan::ReduceShape,
    /// The device runs bf16 `mma.sync`.
    has_mma: bool,
    /// The CPU backend: it emulates the streamed projection pass ([`MhcPasses::Two`] takes two
    /// passes there unless the portable path is chosen).
    emulates_stream: bool,
    /// Clusters of `hc_head` on thread-block clusters the device runs at once (0: that path does
    /// not run here: no clusters, or a hidden size that does not fit).
    pub(crate) head_cluster_slots: usize,
    /// `hc_head` runs on clusters ([`MhcProjection::Auto`] where it fits).
    head_clusters: bool,
    pub(crate) partials: Buffer<f32>,
    pub(crate) sync: Buffer<u32>,
}

impl MhcOps {
    /// Builds the ops for `config` on `device`: checks the configuration and allocates the
    /// workspace (persistent; the counters zeroed). Do this before capturing.
    pub fn new(device: &Device, kernels: &MhcKernels, config: MhcConfig) -> Result<Self> {
        if config.hc_mult != HC_MULT {
            return Err(MhcError::Unsupported(format!("hc_mult {} (kernels exist for 4 only)", config.hc_mult)));
        }
        if config.hidden == 0 || config.hidden.checked_mul(config.hc_mult).is_none_or(|d| d > 1 << 24) {
            return Err(MhcError::Unsupported(format!("hidden {} (need 1 <= n·H <= 2^24)", config.hidden)));
        }
        if u32::try_from(config.max_tokens).is_err() {
            return Err(MhcError::Unsupported(format!("max_tokens {} does not fit 32 bits", config.max_tokens)));
        }
        if kernels.module.device_id() != device.id() {
            return Err(MhcError::Hal(holdfast_hal::HalError::DeviceMismatch(
                "MhcOps::new: the kernels were compiled for another device".into(),
            )));
        }
        let t = config.max_tokens.max(1);
        let partials =
            device.alloc_persistent::<f32>("mhc.partials", plan::workspace_floats(t, splits(config.hidden)))?;
        let sync = device.alloc_zeroed::<u32>("mhc.sync", 1 + 2 * t, true)?;
        let units = (device.info().compute_units as usize).max(1);
        let has_mma = device.info().has_bf16_mma();
        let max_shared = device.info().max_shared_mem_per_block;
        let head_cluster_slots = if device.info().has_clusters() && plan::cluster_head_fits(config.hidden, max_shared) {
            let cluster = plan::cluster_blocks(config.hidden) as u32;
            device.max_active_clusters(&kernels.hc_head_cluster, plan::cluster_block(config.hidden), cluster)? as usize
        } else {
            0
        };
        let shape = plan::ReduceShape {
            mma: has_mma,
            head_mma: false,
            tile_tokens: None,
            max_shared,
            passes: MhcPasses::Auto,
            emulated_stream: device.info().backend == BackendKind::Cpu,
        };
        Ok(MhcOps {
            kernels: kernels.clone(),
            config,
            units,
            shape,
            has_mma,
            emulates_stream: shape.emulated_stream,
            head_cluster_slots,
            head_clusters: head_cluster_slots > 0,
            partials,
            sync,
        })
    }

    /// Chooses the split-reduction ops' kernel path ([`MhcProjection`]; `Auto` by default).
    pub fn with_projection(mut self, projection: MhcProjection) -> Self {
        self.shape.mma = projection != MhcProjection::Portable && self.has_mma;
        self.shape.head_mma = projection == MhcProjection::TensorCores && self.has_mma;
        self.head_clusters = projection == MhcProjection::Auto && self.head_cluster_slots > 0;
        self.shape.emulated_stream = projection != MhcProjection::Portable && self.emulates_stream;
        self
    }

    /// Whether `op` runs on thread-block clusters: `hc_head` under [`MhcProjection::Auto`] on a
    /// device with clusters, at a hidden size that fits.
    pub fn uses_clusters(&self, op: MhcOp) -> bool {
        op == MhcOp::HcHead && self.head_clusters
    }

    /// Whether `op` runs on tensor cores (resident items): its [`MhcProjection`] choice, on an
    /// sm_80+ device that holds twice the `ceil(H / 256)` blocks a tile's items need at once
    /// (every H up to 16896 on an H200) and whose blocks' shared memory holds one m-tile's stage.
    /// Never for `mhc_post`, which has no reduction.
    pub fn uses_tensor_cores(&self, op: MhcOp) -> bool {
        Reduce::of(op).is_some_and(|kind| {
            self.shape.mma_for(kind) && plan::resident_fits(kind, self.config.hidden, self.units, self.shape.max_shared)
        })
    }

    /// Chooses one launch or two for `mhc_pre` and the fused op on tensor cores ([`MhcPasses`];
    /// `Auto` by default). A tuning knob: every choice gives the same bits.
    pub fn with_passes(mut self, passes: MhcPasses) -> Self {
        self.shape.passes = passes;
        self
    }

    /// Forces the tokens per projection tile (`1..=128`; `None`: the plan's choice, a function of
    /// `T`, `H` and the multiprocessor count). A tuning knob: every tile gives the same bits (a
    /// token's reduction order depends on `H` alone). Fails outside `1..=128`.
    pub fn with_tile_tokens(mut self, tile_tokens: Option<usize>) -> Result<Self> {
        if let Some(t) = tile_tokens {
            if !(1..=128).contains(&t) {
                return Err(MhcError::Unsupported(format!("tile_tokens {t} (need 1..=128)")));
            }
        }
        self.shape.tile_tokens = tile_tokens;
        Ok(self)
    }

    /// The configuration.
    pub fn config(&self) -> &MhcConfig {
        &self.config
    }

    /// Bytes of device memory the workspace holds.
    pub fn workspace_bytes(&self) -> usize {
        self.partials.bytes() + self.sync.bytes()
    }

    /// Every launch `op` makes for `tokens` tokens, in order (none for 0; two where `mhc_pre` or
    /// the fused op takes [`MhcPasses::Two`]). A function of `tokens` for a given `MhcOps`.
    pub fn launch_configs(&self, op: MhcOp, tokens: usize) -> Vec<LaunchConfig> {
        let first = self.launch_config(op, tokens);
        let second = match Reduce::of(op) {
            Some(kind) if tokens > 0 && !self.uses_clusters(op) => self.reduce_plan(kind, tokens).finish,
            _ => None,
        };
        first.into_iter().chain(second).collect()
    }

    /// The (first) launch `op` makes for `tokens` tokens (`None` for 0: nothing is launched). A
    /// function of `tokens` for a given `MhcOps`, so every call at a padded size launches the same
    /// shape; [`Self::launch_configs`] gives the second where there is one.
    pub fn launch_config(&self, op: MhcOp, tokens: usize) -> Option<LaunchConfig> {
        if tokens == 0 {
            return None;
        }
        if self.uses_clusters(op) {
            return Some(plan::cluster_head(tokens, self.config.hidden, self.head_cluster_slots));
        }
        Some(match Reduce::of(op) {
            Some(kind) => self.reduce_plan(kind, tokens).config,
            None => plan::post(tokens, self.config.hidden).0,
        })
    }

    pub(crate) fn reduce_plan(&self, kind: Reduce, tokens: usize) -> plan::ReducePlan {
        plan::reduce(kind, tokens, self.config.hidden, self.units, self.shape)
    }

    /// Tokens of a residual view `[T, n, H]`, checked against `max_tokens`.
    pub(crate) fn tokens(&self, op: &'static str, residual: &View<bf16>) -> Result<usize> {
        let t = crate::reference::tokens_of(op, residual.len(), self.config.hidden)?;
        if t > self.config.max_tokens {
            return Err(MhcError::TooManyTokens { op, tokens: t, max_tokens: self.config.max_tokens });
        }
        Ok(t)
    }

    /// The second of the two passes ([`MhcPasses::Two`]) of `plan`, where it has one:
    /// `mhc_pre_finish_n4` on `rows [T, n, H]` (the residual the finish reads: `mhc_pre`'s input,
    /// the fused op's `residual_out`) and the projection's partials, into `out`.
    pub(crate) fn launch_finish(
        &self,
        stream: &Stream,
        plan: &plan::ReducePlan,
        rows: &View<bf16>,
        weights: &MhcPreWeights<'_>,
        params: &MhcPreParams,
        out: &MhcPreOutputs<'_>,
    ) -> Result<()> {
        let Some(config) = plan.finish else { return Ok(()) };
        stream.launch_dependent(
            &self.kernels.pre_finish,
            config,
            &[
                rows.into(),
                weights.scale.into(),
                weights.base.into(),
                out.post.into(),
                out.comb.into(),
                out.layer_input.into(),
                (&self.partials).into(),
                ((rows.len() / (HC_MULT * self.config.hidden)) as u32).into(),
                (self.config.hidden as u32).into(),
                params.rms_eps.into(),
                params.pre_eps.into(),
                params.sinkhorn_eps.into(),
                params.post_mult.into(),
                params.sinkhorn_iters.into(),
            ],
        )?;
        Ok(())
    }

    pub(crate) fn check_pre_weights(&self, op: &'static str, w: &MhcPreWeights<'_>) -> Result<()> {
        let d = HC_MULT * self.config.hidden;
        len(op, "hc_fn", w.hc_fn.len(), PRE_ROWS * d, || format!("[{PRE_ROWS}, {d}]"))?;
        len(op, "scale", w.scale.len(), 3, || "[3]".into())?;
        len(op, "base", w.base.len(), PRE_ROWS, || format!("[{PRE_ROWS}]"))
    }

    pub(crate) fn check_pre_outputs(&self, op: &'static str, t: usize, o: &MhcPreOutputs<'_>) -> Result<()> {
        let (n, h) = (HC_MULT, self.config.hidden);
        len(op, "post", o.post.len(), t * n, || format!("[T={t}, n={n}]"))?;
        len(op, "comb", o.comb.len(), t * n * n, || format!("[T={t}, n={n}, n={n}]"))?;
        len(op, "layer_input", o.layer_input.len(), t * h, || format!("[T={t}, H={h}]"))
    }
}

/// Checks a view's length.
pub(crate) fn len(
    op: &'static str,
    arg: &'static str,
    got: usize,
    expected: usize,
    shape: impl FnOnce() -> String,
) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(MhcError::Shape { op, arg, expected, got, shape: shape() })
    }
}

fn overlap(a: &RawView, b: &RawView) -> bool {
    let (a0, b0) = (a.addr(), b.addr());
    let (a1, b1) = (a0 + a.bytes() as u64, b0 + b.bytes() as u64);
    a.bytes() > 0 && b.bytes() > 0 && a0 < b1 && b0 < a1
}

/// Rejects any output that overlaps an input or another output. `in_place` names an (output,
/// input) pair that may be exactly the same view.
pub(crate) fn disjoint(
    op: &'static str,
    outputs: &[(&'static str, RawView)],
    inputs: &[(&'static str, RawView)],
    in_place: Option<(&'static str, &'static str)>,
) -> Result<()> {
    for (k, (oname, o)) in outputs.iter().enumerate() {
        for (iname, i) in inputs {
            let same = o.addr() == i.addr() && o.bytes() == i.bytes();
            if overlap(o, i) && !(same && in_place == Some((oname, iname))) {
                return Err(MhcError::Overlap { op, output: oname, input: iname });
            }
        }
        for (pname, p) in &outputs[..k] {
            if overlap(o, p) {
                return Err(MhcError::Overlap { op, output: oname, input: pname });
            }
        }
    }
    Ok(())
}
