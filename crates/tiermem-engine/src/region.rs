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
    /// A bit per [`METADATA_CHUNK`] pages: that chunk's per-page state is writable memory
    /// (see [`RegionInner::ready_metadata`]).
    pub(crate) metadata_ready: Box<[std::sync::atomic::AtomicU64]>,
}

/// Pages whose per-page state is made ready at once: a page of state words and one of slot
/// hashes (each of two pages where the table does not start on a page boundary). A power of
/// two, so a window of zero-fill around lies in one chunk.
pub(crate) const METADATA_CHUNK: usize = PAGE_SIZE / 8;

impl RegionInner {
    pub(crate) fn new(index: u32, mapping: Mapping, tables: PageTables, threaded: bool) -> Self {
        debug_assert_eq!(tables.pages.len(), mapping.len() / PAGE_SIZE);
        let PageTables { pages, slot_hashes, metadata_ready } = tables;
        Self {
            index,
            mapping,
            pages,
            slot_hashes,
            closing: std::sync::atomic::AtomicBool::new(false),
            threaded,
            metadata_ready,
        }
    }

    /// Ready the per-page state for a cgroup that pauses the program when out of memory (see
    /// [`crate::Engine::keep_metadata_resident`]): no thread of the engine may wait for memory
    /// to write it, reclaim and completions least of all, as they are the ones to free some.
    /// Here only the page tables over it are mapped, from the shared zero page, which takes
    /// no memory; each chunk of it is made writable memory by the first fault there
    /// ([`RegionInner::ready_metadata`]). Writing all of it up front cost 16 bytes for every
    /// page of the region, 0.4% of what a program reserves however little of it it uses: GNU
    /// sort's 1.4 GiB buffer under a 20 MiB cgroup left a budget of 6.8 MiB instead of 13.
    pub(crate) fn prepare_metadata(&self) {
        use crate::page::touch_word;
        use std::sync::atomic::Ordering;
        // Written now: setting a chunk's bit must not be a first write.
        self.metadata_ready.iter().for_each(touch_word);
        let mapped = [address_range(&self.pages), address_range(&self.slot_hashes)]
            .into_iter()
            .all(|range| advise_range(range, rustix::mm::Advice::LinuxPopulateRead).is_ok());
        if !mapped {
            // No MADV_POPULATE_READ (before Linux 5.14): the whole state written, as before.
            self.pages.iter().step_by(PAGE_SIZE / 8).for_each(PageCell::touch);
            self.slot_hashes.iter().step_by(PAGE_SIZE / 8).for_each(touch_word);
            self.metadata_ready.iter().for_each(|word| word.store(u64::MAX, Ordering::Relaxed));
        }
    }

    /// Make the per-page state of the chunk of [`METADATA_CHUNK`] pages holding page `index`
    /// writable memory (its state words, slot hashes and its bit in `metadata_ready`), once,
    /// for a fault about to write it. With MADV_POPULATE_WRITE, which a full cgroup refuses
    /// with ENOMEM: a plain first write would instead wait in the cgroup's OOM wait, holding
    /// the region table and, from zero-fill around, the locks of up to 64 pages (a handler
    /// thread waiting so left the OOM guard's burst test out of memory for 2 s in 2 of 42 runs).
    /// Reclaim and completions write only the state of pages that faults brought in, so of
    /// chunks made ready here.
    pub(crate) fn ready_metadata(&self, index: u64) -> Result<(), rustix::io::Errno> {
        use std::sync::atomic::Ordering;
        let chunk = index as usize / METADATA_CHUNK;
        let (word, bit) = (chunk / 64, 1u64 << (chunk % 64));
        let Some(ready) = self.metadata_ready.get(word) else { return Ok(()) };
        if ready.load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        let pages = chunk * METADATA_CHUNK..((chunk + 1) * METADATA_CHUNK).min(self.pages.len());
        let ranges = [
            address_range(&self.pages[pages.clone()]),
            address_range(self.slot_hashes.get(pages.clone()).unwrap_or_default()),
            address_range(std::slice::from_ref(ready)),
        ];
        for range in ranges {
            match advise_range(range, rustix::mm::Advice::LinuxPopulateWrite) {
                Ok(()) => {}
                // A kernel before 5.14 (a region made before the guard went on; those made after
                // were written whole): the chunk written, which may wait, as it did before.
                Err(rustix::io::Errno::INVAL) => {
                    let (first, last) = (pages.start, pages.end - 1);
                    [first, last].into_iter().for_each(|p| self.pages[p].touch());
                    [first, last].into_iter().filter_map(|p| self.slot_hashes.get(p)).for_each(crate::page::touch_word);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        ready.fetch_or(bit, Ordering::Release);
        Ok(())
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
    metadata_ready: Box<[std::sync::atomic::AtomicU64]>,
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
        // SAFETY: as above.
        let metadata_ready =
            unsafe { zeroed_slice(count.div_ceil(METADATA_CHUNK).div_ceil(64)) }.ok_or_else(too_large)?;
        Ok(Self { pages, slot_hashes, metadata_ready })
    }
}

/// Where a table lies: its first byte's address and its length in bytes.
fn address_range<T>(table: &[T]) -> (usize, usize) {
    (table.as_ptr() as usize, std::mem::size_of_val(table))
}

/// MADV_POPULATE_READ or _WRITE over `(start, len)`, widened to whole pages (whose other bytes
/// belong to the same allocator): READ maps the page tables, pages nobody wrote becoming the
/// shared zero page (no memory); WRITE makes each page writable memory, failing with ENOMEM
/// rather than waiting where the cgroup is full. Both fail with EINVAL before Linux 5.14.
fn advise_range((start, len): (usize, usize), advice: rustix::mm::Advice) -> Result<(), rustix::io::Errno> {
    if len == 0 {
        return Ok(());
    }
    let first = start & !(PAGE_SIZE - 1);
    let end = (start + len).next_multiple_of(PAGE_SIZE);
    // SAFETY: the range covers memory of this process's allocator (a table of the region, and
    // the rest of its first and last pages), mapped readable and writable; populating faults
    // pages in and changes no byte of them.
    unsafe { rustix::mm::madvise(first as *mut _, end - first, advice) }
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
