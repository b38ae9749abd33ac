//! The application benchmarks (`tiermem bench apps`): the harness itself is the Python package in
//! the repository's `bench/` directory; this module starts it, and provides the one piece it reuses
//! from Rust, `tiermem bench limited-run`: run a program inside a memory cgroup (optionally with a
//! swap file of its own) and report how it went, with the cgroups, swap files and stray children
//! removed by the signal-safe registry of [`crate::bench::cleanup`] on every exit path, Ctrl-C
//! included. The Python side never creates a kernel resource itself.

use std::ffi::OsString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Args;
use serde::{Deserialize, Serialize};
use tiermem_sys::{Error, ErrorKind, Result};

use super::linux_swap::{CgroupVersion, MemCgroup, SwapFile};

/// A cgroup limit that never binds (1 PiB): the unlimited runs still get a cgroup, for its peak
/// usage counter and so that stray children can be found and killed.
pub const UNLIMITED_BYTES: u64 = 1 << 50;

/// Environment variable naming the Python interpreter for the harness (default `python3`).
pub const PYTHON_ENV: &str = "TIERMEM_PYTHON";
/// Environment variable naming the directory holding the `tiermem_bench` package.
pub const BENCH_DIR_ENV: &str = "TIERMEM_BENCH_DIR";
/// Environment variable through which the harness learns which `tiermem` binary started it.
pub const BIN_ENV: &str = "TIERMEM_BIN";

/// `tiermem bench apps ARGS...`: everything after `apps` goes to `python3 -m tiermem_bench`.
#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct AppsArgs {
    /// Arguments for the harness (`--help` lists them).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

/// The directory holding the `tiermem_bench` package: $TIERMEM_BENCH_DIR, else `bench/` of the
/// source tree this binary was built from.
pub fn bench_dir() -> PathBuf {
    std::env::var_os(BENCH_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench"))
}

/// The harness's module for `tiermem bench apps`.
pub const APPS_MODULE: &str = "tiermem_bench";
/// The module for `tiermem bench sim-anchor`: `tiermem sim` beside libCacheSim.
pub const SIM_ANCHOR_MODULE: &str = "tiermem_bench.sim_anchor";

/// Replace this process with `python3 -m MODULE ARGS` from the harness's package. Returns only
/// on failure to start it.
pub fn exec_harness(module: &str, args: &AppsArgs) -> Error {
    let dir = bench_dir();
    if !dir.join("tiermem_bench").is_dir() {
        return Error::new(
            ErrorKind::NotFound,
            format!(
                "no tiermem_bench package in {}; set {BENCH_DIR_ENV} to the repository's bench directory",
                dir.display()
            ),
        );
    }
    let python = std::env::var_os(PYTHON_ENV).unwrap_or_else(|| "python3".into());
    let mut python_path = OsString::from(dir.as_os_str());
    if let Some(existing) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        python_path.push(":");
        python_path.push(existing);
    }
    let mut command = Command::new(&python);
    command.arg("-m").arg(module).args(&args.args).env("PYTHONPATH", python_path);
    if let Ok(exe) = std::env::current_exe() {
        command.env(BIN_ENV, exe);
    }
    let e = command.exec();
    Error::os(e, format!("starting the benchmark harness with {}", python.to_string_lossy()))
}

/// A size option's value, as `tiermem run --limit` reads sizes (bytes, or with a suffix).
fn size_arg(text: &str) -> std::result::Result<u64, String> {
    tiermem_engine::config::parse_size(text).map_err(|e| e.to_string())
}

/// `tiermem bench limited-run`: run PROGRAM in a fresh memory cgroup and write a JSON report.
#[derive(Debug, Args)]
pub struct LimitedRunArgs {
    /// Memory limit of the cgroup: bytes or a size (512MiB, 2G); without it the cgroup does not
    /// limit memory.
    #[arg(long, value_parser = size_arg)]
    pub limit: Option<u64>,
    /// Forbid swap in the cgroup (v1 memory.memsw.limit_in_bytes = the limit, v2 memory.swap.max = 0).
    #[arg(long, conflicts_with = "swap_dir")]
    pub no_swap: bool,
    /// Create and activate a swap file of --swap-bytes in this directory for the run.
    #[arg(long, requires = "swap_bytes")]
    pub swap_dir: Option<PathBuf>,
    /// Size of that swap file: bytes or a size (4GiB).
    #[arg(long, requires = "swap_dir", value_parser = size_arg)]
    pub swap_bytes: Option<u64>,
    /// Stop the program after this many seconds: SIGTERM, and SIGKILL 5 s later.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Name prefix of the cgroup.
    #[arg(long, default_value = "tiermem-apps")]
    pub cgroup_prefix: String,
    /// Where to write the JSON report (default: stderr's last line).
    #[arg(long)]
    pub result: Option<PathBuf>,
    /// The program and its arguments.
    #[arg(required = true, allow_hyphen_values = true, last = true)]
    pub command: Vec<OsString>,
}

