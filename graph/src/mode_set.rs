//! A set of runtime modes as three bits, so a dispatch call's valid/invalid sets cost nothing to
//! build, pass or intersect.

use std::fmt;

use crate::mode::RuntimeMode;

/// A set of [`RuntimeMode`]s (a 3-bit bitset, `Copy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ModeSet(u8);

impl ModeSet {
    /// The empty set.
    pub const EMPTY: ModeSet = ModeSet(0);
    /// `{None, Piecewise, Full}`.
    pub const ALL: ModeSet = ModeSet(0b111);

    /// The set holding only `m`.
    pub const fn only(m: RuntimeMode) -> ModeSet {
        ModeSet(m.bit())
    }

    /// The set holding every mode in `modes`.
    pub const fn of(modes: &[RuntimeMode]) -> ModeSet {
        let mut bits = 0;
        let mut i = 0;
        while i < modes.len() {
            bits |= modes[i].bit();
            i += 1;
        }
        ModeSet(bits)
    }

    /// This set with `m` added.
    #[must_use]
    pub const fn with(self, m: RuntimeMode) -> ModeSet {
        ModeSet(self.0 | m.bit())
    }

    /// This set with `m` removed.
    #[must_use]
    pub const fn without(self, m: RuntimeMode) -> ModeSet {
        ModeSet(self.0 & !m.bit())
    }

    /// Modes in `self` and not in `other`.
    #[must_use]
    pub const fn minus(self, other: ModeSet) -> ModeSet {
        ModeSet(self.0 & !other.0)
    }

    /// Modes in either set.
    #[must_use]
    pub const fn union(self, other: ModeSet) -> ModeSet {
        ModeSet(self.0 | other.0)
    }

    /// Whether `m` is in the set.
    pub const fn contains(self, m: RuntimeMode) -> bool {
        self.0 & m.bit() != 0
    }

    /// Whether the set is empty.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Number of modes in the set.
    pub const fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// Whether every mode of `self` is in `other`.
    pub const fn is_subset_of(self, other: ModeSet) -> bool {
        self.0 & !other.0 == 0
    }

    /// The modes in the set, ascending.
    pub fn iter(self) -> impl Iterator<Item = RuntimeMode> {
        RuntimeMode::ALL.into_iter().filter(move |&m| self.contains(m))
    }
}

impl FromIterator<RuntimeMode> for ModeSet {
    fn from_iter<I: IntoIterator<Item = RuntimeMode>>(iter: I) -> ModeSet {
        iter.into_iter().fold(ModeSet::EMPTY, ModeSet::with)
    }
}

impl From<RuntimeMode> for ModeSet {
    fn from(m: RuntimeMode) -> ModeSet {
        ModeSet::only(m)
    }
}

impl fmt::Display for ModeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, m) in self.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(m.as_str())?;
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RuntimeMode as R;

    #[test]
    fn set_operations_agree_with_membership() {
        for bits in 0..8u8 {
            let s: ModeSet = R::ALL.into_iter().filter(|m| bits & m.bit() != 0).collect();
            assert_eq!(s.len(), bits.count_ones() as usize);
            for m in R::ALL {
                assert_eq!(s.contains(m), bits & m.bit() != 0);
                assert!(!s.without(m).contains(m));
                assert!(s.with(m).contains(m));
            }
            assert!(s.is_subset_of(ModeSet::ALL));
            assert_eq!(ModeSet::ALL.minus(s).union(s), ModeSet::ALL);
        }
    }

    #[test]
    fn display_lists_modes_ascending() {
        assert_eq!(ModeSet::of(&[R::Full, R::None]).to_string(), "{NONE, FULL}");
        assert_eq!(ModeSet::EMPTY.to_string(), "{}");
    }
}
