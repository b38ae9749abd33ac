//! Freed large allocations kept for the next malloc of about the same size.
//!
//! A fresh region costs a first-touch fault per 64 pages, served by the engine (about 1.5 µs a
//! page here, against a fraction of that for the kernel's own anonymous faults), and numpy or
//! scikit-learn programs allocate and free temporaries of the same few sizes over and over: at
//! 100% of its footprint, k-means spent a fifth of its run on such faults. glibc keeps freed
//! memory in its heap for reuse; this does the same for managed regions. A kept region keeps
//! its pages as they are (resident ones stay mapped, evicted ones in their slots), which malloc
//! may hand out: its contents are unspecified. calloc and mmap, which promise zeros, never take
//! one.
//!
//! Bounded: at most [`MAX_KEPT`] regions and an eighth of the budget, oldest dropped first, and
//! only while residency is below the reclaim watermark, so kept garbage never crowds out live
//! data; a kept region's resident pages count against the budget like any others.

use std::sync::Mutex;

use tiermem_engine::{Engine, Region};
use tiermem_sys::PAGE_SIZE;

/// Regions kept at most.
const MAX_KEPT: usize = 16;
/// Kept bytes at most, as a share of the budget (1/N).
const BUDGET_SHARE: u64 = 8;

static KEPT: Mutex<Vec<Region>> = Mutex::new(Vec::new());

/// A kept region of at least `len` bytes and at most an eighth more (the smallest such), if any.
/// Pages of it evicted while it was kept become untouched: their old contents are not worth a
/// device read.
pub fn take(len: usize) -> Option<Region> {
    let region = {
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |r: &Region| r.len() >= len && r.len() - len <= len / 8;
        let best = kept.iter().enumerate().filter(|(_, r)| fits(r)).min_by_key(|(_, r)| r.len()).map(|(i, _)| i)?;
        kept.remove(best)
    };
    region.forget_evicted();
    Some(region)
}

/// Keep `region` for reuse, dropping the oldest kept ones that no longer fit the bounds (or
/// `region` itself when it alone is too large, or when memory is tight: there its resident
/// garbage would push out live pages, and dropping it frees room at once). Regions are dropped
/// after the lock is let go: dropping one waits for its I/O.
pub fn keep(engine: &Engine, region: Region) {
    let cap = engine.limit_pages().saturating_mul(PAGE_SIZE as u64) / BUDGET_SHARE;
    if region.len() as u64 > cap || engine.under_pressure() {
        drop(region);
        return;
    }
    let mut dropped = Vec::new();
    {
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        kept.push(region);
        let mut bytes: u64 = kept.iter().map(|r| r.len() as u64).sum();
        while kept.len() > MAX_KEPT || bytes > cap {
            let oldest = kept.remove(0);
            bytes -= oldest.len() as u64;
            dropped.push(oldest);
        }
    }
    drop(dropped);
}

/// Whether `addr` lies in a kept region: memory the program freed and nobody owns now.
pub fn holds(addr: usize) -> bool {
    let kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
    kept.iter().any(|r| (r.as_ptr() as usize..r.as_ptr() as usize + r.len()).contains(&addr))
}

/// Drop every kept region (before fork, so the child does not copy garbage).
/// The kept regions' lock, held by the forking thread across fork (after [`clear`]): a child
/// forked while another thread held it would wait for it forever in its next free.
pub fn lock_for_fork() -> std::sync::MutexGuard<'static, Vec<Region>> {
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn clear() {
    let all = std::mem::take(&mut *KEPT.lock().unwrap_or_else(|e| e.into_inner()));
    drop(all);
}
