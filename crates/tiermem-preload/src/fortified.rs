//! The `_FORTIFY_SOURCE` variants of the wrapped calls (`__read_chk` and kin), which programs
//! built with it call instead of `read` and which reach the kernel inside the C library, past
//! the wrappers of [`crate::io`]. Each checks the buffer size as the C library would and then
//! goes through the wrapper.

use std::ffi::c_void;

use crate::io;

extern "C" {
    /// The C library's report of a fortified buffer overflow; it ends the program.
    fn __chk_fail() -> !;
}

fn check(len: usize, buf_len: usize) {
    if len > buf_len {
        // SAFETY: __chk_fail takes no arguments and does not return.
        unsafe { __chk_fail() }
    }
}

/// # Safety
/// The C contract of __read_chk.
#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: i32, buf: *mut c_void, len: usize, buf_len: usize) -> isize {
    check(len, buf_len);
    // SAFETY: read with the caller's arguments.
    unsafe { io::read(fd, buf, len) }
}

/// # Safety
/// The C contract of __pread_chk.
#[no_mangle]
pub unsafe extern "C" fn __pread_chk(fd: i32, buf: *mut c_void, len: usize, off: i64, buf_len: usize) -> isize {
    check(len, buf_len);
    // SAFETY: pread with the caller's arguments.
    unsafe { io::pread(fd, buf, len, off) }
}

/// # Safety
/// The C contract of __pread64_chk.
#[no_mangle]
pub unsafe extern "C" fn __pread64_chk(fd: i32, buf: *mut c_void, len: usize, off: i64, buf_len: usize) -> isize {
    // SAFETY: the same call.
    unsafe { __pread_chk(fd, buf, len, off, buf_len) }
}

/// # Safety
/// The C contract of __recv_chk.
#[no_mangle]
pub unsafe extern "C" fn __recv_chk(fd: i32, buf: *mut c_void, len: usize, buf_len: usize, flags: i32) -> isize {
    check(len, buf_len);
    // SAFETY: recv with the caller's arguments.
    unsafe { io::recv(fd, buf, len, flags) }
}

/// # Safety
/// The C contract of __recvfrom_chk.
#[no_mangle]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: i32,
    buf: *mut c_void,
    len: usize,
    buf_len: usize,
    flags: i32,
    from: *mut libc::sockaddr,
    from_len: *mut libc::socklen_t,
) -> isize {
    check(len, buf_len);
    // SAFETY: recvfrom with the caller's arguments.
    unsafe { io::recvfrom(fd, buf, len, flags, from, from_len) }
}

/// Stop the program, as the C library does, when `size * count` overflows or passes `buf_len`.
fn check_elements(size: usize, count: usize, buf_len: usize) {
    check(size.saturating_mul(count), buf_len);
}

/// # Safety
/// The C contract of __fread_chk.
#[no_mangle]
pub unsafe extern "C" fn __fread_chk(
    buf: *mut c_void,
    buf_len: usize,
    size: usize,
    count: usize,
    stream: *mut libc::FILE,
) -> usize {
    check_elements(size, count, buf_len);
    // SAFETY: fread with the caller's arguments.
    unsafe { io::fread(buf, size, count, stream) }
}

/// # Safety
/// The C contract of __fread_unlocked_chk.
#[no_mangle]
pub unsafe extern "C" fn __fread_unlocked_chk(
    buf: *mut c_void,
    buf_len: usize,
    size: usize,
    count: usize,
    stream: *mut libc::FILE,
) -> usize {
    check_elements(size, count, buf_len);
    // SAFETY: fread_unlocked with the caller's arguments.
    unsafe { io::fread_unlocked(buf, size, count, stream) }
}
