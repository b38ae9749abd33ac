//! The `tiermem` command.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tiermem_cli::bench::apps;
use tiermem_cli::bench::array::Phase;
use tiermem_cli::bench::micro;
use tiermem_cli::bench::micro_tiermem::{self, Row, Variant};
use tiermem_engine::EngineConfig;
use tiermem_sys::probe::KernelFeatures;
use tiermem_sys::{Error, ErrorKind, Result};

/// User-space paging with userfaultfd and io_uring.
#[derive(Debug, Parser)]
#[command(name = "tiermem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run an unmodified program with its large allocations in managed memory.
    Run(Box<RunArgs>),
    /// Run a program unmanaged and remember its peak footprint (for `run --limit N%`).
    Profile(ProfileArgs),
    /// Say what this kernel and file system offer tiermem.
    Probe(ProbeArgs),
    /// Run a benchmark.
    Bench(BenchArgs),
    /// Replay a memory trace through prefetchers and replacement policies (the engine's own).
    Sim(tiermem_cli::sim::SimArgs),
    /// Record the page-level trace the engine sees while running a program (for `tiermem sim`).
    Trace(TraceArgs),
    /// Internal: the child process of `bench micro --system linux-swap`.
    #[command(hide = true)]
    MicroWorker(MicroWorkerArgs),
    /// Internal: the child process that times the kernel's fault round trip (`probe --machine`).
    #[command(hide = true, name = tiermem_cli::machine::FAULT_WORKER_COMMAND)]
    FaultRoundTripWorker,
}

#[derive(Debug, Args)]
struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The array microbenchmark: write an N MB array under an M MB memory limit, read it back.
    Micro(MicroArgs),
    /// The application benchmarks (quicksort, k-means, PageRank, Linpack, MLP, IS) against Linux swap.
    Apps(apps::AppsArgs),
    /// `tiermem sim` beside libCacheSim on one trace: LRU and FIFO faults checked equal, speeds
    /// side by side (bench/tiermem_bench/sim_anchor.py; `--help` lists its options).
    SimAnchor(apps::AppsArgs),
    /// Internal: run a program in a fresh memory cgroup (for `bench apps`).
    #[command(hide = true)]
    LimitedRun(apps::LimitedRunArgs),
}

#[derive(Debug, Args)]
struct ProbeArgs {
    /// Directory whose file system would hold a device file.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Also measure the device's own 4 KiB read latency there: single reads through a polled
    /// queue of a 64 MiB temporary device file (written first, deleted after), the floor of a
    /// critical fault.
    #[arg(long)]
    latency: bool,
    /// Also describe the machine (CPUs, hypervisor, idle polling, free page reporting to the
    /// host, THP, swap, DAMON) and measure what paging pays on it: a TLB shootdown, a thread
    /// wake-up across CPUs, the kernel's mapping of a page, and a fault served on the faulting
    /// thread with nothing but the kernel's work in it (under a second).
    #[arg(long)]
    machine: bool,
}

/// Reads timed by `tiermem probe --latency`.
const PROBE_LATENCY_READS: u32 = 2000;
/// Reads in flight for `probe --latency`'s request rate: depth 32 is where this VM's disk
/// reaches its rate (fio: 135k 4 KiB reads a second at 32, 24k at 1).
const PROBE_RATE_DEPTH: u32 = 32;
/// Reads timed for that rate (a fraction of a second on this disk).
const PROBE_RATE_READS: u32 = 20_000;

#[derive(Debug, Args)]
struct MicroArgs {
    /// Which pagers to measure, side by side in this run (repeat or separate with commas).
    #[arg(long = "system", value_enum, value_delimiter = ',', default_values_t = MicroSystem::ALL)]
    systems: Vec<MicroSystem>,
    /// How tiermem takes faults.
    #[arg(long, default_value = "sigbus", env = "TIERMEM_FAULT_MODE")]
    fault_mode: String,
    #[command(flatten)]
    policy: PolicyArgs,
    /// How tiermem notices writes: auto, sync-wp, async-wp, none.
    #[arg(long, default_value = "auto", env = "TIERMEM_DIRTY_TRACKING")]
    dirty_tracking: String,
    /// on | off: tiermem reads prefetched pages in consecutive slots as one request (default off).
    #[arg(long, env = "TIERMEM_READ_RUNS")]
    read_runs: Option<String>,
    /// on | off: tiermem writes contiguous dirty pages as one request (default off).
    #[arg(long, env = "TIERMEM_WRITE_RUNS")]
    write_runs: Option<String>,
    /// Array size in MiB.
    #[arg(long, default_value_t = 100)]
    size_mb: u64,
    /// Memory limit in MiB (must be smaller than the array).
    #[arg(long, default_value_t = 50)]
    limit_mb: u64,
    /// Directory on the file system to page to (the swap file goes here). Default: the temp dir.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print the full result as JSON instead of the summary.
    #[arg(long)]
    json: bool,
}

