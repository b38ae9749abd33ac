//! The report of a process that ends through `_exit` (Python's `os._exit`, a program that skips
//! its exit handlers on purpose): glibc then runs no `atexit` handler, so its statistics and the
//! tail of its fault trace used to be lost.
//!
//! `_exit` may be called from a signal handler that interrupted anything, the C library's malloc
//! included, so the exiting thread writes nothing itself: it wakes a thread of ours, started
//! with the engine, which writes the report (allocating as it likes, on its own malloc arena),
//! and waits for it with only async-signal-safe calls (an atomic store, a futex wake,
//! `clock_gettime`, `nanosleep`). Should the reporter be stuck behind a lock the exiting thread
//! holds, the wait ends after [`REPORT_WAIT`] and the process ends unreported, as before.
//!
//! A process can also end with no report at all: by a fatal signal, `exec` or a raw
//! `exit_group` system call. For those the same thread writes a snapshot of the statistics
//! every [`SNAPSHOT_EVERY`] (marked `"final": false`), which the final report replaces; the
//! launcher shows a snapshot for what it is.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tiermem_engine::STATISTICS_SNAPSHOT_EVERY as SNAPSHOT_EVERY;

use crate::runtime::{in_forked_child, in_vfork_child, report_once, report_written, say, write_snapshot};

/// The longest `_exit` waits for the report.
const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The reporter thread, once started.
static REPORTER: OnceLock<std::thread::Thread> = OnceLock::new();
/// Set by `_exit`: the reporter is to write the report.
static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Start the reporter thread (once the engine runs: before that there is nothing to report).
pub(crate) fn start_reporter() {
    let spawned = std::thread::Builder::new().name("tiermem-report".into()).stack_size(256 << 10).spawn(|| {
        let mut next_snapshot = Instant::now() + SNAPSHOT_EVERY;
        while !REQUESTED.load(Ordering::Acquire) {
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
            "tiermem: cannot start the thread that reports a process ending through _exit (",
            &e.to_string(),
            "); such an end goes unreported",
        ]),
    }
}

/// Have the report written before the process ends through `_exit`, waiting at most
/// [`REPORT_WAIT`]. Nothing in a forked child (whose engine is its parent's) or a vfork child
/// (which shares its parent's memory), nor before the engine started.
fn report_before_exit() {
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
            say(&["tiermem: the statistics were not written within 2 s of _exit; the process ends unreported"]);
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
