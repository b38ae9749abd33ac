//! What happens to managed memory across fork().
//!
//! A child does not inherit userfaultfd registrations (the engine does not ask for fork events),
//! so in the child every managed region becomes ordinary private memory: resident pages are the
//! kernel's copy-on-write copies, and evicted pages would read as zeros. To give the child the
//! parent's data, the engine holds all its work still across the fork ([`Engine::hold_for_fork`])
//! and the child copies every page that is not resident from the device or from the in-flight
//! write buffer into its own memory ([`Engine::copy_into_forked_child`]) before fork() returns to
//! it. The parent's slots cannot change meanwhile: the caller keeps the hold until the child says
//! it is done. The child's copy is unmanaged (no budget, no engine threads); it is freed with
//! munmap.

use std::sync::RwLockWriteGuard;

use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

use crate::engine::Engine;
use crate::page::Kind;
use crate::region::RegionTable;

/// Stops faults, reclaim and region changes while held (the region table's write lock).
#[derive(Debug)]
pub struct ForkHold {
    table: RwLockWriteGuard<'static, RegionTable>,
}

/// What the child copied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChildCopy {
    /// Pages read from device slots.
    pub from_device: u64,
    /// Pages copied from buffers of writes or prefetches still in flight.
    pub from_buffers: u64,
}

impl Engine {
    /// Wait for in-progress faults and reclaim to finish and hold off new ones; call just before
    /// fork() and keep the hold in the parent until the child has run
    /// [`Engine::copy_into_forked_child`]. Needs a `'static` engine (the hold borrows it).
    pub fn hold_for_fork(&'static self) -> ForkHold {
        ForkHold { table: self.shared.regions.write().unwrap_or_else(|e| e.into_inner()) }
    }

    /// How many pages a fork made now would have to copy into the child (see
    /// [`Engine::copy_into_forked_child`]): the managed pages that are not resident, but for
    /// those `skip` names. An estimate: pages come and go until the fork holds the engine.
    pub fn pages_a_forked_child_copies(&self, skip: &dyn Fn(usize) -> bool) -> u64 {
        let table = self.shared.regions();
        let mut pages = 0;
        for region in table.slots.iter().flatten() {
            for (index, cell) in region.pages.iter().enumerate() {
                let kind = cell.peek().kind();
                if !matches!(kind, Kind::Untouched | Kind::Resident) && !skip(region.page_addr(index as u64) as usize) {
                    pages += 1;
                }
            }
        }
        pages
    }

    /// In the child of a fork made under `hold`: copy every managed page that is not resident
    /// into the child's own memory, so the child sees exactly the parent's data, and detach the
    /// SIGBUS handler. The engine must not be used in the child afterwards (its threads and
    /// queues belong to the parent); forget its regions instead of dropping them.
    ///
    /// Pages for which `skip(address)` is true are left alone: the program asked that the child
    /// get them wiped (MADV_WIPEONFORK: the kernel's zeros stay) or not at all (MADV_DONTFORK:
    /// nothing is mapped there in the child).
    pub fn copy_into_forked_child(&'static self, hold: &ForkHold, skip: &dyn Fn(usize) -> bool) -> Result<ChildCopy> {
        crate::delivery::detach_sigbus_in_child(&self.shared);
        let mut copied = ChildCopy::default();
        for region in hold.table.slots.iter().flatten() {
            // The part of the region the page lies in, made writable for the copy if the program
            // had made it read-only or inaccessible, and protected again once past it.
            let mut part = OpenedPart::default();
            for (index, cell) in region.pages.iter().enumerate() {
                let state = cell.peek();
                let addr = region.page_addr(index as u64);
                if matches!(state.kind(), Kind::Untouched | Kind::Resident) || skip(addr as usize) {
                    continue;
                }
                if !part.open_for(addr as usize) {
                    // Nothing mapped there in the child: advice the kernel applied before the
                    // engine took the memory over (MADV_DONTFORK on a reservation V8 then
                    // made usable).
                    continue;
                }
                // SAFETY: the page lies inside the region's mapping, which in the child is plain
                // private memory that only this thread touches until fork() returns.
                let page = unsafe { std::slice::from_raw_parts_mut(addr, PAGE_SIZE) };
                let holds_buffer = state.writing() || state.kind() == Kind::Prefetched;
                match state.kind() {
                    Kind::Untouched | Kind::Resident => {}
                    Kind::Evicted | Kind::Incoming | Kind::Prefetched if holds_buffer => {
                        page.copy_from_slice(self.shared.arena.bytes(state.buf()));
                        copied.from_buffers += 1;
                    }
                    Kind::Evicted | Kind::Incoming | Kind::Prefetched => {
                        let slot = state.slot().ok_or_else(|| {
                            Error::new(
                                ErrorKind::Internal,
                                format!("page {index} of region {} is evicted without a slot", region.index),
                            )
                        })?;
                        self.shared.device.read_slot_blocking(slot, page)?;
                        copied.from_device += 1;
                    }
                }
            }
        }
        Ok(copied)
    }
}

