use std::collections::VecDeque;
use std::sync::Mutex;

use super::clock;
use crate::{lock, owned, PageId, PageList, Replacement};

/// Sequential runs followed at once (the two ends of a partition, interleaved arrays).
const RUNS: usize = 8;
/// Pages in a row that make a run sequential.
const RUN_MIN: u32 = 8;

/// Scan-resistant replacement in the manner of SEQ (Glass and Cao, 1997): pages that came in as
/// part of a sequential run of faults are evicted first, most recent first but never the newest
/// eighth of memory, and everything else in CLOCK order.
///
/// Evicting in insertion order is the worst case for a program that scans data a little larger
/// than memory again and again (sorting, k-means passes, NPB IS): every page goes just before
/// it is needed again, so each pass reads all of it. Evicting the run's most recent pages
/// instead (behind a window the scan is still working in) keeps the start of the data resident
/// and reads only what does not fit. A run page touched again while resident (its referenced
/// bit) has shown reuse and joins the CLOCK pages.
#[derive(Debug)]
pub struct Seq {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Pages that did not arrive in a run, in insertion order (CLOCK).
    others: VecDeque<PageId>,
    /// The newest run pages, at most `window` of them.
    recent: VecDeque<PageId>,
    /// Older run pages; victims come from the back (most recent first).
    older: Vec<PageId>,
    window: usize,
    /// (next page expected going up, next going down, length, last use) per followed run.
    runs: [(PageId, PageId, u32, u64); RUNS],
    clock: u64,
}

impl Seq {
    /// A policy expecting about `capacity` resident pages.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                others: VecDeque::with_capacity(capacity),
                recent: VecDeque::with_capacity(capacity / 8 + 1),
                older: Vec::with_capacity(capacity),
                window: (capacity / 8).max(1),
                runs: [(u64::MAX, u64::MAX, 0, 0); RUNS],
                clock: 0,
            }),
        }
    }
}

impl State {
    /// Whether `page` extends a followed run far enough to be sequential.
    fn in_run(&mut self, page: PageId) -> bool {
        self.clock += 1;
        let now = self.clock;
        let hit = self.runs.iter_mut().find(|r| r.0 == page || r.1 == page);
        let length = match hit {
            Some(run) => {
                // A run keeps its direction once it has one.
                let up = run.0 == page;
                *run = (
                    if up { page + 1 } else { u64::MAX },
                    if up { u64::MAX } else { page.wrapping_sub(1) },
                    run.2 + 1,
                    now,
                );
                run.2
            }
            None => {
                let oldest = self.runs.iter_mut().min_by_key(|r| r.3).expect("RUNS > 0");
                *oldest = (page + 1, page.wrapping_sub(1), 1, now);
                1
            }
        };
        length >= RUN_MIN
    }

    fn insert(&mut self, page: PageId) {
        if self.in_run(page) {
            self.recent.push_back(page);
            while self.recent.len() > self.window {
                let aged = self.recent.pop_front().expect("longer than the window");
                self.older.push(aged);
            }
        } else {
            self.others.push_back(page);
        }
    }

    fn pick(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let max = max.min(PageList::CAPACITY);
        while out.as_slice().len() < max {
            let Some(page) = self.older.pop() else { break };
            if is_referenced(page) {
                self.others.push_back(page);
            } else {
                out.push(page);
            }
        }
        // (clock::pick fills `out` up to `max` in all.)
        clock::pick(&mut self.others, true, max, is_referenced, out);
        // Nothing else left: the window goes too, oldest first.
        while out.as_slice().len() < max {
            let Some(page) = self.recent.pop_front() else { break };
            out.push(page);
        }
    }
}

impl Replacement for Seq {
    fn name(&self) -> &'static str {
        "seq"
    }

    fn on_insert(&self, page: PageId) {
        lock(&self.state).insert(page);
    }

    fn on_access(&self, _page: PageId) {
        // The engine sets the page's referenced bit; victims are checked against it.
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        lock(&self.state).pick(max, is_referenced, out);
    }

    fn on_insert_mut(&mut self, page: PageId) {
        owned(&mut self.state).insert(page);
    }

    fn on_access_mut(&mut self, _page: PageId) {}

    fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        owned(&mut self.state).pick(max, is_referenced, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn victims(p: &Seq, n: usize, referenced: &dyn Fn(PageId) -> bool) -> Vec<PageId> {
        let mut out = PageList::default();
        p.pick_victims(n, referenced, &mut out);
        out.as_slice().to_vec()
    }

    #[test]
    fn a_scan_loses_its_most_recent_pages_behind_the_window_first() {
        let p = Seq::new(64); // window 8
        (100..140).for_each(|page| p.on_insert(page));
        // 100..106 came before the run was long enough; 107..131 are older run pages; 132..139
        // the window.
        assert_eq!(victims(&p, 3, &|_| false), vec![131, 130, 129]);
    }

    #[test]
    fn random_pages_go_in_clock_order_after_the_run_pages() {
        let p = Seq::new(64);
        for page in [7, 3, 11] {
            p.on_insert(page);
        }
        (200..220).for_each(|page| p.on_insert(page)); // run pages 207..219, window 212..219
        let v = victims(&p, 9, &|_| false);
        assert_eq!(&v[..5], &[211, 210, 209, 208, 207]);
        assert_eq!(&v[5..8], &[7, 3, 11], "then the others, oldest first");
        assert_eq!(v[8], 200, "200..206 arrived before the run counted, with the others");
    }

    #[test]
    fn interleaved_runs_in_both_directions_are_followed_and_reused_pages_are_spared() {
        let p = Seq::new(64);
        for i in 0..20 {
            p.on_insert(1000 + i); // forward
            p.on_insert(5000 - i); // backward
        }
        // Both runs became sequential at their 8th page; the newest 8 insertions are the window.
        let v = victims(&p, 4, &|page| page == 1015);
        assert_eq!(v, vec![4985, 4986, 1014, 4987], "most recent first, 1015 referenced");
    }
}
