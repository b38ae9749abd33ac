//! What a trace holds, at a glance: its events by kind, its footprint, and how its accesses
//! follow each other (sequential, repeated, elsewhere). `tiermem trace info` prints it.

use crate::sim::FastMap;
use crate::trace::{split_event, Event, EventKind};

/// A trace's shape.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TraceSummary {
    /// Events of every kind.
    pub events: u64,
    /// Page reads and writes.
    pub reads: u64,
    pub writes: u64,
    /// Hot-page reports (a monitor's, or the hot-page table's from a byte-level trace).
    pub reports: u64,
    /// Accesses that stayed in the caches, summed over the compute events that carry them.
    pub cached_accesses: u64,
    /// Pages the program gave back (discard records), summed over the records.
    pub discarded_pages: u64,
    /// Distinct pages read or written, and the lowest and highest of them.
    pub footprint_pages: u64,
    pub lowest_page: Option<u64>,
    pub highest_page: Option<u64>,
    /// Pages read or written exactly once.
    pub pages_used_once: u64,
    /// Of the accesses after the first: to the page after the previous access's, to the same
    /// page again, to the page before it, and anywhere else.
    pub next_page: u64,
    pub same_page: u64,
    pub previous_page: u64,
    pub elsewhere: u64,
}

impl TraceSummary {
    /// Reads and writes.
    pub fn accesses(&self) -> u64 {
        self.reads + self.writes
    }
}

/// Summarize `events` in one pass.
pub fn summarize(events: &[Event]) -> TraceSummary {
    let mut s = TraceSummary { events: events.len() as u64, ..TraceSummary::default() };
    let mut uses: FastMap<u32> = FastMap::default();
    let mut last: Option<u64> = None;
    for &e in events {
        let (page, kind) = split_event(e);
        match kind {
            EventKind::Read => s.reads += 1,
            EventKind::Write => s.writes += 1,
            EventKind::Report => {
                s.reports += 1;
                continue;
            }
            EventKind::Compute => {
                match crate::trace::split_discard(page) {
                    Some((_, pages)) => s.discarded_pages = s.discarded_pages.saturating_add(pages),
                    // Saturating: a hostile trace's counts would otherwise overflow.
                    None => s.cached_accesses = s.cached_accesses.saturating_add(page),
                }
                continue;
            }
        }
        let count = uses.entry(page).or_insert(0);
        *count = count.saturating_add(1);
        if let Some(prev) = last {
            match page.wrapping_sub(prev) {
                1 => s.next_page += 1,
                0 => s.same_page += 1,
                u64::MAX => s.previous_page += 1,
                _ => s.elsewhere += 1,
            }
        }
        last = Some(page);
    }
    s.footprint_pages = uses.len() as u64;
    s.pages_used_once = uses.values().filter(|&&n| n == 1).count() as u64;
    s.lowest_page = uses.keys().min().copied();
    s.highest_page = uses.keys().max().copied();
    s
}

/// LRU's faults at every memory size at once, from one pass over the accesses (Mattson's stack
/// distances): an access hits in an LRU memory of `c` pages exactly when fewer than `c` other
/// pages were used since the page's last use. The distances are counted with a Fenwick tree
/// over time that marks each page's latest use, its times renumbered whenever they run out so
/// that it stays a few times the footprint: O(accesses × log footprint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LruCurve {
    /// First uses (a fault at any size).
    pub cold: u64,
    /// `reuses[d]`: reuses after `d` distinct other pages (`d` up to the footprint less one).
    reuses: Vec<u64>,
}

impl LruCurve {
    /// Measure the curve of `events` (reads and writes; reports and compute events are not
    /// accesses, and discards do not count: the curve is a cache's, every first touch a miss).
    pub fn measure(events: &[Event]) -> Self {
        let pages = events
            .iter()
            .map(|&e| split_event(e))
            .filter(|(_, k)| matches!(k, EventKind::Read | EventKind::Write))
            .map(|(page, _)| page);
        // Times are slots of the tree. When they run out, the live marks (one per page) are
        // renumbered 0.. in their order and the tree rebuilt, at least four times as large as
        // they are: a tree a few times the footprint stays in the caches, where one slot per
        // access (hundreds of MB) would miss on every level.
        let mut latest = Fenwick::new(1 << 12);
        let mut last_use: FastMap<usize> = FastMap::default();
        let mut curve = LruCurve { cold: 0, reuses: Vec::new() };
        let mut now = 0;
        for page in pages {
            if now == latest.len() {
                now = renumber(&mut last_use, &mut latest);
            }
            match last_use.insert(page, now) {
                None => curve.cold += 1,
                Some(then) => {
                    // Pages whose latest use lies strictly between then and now: every page's
                    // latest use is before now, so all but those up to then.
                    let distance = last_use.len() - latest.prefix(then + 1) as usize;
                    if curve.reuses.len() <= distance {
                        curve.reuses.resize(distance + 1, 0);
                    }
                    curve.reuses[distance] += 1;
                    latest.add(then, -1);
                }
            }
            latest.add(now, 1);
            now += 1;
        }
        curve
    }

