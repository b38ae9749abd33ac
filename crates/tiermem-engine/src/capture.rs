//! Eviction under async write protection: taking pages out of the program's reach.
//!
//! With UFFD_FEATURE_WP_ASYNC the kernel lifts a page's write protection itself on the first
//! write, so no write faults reach the engine; but protecting a page no longer stops a writer
//! either, and the usual eviction (protect, copy, drop) could lose a write landing between the
//! copy and the drop. Here eviction instead moves the page into a staging area with UFFDIO_MOVE:
//! one atomic step after which any access to the page's address faults and waits for the
//! engine, while the moved page holds every write made before it.
//!
//! Which pages need writing comes from PAGEMAP_SCAN: a page still protected was not written
//! since it came in. A write may still land between the scan and the move, so such a page is
//! dropped without a device write only if its contents hash as what its slot holds (xxh3, set
//! whenever the slot is written); otherwise it is written like a dirty page.
//!
//! Where the kernel drops a batch of scattered pages with one TLB flush, the first areas also
//! have a [`PagePipe`]: eviction then holds the victims in the pipe by reference, drops them all
//! with one call and reads their final contents from the pipe into the area's scratch pages
//! (see [`crate::reclaim`]), instead of one UFFDIO_MOVE, and one flush, per run of contiguous
//! victims.

use std::sync::atomic::{AtomicBool, Ordering};

use tiermem_sys::mem::Mapping;
use tiermem_sys::page_pipe::PagePipe;
use tiermem_sys::pagemap::{category, PageRegion, Pagemap, ScanQuery};
use tiermem_sys::uffd::{Features, RegisterMode, Uffd};
use tiermem_sys::{Result, PAGE_SIZE};

use crate::policy::PageList;

/// Pages one staging area holds: one eviction batch at most.
pub(crate) const AREA_PAGES: usize = PageList::CAPACITY;
/// A page kept resident at each end of an area, around its staging pages: see [`Capture::new`].
const SENTINELS: usize = 1;
/// Staging areas: threads evicting at the same time (reclaim, direct reclaim by faulting
/// threads) each need one.
const AREAS: usize = 8;
/// Areas with a page pipe: the reclaim thread's and one faulting thread's at a time, the usual
/// evictors (each pipe is two descriptors in the program's table). The rest move pages.
const PIPED_AREAS: usize = 2;

/// The staging areas and the pagemap handle used for async-WP eviction.
#[derive(Debug)]
pub(crate) struct Capture {
    areas: Box<[Area]>,
    pagemap: Pagemap,
}

#[derive(Debug)]
struct Area {
    mapping: Mapping,
    busy: AtomicBool,
    held: Option<Held>,
}

/// A page pipe and the scratch pages its pages are read into.
#[derive(Debug)]
pub(crate) struct Held {
    pipe: PagePipe,
    /// AREA_PAGES pages, populated when made: reading into them never needs memory.
    scratch: Mapping,
}

/// A staging area held by one evicting thread; empty again when dropped.
#[derive(Debug)]
pub(crate) struct Staging<'a> {
    area: &'a Area,
    used_pages: usize,
}

