//! Pages given back while their entries still wait in a policy's queues.
//!
//! A queue policy (FIFO, CLOCK, SEQ) keeps a page's entry when the program gives the page back
//! (`Replacement::on_remove`): finding it among its queues would take a walk. A page given back
//! and touched again then has two entries, and the old one, nearer the front, would evict the
//! page soon after it came back (on a k-means fault trace, 17% of the write-backs). So the
//! policy notes the pages given back here, and a victim found here is one such stale entry:
//! dropped instead of proposed. The set is a fixed open-addressing table made when the policy
//! is (no allocation on the paths that must not allocate); when it is full, the policy drops
//! the stale entries from its queues in one pass and the table starts over.

use crate::{PageId, PageList};

/// A free slot; slots hold page + 1, so a fresh table is zeroed memory the kernel maps only as
/// it is written (no page id is `PageId::MAX`: the replacement lists' empty marker).
const EMPTY: PageId = 0;
/// At most this many slots (8 MiB, written only as used).
const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug, Default)]
pub(crate) struct Removed {
    slots: Box<[PageId]>,
    /// Stale entries of each slot's page (a page given back again after it came back has one
    /// more).
    counts: Box<[u32]>,
    len: usize,
}

impl Removed {
    /// A table for up to half of `capacity` pages (rounded up to a power of two, 64 to 2^20).
    pub(crate) fn new(capacity: usize) -> Self {
        let n = capacity.next_power_of_two().clamp(64, MAX_SLOTS);
        Self { slots: vec![EMPTY; n].into_boxed_slice(), counts: vec![0; n].into_boxed_slice(), len: 0 }
    }

    /// `key`: a page + 1.
    fn home(&self, key: PageId) -> usize {
        let bits = self.slots.len().trailing_zeros();
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize
    }

    /// Note `page` (given back with its entry still queued). False, noting nothing, when the
    /// set is half full.
    fn insert(&mut self, page: PageId) -> bool {
        let page = page.wrapping_add(1);
        if page == EMPTY || self.slots.is_empty() {
            return false;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(page);
        while self.slots[i] != EMPTY {
            if self.slots[i] == page {
                self.counts[i] = self.counts[i].saturating_add(1);
                return true;
            }
            i = (i + 1) & mask;
        }
        if self.len * 2 >= self.slots.len() {
            return false;
        }
        self.slots[i] = page;
        self.counts[i] = 1;
        self.len += 1;
        true
    }

    /// Note `page` (given back with its entry still queued). When the table is full, `purge`
    /// first drops the stale entries of every page noted from the policy's queues (through
    /// [`Removed::take`], oldest first), and the table starts over: so the stale entries never
    /// outnumber what the table holds, whatever the program gives back between evictions.
    pub(crate) fn note(&mut self, page: PageId, purge: impl FnOnce(&mut Self)) {
        if !self.insert(page) && page != PageId::MAX && !self.slots.is_empty() {
            purge(self);
            self.slots.fill(EMPTY);
            self.counts.fill(0);
            self.len = 0;
            self.insert(page);
        }
    }

    /// Whether `page` was noted: one of its stale entries is taken.
    pub(crate) fn take(&mut self, page: PageId) -> bool {
        let page = page.wrapping_add(1);
        if self.len == 0 || page == EMPTY {
            return false;
        }
        let mask = self.slots.len() - 1;
        let mut i = self.home(page);
        loop {
            match self.slots[i] {
                EMPTY => return false,
                p if p == page => break,
                _ => i = (i + 1) & mask,
            }
        }
        if self.counts[i] > 1 {
            self.counts[i] -= 1;
            return true;
        }
        // Backward-shift deletion: entries after the hole that could live in it move up, so
        // every entry stays reachable from its home without tombstones.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        while self.slots[j] != EMPTY {
            let home = self.home(self.slots[j]);
            // Whether `home` lies cyclically outside (hole, j]: then the entry may fill the hole.
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = self.slots[j];
                self.counts[hole] = self.counts[j];
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.slots[hole] = EMPTY;
        self.counts[hole] = 0;
        self.len -= 1;
        true
    }

    /// Call `pick` to add victims to `out` until it holds `max` or `pick` finds no more,
    /// dropping the stale entries it proposes (pages noted here).
    pub(crate) fn pick_live(&mut self, max: usize, out: &mut PageList, mut pick: impl FnMut(&mut PageList)) {
        let max = max.min(PageList::CAPACITY);
        loop {
            let before = out.len();
            pick(out);
            if self.len == 0 || out.len() == before {
                return;
            }
            let mut live = PageList::default();
            out.as_slice()[before..].iter().filter(|&&p| !self.take(p)).for_each(|&p| {
                live.push(p);
            });
            let stale = out.len() - before - live.len();
            out.truncate(before);
            live.as_slice().iter().for_each(|&p| {
                out.push(p);
            });
            if stale == 0 || out.len() >= max {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// The table holds exactly what a set would, through inserts and takes in any order.
        #[test]
        fn holds_what_a_set_holds(ops in proptest::collection::vec((any::<bool>(), (0u64..200).prop_map(|p| p.wrapping_sub(100))), 0..400)) {
            let mut removed = Removed::new(64);
            let mut model: HashMap<PageId, u32> = HashMap::new();
            for (insert, page) in ops {
                if insert {
                    if removed.insert(page) {
                        *model.entry(page).or_default() += 1;
                    } else {
                        // Refused: the lists' empty marker, or a full table.
                        prop_assert!(page == PageId::MAX || (model.len() * 2 >= 64 && !model.contains_key(&page)));
                    }
                } else {
                    let held = model.get_mut(&page).map(|c| { *c -= 1; *c });
                    if held == Some(0) {
                        model.remove(&page);
                    }
                    prop_assert_eq!(removed.take(page), held.is_some());
                }
                prop_assert_eq!(removed.len, model.len());
            }
            for (page, count) in model {
                for _ in 0..count {
                    prop_assert!(removed.take(page));
                }
                prop_assert!(!removed.take(page));
            }
            prop_assert_eq!(removed.len, 0);
        }
    }
}
