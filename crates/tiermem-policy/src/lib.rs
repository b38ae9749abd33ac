//! The pluggable paging policies: which pages to prefetch, and which to evict.
//!
//! The same objects run in the live engine (called on the fault path, possibly from a SIGBUS
//! handler) and in the trace simulator. So every hook that the engine calls must not allocate:
//! implementations preallocate at construction and keep their critical sections short.
//!
//! Prefetchers: `none`, `readahead` (Linux VMA swap readahead), `fastswap` (next 7 pages),
//! `leap` (majority trend over a delta history), `stream` (the co-designed remote memory paper's
//! §3.2 stream training table), `ondemand` (sequential windows ramping up to 64 pages, after
//! Linux's file readahead, following several forward or backward streams per region), `stride`
//! (`ondemand` that also follows streams a fixed number of pages apart), `temporal` (`ondemand`
//! that also replays a history of misses, for loops over scattered pages), `sibling` (`ondemand`
//! that also reads the same element of parallel arrays: learned distances between misses).
//! Replacement: `fifo`, `clock`, `lru`, `stream-first` (§3.1), `seq`, `seq-adaptive`,
//! `seq-protect`, `seq-balance`, and the offline reference `belady`, which needs the future and so is built
//! from a trace ([`replace::Belady::from_trace`]), never by name.

mod pair;
pub mod prefetch;
pub mod replace;
pub mod stream;

pub use pair::StreamPair;

use std::sync::Arc;

pub use tiermem_sys::{Error, ErrorKind, Result};

use crate::prefetch::{Fastswap, Leap, NoPrefetch, Ondemand, Readahead, Sibling, StreamPrefetcher, Temporal};
use crate::replace::{Clock, Lru, StreamFirst};
use crate::stream::{StreamConfig, StreamTable};

/// Identifies a page across all regions of an engine: region slot in the high bits, page index
/// within the region in the low [`PAGE_INDEX_BITS`] bits.
pub type PageId = u64;
/// Bits of a [`PageId`] holding the page index.
pub const PAGE_INDEX_BITS: u32 = 40;

/// Build a [`PageId`].
pub fn page_id(region: u32, index: u64) -> PageId {
    (u64::from(region) << PAGE_INDEX_BITS) | index
}

/// Split a [`PageId`] into region slot and page index.
pub fn split_page_id(id: PageId) -> (u32, u64) {
    ((id >> PAGE_INDEX_BITS) as u32, id & ((1 << PAGE_INDEX_BITS) - 1))
}

/// A bounded list of page indices that never allocates.
#[derive(Debug, Clone)]
pub struct PageList {
    items: [u64; Self::CAPACITY],
    len: usize,
}

impl Default for PageList {
    fn default() -> Self {
        Self { items: [0; Self::CAPACITY], len: 0 }
    }
}

impl PageList {
    /// Most entries a list holds; pushes beyond are dropped.
    pub const CAPACITY: usize = 64;

    /// Add a page; returns false (and drops it) when full.
    pub fn push(&mut self, page: u64) -> bool {
        if self.len == Self::CAPACITY {
            return false;
        }
        self.items[self.len] = page;
        self.len += 1;
        true
    }

    /// The pages.
    pub fn as_slice(&self) -> &[u64] {
        &self.items[..self.len]
    }

