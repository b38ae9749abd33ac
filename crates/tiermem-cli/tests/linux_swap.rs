//! Tests of the array microbenchmark and of the Linux-swap baseline's guards. The guard and
//! end-to-end tests need root and a memory cgroup; without them they print "SKIPPED: <reason>" to
//! stderr and pass.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tiermem_cli::bench::array::{fill_page, page_matches, read_phase, run_array_bench, write_phase, WORDS_PER_PAGE};
use tiermem_cli::bench::linux_swap::{active_swap_paths, memory_hierarchy, run_in_cgroup, MemCgroup, SwapFile};
use tiermem_cli::bench::micro::{linux_swap_point_with_worker, MIB};
use tiermem_sys::{ErrorKind, PAGE_SIZE};

/// Why the privileged tests cannot run here, if they cannot.
fn privileged_skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (swapon and cgroup creation)".into());
    }
    if !Path::new("/proc/swaps").exists() {
        return Some("kernel without swap support (/proc/swaps missing)".into());
    }
    memory_hierarchy().err().map(|e| e.to_string())
}

macro_rules! skip_unless_privileged {
    () => {
        if let Some(reason) = privileged_skip_reason() {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

/// A scratch directory for swap files on the file system the benchmark targets (/tmp here), not
/// on tmpfs, which cannot hold swap files.
fn swap_scratch_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("tiermem-test-")
        .tempdir_in(std::env::temp_dir())
        .expect("creating a scratch directory")
}

fn swap_is_active(path: &Path) -> bool {
    active_swap_paths().expect("reading /proc/swaps").iter().any(|active| active == path)
}

fn page_aligned_words(pages: usize) -> Vec<u64> {
    // Vec<u64> is 8-byte aligned, which is all the benchmark needs.
    vec![0u64; pages * WORDS_PER_PAGE]
}

#[test]
fn array_bench_on_plain_memory_round_trips_every_page() {
    let pages = 64;
    let mut words = page_aligned_words(pages);
    let progress_calls = std::cell::Cell::new(0);
    let progress = |_phase, _done| progress_calls.set(progress_calls.get() + 1);
    // SAFETY: `words` is an exclusively borrowed, 8-byte aligned buffer of `pages` whole pages.
    let result = unsafe { run_array_bench(words.as_mut_ptr().cast(), pages * PAGE_SIZE, Some(&progress)) };
    assert_eq!(result.pages, pages as u64);
    assert_eq!(result.mismatched_pages, 0);
    assert_eq!(result.first_mismatched_page, None);
    assert!(result.write.total_ns > 0 && result.read.total_ns > 0, "{result:?}");
    assert!(result.write.max_ns >= result.write.p50_ns && result.read.max_ns >= result.read.p50_ns);
    assert!(result.read_per_page_us() > 0.0 && result.write_per_page_us() > 0.0);
    assert_eq!(progress_calls.get(), 2, "one call at the end of each 64-page phase");
    // The pattern is in memory, and the JSON form round-trips.
    assert!(page_matches(&words[3 * WORDS_PER_PAGE..4 * WORDS_PER_PAGE], 3));
    let json = serde_json::to_string(&result).unwrap();
    assert_eq!(serde_json::from_str::<tiermem_cli::bench::array::ArrayResult>(&json).unwrap(), result);
}

#[test]
fn array_bench_detects_a_corrupted_page() {
    let pages = 16;
    let len = pages * PAGE_SIZE;
    let mut words = page_aligned_words(pages);
    let base = words.as_mut_ptr().cast::<u8>();
    // SAFETY: `words` is an exclusively borrowed, 8-byte aligned buffer of `pages` whole pages.
    unsafe { write_phase(base, len, None) };
    // Flip one bit in the last byte of page 5 and zero page 9 entirely (a lost page).
    words[6 * WORDS_PER_PAGE - 1] ^= 1 << 63;
    words[9 * WORDS_PER_PAGE..10 * WORDS_PER_PAGE].fill(0);
    // SAFETY: as above.
    let outcome = unsafe { read_phase(words.as_mut_ptr().cast(), len, None) };
    assert_eq!(outcome.mismatched_pages, 2);
    assert_eq!(outcome.first_mismatched_page, Some(5));
}

#[test]
fn page_pattern_depends_on_the_page_index() {
    let mut page = vec![0u64; WORDS_PER_PAGE];
    assert!(!page_matches(&page, 0), "a zero page must not verify");
    fill_page(&mut page, 7);
    assert!(page_matches(&page, 7));
    assert!(!page_matches(&page, 8), "a page read back from the wrong place must not verify");
}

#[test]
fn swap_file_guard_deactivates_and_removes_the_file_on_drop() {
    skip_unless_privileged!();
    let dir = swap_scratch_dir();
    let swap = SwapFile::create(dir.path(), 16 * MIB).expect("creating a swap file");
    let path = swap.path().to_path_buf();
    assert!(swap_is_active(&path), "{} missing from /proc/swaps", path.display());
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 16 * MIB);
    drop(swap);
    assert!(!swap_is_active(&path), "{} still listed in /proc/swaps after drop", path.display());
    assert!(!path.exists(), "{} still exists after drop", path.display());
}

#[test]
fn swap_file_on_tmpfs_is_refused_with_a_clear_error() {
    skip_unless_privileged!();
    let shm = Path::new("/dev/shm");
    if rustix::fs::statfs(shm).map(|fs| fs.f_type as u32 != 0x0102_1994).unwrap_or(true) {
        eprintln!("SKIPPED: /dev/shm is not a tmpfs here");
        return;
    }
    let error = SwapFile::create(shm, 16 * MIB).expect_err("tmpfs cannot hold swap");
    assert_eq!(error.kind(), ErrorKind::Unsupported);
    assert!(error.to_string().contains("tmpfs"), "{error}");
}

#[test]
fn cgroup_guard_kills_its_tasks_and_removes_the_directory_on_drop() {
    skip_unless_privileged!();
    let cgroup = MemCgroup::create("tiermem-test", 64 * MIB).expect("creating a memory cgroup");
    let dir = cgroup.path().to_path_buf();
    assert!(dir.is_dir());
    let mut sleeper = KillOnDrop(Command::new("sleep").arg("60").spawn().expect("spawning sleep"));
    cgroup.add_pid(sleeper.0.id()).expect("moving sleep into the cgroup");
    assert_eq!(cgroup.pids().unwrap(), vec![sleeper.0.id()]);
    // The task is killed but not reaped (a zombie) while the guard removes the directory.
    drop(cgroup);
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
    assert_eq!(sleeper.0.wait().unwrap().signal(), Some(libc::SIGKILL));
}

#[test]
fn run_in_cgroup_starts_the_child_inside_the_cgroup() {
    skip_unless_privileged!();
    let cgroup = MemCgroup::create("tiermem-test", 64 * MIB).expect("creating a memory cgroup");
    let name = cgroup.path().file_name().unwrap().to_string_lossy().into_owned();
    let output = run_in_cgroup(&cgroup, Command::new("cat").arg("/proc/self/cgroup")).expect("running cat");
    assert!(output.status.success());
    let membership = String::from_utf8_lossy(&output.stdout);
    assert!(membership.lines().any(|line| line.ends_with(&format!("/{name}"))), "{membership}");
    let dir = cgroup.path().to_path_buf();
    cgroup.close().expect("removing the cgroup");
    assert!(!dir.exists());
}

#[test]
fn linux_swap_point_swaps_and_verifies() {
    skip_unless_privileged!();
    let dir = swap_scratch_dir();
    let worker = Path::new(env!("CARGO_BIN_EXE_tiermem"));
    let point = linux_swap_point_with_worker(64, 32, dir.path(), worker).expect("running the 64/32 MB point");
    let array = &point.array;
    assert_eq!(array.pages, 64 * MIB / PAGE_SIZE as u64);
    assert_eq!(array.mismatched_pages, 0, "{point:?}");
    assert_eq!(point.cgroup_oom_kills.unwrap_or(0), 0, "{point:?}");
    // Half the array cannot be resident, so reading it back must fault pages in from swap.
    assert!(array.read.major_faults > 0, "no major faults in the read pass: {point:?}");
    assert!(point.cgroup_major_faults.is_none_or(|faults| faults > 0), "{point:?}");
    assert!(point.cgroup_peak_bytes.is_none_or(|peak| peak <= 32 * MIB), "{point:?}");
    assert_no_leftovers(dir.path());
}

/// Kills a spawned process when the test ends early (a failed check), so it does not outlive it.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// However the interrupt test ends, a `tiermem bench micro` it started stops and undoes its setup
/// (SIGINT, then SIGKILL after 30 s), and what it may still have left is removed here: swap
/// files under the test's directory swapped off, cgroups named after its pid removed. Without
/// this a failed check would leave a 1 GiB benchmark paging through the tests that follow.
struct MicroRun {
    child: Option<std::process::Child>,
    swap_dir: PathBuf,
    hierarchy: PathBuf,
    cgroup_prefix: String,
}

impl Drop for MicroRun {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let swap_dir = std::fs::canonicalize(&self.swap_dir).unwrap_or_else(|_| self.swap_dir.clone());
        for path in active_swap_paths().unwrap_or_default().into_iter().filter(|p| p.starts_with(&swap_dir)) {
            let _ = Command::new("swapoff").arg(&path).status();
        }
        for entry in std::fs::read_dir(&self.hierarchy).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&self.cgroup_prefix) {
                let procs = std::fs::read_to_string(entry.path().join("cgroup.procs")).unwrap_or_default();
                for pid in procs.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }
}

