#![allow(clippy::multiple_unsafe_ops_per_block)] // raw pointer walks over test regions, one invariant each
//! Every prefetcher and replacement policy runs live in the engine without losing data: a
//! region 4x the budget is written, read back in order (where prefetchers work), then read and
//! written at random, and every page must hold what was last written.

mod common;

use common::*;
use tiermem_engine::policy::{PageList, PREFETCHERS, REPLACEMENTS};
use tiermem_engine::EngineConfig;

const LIMIT_PAGES: u64 = 64;

fn run(prefetch: &str, replace: &str) -> tiermem_engine::StatsSnapshot {
    let device = devices(LIMIT_PAGES * 4 * 4096 * 2).remove(0).1;
    let engine = engine(device, LIMIT_PAGES, |c| {
        c.prefetch = prefetch.into();
        c.replace = replace.into();
    });
    let pages = (LIMIT_PAGES * 4) as usize;
    let region = engine.create_region(pages * 4096).unwrap();
    let base = region.as_ptr() as usize;
    let mut versions = vec![0u64; pages];
    let write = |page: usize, v: u64| {
        let ptr = (base + page * 4096) as *mut u64;
        for w in 0..512 {
            // SAFETY: the page lies inside the region, which outlives this closure.
            unsafe { ptr.add(w).write_volatile(pattern(page, v, w)) };
        }
    };
    let intact = |page: usize, v: u64| {
        let ptr = (base + page * 4096) as *const u64;
        // SAFETY: as above.
        (0..512).all(|w| unsafe { ptr.add(w).read_volatile() } == pattern(page, v, w))
    };
    for (page, v) in versions.iter_mut().enumerate() {
        *v = 1;
        write(page, 1);
    }
    for _ in 0..2 {
        for (page, &v) in versions.iter().enumerate() {
            assert!(intact(page, v), "{prefetch} × {replace}: page {page} wrong on the sequential read");
        }
    }
    let mut rng = Rng(0xfeed);
    for _ in 0..3000 {
        let r = rng.next();
        let page = (r >> 8) as usize % pages;
        if r & 3 == 0 {
            versions[page] += 1;
            write(page, versions[page]);
        } else {
            assert!(intact(page, versions[page]), "{prefetch} × {replace}: page {page} wrong on a random read");
        }
    }
    for (page, &v) in versions.iter().enumerate() {
        assert!(intact(page, v), "{prefetch} × {replace}: page {page} wrong at the end");
    }
    engine.stats()
}

#[test]
fn every_prefetcher_with_several_replacements_keeps_every_write() {
    let _serial = serial();
    if features_or_skip("every_prefetcher_with_several_replacements_keeps_every_write").is_none() {
        return;
    }
    for prefetch in PREFETCHERS {
        for replace in ["clock", "lru", "stream-first"] {
            let stats = run(prefetch, replace);
            eprintln!(
                "{prefetch} × {replace}: {} evictions, {} prefetches issued, {} hits",
                stats.evictions, stats.prefetch_issued, stats.prefetch_hits
            );
            assert!(stats.evictions > 0, "{prefetch} × {replace}: nothing was evicted");
            if *prefetch != "none" {
                assert!(stats.prefetch_issued > 0, "{prefetch} × {replace}: a sequential read-back prefetched nothing");
            } else {
                assert_eq!(stats.prefetch_issued, 0);
            }
        }
    }
    // The remaining replacement policies, once each.
    for replace in REPLACEMENTS.iter().filter(|r| !["clock", "lru", "stream-first"].contains(r)) {
        assert!(run("readahead", replace).evictions > 0);
    }
}

