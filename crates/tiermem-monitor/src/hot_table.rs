//! The hot-page extraction table of §2.1, as the memory controller would run it.
//!
//! 64 entries organised as 4 sets × 16 ways; the set is the low 2 bits of the page number. Only
//! reads count (a write reaches memory only as a cache write-back, long after the read that
//! brought the line in). A page missing from its set replaces the set's least recently used
//! entry with a count of 1; a page present with its sent bit clear counts one more read; when
//! its count reaches N (default 8, 1..=64: a 4 KiB page has 64 cache lines) the page is
//! reported once and its sent bit set, which suppresses further reports while it stays in
//! the table. Every read, sent or not, makes its entry the most recently used of the set.

/// Sets in the table.
pub const SETS: usize = 4;
/// Ways per set.
pub const WAYS: usize = 16;
/// Default report threshold (the paper's N).
pub const DEFAULT_THRESHOLD: u32 = 8;

#[derive(Debug, Clone, Copy, Default)]
struct Way {
    page: u64,
    reads: u32,
    sent: bool,
    valid: bool,
    /// Last use (a per-table clock): the smallest is the least recently used.
    used: u64,
}

/// One table entry as seen from outside (tests, debugging).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryView {
    /// Page number.
    pub page: u64,
    /// Reads counted.
    pub reads: u32,
    /// Already reported.
    pub sent: bool,
}

/// The table; see the module docs.
#[derive(Debug, Clone)]
pub struct HotPageTable {
    sets: [[Way; WAYS]; SETS],
    threshold: u32,
    clock: u64,
}

impl HotPageTable {
    /// A table reporting pages at `threshold` reads (1..=64).
    pub fn new(threshold: u32) -> tiermem_sys::Result<Self> {
        if !(1..=64).contains(&threshold) {
            return Err(tiermem_sys::Error::invalid(format!(
                "hot-page threshold {threshold} must be in 1..=64 (a page has 64 cache lines)"
            )));
        }
        Ok(Self { sets: [[Way::default(); WAYS]; SETS], threshold, clock: 0 })
    }

    /// The report threshold N.
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Forget every entry (counts and sent bits).
    pub fn clear(&mut self) {
        self.sets = [[Way::default(); WAYS]; SETS];
    }

    /// A memory request for a cache line of `page`. Returns `Some(page)` when this read makes the
    /// page hot (the report to send).
    #[inline]
    pub fn access(&mut self, page: u64, write: bool) -> Option<u64> {
        if write {
            return None;
        }
        self.clock += 1;
        let now = self.clock;
        let threshold = self.threshold;
        let set = &mut self.sets[(page & (SETS as u64 - 1)) as usize];
        if let Some(way) = set.iter_mut().find(|w| w.valid && w.page == page) {
            way.used = now;
            if way.sent {
                return None;
            }
            way.reads += 1;
            if way.reads >= threshold {
                way.sent = true;
                return Some(page);
            }
            return None;
        }
        // Not tracked: take an empty way, else the least recently used one.
        let victim = set.iter_mut().min_by_key(|w| if w.valid { w.used } else { 0 }).expect("a set has ways");
        *victim = Way { page, reads: 1, sent: threshold == 1, valid: true, used: now };
        (threshold == 1).then_some(page)
    }

    /// The valid entries of `set`, least recently used first.
    pub fn set_entries(&self, set: usize) -> Vec<EntryView> {
        let mut ways: Vec<&Way> = self.sets[set % SETS].iter().filter(|w| w.valid).collect();
        ways.sort_by_key(|w| w.used);
        ways.iter().map(|w| EntryView { page: w.page, reads: w.reads, sent: w.sent }).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_counts_reads_only_and_the_sent_bit_suppresses_repeats() {
        let mut t = HotPageTable::new(8).unwrap();
        // Page 0x8001: 7 reads and any number of writes are not enough.
        for _ in 0..7 {
            assert_eq!(t.access(0x8001, false), None);
            assert_eq!(t.access(0x8001, true), None);
        }
        assert_eq!(t.set_entries(1), vec![EntryView { page: 0x8001, reads: 7, sent: false }]);
        assert_eq!(t.access(0x8001, false), Some(0x8001), "the 8th read reports");
        for _ in 0..100 {
            assert_eq!(t.access(0x8001, false), None, "sent: no repeat");
        }
        assert_eq!(t.set_entries(1), vec![EntryView { page: 0x8001, reads: 8, sent: true }]);
        assert!(HotPageTable::new(0).is_err() && HotPageTable::new(65).is_err());
        let mut eager = HotPageTable::new(1).unwrap();
        assert_eq!(eager.access(5, false), Some(5));
        assert_eq!(eager.access(5, false), None);
    }

    #[test]
    fn sets_come_from_the_low_two_bits_and_evict_their_own_lru_way() {
        let mut t = HotPageTable::new(8).unwrap();
        // 16 pages of set 2 (page & 3 == 2) fill it; touch the first again so the second is LRU.
        let pages: Vec<u64> = (0..16).map(|k| k * 4 + 2).collect();
        for &p in &pages {
            t.access(p, false);
        }
        t.access(pages[0], false);
        // Set 3 and writes do not disturb set 2.
        t.access(3, false);
        t.access(1000 * 4 + 2, true);
        assert_eq!(t.set_entries(2).len(), 16);
        assert_eq!(t.set_entries(3).len(), 1);
        // A 17th page of set 2 evicts pages[1], the least recently used.
        t.access(500 * 4 + 2, false);
        let now: Vec<u64> = t.set_entries(2).iter().map(|e| e.page).collect();
        assert!(!now.contains(&pages[1]) && now.contains(&pages[0]) && now.contains(&2002));
        assert_eq!(now[0], pages[2], "next LRU in line");
        // An evicted page starts again from one read (and can be reported again later).
        for _ in 0..7 {
            assert_eq!(t.access(pages[1], false), None);
        }
        assert_eq!(t.access(pages[1], false), Some(pages[1]));
    }

    #[test]
    fn a_sent_entry_still_moves_to_the_front_and_is_kept() {
        let mut t = HotPageTable::new(2).unwrap();
        let pages: Vec<u64> = (0..16).map(|k| k * 4).collect();
        assert_eq!(t.access(pages[0], false), None);
        assert_eq!(t.access(pages[0], false), Some(0));
        for &p in &pages[1..] {
            t.access(p, false);
        }
        t.access(pages[0], false); // sent, but a read: most recently used again
        t.access(64 * 4, false); // evicts pages[1], not the sent page
        let now: Vec<u64> = t.set_entries(0).iter().map(|e| e.page).collect();
        assert!(now.contains(&0) && !now.contains(&4));
        assert_eq!(t.access(0, false), None, "still sent");
    }
}
