//! One decode step of the whole model (schedule → execute → update) per graph mode (NONE,
//! PIECEWISE, FULL, FULL_AND_PIECEWISE) at batch 1, 8, 64, 256 (`flash-slice`: 4 layers at
//! V4-Flash dimensions, seeded weights), as `model/benches/model.rs` sets it up. On `--quick`:
//! the `tiny` preset at batch 1 and 8.
//!
//! Per step: the step's wall time (`ModelRunner::execute` reads the sampled tokens back, so it
//! includes the device work; the runner's stream is not exposed, so this is not an event time)
//! and the host time before waiting (`StepResult::host_seconds`: dispatch + staging + enqueue or
//! replay). Also capture seconds per mode and the FULL / NONE speed-up at each batch.

use std::collections::HashMap;
use std::time::Instant;

use holdfast_graph::{GraphMode, RuntimeMode};
use holdfast_model::scheduler::{Request, Scheduler};
use holdfast_model::{CachedSource, ModelConfig, ModelRunner, RunnerSettings, SeededInit, StepResult};

use crate::ctx::{Ctx, Scale};
use crate::error::{ReportError, Result};
use crate::report::{Row, Target};
use crate::timing::median;

/// Section name.
pub const SECTION: &str = "decode";
/// Least FULL-over-NONE speed-up at batch 1.
pub const FULL_SPEEDUP_TARGET: f64 = 2.0;

/// The graph modes measured.
pub const MODES: [GraphMode; 4] = [GraphMode::None, GraphMode::Piecewise, GraphMode::Full, GraphMode::FullAndPiecewise];

struct Plan {
    preset: &'static str,
    cfg: ModelConfig,
    batches: Vec<usize>,
    settings: RunnerSettings,
    prompt_len: usize,
    steps: usize,
}

impl Plan {
    fn new(scale: Scale) -> Plan {
        match scale {
            Scale::Full => Plan {
                preset: "flash-slice",
                cfg: ModelConfig::flash_slice(),
                batches: vec![1, 8, 64, 256],
                settings: RunnerSettings {
                    max_num_seqs: 256,
                    max_num_batched_tokens: 256,
                    max_model_len: 1024,
                    capture_sizes: None,
                    ..RunnerSettings::default()
                },
                prompt_len: 32,
                steps: 40,
            },
            Scale::Quick => Plan {
                preset: "tiny",
                cfg: ModelConfig::tiny(),
                batches: vec![1, 8],
                settings: RunnerSettings {
                    max_num_seqs: 8,
                    max_num_batched_tokens: 32,
                    max_model_len: 64,
                    capture_sizes: Some(vec![1, 2, 4, 8]),
                    ..RunnerSettings::default()
                },
                prompt_len: 8,
                steps: 5,
            },
        }
    }

    fn max_new_tokens(&self) -> usize {
        self.settings.max_model_len - self.prompt_len
    }
}

/// A scheduler whose `batch` requests all decode, and the decode steps left before one finishes.
struct Decoding {
    sched: Scheduler,
    batch: usize,
    left: usize,
}

impl Decoding {
    fn new(runner: &mut ModelRunner, plan: &Plan, batch: usize) -> Result<Decoding> {
        let mut sched = runner.scheduler()?;
        let vocab = plan.cfg.vocab_size as u64;
        for id in 0..batch as u64 {
            let prompt = (0..plan.prompt_len as u64).map(|i| ((id * 131 + i * 17 + 3) % vocab) as i32).collect();
            sched.add(Request { id, prompt, max_new_tokens: plan.max_new_tokens() })?;
        }
        loop {
            let step = sched.schedule()?.ok_or_else(|| ReportError::Other("the scheduler has no step".into()))?;
            if step.is_uniform_decode() && step.num_reqs() == batch {
                sched.abort_step();
                break;
            }
            let res = runner.execute(&step)?;
            sched.update(&step, &res.tokens)?;
        }
        Ok(Decoding { sched, batch, left: plan.max_new_tokens() - 1 })
    }

