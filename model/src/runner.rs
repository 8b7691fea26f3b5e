//! [`ModelRunner`]: the model, its graphs and its dispatcher, one step at a time; and
//! [`ModelRunner::serve`], which drives a [`Scheduler`] until every request finishes.

use std::collections::BTreeMap;
use std::time::Instant;

use holdfast_graph::{
    resolve, BatchDescriptor, CaptureSizeConfig, CaptureSizes, CgSupport, DispatchStats, Dispatcher, DispatcherConfig,
    FallbackReason, GraphMode, GraphRunner, LoraConfig, ModeSet, ResolveContext, Resolved, RunnerConfig, RunnerStats,
    RuntimeMode,
};
use holdfast_hal::{Communicator, Device, Stream};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::forward::{sample_rows, ForwardLimits, ModelForward};
use crate::kv::{KvConfig, KvManager};
use crate::scheduler::{Finished, Request, Scheduler, SchedulerConfig, Step};
use crate::weights::{SeededInit, Shard, WeightSource, Weights};

/// Tokens per block of the SWA cache (DeepSeek-V4).
pub const SWA_BLOCK_SIZE: usize = 64;
/// Uncompressed tokens per block of the main (compressed) cache (DeepSeek-V4).
pub const KV_BLOCK_SIZE: usize = 256;

/// How the runner is built.
#[derive(Clone, Debug, PartialEq)]
pub struct RunnerSettings {
    /// The configured graph mode (resolved against the model's attention support).
    pub graph_mode: GraphMode,
    /// Most requests in one step.
    pub max_num_seqs: usize,
    /// Most tokens in one step.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + generated), in tokens.
    pub max_model_len: usize,
    /// Explicit capture sizes, in tokens (default: the reference's list up to the limits).
    pub capture_sizes: Option<Vec<u32>>,
    /// Largest capture size, in tokens.
    pub max_capture_size: Option<u32>,
    /// Main-cache blocks of 256 tokens (the null block included); default: enough for every
    /// request at `max_model_len`. The SWA cache gets 4× as many blocks of 64 tokens.
    pub kv_num_blocks: Option<usize>,
    /// Seed of the deterministic weights.
    pub seed: u64,
    /// Longest prefill chunk of one request per step (0: only the token budget limits it).
    pub long_prefill_token_threshold: usize,
    /// Blocks sharing each attention row on the warpgroup attention kernel (NVIDIA sm_90a,
    /// head_dim 512, at least 64 heads): one of 1, 2, 4 or 8. `None` picks from `max_num_seqs`:
    /// 1 where that many rows fill the device without splitting (at least three quarters of its
    /// multiprocessors busy with one block per row and 64-head group; see
    /// `holdfast_attention::SparseAttention::throughput_split`), else the kernel's default (2).
    /// More blocks cut one request's latency over long contexts (at 1M tokens, 64 heads, one
    /// row: about 3× faster with 8 than with 2 on an H100) and cost throughput from about 64
    /// rows (1.25–1.4× slower with 8 at 64–256 rows when last measured across splits). Fixed for
    /// the runner, so a row's output never depends on its batch. An error (when given) where the
    /// device does not run that kernel.
    pub attention_row_split: Option<usize>,
}

impl Default for RunnerSettings {
    fn default() -> Self {
        RunnerSettings {
            graph_mode: GraphMode::FullAndPiecewise,
            max_num_seqs: 16,
            max_num_batched_tokens: 128,
            max_model_len: 1024,
            capture_sizes: None,
            max_capture_size: None,
            kv_num_blocks: None,
            seed: 0,
            long_prefill_token_threshold: 0,
            attention_row_split: None,
        }
    }
}

/// What one step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepResult {
    /// The sampled token of each sampling request, in the step's request order.
    pub tokens: Vec<i32>,
    /// How the step ran.
    pub mode: RuntimeMode,
    /// The descriptor it ran with (padded for graph steps).
    pub desc: BatchDescriptor,
    /// Why it ran eagerly, if it did.
    pub fallback: Option<FallbackReason>,
    /// Host time to dispatch, stage and enqueue the step, in seconds (excludes waiting for the
    /// device).
    pub host_seconds: f64,
    /// Host time including the wait for the sampled tokens, in seconds.
    pub total_seconds: f64,
}

