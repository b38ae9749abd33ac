//! The live access monitor: sources off the fault path feed the monitor of `tiermem-monitor`,
//! whose reports travel through its single-producer/single-consumer ring to the engine's monitor
//! thread, which acts on them without any program thread waiting:
//! - will-need pages that are evicted are read ahead, eviction making room first when the
//!   budget is full (as the kernel's swap-in readahead for MADV_WILLNEED allocates);
//! - sequential (and hot) pages are told to the prefetcher (`Prefetcher::on_report`), and the
//!   pages it picks are read ahead as will-need pages are (room made first, busy ones
//!   retried): the `stream` prefetcher locks on to a stream before its first fault;
//!   prefetchers that learn from faults only ignore them;
//! - cold resident pages go on the engine's cold list: evicted first when room is needed, as
//!   MADV_COLD deactivates pages. Cold advice is acted on by the advising thread itself
//!   ([`Region::advise`]): only resident pages matter, and a look at each page's state word
//!   finds them faster than a report per page through the ring would (which made a program
//!   advising a range of many GiB wait for the monitor thread to get through every page).
//!
//! Sources: application advice ([`crate::Region::advise`], which the preload shim calls for
//! madvise on managed memory), and every fault and write fault, which the fault path feeds to the
//! hot-page table (§2.1, faults standing for the memory reads it counts; [`LiveMonitor::fault`]):
//! a page that faults N times while it stays in the table is reported hot, and a hot page is
//! wanted as a will-need page is (resident: its referenced bit; evicted: read back). With
//! `EngineConfig::damon`, DAMON's accessed regions too (`damon.rs`), through a table of their
//! own ([`LiveMonitor::physical_pages`]). The
//! prefetcher also hears every fault directly on the fault path, as before.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags};
use tiermem_monitor::ring::Consumer;
use tiermem_monitor::{Advice, Monitor, Report, ReportKind};
use tiermem_sys::{Error, Result, PAGE_SIZE};

use crate::engine::{Region, Shared};
use crate::fault::{read_ahead, ReadAhead};
use crate::page::Kind;
use crate::policy::PageList;
use crate::region::{RegionInner, RegionTable};
use crate::stats::{Path, Stats};

/// Reports the ring holds.
const RING_REPORTS: usize = 16384;
/// Reports sent per [`Monitor::advise`] call (its own cap for will-need and cold ranges).
const ADVICE_CHUNK: u64 = 4096;
/// Most reports handled per hold of the region table's read lock (region creation waits for it).
const ROUND: u64 = 4096;
/// How often the monitor thread retries a read-ahead that found no buffer or queue slot, 100 µs
/// apart, before leaving the rest of its pages to faults.
const STALL_RETRIES: u32 = 50;
/// Background room left free while advised pages land (see [`read_evicted`]).
const LANDING_SLACK: usize = 8;
/// Most time spent on one batch of will-need pages, retries included.
const FLUSH_TIME: Duration = Duration::from_millis(10);
/// How often it goes back, 100 µs apart, to will-need pages that were busy (a write-back in
/// flight) when their turn came, before setting them aside (see [`Waiting`]).
const BUSY_RETRIES: u32 = 20;
/// How long will-need pages set aside as busy are retried, a millisecond apart, before they
/// are left to faults. A write-back queued behind a full queue of others can take several
/// milliseconds (CI: 958 pages cleaned at once, 433 µs each on average), so a few retries
/// within one batch are not enough.
const BUSY_PATIENCE: Duration = Duration::from_secs(1);
/// How often set-aside pages are retried.
const WAITING_TICK: Duration = Duration::from_millis(1);
/// Most batches set aside at once; the oldest go to faults first.
const MOST_WAITING: usize = 64;

/// The producer side, shared by every source, and the thread's wake-up.
#[derive(Debug)]
pub(crate) struct LiveMonitor {
    producer: Mutex<Monitor>,
    consumer: Mutex<Option<Consumer>>,
    /// Written after reports are pushed (an eventfd: a counter, so no wake-up is lost).
    wake: crate::engine::WakeFd,
}

