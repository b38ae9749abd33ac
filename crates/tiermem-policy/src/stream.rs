//! The stream training table of §3.2, shared by the stream prefetcher and stream-first
//! replacement.
//!
//! 64 entries managed LRU; each entry belongs to one owner (a pid in the paper, a region slot in
//! the engine) and remembers up to 5 page numbers. A new page joins the most recently used entry
//! of its owner whose first page is less than 64 pages away; otherwise it takes over the least
//! recently used entry. Once an entry holds 5 pages, the most frequent distance between adjacent
//! pages is the stream's stride, and the page to prefetch is `end + i × stride` (i = 100), where
//! `end` is the newest page. The window then slides: the oldest page leaves, so `first` follows
//! the stream.

use std::sync::Mutex;

use crate::{lock, owned};

/// Most entries a table can be built with.
pub const MAX_ENTRIES: usize = 256;
/// Most pages an entry can be built to remember.
pub const MAX_HISTORY: usize = 16;
/// Most strides a ramping stream reads for one trained page (catching up after its end jumped).
pub const MAX_RAMP_BURST: u64 = 16;

/// The stream table's parameters; the defaults are the paper's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamConfig {
    /// Entries in the training table (paper: 64).
    pub entries: usize,
    /// Page numbers per entry (paper: 5).
    pub history: usize,
    /// A page joins an entry when it is less than this many pages from the entry's first page
    /// (paper: 64).
    pub join_distance: u64,
    /// How many strides ahead of the stream's end to prefetch (paper: i = 100).
    pub distance: u64,
    /// Pages prefetched per trained page: `end + (i + k) × stride` for k in 0..depth (paper: 1).
    pub depth: usize,
    /// 0: the paper's fixed distance. Otherwise a newly detected stream is read `ramp` strides
    /// ahead, one stride further for every page it walks on, up to `distance`, and the strides
    /// in between are read too (at most [`MAX_RAMP_BURST`] a page): a stream that ends early
    /// leaves fewer unused pages behind, one that goes on is soon read as far ahead as the
    /// paper's. Not the paper's (an addition; `tiermem sim --stream-ramp`).
    pub ramp: u64,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self { entries: 64, history: 5, join_distance: 64, distance: 100, depth: 1, ramp: 0 }
    }
}

impl StreamConfig {
    /// Check the ranges the fixed-size table supports.
    pub fn validate(&self) -> crate::Result<()> {
        if !(1..=MAX_ENTRIES).contains(&self.entries) {
            return Err(crate::Error::invalid(format!("stream entries {} must be in 1..={MAX_ENTRIES}", self.entries)));
        }
        if !(3..=MAX_HISTORY).contains(&self.history) {
            return Err(crate::Error::invalid(format!("stream history {} must be in 3..={MAX_HISTORY}", self.history)));
        }
        if self.depth == 0 || self.depth > crate::PageList::CAPACITY {
            return Err(crate::Error::invalid(format!(
                "stream depth {} must be in 1..={}",
                self.depth,
                crate::PageList::CAPACITY
            )));
        }
        if self.join_distance == 0 || self.distance == 0 {
            return Err(crate::Error::invalid("stream join distance and prefetch distance must be at least 1"));
        }
        Ok(())
    }
}

/// A detected stream after training on one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    /// The newest page.
    pub end: u64,
    /// Most frequent distance between adjacent pages.
    pub stride: i64,
    /// The pages to prefetch are `end + k × stride` for k in `ahead.0..=ahead.1` (none when
    /// the first is larger): `i..=i + depth - 1` with the paper's fixed distance.
    pub ahead: (u64, u64),
}

impl Stream {
    /// The stream of `end` and `stride` as the paper prefetches it: `config.depth` pages from
    /// `config.distance` strides ahead.
    pub fn fixed(end: u64, stride: i64, config: &StreamConfig) -> Self {
        let last = config.distance.saturating_add(config.depth.max(1) as u64 - 1);
        Self { end, stride, ahead: (config.distance, last) }
    }
}

/// One training entry. Everything a lookup or a classification reads (`used`, `owner`,
/// `first`, the hull, the links) sits in its first cache line, and the paper's five pages in
/// the next: training touches two lines of one entry instead of one line in each of a dozen
/// arrays.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Entry {
    /// Last use, for LRU; 0 = never used (free).
    used: u64,
    /// Oldest remembered page.
    first: u64,
    /// Smallest and largest remembered page (the part of the stream already used); kept only
    /// while `stride` is not 0.
    lo: u64,
    hi: u64,
    /// Detected stride (0 = no stream yet).
    stride: i64,
    /// With a ramp: the farthest page read ahead for the stream so far, and how many pages
    /// the stream has walked since its stride was found.
    front: u64,
    owner: u32,
    run: u32,
    /// Neighbours in the LRU list.
    prev: u16,
    next: u16,
    len: u8,
    /// Remembered pages, oldest first (`len` of them).
    pages: [u64; MAX_HISTORY],
}