/// Interrupting `tiermem bench micro` mid-run must leave neither the swap file nor the cgroup.
#[test]
fn sigint_during_a_run_cleans_up_and_exits_130() {
    skip_unless_privileged!();
    let dir = swap_scratch_dir();
    // Big enough to still be running when the signal arrives.
    let (_, hierarchy) = memory_hierarchy().unwrap();
    let tiermem = Command::new(env!("CARGO_BIN_EXE_tiermem"))
        .args(["bench", "micro", "--system", "linux-swap", "--size-mb", "1024", "--limit-mb", "64", "--dir"])
        .arg(dir.path())
        // A bench lock of its own: the test may run while a real benchmark holds the machine's.
        .env("TIERMEM_BENCH_LOCK", dir.path().join("bench.lock"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting tiermem");
    let pid = tiermem.id();
    let cgroup_prefix = format!("tiermem-micro-{pid}-");
    let mut run = MicroRun {
        child: Some(tiermem),
        swap_dir: dir.path().to_path_buf(),
        hierarchy: hierarchy.clone(),
        cgroup_prefix: cgroup_prefix.clone(),
    };
    let tiermem = run.child.as_mut().expect("just spawned");

    // Wait until the worker runs inside the cgroup, i.e. both resources exist.
    let deadline = Instant::now() + Duration::from_secs(60);
    let cgroup = loop {
        let found = std::fs::read_dir(&hierarchy)
            .unwrap()
            .filter_map(|entry| entry.ok().map(|entry| entry.path()))
            .find(|path| path.file_name().unwrap().to_string_lossy().starts_with(&cgroup_prefix));
        if let Some(cgroup) = found {
            let tasks = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
            if !tasks.trim().is_empty() {
                break cgroup;
            }
        }
        assert!(Instant::now() < deadline, "the worker never started");
        assert!(tiermem.try_wait().unwrap().is_none(), "tiermem exited early");
        std::thread::sleep(Duration::from_millis(10));
    };
    let swap_path: PathBuf = active_swap_paths()
        .unwrap()
        .into_iter()
        .find(|path| path.starts_with(std::fs::canonicalize(dir.path()).unwrap()))
        .expect("the swap file is active while the worker runs");

    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), rustix::process::Signal::INT)
        .unwrap();
    let output = run.child.take().expect("still ours").wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "stderr: {stderr}");
    assert!(!cgroup.exists(), "{} left behind; stderr: {stderr}", cgroup.display());
    assert!(!swap_is_active(&swap_path), "{} still active; stderr: {stderr}", swap_path.display());
    assert!(!swap_path.exists(), "{} left behind", swap_path.display());
}

