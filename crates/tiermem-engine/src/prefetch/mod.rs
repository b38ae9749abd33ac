//! Prefetchers.

mod none;
mod readahead;

pub use none::NoPrefetch;
pub use readahead::Readahead;