/// The engine's policies, as `tiermem run` and `tiermem bench micro` take them.
#[derive(Debug, Args)]
struct PolicyArgs {
    /// Prefetcher [default: the engine's].
    #[arg(long, env = "TIERMEM_PREFETCH")]
    prefetch: Option<String>,
    /// Replacement policy [default: the engine's].
    #[arg(long, env = "TIERMEM_REPLACE")]
    replace: Option<String>,
    /// on | off: cap the pages each prefetcher call reads while few of the sampled prefetched
    /// pages are used [default: on].
    #[arg(long, env = "TIERMEM_PREFETCH_GOVERNOR")]
    prefetch_governor: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum MicroSystem {
    /// The kernel's own swap, to a swap file, under a memory cgroup limit.
    LinuxSwap,
    /// tiermem on a device file: the Ultraswap I/O path.
    TiermemFile,
    /// tiermem on a device file, every request polled.
    TiermemFilePollOnly,
    /// tiermem on a device file, every request completion-driven.
    TiermemFileInterruptOnly,
    /// tiermem on DRAM: the ideal.
    TiermemMem,
}

impl MicroSystem {
    const ALL: [MicroSystem; 5] = [
        MicroSystem::LinuxSwap,
        MicroSystem::TiermemFile,
        MicroSystem::TiermemFilePollOnly,
        MicroSystem::TiermemFileInterruptOnly,
        MicroSystem::TiermemMem,
    ];

    fn variant(self) -> Option<Variant> {
        match self {
            MicroSystem::LinuxSwap => None,
            MicroSystem::TiermemFile => Some(Variant::File),
            MicroSystem::TiermemFilePollOnly => Some(Variant::FilePollOnly),
            MicroSystem::TiermemFileInterruptOnly => Some(Variant::FileInterruptOnly),
            MicroSystem::TiermemMem => Some(Variant::Mem),
        }
    }
}

impl std::fmt::Display for MicroSystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
        f.write_str(&name)
    }
}

#[derive(Debug, Args)]
struct MicroWorkerArgs {
    /// Array size in MiB.
    #[arg(long)]
    size_mb: u64,
}

