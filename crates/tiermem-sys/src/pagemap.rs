//! The kernel's view of which pages are present and written: PAGEMAP_SCAN (Linux >= 6.7) on
//! /proc/self/pagemap, which also re-arms asynchronous write protection in the same call.

use std::fs::File;
use std::mem::size_of;
use std::os::fd::AsRawFd;

use linux_raw_sys::general as uapi;
use rustix::io::Errno;

use crate::{Result, ResultExt, PAGE_SIZE};

/// Page categories (`PAGE_IS_*`).
pub mod category {
    use linux_raw_sys::general as uapi;
    /// Write protection is armed (userfaultfd-wp).
    pub const WP_ALLOWED: u64 = uapi::PAGE_IS_WPALLOWED as u64;
    /// Written since write protection was armed.
    pub const WRITTEN: u64 = uapi::PAGE_IS_WRITTEN as u64;
    /// Backed by a page in memory.
    pub const PRESENT: u64 = uapi::PAGE_IS_PRESENT as u64;
    /// Swapped out by the kernel.
    pub const SWAPPED: u64 = uapi::PAGE_IS_SWAPPED as u64;
    /// Mapped to the shared zero page.
    pub const PFNZERO: u64 = uapi::PAGE_IS_PFNZERO as u64;
}

/// A run of pages with the same categories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct PageRegion {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// The categories (masked by the scan's return mask).
    pub categories: u64,
}

// _IOWR('f', 16, struct pm_scan_arg)
const PAGEMAP_SCAN: u32 = (3 << 30) | ((size_of::<uapi::pm_scan_arg>() as u32) << 16) | ((b'f' as u32) << 8) | 16;

/// What to look for in one scan.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScanQuery {
    /// Pages must have all of these categories...
    pub required: u64,
    /// ...of which these are inverted (must be absent)...
    pub inverted: u64,
    /// ...and at least one of these (0 = no such condition).
    pub any_of: u64,
    /// Categories to report in each region.
    pub report: u64,
    /// Write-protect the matching pages atomically with reporting them (async WP re-arm).
    pub write_protect_matching: bool,
    /// Stop after this many pages (0 = no limit).
    pub max_pages: u64,
}

/// An open /proc/self/pagemap.
#[derive(Debug)]
pub struct Pagemap {
    file: crate::guarded_fd::Guarded<File>,
}

/// The page frame number in a /proc/PID/pagemap entry (8 bytes, little-endian) of a page present
/// in memory; None for one that is not. The number reads 0 to a process without CAP_SYS_ADMIN.
pub fn present_frame(entry: [u8; 8]) -> Option<u64> {
    let entry = u64::from_le_bytes(entry);
    // Bit 63: present; bits 0..=54: the frame.
    (entry >> 63 == 1).then_some(entry & ((1 << 55) - 1))
}

impl Pagemap {
    /// Open this process's pagemap.
    pub fn open_self() -> Result<Self> {
        let file = File::open("/proc/self/pagemap").context(|| "opening /proc/self/pagemap".into())?;
        Ok(Self { file: crate::guarded_fd::Guarded::new(file) })
    }

    /// Scan `[start, end)` for pages matching `query`, writing runs into `out`. Returns the number
    /// of runs and the address where the walk stopped (== `end` when it covered the range).
    pub fn scan(
        &self,
        start: usize,
        end: usize,
        query: &ScanQuery,
        out: &mut [PageRegion],
    ) -> Result<(usize, usize), Errno> {
        let mut arg = uapi::pm_scan_arg {
            size: size_of::<uapi::pm_scan_arg>() as u64,
            flags: if query.write_protect_matching { u64::from(uapi::PM_SCAN_WP_MATCHING) } else { 0 },
            start: start as u64,
            end: end as u64,
            walk_end: 0,
            vec: out.as_mut_ptr() as u64,
            vec_len: out.len() as u64,
            max_pages: query.max_pages,
            category_inverted: query.inverted,
            category_mask: query.required,
            category_anyof_mask: query.any_of,
            return_mask: query.report,
        };
        // SAFETY: PAGEMAP_SCAN takes a pm_scan_arg; vec/vec_len describe `out`, which the kernel
        // fills with page_region structs (same layout as PageRegion).
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg as *mut uapi::pm_scan_arg) };
        if rc < 0 {
            return Err(Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)));
        }
        Ok((rc as usize, arg.walk_end as usize))
    }

    /// Whether the page at `addr` is mapped (in memory or swapped out by the kernel), from its
    /// /proc/self/pagemap entry: works without PAGEMAP_SCAN and is safe in a signal handler.
    pub fn is_mapped(&self, addr: usize) -> Result<bool, Errno> {
        const PRESENT: u64 = 1 << 63;
        const SWAPPED: u64 = 1 << 62;
        let mut entry = [0u8; 8];
        let offset = (addr / PAGE_SIZE * size_of::<u64>()) as u64;
        let n = rustix::io::pread(&self.file, &mut entry, offset)?;
        if n != entry.len() {
            return Err(Errno::IO);
        }
        Ok(u64::from_ne_bytes(entry) & (PRESENT | SWAPPED) != 0)
    }

    /// Whether any page of `[start, end)` holds data: present in memory or swapped out.
    pub fn any_mapped(&self, start: usize, end: usize) -> Result<bool, Errno> {
        let query = ScanQuery {
            any_of: category::PRESENT | category::SWAPPED,
            report: category::PRESENT | category::SWAPPED,
            max_pages: 1,
            ..Default::default()
        };
        let mut out = [PageRegion::default(); 1];
        Ok(self.scan(start, end, &query, &mut out)?.0 > 0)
    }

    /// How many pages of `[start, end)` are present in memory, per the kernel.
    pub fn count_present(&self, start: usize, end: usize) -> Result<u64, Errno> {
        let query = ScanQuery { required: category::PRESENT, report: category::PRESENT, ..Default::default() };
        let mut out = [PageRegion::default(); 256];
        let mut total = 0u64;
        let mut at = start;
        while at < end {
            let (n, walk_end) = self.scan(at, end, &query, &mut out)?;
            total += out[..n].iter().map(|r| (r.end - r.start) / PAGE_SIZE as u64).sum::<u64>();
            if walk_end <= at {
                break;
            }
            at = walk_end;
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Mapping;

    #[test]
    fn any_mapped_sees_a_single_written_page_and_nothing_in_untouched_memory() {
        let map = Mapping::anonymous(8 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr() as usize;
        let pagemap = Pagemap::open_self().unwrap();
        let any = |from: usize, to: usize| pagemap.any_mapped(base + from * PAGE_SIZE, base + to * PAGE_SIZE);
        match any(0, 8) {
            Ok(false) => {}
            Ok(true) => panic!("untouched memory reported as holding data"),
            Err(e) => {
                eprintln!("SKIPPED any_mapped_sees_a_single_written_page_and_nothing_in_untouched_memory: PAGEMAP_SCAN (Linux >= 6.7) is not available: {e}");
                return;
            }
        }
        // SAFETY: page 5 lies inside the 8-page mapping above.
        let page = unsafe { map.as_ptr().add(5 * PAGE_SIZE) };
        // SAFETY: a byte of that page, owned here and writable.
        unsafe { page.write(1) };
        assert_eq!(any(0, 8), Ok(true));
        assert_eq!(any(5, 6), Ok(true));
        assert_eq!((any(0, 5), any(6, 8)), (Ok(false), Ok(false)));
    }
}