/// A loop over more pages than the budget holds, in an order no address arithmetic predicts
/// and across two regions (an interpreter's collector walking its heap): every lap misses on
/// nearly every page under `ondemand`; `temporal` reads the later laps ahead from its history,
/// in both regions.
#[test]
fn a_scattered_loop_over_two_regions_is_read_ahead_by_temporal_from_its_second_lap() {
    let _serial = serial();
    if features_or_skip("a_scattered_loop_over_two_regions_is_read_ahead_by_temporal_from_its_second_lap").is_none() {
        return;
    }
    // Prefetches land only in the room background reclaim keeps (2% of the budget): a budget
    // large enough for a few windows there.
    let (budget, per_region) = (4096u64, 8192usize);
    let total = 2 * per_region;
    // A step coprime with the loop's length and far from ±1: neighbours in the loop are ~900
    // pages apart, so no sequential window follows it.
    let order: Vec<usize> = (0..total).map(|i| i * 907 % total).collect();
    let mut critical = Vec::new();
    for prefetch in ["ondemand", "temporal"] {
        let device = devices(total as u64 * 4096 * 2).remove(0).1;
        let engine = engine(device, budget, |c| c.prefetch = prefetch.into());
        let regions =
            [engine.create_region(per_region * 4096).unwrap(), engine.create_region(per_region * 4096).unwrap()];
        let addr = |p: usize| regions[p / per_region].as_ptr() as usize + (p % per_region) * 4096;
        for &p in &order {
            // SAFETY: addr(p) is a page inside one of the regions, which outlive the loop.
            unsafe { (addr(p) as *mut u64).write_volatile(p as u64 + 1) };
        }
        let mut laps = Vec::new();
        for lap in 0..4 {
            let before = engine.stats().critical_reads;
            let mut sum = 0;
            for &p in &order {
                // The whole page, as a collector visits its objects: a program that did nothing
                // between faults would outrun any prefetch on the `mem` device.
                sum += (0..512)
                    .map(|w| {
                        // SAFETY: as above; w < 512 words of the page.
                        unsafe { (addr(p) as *const u64).add(w).read_volatile() }
                    })
                    .sum::<u64>();
            }
            assert_eq!(sum, (1..=total as u64).sum::<u64>(), "{prefetch}: lap {lap} read wrong data");
            laps.push(engine.stats().critical_reads - before);
        }
        let s = engine.stats();
        eprintln!("{prefetch}: critical reads per lap of {total} pages {laps:?}, {} prefetched", s.prefetch_issued);
        critical.push(laps[1..].iter().sum::<u64>());
    }
    let later_laps = 3 * total as u64;
    assert!(critical[0] > later_laps * 7 / 10, "ondemand read a scattered loop ahead: {critical:?} of {later_laps}");
    // Measured 39-61% of ondemand's, 79% in one CI run on a slow host and 92% in another
    // (2026-12-06): windows land only in the room reclaim keeps, so part of each is skipped and
    // missed, and how much depends on how fast the prefetches complete next to the program.
    // Asked here: a twentieth fewer at least. ondemand's laps after the first are the same to
    // within a few pages (14,336-14,338 of 16,384 in that run), so a prefetcher that reads none
    // of the loop ahead cannot give that.
    assert!(
        critical[1] * 20 < critical[0] * 19,
        "temporal read little of the repeated laps ahead: {critical:?} of {later_laps}"
    );
}

/// A gather through a scattered index over two parallel arrays, each in its own region (a
/// structure of arrays): under `ondemand` both pages of an element miss one after the other;
/// `sibling` learns that the second lies at the first's index in the other region and reads it
/// with the first.
#[test]
fn a_gather_over_two_parallel_arrays_is_read_in_pairs_by_sibling() {
    let _serial = serial();
    if features_or_skip("a_gather_over_two_parallel_arrays_is_read_in_pairs_by_sibling").is_none() {
        return;
    }
    let (budget, per_region) = (1024u64, 8192usize);
    // Neighbours in the gather are ~900 pages apart: no sequential window follows it.
    let order: Vec<usize> = (0..per_region).map(|i| i * 907 % per_region).collect();
    let mut critical = Vec::new();
    for prefetch in ["ondemand", "sibling"] {
        let device = devices(2 * per_region as u64 * 4096 * 2).remove(0).1;
        let engine = engine(device, budget, |c| c.prefetch = prefetch.into());
        let arrays =
            [engine.create_region(per_region * 4096).unwrap(), engine.create_region(per_region * 4096).unwrap()];
        let addr = |a: usize, i: usize| arrays[a].as_ptr() as usize + i * 4096;
        for i in 0..per_region {
            for a in 0..2 {
                // SAFETY: addr(a, i) is a page inside array a's region, which outlives the loop.
                unsafe { (addr(a, i) as *mut u64).write_volatile((a * per_region + i) as u64 + 1) };
            }
        }
        let before = engine.stats().critical_reads;
        let mut sum = 0;
        for &i in &order {
            for a in 0..2 {
                // The whole page, as a program using the element's neighbours would: a program
                // doing nothing between faults would outrun any prefetch.
                sum += (0..512)
                    .map(|w| {
                        // SAFETY: as above; w < 512 words of the page.
                        unsafe { (addr(a, i) as *const u64).add(w).read_volatile() }
                    })
                    .sum::<u64>();
            }
        }
        assert_eq!(sum, (1..=2 * per_region as u64).sum::<u64>(), "{prefetch}: the gather read wrong data");
        let s = engine.stats();
        let reads = s.critical_reads - before;
        eprintln!(
            "{prefetch}: {reads} critical reads for {} pages gathered, {} prefetched",
            2 * per_region,
            s.prefetch_issued
        );
        critical.push(reads);
    }
    let gathered = 2 * per_region as u64;
    // With the budget an eighth of the pages, nearly every page misses under ondemand.
    assert!(critical[0] > gathered * 8 / 10, "ondemand read the gather ahead: {critical:?} of {gathered}");
    // The second page of each element read with the first: up to half the critical reads go.
    // Asked: a fifth fewer at least, which reading nothing ahead cannot give.
    assert!(
        critical[1] * 5 < critical[0] * 4,
        "sibling read little of the gather in pairs: {critical:?} of {gathered}"
    );
}

