//! Descriptors tiermem must keep open inside a program: the userfaultfd, the device file, the
//! io_uring rings, the pagemap file and the event descriptors its threads sleep on. Daemons,
//! sandboxes and shells close every descriptor they did not open (`close_range(3, ~0)`,
//! `closefrom`, a close loop up to the limit) or `dup2` onto a number of their choice. Were one
//! of these among them, faults would go unserved and written pages be lost, so:
//!
//! - each is moved above [`FLOOR`], far from the small numbers programs pick, and
//! - registered here while it is open; the preload's close, close_range, closefrom, dup2 and
//!   dup3 consult [`is_guarded`] and leave registered descriptors alone.
//!
//! Registration is a fixed table of atomics: the preload's wrappers may run anywhere (inside
//! malloc, in a signal handler), so looking up must not allocate or lock.

use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

/// Lowest number a guarded descriptor is moved to (where the soft RLIMIT_NOFILE allows).
pub const FLOOR: RawFd = 512;

/// Most descriptors registered at once; a process running one engine holds about 25. Past
/// this, descriptors stay usable but unguarded.
const SLOTS: usize = 256;
const EMPTY: RawFd = -1;

static GUARDED: [AtomicI32; SLOTS] = [const { AtomicI32::new(EMPTY) }; SLOTS];
/// One past the highest slot ever used: lookups scan no further.
static USED_SLOTS: AtomicUsize = AtomicUsize::new(0);

/// Whether `fd` is one of tiermem's own open descriptors.
pub fn is_guarded(fd: RawFd) -> bool {
    fd >= 0 && GUARDED[..USED_SLOTS.load(Ordering::Acquire)].iter().any(|slot| slot.load(Ordering::Acquire) == fd)
}

/// The guarded descriptors in `first..=last`, ascending, in `out`; returns how many. More than
/// `out` holds are not reported (callers size it for the whole table).
pub fn guarded_in(first: u32, last: u32, out: &mut [RawFd; SLOTS]) -> usize {
    let mut n = 0;
    for slot in &GUARDED[..USED_SLOTS.load(Ordering::Acquire)] {
        let fd = slot.load(Ordering::Acquire);
        if fd >= 0 && (first..=last).contains(&(fd as u32)) && !out[..n].contains(&fd) {
            out[n] = fd;
            n += 1;
        }
    }
    out[..n].sort_unstable();
    n
}

/// The stretches of `first..=last` without a guarded descriptor (what a close_range of that
/// span may close), in ascending order.
pub fn unguarded_spans(first: u32, last: u32) -> impl Iterator<Item = (u32, u32)> {
    let mut fds = [EMPTY; SLOTS];
    let n = guarded_in(first, last, &mut fds);
    spans_between(first, last, fds, n)
}

fn spans_between(first: u32, last: u32, fds: [RawFd; SLOTS], n: usize) -> impl Iterator<Item = (u32, u32)> {
    let mut next = Some(first);
    let mut i = 0;
    std::iter::from_fn(move || loop {
        let start = next?;
        if start > last {
            return None;
        }
        if i == n {
            next = None;
            return Some((start, last));
        }
        let fd = fds[i] as u32;
        i += 1;
        next = fd.checked_add(1);
        if fd > start {
            return Some((start, fd - 1));
        }
    })
}

/// Registration of one descriptor number, undone when dropped. Drop it before the descriptor
/// is closed (declare it before the field that owns the descriptor).
#[derive(Debug)]
pub struct Guard {
    slot: Option<usize>,
}

impl Guard {
    /// Register `fd`. With the table full the descriptor is left unguarded.
    pub fn new(fd: RawFd) -> Self {
        for (i, slot) in GUARDED.iter().enumerate() {
            if slot.compare_exchange(EMPTY, fd, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                USED_SLOTS.fetch_max(i + 1, Ordering::AcqRel);
                return Self { slot: Some(i) };
            }
        }
        Self { slot: None }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            GUARDED[i].store(EMPTY, Ordering::Release);
        }
    }
}

/// In a forked child: close `fd`, a guarded descriptor the child inherited but must not keep
/// (its owner lives on in the parent), and take it out of the table, so that the number, once
/// the program reuses it, is the program's to close. The child's copy of its [`Guard`] must
/// never be dropped (its slot may hold another descriptor by then).
pub fn close_inherited(fd: RawFd) {
    if fd < 0 {
        return;
    }
    for slot in &GUARDED[..USED_SLOTS.load(Ordering::Acquire)] {
        let _ = slot.compare_exchange(fd, EMPTY, Ordering::AcqRel, Ordering::Acquire);
    }
    // SAFETY: `fd` is open in this process (inherited) and nothing in it uses the number any
    // more: its owner's copy here is never used or dropped (the caller's promise). The raw
    // system call, not libc's close, which the preload would refuse for a guarded number.
    unsafe { rustix::io::close(fd) };
}

