//! Resolving one page fault: the Ultraswap page-in path.
//!
//! Order of work for a page that must come from the device:
//! 1. claim room under the budget (reclaiming on this thread only at the hard limit) and a
//!    staging buffer, before taking the page's lock, so no lock is held while waiting;
//! 2. push the faulting page's read on a polled lane and submit it first;
//! 3. push the prefetcher's pages on the completion-driven prefetch queue and submit;
//! 4. poll the lane until the faulting page arrives, map it (write-protected unless the access
//!    was a write), and return. Prefetched pages are mapped by whoever reaps their completions.
//!
//! Runs on a handler thread or inside a SIGBUS handler on the faulting thread, so it does not
//! allocate and takes only short locks no interrupted code can hold.

use std::sync::atomic::Ordering;
use std::time::Instant;

use rustix::io::Errno;
use tiermem_device::{BufId, Request};
use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

use crate::config::{IoMode, ReclaimMode};
use crate::engine::Shared;
use crate::io::{reap_background, reap_background_for, tag, Op};
use crate::page::{Kind, PageState};
use crate::policy::{split_page_id, FaultInfo, PageList};
use crate::region::{RegionInner, RegionTable};
use crate::stats::{IoErrorKind, Path, Stats};

/// How a fault ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The page is mapped (and any waiter woken).
    Resolved,
    /// The address is in no managed region.
    NotOurs,
    /// The page is being, or has been, mapped over or unmapped by the program: the faulting
    /// access is to be made again, and finds what is there now (or, if a MAP_FIXED failed,
    /// faults here once more).
    Retry,
    /// No room came for the page in a while (see [`ROOMLESS_ROUNDS`]), or the full cgroup
    /// refused it memory (see [`map_in_fault`]): the access is to be made again, this fault's
    /// locks let go in between.
    NoRoomYet,
    /// The device could not deliver the page.
    Failed(Errno),
}

/// Take a buffer, reaping background completions until one is free. Holds no page lock.
pub(crate) fn alloc_buffer(shared: &Shared, regions: &RegionTable) -> BufId {
    loop {
        if let Some(b) = shared.arena.alloc() {
            return b;
        }
        if reap_background(shared, regions) == 0 {
            std::thread::yield_now();
        }
    }
}

/// Claim room for one resident page; at the hard limit (or past the watermark in on-fault-path
/// mode) evict on this thread first. Holds no page lock. False, with nothing claimed, when no
/// room came for a while: the fault is to be made again (see [`ROOMLESS_ROUNDS`]).
fn reserve_room(shared: &Shared, regions: &RegionTable) -> bool {
    if shared.config.reclaim_mode == ReclaimMode::OnFaultPath && shared.resident() >= shared.watermark_pages() {
        crate::reclaim::evict_batch(shared, regions, shared.config.reclaim_batch, Path::DirectReclaim);
    }
    let mut idle = 0;
    loop {
        if shared.try_reserve_resident() {
            return true;
        }
        if crate::reclaim::evict_batch(shared, regions, 8, Path::DirectReclaim) == 0
            && reap_background(shared, regions) == 0
        {
            if idle >= ROUNDS_BEFORE_OVER_BUDGET && shared.device_refusing() {
                // Nothing can be written out: the page comes in over the budget, which is
                // better than a program that stops (reclaim brings residency back down once
                // the file system has room again).
                let resident = shared.resident.fetch_add(1, Ordering::AcqRel) + 1;
                shared.stats.observe_resident(resident);
                return true;
            }
            idle += 1;
            if idle == ROOMLESS_ROUNDS {
                return false;
            }
            std::thread::yield_now();
        } else {
            idle = 0;
        }
    }
}

/// Rounds in a row with nothing evicted and nothing completed after which a fault comes in over
/// the budget while the device's file system refuses slots (fewer could be victims merely busy).
const ROUNDS_BEFORE_OVER_BUDGET: u32 = 8;

/// Rounds in a row with nothing evicted and nothing completed after which a fault stops waiting
/// for room and is made again. It waits holding the region table's read lock; when the budget
/// is all pages of a region being dropped (which reclaim leaves alone), the drop waits for the
/// write lock to take them out and the fault for room: both waited for ever (found in review).
/// Made again, the fault lets the drop through first.
const ROOMLESS_ROUNDS: u32 = 1000;

/// Resolve a fault at `addr`. `write` says whether the access was a write; `missing` that the
/// kernel found no page there (not a write to a protected one); `lane_hint` spreads concurrent
/// faulting threads over the polled lanes; `asleep_in_kernel` that the faulting thread waits in
/// the kernel for a wake (a handler thread's fault), so a page already on its way may be left to
/// the completion that maps it.
pub(crate) fn handle_fault(
    shared: &Shared,
    addr: usize,
    write: bool,
    missing: bool,
    lane_hint: usize,
    asleep_in_kernel: bool,
) -> Outcome {
    let regions = shared.regions();
    let Some(region) = regions.find(addr) else { return Outcome::NotOurs };
    let index = region.page_index(addr);
    let offset_in_region = index as usize * PAGE_SIZE;
    if region.mapping.is_foreign(offset_in_region) {
        // Being replaced by a mapping of the program's: the access, made again, meets it. Once
        // it is in place a fault there is the program's own (a file read past its end): the
        // same page faulting again right after a retry is not ours, or it would loop forever.
        if region.mapping.is_handed_over(offset_in_region) && faulted_again_after_retry(addr) {
            return Outcome::NotOurs;
        }
        return Outcome::Retry;
    }
    if let Some(trace) = &shared.trace {
        // The virtual page number: below 2^40 (the trace format's limit) for any user address,
        // and regions stay distinct page ranges (a page id would put the region above bit 40).
        trace.record((region.page_addr(index) as usize / PAGE_SIZE) as u64, write);
    }
    // Under the OOM guard the state this fault and later reclaim write must be memory now,
    // made so without waiting for the cgroup (see `RegionInner::ready_metadata`).
    if shared.prefault_metadata.load(Ordering::Relaxed) {
        if let Err(e) = ready_metadata(shared, region, index) {
            return outcome_of_copy_error(shared, e);
        }
    }
    // Where in the page the access fell (exact for a SIGBUS; a userfaultfd message gives the
    // page): prefetchers that relate misses to one another by address use it.
    let offset = (addr % PAGE_SIZE) as u16;
    let outcome = resolve(shared, &regions, region, index, offset, write, missing, lane_hint, asleep_in_kernel);
    if matches!(outcome, Outcome::Resolved) {
        // Shown to the monitor once the page is in: a hot report it sends makes the monitor
        // thread want the page, which must find it resident (its referenced bit), not still
        // evicted and so read a second time, racing this fault.
        shared.monitor.fault(&shared.stats, region.index, index, write);
    }
    outcome
}

/// Whether this thread's last fault on a handed-over page was at the page of `addr` and was
/// retried: then this one is the program's (it is forgotten, so a third goes back to a retry).
/// A thread-local of plain data, safe in the SIGBUS handler.
fn faulted_again_after_retry(addr: usize) -> bool {
    thread_local! {
        static LAST_RETRIED: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    }
    let page = addr / PAGE_SIZE;
    LAST_RETRIED.with(|last| {
        let again = last.get() == page;
        last.set(if again { usize::MAX } else { page });
        again
    })
}

