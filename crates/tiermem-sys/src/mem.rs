//! Anonymous memory mappings and the madvise calls the engine needs.

use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::Errno;
use rustix::mm::{self, Advice, MapFlags, ProtFlags};

use crate::{Error, Result, ResultExt, PAGE_SIZE};

/// An anonymous private mapping, unmapped on drop (but for the parts handed over).
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    /// Parts (offset, end; sorted, merged) that belong to someone else now: the program mapped
    /// over them with MAP_FIXED (see [`Mapping::hand_over`]).
    handed_over: std::sync::Mutex<Vec<(usize, usize)>>,
    /// Parts not this mapping's to fill: those handed over and those taken back since (reserved
    /// PROT_NONE where the program's mapping was); sorted, merged.
    foreign: std::sync::Mutex<Vec<(usize, usize)>>,
    /// Set once any part was handed over: until then [`Mapping::is_foreign`] locks nothing.
    any_foreign: AtomicBool,
}

/// Add `[from, to)` to a sorted list of disjoint ranges, merging where they touch.
pub fn merge_range(ranges: &mut Vec<(usize, usize)>, from: usize, to: usize) {
    if from >= to {
        return;
    }
    ranges.push((from, to));
    ranges.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
    for &(a, b) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    *ranges = merged;
}

/// Take `[from, to)` out of a sorted list of disjoint ranges.
pub fn remove_range(ranges: &mut Vec<(usize, usize)>, from: usize, to: usize) {
    if from >= to {
        return;
    }
    let mut kept = Vec::with_capacity(ranges.len() + 1);
    for &(a, b) in ranges.iter() {
        if b <= from || a >= to {
            kept.push((a, b));
            continue;
        }
        if a < from {
            kept.push((a, from));
        }
        if b > to {
            kept.push((to, b));
        }
    }
    *ranges = kept;
}

/// The parts of `[0, len)` outside a sorted list of disjoint ranges, as (start, end).
pub fn gaps_between(ranges: &[(usize, usize)], len: usize) -> Vec<(usize, usize)> {
    let mut gaps = Vec::with_capacity(ranges.len() + 1);
    let mut at = 0;
    for &(from, to) in ranges {
        if from > at {
            gaps.push((at, from.min(len)));
        }
        at = at.max(to);
    }
    if at < len {
        gaps.push((at, len));
    }
    gaps
}

