//! The compact binary trace format (docs/trace-format.md), shared by the simulator (reads it)
//! and the engine's trace sink (writes it).
//!
//! A 24-byte header — magic `TMTRACE\0`, version (u32 LE, 1), address unit (u32 LE: 0 = page
//! numbers, 1 = byte addresses), record count (u64 LE; 0 = read to the end of the file) —
//! then one u64 LE per record: `value << 2 | kind`, kind 0 = read, 1 = write, 2 = report (the
//! monitor saw the page used; no residency effect), 3 = compute (the value counts byte-level
//! accesses since the previous record that never reached memory: CPU time for the time model).

use std::io::Write;

/// Magic bytes opening a binary trace.
pub const MAGIC: &[u8; 8] = b"TMTRACE\0";
/// Format version written and read.
pub const VERSION: u32 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 24;

/// Record kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// A read access.
    Read = 0,
    /// A write access.
    Write = 1,
    /// A monitor report.
    Report = 2,
    /// Accesses that stayed in the caches (the value is how many).
    Compute = 3,
}

/// Encode one record.
#[inline]
pub fn record(value: u64, kind: RecordKind) -> u64 {
    value << 2 | kind as u64
}

/// The header for a trace of page numbers (`bytes` false) or byte addresses, with `count`
/// records (0: unknown, read to the end).
pub fn header(bytes: bool, count: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&u32::from(bytes).to_le_bytes());
    h[16..24].copy_from_slice(&count.to_le_bytes());
    h
}

/// Writes the binary format.
#[derive(Debug)]
pub struct BinaryWriter<W: Write> {
    out: W,
    records: u64,
}

impl<W: Write> BinaryWriter<W> {
    /// Start a trace of page numbers (`bytes` false) or byte addresses. The record count in the
    /// header is 0 ("read to the end"); [`BinaryWriter::finish`] returns how many were written.
    pub fn new(mut out: W, bytes: bool) -> std::io::Result<Self> {
        out.write_all(&header(bytes, 0))?;
        Ok(Self { out, records: 0 })
    }

    /// Append one record.
    pub fn write(&mut self, value: u64, kind: RecordKind) -> std::io::Result<()> {
        self.write_encoded(record(value, kind))
    }

    /// Append an already encoded record.
    pub fn write_encoded(&mut self, word: u64) -> std::io::Result<()> {
        self.records += 1;
        self.out.write_all(&word.to_le_bytes())
    }

    /// Flush and return the record count.
    pub fn finish(mut self) -> std::io::Result<u64> {
        self.out.flush()?;
        Ok(self.records)
    }
}
