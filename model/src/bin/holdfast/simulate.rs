//! `holdfast simulate`: one seeded request stream, served with continuous batching and chunked
//! prefill once per graph mode; a table of speed, dispatch, graph and memory figures per mode, and
//! the verdict that every request's tokens are the same in every mode.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use holdfast_graph::{FallbackReason, GraphMode, RuntimeMode};
use holdfast_hal::{Communicator, Device};
use holdfast_model::{CachedSource, ModelConfig, ModelRunner, SeededInit};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::SimulateArgs;
use crate::error::CliError;
use crate::table;
use crate::workload::{self, Arrival};

/// Figures of one graph mode's run.
#[derive(Debug, Serialize)]
struct ModeReport {
    /// The configured mode.
    mode: String,
    /// The mode it resolved to against the model's attention support.
    resolved_mode: String,
    /// Downgrades applied on the way, with their reasons.
    downgrades: Vec<String>,
    /// The attention kernel the layers ran (on a GPU with warpgroup MMA: its row split).
    attention_kernel: String,
    steps: u64,
    tokens_processed: u64,
    tokens_generated: u64,
    serve_seconds: f64,
    tokens_per_second: f64,
    generated_tokens_per_second: f64,
    step_seconds_p50: f64,
    step_seconds_p90: f64,
    step_seconds_p99: f64,
    full_steps: u64,
    piecewise_steps: u64,
    eager_steps: u64,
    /// Eager steps per reason.
    fallbacks: BTreeMap<&'static str, u64>,
    real_tokens: u64,
    padded_tokens: u64,
    /// Tokens added by padding to capture sizes.
    padded_token_overhead: u64,
    /// Padded over real tokens.
    padding_ratio: f64,
    graphs_captured: usize,
    full_graphs: usize,
    piecewise_keys: usize,
    capture_seconds: f64,
    graph_bytes: u64,
    arena_bytes: u64,
    /// The HAL's host-synchronisation counter over the serving loop (token reads included).
    host_syncs: u64,
    host_syncs_per_step: f64,
    recaptures: u64,
    preemptions: u64,
    /// FNV-1a over every request's id and tokens, in id order.
    tokens_digest: String,
    #[serde(skip)]
    outputs: BTreeMap<u64, Vec<i32>>,
}

/// The request that differs first between two modes, if any.
#[derive(Debug, Serialize)]
struct Mismatch {
    request: u64,
    mode_a: String,
    mode_b: String,
}

#[derive(Debug, Serialize)]
struct Verdict {
    identical: bool,
    requests: usize,
    requests_differing: usize,
    first_mismatch: Option<Mismatch>,
    line: String,
}

#[derive(Debug, Serialize)]
struct Workload {
    requests: usize,
    prompt_len: String,
    output_len: String,
    arrival_rate: f64,
    concurrency: usize,
    seed: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    backend: String,
    device: String,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    workload: Workload,
    modes: Vec<ModeReport>,
    verdict: Verdict,
}

/// Most requests one simulation serves (each is held in memory with its prompt).
const MAX_REQUESTS: usize = 1 << 20;

fn usage(msg: impl Into<String>) -> CliError {
    CliError::Usage(msg.into())
}

