//! An optional record of the faults the engine takes, and of the monitor's reports the
//! prefetcher hears (sequential and hot pages), in the simulator's binary trace format
//! (docs/trace-format.md), so `tiermem sim` can replay what a real program did.
//!
//! Faulting threads (possibly inside the SIGBUS handler) only claim a slot in a preallocated
//! ring with a compare-and-swap and store a word: no allocation, no lock, no system call. A
//! writer thread drains the ring to the file. When the ring is full the record is dropped and
//! counted rather than making a fault wait.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tiermem_monitor::trace_format::{discard_records, record, BinaryWriter, RecordKind};
use tiermem_sys::{Error, Result};

/// Marks a slot holding a record (records use at most 62 bits).
const FULL: u64 = 1 << 63;
/// Records the ring holds between two drains.
const CAPACITY: usize = 1 << 16;

#[derive(Debug)]
struct Ring {
    slots: Box<[AtomicU64]>,
    /// Positions claimed by writers.
    claimed: AtomicU64,
    /// Positions drained by the writer thread.
    drained: AtomicU64,
    dropped: AtomicU64,
    stop: AtomicBool,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct TraceSink {
    ring: Arc<Ring>,
    writer: std::sync::Mutex<Option<JoinHandle<std::io::Result<u64>>>>,
}

impl TraceSink {
    /// Create (truncate) `path` and start the writer thread.
    pub(crate) fn create(path: &Path) -> Result<Self> {
        let file = File::create(path).map_err(|e| Error::os(e, format!("creating trace file {}", path.display())))?;
        let file = tiermem_sys::guarded_fd::Guarded::new(file);
        let mut out = BinaryWriter::new(BufWriter::with_capacity(1 << 20, file), false)
            .map_err(|e| Error::os(e, format!("writing trace file {}", path.display())))?;
        let ring = Arc::new(Ring {
            slots: (0..CAPACITY).map(|_| AtomicU64::new(0)).collect(),
            claimed: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let r = ring.clone();
        // Started before the preload's OOM guard goes on (`tiermem_sys::threads`).
        let writer = tiermem_sys::threads::spawn_running("tiermem-trace", None, move || {
            let mask = CAPACITY as u64 - 1;
            loop {
                let pos = r.drained.load(Ordering::Relaxed);
                let slot = &r.slots[(pos & mask) as usize];
                let word = slot.load(Ordering::Acquire);
                if word & FULL != 0 {
                    out.write_encoded(word & !FULL)?;
                    slot.store(0, Ordering::Relaxed);
                    r.drained.store(pos + 1, Ordering::Release);
                    continue;
                }
                // Nothing ready: either nothing claimed, or a writer is between its claim
                // and its store (a few instructions).
                if pos == r.claimed.load(Ordering::Acquire) && r.stop.load(Ordering::Acquire) {
                    return out.finish();
                }
                std::thread::sleep(Duration::from_micros(500));
            }
        })
        .map_err(|e| Error::os(e, "starting the trace writer thread"))?;
        Ok(Self { ring, writer: std::sync::Mutex::new(Some(writer)) })
    }

    /// Record an access to `page` (a virtual page number); safe in a signal handler.
    #[inline]
    pub(crate) fn record(&self, page: u64, write: bool) {
        self.push(record(page, if write { RecordKind::Write } else { RecordKind::Read }));
    }

    /// Record a monitor report on `page` (a virtual page number): a `report` record, which the
    /// simulator gives the prefetcher (`--monitor reports`) without touching residency.
    pub(crate) fn report(&self, page: u64) {
        self.push(record(page, RecordKind::Report));
    }

    /// Record that the program gave back `pages` pages from virtual page `first`: they hold
    /// nothing afterwards (discard records, one per half million pages).
    pub(crate) fn discard(&self, first: u64, pages: u64) {
        for word in discard_records(first, pages) {
            self.push(word);
        }
    }

    #[inline]
    fn push(&self, word: u64) {
        let r = &self.ring;
        let mut pos = r.claimed.load(Ordering::Relaxed);
        loop {
            if pos - r.drained.load(Ordering::Acquire) >= CAPACITY as u64 {
                r.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            match r.claimed.compare_exchange_weak(pos, pos + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(now) => pos = now,
            }
        }
        r.slots[(pos & (CAPACITY as u64 - 1)) as usize].store(word | FULL, Ordering::Release);
    }
}

impl TraceSink {
    /// Write out what is recorded, close the file and record nothing more (a process that exits
    /// without dropping its engine, like one under the preload shim, calls this at exit).
    pub(crate) fn finish(&self) {
        self.ring.stop.store(true, Ordering::Release);
        let Some(writer) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
        let written = Some(writer.join());
        let dropped = self.ring.dropped.load(Ordering::Relaxed);
        match written {
            Some(Ok(Ok(n))) => tracing::info!(records = n, dropped, "trace written"),
            Some(Ok(Err(e))) => tracing::error!(error = %e, "writing the trace failed"),
            _ => tracing::error!("the trace writer thread panicked"),
        }
    }
}

impl Drop for TraceSink {
    fn drop(&mut self) {
        self.finish();
    }
}
