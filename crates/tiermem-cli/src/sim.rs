//! `tiermem sim`: replay a trace through the engine's policies and compare them.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use tiermem_engine::config::parse_size;
use tiermem_sim::trace::{Format, LineOptions, Synthetic, SyntheticGen};
use tiermem_sim::{format_table, FirstTouch, HitInfo, Latency, MonitorInput, SimConfig, SimResult, Simulator};
use tiermem_sys::{Error, Result};

/// Arguments of `tiermem sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Trace file: tiermem binary, Valgrind lackey `--trace-mem=yes` output, or page numbers,
    /// each also xz-compressed; `-` reads standard input (give --format).
    pub trace: Option<PathBuf>,
    /// Save the page-level trace (after the LLC filter and hot-page table; or the synthetic
    /// trace) in the binary format.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Trace format.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Instead of a file, a synthetic trace KIND:ACCESSES:FOOTPRINT_PAGES (kind: seq, random,
    /// mixed, hot), generated on the fly.
    #[arg(long, conflicts_with = "trace")]
    pub synthetic: Option<String>,
    /// Local memory: pages (`4096`) or a share of the trace's footprint (`50%`); several
    /// (comma-separated) run every pair at each size, for a miss-ratio curve in one call.
    #[arg(long, value_delimiter = ',', default_value = "50%")]
    pub local: Vec<String>,
    /// Prefetchers to compare (comma-separated): none, readahead, fastswap, leap, stream,
    /// ondemand, stride, temporal, stride-temporal, sibling.
    #[arg(long, value_delimiter = ',', default_value = "readahead")]
    pub prefetch: Vec<String>,
    /// Replacement policies to compare (comma-separated): fifo, clock, lru, stream-first, seq,
    /// seq-adaptive, seq-protect, seq-balance, belady (offline optimal).
    #[arg(long, value_delimiter = ',', default_value = "clock")]
    pub replace: Vec<String>,
    #[command(flatten)]
    pub lines: LineArgs,
    /// Monitor input for prefetchers: auto (the trace's reports if it has any, else every page
    /// change), none (faults only, as the engine without a monitor), reports, accesses.
    #[arg(long, default_value = "auto")]
    pub monitor: String,
    /// What replacement learns of an access to a resident page: full (every access, as a trace
    /// or accessed bits give) or engine (what tiermem's engine sees live: the first write to a
    /// clean page and monitor reports, nothing of reads).
    #[arg(long, default_value = "full")]
    pub hits: String,
    /// Share of local memory kept cleaned ahead of eviction as the engine's reclaim thread does
    /// (0: evict each victim as it is picked; the engine keeps 0.3, above its 70% watermark).
    #[arg(long, default_value_t = 0.0)]
    pub clean_ahead: f64,
    /// With --clean-ahead, clean only while fewer than this many write-backs are in flight (the
    /// engine cleans only as far as its write-back queue has room); when nothing is cleaned,
    /// evictions take the policy's victims directly (0: no limit, cleaning is instant; 64 fits
    /// the live runs best, docs/policies.md).
    #[arg(long, default_value_t = 0)]
    pub clean_queue: usize,
    /// A page's first touch: miss (a device read like any miss, and any page may be read
    /// ahead: a cache simulator's compulsory miss, as libCacheSim counts it) or zero-fill (as
    /// tiermem's engine: a page never written has nothing on the device, so a miss on it, its
    /// first touch or one after its unwritten page was dropped, is a zero-filled page without a
    /// read, counted apart from faults, and no prefetcher reads it).
    #[arg(long, default_value = "miss")]
    pub first_touch: String,
    /// CPU time per trace event, ns.
    #[arg(long, default_value_t = Latency::default().access_ns)]
    pub access_ns: f64,
    /// CPU time per byte-level access that stayed in the caches, ns.
    #[arg(long, default_value_t = Latency::default().cached_access_ns)]
    pub cached_access_ns: f64,
    /// Software cost of a fault, ns.
    #[arg(long, default_value_t = Latency::default().fault_ns)]
    pub fault_ns: f64,
    /// Device read latency, ns.
    #[arg(long, default_value_t = Latency::default().read_ns)]
    pub read_ns: f64,
    /// Device time per page transferred, ns.
    #[arg(long, default_value_t = Latency::default().transfer_ns)]
    pub transfer_ns: f64,
    /// Cost of the first touch of a prefetched page, ns.
    #[arg(long, default_value_t = Latency::default().hit_ns)]
    pub hit_ns: f64,
    /// Stream prefetch distance i (strides ahead of the stream's end).
    #[arg(long, default_value_t = 100)]
    pub stream_distance: u64,
    /// Pages the stream prefetcher reads per trained page.
    #[arg(long, default_value_t = 1)]
    pub stream_depth: usize,
    /// Read a newly found stream this many strides ahead, one stride further per page it
    /// walks, up to --stream-distance, the strides in between too (0: the paper's fixed
    /// distance).
    #[arg(long, default_value_t = 0)]
    pub stream_ramp: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Also measure the simulator's speed (wall time, accesses per second).
    #[arg(long)]
    pub bench: bool,
    /// Simulations (policy pairs, at each --local size) run at once, each with its own
    /// simulator state (default: one per CPU, fewer if their state would take more than half
    /// the available memory; 1 with --bench, so each speed is one core's).
    #[arg(long)]
    pub jobs: Option<usize>,
}

