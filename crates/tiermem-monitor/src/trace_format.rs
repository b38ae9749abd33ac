//! The compact binary trace format (docs/trace-format.md), shared by the simulator (reads it)
//! and the engine's trace sink (writes it).
//!
//! A 24-byte header — magic `TMTRACE\0`, version (u32 LE, 2; 1 is read too), address unit
//! (u32 LE: 0 = page numbers, 1 = byte addresses), record count (u64 LE; 0 = read to the end of
//! the file) — then one u64 LE per record: `value << 2 | kind`, kind 0 = read, 1 = write, 2 =
//! report (the monitor saw the page used; no residency effect), 3 = compute (the value counts
//! byte-level accesses since the previous record that never reached memory: CPU time for the
//! time model). Version 2 adds discards: a compute record whose value has [`DISCARD`] set
//! names pages the program gave back (munmap, MADV_DONTNEED), which hold nothing afterwards.

use std::io::Write;

/// Magic bytes opening a binary trace.
pub const MAGIC: &[u8; 8] = b"TMTRACE\0";
/// Format version written (and the newest read).
pub const VERSION: u32 = 2;
/// Oldest format version read (version 1 has no discards).
pub const OLDEST_VERSION: u32 = 1;
/// Set in a compute record's value, it is a discard: `DISCARD | pages << 40 | first page`.
pub const DISCARD: u64 = 1 << 59;
/// Most pages one discard record names (longer runs take several records).
pub const MAX_DISCARD_PAGES: u64 = (1 << 19) - 1;
const DISCARD_PAGE_MASK: u64 = (1 << 40) - 1;
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

/// The discard records for `pages` pages from `first_page` (below 2^40): one per
/// [`MAX_DISCARD_PAGES`], none for no pages.
pub fn discard_records(first_page: u64, pages: u64) -> impl Iterator<Item = u64> {
    let end = first_page.saturating_add(pages);
    (first_page..end).step_by(MAX_DISCARD_PAGES as usize).map(move |start| {
        let n = (end - start).min(MAX_DISCARD_PAGES);
        record(DISCARD | n << 40 | (start & DISCARD_PAGE_MASK), RecordKind::Compute)
    })
}

/// The first page and page count of a compute record's `value` if it is a discard.
#[inline]
pub fn split_discard(value: u64) -> Option<(u64, u64)> {
    (value & DISCARD != 0).then_some((value & DISCARD_PAGE_MASK, (value >> 40) & MAX_DISCARD_PAGES))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_discard_splits_into_records_that_name_each_page_once() {
        assert_eq!(discard_records(7, 0).count(), 0);
        let words: Vec<u64> = discard_records(100, 2 * MAX_DISCARD_PAGES + 5).collect();
        assert_eq!(words.len(), 3);
        let mut next = 100;
        for w in words {
            assert_eq!(w & 3, RecordKind::Compute as u64);
            let (first, pages) = split_discard(w >> 2).expect("a discard");
            assert_eq!(first, next);
            assert!((1..=MAX_DISCARD_PAGES).contains(&pages));
            next += pages;
            // Inside the 62 bits a record may use (the engine's trace ring marks slots with bit 63).
            assert!(w < 1 << 62);
        }
        assert_eq!(next, 100 + 2 * MAX_DISCARD_PAGES + 5);
        // The last page number there is.
        let last: Vec<u64> = discard_records((1 << 40) - 1, 1).collect();
        assert_eq!(split_discard(last[0] >> 2), Some(((1 << 40) - 1, 1)));
        // An ordinary compute count is not a discard.
        assert_eq!(split_discard(12_345), None);
    }
}
