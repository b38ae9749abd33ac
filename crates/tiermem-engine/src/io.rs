//! The queue set of the Ultraswap I/O path and what happens when a request completes.
//!
//! - `lanes`: queues for the page a thread faulted on. Polled in the hybrid and poll-only modes,
//!   completion-driven (the thread sleeps) in interrupt-only mode. One lane per concurrently
//!   faulting thread; a thread takes any free lane.
//! - `prefetch`: completion-driven queue for pages read ahead of demand.
//! - `writeback`: completion-driven queue for evicted pages.
//!
//! The critical read is always pushed and submitted before any prefetch, so a prefetch never
//! delays it (no head-of-line blocking); nothing is reordered, and nothing is merged unless
//! asked for (write runs, read runs: pages already in consecutive slots, one request).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use rustix::event::{poll, PollFd, PollFlags};
use tiermem_device::{BufId, BufferArena, Completion, Device, IoQueue, QueueKind};
use tiermem_sys::Result;

use crate::config::{EngineConfig, FaultMode, IoMode};
use crate::engine::Shared;
use crate::page::Kind;
use crate::policy::{split_page_id, PageId};
use crate::region::RegionTable;
use crate::stats::{IoErrorKind, Path, Stats};

/// What a request was for, kept in the top bits of its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Critical = 1,
    Prefetch = 2,
    WriteBack = 3,
    /// A run of write-backs in one request; the tag holds the run's first buffer (see
    /// [`Queues::note_run`]).
    WriteRun = 4,
    /// A run of prefetches in one request, tagged like a write run.
    ReadRun = 5,
}

const OP_SHIFT: u32 = 61;
/// In a noted run's page count: its buffers carry descending page ids.
const RUN_DESCENDING: u32 = 1 << 31;

pub(crate) fn tag(op: Op, page: PageId) -> u64 {
    ((op as u64) << OP_SHIFT) | page
}

/// Whether `tag` names a critical read.
pub(crate) fn is_critical(tag: u64) -> bool {
    matches!(untag(tag).0, Some(Op::Critical))
}

fn untag(tag: u64) -> (Option<Op>, PageId) {
    let op = match tag >> OP_SHIFT {
        1 => Some(Op::Critical),
        2 => Some(Op::Prefetch),
        3 => Some(Op::WriteBack),
        4 => Some(Op::WriteRun),
        5 => Some(Op::ReadRun),
        _ => None,
    };
    (op, tag & ((1 << OP_SHIFT) - 1))
}

/// A finished request reduced to what processing needs (no heap).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Done {
    pub(crate) tag: u64,
    /// 0 when the page was transferred, else the errno of the failure.
    pub(crate) errno: i32,
}

impl Done {
    pub(crate) const NONE: Self = Self { tag: 0, errno: 0 };

    pub(crate) fn of(c: &Completion) -> Self {
        Self { tag: c.tag, errno: c.result.as_ref().err().map_or(0, crate::stats::errno_of) }
    }

    pub(crate) fn ok(self) -> bool {
        self.errno == 0
    }
}

/// The engine's queues.
#[derive(Debug)]
pub(crate) struct Queues {
    pub(crate) lanes: Vec<Mutex<Box<dyn IoQueue>>>,
    pub(crate) prefetch: Mutex<Box<dyn IoQueue>>,
    pub(crate) writeback: Mutex<Box<dyn IoQueue>>,
    /// Completions whose page was locked by another thread when reaped; retried later.
    deferred: Mutex<Vec<Done>>,
    /// Buffers of critical reads given up on while in flight (their wait failed): given back
    /// when the read's completion shows up on a lane (a critical read's tag names its buffer).
    abandoned: Mutex<Vec<BufId>>,
    /// How many buffers `abandoned` holds, read without its lock.
    abandoned_count: std::sync::atomic::AtomicUsize,
    /// Submission time (ns since `epoch`) of the request using each arena buffer.
    submitted_at: Box<[AtomicU64]>,
    /// Per arena run in flight: the page id its first buffer carries, and its page count with
    /// [`RUN_DESCENDING`] set when buffer k carries the page k before that one, not after.
    runs: Box<[(AtomicU64, AtomicU32)]>,
    epoch: Instant,
    wake: crate::engine::WakeFd,
    description: String,
}

