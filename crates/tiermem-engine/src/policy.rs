//! The pluggable policies: which pages to prefetch on a fault, and which to evict. They live in
//! `tiermem-policy` so the simulator runs the very same code; this module re-exports them.

pub use tiermem_policy::{
    build_policies, page_id, prefetcher_by_name, replacement_by_name, split_page_id, FaultInfo, PageId, PageList,
    PolicyOptions, PolicyPair, Prefetcher, Replacement, OFFLINE_REPLACEMENTS, PAGE_INDEX_BITS, PREFETCHERS,
    REPLACEMENTS,
};
