use std::sync::Arc;
use std::sync::Mutex;

use super::lists::Lists;
use super::lru::pick_lru;
use crate::stream::StreamTable;
use crate::{lock, owned, split_page_id, PageId, PageList, Replacement};

const STREAM: usize = 0;
const RANDOM: usize = 1;
/// Inserted and not used since (read ahead, or faulted in by a source that reports no accesses).
const UNTOUCHED: usize = 2;

/// §3.1's replacement: pages of detected streams the program has already walked are evicted
/// before randomly accessed ones, since a stream rarely comes back; each group is kept in LRU
/// order. A page's group is decided each time it is used, by asking the stream training table
/// shared with the stream prefetcher (without that prefetcher, this policy trains the table
/// itself from the accesses it hears).
///
/// Pages not used since they came in (read ahead and not touched yet) form a third group.
/// The victim is the least recently used head of the three groups, where a walked stream page
/// counts as older than it is by `capacity` uses: stream pages go first unless another page has
/// gone unused for a whole memory's worth of uses longer. Strict stream-first (any stream page
/// before any other) lets a program that rescans its data lose its working set to pages it
/// never uses again; this keeps the preference without that cliff. Without
/// any access reports (the engine alone) every page stays untouched and the policy is CLOCK-like
/// LRU by insertion with the referenced bit as second chance.
#[derive(Debug)]
pub struct StreamFirst {
    table: Arc<StreamTable>,
    trains: bool,
    groups: Groups,
}

/// The three groups and how victims are chosen among them: all of stream-first but its table.
#[derive(Debug)]
pub(crate) struct Groups {
    lists: Mutex<Lists<3>>,
    informed: std::sync::atomic::AtomicBool,
    /// How much older than it is a walked stream page counts, in uses.
    stream_bonus: u64,
}

impl Groups {
    pub(crate) fn new(capacity: usize, dense: u64) -> Self {
        Self {
            lists: Mutex::new(Lists::with_dense(capacity * 2 + 64, dense)),
            informed: std::sync::atomic::AtomicBool::new(false),
            stream_bonus: capacity as u64,
        }
    }

    fn insert(&self, page: PageId) {
        lock(&self.lists).touch(page, UNTOUCHED);
    }

    fn access(&self, page: PageId, in_stream: bool) {
        self.informed.store(true, std::sync::atomic::Ordering::Relaxed);
        lock(&self.lists).move_if_present(page, group(in_stream));
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = !self.informed.load(std::sync::atomic::Ordering::Relaxed);
        pick(&mut lock(&self.lists), self.stream_bonus, second_chance, max, is_referenced, out);
    }

    pub(crate) fn insert_mut(&mut self, page: PageId) {
        owned(&mut self.lists).touch(page, UNTOUCHED);
    }

    fn remove(&self, page: PageId) {
        lock(&self.lists).remove(page);
    }

    pub(crate) fn remove_mut(&mut self, page: PageId) {
        owned(&mut self.lists).remove(page);
    }

    pub(crate) fn access_mut(&mut self, page: PageId, in_stream: bool) {
        *self.informed.get_mut() = true;
        owned(&mut self.lists).move_if_present(page, group(in_stream));
    }

    pub(crate) fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        let second_chance = !*self.informed.get_mut();
        pick(owned(&mut self.lists), self.stream_bonus, second_chance, max, is_referenced, out);
    }
}

fn group(in_stream: bool) -> usize {
    if in_stream {
        STREAM
    } else {
        RANDOM
    }
}

impl StreamFirst {
    /// Room for `capacity` resident pages; `table` is the shared training table, which this
    /// policy trains itself (from the accesses it hears) unless the stream prefetcher does.
    pub fn new(capacity: usize, table: Arc<StreamTable>, trains: bool) -> Self {
        Self::with_dense(capacity, table, trains, 0)
    }

    /// As [`StreamFirst::new`], page ids below `dense` tracked without hashing (see
    /// [`crate::PolicyOptions::dense_pages`]).
    pub fn with_dense(capacity: usize, table: Arc<StreamTable>, trains: bool, dense: u64) -> Self {
        Self { table, trains, groups: Groups::new(capacity, dense) }
    }

    /// Pages currently in the stream, random and untouched groups.
    pub fn group_sizes(&self) -> (usize, usize, usize) {
        let lists = lock(&self.groups.lists);
        (lists.len(STREAM), lists.len(RANDOM), lists.len(UNTOUCHED))
    }

    /// Train the table on a used page if this policy does, and say whether the page is on a
    /// walked stream. The table may be shared with the stream prefetcher, so this locks it
    /// (uncontended in the simulator; [`crate::StreamPair`] avoids even that).
    fn classify(&self, page: PageId) -> bool {
        let (owner, index) = split_page_id(page);
        if self.trains {
            self.table.train(owner, index);
        }
        self.table.in_stream(owner, index)
    }
}