// SAFETY: a Mapping is plain memory addresses; synchronising access to its bytes is the owner's job.
unsafe impl Send for Mapping {}
// SAFETY: as above; the struct itself is immutable after creation.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn at(ptr: NonNull<u8>, len: usize) -> Self {
        Self {
            ptr,
            len,
            handed_over: Default::default(),
            foreign: Default::default(),
            any_foreign: AtomicBool::new(false),
        }
    }

    /// Map `len` bytes (a non-zero multiple of the page size) of anonymous memory.
    /// `populate` pre-faults it so later use never page-faults.
    pub fn anonymous(len: usize, populate: bool) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) {
            return Err(Error::invalid(format!("mapping length {len} is not a non-zero multiple of {PAGE_SIZE}")));
        }
        let mut flags = MapFlags::PRIVATE | MapFlags::NORESERVE;
        if populate {
            flags |= MapFlags::POPULATE;
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing aliases nothing.
        let ptr = unsafe { mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, flags) }
            .context(|| format!("mmap of {len} bytes of anonymous memory"))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::new(crate::ErrorKind::Internal, "mmap returned null"))?;
        Ok(Self::at(ptr, len))
    }

    /// Map `len` bytes of read-only anonymous memory that reads as zeros, backed by the
    /// kernel's shared zero page (read here once, so later reads never fault): a source of
    /// zeros that costs no memory, where a populated writable mapping is charged `len` bytes.
    pub fn zeros(len: usize) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) {
            return Err(Error::invalid(format!("mapping length {len} is not a non-zero multiple of {PAGE_SIZE}")));
        }
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing aliases nothing.
        let ptr = unsafe { mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ, MapFlags::PRIVATE) }
            .context(|| format!("mmap of {len} bytes of zeros"))?;
        let ptr = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| Error::new(crate::ErrorKind::Internal, "mmap returned null"))?;
        for offset in (0..len).step_by(PAGE_SIZE) {
            let page = ptr.as_ptr().wrapping_add(offset);
            // SAFETY: inside the readable mapping just made; a read maps the zero page.
            unsafe { std::ptr::read_volatile(page) };
        }
        Ok(Self::at(ptr, len))
    }

    /// Take over `len` bytes at `ptr` that the caller mapped itself: from now on they are this
    /// mapping's, and dropping it unmaps them.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` is a mapping the caller owns and hands over whole: nothing else
    /// unmaps it or keeps using it as its own.
    pub unsafe fn adopt(ptr: *mut u8, len: usize) -> Result<Self> {
        if len == 0 || !len.is_multiple_of(PAGE_SIZE) || !(ptr as usize).is_multiple_of(PAGE_SIZE) {
            return Err(Error::invalid(format!(
                "mapping of {len} bytes at {ptr:p} is not page-aligned with a non-zero length"
            )));
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::invalid("mapping at address 0"))?;
        Ok(Self::at(ptr, len))
    }

    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Start address, non-null.
    pub fn as_non_null(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: mappings are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    fn page_range(&self, offset: usize, len: usize) -> (usize, usize) {
        let from = (offset / PAGE_SIZE * PAGE_SIZE).min(self.len);
        (from, offset.saturating_add(len).next_multiple_of(PAGE_SIZE).min(self.len).max(from))
    }

    /// The pages of `[offset, offset + len)` are about to be replaced by another mapping: not
    /// this mapping's to fill from now on (see [`Mapping::is_foreign`]). Returns the parts that
    /// were not foreign before (as offsets from, to).
    pub fn mark_foreign(&self, offset: usize, len: usize) -> Vec<(usize, usize)> {
        let (from, to) = self.page_range(offset, len);
        if from >= to {
            return Vec::new();
        }
        let mut foreign = self.foreign.lock().unwrap_or_else(|e| e.into_inner());
        let inside: Vec<(usize, usize)> = foreign
            .iter()
            .map(|&(a, b)| (a.max(from) - from, b.min(to).max(from) - from))
            .filter(|&(a, b)| a < b)
            .collect();
        let new = gaps_between(&inside, to - from).into_iter().map(|(a, b)| (from + a, from + b)).collect();
        merge_range(&mut foreign, from, to);
        self.any_foreign.store(true, Ordering::Release);
        new
    }

    /// Undo [`Mapping::mark_foreign`] (the replacement failed).
    pub fn unmark_foreign(&self, offset: usize, len: usize) {
        let (from, to) = self.page_range(offset, len);
        remove_range(&mut self.foreign.lock().unwrap_or_else(|e| e.into_inner()), from, to);
    }

    /// The pages of `[offset, offset + len)` belong to another mapping now (the program's,
    /// mapped over them with MAP_FIXED): dropping this one leaves them alone.
    pub fn hand_over(&self, offset: usize, len: usize) {
        let (from, to) = self.page_range(offset, len);
        if from < to {
            let _ = self.mark_foreign(from, to - from);
            merge_range(&mut self.handed_over.lock().unwrap_or_else(|e| e.into_inner()), from, to);
        }
    }

    /// Whether the page at `offset` has been handed over (see [`Mapping::hand_over`]): the
    /// program's own mapping is there now, not one being put in place.
    pub fn is_handed_over(&self, offset: usize) -> bool {
        self.handed_over.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|&(a, b)| (a..b).contains(&offset))
    }

    /// Whether the page at `offset` is not this mapping's to fill: handed over, or taken back
    /// and reserved PROT_NONE (neither is registered with userfaultfd any more).
    pub fn is_foreign(&self, offset: usize) -> bool {
        self.any_foreign.load(Ordering::Acquire)
            && self.foreign.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|&(a, b)| (a..b).contains(&offset))
    }

    /// `[offset, offset + len)` is this mapping's again (reserved anew after its new owner
    /// went): dropping the mapping unmaps it. It stays foreign (see [`Mapping::is_foreign`]).
    pub fn take_back(&self, offset: usize, len: usize) {
        remove_range(
            &mut self.handed_over.lock().unwrap_or_else(|e| e.into_inner()),
            offset,
            offset.saturating_add(len),
        );
    }

    /// `[offset, offset + len)`, handed over before, holds a fresh mapping this one takes as its
    /// own again: its pages are this mapping's to fill, and dropping it unmaps them.
    pub fn adopt_back(&self, offset: usize, len: usize) {
        let (from, to) = self.page_range(offset, len);
        remove_range(&mut self.handed_over.lock().unwrap_or_else(|e| e.into_inner()), from, to);
        remove_range(&mut self.foreign.lock().unwrap_or_else(|e| e.into_inner()), from, to);
    }

    /// The parts still this mapping's own, as (offset, length), in order.
    pub fn own_parts(&self) -> Vec<(usize, usize)> {
        let handed = self.handed_over.lock().unwrap_or_else(|e| e.into_inner());
        gaps_between(&handed, self.len).into_iter().map(|(from, to)| (from, to - from)).collect()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        for (offset, len) in self.own_parts() {
            // SAFETY: a part of the mapping created in `anonymous`, owned by self (the parts
            // handed over are left to their new owner).
            let _ = unsafe { mm::munmap(self.ptr.as_ptr().wrapping_add(offset).cast(), len) };
        }
    }
}

