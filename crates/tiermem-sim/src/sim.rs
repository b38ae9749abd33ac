//! The replay loop: local memory of a fixed number of pages, the engine's policy objects, and a
//! device and time model.
//!
//! Per event:
//! - a report (monitor input) goes to the prefetcher's `on_report`, whose pages are read
//!   asynchronously;
//! - an access to a resident page is a hit: the replacement policy hears `on_access` (the trace
//!   is full access information) and the page's referenced bit is set, except on the first
//!   touch of a prefetched page: that is its first use, not a reuse (the engine never sees it).
//!   With [`HitInfo::Engine`] the policy learns only what the live engine does instead: no
//!   `on_access`, the referenced bit set by the first write to a clean page and by a monitor
//!   report on a resident page, nothing for reads.
//!   It is a prefetch hit, late if its read has not finished (the access waits), and the
//!   prefetcher hears `on_fault` with `hit`, as in the engine;
//! - an access to any other page is a fault: room is made (one victim at a time, from the
//!   replacement policy, dirty victims written back), the page is read and waited for, the
//!   policy hears `on_insert`, and the prefetcher's `on_fault` pages are read asynchronously.
//!   With [`FirstTouch::ZeroFill`] a page never written is a zero fill instead: no read, no
//!   prefetcher hears it, and no prefetcher may read such a page ahead;
//! - a discard (the program gave pages back) drops them from local memory without a
//!   write-back, and the replacement policy hears `on_remove`.
//!
//! Time: every access or report event costs `access_ns`, a compute event `cached_access_ns` per
//! access it stands for; a fault adds the device read (queued behind earlier
//! reads and writes on one device with a per-page transfer time) plus `fault_ns`; a prefetch
//! hit adds `hit_ns` plus any wait for a late page. Nothing is random: same input, same output.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;
use tiermem_policy::{FaultInfo, PageList, PolicyOptions, Prefetcher, Replacement, StreamPair};
use tiermem_sys::{Error, Result};

use crate::trace::{split_discard, split_event, Event, EventKind};

/// Device and CPU costs, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Latency {
    /// CPU time per access event (a page-level access, or a memory request of a byte-level
    /// trace).
    pub access_ns: f64,
    /// CPU time per byte-level access that stayed in the caches (compute events).
    pub cached_access_ns: f64,
    /// Software cost of a fault besides waiting for the page.
    pub fault_ns: f64,
    /// Time from issuing a page read to having the page (Fastswap over RDMA: about 6 µs).
    pub read_ns: f64,
    /// Time a page occupies the device (4 KiB at 56 Gb/s ≈ 600 ns); reads and write-backs queue.
    pub transfer_ns: f64,
    /// Cost of the first touch of a prefetched page (0: mapped eagerly, as the paper's stream
    /// prefetcher does; about 1000 for a minor fault).
    pub hit_ns: f64,
}

impl Default for Latency {
    fn default() -> Self {
        Self {
            access_ns: 100.0,
            cached_access_ns: 1.0,
            fault_ns: 2000.0,
            read_ns: 6000.0,
            transfer_ns: 600.0,
            hit_ns: 0.0,
        }
    }
}

/// Which events feed the prefetcher's monitor input (`on_report`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MonitorInput {
    /// None: prefetchers learn from faults only (what the engine sees without a monitor).
    None,
    /// The trace's report events (hot-page table output for byte-level traces).
    Reports,
    /// Every access to a page other than the previous access's page (full page-level
    /// information, for page-level traces without reports).
    Accesses,
}

/// What the replacement policy learns of an access to a resident page (a hit).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HitInfo {
    /// Every hit: the policy hears `on_access` and the page's referenced bit is set (except on
    /// the first touch of a prefetched page). What a trace gives, or a kernel with accessed bits.
    Full,
    /// What tiermem's engine sees: nothing of a read, and of writes only the first to a clean
    /// page (one that came in by a read fault or a prefetch), which sets the referenced bit, as
    /// the engine finds a clean page written in the page tables (async write protection) or
    /// takes its write-protect fault; and a monitor report on a resident page, which the engine
    /// also counts as a use. The engine also cleans pages ahead of eviction, after which a write
    /// is seen again: [`SimConfig::clean_ahead`] models that.
    Engine,
}

/// What a miss on a page that holds no data is: its first touch, or, in a paging system, any
/// touch after its page was dropped unwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FirstTouch {
    /// A miss like any other: read from the device, and any page may be read ahead. A cache
    /// simulator's compulsory miss (libCacheSim's model, and the brute-force references').
    Miss,
    /// What a paging system does: a page nobody has written has nothing on the device, so a
    /// miss on it (its first touch, or a touch after its unwritten page was dropped) is a
    /// zero-filled page (counted in `zero_fills`, costing `fault_ns` and no read, heard by no
    /// prefetcher, as the engine's zero-fill fault) and no prefetcher can read it ahead.
    /// `faults` then counts device reads only, and coverage the misses prefetching could have
    /// covered.
    ZeroFill,
}

/// One simulation's setup.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Local memory in pages.
    pub local_pages: usize,
    /// Prefetcher name.
    pub prefetch: String,
    /// Replacement name (`belady` needs the whole trace: see [`simulate`]).
    pub replace: String,
    /// Policy knobs.
    pub options: PolicyOptions,
    /// Costs.
    pub latency: Latency,
    /// Monitor input.
    pub monitor: MonitorInput,
    /// What the replacement policy learns of hits.
    pub hits: HitInfo,
    /// Share of local memory kept cleaned ahead of eviction, as the engine's reclaim thread
    /// does (0: off, victims are evicted one at a time as they are picked; the engine's default
    /// is 0.3, everything above its 70% watermark). Cleaned pages leave the policy, are written
    /// back if dirty and dropped oldest first; one used meanwhile goes back to the policy.
    /// `belady` ignores it.
    pub clean_ahead: f64,
    /// Most write-backs in flight while cleaning picks victims (0: no limit, every victim is
    /// cleaned the moment the list has room). The engine cleans only as far as its write-back
    /// queue has room (each batch takes at most half of what is free), so how far ahead it
    /// gets depends on the device's write rate; here a write is in flight for one device
    /// latency from its start, and when the list runs dry while cleaning is held back, an
    /// eviction takes the policy's next victim directly, written back on its way out if dirty.
    pub clean_queue: usize,
    /// What a miss on a page never written costs, and whether such a page can be read ahead.
    pub first_touch: FirstTouch,
}

