//! The CPU backend: a faithful emulator of a GPU, and the sanitizer.
//!
//! Strategy per concept:
//! - **Memory**: device memory is host memory behind an allocation table keyed by synthetic device
//!   addresses. Addresses are never reused and every allocation is followed by an unmapped guard
//!   gap, so a stale or overrunning address resolves to nothing instead of to a neighbour. New
//!   allocations are filled with `0xFF` bytes (NaN for every float type, -1 for signed integers),
//!   so unwritten outputs show.
//! - **Kernels**: a module maps entry points to Rust reference functions ([`CpuKernelFn`]) that
//!   take the same arguments. Every pointer argument is resolved through the table at execution
//!   time, and every element access is bounds-checked against the view it was handed.
//! - **Streams**: execute each operation synchronously when it is enqueued, so in-order semantics
//!   hold trivially; events record host timestamps.
//! - **Capture**: while capturing, a stream records operations with their raw addresses instead of
//!   running them; replay re-executes the list, re-resolving every address. Exactly what a GPU
//!   graph does, which is why address-stability bugs show up here.
//! - **Collectives**: the ranks of a group meet in shared host memory (`comm.rs`); a collective
//!   blocks the calling thread until every rank has reached it, and is recorded and re-run at
//!   replay like any other operation.
//!
//! [`CpuKernelFn`]: crate::CpuKernelFn

pub(crate) mod comm;
mod launch;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

pub(crate) use comm::CpuComm;
pub use launch::{CpuLaunch, CpuPtr};

use crate::backend::{
    wrong_backend, DeviceImpl, DeviceOps, EventImpl, EventOps, GraphImpl, GraphOps, KernelImpl, LaunchArg, MemImpl,
    MemOps, PinnedImpl, PinnedOps, StreamImpl, StreamOps,
};
use crate::device::{lock, BackendKind, DeviceInfo};
use crate::error::{HalError, Result};
use crate::kernel::{Arg, CpuKernelFn, KernelEntry, KernelSource, LaunchConfig, LaunchMode};
use crate::stream::StreamPriority;

const ADDRESS_BASE: u64 = 0x7000_0000_0000;
const ALIGN: u64 = 256;
/// Unmapped bytes after each allocation.
const GUARD: u64 = 4096;
/// Fill byte of fresh allocations.
pub(crate) const POISON: u8 = 0xFF;

pub(crate) struct CpuAllocation {
    base: u64,
    bytes: usize,
    label: String,
    data: Mutex<Box<[u64]>>,
}

pub(crate) struct CpuCore {
    table: RwLock<BTreeMap<u64, Arc<CpuAllocation>>>,
    next_addr: AtomicU64,
    /// The emulated device memory, bytes: allocations past it fail with `OutOfMemory`, as a GPU's
    /// do (not an abort, nor the host's out-of-memory killer, when a configuration asks for more
    /// than the host holds).
    capacity: u64,
    /// Bytes of live allocations.
    used: AtomicU64,
}

impl CpuCore {
    fn new(capacity: u64) -> Self {
        CpuCore { table: RwLock::default(), next_addr: AtomicU64::new(0), capacity, used: AtomicU64::new(0) }
    }

    fn reserve(&self, bytes: usize) -> u64 {
        let span = (bytes as u64).max(1).div_ceil(ALIGN) * ALIGN + GUARD;
        ADDRESS_BASE + self.next_addr.fetch_add(span, Ordering::Relaxed)
    }