/// An empty vector with room for `capacity` items, its memory written once now. Reclaim
/// pushes onto these while the memory cgroup may be full: a first touch of a page then waits
/// for memory under the OOM guard, in the thread that is to free some (seen: the reclaim
/// thread stuck in `defer`'s push for the whole burst test, 2026-12-07).
fn touched_vec<T: Copy>(capacity: usize, fill: T) -> Vec<T> {
    let mut v = Vec::with_capacity(capacity);
    v.spare_capacity_mut().iter_mut().for_each(|item| {
        item.write(fill);
    });
    v
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Queues {
    pub(crate) fn open(
        config: &EngineConfig,
        device: &dyn Device,
        arena: &std::sync::Arc<BufferArena>,
    ) -> Result<Self> {
        let lane_kind = match config.io_mode {
            IoMode::Hybrid | IoMode::PollOnly => QueueKind::Polled,
            IoMode::InterruptOnly => QueueKind::Completion,
        };
        let nlanes = match config.fault_mode {
            FaultMode::HandlerThread => config.handler_threads,
            FaultMode::Sigbus => 4,
        };
        let lanes = (0..nlanes)
            .map(|_| device.open_queue(lane_kind, config.queue_depth, arena).map(Mutex::new))
            .collect::<Result<Vec<_>>>()?;
        // In poll-only mode write-backs are waited for by polling too.
        let background_kind =
            if config.io_mode == IoMode::PollOnly { QueueKind::Polled } else { QueueKind::Completion };
        let prefetch = device.open_queue(background_kind, config.queue_depth, arena)?;
        let writeback = device.open_queue(background_kind, config.queue_depth, arena)?;
        let description = format!(
            "fault lanes {:?} x{}, prefetch {:?}, write-back {:?}",
            lock(&lanes[0]).wait_mode(),
            lanes.len(),
            prefetch.wait_mode(),
            writeback.wait_mode()
        );
        let wake = crate::engine::wake_eventfd()?;
        Ok(Self {
            lanes,
            prefetch: Mutex::new(prefetch),
            writeback: Mutex::new(writeback),
            deferred: Mutex::new(touched_vec(4 * config.queue_depth as usize + 64, Done::NONE)),
            abandoned: Mutex::new(touched_vec(arena.pages() as usize, 0)),
            abandoned_count: std::sync::atomic::AtomicUsize::new(0),
            submitted_at: (0..arena.end()).map(|_| AtomicU64::new(0)).collect(),
            runs: (0..tiermem_device::arena::MAX_RUNS).map(|_| Default::default()).collect(),
            epoch: Instant::now(),
            wake,
            description,
        })
    }

    pub(crate) fn describe(&self) -> &str {
        &self.description
    }

    /// Take a free lane, spinning while all are busy.
    pub(crate) fn lane(&self, hint: usize) -> MutexGuard<'_, Box<dyn IoQueue>> {
        let n = self.lanes.len();
        loop {
            for i in 0..n {
                if let Ok(guard) = self.lanes[(hint + i) % n].try_lock() {
                    return guard;
                }
            }
            std::hint::spin_loop();
        }
    }

    pub(crate) fn prefetch(&self) -> MutexGuard<'_, Box<dyn IoQueue>> {
        lock(&self.prefetch)
    }

    pub(crate) fn writeback(&self) -> MutexGuard<'_, Box<dyn IoQueue>> {
        lock(&self.writeback)
    }

    pub(crate) fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Remember that the run of arena buffers from `first_buf` carries `pages` pages for `op`
    /// (a write run or a read run), buffer k the page `first_page + k` (`- k` if `descending`);
    /// returns the request's tag.
    pub(crate) fn note_run(
        &self,
        arena: &tiermem_device::BufferArena,
        op: Op,
        first_buf: BufId,
        first_page: PageId,
        pages: u32,
        descending: bool,
    ) -> u64 {
        let (id, count) = &self.runs[arena.run_index(first_buf) as usize];
        id.store(first_page, Ordering::Relaxed);
        count.store(pages | if descending { RUN_DESCENDING } else { 0 }, Ordering::Release);
        tag(op, PageId::from(first_buf))
    }

    pub(crate) fn mark_submitted(&self, buf: BufId) {
        self.submitted_at[buf as usize].store(self.now_ns(), Ordering::Relaxed);
    }

    fn elapsed_since_submit(&self, buf: BufId) -> u64 {
        self.now_ns().saturating_sub(self.submitted_at[buf as usize].load(Ordering::Relaxed))
    }

    /// Keep a completion for later processing (taken off a queue by a thread that cannot
    /// process it now).
    pub(crate) fn defer(&self, c: Completion) {
        lock(&self.deferred).push(Done::of(&c));
    }

    /// Leave `buf` to the critical read into it, given up on while it may still be in flight:
    /// the buffer goes back when that read's completion is seen ([`Queues::finish_abandoned`]).
    pub(crate) fn abandon(&self, buf: BufId) {
        let mut abandoned = lock(&self.abandoned);
        abandoned.push(buf);
        self.abandoned_count.store(abandoned.len(), Ordering::Release);
    }

    /// Whether some buffer is left to a read given up on.
    pub(crate) fn has_abandoned(&self) -> bool {
        self.abandoned_count.load(Ordering::Acquire) > 0
    }

    /// A critical read's completion (`tag`) that no fault waits for: give back its buffer, if
    /// it is one given up on ([`Queues::abandon`]).
    pub(crate) fn finish_abandoned(&self, arena: &BufferArena, tag: u64) {
        let buf = untag(tag).1 as BufId;
        let mut abandoned = lock(&self.abandoned);
        if let Some(k) = abandoned.iter().position(|&b| b == buf) {
            abandoned.swap_remove(k);
            self.abandoned_count.store(abandoned.len(), Ordering::Release);
            drop(abandoned);
            arena.release(buf);
        }
    }

    pub(crate) fn wake_completion_thread(&self) {
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
    }
}

