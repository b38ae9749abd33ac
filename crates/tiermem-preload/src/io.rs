//! System calls that read or write program memory, wrapped for sigbus fault mode. There the
//! kernel cannot wait for a missing managed page (userfaultfd's SIGBUS feature makes such a
//! copy fail with EFAULT), so the wrapper makes the buffer resident and holds it so while the
//! call runs, chunk by chunk to stay inside the budget. Regular files are read and written in
//! full, as the program asked; for pipes and sockets the first chunk's result is returned, a
//! short transfer those callers must already handle. In thread mode, and for buffers outside
//! managed memory, the calls go straight to the kernel. Here: read/write, the positioned and
//! vectored forms, recv/send with addresses, random bytes and stdio's fread/fwrite; message
//! calls are in [`crate::messages`].

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use tiermem_sys::PAGE_SIZE;

use crate::alloc::real;
use crate::registry;
use crate::runtime;

/// Largest piece held resident for one call.
const CHUNK_BYTES: usize = 256 << 10;

/// Most bytes the kernel moves in one read or write (MAX_RW_COUNT: INT_MAX rounded down to a
/// page); a call asking for more moves this much.
const MAX_RW_COUNT: usize = 0x7fff_f000;

/// Most times a call refused for want of memory is tried again.
const REFUSED_RETRIES: u32 = 16;

/// Make a call that needs kernel memory (sending to a socket or pipe), trying it again while it
/// fails with ENOMEM or ENOBUFS in a cgroup tiermem keeps full (see
/// [`runtime::memory_refused`]). Seen: a Redis server at 20% of its footprint lost its client
/// when a reply's socket buffer was refused ("No buffer space available"). A failed call moved
/// nothing, so trying again is what the program would see had the memory been there.
pub(crate) fn retrying_refused(mut call: impl FnMut() -> isize) -> isize {
    let mut tries = 0;
    loop {
        let r = call();
        if r >= 0 || tries == REFUSED_RETRIES {
            return r;
        }
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        if !matches!(errno, libc::ENOMEM | libc::ENOBUFS) || !runtime::memory_refused() {
            runtime::set_errno(errno);
            return r;
        }
        tries += 1;
    }
}

/// Whether a buffer needs wrapping.
pub(crate) fn needs_wrapping(buf: *const c_void, len: usize) -> bool {
    runtime::sigbus_mode() && len > 0 && registry::may_overlap(buf as usize, len)
}

fn is_regular_file(fd: i32) -> bool {
    // SAFETY: fstat writes into the zeroed struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::fstat(fd, &mut st) == 0 && st.st_mode & libc::S_IFMT == libc::S_IFREG }
}

/// Bytes from `addr` that lie in one stretch of managed (`Some(region end)`) or unmanaged memory.
pub(crate) fn stretch(addr: usize, want: usize) -> (usize, bool) {
    let table = registry::lock();
    match registry::segments(&table, addr, addr.saturating_add(want)).first() {
        Some(&(from, to, managed)) => (to - from, managed.is_some()),
        None => (want, false),
    }
}

/// The most bytes held resident for one call: a quarter of the budget (at least a page).
pub(crate) fn budget_piece(engine: &tiermem_engine::Engine) -> usize {
    (engine.limit_pages() as usize * PAGE_SIZE / 4).max(PAGE_SIZE)
}