    /// Resolves `[addr, addr + bytes)` to one live allocation and a byte offset into it.
    fn resolve(&self, addr: u64, bytes: usize) -> std::result::Result<(Arc<CpuAllocation>, usize), String> {
        let table = self.table.read().unwrap_or_else(|p| p.into_inner());
        let Some((_, a)) = table.range(..=addr).next_back() else {
            return Err("not inside any live allocation".into());
        };
        let end = a.base + a.bytes as u64;
        if addr > end {
            return Err(format!("not inside any live allocation ({} bytes past the end of `{}`)", addr - end, a.label));
        }
        if addr + bytes as u64 > end {
            return Err(format!(
                "past the end of allocation `{}` ({} bytes at {:#x}) by {} bytes",
                a.label,
                a.bytes,
                a.base,
                addr + bytes as u64 - end
            ));
        }
        Ok((a.clone(), (addr - a.base) as usize))
    }

    /// Writes `data` at `addr` (one live allocation); `op` names the operation in the error.
    fn write(&self, addr: u64, data: &[u8], op: &str) -> Result<()> {
        let (a, off) = self.resolve(addr, data.len()).map_err(|why| bad_addr(op, "dst", addr, data.len(), why))?;
        let mut d = lock(&a.data);
        bytemuck::cast_slice_mut::<u64, u8>(&mut d)[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Reads `out.len()` bytes at `addr` (one live allocation); `op` names the operation.
    fn read(&self, addr: u64, out: &mut [u8], op: &str) -> Result<()> {
        let (a, off) = self.resolve(addr, out.len()).map_err(|why| bad_addr(op, "src", addr, out.len(), why))?;
        let d = lock(&a.data);
        out.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&d)[off..off + out.len()]);
        Ok(())
    }
}

/// The CPU device.
pub(crate) struct CpuDevice {
    core: Arc<CpuCore>,
}

impl CpuDevice {
    pub(crate) fn open() -> Result<(DeviceImpl, DeviceInfo)> {
        let capacity = memory_capacity()?;
        let info = DeviceInfo {
            name: "holdfast CPU emulator".into(),
            backend: BackendKind::Cpu,
            ordinal: 0,
            total_memory: capacity,
            arch: "cpu".into(),
            compute_units: rayon::current_num_threads() as u32,
            warp_size: 1,
            max_shared_mem_per_block: crate::device::SM90_MAX_SHARED_MEM_PER_BLOCK,
            dependent_launch: false,
        };
        Ok((DeviceImpl::Cpu(CpuDevice { core: Arc::new(CpuCore::new(capacity)) }), info))
    }

    /// A device allocation of `bytes`, every byte `fill` (poison for `alloc`, zero for mapped
    /// memory): out-of-memory past the emulated capacity or where the host cannot give it.
    fn alloc_filled(&self, bytes: usize, label: &str, fill: u8) -> Result<MemImpl> {
        let oom = || HalError::OutOfMemory { bytes, label: label.to_string() };
        let before = self.core.used.fetch_add(bytes as u64, Ordering::Relaxed);
        let data =
            if before.saturating_add(bytes as u64) > self.core.capacity { None } else { filled_words(bytes, fill) };
        let Some(data) = data else {
            self.core.used.fetch_sub(bytes as u64, Ordering::Relaxed);
            return Err(oom());
        };
        let base = self.core.reserve(bytes);
        let a = Arc::new(CpuAllocation { base, bytes, label: label.to_string(), data: Mutex::new(data) });
        self.core.table.write().unwrap_or_else(|p| p.into_inner()).insert(base, a);
        Ok(MemImpl::Cpu(CpuMem { core: self.core.clone(), base }))
    }
}

/// The 8-byte words backing `bytes`, every byte `fill`; `None` where the host cannot give them.
fn filled_words(bytes: usize, fill: u8) -> Option<Box<[u64]>> {
    let words = bytes.div_ceil(8);
    let mut data = Vec::new();
    data.try_reserve_exact(words).ok()?;
    data.resize(words, u64::from_ne_bytes([fill; 8]));
    Some(data.into_boxed_slice())
}

/// Environment variable: the CPU emulator's device memory in bytes (default: nine tenths of the
/// host memory available when the device opens).
pub const CPU_MEMORY_ENV: &str = "HOLDFAST_CPU_MEMORY";