/// Runs the subcommand; `Ok(1)` when tokens differ between modes.
pub fn run(a: &SimulateArgs) -> Result<ExitCode, CliError> {
    let c = &a.common;
    let modes = a.modes();
    if modes.is_empty() {
        return Err(usage("--modes: no graph mode given"));
    }
    if a.requests == 0 || a.requests > MAX_REQUESTS {
        return Err(usage(format!("--requests must lie in [1, {MAX_REQUESTS}], got {}", a.requests)));
    }
    if !(a.arrival_rate.is_finite() && a.arrival_rate >= 0.0) {
        return Err(usage(format!("--arrival-rate must be a finite rate >= 0, got {}", a.arrival_rate)));
    }
    if c.max_num_seqs == 0 {
        return Err(usage("--max-num-seqs must be at least 1"));
    }
    let concurrency = a.concurrency.unwrap_or(c.max_num_seqs);
    if concurrency == 0 {
        return Err(usage("--concurrency must be at least 1"));
    }
    let longest = a.prompt_len.max.checked_add(a.output_len.max);
    if longest.is_none_or(|n| n > c.max_model_len) {
        return Err(usage(format!(
            "--prompt-len {} with --output-len {} needs sequences of {} tokens, above --max-model-len {}",
            a.prompt_len,
            a.output_len,
            longest.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string()),
            c.max_model_len
        )));
    }
    // The report's file must be writable before any mode runs, not found unwritable after them;
    // a file this check creates is removed again (a failed run leaves none behind).
    if let Some(path) = &a.json {
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| usage(format!("--json {}: {e}", path.display())))?;
        if !existed {
            // Best effort: the file is written in full after the modes ran.
            let _ = std::fs::remove_file(path);
        }
    }
    let (model, cfg) = c.model_config()?;
    // Every mode's settings are checked before the first mode runs.
    for &mode in &modes {
        ModelRunner::check(&cfg, &c.settings(mode))?;
    }
    for &mode in &modes {
        for note in c.capture_size_notes(mode) {
            eprintln!("note: {note}");
        }
    }
    if a.tensor_parallel == 0 {
        return Err(usage("--tensor-parallel must be at least 1"));
    }
    // The model must split into the ranks before any device opens.
    if a.tensor_parallel > 1 {
        cfg.validate_tp(a.tensor_parallel)?;
    }
    let dev = c.device()?;
    let devices = if a.tensor_parallel > 1 { c.devices(a.tensor_parallel)? } else { vec![dev.clone()] };
    let arrivals = workload::requests(c.seed, a.requests, a.prompt_len, a.output_len, cfg.vocab_size, a.arrival_rate);
    if !a.quiet {
        eprintln!(
            "holdfast simulate: {model} ({} layers, hidden {}, vocab {}, {:.2}M parameters) on {}; \
             {} requests, prompt {} / output {} tokens, {} new per step, concurrency {}",
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.vocab_size,
            cfg.parameter_count() as f64 / 1e6,
            if dev.info().dependent_launch {
                format!("{} (dependent launches)", dev.info().name)
            } else {
                dev.info().name.clone()
            },
            a.requests,
            a.prompt_len,
            a.output_len,
            if a.arrival_rate > 0.0 { format!("{}", a.arrival_rate) } else { "all".to_owned() },
            concurrency
        );
    }

    // With several modes on one device, the seeded weights are generated once instead of once
    // per mode (a host copy of them is held until every mode has run).
    let mut weights = (modes.len() > 1 && devices.len() == 1).then(|| CachedSource::new(SeededInit { seed: c.seed }));
    let mut reports = Vec::with_capacity(modes.len());
    for &mode in &modes {
        reports.push(run_mode_tp(&devices, &cfg, a, mode, concurrency, &arrivals, weights.as_mut())?);
    }
    drop(weights);
    let verdict = verdict(&reports);

    println!(
        "holdfast simulate — {model} on {}: {} requests (prompt {}, output {} tokens), max_num_seqs {}, \
         max_num_batched_tokens {}, seed {}",
        c.backend, a.requests, a.prompt_len, a.output_len, c.max_num_seqs, c.max_num_batched_tokens, c.seed
    );
    println!();
    print!("{}", render(&reports));
    for r in &reports {
        for d in &r.downgrades {
            println!("note: {} downgraded: {d}", r.mode);
        }
    }
    println!();
    println!("{}", verdict.line);

    let identical = verdict.identical;
    if let Some(path) = &a.json {
        let report = Report {
            model,
            backend: c.backend.clone(),
            device: dev.info().name.clone(),
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.max_num_batched_tokens,
            max_model_len: c.max_model_len,
            workload: Workload {
                requests: a.requests,
                prompt_len: a.prompt_len.to_string(),
                output_len: a.output_len.to_string(),
                arrival_rate: a.arrival_rate,
                concurrency,
                seed: c.seed,
            },
            modes: reports,
            verdict,
        };
        let text = serde_json::to_string_pretty(&report).map_err(|e| CliError::Runtime(format!("json: {e}")))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| CliError::Runtime(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(if identical { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn bar(quiet: bool, len: usize, prefix: String, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len as u64);
    let template = format!("{{prefix:>18}} {what} [{{bar:32}}] {{pos}}/{{len}} {{msg}}");
    pb.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb.set_prefix(prefix);
    pb
}

/// Runs `mode` on one device (its weights from `weights` where given, else seeded afresh), or on
/// one thread per tensor-parallel rank (each rank serves the same stream; rank 0's report is
/// returned after checking every rank's tokens are the same).
fn run_mode_tp(
    devices: &[Device],
    cfg: &ModelConfig,
    a: &SimulateArgs,
    mode: GraphMode,
    concurrency: usize,
    arrivals: &[Arrival],
    weights: Option<&mut CachedSource<SeededInit>>,
) -> Result<ModeReport, CliError> {
    if devices.len() == 1 {
        let settings = a.common.settings(mode);
        let runner = match weights {
            Some(w) => ModelRunner::with_weights(&devices[0], cfg, &settings, w)?,
            None => ModelRunner::new(&devices[0], cfg, &settings)?,
        };
        return run_mode(runner, &devices[0], a.quiet, mode, concurrency, arrivals);
    }
    let comms = Communicator::group(devices)?;
    let results: Vec<Result<ModeReport, CliError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                scope.spawn(move || {
                    let (rank, dev) = (comm.rank(), comm.device().clone());
                    let runner = ModelRunner::tensor_parallel(cfg, &a.common.settings(mode), comm)?;
                    run_mode(runner, &dev, a.quiet || rank > 0, mode, concurrency, arrivals)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(CliError::Runtime(format!("{mode}: tensor-parallel rank {rank} panicked"))))
            })
            .collect()
    });
    let mut reports = Vec::with_capacity(results.len());
    for (rank, r) in results.into_iter().enumerate() {
        reports.push(r.map_err(|e| CliError::Runtime(format!("{mode}: tensor-parallel rank {rank}: {e}")))?);
    }
    if let Some((rank, r)) = reports.iter().enumerate().find(|(_, r)| r.outputs != reports[0].outputs) {
        return Err(CliError::Runtime(format!(
            "{mode}: tensor-parallel rank {rank} generated different tokens than rank 0 (digest {} vs {})",
            r.tokens_digest, reports[0].tokens_digest
        )));
    }
    Ok(reports.swap_remove(0))
}

