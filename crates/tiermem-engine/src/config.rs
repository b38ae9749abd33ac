//! Engine configuration: every knob, its default, and validation with clear messages.

use std::fmt;
use std::str::FromStr;

use tiermem_sys::{Error, Result, PAGE_SIZE};

/// How a page fault reaches the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum FaultMode {
    /// Handler threads read fault messages from the userfaultfd.
    HandlerThread,
    /// The faulting thread itself takes a SIGBUS and resolves the fault in the signal handler
    /// (UFFD_FEATURE_SIGBUS). Faults taken by the kernel on behalf of a system call cannot be
    /// delivered this way: such calls return EFAULT unless the memory is first made resident with
    /// [`crate::Engine::prepare_kernel_access`].
    Sigbus,
}

/// How writes to resident pages are noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum DirtyTracking {
    /// Pick the best the kernel offers.
    Auto,
    /// Pages come in write-protected; the first write faults synchronously and marks them dirty.
    SyncWriteProtect,
    /// Pages come in write-protected and the kernel lifts the protection on the first write
    /// without a fault reaching the engine (UFFD_FEATURE_WP_ASYNC); eviction finds written pages
    /// with PAGEMAP_SCAN, takes each page out with UFFDIO_MOVE (a writer then waits for the
    /// engine) and confirms an unwritten page against a hash of what its slot holds.
    AsyncWriteProtect,
    /// No tracking: every resident page is written back when evicted.
    None,
}

/// Which queues carry which requests (the paper's §4.4.1 variants).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum IoMode {
    /// Ultraswap: the faulting page on a polled queue, prefetch and write-back on
    /// completion-driven queues.
    Hybrid,
    /// Everything polled and waited for synchronously.
    PollOnly,
    /// Everything completion-driven; the faulting thread sleeps until its page arrives.
    InterruptOnly,
}

/// Where reclaim runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ReclaimMode {
    /// A reclaim thread woken at the watermark (it writes cold pages back ahead of need there, and
    /// drops pages from the evict watermark on); faulting threads reclaim only at the hard limit.
    Background,
    /// Faulting threads reclaim whenever residency passes the watermark (the Linux behaviour the
    /// paper moves off the fault path). The reclaim thread only drops what a cut of the budget
    /// leaves above the limit, which no fault may come to do.
    OnFaultPath,
}

macro_rules! parse_enum {
    ($ty:ty, $what:literal, $($text:literal => $val:expr),+ $(,)?) => {
        impl FromStr for $ty {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($text => Ok($val),)+
                    other => Err(Error::invalid(format!(
                        concat!("unknown ", $what, " '{}' (expected one of: {})"),
                        other,
                        [$($text),+].join(", ")
                    ))),
                }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let text = match self { $(v if *v == $val => $text,)+ _ => "?" };
                f.write_str(text)
            }
        }
    };
}

parse_enum!(FaultMode, "fault mode", "thread" => FaultMode::HandlerThread, "sigbus" => FaultMode::Sigbus);
parse_enum!(DirtyTracking, "dirty tracking", "auto" => DirtyTracking::Auto, "sync-wp" => DirtyTracking::SyncWriteProtect, "async-wp" => DirtyTracking::AsyncWriteProtect, "none" => DirtyTracking::None);
parse_enum!(IoMode, "I/O mode", "hybrid" => IoMode::Hybrid, "poll-only" => IoMode::PollOnly, "interrupt-only" => IoMode::InterruptOnly);
parse_enum!(ReclaimMode, "reclaim mode", "background" => ReclaimMode::Background, "on-fault-path" => ReclaimMode::OnFaultPath);

