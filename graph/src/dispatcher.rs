//! The dispatcher: the one place that knows which graph keys exist, and that maps each step to
//! `(runtime mode, padded descriptor)` (spec §3.3).
//!
//! Keys are built once by [`Dispatcher::initialize_keys`]; [`Dispatcher::dispatch`] then does a
//! table load and at most two hash lookups per step, and counts what it chose.

use crate::descriptor::BatchDescriptor;
use crate::error::GraphError;
use crate::key_set::KeySet;
use crate::lora::LoraConfig;
use crate::mode::{GraphMode, RuntimeMode};
use crate::mode_set::ModeSet;
use crate::padding::PaddingTable;
use crate::sizes::CaptureSizes;
use crate::stats::{DispatchStats, FallbackReason};

/// Settings a [`Dispatcher`] is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatcherConfig {
    /// Capture sizes (already rounded for spec decode when the mode needs it).
    pub capture_sizes: CaptureSizes,
    /// Most requests in one step (≥ 1); caps the request count in keys.
    pub max_num_seqs: u32,
    /// LoRA graph configuration.
    pub lora: LoraConfig,
    /// Whether attention ops are splitting ops (piecewise graphs can be captured).
    pub attention_is_splitting_op: bool,
}

/// What [`Dispatcher::dispatch_detailed`] chose for one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dispatched {
    /// How the step runs.
    pub mode: RuntimeMode,
    /// The graph key (padded), or the unpadded descriptor of an eager step.
    pub descriptor: BatchDescriptor,
    /// Why the step runs eagerly; `None` when it replays a graph.
    pub fallback: Option<FallbackReason>,
}

/// Holds the graph keys per runtime mode and picks the graph for each step.
#[derive(Clone, Debug)]
pub struct Dispatcher {
    sizes: CaptureSizes,
    table: PaddingTable,
    max_size: u32,
    max_num_seqs: u32,
    lora: LoraConfig,
    attention_is_splitting_op: bool,
    mode: GraphMode,
    uniform_decode_query_len: u32,
    initialized: bool,
    full_keys: KeySet,
    piecewise_keys: KeySet,
    stats: DispatchStats,
}

impl Dispatcher {
    /// A dispatcher with no keys yet: every step runs eagerly until
    /// [`initialize_keys`](Self::initialize_keys).
    pub fn new(config: DispatcherConfig) -> Result<Dispatcher, GraphError> {
        if config.max_num_seqs == 0 {
            return Err(GraphError::InvalidSetting {
                setting: "max_num_seqs",
                value: "0".to_owned(),
                reason: "must be at least 1",
            });
        }
        let lora = config.lora.validated()?;
        let table = config.capture_sizes.padding_table();
        Ok(Dispatcher {
            max_size: config.capture_sizes.max(),
            sizes: config.capture_sizes,
            table,
            max_num_seqs: config.max_num_seqs,
            lora,
            attention_is_splitting_op: config.attention_is_splitting_op,
            mode: GraphMode::None,
            uniform_decode_query_len: 1,
            initialized: false,
            full_keys: KeySet::default(),
            piecewise_keys: KeySet::default(),
            stats: DispatchStats::default(),
        })
    }

