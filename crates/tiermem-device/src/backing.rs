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
/// long: a program evicting steadily would otherwise ask again for every page.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// How much of a device's capacity has storage set aside.
#[derive(Debug)]
pub(crate) struct Backing {
    /// Slots `0..backed` have blocks set aside.
    backed: AtomicU64,
    capacity: u64,
    /// When the file system last refused a step; held while a step is taken.
    refused_at: Mutex<Option<Instant>>,
}

impl Backing {
    /// Every slot backed already: a block device, or a file written in full.
    pub(crate) fn complete(capacity: u64) -> Self {
        Self { backed: AtomicU64::new(capacity), capacity, refused_at: Mutex::new(None) }
    }

    /// Nothing set aside yet.
    pub(crate) fn growing(capacity: u64) -> Self {
        Self { backed: AtomicU64::new(0), capacity, refused_at: Mutex::new(None) }
    }

    pub(crate) fn backed(&self) -> u64 {
        self.backed.load(Ordering::Acquire)
    }

    /// Set blocks aside in `file` for slots `0..slots` at least, a step at a time. ENOSPC when
    /// the file system has no room for them (and for a while after it said so), EINVAL past
    /// the capacity. Allocates nothing: the engine may call it from a fault handler.
    pub(crate) fn back(&self, file: &File, slots: u64) -> io::Result<()> {
        if slots <= self.backed() {
            return Ok(());
        }
        if slots > self.capacity {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let no_room = || io::Error::from_raw_os_error(libc::ENOSPC);
        let mut refused_at = self.refused_at.lock().unwrap_or_else(|e| e.into_inner());
        let backed = self.backed();
        if slots <= backed {
            return Ok(());
        }
        if refused_at.is_some_and(|at| at.elapsed() < RETRY_AFTER) {
            return Err(no_room());
        }
        let step = MIN_STEP_SLOTS.max(backed / 4);
        // The whole step, or failing that only what was asked for: a nearly full file system
        // may still hold that.
        let mut target = slots.max(backed.saturating_add(step)).min(self.capacity);
        loop {
            let len = (target - backed) * SLOT_BYTES;
            match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), backed * SLOT_BYTES, len) {
                Ok(()) => break,
                // A file system without fallocate fills holes as they are written; nothing can
                // be set aside ahead.
                Err(rustix::io::Errno::OPNOTSUPP) => {
                    target = self.capacity;
                    break;
                }
                Err(rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT) if target > slots => target = slots,
                Err(rustix::io::Errno::NOSPC | rustix::io::Errno::DQUOT) => {
                    *refused_at = Some(Instant::now());
                    return Err(no_room());
                }
                Err(e) => return Err(e.into()),
            }
        }
        *refused_at = None;
        self.backed.store(target, Ordering::Release);
        Ok(())
    }
}
