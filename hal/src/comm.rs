//! Collective communication between the ranks of a group: the building block of tensor
//! parallelism.
//!
//! A [`Communicator`] is one rank of a group formed by [`Communicator::group`] over a list of
//! devices (rank `i` is `devices[i]`). Its collectives are stream operations like copies: they are
//! enqueued on a [`Stream`] of the rank's device, read a `send` view and write a `recv` view of
//! that device, and follow the same front-end rules as every other operation: views are checked
//! before anything is enqueued, they are legal inside stream capture (the graph re-runs the
//! collective at every replay), a graph retains the buffers a collective touches (and the
//! communicator itself), a collective that reads a host-refreshed buffer counts as a read for the
//! sanitizer, and writing `recv` counts as a write.
//!
//! Every rank of a group must call the same collectives, with the same element type, counts and
//! reduction, in the same order; typically each rank is driven by its own host thread with its own
//! streams. Shapes, per rank, in elements of `T` (`n = size()`):
//!
//! | collective | `send` | `recv` | result on every rank |
//! |---|---|---|---|
//! | [`Communicator::all_reduce`] | `[len]` | `[len]` | `recv[i] = Σ_r send_r[i]` |
//! | [`Communicator::all_gather`] | `[len]` | `[n · len]` | `recv[r · len + i] = send_r[i]` |
//! | [`Communicator::reduce_scatter`] | `[n · len]` | `[len]` | on rank `q`: `recv[i] = Σ_r send_r[q · len + i]` |
//!
//! In place is allowed in the forms NCCL allows: `all_reduce` with `send` and `recv` the same view,
//! `all_gather` with `send` the slice of `recv` at `rank · len`, `reduce_scatter` with `recv` the
//! slice of `send` at `rank · len`. Any other overlap of `send` and `recv` is an error.
//! Element types: `f32`, `bf16` and `f16`.
//!
//! ## Backends
//! - **cpu**: an in-process emulation of `n` ranks. The ranks of a group share a rendezvous (a
//!   mutex, a condition variable and a per-rank sequence number of collectives): each rank
//!   deposits its `send` bytes under its call's sequence number, the last to arrive checks that
//!   every rank called the same collective and computes every rank's output, and each rank copies
//!   its own output into `recv`. The CPU backend executes at enqueue, so a collective blocks the
//!   calling thread until every rank has arrived (or until its timeout, see
//!   [`Communicator::with_timeout`]: the default is [`DEFAULT_COMM_TIMEOUT`], overridden by the
//!   environment variable [`COMM_TIMEOUT_ENV`] read when the group is formed). Ranks that
//!   disagree all get [`HalError::CollectiveMismatch`]; a rank that waits too long gets
//!   [`HalError::CollectiveTimeout`] naming the ranks that did not arrive. The ranks of a group
//!   may be distinct CPU devices (one [`Device::open`] per rank) or the same device.
//! - **cuda**: NCCL (`libnccl.so.2`, 2.10 or newer, loaded at run time; searched in
//!   `$HOLDFAST_NCCL_PATH`, the system loader path, CUDA's library folders and the folders pip
//!   installs `nvidia-nccl-*` wheels into), one communicator per device from `ncclCommInitAll`,
//!   each collective issued on the HAL stream, so it is captured like a kernel. A missing library
//!   is [`HalError::BackendUnavailable`]. The devices must be distinct. No timeout applies: NCCL
//!   waits on the GPU.
//! - **rocm**: not supported yet ([`HalError::Unsupported`]).
//!
//! ## Determinism
//! The CPU emulation reduces in `f32`, in rank order: `((x_0 + x_1) + x_2) + … + x_{n-1}`, each
//! `x_r` converted exactly from `T`, and rounds the sum to `T` once (round to nearest even). Every
//! rank therefore receives bit-identical results, and the same inputs give the same bits at every
//! run, eagerly or replayed from a graph. With one rank every collective is a copy (bits
//! preserved, NaN payloads included). NCCL reduces in its own ring or tree order, with its own
//! intermediate precision for 16-bit types: for a fixed rank count, algorithm and protocol its
//! results are deterministic, but they are not bitwise equal to the CPU emulation's (compare them
//! with a tolerance, as kernels are compared with their CPU references).

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{CommImpl, CommOps};
use crate::device::{BackendKind, Device};
use crate::dtype::{DType, Element};
use crate::error::{HalError, Result};
use crate::memory::{RawView, View};
use crate::stream::Stream;