    /// Build the keys for `mode` (the resolved mode) and `uniform_decode_query_len`
    /// (`1 + num_spec_tokens`). Replaces any earlier keys; on error nothing changes.
    ///
    /// Mixed keys: every capture size × LoRA case, non-uniform (relaxed to any request count for
    /// PIECEWISE). Uniform-decode FULL keys (separate-routine modes only): sizes in
    /// `q..=q * max_num_seqs` × LoRA cases.
    pub fn initialize_keys(&mut self, mode: GraphMode, uniform_decode_query_len: u32) -> Result<(), GraphError> {
        let q = uniform_decode_query_len;
        if q == 0 {
            return Err(GraphError::InvalidSetting {
                setting: "uniform_decode_query_len",
                value: "0".to_owned(),
                reason: "must be 1 + num_spec_tokens, at least 1",
            });
        }
        let mut full = KeySet::default();
        let mut piecewise = KeySet::default();
        if mode.is_enabled() {
            if mode.requires_piecewise_compilation() && !self.attention_is_splitting_op {
                return Err(GraphError::PiecewiseNeedsSplittingAttention { mode });
            }
            let decode_full = mode.separate_routine() && mode.decode_mode() == RuntimeMode::Full;
            if decode_full {
                if let Some(&size) = self.sizes.sizes().iter().find(|&&s| s % q != 0) {
                    return Err(GraphError::SizeNotMultipleOfQueryLen { size, query_len: q });
                }
            }
            let cases = self.lora.capture_cases();
            let mixed = mode.mixed_mode();
            if mixed != RuntimeMode::None {
                let set = if mixed == RuntimeMode::Full { &mut full } else { &mut piecewise };
                for &size in self.sizes.sizes() {
                    for &k in &cases {
                        let d = self.padded(mode, q, size, false, k > 0, k);
                        set.insert(if mixed == RuntimeMode::Piecewise { d.relaxed() } else { d });
                    }
                }
            }
            if decode_full {
                let top = u64::from(q) * u64::from(self.max_num_seqs);
                for &size in self.sizes.sizes().iter().filter(|&&s| s >= q && u64::from(s) <= top) {
                    for &k in &cases {
                        full.insert(self.padded(mode, q, size, true, k > 0, k));
                    }
                }
            }
        }
        self.mode = mode;
        self.uniform_decode_query_len = q;
        self.full_keys = full;
        self.piecewise_keys = piecewise;
        self.initialized = true;
        Ok(())
    }

    /// Pick how a step runs. `valid_modes` restricts the choice (an empty set means all three,
    /// as in the reference); `invalid_modes` removes modes from it (e.g. `{FULL}` under cascade
    /// attention). Returns the runtime mode and the padded descriptor, or the unpadded one for
    /// an eager step.
    ///
    /// Order: eager unpadded when graphs are off, the step exceeds the largest size, or only
    /// NONE is allowed; else FULL if its key exists; else PIECEWISE with the relaxed key; else
    /// eager (an error if NONE is not allowed). As in the reference, the early eager cases
    /// return NONE even when the caller's sets exclude it.
    #[inline]
    pub fn dispatch(
        &mut self,
        num_tokens: u32,
        uniform_decode: bool,
        has_lora: bool,
        num_active_loras: u32,
        valid_modes: ModeSet,
        invalid_modes: ModeSet,
    ) -> Result<(RuntimeMode, BatchDescriptor), GraphError> {
        self.dispatch_detailed(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)
            .map(|d| (d.mode, d.descriptor))
    }

    /// [`dispatch`](Self::dispatch), also saying why an eager step fell back.
    #[inline]
    pub fn dispatch_detailed(
        &mut self,
        num_tokens: u32,
        uniform_decode: bool,
        has_lora: bool,
        num_active_loras: u32,
        valid_modes: ModeSet,
        invalid_modes: ModeSet,
    ) -> Result<Dispatched, GraphError> {
        let valid = if valid_modes.is_empty() { ModeSet::ALL } else { valid_modes };
        let allowed = valid.minus(invalid_modes);
        if allowed.is_empty() {
            return Err(GraphError::NoAllowedMode { valid: valid_modes, invalid: invalid_modes });
        }
        let early = if !self.initialized || !self.mode.is_enabled() {
            Some(FallbackReason::GraphsDisabled)
        } else if num_tokens > self.max_size {
            Some(if self.max_size == 0 { FallbackReason::GraphsDisabled } else { FallbackReason::AboveMaxSize })
        } else if allowed.is_subset_of(ModeSet::only(RuntimeMode::None)) {
            Some(FallbackReason::NotAllowed)
        } else {
            None
        };
        if let Some(why) = early {
            return Ok(self.eager(num_tokens, why));
        }

        let loras = self.lora.effective_count(has_lora, num_active_loras);
        let uniform = uniform_decode && self.mode.separate_routine();
        // `num_tokens <= max_size` here, so the table has an entry.
        let padded = self.table.pad(num_tokens).unwrap_or(num_tokens);
        let desc = self.padded(self.mode, self.uniform_decode_query_len, padded, uniform, has_lora, loras);
        let full_hit = self.full_keys.contains(&desc);
        if full_hit && allowed.contains(RuntimeMode::Full) {
            self.stats.record(RuntimeMode::Full, num_tokens, desc.num_tokens, None);
            return Ok(Dispatched { mode: RuntimeMode::Full, descriptor: desc, fallback: None });
        }
        let relaxed = desc.relaxed();
        let piecewise_hit = self.piecewise_keys.contains(&relaxed);
        if piecewise_hit && allowed.contains(RuntimeMode::Piecewise) {
            self.stats.record(RuntimeMode::Piecewise, num_tokens, relaxed.num_tokens, None);
            return Ok(Dispatched { mode: RuntimeMode::Piecewise, descriptor: relaxed, fallback: None });
        }
        if !allowed.contains(RuntimeMode::None) {
            return Err(GraphError::EagerNotAllowed { num_tokens, allowed });
        }
        let why = if full_hit || piecewise_hit { FallbackReason::NotAllowed } else { FallbackReason::NotInKeys };
        Ok(self.eager(num_tokens, why))
    }