/// Hold `[at, at+len)` resident for one system call or, with `shrink`, as many of those bytes
/// as the budget lets be held now (at least to the end of the first page): the budget can
/// shrink between sizing a piece and pinning it (the cgroup watch following a burst of
/// unmanaged memory), and a shorter piece is a short transfer, which callers that pass
/// `shrink` handle, where a refusal ended the program. While other threads' calls hold so much
/// of the budget that this one would leave no room (the engine says Busy), wait for theirs to
/// end: each holds its pages only for its call. `holding`: this thread holds pins of its own
/// meanwhile, so several such threads could wait for each other: then it waits two seconds at
/// most before giving up as on any other failure (the program ends with a message). Returns
/// the pin and the bytes it holds, or None when the engine refuses the piece as too large for
/// the budget and it may not, or cannot, be shorter (the caller copies instead, or gives up).
pub(crate) fn pin_up_to(
    engine: &tiermem_engine::Engine,
    at: usize,
    mut len: usize,
    kernel_writes: bool,
    holding: bool,
    shrink: bool,
) -> Option<(tiermem_engine::PinGuard, usize)> {
    let mut started = std::time::Instant::now();
    loop {
        match engine.prepare_kernel_access(at as *const u8, len, kernel_writes) {
            Ok(pin) => return Some((pin, len)),
            // Refused as too large for the budget, or busy for a while (the room pins leave the
            // faults that bring their pages in may be all a small budget has, whatever other
            // threads hold: it waited for ever there), with a piece that could be shorter.
            Err(e)
                if shrink
                    && shorter_piece(at, len) < len
                    && (e.kind() == tiermem_sys::ErrorKind::InvalidInput
                        || (e.kind() == tiermem_sys::ErrorKind::Busy
                            && started.elapsed() > std::time::Duration::from_millis(20))) =>
            {
                len = shorter_piece(at, len);
                started = std::time::Instant::now();
            }
            Err(e)
                if e.kind() == tiermem_sys::ErrorKind::Busy
                    && !(holding && started.elapsed() > std::time::Duration::from_secs(2)) =>
            {
                std::thread::sleep(std::time::Duration::from_micros(200))
            }
            Err(e) if e.kind() == tiermem_sys::ErrorKind::InvalidInput => return None,
            Err(e) => runtime::die(&["tiermem: cannot make a system call's buffer resident: ", &e.to_string()]),
        }
    }
}

/// Half of a piece of `len` bytes from `at`, but never less than what lies in its first page.
fn shorter_piece(at: usize, len: usize) -> usize {
    let first_page = PAGE_SIZE - at % PAGE_SIZE;
    (len / 2).max(first_page).min(len)
}

/// Run `op(ptr, len)` over `[buf, buf+len)` in pieces, each held resident while the kernel copies
/// to (`kernel_writes`) or from it. Stops at a short transfer, and after the first piece unless
/// `whole`. Returns the bytes moved, or the first piece's error.
fn in_resident_pieces(
    buf: *mut c_void,
    len: usize,
    kernel_writes: bool,
    whole: bool,
    mut op: impl FnMut(*mut c_void, usize) -> isize,
) -> isize {
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    let Some(engine) = runtime::running_engine() else { return op(buf, len) };
    let budget_piece = budget_piece(engine);
    let mut done = 0usize;
    while done < len {
        let at = buf as usize + done;
        let (piece, managed) = stretch(at, (len - done).min(CHUNK_BYTES).min(budget_piece));
        let (_pin, piece) = if managed {
            let Some((pin, held)) = pin_up_to(engine, at, piece, kernel_writes, false, true) else {
                // What moved so far is a short transfer; nothing at all cannot be made one.
                if done > 0 {
                    return done as isize;
                }
                runtime::die(&[
                    "tiermem: cannot make a system call's buffer resident: the engine refused its first page",
                ]);
            };
            (Some(pin), held)
        } else {
            (None, piece)
        };
        let n = op(at as *mut c_void, piece);
        if n < 0 {
            return if done > 0 { done as isize } else { n };
        }
        done += n as usize;
        if (n as usize) < piece || !whole {
            break;
        }
    }
    done as isize
}

/// Whether `fd` is a socket that keeps message boundaries (datagram, sequenced packets, raw): a
/// call on it moves one message, which pieces would split (a send) or cut short (a receive).
fn keeps_messages(fd: i32) -> bool {
    socket_type(fd).is_some_and(|kind| kind != libc::SOCK_STREAM)
}

/// The type of socket `fd` is (SOCK_STREAM, SOCK_DGRAM, ...), None for anything else.
pub(crate) fn socket_type(fd: i32) -> Option<libc::c_int> {
    let mut kind: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `kind`; anything but a socket fails.
    let ok = unsafe {
        libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut kind as *mut libc::c_int).cast(), &mut len)
    };
    (ok == 0).then_some(kind)
}

/// `op(buf, len)` once, with every managed stretch of the buffer held resident for the call:
/// for a socket that keeps message boundaries (see [`keeps_messages`]). A buffer with more
/// managed bytes than a call may hold goes through a copy instead (see [`held_or_copied`]).
fn in_one_call(
    buf: *mut c_void,
    len: usize,
    kernel_writes: bool,
    op: impl FnOnce(*mut c_void, usize) -> isize,
) -> isize {
    let whole = [libc::iovec { iov_base: buf, iov_len: len }];
    held_or_copied(&whole, kernel_writes, |copy| {
        let (p, n) = copy.unwrap_or((buf, len));
        op(p, n)
    })
}

