//! Oracle tests: the simulator with the engine's policy objects against brute-force references.

use std::collections::VecDeque;

use proptest::prelude::*;
use tiermem_sim::trace::event;
use tiermem_sim::{simulate, EventKind, FirstTouch, HitInfo, Latency, LruCurve, MonitorInput, SimConfig, SimResult};

fn config(prefetch: &str, replace: &str, local_pages: usize) -> SimConfig {
    SimConfig {
        local_pages,
        prefetch: prefetch.into(),
        replace: replace.into(),
        options: Default::default(),
        latency: Latency::default(),
        monitor: MonitorInput::None,
        hits: HitInfo::Full,
        clean_ahead: 0.0,
        clean_queue: 0,
        first_touch: FirstTouch::Miss,
    }
}

fn run(pages: &[u64], prefetch: &str, replace: &str, local_pages: usize) -> SimResult {
    let events: Vec<u64> = pages.iter().map(|&p| event(p, EventKind::Read)).collect();
    simulate(&events, &config(prefetch, replace, local_pages), &mut |_| {}).unwrap()
}

/// An access of a page, or the program giving one back (a discard record).
#[derive(Clone, Copy)]
enum Op {
    Access(u64),
    GiveBack(u64),
}

fn accesses_only(pages: &[u64]) -> Vec<Op> {
    pages.iter().map(|&p| Op::Access(p)).collect()
}

fn brute_fifo(pages: &[u64], cap: usize) -> u64 {
    brute_fifo_ops(&accesses_only(pages), cap)
}

fn brute_fifo_ops(ops: &[Op], cap: usize) -> u64 {
    let mut q = VecDeque::new();
    let mut faults = 0;
    for &op in ops {
        match op {
            Op::GiveBack(p) => q.retain(|&x| x != p),
            Op::Access(p) if !q.contains(&p) => {
                faults += 1;
                if q.len() == cap {
                    q.pop_front();
                }
                q.push_back(p);
            }
            Op::Access(_) => {}
        }
    }
    faults
}

fn brute_lru(pages: &[u64], cap: usize) -> u64 {
    brute_lru_ops(&accesses_only(pages), cap)
}

fn brute_lru_ops(ops: &[Op], cap: usize) -> u64 {
    let mut v: Vec<u64> = Vec::new(); // most recent last
    let mut faults = 0;
    for &op in ops {
        let p = match op {
            Op::GiveBack(p) => {
                v.retain(|&x| x != p);
                continue;
            }
            Op::Access(p) => p,
        };
        if let Some(i) = v.iter().position(|&x| x == p) {
            v.remove(i);
        } else {
            faults += 1;
            if v.len() == cap {
                v.remove(0);
            }
        }
        v.push(p);
    }
    faults
}

/// Belady's MIN by its definition: on a miss with memory full, scan the future for each
/// resident page and evict the one used farthest away (or never).
fn brute_min(pages: &[u64], cap: usize) -> u64 {
    let mut resident: Vec<u64> = Vec::new();
    let mut faults = 0;
    for (i, &p) in pages.iter().enumerate() {
        if resident.contains(&p) {
            continue;
        }
        faults += 1;
        if resident.len() == cap {
            let next = |q: u64| pages[i + 1..].iter().position(|&x| x == q).unwrap_or(usize::MAX);
            let (k, _) = resident.iter().enumerate().max_by_key(|&(_, &q)| next(q)).unwrap();
            resident.remove(k);
        }
        resident.push(p);
    }
    faults
}

/// Traces that hurt LRU and FIFO: loops one page larger than memory, sawtooth scans, Belady's
/// anomaly sequence, hot sets with scans through them.
fn adversarial() -> impl Strategy<Value = (Vec<u64>, usize)> {
    (1usize..12, 0u8..4, 1usize..40).prop_map(|(cap, shape, reps)| {
        let n = cap as u64 + 1;
        let pages: Vec<u64> = match shape {
            0 => (0..reps as u64 * n).map(|i| i % n).collect(),
            1 => (0..reps)
                .flat_map(|r| if r % 2 == 0 { (0..2 * n).collect::<Vec<_>>() } else { (0..2 * n).rev().collect() })
                .collect(),
            2 => [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5].repeat(reps),
            _ => (0..reps as u64).flat_map(|r| [0, 1, 0, 1, 100 + r * 7, 101 + r * 7, 102 + r * 7]).collect(),
        };
        (pages, cap)
    })
}