    #[inline]
    fn eager(&mut self, num_tokens: u32, why: FallbackReason) -> Dispatched {
        self.stats.record(RuntimeMode::None, num_tokens, num_tokens, Some(why));
        Dispatched { mode: RuntimeMode::None, descriptor: BatchDescriptor::unpadded(num_tokens), fallback: Some(why) }
    }

    /// The descriptor for a step padded to `padded` tokens. A uniform batch under a mode with
    /// FULL graphs counts whole requests of `q` tokens; anything else counts one request per
    /// token; both are capped at `max_num_seqs`.
    #[inline]
    fn padded(
        &self,
        mode: GraphMode,
        q: u32,
        padded: u32,
        uniform: bool,
        has_lora: bool,
        num_active_loras: u32,
    ) -> BatchDescriptor {
        let (uniform, reqs) =
            if uniform && mode.has_mode(RuntimeMode::Full) { (true, padded / q) } else { (false, padded) };
        BatchDescriptor {
            num_tokens: padded,
            num_reqs: Some(reqs.min(self.max_num_seqs)),
            uniform,
            has_lora,
            num_active_loras,
        }
    }

    /// Every graph to capture: PIECEWISE first, then FULL (modes without keys left out), each
    /// list largest first by `(num_tokens, num_active_loras)`.
    pub fn capture_descs(&self) -> Vec<(RuntimeMode, Vec<BatchDescriptor>)> {
        [(RuntimeMode::Piecewise, &self.piecewise_keys), (RuntimeMode::Full, &self.full_keys)]
            .into_iter()
            .filter(|(_, keys)| !keys.is_empty())
            .map(|(mode, keys)| {
                let mut v: Vec<BatchDescriptor> = keys.iter().copied().collect();
                v.sort_unstable_by(|a, b| {
                    (b.num_tokens, b.num_active_loras).cmp(&(a.num_tokens, a.num_active_loras)).then(b.cmp(a))
                });
                (mode, v)
            })
            .collect()
    }

    /// Whether `desc` is a key of `mode` (always false for NONE).
    pub fn has_key(&self, mode: RuntimeMode, desc: &BatchDescriptor) -> bool {
        match mode {
            RuntimeMode::None => false,
            RuntimeMode::Piecewise => self.piecewise_keys.contains(desc),
            RuntimeMode::Full => self.full_keys.contains(desc),
        }
    }

    /// Number of keys of `mode` (0 for NONE).
    pub fn key_count(&self, mode: RuntimeMode) -> usize {
        match mode {
            RuntimeMode::None => 0,
            RuntimeMode::Piecewise => self.piecewise_keys.len(),
            RuntimeMode::Full => self.full_keys.len(),
        }
    }

    /// The mode keys were initialised for (`None` before [`initialize_keys`](Self::initialize_keys)).
    pub fn mode(&self) -> GraphMode {
        self.mode
    }

    /// Whether [`initialize_keys`](Self::initialize_keys) has run.
    pub fn keys_initialized(&self) -> bool {
        self.initialized
    }

    /// The uniform decode query length keys were built for, `1 + num_spec_tokens`.
    pub fn uniform_decode_query_len(&self) -> u32 {
        self.uniform_decode_query_len
    }

    /// The capture sizes.
    pub fn capture_sizes(&self) -> &CaptureSizes {
        &self.sizes
    }

    /// The padding table.
    pub fn padding_table(&self) -> &PaddingTable {
        &self.table
    }

