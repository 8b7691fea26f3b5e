//! # holdfast-benches: the GPU performance report
//!
//! `gpu-report` measures, on one device in one run, the physical limits first (device-to-device
//! copy bandwidth counting read + write bytes; a large bf16 GEMM through holdfast's GEMM and,
//! where it loads, cuBLAS) and then every layer against them:
//!
//! | section | what |
//! |---|---|
//! | `ceilings` | copy bandwidth, large-GEMM rate (holdfast, cuBLAS) |
//! | `hal` | eager launch and graph launch on the host, per-node device time, pinned upload, the HAL's overhead over raw cudarc |
//! | `graph` | capture + instantiate + upload per node, dispatcher host time per step |
//! | `metadata` | attention metadata per decode step: host µs per builder, host syncs, device µs |
//! | `attention` | ragged sparse attention with sink at decode shapes |
//! | `mhc` | `hc_head`, `mhc_pre`, `mhc_post`, fused post + pre |
//! | `dense` | every GEMM of a V4-Flash layer and the LM head at t = 1 … 256; RMSNorm |
//! | `decode` | a whole decode step per graph mode at batch 1, 8, 64, 256 |
//!
//! Each row has a median time (CUDA events on GPUs, wall time on the CPU backend; see
//! [`timing`]), the bytes or FLOPs one call must move or do (counted by the report from the
//! shapes; each section's docs say how), the achieved rate and its fraction of the ceiling, and
//! where the issue sets one, a target and whether it is met. `torch_report.py` runs the same
//! cases in plain PyTorch (eager and under `torch.cuda.CUDAGraph`); `--torch` merges its JSON
//! into the same table.
//!
//! [`main_with_args`] is the binary's whole body; [`run`] is the library entry the tests call.

pub mod attention;
pub mod ceilings;
pub mod ctx;
pub mod cublas;
pub mod decode;
pub mod dense;
pub mod error;
pub mod graph_section;
pub mod hal_section;
pub mod metadata;
pub mod mhc;
pub mod report;
pub mod timing;
pub mod torch;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use clap::Parser;
use holdfast_hal::{BackendKind, Device, DeviceName};

pub use ctx::{Ctx, Scale};
pub use error::{ReportError, Result};
pub use report::{Bound, Ceilings, Report, Row, Target};

/// The report's sections, in run order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Section {
    /// Copy bandwidth and GEMM rate.
    Ceilings,
    /// HAL launch and replay overheads.
    Hal,
    /// Capture cost per node, dispatch.
    Graph,
    /// Attention metadata builders.
    Metadata,
    /// Ragged sparse attention.
    Attention,
    /// mHC ops.
    Mhc,
    /// GEMMs at the model's shapes, RMSNorm.
    Dense,
    /// End-to-end decode step per graph mode.
    Decode,
}

impl Section {
    /// Every section, in run order.
    pub const ALL: [Section; 8] = [
        Section::Ceilings,
        Section::Hal,
        Section::Graph,
        Section::Metadata,
        Section::Attention,
        Section::Mhc,
        Section::Dense,
        Section::Decode,
    ];

    /// The section's name (`--only` and the rows' `section`).
    pub fn name(self) -> &'static str {
        match self {
            Section::Ceilings => ceilings::SECTION,
            Section::Hal => hal_section::SECTION,
            Section::Graph => graph_section::SECTION,
            Section::Metadata => metadata::SECTION,
            Section::Attention => attention::SECTION,
            Section::Mhc => mhc::SECTION,
            Section::Dense => dense::SECTION,
            Section::Decode => decode::SECTION,
        }
    }
}

impl FromStr for Section {
    type Err = ReportError;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        Section::ALL.into_iter().find(|x| x.name() == t).ok_or_else(|| {
            let names: Vec<&str> = Section::ALL.iter().map(|x| x.name()).collect();
            ReportError::Usage(format!("unknown section {s:?}; known: {}", names.join(", ")))
        })
    }
}

/// What one run does.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Device name: `cpu`, `cuda:N`, `rocm:N`.
    pub device: String,
    /// Small shapes and few iterations.
    pub quick: bool,
    /// Sections to run (all when empty).
    pub only: Vec<Section>,
    /// Only the rows whose case name contains one of these (all when empty); the copy ceiling,
    /// which every fraction needs, always runs.
    pub cases: Vec<String>,
    /// A `torch_report.py` JSON to merge.
    pub torch: Option<String>,
    /// Print progress lines on stderr.
    pub verbose: bool,
}