/// One call that must move the buffers of `vecs` whole (a message): `call(None)` with their
/// managed stretches held resident, or, when those are more than a call may hold or the engine
/// refuses them (the budget shrank since), `call(Some((copy, len)))` on a copy of them (see
/// [`through_copy`]).
pub(crate) fn held_or_copied(
    vecs: &[libc::iovec],
    kernel_writes: bool,
    call: impl FnOnce(Option<(*mut c_void, usize)>) -> isize,
) -> isize {
    runtime::SYSCALLS_WRAPPED.fetch_add(1, Ordering::Relaxed);
    let Some(engine) = runtime::running_engine() else { return call(None) };
    if managed_bytes(vecs) <= budget_piece(engine) {
        let mut pins = Vec::new();
        let held = crate::messages::hold_vectors(engine, &mut pins, vecs, kernel_writes, None, &mut 0);
        if crate::messages::total(&held) == crate::messages::total(vecs) {
            return call(None);
        }
    }
    through_copy(vecs, kernel_writes, |p, n| call(Some((p, n))))
}

/// Bytes of the buffers of `vecs` that lie in managed memory.
pub(crate) fn managed_bytes(vecs: &[libc::iovec]) -> usize {
    let mut managed = 0;
    for v in vecs {
        let mut done = 0;
        while done < v.iov_len {
            let (piece, is_managed) = stretch(v.iov_base as usize + done, v.iov_len - done);
            if is_managed {
                managed += piece;
            }
            done += piece;
        }
    }
    managed
}

/// `op(copy, len)` once on an unmanaged copy of the buffers of `vecs` (`len` their total):
/// for a call that must move one message whole (a datagram) from or into more managed memory
/// than a call may hold resident, which ended the program before. A send copies the buffers in
/// first; a receive copies what the kernel wrote out after (as much as fits, when the message
/// was longer). The copy is the program's own access, so evicted pages come in as on any
/// other; its memory, mapped past the registry, is charged to the program's cgroup while the
/// call lasts. No copy to be had: ENOMEM, as the kernel says when it lacks the memory.
pub(crate) fn through_copy(
    vecs: &[libc::iovec],
    kernel_writes: bool,
    op: impl FnOnce(*mut c_void, usize) -> isize,
) -> isize {
    // The kernel moves at most MAX_RW_COUNT bytes in one call, whatever the lengths say.
    let len = vecs.iter().fold(0usize, |sum, v| sum.saturating_add(v.iov_len)).min(MAX_RW_COUNT);
    let Ok(copy) = tiermem_sys::mem::Mapping::anonymous(len.max(1).next_multiple_of(PAGE_SIZE), false) else {
        runtime::set_errno(libc::ENOMEM);
        return -1;
    };
    let base = copy.as_ptr();
    if !kernel_writes {
        let mut at = 0;
        for v in vecs {
            let n = v.iov_len.min(len - at);
            // SAFETY: n bytes of the caller's buffer of iov_len bytes (its contract) into the
            // copy, which has room for them and overlaps nothing of the caller's.
            unsafe { std::ptr::copy_nonoverlapping(v.iov_base as *const u8, base.wrapping_add(at), n) };
            at += n;
        }
    }
    let r = op(base.cast(), len);
    if kernel_writes && r > 0 {
        // MSG_TRUNC reports a datagram's whole length, which may be more than was written.
        let mut left = (r as usize).min(len);
        let mut from = 0;
        for v in vecs {
            let n = v.iov_len.min(left);
            // SAFETY: as above, the other way: n bytes the kernel wrote into the copy, into the
            // caller's buffer of at least n bytes.
            unsafe { std::ptr::copy_nonoverlapping(base.wrapping_add(from), v.iov_base as *mut u8, n) };
            from += n;
            left -= n;
        }
    }
    r
}

/// [`in_resident_pieces`], or [`in_one_call`] on a socket that keeps message boundaries.
fn on_descriptor(
    fd: i32,
    buf: *mut c_void,
    len: usize,
    kernel_writes: bool,
    whole: bool,
    op: impl FnMut(*mut c_void, usize) -> isize,
) -> isize {
    if keeps_messages(fd) {
        in_one_call(buf, len, kernel_writes, op)
    } else {
        in_resident_pieces(buf, len, kernel_writes, whole, op)
    }
}

