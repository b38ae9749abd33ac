//! This process's report: its statistics (`TIERMEM_STATS_DIR/<pid>-<image>.json`, which the
//! launcher sums up) and the tail of its fault trace, written once as it ends, and snapshots of the
//! statistics while it runs.
//!
//! A process that ends through `_exit` (Python's `os._exit`, a program that skips its exit
//! handlers on purpose) runs no `atexit` handler, so its statistics and the tail of its fault
//! trace used to be lost.
//!
//! `_exit` may be called from a signal handler that interrupted anything, the C library's malloc
//! included, so the exiting thread writes nothing itself: it wakes a thread of ours, started
//! with the engine, which writes the report (allocating as it likes, on its own malloc arena),
//! and waits for it with only async-signal-safe calls (an atomic store, a futex wake,
//! `clock_gettime`, `nanosleep`). Should the reporter be stuck behind a lock the exiting thread
//! holds, the wait ends after [`REPORT_WAIT`] and the process ends unreported, as before.
//!
//! A process can also end with no report at all: by a fatal signal, `exec` (see [`crate::exec`]
//! for the calls that write one first) or a raw `exit_group` system call. For those the same
//! thread writes a snapshot of the statistics every [`SNAPSHOT_EVERY`] (marked `"final":
//! false`), which the final report replaces; the launcher shows a snapshot for what it is.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tiermem_engine::STATISTICS_SNAPSHOT_EVERY as SNAPSHOT_EVERY;
use tiermem_sys::guarded_fd::Guarded;

use crate::cgroup_watch::{
    BALLAST_BYTES, BALLAST_RELEASES, FILE_FAULT_REFAULTS, FILE_REFAULTS, LOWEST_BUDGET, OOM_RESCUES, PEAK_FILE_ROOM,
};
use crate::runtime::{
    engine, in_forked_child, in_vfork_child, say, with_spare_descriptors, CALLS_RETRIED, COMMITTED_ALLOCATIONS,
    COMMITTED_BYTES, ENGINE, FALLBACK_ALLOCATIONS, FIXED_ALLOCATIONS, FORKS_REFUSED, MANAGED_ALLOCATIONS,
    MANAGED_BYTES, PEAK_MANAGED_BYTES, REUSED_ALLOCATIONS, SETTINGS, SYSCALLS_WRAPPED, TAKEN_BACK,
};

/// The longest `_exit` waits for the report.
const REPORT_WAIT: Duration = Duration::from_secs(2);
/// The longest an `exec` waits for the statistics (past it, the last snapshot stands).
const EXEC_REPORT_WAIT: Duration = Duration::from_millis(500);

/// The reporter thread, once started.
static REPORTER: OnceLock<std::thread::Thread> = OnceLock::new();
/// Set by `_exit`: the reporter is to write the report.
static REQUESTED: AtomicBool = AtomicBool::new(false);
/// Set by an `exec`: the reporter is to write the statistics as they stand.
static EXEC_REQUESTED: AtomicBool = AtomicBool::new(false);
/// Statistics written for an `exec` so far: the exec'ing thread waits for this to move.
static EXEC_REPORTS: AtomicU64 = AtomicU64::new(0);

/// Once the engine runs (before that there is nothing to report): tell the launcher this process
/// manages memory, so that one ending before its first report is not summed up as one that
/// allocated nothing, and start the reporter thread (snapshots, and the report of a process
/// ending through `_exit`, which runs no exit handler).
pub(crate) fn start_reporting(settings: &tiermem_engine::RunSettings) {
    if let Some(dir) = &settings.stats_dir {
        let _ = std::fs::File::create(statistics_path(dir).with_extension("started"));
    }
    start_reporter();
    if settings.stats_dir.is_some() {
        crate::terminating::start();
    }
}

fn start_reporter() {
    // Started before the OOM guard goes on (`tiermem_sys::threads`).
    let spawned = tiermem_sys::threads::spawn_running("tiermem-report", Some(256 << 10), || {
        let mut next_snapshot = Instant::now() + SNAPSHOT_EVERY;
        while !REQUESTED.load(Ordering::Acquire) {
            if EXEC_REQUESTED.swap(false, Ordering::AcqRel) {
                write_before_exec();
                EXEC_REPORTS.fetch_add(1, Ordering::Release);
                continue;
            }
            let now = Instant::now();
            if now >= next_snapshot {
                write_snapshot();
                next_snapshot = now + SNAPSHOT_EVERY;
            } else {
                std::thread::park_timeout(next_snapshot - now);
            }
        }
        report_once();
    });
    match spawned {
        Ok(handle) => {
            let _ = REPORTER.set(handle.thread().clone());
        }
        Err(e) => say(&[
            "tiermem: cannot start the thread that writes snapshots of the statistics (",
            &e.to_string(),
            "); an end through _exit, a signal or exec goes unreported",
        ]),
    }
}