#[derive(Debug, serde::Serialize)]
struct Row {
    #[serde(flatten)]
    result: SimResult,
    #[serde(skip_serializing_if = "Option::is_none")]
    wall_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    accesses_per_second: Option<f64>,
}

fn parse_llc(text: &str) -> Result<Option<(u64, usize)>> {
    if text == "none" {
        return Ok(None);
    }
    let bad = || Error::invalid(format!("--llc '{text}': expected SIZE:WAYS (like 1MiB:16) or none"));
    let (size, ways) = text.split_once(':').ok_or_else(bad)?;
    let size = parse_size(size)?;
    // Real last-level caches are tens of MiB; the filter keeps a tag per line, so a bound keeps
    // a typo from asking for tens of GB.
    if size > MAX_LLC_BYTES {
        return Err(Error::invalid(format!("--llc '{text}': at most {} MiB", MAX_LLC_BYTES >> 20)));
    }
    Ok(Some((size, ways.parse().map_err(|_| bad())?)))
}

/// Largest `--llc` size.
const MAX_LLC_BYTES: u64 = 1 << 30;
/// Largest synthetic footprint in pages (1 TiB of memory): the simulator keeps state per page.
const MAX_SYNTHETIC_PAGES: u64 = 1 << 28;
/// Largest local memory in pages (1 TiB).
const MAX_LOCAL_PAGES: usize = 1 << 28;

/// Pages of local memory from `flag`'s value: pages (`4096`) or a share of the footprint (`50%`).
pub(crate) fn parse_local(flag: &str, text: &str, footprint: usize) -> Result<usize> {
    let pages = if let Some(p) = text.strip_suffix('%') {
        let p: f64 = p.trim().parse().map_err(|_| Error::invalid(format!("{flag} '{text}' is not a percentage")))?;
        if !(p > 0.0 && p <= 100.0) {
            return Err(Error::invalid(format!("{flag} {text} must be above 0% and at most 100%")));
        }
        (footprint as f64 * p / 100.0).round() as usize
    } else {
        text.parse().map_err(|_| Error::invalid(format!("{flag} '{text}': expected pages (4096) or a share (50%)")))?
    };
    if pages == 0 {
        return Err(Error::invalid(format!(
            "{flag} {text} gives 0 pages of local memory (footprint {footprint} pages)"
        )));
    }
    // The replacement policies size their tables by the local memory: a typo of a few digits
    // would ask for more memory than the machine has, and abort.
    if pages > MAX_LOCAL_PAGES {
        return Err(Error::invalid(format!("{flag} {text}: at most {MAX_LOCAL_PAGES} pages (1 TiB)")));
    }
    Ok(pages)
}

