//! Test drivers shared by the device implementations: random round trips checked against a model
//! of what every slot should hold, and the queue-limit checks every queue must pass.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::Arc;

use crate::{BufId, BufferArena, Completion, Device, ErrorKind, IoQueue, QueueKind, Request, Slot, PAGE_SIZE};

/// A small deterministic xorshift generator, so failures reproduce from the seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The bytes version `version` of `slot` holds: distinct for every (slot, version), so a page
/// landing in the wrong slot or a stale page is caught. Version 0 is "never written": zeros.
pub fn fill_page(page: &mut [u8], slot: Slot, version: u64) {
    if version == 0 {
        page.fill(0);
        return;
    }
    let mut rng = Rng::new(slot.wrapping_mul(1_000_003) ^ version.rotate_left(32));
    for chunk in page.chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.next().to_le_bytes());
    }
    // Make the slot and version readable in a hex dump of a mismatch.
    page[..8].copy_from_slice(&slot.to_le_bytes());
    page[8..16].copy_from_slice(&version.to_le_bytes());
}

/// What every slot of a device should hold (absent = never written = zeros).
#[derive(Debug, Default)]
pub struct PageModel {
    versions: HashMap<Slot, u64>,
    next_version: u64,
}

impl PageModel {
    pub fn new() -> Self {
        Self::default()
    }

    fn version(&self, slot: Slot) -> u64 {
        self.versions.get(&slot).copied().unwrap_or(0)
    }

    fn new_version(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    /// Read back every slot written so far through a fresh queue of `kind` and compare.
    pub fn verify_all(&self, device: &dyn Device, kind: QueueKind) {
        let arena = Arc::new(BufferArena::new(8).unwrap());
        let mut queue = device.open_queue(kind, 8, &arena).unwrap();
        let mut expected = vec![0u8; PAGE_SIZE];
        let slots: Vec<_> = self.versions.iter().map(|(&s, &v)| (s, v)).collect();
        for batch in slots.chunks(8) {
            for (i, &(slot, _)) in batch.iter().enumerate() {
                queue.push(Request::Read { slot, buf: i as BufId }, i as u64).unwrap();
            }
            queue.submit().unwrap();
            let mut done = 0;
            while done < batch.len() {
                done += queue.wait(batch.len() - done, &mut |c| c.result.unwrap()).unwrap();
            }
            for (i, &(slot, version)) in batch.iter().enumerate() {
                fill_page(&mut expected, slot, version);
                assert_page_eq(arena.bytes(i as BufId), &expected, slot, version);
            }
        }
    }
}

fn assert_page_eq(actual: &[u8], expected: &[u8], slot: Slot, version: u64) {
    if let Some(at) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        panic!(
            "slot {slot} should hold version {version}; first wrong byte at {at}: {:#04x} instead of {:#04x} \
             (page header says slot {}, version {})",
            actual[at],
            expected[at],
            u64::from_le_bytes(actual[..8].try_into().unwrap()),
            u64::from_le_bytes(actual[8..16].try_into().unwrap()),
        );
    }
}

/// One random mix of pushes, submits, reaps and waits on one queue.
#[derive(Debug, Clone)]
pub struct RoundTrip {
    pub kind: QueueKind,
    pub depth: u32,
    pub ops: usize,
    pub seed: u64,
    /// Slots this round trip may touch; concurrent round trips use disjoint ranges.
    pub slots: Range<Slot>,
}

struct InFlight {
    slot: Slot,
    buf: BufId,
    /// For a read: the version the slot holds. For a write: the version being written.
    version: u64,
    write: bool,
}

impl RoundTrip {
    pub fn new(kind: QueueKind, depth: u32, ops: usize, seed: u64, slots: Range<Slot>) -> Self {
        Self { kind, depth, ops, seed, slots }
    }