fn assert_no_leftovers(swap_dir: &Path) {
    let swap_dir = std::fs::canonicalize(swap_dir).unwrap();
    let active: Vec<PathBuf> =
        active_swap_paths().unwrap().into_iter().filter(|path| path.starts_with(&swap_dir)).collect();
    assert!(active.is_empty(), "swap files still active: {active:?}");
    let files: Vec<PathBuf> =
        std::fs::read_dir(&swap_dir).unwrap().filter_map(|entry| entry.ok().map(|entry| entry.path())).collect();
    assert!(files.is_empty(), "files left in the swap directory: {files:?}");
    let (_, hierarchy) = memory_hierarchy().unwrap();
    let own_prefix = format!("tiermem-micro-{}-", std::process::id());
    let cgroups: Vec<PathBuf> = std::fs::read_dir(hierarchy)
        .unwrap()
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.file_name().unwrap().to_string_lossy().starts_with(&own_prefix))
        .collect();
    assert!(cgroups.is_empty(), "cgroups left behind: {cgroups:?}");
}

/// A run killed before its swapon leaves a swap file nothing lists as active: the next run
/// removes it from the swap directory if its owner is gone, and leaves a live owner's and
/// other files alone.
#[test]
fn a_swap_file_of_a_dead_run_never_swapped_on_is_removed() {
    skip_unless_privileged!();
    let dir = swap_scratch_dir();
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let ours = std::process::id();
    let file = |name: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, b"x").unwrap();
        path
    };
    let stale = file(format!("tiermem-swap-{dead}-0.swap"));
    let (live, other) = (file(format!("tiermem-swap-{ours}-0.swap")), file("mine.swap".into()));
    tiermem_cli::bench::linux_swap::remove_stale_leftovers(Some(dir.path()));
    assert!(!stale.exists(), "the dead run's file stayed");
    assert!(live.exists() && other.exists(), "a live run's or a foreign file went");
}