/// The C library's `syscall`, found past this library's own (which sends the calls wrapped here
/// to their wrappers, see [`crate::syscall`]).
pub(crate) type SyscallFn = unsafe extern "C" fn(libc::c_long, ...) -> libc::c_long;

pub(crate) fn real_syscall() -> SyscallFn {
    real!("syscall", SyscallFn)
}

/// A system call straight to the kernel: -1 with errno set on failure, as libc's syscall().
macro_rules! sys {
    ($number:expr $(, $arg:expr)*) => {
        // SAFETY: the caller's own system call, with its own arguments (buffer pieces stay inside
        // the caller's buffer).
        unsafe { ($crate::io::real_syscall())($number $(, $arg)*) as isize }
    };
}
pub(crate) use sys;

/// # Safety
/// The C contract of read.
#[no_mangle]
pub unsafe extern "C" fn read(fd: i32, buf: *mut c_void, len: usize) -> isize {
    if !needs_wrapping(buf, len) {
        return sys!(libc::SYS_read, fd, buf, len);
    }
    on_descriptor(fd, buf, len, true, is_regular_file(fd), |p, n| sys!(libc::SYS_read, fd, p, n))
}

/// # Safety
/// The C contract of write.
#[no_mangle]
pub unsafe extern "C" fn write(fd: i32, buf: *const c_void, len: usize) -> isize {
    retrying_refused(|| {
        if !needs_wrapping(buf, len) {
            return sys!(libc::SYS_write, fd, buf, len);
        }
        on_descriptor(fd, buf.cast_mut(), len, false, true, |p, n| sys!(libc::SYS_write, fd, p, n))
    })
}

/// pread/pwrite: pieces at advancing file offsets.
fn positioned(syscall: libc::c_long, fd: i32, buf: *mut c_void, len: usize, off: i64, kernel_writes: bool) -> isize {
    if !needs_wrapping(buf, len) {
        return sys!(syscall, fd, buf, len, off);
    }
    let mut at = off;
    in_resident_pieces(buf, len, kernel_writes, true, |p, n| {
        let r = sys!(syscall, fd, p, n, at);
        at += r.max(0) as i64;
        r
    })
}

/// # Safety
/// The C contract of pread.
#[no_mangle]
pub unsafe extern "C" fn pread(fd: i32, buf: *mut c_void, len: usize, off: i64) -> isize {
    positioned(libc::SYS_pread64, fd, buf, len, off, true)
}

/// # Safety
/// The C contract of pread64.
#[no_mangle]
pub unsafe extern "C" fn pread64(fd: i32, buf: *mut c_void, len: usize, off: i64) -> isize {
    // SAFETY: the same call.
    unsafe { pread(fd, buf, len, off) }
}

/// # Safety
/// The C contract of pwrite.
#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: i32, buf: *const c_void, len: usize, off: i64) -> isize {
    positioned(libc::SYS_pwrite64, fd, buf.cast_mut(), len, off, false)
}

/// # Safety
/// The C contract of pwrite64.
#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: i32, buf: *const c_void, len: usize, off: i64) -> isize {
    // SAFETY: the same call.
    unsafe { pwrite(fd, buf, len, off) }
}

/// # Safety
/// The C contract of recvfrom.
#[no_mangle]
pub unsafe extern "C" fn recvfrom(
    fd: i32,
    buf: *mut c_void,
    len: usize,
    flags: i32,
    from: *mut libc::sockaddr,
    from_len: *mut libc::socklen_t,
) -> isize {
    // The sender's address, written by the kernel after the message is taken: in a large
    // allocation and not resident, the message was lost with EFAULT.
    let _address = if needs_wrapping(from.cast(), 1) || needs_wrapping(from_len.cast(), 4) {
        let mut pins = hold_address(from_len.cast(), 4, true);
        // SAFETY: the caller's length word, non-null once `from` is (its contract).
        let len = unsafe { from_len.as_ref() }.map_or(0, |&l| (l as usize).min(ADDRESS_BYTES));
        pins.extend(hold_address(from.cast(), len, true));
        pins
    } else {
        Vec::new()
    };
    if !needs_wrapping(buf, len) {
        return sys!(libc::SYS_recvfrom, fd, buf, len, flags, from, from_len);
    }
    on_descriptor(fd, buf, len, true, false, |p, n| sys!(libc::SYS_recvfrom, fd, p, n, flags, from, from_len))
}

/// The most bytes of a socket address the kernel reads or writes (a `sockaddr_storage`).
const ADDRESS_BYTES: usize = std::mem::size_of::<libc::sockaddr_storage>();

