use std::sync::Arc;
use std::sync::Mutex;

use super::lists::Lists;
use super::lru::pick_lru;
use crate::stream::StreamTable;
use crate::{lock, split_page_id, PageId, PageList, Replacement};

const STREAM: usize = 0;
const RANDOM: usize = 1;

/// §3.1's replacement: pages of detected streams are evicted before randomly accessed ones,
/// since a stream rarely comes back; each group is kept in LRU order. A page's group is decided
/// when it comes in and again each time it is used, by asking the stream training table shared
/// with the stream prefetcher. Without that prefetcher, this policy trains the table itself.
#[derive(Debug)]
pub struct StreamFirst {
    table: Arc<StreamTable>,
    trains: bool,
    lists: Mutex<Lists<2>>,
    informed: std::sync::atomic::AtomicBool,
}

impl StreamFirst {
    /// Room for `capacity` resident pages; `table` is the shared training table, which this
    /// policy trains itself (from inserts and accesses) unless the stream prefetcher does.
    pub fn new(capacity: usize, table: Arc<StreamTable>, trains: bool) -> Self {
        Self {
            table,
            trains,
            lists: Mutex::new(Lists::new(capacity * 2 + 64)),
            informed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn group(&self, page: PageId) -> usize {
        let (owner, index) = split_page_id(page);
        if self.trains {
            self.table.train(owner, index);
        }
        if self.table.in_stream(owner, index) {
            STREAM
        } else {
            RANDOM
        }
    }

    /// Pages currently in the stream group and the random group.
    pub fn group_sizes(&self) -> (usize, usize) {
        let lists = lock(&self.lists);
        (lists.len(STREAM), lists.len(RANDOM))
    }
}

impl Replacement for StreamFirst {
    fn name(&self) -> &'static str {
        "stream-first"
    }

    fn on_insert(&self, page: PageId) {
        let group = self.group(page);
        lock(&self.lists).touch(page, group);
    }

    fn on_access(&self, page: PageId) {
        self.informed.store(true, std::sync::atomic::Ordering::Relaxed);
        let group = self.group(page);
        let mut lists = lock(&self.lists);
        if lists.touch_if_present(page).is_some_and(|g| g != group) {
            lists.touch(page, group);
        }
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = !self.informed.load(std::sync::atomic::Ordering::Relaxed);
        let mut lists = lock(&self.lists);
        pick_lru(&mut lists, STREAM, max, second_chance, is_referenced, out);
        pick_lru(&mut lists, RANDOM, max, second_chance, is_referenced, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_id;
    use crate::stream::StreamConfig;

    #[test]
    fn stream_pages_go_first_then_random_ones_in_lru_order() {
        let table = Arc::new(StreamTable::new(StreamConfig::default()));
        let policy = StreamFirst::new(64, table, true);
        // Random pages of region 1 first (older), then a stride-1 stream in region 1.
        for p in [5000, 9000, 13000] {
            policy.on_insert(page_id(1, p));
        }
        for p in 100..110 {
            policy.on_insert(page_id(1, p));
        }
        let (stream, random) = policy.group_sizes();
        // 100..103 came before the stream was detected (at the fifth page, 104).
        assert_eq!((stream, random), (6, 7));
        policy.on_access(page_id(1, 101)); // now on a detected stream: moves to the stream group
        let mut out = PageList::default();
        policy.pick_victims(8, &|_| false, &mut out);
        let pages: Vec<u64> = out.as_slice().iter().map(|&id| split_page_id(id).1).collect();
        assert_eq!(pages, vec![104, 105, 106, 107, 108, 109, 101, 5000]);
    }
}