/// Set once `process_madvise` was found not to work here: from then on [`discard_all`] leaves
/// it to the caller at once.
static BATCHED_DISCARD_REFUSED: AtomicBool = AtomicBool::new(false);

/// Set once `process_madvise` worked here: from then on a refusal is about the ranges given
/// (mlocked memory answers EINVAL), not the call.
static BATCHED_DISCARD_WORKS: AtomicBool = AtomicBool::new(false);

/// The calling thread, as a pidfd (PIDFD_SELF_THREAD, recent kernels only): its process's
/// memory, also right after a fork, with no descriptor to open or inherit.
const PIDFD_SELF_THREAD: libc::c_int = -10000;

/// Whether [`discard_all`] was found not to work here (it then returns false at once): callers
/// with a cheaper way for one range at a time pick that instead.
pub fn batched_discard_refused() -> bool {
    BATCHED_DISCARD_REFUSED.load(Ordering::Relaxed)
}

/// Drop the pages of every range with one system call, so one TLB flush covers them all:
/// MADV_DONTNEED through `process_madvise` on the calling process, which recent kernels accept
/// and flush once per call for (measured on 6.18). A flush reaches every other CPU running the
/// process, which in a VM costs a few microseconds per call: for scattered pages, one call per
/// page was 6.5 µs a page here and one call for 32 of them 1.0 µs. Returns false when not every
/// range was dropped that way (an older kernel, a seccomp filter): the caller then drops them
/// one by one, which is harmless for ranges already dropped. Async-signal-safe.
///
/// # Safety
/// As [`discard`], for every range.
pub unsafe fn discard_all(ranges: &[libc::iovec]) -> bool {
    if ranges.is_empty() {
        return true;
    }
    if BATCHED_DISCARD_REFUSED.load(Ordering::Relaxed) {
        return false;
    }
    let total: usize = ranges.iter().map(|r| r.iov_len).sum();
    // SAFETY: dropping the ranges' pages is the caller's contract.
    let done = unsafe { dontneed_by_process_madvise(ranges) };
    if done < 0 {
        // Possibly not supported here (EBADF: no PIDFD_SELF; EINVAL: advice refused; ENOSYS,
        // EPERM); but EINVAL is also the answer for a range the advice cannot apply to (mlocked,
        // VM_PFNMAP), so only a call with no range at all failing too says the call itself is
        // refused: then do not ask again. Other errors (ENOMEM for an unmapped range) and
        // refused ranges leave it to the caller, this time.
        let errno = std::io::Error::last_os_error().raw_os_error();
        if matches!(errno, Some(libc::EBADF | libc::EINVAL | libc::ENOSYS | libc::EPERM))
            && !BATCHED_DISCARD_WORKS.load(Ordering::Relaxed)
            && !discard_none()
        {
            BATCHED_DISCARD_REFUSED.store(true, Ordering::Relaxed);
        }
        return false;
    }
    if !BATCHED_DISCARD_WORKS.load(Ordering::Relaxed) {
        BATCHED_DISCARD_WORKS.store(true, Ordering::Relaxed);
    }
    done as usize == total
}