/// Pins holding the managed stretches of a socket address (or its length word) at
/// `[ptr, ptr+len)` resident for one call. Refused, only under a budget of a few pages, the
/// call goes as it is.
fn hold_address(ptr: *const c_void, len: usize, kernel_writes: bool) -> Vec<tiermem_engine::PinGuard> {
    let mut pins = Vec::new();
    if let (true, Some(engine)) = (needs_wrapping(ptr, len), runtime::running_engine()) {
        crate::messages::hold(engine, &mut pins, ptr.cast_mut(), len, kernel_writes, None, &mut 0);
    }
    pins
}

/// # Safety
/// The C contract of recv.
#[no_mangle]
pub unsafe extern "C" fn recv(fd: i32, buf: *mut c_void, len: usize, flags: i32) -> isize {
    // SAFETY: recv is recvfrom without an address.
    unsafe { recvfrom(fd, buf, len, flags, std::ptr::null_mut(), std::ptr::null_mut()) }
}

/// # Safety
/// The C contract of sendto.
#[no_mangle]
pub unsafe extern "C" fn sendto(
    fd: i32,
    buf: *const c_void,
    len: usize,
    flags: i32,
    to: *const libc::sockaddr,
    to_len: libc::socklen_t,
) -> isize {
    retrying_refused(|| {
        let _address = hold_address(to.cast(), (to_len as usize).min(ADDRESS_BYTES), false);
        if !needs_wrapping(buf, len) {
            return sys!(libc::SYS_sendto, fd, buf, len, flags, to, to_len);
        }
        on_descriptor(fd, buf.cast_mut(), len, false, true, |p, n| sys!(libc::SYS_sendto, fd, p, n, flags, to, to_len))
    })
}

/// # Safety
/// The C contract of send.
#[no_mangle]
pub unsafe extern "C" fn send(fd: i32, buf: *const c_void, len: usize, flags: i32) -> isize {
    // SAFETY: send is sendto without an address.
    unsafe { sendto(fd, buf, len, flags, std::ptr::null(), 0) }
}

/// Most elements the kernel takes in one buffer list (UIO_MAXIOV).
const MAX_IOVECS: usize = 1024;

/// A caller's buffer list of `count` elements (empty for none), or None when it is longer than
/// the kernel takes: the call then goes to the kernel as it is, which refuses it (EINVAL or
/// EMSGSIZE) without reading the list.
pub(crate) fn iovecs<'a>(iov: *const libc::iovec, count: usize) -> Option<&'a [libc::iovec]> {
    if count > MAX_IOVECS {
        None
    } else if iov.is_null() || count == 0 {
        Some(&[])
    } else {
        // SAFETY: iov holds count elements (the caller's contract).
        Some(unsafe { std::slice::from_raw_parts(iov, count) })
    }
}

/// Whether any buffer of the list needs wrapping.
pub(crate) fn any_needs_wrapping(vecs: &[libc::iovec]) -> bool {
    vecs.iter().any(|v| needs_wrapping(v.iov_base, v.iov_len))
}

/// The elements of a vectored call's buffer list, when any of them needs wrapping.
fn vectors_to_wrap<'a>(iov: *const libc::iovec, count: i32) -> Option<&'a [libc::iovec]> {
    if count <= 0 || !runtime::sigbus_mode() {
        return None;
    }
    iovecs(iov, count as usize).filter(|vecs| any_needs_wrapping(vecs))
}

/// A vectored call over managed buffers, one element at a time in resident pieces moved by
/// `piece(ptr, len)`, stopping at a short transfer (and after the first piece unless `whole`).
fn each_vector(
    vecs: &[libc::iovec],
    kernel_writes: bool,
    whole: bool,
    mut piece: impl FnMut(*mut c_void, usize) -> isize,
) -> isize {
    let mut total = 0isize;
    // An empty buffer moves nothing: not a short transfer (a read of 0 would say end of file).
    for v in vecs.iter().filter(|v| v.iov_len > 0) {
        let n = in_resident_pieces(v.iov_base, v.iov_len, kernel_writes, whole, &mut piece);
        if n < 0 {
            return if total > 0 { total } else { n };
        }
        total += n;
        if (n as usize) < v.iov_len || !whole {
            break;
        }
    }
    total
}

