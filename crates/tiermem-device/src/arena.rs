//! A page-aligned arena of 4 KiB I/O buffers with a lock-free free list, and optionally a few
//! runs of [`RUN_PAGES`] contiguous buffers for multi-page requests.
//!
//! All page data moving to or from a device passes through here, so a file device can register
//! the whole arena once as an io_uring fixed buffer. Allocation and release are wait-free enough
//! to be called from a signal handler (no locks, no heap).
//!
//! A run is taken whole and given back page by page: each of its buffers is released like a
//! single one, and the run is free again once all the buffers it was taken for are.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tiermem_sys::mem::Mapping;
use tiermem_sys::{Error, Result, PAGE_SIZE};

/// Index of one 4 KiB buffer in a [`BufferArena`].
pub type BufId = u32;

const NIL: u32 = u32::MAX;

/// Buffers in one run (a 128 KiB request at most).
pub const RUN_PAGES: u32 = 32;
/// Runs an arena can have.
pub const MAX_RUNS: u32 = 64;

/// A fixed set of page-aligned 4 KiB buffers.
#[derive(Debug)]
pub struct BufferArena {
    mapping: Mapping,
    pages: u32,
    /// Free-list head: low 32 bits = buffer index (or NIL), high 32 bits = ABA tag.
    head: AtomicU64,
    next: Box<[AtomicU32]>,
    free: AtomicU32,
    /// First buffer id of the run area (run `r` starts at `run_base + r * RUN_PAGES`).
    run_base: u32,
    runs: u32,
    /// Bit `r` set: run `r` is free.
    runs_free: AtomicU64,
    /// Buffers of each taken run not released yet.
    run_left: Box<[AtomicU32]>,
}

impl BufferArena {
    /// An arena of `pages` buffers, populated up front so using a buffer never faults.
    pub fn new(pages: u32) -> Result<Self> {
        Self::with_runs(pages, 0)
    }