/// What `limited-run` reports about one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LimitedRunReport {
    /// Wall-clock seconds from spawn to exit.
    pub wall_s: f64,
    /// Exit code, if the program exited.
    pub exit_code: Option<i32>,
    /// Signal that ended it, if one did.
    pub signal: Option<i32>,
    /// Whether --timeout killed it.
    pub timed_out: bool,
    /// The cgroup's limit in bytes (null: unlimited).
    pub limit_bytes: Option<u64>,
    /// Highest memory use of the cgroup (v1 max_usage_in_bytes, v2 memory.peak); where the cgroup
    /// does not keep one (v2 before Linux 5.19), the largest resident set of the program and
    /// the descendants it waited for (wait4's ru_maxrss).
    pub peak_bytes: Option<u64>,
    /// OOM kills in the cgroup.
    pub oom_kills: Option<u64>,
    /// Major faults of the cgroup's tasks (swap-ins and file refaults), from memory.stat.
    pub major_faults: Option<u64>,
    /// Bytes the kernel swapped in and out while the program ran (/proc/vmstat pswpin and
    /// pswpout, machine-wide: the harness runs one program at a time). Absent when unreadable.
    #[serde(default)]
    pub swap_in_bytes: Option<u64>,
    /// Bytes swapped out meanwhile (pswpout), as `swap_in_bytes`.
    #[serde(default)]
    pub swap_out_bytes: Option<u64>,
    /// Cgroup interface used.
    pub cgroup_version: CgroupVersion,
    /// CPU seconds the program and the descendants it waited for spent in user mode and in the
    /// kernel (wait4's resource usage; absent when the program was not reaped). The kernel part
    /// is what Ultraswap §4.4.2 compares for reclaim on and off the fault path.
    #[serde(default)]
    pub user_s: Option<f64>,
    /// Kernel-mode CPU seconds, as `user_s`.
    #[serde(default)]
    pub sys_s: Option<f64>,
    /// Size of the swap file, if one was made.
    pub swap_file_bytes: Option<u64>,
    /// File system of the swap file, if one was made.
    pub swap_file_system: Option<String>,
}

impl LimitedRunArgs {
    fn validate(&self) -> Result<()> {
        if self.limit == Some(0) {
            return Err(Error::invalid("--limit must be positive"));
        }
        if self.no_swap && self.limit.is_none() {
            return Err(Error::invalid("--no-swap needs --limit"));
        }
        if let Some(t) = self.timeout {
            // A year is far past any run, and far below what a Duration holds.
            if !(t > 0.0 && t <= 365.0 * 86400.0) {
                return Err(Error::invalid(
                    "--timeout must be a positive number of seconds, at most a year (365 days)",
                ));
            }
        }
        Ok(())
    }
}

