//! Command-line options (clap derive) and how they become a model config and runner settings.

use std::path::PathBuf;
use std::str::FromStr;

use clap::{Args, Parser, Subcommand};
use holdfast_graph::{CaptureSizeConfig, CaptureSizes, GraphMode};
use holdfast_hal::Device;
use holdfast_model::{ModelConfig, ModelError, RunnerSettings};

use crate::error::CliError;

/// Serve DeepSeek-V4-shaped models with graphs that change speed, not results.
#[derive(Debug, Parser)]
#[command(name = "holdfast", version, about, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve one seeded request stream under each graph mode; compare speed, graphs and tokens.
    Simulate(SimulateArgs),
    /// Show the resolved graph mode, capture sizes, graph keys and memory, without serving.
    Plan(PlanArgs),
}

/// Options shared by every subcommand: the device, the model and the runner's limits.
#[derive(Debug, Args)]
pub struct Common {
    /// Device: `cpu`, `cuda:N` or `rocm:N` (GPU backends need the `cuda` / `rocm` feature).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Model preset.
    #[arg(long, value_parser = ["tiny", "flash-slice", "pro-slice"], conflicts_with = "config")]
    pub preset: Option<String>,
    /// A Hugging Face-style `config.json` (instead of a preset).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Capture sizes, in tokens, comma-separated (default: the reference's list up to the limits).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...")]
    pub capture_sizes: Option<Vec<u32>>,
    /// Largest capture size, in tokens.
    #[arg(long, value_name = "N")]
    pub max_capture_size: Option<u32>,
    /// Seed of the weights and of the request stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most requests in one step.
    #[arg(long, default_value_t = 16)]
    pub max_num_seqs: usize,
    /// Most tokens in one step (prefill chunks and decodes together).
    #[arg(long, default_value_t = 128)]
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output), in tokens.
    #[arg(long, default_value_t = 512)]
    pub max_model_len: usize,
    /// Longest prefill chunk of one request per step, in tokens (0: only the token budget limits).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub long_prefill_threshold: usize,
    /// Blocks sharing each attention row (1, 2, 4 or 8) on the warpgroup attention kernel
    /// (NVIDIA sm_90a, head_dim 512): more cut one request's latency over long contexts, fewer
    /// keep large batches fast (default: 1 where --max-num-seqs rows fill the GPU, else the
    /// kernel's 2). An error on other devices and shapes.
    #[arg(long, value_name = "N")]
    pub attention_split: Option<usize>,
}

impl Common {
    /// The model configuration: `--config`, else `--preset` (default `tiny`).
    pub fn model_config(&self) -> Result<(String, ModelConfig), CliError> {
        match &self.config {
            Some(path) => Ok((path.display().to_string(), ModelConfig::from_file(path)?)),
            None => {
                let name = self.preset.as_deref().unwrap_or("tiny");
                Ok((name.to_owned(), ModelConfig::preset(name)?))
            }
        }
    }

    /// Runner settings for `mode`.
    pub fn settings(&self, mode: GraphMode) -> RunnerSettings {
        RunnerSettings {
            graph_mode: mode,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            capture_sizes: self.capture_sizes.clone(),
            max_capture_size: self.max_capture_size,
            kv_num_blocks: None,
            seed: self.seed,
            long_prefill_token_threshold: self.long_prefill_threshold,
            attention_row_split: self.attention_split,
        }
    }

    /// The capture sizes the flags give under `mode` (none where `mode` captures nothing), as
    /// the runner builds them from the same settings.
    pub fn capture_sizes(&self, mode: GraphMode) -> Result<CaptureSizes, CliError> {
        if mode == GraphMode::None {
            return Ok(CaptureSizes::empty());
        }
        let mut size_cfg = CaptureSizeConfig::new(
            mode,
            u32::try_from(self.max_num_seqs).unwrap_or(u32::MAX),
            u32::try_from(self.max_num_batched_tokens).unwrap_or(u32::MAX),
        );
        size_cfg.capture_sizes = self.capture_sizes.clone();
        size_cfg.max_capture_size = self.max_capture_size;
        Ok(CaptureSizes::build(&size_cfg).map_err(ModelError::from)?)
    }

    /// What the capture-size rules changed in the user's sizes under `mode` (a maximum truncated
    /// to the largest size it allows, sizes above the token budget dropped), one line each;
    /// none where `mode` captures nothing or the sizes are refused (the runner says why).
    pub fn capture_size_notes(&self, mode: GraphMode) -> Vec<String> {
        self.capture_sizes(mode)
            .map(|s| s.warnings().iter().map(|w| format!("{mode}: {w}")).collect())
            .unwrap_or_default()
    }

    /// Opens `--backend`.
    pub fn device(&self) -> Result<Device, CliError> {
        Ok(Device::open(&self.backend)?)
    }

