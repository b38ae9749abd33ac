//! Which addresses are managed: one entry per managed allocation or mapping, keyed by the start
//! of its region. free() is called for every small object too, so the common "not ours" answer
//! must be cheap: managed pointers are page-aligned (glibc's never are, except from memalign),
//! and they lie between the lowest and highest managed addresses seen.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use tiermem_engine::Region;
use tiermem_sys::PAGE_SIZE;

/// How the program got the memory, which decides how it may give it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// malloc, calloc, realloc, memalign and friends: released by free or realloc.
    Malloc,
    /// Anonymous private mmap: released by munmap (possibly piecewise) or moved by mremap.
    Mmap,
}

/// One managed allocation.
#[derive(Debug)]
pub struct Entry {
    /// The engine's region (the whole mapping).
    pub region: Region,
    /// The pointer handed to the program (the region start, or above it for large alignments).
    pub user: usize,
    /// Bytes the program asked for.
    pub size: usize,
    /// How it was allocated.
    pub origin: Origin,
    /// Pieces of an mmap'd region the program has unmapped (offsets, sorted and merged); the
    /// region goes when they cover all of it.
    pub unmapped: Vec<(usize, usize)>,
    /// Pieces the program mapped over with MAP_FIXED (offsets, sorted and merged): the
    /// kernel's now, so calls there go to it, and releasing the region leaves them mapped.
    pub handed_over: Vec<(usize, usize)>,
    /// Pieces handed over that the program then unmapped or moved away, reserved again
    /// (PROT_NONE): holes in the region for good.
    pub reserved: Vec<(usize, usize)>,
    /// The program's fork advice on parts of the region, in order (offset, end, advice):
    /// MADV_WIPEONFORK/KEEPONFORK and MADV_DONTFORK/DOFORK. The kernel applies them to the
    /// mapping; a forked child's copy of evicted pages must follow them too.
    pub fork_advice: Vec<(usize, usize, i32)>,
    /// The program changed the protection of some of it (mprotect): freed, it is not handed
    /// out again, since a new allocation must be readable and writable.
    pub protection_changed: bool,
}

impl Entry {
    /// A new allocation: `region`, handed to the program at `user` for `size` bytes.
    pub fn new(region: Region, user: usize, size: usize, origin: Origin) -> Self {
        Self {
            region,
            user,
            size,
            origin,
            unmapped: Vec::new(),
            handed_over: Vec::new(),
            reserved: Vec::new(),
            fork_advice: Vec::new(),
            protection_changed: false,
        }
    }

    /// Whether a forked child gets no copy of the page at `offset`: its mapping is wiped in the
    /// child (MADV_WIPEONFORK) or absent there (MADV_DONTFORK), by the latest advice of each kind.
    pub fn excluded_from_fork(&self, offset: usize) -> bool {
        let latest = |set: i32, unset: i32| {
            self.fork_advice
                .iter()
                .rev()
                .find(|&&(from, to, advice)| (from..to).contains(&offset) && (advice == set || advice == unset))
                .is_some_and(|&(_, _, advice)| advice == set)
        };
        latest(libc::MADV_WIPEONFORK, libc::MADV_KEEPONFORK) || latest(libc::MADV_DONTFORK, libc::MADV_DOFORK)
    }

    pub fn base(&self) -> usize {
        self.region.as_ptr() as usize
    }

    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Bytes usable from the user pointer to the end of the region.
    pub fn usable(&self) -> usize {
        self.base() + self.len() - self.user
    }

    /// Note that the program unmapped `[from, to)` (offsets in the region; again is harmless,
    /// as for the kernel). Returns whether the whole region is unmapped now.
    pub fn note_unmapped(&mut self, from: usize, to: usize) -> bool {
        tiermem_sys::mem::merge_range(&mut self.unmapped, from, to);
        self.unmapped == [(0, self.len())]
    }

