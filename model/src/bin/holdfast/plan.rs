//! `holdfast plan`: what a configuration would capture and allocate, without serving: the
//! resolved mode (with downgrade reasons), the capture sizes, the graph keys per runtime mode, and
//! the arena, weight and cache bytes.

use std::process::ExitCode;

use holdfast_graph::{RuntimeMode, WORKSPACE};
use holdfast_model::ModelRunner;
use serde::Serialize;

use crate::args::PlanArgs;
use crate::error::CliError;
use crate::table;

#[derive(Debug, Serialize)]
struct Key {
    num_tokens: u32,
    /// `None` for piecewise keys (any request count).
    num_reqs: Option<u32>,
    uniform: bool,
}

#[derive(Debug, Serialize)]
struct Downgrade {
    from: String,
    to: String,
    reason: String,
}

#[derive(Debug, Serialize)]
struct Plan {
    model: String,
    backend: String,
    parameters: u64,
    configured_mode: String,
    resolved_mode: String,
    downgrades: Vec<Downgrade>,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    capture_sizes: Vec<u32>,
    /// Graph keys in capture order, per runtime mode (`FULL`, `PIECEWISE`).
    keys: std::collections::BTreeMap<&'static str, Vec<Key>>,
    arena_bytes: u64,
    /// The shared workspace inside the arena, when the forward allocates one.
    workspace_bytes: Option<u64>,
    weight_bytes: u64,
    cache_bytes: u64,
}

/// Runs the subcommand.
pub fn run(a: &PlanArgs) -> Result<ExitCode, CliError> {
    let c = &a.common;
    let (model, cfg) = c.model_config()?;
    let dev = c.device()?;
    let runner = ModelRunner::new(&dev, &cfg, &c.settings(a.mode))?;
    let resolved = runner.resolved();
    // The runner built its dispatcher from these sizes (and accepted them, so this cannot fail).
    let sizes = c.capture_sizes(resolved.mode)?;
    for w in sizes.warnings() {
        eprintln!("note: {}: {w}", resolved.mode);
    }
    let mut keys = std::collections::BTreeMap::new();
    for &(mode, desc) in runner.capture_order() {
        keys.entry(mode.as_str()).or_insert_with(Vec::new).push(Key {
            num_tokens: desc.num_tokens,
            num_reqs: desc.num_reqs,
            uniform: desc.uniform,
        });
    }
    let capture_sizes = sizes.sizes().to_vec();
    let arena = runner.forward().arena();
    let plan = Plan {
        model,
        backend: c.backend.clone(),
        parameters: cfg.parameter_count(),
        configured_mode: a.mode.to_string(),
        resolved_mode: resolved.mode.to_string(),
        downgrades: resolved
            .downgrades
            .iter()
            .map(|d| Downgrade { from: d.from.to_string(), to: d.to.to_string(), reason: d.reason.clone() })
            .collect(),
        max_num_seqs: c.max_num_seqs,
        max_num_batched_tokens: c.max_num_batched_tokens,
        max_model_len: c.max_model_len,
        capture_sizes,
        keys,
        arena_bytes: arena.total_bytes() as u64,
        workspace_bytes: arena.bytes(WORKSPACE).ok().map(|b| b as u64),
        weight_bytes: runner.forward().weights().bytes as u64,
        cache_bytes: runner.forward().cache_bytes() as u64,
    };
    if a.json {
        let text = serde_json::to_string_pretty(&plan).map_err(|e| CliError::Runtime(format!("json: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", render(&plan));
    }
    Ok(ExitCode::SUCCESS)
}

fn sizes(keys: &[Key]) -> String {
    keys.iter().map(|k| k.num_tokens.to_string()).collect::<Vec<_>>().join(",")
}

fn render(p: &Plan) -> String {
    let mut rows = vec![
        vec![
            "model".to_owned(),
            format!("{} ({:.2}M parameters) on {}", p.model, p.parameters as f64 / 1e6, p.backend),
        ],
        vec![
            "limits".to_owned(),
            format!(
                "max_num_seqs {}, max_num_batched_tokens {}, max_model_len {}",
                p.max_num_seqs, p.max_num_batched_tokens, p.max_model_len
            ),
        ],
        vec!["configured mode".to_owned(), p.configured_mode.clone()],
        vec!["resolved mode".to_owned(), p.resolved_mode.clone()],
    ];
    for d in &p.downgrades {
        rows.push(vec!["downgrade".to_owned(), format!("{} -> {}: {}", d.from, d.to, d.reason)]);
    }
    let list = if p.capture_sizes.is_empty() {
        "none".to_owned()
    } else {
        p.capture_sizes.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
    };
    rows.push(vec![format!("capture sizes ({})", p.capture_sizes.len()), list]);
    for mode in [RuntimeMode::Full, RuntimeMode::Piecewise] {
        let keys = p.keys.get(mode.as_str()).map_or(&[][..], Vec::as_slice);
        let what = if keys.iter().all(|k| k.uniform) {
            "uniform decode batches"
        } else if keys.iter().all(|k| k.num_reqs.is_none()) {
            "any batch"
        } else {
            "mixed keys"
        };
        let cell = if keys.is_empty() { "none".to_owned() } else { format!("{} ({what})", sizes(keys)) };
        rows.push(vec![format!("{} keys ({})", mode.as_str(), keys.len()), cell]);
    }
    let arena = match p.workspace_bytes {
        Some(w) => format!("{} (workspace {})", table::bytes(p.arena_bytes), table::bytes(w)),
        None => table::bytes(p.arena_bytes),
    };
    rows.push(vec!["arena (graph-visible buffers)".to_owned(), arena]);
    rows.push(vec!["weights".to_owned(), table::bytes(p.weight_bytes)]);
    rows.push(vec!["KV caches".to_owned(), table::bytes(p.cache_bytes)]);
    let width = rows.iter().map(|r| r[0].chars().count()).max().unwrap_or(0);
    let mut out = String::from("holdfast plan\n");
    for r in &rows {
        out.push_str(&format!("  {:<width$}  {}\n", r[0], r[1]));
    }
    out
}
