//! The HAL's one error type.
//!
//! It covers what a caller cannot foresee (out of memory, a lost device, a driver failure, a
//! compile error, a missing backend library) and the misuse that users reach from configuration
//! files and that must not panic: capture-rule violations, kernel signature mismatches, views out
//! of range, and the sanitizer's findings.

use std::fmt;

/// Result alias used throughout the HAL.
pub type Result<T, E = HalError> = std::result::Result<T, E>;

/// An operation that is illegal while a stream of the device is capturing (DESIGN.md 3.1).
///
/// Each of these would either synchronise with the host, change the memory map, or run work that a
/// replay would not repeat, so a graph captured around it could not be replayed faithfully.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureOp {
    /// Device memory allocation (device or pinned host memory).
    Allocate,
    /// An explicit free of device memory.
    Free,
    /// Stream, event or device synchronisation.
    Synchronize,
    /// A device-to-host read.
    DeviceToHost,
    /// A copy from pageable (not pinned) host memory.
    PageableCopy,
    /// Compiling or loading a module.
    Compile,
    /// Recording or waiting on an event (streams join a capture through `Stream::fork_capture` and
    /// `Stream::join_capture` instead).
    Event,
    /// Replaying a graph into a capturing stream.
    Replay,
}

impl fmt::Display for CaptureOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CaptureOp::Allocate => "allocation",
            CaptureOp::Free => "free",
            CaptureOp::Synchronize => "synchronize",
            CaptureOp::DeviceToHost => "device-to-host read",
            CaptureOp::PageableCopy => "pageable host-to-device copy",
            CaptureOp::Compile => "module compilation",
            CaptureOp::Event => "event record/wait",
            CaptureOp::Replay => "graph replay",
        })
    }
}

