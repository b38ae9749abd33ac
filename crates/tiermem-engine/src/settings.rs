//! Settings for running an unmodified program: the engine configuration plus what the preload
//! shim needs (device, allocation threshold, where to write statistics), read from and written
//! to `TIERMEM_*` environment variables. `tiermem run` and the shim share this one parser, so a
//! value the shim would refuse is refused before the program starts.

use std::path::PathBuf;

use tiermem_device::DeviceSpec;
use tiermem_sys::{Error, Result};

use crate::config::{parse_size, EngineConfig, FaultMode, Limit};

/// How often a managed process writes a snapshot of its statistics while it runs: what is left
/// of a process that ends without its final report (a signal, `exec`, a raw `exit_group`).
pub const STATISTICS_SNAPSHOT_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// Everything a managed process is told.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// The engine's configuration; its `limit_bytes` is the resolved budget.
    pub engine: EngineConfig,
    /// The budget as given (bytes or a share of the footprint).
    pub limit: Limit,
    /// The program's peak footprint, when known (percent limits and device sizing need it).
    pub footprint: Option<u64>,
    /// Where evicted pages go. A directory gets a private temporary file.
    pub device: DeviceSpec,
    /// Device capacity; by default sized from the footprint or the machine's memory.
    pub device_bytes: Option<u64>,
    /// Allocations of at least this many bytes are managed; smaller ones go to the C library.
    pub threshold: u64,
    /// Directory where each managed process writes `<pid>-<image>.json` statistics at exit, and a
    /// snapshot of them every [`STATISTICS_SNAPSHOT_EVERY`] before that.
    pub stats_dir: Option<PathBuf>,
    /// Keep the budget inside the memory cgroup's room (on unless turned off).
    pub respect_cgroup: bool,
    /// Also guard against the cgroup's OOM killer (`TIERMEM_CGROUP=guard`, cgroup v1): turn it
    /// off while the program runs, so memory tiermem does not manage growing faster than the
    /// budget can follow pauses the program until the engine has made room, instead of
    /// killing it.
    pub oom_guard: bool,
    /// Serve the program's allocations below the threshold from a managed heap too (on unless
    /// turned off), so its small objects page like the rest instead of pinning memory.
    pub small_heap: bool,
    /// Page the writable data of the libraries the program loads (on unless turned off): their
    /// written pages are anonymous memory that, without swap, nothing else can evict.
    pub library_data: bool,
    /// While the program has one thread of its own, the streams it opens skip the stdio locks
    /// that the engine's threads would otherwise switch on (on unless turned off).
    pub single_thread_stdio: bool,
    /// Keep freed large allocations for the next malloc of about the same size, as the C
    /// library keeps freed memory in its heap (on unless turned off).
    pub reuse_freed: bool,
    /// Directory where each managed process records its faults as `<pid>-<image>.trace` (the
    /// simulator's binary format), for `tiermem trace record`.
    pub trace_dir: Option<PathBuf>,
}

