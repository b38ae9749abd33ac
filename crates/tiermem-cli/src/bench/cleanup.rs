//! A process-wide registry of system resources that must not outlive the process (active swap
//! files, memory cgroups), torn down on drop, on panic and on SIGINT/SIGTERM/SIGHUP/SIGQUIT.
//!
//! How it works:
//! - Each resource is created *while holding the registry lock* and registered with a teardown
//!   closure before the lock is released, so there is no window in which it exists unregistered.
//! - Dropping the resource's guard removes its entry and runs the teardown, again under the lock.
//!   Whoever removes an entry runs it, so each teardown runs exactly once.
//! - Signals: the handler only writes the signal number to a self-pipe (`write` is async-signal
//!   safe; nothing else is done in signal context). A dedicated thread blocks reading the pipe; when
//!   a byte arrives it takes the lock (waiting for any teardown in progress), marks the registry as
//!   shutting down so no new resource can be created, tears everything down newest-first (cgroups
//!   before the swap file their tasks swapped to, which makes swapoff cheap) and exits with
//!   128 + signal number (130 for Ctrl-C). Further signals during that cleanup are absorbed by the
//!   handler so the cleanup is not cut short; SIGKILL of course still works.
//! - A forked child that has not exec'ed yet inherits the handler; the handler notices it is not
//!   running in the process that installed it and re-raises the signal with the default action.
//! - Panics: with `panic = "unwind"` the guards' destructors run during unwinding. With
//!   `panic = "abort"` (the release profile) they never run, so a panic hook tears everything down
//!   before the abort.

use std::io::Read;
use std::os::fd::IntoRawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard, Once, TryLockError};
use std::time::{Duration, Instant};

use tiermem_sys::{Error, ErrorKind, Result};

/// Undoes one resource. Runs at most once, with the registry locked.
pub(crate) type Teardown = Box<dyn FnOnce() -> Result<()> + Send>;

struct Entry {
    id: u64,
    label: String,
    teardown: Teardown,
}

struct Registry {
    next_id: u64,
    entries: Vec<Entry>,
    shutting_down: bool,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry { next_id: 0, entries: Vec::new(), shutting_down: false });

/// Write end of the self-pipe, or -1 before [`install`].
static SIGNAL_PIPE_WRITE_FD: AtomicI32 = AtomicI32::new(-1);
/// The pid of the process that installed the handler (forked children must not use the pipe).
static HANDLER_OWNER_PID: AtomicI32 = AtomicI32::new(0);

const CLEANUP_SIGNALS: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// How long the panic hook waits for the registry lock before giving up.
const PANIC_LOCK_WAIT: Duration = Duration::from_secs(2);

/// Ticket for a registered resource; give it back to [`release`].
#[derive(Debug)]
pub(crate) struct CleanupId(u64);

fn lock_registry() -> MutexGuard<'static, Registry> {
    // A teardown that panicked leaves the registry itself consistent, so poisoning is ignored.
    REGISTRY.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Install the signal handlers, the cleanup thread and (for abort builds) the panic hook. Idempotent;
/// called automatically before the first resource is registered. Replaces any earlier handlers of
/// SIGINT, SIGTERM, SIGHUP and SIGQUIT.
pub fn install() {
    static INSTALLED: Once = Once::new();
    INSTALLED.call_once(|| {
        if let Err(e) = install_signal_handlers() {
            eprintln!("tiermem: warning: cannot install the cleanup signal handler ({e}); Ctrl-C may leave swap files or cgroups behind");
        }
        if cfg!(panic = "abort") {
            let previous_hook = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                previous_hook(info);
                cleanup_after_panic();
            }));
        }
    });
}

fn install_signal_handlers() -> Result<()> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| Error::os(e.into(), "creating the cleanup self-pipe"))?;
    HANDLER_OWNER_PID.store(rustix::process::getpid().as_raw_nonzero().get(), Ordering::SeqCst);
    // The write end lives for the rest of the process: the handler may fire at any time.
    SIGNAL_PIPE_WRITE_FD.store(write_end.into_raw_fd(), Ordering::SeqCst);

    std::thread::Builder::new()
        .name("tiermem-cleanup".into())
        .spawn(move || {
            let mut pipe = std::fs::File::from(read_end);
            let mut signal_byte = [0u8; 1];
            loop {
                match pipe.read(&mut signal_byte) {
                    Ok(1) => break,
                    Ok(_) => return, // write end closed: nothing will ever arrive
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => return,
                }
            }
            let signal = libc::c_int::from(signal_byte[0]);
            let mut registry = lock_registry();
            registry.shutting_down = true;
            teardown_all(&mut registry);
            // Said after the teardown, not before: stderr may be a pipe nobody reads any more (a
            // harness that has stopped listening), and a write to a full one would block the
            // teardown until the harness kills this process outright.
            eprintln!("tiermem: caught signal {signal}; removed swap files and cgroups before exiting");
            std::process::exit(128 + signal);
        })
        .map_err(|e| Error::os(e, "starting the cleanup thread"))?;

    for signal in CLEANUP_SIGNALS {
        // SAFETY: an all-zero sigaction is a valid value (no flags, empty mask) that we fill in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_cleanup_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SA_RESTART: the main thread's blocking calls (waitpid, read) continue rather than fail.
        action.sa_flags = libc::SA_RESTART;
        // SAFETY: sa_mask is a sigset_t we own.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: valid signal number, valid action; the handler is async-signal safe (see below).
        let rc = unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(Error::os(
                std::io::Error::last_os_error(),
                format!("installing the handler for signal {signal}"),
            ));
        }
    }
    Ok(())
}