/// What a simulation measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimResult {
    /// Prefetcher.
    pub prefetch: String,
    /// Replacement policy.
    pub replace: String,
    /// Local memory in pages.
    pub local_pages: usize,
    /// Access events (reads and writes).
    pub accesses: u64,
    /// Report events given to the prefetcher.
    pub reports: u64,
    /// Faults on pages not resident and not prefetched (demand reads; with
    /// [`FirstTouch::ZeroFill`] not the misses on pages never written, which are `zero_fills`).
    pub faults: u64,
    /// Misses on pages never written, served as zero-filled pages without a read
    /// ([`FirstTouch::ZeroFill`]).
    pub zero_fills: u64,
    /// Pages read ahead of demand.
    pub prefetch_issued: u64,
    /// First touches of prefetched pages.
    pub prefetch_hits: u64,
    /// Prefetch hits whose read had not finished yet.
    pub late_prefetches: u64,
    /// Prefetched pages evicted, or left at the end, without being touched.
    pub unused_prefetches: u64,
    /// Pages evicted.
    pub evictions: u64,
    /// Resident pages the program gave back (discard records): they left without an eviction.
    pub discarded: u64,
    /// Of them, pages dropped from the cleaned list (cleaned ahead, no write at eviction).
    pub cleaned_evictions: u64,
    /// Dirty pages written back on eviction.
    pub writebacks: u64,
    /// prefetch_hits / prefetch_issued.
    pub accuracy: f64,
    /// prefetch_hits / (prefetch_hits + faults) (zero fills are not misses).
    pub coverage: f64,
    /// Modeled run time.
    pub modeled_ns: f64,
}

// Page state bits.
const RESIDENT: u8 = 1;
const PREFETCHED: u8 = 2; // resident, read ahead, not touched yet
const REFERENCED: u8 = 4;
const DIRTY: u8 = 8;
const CLEANED: u8 = 16; // resident, on the cleaned list (out of the policy)
const WRITTEN: u8 = 32; // written, so the device holds its data (kept through evictions; ZeroFill only)

const CHUNK_SHIFT: u32 = 12;
const CHUNK: usize = 1 << CHUNK_SHIFT;

/// A multiply-shift hasher for page numbers (the default SipHash costs more than the lookup).
#[derive(Default)]
pub(crate) struct PageHasher(u64);

impl Hasher for PageHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub(crate) type FastMap<V> = HashMap<u64, V, BuildHasherDefault<PageHasher>>;

/// Chunk lookups remembered, direct-mapped by chunk number.
const RECENT: usize = 1024;

/// Page states in chunks of 4096 pages, found through a map behind a direct-mapped cache of
/// recent chunks (a footprint of up to 4 Mi pages never reaches the map after warm-up).
struct PageTable {
    index: FastMap<u32>,
    chunks: Vec<Box<[std::cell::Cell<u8>; CHUNK]>>,
    /// When each prefetched page not touched yet arrives, beside its state (a map of them cost
    /// a hash insert per prefetch and a removal per use). Made for a chunk when a page of it is
    /// first prefetched: eight times its states' size, and a run without prefetching needs none.
    arrivals: Vec<Option<Box<[f64; CHUNK]>>>,
    recent: Box<[(u64, u32); RECENT]>,
}

impl Default for PageTable {
    fn default() -> Self {
        // No chunk key is u64::MAX (pages have at most 40 bits), so the cache starts empty.
        Self {
            index: FastMap::default(),
            chunks: Vec::new(),
            arrivals: Vec::new(),
            recent: Box::new([(u64::MAX, 0); RECENT]),
        }
    }
}

impl PageTable {
    /// The chunk holding `page` (made if new).
    #[inline(always)]
    fn chunk(&mut self, page: u64) -> usize {
        let key = page >> CHUNK_SHIFT;
        let slot = (key as usize) & (RECENT - 1);
        let (cached_key, cached_chunk) = self.recent[slot];
        let chunk = if cached_key == key { cached_chunk } else { self.find_chunk(key, slot) };
        chunk as usize
    }

    #[inline(always)]
    fn cell(&mut self, page: u64) -> &std::cell::Cell<u8> {
        let chunk = self.chunk(page);
        &self.chunks[chunk][(page as usize) & (CHUNK - 1)]
    }

    /// The arrival time slot of `page` (meaningful while it is prefetched and untouched).
    #[inline(always)]
    fn arrival(&mut self, page: u64) -> &mut f64 {
        let chunk = self.chunk(page);
        let times = self.arrivals[chunk].get_or_insert_with(|| Box::new([0.0; CHUNK]));
        &mut times[(page as usize) & (CHUNK - 1)]
    }

    /// The chunk of `key` (made if new), remembered in `recent[slot]`: the slow path of
    /// [`PageTable::cell`], kept out of line so the replay loop stays small.
    #[cold]
    #[inline(never)]
    fn find_chunk(&mut self, key: u64, slot: usize) -> u32 {
        let next = self.chunks.len() as u32;
        let c = *self.index.entry(key).or_insert(next);
        if c == next {
            self.chunks.push(Box::new(std::array::from_fn(|_| std::cell::Cell::new(0))));
            self.arrivals.push(None);
        }
        self.recent[slot] = (key, c);
        c
    }

    /// Read-only lookup that never creates a chunk (for the referenced-bit callback).
    fn existing(&self, page: u64) -> Option<&std::cell::Cell<u8>> {
        let key = page >> CHUNK_SHIFT;
        let (cached_key, cached_chunk) = self.recent[(key as usize) & (RECENT - 1)];
        let c = if cached_key == key { cached_chunk } else { *self.index.get(&key)? };
        Some(&self.chunks[c as usize][(page as usize) & (CHUNK - 1)])
    }
}

impl std::fmt::Debug for PageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTable").field("chunks", &self.chunks.len()).finish()
    }
}