/// The variables [`RunSettings::from_vars`] understands, with what each holds.
pub const VARIABLES: &[(&str, &str)] = &[
    ("TIERMEM_LIMIT", "budget of resident managed memory: bytes (2GiB) or a share of the footprint (40%)"),
    ("TIERMEM_FOOTPRINT", "the program's peak footprint in bytes (for percentage limits)"),
    ("TIERMEM_DEVICE", "mem | file:PATH (a file, a block device, or a directory for a temporary file)"),
    ("TIERMEM_DEVICE_SIZE", "device capacity in bytes"),
    ("TIERMEM_PREFETCH", "prefetcher name"),
    ("TIERMEM_REPLACE", "replacement policy name"),
    (
        "TIERMEM_PREFETCH_GOVERNOR",
        "on | off: cap each prefetcher call's pages while few sampled prefetches are used (default on)",
    ),
    ("TIERMEM_WATERMARK", "share of the budget that wakes background reclaim (it cleans from there), in (0, 1] or a percentage"),
    ("TIERMEM_EVICT_WATERMARK", "share of the budget from which background reclaim drops pages, in (0, 1] or a percentage"),
    (
        "TIERMEM_PREFETCH_ROOM",
        "pages background reclaim keeps free for prefetches to land in, at least, lowering the evict watermark where it leaves fewer (never below 90% of the budget; none with TIERMEM_PREFETCH=none), 0..=16384 (default 256; 0: the watermark alone)",
    ),
    ("TIERMEM_FAULT_MODE", "sigbus | thread (default sigbus: faults served on the faulting thread)"),
    ("TIERMEM_IO_MODE", "hybrid | poll-only | interrupt-only"),
    ("TIERMEM_HANDLER_THREADS", "thread fault mode: threads serving faults, 1..=64 (default 1)"),
    (
        "TIERMEM_IO_BUFFERS",
        "most 4 KiB I/O buffers (a small budget gets a 16th of its pages), at least 16 (default 1024)",
    ),
    (
        "TIERMEM_QUEUE_DEPTH",
        "most requests in flight on each io_uring queue (critical, prefetch, write-back), 1..=4096 (default 128)",
    ),
    (
        "TIERMEM_HANDLER_SPIN_US",
        "thread fault mode: microseconds a handler polls for the next fault before sleeping, 0..=10000 (default 0)",
    ),
    ("TIERMEM_RECLAIM_MODE", "background | on-fault-path"),
    (
        "TIERMEM_WRITE_FAULT_AROUND",
        "sync-wp dirty tracking: a write fault unprotects the clean resident pages of its aligned block of this many pages, a power of two 1..=64 (default 1: the page alone)",
    ),
    (
        "TIERMEM_VICTIM_TIER",
        "evicted pages kept in DRAM, unmapped, so a fault there costs a copy, not a device read: a share of the budget (25%) or bytes (16MiB); off or 0 for none (default off)",
    ),
    (
        "TIERMEM_HOT_THRESHOLD",
        "access monitor: read faults that make a page hot in its hot-page table, 1..=64 (default 8)",
    ),
    (
        "TIERMEM_DAMON",
        "on | off: also feed the access monitor from DAMON's physical-memory monitoring (a running paddr kdamond, or one started when none exists; needs root) (default off)",
    ),
    ("TIERMEM_WRITE_RUNS", "on | off: write contiguous dirty pages as one request of up to 32 pages (default off)"),
    ("TIERMEM_EVICT_PIPE", "on | off: async-wp eviction holds a batch of victims in a pipe and drops them with one TLB flush, instead of moving them run by run (default on)"),
    ("TIERMEM_READ_RUNS", "on | off: read prefetched pages in consecutive slots as one request of up to 32 pages (default off)"),
    ("TIERMEM_INDIRECT", "on | off: sigbus fault mode on x86-64: learn which array a faulting instruction's index comes from and read ahead the pages its next elements name (default on)"),
    ("TIERMEM_DEFER_HITS", "on | off: thread fault mode: a fault on a page being prefetched sleeps until it lands instead of the handler spinning (default off)"),
    ("TIERMEM_DIRTY_TRACKING", "auto | sync-wp | none"),
    ("TIERMEM_THRESHOLD", "smallest allocation that is managed, in bytes (default 1MiB)"),
    ("TIERMEM_STATS_DIR", "directory for per-process statistics (<pid>-<image>.json, one per exec image)"),
    (
        "TIERMEM_CGROUP",
        "on | off | guard: keep the budget inside the memory cgroup's room; guard (cgroup v1) also turns the cgroup's OOM killer off while the program runs, so a sudden burst of unmanaged memory pauses it while tiermem shrinks its budget instead of killing it",
    ),
    ("TIERMEM_SMALL_HEAP", "on | off: serve allocations below the threshold from a managed heap (default on)"),
    (
        "TIERMEM_LIBRARY_DATA",
        "on | off: page the pages the libraries the program loads have written, while it has one thread (default on)",
    ),
    (
        "TIERMEM_SINGLE_THREAD_STDIO",
        "on | off: while the program has one thread, its streams skip stdio locks (default on)",
    ),
    ("TIERMEM_REUSE_FREED", "on | off: freed large allocations serve the next malloc of about their size (default on)"),
    ("TIERMEM_TRACE_DIR", "directory where each managed process records its faults (<pid>-<image>.trace)"),
    ("TIERMEM_STATS_JSON", "tiermem run: file for the run's statistics as JSON"),
    ("TIERMEM_TMPDIR", "tiermem run: directory for the temporary device file"),
    ("TIERMEM_PRELOAD_LIB", "tiermem run: path of the preload shim"),
];

/// Variables only `tiermem run` reads; the shim accepts and ignores them.
const RUN_ONLY: &[&str] = &["TIERMEM_STATS_JSON", "TIERMEM_TMPDIR", "TIERMEM_PRELOAD_LIB"];

/// Prefix of variables for tests and tools, which the parser ignores.
const IGNORED_PREFIXES: &[&str] = &["TIERMEM_TEST_", "TIERMEM_BENCH_"];

/// Default smallest managed allocation.
pub const DEFAULT_THRESHOLD: u64 = 1 << 20;

/// How long the handler thread polls for the next fault in sigbus mode unless told otherwise
/// (TIERMEM_HANDLER_SPIN_US). There it serves only the faults of kernel regions (the small-object
/// heap), which come in bursts, and each one that finds it asleep pays two thread wake-ups
/// (19-23 µs each on this VM, `tiermem probe --machine`). A Redis server at 20% served 22% more
/// requests a second with 200 µs (six alternating runs), the quick apps at 60/20% took 4% less
/// time on geometric mean; 30 µs gained little (the server's faults come about 100 µs apart).
/// In thread mode the handler serves every fault, and polling took the CPU the reclaim and
/// completion threads need (5-18% slower at 20% with 30 µs): 0 there.
pub const SIGBUS_HANDLER_SPIN_US: u32 = 200;

