//! Giving pages of a live region back, as MADV_DONTNEED does for anonymous memory: afterwards
//! they read as zeros, hold no memory and no slot. Programs do this to memory they no longer
//! need (allocators trimming, a partial munmap); without the engine knowing, its state would
//! say "resident" for pages the kernel has dropped.

use tiermem_sys::{Error, Result, PAGE_SIZE};

use crate::engine::{Region, Shared};
use crate::io::reap_background;
use crate::page::{Kind, LockedPage, PageState};

impl Region {
    /// Discard the pages of `[offset, offset + len)` (page-aligned, inside the region). Waits
    /// for I/O in flight on them; safe against concurrent faults and reclaim.
    pub fn discard(&self, offset: usize, len: usize) -> Result<()> {
        self.forget_pages(offset, len, true)
    }

    /// `[offset, offset + len)` (page-aligned, inside the region) belongs to another mapping
    /// now: the program mapped over it with MAP_FIXED, which replaced our pages there. Forget
    /// them (no madvise: the memory there is the program's) and leave that part alone when the
    /// region goes.
    pub fn hand_over(&self, offset: usize, len: usize) -> Result<()> {
        self.forget_pages(offset, len, false)?;
        self.inner.mapping.hand_over(offset, len);
        Ok(())
    }

    /// `[offset, offset + len)`, handed over before, is this region's again: the caller
    /// reserved it anew (PROT_NONE) after the program unmapped its own mapping there.
    pub fn take_back(&self, offset: usize, len: usize) {
        self.inner.mapping.take_back(offset, len);
    }

    /// Forget the pages of `[offset, offset + len)`, first dropping resident ones from the
    /// mapping if `drop_resident`.
    fn forget_pages(&self, offset: usize, len: usize, drop_resident: bool) -> Result<()> {
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
                if drop_resident && state.kind() == Kind::Resident {
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
