//! The per-page state word: one `AtomicU64` per 4 KiB page of a managed region.
//!
//! Layout (low to high bits):
//! - 0..3   kind: untouched, resident, evicted, incoming (read in flight), prefetched (in a buffer)
//! - 3      lock: held by the one thread changing this page
//! - 4      dirty: resident and written since it came in (its slot, if any, is stale)
//! - 5      has slot: `slot` names a device slot reserved for this page
//! - 6      writing: a write-back of this page to `slot` is in flight from buffer `buf`
//! - 7      referenced: touched since the replacement policy last looked (second chance)
//! - 8      victim (kind prefetched): evicted, its copy waiting in `buf` in the victim tier;
//!   cold hint (kind resident): advised cold since it last came in, so on the cold list. Under
//!   another kind it means nothing, and any change of kind clears it: a hint or a kept copy
//!   belongs to one stay of the page.
//! - 9      around: dirty only because write fault-around made it writable (maybe unwritten)
//! - 10     in policy: resident, and its coming in was told to the replacement policy
//! - 11     stale entry: given back while in the policy; one of its policy entries is stale
//! - 12..32 buf: arena buffer of an in-flight read, a prefetched page, or an in-flight write
//! - 32..64 slot
//!
//! Every transition happens under the lock bit, so a page is only ever changed by one thread and
//! all readers that act on a page re-check its state after locking.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a page is, coarsely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Never touched: reads as zeros, costs nothing.
    Untouched = 0,
    /// Mapped in the region.
    Resident = 1,
    /// Not mapped; its contents are in `slot` (or, while `writing`, in `buf`).
    Evicted = 2,
    /// A prefetch read into `buf` is in flight.
    Incoming = 3,
    /// Prefetched into `buf`, waiting to be touched (the prefetch cache).
    Prefetched = 4,
}

const KIND_MASK: u64 = 0b111;
const LOCK: u64 = 1 << 3;
const DIRTY: u64 = 1 << 4;
const HAS_SLOT: u64 = 1 << 5;
const WRITING: u64 = 1 << 6;
const REFERENCED: u64 = 1 << 7;
const VICTIM_OR_COLD: u64 = 1 << 8;
const AROUND: u64 = 1 << 9;
const IN_POLICY: u64 = 1 << 10;
const STALE_ENTRY: u64 = 1 << 11;
const BUF_SHIFT: u32 = 12;
const BUF_MASK: u64 = (1 << 20) - 1;
const SLOT_SHIFT: u32 = 32;

/// Largest arena buffer id a state word can hold.
pub const MAX_BUF: u32 = BUF_MASK as u32;
/// Largest slot a state word can hold.
pub const MAX_SLOT: u64 = u32::MAX as u64;

/// A decoded copy of a page's state word (without the lock bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageState(u64);

impl PageState {
    /// Never touched.
    pub const UNTOUCHED: Self = Self(0);

