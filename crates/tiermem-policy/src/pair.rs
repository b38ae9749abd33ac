//! The stream prefetcher and stream-first replacement as one object, for a caller that owns
//! both outright (the simulator).

use crate::prefetch::{Fastswap, SWAP_PAGES};
use crate::replace::Groups;
use crate::stream::StreamTable;
use crate::{split_page_id, FaultInfo, PageId, PageList, PolicyOptions, Prefetcher};

/// `stream` × `stream-first` with one training table that nothing else holds. [`build_policies`]
/// gives this pair as two objects sharing the table behind a lock, as the engine needs (any
/// thread may call either); here the table is owned, so no hook locks anything. The hooks are
/// those of [`crate::Prefetcher`] and [`crate::Replacement`], with the same decisions call for
/// call (the simulator's `exclusive_hooks_match_shared_hooks` test compares them).
///
/// [`build_policies`]: crate::build_policies
#[derive(Debug)]
pub struct StreamPair {
    table: StreamTable,
    swap: Fastswap,
    groups: Groups,
}

impl StreamPair {
    /// The pair [`crate::build_policies`]`("stream", "stream-first", capacity_pages, options)`
    /// builds.
    pub fn new(capacity_pages: usize, options: &PolicyOptions) -> Self {
        Self {
            table: StreamTable::new(options.stream),
            swap: Fastswap::new(SWAP_PAGES),
            groups: Groups::new(capacity_pages, options.dense_pages),
        }
    }

    /// [`crate::Prefetcher::on_fault`].
    pub fn on_fault(&mut self, fault: &FaultInfo, out: &mut PageList) {
        self.swap.on_fault(fault, out);
        self.on_report(fault.region, fault.page, fault.region_pages, out);
    }

    /// [`crate::Prefetcher::on_report`].
    pub fn on_report(&mut self, region: u32, page: u64, region_pages: u64, out: &mut PageList) {
        if let Some(stream) = self.table.train_mut(region, page) {
            self.table.prefetch_targets(stream, region_pages, out);
        }
    }

    /// [`crate::Replacement::on_insert`].
    pub fn on_insert(&mut self, page: PageId) {
        self.groups.insert_mut(page);
    }

    /// [`crate::Replacement::on_remove`].
    pub fn on_remove(&mut self, page: PageId) {
        self.groups.remove_mut(page);
    }

    /// [`crate::Replacement::on_access`].
    pub fn on_access(&mut self, page: PageId) {
        let (owner, index) = split_page_id(page);
        let in_stream = self.table.in_stream_mut(owner, index);
        self.groups.access_mut(page, in_stream);
    }

    /// [`crate::Replacement::pick_victims`].
    pub fn pick_victims(&mut self, max: usize, is_referenced: &dyn Fn(PageId) -> bool, out: &mut PageList) {
        self.groups.pick_victims_mut(max, is_referenced, out);
    }
}
