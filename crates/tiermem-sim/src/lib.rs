//! The trace simulator: replays page- or cache-line-level traces through local memory of a given
//! size with any prefetcher × replacement pair, using the very policy objects the engine runs
//! (`tiermem-policy`), and reports faults, prefetch accuracy and coverage, timeliness,
//! write-backs and a modeled run time.

pub mod sim;
pub mod summary;
pub mod trace;

pub use sim::{footprint, simulate, FirstTouch, HitInfo, Latency, MonitorInput, SimConfig, SimResult, Simulator};
pub use summary::{summarize, LruCurve, TraceSummary};
pub use trace::{load, Event, EventKind, Format, LineOptions, Synthetic, SyntheticGen, Trace};

/// A plain-text table of results, one row per policy pair (and local memory size, shown in a
/// first column when `with_local`).
pub fn format_table(results: &[SimResult], with_local: bool) -> String {
    // With several local memory sizes, each row starts with its own.
    let local = |text: String| if with_local { format!("{text:>10} ") } else { String::new() };
    // Zero fills only where pages never written were served as such (`FirstTouch::ZeroFill`).
    let zero_fills = results.iter().any(|r| r.zero_fills > 0);
    let zeros = |text: String| if zero_fills { format!(" {text:>10}") } else { String::new() };
    let mut out = local("local".into());
    out += &format!(
        "{:<10} {:<13} {:>10} {:>10}{} {:>10} {:>10} {:>8} {:>8} {:>8} {:>9} {:>10} {:>12}\n",
        "prefetch",
        "replace",
        "accesses",
        "faults",
        zeros("zero fills".into()),
        "issued",
        "hits",
        "accuracy",
        "coverage",
        "late",
        "unused",
        "writebacks",
        "modeled ms"
    );
    for r in results {
        out += &local(r.local_pages.to_string());
        out += &format!(
            "{:<10} {:<13} {:>10} {:>10}{} {:>10} {:>10} {:>7.1}% {:>7.1}% {:>8} {:>9} {:>10} {:>12.3}\n",
            r.prefetch,
            r.replace,
            r.accesses,
            r.faults,
            zeros(r.zero_fills.to_string()),
            r.prefetch_issued,
            r.prefetch_hits,
            r.accuracy * 100.0,
            r.coverage * 100.0,
            r.late_prefetches,
            r.unused_prefetches,
            r.writebacks,
            r.modeled_ns / 1e6
        );
    }
    out
}