fn parse_synthetic(text: &str) -> Result<(Synthetic, u64, u64)> {
    let bad = || Error::invalid(format!("--synthetic '{text}': expected KIND:ACCESSES:FOOTPRINT_PAGES"));
    let mut parts = text.split(':');
    let kind: Synthetic = parts.next().ok_or_else(bad)?.parse()?;
    let accesses: u64 = parts.next().ok_or_else(bad)?.replace('_', "").parse().map_err(|_| bad())?;
    let footprint: u64 = parts.next().ok_or_else(bad)?.replace('_', "").parse().map_err(|_| bad())?;
    if accesses == 0 || footprint == 0 || parts.next().is_some() {
        return Err(bad());
    }
    if footprint > MAX_SYNTHETIC_PAGES {
        return Err(Error::invalid(format!(
            "--synthetic '{text}': a footprint of at most {MAX_SYNTHETIC_PAGES} pages (1 TiB)"
        )));
    }
    // The generator spreads its streams over at least this many pages; a smaller footprint
    // would be touched beyond and local memory sized from the wrong count.
    if footprint < tiermem_sim::trace::MIN_SYNTHETIC_PAGES {
        return Err(Error::invalid(format!(
            "--synthetic '{text}': a footprint of at least {} pages",
            tiermem_sim::trace::MIN_SYNTHETIC_PAGES
        )));
    }
    Ok((kind, accesses, footprint))
}

/// A bar for a simulation of `len` events, drawn among `bars`. Short runs get none (a bar
/// added to `bars` would be drawn, hidden or not); indicatif hides them all by itself when
/// stderr is not a terminal.
fn progress_bar(bars: &indicatif::MultiProgress, len: u64, label: String) -> indicatif::ProgressBar {
    if len < 20_000_000 {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:28} [{bar:40}] {percent:>3}% {rate} {eta}")
            .map(|style| {
                // Events a second in millions: indicatif's own rate prints every digit.
                style.with_key("rate", |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.1} M/s", state.per_sec() / 1e6);
                })
            })
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message(label);
    bars.add(bar)
}

/// How byte-address traces (lackey, binary with byte addresses) become page events.
#[derive(Debug, Args)]
pub struct LineArgs {
    /// LLC in front of memory for byte-address traces, SIZE:WAYS, or `none`.
    #[arg(long, default_value = "1MiB:16")]
    pub llc: String,
    /// Reads before the hot-page table reports a page (1..=64).
    #[arg(long, default_value_t = 8)]
    pub threshold: u32,
    /// Count lackey instruction fetches as reads.
    #[arg(long)]
    pub instructions: bool,
}

impl LineArgs {
    /// The options, checked.
    pub(crate) fn options(&self) -> Result<LineOptions> {
        let threshold = self.threshold;
        if !(1..=64).contains(&threshold) {
            return Err(Error::invalid(format!(
                "--threshold {threshold} must be in 1..=64 (a page has 64 cache lines)"
            )));
        }
        Ok(LineOptions { llc: parse_llc(&self.llc)?, threshold, instructions: self.instructions })
    }
}