/// What [`ModelRunner::serve`] produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServeReport {
    /// Generated tokens per request id.
    pub outputs: BTreeMap<u64, Vec<i32>>,
    /// Steps run.
    pub steps: u64,
    /// Tokens processed (prefill + decode), generated tokens.
    pub tokens_processed: u64,
    /// Tokens generated.
    pub tokens_generated: u64,
    /// Per-step wall time, in seconds, in order.
    pub step_seconds: Vec<f64>,
    /// Steps per runtime mode (NONE, PIECEWISE, FULL).
    pub steps_per_mode: [u64; 3],
    /// Preemptions the scheduler made.
    pub preemptions: u64,
    /// Wall time of the whole run, in seconds.
    pub seconds: f64,
}

/// What a runner's settings give before any device memory is allocated.
struct Plan {
    kv: KvConfig,
    resolved: Resolved,
    dispatcher: Dispatcher,
}

/// The model with its graphs: dispatch, stage, run or replay, sample.
pub struct ModelRunner {
    stream: Stream,
    runner: GraphRunner<ModelForward>,
    dispatcher: Dispatcher,
    resolved: Resolved,
    kv: KvConfig,
    settings: RunnerSettings,
}

impl std::fmt::Debug for ModelRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRunner").field("mode", &self.resolved.mode).field("settings", &self.settings).finish()
    }
}

fn setting(setting: &'static str, detail: impl Into<String>) -> ModelError {
    ModelError::Setting { setting, detail: detail.into() }
}

/// The attention support the model declares: every token is a row of the ragged kernels and
/// every view depends on the padded row count alone (see [`crate::forward`]).
pub const MODEL_CG_SUPPORT: CgSupport = CgSupport::Always;

impl ModelRunner {
    /// Builds the model with seeded weights on `dev`.
    pub fn new(dev: &Device, cfg: &ModelConfig, settings: &RunnerSettings) -> Result<Self> {
        Self::with_weights(dev, cfg, settings, &mut SeededInit { seed: settings.seed })
    }

    /// Builds the model with weights from `src`.
    pub fn with_weights(
        dev: &Device,
        cfg: &ModelConfig,
        settings: &RunnerSettings,
        src: &mut dyn WeightSource,
    ) -> Result<Self> {
        Self::build(dev, cfg, settings, src, None)
    }

    /// Builds one rank of a tensor-parallel group on `comm`'s device: the rank's shard of the
    /// seeded weights ([`Weights::load_shard`]) and a forward whose row-parallel projections
    /// all-reduce over `comm` ([`ModelForward::new_tp`]). Every rank must be built with the
    /// same `cfg` and `settings` and then driven with the same steps in the same order, each
    /// from its own thread (the collectives wait for every rank); [`serve_tensor_parallel`]
    /// does that.
    pub fn tensor_parallel(cfg: &ModelConfig, settings: &RunnerSettings, comm: Communicator) -> Result<Self> {
        let dev = comm.device().clone();
        Self::build(&dev, cfg, settings, &mut SeededInit { seed: settings.seed }, Some(comm))
    }

    /// Checks `settings` against `cfg` as building a runner does (the model config, the step
    /// limits, the graph mode's resolution, the capture sizes and the dispatcher's keys), without
    /// a device: every settings error [`ModelRunner::new`] would return for them, before any
    /// work starts.
    pub fn check(cfg: &ModelConfig, settings: &RunnerSettings) -> Result<()> {
        Self::plan(cfg, settings).map(|_| ())
    }

