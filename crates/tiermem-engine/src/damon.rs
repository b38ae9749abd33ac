//! DAMON as a live source of the access monitor (`EngineConfig::damon`): the kernel samples
//! the accessed bits of physical memory, something faults cannot show (a resident page that
//! the program keeps using never faults again). At the end of each of DAMON's aggregation
//! windows this thread finds the resident managed pages whose frames lie in regions DAMON saw
//! accessed (from /proc/self/pagemap), enters them in the monitor's reverse page table, and
//! feeds them to the monitor as the paper's physical-address source: through the physical
//! hot-page table and the reverse page table into the ring, where a hot page gets its
//! referenced bit (replacement passes it over once) and goes to the prefetcher's `on_report`.
//!
//! It listens to a kdamond already running for physical memory (`tiermem run --damon on`
//! starts one when none exists). DAMON's view is coarse: regions of megabytes, and on this VM
//! the boot-time kdamond samples every 0.5 s and aggregates every 5 s. A page is reported
//! when its region was found accessed in at least N samples of a window (the hot threshold).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tiermem_monitor::damon::DamonRegion;
use tiermem_sys::PAGE_SIZE;

use crate::engine::Shared;
use crate::region::RegionInner;
use crate::stats::Stats;

/// Sampling interval and aggregation window of a kdamond started for a run when none exists:
/// fine enough to tell a working set within a second.
pub const OWN_SAMPLE: Duration = Duration::from_millis(5);
/// See [`OWN_SAMPLE`].
pub const OWN_WINDOW: Duration = Duration::from_millis(100);

/// How long without a window before checking that the kdamond still runs.
const KDAMOND_CHECK: Duration = Duration::from_secs(10);

/// Pagemap entries read per call.
const PAGEMAP_CHUNK: usize = 512;
/// Pages fed to the monitor at once: per hold of its lock (the fault path skips the monitor
/// while it is held), and so the ring room waited for first and the reverse page table's
/// leaves allocated at once (at most this many 4 KiB leaves when the frames are scattered).
const FEED_CHUNK: usize = 512;

/// A resident managed page whose frame DAMON found accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct AccessedPage {
    pub(crate) pfn: u64,
    pub(crate) nr_accesses: u32,
    pub(crate) region: u32,
    pub(crate) page: u64,
}

/// The thread: one round per aggregation window until shutdown or [`crate::Engine::stop_damon`].
pub(crate) fn damon_thread(shared: &Shared) {
    // Stopped by a caller that could not wait for the events, or ended by a failure: they go
    // when the thread ends.
    let _drop_on_stop = DropOnStop(shared);
    // Guarded, as the engine's other descriptors: programs close every descriptor they did
    // not open.
    let pagemap = match File::open("/proc/self/pagemap") {
        Ok(f) => tiermem_sys::guarded_fd::Guarded::new(f),
        Err(e) => {
            tracing::warn!("DAMON source stopped: opening /proc/self/pagemap: {e}");
            return;
        }
    };
    let mut chunk = Vec::with_capacity(FEED_CHUNK);
    let mut last_window = std::time::Instant::now();
    let stopping = || shared.shutdown.load(Ordering::Acquire) || shared.damon_stop.load(Ordering::Acquire);
    while !stopping() {
        // Held while waiting (100 ms at most), so that stopping it waits for no more.
        let next = {
            let mut events = shared.damon.lock().unwrap_or_else(|e| e.into_inner());
            let Some(events) = events.as_mut() else { return };
            match events.next(Duration::from_millis(100)) {
                // Its kdamond gone (stopped, say, by the run that started it while this
                // process lives on): nothing more will come.
                Ok(None) if last_window.elapsed() > KDAMOND_CHECK && !events.kdamond_running() => {
                    Err(tiermem_sys::Error::new(tiermem_sys::ErrorKind::Io, "the kdamond it listened to stopped"))
                }
                Ok(None) if last_window.elapsed() > KDAMOND_CHECK => {
                    last_window = std::time::Instant::now();
                    Ok(None)
                }
                other => other,
            }
        };
        let window = match next {
            Ok(Some(window)) => window,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!("DAMON source stopped: {e}");
                Stats::add(&shared.stats.counters.damon_errors, 1);
                return;
            }
        };
        last_window = std::time::Instant::now();
        Stats::add(&shared.stats.counters.damon_windows, 1);
        let accessed: Vec<DamonRegion> = window.into_iter().filter(|r| r.nr_accesses > 0).collect();
        if accessed.is_empty() {
            continue;
        }
        shared.monitor.begin_physical_window();
        if !feed_accessed_pages(shared, &pagemap, &accessed, &mut chunk) {
            return;
        }
    }
}