impl LiveMonitor {
    pub(crate) fn new(hot_threshold: u32) -> Result<Self> {
        let (producer, consumer) = tiermem_monitor::ring::ring(RING_REPORTS);
        Ok(Self {
            producer: Mutex::new(Monitor::new(hot_threshold, producer)?),
            consumer: Mutex::new(Some(consumer)),
            wake: crate::engine::wake_eventfd()?,
        })
    }

    /// The reading end, for the monitor thread (once).
    pub(crate) fn take_consumer(&self) -> Option<Consumer> {
        self.consumer.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Wake the monitor thread: reports are waiting, or the engine shuts down.
    pub(crate) fn wake(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }

    /// Show the monitor a fault on page `page` of region `index` (`write`: a write fault).
    /// Called on the fault path, also inside the SIGBUS handler: never waits (a fault that finds
    /// another thread feeding the monitor is skipped and counted), never allocates, and makes a
    /// system call only for a report (the wake-up), which the table's sent bit keeps rare.
    pub(crate) fn fault(&self, stats: &Stats, index: u32, page: u64, write: bool) {
        let Ok(owner) = u16::try_from(index) else { return };
        let mut monitor = match self.producer.try_lock() {
            Ok(m) => m,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                Stats::add(&stats.counters.monitor_skipped_faults, 1);
                return;
            }
        };
        let reported = monitor.fault(owner, page, write);
        drop(monitor);
        if reported {
            self.wake();
        }
    }

