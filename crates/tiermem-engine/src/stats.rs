//! Counters and latency histograms for each path, a one-screen summary, and JSON.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// The timed paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// A missing-page fault served by a device read of that page.
    CriticalFault,
    /// The device read inside a critical fault, from submission (the submit call included) to
    /// its completion: the device's latency as that fault saw it, so that the engine's own
    /// share of a critical fault is the difference, measured on the same requests.
    CriticalRead,
    /// A fault on a page that was untouched (zero-filled, no I/O).
    ZeroFault,
    /// A fault on a page prefetched, in flight, or still in a write-back buffer.
    HitFault,
    /// A write to a clean resident page (write-protect fault).
    WriteProtectFault,
    /// A prefetch read, from submission to completion.
    Prefetch,
    /// A write-back, from submission to completion.
    WriteBack,
    /// Evicting one page in the background reclaim thread.
    Reclaim,
    /// Evicting one page on a faulting thread (hard limit reached, or on-fault-path mode).
    DirectReclaim,
}

const PATHS: [(Path, &str); 9] = [
    (Path::CriticalFault, "critical_fault"),
    (Path::CriticalRead, "critical_read"),
    (Path::ZeroFault, "zero_fault"),
    (Path::HitFault, "hit_fault"),
    (Path::WriteProtectFault, "wp_fault"),
    (Path::Prefetch, "prefetch_io"),
    (Path::WriteBack, "writeback_io"),
    (Path::Reclaim, "reclaim"),
    (Path::DirectReclaim, "direct_reclaim"),
];