/// Reads and writes of `pages`, a write where `writes` (repeated) says so.
fn accesses(pages: &[u64], writes: &[bool]) -> Vec<u64> {
    pages
        .iter()
        .zip(writes.iter().cycle())
        .map(|(&p, &w)| event(p, if w { EventKind::Write } else { EventKind::Read }))
        .collect()
}

fn random() -> impl Strategy<Value = (Vec<u64>, usize)> {
    (1usize..20, 2u64..64).prop_flat_map(|(cap, range)| (proptest::collection::vec(0..range, 1..600), Just(cap)))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn fifo_and_lru_match_brute_force_on_random_traces((pages, cap) in random()) {
        prop_assert_eq!(run(&pages, "none", "fifo", cap).faults, brute_fifo(&pages, cap));
        prop_assert_eq!(run(&pages, "none", "lru", cap).faults, brute_lru(&pages, cap));
    }

    #[test]
    fn fifo_and_lru_match_brute_force_on_adversarial_traces((pages, cap) in adversarial()) {
        prop_assert_eq!(run(&pages, "none", "fifo", cap).faults, brute_fifo(&pages, cap));
        prop_assert_eq!(run(&pages, "none", "lru", cap).faults, brute_lru(&pages, cap));
    }

    /// With pages given back in between (a discard record): the reference drops them from its
    /// queue and list. FIFO used to keep a stale entry, which evicted the page soon after it
    /// came back (found in the review of 2026-12-05).
    #[test]
    fn fifo_and_lru_match_brute_force_with_pages_given_back(
        (pages, cap) in random(),
        given_back in proptest::collection::vec(any::<bool>(), 600),
    ) {
        use tiermem_sim::trace::discard_records;
        // After each access, maybe give back the page accessed two steps before.
        let mut events = Vec::new();
        let mut ops = Vec::new();
        for (k, &p) in pages.iter().enumerate() {
            events.push(event(p, EventKind::Read));
            ops.push(Op::Access(p));
            if k >= 2 && given_back[k] {
                events.extend(discard_records(pages[k - 2], 1));
                ops.push(Op::GiveBack(pages[k - 2]));
            }
        }
        let sim = |replace| simulate(&events, &config("none", replace, cap), &mut |_| {}).unwrap().faults;
        prop_assert_eq!(sim("fifo"), brute_fifo_ops(&ops, cap));
        prop_assert_eq!(sim("lru"), brute_lru_ops(&ops, cap));
    }

    #[test]
    fn the_one_pass_lru_curve_is_lru_at_every_size(
        (pages, _) in prop_oneof![random(), adversarial()],
        writes in proptest::collection::vec(any::<bool>(), 600),
    ) {
        let events: Vec<u64> = accesses(&pages, &writes)
            .into_iter()
            // Reports and compute events between the accesses change nothing.
            .flat_map(|e| [e, event(3, EventKind::Report), event(5, EventKind::Compute)])
            .collect();
        let curve = LruCurve::measure(&events);
        for cap in [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 300] {
            prop_assert_eq!(curve.faults(cap), brute_lru(&pages, cap), "{} pages", cap);
        }
        // And the simulator's own LRU, at a few sizes.
        for cap in [2, 9, 40] {
            prop_assert_eq!(curve.faults(cap), run(&pages, "none", "lru", cap).faults, "{} pages", cap);
        }
    }

    #[test]
    fn zero_fills_only_split_the_misses_without_prefetching(
        (pages, cap) in prop_oneof![random(), adversarial()],
        writes in proptest::collection::vec(any::<bool>(), 1..40),
    ) {
        // Which pages are resident does not depend on what a miss on a page never written
        // costs: each miss is either a device read or a zero fill, and each distinct page's first
        // touch is a zero fill.
        let events = accesses(&pages, &writes);
        let distinct = pages.iter().collect::<std::collections::HashSet<_>>().len() as u64;
        for policy in ["fifo", "lru", "clock", "belady"] {
            let miss = simulate(&events, &config("none", policy, cap), &mut |_| {}).unwrap();
            let zero = simulate(&events, &zero_fill(config("none", policy, cap)), &mut |_| {}).unwrap();
            prop_assert!(zero.zero_fills >= distinct, "{}: {} zero fills, {} pages", policy, zero.zero_fills, distinct);
            prop_assert_eq!(zero.faults + zero.zero_fills, miss.faults, "{}", policy);
            prop_assert_eq!(miss.zero_fills, 0);
            prop_assert_eq!(zero.evictions, miss.evictions, "{}", policy);
            if writes.iter().all(|&w| !w) {
                prop_assert_eq!(zero.faults, 0, "{}: a page never written is never read", policy);
            }
        }
    }

    #[test]
    fn belady_is_the_brute_force_minimum_and_no_online_policy_beats_it(
        (pages, cap) in prop_oneof![random(), adversarial()]
    ) {
        let optimum = run(&pages, "none", "belady", cap).faults;
        prop_assert_eq!(optimum, brute_min(&pages, cap));
        for policy in tiermem_policy::REPLACEMENTS {
            let online = run(&pages, "none", policy, cap).faults;
            prop_assert!(online >= optimum, "{} took {} faults, Belady {}", policy, online, optimum);
        }
    }
}

