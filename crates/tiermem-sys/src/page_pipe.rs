//! A pipe holding pages of this process by reference: a page's contents as of the moment it
//! leaves the address space, kept past that moment.
//!
//! vmsplice(2) without SPLICE_F_GIFT puts references to the pages themselves in a pipe, not
//! copies: a write to a page after the splice is what a later read of the pipe returns, until
//! the page is dropped from the address space (MADV_DONTNEED), after which nothing can write it.
//! So hold, drop, read yields each page's final contents with no window for a lost write, and the
//! drops of a batch of scattered pages can share one TLB flush ([`crate::mem::discard_all`]),
//! where UFFDIO_MOVE, the other way to take a page atomically, flushes once per run of
//! contiguous pages.

use std::os::fd::OwnedFd;

use rustix::pipe::{IoSliceRaw, PipeFlags, SpliceFlags};

use crate::guarded_fd::Guarded;
use crate::{Error, ErrorKind, Result, ResultExt, PAGE_SIZE};

/// A pipe with room for a fixed number of page references.
#[derive(Debug)]
pub struct PagePipe {
    read: Guarded<OwnedFd>,
    write: Guarded<OwnedFd>,
    pages: usize,
}

impl PagePipe {
    /// A non-blocking pipe with room for at least `pages` pages.
    pub fn new(pages: usize) -> Result<Self> {
        let (read, write) =
            rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK).context(|| "pipe2".into())?;
        let wanted = pages * PAGE_SIZE;
        let got = rustix::pipe::fcntl_setpipe_size(&write, wanted)
            .context(|| format!("F_SETPIPE_SZ {wanted} (see /proc/sys/fs/pipe-max-size)"))?;
        if got < wanted {
            return Err(Error::new(ErrorKind::Unsupported, format!("a pipe of {wanted} bytes got {got}")));
        }
        Ok(Self { read: Guarded::new(read), write: Guarded::new(write), pages })
    }

    /// Pages it has room for.
    pub fn capacity_pages(&self) -> usize {
        self.pages
    }

    /// Put references to the pages `ranges` name in the pipe, in order. Returns the bytes taken:
    /// all of them, or those before a range that could not be taken (not mapped, not readable,
    /// no room), 0 on an error at the first. Async-signal-safe.
    ///
    /// A page that is not present is faulted in by the kernel, as for any system call reading
    /// user memory: callers hold pages known to be mapped.
    pub fn hold(&self, ranges: &[libc::iovec]) -> usize {
        if ranges.is_empty() {
            return 0;
        }
        // SAFETY: IoSliceRaw is documented ABI-compatible with iovec (a transparent wrapper), so
        // the slice reinterpreted names the same ranges for the same lifetime.
        let slices = unsafe { std::slice::from_raw_parts(ranges.as_ptr().cast::<IoSliceRaw<'_>>(), ranges.len()) };
        // rustix's raw system call, not libc's: inside `tiermem run` the preload's wrappers of
        // I/O calls (and of syscall() itself) come first, and take locks that the program may
        // hold while this runs (in the reclaim thread, or in the SIGBUS handler).
        // SAFETY: the ranges name mapped memory, readable for the call; the kernel only takes
        // references to the pages, which keep them alive as long as the pipe holds them.
        unsafe { rustix::pipe::vmsplice(&*self.write, slices, SpliceFlags::empty()) }.unwrap_or(0)
    }

    /// Read the next `pages.len()` pages the pipe holds into `pages` (each PAGE_SIZE writable
    /// bytes). Returns the bytes read, short only when the pipe held fewer. Async-signal-safe.
    pub fn take(&self, pages: &[libc::iovec]) -> usize {
        let want: usize = pages.iter().map(|p| p.iov_len).sum();
        let mut done = 0;
        while done < want {
            // Resume after what was read: skip whole buffers, then part of one.
            let first = done / PAGE_SIZE;
            let skip = done % PAGE_SIZE;
            let mut rest = [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 64];
            let count = (pages.len() - first).min(rest.len());
            rest[..count].copy_from_slice(&pages[first..first + count]);
            rest[0].iov_base = rest[0].iov_base.wrapping_byte_add(skip);
            rest[0].iov_len -= skip;
            // SAFETY: std's IoSliceMut is documented ABI-compatible with iovec on Unix; the
            // iovecs name writable buffers the caller gives for this call alone.
            let bufs =
                unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr().cast::<std::io::IoSliceMut<'_>>(), count) };
            // rustix's raw system call, past the preload's `readv` (see `hold`).
            match rustix::io::readv(&*self.read, bufs) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
        }
        done
    }

    /// Throw away whatever the pipe holds, read through `scratch`. Async-signal-safe.
    pub fn clear(&self, scratch: &mut [u8]) {
        loop {
            match rustix::io::read(&*self.read, &mut *scratch) {
                Ok(0) | Err(rustix::io::Errno::AGAIN) => return,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::Mapping;

    fn iov(ptr: *mut u8) -> libc::iovec {
        libc::iovec { iov_base: ptr.cast(), iov_len: PAGE_SIZE }
    }

    /// The bytes of `map`, which the test owns (`&mut`: one slice at a time).
    fn bytes(map: &mut Mapping) -> &mut [u8] {
        // SAFETY: the mapping is readable and writable, owned by the test, and only touched
        // through the slice returned here while it is in use.
        unsafe { std::slice::from_raw_parts_mut(map.as_ptr(), map.len()) }
    }

    /// The pipe returns what a page held when it was dropped, including a write made after the
    /// page was put in the pipe; the page itself then reads as zeros.
    #[test]
    fn holds_a_page_past_its_drop() {
        let pipe = PagePipe::new(4).unwrap();
        let mut map = Mapping::anonymous(4 * PAGE_SIZE, false).unwrap();
        for (k, page) in bytes(&mut map).chunks_mut(PAGE_SIZE).enumerate() {
            page.fill(k as u8 + 1);
        }
        let base = map.as_ptr();
        let held = [iov(base), iov(base.wrapping_add(2 * PAGE_SIZE))];
        assert_eq!(pipe.hold(&held), 2 * PAGE_SIZE);
        // Written after the hold, before the drop: the pipe must show it.
        bytes(&mut map)[2 * PAGE_SIZE + 100] = 0xee;
        // SAFETY: the test's own pages, whose contents it gives up.
        let dropped = unsafe { crate::mem::discard_all(&held) };
        if !dropped {
            // SAFETY: as above.
            unsafe { crate::mem::discard(base, 4 * PAGE_SIZE) }.unwrap();
        }
        // A write after the drop lands in a new page, not in what the pipe holds.
        bytes(&mut map)[2 * PAGE_SIZE + 200] = 0x77;
        let mut out = vec![0u8; 2 * PAGE_SIZE];
        let into = [iov(out.as_mut_ptr()), iov(out.as_mut_ptr().wrapping_add(PAGE_SIZE))];
        assert_eq!(pipe.take(&into), 2 * PAGE_SIZE);
        assert!(out[..PAGE_SIZE].iter().all(|&b| b == 1));
        assert_eq!(out[PAGE_SIZE + 100], 0xee);
        assert_eq!(out[PAGE_SIZE + 200], 3);
        assert_eq!(bytes(&mut map)[2 * PAGE_SIZE], 0, "the dropped page reads as zeros");
        assert_eq!(pipe.take(&into[..1]), 0, "the pipe is empty");
    }

    #[test]
    fn refuses_an_unreadable_page_and_clears() {
        let pipe = PagePipe::new(2).unwrap();
        let map = Mapping::anonymous(PAGE_SIZE, true).unwrap();
        let unreadable = Mapping::anonymous(PAGE_SIZE, false).unwrap();
        let gone = unreadable.as_ptr();
        // SAFETY: the test's own mapping, not accessed again.
        unsafe { rustix::mm::mprotect(gone.cast(), PAGE_SIZE, rustix::mm::MprotectFlags::empty()) }.unwrap();
        assert_eq!(pipe.hold(&[iov(map.as_ptr()), iov(gone)]), PAGE_SIZE, "stops at the unreadable page");
        assert_eq!(pipe.hold(&[iov(gone)]), 0);
        let mut scratch = vec![0u8; PAGE_SIZE];
        pipe.clear(&mut scratch);
        let mut out = vec![0u8; PAGE_SIZE];
        assert_eq!(pipe.take(&[iov(out.as_mut_ptr())]), 0, "cleared");
        assert!(pipe.capacity_pages() >= 2);
    }
}
