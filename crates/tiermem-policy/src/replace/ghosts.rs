//! Recently evicted pages and when they went, for the refault distance (how many evictions ago
//! a page coming back was evicted), in a fixed, compact table.
//!
//! A hash map from page to eviction number plus a queue to expire old entries cost about 78
//! bytes per entry kept (hashbrown rounds its buckets up to a power of two at 7/8 load, 17 bytes
//! each, and the queue holds 16 bytes more); `seq-protect` keeps 1.6 entries per page of memory,
//! so its bookkeeping took 1.8% of the budget, memory the budget had to give up inside a cgroup.
//! Here an entry is one 64-bit word, a 23-bit tag of the page's hash, the low 40 bits of its
//! eviction number and one bit the policy may mark it with (`seq-balance`: the page left
//! protection), in sets of eight words (one cache line), at twice the entries kept: 16 bytes
//! per entry. An entry expires by its age alone, so nothing has to be queued to forget it.
//!
//! What this gives up, deliberately: when more than eight live pages hash to one set, the oldest
//! of them is forgotten early (about 2% of sets at this load, and the oldest is the entry
//! closest to expiring anyway), and a page whose hash matches another's set and tag (a chance of
//! about one in a million per lookup) is taken for it. Either only changes whether one page-in
//! counts as a short refault.
//!
//! The table comes from a zeroed allocation and so costs nothing until evictions write to it:
//! it is sized for the budget (16 bytes per entry, 1.6 entries per page of budget: about 0.6%
//! of it), which a program that stays under its limit never reaches. A caller that needs it in
//! place up front (the engine under the preload's OOM guard) calls [`Ghosts::make_resident`].

/// Words per set: one 64-byte cache line.
const WAYS: usize = 8;
/// Bits of the eviction number kept; ages are computed modulo 2^40 (a trillion evictions).
const STAMP_BITS: u32 = 40;
const STAMP_MASK: u64 = (1 << STAMP_BITS) - 1;
/// The one bit above the tag: a mark the caller may set on an entry.
const MARK: u64 = 1 << 63;
/// The tag's bits.
const TAG_MASK: u64 = !STAMP_MASK & !MARK;

/// A table of the last `keep` evicted pages; see the module docs.
#[derive(Debug)]
pub(crate) struct Ghosts {
    /// The sets, `WAYS` words each, from `first` on (the first word on a cache-line boundary).
    words: Vec<u64>,
    first: usize,
    sets: usize,
    /// Entries are kept for this many evictions.
    keep: u64,
}

/// The page's set (from the high half of a mixed hash) and tag (from the low bits, never 0, so
/// an empty word is 0).
#[inline]
fn locate(page: u64, sets: usize) -> (usize, u64) {
    // SplitMix64's finaliser: every input bit reaches every output bit.
    let mut h = page;
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^= h >> 31;
    let set = ((h >> 32) * sets as u64) >> 32;
    let tag = (h & 0x7F_FFFF) | 1;
    (set as usize, tag << STAMP_BITS)
}

/// Evictions since the eviction stamped in `word`, as of eviction number `now`.
#[inline]
fn age(word: u64, now: u64) -> u64 {
    now.wrapping_sub(word) & STAMP_MASK
}

/// Whether `word` holds an entry from the last `keep` evictions.
#[inline]
fn live(word: u64, now: u64, keep: u64) -> bool {
    word != 0 && age(word, now) < keep
}

impl Ghosts {
    /// Room for the last `keep` evictions (at least one).
    pub(crate) fn new(keep: usize) -> Self {
        let keep = keep.max(1);
        // Twice the entries kept: eight ways at half load rarely overflow.
        let sets = (2 * keep).div_ceil(WAYS).max(1);
        // Zeroed words (untouched pages of a fresh mapping for any size that matters), one set
        // more than needed so that the sets can start on a cache line: an allocation of plain
        // words is only 16-byte aligned, and asking for 64 would have the allocator zero it by
        // hand, page by page.
        let words = vec![0u64; (sets + 1) * WAYS];
        let first = words.as_ptr().align_offset(WAYS * std::mem::size_of::<u64>()).min(WAYS);
        Self { words, first, sets, keep: keep as u64 }
    }