    /// The program is about to map over `[from, to)` (offsets): the engine starts no work
    /// there (not in a forked child, which has no engine). Returns what to give
    /// [`Entry::cancel_hand_over`] if the mapping fails.
    pub fn prepare_hand_over(&self, from: usize, to: usize) -> Vec<(usize, usize)> {
        if crate::runtime::in_forked_child() {
            return Vec::new();
        }
        self.region.prepare_hand_over(from, to - from).unwrap_or_else(|e| {
            crate::runtime::say(&["tiermem: mapping over managed memory: ", &e.to_string()]);
            Vec::new()
        })
    }

    /// The mapping [`Entry::prepare_hand_over`] was for failed.
    pub fn cancel_hand_over(&self, marked: &[(usize, usize)]) {
        if !crate::runtime::in_forked_child() {
            self.region.cancel_hand_over(marked);
        }
    }

    /// The program mapped over `[from, to)` (offsets); see `handed_over`. The engine forgets
    /// its pages there.
    pub fn hand_over(&mut self, from: usize, to: usize) {
        tiermem_sys::mem::merge_range(&mut self.handed_over, from, to);
        tiermem_sys::mem::remove_range(&mut self.reserved, from, to);
        if !crate::runtime::in_forked_child() {
            if let Err(e) = self.region.hand_over(from, to - from) {
                crate::runtime::say(&["tiermem: mapping over managed memory: ", &e.to_string()]);
            }
        }
    }

    /// Whether `[from, to)` (offsets) meets a piece that is not the region's own memory.
    pub fn meets_foreign(&self, from: usize, to: usize) -> bool {
        self.handed_over.iter().chain(&self.reserved).any(|&(a, b)| a < to && b > from)
    }

    /// Whether the program still has some of this mapping at or after `offset`: not unmapped,
    /// not handed over, below the size it asked for.
    pub fn maps_beyond(&self, offset: usize) -> bool {
        let end = self.size.next_multiple_of(PAGE_SIZE).min(self.len());
        if offset >= end {
            return false;
        }
        let mut gone = self.unmapped.clone();
        for &(a, b) in self.handed_over.iter().chain(&self.reserved) {
            tiermem_sys::mem::merge_range(&mut gone, a, b);
        }
        tiermem_sys::mem::gaps_between(&gone, end).iter().any(|&(_, b)| b > offset)
    }

    /// `[from, to)` (offsets), handed over before, is reserved for the region again.
    pub fn take_back(&mut self, from: usize, to: usize) {
        tiermem_sys::mem::remove_range(&mut self.handed_over, from, to);
        tiermem_sys::mem::merge_range(&mut self.reserved, from, to);
        if !crate::runtime::in_forked_child() {
            self.region.take_back(from, to - from);
        }
    }

    /// `[from, to)` (offsets), handed over, holds fresh anonymous memory the program has just
    /// mapped there with MAP_FIXED: the region's own again, managed (see
    /// [`tiermem_engine::Region::adopt_back`]). Its fork advice starts afresh, as the new
    /// mapping's does in the kernel.
    ///
    /// # Safety
    /// As for `Region::adopt_back`: the range is that fresh mapping, not yet used.
    pub unsafe fn adopt_back(&mut self, from: usize, to: usize) -> Result<(), String> {
        // SAFETY: this function's contract.
        unsafe { self.region.adopt_back(from, to - from) }.map_err(|e| e.to_string())?;
        for list in [&mut self.handed_over, &mut self.reserved, &mut self.unmapped] {
            tiermem_sys::mem::remove_range(list, from, to);
        }
        if !self.fork_advice.is_empty() {
            self.fork_advice.extend([(from, to, libc::MADV_KEEPONFORK), (from, to, libc::MADV_DOFORK)]);
        }
        Ok(())
    }

    /// The parts of the region not handed over, as absolute (start, end).
    pub fn own_parts(&self) -> Vec<(usize, usize)> {
        let base = self.base();
        tiermem_sys::mem::gaps_between(&self.handed_over, self.len())
            .into_iter()
            .map(|(a, b)| (base + a, base + b))
            .collect()
    }

