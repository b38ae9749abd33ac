//! The report buffer between the table (producer) and the software thread reading it
//! (consumer): a single-producer/single-consumer ring with a write pointer the producer
//! advances and a read pointer the consumer advances, as in §2's figure 4. Pointers count
//! forever (they never wrap back); the slot is `pointer mod capacity`. A full ring drops the new
//! report and counts it: the producer (the memory controller) cannot wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[derive(Debug)]
struct Shared {
    slots: Box<[AtomicU64]>,
    mask: u64,
    write: AtomicU64,
    read: AtomicU64,
    dropped: AtomicU64,
}

/// The writing end; exactly one exists per ring.
#[derive(Debug)]
pub struct Producer {
    ring: Arc<Shared>,
}

/// The reading end; exactly one exists per ring.
#[derive(Debug)]
pub struct Consumer {
    ring: Arc<Shared>,
}

/// A ring of `capacity` words (rounded up to a power of two, at least 2).
pub fn ring(capacity: usize) -> (Producer, Consumer) {
    let capacity = capacity.max(2).next_power_of_two();
    let shared = Arc::new(Shared {
        slots: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
        mask: capacity as u64 - 1,
        write: AtomicU64::new(0),
        read: AtomicU64::new(0),
        dropped: AtomicU64::new(0),
    });
    (Producer { ring: shared.clone() }, Consumer { ring: shared })
}

impl Producer {
    /// Append `value`; false (and counted as dropped) when the ring is full.
    pub fn push(&mut self, value: u64) -> bool {
        let r = &self.ring;
        let w = r.write.load(Ordering::Relaxed);
        // Acquire: the consumer's read of the slot we are about to reuse happened before.
        if w - r.read.load(Ordering::Acquire) > r.mask {
            r.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        r.slots[(w & r.mask) as usize].store(value, Ordering::Relaxed);
        // Release: the slot's value is visible before the pointer that publishes it.
        r.write.store(w + 1, Ordering::Release);
        true
    }

    /// Values that can be pushed now without dropping any (more, once the consumer reads).
    pub fn room(&self) -> usize {
        let r = &self.ring;
        (r.mask + 1 - (r.write.load(Ordering::Relaxed) - r.read.load(Ordering::Acquire))) as usize
    }

    /// Reports dropped because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.ring.dropped.load(Ordering::Relaxed)
    }
}

impl Consumer {
    /// The oldest unread value, if any.
    pub fn pop(&mut self) -> Option<u64> {
        let r = &self.ring;
        let rd = r.read.load(Ordering::Relaxed);
        if rd == r.write.load(Ordering::Acquire) {
            return None;
        }
        let value = r.slots[(rd & r.mask) as usize].load(Ordering::Relaxed);
        r.read.store(rd + 1, Ordering::Release);
        Some(value)
    }

    /// Values waiting.
    pub fn len(&self) -> usize {
        (self.ring.write.load(Ordering::Acquire) - self.ring.read.load(Ordering::Relaxed)) as usize
    }

    /// Nothing waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots in the ring.
    pub fn capacity(&self) -> usize {
        self.ring.slots.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Any interleaving of pushes and pops behaves like a bounded FIFO that drops when full,
        /// across many wrap-arounds of the pointers.
        #[test]
        fn behaves_like_a_bounded_fifo(cap in 1usize..9, ops in proptest::collection::vec(any::<Option<u64>>(), 0..600)) {
            let (mut tx, mut rx) = ring(cap);
            let cap = rx.capacity();
            let mut model = VecDeque::new();
            let mut dropped = 0;
            for op in ops {
                match op {
                    Some(v) => {
                        let fits = model.len() < cap;
                        prop_assert_eq!(tx.push(v), fits);
                        if fits { model.push_back(v) } else { dropped += 1 }
                    }
                    None => prop_assert_eq!(rx.pop(), model.pop_front()),
                }
                prop_assert_eq!(rx.len(), model.len());
                prop_assert_eq!(tx.room(), cap - model.len());
                prop_assert_eq!(tx.dropped(), dropped);
            }
        }
    }

    #[test]
    fn a_producer_thread_and_a_consumer_thread_lose_nothing_and_keep_order() {
        let (mut tx, mut rx) = ring(64);
        const N: u64 = 200_000;
        let producer = std::thread::spawn(move || {
            for v in 0..N {
                while !tx.push(v) {
                    std::hint::spin_loop();
                }
            }
            tx.dropped()
        });
        let mut expect = 0;
        while expect < N {
            if let Some(v) = rx.pop() {
                assert_eq!(v, expect);
                expect += 1;
            }
        }
        // Every failed push was retried, so the drop counter counts the retries, not losses.
        let _ = producer.join().unwrap();
        assert!(rx.pop().is_none());
    }
}
