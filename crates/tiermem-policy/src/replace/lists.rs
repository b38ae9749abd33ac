//! Doubly-linked LRU lists over a preallocated slab, indexed by an open-addressing hash table:
//! insert, touch, remove and pop are O(1) and never allocate after construction.
//!
//! Optionally, page ids below a `dense` bound skip the hash: page `p` owns node `p` of a
//! directly indexed array in front of the slab (the simulator's page numbers are small and
//! dense, and a hot set then stays in a few contiguous cache lines instead of two scattered
//! ones per page).

use crate::PageId;

const NIL: u32 = u32::MAX;
/// Marks an empty hash slot; no real page id reaches it (regions have fewer than 2^24 slots).
const EMPTY: u64 = u64::MAX;

/// 16 bytes, so that a list walk or relink touches half the cache lines it did with the page
/// id inside (a slab node's page id lives in `Lists::slab_pages`; a dense node's is its index).
#[derive(Debug, Clone, Copy)]
struct Node {
    /// When the page last moved to the front of a list (a per-structure clock), its list and
    /// whether the node is in use: see [`Node::STAMP_SHIFT`].
    word: u64,
    prev: u32,
    next: u32,
}

const _: () = assert!(std::mem::size_of::<Node>() == 16);

impl Node {
    /// `word` = stamp << 9 | list << 1 | in use. 55 bits of clock last 10^16 moves.
    const STAMP_SHIFT: u32 = 9;
    const UNUSED: Node = Node { word: 0, prev: NIL, next: NIL };

    fn in_use(self) -> bool {
        self.word & 1 != 0
    }

    fn list(self) -> usize {
        (self.word >> 1) as u8 as usize
    }

    fn stamp(self) -> u64 {
        self.word >> Self::STAMP_SHIFT
    }
}

/// `L` LRU lists sharing one slab of at most `capacity` pages.
#[derive(Debug)]
pub(crate) struct Lists<const L: usize> {
    /// Nodes `0..dense` belong to pages `0..dense`; the slab follows.
    nodes: Vec<Node>,
    /// The page of slab node `dense + k` at `k`.
    slab_pages: Vec<PageId>,
    dense: u64,
    /// Pages tracked, and the most that may be.
    tracked: usize,
    capacity: usize,
    free: u32,
    head: [u32; L],
    tail: [u32; L],
    len: [usize; L],
    clock: u64,
    /// Open-addressing index: (page, node) side by side, so a probe reads one cache line.
    table: Vec<(u64, u32)>,
    mask: usize,
}