/// `gpu-report`'s command line.
#[derive(Debug, Parser)]
#[command(name = "gpu-report", about = "holdfast GPU performance report: every layer against its physical limit")]
struct Cli {
    /// Device: cpu, cuda:N or rocm:N (default: $HOLDFAST_DEVICE, else cpu).
    #[arg(long)]
    device: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Merge the JSON written by torch_report.py (adds the torch columns).
    #[arg(long)]
    torch: Option<String>,
    /// Small shapes and few iterations (the CPU backend; well under a minute).
    #[arg(long)]
    quick: bool,
    /// Comma-separated sections: ceilings, hal, graph, metadata, attention, mhc, dense, decode.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Comma-separated pieces of case names: only the rows whose case contains one of them run
    /// (for example `--cases "h128_d512 swa128+512 B=64,T=16384"`); the copy ceiling always runs.
    #[arg(long, value_delimiter = ',')]
    cases: Vec<String>,
    /// Write the cases torch_report.py should run (same shapes and keys) to this file and exit.
    #[arg(long)]
    emit_plan: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
}

fn write(path: &PathBuf, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| ReportError::Io { path: path.display().to_string(), source })
}

/// The binary: parses `args` (program name first), runs, prints; returns the exit code (0 ok,
/// 1 a section failed or a file could not be written, 2 a bad option or an unusable device).
pub fn main_with_args<I: IntoIterator<Item = String>>(args: I) -> i32 {
    let cli = match Cli::try_parse_from(args) {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let only: Result<Vec<Section>> = cli.only.iter().filter(|s| !s.trim().is_empty()).map(|s| s.parse()).collect();
    let only = match only {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: --only: {e}");
            return 2;
        }
    };
    let scale = if cli.quick { Scale::Quick } else { Scale::Full };
    if let Some(path) = &cli.emit_plan {
        let text = serde_json::to_string_pretty(&torch::plan(scale)).unwrap_or_default();
        return match write(path, &text) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        };
    }
    // The report's file must be writable before the run starts, not found unwritable after it.
    if let Some(path) = &cli.json {
        if let Err(e) = std::fs::OpenOptions::new().write(true).create(true).truncate(false).open(path) {
            eprintln!("error: --json {}: {e}", path.display());
            return 2;
        }
    }
    let device = cli.device.or_else(|| std::env::var("HOLDFAST_DEVICE").ok()).unwrap_or_else(|| "cpu".into());
    let cases = cli.cases.into_iter().filter(|c| !c.trim().is_empty()).collect();
    let opts = Options { device, quick: cli.quick, only, cases, torch: cli.torch, verbose: !cli.quiet };
    let report = match run(&opts) {
        Ok(r) => r,
        Err(e @ ReportError::Usage(_)) => {
            eprintln!("error: {e}");
            return 2;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    print!("{}", report.table());
    for n in &report.notes {
        println!("note: {n}");
    }
    let (met, checked) = report.targets_met();
    println!(
        "targets: {met} of {checked} met; device {} ({}), {} s",
        report.device_name,
        report.driver.as_deref().unwrap_or("no driver version"),
        report::fmt_num(report.seconds)
    );
    let mut code = if report.failed.is_empty() { 0 } else { 1 };
    if let Some(path) = &cli.json {
        match serde_json::to_string_pretty(&report) {
            Ok(text) => {
                if let Err(e) = write(path, &text) {
                    eprintln!("error: {e}");
                    code = 1;
                }
            }
            Err(e) => {
                eprintln!("error: JSON: {e}");
                code = 1;
            }
        }
    }
    code
}

/// The driver version where the backend exposes one, and whether launches are dependent there.
fn driver_version(dev: &Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if dev.backend() == BackendKind::Cuda {
        let mut v: std::ffi::c_int = 0;
        // SAFETY: the device opened, so libcuda is loaded; the call writes one int.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        if r == cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS {
            let dependent = if dev.info().dependent_launch { "on" } else { "off" };
            return Some(format!("CUDA driver API {}.{}, dependent launches {dependent}", v / 1000, (v % 1000) / 10));
        }
    }
    let _ = dev;
    None
}