/// The signal handler. Only async-signal-safe calls: getpid, write, signal, raise (rustix makes the
/// raw system calls and leaves errno alone).
extern "C" fn on_cleanup_signal(signal: libc::c_int) {
    if rustix::process::getpid().as_raw_nonzero().get() != HANDLER_OWNER_PID.load(Ordering::Relaxed) {
        // A forked child before exec: behave as if no handler were installed.
        // SAFETY: restoring the default disposition of a valid signal number.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
        // SAFETY: raising a valid signal in the current thread.
        unsafe { libc::raise(signal) };
        return;
    }
    let fd = SIGNAL_PIPE_WRITE_FD.load(Ordering::Relaxed);
    if fd < 0 {
        return;
    }
    // SAFETY: fd is the pipe's write end, which is never closed once stored.
    let pipe = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    // A full pipe (many signals) just drops the byte: one is enough to start the cleanup.
    let _ = rustix::io::write(pipe, &[signal as u8]);
}

/// Create a resource and register its teardown atomically with respect to signal cleanup.
///
/// `create` runs with the registry locked and must return the resource, a label naming it in
/// error messages, and the closure that undoes it; if `create` fails it must have undone its own
/// partial work.
pub(crate) fn create_registered<T>(create: impl FnOnce() -> Result<(T, String, Teardown)>) -> Result<(T, CleanupId)> {
    install();
    let mut registry = lock_registry();
    if registry.shutting_down {
        return Err(Error::new(
            ErrorKind::Internal,
            "not creating new resources: the process is shutting down after a signal",
        ));
    }
    let (resource, label, teardown) = create()?;
    let id = registry.next_id;
    registry.next_id += 1;
    registry.entries.push(Entry { id, label, teardown });
    Ok((resource, CleanupId(id)))
}

/// Run `action` only if the resource is still registered (not yet torn down by a signal), with the
/// registry locked so that a teardown cannot run concurrently. `None` if it was already torn down.
pub(crate) fn while_registered<R>(id: &CleanupId, action: impl FnOnce() -> R) -> Option<R> {
    let registry = lock_registry();
    if registry.entries.iter().any(|entry| entry.id == id.0) {
        let result = action();
        drop(registry);
        Some(result)
    } else {
        None
    }
}

/// Tear down one resource now. A no-op if the signal path already did it.
pub(crate) fn release(id: CleanupId) -> Result<()> {
    let mut registry = lock_registry();
    let Some(position) = registry.entries.iter().position(|entry| entry.id == id.0) else {
        return Ok(());
    };
    let entry = registry.entries.remove(position);
    // Teardown runs with the lock held: a signal arriving now waits for it instead of exiting the
    // process halfway through a swapoff.
    let result = (entry.teardown)().map_err(|e| e.context(format!("cleaning up {}", entry.label)));
    drop(registry);
    result
}

/// Tear down every registered resource, newest first, reporting failures on stderr. Used by the
/// signal and panic paths; normal code releases resources by dropping their guards.
pub fn cleanup_all() {
    teardown_all(&mut lock_registry());
}

fn teardown_all(registry: &mut Registry) {
    while let Some(entry) = registry.entries.pop() {
        if let Err(e) = (entry.teardown)() {
            eprintln!("tiermem: error: cleaning up {}: {e}", entry.label);
        }
    }
}

fn cleanup_after_panic() {
    let deadline = Instant::now() + PANIC_LOCK_WAIT;
    loop {
        match REGISTRY.try_lock() {
            Ok(mut registry) => return teardown_all(&mut registry),
            Err(TryLockError::Poisoned(poisoned)) => return teardown_all(&mut poisoned.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(TryLockError::WouldBlock) => {
                eprintln!("tiermem: error: panic while the cleanup registry was busy; check /proc/swaps and the memory cgroup hierarchy for tiermem leftovers");
                return;
            }
        }
    }
}

/// Labels of the resources currently registered (for tests and diagnostics).
pub fn registered_labels() -> Vec<String> {
    lock_registry().entries.iter().map(|entry| entry.label.clone()).collect()
}