    /// Whether the page at `offset` is in a piece handed over to the kernel.
    fn is_handed_over(&self, offset: usize) -> bool {
        self.handed_over.iter().any(|&(from, to)| (from..to).contains(&offset))
    }
}

static TABLE: Mutex<BTreeMap<usize, Entry>> = Mutex::new(BTreeMap::new());
static LIVE: AtomicUsize = AtomicUsize::new(0);
static LOWEST: AtomicUsize = AtomicUsize::new(usize::MAX);
static HIGHEST: AtomicUsize = AtomicUsize::new(0);

/// The table, locked. Lock order: this before the engine's region table.
pub fn lock() -> MutexGuard<'static, BTreeMap<usize, Entry>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Address ranges of regions taken out of the table to be released, whose release has not
/// finished: the kernel still maps them until their regions are dropped, outside the table's
/// lock (see [`ReleaseMark`]). Slots of (start, end, the releasing thread: [`this_thread`]);
/// an end of 0 is a free slot.
const RELEASE_SLOTS: usize = 16;
static RELEASING: [[AtomicUsize; 3]; RELEASE_SLOTS] = [const { [const { AtomicUsize::new(0) }; 3] }; RELEASE_SLOTS];
/// Slots taken.
static RELEASING_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Releases that found every slot taken: while any runs, every range counts as being released.
static RELEASING_ANYWHERE: AtomicUsize = AtomicUsize::new(0);
/// Regions under marks, still counted in [`LIVE`].
static RELEASING_REGIONS: AtomicUsize = AtomicUsize::new(0);
/// The process the marks belong to. A forked child has copies of the marks the parent's other
/// threads held, which no thread of its own will ever end: they are never waited for there,
/// and the first look under the table's lock forgets them (see [`forget_inherited_marks`]),
/// whichever way it was forked (a child of a child, or
/// a clone without the fork handlers, runs no hook of ours).
static MARKS_PID: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Releases this thread has under way, which it never waits for (a signal handler of the
    /// program's run in the middle of one would wait for ever), as (the process they were made
    /// in, how many): those in slots are known by the slot's thread, those counted in
    /// [`RELEASING_ANYWHERE`] only by this count. Other threads' marks are waited for all the
    /// same. Made in another process (a child forked in the middle of a release), they count as
    /// none: those marks were forgotten.
    static RELEASING_HERE: std::cell::Cell<(usize, usize, usize)> = const { std::cell::Cell::new((0, 0, 0)) };
}

/// This thread's releases under way in process `pid`: (in slots, counted anywhere).
fn marks_here(pid: usize) -> (usize, usize) {
    let (made_in, slots, anywhere) = RELEASING_HERE.with(std::cell::Cell::get);
    if made_in == pid {
        (slots, anywhere)
    } else {
        (0, 0)
    }
}

/// This thread, as a number no other live thread has: the address of a thread-local.
fn this_thread() -> usize {
    thread_local! {
        static ME: u8 = const { 0 };
    }
    ME.with(|me| me as *const u8 as usize)
}

fn current_pid() -> usize {
    crate::io::sys!(libc::SYS_getpid) as usize
}

/// Make the marks this process's, forgetting them (and the regions they kept counted live)
/// if they were copied from a parent. Under the table's lock (`_table`), as marks are made: a
/// mark made meanwhile by another thread of this process would be wiped with them.
fn forget_inherited_marks(_table: &BTreeMap<usize, Entry>, me: usize) {
    if MARKS_PID.load(Ordering::Acquire) == me {
        return;
    }
    for slot in &RELEASING {
        slot[1].store(0, Ordering::Release);
    }
    RELEASING_COUNT.store(0, Ordering::Release);
    RELEASING_ANYWHERE.store(0, Ordering::Release);
    LIVE.fetch_sub(RELEASING_REGIONS.swap(0, Ordering::AcqRel), Ordering::AcqRel);
    MARKS_PID.store(me, Ordering::Release);
}

