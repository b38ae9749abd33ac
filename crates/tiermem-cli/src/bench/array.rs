//! The §4.2 array microbenchmark: write every byte of an array once, then read every byte back and
//! verify it, timing each 4 KiB page of both passes.
//!
//! The array is given as a raw address range so the same code runs on plain anonymous memory (the
//! Linux-swap baseline, where the kernel pages) and on a tiermem engine region (where tiermem
//! pages). Single-threaded, pages in address order, as in the paper.

use std::time::Instant;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tiermem_sys::PAGE_SIZE;

/// 64-bit words per page; the pattern is written and checked a word at a time.
pub const WORDS_PER_PAGE: usize = PAGE_SIZE / std::mem::size_of::<u64>();

/// Mixed into every pattern word so that a zero-filled page (a page the kernel or engine lost and
/// replaced with a fresh one) never verifies.
const PATTERN_SALT: u64 = 0x9E37_79B9_7F4A_7C15;

/// The progress callback is invoked once per this many pages (outside the timed region); a power of two.
const PROGRESS_INTERVAL_PAGES: usize = 256;

/// Largest latency the histograms track: one minute per page is already pathological.
const HISTOGRAM_MAX_NS: u64 = 60_000_000_000;

/// Which pass of the benchmark is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Writing the pattern into every page (forces page-out under a memory limit).
    Write,
    /// Reading back and verifying every page (forces page-in).
    Read,
}

/// Per-page latency statistics of one pass.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    /// Sum of the per-page times (time spent outside page accesses is not included).
    pub total_ns: u64,
    /// Mean time per page.
    pub mean_ns: f64,
    /// Median time per page (histogram resolution: 3 significant digits).
    pub p50_ns: u64,
    /// 99th-percentile time per page (histogram resolution: 3 significant digits).
    pub p99_ns: u64,
    /// Slowest page, exact.
    pub max_ns: u64,
    /// Major page faults of the whole process during the pass (getrusage `ru_majflt`); for plain
    /// memory under a cgroup limit these are swap-ins.
    pub major_faults: u64,
    /// Minor page faults of the whole process during the pass (getrusage `ru_minflt`).
    pub minor_faults: u64,
}

impl PhaseStats {
    /// Mean time per page in microseconds.
    pub fn per_page_us(&self) -> f64 {
        self.mean_ns / 1_000.0
    }

    /// Median time per page in microseconds.
    pub fn p50_us(&self) -> f64 {
        self.p50_ns as f64 / 1_000.0
    }

    /// 99th-percentile time per page in microseconds.
    pub fn p99_us(&self) -> f64 {
        self.p99_ns as f64 / 1_000.0
    }

    /// Slowest page in microseconds.
    pub fn max_us(&self) -> f64 {
        self.max_ns as f64 / 1_000.0
    }
}

/// What the read pass found besides its timings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReadOutcome {
    /// Timings of the read pass.
    pub stats: PhaseStats,
    /// Pages whose contents differed from the written pattern in at least one word.
    pub mismatched_pages: u64,
    /// Index of the first mismatching page, for debugging.
    pub first_mismatched_page: Option<u64>,
}

/// The result of one benchmark run; printed as JSON by `tiermem micro-worker`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ArrayResult {
    /// Number of 4 KiB pages in the array.
    pub pages: u64,
    /// The write pass.
    pub write: PhaseStats,
    /// The read-and-verify pass.
    pub read: PhaseStats,
    /// Pages whose contents did not survive the round trip.
    pub mismatched_pages: u64,
    /// Index of the first mismatching page, if any.
    pub first_mismatched_page: Option<u64>,
}

impl ArrayResult {
    /// Mean write latency per page in microseconds.
    pub fn write_per_page_us(&self) -> f64 {
        self.write.per_page_us()
    }

    /// Mean read-and-verify latency per page in microseconds.
    pub fn read_per_page_us(&self) -> f64 {
        self.read.per_page_us()
    }
}

/// The pattern word at `word_index` of page `page_index`: cheap to compute, unique per word of the
/// array, so a page written to or read from the wrong place is caught as well as a corrupted one.
#[inline]
pub fn pattern_word(page_index: usize, word_index: usize) -> u64 {
    (((page_index as u64) << 9) | word_index as u64) ^ PATTERN_SALT
}

