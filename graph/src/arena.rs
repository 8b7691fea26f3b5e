//! The persistent arena: every buffer a graph may touch, allocated once at the largest capture
//! size and then locked (DESIGN.md 4, "Persistent arena").
//!
//! A graph bakes in addresses, so step-varying data (inputs, attention metadata, intermediates,
//! outputs) must live at addresses that never change. The arena allocates each named buffer once,
//! with [`holdfast_hal::Device::alloc_persistent`], for the largest size; a graph captured for `n`
//! tokens uses the prefix views `buffer.prefix(n)`, which start at the same address. One shared
//! workspace ([`WORKSPACE`]) holds the intermediates of every graph: graphs never replay
//! concurrently, so graph memory does not grow with the number of capture sizes.
//!
//! After [`PersistentArena::lock`] no buffer can be added; the graph runners require a locked
//! arena, so nothing a graph could need can appear after capture.

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use holdfast_hal::{Buffer, DType, Device, Element, RawView, View};

use crate::error::GraphError;

/// Name of the shared workspace buffer (`f32` elements) allocated by
/// [`PersistentArena::alloc_workspace`].
pub const WORKSPACE: &str = "workspace";

struct Entry {
    name: String,
    dtype: DType,
    len: usize,
    bytes: usize,
    addr: u64,
    buffer: Box<dyn Any + Send + Sync>,
    /// A view of it was taken while a stream of the device was capturing.
    captured: AtomicBool,
}

/// Named, typed, graph-stable device buffers, allocated once and then locked.
pub struct PersistentArena {
    device: Device,
    entries: Vec<Entry>,
    index: BTreeMap<String, usize>,
    locked: bool,
}

impl std::fmt::Debug for PersistentArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PersistentArena")
            .field("buffers", &self.entries.len())
            .field("total_bytes", &self.total_bytes())
            .field("locked", &self.locked)
            .finish()
    }
}

impl PersistentArena {
    /// An empty, unlocked arena on `device`.
    pub fn new(device: &Device) -> PersistentArena {
        PersistentArena { device: device.clone(), entries: Vec::new(), index: BTreeMap::new(), locked: false }
    }

    /// The device its buffers live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Allocates `len` zeroed elements of `T` under `name` (also the HAL buffer's label, so HAL
    /// errors name it). Errors: [`GraphError::ArenaLocked`] after [`lock`](Self::lock),
    /// [`GraphError::DuplicateBuffer`], or the HAL's allocation error.
    pub fn alloc<T: Element>(&mut self, name: &str, len: usize) -> Result<&Buffer<T>, GraphError> {
        if self.locked {
            return Err(GraphError::ArenaLocked { buffer: name.to_owned() });
        }
        if self.index.contains_key(name) {
            return Err(GraphError::DuplicateBuffer { buffer: name.to_owned() });
        }
        let buf: Buffer<T> = self.device.alloc_zeroed(name, len, true)?;
        let i = self.entries.len();
        self.entries.push(Entry {
            name: name.to_owned(),
            dtype: T::DTYPE,
            len,
            bytes: buf.bytes(),
            addr: buf.addr(),
            buffer: Box::new(buf),
            captured: AtomicBool::new(false),
        });
        self.index.insert(name.to_owned(), i);
        self.typed(i, name)
    }

    /// Like [`alloc`](Self::alloc), and marks the buffer host-refreshed: the HAL sanitizer then
    /// rejects a replay of a graph that reads it unless the host rewrote it since the last replay
    /// (catches a step that forgot to upload its inputs).
    pub fn alloc_input<T: Element>(&mut self, name: &str, len: usize) -> Result<&Buffer<T>, GraphError> {
        let buf = self.alloc::<T>(name, len)?;
        buf.set_host_refreshed(true);
        Ok(buf)
    }

    /// Allocates the shared workspace: `len` `f32` elements named [`WORKSPACE`], for the
    /// intermediates of every graph (size it for the largest capture size).
    pub fn alloc_workspace(&mut self, len: usize) -> Result<&Buffer<f32>, GraphError> {
        self.alloc::<f32>(WORKSPACE, len)
    }

    /// Forbids further allocation. Idempotent.
    pub fn lock(&mut self) {
        self.locked = true;
    }

    /// True after [`lock`](Self::lock).
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    fn entry(&self, name: &str) -> Result<usize, GraphError> {
        self.index.get(name).copied().ok_or_else(|| GraphError::UnknownBuffer {
            buffer: name.to_owned(),
            available: self.entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>().join(", "),
        })
    }

    fn typed<T: Element>(&self, i: usize, name: &str) -> Result<&Buffer<T>, GraphError> {
        let e = &self.entries[i];
        e.buffer.downcast_ref::<Buffer<T>>().ok_or_else(|| GraphError::BufferTypeMismatch {
            buffer: name.to_owned(),
            actual: e.dtype,
            requested: T::DTYPE,
        })
    }

