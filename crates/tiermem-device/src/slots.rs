//! Allocation of device slots for evicted pages.
//!
//! A bitmap of 64-bit words, searched from the lowest word that may have a free slot, so slots
//! are reused lowest first: a device then touches no more of its capacity than the pages it
//! held at the peak (a rotating search walked the whole capacity, which for the `mem` device,
//! twice the footprint, made it hold that much memory). Slots are taken on the reclaim path and
//! given back when a page is freed, so contention is low; a lock-free bitmap keeps the fault path
//! free of locks anyway.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::Slot;

/// Hands out slot numbers `0..capacity`.
#[derive(Debug)]
pub struct SlotAllocator {
    words: Box<[AtomicU64]>,
    capacity: u64,
    /// No word below this one has a free slot (lowered by `free`, raised by `alloc`).
    lowest: AtomicUsize,
    used: AtomicU64,
}

impl SlotAllocator {
    /// An allocator for `capacity` slots, all free.
    pub fn new(capacity: u64) -> Self {
        let nwords = capacity.div_ceil(64) as usize;
        // Zeroed memory the kernel maps on first touch: the bitmap of a large device (a 24 GiB
        // file is 771 KiB of words) costs only the words the lowest-first search reaches,
        // instead of all of them being written here and charged to the program's cgroup.
        let words: Box<[u64]> = vec![0u64; nwords].into_boxed_slice();
        // SAFETY: AtomicU64 has the same size, alignment and bit validity as u64 (documented),
        // so a boxed slice of one is a boxed slice of the other; the box is moved, not copied.
        let words: Box<[AtomicU64]> = unsafe { Box::from_raw(Box::into_raw(words) as *mut [AtomicU64]) };
        // Bits past the capacity start out "used" so they are never handed out.
        if let Some(last) = words.last() {
            let valid = capacity - (nwords as u64 - 1) * 64;
            if valid < 64 {
                last.store(!0u64 << valid, Ordering::Relaxed);
            }
        }
        Self { words, capacity, lowest: AtomicUsize::new(0), used: AtomicU64::new(0) }
    }

    /// Total number of slots.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Slots in use.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Take a free slot, or `None` when the device is full.
    pub fn alloc(&self) -> Option<Slot> {
        let n = self.words.len();
        if n == 0 {
            return None;
        }
        let start = self.lowest.load(Ordering::Relaxed) % n;
        // From the lowest word up, then (a free racing with us may have lowered it) the rest.
        for i in 0..n {
            let w = (start + i) % n;
            let word = &self.words[w];
            let mut bits = word.load(Ordering::Relaxed);
            while bits != !0u64 {
                let bit = (!bits).trailing_zeros();
                match word.compare_exchange_weak(bits, bits | (1 << bit), Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => {
                        if w > start
                            && self.lowest.compare_exchange(start, w, Ordering::SeqCst, Ordering::Relaxed).is_ok()
                        {
                            // Words start..w were full when looked at, but a slot freed there
                            // since found the hint still at `start` and left it: look again
                            // (after the raise, so such a free either shows here or lowers
                            // the raised hint itself).
                            if let Some(freed) = (start..w).find(|&v| self.words[v].load(Ordering::SeqCst) != !0u64) {
                                self.lowest.fetch_min(freed, Ordering::SeqCst);
                            }
                        }
                        self.used.fetch_add(1, Ordering::Relaxed);
                        return Some(w as u64 * 64 + u64::from(bit));
                    }
                    Err(actual) => bits = actual,
                }
            }
        }
        None
    }

    /// Take `n` consecutive free slots (1..=64, within one 64-slot word of the bitmap), lowest
    /// first; `None` when no word has that many free in a row. Each is given back with `free`.
    pub fn alloc_run(&self, n: u32) -> Option<Slot> {
        assert!((1..=64).contains(&n), "a run of {n} slots");
        let words = self.words.len();
        let start = self.lowest.load(Ordering::Relaxed).min(words);
        for w in (start..words).chain(0..start) {
            let word = &self.words[w];
            let mut bits = word.load(Ordering::Relaxed);
            loop {
                // Bit i of `starts` set: slots i..i + n of this word are all free.
                let free = !bits;
                let mut starts = free;
                for shift in 1..n {
                    starts &= free >> shift;
                }
                if n > 1 {
                    // Runs must end inside the word.
                    starts &= u64::MAX >> (n - 1);
                }
                if starts == 0 {
                    break;
                }
                let first = starts.trailing_zeros();
                let mask = (u64::MAX >> (64 - n)) << first;
                match word.compare_exchange_weak(bits, bits | mask, Ordering::AcqRel, Ordering::Relaxed) {
                    Ok(_) => {
                        self.used.fetch_add(u64::from(n), Ordering::Relaxed);
                        return Some(w as u64 * 64 + u64::from(first));
                    }
                    Err(actual) => bits = actual,
                }
            }
        }
        None
    }