/// `process_madvise(MADV_DONTNEED)` on the calling process with one empty range: whether the
/// kernel takes the call at all, apart from any range. Async-signal-safe.
fn discard_none() -> bool {
    let empty = [libc::iovec { iov_base: std::ptr::NonNull::<u8>::dangling().as_ptr().cast(), iov_len: 0 }];
    // SAFETY: one iovec of no bytes: no page is dropped.
    let done = unsafe { dontneed_by_process_madvise(&empty) };
    if done == 0 {
        BATCHED_DISCARD_WORKS.store(true, Ordering::Relaxed);
    }
    done == 0
}

/// `process_madvise(MADV_DONTNEED)` of `ranges` on the calling process: the bytes dropped, or
/// -1 with errno set. Async-signal-safe.
///
/// # Safety
/// As [`discard`], for every range.
unsafe fn dontneed_by_process_madvise(ranges: &[libc::iovec]) -> libc::c_long {
    // SAFETY: the iovecs are valid for reading for the call; dropping their pages is the
    // caller's contract. No flags are defined.
    unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            PIDFD_SELF_THREAD,
            ranges.as_ptr(),
            ranges.len(),
            libc::MADV_DONTNEED,
            0u32,
        )
    }
}

/// Drop the pages of `[addr, addr+len)` so the next access faults again (MADV_DONTNEED).
///
/// # Safety
/// The range must be mapped memory whose contents the caller is entitled to discard.
pub unsafe fn discard(addr: *mut u8, len: usize) -> Result<()> {
    // SAFETY: forwarded to the caller.
    unsafe { mm::madvise(addr.cast(), len, Advice::LinuxDontNeed) }
        .context(|| format!("madvise(DONTNEED) of {len} bytes at {addr:p}"))
}

/// One mapping of this process as the kernel keeps it (a VMA): `[start, end)`, its
/// protection (`PROT_*` bits) and what backs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Vma {
    /// First address.
    pub start: usize,
    /// One past the last address.
    pub end: usize,
    /// `PROT_READ`, `PROT_WRITE` and `PROT_EXEC` as the mapping has them.
    pub prot: i32,
    /// Shared (MAP_SHARED) rather than private.
    pub shared: bool,
    /// Backed by a file (an inode or a device: also hugetlbfs and shared memory), not anonymous.
    pub file: bool,
}

// _IOWR('f', 17, struct procmap_query)
const PROCMAP_QUERY: u32 = (3 << 30)
    | ((std::mem::size_of::<linux_raw_sys::general::procmap_query>() as u32) << 16)
    | ((b'f' as u32) << 8)
    | 17;

/// The kernel's mappings that overlap `[start, end)`, in address order, written to `out`;
/// returns how many (a full `out` may mean more follow). Asks PROCMAP_QUERY (Linux >= 6.11)
/// on /proc/self/maps, one mapping per call, or on older kernels reads the file's text into a
/// buffer on the stack: nothing is allocated, so it is safe to call with the preload's locks
/// held. Err: /proc/self/maps could not be opened or read (no descriptor left).
pub fn vmas(start: usize, end: usize, out: &mut [Vma]) -> std::result::Result<usize, Errno> {
    use linux_raw_sys::general as uapi;
    let maps = rustix::fs::open(
        "/proc/self/maps",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let mut n = 0;
    let mut at = start;
    while at < end && n < out.len() {
        // SAFETY: procmap_query is plain integers; all zeros is a valid value.
        let mut query: uapi::procmap_query = unsafe { std::mem::zeroed() };
        query.size = std::mem::size_of::<uapi::procmap_query>() as u64;
        query.query_flags = uapi::procmap_query_flags::PROCMAP_QUERY_COVERING_OR_NEXT_VMA as u64;
        query.query_addr = at as u64;
        // SAFETY: PROCMAP_QUERY reads and fills a procmap_query of the given size; no name or
        // build id is asked for (their sizes are 0), so the kernel writes nowhere else.
        let rc = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut query as *mut uapi::procmap_query) };
        if rc < 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                // No mapping at or after `at`.
                Some(libc::ENOENT) => break,
                // No PROCMAP_QUERY (Linux < 6.11): the same from the file's text.
                Some(libc::ENOTTY | libc::EINVAL) if n == 0 => {
                    // This thread's view: /proc/self/maps of a process whose main thread has
                    // ended reads as empty.
                    let text = rustix::fs::open(
                        "/proc/thread-self/maps",
                        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                        rustix::fs::Mode::empty(),
                    )?;
                    return vmas_from_text(&text, start, end, out);
                }
                e => return Err(Errno::from_raw_os_error(e.unwrap_or(libc::EIO))),
            }
        }
        let (vma_start, vma_end) = (query.vma_start as usize, query.vma_end as usize);
        if vma_start >= end || vma_end <= at {
            break;
        }
        let flag = |f: uapi::procmap_query_flags, prot: i32| if query.vma_flags & f as u64 != 0 { prot } else { 0 };
        let prot = flag(uapi::procmap_query_flags::PROCMAP_QUERY_VMA_READABLE, libc::PROT_READ)
            | flag(uapi::procmap_query_flags::PROCMAP_QUERY_VMA_WRITABLE, libc::PROT_WRITE)
            | flag(uapi::procmap_query_flags::PROCMAP_QUERY_VMA_EXECUTABLE, libc::PROT_EXEC);
        let shared = query.vma_flags & uapi::procmap_query_flags::PROCMAP_QUERY_VMA_SHARED as u64 != 0;
        let file = query.inode != 0 || query.dev_major != 0 || query.dev_minor != 0;
        out[n] = Vma { start: vma_start, end: vma_end, prot, shared, file };
        n += 1;
        at = vma_end;
    }
    Ok(n)
}

