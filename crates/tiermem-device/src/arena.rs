//! A page-aligned arena of 4 KiB I/O buffers with a lock-free free list.
//!
//! All page data moving to or from a device passes through here, so a file device can register
//! the whole arena once as an io_uring fixed buffer. Allocation and release are wait-free enough
//! to be called from a signal handler (no locks, no heap).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tiermem_sys::mem::Mapping;
use tiermem_sys::{Error, Result, PAGE_SIZE};

/// Index of one 4 KiB buffer in a [`BufferArena`].
pub type BufId = u32;

const NIL: u32 = u32::MAX;

/// A fixed set of page-aligned 4 KiB buffers.
#[derive(Debug)]
pub struct BufferArena {
    mapping: Mapping,
    pages: u32,
    /// Free-list head: low 32 bits = buffer index (or NIL), high 32 bits = ABA tag.
    head: AtomicU64,
    next: Box<[AtomicU32]>,
    free: AtomicU32,
}

impl BufferArena {
    /// An arena of `pages` buffers, populated up front so using a buffer never faults.
    pub fn new(pages: u32) -> Result<Self> {
        if pages == 0 || pages == NIL {
            return Err(Error::invalid(format!("buffer arena size {pages} pages is out of range")));
        }
        let mapping = Mapping::anonymous(pages as usize * PAGE_SIZE, true)?;
        let next: Box<[AtomicU32]> =
            (0..pages).map(|i| AtomicU32::new(if i + 1 < pages { i + 1 } else { NIL })).collect();
        Ok(Self { mapping, pages, head: AtomicU64::new(0), next, free: AtomicU32::new(pages) })
    }

    /// How many buffers the arena has.
    pub fn pages(&self) -> u32 {
        self.pages
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
        assert!(buf < self.pages, "buffer {buf} is not in this arena");
        // SAFETY: buf < pages, so the offset stays inside the mapping.
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