/// Drops the source's events when the thread ends for any reason (they may still be there
/// when a stop gave up waiting for them).
struct DropOnStop<'a>(&'a Shared);

impl Drop for DropOnStop<'_> {
    fn drop(&mut self) {
        self.0.drop_damon(&mut self.0.damon.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Find the resident pages of live regions whose frames lie in `accessed` (sorted by address)
/// and feed them to the monitor a chunk at a time. False if the engine shuts down meanwhile.
fn feed_accessed_pages(
    shared: &Shared,
    pagemap: &File,
    accessed: &[DamonRegion],
    chunk: &mut Vec<AccessedPage>,
) -> bool {
    // Where the regions are, with a weak reference each: a strong one would keep a closed
    // region's memory mapped, and a slot reused by a new region must not get the old one's pages.
    let spans: Vec<(u32, Weak<RegionInner>, usize, u64)> = {
        let regions = shared.regions();
        regions
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                let r = r.as_ref().filter(|r| !r.is_closing())?;
                Some((i as u32, Arc::downgrade(r), r.start(), r.page_count()))
            })
            .collect()
    };
    let mut buf = [0u8; PAGEMAP_CHUNK * 8];
    for (region, weak, start, count) in spans {
        if shared.shutdown.load(Ordering::Acquire) {
            return false;
        }
        let first_vpn = (start / PAGE_SIZE) as u64;
        let mut at = 0u64;
        while at < count {
            let n = ((count - at) as usize).min(PAGEMAP_CHUNK);
            let bytes = &mut buf[..n * 8];
            if pagemap.read_exact_at(bytes, (first_vpn + at) * 8).is_err() {
                break;
            }
            for (k, word) in bytes.chunks_exact(8).enumerate() {
                // A frame of 0: hidden (no CAP_SYS_ADMIN).
                let Some(pfn) =
                    tiermem_sys::pagemap::present_frame(word.try_into().unwrap_or_default()).filter(|&f| f != 0)
                else {
                    continue;
                };
                if let Some(r) = region_of(accessed, pfn * PAGE_SIZE as u64) {
                    chunk.push(AccessedPage { pfn, nr_accesses: r.nr_accesses, region, page: at + k as u64 });
                    if chunk.len() == FEED_CHUNK && !feed(shared, &weak, chunk) {
                        return false;
                    }
                }
            }
            at += n as u64;
        }
        if !feed(shared, &weak, chunk) {
            return false;
        }
    }
    true
}

/// Feed `chunk` (pages of the region `weak` refers to) to the monitor, unless that region was
/// closed meanwhile, and empty it. False if the engine shuts down meanwhile.
fn feed(shared: &Shared, weak: &Weak<RegionInner>, chunk: &mut Vec<AccessedPage>) -> bool {
    if chunk.is_empty() {
        return true;
    }
    let live = chunk.first().is_some_and(|p| {
        let regions = shared.regions();
        regions
            .slots
            .get(p.region as usize)
            .and_then(|r| r.as_ref())
            .is_some_and(|r| std::ptr::eq(Arc::as_ptr(r), weak.as_ptr()))
    });
    let fed = !live || {
        Stats::add(&shared.stats.counters.damon_pages, chunk.len() as u64);
        shared.monitor.physical_pages(shared, chunk)
    };
    chunk.clear();
    fed
}

/// The region of `sorted` (by address, not overlapping) holding physical address `addr`.
fn region_of(sorted: &[DamonRegion], addr: u64) -> Option<&DamonRegion> {
    let after = sorted.partition_point(|r| r.start <= addr);
    sorted.get(after.checked_sub(1)?).filter(|r| addr < r.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_found_in_its_region_only() {
        let r = |start, end| DamonRegion { start, end, nr_accesses: 1, age: 0 };
        let sorted = [r(0x1000, 0x3000), r(0x5000, 0x6000)];
        assert_eq!(region_of(&sorted, 0x0fff), None);
        assert_eq!(region_of(&sorted, 0x1000), Some(&sorted[0]));
        assert_eq!(region_of(&sorted, 0x2fff), Some(&sorted[0]));
        assert_eq!(region_of(&sorted, 0x3000), None, "a gap between regions");
        assert_eq!(region_of(&sorted, 0x5000), Some(&sorted[1]));
        assert_eq!(region_of(&sorted, 0x6000), None);
    }
}