impl Default for RunSettings {
    fn default() -> Self {
        // Unmodified programs take faults on their own threads (faster): the shim makes the
        // buffers of the system calls that reach managed memory resident first, which the
        // library's own default (handler threads) does not need from its callers.
        let engine = EngineConfig {
            fault_mode: FaultMode::Sigbus,
            handler_spin_us: SIGBUS_HANDLER_SPIN_US,
            // The registers a SIGBUS brings make index-array gathers predictable (PageRank at
            // 20% of its footprint: 2.6x faster), and nothing else measured changed.
            indirect: true,
            ..EngineConfig::default()
        };
        Self {
            limit: Limit::Bytes(engine.limit_bytes),
            engine,
            footprint: None,
            device: DeviceSpec::File(std::env::temp_dir()),
            device_bytes: None,
            threshold: DEFAULT_THRESHOLD,
            stats_dir: None,
            respect_cgroup: true,
            oom_guard: false,
            small_heap: true,
            library_data: true,
            single_thread_stdio: true,
            reuse_freed: true,
            trace_dir: None,
        }
    }
}

impl RunSettings {
    /// Settings from `TIERMEM_*` variables (others are ignored). Any unknown `TIERMEM_*` name
    /// or bad value is an error that names the variable.
    pub fn from_vars<K: AsRef<str>, V: AsRef<str>>(vars: impl IntoIterator<Item = (K, V)>) -> Result<Self> {
        let mut s = Self::default();
        let mut limit_given = false;
        let mut evict_given = false;
        let mut victim_tier = None;
        let mut spin_given = false;
        // The variables as given, for naming the one behind a range error of the engine's checks.
        let mut given: Vec<(String, String)> = Vec::new();
        for (key, value) in vars {
            let (key, value) = (key.as_ref(), value.as_ref());
            if !key.starts_with("TIERMEM_")
                || IGNORED_PREFIXES.iter().any(|p| key.starts_with(p))
                || RUN_ONLY.contains(&key)
            {
                continue;
            }
            given.push((key.to_string(), value.to_string()));
            let named = |e: Error| e.context(format!("{key}={value}"));
            match key {
                "TIERMEM_LIMIT" => {
                    s.limit = value.parse().map_err(named)?;
                    limit_given = true;
                }
                "TIERMEM_FOOTPRINT" => s.footprint = Some(nonzero_size(value).map_err(named)?),
                "TIERMEM_DEVICE" => s.device = value.parse().map_err(named)?,
                "TIERMEM_DEVICE_SIZE" => {
                    let bytes = nonzero_size(value).map_err(named)?;
                    // A device of a few pages cannot hold what a program pages out: everything
                    // would quietly stay unmanaged.
                    if bytes < MIN_DEVICE_BYTES {
                        return Err(named(Error::invalid(format!(
                            "a device must hold at least {} MiB",
                            MIN_DEVICE_BYTES >> 20
                        ))));
                    }
                    s.device_bytes = Some(bytes);
                }
                "TIERMEM_PREFETCH" => s.engine.prefetch = value.to_string(),
                "TIERMEM_REPLACE" => s.engine.replace = value.to_string(),
                "TIERMEM_PREFETCH_GOVERNOR" => s.engine.prefetch_governor = on_off(value).map_err(named)?,
                "TIERMEM_WATERMARK" => s.engine.watermark = fraction(value, "0.7 or 70%").map_err(named)?,
                "TIERMEM_EVICT_WATERMARK" => {
                    s.engine.evict_watermark = fraction(value, "0.98 or 98%").map_err(named)?;
                    evict_given = true;
                }
                "TIERMEM_FAULT_MODE" => s.engine.fault_mode = value.parse().map_err(named)?,
                "TIERMEM_IO_MODE" => s.engine.io_mode = value.parse().map_err(named)?,
                "TIERMEM_HANDLER_THREADS" => s.engine.handler_threads = whole_number(value, "2").map_err(named)?,
                "TIERMEM_PREFETCH_ROOM" => s.engine.prefetch_room = whole_number(value, "256").map_err(named)?,
                "TIERMEM_IO_BUFFERS" => s.engine.io_buffers = whole_number(value, "256").map_err(named)?,
                "TIERMEM_QUEUE_DEPTH" => s.engine.queue_depth = whole_number(value, "32").map_err(named)?,
                "TIERMEM_HANDLER_SPIN_US" => {
                    s.engine.handler_spin_us = whole_number(value, "30").map_err(named)?;
                    spin_given = true;
                }
                "TIERMEM_RECLAIM_MODE" => s.engine.reclaim_mode = value.parse().map_err(named)?,
                "TIERMEM_WRITE_FAULT_AROUND" => {
                    s.engine.write_fault_around = whole_number(value, "16").map_err(named)?;
                }
                "TIERMEM_HOT_THRESHOLD" => s.engine.hot_threshold = whole_number(value, "8").map_err(named)?,
                "TIERMEM_DIRTY_TRACKING" => s.engine.dirty_tracking = value.parse().map_err(named)?,
                "TIERMEM_THRESHOLD" => s.threshold = nonzero_size(value).map_err(named)?,
                "TIERMEM_STATS_DIR" => s.stats_dir = Some(PathBuf::from(value)),
                "TIERMEM_TRACE_DIR" => s.trace_dir = Some(PathBuf::from(value)),
                "TIERMEM_CGROUP" => {
                    (s.respect_cgroup, s.oom_guard) = match value {
                        "guard" => (true, true),
                        _ => (on_off(value).map_err(|_| named(Error::invalid("expected on, off or guard")))?, false),
                    }
                }
                "TIERMEM_SMALL_HEAP" => s.small_heap = on_off(value).map_err(named)?,
                "TIERMEM_LIBRARY_DATA" => s.library_data = on_off(value).map_err(named)?,
                "TIERMEM_SINGLE_THREAD_STDIO" => s.single_thread_stdio = on_off(value).map_err(named)?,
                "TIERMEM_REUSE_FREED" => s.reuse_freed = on_off(value).map_err(named)?,
                "TIERMEM_WRITE_RUNS" => s.engine.write_runs = on_off(value).map_err(named)?,
                "TIERMEM_EVICT_PIPE" => s.engine.evict_pipe = on_off(value).map_err(named)?,
                "TIERMEM_DAMON" => s.engine.damon = on_off(value).map_err(named)?,
                "TIERMEM_READ_RUNS" => s.engine.read_runs = on_off(value).map_err(named)?,
                "TIERMEM_INDIRECT" => s.engine.indirect = on_off(value).map_err(named)?,
                "TIERMEM_DEFER_HITS" => s.engine.defer_prefetch_hits = on_off(value).map_err(named)?,
                "TIERMEM_VICTIM_TIER" => victim_tier = Some(victim_tier_size(value).map_err(named)?),
                _ => {
                    let known: Vec<&str> = VARIABLES.iter().map(|(k, _)| *k).collect();
                    return Err(Error::invalid(format!(
                        "unknown variable {key}; tiermem understands: {}",
                        known.join(", ")
                    )));
                }
            }
        }
        if !spin_given {
            s.engine.handler_spin_us =
                if s.engine.fault_mode == FaultMode::Sigbus { SIGBUS_HANDLER_SPIN_US } else { 0 };
        }
        // The engine drops pages from max(evict watermark, watermark); an evict watermark given
        // below the watermark would be raised without a word, so it is refused instead.
        // Both watermarks in range first, so this names the one that is wrong, as typed.
        if evict_given
            && s.engine.evict_watermark < s.engine.watermark
            && (0.0..=1.0).contains(&s.engine.watermark)
            && s.engine.evict_watermark > 0.0
        {
            return Err(Error::invalid(format!(
                "TIERMEM_EVICT_WATERMARK={} is below the watermark {} where cleaning starts; pages are dropped \
                 from the higher of the two, so lower the watermark too (--watermark, TIERMEM_WATERMARK)",
                typed(&given, "TIERMEM_EVICT_WATERMARK").unwrap_or_default(),
                s.engine.watermark
            )));
        }
        if !limit_given {
            return Err(Error::invalid(
                "TIERMEM_LIMIT is not set: give the budget (bytes, or a percentage with TIERMEM_FOOTPRINT)",
            ));
        }
        s.engine.limit_bytes = s.limit.resolve(s.footprint).map_err(|e| e.context("TIERMEM_LIMIT"))?;
        if let Some(tier) = victim_tier {
            let bytes = match tier {
                VictimTierSize::Share(percent) => (s.engine.limit_bytes as f64 * percent / 100.0) as u64,
                VictimTierSize::Bytes(bytes) => bytes,
            };
            // The tier comes out of the budget, so a size is held to the cap a share has.
            let most = (s.engine.limit_bytes as f64 * MAX_VICTIM_SHARE) as u64;
            // A limit too small is validate()'s to report.
            if matches!(tier, VictimTierSize::Bytes(_)) && bytes > most && s.engine.limit_pages() >= 16 {
                let given = typed(&given, "TIERMEM_VICTIM_TIER").unwrap_or_default();
                return Err(Error::invalid(format!(
                    "TIERMEM_VICTIM_TIER={given}: a victim tier of {:.2} MiB is more than 90% of the {:.2} MiB \
                     budget it comes out of",
                    bytes as f64 / f64::from(1 << 20),
                    s.engine.limit_bytes as f64 / f64::from(1 << 20)
                )));
            }
            s.engine.victim_pages = u32::try_from(bytes / tiermem_sys::PAGE_SIZE as u64).unwrap_or(u32::MAX);
        }
        s.engine.validate().map_err(|e| name_the_variable(e, &given))?;
        Ok(s)
    }

