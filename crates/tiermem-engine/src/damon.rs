//! DAMON as a live source of the access monitor (`EngineConfig::damon`): the kernel samples
//! the accessed bits of physical memory, something faults cannot show (a resident page that
//! the program keeps using never faults again). At the end of each of DAMON's aggregation
//! windows this thread finds the resident managed pages whose frames lie in regions DAMON saw
//! accessed (from /proc/self/pagemap), enters them in the monitor's reverse page table, and
//! feeds the regions to the monitor as the paper's physical-address source: through the
//! hot-page table and the reverse page table into the ring, where a hot page gets its
//! referenced bit (replacement passes it over once) and goes to the prefetcher's `on_report`.
//!
//! DAMON's view is coarse: regions of megabytes, and on this VM the boot-time kdamond samples
//! every 0.5 s and aggregates every 5 s. A page is reported when its region was found accessed
//! in at least N samples of a window (the hot threshold).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tiermem_monitor::damon::{DamonEvents, DamonRegion};
use tiermem_sys::PAGE_SIZE;

use crate::engine::Shared;
use crate::stats::Stats;

/// Sampling interval and aggregation window of a kdamond the engine starts itself (only when
/// no kdamond exists): fine enough to tell a working set within a second.
pub(crate) const OWN_SAMPLE: Duration = Duration::from_millis(5);
pub(crate) const OWN_WINDOW: Duration = Duration::from_millis(100);

/// Pagemap entries read per call.
const PAGEMAP_CHUNK: usize = 512;
/// Frames fed to the monitor per hold of its lock (the fault path skips the monitor while it
/// is held), and so the ring room waited for first.
const FEED_CHUNK: usize = 2048;

/// A resident managed page whose frame DAMON found accessed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct AccessedPage {
    pub(crate) pfn: u64,
    pub(crate) nr_accesses: u32,
    pub(crate) region: u32,
    pub(crate) page: u64,
}

/// The thread: one round per aggregation window until shutdown.
pub(crate) fn damon_thread(shared: &Shared, mut events: DamonEvents) {
    let pagemap = match File::open("/proc/self/pagemap") {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("DAMON source stopped: opening /proc/self/pagemap: {e}");
            return;
        }
    };
    while !shared.shutdown.load(Ordering::Acquire) {
        let window = match events.next(Duration::from_millis(100)) {
            Ok(Some(window)) => window,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!("DAMON source stopped: {e}");
                return;
            }
        };
        Stats::add(&shared.stats.counters.damon_windows, 1);
        let accessed: Vec<DamonRegion> = window.into_iter().filter(|r| r.nr_accesses > 0).collect();
        if accessed.is_empty() {
            continue;
        }
        let pages = accessed_pages(shared, &pagemap, &accessed);
        Stats::add(&shared.stats.counters.damon_pages, pages.len() as u64);
        for chunk in pages.chunks(FEED_CHUNK) {
            if !shared.monitor.physical_pages(shared, chunk) {
                return;
            }
        }
    }
}

/// The resident pages of live regions whose frames lie in `accessed` (sorted by address),
/// sorted by frame.
fn accessed_pages(shared: &Shared, pagemap: &File, accessed: &[DamonRegion]) -> Vec<AccessedPage> {
    // Where the regions are, not the regions: holding one would keep a closed region's memory
    // mapped. A region closed meanwhile yields pages whose reports the monitor thread drops.
    let spans: Vec<(u32, usize, u64)> = {
        let regions = shared.regions();
        regions
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().filter(|r| !r.is_closing()).map(|r| (i as u32, r.start(), r.page_count())))
            .collect()
    };
    let mut out = Vec::new();
    let mut buf = [0u8; PAGEMAP_CHUNK * 8];
    for (region, start, count) in spans {
        let first_vpn = (start / PAGE_SIZE) as u64;
        let mut at = 0u64;
        while at < count {
            let n = ((count - at) as usize).min(PAGEMAP_CHUNK);
            let bytes = &mut buf[..n * 8];
            if pagemap.read_exact_at(bytes, (first_vpn + at) * 8).is_err() {
                break;
            }
            for (k, word) in bytes.chunks_exact(8).enumerate() {
                let entry = u64::from_le_bytes(word.try_into().unwrap_or_default());
                // Bit 63: present; bits 0..=54: the frame (0 without CAP_SYS_ADMIN).
                let pfn = entry & ((1 << 55) - 1);
                if entry & (1 << 63) == 0 || pfn == 0 {
                    continue;
                }
                if let Some(r) = region_of(accessed, pfn * PAGE_SIZE as u64) {
                    out.push(AccessedPage { pfn, nr_accesses: r.nr_accesses, region, page: at + k as u64 });
                }
            }
            at += n as u64;
        }
    }
    out.sort_unstable();
    out
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