/// Fill one page (as words) with its pattern.
///
/// # Panics
/// If `words` is not exactly one page long.
pub fn fill_page(words: &mut [u64], page_index: usize) {
    assert_eq!(words.len(), WORDS_PER_PAGE, "fill_page takes exactly one page");
    // SAFETY: `words` is a live exclusive borrow of exactly one page of u64s.
    unsafe { fill_page_raw(words.as_mut_ptr(), page_index) }
}

/// Whether one page (as words) holds its pattern.
///
/// # Panics
/// If `words` is not exactly one page long.
pub fn page_matches(words: &[u64], page_index: usize) -> bool {
    assert_eq!(words.len(), WORDS_PER_PAGE, "page_matches takes exactly one page");
    // SAFETY: `words` is a live borrow of exactly one page of u64s.
    unsafe { page_matches_raw(words.as_ptr(), page_index) }
}

/// # Safety
/// `page` must be valid for writes of [`WORDS_PER_PAGE`] aligned u64s.
#[inline]
unsafe fn fill_page_raw(page: *mut u64, page_index: usize) {
    // Raw-pointer writes rather than a slice: the memory may be a userfaultfd region whose pages
    // another thread installs, so no Rust reference to it is ever created here.
    for word_index in 0..WORDS_PER_PAGE {
        // SAFETY: word_index < WORDS_PER_PAGE, inside the page the caller vouched for.
        unsafe { page.wrapping_add(word_index).write(pattern_word(page_index, word_index)) };
    }
}

/// # Safety
/// `page` must be valid for reads of [`WORDS_PER_PAGE`] aligned u64s.
#[inline]
unsafe fn page_matches_raw(page: *const u64, page_index: usize) -> bool {
    // Accumulate differences instead of returning early so that every byte of the page is read
    // (the benchmark times reading the whole page) and the loop stays branch-free.
    let mut difference = 0u64;
    for word_index in 0..WORDS_PER_PAGE {
        // SAFETY: word_index < WORDS_PER_PAGE, inside the page the caller vouched for.
        let word = unsafe { page.wrapping_add(word_index).read() };
        difference |= word ^ pattern_word(page_index, word_index);
    }
    difference == 0
}

/// Major and minor fault counts of this process so far.
fn fault_counts() -> (u64, u64) {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a complete `rusage` into the buffer we own; RUSAGE_SELF is valid.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if rc != 0 {
        return (0, 0);
    }
    // SAFETY: getrusage succeeded, so the struct is initialised (it was zeroed before, too).
    let usage = unsafe { usage.assume_init() };
    (usage.ru_majflt as u64, usage.ru_minflt as u64)
}

/// Per-page timing collector for one pass.
struct PhaseTimer {
    histogram: Histogram<u64>,
    total_ns: u64,
    max_ns: u64,
    pages: u64,
    faults_before: (u64, u64),
}

impl PhaseTimer {
    fn start() -> Self {
        let histogram = Histogram::new_with_bounds(1, HISTOGRAM_MAX_NS, 3).expect("static histogram bounds are valid");
        Self { histogram, total_ns: 0, max_ns: 0, pages: 0, faults_before: fault_counts() }
    }

    #[inline]
    fn record(&mut self, ns: u64) {
        self.histogram.saturating_record(ns.max(1));
        self.total_ns += ns;
        self.max_ns = self.max_ns.max(ns);
        self.pages += 1;
    }

    fn finish(self) -> PhaseStats {
        let (major_after, minor_after) = fault_counts();
        let mean_ns = if self.pages == 0 { 0.0 } else { self.total_ns as f64 / self.pages as f64 };
        PhaseStats {
            total_ns: self.total_ns,
            mean_ns,
            p50_ns: self.histogram.value_at_quantile(0.50),
            p99_ns: self.histogram.value_at_quantile(0.99),
            max_ns: self.max_ns,
            major_faults: major_after.saturating_sub(self.faults_before.0),
            minor_faults: minor_after.saturating_sub(self.faults_before.1),
        }
    }
}

