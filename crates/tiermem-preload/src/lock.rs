//! The mlock family over managed memory. Passed to the kernel, a lock on managed memory made
//! the kernel fault every page in through the engine, which then could not evict any of them
//! (MADV_DONTNEED refuses locked pages): past the budget the program hung. Here:
//!
//! - `mlock`/`mlock2` pin the managed part (mmap'd or malloc'd, small-heap blocks included) in
//!   the engine: its pages are brought in and never evicted until `munlock`, `munlockall`, or
//!   the memory is unmapped, freed or shrunk away. Locked managed memory may take up to a
//!   quarter of the budget (system calls' buffers are pinned beside it); past that, or past
//!   RLIMIT_MEMLOCK without CAP_IPC_LOCK, the call fails with ENOMEM before locking anything
//!   (EPERM when that limit is 0, as the kernel's). The unmanaged part goes to the kernel.
//! - `mlockall` fails with ENOMEM (and a message) once memory is managed, or when it asks for
//!   MCL_FUTURE (future managed allocations could not be paged): locking all of a program's
//!   memory is the opposite of paging it. Before then, MCL_CURRENT alone goes to the kernel.
//! - MADV_DONTNEED and MADV_FREE on locked managed pages fail with EINVAL, as on locked pages.
//!
//! In a forked child, whose memory is a plain copy, every call goes to the kernel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tiermem_engine::{Engine, PinGuard};
use tiermem_sys::PAGE_SIZE;

use crate::io::{stretch, sys};
use crate::runtime;

/// A locked, page-aligned stretch of one managed region.
struct Lock {
    start: usize,
    end: usize,
    _pin: PinGuard,
}

struct Locks {
    held: Vec<Lock>,
    /// Bytes being pinned outside the lock (counted so two calls cannot both pass the limit).
    pending: usize,
}

impl Locks {
    /// Bytes counted against the quota: locked, and being pinned or set aside.
    fn counted(&self) -> usize {
        self.held.iter().map(|l| l.end - l.start).sum::<usize>() + self.pending
    }
}

static LOCKS: Mutex<Locks> = Mutex::new(Locks { held: Vec::new(), pending: 0 });

fn locks() -> std::sync::MutexGuard<'static, Locks> {
    LOCKS.lock().unwrap_or_else(|e| e.into_inner())
}

fn page_span(addr: usize, len: usize) -> (usize, usize) {
    let start = addr & !(PAGE_SIZE - 1);
    (start, addr.saturating_add(len).next_multiple_of(PAGE_SIZE))
}

/// `[start, end)` cut into managed and unmanaged pieces, in order.
fn pieces(start: usize, end: usize) -> Vec<(usize, usize, bool)> {
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let (to, managed) = match crate::heap::chunk_bounds(at) {
            // A small-heap chunk: a managed region outside the registry.
            Some((_, chunk_end)) => (chunk_end.min(end), true),
            None => {
                let (len, managed) = stretch(at, end - at);
                let to = at + len.max(PAGE_SIZE).min(end - at);
                // An unmanaged stretch ends where a small-heap chunk begins.
                let to = if managed { to } else { crate::heap::first_chunk_start_in(at + 1, to).unwrap_or(to) };
                (to, managed)
            }
        };
        out.push((at, to, managed));
        at = to;
    }
    out
}

fn say_once(said: &AtomicBool, parts: &[&str]) {
    if !said.swap(true, Ordering::Relaxed) {
        runtime::say(parts);
    }
}

fn refuse(errno: i32) -> isize {
    runtime::set_errno(errno);
    -1
}

/// The parts of `[from, to)` no lock covers.
fn uncovered(held: &[Lock], from: usize, to: usize) -> Vec<(usize, usize)> {
    let mut covering: Vec<(usize, usize)> =
        held.iter().filter(|l| l.start < to && l.end > from).map(|l| (l.start, l.end)).collect();
    covering.sort_unstable();
    let mut gaps = Vec::new();
    let mut at = from;
    for (s, e) in covering {
        if s > at {
            gaps.push((at, s));
        }
        at = at.max(e);
    }
    if at < to {
        gaps.push((at, to));
    }
    gaps
}

/// Whether the calling thread may lock past RLIMIT_MEMLOCK: CAP_IPC_LOCK in its effective set,
/// which is what the kernel asks (root without it is limited; a user with it is not). The
/// kernel asks for it in the initial user namespace, so inside another one (a rootless
/// container, `unshare -r`), whose capabilities capget reports, the limit holds.
fn may_lock_past_rlimit() -> bool {
    rustix::thread::capabilities(None)
        .is_ok_and(|sets| sets.effective.contains(rustix::thread::CapabilitySet::IPC_LOCK))
        && in_initial_user_namespace()
}

