//! The reverse page table of §2.2: indexed by physical page number, its entries hold the
//! 16-bit pid and 40-bit virtual page number mapped there, so a physical-address report (the
//! hot-page table, DAMON's paddr operations) becomes a {pid, virtual page} in a lookup. Built
//! from /proc/PID/pagemap (which shows page frame numbers only to CAP_SYS_ADMIN) and kept
//! current by whoever maps and unmaps pages.
//!
//! The paper's table is one flat array over all of physical memory, 8 bytes a frame: 48 MiB on
//! this 24 GiB machine, which under `tiermem run` counts against the program's own memory
//! limit (with DAMON on, a Redis server at 20% of its footprint paged in three times as much). Here it has two
//! levels: leaves of 512 frames (2 MiB of physical memory) exist only while a frame of theirs
//! has an entry, so its memory follows the frames entered, and a lookup is two loads.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;

use tiermem_sys::{Error, ErrorKind, Result};

/// Bits of the virtual page number in an entry.
pub const VPN_BITS: u32 = 40;
const VALID: u64 = 1 << 63;
const VPN_MASK: u64 = (1 << VPN_BITS) - 1;
/// Frames per leaf.
const LEAF_FRAMES: usize = 512;

/// Entries of 512 consecutive frames, and how many of them are valid.
#[derive(Debug, Clone)]
struct Leaf {
    entries: [u64; LEAF_FRAMES],
    valid: u16,
}

/// The table; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct ReversePageTable {
    leaves: Vec<Option<Box<Leaf>>>,
    mapped: usize,
}

impl ReversePageTable {
    /// An empty table with room for physical pages `0..frames` in its first level (it grows
    /// when needed).
    pub fn with_frames(frames: usize) -> Self {
        Self { leaves: vec![None; frames.div_ceil(LEAF_FRAMES)], mapped: 0 }
    }

    /// Record that physical page `pfn` maps virtual page `vpn` of process `pid`.
    pub fn insert(&mut self, pfn: u64, pid: u32, vpn: u64) -> Result<()> {
        let pid16 = u16::try_from(pid)
            .map_err(|_| Error::invalid(format!("pid {pid} does not fit the table's 16-bit pid field")))?;
        if vpn > VPN_MASK {
            return Err(Error::invalid(format!("virtual page {vpn:#x} does not fit 40 bits")));
        }
        let i = usize::try_from(pfn).map_err(|_| Error::invalid(format!("pfn {pfn:#x} too large")))?;
        let (leaf, at) = (i / LEAF_FRAMES, i % LEAF_FRAMES);
        if leaf >= self.leaves.len() {
            self.leaves.resize(leaf + 1, None);
        }
        let leaf = self.leaves[leaf].get_or_insert_with(|| Box::new(Leaf { entries: [0; LEAF_FRAMES], valid: 0 }));
        if leaf.entries[at] & VALID == 0 {
            leaf.valid += 1;
            self.mapped += 1;
        }
        leaf.entries[at] = VALID | (u64::from(pid16) << VPN_BITS) | vpn;
        Ok(())
    }

    /// Forget physical page `pfn` (it was unmapped).
    pub fn remove(&mut self, pfn: u64) {
        let (leaf, at) = (pfn as usize / LEAF_FRAMES, pfn as usize % LEAF_FRAMES);
        let Some(slot) = self.leaves.get_mut(leaf) else { return };
        let Some(l) = slot.as_mut() else { return };
        if l.entries[at] & VALID != 0 {
            l.entries[at] = 0;
            l.valid -= 1;
            self.mapped -= 1;
            if l.valid == 0 {
                *slot = None;
            }
        }
    }

    /// The {pid, virtual page} at physical page `pfn`.
    #[inline]
    pub fn lookup(&self, pfn: u64) -> Option<(u16, u64)> {
        let leaf = self.leaves.get(usize::try_from(pfn).ok()? / LEAF_FRAMES)?.as_deref()?;
        let e = leaf.entries[pfn as usize % LEAF_FRAMES];
        (e & VALID != 0).then_some((((e >> VPN_BITS) & 0xffff) as u16, e & VPN_MASK))
    }

    /// Leaves allocated (each 4 KiB), for the memory it takes.
    pub fn leaves(&self) -> usize {
        self.leaves.iter().filter(|l| l.is_some()).count()
    }

    /// Physical pages with an entry.
    pub fn mapped(&self) -> usize {
        self.mapped
    }