/// Event counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// Pages read from the device for a faulting thread.
    pub critical_reads: AtomicU64,
    /// Prefetch reads issued.
    pub prefetch_issued: AtomicU64,
    /// Prefetched pages later faulted on (prefetch cache hits and in-flight hits).
    pub prefetch_hits: AtomicU64,
    /// Of the prefetch hits, faults on pages still in flight left to their completion to map
    /// (the faulting thread slept instead of a handler spinning; see
    /// [`crate::EngineConfig::defer_prefetch_hits`]).
    pub deferred_hits: AtomicU64,
    /// Prefetched pages mapped before anyone asked (eager install).
    pub prefetch_installed: AtomicU64,
    /// Prefetched pages thrown away unused (no room, or evicted before use).
    pub prefetch_dropped: AtomicU64,
    /// Prefetched pages left in their buffers to see whether they are used (the samples that
    /// measure accuracy under eager install).
    pub prefetch_sampled: AtomicU64,
    /// Samples the program touched.
    pub prefetch_sample_used: AtomicU64,
    /// Samples still untouched when their wait ended.
    pub prefetch_sample_unused: AtomicU64,
    /// Entries of prefetchers' lists the prefetch governor cut (see `prefetch_governor`); some
    /// would have been skipped as resident or in flight.
    pub prefetch_cut: AtomicU64,
    /// Faults served from a write-back buffer still in flight.
    pub writeback_hits: AtomicU64,
    /// Pages zero-filled.
    pub zero_fills: AtomicU64,
    /// Write-protect faults (first write to a clean page).
    pub wp_faults: AtomicU64,
    /// Pages evicted.
    pub evictions: AtomicU64,
    /// Page writes issued: at eviction (dirty pages) and ahead of it (`cleaned_ahead`).
    pub writebacks: AtomicU64,
    /// Page writes issued ahead of eviction by the reclaim thread (the page stayed resident).
    pub cleaned_ahead: AtomicU64,
    /// Evicted pages dropped without a write (clean, slot still valid).
    pub clean_drops: AtomicU64,
    /// Evicted pages found all-zero and returned to untouched.
    pub zero_drops: AtomicU64,
    /// Pages evicted by faulting threads.
    pub direct_reclaims: AtomicU64,
    /// Times the reclaim thread was woken.
    pub reclaim_wakeups: AtomicU64,
    /// System calls by which eviction and cleaning change the program's page tables: one per
    /// UFFDIO_MOVE, UFFDIO_WRITEPROTECT or MADV_DONTNEED, each for a run of contiguous pages or
    /// (batched MADV_DONTNEED) a whole batch. Each flushes the TLB of every other CPU running the
    /// program, an IPI that costs about as much as the rest of the call (about 10 µs on the
    /// 2-core test VM, whatever the run's length up to 64 pages), so evictions per call says
    /// how much of that reclaim shares.
    pub unmap_calls: AtomicU64,
    /// Victims taken out through a page pipe (async WP: one drop and one TLB flush for a whole
    /// batch of scattered pages) rather than moved run by run.
    pub spliced_evictions: AtomicU64,
    /// Page copies the kernel refused for want of memory in the cgroup (ENOMEM: its OOM killer
    /// is off, see the preload's OOM guard), retried after the budget shrank; one still refused
    /// counts again every 20 ms.
    pub memory_waits: AtomicU64,
    /// Write-backs not made because the device's file system had no room to set aside a slot
    /// (see `Device::back_slots`): the page stayed in memory.
    pub no_device_room: AtomicU64,
    /// Extensions of the device refused memory by a full cgroup (ENOMEM), tried again in a
    /// few milliseconds; the pages needing them stayed in memory meanwhile.
    pub device_memory_refusals: AtomicU64,
    /// Device errors seen.
    pub io_errors: AtomicU64,
    /// The first of them: `kind << 32 | errno` ([`IoErrorKind`]), 0 before any.
    pub first_io_error: AtomicU64,
    /// Resident pages found unmapped at a fault: dropped behind the engine's back (a madvise
    /// that bypassed it). They read as zeros afterwards, as MADV_DONTNEED promises.
    pub dropped_outside: AtomicU64,
    /// Highest resident page count seen.
    pub peak_resident: AtomicU64,
    /// Reports the monitor thread took from the access monitor's ring (application advice, hot
    /// pages).
    pub monitor_reports: AtomicU64,
    /// Of those, hot pages: pages the hot-page table saw fault N times (the threshold),
    /// counted once the monitor thread has acted on them.
    pub hot_reports: AtomicU64,
    /// Writes to clean resident pages found in the page tables when replacement looked at the
    /// pages (async write protection, where such writes do not fault): each counted as a use.
    pub writes_seen_in_page_tables: AtomicU64,
    /// Stale replacement entries dropped: entries of pages the program gave back while a queue
    /// policy held them, which came up as victims (the page, back since or not, stays).
    pub stale_entries_dropped: AtomicU64,
    /// Pages write fault-around made writable that reclaim found unwritten (their contents
    /// still hash as what their slot holds) and so did not write back.
    pub unwritten_around: AtomicU64,
    /// Faults the access monitor did not see: another thread was feeding it at that moment
    /// (the fault path never waits for it).
    pub monitor_skipped_faults: AtomicU64,
    /// Pages read ahead for monitor reports: advised as needed soon, or chosen by the
    /// prefetcher from a report (counted in `prefetch_issued` too).
    pub monitor_read_ahead: AtomicU64,
    /// Resident pages advised cold and put first in line for eviction.
    pub cold_listed: AtomicU64,
    /// DAMON aggregation windows the DAMON source took (`EngineConfig::damon`).
    pub damon_windows: AtomicU64,
    /// Resident managed pages found in regions DAMON saw accessed, over all windows (fed to
    /// the monitor; those seen in at least N samples become hot reports).
    pub damon_pages: AtomicU64,
    /// Times the DAMON source stopped on an error (reading its events failed).
    pub damon_errors: AtomicU64,
    /// Evicted pages whose copy entered the victim tier (see [`crate::EngineConfig::victim_pages`]).
    pub victim_kept: AtomicU64,
    /// Faults served from the victim tier (a copy back, no device read).
    pub victim_hits: AtomicU64,
    /// Copies that left the victim tier unused (the tier was full).
    pub victim_dropped: AtomicU64,
    /// Instructions whose index array indirect prefetching learned (see `indirect.rs`).
    pub indirect_learned: AtomicU64,
    /// Pages indirect prefetching read ahead.
    pub indirect_prefetched: AtomicU64,
    /// Trusted index sources dropped (their index was not where they said, or they led
    /// outside the data).
    pub indirect_forgotten: AtomicU64,
    /// Times an instruction was given up on: its searches for an index source failed.
    pub indirect_given_up: AtomicU64,
    /// Learned instructions pushed out of the table by others.
    pub indirect_displaced: AtomicU64,
    /// Faults at a trusted instruction whose next index elements could not be read (evicted).
    pub indirect_unreadable: AtomicU64,
    /// Read-ahead windows stopped short for want of room or I/O buffers.
    pub indirect_room_stops: AtomicU64,
}

