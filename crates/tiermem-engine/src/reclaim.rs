//! Reclaim: choosing victims and evicting them without ever losing a write.
//!
//! Eviction of a page, under its lock:
//! - clean (came in write-protected and not written since): drop it; its slot still holds it;
//! - dirty: write-protect it (a racing write now faults and waits for the lock), copy it to a
//!   buffer, drop it, and queue the write. Until the write completes, a fault on the page is
//!   served from that buffer; the buffer is freed on completion, never waited for here.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use tiermem_device::Request;
use tiermem_sys::PAGE_SIZE;

use crate::config::IoMode;
use crate::engine::Shared;
use crate::io::{reap_background, tag, Op};
use crate::page::{Kind, PageState};
use crate::policy::{split_page_id, PageId, PageList};
use crate::region::{RegionInner, RegionTable};
use crate::stats::{Path, Stats};

/// What became of one eviction attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evict {
    Done,
    /// Not resident any more: forget it.
    Gone,
    /// Locked, pinned, or its previous write still in flight: try later.
    Busy,
}

/// Evict up to `max` pages chosen by the replacement policy. Returns how many were evicted.
pub(crate) fn evict_batch(shared: &Shared, regions: &RegionTable, max: usize, path: Path) -> usize {
    let mut victims = PageList::default();
    let is_referenced = |id: PageId| {
        let (r, i) = split_page_id(id);
        regions.get(r).and_then(|r| r.pages.get(i as usize)).is_some_and(|c| take_referenced(c))
    };
    shared.replacement.pick_victims(max, &is_referenced, &mut victims);
    let mut evicted = 0;
    for &id in victims.as_slice() {
        let started = Instant::now();
        match evict_one(shared, regions, id) {
            Evict::Done => {
                evicted += 1;
                shared.stats.record(path, started.elapsed().as_nanos() as u64);
                if path == Path::DirectReclaim {
                    Stats::add(&shared.stats.counters.direct_reclaims, 1);
                }
            }
            Evict::Gone => {}
            Evict::Busy => shared.replacement.on_insert(id),
        }
    }
    evicted
}

fn take_referenced(cell: &crate::page::PageCell) -> bool {
    let Some(mut locked) = cell.try_lock() else { return true };
    let state = locked.state();
    locked.set(state.with_referenced(false));
    state.referenced()
}

fn evict_one(shared: &Shared, regions: &RegionTable, id: PageId) -> Evict {
    let (r, index) = split_page_id(id);
    let Some(region) = regions.get(r) else { return Evict::Gone };
    let Some(cell) = region.pages.get(index as usize) else { return Evict::Gone };
    let peek = cell.peek();
    if peek.kind() != Kind::Resident {
        return Evict::Gone;
    }
    if peek.writing() || shared.is_pinned(region.page_addr(index) as usize) {
        return Evict::Busy;
    }
    // Take the buffer before the lock: nobody waits for anything while holding a page lock.
    let buf = if peek.dirty() {
        match shared.arena.alloc() {
            Some(b) => Some(b),
            None => return Evict::Busy,
        }
    } else {
        None
    };
    let Some(mut locked) = cell.try_lock() else {
        release(shared, buf);
        return Evict::Busy;
    };
    let state = locked.state();
    if state.kind() != Kind::Resident {
        release(shared, buf);
        return Evict::Gone;
    }
    if state.writing() || (state.dirty() && buf.is_none()) {
        release(shared, buf);
        return Evict::Busy;
    }
    let addr = region.page_addr(index);
    let next = if !state.dirty() {
        // SAFETY: the page belongs to a live region and is locked; its contents are in its slot
        // (or it was never written and reads as zeros).
        if unsafe { tiermem_sys::mem::discard(addr, PAGE_SIZE) }.is_err() {
            return Evict::Busy;
        }
        match state.slot() {
            Some(_) => {
                Stats::add(&shared.stats.counters.clean_drops, 1);
                state.with_kind(Kind::Evicted)
            }
            None => {
                Stats::add(&shared.stats.counters.zero_drops, 1);
                PageState::UNTOUCHED
            }
        }
    } else {
        let buf = buf.unwrap_or_default();
        match write_out(shared, region, index, state, buf) {
            Some(next) => next,
            None => {
                release(shared, Some(buf));
                return Evict::Busy;
            }
        }
    };
    if next.kind() == Kind::Resident {
        // Written out but could not be dropped: still resident, try again later.
        locked.set(next);
        return Evict::Busy;
    }
    locked.set(next.with_referenced(false));
    drop(locked);
    shared.release_resident();
    Stats::add(&shared.stats.counters.evictions, 1);
    Evict::Done
}

fn release(shared: &Shared, buf: Option<tiermem_device::BufId>) {
    if let Some(b) = buf {
        shared.arena.release(b);
    }
}

