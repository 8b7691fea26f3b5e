//! What an attention backend can capture ([`CgSupport`]) and how the weakest backend's level
//! turns a configured [`GraphMode`] into the mode actually used ([`resolve`]).
//!
//! Resolution applies the reference's ordered rules once, at start-up. Each rule that fires is a
//! [`Downgrade`] recorded in the result and logged once as a warning; a configuration no rule can
//! rescue is an error saying what to change, never a silent fallback to eager.

use std::fmt;

use crate::error::GraphError;
use crate::mode::{GraphMode, RuntimeMode};

/// How much of a batch an attention backend can run inside a full graph. Ordered by
/// capability: `Never < UniformSingleTokenDecode < UniformBatch < Always`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CgSupport {
    /// No full graphs.
    Never = 0,
    /// Full graphs only for pure decode batches with query length 1.
    UniformSingleTokenDecode = 1,
    /// Full graphs when every request has the same query length (spec decode: `1 + k`).
    UniformBatch = 2,
    /// Full graphs for any batch, mixed prefill/decode included.
    Always = 3,
}

impl CgSupport {
    /// Upper-case name, as displayed.
    pub const fn as_str(self) -> &'static str {
        match self {
            CgSupport::Never => "NEVER",
            CgSupport::UniformSingleTokenDecode => "UNIFORM_SINGLE_TOKEN_DECODE",
            CgSupport::UniformBatch => "UNIFORM_BATCH",
            CgSupport::Always => "ALWAYS",
        }
    }
}

impl fmt::Display for CgSupport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The strict minimum support over `(backend name, support)` pairs and the first backend that
/// has it. With no backends the result is `(Always, None)`, as in the reference.
pub fn min_support<'a, I>(backends: I) -> (CgSupport, Option<&'a str>)
where
    I: IntoIterator<Item = (&'a str, CgSupport)>,
{
    backends.into_iter().fold(
        (CgSupport::Always, None),
        |(best, name), (n, s)| {
            if s < best {
                (s, Some(n))
            } else {
                (best, name)
            }
        },
    )
}

/// Facts about the model and its attention that resolution needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolveContext<'a> {
    /// Name of the attention backend that produced the minimum support (used in messages).
    pub backend: &'a str,
    /// Query length of a uniform decode request, `1 + num_spec_tokens` (≥ 1).
    pub uniform_decode_query_len: u32,
    /// Whether attention ops are splitting ops, i.e. piecewise graphs around eager attention
    /// can be captured.
    pub attention_is_splitting_op: bool,
}

/// Which resolution rule fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DowngradeRule {
    /// Full graphs for mixed batches need `Always`.
    MixedFullUnsupported,
    /// Full decode graphs need more than `Never`.
    DecodeFullUnsupported,
    /// Full decode graphs with query length > 1 need at least `UniformBatch`.
    SpecDecodeUnsupported,
}

/// One downgrade applied during resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Downgrade {
    /// Mode before the rule.
    pub from: GraphMode,
    /// Mode after the rule.
    pub to: GraphMode,
    /// The rule that fired.
    pub rule: DowngradeRule,
    /// Human-readable explanation (backend, level, what was chosen and why).
    pub reason: String,
}

impl fmt::Display for Downgrade {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}: {}", self.from, self.to, self.reason)
    }
}

/// Outcome of [`resolve`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The mode to use.
    pub mode: GraphMode,
    /// Downgrades applied, in order (empty when the configured mode stands).
    pub downgrades: Vec<Downgrade>,
    /// The context's `1 + num_spec_tokens`.
    pub uniform_decode_query_len: u32,
}

impl Resolved {
    /// Whether capture sizes must be rounded to multiples of the uniform decode query length
    /// (full decode graphs with spec decode).
    pub const fn needs_spec_decode_rounding(&self) -> bool {
        matches!(self.mode.decode_mode(), RuntimeMode::Full) && self.uniform_decode_query_len > 1
    }
}

const ADVICE_NEVER_MIXED: &str = "set the graph mode to PIECEWISE (with attention as a splitting \
                                  op) or NONE";
