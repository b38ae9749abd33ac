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
/// until it is a zombie (it is still running its exit handlers before that). In doubt, yes.
fn program_threads_left() -> bool {
    match scan_threads() {
        Ok(left) => left,
        // The program may have used every descriptor it may have: look with a few more.
        Err(e) if e.raw_os_error() == Some(libc::EMFILE) => {
            crate::runtime::with_spare_descriptors(scan_threads).unwrap_or(true)
        }
        Err(_) => true,
    }
}

fn scan_threads() -> std::io::Result<bool> {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    // A thread that ended while being looked at is gone; any other failure is an error.
    let read = |path: std::path::PathBuf| match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH)) => Ok(None),
        Err(e) => Err(e),
    };
    for task in std::fs::read_dir("/proc/self/task")? {
        let task = task?;
        let Some(tid) = task.file_name().to_str().and_then(|name| name.parse::<i32>().ok()) else { continue };
        let alive = if tid == pid {
            // "pid (comm) S ...": the state follows the last ')'.
            let Some(stat) = read(task.path().join("stat"))? else { continue };
            let state = stat.iter().rposition(|&b| b == b')').and_then(|i| stat.get(i + 2)).copied();
            !matches!(state, Some(b'Z' | b'X'))
        } else {
            let Some(comm) = read(task.path().join("comm"))? else { continue };
            !OWN_THREAD_PREFIXES.iter().any(|prefix| comm.starts_with(prefix))
        };
        if alive {
            return Ok(true);
        }
    }
    Ok(false)
}