    /// Number of pages held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No pages held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Empty the list.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keep the first `len` pages (all of them if there are fewer).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// What a prefetcher learns about one fault.
#[derive(Debug, Clone, Copy)]
pub struct FaultInfo {
    /// Region slot (prefetchers may keep per-region history).
    pub region: u32,
    /// Faulting page index within the region.
    pub page: u64,
    /// Pages in the region (prefetch never goes past it).
    pub region_pages: u64,
    /// The access was a write.
    pub write: bool,
    /// The page was already on its way or waiting in the prefetch cache (a prefetch hit).
    pub hit: bool,
    /// The byte within the page the faulting access touched, where the fault tells (a SIGBUS
    /// carries the exact address); 0 where it does not (a userfaultfd message gives the page,
    /// a page-level trace only pages).
    pub offset: u16,
}

/// Chooses pages to read ahead of demand.
pub trait Prefetcher: Send + Sync + std::fmt::Debug {
    /// Name as given on the command line.
    fn name(&self) -> &'static str;
    /// A fault happened; push page indices (same region; page ids if
    /// [`Prefetcher::spans_regions`]) worth reading now into `out`.
    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList);
    /// The access monitor saw `page` of `region` (holding `region_pages` pages) being used,
    /// without a fault: a hot-page report, a hint, a traced access. Push pages (same region)
    /// worth reading now; this is how a prefetcher works ahead of faults. Most prefetchers
    /// learn from faults only and ignore it.
    fn on_report(&self, region: u32, page: u64, region_pages: u64, out: &mut PageList) {
        let _ = (region, page, region_pages, out);
    }
    /// Whether the lists [`Prefetcher::on_fault`] fills hold page ids ([`page_id`]) of any
    /// region instead of page indices of the faulting one (its `on_report` lists stay within
    /// the reported page's region). A history of misses spans regions: an interpreter's heap
    /// is several.
    fn spans_regions(&self) -> bool {
        false
    }
    /// [`Prefetcher::on_fault`] for a caller with exclusive use of the policy and of everything
    /// it shares (the simulator): same result, without taking locks where the policy can avoid
    /// them. Must not allocate either.
    fn on_fault_mut(&mut self, fault: &FaultInfo, out: &mut PageList) {
        self.on_fault(fault, out);
    }
    /// [`Prefetcher::on_report`] for an exclusive caller; see [`Prefetcher::on_fault_mut`].
    fn on_report_mut(&mut self, region: u32, page: u64, region_pages: u64, out: &mut PageList) {
        self.on_report(region, page, region_pages, out);
    }
}

/// Chooses pages to evict. Hooks follow libCacheSim: insert, access, evict.
pub trait Replacement: Send + Sync + std::fmt::Debug {
    /// Name as given on the command line.
    fn name(&self) -> &'static str;
    /// `page` became resident.
    fn on_insert(&self, page: PageId);
    /// `page` was touched while resident (a write fault, a prefetch hit, a monitor report, a
    /// traced access).
    fn on_access(&self, page: PageId);
    /// Propose up to `max` victims into `out`, removing them from the policy's tracking.
    /// `is_referenced` reports and clears a page's referenced bit (second chance). The engine
    /// re-checks every proposal and hands back the ones it could not evict via `on_insert`.
    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList);
    /// Make the memory the policy set aside for its capacity resident now, instead of page by
    /// page as it fills (for a caller that must not wait for a new page later: the engine under
    /// the preload's OOM guard, whose reclaim thread stalled on the first touch of a policy
    /// queue while the cgroup was out of memory). Policies that set nothing aside do nothing.
    fn reserve_now(&self) {}
    /// `page` left memory without being picked (the program gave it back): forget it. List
    /// policies remove its entry; queue policies note it and drop its stale entry when it comes
    /// up, so the page, if it comes back, is not evicted by the old entry (a caller skips a
    /// victim it no longer holds, but not one that came back). Call it only for a page the
    /// policy holds an entry of (resident and not picked since).
    fn on_remove(&self, _page: PageId) {}
    /// Whether the policy holds at most one entry per page: `on_insert` of a page it holds
    /// moves that entry instead of adding one, and `on_remove` takes it out at once (the list
    /// policies, `lru` and `stream-first`). A caller may then give pages back through
    /// `on_remove` whatever their entry is doing; a queue policy (false) keeps a stale entry
    /// for each page given back and taken again, which its caller has to account for.
    fn one_entry_per_page(&self) -> bool {
        false
    }
    /// [`Replacement::on_remove`] for an exclusive caller; see [`Replacement::on_insert_mut`].
    fn on_remove_mut(&mut self, page: PageId) {
        self.on_remove(page);
    }
    /// [`Replacement::on_insert`] for a caller with exclusive use of the policy and of everything
    /// it shares (the simulator): same result, without taking locks where the policy can avoid
    /// them. Must not allocate either.
    fn on_insert_mut(&mut self, page: PageId) {
        self.on_insert(page);
    }
    /// [`Replacement::on_access`] for an exclusive caller; see [`Replacement::on_insert_mut`].
    fn on_access_mut(&mut self, page: PageId) {
        self.on_access(page);
    }
    /// [`Replacement::pick_victims`] for an exclusive caller; see [`Replacement::on_insert_mut`].
    fn pick_victims_mut(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        self.pick_victims(max, is_referenced, out);
    }
}

