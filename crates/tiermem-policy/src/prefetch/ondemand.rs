use std::sync::Mutex;

use super::REGION_SLOTS;
use crate::{lock, owned, FaultInfo, PageList, Prefetcher};

/// Sequential readahead that ramps up, after Linux's on-demand file readahead (mm/readahead.c)
/// rather than its swap readahead: windows start at 4 pages and double up to `max_pages`.
/// Unlike file readahead it follows several streams per region, forward or backward: a sort's
/// partitioning walks one array from both ends at once, which a single window per region would
/// see as random misses and never follow.
///
/// - A miss inside a stream's current window or right after it continues that stream: its next
///   window starts after the faulting page, grown.
/// - A miss right next to a recent miss (after it or before it) starts a stream in that
///   direction with a small window, replacing the least recently used stream.
/// - Any other miss reads nothing and leaves the streams alone: random access costs no extra
///   device reads.
/// - A hit on the first page of a stream's newest window (its marker: the program has reached it
///   while it was still on its way, or touched it in the prefetch cache) reads the next window
///   now, so reads stay ahead of a program that consumes them faster than one window per device
///   latency.
///
/// Unlike swap readahead it needs no hit counts, which the engine cannot see when it maps
/// prefetched pages at once: progress through the windows is the evidence.
#[derive(Debug)]
pub struct Ondemand {
    max_pages: u64,
    state: Mutex<Box<[Region]>>,
}

/// What one region slot remembers.
#[derive(Debug, Clone, Copy, Default)]
struct Region {
    streams: [Stream; STREAMS],
    /// The latest misses, newest at `next_miss - 1` (a ring); `None` until filled.
    misses: [Option<u64>; MISSES],
    next_miss: usize,
    /// Counts calls, to find the least recently used stream.
    clock: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Stream {
    /// First page of the newest window in the stream's direction (its marker) and the window's
    /// size; size 0 = no stream.
    marker: u64,
    size: u64,
    backward: bool,
    last_used: u64,
}

/// First window of a new stream, pages.
const INITIAL_PAGES: u64 = 4;
/// Streams followed per region.
const STREAMS: usize = 4;
/// Recent misses kept per region to spot a new stream next to one of them.
const MISSES: usize = 8;

impl Ondemand {
    /// Windows of at most `max_pages` pages (at most [`PageList::CAPACITY`]).
    pub fn new(max_pages: u64) -> Self {
        Self {
            max_pages: max_pages.clamp(1, PageList::CAPACITY as u64),
            state: Mutex::new(vec![Region::default(); REGION_SLOTS].into_boxed_slice()),
        }
    }
}

impl Prefetcher for Ondemand {
    fn name(&self) -> &'static str {
        "ondemand"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, &mut lock(&self.state)[..], fault);
        push_window(window, out);
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, &mut owned(&mut self.state)[..], fault);
        push_window(window, out);
    }
}

fn grow(max_pages: u64, size: u64) -> u64 {
    (size * 2).clamp(INITIAL_PAGES.min(max_pages), max_pages)
}

/// A window to read: `len` pages from `first`, in the stream's direction.
#[derive(Debug, Clone, Copy)]
struct Window {
    first: u64,
    len: u64,
    backward: bool,
}

fn push_window(window: Option<Window>, out: &mut PageList) {
    let Some(w) = window else { return };
    for k in 0..w.len {
        out.push(if w.backward { w.first - k } else { w.first + k });
    }
}

impl Stream {
    /// Whether `page` lies in the newest window or just past it (the stream went on).
    fn continues(&self, page: u64) -> bool {
        if self.size == 0 {
            return false;
        }
        if self.backward {
            page <= self.marker && page.saturating_add(self.size) >= self.marker
        } else {
            page >= self.marker && page <= self.marker.saturating_add(self.size)
        }
    }
}

impl Ondemand {
    /// Update the streams for `fault`; the pages to read, if any.
    fn advance(max_pages: u64, state: &mut [Region], fault: &FaultInfo) -> Option<Window> {
        let r = &mut state[fault.region as usize % REGION_SLOTS];
        r.clock += 1;
        let page = fault.page;
        let (k, from, size) = if fault.hit {
            let k = r.streams.iter().position(|s| s.size > 0 && s.marker == page)?;
            let s = r.streams[k];
            let next = if s.backward { s.marker.checked_sub(s.size) } else { Some(s.marker + s.size) };
            (k, next, grow(max_pages, s.size))
        } else {
            let continued = r.streams.iter().position(|s| s.continues(page));
            let adjacent = |d: i64| r.misses.iter().flatten().any(|&m| m.checked_add_signed(d) == Some(page));
            let found = match continued {
                Some(k) => {
                    let s = r.streams[k];
                    Some((k, s.backward, grow(max_pages, s.size)))
                }
                None if adjacent(1) || adjacent(-1) => {
                    let backward = !adjacent(1);
                    let lru = (0..STREAMS).min_by_key(|&k| (r.streams[k].size > 0, r.streams[k].last_used));
                    lru.map(|k| (k, backward, INITIAL_PAGES.min(max_pages)))
                }
                None => None,
            };
            r.misses[r.next_miss] = Some(page);
            r.next_miss = (r.next_miss + 1) % MISSES;
            let (k, backward, size) = found?;
            r.streams[k].backward = backward;
            (k, if backward { page.checked_sub(1) } else { Some(page + 1) }, size)
        };
        let s = &mut r.streams[k];
        s.last_used = r.clock;
        // Clip to the region: [0, region_pages).
        let window = from.filter(|&f| f < fault.region_pages).map(|first| {
            let room = if s.backward { first + 1 } else { fault.region_pages - first };
            Window { first, len: size.min(room), backward: s.backward }
        });
        match window {
            Some(w) if w.len > 0 => {
                s.marker = w.first;
                s.size = w.len;
                Some(w)
            }
            _ => {
                s.size = 0;
                None
            }
        }
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
    fn random_misses_read_nothing_and_leave_the_streams_alone() {
        let p = Ondemand::new(64);
        call(&p, 10, false);
        assert_eq!(call(&p, 11, false), vec![12, 13, 14, 15]);
        assert!(call(&p, 5000, false).is_empty());
        assert!(call(&p, 9000, false).is_empty());
        assert_eq!(call(&p, 12, true), (16..24).collect::<Vec<_>>(), "the stream goes on past random misses");
    }

    #[test]
    fn two_interleaved_streams_in_opposite_directions_are_both_followed() {
        // A partition step: one index walks up from 1000, the other down from 5000.
        let p = Ondemand::new(64);
        assert!(call(&p, 1000, false).is_empty());
        assert!(call(&p, 5000, false).is_empty());
        assert_eq!(call(&p, 1001, false), vec![1002, 1003, 1004, 1005]);
        assert_eq!(call(&p, 4999, false), vec![4998, 4997, 4996, 4995], "a backward stream reads downwards");
        assert_eq!(call(&p, 1002, true), (1006..1014).collect::<Vec<_>>());
        assert_eq!(call(&p, 4998, true), (4987..4995).rev().collect::<Vec<_>>());
        // A miss just past the backward window continues it, grown.
        assert_eq!(call(&p, 4986, false), (4970..4986).rev().collect::<Vec<_>>());
    }

    #[test]
    fn a_backward_stream_stops_at_page_zero() {
        let p = Ondemand::new(64);
        call(&p, 3, false);
        assert_eq!(call(&p, 2, false), vec![1, 0]);
        assert!(call(&p, 1, true).is_empty());
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
