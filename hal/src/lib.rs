//! # holdfast-hal: one device abstraction for CPU, CUDA and ROCm
//!
//! Everything above this crate is written once against [`Device`], [`Stream`], [`Event`],
//! [`Buffer`], [`Module`]/[`Kernel`] and [`Graph`], and runs on whichever backend a device name
//! picks at run time: `cpu` (always compiled), `cuda:N` (feature `cuda`), `rocm:N` (feature
//! `rocm`). GPU backends load their driver libraries at run time, so every feature builds on a
//! machine with no GPU toolkit; a missing library is [`HalError::BackendUnavailable`], never a
//! panic.
//!
//! ## Who validates what
//! The front end (this crate's top-level types) validates; backends only execute. Before any
//! backend call the front end checks kernel arguments against the declared signature, views
//! against their buffers, device ownership, and the capture rules: while any stream of a device
//! is capturing, allocation, free, synchronisation, device→host reads, pageable copies, module
//! compilation and event operations are [`HalError::IllegalDuringCapture`], and a captured
//! operation may only touch persistent buffers ([`Device::alloc_persistent`]). A rejected
//! operation records nothing, so the capture stays usable: the caller may go on and end it, or
//! abort it.
//!
//! ## Branches and dependent launches
//! A capture may span several streams: [`Stream::fork_capture`] makes another stream record into
//! the same graph, after what was recorded so far, so the two branches may run concurrently on
//! replay; [`Stream::join_capture`] orders the capturing stream's next work after the branch's.
//! Only the stream that began a capture ends it, and never while a branch is unjoined (an abort
//! joins and releases them). [`Stream::launch_dependent`] lets a kernel begin before the kernel
//! before it has finished (programmatic dependent launch on sm_90 and newer; it waits inside the kernel with
//! `hf_grid_dependency_wait()`), which hides the launch gap between short back-to-back kernels;
//! elsewhere it is an ordinary launch. Every kernel of the upper crates is launched that way and
//! starts with the wait: the mHC and attention kernels with `hf_dependent_kernel_start()` (let
//! the next launch begin, then wait for the one before), the `kernels` crate's with the wait
//! alone (an early start of the next launch made its small matmuls up to 1.3× slower on an
//! H100). The wait must come before any memory access and before any early return:
//! a block that ends without it could let the kernel after it pass its own wait while the one
//! before still runs. The CUDA backend checks each kernel's PTX for the wait when it loads the
//! module and refuses a dependent launch of one without it; `testing::assert_entries_wait_for_prior`
//! (feature `cuda`) is the same check at compile time, with no GPU. `HOLDFAST_DEPENDENT_LAUNCH=off` makes every
//! such launch ordinary (to rule it out, or to time a step both ways on one binary).
//!
//! ## Why graphs are safe to replay
//! A [`Graph`] holds every allocation and pinned buffer it touched, so no address it baked in can
//! be freed or reused while it lives. What remains is *content*: a graph replays whatever the
//! buffers hold. The sanitizer checks what can be checked: host-refreshed inputs must have been
//! rewritten since the last replay, and views bound by name at capture must be handed back
//! identical at replay. On the CPU backend every element access is also bounds-checked against the
//! view the kernel was given, and every address is resolved through the allocation table at
//! execution time.
//!
//! ## Collectives
//! A [`Communicator`] is one rank of a group of devices ([`Communicator::group`]); its
//! all-reduce, all-gather and reduce-scatter are stream operations under the same rules as copies
//! (checked views, legal and retained in captures, sanitizer reads). The CPU backend emulates the
//! ranks in process with a deterministic `f32` rank-order reduction; CUDA uses NCCL. The [`comm`]
//! module's documentation gives the shapes, the semantics and what is deterministic where.
//!
//! ## Kernels
//! A [`KernelSource`] is CUDA C that is also valid HIP (see [`PORTABILITY_HEADER`]), with, per
//! entry point, its [`Param`] list and a CPU reference function. The reference is the definition
//! of what the kernel computes; GPU backends are tested against it.

pub(crate) mod backend;
mod capture;
pub mod comm;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod demo_kernels;
mod device;
mod dtype;
mod error;
mod graph;
mod kernel;
mod memory;
#[cfg(feature = "rocm")]
pub mod rocm;
mod stream;
pub mod testing;

pub use capture::CaptureStatus;
pub use comm::{Communicator, ReduceOp, COMM_TIMEOUT_ENV, DEFAULT_COMM_TIMEOUT};
pub use cpu::{CpuLaunch, CpuPtr};
pub use device::{BackendKind, Device, DeviceInfo, DeviceName, SM90_MAX_SHARED_MEM_PER_BLOCK};
pub use dtype::{DType, Element};
pub use error::{CaptureOp, HalError, Result};
pub use graph::Graph;
pub use half::{bf16, f16};
pub use kernel::{
    Access, Arg, CpuKernelFn, Kernel, KernelEntry, KernelSource, LaunchConfig, Module, Param, ParamKind, ScalarKind,
    MAX_CLUSTER_BLOCKS, PORTABILITY_HEADER, PORTABLE_CLUSTER_BLOCKS,
};
pub use memory::{Buffer, MappedBuffer, MemStats, PinnedBuffer, RawView, View};
pub use stream::{Event, Stream, StreamPriority};
