//! The DRAM device: slots are plain memory and every request is a memcpy done at submission.
//! This is the "ideal" of the Ultraswap paper (its frontswap-to-DRAM baseline).
//!
//! Slots live in one anonymous `MAP_NORESERVE` mapping that is not populated, so a slot costs
//! memory only once it is written; reading a never-written slot yields zeros.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustix::event::{eventfd, EventfdFlags};
use tiermem_sys::mem::Mapping;

use crate::{
    check_blocking_read, check_queue_depth, check_request, BufferArena, Completion, Device, DeviceCounters, Error,
    ErrorKind, IoQueue, QueueKind, Request, Result, WaitMode, PAGE_SIZE,
};

/// A device whose slots are anonymous memory.
///
/// Like a disk, it does not order requests to one slot that are in flight at the same time on
/// different queues; the engine never has two requests for one slot in flight.
#[derive(Debug)]
pub struct MemDevice {
    store: Arc<SlotMemory>,
    counters: Arc<DeviceCounters>,
}

/// The mapping that holds the slots, shared by the device and its queues.
#[derive(Debug)]
struct SlotMemory {
    mapping: Mapping,
    slots: u64,
    /// One past the highest slot ever written: the mapping is populated below it (slots are
    /// handed out lowest first), so this is what the store costs in memory.
    written_end: AtomicU64,
}

impl SlotMemory {
    /// Address of the first byte of `slot`, which must be below `self.slots`.
    fn slot_ptr(&self, slot: u64) -> *mut u8 {
        assert!(slot < self.slots, "slot {slot} is beyond the {} slots of the mem device", self.slots);
        // SAFETY: slot < slots, so slot * PAGE_SIZE + PAGE_SIZE <= mapping.len(): in bounds.
        unsafe { self.mapping.as_ptr().add(slot as usize * PAGE_SIZE) }
    }
}

impl MemDevice {
    /// A DRAM device of `capacity_bytes`, a non-zero multiple of 4096.
    pub fn new(capacity_bytes: u64) -> Result<Self> {
        if capacity_bytes == 0 || !capacity_bytes.is_multiple_of(PAGE_SIZE as u64) {
            return Err(Error::invalid(format!(
                "mem device capacity of {capacity_bytes} bytes is not a non-zero multiple of {PAGE_SIZE} (one slot)"
            )));
        }
        let len = usize::try_from(capacity_bytes).map_err(|_| {
            Error::invalid(format!("mem device capacity of {capacity_bytes} bytes does not fit in memory"))
        })?;
        let mapping = Mapping::anonymous(len, false).map_err(|e| e.context("creating the mem device"))?;
        let store = SlotMemory { mapping, slots: capacity_bytes / PAGE_SIZE as u64, written_end: AtomicU64::new(0) };
        Ok(Self { store: Arc::new(store), counters: Arc::new(DeviceCounters::default()) })
    }
}

impl Device for MemDevice {
    fn describe(&self) -> String {
        "mem".to_string()
    }

    fn capacity_slots(&self) -> u64 {
        self.store.slots
    }

    fn open_queue(&self, kind: QueueKind, depth: u32, arena: &Arc<BufferArena>) -> Result<Box<dyn IoQueue>> {
        check_queue_depth(depth)?;
        let ready_signal = match kind {
            QueueKind::Polled => None,
            QueueKind::Completion => Some(
                eventfd(0, EventfdFlags::CLOEXEC)
                    .map(tiermem_sys::guarded_fd::Guarded::new)
                    .map_err(|e| Error::os(e.into(), "creating the completion eventfd of a mem device queue"))?,
            ),
        };
        Ok(Box::new(MemQueue {
            kind,
            depth: depth as usize,
            store: self.store.clone(),
            arena: arena.clone(),
            counters: self.counters.clone(),
            queued: VecDeque::new(),
            finished: VecDeque::new(),
            ready_signal,
        }))
    }

    fn counters(&self) -> &DeviceCounters {
        &self.counters
    }