/// Whether this process's user namespace is the initial one: its uid map is the identity over
/// every id, as only the initial namespace's is (an unreadable map counts as another one).
fn in_initial_user_namespace() -> bool {
    std::fs::read_to_string("/proc/self/uid_map")
        .is_ok_and(|map| map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"])
}

/// RLIMIT_MEMLOCK's soft limit in bytes, unless the caller may lock past it.
fn rlimit_bytes() -> Option<usize> {
    if may_lock_past_rlimit() {
        return None;
    }
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
    limit.map(|l| usize::try_from(l).unwrap_or(usize::MAX))
}

/// Most bytes of managed memory the program may lock: a quarter of the budget, and without
/// CAP_IPC_LOCK no more than RLIMIT_MEMLOCK leaves beside the memory the kernel holds locked
/// for it (unmanaged locks, which the kernel counts against the same limit).
fn lockable_bytes(engine: &Engine) -> usize {
    let quarter = engine.limit_pages() as usize * PAGE_SIZE / 4;
    rlimit_bytes().map_or(quarter, |l| quarter.min(l.saturating_sub(kernel_locked_bytes())))
}

/// Memory the kernel has locked for this process (`VmLck`; 0 if unreadable).
///
/// Read with the system calls themselves into a buffer on the stack: this runs with the
/// registry locked, and the shim's `read` looks a buffer that may lie in managed memory up in
/// the registry (a heap buffer between two regions deadlocked the program).
fn kernel_locked_bytes() -> usize {
    use rustix::fs::{Mode, OFlags};
    let Ok(file) = rustix::fs::open("/proc/self/status", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()) else {
        return 0;
    };
    let mut buf = [0u8; 8192];
    let mut len = 0;
    while len < buf.len() {
        match rustix::io::read(&file, &mut buf[len..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => len += n,
        }
    }
    let status = String::from_utf8_lossy(&buf[..len]);
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok());
    kib.unwrap_or(0) * 1024
}

/// Lock `[start, end)`: the unmanaged pieces by `kernel(from, to)`, the managed ones by
/// pinning, after checking that all of it may be locked.
/// `reserved`: bytes [`reserve`] set aside for this call (in `pending` until now), which need
/// no check.
fn lock_range(start: usize, end: usize, kernel: impl Fn(usize, usize) -> isize, reserved: usize) -> isize {
    static SAID: AtomicBool = AtomicBool::new(false);
    let pieces = pieces(start, end);
    let Some(engine) = runtime::running_engine() else {
        locks().pending -= reserved;
        return pieces.iter().map(|&(a, b, _)| kernel(a, b)).find(|&r| r < 0).unwrap_or(0);
    };
    if rlimit_bytes() == Some(0) && reserved == 0 {
        // The kernel's answer when nothing may be locked at all: not allowed, rather than no room.
        return refuse(libc::EPERM);
    }
    // Reserve the new pages' bytes under the lock; pin outside it (reading pages in takes a
    // while, and frees and unmaps wait for this lock).
    let gaps: Vec<(usize, usize)> = {
        let mut locks = locks();
        let gaps: Vec<(usize, usize)> =
            pieces.iter().filter(|p| p.2).flat_map(|&(a, b, _)| uncovered(&locks.held, a, b)).collect();
        let adding: usize = gaps.iter().map(|&(a, b)| b - a).sum();
        locks.pending -= reserved;
        let locked = locks.counted();
        let allowed = lockable_bytes(engine);
        if adding > reserved && locked + adding > allowed {
            drop(locks);
            let mut mib = [0u8; 20];
            say_once(
                &SAID,
                &[
                    "tiermem: mlock refused (ENOMEM): locked managed memory may take at most a quarter of the budget or RLIMIT_MEMLOCK (",
                    runtime::decimal((allowed >> 20) as i64, &mut mib),
                    " MiB here)",
                ],
            );
            return refuse(libc::ENOMEM);
        }
        locks.pending += adding;
        gaps
    };
    let adding: usize = gaps.iter().map(|&(a, b)| b - a).sum();
    let mut result = pieces.iter().filter(|p| !p.2).map(|&(a, b, _)| kernel(a, b)).find(|&r| r < 0).unwrap_or(0);
    let mut pinned = Vec::new();
    if result == 0 {
        for &(a, b) in &gaps {
            match engine.prepare_kernel_access(a as *const u8, b - a, false) {
                Ok(pin) => pinned.push(Lock { start: a, end: b, _pin: pin }),
                Err(e) => {
                    runtime::say(&["tiermem: mlock of managed memory failed: ", &e.to_string()]);
                    result = refuse(libc::ENOMEM);
                    break;
                }
            }
        }
    }
    // Commit under the registry's lock (the order munmap and free take them in): a range the
    // program gave back while it was being pinned is not kept locked.
    let table = crate::registry::lock();
    let live = |&(a, b): &(usize, usize)| {
        crate::heap::chunk_bounds(a).is_some_and(|(_, chunk_end)| b <= chunk_end)
            || crate::registry::segments(&table, a, b).iter().all(|&(from, to, base)| {
                base.is_some_and(|base| {
                    let (from, to) = (from - base, to - base);
                    let entry = &table[&base];
                    !entry.meets_foreign(from, to) && !entry.unmapped.iter().any(|&(x, y)| x < to && y > from)
                })
            })
    };
    pinned.retain(|l| live(&(l.start, l.end)));
    let mut locks = locks();
    locks.pending -= adding;
    if result == 0 {
        locks.held.extend(pinned);
    }
    result
}

/// Unlock `[from, to)` of managed memory: locks overlapping it are dropped and their parts
/// outside it pinned again.
fn unlock_managed(from: usize, to: usize) {
    let Some(engine) = runtime::running_engine() else { return };
    let mut locks = locks();
    let (hit, kept): (Vec<Lock>, Vec<Lock>) = locks.held.drain(..).partition(|l| l.start < to && l.end > from);
    locks.held = kept;
    for lock in hit {
        for (a, b) in [(lock.start, from.max(lock.start)), (to.min(lock.end), lock.end)] {
            if a < b {
                // Resident already (pinned until now): pinning again reads nothing.
                match engine.prepare_kernel_access(a as *const u8, b - a, false) {
                    Ok(pin) => locks.held.push(Lock { start: a, end: b, _pin: pin }),
                    Err(e) => runtime::say(&["tiermem: keeping part of a locked range locked: ", &e.to_string()]),
                }
            }
        }
    }
}

/// Whether any page of `[from, to)` is locked managed memory.
pub(crate) fn any_locked(from: usize, to: usize) -> bool {
    !runtime::in_forked_child() && locks().held.iter().any(|l| l.start < to && l.end > from)
}

/// The locked parts of `[from, to)`, as (start, end), in order; locks that meet are one part
/// (a range locked in two calls is locked as a whole, as the kernel merges the two VMAs).
pub(crate) fn locked_parts(from: usize, to: usize) -> Vec<(usize, usize)> {
    if runtime::in_forked_child() {
        return Vec::new();
    }
    let mut parts: Vec<(usize, usize)> =
        locks().held.iter().map(|l| (l.start.max(from), l.end.min(to))).filter(|&(a, b)| a < b).collect();
    parts.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(parts.len());
    for (a, b) in parts {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    merged
}

/// Lock quota set aside by [`reserve`] for locks an mremap makes at the new place, from its
/// check to its relock, so no other thread's mlock takes the room in between (the kernel checks
/// and accounts in one step). What is not used goes back when it is dropped.
pub(crate) struct Reservation {
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            locks().pending -= self.bytes;
        }
    }
}

