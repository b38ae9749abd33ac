//! process_vm_readv and process_vm_writev in sigbus fault mode. The kernel copies between this
//! process's `local` buffers and another process's `remote` ones, or this process's own: managed
//! pages on either side of ours are held resident for the call, each side's list cut where its
//! held bytes reach its part of the per-call share of the budget (half each when both sides are
//! ours), then both to the same length. A short transfer is what these calls may always return.

use std::sync::atomic::Ordering;

use crate::io::{any_needs_wrapping, budget_piece, iovecs, sys};
use crate::messages::{hold_vectors, total};
use crate::runtime;

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
    let as_given = || sys!(number, pid, local, local_count, remote, remote_count, flags);
    let (Some(locals), Some(remotes)) = (iovecs(local, local_count as usize), iovecs(remote, remote_count as usize))
    else {
        return as_given();
    };
    // SAFETY: getpid has no preconditions.
    let remote_is_ours = pid == unsafe { libc::getpid() };
    let engine = match runtime::running_engine() {
        Some(engine) if any_needs_wrapping(locals) || (remote_is_ours && any_needs_wrapping(remotes)) => engine,
        _ => return as_given(),
    };
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    // readv: the kernel writes the local side and reads the remote one; writev the reverse.
    let local_written = number == libc::SYS_process_vm_readv;
    let share = budget_piece(engine);
    let cap = Some(if remote_is_ours { (share / 2).max(tiermem_sys::PAGE_SIZE) } else { share });
    let mut pins = Vec::new();
    let asked = total(locals).min(total(remotes));
    let mut locals = hold_vectors(engine, &mut pins, locals, local_written, cap, &mut 0);
    let mut len = total(&locals).min(total(remotes));
    let mut remotes = cut_to(remotes, len);
    if remote_is_ours {
        remotes = hold_vectors(engine, &mut pins, &remotes, !local_written, cap, &mut 0);
        len = len.min(total(&remotes));
    }
    if len == 0 && asked > 0 {
        // Not a page could be held (a budget of a few pages): 0 bytes would say nothing moved.
        runtime::set_errno(libc::ENOMEM);
        return -1;
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