/// Everything the engine can be told.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EngineConfig {
    /// Most bytes of managed memory resident at once (rounded down to pages).
    pub limit_bytes: u64,
    /// Fraction of the limit at which background reclaim starts (the paper: 0.7): from here the
    /// reclaim thread writes the coldest dirty pages back, keeping them resident, so that pages
    /// can later be dropped without waiting for a write.
    pub watermark: f64,
    /// Fraction of the limit from which the reclaim thread drops pages (the cleaned ones first),
    /// keeping the rest as headroom for faults and prefetches. Never below `watermark`; setting
    /// it to `watermark` makes reclaim evict down to the watermark, as the paper's kernel does.
    pub evict_watermark: f64,
    /// Pages the drop threshold stays below the limit, less one reclaim batch, at least: the
    /// room prefetched pages land in. Where the evict watermark leaves less (2% of a small
    /// budget is less than one 64-page readahead window), reclaim drops from lower down, or a
    /// scan's windows are cut to what fits and each page cut off is a critical read later.
    /// Never below 90% of the limit, nor above `evict_watermark`; none with `prefetch` "none".
    /// 0 leaves the evict watermark alone (256 by default).
    pub prefetch_room: u32,
    /// How faults arrive.
    pub fault_mode: FaultMode,
    /// How writes are noticed.
    pub dirty_tracking: DirtyTracking,
    /// Which queues carry which requests.
    pub io_mode: IoMode,
    /// Where reclaim runs.
    pub reclaim_mode: ReclaimMode,
    /// Prefetcher name (see [`crate::policy::prefetcher_by_name`]).
    pub prefetch: String,
    /// Replacement policy name (see [`crate::policy::replacement_by_name`]).
    pub replace: String,
    /// Cap the pages each prefetcher call may read while the sampled share of prefetched pages
    /// the program uses is low, so a prefetcher guessing badly cannot evict the working set
    /// for its guesses (see `prefetch_governor`).
    pub prefetch_governor: bool,
    /// 4 KiB I/O buffers shared by all queues.
    pub io_buffers: u32,
    /// Pages of the victim tier (0: none): evicted pages keep a copy in DRAM, unmapped, until
    /// this many newer ones have left; a fault there maps the copy back without a device read
    /// and tells replacement the page is in use (see [`crate::victim`]). Its buffers are
    /// allocated with the I/O buffers, on top of the budget.
    pub victim_pages: u32,
    /// Depth of each queue.
    pub queue_depth: u32,
    /// Pages evicted per reclaim round.
    pub reclaim_batch: usize,
    /// Handler threads in [`FaultMode::HandlerThread`].
    pub handler_threads: usize,
    /// Microseconds a handler thread keeps polling the userfaultfd after a fault before it
    /// sleeps (0: sleep at once). A program that faults again soon then finds the handler
    /// awake instead of waiting for its wake-up, which on a VM is an IPI to a halted vCPU.
    pub handler_spin_us: u32,
    /// Under sync write protection, a write fault unprotects the resident clean pages next to
    /// the written one too, within its aligned block of this many pages (1: the page alone),
    /// marking them dirty by presumption: one fault and one unprotect call instead of one per
    /// page for a program that writes a region through. Reclaim writes such a page back only if
    /// its contents no longer hash as what its slot holds. A power of two, 1..=64.
    pub write_fault_around: u32,
    /// Write address-contiguous dirty pages of a reclaim batch as one request of up to 32 pages
    /// to consecutive slots, instead of one request per page (the paper merges nothing).
    pub write_runs: bool,
    /// Async WP eviction through a page pipe where the fault mode allows it: a batch of
    /// scattered victims is held in a pipe, dropped with one call (one TLB flush) and read back,
    /// instead of one UFFDIO_MOVE, and one flush, per run of contiguous victims.
    pub evict_pipe: bool,
    /// Read a prefetcher's pages that sit in consecutive slots as one request of up to 32
    /// pages, instead of one request per page (the faulting page is still read alone, first).
    pub read_runs: bool,
    /// Indirect prefetching (sigbus fault mode, x86-64): learn, from a faulting instruction's
    /// registers, the array its index was read from, and read ahead the pages the next
    /// elements of that array name (`data[index[i]]` gathers; see `indirect.rs`).
    pub indirect: bool,
    /// In [`FaultMode::HandlerThread`], a fault on a page whose prefetch is in flight leaves the
    /// faulting thread asleep in the kernel until the completion maps the page (which wakes it),
    /// instead of the handler spinning until the read lands.
    pub defer_prefetch_hits: bool,
    /// The access monitor's hot-page threshold N (1..=64): a page is reported hot once it
    /// takes N read faults while it stays in the 64-entry hot-page table; a hot page found
    /// resident gets its referenced bit, one found evicted is read back.
    pub hot_threshold: u32,
    /// Feed the access monitor from DAMON too: the resident pages in physical regions DAMON
    /// found accessed in at least N samples of a window are reported hot (see `damon.rs`).
    /// Listens to a kdamond already monitoring physical memory (the engine refuses to start
    /// without one; `tiermem run` starts one when none exists); needs root (tracefs, DAMON
    /// sysfs, frame numbers in /proc/self/pagemap).
    pub damon: bool,
    /// Record every fault (page id, read or write) to this file in the simulator's binary trace
    /// format, for `tiermem sim`.
    pub trace_path: Option<std::path::PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            limit_bytes: 256 << 20,
            watermark: 0.7,
            evict_watermark: 0.98,
            // Quicksort at 20% of its footprint at the quick scale (an 18 MiB budget, whose 2%
            // leave 62 pages past a batch): 13.0 k critical reads with the watermark alone, 3.7 k
            // with 256 pages, 1.36x faster; budgets above 56 MiB are left as they were
            // (docs/engine.md, *Room for prefetches*).
            prefetch_room: 256,
            fault_mode: FaultMode::HandlerThread,
            dirty_tracking: DirtyTracking::Auto,
            io_mode: IoMode::Hybrid,
            reclaim_mode: ReclaimMode::Background,
            // Sequential windows ramping to 64 pages, driven by where faults land: swap-style
            // readahead sizes its window from prefetch hits, which eager install hides, and a
            // fixed next-7 is too short to cover a device latency of tens of microseconds. Plus
            // strided streams (`stride`, since 2026-12-06): Linpack's column sweeps at 20% took
            // 30% fewer critical reads, the other quick programs the same as with `ondemand`.
            prefetch: "stride".into(),
            // CLOCK order, but most recent first while a scan refaults (quicksort at 100% of
            // its footprint: 2.22 -> 1.70x its unmanaged time at the quick scale), and pages that
            // come back soon on their own kept (a Redis server and NPB IS at 20%: 26% faster
            // than seq-adaptive), as many as returns after leaving protection call for
            // (`seq-balance`, since 2026-12-06: Linpack at 20% 17% fewer critical reads than
            // with seq-protect; docs/policies.md).
            replace: "seq-balance".into(),
            prefetch_governor: true,
            io_buffers: 1024,
            victim_pages: 0,
            queue_depth: 128,
            reclaim_batch: 32,
            handler_threads: 1,
            handler_spin_us: 0,
            write_fault_around: 1,
            write_runs: false,
            evict_pipe: true,
            read_runs: false,
            indirect: false,
            defer_prefetch_hits: false,
            hot_threshold: tiermem_monitor::hot_table::DEFAULT_THRESHOLD,
            damon: false,
            trace_path: None,
        }
    }
}