/// Run `tiermem sim`.
pub fn run(args: &SimArgs) -> Result<()> {
    let lines = args.lines.options()?;
    let latency = Latency {
        access_ns: args.access_ns,
        cached_access_ns: args.cached_access_ns,
        fault_ns: args.fault_ns,
        read_ns: args.read_ns,
        transfer_ns: args.transfer_ns,
        hit_ns: args.hit_ns,
    };
    let named = [
        ("--access-ns", latency.access_ns),
        ("--cached-access-ns", latency.cached_access_ns),
        ("--fault-ns", latency.fault_ns),
        ("--read-ns", latency.read_ns),
        ("--transfer-ns", latency.transfer_ns),
        ("--hit-ns", latency.hit_ns),
    ];
    // An hour per event is far beyond any device; the bound keeps modeled times readable.
    if let Some((option, v)) = named.iter().find(|(_, v)| !(v.is_finite() && (0.0..=3.6e12).contains(v))) {
        return Err(Error::invalid(format!("{option} {v}: a latency must be between 0 and 3.6e12 ns (an hour)")));
    }
    if args.stream_distance == 0 {
        return Err(Error::invalid("--stream-distance 0: the stream prefetcher reads at least 1 stride ahead"));
    }
    let mut options = tiermem_policy::PolicyOptions::default();
    options.stream.distance = args.stream_distance;
    options.stream.depth = args.stream_depth;
    options.stream.ramp = args.stream_ramp;
    options.stream.validate()?;
    // A policy named twice is compared once.
    let distinct = |names: &[String]| {
        let mut seen = Vec::new();
        for n in names {
            if !seen.contains(n) {
                seen.push(n.clone());
            }
        }
        seen
    };
    let (prefetchers, replacements) = (distinct(&args.prefetch), distinct(&args.replace));
    for p in &prefetchers {
        tiermem_policy::build_policies(p, "fifo", 1, &options)?;
    }
    for r in &replacements {
        if r != "belady" {
            tiermem_policy::build_policies("none", r, 1, &options)?;
        }
    }
    // Options checked before the input is loaded (a large trace takes a while).
    let hits = match args.hits.as_str() {
        "full" => HitInfo::Full,
        "engine" => HitInfo::Engine,
        other => return Err(Error::invalid(format!("--hits '{other}': expected full or engine"))),
    };
    if !(0.0..1.0).contains(&args.clean_ahead) {
        return Err(Error::invalid(format!("--clean-ahead {}: a share at least 0 and below 1", args.clean_ahead)));
    }
    if args.clean_queue > 0 && args.clean_ahead == 0.0 {
        return Err(Error::invalid("--clean-queue limits cleaning ahead: give --clean-ahead too"));
    }
    let first_touch = match args.first_touch.as_str() {
        "miss" => FirstTouch::Miss,
        "zero-fill" => FirstTouch::ZeroFill,
        other => return Err(Error::invalid(format!("--first-touch '{other}': expected miss or zero-fill"))),
    };
    // None: auto (the trace's reports if it has any, else every page change).
    let monitor = match args.monitor.as_str() {
        "auto" => None,
        "accesses" => Some(MonitorInput::Accesses),
        "none" => Some(MonitorInput::None),
        "reports" => Some(MonitorInput::Reports),
        other => return Err(Error::invalid(format!("--monitor '{other}': expected auto, none, reports, accesses"))),
    };
    // Load (or describe) the input.
    let (trace, synthetic, label) = match (&args.trace, &args.synthetic) {
        (Some(path), None) => {
            let t = tiermem_sim::load(path, args.format.parse::<Format>()?, &lines)?;
            if let Some(note) = fault_trace_note(path, first_touch) {
                eprintln!("tiermem sim: note: {note}");
            }
            (Some(t), None, path.display().to_string())
        }
        (None, Some(spec)) if args.save.is_some() => {
            // To be saved, the synthetic trace is made whole first, and replayed from memory
            // like a loaded one.
            let (kind, accesses, footprint) = parse_synthetic(spec)?;
            let events = SyntheticGen::new(kind, footprint).take(accesses as usize).collect();
            (Some(tiermem_sim::Trace { events, has_reports: false, raw_accesses: 0 }), None, spec.clone())
        }
        (None, Some(spec)) => (None, Some(parse_synthetic(spec)?), spec.clone()),
        _ => return Err(Error::invalid("give a trace file or --synthetic KIND:ACCESSES:FOOTPRINT_PAGES")),
    };
    if let (Some(t), Some(path)) = (&trace, &args.save) {
        save(t, path)?;
    }
    let footprint = match (&trace, synthetic) {
        (Some(t), _) => tiermem_sim::footprint(&t.events),
        (None, Some((_, _, f))) => f as usize,
        _ => 0,
    };
    // Sizes in the order given, each once.
    let mut sizes: Vec<usize> = Vec::new();
    for text in &args.local {
        let pages = parse_local("--local", text, footprint)?;
        if !sizes.contains(&pages) {
            sizes.push(pages);
        }
    }
    let has_reports = trace.as_ref().is_some_and(|t| t.has_reports);
    let monitor = match monitor {
        None if has_reports => MonitorInput::Reports,
        None => MonitorInput::Accesses,
        Some(m) => m,
    };
    // The pairs in table order; belady with prefetching is left out with a note.
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    for prefetch in &prefetchers {
        for replace in &replacements {
            if replace == "belady" && prefetch != "none" {
                eprintln!("note: belady runs only without prefetching; skipping {prefetch} × belady");
                continue;
            }
            if replace == "belady" && hits == HitInfo::Engine {
                eprintln!("note: belady, the offline optimum, hears every access; --hits engine applies to the online policies");
            }
            pairs.push((prefetch, replace));
        }
    }
    if pairs.is_empty() {
        return Err(Error::invalid(
            "no policy pair to run: belady runs only without prefetching, so add none to --prefetch (--prefetch none)",
        ));
    }
    // Every pair at each size, size by size.
    let runs: Vec<(usize, &str, &str)> =
        sizes.iter().flat_map(|&local| pairs.iter().map(move |&(p, r)| (local, p, r))).collect();
    let mut jobs = jobs(args.jobs, args.bench, runs.len())?;
    if args.jobs.is_none() && jobs > 1 {
        // Each simulation at once holds its own state: as many as half the available memory
        // takes (the rest is the trace's and the system's).
        let accesses = trace.as_ref().map_or_else(|| synthetic.map_or(0, |(_, a, _)| a), |t| t.events.len() as u64);
        let belady = replacements.iter().any(|r| r == "belady");
        let largest = sizes.iter().copied().max().unwrap_or(1);
        jobs =
            fewer_to_fit_memory(jobs, simulation_bytes(footprint as u64, largest as u64, belady.then_some(accesses)));
    }
    let bars = indicatif::MultiProgress::new();
    let several = sizes.len() > 1;
    let run_one = |&(local_pages, prefetch, replace): &(usize, &str, &str)| -> Result<Row> {
        // With several sizes a bar says which one it is at.
        let label =
            if several { format!("{local_pages} {prefetch} × {replace}") } else { format!("{prefetch} × {replace}") };
        let config = SimConfig {
            local_pages,
            prefetch: prefetch.to_string(),
            replace: replace.to_string(),
            options,
            latency,
            monitor,
            hits,
            clean_ahead: args.clean_ahead,
            clean_queue: args.clean_queue,
            first_touch,
        };
        let started = Instant::now();
        let result = match (&trace, synthetic) {
            (Some(t), _) => {
                let bar = progress_bar(&bars, t.events.len() as u64, label);
                let r = tiermem_sim::simulate(&t.events, &config, &mut |done| bar.set_position(done));
                bar.finish_and_clear();
                r?
            }
            (None, Some((kind, accesses, footprint))) if replace == "belady" => {
                let events: Vec<u64> = SyntheticGen::new(kind, footprint).take(accesses as usize).collect();
                tiermem_sim::simulate(&events, &config, &mut |_| {})?
            }
            (None, Some((kind, accesses, footprint))) => {
                let mut sim = Simulator::new(config)?;
                let bar = progress_bar(&bars, accesses, label);
                let mut generator = SyntheticGen::new(kind, footprint);
                let mut left = accesses;
                while left > 0 {
                    let n = left.min(1 << 20);
                    for e in generator.by_ref().take(n as usize) {
                        sim.step(e);
                    }
                    left -= n;
                    bar.inc(n);
                }
                bar.finish_and_clear();
                sim.finish()
            }
            _ => unreachable!("input checked above"),
        };
        let wall = started.elapsed().as_secs_f64();
        let speed = result.accesses as f64 / wall;
        Ok(Row { result, wall_seconds: args.bench.then_some(wall), accesses_per_second: args.bench.then_some(speed) })
    };
    let rows = run_all(&runs, jobs, &run_one)?;
    if args.json {
        let out = serde_json::json!({
            "trace": label,
            "footprint_pages": footprint,
            // An array whenever several sizes were asked for, even if they came to one.
            "local_pages": if args.local.len() > 1 { serde_json::json!(sizes) } else { serde_json::json!(sizes[0]) },
            "raw_accesses": trace.as_ref().map(|t| t.raw_accesses),
            "monitor": monitor,
            "hits": hits,
            "clean_ahead": args.clean_ahead,
            "clean_queue": args.clean_queue,
            "first_touch": first_touch,
            "latency": latency,
            "results": rows,
        });
        println!("{out}");
        return Ok(());
    }
    let share = |pages: usize| format!("{pages} pages ({:.0}%)", pages as f64 * 100.0 / footprint.max(1) as f64);
    println!(
        "trace {label}: footprint {footprint} pages, local memory {}, monitor input {}, hits {}, clean-ahead {}{}{}",
        sizes.iter().map(|&p| share(p)).collect::<Vec<_>>().join(", "),
        flag_spelling(&monitor),
        flag_spelling(&hits),
        args.clean_ahead,
        if args.clean_queue > 0 {
            format!(" (at most {} write-backs in flight)", args.clean_queue)
        } else {
            String::new()
        },
        if first_touch == FirstTouch::ZeroFill { ", pages never written zero-filled (not in faults)" } else { "" }
    );
    let results: Vec<SimResult> = rows.iter().map(|r| r.result.clone()).collect();
    print!("{}", format_table(&results, several));
    if args.bench {
        for r in &rows {
            println!(
                "speed {}{} × {}: {:.1} M accesses/s ({:.2} s)",
                if several { format!("{} pages: ", r.result.local_pages) } else { String::new() },
                r.result.prefetch,
                r.result.replace,
                r.accesses_per_second.unwrap_or(0.0) / 1e6,
                r.wall_seconds.unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

/// How the flag that set a setting spells it (`accesses`, `zero-fill`), from the setting's serde
/// name, so the summary line and the JSON say what the user typed.
fn flag_spelling<T: serde::Serialize>(setting: &T) -> String {
    match serde_json::to_value(setting) {
        Ok(serde_json::Value::String(name)) => name,
        _ => String::from("?"),
    }
}

/// Simulations run at once: `--jobs`, else one per CPU, but one with `--bench` (each one's
/// speed is then that of a core of its own); never more than there are simulations.
fn jobs(asked: Option<usize>, bench: bool, runs: usize) -> Result<usize> {
    let jobs = match asked {
        Some(0) => return Err(Error::invalid("--jobs 0: at least one simulation has to run at a time")),
        Some(n) => n,
        None if bench => 1,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let jobs = jobs.min(runs);
    if bench && jobs > 1 {
        eprintln!(
            "tiermem sim: note: --bench with {jobs} simulations at once: they share the CPUs and memory, so each speed is below that of a core alone"
        );
    }
    Ok(jobs)
}

/// `jobs`, or fewer (with a note) if that many simulations needing `need` bytes each would take
/// more than half the memory /proc/meminfo says is available.
fn fewer_to_fit_memory(jobs: usize, need: u64) -> usize {
    let available =
        std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| crate::machine::meminfo_bytes(&m, "MemAvailable"));
    let Some(available) = available else { return jobs };
    let fit = jobs_that_fit(jobs, need, available);
    if fit < jobs {
        eprintln!(
            "tiermem sim: note: {fit} simulation(s) at once, not {jobs}: each needs about {} MiB and {} MiB are available (--jobs overrides)",
            need >> 20,
            available >> 20
        );
    }
    fit
}

/// How many of `jobs` simulations needing `need` bytes each fit in half of `available` (at
/// least one).
fn jobs_that_fit(jobs: usize, need: u64, available: u64) -> usize {
    let fit = (available / 2) / need.max(1);
    (fit.max(1)).min(jobs as u64) as usize
}

/// About the memory one simulation holds: a byte of state and an arrival time per page of the
/// footprint, the replacement policy's list nodes (16 bytes, up to three per local page), and
/// for the offline optimum (`belady_accesses`) its copy of the trace and its next-use tables.
fn simulation_bytes(footprint_pages: u64, local_pages: u64, belady_accesses: Option<u64>) -> u64 {
    footprint_pages.saturating_mul(9) + local_pages.saturating_mul(48) + belady_accesses.unwrap_or(0).saturating_mul(40)
}

/// Run every simulation, `jobs` at a time, and give their rows in `runs`' order. Each is
/// independent and deterministic, so the results are those of running them one by one. After a
/// failure no further one starts, and the first failure in table order is returned.
fn run_all<T: Sync>(runs: &[T], jobs: usize, run_one: &(dyn Fn(&T) -> Result<Row> + Sync)) -> Result<Vec<Row>> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    use std::sync::Mutex;

    if jobs <= 1 {
        return runs.iter().map(run_one).collect();
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let done: Vec<Mutex<Option<Result<Row>>>> = runs.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                while !failed.load(Relaxed) {
                    let k = next.fetch_add(1, Relaxed);
                    let Some(run) = runs.get(k) else { break };
                    let row = run_one(run);
                    failed.fetch_or(row.is_err(), Relaxed);
                    *done[k].lock().unwrap_or_else(|e| e.into_inner()) = Some(row);
                }
            });
        }
    });
    // A pair not started (after a failure) leaves its slot empty; the failure itself is in a
    // slot of its own, so it is met before or after the gap and returned either way.
    let results: Vec<Result<Row>> =
        done.into_iter().filter_map(|slot| slot.into_inner().unwrap_or_else(|e| e.into_inner())).collect();
    let complete = results.len() == runs.len();
    let rows = results.into_iter().collect::<Result<Vec<Row>>>()?;
    if !complete {
        return Err(Error::new(tiermem_sys::ErrorKind::Internal, "simulations were left out without a failure"));
    }
    Ok(rows)
}