    /// The kind.
    pub fn kind(self) -> Kind {
        match self.0 & KIND_MASK {
            0 => Kind::Untouched,
            1 => Kind::Resident,
            2 => Kind::Evicted,
            3 => Kind::Incoming,
            _ => Kind::Prefetched,
        }
    }
    /// Written since page-in.
    pub fn dirty(self) -> bool {
        self.0 & DIRTY != 0
    }
    /// The reserved slot, if any.
    pub fn slot(self) -> Option<u64> {
        (self.0 & HAS_SLOT != 0).then_some(self.0 >> SLOT_SHIFT)
    }
    /// A write-back is in flight.
    pub fn writing(self) -> bool {
        self.0 & WRITING != 0
    }
    /// Touched since the replacement policy last looked.
    pub fn referenced(self) -> bool {
        self.0 & REFERENCED != 0
    }
    /// Dirty only by presumption: made writable by write fault-around, not by a write fault of
    /// its own, so possibly never written.
    pub fn around(self) -> bool {
        self.0 & AROUND != 0
    }
    /// Resident, and its coming in was told to the replacement policy (`on_insert`): the
    /// policy, the cleaned list or a reclaim batch holds an entry of it. Where a page comes in,
    /// the policy is told before the page is unlocked with this bit: a thread that sees the bit
    /// (cold reclaim, a give-back) and takes the entry out must not find it added after (an
    /// entry of a page gone, under a list policy). Two re-insertions still come after the
    /// page's lock (a victim found busy, a cleaned page found touched): such an entry of a page
    /// given back meanwhile is dropped when it comes up (the page is not resident).
    pub fn in_policy(self) -> bool {
        self.0 & IN_POLICY != 0
    }
    /// Given back by the program while in the policy: one entry of it in a queue policy is
    /// stale, and the first of its entries to come up as a victim is dropped instead of evicting
    /// the page (which may have come back since). See `reclaim::lock_victim`.
    pub fn stale_entry(self) -> bool {
        self.0 & STALE_ENTRY != 0
    }
    /// Held in the victim tier (kind prefetched): evicted, its copy kept in `buf`.
    pub fn victim(self) -> bool {
        self.kind() == Kind::Prefetched && self.0 & VICTIM_OR_COLD != 0
    }
    /// Resident and advised cold since it came in: its entry on the cold list is still good
    /// (an entry of an earlier stay, before an eviction or a give-back, is not).
    pub fn cold_hint(self) -> bool {
        self.kind() == Kind::Resident && self.0 & VICTIM_OR_COLD != 0
    }
    /// The arena buffer, meaningful for incoming, prefetched and writing pages.
    pub fn buf(self) -> u32 {
        ((self.0 >> BUF_SHIFT) & BUF_MASK) as u32
    }

    /// Same state with another kind. A new kind drops the victim bit or cold hint.
    #[must_use]
    pub fn with_kind(self, kind: Kind) -> Self {
        let kept = if self.kind() == kind { self.0 } else { self.0 & !VICTIM_OR_COLD };
        Self((kept & !KIND_MASK) | kind as u64)
    }
    /// Same state with the dirty bit set or cleared (either way no longer dirty by presumption:
    /// a write fault, a write-back or a check has settled it).
    #[must_use]
    pub fn with_dirty(self, dirty: bool) -> Self {
        let settled = self.0 & !AROUND;
        Self(if dirty { settled | DIRTY } else { settled & !DIRTY })
    }
    /// Same state made writable by write fault-around: dirty, but maybe never written. A page
    /// already dirty stays as it is.
    #[must_use]
    pub fn with_dirty_around(self) -> Self {
        if self.dirty() {
            self
        } else {
            Self(self.0 | DIRTY | AROUND)
        }
    }
    /// Same state with the referenced bit set or cleared.
    #[must_use]
    pub fn with_referenced(self, referenced: bool) -> Self {
        Self(if referenced { self.0 | REFERENCED } else { self.0 & !REFERENCED })
    }
    /// Same state with the in-policy bit set or cleared.
    #[must_use]
    pub fn with_in_policy(self, in_policy: bool) -> Self {
        Self(if in_policy { self.0 | IN_POLICY } else { self.0 & !IN_POLICY })
    }
    /// Same state with the stale-entry bit set or cleared.
    #[must_use]
    pub fn with_stale_entry(self, stale: bool) -> Self {
        Self(if stale { self.0 | STALE_ENTRY } else { self.0 & !STALE_ENTRY })
    }
    /// Same state with the victim bit set or cleared (set: kind prefetched only).
    #[must_use]
    pub fn with_victim(self, victim: bool) -> Self {
        debug_assert!(!victim || self.kind() == Kind::Prefetched);
        Self(if victim { self.0 | VICTIM_OR_COLD } else { self.0 & !VICTIM_OR_COLD })
    }
    /// Same state with the cold hint set or cleared (set: kind resident only).
    #[must_use]
    pub fn with_cold_hint(self, cold: bool) -> Self {
        debug_assert!(!cold || self.kind() == Kind::Resident);
        Self(if cold { self.0 | VICTIM_OR_COLD } else { self.0 & !VICTIM_OR_COLD })
    }
    /// The state of an evicted page whose copy waits in the victim tier in `buf`.
    #[must_use]
    pub fn in_victim_tier(self, buf: u32) -> Self {
        self.with_kind(Kind::Prefetched).with_victim(true).with_buf(buf)
    }
    /// Same state with a slot (or none).
    #[must_use]
    pub fn with_slot(self, slot: Option<u64>) -> Self {
        let cleared = (self.0 & !HAS_SLOT) & ((1u64 << SLOT_SHIFT) - 1);
        match slot {
            Some(s) => {
                debug_assert!(s <= MAX_SLOT);
                Self(cleared | HAS_SLOT | (s << SLOT_SHIFT))
            }
            None => Self(cleared),
        }
    }
    /// Same state with a buffer.
    #[must_use]
    pub fn with_buf(self, buf: u32) -> Self {
        debug_assert!(buf <= MAX_BUF);
        Self((self.0 & !(BUF_MASK << BUF_SHIFT)) | (u64::from(buf) << BUF_SHIFT))
    }
    /// Same state with the writing bit set or cleared.
    #[must_use]
    pub fn with_writing(self, writing: bool) -> Self {
        Self(if writing { self.0 | WRITING } else { self.0 & !WRITING })
    }
}