/// Set aside `needed` bytes of the lock quota for a move or growth that gives up `freed` locked
/// bytes: None (EAGAIN for mremap, which checks before moving) if they do not fit.
pub(crate) fn reserve(freed: usize, needed: usize) -> Option<Reservation> {
    let Some(engine) = runtime::running_engine() else { return Some(Reservation { bytes: 0 }) };
    if runtime::in_forked_child() || needed == 0 {
        return Some(Reservation { bytes: 0 });
    }
    let mut locks = locks();
    let locked = locks.counted();
    if needed > freed && locked - freed.min(locked) + needed > lockable_bytes(engine) {
        return None;
    }
    locks.pending += needed;
    Some(Reservation { bytes: needed })
}

/// Lock `[start, end)` of managed memory again, out of `reservation`: a mapping mremap moved
/// or grew keeps its locks, as the kernel's does, without the quota being checked again.
pub(crate) fn relock(start: usize, end: usize, reservation: &mut Reservation) {
    let take = reservation.bytes.min(end - start);
    reservation.bytes -= take;
    let _ = lock_range(start, end, |_, _| 0, take);
}

/// Memory leaving the program (unmapped, freed, shrunk away): its locks go with it, as the
/// kernel's do.
pub(crate) fn forget(from: usize, to: usize) {
    if any_locked(from, to) {
        unlock_managed(from, to);
    }
}

