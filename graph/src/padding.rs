//! The padding table: token count → the capture size a step of that many tokens replays
//! (spec §3.3), as one indexed load.

use crate::sizes::CaptureSizes;

/// For every token count `n` in `0..=max`, the smallest capture size `>= n` (and `0 -> 0`).
/// Counts above the largest size have no entry: such steps run eagerly, unpadded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaddingTable {
    /// `table[n]` = padded token count for `n`; length `max + 1`.
    table: Vec<u32>,
}

impl PaddingTable {
    /// Build the table for `sizes` (length `max + 1`, at most 4 MiB by
    /// [`MAX_CAPTURE_SIZE`](crate::sizes::MAX_CAPTURE_SIZE)).
    pub fn new(sizes: &CaptureSizes) -> PaddingTable {
        let sizes = sizes.sizes();
        let max = sizes.last().copied().unwrap_or(0);
        let mut table = Vec::with_capacity(max as usize + 1);
        table.push(0);
        let mut next = sizes.iter().copied();
        let mut current = 0;
        for n in 1..=max {
            while current < n {
                // Sizes are ascending and end at `max`, so this always finds one.
                current = next.next().unwrap_or(max);
            }
            table.push(current);
        }
        PaddingTable { table }
    }

    /// The padded token count for a step of `n` tokens, or `None` above the largest size.
    #[inline]
    pub fn pad(&self, n: u32) -> Option<u32> {
        self.table.get(n as usize).copied()
    }

    /// The largest capture size, in tokens (0 when there are none).
    pub fn max(&self) -> u32 {
        self.table.last().copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn table(sizes: &[u32]) -> PaddingTable {
        match CaptureSizes::new(sizes.iter().copied()) {
            Ok(s) => s.padding_table(),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn reference_examples_pad_to_the_next_captured_size() {
        let sizes: Vec<u32> = [1, 2, 4].into_iter().chain((8..256).step_by(8)).chain((256..=512).step_by(16)).collect();
        let t = table(&sizes);
        for (n, want) in [(0, 0), (1, 1), (3, 4), (5, 8), (9, 16), (257, 272), (511, 512), (512, 512)] {
            assert_eq!(t.pad(n), Some(want), "pad({n})");
        }
        assert_eq!(t.pad(513), None);
        assert_eq!(t.max(), 512);
    }

    #[test]
    fn no_sizes_pads_only_zero() {
        let t = PaddingTable::new(&CaptureSizes::empty());
        assert_eq!(t.pad(0), Some(0));
        assert_eq!(t.pad(1), None);
        assert_eq!(t.max(), 0);
    }

    proptest! {
        #[test]
        fn table_is_the_smallest_captured_size_at_least_n(
            sizes in proptest::collection::vec(1u32..2000, 1..40),
        ) {
            let t = table(&sizes);
            let max = sizes.iter().copied().max().unwrap_or(0);
            prop_assert_eq!(t.max(), max);
            for n in 0..=max + 1 {
                let want = if n == 0 { Some(0) } else { sizes.iter().copied().filter(|&s| s >= n).min() };
                prop_assert_eq!(t.pad(n), want, "n = {}", n);
            }
        }
    }
}