/// Regions being released: marked from when they leave the table (under its lock) until this
/// is dropped, after their release. A mapping the program makes at a fixed address in their
/// range meanwhile (in a hole it unmapped earlier, say) waits for the release ([`lock_clear_of`],
/// [`wait_released`]) instead of being unmapped with the region, or failing with EEXIST over
/// the range the kernel still maps. The release itself cannot happen under the lock: dropping
/// a region allocates, and the small heap's lock comes before this one.
#[derive(Debug)]
pub struct ReleaseMark {
    /// The slot, or None for a release counted in [`RELEASING_ANYWHERE`].
    slot: Option<usize>,
    /// Regions taken out with [`take_for_release`], still counted live.
    regions: usize,
    /// The process that made it (a forked child's copy of it is not its own).
    pid: usize,
}

impl ReleaseMark {
    /// Mark `[start, end)`, the span of the `regions` regions the caller took out of the table
    /// with [`take_for_release`], as being released (under the table's lock, which `table`
    /// shows).
    pub fn new(table: &mut BTreeMap<usize, Entry>, start: usize, end: usize, regions: usize) -> Self {
        let pid = current_pid();
        forget_inherited_marks(table, pid);
        RELEASING_REGIONS.fetch_add(regions, Ordering::AcqRel);
        // Slots are taken only under the table's lock, so no two threads race for one.
        let slot = (0..RELEASE_SLOTS).find(|&k| RELEASING[k][1].load(Ordering::Acquire) == 0);
        // This thread's own count first: a signal handler run between the two must not wait
        // for the mark without a bound.
        let (slots, anywhere) = marks_here(pid);
        match slot {
            Some(k) => {
                RELEASING_HERE.with(|here| here.set((pid, slots + 1, anywhere)));
                RELEASING[k][0].store(start, Ordering::Relaxed);
                RELEASING[k][2].store(this_thread(), Ordering::Relaxed);
                RELEASING_COUNT.fetch_add(1, Ordering::AcqRel);
                RELEASING[k][1].store(end, Ordering::Release);
            }
            None => {
                RELEASING_HERE.with(|here| here.set((pid, slots, anywhere + 1)));
                RELEASING_ANYWHERE.fetch_add(1, Ordering::AcqRel);
            }
        }
        Self { slot, regions, pid }
    }
}

impl Drop for ReleaseMark {
    fn drop(&mut self) {
        // In a forked child (a fork from a signal handler in the middle of a release) the copy
        // was forgotten, or will be.
        if self.pid != current_pid() {
            return;
        }
        // The mark first, this thread's count after: a signal handler run between the two
        // waits for nothing of its own (a slot taken again meanwhile is another thread's, and
        // known as such).
        let (slots, anywhere) = marks_here(self.pid);
        match self.slot {
            Some(k) => {
                RELEASING[k][1].store(0, Ordering::Release);
                RELEASING_COUNT.fetch_sub(1, Ordering::AcqRel);
                RELEASING_HERE.with(|here| here.set((self.pid, slots.saturating_sub(1), anywhere)));
            }
            None => {
                RELEASING_ANYWHERE.fetch_sub(1, Ordering::AcqRel);
                RELEASING_HERE.with(|here| here.set((self.pid, slots, anywhere.saturating_sub(1))));
            }
        }
        // Their ranges are unmapped: from here a call there need not look at the table.
        RELEASING_REGIONS.fetch_sub(self.regions, Ordering::AcqRel);
        LIVE.fetch_sub(self.regions, Ordering::AcqRel);
    }
}

/// Take entry `base` out of the table to be released outside the lock, under a
/// [`ReleaseMark`] (the only way an entry leaves). It stays counted live until the mark goes,
/// so that [`may_overlap`] sends a call at a fixed address in its range to the table (and
/// [`lock_clear_of`]) rather than straight to the kernel, which still maps the range.
pub fn take_for_release(table: &mut BTreeMap<usize, Entry>, base: usize) -> Option<Entry> {
    table.remove(&base)
}