    fn step(&mut self, runner: &mut ModelRunner) -> Result<StepResult> {
        let step = self.sched.schedule()?.ok_or_else(|| ReportError::Other("the scheduler has no step".into()))?;
        if !(step.is_uniform_decode() && step.num_reqs() == self.batch) {
            return Err(ReportError::Other(format!("not a steady decode step of {} requests", self.batch)));
        }
        let res = runner.execute(&step)?;
        self.sched.update(&step, &res.tokens)?;
        self.left = self.left.saturating_sub(1);
        Ok(res)
    }
}

fn mode_name(m: RuntimeMode) -> String {
    format!("{m}")
}

/// Runs the section: `flash-slice` (the targets), then on the full scale also `tiny` at batch 1
/// and 8, a model small enough that the eager step is bound by the host's launches, which is
/// where a FULL graph's saving shows end to end.
pub fn run(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let mut rows = run_plan(ctx, &Plan::new(ctx.scale), true)?;
    if ctx.scale == Scale::Full {
        let mut tiny = Plan::new(Scale::Quick);
        tiny.steps = 40;
        rows.extend(run_plan(ctx, &tiny, false)?);
    }
    Ok(rows)
}

fn run_plan(ctx: &mut Ctx, plan: &Plan, with_target: bool) -> Result<Vec<Row>> {
    let mut weights = CachedSource::new(SeededInit { seed: plan.settings.seed });
    let mut rows = Vec::new();
    // (mode, batch) → median step µs.
    let mut steps: HashMap<(GraphMode, usize), f64> = HashMap::new();
    for mode in MODES {
        let settings = RunnerSettings { graph_mode: mode, ..plan.settings.clone() };
        let t0 = Instant::now();
        let mut runner = ModelRunner::with_weights(&ctx.dev, &plan.cfg, &settings, &mut weights)?;
        let build_s = t0.elapsed().as_secs_f64();
        let graphs = runner.capture_order().len();
        let capture_s = runner.capture_all(|_, _, _| {})?;
        rows.push(
            Row::value(SECTION, format!("{} {mode} capture ({graphs} graphs)", plan.preset), capture_s, "s")
                .with_note(format!("resolved {}; runner build {build_s:.2} s", runner.resolved().mode)),
        );
        for &batch in &plan.batches {
            let mut state = Some(Decoding::new(&mut runner, plan, batch)?);
            let (mut wall, mut host) = (Vec::new(), Vec::new());
            let mut ran = RuntimeMode::None;
            let mut fallbacks = 0usize;
            // One step untimed first: the first replay of this size stays out of the numbers.
            for i in 0..=plan.steps {
                if state.as_ref().is_none_or(|s| s.left == 0) {
                    drop(state.take()); // free the old requests' blocks before scheduling new ones
                    state = Some(Decoding::new(&mut runner, plan, batch)?);
                }
                let Some(st) = state.as_mut() else { continue };
                let t = Instant::now();
                let res = st.step(&mut runner)?;
                if i == 0 {
                    continue;
                }
                wall.push(t.elapsed().as_secs_f64() * 1e6);
                host.push(res.host_seconds * 1e6);
                ran = res.mode;
                fallbacks += usize::from(res.fallback.is_some());
            }
            drop(state);
            let step_us = median(&mut wall);
            steps.insert((mode, batch), step_us);
            let tag = format!("{} {mode} B={batch}", plan.preset);
            rows.push(
                Row::timed(SECTION, format!("{tag} step"), step_us, plan.steps).with_note(format!(
                    "ran {}; {fallbacks} fallbacks; wall time incl. token read-back",
                    mode_name(ran)
                )),
            );
            rows.push(
                Row::timed(SECTION, format!("{tag} host"), median(&mut host), plan.steps)
                    .with_note("dispatch + staging + enqueue/replay, before the wait"),
            );
        }
    }
    for &batch in &plan.batches {
        if let (Some(none), Some(full)) = (steps.get(&(GraphMode::None, batch)), steps.get(&(GraphMode::Full, batch))) {
            let mut r =
                Row::value(SECTION, format!("{} FULL speed-up over NONE B={batch}", plan.preset), none / full, "×");
            if batch == 1 && with_target {
                r = r.with_target(Target::AtLeast(FULL_SPEEDUP_TARGET));
            }
            rows.push(r);
        }
    }
    Ok(rows)
}