#[test]
fn belady_beats_lru_strictly_on_a_loop_one_page_too_big() {
    let pages: Vec<u64> = (0..100).map(|i| i % 5).collect();
    assert_eq!(run(&pages, "none", "lru", 4).faults, 100, "LRU misses every time");
    assert!(run(&pages, "none", "belady", 4).faults < 40);
}

#[test]
fn stream_prefetching_covers_a_sequential_scan_accurately() {
    let pages: Vec<u64> = (0..20_000).collect();
    let events: Vec<u64> = pages.iter().map(|&p| event(p, EventKind::Read)).collect();
    let mut cfg = config("stream", "stream-first", 1000);
    cfg.monitor = MonitorInput::Accesses;
    let stream = simulate(&events, &cfg, &mut |_| {}).unwrap();
    assert!(stream.accuracy > 0.9, "{stream:?}");
    assert!(stream.coverage > 0.9, "{stream:?}");
    let none = simulate(&events, &config("none", "clock", 1000), &mut |_| {}).unwrap();
    assert_eq!(none.faults, 20_000);
    assert!(stream.modeled_ns < none.modeled_ns / 2.0, "prefetching must pay off in modeled time");
    // On uniform random pages there is no stream: the stream table issues nothing (only the
    // swap-style next-7 of faults), so accuracy is low and stream-first degenerates to LRU.
    let mut x = 12345u64;
    let random: Vec<u64> = (0..20_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            event(x % 5000, EventKind::Read)
        })
        .collect();
    let r = simulate(&random, &cfg, &mut |_| {}).unwrap();
    assert!(r.accuracy < 0.3, "{r:?}");
}

fn zero_fill(config: SimConfig) -> SimConfig {
    SimConfig { first_touch: FirstTouch::ZeroFill, ..config }
}

#[test]
fn a_page_never_written_is_zero_filled_and_never_read_ahead() {
    // Two ascending passes over 2,000 pages through 500: the first pass writes pages nobody
    // touched (nothing on the device), the second reads them back. A third range is only
    // read: dropped unwritten, its pages are zero fills again on the next pass.
    let events: Vec<u64> =
        (0..2000).map(|p| event(p, EventKind::Write)).chain((0..2000).map(|p| event(p, EventKind::Read))).collect();
    for prefetch in ["fastswap", "readahead", "stream", "ondemand"] {
        let mut cfg = zero_fill(config(prefetch, "clock", 500));
        cfg.monitor = MonitorInput::Accesses;
        let first_pass = simulate(&events[..2000], &cfg, &mut |_| {}).unwrap();
        assert_eq!((first_pass.zero_fills, first_pass.faults), (2000, 0), "{prefetch}: {first_pass:?}");
        assert_eq!(first_pass.prefetch_issued, 0, "{prefetch}: nothing to read ahead of a first touch");
        // A zero fill costs the fault's software time and no read.
        let per_access = cfg.latency.access_ns + cfg.latency.fault_ns;
        assert_eq!(first_pass.modeled_ns, 2000.0 * per_access, "{prefetch}");
        let both = simulate(&events, &cfg, &mut |_| {}).unwrap();
        assert_eq!(both.zero_fills, 2000, "{prefetch}");
        assert!(both.prefetch_hits > 1000, "{prefetch}: the second pass is read ahead: {both:?}");
        assert!(both.accuracy > 0.95, "{prefetch}: {both:?}");
        // As a cache simulator counts it, the first pass is 2,000 misses and is read ahead too.
        let mut miss = config(prefetch, "clock", 500);
        miss.monitor = MonitorInput::Accesses;
        let cache = simulate(&events[..2000], &miss, &mut |_| {}).unwrap();
        assert!(cache.prefetch_issued > 1000 && cache.zero_fills == 0, "{prefetch}: {cache:?}");
    }
    let read_only: Vec<u64> = (0..2).flat_map(|_| (10_000..12_000).map(|p| event(p, EventKind::Read))).collect();
    let r = simulate(&read_only, &zero_fill(config("fastswap", "clock", 500)), &mut |_| {}).unwrap();
    assert_eq!((r.zero_fills, r.faults, r.prefetch_issued), (4000, 0, 0), "{r:?}");
}

