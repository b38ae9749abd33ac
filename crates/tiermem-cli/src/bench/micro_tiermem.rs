//! The tiermem side of the §4.2 microbenchmark, and the side-by-side table with Linux swap.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tiermem_device::{BufferArena, Device, DeviceSpec, QueueKind, Request};
use tiermem_engine::stats::PathStats;
use tiermem_engine::{Engine, EngineConfig, IoMode, StatsSnapshot};
use tiermem_sys::{Error, Result};

use super::array::{run_array_bench, ArrayResult};

/// One configuration of tiermem measured by the microbenchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Variant {
    /// File device, Ultraswap I/O path: faulting page polled, prefetch and write-back completion-driven.
    File,
    /// File device, everything polled (§4.4.1 "poll-only").
    FilePollOnly,
    /// File device, everything completion-driven (§4.4.1 "interrupt-only").
    FileInterruptOnly,
    /// DRAM device: the ideal.
    Mem,
}

impl Variant {
    /// Name in tables and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Variant::File => "tiermem-file",
            Variant::FilePollOnly => "tiermem-file-poll-only",
            Variant::FileInterruptOnly => "tiermem-file-interrupt-only",
            Variant::Mem => "tiermem-mem",
        }
    }

    fn io_mode(self) -> IoMode {
        match self {
            Variant::FilePollOnly => IoMode::PollOnly,
            Variant::FileInterruptOnly => IoMode::InterruptOnly,
            Variant::File | Variant::Mem => IoMode::Hybrid,
        }
    }
}

/// What one tiermem run measured.
#[derive(Debug, Clone, Serialize)]
pub struct TiermemPoint {
    /// Which configuration.
    pub variant: Variant,
    /// How the engine ran.
    pub engine: String,
    /// The array benchmark's per-page timings.
    pub array: ArrayResult,
    /// The engine's counters and per-path latencies.
    pub stats: StatsSnapshot,
}

/// Open the device a variant pages to: an unnamed file in `dir`, written with zeros as the swap
/// file is (gone with the device, or with the process however it ends), or DRAM.
fn open_device(variant: Variant, dir: &Path, capacity: u64) -> Result<Arc<dyn Device>> {
    if variant == Variant::Mem {
        return DeviceSpec::Mem.open(capacity);
    }
    Ok(Arc::new(tiermem_device::FileDevice::create_temporary_zeroed(dir, capacity)?))
}

/// Run the array benchmark under tiermem: `size_mb` MiB managed with a `limit_mb` MiB budget.
pub fn tiermem_point(
    variant: Variant,
    size_mb: u64,
    limit_mb: u64,
    dir: &Path,
    base: &EngineConfig,
    progress: Option<&dyn Fn(super::array::Phase, usize)>,
) -> Result<TiermemPoint> {
    let bytes = size_mb << 20;
    let device = open_device(variant, dir, bytes + (bytes / 4).max(16 << 20))?;
    let config = EngineConfig { limit_bytes: limit_mb << 20, io_mode: variant.io_mode(), ..base.clone() };
    let engine = Engine::new(config, device)?;
    let region = engine.create_region(bytes as usize)?;
    // SAFETY: the region is `bytes` long, page-aligned, and nothing else uses it.
    let array = unsafe { run_array_bench(region.as_ptr(), region.len(), progress) };
    let stats = engine.stats();
    let describe = engine.describe();
    drop(region);
    Ok(TiermemPoint { variant, engine: describe, array, stats })
}

/// Mean µs of single 4 KiB reads through a polled queue of a fresh device file in `dir`: the
/// device's own latency, the floor for the critical-fault path.
pub fn device_read_latency_us(dir: &Path, samples: u32) -> Result<f64> {
    let mut reader = SlotReader::new(dir)?;
    let started = Instant::now();
    for _ in 0..samples {
        reader.read_next()?;
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / f64::from(samples))
}

