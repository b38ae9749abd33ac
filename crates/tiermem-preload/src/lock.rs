//! The mlock family over managed memory. Passed to the kernel, a lock on managed memory made
//! the kernel fault every page in through the engine, which then could not evict any of them
//! (MADV_DONTNEED refuses locked pages): past the budget the program hung. Here:
//!
//! - `mlock`/`mlock2` pin the managed part in the engine: its pages are brought in and never
//!   evicted until `munlock`, `munlockall`, or the memory is unmapped or freed. Locked managed
//!   memory may take up to half the budget; a lock past that fails with ENOMEM, as a lock past
//!   RLIMIT_MEMLOCK does. The unmanaged part goes to the kernel.
//! - `mlockall` fails with ENOMEM (and a message) once memory is managed, or when it asks for
//!   MCL_FUTURE (future managed allocations could not be paged): locking all of a program's
//!   memory is the opposite of paging it. Before then, MCL_CURRENT alone goes to the kernel.
//!
//! In a forked child, whose memory is a plain copy, every call goes to the kernel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use tiermem_engine::PinGuard;
use tiermem_sys::PAGE_SIZE;

use crate::io::{stretch, sys};
use crate::runtime;

/// A locked, page-aligned stretch of one managed region.
struct Lock {
    start: usize,
    end: usize,
    _pin: PinGuard,
}

/// Locked stretches, disjoint.
static LOCKS: Mutex<Vec<Lock>> = Mutex::new(Vec::new());

fn locks() -> std::sync::MutexGuard<'static, Vec<Lock>> {
    LOCKS.lock().unwrap_or_else(|e| e.into_inner())
}

fn page_span(addr: usize, len: usize) -> (usize, usize) {
    let start = addr & !(PAGE_SIZE - 1);
    (start, addr.saturating_add(len).next_multiple_of(PAGE_SIZE))
}

