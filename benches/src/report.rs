//! Rows, targets, the printed table and the JSON document.

use serde::Serialize;

/// What a row's `fraction` is measured against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    /// Device-to-device copy bandwidth (read + write bytes per second).
    Copy,
    /// The large bf16 GEMM rate (cuBLAS where available, else holdfast's own GEMM).
    Gemm,
    /// The roofline of both: the time is compared with `max(bytes / copy, flops / gemm)`.
    Roofline,
}

/// A goal a row is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", content = "limit", rename_all = "snake_case")]
pub enum Target {
    /// `value ≤ limit` (µs, counts).
    AtMost(f64),
    /// `value ≥ limit` (ratios).
    AtLeast(f64),
    /// `fraction ≥ limit` of the row's bound.
    FractionAtLeast(f64),
    /// Faster than the plain-PyTorch equivalent under a CUDA graph (`holdfast / torch graph < 1`).
    FasterThanTorchGraph,
}

impl Target {
    /// The target as printed in the table.
    pub fn describe(&self, unit: &str) -> String {
        match self {
            Target::AtMost(v) => format!("<= {} {unit}", fmt_num(*v)).trim_end().to_string(),
            Target::AtLeast(v) => format!(">= {} {unit}", fmt_num(*v)).trim_end().to_string(),
            Target::FractionAtLeast(v) => format!(">= {:.0}%", v * 100.0),
            Target::FasterThanTorchGraph => "< torch graph".into(),
        }
    }
}

/// One measured case.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Row {
    /// The section (`ceilings`, `hal`, `graph`, `metadata`, `attention`, `mhc`, `dense`, `decode`).
    pub section: String,
    /// The case; `section/case` is the key the PyTorch JSON uses.
    pub case: String,
    /// Median time of one call, µs (device time from events on GPUs, host wall time where the
    /// row says so, wall time on the CPU backend).
    pub time_us: Option<f64>,
    /// Samples behind the median.
    pub samples: usize,
    /// For kernel rows: the same op enqueued eagerly back to back, µs per call (`time_us` is the
    /// op replayed from a graph of back-to-back launches).
    pub eager_us: Option<f64>,
    /// Bytes the op must move through device memory per call.
    pub bytes: Option<u64>,
    /// Floating-point operations per call.
    pub flops: Option<u64>,
    /// A value that is not a time (a count or a ratio), with `unit`.
    pub value: Option<f64>,
    /// The unit of `value`.
    pub unit: String,
    /// The ceiling `fraction` is measured against.
    pub bound: Option<Bound>,
    /// Achieved bandwidth, GB/s (from `bytes`).
    pub gbps: Option<f64>,
    /// Achieved rate, TFLOP/s (from `flops`).
    pub tflops: Option<f64>,
    /// Fraction of the bound reached (1.0 = at the ceiling).
    pub fraction: Option<f64>,
    /// The goal, if the row has one.
    pub target: Option<Target>,
    /// Whether the goal is met (`None`: no goal, or not measurable here).
    pub met: Option<bool>,
    /// The plain-PyTorch equivalent, eager, µs.
    pub torch_eager_us: Option<f64>,
    /// The plain-PyTorch equivalent replayed from a `torch.cuda.CUDAGraph`, µs.
    pub torch_graph_us: Option<f64>,
    /// `time_us / torch_graph_us` (below 1: holdfast is faster).
    pub vs_torch_graph: Option<f64>,
    /// Free text: how a number was measured, or why something was skipped.
    pub note: String,
    /// Whether the target is checked on the CPU backend too (counts such as host syncs); the
    /// performance targets are for GPUs and show `—` elsewhere.
    #[serde(skip)]
    pub portable_target: bool,
}

impl Row {
    /// A timed row.
    pub fn timed(section: &str, case: impl Into<String>, time_us: f64, samples: usize) -> Row {
        Row { section: section.into(), case: case.into(), time_us: Some(time_us), samples, ..Row::default() }
    }