/// 4 KiB reads a second of random slots of a fresh 64 MiB device file in `dir`, `depth` of them
/// in flight at once on a completion-driven queue, as prefetches go: the request rate the disk
/// serves. For 4 KiB pages that rate, more than its bandwidth, is what paging can use up (the
/// application benchmark's *Disk requests* are read against it).
pub fn device_read_rate(dir: &Path, depth: u32, reads: u32) -> Result<f64> {
    let device = open_device(Variant::File, dir, 64 << 20)?;
    let arena = Arc::new(BufferArena::new(depth)?);
    let mut queue = device.open_queue(QueueKind::Completion, depth, &arena)?;
    let bufs = (0..depth)
        .map(|_| arena.alloc())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::new(tiermem_sys::ErrorKind::Internal, "an arena smaller than the queue depth"))?;
    let slots = device.capacity_slots();
    write_every_slot(&mut *queue, bufs[0], slots, u64::from(depth))?;
    let mut random = RandomSlots::new(slots);
    let started = Instant::now();
    let mut issued = 0;
    for (tag, &buf) in bufs.iter().enumerate().take(reads as usize) {
        queue.push(Request::Read { slot: random.next(), buf }, tag as u64)?;
        issued += 1;
    }
    queue.submit()?;
    let (mut done, mut finished) = (0, Vec::with_capacity(depth as usize));
    while done < reads {
        let mut failed = None;
        queue.wait(1, &mut |c| {
            if let Err(e) = c.result {
                failed.get_or_insert(e);
            }
            finished.push(c.tag);
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        done += finished.len() as u32;
        for tag in finished.drain(..) {
            if issued < reads {
                queue.push(Request::Read { slot: random.next(), buf: bufs[tag as usize] }, tag)?;
                issued += 1;
            }
        }
        queue.submit()?;
    }
    Ok(f64::from(reads) / started.elapsed().as_secs_f64())
}

/// Write `buf` to every slot, up to `depth` at a time, so that reads hit allocated blocks as
/// evicted pages do (a block never written reads as zeros without reaching the disk).
fn write_every_slot(
    queue: &mut dyn tiermem_device::IoQueue,
    buf: tiermem_device::BufId,
    slots: u64,
    depth: u64,
) -> Result<()> {
    let mut slot = 0;
    while slot < slots {
        let n = depth.min(slots - slot);
        for s in slot..slot + n {
            queue.push(Request::Write { slot: s, buf }, s)?;
        }
        queue.submit()?;
        let mut failed = None;
        queue.wait(n as usize, &mut |c| {
            if let Err(e) = c.result {
                failed.get_or_insert(e);
            }
        })?;
        if let Some(e) = failed {
            return Err(e);
        }
        slot += n;
    }
    Ok(())
}

/// Slots of a device in a fixed pseudo-random order (xorshift), the same in every run.
struct RandomSlots {
    state: u64,
    slots: u64,
}

impl RandomSlots {
    fn new(slots: u64) -> Self {
        Self { state: 0x2545_f491_4f6c_dd1d, slots }
    }

    fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state % self.slots
    }
}

/// Random single-slot reads from a 64 MiB temporary device file in `dir` through a polled
/// queue, into one buffer: what a critical fault's read is.
struct SlotReader {
    arena: Arc<BufferArena>,
    queue: Box<dyn tiermem_device::IoQueue>,
    buf: tiermem_device::BufId,
    random: RandomSlots,
    // Kept open for the queue (the device file goes when it drops).
    _device: Arc<dyn Device>,
}

impl SlotReader {
    fn new(dir: &Path) -> Result<Self> {
        let device = open_device(Variant::File, dir, 64 << 20)?;
        let arena = Arc::new(BufferArena::new(16)?);
        let mut queue = device.open_queue(QueueKind::Polled, 4, &arena)?;
        let buf = arena.alloc().ok_or_else(|| Error::new(tiermem_sys::ErrorKind::Internal, "empty arena"))?;
        arena.bytes_mut(buf).fill(0x5a);
        write_every_slot(&mut *queue, buf, device.capacity_slots(), 1)?;
        let random = RandomSlots::new(device.capacity_slots());
        Ok(Self { arena, queue, buf, random, _device: device })
    }

    /// Read a random slot into the buffer and wait for it.
    fn read_next(&mut self) -> Result<()> {
        self.queue.push(Request::Read { slot: self.random.next(), buf: self.buf }, 0)?;
        self.queue.submit()?;
        self.queue.wait(1, &mut |_| {})?;
        Ok(())
    }
}