    /// Counters since creation or the last [`reset_stats`](Self::reset_stats).
    pub fn stats(&self) -> &DispatchStats {
        &self.stats
    }

    /// Zero the counters.
    pub fn reset_stats(&mut self) {
        self.stats = DispatchStats::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RuntimeMode as R;

    const ALL: ModeSet = ModeSet::ALL;
    const NO: ModeSet = ModeSet::EMPTY;

    fn dispatcher(sizes: &[u32], max_num_seqs: u32, lora: LoraConfig, mode: GraphMode, q: u32) -> Dispatcher {
        let capture_sizes = match CaptureSizes::new(sizes.iter().copied()) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        };
        let config = DispatcherConfig { capture_sizes, max_num_seqs, lora, attention_is_splitting_op: true };
        let mut d = match Dispatcher::new(config) {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        if let Err(e) = d.initialize_keys(mode, q) {
            panic!("{e}");
        }
        d
    }

    fn dsv4(mode: GraphMode) -> Dispatcher {
        dispatcher(&[1, 2, 4, 8, 16, 24, 32], 16, LoraConfig::Disabled, mode, 1)
    }

    fn desc(num_tokens: u32, num_reqs: Option<u32>, uniform: bool) -> BatchDescriptor {
        BatchDescriptor { num_tokens, num_reqs, uniform, has_lora: false, num_active_loras: 0 }
    }

    fn go(d: &mut Dispatcher, n: u32, uniform: bool) -> (RuntimeMode, BatchDescriptor) {
        match d.dispatch(n, uniform, false, 0, ALL, NO) {
            Ok(x) => x,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn uniform_decode_under_full_and_piecewise_replays_a_full_graph_with_request_count() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        assert_eq!(go(&mut d, 3, true), (R::Full, desc(4, Some(4), true)));
        assert_eq!(go(&mut d, 16, true), (R::Full, desc(16, Some(16), true)));
    }

    #[test]
    fn uniform_decode_above_the_request_limit_falls_to_piecewise() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        // 24 tokens = 24 requests of 1 token, more than max_num_seqs = 16: no uniform key.
        assert_eq!(go(&mut d, 20, true), (R::Piecewise, desc(24, None, false)));
    }

    #[test]
    fn mixed_batches_under_full_and_piecewise_use_the_relaxed_piecewise_key() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        assert_eq!(go(&mut d, 5, false), (R::Piecewise, desc(8, None, false)));
    }

