use super::with_ondemand::{OnTopOfOndemand, WithOndemand};
use crate::{page_id, FaultInfo, PageId, PageList};

/// `ondemand` plus a history of misses that it replays: a program that misses the same pages in
/// the same order again, without any address pattern, gets them read ahead the second time.
///
/// The case it is for: a loop over more pages than memory holds, in an order no address
/// arithmetic predicts. CPython's final garbage collections walk every container object in the
/// same list order several times, over a heap larger than the budget (k-means at 20%: 109k faults
/// on 17k pages after the clustering); an iterative solver walks the same edge list each
/// iteration. Every such miss is a critical read at queue depth one; replayed from the history,
/// the same reads go out many at a time on the prefetch queue.
///
/// - The history is a ring of the last [`HISTORY`] misses nobody predicted (page ids, so it
///   spans regions), with a hash index from a page to its newest position in the ring (verified
///   against the ring, so a collision only loses a position).
/// - A stream starts where [`CONFIRMATIONS`] + 1 unpredicted misses in a row each occurred
///   just after (within [`CONFIRM`] positions of) the one before them last time: a repeat of
///   the history is the evidence, so misses that repeat no order read nothing extra.
/// - A fault on a page a followed stream predicted, or not far past its end (a miss or a hit on
///   a page still on its way), moves the stream on and reads further along the history, the
///   window doubling from [`INITIAL_DEPTH`] to [`MAX_DEPTH`] pages. Such faults are
///   not added to the history: it already holds that sequence, and keeping the older copy lets
///   the next round follow it again.
/// - Everything else goes to `ondemand` first, so sequential streams keep their windows and
///   their misses do not crowd the history.
/// - It names pages by page id, of any region ([`Prefetcher::spans_regions`]): an interpreter's
///   heap is several regions, and its loops cross them.
pub type Temporal = WithOndemand<History>;

/// Misses the ring keeps: 4x the 17k-page loop of k-means' exit at 20%; 512 KiB.
pub const HISTORY: usize = 1 << 16;
const INDEX: usize = HISTORY * 2;
/// Unpredicted misses in a row, each right after the previous one's old position, that start a
/// stream.
const CONFIRMATIONS: u32 = 2;
/// Streams followed at once.
const STREAMS: usize = 8;
/// Pages read when a stream starts.
const INITIAL_DEPTH: u32 = 8;
/// Most pages a stream reads ahead. Deeper windows cut k-means' critical reads further (live:
/// 111-114k at 64 against 122-129k at 16 and 152-159k with `ondemand`) but read 1.6x as much for
/// PageRank at 20%, whose misses repeat only loosely (75 s with `ondemand`, 117 s, one run each);
/// replayed with the disk's queueing (`--read-ns 45000 --transfer-ns 11000`) 16 was the best
/// depth on both.
const MAX_DEPTH: u32 = 16;
/// How far along the history the previous unpredicted miss's successor may lie to confirm a
/// stream (a few pages of the old round may have been resident this time).
const CONFIRM: u32 = 4;
/// How far past the positions a stream already read a miss may lie and still continue it.
const SLACK: u32 = 16;
const EMPTY: PageId = PageId::MAX;

/// `temporal`'s ring of misses and the streams it follows along it.
#[derive(Debug)]
pub struct History {
    pages: Box<[PageId]>,
    /// Page hash → its newest position (valid only if the ring still holds the page there).
    index: Box<[u32]>,
    /// Positions written so far (wrapping); the newest entry is at `head - 1`.
    head: u32,
    streams: [Follow; STREAMS],
    /// Where the last unpredicted miss had occurred before, if it had.
    pending: Option<u32>,
    /// Unpredicted misses in a row so far that each followed the one before in the history.
    repeats: u32,
    clock: u64,
}

/// A stream being followed along the history.
#[derive(Debug, Clone, Copy, Default)]
struct Follow {
    /// Position of the last fault that continued it.
    last: u32,
    /// First position not read yet.
    next: u32,
    /// Window in positions; 0 = no stream.
    depth: u32,
    used: u64,
}

/// How many positions `a` lies after `b` in the wrapping position space.
fn after(a: u32, b: u32) -> u32 {
    a.wrapping_sub(b)
}

impl Default for Temporal {
    fn default() -> Self {
        Self::new()
    }
}

impl Temporal {
    /// A prefetcher with an empty history; its tables (1 MiB) are written here, not on the
    /// fault path.
    pub fn new() -> Self {
        Self::with_table(History::new())
    }

