//! Model configuration: the architecture read from a Hugging Face-style `config.json` (field
//! names as DeepSeek-V4 publishes them), validated, plus presets.
//!
//! Validation names the field and what is allowed, so a malformed or inconsistent file fails at
//! load with a message a user can act on, never later inside a kernel.

use std::path::Path;

use holdfast_attention::LayerKind;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The hyper-connection `post_mult` (`hc_post_alpha`), fixed by the architecture.
pub const HC_POST_ALPHA: f32 = 2.0;

/// Compress ratios a layer may declare: 0 and 1 (sliding window only), 4 (c4a), 128 (c128a).
pub const ALLOWED_RATIOS: [u32; 4] = [0, 1, 4, 128];

/// The architecture of a DeepSeek-V4-shaped decoder.
///
/// Field names are those of the published `config.json`; fields of the file that this model does
/// not use (MoE routing, quantization, YaRN scaling) are accepted and ignored. Dimensions are in
/// elements, `*_theta` are RoPE bases, `*_eps` are added inside a square root or a denominator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Hidden size `H` (4096 Flash, 7168 Pro).
    pub hidden_size: usize,
    /// Decoder layers (the MTP layer is not part of the forward).
    pub num_hidden_layers: usize,
    /// Query heads of the attention (a single latent KV head is shared: MQA).
    pub num_attention_heads: usize,
    /// Width of each query head and of the latent KV entry (512; NoPE + RoPE parts).
    pub head_dim: usize,
    /// The trailing RoPE part of `head_dim` (64).
    pub qk_rope_head_dim: usize,
    /// Rank of the query low-rank projection.
    pub q_lora_rank: usize,
    /// Groups of the grouped output projection (`heads · head_dim / o_groups` inputs each).
    pub o_groups: usize,
    /// Output rank of each group of the grouped output projection.
    pub o_lora_rank: usize,
    /// Sliding window of every layer, in tokens.
    pub sliding_window: usize,
    /// Per layer compress ratio (0/1 SWA only, 4 c4a, 128 c128a); `num_hidden_layers` entries,
    /// or one more (the MTP layer's, ignored).
    pub compress_ratios: Vec<u32>,
    /// Indexer query heads (c4a layers).
    #[serde(default)]
    pub index_n_heads: usize,
    /// Indexer head width (c4a layers).
    #[serde(default)]
    pub index_head_dim: usize,
    /// Compressed entries each c4a query attends to.
    #[serde(default)]
    pub index_topk: usize,
    /// Residual streams `n` of the hyper-connections (4).
    pub hc_mult: usize,
    /// Sinkhorn normalisations of the `mhc_pre` mixing matrix.
    pub hc_sinkhorn_iters: usize,
    /// Hyper-connection epsilon (pre weights and Sinkhorn).
    pub hc_eps: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// RoPE base of sliding-window-only layers.
    pub rope_theta: f32,
    /// RoPE base of compressed layers and of compressed entries.
    pub compress_rope_theta: f32,
    /// Longest position the model supports.
    pub max_position_embeddings: usize,
    /// Width of the dense SwiGLU FFN (the `moe_intermediate_size` of the published configs: the
    /// FFN here is one dense expert).
    #[serde(alias = "intermediate_size")]
    pub moe_intermediate_size: usize,
    /// Clamp of the SwiGLU inputs (`f32::INFINITY` disables it).
    #[serde(default = "default_swiglu_limit")]
    pub swiglu_limit: f32,
}

fn default_swiglu_limit() -> f32 {
    10.0
}

fn err(field: &'static str, detail: impl Into<String>) -> ModelError {
    ModelError::Config { field, detail: detail.into() }
}

