//! Managed regions: anonymous mappings registered with the engine's userfaultfd, each with one
//! state word per page.

use std::sync::Arc;

use tiermem_sys::mem::Mapping;
use tiermem_sys::{PAGE_SHIFT, PAGE_SIZE};

use crate::page::PageCell;
use crate::policy::{page_id, PageId};

/// The engine's side of a region.
#[derive(Debug)]
pub(crate) struct RegionInner {
    pub(crate) index: u32,
    pub(crate) mapping: Mapping,
    pub(crate) pages: Box<[PageCell]>,
    /// Per page, a hash of what its slot holds, set whenever the slot is written (async WP, and
    /// sync WP with write fault-around; empty otherwise): a page that may or may not have been
    /// written is dropped or cleaned without a write only if its contents still hash the same.
    pub(crate) slot_hashes: Box<[std::sync::atomic::AtomicU64]>,
    /// Set when the region is being freed: reclaim and prefetch start no new work on it.
    pub(crate) closing: std::sync::atomic::AtomicBool,
    /// Registered on the engine's second userfaultfd, served by a handler thread (sigbus mode's
    /// kernel regions, see [`crate::Engine::create_kernel_region`]).
    pub(crate) threaded: bool,
}

impl RegionInner {
    pub(crate) fn new(index: u32, mapping: Mapping, tables: PageTables, threaded: bool) -> Self {
        debug_assert_eq!(tables.pages.len(), mapping.len() / PAGE_SIZE);
        let PageTables { pages, slot_hashes } = tables;
        Self { index, mapping, pages, slot_hashes, closing: std::sync::atomic::AtomicBool::new(false), threaded }
    }

    /// Write to every memory page of the per-page state (see [`crate::Engine::keep_metadata_resident`]).
    pub(crate) fn touch_metadata(&self) {
        use std::sync::atomic::Ordering;
        // Nothing else uses a region being made; one element per 4 KiB page suffices.
        const STEP: usize = PAGE_SIZE / 8;
        self.pages.iter().step_by(STEP).for_each(|cell| cell.touch());
        self.slot_hashes.iter().step_by(STEP).for_each(|hash| {
            hash.swap(hash.load(Ordering::Relaxed), Ordering::Relaxed);
        });
    }

    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether any page is locked or has I/O in flight.
    pub(crate) fn busy(&self) -> bool {
        self.pages.iter().any(|c| {
            let s = c.peek();
            c.is_locked() || s.writing() || s.kind() == crate::page::Kind::Incoming
        })
    }

    pub(crate) fn start(&self) -> usize {
        self.mapping.as_ptr() as usize
    }

    pub(crate) fn contains(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.start()) < self.mapping.len()
    }

    pub(crate) fn page_index(&self, addr: usize) -> u64 {
        ((addr - self.start()) >> PAGE_SHIFT) as u64
    }

    pub(crate) fn page_addr(&self, index: u64) -> *mut u8 {
        // Callers pass indices below pages.len(), so this stays inside the mapping.
        self.mapping.as_ptr().wrapping_add((index as usize) << PAGE_SHIFT)
    }

    pub(crate) fn page_count(&self) -> u64 {
        self.pages.len() as u64
    }

    pub(crate) fn id(&self, index: u64) -> PageId {
        page_id(self.index, index)
    }
}

/// A region's per-page tables, made before its mapping so that a region too large for them
/// fails before anything is mapped or registered.
#[derive(Debug)]
pub(crate) struct PageTables {
    pages: Box<[PageCell]>,
    slot_hashes: Box<[std::sync::atomic::AtomicU64]>,
}

impl PageTables {
    /// Tables for `count` pages, from zeroed memory: they take memory only as pages are used (a
    /// reservation of many GiB that the program touches sparsely costs what it touches), and
    /// an allocation that fails is an error, not an abort.
    pub(crate) fn new(count: usize, with_hashes: bool) -> crate::Result<Self> {
        let too_large = || {
            crate::Error::new(
                crate::ErrorKind::NoSpace,
                format!(
                    "cannot allocate {} MiB of page state for a region of {} MiB",
                    (count * if with_hashes { 16 } else { 8 }) >> 20,
                    (count * PAGE_SIZE) >> 20
                ),
            )
        };
        // SAFETY: a PageCell and an AtomicU64 are a u64 each, for which all-zero bits are a
        // valid value (a PageCell of zero is `PageCell::default()`, a page never touched).
        let pages = unsafe { zeroed_slice::<PageCell>(count) }.ok_or_else(too_large)?;
        // SAFETY: as above.
        let slot_hashes = unsafe { zeroed_slice(if with_hashes { count } else { 0 }) }.ok_or_else(too_large)?;
        Ok(Self { pages, slot_hashes })
    }
}

/// `count` elements of zeroed memory, or `None` if the allocator has none to give. Large
/// zeroed allocations come from fresh anonymous pages, which the kernel maps only when written.
///
/// # Safety
/// All-zero bits must be a valid `T`.
unsafe fn zeroed_slice<T>(count: usize) -> Option<Box<[T]>> {
    let layout = std::alloc::Layout::array::<T>(count).ok()?;
    if layout.size() == 0 {
        // SAFETY: a dangling, aligned pointer is a valid empty or zero-sized slice, and Box
        // never frees a zero-sized allocation.
        return Some(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(std::ptr::NonNull::<T>::dangling().as_ptr(), count))
        });
    }
    // SAFETY: the layout has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` is a live allocation of the global allocator with `layout`, the layout
    // Box<[T]> of `count` elements frees with; its zeroed elements are valid (the caller's
    // contract) and owned by nothing else.
    Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, count)) })
}

/// All live regions, indexed by region slot. Lookups take a read lock that the caller holds for
/// the whole fault, so a region cannot disappear while one of its pages is being handled.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    pub(crate) slots: Vec<Option<Arc<RegionInner>>>,
    /// (first address, slot) of every live region, sorted by address: a program under the
    /// preload shim can have thousands of small regions (an interpreter's 1 MiB arenas), and
    /// every fault looks its address up here.
    by_start: Vec<(usize, u32)>,
}

impl RegionTable {
    pub(crate) fn find(&self, addr: usize) -> Option<&RegionInner> {
        let after = self.by_start.partition_point(|&(start, _)| start <= addr);
        let (_, index) = *self.by_start.get(after.checked_sub(1)?)?;
        self.get(index).filter(|r| r.contains(addr))
    }

    pub(crate) fn get(&self, index: u32) -> Option<&RegionInner> {
        self.slots.get(index as usize).and_then(|r| r.as_deref())
    }

    pub(crate) fn insert(&mut self, make: impl FnOnce(u32) -> RegionInner) -> Arc<RegionInner> {
        let index = self.slots.iter().position(Option::is_none).unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        let region = Arc::new(make(index as u32));
        let start = region.start();
        // After any region of the same start: a region being dropped may still be listed
        // while a new one takes over its addresses (the program mapped there again); `find`
        // then sees the new one at once instead of retrying faults until the old one is gone.
        let at = self.by_start.partition_point(|&(s, _)| s <= start);
        self.by_start.insert(at, (start, index as u32));
        self.slots[index] = Some(region.clone());
        region
    }

    pub(crate) fn remove(&mut self, index: u32) -> Option<Arc<RegionInner>> {
        let region = self.slots.get_mut(index as usize).and_then(Option::take)?;
        self.by_start.retain(|&(_, i)| i != index);
        Some(region)
    }
}
