//! The program's close and dup family, kept off tiermem's own descriptors (the userfaultfd,
//! device file, io_uring rings, event descriptors: see [`tiermem_sys::guarded_fd`]). A program
//! that closes every descriptor it did not open — `close_range(3, ~0)`, `closefrom(3)`, a close
//! loop — would otherwise switch the engine off under it, and its managed data would read back
//! as zeros. Here:
//!
//! - `close` of a guarded descriptor fails with EBADF, as for a number the program never opened;
//! - `close_range` and `closefrom` close the stretches around guarded descriptors;
//! - `dup2`/`dup3` onto a guarded descriptor fail with EBUSY, with a message.
//!
//! In a forked child the engine is not used (its memory is a plain copy), so nothing is guarded
//! there. The same calls made by number through `syscall()` come here too ([`crate::syscall`]).

use std::sync::atomic::{AtomicBool, Ordering};

use tiermem_sys::guarded_fd;

use crate::alloc::real;
use crate::io::sys;
use crate::runtime;

type CloseFn = unsafe extern "C" fn(i32) -> i32;
type Dup2Fn = unsafe extern "C" fn(i32, i32) -> i32;
type Dup3Fn = unsafe extern "C" fn(i32, i32, i32) -> i32;

fn real_close() -> CloseFn {
    real!("close", CloseFn)
}

fn real_dup2() -> Dup2Fn {
    real!("dup2", Dup2Fn)
}

fn real_dup3() -> Dup3Fn {
    real!("dup3", Dup3Fn)
}

/// Look the C library's functions up now, at load: the first lookup (dlsym) may allocate,
/// which a close inside a fork handler (holding the heap's lock) or a signal handler must not.
pub(crate) fn resolve_real_functions() {
    let _ = (real_close(), real_dup2(), real_dup3());
}

fn guarded(fd: i32) -> bool {
    !runtime::in_forked_child() && guarded_fd::is_guarded(fd)
}

/// # Safety
/// The C contract of close.
#[no_mangle]
pub unsafe extern "C" fn close(fd: i32) -> i32 {
    if guarded(fd) {
        runtime::set_errno(libc::EBADF);
        return -1;
    }
    // SAFETY: the caller's own close.
    unsafe { real_close()(fd) }
}

/// # Safety
/// The C contract of close_range.
#[no_mangle]
pub unsafe extern "C" fn close_range(first: u32, last: u32, flags: i32) -> i32 {
    close_range_call(first, last, flags) as i32
}

/// # Safety
/// The C contract of closefrom.
#[no_mangle]
pub unsafe extern "C" fn closefrom(low: i32) {
    // Without close_range (Linux < 5.9), close what /proc lists, as the C library does.
    if low >= 0 && close_range_call(low as u32, u32::MAX, 0) < 0 {
        let Ok(listed) = std::fs::read_dir("/proc/self/fd") else { return };
        let open: Vec<i32> = listed.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect();
        for fd in open.into_iter().filter(|&fd| fd >= low) {
            // SAFETY: closing a number the program asked to close (guarded ones are skipped).
            unsafe { close(fd) };
        }
    }
}

/// close_range(2) that leaves guarded descriptors open: one call for each stretch between them.
pub(crate) fn close_range_call(first: u32, last: u32, flags: i32) -> isize {
    let known = libc::CLOSE_RANGE_UNSHARE as i32 | libc::CLOSE_RANGE_CLOEXEC as i32;
    // Marking close-on-exec harms nothing of ours (ours are already); odd arguments are the
    // kernel's to refuse.
    if runtime::in_forked_child()
        || flags & libc::CLOSE_RANGE_CLOEXEC as i32 != 0
        || flags & !known != 0
        || first > last
    {
        return sys!(libc::SYS_close_range, first, last, flags);
    }
    let mut flags = flags;
    for (from, to) in guarded_fd::unguarded_spans(first, last) {
        let r = sys!(libc::SYS_close_range, from, to, flags);
        if r < 0 {
            return r;
        }
        // Unshared by the first call; the rest close in the new table.
        flags &= !(libc::CLOSE_RANGE_UNSHARE as i32);
    }
    if flags & libc::CLOSE_RANGE_UNSHARE as i32 != 0 {
        // Nothing to close, but the table was to be unshared.
        // SAFETY: unshare of the descriptor table only.
        return unsafe { libc::unshare(libc::CLONE_FILES) } as isize;
    }
    0
}

/// Says once that a dup2 or dup3 onto a guarded descriptor was refused.
static REFUSAL_SAID: AtomicBool = AtomicBool::new(false);

fn refuse_replacing(new: i32) -> i32 {
    if !REFUSAL_SAID.swap(true, Ordering::Relaxed) {
        // Without allocating: dup2 may be called from a signal handler.
        let mut digits = [0u8; 20];
        runtime::say(&[
            "tiermem: the program asked to replace descriptor ",
            runtime::decimal(i64::from(new), &mut digits),
            ", which tiermem uses to page its memory; refused with EBUSY (replacing it would lose the program's data)",
        ]);
    }
    runtime::set_errno(libc::EBUSY);
    -1
}

/// # Safety
/// The C contract of dup2.
#[no_mangle]
pub unsafe extern "C" fn dup2(old: i32, new: i32) -> i32 {
    if old != new && guarded(new) {
        return refuse_replacing(new);
    }
    // SAFETY: the caller's own dup2.
    unsafe { real_dup2()(old, new) }
}

/// # Safety
/// The C contract of dup3.
#[no_mangle]
pub unsafe extern "C" fn dup3(old: i32, new: i32, flags: i32) -> i32 {
    if old != new && guarded(new) {
        return refuse_replacing(new);
    }
    // SAFETY: the caller's own dup3.
    unsafe { real_dup3()(old, new, flags) }
}