impl ModelConfig {
    /// Parses and validates a `config.json` text.
    pub fn from_json(text: &str) -> Result<Self> {
        let cfg: ModelConfig =
            serde_json::from_str(text).map_err(|e| err("config.json", format!("not a valid model config: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and validates a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| err("config.json", format!("cannot read {}: {e}", path.display())))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Config { field, detail } => err(field, format!("{detail} (in {})", path.display())),
            other => other,
        })
    }

    /// The configuration as pretty JSON (round-trips through [`ModelConfig::from_json`]).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A preset by name: `tiny`, `flash-slice` or `pro-slice`.
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "flash-slice" => Ok(Self::flash_slice()),
            "pro-slice" => Ok(Self::pro_slice()),
            other => Err(err("preset", format!("unknown preset {other:?}; known: tiny, flash-slice, pro-slice"))),
        }
    }

    /// A small model with one layer of each kind (SWA only, c4a, c128a, SWA only) that runs on the
    /// CPU backend in seconds: `H = 64`, 2 heads of 64, window 16, top-k 8, vocab 256.
    pub fn tiny() -> Self {
        ModelConfig {
            hidden_size: 64,
            num_hidden_layers: 4,
            num_attention_heads: 2,
            head_dim: 64,
            qk_rope_head_dim: 16,
            q_lora_rank: 32,
            o_groups: 2,
            o_lora_rank: 32,
            sliding_window: 16,
            compress_ratios: vec![0, 4, 128, 0, 0],
            index_n_heads: 2,
            index_head_dim: 32,
            index_topk: 8,
            hc_mult: 4,
            hc_sinkhorn_iters: 8,
            hc_eps: 1e-6,
            rms_norm_eps: 1e-6,
            vocab_size: 256,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            max_position_embeddings: 4096,
            moe_intermediate_size: 128,
            swiglu_limit: 10.0,
        }
    }

    /// DeepSeek-V4-Flash per-layer dimensions with 4 layers (SWA only, SWA only, c4a, c128a).
    pub fn flash_slice() -> Self {
        ModelConfig {
            hidden_size: 4096,
            num_hidden_layers: 4,
            num_attention_heads: 64,
            head_dim: 512,
            qk_rope_head_dim: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            sliding_window: 128,
            compress_ratios: vec![0, 0, 4, 128, 0],
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 512,
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_norm_eps: 1e-6,
            vocab_size: 129280,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            max_position_embeddings: 1 << 20,
            moe_intermediate_size: 2048,
            swiglu_limit: 10.0,
        }
    }

    /// DeepSeek-V4-Pro per-layer dimensions with 3 layers (c128a, c4a, c128a).
    pub fn pro_slice() -> Self {
        ModelConfig {
            hidden_size: 7168,
            num_hidden_layers: 3,
            num_attention_heads: 128,
            head_dim: 512,
            qk_rope_head_dim: 64,
            q_lora_rank: 1536,
            o_groups: 16,
            o_lora_rank: 1024,
            sliding_window: 128,
            compress_ratios: vec![128, 4, 128, 0],
            index_n_heads: 64,
            index_head_dim: 128,
            index_topk: 1024,
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            hc_eps: 1e-6,
            rms_norm_eps: 1e-6,
            vocab_size: 129280,
            rope_theta: 10000.0,
            compress_rope_theta: 160000.0,
            max_position_embeddings: 1 << 20,
            moe_intermediate_size: 3072,
            swiglu_limit: 10.0,
        }
    }

    /// The kind of decoder layer `layer` (< `num_hidden_layers`).
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        match self.compress_ratios.get(layer).copied().unwrap_or(0) {
            4 => LayerKind::C4a,
            128 => LayerKind::C128a,
            _ => LayerKind::SwaOnly,
        }
    }

    /// The compress ratio of `layer` (1 for sliding-window-only layers).
    pub fn ratio(&self, layer: usize) -> usize {
        match self.layer_kind(layer) {
            LayerKind::C4a => 4,
            LayerKind::C128a => 128,
            LayerKind::SwaOnly => 1,
        }
    }

    /// Whether any layer is c4a (the model then needs the indexer).
    pub fn has_c4a(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.layer_kind(l) == LayerKind::C4a)
    }

    /// Whether any layer is c128a.
    pub fn has_c128a(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.layer_kind(l) == LayerKind::C128a)
    }

    /// The RoPE base of `layer`'s queries and keys.
    pub fn layer_rope_theta(&self, layer: usize) -> f32 {
        if self.layer_kind(layer) == LayerKind::SwaOnly {
            self.rope_theta
        } else {
            self.compress_rope_theta
        }
    }

    /// Parameters of the model, in elements (embedding and LM head included).
    pub fn parameter_count(&self) -> u64 {
        let (h, v, d) = (self.hidden_size as u64, self.vocab_size as u64, self.head_dim as u64);
        let heads = self.num_attention_heads as u64;
        let n = self.hc_mult as u64;
        let m3 = n * (n + 2);
        let mut total = 2 * v * h + h + n * n * h + n + 1;
        for l in 0..self.num_hidden_layers {
            let q = self.q_lora_rank as u64;
            let f = self.moe_intermediate_size as u64;
            let attn = h * q
                + q
                + q * heads * d
                + h * d
                + d
                + heads * d * self.o_lora_rank as u64
                + self.o_groups as u64 * self.o_lora_rank as u64 * h
                + heads
                + h;
            let ffn = 3 * h * f + h;
            let hc = 2 * (m3 * n * h + m3 + 3);
            let comp = match self.layer_kind(l) {
                LayerKind::SwaOnly => 0,
                LayerKind::C128a => 2 * d * h + 128 * d + d,
                LayerKind::C4a => {
                    let (ih, id) = (self.index_n_heads as u64, self.index_head_dim as u64);
                    2 * d * h + 4 * d + d + q * ih * id + h * ih + 2 * id * h + 4 * id + id
                }
            };
            total += attn + ffn + hc + comp;
        }
        total
    }

    /// Checks that `size` tensor-parallel ranks can split this model: query heads, output groups
    /// and the FFN width must each divide by `size` (at least 1).
    pub fn validate_tp(&self, size: usize) -> Result<()> {
        if size == 0 {
            return Err(err("tensor_parallel_size", "must be at least 1, got 0"));
        }
        for (field, v) in [
            ("num_attention_heads", self.num_attention_heads),
            ("o_groups", self.o_groups),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ] {
            if !v.is_multiple_of(size) {
                return Err(err(field, format!("{v} is not divisible by the tensor-parallel size {size}")));
            }
        }
        Ok(())
    }

    /// Checks every field and their consistency; the error names the first bad field.
    pub fn validate(&self) -> Result<()> {
        let positive = |field: &'static str, v: usize| {
            if v == 0 {
                Err(err(field, "must be at least 1, got 0"))
            } else {
                Ok(())
            }
        };
        positive("hidden_size", self.hidden_size)?;
        positive("num_hidden_layers", self.num_hidden_layers)?;
        positive("num_attention_heads", self.num_attention_heads)?;
        positive("q_lora_rank", self.q_lora_rank)?;
        positive("o_lora_rank", self.o_lora_rank)?;
        positive("o_groups", self.o_groups)?;
        positive("moe_intermediate_size", self.moe_intermediate_size)?;
        positive("max_position_embeddings", self.max_position_embeddings)?;
        // Upper bounds well past any DeepSeek-V4-class model, so that every product of sizes below
        // (and in the weights' shapes) fits `usize` and positions fit `i32`.
        for (field, v, max) in [
            ("hidden_size", self.hidden_size, 1usize << 16),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 12),
            ("num_attention_heads", self.num_attention_heads, holdfast_attention::MAX_HEADS),
            ("q_lora_rank", self.q_lora_rank, 1 << 16),
            ("o_lora_rank", self.o_lora_rank, 1 << 16),
            ("o_groups", self.o_groups, 1 << 12),
            ("moe_intermediate_size", self.moe_intermediate_size, 1 << 18),
            ("max_position_embeddings", self.max_position_embeddings, i32::MAX as usize),
            ("sliding_window", self.sliding_window, i32::MAX as usize),
            ("index_n_heads", self.index_n_heads, 1 << 12),
            ("index_head_dim", self.index_head_dim, 1 << 12),
            ("index_topk", self.index_topk, 1 << 20),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters, 1 << 16),
        ] {
            if v > max {
                return Err(err(field, format!("must be at most {max}, got {v}")));
            }
        }
        if self.sliding_window == 0 {
            return Err(err("sliding_window", "must be at least 1 token, got 0"));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(64) || self.head_dim > 512 {
            return Err(err("head_dim", format!("must be a multiple of 64 in [64, 512], got {}", self.head_dim)));
        }
        if self.qk_rope_head_dim == 0
            || !self.qk_rope_head_dim.is_multiple_of(2)
            || self.qk_rope_head_dim > self.head_dim
        {
            return Err(err(
                "qk_rope_head_dim",
                format!("must be even and in [2, head_dim {}], got {}", self.head_dim, self.qk_rope_head_dim),
            ));
        }
        if !(self.num_attention_heads * self.head_dim).is_multiple_of(self.o_groups) {
            return Err(err(
                "o_groups",
                format!(
                    "must divide num_attention_heads · head_dim = {}, got {}",
                    self.num_attention_heads * self.head_dim,
                    self.o_groups
                ),
            ));
        }
        if self.hc_mult != 4 {
            return Err(err("hc_mult", format!("only 4 residual streams have kernels, got {}", self.hc_mult)));
        }
        if self.hc_sinkhorn_iters == 0 {
            return Err(err("hc_sinkhorn_iters", "must be at least 1, got 0"));
        }
        for (field, v) in [("hc_eps", self.hc_eps), ("rms_norm_eps", self.rms_norm_eps)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(err(field, format!("must be a positive finite number, got {v}")));
            }
        }
        for (field, v) in [("rope_theta", self.rope_theta), ("compress_rope_theta", self.compress_rope_theta)] {
            if !(v.is_finite() && v > 1.0) {
                return Err(err(field, format!("must be a finite RoPE base above 1, got {v}")));
            }
        }
        if self.swiglu_limit.is_nan() || self.swiglu_limit <= 0.0 {
            return Err(err(
                "swiglu_limit",
                format!("must be positive (or infinite to disable), got {}", self.swiglu_limit),
            ));
        }
        if self.vocab_size < 2 || self.vocab_size > i32::MAX as usize {
            return Err(err("vocab_size", format!("must lie in [2, 2^31), got {}", self.vocab_size)));
        }
        let n = self.num_hidden_layers;
        if self.compress_ratios.len() != n && self.compress_ratios.len() != n + 1 {
            return Err(err(
                "compress_ratios",
                format!(
                    "must hold num_hidden_layers ({n}) or num_hidden_layers + 1 entries, got {}",
                    self.compress_ratios.len()
                ),
            ));
        }
        if let Some((l, r)) = self.compress_ratios.iter().enumerate().find(|(_, r)| !ALLOWED_RATIOS.contains(r)) {
            return Err(err(
                "compress_ratios",
                format!("layer {l}: ratio {r} is not supported; allowed: 0 or 1 (window only), 4 (c4a), 128 (c128a)"),
            ));
        }
        if self.has_c4a() {
            positive("index_n_heads", self.index_n_heads)?;
            positive("index_topk", self.index_topk)?;
            if self.index_head_dim == 0
                || !self.index_head_dim.is_multiple_of(32)
                || self.index_head_dim < self.qk_rope_head_dim
            {
                return Err(err(
                    "index_head_dim",
                    format!(
                        "c4a layers need a multiple of 32 at least qk_rope_head_dim ({}), got {}",
                        self.qk_rope_head_dim, self.index_head_dim
                    ),
                ));
            }
            // What the indexer kernels hold (Indexer::new checks the same): one block stages the
            // heads' queries and weights and a K row per warp in shared memory, and top-k keeps at
            // most TOPK_MAX entries.
            let (h, d) = (self.index_n_heads, self.index_head_dim);
            let floats = holdfast_attention::indexer_staged_floats(h, d).unwrap_or(usize::MAX);
            if floats > holdfast_attention::INDEXER_MAX_SHARED_FLOATS {
                return Err(err(
                    "index_n_heads",
                    format!(
                        "{h} heads × index_head_dim {d} (+ {h} weights + {} K rows) need {floats} floats of shared \
                         memory; the indexer stages at most {}",
                        holdfast_attention::INDEXER_WARPS,
                        holdfast_attention::INDEXER_MAX_SHARED_FLOATS
                    ),
                ));
            }
            if self.index_topk > holdfast_attention::TOPK_MAX {
                return Err(err(
                    "index_topk",
                    format!(
                        "must be at most {} (the top-k kernel's limit), got {}",
                        holdfast_attention::TOPK_MAX,
                        self.index_topk
                    ),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_names_its_field_and_what_is_allowed() {
        type Set = fn(&mut ModelConfig);
        let cases: &[(&str, &str, Set)] = &[
            ("hidden_size", "at least 1", |c| c.hidden_size = 0),
            ("hidden_size", "at most", |c| c.hidden_size = 1 << 40),
            ("num_attention_heads", "at most", |c| c.num_attention_heads = 1 << 58),
            ("hc_sinkhorn_iters", "at most", |c| c.hc_sinkhorn_iters = (1 << 32) + 1),
            ("max_position_embeddings", "at most", |c| c.max_position_embeddings = 1 << 62),
            ("num_hidden_layers", "at least 1", |c| c.num_hidden_layers = 0),
            ("num_attention_heads", "at least 1", |c| c.num_attention_heads = 0),
            ("q_lora_rank", "at least 1", |c| c.q_lora_rank = 0),
            ("o_lora_rank", "at least 1", |c| c.o_lora_rank = 0),
            ("o_groups", "at least 1", |c| c.o_groups = 0),
            ("moe_intermediate_size", "at least 1", |c| c.moe_intermediate_size = 0),
            ("max_position_embeddings", "at least 1", |c| c.max_position_embeddings = 0),
            ("sliding_window", "at least 1 token", |c| c.sliding_window = 0),
            ("head_dim", "multiple of 64", |c| c.head_dim = 96),
            ("head_dim", "multiple of 64", |c| c.head_dim = 576),
            ("qk_rope_head_dim", "even", |c| c.qk_rope_head_dim = 15),
            ("qk_rope_head_dim", "head_dim 64", |c| c.qk_rope_head_dim = 128),
            ("o_groups", "must divide", |c| c.o_groups = 3),
            ("hc_mult", "only 4", |c| c.hc_mult = 2),
            ("hc_sinkhorn_iters", "at least 1", |c| c.hc_sinkhorn_iters = 0),
            ("hc_eps", "positive finite", |c| c.hc_eps = 0.0),
            ("rms_norm_eps", "positive finite", |c| c.rms_norm_eps = f32::NAN),
            ("rms_norm_eps", "positive finite", |c| c.rms_norm_eps = f32::INFINITY),
            ("rope_theta", "above 1", |c| c.rope_theta = 1.0),
            ("compress_rope_theta", "above 1", |c| c.compress_rope_theta = f32::NAN),
            ("swiglu_limit", "positive", |c| c.swiglu_limit = 0.0),
            ("swiglu_limit", "positive", |c| c.swiglu_limit = f32::NAN),
            ("vocab_size", "[2, 2^31)", |c| c.vocab_size = 1),
            ("vocab_size", "[2, 2^31)", |c| c.vocab_size = 1 << 31),
            ("compress_ratios", "num_hidden_layers (4)", |c| c.compress_ratios = vec![0, 4]),
            ("compress_ratios", "layer 2: ratio 64", |c| c.compress_ratios = vec![0, 4, 64, 0]),
            ("index_n_heads", "at least 1", |c| c.index_n_heads = 0),
            ("index_topk", "at least 1", |c| c.index_topk = 0),
            ("index_head_dim", "multiple of 32", |c| c.index_head_dim = 48),
            ("index_head_dim", "at least qk_rope_head_dim", |c| c.index_head_dim = 0),
            ("index_n_heads", "floats of shared memory", |c| c.index_head_dim = 4096),
            ("index_n_heads", "floats of shared memory", |c| c.index_n_heads = 4096),
            ("index_topk", "at most 1024", |c| c.index_topk = 1025),
        ];
        for (field, needle, f) in cases {
            let mut c = ModelConfig::tiny();
            f(&mut c);
            match c.validate() {
                Err(ModelError::Config { field: got, detail }) => {
                    assert_eq!(got, *field, "{detail}");
                    assert!(detail.contains(needle), "{field}: {detail}");
                }
                other => panic!("{field} ({needle}): {other:?}"),
            }
        }
        // Without c4a layers the indexer's fields are not used, so they are not checked.
        let mut c = ModelConfig::tiny();
        c.compress_ratios = vec![0, 1, 128, 0];
        c.index_n_heads = 0;
        c.index_head_dim = 0;
        c.validate().expect("no c4a layer: the indexer's fields are unused");
        // A window-only layer may be written 0 or 1, with or without the trailing (MTP) entry.
        c.compress_ratios = vec![1, 0, 4, 128, 0];
        c.index_n_heads = 2;
        c.index_head_dim = 32;
        c.validate().expect("n + 1 ratios");
    }

    #[test]
    fn presets_validate_and_round_trip() {
        for name in ["tiny", "flash-slice", "pro-slice"] {
            let c = ModelConfig::preset(name).expect("preset");
            c.validate().expect("valid");
            assert_eq!(ModelConfig::from_json(&c.to_json()).expect("parses"), c, "{name}");
        }
    }

    #[test]
    fn tiny_covers_every_layer_kind() {
        let c = ModelConfig::tiny();
        let kinds: Vec<_> = (0..c.num_hidden_layers).map(|l| c.layer_kind(l)).collect();
        assert!(kinds.contains(&LayerKind::SwaOnly) && kinds.contains(&LayerKind::C4a));
        assert!(kinds.contains(&LayerKind::C128a));
    }
}