fn bench_micro(args: &MicroArgs) -> Result<()> {
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    micro::validate_micro_args(args.size_mb, args.limit_mb, &dir)?;
    let mut base = EngineConfig {
        fault_mode: args.fault_mode.parse()?,
        dirty_tracking: args.dirty_tracking.parse()?,
        ..EngineConfig::default()
    };
    if let Some(p) = &args.policy.prefetch {
        base.prefetch = p.clone();
    }
    if let Some(r) = &args.policy.replace {
        base.replace = r.clone();
    }
    let on_off = |flag: &str, value: &Option<String>, default: bool| match value.as_deref() {
        None => Ok(default),
        Some(text) => tiermem_engine::settings::on_off(text)
            .map_err(|e| Error::new(ErrorKind::InvalidInput, format!("{flag} '{text}': {e}"))),
    };
    base.read_runs = on_off("--read-runs", &args.read_runs, base.read_runs)?;
    base.write_runs = on_off("--write-runs", &args.write_runs, base.write_runs)?;
    base.prefetch_governor = on_off("--prefetch-governor", &args.policy.prefetch_governor, base.prefetch_governor)?;
    // Bad policy names fail here, before any system runs.
    tiermem_engine::policy::build_policies(&base.prefetch, &base.replace, 1, &Default::default())?;
    let command: Vec<String> = std::env::args().collect();
    let _machine = tiermem_cli::bench::exclusive::machine_to_ourselves(&command.join(" "))?;
    let mut rows = Vec::new();
    let mut details = Vec::new();
    for &system in &args.systems {
        let name = system.to_string();
        let bar = progress_bar(&name, args.size_mb);
        let report = |phase: Phase, pages: usize| {
            bar.set_message(format!("{name} {phase:?}"));
            bar.set_position(pages as u64 + if phase == Phase::Read { args.size_mb * 256 } else { 0 });
        };
        let outcome = match system.variant() {
            None => {
                let worker = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable"))?;
                micro::linux_swap_point_with_worker(args.size_mb, args.limit_mb, &dir, &worker).map(|point| {
                    rows.push(Row::new(&name, &point.array, None));
                    details.push(serde_json::json!({"system": name, "linux_swap": point}));
                })
            }
            Some(variant) => {
                micro_tiermem::tiermem_point(variant, args.size_mb, args.limit_mb, &dir, &base, Some(&report)).map(
                    |point| {
                        rows.push(Row::new(&name, &point.array, Some(&point.stats)));
                        details.push(serde_json::json!({"system": name, "tiermem": point}));
                    },
                )
            }
        };
        bar.finish_and_clear();
        if let Err(e) = outcome {
            // One system failing (no root for swapon, say) must not hide the others.
            eprintln!("{name}: SKIPPED: {e}");
        }
    }
    let device_us = if args.systems.iter().any(|s| !matches!(s, MicroSystem::TiermemMem | MicroSystem::LinuxSwap)) {
        micro_tiermem::device_read_latency_us(&dir, 5000).ok()
    } else {
        None
    };
    // Only when a critical fault was timed (the floor means nothing without one); the round
    // trip only where faults were served on the faulting thread.
    let timed_critical = rows.iter().any(|r| r.critical_fault_us.is_some());
    let floor = micro_tiermem::KernelFloor {
        page_map_us: if timed_critical { micro_tiermem::page_map_latency_us(8192).ok() } else { None },
        // The same copy from a buffer the device has just filled, as a critical fault on a
        // device file maps it.
        page_map_after_read_us: if timed_critical && device_us.is_some() {
            noted(micro_tiermem::page_map_after_read_us(&dir, 2000), "the copy from a buffer just read")
        } else {
            None
        },
        fault_round_trip: if timed_critical && base.fault_mode == tiermem_engine::FaultMode::Sigbus {
            let worker = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable"));
            noted(worker.and_then(|w| tiermem_cli::machine::fault_round_trip_in_worker(&w)), "the fault round trip")
        } else {
            None
        },
    };
    if args.json {
        let all = serde_json::json!({"size_mb": args.size_mb, "limit_mb": args.limit_mb, "device_read_us": device_us,
            "page_map_us": floor.page_map_us, "page_map_after_read_us": floor.page_map_after_read_us,
            "fault_round_trip": floor.fault_round_trip, "rows": rows, "details": details});
        println!("{all}");
    } else {
        print!("{}", micro_tiermem::format_table(&rows, args.size_mb, args.limit_mb, device_us, &floor));
    }
    if rows.iter().any(|r| r.mismatched_pages > 0) {
        return Err(Error::new(ErrorKind::Internal, "some pages read back wrong: see the table"));
    }
    if rows.is_empty() {
        return Err(Error::new(ErrorKind::Unsupported, "no system could be measured"));
    }
    Ok(())
}

/// A figure measured after the runs, or None with a note on stderr saying why not (the table
/// is worth printing without it).
fn noted<T>(figure: Result<T>, what: &str) -> Option<T> {
    figure.map_err(|e| eprintln!("tiermem: note: {what} was not measured: {e}")).ok()
}

fn progress_bar(name: &str, size_mb: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(size_mb * 256 * 2);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:32} [{bar:40}] {pos}/{len} pages")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(name.to_string());
    bar
}