/// [`vmas`] from the text of a maps file (`maps`, opened and not read yet), for kernels
/// without PROCMAP_QUERY: read a buffer at a time and parsed as it comes, nothing allocated.
fn vmas_from_text(maps: impl AsFd, start: usize, end: usize, out: &mut [Vma]) -> std::result::Result<usize, Errno> {
    // Every field before the path fits in about 100 bytes; the stack may be a signal
    // handler's small alternate one.
    let mut buf = [0u8; 512];
    let (mut filled, mut n) = (0, 0);
    // A mapping's line: false once the list has what was asked for.
    let mut take = |line: &[u8]| match parse_maps_line(line) {
        Some(vma) if vma.start >= end || n == out.len() => false,
        Some(vma) if vma.end > start => {
            out[n] = vma;
            n += 1;
            true
        }
        _ => true,
    };
    // In a line longer than the buffer whose start (every field but the path) was taken.
    let mut skipping = false;
    loop {
        let read = match rustix::io::read(&maps, &mut buf[filled..]) {
            Ok(read) => read,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
        };
        filled += read;
        let mut at = 0;
        while at < filled {
            let (line, next, long) = match buf[at..filled].iter().position(|&b| b == b'\n') {
                Some(i) => (&buf[at..at + i], at + i + 1, false),
                None if read == 0 => (&buf[at..filled], filled, false),
                None if at == 0 && filled == buf.len() => (&buf[..filled], filled, true),
                None => break,
            };
            if !std::mem::replace(&mut skipping, long) && !take(line) {
                return Ok(n);
            }
            at = next;
        }
        if read == 0 {
            return Ok(n);
        }
        buf.copy_within(at..filled, 0);
        filled -= at;
    }
}