    /// Add every present page of process `pid` (all its mappings) from /proc/PID/pagemap.
    /// Returns the pages added. Fails with [`ErrorKind::Permission`] when the kernel hides page
    /// frame numbers (no CAP_SYS_ADMIN).
    pub fn add_process(&mut self, pid: u32) -> Result<usize> {
        let maps =
            File::open(format!("/proc/{pid}/maps")).map_err(|e| Error::os(e, format!("opening /proc/{pid}/maps")))?;
        let pagemap = File::open(format!("/proc/{pid}/pagemap"))
            .map_err(|e| Error::os(e, format!("opening /proc/{pid}/pagemap")))?;
        let mut added = 0;
        let mut present_without_pfn = 0;
        let mut buf = vec![0u8; 8 * 512];
        for line in BufReader::new(maps).lines() {
            let line = line.map_err(|e| Error::os(e, format!("reading /proc/{pid}/maps")))?;
            let Some((range, _)) = line.split_once(' ') else { continue };
            let Some((start, end)) = range.split_once('-') else { continue };
            let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16)) else { continue };
            if line.ends_with("[vsyscall]") {
                continue;
            }
            let (first, last) = (start / 4096, end / 4096);
            let mut vpn = first;
            while vpn < last {
                let n = ((last - vpn) as usize).min(512);
                let bytes = &mut buf[..n * 8];
                if pagemap.read_exact_at(bytes, vpn * 8).is_err() {
                    break;
                }
                for (k, word) in bytes.chunks_exact(8).enumerate() {
                    let Some(pfn) = tiermem_sys::pagemap::present_frame(word.try_into().unwrap_or_default()) else {
                        continue;
                    };
                    if pfn == 0 {
                        present_without_pfn += 1;
                        continue;
                    }
                    self.insert(pfn, pid, vpn + k as u64)?;
                    added += 1;
                }
                vpn += n as u64;
            }
        }
        if added == 0 && present_without_pfn > 0 {
            return Err(Error::new(
                ErrorKind::Permission,
                format!("/proc/{pid}/pagemap hides page frame numbers (CAP_SYS_ADMIN is needed)"),
            ));
        }
        Ok(added)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Inserts (overwriting), removals and lookups agree with a map, at the fields' limits too.
        #[test]
        fn agrees_with_a_map(ops in proptest::collection::vec(
            (prop_oneof![0u64..300, 500u64..530, 1000u64..1300], prop_oneof![Just(0u32), Just(65535u32), 1u32..65535], prop_oneof![Just(0u64), Just(VPN_MASK), 0u64..VPN_MASK], any::<bool>()), 0..300)) {
            let mut t = ReversePageTable::with_frames(16);
            let mut model = HashMap::new();
            for (pfn, pid, vpn, insert) in ops {
                if insert {
                    t.insert(pfn, pid, vpn).unwrap();
                    model.insert(pfn, (pid as u16, vpn));
                } else {
                    t.remove(pfn);
                    model.remove(&pfn);
                }
                prop_assert_eq!(t.mapped(), model.len());
            }
            for pfn in 0..1310 {
                prop_assert_eq!(t.lookup(pfn), model.get(&pfn).copied());
            }
            // A leaf lives exactly while one of its frames has an entry.
            let mut leaves: Vec<u64> = model.keys().map(|pfn| pfn / LEAF_FRAMES as u64).collect();
            leaves.sort_unstable();
            leaves.dedup();
            prop_assert_eq!(t.leaves(), leaves.len());
        }

        #[test]
        fn rejects_fields_that_do_not_fit(pid in 65536u32.., vpn in (VPN_MASK + 1)..) {
            let mut t = ReversePageTable::default();
            prop_assert!(t.insert(1, pid, 5).is_err());
            prop_assert!(t.insert(1, 5, vpn).is_err());
            prop_assert_eq!(t.lookup(1), None);
        }
    }

    #[test]
    fn built_from_this_process_pagemap_translates_its_own_pages() {
        let pid = std::process::id();
        if pid > 65535 {
            println!("SKIPPED: pid {pid} does not fit the 16-bit pid field");
            return;
        }
        let data: Vec<u64> = (0..4096u64).collect(); // 32 KiB, touched: present
        let mut t = ReversePageTable::default();
        match t.add_process(pid) {
            Err(e) if e.kind() == ErrorKind::Permission => {
                println!("SKIPPED: {e}");
                return;
            }
            other => assert!(other.unwrap() > 0),
        }
        let vpn = data.as_ptr() as u64 / 4096;
        let found = (0..(t.leaves.len() * LEAF_FRAMES) as u64)
            .filter_map(|pfn| t.lookup(pfn))
            .any(|(p, v)| u32::from(p) == pid && v == vpn);
        assert!(found, "the page holding `data` is in the table");
        // Keep `data` (and so its page) alive and in use up to here.
        std::hint::black_box(&data);
    }
}