/// Bring page `index` of `region` in (or unprotect it) for [`handle_fault`].
#[allow(clippy::too_many_arguments)]
fn resolve(
    shared: &Shared,
    regions: &RegionTable,
    region: &RegionInner,
    index: u64,
    offset: u16,
    write: bool,
    missing: bool,
    lane_hint: usize,
    asleep_in_kernel: bool,
) -> Outcome {
    let cell = &region.pages[index as usize];
    let page_addr = region.page_addr(index);
    let id = region.id(index);
    let started = Instant::now();
    // What the prefetcher hears of this fault: a hit on a page already on its way, or a miss.
    let fault_info = |hit: bool| FaultInfo {
        offset,
        region: region.index,
        page: index,
        region_pages: region.page_count(),
        write,
        hit,
    };
    let mut waited_on_prefetch = false;
    // Critical reads of this fault given up on while in flight.
    let mut abandoned_reads = 0;
    loop {
        let peek = cell.peek();
        let needs_room = matches!(peek.kind(), Kind::Untouched | Kind::Evicted | Kind::Prefetched);
        if needs_room && !reserve_room(shared, regions) {
            return Outcome::NoRoomYet;
        }
        let staging = (peek.kind() == Kind::Evicted && !peek.writing()).then(|| alloc_buffer(shared, regions));
        let give_back = |reserved: bool, staging: Option<BufId>| {
            if reserved {
                shared.release_resident();
            }
            if let Some(b) = staging {
                shared.arena.release(b);
            }
        };
        let mut locked = cell.lock();
        let state = locked.state();
        // Handed over since `handle_fault` looked (this fault waited for room or a buffer in
        // between): no longer the engine's page to fill. Filled anyway, a copy into the new
        // mapping failed and, the program having touched it, the page was taken for resident
        // for good (found in review; the window is too narrow to force in a test).
        if region.mapping.is_foreign(index as usize * PAGE_SIZE) {
            drop(locked);
            give_back(needs_room, staging);
            return Outcome::Retry;
        }
        let protect = !write && shared.write_protect;
        match state.kind() {
            Kind::Resident if missing && !is_mapped(shared, page_addr) => {
                if state.writing() {
                    // A write-back of it is in flight: its completion needs the page, unlocked,
                    // and its buffer and slot as the state names them; forgotten once it is done.
                    drop(locked);
                    give_back(needs_room, staging);
                    if reap_background(shared, regions) == 0 {
                        std::thread::yield_now();
                    }
                    continue;
                }
                // Counted resident, yet the kernel has no page: the program dropped it with a
                // madvise the engine did not see. Re-fault, and lose the page as the kernel
                // would (zeros), rather than wake the thread into the same fault forever.
                give_back(needs_room, staging);
                crate::discard::forget_page(shared, id, &mut locked);
                drop(locked);
                Stats::add(&shared.stats.counters.dropped_outside, 1);
                if let Some(trace) = &shared.trace {
                    trace.discard((page_addr as usize / PAGE_SIZE) as u64, 1);
                }
            }
            Kind::Resident => {
                give_back(needs_room, staging);
                if write {
                    // Unprotect even if already dirty: a failed eviction may have left the page
                    // protected, and a write must never fault forever.
                    locked.set(state.with_dirty(true).with_referenced(true));
                    // Clearing protection also wakes a thread waiting on this write.
                    if let Err(e) = unprotect_for_write(shared, region, index) {
                        return outcome_of_copy_error(shared, e);
                    }
                    drop(locked);
                    Stats::add(&shared.stats.counters.wp_faults, 1);
                    shared.stats.record(Path::WriteProtectFault, started.elapsed().as_nanos() as u64);
                } else {
                    drop(locked);
                    // Someone else resolved it: wake a thread blocked in the kernel, if any.
                    let _ = shared.uffd_of(region).wake(page_addr, PAGE_SIZE);
                    if waited_on_prefetch {
                        Stats::add(&shared.stats.counters.prefetch_hits, 1);
                        shared.stats.record(Path::HitFault, started.elapsed().as_nanos() as u64);
                    }
                }
                if waited_on_prefetch {
                    // The program caught up with a prefetch in flight: the moment to read
                    // further ahead (a prefetch hit, as for a page found in the prefetch cache).
                    let info = fault_info(true);
                    issue_prefetches(shared, regions, region, &info, None);
                }
                return Outcome::Resolved;
            }
            Kind::Incoming if asleep_in_kernel && shared.config.defer_prefetch_hits => {
                // A prefetch of this page is in flight and its completion will map it, which
                // wakes the faulting thread (a completion that does not map it wakes it to fault
                // again): nothing to wait for here, and the CPU this handler would spin on is
                // what the completion and reclaim threads need. Read further ahead now, as the
                // program has caught up with the prefetcher.
                drop(locked);
                give_back(needs_room, staging);
                Stats::add(&shared.stats.counters.prefetch_hits, 1);
                Stats::add(&shared.stats.counters.deferred_hits, 1);
                let info = fault_info(true);
                issue_prefetches(shared, regions, region, &info, None);
                return Outcome::Resolved;
            }
            Kind::Incoming => {
                // A prefetch of this page is in flight: help complete it rather than read twice.
                drop(locked);
                give_back(needs_room, staging);
                waited_on_prefetch = true;
                if reap_background_for(shared, regions, id) == 0 {
                    std::hint::spin_loop();
                }
                continue;
            }
            Kind::Untouched if needs_room => {
                give_back(false, staging);
                let filled = zero_fill_around(shared, region, index, locked, protect);
                if let Err(e) = filled {
                    shared.release_resident();
                    return outcome_of_copy_error(shared, e);
                }
                shared.stats.record(Path::ZeroFault, started.elapsed().as_nanos() as u64);
                return Outcome::Resolved;
            }
            Kind::Prefetched if needs_room => {
                let buf = state.buf();
                if let Err(e) = map_in_fault(shared, region, page_addr, shared.arena.ptr(buf), 1, protect) {
                    give_back(true, staging);
                    return outcome_of_copy_error(shared, e);
                }
                give_back(false, staging);
                if state.victim() {
                    // Back from the victim tier: a use of a page evicted not long ago, which
                    // replacement sees as the short refault it is.
                    locked.set(state.with_kind(Kind::Resident).with_dirty(!protect).with_in_policy(true));
                    shared.replacement.on_insert(id);
                    drop(locked);
                    shared.release_prefetched(state);
                    Stats::add(&shared.stats.counters.victim_hits, 1);
                    shared.stats.record(Path::HitFault, started.elapsed().as_nanos() as u64);
                    return Outcome::Resolved;
                }
                // Its first use, not a reuse: not referenced, like the prefetched pages mapped
                // at their completion (whose first touch the engine never sees).
                locked.set(
                    state.with_kind(Kind::Resident).with_dirty(!protect).with_referenced(false).with_in_policy(true),
                );
                shared.replacement.on_insert(id);
                drop(locked);
                shared.arena.release(buf);
                Stats::add(&shared.stats.counters.prefetch_hits, 1);
                // Only prefetch samples wait in their buffers (see `prefetch_sample`).
                shared.prefetch_sample_ended(true);
                shared.stats.record(Path::HitFault, started.elapsed().as_nanos() as u64);
                let info = fault_info(true);
                issue_prefetches(shared, regions, region, &info, None);
                return Outcome::Resolved;
            }
            Kind::Evicted if needs_room && state.writing() => {
                // Its write-back is still in flight: the buffer holds the page.
                if let Err(e) = map_in_fault(shared, region, page_addr, shared.arena.ptr(state.buf()), 1, protect) {
                    give_back(true, staging);
                    return outcome_of_copy_error(shared, e);
                }
                give_back(false, staging);
                locked.set(state.with_kind(Kind::Resident).with_dirty(!protect).with_in_policy(true));
                shared.replacement.on_insert(id);
                drop(locked);
                Stats::add(&shared.stats.counters.writeback_hits, 1);
                shared.stats.record(Path::HitFault, started.elapsed().as_nanos() as u64);
                return Outcome::Resolved;
            }
            Kind::Evicted if needs_room && staging.is_some() => {
                let mut buf = staging.unwrap_or_default();
                let slot = state.slot().unwrap_or_default();
                let info = fault_info(false);
                let read = read_critical(shared, regions, region, slot, buf, &info, lane_hint);
                if let Err(CriticalReadFailed { errno: Errno::NOMEM, buffer_in_use: true }) = read {
                    // The full cgroup kept refusing the lane's submission (io_uring charges its
                    // requests there), or a wait for the read was refused memory. The read stays
                    // queued or in flight, its buffer left to it (abandoned by `read_critical`;
                    // a later reap of the lane gives it back); the page is
                    // read plainly into another, which needs no memory of the cgroup. Waiting
                    // for the submission held the region table for up to two seconds instead.
                    note_memory_refused(shared);
                    match shared.arena.alloc() {
                        Some(other) if read_again(shared, slot, other) => buf = other,
                        other => {
                            give_back(true, other);
                            return outcome_of_copy_error(shared, Errno::NOMEM);
                        }
                    }
                } else if let Err(failed) = read {
                    // (Not the device's error: a lane full of reads refused submission.)
                    if failed.errno != Errno::NOMEM {
                        shared.stats.io_error(IoErrorKind::CriticalRead, failed.errno.raw_os_error());
                    }
                    // A read the device answered with an error (not one left in flight, whose
                    // buffer is still the device's) is made again, plainly: a passing error (a
                    // cancelled or interrupted request, EAGAIN from a polled ring) must not kill
                    // a program whose page is safe on the device.
                    // A read given up on while in flight may still land in its buffer: that
                    // one is left to it (given back when its completion shows up), and the
                    // fault starts again with another, a few times (the fault used to fail,
                    // and the program with it; a lane whose waits keep failing is not waited
                    // on for ever, each time leaving a buffer behind).
                    if failed.buffer_in_use {
                        give_back(true, None);
                        if abandoned_reads < ABANDONED_READS_PER_FAULT {
                            abandoned_reads += 1;
                            continue;
                        }
                        return Outcome::Failed(failed.errno);
                    }
                    if !read_again(shared, slot, buf) {
                        give_back(true, Some(buf));
                        return Outcome::Failed(failed.errno);
                    }
                }
                if let Err(e) = map_in_fault(shared, region, page_addr, shared.arena.ptr(buf), 1, protect) {
                    give_back(true, Some(buf));
                    return outcome_of_copy_error(shared, e);
                }
                shared.arena.release(buf);
                locked.set(state.with_kind(Kind::Resident).with_dirty(!protect).with_in_policy(true));
                shared.replacement.on_insert(id);
                drop(locked);
                Stats::add(&shared.stats.counters.critical_reads, 1);
                shared.stats.record(Path::CriticalFault, started.elapsed().as_nanos() as u64);
                // Prefetches submitted with this page are often done by now: map them here
                // rather than wait for the completion thread to wake. The faulting thread is
                // already running again in handler-thread mode.
                reap_background(shared, regions);
                return Outcome::Resolved;
            }
            _ => {
                // The state changed between the peek and the lock; try again with the right
                // preparations.
                drop(locked);
                give_back(needs_room, staging);
            }
        }
    }
}

