//! Capture sizes: the token counts a graph is captured for (spec §3.2), and their rounding to
//! whole spec-decode requests (spec §2.2).
//!
//! A size is a number of tokens in one step. Sizes are kept ascending and unique; the largest is
//! the maximum capture size, and any step above it runs eagerly.

use std::collections::BTreeSet;
use std::fmt;

use crate::error::GraphError;
use crate::mode::{GraphMode, RuntimeMode};
use crate::padding::PaddingTable;

/// Largest capture size accepted, in tokens. The padding table holds one `u32` per token count
/// up to the largest size, so this bounds it at 4 MiB.
pub const MAX_CAPTURE_SIZE: u32 = 1 << 20;

/// Default upper bound of the maximum capture size when the user sets none, in tokens.
pub const DEFAULT_MAX_CAPTURE_SIZE_CAP: u32 = 512;

/// Inputs of [`CaptureSizes::build`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureSizeConfig {
    /// The resolved graph mode. `None` (or forced eager) gives no sizes; a FULL decode mode with
    /// spec decode rounds sizes to multiples of `1 + num_spec_tokens`.
    pub mode: GraphMode,
    /// Most requests in one step (≥ 1).
    pub max_num_seqs: u32,
    /// Most tokens in one step (≥ 1).
    pub max_num_batched_tokens: u32,
    /// Speculative tokens per request per step (0 without spec decode).
    pub num_spec_tokens: u32,
    /// User's maximum capture size, in tokens (`max_cudagraph_capture_size`).
    pub max_capture_size: Option<u32>,
    /// User's list of capture sizes, in tokens (`cudagraph_capture_sizes`).
    pub capture_sizes: Option<Vec<u32>>,
    /// Interactivity performance mode: capture every size from 1 to 32 instead of `1, 2, 4, 8..`.
    pub interactivity: bool,
}

impl CaptureSizeConfig {
    /// A configuration with the defaults for everything the user may leave unset.
    pub fn new(mode: GraphMode, max_num_seqs: u32, max_num_batched_tokens: u32) -> Self {
        CaptureSizeConfig {
            mode,
            max_num_seqs,
            max_num_batched_tokens,
            num_spec_tokens: 0,
            max_capture_size: None,
            capture_sizes: None,
            interactivity: false,
        }
    }
}

/// Something the builder changed in the user's inputs; logged and kept in the result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeWarning {
    /// Only a maximum was given and no default size equals it; the maximum became the largest
    /// size at or below it.
    TruncatedMax {
        /// The user's maximum, in tokens.
        requested: u32,
        /// The maximum used, in tokens.
        actual: u32,
    },
    /// Sizes of the user's list above the token budget were dropped.
    DroppedAboveTokenBudget {
        /// The dropped sizes, ascending.
        dropped: Vec<u32>,
        /// The per-step token budget.
        max_num_batched_tokens: u32,
    },
}

impl fmt::Display for SizeWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SizeWarning::TruncatedMax { requested, actual } => write!(
                f,
                "truncating max_cudagraph_capture_size from {requested} to {actual}, the largest \
                 capture size it allows"
            ),
            SizeWarning::DroppedAboveTokenBudget { dropped, max_num_batched_tokens } => write!(
                f,
                "dropping capture sizes {dropped:?} above max_num_batched_tokens = \
                 {max_num_batched_tokens}"
            ),
        }
    }
}

/// Ascending, unique capture sizes (tokens) plus the warnings produced while building them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaptureSizes {
    sizes: Vec<u32>,
    warnings: Vec<SizeWarning>,
}

impl CaptureSizes {
    /// No sizes: graphs disabled, maximum 0.
    pub fn empty() -> Self {
        CaptureSizes::default()
    }

    /// An explicit size list, taken as is apart from sorting and deduplication. Sizes must be in
    /// `1..=MAX_CAPTURE_SIZE`.
    pub fn new<I: IntoIterator<Item = u32>>(sizes: I) -> Result<Self, GraphError> {
        let set: BTreeSet<u32> = sizes.into_iter().collect();
        check_size_range(&set)?;
        Ok(CaptureSizes { sizes: set.into_iter().collect(), warnings: Vec::new() })
    }