/// Counters plus one histogram (ns) per path.
#[derive(Debug)]
pub struct Stats {
    /// Event counters.
    pub counters: Counters,
    histograms: [Mutex<Histogram<u64>>; PATHS.len()],
}

impl Default for Stats {
    fn default() -> Self {
        let new = || Mutex::new(Histogram::new_with_bounds(1, 60_000_000_000, 2).expect("static histogram bounds"));
        Self { counters: Counters::default(), histograms: std::array::from_fn(|_| new()) }
    }
}

/// What a device request that failed was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoErrorKind {
    /// The read of a faulting page.
    CriticalRead = 1,
    /// A prefetch.
    Prefetch = 2,
    /// A write-back.
    WriteBack = 3,
}

impl IoErrorKind {
    fn describe(code: u64) -> &'static str {
        match code {
            1 => "a critical read",
            2 => "a prefetch",
            3 => "a write-back",
            _ => "a request",
        }
    }
}

/// The errno of a device error: its OS error's, else EIO (a short transfer, say).
pub fn errno_of(e: &tiermem_device::Error) -> i32 {
    e.os_error().and_then(std::io::Error::raw_os_error).filter(|&errno| errno > 0).unwrap_or(libc::EIO)
}

impl Stats {
    /// Count one event.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Count a failed device request, keeping the first one's kind and errno for the summary
    /// (a count alone does not say whether the disk is failing or full).
    pub fn io_error(&self, kind: IoErrorKind, errno: i32) {
        Self::add(&self.counters.io_errors, 1);
        let code = (kind as u64) << 32 | u64::from(errno as u32);
        let _ = self.counters.first_io_error.compare_exchange(0, code, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Record one latency sample of `path`.
    pub fn record(&self, path: Path, ns: u64) {
        let idx = PATHS.iter().position(|(p, _)| *p == path).unwrap_or(0);
        let mut h = self.histograms[idx].lock().unwrap_or_else(|e| e.into_inner());
        h.saturating_record(ns.max(1));
    }

    /// Write every histogram's counts once (a reset writes them all), so recording never
    /// touches a new page (see [`crate::Engine::keep_metadata_resident`]).
    pub fn touch_histograms(&self) {
        for h in &self.histograms {
            h.lock().unwrap_or_else(|e| e.into_inner()).reset();
        }
    }

    /// Note the resident count for the peak.
    pub fn observe_resident(&self, pages: u64) {
        self.counters.peak_resident.fetch_max(pages, Ordering::Relaxed);
    }

    /// A copy of everything now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let paths = PATHS
            .iter()
            .enumerate()
            .map(|(i, (_, name))| {
                let h = self.histograms[i].lock().unwrap_or_else(|e| e.into_inner());
                let us = |v: u64| v as f64 / 1000.0;
                PathStats {
                    path: name.to_string(),
                    count: h.len(),
                    mean_us: if h.is_empty() { 0.0 } else { h.mean() / 1000.0 },
                    p50_us: us(h.value_at_quantile(0.5)),
                    p99_us: us(h.value_at_quantile(0.99)),
                    max_us: us(h.max()),
                    total_ms: if h.is_empty() { 0.0 } else { h.mean() * h.len() as f64 / 1e6 },
                }
            })
            .collect();
        let issued = l(&c.prefetch_issued);
        let hits = l(&c.prefetch_hits);
        let critical = l(&c.critical_reads);
        let installed = l(&c.prefetch_installed);
        let (used, unused, sampled) =
            (l(&c.prefetch_sample_used), l(&c.prefetch_sample_unused), l(&c.prefetch_sampled));
        // With eager install, a used prefetched page is never seen: estimate from the samples.
        // Without it (nothing installed), every prefetched page waits and is counted.
        let (accuracy, coverage) = if installed > 0 {
            crate::prefetch_sample::estimate(used, unused, installed + sampled, issued, critical).unzip()
        } else {
            (
                (issued > 0).then(|| hits as f64 / issued as f64),
                (hits + critical > 0).then(|| hits as f64 / (hits + critical) as f64),
            )
        };
        StatsSnapshot {
            critical_reads: critical,
            prefetch_issued: issued,
            prefetch_hits: hits,
            deferred_hits: l(&c.deferred_hits),
            prefetch_installed: installed,
            prefetch_dropped: l(&c.prefetch_dropped),
            prefetch_sampled: sampled,
            prefetch_sample_used: used,
            prefetch_sample_unused: unused,
            prefetch_cut: l(&c.prefetch_cut),
            writeback_hits: l(&c.writeback_hits),
            zero_fills: l(&c.zero_fills),
            wp_faults: l(&c.wp_faults),
            evictions: l(&c.evictions),
            writebacks: l(&c.writebacks),
            cleaned_ahead: l(&c.cleaned_ahead),
            clean_drops: l(&c.clean_drops),
            zero_drops: l(&c.zero_drops),
            direct_reclaims: l(&c.direct_reclaims),
            reclaim_wakeups: l(&c.reclaim_wakeups),
            unmap_calls: l(&c.unmap_calls),
            spliced_evictions: l(&c.spliced_evictions),
            memory_waits: l(&c.memory_waits),
            no_device_room: l(&c.no_device_room),
            device_memory_refusals: l(&c.device_memory_refusals),
            io_errors: l(&c.io_errors),
            first_io_error: match l(&c.first_io_error) {
                0 => None,
                code => Some(format!(
                    "{}: {}",
                    IoErrorKind::describe(code >> 32),
                    std::io::Error::from_raw_os_error((code & 0xffff_ffff) as i32)
                )),
            },
            dropped_outside: l(&c.dropped_outside),
            peak_resident_pages: l(&c.peak_resident),
            monitor_reports: l(&c.monitor_reports),
            hot_reports: l(&c.hot_reports),
            monitor_skipped_faults: l(&c.monitor_skipped_faults),
            writes_seen_in_page_tables: l(&c.writes_seen_in_page_tables),
            stale_entries_dropped: l(&c.stale_entries_dropped),
            unwritten_around: l(&c.unwritten_around),
            monitor_read_ahead: l(&c.monitor_read_ahead),
            cold_listed: l(&c.cold_listed),
            damon_windows: l(&c.damon_windows),
            damon_pages: l(&c.damon_pages),
            damon_errors: l(&c.damon_errors),
            victim_kept: l(&c.victim_kept),
            victim_hits: l(&c.victim_hits),
            victim_dropped: l(&c.victim_dropped),
            indirect_learned: l(&c.indirect_learned),
            indirect_prefetched: l(&c.indirect_prefetched),
            indirect_forgotten: l(&c.indirect_forgotten),
            indirect_given_up: l(&c.indirect_given_up),
            indirect_displaced: l(&c.indirect_displaced),
            indirect_unreadable: l(&c.indirect_unreadable),
            indirect_room_stops: l(&c.indirect_room_stops),
            prefetch_accuracy: accuracy,
            prefetch_coverage: coverage,
            prefetched_share: (installed + hits + critical > 0)
                .then(|| (installed + hits) as f64 / (installed + hits + critical) as f64),
            paths,
        }
    }
}

/// Latency of one path.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PathStats {
    /// Path name.
    pub path: String,
    /// Samples.
    pub count: u64,
    /// Mean µs.
    pub mean_us: f64,
    /// Median µs.
    pub p50_us: f64,
    /// 99th percentile µs.
    pub p99_us: f64,
    /// Max µs.
    pub max_us: f64,
    /// Sum, ms.
    pub total_ms: f64,
}

