use std::sync::Mutex;

use super::{Readahead, REGION_SLOTS};
use crate::{lock, owned, FaultInfo, PageList, Prefetcher};

/// Deltas remembered per region (Leap: 32).
const HISTORY: usize = 32;
/// Windows searched for a majority, smallest first (Leap: history / 4, doubling up to all of it).
const WINDOWS: [usize; 3] = [8, 16, 32];
/// Most pages prefetched per fault (Leap's cap, as Linux's page cluster).
const MAX_WINDOW: u64 = 8;

/// Leap (Al Maruf and Chowdhury, ATC '20): keep the last 32 distances between faulting pages;
/// look for a majority distance (Boyer–Moore vote) in the newest 8, then 16, then 32 of them;
/// with one, prefetch along it; without, fall back to Linux readahead. The prefetch window is
/// the number of prefetch hits since the last miss plus one, rounded up to a power of two,
/// capped at 8 and never below half the previous window.
#[derive(Debug)]
pub struct Leap {
    state: Mutex<[History; REGION_SLOTS]>,
    fallback: Readahead,
}

#[derive(Debug, Clone, Copy)]
struct History {
    deltas: [i64; HISTORY],
    /// Deltas recorded so far (saturates at HISTORY); the newest is at `(head + HISTORY - 1) % HISTORY`.
    count: usize,
    head: usize,
    last_page: Option<u64>,
    hits: u64,
    prev_window: u64,
}

impl Default for History {
    fn default() -> Self {
        Self { deltas: [0; HISTORY], count: 0, head: 0, last_page: None, hits: 0, prev_window: 0 }
    }
}

impl History {
    fn record(&mut self, page: u64) {
        if let Some(last) = self.last_page {
            self.deltas[self.head] = page.wrapping_sub(last) as i64;
            self.head = (self.head + 1) % HISTORY;
            self.count = (self.count + 1).min(HISTORY);
        }
        self.last_page = Some(page);
    }

    /// The newest `n` deltas, newest first.
    fn newest(&self, n: usize) -> impl Iterator<Item = i64> + Clone + '_ {
        (1..=n).map(move |k| self.deltas[(self.head + HISTORY - k) % HISTORY])
    }

    /// A delta held by more than half of the smallest window that has one.
    fn trend(&self) -> Option<i64> {
        for w in WINDOWS {
            let w = w.min(self.count);
            // One delta is no trend yet.
            if w < 2 {
                return None;
            }
            if let Some(d) = majority(self.newest(w)) {
                return Some(d);
            }
            if w == self.count {
                return None;
            }
        }
        None
    }
}

/// Boyer–Moore majority vote: the value held by more than half of `items`, if any.
fn majority(items: impl Iterator<Item = i64> + Clone) -> Option<i64> {
    let mut candidate = 0;
    let mut votes = 0usize;
    for x in items.clone() {
        if votes == 0 {
            candidate = x;
            votes = 1;
        } else if x == candidate {
            votes += 1;
        } else {
            votes -= 1;
        }
    }
    let (mut n, mut hits) = (0usize, 0usize);
    for x in items {
        n += 1;
        hits += usize::from(x == candidate);
    }
    (votes > 0 && hits * 2 > n).then_some(candidate)
}

impl Leap {
    /// A Leap prefetcher with the paper's parameters.
    pub fn new() -> Self {
        Self { state: Mutex::new([History::default(); REGION_SLOTS]), fallback: Readahead::new(3) }
    }
}

impl Default for Leap {
    fn default() -> Self {
        Self::new()
    }
}

impl Prefetcher for Leap {
    fn name(&self) -> &'static str {
        "leap"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        let advice = advance(&mut lock(&self.state), fault);
        match advice {
            None => self.fallback.on_fault(fault, out),
            Some(run) => {
                // Keep the fallback's history current so a lost trend falls back with a sane window.
                self.fallback.on_fault(fault, &mut PageList::default());
                push_run(run, fault, out);
            }
        }
    }

    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        let advice = advance(owned(&mut self.state), fault);
        match advice {
            None => self.fallback.on_fault_mut(fault, out),
            Some(run) => {
                self.fallback.on_fault_mut(fault, &mut PageList::default());
                push_run(run, fault, out);
            }
        }
    }
}

/// Record `fault`; the trend and window to follow, or None to let the fallback decide (a hit,
/// which the fallback also counts, or no trend).
fn advance(state: &mut [History; REGION_SLOTS], fault: &FaultInfo) -> Option<(i64, u64)> {
    let h = &mut state[fault.region as usize % REGION_SLOTS];
    h.record(fault.page);
    if fault.hit {
        h.hits += 1;
        return None;
    }
    let trend = h.trend().filter(|&d| d != 0);
    let window = (h.hits + 1).next_power_of_two().min(MAX_WINDOW).max(h.prev_window / 2);
    h.hits = 0;
    h.prev_window = window;
    trend.map(|delta| (delta, window))
}

fn push_run((delta, window): (i64, u64), fault: &FaultInfo, out: &mut PageList) {
    let mut page = fault.page as i64;
    for _ in 0..window {
        page += delta;
        if page < 0 || page as u64 >= fault.region_pages {
            break;
        }
        out.push(page as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn miss(leap: &Leap, page: u64) -> Vec<u64> {
        let mut out = PageList::default();
        leap.on_fault(
            &FaultInfo { offset: 0, region: 0, page, region_pages: 10_000, write: false, hit: false },
            &mut out,
        );
        out.as_slice().to_vec()
    }

    #[test]
    fn majority_vote_needs_more_than_half() {
        assert_eq!(majority([3, 3, 1, 3, 2].into_iter()), Some(3));
        assert_eq!(majority([3, 3, 1, 2].into_iter()), None);
        assert_eq!(majority([1, 2, 3, 4, 5, 6, 7, 7].into_iter()), None);
    }

    #[test]
    fn follows_a_strided_trend_and_falls_back_to_readahead_without_one() {
        let leap = Leap::new();
        // Misses at stride −5: from the second delta on, the trend is clear.
        let mut out = Vec::new();
        for k in 0..10 {
            out = miss(&leap, 5000 - 5 * k);
        }
        assert_eq!(out, vec![4950], "no hits: window 1 along the trend");
        let mut hit = PageList::default();
        for _ in 0..3 {
            leap.on_fault(
                &FaultInfo { offset: 0, region: 0, page: 4945, region_pages: 10_000, write: false, hit: true },
                &mut hit,
            );
        }
        // The hits recorded −10, 0, 0; the newest 8 deltas are −5, 0, 0, −10, −5, −5, −5, −5: still
        // a majority of −5, and 3 hits make a window of 4.
        assert_eq!(miss(&leap, 4940), vec![4935, 4930, 4925, 4920]);
        // A random jumble: no majority in any window, so readahead decides (a centred window).
        let jumble = Leap::new();
        for p in [10, 900, 33, 4000, 77, 2500, 5, 1234, 666, 3000, 42, 7777] {
            miss(&jumble, p);
        }
        let ra = Readahead::new(3);
        for p in [10, 900, 33, 4000, 77, 2500, 5, 1234, 666, 3000, 42, 7777] {
            let mut o = PageList::default();
            ra.on_fault(
                &FaultInfo { offset: 0, region: 0, page: p, region_pages: 10_000, write: false, hit: false },
                &mut o,
            );
        }
        let mut expect = PageList::default();
        ra.on_fault(
            &FaultInfo { offset: 0, region: 0, page: 7778, region_pages: 10_000, write: false, hit: false },
            &mut expect,
        );
        assert_eq!(miss(&jumble, 7778), expect.as_slice().to_vec());
    }
}