    /// Build the sizes for a configuration (spec §3.2, then the spec-decode rounding of §2.2
    /// when the mode has FULL decode graphs and `num_spec_tokens > 0`). Warnings are logged
    /// with `tracing::warn!` and kept in the result.
    pub fn build(cfg: &CaptureSizeConfig) -> Result<Self, GraphError> {
        if !cfg.mode.is_enabled() {
            return Ok(CaptureSizes::empty());
        }
        let budget = cfg.max_num_batched_tokens;
        check_positive("max_num_seqs", cfg.max_num_seqs)?;
        check_positive("max_num_batched_tokens", budget)?;
        let q = cfg.num_spec_tokens.checked_add(1).ok_or(GraphError::InvalidSetting {
            setting: "num_spec_tokens",
            value: cfg.num_spec_tokens.to_string(),
            reason: "1 + num_spec_tokens overflows a u32",
        })?;

        let default_max = (u64::from(cfg.max_num_seqs) * u64::from(q) * 2).min(u64::from(DEFAULT_MAX_CAPTURE_SIZE_CAP));
        let max = cfg.max_capture_size.map_or(default_max, u64::from).min(u64::from(budget));
        if max == 0 {
            return Err(GraphError::InvalidSetting {
                setting: "max_cudagraph_capture_size",
                value: "0".to_owned(),
                reason: "must be at least 1 when graphs are enabled; set the graph mode to NONE \
                         to disable graphs",
            });
        }

        let mut warnings = Vec::new();
        let sizes: Vec<u32> = match &cfg.capture_sizes {
            Some(user) => {
                if user.is_empty() {
                    return Err(GraphError::InvalidSetting {
                        setting: "cudagraph_capture_sizes",
                        value: "[]".to_owned(),
                        reason: "must hold at least one size when graphs are enabled; leave it \
                                 unset for the default list",
                    });
                }
                let set: BTreeSet<u32> = user.iter().copied().collect();
                if set.contains(&0) {
                    return Err(GraphError::InvalidSetting {
                        setting: "cudagraph_capture_sizes",
                        value: format!("{user:?}"),
                        reason: "sizes are token counts and must be at least 1",
                    });
                }
                let (kept, dropped): (Vec<u32>, Vec<u32>) = set.iter().partition(|&&s| s <= budget);
                if kept.is_empty() {
                    return Err(GraphError::NoCaptureSizeFits {
                        sizes: set.into_iter().collect(),
                        max_num_batched_tokens: budget,
                    });
                }
                if !dropped.is_empty() {
                    warnings.push(SizeWarning::DroppedAboveTokenBudget { dropped, max_num_batched_tokens: budget });
                }
                kept
            }
            None => {
                let max = u32::try_from(max)
                    .map_err(|_| GraphError::CaptureSizeTooLarge { size: max, limit: MAX_CAPTURE_SIZE })?;
                default_sizes(max, budget, cfg.interactivity)?
            }
        };
        let set: BTreeSet<u32> = sizes.iter().copied().collect();
        check_size_range(&set)?;

        let largest = sizes.last().copied().unwrap_or(0);
        if let Some(requested) = cfg.max_capture_size {
            if requested != largest {
                if cfg.capture_sizes.is_some() {
                    return Err(GraphError::InconsistentCaptureSizes { max: requested, largest });
                }
                warnings.push(SizeWarning::TruncatedMax { requested, actual: largest });
            }
        }

        let mut built = CaptureSizes { sizes, warnings };
        if cfg.mode.decode_mode() == RuntimeMode::Full && q > 1 {
            built = built.round_for_spec_decode(q)?;
        }
        for w in &built.warnings {
            tracing::warn!("capture sizes: {w}");
        }
        Ok(built)
    }

    /// Round every size up to a multiple of `multiple` (`1 + num_spec_tokens`), keeping those
    /// that stay within the current maximum; if none does but `multiple` itself fits, the list
    /// is `[multiple]`. No-op for an empty list or `multiple <= 1`. Warnings are carried over.
    pub fn round_for_spec_decode(&self, multiple: u32) -> Result<Self, GraphError> {
        let max = self.max();
        if self.sizes.is_empty() || multiple <= 1 {
            return Ok(self.clone());
        }
        let m = u64::from(multiple);
        let mut rounded: Vec<u32> = self
            .sizes
            .iter()
            .filter_map(|&s| u32::try_from(u64::from(s).div_ceil(m) * m).ok())
            .filter(|&r| r <= max)
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .collect();
        if rounded.is_empty() && multiple <= max {
            rounded.push(multiple);
        }
        if rounded.is_empty() {
            return Err(GraphError::NoSizeAfterSpecDecodeRounding { multiple, max, sizes: self.sizes.clone() });
        }
        Ok(CaptureSizes { sizes: rounded, warnings: self.warnings.clone() })
    }

