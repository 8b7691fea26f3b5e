//! One decode step of the whole model (schedule → execute → update) at batch 1, 8, 64 and 256 in
//! each graph mode (None = eager, Piecewise, Full), on the device named by `HOLDFAST_DEVICE`
//! (default `cpu`).
//!
//! - GPU: preset `flash-slice`, 256 sequences / 256 batched tokens, max_model_len 1024, the default
//!   capture sizes for those limits (1, 2, 4, 8, 16, 24, …, 256).
//! - CPU backend: preset `tiny`, batches 1, 8 and 64, small limits, so a run takes about a minute.
//!
//! Per mode one runner is built (seeded weights, generated once and reused by the later runners),
//! every graph is captured (`capture_all`, timed and printed), and for each batch `B` a scheduler
//! is brought to a steady decode state: `B` requests with 32-token prompts (16 on the CPU) are
//! prefilled until every one of them decodes. The timed closure is one decode step; `execute`
//! reads the sampled tokens back, so each step includes the device work. Requests are given as
//! many new tokens as `max_model_len` allows; when they run out, a fresh steady state is built
//! outside the timed region.
//!
//! After criterion, a summary phase runs `SUMMARY_STEPS` more steps per mode and batch and prints
//! `model/summary:` lines: median step time, median host time per step
//! ([`StepResult::host_seconds`]: dispatch + staging + enqueue, without the wait), the runtime
//! mode the steps actually ran in, the capture seconds per mode, and the None/Full ratio at each
//! batch, next to the targets (capture ≤ 3 s, Full host time ≤ 30 µs, None/Full ≥ 2 at batch 1
//! and ≥ 1.3 at batch 8; the targets are for flash-slice on a GPU).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use holdfast_graph::{GraphMode, RuntimeMode};
use holdfast_hal::{BackendKind, Device};
use holdfast_model::scheduler::{Request, Scheduler};
use holdfast_model::{CachedSource, ModelConfig, ModelRunner, RunnerSettings, SeededInit, StepResult};

const MODES: [GraphMode; 3] = [GraphMode::None, GraphMode::Piecewise, GraphMode::Full];

fn device() -> Device {
    let name = std::env::var("HOLDFAST_DEVICE").unwrap_or_else(|_| "cpu".into());
    match Device::open(&name) {
        Ok(d) => d,
        Err(e) => panic!("HOLDFAST_DEVICE={name}: {e}"),
    }
}

/// Everything that differs between the GPU and the CPU backend.
struct Plan {
    preset: &'static str,
    cfg: ModelConfig,
    batches: Vec<usize>,
    settings: RunnerSettings,
    prompt_len: usize,
    summary_steps: usize,
    warm_up: Duration,
    measurement: Duration,
    sample_size: usize,
}

impl Plan {
    fn for_device(dev: &Device) -> Self {
        if dev.backend() == BackendKind::Cpu {
            Plan {
                preset: "tiny",
                cfg: ModelConfig::tiny(),
                batches: vec![1, 8, 64],
                settings: RunnerSettings {
                    max_num_seqs: 64,
                    max_num_batched_tokens: 64,
                    max_model_len: 128,
                    capture_sizes: Some(vec![1, 2, 4, 8, 16, 32, 64]),
                    ..RunnerSettings::default()
                },
                prompt_len: 16,
                summary_steps: 20,
                warm_up: Duration::from_millis(200),
                measurement: Duration::from_millis(500),
                sample_size: 10,
            }
        } else {
            Plan {
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
                summary_steps: 200,
                warm_up: Duration::from_millis(300),
                measurement: Duration::from_secs(1),
                sample_size: 10,
            }
        }
    }

    fn max_new_tokens(&self) -> usize {
        self.settings.max_model_len - self.prompt_len
    }
}

/// A scheduler whose `batch` requests all decode, and how many decode steps remain before the
/// first of them finishes.
struct Decoding {
    sched: Scheduler,
    batch: usize,
    left: usize,
}

impl Decoding {
    fn new(runner: &mut ModelRunner, plan: &Plan, batch: usize) -> Self {
        let mut sched = runner.scheduler().expect("scheduler");
        let vocab = plan.cfg.vocab_size as u64;
        for id in 0..batch as u64 {
            let prompt = (0..plan.prompt_len as u64).map(|i| ((id * 131 + i * 17 + 3) % vocab) as i32).collect();
            sched.add(Request { id, prompt, max_new_tokens: plan.max_new_tokens() }).expect("add");
        }
        loop {
            let step = sched.schedule().expect("schedule").expect("a step");
            if step.is_uniform_decode() && step.num_reqs() == batch {
                // The first all-decode step: leave it to the timed loop.
                sched.abort_step();
                break;
            }
            let res = runner.execute(&step).expect("execute");
            sched.update(&step, &res.tokens).expect("update");
        }
        // Every request holds its first sampled token; each decode step adds one more.
        Decoding { sched, batch, left: plan.max_new_tokens() - 1 }
    }

    /// One decode step: schedule → execute → update.
    fn step(&mut self, runner: &mut ModelRunner) -> StepResult {
        let step = self.sched.schedule().expect("schedule").expect("a step");
        assert!(step.is_uniform_decode() && step.num_reqs() == self.batch, "not a steady decode step");
        let res = runner.execute(&step).expect("execute");
        let finished = self.sched.update(&step, &res.tokens).expect("update");
        assert!(finished.is_empty() || self.left == 1, "a request finished early");
        self.left -= 1;
        res
    }
}

