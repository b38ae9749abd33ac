//! Giving pages of a live region back, as MADV_DONTNEED does for anonymous memory: afterwards
//! they read as zeros, hold no memory and no slot. Programs do this to memory they no longer
//! need (allocators trimming, a partial munmap); without the engine knowing, its state would
//! say "resident" for pages the kernel has dropped.

use tiermem_sys::{Error, Result, PAGE_SIZE};

use crate::engine::{Region, Shared};
use crate::io::reap_background;
use crate::page::{Kind, LockedPage, PageState};
use crate::policy::PageId;

impl Region {
    /// `[offset, offset + len)` (page-aligned, inside the region) is about to be replaced by a
    /// mapping of the program's (MAP_FIXED): from now on the engine starts no fill, prefetch or
    /// eviction there, and I/O in flight on those pages is waited for. Their contents stay
    /// until the replacement succeeds ([`Region::hand_over`]); if it fails,
    /// [`Region::cancel_hand_over`] with the parts returned here (those not foreign before).
    pub fn prepare_hand_over(&self, offset: usize, len: usize) -> Result<Vec<(usize, usize)>> {
        self.check_range(offset, len)?;
        let marked = self.inner.mapping.mark_foreign(offset, len);
        if let Err(e) = self.settle_each_page(offset, len, |_, _, _| Ok(())) {
            self.cancel_hand_over(&marked);
            return Err(e);
        }
        Ok(marked)
    }

    /// The replacement [`Region::prepare_hand_over`] made ready for failed: the parts it
    /// marked are the region's again, contents and all.
    pub fn cancel_hand_over(&self, marked: &[(usize, usize)]) {
        for &(from, to) in marked {
            self.inner.mapping.unmark_foreign(from, to - from);
        }
    }

    /// `[offset, offset + len)` belongs to another mapping now: the program mapped over it
    /// (after [`Region::prepare_hand_over`]), and the kernel dropped our pages there. Forget
    /// them (no madvise: the memory there is the program's); dropping the region leaves that
    /// part alone.
    pub fn hand_over(&self, offset: usize, len: usize) -> Result<()> {
        self.settle_each_page(offset, len, |shared, index, page| {
            forget_page(shared, self.inner.id(index), page);
            Ok(())
        })?;
        self.inner.mapping.hand_over(offset, len);
        self.trace_discard(offset, len);
        Ok(())
    }

    /// Tell the trace, if one is recorded, that `[offset, offset + len)` holds nothing now.
    pub(crate) fn trace_discard(&self, offset: usize, len: usize) {
        if let Some(trace) = &self.shared.trace {
            let first = self.inner.page_addr((offset / PAGE_SIZE) as u64) as usize / PAGE_SIZE;
            trace.discard(first as u64, (len / PAGE_SIZE) as u64);
        }
    }

    /// `[offset, offset + len)`, handed over before, is this region's again: the caller
    /// reserved it anew (PROT_NONE) after the program unmapped its own mapping there.
    pub fn take_back(&self, offset: usize, len: usize) {
        self.inner.mapping.take_back(offset, len);
    }

    /// `[offset, offset + len)`, handed over before, holds fresh private anonymous read-write
    /// memory the program has just mapped there (a heap grown again where it gave memory
    /// back): the region manages it again, as untouched pages. On failure it stays handed over.
    ///
    /// # Safety
    /// The range is such a mapping, made by one mmap that has just returned, not populated and
    /// not yet used: nothing else unmaps it or uses it as its own.
    pub unsafe fn adopt_back(&self, offset: usize, len: usize) -> Result<()> {
        self.check_range(offset, len)?;
        let addr = self.inner.mapping.as_ptr().wrapping_add(offset);
        // SAFETY: the range is the fresh mapping the caller hands back to the region.
        unsafe { crate::engine::register_base_pages(self.shared.uffd_of(&self.inner), addr, len)? };
        // Its pages were forgotten when it was handed over: untouched, no slot.
        self.inner.mapping.adopt_back(offset, len);
        Ok(())
    }

    /// Discard the pages of `[offset, offset + len)` (page-aligned, inside the region). Waits
    /// for I/O in flight on them; safe against concurrent faults and reclaim.
    pub fn discard(&self, offset: usize, len: usize) -> Result<()> {
        let page_addr = |index: u64| self.inner.page_addr(index);
        self.settle_each_page(offset, len, |shared, index, page| {
            if page.state().kind() == Kind::Resident {
                // SAFETY: the page is ours and locked; a racing access faults and waits.
                unsafe { tiermem_sys::mem::discard(page_addr(index), PAGE_SIZE)? };
            }
            forget_page(shared, self.inner.id(index), page);
            Ok(())
        })?;
        self.trace_discard(offset, len);
        Ok(())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        if !offset.is_multiple_of(PAGE_SIZE) || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {offset} are not page-aligned inside a region of {} bytes",
                self.len()
            )));
        }
        Ok(())
    }

    /// Lock each page of `[offset, offset + len)` (page-aligned, inside the region) once no
    /// I/O is in flight on it, and call `f` with its index, locked.
    fn settle_each_page(
        &self,
        offset: usize,
        len: usize,
        mut f: impl FnMut(&Shared, u64, &mut LockedPage<'_>) -> Result<()>,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        let shared = &*self.shared;
        let first = offset / PAGE_SIZE;
        let last = (offset + len).div_ceil(PAGE_SIZE);
        for index in first..last {
            loop {
                let regions = shared.regions();
                let cell = &self.inner.pages[index];
                let mut page = cell.lock();
                let state = page.state();
                if state.writing() || state.kind() == Kind::Incoming {
                    // Its I/O must finish first (the completion needs the page unlocked).
                    drop(page);
                    reap_background(shared, &regions);
                    drop(regions);
                    std::thread::yield_now();
                    continue;
                }
                f(shared, index as u64, &mut page)?;
                break;
            }
        }
        Ok(())
    }
}

/// Forget a locked page as MADV_DONTNEED does: no memory, no slot, zeros on the next touch. A
/// resident page's mapping must be gone already (dropped by the caller, or by the kernel).
///
/// Its replacement policy entry goes too: a list policy removes it now; a queue policy's entry
/// stays queued, marked stale on the page, and is dropped when it comes up (see
/// `reclaim::lock_victim`): left as it was, it evicted the page soon after it came back,
/// in the place of its first coming in.
pub(crate) fn forget_page(shared: &Shared, id: PageId, page: &mut LockedPage<'_>) {
    let state = page.state();
    match state.kind() {
        Kind::Resident => shared.release_resident(),
        Kind::Prefetched => shared.release_prefetched(state),
        Kind::Untouched | Kind::Evicted | Kind::Incoming => {}
    }
    if let Some(slot) = state.slot() {
        shared.slots.free(slot);
    }
    let mut stale = state.stale_entry();
    if state.in_policy() {
        if shared.replacement.one_entry_per_page() {
            shared.replacement.on_remove(id);
        } else {
            // One mark for any number of stale entries: a page given back twice before its
            // first stale entry came up keeps one unmarked, which only evicts it early (a mark
            // without an entry behind it would drop the page's live entry and never evict it).
            stale = true;
        }
    }
    page.set(PageState::UNTOUCHED.with_stale_entry(stale));
}