    /// The sizes, ascending, in tokens.
    pub fn sizes(&self) -> &[u32] {
        &self.sizes
    }

    /// The largest size in tokens (the maximum capture size), 0 when there are none.
    pub fn max(&self) -> u32 {
        self.sizes.last().copied().unwrap_or(0)
    }

    /// Number of sizes.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Whether there are no sizes (graphs disabled).
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }

    /// What the builder changed in the user's inputs.
    pub fn warnings(&self) -> &[SizeWarning] {
        &self.warnings
    }

    /// The O(1) table padding each token count to its capture size.
    pub fn padding_table(&self) -> PaddingTable {
        PaddingTable::new(self)
    }
}

/// The default list for a maximum `max ≥ 1` (spec §3.2 step 3).
fn default_sizes(max: u32, budget: u32, interactivity: bool) -> Result<Vec<u32>, GraphError> {
    if max > MAX_CAPTURE_SIZE {
        return Err(GraphError::CaptureSizeTooLarge { size: u64::from(max), limit: MAX_CAPTURE_SIZE });
    }
    let mut set = BTreeSet::new();
    if interactivity {
        set.extend(1..=max.min(32));
    } else {
        set.extend([1, 2, 4].into_iter().filter(|&s| s <= max));
    }
    if max >= 8 {
        set.extend((8..=max.min(255)).step_by(8));
    }
    if max >= 256 {
        set.extend((256..=max).step_by(16));
    }
    if budget <= max {
        set.insert(budget);
    }
    Ok(set.into_iter().collect())
}

fn check_positive(setting: &'static str, value: u32) -> Result<(), GraphError> {
    if value == 0 {
        return Err(GraphError::InvalidSetting { setting, value: "0".to_owned(), reason: "must be at least 1" });
    }
    Ok(())
}