/// Mean µs of UFFDIO_COPY of a 4 KiB page into a fresh registered mapping from a buffer the
/// device in `dir` has just read into, as a critical fault maps its page: its source is not in
/// the CPU's caches then, so it costs more than [`page_map_latency_us`], whose source is.
pub fn page_map_after_read_us(dir: &Path, pages: usize) -> Result<f64> {
    let mut reader = SlotReader::new(dir)?;
    mean_copy_us(pages, "UFFDIO_COPY from a buffer just read", || {
        reader.read_next()?;
        Ok(reader.arena.ptr(reader.buf).cast_const())
    })
}

/// Mean µs of one UFFDIO_COPY of a 4 KiB page into a fresh registered mapping: the kernel's
/// part of every page-in (allocating, charging, copying and mapping the page), which no engine
/// work can remove. Measured on its own so the engine share of a critical fault can be read
/// against it.
pub fn page_map_latency_us(pages: usize) -> Result<f64> {
    let source = vec![0x5au8; tiermem_sys::PAGE_SIZE];
    mean_copy_us(pages, "UFFDIO_COPY of a fresh page", || Ok(source.as_ptr()))
}

/// Map `pages` fresh pages of a registered mapping with one UFFDIO_COPY each, from the page
/// `next_source` gives before each copy (that call is not timed); the mean µs of a copy.
/// `next_source` must return a readable page that nothing writes until its next call.
fn mean_copy_us(pages: usize, what: &str, mut next_source: impl FnMut() -> Result<*const u8>) -> Result<f64> {
    use tiermem_sys::uffd::{Features, RegisterMode, Uffd};
    let uffd = Uffd::open(Features::empty(), true)?;
    let target = tiermem_sys::mem::Mapping::anonymous(pages * tiermem_sys::PAGE_SIZE, false)?;
    uffd.register(target.as_ptr(), target.len(), RegisterMode { missing: true, write_protect: false })?;
    let mut copying = std::time::Duration::ZERO;
    for page in 0..pages {
        let src = next_source()?;
        let dst = target.as_ptr().wrapping_add(page * tiermem_sys::PAGE_SIZE);
        let started = Instant::now();
        // SAFETY: `src` is one readable page that nothing writes now (the callers' promise);
        // `dst` is a page of `target`, registered above, never touched, and unmapped only when
        // `target` drops after this loop.
        unsafe { uffd.copy(dst, src, tiermem_sys::PAGE_SIZE, false, true) }
            .map_err(|(_, e)| Error::os(e.into(), what.to_string()))?;
        copying += started.elapsed();
    }
    Ok(copying.as_secs_f64() * 1e6 / pages as f64)
}

/// One row of the comparison table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// System name.
    pub system: String,
    /// Write path, mean µs per page.
    pub write_us: f64,
    /// Read path, mean µs per page.
    pub read_us: f64,
    /// Read path, median µs per page.
    pub read_p50_us: f64,
    /// Read path, 99th percentile µs per page.
    pub read_p99_us: f64,
    /// Pages that read back wrong.
    pub mismatched_pages: u64,
    /// Mean µs of a critical fault (tiermem only).
    pub critical_fault_us: Option<f64>,
    /// Mean µs of the device read inside those faults, submission to completion (tiermem only).
    pub critical_read_us: Option<f64>,
    /// Median µs of a critical fault (tiermem only).
    pub critical_fault_p50_us: Option<f64>,
    /// Median µs of the device read inside those faults (tiermem only).
    pub critical_read_p50_us: Option<f64>,
}

impl Row {
    /// A row from an array result.
    pub fn new(system: &str, array: &ArrayResult, stats: Option<&StatsSnapshot>) -> Self {
        Self {
            system: system.into(),
            write_us: array.write_per_page_us(),
            read_us: array.read_per_page_us(),
            read_p50_us: array.read.p50_us(),
            read_p99_us: array.read.p99_us(),
            mismatched_pages: array.mismatched_pages,
            critical_fault_us: stats.and_then(|s| path_us(s, "critical_fault", |p| p.mean_us)),
            critical_read_us: stats.and_then(|s| path_us(s, "critical_read", |p| p.mean_us)),
            critical_fault_p50_us: stats.and_then(|s| path_us(s, "critical_fault", |p| p.p50_us)),
            critical_read_p50_us: stats.and_then(|s| path_us(s, "critical_read", |p| p.p50_us)),
        }
    }
}

