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

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    /// Last use, for LRU; 0 = never used (free).
    used: u64,
    owner: u32,
    pages: [u64; MAX_HISTORY],
    len: u8,
    /// Detected stride (0 = no stream yet).
    stride: i64,
}

/// A detected stream after training on one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    /// The newest page.
    pub end: u64,
    /// Most frequent distance between adjacent pages.
    pub stride: i64,
}

#[derive(Debug)]
struct Entries {
    clock: u64,
    entries: [Entry; MAX_ENTRIES],
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
        Self { config, state: Mutex::new(Entries { clock: 0, entries: [Entry::default(); MAX_ENTRIES] }) }
    }

    /// The parameters in force.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }

    /// Learn that `owner` used `page`. Returns the stream it belongs to when its entry is full and
    /// has a stride (the moment the paper issues a prefetch), else None. A page equal to the
    /// entry's newest one teaches nothing (several reports of one page).
    pub fn train(&self, owner: u32, page: u64) -> Option<Stream> {
        let mut state = lock(&self.state);
        state.clock += 1;
        let now = state.clock;
        let n = self.config.entries;
        let join = self.config.join_distance;
        let mut found = None;
        let mut victim = 0;
        for (i, e) in state.entries[..n].iter().enumerate() {
            if e.used != 0 && e.owner == owner && e.pages[0].abs_diff(page) < join {
                if found.is_none_or(|f: usize| state.entries[f].used < e.used) {
                    found = Some(i);
                }
            } else if found.is_none() && e.used < state.entries[victim].used {
                victim = i;
            }
        }
        let Some(i) = found else {
            // Take over the least recently used entry (the scan skipped matches, which are
            // never the victim since then `found` is set and the victim is unused).
            let e = &mut state.entries[victim];
            *e = Entry { used: now, owner, len: 1, ..Entry::default() };
            e.pages[0] = page;
            return None;
        };
        let history = self.config.history;
        let e = &mut state.entries[i];
        e.used = now;
        if e.pages[usize::from(e.len) - 1] == page {
            return None;
        }
        if usize::from(e.len) == history {
            e.pages.copy_within(1..history, 0);
            e.len -= 1;
        }
        e.pages[usize::from(e.len)] = page;
        e.len += 1;
        if usize::from(e.len) < history {
            return None;
        }
        e.stride = most_frequent_stride(&e.pages[..history]);
        (e.stride != 0).then_some(Stream { end: page, stride: e.stride })
    }

    /// Whether `page` of `owner` lies on a detected stream: it would join a detected entry (less
    /// than the join distance from its first page), or lies between the entry's newest page and
    /// the farthest page the prefetcher asks for, in the stream's direction. Stream-first
    /// replacement asks this when a page comes in or is used.
    pub fn in_stream(&self, owner: u32, page: u64) -> bool {
        let state = lock(&self.state);
        let ahead = (self.config.distance + self.config.depth as u64 - 1) as i64;
        let join = self.config.join_distance;
        state.entries[..self.config.entries].iter().any(|e| {
            if e.used == 0 || e.owner != owner || e.stride == 0 {
                return false;
            }
            if e.pages[0].abs_diff(page) < join {
                return true;
            }
            let end = e.pages[usize::from(e.len) - 1] as i64;
            let limit = end.saturating_add(e.stride.saturating_mul(ahead));
            let (lo, hi) = if e.stride > 0 { (end, limit) } else { (limit, end) };
            (lo..=hi).contains(&(page as i64))
        })
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
        assert!(table.in_stream(2, 4) && table.in_stream(2, 208));
        assert!(!table.in_stream(2, 210) && !table.in_stream(3, 4) && !table.in_stream(2, 4000));
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
