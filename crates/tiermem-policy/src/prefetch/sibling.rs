use super::with_ondemand::{OnTopOfOndemand, WithOndemand};
use crate::{page_id, split_page_id, FaultInfo, PageId, PageList};

/// `ondemand` plus the pages of parallel arrays: a miss on `a[i]` predicts misses on `b[i]` and
/// `c[i]` when the program has been missing those together, each a fixed distance away.
///
/// The case it is for: a gather through an index over several arrays of one length (a
/// structure of arrays, a graph's edge arrays, a column store). igraph's PageRank reads each
/// edge's source, target and weight in target order from three arrays of 15 MB sorted by
/// source (quick scale); at 20% of the footprint nearly half of its 1.2 M misses follow the one
/// before at +7,326 or −3,663 pages, one array length either way. No address stream predicts
/// the first of a group; the others are where the first says, and read at once they wait
/// together instead of one after another.
///
/// - Distances are in bytes where the fault gives the byte it touched (a SIGBUS does): the same
///   element of two arrays is then exactly one distance apart, wherever in its page it lies,
///   where in pages it is one of two (the arrays' starts seldom share their offset in a page),
///   and both would be read. Without the byte (a userfaultfd message, a page-level trace) they
///   are whole pages.
/// - Faults are grouped by page id in zones of [`ZONE_PAGES`] (a zone never spans regions: page
///   ids keep the region above the page index). Each zone learns the distances from its misses
///   to the next [`LOOKBACK`] faults, in [`SLOTS`] counters; a distance seen again scores, a new one
///   takes a free counter or wears the weakest down, so one-off distances (the rest of a random
///   gather) never build up. Scores halve every [`AGE_FAULTS`] faults, so a pattern that ends
///   fades.
/// - A fault that `ondemand` reads a window for gets that window (a sequential stream; arrays
///   walked in lockstep are several); any other reads the page at each distance its zone
///   scored at least [`CONFIDENT`] for. Not the siblings' own siblings too: on PageRank at 20% (distances in
///   pages then) that read a third more (1.83 M pages against 1.38 M) for no fewer misses.
/// - Distances shorter than [`NEAR`] pages are left to `ondemand`.
/// - Hits on pages still on their way count as faults: once the siblings are read ahead they
///   show up that way (or not at all, and the scores fade until misses teach them again).
pub type Sibling = WithOndemand<Table>;

/// Pages a zone covers (4 MiB).
pub const ZONE_PAGES: u64 = 1 << 10;
/// Zones tracked at once (direct-mapped by zone number, tagged).
const ZONES: usize = 4096;
/// Distances a zone keeps counts for.
pub const SLOTS: usize = 4;
/// Faults after a miss whose distance from it is learned.
pub const LOOKBACK: usize = 2;
/// Score from which a distance is read ahead.
pub const CONFIDENT: u8 = 12;
const MAX_SCORE: u8 = 15;
/// Distances below this many pages are sequential: `ondemand`'s.
pub const NEAR: u64 = 64;
const PAGE_BYTES: u64 = 4096;
/// Faults between halvings of every score.
pub const AGE_FAULTS: u64 = 1 << 13;

#[derive(Debug, Clone, Copy)]
struct Zone {
    /// The zone number (page id / ZONE_PAGES), or u64::MAX when unused.
    tag: u64,
    /// The aging round its scores were last brought up to date in.
    round: u64,
    distances: [Distance; SLOTS],
    scores: [u8; SLOTS],
}

/// From one fault to another: whole pages (wrapping, over page ids) plus 0..4096 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Distance {
    pages: i64,
    bytes: u16,
}

/// Where a fault fell: its page id and the byte in the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct At {
    id: PageId,
    offset: u16,
}

impl At {
    const NONE: At = At { id: PageId::MAX, offset: 0 };

    /// The distance from `from` to here.
    fn since(self, from: At) -> Distance {
        let bytes = i32::from(self.offset) - i32::from(from.offset);
        let pages = self.id.wrapping_sub(from.id) as i64;
        // Carry a negative byte difference into the pages: one distance, one way to write it.
        Distance {
            pages: pages.wrapping_add(i64::from(bytes.div_euclid(PAGE_BYTES as i32))),
            bytes: bytes.rem_euclid(PAGE_BYTES as i32) as u16,
        }
    }

    /// The page `distance` from here.
    fn page_at(self, distance: Distance) -> PageId {
        let carry = (u64::from(self.offset) + u64::from(distance.bytes)) / PAGE_BYTES;
        self.id.wrapping_add(distance.pages as u64).wrapping_add(carry)
    }
}

const UNUSED: Zone =
    Zone { tag: u64::MAX, round: 0, distances: [Distance { pages: 0, bytes: 0 }; SLOTS], scores: [0; SLOTS] };

/// `sibling`'s zones and the last faults.
#[derive(Debug)]
pub struct Table {
    zones: Box<[Zone]>,
    /// The last faults, newest first.
    recent: [At; LOOKBACK],
    faults: u64,
}

impl Default for Sibling {
    fn default() -> Self {
        Self::new()
    }
}