impl Capture {
    /// Map and register the staging areas on `uffd` (UFFDIO_MOVE only moves into registered
    /// memory, with the same protection as the source, so they are registered as regions are).
    ///
    /// Eviction must not need memory: it is what makes room when the memory cgroup has none.
    /// A move into an area needs the area's anon_vma and the page tables over its pages, and
    /// the kernel charges both to the cgroup of the thread that allocates them. So each area
    /// gets them here, while there is room, by a write to a sentinel page at each end (outside
    /// the registered range), and the sentinels stay: emptying the staging pages between them
    /// (MADV_DONTNEED, which frees a page table left empty) then leaves every page table the
    /// area spans in place, since a table holding staging pages holds one sentinel or the
    /// other. Before, the first move into an area, and every move after a table was freed,
    /// allocated; under a full cgroup the reclaim thread then waited in the kernel's reclaim
    /// for memory only its own eviction could free, and the OOM guard gave up after 2 s (the
    /// OOM-guard test's rare failure, docs/running-programs.md).
    ///
    /// Page pipes (`pipes_wanted`: [`crate::EngineConfig::evict_pipe`]) only where taking a
    /// page into one cannot wait for the engine: a page that is unexpectedly missing faults
    /// inside vmsplice, which a SIGBUS-mode or user-mode-only userfaultfd fails at once (EFAULT)
    /// and a handler-thread one would hand to a thread that waits for the page lock this
    /// eviction holds.
    pub(crate) fn new(uffd: &Uffd, pipes_wanted: bool) -> Result<Self> {
        let pipes = if !pipes_wanted {
            0
        } else if uffd.features().contains(Features::SIGBUS) || !uffd.handles_kernel_faults() {
            PIPED_AREAS
        } else {
            0
        };
        let mut areas = Vec::with_capacity(AREAS);
        for k in 0..AREAS {
            let mapping = Mapping::anonymous((AREA_PAGES + 2 * SENTINELS) * PAGE_SIZE, false)?;
            // SAFETY: the range is the mapping just created and owned here.
            let _ = unsafe {
                rustix::mm::madvise(mapping.as_ptr().cast(), mapping.len(), rustix::mm::Advice::LinuxNoHugepage)
            };
            for sentinel in [0, mapping.len() - PAGE_SIZE] {
                // The offset is within the mapping (its first and last page).
                let byte = mapping.as_ptr().wrapping_add(sentinel);
                // SAFETY: a byte of the mapping just created, outside the range registered
                // below (no fault goes to the engine), that nothing else refers to.
                unsafe { byte.write_volatile(1) };
            }
            // The staging pages only: the sentinels are the engine's own memory, not managed
            // memory (a kernel's count of registered memory, as the tests take it, leaves them
            // out). Page tables do not follow the split this makes, so they still hold them.
            let staging = mapping.as_ptr().wrapping_add(SENTINELS * PAGE_SIZE);
            uffd.register(staging, AREA_PAGES * PAGE_SIZE, RegisterMode { missing: true, write_protect: true })?;
            let held = if k < pipes { Held::new() } else { None };
            areas.push(Area { mapping, busy: AtomicBool::new(false), held });
        }
        Ok(Self { areas: areas.into_boxed_slice(), pagemap: Pagemap::open_self()? })
    }

    /// Take a free staging area, waiting for one if all are in use.
    pub(crate) fn claim(&self) -> Staging<'_> {
        loop {
            for area in self.areas.iter() {
                if area.busy.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                    return Staging { area, used_pages: 0 };
                }
            }
            std::thread::yield_now();
        }
    }

    /// Mark in `written` (one entry per page from `addr`) the pages the program wrote since
    /// they came in. A failed scan marks every page written: that only costs device writes.
    pub(crate) fn find_written(&self, addr: usize, written: &mut [bool]) {
        if self.find(addr, category::WRITTEN, written).is_err() {
            written.fill(true);
        }
    }

    /// Mark in `present` the pages of `staging` (from its first page) that hold a page.
    pub(crate) fn find_present(
        &self,
        staging: &Staging<'_>,
        present: &mut [bool],
    ) -> std::result::Result<(), rustix::io::Errno> {
        self.find(staging.page(0) as usize, category::PRESENT, present)
    }

    /// Mark in `out` (one entry per page from `addr`) the pages in `wanted` categories.
    fn find(&self, addr: usize, wanted: u64, out: &mut [bool]) -> std::result::Result<(), rustix::io::Errno> {
        let end = addr + out.len() * PAGE_SIZE;
        let query = ScanQuery { required: wanted, report: wanted, ..Default::default() };
        let mut regions = [PageRegion::default(); AREA_PAGES];
        out.fill(false);
        let mut at = addr;
        while at < end {
            let (n, walk_end) = self.pagemap.scan(at, end, &query, &mut regions)?;
            for r in &regions[..n] {
                let first = (r.start as usize).saturating_sub(addr) / PAGE_SIZE;
                let last = ((r.end as usize).min(end) - addr) / PAGE_SIZE;
                out[first..last].fill(true);
            }
            if walk_end <= at {
                break;
            }
            at = walk_end;
        }
        Ok(())
    }
}