/// Run one limited program as `args` says. Resources are released before returning, also on error.
pub fn limited_run(args: &LimitedRunArgs) -> Result<LimitedRunReport> {
    args.validate()?;
    // The swap file is created first so that it is dropped last: the cgroup's tasks are dead and
    // their swap slots freed by the time swapoff runs.
    super::linux_swap::remove_stale_leftovers(args.swap_dir.as_deref());
    let swap = match (&args.swap_dir, args.swap_bytes) {
        (Some(dir), Some(bytes)) => Some(SwapFile::create(dir, bytes)?),
        _ => None,
    };
    let (program, rest) = args.command.split_first().ok_or_else(|| Error::invalid("no program given"))?;
    // The program's temporary files (`tiermem run`'s statistics directory among them) go to a
    // directory of this run, removed when it ends: a program killed at the timeout or by the OOM
    // killer cannot remove its own. Made before the cgroup, so that it goes after it: on Ctrl-C
    // the registry tears down newest first, and a directory removed while the program still
    // ran (writing its statistics there as it ended) could be left behind.
    let temp_dir = RunTempDir::create()?;
    let limit = args.limit.unwrap_or(UNLIMITED_BYTES);
    let cgroup =
        MemCgroup::create_with_swap_limit(&args.cgroup_prefix, limit, if args.no_swap { Some(0) } else { None })?;

    let mut command = Command::new(program);
    command.args(rest).env("TMPDIR", &temp_dir.path);
    let swap_before = swap_pages();
    let Waited { status, wall, timed_out, cpu } =
        spawn_and_wait(&cgroup, &mut command, args.timeout.map(Duration::from_secs_f64))?;
    let swapped = swap_before.zip(swap_pages()).map(|((in0, out0), (in1, out1))| {
        let bytes = |pages: u64| pages * tiermem_sys::PAGE_SIZE as u64;
        (bytes(in1.saturating_sub(in0)), bytes(out1.saturating_sub(out0)))
    });

    let report = LimitedRunReport {
        wall_s: wall.as_secs_f64(),
        exit_code: status.and_then(|s| s.code()),
        signal: status.and_then(|s| s.signal()),
        timed_out,
        limit_bytes: args.limit,
        peak_bytes: cgroup.peak_bytes().ok().or(cpu.map(|c| c.max_rss_bytes)),
        oom_kills: cgroup.oom_kills(),
        major_faults: cgroup.memory_stat().ok().and_then(|stat| stat.get("pgmajfault").copied()),
        swap_in_bytes: swapped.map(|(i, _)| i),
        swap_out_bytes: swapped.map(|(_, o)| o),
        cgroup_version: cgroup.version(),
        user_s: cpu.map(|c| c.user_s),
        sys_s: cpu.map(|c| c.sys_s),
        swap_file_bytes: swap.as_ref().map(SwapFile::size_bytes),
        swap_file_system: swap.as_ref().map(|s| s.file_system().to_owned()),
    };
    // Kills whatever the program left running in the cgroup (stray children), then removes it.
    cgroup.close()?;
    if let Some(swap) = swap {
        swap.close()?;
    }
    Ok(report)
}

/// Pages swapped in and out since boot, machine-wide (/proc/vmstat pswpin, pswpout).
fn swap_pages() -> Option<(u64, u64)> {
    parse_swap_pages(&std::fs::read_to_string("/proc/vmstat").ok()?)
}

fn parse_swap_pages(vmstat: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        vmstat.lines().find_map(|line| {
            let (key, value) = line.split_once(' ')?;
            (key == name).then(|| value.trim().parse::<u64>().ok()).flatten()
        })
    };
    Some((field("pswpin")?, field("pswpout")?))
}

/// A run's temporary directory, removed when dropped and, like the cgroup and the swap file, by
/// the cleanup registry on Ctrl-C or another signal (a plain `TempDir` outlived an interrupted
/// run: three were left behind by every CI run's Ctrl-C tests).
struct RunTempDir {
    path: PathBuf,
    cleanup: Option<super::cleanup::CleanupId>,
}

impl RunTempDir {
    fn create() -> Result<Self> {
        let (path, cleanup) = super::cleanup::create_registered(|| {
            let path = tempfile::Builder::new()
                .prefix("tiermem-limited-run-")
                .tempdir()
                .map_err(|e| Error::os(e, "creating the run's temporary directory"))?
                .keep();
            let label = format!("temporary directory {}", path.display());
            let gone = path.clone();
            let teardown: super::cleanup::Teardown = Box::new(move || match std::fs::remove_dir_all(&gone) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(Error::os(e, format!("removing {}", gone.display())))
                }
                _ => Ok(()),
            });
            Ok((path, label, teardown))
        })?;
        Ok(Self { path, cleanup: Some(cleanup) })
    }
}

impl Drop for RunTempDir {
    fn drop(&mut self) {
        if let Some(cleanup) = self.cleanup.take() {
            if let Err(e) = super::cleanup::release(cleanup) {
                eprintln!("tiermem: {e}");
            }
        }
    }
}

/// CPU time of a reaped program (with the descendants it reaped), in seconds, and the largest
/// resident set among them.
#[derive(Debug, Clone, Copy, PartialEq)]
struct CpuTimes {
    user_s: f64,
    sys_s: f64,
    max_rss_bytes: u64,
}

/// How a program run by [`spawn_and_wait`] ended.
struct Waited {
    /// None when the timeout killed it.
    status: Option<ExitStatus>,
    wall: Duration,
    timed_out: bool,
    /// None when it could not be reaped with its resource usage.
    cpu: Option<CpuTimes>,
}