    /// Run against `device`, updating and checking `model`. Returns (reads, writes) completed.
    pub fn run(&self, device: &dyn Device, model: &mut PageModel) -> (u64, u64) {
        let arena = Arc::new(BufferArena::new(self.depth).unwrap());
        let mut queue = device.open_queue(self.kind, self.depth, &arena).unwrap();
        assert_eq!(queue.kind(), self.kind);
        let mut rng = Rng::new(self.seed);
        let mut in_flight: HashMap<u64, InFlight> = HashMap::new();
        let mut busy_slots: HashSet<Slot> = HashSet::new();
        let mut counts = (0u64, 0u64);
        let mut expected = vec![0u8; PAGE_SIZE];
        let span = self.slots.end - self.slots.start;

        let mut finish = |c: Completion,
                          in_flight: &mut HashMap<u64, InFlight>,
                          busy_slots: &mut HashSet<Slot>,
                          model: &mut PageModel| {
            let op = in_flight.remove(&c.tag).unwrap_or_else(|| panic!("completion for unknown tag {}", c.tag));
            if let Err(e) = c.result {
                panic!("request for slot {} failed: {e}", op.slot);
            }
            if op.write {
                model.versions.insert(op.slot, op.version);
                counts.1 += 1;
            } else {
                fill_page(&mut expected, op.slot, op.version);
                assert_page_eq(arena.bytes(op.buf), &expected, op.slot, op.version);
                counts.0 += 1;
            }
            busy_slots.remove(&op.slot);
            arena.release(op.buf);
        };

        let mut next_tag = 0u64;
        for _ in 0..self.ops {
            assert_eq!(queue.in_flight(), in_flight.len());
            let mut done: Vec<Completion> = Vec::new();
            let action = if in_flight.len() == self.depth as usize { 9 } else { rng.below(10) };
            match action {
                0..=6 => {
                    let slot = self.slots.start + rng.below(span);
                    if busy_slots.contains(&slot) {
                        continue;
                    }
                    let buf = arena.alloc().expect("the arena has one buffer per queue entry");
                    let write = rng.below(2) == 0;
                    let (request, version) = if write {
                        let version = model.new_version();
                        fill_page(arena.bytes_mut(buf), slot, version);
                        (Request::Write { slot, buf }, version)
                    } else {
                        // Scribble so a read that moves nothing is caught.
                        arena.bytes_mut(buf).fill(0x5A);
                        (Request::Read { slot, buf }, model.version(slot))
                    };
                    next_tag += 1;
                    queue.push(request, next_tag).unwrap();
                    in_flight.insert(next_tag, InFlight { slot, buf, version, write });
                    busy_slots.insert(slot);
                }
                7 => {
                    queue.submit().unwrap();
                }
                8 => {
                    queue.reap(usize::MAX, &mut |c| done.push(c));
                }
                _ => {
                    if !in_flight.is_empty() {
                        let min = 1 + rng.below(in_flight.len() as u64) as usize;
                        let handed = queue.wait(min, &mut |c| done.push(c)).unwrap();
                        assert!(handed >= min, "wait({min}) handed out only {handed}");
                        assert_eq!(handed, done.len());
                    }
                }
            }
            for c in done {
                finish(c, &mut in_flight, &mut busy_slots, model);
            }
        }
        while !in_flight.is_empty() {
            let mut done = Vec::new();
            queue.wait(in_flight.len(), &mut |c| done.push(c)).unwrap();
            for c in done {
                finish(c, &mut in_flight, &mut busy_slots, model);
            }
        }
        assert_eq!(queue.in_flight(), 0);
        assert_eq!(arena.free_count(), self.depth);
        counts
    }
}

/// Round trips with both queue kinds, then a read-back of everything, checking the counters.
pub fn round_trips_with_counters(device: &dyn Device, runs: &[RoundTrip]) {
    let before = device.counters().snapshot();
    let mut model = PageModel::new();
    let (mut reads, mut writes) = (0, 0);
    for run in runs {
        let (r, w) = run.run(device, &mut model);
        reads += r;
        writes += w;
    }
    let after = device.counters().snapshot();
    assert_eq!(after.reads - before.reads, reads);
    assert_eq!(after.writes - before.writes, writes);
    assert_eq!(after.bytes_read_asked - before.bytes_read_asked, reads * PAGE_SIZE as u64);
    assert_eq!(after.bytes_read_medium - before.bytes_read_medium, reads * PAGE_SIZE as u64);
    assert_eq!(after.bytes_written_asked - before.bytes_written_asked, writes * PAGE_SIZE as u64);
    assert_eq!(after.bytes_written_medium - before.bytes_written_medium, writes * PAGE_SIZE as u64);
    assert_eq!(after.errors, before.errors);
    assert!(reads > 0 && writes > 0);
    // Written through one kind, read back through both.
    model.verify_all(device, QueueKind::Polled);
    model.verify_all(device, QueueKind::Completion);
}

