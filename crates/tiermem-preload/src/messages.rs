//! recvmsg, sendmsg, recvmmsg and sendmmsg in sigbus fault mode: the managed parts of the
//! messages' buffers are held resident for one call. Pieces would split a datagram, so the call
//! is made once: on a stream socket with the buffer list cut where the resident bytes reach the
//! per-call share of the budget (a short transfer, which stream callers handle), on any other
//! socket whole; recvmmsg and sendmmsg take the messages that fit in that share (at least one),
//! and report fewer, as they may.

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use tiermem_engine::{Engine, PinGuard};

use crate::io::{
    any_needs_wrapping, budget_piece, held_or_copied, iovecs, managed_bytes, needs_wrapping, stretch, sys,
};
use crate::runtime;

fn is_stream_socket(fd: i32) -> bool {
    crate::io::socket_type(fd) == Some(libc::SOCK_STREAM)
}

/// Pins held for one call, and the buffer list cut to what they cover.
struct HeldMessage {
    _pins: Vec<PinGuard>,
    vecs: Vec<libc::iovec>,
}

/// Make the managed stretches of `[ptr, ptr+len)` resident, all of them (`cap` None) or until
/// `held` reaches `cap`, or the budget lets hold no more now (the caller takes a short
/// transfer; without a cap, a piece the engine refuses as too large for the budget ends it,
/// and the caller copies instead). Returns the bytes from `ptr` that are covered.
pub(crate) fn hold(
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
            let holding = !pins.is_empty();
            let Some((pin, pinned)) = crate::io::pin_up_to(engine, at, piece, kernel_writes, holding, cap.is_some())
            else {
                break;
            };
            pins.push(pin);
            *held += pinned;
            done += pinned;
            if pinned < piece {
                break;
            }
            continue;
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
    let vecs = hold_parts(engine, &mut pins, msg, vecs, kernel_writes, cap, &mut 0);
    HeldMessage { _pins: pins, vecs }
}

/// Hold a message's address and control buffers resident, whole, and its buffer list until
/// `held` reaches `cap`; returns the list cut to what is covered.
fn hold_parts(
    engine: &Engine,
    pins: &mut Vec<PinGuard>,
    msg: &libc::msghdr,
    vecs: &[libc::iovec],
    kernel_writes: bool,
    cap: Option<usize>,
    held: &mut usize,
) -> Vec<libc::iovec> {
    for (ptr, len) in [(msg.msg_name, msg.msg_namelen as usize), (msg.msg_control, msg.msg_controllen)] {
        if needs_wrapping(ptr, len) {
            hold(engine, pins, ptr, len, kernel_writes, None, held);
        }
    }
    hold_vectors(engine, pins, vecs, kernel_writes, cap, held)
}

/// Hold the managed stretches of the buffers of `vecs` resident, in order, until `held` reaches
/// `cap` (None: all of them). Returns the list cut to what is covered.
pub(crate) fn hold_vectors(
    engine: &Engine,
    pins: &mut Vec<PinGuard>,
    vecs: &[libc::iovec],
    kernel_writes: bool,
    cap: Option<usize>,
    held: &mut usize,
) -> Vec<libc::iovec> {
    let mut cut = Vec::with_capacity(vecs.len());
    for v in vecs {
        let covered = hold(engine, pins, v.iov_base, v.iov_len, kernel_writes, cap, held);
        if covered > 0 || v.iov_len == 0 {
            cut.push(libc::iovec { iov_base: v.iov_base, iov_len: covered });
        }
        if covered < v.iov_len {
            break;
        }
    }
    cut
}

/// The buffer list of a message (None: longer than the kernel takes).
fn vectors_of(m: &libc::msghdr) -> Option<&[libc::iovec]> {
    iovecs(m.msg_iov, m.msg_iovlen)
}

pub(crate) fn total(vecs: &[libc::iovec]) -> usize {
    vecs.iter().fold(0usize, |sum, v| sum.saturating_add(v.iov_len))
}

fn message_needs_wrapping(m: &libc::msghdr, vecs: &[libc::iovec]) -> bool {
    any_needs_wrapping(vecs)
        || needs_wrapping(m.msg_name, m.msg_namelen as usize)
        || needs_wrapping(m.msg_control, m.msg_controllen)
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
    let vecs = vectors_of(m)?;
    message_needs_wrapping(m, vecs).then_some((engine, m, vecs))
}