/// Call `managed(from, to)` or `unmanaged(from, to)` for each stretch of `[start, end)`; stops
/// at the first failure (-1, errno set).
fn by_stretch(
    start: usize,
    end: usize,
    mut managed: impl FnMut(usize, usize) -> isize,
    mut unmanaged: impl FnMut(usize, usize) -> isize,
) -> isize {
    let mut at = start;
    while at < end {
        let (len, is_managed) = stretch(at, end - at);
        let len = len.max(PAGE_SIZE).min(end - at);
        let r = if is_managed { managed(at, at + len) } else { unmanaged(at, at + len) };
        if r < 0 {
            return r;
        }
        at += len;
    }
    0
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

/// Pin the pages of `[from, to)` (inside one managed region) not locked yet.
fn lock_managed(from: usize, to: usize) -> isize {
    static SAID: AtomicBool = AtomicBool::new(false);
    let Some(engine) = runtime::running_engine() else { return refuse(libc::ENOMEM) };
    let mut locks = locks();
    let gaps = uncovered(&locks, from, to);
    let locked: usize = locks.iter().map(|l| l.end - l.start).sum();
    let adding: usize = gaps.iter().map(|&(a, b)| b - a).sum();
    let allowed = engine.limit_pages() as usize * PAGE_SIZE / 2;
    if locked + adding > allowed {
        say_once(
            &SAID,
            &[
                "tiermem: mlock refused (ENOMEM): locked managed memory may take at most half the budget (",
                &(allowed >> 20).to_string(),
                " MiB)",
            ],
        );
        return refuse(libc::ENOMEM);
    }
    for (a, b) in gaps {
        match engine.prepare_kernel_access(a as *const u8, b - a, false) {
            Ok(pin) => locks.push(Lock { start: a, end: b, _pin: pin }),
            Err(e) => {
                runtime::say(&["tiermem: mlock of managed memory failed: ", &e.to_string()]);
                return refuse(libc::ENOMEM);
            }
        }
    }
    0
}

/// The parts of `[from, to)` no lock covers.
fn uncovered(locks: &[Lock], from: usize, to: usize) -> Vec<(usize, usize)> {
    let mut covering: Vec<(usize, usize)> =
        locks.iter().filter(|l| l.start < to && l.end > from).map(|l| (l.start, l.end)).collect();
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

/// Unlock `[from, to)`: locks overlapping it are dropped and their parts outside it pinned again.
fn unlock_managed(from: usize, to: usize) {
    let Some(engine) = runtime::running_engine() else { return };
    let mut locks = locks();
    let (hit, kept): (Vec<Lock>, Vec<Lock>) = locks.drain(..).partition(|l| l.start < to && l.end > from);
    *locks = kept;
    for lock in hit {
        for (a, b) in [(lock.start, from.max(lock.start)), (to.min(lock.end), lock.end)] {
            if a < b {
                // Resident already (pinned until now): pinning again reads nothing.
                if let Ok(pin) = engine.prepare_kernel_access(a as *const u8, b - a, false) {
                    locks.push(Lock { start: a, end: b, _pin: pin });
                }
            }
        }
    }
}

/// Memory leaving the program (unmapped, freed): its locks go with it, as the kernel's do.
pub(crate) fn forget(from: usize, to: usize) {
    if runtime::in_forked_child() {
        return;
    }
    let locks = locks();
    if locks.iter().any(|l| l.start < to && l.end > from) {
        drop(locks);
        unlock_managed(from, to);
    }
}

fn lock_call(addr: usize, len: usize, kernel: impl Fn(usize, usize) -> isize) -> isize {
    let (start, end) = page_span(addr, len);
    if runtime::in_forked_child() || !crate::registry::may_overlap(start, end - start) {
        return kernel(addr, len);
    }
    by_stretch(start, end, lock_managed, |a, b| kernel(a, b - a))
}

fn unlock_call(addr: usize, len: usize) -> isize {
    let (start, end) = page_span(addr, len);
    if runtime::in_forked_child() || !crate::registry::may_overlap(start, end - start) {
        return sys!(libc::SYS_munlock, addr, len);
    }
    by_stretch(
        start,
        end,
        |a, b| {
            unlock_managed(a, b);
            0
        },
        |a, b| sys!(libc::SYS_munlock, a, b - a),
    )
}

/// # Safety
/// The C contract of mlock.
#[no_mangle]
pub unsafe extern "C" fn mlock(addr: *const libc::c_void, len: usize) -> i32 {
    lock_call(addr as usize, len, |a, n| sys!(libc::SYS_mlock, a, n)) as i32
}

/// # Safety
/// The C contract of mlock2. MLOCK_ONFAULT over managed memory locks at once (a stronger
/// promise than asked).
#[no_mangle]
pub unsafe extern "C" fn mlock2(addr: *const libc::c_void, len: usize, flags: u32) -> i32 {
    lock_call(addr as usize, len, |a, n| sys!(libc::SYS_mlock2, a, n, flags)) as i32
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

pub(crate) fn mlockall_call(flags: i32) -> isize {
    static SAID: AtomicBool = AtomicBool::new(false);
    let managing = runtime::running_engine().is_some();
    if runtime::in_forked_child() || (!managing && flags & libc::MCL_FUTURE == 0) {
        return sys!(libc::SYS_mlockall, flags);
    }
    say_once(
        &SAID,
        &["tiermem: mlockall refused (ENOMEM): tiermem pages this program's memory; lock ranges with mlock (up to half the budget), or run the program without tiermem"],
    );
    refuse(libc::ENOMEM)
}

/// # Safety
/// The C contract of munlockall.
#[no_mangle]
pub unsafe extern "C" fn munlockall() -> i32 {
    munlockall_call() as i32
}

pub(crate) fn munlockall_call() -> isize {
    if !runtime::in_forked_child() {
        locks().clear();
    }
    sys!(libc::SYS_munlockall)
}

/// The lock family's results for their call numbers through `syscall()`, or None.
pub(crate) fn by_number(number: libc::c_long, a: libc::c_long, b: libc::c_long, c: libc::c_long) -> Option<isize> {
    let (addr, len) = (a as usize, b as usize);
    Some(match number {
        libc::SYS_mlock => lock_call(addr, len, |x, n| sys!(libc::SYS_mlock, x, n)),
        libc::SYS_mlock2 => lock_call(addr, len, |x, n| sys!(libc::SYS_mlock2, x, n, c)),
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