/// One page's atomic state word. Transparent, and all-zero is its default: regions allocate
/// their cells as zeroed memory.
#[derive(Debug, Default)]
#[repr(transparent)]
pub struct PageCell(AtomicU64);

/// Proof that the caller holds a page's lock; unlocking publishes a new state.
#[derive(Debug)]
pub struct LockedPage<'a> {
    cell: &'a PageCell,
    state: PageState,
}

impl PageCell {
    /// Write the cell without changing it (makes its memory page resident; see [`touch_word`]).
    pub(crate) fn touch(&self) {
        touch_word(&self.0);
    }

    /// The state now (may change right after unless the caller holds the lock).
    pub fn peek(&self) -> PageState {
        PageState(self.0.load(Ordering::Acquire) & !LOCK)
    }

    /// The state now, and whether some thread holds the lock, from one load: a locked word's
    /// state may be about to change (a completion that has told the policy of a page it is
    /// mapping publishes it resident only when it unlocks).
    pub fn peek_with_lock(&self) -> (PageState, bool) {
        let word = self.0.load(Ordering::Acquire);
        (PageState(word & !LOCK), word & LOCK != 0)
    }

    /// Whether some thread holds the lock now.
    pub fn is_locked(&self) -> bool {
        self.0.load(Ordering::Relaxed) & LOCK != 0
    }

