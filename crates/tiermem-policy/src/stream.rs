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

use crate::lock;

/// Most entries a table can be built with.
pub const MAX_ENTRIES: usize = 256;
/// Most pages an entry can be built to remember.
pub const MAX_HISTORY: usize = 16;

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
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self { entries: 64, history: 5, join_distance: 64, distance: 100, depth: 1 }
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
}

/// The entries, field by field (the scans on every access read only `used`, `owner`, `first`
/// or the hull, so these stay in a few cache lines).
#[derive(Debug)]
struct Entries {
    clock: u64,
    /// The most recently used entry: checked first, since accesses come in runs.
    mru: usize,
    /// Last use, for LRU; 0 = never used (free).
    used: [u64; MAX_ENTRIES],
    owner: [u32; MAX_ENTRIES],
    /// Oldest remembered page.
    first: [u64; MAX_ENTRIES],
    /// Detected stride (0 = no stream yet).
    stride: [i64; MAX_ENTRIES],
    /// Smallest and largest remembered page (the part of the stream already used).
    lo: [u64; MAX_ENTRIES],
    hi: [u64; MAX_ENTRIES],
    len: [u8; MAX_ENTRIES],
    pages: [[u64; MAX_HISTORY]; MAX_ENTRIES],
}

/// The shared training table; see the module docs.
#[derive(Debug)]
pub struct StreamTable {
    config: StreamConfig,
    state: Mutex<Entries>,
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
        };
        let entries = Entries {
            clock: 0,
            mru: 0,
            used: [0; MAX_ENTRIES],
            owner: [0; MAX_ENTRIES],
            first: [0; MAX_ENTRIES],
            stride: [0; MAX_ENTRIES],
            lo: [0; MAX_ENTRIES],
            hi: [0; MAX_ENTRIES],
            len: [0; MAX_ENTRIES],
            pages: [[0; MAX_HISTORY]; MAX_ENTRIES],
        };
        Self { config, state: Mutex::new(entries) }
    }

    /// The parameters in force.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }

    /// Learn that `owner` used `page`. Returns the stream it belongs to when its entry is full and
    /// has a stride (the moment the paper issues a prefetch), else None. A page equal to the
    /// entry's newest one teaches nothing (several reports of one page).
    pub fn train(&self, owner: u32, page: u64) -> Option<Stream> {
        let mut guard = lock(&self.state);
        let s = &mut *guard;
        s.clock += 1;
        let now = s.clock;
        let n = self.config.entries;
        let join = self.config.join_distance;
        let matches = |s: &Entries, i: usize| s.used[i] != 0 && s.owner[i] == owner && s.first[i].abs_diff(page) < join;
        // The most recently used entry, if it matches, is the most recent match. Otherwise one
        // pass finds both the most recent match and the least recently used entry, without
        // branches the predictor would miss.
        let mut victim = 0;
        let found = if matches(s, s.mru) {
            Some(s.mru)
        } else {
            let (mut best, mut best_used, mut oldest) = (usize::MAX, 0u64, u64::MAX);
            for i in 0..n {
                let used = s.used[i];
                let hit = used > best_used && s.owner[i] == owner && s.first[i].abs_diff(page) < join;
                best = if hit { i } else { best };
                best_used = if hit { used } else { best_used };
                victim = if used < oldest { i } else { victim };
                oldest = oldest.min(used);
            }
            (best != usize::MAX).then_some(best)
        };
        let Some(i) = found else {
            // Take over the least recently used entry (a free one has `used` 0).
            s.used[victim] = now;
            s.owner[victim] = owner;
            s.first[victim] = page;
            s.stride[victim] = 0;
            s.lo[victim] = page;
            s.hi[victim] = page;
            s.len[victim] = 1;
            s.pages[victim][0] = page;
            s.mru = victim;
            return None;
        };
        s.used[i] = now;
        s.mru = i;
        let history = self.config.history;
        let len = usize::from(s.len[i]);
        let pages = &mut s.pages[i];
        if pages[len - 1] == page {
            return None;
        }
        let len = if len == history {
            pages.copy_within(1..history, 0);
            len - 1
        } else {
            len
        };
        pages[len] = page;
        let len = len + 1;
        s.len[i] = len as u8;
        s.first[i] = pages[0];
        let window = &pages[..len];
        s.lo[i] = window.iter().copied().min().unwrap_or(page);
        s.hi[i] = window.iter().copied().max().unwrap_or(page);
        if len < history {
            return None;
        }
        let stride = most_frequent_stride(window);
        s.stride[i] = stride;
        (stride != 0).then_some(Stream { end: page, stride })
    }

    /// Whether `page` of `owner` is part of a detected stream the program has already walked:
    /// it lies between the smallest and largest page its entry remembers. Pages ahead of the
    /// stream (read ahead, not used yet) are not: stream-first replacement must keep those.
    /// Stream-first asks this when a page comes in or is used.
    pub fn in_stream(&self, owner: u32, page: u64) -> bool {
        let s = lock(&self.state);
        let on =
            |i: usize| s.stride[i] != 0 && s.owner[i] == owner && s.lo[i] <= page && page <= s.hi[i] && s.used[i] != 0;
        // The entry trained last usually answers (the page was just reported).
        on(s.mru) || (0..self.config.entries).any(on)
    }

    /// Push the pages to prefetch for `stream` (clipped to `0..region_pages`) into `out`.
    pub fn prefetch_targets(&self, stream: Stream, region_pages: u64, out: &mut crate::PageList) {
        for k in 0..self.config.depth as u64 {
            let ahead = (self.config.distance + k) as i64 * stream.stride;
            let Some(target) = (stream.end as i64).checked_add(ahead) else { break };
            if target < 0 || target as u64 >= region_pages {
                break;
            }
            out.push(target as u64);
        }
    }
}