    /// A row holding a count or a ratio.
    pub fn value(section: &str, case: impl Into<String>, value: f64, unit: &str) -> Row {
        Row { section: section.into(), case: case.into(), value: Some(value), unit: unit.into(), ..Row::default() }
    }

    /// The key shared with the PyTorch JSON.
    pub fn key(&self) -> String {
        format!("{}/{}", self.section, self.case)
    }

    /// Sets the bytes moved per call.
    pub fn with_bytes(mut self, bytes: u64) -> Row {
        self.bytes = Some(bytes);
        self
    }

    /// Sets the FLOPs per call.
    pub fn with_flops(mut self, flops: u64) -> Row {
        self.flops = Some(flops);
        self
    }

    /// Sets the bound `fraction` is computed against.
    pub fn with_bound(mut self, bound: Bound) -> Row {
        self.bound = Some(bound);
        self
    }

    /// Sets the target.
    pub fn with_target(mut self, target: Target) -> Row {
        self.target = Some(target);
        self
    }

    /// Sets a target that holds on every backend (a count, not a speed).
    pub fn with_portable_target(mut self, target: Target) -> Row {
        self.target = Some(target);
        self.portable_target = true;
        self
    }

    /// Sets the eager time per call.
    pub fn with_eager(mut self, eager_us: f64) -> Row {
        self.eager_us = Some(eager_us);
        self
    }

    /// Appends to the note.
    pub fn with_note(mut self, note: impl AsRef<str>) -> Row {
        if !self.note.is_empty() {
            self.note.push_str("; ");
        }
        self.note.push_str(note.as_ref());
        self
    }

    /// Fills the achieved rates, the fraction of the bound and whether the target is met (on a
    /// GPU, or anywhere for a portable target).
    pub fn finish(&mut self, ceilings: &Ceilings, gpu: bool) {
        let secs = self.time_us.filter(|t| t.is_finite() && *t > 0.0).map(|t| t * 1e-6);
        if let Some(s) = secs {
            self.gbps = self.bytes.map(|b| b as f64 / s / 1e9);
            self.tflops = self.flops.map(|f| f as f64 / s / 1e12);
        }
        self.fraction = match (self.bound, secs) {
            (Some(Bound::Copy), Some(_)) => self.gbps.zip(ceilings.copy_gbps).map(|(a, c)| a / c),
            (Some(Bound::Gemm), Some(_)) => self.tflops.zip(ceilings.gemm_tflops()).map(|(a, c)| a / c),
            (Some(Bound::Roofline), Some(s)) => {
                let mem = self.bytes.zip(ceilings.copy_gbps).map(|(b, c)| b as f64 / (c * 1e9));
                let math = self.flops.zip(ceilings.gemm_tflops()).map(|(f, c)| f as f64 / (c * 1e12));
                match (mem, math) {
                    (None, None) => None,
                    (m, f) => Some(m.unwrap_or(0.0).max(f.unwrap_or(0.0)) / s),
                }
            }
            _ => None,
        };
        self.vs_torch_graph = self.time_us.zip(self.torch_graph_us).map(|(a, b)| a / b);
        let value = self.value.filter(|v| v.is_finite());
        self.met = match self.target {
            None => None,
            Some(_) if !gpu && !self.portable_target => None,
            Some(Target::AtMost(l)) => value.or(self.time_us).map(|v| v <= l),
            Some(Target::AtLeast(l)) => value.map(|v| v >= l),
            Some(Target::FractionAtLeast(l)) => self.fraction.map(|f| f >= l),
            Some(Target::FasterThanTorchGraph) => self.vs_torch_graph.map(|r| r < 1.0),
        };
    }
}