    /// Report `advice` for `pages` pages of region `owner` from page `first`. Waits for room in
    /// the ring instead of dropping reports (the caller is a program thread, which may wait);
    /// returns early only if the engine shuts down.
    fn advise(&self, shared: &Shared, owner: u16, first: u64, pages: u64, advice: Advice) {
        let mut monitor = self.producer.lock().unwrap_or_else(|e| e.into_inner());
        let end = first + pages;
        let mut at = first;
        while at < end {
            // Sequential advice sends only the first few pages, whatever the range.
            let chunk = (end - at).min(ADVICE_CHUNK);
            let needed = if advice == Advice::Sequential { chunk.min(8) } else { chunk } as usize;
            while monitor.room() < needed {
                self.wake();
                if shared.shutdown.load(Ordering::Acquire) {
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
            monitor.advise(owner, at, chunk, advice);
            if advice == Advice::Sequential {
                break;
            }
            at += chunk;
        }
        drop(monitor);
        self.wake();
    }
}

impl LiveMonitor {
    /// A new window of DAMON's: see [`Monitor::begin_physical_window`].
    pub(crate) fn begin_physical_window(&self) {
        self.producer.lock().unwrap_or_else(|e| e.into_inner()).begin_physical_window();
    }

    /// Feed DAMON's finding for `pages` (resident managed pages in regions it saw accessed) as
    /// the physical source: their frames are entered in the reverse page table for the feed
    /// and taken out after it (a frame's page changes once it is evicted). Waits for ring room
    /// first, as advice does, without holding the monitor meanwhile (faults would skip it and
    /// advice would wait); false if the engine shuts down meanwhile.
    pub(crate) fn physical_pages(&self, shared: &Shared, pages: &[crate::damon::AccessedPage]) -> bool {
        let frames: Vec<tiermem_monitor::damon::DamonRegion> = pages
            .iter()
            .map(|p| {
                let start = p.pfn * PAGE_SIZE as u64;
                tiermem_monitor::damon::DamonRegion {
                    start,
                    end: start + PAGE_SIZE as u64,
                    nr_accesses: p.nr_accesses,
                    age: 0,
                }
            })
            .collect();
        let mut monitor = loop {
            let monitor = self.producer.lock().unwrap_or_else(|e| e.into_inner());
            if monitor.room() >= pages.len() {
                break monitor;
            }
            drop(monitor);
            self.wake();
            if shared.shutdown.load(Ordering::Acquire) {
                return false;
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        for p in pages {
            // A region index the 16-bit field cannot hold is left out (reports carry 16 bits).
            let _ = monitor.reverse_page_table().insert(p.pfn, p.region, p.page);
        }
        monitor.damon_regions(&frames);
        for p in pages {
            monitor.reverse_page_table().remove(p.pfn);
        }
        drop(monitor);
        self.wake();
        true
    }
}

/// Will-need pages of one region gathered from consecutive reports, read together (contiguous
/// pages share one request where their slots are contiguous too), and those set aside because
/// they were busy.
#[derive(Default)]
struct Pending {
    region: u32,
    pages: PageList,
    waiting: std::collections::VecDeque<Waiting>,
}

/// Will-need pages that were still being written back after a batch's retries: read once
/// their write-back ends, retried between rounds (the region table unlocked in between).
struct Waiting {
    region: u32,
    pages: PageList,
    since: std::time::Instant,
}

/// The monitor thread: take reports off the ring and act on them, sleeping while it is empty.
pub(crate) fn monitor_thread(shared: &Shared, mut consumer: Consumer) {
    let mut buf = [0u8; 8];
    let mut pending = Pending::default();
    while !shared.shutdown.load(Ordering::Acquire) {
        let mut taken = 0;
        {
            let regions = shared.regions();
            while taken < ROUND {
                let Some(word) = consumer.pop() else { break };
                taken += 1;
                Stats::add(&shared.stats.counters.monitor_reports, 1);
                if let Some(report) = Report::decode(word) {
                    act(shared, &regions, report, &mut pending);
                }
            }
            flush(shared, &regions, &mut pending);
            retry_waiting(shared, &regions, &mut pending);
        }
        if taken > 0 {
            continue;
        }
        // Sleep until reports or shutdown (both write the eventfd, a counter: no wake-up is lost
        // between the empty ring above and this), or the next retry of busy pages.
        let mut fds = [PollFd::new(&shared.monitor.wake, PollFlags::IN)];
        let tick = rustix::event::Timespec { tv_sec: 0, tv_nsec: WAITING_TICK.as_nanos() as i64 };
        let timeout = (!pending.waiting.is_empty()).then_some(&tick);
        if poll(&mut fds, timeout).is_ok_and(|n| n > 0) {
            let _ = rustix::io::read(&shared.monitor.wake, &mut buf);
        }
    }
}

fn act(shared: &Shared, regions: &RegionTable, report: Report, pending: &mut Pending) {
    let index = u32::from(report.owner);
    let Some(region) = regions.get(index).filter(|r| !r.is_closing() && report.page < r.page_count()) else {
        return;
    };
    let page = report.page;
    match report.kind {
        ReportKind::WillNeed => want(shared, regions, pending, index, region, page),
        ReportKind::Sequential | ReportKind::Hot => {
            if let Some(trace) = &shared.trace {
                trace.report((region.page_addr(page) as usize / PAGE_SIZE) as u64);
            }
            if report.kind == ReportKind::Hot {
                // It kept coming back: keep it (resident) or bring it back (evicted). The
                // report leaves once its fault is resolved, but a handler thread that found
                // the page's prefetch in flight leaves it to the completion: wait for that
                // (for a resident page, as DAMON's mostly are, this returns at once).
                await_landing(region, &[page]);
                want(shared, regions, pending, index, region, page);
                // Counted once acted on: a resident hot page has its referenced bit by now.
                Stats::add(&shared.stats.counters.hot_reports, 1);
            }
            let mut wanted = PageList::default();
            shared.prefetcher.on_report(index, page, region.page_count(), &mut wanted);
            shared.govern_prefetches(&mut wanted);
            // Read like will-need pages: room made first (right after a program filled its
            // budget there is none, and a plain prefetch would find none and read nothing),
            // busy pages retried.
            for &p in wanted.as_slice() {
                want(shared, regions, pending, index, region, p);
            }
        }
        ReportKind::Cold => list_cold(shared, region, page..page + 1),
    }
}

/// Put the resident pages of `pages` on the cold list, their referenced bits cleared (by the
/// program's word, no second chance for a touch before the advice) and their cold hints set
/// (the entry holds while the page stays in memory). Pages not resident are passed over on one
/// load of their state word each.
fn list_cold(shared: &Shared, region: &RegionInner, pages: std::ops::Range<u64>) {
    if region.is_closing() {
        return;
    }
    let mut listed = Vec::new();
    for page in pages {
        let cell = &region.pages[page as usize];
        // A locked page is looked at under its lock: a page just mapped by a fault can be in
        // the program's hands before its handler has recorded it (zero-fill-around, handler
        // threads), still untouched in its word.
        let (seen, locked) = cell.peek_with_lock();
        if seen.kind() != Kind::Resident && !locked {
            continue;
        }
        let mut locked = cell.lock();
        let state = locked.state();
        if state.kind() == Kind::Resident {
            locked.set(state.with_referenced(false).with_cold_hint(true));
            drop(locked);
            listed.push(region.id(page));
        }
    }
    if !listed.is_empty() {
        shared.push_cold(&listed);
    }
}

/// Make page `page` of region `index` resident soon: an evicted page, or one whose eviction is
/// under way (its write-back in flight), is queued to be read with the pages queued with it
/// (once the batch is full, another region's page comes, or the reports run out); a resident
/// page gets its referenced bit, as a use would, so replacement passes it over once.
fn want(shared: &Shared, regions: &RegionTable, pending: &mut Pending, index: u32, region: &RegionInner, page: u64) {
    if page >= region.page_count() {
        return;
    }
    if pending.region != index || pending.pages.len() == PageList::CAPACITY {
        flush(shared, regions, pending);
        pending.region = index;
    }
    let cell = &region.pages[page as usize];
    let seen = cell.peek();
    if to_read(seen) {
        pending.pages.push(page);
    } else if seen.kind() == Kind::Resident {
        let mut locked = cell.lock();
        let state = locked.state();
        if state.kind() == Kind::Resident {
            locked.set(state.with_referenced(true));
        }
    }
}

/// Whether a wanted page still has to be read: evicted, or on its way out.
fn to_read(state: crate::page::PageState) -> bool {
    state.kind() == Kind::Evicted || (state.kind() == Kind::Resident && state.writing())
}

/// Read the pending will-need pages, evicting first where the budget has no room for them.
fn flush(shared: &Shared, regions: &RegionTable, pending: &mut Pending) {
    let mut pages = std::mem::take(&mut pending.pages);
    let Some(region) = regions.get(pending.region).filter(|r| !r.is_closing()) else { return };
    // The region table stays read-locked meanwhile (region creation waits): bounded.
    let deadline = std::time::Instant::now() + FLUSH_TIME;
    for _ in 0..BUSY_RETRIES {
        if pages.is_empty() || shared.shutdown.load(Ordering::Acquire) || std::time::Instant::now() > deadline {
            break;
        }
        read_evicted(shared, regions, region, pages.as_slice());
        // Pages still to read were busy (their write-back in flight, or locked): once that
        // ends they can be read, and a program touching them later would wait for the device.
        pages = still_to_read(region, &pages);
        if !pages.is_empty() {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    if !pages.is_empty() && !shared.shutdown.load(Ordering::Acquire) {
        if pending.waiting.len() == MOST_WAITING {
            pending.waiting.pop_front();
        }
        pending.waiting.push_back(Waiting { region: pending.region, pages, since: std::time::Instant::now() });
    }
}

/// The pages of `pages` that still have to be read (see [`to_read`]).
fn still_to_read(region: &RegionInner, pages: &PageList) -> PageList {
    let mut left = PageList::default();
    for &page in pages.as_slice() {
        if region.pages.get(page as usize).is_some_and(|cell| to_read(cell.peek())) {
            left.push(page);
        }
    }
    left
}

/// One more try at every batch of set-aside pages; a batch whose pages were all read, whose
/// region is gone, or that waited longer than [`BUSY_PATIENCE`] is done.
fn retry_waiting(shared: &Shared, regions: &RegionTable, pending: &mut Pending) {
    pending.waiting.retain_mut(|w| {
        let Some(region) = regions.get(w.region).filter(|r| !r.is_closing()) else { return false };
        if w.since.elapsed() > BUSY_PATIENCE || shared.shutdown.load(Ordering::Acquire) {
            return false;
        }
        // The slot may hold another region by now (the one set aside was freed and its slot
        // reused), maybe a smaller one: its pages are not these.
        if w.pages.as_slice().iter().any(|&p| p >= region.page_count()) {
            return false;
        }
        read_evicted(shared, regions, region, w.pages.as_slice());
        w.pages = still_to_read(region, &w.pages);
        !w.pages.is_empty()
    });
}

/// Start reading `pages` (evicted pages of `region`), evicting first where the budget has no
/// room for them; busy pages are skipped.
fn read_evicted(shared: &Shared, regions: &RegionTable, region: &RegionInner, pages: &[u64]) {
    let mut rest = pages;
    let mut stalls = 0;
    while !rest.is_empty() && !shared.shutdown.load(Ordering::Acquire) {
        // Room for these and a few more: a faulting thread holds a page of room for a moment
        // while it looks at its page, and a completion that finds no room drops its page
        // (seen: one advised page in a hundred dropped so, and then read by a fault).
        make_room(shared, regions, rest.len() + LANDING_SLACK);
        let fits = (shared.prefetch_room() as usize).saturating_sub(LANDING_SLACK).min(rest.len());
        let done = if fits > 0 { read_ahead(shared, region, &rest[..fits], None) } else { ReadAhead::default() };
        Stats::add(&shared.stats.counters.monitor_read_ahead, done.pages as u64);
        // A page counts as resident only once it lands: wait for these before making room
        // for the next, or the room made would be counted twice and the pages dropped.
        await_landing(region, &rest[..done.looked_at]);
        rest = &rest[done.looked_at..];
        if done.looked_at == 0 {
            // No room, buffer or queue slot: let completions land, then try again.
            stalls += 1;
            if stalls > STALL_RETRIES {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Wait (at most 20 ms) until none of `pages` is still being read.
fn await_landing(region: &RegionInner, pages: &[u64]) {
    let start = std::time::Instant::now();
    while pages.iter().any(|&p| region.pages.get(p as usize).is_some_and(|cell| cell.peek().kind() == Kind::Incoming))
        && start.elapsed() < Duration::from_millis(20)
    {
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Evict until `pages` background page-ins fit (what a reclaim batch can do at a time).
fn make_room(shared: &Shared, regions: &RegionTable, pages: usize) {
    let short = (pages as u64).saturating_sub(shared.prefetch_room());
    if short > 0 {
        crate::reclaim::evict_batch(
            shared,
            regions,
            short.min(shared.config.reclaim_batch as u64) as usize,
            Path::Reclaim,
        );
    }
}

impl Region {
    /// Advise the engine about `[offset, offset + len)` of this region (page-aligned, inside
    /// it), as madvise(2) does the kernel; returns at once, the monitor thread acts on
    /// will-need and sequential advice:
    /// - [`Advice::WillNeed`]: evicted pages are read ahead, making room by eviction if needed;
    ///   at most half the budget per call (more would push out what was just read);
    /// - [`Advice::Sequential`]: the prefetcher hears the first pages (the `stream` prefetcher
    ///   then reads ahead of the stream before its first fault; others learn from faults);
    /// - [`Advice::Cold`]: resident pages are the first evicted when room is needed. Acted on
    ///   here, not by the monitor thread: a look at each page's state (about half a ms per
    ///   GiB of range), a lock of each resident one.
    pub fn advise(&self, offset: usize, len: usize, advice: Advice) -> Result<()> {
        if !offset.is_multiple_of(PAGE_SIZE) || offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(Error::invalid(format!(
                "advice on {len} bytes at offset {offset} is not page-aligned inside a region of {} bytes",
                self.len()
            )));
        }
        let owner = u16::try_from(self.inner.index).map_err(|_| {
            Error::invalid(format!(
                "advice on region slot {}: the access monitor's reports name at most 65536 live regions",
                self.inner.index
            ))
        })?;
        let first = (offset / PAGE_SIZE) as u64;
        let mut pages = ((offset + len).div_ceil(PAGE_SIZE) as u64).saturating_sub(first);
        if advice == Advice::Cold {
            list_cold(&self.shared, &self.inner, first..first + pages);
            return Ok(());
        }
        if advice == Advice::WillNeed {
            pages = pages.min(self.shared.limit_pages() / 2);
        }
        // Every page is reported; the monitor thread looks at each one's state when it acts,
        // not here: a page being evicted right now still looks resident (seen: a will-need page
        // skipped here and then read by a fault).
        if pages > 0 {
            self.shared.monitor.advise(&self.shared, owner, first, pages, advice);
        }
        Ok(())
    }
}