    /// An arena of `pages` single buffers and `runs` runs of [`RUN_PAGES`] (at most
    /// [`MAX_RUNS`]). Runs are aligned to their size, so one never straddles a 1 GiB boundary
    /// of the arena (where a file device splits its fixed buffers).
    pub fn with_runs(pages: u32, runs: u32) -> Result<Self> {
        if pages == 0 || pages >= NIL / 2 || runs > MAX_RUNS {
            return Err(Error::invalid(format!("buffer arena of {pages} pages and {runs} runs is out of range")));
        }
        let run_base = if runs == 0 { pages } else { pages.next_multiple_of(RUN_PAGES) };
        let end = run_base + runs * RUN_PAGES;
        let mapping = Mapping::anonymous(end as usize * PAGE_SIZE, true)?;
        let next: Box<[AtomicU32]> =
            (0..pages).map(|i| AtomicU32::new(if i + 1 < pages { i + 1 } else { NIL })).collect();
        let all_runs = if runs == 64 { !0 } else { (1u64 << runs) - 1 };
        Ok(Self {
            mapping,
            pages,
            head: AtomicU64::new(0),
            next,
            free: AtomicU32::new(pages),
            run_base,
            runs,
            runs_free: AtomicU64::new(all_runs),
            run_left: (0..runs).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    /// How many single buffers the arena has.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// One past the highest buffer id (single buffers and runs).
    pub fn end(&self) -> u32 {
        self.run_base + self.runs * RUN_PAGES
    }

    /// Whether `buf` belongs to a run (not a single buffer).
    pub fn in_run(&self, buf: BufId) -> bool {
        buf >= self.run_base && buf < self.end()
    }

    /// Which run buffer `buf` belongs to. Panics on a single buffer.
    pub fn run_index(&self, buf: BufId) -> u32 {
        assert!(buf >= self.run_base && buf < self.end(), "buffer {buf} is not in a run");
        (buf - self.run_base) / RUN_PAGES
    }

    /// Take a run for `n` buffers (1..=[`RUN_PAGES`]): ids `first..first + n`, contiguous in
    /// memory. `None` when all runs are in use (or the arena has none).
    pub fn alloc_run(&self, n: u32) -> Option<BufId> {
        assert!((1..=RUN_PAGES).contains(&n), "a run of {n} buffers");
        let mut free = self.runs_free.load(Ordering::Acquire);
        loop {
            if free == 0 {
                return None;
            }
            let r = free.trailing_zeros();
            match self.runs_free.compare_exchange_weak(free, free & !(1 << r), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.run_left[r as usize].store(n, Ordering::Release);
                    return Some(self.run_base + r * RUN_PAGES);
                }
                Err(actual) => free = actual,
            }
        }
    }

    /// How many buffers are free now.
    pub fn free_count(&self) -> u32 {
        self.free.load(Ordering::Relaxed)
    }

    /// Base address and length in bytes, for registering with the kernel.
    pub fn as_raw_parts(&self) -> (NonNull<u8>, usize) {
        (self.mapping.as_non_null(), self.mapping.len())
    }

    /// Take a free buffer, or `None` when all are in use.
    pub fn alloc(&self) -> Option<BufId> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let idx = head as u32;
            if idx == NIL {
                return None;
            }
            let next = self.next[idx as usize].load(Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | u64::from(next);
            match self.head.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.free.fetch_sub(1, Ordering::Relaxed);
                    return Some(idx);
                }
                Err(actual) => head = actual,
            }
        }
    }

    /// Give a buffer back. Releasing a buffer twice corrupts the list; callers own buffers
    /// exclusively between `alloc` and `release`.
    pub fn release(&self, buf: BufId) {
        if buf >= self.run_base {
            assert!(buf < self.end(), "buffer {buf} is not in this arena");
            let r = (buf - self.run_base) / RUN_PAGES;
            let before = self.run_left[r as usize].fetch_sub(1, Ordering::AcqRel);
            assert!(before > 0, "buffer {buf} of run {r} released more often than taken");
            if before == 1 {
                self.runs_free.fetch_or(1 << r, Ordering::AcqRel);
            }
            return;
        }
        assert!(buf < self.pages, "buffer {buf} is not in this arena");
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            self.next[buf as usize].store(head as u32, Ordering::Relaxed);
            let new = ((head >> 32).wrapping_add(1) << 32) | u64::from(buf);
            match self.head.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.free.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(actual) => head = actual,
            }
        }
    }

    /// Address of buffer `buf`.
    pub fn ptr(&self, buf: BufId) -> *mut u8 {
        assert!(buf < self.end(), "buffer {buf} is not in this arena");
        // SAFETY: buf < end, so the offset stays inside the mapping.
        unsafe { self.mapping.as_ptr().add(buf as usize * PAGE_SIZE) }
    }

    /// Byte offset of buffer `buf` from the arena's base.
    pub fn offset(&self, buf: BufId) -> usize {
        buf as usize * PAGE_SIZE
    }

    /// The contents of buffer `buf`. The caller must own the buffer (no I/O into it in flight).
    pub fn bytes(&self, buf: BufId) -> &[u8] {
        // SAFETY: the buffer is PAGE_SIZE bytes inside a live mapping; the caller owns it, so no
        // device is writing it while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.ptr(buf), PAGE_SIZE) }
    }

    /// The contents of buffer `buf`, writable. The caller must own the buffer.
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, buf: BufId) -> &mut [u8] {
        // SAFETY: as in `bytes`; exclusive ownership of `buf` by the caller makes this the only
        // reference to these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(buf), PAGE_SIZE) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_run_is_contiguous_and_free_again_once_all_its_buffers_are_released() {
        let arena = BufferArena::with_runs(5, 2).unwrap();
        assert_eq!(arena.end(), 32 + 64);
        let a = arena.alloc_run(3).unwrap();
        let b = arena.alloc_run(32).unwrap();
        assert_eq!(arena.alloc_run(1), None, "both runs taken");
        assert_ne!(a, b);
        for k in 1..3 {
            assert_eq!(arena.ptr(a + k) as usize - arena.ptr(a) as usize, k as usize * PAGE_SIZE);
        }
        arena.release(a + 2);
        arena.release(a);
        assert_eq!(arena.alloc_run(1), None, "run a still has a buffer out");
        arena.release(a + 1);
        assert_eq!(arena.alloc_run(4), Some(a));
        // Single buffers are untouched by runs.
        assert_eq!(std::iter::from_fn(|| arena.alloc()).count(), 5);
    }

    #[test]
    fn every_buffer_is_handed_out_once_until_released() {
        let arena = BufferArena::new(64).unwrap();
        let taken: Vec<_> = std::iter::from_fn(|| arena.alloc()).collect();
        assert_eq!(taken.len(), 64);
        assert_eq!(taken.iter().collect::<HashSet<_>>().len(), 64);
        assert_eq!(arena.free_count(), 0);
        arena.release(taken[10]);
        assert_eq!(arena.alloc(), Some(taken[10]));
        assert_eq!(arena.alloc(), None);
    }

    #[test]
    fn concurrent_alloc_release_never_hands_one_buffer_to_two_owners() {
        let arena = std::sync::Arc::new(BufferArena::new(8).unwrap());
        let owners: std::sync::Arc<Vec<AtomicU32>> = std::sync::Arc::new((0..8).map(|_| AtomicU32::new(0)).collect());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (arena, owners) = (arena.clone(), owners.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(b) = arena.alloc() {
                            assert_eq!(owners[b as usize].fetch_add(1, Ordering::SeqCst), 0);
                            owners[b as usize].fetch_sub(1, Ordering::SeqCst);
                            arena.release(b);
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(arena.free_count(), 8);
    }
}
