//! Giving pages of a live region back, as MADV_DONTNEED does for anonymous memory: afterwards
//! they read as zeros, hold no memory and no slot. Programs do this to memory they no longer
//! need (allocators trimming, a partial munmap); without the engine knowing, its state would
//! say "resident" for pages the kernel has dropped.

use tiermem_sys::{Error, Result, PAGE_SIZE};

use crate::engine::{Region, Shared};
use crate::io::reap_background;
use crate::page::{Kind, LockedPage, PageState};

impl Region {
    /// `[offset, offset + len)` (page-aligned, inside the region) is about to be replaced by a
    /// mapping of the program's (MAP_FIXED): from now on the engine fills no page there on its
    /// own, and the pages are given up, as by MADV_DONTNEED. Then the caller replaces them and
    /// calls [`Region::hand_over`], or [`Region::cancel_hand_over`] if that failed.
    pub fn prepare_hand_over(&self, offset: usize, len: usize) -> Result<()> {
        self.inner.mapping.mark_foreign(offset, len);
        self.discard(offset, len)
    }

    /// The replacement [`Region::prepare_hand_over`] made ready for failed: the pages are the
    /// region's again (they read as zeros).
    pub fn cancel_hand_over(&self, offset: usize, len: usize) {
        self.inner.mapping.unmark_foreign(offset, len);
    }

    /// `[offset, offset + len)` belongs to another mapping now: the program mapped over it
    /// (after [`Region::prepare_hand_over`]). Dropping the region leaves that part alone.
    pub fn hand_over(&self, offset: usize, len: usize) {
        self.inner.mapping.hand_over(offset, len);
    }

    /// `[offset, offset + len)`, handed over before, is this region's again: the caller
    /// reserved it anew (PROT_NONE) after the program unmapped its own mapping there.
    pub fn take_back(&self, offset: usize, len: usize) {
        self.inner.mapping.take_back(offset, len);
    }

    /// Discard the pages of `[offset, offset + len)` (page-aligned, inside the region). Waits
    /// for I/O in flight on them; safe against concurrent faults and reclaim.
    pub fn discard(&self, offset: usize, len: usize) -> Result<()> {
        if !offset.is_multiple_of(PAGE_SIZE) || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(format!(
                "discard of {len} bytes at offset {offset} is not page-aligned inside a region of {} bytes",
                self.len()
            )));
        }
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
                if state.kind() == Kind::Resident {
                    // SAFETY: the page is ours and locked; a racing access faults and waits.
                    unsafe { tiermem_sys::mem::discard(self.inner.page_addr(index as u64), PAGE_SIZE)? };
                }
                forget_page(shared, &mut page);
                break;
            }
        }
        Ok(())
    }
}

/// Forget a locked page as MADV_DONTNEED does: no memory, no slot, zeros on the next touch. A
/// resident page's mapping must be gone already (dropped by the caller, or by the kernel).
pub(crate) fn forget_page(shared: &Shared, page: &mut LockedPage<'_>) {
    let state = page.state();
    match state.kind() {
        Kind::Resident => shared.release_resident(),
        Kind::Prefetched => shared.release_prefetched(state),
        Kind::Untouched | Kind::Evicted | Kind::Incoming => {}
    }
    if let Some(slot) = state.slot() {
        shared.slots.free(slot);
    }
    page.set(PageState::UNTOUCHED);
}
