//! Anonymous memory mappings and the madvise calls the engine needs.

use std::ptr::NonNull;

use rustix::mm::{self, Advice, MapFlags, ProtFlags};

use crate::{Error, Result, ResultExt, PAGE_SIZE};

/// An anonymous private mapping, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is plain memory addresses; synchronising access to its bytes is the owner's job.
unsafe impl Send for Mapping {}
// SAFETY: as above; the struct itself is immutable after creation.
unsafe impl Sync for Mapping {}

impl Mapping {
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
        Ok(Self { ptr, len })
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
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe exactly the mapping created in `anonymous`, owned by self.
        let _ = unsafe { mm::munmap(self.ptr.as_ptr().cast(), self.len) };
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
