//! Layer kinds by compress ratio (spec §5.1).

use crate::error::{AttentionError, Result};

/// The attention flavour of one DeepSeek-V4 layer, from its `compress_ratios[layer]` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// Ratio 0 or 1: sliding-window attention only.
    SwaOnly,
    /// Ratio 4: sliding window plus indexer-selected top-k compressed tokens (CSA).
    C4a,
    /// Ratio 128: sliding window plus every compressed token so far (HCA).
    C128a,
}

impl LayerKind {
    /// Maps a compress ratio to its kind; any ratio other than 0, 1, 4, 128 is an error.
    pub fn from_compress_ratio(ratio: u32) -> Result<Self> {
        match ratio {
            0 | 1 => Ok(LayerKind::SwaOnly),
            4 => Ok(LayerKind::C4a),
            128 => Ok(LayerKind::C128a),
            other => Err(AttentionError::UnsupportedCompressRatio(other)),
        }
    }

    /// The compress ratio (tokens per compressed entry; 1 for SWA-only layers).
    pub const fn compress_ratio(self) -> u32 {
        match self {
            LayerKind::SwaOnly => 1,
            LayerKind::C4a => 4,
            LayerKind::C128a => 128,
        }
    }

    /// The name vLLM uses for the kind (`swaonly`, `c4a`, `c128a`).
    pub const fn as_str(self) -> &'static str {
        match self {
            LayerKind::SwaOnly => "swaonly",
            LayerKind::C4a => "c4a",
            LayerKind::C128a => "c128a",
        }
    }
}

impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
