//! The seeded request stream: prompt and output lengths, prompt tokens, and arrival steps.
//!
//! Everything depends on the seed alone (SplitMix64), and arrivals are counted in scheduler
//! steps, not seconds, so every graph mode sees exactly the same stream and the same batches.

use holdfast_model::scheduler::Request;

use crate::args::LenRange;

/// A request and the step at which it arrives.
#[derive(Clone, Debug)]
pub struct Arrival {
    /// Scheduler step (0-based) from which the request may be admitted.
    pub step: u64,
    /// The request.
    pub request: Request,
}

/// SplitMix64: small, seedable, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

/// `n` requests with ids `0..n`, lengths uniform in the given ranges, token ids uniform in
/// `[0, vocab)`, arriving as a Poisson process of `rate` requests per step (all at step 0 when
/// `rate` is 0).
pub fn requests(seed: u64, n: usize, prompt: LenRange, output: LenRange, vocab: usize, rate: f64) -> Vec<Arrival> {
    // Separate streams: the requests' contents do not depend on the arrival pattern, so runs with
    // different rates or concurrency serve the same requests.
    let mut rng = Rng(seed ^ 0x686F_6C64_6661_7374);
    let mut gaps = Rng(!seed ^ 0x6172_7269_7661_6C73);
    let mut clock = 0.0f64;
    (0..n as u64)
        .map(|id| {
            if rate > 0.0 && id > 0 {
                clock += -(1.0 - gaps.unit()).ln() / rate;
            }
            let len = rng.range(prompt.min, prompt.max);
            let prompt = (0..len).map(|_| rng.range(0, vocab - 1) as i32).collect();
            let max_new_tokens = rng.range(output.min, output.max);
            Arrival { step: clock as u64, request: Request { id, prompt, max_new_tokens } }
        })
        .collect()
}
