//! The `exec` family: the image about to be replaced writes its statistics first.
//!
//! An `exec` ends the image without running its exit handlers, so its statistics would be only
//! the last snapshot, up to 2 s old, or none at all for an image that ran less than that, and
//! the tail of its fault trace (`tiermem trace record`) would be lost. The
//! functions a program calls by name are interposed here; the C library's `execl` family and
//! `execvp`'s retries over `PATH` call the system call directly, and an image replaced through
//! them keeps its last snapshot. An `exec` that fails leaves the process running, and its later
//! snapshots and final report replace the statistics written, and its faults go unrecorded.

use std::ffi::{c_char, c_int};

type ExecveFn = unsafe extern "C" fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int;
type ExecvFn = unsafe extern "C" fn(*const c_char, *const *const c_char) -> c_int;
type FexecveFn = unsafe extern "C" fn(c_int, *const *const c_char, *const *const c_char) -> c_int;
type ExecveatFn =
    unsafe extern "C" fn(c_int, *const c_char, *const *const c_char, *const *const c_char, c_int) -> c_int;

/// # Safety
/// The C contract of `execve`.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execve", ExecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execve).
    unsafe { real(path, argv, envp) }
}

/// # Safety
/// The C contract of `execv`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execv", ExecvFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execv).
    unsafe { real(path, argv) }
}

/// # Safety
/// The C contract of `execvp`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execvp", ExecvFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execvp).
    unsafe { real(file, argv) }
}

/// # Safety
/// The C contract of `execvpe`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execvpe", ExecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execvpe).
    unsafe { real(file, argv, envp) }
}

/// # Safety
/// The C contract of `fexecve`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("fexecve", FexecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of fexecve).
    unsafe { real(fd, argv, envp) }
}

/// # Safety
/// The C contract of `execveat`.
#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execveat", ExecveatFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execveat).
    unsafe { real(dirfd, path, argv, envp, flags) }
}
