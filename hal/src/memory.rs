//! Device buffers, views and pinned host staging memory.
//!
//! A [`Buffer<T>`] owns one device allocation whose address never changes while it lives. A
//! [`View<T>`] is `(offset, len)` into it: same allocation, address `base + offset`, so a view of
//! the first `n` rows of a persistent buffer is exactly what a graph captured at `n` rows baked in.
//! Allocations are reference counted: views and graphs keep an allocation alive, so a graph can
//! never replay into freed memory. Dropping the last handle while a stream of the device is
//! capturing defers the free until the capture ends.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::{MemImpl, MemOps, PinnedImpl, PinnedOps};
use crate::device::DeviceShared;
use crate::dtype::{DType, Element};
use crate::error::{CaptureOp, HalError, Result};

/// One device allocation, shared by its buffer, its views and the graphs that use it.
pub(crate) struct Allocation {
    pub(crate) id: u64,
    pub(crate) addr: u64,
    pub(crate) bytes: usize,
    pub(crate) label: String,
    pub(crate) persistent: bool,
    /// Page-locked host memory mapped into the device's address space ([`MappedBuffer`]).
    pub(crate) mapped: bool,
    /// Opt-in sanitizer flag: the host must rewrite this buffer before every graph replay.
    pub(crate) host_refreshed: AtomicBool,
    /// Incremented by every host write (pageable, pinned or synchronous upload).
    pub(crate) host_gen: AtomicU64,
    pub(crate) device: Arc<DeviceShared>,
    inner: Option<MemImpl>,
}

impl Allocation {
    pub(crate) fn new(device: Arc<DeviceShared>, bytes: usize, label: &str, persistent: bool) -> Result<Arc<Self>> {
        Self::create(device, bytes, label, persistent, false)
    }

    /// A mapped host allocation (always persistent: its address never changes).
    pub(crate) fn new_mapped(device: Arc<DeviceShared>, bytes: usize, label: &str) -> Result<Arc<Self>> {
        Self::create(device, bytes, label, true, true)
    }

    fn create(
        device: Arc<DeviceShared>,
        bytes: usize,
        label: &str,
        persistent: bool,
        mapped: bool,
    ) -> Result<Arc<Self>> {
        if device.capture_active() {
            return Err(HalError::IllegalDuringCapture {
                op: CaptureOp::Allocate,
                detail: format!("buffer `{label}`"),
            });
        }
        let inner = if mapped {
            crate::backend::DeviceOps::alloc_mapped(&device.inner, bytes, label)?
        } else {
            crate::backend::DeviceOps::alloc(&device.inner, bytes, label)?
        };
        let addr = inner.addr();
        if mapped {
            device.stats.on_pinned_alloc(bytes);
        } else {
            device.stats.on_alloc(bytes);
        }
        Ok(Arc::new(Allocation {
            id: device.next_id(),
            addr,
            bytes,
            label: label.to_string(),
            persistent,
            mapped,
            host_refreshed: AtomicBool::new(false),
            host_gen: AtomicU64::new(0),
            device,
            inner: Some(inner),
        }))
    }