fn hash(page: PageId) -> usize {
    // Blocks of 16 consecutive pages stay in 16 consecutive slots (a scan touches a new cache
    // line every 8 pages, not every page); the blocks themselves are scattered by Fibonacci
    // hashing, so large power-of-two strides do not pile onto one slot.
    let block = (page >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 16;
    ((block << 4) | (page & 15)) as usize
}

impl<const L: usize> Lists<L> {
    /// Lists holding at most `capacity` pages in total, pages below `dense` directly indexed.
    pub(crate) fn with_dense(capacity: usize, dense: u64) -> Self {
        let capacity = capacity.clamp(1, NIL as usize / 2);
        let dense = dense.min(NIL as u64 / 2);
        // A node's list index has 8 bits of its word.
        assert!(L <= 256, "at most 256 lists");
        let d = dense as usize;
        let nodes = (0..d + capacity)
            .map(|i| Node { next: if i >= d && i + 1 < d + capacity { i as u32 + 1 } else { NIL }, ..Node::UNUSED })
            .collect();
        let table = (capacity * 2).next_power_of_two();
        Self {
            nodes,
            slab_pages: vec![EMPTY; capacity],
            dense,
            tracked: 0,
            capacity,
            free: d as u32,
            head: [NIL; L],
            tail: [NIL; L],
            len: [0; L],
            clock: 0,
            table: vec![(EMPTY, NIL); table],
            mask: table - 1,
        }
    }

    /// The hash slot (`usize::MAX` for a dense page) and node of a tracked page.
    #[inline]
    fn find(&self, page: PageId) -> Option<(usize, u32)> {
        if page < self.dense {
            return self.nodes[page as usize].in_use().then_some((usize::MAX, page as u32));
        }
        let mut i = hash(page) & self.mask;
        loop {
            let (k, n) = self.table[i];
            if k == page {
                return Some((i, n));
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Remove hash slot `i` with backward-shift deletion (keeps probe chains intact, no tombstones).
    fn unhash(&mut self, mut i: usize) {
        loop {
            self.table[i].0 = EMPTY;
            let mut j = i;
            loop {
                j = (j + 1) & self.mask;
                let k = self.table[j].0;
                if k == EMPTY {
                    return;
                }
                let home = hash(k) & self.mask;
                // Move k back into the hole unless its home lies cyclically in (i, j].
                let stays = if i <= j { i < home && home <= j } else { i < home || home <= j };
                if !stays {
                    self.table[i] = self.table[j];
                    i = j;
                    break;
                }
            }
        }
    }

    fn link_mru(&mut self, n: u32, list: usize) {
        self.clock += 1;
        let node = &mut self.nodes[n as usize];
        node.word = self.clock << Node::STAMP_SHIFT | (list as u64) << 1 | 1;
        node.prev = NIL;
        node.next = self.head[list];
        if self.head[list] != NIL {
            self.nodes[self.head[list] as usize].prev = n;
        } else {
            self.tail[list] = n;
        }
        self.head[list] = n;
        self.len[list] += 1;
    }

    fn unlink(&mut self, n: u32) {
        let node = self.nodes[n as usize];
        let (prev, next, list) = (node.prev, node.next, node.list());
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.head[list] = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail[list] = prev;
        }
        self.len[list] -= 1;
    }

    /// Whether `page` is tracked.
    #[cfg(test)]
    pub(crate) fn contains(&self, page: PageId) -> bool {
        self.find(page).is_some()
    }

    /// Make `page` the most recently used of `list`, inserting it if new. False when the slab is
    /// full and the page is new (it is then not tracked).
    pub(crate) fn touch(&mut self, page: PageId, list: usize) -> bool {
        if let Some((_, n)) = self.find(page) {
            self.unlink(n);
            self.link_mru(n, list);
            return true;
        }
        if self.tracked == self.capacity || page == EMPTY {
            return false;
        }
        self.tracked += 1;
        if page < self.dense {
            let n = page as u32;
            self.link_mru(n, list);
            return true;
        }
        let n = self.free;
        self.free = self.nodes[n as usize].next;
        self.slab_pages[n as usize - self.dense as usize] = page;
        let mut i = hash(page) & self.mask;
        while self.table[i].0 != EMPTY {
            i = (i + 1) & self.mask;
        }
        self.table[i] = (page, n);
        self.link_mru(n, list);
        true
    }

    /// Move `page` to the front of its own list if tracked; returns its list.
    pub(crate) fn touch_if_present(&mut self, page: PageId) -> Option<usize> {
        let (_, n) = self.find(page)?;
        let list = self.nodes[n as usize].list();
        self.unlink(n);
        self.link_mru(n, list);
        Some(list)
    }

    /// Move `page` to the front of `list` if tracked. Exactly [`Lists::touch_if_present`] and
    /// then, if the page was in another list, [`Lists::touch`] into `list` (the clock advances
    /// twice then), with one lookup.
    pub(crate) fn move_if_present(&mut self, page: PageId, list: usize) {
        let Some((_, n)) = self.find(page) else { return };
        let from = self.nodes[n as usize].list();
        self.unlink(n);
        if from != list {
            self.clock += 1;
        }
        self.link_mru(n, list);
    }

    /// Stop tracking `page`.
    pub(crate) fn remove(&mut self, page: PageId) -> bool {
        let Some((i, n)) = self.find(page) else { return false };
        self.tracked -= 1;
        self.unlink(n);
        self.nodes[n as usize].word = 0;
        if page < self.dense {
            return true;
        }
        self.slab_pages[n as usize - self.dense as usize] = EMPTY;
        self.unhash(i);
        self.nodes[n as usize].next = self.free;
        self.free = n;
        true
    }

    /// The least recently used page of `list`, without removing it.
    pub(crate) fn lru(&self, list: usize) -> Option<PageId> {
        let t = self.tail[list];
        (t != NIL).then(|| self.page_of(t))
    }

    /// When the least recently used page of `list` last moved to the front (None: empty).
    pub(crate) fn lru_stamp(&self, list: usize) -> Option<u64> {
        let t = self.tail[list];
        (t != NIL).then(|| self.nodes[t as usize].stamp())
    }

    /// The page node `n` (in use) holds.
    fn page_of(&self, n: u32) -> PageId {
        match (n as u64).checked_sub(self.dense) {
            None => n as u64,
            Some(k) => self.slab_pages[k as usize],
        }
    }

    /// Pages in `list`.
    pub(crate) fn len(&self, list: usize) -> usize {
        self.len[list]
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Against a Vec model: the same pages in the same order after any operation sequence,
        /// including collisions (small page ranges) and removal in the middle of probe chains.
        #[test]
        fn behaves_like_a_vector_of_lists(
            dense in prop_oneof![Just(0u64), 0u64..48],
            ops in proptest::collection::vec((0u8..4, 0u64..40, 0usize..2), 1..400),
        ) {
            // Odd pages are small ids (directly indexed below `dense`), even ones hashed.
            let id = |page: u64| if page % 2 == 1 { page } else { page << 40 | page };
            let mut lists = Lists::<2>::with_dense(24, dense);
            let mut model: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
            for (op, page, list) in ops {
                let page = id(page); // even: ids with high bits, as the engine makes them
                let tracked = model.iter().any(|l| l.contains(&page));
                match op {
                    0 | 1 => {
                        let full = model.iter().map(Vec::len).sum::<usize>() == 24;
                        let ok = lists.touch(page, list);
                        prop_assert_eq!(ok, tracked || !full);
                        if ok {
                            model.iter_mut().for_each(|l| l.retain(|&p| p != page));
                            model[list].insert(0, page);
                        }
                    }
                    2 => {
                        prop_assert_eq!(lists.remove(page), tracked);
                        model.iter_mut().for_each(|l| l.retain(|&p| p != page));
                    }
                    _ => {
                        prop_assert_eq!(lists.lru(list), model[list].last().copied());
                        if let Some(p) = lists.lru(list) {
                            lists.remove(p);
                            model[list].pop();
                        }
                    }
                }
                for (l, m) in model.iter().enumerate() {
                    prop_assert_eq!(lists.len(l), m.len());
                }
                for p in 0u64..40 {
                    let p = id(p);
                    prop_assert_eq!(lists.contains(p), model.iter().any(|l| l.contains(&p)));
                }
            }
        }
    }
}
