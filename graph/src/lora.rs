//! How LoRA adapters enter graph keys (spec §3.3): the active-adapter counts graphs are
//! captured for, and the count a step is looked up with.

use crate::error::GraphError;

/// LoRA graph configuration of a [`Dispatcher`](crate::Dispatcher).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LoraConfig {
    /// No LoRA: every key has `num_active_loras = 0`.
    #[default]
    Disabled,
    /// Graphs specialised on the number of active adapters: captured for 0 and for each count in
    /// `captured_counts`; a step with `k` active adapters uses the smallest captured count `>= k`.
    Specialized {
        /// Active-adapter counts with their own graphs, each ≥ 1 (sorted and deduplicated by
        /// the dispatcher).
        captured_counts: Vec<u32>,
    },
    /// One set of LoRA graphs sized for the worst case, `max_loras + 1` adapters.
    Unspecialized {
        /// Most adapters active in one step (≥ 1).
        max_loras: u32,
    },
}

impl LoraConfig {
    /// Specialised on the powers of two up to `max_loras + 1`, plus `max_loras + 1` itself
    /// (e.g. 8 → 1, 2, 4, 8, 9).
    pub fn specialized_powers_of_two(max_loras: u32) -> LoraConfig {
        let top = max_loras.saturating_add(1);
        let mut captured_counts: Vec<u32> = (0..32).map(|b| 1u32 << b).take_while(|&p| p <= top).collect();
        if captured_counts.last() != Some(&top) {
            captured_counts.push(top);
        }
        LoraConfig::Specialized { captured_counts }
    }

    /// The configuration with counts sorted and deduplicated, or an error saying what is wrong.
    pub(crate) fn validated(&self) -> Result<LoraConfig, GraphError> {
        match self {
            LoraConfig::Disabled => Ok(LoraConfig::Disabled),
            LoraConfig::Specialized { captured_counts } => {
                let mut c = captured_counts.clone();
                c.sort_unstable();
                c.dedup();
                if c.first() == Some(&0) {
                    return Err(GraphError::InvalidLora {
                        reason: "captured LoRA counts must be at least 1 (the no-adapter case is \
                                 always captured)",
                    });
                }
                Ok(LoraConfig::Specialized { captured_counts: c })
            }
            LoraConfig::Unspecialized { max_loras } => {
                if *max_loras == 0 || *max_loras == u32::MAX {
                    return Err(GraphError::InvalidLora { reason: "max_loras must be in 1..u32::MAX" });
                }
                Ok(LoraConfig::Unspecialized { max_loras: *max_loras })
            }
        }
    }

    /// The `num_active_loras` values graphs are captured for.
    pub(crate) fn capture_cases(&self) -> Vec<u32> {
        match self {
            LoraConfig::Disabled => vec![0],
            LoraConfig::Specialized { captured_counts } => {
                std::iter::once(0).chain(captured_counts.iter().copied()).collect()
            }
            LoraConfig::Unspecialized { max_loras } => vec![max_loras.saturating_add(1)],
        }
    }

    /// The adapter count a step with `num_active_loras` adapters is looked up with.
    #[inline]
    pub(crate) fn effective_count(&self, has_lora: bool, num_active_loras: u32) -> u32 {
        if !has_lora || num_active_loras == 0 {
            return num_active_loras;
        }
        match self {
            LoraConfig::Disabled => num_active_loras,
            LoraConfig::Specialized { captured_counts } => {
                let i = captured_counts.partition_point(|&c| c < num_active_loras);
                captured_counts.get(i).copied().unwrap_or(num_active_loras)
            }
            LoraConfig::Unspecialized { max_loras } => max_loras.saturating_add(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_of_two_end_with_max_plus_one() {
        let counts = |m| match LoraConfig::specialized_powers_of_two(m) {
            LoraConfig::Specialized { captured_counts } => captured_counts,
            other => panic!("{other:?}"),
        };
        assert_eq!(counts(8), vec![1, 2, 4, 8, 9]);
        assert_eq!(counts(3), vec![1, 2, 4]);
        assert_eq!(counts(1), vec![1, 2]);
    }

    #[test]
    fn capture_cases_follow_the_config_kind() {
        assert_eq!(LoraConfig::Disabled.capture_cases(), vec![0]);
        let s = LoraConfig::Specialized { captured_counts: vec![1, 2, 4] };
        assert_eq!(s.capture_cases(), vec![0, 1, 2, 4]);
        assert_eq!(LoraConfig::Unspecialized { max_loras: 4 }.capture_cases(), vec![5]);
    }

    #[test]
    fn effective_count_rounds_up_to_a_captured_count_or_keeps_it() {
        let s = LoraConfig::Specialized { captured_counts: vec![1, 2, 4, 8] };
        assert_eq!(s.effective_count(true, 3), 4);
        assert_eq!(s.effective_count(true, 4), 4);
        assert_eq!(s.effective_count(true, 9), 9);
        assert_eq!(s.effective_count(false, 3), 3);
        assert_eq!(s.effective_count(true, 0), 0);
        let u = LoraConfig::Unspecialized { max_loras: 4 };
        assert_eq!(u.effective_count(true, 1), 5);
        assert_eq!(u.effective_count(false, 1), 1);
        assert_eq!(LoraConfig::Disabled.effective_count(true, 3), 3);
    }

    #[test]
    fn validation_sorts_counts_and_rejects_zero() {
        let s = LoraConfig::Specialized { captured_counts: vec![4, 1, 4] };
        assert_eq!(s.validated(), Ok(LoraConfig::Specialized { captured_counts: vec![1, 4] }));
        assert!(LoraConfig::Specialized { captured_counts: vec![0, 1] }.validated().is_err());
        assert!(LoraConfig::Unspecialized { max_loras: 0 }.validated().is_err());
    }
}