impl EngineConfig {
    /// The limit in pages.
    pub fn limit_pages(&self) -> u64 {
        self.limit_bytes / PAGE_SIZE as u64
    }

    /// Check every field; the message names the field and the accepted range.
    pub fn validate(&self) -> Result<()> {
        if self.limit_pages() < 16 {
            return Err(Error::invalid(format!(
                "limit {} bytes is too small: at least 16 pages ({} bytes) are needed",
                self.limit_bytes,
                16 * PAGE_SIZE
            )));
        }
        if !(self.watermark > 0.0 && self.watermark <= 1.0) {
            return Err(Error::invalid(format!("watermark {} must be in (0, 1]", self.watermark)));
        }
        if !(self.evict_watermark > 0.0 && self.evict_watermark <= 1.0) {
            return Err(Error::invalid(format!("evict watermark {} must be in (0, 1]", self.evict_watermark)));
        }
        if self.prefetch_room > MAX_PREFETCH_ROOM {
            return Err(Error::invalid(format!(
                "prefetch room {} must be in 0..={MAX_PREFETCH_ROOM} pages",
                self.prefetch_room
            )));
        }
        if self.io_buffers < 16 || self.io_buffers > crate::page::MAX_BUF {
            return Err(Error::invalid(format!(
                "io_buffers {} must be in 16..={}",
                self.io_buffers,
                crate::page::MAX_BUF
            )));
        }
        if u64::from(self.io_buffers) + u64::from(self.victim_pages) > u64::from(crate::page::MAX_BUF) {
            return Err(Error::invalid(format!(
                "victim tier of {} pages and {} I/O buffers exceed the {} buffers a page can name",
                self.victim_pages,
                self.io_buffers,
                crate::page::MAX_BUF
            )));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(Error::invalid(format!("queue depth {} must be in 1..=4096", self.queue_depth)));
        }
        if self.reclaim_batch == 0 || self.reclaim_batch > 4096 {
            return Err(Error::invalid(format!("reclaim batch {} must be in 1..=4096", self.reclaim_batch)));
        }
        if self.handler_threads == 0 || self.handler_threads > 64 {
            return Err(Error::invalid(format!("handler threads {} must be in 1..=64", self.handler_threads)));
        }
        if !self.write_fault_around.is_power_of_two() || self.write_fault_around > 64 {
            return Err(Error::invalid(format!(
                "write fault-around {} must be a power of two from 1 to 64 pages",
                self.write_fault_around
            )));
        }
        if self.handler_spin_us > 10_000 {
            return Err(Error::invalid(format!("handler spin {} µs must be at most 10000", self.handler_spin_us)));
        }
        // The table states its own range.
        tiermem_monitor::hot_table::HotPageTable::new(self.hot_threshold)?;
        crate::policy::build_policies(&self.prefetch, &self.replace, 1, &crate::policy::PolicyOptions::default())?;
        // Last, after the fields that name their own errors. Resident memory cannot exceed the
        // machine's, and the policy tables sized for the budget (about 1% of it) would be a
        // single allocation the kernel refuses, which aborts the process (a C caller's too,
        // with no error to return).
        let machine = machine_memory_bytes();
        if machine > 0 && self.limit_bytes > machine {
            return Err(Error::invalid(format!(
                "limit {} bytes is more than this machine's memory ({machine} bytes): the budget is memory the \
                 program's pages are kept resident in",
                self.limit_bytes
            )));
        }
        Ok(())
    }
}