    /// The history on top of `stride` instead of `ondemand` (`stride-temporal`): strided
    /// streams keep their windows too, and their misses stay out of the history.
    pub fn on_strides() -> Self {
        Self::with_strides_and_table(History::new(), "stride-temporal")
    }
}

impl History {
    fn new() -> Self {
        Self {
            pages: vec![EMPTY; HISTORY].into_boxed_slice(),
            // Written (not zeroed pages the kernel maps later): no first touch on a fault path.
            index: vec![u32::MAX; INDEX].into_boxed_slice(),
            head: 0,
            streams: [Follow::default(); STREAMS],
            pending: None,
            repeats: 0,
            clock: 0,
        }
    }

    fn slot(id: PageId) -> usize {
        // Fibonacci hashing: consecutive pages spread over the index.
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - INDEX.trailing_zeros())) as usize
    }

    /// Whether the ring still holds position `pos`.
    fn holds(&self, pos: u32) -> bool {
        (1..=HISTORY as u32).contains(&after(self.head, pos))
    }

    /// The newest position of `id` in the ring.
    fn find(&self, id: PageId) -> Option<u32> {
        let pos = self.index[Self::slot(id)];
        (self.holds(pos) && self.pages[pos as usize % HISTORY] == id).then_some(pos)
    }

    fn append(&mut self, id: PageId) {
        self.pages[self.head as usize % HISTORY] = id;
        self.index[Self::slot(id)] = self.head;
        self.head = self.head.wrapping_add(1);
    }

    /// Push the pages at positions `from..to` into `out` as page ids; returns the first
    /// position not looked at (the list filled, or the ring no longer holds it).
    fn read(&self, from: u32, to: u32, out: &mut PageList) -> u32 {
        let mut pos = from;
        while after(to, pos) > 0 && after(to, pos) <= after(to, from) && self.holds(pos) {
            if !out.push(self.pages[pos as usize % HISTORY]) {
                break;
            }
            pos = pos.wrapping_add(1);
        }
        pos
    }

    /// Move a followed stream on for a fault at history position `pos`, if one predicted it.
    /// Returns whether one did.
    fn follow(&mut self, pos: u32, out: &mut PageList) -> bool {
        let continues =
            |s: &Follow| s.depth > 0 && after(pos, s.last) > 0 && after(pos, s.last) <= after(s.next, s.last) + SLACK;
        let Some(k) = self.streams.iter().position(continues) else { return false };
        let mut s = self.streams[k];
        s.last = pos;
        s.used = self.clock;
        s.depth = (s.depth * 2).min(MAX_DEPTH);
        let to = pos.wrapping_add(1 + s.depth);
        // Positions before `next` are on their way already.
        let from = if after(s.next, pos) > 0 && after(s.next, pos) <= s.depth { s.next } else { pos.wrapping_add(1) };
        if after(to, from) > 0 && after(to, from) <= s.depth {
            s.next = self.read(from, to, out);
        }
        self.streams[k] = s;
        true
    }

    /// An unpredicted miss of `id`, whose previous position was `before`: record it, and start
    /// a stream if it repeats the history right after the previous unpredicted misses.
    fn record(&mut self, id: PageId, before: Option<u32>, out: &mut PageList) {
        self.append(id);
        let confirmed = match (self.pending, before) {
            (Some(p), Some(q)) => (1..=CONFIRM).contains(&after(q, p)),
            _ => false,
        };
        self.pending = before;
        self.repeats = if confirmed { self.repeats + 1 } else { 0 };
        let Some(q) = before.filter(|_| self.repeats >= CONFIRMATIONS) else { return };
        self.repeats = 0;
        let k = (0..STREAMS).min_by_key(|&k| (self.streams[k].depth > 0, self.streams[k].used)).unwrap_or(0);
        let from = q.wrapping_add(1);
        let next = self.read(from, from.wrapping_add(INITIAL_DEPTH), out);
        self.streams[k] = Follow { last: q, next, depth: INITIAL_DEPTH, used: self.clock };
    }
}

impl OnTopOfOndemand for History {
    const NAME: &'static str = "temporal";