/// # Safety
/// The C contract of readv.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: i32, iov: *const libc::iovec, count: i32) -> isize {
    match vectors_to_wrap(iov, count) {
        None => sys!(libc::SYS_readv, fd, iov, count),
        // One datagram fills the list in order: in pieces, each read took a datagram of its own.
        Some(vecs) if keeps_messages(fd) => held_or_copied(vecs, true, |copy| match copy {
            None => sys!(libc::SYS_readv, fd, iov, count),
            Some((p, n)) => sys!(libc::SYS_read, fd, p, n),
        }),
        Some(vecs) => each_vector(vecs, true, is_regular_file(fd), |p, n| sys!(libc::SYS_read, fd, p, n)),
    }
}

/// # Safety
/// The C contract of writev.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: i32, iov: *const libc::iovec, count: i32) -> isize {
    retrying_refused(|| match vectors_to_wrap(iov, count) {
        None => sys!(libc::SYS_writev, fd, iov, count),
        // The whole list is one datagram: in pieces, each piece went as a datagram of its own.
        Some(vecs) if keeps_messages(fd) => held_or_copied(vecs, false, |copy| match copy {
            None => sys!(libc::SYS_writev, fd, iov, count),
            Some((p, n)) => sys!(libc::SYS_write, fd, p, n),
        }),
        Some(vecs) => each_vector(vecs, false, true, |p, n| sys!(libc::SYS_write, fd, p, n)),
    })
}

/// preadv2/pwritev2 (and preadv/pwritev, flags 0) over managed buffers: each piece a one-element
/// call at the advancing offset, or at the file position where the offset is -1.
fn positioned_vectors(
    syscall: libc::c_long,
    fd: i32,
    vecs: &[libc::iovec],
    off: i64,
    flags: i32,
    kernel_writes: bool,
) -> isize {
    if off == -1 && keeps_messages(fd) {
        // At the current position, on a socket: one message, as readv and writev move it.
        return held_or_copied(vecs, kernel_writes, |copy| match copy {
            None => sys!(syscall, fd, vecs.as_ptr(), vecs.len(), off, 0, flags),
            Some((p, n)) => {
                let one = libc::iovec { iov_base: p, iov_len: n };
                sys!(syscall, fd, &one as *const libc::iovec, 1, off, 0, flags)
            }
        });
    }
    // A pipe or socket read at its current position gives what is there: a second piece would
    // wait for more (as readv's would).
    let whole = off != -1 || is_regular_file(fd) || !kernel_writes;
    let mut at = off;
    each_vector(vecs, kernel_writes, whole, |p, n| {
        let one = libc::iovec { iov_base: p, iov_len: n };
        // On 64-bit targets the kernel takes the whole offset in its low word.
        let r = sys!(syscall, fd, &one as *const libc::iovec, 1, at, 0, flags);
        if at >= 0 {
            at += r.max(0) as i64;
        }
        r
    })
}

type PositionedVectorsFn = unsafe extern "C" fn(i32, *const libc::iovec, i32, i64, i32) -> isize;

/// # Safety
/// The C contract of preadv2.
#[no_mangle]
pub unsafe extern "C" fn preadv2(fd: i32, iov: *const libc::iovec, count: i32, off: i64, flags: i32) -> isize {
    match vectors_to_wrap(iov, count) {
        None => {
            let real = real!("preadv2", PositionedVectorsFn);
            // SAFETY: the caller's own call.
            unsafe { real(fd, iov, count, off, flags) }
        }
        Some(vecs) => positioned_vectors(libc::SYS_preadv2, fd, vecs, off, flags, true),
    }
}

/// # Safety
/// The C contract of pwritev2.
#[no_mangle]
pub unsafe extern "C" fn pwritev2(fd: i32, iov: *const libc::iovec, count: i32, off: i64, flags: i32) -> isize {
    // At the current position it may write to a socket or pipe, which needs kernel memory: as
    // writev, tried again when refused for want of it.
    retrying_refused(|| match vectors_to_wrap(iov, count) {
        None => {
            let real = real!("pwritev2", PositionedVectorsFn);
            // SAFETY: the caller's own call.
            unsafe { real(fd, iov, count, off, flags) }
        }
        Some(vecs) => positioned_vectors(libc::SYS_pwritev2, fd, vecs, off, flags, false),
    })
}

/// # Safety
/// The C contract of preadv64v2.
#[no_mangle]
pub unsafe extern "C" fn preadv64v2(fd: i32, iov: *const libc::iovec, count: i32, off: i64, flags: i32) -> isize {
    // SAFETY: the same call.
    unsafe { preadv2(fd, iov, count, off, flags) }
}