/// Unprotect page `index` (locked by the caller, already marked dirty) for a write and, under
/// sync write protection with [`crate::EngineConfig::write_fault_around`], when the program
/// writes through (a page next to this one is dirty already), the resident pages next to it in
/// its aligned block, as far as each can be locked: they are marked dirty first and stay locked
/// until the one unprotect call is done, so no eviction can see one clean while it is
/// writable, and no page-in can be unprotected by a call meant for the page before it. They are
/// dirty by presumption only (`around`): reclaim protects them again and compares their contents
/// with their slot's hash before writing one back, so a neighbour never written costs no write.
/// Scattered writes (no dirty neighbour) unprotect their page alone.
fn unprotect_for_write(shared: &Shared, region: &RegionInner, index: u64) -> Result<(), Errno> {
    let uffd = shared.uffd_of(region);
    let block = u64::from(shared.config.write_fault_around);
    let sync_wp = shared.write_protect && shared.capture_of(region).is_none();
    let dirty = |i: u64| region.pages.get(i as usize).is_some_and(|c| c.peek().dirty());
    if block <= 1 || !sync_wp || !(index.checked_sub(1).is_some_and(dirty) || dirty(index + 1)) {
        return uffd.write_protect(region.page_addr(index), PAGE_SIZE, false, false);
    }
    // Resident and not being written back (a write-back in flight ends by marking the page
    // clean, which must not happen to a page made writable here).
    let run = lock_run_around(region, index, block.min(ZERO_FILL_AROUND as u64), |i| {
        let mut page = region.pages[i as usize].try_lock()?;
        let state = page.state();
        (state.kind() == Kind::Resident && !state.writing()).then(|| {
            page.set(state.with_dirty_around());
            page
        })
    });
    // The locks are released (dropping `run`) only once the whole run is writable.
    uffd.write_protect(region.page_addr(run.lo), ((run.hi - run.lo) as usize) * PAGE_SIZE, false, false)
}

/// Whether the kernel has a page at `addr` (a failed check answers yes: the old behaviour).
fn is_mapped(shared: &Shared, addr: *mut u8) -> bool {
    shared.pagemap.as_ref().is_none_or(|p| p.is_mapped(addr as usize).unwrap_or(true))
}

/// Most pages one zero-fill maps: the untouched pages around the faulting one within its
/// aligned window of this many. 64 rather than 16 cut the first-touch faults of numpy/scikit-learn
/// programs fourfold (at 100% of their footprint, with nothing to page, intsort went 1.65x ->
/// 1.33x of its unmanaged time).
pub(crate) const ZERO_FILL_AROUND: usize = 64;
// A fault readies the per-page state of its page's chunk only: its window must lie in it.
const _: () = assert!(crate::region::METADATA_CHUNK.is_multiple_of(ZERO_FILL_AROUND));

