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

/// Whether a /proc/PID/pagemap entry holds a page: present, or swapped out and not a marker
/// (see [`Pagemap::is_mapped`]).
fn entry_holds_data(entry: u64) -> bool {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    // Bit 57: the entry is uffd-wp write-protected; bit 58: a guard region (Linux >= 6.14).
    const MARKER_BITS: u64 = (1 << 57) | (1 << 58);
    entry & PRESENT != 0 || (entry & SWAPPED != 0 && entry & MARKER_BITS == 0)
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
    ///
    /// The kernel reports every non-empty entry that is not present as swapped, markers
    /// included: a write-protect marker (left by write-protecting a page that is not there, with
    /// WP_UNPOPULATED, which WP_ASYNC turns on) or a guard region holds no data and reads as
    /// not mapped here. A page swapped out with write protection has the same bits as such a
    /// marker (the entry's swap type, which would tell them apart, is shown to root only) and
    /// also reads as not mapped: a missing-page fault never comes from a swapped page.
    pub fn is_mapped(&self, addr: usize) -> Result<bool, Errno> {
        let mut entry = [0u8; 8];
        let offset = (addr / PAGE_SIZE * size_of::<u64>()) as u64;
        let n = rustix::io::pread(&self.file, &mut entry, offset)?;
        if n != entry.len() {
            return Err(Errno::IO);
        }
        Ok(entry_holds_data(u64::from_ne_bytes(entry)))
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

    /// Write-protecting a page that is not there leaves a marker (WP_UNPOPULATED, which WP_ASYNC
    /// turns on), which the kernel's pagemap reports as swapped: it holds no data, and the engine
    /// took it for a page someone else had mapped and woke the faulting thread into the same
    /// fault forever.
    #[test]
    fn a_write_protect_marker_on_a_page_that_is_not_there_is_not_mapped() {
        use crate::uffd::{Features, RegisterMode, Uffd};
        let test = "a_write_protect_marker_on_a_page_that_is_not_there_is_not_mapped";
        let uffd = match Uffd::open(Features(Features::WP_ASYNC.0 | Features::WP_UNPOPULATED.0), true) {
            Ok(uffd) => uffd,
            Err(e) => {
                eprintln!("SKIPPED {test}: no userfaultfd with WP_ASYNC and WP_UNPOPULATED here: {e}");
                return;
            }
        };
        let map = Mapping::anonymous(4 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr();
        for k in 0..4 {
            let byte = base.wrapping_add(k * PAGE_SIZE);
            // SAFETY: a byte of page k of the 4-page mapping above, owned here.
            unsafe { byte.write(1) };
        }
        let third = base.wrapping_add(2 * PAGE_SIZE);
        // SAFETY: page 2 of the mapping, dropped before the range is registered.
        unsafe { rustix::mm::madvise(third.cast(), PAGE_SIZE, rustix::mm::Advice::LinuxDontNeed) }.unwrap();
        uffd.register(base, 4 * PAGE_SIZE, RegisterMode { missing: true, write_protect: true }).unwrap();
        uffd.write_protect(base, 4 * PAGE_SIZE, true, false).unwrap();
        let pagemap = Pagemap::open_self().unwrap();
        let raw = |k: usize| {
            let mut entry = [0u8; 8];
            let offset = ((base as usize + k * PAGE_SIZE) / PAGE_SIZE * size_of::<u64>()) as u64;
            rustix::io::pread(&pagemap.file, &mut entry, offset).unwrap();
            u64::from_ne_bytes(entry)
        };
        if raw(2) & (1 << 62) == 0 {
            eprintln!("SKIPPED {test}: this kernel left no marker (entry {:#x})", raw(2));
            return;
        }
        let mapped = |k: usize| pagemap.is_mapped(base as usize + k * PAGE_SIZE).unwrap();
        assert!(!mapped(2), "the marker on the dropped page (entry {:#x}) counts as a page", raw(2));
        assert!(mapped(1) && mapped(3), "the written pages around it are mapped");
        uffd.unregister(base, 4 * PAGE_SIZE).unwrap();
    }
}
