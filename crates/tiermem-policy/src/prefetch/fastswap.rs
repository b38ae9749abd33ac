use crate::{FaultInfo, PageList, Prefetcher};

/// Fastswap's prefetch: on every miss, the next `count` pages (7 in Fastswap).
#[derive(Debug)]
pub struct Fastswap {
    count: u64,
}

impl Fastswap {
    /// Prefetch the `count` pages after the faulting one.
    pub fn new(count: u64) -> Self {
        Self { count: count.min(PageList::CAPACITY as u64) }
    }
}

impl Prefetcher for Fastswap {
    fn name(&self) -> &'static str {
        "fastswap"
    }

    fn on_fault(&self, fault: &FaultInfo, out: &mut PageList) {
        if fault.hit {
            return;
        }
        let end = fault.page.saturating_add(self.count + 1).min(fault.region_pages);
        for page in fault.page + 1..end {
            out.push(page);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_seven_pages_clipped_at_the_region_end() {
        let f = Fastswap::new(7);
        let mut out = PageList::default();
        f.on_fault(
            &FaultInfo { offset: 0, region: 0, page: 10, region_pages: 100, write: false, hit: false },
            &mut out,
        );
        assert_eq!(out.as_slice(), &[11, 12, 13, 14, 15, 16, 17]);
        out.clear();
        f.on_fault(
            &FaultInfo { offset: 0, region: 0, page: 97, region_pages: 100, write: false, hit: false },
            &mut out,
        );
        assert_eq!(out.as_slice(), &[98, 99]);
        out.clear();
        f.on_fault(&FaultInfo { offset: 0, region: 0, page: 10, region_pages: 100, write: false, hit: true }, &mut out);
        assert!(out.is_empty());
    }
}