/// Captures and serves the stream under `mode` with `runner` (built on `dev`).
fn run_mode(
    mut runner: ModelRunner,
    dev: &Device,
    quiet: bool,
    mode: GraphMode,
    concurrency: usize,
    arrivals: &[Arrival],
) -> Result<ModeReport, CliError> {
    let pb = bar(quiet, runner.capture_order().len(), mode.to_string(), "capture");
    let capture_seconds = runner.capture_all(|done, _, desc| {
        pb.set_position(done as u64);
        pb.set_message(format!("{} tokens", desc.num_tokens));
    })?;
    pb.finish_and_clear();

    let pb = bar(quiet, arrivals.len(), mode.to_string(), "serve  ");
    let mut sched = runner.scheduler()?;
    let mut outputs = BTreeMap::new();
    let mut step_seconds = Vec::new();
    let (mut next, mut in_flight, mut clock) = (0usize, 0usize, 0u64);
    let (mut steps, mut processed, mut generated) = (0u64, 0u64, 0u64);
    let syncs0 = dev.stats().host_syncs;
    let t0 = Instant::now();
    while outputs.len() < arrivals.len() {
        while next < arrivals.len() && arrivals[next].step <= clock && in_flight < concurrency {
            sched.add(arrivals[next].request.clone())?;
            next += 1;
            in_flight += 1;
        }
        if sched.is_idle() {
            // Nothing to run before the next arrival: skip the idle steps.
            match arrivals.get(next) {
                Some(n) if n.step > clock => {
                    clock = n.step;
                    continue;
                }
                _ => {
                    return Err(CliError::Runtime(format!(
                        "{mode}: the scheduler is idle with {} of {} requests unfinished",
                        arrivals.len() - outputs.len(),
                        arrivals.len()
                    )))
                }
            }
        }
        let Some(step) = sched.schedule()? else { continue };
        let res = match runner.execute(&step) {
            Ok(r) => r,
            Err(e) => {
                sched.abort_step();
                return Err(e.into());
            }
        };
        step_seconds.push(res.total_seconds);
        steps += 1;
        clock = clock.saturating_add(1);
        processed += step.num_tokens() as u64;
        generated += res.tokens.len() as u64;
        for f in sched.update(&step, &res.tokens)? {
            outputs.insert(f.id, f.tokens);
            in_flight -= 1;
            pb.inc(1);
        }
        pb.set_message(format!("step {steps}"));
    }
    let serve_seconds = t0.elapsed().as_secs_f64();
    let host_syncs = dev.stats().host_syncs - syncs0;
    pb.finish_and_clear();

    let stats = runner.stats();
    let d = runner.dispatch_stats();
    let resolved = runner.resolved();
    let report = ModeReport {
        mode: mode.to_string(),
        resolved_mode: resolved.mode.to_string(),
        downgrades: resolved.downgrades.iter().map(ToString::to_string).collect(),
        attention_kernel: runner.forward().sparse_attention().kernel_description(),
        steps,
        tokens_processed: processed,
        tokens_generated: generated,
        serve_seconds,
        tokens_per_second: per_second(processed, serve_seconds),
        generated_tokens_per_second: per_second(generated, serve_seconds),
        step_seconds_p50: percentile(&mut step_seconds, 0.50),
        step_seconds_p90: percentile(&mut step_seconds, 0.90),
        step_seconds_p99: percentile(&mut step_seconds, 0.99),
        full_steps: stats.steps(RuntimeMode::Full),
        piecewise_steps: stats.steps(RuntimeMode::Piecewise),
        eager_steps: stats.eager_steps(),
        fallbacks: FallbackReason::ALL.iter().map(|&r| (r.as_str(), d.fallbacks(r))).collect(),
        real_tokens: d.real_tokens(),
        padded_tokens: d.padded_tokens(),
        padded_token_overhead: d.padding_overhead(),
        padding_ratio: d.padding_ratio(),
        graphs_captured: stats.graphs,
        full_graphs: stats.full_graphs,
        piecewise_keys: stats.piecewise_keys,
        capture_seconds,
        graph_bytes: stats.graph_bytes,
        arena_bytes: runner.forward().arena().total_bytes() as u64,
        host_syncs,
        host_syncs_per_step: if steps == 0 { 0.0 } else { host_syncs as f64 / steps as f64 },
        recaptures: stats.recaptures,
        preemptions: sched.num_preemptions(),
        tokens_digest: format!("{:016x}", digest(&outputs)),
        outputs,
    };
    if !quiet {
        eprintln!(
            "{:>18} {} graphs in {}, {} steps in {}",
            report.mode,
            report.graphs_captured,
            table::seconds(report.capture_seconds),
            report.steps,
            table::seconds(report.serve_seconds)
        );
    }
    Ok(report)
}