    pub(crate) fn bump_host_gen(&self) {
        self.host_gen.fetch_add(1, Ordering::AcqRel);
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.mapped {
            self.device.stats.on_pinned_free(self.bytes);
        } else {
            self.device.stats.on_free(self.bytes);
        }
        if let Some(inner) = self.inner.take() {
            self.device.release(inner);
        }
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Allocation(`{}`, {:#x}, {} bytes)", self.label, self.addr, self.bytes)
    }
}

/// A typed device buffer with a fixed address for its whole life.
///
/// Zero-length buffers are valid: they have a unique address, hold no elements, and every
/// element access through them is out of bounds.
pub struct Buffer<T: Element> {
    pub(crate) alloc: Arc<Allocation>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> Buffer<T> {
    pub(crate) fn from_alloc(alloc: Arc<Allocation>, len: usize) -> Self {
        Buffer { alloc, len, _t: PhantomData }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * T::DTYPE.size()
    }
    /// The label given at allocation (used in every error about this buffer).
    pub fn label(&self) -> &str {
        &self.alloc.label
    }
    /// The device address of element 0.
    pub fn addr(&self) -> u64 {
        self.alloc.addr
    }
    /// True if the buffer is persistent (graph-stable): captured kernels may use it.
    pub fn is_persistent(&self) -> bool {
        self.alloc.persistent
    }
    /// The id of the device that owns it.
    pub fn device_id(&self) -> u64 {
        self.alloc.device.id
    }

    /// Marks the buffer as host-refreshed: the sanitizer then requires a host write to it between
    /// any two replays of a graph that reads it (catches a step that forgot to upload its inputs).
    pub fn set_host_refreshed(&self, on: bool) {
        self.alloc.host_refreshed.store(on, Ordering::Release);
    }

    /// The whole buffer as a view.
    pub fn view(&self) -> View<T> {
        View { alloc: self.alloc.clone(), offset: 0, len: self.len, _t: PhantomData }
    }

    /// Elements `[offset, offset + len)` as a view at address `addr() + offset * size_of::<T>()`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<View<T>> {
        self.view().slice(offset, len)
    }

    /// The first `len` elements (the padded-prefix view a graph of `len` rows uses).
    pub fn prefix(&self, len: usize) -> Result<View<T>> {
        self.slice(0, len)
    }

    /// Frees this handle now. While a stream of the device is capturing this is
    /// [`HalError::IllegalDuringCapture`] (`Free`), and the memory stays allocated until the
    /// capture ends, so nothing the capture recorded is invalidated. Views and graphs that still
    /// hold the allocation keep it alive either way.
    pub fn free(self) -> Result<()> {
        let capturing = self.alloc.device.capture_active();
        let label = self.alloc.label.clone();
        drop(self);
        if capturing {
            return Err(HalError::IllegalDuringCapture { op: CaptureOp::Free, detail: format!("buffer `{label}`") });
        }
        Ok(())
    }
}

impl<T: Element> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer<{}>(`{}`, {} elements at {:#x})", T::DTYPE, self.label(), self.len, self.addr())
    }
}

/// A typed window `(offset, len)` into a buffer; it keeps the buffer's allocation alive.
pub struct View<T: Element> {
    alloc: Arc<Allocation>,
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> Clone for View<T> {
    fn clone(&self) -> Self {
        View { alloc: self.alloc.clone(), offset: self.offset, len: self.len, _t: PhantomData }
    }
}

impl<T: Element> View<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Offset of element 0 in the buffer, in elements.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Device address of element 0 of the view.
    pub fn addr(&self) -> u64 {
        self.alloc.addr + (self.offset * T::DTYPE.size()) as u64
    }
    /// Label of the underlying buffer.
    pub fn label(&self) -> &str {
        &self.alloc.label
    }
    /// A sub-view relative to this view.
    pub fn slice(&self, offset: usize, len: usize) -> Result<View<T>> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                Ok(View { alloc: self.alloc.clone(), offset: self.offset + offset, len, _t: PhantomData })
            }
            _ if self.offset == 0 && self.len * T::DTYPE.size() == self.alloc.bytes => {
                Err(HalError::InvalidView { buffer: self.alloc.label.clone(), offset, len, capacity: self.len })
            }
            _ => Err(HalError::InvalidSubView {
                buffer: self.alloc.label.clone(),
                offset: self.offset.saturating_add(offset),
                len,
                view_offset: self.offset,
                view_len: self.len,
            }),
        }
    }
    /// The untyped form used in launch arguments and replay checks.
    pub fn raw(&self) -> RawView {
        RawView { alloc: self.alloc.clone(), offset: self.offset, len: self.len, dtype: T::DTYPE }
    }
}

impl<T: Element> fmt::Debug for View<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "View<{}>(`{}`[{}..{}])", T::DTYPE, self.label(), self.offset, self.offset + self.len)
    }
}

/// An untyped view: allocation, element offset, element count and element type.
#[derive(Clone)]
pub struct RawView {
    pub(crate) alloc: Arc<Allocation>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl RawView {
    /// Device address of the first element.
    pub fn addr(&self) -> u64 {
        self.alloc.addr + (self.offset * self.dtype.size()) as u64
    }
    /// Element count.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Label of the underlying buffer.
    pub fn label(&self) -> &str {
        &self.alloc.label
    }
    /// True if the underlying buffer is persistent.
    pub fn is_persistent(&self) -> bool {
        self.alloc.persistent
    }
    /// The view's identity as recorded by a graph: `(address, length, dtype)`.
    pub fn describe(&self) -> String {
        format!("`{}` {:#x}+{} {}", self.label(), self.addr(), self.len, self.dtype)
    }
}

impl fmt::Debug for RawView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

impl<T: Element> From<&View<T>> for RawView {
    fn from(v: &View<T>) -> Self {
        v.raw()
    }
}
impl<T: Element> From<&Buffer<T>> for RawView {
    fn from(b: &Buffer<T>) -> Self {
        b.view().raw()
    }
}
impl<T: Element> From<&View<T>> for crate::Arg {
    fn from(v: &View<T>) -> Self {
        crate::Arg::Ptr(v.raw())
    }
}
impl<T: Element> From<&Buffer<T>> for crate::Arg {
    fn from(b: &Buffer<T>) -> Self {
        crate::Arg::Ptr(b.view().raw())
    }
}

/// Page-locked host memory shared by a pinned buffer and the graphs that copy from it.
pub(crate) struct PinnedAlloc {
    pub(crate) bytes: usize,
    pub(crate) device: Arc<DeviceShared>,
    pub(crate) inner: PinnedImpl,
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        self.device.stats.on_pinned_free(self.bytes);
    }
}