/// Protect, copy, queue the write of, and drop a dirty page (locked by the caller). `None`
/// leaves the page resident and dirty, as it was.
fn write_out(shared: &Shared, region: &RegionInner, index: u64, state: PageState, buf: tiermem_device::BufId) -> Option<PageState> {
    let addr = region.page_addr(index);
    // From here on a write to the page faults and waits for our lock.
    shared.uffd.write_protect(addr, PAGE_SIZE, true, false).ok()?;
    let unprotect = || {
        let _ = shared.uffd.write_protect(addr, PAGE_SIZE, false, false);
    };
    let copy = shared.arena.bytes_mut(buf);
    // SAFETY: the page is mapped (resident, locked) and write-protected, so its PAGE_SIZE bytes
    // are readable and stable while copied.
    copy.copy_from_slice(unsafe { std::slice::from_raw_parts(addr, PAGE_SIZE) });
    if copy.iter().all(|&b| b == 0) {
        // SAFETY: the page is locked and its contents (zeros) are known.
        if unsafe { tiermem_sys::mem::discard(addr, PAGE_SIZE) }.is_err() {
            unprotect();
            return None;
        }
        if let Some(slot) = state.slot() {
            shared.slots.free(slot);
        }
        shared.arena.release(buf);
        Stats::add(&shared.stats.counters.zero_drops, 1);
        return Some(PageState::UNTOUCHED);
    }
    let Some(slot) = state.slot().or_else(|| shared.slots.alloc()) else {
        unprotect();
        return None;
    };
    let give_back_slot = || {
        if state.slot().is_none() {
            shared.slots.free(slot);
        }
    };
    let request = Request::Write { slot, buf };
    let write_tag = tag(Op::WriteBack, region.id(index));
    {
        let mut queue = shared.queues.writeback();
        if queue.in_flight() >= shared.config.queue_depth as usize {
            // Full: take finished writes off it (processed later, outside this page's lock).
            let _ = queue.wait(1, &mut |c| shared.queues.defer(c));
        }
        shared.queues.mark_submitted(buf);
        if queue.push(request, write_tag).and_then(|()| queue.submit()).is_err() {
            drop(queue);
            give_back_slot();
            unprotect();
            return None;
        }
        if shared.config.io_mode == IoMode::PollOnly {
            // The poll-only variant waits for its own write before moving on.
            let _ = queue.wait(1, &mut |c| shared.queues.defer(c));
        }
    }
    Stats::add(&shared.stats.counters.writebacks, 1);
    // The buffer holds the page from now on; faults are served from it until the write is done.
    // SAFETY: the page is locked and its contents are saved in `buf`.
    if unsafe { tiermem_sys::mem::discard(addr, PAGE_SIZE) }.is_err() {
        // Still mapped and protected: keep it resident; the write in flight is harmless.
        unprotect();
        return Some(state.with_slot(Some(slot)).with_writing(true).with_buf(buf));
    }
    Some(state.with_kind(Kind::Evicted).with_slot(Some(slot)).with_dirty(false).with_writing(true).with_buf(buf))
}

/// Background reclaim: sleeps until residency passes the watermark, then evicts down below it.
pub(crate) fn reclaim_thread(shared: &Shared) {
    let batch = shared.config.reclaim_batch;
    let target = shared.watermark_pages.saturating_sub(batch as u64 / 2);
    let mut buf = [0u8; 8];
    while !shared.shutdown.load(Ordering::Acquire) {
        let mut fds = [PollFd::new(&shared.reclaim_wake, PollFlags::IN)];
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: 20_000_000 };
        let _ = poll(&mut fds, Some(&timeout));
        let _ = rustix::io::read(&shared.reclaim_wake, &mut buf);
        if shared.resident() <= shared.watermark_pages {
            continue;
        }
        Stats::add(&shared.stats.counters.reclaim_wakeups, 1);
        let regions = shared.regions();
        let mut idle_rounds = 0;
        while shared.resident() > target && !shared.shutdown.load(Ordering::Acquire) {
            if evict_batch(shared, &regions, batch, Path::Reclaim) == 0 {
                reap_background(shared, &regions);
                idle_rounds += 1;
                if idle_rounds > 100 {
                    break;
                }
                std::thread::yield_now();
            } else {
                idle_rounds = 0;
            }
        }
    }
}

/// Wait until no I/O of `region` is in flight and no thread holds one of its pages.
pub(crate) fn quiesce_region(shared: &Shared, region: &RegionInner) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let busy = region.pages.iter().any(|c| {
            let s = c.peek();
            c.is_locked() || s.writing() || s.kind() == Kind::Incoming
        });
        if !busy {
            return;
        }
        {
            let regions = shared.regions();
            reap_background(shared, &regions);
        }
        if Instant::now() > deadline {
            tracing::error!("region still has I/O in flight after 30 s; releasing it anyway");
            return;
        }
        std::thread::yield_now();
    }
}