/// Names accepted by [`prefetcher_by_name`].
pub const PREFETCHERS: &[&str] = &[
    "none",
    "readahead",
    "fastswap",
    "leap",
    "stream",
    "ondemand",
    "stride",
    "temporal",
    "stride-temporal",
    "sibling",
];
/// Names accepted by [`replacement_by_name`].
pub const REPLACEMENTS: &[&str] =
    &["clock", "fifo", "lru", "stream-first", "seq", "seq-adaptive", "seq-protect", "seq-balance"];
/// Replacement policies that exist only offline (they read the future from a trace).
pub const OFFLINE_REPLACEMENTS: &[&str] = &["belady"];

/// Knobs of the policies that have any; the defaults are the papers' values.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PolicyOptions {
    /// The stream training table and stream prefetcher.
    pub stream: StreamConfig,
    /// Page ids below this are tracked by `lru` and `stream-first` in arrays indexed by page
    /// instead of a hash table (faster when ids are small and dense, as the simulator's are;
    /// costs 16 bytes per id, allocated at construction). 0, the default: hashing only.
    pub dense_pages: u64,
}

/// A prefetcher and a replacement policy built together, sharing one stream training table
/// when both use it (`stream` with `stream-first`, the paper's §5.3 combination).
#[derive(Debug)]
pub struct PolicyPair {
    /// The prefetcher.
    pub prefetcher: Box<dyn Prefetcher>,
    /// The replacement policy.
    pub replacement: Box<dyn Replacement>,
    /// The stream table both share, if either uses one.
    pub stream_table: Option<Arc<StreamTable>>,
}

/// Build a prefetcher and a replacement policy by name, sized for `capacity_pages` resident
/// pages; `stream` and `stream-first` share one training table.
pub fn build_policies(
    prefetch: &str,
    replace: &str,
    capacity_pages: usize,
    options: &PolicyOptions,
) -> Result<PolicyPair> {
    check_prefetcher(prefetch)?;
    check_replacement(replace)?;
    let uses_table = prefetch == "stream" || replace == "stream-first";
    let table = uses_table.then(|| Arc::new(StreamTable::new(options.stream)));
    let prefetcher: Box<dyn Prefetcher> = match prefetch {
        "none" => Box::new(NoPrefetch),
        "readahead" => Box::new(Readahead::new(3)),
        "fastswap" => Box::new(Fastswap::new(7)),
        "leap" => Box::new(Leap::new()),
        "ondemand" => Box::new(Ondemand::new(PageList::CAPACITY as u64)),
        "stride" => Box::new(Ondemand::with_strides(PageList::CAPACITY as u64)),
        "temporal" => Box::new(Temporal::new()),
        "stride-temporal" => Box::new(Temporal::on_strides()),
        "sibling" => Box::new(Sibling::new()),
        _ => {
            Box::new(StreamPrefetcher::new(table.clone().unwrap_or_else(|| Arc::new(StreamTable::new(options.stream)))))
        }
    };
    let replacement: Box<dyn Replacement> = match replace {
        "clock" => Box::new(Clock::new(capacity_pages, true)),
        "fifo" => Box::new(Clock::new(capacity_pages, false)),
        "seq" => Box::new(replace::Seq::new(capacity_pages)),
        "seq-adaptive" => Box::new(replace::Seq::adaptive(capacity_pages)),
        "seq-protect" => Box::new(replace::Seq::protecting(capacity_pages)),
        "seq-balance" => Box::new(replace::Seq::balancing(capacity_pages)),
        "lru" => Box::new(Lru::with_dense(capacity_pages, options.dense_pages)),
        _ => Box::new(StreamFirst::with_dense(
            capacity_pages,
            table.clone().unwrap_or_else(|| Arc::new(StreamTable::new(options.stream))),
            prefetch != "stream",
            options.dense_pages,
        )),
    };
    Ok(PolicyPair { prefetcher, replacement, stream_table: table })
}

fn check_prefetcher(name: &str) -> Result<()> {
    if PREFETCHERS.contains(&name) {
        return Ok(());
    }
    Err(Error::invalid(format!("unknown prefetcher '{name}' (expected one of: {})", PREFETCHERS.join(", "))))
}

fn check_replacement(name: &str) -> Result<()> {
    if REPLACEMENTS.contains(&name) {
        return Ok(());
    }
    if OFFLINE_REPLACEMENTS.contains(&name) {
        return Err(Error::invalid(format!(
            "replacement policy '{name}' is offline-only: it needs the future accesses, so only the simulator \
             can run it (tiermem sim --replace {name})"
        )));
    }
    Err(Error::invalid(format!(
        "unknown replacement policy '{name}' (expected one of: {}; in the simulator also: {})",
        REPLACEMENTS.join(", "),
        OFFLINE_REPLACEMENTS.join(", ")
    )))
}

