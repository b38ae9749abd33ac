//! Stream locks while the program has one thread.
//!
//! glibc's stdio leaves its stream locks out while a process has a single thread. The engine's
//! threads end that for the whole process: from then on every getc, ungetc or ferror takes and
//! releases the stream's lock, two atomic instructions (on this VM a getc loop goes from 5.7 to
//! 35 ns per character, and igraph's reader of PageRank's text edge list ran 1.8x slower under
//! tiermem than without it). The engine's threads never use the program's streams, so while the
//! program itself has one thread, the streams it opens are switched to caller locking
//! (`__fsetlocking(fp, FSETLOCKING_BYCALLER)`, glibc's public API for "one thread uses this
//! stream"). Before the program starts a thread of its own, every stream switched so far goes
//! back to internal locking, for good.
//!
//! - Only streams the program opens after the engine has started are switched, through the
//!   interposed fopen family (never one in use: a flag change between a stdio call's lock and
//!   unlock would unbalance the lock).
//! - fclose, pclose and freopen get the stream back to internal locking first: glibc takes the
//!   lock, resets the stream's flags and releases the lock, which must see the same mode.
//! - Program threads are seen through pthread_create, thrd_create, timer_create / mq_notify
//!   with SIGEV_THREAD, the POSIX AIO submissions (glibc serves them on threads of its own,
//!   started inside the C library where no interposition sees them), getaddrinfo_a, and
//!   `clone()` or the clone system calls by number with CLONE_VM but not CLONE_VFORK
//!   ([`clone_coming`]).
//! - Switching back walks glibc's list of open streams, so a stream closed behind our back
//!   (inside the C library) is never touched again.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::alloc::real;

/// glibc's `struct _IO_FILE` up to its link in the list of open streams (public layout,
/// `<bits/types/struct_FILE.h>`, part of the C library's ABI).
#[repr(C)]
struct FileHead {
    flags: c_int,
    buffer_pointers: [*mut c_char; 11],
    markers: *mut c_void,
    chain: *mut FileHead,
}

const FSETLOCKING_INTERNAL: c_int = 1;
const FSETLOCKING_BYCALLER: c_int = 2;

extern "C" {
    static __libc_single_threaded: c_char;
    static _IO_list_all: *mut FileHead;
    fn _IO_list_lock();
    fn _IO_list_unlock();
    fn __fsetlocking(fp: *mut libc::FILE, kind: c_int) -> c_int;
}

/// Streams switched at most (beyond it new streams keep their locks).
const MAX_SWITCHED: usize = 4096;

/// New streams are switched: the engine runs and the program has shown no thread of its own.
static ACTIVE: AtomicBool = AtomicBool::new(false);
/// The program has (or may have) a thread of its own: nothing is switched again.
static PROGRAM_THREADED: AtomicBool = AtomicBool::new(false);
/// The streams switched and still open as far as we know. Only touched while ACTIVE, that is by
/// the program's one thread (the engine's threads never open streams), so a fork never finds it
/// held by another thread.
static SWITCHED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Streams switched to caller locking (for the statistics).
pub static STREAMS_UNLOCKED: AtomicU64 = AtomicU64::new(0);
/// Streams switched back when the program started a thread (for the statistics).
pub static STREAMS_RELOCKED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread is starting the engine: the threads it creates are the engine's.
    static STARTING_ENGINE: Cell<bool> = const { Cell::new(false) };
}

fn switched() -> MutexGuard<'static, Vec<usize>> {
    SWITCHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// At load, before the program runs: a process that already has threads is not single-threaded.
pub fn note_load() {
    // SAFETY: a plain read of glibc's public flag (<sys/single_threaded.h>).
    if unsafe { std::ptr::read_volatile(&raw const __libc_single_threaded) } == 0 {
        PROGRAM_THREADED.store(true, Ordering::Release);
    }
}

/// Whether the program has shown no thread of its own (besides the engine's).
pub fn program_single_threaded() -> bool {
    !PROGRAM_THREADED.load(Ordering::Acquire)
}