/// Make the call `number` (recvmsg or sendmsg) with the message's buffers held resident, or on
/// a socket that keeps message boundaries, with more managed bytes than a call may hold, through
/// a copy of them (see [`crate::io::through_copy`]). Returns its result and the message as the
/// kernel saw it (the buffer list possibly cut or replaced).
fn call_held(number: libc::c_long, fd: i32, (engine, m, vecs): Wrapped, flags: i32) -> (isize, libc::msghdr) {
    let kernel_writes = number == libc::SYS_recvmsg;
    let mut copy = *m;
    if is_stream_socket(fd) {
        runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
        let mut held = hold_message(engine, fd, m, vecs, kernel_writes);
        if total(&held.vecs) == 0 && total(vecs) > 0 {
            // Not a page could be held (a budget of a few pages): an empty list would read as
            // the end of the stream.
            runtime::set_errno(libc::ENOMEM);
            return (-1, copy);
        }
        copy.msg_iov = held.vecs.as_mut_ptr();
        copy.msg_iovlen = held.vecs.len();
        let r = sys!(number, fd, &mut copy as *mut libc::msghdr, flags);
        return (r, copy);
    }
    // A message: the address and control buffers (small) held resident as they are, the
    // buffer list held whole or copied.
    let mut pins = Vec::new();
    hold_parts(engine, &mut pins, m, &[], kernel_writes, None, &mut 0);
    let r = held_or_copied(vecs, kernel_writes, |copied| {
        // The copy as a one-element list (unused when the caller's own list goes).
        let (buf, len) = copied.unwrap_or((std::ptr::null_mut(), 0));
        let mut whole = libc::iovec { iov_base: buf, iov_len: len };
        if copied.is_some() {
            copy.msg_iov = &mut whole;
            copy.msg_iovlen = 1;
        }
        sys!(number, fd, &mut copy as *mut libc::msghdr, flags)
    });
    // Not left pointing at the closure's list, gone now.
    copy.msg_iov = m.msg_iov;
    copy.msg_iovlen = m.msg_iovlen;
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
    crate::io::retrying_refused(|| match message_to_wrap(msg) {
        None => sys!(libc::SYS_sendmsg, fd, msg, flags),
        Some(wrapped) => call_held(libc::SYS_sendmsg, fd, wrapped, flags).0,
    })
}

/// Make the call `number` (recvmmsg or sendmmsg) over `vlen` messages, those that fit in the
/// per-call share of the budget held resident (at least one), or None when nothing needs it.
/// The kernel's per-message results are copied back into the caller's array.
fn multiple_held(
    number: libc::c_long,
    fd: i32,
    msgs: *mut libc::mmsghdr,
    vlen: u32,
    flags: i32,
    timeout: *mut libc::timespec,
) -> Option<i32> {
    if msgs.is_null() || vlen == 0 || !runtime::sigbus_mode() {
        return None;
    }
    let engine = runtime::running_engine()?;
    // The kernel takes at most UIO_MAXIOV messages and ignores the rest.
    let vlen = vlen.min(1024);
    // SAFETY: the caller's array of vlen messages (its contract).
    let caller = unsafe { std::slice::from_raw_parts_mut(msgs, vlen as usize) };
    // Every list readable, and something to wrap (else the kernel takes the call as it is).
    let lists: Vec<&[libc::iovec]> = caller.iter().map(|m| vectors_of(&m.msg_hdr)).collect::<Option<_>>()?;
    if !caller.iter().zip(&lists).any(|(m, vecs)| message_needs_wrapping(&m.msg_hdr, vecs)) {
        return None;
    }
    let kernel_writes = number == libc::SYS_recvmmsg;
    let share = budget_piece(engine);
    // A stream socket's messages are cut at the share; datagrams go whole, as many as fit.
    let cut_at = is_stream_socket(fd).then_some(share);
    if cut_at.is_none() && managed_bytes(lists[0]) > share {
        return Some(first_alone(number, fd, (engine, caller), flags, timeout));
    }
    let first_len = total(lists[0]);
    let (mut pins, mut held) = (Vec::new(), 0usize);
    let mut cuts = Vec::with_capacity(caller.len());
    for (i, (m, vecs)) in caller.iter().zip(lists).enumerate() {
        // Later datagrams go in a later call when they would take the held bytes past the share.
        if i > 0 && (held >= share || (cut_at.is_none() && held + managed_bytes(vecs) > share)) {
            break;
        }
        let cut = hold_parts(engine, &mut pins, &m.msg_hdr, vecs, kernel_writes, cut_at, &mut held);
        let whole = total(&cut) == total(vecs);
        // A datagram goes whole or in a later call (refused: the budget shrank since).
        if whole || cut_at.is_some() {
            cuts.push(cut);
        }
        if !whole {
            break;
        }
    }
    if cuts.is_empty() {
        drop(pins);
        return Some(first_alone(number, fd, (engine, caller), flags, timeout));
    }
    if cut_at.is_some() && total(&cuts[0]) == 0 && first_len > 0 {
        // Not a page could be held (a budget of a few pages): an empty first message would
        // read as the end of the stream.
        runtime::set_errno(libc::ENOMEM);
        return Some(-1);
    }
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    let mut copies: Vec<libc::mmsghdr> = caller[..cuts.len()]
        .iter()
        .zip(cuts.iter_mut())
        .map(|(m, list)| {
            let mut copy = *m;
            copy.msg_hdr.msg_iov = list.as_mut_ptr();
            copy.msg_hdr.msg_iovlen = list.len();
            copy
        })
        .collect();
    let n = sys!(number, fd, copies.as_mut_ptr(), copies.len() as u32, flags, timeout);
    for (m, seen) in caller.iter_mut().zip(&copies).take(usize::try_from(n).unwrap_or(0)) {
        m.msg_len = seen.msg_len;
        if kernel_writes {
            m.msg_hdr.msg_namelen = seen.msg_hdr.msg_namelen;
            m.msg_hdr.msg_controllen = seen.msg_hdr.msg_controllen;
            m.msg_hdr.msg_flags = seen.msg_hdr.msg_flags;
        }
    }
    Some(n as i32)
}

