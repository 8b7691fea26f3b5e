//! The PyTorch side: the plan of comparable cases handed to `torch_report.py` (so both sides run
//! the same shapes under the same keys), and merging its JSON back into the rows.

use std::collections::BTreeMap;

use holdfast_mhc::MhcOp;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ctx::Scale;
use crate::error::{ReportError, Result};
use crate::report::{Report, Row, Target};
use crate::{attention, ceilings, dense, mhc};

/// Every case `torch_report.py` can run, as `{"key", "op", shape fields…}` objects.
pub fn plan(scale: Scale) -> Value {
    let mut cases = vec![json!({"key": format!("{}/{}", ceilings::SECTION, ceilings::copy_case(scale)), "op": "copy",
               "bytes": ceilings::copy_bytes(scale)})];
    let n = ceilings::gemm_size(scale);
    cases.push(json!({"key": format!("{}/{}", ceilings::SECTION, ceilings::gemm_case(scale)), "op": "gemm",
                      "t": n, "n": n, "k": n, "groups": 1, "out": "bf16"}));
    for sh in dense::gemm_shapes(scale) {
        let g = sh.gemm;
        cases.push(json!({"key": format!("{}/{}", dense::SECTION, sh.case()), "op": "gemm", "t": g.t, "n": g.n,
                          "k": g.k, "groups": g.groups, "out": if sh.f32_out { "f32" } else { "bf16" }}));
    }
    let hdim = dense::config(scale).hidden_size;
    for t in dense::tokens(scale) {
        cases.push(json!({"key": format!("{}/{}", dense::SECTION, dense::rms_case(t, hdim)), "op": "rms_norm",
                          "rows": t, "dim": hdim, "eps": 1e-6}));
    }
    for (h, ts) in mhc::shapes(scale) {
        for op in MhcOp::ALL {
            for &t in &ts {
                cases.push(json!({"key": format!("{}/{}", mhc::SECTION, mhc::case(op, h, t)), "op": op.name(),
                                  "t": t, "hidden": h, "hc_mult": holdfast_mhc::HC_MULT, "sinkhorn_iters": 20}));
            }
        }
    }
    for sh in attention::shapes(scale) {
        cases.push(json!({"key": format!("{}/{}", attention::SECTION, sh.case()), "op": "attention",
                          "batch": sh.batch, "heads": sh.heads, "head_dim": sh.head_dim, "window": sh.window,
                          "extra": sh.extra, "scale": 1.0 / (sh.head_dim as f64).sqrt()}));
    }
    json!({"scale": match scale { Scale::Full => "full", Scale::Quick => "quick" }, "cases": cases})
}

/// One case's PyTorch timings.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize)]
pub struct TorchCase {
    /// Eager, µs.
    pub eager_us: Option<f64>,
    /// Replayed from a `torch.cuda.CUDAGraph`, µs.
    pub graph_us: Option<f64>,
}

/// What `torch_report.py` writes.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct TorchReport {
    /// The GPU it ran on.
    #[serde(default)]
    pub device: String,
    /// `torch.__version__`.
    #[serde(default)]
    pub torch: String,
    /// Timings by key (`section/case`).
    #[serde(default)]
    pub cases: BTreeMap<String, TorchCase>,
    /// Cases it did not run, with the reason.
    #[serde(default)]
    pub skipped: BTreeMap<String, String>,
}

/// Reads `path`.
pub fn load(path: &str) -> Result<TorchReport> {
    // A file the user named that cannot be read is a usage error (exit 2), as a malformed one is.
    let text = std::fs::read_to_string(path).map_err(|e| ReportError::Usage(format!("--torch {path}: {e}")))?;
    serde_json::from_str(&text)
        .map_err(|e| ReportError::Usage(format!("--torch {path}: not a torch_report.py JSON: {e}")))
}

/// Copies the PyTorch timings into the matching rows and adds the summary row of the target
/// "every holdfast op faster than its plain-PyTorch equivalent under a CUDA graph".
pub fn merge(report: &mut Report, torch: &TorchReport) {
    let mut matched = 0usize;
    for r in &mut report.rows {
        if let Some(c) = torch.cases.get(&r.key()) {
            r.torch_eager_us = c.eager_us;
            r.torch_graph_us = c.graph_us;
            matched += 1;
        }
    }
    // The copy is the ceiling, not a holdfast op: it is in the table but not counted here.
    let is_op = |r: &Row| !(r.section == ceilings::SECTION && r.bound == Some(crate::report::Bound::Copy));
    let compared: Vec<&Row> =
        report.rows.iter().filter(|r| r.time_us.is_some() && r.torch_graph_us.is_some() && is_op(r)).collect();
    let faster = compared.iter().filter(|r| r.time_us.zip(r.torch_graph_us).is_some_and(|(a, b)| a < b)).count();
    let n = compared.len();
    report.notes.push(format!(
        "torch: {matched} of {} torch cases matched a row ({} skipped by the script)",
        torch.cases.len(),
        torch.skipped.len()
    ));
    if n > 0 {
        let slower: Vec<String> = compared
            .iter()
            .filter(|r| !r.time_us.zip(r.torch_graph_us).is_some_and(|(a, b)| a < b))
            .map(|r| r.key())
            .collect();
        let mut row = Row::value("summary", "ops faster than plain PyTorch under a CUDA graph", faster as f64, "ops")
            .with_portable_target(Target::AtLeast(n as f64))
            .with_note(format!("{faster} of {n}"));
        if !slower.is_empty() {
            row = row.with_note(format!("slower: {}", slower.join(", ")));
        }
        report.rows.push(row);
    }
}