/// Completions the completion thread, or a faulting thread waiting for one page, takes off
/// each background queue at a time. Few, so that the two share the work: when the completion
/// thread took all at once, it installed a long batch page by page (about 3 µs each) while the
/// faulting thread spun for a page near its end, unable to help.
const REAP_CHUNK: usize = 8;

/// Reap what the background queues finished and process it. Never blocks, on a queue (one
/// another thread holds is skipped) or a page lock (completions for locked pages are
/// deferred). Returns how many completions were taken or processed; 0 when there was nothing
/// to take, or the queues were busy.
pub(crate) fn reap_background(shared: &Shared, regions: &RegionTable) -> usize {
    reap_some(shared, regions, usize::MAX, None, false)
}

/// For the completion thread: a few completions per queue (see [`REAP_CHUNK`]), waiting for a
/// queue another thread holds, so that 0 means both rings were empty (and the thread may
/// sleep: their eventfds signal the next completion).
pub(crate) fn reap_background_chunk(shared: &Shared, regions: &RegionTable) -> usize {
    reap_some(shared, regions, REAP_CHUNK, None, true)
}

/// For a faulting thread waiting for the prefetch of page `wanted`: a few completions per
/// queue, without waiting for a queue, that page's first if it is among them (a single-page
/// prefetch; a page read as part of a run comes with its run, in order).
pub(crate) fn reap_background_for(shared: &Shared, regions: &RegionTable, wanted: PageId) -> usize {
    reap_some(shared, regions, REAP_CHUNK, Some(wanted), false)
}

fn reap_some(shared: &Shared, regions: &RegionTable, max: usize, wanted: Option<PageId>, wait: bool) -> usize {
    let mut batch = [Done::NONE; 64];
    let mut n = 0;
    // Into the batch, or, out of room on the stack, kept for the next pass.
    let keep = |batch: &mut [Done; 64], n: &mut usize, c: Completion| {
        if *n < batch.len() {
            batch[*n] = Done::of(&c);
            *n += 1;
        } else {
            shared.queues.defer(c);
        }
    };
    for queue in [&shared.queues.prefetch, &shared.queues.writeback] {
        let mut q = if wait {
            lock(queue)
        } else {
            let Ok(q) = queue.try_lock() else { continue };
            q
        };
        q.reap(max, &mut |c: Completion| keep(&mut batch, &mut n, c));
    }
    if shared.config.io_mode == IoMode::PollOnly || shared.queues.has_abandoned() {
        // Only a critical read waits on a lane, so what a fault left there is nobody's to
        // collect until a fault takes that lane again, which may never come: in poll-only mode
        // prefetches (the kernel refused their submission, or they outlived the wait), whose
        // pages stayed incoming, so that a fault on one waited for ever; in every mode, reads
        // given up on (refused submission: the fault read its page plainly), each holding a
        // buffer. A lane nobody holds has no critical read waiting, so a critical completion
        // found there is one given up on: its buffer goes back. (Not at every reap outside
        // poll-only mode: that looked to cost intsort at 20% about 8%, slower in 7 of 8 pairs
        // on 2026-12-07.)
        for lane in &shared.queues.lanes {
            let Ok(mut q) = lane.try_lock() else { continue };
            if q.in_flight() == 0 {
                continue;
            }
            q.reap(max, &mut |c: Completion| {
                if is_critical(c.tag) {
                    shared.queues.finish_abandoned(&shared.arena, c.tag);
                } else {
                    keep(&mut batch, &mut n, c);
                }
            });
        }
    }
    if let Some(at) = wanted.and_then(|page| batch[..n].iter().position(|d| d.tag == tag(Op::Prefetch, page))) {
        batch[..=at].rotate_right(1);
    }
    for done in &batch[..n] {
        process(shared, regions, *done);
    }
    n + retry_deferred(shared, regions)
}

