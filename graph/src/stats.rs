//! Dispatch counters: what each step ran as, why eager steps fell back, and how many tokens
//! padding added. Plain integers updated in place; reading them costs nothing.

use std::fmt;

use crate::mode::RuntimeMode;

/// Why a step ran eagerly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// Keys not initialised, mode NONE, or no capture sizes.
    GraphsDisabled = 0,
    /// More tokens than the largest capture size.
    AboveMaxSize = 1,
    /// A graph exists (or could have been used) but the caller's valid/invalid modes excluded it.
    NotAllowed = 2,
    /// No key matches the padded descriptor in any allowed mode.
    NotInKeys = 3,
}

impl FallbackReason {
    /// Every reason, in declaration order.
    pub const ALL: [FallbackReason; 4] = [
        FallbackReason::GraphsDisabled,
        FallbackReason::AboveMaxSize,
        FallbackReason::NotAllowed,
        FallbackReason::NotInKeys,
    ];

    /// Short snake-case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            FallbackReason::GraphsDisabled => "graphs_disabled",
            FallbackReason::AboveMaxSize => "above_max_size",
            FallbackReason::NotAllowed => "not_allowed",
            FallbackReason::NotInKeys => "not_in_keys",
        }
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Counters over every successful dispatch since creation or the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DispatchStats {
    per_mode: [u64; 3],
    fallbacks: [u64; 4],
    real_tokens: u64,
    padded_tokens: u64,
}

impl DispatchStats {
    #[inline]
    pub(crate) fn record(&mut self, mode: RuntimeMode, real: u32, padded: u32, why: Option<FallbackReason>) {
        self.per_mode[mode as usize] += 1;
        if let Some(r) = why {
            self.fallbacks[r as usize] += 1;
        }
        self.real_tokens += u64::from(real);
        self.padded_tokens += u64::from(padded);
    }

    /// Steps dispatched in total.
    pub fn dispatches(&self) -> u64 {
        self.per_mode.iter().sum()
    }

    /// Steps dispatched to `mode`.
    pub fn count(&self, mode: RuntimeMode) -> u64 {
        self.per_mode[mode as usize]
    }

    /// Eager steps for `reason`.
    pub fn fallbacks(&self, reason: FallbackReason) -> u64 {
        self.fallbacks[reason as usize]
    }

    /// Tokens the steps really had.
    pub fn real_tokens(&self) -> u64 {
        self.real_tokens
    }

    /// Tokens the steps ran with after padding (equal to the real count for eager steps).
    pub fn padded_tokens(&self) -> u64 {
        self.padded_tokens
    }

    /// Tokens added by padding.
    pub fn padding_overhead(&self) -> u64 {
        self.padded_tokens.saturating_sub(self.real_tokens)
    }

    /// Padded over real tokens (1.0 = no padding; 1.0 when nothing ran).
    pub fn padding_ratio(&self) -> f64 {
        if self.real_tokens == 0 {
            1.0
        } else {
            self.padded_tokens as f64 / self.real_tokens as f64
        }
    }
}

impl fmt::Display for DispatchStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dispatches={} full={} piecewise={} none={} (",
            self.dispatches(),
            self.count(RuntimeMode::Full),
            self.count(RuntimeMode::Piecewise),
            self.count(RuntimeMode::None)
        )?;
        for (i, r) in FallbackReason::ALL.into_iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{}={}", r, self.fallbacks(r))?;
        }
        write!(
            f,
            ") tokens real={} padded={} overhead={}",
            self.real_tokens,
            self.padded_tokens,
            self.padding_overhead()
        )
    }
}
