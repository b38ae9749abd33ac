//! Pages given back while their entries still wait in a policy's queues.
//!
//! A queue policy (FIFO, CLOCK, SEQ) keeps a page's entry when the program gives the page back
//! (`Replacement::on_remove`): finding it among its queues would take a walk. A page given back
//! and touched again then has two entries, and the old one, nearer the front, would evict the
//! page soon after it came back. So the policy notes the pages given back here, and an entry
//! it pops for a page found here is one such stale entry: dropped, before it is asked whether
//! the page was referenced (which would use up the live page's bit). The table is made by the
//! first page given back (the engine gives none to its policy: it costs nothing there); when
//! it is half full, the policy drops the stale entries from its queues in one pass and the
//! table starts over.

use crate::PageId;

/// A free slot; slots hold page + 1 (no page id is `PageId::MAX`: the replacement lists' empty
/// marker).
const EMPTY: PageId = 0;
/// At most this many slots (12 MiB with the counts).
const MAX_SLOTS: usize = 1 << 20;

#[derive(Debug)]
pub(crate) struct Removed {
    /// Slots of the table once made: a power of two between 64 and [`MAX_SLOTS`].
    size: usize,
    slots: Box<[PageId]>,
    /// Stale entries of each slot's page (a page given back again after it came back has one
    /// more).
    counts: Box<[u32]>,
    len: usize,
}

impl Removed {
    /// A table for up to half of `capacity` pages (rounded up to a power of two, 64 to 2^20),
    /// made when the first page is noted.
    pub(crate) fn new(capacity: usize) -> Self {
        let size = capacity.next_power_of_two().clamp(64, MAX_SLOTS);
        Self { size, slots: Box::default(), counts: Box::default(), len: 0 }
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
        if page == EMPTY {
            return false;
        }
        if self.slots.is_empty() {
            self.slots = vec![EMPTY; self.size].into_boxed_slice();
            self.counts = vec![0; self.size].into_boxed_slice();
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
        if !self.insert(page) && page != PageId::MAX {
            purge(self);
            // Every noted page has its stale entries in the queues, so the purge took them
            // all; anything left (a caller that broke the contract) is forgotten.
            if self.len > 0 {
                self.slots.fill(EMPTY);
                self.counts.fill(0);
                self.len = 0;
            }
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