    /// One fault through the history.
    fn advance(&mut self, fault: &FaultInfo, out: &mut PageList, sequential: impl FnOnce(&mut PageList)) {
        self.clock += 1;
        let id = page_id(fault.region, fault.page);
        let before = self.find(id);
        if let Some(pos) = before {
            if self.follow(pos, out) {
                return;
            }
        }
        let mut window = PageList::default();
        sequential(&mut window);
        for &page in window.as_slice() {
            out.push(page_id(fault.region, page));
        }
        if fault.hit {
            // A page some window read: that window's business.
            return;
        }
        if !window.is_empty() {
            // A sequential stream has it: recorded, but no second guess on top.
            self.append(id);
            self.pending = None;
            self.repeats = 0;
            return;
        }
        self.record(id, before, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prefetcher;

    /// A fault on `page` of region 1; the pages it reads, all of region 1.
    fn miss(p: &impl Prefetcher, page: u64, hit: bool) -> Vec<u64> {
        let mut out = PageList::default();
        p.on_fault(&FaultInfo { offset: 0, region: 1, page, region_pages: 1 << 30, write: false, hit }, &mut out);
        out.as_slice()
            .iter()
            .map(|&id| {
                let (region, page) = crate::split_page_id(id);
                assert_eq!(region, 1, "a page of the one region used");
                page
            })
            .collect()
    }

    /// Pages with no address pattern: a multiplicative walk over a large region.
    fn scattered(n: u64) -> Vec<u64> {
        (1..=n).map(|i| (i * 7_919 * 104_729) % 1_000_003 * 5).collect()
    }

    #[test]
    fn a_repeated_miss_sequence_is_read_ahead_the_second_time() {
        let p = Temporal::new();
        let lap = scattered(1_000);
        for &page in &lap {
            assert!(miss(&p, page, false).is_empty(), "first lap: no history, no pattern, nothing read");
        }
        // Second lap: the first misses confirm the repeat, then the stream reads ahead.
        let mut read = std::collections::HashSet::new();
        let mut critical = 0;
        for &page in &lap {
            if !read.contains(&page) {
                critical += 1;
                read.extend(miss(&p, page, false));
            }
        }
        // One miss a window at most (this caller reports no hits), windows of up to MAX_DEPTH.
        assert!(critical <= 1_000 / MAX_DEPTH as usize + 10, "{critical} of 1000 pages missed the second lap");
        assert!(read.iter().all(|page| lap.contains(page)), "only pages of the lap are read");
    }

    #[test]
    fn misses_that_repeat_no_order_read_nothing_extra() {
        let p = Temporal::new();
        let pages = scattered(2_000);
        // The same pages three times over, each time in another scattered order (steps coprime
        // with the length: each round visits every page once).
        for (round, step) in [3u64 * 389, 7 * 389, 11 * 389].into_iter().enumerate() {
            for k in 0..pages.len() as u64 {
                let page = pages[((k * step) % pages.len() as u64) as usize];
                assert!(miss(&p, page, false).is_empty(), "round {round}: page {page} read something");
            }
        }
    }

    #[test]
    fn sequential_misses_are_left_to_ondemand_and_other_regions_are_named_by_page_id() {
        let p = Temporal::new();
        assert!(miss(&p, 1_000, false).is_empty());
        let window = miss(&p, 1_001, false);
        assert_eq!(window, (1_002..1_006).collect::<Vec<_>>(), "ondemand's first window, in region 1");
        // A loop alternating between regions 1 and 2.
        let at = |k: u64| (1 + k % 2, (k * 7_919) % 100_003 * 3);
        let fault = |k: u64| {
            let (region, page) = at(k);
            let mut out = PageList::default();
            p.on_fault(
                &FaultInfo { offset: 0, region: region as u32, page, region_pages: 1 << 30, write: false, hit: false },
                &mut out,
            );
            out.as_slice().to_vec()
        };
        (0..300).for_each(|k| {
            fault(k);
        });
        let read: Vec<u64> = (0..3).flat_map(fault).collect();
        assert_eq!(
            read,
            (3..11).map(|k| page_id(at(k).0 as u32, at(k).1)).collect::<Vec<_>>(),
            "both regions' pages, in loop order"
        );
    }

    #[test]
    fn on_strides_a_strided_stream_is_read_ahead_and_a_scattered_loop_replayed() {
        let (plain, strided) = (Temporal::new(), Temporal::on_strides());
        assert_eq!((plain.name(), strided.name()), ("temporal", "stride-temporal"));
        // Every third page: `ondemand` sees no sequence in it, `stride` does.
        let reads = |p: &Temporal| (0..40u64).map(|k| miss(p, 50_000 + 3 * k, false).len()).sum::<usize>();
        assert_eq!(reads(&plain), 0, "temporal alone reads nothing ahead of a strided stream");
        assert!(reads(&strided) > 40, "stride-temporal reads ahead along the stride");
        // The history is there on top: a scattered lap's second round is read ahead.
        let lap = scattered(1_000);
        lap.iter().for_each(|&page| {
            miss(&strided, page, false);
        });
        let second: usize = lap.iter().map(|&page| miss(&strided, page, false).len()).sum();
        assert!(second > 500, "the second lap read {second} pages ahead");
    }
}
