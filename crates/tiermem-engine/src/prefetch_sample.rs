//! Prefetch accuracy under eager install, by sampling.
//!
//! Prefetched pages are mapped as soon as they arrive, so the engine never sees whether the
//! program uses them: a read of a mapped page takes no fault. To measure it anyway, one
//! completed prefetch in [`SAMPLE_EVERY`] is left in its buffer (the prefetch cache, `Prefetched`)
//! instead of being mapped. The program's first touch of it then takes a cheap fault that maps
//! the buffer (a few µs, no I/O) and counts as a used sample; a sample still waiting when
//! a few dozen newer ones have arrived is dropped back to its slot and counts
//! as unused. The share of used samples estimates the share of all prefetched pages that are
//! used before that many further prefetches (64 × 32 pages, 8 MiB, by default).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One completed prefetch in this many waits for a fault instead of being mapped.
pub(crate) const SAMPLE_EVERY: u64 = 64;
/// Most samples waiting at once: each holds an I/O buffer.
const MAX_WAITING: usize = 32;

/// Chooses the samples and remembers which are still waiting.
#[derive(Debug)]
pub(crate) struct PrefetchSampler {
    completed: AtomicU64,
    capacity: usize,
    waiting: Mutex<VecDeque<u64>>,
}

impl PrefetchSampler {
    /// A sampler for an engine with `io_buffers` I/O buffers: samples never hold more than a
    /// 32nd of them, so critical reads always find one.
    pub(crate) fn new(io_buffers: usize) -> Self {
        let capacity = (io_buffers / 32).clamp(1, MAX_WAITING);
        Self { completed: AtomicU64::new(0), capacity, waiting: Mutex::new(VecDeque::with_capacity(capacity + 1)) }
    }

    /// Whether the prefetch that just completed should wait for a fault (one in
    /// [`SAMPLE_EVERY`]).
    pub(crate) fn take_sample(&self) -> bool {
        self.completed.fetch_add(1, Ordering::Relaxed) % SAMPLE_EVERY == SAMPLE_EVERY - 1
    }

    /// Note that page `id` waits as a sample. Returns the oldest waiting sample when there are
    /// now more than its capacity: the caller ends its wait.
    pub(crate) fn push(&self, id: u64) -> Option<u64> {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        // Room for one more than `capacity` was reserved: the queue never grows (growing
        // allocates on the completion thread, which under the OOM guard must not wait for memory).
        waiting.push_back(id);
        (waiting.len() > self.capacity).then(|| waiting.pop_front()).flatten()
    }
}

/// Accuracy and coverage estimated from the samples, or None before any sample has ended.
/// `kept` = prefetched pages that arrived and were mapped or sampled, `issued` = prefetch reads
/// issued, `critical` = pages read for a fault.
pub(crate) fn estimate(used: u64, unused: u64, kept: u64, issued: u64, critical: u64) -> Option<(f64, f64)> {
    if used + unused == 0 || issued == 0 {
        return None;
    }
    let used_pages = used as f64 / (used + unused) as f64 * kept as f64;
    let accuracy = used_pages / issued as f64;
    let coverage = if used_pages + critical as f64 > 0.0 { used_pages / (used_pages + critical as f64) } else { 0.0 };
    Some((accuracy.min(1.0), coverage))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_in_sample_every_is_taken() {
        let s = PrefetchSampler::new(1024);
        let taken = (0..SAMPLE_EVERY * 10).filter(|_| s.take_sample()).count();
        assert_eq!(taken, 10);
    }

    #[test]
    fn the_oldest_sample_ends_when_the_ring_is_full() {
        let s = PrefetchSampler::new(64);
        assert_eq!(s.capacity, 2);
        assert_eq!(s.push(10), None);
        assert_eq!(s.push(11), None);
        assert_eq!(s.push(12), Some(10));
        assert_eq!(s.push(13), Some(11));
        assert_eq!(PrefetchSampler::new(1 << 20).capacity, MAX_WAITING);
        assert_eq!(PrefetchSampler::new(8).capacity, 1);
    }

    #[test]
    fn estimates_scale_the_sampled_share_to_every_kept_prefetch() {
        assert_eq!(estimate(0, 0, 100, 100, 5), None);
        // 3 of 4 samples used, 800 of 1000 issued pages arrived: 600 used.
        let (accuracy, coverage) = estimate(3, 1, 800, 1000, 200).unwrap();
        assert!((accuracy - 0.6).abs() < 1e-9);
        assert!((coverage - 0.75).abs() < 1e-9);
    }
}