/// The emulated device memory: [`CPU_MEMORY_ENV`] if set, else nine tenths of `MemAvailable`
/// (unlimited where the host does not say).
fn memory_capacity() -> Result<u64> {
    if let Ok(v) = std::env::var(CPU_MEMORY_ENV) {
        return v.trim().parse::<u64>().map_err(|e| HalError::UnknownDevice {
            name: "cpu".into(),
            reason: format!("{CPU_MEMORY_ENV}={v:?} is not a byte count: {e}"),
        });
    }
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()))
    });
    Ok(available.map_or(u64::MAX, |kb| kb.saturating_mul(1024) / 10 * 9))
}

impl DeviceOps for CpuDevice {
    fn alloc(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.alloc_filled(bytes, label, POISON)
    }

    fn write_sync(&self, addr: u64, data: &[u8]) -> Result<()> {
        self.core.write(addr, data, "upload")
    }

    /// Host memory (not counted against the emulated device memory); a size the host cannot
    /// give is an out-of-memory error, as `cuMemHostAlloc` failing would be.
    fn alloc_pinned(&self, bytes: usize) -> Result<PinnedImpl> {
        let data = filled_words(bytes, 0)
            .ok_or_else(|| HalError::OutOfMemory { bytes, label: "pinned host memory".into() })?;
        Ok(PinnedImpl::Cpu(CpuPinned(Arc::new(Mutex::new(data)))))
    }

    fn alloc_mapped(&self, bytes: usize, label: &str) -> Result<MemImpl> {
        self.alloc_filled(bytes, label, 0)
    }

    /// The emulator runs every stream's work in its enqueue order: a priority changes nothing.
    fn create_stream(&self, _priority: StreamPriority) -> Result<StreamImpl> {
        Ok(StreamImpl::Cpu(CpuStream { core: self.core.clone(), recording: Mutex::new(None) }))
    }

    fn create_event(&self) -> Result<EventImpl> {
        Ok(EventImpl::Cpu(CpuEvent { at: Mutex::new(None) }))
    }

    fn compile(&self, src: &KernelSource) -> Result<Vec<KernelImpl>> {
        Ok(src.entries.iter().map(|e| KernelImpl::Cpu(CpuKernel { f: e.cpu })).collect())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    /// The emulator stands for an sm_90 device with one multiprocessor per host thread: blocks
    /// per multiprocessor as its thread, block and shared-memory limits allow, whole clusters
    /// over all of them, and at least one cluster whenever a block fits (the emulator runs any
    /// number of clusters, one after another).
    fn max_active_clusters(&self, _kernel: &KernelImpl, cfg: &LaunchConfig, cluster: u32) -> Result<u32> {
        Ok(sm90_active_clusters(cfg, cluster, rayon::current_num_threads() as u32))
    }
}

/// Shared memory of one sm_90 multiprocessor, bytes (228 KiB).
const SM90_SHARED_MEM_PER_UNIT: u64 = 228 * 1024;
/// Shared memory the sm_90 hardware reserves for each resident block, bytes.
const SM90_RESERVED_SHARED_PER_BLOCK: u64 = 1024;

/// Clusters of `cluster` blocks shaped as `cfg` that `units` sm_90 multiprocessors hold at once
/// (at most 2048 threads, 32 blocks and 228 KiB of shared memory per multiprocessor); 0 when one
/// block does not fit, at least 1 otherwise. Registers and the processing clusters a cluster must
/// fit in are not modelled, so a GPU may report fewer (an H200's 132 multiprocessors hold 30
/// clusters of 8 blocks of 96 KiB where this model says 33).
fn sm90_active_clusters(cfg: &LaunchConfig, cluster: u32, units: u32) -> u32 {
    let threads = cfg.threads_per_block().max(1);
    let smem = u64::from(cfg.shared_mem_bytes);
    if smem > u64::from(crate::device::SM90_MAX_SHARED_MEM_PER_BLOCK) || threads > 1024 {
        return 0;
    }
    let per_unit = (2048 / threads).min(32).min(SM90_SHARED_MEM_PER_UNIT / (smem + SM90_RESERVED_SHARED_PER_BLOCK));
    let clusters = u64::from(units) * per_unit / u64::from(cluster.max(1));
    u32::try_from(clusters.max(u64::from(per_unit > 0))).unwrap_or(u32::MAX)
}

fn bad_addr(kernel: &str, arg: &str, addr: u64, bytes: usize, why: String) -> HalError {
    HalError::BadAddress { kernel: kernel.to_string(), arg: arg.to_string(), addr, bytes, why }
}

/// A CPU allocation handle; dropping it unmaps the address range.
pub(crate) struct CpuMem {
    core: Arc<CpuCore>,
    base: u64,
}

impl MemOps for CpuMem {
    fn addr(&self) -> u64 {
        self.base
    }
    // Every allocation of the emulator is host memory; only mapped ones are reached from here.
    fn host_write(&self, offset: usize, data: &[u8]) -> Result<()> {
        self.core.write(self.base + offset as u64, data, "host write")
    }
    fn host_read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.core.read(self.base + offset as u64, out, "host read")
    }
}