/// Whether `[start, end)` may hold managed memory (false is certain).
fn may_be_managed(start: usize, end: usize) -> bool {
    crate::registry::may_overlap(start, end - start)
        || crate::heap::contains(start)
        || crate::heap::first_chunk_start_in(start, end).is_some()
}

fn lock_call(addr: usize, len: usize, kernel: impl Fn(usize, usize) -> isize) -> isize {
    let (start, end) = page_span(addr, len);
    let managed_somewhere = may_be_managed(start, end);
    if runtime::in_forked_child() || !managed_somewhere {
        return kernel(addr, addr.saturating_add(len));
    }
    lock_range(start, end, kernel, 0)
}

fn unlock_call(addr: usize, len: usize) -> isize {
    let (start, end) = page_span(addr, len);
    let managed_somewhere = may_be_managed(start, end);
    if runtime::in_forked_child() || !managed_somewhere {
        return sys!(libc::SYS_munlock, addr, len);
    }
    for (a, b, managed) in pieces(start, end) {
        if managed {
            unlock_managed(a, b);
        } else {
            let r = sys!(libc::SYS_munlock, a, b - a);
            if r < 0 {
                return r;
            }
        }
    }
    0
}

fn mlock2_call(addr: usize, len: usize, flags: u32) -> isize {
    if flags & !libc::MLOCK_ONFAULT != 0 {
        return refuse(libc::EINVAL);
    }
    // MLOCK_ONFAULT over managed memory locks at once: a stronger promise than asked.
    lock_call(addr, len, |a, b| sys!(libc::SYS_mlock2, a, b - a, flags))
}

/// # Safety
/// The C contract of mlock.
#[no_mangle]
pub unsafe extern "C" fn mlock(addr: *const libc::c_void, len: usize) -> i32 {
    lock_call(addr as usize, len, |a, b| sys!(libc::SYS_mlock, a, b - a)) as i32
}

/// # Safety
/// The C contract of mlock2.
#[no_mangle]
pub unsafe extern "C" fn mlock2(addr: *const libc::c_void, len: usize, flags: u32) -> i32 {
    mlock2_call(addr as usize, len, flags) as i32
}

/// # Safety
/// The C contract of munlock.
#[no_mangle]
pub unsafe extern "C" fn munlock(addr: *const libc::c_void, len: usize) -> i32 {
    unlock_call(addr as usize, len) as i32
}

/// # Safety
/// The C contract of mlockall.
#[no_mangle]
pub unsafe extern "C" fn mlockall(flags: i32) -> i32 {
    mlockall_call(flags) as i32
}

fn mlockall_call(flags: i32) -> isize {
    static SAID: AtomicBool = AtomicBool::new(false);
    let managing = runtime::running_engine().is_some();
    if runtime::in_forked_child() || (!managing && flags & libc::MCL_FUTURE == 0) {
        return sys!(libc::SYS_mlockall, flags);
    }
    let known = libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT;
    if flags == 0 || flags & !known != 0 || flags == libc::MCL_ONFAULT {
        return refuse(libc::EINVAL);
    }
    if rlimit_bytes() == Some(0) {
        // The kernel's answer when nothing may be locked, after checking the flags.
        return refuse(libc::EPERM);
    }
    say_once(
        &SAID,
        &["tiermem: mlockall refused (ENOMEM): tiermem pages this program's memory; lock ranges with mlock (up to a quarter of the budget), or run the program without tiermem"],
    );
    refuse(libc::ENOMEM)
}

/// # Safety
/// The C contract of munlockall.
#[no_mangle]
pub unsafe extern "C" fn munlockall() -> i32 {
    munlockall_call() as i32
}

fn munlockall_call() -> isize {
    if !runtime::in_forked_child() {
        locks().held.clear();
    }
    sys!(libc::SYS_munlockall)
}

/// The lock family's results for their call numbers through `syscall()`, or None.
pub(crate) fn by_number(number: libc::c_long, a: libc::c_long, b: libc::c_long, c: libc::c_long) -> Option<isize> {
    let (addr, len) = (a as usize, b as usize);
    Some(match number {
        libc::SYS_mlock => lock_call(addr, len, |x, y| sys!(libc::SYS_mlock, x, y - x)),
        libc::SYS_mlock2 => mlock2_call(addr, len, c as u32),
        libc::SYS_munlock => unlock_call(addr, len),
        libc::SYS_mlockall => mlockall_call(a as i32),
        libc::SYS_munlockall => munlockall_call(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn page_spans_cover_every_byte() {
        assert_eq!(super::page_span(4096, 1), (4096, 8192));
        assert_eq!(super::page_span(4097, 4096), (4096, 12288));
        assert_eq!(super::page_span(8192, 0), (8192, 8192));
    }
}