/// How a reducing collective combines the ranks' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
        })
    }
}

/// How long a rank of a CPU group waits for the others at a collective before it gives up with
/// [`HalError::CollectiveTimeout`]: 60 s.
pub const DEFAULT_COMM_TIMEOUT: Duration = Duration::from_secs(60);

/// Environment variable read by [`Communicator::group`]: the default timeout of the group's ranks,
/// in seconds (a positive decimal number, e.g. `0.5`).
pub const COMM_TIMEOUT_ENV: &str = "HOLDFAST_COMM_TIMEOUT_S";

/// Which collective a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CollectiveKind {
    AllReduce,
    AllGather,
    ReduceScatter,
}

impl CollectiveKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
        }
    }
}

/// A collective reduced to what a backend needs: device addresses and element counts, checked by
/// the front end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CollectiveCall {
    pub(crate) kind: CollectiveKind,
    /// Ignored by `AllGather`.
    pub(crate) op: ReduceOp,
    pub(crate) dtype: DType,
    pub(crate) send: u64,
    pub(crate) recv: u64,
    /// Elements of `send` on this rank.
    pub(crate) send_count: usize,
    /// Elements of `recv` on this rank.
    pub(crate) recv_count: usize,
}

/// What a communicator handle shares with the graphs that captured its collectives.
pub(crate) struct CommShared {
    device: Device,
    rank: usize,
    size: usize,
    inner: CommImpl,
}

/// One rank of a group of devices that run collectives together.
///
/// Cheap to clone (clones are the same rank). `Send` and `Sync`, so each rank can move to the
/// thread that drives it. See the [module documentation](crate::comm) for shapes, semantics
/// and determinism.
#[derive(Clone)]
pub struct Communicator {
    shared: Arc<CommShared>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator(rank {} of {}, {:?})", self.shared.rank, self.shared.size, self.shared.device)
    }
}

impl Communicator {
    /// Forms a group over `devices`: one communicator per device, rank `i` on `devices[i]`,
    /// returned in rank order.
    ///
    /// Errors: [`HalError::InvalidGroup`] for an empty list, devices of different backends, a
    /// CUDA device listed twice, or a malformed [`COMM_TIMEOUT_ENV`];
    /// [`HalError::BackendUnavailable`] when the backend's collective library (NCCL) cannot be
    /// loaded; [`HalError::Unsupported`] on ROCm.
    pub fn group(devices: &[Device]) -> Result<Vec<Communicator>> {
        let Some(first) = devices.first() else {
            return Err(HalError::InvalidGroup("no devices given: a group needs at least one".into()));
        };
        let backend = first.backend();
        if let Some((i, d)) = devices.iter().enumerate().find(|(_, d)| d.backend() != backend) {
            return Err(HalError::InvalidGroup(format!(
                "device 0 is on the {backend} backend but device {i} is on the {}: every rank of a group must be \
                 on one backend",
                d.backend()
            )));
        }
        let impls = match backend {
            BackendKind::Cpu => crate::cpu::comm::group(devices.len(), timeout_from_env()?),
            BackendKind::Cuda => cuda_group(devices)?,
            BackendKind::Rocm => {
                return Err(HalError::Unsupported(
                    "collectives on the rocm backend are not supported yet (no RCCL binding)".into(),
                ))
            }
        };
        let size = devices.len();
        Ok(devices
            .iter()
            .zip(impls)
            .enumerate()
            .map(|(rank, (device, inner))| Communicator {
                shared: Arc::new(CommShared { device: device.clone(), rank, size, inner }),
            })
            .collect())
    }