impl Sibling {
    /// A prefetcher that has learned nothing; its table (about 200 KiB) is written here, not on
    /// the fault path.
    pub fn new() -> Self {
        let table = Table { zones: vec![UNUSED; ZONES].into_boxed_slice(), recent: [At::NONE; LOOKBACK], faults: 0 };
        Self::with_table(table)
    }
}

fn slot_of(zone: u64) -> usize {
    (zone.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - ZONES.trailing_zeros())) as usize
}

impl Table {
    fn round(&self) -> u64 {
        self.faults / AGE_FAULTS
    }

    /// The zone of the page of `at`, its scores aged to now; taken over when `create` and
    /// another zone held the slot, else None then.
    fn zone(&mut self, at: At, create: bool) -> Option<&mut Zone> {
        let tag = at.id / ZONE_PAGES;
        let round = self.round();
        let z = &mut self.zones[slot_of(tag)];
        if z.tag != tag {
            if !create {
                return None;
            }
            *z = Zone { tag, round, ..UNUSED };
        }
        let halvings = round - z.round;
        if halvings > 0 {
            z.scores.iter_mut().for_each(|s| *s = s.checked_shr(halvings.min(8) as u32).unwrap_or(0));
            z.round = round;
        }
        Some(z)
    }

    /// Learn that `at` faulted: its distance from each recent fault, in that fault's zone.
    fn learn(&mut self, at: At) {
        self.faults += 1;
        for k in 0..LOOKBACK {
            let before = self.recent[k];
            if before == At::NONE {
                continue;
            }
            let distance = at.since(before);
            if distance.pages.unsigned_abs() < NEAR {
                continue;
            }
            let Some(z) = self.zone(before, true) else { continue };
            if let Some(s) = (0..SLOTS).find(|&s| z.scores[s] > 0 && z.distances[s] == distance) {
                z.scores[s] = (z.scores[s] + 1).min(MAX_SCORE);
            } else if let Some(s) = (0..SLOTS).find(|&s| z.scores[s] == 0) {
                z.distances[s] = distance;
                z.scores[s] = 1;
            } else {
                let weakest = (0..SLOTS).min_by_key(|&s| z.scores[s]).unwrap_or(0);
                z.scores[weakest] -= 1;
            }
        }
        self.recent.copy_within(..LOOKBACK - 1, 1);
        self.recent[0] = at;
    }

    /// Distances the zone of `at` is confident of.
    fn confident(&mut self, at: At) -> [Option<Distance>; SLOTS] {
        let Some(z) = self.zone(at, false) else { return [None; SLOTS] };
        std::array::from_fn(|s| (z.scores[s] >= CONFIDENT).then_some(z.distances[s]))
    }

    /// Push the pages of the siblings of `at` into `out` (page ids), none past the end of the
    /// faulting region (of `region_pages`; other regions' ends are the engine's to check).
    fn predict(&mut self, at: At, region_pages: u64, out: &mut PageList) {
        for distance in self.confident(at).into_iter().flatten() {
            let sibling = at.page_at(distance);
            let (region, page) = split_page_id(sibling);
            if region != split_page_id(at.id).0 || page < region_pages {
                out.push(sibling);
            }
        }
    }
}

impl OnTopOfOndemand for Table {
    const NAME: &'static str = "sibling";

