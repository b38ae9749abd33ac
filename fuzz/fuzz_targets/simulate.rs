//! The simulator on arbitrary page traces with arbitrary settings (local memory, every policy
//! pair including `belady`, monitor input, what hits teach, cleaning ahead and its queue limit,
//! costs): it runs to the end or refuses the settings with an error, never panics or overflows,
//! and its counts add up.
#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tiermem_policy::{PolicyOptions, PREFETCHERS, REPLACEMENTS};
use tiermem_sim::{simulate, FirstTouch, HitInfo, Latency, MonitorInput, SimConfig};

fuzz_target!(|data: &[u8]| {
    let _ = run(&mut Unstructured::new(data));
});

fn run(u: &mut Unstructured<'_>) -> Result<()> {
    let replacements: Vec<&str> = REPLACEMENTS.iter().copied().chain(["belady"]).collect();
    let config = SimConfig {
        local_pages: u.int_in_range(0..=80)?,
        prefetch: u.choose(PREFETCHERS)?.to_string(),
        replace: u.choose(&replacements)?.to_string(),
        options: PolicyOptions { dense_pages: *u.choose(&[0, 16, 4096])?, ..PolicyOptions::default() },
        latency: Latency {
            access_ns: *u.choose(&[0.0, 1.0, 100.0])?,
            cached_access_ns: *u.choose(&[0.0, 1.0])?,
            fault_ns: *u.choose(&[0.0, 2000.0])?,
            read_ns: *u.choose(&[0.0, 6000.0, 1e9])?,
            transfer_ns: *u.choose(&[0.0, 600.0, 1e7])?,
            hit_ns: *u.choose(&[0.0, 1000.0])?,
        },
        monitor: *u.choose(&[MonitorInput::None, MonitorInput::Reports, MonitorInput::Accesses])?,
        hits: *u.choose(&[HitInfo::Full, HitInfo::Engine])?,
        clean_ahead: *u.choose(&[0.0, 0.01, 0.3, 0.99, 1.0, -0.5, f64::NAN])?,
        clean_queue: *u.choose(&[0, 1, 64])?,
        first_touch: *u.choose(&[FirstTouch::Miss, FirstTouch::ZeroFill])?,
    };
    // Pages in a few clusters across the whole page space, every kind of event.
    let bases = [0u64, 1 << 20, (1 << 40) - 64];
    let mut events = Vec::new();
    while !u.is_empty() && events.len() < 4096 {
        let page = u.choose(&bases)? + u.int_in_range(0..=63u64)?;
        let kind = u.int_in_range(0..=4u64)?;
        if kind == 4 {
            // A discard of a few pages (or of none, which a trace file may not hold).
            let pages = u.int_in_range(0..=80u64)?;
            events.extend(tiermem_sim::trace::discard_records(page, pages));
        } else {
            events.push(page << 2 | kind);
        }
    }
    let Ok(result) = simulate(&events, &config, &mut |_| {}) else { return Ok(()) };
    let accesses = events.iter().filter(|&&e| e & 3 < 2).count() as u64;
    assert_eq!(result.accesses, accesses);
    assert!(result.faults + result.zero_fills <= accesses);
    assert!(result.prefetch_hits <= result.prefetch_issued);
    assert!(result.modeled_ns >= 0.0, "modeled time {}", result.modeled_ns);
    Ok(())
}