/// One figure (`pick`: mean, median) of a timed path that ran at least once.
fn path_us(stats: &StatsSnapshot, path: &str, pick: impl Fn(&PathStats) -> f64) -> Option<f64> {
    stats.paths.iter().find(|p| p.path == path && p.count > 0).map(pick)
}

/// What the kernel alone costs in a critical fault, measured after the runs (each None where not
/// measured): the floor under the engine share the table reports.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct KernelFloor {
    /// UFFDIO_COPY of a fresh page from a cache-hot buffer, mean µs ([`page_map_latency_us`]).
    pub page_map_us: Option<f64>,
    /// The same from a buffer the device has just filled, mean µs ([`page_map_after_read_us`]).
    pub page_map_after_read_us: Option<f64>,
    /// A fault served on the faulting thread by a handler that only maps the page.
    pub fault_round_trip: Option<crate::machine::FaultRoundTrip>,
}

/// The side-by-side table, with speed-ups over Linux swap when it was measured.
pub fn format_table(rows: &[Row], size_mb: u64, limit_mb: u64, device_us: Option<f64>, floor: &KernelFloor) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "array {size_mb} MiB, limit {limit_mb} MiB, per-page µs (mean; read p50/p99):");
    let _ = writeln!(
        s,
        "{:<28} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9} {:>11} {:>11} {:>9}",
        "system",
        "write",
        "read",
        "read p50",
        "read p99",
        "crit fault",
        "of it I/O",
        "write vs LS",
        "read vs LS",
        "bad pages"
    );
    let linux = rows.iter().find(|r| r.system == "linux-swap");
    for r in rows {
        let ratio =
            |ours: f64, theirs: Option<f64>| theirs.map_or("-".to_string(), |t| format!("{:.2}x", t / ours.max(1e-9)));
        let _ = writeln!(
            s,
            "{:<28} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10} {:>9} {:>11} {:>11} {:>9}",
            r.system,
            r.write_us,
            r.read_us,
            r.read_p50_us,
            r.read_p99_us,
            r.critical_fault_us.map_or("-".into(), |v| format!("{v:.2}")),
            r.critical_read_us.map_or("-".into(), |v| format!("{v:.2}")),
            ratio(r.write_us, linux.map(|l| l.write_us)),
            ratio(r.read_us, linux.map(|l| l.read_us)),
            r.mismatched_pages
        );
    }
    if let Some(d) = device_us {
        let _ = writeln!(
            s,
            "device: 4 KiB polled read {d:.2} µs alone, after the runs (this VM's disk drifts by 2x within minutes)"
        );
    }
    let _ = writeln!(
        s,
        "\"of it I/O\" = the critical read at the device, submission to completion, in the same faults: \
         the rest of \"crit fault\" is the engine's own work"
    );
    for r in rows {
        if let (Some(fault), Some(io)) = (r.critical_fault_us, r.critical_read_us) {
            let median = match (r.critical_fault_p50_us, r.critical_read_p50_us) {
                (Some(f), Some(i)) => format!(", {:.2} µs median", f - i),
                _ => String::new(),
            };
            let _ = writeln!(s, "  {}: engine share of a critical fault {:.2} µs mean{median}", r.system, fault - io);
        }
    }
    if let Some(m) = floor.page_map_us {
        let _ = writeln!(
            s,
            "  of which the kernel maps the page: UFFDIO_COPY of a fresh page alone {m:.2} µs (measured after the runs)"
        );
    }
    if let Some(m) = floor.page_map_after_read_us {
        let _ = writeln!(
            s,
            "  the same copy from a buffer the device has just filled (not in the CPU's caches): {m:.2} µs"
        );
    }
    if let Some(trip) = &floor.fault_round_trip {
        let _ = writeln!(s, "  the kernel alone: {}", crate::machine::round_trip_line(trip));
    }
    let _ = writeln!(s, "\"vs LS\" = Linux swap time / this system's time (>1 = faster than Linux swap)");
    s
}
