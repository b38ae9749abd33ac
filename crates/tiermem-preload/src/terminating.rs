//! Signals that end a program by default (SIGTERM, SIGINT, SIGHUP) have its report written
//! first.
//!
//! A process ended by a signal it leaves at the default action runs no exit handler, so its
//! statistics were only its last snapshot, and none at all within 2 s of its engine's start:
//! Python's multiprocessing pool ends its workers with SIGTERM, `tiermem run` passes a Ctrl-C or
//! SIGTERM on to the program, and a benchmark's time limit ends a run the same way. While the
//! engine runs and the program leaves one of these signals at its default action, a handler of
//! the shim's stands in for that action: it has the report written as `_exit` does (at most 2 s,
//! async-signal-safe calls only), puts the default action back and raises the signal again, so
//! the process ends by it, as it would have. The program sees the default action in every
//! `sigaction` and `signal` query; a handler it installs (or SIG_IGN) replaces the stand-in, and
//! the default action it puts back brings the stand-in back.
//!
//! Not seen: an action set by the `rt_sigaction` system call made by number or inside the C
//! library (`system()` ignores SIGINT while it waits, then restores what it found, the stand-in).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::alloc::real;
use crate::runtime;
use crate::signals::SigactionFn;

/// The signals whose default action the stand-in takes.
const SIGNALS: [i32; 3] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP];

/// Stand-ins may be installed: the engine runs and there is something to report.
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Bit `signal`: the stand-in is installed for it, in place of the program's default action.
static STANDING_IN: AtomicU32 = AtomicU32::new(0);
/// Held while an action of these signals changes (the check and the change are one step for
/// other threads). Signals are held on the holder's thread meanwhile, so a handler of the
/// program's that calls `sigaction` never spins on its own thread's lock.
static CHANGING: AtomicBool = AtomicBool::new(false);

fn bit(signal: i32) -> u32 {
    1 << signal
}

fn managed(signal: i32) -> bool {
    SIGNALS.contains(&signal)
}

/// Run `f` with the actions of these signals to itself.
fn changing<R>(f: impl FnOnce() -> R) -> R {
    crate::signals::holding_signals(|| {
        while CHANGING.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        let result = f();
        CHANGING.store(false, Ordering::Release);
        result
    })
}

/// The C library's sigaction.
fn real_sigaction(signal: i32, act: *const libc::sigaction, old: *mut libc::sigaction) -> i32 {
    let real = real!("sigaction", SigactionFn);
    // SAFETY: act and old are null or valid, as the callers below pass them.
    unsafe { real(signal, act, old) }
}

fn default_action() -> libc::sigaction {
    // SAFETY: an all-zero sigaction is SIG_DFL with no flags and an empty mask.
    unsafe { std::mem::zeroed() }
}

fn stand_in_action() -> libc::sigaction {
    let mut action = default_action();
    action.sa_sigaction = stand_in as extern "C" fn(i32) as libc::sighandler_t;
    // Interrupted system calls go on, as they would have for a program that never saw the signal
    // until it ended: none does, the process ends in the handler.
    action.sa_flags = libc::SA_RESTART;
    action
}

/// Install the stand-in for `signal` if its action is the default one now. Called with
/// [`CHANGING`] held.
fn stand_in_if_default(signal: i32) {
    let mut current = default_action();
    if real_sigaction(signal, std::ptr::null(), &mut current) == 0
        && current.sa_sigaction == libc::SIG_DFL
        && real_sigaction(signal, &stand_in_action(), std::ptr::null_mut()) == 0
    {
        STANDING_IN.fetch_or(bit(signal), Ordering::AcqRel);
    }
}

/// The engine runs: stand in for the default action of every one of these signals that has it.
pub(crate) fn start() {
    if runtime::in_forked_child() || runtime::in_vfork_child() {
        return;
    }
    changing(|| {
        ENABLED.store(true, Ordering::Release);
        for signal in SIGNALS {
            stand_in_if_default(signal);
        }
    });
}

/// The program's `sigaction` for one of these signals, if it is one (None: not ours to serve).
pub(crate) fn sigaction(signal: i32, act: Option<&libc::sigaction>, old: *mut libc::sigaction) -> Option<i32> {
    if !managed(signal) || !ENABLED.load(Ordering::Acquire) || runtime::in_vfork_child() {
        return None;
    }
    Some(changing(|| {
        let standing_in = STANDING_IN.load(Ordering::Acquire) & bit(signal) != 0;
        let mut previous = default_action();
        let result = match act {
            // The default action asked for: the stand-in takes it (again).
            Some(new) if new.sa_sigaction == libc::SIG_DFL => {
                if standing_in {
                    0
                } else {
                    let result = real_sigaction(signal, &stand_in_action(), &mut previous);
                    if result == 0 {
                        STANDING_IN.fetch_or(bit(signal), Ordering::AcqRel);
                    }
                    result
                }
            }
            // A handler or SIG_IGN of the program's replaces the stand-in.
            Some(new) => {
                let result = real_sigaction(signal, new, &mut previous);
                if result == 0 {
                    STANDING_IN.fetch_and(!bit(signal), Ordering::AcqRel);
                }
                result
            }
            None if standing_in => 0,
            None => real_sigaction(signal, std::ptr::null(), &mut previous),
        };
        if result == 0 && !old.is_null() {
            // The program's view: the default action where the stand-in is.
            let shown = if standing_in { default_action() } else { previous };
            // SAFETY: old is a valid sigaction to write (the caller's contract).
            unsafe { old.write(shown) };
        }
        result
    }))
}

/// The stand-in: the report first, then the default action, by the same signal.
extern "C" fn stand_in(signal: i32) {
    let errno = runtime::errno();
    crate::report::report_before_signal_death();
    if !runtime::in_vfork_child() {
        STANDING_IN.fetch_and(!bit(signal), Ordering::AcqRel);
    }
    // Straight to the kernel: async-signal-safe, and no lock of ours (CHANGING may be held by
    // the thread this handler interrupted).
    let default = KernelAction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
    crate::io::sys!(
        libc::SYS_rt_sigaction,
        signal,
        &default as *const KernelAction,
        std::ptr::null_mut::<KernelAction>(),
        std::mem::size_of::<u64>()
    );
    let unblock: u64 = 1 << (signal - 1);
    crate::io::sys!(
        libc::SYS_rt_sigprocmask,
        libc::SIG_UNBLOCK,
        &unblock as *const u64,
        std::ptr::null_mut::<u64>(),
        std::mem::size_of::<u64>()
    );
    let (pid, tid) =
        (rustix::process::getpid().as_raw_nonzero().get(), rustix::thread::gettid().as_raw_nonzero().get());
    crate::io::sys!(libc::SYS_tgkill, pid, tid, signal);
    // A signal still blocked by the program's mask elsewhere, or ignored meanwhile: go on.
    runtime::set_errno(errno);
}

/// The kernel's `struct sigaction` on x86-64 (handler, flags, restorer, mask).
#[repr(C)]
struct KernelAction {
    handler: libc::sighandler_t,
    flags: u64,
    restorer: usize,
    mask: u64,
}