/// Pinned (page-locked) host memory: the source of non-blocking host→device copies.
///
/// A copy from it is asynchronous: the host must not rewrite the staged range until the copy has
/// completed (record an event after the copy and wait for it). A graph that captured a copy from
/// a pinned buffer reads the buffer's contents at replay time.
pub struct PinnedBuffer<T: Element> {
    pub(crate) alloc: Arc<PinnedAlloc>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> PinnedBuffer<T> {
    pub(crate) fn from_alloc(alloc: Arc<PinnedAlloc>, len: usize) -> Self {
        PinnedBuffer { alloc, len, _t: PhantomData }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True if it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Writes `data` at element `offset` (host-side memcpy). Takes the buffer mutably, so host
    /// writes cannot race each other (the device side is the caller's to order, as above).
    pub fn write(&mut self, offset: usize, data: &[T]) -> Result<()> {
        self.check(offset, data.len())?;
        self.alloc.inner.write(offset * T::DTYPE.size(), bytemuck::cast_slice(data));
        Ok(())
    }
    /// Reads the whole buffer (host-side memcpy; the caller ensures no copy into it is pending).
    pub fn to_vec(&self) -> Vec<T> {
        let mut out = vec![T::default(); self.len];
        self.alloc.inner.read(0, bytemuck::cast_slice_mut(&mut out));
        out
    }
    pub(crate) fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(HalError::InvalidView { buffer: "pinned staging".into(), offset, len, capacity: self.len }),
        }
    }
}

impl<T: Element> fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedBuffer<{}>({} elements)", T::DTYPE, self.len)
    }
}

/// Page-locked host memory that kernels and copies use in place ("zero-copy"): mapped into the
/// device's address space at a fixed address, so its [`View`]s are ordinary kernel arguments and
/// copy operands, captured like any persistent buffer; the host writes and reads it directly.
///
/// A kernel reads it over the host link at the time the kernel runs (in a graph: at every
/// replay), which saves the copy engine's round trip for small per-step inputs read once. As with
/// [`PinnedBuffer`], the host must not rewrite a range that enqueued work has yet to read (wait on
/// an event first). A host write counts as a refresh for the sanitizer
/// ([`Buffer::set_host_refreshed`]). The counters list it as pinned memory.
pub struct MappedBuffer<T: Element> {
    buf: Buffer<T>,
}

impl<T: Element> MappedBuffer<T> {
    pub(crate) fn from_alloc(alloc: Arc<Allocation>, len: usize) -> Self {
        MappedBuffer { buf: Buffer::from_alloc(alloc, len) }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    /// True if it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    /// The label given at allocation.
    pub fn label(&self) -> &str {
        self.buf.label()
    }
    /// The device face: the whole buffer as a view (for kernel arguments and copies).
    pub fn view(&self) -> View<T> {
        self.buf.view()
    }
    /// The device face as a buffer handle (for [`Buffer::set_host_refreshed`] and slicing).
    pub fn buffer(&self) -> &Buffer<T> {
        &self.buf
    }
    /// Writes `data` at element `offset` (a host-side memcpy; no stream involved). Takes the
    /// buffer mutably, so host writes never race each other.
    pub fn write(&mut self, offset: usize, data: &[T]) -> Result<()> {
        self.buf.slice(offset, data.len())?;
        self.inner()?.host_write(offset * T::DTYPE.size(), bytemuck::cast_slice(data))?;
        self.buf.alloc.bump_host_gen();
        Ok(())
    }
    /// Reads `len` elements from element `offset` (a host-side memcpy; the caller ensures no
    /// enqueued work still writes the range).
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<T>> {
        self.buf.slice(offset, len)?;
        let mut out = vec![T::default(); len];
        self.inner()?.host_read(offset * T::DTYPE.size(), bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }
    fn inner(&self) -> Result<&MemImpl> {
        self.buf.alloc.inner.as_ref().ok_or_else(|| HalError::Unsupported("mapped buffer already released".into()))
    }
}

impl<T: Element> fmt::Debug for MappedBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MappedBuffer<{}>(`{}`, {} elements)", T::DTYPE, self.label(), self.len())
    }
}

/// Memory and synchronisation counters of one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemStats {
    /// Device allocations currently live.
    pub live_allocations: u64,
    /// Bytes of device memory currently allocated.
    pub live_bytes: u64,
    /// Highest `live_bytes` seen.
    pub peak_bytes: u64,
    /// Device allocations made since the device was opened.
    pub total_allocations: u64,
    /// Bytes of pinned host memory currently allocated.
    pub pinned_bytes: u64,
    /// Frees deferred because a capture was active, not yet released.
    pub deferred_frees: u64,
    /// Host synchronisations (stream/event/device sync, device→host reads) so far.
    pub host_syncs: u64,
}
