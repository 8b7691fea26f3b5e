//! Medians of many timed samples after warm-up: device time between two HAL events on GPUs,
//! host wall time on the CPU backend (whose streams run their work inline).
//!
//! A sample is `reps` calls between two event records, divided by `reps`; `reps` is picked from a
//! first untimed call so that a sample lasts about [`Effort::sample_us`]. Two ways to enqueue the
//! calls:
//! - [`Clock::eager`]: `reps` calls enqueued back to back. For small kernels this measures the
//!   host's launch rate, not the kernel, because the device waits for each launch.
//! - [`Clock::graph`]: `reps` calls captured once into a graph, the graph replayed per sample. The
//!   device runs the launches back to back, so this is the kernel's device time (plus the graph's
//!   per-node gap, about 1 µs on an H200). This is the number rows report as `time_us`.

use std::time::Instant;

use holdfast_hal::{BackendKind, Device, Event, Stream};

use crate::error::Result;

/// How hard to measure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Effort {
    /// Untimed calls before the first sample.
    pub warmup: usize,
    /// Fewest samples per median.
    pub min_samples: usize,
    /// Most samples per median.
    pub max_samples: usize,
    /// Wanted length of one sample, µs (sets `reps`).
    pub sample_us: f64,
    /// Most calls per sample.
    pub max_reps: usize,
    /// Wanted time for all samples of one case, µs (sets the sample count within the bounds).
    pub case_us: f64,
}

impl Effort {
    /// GPU defaults: 30–200 samples of about 200 µs, about 0.25 s per case.
    pub const GPU: Effort =
        Effort { warmup: 3, min_samples: 15, max_samples: 200, sample_us: 200.0, max_reps: 64, case_us: 250_000.0 };
    /// `--quick`: few samples, few calls.
    pub const QUICK: Effort =
        Effort { warmup: 1, min_samples: 3, max_samples: 7, sample_us: 500.0, max_reps: 4, case_us: 20_000.0 };
    /// The CPU backend without `--quick`.
    pub const CPU: Effort =
        Effort { warmup: 1, min_samples: 5, max_samples: 31, sample_us: 2_000.0, max_reps: 16, case_us: 200_000.0 };
}

/// A median and how many samples it came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    /// Median per call, µs.
    pub median_us: f64,
    /// Samples.
    pub samples: usize,
}

/// The median of `v` (NaN when empty).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Times work on one stream of one device.
pub struct Clock {
    gpu: bool,
    start: Event,
    end: Event,
    /// How hard to measure.
    pub effort: Effort,
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clock").field("gpu", &self.gpu).field("effort", &self.effort).finish()
    }
}

impl Clock {
    /// A clock for `dev`.
    pub fn new(dev: &Device, effort: Effort) -> Result<Clock> {
        Ok(Clock {
            gpu: dev.backend() != BackendKind::Cpu,
            start: dev.create_event()?,
            end: dev.create_event()?,
            effort,
        })
    }

    /// Whether samples are timed with device events.
    pub fn is_gpu(&self) -> bool {
        self.gpu
    }

    /// µs of one sample of `f` (which enqueues `reps` calls), per call.
    fn sample(&self, s: &Stream, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        if self.gpu {
            self.start.record(s)?;
            f()?;
            self.end.record(s)?;
            Ok(f64::from(self.start.elapsed_ms(&self.end)?) * 1e3 / reps as f64)
        } else {
            s.synchronize()?;
            let t = Instant::now();
            f()?;
            s.synchronize()?;
            Ok(t.elapsed().as_secs_f64() * 1e6 / reps as f64)
        }
    }

    /// Picks `reps` and the sample count from one untimed-for-the-median sample of one call.
    fn plan(&self, s: &Stream, one: &mut dyn FnMut() -> Result<()>) -> Result<(usize, usize)> {
        let e = self.effort;
        for _ in 0..e.warmup {
            one()?;
        }
        let t = self.sample(s, 1, one)?.max(0.05);
        let reps = ((e.sample_us / t).ceil() as usize).clamp(1, e.max_reps);
        let samples = ((e.case_us / (t * reps as f64)) as usize).clamp(e.min_samples, e.max_samples);
        Ok((reps, samples))
    }

    /// Median µs per call of `op`, enqueued eagerly `reps` times per sample.
    pub fn eager(&self, s: &Stream, op: &mut dyn FnMut() -> Result<()>) -> Result<Stat> {
        let (reps, samples) = self.plan(s, op)?;
        let mut v = Vec::with_capacity(samples);
        for _ in 0..samples {
            v.push(self.sample(s, reps, &mut || {
                for _ in 0..reps {
                    op()?;
                }
                Ok(())
            })?);
        }
        Ok(Stat { median_us: median(&mut v), samples })
    }

    /// Median µs per call of `op` replayed from one graph of `reps` back-to-back calls. `op` must
    /// be capturable: persistent buffers only, no allocation or synchronisation.
    pub fn graph(&self, s: &Stream, op: &mut dyn FnMut() -> Result<()>) -> Result<Stat> {
        let (reps, samples) = self.plan(s, op)?;
        s.begin_capture("gpu-report")?;
        let mut captured = Ok(());
        for _ in 0..reps {
            captured = op();
            if captured.is_err() {
                break;
            }
        }
        if let Err(e) = captured {
            s.abort_capture()?;
            return Err(e);
        }
        let graph = s.end_capture()?;
        for _ in 0..self.effort.warmup.max(1) {
            graph.replay(s)?;
        }
        let mut v = Vec::with_capacity(samples);
        for _ in 0..samples {
            v.push(self.sample(s, reps, &mut || Ok(graph.replay(s)?))?);
        }
        Ok(Stat { median_us: median(&mut v), samples })
    }

    /// Records the start event of a hand-timed window on `s` (GPU only).
    pub fn start(&self, s: &Stream) -> Result<()> {
        Ok(self.start.record(s)?)
    }

    /// Records the end event on `s` and returns the µs since [`Clock::start`] (waits for it).
    pub fn stop_us(&self, s: &Stream) -> Result<f64> {
        self.end.record(s)?;
        Ok(f64::from(self.start.elapsed_ms(&self.end)?) * 1e3)
    }

    /// Median host wall time of `op` (µs), the stream synchronised outside the timed region after
    /// each sample.
    pub fn host(&self, s: &Stream, samples: usize, op: &mut dyn FnMut() -> Result<()>) -> Result<Stat> {
        for _ in 0..self.effort.warmup {
            op()?;
            s.synchronize()?;
        }
        let mut v = Vec::with_capacity(samples);
        for _ in 0..samples {
            let t = Instant::now();
            op()?;
            v.push(t.elapsed().as_secs_f64() * 1e6);
            s.synchronize()?;
        }
        Ok(Stat { median_us: median(&mut v), samples })
    }
}