    /// One fault: `ondemand`'s window if it has one, else the siblings. A fault `ondemand`
    /// reads ahead of is part of a sequential stream; arrays walked in lockstep are each such
    /// a stream, and their siblings would only come ahead of the windows.
    fn advance(&mut self, fault: &FaultInfo, out: &mut PageList, sequential: impl FnOnce(&mut PageList)) {
        let at = At { id: page_id(fault.region, fault.page), offset: fault.offset % PAGE_BYTES as u16 };
        self.learn(at);
        let mut window = PageList::default();
        sequential(&mut window);
        if window.is_empty() {
            self.predict(at, fault.region_pages, out);
        }
        for &page in window.as_slice() {
            out.push(page_id(fault.region, page));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prefetcher;

    fn fault(p: &Sibling, region: u32, page: u64) -> Vec<PageId> {
        let mut out = PageList::default();
        p.on_fault(&FaultInfo { offset: 0, region, page, region_pages: 1 << 30, write: false, hit: false }, &mut out);
        out.as_slice().to_vec()
    }

    /// Scattered indexes below `n`, with no repeating distance between consecutive ones (a
    /// multiplicative walk `k * c % n` would have one).
    fn scattered(k: u64, n: u64) -> u64 {
        let mut x = k.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        (x ^ x >> 32) % n
    }

    #[test]
    fn a_gather_over_three_arrays_reads_the_other_two_with_the_first() {
        // Three arrays of 3,663 pages in one region, each starting on a zone boundary as
        // separate mappings would, gathered at one index each time in the order a, c, b
        // (igraph's PageRank conversion).
        const LEN: u64 = 3_663;
        const APART: u64 = 4 * ZONE_PAGES;
        let p = Sibling::new();
        let group = |i: u64| [i, i + 2 * APART, i + APART];
        let mut predicted = 0;
        for k in 0..2_000 {
            let [a, c, b] = group(scattered(k, LEN));
            let read = fault(&p, 0, a);
            if k >= 1_000 {
                // Learned by now: both siblings of a, unless two groups happened to lie next to
                // each other and `ondemand` read a window instead.
                let window = !read.is_empty() && read.iter().all(|&w| w.abs_diff(a) <= 64);
                assert!(window || read == [page_id(0, c), page_id(0, b)], "group {k}: {read:?}");
                predicted += usize::from(!window);
            }
            fault(&p, 0, c);
            fault(&p, 0, b);
        }
        assert!(predicted > 950, "{predicted} of 1000 groups had their siblings read");
    }

    #[test]
    fn with_the_byte_of_each_fault_one_distance_names_the_exact_page() {
        // Two arrays of 8-byte elements whose starts lie at different offsets in their pages
        // (bytes 0 and 1,000): the same element is 4,096 or 4,097 pages apart, depending on
        // where in its page it lies, but always 4,096 pages and 1,000 bytes.
        const B: u64 = 4 * ZONE_PAGES * 4096 + 1_000;
        let p = Sibling::new();
        let at = |byte: u64| (byte / 4096, (byte % 4096) as u16);
        let fault_at = |byte: u64| {
            let (page, offset) = at(byte);
            let mut out = PageList::default();
            p.on_fault(
                &FaultInfo { region: 0, page, region_pages: 1 << 30, write: false, hit: false, offset },
                &mut out,
            );
            out.as_slice().to_vec()
        };
        let mut exact = 0;
        for k in 0..3_000 {
            // A zone of elements (1,024 pages).
            let element = scattered(k, ZONE_PAGES * 4096 / 8);
            let read = fault_at(8 * element);
            fault_at(B + 8 * element);
            if k >= 1_000 {
                // The sibling, unless `ondemand` read a window (scattered elements
                // sometimes look sequential).
                let window = !read.is_empty() && read.iter().all(|&r| r.abs_diff(8 * element / 4096) <= 64);
                assert!(window || read == [(B + 8 * element) / 4096], "element {element}: {read:?}");
                exact += usize::from(!window);
            }
        }
        assert!(exact > 1_800, "{exact} of 2000 elements had their sibling read");
    }

    #[test]
    fn siblings_in_other_regions_are_named_by_page_id() {
        let p = Sibling::new();
        for k in 0..500 {
            let i = scattered(k, 50_000);
            fault(&p, 3, i);
            fault(&p, 7, i);
        }
        let read = fault(&p, 3, 12_345);
        assert_eq!(read.iter().map(|&id| split_page_id(id)).collect::<Vec<_>>(), vec![(7, 12_345)]);
    }

    #[test]
    fn no_sibling_is_read_past_the_end_of_the_faulting_region() {
        // Two arrays of 400 pages in a region of 1,000: page i and page i + 500.
        let p = Sibling::new();
        let fault_in = |page: u64| {
            let mut out = PageList::default();
            p.on_fault(
                &FaultInfo { offset: 0, region: 0, page, region_pages: 1_000, write: false, hit: false },
                &mut out,
            );
            out.as_slice().to_vec()
        };
        for k in 0..500 {
            let i = scattered(k, 400);
            fault_in(i);
            fault_in(i + 500);
        }
        assert_eq!(fault_in(123), vec![623], "learned");
        // The zone holds both arrays, so a fault in the second learns nothing else, but 700 + 500
        // lies past the region's last page (999).
        assert!(fault_in(700).is_empty());
    }

    #[test]
    fn a_random_gather_with_no_siblings_reads_nothing() {
        let p = Sibling::new();
        for k in 0..20_000 {
            assert!(fault(&p, 0, scattered(k, 1_000_003)).is_empty(), "fault {k} read something");
        }
    }

    #[test]
    fn a_pattern_that_ends_fades() {
        const LEN: u64 = 10_000;
        const APART: u64 = 16 * ZONE_PAGES;
        let p = Sibling::new();
        for k in 0..1_000 {
            let i = scattered(k, LEN);
            fault(&p, 0, i);
            fault(&p, 0, i + APART);
        }
        assert_eq!(fault(&p, 0, 77), vec![page_id(0, 77 + APART)]);
        // The program moves on to random faults elsewhere: a few aging rounds later the zones
        // of the old pattern predict nothing.
        for k in 0..(5 * AGE_FAULTS) {
            fault(&p, 1, scattered(k, 1_000_003));
        }
        assert!(fault(&p, 0, 5_000).is_empty());
    }

    #[test]
    fn sequential_misses_are_ondemands_and_teach_nothing() {
        let p = Sibling::new();
        assert!(fault(&p, 2, 1_000).is_empty());
        let window = fault(&p, 2, 1_001);
        assert_eq!(window, (1_002..1_006).map(|page| page_id(2, page)).collect::<Vec<_>>(), "ondemand's first window");
        for page in 1_002..1_400 {
            fault(&p, 2, page);
        }
        let t = p.table();
        assert!(t.zones.iter().all(|z| z.scores.iter().all(|&s| s == 0)), "no distance learned");
    }
}