fn probe(args: &ProbeArgs) -> Result<()> {
    let features = KernelFeatures::probe();
    if let Some(dir) = &args.dir {
        // A --dir given by the user must be one: the device line's "not writable" would hide a typo.
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(Error::invalid(format!("--dir {}: not a directory", dir.display()))),
            Err(e) => return Err(Error::os(e, format!("--dir {}", dir.display()))),
        }
    }
    let dir = args.dir.clone().unwrap_or_else(std::env::temp_dir);
    let device = tempfile::tempfile_in(&dir).ok().and_then(|_| {
        let path = dir.join(format!(".tiermem-probe-{}", std::process::id()));
        let d = tiermem_device::DeviceSpec::File(path.clone()).open(16 << 20);
        let _ = std::fs::remove_file(&path);
        d.map(|d| d.describe()).map_err(|e| e.to_string()).into()
    });
    // Measured only where a device file works: otherwise the device line says why not.
    let (latency_us, reads_per_s) = match (&device, args.latency) {
        (Some(Ok(_)), true) => (
            Some(micro_tiermem::device_read_latency_us(&dir, PROBE_LATENCY_READS)?),
            Some(micro_tiermem::device_read_rate(&dir, PROBE_RATE_DEPTH, PROBE_RATE_READS)?),
        ),
        _ => (None, None),
    };
    let machine = if args.machine {
        let worker = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable"))?;
        Some((tiermem_cli::machine::facts(), tiermem_cli::machine::costs(Some(&worker))?))
    } else {
        None
    };
    if args.json {
        let mut out = serde_json::json!({
            "kernel": features,
            "device": device.map(|d: std::result::Result<String, String>| d.unwrap_or_else(|e| e)),
            "device_read_latency_us": latency_us,
            "device_read_rate": reads_per_s.map(|per_s| serde_json::json!({
                "depth": PROBE_RATE_DEPTH,
                "reads_per_s": per_s,
            })),
        });
        if let Some((facts, costs)) = &machine {
            out["machine"] = serde_json::json!(facts);
            out["costs"] = serde_json::json!(costs);
        }
        println!("{out}");
    } else {
        print_probe(&features, device, &dir, latency_us, reads_per_s);
        if let Some((facts, costs)) = &machine {
            for line in tiermem_cli::machine::summary_lines(facts, costs) {
                println!("{line}");
            }
        }
    }
    if args.latency && latency_us.is_none() {
        // Asked for and not measurable: the device line says why; the exit status must too.
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("--latency: no usable device file in {}", dir.display()),
        ));
    }
    Ok(())
}

fn print_probe(
    features: &KernelFeatures,
    device: Option<std::result::Result<String, String>>,
    dir: &std::path::Path,
    latency_us: Option<f64>,
    reads_per_s: Option<f64>,
) {
    for line in features.summary_lines() {
        println!("{line}");
    }
    match device {
        Some(Ok(d)) => println!("device file     {d}"),
        Some(Err(e)) => println!("device file     unusable in {}: {e}", dir.display()),
        None => println!("device file     {} is not writable", dir.display()),
    }
    if let Some(us) = latency_us {
        println!(
            "device latency  {us:.1} µs per 4 KiB read (polled, one at a time, mean of {PROBE_LATENCY_READS}) in {}",
            dir.display()
        );
    }
    if let Some(per_s) = reads_per_s {
        println!(
            "device rate     {:.1}k 4 KiB reads a second with {PROBE_RATE_DEPTH} in flight ({PROBE_RATE_READS} random reads)",
            per_s / 1000.0
        );
    }
}

fn fault_round_trip_worker() -> Result<()> {
    let trip = tiermem_cli::machine::measure_fault_round_trip(tiermem_cli::machine::ROUND_TRIP_FAULTS)?;
    let json = serde_json::to_string(&trip).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    println!("{json}");
    Ok(())
}

fn micro_worker(args: &MicroWorkerArgs) -> Result<()> {
    let result = micro::run_micro_worker(args.size_mb)?;
    let json = serde_json::to_string(&result).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    println!("{json}");
    Ok(())
}