/// A program that writes pages and gives them back (munmap, MADV_DONTNEED; the engine records
/// a discard): they leave local memory without a write-back, and hold nothing afterwards.
#[test]
fn discarded_pages_free_local_memory_and_hold_nothing() {
    use tiermem_sim::trace::discard_records;
    let writes = |from: u64| (from..from + 100).map(|p| event(p, EventKind::Write));
    // Write 100 pages into 100 of local memory, give them back, write 100 fresh ones, and
    // read the first 100 again.
    let events: Vec<u64> = writes(0)
        .chain(discard_records(0, 100))
        .chain(writes(1000))
        .chain((0..100).map(|p| event(p, EventKind::Read)))
        .collect();
    for replace in ["fifo", "lru", "clock", "stream-first", "seq-protect", "seq-balance", "belady"] {
        let zero = simulate(&events, &zero_fill(config("none", replace, 100)), &mut |_| {}).unwrap();
        assert_eq!(zero.discarded, 100, "{replace}");
        // Written back: the fresh pages the re-reads evict, none of those given back.
        assert_eq!(zero.writebacks, 100, "{replace}: {zero:?}");
        // The fresh pages found room without an eviction; reading the given-back pages again
        // maps zeros, with no device read.
        assert_eq!((zero.faults, zero.zero_fills, zero.evictions), (0, 300, 100), "{replace}: {zero:?}");
        let miss = simulate(&events, &config("none", replace, 100), &mut |_| {}).unwrap();
        assert_eq!((miss.faults, miss.evictions, miss.discarded), (300, 100, 100), "{replace}: {miss:?}");
    }
    // A discard of pages never used, or of a range far larger than anything used, is harmless.
    let mut wide: Vec<u64> = discard_records(0, 1 << 30).collect();
    wide.extend(writes(0));
    let r = simulate(&wide, &zero_fill(config("fastswap", "lru", 100)), &mut |_| {}).unwrap();
    assert_eq!((r.zero_fills, r.discarded), (100, 0));
}

#[test]
fn bad_setups_are_clear_errors() {
    let events = vec![event(1, EventKind::Read)];
    let e = simulate(&events, &config("none", "lru", 0), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("at least one page"), "{e}");
    let e = simulate(&events, &config("magic", "lru", 4), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("unknown prefetcher 'magic'"), "{e}");
    let e = simulate(&events, &config("stream", "belady", 4), &mut |_| {}).unwrap_err().to_string();
    assert!(e.contains("--prefetch none"), "{e}");
    assert!(simulate(&[], &config("none", "lru", 4), &mut |_| {}).is_err());
}

#[test]
fn dirty_evictions_are_written_back_and_clean_ones_are_not() {
    let events: Vec<u64> =
        (0..10u64).map(|p| event(p, if p % 2 == 0 { EventKind::Write } else { EventKind::Read })).collect();
    let r = simulate(&events, &config("none", "fifo", 4), &mut |_| {}).unwrap();
    // Pages 0..=5 are evicted; 0, 2, 4 were written.
    assert_eq!((r.evictions, r.writebacks), (6, 3));
}

/// A trace long enough that the one-pass curve renumbers its times several times (its tree
/// starts with 4,096 slots) is still LRU's at every size.
#[test]
fn the_one_pass_lru_curve_stays_exact_across_renumberings() {
    let mut x = 12345u64;
    let pages: Vec<u64> = (0..40_000)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A random walk over 300 pages with a sequential sweep every so often.
            if i % 1000 < 100 {
                (i % 1000) as u64
            } else {
                x % 300
            }
        })
        .collect();
    let events: Vec<u64> = pages.iter().map(|&p| event(p, EventKind::Read)).collect();
    let curve = LruCurve::measure(&events);
    for cap in [1, 7, 50, 150, 299, 300, 400] {
        assert_eq!(curve.faults(cap), brute_lru(&pages, cap), "{cap} pages");
    }
}
