//! In sigbus fault mode the engine's SIGBUS handler must stay installed and SIGBUS must never be
//! blocked (a blocked fault signal kills the process). A program's own SIGBUS handler becomes the
//! one the engine chains to for faults that are not its own; masks lose SIGBUS on the way in,
//! the masks of signal handlers (`sa_mask`) too.

use crate::alloc::real;
use crate::runtime;

pub(crate) type SigactionFn = unsafe extern "C" fn(i32, *const libc::sigaction, *mut libc::sigaction) -> i32;
type SignalFn = unsafe extern "C" fn(i32, libc::sighandler_t) -> libc::sighandler_t;
type MaskFn = unsafe extern "C" fn(i32, *const libc::sigset_t, *mut libc::sigset_t) -> i32;

/// # Safety
/// The C contract of sigaction.
#[no_mangle]
pub unsafe extern "C" fn sigaction(sig: i32, act: *const libc::sigaction, old: *mut libc::sigaction) -> i32 {
    if sig == libc::SIGBUS && runtime::sigbus_mode() {
        // SAFETY: act is null or valid (the caller's contract).
        let new = unsafe { act.as_ref() };
        // SAFETY: old is null or valid (the caller's contract).
        let old_ref = unsafe { old.as_mut() };
        let engine_installing = new.is_some_and(tiermem_engine::is_engine_sigbus_action);
        if !engine_installing && tiermem_engine::replace_chained_sigbus_action(new, old_ref) {
            return 0;
        }
    }
    // A handler of any signal runs with its own mask added: one that blocks SIGBUS (sigfillset,
    // a common pattern) would be killed by the kernel at the first evicted page it touched.
    let mut copy: libc::sigaction;
    // SAFETY: act is null or valid (the caller's contract).
    let act = match unsafe { act.as_ref() } {
        // SAFETY: the mask of a valid action.
        Some(a) if runtime::sigbus_mode() && unsafe { libc::sigismember(&a.sa_mask, libc::SIGBUS) } == 1 => {
            copy = *a;
            // SAFETY: copy's mask is a valid sigset.
            unsafe { libc::sigdelset(&mut copy.sa_mask, libc::SIGBUS) };
            &copy as *const libc::sigaction
        }
        _ => act,
    };
    // SAFETY: act is null or valid (as above).
    if let Some(result) = crate::terminating::sigaction(sig, unsafe { act.as_ref() }, old) {
        return result;
    }
    let real = real!("sigaction", SigactionFn);
    // SAFETY: the caller's own call, with SIGBUS left out of the handler's mask.
    unsafe { real(sig, act, old) }
}

/// # Safety
/// The C contract of signal.
#[no_mangle]
pub unsafe extern "C" fn signal(sig: i32, handler: libc::sighandler_t) -> libc::sighandler_t {
    // glibc's signal() sets the action inside the C library, past our sigaction: the signals
    // tiermem serves itself (SIGBUS in sigbus mode; SIGTERM and the like, see `terminating`)
    // get the action glibc's would set (BSD semantics) here.
    // SAFETY: zeroed is an empty action.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = handler;
    action.sa_flags = libc::SA_RESTART;
    // SAFETY: as above.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    if sig == libc::SIGBUS
        && runtime::sigbus_mode()
        && tiermem_engine::replace_chained_sigbus_action(Some(&action), Some(&mut old))
    {
        return old.sa_sigaction;
    }
    match crate::terminating::sigaction(sig, Some(&action), &mut old) {
        Some(0) => return old.sa_sigaction,
        Some(_) => return libc::SIG_ERR,
        None => {}
    }
    let real = real!("signal", SignalFn);
    // SAFETY: the caller's own call.
    unsafe { real(sig, handler) }
}

/// `set` without SIGBUS when it would block it, in `copy`.
fn without_sigbus(how: i32, set: *const libc::sigset_t, copy: &mut libc::sigset_t) -> *const libc::sigset_t {
    if set.is_null() || how == libc::SIG_UNBLOCK || !runtime::sigbus_mode() {
        return set;
    }
    // SAFETY: set points to a valid sigset (the caller's contract).
    if unsafe { libc::sigismember(set, libc::SIGBUS) } != 1 {
        return set;
    }
    // SAFETY: as above; copy is ours.
    *copy = unsafe { *set };
    // SAFETY: copy is a valid sigset.
    unsafe { libc::sigdelset(copy, libc::SIGBUS) };
    copy
}

/// # Safety
/// The C contract of sigprocmask.
#[no_mangle]
pub unsafe extern "C" fn sigprocmask(how: i32, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> i32 {
    // SAFETY: zeroed is an empty set, overwritten before use.
    let mut copy: libc::sigset_t = unsafe { std::mem::zeroed() };
    let set = without_sigbus(how, set, &mut copy);
    let real = real!("sigprocmask", MaskFn);
    // SAFETY: the caller's call with SIGBUS left out of a blocking set.
    unsafe { real(how, set, old) }
}

/// # Safety
/// The C contract of pthread_sigmask.
#[no_mangle]
pub unsafe extern "C" fn pthread_sigmask(how: i32, set: *const libc::sigset_t, old: *mut libc::sigset_t) -> i32 {
    // SAFETY: as in sigprocmask.
    let mut copy: libc::sigset_t = unsafe { std::mem::zeroed() };
    let set = without_sigbus(how, set, &mut copy);
    let real = real!("pthread_sigmask", MaskFn);
    // SAFETY: as in sigprocmask.
    unsafe { real(how, set, old) }
}

/// Run `f` with every signal but SIGBUS (which serves faults in sigbus mode) blocked on this
/// thread, errno as `f` left it: no handler of the program's runs in between.
pub(crate) fn holding_signals<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: sigset_t is plain data, valid all zeros.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; rt_sigprocmask writes the old mask here.
    let mut before: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` is a valid sigset_t.
    unsafe { libc::sigfillset(&mut all) };
    // SAFETY: as above.
    unsafe { libc::sigdelset(&mut all, libc::SIGBUS) };
    let set_size = std::mem::size_of::<libc::c_ulong>();
    crate::io::sys!(
        libc::SYS_rt_sigprocmask,
        libc::SIG_BLOCK,
        &all as *const libc::sigset_t,
        &mut before as *mut libc::sigset_t,
        set_size
    );
    let result = f();
    let errno = runtime::errno();
    crate::io::sys!(
        libc::SYS_rt_sigprocmask,
        libc::SIG_SETMASK,
        &before as *const libc::sigset_t,
        std::ptr::null_mut::<libc::sigset_t>(),
        set_size
    );
    runtime::set_errno(errno);
    result
}