/// Every option also reads the `TIERMEM_*` variable named in its help; flags win.
#[derive(Debug, Args)]
struct RunArgs {
    /// Budget of resident managed memory: bytes (2GiB, 512MiB) or a share of the footprint (40%).
    #[arg(long, env = "TIERMEM_LIMIT")]
    limit: String,
    /// The program's peak footprint (default: what `tiermem profile` measured for this command).
    #[arg(long, env = "TIERMEM_FOOTPRINT")]
    footprint: Option<String>,
    /// mem | file:PATH (a file, a block device, or a directory for a temporary file).
    /// Default: a temporary file on the first disk file system of /var/tmp, $TMPDIR, /tmp.
    #[arg(long, env = "TIERMEM_DEVICE")]
    device: Option<String>,
    /// Device capacity (default: twice the footprint, else the machine's memory).
    #[arg(long, env = "TIERMEM_DEVICE_SIZE")]
    device_size: Option<String>,
    #[command(flatten)]
    policy: PolicyArgs,
    /// Share of the budget that wakes background reclaim (0.7 or 70%); from there it writes cold
    /// pages back ahead of eviction [default: 0.7].
    #[arg(long, env = "TIERMEM_WATERMARK")]
    watermark: Option<String>,
    /// Share of the budget from which background reclaim drops pages (0.98 or 98%) [default: 0.98].
    #[arg(long, env = "TIERMEM_EVICT_WATERMARK")]
    evict_watermark: Option<String>,
    /// Pages background reclaim keeps free for prefetches to land in, at least: it drops from
    /// below the evict watermark where that leaves fewer, never below 90% of the budget, none
    /// with --prefetch none (0..=16384; 0: the watermark alone) [default: 256].
    #[arg(long, env = "TIERMEM_PREFETCH_ROOM")]
    prefetch_room: Option<String>,
    /// sigbus (faults served on the faulting thread) | thread (by a handler thread) [default: sigbus].
    #[arg(long, env = "TIERMEM_FAULT_MODE")]
    fault_mode: Option<String>,
    /// hybrid | poll-only | interrupt-only.
    #[arg(long, env = "TIERMEM_IO_MODE")]
    io_mode: Option<String>,
    /// thread fault mode: threads serving faults, 1..=64 [default: 1].
    #[arg(long, env = "TIERMEM_HANDLER_THREADS")]
    handler_threads: Option<String>,
    /// Most 4 KiB I/O buffers shared by all queues; a budget of fewer than 64 times as many
    /// pages gets a 64th of it (at least 256) [default: 1024].
    #[arg(long, env = "TIERMEM_IO_BUFFERS")]
    io_buffers: Option<String>,
    /// Keep evicted pages in DRAM, unmapped, so a fault on one soon after costs a copy instead
    /// of a device read and tells replacement it is in use: a share of the budget (25%) or bytes
    /// (16MiB). Its memory comes on top of the budget; inside a memory cgroup the budget makes
    /// room for it [default: off].
    #[arg(long, env = "TIERMEM_VICTIM_TIER")]
    victim_tier: Option<String>,
    /// Most requests in flight on each io_uring queue (critical, prefetch, write-back), 1..=4096
    /// [default: 128].
    #[arg(long, env = "TIERMEM_QUEUE_DEPTH")]
    queue_depth: Option<String>,
    /// Microseconds a handler thread keeps polling for the next fault before it sleeps,
    /// 0..=10000 [default: 200 in sigbus mode, where it serves only the small-object heap's
    /// faults; 0 in thread mode].
    #[arg(long, env = "TIERMEM_HANDLER_SPIN_US")]
    handler_spin_us: Option<String>,
    /// background | on-fault-path.
    #[arg(long, env = "TIERMEM_RECLAIM_MODE")]
    reclaim_mode: Option<String>,
    /// sync-wp dirty tracking: a write fault unprotects the clean resident pages of its aligned
    /// block of this many pages too (written back later only if they changed), a power of two
    /// 1..=64 [default: 1].
    #[arg(long, env = "TIERMEM_WRITE_FAULT_AROUND")]
    write_fault_around: Option<String>,
    /// Access monitor: read faults that make a page hot in its hot-page table (kept, or read
    /// back if evicted), 1..=64 [default: 8].
    #[arg(long, env = "TIERMEM_HOT_THRESHOLD")]
    hot_threshold: Option<String>,
    /// on | off: also feed the access monitor from DAMON's monitoring of physical memory: pages
    /// in regions it finds accessed are reported hot (needs root) [default: off].
    #[arg(long, env = "TIERMEM_DAMON")]
    damon: Option<String>,
    /// on | off: write address-contiguous dirty pages of a reclaim batch as one request of up
    /// to 32 pages to consecutive slots [default: off].
    #[arg(long, env = "TIERMEM_WRITE_RUNS")]
    write_runs: Option<String>,
    /// on | off: under async write protection, hold a batch of victims in a pipe and drop them
    /// with one call, one TLB flush for the batch, instead of moving them out run by run with
    /// UFFDIO_MOVE [default: on].
    #[arg(long, env = "TIERMEM_EVICT_PIPE")]
    evict_pipe: Option<String>,
    /// on | off: read the prefetcher's pages that sit in consecutive slots as one request of
    /// up to 32 pages [default: off].
    #[arg(long, env = "TIERMEM_READ_RUNS")]
    read_runs: Option<String>,
    /// on | off: sigbus fault mode on x86-64: learn which array a faulting instruction's index
    /// was read from (`data[index[i]]`) and read ahead the pages the next elements of that
    /// array name [default: on].
    #[arg(long, env = "TIERMEM_INDIRECT")]
    indirect: Option<String>,
    /// on | off: thread fault mode: a fault on a page whose prefetch is in flight sleeps until
    /// the page lands instead of the handler spinning for it [default: off].
    #[arg(long, env = "TIERMEM_DEFER_HITS")]
    defer_hits: Option<String>,
    /// auto | sync-wp | async-wp | none (auto: async-wp where the kernel has it).
    #[arg(long, env = "TIERMEM_DIRTY_TRACKING")]
    dirty_tracking: Option<String>,
    /// Smallest allocation that is managed.
    #[arg(long, env = "TIERMEM_THRESHOLD")]
    threshold: Option<String>,
    /// on | off | guard: keep the budget inside the memory cgroup's room [default: on]. guard
    /// (cgroup v1): also turn the cgroup's OOM killer off while the program runs, so a sudden
    /// burst of memory tiermem does not manage pauses the program while tiermem shrinks its
    /// budget, instead of killing it (the killer is back on when the program ends, and at once
    /// if tiermem has nothing left to give). With on or guard, `tiermem run` started in a v1
    /// cgroup that sets a memory limit moves itself to the parent cgroup and runs the program
    /// in the limited one, so the limit holds the program and the engine inside it, not the
    /// launcher.
    #[arg(long, env = "TIERMEM_CGROUP")]
    cgroup: Option<String>,
    /// on | off: serve allocations below the threshold from a managed heap [default: on].
    #[arg(long, env = "TIERMEM_SMALL_HEAP")]
    small_heap: Option<String>,
    /// on | off: while the program has one thread of its own, the pages the libraries it loads
    /// have written (their data, relocations) are paged too instead of pinning memory; given
    /// back to the kernel when it starts a thread or calls dlclose [default: on].
    #[arg(long, env = "TIERMEM_LIBRARY_DATA")]
    library_data: Option<String>,
    /// on | off: while the program has one thread, the streams it opens skip the stdio locks
    /// the engine's threads would otherwise switch on [default: on].
    #[arg(long, env = "TIERMEM_SINGLE_THREAD_STDIO")]
    single_thread_stdio: Option<String>,
    /// on | off: a freed large allocation serves the next malloc of about its size instead of
    /// a fresh region, which would take a first-touch fault per 64 pages [default: on].
    #[arg(long, env = "TIERMEM_REUSE_FREED")]
    reuse_freed: Option<String>,
    /// Write the run's statistics as JSON to this file: the counts summed over the managed
    /// processes (`merged`), each process's report (`processes`; `"final": false` marks a
    /// snapshot, left by a process killed outright, which writes one every 2 s), and how many
    /// ended before writing any (`unreported_processes`).
    #[arg(long, env = "TIERMEM_STATS_JSON")]
    stats_json: Option<PathBuf>,
    /// No summary at exit.
    #[arg(long)]
    quiet: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    program: Vec<std::ffi::OsString>,
}