const FREE: Entry = Entry {
    used: 0,
    first: 0,
    lo: 0,
    hi: 0,
    stride: 0,
    front: 0,
    owner: 0,
    run: 0,
    prev: NONE,
    next: NONE,
    len: 0,
    pages: [0; MAX_HISTORY],
};

#[derive(Debug)]
struct Entries {
    clock: u64,
    /// The most recently used entry: checked first, since accesses come in runs.
    mru: usize,
    /// Ends of the LRU list (its tail is the least recently used entry).
    head: u16,
    tail: u16,
    /// Detected streams too wide for `hulls` (then every `in_stream` scans).
    wide: u32,
    e: [Entry; MAX_ENTRIES],
    /// The low 16 bits of each entry's first page, side by side so that a lookup compares them
    /// all in one branch-free pass (see [`near_firsts`]).
    first_lows: [u16; MAX_ENTRIES],
    /// Counting filter: detected streams whose walked range covers each (owner, bucket) slot.
    hulls: [u16; FILTER],
    /// Bit i set while entry i has a stride: where the hull filter lets a page through, only
    /// these entries can hold it (most entries of a random access pattern have none).
    strided: [u64; MAX_ENTRIES / LANES],
}

/// Slots of the hull filter: a few times the most entries, and small enough (2 KiB) to stay in
/// L1 next to the entries.
const FILTER: usize = 1024;
/// Most buckets one stream's range may cover in the `hulls` filter.
const MAX_HULL_BUCKETS: u64 = 16;
const NONE: u16 = u16::MAX;
/// Entries compared per [`near_firsts`] pass (one bit each in its mask).
const LANES: usize = 64;

/// The shared training table; see the module docs.
#[derive(Debug)]
pub struct StreamTable {
    config: StreamConfig,
    state: Mutex<Entries>,
    bucket_shift: u32,
    /// Use the hull filter and the LRU list (false: scan the entries for a stream or the least
    /// recently used one every time; the reference the filtered table is tested against).
    filters: bool,
}

fn filter_slot(owner: u32, bucket: u64) -> usize {
    ((bucket ^ u64::from(owner) << 40).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize & (FILTER - 1)
}

impl Entries {
    fn push_front(&mut self, i: usize) {
        let i16 = i as u16;
        self.e[i].prev = NONE;
        self.e[i].next = self.head;
        if self.head != NONE {
            self.e[self.head as usize].prev = i16;
        } else {
            self.tail = i16;
        }
        self.head = i16;
    }

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.e[i].prev, self.e[i].next);
        if p != NONE {
            self.e[p as usize].next = n;
        } else {
            self.head = n;
        }
        if n != NONE {
            self.e[n as usize].prev = p;
        } else {
            self.tail = p;
        }
    }

    #[inline]
    fn touch(&mut self, i: usize) {
        if self.head != i as u16 {
            self.unlink(i);
            self.push_front(i);
        }
    }

    /// Add (`delta` 1) or remove (`delta` -1) a detected stream of `owner` walking buckets
    /// `lo..=hi` to or from the hull filter.
    fn count_hull(&mut self, owner: u32, lo: u64, hi: u64, delta: i32) {
        if hi - lo >= MAX_HULL_BUCKETS {
            self.wide = (self.wide as i32 + delta) as u32;
            return;
        }
        for b in lo..=hi {
            let slot = filter_slot(owner, b);
            self.hulls[slot] = (i32::from(self.hulls[slot]) + delta) as u16;
        }
    }

    /// Record whether entry `i` has a stride.
    #[inline]
    fn mark_strided(&mut self, i: usize, strided: bool) {
        let (word, bit) = (i / LANES, 1u64 << (i % LANES));
        if strided {
            self.strided[word] |= bit;
        } else {
            self.strided[word] &= !bit;
        }
    }

    /// Add (`delta` 1) or remove (`delta` -1) entry `i`'s walked range, if it is a detected
    /// stream, to or from the hull filter.
    fn count(&mut self, i: usize, shift: u32, delta: i32) {
        let Entry { used, owner, stride, lo, hi, .. } = self.e[i];
        if used != 0 && stride != 0 {
            self.count_hull(owner, lo >> shift, hi >> shift, delta);
        }
    }
}