    fn read_slot_blocking(&self, slot: u64, dst: &mut [u8]) -> Result<()> {
        check_blocking_read(slot, self.store.slots, dst)?;
        // SAFETY: the slot is in range (checked), so its page lies inside the store mapping, and
        // dst is a distinct caller-owned page.
        let src = unsafe { std::slice::from_raw_parts(self.store.slot_ptr(slot), PAGE_SIZE) };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn memory_held(&self) -> Option<u64> {
        Some(self.store.written_end.load(Ordering::Relaxed) * PAGE_SIZE as u64)
    }
}

/// A queue of a [`MemDevice`]: requests are copied at [`IoQueue::submit`] and their completions
/// kept until reaped.
///
/// A completion queue's [`IoQueue::notify_fd`] is a blocking eventfd that `submit` increments
/// whenever it finished requests. A thread that sleeps on it (read(2) or poll(2)) should read it,
/// which resets it, and then call [`IoQueue::reap`]; wake-ups without completions left to reap are
/// possible when `wait` or an earlier `reap` already handed them out.
#[derive(Debug)]
pub struct MemQueue {
    kind: QueueKind,
    depth: usize,
    store: Arc<SlotMemory>,
    arena: Arc<BufferArena>,
    counters: Arc<DeviceCounters>,
    /// Pushed, not yet submitted.
    queued: VecDeque<(Request, u64)>,
    /// Done, not yet handed out.
    finished: VecDeque<Completion>,
    ready_signal: Option<tiermem_sys::guarded_fd::Guarded<OwnedFd>>,
}

impl MemQueue {
    fn copy(&self, request: Request) {
        match request {
            Request::Read { slot, buf } | Request::ReadRun { slot, buf, .. } => {
                let len = request.pages() as usize * PAGE_SIZE;
                let from = self.store.slot_ptr(slot);
                let to = self.arena.ptr(buf);
                // SAFETY: both are `len` bytes inside live mappings (a run's buffers and slots
                // are contiguous; checked at push); the caller owns the buffers until the
                // completion and the slot mapping is a different mapping, so they do not overlap.
                unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
                self.counters.record_read(len as u64, len as u64);
            }
            Request::Write { slot, buf } | Request::WriteRun { slot, buf, .. } => {
                let len = request.pages() as usize * PAGE_SIZE;
                let from = self.arena.ptr(buf);
                let to = self.store.slot_ptr(slot);
                // SAFETY: as for reads, with the direction reversed; a run's buffers and slots
                // are contiguous and inside their mappings (checked at push).
                unsafe { std::ptr::copy_nonoverlapping(from, to, len) };
                self.store.written_end.fetch_max(slot + u64::from(request.pages()), Ordering::Relaxed);
                self.counters.record_write(len as u64, len as u64);
            }
        }
    }

    fn signal_ready(&self) {
        if let Some(fd) = &self.ready_signal {
            // An eventfd write fails only if the counter would reach u64::MAX, after ~2^64 signals
            // nobody read; there is nothing better to do than drop that one.
            let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
        }
    }
}

impl IoQueue for MemQueue {
    fn kind(&self) -> QueueKind {
        self.kind
    }

    fn wait_mode(&self) -> WaitMode {
        WaitMode::Synchronous
    }

