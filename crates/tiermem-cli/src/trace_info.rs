//! `tiermem trace info`: what a trace holds (events by kind, footprint, how its accesses follow
//! each other), before choosing what to simulate.

use std::path::PathBuf;

use clap::Args;
use tiermem_sim::trace::Format;
use tiermem_sim::TraceSummary;
use tiermem_sys::Result;

/// Arguments of `tiermem trace info`.
#[derive(Debug, Args)]
pub struct TraceInfoArgs {
    /// Trace file, in any format `tiermem sim` reads (`-`: standard input, with --format).
    pub trace: PathBuf,
    /// Trace format: auto, binary, lackey, pages.
    #[arg(long, default_value = "auto")]
    pub format: String,
    #[command(flatten)]
    pub lines: crate::sim::LineArgs,
    /// Also LRU's faults at these memory sizes (pages or % of the footprint, comma-separated),
    /// all from one pass over the trace (stack distances), without simulating each.
    #[arg(long, value_delimiter = ',')]
    pub lru: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `tiermem trace info`.
pub fn run(args: &TraceInfoArgs) -> Result<()> {
    let lines = args.lines.options()?;
    let trace = tiermem_sim::load(&args.trace, args.format.parse::<Format>()?, &lines)?;
    let summary = tiermem_sim::summarize(&trace.events);
    let footprint = summary.footprint_pages as usize;
    let sizes =
        args.lru.iter().map(|text| crate::sim::parse_local("--lru", text, footprint)).collect::<Result<Vec<_>>>()?;
    let curve = (!sizes.is_empty()).then(|| tiermem_sim::LruCurve::measure(&trace.events));
    let lru: Vec<LruPoint> = curve.map_or_else(Vec::new, |curve| {
        sizes
            .iter()
            .map(|&pages| {
                let faults = curve.faults(pages);
                LruPoint {
                    local_pages: pages,
                    faults,
                    faults_per_access: faults as f64 / summary.accesses().max(1) as f64,
                }
            })
            .collect()
    });
    if args.json {
        let out = serde_json::json!({
            "trace": args.trace.display().to_string(),
            "raw_accesses": trace.raw_accesses,
            "summary": summary,
            "lru": lru,
        });
        println!("{out}");
        return Ok(());
    }
    print!("{}", describe(&args.trace.display().to_string(), trace.raw_accesses, &summary));
    for p in &lru {
        println!(
            "  LRU at {} pages ({:.0}%): {} faults, {:.4} an access",
            p.local_pages,
            p.local_pages as f64 * 100.0 / footprint.max(1) as f64,
            p.faults,
            p.faults_per_access
        );
    }
    Ok(())
}

/// LRU's faults at one memory size.
#[derive(Debug, serde::Serialize)]
struct LruPoint {
    local_pages: usize,
    faults: u64,
    faults_per_access: f64,
}

/// The summary as a few lines of text.
fn describe(name: &str, raw_accesses: u64, s: &TraceSummary) -> String {
    let share = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 * 100.0 / of as f64 };
    let mut out = format!(
        "{name}: {} events: {} reads, {} writes, {} reports, {} cache hits in compute events\n",
        s.events, s.reads, s.writes, s.reports, s.cached_accesses
    );
    if raw_accesses > 0 {
        out += &format!("  from {raw_accesses} byte-level accesses through the LLC filter\n");
    }
    if s.discarded_pages > 0 {
        out += &format!("  {} pages given back by the program (discard records)\n", s.discarded_pages);
    }
    match (s.lowest_page, s.highest_page) {
        (Some(lo), Some(hi)) => {
            out += &format!(
                "  footprint {} pages ({:.1} MiB), pages {lo:#x}..={hi:#x}; {} used once ({:.1}%); {:.1} accesses a page\n",
                s.footprint_pages,
                s.footprint_pages as f64 / 256.0,
                s.pages_used_once,
                share(s.pages_used_once, s.footprint_pages),
                s.accesses() as f64 / s.footprint_pages as f64
            );
            let after_first = s.accesses().saturating_sub(1);
            out += &format!(
                "  each access against the one before: next page {:.1}%, same page {:.1}%, page before {:.1}%, elsewhere {:.1}%\n",
                share(s.next_page, after_first),
                share(s.same_page, after_first),
                share(s.previous_page, after_first),
                share(s.elsewhere, after_first)
            );
        }
        _ => out += "  no page is read or written\n",
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_description_gives_shares_of_the_accesses_after_the_first() {
        let s = TraceSummary {
            events: 5,
            reads: 4,
            writes: 1,
            footprint_pages: 4,
            lowest_page: Some(1),
            highest_page: Some(9),
            pages_used_once: 3,
            next_page: 2,
            same_page: 1,
            elsewhere: 1,
            ..TraceSummary::default()
        };
        let text = describe("t", 0, &s);
        assert!(text.contains("5 events: 4 reads, 1 writes"), "{text}");
        assert!(
            text.contains("footprint 4 pages (0.0 MiB), pages 0x1..=0x9; 3 used once (75.0%); 1.2 accesses a page"),
            "{text}"
        );
        assert!(text.contains("next page 50.0%, same page 25.0%, page before 0.0%, elsewhere 25.0%"), "{text}");
        assert!(!text.contains("byte-level"), "{text}");
        assert!(describe("t", 0, &TraceSummary::default()).contains("no page is read or written"));
    }
}
