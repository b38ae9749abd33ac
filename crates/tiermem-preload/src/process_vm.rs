//! process_vm_readv and process_vm_writev in sigbus fault mode. The kernel copies between this
//! process's `local` buffers and another process's `remote` ones, or this process's own: managed
//! pages on either side of ours are held resident for the call, each side's list cut where its
//! held bytes reach its part of the per-call share of the budget (half each when both sides are
//! ours), then both to the same length. A short transfer is what these calls may always return.

use std::sync::atomic::Ordering;

use crate::io::{budget_piece, needs_wrapping, sys};
use crate::messages::{hold_vectors, total};
use crate::runtime;

/// Most iovecs the kernel takes in one list (UIO_MAXIOV); a longer list gets EINVAL.
const MAX_IOVECS: libc::c_ulong = 1024;

/// A list of `count` iovecs (empty for null or a zero count).
fn list<'a>(vecs: *const libc::iovec, count: libc::c_ulong) -> &'a [libc::iovec] {
    if vecs.is_null() || count == 0 {
        &[]
    } else {
        // SAFETY: the caller's list of `count` iovecs (its contract), at most MAX_IOVECS long
        // (checked by the caller).
        unsafe { std::slice::from_raw_parts(vecs, count as usize) }
    }
}

/// `vecs` cut to its first `len` bytes.
fn cut_to(vecs: &[libc::iovec], mut len: usize) -> Vec<libc::iovec> {
    let mut out = Vec::with_capacity(vecs.len());
    for v in vecs {
        if len == 0 {
            break;
        }
        let n = v.iov_len.min(len);
        out.push(libc::iovec { iov_base: v.iov_base, iov_len: n });
        len -= n;
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn transfer(
    number: libc::c_long,
    pid: libc::pid_t,
    local: *const libc::iovec,
    local_count: libc::c_ulong,
    remote: *const libc::iovec,
    remote_count: libc::c_ulong,
    flags: libc::c_ulong,
) -> isize {
    if local_count > MAX_IOVECS || remote_count > MAX_IOVECS {
        // The kernel refuses the call (EINVAL) without reading the lists.
        return sys!(number, pid, local, local_count, remote, remote_count, flags);
    }
    let (locals, remotes) = (list(local, local_count), list(remote, remote_count));
    // SAFETY: getpid has no preconditions.
    let remote_is_ours = pid == unsafe { libc::getpid() };
    let ours = |v: &libc::iovec| needs_wrapping(v.iov_base, v.iov_len);
    let engine = match runtime::running_engine() {
        Some(engine) if locals.iter().any(ours) || (remote_is_ours && remotes.iter().any(ours)) => engine,
        _ => return sys!(number, pid, local, local_count, remote, remote_count, flags),
    };
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    // readv: the kernel writes the local side and reads the remote one; writev the reverse.
    let local_written = number == libc::SYS_process_vm_readv;
    let share = budget_piece(engine);
    let cap = Some(if remote_is_ours { (share / 2).max(tiermem_sys::PAGE_SIZE) } else { share });
    let mut pins = Vec::new();
    let mut locals = hold_vectors(engine, &mut pins, locals, local_written, cap, &mut 0);
    let mut len = total(&locals).min(total(remotes));
    let mut remotes = cut_to(remotes, len);
    if remote_is_ours {
        remotes = hold_vectors(engine, &mut pins, &remotes, !local_written, cap, &mut 0);
        len = len.min(total(&remotes));
    }
    locals = cut_to(&locals, len);
    remotes = cut_to(&remotes, len);
    sys!(
        number,
        pid,
        locals.as_ptr(),
        locals.len() as libc::c_ulong,
        remotes.as_ptr(),
        remotes.len() as libc::c_ulong,
        flags
    )
}

/// Defines the C entry point `$name`, made through [`transfer`] as system call `$number`.
macro_rules! entry_point {
    ($name:ident, $number:expr) => {
        /// # Safety
        /// The C contract of the function of this name.
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            pid: libc::pid_t,
            local: *const libc::iovec,
            local_count: libc::c_ulong,
            remote: *const libc::iovec,
            remote_count: libc::c_ulong,
            flags: libc::c_ulong,
        ) -> isize {
            transfer($number, pid, local, local_count, remote, remote_count, flags)
        }
    };
}

entry_point!(process_vm_readv, libc::SYS_process_vm_readv);
entry_point!(process_vm_writev, libc::SYS_process_vm_writev);
