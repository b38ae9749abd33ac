//! Reclaim: choosing victims and evicting them without ever losing a write.
//!
//! Eviction of a page, under its lock:
//! - clean (came in write-protected and not written since): drop it; its slot still holds it;
//! - dirty: write-protect it (a racing write now faults and waits for the lock), copy it to a
//!   buffer, drop it, and queue the write. Until the write completes, a fault on the page is
//!   served from that buffer; the buffer is freed on completion, never waited for here.
//!
//! Under async write protection a racing write is not stopped by protection, so pages are taken
//! out with UFFDIO_MOVE first and judged afterwards (see [`crate::capture`]).

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

/// A victim locked for eviction.
struct Victim<'a> {
    id: PageId,
    region: &'a RegionInner,
    index: u64,
    page: crate::page::LockedPage<'a>,
    /// Write-back buffer, for dirty pages.
    buf: Option<tiermem_device::BufId>,
    /// Slot the write goes to, and whether it was taken for this write.
    slot: Option<(u64, bool)>,
    /// The state to publish, once decided.
    next: Option<PageState>,
    /// Where the page's contents are read instead of the page itself: the staging page it was
    /// moved to (async WP), or an arena copy of a page the program made unreadable or that
    /// UFFDIO_MOVE refused ([`copy_unreadable`], [`copy_out_protected`]).
    staged: Option<usize>,
    /// Taken from the cold list: the page's entry in the policy is still there (a cold id is a
    /// hint, not an entry), so a victim that stays is not put back into the policy, and an
    /// evicted one leaves that entry stale.
    from_cold: bool,
}

