//! Prefetchers.

mod fastswap;
mod leap;
mod none;
mod ondemand;
mod readahead;
mod sibling;
mod stream;
mod temporal;
mod with_ondemand;

pub use fastswap::Fastswap;
pub use leap::Leap;
pub use none::NoPrefetch;
pub use ondemand::Ondemand;
pub use readahead::Readahead;
pub use sibling::Sibling;
pub use stream::StreamPrefetcher;
pub(crate) use stream::SWAP_PAGES;
pub use temporal::Temporal;

/// Per-region state slots a prefetcher keeps: regions share a slot when their numbers agree
/// modulo this, which only blurs their histories, never breaks correctness.
pub(crate) const REGION_SLOTS: usize = 64;