/// Runs the report: opens the device, measures the ceilings, then each selected section. A
/// section that fails is a `failed` note and the others still run; a bad device name or a
/// device that cannot be opened is [`ReportError::Usage`].
pub fn run(opts: &Options) -> Result<Report> {
    let t0 = Instant::now();
    let name = DeviceName::from_str(&opts.device).map_err(|e| ReportError::Usage(format!("--device: {e}")))?;
    let dev = Device::open(&opts.device).map_err(|e| ReportError::Usage(format!("device {name}: {e}")))?;
    let gpu = dev.backend() != BackendKind::Cpu;
    let effort = match (opts.quick, gpu) {
        (true, _) => timing::Effort::QUICK,
        (false, true) => timing::Effort::GPU,
        (false, false) => timing::Effort::CPU,
    };
    let scale = if opts.quick { Scale::Quick } else { Scale::Full };
    let sections: Vec<Section> = if opts.only.is_empty() {
        Section::ALL.to_vec()
    } else {
        Section::ALL.into_iter().filter(|s| opts.only.contains(s)).collect()
    };
    let mut report = Report {
        device: name.to_string(),
        device_name: dev.info().name.clone(),
        driver: driver_version(&dev),
        date: report::utc_date(),
        quick: opts.quick,
        gpu,
        sections: sections.iter().map(|s| s.name().to_string()).collect(),
        ..Report::default()
    };
    let torch = opts.torch.as_deref().map(torch::load).transpose()?;
    if opts.verbose {
        eprintln!(
            "gpu-report: {} ({}), {}, sections {}",
            report.device_name,
            report.device,
            report.driver.as_deref().unwrap_or("no driver version"),
            report.sections.join(",")
        );
        if !gpu && !opts.quick {
            eprintln!("gpu-report: the CPU backend runs the full GPU shapes slowly; --quick picks small ones");
        }
    }
    let s = dev.create_stream()?;
    let clock = timing::Clock::new(&dev, effort)?;
    let mut ctx =
        Ctx { dev, s, clock, scale, ceilings: Ceilings::default(), notes: Vec::new(), cases: opts.cases.clone() };
    if !opts.cases.is_empty() {
        ctx.note(format!("rows limited to the cases containing one of: {}", opts.cases.join(" | ")));
    }
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    let progress = |what: &str, t: Instant, n: usize| {
        if opts.verbose {
            eprintln!("gpu-report: {what}: {n} rows in {:.1} s", t.elapsed().as_secs_f64());
        }
    };

    // The copy ceiling always runs (every GB/s fraction needs it); the GEMM ceilings run with
    // the sections that use them.
    let t = Instant::now();
    match ceilings::copy(&mut ctx) {
        Ok(r) => rows.push(r),
        Err(e) => {
            ctx.note(format!("ceilings: copy failed: {e}"));
            failed.push("ceilings/copy".to_string());
        }
    }
    if sections.iter().any(|s| matches!(s, Section::Ceilings | Section::Dense)) {
        match ceilings::gemm(&mut ctx) {
            Ok(r) => rows.push(r),
            Err(e) => {
                ctx.note(format!("ceilings: gemm failed: {e}"));
                failed.push("ceilings/gemm".to_string());
            }
        }
        rows.extend(ceilings::cublas(&mut ctx));
    }
    progress("ceilings", t, rows.len());

    for sec in sections {
        let t = Instant::now();
        let res = match sec {
            Section::Ceilings => continue,
            Section::Hal => hal_section::run(&mut ctx),
            Section::Graph => graph_section::run(&mut ctx),
            Section::Metadata => metadata::run(&mut ctx),
            Section::Attention => attention::run(&mut ctx),
            Section::Mhc => mhc::run(&mut ctx),
            Section::Dense => dense::run(&mut ctx),
            Section::Decode => decode::run(&mut ctx),
        };
        // A failed section may leave a capture open; end it so the next section can run.
        if ctx.s.is_capturing() {
            let _ = ctx.s.abort_capture();
        }
        match res {
            Ok(mut r) => {
                // Sections that cannot tell a row's case before measuring it drop it here.
                r.retain(|row| ctx.wants(&row.case));
                progress(sec.name(), t, r.len());
                rows.extend(r);
            }
            Err(e) => {
                ctx.note(format!("{}: failed: {e}", sec.name()));
                failed.push(sec.name().to_string());
            }
        }
    }
    if !opts.cases.is_empty() && rows.iter().all(|r| r.section == ceilings::SECTION) {
        ctx.note(format!("no row of sections {} has a case containing one of the --cases", report.sections.join(",")));
    }
    report.ceilings = ctx.ceilings;
    report.rows = rows;
    report.notes = std::mem::take(&mut ctx.notes);
    report.failed = failed;
    if let (Some(t), Some(path)) = (&torch, &opts.torch) {
        report.torch_source = Some(format!("{path} (torch {}, {})", t.torch, t.device));
        torch::merge(&mut report, t);
    }
    let ceilings = report.ceilings;
    for r in &mut report.rows {
        r.finish(&ceilings, gpu);
    }
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