    /// The buffer `name` as `Buffer<T>`. Errors: [`GraphError::UnknownBuffer`],
    /// [`GraphError::BufferTypeMismatch`].
    pub fn get<T: Element>(&self, name: &str) -> Result<&Buffer<T>, GraphError> {
        let i = self.entry(name)?;
        let buf = self.typed::<T>(i, name)?;
        if self.device.is_capturing() {
            self.entries[i].captured.store(true, Ordering::Relaxed);
        }
        Ok(buf)
    }

    /// The first `len` elements of `name` (same address as the whole buffer): the view a graph of
    /// `len` rows uses. A `len` past the buffer is the HAL's `InvalidView`.
    pub fn view<T: Element>(&self, name: &str, len: usize) -> Result<View<T>, GraphError> {
        Ok(self.get::<T>(name)?.prefix(len)?)
    }

    /// The shared workspace buffer.
    pub fn workspace(&self) -> Result<&Buffer<f32>, GraphError> {
        self.get::<f32>(WORKSPACE)
    }

    /// Elements `[offset, offset + len)` of the shared workspace.
    pub fn workspace_slice(&self, offset: usize, len: usize) -> Result<View<f32>, GraphError> {
        Ok(self.workspace()?.slice(offset, len)?)
    }

    /// Bytes of all buffers.
    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Bytes of the buffer `name`.
    pub fn bytes(&self, name: &str) -> Result<usize, GraphError> {
        Ok(self.entries[self.entry(name)?].bytes)
    }