/// Runs of buffers written in one request each land in consecutive slots, count as one write of
/// all their bytes; runs read back in one request each (also one straddling both written runs
/// and a never-written slot) fill consecutive buffers; bad runs are refused. Needs a device of
/// at least 64 slots.
pub fn runs_move_consecutive_slots_in_one_request(device: &dyn Device) {
    let arena = Arc::new(BufferArena::with_runs(1, 2).unwrap());
    let mut queue = device.open_queue(QueueKind::Completion, 4, &arena).unwrap();
    let mut model = PageModel::new();
    let before = device.counters().snapshot();
    let run_trip = |queue: &mut Box<dyn IoQueue>, request: Request| {
        queue.push(request, 1).unwrap();
        queue.submit().unwrap();
        let mut done = 0;
        while done < 1 {
            done += queue.wait(1, &mut |c| c.result.unwrap()).unwrap();
        }
    };
    for (first_slot, pages) in [(3u64, 5u32), (40, crate::arena::RUN_PAGES - 8)] {
        let buf = arena.alloc_run(pages).unwrap();
        for k in 0..pages {
            let slot = first_slot + u64::from(k);
            let version = model.new_version();
            fill_page(arena.bytes_mut(buf + k), slot, version);
            model.versions.insert(slot, version);
        }
        run_trip(&mut queue, Request::WriteRun { slot: first_slot, buf, pages });
        (0..pages).for_each(|k| arena.release(buf + k));
    }
    let after = device.counters().snapshot();
    assert_eq!(after.writes - before.writes, 2, "one device write per run");
    assert_eq!(after.bytes_written_medium - before.bytes_written_medium, (5 + 24) * PAGE_SIZE as u64);
    model.verify_all(device, QueueKind::Polled);
    let mut expected = vec![0u8; PAGE_SIZE];
    for (first_slot, pages) in [(3u64, 5u32), (40, 24), (1, crate::arena::RUN_PAGES)] {
        let before = device.counters().snapshot();
        let buf = arena.alloc_run(pages).unwrap();
        run_trip(&mut queue, Request::ReadRun { slot: first_slot, buf, pages });
        let after = device.counters().snapshot();
        assert_eq!(after.reads - before.reads, 1, "one device read for the run of {pages} from {first_slot}");
        assert_eq!(after.bytes_read_medium - before.bytes_read_medium, u64::from(pages) * PAGE_SIZE as u64);
        for k in 0..pages {
            let slot = first_slot + u64::from(k);
            fill_page(&mut expected, slot, model.version(slot));
            assert_page_eq(arena.bytes(buf + k), &expected, slot, model.version(slot));
            arena.release(buf + k);
        }
    }
    let capacity = device.capacity_slots();
    for (bad, says) in [
        (Request::WriteRun { slot: 0, buf: 32, pages: 0 }, "0 pages"),
        (Request::WriteRun { slot: 0, buf: 32, pages: 33 }, "33 pages"),
        (Request::ReadRun { slot: 0, buf: 32, pages: 33 }, "33 pages"),
        (Request::WriteRun { slot: capacity - 2, buf: 32, pages: 3 }, "the device has only"),
        (Request::ReadRun { slot: capacity - 2, buf: 32, pages: 3 }, "reading slots"),
        (Request::WriteRun { slot: 0, buf: 90, pages: 8 }, "not in the arena"),
        (Request::ReadRun { slot: 0, buf: 90, pages: 8 }, "not in the arena"),
    ] {
        let err = queue.push(bad, 0).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{bad:?}");
        assert!(err.to_string().contains(says), "{bad:?}: {err}");
    }
}

/// Three threads, each with its own queue and slot range, on one device at once.
pub fn concurrent_round_trips(device: Arc<dyn Device>) {
    let capacity = device.capacity_slots();
    let per_thread = capacity / 3;
    let threads: Vec<_> = (0..3u64)
        .map(|t| {
            let device = device.clone();
            std::thread::spawn(move || {
                let kind = if t % 2 == 0 { QueueKind::Polled } else { QueueKind::Completion };
                let slots = t * per_thread..(t + 1) * per_thread;
                let mut model = PageModel::new();
                let counts = RoundTrip::new(kind, 16, 1500, 100 + t, slots).run(&*device, &mut model);
                model.verify_all(&*device, kind);
                counts
            })
        })
        .collect();
    let (mut reads, mut writes) = (0, 0);
    for t in threads {
        let (r, w) = t.join().unwrap();
        reads += r;
        writes += w;
    }
    let counters = device.counters().snapshot();
    // verify_all adds reads of its own, so only a lower bound holds for reads.
    assert!(counters.reads >= reads);
    assert_eq!(counters.writes, writes);
    assert_eq!(counters.errors, 0);
}