    /// Write to every memory page of the table now rather than as evictions reach it, keeping
    /// what it holds.
    pub(crate) fn make_resident(&mut self) {
        const PAGE_WORDS: usize = 4096 / std::mem::size_of::<u64>();
        for word in self.words.iter_mut().step_by(PAGE_WORDS) {
            // Stored back as read: a write the compiler cannot drop as a no-op.
            *word = std::hint::black_box(*word);
        }
    }

    /// The eight words of set `set`.
    #[inline]
    fn ways(&mut self, set: usize) -> &mut [u64; WAYS] {
        let start = self.first + set * WAYS;
        (&mut self.words[start..start + WAYS]).try_into().expect("a set is WAYS words")
    }

    /// Bytes of the table.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.words.len() * std::mem::size_of::<u64>()
    }

    /// Remember that `page` was evicted as eviction number `now` (counted up by one per
    /// eviction). A live entry of the page keeps its mark.
    pub(crate) fn insert(&mut self, page: u64, now: u64) {
        self.put(page, now, false);
    }

    /// [`Ghosts::insert`] with a mark, which [`Ghosts::take_marked`] gives back and a later
    /// [`Ghosts::insert`] of the page within `keep` evictions keeps.
    pub(crate) fn insert_marked(&mut self, page: u64, now: u64) {
        self.put(page, now, true);
    }

    fn put(&mut self, page: u64, now: u64, mark: bool) {
        let (set, tag) = locate(page, self.sets);
        let keep = self.keep;
        let ways = self.ways(set);
        // The page's own entry, else a free or expired word, else the oldest.
        let own = ways.iter().position(|&w| w & TAG_MASK == tag && live(w, now, keep));
        let slot = own.unwrap_or_else(|| {
            let reuse = |w: u64| if live(w, now, keep) { age(w, now) } else { u64::MAX };
            (0..WAYS).max_by_key(|&i| reuse(ways[i])).unwrap_or(0)
        });
        let marked = mark || own.is_some_and(|i| ways[i] & MARK != 0);
        ways[slot] = tag | (now & STAMP_MASK) | if marked { MARK } else { 0 };
    }

    /// Forget `page` and return how many evictions ago it was evicted, as of eviction number
    /// `now`, if that was within the last `keep` (the policy takes the mark too).
    #[cfg(test)]
    pub(crate) fn take(&mut self, page: u64, now: u64) -> Option<u64> {
        self.take_marked(page, now).map(|(ago, _)| ago)
    }

    /// [`Ghosts::take`], with the entry's mark.
    pub(crate) fn take_marked(&mut self, page: u64, now: u64) -> Option<(u64, bool)> {
        let (set, tag) = locate(page, self.sets);
        let keep = self.keep;
        let ways = self.ways(set);
        let i = ways.iter().position(|&w| w & TAG_MASK == tag && live(w, now, keep))?;
        let (evicted_ago, mark) = (age(ways[i], now), ways[i] & MARK != 0);
        ways[i] = 0;
        Some((evicted_ago, mark))
    }

    /// Live entries (for tests).
    #[cfg(test)]
    fn len(&self, now: u64) -> usize {
        self.words.iter().filter(|&&w| live(w, now, self.keep)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_found_once_with_its_age_until_it_expires() {
        let mut g = Ghosts::new(100);
        g.insert(7, 1);
        g.insert(9, 2);
        assert_eq!(g.take(7, 50), Some(49));
        assert_eq!(g.take(7, 50), None, "taken once");
        assert_eq!(g.take(9, 101), Some(99), "within the last 100 evictions");
        g.insert(9, 102);
        assert_eq!(g.take(9, 202), None, "100 evictions ago is past the last 100");
        assert_eq!(g.take(8, 3), None, "never evicted");
    }

    #[test]
    fn a_mark_comes_back_with_its_entry_and_survives_a_new_insert() {
        let mut g = Ghosts::new(100);
        g.insert_marked(7, 1);
        g.insert(8, 2);
        assert_eq!(g.take_marked(7, 10), Some((9, true)));
        assert_eq!(g.take_marked(8, 10), Some((8, false)));
        // Marked, then inserted again while the entry lives: one entry, the new age, the mark
        // kept.
        g.insert_marked(9, 11);
        g.insert(9, 12);
        assert_eq!(g.len(12), 1);
        assert_eq!(g.take_marked(9, 13), Some((1, true)));
        // Once the marked entry has expired, a new one starts unmarked.
        g.insert_marked(5, 20);
        g.insert(5, 120);
        assert_eq!(g.take_marked(5, 121), Some((1, false)));
    }

    #[test]
    fn evicting_a_page_again_replaces_its_entry() {
        let mut g = Ghosts::new(100);
        g.insert(5, 10);
        g.insert(5, 20);
        assert_eq!(g.len(20), 1);
        assert_eq!(g.take(5, 25), Some(5));
        assert_eq!(g.len(25), 0);
    }

    /// The table keeps (nearly) every one of its last `keep` evictions, also once old entries
    /// have expired in place many times over, and costs 16 bytes per entry instead of about 78.
    #[test]
    fn the_last_keep_evictions_are_nearly_all_found() {
        let keep = 40_000u64;
        let mut g = Ghosts::new(keep as usize);
        assert!(g.bytes() <= 16 * keep as usize + 64, "{} bytes", g.bytes());
        // Pages from a few regions, in a pattern nothing like uniform.
        let page = |n: u64| ((n % 3) << 36) | (n * 17 % 1_000_003);
        let total = 5 * keep;
        for n in 1..=total {
            g.insert(page(n), n);
        }
        let found = (total - keep + 1..=total).filter(|&n| g.take(page(n), total) == Some(total - n)).count();
        assert!(found as f64 >= 0.99 * keep as f64, "found {found} of the last {keep}");
        // The older ones are gone.
        let stale = (1..=total - keep).filter(|&n| g.take(page(n), total).is_some()).count();
        assert!(stale < 10, "{stale} expired entries still found");
    }

    /// Of the table's memory pages, how many are resident (by /proc/self/pagemap, bit 63:
    /// present; not the process's resident total, which other tests running at the same time
    /// move both ways).
    fn resident_pages(g: &Ghosts) -> (usize, usize) {
        use std::io::{Read, Seek};
        let start = g.words.as_ptr() as u64;
        let (first, last) = (start / 4096, (start + g.bytes() as u64 - 1) / 4096);
        let mut file = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        file.seek(std::io::SeekFrom::Start(first * 8)).expect("seek");
        let mut entries = vec![0u8; ((last - first + 1) * 8) as usize];
        file.read_exact(&mut entries).expect("read pagemap");
        let present = entries.chunks_exact(8).filter(|e| e[7] & 0x80 != 0).count();
        (present, entries.len() / 8)
    }

    /// A fresh table costs no memory until it is written: sized for a 16 GiB budget it is 107
    /// MB, which a program that never reaches its limit should not pay. Made resident (for the
    /// OOM guard, which needs the policy's memory in place before the cgroup fills up, not
    /// faulted in on the reclaim path), every page is there, and what it held still is.
    #[test]
    fn the_table_takes_memory_as_it_is_written_or_when_made_resident() {
        // 64 MiB of table: a fresh mapping whatever glibc's mmap threshold has grown to.
        let mut g = Ghosts::new(4 << 20);
        assert_eq!((g.words.as_ptr() as usize + g.first * 8) % 64, 0, "sets start on a cache line");
        let (present, pages) = resident_pages(&g);
        assert!(present * 10 < pages, "{present} of a fresh table's {pages} pages are resident");
        g.insert(12_345, 7);
        g.make_resident();
        let (present, pages) = resident_pages(&g);
        assert_eq!(present, pages, "{present} of the table's {pages} pages are resident");
        assert_eq!(g.take(12_345, 9), Some(2), "an entry made before is kept");
    }

    #[test]
    fn ages_wrap_with_the_stamp() {
        let mut g = Ghosts::new(10);
        let now = STAMP_MASK - 2;
        g.insert(1, now);
        assert_eq!(g.take(1, now + 5), Some(5), "across the 40-bit wrap");
    }
}