/// Locks on a run of pages around one: slot k holds page `start + k`, the run is `lo..hi`.
struct RunAround<'a> {
    start: u64,
    lo: u64,
    hi: u64,
    locks: [Option<crate::page::LockedPage<'a>>; ZERO_FILL_AROUND],
}

/// Lock the pages next to `index` within its aligned window of `window` pages (a power of two,
/// at most [`ZERO_FILL_AROUND`]), below it then above, each side as far as `claim` takes the
/// next page. Page `index` itself is the caller's: its slot stays empty. A run stops at a page
/// the program mapped over: that page is not registered, so one call over the run would fail.
fn lock_run_around<'a>(
    region: &'a RegionInner,
    index: u64,
    window: u64,
    mut claim: impl FnMut(u64) -> Option<crate::page::LockedPage<'a>>,
) -> RunAround<'a> {
    let start = index & !(window - 1);
    let end = (start + window).min(region.page_count());
    let mut run = RunAround { start, lo: index, hi: index + 1, locks: std::array::from_fn(|_| None) };
    let mut claim = |page: u64| if region.mapping.is_foreign(page as usize * PAGE_SIZE) { None } else { claim(page) };
    while run.lo > start {
        let Some(page) = claim(run.lo - 1) else { break };
        run.lo -= 1;
        run.locks[(run.lo - start) as usize] = Some(page);
    }
    while run.hi < end {
        let Some(page) = claim(run.hi) else { break };
        run.locks[(run.hi - start) as usize] = Some(page);
        run.hi += 1;
    }
    run
}

/// Map zeros at the faulting untouched page (locked, room reserved) and at the untouched pages
/// next to it, before and after, within its aligned window of [`ZERO_FILL_AROUND`] pages, as far
/// as they can be locked and fit under the budget, with one UFFDIO_COPY. A program touching
/// fresh memory then takes one fault per window instead of one per page, as the kernel's
/// fault-around does for files, whichever way it walks: a window that only reached forward
/// left descending walks one fault per page (k-means, quick scale: 21,300 of its 23,500
/// first-touch faults were single pages, each just below the previous one).
fn zero_fill_around(
    shared: &Shared,
    region: &RegionInner,
    index: u64,
    first: crate::page::LockedPage<'_>,
    protect: bool,
) -> Result<(), Errno> {
    let mut run = lock_run_around(region, index, ZERO_FILL_AROUND as u64, |page| {
        let cell = region.pages.get(page as usize)?;
        if cell.peek().kind() != Kind::Untouched {
            return None;
        }
        let locked = cell.try_lock()?;
        (locked.state().kind() == Kind::Untouched && shared.try_reserve_background()).then_some(locked)
    });
    run.locks[(index - run.start) as usize] = Some(first);
    let len = (run.hi - run.lo) as usize;
    let copied = map_in_fault(shared, region, region.page_addr(run.lo), shared.zero_page.as_ptr(), len, protect);
    // A copy that failed part-way (refused memory for a while, a run split by the program)
    // has mapped some pages: those are resident whatever the error, or the engine would take
    // them for untouched, never evict them, and fault forever on a write to one it protected.
    let all = copied.is_ok();
    let mapped = |at: u64| all || surely_mapped(shared, region.page_addr(at));
    let result = match copied {
        // Which pages of a refused run were mapped is known through pagemap only: without it
        // the fault fails, as before refused faults were made again (made again, a page mapped
        // but taken for untouched would never be evicted).
        Err(Errno::NOMEM) if len > 1 && shared.pagemap.is_none() => Err(Errno::IO),
        _ if mapped(index) => Ok(()),
        other => other,
    };
    let mut filled = 0;
    for (k, slot) in run.locks.iter_mut().enumerate() {
        let Some(mut page) = slot.take() else { continue };
        let at = run.start + k as u64;
        if mapped(at) {
            // A stale entry of the page's earlier life stays marked (see `discard::forget_page`).
            let stale = page.state().stale_entry();
            page.set(
                PageState::UNTOUCHED
                    .with_stale_entry(stale)
                    .with_kind(Kind::Resident)
                    .with_dirty(!protect)
                    .with_in_policy(true),
            );
            shared.replacement.on_insert(region.id(at));
            drop(page);
            filled += 1;
        } else if at != index {
            // Only the extra pages' room is given back here; the caller owns the faulting one's.
            drop(page);
            shared.release_resident();
        }
    }
    Stats::add(&shared.stats.counters.zero_fills, filled);
    result
}

/// Whether the kernel has a page at `addr`, known for sure (no pagemap, or a failed read: no).
fn surely_mapped(shared: &Shared, addr: *mut u8) -> bool {
    shared.pagemap.as_ref().is_some_and(|p| p.is_mapped(addr as usize).unwrap_or(false))
}

/// Map `count` pages of `src` at `dst` with UFFDIO_COPY, retrying while the address space is
/// being changed. A copy that stops part-way goes on from where it stopped, never from the
/// start (the pages before are mapped now and would fail it with EEXIST). In a multi-page run a
/// page found already mapped is skipped: it is there, which is all the caller wants; a single
/// page reports EEXIST.
pub(crate) fn map_pages(
    shared: &Shared,
    region: &RegionInner,
    dst: *mut u8,
    src: *const u8,
    count: usize,
    write_protect: bool,
) -> Result<(), Errno> {
    map_pages_waiting(shared, region, dst, src, count, write_protect, NOMEM_RETRIES)
}

/// [`map_pages`] for a fault holding the region table's read lock: refused memory, it waits
/// only [`NOMEM_RETRIES_IN_FAULT`] times, then fails with ENOMEM, which
/// [`outcome_of_copy_error`] turns into [`Outcome::NoRoomYet`] (the access made again, the
/// table let go in between) until copies have been refused for [`NOMEM_GIVE_UP`]. Waiting the
/// whole two seconds with the table held kept reclaim from it whenever a thread waited to
/// create a region (a writer queued ahead of reclaim's read): nothing made room, and the
/// fault failed (docs/testing.md, 2026-12-07).
fn map_in_fault(
    shared: &Shared,
    region: &RegionInner,
    dst: *mut u8,
    src: *const u8,
    count: usize,
    write_protect: bool,
) -> Result<(), Errno> {
    let result = map_pages_waiting(shared, region, dst, src, count, write_protect, NOMEM_RETRIES_IN_FAULT);
    if result == Err(Errno::NOMEM) {
        note_memory_refused(shared);
    }
    result
}

/// Make the per-page state around `index` writable memory, retrying a full cgroup's refusals
/// as a refused page copy is (then ENOMEM, noted).
fn ready_metadata(shared: &Shared, region: &RegionInner, index: u64) -> Result<(), Errno> {
    let ready = retrying_refusals(shared, || region.ready_metadata(index));
    if ready == Err(Errno::NOMEM) {
        note_memory_refused(shared);
    }
    ready
}