impl Drop for CpuMem {
    fn drop(&mut self) {
        let removed = self.core.table.write().unwrap_or_else(|p| p.into_inner()).remove(&self.base);
        if let Some(a) = removed {
            self.core.used.fetch_sub(a.bytes as u64, Ordering::Relaxed);
        }
    }
}

/// Pinned host memory on the CPU backend: plain host memory.
#[derive(Clone)]
pub(crate) struct CpuPinned(Arc<Mutex<Box<[u64]>>>);

impl PinnedOps for CpuPinned {
    fn write(&self, offset: usize, data: &[u8]) {
        let mut d = lock(&self.0);
        bytemuck::cast_slice_mut::<u64, u8>(&mut d)[offset..offset + data.len()].copy_from_slice(data);
    }
    fn read(&self, offset: usize, out: &mut [u8]) {
        let d = lock(&self.0);
        out.copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&d)[offset..offset + out.len()]);
    }
}

/// A compiled CPU kernel: its reference function.
#[derive(Clone, Debug)]
pub(crate) struct CpuKernel {
    f: CpuKernelFn,
}

#[derive(Clone)]
enum CpuOp {
    Launch { f: CpuKernelFn, entry: Arc<KernelEntry>, cfg: LaunchConfig, cluster: u32, args: Vec<LaunchArg> },
    Memset { addr: u64, bytes: usize, value: u8 },
    Copy { src: u64, dst: u64, bytes: usize },
    CopyPinned { src: CpuPinned, offset: usize, dst: u64, bytes: usize },
    Collective { rank: Arc<comm::CpuRank>, call: crate::comm::CollectiveCall },
}

