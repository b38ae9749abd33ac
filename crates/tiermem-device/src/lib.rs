//! Where evicted pages live.
//!
//! A [`Device`] stores 4 KiB pages in numbered *slots*. I/O goes through [`IoQueue`]s of two kinds,
//! as Ultraswap prescribes:
//! - [`QueueKind::Polled`]: the submitter waits for its own request by polling, never sleeping
//!   (io_uring with `IORING_SETUP_IOPOLL` where the file supports it, otherwise spinning on the
//!   completion ring). Used for the page a thread faulted on.
//! - [`QueueKind::Completion`]: requests complete in the background and are signalled through an
//!   eventfd (the user-space analogue of an interrupt). Used for prefetch and write-back.
//!
//! Requests are never merged, reordered or scheduled: one request is one 4 KiB slot.
//!
//! Page data moves only between slots and a [`BufferArena`]: a page-aligned region the device may
//! register with the kernel once (io_uring fixed buffers) so no request pins or maps memory.

pub mod arena;
mod backing;
pub mod counters;
pub mod file;
pub mod mem;
pub use file::FileDevice;
pub use mem::MemDevice;
pub mod slots;
pub mod spec;
#[cfg(test)]
mod testing;

use std::os::fd::BorrowedFd;
use std::sync::Arc;

pub use arena::{BufId, BufferArena};
pub use counters::{CounterSnapshot, DeviceCounters};
pub use slots::SlotAllocator;
pub use spec::DeviceSpec;
pub use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

/// Index of a 4 KiB page-sized slot on a device.
pub type Slot = u64;

/// The two kinds of queue of the Ultraswap I/O stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum QueueKind {
    /// The submitter polls for completion and never sleeps.
    Polled,
    /// Completion is signalled asynchronously through [`IoQueue::notify_fd`].
    Completion,
}

/// How a queue actually waits, which depends on what the kernel and the file allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum WaitMode {
    /// io_uring `IORING_SETUP_IOPOLL`: the kernel polls the device's queue, no interrupt.
    KernelPoll,
    /// The device raises interrupts, but the waiter spins on the completion ring in user space.
    SpinOnCompletionRing,
    /// The waiter sleeps until an eventfd signals completions.
    Interrupt,
    /// The request finishes during submission (the DRAM device: a memcpy).
    Synchronous,
}

/// What happened to one request.
#[derive(Debug)]
pub struct Completion {
    /// The tag given when the request was pushed.
    pub tag: u64,
    /// `Ok` when the whole 4 KiB page was transferred.
    pub result: Result<()>,
}

/// A request for one queue: pages between slots and arena buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// Read `slot` into arena buffer `buf`.
    Read { slot: Slot, buf: BufId },
    /// Read `pages` slots from `slot` into as many buffers from `buf` (a run: contiguous in the
    /// arena), in one request.
    ReadRun { slot: Slot, buf: BufId, pages: u32 },
    /// Write arena buffer `buf` to `slot`.
    Write { slot: Slot, buf: BufId },
    /// Write `pages` buffers from `buf` (a run: contiguous in the arena) to as many slots from
    /// `slot`, in one request.
    WriteRun { slot: Slot, buf: BufId, pages: u32 },
}

impl Request {
    /// The (first) slot the request reads or writes.
    pub fn slot(&self) -> Slot {
        match *self {
            Request::Read { slot, .. }
            | Request::ReadRun { slot, .. }
            | Request::Write { slot, .. }
            | Request::WriteRun { slot, .. } => slot,
        }
    }

    /// The (first) arena buffer the request reads into or writes from.
    pub fn buf(&self) -> BufId {
        match *self {
            Request::Read { buf, .. }
            | Request::ReadRun { buf, .. }
            | Request::Write { buf, .. }
            | Request::WriteRun { buf, .. } => buf,
        }
    }

    /// Pages the request moves.
    pub fn pages(&self) -> u32 {
        match *self {
            Request::ReadRun { pages, .. } | Request::WriteRun { pages, .. } => pages,
            Request::Read { .. } | Request::Write { .. } => 1,
        }
    }

    /// Whether it writes to the device.
    pub fn is_write(&self) -> bool {
        matches!(self, Request::Write { .. } | Request::WriteRun { .. })
    }

    /// "reading slot N" / "writing slot N" / "reading slots N..M", for error messages.
    pub fn describe(&self) -> String {
        match *self {
            Request::Read { slot, .. } => format!("reading slot {slot}"),
            Request::ReadRun { slot, pages, .. } => {
                format!("reading slots {slot}..{}", slot.saturating_add(u64::from(pages)))
            }
            Request::Write { slot, .. } => format!("writing slot {slot}"),
            Request::WriteRun { slot, pages, .. } => {
                format!("writing slots {slot}..{}", slot.saturating_add(u64::from(pages)))
            }
        }
    }
}

/// The deepest queue [`Device::open_queue`] accepts.
pub const MAX_QUEUE_DEPTH: u32 = 4096;

/// Reject a queue depth outside `1..=MAX_QUEUE_DEPTH`.
pub(crate) fn check_queue_depth(depth: u32) -> Result<()> {
    if depth == 0 || depth > MAX_QUEUE_DEPTH {
        return Err(Error::invalid(format!(
            "queue depth {depth} is out of range: it must be between 1 and {MAX_QUEUE_DEPTH}"
        )));
    }
    Ok(())
}

