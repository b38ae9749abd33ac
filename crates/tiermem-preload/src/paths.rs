//! readlink, readlinkat and getcwd in sigbus fault mode: the kernel writes a path (at most a
//! page) into the caller's buffer, so the start of a managed buffer is held resident for the call.

use std::ffi::{c_char, c_void};
use std::sync::atomic::Ordering;

use crate::alloc::real;
use crate::io::{needs_wrapping, sys};
use crate::messages::hold;
use crate::runtime;

/// Bytes of the buffer held: more than the kernel ever writes for a path (a page), so the
/// length the call is given never changes what it returns.
const PATH_BUFFER_BYTES: usize = 64 << 10;

/// Run `op` with the first [`PATH_BUFFER_BYTES`] of `[buf, buf+len)` held resident; `op` gets
/// the length to pass on.
fn with_path_buffer<R>(buf: *mut c_void, len: usize, op: impl FnOnce(usize) -> R) -> R {
    let Some(engine) = runtime::running_engine() else { return op(len) };
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    let len = len.min(PATH_BUFFER_BYTES);
    let mut pins = Vec::new();
    hold(engine, &mut pins, buf, len, true, None, &mut 0);
    op(len)
}

/// # Safety
/// The C contract of readlinkat.
#[no_mangle]
pub unsafe extern "C" fn readlinkat(dir: i32, path: *const c_char, buf: *mut c_char, len: usize) -> isize {
    if !needs_wrapping(buf.cast(), len) {
        return sys!(libc::SYS_readlinkat, dir, path, buf, len);
    }
    with_path_buffer(buf.cast(), len, |n| sys!(libc::SYS_readlinkat, dir, path, buf, n))
}

/// # Safety
/// The C contract of readlink.
#[no_mangle]
pub unsafe extern "C" fn readlink(path: *const c_char, buf: *mut c_char, len: usize) -> isize {
    // SAFETY: the caller's arguments, relative to the working directory as readlink's are.
    unsafe { readlinkat(libc::AT_FDCWD, path, buf, len) }
}

/// The getcwd system call (by number through `syscall()`): the path's length, or -1.
///
/// # Safety
/// The system call's contract: `buf` writable for `len` bytes.
pub unsafe fn getcwd_call(buf: *mut c_char, len: usize) -> isize {
    if !needs_wrapping(buf.cast(), len) {
        return sys!(libc::SYS_getcwd, buf, len);
    }
    with_path_buffer(buf.cast(), len, |n| sys!(libc::SYS_getcwd, buf, n))
}

/// # Safety
/// The C contract of getcwd.
#[no_mangle]
pub unsafe extern "C" fn getcwd(buf: *mut c_char, len: usize) -> *mut c_char {
    if buf.is_null() || !needs_wrapping(buf.cast(), len) {
        // The C library's, which also allocates the buffer when given none.
        let real = real!("getcwd", unsafe extern "C" fn(*mut c_char, usize) -> *mut c_char);
        // SAFETY: the caller's arguments to the C library's getcwd.
        return unsafe { real(buf, len) };
    }
    // SAFETY: the caller's buffer of len bytes.
    let n = unsafe { getcwd_call(buf, len) };
    if n < 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: the kernel wrote at least one byte (the terminating NUL) at buf.
    if n == 0 || unsafe { *buf } != b'/' as c_char {
        // Not reachable from the root (the kernel's "(unreachable)" prefix): as the C library.
        runtime::set_errno(libc::ENOENT);
        return std::ptr::null_mut();
    }
    buf
}
