//! The §4.2 microbenchmark driver: one point (array size N MB, memory limit M MB) on a given
//! system. The Linux-swap point runs the array benchmark on plain anonymous memory in a child
//! process (`tiermem micro-worker`) confined by a memory cgroup, with a swap file on the file system
//! under test as the only place the kernel can page to.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use serde::{Deserialize, Serialize};
use tiermem_sys::{Error, ErrorKind, Result};

use super::array::{run_array_bench, ArrayResult, PhaseStats};
use super::linux_swap::{run_in_cgroup, CgroupVersion, MemCgroup, SwapFile};

/// Bytes per MB as the benchmark counts them (MiB, as in the paper's "100 MB" arrays).
pub const MIB: u64 = 1 << 20;

/// The swap file is this many times the array, so swap space never limits the benchmark.
const SWAP_FILE_SIZE_FACTOR: u64 = 2;

/// The hidden subcommand the Linux-swap point runs in the cgroup.
pub const WORKER_SUBCOMMAND: &str = "micro-worker";

/// Check the arguments of a micro point: positive sizes, a limit below the array size (otherwise
/// nothing is paged) and a writable directory for the swap file.
pub fn validate_micro_args(size_mb: u64, limit_mb: u64, dir: &Path) -> Result<()> {
    if size_mb == 0 {
        return Err(Error::invalid("--size-mb must be positive"));
    }
    if limit_mb == 0 {
        return Err(Error::invalid("--limit-mb must be positive"));
    }
    if limit_mb >= size_mb {
        return Err(Error::invalid(format!(
            "--limit-mb ({limit_mb}) must be smaller than --size-mb ({size_mb}), or the array fits in memory and nothing is paged"
        )));
    }
    if size_mb.checked_mul(MIB * SWAP_FILE_SIZE_FACTOR).is_none_or(|bytes| usize::try_from(bytes).is_err()) {
        return Err(Error::invalid(format!("--size-mb {size_mb} is too large")));
    }
    let metadata = std::fs::metadata(dir).map_err(|e| Error::os(e, format!("--dir {}", dir.display())))?;
    if !metadata.is_dir() {
        return Err(Error::invalid(format!("--dir {} is not a directory", dir.display())));
    }
    // Actually creating a file is the only reliable test (root ignores mode bits, not read-only mounts).
    tempfile::tempfile_in(dir)
        .map_err(|e| Error::os(e, format!("--dir {}: cannot create a file there", dir.display())))?;
    Ok(())
}

/// Everything measured at one Linux-swap point.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LinuxSwapPoint {
    /// Array size in MiB.
    pub size_mb: u64,
    /// Cgroup memory limit in MiB.
    pub limit_mb: u64,
    /// Size of the swap file used.
    pub swap_file_bytes: u64,
    /// File system holding the swap file.
    pub file_system: String,
    /// Cgroup interface used.
    pub cgroup_version: CgroupVersion,
    /// The worker's measurements.
    pub array: ArrayResult,
    /// Highest memory use of the cgroup, if readable.
    pub cgroup_peak_bytes: Option<u64>,
    /// OOM kills in the cgroup, if readable.
    pub cgroup_oom_kills: Option<u64>,
    /// Major faults (swap-ins) charged to the cgroup, from memory.stat, if readable.
    pub cgroup_major_faults: Option<u64>,
}

/// One Linux-swap point: an array of `size_mb` MiB under a `limit_mb` MiB cgroup limit, swapping to
/// a swap file in `swap_dir`. Runs this executable's `micro-worker` subcommand.
pub fn linux_swap_point(size_mb: u64, limit_mb: u64, swap_dir: &Path) -> Result<ArrayResult> {
    let worker = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable for the worker"))?;
    Ok(linux_swap_point_with_worker(size_mb, limit_mb, swap_dir, &worker)?.array)
}