    /// Settings from this process's environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?))))
    }

    /// The variables that reproduce these settings in another process.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let e = &self.engine;
        let mut vars = vec![
            ("TIERMEM_LIMIT", self.engine.limit_bytes.to_string()),
            ("TIERMEM_DEVICE", self.device.to_string()),
            ("TIERMEM_PREFETCH", e.prefetch.clone()),
            ("TIERMEM_REPLACE", e.replace.clone()),
            ("TIERMEM_PREFETCH_GOVERNOR", if e.prefetch_governor { "on" } else { "off" }.to_string()),
            ("TIERMEM_WATERMARK", e.watermark.to_string()),
            ("TIERMEM_EVICT_WATERMARK", e.evict_watermark.to_string()),
            ("TIERMEM_PREFETCH_ROOM", e.prefetch_room.to_string()),
            ("TIERMEM_FAULT_MODE", e.fault_mode.to_string()),
            ("TIERMEM_IO_MODE", e.io_mode.to_string()),
            ("TIERMEM_HANDLER_THREADS", e.handler_threads.to_string()),
            ("TIERMEM_IO_BUFFERS", e.io_buffers.to_string()),
            ("TIERMEM_QUEUE_DEPTH", e.queue_depth.to_string()),
            ("TIERMEM_HANDLER_SPIN_US", e.handler_spin_us.to_string()),
            ("TIERMEM_WRITE_RUNS", if e.write_runs { "on" } else { "off" }.to_string()),
            ("TIERMEM_EVICT_PIPE", if e.evict_pipe { "on" } else { "off" }.to_string()),
            ("TIERMEM_READ_RUNS", if e.read_runs { "on" } else { "off" }.to_string()),
            ("TIERMEM_INDIRECT", if e.indirect { "on" } else { "off" }.to_string()),
            ("TIERMEM_DEFER_HITS", if e.defer_prefetch_hits { "on" } else { "off" }.to_string()),
            ("TIERMEM_VICTIM_TIER", (u64::from(e.victim_pages) * tiermem_sys::PAGE_SIZE as u64).to_string()),
            ("TIERMEM_RECLAIM_MODE", e.reclaim_mode.to_string()),
            ("TIERMEM_WRITE_FAULT_AROUND", e.write_fault_around.to_string()),
            ("TIERMEM_HOT_THRESHOLD", e.hot_threshold.to_string()),
            ("TIERMEM_DAMON", if e.damon { "on" } else { "off" }.to_string()),
            ("TIERMEM_DIRTY_TRACKING", e.dirty_tracking.to_string()),
            ("TIERMEM_THRESHOLD", self.threshold.to_string()),
            (
                "TIERMEM_CGROUP",
                match (self.respect_cgroup, self.oom_guard) {
                    (true, true) => "guard",
                    (true, false) => "on",
                    (false, _) => "off",
                }
                .to_string(),
            ),
            ("TIERMEM_SMALL_HEAP", if self.small_heap { "on" } else { "off" }.to_string()),
            ("TIERMEM_LIBRARY_DATA", if self.library_data { "on" } else { "off" }.to_string()),
            ("TIERMEM_SINGLE_THREAD_STDIO", if self.single_thread_stdio { "on" } else { "off" }.to_string()),
            ("TIERMEM_REUSE_FREED", if self.reuse_freed { "on" } else { "off" }.to_string()),
        ];
        if let Some(f) = self.footprint {
            vars.push(("TIERMEM_FOOTPRINT", f.to_string()));
        }
        if let Some(d) = self.device_bytes {
            vars.push(("TIERMEM_DEVICE_SIZE", d.to_string()));
        }
        if let Some(dir) = &self.stats_dir {
            vars.push(("TIERMEM_STATS_DIR", dir.display().to_string()));
        }
        if let Some(dir) = &self.trace_dir {
            vars.push(("TIERMEM_TRACE_DIR", dir.display().to_string()));
        }
        vars
    }

    /// Device capacity to create: as given, else room for every managed byte the program may
    /// reserve at once, which can be far more than it touches (GNU sort allocates its whole
    /// buffer up front): the machine's memory or twice the footprint, whichever is larger.
    /// Rounded up to whole pages. Temporary device files are allocated, not written, so a large
    /// capacity costs no time.
    pub fn device_capacity(&self, machine_memory: u64) -> u64 {
        let bytes = self
            .device_bytes
            .unwrap_or_else(|| self.footprint.map_or(machine_memory, |f| f.saturating_mul(2).max(machine_memory)));
        bytes.div_ceil(4096) * 4096
    }
}