/// Whether a release by another thread still holds part of `[start, end)`.
fn released_by_another(start: usize, end: usize) -> bool {
    if RELEASING_COUNT.load(Ordering::Acquire) == 0 && RELEASING_ANYWHERE.load(Ordering::Acquire) == 0 {
        return false;
    }
    // Marks copied from a parent are never waited for (and forgotten under the lock, see
    // `lock_clear_of`).
    let pid = current_pid();
    if MARKS_PID.load(Ordering::Acquire) != pid {
        return false;
    }
    // This thread's own marks are not waited for; every other thread's are.
    let (_, mine_anywhere) = marks_here(pid);
    let me = this_thread();
    RELEASING_ANYWHERE.load(Ordering::Acquire) > mine_anywhere
        || RELEASING.iter().any(|slot| {
            let to = slot[1].load(Ordering::Acquire);
            to != 0 && slot[2].load(Ordering::Relaxed) != me && slot[0].load(Ordering::Relaxed) < end && start < to
        })
}

/// How long a thread with a release of its own under way waits for another thread's: it is a
/// signal handler of the program's run in the middle of that release (nothing else of the
/// thread's maps memory then), and the other release may need a lock the interrupted one
/// holds (the engine's region table), which would wait for ever.
const WAIT_WITH_OWN_RELEASE: std::time::Duration = std::time::Duration::from_millis(100);

/// Wait until no region overlapping `[start, end)` is being released by another thread (a
/// mapping at a fixed address made before that would be unmapped with the region), or until
/// `deadline`.
fn wait_released(start: usize, end: usize, deadline: Option<std::time::Instant>) {
    let mut looks = 0u32;
    while released_by_another(start, end) && deadline.is_none_or(|d| std::time::Instant::now() < d) {
        // A release may unmap gigabytes: after a few yields, short sleeps rather than a CPU.
        if looks < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        looks = looks.saturating_add(1);
    }
}

/// The table, locked once no region overlapping `[start, end)` is being released by another
/// thread (see [`wait_released`]; at most [`WAIT_WITH_OWN_RELEASE`] for a thread with a release
/// of its own under way); a release starting later is one the caller sees in the table.
pub fn lock_clear_of(start: usize, end: usize) -> MutexGuard<'static, BTreeMap<usize, Entry>> {
    // (A system call only while some release is under way.)
    let any = RELEASING_COUNT.load(Ordering::Acquire) != 0 || RELEASING_ANYWHERE.load(Ordering::Acquire) != 0;
    let deadline =
        (any && marks_here(current_pid()) != (0, 0)).then(|| std::time::Instant::now() + WAIT_WITH_OWN_RELEASE);
    loop {
        let table = lock();
        if RELEASING_COUNT.load(Ordering::Acquire) != 0 || RELEASING_ANYWHERE.load(Ordering::Acquire) != 0 {
            forget_inherited_marks(&table, current_pid());
        }
        if !released_by_another(start, end) || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return table;
        }
        drop(table);
        wait_released(start, end, deadline);
    }
}

/// Whether `[addr, addr+len)` may touch managed memory (false is certain, true needs a lookup).
pub fn may_overlap(addr: usize, len: usize) -> bool {
    LIVE.load(Ordering::Acquire) != 0
        && addr < HIGHEST.load(Ordering::Acquire)
        && addr.saturating_add(len) > LOWEST.load(Ordering::Acquire)
}

/// Whether `ptr` could be a managed malloc pointer (false is certain).
pub fn may_be_managed_pointer(ptr: usize) -> bool {
    ptr.is_multiple_of(PAGE_SIZE) && may_overlap(ptr, 1)
}