/// The policy objects, which the simulator owns outright: any pair through the traits'
/// exclusive (`_mut`) hooks, or `stream` × `stream-first` as one object whose shared training
/// table needs no lock.
#[derive(Debug)]
enum Policies {
    Pair { prefetcher: Box<dyn Prefetcher>, replacement: Box<dyn Replacement> },
    Stream(Box<StreamPair>),
}

impl Policies {
    fn names(&self) -> (&'static str, &'static str) {
        match self {
            Policies::Pair { prefetcher, replacement } => (prefetcher.name(), replacement.name()),
            Policies::Stream(_) => ("stream", "stream-first"),
        }
    }

    #[inline]
    fn on_fault(&mut self, fault: &FaultInfo, out: &mut PageList) {
        match self {
            Policies::Pair { prefetcher, .. } => prefetcher.on_fault_mut(fault, out),
            Policies::Stream(pair) => pair.on_fault(fault, out),
        }
    }

    #[inline]
    fn on_report(&mut self, page: u64, out: &mut PageList) {
        match self {
            Policies::Pair { prefetcher, .. } => prefetcher.on_report_mut(0, page, REGION_PAGES, out),
            Policies::Stream(pair) => pair.on_report(0, page, REGION_PAGES, out),
        }
    }

    #[inline]
    fn on_remove(&mut self, page: u64) {
        match self {
            Policies::Pair { replacement, .. } => replacement.on_remove_mut(page),
            Policies::Stream(pair) => pair.on_remove(page),
        }
    }

    #[inline]
    fn on_insert(&mut self, page: u64) {
        match self {
            Policies::Pair { replacement, .. } => replacement.on_insert_mut(page),
            Policies::Stream(pair) => pair.on_insert(page),
        }
    }

    #[inline]
    fn on_access(&mut self, page: u64) {
        match self {
            Policies::Pair { replacement, .. } => replacement.on_access_mut(page),
            Policies::Stream(pair) => pair.on_access(page),
        }
    }

    #[inline]
    fn pick_victims(&mut self, max: usize, is_referenced: &dyn Fn(u64) -> bool, out: &mut PageList) {
        match self {
            Policies::Pair { replacement, .. } => replacement.pick_victims_mut(max, is_referenced, out),
            Policies::Stream(pair) => pair.pick_victims(max, is_referenced, out),
        }
    }
}

/// A running simulation; feed it events with [`Simulator::step`].
#[derive(Debug)]
pub struct Simulator {
    config: SimConfig,
    policies: Policies,
    pages: PageTable,
    /// Prefetched pages not touched yet (their arrival times are in `pages`).
    untouched_prefetches: u64,
    resident: usize,
    now: f64,
    device_free: f64,
    last_page: u64,
    wanted: PageList,
    victims: PageList,
    result: SimResult,
    /// Skip policy calls for an immediate repeat of a resident page (fifo, clock, lru).
    skip_repeats: bool,
    /// The page the replacement policy last heard `on_access` for, if nothing came after.
    policy_mru: u64,
    /// Pages cleaned ahead of eviction, oldest first, and how many to keep (0: off).
    cleaned: std::collections::VecDeque<u64>,
    clean_target: usize,
    /// When the write-backs still in flight complete, oldest first (kept only with a
    /// [`SimConfig::clean_queue`] limit).
    writes_in_flight: std::collections::VecDeque<f64>,
    /// WRITTEN with [`FirstTouch::ZeroFill`] (set by every write), else 0.
    written_bit: u8,
}

/// Refuse settings no simulation can run with.
fn check(config: &SimConfig) -> Result<()> {
    if config.local_pages == 0 {
        return Err(Error::invalid("local memory must be at least one page"));
    }
    if !(0.0..1.0).contains(&config.clean_ahead) {
        return Err(Error::invalid(format!("clean-ahead share {} must be at least 0 and below 1", config.clean_ahead)));
    }
    config.options.stream.validate()
}

/// Pages a prefetcher may name (page ids carry no region in the simulator).
const REGION_PAGES: u64 = 1 << 40;

impl Simulator {
    /// A simulator with policies built by name (`belady` is refused: use [`simulate`]).
    pub fn new(config: SimConfig) -> Result<Self> {
        check(&config)?;
        // Synthetic and page-list traces number pages from 0: index them directly up to a
        // footprint twice the local memory (pages beyond are hashed, as always).
        let mut options = config.options;
        if options.dense_pages == 0 {
            options.dense_pages = (config.local_pages as u64).saturating_mul(2).saturating_add(64).min(1 << 26);
        }
        if config.prefetch == "stream" && config.replace == "stream-first" {
            let pair = StreamPair::new(config.local_pages, &options);
            return Ok(Self::build(config, Policies::Stream(Box::new(pair))));
        }
        let pair = tiermem_policy::build_policies(&config.prefetch, &config.replace, config.local_pages, &options)?;
        Ok(Self::with_policies(config, pair.prefetcher, pair.replacement))
    }

    /// A simulator with given policy objects.
    pub fn with_policies(
        config: SimConfig,
        prefetcher: Box<dyn Prefetcher>,
        replacement: Box<dyn Replacement>,
    ) -> Self {
        Self::build(config, Policies::Pair { prefetcher, replacement })
    }

    fn build(config: SimConfig, policies: Policies) -> Self {
        let (prefetch, replace) = policies.names();
        // Exact only for policies whose state is an order of pages: stream-first also counts
        // uses (its stream bonus and its table's LRU clock), and Belady needs every access.
        let skip_repeats = matches!(replace, "fifo" | "clock" | "lru");
        let result = SimResult {
            prefetch: prefetch.to_string(),
            replace: replace.to_string(),
            local_pages: config.local_pages,
            ..SimResult::default()
        };
        // Belady evicts by the future: cleaning ahead would only get in its way.
        let clean_target =
            if replace == "belady" { 0 } else { (config.local_pages as f64 * config.clean_ahead).ceil() as usize };
        Self {
            policies,
            pages: PageTable::default(),
            untouched_prefetches: 0,
            resident: 0,
            now: 0.0,
            device_free: 0.0,
            last_page: u64::MAX,
            wanted: PageList::default(),
            victims: PageList::default(),
            result,
            skip_repeats,
            policy_mru: u64::MAX,
            cleaned: std::collections::VecDeque::new(),
            clean_target,
            writes_in_flight: std::collections::VecDeque::new(),
            written_bit: if config.first_touch == FirstTouch::ZeroFill { WRITTEN } else { 0 },
            config,
        }
    }

