//! The setuid family: a program started as root that gives up its privileges (daemons do,
//! before or after their first large allocation) would leave tiermem unable to open a
//! userfaultfd that serves faults inside system calls (thread fault mode could not start) and
//! to write its statistics into the run's directory. Before the first call that could drop
//! root (setuid, seteuid, setreuid, setresuid, capset, or their numbers through `syscall()`),
//! [`report::before_dropping_privileges`] does what needs it.

use crate::alloc::real;
use crate::report;

/// Before a call that sets these user ids (-1: unchanged) or, with `None`, capabilities.
pub(crate) fn before_a_change(ids: Option<&[libc::uid_t]>) {
    let leaves_root = ids.is_none_or(|ids| ids.iter().any(|&id| id != 0 && id != libc::uid_t::MAX));
    if leaves_root && rustix::process::geteuid().is_root() {
        report::before_dropping_privileges();
    }
}

/// # Safety
/// The C contract of setuid.
#[no_mangle]
pub unsafe extern "C" fn setuid(uid: libc::uid_t) -> i32 {
    before_a_change(Some(&[uid]));
    let real = real!("setuid", unsafe extern "C" fn(libc::uid_t) -> i32);
    // SAFETY: the caller's own setuid.
    unsafe { real(uid) }
}

/// # Safety
/// The C contract of seteuid.
#[no_mangle]
pub unsafe extern "C" fn seteuid(uid: libc::uid_t) -> i32 {
    before_a_change(Some(&[uid]));
    let real = real!("seteuid", unsafe extern "C" fn(libc::uid_t) -> i32);
    // SAFETY: the caller's own seteuid.
    unsafe { real(uid) }
}

/// # Safety
/// The C contract of setreuid.
#[no_mangle]
pub unsafe extern "C" fn setreuid(ruid: libc::uid_t, euid: libc::uid_t) -> i32 {
    before_a_change(Some(&[ruid, euid]));
    let real = real!("setreuid", unsafe extern "C" fn(libc::uid_t, libc::uid_t) -> i32);
    // SAFETY: the caller's own setreuid.
    unsafe { real(ruid, euid) }
}

/// # Safety
/// The C contract of capset (dropping CAP_SYS_PTRACE has the same effect on userfaultfd).
#[no_mangle]
pub unsafe extern "C" fn capset(header: *mut libc::c_void, data: *const libc::c_void) -> i32 {
    before_a_change(None);
    let real = real!("capset", unsafe extern "C" fn(*mut libc::c_void, *const libc::c_void) -> i32);
    // SAFETY: the caller's own capset.
    unsafe { real(header, data) }
}

/// # Safety
/// The C contract of setresuid.
#[no_mangle]
pub unsafe extern "C" fn setresuid(ruid: libc::uid_t, euid: libc::uid_t, suid: libc::uid_t) -> i32 {
    before_a_change(Some(&[ruid, euid, suid]));
    let real = real!("setresuid", unsafe extern "C" fn(libc::uid_t, libc::uid_t, libc::uid_t) -> i32);
    // SAFETY: the caller's own setresuid.
    unsafe { real(ruid, euid, suid) }
}
