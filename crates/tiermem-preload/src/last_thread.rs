//! A program whose main thread ends with `pthread_exit` ends when its last thread does: glibc
//! calls `exit(0)` once no thread is left. tiermem's own threads (the engine's, named
//! `tiermem-*`) are threads to glibc too, so such a program used to hang after its last thread
//! finished. When the main thread calls `pthread_exit` (or C11's `thrd_exit`), a watcher thread
//! starts and calls `exit(0)` once only tiermem's threads remain, as glibc would have.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::alloc::real;

/// Name prefixes of the threads tiermem starts in the program's process, and of the kernel's
/// io_uring workers serving its rings (which the kernel lists among the process's threads).
const OWN_THREAD_PREFIXES: [&[u8]; 2] = [b"tiermem-", b"iou-"];

/// # Safety
/// The C contract of pthread_exit.
#[no_mangle]
pub unsafe extern "C" fn pthread_exit(value: *mut c_void) -> ! {
    if rustix::thread::gettid() == rustix::process::getpid() {
        watch_for_the_last_program_thread();
    }
    let real = real!("pthread_exit", unsafe extern "C" fn(*mut c_void) -> !);
    // SAFETY: the caller's own pthread_exit.
    unsafe { real(value) }
}

/// # Safety
/// The C contract of thrd_exit (C11 threads; the C library ends the thread without going
/// through `pthread_exit`'s symbol).
#[no_mangle]
pub unsafe extern "C" fn thrd_exit(result: i32) -> ! {
    if rustix::thread::gettid() == rustix::process::getpid() {
        watch_for_the_last_program_thread();
    }
    let real = real!("thrd_exit", unsafe extern "C" fn(i32) -> !);
    // SAFETY: the caller's own thrd_exit.
    unsafe { real(result) }
}

fn watch_for_the_last_program_thread() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    if STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    let watcher = std::thread::Builder::new().name("tiermem-lastexit".into()).spawn(|| loop {
        std::thread::sleep(Duration::from_millis(20));
        if !program_threads_left() {
            // SAFETY: what glibc does when the last thread ends: exit handlers, then the exit.
            unsafe { libc::exit(0) };
        }
    });
    if watcher.is_err() {
        crate::runtime::say(&["tiermem: cannot watch for the program's last thread; it may not exit by itself"]);
    }
}

/// Whether a thread of the program (not tiermem's) is still running. The main thread counts
/// until it is a zombie (it is still running its exit handlers before that).
fn program_threads_left() -> bool {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return true };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|name| name.parse::<i32>().ok()) else { continue };
        let alive = if tid == pid {
            // "pid (comm) S ...": the state follows the last ')'.
            let stat = std::fs::read(task.path().join("stat")).unwrap_or_default();
            let state = stat.iter().rposition(|&b| b == b')').and_then(|i| stat.get(i + 2)).copied();
            !matches!(state, Some(b'Z' | b'X') | None)
        } else {
            let comm = std::fs::read(task.path().join("comm")).unwrap_or_default();
            !comm.is_empty() && !OWN_THREAD_PREFIXES.iter().any(|prefix| comm.starts_with(prefix))
        };
        if alive {
            return true;
        }
    }
    false
}