    /// Start a read on the device at the current time; returns when the page is there.
    #[inline]
    fn device_read(&mut self) -> f64 {
        let start = self.device_free.max(self.now);
        self.device_free = start + self.config.latency.transfer_ns;
        start + self.config.latency.read_ns.max(self.config.latency.transfer_ns)
    }

    /// Evict until there is room for one more page.
    fn make_room(&mut self) {
        if self.clean_target > 0 {
            self.make_room_from_cleaned();
            return;
        }
        while self.resident >= self.config.local_pages {
            if !self.evict_from_policy() {
                return;
            }
        }
    }

    /// Evict the policy's next victim (written back if dirty); false if it has none.
    fn evict_from_policy(&mut self) -> bool {
        if !self.pick_victim() {
            return false;
        }
        for k in 0..self.victims.len() {
            let page = self.victims.as_slice()[k];
            let cell = self.pages.cell(page);
            let s = cell.get();
            if s & RESIDENT != 0 {
                cell.set(s & WRITTEN);
                self.evicted(s);
            }
        }
        true
    }

    /// Account for a page in state `s` leaving local memory (its state already cleared).
    fn evicted(&mut self, s: u8) {
        self.resident -= 1;
        self.result.evictions += 1;
        if s & PREFETCHED != 0 {
            self.result.unused_prefetches += 1;
            self.untouched_prefetches -= 1;
        }
        if s & DIRTY != 0 {
            self.write_back();
        }
    }

    /// Evict the way the engine does: victims picked by the policy are first cleaned (written
    /// back if dirty, still resident, out of the policy) onto a list of `clean_target` pages, and
    /// evictions drop the oldest cleaned page; one used since it was cleaned (its referenced bit,
    /// which with [`HitInfo::Engine`] only a write or a report sets) goes back to the policy.
    fn make_room_from_cleaned(&mut self) {
        while self.resident >= self.config.local_pages {
            let held_back = self.clean_ahead();
            let Some(page) = self.cleaned.pop_front() else {
                // Nothing cleaned because the write-back queue is full: evict directly, as the
                // engine's eviction does then. (Otherwise the policy has nothing to give.)
                if held_back && self.evict_from_policy() {
                    continue;
                }
                return;
            };
            let cell = self.pages.cell(page);
            let s = cell.get();
            if s & (RESIDENT | CLEANED) != (RESIDENT | CLEANED) {
                continue;
            }
            if s & REFERENCED != 0 {
                cell.set(s & !(CLEANED | REFERENCED));
                self.policies.on_insert(page);
                self.policy_mru = u64::MAX;
                continue;
            }
            cell.set(s & WRITTEN);
            self.result.cleaned_evictions += 1;
            self.evicted(s);
        }
    }

    /// The policy's next victim, into `victims`; false if it has none. A second-chance pass may
    /// clear every referenced bit without choosing, and the next pass then chooses: twice
    /// empty, the policy tracks nothing resident.
    fn pick_victim(&mut self) -> bool {
        for _ in 0..2 {
            self.victims.clear();
            let pages = &self.pages;
            let is_referenced = |id: u64| {
                pages.existing(id).is_some_and(|c| {
                    let s = c.get();
                    c.set(s & !REFERENCED);
                    s & REFERENCED != 0
                })
            };
            self.policies.pick_victims(1, &is_referenced, &mut self.victims);
            if !self.victims.is_empty() {
                return true;
            }
        }
        false
    }

    /// Fill the cleaned list up to its target from the policy's victims, while the write-back
    /// queue has room for cleaning. True if that room ran out first.
    fn clean_ahead(&mut self) -> bool {
        while self.cleaned.len() < self.clean_target {
            if self.cleaning_held_back() {
                return true;
            }
            if !self.pick_victim() {
                return false;
            }
            for k in 0..self.victims.len() {
                let page = self.victims.as_slice()[k];
                let cell = self.pages.cell(page);
                let s = cell.get();
                if s & RESIDENT == 0 || s & CLEANED != 0 {
                    continue;
                }
                // The referenced bit stays, as in the engine: a policy that picked without
                // asking (fifo) leaves a used page to be sent back at the list's front.
                cell.set((s & !DIRTY) | CLEANED);
                self.cleaned.push_back(page);
                if s & DIRTY != 0 {
                    self.write_back();
                }
            }
        }
        false
    }

    /// Whether [`SimConfig::clean_queue`] write-backs are still in flight now (only writes
    /// count: a clean victim costs the queue nothing).
    fn cleaning_held_back(&mut self) -> bool {
        if self.config.clean_queue == 0 {
            return false;
        }
        while self.writes_in_flight.front().is_some_and(|&done| done <= self.now) {
            self.writes_in_flight.pop_front();
        }
        self.writes_in_flight.len() >= self.config.clean_queue
    }

    /// A page written back: the device is busy for its transfer, and the write is in flight
    /// until a device latency after it started.
    fn write_back(&mut self) {
        self.result.writebacks += 1;
        let start = self.device_free.max(self.now);
        self.device_free = start + self.config.latency.transfer_ns;
        if self.config.clean_queue > 0 {
            let latency = self.config.latency.read_ns.max(self.config.latency.transfer_ns);
            self.writes_in_flight.push_back(start + latency);
        }
    }

    fn issue_wanted(&mut self) {
        self.policy_mru = u64::MAX;
        for k in 0..self.wanted.len() {
            let page = self.wanted.as_slice()[k];
            // Outside the trace's one region (a prefetcher's guess in another region, as
            // `sibling` makes of a distance that runs below page 0): the engine drops such ids,
            // there being no such region.
            if page >= REGION_PAGES {
                continue;
            }
            let s = self.pages.cell(page).get();
            // With ZeroFill a page never written has nothing on the device to read.
            if s & RESIDENT != 0 || s & WRITTEN < self.written_bit {
                continue;
            }
            self.make_room();
            let arrival = self.device_read();
            self.pages.cell(page).set(RESIDENT | PREFETCHED | (s & WRITTEN));
            *self.pages.arrival(page) = arrival;
            self.untouched_prefetches += 1;
            self.resident += 1;
            self.result.prefetch_issued += 1;
            self.policies.on_insert(page);
        }
        self.wanted.clear();
    }

