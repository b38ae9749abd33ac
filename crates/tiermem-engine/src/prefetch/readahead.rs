use crate::policy::{FaultInfo, PageList, Prefetcher};

/// Linux's swap-cluster readahead: on a miss, read the aligned cluster of `2^page_cluster` pages
/// around the faulting page (page-cluster 3 = 8 pages). Hits trigger nothing: the cluster was
/// read already.
#[derive(Debug)]
pub struct Readahead {
    cluster: u64,
}

impl Readahead {
    /// Clusters of `2^page_cluster` pages.
    pub fn new(page_cluster: u32) -> Self {
        Self { cluster: 1 << page_cluster }
    }
}

impl Prefetcher for Readahead {
    fn name(&self) -> &'static str {
        "readahead"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        if fault.hit {
            return;
        }
        let start = fault.page & !(self.cluster - 1);
        let end = (start + self.cluster).min(fault.region_pages);
        for page in start..end {
            if page != fault.page {
                out.push(page);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fault(page: u64, hit: bool) -> FaultInfo {
        FaultInfo { region: 0, page, region_pages: 20, write: false, hit }
    }

    #[test]
    fn reads_the_aligned_cluster_without_the_faulting_page() {
        let ra = Readahead::new(3);
        let mut out = PageList::default();
        ra.on_fault(&fault(10, false), &mut out);
        assert_eq!(out.as_slice(), &[8, 9, 11, 12, 13, 14, 15]);
        out.clear();
        ra.on_fault(&fault(17, false), &mut out);
        assert_eq!(out.as_slice(), &[16, 18, 19], "clipped at the region's end");
        out.clear();
        ra.on_fault(&fault(3, true), &mut out);
        assert!(out.as_slice().is_empty());
    }
}
