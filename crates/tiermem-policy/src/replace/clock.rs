use std::collections::VecDeque;
use std::sync::Mutex;

use super::removed::Removed;
use crate::{owned, PageId, PageList, Replacement};

/// FIFO order with an optional second chance for referenced pages (CLOCK), the kernel-like
/// default. User space cannot see hardware accessed bits, so "referenced" means a fault touched
/// the page while resident (a write to a clean page, a prefetch hit).
#[derive(Debug)]
pub struct Clock {
    queue: Mutex<Queue>,
    second_chance: bool,
}

/// The pages in insertion order, and those of them given back (see [`Removed`]).
#[derive(Debug)]
struct Queue {
    pages: VecDeque<PageId>,
    removed: Removed,
}

impl Clock {
    /// A policy expecting about `capacity` resident pages; `second_chance` false gives FIFO.
    pub fn new(capacity: usize, second_chance: bool) -> Self {
        let queue = Queue { pages: VecDeque::with_capacity(capacity), removed: Removed::new(capacity * 2) };
        Self { queue: Mutex::new(queue), second_chance }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A panic while holding this lock leaves a valid queue; keep going.
        self.queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Queue {
    fn note_removed(&mut self, page: PageId) {
        let pages = &mut self.pages;
        self.removed.note(page, |removed| pages.retain(|&p| !removed.take(p)));
    }

    fn pick(&mut self, second_chance: bool, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        pick(&mut self.pages, &mut self.removed, second_chance, max, is_referenced, out);
    }
}

impl Replacement for Clock {
    fn name(&self) -> &'static str {
        if self.second_chance {
            "clock"
        } else {
            "fifo"
        }
    }

    fn on_insert(&self, page: PageId) {
        self.queue().pages.push_back(page);
    }

    fn on_remove(&self, page: PageId) {
        self.queue().note_removed(page);
    }

    fn on_remove_mut(&mut self, page: PageId) {
        owned(&mut self.queue).note_removed(page);
    }

    fn on_access(&self, _page: PageId) {
        // The engine sets the page's referenced bit; nothing to move in a FIFO.
    }

    fn reserve_now(&self) {
        super::seq::touch_capacity(&mut self.queue().pages, 0);
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        self.queue().pick(self.second_chance, max, is_referenced, out);
    }

    fn on_insert_mut(&mut self, page: PageId) {
        owned(&mut self.queue).pages.push_back(page);
    }

    fn on_access_mut(&mut self, _page: PageId) {}

    fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = self.second_chance;
        owned(&mut self.queue).pick(second_chance, max, is_referenced, out);
    }
}

/// Victims from the front of `queue` until `out` holds `max`; the stale entries of pages given
/// back (`removed`) go as they come up.
pub(super) fn pick(
    queue: &mut VecDeque<PageId>,
    removed: &mut Removed,
    second_chance: bool,
    max: usize,
    is_referenced: &dyn Fn(PageId) -> bool,
    out: &mut PageList,
) {
    // Each page gets at most one second chance per call, so this terminates.
    let mut budget = queue.len();
    while out.as_slice().len() < max.min(PageList::CAPACITY) && budget > 0 {
        let Some(page) = queue.pop_front() else { break };
        budget -= 1;
        if removed.take(page) {
            continue;
        }
        if second_chance && is_referenced(page) {
            queue.push_back(page);
        } else {
            out.push(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_evicts_in_insertion_order_and_clock_spares_referenced_pages() {
        let fifo = Clock::new(8, false);
        (1..=4).for_each(|p| fifo.on_insert(p));
        let mut out = PageList::default();
        fifo.pick_victims(2, &|_| true, &mut out);
        assert_eq!(out.as_slice(), &[1, 2]);

        let clock = Clock::new(8, true);
        (1..=4).for_each(|p| clock.on_insert(p));
        let mut out = PageList::default();
        clock.pick_victims(2, &|p| p == 1 || p == 3, &mut out);
        assert_eq!(out.as_slice(), &[2, 4]);
        out.clear();
        clock.pick_victims(2, &|_| false, &mut out);
        assert_eq!(out.as_slice(), &[1, 3], "second chance used up");
    }

    #[test]
    fn an_old_entry_does_not_use_up_the_second_chance_of_a_page_that_came_back() {
        let clock = Clock::new(8, true);
        clock.on_insert(9);
        clock.on_remove(9);
        (1..=2).for_each(|p| clock.on_insert(p));
        clock.on_insert(9);
        // 9 came back and was touched: its bit is set until asked once.
        let asked = std::cell::Cell::new(false);
        let referenced = |p: PageId| p == 9 && !asked.replace(true);
        let mut out = PageList::default();
        clock.pick_victims(3, &referenced, &mut out);
        assert_eq!(out.as_slice(), &[1, 2], "9 spared: its second chance, not its old entry's");
        assert!(asked.get());
        out.clear();
        clock.pick_victims(3, &referenced, &mut out);
        assert_eq!(out.as_slice(), &[9]);
    }

    #[test]
    fn a_page_given_back_and_inserted_again_is_not_evicted_by_its_old_entries() {
        for second_chance in [false, true] {
            let fifo = Clock::new(8, second_chance);
            (1..=3).for_each(|p| fifo.on_insert(p));
            // Page 1 given back and faulted in again, twice: its newest entry is its only live one.
            for _ in 0..2 {
                fifo.on_remove(1);
                fifo.on_insert(1);
            }
            fifo.on_insert(4);
            let mut out = PageList::default();
            fifo.pick_victims(2, &|_| false, &mut out);
            assert_eq!(out.as_slice(), &[2, 3], "second chance {second_chance}: the old entries of 1 dropped");
            out.clear();
            fifo.pick_victims(3, &|_| false, &mut out);
            assert_eq!(out.as_slice(), &[1, 4]);
        }
    }
}