/// recvmmsg or sendmmsg (`number`) of the first message alone, a datagram with more managed
/// bytes than a call may hold, as recvmsg or sendmsg takes it: through a copy. The timeout is
/// checked and counted down as the kernel does.
fn first_alone(
    number: libc::c_long,
    fd: i32,
    (engine, caller): (&'static Engine, &mut [libc::mmsghdr]),
    flags: i32,
    timeout: *mut libc::timespec,
) -> i32 {
    let kernel_writes = number == libc::SYS_recvmmsg;
    let started = std::time::Instant::now();
    let timeout = (kernel_writes && !timeout.is_null()).then_some(timeout);
    // SAFETY: the caller's timespec (its contract), read before anything is received.
    if timeout.is_some_and(|t| !valid_timeout(unsafe { &*t })) {
        runtime::set_errno(libc::EINVAL);
        return -1;
    }
    let single = if kernel_writes { libc::SYS_recvmsg } else { libc::SYS_sendmsg };
    let Some(vecs) = vectors_of(&caller[0].msg_hdr) else {
        runtime::set_errno(libc::EINVAL);
        return -1;
    };
    let (r, seen) = call_held(single, fd, (engine, &caller[0].msg_hdr, vecs), flags & !libc::MSG_WAITFORONE);
    if r < 0 {
        return -1;
    }
    caller[0].msg_len = r as u32;
    if kernel_writes {
        caller[0].msg_hdr.msg_namelen = seen.msg_namelen;
        caller[0].msg_hdr.msg_controllen = seen.msg_controllen;
        caller[0].msg_hdr.msg_flags = seen.msg_flags;
    }
    if let Some(t) = timeout {
        // SAFETY: as above; the kernel too writes back the time left.
        let t = unsafe { &mut *t };
        *t = time_left(t, started.elapsed());
    }
    1
}

/// Whether recvmmsg's kernel takes `t` (else EINVAL, before anything is received).
fn valid_timeout(t: &libc::timespec) -> bool {
    t.tv_sec >= 0 && (0..1_000_000_000).contains(&t.tv_nsec)
}

/// What is left of timeout `t` after `spent`, as recvmmsg writes it back (never below zero).
fn time_left(t: &libc::timespec, spent: std::time::Duration) -> libc::timespec {
    let total = std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32);
    let left = total.saturating_sub(spent);
    libc::timespec { tv_sec: left.as_secs() as libc::time_t, tv_nsec: left.subsec_nanos() as libc::c_long }
}

/// # Safety
/// The C contract of recvmmsg.
#[no_mangle]
pub unsafe extern "C" fn recvmmsg(
    fd: i32,
    msgs: *mut libc::mmsghdr,
    vlen: u32,
    flags: i32,
    timeout: *mut libc::timespec,
) -> i32 {
    multiple_held(libc::SYS_recvmmsg, fd, msgs, vlen, flags, timeout)
        .unwrap_or_else(|| sys!(libc::SYS_recvmmsg, fd, msgs, vlen, flags, timeout) as i32)
}

/// # Safety
/// The C contract of sendmmsg.
#[no_mangle]
pub unsafe extern "C" fn sendmmsg(fd: i32, msgs: *mut libc::mmsghdr, vlen: u32, flags: i32) -> i32 {
    crate::io::retrying_refused(|| {
        multiple_held(libc::SYS_sendmmsg, fd, msgs, vlen, flags, std::ptr::null_mut())
            .unwrap_or_else(|| sys!(libc::SYS_sendmmsg, fd, msgs, vlen, flags) as i32) as isize
    }) as i32
}

#[cfg(test)]
mod tests {
    use super::{time_left, valid_timeout};
    use std::time::Duration;

    fn ts(sec: i64, nsec: i64) -> libc::timespec {
        libc::timespec { tv_sec: sec, tv_nsec: nsec }
    }

    #[test]
    fn a_recvmmsg_timeout_is_checked_as_the_kernel_does_and_counts_down_to_zero() {
        assert!(valid_timeout(&ts(0, 0)) && valid_timeout(&ts(5, 999_999_999)));
        assert!(!valid_timeout(&ts(-1, 0)) && !valid_timeout(&ts(0, -1)) && !valid_timeout(&ts(0, 1_000_000_000)));
        let left = time_left(&ts(2, 500_000_000), Duration::from_millis(700));
        assert_eq!((left.tv_sec, left.tv_nsec), (1, 800_000_000));
        let none = time_left(&ts(0, 10), Duration::from_secs(1));
        assert_eq!((none.tv_sec, none.tv_nsec), (0, 0));
    }
}