    /// The KV layout, resolved mode and dispatcher (with its capture sizes and keys) `settings`
    /// give for `cfg`, validated.
    fn plan(cfg: &ModelConfig, settings: &RunnerSettings) -> Result<Plan> {
        cfg.validate()?;
        let s = settings;
        if s.max_num_seqs == 0 || s.max_num_seqs > s.max_num_batched_tokens {
            return Err(setting(
                "max_num_seqs",
                format!("must lie in [1, max_num_batched_tokens {}], got {}", s.max_num_batched_tokens, s.max_num_seqs),
            ));
        }
        if s.max_num_batched_tokens > u32::MAX as usize / 2 {
            return Err(setting("max_num_batched_tokens", "must fit in 31 bits"));
        }
        if s.max_model_len == 0 || s.max_model_len > cfg.max_position_embeddings {
            return Err(setting(
                "max_model_len",
                format!(
                    "must lie in [1, max_position_embeddings {}], got {}",
                    cfg.max_position_embeddings, s.max_model_len
                ),
            ));
        }
        if let Some(split) = s.attention_row_split {
            if !holdfast_attention::WG_SPLITS.contains(&split) {
                return Err(setting(
                    "attention_row_split",
                    format!("must be one of {:?}, got {split}", holdfast_attention::WG_SPLITS),
                ));
            }
        }
        // Every ragged attention list holds max_num_batched_tokens rows of its width: checked here,
        // before anything is built (the builders apply the same bound when they allocate).
        let widths = [
            ("the SWA lists (sliding_window)", cfg.sliding_window, true),
            ("the c128a lists", holdfast_attention::c128a_max_compressed(s.max_model_len), cfg.has_c128a()),
            ("the c4a lists (index_topk)", cfg.index_topk, cfg.has_c4a()),
        ];
        for (what, width, used) in widths {
            if used {
                holdfast_attention::ragged_capacity(what, s.max_num_batched_tokens, width)
                    .map_err(|e| setting("max_num_batched_tokens", e.to_string()))?;
            }
        }
        let bps_kv = s.max_model_len.div_ceil(KV_BLOCK_SIZE);
        let bps_swa = s.max_model_len.div_ceil(SWA_BLOCK_SIZE);
        // Every sequence's blocks plus the null block by default; at least 2, and few enough that
        // every SWA block id (4 per KV block) fits an i32.
        let kv_blocks = s.kv_num_blocks.unwrap_or_else(|| s.max_num_seqs.saturating_mul(bps_kv).saturating_add(1));
        let max_blocks = (i32::MAX as usize - 1) / (KV_BLOCK_SIZE / SWA_BLOCK_SIZE);
        if kv_blocks < 2 || kv_blocks > max_blocks {
            return Err(setting(
                "kv_num_blocks",
                format!(
                    "needs 2 to {max_blocks} blocks (one is the null block; block ids are 32-bit), got {kv_blocks}{}",
                    if s.kv_num_blocks.is_none() { " (max_num_seqs · ceil(max_model_len / 256) + 1)" } else { "" }
                ),
            ));
        }
        let kv = KvConfig {
            swa_block_size: SWA_BLOCK_SIZE,
            swa_num_blocks: (kv_blocks - 1) * (KV_BLOCK_SIZE / SWA_BLOCK_SIZE) + 1,
            kv_block_size: KV_BLOCK_SIZE,
            kv_num_blocks: kv_blocks,
            max_blocks_per_seq_swa: bps_swa,
            max_blocks_per_seq_kv: bps_kv,
        };
        let resolved = resolve(
            s.graph_mode,
            MODEL_CG_SUPPORT,
            &ResolveContext {
                backend: "holdfast ragged sparse MLA",
                uniform_decode_query_len: 1,
                attention_is_splitting_op: true,
            },
        )?;
        // Checked in every mode, `none` included (which captures nothing but takes the same list).
        if s.capture_sizes.iter().flatten().any(|&z| z == 0) {
            return Err(setting("capture_sizes", "size 0: a graph serves at least one token".to_string()));
        }
        if let Some(&big) = s.capture_sizes.iter().flatten().find(|&&z| z as usize > s.max_num_batched_tokens) {
            return Err(setting(
                "capture_sizes",
                format!(
                    "size {big} exceeds max_num_batched_tokens {}: a graph can never serve more tokens than a step holds",
                    s.max_num_batched_tokens
                ),
            ));
        }
        let mut size_cfg =
            CaptureSizeConfig::new(resolved.mode, s.max_num_seqs as u32, s.max_num_batched_tokens as u32);
        size_cfg.capture_sizes = s.capture_sizes.clone();
        size_cfg.max_capture_size = s.max_capture_size;
        let sizes =
            if resolved.mode == GraphMode::None { CaptureSizes::empty() } else { CaptureSizes::build(&size_cfg)? };
        if let Some(&big) = sizes.sizes().iter().find(|&&z| z as usize > s.max_num_batched_tokens) {
            return Err(setting(
                "capture_sizes",
                format!("size {big} exceeds max_num_batched_tokens {}", s.max_num_batched_tokens),
            ));
        }
        let mut dispatcher = Dispatcher::new(DispatcherConfig {
            capture_sizes: sizes,
            max_num_seqs: s.max_num_seqs as u32,
            lora: LoraConfig::Disabled,
            attention_is_splitting_op: true,
        })?;
        dispatcher.initialize_keys(resolved.mode, 1)?;
        Ok(Plan { kv, resolved, dispatcher })
    }