/// Run `attempt` until the full cgroup stops refusing it memory (ENOMEM), waiting as a refused
/// page copy in a fault does: for [`NOMEM_RETRIES_IN_FAULT`] times (20 ms) with the region
/// table held; then ENOMEM.
fn retrying_refusals(shared: &Shared, mut attempt: impl FnMut() -> Result<(), Errno>) -> Result<(), Errno> {
    for waited in 0..NOMEM_RETRIES_IN_FAULT {
        match attempt() {
            Err(Errno::NOMEM) => wait_for_memory_once(shared, waited),
            other => return other,
        }
    }
    Err(Errno::NOMEM)
}

/// Note that a fault was refused memory now, for [`outcome_of_copy_error`]'s count of how long
/// refusals have lasted. Refusals less than REFUSALS_APART apart are one spell; a spell is never
/// ended by another thread's success, only by a pause in the refusals (a clock cleared by any
/// copy let through made a fault refused between another's copies fail at once; one cleared by
/// faults' copies only was left running when the page came by a prefetch).
fn note_memory_refused(shared: &Shared) {
    let now = crate::engine::monotonic_ms().max(1);
    let last = shared.memory_refused_last_ms.swap(now, Ordering::AcqRel);
    if last == 0 || now.saturating_sub(last) > REFUSALS_APART.as_millis() as u64 {
        shared.memory_refused_since_ms.store(now, Ordering::Release);
    }
}

/// Refusals of memory further apart than this are separate spells (see [`map_in_fault`]);
/// a fault refused again comes back within its 20 ms wait and a re-fault.
const REFUSALS_APART: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits, 0.5 ms apart, of a fault refused memory before it lets the region table go: 20 ms.
const NOMEM_RETRIES_IN_FAULT: u32 = 40;

/// How long faults may go on being refused their pages before one fails: two seconds, as when
/// a fault waited them out itself.
const NOMEM_GIVE_UP: std::time::Duration = std::time::Duration::from_secs(2);

/// [`map_pages`], waiting for memory up to `memory_retries` times (0.5 ms apart) before failing
/// with ENOMEM when the full cgroup refuses a page.
fn map_pages_waiting(
    shared: &Shared,
    region: &RegionInner,
    dst: *mut u8,
    src: *const u8,
    count: usize,
    write_protect: bool,
    memory_retries: u32,
) -> Result<(), Errno> {
    let mut done = 0;
    let mut memory_waits = 0;
    while done < count {
        let offset = done * PAGE_SIZE;
        // SAFETY: src is readable for `count` pages (an arena buffer, or the zero area of
        // ZERO_FILL_AROUND pages); dst..dst+count pages lie in a registered region and are all
        // locked by the caller.
        let result = unsafe {
            shared.uffd_of(region).copy(
                dst.wrapping_add(offset),
                src.wrapping_add(offset),
                (count - done) * PAGE_SIZE,
                write_protect,
                false,
            )
        };
        let (copied, err) = match result {
            Ok(()) => return Ok(()),
            Err(failure) => failure,
        };
        done += copied / PAGE_SIZE;
        match err {
            Errno::AGAIN => std::hint::spin_loop(),
            Errno::EXIST if count == 1 => return Err(err),
            Errno::EXIST => done += 1,
            // The cgroup is full and its OOM killer is off (the preload's OOM guard): the kernel
            // refuses the page instead of killing. Shrink the budget a step once so reclaim
            // makes room (the cgroup watch sees the count and cuts more if needed), then keep
            // reclaim awake and try again for a while before giving up.
            Errno::NOMEM if memory_waits < memory_retries => {
                wait_for_memory_once(shared, memory_waits);
                memory_waits += 1;
            }
            // The run crosses a VMA boundary (the program split the region with madvise or
            // mprotect), which one copy cannot: go page by page.
            Errno::NOENT if count - done > 1 => {
                for i in done..count {
                    let offset = i * PAGE_SIZE;
                    match map_pages_waiting(
                        shared,
                        region,
                        dst.wrapping_add(offset),
                        src.wrapping_add(offset),
                        1,
                        write_protect,
                        memory_retries,
                    ) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(e),
                    }
                }
                return Ok(());
            }
            other => return Err(other),
        }
    }
    Ok(())
}

/// How many times a copy refused for want of memory is retried, 0.5 ms apart (two seconds).
const NOMEM_RETRIES: u32 = 4000;

/// What a failed UFFDIO_COPY or UFFDIO_WRITEPROTECT of the faulting page means for the fault.
/// EEXIST: the page is there already. ENOENT: no registered mapping holds the page any more (for
/// one page it means nothing else); the program mapped over it or unmapped it after the fault was
/// read, which in handler-thread mode can be a fault message read after a prefetch completion had
/// already mapped the page and woken the thread. The access, made again, meets what is there now.
/// ENOMEM: the full cgroup refused the page (see [`map_in_fault`]); the access is made again
/// until faults have been refused for [`NOMEM_GIVE_UP`].
fn outcome_of_copy_error(shared: &Shared, e: Errno) -> Outcome {
    match e {
        Errno::EXIST => Outcome::Resolved,
        Errno::NOENT => Outcome::Retry,
        Errno::NOMEM => {
            let since = shared.memory_refused_since_ms.load(Ordering::Acquire);
            if crate::engine::monotonic_ms().saturating_sub(since) < NOMEM_GIVE_UP.as_millis() as u64 {
                Outcome::NoRoomYet
            } else {
                Outcome::Failed(e)
            }
        }
        other => Outcome::Failed(other),
    }
}

/// Submit what `queue` holds. The kernel refuses a submission while the memory cgroup is full
/// (io_uring charges its request memory there), so a refusal is treated as a refused page copy
/// in a fault is: counted as a wait for memory (which the cgroup watch answers), the budget shed
/// a step, reclaim kept awake, and tried again for [`NOMEM_RETRIES_IN_FAULT`] times (20 ms) with
/// the region table held; then ENOMEM (the fault notes the refusal: see [`note_memory_refused`]).
fn submit_retrying(shared: &Shared, queue: &mut dyn tiermem_device::IoQueue) -> Result<(), Errno> {
    retrying_refusals(shared, || queue.submit().map(drop).map_err(|_| Errno::NOMEM))
}

/// Waits of a thread still refused memory between two counted ones: 20 ms.
const NOMEM_WAITS_PER_COUNT: u32 = 40;

/// One wait of a thread the full cgroup refused memory (`earlier` waits before it): the first,
/// and every 20 ms one again, is counted (the cgroup watch answers the count) and sheds the
/// budget a step so reclaim makes room; the others keep reclaim awake. Then 0.5 ms before the
/// caller tries again. Counted once only, a copy refused with the budget above what was
/// resident stayed refused: the watch had answered the first count by freeing its ballast, the
/// kernel's page cache took that room, and reclaim, under its budget, had nothing to do for
/// the two seconds before the fault failed (a 6.2 MiB cgroup, 1 MiB resident of a 1.3 MiB
/// budget).
fn wait_for_memory_once(shared: &Shared, earlier: u32) {
    if earlier.is_multiple_of(NOMEM_WAITS_PER_COUNT) {
        Stats::add(&shared.stats.counters.memory_waits, 1);
        shared.shed(shared.limit_pages() / 32);
    } else {
        shared.wake_reclaim();
    }
    std::thread::sleep(std::time::Duration::from_micros(500));
}