/// The physical limits measured first.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Ceilings {
    /// Device-to-device copy bandwidth, GB/s, counting read + write bytes.
    pub copy_gbps: Option<f64>,
    /// Large bf16 GEMM rate of holdfast's GEMM, TFLOP/s.
    pub gemm_tflops_holdfast: Option<f64>,
    /// Large bf16 GEMM rate of cuBLAS, TFLOP/s (where available).
    pub gemm_tflops_cublas: Option<f64>,
}

impl Ceilings {
    /// The GEMM ceiling: cuBLAS where it ran, else holdfast's own large-GEMM rate.
    pub fn gemm_tflops(&self) -> Option<f64> {
        self.gemm_tflops_cublas.or(self.gemm_tflops_holdfast)
    }
}

/// The whole report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// The device name given (`cpu`, `cuda:0`).
    pub device: String,
    /// The device's marketing name.
    pub device_name: String,
    /// The driver version, where the backend exposes one, and whether its launches are dependent
    /// (`CUDA driver API 13.0, dependent launches on`).
    pub driver: Option<String>,
    /// The UTC date of the run (`YYYY-MM-DD`).
    pub date: String,
    /// Whether `--quick` shapes were used.
    pub quick: bool,
    /// Whether the device is a GPU (targets are checked on GPUs).
    pub gpu: bool,
    /// The sections run.
    pub sections: Vec<String>,
    /// The ceilings.
    pub ceilings: Ceilings,
    /// The PyTorch JSON merged in, if any.
    pub torch_source: Option<String>,
    /// Every row, in order.
    pub rows: Vec<Row>,
    /// Lines about skipped parts and failures.
    pub notes: Vec<String>,
    /// Sections (or ceilings) that failed with an error; the exit code is 1 when any did.
    pub failed: Vec<String>,
    /// Seconds the run took.
    pub seconds: f64,
}

/// `1234.5` → `1234.5`, `0.01234` → `0.0123`: about four significant digits.
pub fn fmt_num(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 10.0 {
        format!("{v:.2}")
    } else if a >= 0.01 || a == 0.0 {
        format!("{v:.3}")
    } else {
        format!("{v:.2e}")
    }
}

fn fmt_amount(bytes: Option<u64>, flops: Option<u64>) -> String {
    let scale = |v: u64, unit: &str| {
        let v = v as f64;
        let (d, p) = if v >= 1e12 {
            (1e12, "T")
        } else if v >= 1e9 {
            (1e9, "G")
        } else if v >= 1e6 {
            (1e6, "M")
        } else if v >= 1e3 {
            (1e3, "K")
        } else {
            (1.0, "")
        };
        format!("{} {p}{unit}", fmt_num(v / d))
    };
    match (bytes, flops) {
        (Some(b), Some(f)) => format!("{} / {}", scale(b, "B"), scale(f, "FLOP")),
        (Some(b), None) => scale(b, "B"),
        (None, Some(f)) => scale(f, "FLOP"),
        (None, None) => String::new(),
    }
}