/// # Safety
/// The C contract of pwritev64v2.
#[no_mangle]
pub unsafe extern "C" fn pwritev64v2(fd: i32, iov: *const libc::iovec, count: i32, off: i64, flags: i32) -> isize {
    // SAFETY: the same call.
    unsafe { pwritev2(fd, iov, count, off, flags) }
}

type VectorsAtFn = unsafe extern "C" fn(i32, *const libc::iovec, i32, i64) -> isize;

/// # Safety
/// The C contract of preadv.
#[no_mangle]
pub unsafe extern "C" fn preadv(fd: i32, iov: *const libc::iovec, count: i32, off: i64) -> isize {
    match vectors_to_wrap(iov, count) {
        // A negative offset is the kernel's error to report (preadv2 would read at the file
        // position instead).
        Some(vecs) if off >= 0 => positioned_vectors(libc::SYS_preadv2, fd, vecs, off, 0, true),
        _ => {
            let real = real!("preadv", VectorsAtFn);
            // SAFETY: the caller's own call.
            unsafe { real(fd, iov, count, off) }
        }
    }
}

/// # Safety
/// The C contract of pwritev.
#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: i32, iov: *const libc::iovec, count: i32, off: i64) -> isize {
    match vectors_to_wrap(iov, count) {
        Some(vecs) if off >= 0 => positioned_vectors(libc::SYS_pwritev2, fd, vecs, off, 0, false),
        _ => {
            let real = real!("pwritev", VectorsAtFn);
            // SAFETY: the caller's own call.
            unsafe { real(fd, iov, count, off) }
        }
    }
}

/// # Safety
/// The C contract of preadv64.
#[no_mangle]
pub unsafe extern "C" fn preadv64(fd: i32, iov: *const libc::iovec, count: i32, off: i64) -> isize {
    // SAFETY: the same call.
    unsafe { preadv(fd, iov, count, off) }
}

/// # Safety
/// The C contract of pwritev64.
#[no_mangle]
pub unsafe extern "C" fn pwritev64(fd: i32, iov: *const libc::iovec, count: i32, off: i64) -> isize {
    // SAFETY: the same call.
    unsafe { pwritev(fd, iov, count, off) }
}

/// # Safety
/// The C contract of getrandom.
#[no_mangle]
pub unsafe extern "C" fn getrandom(buf: *mut c_void, len: usize, flags: u32) -> isize {
    if !needs_wrapping(buf, len) {
        return sys!(libc::SYS_getrandom, buf, len, flags);
    }
    in_resident_pieces(buf, len, true, true, |p, n| sys!(libc::SYS_getrandom, p, n, flags))
}

/// # Safety
/// The C contract of getentropy.
#[no_mangle]
pub unsafe extern "C" fn getentropy(buf: *mut c_void, len: usize) -> i32 {
    if len > 256 {
        runtime::set_errno(libc::EIO);
        return -1;
    }
    let mut done = 0;
    while done < len {
        // SAFETY: the rest of the caller's buffer.
        let n = unsafe { getrandom((buf as usize + done) as *mut c_void, len - done, 0) };
        if n < 0 {
            if runtime::errno() == libc::EINTR {
                continue;
            }
            return -1;
        }
        done += n as usize;
    }
    0
}

type StdioFn = unsafe extern "C" fn(*mut c_void, usize, usize, *mut libc::FILE) -> usize;

/// fread/fwrite over a managed buffer in pieces of whole elements. stdio moves large requests
/// straight between the file and the caller's buffer, inside the C library where the read and
/// write wrappers above cannot see it.
fn stdio_pieces(
    real: StdioFn,
    buf: *mut c_void,
    size: usize,
    count: usize,
    stream: *mut libc::FILE,
    kernel_writes: bool,
) -> usize {
    let Some(total) = size.checked_mul(count) else { return 0 };
    if size == 0 || !needs_wrapping(buf, total) {
        // SAFETY: the caller's own call.
        return unsafe { real(buf, size, count, stream) };
    }
    let per_piece = (CHUNK_BYTES / size).max(1);
    let mut done = 0usize;
    while done < count {
        let items = per_piece.min(count - done);
        let at = (buf as usize + done * size) as *mut c_void;
        let moved = in_resident_pieces(at, items * size, kernel_writes, true, |p, n| {
            // SAFETY: the caller's call on a piece of its own buffer (n is a whole number of
            // items except where a piece ends at a region boundary, handled by the byte count).
            let got = unsafe { real(p, 1, n, stream) };
            got as isize
        });
        let items_moved = moved.max(0) as usize / size;
        done += items_moved;
        if items_moved < items {
            break;
        }
    }
    done
}