impl StreamTable {
    /// An empty table. Out-of-range parameters are clamped (validate them first to get errors).
    pub fn new(config: StreamConfig) -> Self {
        let config = StreamConfig {
            entries: config.entries.clamp(1, MAX_ENTRIES),
            history: config.history.clamp(3, MAX_HISTORY),
            depth: config.depth.clamp(1, crate::PageList::CAPACITY),
            join_distance: config.join_distance.max(1),
            distance: config.distance.max(1),
            ramp: config.ramp,
        };
        let mut entries = Entries {
            clock: 0,
            mru: 0,
            head: NONE,
            tail: NONE,
            wide: 0,
            e: [FREE; MAX_ENTRIES],
            first_lows: [0; MAX_ENTRIES],
            hulls: [0; FILTER],
            strided: [0; MAX_ENTRIES / LANES],
        };
        // Free entries go first, lowest index first: the list runs n-1 (front) .. 0 (tail).
        for i in 0..config.entries {
            entries.push_front(i);
        }
        // Buckets at least as wide as the join distance: a joinable first page is in the
        // page's bucket or a neighbour. At most 63 (a shift by 64 overflows): two buckets
        // then, for a join distance past half the page space.
        let bucket_shift = (64 - (config.join_distance - 1).leading_zeros()).clamp(1, 63);
        Self { config, state: Mutex::new(entries), bucket_shift, filters: true }
    }

    /// The parameters in force.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }

    /// Learn that `owner` used `page`. Returns the stream it belongs to when its entry is full and
    /// has a stride (the moment the paper issues a prefetch), else None. A page equal to the
    /// entry's newest one teaches nothing (several reports of one page).
    pub fn train(&self, owner: u32, page: u64) -> Option<Stream> {
        Self::train_in(&self.config, self.bucket_shift, self.filters, &mut lock(&self.state), owner, page)
    }

    /// [`StreamTable::train`] without locking, for an exclusive owner.
    pub fn train_mut(&mut self, owner: u32, page: u64) -> Option<Stream> {
        Self::train_in(&self.config, self.bucket_shift, self.filters, owned(&mut self.state), owner, page)
    }

    /// The entry `page` of `owner` joins: the most recently used one whose first page is less
    /// than the join distance away.
    #[inline]
    fn find(config: &StreamConfig, s: &Entries, owner: u32, page: u64) -> Option<usize> {
        let join = config.join_distance;
        let matches = |i: usize| {
            let e = &s.e[i];
            e.used != 0 && e.owner == owner && e.first.abs_diff(page) < join
        };
        // The most recently used entry, if it matches, is the most recent match. Otherwise one
        // branch-free pass over the first pages gives the few candidates to check.
        if matches(s.mru) {
            return Some(s.mru);
        }
        let (mut best, mut best_used) = (usize::MAX, 0u64);
        let lows = s.first_lows[..config.entries.next_multiple_of(LANES)].chunks_exact(LANES);
        for (chunk, firsts) in lows.enumerate() {
            let firsts: &[u16; LANES] = firsts.try_into().expect("chunks_exact gives LANES");
            let mut near = near_firsts(firsts, page, join);
            // Candidates two at a time without a branch on either: how many there are (mostly
            // one or two on a random pattern) is unpredictable, and a mispredicted exit from a
            // loop per candidate cost more than checking a missing second one. A missing
            // candidate reads the chunk's first entry (any valid index) and is ruled out by
            // `valid`.
            loop {
                for _ in 0..2 {
                    let valid = near != 0;
                    let i = chunk * LANES + (near.trailing_zeros() as usize & (LANES - 1));
                    near &= near.wrapping_sub(1);
                    let e = &s.e[i];
                    let better = valid & (e.used > best_used) & (e.owner == owner) & (e.first.abs_diff(page) < join);
                    best = std::hint::select_unpredictable(better, i, best);
                    best_used = std::hint::select_unpredictable(better, e.used, best_used);
                }
                if near == 0 {
                    break;
                }
            }
        }
        (best != usize::MAX).then_some(best)
    }

