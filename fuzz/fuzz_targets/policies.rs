//! Every prefetcher × replacement pair driven the way the engine drives them, by arbitrary
//! operations: faults and monitor reports in regions of any size, inserts of pages that became
//! resident, uses, victim picks with arbitrary referenced bits, victims handed back. The
//! policies run inside programs (a panic aborts the program), so none may panic or overflow, a
//! prefetcher never names a page past its region, and a replacement policy proposes only pages
//! it was given and still holds, each once.
#![no_main]

use std::collections::HashSet;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tiermem_policy::stream::StreamConfig;
use tiermem_policy::{
    build_policies, page_id, split_page_id, FaultInfo, PageList, PolicyOptions, PREFETCHERS, REPLACEMENTS,
};

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let prefetch = *u.choose(PREFETCHERS)?;
    let replace = *u.choose(REPLACEMENTS)?;
    let capacity = u.int_in_range(1..=96usize)?;
    let stream = StreamConfig {
        entries: u.int_in_range(1..=256)?,
        history: u.int_in_range(3..=16)?,
        join_distance: *u.choose(&[1, 2, 63, 64, 65, 1 << 20, 1 << 63, u64::MAX])?,
        distance: *u.choose(&[1, 2, 100, 1 << 30, 1 << 62, u64::MAX])?,
        depth: u.int_in_range(1..=PageList::CAPACITY)?,
        ramp: *u.choose(&[0, 1, 4, 100, 1 << 40, u64::MAX])?,
    };
    if stream.validate().is_err() {
        return Ok(());
    }
    let dense_pages = *u.choose(&[0u64, 64, 4096])?;
    let options = PolicyOptions { stream, dense_pages };
    let pair = build_policies(prefetch, replace, capacity, &options).expect("listed names build");
    // Regions of any size the engine allows: one page up to 2^40 - 1 pages.
    let regions: Vec<u64> = (0..u.int_in_range(1..=4)?)
        .map(|_| u.choose(&[1u64, 2, 7, 64, 1000, 1 << 20, (1 << 40) - 1]).copied())
        .collect::<Result<_>>()?;
    let mut resident: HashSet<u64> = HashSet::new();
    let mut out = PageList::default();
    let mut last = (0u32, 0u64);
    while !u.is_empty() {
        let region = u.int_in_range(0..=regions.len() as u32 - 1)?;
        let region_pages = regions[region as usize];
        // Pages near the last one as often as anywhere, so streams form.
        let page = if u.arbitrary()? {
            let step = u.int_in_range(-9i64..=9)?;
            (last.1 as i64 + step).clamp(0, region_pages as i64 - 1) as u64
        } else {
            u.int_in_range(0..=region_pages - 1)?
        };
        match u.int_in_range(0..=5u8)? {
            0 | 1 => {
                let fault = FaultInfo {
                    region,
                    page,
                    region_pages,
                    write: u.arbitrary()?,
                    hit: u.arbitrary()?,
                    offset: u.int_in_range(0..=4095)?,
                };
                out.clear();
                pair.prefetcher.on_fault(&fault, &mut out);
                if pair.prefetcher.spans_regions() {
                    check_page_ids(&out, region, region_pages, prefetch);
                } else {
                    check_prefetches(&out, region_pages, prefetch);
                }
            }
            2 => {
                out.clear();
                pair.prefetcher.on_report(region, page, region_pages, &mut out);
                check_prefetches(&out, region_pages, prefetch);
            }
            3 => {
                let id = page_id(region, page);
                if !resident.contains(&id) && resident.len() < capacity {
                    pair.replacement.on_insert(id);
                    resident.insert(id);
                }
            }
            4 => {
                let id = page_id(region, page);
                if resident.contains(&id) {
                    pair.replacement.on_access(id);
                }
            }
            _ => {
                let max = u.int_in_range(1..=PageList::CAPACITY)?;
                let referenced: u64 = u.arbitrary()?;
                let is_referenced = |id: u64| referenced >> (id % 64) & 1 == 1;
                out.clear();
                pair.replacement.pick_victims(max, &is_referenced, &mut out);
                assert!(out.len() <= max, "{replace}: {} victims asked for at most {max}", out.len());
                for &victim in out.as_slice() {
                    assert!(
                        resident.remove(&victim),
                        "{replace}: victim {victim:#x} is not a page it holds (or named twice)"
                    );
                }
                // The engine hands back a victim it could not evict.
                if let Some(&back) = out.as_slice().first() {
                    if u.arbitrary()? {
                        pair.replacement.on_insert(back);
                        resident.insert(back);
                    }
                }
            }
        }
        last = (region, page);
    }
    Ok(())
}

/// Page ids of any region (the engine skips regions it does not have), but never past the end
/// of the faulting one.
fn check_page_ids(out: &PageList, region: u32, region_pages: u64, prefetch: &str) {
    for &id in out.as_slice() {
        let (r, p) = split_page_id(id);
        assert!(r != region || p < region_pages, "{prefetch}: prefetch of page {p} in a region of {region_pages} pages");
    }
}

fn check_prefetches(out: &PageList, region_pages: u64, prefetch: &str) {
    for &p in out.as_slice() {
        assert!(p < region_pages, "{prefetch}: prefetch of page {p} in a region of {region_pages} pages");
    }
}