#[derive(Debug, Args)]
struct TraceArgs {
    #[command(subcommand)]
    command: TraceCommand,
}

#[derive(Debug, Subcommand)]
enum TraceCommand {
    /// Run a program as `tiermem run` does and record every fault and write fault of each
    /// managed process in the simulator's binary trace format.
    Record(Box<TraceRecordArgs>),
    /// Say what a trace holds: events by kind, footprint, how its accesses follow each other.
    Info(tiermem_cli::trace_info::TraceInfoArgs),
}

#[derive(Debug, Args)]
struct TraceRecordArgs {
    /// Where the trace goes (other processes' traces go to FILE.<pid>, an image a process exec'ed after its first to FILE.<pid>-<n>).
    #[arg(long, short)]
    output: PathBuf,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Args)]
struct ProfileArgs {
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    program: Vec<std::ffi::OsString>,
}

/// Fail before the program runs if `path` (given with `option`) cannot be written afterwards:
/// the program's own status would otherwise be lost behind a late error.
fn check_output_path(option: &str, path: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let shown = path.display();
    if path.is_dir() {
        return Err(Error::invalid(format!("{option} {shown}: is a directory; name a file")));
    }
    if path.exists() {
        // Non-blocking: a FIFO nobody reads yet would otherwise hold us here.
        return std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map(drop)
            .map_err(|e| Error::os(e, format!("{option} {shown}: cannot write it")));
    }
    let created = std::fs::OpenOptions::new().write(true).create_new(true).open(path);
    match created {
        Ok(_) => {
            std::fs::remove_file(path).map_err(|e| Error::os(e, format!("{option} {shown}: removing the test file")))
        }
        Err(e) => Err(Error::os(e, format!("{option} {shown}: cannot create it"))),
    }
}