impl CpuOp {
    fn execute(&self, core: &CpuCore) -> Result<()> {
        match self {
            CpuOp::Launch { f, entry, cfg, cluster, args } => launch::execute(core, *f, entry, cfg, *cluster, args),
            CpuOp::Memset { addr, bytes, value } => {
                let (a, off) =
                    core.resolve(*addr, *bytes).map_err(|why| bad_addr("memset", "dst", *addr, *bytes, why))?;
                let mut d = lock(&a.data);
                bytemuck::cast_slice_mut::<u64, u8>(&mut d)[off..off + bytes].fill(*value);
                Ok(())
            }
            CpuOp::Copy { src, dst, bytes } => {
                let (sa, so) = core.resolve(*src, *bytes).map_err(|why| bad_addr("copy", "src", *src, *bytes, why))?;
                let (da, doff) =
                    core.resolve(*dst, *bytes).map_err(|why| bad_addr("copy", "dst", *dst, *bytes, why))?;
                if Arc::ptr_eq(&sa, &da) {
                    let mut d = lock(&da.data);
                    bytemuck::cast_slice_mut::<u64, u8>(&mut d).copy_within(so..so + bytes, doff);
                } else {
                    let s = lock(&sa.data);
                    let mut d = lock(&da.data);
                    bytemuck::cast_slice_mut::<u64, u8>(&mut d)[doff..doff + bytes]
                        .copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&s)[so..so + bytes]);
                }
                Ok(())
            }
            CpuOp::CopyPinned { src, offset, dst, bytes } => {
                let (da, doff) =
                    core.resolve(*dst, *bytes).map_err(|why| bad_addr("copy_from_pinned", "dst", *dst, *bytes, why))?;
                let mut d = lock(&da.data);
                src.read(*offset, &mut bytemuck::cast_slice_mut::<u64, u8>(&mut d)[doff..doff + bytes]);
                Ok(())
            }
            CpuOp::Collective { rank, call } => rank.execute(core, call),
        }
    }
}

/// The operations a capture records, shared by the stream that began it and its forked branches
/// in the order the host issued them (a valid order for every dependency: a stream can only be
/// made to wait on work issued before). `None` once the capture has ended.
type Tape = Arc<Mutex<Option<Vec<CpuOp>>>>;

/// A CPU stream: runs each operation when enqueued, or records it while capturing.
pub(crate) struct CpuStream {
    core: Arc<CpuCore>,
    recording: Mutex<Option<Tape>>,
}

impl CpuStream {
    fn submit(&self, op: CpuOp) -> Result<()> {
        let tape = lock(&self.recording).clone();
        if let Some(tape) = tape {
            if let Some(ops) = lock(&tape).as_mut() {
                ops.push(op);
                return Ok(());
            }
            // The capture this stream was forked into has ended.
            *lock(&self.recording) = None;
        }
        op.execute(&self.core)
    }

    fn take_tape(&self) -> Vec<CpuOp> {
        match lock(&self.recording).take() {
            Some(tape) => lock(&tape).take().unwrap_or_default(),
            None => Vec::new(),
        }
    }
}

fn cpu_stream(s: &StreamImpl) -> Result<&CpuStream> {
    #[allow(unreachable_patterns)]
    match s {
        StreamImpl::Cpu(s) => Ok(s),
        _ => Err(wrong_backend("stream")),
    }
}

impl StreamOps for CpuStream {
    fn launch(
        &self,
        kernel: &KernelImpl,
        entry: &Arc<KernelEntry>,
        cfg: &LaunchConfig,
        args: &[Arg],
        mode: LaunchMode, // kernels run one after the other here, each from its reference
    ) -> Result<()> {
        #[allow(unreachable_patterns)]
        let f = match kernel {
            KernelImpl::Cpu(k) => k.f,
            _ => return Err(wrong_backend("kernel")),
        };
        let args = args.iter().map(LaunchArg::of).collect();
        self.submit(CpuOp::Launch { f, entry: entry.clone(), cfg: *cfg, cluster: mode.cluster, args })
    }

    fn memset(&self, addr: u64, bytes: usize, value: u8) -> Result<()> {
        self.submit(CpuOp::Memset { addr, bytes, value })
    }

    fn copy_d2d(&self, src: u64, dst: u64, bytes: usize) -> Result<()> {
        self.submit(CpuOp::Copy { src, dst, bytes })
    }