/// Parse an `on` / `off` switch (`TIERMEM_*` variables and the CLI flags that mirror them).
pub fn on_off(text: &str) -> Result<bool> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(Error::invalid("expected on or off")),
    }
}

/// How large the victim tier is, as given.
#[derive(Debug, Clone, Copy)]
enum VictimTierSize {
    /// Percent of the budget, in [0, 90].
    Share(f64),
    Bytes(u64),
}

/// Largest share of the budget a victim tier may take.
const MAX_VICTIM_SHARE: f64 = 0.9;

fn victim_tier_size(text: &str) -> Result<VictimTierSize> {
    let t = text.trim();
    if t == "off" {
        return Ok(VictimTierSize::Bytes(0));
    }
    if let Some(p) = t.strip_suffix('%') {
        return match p.trim().parse::<f64>() {
            Ok(p) if (0.0..=MAX_VICTIM_SHARE * 100.0).contains(&p) => Ok(VictimTierSize::Share(p)),
            _ => Err(Error::invalid("a share of the budget must be a number from 0% to 90% (example: 25%)")),
        };
    }
    parse_size(t).map(VictimTierSize::Bytes)
}

fn whole_number<T: std::str::FromStr>(text: &str, example: &str) -> Result<T> {
    let t = text.trim();
    t.parse().map_err(|_| {
        let digits = !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        Error::invalid(if digits {
            format!("{t} is too large (example: {example})")
        } else {
            format!("not a whole number (example: {example})")
        })
    })
}