    #[inline]
    fn report(&mut self, page: u64) {
        self.result.reports += 1;
        self.policy_mru = u64::MAX;
        if self.config.hits == HitInfo::Engine {
            // The engine marks a reported page that is resident as used (its monitor is one of
            // the few ways it learns of accesses that do not fault).
            if let Some(cell) = self.pages.existing(page) {
                if cell.get() & RESIDENT != 0 {
                    cell.set(cell.get() | REFERENCED);
                }
            }
        }
        self.policies.on_report(page, &mut self.wanted);
        if !self.wanted.is_empty() {
            self.issue_wanted();
        }
    }

    /// The program gave `pages` pages from `first` back (a discard record): each leaves local
    /// memory without a write-back, and holds nothing afterwards (its next touch is a zero fill
    /// under [`FirstTouch::ZeroFill`], a miss as any under `Miss`).
    fn discard(&mut self, first: u64, pages: u64) {
        let end = first.saturating_add(pages);
        let mut page = first;
        while page < end {
            let Some(cell) = self.pages.existing(page) else {
                // No page of this chunk was ever used: skip the chunk.
                page = ((page >> CHUNK_SHIFT) + 1) << CHUNK_SHIFT;
                continue;
            };
            let s = cell.get();
            cell.set(0);
            if s & RESIDENT != 0 {
                self.resident -= 1;
                self.result.discarded += 1;
                if s & PREFETCHED != 0 {
                    self.untouched_prefetches -= 1;
                    self.result.unused_prefetches += 1;
                }
                // A page on the cleaned list is out of the policy already; the list skips it.
                if s & CLEANED == 0 {
                    self.policies.on_remove(page);
                }
            }
            page += 1;
        }
        self.last_page = u64::MAX;
        self.policy_mru = u64::MAX;
    }

    /// Replay one event.
    #[inline]
    pub fn step(&mut self, e: Event) {
        let (page, kind) = split_event(e);
        if kind == EventKind::Compute {
            match split_discard(page) {
                Some((first, pages)) => self.discard(first, pages),
                None => self.now += self.config.latency.cached_access_ns * page as f64,
            }
            return;
        }
        self.now += self.config.latency.access_ns;
        if kind == EventKind::Report {
            if self.config.monitor == MonitorInput::Reports {
                self.report(page);
            }
            return;
        }
        if self.config.monitor == MonitorInput::Accesses && page != self.last_page {
            self.report(page);
        }
        self.last_page = page;
        self.result.accesses += 1;
        let write = kind == EventKind::Write;
        // A write also marks the page as holding data from now on (with ZeroFill).
        let dirty = if write { DIRTY | self.written_bit } else { 0 };
        let cell = self.pages.cell(page);
        let s = cell.get();
        if page == self.policy_mru
            && self.skip_repeats
            && s & (RESIDENT | PREFETCHED | REFERENCED) == (RESIDENT | REFERENCED)
        {
            // The page the policy heard of last, used again with nothing in between (no insert,
            // no report that could change a stream-first classification): it is already the
            // most recent for every online policy, and referenced, so telling it again changes
            // nothing. Results are identical; only the calls are saved.
            cell.set(s | dirty);
            return;
        }
        if s & RESIDENT != 0 {
            if self.config.hits == HitInfo::Full {
                // The first touch of a prefetched page is its first use, as a fault is for a page
                // read on demand, not a reuse: the engine maps prefetched pages before the program
                // touches them and never sees that touch, so the referenced bit stays clear there too.
                // A cleaned page is out of the policy: any touch is what sends it back.
                let reused = if s & PREFETCHED != 0 && s & CLEANED == 0 { 0 } else { REFERENCED };
                cell.set((s & !PREFETCHED) | reused | dirty);
                // A cleaned page is out of the policy until it is rescued.
                if s & CLEANED == 0 {
                    self.policies.on_access(page);
                    self.policy_mru = page;
                }
            } else {
                let first_write = if write && s & DIRTY == 0 { REFERENCED } else { 0 };
                cell.set((s & !PREFETCHED) | first_write | dirty);
            }
            if s & PREFETCHED != 0 {
                self.result.prefetch_hits += 1;
                self.untouched_prefetches -= 1;
                let arrival = *self.pages.arrival(page);
                if arrival > self.now {
                    self.result.late_prefetches += 1;
                    self.now = arrival;
                }
                self.now += self.config.latency.hit_ns;
                let info = FaultInfo { offset: 0, region: 0, page, region_pages: REGION_PAGES, write, hit: true };
                self.policies.on_fault(&info, &mut self.wanted);
                if !self.wanted.is_empty() {
                    self.issue_wanted();
                }
            }
            return;
        }
        // Under ZeroFill a page never written holds nothing on the device: a zero-filled page,
        // no read (the engine drops such a page unwritten, so this holds after its eviction too).
        let zero_fill = s & WRITTEN < self.written_bit;
        self.make_room();
        if zero_fill {
            self.result.zero_fills += 1;
            self.now += self.config.latency.fault_ns;
        } else {
            self.result.faults += 1;
            self.now = self.device_read() + self.config.latency.fault_ns;
        }
        self.pages.cell(page).set(RESIDENT | (s & WRITTEN) | dirty);
        self.resident += 1;
        self.policies.on_insert(page);
        self.policy_mru = u64::MAX;
        if zero_fill {
            // The engine's zero-fill fault issues no prefetch: no prefetcher hears it.
            return;
        }
        let info = FaultInfo { offset: 0, region: 0, page, region_pages: REGION_PAGES, write, hit: false };
        self.policies.on_fault(&info, &mut self.wanted);
        if !self.wanted.is_empty() {
            self.issue_wanted();
        }
    }