    fn build(
        dev: &Device,
        cfg: &ModelConfig,
        settings: &RunnerSettings,
        src: &mut dyn WeightSource,
        tp: Option<Communicator>,
    ) -> Result<Self> {
        let Plan { kv, resolved, dispatcher } = Self::plan(cfg, settings)?;
        let s = settings;
        let shard = tp.as_ref().map_or(Shard::WHOLE, |c| Shard { rank: c.rank(), size: c.size() });
        let weights = Weights::load_shard(dev, cfg, src, shard)?;
        let limits = ForwardLimits {
            max_num_batched_tokens: s.max_num_batched_tokens,
            max_num_seqs: s.max_num_seqs,
            max_model_len: s.max_model_len,
        };
        let mut forward = ModelForward::new_tp(dev, cfg, weights, limits, kv.swa_table(), kv.kv_table(), tp)?;
        // Fixed for the runner (never per step), so a row's output never depends on its batch.
        // Unset, the split changes only where the throughput split differs from the kernel's.
        let attn = forward.sparse_attention();
        let split = s
            .attention_row_split
            .or_else(|| Some(attn.throughput_split(s.max_num_seqs)).filter(|&n| n != attn.warpgroup_split()));
        if let Some(n) = split {
            forward.set_attention_row_split(dev, n)?;
        }
        let arena = forward.arena().clone();
        let runner = GraphRunner::new(forward, arena, &dispatcher, RunnerConfig::default())?;
        Ok(ModelRunner { stream: dev.create_stream()?, runner, dispatcher, resolved, kv, settings: s.clone() })
    }

