//! Storage set aside for a regular device file as it fills.
//!
//! A device file is sized for the program's worst case (`tiermem run` takes the machine's
//! memory by default). Setting all of it aside at open took that much of the file system from
//! everyone for the whole run, and each process of a multi-process program took its own, so
//! the later ones got what little was left. Instead the file is sized at open and its blocks
//! are set aside (`fallocate`) from slot 0 up, in steps, as slots are handed out. Slots are
//! handed out lowest first, so a file holds about what the evicted pages held at their peak.
//!
//! The blocks are set aside before the slot is written rather than filled by the write: a
//! file system without room then refuses the slot while its page is still in memory, where
//! the page can stay, instead of failing a write after the page left.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::PAGE_SIZE;

const SLOT_BYTES: u64 = PAGE_SIZE as u64;

/// The least a step sets aside (16 MiB), so that a growing file costs a system call per 4096
/// pages written at most; a step is also at least a quarter of what is already set aside.
pub(crate) const MIN_STEP_SLOTS: u64 = (16 << 20) / SLOT_BYTES;

/// After the file system refused, slots past what is set aside are refused at once for this
/// long: a program evicting steadily would otherwise ask again for every page. After it
/// refused a whole step but took what was asked, steps stay that short for as long.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// After the kernel refused an extension memory (ENOMEM: a full memory cgroup whose OOM killer
/// is off refuses the file system the little it needs), slots past what is set aside are
/// refused at once for this long, and room ahead of need is not asked for: passing, but each
/// refused call may have run the cgroup's reclaim on the thread that is to make room.
const MEMORY_RETRY_AFTER: Duration = Duration::from_millis(20);

/// A short step (1 MiB): what is asked for, rounded up to this, on a file system short of room.
const SHORT_STEP_SLOTS: u64 = (1 << 20) / SLOT_BYTES;

/// How much of a device's capacity has storage set aside.
#[derive(Debug)]
pub(crate) struct Backing {
    /// Slots `0..backed` have blocks set aside.
    backed: AtomicU64,
    capacity: u64,
    /// The file system's last answers; held while a step is taken.
    shortfall: Mutex<Shortfall>,
}

/// When the file system last fell short.
#[derive(Debug, Default)]
struct Shortfall {
    /// It refused even what was asked for.
    refused_at: Option<Instant>,
    /// It refused a whole step.
    step_refused_at: Option<Instant>,
    /// The kernel refused even what was asked for memory.
    memory_refused_at: Option<Instant>,
    /// The kernel refused a whole step memory.
    step_memory_refused_at: Option<Instant>,
}

fn recent(at: Option<Instant>) -> bool {
    at.is_some_and(|at| at.elapsed() < RETRY_AFTER)
}

fn is_no_memory(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOMEM)
}

impl Backing {
    /// Every slot backed already: a block device, or a file written in full.
    pub(crate) fn complete(capacity: u64) -> Self {
        Self { backed: AtomicU64::new(capacity), capacity, shortfall: Mutex::default() }
    }

    /// Nothing set aside yet.
    pub(crate) fn growing(capacity: u64) -> Self {
        Self { backed: AtomicU64::new(0), capacity, shortfall: Mutex::default() }
    }

    pub(crate) fn backed(&self) -> u64 {
        self.backed.load(Ordering::Acquire)
    }

    /// Set blocks aside in `file` for slots `0..needed` at least, and `0..wanted` if the file
    /// system has room, a step at a time. ENOSPC when the file system has no room for `needed`
    /// (and for a while after it said so), ENOMEM when the kernel refused the memory (and for a
    /// moment after), EINVAL past the capacity. A refusal of what was wanted beyond the need
    /// is no error: steps stay short for a while after it. Allocates nothing: the engine may
    /// call it from a fault handler.
    pub(crate) fn back(&self, file: &File, needed: u64, wanted: u64) -> io::Result<()> {
        let wanted = wanted.max(needed);
        if wanted <= self.backed() {
            return Ok(());
        }
        if wanted > self.capacity {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut shortfall = self.shortfall.lock().unwrap_or_else(|e| e.into_inner());
        let backed = self.backed();
        if wanted <= backed {
            return Ok(());
        }
        let memory_recent = |at: Option<Instant>| at.is_some_and(|at| at.elapsed() < MEMORY_RETRY_AFTER);
        let refusal = if recent(shortfall.refused_at) {
            Some(libc::ENOSPC)
        } else if memory_recent(shortfall.memory_refused_at) {
            Some(libc::ENOMEM)
        } else {
            None
        };
        if let Some(errno) = refusal {
            // Not asked again so soon; fine while nothing past what is set aside is needed.
            return if needed <= backed { Ok(()) } else { Err(io::Error::from_raw_os_error(errno)) };
        }
        // Lately refused a whole step: no room is asked for beyond the need, and the need in a
        // short step (the need alone, rounded up to 1 MiB). Else a whole step: at least what is
        // wanted and a quarter more than is set aside.
        let steps_short = recent(shortfall.step_refused_at) || memory_recent(shortfall.step_memory_refused_at);
        if steps_short && needed <= backed {
            return Ok(());
        }
        let short = needed.next_multiple_of(SHORT_STEP_SLOTS).min(self.capacity).max(backed);
        let step = if steps_short {
            short
        } else {
            wanted.max(backed.saturating_add(MIN_STEP_SLOTS.max(backed / 4))).min(self.capacity)
        };
        let target = match self.allocate(file, backed, step) {
            Ok(target) => {
                shortfall.refused_at = None;
                shortfall.memory_refused_at = None;
                target
            }
            Err(e) if !is_no_room(&e) && !is_no_memory(&e) => return Err(e),
            // The whole step did not fit (or its memory was refused): the need alone may.
            // What the failed step got (ext4 and XFS keep it) goes back either way, or this
            // file would hold the room other processes need.
            Err(e) => {
                let now = Some(Instant::now());
                if is_no_room(&e) {
                    shortfall.step_refused_at = now;
                } else {
                    shortfall.step_memory_refused_at = now;
                }
                let fitted = if short <= backed {
                    Ok(backed)
                } else if step > short {
                    self.allocate(file, backed, short)
                } else {
                    Err(e)
                };
                give_back(file, *fitted.as_ref().unwrap_or(&backed), step);
                match fitted {
                    Ok(target) => target,
                    // Even the need was refused (it lies past what is set aside: `short > backed`).
                    Err(e) => {
                        if is_no_room(&e) {
                            shortfall.refused_at = now;
                        } else if is_no_memory(&e) {
                            shortfall.memory_refused_at = now;
                        }
                        return Err(e);
                    }
                }
            }
        };
        self.backed.store(target, Ordering::Release);
        Ok(())
    }

    /// fallocate slots `from..to`; the slots then backed (all of them where the file system
    /// has no fallocate: it fills holes as they are written, nothing can be set aside ahead).
    fn allocate(&self, file: &File, from: u64, to: u64) -> io::Result<u64> {
        let len = (to - from) * SLOT_BYTES;
        match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), from * SLOT_BYTES, len) {
            Ok(()) => Ok(to),
            Err(rustix::io::Errno::OPNOTSUPP) => Ok(self.capacity),
            Err(e) => Err(e.into()),
        }
    }
}

fn is_no_room(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// Free the blocks of slots `from..to` (none of which is in use: they lie past what is backed)
/// and keep the file's size. Best effort: what cannot be punched stays set aside, unused.
fn give_back(file: &File, from: u64, to: u64) {
    if to > from {
        let flags = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        let _ = rustix::fs::fallocate(file, flags, from * SLOT_BYTES, (to - from) * SLOT_BYTES);
    }
}