    fn copy_h2d(&self, src: &[u8], dst: u64) -> Result<()> {
        let (a, off) =
            self.core.resolve(dst, src.len()).map_err(|why| bad_addr("copy_from_host", "dst", dst, src.len(), why))?;
        let mut d = lock(&a.data);
        bytemuck::cast_slice_mut::<u64, u8>(&mut d)[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn copy_pinned_h2d(&self, src: &PinnedImpl, offset: usize, dst: u64, bytes: usize) -> Result<()> {
        #[allow(unreachable_patterns)]
        let src = match src {
            PinnedImpl::Cpu(p) => p.clone(),
            _ => return Err(wrong_backend("pinned buffer")),
        };
        self.submit(CpuOp::CopyPinned { src, offset, dst, bytes })
    }

    fn copy_d2h_sync(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.core.read(src, dst, "copy_to_host_sync")
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn wait_event(&self, _event: &EventImpl) -> Result<()> {
        // Work completes at enqueue on this backend, so every recorded event is already complete.
        Ok(())
    }

    fn begin_capture(&self) -> Result<()> {
        *lock(&self.recording) = Some(Arc::new(Mutex::new(Some(Vec::new()))));
        Ok(())
    }

    fn end_capture(&self) -> Result<GraphImpl> {
        let ops = self.take_tape();
        Ok(GraphImpl::Cpu(CpuGraph { core: self.core.clone(), ops }))
    }

    fn abort_capture(&self) -> Result<()> {
        self.take_tape();
        Ok(())
    }

    fn fork_capture(&self, branch: &StreamImpl, _edge: &EventImpl) -> Result<()> {
        let tape = lock(&self.recording).clone();
        *lock(&cpu_stream(branch)?.recording) = tape;
        Ok(())
    }

    fn join_capture(&self, branch: &StreamImpl, _edge: &EventImpl) -> Result<()> {
        *lock(&cpu_stream(branch)?.recording) = None;
        Ok(())
    }
}

/// An event on the CPU backend: the host time at which it was recorded.
pub(crate) struct CpuEvent {
    at: Mutex<Option<Instant>>,
}

impl EventOps for CpuEvent {
    fn record(&self, _stream: &StreamImpl) -> Result<()> {
        *lock(&self.at) = Some(Instant::now());
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn elapsed_ms(&self, end: &EventImpl) -> Result<f32> {
        #[allow(unreachable_patterns)]
        let end = match end {
            EventImpl::Cpu(e) => e,
            _ => return Err(wrong_backend("event")),
        };
        let (Some(a), Some(b)) = (*lock(&self.at), *lock(&end.at)) else {
            return Err(HalError::EventNotRecorded);
        };
        Ok(b.saturating_duration_since(a).as_secs_f32() * 1e3)
    }
}

/// A recorded operation list.
pub(crate) struct CpuGraph {
    core: Arc<CpuCore>,
    ops: Vec<CpuOp>,
}

impl GraphOps for CpuGraph {
    fn replay(&self, _stream: &StreamImpl) -> Result<()> {
        for op in &self.ops {
            op.execute(&self.core)?;
        }
        Ok(())
    }
    fn node_count(&self) -> usize {
        self.ops.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sm90_cluster_model_counts_blocks_per_unit_by_their_limits() {
        let cfg = |threads: u32, smem: u32| LaunchConfig { shared_mem_bytes: smem, ..LaunchConfig::blocks(1, threads) };
        // Shared memory: two 96 KiB blocks per unit; 132 units hold 33 clusters of 8.
        assert_eq!(sm90_active_clusters(&cfg(256, 96 * 1024), 8, 132), 33);
        // Threads: eight 256-thread blocks per unit.
        assert_eq!(sm90_active_clusters(&cfg(256, 0), 8, 132), 132);
        // Blocks: at most 32 per unit.
        assert_eq!(sm90_active_clusters(&cfg(32, 0), 16, 4), 8);
        // At least one cluster where a block fits; none where it does not.
        assert_eq!(sm90_active_clusters(&cfg(1024, 200 * 1024), 16, 2), 1);
        assert_eq!(sm90_active_clusters(&cfg(64, 228 * 1024), 1, 132), 0);
        assert_eq!(sm90_active_clusters(&cfg(2048, 0), 1, 132), 0);
    }
}
