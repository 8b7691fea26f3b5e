//! What every section gets: the device, one stream, the clock, the ceilings so far.

use holdfast_hal::{BackendKind, Device, Element, Stream};

use crate::error::Result;
use crate::report::{Ceilings, Row};
use crate::timing::Clock;

/// Shapes a run uses: the model's real shapes, or small ones for `--quick`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// DeepSeek-V4-Flash shapes (the GPU report).
    Full,
    /// Small shapes and few iterations (the CPU backend, tests).
    Quick,
}

/// The state shared by the sections of one run.
pub struct Ctx {
    /// The device.
    pub dev: Device,
    /// The stream everything is enqueued on.
    pub s: Stream,
    /// The clock.
    pub clock: Clock,
    /// Which shapes to run.
    pub scale: Scale,
    /// The ceilings measured so far.
    pub ceilings: Ceilings,
    /// Lines about skipped parts.
    pub notes: Vec<String>,
    /// `--cases`: the rows to run, by a piece of their case name (all when empty).
    pub cases: Vec<String>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx").field("device", &self.dev.info().name).field("scale", &self.scale).finish()
    }
}

impl Ctx {
    /// Whether the device is a GPU (timings from events; targets apply).
    pub fn gpu(&self) -> bool {
        self.dev.backend() != BackendKind::Cpu
    }

    /// Whether the row of case `case` is to run: no `--cases` given, or `case` contains one of
    /// them. Sections test it before setting a case up, so that a filtered run skips the work.
    pub fn wants(&self, case: &str) -> bool {
        self.cases.is_empty() || self.cases.iter().any(|c| case.contains(c.as_str()))
    }

    /// Whether `--quick` shapes are in use.
    pub fn quick(&self) -> bool {
        self.scale == Scale::Quick
    }

    /// Records a skipped part: printed at once on stderr and kept in the report.
    pub fn note(&mut self, line: impl Into<String>) {
        let line = line.into();
        eprintln!("note: {line}");
        self.notes.push(line);
    }

    /// A persistent buffer of `len` elements with every byte set to `byte`.
    pub fn filled<T: Element>(&self, label: &str, len: usize, byte: u8) -> Result<holdfast_hal::Buffer<T>> {
        let b = self.dev.alloc_persistent::<T>(label, len.max(1))?;
        self.s.memset(&b.view(), byte)?;
        Ok(b)
    }

    /// Starts a hand-timed device window on the stream.
    pub fn clock_start(&self) -> Result<()> {
        self.clock.start(&self.s)
    }

    /// Ends the window started by [`Ctx::clock_start`]: device µs.
    pub fn clock_stop(&self) -> Result<f64> {
        self.clock.stop_us(&self.s)
    }

    /// A kernel row: `op` timed eagerly and from a graph (the graph time is the row's time).
    pub fn kernel_row(&self, section: &str, case: String, op: &mut dyn FnMut() -> Result<()>) -> Result<Row> {
        let eager = self.clock.eager(&self.s, op)?;
        let graph = self.clock.graph(&self.s, op)?;
        Ok(Row::timed(section, case, graph.median_us, graph.samples).with_eager(eager.median_us))
    }
}