/// Reject a request whose slot is beyond `capacity_slots` or whose buffer is not in `arena`.
/// Refuse a blocking read of a slot outside the device or into anything but one aligned page.
pub(crate) fn check_blocking_read(slot: u64, capacity_slots: u64, dst: &[u8]) -> Result<()> {
    if slot >= capacity_slots {
        return Err(Error::invalid(format!("read of slot {slot}: the device has only {capacity_slots} slots")));
    }
    if dst.len() != PAGE_SIZE || !(dst.as_ptr() as usize).is_multiple_of(PAGE_SIZE) {
        return Err(Error::invalid(format!(
            "read of slot {slot}: the destination must be one page-aligned page, not {} bytes at {:p}",
            dst.len(),
            dst.as_ptr()
        )));
    }
    Ok(())
}

pub(crate) fn check_request(request: &Request, capacity_slots: u64, arena: &BufferArena) -> Result<()> {
    let pages = request.pages();
    if pages == 0 || pages > arena::RUN_PAGES {
        return Err(Error::invalid(format!("{}: {pages} pages in one request", request.describe())));
    }
    if request.slot().saturating_add(u64::from(pages)) > capacity_slots {
        return Err(Error::invalid(format!(
            "{}: the device has only {capacity_slots} slots (0..={})",
            request.describe(),
            capacity_slots.saturating_sub(1)
        )));
    }
    if request.buf().saturating_add(pages) > arena.end() {
        return Err(Error::invalid(format!(
            "{}: buffer {} is not in the arena of {} buffers",
            request.describe(),
            request.buf(),
            arena.end()
        )));
    }
    Ok(())
}

/// A submission/completion queue pair on a device. Owned by one thread at a time (`&mut self`);
/// the engine puts shared queues behind a lock.
pub trait IoQueue: Send + std::fmt::Debug {
    /// The kind this queue was opened as.
    fn kind(&self) -> QueueKind;

    /// How waiting on this queue is implemented.
    fn wait_mode(&self) -> WaitMode;

    /// Queue one request; it is not started before [`IoQueue::submit`]. `tag` comes back in its
    /// [`Completion`]. Fails with [`ErrorKind::NoSpace`] when the queue is full (submit or reap
    /// first) and [`ErrorKind::InvalidInput`] for a slot beyond the device's capacity.
    fn push(&mut self, request: Request, tag: u64) -> Result<()>;

    /// Start every queued request. Returns how many were started.
    fn submit(&mut self) -> Result<usize>;

    /// Hand at most `max` finished requests to `on_done`, oldest first, without blocking; the
    /// rest wait for the next call. Returns how many.
    fn reap(&mut self, max: usize, on_done: &mut dyn FnMut(Completion)) -> usize;

    /// Wait until at least `min` requests finished (counting those handed out by this call), and
    /// hand them to `on_done`. Polled queues poll; completion-driven queues sleep.
    fn wait(&mut self, min: usize, on_done: &mut dyn FnMut(Completion)) -> Result<usize>;

    /// Requests pushed or submitted whose completion was not handed out yet.
    fn in_flight(&self) -> usize;

    /// For completion-driven queues: an eventfd that becomes readable when completions are
    /// ready, so a thread can sleep on it without holding the queue's lock.
    fn notify_fd(&self) -> Option<BorrowedFd<'_>>;
}

/// Where evicted pages live.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// A short human-readable description ("file:/path (O_DIRECT, io_uring IOPOLL)", "mem").
    fn describe(&self) -> String;

    /// How many 4 KiB slots the device holds.
    fn capacity_slots(&self) -> u64;

    /// How many slots, from slot 0, have storage set aside for them now: a write to one of them
    /// cannot fail for want of space. A device that sets its storage aside as it fills (a
    /// regular file: see [`FileDevice`]) starts below its capacity; the others hold it all.
    fn backed_slots(&self) -> u64 {
        self.capacity_slots()
    }

    /// Set storage aside for slots `0..needed` at least, and for `0..wanted` (`wanted` >=
    /// `needed`, at most the capacity) if the medium has room: at once or in a larger step.
    /// Ok when `needed` is set aside, even where `wanted` was not (which is then asked for
    /// again no sooner than the device sees fit). ENOSPC when the medium has no room for
    /// `needed`, ENOMEM when the kernel refused the memory an extension needs (passing): the
    /// slots past [`Device::backed_slots`] must then not be written. An `io::Error` of an
    /// errno, so that nothing is allocated: the engine may ask from a fault handler.
    fn back_slots(&self, needed: u64, wanted: u64) -> std::io::Result<()> {
        if needed.max(wanted) > self.capacity_slots() {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }

    /// Open a queue of `kind` able to hold `depth` requests in flight, whose requests move data
    /// to and from `arena` only. The queue may register the arena with the kernel.
    fn open_queue(&self, kind: QueueKind, depth: u32, arena: &Arc<BufferArena>) -> Result<Box<dyn IoQueue>>;

    /// Bytes asked for and bytes moved to and from the medium, for write amplification.
    fn counters(&self) -> &DeviceCounters;

    /// Read one slot into `dst` (one page-aligned page) synchronously, outside any queue. For
    /// where queues cannot be used: a forked child shares its parent's rings and must not touch them.
    fn read_slot_blocking(&self, slot: u64, dst: &mut [u8]) -> Result<()>;

    /// Bytes of this process's own memory that hold stored pages, or None when they live
    /// elsewhere (a file, a disk). The `mem` device keeps every slot it has written resident, and
    /// a memory cgroup charges that to the program although it stands for far memory.
    fn memory_held(&self) -> Option<u64> {
        None
    }
}
