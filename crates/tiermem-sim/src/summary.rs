//! What a trace holds, at a glance: its events by kind, its footprint, and how its accesses
//! follow each other (sequential, repeated, elsewhere). `tiermem trace info` prints it.

use std::collections::HashMap;

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
    let mut uses: HashMap<u64, u32> = HashMap::new();
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
                s.cached_accesses += page;
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
}