/// In a forked child, the kernel mapping a copy is going into, opened for writing while the
/// copy needs it if the program had protected it; protected again when dropped or when the copy
/// moves past it.
#[derive(Default)]
struct OpenedPart {
    /// The mapping's range and the protection to put back (0 end: none looked up yet), or the
    /// gap between mappings the last page fell in (`absent`).
    start: usize,
    end: usize,
    prot: Option<i32>,
    absent: bool,
}

impl OpenedPart {
    /// Make sure the page at `addr` can be written. False when nothing is mapped there.
    fn open_for(&mut self, addr: usize) -> bool {
        if (self.start..self.end).contains(&addr) {
            return !self.absent;
        }
        self.close();
        // The mapping at `addr`, or the next one.
        let mut vma = [tiermem_sys::mem::Vma::default(); 1];
        match tiermem_sys::mem::vmas(addr, usize::MAX, &mut vma) {
            Ok(1) if vma[0].start <= addr => {}
            Ok(n) => {
                // A gap, up to the next mapping: one query for all its pages.
                let end = if n == 1 { vma[0].start } else { usize::MAX };
                *self = Self { start: addr, end, prot: None, absent: true };
                return false;
            }
            Err(_) => {
                // Unknown (no descriptor left to read /proc/self/maps): mincore says whether
                // anything is mapped there (ENOMEM: no), and the page is then taken as the
                // engine made it, writable.
                let mut resident = 0u8;
                // SAFETY: mincore writes one byte per page of the range into `resident`: one
                // page here.
                let rc = unsafe { libc::mincore(addr as *mut libc::c_void, PAGE_SIZE, &mut resident) };
                let absent = rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM);
                *self = Self { start: addr, end: addr + PAGE_SIZE, prot: None, absent };
                return !absent;
            }
        }
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let prot = (vma[0].prot & rw != rw).then_some(vma[0].prot);
        *self = Self { start: vma[0].start, end: vma[0].end, prot, absent: false };
        if prot.is_some() {
            // SAFETY: the child's own private mapping, which only this thread uses until fork()
            // returns; its contents do not change.
            let _ = unsafe { raw_mprotect(self.start, self.end - self.start, rw) };
        }
        true
    }

    fn close(&mut self) {
        if let Some(prot) = self.prot.take() {
            // SAFETY: as in `open_for`: back to the program's own protection.
            let _ = unsafe { raw_mprotect(self.start, self.end - self.start, prot) };
        }
    }
}

/// mprotect straight to the kernel: not through `syscall()`, which a preloaded shim may wrap
/// (tiermem's sends mprotect by number to its own wrapper, whose locks the forked child must not
/// take).
///
/// # Safety
/// As mprotect: the range must be memory whose protection may change.
unsafe fn raw_mprotect(start: usize, len: usize, prot: i32) -> rustix::io::Result<()> {
    let flags = rustix::mm::MprotectFlags::from_bits_retain(prot as u32);
    // SAFETY: the caller's contract.
    unsafe { rustix::mm::mprotect(start as *mut libc::c_void, len, flags) }
}

impl Drop for OpenedPart {
    fn drop(&mut self) {
        self.close();
    }
}