/// The most frequent non-zero difference between adjacent pages; ties go to the most recent.
/// A stride seen only once among several candidates is not a stream (0).
fn most_frequent_stride(pages: &[u64]) -> i64 {
    let mut deltas = [0i64; MAX_HISTORY];
    let n = pages.len() - 1;
    for k in 0..n {
        deltas[k] = pages[k + 1].wrapping_sub(pages[k]) as i64;
    }
    let mut best = 0;
    let mut best_count = 0;
    for k in (0..n).rev() {
        let d = deltas[k];
        if d == 0 {
            continue;
        }
        let count = deltas[..n].iter().filter(|&&x| x == d).count();
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
    use super::*;

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
        assert_eq!(stream, Stream { end: 8, stride: 2 });
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
        assert_eq!(table.train(1, 5), Some(Stream { end: 5, stride: 1 }));
        // That took the entry of 1000 (the LRU one), so the 200.. stream is still there.
        assert_eq!(table.train(1, 208), Some(Stream { end: 208, stride: 2 }));
    }

    #[test]
    fn descending_streams_and_noise() {
        let table = StreamTable::new(StreamConfig::default());
        for p in [500, 497, 494, 491] {
            table.train(9, p);
        }
        assert_eq!(table.train(9, 488), Some(Stream { end: 488, stride: -3 }));
        let mut out = crate::PageList::default();
        table.prefetch_targets(Stream { end: 488, stride: -3 }, 1 << 20, &mut out);
        assert_eq!(out.as_slice(), &[188]);
        out.clear();
        table.prefetch_targets(Stream { end: 200, stride: -3 }, 1 << 20, &mut out);
        assert!(out.is_empty(), "never below page 0");
        let noisy = StreamTable::new(StreamConfig::default());
        for p in [10, 11, 13, 16] {
            noisy.train(1, p);
        }
        assert_eq!(noisy.train(1, 20), None, "all distances differ: no stride");
    }
}