const ADVICE_FINAL: &str = "this backend cannot run inside any full graph; set the graph mode to \
                            PIECEWISE or NONE";

/// Resolve the configured `mode` against the weakest attention backend's `min_support`.
///
/// Rules, in order (spec §2.2):
/// 1. mixed mode FULL and support below `Always`: `Never` is an error; otherwise
///    `FullAndPiecewise` when attention is a splitting op, else `FullDecodeOnly`;
/// 2. decode mode FULL and support `Never`: `Piecewise` when attention is a splitting op, else
///    `None`;
/// 3. decode mode FULL, query length > 1 and support below `UniformBatch`: `Piecewise` when
///    attention is a splitting op, else `None`;
/// 4. any full graph left with support `Never` is an error.
pub fn resolve(mode: GraphMode, min_support: CgSupport, ctx: &ResolveContext<'_>) -> Result<Resolved, GraphError> {
    let q = ctx.uniform_decode_query_len;
    if q == 0 {
        return Err(GraphError::InvalidSetting {
            setting: "uniform_decode_query_len",
            value: q.to_string(),
            reason: "must be 1 + num_spec_tokens, at least 1",
        });
    }
    let mut current = mode;
    let mut downgrades = Vec::new();
    let splitting = ctx.attention_is_splitting_op;
    let piecewise_or_none = if splitting { GraphMode::Piecewise } else { GraphMode::None };

    if current.mixed_mode() == RuntimeMode::Full && min_support != CgSupport::Always {
        if min_support == CgSupport::Never {
            return Err(GraphError::UnsupportedGraphMode {
                mode: current,
                backend: ctx.backend.to_owned(),
                support: min_support,
                advice: ADVICE_NEVER_MIXED,
            });
        }
        let to = if splitting { GraphMode::FullAndPiecewise } else { GraphMode::FullDecodeOnly };
        let why = if splitting {
            "mixed batches run piecewise around attention"
        } else {
            "mixed batches run eagerly because attention is not a splitting op"
        };
        downgrades.push(Downgrade {
            from: current,
            to,
            rule: DowngradeRule::MixedFullUnsupported,
            reason: format!(
                "attention backend `{}` (support {}) cannot capture mixed batches in a full \
                 graph; {why}",
                ctx.backend, min_support
            ),
        });
        current = to;
    }

    if current.decode_mode() == RuntimeMode::Full && min_support == CgSupport::Never {
        let why = if splitting {
            "attention is a splitting op, so piecewise graphs remain"
        } else {
            "attention is not a splitting op, so no graph can be captured"
        };
        downgrades.push(Downgrade {
            from: current,
            to: piecewise_or_none,
            rule: DowngradeRule::DecodeFullUnsupported,
            reason: format!(
                "attention backend `{}` (support {}) cannot capture decode batches in a full \
                 graph; {why}",
                ctx.backend, min_support
            ),
        });
        current = piecewise_or_none;
    } else if current.decode_mode() == RuntimeMode::Full && q > 1 && min_support < CgSupport::UniformBatch {
        let why = if splitting {
            "using piecewise graphs"
        } else {
            "running eagerly because attention is not a splitting op"
        };
        downgrades.push(Downgrade {
            from: current,
            to: piecewise_or_none,
            rule: DowngradeRule::SpecDecodeUnsupported,
            reason: format!(
                "attention backend `{}` (support {}) cannot capture spec-decode batches (query \
                 length {q}) in a full graph; {why}",
                ctx.backend, min_support
            ),
        });
        current = piecewise_or_none;
    }

    final_guard(current, min_support, ctx.backend)?;

    for d in &downgrades {
        tracing::warn!(from = %d.from, to = %d.to, "graph mode downgraded: {}", d.reason);
    }
    Ok(Resolved { mode: current, downgrades, uniform_decode_query_len: q })
}

