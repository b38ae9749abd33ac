//! The access monitor of the co-designed remote memory paper (§2): where the policies learn what
//! a program touches.
//!
//! - [`hot_table::HotPageTable`]: cache-line requests in, hot pages out (§2.1);
//! - [`ring`]: the single-producer/single-consumer report buffer with read and write pointers;
//! - [`rpt::ReversePageTable`]: physical page → {16-bit pid, 40-bit virtual page} (§2.2);
//! - [`llc::LlcFilter`]: turns loads and stores into what a memory controller sees;
//! - sources: [`Monitor`] takes the engine's faults and write faults, application hints,
//!   traced accesses (virtual, through the table) and physical accesses (through a table of
//!   their own and the reverse page table, as DAMON's regions or hardware would give).
//!
//! Reports are 64-bit words ([`Report`]) so they fit the ring.

pub mod damon;
pub mod hot_table;
pub mod llc;
pub mod ring;
pub mod rpt;
pub mod trace_format;

use hot_table::HotPageTable;
use ring::Producer;
use rpt::ReversePageTable;

/// Why a page is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ReportKind {
    /// The hot-page table saw N reads.
    Hot = 0,
    // 1 and 2 were raw faults and write faults: faults now go through the hot-page table.
    /// The application said it will read the page sequentially.
    Sequential = 3,
    /// The application said it will need the page soon.
    WillNeed = 4,
    /// The application said it will not need the page for a while.
    Cold = 5,
}

/// Application advice over a range of pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Read front to back.
    Sequential,
    /// Needed soon.
    WillNeed,
    /// Not needed for a while.
    Cold,
}

/// One report: kind (4 bits), owner (a pid or region, 16 bits) and page (40 bits) in a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Why.
    pub kind: ReportKind,
    /// Process (or engine region) the page belongs to.
    pub owner: u16,
    /// Virtual page number (or page index in the region).
    pub page: u64,
}

const PAGE_MASK: u64 = (1 << 40) - 1;

impl Report {
    /// Pack into a ring word.
    pub fn encode(self) -> u64 {
        (self.kind as u64) << 60 | u64::from(self.owner) << 40 | (self.page & PAGE_MASK)
    }

    /// Unpack a ring word (None for a word no [`Report::encode`] made).
    pub fn decode(word: u64) -> Option<Self> {
        let kind = match word >> 60 {
            0 => ReportKind::Hot,
            3 => ReportKind::Sequential,
            4 => ReportKind::WillNeed,
            5 => ReportKind::Cold,
            _ => return None,
        };
        if (word >> 56) & 0xf != 0 {
            return None;
        }
        Some(Self { kind, owner: ((word >> 40) & 0xffff) as u16, page: word & PAGE_MASK })
    }
}

/// Counters of what the monitor saw and sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MonitorCounters {
    /// Cache-line requests given to the table.
    pub line_requests: u64,
    /// Reports pushed into the ring.
    pub reports: u64,
    /// Physical hot pages the reverse page table could not translate.
    pub untranslated: u64,
    /// Reports lost because the ring was full.
    pub dropped: u64,
}

/// The producer side: every source feeds this, and it writes reports into the ring.
#[derive(Debug)]
pub struct Monitor {
    table: HotPageTable,
    /// The physical sources' own table: DAMON feeds thousands of frames a window, which would
    /// wipe the faults' counts from a shared one, and its windows are its unit of time (see
    /// [`Monitor::begin_physical_window`]).
    physical: HotPageTable,
    rpt: ReversePageTable,
    ring: Producer,
    counters: MonitorCounters,
}

impl Monitor {
    /// A monitor with a hot-page threshold of `threshold` reads writing into `ring`.
    pub fn new(threshold: u32, ring: Producer) -> tiermem_sys::Result<Self> {
        Ok(Self {
            table: HotPageTable::new(threshold)?,
            physical: HotPageTable::new(threshold)?,
            rpt: ReversePageTable::default(),
            ring,
            counters: Default::default(),
        })
    }

    /// The reverse page table physical sources are translated with.
    pub fn reverse_page_table(&mut self) -> &mut ReversePageTable {
        &mut self.rpt
    }

    /// Reports the ring can take now without dropping any.
    pub fn room(&self) -> usize {
        self.ring.room()
    }

    /// What was seen and sent so far.
    pub fn counters(&self) -> MonitorCounters {
        MonitorCounters { dropped: self.ring.dropped(), ..self.counters }
    }

    /// Push `report`; false if the ring was full (counted there as dropped).
    fn send(&mut self, report: Report) -> bool {
        let sent = self.ring.push(report.encode());
        if sent {
            self.counters.reports += 1;
        }
        sent
    }

    /// Source: the engine's faults (`write`: a write fault on a resident page), page-granular
    /// accesses into the hot-page table: a read fault counts as a read of page `page` of region
    /// `owner`, a write fault counts nothing (the table counts reads only). A page that faults
    /// N times while it stays in the table (it came back that often within about 16 other
    /// faulting pages of its set) is reported [`ReportKind::Hot`], once. Returns whether this
    /// fault sent a report.
    pub fn fault(&mut self, owner: u16, page: u64, write: bool) -> bool {
        self.counters.line_requests += 1;
        // Region and page in one key, so that equal page indices of two regions stay apart;
        // the low bits (the set index) are the page's own.
        let key = u64::from(owner) << 40 | (page & PAGE_MASK);
        let Some(hot) = self.table.access(key, write) else { return false };
        self.send(Report { kind: ReportKind::Hot, owner: (hot >> 40) as u16, page: hot & PAGE_MASK })
    }