/// Wait for child `pid` to end and reap it, with its resource usage (wait4): std's `Child::wait`
/// does not give it.
fn wait_with_usage(pid: libc::pid_t) -> std::io::Result<(ExitStatus, CpuTimes)> {
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: an all-zero rusage is a valid value of that plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `status` and `usage` are valid for writing for the call; `pid` is our own
        // unreaped child, which nothing else waits for.
        let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if reaped == pid {
            let cpu = CpuTimes {
                user_s: seconds(usage.ru_utime),
                sys_s: seconds(usage.ru_stime),
                // Kilobytes on Linux.
                max_rss_bytes: u64::try_from(usage.ru_maxrss).unwrap_or(0) * 1024,
            };
            return Ok((ExitStatus::from_raw(status), cpu));
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// How long a program stopped at its timeout has to end after SIGTERM before it is killed:
/// `tiermem run` passes the SIGTERM on to its program and then writes its statistics (a
/// snapshot of the program's, written at most 2 s before), which a timed-out run keeps.
const TIMEOUT_GRACE: Duration = Duration::from_secs(5);

/// Start `command` inside `cgroup` (stdin closed, stdout/stderr inherited) and wait for it, at most
/// `timeout`. On timeout the program gets SIGTERM and, [`TIMEOUT_GRACE`] later, SIGKILL (the
/// cgroup teardown kills its children too); the status is `None`.
fn spawn_and_wait(cgroup: &MemCgroup, command: &mut Command, timeout: Option<Duration>) -> Result<Waited> {
    command.stdin(std::process::Stdio::null());
    super::linux_swap::start_inside(cgroup, command)?;
    let program = command.get_program().to_string_lossy().into_owned();
    let start = Instant::now();
    // The child is reaped by `wait_with_usage`, not through this handle (dropping a `Child`
    // neither waits nor kills).
    let child = command.spawn().map_err(|e| Error::os(e, format!("starting {program} in its cgroup")))?;
    let pid = child.id();
    // The process itself, for the kill at the timeout: by then the waiter may have reaped it
    // and its pid be another process's. Opened before the waiter starts, so it cannot miss.
    let pidfd = rustix::process::Pid::from_raw(pid as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    let (sender, receiver) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let ended = wait_with_usage(pid as libc::pid_t);
        let _ = sender.send((ended, Instant::now()));
    });
    let received = match timeout {
        Some(t) => receiver.recv_timeout(t).ok(),
        None => receiver.recv().ok(),
    };
    match received {
        Some((ended, end)) => {
            let _ = waiter.join();
            let (status, cpu) = ended.map_err(|e| Error::os(e, format!("waiting for {program}")))?;
            Ok(Waited { status: Some(status), wall: end - start, timed_out: false, cpu: Some(cpu) })
        }
        None => {
            let wall = start.elapsed();
            let signal = |signal| match &pidfd {
                Some(pidfd) => _ = rustix::process::pidfd_send_signal(pidfd, signal),
                // No pidfd (Linux < 5.3): the pid, unreaped unless the program ended just now.
                None => {
                    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                        let _ = rustix::process::kill_process(pid, signal);
                    }
                }
            };
            signal(rustix::process::Signal::TERM);
            let ended = receiver.recv_timeout(TIMEOUT_GRACE).ok().or_else(|| {
                signal(rustix::process::Signal::KILL);
                receiver.recv().ok()
            });
            let _ = waiter.join();
            let ended = ended.and_then(|(ended, _)| ended.ok());
            Ok(Waited { status: None, wall, timed_out: true, cpu: ended.map(|(_, cpu)| cpu) })
        }
    }
}

/// Write `report` as JSON to `path`, or print it on stderr when no path is given.
pub fn write_report(report: &LimitedRunReport, path: Option<&Path>) -> Result<()> {
    let json = serde_json::to_string(report).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    match path {
        Some(path) => {
            std::fs::write(path, json + "\n").map_err(|e| Error::os(e, format!("writing {}", path.display())))
        }
        None => {
            eprintln!("{json}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_swap_pages;

    #[test]
    fn swap_counters_are_read_from_vmstat_by_exact_name() {
        let vmstat = "pswpin 120\npswpin_extra 7\npswpout 45\npgmajfault 9\n";
        assert_eq!(parse_swap_pages(vmstat), Some((120, 45)));
        assert_eq!(parse_swap_pages("pswpin 1\n"), None, "pswpout missing");
        assert_eq!(parse_swap_pages("pswpin x\npswpout 2\n"), None, "not a number");
    }
}
