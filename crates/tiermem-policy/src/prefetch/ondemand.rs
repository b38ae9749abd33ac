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
///
/// With strides on (`stride`, see [`Ondemand::with_strides`]) a stream may also step by more
/// than one page: a miss that continues two recent misses at (about) the same distance, up to
/// [`MAX_STRIDE`] pages, starts one whose windows are every stride-th page. Column-major dense
/// algebra misses that way: LAPACK's row interchanges and the trailing-matrix updates of an LU
/// factorisation touch one page per column or per block of columns (Linpack at 20% of its
/// footprint: a fifth of its misses 175 pages apart, as many 11 apart).
#[derive(Debug)]
pub struct Ondemand {
    max_pages: u64,
    strides: bool,
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
    /// size in pages; size 0 = no stream.
    marker: u64,
    size: u64,
    /// Pages from one page of a window to the next: 1 or -1 for a sequential stream.
    stride: i64,
    last_used: u64,
}

/// First window of a new stream, pages.
const INITIAL_PAGES: u64 = 4;
/// Streams followed per region.
const STREAMS: usize = 4;
/// Recent misses kept per region to spot a new stream next to one of them.
const MISSES: usize = 8;
/// Longest stride a strided stream may have, pages (a few hundred: one page per block of
/// columns of a matrix of a few thousand doubles a column; longer ones are rarer than chance).
pub const MAX_STRIDE: i64 = 512;
/// Most pages of a strided window. Strided runs are short (a block of rows across the columns
/// of a panel), so long windows read mostly pages nobody uses: replaying Linpack's misses at 16%
/// local memory (`tiermem sim`, no prefetching when recorded), windows of at most 4 pages took
/// 25.8 k faults for 173 k prefetches at 85% accuracy; 64 pages, 23.5 k for 261 k at 64% (before
/// short strides had to match exactly); `ondemand`: 58 k for 149 k at 75%.
const MAX_STRIDED_PAGES: u64 = 4;
/// How far (pages) a strided stream's miss may lie from the page the stride predicts and still
/// continue it: a matrix column of 5.47 pages puts columns 5 or 6 pages apart. Strides too short
/// for it to leave pages out (below 4) must match exactly, or they would take a sequential
/// scan's misses for theirs.
const STRIDE_SLACK: i64 = 1;

/// The slack allowed around a stride of `stride` pages.
fn slack(stride: i64) -> i64 {
    if stride.abs() > 2 * STRIDE_SLACK + 1 {
        STRIDE_SLACK
    } else {
        0
    }
}

impl Ondemand {
    /// Windows of at most `max_pages` pages (at most [`PageList::CAPACITY`]).
    pub fn new(max_pages: u64) -> Self {
        Self {
            max_pages: max_pages.clamp(1, PageList::CAPACITY as u64),
            strides: false,
            state: Mutex::new(vec![Region::default(); REGION_SLOTS].into_boxed_slice()),
        }
    }

    /// [`Ondemand::new`] that also follows strided streams.
    pub fn with_strides(max_pages: u64) -> Self {
        Self { strides: true, ..Self::new(max_pages) }
    }
}

impl Prefetcher for Ondemand {
    fn name(&self) -> &'static str {
        if self.strides {
            "stride"
        } else {
            "ondemand"
        }
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, self.strides, &mut lock(&self.state)[..], fault);
        push_window(window, out);
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let window = Self::advance(self.max_pages, self.strides, &mut owned(&mut self.state)[..], fault);
        push_window(window, out);
    }
}

fn grow(max_pages: u64, size: u64) -> u64 {
    (size * 2).clamp(INITIAL_PAGES.min(max_pages), max_pages)
}

/// A window to read: `len` pages from `first`, `stride` pages apart.
#[derive(Debug, Clone, Copy)]
struct Window {
    first: u64,
    len: u64,
    stride: i64,
}

fn push_window(window: Option<Window>, out: &mut PageList) {
    let Some(w) = window else { return };
    for k in 0..w.len {
        // In the region: the window was clipped to it.
        out.push(w.first.wrapping_add_signed(k as i64 * w.stride));
    }
}

impl Stream {
    /// Whether `page` lies in the newest window or just past it (the stream went on); for a
    /// strided stream, within [`STRIDE_SLACK`] of one of those pages.
    fn continues(&self, page: u64) -> bool {
        if self.size == 0 {
            return false;
        }
        let ahead = (page as i64).wrapping_sub(self.marker as i64);
        if self.stride.abs() == 1 {
            let ahead = ahead * self.stride;
            return ahead >= 0 && ahead as u64 <= self.size;
        }
        // The window page nearest to `page`, counted from the marker.
        let (along, stride) = (ahead * self.stride.signum(), self.stride.abs());
        let steps = (along + stride / 2).div_euclid(stride);
        (0..=self.size as i64).contains(&steps) && (along - steps * stride).abs() <= slack(stride)
    }
}