    /// LRU's faults with `pages` of memory.
    pub fn faults(&self, pages: usize) -> u64 {
        self.cold + self.reuses.iter().skip(pages).sum::<u64>()
    }
}

/// Give the pages of `last_use` the times 0.. in the order of their latest uses, in a new tree
/// with room for at least three times as many more; returns the next free time.
fn renumber(last_use: &mut FastMap<usize>, latest: &mut Fenwick) -> usize {
    let mut live: Vec<(usize, u64)> = last_use.iter().map(|(&page, &time)| (time, page)).collect();
    live.sort_unstable();
    for (time, &(_, page)) in live.iter().enumerate() {
        last_use.insert(page, time);
    }
    *latest = Fenwick::with_first_marked(live.len(), (live.len() * 4).max(latest.len()));
    live.len()
}

/// Prefix sums over 0/1 marks with point updates, both O(log n). A node's sum counts marks,
/// at most one per page, so 32 bits hold it for up to 4 Gi pages (wrapping adds keep the
/// removal of a mark exact).
struct Fenwick(Vec<u32>);

impl Fenwick {
    fn new(n: usize) -> Self {
        Self(vec![0; n + 1])
    }

    /// A tree of `n` slots with the first `marked` of them marked, built in O(n).
    fn with_first_marked(marked: usize, n: usize) -> Self {
        let mut tree = vec![0u32; n + 1];
        for i in 1..=n {
            tree[i] = tree[i].wrapping_add(u32::from(i <= marked));
            let parent = i + (i & i.wrapping_neg());
            if parent <= n {
                tree[parent] = tree[parent].wrapping_add(tree[i]);
            }
        }
        Self(tree)
    }

    /// Slots.
    fn len(&self) -> usize {
        self.0.len() - 1
    }

    fn add(&mut self, index: usize, delta: i64) {
        let delta = delta as u32;
        let mut i = index + 1;
        while i < self.0.len() {
            self.0[i] = self.0[i].wrapping_add(delta);
            i += i & i.wrapping_neg();
        }
    }

    /// The sum of marks at indices below `end`.
    fn prefix(&self, end: usize) -> i64 {
        let (mut i, mut sum) = (end, 0u32);
        while i > 0 {
            sum = sum.wrapping_add(self.0[i]);
            i -= i & i.wrapping_neg();
        }
        i64::from(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::event;

    #[test]
    fn counts_kinds_footprint_and_how_accesses_follow_each_other() {
        let e = |page, kind| event(page, kind);
        let events = [
            e(10, EventKind::Read),
            e(11, EventKind::Read),
            e(11, EventKind::Write),
            e(12, EventKind::Report),
            e(40, EventKind::Compute),
            e(10, EventKind::Read),
            e(9, EventKind::Read),
            e(500, EventKind::Write),
        ];
        let s = summarize(&events);
        assert_eq!((s.events, s.reads, s.writes, s.reports, s.cached_accesses), (8, 4, 2, 1, 40));
        assert_eq!(s.accesses(), 6);
        // Pages 9, 10, 11, 500; 9 and 500 used once.
        assert_eq!((s.footprint_pages, s.pages_used_once), (4, 2));
        assert_eq!((s.lowest_page, s.highest_page), (Some(9), Some(500)));
        // 10→11 next, 11→11 same, 11→10 previous, 10→9 previous, 9→500 elsewhere; reports and
        // compute events are not accesses and break nothing.
        assert_eq!((s.next_page, s.same_page, s.previous_page, s.elsewhere), (1, 1, 2, 1));
        assert_eq!(summarize(&[]), TraceSummary::default());
    }

    #[test]
    fn a_loop_larger_than_memory_misses_everywhere_below_its_size() {
        let events: Vec<Event> = (0..300u64).map(|i| event(i % 100, EventKind::Read)).collect();
        let curve = LruCurve::measure(&events);
        assert_eq!(curve.cold, 100);
        assert_eq!(curve.faults(99), 300);
        assert_eq!(curve.faults(100), 100);
        assert_eq!(curve.faults(1000), 100);
    }
}
