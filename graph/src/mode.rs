//! Graph modes: what the configuration asks for ([`GraphMode`]) and what one step runs as
//! ([`RuntimeMode`]).
//!
//! A configured mode is a pair `(decode mode, mixed mode)`: the first applies to uniform-decode
//! batches, the second to everything else (prefill, mixed prefill/decode). The three plain modes
//! are the pairs `(m, m)`; `FullDecodeOnly = (Full, None)` and `FullAndPiecewise = (Full,
//! Piecewise)` are the two *separate-routine* modes. Only plain modes are runtime modes, which is
//! why the dispatcher hands out a [`RuntimeMode`]: a composite mode cannot reach a graph runner.
//!
//! Display uses the upper-case names (`FULL_AND_PIECEWISE`), the spelling of the reference's logs
//! and config docs; parsing accepts any case and `-` for `_`.

use std::fmt;
use std::str::FromStr;

use crate::error::GraphError;
use crate::mode_set::ModeSet;

/// A mode one forward step can run in. Ordered by how much of the step is captured:
/// `None < Piecewise < Full`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum RuntimeMode {
    /// Run eagerly, no graph.
    None = 0,
    /// Replay graphs of the segments between splitting ops (attention runs eagerly).
    Piecewise = 1,
    /// Replay one graph of the whole forward.
    Full = 2,
}

impl RuntimeMode {
    /// The three runtime modes, ascending.
    pub const ALL: [RuntimeMode; 3] = [RuntimeMode::None, RuntimeMode::Piecewise, RuntimeMode::Full];

    /// Upper-case name, as displayed.
    pub const fn as_str(self) -> &'static str {
        match self {
            RuntimeMode::None => "NONE",
            RuntimeMode::Piecewise => "PIECEWISE",
            RuntimeMode::Full => "FULL",
        }
    }

    /// Bit of this mode in a [`ModeSet`].
    pub(crate) const fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for RuntimeMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The configured graph mode: a `(decode, mixed)` pair of runtime modes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GraphMode {
    /// No graphs: `(None, None)`.
    None,
    /// Piecewise graphs for every batch: `(Piecewise, Piecewise)`.
    Piecewise,
    /// One full graph for every captured batch shape: `(Full, Full)`.
    Full,
    /// Full graphs for uniform decode, eager for the rest: `(Full, None)`.
    FullDecodeOnly,
    /// Full graphs for uniform decode, piecewise for the rest: `(Full, Piecewise)`. The default.
    #[default]
    FullAndPiecewise,
}

impl GraphMode {
    /// The five modes, in declaration order.
    pub const ALL: [GraphMode; 5] = [
        GraphMode::None,
        GraphMode::Piecewise,
        GraphMode::Full,
        GraphMode::FullDecodeOnly,
        GraphMode::FullAndPiecewise,
    ];

    /// The `(decode, mixed)` pair this mode stands for.
    pub const fn pair(self) -> (RuntimeMode, RuntimeMode) {
        match self {
            GraphMode::None => (RuntimeMode::None, RuntimeMode::None),
            GraphMode::Piecewise => (RuntimeMode::Piecewise, RuntimeMode::Piecewise),
            GraphMode::Full => (RuntimeMode::Full, RuntimeMode::Full),
            GraphMode::FullDecodeOnly => (RuntimeMode::Full, RuntimeMode::None),
            GraphMode::FullAndPiecewise => (RuntimeMode::Full, RuntimeMode::Piecewise),
        }
    }

    /// The mode whose pair is `(decode, mixed)`, if there is one (e.g. `(None, Full)` has none).
    pub const fn from_pair(decode: RuntimeMode, mixed: RuntimeMode) -> Option<GraphMode> {
        match (decode, mixed) {
            (RuntimeMode::None, RuntimeMode::None) => Some(GraphMode::None),
            (RuntimeMode::Piecewise, RuntimeMode::Piecewise) => Some(GraphMode::Piecewise),
            (RuntimeMode::Full, RuntimeMode::Full) => Some(GraphMode::Full),
            (RuntimeMode::Full, RuntimeMode::None) => Some(GraphMode::FullDecodeOnly),
            (RuntimeMode::Full, RuntimeMode::Piecewise) => Some(GraphMode::FullAndPiecewise),
            _ => None,
        }
    }

    /// Mode for uniform-decode batches.
    pub const fn decode_mode(self) -> RuntimeMode {
        self.pair().0
    }

    /// Mode for mixed and prefill batches.
    pub const fn mixed_mode(self) -> RuntimeMode {
        self.pair().1
    }

    /// True for the two composite modes, whose decode and mixed batches take different routes
    /// (and so have separate FULL uniform-decode keys).
    pub const fn separate_routine(self) -> bool {
        matches!(self, GraphMode::FullDecodeOnly | GraphMode::FullAndPiecewise)
    }