/// Rule 4: no full graph may remain with a backend that supports none. The earlier rules make
/// this unreachable from [`resolve`]; it stays as a check rather than an assumption.
fn final_guard(mode: GraphMode, support: CgSupport, backend: &str) -> Result<(), GraphError> {
    if mode.has_full() && support == CgSupport::Never {
        return Err(GraphError::UnsupportedGraphMode {
            mode,
            backend: backend.to_owned(),
            support,
            advice: ADVICE_FINAL,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use CgSupport as S;
    use GraphMode as M;

    fn ctx(q: u32, splitting: bool) -> ResolveContext<'static> {
        ResolveContext { backend: "TestBackend", uniform_decode_query_len: q, attention_is_splitting_op: splitting }
    }

    fn resolved(mode: M, s: S, q: u32, splitting: bool) -> Result<(M, Vec<DowngradeRule>), GraphError> {
        resolve(mode, s, &ctx(q, splitting)).map(|r| (r.mode, r.downgrades.iter().map(|d| d.rule).collect()))
    }

    #[test]
    fn support_levels_are_ordered_by_capability() {
        assert!(S::Never < S::UniformSingleTokenDecode);
        assert!(S::UniformSingleTokenDecode < S::UniformBatch);
        assert!(S::UniformBatch < S::Always);
    }

    #[test]
    fn min_support_keeps_the_first_backend_with_the_strict_minimum() {
        assert_eq!(min_support([]), (S::Always, None));
        let b = [("A", S::Always), ("B", S::UniformBatch), ("C", S::UniformBatch), ("D", S::Always)];
        assert_eq!(min_support(b), (S::UniformBatch, Some("B")));
        assert_eq!(min_support([("A", S::Always)]), (S::Always, None));
    }

    #[test]
    fn none_resolves_to_none_whatever_the_support() {
        for s in [S::Never, S::UniformSingleTokenDecode, S::UniformBatch, S::Always] {
            assert_eq!(resolved(M::None, s, 3, false), Ok((M::None, vec![])));
        }
    }

    #[test]
    fn always_support_keeps_every_mode() {
        for m in GraphMode::ALL {
            for q in [1, 4] {
                assert_eq!(resolved(m, S::Always, q, true), Ok((m, vec![])));
            }
        }
    }

    #[test]
    fn mixed_full_with_partial_support_becomes_full_and_piecewise_when_attention_splits() {
        for s in [S::UniformSingleTokenDecode, S::UniformBatch] {
            assert_eq!(
                resolved(M::Full, s, 1, true),
                Ok((M::FullAndPiecewise, vec![DowngradeRule::MixedFullUnsupported]))
            );
        }
    }

    #[test]
    fn mixed_full_with_partial_support_becomes_full_decode_only_when_attention_does_not_split() {
        for s in [S::UniformSingleTokenDecode, S::UniformBatch] {
            assert_eq!(
                resolved(M::Full, s, 1, false),
                Ok((M::FullDecodeOnly, vec![DowngradeRule::MixedFullUnsupported]))
            );
        }
    }

    #[test]
    fn mixed_full_with_never_support_is_an_error_that_suggests_piecewise() {
        for splitting in [false, true] {
            let err = resolve(M::Full, S::Never, &ctx(1, splitting));
            let Err(e) = err else { panic!("expected an error, got {err:?}") };
            assert!(matches!(e, GraphError::UnsupportedGraphMode { mode: M::Full, support: S::Never, .. }));
            let msg = e.to_string();
            assert!(msg.contains("TestBackend") && msg.contains("PIECEWISE"), "{msg}");
        }
    }

    #[test]
    fn decode_full_with_never_support_becomes_piecewise_or_none() {
        for m in [M::FullDecodeOnly, M::FullAndPiecewise] {
            assert_eq!(resolved(m, S::Never, 1, true), Ok((M::Piecewise, vec![DowngradeRule::DecodeFullUnsupported])));
            assert_eq!(resolved(m, S::Never, 1, false), Ok((M::None, vec![DowngradeRule::DecodeFullUnsupported])));
        }
    }

    #[test]
    fn spec_decode_below_uniform_batch_drops_full_decode_graphs() {
        for m in [M::FullDecodeOnly, M::FullAndPiecewise] {
            assert_eq!(
                resolved(m, S::UniformSingleTokenDecode, 2, true),
                Ok((M::Piecewise, vec![DowngradeRule::SpecDecodeUnsupported]))
            );
            assert_eq!(
                resolved(m, S::UniformSingleTokenDecode, 2, false),
                Ok((M::None, vec![DowngradeRule::SpecDecodeUnsupported]))
            );
            // Query length 1 and UniformBatch are both fine.
            assert_eq!(resolved(m, S::UniformSingleTokenDecode, 1, true), Ok((m, vec![])));
            assert_eq!(resolved(m, S::UniformBatch, 4, false), Ok((m, vec![])));
        }
    }

    #[test]
    fn full_with_single_token_support_and_spec_decode_downgrades_twice_in_rule_order() {
        assert_eq!(
            resolved(M::Full, S::UniformSingleTokenDecode, 3, true),
            Ok((M::Piecewise, vec![DowngradeRule::MixedFullUnsupported, DowngradeRule::SpecDecodeUnsupported]))
        );
        let r = resolve(M::Full, S::UniformSingleTokenDecode, &ctx(3, false));
        let Ok(r) = r else { panic!("{r:?}") };
        assert_eq!(r.mode, M::None);
        assert_eq!(r.downgrades[0].to, M::FullDecodeOnly);
        assert_eq!(r.downgrades[1].from, M::FullDecodeOnly);
    }

    #[test]
    fn dsv4_default_resolves_to_full_and_piecewise_with_no_downgrade() {
        let r = resolve(M::default(), S::UniformBatch, &ctx(2, true));
        assert_eq!(
            r.map(|r| (r.mode, r.downgrades.len(), r.needs_spec_decode_rounding())),
            Ok((M::FullAndPiecewise, 0, true))
        );
    }

    #[test]
    fn piecewise_is_never_downgraded() {
        for s in [S::Never, S::UniformSingleTokenDecode, S::UniformBatch, S::Always] {
            assert_eq!(resolved(M::Piecewise, s, 5, true), Ok((M::Piecewise, vec![])));
        }
    }

    #[test]
    fn final_guard_rejects_any_full_graph_with_never_support() {
        for m in GraphMode::ALL {
            let r = final_guard(m, S::Never, "B");
            assert_eq!(r.is_err(), m.has_full(), "{m}");
            assert!(final_guard(m, S::UniformSingleTokenDecode, "B").is_ok());
        }
    }

    #[test]
    fn a_zero_query_length_is_an_error() {
        let r = resolve(M::Full, S::Always, &ctx(0, true));
        let Err(e) = r else { panic!("expected an error, got {r:?}") };
        assert!(matches!(e, GraphError::InvalidSetting { setting: "uniform_decode_query_len", .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains("uniform_decode_query_len = 0") && msg.contains("at least 1"), "{msg}");
    }

    #[test]
    fn downgrade_reasons_name_the_backend_and_level() {
        let r = resolve(M::Full, S::UniformBatch, &ctx(1, true));
        let Ok(r) = r else { panic!("{r:?}") };
        let text = r.downgrades[0].to_string();
        assert!(text.starts_with("FULL -> FULL_AND_PIECEWISE: "), "{text}");
        assert!(text.contains("TestBackend") && text.contains("UNIFORM_BATCH"), "{text}");
    }

    #[test]
    fn resolution_never_raises_the_largest_mode_and_full_needs_support() {
        for m in GraphMode::ALL {
            for s in [S::Never, S::UniformSingleTokenDecode, S::UniformBatch, S::Always] {
                for q in [1, 2] {
                    for splitting in [false, true] {
                        if let Ok(r) = resolve(m, s, &ctx(q, splitting)) {
                            assert!(r.mode.max_mode() <= m.max_mode(), "{m} {s} -> {}", r.mode);
                            assert!(!r.mode.has_full() || s != S::Never);
                            if r.downgrades.is_empty() {
                                assert_eq!(r.mode, m);
                            }
                        }
                    }
                }
            }
        }
    }
}
