use std::sync::Mutex;

use super::REGION_SLOTS;
use crate::{lock, owned, FaultInfo, PageList, Prefetcher};

/// Sequential readahead that ramps up, after Linux's on-demand file readahead (mm/readahead.c)
/// rather than its swap readahead: windows run forward only, start at 4 pages and double up to
/// `max_pages`.
///
/// - A miss inside the current window or right after it continues the stream: the next window
///   starts after the faulting page, grown.
/// - A second miss right after the previous one starts a stream with a small window.
/// - Any other miss reads nothing: random access costs no extra device reads.
/// - A hit on the first page of the newest window (its marker: the program has reached it while
///   it was still on its way, or touched it in the prefetch cache) reads the next window now, so
///   reads stay ahead of a program that consumes them faster than one window per device latency.
///
/// Unlike swap readahead it needs no hit counts, which the engine cannot see when it maps
/// prefetched pages at once: progress through the windows is the evidence.
#[derive(Debug)]
pub struct Ondemand {
    max_pages: u64,
    state: Mutex<[Window; REGION_SLOTS]>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Window {
    /// First page of the newest window (its marker) and its size; size 0 = no stream.
    start: u64,
    size: u64,
    prev_miss: Option<u64>,
}

/// First window of a new stream, pages.
const INITIAL_PAGES: u64 = 4;

impl Ondemand {
    /// Windows of at most `max_pages` pages (at most [`PageList::CAPACITY`]).
    pub fn new(max_pages: u64) -> Self {
        Self {
            max_pages: max_pages.clamp(1, PageList::CAPACITY as u64),
            state: Mutex::new([Window::default(); REGION_SLOTS]),
        }
    }
}

impl Prefetcher for Ondemand {
    fn name(&self) -> &'static str {
        "ondemand"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, &mut lock(&self.state), fault);
        push_range(window, out);
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, owned(&mut self.state), fault);
        push_range(window, out);
    }
}

fn grow(max_pages: u64, size: u64) -> u64 {
    (size * 2).clamp(INITIAL_PAGES.min(max_pages), max_pages)
}

fn push_range(window: Option<(u64, u64)>, out: &mut PageList) {
    let Some((start, end)) = window else { return };
    for p in start..end {
        out.push(p);
    }
}

impl Ondemand {
    /// Update the window for `fault`; the pages to read, if any.
    fn advance(max_pages: u64, state: &mut [Window; REGION_SLOTS], fault: &FaultInfo) -> Option<(u64, u64)> {
        let w = &mut state[fault.region as usize % REGION_SLOTS];
        let page = fault.page;
        let (start, size) = if fault.hit {
            if w.size == 0 || page != w.start {
                return None;
            }
            (w.start + w.size, grow(max_pages, w.size))
        } else {
            let in_stream = w.size > 0 && page >= w.start && page <= w.start + w.size;
            let adjacent = w.prev_miss.is_some_and(|p| p + 1 == page);
            w.prev_miss = Some(page);
            if in_stream {
                (page + 1, grow(max_pages, w.size))
            } else if adjacent {
                (page + 1, INITIAL_PAGES.min(max_pages))
            } else {
                w.size = 0;
                return None;
            }
        };
        let end = start.saturating_add(size).min(fault.region_pages);
        if end <= start {
            w.size = 0;
            return None;
        }
        w.start = start;
        w.size = end - start;
        Some((start, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(p: &Ondemand, page: u64, hit: bool) -> Vec<u64> {
        let mut out = PageList::default();
        p.on_fault(&FaultInfo { region: 0, page, region_pages: 10_000, write: false, hit }, &mut out);
        out.as_slice().to_vec()
    }

    #[test]
    fn a_sequential_scan_ramps_the_window_up_to_the_maximum() {
        let p = Ondemand::new(64);
        assert!(call(&p, 100, false).is_empty(), "a lone miss reads nothing");
        assert_eq!(call(&p, 101, false), vec![102, 103, 104, 105], "two adjacent misses: 4 pages");
        // The program went through the window and missed right after it: the window doubles.
        assert_eq!(call(&p, 106, false), (107..115).collect::<Vec<_>>());
        // A hit on the marker (107, the newest window's first page) reads the next one now.
        assert_eq!(call(&p, 107, true), (115..131).collect::<Vec<_>>());
        assert!(call(&p, 108, true).is_empty(), "hits past the marker read nothing");
        assert_eq!(call(&p, 115, true), (131..163).collect::<Vec<_>>());
        assert_eq!(call(&p, 131, true), (163..227).collect::<Vec<_>>());
        assert_eq!(call(&p, 163, true), (227..291).collect::<Vec<_>>(), "capped at 64");
        // A miss inside the window (a page dropped before use) continues the stream from there.
        assert_eq!(call(&p, 230, false), (231..295).collect::<Vec<_>>());
    }

    #[test]
    fn a_smaller_maximum_caps_every_window() {
        let p = Ondemand::new(2);
        call(&p, 0, false);
        assert_eq!(call(&p, 1, false), vec![2, 3]);
        assert_eq!(call(&p, 2, true), vec![4, 5]);
        assert_eq!(call(&p, 5, false), vec![6, 7]);
    }

    #[test]
    fn random_misses_read_nothing_and_end_the_stream() {
        let p = Ondemand::new(64);
        call(&p, 10, false);
        assert_eq!(call(&p, 11, false).len(), 4);
        assert!(call(&p, 5000, false).is_empty());
        assert!(call(&p, 12, true).is_empty(), "the stream ended: its marker means nothing now");
        assert!(call(&p, 17, false).is_empty());
    }

    #[test]
    fn windows_stop_at_the_region_end() {
        let p = Ondemand::new(64);
        let mut out = PageList::default();
        for page in [96, 97] {
            out.clear();
            p.on_fault(&FaultInfo { region: 0, page, region_pages: 100, write: false, hit: false }, &mut out);
        }
        assert_eq!(out.as_slice(), &[98, 99]);
        out.clear();
        p.on_fault(&FaultInfo { region: 0, page: 99, region_pages: 100, write: false, hit: false }, &mut out);
        assert!(out.is_empty());
    }
}
