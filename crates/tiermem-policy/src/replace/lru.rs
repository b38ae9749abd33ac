use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::lists::Lists;
use crate::{lock, owned, PageId, PageList, Replacement};

/// Least recently used, from full access information when a source gives it: every
/// [`Replacement::on_access`] (a traced access, a monitor report) moves the page to the front.
/// Until any access report arrives (the engine alone sees only faults), the referenced bit
/// stands in for it: a referenced page found at the tail goes back to the front (second chance).
#[derive(Debug)]
pub struct Lru {
    lists: Mutex<Lists<1>>,
    informed: AtomicBool,
}

impl Lru {
    /// Room for `capacity` resident pages, with slack for pages the engine hands back and
    /// stale entries of closed regions.
    pub fn new(capacity: usize) -> Self {
        Self::with_dense(capacity, 0)
    }

    /// As [`Lru::new`], page ids below `dense` tracked without hashing (see
    /// [`crate::PolicyOptions::dense_pages`]).
    pub fn with_dense(capacity: usize, dense: u64) -> Self {
        Self { lists: Mutex::new(Lists::with_dense(capacity * 2 + 64, dense)), informed: AtomicBool::new(false) }
    }
}

impl Replacement for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_insert(&self, page: PageId) {
        lock(&self.lists).touch(page, 0);
    }

    fn on_access(&self, page: PageId) {
        if !self.informed.load(Ordering::Relaxed) {
            self.informed.store(true, Ordering::Relaxed);
        }
        lock(&self.lists).touch_if_present(page);
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = !self.informed.load(Ordering::Relaxed);
        pick_lru(&mut lock(&self.lists), 0, max, second_chance, is_referenced, out);
    }

    fn on_remove(&self, page: PageId) {
        lock(&self.lists).remove(page);
    }

    fn one_entry_per_page(&self) -> bool {
        true
    }

    fn on_insert_mut(&mut self, page: PageId) {
        owned(&mut self.lists).touch(page, 0);
    }

    fn on_remove_mut(&mut self, page: PageId) {
        owned(&mut self.lists).remove(page);
    }

    fn on_access_mut(&mut self, page: PageId) {
        *self.informed.get_mut() = true;
        owned(&mut self.lists).touch_if_present(page);
    }

    fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = !*self.informed.get_mut();
        pick_lru(owned(&mut self.lists), 0, max, second_chance, is_referenced, out);
    }
}

/// Pop up to `max` victims from the tail of `list` into `out`. With `second_chance`, a
/// referenced page moves to the front instead, once per call.
pub(crate) fn pick_lru<const L: usize>(
    lists: &mut Lists<L>,
    list: usize,
    max: usize,
    second_chance: bool,
    is_referenced: &dyn Fn(PageId) -> bool,
    out: &mut PageList,
) {
    let mut budget = lists.len(list);
    while out.len() < max.min(PageList::CAPACITY) && budget > 0 {
        let Some(page) = lists.lru(list) else { break };
        budget -= 1;
        if is_referenced(page) && second_chance {
            lists.touch(page, list);
        } else {
            lists.remove(page);
            out.push(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_the_least_recently_accessed_and_uses_referenced_bits_only_without_reports() {
        let lru = Lru::new(8);
        (1..=4).for_each(|p| lru.on_insert(p));
        let mut out = PageList::default();
        lru.pick_victims(1, &|p| p == 1, &mut out);
        assert_eq!(out.as_slice(), &[2], "no reports yet: 1 was referenced, gets a second chance");
        lru.on_access(3);
        out.clear();
        lru.pick_victims(2, &|_| true, &mut out);
        assert_eq!(out.as_slice(), &[4, 1], "with reports, order is by access and the bit is ignored");
        out.clear();
        lru.pick_victims(8, &|_| false, &mut out);
        assert_eq!(out.as_slice(), &[3]);
    }
}