    /// `(name, element type, elements, bytes)` of every buffer, in allocation order.
    pub fn buffers(&self) -> impl Iterator<Item = (&str, DType, usize, usize)> {
        self.entries.iter().map(|e| (e.name.as_str(), e.dtype, e.len, e.bytes))
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True if no buffer was allocated.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The name of the arena buffer `view` lies in, if any (same device address range and label).
    pub fn owner_of(&self, view: &RawView) -> Option<&str> {
        self.entry_of(view).map(|e| e.name.as_str())
    }

    fn entry_of(&self, view: &RawView) -> Option<&Entry> {
        let (start, end) = (view.addr(), view.addr() + view.bytes() as u64);
        let i = *self.index.get(view.label())?;
        let e = &self.entries[i];
        (start >= e.addr && end <= e.addr + e.bytes as u64).then_some(e)
    }

    /// Records that a graph uses the arena buffer `view` lies in (the runners call it for the
    /// inputs they bind); views of other buffers are ignored.
    pub(crate) fn note_captured(&self, view: &RawView) {
        if let Some(e) = self.entry_of(view) {
            e.captured.store(true, Ordering::Relaxed);
        }
    }

    /// Bytes of the distinct arena buffers looked up while a capture was active, or bound as graph
    /// inputs: the memory the
    /// captured graphs share (each buffer counted once however many graphs use it).
    pub fn captured_bytes(&self) -> usize {
        self.entries.iter().filter(|e| e.captured.load(Ordering::Relaxed)).map(|e| e.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena() -> PersistentArena {
        PersistentArena::new(&Device::cpu().expect("cpu device"))
    }

    #[test]
    fn prefix_views_share_the_buffer_address() {
        let mut a = arena();
        let base = a.alloc::<f32>("x", 64).expect("alloc").addr();
        let v = a.view::<f32>("x", 8).expect("view");
        assert_eq!((v.addr(), v.len()), (base, 8));
        assert!(a.get::<f32>("x").expect("get").is_persistent());
        assert!(a.view::<f32>("x", 65).is_err(), "a view past the buffer is an error");
    }

    #[test]
    fn allocating_after_lock_names_the_buffer() {
        let mut a = arena();
        a.alloc::<f32>("x", 4).expect("alloc");
        a.lock();
        assert_eq!(a.alloc::<i32>("late", 4).err(), Some(GraphError::ArenaLocked { buffer: "late".into() }));
        assert_eq!(a.len(), 1, "the rejected allocation changed nothing");
    }

    #[test]
    fn lookups_check_name_and_type() {
        let mut a = arena();
        a.alloc::<f32>("x", 4).expect("alloc");
        a.alloc::<i32>("idx", 2).expect("alloc");
        assert!(
            matches!(a.get::<f32>("nope"), Err(GraphError::UnknownBuffer { available, .. }) if available == "x, idx")
        );
        assert_eq!(
            a.get::<i32>("x").err(),
            Some(GraphError::BufferTypeMismatch { buffer: "x".into(), actual: DType::F32, requested: DType::I32 })
        );
        assert_eq!(a.alloc::<f32>("x", 1).err(), Some(GraphError::DuplicateBuffer { buffer: "x".into() }));
    }

    /// Every rejected allocation or lookup, through each entry point: the variant, and the words
    /// its message must contain (the buffer at fault and what the arena has or needs).
    #[test]
    fn every_rejected_allocation_or_lookup_names_the_buffer() {
        use GraphError as E;
        let mut a = arena();
        a.alloc::<f32>("x", 4).expect("alloc");
        a.alloc::<i32>("idx", 2).expect("alloc");
        let no_workspace = a.workspace().map(|_| ());
        let no_workspace_slice = a.workspace_slice(0, 1).map(|_| ());
        a.alloc_workspace(16).expect("workspace");
        let mut cases: Vec<crate::error::ErrorCase> = vec![
            (
                "second workspace",
                a.alloc_workspace(8).map(|_| ()),
                |e| matches!(e, E::DuplicateBuffer { buffer } if buffer == WORKSPACE),
                &["already has a buffer named `workspace`"],
            ),
            (
                "duplicate input",
                a.alloc_input::<i32>("idx", 2).map(|_| ()),
                |e| matches!(e, E::DuplicateBuffer { buffer } if buffer == "idx"),
                &["`idx`"],
            ),
            (
                "workspace before it is allocated",
                no_workspace,
                |e| matches!(e, E::UnknownBuffer { buffer, .. } if buffer == WORKSPACE),
                &["no buffer named `workspace`", "it has: x, idx"],
            ),
            (
                "workspace slice before it is allocated",
                no_workspace_slice,
                |e| matches!(e, E::UnknownBuffer { buffer, .. } if buffer == WORKSPACE),
                &["no buffer named `workspace`", "it has: x, idx"],
            ),
            (
                "bytes of an unknown buffer",
                a.bytes("nope").map(|_| ()),
                |e| matches!(e, E::UnknownBuffer { buffer, .. } if buffer == "nope"),
                &["no buffer named `nope`", "it has: x, idx, workspace"],
            ),
            (
                "view of an unknown buffer",
                a.view::<f32>("y", 1).map(|_| ()),
                |e| matches!(e, E::UnknownBuffer { buffer, .. } if buffer == "y"),
                &["no buffer named `y`", "it has: x, idx, workspace"],
            ),
            (
                "view with the wrong element type",
                a.view::<i32>("x", 1).map(|_| ()),
                |e| matches!(e, E::BufferTypeMismatch { actual: DType::F32, requested: DType::I32, .. }),
                &["buffer `x` holds f32 elements, not i32"],
            ),
            (
                "view past the buffer",
                a.view::<f32>("x", 5).map(|_| ()),
                |e| matches!(e.hal(), Some(holdfast_hal::HalError::InvalidView { buffer, len: 5, .. }) if buffer == "x"),
                &["buffer `x` of 4 elements"],
            ),
            (
                "workspace slice past the workspace",
                a.workspace_slice(10, 7).map(|_| ()),
                |e| matches!(e.hal(), Some(holdfast_hal::HalError::InvalidView { offset: 10, len: 7, .. })),
                &["[10, 10+7)", "buffer `workspace` of 16 elements"],
            ),
        ];
        a.lock();
        cases.push((
            "input after lock",
            a.alloc_input::<f32>("late input", 4).map(|_| ()),
            |e| matches!(e, E::ArenaLocked { buffer } if buffer == "late input"),
            &["locked", "`late input`", "allocate every graph-visible buffer before locking"],
        ));
        cases.push((
            "workspace after lock",
            a.alloc_workspace(4).map(|_| ()),
            |e| matches!(e, E::ArenaLocked { buffer } if buffer == WORKSPACE),
            &["locked", "`workspace`"],
        ));
        holdfast_hal::testing::check_errors(cases);
        assert_eq!(a.len(), 3, "no rejected allocation added a buffer");
    }

    #[test]
    fn bytes_are_counted_per_name_and_in_total() {
        let mut a = arena();
        a.alloc::<f32>("x", 10).expect("alloc");
        a.alloc::<i32>("idx", 3).expect("alloc");
        a.alloc_workspace(100).expect("workspace");
        assert_eq!(a.bytes("x").expect("x"), 40);
        assert_eq!(a.bytes(WORKSPACE).expect("ws"), 400);
        assert_eq!(a.total_bytes(), 40 + 12 + 400);
        assert_eq!(a.workspace_slice(10, 5).expect("slice").addr(), a.workspace().expect("ws").addr() + 40);
    }

    #[test]
    fn owner_of_recognises_arena_views_only() {
        let mut a = arena();
        a.alloc::<f32>("x", 10).expect("alloc");
        let inside = a.get::<f32>("x").expect("x").slice(2, 3).expect("view").raw();
        assert_eq!(a.owner_of(&inside), Some("x"));
        let fresh = a.device().alloc_persistent::<f32>("x", 10).expect("fresh");
        assert_eq!(a.owner_of(&fresh.view().raw()), None, "same label, other allocation");
    }
}