    fn train_in(
        config: &StreamConfig,
        shift: u32,
        filters: bool,
        s: &mut Entries,
        owner: u32,
        page: u64,
    ) -> Option<Stream> {
        s.clock += 1;
        let now = s.clock;
        let Some(i) = Self::find(config, s, owner, page) else {
            // Take over the least recently used entry (a free one has `used` 0; without the
            // filters, the first entry of the smallest `used`).
            let victim = if filters {
                s.tail as usize
            } else {
                let used = s.e[..config.entries].iter().map(|e| e.used);
                used.enumerate().min_by_key(|&(i, u)| (u, i)).map_or(0, |(i, _)| i)
            };
            s.count(victim, shift, -1);
            let e = &mut s.e[victim];
            e.used = now;
            e.owner = owner;
            e.stride = 0;
            e.lo = page;
            e.hi = page;
            e.len = 1;
            e.pages[0] = page;
            e.first = page;
            s.first_lows[victim] = page as u16;
            s.mark_strided(victim, false);
            s.mru = victim;
            s.touch(victim);
            s.count(victim, shift, 1);
            return None;
        };
        s.mru = i;
        s.touch(i);
        let history = config.history;
        let e = &mut s.e[i];
        e.used = now;
        let len = usize::from(e.len);
        if e.pages[len - 1] == page {
            return None;
        }
        // `lo` and `hi` are kept only while the entry has a stride: nothing else reads them.
        let hull = |e: &Entry| (e.stride != 0).then_some((e.lo >> shift, e.hi >> shift));
        let hull_before = hull(e);
        let stride_before = e.stride;
        let was_full = len == history;
        let delta = page.wrapping_sub(e.pages[len - 1]) as i64;
        // Slide the window when full: the oldest page leaves. The whole array moves (a fixed-size
        // move, no memmove call); the tail beyond `len` is unused.
        let len = if was_full {
            if len <= 8 {
                e.pages.copy_within(1..8, 0);
            } else {
                e.pages.copy_within(1.., 0);
            }
            len
        } else {
            len + 1
        };
        e.pages[len - 1] = page;
        e.len = len as u8;
        e.first = e.pages[0];
        let first = e.first;
        if len == history {
            e.stride = if was_full && e.stride != 0 && delta == e.stride {
                // Walking on along the stream: the stride's count did not fall (the distance
                // that left may be it, the new one is), no other count rose, and a tie goes to
                // the newest distance, which is the stride. No vote needed (it also re-read the
                // window just moved, which stalled on store forwarding).
                delta
            } else if was_full && e.stride == 0 {
                // The previous window repeated no non-zero distance, so only the new one can
                // repeat now, and if it does it is the most frequent (and the most recent).
                let older = e.pages[..len - 1].windows(2);
                let repeats = delta != 0 && older.fold(false, |r, w| r | (w[1].wrapping_sub(w[0]) as i64 == delta));
                if repeats {
                    delta
                } else {
                    0
                }
            } else {
                most_frequent_stride(&e.pages[..len])
            };
        }
        let stride = e.stride;
        if stride != 0 {
            let (mut lo, mut hi) = (page, page);
            for &p in &e.pages[..len - 1] {
                lo = lo.min(p);
                hi = hi.max(p);
            }
            e.lo = lo;
            e.hi = hi;
        }
        let hull_after = hull(e);
        s.first_lows[i] = first as u16;
        s.mark_strided(i, stride != 0);
        // The hull filter changes only where a bucket did (a window sliding along a stream
        // mostly stays within its buckets).
        if hull_after != hull_before {
            if let Some((lo, hi)) = hull_before {
                s.count_hull(owner, lo, hi, -1);
            }
            if let Some((lo, hi)) = hull_after {
                s.count_hull(owner, lo, hi, 1);
            }
        }
        if len < history || stride == 0 {
            return None;
        }
        if config.ramp == 0 {
            return Some(Stream::fixed(page, stride, config));
        }
        Some(Self::ramp(config, &mut s.e[i], page, stride, was_full && stride_before == stride))
    }

    /// The strides to read for a ramping stream that has just walked to `end` (see
    /// [`StreamConfig::ramp`]); `walking_on` when it had this stride before.
    fn ramp(config: &StreamConfig, e: &mut Entry, end: u64, stride: i64, walking_on: bool) -> Stream {
        if walking_on {
            e.run = e.run.saturating_add(1);
        } else {
            e.run = 0;
            e.front = end;
        }
        let reach = config.ramp.saturating_add(u64::from(e.run)).min(config.distance);
        let last = reach.saturating_add(config.depth as u64 - 1);
        // Strides already read ahead of `end` (the front may lie behind a stream that jumped).
        let gap = e.front.wrapping_sub(end) as i64;
        let done =
            if gap != 0 && gap.signum() == stride.signum() { gap.unsigned_abs() / stride.unsigned_abs() } else { 0 };
        let first = done + 1;
        let last = last.min(first.saturating_add(MAX_RAMP_BURST - 1));
        if first <= last {
            // Where the last read lands (wrapped past the page space, the next training finds
            // it behind the stream and starts over from the end; such targets are never read).
            e.front = end.wrapping_add((last as i64).wrapping_mul(stride) as u64);
        }
        Stream { end, stride, ahead: (first, last) }
    }

    /// Whether `page` of `owner` is part of a detected stream the program has already walked:
    /// it lies between the smallest and largest page its entry remembers. Pages ahead of the
    /// stream (read ahead, not used yet) are not: stream-first replacement must keep those.
    /// Stream-first asks this when a page comes in or is used.
    pub fn in_stream(&self, owner: u32, page: u64) -> bool {
        self.in_stream_in(&lock(&self.state), owner, page)
    }

    /// [`StreamTable::in_stream`] without locking, for an exclusive owner.
    pub fn in_stream_mut(&mut self, owner: u32, page: u64) -> bool {
        let s = owned(&mut self.state);
        // Reborrow shared: the query changes nothing.
        let s: &Entries = s;
        Self::in_stream_at(&self.config, self.bucket_shift, self.filters, s, owner, page)
    }

