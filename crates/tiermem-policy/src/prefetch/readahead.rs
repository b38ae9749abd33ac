use std::sync::Mutex;

use super::REGION_SLOTS;
use crate::{lock, owned, FaultInfo, PageList, Prefetcher};

/// Linux's VMA-based swap readahead (mm/swap_state.c, `swap_vma_readahead`).
///
/// The window is `hits + 2` rounded up to a power of two, at most `2^page_cluster` pages (page
/// cluster 3 = 8), and never below half the previous window; `hits` counts prefetch hits since
/// the last miss. Two misses with no hit in between keep a window of 2 only when they are on
/// adjacent pages, else the window is the faulting page alone. The window runs forward from a
/// fault right after the previous one, backward from a fault right before it, and is centred
/// on the faulting page otherwise; it is clipped to the region.
#[derive(Debug)]
pub struct Readahead {
    max_pages: u64,
    state: Mutex<[History; REGION_SLOTS]>,
}

#[derive(Debug, Clone, Copy, Default)]
struct History {
    prev_page: Option<u64>,
    prev_window: u64,
    hits: u64,
}

impl Readahead {
    /// Windows of at most `2^page_cluster` pages.
    pub fn new(page_cluster: u32) -> Self {
        Self { max_pages: 1 << page_cluster.min(6), state: Mutex::new([History::default(); REGION_SLOTS]) }
    }
}

impl Prefetcher for Readahead {
    fn name(&self) -> &'static str {
        "readahead"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, &mut lock(&self.state), fault);
        push_window(window, fault, out);
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, owned(&mut self.state), fault);
        push_window(window, fault, out);
    }
}

/// Push the pages of `start..end` except the faulting one, clipped to the region.
fn push_window(window: Option<(u64, u64)>, fault: &FaultInfo, out: &mut PageList) {
    let Some((start, end)) = window else { return };
    for p in start..end.min(fault.region_pages) {
        if p != fault.page {
            out.push(p);
        }
    }
}

impl Readahead {
    /// Update the history for `fault`; the window to read on a miss.
    fn advance(max_pages: u64, state: &mut [History; REGION_SLOTS], fault: &FaultInfo) -> Option<(u64, u64)> {
        let h = &mut state[fault.region as usize % REGION_SLOTS];
        if fault.hit {
            h.hits += 1;
            return None;
        }
        let page = fault.page;
        let adjacent = h.prev_page.is_some_and(|p| p.abs_diff(page) == 1);
        let mut window = h.hits + 2;
        if window == 2 {
            if !adjacent {
                window = 1;
            }
        } else {
            window = window.next_power_of_two();
        }
        window = window.min(max_pages).max(h.prev_window / 2);
        let (start, end) = match h.prev_page {
            _ if window == 1 => (page, page + 1),
            Some(p) if page == p + 1 => (page, page + window),
            Some(p) if page + 1 == p => ((page + 1).saturating_sub(window), page + 1),
            _ => {
                let start = page.saturating_sub((window - 1) / 2);
                (start, start + window)
            }
        };
        h.prev_page = Some(page);
        h.prev_window = window;
        h.hits = 0;
        Some((start, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(page: u64, hit: bool) -> FaultInfo {
        FaultInfo { offset: 0, region: 0, page, region_pages: 1000, write: false, hit }
    }

    fn run(ra: &Readahead, page: u64) -> Vec<u64> {
        let mut out = PageList::default();
        ra.on_fault(&fault(page, false), &mut out);
        out.as_slice().to_vec()
    }

    #[test]
    fn window_grows_with_hits_runs_with_the_direction_and_shrinks_by_halves() {
        let ra = Readahead::new(3);
        assert!(run(&ra, 100).is_empty(), "first miss, no history: the page alone");
        assert_eq!(run(&ra, 101), vec![102], "adjacent miss: window 2, forward");
        for _ in 0..2 {
            ra.on_fault(&fault(102, true), &mut PageList::default());
        }
        // hits 2 → 4 pages, forward from 102 (= previous + 1).
        assert_eq!(run(&ra, 102), vec![103, 104, 105]);
        for _ in 0..9 {
            ra.on_fault(&fault(104, true), &mut PageList::default());
        }
        // hits 9 → 11 → 16, capped at 8 pages; backward from 101 (= previous − 1).
        assert_eq!(run(&ra, 101), vec![94, 95, 96, 97, 98, 99, 100]);
        // No hits: 2 → 1, but never below half the previous window (4); centred on 500.
        assert_eq!(run(&ra, 500), vec![499, 501, 502]);
        assert_eq!(run(&ra, 800), vec![801], "half of 4 is 2, centred: start = 800 − 0");
        assert!(run(&ra, 10).is_empty(), "window 1 at last");
    }

    #[test]
    fn clipped_at_the_region_end() {
        let ra = Readahead::new(3);
        run(&ra, 997);
        let mut out = PageList::default();
        ra.on_fault(&fault(998, true), &mut out);
        ra.on_fault(&fault(998, true), &mut out);
        assert_eq!(run(&ra, 998), vec![999]);
    }
}