/// Everything the engine counted, at one moment.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// See [`Counters`].
    pub critical_reads: u64,
    /// See [`Counters`].
    pub prefetch_issued: u64,
    /// See [`Counters`].
    pub prefetch_hits: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub deferred_hits: u64,
    /// See [`Counters`].
    pub prefetch_installed: u64,
    /// See [`Counters`].
    pub prefetch_dropped: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub prefetch_sampled: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub prefetch_sample_used: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub prefetch_sample_unused: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub prefetch_cut: u64,
    /// See [`Counters`].
    pub writeback_hits: u64,
    /// See [`Counters`].
    pub zero_fills: u64,
    /// See [`Counters`].
    pub wp_faults: u64,
    /// See [`Counters`].
    pub evictions: u64,
    /// See [`Counters`].
    pub writebacks: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub cleaned_ahead: u64,
    /// See [`Counters`].
    pub clean_drops: u64,
    /// See [`Counters`].
    pub zero_drops: u64,
    /// See [`Counters`].
    pub direct_reclaims: u64,
    /// See [`Counters`].
    pub reclaim_wakeups: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub unmap_calls: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub spliced_evictions: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub memory_waits: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub no_device_room: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub device_memory_refusals: u64,
    /// See [`Counters`].
    pub io_errors: u64,
    /// The first device error: what the request was for and the error ("a write-back:
    /// Input/output error (os error 5)").
    #[serde(default)]
    pub first_io_error: Option<String>,
    /// See [`Counters`].
    #[serde(default)]
    pub dropped_outside: u64,
    /// Highest number of resident managed pages.
    pub peak_resident_pages: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub monitor_reports: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub hot_reports: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub monitor_skipped_faults: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub writes_seen_in_page_tables: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub stale_entries_dropped: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub unwritten_around: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub monitor_read_ahead: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub cold_listed: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub damon_windows: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub damon_pages: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub damon_errors: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub victim_kept: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub victim_hits: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub victim_dropped: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_learned: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_prefetched: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_forgotten: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_given_up: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_displaced: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_unreadable: u64,
    /// See [`Counters`].
    #[serde(default)]
    pub indirect_room_stops: u64,
    /// Prefetched pages used per prefetch issued. With eager install, estimated from the
    /// samples that waited for their first touch (none ended yet: None).
    pub prefetch_accuracy: Option<f64>,
    /// Used prefetched pages per page the program needed from the device (used prefetched
    /// pages + critical reads); estimated like the accuracy.
    pub prefetch_coverage: Option<f64>,
    /// Share of pages read from the device that came by prefetch rather than by a fault.
    pub prefetched_share: Option<f64>,
    /// Latency per path.
    pub paths: Vec<PathStats>,
}