/// Read the faulting page first on a lane, then issue prefetches, then poll for the page.
#[allow(clippy::too_many_arguments)]
fn read_critical(
    shared: &Shared,
    regions: &RegionTable,
    region: &RegionInner,
    slot: u64,
    buf: BufId,
    info: &FaultInfo,
    lane_hint: usize,
) -> Result<(), CriticalReadFailed> {
    // Named by its buffer, not its page: no other read has that buffer while this one may be
    // in flight, so a completion of an earlier read of the same page given up on (which
    // finished in its own buffer) is never taken for this one.
    let critical_tag = tag(Op::Critical, u64::from(buf));
    let mut lane = shared.queues.lane(lane_hint);
    let submitted = Instant::now();
    let read = Request::Read { slot, buf };
    if lane.push(read, critical_tag).is_err() {
        // Full: of reads given up on, left there by faults whose submission the full cgroup
        // refused (outside poll-only mode only a fault submits or reaps a lane). Reaping submits
        // them and collects what is done; without it no later fault could push, so none would
        // ever submit the lane again.
        lane.reap(usize::MAX, &mut |c| {
            if crate::io::is_critical(c.tag) {
                shared.queues.finish_abandoned(&shared.arena, c.tag);
            } else {
                shared.queues.defer(c);
            }
        });
        // Still full: its reads are still refused submission. The buffer is the caller's, to
        // read into plainly.
        lane.push(read, critical_tag).map_err(|_| CriticalReadFailed { errno: Errno::NOMEM, buffer_in_use: false })?;
    }
    // From here the request is the device's: pushed, it goes out with the lane's next submit
    // and lands in `buf` whenever that completes, so on any failure the buffer stays the read's.
    let lost = |errno| CriticalReadFailed { errno, buffer_in_use: true };
    if let Err(errno) = submit_retrying(shared, &mut **lane) {
        // Left to the queued request before the lane is let go: another thread may take the
        // lane, submit and reap the read at once, and would not know its buffer otherwise.
        shared.queues.abandon(buf);
        return Err(lost(errno));
    }
    let poll_only = shared.config.io_mode == IoMode::PollOnly;
    let requests = issue_prefetches(shared, regions, region, info, poll_only.then_some(&mut **lane));
    let on_lane = if poll_only { requests } else { 0 };
    // The critical read's result once it is back: 0, or its errno.
    let mut critical = None;
    let mut lane_prefetches = [crate::io::Done::NONE; PageList::CAPACITY];
    let mut n = 0;
    let want = 1 + on_lane;
    let mut seen = 0;
    // Why the wait itself failed, if it did.
    let mut wait_error = None;
    // Until the critical read is back, whatever the count says: completions of an earlier
    // fault's prefetches left on the lane are counted too, and leaving without it would give
    // its buffer back (read again) while the device may still write into it.
    while critical.is_none() || seen < want {
        let mut stale = 0;
        let waited = lane.wait(want.saturating_sub(seen).max(1), &mut |c| {
            if c.tag == critical_tag {
                critical = Some(crate::io::Done::of(&c).errno);
                shared.stats.record(Path::CriticalRead, submitted.elapsed().as_nanos() as u64);
            } else if crate::io::is_critical(c.tag) {
                // An earlier fault's critical read on this lane, given up on (below): not
                // one this wait is for. The buffer it was left is free now.
                shared.queues.finish_abandoned(&shared.arena, c.tag);
                stale += 1;
            } else if n < lane_prefetches.len() {
                lane_prefetches[n] = crate::io::Done::of(&c);
                n += 1;
            } else {
                // More than fit here (an earlier fault's left on the lane too): processed later,
                // not dropped (a dropped one left its page incoming and its buffer taken).
                shared.queues.defer(c);
            }
        });
        match waited {
            Ok(got) => seen += got - stale,
            Err(e) => {
                wait_error = Some(crate::stats::errno_of(&e));
                break;
            }
        }
    }
    if critical.is_none() {
        // Given up on while it may be in flight: its buffer is left to it, noted before the
        // lane is let go (see the submission above).
        shared.queues.abandon(buf);
    }
    drop(lane);
    // Prefetches completed on the lane are installed even when the wait then failed: left
    // unprocessed, their pages would stay incoming, and a fault on one wait for ever.
    if n > 0 {
        crate::io::process_all(shared, regions, &lane_prefetches[..n]);
    }
    match critical {
        // Completed (maybe before a failed wait): the buffer is the caller's again.
        Some(0) => Ok(()),
        Some(errno) => Err(CriticalReadFailed { errno: Errno::from_raw_os_error(errno), buffer_in_use: false }),
        // Not seen to complete, so the wait failed: it may still be in flight.
        None => Err(CriticalReadFailed {
            errno: Errno::from_raw_os_error(wait_error.unwrap_or(libc::EIO)),
            buffer_in_use: true,
        }),
    }
}

/// Read `slot` into `buf` with a plain blocking read, after the device's queue failed the
/// critical read: a few tries (an interrupted or refused call is tried again). Whether it
/// succeeded.
fn read_again(shared: &Shared, slot: u64, buf: BufId) -> bool {
    (0..3).any(|_| shared.device.read_slot_blocking(slot, shared.arena.bytes_mut(buf)).is_ok())
}

/// A critical read that failed; `buffer_in_use` when the request may still be queued or in
/// flight, so its buffer must not be given back: it is left to the read ([`Queues::abandon`],
/// done by `read_critical` while it holds the lane), given back when its completion is seen
/// (reused before, the device could write into someone else's page).
///
/// [`Queues::abandon`]: crate::io::Queues::abandon
#[derive(Debug, Clone, Copy)]
struct CriticalReadFailed {
    errno: Errno,
    buffer_in_use: bool,
}

/// Ask the prefetcher and start reading its pages. With `lane`, the reads go there (poll-only
/// mode) and the number of requests is returned for the caller to wait on; otherwise they go on
/// the completion-driven prefetch queue.
fn issue_prefetches(
    shared: &Shared,
    regions: &RegionTable,
    region: &RegionInner,
    info: &FaultInfo,
    mut lane: Option<&mut dyn tiermem_device::IoQueue>,
) -> usize {
    if region.is_closing() {
        return 0;
    }
    let mut wanted = PageList::default();
    shared.prefetcher.on_fault(info, &mut wanted);
    shared.govern_prefetches(&mut wanted);
    if !shared.prefetcher.spans_regions() {
        return read_ahead(shared, region, wanted.as_slice(), lane).requests;
    }
    // Page ids of any region: each run of one region's pages is read as a list of its own.
    let mut requests = 0;
    let mut rest = wanted.as_slice();
    while let Some(&first) = rest.first() {
        let (index, _) = split_page_id(first);
        let len = rest.iter().position(|&id| split_page_id(id).0 != index).unwrap_or(rest.len());
        let mut pages = PageList::default();
        rest[..len].iter().for_each(|&id| {
            pages.push(split_page_id(id).1);
        });
        rest = &rest[len..];
        match regions.get(index) {
            Some(r) if !r.is_closing() => {
                // A reborrow for this call (the trait object's lifetime shortened with it).
                let this_lane: Option<&mut dyn tiermem_device::IoQueue> = match lane {
                    Some(ref mut q) => Some(&mut **q),
                    None => None,
                };
                requests += read_ahead(shared, r, pages.as_slice(), this_lane).requests;
            }
            _ => {}
        }
    }
    requests
}