    /// Whether `m` is the decode or the mixed half of this mode (for a plain mode: whether it
    /// equals `m`). Taking a [`RuntimeMode`] makes the reference's "argument must not be a
    /// composite mode" precondition a type.
    pub const fn has_mode(self, m: RuntimeMode) -> bool {
        let (d, x) = self.pair();
        d as u8 == m as u8 || x as u8 == m as u8
    }

    /// The larger of the decode and mixed modes.
    pub const fn max_mode(self) -> RuntimeMode {
        let (d, x) = self.pair();
        if (d as u8) >= (x as u8) {
            d
        } else {
            x
        }
    }

    /// Whether any full graph is captured.
    pub const fn has_full(self) -> bool {
        matches!(self.max_mode(), RuntimeMode::Full)
    }

    /// Whether any piecewise graph is captured.
    pub const fn has_piecewise(self) -> bool {
        self.has_mode(RuntimeMode::Piecewise)
    }

    /// Whether the model must be compiled piecewise (split at attention); same as
    /// [`has_piecewise`](Self::has_piecewise).
    pub const fn requires_piecewise_compilation(self) -> bool {
        self.has_piecewise()
    }

    /// The modes a dispatcher may hand out: `{None, Piecewise, Full}`.
    pub const fn valid_runtime_modes() -> ModeSet {
        ModeSet::ALL
    }

    /// Whether this mode is itself a runtime mode (one of the three plain modes).
    pub const fn is_valid_runtime_mode(self) -> bool {
        self.as_runtime().is_some()
    }

    /// This mode as a runtime mode, if it is one.
    pub const fn as_runtime(self) -> Option<RuntimeMode> {
        match self {
            GraphMode::None => Some(RuntimeMode::None),
            GraphMode::Piecewise => Some(RuntimeMode::Piecewise),
            GraphMode::Full => Some(RuntimeMode::Full),
            GraphMode::FullDecodeOnly | GraphMode::FullAndPiecewise => None,
        }
    }

    /// Whether graphs are used at all (`self != None`); the reference's truthiness.
    pub const fn is_enabled(self) -> bool {
        !matches!(self, GraphMode::None)
    }

    /// Upper-case name, as displayed.
    pub const fn as_str(self) -> &'static str {
        match self {
            GraphMode::None => "NONE",
            GraphMode::Piecewise => "PIECEWISE",
            GraphMode::Full => "FULL",
            GraphMode::FullDecodeOnly => "FULL_DECODE_ONLY",
            GraphMode::FullAndPiecewise => "FULL_AND_PIECEWISE",
        }
    }
}

impl From<RuntimeMode> for GraphMode {
    fn from(m: RuntimeMode) -> GraphMode {
        match m {
            RuntimeMode::None => GraphMode::None,
            RuntimeMode::Piecewise => GraphMode::Piecewise,
            RuntimeMode::Full => GraphMode::Full,
        }
    }
}

impl TryFrom<GraphMode> for RuntimeMode {
    type Error = GraphError;

    fn try_from(mode: GraphMode) -> Result<RuntimeMode, GraphError> {
        mode.as_runtime().ok_or(GraphError::NotARuntimeMode { mode })
    }
}

impl fmt::Display for GraphMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GraphMode {
    type Err = GraphError;