impl Report {
    /// The table, one line per row, with torch columns when any row has them.
    pub fn table(&self) -> String {
        let torch = self.rows.iter().any(|r| r.torch_eager_us.is_some() || r.torch_graph_us.is_some());
        let mut head =
            vec!["section", "case", "time µs", "eager µs", "bytes / FLOPs", "achieved", "of ceiling", "target", "met"];
        if torch {
            head.extend(["torch eager µs", "torch graph µs", "holdfast / torch graph"]);
        }
        let opt = |v: Option<f64>| v.map(fmt_num).unwrap_or_default();
        let mut lines: Vec<Vec<String>> = Vec::new();
        for r in &self.rows {
            let time = match (r.time_us, r.value) {
                (Some(t), _) => fmt_num(t),
                (None, Some(v)) => format!("{} {}", fmt_num(v), r.unit).trim_end().to_string(),
                _ => String::new(),
            };
            let achieved = match (r.bound, r.gbps, r.tflops) {
                (Some(Bound::Gemm), _, Some(t)) => format!("{} TFLOP/s", fmt_num(t)),
                (Some(Bound::Roofline), Some(g), Some(t)) => {
                    format!("{} GB/s, {} TFLOP/s", fmt_num(g), fmt_num(t))
                }
                (_, Some(g), _) => format!("{} GB/s", fmt_num(g)),
                (_, None, Some(t)) => format!("{} TFLOP/s", fmt_num(t)),
                _ => String::new(),
            };
            let met = match (r.target, r.met) {
                (None, _) => String::new(),
                (Some(_), Some(true)) => "met".into(),
                (Some(_), Some(false)) => "NOT MET".into(),
                (Some(_), None) => "—".into(),
            };
            let mut line = vec![
                r.section.clone(),
                r.case.clone(),
                time,
                opt(r.eager_us),
                fmt_amount(r.bytes, r.flops),
                achieved,
                r.fraction.map(|f| format!("{:.1}%", f * 100.0)).unwrap_or_default(),
                r.target.map(|t| t.describe(&r.unit)).unwrap_or_default(),
                met,
            ];
            if torch {
                line.extend([
                    opt(r.torch_eager_us),
                    opt(r.torch_graph_us),
                    r.vs_torch_graph.map(|v| format!("{v:.2}×")).unwrap_or_default(),
                ]);
            }
            lines.push(line);
        }
        let mut width: Vec<usize> = head.iter().map(|h| h.chars().count()).collect();
        for l in &lines {
            for (w, c) in width.iter_mut().zip(l) {
                *w = (*w).max(c.chars().count());
            }
        }
        let pad = |cells: &[String]| -> String {
            let mut s = String::new();
            for (i, (c, w)) in cells.iter().zip(&width).enumerate() {
                if i > 0 {
                    s.push_str(" | ");
                }
                s.push_str(c);
                s.extend(std::iter::repeat_n(' ', w - c.chars().count()));
            }
            s.trim_end().to_string()
        };
        let mut out = String::new();
        out.push_str(&pad(&head.iter().map(|h| h.to_string()).collect::<Vec<_>>()));
        out.push('\n');
        out.push_str(&width.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("-|-"));
        out.push('\n');
        for l in &lines {
            out.push_str(&pad(l));
            out.push('\n');
        }
        out
    }

    /// Targets met and checked, over all rows that have a target and a verdict.
    pub fn targets_met(&self) -> (usize, usize) {
        let checked: Vec<bool> = self.rows.iter().filter_map(|r| r.met).collect();
        (checked.iter().filter(|m| **m).count(), checked.len())
    }
}

/// Today's UTC date as `YYYY-MM-DD` (civil-from-days over the Unix epoch).
pub fn utc_date() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_fraction_takes_the_slower_limit() {
        let c = Ceilings { copy_gbps: Some(1000.0), gemm_tflops_holdfast: Some(100.0), gemm_tflops_cublas: None };
        // 1 GB at 1000 GB/s = 1 ms; 10 TFLOP at 100 TFLOP/s = 100 ms: bound by math.
        let mut r = Row::timed("dense", "x", 200_000.0, 1).with_bytes(1_000_000_000).with_flops(10_000_000_000_000);
        r = r.with_bound(Bound::Roofline).with_target(Target::FractionAtLeast(0.4));
        r.finish(&c, true);
        assert!((r.fraction.unwrap_or(0.0) - 0.5).abs() < 1e-9);
        assert_eq!(r.met, Some(true));
    }

    #[test]
    fn a_target_without_a_measurement_has_no_verdict() {
        let mut r = Row::timed("mhc", "x", 1.0, 1).with_bound(Bound::Copy).with_target(Target::FractionAtLeast(0.5));
        r.finish(&Ceilings::default(), true);
        assert_eq!(r.met, None);
    }

    #[test]
    fn date_is_iso() {
        let d = utc_date();
        assert_eq!(d.len(), 10);
        assert!(d.starts_with("20"));
    }
}