    #[test]
    fn steps_above_the_largest_size_run_eagerly_unpadded() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        let r = d.dispatch_detailed(33, true, false, 0, ALL, NO);
        assert_eq!(
            r,
            Ok(Dispatched {
                mode: R::None,
                descriptor: BatchDescriptor::unpadded(33),
                fallback: Some(FallbackReason::AboveMaxSize)
            })
        );
    }

    #[test]
    fn plain_full_drops_the_uniform_flag_so_uniform_batches_hit_its_keys() {
        let mut d = dsv4(GraphMode::Full);
        assert_eq!(go(&mut d, 3, true), (R::Full, desc(4, Some(4), false)));
        assert_eq!(go(&mut d, 24, false), (R::Full, desc(24, Some(16), false)));
    }

    #[test]
    fn full_decode_only_runs_mixed_batches_eagerly() {
        let mut d = dsv4(GraphMode::FullDecodeOnly);
        assert_eq!(go(&mut d, 8, true), (R::Full, desc(8, Some(8), true)));
        let r = d.dispatch_detailed(8, false, false, 0, ALL, NO);
        assert_eq!(r.map(|x| (x.mode, x.fallback)), Ok((R::None, Some(FallbackReason::NotInKeys))));
    }

    #[test]
    fn piecewise_mode_serves_every_batch_under_relaxed_keys() {
        let mut d = dsv4(GraphMode::Piecewise);
        assert_eq!(go(&mut d, 7, true), (R::Piecewise, desc(8, None, false)));
        assert_eq!(d.key_count(R::Full), 0);
        assert_eq!(d.key_count(R::Piecewise), 7);
    }

    #[test]
    fn invalid_full_falls_back_to_piecewise_and_valid_none_forces_eager() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        let full = ModeSet::only(R::Full);
        assert_eq!(d.dispatch(4, true, false, 0, ALL, full), Ok((R::Piecewise, desc(4, None, false))));
        let r = d.dispatch_detailed(4, true, false, 0, ModeSet::only(R::None), NO);
        assert_eq!(r.map(|x| (x.mode, x.fallback)), Ok((R::None, Some(FallbackReason::NotAllowed))));
        // FDO + FULL invalid: the FULL key exists but may not be used.
        let mut d = dsv4(GraphMode::FullDecodeOnly);
        let r = d.dispatch_detailed(4, true, false, 0, ALL, full);
        assert_eq!(r.map(|x| (x.mode, x.fallback)), Ok((R::None, Some(FallbackReason::NotAllowed))));
    }

    #[test]
    fn an_empty_valid_set_means_every_mode() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        assert_eq!(d.dispatch(4, true, false, 0, NO, NO), Ok((R::Full, desc(4, Some(4), true))));
    }

    #[test]
    fn no_allowed_mode_or_forbidden_eager_fallback_are_errors() {
        let mut d = dsv4(GraphMode::FullDecodeOnly);
        assert_eq!(
            d.dispatch(4, true, false, 0, ModeSet::only(R::Full), ModeSet::only(R::Full)),
            Err(GraphError::NoAllowedMode { valid: ModeSet::only(R::Full), invalid: ModeSet::only(R::Full) })
        );
        let graphs = ModeSet::of(&[R::Full, R::Piecewise]);
        assert_eq!(
            d.dispatch(4, false, false, 0, graphs, NO),
            Err(GraphError::EagerNotAllowed { num_tokens: 4, allowed: graphs })
        );
        assert_eq!(d.stats().dispatches(), 0);
    }

    #[test]
    fn before_initialisation_and_under_none_every_step_is_eager() {
        let config = DispatcherConfig {
            capture_sizes: CaptureSizes::new([1, 2]).unwrap_or_default(),
            max_num_seqs: 4,
            lora: LoraConfig::Disabled,
            attention_is_splitting_op: true,
        };
        let Ok(mut d) = Dispatcher::new(config) else { panic!("new") };
        assert!(!d.keys_initialized());
        assert_eq!(go(&mut d, 1, true), (R::None, BatchDescriptor::unpadded(1)));
        assert_eq!(d.initialize_keys(GraphMode::None, 1), Ok(()));
        assert!(d.keys_initialized());
        assert_eq!(go(&mut d, 2, false), (R::None, BatchDescriptor::unpadded(2)));
        assert_eq!(d.stats().fallbacks(FallbackReason::GraphsDisabled), 2);
        assert!(d.capture_descs().is_empty());
    }

    #[test]
    fn spec_decode_uniform_keys_count_whole_requests() {
        let mut d = dispatcher(&[3, 6, 9, 12, 24], 4, LoraConfig::Disabled, GraphMode::FullAndPiecewise, 3);
        assert_eq!(go(&mut d, 6, true), (R::Full, desc(6, Some(2), true)));
        assert_eq!(go(&mut d, 12, true), (R::Full, desc(12, Some(4), true)));
        // 24 > q * max_num_seqs = 12: no uniform key.
        assert_eq!(go(&mut d, 24, true), (R::Piecewise, desc(24, None, false)));
    }

    #[test]
    fn a_rejected_key_initialisation_changes_nothing() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        let before = d.capture_descs();
        assert_eq!(
            d.initialize_keys(GraphMode::FullAndPiecewise, 3),
            Err(GraphError::SizeNotMultipleOfQueryLen { size: 1, query_len: 3 })
        );
        assert!(d.initialize_keys(GraphMode::Full, 0).is_err());
        assert_eq!(d.capture_descs(), before);
        assert_eq!(d.mode(), GraphMode::FullAndPiecewise);
        assert_eq!(d.uniform_decode_query_len(), 1);
        // Plain FULL has no uniform keys, so sizes need not be multiples of q.
        assert_eq!(d.initialize_keys(GraphMode::Full, 3), Ok(()));
    }

    #[test]
    fn piecewise_modes_need_splitting_attention() {
        let config = DispatcherConfig {
            capture_sizes: CaptureSizes::new([1, 2]).unwrap_or_default(),
            max_num_seqs: 4,
            lora: LoraConfig::Disabled,
            attention_is_splitting_op: false,
        };
        let Ok(mut d) = Dispatcher::new(config) else { panic!("new") };
        for m in [GraphMode::Piecewise, GraphMode::FullAndPiecewise] {
            assert_eq!(d.initialize_keys(m, 1), Err(GraphError::PiecewiseNeedsSplittingAttention { mode: m }));
        }
        assert_eq!(d.initialize_keys(GraphMode::FullDecodeOnly, 1), Ok(()));
    }

    #[test]
    fn zero_max_num_seqs_or_bad_lora_is_rejected_at_construction() {
        let base = DispatcherConfig {
            capture_sizes: CaptureSizes::empty(),
            max_num_seqs: 0,
            lora: LoraConfig::Disabled,
            attention_is_splitting_op: true,
        };
        assert!(Dispatcher::new(base.clone()).is_err());
        let bad = DispatcherConfig { max_num_seqs: 1, lora: LoraConfig::Unspecialized { max_loras: 0 }, ..base };
        assert!(matches!(Dispatcher::new(bad), Err(GraphError::InvalidLora { .. })));
    }

    /// Every error of construction, key initialisation and dispatch: the variant, and the words
    /// its message must contain (the setting or argument at fault and what is allowed).
    #[test]
    fn every_rejected_dispatcher_setting_or_request_names_it_and_what_is_allowed() {
        use GraphError as E;
        let config = |max_num_seqs, lora, attention_is_splitting_op| DispatcherConfig {
            capture_sizes: CaptureSizes::new([1, 2, 4]).unwrap_or_default(),
            max_num_seqs,
            lora,
            attention_is_splitting_op,
        };
        let new = |max_num_seqs, lora| Dispatcher::new(config(max_num_seqs, lora, true)).map(|_| ());
        let keys = |splitting, mode, q| {
            Dispatcher::new(config(4, LoraConfig::Disabled, splitting)).and_then(|mut d| d.initialize_keys(mode, q))
        };
        let mut fdo = dsv4(GraphMode::FullDecodeOnly);
        let full = ModeSet::only(R::Full);
        let graphs = ModeSet::of(&[R::Full, R::Piecewise]);
        let cases: Vec<crate::error::ErrorCase> = vec![
            (
                "zero max_num_seqs",
                new(0, LoraConfig::Disabled),
                |e| matches!(e, E::InvalidSetting { setting: "max_num_seqs", .. }),
                &["max_num_seqs = 0", "at least 1"],
            ),
            (
                "captured LoRA count 0",
                new(4, LoraConfig::Specialized { captured_counts: vec![2, 0] }),
                |e| matches!(e, E::InvalidLora { .. }),
                &["LoRA", "captured LoRA counts must be at least 1"],
            ),
            (
                "max_loras 0",
                new(4, LoraConfig::Unspecialized { max_loras: 0 }),
                |e| matches!(e, E::InvalidLora { .. }),
                &["LoRA", "max_loras must be in 1..u32::MAX"],
            ),
            (
                "max_loras u32::MAX",
                new(4, LoraConfig::Unspecialized { max_loras: u32::MAX }),
                |e| matches!(e, E::InvalidLora { .. }),
                &["LoRA", "max_loras must be in 1..u32::MAX"],
            ),
            (
                "zero query length",
                keys(true, GraphMode::Full, 0),
                |e| matches!(e, E::InvalidSetting { setting: "uniform_decode_query_len", .. }),
                &["uniform_decode_query_len = 0", "1 + num_spec_tokens, at least 1"],
            ),
            (
                "piecewise without splitting attention",
                keys(false, GraphMode::FullAndPiecewise, 1),
                |e| matches!(e, E::PiecewiseNeedsSplittingAttention { mode: GraphMode::FullAndPiecewise }),
                &["FULL_AND_PIECEWISE", "not a splitting op", "FULL_DECODE_ONLY, FULL or NONE"],
            ),
            (
                "size not a whole number of requests",
                keys(true, GraphMode::FullDecodeOnly, 2),
                |e| matches!(e, E::SizeNotMultipleOfQueryLen { size: 1, query_len: 2 }),
                &["capture size 1", "multiple of the uniform decode query length 2", "round_for_spec_decode"],
            ),
            (
                "no allowed mode",
                fdo.dispatch(4, true, false, 0, full, full).map(|_| ()),
                |e| matches!(e, E::NoAllowedMode { .. }),
                &["no allowed mode", "valid_modes = {FULL}", "invalid_modes = {FULL}"],
            ),
            (
                "eager not allowed",
                fdo.dispatch(4, false, false, 0, graphs, NO).map(|_| ()),
                |e| matches!(e, E::EagerNotAllowed { num_tokens: 4, .. }),
                &["batch of 4 tokens", "allowed modes {PIECEWISE, FULL}", "add NONE to valid_modes"],
            ),
        ];
        holdfast_hal::testing::check_errors(cases);
    }

    #[test]
    fn capture_list_is_piecewise_then_full_each_largest_first() {
        let d = dispatcher(
            &[1, 2, 4],
            8,
            LoraConfig::Specialized { captured_counts: vec![1, 2] },
            GraphMode::FullAndPiecewise,
            1,
        );
        let descs = d.capture_descs();
        assert_eq!(descs.iter().map(|(m, _)| *m).collect::<Vec<_>>(), vec![R::Piecewise, R::Full]);
        let order = |v: &[BatchDescriptor]| v.iter().map(|d| (d.num_tokens, d.num_active_loras)).collect::<Vec<_>>();
        let want = vec![(4, 2), (4, 1), (4, 0), (2, 2), (2, 1), (2, 0), (1, 2), (1, 1), (1, 0)];
        assert_eq!(order(&descs[0].1), want);
        assert_eq!(order(&descs[1].1), want);
        assert!(descs[0].1.iter().all(|d| d.num_reqs.is_none() && !d.uniform));
        assert!(descs[1].1.iter().all(|d| d.uniform && d.num_reqs == Some(d.num_tokens)));
        assert!(descs[1].1.iter().all(|d| d.has_lora == (d.num_active_loras > 0)));
    }

    #[test]
    fn lora_steps_look_up_the_captured_adapter_count() {
        let lora = LoraConfig::Specialized { captured_counts: vec![1, 2, 4] };
        let mut d = dispatcher(&[1, 2, 4, 8], 8, lora, GraphMode::FullAndPiecewise, 1);
        let r = d.dispatch(3, true, true, 3, ALL, NO);
        assert_eq!(r.map(|(m, x)| (m, x.num_active_loras, x.has_lora)), Ok((R::Full, 4, true)));
        // More adapters than any capture: count kept, no key, eager.
        let r = d.dispatch(3, true, true, 5, ALL, NO);
        assert_eq!(r.map(|(m, _)| m), Ok(R::None));

        let mut d =
            dispatcher(&[1, 2, 4, 8], 8, LoraConfig::Unspecialized { max_loras: 4 }, GraphMode::FullAndPiecewise, 1);
        let r = d.dispatch(3, false, true, 1, ALL, NO);
        assert_eq!(r.map(|(m, x)| (m, x.num_active_loras)), Ok((R::Piecewise, 5)));
        // Unspecialised graphs are captured with adapters only.
        assert_eq!(d.dispatch(3, false, false, 0, ALL, NO).map(|(m, _)| m), Ok(R::None));
    }

    #[test]
    fn stats_count_modes_fallbacks_and_padding() {
        let mut d = dsv4(GraphMode::FullAndPiecewise);
        go(&mut d, 3, true); // FULL, padded to 4
        go(&mut d, 5, false); // PIECEWISE, padded to 8
        go(&mut d, 40, false); // NONE above max
        let _ = d.dispatch(4, true, false, 0, ModeSet::only(R::None), NO); // NONE not allowed
        let s = *d.stats();
        assert_eq!((s.count(R::Full), s.count(R::Piecewise), s.count(R::None)), (1, 1, 2));
        assert_eq!(s.fallbacks(FallbackReason::AboveMaxSize), 1);
        assert_eq!(s.fallbacks(FallbackReason::NotAllowed), 1);
        assert_eq!((s.real_tokens(), s.padded_tokens(), s.padding_overhead()), (52, 56, 4));
        assert!(s.to_string().contains("overhead=4"));
        d.reset_stats();
        assert_eq!(d.stats().dispatches(), 0);
    }
}