/// Runs `iters` decode steps and returns the time spent in them, rebuilding the steady state
/// (untimed) whenever the requests run out of tokens.
fn timed_steps(
    runner: &mut ModelRunner,
    plan: &Plan,
    state: &mut Option<Decoding>,
    batch: usize,
    iters: u64,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0u64;
    while done < iters {
        if state.as_ref().is_none_or(|s| s.left == 0 || s.batch != batch) {
            *state = None; // free the old blocks' scheduler before building the next
            *state = Some(Decoding::new(runner, plan, batch));
        }
        let Some(s) = state.as_mut() else { unreachable!() };
        let n = (s.left as u64).min(iters - done);
        let t0 = Instant::now();
        for _ in 0..n {
            black_box(s.step(runner));
        }
        total += t0.elapsed();
        done += n;
    }
    total
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// What the summary phase found for one mode and batch.
struct Summary {
    mode: GraphMode,
    batch: usize,
    step_us: f64,
    host_us: f64,
    ran: RuntimeMode,
    fallbacks: usize,
}

fn summarise(runner: &mut ModelRunner, plan: &Plan, mode: GraphMode, batch: usize) -> Summary {
    let mut state = Decoding::new(runner, plan, batch);
    // One step untimed so the first replay of this size is out of the numbers.
    state.step(runner);
    let (mut wall, mut host) = (Vec::new(), Vec::new());
    let mut ran = RuntimeMode::None;
    let mut fallbacks = 0;
    for _ in 0..plan.summary_steps {
        if state.left == 0 {
            state = Decoding::new(runner, plan, batch);
        }
        let t0 = Instant::now();
        let res = state.step(runner);
        wall.push(t0.elapsed().as_secs_f64() * 1e6);
        host.push(res.host_seconds * 1e6);
        ran = res.mode;
        fallbacks += usize::from(res.fallback.is_some());
    }
    Summary { mode, batch, step_us: median(&mut wall), host_us: median(&mut host), ran, fallbacks }
}

fn bench(c: &mut Criterion) {
    let dev = device();
    let plan = Plan::for_device(&dev);
    println!(
        "model/setup: device={} preset={} params={} batches={:?} max_num_seqs={} max_num_batched_tokens={} \
         max_model_len={} prompt_len={}",
        dev.info().name,
        plan.preset,
        plan.cfg.parameter_count(),
        plan.batches,
        plan.settings.max_num_seqs,
        plan.settings.max_num_batched_tokens,
        plan.settings.max_model_len,
        plan.prompt_len
    );
    let mut weights = CachedSource::new(SeededInit { seed: plan.settings.seed });
    let mut captures = Vec::new();
    let mut summaries = Vec::new();
    for mode in MODES {
        let settings = RunnerSettings { graph_mode: mode, ..plan.settings.clone() };
        let t0 = Instant::now();
        let mut runner = ModelRunner::with_weights(&dev, &plan.cfg, &settings, &mut weights).expect("runner");
        let build_s = t0.elapsed().as_secs_f64();
        let keys = runner.capture_order().len();
        let capture_s = runner.capture_all(|_, _, _| {}).expect("capture");
        println!(
            "model/capture: mode={mode} resolved={} graphs={keys} capture_s={capture_s:.3} build_s={build_s:.2}",
            runner.resolved().mode
        );
        captures.push((mode, keys, capture_s));

        let mut g = c.benchmark_group(format!("model_decode/{}/{mode}", plan.preset));
        g.sample_size(plan.sample_size).warm_up_time(plan.warm_up).measurement_time(plan.measurement);
        let mut state: Option<Decoding> = None;
        for &batch in &plan.batches {
            g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
                b.iter_custom(|iters| timed_steps(&mut runner, &plan, &mut state, batch, iters))
            });
        }
        g.finish();
        drop(state);

        for &batch in &plan.batches {
            let s = summarise(&mut runner, &plan, mode, batch);
            println!(
                "model/step: mode={mode} batch={batch} ran={} fallbacks={} step_median_us={:.1} host_median_us={:.1}",
                s.ran, s.fallbacks, s.step_us, s.host_us
            );
            summaries.push(s);
        }
    }

    let n = plan.summary_steps;
    println!("model/summary: device={} preset={} (medians over {n} decode steps)", dev.info().name, plan.preset);
    for (mode, keys, secs) in &captures {
        println!("model/summary: capture mode={mode} graphs={keys} seconds={secs:.3} (target <= 3 s, flash-slice)");
    }
    for s in &summaries {
        println!(
            "model/summary: mode={} batch={} ran={} step_us={:.1} host_us={:.1}{}",
            s.mode,
            s.batch,
            s.ran,
            s.step_us,
            s.host_us,
            if s.mode == GraphMode::Full { " (Full host target <= 30 us)" } else { "" }
        );
    }
    let find = |mode: GraphMode, batch: usize| summaries.iter().find(|s| s.mode == mode && s.batch == batch);
    for &batch in &plan.batches {
        if let (Some(none), Some(full)) = (find(GraphMode::None, batch), find(GraphMode::Full, batch)) {
            let target = match batch {
                1 => " (target >= 2.0)",
                8 => " (target >= 1.3)",
                _ => "",
            };
            println!(
                "model/summary: None/Full batch={batch} ratio={:.2}{target}  Piecewise/Full={:.2}",
                none.step_us / full.step_us,
                find(GraphMode::Piecewise, batch).map_or(f64::NAN, |p| p.step_us / full.step_us)
            );
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
