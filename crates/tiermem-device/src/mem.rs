//! The DRAM device: slots are plain memory and every request is a memcpy done at submission.
//! This is the "ideal" of the Ultraswap paper (its frontswap-to-DRAM baseline).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::event::{eventfd, EventfdFlags};
use tiermem_sys::mem::Mapping;
use tiermem_sys::{Error, Result, PAGE_SIZE};

use crate::{BufferArena, Completion, Device, DeviceCounters, IoQueue, QueueKind, Request, WaitMode};

/// Slots in anonymous memory.
#[derive(Debug)]
pub struct MemDevice {
    store: Arc<Mapping>,
    slots: u64,
    counters: Arc<DeviceCounters>,
}

impl MemDevice {
    /// A device of `capacity_bytes` (a non-zero multiple of 4096). Memory is taken only for
    /// slots that are written.
    pub fn new(capacity_bytes: u64) -> Result<Self> {
        if capacity_bytes == 0 || capacity_bytes % PAGE_SIZE as u64 != 0 {
            return Err(Error::invalid(format!("mem device capacity {capacity_bytes} is not a non-zero multiple of {PAGE_SIZE}")));
        }
        let store = Arc::new(Mapping::anonymous(capacity_bytes as usize, false)?);
        Ok(Self { store, slots: capacity_bytes / PAGE_SIZE as u64, counters: Arc::default() })
    }
}

impl Device for MemDevice {
    fn describe(&self) -> String {
        "mem (DRAM, memcpy)".into()
    }
    fn capacity_slots(&self) -> u64 {
        self.slots
    }
    fn open_queue(&self, kind: QueueKind, depth: u32, arena: &Arc<BufferArena>) -> Result<Box<dyn IoQueue>> {
        if depth == 0 || depth > 4096 {
            return Err(Error::invalid(format!("queue depth {depth} must be in 1..=4096")));
        }
        let notify = match kind {
            QueueKind::Completion => Some(eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(|e| Error::os(e.into(), "eventfd"))?),
            QueueKind::Polled => None,
        };
        Ok(Box::new(MemQueue {
            kind,
            depth: depth as usize,
            store: self.store.clone(),
            slots: self.slots,
            arena: arena.clone(),
            counters: self.counters.clone(),
            done: VecDeque::with_capacity(depth as usize),
            notify,
        }))
    }
    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }
}

/// A queue of the DRAM device: requests complete inside `push`.
#[derive(Debug)]
struct MemQueue {
    kind: QueueKind,
    depth: usize,
    store: Arc<Mapping>,
    slots: u64,
    arena: Arc<BufferArena>,
    counters: Arc<DeviceCounters>,
    done: VecDeque<u64>,
    notify: Option<OwnedFd>,
}

impl IoQueue for MemQueue {
    fn kind(&self) -> QueueKind {
        self.kind
    }
    fn wait_mode(&self) -> WaitMode {
        WaitMode::Synchronous
    }
    fn push(&mut self, request: Request, tag: u64) -> Result<()> {
        if self.done.len() >= self.depth {
            return Err(Error::new(tiermem_sys::ErrorKind::NoSpace, "queue full: reap completions first"));
        }
        let (slot, buf) = match request {
            Request::Read { slot, buf } | Request::Write { slot, buf } => (slot, buf),
        };
        if slot >= self.slots {
            return Err(Error::invalid(format!("slot {slot} is beyond the device's {} slots", self.slots)));
        }
        // SAFETY: slot < capacity, so the slot's PAGE_SIZE bytes lie inside the store mapping.
        let at = unsafe { self.store.as_ptr().add(slot as usize * PAGE_SIZE) };
        let page = self.arena.ptr(buf);
        match request {
            Request::Read { .. } => {
                // SAFETY: both ranges are PAGE_SIZE bytes of distinct live mappings; the caller
                // owns `buf` until the completion is reaped.
                unsafe { std::ptr::copy_nonoverlapping(at, page, PAGE_SIZE) };
                self.counters.record_read(PAGE_SIZE as u64, PAGE_SIZE as u64);
            }
            Request::Write { .. } => {
                // SAFETY: as above, in the other direction.
                unsafe { std::ptr::copy_nonoverlapping(page, at, PAGE_SIZE) };
                self.counters.record_write(PAGE_SIZE as u64, PAGE_SIZE as u64);
            }
        }
        self.done.push_back(tag);
        Ok(())
    }
    fn submit(&mut self) -> Result<usize> {
        if let Some(fd) = &self.notify {
            if !self.done.is_empty() {
                let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
            }
        }
        Ok(0)
    }
    fn reap(&mut self, on_done: &mut dyn FnMut(Completion)) -> usize {
        let n = self.done.len();
        for tag in self.done.drain(..) {
            on_done(Completion { tag, result: Ok(()) });
        }
        n
    }
    fn wait(&mut self, _min: usize, on_done: &mut dyn FnMut(Completion)) -> Result<usize> {
        Ok(self.reap(on_done))
    }
    fn in_flight(&self) -> usize {
        self.done.len()
    }
    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        self.notify.as_ref().map(|fd| fd.as_fd())
    }
}