fn per_second(n: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

/// The nearest-rank percentile `q` of `v` (sorts it); 0 when empty.
fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// FNV-1a (64-bit) over every request's id, token count and tokens, in id order.
fn digest(outputs: &BTreeMap<u64, Vec<i32>>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for (id, tokens) in outputs {
        eat(&id.to_le_bytes());
        eat(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            eat(&t.to_le_bytes());
        }
    }
    h
}

fn verdict(reports: &[ModeReport]) -> Verdict {
    let first = &reports[0];
    let requests = first.outputs.len();
    let tokens: usize = first.outputs.values().map(Vec::len).sum();
    let mut differing = std::collections::BTreeSet::new();
    let mut first_mismatch = None;
    for other in &reports[1..] {
        let ids = first.outputs.keys().chain(other.outputs.keys());
        for &id in ids {
            if first.outputs.get(&id) != other.outputs.get(&id) {
                differing.insert(id);
                if first_mismatch.is_none() {
                    first_mismatch =
                        Some(Mismatch { request: id, mode_a: first.mode.clone(), mode_b: other.mode.clone() });
                }
            }
        }
    }
    let identical = differing.is_empty();
    let line = if identical {
        format!(
            "verdict: identical tokens across {} mode{}: all {requests} requests, {tokens} generated tokens (digest {})",
            reports.len(),
            if reports.len() == 1 { "" } else { "s" },
            first.tokens_digest
        )
    } else {
        let m = first_mismatch.as_ref().map_or(String::new(), |m| {
            format!("; first: request {} differs between {} and {}", m.request, m.mode_a, m.mode_b)
        });
        format!("verdict: TOKENS DIFFER across modes: {} of {requests} requests{m}", differing.len())
    };
    Verdict { identical, requests, requests_differing: differing.len(), first_mismatch, line }
}

fn render(reports: &[ModeReport]) -> String {
    let mut header = vec!["".to_owned()];
    header.extend(reports.iter().map(|r| r.mode.clone()));
    type Cell = fn(&ModeReport) -> String;
    let rows: [(&str, Cell); 18] = [
        ("resolved mode", |r| r.resolved_mode.clone()),
        ("attention kernel", |r| r.attention_kernel.clone()),
        ("steps", |r| r.steps.to_string()),
        ("tokens/s (prefill+decode)", |r| format!("{:.0}", r.tokens_per_second)),
        ("generated tokens/s", |r| format!("{:.0}", r.generated_tokens_per_second)),
        ("step latency p50", |r| table::seconds(r.step_seconds_p50)),
        ("step latency p90", |r| table::seconds(r.step_seconds_p90)),
        ("step latency p99", |r| table::seconds(r.step_seconds_p99)),
        ("FULL steps", |r| r.full_steps.to_string()),
        ("PIECEWISE steps", |r| r.piecewise_steps.to_string()),
        ("eager steps", |r| r.eager_steps.to_string()),
        ("padded tokens (overhead)", |r| {
            format!("{} (+{:.1}%)", r.padded_token_overhead, (r.padding_ratio - 1.0) * 100.0)
        }),
        ("graphs captured", |r| r.graphs_captured.to_string()),
        ("capture time", |r| table::seconds(r.capture_seconds)),
        ("graph memory", |r| table::bytes(r.graph_bytes)),
        ("arena memory", |r| table::bytes(r.arena_bytes)),
        ("host syncs/step", |r| format!("{:.2}", r.host_syncs_per_step)),
        ("preemptions", |r| r.preemptions.to_string()),
    ];
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|(name, cell)| {
            let mut row = vec![(*name).to_owned()];
            row.extend(reports.iter().map(cell));
            row
        })
        .collect();
    table::render(&header, &body)
}