    fn push(&mut self, request: Request, tag: u64) -> Result<()> {
        check_request(&request, self.store.slots, &self.arena)?;
        if self.in_flight() >= self.depth {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "{}: the mem device queue is full ({} requests); submit and reap first",
                    request.describe(),
                    self.depth
                ),
            ));
        }
        self.queued.push_back((request, tag));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        let started = self.queued.len();
        while let Some((request, tag)) = self.queued.pop_front() {
            self.copy(request);
            self.finished.push_back(Completion { tag, result: Ok(()) });
        }
        if started > 0 {
            self.signal_ready();
        }
        Ok(started)
    }

    fn reap(&mut self, max: usize, on_done: &mut dyn FnMut(Completion)) -> usize {
        let done = self.finished.len().min(max);
        self.finished.drain(..done).for_each(&mut *on_done);
        done
    }

    /// Submits what is queued, then hands out every finished request. `min` beyond what is in
    /// flight is capped: those requests can never finish.
    fn wait(&mut self, _min: usize, on_done: &mut dyn FnMut(Completion)) -> Result<usize> {
        self.submit()?;
        Ok(self.reap(usize::MAX, on_done))
    }

    fn in_flight(&self) -> usize {
        self.queued.len() + self.finished.len()
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready_signal.as_ref().map(|fd| fd.as_fd())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{self, eventfd_is_readable, read_eventfd, PageModel, RoundTrip};

    #[test]
    fn capacity_must_be_a_non_zero_multiple_of_the_page_size() {
        for bad in [0, 1, 4095, 4097, 3 * 4096 + 12] {
            let err = MemDevice::new(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            let text = err.to_string();
            assert!(text.contains(&bad.to_string()) && text.contains("multiple of 4096"), "{text}");
        }
        assert_eq!(MemDevice::new(8 * 4096).unwrap().capacity_slots(), 8);
    }

    #[test]
    fn the_memory_held_is_what_the_highest_written_slot_populated() {
        let device = MemDevice::new(64 * 4096).unwrap();
        assert_eq!(device.memory_held(), Some(0));
        let arena = Arc::new(BufferArena::with_runs(8, 1).unwrap());
        let mut queue = device.open_queue(QueueKind::Polled, 4, &arena).unwrap();
        let buf = arena.alloc().unwrap();
        let mut run_to_end = |request: Request| {
            queue.push(request, 0).unwrap();
            assert_eq!(testing::wait_for(queue.as_mut(), 1).len(), 1);
        };
        run_to_end(Request::Write { slot: 9, buf });
        assert_eq!(device.memory_held(), Some(10 * 4096), "slots 0..=9 are below the highest written");
        run_to_end(Request::Read { slot: 40, buf });
        run_to_end(Request::Write { slot: 3, buf });
        assert_eq!(device.memory_held(), Some(10 * 4096), "reads and lower writes populate nothing new");
        let run = arena.alloc_run(4).unwrap();
        run_to_end(Request::WriteRun { slot: 20, buf: run, pages: 4 });
        assert_eq!(device.memory_held(), Some(24 * 4096), "a run of 4 pages ends at slot 23");
    }

    #[test]
    fn a_huge_device_costs_nothing_until_written() {
        // 64 GiB of NORESERVE mapping must be accepted on a machine with far less free memory.
        let device = MemDevice::new(64 << 30).unwrap();
        let slots = device.capacity_slots();
        assert_eq!(slots, (64 << 30) / 4096);
        let mut model = PageModel::new();
        RoundTrip::new(QueueKind::Polled, 8, 300, 11, 0..slots).run(&device, &mut model);
        model.verify_all(&device, QueueKind::Completion);
    }

    #[test]
    fn random_round_trips_through_both_queue_kinds_check_every_byte_and_the_counters() {
        let device = MemDevice::new(512 * 4096).unwrap();
        let runs = [
            RoundTrip::new(QueueKind::Polled, 1, 500, 1, 0..512),
            RoundTrip::new(QueueKind::Completion, 1, 500, 2, 0..512),
            RoundTrip::new(QueueKind::Polled, 4, 3000, 3, 0..512),
            RoundTrip::new(QueueKind::Completion, 7, 3000, 4, 0..512),
            RoundTrip::new(QueueKind::Polled, 64, 3000, 5, 0..512),
            RoundTrip::new(QueueKind::Completion, 128, 3000, 6, 0..512),
        ];
        testing::round_trips_with_counters(&device, &runs);
    }

    #[test]
    fn queues_on_several_threads_share_one_device() {
        testing::concurrent_round_trips(Arc::new(MemDevice::new(4096 * 4096).unwrap()));
    }

    #[test]
    fn reap_hands_out_at_most_max() {
        testing::reap_hands_out_at_most_max(&MemDevice::new(64 * 4096).unwrap());
    }

    #[test]
    fn runs_move_consecutive_slots_in_one_request() {
        testing::runs_move_consecutive_slots_in_one_request(&MemDevice::new(256 * 4096).unwrap());
    }

    #[test]
    fn queue_limits_and_bad_requests_are_refused() {
        let device = MemDevice::new(16 * 4096).unwrap();
        testing::check_queue_limits(&device, QueueKind::Polled);
        testing::check_queue_limits(&device, QueueKind::Completion);
    }

    #[test]
    fn requests_start_at_submit_not_at_push() {
        let device = MemDevice::new(4 * 4096).unwrap();
        let arena = Arc::new(BufferArena::new(2).unwrap());
        let mut queue = device.open_queue(QueueKind::Polled, 4, &arena).unwrap();
        assert_eq!(queue.wait_mode(), WaitMode::Synchronous);
        assert!(queue.notify_fd().is_none());
        arena.bytes_mut(0).fill(0xAB);
        queue.push(Request::Write { slot: 1, buf: 0 }, 1).unwrap();
        assert_eq!(queue.reap(usize::MAX, &mut |_| panic!("nothing was submitted")), 0);
        assert_eq!(device.counters().snapshot().writes, 0);
        assert_eq!(queue.submit().unwrap(), 1);
        assert_eq!(queue.in_flight(), 1);
        queue.push(Request::Read { slot: 1, buf: 1 }, 2).unwrap();
        // wait submits what is queued, so it cannot hang on a forgotten submit.
        let mut tags = Vec::new();
        assert_eq!(queue.wait(2, &mut |c| tags.push((c.tag, c.result.is_ok()))).unwrap(), 2);
        assert_eq!(tags, [(1, true), (2, true)]);
        assert!(arena.bytes(1).iter().all(|&b| b == 0xAB));
        assert_eq!(queue.in_flight(), 0);
        // Waiting for more than is in flight returns instead of hanging.
        assert_eq!(queue.wait(5, &mut |_| {}).unwrap(), 0);
    }

    #[test]
    fn completion_queue_eventfd_becomes_readable_after_submit() {
        let device = MemDevice::new(4 * 4096).unwrap();
        let arena = Arc::new(BufferArena::new(2).unwrap());
        let mut queue = device.open_queue(QueueKind::Completion, 4, &arena).unwrap();
        assert_eq!(queue.kind(), QueueKind::Completion);
        assert_eq!(queue.wait_mode(), WaitMode::Synchronous);
        let fd = queue.notify_fd().unwrap().try_clone_to_owned().unwrap();
        assert!(!eventfd_is_readable(&fd));
        queue.push(Request::Write { slot: 0, buf: 0 }, 9).unwrap();
        assert!(!eventfd_is_readable(&fd), "push alone must not signal");
        queue.submit().unwrap();
        assert!(eventfd_is_readable(&fd));
        assert!(read_eventfd(&fd) >= 1);
        assert!(!eventfd_is_readable(&fd), "reading the eventfd drains it");
        assert_eq!(queue.reap(usize::MAX, &mut |c| assert_eq!(c.tag, 9)), 1);
    }

    #[test]
    fn a_sleeping_thread_wakes_when_another_submits() {
        let device = MemDevice::new(4 * 4096).unwrap();
        let arena = Arc::new(BufferArena::new(1).unwrap());
        let queue = device.open_queue(QueueKind::Completion, 4, &arena).unwrap();
        let fd = queue.notify_fd().unwrap().try_clone_to_owned().unwrap();
        let queue = std::sync::Mutex::new(queue);
        std::thread::scope(|s| {
            let sleeper = s.spawn(|| {
                // A blocking read sleeps until the submitter signals.
                let count = read_eventfd(&fd);
                let mut tags = Vec::new();
                queue.lock().unwrap().reap(usize::MAX, &mut |c| tags.push(c.tag));
                (count, tags)
            });
            std::thread::sleep(std::time::Duration::from_millis(50));
            let mut q = queue.lock().unwrap();
            q.push(Request::Read { slot: 3, buf: 0 }, 77).unwrap();
            q.submit().unwrap();
            drop(q);
            let (count, tags) = sleeper.join().unwrap();
            assert!(count >= 1);
            assert_eq!(tags, [77]);
        });
    }
}