fn check_size_range(set: &BTreeSet<u32>) -> Result<(), GraphError> {
    if set.contains(&0) {
        return Err(GraphError::InvalidSetting {
            setting: "capture size",
            value: "0".to_owned(),
            reason: "sizes are token counts and must be at least 1",
        });
    }
    match set.last() {
        Some(&s) if s > MAX_CAPTURE_SIZE => {
            Err(GraphError::CaptureSizeTooLarge { size: u64::from(s), limit: MAX_CAPTURE_SIZE })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(seqs: u32, tokens: u32) -> CaptureSizeConfig {
        CaptureSizeConfig::new(GraphMode::FullAndPiecewise, seqs, tokens)
    }

    fn build(c: &CaptureSizeConfig) -> CaptureSizes {
        match CaptureSizes::build(c) {
            Ok(s) => s,
            Err(e) => panic!("build failed: {e}"),
        }
    }

    #[test]
    fn default_for_256_seqs_is_51_sizes_ending_at_512() {
        let s = build(&cfg(256, 8192));
        assert_eq!(s.len(), 51);
        assert_eq!(&s.sizes()[..5], &[1, 2, 4, 8, 16]);
        assert!(s.sizes().contains(&248) && s.sizes().contains(&256) && s.sizes().contains(&272));
        assert_eq!(s.max(), 512);
        assert!(s.warnings().is_empty());
    }

    #[test]
    fn default_for_128_seqs_is_35_sizes_ending_at_256() {
        let s = build(&cfg(128, 8192));
        assert_eq!(s.len(), 35);
        assert_eq!(s.max(), 256);
    }

    #[test]
    fn default_for_16_seqs_and_1024_tokens_is_powers_then_steps_of_8() {
        assert_eq!(build(&cfg(16, 1024)).sizes(), &[1, 2, 4, 8, 16, 24, 32]);
    }

    #[test]
    fn default_list_is_ascending_unique_and_within_budget() {
        for seqs in [1, 3, 7, 100, 300] {
            for tokens in [1, 5, 20, 300, 8192] {
                let s = build(&cfg(seqs, tokens));
                assert!(s.sizes().windows(2).all(|w| w[0] < w[1]));
                assert!(s.max() <= tokens);
                assert!(!s.is_empty());
            }
        }
    }

    #[test]
    fn token_budget_is_captured_when_it_caps_the_maximum() {
        assert_eq!(build(&cfg(16, 20)).sizes(), &[1, 2, 4, 8, 16, 20]);
        assert_eq!(build(&cfg(256, 300)).max(), 300);
        assert_eq!(build(&cfg(1, 3)).sizes(), &[1, 2]);
        assert_eq!(build(&cfg(4, 3)).sizes(), &[1, 2, 3]);
    }

    #[test]
    fn interactivity_captures_every_size_up_to_32() {
        let mut c = cfg(64, 8192);
        c.interactivity = true;
        let s = build(&c);
        assert_eq!(&s.sizes()[..32], (1..=32).collect::<Vec<_>>().as_slice());
        assert_eq!(s.sizes()[32], 40);
        assert_eq!(s.max(), 128);
    }

    #[test]
    fn disabled_graphs_have_no_sizes_whatever_the_user_gave() {
        let mut c = cfg(256, 8192);
        c.mode = GraphMode::None;
        c.capture_sizes = Some(vec![]);
        c.max_capture_size = Some(3);
        let s = build(&c);
        assert!(s.is_empty());
        assert_eq!(s.max(), 0);
    }

    #[test]
    fn a_user_list_is_deduped_sorted_and_cut_at_the_token_budget_with_a_warning() {
        let mut c = cfg(8, 100);
        c.capture_sizes = Some(vec![64, 8, 200, 8, 1, 101, 100]);
        let s = build(&c);
        assert_eq!(s.sizes(), &[1, 8, 64, 100]);
        assert_eq!(
            s.warnings(),
            &[SizeWarning::DroppedAboveTokenBudget { dropped: vec![101, 200], max_num_batched_tokens: 100 }]
        );
    }

    #[test]
    fn a_user_list_may_exceed_the_default_maximum() {
        let mut c = cfg(2, 8192);
        c.capture_sizes = Some(vec![1, 1024]);
        assert_eq!(build(&c).max(), 1024);
    }

    #[test]
    fn a_user_list_and_maximum_that_disagree_is_an_error() {
        let mut c = cfg(8, 100);
        c.capture_sizes = Some(vec![1, 2, 4, 200]);
        c.max_capture_size = Some(200);
        assert_eq!(CaptureSizes::build(&c), Err(GraphError::InconsistentCaptureSizes { max: 200, largest: 4 }));
        c.max_capture_size = Some(4);
        assert_eq!(build(&c).sizes(), &[1, 2, 4]);
    }

    #[test]
    fn a_user_maximum_alone_is_truncated_to_a_default_size_with_a_warning() {
        let mut c = cfg(256, 8192);
        c.max_capture_size = Some(100);
        let s = build(&c);
        assert_eq!(s.max(), 96);
        assert_eq!(s.warnings(), &[SizeWarning::TruncatedMax { requested: 100, actual: 96 }]);
        c.max_capture_size = Some(1000);
        let s = build(&c);
        assert_eq!(s.max(), 992);
        assert!(s.warnings()[0].to_string().contains("from 1000 to 992"));
        c.max_capture_size = Some(96);
        assert!(build(&c).warnings().is_empty());
    }

    #[test]
    fn a_user_maximum_above_the_budget_is_capped_to_the_budget() {
        let mut c = cfg(256, 300);
        c.max_capture_size = Some(10_000);
        let s = build(&c);
        assert_eq!(s.max(), 300);
        assert_eq!(s.warnings(), &[SizeWarning::TruncatedMax { requested: 10_000, actual: 300 }]);
    }

    #[test]
    fn empty_zero_or_oversized_user_inputs_are_errors() {
        let mut c = cfg(8, 100);
        c.capture_sizes = Some(vec![]);
        assert!(matches!(
            CaptureSizes::build(&c),
            Err(GraphError::InvalidSetting { setting: "cudagraph_capture_sizes", .. })
        ));
        c.capture_sizes = Some(vec![0, 4]);
        assert!(matches!(
            CaptureSizes::build(&c),
            Err(GraphError::InvalidSetting { setting: "cudagraph_capture_sizes", .. })
        ));
        c.capture_sizes = Some(vec![101, 500]);
        assert_eq!(
            CaptureSizes::build(&c),
            Err(GraphError::NoCaptureSizeFits { sizes: vec![101, 500], max_num_batched_tokens: 100 })
        );
        c.capture_sizes = None;
        c.max_capture_size = Some(0);
        assert!(matches!(
            CaptureSizes::build(&c),
            Err(GraphError::InvalidSetting { setting: "max_cudagraph_capture_size", .. })
        ));
        let mut big = cfg(8, u32::MAX);
        big.capture_sizes = Some(vec![MAX_CAPTURE_SIZE + 1]);
        assert!(matches!(CaptureSizes::build(&big), Err(GraphError::CaptureSizeTooLarge { .. })));
        big.capture_sizes = None;
        big.max_capture_size = Some(u32::MAX);
        assert!(matches!(CaptureSizes::build(&big), Err(GraphError::CaptureSizeTooLarge { .. })));
    }

    #[test]
    fn zero_seqs_or_tokens_are_errors_when_graphs_are_on() {
        assert!(matches!(
            CaptureSizes::build(&cfg(0, 10)),
            Err(GraphError::InvalidSetting { setting: "max_num_seqs", .. })
        ));
        assert!(matches!(
            CaptureSizes::build(&cfg(1, 0)),
            Err(GraphError::InvalidSetting { setting: "max_num_batched_tokens", .. })
        ));
        let mut c = cfg(1, 10);
        c.num_spec_tokens = u32::MAX;
        assert!(matches!(CaptureSizes::build(&c), Err(GraphError::InvalidSetting { setting: "num_spec_tokens", .. })));
    }

    #[test]
    fn spec_decode_with_full_decode_graphs_rounds_to_whole_requests() {
        let mut c = cfg(16, 8192);
        c.num_spec_tokens = 2; // q = 3, default max = 16 * 3 * 2 = 96
        let s = build(&c);
        assert!(s.sizes().iter().all(|&x| x % 3 == 0), "{:?}", s.sizes());
        assert_eq!(&s.sizes()[..4], &[3, 6, 9, 18]);
        assert_eq!(s.max(), 96);
    }

    #[test]
    fn spec_decode_without_full_decode_graphs_keeps_sizes() {
        let mut c = cfg(16, 8192);
        c.num_spec_tokens = 2;
        c.mode = GraphMode::Piecewise;
        let s = build(&c);
        assert_eq!(&s.sizes()[..3], &[1, 2, 4]);
    }

    #[test]
    fn rounding_drops_sizes_that_would_pass_the_maximum() {
        let s = CaptureSizes::new([1, 2, 4, 8, 512]).and_then(|s| s.round_for_spec_decode(3));
        assert_eq!(s.map(|s| s.sizes().to_vec()), Ok(vec![3, 6, 9]));
    }

    #[test]
    fn rounding_falls_back_to_the_multiple_itself_then_errors() {
        let s = CaptureSizes::new([5]).and_then(|s| s.round_for_spec_decode(3));
        assert_eq!(s.map(|s| s.sizes().to_vec()), Ok(vec![3]));
        let s = CaptureSizes::new([1, 2]).and_then(|s| s.round_for_spec_decode(3));
        assert_eq!(s, Err(GraphError::NoSizeAfterSpecDecodeRounding { multiple: 3, max: 2, sizes: vec![1, 2] }));
        let mut c = cfg(8, 2);
        c.num_spec_tokens = 3;
        assert!(matches!(CaptureSizes::build(&c), Err(GraphError::NoSizeAfterSpecDecodeRounding { multiple: 4, .. })));
    }

    #[test]
    fn rounding_is_a_no_op_for_query_length_one_or_no_sizes() {
        let s = CaptureSizes::new([1, 5, 7]);
        assert_eq!(s.clone().and_then(|s| s.round_for_spec_decode(1)), s);
        assert_eq!(CaptureSizes::empty().round_for_spec_decode(4), Ok(CaptureSizes::empty()));
    }

    /// Every rejected size setting: the error variant, and the words its message must contain
    /// (the setting at fault and what is allowed).
    #[test]
    fn every_rejected_size_setting_names_the_setting_and_what_is_allowed() {
        use GraphError as E;
        type Case = (&'static str, Result<CaptureSizes, GraphError>, fn(&GraphError) -> bool, &'static [&'static str]);
        let with = |f: &dyn Fn(&mut CaptureSizeConfig)| {
            let mut c = cfg(8, 100);
            f(&mut c);
            CaptureSizes::build(&c)
        };
        let cases: Vec<Case> = vec![
            (
                "zero seqs",
                CaptureSizes::build(&cfg(0, 100)),
                |e| matches!(e, E::InvalidSetting { setting: "max_num_seqs", .. }),
                &["max_num_seqs = 0", "at least 1"],
            ),
            (
                "zero tokens",
                CaptureSizes::build(&cfg(8, 0)),
                |e| matches!(e, E::InvalidSetting { setting: "max_num_batched_tokens", .. }),
                &["max_num_batched_tokens = 0", "at least 1"],
            ),
            (
                "spec tokens overflow",
                with(&|c| c.num_spec_tokens = u32::MAX),
                |e| matches!(e, E::InvalidSetting { setting: "num_spec_tokens", .. }),
                &["num_spec_tokens = 4294967295", "overflows a u32"],
            ),
            (
                "zero maximum",
                with(&|c| c.max_capture_size = Some(0)),
                |e| matches!(e, E::InvalidSetting { setting: "max_cudagraph_capture_size", .. }),
                &["max_cudagraph_capture_size = 0", "at least 1", "NONE"],
            ),
            (
                "empty list",
                with(&|c| c.capture_sizes = Some(vec![])),
                |e| matches!(e, E::InvalidSetting { setting: "cudagraph_capture_sizes", .. }),
                &["cudagraph_capture_sizes = []", "at least one size"],
            ),
            (
                "zero in the list",
                with(&|c| c.capture_sizes = Some(vec![4, 0])),
                |e| matches!(e, E::InvalidSetting { setting: "cudagraph_capture_sizes", .. }),
                &["cudagraph_capture_sizes = [4, 0]", "at least 1"],
            ),
            (
                "no size within the budget",
                with(&|c| c.capture_sizes = Some(vec![200, 101])),
                |e| matches!(e, E::NoCaptureSizeFits { max_num_batched_tokens: 100, .. }),
                &["cudagraph_capture_sizes [101, 200]", "max_num_batched_tokens = 100"],
            ),
            (
                "list and maximum disagree",
                with(&|c| {
                    c.capture_sizes = Some(vec![1, 2, 4]);
                    c.max_capture_size = Some(8);
                }),
                |e| matches!(e, E::InconsistentCaptureSizes { max: 8, largest: 4 }),
                &["max_cudagraph_capture_size = 8", "largest usable entry of cudagraph_capture_sizes (4"],
            ),
            (
                "nothing left after spec-decode rounding",
                CaptureSizes::build(&CaptureSizeConfig { num_spec_tokens: 3, ..cfg(8, 2) }),
                |e| matches!(e, E::NoSizeAfterSpecDecodeRounding { multiple: 4, max: 2, .. }),
                &["multiples of 4", "num_spec_tokens", "within the maximum 2"],
            ),
            (
                "listed size above the limit",
                CaptureSizes::build(&CaptureSizeConfig {
                    capture_sizes: Some(vec![MAX_CAPTURE_SIZE + 1]),
                    ..cfg(8, u32::MAX)
                }),
                |e| matches!(e, E::CaptureSizeTooLarge { size: 1_048_577, limit: MAX_CAPTURE_SIZE }),
                &["capture size 1048577", "maximum of 1048576", "cudagraph_capture_sizes"],
            ),
            (
                "maximum above the limit",
                CaptureSizes::build(&CaptureSizeConfig { max_capture_size: Some(u32::MAX), ..cfg(8, u32::MAX) }),
                |e| matches!(e, E::CaptureSizeTooLarge { size: 4_294_967_295, limit: MAX_CAPTURE_SIZE }),
                &["capture size 4294967295", "maximum of 1048576", "max_cudagraph_capture_size"],
            ),
            (
                "explicit zero",
                CaptureSizes::new([0, 2]),
                |e| matches!(e, E::InvalidSetting { setting: "capture size", .. }),
                &["capture size = 0", "at least 1"],
            ),
            (
                "explicit size above the limit",
                CaptureSizes::new([2, MAX_CAPTURE_SIZE + 1]),
                |e| matches!(e, E::CaptureSizeTooLarge { size: 1_048_577, .. }),
                &["capture size 1048577", "maximum of 1048576"],
            ),
            (
                "explicit rounding leaves nothing",
                CaptureSizes::new([1, 2]).and_then(|s| s.round_for_spec_decode(3)),
                |e| matches!(e, E::NoSizeAfterSpecDecodeRounding { multiple: 3, max: 2, .. }),
                &["multiples of 3", "within the maximum 2", "sizes were [1, 2]"],
            ),
        ];
        holdfast_hal::testing::check_errors(cases.into_iter().map(|(w, r, v, x)| (w, r.map(|_| ()), v, x)).collect());
    }

    #[test]
    fn explicit_lists_are_sorted_and_reject_zero() {
        assert_eq!(CaptureSizes::new([8, 1, 8, 4]).map(|s| s.sizes().to_vec()), Ok(vec![1, 4, 8]));
        assert!(CaptureSizes::new([0, 1]).is_err());
        assert!(CaptureSizes::new([MAX_CAPTURE_SIZE + 1]).is_err());
        assert_eq!(CaptureSizes::new([]).map(|s| s.max()), Ok(0));
    }
}
