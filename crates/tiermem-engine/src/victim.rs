//! The victim tier: evicted pages kept a while in DRAM, unmapped (VMS's segmented FIFO).
//!
//! User space sees no accessed bits, so replacement orders pages by when they came in and by
//! the faults they take. Here a page leaving the budget keeps a copy of itself in an I/O buffer
//! (the prefetch cache's `Prefetched` kind, with the victim bit) for as long as the tier has
//! room; a fault on it maps the buffer back (a copy, no device read) and is a use the
//! replacement policy sees (a short refault). The oldest copy leaves when the tier is full; its
//! slot holds the same data, so leaving costs nothing. Written pages enter when their
//! write-back completes, clean ones at eviction: copied from the staging area (async write
//! protection) or from the protected page before it is dropped (sync).
//!
//! The buffers are part of the arena, charged to the process whether used or not: under
//! `tiermem run` in a cgroup they come out of the budget as unmanaged memory, so the tier
//! trades mapped pages for cheap refaults, never more memory for less paging.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

use tiermem_device::BufId;

use crate::engine::Shared;
use crate::page::Kind;
use crate::policy::{split_page_id, PageId};
use crate::region::RegionTable;
use crate::stats::Stats;

/// Oldest first: the pages that entered the tier, with the buffer each entered with. Entries go
/// stale when their page is faulted back or dropped; leaving checks the page's state.
#[derive(Debug)]
pub(crate) struct VictimTier {
    capacity: usize,
    /// Most entries `order` holds: the live ones and as many stale ones.
    queue_max: usize,
    /// Pages in the tier now (state prefetched with the victim bit). Signed: a page can be
    /// faulted back (and counted out) between its entry and the caller's [`Self::entered`].
    held: AtomicI64,
    order: Mutex<VecDeque<(PageId, BufId)>>,
}

/// Callers of [`VictimTier::entered`] at one time the queue's capacity allows for beyond its
/// bound: the completion thread, the reclaim thread and faulting threads reclaiming directly.
const CONCURRENT_ENTRIES: usize = 64;

impl VictimTier {
    /// A tier of at most `capacity` pages (0: none).
    pub(crate) fn new(capacity: usize) -> Self {
        // Stale entries stay until they reach the front: room for as many again, so the queue
        // never grows (growing allocates, which the SIGBUS handler and, under the OOM guard,
        // the engine's threads must not).
        let queue_max = if capacity == 0 { 0 } else { 2 * capacity + 1 };
        // Threads that entered a page at the same moment may each push one past `queue_max`
        // (a page tried and put back as well): room for that many too.
        let room = if capacity == 0 { 0 } else { queue_max + CONCURRENT_ENTRIES };
        Self { capacity, queue_max, held: AtomicI64::new(0), order: Mutex::new(VecDeque::with_capacity(room)) }
    }

    /// Whether evicted pages are kept at all.
    pub(crate) fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// Pages in the tier now.
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed).max(0) as u64
    }

    /// Page `id` has just entered the tier holding `buf` (its state set and unlocked by the
    /// caller). The oldest pages leave while the tier is over its capacity.
    pub(crate) fn entered(&self, shared: &Shared, regions: &RegionTable, id: PageId, buf: BufId) {
        self.held.fetch_add(1, Ordering::Relaxed);
        Stats::add(&shared.stats.counters.victim_kept, 1);
        let lock = || self.order.lock().unwrap_or_else(|e| e.into_inner());
        // Checked and pushed under one lock, so two callers cannot both find room for one.
        let oldest = {
            let mut order = lock();
            // Full: mostly stale entries, then: the oldest goes whatever it is (a page still
            // held with it keeps its buffer until it is faulted back or its region goes).
            let oldest = if order.len() >= self.queue_max { order.pop_front() } else { None };
            order.push_back((id, buf));
            oldest
        };
        // As below, a page locked by someone else goes to the back (forgotten, its buffer
        // stayed taken and counted in the tier for good).
        if let Some((old, b)) = oldest {
            if !self.leave(shared, regions, old, b) {
                lock().push_back((old, b));
            }
        }
        // Bounded: a page locked by someone else goes to the back and is tried again later.
        for _ in 0..self.queue_max {
            if self.held.load(Ordering::Relaxed) <= self.capacity as i64 {
                break;
            }
            let Some((old, b)) = lock().pop_front() else { break };
            if !self.leave(shared, regions, old, b) {
                lock().push_back((old, b));
            }
        }
    }

    /// A page of the tier was mapped again, dropped or forgotten, and its buffer given back.
    pub(crate) fn left(&self) {
        self.held.fetch_sub(1, Ordering::Relaxed);
    }

    /// Page `id`, if it is still in the tier with `buf`, leaves it: evicted to its slot, which
    /// holds the same data. False if the page is locked by someone else (never waited for: the
    /// caller may hold page locks of its own).
    fn leave(&self, shared: &Shared, regions: &RegionTable, id: PageId, buf: BufId) -> bool {
        let (r, index) = split_page_id(id);
        let Some(cell) = regions.get(r).and_then(|region| region.pages.get(index as usize)) else { return true };
        if !is_held(cell.peek(), buf) {
            return true;
        }
        let Some(mut locked) = cell.try_lock() else { return false };
        let state = locked.state();
        if !is_held(state, buf) {
            return true;
        }
        locked.set(state.with_kind(Kind::Evicted));
        drop(locked);
        shared.release_prefetched(state);
        Stats::add(&shared.stats.counters.victim_dropped, 1);
        true
    }
}

fn is_held(state: crate::page::PageState, buf: BufId) -> bool {
    state.kind() == Kind::Prefetched && state.victim() && state.buf() == buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_of_no_pages_is_off_and_holds_nothing() {
        let tier = VictimTier::new(0);
        assert!(!tier.enabled());
        assert_eq!(tier.held(), 0);
        assert!(VictimTier::new(3).enabled());
        assert_eq!(VictimTier::new(3).queue_max, 7);
    }

    #[test]
    fn a_page_counted_out_before_it_was_counted_in_leaves_the_count_at_zero() {
        // A fault can take a page back between its state change and the caller's `entered`.
        let tier = VictimTier::new(3);
        tier.left();
        assert_eq!(tier.held(), 0);
        tier.held.fetch_add(1, Ordering::Relaxed);
        assert_eq!(tier.held(), 0, "one out, one in");
        tier.held.fetch_add(1, Ordering::Relaxed);
        assert_eq!(tier.held(), 1);
    }
}