impl Region {
    /// The stride a miss at `page` continues: a recent miss `d` pages before it that followed
    /// an older one at about the same distance (2 <= |d| <= MAX_STRIDE), newest misses first.
    fn stride_to(&self, page: u64) -> Option<i64> {
        // The ring from the newest miss back.
        let age = |a: usize| self.misses[(self.next_miss + MISSES - 1 - a) % MISSES];
        (0..MISSES).find_map(|a| {
            let newer = age(a)?;
            let d = (page as i64).wrapping_sub(newer as i64);
            let follows = |older: u64| ((newer as i64).wrapping_sub(older as i64) - d).abs() <= slack(d);
            let seen = (a + 1..MISSES).filter_map(age).any(follows);
            ((2..=MAX_STRIDE).contains(&d.abs()) && seen).then_some(d)
        })
    }
}

impl Ondemand {
    /// Update the streams for `fault`; the pages to read, if any.
    fn advance(max_pages: u64, strides: bool, state: &mut [Region], fault: &FaultInfo) -> Option<Window> {
        let r = &mut state[fault.region as usize % REGION_SLOTS];
        r.clock += 1;
        let page = fault.page;
        let (k, from, size) = if fault.hit {
            let k = r.streams.iter().position(|s| s.size > 0 && s.marker == page)?;
            let s = r.streams[k];
            (k, step(s.marker, s.size as i64 * s.stride), grow(max_pages, s.size))
        } else {
            // Sequential streams first, then a new sequential one, then strided ones, shortest
            // stride first: a scan's misses are never taken for a stride's, nor a stride's for
            // one of its multiples (which reads every other page of it).
            let continued = |sequential: bool| {
                let going_on =
                    |k: &usize| (r.streams[*k].stride.abs() == 1) == sequential && r.streams[*k].continues(page);
                (0..STREAMS).filter(going_on).min_by_key(|&k| r.streams[k].stride.abs())
            };
            let adjacent = |d: i64| r.misses.iter().flatten().any(|&m| m.checked_add_signed(d) == Some(page));
            let lru = || (0..STREAMS).min_by_key(|&k| (r.streams[k].size > 0, r.streams[k].last_used));
            let go_on = |k: usize| Some((k, r.streams[k].stride, grow(max_pages, r.streams[k].size)));
            let found = match continued(true) {
                Some(k) => go_on(k),
                None if adjacent(1) || adjacent(-1) => {
                    let stride = if adjacent(1) { 1 } else { -1 };
                    lru().map(|k| (k, stride, INITIAL_PAGES.min(max_pages)))
                }
                None => match continued(false) {
                    Some(k) => go_on(k),
                    None if strides => {
                        r.stride_to(page).and_then(|d| lru().map(|k| (k, d, INITIAL_PAGES.min(max_pages))))
                    }
                    None => None,
                },
            };
            r.misses[r.next_miss] = Some(page);
            r.next_miss = (r.next_miss + 1) % MISSES;
            let (k, stride, size) = found?;
            r.streams[k].stride = stride;
            (k, step(page, stride), size)
        };
        let s = &mut r.streams[k];
        s.last_used = r.clock;
        let size = if s.stride.abs() > 1 { size.min(MAX_STRIDED_PAGES) } else { size };
        // Clip to the region: [0, region_pages).
        let window = from.filter(|&f| f < fault.region_pages).map(|first| {
            let room = if s.stride > 0 {
                (fault.region_pages - 1 - first) / s.stride as u64 + 1
            } else {
                first / s.stride.unsigned_abs() + 1
            };
            Window { first, len: size.min(room), stride: s.stride }
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

/// `page + delta`, if that is not below page 0.
fn step(page: u64, delta: i64) -> Option<u64> {
    page.checked_add_signed(delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(p: &Ondemand, page: u64, hit: bool) -> Vec<u64> {
        call_in(p, page, hit, 10_000)
    }

    fn call_in(p: &Ondemand, page: u64, hit: bool, region_pages: u64) -> Vec<u64> {
        let mut out = PageList::default();
        p.on_fault(&FaultInfo { offset: 0, region: 0, page, region_pages, write: false, hit }, &mut out);
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

    /// [`call`] in a region of 100,000 pages.
    fn stride_call(p: &Ondemand, page: u64, hit: bool) -> Vec<u64> {
        call_in(p, page, hit, 100_000)
    }

    /// Three misses in a row; what the third reads.
    fn third_miss(p: &Ondemand, misses: [u64; 3]) -> Vec<u64> {
        stride_call(p, misses[0], false);
        stride_call(p, misses[1], false);
        stride_call(p, misses[2], false)
    }

    #[test]
    fn strided_misses_start_a_strided_stream_only_with_strides_on() {
        let plain = Ondemand::new(64);
        let p = Ondemand::with_strides(64);
        assert_eq!((plain.name(), p.name()), ("ondemand", "stride"));
        for page in [1000, 1175] {
            assert!(stride_call(&p, page, false).is_empty(), "one distance is no stride yet");
            assert!(stride_call(&plain, page, false).is_empty());
        }
        // A third miss 175 pages on: every 175th page, 4 of them.
        assert_eq!(stride_call(&p, 1350, false), vec![1525, 1700, 1875, 2050]);
        assert!(stride_call(&plain, 1350, false).is_empty(), "ondemand follows no strides");
        // A hit on the marker reads the next window (strided windows stay at 4 pages).
        assert_eq!(stride_call(&p, 1525, true), (0..4).map(|k| 2225 + 175 * k).collect::<Vec<_>>());
        // A miss one page off a window page (a column of 5.47 pages) continues the stream from
        // there.
        assert_eq!(stride_call(&p, 2401, false), (1..=4).map(|k| 2401 + 175 * k).collect::<Vec<_>>());
        // A miss far from every window page starts nothing.
        assert!(stride_call(&p, 2401 + 175 * 2 + 40, false).is_empty());
    }

    #[test]
    fn a_stride_about_right_twice_counts_and_random_or_far_misses_do_not() {
        let p = Ondemand::with_strides(64);
        // 5 then 6 pages apart (columns of 5.47 pages): stride 6 from the newest.
        assert_eq!(third_miss(&p, [500, 505, 511]), vec![517, 523, 529, 535]);
        // Backward strides too.
        let p = Ondemand::with_strides(64);
        assert_eq!(third_miss(&p, [9000, 8989, 8978]), vec![8967, 8956, 8945, 8934]);
        // Distances past MAX_STRIDE are not strides; neither are unrelated misses.
        let p = Ondemand::with_strides(64);
        let far = MAX_STRIDE as u64 + 1;
        for page in [100, 100 + far, 100 + 2 * far, 7, 60_000, 31_337] {
            assert!(stride_call(&p, page, false).is_empty(), "page {page}");
        }
    }

    #[test]
    fn a_scan_s_misses_are_not_taken_for_a_short_stride() {
        let p = Ondemand::with_strides(64);
        // Misses 2 apart: a stride of 2.
        assert_eq!(third_miss(&p, [1000, 1002, 1004]), vec![1006, 1008, 1010, 1012]);
        // A scan through the same pages: its misses start and continue a sequential stream,
        // not the stride-2 one.
        assert_eq!(stride_call(&p, 1007, false), Vec::<u64>::new(), "1007 is no stride-2 page, nor next to a miss");
        assert_eq!(stride_call(&p, 1008, false), vec![1009, 1010, 1011, 1012]);
        // Short strides must match exactly: 3 pages, then 2, is no stride of 2.
        let p = Ondemand::with_strides(64);
        assert_eq!(third_miss(&p, [5000, 5003, 5005]), Vec::<u64>::new());
    }

    #[test]
    fn a_backward_strided_stream_stops_at_page_zero_and_a_forward_one_at_the_region_end() {
        let p = Ondemand::with_strides(64);
        for page in [250, 150] {
            stride_call(&p, page, false);
        }
        assert_eq!(stride_call(&p, 50, false), Vec::<u64>::new(), "the next page along would be below 0");
        let p = Ondemand::with_strides(64);
        let mut out = PageList::default();
        for page in [100, 200, 300] {
            out.clear();
            p.on_fault(
                &FaultInfo { offset: 0, region: 0, page, region_pages: 650, write: false, hit: false },
                &mut out,
            );
        }
        assert_eq!(out.as_slice(), &[400, 500, 600]);
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
            p.on_fault(
                &FaultInfo { offset: 0, region: 0, page, region_pages: 100, write: false, hit: false },
                &mut out,
            );
        }
        assert_eq!(out.as_slice(), &[98, 99]);
        out.clear();
        p.on_fault(
            &FaultInfo { offset: 0, region: 0, page: 99, region_pages: 100, write: false, hit: false },
            &mut out,
        );
        assert!(out.is_empty());
    }
}