/// Reads pages of a region 4x a 1,024-page budget with `fastswap` (the next 7 pages on every
/// miss), `reads` per phase, each phase at random (true) or in order (false). Returns the
/// engine's counters after each phase.
fn fastswap_reads(governor: bool, phases: &[bool], reads: usize) -> Vec<(tiermem_engine::StatsSnapshot, usize)> {
    let budget = 1024u64;
    let pages = (budget * 4) as usize;
    let device = devices(pages as u64 * 4096 * 2).remove(0).1;
    let engine = engine(device, budget, |c| {
        c.prefetch = "fastswap".into();
        c.prefetch_governor = governor;
        // As `tiermem run` takes faults: there eviction drops a batch at once (a page pipe), and
        // room for prefetches follows; moving victims page by page in handler-thread mode left
        // so little that an ungoverned fastswap issued 0.6-2.5 prefetches a miss from run to
        // run, and the comparison below was noise.
        c.fault_mode = tiermem_engine::FaultMode::Sigbus;
    });
    let region = engine.create_region(pages * 4096).unwrap();
    let base = region.as_ptr() as usize;
    for page in 0..pages {
        // SAFETY: the page lies inside the region, which outlives the loop.
        unsafe { ((base + page * 4096) as *mut u64).write_volatile(page as u64 + 1) };
    }
    let mut rng = Rng(0x5eed);
    let mut after = Vec::new();
    for &random in phases {
        for k in 0..reads {
            let page = if random { (rng.next() >> 8) as usize % pages } else { k % pages };
            // SAFETY: as above.
            let got = unsafe { ((base + page * 4096) as *const u64).read_volatile() };
            assert_eq!(got, page as u64 + 1, "page {page} read wrong data");
        }
        after.push((engine.stats(), engine.prefetch_cap()));
    }
    after
}

#[test]
fn the_prefetch_governor_cuts_a_prefetcher_that_guesses_wrong_and_leaves_one_that_guesses_right() {
    let _serial = serial();
    if features_or_skip("the_prefetch_governor_cuts_a_prefetcher_that_guesses_wrong_and_leaves_one_that_guesses_right")
        .is_none()
    {
        return;
    }
    // At random over 4x the budget, the next 7 pages of a miss are almost never read before
    // they are evicted again. Judged on the second half: the cap takes a few thousand
    // prefetches to come down from 64 pages a call to 1.
    let later = |s: &[(tiermem_engine::StatsSnapshot, usize)]| {
        let issued = s[1].0.prefetch_issued - s[0].0.prefetch_issued;
        let misses = s[1].0.critical_reads - s[0].0.critical_reads;
        (issued, misses, issued as f64 / misses.max(1) as f64)
    };
    let free = fastswap_reads(false, &[true, true], 15_000);
    let governed = fastswap_reads(true, &[true, true], 15_000);
    let ((free_issued, free_misses, free_rate), (issued, misses, rate)) = (later(&free), later(&governed));
    eprintln!(
        "random, second half: ungoverned {free_issued} prefetches for {free_misses} critical reads ({free_rate:.2} a \
         miss); governed {issued} for {misses} ({rate:.2}), {} list entries cut in all, cap {} pages",
        governed[1].0.prefetch_cut, governed[1].1
    );
    assert_eq!(free[1].0.prefetch_cut, 0, "the governor is off");
    assert_eq!(free[1].1, PageList::CAPACITY, "the governor is off");
    assert!(governed[1].0.prefetch_cut > 0, "nothing cut from a prefetcher guessing wrong");
    assert!(governed[1].1 <= 2, "the cap stayed at {} pages a call", governed[1].1);
    // A cap of one page a call: at most one prefetch per miss (a rare prefetch hit asks too).
    assert!(rate <= 1.05, "the governor's cap did not come down to a page a call: {rate:.2} prefetches a miss");
    assert!(
        rate * 1.2 < free_rate,
        "the governor cut few prefetches: {rate:.2} a miss against {free_rate:.2} without it"
    );
    // In order, the next 7 pages are what the program reads next: nothing to cut.
    let (sequential, cap) = fastswap_reads(true, &[false], 4 * 4 * 1024).remove(0);
    eprintln!(
        "sequential: {} prefetches for {} critical reads, samples used {} of {}",
        sequential.prefetch_issued,
        sequential.critical_reads,
        sequential.prefetch_sample_used,
        sequential.prefetch_sample_used + sequential.prefetch_sample_unused
    );
    assert!(sequential.prefetch_sample_used >= 16, "too few samples to judge by");
    assert_eq!(sequential.prefetch_cut, 0, "the governor cut a prefetcher that guesses right");
    assert_eq!(cap, PageList::CAPACITY);
}