    /// Finish: count prefetched pages never touched and compute the ratios.
    pub fn finish(mut self) -> SimResult {
        self.result.unused_prefetches += self.untouched_prefetches;
        let r = &mut self.result;
        r.accuracy = ratio(r.prefetch_hits, r.prefetch_issued);
        r.coverage = ratio(r.prefetch_hits, r.prefetch_hits + r.faults);
        r.modeled_ns = self.now;
        self.result
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Distinct pages accessed (reports excluded).
pub fn footprint(events: &[Event]) -> usize {
    let mut seen: std::collections::HashSet<u64, BuildHasherDefault<PageHasher>> = Default::default();
    for &e in events {
        let (page, kind) = split_event(e);
        if kind == EventKind::Read || kind == EventKind::Write {
            seen.insert(page);
        }
    }
    seen.len()
}

/// Replay a whole trace. `belady` is built from the trace here (it needs the future), and runs
/// only without prefetching, hearing of every access ([`SimConfig::hits`] is for the online
/// policies). `progress` hears the number of events done now and then.
pub fn simulate(events: &[Event], config: &SimConfig, progress: &mut dyn FnMut(u64)) -> Result<SimResult> {
    if events.is_empty() {
        return Err(Error::invalid("the trace has no accesses"));
    }
    let mut sim = if config.replace == "belady" {
        if config.prefetch != "none" {
            return Err(Error::invalid(format!(
                "belady is the optimum without prefetching; run it with --prefetch none, not '{}'",
                config.prefetch
            )));
        }
        check(config)?;
        let pages: Vec<u64> = events
            .iter()
            .map(|&e| split_event(e))
            .filter(|(_, k)| matches!(k, EventKind::Read | EventKind::Write))
            .map(|(p, _)| p)
            .collect();
        let belady = tiermem_policy::replace::Belady::from_trace(&pages);
        // The optimum knows every access: it hears each one in trace order, whatever the online
        // policies are told of hits (with `HitInfo::Engine` it heard none and aborted).
        let config = SimConfig { monitor: MonitorInput::None, hits: HitInfo::Full, ..config.clone() };
        Simulator::with_policies(config, Box::new(tiermem_policy::prefetch::NoPrefetch), Box::new(belady))
    } else {
        Simulator::new(config.clone())?
    };
    for (i, chunk) in events.chunks(1 << 20).enumerate() {
        for &e in chunk {
            sim.step(e);
        }
        progress(((i << 20) + chunk.len()) as u64);
    }
    Ok(sim.finish())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::trace::event;

    fn run(events: &[Event], prefetch: &str, replace: &str, skip_repeats: bool) -> SimResult {
        let config = SimConfig {
            local_pages: 8,
            prefetch: prefetch.into(),
            replace: replace.into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor: MonitorInput::Reports,
            hits: HitInfo::Full,
            clean_ahead: 0.0,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let mut sim = Simulator::new(config).unwrap();
        // The default decides per policy; `false` forces every call through.
        sim.skip_repeats &= skip_repeats;
        for &e in events {
            sim.step(e);
        }
        sim.finish()
    }

    #[test]
    fn belady_hears_every_access_whatever_the_online_policies_learn_of_hits() {
        // Found by the `simulate` fuzz target: with `--hits engine` the simulator told Belady of
        // no hit, and it aborted the run ("driven out of trace order").
        let events: Vec<Event> = (0..400u64).map(|i| event(i * 7 % 23, EventKind::Read)).collect();
        let config = |hits| SimConfig {
            local_pages: 8,
            prefetch: "none".into(),
            replace: "belady".into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor: MonitorInput::Reports,
            hits,
            clean_ahead: 0.0,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let full = simulate(&events, &config(HitInfo::Full), &mut |_| {}).unwrap();
        let engine = simulate(&events, &config(HitInfo::Engine), &mut |_| {}).unwrap();
        assert_eq!((engine.faults, engine.accesses), (full.faults, full.accesses));
        assert!(full.faults > 23 && full.faults < 400, "{} faults", full.faults);
        let bad = SimConfig { clean_ahead: 1.5, ..config(HitInfo::Full) };
        assert!(simulate(&events, &bad, &mut |_| {}).unwrap_err().to_string().contains("clean-ahead"));
    }

    #[test]
    fn the_first_touch_of_a_prefetched_page_is_a_use_and_the_second_a_reuse() {
        let config = SimConfig {
            local_pages: 16,
            prefetch: "fastswap".into(),
            replace: "clock".into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor: MonitorInput::None,
            hits: HitInfo::Full,
            clean_ahead: 0.0,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let mut sim = Simulator::new(config).unwrap();
        let referenced = |sim: &mut Simulator, page| sim.pages.cell(page).get() & REFERENCED != 0;
        sim.step(event(100, EventKind::Read)); // a fault; 101..=107 read ahead
        assert!(!referenced(&mut sim, 100), "a fault is the page's first use");
        sim.step(event(101, EventKind::Read));
        assert_eq!(sim.result.prefetch_hits, 1);
        // As in the engine, which maps prefetched pages before the program touches them.
        assert!(!referenced(&mut sim, 101), "the first touch of a prefetched page is its first use");
        sim.step(event(102, EventKind::Read));
        sim.step(event(101, EventKind::Read));
        assert!(referenced(&mut sim, 101), "touched again while resident: reused");
        sim.step(event(100, EventKind::Read));
        assert!(referenced(&mut sim, 100));
        assert_eq!(sim.result.faults, 1);
    }

    /// With the engine's view of hits, a read teaches the policy nothing and a write counts
    /// once, as the first write to a clean page; the policy never hears `on_access`.
    #[test]
    fn the_engine_view_sees_only_the_first_write_to_a_clean_page() {
        let config = |hits| SimConfig {
            local_pages: 16,
            prefetch: "fastswap".into(),
            replace: "clock".into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor: MonitorInput::None,
            hits,
            clean_ahead: 0.0,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let mut sim = Simulator::new(config(HitInfo::Engine)).unwrap();
        let referenced = |sim: &mut Simulator, page| sim.pages.cell(page).get() & REFERENCED != 0;
        sim.step(event(100, EventKind::Read)); // a fault; 101..=107 read ahead
        sim.step(event(100, EventKind::Read));
        assert!(!referenced(&mut sim, 100), "a read hit is not seen");
        sim.step(event(100, EventKind::Write));
        assert!(referenced(&mut sim, 100), "the first write to a clean page is");
        let cell = sim.pages.cell(100);
        cell.set(cell.get() & !REFERENCED);
        sim.step(event(100, EventKind::Write));
        assert!(!referenced(&mut sim, 100), "later writes to the dirty page are not");
        sim.step(event(101, EventKind::Write));
        assert!(referenced(&mut sim, 101), "a prefetched page is clean: its first write is seen");
        sim.step(event(200, EventKind::Write)); // a write fault: the page comes in dirty
        sim.step(event(200, EventKind::Write));
        assert!(!referenced(&mut sim, 200), "a page that came in by a write is dirty from the start");
        // A monitor report on a resident page is a use the engine sees.
        let mut sim = Simulator::new(SimConfig { monitor: MonitorInput::Reports, ..config(HitInfo::Engine) }).unwrap();
        sim.step(event(300, EventKind::Read));
        sim.step(event(300, EventKind::Read));
        assert!(!referenced(&mut sim, 300));
        sim.step(event(300, EventKind::Report));
        assert!(referenced(&mut sim, 300), "reported while resident");

        // `lru` ranks by `on_access`: with every hit it keeps the page used between faults, with
        // the engine's view it only has insertion order and the referenced bits (none here).
        let loop_with_a_hot_page: Vec<Event> =
            (0..200u64).flat_map(|i| [event(1000, EventKind::Read), event(i % 24, EventKind::Read)]).collect();
        let faults = |hits| {
            let mut sim =
                Simulator::new(SimConfig { prefetch: "none".into(), replace: "lru".into(), ..config(hits) }).unwrap();
            loop_with_a_hot_page.iter().for_each(|&e| sim.step(e));
            sim.finish().faults
        };
        let (full, engine) = (faults(HitInfo::Full), faults(HitInfo::Engine));
        assert!(engine > full, "the hot page is evicted without its hits: {engine} against {full}");
    }

    /// With pages cleaned ahead, a victim is written back when it is cleaned, stays resident on
    /// the cleaned list, and is dropped later unless used meanwhile, which with the engine's view
    /// means written: then it goes back to the policy.
    #[test]
    fn cleaned_pages_are_dropped_oldest_first_unless_written_meanwhile() {
        let config = SimConfig {
            local_pages: 10,
            prefetch: "none".into(),
            replace: "clock".into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor: MonitorInput::None,
            hits: HitInfo::Engine,
            clean_ahead: 0.3,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let mut sim = Simulator::new(config.clone()).unwrap();
        for page in 0..10 {
            sim.step(event(page, EventKind::Write));
        }
        assert_eq!(sim.result.writebacks, 0);
        // The 11th page: 0, 1, 2 are cleaned (three write-backs) and 0 is dropped.
        sim.step(event(10, EventKind::Read));
        assert_eq!((sim.result.writebacks, sim.result.evictions), (3, 1));
        let state = |sim: &mut Simulator, page| sim.pages.cell(page).get();
        assert_eq!(state(&mut sim, 0), 0, "dropped");
        assert_eq!(state(&mut sim, 1) & (RESIDENT | CLEANED | DIRTY), RESIDENT | CLEANED, "cleaned, still resident");
        sim.step(event(2, EventKind::Read));
        sim.step(event(1, EventKind::Write)); // seen: the first write since it was cleaned
        sim.step(event(11, EventKind::Read));
        // 3 is cleaned to keep three, 1 goes back to the policy, 4 is cleaned in its place, and
        // 2 (only read) is dropped, without a write.
        assert_eq!(state(&mut sim, 2), 0, "a read is not seen: dropped");
        assert_eq!(state(&mut sim, 1) & (RESIDENT | CLEANED | DIRTY), RESIDENT | DIRTY, "rescued by its write");
        assert_eq!((sim.result.writebacks, sim.result.evictions), (5, 2));
        let faults = sim.result.faults;
        sim.step(event(1, EventKind::Read));
        assert_eq!(sim.result.faults, faults, "still resident");

        // With every hit known, a read of a cleaned page sends it back too, a prefetched one's
        // first touch included (a prefetched page on the list is set up by hand here).
        let mut sim = Simulator::new(SimConfig { hits: HitInfo::Full, ..config }).unwrap();
        for page in 0..10 {
            sim.step(event(page, EventKind::Write));
        }
        sim.step(event(10, EventKind::Read)); // 0, 1, 2 cleaned, 0 dropped
        let cell = sim.pages.cell(2);
        cell.set(cell.get() | PREFETCHED);
        sim.untouched_prefetches += 1;
        sim.step(event(2, EventKind::Read));
        assert_eq!(sim.result.prefetch_hits, 1);
        sim.step(event(11, EventKind::Read)); // 3 cleaned, 1 dropped
        sim.step(event(12, EventKind::Read)); // 4 cleaned, 2 sent back, 3 dropped
        assert_eq!(state(&mut sim, 1), 0, "untouched: dropped");
        assert_eq!(state(&mut sim, 2) & (RESIDENT | CLEANED), RESIDENT, "touched while cleaned: sent back");
        assert_eq!(state(&mut sim, 3), 0);
    }

    /// With a write-back queue limit, cleaning stops while that many write-backs are in flight,
    /// and evictions that find nothing cleaned then write their own victims back; without it,
    /// every victim is cleaned the moment the list has room.
    #[test]
    fn cleaning_waits_for_room_in_the_write_back_queue() {
        let config = |clean_queue| SimConfig {
            local_pages: 80,
            // The next seven pages after each fault: evictions for them come back to back,
            // with no fault in between to wait for the writes.
            prefetch: "fastswap".into(),
            replace: "fifo".into(),
            options: PolicyOptions::default(),
            latency: Latency { read_ns: 1e6, transfer_ns: 1000.0, ..Latency::default() },
            monitor: MonitorInput::None,
            // (With every hit known, a prefetched page's first touch is not a reuse: nothing
            // below is referenced, so no cleaned page is sent back.)
            hits: HitInfo::Full,
            clean_ahead: 0.3,
            clean_queue,
            first_touch: FirstTouch::Miss,
        };
        let run = |clean_queue| {
            let mut sim = Simulator::new(config(clean_queue)).unwrap();
            // Ten faults, each with its seven prefetched neighbours, all written: 80 dirty pages
            // fill memory.
            for group in (0..10).map(|g| g * 100) {
                (group..group + 8).for_each(|page| sim.step(event(page, EventKind::Write)));
            }
            assert_eq!((sim.result.evictions, sim.result.writebacks, sim.result.faults), (0, 0, 10));
            // A fault far from them and its seven prefetches need eight evictions.
            sim.step(event(5000, EventKind::Read));
            let evicted: Vec<u64> = (0..10)
                .flat_map(|g| g * 100..g * 100 + 8)
                .filter(|&p| sim.pages.cell(p).get() & RESIDENT == 0)
                .collect();
            (sim.result.clone(), evicted)
        };
        let (free, free_evicted) = run(0);
        // Unlimited: the oldest 24 are cleaned (written) ahead; each of the eight evictions drops
        // the oldest cleaned page, and another is cleaned in its place from the second on.
        assert_eq!((free.evictions, free.cleaned_evictions), (8, 8));
        assert_eq!(free.writebacks, 24 + 7, "{free:?}");
        let (held, held_evicted) = run(1);
        // One write-back in flight at most: the fault's eviction cleans one victim, written by
        // the time its own read returns, and the first prefetch's cleans one more; the other
        // six find the queue busy and the list empty, and write their own victims on the way
        // out.
        assert_eq!((held.evictions, held.cleaned_evictions), (8, 2), "{held:?}");
        assert_eq!(held.writebacks, 8, "each victim written once, nothing cleaned ahead of need");
        // Either way the same pages leave, oldest first (fifo).
        assert_eq!(free_evicted, held_evicted);
        assert_eq!(held_evicted, (0..8).collect::<Vec<u64>>());
    }

    /// Forwards only the `&self` hooks, so the simulator's `_mut` calls take the trait's default
    /// path: every call locks, exactly as in the engine. Built with the default options, these
    /// policies also hash every page id, where [`Simulator::new`] indexes small ids directly.
    #[derive(Debug)]
    struct ViaShared<T: ?Sized>(Box<T>);

    impl Prefetcher for ViaShared<dyn Prefetcher> {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
            self.0.on_fault(fault, out);
        }
        fn on_report(&self, region: u32, page: u64, region_pages: u64, out: &mut PageList) {
            self.0.on_report(region, page, region_pages, out);
        }
    }

    impl Replacement for ViaShared<dyn Replacement> {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn on_insert(&self, page: u64) {
            self.0.on_insert(page);
        }
        fn on_access(&self, page: u64) {
            self.0.on_access(page);
        }
        fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(u64) -> bool, out: &mut PageList) {
            self.0.pick_victims(max, is_referenced, out);
        }
    }

    fn run_paths(events: &[Event], prefetch: &str, replace: &str, monitor: MonitorInput, exclusive: bool) -> SimResult {
        let config = SimConfig {
            local_pages: 16,
            prefetch: prefetch.into(),
            replace: replace.into(),
            options: PolicyOptions::default(),
            latency: Latency::default(),
            monitor,
            hits: HitInfo::Full,
            clean_ahead: 0.0,
            clean_queue: 0,
            first_touch: FirstTouch::Miss,
        };
        let mut sim = if exclusive {
            Simulator::new(config).unwrap()
        } else {
            let pair = tiermem_policy::build_policies(prefetch, replace, config.local_pages, &config.options).unwrap();
            Simulator::with_policies(
                config,
                Box::new(ViaShared(pair.prefetcher)),
                Box::new(ViaShared(pair.replacement)),
            )
        };
        for &e in events {
            sim.step(e);
        }
        sim.finish()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]

        /// The lock-free `_mut` hooks the simulator calls give exactly what the engine's locking
        /// `&self` hooks give, for every policy pair and monitor input, on random traces mixing
        /// runs, strided streams (so stream training and prefetching happen), writes and reports.
        #[test]
        fn exclusive_hooks_match_shared_hooks(ops in proptest::collection::vec((0u64..96, 0u8..10, 1u64..4), 1..300)) {
            let mut events = Vec::new();
            for (page, op, stride) in ops {
                let kind = match op { 0 => EventKind::Report, 1 => EventKind::Write, _ => EventKind::Read };
                if op == 9 {
                    // A short stream.
                    for k in 0..8 {
                        events.push(event(page + k * stride, EventKind::Read));
                    }
                } else {
                    for _ in 0..1 + op % 3 {
                        events.push(event(page, kind));
                    }
                }
            }
            for monitor in [MonitorInput::None, MonitorInput::Reports, MonitorInput::Accesses] {
                for p in tiermem_policy::PREFETCHERS {
                    for r in tiermem_policy::REPLACEMENTS {
                        prop_assert_eq!(
                            run_paths(&events, p, r, monitor, true),
                            run_paths(&events, p, r, monitor, false),
                            "{} × {}, {:?}", p, r, monitor
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

        /// Skipping policy calls for immediate repeats is an optimisation only: every counter and
        /// the modeled time come out the same, for every policy pair, with reports interleaved.
        #[test]
        fn skipping_repeats_changes_no_result(ops in proptest::collection::vec((0u64..24, 0u8..8), 1..400)) {
            let mut events = Vec::new();
            for (page, op) in ops {
                let kind = match op { 0 => EventKind::Report, 1 => EventKind::Write, _ => EventKind::Read };
                // Runs of the same page, as cache lines of one page give.
                for _ in 0..1 + op % 3 {
                    events.push(event(page, kind));
                }
            }
            for p in tiermem_policy::PREFETCHERS {
                for r in tiermem_policy::REPLACEMENTS {
                    prop_assert_eq!(run(&events, p, r, true), run(&events, p, r, false), "{} × {}", p, r);
                }
            }
        }
    }
}