    /// The devices of `ranks` tensor-parallel ranks: `ranks` CPU devices for `cpu`, else the
    /// `ranks` consecutive devices from `--backend`'s ordinal (`cuda:2` with 2 ranks: `cuda:2`,
    /// `cuda:3`).
    pub fn devices(&self, ranks: usize) -> Result<Vec<Device>, CliError> {
        let first_device = self.device()?;
        if ranks <= 1 || first_device.backend() == holdfast_hal::BackendKind::Cpu {
            let mut all = vec![first_device];
            for _ in 1..ranks {
                all.push(self.device()?);
            }
            return Ok(all);
        }
        let (kind, first) = self
            .backend
            .trim()
            .split_once(':')
            .and_then(|(k, n)| n.trim().parse::<usize>().ok().map(|n| (k.trim().to_ascii_lowercase(), n)))
            .ok_or_else(|| CliError::Usage(format!("--backend {}: expected cpu or KIND:N", self.backend)))?;
        let mut all = vec![first_device];
        for i in 1..ranks {
            let ordinal = first.checked_add(i).ok_or_else(|| {
                CliError::Usage(format!("--backend {}: {ranks} ranks from ordinal {first} overflow", self.backend))
            })?;
            all.push(Device::open(&format!("{kind}:{ordinal}"))?);
        }
        Ok(all)
    }
}

/// A list of graph modes: `all`, or comma-separated names (`none,full_and_piecewise`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModeList(pub Vec<GraphMode>);

impl FromStr for ModeList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("all") {
            return Ok(ModeList(GraphMode::ALL.to_vec()));
        }
        let mut modes = Vec::new();
        for part in s.split(',') {
            let m: GraphMode = part.parse().map_err(|e: holdfast_graph::GraphError| e.to_string())?;
            if !modes.contains(&m) {
                modes.push(m);
            }
        }
        Ok(ModeList(modes))
    }
}

/// A length distribution: `N` (fixed) or `A..B` (uniform over `A..=B`), in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LenRange {
    /// Shortest, in tokens.
    pub min: usize,
    /// Longest, in tokens.
    pub max: usize,
}

impl FromStr for LenRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| t.trim().parse::<usize>().map_err(|_| format!("`{t}` is not a token count"));
        let (min, max) = match s.split_once("..") {
            Some((a, b)) => (num(a)?, num(b.trim_start_matches('='))?),
            None => {
                let n = num(s)?;
                (n, n)
            }
        };
        if min == 0 || min > max {
            return Err(format!("`{s}`: expected N or A..B with 1 <= A <= B"));
        }
        Ok(LenRange { min, max })
    }
}

impl std::fmt::Display for LenRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..{}", self.min, self.max)
        }
    }
}

/// Options of `holdfast simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// Device, model and limits.
    #[command(flatten)]
    pub common: Common,
    /// Graph modes to run: `all` or a comma-separated list.
    #[arg(long, default_value = "all", conflicts_with = "mode")]
    pub modes: ModeList,
    /// Run one graph mode only (shorthand for `--modes MODE`).
    #[arg(long)]
    pub mode: Option<GraphMode>,
    /// Requests in the stream (1 to 1048576).
    #[arg(long, default_value_t = 48)]
    pub requests: usize,
    /// Prompt lengths, in tokens: `N` or `A..B` (uniform).
    #[arg(long, default_value = "8..96", value_name = "N|A..B")]
    pub prompt_len: LenRange,
    /// Output lengths, in tokens: `N` or `A..B` (uniform).
    #[arg(long, default_value = "4..32", value_name = "N|A..B")]
    pub output_len: LenRange,
    /// Mean new requests per step (exponential gaps); 0 puts every request in the queue at once.
    #[arg(long, default_value_t = 1.0, value_name = "RATE")]
    pub arrival_rate: f64,
    /// Most requests in flight (admitted and unfinished); default: `--max-num-seqs`.
    #[arg(long, value_name = "N")]
    pub concurrency: Option<usize>,
    /// Tensor-parallel ranks, one thread each: on `cpu` emulated ranks in this process, on
    /// `cuda:K` the devices `cuda:K` … `cuda:K+N-1` (NCCL). The table reports rank 0; every
    /// rank must produce the same tokens.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub tensor_parallel: usize,
    /// Write the report as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// No progress bars or notes on stderr (the table and the verdict still print).
    #[arg(long, short)]
    pub quiet: bool,
}

impl SimulateArgs {
    /// The modes to run, in order.
    pub fn modes(&self) -> Vec<GraphMode> {
        match self.mode {
            Some(m) => vec![m],
            None => self.modes.0.clone(),
        }
    }
}

/// Options of `holdfast plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Device, model and limits.
    #[command(flatten)]
    pub common: Common,
    /// The configured graph mode.
    #[arg(long, default_value = "full_and_piecewise")]
    pub mode: GraphMode,
    /// Print the plan as JSON on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}
