//! `syscall()`, for programs and libraries that make the wrapped system calls by number: the
//! mmap family always goes to [`crate::mmap`], the close and dup family to [`crate::fds`], the mlock family to [`crate::lock`]; in sigbus fault mode the calls that move
//! data go to their wrappers in [`crate::io`], [`crate::messages`], [`crate::process_vm`] or
//! [`crate::paths`]; the fork and clone calls that copy the process run tiermem's fork
//! handlers around them ([`crate::other_forks`]); every other call goes to the
//! C library's `syscall`.
//!
//! `syscall` is variadic in C, which stable Rust cannot define. On x86-64 and AArch64 Linux a
//! variadic call passes its integer arguments exactly as a call with that many `long`
//! parameters would (registers first, then the stack), so the function takes the number and six
//! `long`s — the most any system call has. Those past the caller's last argument are whatever
//! the registers or stack slot held, and are passed on unread by the kernel, as the C library's
//! own `syscall` does.

use std::ffi::c_void;

use libc::c_long;

use crate::io::{self, sys};
use crate::{fds, messages, paths, process_vm, runtime};

/// # Safety
/// The C contract of syscall.
#[no_mangle]
pub unsafe extern "C" fn syscall(
    number: c_long,
    a: c_long,
    b: c_long,
    c: c_long,
    d: c_long,
    e: c_long,
    f: c_long,
) -> c_long {
    if let Some(result) = memory(number, a, b, c, d, e, f) {
        return result;
    }
    if let Some(result) = descriptors(number, a, b, c) {
        return result;
    }
    if let Some(result) = crate::lock::by_number(number, a, b, c) {
        return result as c_long;
    }
    let mut clone_args = CloneArgs::default();
    if !runtime::in_vfork_child() {
        if let Some(flags) = clone_flags(number, a, b) {
            crate::stdio::clone_coming(flags);
        }
    }
    if forks_memory(number, a, b, &mut clone_args) {
        // clone3 reads our copy of its arguments; the others take theirs as they are.
        let a = if number == libc::SYS_clone3 { clone_args.0.as_ptr() as c_long } else { a };
        return crate::other_forks::around(|| sys!(number, a, b, c, d, e, f) as c_long);
    }
    let id = |v: c_long| v as libc::uid_t;
    match number {
        libc::SYS_execve | libc::SYS_execveat => crate::report::before_exec(),
        libc::SYS_setuid => crate::privileges::before_a_change(Some(&[id(a)])),
        libc::SYS_setreuid => crate::privileges::before_a_change(Some(&[id(a), id(b)])),
        libc::SYS_setresuid => crate::privileges::before_a_change(Some(&[id(a), id(b), id(c)])),
        libc::SYS_capset => crate::privileges::before_a_change(None),
        _ => {}
    }
    if runtime::sigbus_mode() {
        if let Some(result) = wrapped(number, a, b, c, d, e, f) {
            return result as c_long;
        }
    }
    sys!(number, a, b, c, d, e, f) as c_long
}

/// Whether the call makes a child with a copy of this process's memory that goes on on the
/// caller's stack, as fork() does: the fork system call, or clone or clone3 without a stack of
/// its own (a child with one cannot return through this function) and without the flags of
/// [`crate::other_forks::CLONE_WITHOUT_HANDLERS`]. For clone3, `args` gets a copy of the
/// caller's arguments to hand the kernel instead: the kernel reads them while the fork
/// handlers hold the engine, which an evicted page there would wait for.
fn forks_memory(number: c_long, a: c_long, b: c_long, args: &mut CloneArgs) -> bool {
    let copies = |flags: u64, stack: u64| flags & crate::other_forks::CLONE_WITHOUT_HANDLERS == 0 && stack == 0;
    match number {
        #[cfg(target_arch = "x86_64")]
        libc::SYS_fork => true,
        libc::SYS_clone => copies(a as u64, b as u64),
        libc::SYS_clone3 => {
            // struct clone_args: flags is its first u64, stack its sixth, set_tid_size its tenth;
            // the kernel takes no struct shorter than 64 bytes (CLONE_ARGS_SIZE_VER0), and
            // none longer than ours is copied (later fields would be lost).
            let size = b as usize;
            if a == 0 || !(64..=std::mem::size_of::<CloneArgs>()).contains(&size) {
                return false;
            }
            // SAFETY: the caller hands the kernel `size` bytes there to read (a pointer the
            // kernel would refuse with EFAULT faults here instead); any alignment.
            unsafe { std::ptr::copy_nonoverlapping(a as *const u8, args.0.as_mut_ptr().cast::<u8>(), size) };
            // set_tid (the kernel reads that array too) is left to the kernel alone.
            copies(args.0[0], args.0[5]) && args.0[9] == 0
        }
        _ => false,
    }
}

/// The flags of a clone or clone3 system call (None for another call, or a clone3 whose
/// arguments the kernel will refuse).
fn clone_flags(number: c_long, a: c_long, b: c_long) -> Option<u64> {
    match number {
        libc::SYS_clone => Some(a as u64),
        libc::SYS_clone3 if a != 0 && b as usize >= 64 => {
            // SAFETY: the caller hands the kernel at least 64 bytes there to read, flags first
            // (a pointer the kernel would refuse with EFAULT faults here instead); any alignment.
            Some(unsafe { std::ptr::read_unaligned(a as *const u64) })
        }
        _ => None,
    }
}

/// Room for a clone3 argument struct (Linux 6.18's is 88 bytes).
#[derive(Default)]
struct CloneArgs([u64; 16]);

