//! The tiermem paging engine (Ultraswap in user space).
//!
//! An [`Engine`] manages [`Region`]s of anonymous memory registered with userfaultfd. It keeps at
//! most a budget of their pages resident and moves the rest to a [`tiermem_device::Device`]:
//! - the faulting page is read first, on a polled queue; prefetched pages follow on a separate
//!   completion-driven queue, so they never delay it;
//! - write-backs go on their own completion-driven queue and are never waited for on the fault
//!   path;
//! - a reclaim thread keeps residency under a watermark (70% of the budget by default), so
//!   faulting threads reclaim only at the hard limit;
//! - eviction write-protects a page before copying it, so a racing write waits instead of being
//!   lost; pages not written since they came in are dropped without a device write.

mod capture;
pub mod config;
pub mod damon;
mod delivery;
mod discard;
mod engine;
mod fault;
mod fork;
mod indirect;
mod io;
mod monitor;
pub mod page;
pub mod policy;
/// The prefetchers (from `tiermem-policy`).
pub use tiermem_policy::prefetch;
/// The replacement policies (from `tiermem-policy`).
pub use tiermem_policy::replace;
mod prefetch_governor;
mod prefetch_sample;
mod reclaim;
mod region;
pub mod settings;
pub mod stats;
mod trace_sink;
mod victim;

pub use config::{DirtyTracking, EngineConfig, FaultMode, IoMode, Limit, ReclaimMode};
pub use delivery::{is_engine_sigbus_action, replace_chained_sigbus_action};
pub use engine::{Engine, Region};
pub use fault::PinGuard;
pub use fork::{ChildCopy, ForkHold};
pub use settings::{RunSettings, STATISTICS_SNAPSHOT_EVERY};
pub use stats::StatsSnapshot;
pub use tiermem_monitor::Advice;
pub use tiermem_sys::{Error, ErrorKind, Result};
