//! recvmsg and sendmsg in sigbus fault mode: the managed parts of the message's buffers are held
//! resident for one call. Pieces would split a datagram, so the call is made once: on a stream
//! socket with the buffer list cut where the resident bytes reach the per-call share of the budget
//! (a short transfer, which stream callers handle), on any other socket whole.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use tiermem_engine::{Engine, PinGuard};

use crate::io::{budget_piece, needs_wrapping, stretch, sys};
use crate::runtime;

fn is_stream_socket(fd: i32) -> bool {
    let mut kind: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `kind`.
    let ok = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut kind as *mut libc::c_int).cast(), &mut len)
    };
    ok == 0 && kind == libc::SOCK_STREAM
}

/// Pins held for one call, and the buffer list cut to what they cover.
struct HeldMessage {
    _pins: Vec<PinGuard>,
    vecs: Vec<libc::iovec>,
}

/// Make the managed stretches of `[ptr, ptr+len)` resident, all of them (`cap` None) or until
/// `held` reaches `cap`. Returns the bytes from `ptr` that are covered.
fn hold(
    engine: &Engine,
    pins: &mut Vec<PinGuard>,
    ptr: *mut c_void,
    len: usize,
    kernel_writes: bool,
    cap: Option<usize>,
    held: &mut usize,
) -> usize {
    let mut done = 0;
    while done < len {
        let at = ptr as usize + done;
        let (mut piece, managed) = stretch(at, len - done);
        if managed {
            if let Some(cap) = cap {
                piece = piece.min(cap.saturating_sub(*held));
                if piece == 0 {
                    break;
                }
            }
            match engine.prepare_kernel_access(at as *const u8, piece, kernel_writes) {
                Ok(guard) => pins.push(guard),
                Err(e) => runtime::die(&["tiermem: cannot make a message's buffer resident: ", &e.to_string()]),
            }
            *held += piece;
        }
        done += piece;
    }
    done
}

/// Hold the message's buffers (and its address and control buffers) resident.
fn hold_message(
    engine: &Engine,
    fd: i32,
    msg: &libc::msghdr,
    vecs: &[libc::iovec],
    kernel_writes: bool,
) -> HeldMessage {
    let cap = is_stream_socket(fd).then(|| budget_piece(engine));
    let mut pins = Vec::new();
    let mut held = 0;
    for (ptr, len) in [(msg.msg_name, msg.msg_namelen as usize), (msg.msg_control, msg.msg_controllen)] {
        if needs_wrapping(ptr, len) {
            hold(engine, &mut pins, ptr, len, kernel_writes, None, &mut held);
        }
    }
    let mut cut = Vec::with_capacity(vecs.len());
    for v in vecs {
        let covered = hold(engine, &mut pins, v.iov_base, v.iov_len, kernel_writes, cap, &mut held);
        if covered > 0 || v.iov_len == 0 {
            cut.push(libc::iovec { iov_base: v.iov_base, iov_len: covered });
        }
        if covered < v.iov_len {
            break;
        }
    }
    HeldMessage { _pins: pins, vecs: cut }
}

/// A message to wrap: the engine, the caller's msghdr and its buffer list.
type Wrapped<'a> = (&'static Engine, &'a libc::msghdr, &'a [libc::iovec]);

/// The message with its buffer list, when anything in it needs wrapping.
fn message_to_wrap<'a>(msg: *const libc::msghdr) -> Option<Wrapped<'a>> {
    if msg.is_null() || !runtime::sigbus_mode() {
        return None;
    }
    let engine = runtime::running_engine()?;
    // SAFETY: a non-null msghdr from the caller (its contract).
    let m = unsafe { &*msg };
    let vecs = if m.msg_iov.is_null() || m.msg_iovlen == 0 {
        &[][..]
    } else {
        // SAFETY: msg_iov holds msg_iovlen elements (the caller's contract).
        unsafe { std::slice::from_raw_parts(m.msg_iov, m.msg_iovlen) }
    };
    let any = vecs.iter().any(|v| needs_wrapping(v.iov_base, v.iov_len))
        || needs_wrapping(m.msg_name, m.msg_namelen as usize)
        || needs_wrapping(m.msg_control, m.msg_controllen);
    any.then_some((engine, m, vecs))
}

/// Make the call `number` (recvmsg or sendmsg) with the message's buffers held resident.
/// Returns its result and the message as the kernel saw it (the buffer list possibly cut).
fn call_held(number: libc::c_long, fd: i32, (engine, m, vecs): Wrapped, flags: i32) -> (isize, libc::msghdr) {
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    let mut held = hold_message(engine, fd, m, vecs, number == libc::SYS_recvmsg);
    let mut copy = *m;
    copy.msg_iov = held.vecs.as_mut_ptr();
    copy.msg_iovlen = held.vecs.len();
    let r = sys!(number, fd, &mut copy as *mut libc::msghdr, flags);
    (r, copy)
}

/// # Safety
/// The C contract of recvmsg.
#[no_mangle]
pub unsafe extern "C" fn recvmsg(fd: i32, msg: *mut libc::msghdr, flags: i32) -> isize {
    let Some(wrapped) = message_to_wrap(msg) else { return sys!(libc::SYS_recvmsg, fd, msg, flags) };
    let (r, seen) = call_held(libc::SYS_recvmsg, fd, wrapped, flags);
    // SAFETY: the caller's msghdr; the kernel reports these three fields back through it.
    let out = unsafe { &mut *msg };
    out.msg_namelen = seen.msg_namelen;
    out.msg_controllen = seen.msg_controllen;
    out.msg_flags = seen.msg_flags;
    r
}

/// # Safety
/// The C contract of sendmsg.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(fd: i32, msg: *const libc::msghdr, flags: i32) -> isize {
    match message_to_wrap(msg) {
        None => sys!(libc::SYS_sendmsg, fd, msg, flags),
        Some(wrapped) => call_held(libc::SYS_sendmsg, fd, wrapped, flags).0,
    }
}