/// One line of /proc/PID/maps: `start-end perms offset major:minor inode [path]` (numbers in
/// hex but the inode); None if it is not one.
fn parse_maps_line(line: &[u8]) -> Option<Vma> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let hex = |f: &[u8]| usize::from_str_radix(std::str::from_utf8(f).ok()?, 16).ok();
    let range = fields.next()?;
    let dash = range.iter().position(|&b| b == b'-')?;
    let (vma_start, vma_end) = (hex(&range[..dash])?, hex(&range[dash + 1..])?);
    let perms = fields.next()?;
    if perms.len() < 4 {
        return None;
    }
    let bit = |i: usize, c: u8, prot: i32| if perms[i] == c { prot } else { 0 };
    let prot = bit(0, b'r', libc::PROT_READ) | bit(1, b'w', libc::PROT_WRITE) | bit(2, b'x', libc::PROT_EXEC);
    let _offset = fields.next()?;
    let dev = fields.next()?;
    let inode = std::str::from_utf8(fields.next()?).ok()?.parse::<u64>().ok()?;
    let file = inode != 0 || dev.iter().any(|&b| b != b'0' && b != b':');
    Some(Vma { start: vma_start, end: vma_end, prot, shared: perms[3] == b's', file })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    proptest! {
        /// Range lists built by merging and removing hold exactly the numbers a set would, and
        /// their gaps exactly the others.
        #[test]
        fn range_lists_match_a_set(ops in proptest::collection::vec((any::<bool>(), 0usize..64, 0usize..16), 0..24)) {
            let mut ranges = Vec::new();
            let mut model = [false; 80];
            for (add, from, len) in ops {
                let to = from + len;
                if add {
                    super::merge_range(&mut ranges, from, to);
                } else {
                    super::remove_range(&mut ranges, from, to);
                }
                model[from..to].iter_mut().for_each(|x| *x = add);
            }
            let held: Vec<usize> = ranges.iter().flat_map(|&(a, b)| a..b).collect();
            let expected: Vec<usize> = (0..80).filter(|&i| model[i]).collect();
            prop_assert_eq!(held, expected);
            prop_assert!(ranges.windows(2).all(|w| w[0].1 < w[1].0), "sorted, disjoint, merged: {:?}", ranges);
            let gaps: Vec<usize> = super::gaps_between(&ranges, 80).iter().flat_map(|&(a, b)| a..b).collect();
            let expected_gaps: Vec<usize> = (0..80).filter(|&i| !model[i]).collect();
            prop_assert_eq!(gaps, expected_gaps);
        }
    }

    use super::*;

    /// The Rss of the mapping that holds `addr`, in KiB, from /proc/self/smaps.
    fn rss_kib(addr: *mut u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let holds = |line: &str| {
            let Some((range, _)) = line.split_once(' ') else { return false };
            let Some((lo, hi)) = range.split_once('-') else { return false };
            match (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                (Ok(lo), Ok(hi)) => lo <= addr as usize && (addr as usize) < hi,
                _ => false,
            }
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        assert!(lines.next().is_some(), "no mapping holds {addr:p}");
        let rss = lines.find_map(|l| l.strip_prefix("Rss:")).unwrap();
        rss.trim().trim_end_matches("kB").trim().parse().unwrap()
    }

    #[test]
    fn zeros_read_as_zeros_and_hold_no_memory() {
        let zeros = Mapping::zeros(64 * PAGE_SIZE).unwrap();
        // SAFETY: the mapping's 64 pages, readable.
        let bytes = unsafe { std::slice::from_raw_parts(zeros.as_ptr(), 64 * PAGE_SIZE) };
        assert!(bytes.iter().all(|&b| b == 0));
        let populated = Mapping::anonymous(64 * PAGE_SIZE, true).unwrap();
        assert!(rss_kib(populated.as_ptr()) >= 256, "a populated mapping holds its pages");
        assert_eq!(rss_kib(zeros.as_ptr()), 0, "the zero page is not counted as the mapping's memory");
    }

    #[test]
    fn vmas_lists_the_kernels_mappings_with_their_protection() {
        let map = Mapping::anonymous(4 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr() as usize;
        let protect = |page: usize, prot: mm::MprotectFlags| {
            // SAFETY: one page of the mapping above, owned here and not touched while changed.
            unsafe { mm::mprotect((base + page * PAGE_SIZE) as *mut libc::c_void, PAGE_SIZE, prot) }.unwrap();
        };
        protect(1, mm::MprotectFlags::empty());
        protect(2, mm::MprotectFlags::READ);
        let mut out = [Vma::default(); 8];
        let n = match vmas(base, base + 4 * PAGE_SIZE, &mut out) {
            Ok(n) => n,
            Err(e) => {
                eprintln!("SKIPPED vmas_lists_the_kernels_mappings_with_their_protection: PROCMAP_QUERY (Linux >= 6.11) is not available: {e}");
                return;
            }
        };
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let page = |k: usize| base + k * PAGE_SIZE;
        // The first and last parts may be merged with neighbouring mappings of the same kind.
        assert_eq!(n, 4, "{:?}", &out[..n]);
        assert_eq!((out[0].end, out[0].prot), (page(1), rw));
        assert_eq!(out[1], Vma { start: page(1), end: page(2), prot: 0, ..Default::default() });
        assert_eq!(out[2], Vma { start: page(2), end: page(3), prot: libc::PROT_READ, ..Default::default() });
        assert_eq!((out[3].start, out[3].prot), (page(3), rw));
        // Only what overlaps the range, and no more than `out` holds.
        assert_eq!(vmas(page(1), page(2), &mut out), Ok(1));
        assert_eq!(out[0].prot, 0);
        assert_eq!(vmas(base, page(4), &mut out[..2]), Ok(2));
        // A file's mapping and a shared one say so (the anonymous private ones above do not).
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        // SAFETY: a new read-only private mapping of a file, unmapped below, nothing else there.
        let text =
            unsafe { mm::mmap(std::ptr::null_mut(), PAGE_SIZE, mm::ProtFlags::READ, mm::MapFlags::PRIVATE, &file, 0) }
                .unwrap() as usize;
        // SAFETY: as above, anonymous and shared.
        let shared =
            unsafe { mm::mmap_anonymous(std::ptr::null_mut(), PAGE_SIZE, mm::ProtFlags::READ, mm::MapFlags::SHARED) }
                .unwrap() as usize;
        assert_eq!(vmas(text, text + PAGE_SIZE, &mut out), Ok(1));
        assert!(out[0].file && !out[0].shared, "{:?}", out[0]);
        assert_eq!(vmas(shared, shared + PAGE_SIZE, &mut out), Ok(1));
        // (Shared anonymous memory is backed by shmem, a file of its own.)
        assert!(out[0].shared, "{:?}", out[0]);
        for addr in [text, shared] {
            // SAFETY: the mappings made above, unused now.
            unsafe { mm::munmap(addr as *mut libc::c_void, PAGE_SIZE) }.unwrap();
        }
    }

    #[test]
    fn the_maps_text_lists_what_procmap_query_lists() {
        let map = Mapping::anonymous(4 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr() as usize;
        // SAFETY: pages of the mapping above, owned here.
        unsafe { mm::mprotect((base + PAGE_SIZE) as *mut libc::c_void, PAGE_SIZE, mm::MprotectFlags::READ) }.unwrap();
        let exe = std::fs::File::open("/proc/self/exe").unwrap();
        // SAFETY: a new read-only private mapping of a file, unmapped with `text` below.
        let text =
            unsafe { mm::mmap(std::ptr::null_mut(), PAGE_SIZE, mm::ProtFlags::READ, mm::MapFlags::SHARED, &exe, 0) }
                .unwrap() as usize;
        let maps = || std::fs::File::open("/proc/self/maps").unwrap();
        for (start, end) in [(base, base + 4 * PAGE_SIZE), (base + PAGE_SIZE, base + 2 * PAGE_SIZE), (text, text + 1)] {
            let (mut queried, mut parsed) = ([Vma::default(); 4], [Vma::default(); 4]);
            let Ok(q) = vmas(start, end, &mut queried) else {
                eprintln!("SKIPPED the_maps_text_lists_what_procmap_query_lists: PROCMAP_QUERY (Linux >= 6.11) is not available to compare with");
                break;
            };
            let p = vmas_from_text(maps(), start, end, &mut parsed).unwrap();
            assert_eq!(parsed[..p], queried[..q], "[{start:#x}, {end:#x})");
        }
        assert!(vmas_from_text(maps(), text, text + 1, &mut [Vma::default(); 1]) == Ok(1));
        // SAFETY: the mapping made above, unused now.
        unsafe { mm::munmap(text as *mut libc::c_void, PAGE_SIZE) }.unwrap();
    }

    #[test]
    fn the_maps_text_parser_takes_long_paths_and_a_last_line_without_newline() {
        let long = "x".repeat(10_000);
        let lines = format!(
            "1000-3000 r-xp 00000000 08:01 1234 /bin/{long}\n\
             5000-6000 rw-p 00000000 00:00 0 \n\
             6000-8000 ---s 00000000 00:05 77 /dev/zero (deleted)\n\
             9000-a000 rw-p 00000000 00:00 0"
        );
        let mut file = std::fs::File::from(rustix::fs::memfd_create("maps", rustix::fs::MemfdFlags::CLOEXEC).unwrap());
        std::io::Write::write_all(&mut file, lines.as_bytes()).unwrap();
        let all = |start, end| {
            std::io::Seek::rewind(&mut &file).unwrap();
            let mut out = [Vma::default(); 8];
            let n = vmas_from_text(&file, start, end, &mut out).unwrap();
            out[..n].iter().map(|v| (v.start, v.end, v.prot, v.shared, v.file)).collect::<Vec<_>>()
        };
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        assert_eq!(
            all(0, usize::MAX),
            [
                (0x1000, 0x3000, libc::PROT_READ | libc::PROT_EXEC, false, true),
                (0x5000, 0x6000, rw, false, false),
                (0x6000, 0x8000, 0, true, true),
                (0x9000, 0xa000, rw, false, false),
            ]
        );
        assert_eq!(all(0x2fff, 0x5001).len(), 2);
        assert_eq!(all(0x3000, 0x5000), []);
        assert_eq!(all(0x9fff, 0xa000).len(), 1);
    }

    #[test]
    fn discard_all_drops_exactly_the_given_ranges() {
        let map = Mapping::anonymous(8 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr();
        // SAFETY: the mapping is 8 pages, owned here.
        unsafe { std::ptr::write_bytes(base, 7, 8 * PAGE_SIZE) };
        let range = |page: usize, pages: usize| libc::iovec {
            // SAFETY: inside the mapping.
            iov_base: unsafe { base.add(page * PAGE_SIZE) }.cast(),
            iov_len: pages * PAGE_SIZE,
        };
        // SAFETY: pages of the mapping above, whose contents nobody needs.
        if !unsafe { discard_all(&[range(1, 1), range(3, 2), range(7, 1)]) } {
            eprintln!("SKIPPED discard_all_drops_exactly_the_given_ranges: process_madvise(MADV_DONTNEED) on oneself is not available on this kernel");
            return;
        }
        // SAFETY: the mapping's 8 pages, readable.
        let bytes = unsafe { std::slice::from_raw_parts(base, 8 * PAGE_SIZE) };
        let first_bytes: Vec<u8> = (0..8).map(|p| bytes[p * PAGE_SIZE]).collect();
        assert_eq!(first_bytes, [7, 0, 7, 0, 0, 7, 7, 0]);
        // SAFETY: an empty list touches nothing.
        assert!(unsafe { discard_all(&[]) });
    }

    #[test]
    fn a_range_the_kernel_refuses_to_drop_leaves_batched_discards_on() {
        if !discard_none() {
            eprintln!("SKIPPED a_range_the_kernel_refuses_to_drop_leaves_batched_discards_on: process_madvise(MADV_DONTNEED) on oneself is not available on this kernel");
            return;
        }
        let map = Mapping::anonymous(2 * PAGE_SIZE, false).unwrap();
        let base = map.as_ptr();
        // SAFETY: the mapping's first page, owned here; locked until the mapping goes.
        if unsafe { libc::mlock(base.cast(), PAGE_SIZE) } != 0 {
            eprintln!(
                "SKIPPED a_range_the_kernel_refuses_to_drop_leaves_batched_discards_on: mlock: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        // SAFETY: the mapping's two pages, writable.
        unsafe { std::ptr::write_bytes(base, 7, 2 * PAGE_SIZE) };
        let page = |p: usize| libc::iovec {
            // SAFETY: inside the mapping.
            iov_base: unsafe { base.add(p * PAGE_SIZE) }.cast(),
            iov_len: PAGE_SIZE,
        };
        // SAFETY: pages of the mapping above, whose contents nobody needs.
        assert!(!unsafe { discard_all(&[page(0)]) }, "MADV_DONTNEED dropped an mlocked page");
        assert!(!batched_discard_refused(), "one locked range turned batched discards off for good");
        // SAFETY: as above.
        assert!(unsafe { discard_all(&[page(1)]) });
        // SAFETY: the mapping's two pages, readable.
        let bytes = unsafe { std::slice::from_raw_parts(base, 2 * PAGE_SIZE) };
        assert_eq!((bytes[0], bytes[PAGE_SIZE]), (7, 0), "the locked page kept, the other dropped");
    }
}