impl Held {
    /// A pipe and its scratch pages; None (tracing why) where either cannot be had.
    fn new() -> Option<Self> {
        let made =
            PagePipe::new(AREA_PAGES).and_then(|pipe| Ok((pipe, Mapping::anonymous(AREA_PAGES * PAGE_SIZE, true)?)));
        match made {
            Ok((pipe, scratch)) => Some(Self { pipe, scratch }),
            Err(e) => {
                tracing::debug!("eviction moves pages one run at a time: no page pipe ({e})");
                None
            }
        }
    }

    /// Scratch page `k`.
    pub(crate) fn scratch_page(&self, k: usize) -> *mut u8 {
        self.scratch.as_ptr().wrapping_add(k * PAGE_SIZE)
    }

    /// Take references to the pages `ranges` name (see [`PagePipe::hold`]); all or nothing:
    /// false, with the pipe empty again, where any was not taken.
    pub(crate) fn hold(&self, ranges: &[libc::iovec]) -> bool {
        let want: usize = ranges.iter().map(|r| r.iov_len).sum();
        if self.pipe.hold(ranges) == want {
            return true;
        }
        // SAFETY: the scratch pages are this area's, held by the caller, and hold nothing yet.
        let scratch = unsafe { std::slice::from_raw_parts_mut(self.scratch.as_ptr(), AREA_PAGES * PAGE_SIZE) };
        self.pipe.clear(scratch);
        false
    }

    /// Read the first `count` held pages into scratch pages 0..count. False if fewer came.
    pub(crate) fn take(&self, count: usize) -> bool {
        let mut into = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; AREA_PAGES];
        for (k, iov) in into.iter_mut().enumerate().take(count) {
            *iov = libc::iovec { iov_base: self.scratch_page(k).cast(), iov_len: PAGE_SIZE };
        }
        self.pipe.take(&into[..count]) == count * PAGE_SIZE
    }
}

impl Staging<'_> {
    /// The area's page pipe, if it has one.
    pub(crate) fn held(&self) -> Option<&Held> {
        self.area.held.as_ref()
    }

    /// Address of staging page `k` (after the first sentinel).
    pub(crate) fn page(&self, k: usize) -> *mut u8 {
        self.area.mapping.as_ptr().wrapping_add((SENTINELS + k) * PAGE_SIZE)
    }

    /// Whether `addr` is one of the staging pages (not a scratch page or an arena buffer).
    pub(crate) fn holds(&self, addr: usize) -> bool {
        (self.page(0) as usize..self.page(AREA_PAGES) as usize).contains(&addr)
    }

    /// Whether pages were moved here (its drop then empties it).
    pub(crate) fn is_used(&self) -> bool {
        self.used_pages > 0
    }

    /// Note that pages up to `k` (exclusive) may hold moved pages, to empty them on drop.
    pub(crate) fn note_used(&mut self, k: usize) {
        self.used_pages = self.used_pages.max(k);
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        if self.used_pages > 0 {
            // SAFETY: the staging pages belong to this area, which this thread holds; their
            // contents have been copied or were clean.
            let _ = unsafe { tiermem_sys::mem::discard(self.page(0), self.used_pages * PAGE_SIZE) };
        }
        self.area.busy.store(false, Ordering::Release);
    }
}

/// The hash kept per slot: what a page's contents must still hash to for it to be dropped
/// without a write.
pub(crate) fn page_hash(page: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}