    /// This rank's index in the group, `0..size()`.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.shared.size
    }

    /// The device this rank runs on: its collectives take streams and views of this device.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// How long this rank waits for the others at each collective, or `None` where the backend
    /// enforces no timeout (CUDA: NCCL waits on the GPU).
    pub fn timeout(&self) -> Option<Duration> {
        self.shared.inner.timeout()
    }

    /// Sets how long this rank waits for the others at each collective (CPU backend; no effect on
    /// CUDA). Applies to every later execution, replays of graphs captured earlier included.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        self.shared.inner.set_timeout(timeout);
        self
    }

    /// Element-wise reduction of every rank's `send` into every rank's `recv`.
    ///
    /// `send` and `recv`: `[len]` elements each, views of this rank's device; they may be the same
    /// view (in place). Legal during capture.
    pub fn all_reduce<T: Element>(&self, stream: &Stream, send: &View<T>, recv: &View<T>, op: ReduceOp) -> Result<()> {
        let kind = CollectiveKind::AllReduce;
        if send.len() != recv.len() {
            return Err(self.invalid(
                kind,
                format!("send has {} elements and recv has {}; they must be equal", send.len(), recv.len()),
            ));
        }
        self.enqueue::<T>(stream, kind, op, send.raw(), recv.raw())
    }

    /// Concatenation of every rank's `send`, in rank order, into every rank's `recv`.
    ///
    /// `send`: `[len]`, `recv`: `[size() · len]` (rank `r`'s data at element `r · len`). In place
    /// when `send` is the slice of `recv` at `rank() · len`. Legal during capture.
    pub fn all_gather<T: Element>(&self, stream: &Stream, send: &View<T>, recv: &View<T>) -> Result<()> {
        let kind = CollectiveKind::AllGather;
        if send.len().checked_mul(self.size()) != Some(recv.len()) {
            return Err(self.invalid(
                kind,
                format!(
                    "send has {} elements, so recv must have {} × {} = {}, but it has {}",
                    send.len(),
                    self.size(),
                    send.len(),
                    send.len().saturating_mul(self.size()),
                    recv.len()
                ),
            ));
        }
        self.enqueue::<T>(stream, kind, ReduceOp::Sum, send.raw(), recv.raw())
    }

    /// Element-wise reduction of every rank's `send`, of which rank `q` receives block `q`.
    ///
    /// `send`: `[size() · len]`, `recv`: `[len]`; rank `q`'s `recv` is the reduction of elements
    /// `[q · len, (q + 1) · len)` of every rank's `send`. In place when `recv` is the slice of
    /// `send` at `rank() · len`. Legal during capture.
    pub fn reduce_scatter<T: Element>(
        &self,
        stream: &Stream,
        send: &View<T>,
        recv: &View<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let kind = CollectiveKind::ReduceScatter;
        if recv.len().checked_mul(self.size()) != Some(send.len()) {
            return Err(self.invalid(
                kind,
                format!(
                    "recv has {} elements, so send must have {} × {} = {}, but it has {}",
                    recv.len(),
                    self.size(),
                    recv.len(),
                    recv.len().saturating_mul(self.size()),
                    send.len()
                ),
            ));
        }
        self.enqueue::<T>(stream, kind, op, send.raw(), recv.raw())
    }

    fn invalid(&self, kind: CollectiveKind, detail: String) -> HalError {
        HalError::InvalidCollective { op: kind.name(), rank: self.rank(), size: self.size(), detail }
    }

    /// The checks every collective shares, then the enqueue through the stream's capture-aware
    /// path (retention, sanitizer reads, op count).
    fn enqueue<T: Element>(
        &self,
        stream: &Stream,
        kind: CollectiveKind,
        op: ReduceOp,
        s: RawView,
        r: RawView,
    ) -> Result<()> {
        let name = kind.name();
        if !matches!(T::DTYPE, DType::F32 | DType::BF16 | DType::F16) {
            return Err(self.invalid(
                kind,
                format!("element type {} is not supported by collectives (f32, bf16 and f16 are)", T::DTYPE),
            ));
        }
        let own = self.shared.device.id();
        if stream.device_id() != own {
            return Err(self.invalid(kind, "the stream belongs to another device than this rank's".into()));
        }
        for (arg, v) in [("send", &s), ("recv", &r)] {
            if v.alloc.device.id != own {
                return Err(self.invalid(
                    kind,
                    format!("{arg} (buffer `{}`) belongs to another device than this rank's", v.label()),
                ));
            }
        }
        self.check_overlap(kind, &s, &r)?;
        let call = CollectiveCall {
            kind,
            op,
            dtype: T::DTYPE,
            send: s.addr(),
            recv: r.addr(),
            send_count: s.len(),
            recv_count: r.len(),
        };
        let shared = self.shared.clone();
        stream.enqueue(
            name,
            || [("send", &s, true), ("recv", &r, false)].into_iter(),
            |log| log.keep_comm(shared),
            || self.shared.inner.collective(&stream.inner, &call),
        )
    }

    /// Overlapping `send` and `recv` are allowed only in the in-place forms NCCL defines.
    fn check_overlap(&self, kind: CollectiveKind, s: &RawView, r: &RawView) -> Result<()> {
        let (s0, s1) = (s.addr(), s.addr() + s.bytes() as u64);
        let (r0, r1) = (r.addr(), r.addr() + r.bytes() as u64);
        if s.alloc.id != r.alloc.id || s0 >= r1 || r0 >= s1 || s.is_empty() || r.is_empty() {
            return Ok(());
        }
        let esize = s.dtype().size() as u64;
        let rank = self.rank() as u64;
        let (ok, rule) = match kind {
            CollectiveKind::AllReduce => (s0 == r0, "in place, send and recv must be the same view"),
            CollectiveKind::AllGather => (
                s0 == r0 + rank * s.len() as u64 * esize,
                "in place, send must be the slice of recv at element rank × send.len()",
            ),
            CollectiveKind::ReduceScatter => (
                r0 == s0 + rank * r.len() as u64 * esize,
                "in place, recv must be the slice of send at element rank × recv.len()",
            ),
        };
        if ok {
            return Ok(());
        }
        let elems = |v: &RawView| (v.offset, v.offset + v.len);
        Err(self.invalid(
            kind,
            format!(
                "send (elements {:?} of `{}`) and recv (elements {:?}) overlap; {rule}",
                elems(s),
                s.label(),
                elems(r)
            ),
        ))
    }
}

