use crate::{FaultInfo, PageList, Prefetcher};

/// Never prefetches: every page comes in on its own fault.
#[derive(Debug, Default)]
pub struct NoPrefetch;

impl Prefetcher for NoPrefetch {
    fn name(&self) -> &'static str {
        "none"
    }
    fn on_fault(&self, _fault: &FaultInfo, _out: &mut PageList) {}
}