/// Build a prefetcher by name (its own stream table, if it uses one).
pub fn prefetcher_by_name(name: &str) -> Result<Box<dyn Prefetcher>> {
    Ok(build_policies(name, "fifo", 1, &PolicyOptions::default())?.prefetcher)
}

/// Build a replacement policy by name, sized for `capacity_pages` resident pages (its own stream
/// table, if it uses one).
pub fn replacement_by_name(name: &str, capacity_pages: usize) -> Result<Box<dyn Replacement>> {
    Ok(build_policies("none", name, capacity_pages, &PolicyOptions::default())?.replacement)
}

/// Lock a mutex, carrying on after a panic elsewhere: every policy keeps its state valid between
/// statements, so a poisoned lock still guards consistent data.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The data of a mutex its owner holds exclusively (no locking), carrying on after a panic as
/// [`lock`] does.
pub(crate) fn owned<T>(m: &mut std::sync::Mutex<T>) -> &mut T {
    m.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_name_builds_and_unknown_or_offline_names_are_clear_errors() {
        for p in PREFETCHERS {
            for r in REPLACEMENTS {
                let pair = build_policies(p, r, 64, &PolicyOptions::default()).unwrap();
                assert_eq!(pair.prefetcher.name(), *p);
                assert_eq!(pair.replacement.name(), *r);
                assert_eq!(pair.stream_table.is_some(), *p == "stream" || *r == "stream-first");
            }
        }
        let e = replacement_by_name("belady", 8).unwrap_err().to_string();
        assert!(e.contains("offline-only"), "{e}");
        let e = prefetcher_by_name("oracle").unwrap_err().to_string();
        assert!(e.contains("unknown prefetcher 'oracle'") && e.contains("stream"), "{e}");
    }

    /// What `one_entry_per_page` promises the engine, policy by policy: a page inserted twice
    /// comes up as a victim once (and not at all after `on_remove`) where it is true, twice
    /// where it is false (a queue policy's second entry).
    #[test]
    fn one_entry_per_page_says_how_a_policy_keeps_a_page_inserted_twice() {
        let victims = |policy: &dyn Replacement| {
            let mut out = PageList::default();
            policy.pick_victims(PageList::CAPACITY, &|_| false, &mut out);
            out.as_slice().iter().filter(|&&p| p == 7).count()
        };
        for name in REPLACEMENTS {
            let policy = replacement_by_name(name, 64).unwrap();
            for page in [7, 3, 7] {
                policy.on_insert(page);
            }
            let one = policy.one_entry_per_page();
            assert_eq!(victims(&*policy), if one { 1 } else { 2 }, "{name}");
            if one {
                for page in [7, 3, 7] {
                    policy.on_insert(page);
                }
                policy.on_remove(7);
                assert_eq!(victims(&*policy), 0, "{name}: removed at once");
            }
        }
    }

    #[test]
    fn pages_given_back_never_crowd_out_the_ones_that_came_after() {
        // A program that maps, fills and frees memory at fresh addresses, round after round:
        // far more pages given back than any policy's table holds.
        for name in REPLACEMENTS {
            let mut policy = replacement_by_name(name, 4).unwrap();
            for round in 0..100u64 {
                for page in round * 4..round * 4 + 4 {
                    policy.on_insert_mut(page);
                }
                for page in round * 4..round * 4 + 4 {
                    policy.on_remove_mut(page);
                }
            }
            let fresh: Vec<u64> = (10_000..10_004).collect();
            for &page in &fresh {
                policy.on_insert_mut(page);
            }
            // A caller skips victims it no longer holds; every page it does hold is found.
            let mut found = Vec::new();
            for _ in 0..1000 {
                let mut out = PageList::default();
                policy.pick_victims_mut(4, &|_| false, &mut out);
                if out.is_empty() {
                    break;
                }
                found.extend(out.as_slice().iter().copied().filter(|p| fresh.contains(p)));
            }
            found.sort_unstable();
            assert_eq!(found, fresh, "{name}");
        }
    }

    #[test]
    fn page_ids_round_trip() {
        let id = page_id(7, (1 << 40) - 1);
        assert_eq!(split_page_id(id), (7, (1 << 40) - 1));
    }
}