/// Smallest `TIERMEM_DEVICE_SIZE`.
const MIN_DEVICE_BYTES: u64 = 1 << 20;

fn nonzero_size(text: &str) -> Result<u64> {
    match parse_size(text)? {
        0 => Err(Error::invalid("must be greater than zero")),
        n => Ok(n),
    }
}

/// A share of the budget as a fraction (`0.7`) or a percentage (`70%`); the range is the
/// engine's to check.
fn fraction(value: &str, example: &str) -> Result<f64> {
    let text = value.trim();
    let (number, scale) = match text.strip_suffix('%') {
        Some(percent) => (percent.trim(), 100.0),
        None => (text, 1.0),
    };
    number.parse::<f64>().map(|v| v / scale).map_err(|_| Error::invalid(format!("not a number (example: {example})")))
}

/// The engine's checks name its fields (a C caller sets those); a run names the variable that
/// set the field, `TIERMEM_IO_BUFFERS=8: io_buffers 8 must be in ...`, which `tiermem run` turns
/// into the flag (`--io-buffers=8`).
fn name_the_variable(e: Error, given: &[(String, String)]) -> Error {
    const FIELDS: &[(&str, &str)] = &[
        ("evict watermark ", "TIERMEM_EVICT_WATERMARK"),
        ("watermark ", "TIERMEM_WATERMARK"),
        ("io_buffers ", "TIERMEM_IO_BUFFERS"),
        ("prefetch room ", "TIERMEM_PREFETCH_ROOM"),
        ("victim tier of ", "TIERMEM_VICTIM_TIER"),
        ("queue depth ", "TIERMEM_QUEUE_DEPTH"),
        ("handler threads ", "TIERMEM_HANDLER_THREADS"),
        ("write fault-around ", "TIERMEM_WRITE_FAULT_AROUND"),
        ("handler spin ", "TIERMEM_HANDLER_SPIN_US"),
        ("hot-page threshold ", "TIERMEM_HOT_THRESHOLD"),
        ("limit ", "TIERMEM_LIMIT"),
    ];
    let text = e.to_string();
    let variable = FIELDS.iter().find(|(field, _)| text.starts_with(field)).map(|(_, var)| *var);
    match variable.and_then(|var| Some((var, typed(given, var)?))) {
        Some((key, value)) => e.context(format!("{key}={value}")),
        None => e,
    }
}