    /// Take the lock if it is free.
    pub fn try_lock(&self) -> Option<LockedPage<'_>> {
        let cur = self.0.load(Ordering::Relaxed);
        if cur & LOCK != 0 {
            return None;
        }
        self.0
            .compare_exchange(cur, cur | LOCK, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| LockedPage { cell: self, state: PageState(cur) })
    }

    /// Take the lock, spinning (then yielding) while another thread holds it. Holders keep it
    /// for at most one device read, so spinning is cheaper than sleeping.
    pub fn lock(&self) -> LockedPage<'_> {
        let mut spins = 0u32;
        loop {
            if let Some(locked) = self.try_lock() {
                return locked;
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Set the referenced bit if nobody holds the lock (a hint for replacement; a locked page
    /// is being changed and its holder decides).
    pub fn mark_referenced(&self) {
        let cur = self.0.load(Ordering::Relaxed);
        if cur & LOCK == 0 {
            let _ = self.0.compare_exchange(cur, cur | REFERENCED, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

impl LockedPage<'_> {
    /// The state as of locking (or as last set).
    pub fn state(&self) -> PageState {
        self.state
    }

    /// Change the state that unlocking will publish.
    pub fn set(&mut self, state: PageState) {
        self.state = state;
    }
}

impl Drop for LockedPage<'_> {
    fn drop(&mut self) {
        // Nobody else changes the word while it is locked, so the holder's state is the truth.
        self.cell.0.store(self.state.0 & !LOCK, Ordering::Release);
    }
}

/// Write `word` without changing it (makes its memory page resident), even while other threads
/// use it: a compare-exchange of its value with itself, which never undoes a store made
/// meanwhile (a load then a swap could), and where it fails, that store wrote the page
/// already. (An idempotent read-modify-write such as adding zero may be compiled to a plain
/// load, which writes nothing.)
pub(crate) fn touch_word(word: &AtomicU64) {
    let value = word.load(Ordering::Relaxed);
    let _ = word.compare_exchange(value, value, Ordering::Relaxed, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_without_disturbing_each_other() {
        let s = PageState::UNTOUCHED
            .with_kind(Kind::Prefetched)
            .with_slot(Some(MAX_SLOT))
            .with_buf(MAX_BUF)
            .with_writing(true)
            .with_victim(true)
            .with_dirty(true);
        assert_eq!(s.kind(), Kind::Prefetched);
        assert_eq!(s.slot(), Some(MAX_SLOT));
        assert_eq!(s.buf(), MAX_BUF);
        assert!(s.writing() && s.dirty() && s.victim() && !s.referenced() && !s.cold_hint());
        let s = s.with_slot(None).with_writing(false).with_kind(Kind::Resident);
        assert!(!s.victim() && !s.cold_hint(), "a new kind drops the victim bit");
        assert_eq!(s.slot(), None);
        assert_eq!(s.buf(), MAX_BUF);
        assert_eq!(s.kind(), Kind::Resident);
        assert!(!s.writing());
    }

    #[test]
    fn a_cold_hint_lasts_while_the_page_stays_resident() {
        let resident = PageState::UNTOUCHED.with_kind(Kind::Resident).with_slot(Some(3)).with_in_policy(true);
        let cold = resident.with_cold_hint(true);
        assert!(cold.cold_hint() && !cold.victim());
        let kept = cold.with_kind(Kind::Resident).with_dirty(true).with_referenced(true).with_writing(true);
        assert!(kept.cold_hint(), "changes within a stay keep the hint");
        for kind in [Kind::Evicted, Kind::Untouched, Kind::Incoming, Kind::Prefetched] {
            let left = cold.with_kind(kind);
            assert!(!left.victim() && !left.cold_hint(), "{kind:?}");
            assert!(!left.with_kind(Kind::Resident).cold_hint(), "back from {kind:?}");
        }
        assert!(!cold.with_cold_hint(false).cold_hint());
        assert_eq!(cold.with_cold_hint(false), resident);
    }

    #[test]
    fn dirty_by_fault_around_is_settled_by_any_later_verdict() {
        let clean = PageState::UNTOUCHED.with_kind(Kind::Resident).with_slot(Some(7));
        let around = clean.with_dirty_around();
        assert!(around.dirty() && around.around());
        assert_eq!(around.slot(), Some(7));
        assert!(!around.with_dirty(false).dirty() && !around.with_dirty(false).around());
        assert!(around.with_dirty(true).dirty() && !around.with_dirty(true).around(), "a write fault");
        let written = clean.with_dirty(true);
        assert_eq!(written.with_dirty_around(), written, "a written page stays written");
    }

    #[test]
    fn lock_is_exclusive_and_unlock_publishes() {
        let cell = PageCell::default();
        let mut held = cell.try_lock().unwrap();
        assert!(cell.try_lock().is_none());
        held.set(PageState::UNTOUCHED.with_kind(Kind::Resident));
        drop(held);
        assert_eq!(cell.peek().kind(), Kind::Resident);
        assert!(!cell.is_locked());
    }
}