/// Run the engine's start-up: threads created inside are the engine's, not the program's.
pub fn starting_engine<R>(start: impl FnOnce() -> R) -> R {
    STARTING_ENGINE.with(|s| s.set(true));
    let result = start();
    STARTING_ENGINE.with(|s| s.set(false));
    result
}

/// The engine runs: from now on streams the program opens are switched, if it still has one thread.
pub fn activate(wanted: bool) {
    let _list = switched();
    if wanted && !PROGRAM_THREADED.load(Ordering::Acquire) {
        ACTIVE.store(true, Ordering::Release);
    }
}

/// A stream the program just opened.
fn opened(fp: *mut libc::FILE) -> *mut libc::FILE {
    if fp.is_null() || !ACTIVE.load(Ordering::Acquire) {
        return fp;
    }
    let mut list = switched();
    if ACTIVE.load(Ordering::Acquire) && list.len() < MAX_SWITCHED {
        // SAFETY: fp is an open stream the C library just returned, not in use by anyone yet.
        unsafe { __fsetlocking(fp, FSETLOCKING_BYCALLER) };
        list.push(fp as usize);
        STREAMS_UNLOCKED.fetch_add(1, Ordering::Relaxed);
    }
    fp
}

/// A stream about to be closed or reopened: back to internal locking if it was switched.
/// Returns whether it was.
fn closing(fp: *mut libc::FILE) -> bool {
    if fp.is_null() || !ACTIVE.load(Ordering::Acquire) {
        return false;
    }
    let mut list = switched();
    let Some(at) = list.iter().position(|&p| p == fp as usize) else { return false };
    list.swap_remove(at);
    // SAFETY: the caller hands us its open stream (the contract of fclose/freopen), and nothing
    // is inside a stdio call on it: the program has one thread, and it is here.
    unsafe { __fsetlocking(fp, FSETLOCKING_INTERNAL) };
    true
}

/// Every switched stream still open goes back to internal locking. Returns how many did.
fn relock_all(list: &mut Vec<usize>) -> u64 {
    let mut relocked = 0;
    if list.is_empty() {
        return relocked;
    }
    // SAFETY: glibc's lock of its list of open streams, released below.
    unsafe { _IO_list_lock() };
    // SAFETY: the list's head, read under its lock.
    let mut fp = unsafe { _IO_list_all };
    while !fp.is_null() {
        // A stream on the list is open; a pointer we recorded that is on it is the stream we
        // switched, or a newer one at the same address, which is in internal mode anyway.
        if list.contains(&(fp as usize)) {
            // SAFETY: an open stream (above); nothing is inside a stdio call on it, as the
            // program's one thread is here.
            unsafe { __fsetlocking(fp.cast(), FSETLOCKING_INTERNAL) };
            relocked += 1;
        }
        // SAFETY: an open stream's link to the next, read under the list's lock.
        fp = unsafe { (*fp).chain };
    }
    // SAFETY: the lock taken above.
    unsafe { _IO_list_unlock() };
    list.clear();
    relocked
}

/// A clone with these `flags` is about to be made: with CLONE_VM and without CLONE_VFORK the
/// child is a thread of the program (a vfork-like child shares the memory while its parent
/// waits, and runs no code of the program's beside it).
pub(crate) fn clone_coming(flags: u64) {
    if flags & libc::CLONE_VM as u64 != 0 && flags & libc::CLONE_VFORK as u64 == 0 {
        program_thread_coming();
    }
}

/// The program is about to get a second thread of its own (unless the engine is starting).
fn program_thread_coming() {
    if STARTING_ENGINE.with(Cell::get) {
        return;
    }
    PROGRAM_THREADED.store(true, Ordering::Release);
    crate::library_data::program_thread_coming();
    if ACTIVE.load(Ordering::Acquire) {
        let mut list = switched();
        ACTIVE.store(false, Ordering::Release);
        STREAMS_RELOCKED.fetch_add(relock_all(&mut list), Ordering::Relaxed);
    }
}