/// What a killed run left (its swap file still on, its cgroup still there) is removed by the
/// next run: names carry the owner's pid, and only a dead owner's leftovers go.
#[test]
fn leftovers_of_a_dead_run_are_removed_and_a_live_one_s_are_kept() {
    skip_unless_privileged!();
    let dir = swap_scratch_dir();
    // A pid that is gone: a child that ran and was reaped.
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let (_, hierarchy) = memory_hierarchy().unwrap();
    let stale_cgroup = hierarchy.join(format!("tiermem-stale-{dead}-0"));
    std::fs::create_dir(&stale_cgroup).unwrap();
    let stale_swap = dir.path().join(format!("tiermem-swap-{dead}-0.swap"));
    let made = Command::new("sh")
        .arg("-c")
        .arg(format!("fallocate -l 16M {0} && chmod 600 {0} && mkswap -q {0} && swapon {0}", stale_swap.display()))
        .status()
        .unwrap();
    if !made.success() {
        let _ = std::fs::remove_dir(&stale_cgroup);
        eprintln!("SKIPPED leftovers test: cannot make a swap file by hand here (fallocate/mkswap/swapon)");
        return;
    }
    // This test's own resources (a live pid) must survive the sweep.
    let live = MemCgroup::create("tiermem-test", 64 * MIB).expect("memory cgroup");
    tiermem_cli::bench::linux_swap::remove_stale_leftovers(None);
    let swap_left = swap_is_active(&stale_swap);
    if swap_left {
        let _ = Command::new("swapoff").arg(&stale_swap).status();
    }
    let cgroup_left = stale_cgroup.exists();
    if cgroup_left {
        let _ = std::fs::remove_dir(&stale_cgroup);
    }
    assert!(!swap_left && !stale_swap.exists(), "the dead run's swap file was kept");
    assert!(!cgroup_left, "the dead run's cgroup was kept");
    assert!(live.path().is_dir(), "a live run's cgroup was removed");
}