/// Evict up to `max` pages chosen by the replacement policy. Returns how many were evicted.
///
/// Victims are handled as a batch so contiguous pages share one write-protect call and one
/// MADV_DONTNEED: each of those flushes TLBs on every CPU running this process, which costs
/// more than the rest of an eviction.
pub(crate) fn evict_batch(shared: &Shared, regions: &RegionTable, max: usize, path: Path) -> usize {
    let started = Instant::now();
    let mut picked = PageList::default();
    let written = WrittenPages::new(shared);
    let is_referenced = |id: PageId| is_referenced(shared, regions, &written, id);
    let cold = take_cold(shared, regions, max, &mut picked);
    take_cleaned(shared, max, &is_referenced, &mut picked);
    if picked.len() < max {
        let mut more = PageList::default();
        shared.replacement.pick_victims(max - picked.len(), &is_referenced, &mut more);
        for &id in more.as_slice() {
            picked.push(id);
        }
    }
    // A fixed array, not a Vec: this runs inside the SIGBUS handler too, where allocating is
    // not safe.
    let mut storage: [Option<Victim<'_>>; PageList::CAPACITY] = std::array::from_fn(|_| None);
    back_ahead(shared, picked.len() as u64);
    let victims = lock_victims(shared, regions, &picked, cold, &mut storage);
    if victims.is_empty() {
        return 0;
    }
    if let Some(capture) = &shared.capture {
        if shared.threaded.is_none() {
            capture_out(shared, capture, victims);
        } else {
            // Pages move only into staging areas of their own userfaultfd: one pass per
            // userfaultfd, the other victims set aside meanwhile.
            for threaded in [false, true] {
                let mut aside: [Option<Victim<'_>>; PageList::CAPACITY] = std::array::from_fn(|_| None);
                for (k, slot) in victims.iter_mut().enumerate() {
                    if slot.as_ref().is_some_and(|v| v.region.threaded != threaded) {
                        aside[k] = slot.take();
                    }
                }
                if let Some(capture) = victims.iter().flatten().next().and_then(|v| shared.capture_of(v.region)) {
                    capture_out(shared, capture, victims);
                }
                for (k, v) in aside.into_iter().enumerate() {
                    if v.is_some() {
                        victims[k] = v;
                    }
                }
            }
        }
    } else {
        // Pages are read in place below: no protection may change until they are gone (a page
        // made unreadable meanwhile would kill this thread). A change under way: next round.
        let Ok(_no_change) = shared.protection.try_read() else {
            unlock_all(shared, victims);
            return 0;
        };
        // Write-protect the dirty pages, run by run: from here a racing write waits for our lock.
        for_each_run(
            victims,
            |v| v.buf.is_some(),
            |region, addr, len| {
                Stats::add(&shared.stats.counters.unmap_calls, 1);
                shared.uffd_of(region).write_protect(addr, len, true, false).is_ok()
            },
            |v, ok| {
                if !ok {
                    v.next = Some(v.page.state());
                }
            },
        );
        let copies = copy_unreadable(shared, victims);
        settle_unwritten_around(shared, victims, true);
        queue_writes(shared, victims, true);
        for v in victims.iter_mut().flatten().filter(|v| v.next.is_none()) {
            let state = v.page.state();
            v.next = Some(match state.slot() {
                // Clean and protected (a write would fault and wait for our lock): what its slot
                // holds.
                // SAFETY: see [`source`]: the page is mapped, locked and write-protected.
                Some(_) if shared.write_protect => clean_leaving(shared, state, unsafe { source(v) }),
                Some(_) => state.with_kind(Kind::Evicted),
                None => PageState::UNTOUCHED,
            });
        }
        // Drop every page that leaves; its data is in its slot or a write buffer.
        discard_runs(
            shared,
            victims,
            |v| v.next.is_some_and(|n| n.kind() != Kind::Resident),
            |v, ok| stay_unless_dropped(shared, v, ok),
        );
        release_copies(shared, victims, copies);
    }
    let mut evicted = 0;
    // Pages whose copy entered the victim tier, told to it once no victim is locked any more.
    let mut kept: [Option<(PageId, tiermem_device::BufId)>; PageList::CAPACITY] = [None; PageList::CAPACITY];
    for v in victims.iter_mut().filter_map(Option::take) {
        let next = v.next.unwrap_or_else(|| v.page.state());
        let mut page = v.page;
        if next.kind() == Kind::Resident {
            if next.writing() {
                page.set(next);
            } else {
                // Not evicted: undo what was done for it.
                if v.buf.is_some() {
                    if shared.capture.is_none() {
                        let _ = shared.uffd_of(v.region).write_protect(
                            v.region.page_addr(v.index),
                            PAGE_SIZE,
                            false,
                            false,
                        );
                    }
                    release(shared, v.buf);
                }
                if let Some((slot, true)) = v.slot {
                    shared.slots.free(slot);
                }
            }
            // Back to the policy before the page is unlocked (see `PageState::in_policy`).
            if !v.from_cold {
                shared.replacement.on_insert(v.id);
            }
            drop(page);
            continue;
        }
        if next.kind() == Kind::Untouched {
            // Left as zeros: the slot that held an older version is no longer needed.
            if let Some(slot) = page.state().slot() {
                shared.slots.free(slot);
            }
        }
        match (next.kind(), next.writing()) {
            (Kind::Untouched, _) => Stats::add(&shared.stats.counters.zero_drops, 1),
            (_, false) => Stats::add(&shared.stats.counters.clean_drops, 1),
            (_, true) => {}
        }
        // Its entry was the one that came up: the page is out of the policy. A list policy may
        // hold another (a page taken from the cold list keeps its list entry): taken out too,
        // or it would outlive the page. A cold victim's queue entry is still in the policy:
        // marked stale, dropped when it comes up (`lock_victim` took it only with no stale
        // mark pending).
        let stale = v.from_cold && !shared.replacement.one_entry_per_page();
        page.set(next.with_referenced(false).with_in_policy(false).with_stale_entry(stale || next.stale_entry()));
        if shared.replacement.one_entry_per_page() {
            shared.replacement.on_remove(v.id);
        }
        drop(page);
        shared.release_resident();
        if next.kind() == Kind::Prefetched {
            kept[evicted] = Some((v.id, next.buf()));
        }
        evicted += 1;
    }
    for (id, buf) in kept.into_iter().flatten() {
        shared.victims.entered(shared, regions, id, buf);
    }
    if evicted > 0 {
        Stats::add(&shared.stats.counters.evictions, evicted as u64);
        if path == Path::DirectReclaim {
            Stats::add(&shared.stats.counters.direct_reclaims, evicted as u64);
        }
        let per_page = started.elapsed().as_nanos() as u64 / evicted as u64;
        for _ in 0..evicted {
            shared.stats.record(path, per_page);
        }
    }
    evicted
}

/// The state of a clean victim leaving for its slot: in the victim tier with a copy of `bytes`
/// (what the slot holds) where the tier is on and a buffer is free, else plainly evicted.
fn clean_leaving(shared: &Shared, state: PageState, bytes: &[u8]) -> PageState {
    match shared.victims.enabled().then(|| shared.arena.alloc()).flatten() {
        Some(b) => {
            shared.arena.bytes_mut(b).copy_from_slice(bytes);
            state.in_victim_tier(b)
        }
        None => state.with_kind(Kind::Evicted),
    }
}

/// Sync WP with write fault-around: the victims about to be written that are dirty only by
/// presumption (made writable by fault-around, now protected again, so their contents are
/// stable) and whose contents still hash as what their slot holds were never written: they
/// need no write. Such a page leaves clean (`leave`) or stays resident clean and protected
/// (cleaning ahead).
fn settle_unwritten_around(shared: &Shared, victims: &mut [Option<Victim<'_>>], leave: bool) {
    for v in victims.iter_mut().flatten().filter(|v| v.buf.is_some() && v.next.is_none()) {
        let state = v.page.state();
        let Some(hash) = v.region.slot_hashes.get(v.index as usize) else { continue };
        if !state.around() || state.slot().is_none() {
            continue;
        }
        // SAFETY: see [`source`]: the page is mapped, locked and write-protected.
        let bytes = unsafe { source(v) };
        if hash.load(Ordering::Relaxed) != crate::capture::page_hash(bytes) {
            continue;
        }
        release(shared, v.buf.take());
        Stats::add(&shared.stats.counters.unwritten_around, 1);
        let clean = state.with_dirty(false);
        v.next = Some(if leave { clean_leaving(shared, clean, bytes) } else { clean });
    }
}

/// Async WP: take `victims` (all on the userfaultfd of `capture`'s staging areas) out through a
/// page pipe or with UFFDIO_MOVE, queue the writes of the written ones, and put back those that stay.
fn capture_out(shared: &Shared, capture: &crate::capture::Capture, victims: &mut [Option<Victim<'_>>]) {
    let mut staging = capture.claim();
    let mut unmoved = [None; PageList::CAPACITY];
    if !splice_out(shared, capture, &staging, victims) {
        move_out(shared, capture, &mut staging, victims, &mut unmoved);
    }
    queue_writes(shared, victims, true);
    put_back_failed(shared, &staging, victims);
    if unmoved.iter().any(Option::is_some) && shared.protection_guarded.load(Ordering::Acquire) {
        copy_out_protected(shared, victims, &unmoved);
    }
    // Dropping `staging` empties it (one MADV_DONTNEED): every page moved there is copied or
    // clean.
    if staging.is_used() {
        Stats::add(&shared.stats.counters.unmap_calls, 1);
    }
}

/// Lock the proposed victims that can be evicted now, sorted by page; busy ones go back to the
/// replacement policy. Returns the locked ones, at the front of `storage`.
fn lock_victims<'s, 'a>(
    shared: &Shared,
    regions: &'a RegionTable,
    picked: &PageList,
    cold: usize,
    storage: &'s mut [Option<Victim<'a>>; PageList::CAPACITY],
) -> &'s mut [Option<Victim<'a>>] {
    let mut n = 0;
    for (k, &id) in picked.as_slice().iter().enumerate() {
        let from_cold = k < cold;
        match lock_victim(shared, regions, id, from_cold) {
            Ok(v) => {
                storage[n] = Some(v);
                n += 1;
            }
            Err(true) if !from_cold => shared.replacement.on_insert(id),
            Err(_) => {}
        }
    }
    let victims = &mut storage[..n];
    victims.sort_by_key(|v| v.as_ref().map_or(PageId::MAX, |v| v.id));
    victims
}

/// Whether page `id` was touched since last asked (and clear that). Unknown pages: no.
///
/// Under async write protection a write to a clean resident page does not fault, so nothing
/// sets its referenced bit; the write shows in the page tables instead (`written`). Such a page
/// counts as touched once, and is marked dirty, which is what the write fault does under sync
/// protection. Without this, MLP at a fixed budget read about 400 MiB back where sync
/// protection read 363 (now 360).
fn is_referenced(shared: &Shared, regions: &RegionTable, written: &WrittenPages<'_>, id: PageId) -> bool {
    let (r, i) = split_page_id(id);
    let Some(region) = regions.get(r) else { return false };
    let Some(cell) = region.pages.get(i as usize) else { return false };
    let Some(mut locked) = cell.try_lock() else { return true };
    let state = locked.state();
    if state.stale_entry() {
        // The entry asked about may be the stale one: let it come up as a victim, where it is
        // dropped (`lock_victim`), and keep the page's referenced bit for its live entry.
        return false;
    }
    if !state.referenced()
        && state.kind() == Kind::Resident
        && !state.dirty()
        && !state.writing()
        && written.is_written(region, i)
    {
        locked.set(state.with_dirty(true));
        Stats::add(&shared.stats.counters.writes_seen_in_page_tables, 1);
        return true;
    }
    locked.set(state.with_referenced(false));
    state.referenced()
}

/// Which pages the program wrote since they were last write-protected, read from the page
/// tables (PAGEMAP_SCAN) a block of 64 pages at a time and kept for one reclaim batch: victims
/// come mostly in address order, so one scan serves many. Nothing without async protection.
struct WrittenPages<'a> {
    capture: Option<&'a crate::capture::Capture>,
    /// Recently scanned blocks: (region, block, written bits), by block number mod 4.
    blocks: [std::cell::Cell<Option<(u32, u64, u64)>>; 4],
}

impl<'a> WrittenPages<'a> {
    fn new(shared: &'a Shared) -> Self {
        Self { capture: shared.capture.as_ref(), blocks: Default::default() }
    }

    fn is_written(&self, region: &RegionInner, index: u64) -> bool {
        let Some(capture) = self.capture else { return false };
        let block = index / 64;
        let cached = &self.blocks[(block % 4) as usize];
        let bits = match cached.get() {
            Some((r, b, bits)) if r == region.index && b == block => bits,
            _ => {
                let first = block * 64;
                let n = (region.page_count() - first).min(64) as usize;
                let mut flags = [false; 64];
                capture.find_written(region.page_addr(first) as usize, &mut flags[..n]);
                let bits = flags[..n].iter().enumerate().fold(0u64, |acc, (k, &w)| acc | (u64::from(w) << k));
                cached.set(Some((region.index, block, bits)));
                bits
            }
        };
        bits >> (index % 64) & 1 == 1
    }
}

/// Move up to `max` pages from the front of the cold list to `out` (empty when called);
/// returns how many. Only pages resident since the advice (their cold hint set: an entry
/// from before an eviction or a give-back is of no use), untouched since, not locked and
/// without a stale entry pending are taken (looked at, not changed: the referenced bit belongs
/// to the page's policy entry), each once; the rest of what is popped is dropped, at most a
/// few batches' worth per call. Never waits for the list: a program thread listing cold pages
/// holds it, and in sigbus mode a fault of that same thread (in a signal handler of the
/// program's) may be the one reclaiming here.
fn take_cold(shared: &Shared, regions: &RegionTable, max: usize, out: &mut PageList) -> usize {
    if shared.cold_pages.load(Ordering::Relaxed) == 0 {
        return 0;
    }
    let mut cold = match shared.cold.try_lock() {
        Ok(cold) => cold,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return 0,
    };
    let max = max.min(PageList::CAPACITY);
    let still_cold = |id: PageId| {
        let (r, i) = split_page_id(id);
        regions.get(r).and_then(|region| region.pages.get(i as usize)).is_some_and(|cell| {
            let (state, locked) = cell.peek_with_lock();
            !locked
                && state.cold_hint()
                && !state.referenced()
                && !state.writing()
                && !state.stale_entry()
                && state.in_policy()
        })
    };
    let mut looked = 0;
    while out.len() < max && looked < 4 * PageList::CAPACITY {
        let Some(id) = cold.pop_front() else { break };
        looked += 1;
        if still_cold(id) && !out.as_slice().contains(&id) {
            out.push(id);
        }
    }
    shared.cold_pages.store(cold.len() as u64, Ordering::Relaxed);
    out.len()
}

/// Move up to `max` pages from the front of the cleaned list to `out`; a page touched since it
/// was cleaned gets a second chance instead: back to the replacement policy.
fn take_cleaned(shared: &Shared, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
    let max = max.min(PageList::CAPACITY);
    if shared.cleaned_pages.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut cleaned = shared.cleaned.lock().unwrap_or_else(|e| e.into_inner());
    while out.len() < max {
        let Some(id) = cleaned.pop_front() else { break };
        if is_referenced(id) {
            shared.replacement.on_insert(id);
        } else {
            out.push(id);
        }
    }
    shared.cleaned_pages.store(cleaned.len() as u64, Ordering::Relaxed);
}

/// Clean ahead of need: take up to `max` pages from the replacement policy, write back the ones
/// that are dirty while keeping them resident (write-protected again, so a later write is seen),
/// and put them all on the cleaned list, from which eviction takes first. Dropping them later
/// costs no write unless they are written meanwhile. Returns the pages put on the list.
pub(crate) fn clean_batch(shared: &Shared, regions: &RegionTable, max: usize) -> usize {
    // Untracked writes (dirty tracking off) would make every page dirty again at once.
    if !shared.write_protect {
        return 0;
    }
    let room = {
        let queue = shared.queues.writeback();
        (shared.config.queue_depth as usize).saturating_sub(queue.in_flight())
    };
    // Leave half the write-back queue to eviction, which cannot wait.
    let max = max.min(room / 2);
    if max == 0 {
        return 0;
    }
    let mut picked = PageList::default();
    let written = WrittenPages::new(shared);
    shared.replacement.pick_victims(max, &|id| is_referenced(shared, regions, &written, id), &mut picked);
    let mut storage: [Option<Victim<'_>>; PageList::CAPACITY] = std::array::from_fn(|_| None);
    let victims = lock_victims(shared, regions, &picked, 0, &mut storage);
    if victims.is_empty() {
        return 0;
    }
    // Which need a write: dirty, never written out (no slot), or (async WP, where writes do not
    // fault) written since they were last protected.
    let mut written = [false; PageList::CAPACITY];
    if let Some(capture) = &shared.capture {
        find_written_victims(capture, victims, &mut written);
    }
    for (k, v) in victims.iter_mut().enumerate() {
        let Some(v) = v.as_mut() else { continue };
        let state = v.page.state();
        if !(state.dirty() || state.slot().is_none() || written[k]) {
            release(shared, v.buf.take());
            v.next = Some(state);
            continue;
        }
        if v.buf.is_none() {
            v.buf = shared.arena.alloc();
        }
        if v.buf.is_none() {
            v.next = Some(state);
        }
    }
    // The pages are read in place below (see evict_batch).
    let Ok(_no_change) = shared.protection.try_read() else {
        unlock_all(shared, victims);
        return 0;
    };
    // Protect before copying: a write after this faults (sync WP) or shows as written (async
    // WP), so the copy never hides a later write.
    for_each_run(
        victims,
        |v| v.next.is_none(),
        |region, addr, len| {
            Stats::add(&shared.stats.counters.unmap_calls, 1);
            shared.uffd_of(region).write_protect(addr, len, true, false).is_ok()
        },
        |v, ok| {
            if !ok {
                release(shared, v.buf.take());
                v.next = Some(v.page.state());
            }
        },
    );
    let copies = copy_unreadable(shared, victims);
    settle_unwritten_around(shared, victims, false);
    queue_writes(shared, victims, false);
    release_copies(shared, victims, copies);
    let mut cleaned = shared.cleaned.lock().unwrap_or_else(|e| e.into_inner());
    let mut listed = 0;
    for v in victims.iter_mut().filter_map(Option::take) {
        let next = v.next.unwrap_or_else(|| v.page.state());
        if !next.writing() {
            release(shared, v.buf);
            if let Some((slot, true)) = v.slot {
                shared.slots.free(slot);
            }
        }
        let mut page = v.page;
        page.set(next);
        drop(page);
        cleaned.push_back(v.id);
        listed += 1;
    }
    shared.cleaned_pages.store(cleaned.len() as u64, Ordering::Relaxed);
    listed
}

/// Async WP: mark in `written` (by victim) the victims the program wrote since they were last
/// protected, one page-table scan per run of contiguous victims.
fn find_written_victims(
    capture: &crate::capture::Capture,
    victims: &[Option<Victim<'_>>],
    written: &mut [bool; PageList::CAPACITY],
) {
    let mut i = 0;
    while i < victims.len() {
        let j = run_end(victims, i, |_| true);
        if let Some(v) = victims[i].as_ref() {
            capture.find_written(v.region.page_addr(v.index) as usize, &mut written[i..j]);
        }
        i = j;
    }
}

/// Lock one proposed victim. `Err(true)`: busy, try later; `Err(false)`: not resident any more.
fn lock_victim<'a>(shared: &Shared, regions: &'a RegionTable, id: PageId, from_cold: bool) -> Result<Victim<'a>, bool> {
    let (r, index) = split_page_id(id);
    let region = regions.get(r).ok_or(false)?;
    if region.is_closing() {
        return Err(false);
    }
    let cell = region.pages.get(index as usize).ok_or(false)?;
    let (peek, locked) = cell.peek_with_lock();
    // An entry of a page that is not resident is dropped, unless the page has a stale entry
    // to account for (below). Dropping one never leaves a page without the entries it needs:
    // the page, not resident, needed none when this entry was counted. Not on a locked word:
    // a completion mapping the page has told the policy already (this may be that entry) and
    // publishes it resident when it unlocks.
    if peek.kind() != Kind::Resident && !peek.stale_entry() {
        return Err(locked);
    }
    // A cold id is no entry: a stale mark is not its to take, nor is a page not resident.
    if from_cold && (peek.kind() != Kind::Resident || peek.stale_entry()) {
        return Err(false);
    }
    let resident = peek.kind() == Kind::Resident;
    // A resident page the program is mapping over is about to leave the engine, and its entry
    // with it (`discard::forget_page`): until then the entry stays. (A page handed over
    // already is not resident: its stale entry is dropped below.)
    let foreign = resident && region.mapping.is_foreign(index as usize * PAGE_SIZE);
    if peek.writing() || foreign || shared.is_pinned(region.page_addr(index) as usize) {
        return Err(true);
    }
    // Take the buffer before the lock: nobody waits for anything while holding a page lock.
    let buf = if peek.dirty() && !peek.stale_entry() { Some(shared.arena.alloc().ok_or(true)?) } else { None };
    let Some(mut page) = cell.try_lock() else {
        release(shared, buf);
        return Err(true);
    };
    // Again under the lock: a hand-over marks its pages foreign before it takes and lets go of
    // each page's lock (`Region::prepare_hand_over`), and a pin is in place before the pinning
    // fault takes the lock; a reclaimer whose first look came before either and whose lock
    // after would otherwise evict a page that is the program's now (a page moved there by
    // mremap read as zeros) or that a system call is about to use (EFAULT in sigbus mode).
    if resident
        && (region.mapping.is_foreign(index as usize * PAGE_SIZE) || shared.is_pinned(region.page_addr(index) as usize))
    {
        drop(page);
        release(shared, buf);
        return Err(true);
    }
    let state = page.state();
    // Looked at again under the lock: since `take_cold` looked, the page may have left and come
    // back (its hint gone with the stay it was for) or been touched.
    if from_cold && (state.stale_entry() || !state.in_policy() || !state.cold_hint() || state.referenced()) {
        drop(page);
        release(shared, buf);
        return Err(false);
    }
    if state.stale_entry() {
        // The first of the page's entries to come up since it was given back is the stale
        // one (which one does not matter: they are alike), dropped; the page stays as it is.
        page.set(state.with_stale_entry(false));
        release(shared, buf);
        Stats::add(&shared.stats.counters.stale_entries_dropped, 1);
        return Err(false);
    }
    // A page never written out needs a new slot, which the device has just refused: left for
    // now, rather than made ready to leave and put back (`device_cannot_extend`).
    let busy = state.writing()
        || (state.dirty() && buf.is_none())
        || (state.slot().is_none() && shared.device_cannot_extend());
    if state.kind() != Kind::Resident || busy {
        drop(page);
        release(shared, buf);
        return Err(busy);
    }
    // A clean page needs no buffer (one taken on a stale peek goes back).
    let buf = if state.dirty() {
        buf
    } else {
        release(shared, buf);
        None
    };
    Ok(Victim { id, region, index, page, buf, slot: None, next: None, staged: None, from_cold })
}

/// Call `act` once per maximal run of address-contiguous victims selected by `pick` (victims
/// are sorted), then `after` on each victim of the run with its result.
fn for_each_run<'a>(
    victims: &mut [Option<Victim<'a>>],
    pick: impl Fn(&Victim<'a>) -> bool,
    mut act: impl FnMut(&RegionInner, *mut u8, usize) -> bool,
    mut after: impl FnMut(&mut Victim<'a>, bool),
) {
    let picked = |v: &Option<Victim<'a>>| v.as_ref().is_some_and(&pick);
    let mut i = 0;
    while i < victims.len() {
        if !picked(&victims[i]) {
            i += 1;
            continue;
        }
        let j = run_end(victims, i, picked);
        let first = victims[i].as_ref().map(|v| (v.region, v.region.page_addr(v.index)));
        let ok = first.is_some_and(|(region, addr)| act(region, addr, (j - i) * PAGE_SIZE));
        for v in victims[i..j].iter_mut().flatten() {
            after(v, ok);
        }
        i = j;
    }
}

/// Drop the picked victims' pages: every run in one system call (one TLB flush for the batch)
/// where the kernel allows it, else run by run. `after` learns for each page whether it left.
fn discard_runs<'a>(
    shared: &Shared,
    victims: &mut [Option<Victim<'a>>],
    pick: impl Fn(&Victim<'a>) -> bool,
    mut after: impl FnMut(&mut Victim<'a>, bool),
) {
    // At most one run per victim. A fixed array: this runs in the SIGBUS handler too.
    let mut ranges = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; PageList::CAPACITY];
    let mut count = 0;
    for_each_run(
        victims,
        &pick,
        |_, addr, len| {
            ranges[count] = libc::iovec { iov_base: addr.cast(), iov_len: len };
            count += 1;
            true
        },
        |_, _| {},
    );
    // SAFETY: every picked page is locked by us and its contents are saved.
    if unsafe { tiermem_sys::mem::discard_all(&ranges[..count]) } {
        if count > 0 {
            Stats::add(&shared.stats.counters.unmap_calls, 1);
        }
        for v in victims.iter_mut().flatten().filter(|v| pick(v)) {
            after(v, true);
        }
        return;
    }
    for_each_run(
        victims,
        pick,
        |_, addr, len| {
            Stats::add(&shared.stats.counters.unmap_calls, 1);
            // SAFETY: as above; pages already dropped by a partial batch are dropped again, harmlessly.
            unsafe { tiermem_sys::mem::discard(addr, len) }.is_ok()
        },
        after,
    );
}

/// After a drop of a leaving victim: if it failed (`dropped` false) the page is still mapped
/// and stays resident (a write in flight for it is harmless), and a copy taken for the victim
/// tier goes back.
fn stay_unless_dropped(shared: &Shared, v: &mut Victim<'_>, dropped: bool) {
    if dropped {
        return;
    }
    if let Some(n) = v.next.filter(|n| n.kind() == Kind::Prefetched) {
        shared.arena.release(n.buf());
    }
    let keep = v.page.state();
    v.next = Some(match v.buf {
        Some(b) if v.next.is_some_and(|n| n.writing()) => {
            keep.with_slot(v.slot.map(|s| s.0)).with_writing(true).with_buf(b)
        }
        _ => keep,
    });
}

/// Whether the slot of a victim in `state` already holds `bytes`, its contents: not written
/// since it came in (`written`: the kernel's written bit under async WP), not dirty, and equal
/// to the slot by hash, which covers a write between the scan and the move or copy.
fn slot_holds(v: &Victim<'_>, state: PageState, written: bool, bytes: &[u8]) -> bool {
    !written
        && !state.dirty()
        && state.slot().is_some()
        && v.region
            .slot_hashes
            .get(v.index as usize)
            .is_some_and(|h| h.load(Ordering::Relaxed) == crate::capture::page_hash(bytes))
}

/// The protection of the kernel mapping holding `addr`, if /proc/self/maps can be read.
fn page_prot(addr: usize) -> Option<i32> {
    let mut vma = [tiermem_sys::mem::Vma::default(); 1];
    match tiermem_sys::mem::vmas(addr, addr + PAGE_SIZE, &mut vma) {
        Ok(1) => Some(vma[0].prot),
        _ => None,
    }
}

/// A copy of the page at `addr` in an arena buffer of its own, read through /proc/self/mem
/// (which reads pages the program made inaccessible too); None without a buffer or on a
/// failed read.
fn copy_page(shared: &Shared, addr: usize) -> Option<tiermem_device::BufId> {
    let self_mem = shared.self_mem.as_ref()?;
    let copy = shared.arena.alloc()?;
    match rustix::io::pread(self_mem, shared.arena.bytes_mut(copy), addr as u64) {
        Ok(n) if n == PAGE_SIZE => Some(copy),
        _ => {
            shared.arena.release(copy);
            None
        }
    }
}

/// End (exclusive) of the run of address-contiguous victims, all accepted by `pick`, that starts
/// at `i` (victims are sorted).
fn run_end<'a>(victims: &[Option<Victim<'a>>], i: usize, pick: impl Fn(&Option<Victim<'a>>) -> bool) -> usize {
    let mut j = i + 1;
    while j < victims.len() && pick(&victims[j]) && contiguous(victims[j - 1].as_ref(), victims[j].as_ref()) {
        j += 1;
    }
    j
}

fn contiguous(a: Option<&Victim<'_>>, b: Option<&Victim<'_>>) -> bool {
    matches!((a, b), (Some(a), Some(b)) if a.region.index == b.region.index && b.index == a.index + 1)
}

fn release(shared: &Shared, buf: Option<tiermem_device::BufId>) {
    if let Some(b) = buf {
        shared.arena.release(b);
    }
}

/// Async WP: move every victim's page to `staging`, run by run, and decide which need a write
/// (they get a buffer and stay undecided for [`queue_writes`]) and which are clean (decided
/// here). A page that cannot be moved stays resident.
fn move_out(
    shared: &Shared,
    capture: &crate::capture::Capture,
    staging: &mut crate::capture::Staging<'_>,
    victims: &mut [Option<Victim<'_>>],
    unmoved: &mut [Option<bool>; PageList::CAPACITY],
) {
    let n = victims.len();
    let mut written = [false; PageList::CAPACITY];
    let mut reported = [false; PageList::CAPACITY];
    let mut i = 0;
    while i < n {
        let j = run_end(victims, i, |_| true);
        let Some(first) = victims[i].as_ref() else {
            i = j;
            continue;
        };
        let addr = first.region.page_addr(first.index);
        capture.find_written(addr as usize, &mut written[i..j]);
        Stats::add(&shared.stats.counters.unmap_calls, 1);
        let uffd = shared.uffd_of(first.region);
        // SAFETY: the run's pages are resident and locked by this thread, in a registered
        // region; the staging pages i..j are empty and registered on the same userfaultfd.
        let done = match unsafe { uffd.move_pages(staging.page(i), addr, (j - i) * PAGE_SIZE) } {
            Ok(bytes) | Err((bytes, _)) => bytes / PAGE_SIZE,
        };
        reported[i..i + done].fill(true);
        for (k, ok) in reported.iter_mut().enumerate().take(j).skip(i + done) {
            *ok = move_one(shared, uffd, staging.page(k), addr.wrapping_add((k - i) * PAGE_SIZE));
        }
        staging.note_used(j);
        i = j;
    }
    // What the staging area holds, not what UFFDIO_MOVE returned, says which pages left: 6.18
    // was seen to move a page and still fail the call with EEXIST (and a retry with ENOENT).
    // Trusting the error would leave such a page counted resident, unmapped, and thrown away
    // with the staging area.
    let mut moved = [false; PageList::CAPACITY];
    if capture.find_present(staging, &mut moved[..n]).is_err() {
        moved = reported;
    }
    for (k, slot) in victims.iter_mut().enumerate() {
        let Some(v) = slot.as_mut() else { continue };
        if !moved[k] {
            release(shared, v.buf.take());
            v.next = Some(v.page.state());
            unmoved[k] = Some(written[k]);
            continue;
        }
        judge_taken(shared, v, staging.page(k), written[k]);
    }
}

/// Async WP: decide what a victim taken out of the program's reach needs, its contents now at
/// `page` (a staging or scratch page only this thread touches), `written` what the page tables
/// said: clean (decided here), or a write (a buffer, left undecided for [`queue_writes`]).
fn judge_taken(shared: &Shared, v: &mut Victim<'_>, page: *mut u8, written: bool) {
    let state = v.page.state();
    v.staged = Some(page as usize);
    // SAFETY: see [`source`]: the page is this thread's alone.
    let bytes = unsafe { source(v) };
    if slot_holds(v, state, written, bytes) {
        release(shared, v.buf.take());
        v.next = Some(clean_leaving(shared, state, bytes));
        return;
    }
    if v.buf.is_none() {
        v.buf = shared.arena.alloc();
    }
    if v.buf.is_none() {
        // No buffer to write it from: it goes back (see put_back_failed).
        v.next = Some(state.with_dirty(true));
    }
}

/// Async WP, one TLB flush for the whole batch: hold every victim's page in the staging area's
/// page pipe (references, not copies), drop them all with one call, then read from the pipe
/// each page as it was when dropped, every earlier write included, into the area's scratch
/// pages, which the checks and writes read from. A victim whose drop failed stays resident.
/// Returns false, having changed nothing, where this cannot be done (no pipe, batched drops
/// refused here, a page the pipe would not take): the caller moves the pages instead.
fn splice_out(
    shared: &Shared,
    capture: &crate::capture::Capture,
    staging: &crate::capture::Staging<'_>,
    victims: &mut [Option<Victim<'_>>],
) -> bool {
    let Some(held) = staging.held() else { return false };
    if tiermem_sys::mem::batched_discard_refused() {
        return false;
    }
    // Each victim's place in the pipe, and the pages in that order.
    let mut place = [usize::MAX; PageList::CAPACITY];
    let mut pages = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; PageList::CAPACITY];
    let mut count = 0;
    for (k, v) in victims.iter().enumerate() {
        if let Some(v) = v {
            place[k] = count;
            pages[count] = libc::iovec { iov_base: v.region.page_addr(v.index).cast(), iov_len: PAGE_SIZE };
            count += 1;
        }
    }
    if count == 0 {
        return true;
    }
    // Written since they came in, asked before they are held: a write after this is caught by
    // the hash comparison.
    let mut written = [false; PageList::CAPACITY];
    find_written_victims(capture, victims, &mut written);
    if !held.hold(&pages[..count]) {
        return false;
    }
    discard_runs(
        shared,
        victims,
        |v| v.next.is_none(),
        |v, dropped| {
            if !dropped {
                release(shared, v.buf.take());
                v.next = Some(v.page.state());
            }
        },
    );
    // Every held page is read, dropped or not, so the pipe is empty for the next batch.
    if !held.take(count) {
        // The pipe held these pages a moment ago; only a broken kernel loses them. The dropped
        // pages' contents are gone with it: stop rather than return wrong data later.
        tiermem_sys::messages::fatal(&[
            "tiermem: fatal: pages held for eviction could not be read back from the page pipe",
        ]);
    }
    // Those whose drop failed stay resident (decided above) and are not counted.
    let mut taken = 0;
    for (k, slot) in victims.iter_mut().enumerate() {
        let Some(v) = slot.as_mut().filter(|v| v.next.is_none()) else { continue };
        judge_taken(shared, v, held.scratch_page(place[k]), written[k]);
        taken += 1;
    }
    Stats::add(&shared.stats.counters.spliced_evictions, taken);
    true
}

/// Eviction under sync WP and cleaning (either WP), which read victims in place: where the
/// program has changed the protection of managed memory, copy each victim it made unreadable
/// (through /proc/self/mem) into an arena buffer of its own, set as the victim's `staged`
/// page, which the write and the checks then read instead (a read of the page itself would
/// kill the reclaim thread). Write protection keeps the contents as they are meanwhile, and
/// the caller's hold on [`Shared::protection`] the protection. Returns the copies, to release
/// once written.
fn copy_unreadable(
    shared: &Shared,
    victims: &mut [Option<Victim<'_>>],
) -> [Option<tiermem_device::BufId>; PageList::CAPACITY] {
    let mut copies = [None; PageList::CAPACITY];
    if !shared.protection_guarded.load(Ordering::Acquire) {
        return copies;
    }
    for (k, slot) in victims.iter_mut().enumerate() {
        let Some(v) = slot.as_mut().filter(|v| v.next.is_none()) else { continue };
        let addr = v.region.page_addr(v.index) as usize;
        // Read in place only when known to be readable; a failed query copies (safe either way).
        if page_prot(addr).is_some_and(|prot| prot & libc::PROT_READ != 0) {
            continue;
        }
        match copy_page(shared, addr) {
            Some(copy) => {
                v.staged = Some(shared.arena.ptr(copy) as usize);
                copies[k] = Some(copy);
            }
            // Unreadable and not copied: it stays.
            None => {
                release(shared, v.buf.take());
                v.next = Some(v.page.state());
            }
        }
    }
    copies
}

/// Let go of victims nothing was done to yet: their buffers back, their locks released, and
/// back to the replacement policy.
fn unlock_all(shared: &Shared, victims: &mut [Option<Victim<'_>>]) {
    for v in victims.iter_mut().filter_map(Option::take) {
        release(shared, v.buf);
        if !v.from_cold {
            shared.replacement.on_insert(v.id);
        }
        drop(v.page);
    }
}

/// Give back the copies [`copy_unreadable`] or [`copy_out_protected`] made, once written.
fn release_copies(
    shared: &Shared,
    victims: &mut [Option<Victim<'_>>],
    copies: [Option<tiermem_device::BufId>; PageList::CAPACITY],
) {
    for (slot, copy) in victims.iter_mut().zip(copies) {
        if let (Some(v), Some(copy)) = (slot.as_mut(), copy) {
            v.staged = None;
            shared.arena.release(copy);
        }
    }
}

/// Async WP: take out the victims UFFDIO_MOVE left (`unmoved[k]`: whether the page was written
/// since it came in) whose mapping the program made read-only or inaccessible, which the kernel
/// moves no page out of. Their contents cannot change while protection changes wait
/// ([`crate::Engine::protection_change`]), so each is copied (through /proc/self/mem, which
/// reads inaccessible pages too), written back unless its slot holds it already, and dropped.
/// Nothing is done when a protection change is under way: the pages stay for the next round.
fn copy_out_protected(
    shared: &Shared,
    victims: &mut [Option<Victim<'_>>],
    unmoved: &[Option<bool>; PageList::CAPACITY],
) {
    let Ok(_no_change) = shared.protection.try_read() else { return };
    // Copies of the pages, in buffers of their own (the victims' buffers get the written ones).
    let mut copies: [Option<tiermem_device::BufId>; PageList::CAPACITY] = [None; PageList::CAPACITY];
    let mut leaving: [Option<PageId>; PageList::CAPACITY] = [None; PageList::CAPACITY];
    for (k, slot) in victims.iter_mut().enumerate() {
        let (Some(v), Some(was_written)) = (slot.as_mut(), unmoved[k]) else { continue };
        let state = v.page.state();
        if v.next != Some(state) || state.kind() != Kind::Resident || state.writing() {
            continue;
        }
        let addr = v.region.page_addr(v.index) as usize;
        if page_prot(addr).is_none_or(|prot| prot & libc::PROT_WRITE != 0) {
            continue;
        }
        let Some(copy) = copy_page(shared, addr) else { continue };
        leaving[k] = Some(v.id);
        let bytes = shared.arena.bytes_mut(copy);
        if slot_holds(v, state, was_written, bytes) {
            v.next = Some(clean_leaving(shared, state, bytes));
            shared.arena.release(copy);
        } else if let Some(buf) = shared.arena.alloc() {
            // Written from its own buffer below, as a moved page is from the staging area.
            v.buf = Some(buf);
            v.next = None;
            v.staged = Some(shared.arena.ptr(copy) as usize);
            copies[k] = Some(copy);
        } else {
            leaving[k] = None;
            shared.arena.release(copy);
        }
    }
    queue_writes(shared, victims, true);
    release_copies(shared, victims, copies);
    // Drop the pages that leave, still under `_no_change`.
    discard_runs(
        shared,
        victims,
        |v| leaving.contains(&Some(v.id)) && v.next.is_some_and(|n| n.kind() != Kind::Resident),
        |v, ok| stay_unless_dropped(shared, v, ok),
    );
}

/// Move one page; a page shared with a forked child (not exclusively ours, which UFFDIO_MOVE
/// refuses) is made ours by a write that changes nothing, then moved.
fn move_one(shared: &Shared, uffd: &tiermem_sys::uffd::Uffd, dst: *mut u8, src: *mut u8) -> bool {
    let mut made_ours = false;
    // EAGAIN: the page table changed under the kernel's check; retried a bounded number of times.
    for _ in 0..64 {
        Stats::add(&shared.stats.counters.unmap_calls, 1);
        // SAFETY: as in move_out: `src` is resident and locked by this thread, `dst` an empty
        // registered staging page.
        match unsafe { uffd.move_pages(dst, src, PAGE_SIZE) } {
            Ok(_) => return true,
            Err((_, rustix::io::Errno::BUSY)) if !made_ours => {
                made_ours = true;
                // The write below needs the page writable, and kept so while it runs: a page the
                // program made read-only (or changes now) stays where it is instead of killing
                // this thread with a SIGSEGV.
                let Ok(_no_change) = shared.protection.try_read() else { return false };
                // (Unknown when /proc/self/maps cannot be read: written as before.)
                if page_prot(src as usize).is_some_and(|prot| prot & libc::PROT_WRITE == 0) {
                    return false;
                }
                // SAFETY: `src` is a resident, page-aligned (so u64-aligned) page of a region,
                // locked by this thread, mapped and (as far as the kernel says) writable, its
                // protection held unchanged; the program may write it meanwhile, which the
                // compare-exchange below never undoes.
                let word = unsafe { &*src.cast::<std::sync::atomic::AtomicU64>() };
                // Write the first word back unchanged, which makes the kernel give this process
                // its own copy (a copy-on-write break). A compare-exchange, not `fetch_or(0)`:
                // the compiler turns an idempotent read-modify-write into a plain load.
                let mut current = word.load(Ordering::Relaxed);
                while let Err(seen) = word.compare_exchange(current, current, Ordering::SeqCst, Ordering::Relaxed) {
                    current = seen;
                }
            }
            Err((_, rustix::io::Errno::AGAIN)) => std::hint::spin_loop(),
            Err(_) => return false,
        }
    }
    false
}

/// Async WP: a victim that was moved out but stays resident after all (no buffer, no slot, a
/// failed submission) goes back where it was, dirty: moved back from its staging page, which
/// needs no new page (only the page table over its place, which a move out leaves; a kernel
/// that frees emptied tables, CONFIG_PT_RECLAIM, may have freed it after a MADV_DONTNEED
/// meanwhile), or copied from its scratch page or arena copy, which needs a page of the
/// cgroup. Always copied before, it was fatal where a full cgroup kept refusing the copy
/// (docs/testing.md, 2026-12-07).
fn put_back_failed(shared: &Shared, staging: &crate::capture::Staging<'_>, victims: &mut [Option<Victim<'_>>]) {
    for v in victims.iter_mut().flatten() {
        let (Some(staged), Some(next)) = (v.staged, v.next) else { continue };
        if next.kind() != Kind::Resident {
            continue;
        }
        let addr = v.region.page_addr(v.index);
        let movable = staging.holds(staged);
        let moved = movable && {
            let uffd = shared.uffd_of(v.region);
            // SAFETY: `staged` is a staging page holding this victim's page, which only this
            // thread touches; `addr` is the victim's place in a region registered on the same
            // userfaultfd, empty since the page left, and locked by this thread.
            unsafe { uffd.move_pages(addr, staged as *mut u8, PAGE_SIZE) }.is_ok()
        };
        // (A move that failed may still have moved the page, as `move_out` found: the copy
        // then finds it there, EEXIST.)
        let copied = || match crate::fault::map_pages(shared, v.region, addr, staged as *const u8, 1, false) {
            Ok(()) => true,
            Err(e) => movable && e == rustix::io::Errno::EXIST,
        };
        if !moved && !copied() {
            // Nothing left to try: say so loudly rather than return wrong data later.
            tiermem_sys::messages::fatal(&["tiermem: fatal: a page whose eviction failed could not be put back"]);
        }
        v.next = Some(next.with_dirty(true));
    }
}

/// Queue the write of each protected dirty victim, from a copy in its buffer. Sets `next` for
/// the ones that leave (or stay, on failure). With `leave` false the pages stay resident, clean
/// once the write completes (cleaning ahead); all-zero pages then stay as they are. With
/// [`crate::EngineConfig::write_runs`], address-contiguous victims go as one request to
/// consecutive slots from a run of buffers (their own buffers go back).
fn queue_writes(shared: &Shared, victims: &mut [Option<Victim<'_>>], leave: bool) {
    // Which still need a write once all-zero pages are taken out.
    let mut pending = [false; PageList::CAPACITY];
    for (k, slot) in victims.iter_mut().enumerate() {
        let Some(v) = slot.as_mut().filter(|v| v.buf.is_some() && v.next.is_none()) else { continue };
        // SAFETY: see [`source`].
        if unsafe { source(v) }.iter().all(|&b| b == 0) {
            let state = v.page.state();
            release(shared, v.buf.take());
            if !leave {
                // Nothing to gain from writing zeros; eviction will make it untouched.
                v.next = Some(state);
                continue;
            }
            // Zeros need no slot: the page becomes untouched again, and its slot is freed once
            // the page is dropped (a failed drop keeps the page, and the slot its state names).
            v.next = Some(PageState::UNTOUCHED);
            continue;
        }
        pending[k] = true;
    }
    let mut queue = shared.queues.writeback();
    let mut queued = 0;
    if shared.config.write_runs {
        let mut i = 0;
        while i < victims.len() {
            let j = run_end(victims, i, |v| v.is_some()).min(i + tiermem_device::arena::RUN_PAGES as usize);
            let j = (i..j).find(|&k| !pending[k]).unwrap_or(j);
            if j - i >= 2 && queue_run(shared, &mut **queue, &mut victims[i..j], leave, &mut queued) {
                pending[i..j].fill(false);
            }
            i = j.max(i + 1);
        }
    }
    for (k, slot) in victims.iter_mut().enumerate() {
        let Some(v) = slot.as_mut().filter(|_| pending[k]) else { continue };
        let buf = v.buf.unwrap_or_default();
        let state = v.page.state();
        // SAFETY: see [`source`].
        shared.arena.bytes_mut(buf).copy_from_slice(unsafe { source(v) });
        let Some(slot) = state.slot().or_else(|| take_slots(shared, 1)) else {
            v.next = Some(state);
            continue;
        };
        v.slot = Some((slot, state.slot().is_none()));
        make_room(shared, &mut **queue, &mut queued);
        shared.queues.mark_submitted(buf);
        if queue.push(Request::Write { slot, buf }, tag(Op::WriteBack, v.id)).is_err() {
            v.next = Some(state);
            continue;
        }
        queued += 1;
        v.next = Some(written(shared, v, slot, buf, leave));
    }
    if queued > 0 && queue.submit().is_err() {
        tracing::error!("submitting write-backs failed; their pages stay resident");
    }
    if shared.config.io_mode == IoMode::PollOnly {
        // The poll-only variant waits for its own writes before moving on.
        while queue.in_flight() > 0 {
            let pending = queue.in_flight();
            if queue.wait(pending, &mut |c| shared.queues.defer(c)).is_err() {
                break;
            }
        }
    }
}

/// The page a victim's write copies: the page itself, mapped (resident, locked) and
/// write-protected, or what `staged` points at (its staging page or arena copy).
///
/// # Safety
/// Only this thread touches a staging page or a victim's copy, and a protected locked page is
/// not written: the bytes are stable while the returned slice is used, within this reclaim
/// round.
unsafe fn source<'a>(v: &Victim<'a>) -> &'a [u8] {
    let from = v.staged.map_or(v.region.page_addr(v.index).cast_const(), |a| a as *const u8);
    // SAFETY: the caller's contract; `from` is PAGE_SIZE readable bytes (see above).
    unsafe { std::slice::from_raw_parts(from, PAGE_SIZE) }
}

/// Slots the device is asked to set aside past what a round may take (8 MiB).
const BACKED_AHEAD_SLOTS: u64 = 2048;

/// Before a round that may take `n` new slots: have the device set storage aside for them and
/// [`BACKED_AHEAD_SLOTS`] more, so that it grows while the program's cgroup still has room for
/// the little an extension needs. Asked at the last moment, the extension came when reclaim
/// was needed most: a burst of the program's own memory had filled the cgroup, its OOM guard
/// had the kernel refuse the file system memory (ENOMEM), and pages stayed over the budget
/// with nowhere to go (docs/testing.md, 2026-12-07). Slots are handed out lowest first, so
/// this round's lie below `used + n` (runs, about). The device says when to ask again after
/// a refusal of the margin (see tiermem_device's `backing`).
fn back_ahead(shared: &Shared, n: u64) {
    let capacity = shared.slots.capacity();
    let needed = (shared.slots.used() + n).min(capacity);
    let wanted = (needed + BACKED_AHEAD_SLOTS).min(capacity);
    if wanted <= shared.device.backed_slots() || shared.device_cannot_extend() {
        return;
    }
    match shared.device.back_slots(needed, wanted) {
        Ok(()) => shared.note_device_room(),
        Err(e) => refused_device_room(shared, &e),
    }
}

/// Take `n` consecutive free slots (one, or a run within a bitmap word) with storage set aside
/// for them: a device that sets its storage aside as it fills is asked for more when they are
/// past what it holds, unless it refused lately. `None` when no slots are free or the device
/// refused (noted, and said once): the page then stays in memory rather than be written where
/// its write could fail after it left.
fn take_slots(shared: &Shared, n: u32) -> Option<u64> {
    let first = if n == 1 { shared.slots.alloc()? } else { shared.slots.alloc_run(n)? };
    let end = first + u64::from(n);
    if end <= shared.device.backed_slots() {
        return Some(first);
    }
    let backed =
        if shared.device_cannot_extend() { Err(None) } else { shared.device.back_slots(end, end).map_err(Some) };
    match backed {
        Ok(()) => {
            shared.note_device_room();
            Some(first)
        }
        Err(e) => {
            (first..end).for_each(|slot| shared.slots.free(slot));
            // A refused run is tried again page by page, each counted then.
            if let (Some(e), 1) = (e, n) {
                refused_device_room(shared, &e);
            }
            None
        }
    }
}

/// The device refused to set storage aside: noted (victims needing a new slot are held back a
/// while) and counted; a full file system (not a passing refusal of memory) is said once.
/// Memory refused in a system call raises no OOM event under the OOM guard, so the cgroup
/// watch would not hear of it: counted as a wait for memory (which the watch answers) and a
/// step of the budget shed, as a refused page copy is.
fn refused_device_room(shared: &Shared, e: &std::io::Error) {
    let errno = e.raw_os_error().unwrap_or(0);
    shared.note_device_refusal(errno);
    if errno == libc::ENOMEM {
        Stats::add(&shared.stats.counters.device_memory_refusals, 1);
        Stats::add(&shared.stats.counters.memory_waits, 1);
        shared.shed(shared.limit_pages() / 32);
        return;
    }
    Stats::add(&shared.stats.counters.no_device_room, 1);
    if !shared.said_no_device_room.swap(true, Ordering::Relaxed) {
        say_no_device_room(shared.device.backed_slots(), errno);
    }
}

/// Say once that the device could set no more aside. Without allocating: this may run in the
/// SIGBUS handler, over program code that holds malloc's lock.
fn say_no_device_room(backed_slots: u64, errno: i32) {
    use tiermem_sys::messages::decimal;
    let (mut mib, mut code) = ([0u8; 20], [0u8; 20]);
    let why = if errno == libc::ENOSPC { "its file system is full" } else { "fallocate failed" };
    let parts = [
        "tiermem: the device cannot set aside more than ",
        decimal(((backed_slots * PAGE_SIZE as u64) >> 20) as i64, &mut mib),
        " MiB (",
        why,
        ", errno ",
        decimal(i64::from(errno), &mut code),
        "); pages that cannot be written out stay in memory, over the budget",
    ];
    tiermem_sys::messages::say(&parts);
}

/// Full queue: submit what is queued and take finished writes off it (processed later, outside
/// these pages' locks).
fn make_room(shared: &Shared, queue: &mut dyn tiermem_device::IoQueue, queued: &mut usize) {
    if queue.in_flight() >= shared.config.queue_depth as usize {
        if *queued > 0 {
            let _ = queue.submit();
            *queued = 0;
        }
        let _ = queue.wait(1, &mut |c| shared.queues.defer(c));
    }
}

/// The state of a victim whose write of buffer `buf` to `slot` is queued: the slot's hash is
/// noted and the write counted.
fn written(shared: &Shared, v: &Victim<'_>, slot: u64, buf: tiermem_device::BufId, leave: bool) -> PageState {
    if let Some(hash) = v.region.slot_hashes.get(v.index as usize) {
        hash.store(crate::capture::page_hash(shared.arena.bytes_mut(buf)), Ordering::Relaxed);
    }
    Stats::add(&shared.stats.counters.writebacks, 1);
    let state = v.page.state().with_slot(Some(slot)).with_dirty(false).with_writing(true).with_buf(buf);
    if leave {
        state.with_kind(Kind::Evicted)
    } else {
        Stats::add(&shared.stats.counters.cleaned_ahead, 1);
        state
    }
}

/// Write `run` (address-contiguous victims, all needing a write) as one request from a run of
/// arena buffers to as many consecutive new slots; their old slots are freed once it is queued.
/// False, with nothing changed, when no buffer run or slot run is free or the push fails.
fn queue_run(
    shared: &Shared,
    queue: &mut dyn tiermem_device::IoQueue,
    run: &mut [Option<Victim<'_>>],
    leave: bool,
    queued: &mut usize,
) -> bool {
    let n = run.len() as u32;
    let Some(bufs) = shared.arena.alloc_run(n) else { return false };
    let Some(slots) = take_slots(shared, n) else {
        (0..n).for_each(|k| shared.arena.release(bufs + k));
        return false;
    };
    for (k, v) in run.iter().flatten().enumerate() {
        // SAFETY: see [`source`].
        shared.arena.bytes_mut(bufs + k as u32).copy_from_slice(unsafe { source(v) });
        shared.queues.mark_submitted(bufs + k as u32);
    }
    make_room(shared, queue, queued);
    let first = run.iter().flatten().next().map_or(0, |v| v.id);
    let tag = shared.queues.note_run(&shared.arena, Op::WriteRun, bufs, first, n, false);
    if queue.push(Request::WriteRun { slot: slots, buf: bufs, pages: n }, tag).is_err() {
        (0..n).for_each(|k| shared.arena.release(bufs + k));
        (0..u64::from(n)).for_each(|k| shared.slots.free(slots + k));
        return false;
    }
    *queued += 1;
    for (k, v) in run.iter_mut().flatten().enumerate() {
        release(shared, v.buf.take());
        if let Some(old) = v.page.state().slot() {
            shared.slots.free(old);
        }
        let (slot, buf) = (slots + k as u64, bufs + k as u32);
        v.buf = Some(buf);
        v.slot = Some((slot, true));
        v.next = Some(written(shared, v, slot, buf, leave));
    }
    true
}

/// Background reclaim. Past the watermark it cleans ahead (see [`clean_batch`]) until the pages
/// above the watermark are all cleaned; past the evict watermark it drops pages, cleaned ones
/// first, down to a little below it. Sleeps when neither is needed.
pub(crate) fn reclaim_thread(shared: &Shared) {
    let batch = shared.config.reclaim_batch;
    let mut buf = [0u8; 8];
    while !shared.shutdown.load(Ordering::Acquire) {
        // Say we sleep before the last look at residency (SeqCst, paired with wake_reclaim), so
        // a thread that raises it after that look wakes us.
        shared.reclaim_asleep.store(true, Ordering::SeqCst);
        if !shared.reclaim_wanted(shared.resident()) {
            let mut fds = [PollFd::new(&shared.reclaim_wake, PollFlags::IN)];
            let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: 20_000_000 };
            let woken = poll(&mut fds, Some(&timeout)).is_ok_and(|n| n > 0);
            let _ = rustix::io::read(&shared.reclaim_wake, &mut buf);
            if !woken {
                // A timed look: try cleaning again even if the last round found nothing.
                shared.clean_stalled.store(false, Ordering::Relaxed);
            }
        }
        shared.reclaim_asleep.store(false, Ordering::SeqCst);
        let regions = shared.regions();
        if shared.resident() > shared.drop_threshold() {
            Stats::add(&shared.stats.counters.reclaim_wakeups, 1);
            let target = shared.drop_threshold().saturating_sub(batch as u64 / 2);
            let mut idle_rounds = 0;
            while shared.resident() > target && !shared.shutdown.load(Ordering::Acquire) {
                let evicted = evict_batch(shared, &regions, batch, Path::Reclaim);
                // Finish earlier writes here too: their buffers are what the next batch needs,
                // and the completion thread may not get a CPU soon on a busy machine.
                reap_background(shared, &regions);
                if evicted == 0 {
                    idle_rounds += 1;
                    if idle_rounds > 100 {
                        // Nothing evictable now (all locked, pinned or in flight): let the
                        // fault path and completions move before looking again.
                        std::thread::sleep(Duration::from_millis(1));
                        break;
                    }
                    std::thread::yield_now();
                } else {
                    idle_rounds = 0;
                }
            }
        } else if shared.reclaim_wanted(shared.resident()) {
            // Cleaning only: one batch, then look at residency again (faults may need drops).
            if clean_batch(shared, &regions, batch) == 0 {
                shared.clean_stalled.store(true, Ordering::Relaxed);
            }
            reap_background(shared, &regions);
        }
    }
}

/// Wait until no I/O of `region` is in flight and no thread holds one of its pages; after 30 s
/// say so (the caller looks again under the region table's write lock and comes back here
/// while the region is still busy: its I/O must end before its pages can go).
pub(crate) fn quiesce_region(shared: &Shared, region: &RegionInner) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while region.busy() {
        {
            let regions = shared.regions();
            reap_background(shared, &regions);
        }
        if Instant::now() > deadline {
            tracing::error!("a region being released still has I/O in flight after 30 s; still waiting");
            return;
        }
        std::thread::yield_now();
    }
}