/// Depth limits, a full queue and out-of-range requests, on a device with at least 4 slots.
pub fn check_queue_limits(device: &dyn Device, kind: QueueKind) {
    let arena = Arc::new(BufferArena::new(4).unwrap());
    for bad_depth in [0, crate::MAX_QUEUE_DEPTH + 1, u32::MAX] {
        let err = device.open_queue(kind, bad_depth, &arena).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("between 1 and 4096"), "{err}");
    }
    drop(device.open_queue(kind, crate::MAX_QUEUE_DEPTH, &arena).unwrap());

    let mut queue = device.open_queue(kind, 3, &arena).unwrap();
    let capacity = device.capacity_slots();
    let err = queue.push(Request::Read { slot: capacity, buf: 0 }, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains(&format!("reading slot {capacity}")), "{err}");
    assert!(err.to_string().contains(&format!("only {capacity} slots")), "{err}");
    let err = queue.push(Request::Write { slot: u64::MAX, buf: 0 }, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let err = queue.push(Request::Write { slot: 0, buf: 4 }, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("buffer 4 is not in the arena"), "{err}");
    assert_eq!(queue.in_flight(), 0, "refused requests must not count");

    for i in 0..3 {
        queue.push(Request::Write { slot: i, buf: i as BufId }, i).unwrap();
    }
    let full = queue.push(Request::Write { slot: 3, buf: 3 }, 3).unwrap_err();
    assert_eq!(full.kind(), ErrorKind::NoSpace);
    assert!(full.to_string().contains("full"), "{full}");
    assert_eq!(queue.submit().unwrap(), 3);
    // Submitted but not reaped still occupies the queue.
    assert_eq!(queue.push(Request::Write { slot: 3, buf: 3 }, 3).unwrap_err().kind(), ErrorKind::NoSpace);
    let mut tags = Vec::new();
    let mut handed = 0;
    while handed < 3 {
        handed += queue
            .wait(3 - handed, &mut |c| {
                c.result.unwrap();
                tags.push(c.tag)
            })
            .unwrap();
    }
    tags.sort();
    assert_eq!(tags, [0, 1, 2]);
    assert_eq!(queue.in_flight(), 0);
    queue.push(Request::Read { slot: 3, buf: 3 }, 3).unwrap();
    assert_eq!(queue.wait(1, &mut |c| assert_eq!(c.tag, 3)).unwrap(), 1);
    // Waiting with nothing in flight returns at once.
    assert_eq!(queue.wait(1, &mut |_| panic!("nothing is in flight")).unwrap(), 0);
}

/// Whether an eventfd can be read without sleeping.
pub fn eventfd_is_readable(fd: &impl AsFd) -> bool {
    let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap() == 1
}

/// Read (and so reset) an eventfd's counter; sleeps while it is zero.
pub fn read_eventfd(fd: &impl AsFd) -> u64 {
    let mut bytes = [0u8; 8];
    assert_eq!(rustix::io::read(fd, &mut bytes).unwrap(), 8);
    u64::from_ne_bytes(bytes)
}

/// Wait for `queue` to hand out `count` completions, returning them.
pub fn wait_for(queue: &mut dyn IoQueue, count: usize) -> Vec<Completion> {
    let mut done = Vec::new();
    while done.len() < count {
        queue.wait(count - done.len(), &mut |c| done.push(c)).unwrap();
    }
    done
}

/// `reap(max)` hands out at most `max` completions and leaves the rest for the next call: the
/// engine's threads take a few at a time so that they can share the work.
pub fn reap_hands_out_at_most_max(device: &dyn Device) {
    let arena = Arc::new(BufferArena::new(12).unwrap());
    let mut queue = device.open_queue(QueueKind::Completion, 16, &arena).unwrap();
    for buf in 0..12 {
        queue.push(Request::Read { slot: Slot::from(buf), buf }, u64::from(buf)).unwrap();
    }
    queue.submit().unwrap();
    assert_eq!(queue.reap(0, &mut |_| panic!("max 0 takes nothing")), 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut tags = Vec::new();
    while tags.len() < 12 {
        assert!(std::time::Instant::now() < deadline, "12 reads: only {} reaped in 30 s", tags.len());
        let before = tags.len();
        let got = queue.reap(5, &mut |c| tags.push(c.tag));
        assert!(got <= 5 && got == tags.len() - before, "reap(5) handed out {got}");
        // What was not handed out is still the queue's, finished or not.
        assert_eq!(queue.in_flight(), 12 - tags.len());
        if got < 5 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    tags.sort_unstable();
    assert_eq!(tags, (0..12).collect::<Vec<u64>>());
}