/// `fd` moved to a close-on-exec descriptor at or above [`FLOOR`]; `fd` itself where that
/// fails (the soft RLIMIT_NOFILE is lower, or descriptors are exhausted).
pub fn lift(fd: OwnedFd) -> OwnedFd {
    if fd.as_raw_fd() >= FLOOR {
        return fd;
    }
    rustix::io::fcntl_dupfd_cloexec(&fd, FLOOR).unwrap_or(fd)
}

/// A descriptor-owning value (a `File`, an `OwnedFd`) lifted and guarded for as long as it lives.
#[derive(Debug)]
pub struct Guarded<T> {
    // Declared first: unregistered before `inner` closes the descriptor.
    _guard: Guard,
    inner: T,
}

impl<T: AsFd + From<OwnedFd> + Into<OwnedFd>> Guarded<T> {
    /// Move `inner`'s descriptor above [`FLOOR`] and register it.
    pub fn new(inner: T) -> Self {
        let fd = lift(inner.into());
        Self { _guard: Guard::new(fd.as_raw_fd()), inner: T::from(fd) }
    }
}

impl<T> Deref for Guarded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.inner
    }
}

impl<T: AsFd> AsFd for Guarded<T> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

impl<T: AsRawFd> AsRawFd for Guarded<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

impl<T: std::io::Write> std::io::Write for Guarded<T> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spans(first: u32, last: u32, guarded: &[RawFd]) -> Vec<(u32, u32)> {
        let mut fds = [EMPTY; SLOTS];
        let mut sorted = guarded.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        sorted.retain(|&fd| (first..=last).contains(&(fd as u32)));
        fds[..sorted.len()].copy_from_slice(&sorted);
        spans_between(first, last, fds, sorted.len()).collect()
    }

    #[test]
    fn spans_skip_guarded_descriptors() {
        assert_eq!(spans(3, u32::MAX, &[]), vec![(3, u32::MAX)]);
        assert_eq!(spans(3, u32::MAX, &[3]), vec![(4, u32::MAX)]);
        assert_eq!(spans(3, 10, &[5, 6, 9]), vec![(3, 4), (7, 8), (10, 10)]);
        assert_eq!(spans(3, 10, &[10]), vec![(3, 9)]);
        assert_eq!(spans(5, 5, &[5]), vec![]);
        assert_eq!(spans(0, u32::MAX, &[i32::MAX]), vec![(0, i32::MAX as u32 - 1), (i32::MAX as u32 + 1, u32::MAX)]);
    }

    proptest! {
        /// The spans cover exactly the unguarded numbers of the range: compared number by number
        /// over a small range.
        #[test]
        fn spans_cover_exactly_the_unguarded(first in 0u32..40, len in 0u32..40, guarded in proptest::collection::vec(0i32..90, 0..12)) {
            let last = first + len;
            let covered: Vec<u32> = spans(first, last, &guarded).into_iter().flat_map(|(a, b)| a..=b).collect();
            let expected: Vec<u32> = (first..=last).filter(|&fd| !guarded.contains(&(fd as i32))).collect();
            prop_assert_eq!(covered, expected);
        }
    }

    #[test]
    fn a_guarded_descriptor_is_lifted_registered_and_released_when_dropped() {
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        let low = fd.as_raw_fd();
        let guarded = Guarded::new(fd);
        let high = guarded.as_raw_fd();
        assert!(high >= FLOOR, "moved to {high}");
        assert!(is_guarded(high));
        assert!(!is_guarded(low), "the original number was closed and is not guarded");
        let mut found = [EMPTY; SLOTS];
        let n = guarded_in(high as u32, high as u32, &mut found);
        assert_eq!(&found[..n], &[high]);
        assert!(unguarded_spans(high as u32, high as u32).next().is_none());
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(high, libc::F_GETFD) };
        assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0);
        drop(guarded);
        assert!(!is_guarded(high));
    }

    #[test]
    fn an_inherited_descriptor_is_closed_and_released_in_a_forked_child_only() {
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        let guarded = Guarded::new(fd);
        let high = guarded.as_raw_fd();
        // In a child, as after a fork under the preload: one thread, so no other test can take
        // the number meanwhile. It only uses atomics and system calls before _exit.
        // SAFETY: the child calls nothing that could wait for a lock another thread held.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            close_inherited(high);
            // SAFETY: F_GETFD only reads the descriptor's flags; it fails on a closed number.
            let closed = unsafe { libc::fcntl(high, libc::F_GETFD) } == -1;
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if closed && !is_guarded(high) { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child still had it: {status:#x}");
        assert!(is_guarded(high), "the parent's copy is untouched");
        // SAFETY: F_GETFD only reads the descriptor's flags.
        assert!(unsafe { libc::fcntl(high, libc::F_GETFD) } >= 0, "and open");
    }
}