/// # Safety
/// The C contract of fread.
#[no_mangle]
pub unsafe extern "C" fn fread(buf: *mut c_void, size: usize, count: usize, stream: *mut libc::FILE) -> usize {
    let real = real!("fread", StdioFn);
    stdio_pieces(real, buf, size, count, stream, true)
}

/// # Safety
/// The C contract of fwrite.
#[no_mangle]
pub unsafe extern "C" fn fwrite(buf: *const c_void, size: usize, count: usize, stream: *mut libc::FILE) -> usize {
    let real = real!("fwrite", StdioFn);
    stdio_pieces(real, buf.cast_mut(), size, count, stream, false)
}

/// # Safety
/// The C contract of fread_unlocked (what GNU programs built with gnulib call for fread).
#[no_mangle]
pub unsafe extern "C" fn fread_unlocked(buf: *mut c_void, size: usize, count: usize, stream: *mut libc::FILE) -> usize {
    let real = real!("fread_unlocked", StdioFn);
    stdio_pieces(real, buf, size, count, stream, true)
}

/// # Safety
/// The C contract of fwrite_unlocked.
#[no_mangle]
pub unsafe extern "C" fn fwrite_unlocked(
    buf: *const c_void,
    size: usize,
    count: usize,
    stream: *mut libc::FILE,
) -> usize {
    let real = real!("fwrite_unlocked", StdioFn);
    stdio_pieces(real, buf.cast_mut(), size, count, stream, false)
}

#[cfg(test)]
mod tests {
    use super::{shorter_piece, through_copy, PAGE_SIZE};

    fn list(parts: &mut [Vec<u8>]) -> Vec<libc::iovec> {
        parts.iter_mut().map(|p| libc::iovec { iov_base: p.as_mut_ptr().cast(), iov_len: p.len() }).collect()
    }

    #[test]
    fn a_copy_gathers_a_send_and_scatters_a_receive_over_the_buffer_list() {
        let mut parts = vec![vec![1u8; 5000], vec![2u8; 3], vec![], vec![3u8; 100]];
        let sent = through_copy(&list(&mut parts), false, |p, len| {
            // SAFETY: the copy of `len` bytes the call is given.
            let copy = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
            assert_eq!(copy, [vec![1u8; 5000], vec![2u8; 3], vec![3u8; 100]].concat());
            len as isize
        });
        assert_eq!(sent, 5103);
        // A receive of a longer message (MSG_TRUNC's length): what fits, in order.
        let got = through_copy(&list(&mut parts), true, |p, len| {
            // SAFETY: as above, written as the kernel would.
            let copy = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) };
            for (i, b) in copy.iter_mut().enumerate() {
                *b = (i % 251) as u8;
            }
            len as isize + 40
        });
        assert_eq!(got, 5143);
        let all: Vec<u8> = parts.concat();
        assert!(all.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        // A short receive leaves the rest as it was; a failure copies nothing.
        let mut parts = vec![vec![9u8; 10], vec![9u8; 10]];
        assert_eq!(through_copy(&list(&mut parts), true, |_, _| 12), 12);
        assert_eq!(parts.concat(), [vec![0u8; 12], vec![9u8; 8]].concat());
        assert_eq!(through_copy(&list(&mut parts), true, |_, _| -1), -1);
        assert_eq!(parts.concat(), [vec![0u8; 12], vec![9u8; 8]].concat());
    }

    #[test]
    fn a_piece_halves_down_to_what_lies_in_its_first_page() {
        assert_eq!(shorter_piece(0, 16 * PAGE_SIZE), 8 * PAGE_SIZE);
        // From the middle of a page: half, or the rest of the first page if that is more.
        assert_eq!(shorter_piece(100, 3 * PAGE_SIZE), 3 * PAGE_SIZE / 2);
        assert_eq!(shorter_piece(100, PAGE_SIZE), PAGE_SIZE - 100);
        // Nothing shorter to offer: the caller gives up.
        assert_eq!(shorter_piece(PAGE_SIZE - 8, 8), 8);
        assert_eq!(shorter_piece(0, PAGE_SIZE), PAGE_SIZE);
    }
}