    fn in_stream_in(&self, s: &Entries, owner: u32, page: u64) -> bool {
        Self::in_stream_at(&self.config, self.bucket_shift, self.filters, s, owner, page)
    }

    fn in_stream_at(config: &StreamConfig, shift: u32, filters: bool, s: &Entries, owner: u32, page: u64) -> bool {
        let on = |e: &Entry| e.stride != 0 && e.owner == owner && e.lo <= page && page <= e.hi && e.used != 0;
        // The entry trained last usually answers (the page was just reported); a zero count in
        // the page's bucket means no detected stream covers it.
        if on(&s.e[s.mru]) {
            return true;
        }
        if !filters {
            return s.e[..config.entries].iter().any(on);
        }
        if s.wide == 0 && s.hulls[filter_slot(owner, page >> shift)] == 0 {
            return false;
        }
        // Only entries with a stride can hold the page.
        for (word, &bits) in s.strided.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                let i = word * LANES + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if on(&s.e[i]) {
                    return true;
                }
            }
        }
        false
    }

    /// Push the pages to prefetch for `stream` (clipped to `0..region_pages`) into `out`.
    pub fn prefetch_targets(&self, stream: Stream, region_pages: u64, out: &mut crate::PageList) {
        let (first, last) = stream.ahead;
        // A half-open count, not `first..=last`: an inclusive range costs a check per step.
        let count = last.checked_sub(first).map_or(0, |n| n.saturating_add(1));
        for k in (0..count).map(|n| first + n) {
            // A distance or stride so large that the target leaves the page space is past any
            // region (computed unchecked, `--stream-distance 18446744073709551615` wrapped round
            // to one page behind the stream).
            let ahead = i64::try_from(k).ok();
            let Some(target) =
                ahead.and_then(|d| d.checked_mul(stream.stride)).and_then(|a| (stream.end as i64).checked_add(a))
            else {
                break;
            };
            if target < 0 || target as u64 >= region_pages || !out.push(target as u64) {
                break;
            }
        }
    }
}

/// Bit i set when `first_lows[i]`, the low 16 bits of an entry's first page, is less than `join`
/// from those of `page` modulo 2^16: every entry the page may join, and a few it may not (the
/// caller checks each candidate exactly, owner and use included). Nothing has to be maintained
/// per update, and for a 64-entry table one pass costs less than walking hashed chains did.
#[inline]
fn near_firsts(first_lows: &[u16; LANES], page: u64, join: u64) -> u64 {
    // Wider than the 16-bit space: everything is a candidate.
    let Ok(width) = u16::try_from((join - 1).saturating_mul(2)) else { return u64::MAX };
    let lowest = (page as u16).wrapping_sub(width / 2);
    near_lanes(first_lows, lowest, width)
}

/// Bit i set when `first_lows[i] - lowest` (wrapping) is at most `width`: SSE2 (the x86-64
/// baseline) compares eight 16-bit lanes at once and packs the answers into a bit mask, a
/// quarter of the instructions the compiler made of the plain loop (the whole table's training
/// went from 42 to 33 ns a page on the `hot` synthetic trace).
#[cfg(target_arch = "x86_64")]
#[inline]
fn near_lanes(first_lows: &[u16; LANES], lowest: u16, width: u16) -> u64 {
    // SAFETY: SSE2 is part of every x86-64 target, so the CPU running this has it.
    unsafe { near_lanes_sse2(first_lows, lowest, width) }
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "sse2")]
fn near_lanes_sse2(first_lows: &[u16; LANES], lowest: u16, width: u16) -> u64 {
    use std::arch::x86_64::{
        _mm_cmpeq_epi16, _mm_loadu_si128, _mm_movemask_epi8, _mm_packs_epi16, _mm_set1_epi16, _mm_setzero_si128,
        _mm_sub_epi16, _mm_subs_epu16,
    };
    let low = _mm_set1_epi16(lowest as i16);
    let limit = _mm_set1_epi16(width as i16);
    let zero = _mm_setzero_si128();
    // x - lowest <= width, unsigned: the saturating difference from `width` is 0.
    let near8 = |lanes: &[u16]| {
        debug_assert_eq!(lanes.len(), 8);
        // SAFETY: `lanes` is 8 u16 of `first_lows`, the 16 bytes read (unaligned load).
        let v = unsafe { _mm_loadu_si128(lanes.as_ptr().cast()) };
        _mm_cmpeq_epi16(_mm_subs_epu16(_mm_sub_epi16(v, low), limit), zero)
    };
    let mut near = 0u64;
    for (k, sixteen) in first_lows.chunks_exact(16).enumerate() {
        let bytes = _mm_packs_epi16(near8(&sixteen[..8]), near8(&sixteen[8..]));
        near |= u64::from(_mm_movemask_epi8(bytes) as u16) << (16 * k);
    }
    near
}