type OpenFn = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut libc::FILE;
type FdOpenFn = unsafe extern "C" fn(c_int, *const c_char) -> *mut libc::FILE;
type TmpFn = unsafe extern "C" fn() -> *mut libc::FILE;
type MemOpenFn = unsafe extern "C" fn(*mut c_void, usize, *const c_char) -> *mut libc::FILE;
type MemStreamFn = unsafe extern "C" fn(*mut *mut c_char, *mut usize) -> *mut libc::FILE;
type ReopenFn = unsafe extern "C" fn(*const c_char, *const c_char, *mut libc::FILE) -> *mut libc::FILE;
type CloseFn = unsafe extern "C" fn(*mut libc::FILE) -> c_int;
type CloseAllFn = unsafe extern "C" fn() -> c_int;
type ThreadFn = unsafe extern "C" fn(
    *mut libc::pthread_t,
    *const libc::pthread_attr_t,
    extern "C" fn(*mut c_void) -> *mut c_void,
    *mut c_void,
) -> c_int;
type ThrdFn = unsafe extern "C" fn(*mut libc::c_ulong, extern "C" fn(*mut c_void) -> c_int, *mut c_void) -> c_int;
type TimerFn = unsafe extern "C" fn(libc::clockid_t, *mut libc::sigevent, *mut libc::timer_t) -> c_int;
type MqNotifyFn = unsafe extern "C" fn(libc::mqd_t, *const libc::sigevent) -> c_int;
type AioFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type AioSyncFn = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;
/// lio_listio and getaddrinfo_a: a mode, a list of requests, its length, how to notify.
type ListIoFn = unsafe extern "C" fn(c_int, *const *mut c_void, c_int, *mut libc::sigevent) -> c_int;

/// Interpose `$name(path, mode)`-shaped openers: call the C library's, then switch the stream.
macro_rules! opener {
    ($name:ident, $symbol:literal, $ty:ty, ($($arg:ident: $argty:ty),*)) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $argty),*) -> *mut libc::FILE {
            let real = real!($symbol, $ty);
            // SAFETY: the caller's own call.
            opened(unsafe { real($($arg),*) })
        }
    };
}

opener!(fopen, "fopen", OpenFn, (path: *const c_char, mode: *const c_char));
opener!(fopen64, "fopen64", OpenFn, (path: *const c_char, mode: *const c_char));
opener!(fdopen, "fdopen", FdOpenFn, (fd: c_int, mode: *const c_char));
opener!(popen, "popen", OpenFn, (command: *const c_char, mode: *const c_char));
opener!(tmpfile, "tmpfile", TmpFn, ());
opener!(tmpfile64, "tmpfile64", TmpFn, ());
opener!(fmemopen, "fmemopen", MemOpenFn, (buf: *mut c_void, size: usize, mode: *const c_char));
opener!(open_memstream, "open_memstream", MemStreamFn, (ptr: *mut *mut c_char, size: *mut usize));

/// Interpose freopen-shaped calls: internal locking across the reopen, switched again after.
macro_rules! reopener {
    ($name:ident, $symbol:literal) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            path: *const c_char,
            mode: *const c_char,
            fp: *mut libc::FILE,
        ) -> *mut libc::FILE {
            let was_switched = closing(fp);
            let real = real!($symbol, ReopenFn);
            // SAFETY: the caller's own call.
            let reopened = unsafe { real(path, mode, fp) };
            if was_switched {
                opened(reopened)
            } else {
                reopened
            }
        }
    };
}

reopener!(freopen, "freopen");
reopener!(freopen64, "freopen64");

/// Interpose fclose-shaped calls: internal locking first.
macro_rules! closer {
    ($name:ident, $symbol:literal) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name(fp: *mut libc::FILE) -> c_int {
            closing(fp);
            let real = real!($symbol, CloseFn);
            // SAFETY: the caller's own call.
            unsafe { real(fp) }
        }
    };
}

closer!(fclose, "fclose");
closer!(pclose, "pclose");