/// Everything that can go wrong in the HAL.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HalError {
    /// The backend was compiled in, but its driver library or device is not usable here.
    #[error("backend {backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// `cuda` or `rocm`.
        backend: &'static str,
        /// What was searched or what failed.
        reason: String,
    },
    /// The backend was not compiled into this build.
    #[error("backend {backend} is not compiled in: rebuild with `--features {feature}`")]
    BackendNotCompiled {
        /// `cuda` or `rocm`.
        backend: &'static str,
        /// The cargo feature that enables it.
        feature: &'static str,
    },
    /// A device name that does not parse or names no device.
    #[error("unknown device `{name}`: {reason}")]
    UnknownDevice {
        /// The name as given.
        name: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The device has no room for an allocation.
    #[error("out of device memory allocating {bytes} bytes for `{label}`")]
    OutOfMemory {
        /// Requested size in bytes.
        bytes: usize,
        /// Label of the buffer being allocated.
        label: String,
    },
    /// An allocation's byte size (`len` elements of `elem_bytes` each) overflows the address space.
    #[error("allocating `{label}`: {len} elements of {elem_bytes} bytes overflow the address space")]
    SizeOverflow {
        /// Label of the buffer being allocated.
        label: String,
        /// Requested elements.
        len: usize,
        /// Bytes per element.
        elem_bytes: usize,
    },
    /// The device stopped answering (reset, Xid, removed).
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// A driver call failed.
    #[error("driver call {call} failed with code {code}: {message}")]
    Driver {
        /// The driver entry point, e.g. `cuGraphInstantiateWithFlags`.
        call: &'static str,
        /// The driver's numeric error code.
        code: i64,
        /// The driver's description.
        message: String,
    },
    /// Kernel compilation failed; `log` is the compiler's full log.
    #[error("compiling `{source_name}` for {arch} failed:\n{log}")]
    Compile {
        /// The kernel source's name.
        source_name: String,
        /// The target architecture, e.g. `sm_90`.
        arch: String,
        /// The full compiler log.
        log: String,
    },
    /// An operation that capture forbids was attempted while a stream was capturing.
    #[error("{op} is illegal while stream capture is active{}", detail_suffix(detail))]
    IllegalDuringCapture {
        /// The forbidden operation.
        op: CaptureOp,
        /// Where it came from (buffer label, call site).
        detail: String,
    },
    /// A capture state transition that is not allowed from the current state; nothing changed.
    #[error("cannot {attempted} a stream whose capture state is {state}")]
    CaptureTransition {
        /// What was attempted (`begin capture`, `end capture`, ...).
        attempted: &'static str,
        /// The state the stream was in (and still is).
        state: &'static str,
    },
    /// A captured operation was handed a buffer that is not graph-stable (not persistent).
    #[error(
        "kernel `{kernel}` argument `{arg}` uses buffer `{buffer}`, which is not persistent: a graph \
         bakes in its address, so step-varying data must live in a persistent (arena) buffer"
    )]
    NotGraphStable {
        /// The kernel (or copy) that received the buffer.
        kernel: String,
        /// The parameter name.
        arg: String,
        /// The buffer's label.
        buffer: String,
    },
    /// A graph read a host-refreshed buffer that the host did not rewrite since the last replay.
    #[error(
        "graph `{graph}` reads host-refreshed buffer `{buffer}`, which was not rewritten since the \
         graph last ran: the replay would consume the previous step's data"
    )]
    StaleHostInput {
        /// The graph's label.
        graph: String,
        /// The buffer's label.
        buffer: String,
    },
    /// The views handed to a replay differ from those recorded at capture.
    #[error("graph `{graph}` input `{input}`: captured with {recorded}, replayed with {given}")]
    InputViewMismatch {
        /// The graph's label.
        graph: String,
        /// The input's name.
        input: String,
        /// The view recorded at capture.
        recorded: String,
        /// The view the caller passed.
        given: String,
    },
    /// The arguments of a launch do not match the kernel's declared signature.
    #[error("kernel `{kernel}`: {detail}")]
    KernelArgs {
        /// The kernel's entry point.
        kernel: String,
        /// What does not match.
        detail: String,
    },
    /// A module has no entry point of that name.
    #[error("module `{module}` has no kernel `{name}` (it has: {available})")]
    UnknownKernel {
        /// The module's source name.
        module: String,
        /// The requested entry point.
        name: String,
        /// The entry points it does have, comma separated.
        available: String,
    },
    /// The launch configuration is impossible (zero dimension, too many threads, ...).
    #[error("invalid launch of `{kernel}`: {detail}")]
    InvalidLaunch {
        /// The kernel's entry point.
        kernel: String,
        /// What is wrong.
        detail: String,
    },
    /// A kernel accessed an element outside the view it was handed.
    #[error(
        "kernel `{kernel}` argument `{arg}`: index {index} is out of bounds for a view of {len} \
         elements of buffer `{buffer}`"
    )]
    OutOfBounds {
        /// The kernel's entry point.
        kernel: String,
        /// The parameter name.
        arg: String,
        /// The offending element index (relative to the view; negative for a signed index
        /// before its start).
        index: i64,
        /// The view's length in elements.
        len: usize,
        /// The buffer's label.
        buffer: String,
    },
    /// An address that resolves to no live allocation, or a range that runs past its allocation.
    #[error("kernel `{kernel}` argument `{arg}`: address {addr:#x} (+{bytes} bytes) is {why}")]
    BadAddress {
        /// The kernel (or copy) that received the address.
        kernel: String,
        /// The parameter name.
        arg: String,
        /// The device address.
        addr: u64,
        /// The length of the access in bytes.
        bytes: usize,
        /// Why it does not resolve.
        why: String,
    },
    /// A kernel wrote to an argument declared read-only.
    #[error("kernel `{kernel}` wrote to argument `{arg}`, which its signature declares read-only")]
    ReadOnlyArgument {
        /// The kernel's entry point.
        kernel: String,
        /// The parameter name.
        arg: String,
    },
    /// A kernel's reference implementation found its inputs invalid.
    #[error("kernel `{kernel}` failed: {message}")]
    KernelFailed {
        /// The kernel's entry point.
        kernel: String,
        /// What it found.
        message: String,
    },
    /// A sub-view that runs past the view it is cut from (offsets in elements of the buffer).
    #[error("view [{offset}, {offset}+{len}) runs past the view [{view_offset}, {view_offset}+{view_len}) of buffer `{buffer}` it is cut from")]
    InvalidSubView {
        /// The buffer's label.
        buffer: String,
        /// Requested offset in the buffer, in elements.
        offset: usize,
        /// Requested length, in elements.
        len: usize,
        /// The parent view's offset in the buffer, in elements.
        view_offset: usize,
        /// The parent view's length, in elements.
        view_len: usize,
    },
    /// A view (offset, length) that does not fit in its buffer.
    #[error("view [{offset}, {offset}+{len}) is out of range for buffer `{buffer}` of {capacity} elements")]
    InvalidView {
        /// The buffer's label.
        buffer: String,
        /// Requested offset, in elements.
        offset: usize,
        /// Requested length, in elements.
        len: usize,
        /// The buffer's length, in elements.
        capacity: usize,
    },
    /// Source and destination of a copy have different lengths.
    #[error("{op}: source has {src} elements, destination has {dst}")]
    LengthMismatch {
        /// The operation.
        op: &'static str,
        /// Source length in elements.
        src: usize,
        /// Destination length in elements.
        dst: usize,
    },
    /// Objects of different devices were mixed in one operation.
    #[error("device mismatch: {0}")]
    DeviceMismatch(String),
    /// An event was queried before it was recorded.
    #[error("event was never recorded")]
    EventNotRecorded,
    /// The backend does not support this operation.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A communicator group cannot be formed from the devices given (none, mixed backends, a
    /// device listed twice where the backend forbids it, a malformed timeout setting).
    #[error("cannot form a communicator group: {0}")]
    InvalidGroup(String),
    /// A collective's arguments are wrong on the calling rank (lengths, element type, aliasing,
    /// device); found before anything is enqueued.
    #[error("{op} on rank {rank} of {size}: {detail}")]
    InvalidCollective {
        /// The collective: `all_reduce`, `all_gather` or `reduce_scatter`.
        op: &'static str,
        /// The calling rank.
        rank: usize,
        /// The group's size.
        size: usize,
        /// What is wrong.
        detail: String,
    },
    /// The ranks of a group called different collectives (kind, element type, count or
    /// reduction) at the same position of their sequences; every participant gets this error
    /// and no receive buffer is written.
    #[error("{op} (collective #{seq}) on rank {rank}: the ranks disagree: {detail}")]
    CollectiveMismatch {
        /// The collective the reporting rank called.
        op: &'static str,
        /// The reporting rank.
        rank: usize,
        /// Position of the call in the rank's sequence of collectives (0-based).
        seq: u64,
        /// Which rank called what.
        detail: String,
    },
    /// A rank waited longer than its timeout for the others to reach a collective.
    #[error(
        "{op} (collective #{seq}) on rank {rank} timed out after {:.3} s: rank(s) {missing:?} did not arrive",
        waited.as_secs_f64()
    )]
    CollectiveTimeout {
        /// The collective the reporting rank called.
        op: &'static str,
        /// The reporting rank.
        rank: usize,
        /// Position of the call in the rank's sequence of collectives (0-based).
        seq: u64,
        /// How long it waited.
        waited: std::time::Duration,
        /// The ranks that had not called it.
        missing: Vec<usize>,
    },
    /// A collective could not complete for a reason outside the calling rank: another rank gave
    /// up on it (timeout), or the group's shared state was poisoned by a panic on another thread.
    #[error("{op} (collective #{seq}) on rank {rank} was abandoned: {detail}")]
    CollectiveAborted {
        /// The collective the reporting rank called.
        op: &'static str,
        /// The reporting rank.
        rank: usize,
        /// Position of the call in the rank's sequence of collectives (0-based).
        seq: u64,
        /// Why.
        detail: String,
    },
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(" ({detail})")
    }
}