/// What [`read_ahead`] queued.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ReadAhead {
    /// Read requests queued (a run of pages is one).
    pub(crate) requests: usize,
    /// Pages they read.
    pub(crate) pages: usize,
    /// Leading pages of the list dealt with (read, or skipped as not evicted or busy); the rest
    /// found no room, buffer or queue slot.
    pub(crate) looked_at: usize,
}

/// Start reading `wanted` (pages of `region` in the prefetcher's order; those not evicted are
/// skipped) as prefetches: on `lane` if given, else on the completion-driven prefetch queue.
pub(crate) fn read_ahead(
    shared: &Shared,
    region: &RegionInner,
    wanted: &[u64],
    lane: Option<&mut dyn tiermem_device::IoQueue>,
) -> ReadAhead {
    if wanted.is_empty() {
        return ReadAhead::default();
    }
    // Leave room for the pages to land: eager install stops a reclaim batch below the limit,
    // and reading pages that will be dropped wastes the device.
    let headroom = shared.prefetch_room() as usize;
    let mut guard;
    let queue: &mut dyn tiermem_device::IoQueue = match lane {
        Some(q) => q,
        None => {
            guard = shared.queues.prefetch();
            &mut **guard
        }
    };
    let mut rest = &wanted[..wanted.len().min(headroom)];
    let mut done = ReadAhead::default();
    while !rest.is_empty() {
        let queued = queue_prefetch(shared, region, rest, queue);
        let Some((looked_at, read)) = queued else { break };
        rest = &rest[looked_at..];
        done.looked_at += looked_at;
        if read > 0 {
            done.requests += 1;
            done.pages += read;
        }
    }
    if done.requests > 0 {
        let _ = queue.submit();
        Stats::add(&shared.stats.counters.prefetch_issued, done.pages as u64);
    }
    done
}