pub fn insert(table: &mut BTreeMap<usize, Entry>, entry: Entry) {
    let (base, end) = (entry.base(), entry.base() + entry.len());
    LOWEST.fetch_min(base, Ordering::AcqRel);
    HIGHEST.fetch_max(end, Ordering::AcqRel);
    table.insert(base, entry);
    LIVE.fetch_add(1, Ordering::AcqRel);
}

/// The start of the entry whose region contains `addr` (not in a piece handed over).
pub fn containing(table: &BTreeMap<usize, Entry>, addr: usize) -> Option<usize> {
    let (&base, entry) = table.range(..=addr).next_back()?;
    (addr < base + entry.len() && !entry.is_handed_over(addr - base)).then_some(base)
}

/// `[start, end)` cut into pieces, in order: `(from, to, Some(base))` where entry `base`
/// manages the memory, `(from, to, None)` where the kernel does (between entries, or in a
/// piece handed over).
pub fn segments(table: &BTreeMap<usize, Entry>, start: usize, end: usize) -> Vec<(usize, usize, Option<usize>)> {
    let mut out = Vec::new();
    let mut at = start;
    let first = spanning(table, start).unwrap_or(start);
    for (&base, entry) in table.range(first..end) {
        let (from, to) = (base.max(start), (base + entry.len()).min(end));
        if from >= to {
            continue;
        }
        if at < from {
            out.push((at, from, None));
        }
        let mut cursor = from;
        for &(a, b) in &entry.handed_over {
            let (a, b) = ((base + a).max(cursor), (base + b).min(to));
            if a >= b {
                continue;
            }
            if cursor < a {
                out.push((cursor, a, Some(base)));
            }
            out.push((a, b, None));
            cursor = b;
        }
        if cursor < to {
            out.push((cursor, to, Some(base)));
        }
        at = to;
    }
    if at < end {
        out.push((at, end, None));
    }
    out
}

/// Whether the program has nothing mapped anywhere in `[start, end)` (non-empty), which lies
/// wholly in mmap'd regions: only pieces it unmapped, or reserved again after it unmapped what
/// it had mapped over them. The kernel still holds a mapping there (the region's, or the
/// reservation), which a MAP_FIXED_NOREPLACE would meet where without tiermem it meets none.
pub fn unmapped_by_program(table: &BTreeMap<usize, Entry>, start: usize, end: usize) -> bool {
    let mut at = start;
    let first = spanning(table, start).unwrap_or(start);
    for (&base, entry) in table.range(first..end) {
        let (from, to) = (base.max(start) - base, (base + entry.len()).min(end) - base);
        if from >= to {
            continue;
        }
        if base + from != at || entry.origin != Origin::Mmap {
            return false;
        }
        let mut gone = entry.unmapped.clone();
        for &(a, b) in &entry.reserved {
            tiermem_sys::mem::merge_range(&mut gone, a, b);
        }
        // `unmapped` also holds the pieces the program mapped over: those are its mapping now.
        let covered = gone.iter().any(|&(a, b)| a <= from && to <= b);
        if !covered || entry.handed_over.iter().any(|&(a, b)| a < to && from < b) {
            return false;
        }
        at = base + to;
    }
    start < end && at == end
}

/// The start of the entry whose region spans `addr`, handed-over pieces included (what
/// free() and realloc() look a pointer up by: the program may have mapped over its block).
pub fn spanning(table: &BTreeMap<usize, Entry>, addr: usize) -> Option<usize> {
    let (&base, entry) = table.range(..=addr).next_back()?;
    (addr < base + entry.len()).then_some(base)
}

/// Starts of the entries whose regions overlap `[addr, addr+len)` (by their whole range).
pub fn overlapping(table: &BTreeMap<usize, Entry>, addr: usize, len: usize) -> Vec<usize> {
    let end = addr.saturating_add(len);
    let first = spanning(table, addr).unwrap_or(addr);
    table.range(first..end).map(|(&base, _)| base).collect()
}