/// The mmap family by number goes to the same wrappers as by name, so managed memory is made,
/// unmapped, moved, protected and advised alike. (Before, an anonymous mmap by number was never
/// managed, and an mprotect by number on managed memory raced eviction, which reads pages in
/// place under the protection lock that call bypassed.) The wrappers reach the kernel past
/// `syscall`, so none of this comes back here.
fn memory(number: c_long, a: c_long, b: c_long, c: c_long, d: c_long, e: c_long, f: c_long) -> Option<c_long> {
    use crate::mmap;
    macro_rules! call {
        ($wrapper:expr) => {
            // SAFETY: the caller's own call, its arguments in the C types of the function that
            // makes it, which is what the kernel would have made of them.
            unsafe { $wrapper }
        };
    }
    let (addr, len) = (a as *mut c_void, b as usize);
    let result = match number {
        libc::SYS_mmap => call!(mmap::mmap(addr, len, c as i32, d as i32, e as i32, f)) as c_long,
        libc::SYS_munmap => c_long::from(call!(mmap::munmap(addr, len))),
        libc::SYS_mremap => call!(mmap::mremap(addr, len, c as usize, d as i32, e as *mut c_void)) as c_long,
        libc::SYS_mprotect => c_long::from(call!(mmap::mprotect(addr, len, c as i32))),
        libc::SYS_pkey_mprotect => c_long::from(call!(mmap::pkey_mprotect(addr, len, c as i32, d as i32))),
        libc::SYS_madvise => c_long::from(call!(mmap::madvise(addr, len, c as i32))),
        _ => return None,
    };
    Some(result)
}

/// The close and dup family's wrapper result for their call numbers, or None.
fn descriptors(number: c_long, a: c_long, b: c_long, c: c_long) -> Option<c_long> {
    let result = match number {
        // SAFETY: the caller's own close, its argument in its C type.
        libc::SYS_close => unsafe { fds::close(a as i32) },
        libc::SYS_close_range => return Some(fds::close_range_call(a as u32, b as u32, c as i32) as c_long),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's own dup2, its arguments in their C types.
        libc::SYS_dup2 => unsafe { fds::dup2(a as i32, b as i32) },
        // SAFETY: the caller's own dup3, its arguments in their C types.
        libc::SYS_dup3 => unsafe { fds::dup3(a as i32, b as i32, c as i32) },
        _ => return None,
    };
    Some(c_long::from(result))
}

/// The wrapper's result for a wrapped call number, or None.
fn wrapped(number: c_long, a: c_long, b: c_long, c: c_long, d: c_long, e: c_long, f: c_long) -> Option<isize> {
    macro_rules! call {
        ($wrapper:expr) => {
            // SAFETY: the wrapper gets the caller's arguments in its C types, which is what the
            // kernel would have made of them.
            Some(unsafe { $wrapper })
        };
    }
    let (fd, ptr) = (a as i32, b as *mut c_void);
    match number {
        libc::SYS_read => call!(io::read(fd, ptr, c as usize)),
        libc::SYS_write => call!(io::write(fd, ptr, c as usize)),
        libc::SYS_pread64 => call!(io::pread(fd, ptr, c as usize, d)),
        libc::SYS_pwrite64 => call!(io::pwrite(fd, ptr, c as usize, d)),
        libc::SYS_readv => call!(io::readv(fd, ptr.cast(), c as i32)),
        libc::SYS_writev => call!(io::writev(fd, ptr.cast(), c as i32)),
        // The offset's high word (e) is for 32-bit targets; here d holds all of it.
        libc::SYS_preadv => call!(io::preadv(fd, ptr.cast(), c as i32, d)),
        libc::SYS_pwritev => call!(io::pwritev(fd, ptr.cast(), c as i32, d)),
        libc::SYS_preadv2 => call!(io::preadv2(fd, ptr.cast(), c as i32, d, f as i32)),
        libc::SYS_pwritev2 => call!(io::pwritev2(fd, ptr.cast(), c as i32, d, f as i32)),
        libc::SYS_recvfrom => call!(io::recvfrom(fd, ptr, c as usize, d as i32, e as *mut _, f as *mut _)),
        libc::SYS_sendto => call!(io::sendto(fd, ptr, c as usize, d as i32, e as *const _, f as u32)),
        libc::SYS_recvmsg => call!(messages::recvmsg(fd, ptr.cast(), c as i32)),
        libc::SYS_sendmsg => call!(messages::sendmsg(fd, ptr.cast(), c as i32)),
        libc::SYS_recvmmsg => call!(messages::recvmmsg(fd, ptr.cast(), c as u32, d as i32, e as *mut _) as isize),
        libc::SYS_sendmmsg => call!(messages::sendmmsg(fd, ptr.cast(), c as u32, d as i32) as isize),
        libc::SYS_process_vm_readv => {
            call!(process_vm::process_vm_readv(fd, ptr.cast(), c as _, d as *const _, e as _, f as _))
        }
        libc::SYS_process_vm_writev => {
            call!(process_vm::process_vm_writev(fd, ptr.cast(), c as _, d as *const _, e as _, f as _))
        }
        libc::SYS_getrandom => call!(io::getrandom(a as *mut c_void, b as usize, c as u32)),
        libc::SYS_getcwd => call!(paths::getcwd_call(a as *mut _, b as usize)),
        libc::SYS_readlinkat => call!(paths::readlinkat(fd, b as *const _, c as *mut _, d as usize)),
        #[cfg(target_arch = "x86_64")]
        libc::SYS_readlink => call!(paths::readlink(a as *const _, b as *mut _, c as usize)),
        _ => None,
    }
}