/// Queue one read for the first of `pages` (in the prefetcher's order): with read runs on, the
/// pages after it that lie next to it in both address and slot come along in the same request,
/// as far as they can be locked. Returns how many of `pages` were looked at and how many are
/// read (0: the first was not evicted or was busy), or None when out of buffers or queue room.
fn queue_prefetch(
    shared: &Shared,
    region: &RegionInner,
    pages: &[u64],
    queue: &mut dyn tiermem_device::IoQueue,
) -> Option<(usize, usize)> {
    let readable_slot = |page: u64| {
        let state = region.pages.get(page as usize)?.peek();
        let foreign = region.mapping.is_foreign(page as usize * PAGE_SIZE);
        (state.kind() == Kind::Evicted && !state.writing() && !foreign).then(|| state.slot()).flatten()
    };
    let first = pages[0];
    let Some(first_slot) = readable_slot(first) else { return Some((1, 0)) };
    // A run steps one page and one slot per entry, each either way; found on peeked states and
    // checked again under the locks.
    let mut len = 1;
    let (mut page_step, mut slot_step) = (1i64, 1i64);
    if shared.config.read_runs && pages.len() > 1 {
        page_step = pages[1].wrapping_sub(first) as i64;
        slot_step = readable_slot(pages[1]).map_or(0, |s| s.wrapping_sub(first_slot) as i64);
        if page_step.abs() == 1 && slot_step.abs() == 1 {
            let at = |base: u64, step: i64, k: usize| base.wrapping_add_signed(step * k as i64);
            let most = pages.len().min(tiermem_device::arena::RUN_PAGES as usize);
            while len < most
                && pages[len] == at(first, page_step, len)
                && readable_slot(pages[len]) == Some(at(first_slot, slot_step, len))
            {
                len += 1;
            }
        }
    }
    let mut locked: [Option<crate::page::LockedPage<'_>>; tiermem_device::arena::RUN_PAGES as usize] =
        std::array::from_fn(|_| None);
    let mut got = 0;
    for (k, &page) in pages[..len].iter().enumerate() {
        let Some(page_lock) = region.pages[page as usize].try_lock() else { break };
        let state = page_lock.state();
        let slot = first_slot.wrapping_add_signed(slot_step * k as i64);
        if state.kind() != Kind::Evicted || state.writing() || state.slot() != Some(slot) {
            break;
        }
        locked[k] = Some(page_lock);
        got += 1;
    }
    if got == 0 {
        return Some((1, 0));
    }
    let run = if got > 1 { shared.arena.alloc_run(got as u32) } else { None };
    let Some(bufs) = run else {
        // The first page alone, in a single buffer.
        let mut page_lock = locked[0].take()?;
        let buf = shared.arena.alloc()?;
        let state = page_lock.state();
        if queue.push(Request::Read { slot: first_slot, buf }, tag(Op::Prefetch, region.id(first))).is_err() {
            shared.arena.release(buf);
            return None;
        }
        shared.queues.mark_submitted(buf);
        shared.prefetches_in_flight.fetch_add(1, Ordering::Relaxed);
        page_lock.set(state.with_kind(Kind::Incoming).with_buf(buf));
        return Some((1, 1));
    };
    // Buffers follow the slots upwards: with slots descending, the last page locked comes first.
    let n = got as u32;
    let buf_of = |k: usize| if slot_step > 0 { bufs + k as u32 } else { bufs + n - 1 - k as u32 };
    let lowest_slot = if slot_step > 0 { first_slot } else { first_slot - (n as u64 - 1) };
    let first_buf_page = pages[if slot_step > 0 { 0 } else { got - 1 }];
    let tag = shared.queues.note_run(
        &shared.arena,
        Op::ReadRun,
        bufs,
        region.id(first_buf_page),
        n,
        page_step * slot_step < 0,
    );
    if queue.push(Request::ReadRun { slot: lowest_slot, buf: bufs, pages: n }, tag).is_err() {
        (0..n).for_each(|k| shared.arena.release(bufs + k));
        return None;
    }
    shared.prefetches_in_flight.fetch_add(got as u64, Ordering::Relaxed);
    // The first `got` entries are all locked pages, so positions match `k`.
    for (k, page_lock) in locked.iter_mut().take(got).flatten().enumerate() {
        shared.queues.mark_submitted(buf_of(k));
        let state = page_lock.state();
        page_lock.set(state.with_kind(Kind::Incoming).with_buf(buf_of(k)));
    }
    Some((got, got))
}

/// A prefetch read finished: map the page now if there is room, else forget it (its slot still
/// holds it). Called with the page locked; returns the state to publish.
pub(crate) fn install_prefetched(shared: &Shared, region: &RegionInner, index: u64, state: PageState) -> PageState {
    let buf = state.buf();
    if !shared.try_reserve_background() {
        shared.arena.release(buf);
        Stats::add(&shared.stats.counters.prefetch_dropped, 1);
        return state.with_kind(Kind::Evicted);
    }
    let protect = shared.write_protect;
    // Not waiting for memory: a copy the full cgroup refuses fails at once with ENOMEM and the
    // page stays on the device (a program waiting for it reads it again, waiting for memory in
    // its own fault). Retrying held the completion and reclaim threads, the ones to free
    // memory, for up to two seconds each while the program waited for it (their stacks, seen in
    // a stuck run). A 16 MiB burst of unmanaged memory under a 48 MiB limit and the OOM guard
    // ended with the OOM killer in 6 of 10 runs before (handler-thread and SIGBUS modes, by
    // hand), 9 of 43 after: it still can, when the program itself waits in the kernel's reclaim
    // of its own code pages.
    let (dst, src) = (region.page_addr(index), shared.arena.ptr(buf));
    match map_pages_waiting(shared, region, dst, src, 1, protect, 0) {
        Ok(()) | Err(Errno::EXIST) => {
            shared.arena.release(buf);
            shared.replacement.on_insert(region.id(index));
            Stats::add(&shared.stats.counters.prefetch_installed, 1);
            state.with_kind(Kind::Resident).with_dirty(!protect).with_in_policy(true)
        }
        Err(_) => {
            shared.release_resident();
            shared.arena.release(buf);
            Stats::add(&shared.stats.counters.prefetch_dropped, 1);
            state.with_kind(Kind::Evicted)
        }
    }
}

/// A write-back failed. The buffer (still owned by the caller) holds the only copy: if the page
/// is not resident, map it back, dirty; in every case free the slot. Returns the new state.
pub(crate) fn recover_failed_writeback(
    shared: &Shared,
    region: &RegionInner,
    index: u64,
    state: PageState,
) -> PageState {
    // The slot goes back: no page names it any more (kept, it was lost for good, and a device
    // that kept failing writes ran out of slots; a bad one is tried again by a later write,
    // which fails and comes back here, never read before a write succeeded).
    if let Some(slot) = state.slot() {
        shared.slots.free(slot);
    }
    let state = state.with_writing(false).with_slot(None).with_dirty(true);
    if state.kind() == Kind::Resident {
        return state;
    }
    // Over the budget by one page for a moment is better than losing data.
    shared.resident.fetch_add(1, Ordering::AcqRel);
    match map_pages(shared, region, region.page_addr(index), shared.arena.ptr(state.buf()), 1, false) {
        Ok(()) | Err(Errno::EXIST) => {
            shared.replacement.on_insert(region.id(index));
            state.with_kind(Kind::Resident).with_in_policy(true)
        }
        Err(e) => {
            // Nothing left to try: say so loudly rather than return wrong data later.
            let mut code = [0u8; 20];
            let errno = tiermem_sys::messages::decimal(i64::from(e.raw_os_error()), &mut code);
            tiermem_sys::messages::fatal(&[
                "tiermem: fatal: a write-back failed and its page could not be mapped back (errno ",
                errno,
                ")",
            ]);
        }
    }
}

/// Times one fault starts again after a critical read given up on while in flight.
const ABANDONED_READS_PER_FAULT: u32 = 3;

/// Pages of the budget pins never take, for the faults that bring pinned pages in.
const PIN_HEADROOM_PAGES: u64 = 16;

/// Pages held resident for a system call (see [`crate::Engine::prepare_kernel_access`]).
#[derive(Debug)]
pub struct PinGuard {
    shared: std::sync::Arc<Shared>,
    range: (usize, usize),
}

pub(crate) fn pin_range(shared: &std::sync::Arc<Shared>, addr: usize, len: usize, write: bool) -> Result<PinGuard> {
    let start = addr & !(PAGE_SIZE - 1);
    let end = addr
        .checked_add(len)
        .and_then(|last| last.checked_next_multiple_of(PAGE_SIZE))
        .ok_or_else(|| Error::invalid(format!("{len} bytes at {addr:#x} run past the end of the address space")))?;
    let pages = ((end - start) / PAGE_SIZE) as u64;
    if pages * 2 > shared.limit_pages() {
        return Err(Error::invalid(format!(
            "cannot hold {pages} pages resident for a system call under a budget of {} pages",
            shared.limit_pages()
        )));
    }
    {
        let regions = shared.regions();
        if regions.find(start).is_none() || regions.find(end - 1).is_none() {
            return Err(Error::invalid(format!("range {start:#x}..{end:#x} is not inside one managed region")));
        }
    }
    {
        // Pins together leave room for the faults that bring their pages in (and everything
        // else): pinned pages cannot be evicted, and with the budget full of them a fault
        // waited for room forever (a caller holding two pins and asking for a third).
        let mut pins = shared.pins.lock().unwrap_or_else(|e| e.into_inner());
        let pinned = pages_in(&pins);
        if pinned + pages + PIN_HEADROOM_PAGES > shared.limit_pages() {
            return Err(Error::new(
                ErrorKind::Busy,
                format!(
                    "cannot hold {pages} more pages resident for a system call: {pinned} are held already, under a budget of {} pages",
                    shared.limit_pages()
                ),
            ));
        }
        pins.push((start, end));
    }
    let guard = PinGuard { shared: shared.clone(), range: (start, end) };
    for page in (start..end).step_by(PAGE_SIZE) {
        loop {
            match handle_fault(shared, page, write, false, 0, false) {
                Outcome::Resolved => {}
                Outcome::NoRoomYet => {
                    std::thread::yield_now();
                    continue;
                }
                Outcome::NotOurs | Outcome::Retry => {
                    return Err(Error::invalid(format!("address {page:#x} left its region")))
                }
                Outcome::Failed(e) => {
                    return Err(Error::os_kind(ErrorKind::Io, e.into(), format!("bringing in page {page:#x}")))
                }
            }
            // Resolved may mean "resident but clean" for a write: fault again until dirty.
            let regions = shared.regions();
            let Some(region) = regions.find(page) else { break };
            let state = region.pages[region.page_index(page) as usize].peek();
            if state.kind() == Kind::Resident && (!write || state.dirty()) {
                break;
            }
        }
    }
    Ok(guard)
}

impl Shared {
    /// Pages in pinned ranges (overlapping pins counted once each).
    pub(crate) fn pinned_pages(&self) -> u64 {
        pages_in(&self.pins.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether `addr` lies in a pinned range (a system call's buffer, or memory the program locked).
    pub(crate) fn is_pinned(&self, addr: usize) -> bool {
        let pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        pins.iter().any(|&(s, e)| addr >= s && addr < e)
    }
}

/// Pages in `pins` (overlapping pins counted once each).
fn pages_in(pins: &[(usize, usize)]) -> u64 {
    pins.iter().map(|&(s, e)| ((e - s) / PAGE_SIZE) as u64).sum()
}

impl Drop for PinGuard {
    fn drop(&mut self) {
        let mut pins = self.shared.pins.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pins.iter().position(|&r| r == self.range) {
            pins.swap_remove(i);
        }
    }
}
