use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use crate::{lock, PageId, PageList, Replacement};

/// Belady's MIN, the offline optimum without prefetching: evict the resident page whose next use
/// is farthest in the future. It reads the future from the trace, so it exists only in the
/// simulator. Protocol: the simulator calls [`Replacement::on_insert`] (a miss) or
/// [`Replacement::on_access`] (a hit) exactly once per trace access, in trace order, and no
/// other insert or access.
#[derive(Debug)]
pub struct Belady {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Position of the next access to the same page after each position (`u64::MAX`: never).
    next_use: Vec<u64>,
    pages: Vec<PageId>,
    cursor: usize,
    /// Resident pages by next use; stale entries are skipped when popped.
    heap: BinaryHeap<(u64, PageId)>,
    current: HashMap<PageId, u64>,
}

impl Belady {
    /// Precompute next uses for `trace` (the page of every access, in order).
    pub fn from_trace(trace: &[PageId]) -> Self {
        let mut next_use = vec![u64::MAX; trace.len()];
        let mut seen: HashMap<PageId, u64> = HashMap::new();
        for (i, &page) in trace.iter().enumerate().rev() {
            next_use[i] = seen.insert(page, i as u64).unwrap_or(u64::MAX);
        }
        Self {
            state: Mutex::new(State {
                next_use,
                pages: trace.to_vec(),
                cursor: 0,
                heap: BinaryHeap::with_capacity(1024),
                current: HashMap::with_capacity(seen.len()),
            }),
        }
    }

    fn advance(&self, page: PageId) {
        let mut s = lock(&self.state);
        let i = s.cursor;
        assert!(
            i < s.pages.len() && s.pages[i] == page,
            "Belady driven out of trace order at access {i} (page {page:#x})"
        );
        s.cursor += 1;
        let next = s.next_use[i];
        s.current.insert(page, next);
        s.heap.push((next, page));
    }
}

impl Replacement for Belady {
    fn name(&self) -> &'static str {
        "belady"
    }

    fn on_insert(&self, page: PageId) {
        self.advance(page);
    }

    fn on_access(&self, page: PageId) {
        self.advance(page);
    }

    fn on_remove(&self, page: PageId) {
        // Its heap entry is skipped when popped.
        lock(&self.state).current.remove(&page);
    }

    fn pick_victims(&self, max: usize, _is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let mut s = lock(&self.state);
        while out.len() < max.min(PageList::CAPACITY) {
            let Some((next, page)) = s.heap.pop() else { break };
            if s.current.get(&page) == Some(&next) {
                s.current.remove(&page);
                out.push(page);
            }
        }
    }
}