/// What to keep in mind when replaying a trace `tiermem trace record` wrote (it leaves a
/// description next to it): the trace holds that run's faults only. A page the run kept resident
/// is never in it, so a replay with more local memory than the run kept, or with another policy
/// (which would have kept other pages), finds hits the run never had and counts fewer faults
/// than the run, or a live run under that policy, would take. Replayed with the run's own
/// policies at or a little below the pages it kept resident, it reproduces the run's faults.
fn fault_trace_note(trace: &std::path::Path, first_touch: FirstTouch) -> Option<String> {
    let about: serde_json::Value =
        serde_json::from_slice(&std::fs::read(crate::run::sidecar_path(trace)).ok()?).ok()?;
    if about["kind"].as_str() != Some(crate::run::FAULT_TRACE_KIND) {
        return None;
    }
    let budget = about["lowest_budget_pages"].as_u64().or(about["budget_pages"].as_u64())?;
    // The engine evicts from 98% of its budget in batches, and pages it installs without a fault
    // (zero-filled or read ahead) never appear in the trace: uniform random reads replayed
    // exactly from 95% of the budget down, PageRank from 90% (docs/policies.md).
    let replay = budget - budget / 20;
    Some(format!(
        "{} holds the faults of one live run (--replace {} --prefetch {}, budget {budget} pages), \
         not every access: pages that run kept resident never appear. Replayed with that run's \
         policies and --local {replay} (95% of its budget) or less it takes about the run's \
         faults again; with more local memory, or with other policies, the simulator counts fewer \
         faults than a live run would take (docs/policies.md, \"Replaying recorded fault traces\"){}",
        trace.display(),
        about["replace"].as_str().unwrap_or("?"),
        about["prefetch"].as_str().unwrap_or("?"),
        // The run's critical faults are device reads; its first touches were zero fills.
        if first_touch == FirstTouch::Miss {
            ". Each page's first touch counts as a device read here, where the engine zero-filled it \
             (--first-touch zero-fill counts as the engine did)"
        } else {
            ""
        }
    ))
}