/// The default timeout of a CPU group's ranks: [`COMM_TIMEOUT_ENV`] if set, else
/// [`DEFAULT_COMM_TIMEOUT`].
fn timeout_from_env() -> Result<Duration> {
    parse_timeout(std::env::var_os(COMM_TIMEOUT_ENV).as_deref())
}

fn parse_timeout(value: Option<&std::ffi::OsStr>) -> Result<Duration> {
    let Some(v) = value else {
        return Ok(DEFAULT_COMM_TIMEOUT);
    };
    let text = v.to_string_lossy();
    match text.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(HalError::InvalidGroup(format!("{COMM_TIMEOUT_ENV}=`{text}` is not a positive number of seconds"))),
    }
}

#[cfg(feature = "cuda")]
fn cuda_group(devices: &[Device]) -> Result<Vec<CommImpl>> {
    crate::cuda::comm::group(devices)
}
#[cfg(not(feature = "cuda"))]
fn cuda_group(_devices: &[Device]) -> Result<Vec<CommImpl>> {
    Err(HalError::BackendNotCompiled { backend: "cuda", feature: "cuda" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeout_setting_is_seconds_and_a_bad_one_is_an_error_naming_it() {
        use std::ffi::OsStr;
        assert_eq!(parse_timeout(None).expect("unset"), DEFAULT_COMM_TIMEOUT);
        assert_eq!(parse_timeout(Some(OsStr::new(" 0.25 "))).expect("0.25"), Duration::from_millis(250));
        assert_eq!(parse_timeout(Some(OsStr::new("120"))).expect("120"), Duration::from_secs(120));
        for bad in ["", "abc", "0", "-1", "inf", "NaN"] {
            let e = parse_timeout(Some(OsStr::new(bad))).expect_err(bad);
            assert!(e.to_string().contains(COMM_TIMEOUT_ENV), "{e}");
        }
    }
}