/// The entry whose handed-over piece holds `addr`, and that piece (absolute addresses).
pub fn handed_over_at(table: &BTreeMap<usize, Entry>, addr: usize) -> Option<(usize, usize, usize)> {
    let base = spanning(table, addr)?;
    let entry = &table[&base];
    entry
        .handed_over
        .iter()
        .find(|&&(from, to)| (base + from..base + to).contains(&addr))
        .map(|&(from, to)| (base, base + from, base + to))
}

/// Recently freed managed pointers, to recognise a double free cheaply.
static RECENTLY_FREED: [AtomicUsize; 64] = [const { AtomicUsize::new(0) }; 64];
static RECENT_NEXT: AtomicUsize = AtomicUsize::new(0);

pub fn remember_freed(ptr: usize) {
    let i = RECENT_NEXT.fetch_add(1, Ordering::Relaxed) % RECENTLY_FREED.len();
    RECENTLY_FREED[i].store(ptr, Ordering::Relaxed);
}

/// `ptr` was freed by this shim recently and nothing is mapped there now: freeing it again is a
/// double free (if something is mapped there, the C library may own it now).
pub fn is_double_free(ptr: usize) -> bool {
    if ptr == 0 || !RECENTLY_FREED.iter().any(|p| p.load(Ordering::Relaxed) == ptr) {
        return false;
    }
    let mut vec = 0u8;
    // SAFETY: mincore only reads the page tables for the page at ptr and writes one byte to vec;
    // ENOMEM means the page is not mapped.
    let rc = unsafe { libc::mincore(ptr as *mut libc::c_void, 1, &mut vec) };
    rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM)
}

#[cfg(test)]
mod tests {
    use super::{lock, lock_clear_of, released_by_another, ReleaseMark, WAIT_WITH_OWN_RELEASE};

    #[test]
    fn a_thread_with_a_release_of_its_own_under_way_still_waits_for_another_threads() {
        // Address ranges no test maps: only the marks are looked at.
        let (mine_at, theirs_at, len) = (0x7100_0000_0000usize, 0x7100_1000_0000usize, 1 << 20);
        let mine = ReleaseMark::new(&mut lock(), mine_at, mine_at + len, 0);
        assert!(!released_by_another(mine_at, mine_at + 4096), "its own release is never waited for");
        let (marked_tx, marked_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || {
            let theirs = ReleaseMark::new(&mut lock(), theirs_at, theirs_at + len, 0);
            marked_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(theirs);
        });
        marked_rx.recv().unwrap();
        // Before, a thread with a release of its own under way looked at no other's.
        assert!(released_by_another(theirs_at + len - 4096, theirs_at + len));
        assert!(!released_by_another(theirs_at + len, theirs_at + 2 * len), "a range next to it is clear");
        // Waited for, but not for ever (the other release could need what this thread holds).
        let started = std::time::Instant::now();
        drop(lock_clear_of(theirs_at, theirs_at + 4096));
        assert!(started.elapsed() >= WAIT_WITH_OWN_RELEASE);
        done_tx.send(()).unwrap();
        other.join().unwrap();
        assert!(!released_by_another(theirs_at, theirs_at + 4096), "released");
        drop(mine);
        // Without a release of its own, the wait for another's lasts until that one is done.
        static RELEASED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        let (marked_tx, marked_rx) = std::sync::mpsc::channel();
        let other = std::thread::spawn(move || {
            let theirs = ReleaseMark::new(&mut lock(), theirs_at, theirs_at + len, 0);
            marked_tx.send(()).unwrap();
            std::thread::sleep(3 * WAIT_WITH_OWN_RELEASE);
            RELEASED.store(true, std::sync::atomic::Ordering::SeqCst);
            drop(theirs);
        });
        marked_rx.recv().unwrap();
        drop(lock_clear_of(theirs_at, theirs_at + 4096));
        assert!(RELEASED.load(std::sync::atomic::Ordering::SeqCst), "waited until the other release was done");
        assert!(!released_by_another(theirs_at, theirs_at + 4096));
        other.join().unwrap();
    }
}