/// What was given for variable `key` (the last value, as the settings take the last).
fn typed<'a>(given: &'a [(String, String)], key: &str) -> Option<&'a str> {
    given.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<RunSettings> {
        RunSettings::from_vars(vars.iter().copied())
    }

    #[test]
    fn the_handler_polls_after_a_fault_by_default_only_in_sigbus_mode() {
        let limit = ("TIERMEM_LIMIT", "64MiB");
        assert_eq!(parse(&[limit]).unwrap().engine.handler_spin_us, SIGBUS_HANDLER_SPIN_US);
        assert_eq!(RunSettings::default().engine.handler_spin_us, SIGBUS_HANDLER_SPIN_US);
        assert_eq!(parse(&[limit, ("TIERMEM_FAULT_MODE", "thread")]).unwrap().engine.handler_spin_us, 0);
        let told = parse(&[limit, ("TIERMEM_HANDLER_SPIN_US", "0")]).unwrap();
        assert_eq!(told.engine.handler_spin_us, 0, "a value given is kept, 0 included");
        let told = parse(&[limit, ("TIERMEM_FAULT_MODE", "thread"), ("TIERMEM_HANDLER_SPIN_US", "30")]).unwrap();
        assert_eq!(told.engine.handler_spin_us, 30);
    }

    #[test]
    fn watermarks_take_a_fraction_or_a_percentage() {
        let limit = ("TIERMEM_LIMIT", "64MiB");
        let s = parse(&[limit, ("TIERMEM_WATERMARK", "60%"), ("TIERMEM_EVICT_WATERMARK", " 95 % ")]).unwrap();
        assert!((s.engine.watermark - 0.6).abs() < 1e-12, "{}", s.engine.watermark);
        assert!((s.engine.evict_watermark - 0.95).abs() < 1e-12, "{}", s.engine.evict_watermark);
        let s = parse(&[limit, ("TIERMEM_WATERMARK", "0.5")]).unwrap();
        assert_eq!(s.engine.watermark, 0.5);
    }

    #[test]
    fn round_trips_through_variables() {
        let s = parse(&[
            ("TIERMEM_LIMIT", "40%"),
            ("TIERMEM_FOOTPRINT", "1GiB"),
            ("TIERMEM_DEVICE", "mem"),
            ("TIERMEM_FAULT_MODE", "thread"),
            ("TIERMEM_THRESHOLD", "2MiB"),
            ("TIERMEM_SMALL_HEAP", "off"),
            ("TIERMEM_LIBRARY_DATA", "off"),
            ("TIERMEM_SINGLE_THREAD_STDIO", "off"),
            ("TIERMEM_REUSE_FREED", "off"),
            ("TIERMEM_WRITE_RUNS", "on"),
            ("TIERMEM_EVICT_PIPE", "off"),
            ("TIERMEM_READ_RUNS", "on"),
            ("TIERMEM_INDIRECT", "off"),
            ("TIERMEM_PREFETCH_GOVERNOR", "off"),
            ("TIERMEM_PREFETCH_ROOM", "300"),
            ("TIERMEM_CGROUP", "guard"),
            ("TIERMEM_VICTIM_TIER", "25%"),
            ("PATH", "/bin"),
            ("TIERMEM_TEST_DEVICES", "mem"),
        ])
        .unwrap();
        assert_eq!(s.engine.limit_bytes, (1u64 << 30) * 40 / 100);
        assert_eq!(s.threshold, 2 << 20);
        assert_eq!(s.device, DeviceSpec::Mem);
        let again = RunSettings::from_vars(s.to_vars()).unwrap();
        assert_eq!(again.engine.limit_bytes, s.engine.limit_bytes);
        assert_eq!(s.engine.fault_mode, FaultMode::HandlerThread);
        assert_eq!(again.engine.fault_mode, s.engine.fault_mode);
        assert_eq!(RunSettings::default().engine.fault_mode, FaultMode::Sigbus, "the default of tiermem run");
        assert_eq!(again.threshold, s.threshold);
        assert!(!s.small_heap && !again.small_heap);
        assert!(!s.library_data && !again.library_data);
        assert!(!s.single_thread_stdio && !again.single_thread_stdio);
        assert!(!s.reuse_freed && !again.reuse_freed);
        assert!(s.engine.write_runs && again.engine.write_runs);
        assert!(!s.engine.evict_pipe && !again.engine.evict_pipe);
        assert!(RunSettings::default().engine.evict_pipe, "on by default");
        assert!(s.engine.read_runs && again.engine.read_runs);
        assert!(!s.engine.indirect && !again.engine.indirect);
        assert!(RunSettings::default().engine.indirect, "on by default in tiermem run");
        assert!(!EngineConfig::default().indirect, "off by default for the library");
        assert!(!s.engine.prefetch_governor && !again.engine.prefetch_governor);
        assert!(RunSettings::default().engine.prefetch_governor, "on by default");
        assert_eq!((s.engine.prefetch_room, again.engine.prefetch_room), (300, 300));
        assert!(s.respect_cgroup && s.oom_guard && again.respect_cgroup && again.oom_guard);
        assert_eq!(again.footprint, s.footprint);
        assert_eq!(u64::from(s.engine.victim_pages), s.engine.limit_bytes / 4 / 4096);
        assert_eq!(again.engine.victim_pages, s.engine.victim_pages);
    }

    #[test]
    fn the_victim_tier_is_a_share_of_the_budget_or_bytes() {
        let pages = |value: &str| {
            parse(&[("TIERMEM_LIMIT", "1GiB"), ("TIERMEM_VICTIM_TIER", value)]).unwrap().engine.victim_pages
        };
        assert_eq!(pages("10%"), 26214);
        assert_eq!(pages("16MiB"), 4096);
        assert_eq!(pages("off"), 0);
        assert_eq!(pages("0"), 0);
        assert_eq!(parse(&[("TIERMEM_LIMIT", "1GiB")]).unwrap().engine.victim_pages, 0, "off by default");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[], "TIERMEM_LIMIT is not set"),
            (&[("TIERMEM_LIMIT", "40%")], "footprint"),
            (&[("TIERMEM_LIMIT", "lots")], "TIERMEM_LIMIT=lots"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_THRESHOLD", "0")], "TIERMEM_THRESHOLD=0"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_FAULT_MODE", "fast")], "TIERMEM_FAULT_MODE=fast"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_PREFETCH", "magic")], "magic"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_LIMT", "1G")], "unknown variable TIERMEM_LIMT"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WATERMARK", "1.5")], "watermark"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_EVICT_WATERMARK", "high")], "TIERMEM_EVICT_WATERMARK=high"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_EVICT_WATERMARK", "0.5")], "below the watermark 0.7"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_CGROUP", "maybe")], "TIERMEM_CGROUP=maybe"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_CGROUP", "maybe")], "expected on, off or guard"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_SMALL_HEAP", "yes")], "TIERMEM_SMALL_HEAP=yes"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_LIBRARY_DATA", "maybe")], "TIERMEM_LIBRARY_DATA=maybe"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_SINGLE_THREAD_STDIO", "1")], "TIERMEM_SINGLE_THREAD_STDIO=1"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_REUSE_FREED", "sometimes")], "TIERMEM_REUSE_FREED=sometimes"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HANDLER_THREADS", "two")], "TIERMEM_HANDLER_THREADS=two"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HANDLER_THREADS", "0")], "handler threads 0"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HANDLER_SPIN_US", "-1")], "TIERMEM_HANDLER_SPIN_US=-1"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_IO_BUFFERS", "8")], "io_buffers 8"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_QUEUE_DEPTH", "0")], "queue depth 0"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_QUEUE_DEPTH", "deep")], "TIERMEM_QUEUE_DEPTH=deep"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HANDLER_SPIN_US", "20000")], "handler spin 20000"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HOT_THRESHOLD", "65")], "hot-page threshold 65"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HOT_THRESHOLD", "0")], "hot-page threshold 0"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_DAMON", "sometimes")], "TIERMEM_DAMON=sometimes"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_DEVICE", "floppy")], "TIERMEM_DEVICE=floppy"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_VICTIM_TIER", "95%")], "TIERMEM_VICTIM_TIER=95%"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_VICTIM_TIER", "95%")], "from 0% to 90%"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_VICTIM_TIER", "some")], "TIERMEM_VICTIM_TIER=some"),
            (&[("TIERMEM_LIMIT", "64G"), ("TIERMEM_VICTIM_TIER", "50%")], "victim tier of"),
            (
                &[("TIERMEM_LIMIT", "1G"), ("TIERMEM_VICTIM_TIER", "3G")],
                "TIERMEM_VICTIM_TIER=3G: a victim tier of 3072.00 MiB",
            ),
            // The engine's own range checks name the variable that set the field.
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_IO_BUFFERS", "8")], "TIERMEM_IO_BUFFERS=8: io_buffers 8"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_PREFETCH_ROOM", "lots")], "TIERMEM_PREFETCH_ROOM=lots"),
            (
                &[("TIERMEM_LIMIT", "1G"), ("TIERMEM_PREFETCH_ROOM", "20000")],
                "TIERMEM_PREFETCH_ROOM=20000: prefetch room 20000",
            ),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WATERMARK", "2")], "TIERMEM_WATERMARK=2: watermark 2"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_QUEUE_DEPTH", "0")], "TIERMEM_QUEUE_DEPTH=0: queue depth 0"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_HOT_THRESHOLD", "65")], "TIERMEM_HOT_THRESHOLD=65: hot-page"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WRITE_FAULT_AROUND", "3")], "TIERMEM_WRITE_FAULT_AROUND=3: write"),
            (&[("TIERMEM_LIMIT", "8K")], "TIERMEM_LIMIT=8K: limit 8192 bytes is too small"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WATERMARK", "70%%")], "TIERMEM_WATERMARK=70%%: not a number"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WATERMARK", "170%")], "TIERMEM_WATERMARK=170%: watermark 1.7"),
            (&[("TIERMEM_LIMIT", "1G"), ("TIERMEM_EVICT_WATERMARK", "60%")], "TIERMEM_EVICT_WATERMARK=60% is below"),
            (
                &[("TIERMEM_LIMIT", "1G"), ("TIERMEM_WATERMARK", "150%"), ("TIERMEM_EVICT_WATERMARK", "98%")],
                "TIERMEM_WATERMARK=150%: watermark 1.5",
            ),
        ];
        for (vars, expected) in cases {
            let message = parse(vars).unwrap_err().to_string();
            assert!(message.contains(expected), "{vars:?}: {message}");
        }
    }

    #[test]
    fn device_is_sized_from_the_footprint() {
        let mut s = parse(&[("TIERMEM_LIMIT", "1G")]).unwrap();
        assert_eq!(s.device_capacity(8 << 30), 8 << 30);
        s.footprint = Some(1000 << 20);
        assert_eq!(s.device_capacity(8 << 30), 8 << 30);
        s.footprint = Some(6 << 30);
        assert_eq!(s.device_capacity(8 << 30), 12 << 30);
        s.device_bytes = Some(5000);
        assert_eq!(s.device_capacity(8 << 30), 8192);
    }
}