/// [`near_lanes`] lane by lane, for other targets.
#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn near_lanes(first_lows: &[u16; LANES], lowest: u16, width: u16) -> u64 {
    first_lows
        .iter()
        .enumerate()
        .fold(0, |near, (i, &first)| near | u64::from(first.wrapping_sub(lowest) <= width) << i)
}

/// The most frequent non-zero difference between adjacent pages; ties go to the most recent.
/// A stride seen only once among several candidates is not a stream (0).
fn most_frequent_stride(pages: &[u64]) -> i64 {
    let mut deltas = [0i64; MAX_HISTORY - 1];
    let n = pages.len() - 1;
    for (d, w) in deltas.iter_mut().zip(pages.windows(2)) {
        *d = w[1].wrapping_sub(w[0]) as i64;
    }
    let deltas = &deltas[..n];
    let (mut best, mut best_count) = (0, 0);
    for &d in deltas.iter().rev() {
        // A value already counted has the same count again (and, being older, loses ties).
        if d == 0 || d == best {
            continue;
        }
        let count = deltas.iter().fold(0, |c, &x| c + usize::from(x == d));
        if count > best_count {
            best = d;
            best_count = count;
        }
    }
    if best_count < 2 {
        0
    } else {
        best
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The hull filter, the lookup's 16-bit pass and the LRU list only save work: training and classification
        /// agree with plain scans on any sequence, with few entries (much eviction), several
        /// owners, clustered and far pages, strides of both signs, and a small join distance.
        #[test]
        fn filters_change_no_answer(
            entries in prop_oneof![1usize..8, 65usize..=MAX_ENTRIES],
            // Join distances past half the page space too.
            join in prop_oneof![Just(64u64), 1u64..200, Just(1u64 << 63), Just(u64::MAX)],
            // Pages equal in their low 16 bits too: the lookup's first pass compares only those.
            ops in proptest::collection::vec((0u32..3, prop_oneof![
                0u64..300,
                0u64..100_000,
                (0u64..3, 0u64..300).prop_map(|(high, low)| high << 32 | low),
                (0u64..4, 0u64..300).prop_map(|(high, low)| high << 16 | low),
            ], any::<bool>()), 1..500),
        ) {
            let config = StreamConfig { entries, join_distance: join, ..StreamConfig::default() };
            let fast = StreamTable::new(config);
            let mut reference = StreamTable::new(config);
            reference.filters = false;
            for (owner, page, train) in ops {
                if train {
                    prop_assert_eq!(fast.train(owner, page), reference.train(owner, page));
                }
                for p in [page, page + 1, page.saturating_sub(2), page + 64] {
                    prop_assert_eq!(fast.in_stream(owner, p), reference.in_stream(owner, p), "page {}", p);
                }
            }
        }
    }

    /// §3.2 written as plainly as possible: a list of entries scanned in full on every call.
    /// The table (filtered or not) must give its answers.
    #[derive(Default)]
    struct Model {
        /// (last use, owner, pages oldest first, stride); last use 0 = free.
        entries: Vec<(u64, u32, Vec<u64>, i64)>,
        clock: u64,
    }

    impl Model {
        fn new(config: &StreamConfig) -> Self {
            Self { entries: vec![(0, 0, Vec::new(), 0); config.entries], clock: 0 }
        }

        fn train(&mut self, config: &StreamConfig, owner: u32, page: u64) -> Option<Stream> {
            self.clock += 1;
            let joinable = |e: &(u64, u32, Vec<u64>, i64)| {
                e.0 != 0 && e.1 == owner && e.2[0].abs_diff(page) < config.join_distance
            };
            let found =
                (0..self.entries.len()).filter(|&i| joinable(&self.entries[i])).max_by_key(|&i| self.entries[i].0);
            let Some(i) = found else {
                // Least recently used; free entries (0) first, lowest index first.
                let victim = (0..self.entries.len()).min_by_key(|&i| (self.entries[i].0, i)).unwrap();
                self.entries[victim] = (self.clock, owner, vec![page], 0);
                return None;
            };
            let e = &mut self.entries[i];
            e.0 = self.clock;
            if *e.2.last().unwrap() == page {
                return None;
            }
            if e.2.len() == config.history {
                e.2.remove(0);
            }
            e.2.push(page);
            if e.2.len() < config.history {
                return None;
            }
            e.3 = Self::stride(&e.2);
            (e.3 != 0).then_some(Stream::fixed(page, e.3, config))
        }

        /// The most frequent non-zero adjacent difference, ties to the most recent, if seen twice.
        fn stride(pages: &[u64]) -> i64 {
            let deltas: Vec<i64> = pages.windows(2).map(|w| w[1] as i64 - w[0] as i64).collect();
            let count = |d: i64| deltas.iter().filter(|&&x| x == d).count();
            let best = deltas.iter().rev().filter(|&&d| d != 0).fold(None, |best: Option<i64>, &d| match best {
                Some(b) if count(b) >= count(d) => Some(b),
                _ => Some(d),
            });
            best.filter(|&d| count(d) >= 2).unwrap_or(0)
        }

        fn in_stream(&self, owner: u32, page: u64) -> bool {
            self.entries.iter().any(|e| {
                e.0 != 0
                    && e.1 == owner
                    && e.3 != 0
                    && *e.2.iter().min().unwrap() <= page
                    && page <= *e.2.iter().max().unwrap()
            })
        }
    }

    proptest! {
        /// The table against the plain model, both with and without its filters, including a
        /// longer history (other strides) and re-reports of an entry's newest page.
        #[test]
        fn matches_the_plain_model(
            entries in prop_oneof![Just(64usize), 1usize..10, 65usize..=MAX_ENTRIES],
            history in prop_oneof![Just(5usize), 3usize..=MAX_HISTORY],
            join in prop_oneof![Just(64u64), 1u64..300],
            ops in proptest::collection::vec((0u32..3, prop_oneof![0u64..400, 0u64..100_000], 0u8..4), 1..600),
        ) {
            let config = StreamConfig { entries, history, join_distance: join, ..StreamConfig::default() };
            let fast = StreamTable::new(config);
            let mut scan = StreamTable::new(config);
            scan.filters = false;
            let mut model = Model::new(&config);
            let mut last = 0;
            for (owner, page, op) in ops {
                // Op 3 follows the last page with a stride, so streams form.
                let page = if op == 3 { last + page % 5 } else { page };
                last = page;
                let want = model.train(&config, owner, page);
                prop_assert_eq!(fast.train(owner, page), want);
                prop_assert_eq!(scan.train(owner, page), want);
                for p in [page, page + 1, page.saturating_sub(3), page + 64, page.saturating_sub(200)] {
                    let want = model.in_stream(owner, p);
                    prop_assert_eq!(fast.in_stream(owner, p), want, "page {}", p);
                    prop_assert_eq!(scan.in_stream(owner, p), want, "page {}", p);
                }
            }
        }
    }

    /// §3.2's worked example (figure 7): the first entry of pid 2 holds 0, 2, 4, 6; page 8 of pid 2
    /// arrives, joins it (|8 − 0| < 64), fills it, the most frequent stride is 2, and the page to
    /// prefetch is 8 + 2 × 100 = 208.
    #[test]
    fn reproduces_the_papers_worked_example() {
        let table = StreamTable::new(StreamConfig::default());
        // A stream of another pid and a far-away stream of the same pid must not capture it.
        for p in [0, 2, 4, 6] {
            assert_eq!(table.train(2, p), None);
            assert_eq!(table.train(3, p), None);
            assert_eq!(table.train(2, 5000 + 3 * p), None);
        }
        let stream = table.train(2, 8).expect("a stream");
        assert_eq!(stream, Stream { end: 8, stride: 2, ahead: (100, 100) });
        let mut out = crate::PageList::default();
        table.prefetch_targets(stream, u64::MAX, &mut out);
        assert_eq!(out.as_slice(), &[208]);
        assert!(table.in_stream(2, 4) && table.in_stream(2, 8), "walked stream pages");
        assert!(!table.in_stream(2, 208), "a page ahead of the stream is kept out of the stream group");
        assert!(!table.in_stream(2, 9) && !table.in_stream(3, 4) && !table.in_stream(2, 4000));
    }

    #[test]
    fn joins_only_within_the_distance_and_evicts_the_least_recently_used_entry() {
        let table = StreamTable::new(StreamConfig { entries: 2, ..StreamConfig::default() });
        table.train(1, 0);
        table.train(1, 63); // joins: 63 < 64
        table.train(1, 200); // too far from 0: the second entry
        table.train(1, 1000); // a third stream takes the least recently used entry, {0, 63}
        for p in [202, 204, 206] {
            assert_eq!(table.train(1, p), None);
        }
        // Had {0, 63} survived, 1 would join it and 3 would complete a five-page window.
        for p in [1, 2, 3, 4] {
            assert_eq!(table.train(1, p), None, "page {p}");
        }
        let paper = StreamConfig::default();
        assert_eq!(table.train(1, 5), Some(Stream::fixed(5, 1, &paper)));
        // That took the entry of 1000 (the LRU one), so the 200.. stream is still there.
        assert_eq!(table.train(1, 208), Some(Stream::fixed(208, 2, &paper)));
    }

    #[test]
    fn descending_streams_and_noise() {
        let table = StreamTable::new(StreamConfig::default());
        for p in [500, 497, 494, 491] {
            table.train(9, p);
        }
        let paper = StreamConfig::default();
        assert_eq!(table.train(9, 488), Some(Stream::fixed(488, -3, &paper)));
        let mut out = crate::PageList::default();
        table.prefetch_targets(Stream::fixed(488, -3, &paper), 1 << 20, &mut out);
        assert_eq!(out.as_slice(), &[188]);
        out.clear();
        table.prefetch_targets(Stream::fixed(200, -3, &paper), 1 << 20, &mut out);
        assert!(out.is_empty(), "never below page 0");
        // Distances that leave the page space prefetch nothing (they wrapped round to pages
        // behind the stream).
        for distance in [u64::MAX, 1 << 63, (1 << 62) + 1] {
            let config = StreamConfig { distance, depth: 3, ..StreamConfig::default() };
            let far = StreamTable::new(config);
            out.clear();
            far.prefetch_targets(Stream::fixed(488, 2, &config), 1 << 40, &mut out);
            assert!(out.is_empty(), "distance {distance}: {:?}", out.as_slice());
            far.prefetch_targets(Stream::fixed(488, -3, &config), 1 << 40, &mut out);
            assert!(out.is_empty(), "distance {distance}, backwards: {:?}", out.as_slice());
        }
        let noisy = StreamTable::new(StreamConfig::default());
        for p in [10, 11, 13, 16] {
            noisy.train(1, p);
        }
        assert_eq!(noisy.train(1, 20), None, "all distances differ: no stride");
    }

    fn targets(table: &StreamTable, owner: u32, page: u64) -> Vec<u64> {
        let mut out = crate::PageList::default();
        if let Some(stream) = table.train(owner, page) {
            table.prefetch_targets(stream, 1 << 20, &mut out);
        }
        out.as_slice().to_vec()
    }

    #[test]
    fn a_ramp_reads_closer_first_and_fills_in_as_the_stream_goes_on() {
        let table = StreamTable::new(StreamConfig { ramp: 4, distance: 10, ..StreamConfig::default() });
        for p in 100..104 {
            assert!(targets(&table, 1, p).is_empty());
        }
        // Found at its fifth page: 4 strides ahead, and the strides before them.
        assert_eq!(targets(&table, 1, 104), [105, 106, 107, 108]);
        // One stride further per page walked: two new pages a page while ramping up.
        assert_eq!(targets(&table, 1, 105), [109, 110]);
        assert_eq!(targets(&table, 1, 106), [111, 112]);
        for p in 107..=110 {
            assert_eq!(targets(&table, 1, p), [2 * p - 101, 2 * p - 100]);
        }
        // At the distance (10 strides): one page a page, as the paper's.
        assert_eq!(targets(&table, 1, 111), [121]);
        assert_eq!(targets(&table, 1, 112), [122]);
        // The newest page again teaches nothing; a jump ahead along the stream (the stride
        // stays the most frequent) reads only the strides not read yet.
        assert!(targets(&table, 1, 112).is_empty());
        assert_eq!(targets(&table, 1, 115), [123, 124, 125]);

        // Descending, stride 3: the same ramp mirrored.
        let down = StreamTable::new(StreamConfig { ramp: 2, distance: 3, ..StreamConfig::default() });
        for p in [500, 497, 494, 491] {
            assert!(targets(&down, 7, p).is_empty());
        }
        assert_eq!(targets(&down, 7, 488), [485, 482]);
        assert_eq!(targets(&down, 7, 485), [479, 476]);
        assert_eq!(targets(&down, 7, 482), [473], "at the distance of 3 strides");
    }

    proptest! {
        /// Along one stream, a ramp reads every stride step from the end where it was found to
        /// its final front exactly once, and never more than the distance past the last page
        /// walked (the paper's fixed distance leaves `distance` strides of unused pages too,
        /// but with gaps before them).
        #[test]
        fn a_ramp_reads_each_page_of_a_stream_once(
            stride in prop_oneof![1i64..6, -5i64..0],
            // At most one burst's worth, so the read reaches the full ramp at once.
            ramp in 1u64..=MAX_RAMP_BURST,
            extra in 0u64..160,
            walk in 5usize..400,
        ) {
            let distance = ramp + extra;
            let table = StreamTable::new(StreamConfig { ramp, distance, ..StreamConfig::default() });
            let start = 1u64 << 19;
            let page = |k: usize| start.wrapping_add((k as i64 * stride) as u64);
            let mut read = Vec::new();
            for k in 0..walk {
                read.extend(targets(&table, 3, page(k)));
            }
            // Found at its fifth page (k = 4), the stream is read from the next step on, up to
            // the reach its last page gave.
            let reach = (ramp + (walk - 5) as u64).min(distance) as usize;
            let expected: Vec<u64> = (5..walk + reach).map(page).collect();
            let mut sorted = read.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert_eq!(sorted.len(), read.len(), "a page read twice: {:?}", read);
            let mut expected_sorted = expected.clone();
            expected_sorted.sort_unstable();
            prop_assert_eq!(sorted, expected_sorted);
        }
    }
}
