use std::sync::Arc;

use crate::stream::StreamTable;
use crate::{FaultInfo, PageList, Prefetcher};

/// Pages after a miss the swap system reads itself (Fastswap's 7).
pub(crate) const SWAP_PAGES: u64 = 7;

/// The stream prefetcher of §3.2: every access it hears of (monitor reports, and faults, which
/// are accesses too) trains the shared stream table; when a page completes a stream entry it
/// prefetches `end + i × stride`. Like the paper's integration with Fastswap, a miss also reads
/// the next 7 pages (the swap system's own prefetch, the paper's "swap hits"), which covers a
/// stream's first hundred strides before the table's prefetches arrive.
#[derive(Debug)]
pub struct StreamPrefetcher {
    table: Arc<StreamTable>,
    swap: super::Fastswap,
}

impl StreamPrefetcher {
    /// A prefetcher training `table` (shared with stream-first replacement, if any).
    pub fn new(table: Arc<StreamTable>) -> Self {
        Self { table, swap: super::Fastswap::new(SWAP_PAGES) }
    }

    /// The training table.
    pub fn table(&self) -> &Arc<StreamTable> {
        &self.table
    }
}

impl Prefetcher for StreamPrefetcher {
    fn name(&self) -> &'static str {
        "stream"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        self.swap.on_fault(fault, out);
        self.on_report(fault.region, fault.page, fault.region_pages, out);
    }

    fn on_report(&self, region: u32, page: u64, region_pages: u64, out: &mut PageList) {
        if let Some(stream) = self.table.train(region, page) {
            self.table.prefetch_targets(stream, region_pages, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::StreamConfig;

    #[test]
    fn reports_alone_prefetch_far_ahead_and_faults_add_the_swap_pages() {
        let p = StreamPrefetcher::new(Arc::new(StreamTable::new(StreamConfig { depth: 2, ..StreamConfig::default() })));
        let mut out = PageList::default();
        for page in [0, 2, 4, 6] {
            p.on_report(2, page, 1 << 20, &mut out);
        }
        assert!(out.is_empty());
        p.on_report(2, 8, 1 << 20, &mut out);
        assert_eq!(out.as_slice(), &[208, 210], "depth 2: i = 100 and 101");
        out.clear();
        p.on_fault(
            &FaultInfo { offset: 0, region: 2, page: 10, region_pages: 1 << 20, write: false, hit: false },
            &mut out,
        );
        assert_eq!(out.as_slice(), &[11, 12, 13, 14, 15, 16, 17, 210, 212]);
    }
}