    /// Source: application hints over `pages` pages from `first`. Will-need and cold ranges are
    /// reported page by page (at most 4096 pages per call); sequential reports the first pages a
    /// stream detector needs to lock on (the stream table's history).
    pub fn advise(&mut self, owner: u16, first: u64, pages: u64, advice: Advice) {
        let (kind, n) = match advice {
            Advice::Sequential => (ReportKind::Sequential, pages.min(8)),
            Advice::WillNeed => (ReportKind::WillNeed, pages.min(4096)),
            Advice::Cold => (ReportKind::Cold, pages.min(4096)),
        };
        for page in first..first + n {
            let _ = self.send(Report { kind, owner, page });
        }
    }

    /// Source: a traced cache-line request at virtual page `page` of `owner` (no translation
    /// needed); goes through the hot-page table.
    #[inline]
    pub fn virtual_line(&mut self, owner: u16, page: u64, write: bool) {
        self.counters.line_requests += 1;
        if let Some(hot) = self.table.access(page, write) {
            let _ = self.send(Report { kind: ReportKind::Hot, owner, page: hot });
        }
    }

    /// Source: a cache-line request at physical page `pfn` (hardware, DAMON); goes through the
    /// hot-page table, then the reverse page table.
    pub fn physical_line(&mut self, pfn: u64, write: bool) {
        self.counters.line_requests += 1;
        if let Some(hot) = self.physical.access(pfn, write) {
            match self.rpt.lookup(hot) {
                Some((pid, vpn)) => {
                    let _ = self.send(Report { kind: ReportKind::Hot, owner: pid, page: vpn });
                }
                None => self.counters.untranslated += 1,
            }
        }
    }

    /// Start a new window of a physical source: what its table counted and sent is forgotten,
    /// so a page counts the reads of one window (DAMON's samples), and a page still in use is
    /// reported again each window (a frame may also hold another page by now).
    pub fn begin_physical_window(&mut self) {
        self.physical.clear();
    }

    /// Source: DAMON regions. Every page of an accessed region counts `nr_accesses` reads (at
    /// most the threshold: more would be suppressed by the sent bit anyway).
    pub fn damon_regions(&mut self, regions: &[damon::DamonRegion]) {
        let threshold = self.table.threshold();
        for r in regions.iter().filter(|r| r.nr_accesses > 0) {
            for pfn in r.start / 4096..r.end.div_ceil(4096) {
                if self.rpt.lookup(pfn).is_none() {
                    continue;
                }
                for _ in 0..r.nr_accesses.min(threshold) {
                    self.physical_line(pfn, false);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn reports_round_trip_through_a_word(kind in 0u8..4, owner in any::<u16>(), page in 0u64..(1 << 40)) {
            let kind = [ReportKind::Hot, ReportKind::Sequential, ReportKind::WillNeed, ReportKind::Cold][kind as usize];
            let r = Report { kind, owner, page };
            prop_assert_eq!(Report::decode(r.encode()), Some(r));
        }
    }

    #[test]
    fn every_source_reaches_the_ring_translated() {
        let (tx, mut rx) = ring::ring(64);
        let mut m = Monitor::new(2, tx).unwrap();
        assert!(!m.fault(3, 100, false));
        assert!(!m.fault(3, 101, true));
        assert!(!m.fault(3, 101, true), "write faults count nothing");
        assert!(!m.fault(5, 100, false), "the same page index of another region is another page");
        assert!(m.fault(3, 100, false), "the second read fault of page 100 of region 3: hot");
        assert!(!m.fault(3, 100, false), "reported once");
        m.advise(3, 500, 2, Advice::WillNeed);
        m.virtual_line(4, 77, false);
        m.virtual_line(4, 77, true);
        m.virtual_line(4, 77, false); // second read: hot
        m.reverse_page_table().insert(9000, 12, 0xabc).unwrap();
        m.physical_line(9000, false);
        m.physical_line(9000, false); // hot, translated
        m.physical_line(9001, false);
        m.physical_line(9001, false); // hot, but no reverse mapping
        m.damon_regions(&[damon::DamonRegion { start: 9000 * 4096, end: 9002 * 4096, nr_accesses: 5, age: 1 }]);
        let got: Vec<Report> = std::iter::from_fn(|| rx.pop()).map(|w| Report::decode(w).unwrap()).collect();
        let r = |kind, owner, page| Report { kind, owner, page };
        assert_eq!(
            got,
            vec![
                r(ReportKind::Hot, 3, 100),
                r(ReportKind::WillNeed, 3, 500),
                r(ReportKind::WillNeed, 3, 501),
                r(ReportKind::Hot, 4, 77),
                r(ReportKind::Hot, 12, 0xabc),
            ],
            "DAMON's pages were already sent (sent bit); 9001 is untranslated"
        );
        assert_eq!(m.counters().untranslated, 1);
        assert_eq!(m.counters().line_requests, 6 + 7 + 2);
        // A new window forgets the sent bits: a page still in use is reported again.
        m.begin_physical_window();
        m.damon_regions(&[damon::DamonRegion { start: 9000 * 4096, end: 9001 * 4096, nr_accesses: 5, age: 1 }]);
        assert_eq!(rx.pop().and_then(Report::decode), Some(r(ReportKind::Hot, 12, 0xabc)));
    }
}
