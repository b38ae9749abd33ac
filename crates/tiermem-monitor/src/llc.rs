//! A last-level-cache filter: turns a program's loads and stores into the requests a memory
//! controller sees (line fills on misses, write-backs of dirty lines), so the hot-page table gets
//! what it would get in hardware. Set-associative, LRU, write-allocate, write-back.

use tiermem_sys::{Error, Result};

/// Bytes per cache line.
pub const LINE: u64 = 64;

/// The requests one access sends to memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryRequests {
    /// Line address read from memory (a miss; a write miss reads the line first too).
    pub fill: Option<u64>,
    /// Line address of a dirty line evicted to make room.
    pub writeback: Option<u64>,
}

/// The cache; see the module docs.
#[derive(Debug, Clone)]
pub struct LlcFilter {
    tags: Vec<u64>,
    used: Vec<u64>,
    dirty: Vec<bool>,
    ways: usize,
    set_mask: u64,
    clock: u64,
}

const INVALID: u64 = u64::MAX;

impl LlcFilter {
    /// A cache of `bytes` (a power of two times `ways` lines) with `ways` ways.
    pub fn new(bytes: u64, ways: usize) -> Result<Self> {
        let way_bytes = u64::try_from(ways).ok().and_then(|w| w.checked_mul(LINE));
        if ways == 0 || bytes == 0 || way_bytes.is_none_or(|w| !bytes.is_multiple_of(w)) {
            return Err(Error::invalid(format!(
                "LLC of {bytes} bytes and {ways} ways: size must be a positive multiple of ways × 64 bytes"
            )));
        }
        let sets = bytes / (LINE * ways as u64); // (no overflow: checked above)
        if !sets.is_power_of_two() {
            return Err(Error::invalid(format!(
                "LLC of {bytes} bytes and {ways} ways has {sets} sets; the number of sets must be a power of two"
            )));
        }
        let lines = (sets as usize) * ways;
        Ok(Self {
            tags: vec![INVALID; lines],
            used: vec![0; lines],
            dirty: vec![false; lines],
            ways,
            set_mask: sets - 1,
            clock: 0,
        })
    }

    /// A load (`write` false) or store at byte address `addr`.
    #[inline]
    pub fn access(&mut self, addr: u64, write: bool) -> MemoryRequests {
        let line = addr / LINE;
        let base = ((line & self.set_mask) as usize) * self.ways;
        self.clock += 1;
        let ways = base..base + self.ways;
        if let Some(i) = ways.clone().find(|&i| self.tags[i] == line) {
            self.used[i] = self.clock;
            self.dirty[i] |= write;
            return MemoryRequests::default();
        }
        let victim = ways.min_by_key(|&i| if self.tags[i] == INVALID { 0 } else { self.used[i] }).unwrap_or(base);
        let writeback = (self.tags[victim] != INVALID && self.dirty[victim]).then(|| self.tags[victim] * LINE);
        self.tags[victim] = line;
        self.used[victim] = self.clock;
        self.dirty[victim] = write;
        MemoryRequests { fill: Some(line * LINE), writeback }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_filter_out_and_dirty_evictions_write_back() {
        // 2 sets × 2 ways.
        let mut llc = LlcFilter::new(4 * LINE, 2).unwrap();
        assert_eq!(llc.access(0, false).fill, Some(0));
        assert_eq!(llc.access(8, false), MemoryRequests::default(), "same line");
        assert_eq!(llc.access(2 * LINE, true).fill, Some(2 * LINE), "write miss reads the line first");
        llc.access(0, false); // line 0 most recent in set 0
        let r = llc.access(4 * LINE, false); // set 0 full: evicts line 2 (dirty)
        assert_eq!(r, MemoryRequests { fill: Some(4 * LINE), writeback: Some(2 * LINE) });
        let r = llc.access(6 * LINE, false); // evicts line 0 (clean)
        assert_eq!(r, MemoryRequests { fill: Some(6 * LINE), writeback: None });
        assert_eq!(llc.access(LINE, false).fill, Some(LINE), "set 1 untouched so far");
        assert!(LlcFilter::new(3 * LINE, 1).is_err() && LlcFilter::new(0, 4).is_err());
    }
}
