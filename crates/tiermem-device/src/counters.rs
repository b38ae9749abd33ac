//! Byte counters every device keeps, so write amplification is measured, not assumed.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters of one device.
#[derive(Debug, Default)]
pub struct DeviceCounters {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read_asked: AtomicU64,
    bytes_read_medium: AtomicU64,
    bytes_written_asked: AtomicU64,
    bytes_written_medium: AtomicU64,
    errors: AtomicU64,
}

/// A copy of [`DeviceCounters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CounterSnapshot {
    /// Read requests completed.
    pub reads: u64,
    /// Write requests completed.
    pub writes: u64,
    /// Bytes callers asked to read.
    pub bytes_read_asked: u64,
    /// Bytes read from the medium.
    pub bytes_read_medium: u64,
    /// Bytes callers asked to write.
    pub bytes_written_asked: u64,
    /// Bytes written to the medium.
    pub bytes_written_medium: u64,
    /// Requests that failed.
    pub errors: u64,
}

impl DeviceCounters {
    /// Count a finished read of `asked` bytes that moved `medium` bytes.
    pub fn record_read(&self, asked: u64, medium: u64) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes_read_asked.fetch_add(asked, Ordering::Relaxed);
        self.bytes_read_medium.fetch_add(medium, Ordering::Relaxed);
    }

    /// Count a finished write of `asked` bytes that moved `medium` bytes.
    pub fn record_write(&self, asked: u64, medium: u64) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.bytes_written_asked.fetch_add(asked, Ordering::Relaxed);
        self.bytes_written_medium.fetch_add(medium, Ordering::Relaxed);
    }

    /// Count a failed request.
    pub fn record_error(&self) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> CounterSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            reads: l(&self.reads),
            writes: l(&self.writes),
            bytes_read_asked: l(&self.bytes_read_asked),
            bytes_read_medium: l(&self.bytes_read_medium),
            bytes_written_asked: l(&self.bytes_written_asked),
            bytes_written_medium: l(&self.bytes_written_medium),
            errors: l(&self.errors),
        }
    }
}

impl CounterSnapshot {
    /// Bytes written to the medium per byte asked for (1.0 = no amplification).
    pub fn write_amplification(&self) -> f64 {
        if self.bytes_written_asked == 0 {
            return 1.0;
        }
        self.bytes_written_medium as f64 / self.bytes_written_asked as f64
    }
}