    /// Give a slot back. Panics on a slot that is out of range or not in use: both are bugs that
    /// would otherwise let two pages share a slot.
    pub fn free(&self, slot: Slot) {
        assert!(slot < self.capacity, "slot {slot} out of range");
        let mask = 1u64 << (slot % 64);
        // Sequentially consistent with `alloc`'s raise of the hint and its look back: one of the
        // two sees the other.
        let prev = self.words[(slot / 64) as usize].fetch_and(!mask, Ordering::SeqCst);
        assert!(prev & mask != 0, "slot {slot} freed twice");
        self.used.fetch_sub(1, Ordering::Relaxed);
        self.lowest.fetch_min((slot / 64) as usize, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    #[test]
    fn capacity_not_a_multiple_of_64_hands_out_exactly_capacity() {
        let slots = SlotAllocator::new(70);
        let all: HashSet<_> = std::iter::from_fn(|| slots.alloc()).collect();
        assert_eq!(all.len(), 70);
        assert!(all.iter().all(|&s| s < 70));
        assert_eq!(slots.used(), 70);
    }

    #[test]
    fn freed_slots_are_reused_lowest_first() {
        let slots = SlotAllocator::new(10_000);
        let taken: Vec<_> = (0..5_000).map(|_| slots.alloc().unwrap()).collect();
        assert_eq!(taken, (0..5_000).collect::<Vec<_>>());
        for s in (100..5_000).step_by(7) {
            slots.free(s);
        }
        // Every freed slot comes back before any slot past the highest ever used.
        let again: Vec<_> = (100..5_000).step_by(7).map(|_| slots.alloc().unwrap()).collect();
        assert!(again.iter().all(|&s| s < 5_000), "a slot past 5000 while lower ones were free");
        assert_eq!(slots.alloc(), Some(5_000));
        slots.free(3);
        assert_eq!(slots.alloc(), Some(3));
    }

    #[test]
    fn the_hint_never_passes_a_free_slot_with_allocs_and_frees_racing() {
        // An alloc that found words full and raised the hint past them could do so just after
        // a free there had found the hint low enough to leave alone: that slot then came back
        // only once every slot above it was taken.
        let slots = SlotAllocator::new(64 * 64);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let slots = &slots;
                s.spawn(move || {
                    let mut held = Vec::new();
                    for k in 0..20_000u64 {
                        if held.len() < 200 && (k * 7 + t) % 3 != 0 {
                            held.push(slots.alloc().unwrap());
                        } else if let Some(slot) = held.pop() {
                            slots.free(slot);
                        }
                    }
                    for slot in held {
                        slots.free(slot);
                    }
                });
            }
        });
        assert_eq!(slots.used(), 0);
        assert_eq!(slots.lowest.load(Ordering::Relaxed), 0, "the hint left above free slots");
        assert_eq!(slots.alloc(), Some(0));
    }

    #[test]
    fn runs_are_consecutive_free_slots_within_a_word() {
        let slots = SlotAllocator::new(200);
        assert_eq!(slots.alloc_run(32), Some(0));
        assert_eq!(slots.alloc_run(32), Some(32));
        assert_eq!(slots.alloc(), Some(64));
        // 65..128 has 63 free slots: a run of 63 fits, one of 64 needs the next word.
        assert_eq!(slots.alloc_run(64), Some(128));
        assert_eq!(slots.alloc_run(63), Some(65));
        slots.free(40);
        slots.free(41);
        assert_eq!(slots.alloc_run(3), Some(192), "only 8 slots left past 192, and 40..42 is two long");
        assert_eq!(slots.alloc_run(2), Some(40));
        assert_eq!(slots.alloc_run(6), None, "195..200 is five long");
        assert_eq!(slots.used(), 200 - 5);
    }

    /// Resident pages (per mincore) of the bitmap's memory.
    fn resident_bitmap_pages(slots: &SlotAllocator) -> usize {
        let start = slots.words.as_ptr() as usize;
        let end = start + slots.words.len() * 8;
        let (first, last) = (start & !4095, (end + 4095) & !4095);
        let mut vec = vec![0u8; (last - first) / 4096];
        // SAFETY: the range covers the live allocation `words` rounded out to whole pages, all
        // mapped; mincore writes one byte per page into `vec`, which has that many.
        let rc = unsafe { libc::mincore(first as *mut libc::c_void, last - first, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn a_large_device_costs_only_the_bitmap_words_in_use() {
        // A 24 GiB device: 6.3 M slots, 768 KiB of bitmap.
        let slots = SlotAllocator::new(6_291_456);
        let taken: Vec<_> = (0..10_000).map(|_| slots.alloc().unwrap()).collect();
        assert_eq!(taken, (0..10_000).collect::<Vec<_>>());
        let resident = resident_bitmap_pages(&slots);
        // 10,000 slots are 157 words, one page; the allocation's first and last page may be
        // shared with other heap data.
        assert!(resident <= 4, "{resident} of 192 bitmap pages resident for 10,000 slots in use");
    }

    proptest! {
        #[test]
        fn alloc_free_sequences_match_a_set_model(ops in proptest::collection::vec(any::<(bool, u8)>(), 1..400)) {
            let slots = SlotAllocator::new(100);
            let mut model: Vec<Slot> = Vec::new();
            for (alloc, pick) in ops {
                if alloc || model.is_empty() {
                    match slots.alloc() {
                        Some(s) => { prop_assert!(!model.contains(&s)); model.push(s); }
                        None => prop_assert_eq!(model.len(), 100),
                    }
                } else {
                    let s = model.swap_remove(pick as usize % model.len());
                    slots.free(s);
                }
                prop_assert_eq!(slots.used(), model.len() as u64);
            }
        }
    }
}