fn check_range(base: *mut u8, len: usize) -> usize {
    // Masks rather than `%`: both are powers of two, and `is_multiple_of` is newer than our MSRV.
    assert!(base as usize & (std::mem::align_of::<u64>() - 1) == 0, "array base {base:p} is not 8-byte aligned");
    assert!(len & (PAGE_SIZE - 1) == 0, "array length {len} is not a multiple of {PAGE_SIZE}");
    len / PAGE_SIZE
}

fn report_progress(progress: Option<&dyn Fn(Phase, usize)>, phase: Phase, pages_done: usize, pages: usize) {
    if let Some(progress) = progress {
        if pages_done & (PROGRESS_INTERVAL_PAGES - 1) == 0 || pages_done == pages {
            progress(phase, pages_done);
        }
    }
}

/// The write pass: fill every page with its pattern, in order, timing each page.
///
/// `progress` is called with the number of pages done every 256 pages and at the end, outside the
/// timed region.
///
/// # Safety
/// `[base, base + len)` must be mapped, writable memory that nothing else accesses during the call;
/// `base` must be 8-byte aligned and `len` a multiple of the page size (both are asserted).
pub unsafe fn write_phase(base: *mut u8, len: usize, progress: Option<&dyn Fn(Phase, usize)>) -> PhaseStats {
    let pages = check_range(base, len);
    let mut timer = PhaseTimer::start();
    for page_index in 0..pages {
        // SAFETY: page_index < pages, so the page lies inside the caller's range.
        let page = unsafe { base.add(page_index * PAGE_SIZE) }.cast::<u64>();
        let started = Instant::now();
        // SAFETY: one whole, aligned page inside the caller's exclusively owned range.
        unsafe { fill_page_raw(page, page_index) };
        // Keep the stores from being sunk past the second clock read.
        std::hint::black_box(page);
        timer.record(started.elapsed().as_nanos() as u64);
        report_progress(progress, Phase::Write, page_index + 1, pages);
    }
    timer.finish()
}

/// The read pass: read every page, in order, and compare it with its pattern, timing each page.
///
/// # Safety
/// As for [`write_phase`] (readable instead of writable).
pub unsafe fn read_phase(base: *mut u8, len: usize, progress: Option<&dyn Fn(Phase, usize)>) -> ReadOutcome {
    let pages = check_range(base, len);
    let mut timer = PhaseTimer::start();
    let mut mismatched_pages = 0u64;
    let mut first_mismatched_page = None;
    for page_index in 0..pages {
        // SAFETY: page_index < pages, so the page lies inside the caller's range.
        let page = unsafe { base.add(page_index * PAGE_SIZE) }.cast::<u64>().cast_const();
        let started = Instant::now();
        // SAFETY: one whole, aligned page inside the caller's range, not written concurrently.
        let matches = unsafe { page_matches_raw(page, page_index) };
        let matches = std::hint::black_box(matches);
        timer.record(started.elapsed().as_nanos() as u64);
        if !matches {
            mismatched_pages += 1;
            first_mismatched_page.get_or_insert(page_index as u64);
        }
        report_progress(progress, Phase::Read, page_index + 1, pages);
    }
    ReadOutcome { stats: timer.finish(), mismatched_pages, first_mismatched_page }
}

/// Run the whole benchmark on `[base, base + len)`: the write pass, then the read-and-verify pass.
///
/// # Safety
/// `[base, base + len)` must be mapped, readable and writable memory that nothing else accesses
/// during the call (a pager servicing its faults is fine); `base` must be 8-byte aligned and `len`
/// a multiple of the 4 KiB page size (both are asserted). Its previous contents are overwritten.
pub unsafe fn run_array_bench(base: *mut u8, len: usize, progress: Option<&dyn Fn(Phase, usize)>) -> ArrayResult {
    // SAFETY: forwarded to the caller.
    let write = unsafe { write_phase(base, len, progress) };
    // SAFETY: forwarded to the caller.
    let read = unsafe { read_phase(base, len, progress) };
    ArrayResult {
        pages: (len / PAGE_SIZE) as u64,
        write,
        read: read.stats,
        mismatched_pages: read.mismatched_pages,
        first_mismatched_page: read.first_mismatched_page,
    }
}