fn save(trace: &tiermem_sim::Trace, path: &std::path::Path) -> Result<()> {
    let file = std::fs::File::create(path).map_err(|e| Error::os(e, format!("creating {}", path.display())))?;
    let mut w = tiermem_sim::trace::BinaryWriter::new(std::io::BufWriter::new(file), false)
        .map_err(|e| Error::os(e, format!("writing {}", path.display())))?;
    for &e in &trace.events {
        w.write_encoded(e).map_err(|e| Error::os(e, format!("writing {}", path.display())))?;
    }
    w.finish().map_err(|e| Error::os(e, format!("writing {}", path.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(prefetch: &str) -> Row {
        Row {
            result: SimResult { prefetch: prefetch.to_string(), ..SimResult::default() },
            wall_seconds: None,
            accesses_per_second: None,
        }
    }

    #[test]
    fn pairs_run_side_by_side_come_back_in_order_and_a_failure_is_reported() {
        let pairs: Vec<(String, String)> =
            ["a", "b", "c", "d", "e"].iter().map(|p| (p.to_string(), "lru".into())).collect();
        for jobs in [1, 2, 5] {
            let rows = run_all(&pairs, jobs, &|(p, _)| Ok(row(p))).unwrap();
            let order: Vec<&str> = rows.iter().map(|r| r.result.prefetch.as_str()).collect();
            assert_eq!(order, ["a", "b", "c", "d", "e"], "{jobs} jobs");
            let failing =
                |(p, _): &(String, String)| if p == "c" { Err(Error::invalid("pair c failed")) } else { Ok(row(p)) };
            let err = run_all(&pairs, jobs, &failing).map(|_| ()).unwrap_err();
            assert!(err.to_string().contains("pair c failed"), "{jobs} jobs: {err}");
        }
    }

    #[test]
    fn jobs_default_to_the_cpus_but_to_one_when_timing() {
        assert!(jobs(Some(0), false, 4).is_err());
        assert_eq!(jobs(Some(3), false, 2).unwrap(), 2, "never more than there are pairs");
        assert_eq!(jobs(None, true, 9).unwrap(), 1);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(jobs(None, false, 64).unwrap(), cpus.min(64));
    }

    #[test]
    fn simulations_at_once_fit_in_half_the_available_memory() {
        let gib = 1u64 << 30;
        assert_eq!(jobs_that_fit(8, gib, 10 * gib), 5);
        assert_eq!(jobs_that_fit(2, gib, 10 * gib), 2, "never more than asked");
        assert_eq!(jobs_that_fit(4, 20 * gib, 10 * gib), 1, "one runs whatever it needs");
        // 100 M accesses of the optimum over a million pages at half of them: about 4 GiB.
        let need = simulation_bytes(1 << 20, 1 << 19, Some(100_000_000));
        assert!((3 * gib..5 * gib).contains(&need), "{need}");
        assert!(simulation_bytes(1 << 20, 1 << 19, None) < gib / 8);
    }
}
