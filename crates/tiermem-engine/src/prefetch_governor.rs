//! Cuts a prefetcher's reads while they are mostly wasted.
//!
//! Prefetched pages are mapped as soon as they land, and their first touch is never seen, so
//! replacement cannot tell a prefetched page nobody wants from the program's working set. A
//! prefetcher that guesses badly (the next 7 pages on every miss of a blocked LU solve: 14–19%
//! used) then evicts the working set to make room for its guesses, each eviction brings
//! another miss, and each miss another 7 guesses: 18x slower than `ondemand` on a small
//! Linpack at 20 MiB (docs/policies.md, *The prefetch governor*).
//!
//! The governor caps how many pages one prefetcher call may ask for. It judges by the
//! prefetch samples (see [`crate::prefetch_sample`]): after every [`WINDOW`] samples ended
//! used or unused, the cap halves when fewer than [`CUT_BELOW`] of them were used and doubles
//! when at least [`GROW_FROM`] were, between 1 page and a whole [`PageList`]. It never goes
//! to zero: the samples it judges by come from the reads it allows. The prefetchers themselves
//! are untouched (the simulator runs them as they are); the cap keeps the first pages of a
//! list, which every prefetcher here orders from most to least likely.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use tiermem_policy::PageList;

/// Samples judged at once (one sample per 64 prefetches: a decision per 1,024 or so).
pub(crate) const WINDOW: u32 = 16;
/// Fewer used samples than this in a window halve the cap (37.5%).
pub(crate) const CUT_BELOW: u32 = 6;
/// At least this many used samples in a window double it (62.5%).
pub(crate) const GROW_FROM: u32 = 10;

/// The cap on pages per prefetcher call and the samples ended since it was last judged.
#[derive(Debug)]
pub(crate) struct PrefetchGovernor {
    enabled: bool,
    cap: AtomicUsize,
    /// Used samples in the high 32 bits, ended samples in the low 32: one atomic update per
    /// sample, no lock (samples end on faulting threads too, inside the SIGBUS handler).
    window: AtomicU64,
}

impl PrefetchGovernor {
    /// A governor starting with no cut; a disabled one never cuts.
    pub(crate) fn new(enabled: bool) -> Self {
        Self { enabled, cap: AtomicUsize::new(PageList::CAPACITY), window: AtomicU64::new(0) }
    }

    /// Pages one prefetcher call may read now.
    pub(crate) fn cap(&self) -> usize {
        self.cap.load(Ordering::Relaxed)
    }

    /// Keep the first [`Self::cap`] pages of `wanted`; returns how many were cut.
    pub(crate) fn cut(&self, wanted: &mut PageList) -> usize {
        let keep = self.cap();
        let cut = wanted.len().saturating_sub(keep);
        wanted.truncate(keep);
        cut
    }

    /// A prefetch sample ended, `used` by the program or not.
    pub(crate) fn sample_ended(&self, used: bool) {
        if !self.enabled {
            return;
        }
        let add = (u64::from(used) << 32) | 1;
        // The sample that fills a window empties it in the same atomic step, so exactly one
        // thread judges each window and the count never runs past one (emptying it in a
        // second step let a thread preempted between the two leave it past the window for
        // good, judged never again).
        let filled = |window: u64| (window + add) as u32 >= WINDOW;
        let before = self
            .window
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| Some(if filled(w) { 0 } else { w + add }))
            .unwrap_or_else(|w| w);
        if !filled(before) {
            return;
        }
        let used = ((before + add) >> 32) as u32;
        // One update (a judgement of the window before, on another thread, may still be
        // landing).
        let _ = self.cap.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cap| {
            Some(if used < CUT_BELOW {
                (cap / 2).max(1)
            } else if used >= GROW_FROM {
                (cap * 2).min(PageList::CAPACITY)
            } else {
                cap
            })
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge(g: &PrefetchGovernor, used: u32) {
        (0..WINDOW).for_each(|k| g.sample_ended(k < used));
    }

    fn list(n: u64) -> PageList {
        let mut l = PageList::default();
        (0..n).for_each(|p| {
            l.push(p);
        });
        l
    }

    #[test]
    fn wasted_windows_halve_the_cap_down_to_one_page_and_useful_ones_double_it_back() {
        let g = PrefetchGovernor::new(true);
        assert_eq!(g.cap(), PageList::CAPACITY);
        judge(&g, CUT_BELOW - 1);
        assert_eq!(g.cap(), PageList::CAPACITY / 2);
        (0..10).for_each(|_| judge(&g, 0));
        assert_eq!(g.cap(), 1, "never below one page: the samples come from the reads allowed");
        judge(&g, CUT_BELOW);
        assert_eq!(g.cap(), 1, "between the thresholds the cap holds");
        judge(&g, GROW_FROM);
        assert_eq!(g.cap(), 2);
        (0..10).for_each(|_| judge(&g, WINDOW));
        assert_eq!(g.cap(), PageList::CAPACITY);
    }

    #[test]
    fn a_window_is_judged_only_once_full() {
        let g = PrefetchGovernor::new(true);
        (0..WINDOW - 1).for_each(|_| g.sample_ended(false));
        assert_eq!(g.cap(), PageList::CAPACITY);
        g.sample_ended(false);
        assert_eq!(g.cap(), PageList::CAPACITY / 2);
    }

    #[test]
    fn samples_ended_on_many_threads_at_once_are_all_judged() {
        // A thread that saw its sample fill the window used to take the window's count back
        // only afterwards: preempted in between while others went on, it left the count past
        // the window for good, and the cap never moved again.
        let g = PrefetchGovernor::new(true);
        let per_thread = 50_000u64;
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let g = &g;
                s.spawn(move || {
                    for k in 0..per_thread {
                        g.sample_ended((k + t) % 5 == 0);
                        if k % 64 == 0 {
                            std::thread::yield_now();
                        }
                    }
                });
            }
        });
        let left = g.window.load(Ordering::Relaxed) as u32;
        assert_eq!(u64::from(left), 4 * per_thread % u64::from(WINDOW), "samples not judged");
        assert_eq!(g.cap(), 1, "a fifth of the samples used: every window cuts");
    }

    #[test]
    fn the_cut_keeps_the_first_pages_of_the_list() {
        let g = PrefetchGovernor::new(true);
        (0..3).for_each(|_| judge(&g, 0));
        assert_eq!(g.cap(), 8);
        let mut wanted = list(20);
        assert_eq!(g.cut(&mut wanted), 12);
        assert_eq!(wanted.as_slice(), list(8).as_slice());
        let mut short = list(5);
        assert_eq!(g.cut(&mut short), 0);
        assert_eq!(short.len(), 5);
    }

    #[test]
    fn a_disabled_governor_never_cuts() {
        let g = PrefetchGovernor::new(false);
        (0..10).for_each(|_| judge(&g, 0));
        let mut wanted = list(64);
        assert_eq!(g.cut(&mut wanted), 0);
        assert_eq!(wanted.len(), 64);
    }
}