fn trace_record(args: &TraceRecordArgs) -> Result<std::convert::Infallible> {
    check_output_path("-o", &args.output)?;
    if let Some(path) = &args.run.stats_json {
        check_output_path("--stats-json", path)?;
    }
    let settings = tiermem_cli::run::resolve_settings(std::env::vars(), &run_flags(&args.run), &args.run.program)?;
    let (outcome, written) = tiermem_cli::run::record_trace(settings, &args.run.program, &args.output)?;
    report_outcome(&args.run, &outcome)?;
    if written.is_empty() {
        tiermem_cli::say("tiermem: no trace: the program made no allocation above the threshold");
    }
    for path in &written {
        tiermem_cli::say(&format!("tiermem: trace written to {}", path.display()));
    }
    tiermem_cli::run::exit_like(outcome.ending)
}

fn run_flags(args: &RunArgs) -> Vec<(&'static str, String)> {
    let mut flags: Vec<(&str, String)> = vec![("TIERMEM_LIMIT", args.limit.clone())];
    let optional = [
        ("TIERMEM_FOOTPRINT", &args.footprint),
        ("TIERMEM_DEVICE", &args.device),
        ("TIERMEM_DEVICE_SIZE", &args.device_size),
        ("TIERMEM_PREFETCH", &args.policy.prefetch),
        ("TIERMEM_REPLACE", &args.policy.replace),
        ("TIERMEM_PREFETCH_GOVERNOR", &args.policy.prefetch_governor),
        ("TIERMEM_WATERMARK", &args.watermark),
        ("TIERMEM_EVICT_WATERMARK", &args.evict_watermark),
        ("TIERMEM_PREFETCH_ROOM", &args.prefetch_room),
        ("TIERMEM_FAULT_MODE", &args.fault_mode),
        ("TIERMEM_IO_MODE", &args.io_mode),
        ("TIERMEM_HANDLER_THREADS", &args.handler_threads),
        ("TIERMEM_HANDLER_SPIN_US", &args.handler_spin_us),
        ("TIERMEM_IO_BUFFERS", &args.io_buffers),
        ("TIERMEM_VICTIM_TIER", &args.victim_tier),
        ("TIERMEM_QUEUE_DEPTH", &args.queue_depth),
        ("TIERMEM_WRITE_RUNS", &args.write_runs),
        ("TIERMEM_EVICT_PIPE", &args.evict_pipe),
        ("TIERMEM_READ_RUNS", &args.read_runs),
        ("TIERMEM_DEFER_HITS", &args.defer_hits),
        ("TIERMEM_INDIRECT", &args.indirect),
        ("TIERMEM_RECLAIM_MODE", &args.reclaim_mode),
        ("TIERMEM_WRITE_FAULT_AROUND", &args.write_fault_around),
        ("TIERMEM_HOT_THRESHOLD", &args.hot_threshold),
        ("TIERMEM_DAMON", &args.damon),
        ("TIERMEM_DIRTY_TRACKING", &args.dirty_tracking),
        ("TIERMEM_THRESHOLD", &args.threshold),
        ("TIERMEM_CGROUP", &args.cgroup),
        ("TIERMEM_SMALL_HEAP", &args.small_heap),
        ("TIERMEM_LIBRARY_DATA", &args.library_data),
        ("TIERMEM_SINGLE_THREAD_STDIO", &args.single_thread_stdio),
        ("TIERMEM_REUSE_FREED", &args.reuse_freed),
    ];
    flags.extend(optional.into_iter().filter_map(|(k, v)| v.clone().map(|v| (k, v))));
    flags
}

