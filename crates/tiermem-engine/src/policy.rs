//! The pluggable policies: which pages to prefetch on a fault, and which to evict.
//!
//! Both traits are called on the fault path, possibly from a signal handler, so implementations
//! must not allocate there and should keep their critical sections short.

use tiermem_sys::{Error, Result};

use crate::prefetch::{NoPrefetch, Readahead};
use crate::replace::Clock;

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
#[derive(Debug)]
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

    /// Empty the list.
    pub fn clear(&mut self) {
        self.len = 0;
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
}

/// Chooses pages to read ahead of demand.
pub trait Prefetcher: Send + Sync + std::fmt::Debug {
    /// Name as given on the command line.
    fn name(&self) -> &'static str;
    /// A fault happened; push page indices (same region) worth reading now into `out`.
    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList);
}

/// Chooses pages to evict. Hooks follow libCacheSim: insert, access, evict.
pub trait Replacement: Send + Sync + std::fmt::Debug {
    /// Name as given on the command line.
    fn name(&self) -> &'static str;
    /// `page` became resident.
    fn on_insert(&self, page: PageId);
    /// `page` was touched while resident (a write fault, a prefetch hit).
    fn on_access(&self, page: PageId);
    /// Propose up to `max` victims into `out`, removing them from the policy's tracking.
    /// `is_referenced` reports and clears a page's referenced bit (second chance). The engine
    /// re-checks every proposal and hands back the ones it could not evict via `on_insert`.
    fn pick_victims(&self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList);
}

/// Names accepted by [`prefetcher_by_name`].
pub const PREFETCHERS: &[&str] = &["none", "readahead"];
/// Names accepted by [`replacement_by_name`].
pub const REPLACEMENTS: &[&str] = &["clock", "fifo"];

/// Build a prefetcher by name.
pub fn prefetcher_by_name(name: &str) -> Result<Box<dyn Prefetcher>> {
    match name {
        "none" => Ok(Box::new(NoPrefetch)),
        "readahead" => Ok(Box::new(Readahead::new(3))),
        other => {
            Err(Error::invalid(format!("unknown prefetcher '{other}' (expected one of: {})", PREFETCHERS.join(", "))))
        }
    }
}

/// Build a replacement policy by name, sized for `capacity_pages` resident pages.
pub fn replacement_by_name(name: &str, capacity_pages: usize) -> Result<Box<dyn Replacement>> {
    match name {
        "clock" => Ok(Box::new(Clock::new(capacity_pages, true))),
        "fifo" => Ok(Box::new(Clock::new(capacity_pages, false))),
        other => Err(Error::invalid(format!(
            "unknown replacement policy '{other}' (expected one of: {})",
            REPLACEMENTS.join(", ")
        ))),
    }
}