impl StatsSnapshot {
    /// A one-screen summary for people.
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let pct = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{:.1}%", v * 100.0));
        let mib = |pages: u64| pages as f64 * 4096.0 / (1 << 20) as f64;
        let _ = writeln!(
            s,
            "peak resident   {:.1} MiB ({} pages)",
            mib(self.peak_resident_pages),
            self.peak_resident_pages
        );
        let _ = writeln!(
            s,
            "faults          critical {}  zero-fill {}  prefetch-hit {}{}  write-back-hit {}  write-protect {}",
            self.critical_reads,
            self.zero_fills,
            self.prefetch_hits,
            if self.deferred_hits > 0 {
                format!(" ({} left to their completion)", self.deferred_hits)
            } else {
                String::new()
            },
            self.writeback_hits,
            self.wp_faults
        );
        let _ = writeln!(
            s,
            "prefetch        issued {}  installed {}  dropped {}  accuracy {}  coverage {}{}  prefetched share of page-ins {}",
            self.prefetch_issued,
            self.prefetch_installed,
            self.prefetch_dropped,
            pct(self.prefetch_accuracy),
            pct(self.prefetch_coverage),
            if self.prefetch_installed > 0 && self.prefetch_accuracy.is_some() {
                format!(
                    " (from {} of {} samples: used {})",
                    self.prefetch_sample_used + self.prefetch_sample_unused,
                    self.prefetch_sampled,
                    self.prefetch_sample_used
                )
            } else {
                String::new()
            },
            pct(self.prefetched_share)
        );
        if self.prefetch_cut > 0 {
            let _ = writeln!(
                s,
                "                {} pages asked for cut by the prefetch governor (too few sampled prefetches used)",
                self.prefetch_cut
            );
        }
        let _ = writeln!(
            s,
            "eviction        {} pages: {} written, {} clean (no write), {} zero; {} on faulting threads",
            self.evictions,
            self.writebacks - self.cleaned_ahead.min(self.writebacks),
            self.clean_drops,
            self.zero_drops,
            self.direct_reclaims
        );
        if self.victim_kept > 0 {
            let _ = writeln!(
                s,
                "victim tier     {} evicted pages kept in DRAM: {} faulted back from there (no device read), {} left unused",
                self.victim_kept, self.victim_hits, self.victim_dropped
            );
        }
        if self.indirect_learned > 0 {
            let _ = writeln!(
                s,
                "indirect        {} pages read ahead from the index arrays of {} learned instructions",
                self.indirect_prefetched, self.indirect_learned
            );
            let _ = writeln!(
                s,
                "                {} sources forgotten, {} times an instruction was given up on, {} learned ones displaced; {} faults could not read their index array, {} windows stopped short for room",
                self.indirect_forgotten,
                self.indirect_given_up,
                self.indirect_displaced,
                self.indirect_unreadable,
                self.indirect_room_stops
            );
        }
        if self.memory_waits > 0 {
            let _ = writeln!(
                s,
                "memory waits    {} page copies refused by the full cgroup (again for each 20 ms one stayed refused), retried after making room",
                self.memory_waits
            );
        }
        if self.device_memory_refusals > 0 {
            let _ = writeln!(
                s,
                "device memory   {} extensions of the device refused memory by the full cgroup, tried again as reclaim made room",
                self.device_memory_refusals
            );
        }
        if self.no_device_room > 0 {
            let _ = writeln!(
                s,
                "warning         {} write-backs not made: the device's file system had no room; those pages stayed in memory, over the budget",
                self.no_device_room
            );
        }
        if self.cleaned_ahead > 0 {
            let _ = writeln!(s, "cleaning        {} pages written back ahead of eviction", self.cleaned_ahead);
        }
        if self.unmap_calls > 0 {
            let _ = writeln!(
                s,
                "page tables     {} calls changed them for eviction and cleaning (each flushes other CPUs' TLBs), {:.1} evictions per call",
                self.unmap_calls,
                self.evictions as f64 / self.unmap_calls as f64
            );
        }
        if self.spliced_evictions > 0 {
            let _ = writeln!(
                s,
                "                {} of the evictions through a page pipe, a batch a call",
                self.spliced_evictions
            );
        }
        if self.writes_seen_in_page_tables > 0 {
            let _ = writeln!(
                s,
                "writes seen     {} clean pages found written in the page tables (async write protection) and counted as used",
                self.writes_seen_in_page_tables
            );
        }
        if self.stale_entries_dropped > 0 {
            let _ = writeln!(
                s,
                "stale entries   {} replacement entries of pages given back dropped when they came up",
                self.stale_entries_dropped
            );
        }
        if self.unwritten_around > 0 {
            let _ = writeln!(
                s,
                "fault-around    {} pages made writable next to a write were found unwritten and not written back",
                self.unwritten_around
            );
        }
        if self.monitor_reports > 0 {
            let _ = writeln!(
                s,
                "monitor         {} reports ({} hot pages): {} pages read ahead, {} resident pages put first for eviction",
                self.monitor_reports, self.hot_reports, self.monitor_read_ahead, self.cold_listed
            );
        }
        if self.damon_windows > 0 || self.damon_errors > 0 {
            let _ = writeln!(
                s,
                "DAMON           {} windows: {} resident pages found in accessed regions{}",
                self.damon_windows,
                self.damon_pages,
                if self.damon_errors > 0 { " (then it stopped on an error)" } else { "" }
            );
        }
        if self.dropped_outside > 0 {
            let _ = writeln!(
                s,
                "warning         {} resident pages were dropped behind the engine's back (a madvise it did not see); they read as zeros",
                self.dropped_outside
            );
        }
        let read_pages = self.critical_reads + self.prefetch_issued;
        let _ = writeln!(
            s,
            "bytes           in {:.1} MiB  out {:.1} MiB  errors {}{}",
            mib(read_pages),
            mib(self.writebacks),
            self.io_errors,
            self.first_io_error.as_ref().map(|e| format!(" (the first: {e})")).unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "{:<15} {:>9} {:>9} {:>9} {:>9} {:>10}",
            "path", "count", "mean µs", "p50 µs", "p99 µs", "total ms"
        );
        for p in self.paths.iter().filter(|p| p.count > 0) {
            let _ = writeln!(
                s,
                "{:<15} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>10.1}",
                p.path, p.count, p.mean_us, p.p50_us, p.p99_us, p.total_ms
            );
        }
        s
    }

    /// Add another process's counts to these (for a program that ran several managed
    /// processes). Counters and path totals add up; percentiles and maxima take the larger one;
    /// ratios are recomputed where both sides know them; the first device error is the first
    /// process's that had one (in the order merged, not necessarily the earliest).
    pub fn merge(&mut self, other: &StatsSnapshot) {
        let weighted = |a: Option<f64>, wa: u64, b: Option<f64>, wb: u64| match (a, b) {
            (Some(a), Some(b)) if wa + wb > 0 => Some((a * wa as f64 + b * wb as f64) / (wa + wb) as f64),
            (a, b) => a.or(b),
        };
        self.prefetch_accuracy =
            weighted(self.prefetch_accuracy, self.prefetch_issued, other.prefetch_accuracy, other.prefetch_issued);
        let page_ins = |s: &StatsSnapshot| s.critical_reads + s.prefetch_issued;
        self.prefetch_coverage =
            weighted(self.prefetch_coverage, page_ins(self), other.prefetch_coverage, page_ins(other));
        self.prefetched_share =
            weighted(self.prefetched_share, page_ins(self), other.prefetched_share, page_ins(other));
        self.critical_reads += other.critical_reads;
        self.prefetch_issued += other.prefetch_issued;
        self.prefetch_hits += other.prefetch_hits;
        self.deferred_hits += other.deferred_hits;
        self.prefetch_installed += other.prefetch_installed;
        self.prefetch_dropped += other.prefetch_dropped;
        self.prefetch_sampled += other.prefetch_sampled;
        self.prefetch_sample_used += other.prefetch_sample_used;
        self.prefetch_sample_unused += other.prefetch_sample_unused;
        self.prefetch_cut += other.prefetch_cut;
        self.writeback_hits += other.writeback_hits;
        self.zero_fills += other.zero_fills;
        self.wp_faults += other.wp_faults;
        self.evictions += other.evictions;
        self.writebacks += other.writebacks;
        self.cleaned_ahead += other.cleaned_ahead;
        self.clean_drops += other.clean_drops;
        self.zero_drops += other.zero_drops;
        self.direct_reclaims += other.direct_reclaims;
        self.reclaim_wakeups += other.reclaim_wakeups;
        self.unmap_calls += other.unmap_calls;
        self.spliced_evictions += other.spliced_evictions;
        self.memory_waits += other.memory_waits;
        self.no_device_room += other.no_device_room;
        self.device_memory_refusals += other.device_memory_refusals;
        self.io_errors += other.io_errors;
        if self.first_io_error.is_none() {
            self.first_io_error.clone_from(&other.first_io_error);
        }
        self.dropped_outside += other.dropped_outside;
        self.peak_resident_pages = self.peak_resident_pages.max(other.peak_resident_pages);
        self.monitor_reports += other.monitor_reports;
        self.hot_reports += other.hot_reports;
        self.monitor_skipped_faults += other.monitor_skipped_faults;
        self.writes_seen_in_page_tables += other.writes_seen_in_page_tables;
        self.stale_entries_dropped += other.stale_entries_dropped;
        self.unwritten_around += other.unwritten_around;
        self.monitor_read_ahead += other.monitor_read_ahead;
        self.cold_listed += other.cold_listed;
        self.damon_windows += other.damon_windows;
        self.damon_pages += other.damon_pages;
        self.damon_errors += other.damon_errors;
        self.victim_kept += other.victim_kept;
        self.victim_hits += other.victim_hits;
        self.victim_dropped += other.victim_dropped;
        self.indirect_learned += other.indirect_learned;
        self.indirect_prefetched += other.indirect_prefetched;
        self.indirect_forgotten += other.indirect_forgotten;
        self.indirect_given_up += other.indirect_given_up;
        self.indirect_displaced += other.indirect_displaced;
        self.indirect_unreadable += other.indirect_unreadable;
        self.indirect_room_stops += other.indirect_room_stops;
        for theirs in &other.paths {
            match self.paths.iter_mut().find(|p| p.path == theirs.path) {
                Some(mine) => {
                    let count = mine.count + theirs.count;
                    if count > 0 {
                        mine.mean_us =
                            (mine.mean_us * mine.count as f64 + theirs.mean_us * theirs.count as f64) / count as f64;
                    }
                    mine.count = count;
                    mine.total_ms += theirs.total_ms;
                    mine.p50_us = mine.p50_us.max(theirs.p50_us);
                    mine.p99_us = mine.p99_us.max(theirs.p99_us);
                    mine.max_us = mine.max_us.max(theirs.max_us);
                }
                None => self.paths.push(theirs.clone()),
            }
        }
    }

    /// Total time spent on faulting threads (faults + direct reclaim), ms.
    pub fn fault_path_ms(&self) -> f64 {
        self.paths
            .iter()
            .filter(|p| {
                matches!(p.path.as_str(), "critical_fault" | "zero_fault" | "hit_fault" | "wp_fault" | "direct_reclaim")
            })
            .map(|p| p.total_ms)
            .sum()
    }
}