fn run_command(args: &RunArgs) -> Result<std::convert::Infallible> {
    if let Some(path) = &args.stats_json {
        check_output_path("--stats-json", path)?;
    }
    let flags = run_flags(args);
    let settings = tiermem_cli::run::resolve_settings(std::env::vars(), &flags, &args.program)?;
    let outcome = tiermem_cli::run::run(settings, &args.program)?;
    report_outcome(args, &outcome)?;
    tiermem_cli::run::exit_like(outcome.ending)
}

/// The summary on stderr (unless `--quiet`) and the statistics as JSON (`--stats-json`).
fn report_outcome(args: &RunArgs, outcome: &tiermem_cli::run::RunOutcome) -> Result<()> {
    if !args.quiet {
        // A reader gone from stderr (`tiermem run ... 2>&1 | head`) must not turn the program's
        // exit status into tiermem's abort.
        let _ = std::io::Write::write_all(&mut std::io::stderr(), outcome.summary().as_bytes());
    }
    if let Some(path) = &args.stats_json {
        let text = serde_json::to_string_pretty(&outcome.to_json())
            .map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
        std::fs::write(path, text).map_err(|e| Error::os(e, format!("writing statistics to {}", path.display())))?;
    }
    Ok(())
}

fn profile_command(args: &ProfileArgs) -> Result<std::convert::Infallible> {
    let (ending, footprint) = tiermem_cli::run::profile(&args.program)?;
    eprintln!(
        "tiermem: peak footprint {footprint} bytes ({:.1} MiB){}",
        footprint as f64 / (1 << 20) as f64,
        if ending == tiermem_cli::run::Ending::Exited(0) {
            format!(", remembered in {}", tiermem_cli::run::profile_store().display())
        } else {
            " (not remembered: the program failed)".to_string()
        }
    );
    tiermem_cli::run::exit_like(ending)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Probe(_) | Command::Sim(_)) {
        // Commands that only print end quietly when their reader goes away (`tiermem probe |
        // head`), as other tools do, instead of panicking on EPIPE. Not the others: they have
        // swap files, cgroups or a program to clean up after.
        // SAFETY: setting a signal's disposition before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let outcome = match &cli.command {
        Command::Run(args) => run_command(args).map(|never| match never {}),
        Command::Profile(args) => profile_command(args).map(|never| match never {}),
        Command::Probe(args) => probe(args),
        Command::Bench(BenchArgs { command: BenchCommand::Micro(args) }) => bench_micro(args),
        Command::Bench(BenchArgs { command: BenchCommand::Apps(args) }) => {
            Err(apps::exec_harness(apps::APPS_MODULE, args))
        }
        Command::Bench(BenchArgs { command: BenchCommand::SimAnchor(args) }) => {
            Err(apps::exec_harness(apps::SIM_ANCHOR_MODULE, args))
        }
        Command::Bench(BenchArgs { command: BenchCommand::LimitedRun(args) }) => {
            apps::limited_run(args).and_then(|report| apps::write_report(&report, args.result.as_deref()))
        }
        Command::MicroWorker(args) => micro_worker(args),
        Command::FaultRoundTripWorker => fault_round_trip_worker(),
        Command::Sim(args) => tiermem_cli::sim::run(args),
        Command::Trace(TraceArgs { command: TraceCommand::Record(args) }) => {
            trace_record(args).map(|never| match never {})
        }
        Command::Trace(TraceArgs { command: TraceCommand::Info(args) }) => tiermem_cli::trace_info::run(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tiermem: error: {e}");
            // 2 for bad arguments, like clap's own usage errors; a program that cannot be
            // started ends as a shell reports it: 127 when not found, 126 otherwise.
            let starting = e.to_string().starts_with(tiermem_cli::run::CANNOT_START);
            ExitCode::from(match e.kind() {
                ErrorKind::NotFound if starting => 127,
                _ if starting => 126,
                ErrorKind::InvalidInput => 2,
                _ => 1,
            })
        }
    }
}