/// The machine's physical memory in bytes (0 when it cannot be read).
fn machine_memory_bytes() -> u64 {
    let info = rustix::system::sysinfo();
    (info.totalram as u64).saturating_mul(u64::from(info.mem_unit).max(1))
}

/// Largest size [`parse_size`] accepts: 1 EiB.
pub const MAX_SIZE: u64 = 1 << 60;

/// Largest [`EngineConfig::prefetch_room`], pages (64 MiB; the threshold never goes below the
/// cleaning watermark whatever the room).
pub const MAX_PREFETCH_ROOM: u32 = 16_384;

/// Parse a size: plain bytes or with a binary suffix (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `P`).
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || Error::invalid(format!("'{text}' is not a size (examples: 4096, 512MiB, 2G, 1.5GiB)"));
    let value: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        "p" | "pb" | "pib" => 1 << 50,
        _ => return Err(bad()),
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(bad());
    }
    // Far beyond any memory or device, and far enough below 2^64 that rounding up to pages and
    // doubling for capacities cannot wrap.
    if bytes > MAX_SIZE as f64 {
        return Err(Error::invalid(format!("'{text}' is too large (at most 1 EiB)")));
    }
    Ok(bytes as u64)
}

/// A memory limit: absolute, or a share of the footprint.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    /// Bytes.
    Bytes(u64),
    /// Percent of the footprint, in (0, 100].
    Percent(f64),
}

impl FromStr for Limit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if let Some(p) = s.trim().strip_suffix('%') {
            let v: f64 =
                p.trim().parse().map_err(|_| Error::invalid(format!("'{s}' is not a percentage (example: 40%)")))?;
            if !(v > 0.0 && v <= 100.0) {
                return Err(Error::invalid(format!("limit {s} must be above 0% and at most 100%")));
            }
            return Ok(Limit::Percent(v));
        }
        let bytes = parse_size(s)?;
        if bytes == 0 {
            return Err(Error::invalid("limit must be greater than zero"));
        }
        Ok(Limit::Bytes(bytes))
    }
}

impl Limit {
    /// The limit in bytes given the footprint (needed for percentages).
    pub fn resolve(self, footprint: Option<u64>) -> Result<u64> {
        match (self, footprint) {
            (Limit::Bytes(b), _) => Ok(b),
            (Limit::Percent(p), Some(f)) => Ok((f as f64 * p / 100.0) as u64),
            (Limit::Percent(p), None) => {
                Err(Error::invalid(format!("a limit of {p}% needs the footprint (give --footprint)")))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units_and_reject_garbage() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("1PiB").unwrap(), 1 << 50);
        for bad in ["", "MiB", "12XB", "-5", "1e3", "abc", "18446744073709551616", "2000PiB"] {
            assert!(parse_size(bad).is_err(), "{bad} accepted");
        }
        assert!(parse_size("18446744073709551616").unwrap_err().to_string().contains("too large"));
    }

    #[test]
    fn limits_resolve_percentages_against_the_footprint() {
        assert_eq!("40%".parse::<Limit>().unwrap().resolve(Some(1000)).unwrap(), 400);
        assert_eq!("1MiB".parse::<Limit>().unwrap().resolve(None).unwrap(), 1 << 20);
        assert!("0%".parse::<Limit>().is_err());
        assert!("101%".parse::<Limit>().is_err());
        assert!("0".parse::<Limit>().is_err());
        assert!("50%".parse::<Limit>().unwrap().resolve(None).is_err());
    }

    #[test]
    fn validation_names_the_bad_field() {
        let cfg = EngineConfig { watermark: 1.5, ..EngineConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("watermark"));
        let cfg = EngineConfig { evict_watermark: 0.0, ..EngineConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("evict watermark"));
        let cfg = EngineConfig { limit_bytes: 4096, ..EngineConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("too small"));
        // A budget no machine has (the C API took it, and aborted on the policy's tables).
        let cfg = EngineConfig { limit_bytes: MAX_SIZE, ..EngineConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("machine's memory"));
        let cfg = EngineConfig { prefetch: "magic".into(), ..EngineConfig::default() };
        assert!(cfg.validate().unwrap_err().to_string().contains("magic"));
        assert!("bogus".parse::<IoMode>().unwrap_err().to_string().contains("poll-only"));
        assert_eq!(IoMode::InterruptOnly.to_string(), "interrupt-only");
    }
}