fn retry_deferred(shared: &Shared, regions: &RegionTable) -> usize {
    let mut pending = [Done::NONE; 64];
    let n = {
        let Ok(mut deferred) = shared.queues.deferred.try_lock() else { return 0 };
        let n = deferred.len().min(pending.len());
        for (slot, done) in pending.iter_mut().zip(deferred.drain(..n)) {
            *slot = done;
        }
        n
    };
    (0..n).filter(|&i| process(shared, regions, pending[i])).count()
}

/// Process completions already taken off a queue.
pub(crate) fn process_all(shared: &Shared, regions: &RegionTable, done: &[Done]) {
    for d in done {
        process(shared, regions, *d);
    }
}

/// Process one completion; false (and deferred) if its page is locked by someone else.
fn process(shared: &Shared, regions: &RegionTable, done: Done) -> bool {
    let finished = process_once(shared, regions, done);
    if finished && untag(done.tag).0 == Some(Op::Prefetch) {
        shared.prefetches_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
    finished
}

/// [`process`] without the count of prefetches in flight.
fn process_once(shared: &Shared, regions: &RegionTable, done: Done) -> bool {
    let (op, page) = untag(done.tag);
    if let Some(run_op @ (Op::WriteRun | Op::ReadRun)) = op {
        // One completion for the run: finish each page's write-back or prefetch (each deferred
        // on its own if its page is locked).
        let each = if run_op == Op::WriteRun { Op::WriteBack } else { Op::Prefetch };
        let (first, count) = &shared.queues.runs[shared.arena.run_index(page as BufId) as usize];
        let (first, count) = (first.load(Ordering::Relaxed), count.load(Ordering::Acquire));
        for k in 0..u64::from(count & !RUN_DESCENDING) {
            let id = if count & RUN_DESCENDING != 0 { first - k } else { first + k };
            process(shared, regions, Done { tag: tag(each, id), errno: done.errno });
        }
        return true;
    }
    let (region_index, index) = split_page_id(page);
    let Some(region) = regions.get(region_index) else { return true };
    let Some(cell) = region.pages.get(index as usize) else { return true };
    let Some(mut locked) = cell.try_lock() else {
        lock(&shared.queues.deferred).push(done);
        return false;
    };
    let state = locked.state();
    let buf = state.buf();
    match op {
        Some(Op::WriteBack) => {
            debug_assert!(state.writing());
            shared.stats.record(Path::WriteBack, shared.queues.elapsed_since_submit(buf));
            let mut next = state.with_writing(false);
            if !done.ok() {
                // The only copy of the data is in the buffer: put it back in memory, dirty,
                // and forget the bad slot rather than lose the page.
                shared.stats.io_error(IoErrorKind::WriteBack, done.errno);
                next = crate::fault::recover_failed_writeback(shared, region, index, state);
            }
            // An evicted page's buffer now holds what its slot holds: it can wait in the
            // victim tier instead of being given back.
            // (Not a buffer of a run: runs are few, and one kept would hold its whole run.)
            let keep = done.ok()
                && next.kind() == Kind::Evicted
                && shared.victims.enabled()
                && !shared.arena.in_run(buf)
                && !region.is_closing();
            if keep {
                next = next.in_victim_tier(buf);
            }
            locked.set(next);
            drop(locked);
            if keep {
                shared.victims.entered(shared, regions, page, buf);
            } else {
                shared.arena.release(buf);
            }
        }
        Some(Op::Prefetch) => {
            debug_assert_eq!(state.kind(), Kind::Incoming);
            shared.stats.record(Path::Prefetch, shared.queues.elapsed_since_submit(buf));
            // A sample waits in a single buffer: one in a run would keep the whole run taken.
            let sample_buf = (done.ok() && !region.is_closing() && shared.prefetch_sampler.take_sample())
                .then(|| single_buffer(shared, buf))
                .flatten();
            let sampled = sample_buf.is_some();
            let next = if let Some(kept) = sample_buf {
                // Left in its buffer: the program's first touch shows that it was used.
                Stats::add(&shared.stats.counters.prefetch_sampled, 1);
                state.with_kind(Kind::Prefetched).with_buf(kept)
            } else if done.ok() {
                crate::fault::install_prefetched(shared, region, index, state)
            } else {
                shared.stats.io_error(IoErrorKind::Prefetch, done.errno);
                shared.arena.release(buf);
                state.with_kind(Kind::Evicted)
            };
            locked.set(next);
            drop(locked);
            if next.kind() != Kind::Resident && shared.config.defer_prefetch_hits {
                // A thread that faulted on it may sleep until it is mapped (see
                // `handle_fault`): let it fault again and find it where it is now.
                let _ = shared.uffd_of(region).wake(region.page_addr(index), tiermem_sys::PAGE_SIZE);
            }
            if sampled {
                if let Some(oldest) = shared.prefetch_sampler.push(page) {
                    end_sample(shared, regions, oldest);
                }
            }
        }
        Some(Op::Critical | Op::WriteRun | Op::ReadRun) | None => {
            // Critical reads are waited for on their lane and never reach here.
            debug_assert!(false, "unexpected completion tag {:#x}", done.tag);
        }
    }
    true
}

/// `buf` if it is a single buffer; else a single buffer holding a copy of it (`buf` is given
/// back), or None when none is free.
fn single_buffer(shared: &Shared, buf: BufId) -> Option<BufId> {
    if !shared.arena.in_run(buf) {
        return Some(buf);
    }
    let single = shared.arena.alloc()?;
    shared.arena.bytes_mut(single).copy_from_slice(shared.arena.bytes(buf));
    shared.arena.release(buf);
    Some(single)
}

/// A sample has waited long enough: if the program has not touched it, put it back to its slot
/// and count it unused. A page locked by someone else is waited for a little: most holders
/// only look (a write fault's neighbours, reclaim asking for the referenced bit), and a sample
/// given up while one looked kept its buffer until the program touched the page. One still
/// locked after that is left alone and not counted (its state is changing: touched,
/// discarded or forked), which biases nothing much for a sample in 64.
fn end_sample(shared: &Shared, regions: &RegionTable, id: u64) {
    let (region_index, index) = split_page_id(id);
    let Some(cell) = regions.get(region_index).and_then(|r| r.pages.get(index as usize)) else { return };
    let Some(mut locked) = (0..64).find_map(|attempt| {
        if attempt > 0 {
            std::thread::yield_now();
        }
        cell.try_lock()
    }) else {
        return;
    };
    let state = locked.state();
    // A page of the victim tier is not a sample (the sample it was has ended).
    if state.kind() == Kind::Prefetched && !state.victim() {
        locked.set(state.with_kind(Kind::Evicted));
        drop(locked);
        shared.arena.release(state.buf());
        shared.prefetch_sample_ended(false);
    }
}

/// Copies of the background queues' completion descriptors for [`completion_thread`], made
/// while the engine starts. Guarded like the originals: the program must not close these either.
pub(crate) fn completion_wait_fds(shared: &Shared) -> Vec<crate::engine::WakeFd> {
    let prefetch_fd = shared.queues.prefetch().notify_fd().map(|fd| fd.try_clone_to_owned());
    let writeback_fd = shared.queues.writeback().notify_fd().map(|fd| fd.try_clone_to_owned());
    [prefetch_fd, writeback_fd]
        .into_iter()
        .flatten()
        .filter_map(|r| r.ok())
        .map(tiermem_sys::guarded_fd::Guarded::new)
        .collect()
}

/// Sleeps until the background queues signal completions (on `fds`), then processes them.
pub(crate) fn completion_thread(shared: &Shared, fds: Vec<crate::engine::WakeFd>) {
    let mut buf = [0u8; 8];
    while !shared.shutdown.load(Ordering::Acquire) {
        {
            let regions = shared.regions();
            while reap_background_chunk(shared, &regions) > 0 {}
        }
        let mut pollfds: Vec<PollFd<'_>> = fds.iter().map(|fd| PollFd::new(fd, PollFlags::IN)).collect();
        pollfds.push(PollFd::new(&shared.queues.wake, PollFlags::IN));
        // Poll-only queues have no eventfd; look again soon. Deferred work is retried too.
        let timeout = rustix::event::Timespec { tv_sec: 0, tv_nsec: if fds.is_empty() { 200_000 } else { 5_000_000 } };
        let _ = poll(&mut pollfds, Some(&timeout));
        let ready: Vec<bool> = pollfds.iter().map(|p| p.revents().contains(PollFlags::IN)).collect();
        // Drain only what is readable: the device's eventfds may be blocking.
        for (fd, _) in fds.iter().chain(std::iter::once(&shared.queues.wake)).zip(ready).filter(|(_, r)| *r) {
            let _ = rustix::io::read(fd, &mut buf);
        }
    }
}