/// Have the report written before the process ends through `_exit`, waiting at most
/// [`REPORT_WAIT`]. Nothing in a forked child (whose engine is its parent's) or a vfork child
/// (which shares its parent's memory), nor before the engine started.
fn report_before_exit() {
    report_before_the_end("_exit");
}

/// Have the report written before a signal ends the process ([`crate::terminating`]), as
/// [`report_before_exit`] does.
pub(crate) fn report_before_signal_death() {
    report_before_the_end("a signal");
}

fn report_before_the_end(cause: &str) {
    if in_forked_child() || in_vfork_child() || report_written() {
        return;
    }
    let Some(reporter) = REPORTER.get() else { return };
    REQUESTED.store(true, Ordering::Release);
    // Unparking is an atomic swap and a futex wake: it neither allocates nor locks.
    reporter.unpark();
    let asked = Instant::now();
    while !report_written() {
        if asked.elapsed() > REPORT_WAIT {
            say(&["tiermem: the statistics were not written within 2 s of ", cause, "; the process ends unreported"]);
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// End the process now, as `_exit` does (every thread, no handlers), without a report.
pub(crate) fn exit_now(status: i32) -> ! {
    // SAFETY: exit_group takes an int and ends every thread of the process; it does not return.
    unsafe { libc::syscall(libc::SYS_exit_group, status) };
    unreachable!("exit_group returned")
}

/// This image is about to be replaced by `exec`: have the reporter finish its fault trace and
/// write its statistics as they stand, as a final report (a failed `exec` goes on untraced, and
/// the statistics it writes later replace these), waiting at most [`EXEC_REPORT_WAIT`] with
/// only async-signal-safe calls, as `_exit` does (`exec` may be called from a signal handler).
/// Nothing in a forked or vfork child, whose engine is its parent's, nor before the engine
/// started.
pub(crate) fn before_exec() {
    if in_forked_child() || in_vfork_child() || report_written() {
        return;
    }
    let Some(reporter) = REPORTER.get() else { return };
    let done = EXEC_REPORTS.load(Ordering::Acquire);
    EXEC_REQUESTED.store(true, Ordering::Release);
    reporter.unpark();
    let asked = Instant::now();
    while EXEC_REPORTS.load(Ordering::Acquire) == done && asked.elapsed() < EXEC_REPORT_WAIT {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The trace and statistics of an image about to `exec`, the statistics written as final,
/// unless the final report has begun.
fn write_before_exec() {
    let _writing = REPORT_FILE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if REPORT_STATE.load(Ordering::Acquire) == REPORT_NOT_BEGUN {
        if let Some(engine) = ENGINE.get() {
            engine.finish_trace();
        }
        write_statistics(true);
    }
}

/// # Safety
/// The C contract of `_exit`.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: i32) -> ! {
    report_before_exit();
    exit_now(status)
}

/// # Safety
/// The C contract of `_Exit` (C99's name for `_exit`, a symbol of its own in glibc).
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: i32) -> ! {
    report_before_exit();
    exit_now(status)
}

pub(crate) extern "C" fn at_exit() {
    if in_forked_child() || in_vfork_child() {
        return;
    }
    report_once();
}

/// Where this process's report (the trace's tail, the statistics) stands.
static REPORT_STATE: AtomicU8 = AtomicU8::new(REPORT_NOT_BEGUN);
const REPORT_NOT_BEGUN: u8 = 0;
const REPORT_BEING_WRITTEN: u8 = 1;
const REPORT_WRITTEN: u8 = 2;

/// Whether this process's report is written.
pub(crate) fn report_written() -> bool {
    REPORT_STATE.load(Ordering::Acquire) == REPORT_WRITTEN
}

/// Serializes the writes of this process's statistics file (snapshots and the final report).
static REPORT_FILE_LOCK: Mutex<()> = Mutex::new(());

/// Finish the trace and write the statistics, once per process: from the exit handlers, or
/// from the reporter thread when the program ends through `_exit`. A second caller while the
/// first writes waits for it, so that a process ending through `exit` on one thread and `_exit`
/// on another is not cut off in the middle of its file (the `_exit` side bounds its wait).
pub(crate) fn report_once() {
    match REPORT_STATE.compare_exchange(REPORT_NOT_BEGUN, REPORT_BEING_WRITTEN, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            if let (Some(engine), Some(_)) = (ENGINE.get(), SETTINGS.get()) {
                engine.finish_trace();
                // The engine is never dropped here: what its DAMON source set up outside the
                // process (a tracefs instance) goes now.
                engine.stop_damon();
            }
            let _writing = REPORT_FILE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
            write_statistics(true);
            REPORT_STATE.store(REPORT_WRITTEN, Ordering::Release);
        }
        Err(_) => {
            while !report_written() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Write the statistics so far, marked as a snapshot, unless the final report has begun: what
/// the launcher shows for a process that ends without writing its final report (a signal,
/// `exec`, a raw `exit_group`). Silent on failure: the statistics directory is gone once the
/// launcher has read it, and a process that outlives the run would say so every time.
pub(crate) fn write_snapshot() {
    let _writing = REPORT_FILE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if REPORT_STATE.load(Ordering::Acquire) == REPORT_NOT_BEGUN {
        write_statistics(false);
    }
}

/// Write this process's statistics file, the final report or a snapshot (`complete`). The
/// caller holds [`REPORT_FILE_LOCK`].
fn write_statistics(complete: bool) {
    let (Some(engine), Some(settings)) = (ENGINE.get(), SETTINGS.get()) else { return };
    let Some(dir) = &settings.stats_dir else { return };
    let lowest = LOWEST_BUDGET.load(Ordering::Relaxed);
    let report = serde_json::json!({
        "pid": std::process::id(),
        // Tells apart the images of one pid (`exec`), in the order they ran.
        "image": crate::runtime::image_key(),
        // false in a snapshot, written while the process ran.
        "final": complete,
        "program": std::env::args().next().unwrap_or_default(),
        "engine": engine.stats(),
        "device": engine.device_counters(),
        "limit_bytes": engine.config().limit_bytes,
        "lowest_budget_bytes": (lowest != u64::MAX).then_some(lowest),
        "oom_rescues": OOM_RESCUES.load(Ordering::Relaxed),
        "oom_ballast_releases": BALLAST_RELEASES.load(Ordering::Relaxed),
        "forks_refused": FORKS_REFUSED.load(Ordering::Relaxed),
        "file_refaults": FILE_REFAULTS.load(Ordering::Relaxed),
        "file_fault_refaults": FILE_FAULT_REFAULTS.load(Ordering::Relaxed),
        "peak_file_room_bytes": PEAK_FILE_ROOM.load(Ordering::Relaxed),
        "fault_mode": engine.config().fault_mode.to_string(),
        "dirty_tracking": engine.dirty_tracking(),
        "device_description": engine.describe(),
        "managed_allocations": MANAGED_ALLOCATIONS.load(Ordering::Relaxed),
        "managed_bytes": MANAGED_BYTES.load(Ordering::Relaxed),
        "peak_managed_bytes": PEAK_MANAGED_BYTES.load(Ordering::Relaxed),
        "fallback_allocations": FALLBACK_ALLOCATIONS.load(Ordering::Relaxed),
        "reused_allocations": REUSED_ALLOCATIONS.load(Ordering::Relaxed),
        "fixed_allocations": FIXED_ALLOCATIONS.load(Ordering::Relaxed),
        "pieces_taken_back": TAKEN_BACK.load(Ordering::Relaxed),
        "committed_allocations": COMMITTED_ALLOCATIONS.load(Ordering::Relaxed),
        "committed_bytes": COMMITTED_BYTES.load(Ordering::Relaxed),
        "small_heap_allocations": crate::heap::ALLOCATIONS.load(Ordering::Relaxed),
        "small_heap_bytes": crate::heap::CHUNK_BYTES.load(Ordering::Relaxed),
        "small_heap_dead_pages_forgotten": crate::heap::DEAD_PAGES_FORGOTTEN.load(Ordering::Relaxed),
        "library_data_runs": crate::library_data::RUNS.load(Ordering::Relaxed),
        "library_data_bytes": crate::library_data::BYTES.load(Ordering::Relaxed),
        "library_data_pages_with_data": crate::library_data::PAGES_WITH_DATA.load(Ordering::Relaxed),
        "library_data_segments_left": crate::library_data::SEGMENTS_LEFT.load(Ordering::Relaxed),
        "library_data_runs_given_back": crate::library_data::RUNS_GIVEN_BACK.load(Ordering::Relaxed),
        "syscalls_wrapped": SYSCALLS_WRAPPED.load(Ordering::Relaxed),
        "calls_retried_for_memory": CALLS_RETRIED.load(Ordering::Relaxed),
        "stdio_streams_unlocked": crate::stdio::STREAMS_UNLOCKED.load(Ordering::Relaxed),
        "stdio_streams_relocked": crate::stdio::STREAMS_RELOCKED.load(Ordering::Relaxed),
        "engine_reserve_bytes": crate::reserve::USED_BYTES.load(Ordering::Relaxed),
        // tiermem's own memory beside the budget: what its Rust code allocated (page state,
        // policy tables, statistics; at most, over the run), the I/O buffers, the OOM guard's
        // ballast and the engine's reserve.
        "own_heap_peak_bytes": crate::libc_alloc::PEAK_BYTES.load(Ordering::Relaxed),
        "io_buffer_bytes": engine.io_buffer_bytes(),
        "guard_ballast_bytes": BALLAST_BYTES.load(Ordering::Relaxed),
        "engine_reserve_size_bytes": crate::reserve::size(),
        "engine_reserve_fallbacks": crate::reserve::FALLBACKS.load(Ordering::Relaxed),
        "engine_reserve_rescues": crate::reserve::RESCUES.load(Ordering::Relaxed),
    });
    let path = statistics_path(dir);
    let text = report.to_string();
    // Whole or not at all where a process may be killed in the middle: a snapshot goes to a
    // file of its own, renamed over the last. The file made before the program gave up root is
    // rewritten in place (the directory may no longer be writable); the launcher counts one it
    // cannot read as unreported.
    let replace = || {
        let partial = path.with_extension("json.partial");
        std::fs::write(&partial, &text).and_then(|()| std::fs::rename(&partial, &path))
    };
    let rewrite = |file: &std::fs::File| {
        use std::os::unix::fs::FileExt;
        file.set_len(0).and_then(|()| file.write_all_at(text.as_bytes(), 0))
    };
    let written = match STATISTICS_FILE.get().map(|file| rewrite(file)).unwrap_or_else(replace) {
        // A program that ends with every descriptor in use still gets its statistics (not a
        // snapshot: raising the limit for a moment could let one of the program's own calls
        // succeed that should fail).
        Err(e) if complete && e.raw_os_error() == Some(libc::EMFILE) => with_spare_descriptors(replace),
        other => other,
    };
    if let (Err(e), true) = (written, complete) {
        // A directory gone means the launcher has collected the run's statistics and left: a
        // process that outlived it by more than its wait has nobody to report to.
        if e.kind() == std::io::ErrorKind::NotFound && !dir.exists() {
            return;
        }
        say(&["tiermem: cannot write statistics to ", &path.display().to_string(), ": ", &e.to_string()]);
    }
}

/// This process's statistics file, opened before the program gave up the privileges that let
/// it create one in the statistics directory (see [`crate::privileges`]).
static STATISTICS_FILE: OnceLock<Guarded<std::fs::File>> = OnceLock::new();

fn statistics_path(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join(format!("{}.json", crate::runtime::image_file_stem()))
}

/// The program is about to give up root (setuid and kin): do now what needs it later. The
/// engine starts (its userfaultfd then serves faults taken inside system calls, which an
/// unprivileged process may not ask for, and its device and trace files are made with the
/// rights the run began with), and the statistics file is created, to be written at exit.
pub fn before_dropping_privileges() {
    if in_forked_child() || in_vfork_child() {
        return;
    }
    let Some(settings) = SETTINGS.get() else { return };
    engine();
    if let Some(dir) = &settings.stats_dir {
        if STATISTICS_FILE.get().is_none() {
            match std::fs::File::options().write(true).create(true).truncate(true).open(statistics_path(dir)) {
                Ok(file) => {
                    let _ = STATISTICS_FILE.set(Guarded::new(file));
                }
                Err(e) => say(&["tiermem: cannot create the statistics file: ", &e.to_string()]),
            }
        }
    }
}