    /// Case-insensitive; surrounding whitespace is ignored and `-` counts as `_`.
    fn from_str(s: &str) -> Result<GraphMode, GraphError> {
        let trimmed = s.trim();
        GraphMode::ALL
            .into_iter()
            .find(|m| {
                let name = m.as_str().as_bytes();
                let given = trimmed.as_bytes();
                name.len() == given.len()
                    && name.iter().zip(given).all(|(&n, &g)| {
                        let g = if g == b'-' { b'_' } else { g.to_ascii_uppercase() };
                        n == g
                    })
            })
            .ok_or_else(|| GraphError::UnknownGraphMode { input: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RuntimeMode as R;

    /// One row of the reference truth table (spec §1.2).
    struct Row {
        mode: GraphMode,
        decode: R,
        mixed: R,
        separate: bool,
        max: R,
        has_full: bool,
        has_piecewise: bool,
        has_none: bool,
        has_full_mode: bool,
        enabled: bool,
    }

    #[rustfmt::skip]
    const TABLE: [Row; 5] = [
        Row { mode: GraphMode::None, decode: R::None, mixed: R::None, separate: false, max: R::None, has_full: false, has_piecewise: false, has_none: true, has_full_mode: false, enabled: false },
        Row { mode: GraphMode::Piecewise, decode: R::Piecewise, mixed: R::Piecewise, separate: false, max: R::Piecewise, has_full: false, has_piecewise: true, has_none: false, has_full_mode: false, enabled: true },
        Row { mode: GraphMode::Full, decode: R::Full, mixed: R::Full, separate: false, max: R::Full, has_full: true, has_piecewise: false, has_none: false, has_full_mode: true, enabled: true },
        Row { mode: GraphMode::FullDecodeOnly, decode: R::Full, mixed: R::None, separate: true, max: R::Full, has_full: true, has_piecewise: false, has_none: true, has_full_mode: true, enabled: true },
        Row { mode: GraphMode::FullAndPiecewise, decode: R::Full, mixed: R::Piecewise, separate: true, max: R::Full, has_full: true, has_piecewise: true, has_none: false, has_full_mode: true, enabled: true },
    ];

    #[test]
    fn every_helper_matches_the_reference_truth_table() {
        for r in &TABLE {
            let m = r.mode;
            assert_eq!(m.decode_mode(), r.decode, "{m} decode");
            assert_eq!(m.mixed_mode(), r.mixed, "{m} mixed");
            assert_eq!(m.separate_routine(), r.separate, "{m} separate");
            assert_eq!(m.max_mode(), r.max, "{m} max");
            assert_eq!(m.has_full(), r.has_full, "{m} has_full");
            assert_eq!(m.has_piecewise(), r.has_piecewise, "{m} has_piecewise");
            assert_eq!(m.requires_piecewise_compilation(), r.has_piecewise, "{m} requires pw");
            assert_eq!(m.has_mode(R::None), r.has_none, "{m} has_mode(NONE)");
            assert_eq!(m.has_mode(R::Full), r.has_full_mode, "{m} has_mode(FULL)");
            assert_eq!(m.has_mode(R::Piecewise), r.has_piecewise, "{m} has_mode(PIECEWISE)");
            assert_eq!(m.is_enabled(), r.enabled, "{m} bool");
            assert_eq!(m.is_valid_runtime_mode(), !r.separate, "{m} is runtime");
        }
    }

    #[test]
    fn pair_encoding_round_trips_and_rejects_unnamed_pairs() {
        for m in GraphMode::ALL {
            let (d, x) = m.pair();
            assert_eq!(GraphMode::from_pair(d, x), Some(m));
        }
        let named = GraphMode::ALL.map(GraphMode::pair);
        for d in R::ALL {
            for x in R::ALL {
                assert_eq!(GraphMode::from_pair(d, x).is_some(), named.contains(&(d, x)));
            }
        }
    }

    #[test]
    fn valid_runtime_modes_are_exactly_the_plain_modes() {
        let set = GraphMode::valid_runtime_modes();
        assert_eq!(set.len(), 3);
        for m in R::ALL {
            assert!(set.contains(m));
            assert_eq!(RuntimeMode::try_from(GraphMode::from(m)), Ok(m));
        }
        for m in [GraphMode::FullDecodeOnly, GraphMode::FullAndPiecewise] {
            assert_eq!(RuntimeMode::try_from(m), Err(GraphError::NotARuntimeMode { mode: m }));
            let msg = RuntimeMode::try_from(m).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains(m.as_str()) && msg.contains("only NONE, PIECEWISE and FULL"), "{msg}");
        }
    }

    #[test]
    fn default_is_full_and_piecewise() {
        assert_eq!(GraphMode::default(), GraphMode::FullAndPiecewise);
    }

    #[test]
    fn display_then_parse_is_identity() {
        for m in GraphMode::ALL {
            assert_eq!(m.to_string().parse::<GraphMode>(), Ok(m));
            assert_eq!(m.to_string().to_lowercase().parse::<GraphMode>(), Ok(m));
        }
    }

    #[test]
    fn parsing_ignores_case_and_accepts_dashes() {
        for s in ["full_and_piecewise", "FULL-AND-PIECEWISE", "Full-And_Piecewise", " full_and_piecewise\n"] {
            assert_eq!(s.parse::<GraphMode>(), Ok(GraphMode::FullAndPiecewise), "{s:?}");
        }
        assert_eq!("full_decode_only".parse::<GraphMode>(), Ok(GraphMode::FullDecodeOnly));
        assert_eq!("none".parse::<GraphMode>(), Ok(GraphMode::None));
    }

    #[test]
    fn an_unknown_mode_string_is_an_error_naming_it() {
        for s in ["", "fullandpiecewise", "full_", "piecewise2", "ｆｕｌｌ"] {
            let err = s.parse::<GraphMode>();
            assert_eq!(err, Err(GraphError::UnknownGraphMode { input: s.to_owned() }));
        }
        let msg = "bogus".parse::<GraphMode>().map(|_| ()).err().map(|e| e.to_string());
        assert!(msg.is_some_and(|m| m.contains("`bogus`") && m.contains("full_and_piecewise")));
    }
}