impl Replacement for StreamFirst {
    fn name(&self) -> &'static str {
        "stream-first"
    }

    fn on_insert(&self, page: PageId) {
        self.groups.insert(page);
    }

    fn on_access(&self, page: PageId) {
        self.groups.access(page, self.classify(page));
    }

    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        self.groups.pick_victims(max, is_referenced, out);
    }

    fn on_remove(&self, page: PageId) {
        self.groups.remove(page);
    }

    fn one_entry_per_page(&self) -> bool {
        true
    }

    fn on_insert_mut(&mut self, page: PageId) {
        self.groups.insert_mut(page);
    }

    fn on_remove_mut(&mut self, page: PageId) {
        self.groups.remove_mut(page);
    }

    fn on_access_mut(&mut self, page: PageId) {
        let in_stream = self.classify(page);
        self.groups.access_mut(page, in_stream);
    }

    fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        self.groups.pick_victims_mut(max, is_referenced, out);
    }
}

fn pick(
    lists: &mut Lists<3>,
    stream_bonus: u64,
    second_chance: bool,
    max: usize,
    is_referenced: &dyn Fn(PageId) -> bool,
    out: &mut PageList,
) {
    let max = max.min(PageList::CAPACITY);
    while out.len() < max {
        // The oldest head goes, a stream head counting `stream_bonus` uses older.
        let stream = lists.lru_stamp(STREAM).map(|s| s.saturating_sub(stream_bonus));
        let list = [(stream, STREAM), (lists.lru_stamp(UNTOUCHED), UNTOUCHED), (lists.lru_stamp(RANDOM), RANDOM)]
            .into_iter()
            .filter_map(|(stamp, list)| stamp.map(|s| (s, list)))
            .min()
            .map_or(RANDOM, |(_, list)| list);
        let before = out.len();
        pick_lru(lists, list, out.len() + 1, second_chance, is_referenced, out);
        if out.len() == before {
            // Everything there was referenced (moved to its front): fall back to the others.
            for other in [STREAM, UNTOUCHED, RANDOM] {
                if out.len() < max {
                    pick_lru(lists, other, max, second_chance, is_referenced, out);
                }
            }
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_id;
    use crate::stream::StreamConfig;

    #[test]
    fn walked_stream_pages_go_first_then_the_rest_by_last_use() {
        let table = Arc::new(StreamTable::new(StreamConfig::default()));
        let policy = StreamFirst::new(64, table, true);
        assert_eq!(policy.groups.stream_bonus, 64);
        // Random pages of region 1, used once each after coming in.
        for p in [5000, 9000, 13000] {
            policy.on_insert(page_id(1, p));
            policy.on_access(page_id(1, p));
        }
        // A read-ahead page nobody uses.
        policy.on_insert(page_id(1, 777));
        // A stride-1 stream in region 1, each page faulted in and then used.
        for p in 100..110 {
            policy.on_insert(page_id(1, p));
            policy.on_access(page_id(1, p));
        }
        // The stream is detected at its fifth page (104): 100..103 were random when used.
        assert_eq!(policy.group_sizes(), (6, 7, 1));
        policy.on_access(page_id(1, 101)); // now on the walked stream: moves to the stream group
        let mut out = PageList::default();
        policy.pick_victims(9, &|_| false, &mut out);
        let pages: Vec<u64> = out.as_slice().iter().map(|&id| split_page_id(id).1).collect();
        // The stream first, in LRU order (its pages count 64 uses older than they are, so older
        // than everything else here); then plain LRU over the rest: the random pages were used
        // before the read-ahead page 777 came in.
        assert_eq!(pages, vec![104, 105, 106, 107, 108, 109, 101, 5000, 9000]);
    }

    #[test]
    fn without_access_reports_it_is_clock_over_insertion_order() {
        let policy = StreamFirst::new(64, Arc::new(StreamTable::new(StreamConfig::default())), true);
        for p in 0..4 {
            policy.on_insert(page_id(0, p));
        }
        let mut out = PageList::default();
        policy.pick_victims(2, &|id| id == page_id(0, 0), &mut out);
        assert_eq!(out.as_slice(), &[page_id(0, 1), page_id(0, 2)]);
    }
}

#[cfg(test)]
mod bonus_tests {
    use super::*;
    use crate::page_id;
    use crate::stream::StreamConfig;

    #[test]
    fn a_random_page_unused_for_longer_than_the_bonus_goes_before_a_stream_page() {
        let policy = StreamFirst::new(4, Arc::new(StreamTable::new(StreamConfig::default())), true);
        policy.on_insert(page_id(0, 9000));
        policy.on_access(page_id(0, 9000)); // random, used early
        for p in 0..12 {
            policy.on_insert(page_id(0, p));
            policy.on_access(page_id(0, p));
        }
        let mut out = PageList::default();
        policy.pick_victims(1, &|_| false, &mut out);
        assert_eq!(out.as_slice(), &[page_id(0, 9000)], "unused for 24 uses, more than the bonus of 4");
    }
}