/// [`linux_swap_point`] with an explicit `tiermem` executable for the worker (tests run from a
/// test binary) and the cgroup's own counters in the result.
pub fn linux_swap_point_with_worker(
    size_mb: u64,
    limit_mb: u64,
    swap_dir: &Path,
    worker_exe: &Path,
) -> Result<LinuxSwapPoint> {
    validate_micro_args(size_mb, limit_mb, swap_dir)?;
    // Declared before the cgroup so that it is dropped after it: the worker is gone and its swap
    // slots freed by the time swapoff runs.
    super::linux_swap::remove_stale_leftovers(Some(swap_dir));
    let swap = SwapFile::create(swap_dir, size_mb * MIB * SWAP_FILE_SIZE_FACTOR)?;
    let cgroup = MemCgroup::create("tiermem-micro", limit_mb * MIB)?;

    let mut command = Command::new(worker_exe);
    command.arg(WORKER_SUBCOMMAND).arg("--size-mb").arg(size_mb.to_string());
    let output = run_in_cgroup(&cgroup, &mut command)?;
    let oom_kills = cgroup.oom_kills();
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        let oom_note = match oom_kills {
            Some(kills) if kills > 0 => {
                format!(" (the cgroup recorded {kills} OOM kill(s): swap did not keep up with the limit)")
            }
            _ => String::new(),
        };
        return Err(Error::new(
            ErrorKind::Io,
            format!("micro worker failed with {}{oom_note}; its stderr: {}", output.status, stderr.trim()),
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let json_line = stdout.lines().rev().find(|line| line.starts_with('{')).ok_or_else(|| {
        Error::new(
            ErrorKind::Internal,
            format!("micro worker printed no result; stdout: {:?}, stderr: {:?}", stdout.trim(), stderr.trim()),
        )
    })?;
    let array: ArrayResult = serde_json::from_str(json_line)
        .map_err(|e| Error::new(ErrorKind::Internal, format!("micro worker result {json_line:?} is not valid: {e}")))?;

    let point = LinuxSwapPoint {
        size_mb,
        limit_mb,
        swap_file_bytes: swap.size_bytes(),
        file_system: swap.file_system().to_owned(),
        cgroup_version: cgroup.version(),
        array,
        cgroup_peak_bytes: cgroup.peak_bytes().ok(),
        cgroup_oom_kills: oom_kills,
        cgroup_major_faults: cgroup.memory_stat().ok().and_then(|stat| stat.get("pgmajfault").copied()),
    };
    cgroup.close()?;
    swap.close()?;
    Ok(point)
}

/// The worker: map `size_mb` MiB of plain anonymous memory and run the array benchmark on it.
pub fn run_micro_worker(size_mb: u64) -> Result<ArrayResult> {
    let len = size_mb
        .checked_mul(MIB)
        .and_then(|bytes| usize::try_from(bytes).ok())
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| Error::invalid(format!("--size-mb {size_mb} must be positive and addressable")))?;
    let array = tiermem_sys::mem::Mapping::anonymous(len, false)?;
    // 4 KiB pages, as tiermem pages: with THP set to "always" the kernel would otherwise fault and
    // swap 2 MiB at a time. EINVAL means a kernel without THP, which is what we want anyway.
    // SAFETY: the range is exactly the mapping we own; the advice does not change its contents.
    let _ = unsafe { rustix::mm::madvise(array.as_ptr().cast(), len, rustix::mm::Advice::LinuxNoHugepage) };
    // SAFETY: `array` is a fresh private mapping of `len` bytes, page-aligned, used by nothing else
    // and alive until after the call.
    Ok(unsafe { run_array_bench(array.as_ptr(), len, None) })
}

fn phase_line(name: &str, stats: &PhaseStats) -> String {
    format!(
        "{name:<5} {:>8.2} µs/page   p50 {:>7.2}  p99 {:>8.2}  max {:>9.1} µs   major faults {}",
        stats.per_page_us(),
        stats.p50_us(),
        stats.p99_us(),
        stats.max_us(),
        stats.major_faults
    )
}

/// A human-readable report of one Linux-swap point.
pub fn format_linux_swap_point(point: &LinuxSwapPoint) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "linux-swap micro: {} MiB array ({} pages), {} MiB cgroup limit ({:?}), {} MiB swap file on {}",
        point.size_mb,
        point.array.pages,
        point.limit_mb,
        point.cgroup_version,
        point.swap_file_bytes / MIB,
        point.file_system
    );
    let _ = writeln!(text, "{}", phase_line("write", &point.array.write));
    let _ = writeln!(text, "{}", phase_line("read", &point.array.read));
    let mb = |bytes: Option<u64>| bytes.map_or("?".to_owned(), |b| format!("{:.1} MiB", b as f64 / MIB as f64));
    let count = |value: Option<u64>| value.map_or("?".to_owned(), |v| v.to_string());
    let _ = write!(
        text,
        "mismatched pages {}   cgroup peak {}   cgroup major faults {}   OOM kills {}",
        point.array.mismatched_pages,
        mb(point.cgroup_peak_bytes),
        count(point.cgroup_major_faults),
        count(point.cgroup_oom_kills)
    );
    text
}