#[test]
fn the_prefetch_governor_lifts_its_cap_once_the_guesses_come_right_again() {
    let _serial = serial();
    if features_or_skip("the_prefetch_governor_lifts_its_cap_once_the_guesses_come_right_again").is_none() {
        return;
    }
    // Random reads bring the cap down to a page or two a call; then passes in order, where the
    // next 7 pages are right: used samples double the cap back to a whole list.
    let after = fastswap_reads(true, &[true, true, false, false, false, false], 16_384);
    let caps: Vec<usize> = after.iter().map(|(_, cap)| *cap).collect();
    let samples: Vec<(u64, u64)> =
        after.iter().map(|(s, _)| (s.prefetch_sample_used, s.prefetch_sample_unused)).collect();
    eprintln!("cap after each phase {caps:?}; samples (used, unused) {samples:?}");
    assert!(caps[1] <= 2, "the random phase did not bring the cap down: {caps:?}");
    assert_eq!(caps[5], PageList::CAPACITY, "the cap stayed down after the guesses came right: {caps:?}");
}

#[test]
fn belady_is_refused_live_as_offline_only() {
    let cfg = EngineConfig { replace: "belady".into(), ..EngineConfig::default() };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("offline-only") && e.contains("tiermem sim"), "{e}");
    for p in PREFETCHERS {
        let cfg = EngineConfig { prefetch: p.to_string(), replace: "stream-first".into(), ..EngineConfig::default() };
        assert!(cfg.validate().is_ok(), "{p}");
    }
}

#[test]
fn the_trace_sink_records_every_fault_in_the_binary_format() {
    let _serial = serial();
    if features_or_skip("the_trace_sink_records_every_fault_in_the_binary_format").is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("faults.tmtrace");
    let device = devices(LIMIT_PAGES * 4 * 4096 * 2).remove(0).1;
    let pages = (LIMIT_PAGES * 4) as usize;
    let first_page;
    {
        let engine = engine(device, LIMIT_PAGES, |c| {
            c.trace_path = Some(path.clone());
            c.prefetch = "none".into();
        });
        let region = engine.create_region(pages * 4096).unwrap();
        let base = region.as_ptr() as usize;
        first_page = (base / 4096) as u64;
        for page in 0..pages {
            // SAFETY: inside the region, which lives until the end of this block.
            unsafe { ((base + page * 4096) as *mut u64).write_volatile(page as u64 + 1) };
        }
        for page in 0..pages {
            // SAFETY: as above.
            assert_eq!(unsafe { ((base + page * 4096) as *const u64).read_volatile() }, page as u64 + 1);
        }
        drop(region);
    }
    let mut records = trace_records(&path);
    // The region's end is the last record: a discard of all its pages (they hold nothing now).
    let last = records.pop().expect("records");
    assert_eq!(last & 3, 3, "a compute-kind record");
    assert_eq!(tiermem_monitor::trace_format::split_discard(last >> 2), Some((first_page, pages as u64)));
    // Records hold virtual page numbers.
    let index = |r: u64| (r >> 2).wrapping_sub(first_page);
    assert!(records.iter().all(|&r| index(r) < pages as u64 && r & 3 < 2), "pages of the region, reads/writes");
    assert!(records.iter().any(|&r| r & 3 == 1), "the first pass wrote");
    let read_back: std::collections::HashSet<u64> =
        records.iter().filter(|&&r| r & 3 == 0).map(|&r| index(r)).collect();
    assert!(read_back.len() as u64 >= pages as u64 - LIMIT_PAGES, "the read pass faulted on the evicted pages");
}