/// # Safety
/// The C contract of fcloseall.
#[no_mangle]
pub unsafe extern "C" fn fcloseall() -> c_int {
    if ACTIVE.load(Ordering::Acquire) {
        relock_all(&mut switched()); // closing them all: not counted as relocked for threads
    }
    let real = real!("fcloseall", CloseAllFn);
    // SAFETY: the caller's own call.
    unsafe { real() }
}

/// # Safety
/// The C contract of pthread_create.
#[no_mangle]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    start: extern "C" fn(*mut c_void) -> *mut c_void,
    arg: *mut c_void,
) -> c_int {
    program_thread_coming();
    let real = real!("pthread_create", ThreadFn);
    // SAFETY: the caller's own call.
    unsafe { real(thread, attr, start, arg) }
}

/// # Safety
/// The C contract of thrd_create (C11 threads; glibc's does not go through pthread_create's
/// symbol).
#[no_mangle]
pub unsafe extern "C" fn thrd_create(
    thread: *mut libc::c_ulong,
    start: extern "C" fn(*mut c_void) -> c_int,
    arg: *mut c_void,
) -> c_int {
    program_thread_coming();
    let real = real!("thrd_create", ThrdFn);
    // SAFETY: the caller's own call.
    unsafe { real(thread, start, arg) }
}

fn notifies_on_a_thread(event: *const libc::sigevent) -> bool {
    // SAFETY: event is null or the caller's valid sigevent.
    unsafe { event.as_ref() }.is_some_and(|e| e.sigev_notify == libc::SIGEV_THREAD)
}

/// # Safety
/// The C contract of timer_create.
#[no_mangle]
pub unsafe extern "C" fn timer_create(
    clock: libc::clockid_t,
    event: *mut libc::sigevent,
    timer: *mut libc::timer_t,
) -> c_int {
    if notifies_on_a_thread(event) {
        program_thread_coming();
    }
    let real = real!("timer_create", TimerFn);
    // SAFETY: the caller's own call.
    unsafe { real(clock, event, timer) }
}

/// # Safety
/// The C contract of mq_notify.
#[no_mangle]
pub unsafe extern "C" fn mq_notify(queue: libc::mqd_t, event: *const libc::sigevent) -> c_int {
    if notifies_on_a_thread(event) {
        program_thread_coming();
    }
    let real = real!("mq_notify", MqNotifyFn);
    // SAFETY: the caller's own call.
    unsafe { real(queue, event) }
}

/// Interpose a call that hands work to threads the C library starts for it (POSIX AIO,
/// getaddrinfo_a): they are the program's threads as far as its locks and libraries' data go.
macro_rules! starts_threads {
    ($name:ident, $symbol:literal, $ty:ty, ($($arg:ident: $argty:ty),*)) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $argty),*) -> c_int {
            program_thread_coming();
            let real = real!($symbol, $ty);
            // SAFETY: the caller's own call.
            unsafe { real($($arg),*) }
        }
    };
}

starts_threads!(aio_read, "aio_read", AioFn, (request: *mut c_void));
starts_threads!(aio_read64, "aio_read64", AioFn, (request: *mut c_void));
starts_threads!(aio_write, "aio_write", AioFn, (request: *mut c_void));
starts_threads!(aio_write64, "aio_write64", AioFn, (request: *mut c_void));
starts_threads!(aio_fsync, "aio_fsync", AioSyncFn, (op: c_int, request: *mut c_void));
starts_threads!(aio_fsync64, "aio_fsync64", AioSyncFn, (op: c_int, request: *mut c_void));
starts_threads!(lio_listio, "lio_listio", ListIoFn, (mode: c_int, list: *const *mut c_void, n: c_int, event: *mut libc::sigevent));
starts_threads!(lio_listio64, "lio_listio64", ListIoFn, (mode: c_int, list: *const *mut c_void, n: c_int, event: *mut libc::sigevent));
starts_threads!(getaddrinfo_a, "getaddrinfo_a", ListIoFn, (mode: c_int, list: *const *mut c_void, n: c_int, event: *mut libc::sigevent));