    /// The resolved graph mode and the downgrades applied to the configured one.
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }

    /// The settings.
    pub fn settings(&self) -> &RunnerSettings {
        &self.settings
    }

    /// The shape of the KV caches (what a [`KvManager`] for this runner must use).
    pub fn kv_config(&self) -> KvConfig {
        self.kv
    }

    /// A scheduler over a fresh block manager for this runner's caches.
    pub fn scheduler(&self) -> Result<Scheduler> {
        let s = &self.settings;
        Ok(Scheduler::new(
            SchedulerConfig {
                max_num_seqs: s.max_num_seqs,
                max_num_batched_tokens: s.max_num_batched_tokens,
                max_model_len: s.max_model_len,
                long_prefill_token_threshold: s.long_prefill_token_threshold,
                vocab_size: self.runner.forward().config().vocab_size,
            },
            KvManager::new(self.kv)?,
        )?)
    }

    /// The forward (weights, arena, caches).
    pub fn forward(&self) -> &ModelForward {
        self.runner.forward()
    }

    /// Graph counters.
    pub fn stats(&self) -> RunnerStats {
        self.runner.stats()
    }

    /// Dispatch counters.
    pub fn dispatch_stats(&self) -> &DispatchStats {
        self.dispatcher.stats()
    }

    /// Graph keys to capture, in capture order.
    pub fn capture_order(&self) -> &[(RuntimeMode, BatchDescriptor)] {
        self.runner.capture_order()
    }

    /// Captures every graph key (PIECEWISE first, largest first), calling
    /// `progress(done, total, desc)` after each. Returns the seconds it took.
    pub fn capture_all(&mut self, progress: impl FnMut(usize, usize, &BatchDescriptor)) -> Result<f64> {
        let t0 = Instant::now();
        self.runner.capture_all(&self.stream, progress)?;
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Runs one scheduled step: dispatch, stage, run or replay, and read the sampled tokens.
    pub fn execute(&mut self, step: &Step) -> Result<StepResult> {
        let t0 = Instant::now();
        let n = step.num_tokens();
        let limits = self.runner.forward().limits();
        if n == 0 || n > limits.max_num_batched_tokens || step.num_reqs() > limits.max_num_seqs {
            return Err(ModelError::Step(format!(
                "a step of {n} tokens / {} requests; this runner takes 1 to {} tokens and at most {} requests",
                step.num_reqs(),
                limits.max_num_batched_tokens,
                limits.max_num_seqs
            )));
        }
        let d = self.dispatcher.dispatch_detailed(
            n as u32,
            step.is_uniform_decode(),
            false,
            0,
            ModeSet::EMPTY,
            ModeSet::EMPTY,
        )?;
        self.runner.forward_mut().stage_step(step, d.descriptor.num_tokens as usize)?;
        // Updates too large for the captured upload's fixed-size part go out eagerly first.
        self.runner.forward().apply_pending_table_updates(&self.stream)?;
        self.runner.execute(&self.stream, d.mode, &d.descriptor)?;
        let host_seconds = t0.elapsed().as_secs_f64();
        let rows = step.num_sampling();
        debug_assert!(rows <= sample_rows(d.descriptor.num_tokens as usize, limits.max_num_seqs));
        // Reading the tokens waits for the step (also when it samples nothing): the next step
        // stages its inputs into the same mapped memory the step's kernels read in place.
        let tokens = self.runner.forward().read_tokens(&self.stream, rows)?;
        if rows == 0 {
            self.stream.synchronize()?;
        }
        Ok(StepResult {
            tokens,
            mode: d.mode,
            desc: d.descriptor,
            fallback: d.fallback,
            host_seconds,
            total_seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// The logits `[rows, vocab]` of the last step's first `rows` sampling requests (syncs).
    pub fn logits(&self, rows: usize) -> Result<Vec<f32>> {
        self.runner.forward().read_logits(&self.stream, rows)
    }

    /// Runs `requests` to completion through a fresh scheduler with continuous batching and
    /// chunked prefill; `on_step(step, result)` sees every step.
    pub fn serve(
        &mut self,
        requests: Vec<Request>,
        mut on_step: impl FnMut(&Step, &StepResult),
    ) -> Result<ServeReport> {
        let t0 = Instant::now();
        let mut sched = self.scheduler()?;
        for r in requests {
            sched.add(r)?;
        }
        let mut rep = ServeReport::default();
        while let Some(step) = sched.schedule()? {
            let t = Instant::now();
            let res = match self.execute(&step) {
                Ok(r) => r,
                Err(e) => {
                    sched.abort_step();
                    return Err(e);
                }
            };
            on_step(&step, &res);
            rep.steps += 1;
            rep.tokens_processed += step.num_tokens() as u64;
            rep.tokens_generated += res.tokens.len() as u64;
            rep.steps_per_mode[res.mode as usize] += 1;
            for Finished { id, tokens, .. } in sched.update(&step, &res.tokens)? {
                rep.outputs.insert(id, tokens);
            }
            rep.step_seconds.push(t.elapsed().as_secs_f64());
        }
        rep.preemptions = sched.num_preemptions();
        rep.seconds = t0.elapsed().as_secs_f64();
        Ok(rep)
    }
}

/// One step as one tensor-parallel rank ran it: the runtime mode, the dispatched descriptor and
/// the sampled tokens.
pub type RankStep = (RuntimeMode, BatchDescriptor, Vec<i32>);

/// What [`serve_tensor_parallel`] did.
#[derive(Clone, Debug)]
pub struct TensorParallelReport {
    /// Ranks in the group.
    pub ranks: usize,
    /// Rank 0's serving report (every rank's outputs are checked equal to it).
    pub report: ServeReport,
    /// Every step as the ranks ran it (checked equal on every rank).
    pub steps: Vec<RankStep>,
    /// Seconds each rank took to capture its graphs, by rank.
    pub capture_seconds: Vec<f64>,
}

/// Serves `requests` tensor-parallel over `devices` (rank i on `devices[i]`, one thread per rank;
/// on the CPU backend the ranks are emulated in this process): every rank builds its shard of
/// the seeded model, captures its graphs (the ranks in lockstep: warm-up runs execute the
/// collectives) and runs the same deterministic scheduler, so every step is dispatched to the
/// same descriptor on every rank. Afterwards the ranks' steps (mode, descriptor, sampled tokens)
/// and outputs are compared: any difference is an error naming the step and the rank. A rank
/// that fails makes the others fail too (their next collective times out); the first error that
/// is not a collective's is returned.
pub fn serve_tensor_parallel(
    devices: &[Device],
    cfg: &ModelConfig,
    settings: &RunnerSettings,
    requests: Vec<Request>,
) -> Result<TensorParallelReport> {
    cfg.validate_tp(devices.len().max(1))?;
    let comms = Communicator::group(devices)?;
    let ranks = comms.len();
    let results: Vec<Result<(ServeReport, Vec<RankStep>, f64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let requests = requests.clone();
                scope.spawn(move || -> Result<(ServeReport, Vec<RankStep>, f64)> {
                    let mut runner = ModelRunner::tensor_parallel(cfg, settings, comm)?;
                    let capture = runner.capture_all(|_, _, _| {})?;
                    let mut steps = Vec::new();
                    let report = runner.serve(requests, |_, r| steps.push((r.mode, r.desc, r.tokens.clone())))?;
                    Ok((report, steps, capture))
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| Err(ModelError::Step(format!("tensor-parallel rank {rank} panicked"))))
            })
            .collect()
    });
    let mut ok = Vec::with_capacity(ranks);
    // The first error, unless it is a collective that timed out behind a later rank's root cause.
    let mut first_err: Option<(bool, ModelError)> = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => ok.push(v),
            Err(e) => {
                let collective = matches!(
                    &e,
                    ModelError::Hal(holdfast_hal::HalError::CollectiveTimeout { .. })
                        | ModelError::Hal(holdfast_hal::HalError::CollectiveAborted { .. })
                );
                if first_err.as_ref().is_none_or(|(was_collective, _)| *was_collective && !collective) {
                    first_err = Some((collective, ModelError::Step(format!("tensor-parallel rank {rank}: {e}"))));
                }
            }
        }
    }
    if let Some((_, e)) = first_err {
        return Err(e);
    }
    let mut it = ok.into_iter();
    let (report, steps, capture0) = it.next().ok_or_else(|| ModelError::Step("no ranks".into()))?;
    let mut capture_seconds = vec![capture0];
    for (i, (rep, st, cap)) in it.enumerate() {
        let rank = i + 1;
        capture_seconds.push(cap);
        if let Some((k, (a, b))) = steps.iter().zip(&st).enumerate().find(|(_, (a, b))| a != b) {
            return Err(ModelError::Step(format!(
                "tensor-parallel ranks disagree at step {k}: rank 0 ran {a:?}, rank {rank} ran {b:?}"
            )));
        }
        if st.len() != steps.len() || rep.outputs != report.outputs {
            return Err(ModelError::Step(format!(
                "tensor-parallel rank {rank} ran {} steps / produced different outputs than rank 0 ({} steps)",
                st.len(),
                steps.len()
            )));
        }
    }
    Ok(TensorParallelReport { ranks, report, steps, capture_seconds })
}
