//! The memory cgroup the program runs in: the room it leaves the budget (everything charged that
//! the engine does not manage taken off its limit), the room kept for the program's file pages,
//! and the OOM guard that pauses the program instead of killing it when a burst outruns a look.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tiermem_engine::Engine;
use tiermem_sys::guarded_fd::Guarded;

use crate::runtime::say;

/// The lowest budget the cgroup left, over the run.
pub(crate) static LOWEST_BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);
/// Times the cgroup ran out of memory under the OOM guard and the budget was cut for it.
pub(crate) static OOM_RESCUES: AtomicU64 = AtomicU64::new(0);
/// Times it ran out while the guard held its ballast, whose release was room enough.
pub(crate) static BALLAST_RELEASES: AtomicU64 = AtomicU64::new(0);
/// Refaults of the cgroup's file pages seen while following it (see [`FileRoom`]), how many of
/// them page faults could have read back, and the most room kept for its file pages because of
/// them.
pub(crate) static FILE_REFAULTS: AtomicU64 = AtomicU64::new(0);
pub(crate) static FILE_FAULT_REFAULTS: AtomicU64 = AtomicU64::new(0);
pub(crate) static PEAK_FILE_ROOM: AtomicU64 = AtomicU64::new(0);
/// Bytes of the OOM guard's ballast (0 without the guard).
pub(crate) static BALLAST_BYTES: AtomicU64 = AtomicU64::new(0);

/// The memory cgroup this process runs in, when it has a limit.
#[derive(Debug, Clone)]
pub struct CgroupRoom {
    pub(crate) limit: u64,
    usage: std::path::PathBuf,
    stat: std::path::PathBuf,
    keys: &'static StatKeys,
    /// Nothing charged to the cgroup can be swapped out (v1: memory.memsw.limit_in_bytes no
    /// higher than the limit; v2: memory.swap.max 0).
    pub(crate) no_swap: bool,
    /// The cgroup's directory when it is a v1 memory cgroup (the OOM guard needs v1's
    /// `memory.oom_control`).
    v1_dir: Option<std::path::PathBuf>,
}

impl CgroupRoom {
    /// Our memory cgroup (v2 unified or v1 memory controller) if it sets a limit.
    pub fn of_self() -> Option<Self> {
        if let Some(dir) = tiermem_sys::cgroup::own_v1_memory_dir() {
            let limit = read_number(&dir.join("memory.limit_in_bytes"))?;
            // No memsw file: swap is not accounted, so not limited either.
            let memsw = read_number(&dir.join("memory.memsw.limit_in_bytes"));
            return (limit < 1 << 60).then(|| Self {
                limit,
                usage: dir.join("memory.usage_in_bytes"),
                stat: dir.join("memory.stat"),
                keys: &V1_KEYS,
                no_swap: memsw.is_some_and(|memsw| memsw <= limit),
                v1_dir: Some(dir.clone()),
            });
        }
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        for line in cgroups.lines() {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let path = path.trim_start_matches('/');
            if controllers.is_empty() {
                let dir = std::path::Path::new("/sys/fs/cgroup").join(path);
                if let Some(limit) = read_number(&dir.join("memory.max")) {
                    return Some(Self {
                        limit,
                        usage: dir.join("memory.current"),
                        stat: dir.join("memory.stat"),
                        keys: &V2_KEYS,
                        no_swap: read_number(&dir.join("memory.swap.max")) == Some(0),
                        v1_dir: None,
                    });
                }
            }
        }
        None
    }

    /// One look at the cgroup: what it is charged for that the kernel cannot simply drop
    /// (everything but the page cache: anonymous memory, page tables, kernel stacks and other
    /// kernel memory), and how many of its file pages were read back soon after the kernel
    /// evicted them (None where the kernel does not count that).
    pub(crate) fn look(&self) -> Option<CgroupLook> {
        let usage = read_number(&self.usage)?;
        let stat = std::fs::read_to_string(&self.stat).ok()?;
        CgroupLook::from_stat(usage, &stat, self.keys)
    }
}

/// The fields of a cgroup's `memory.stat` a look reads.
#[derive(Debug)]
struct StatKeys {
    /// The page cache, shared memory included.
    cache: &'static str,
    /// Shared memory (shmem, tmpfs, memfd): in the page cache's count, but not droppable.
    shmem: &'static str,
    /// Pages locked in memory (mlock), of files among them: the shim's own code and the C
    /// library's, which it locks (see `pin_own_code`), are charged here when no other cgroup
    /// had them in its page cache first.
    unevictable: &'static str,
    refaults: &'static str,
    /// Page faults that read from a file (or swap, which a cgroup without swap has none of).
    major_faults: &'static str,
}

/// v1 (`total_` counts this cgroup and those below it, as its usage does).
static V1_KEYS: StatKeys = StatKeys {
    cache: "total_cache ",
    shmem: "total_shmem ",
    unevictable: "total_unevictable ",
    refaults: "total_workingset_refault_file ",
    major_faults: "total_pgmajfault ",
};
static V2_KEYS: StatKeys = StatKeys {
    cache: "file ",
    shmem: "shmem ",
    unevictable: "unevictable ",
    refaults: "workingset_refault_file ",
    major_faults: "pgmajfault ",
};

/// See [`CgroupRoom::look`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CgroupLook {
    pub(crate) charged: u64,
    /// The page cache the kernel may drop (shared memory left out).
    pub(crate) droppable: u64,
    pub(crate) file_refaults: Option<u64>,
    pub(crate) major_faults: Option<u64>,
}

impl CgroupLook {
    /// A look from the cgroup's usage and its `memory.stat` text; None without a page cache
    /// count. Shared memory is counted as charged although both cgroup versions count it as
    /// page cache: the kernel can only swap it out, never drop it, and a cgroup without swap
    /// (as `bench apps` runs tiermem) cannot even do that. Counted as droppable, a program's
    /// 16 MiB memfd under a 48 MiB limit was room the budget took back at every look, and the
    /// OOM guard gave up in about one run in seven. Locked pages cannot be dropped either (the
    /// count does not tell locked file pages from locked anonymous ones, so all are left out):
    /// counted as droppable, the 1.5 MiB of code the shim locks under a 6.2 MiB limit was room
    /// the budget kept while the cgroup was full, and the program's page copies were refused
    /// until it got SIGBUS.
    fn from_stat(usage: u64, stat: &str, keys: &StatKeys) -> Option<Self> {
        let field = |key: &str| stat.lines().find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok());
        let cache = field(keys.cache)?;
        let not_droppable = field(keys.shmem).unwrap_or(0) + field(keys.unevictable).unwrap_or(0);
        let droppable = cache.saturating_sub(not_droppable);
        Some(Self {
            charged: usage.saturating_sub(droppable),
            droppable,
            file_refaults: field(keys.refaults),
            major_faults: field(keys.major_faults),
        })
    }
}

/// Room kept free for the program's file pages: its code, the libraries it runs, files it maps
/// or reads again. The budget counts the page cache as droppable, and without this it takes that
/// memory too; the kernel then evicts the program's own code, which comes back from disk on
/// every use (a Redis server at 20% of its footprint whose code was first read inside its
/// cgroup: 340,000 major faults and 400 s instead of 23). Every refault the cgroup reports (a
/// file page read back soon after the kernel evicted it) adds room by the reads it cost, at
/// most half the cgroup's room: a page for each refault a major fault read (one read each), and
/// a page per [`READ_AROUND_PAGES`] of the others, which came in as many to a request (the
/// kernel's read-around of a faulting page's neighbours, the readahead of `read` calls as a
/// program reads its input again). A page of the budget spares up to a read of the program's
/// memory too, so the two sides win room at the same price. Counting every refault as a page,
/// k-means at 40% of its footprint (a 102 MiB cgroup) after `drop_caches` left 51 MiB to the
/// page cache after 45,000 refaults (its input file, Python's modules) with 760 major faults,
/// and took 18–20 s; 11–12.5 s counting reads (docs/running-programs.md).
///
/// A look without refaults gives back a 1024th (about 14 s to halve), and at once whatever the
/// page cache does not fill: room the file pages leave empty protects nothing. Refaults come in
/// bursts while a program starts (an interpreter importing its libraries in a full cgroup), and
/// the room they leave behind is mostly not needed again: Linpack at 20% of its footprint saw
/// 2,500–3,200 refaults in its first second and none after, and the room that decayed from them
/// took 4–17 MiB from a budget of about 30 for the whole 13–20 s run, while the page cache
/// shrank from 6 MiB to 2.5 without a refault. Room the cache leaves empty now goes back to the
/// budget; the kernel then drops file pages nobody uses again, and those the program does use
/// come back as refaults and win their room again.
#[derive(Debug, Default)]
struct FileRoom {
    /// The cgroup's refault count at the last look.
    seen: Option<u64>,
    /// Its count of major faults at the last look.
    seen_major: Option<u64>,
    /// Refaults read back in batches not yet counted (under [`READ_AROUND_PAGES`]).
    batch_carry: u64,
    bytes: u64,
}

/// Pages one read of the page cache brings in when it reads ahead: the kernel's read-around of a
/// faulting page and a `read` call's readahead, `read_ahead_kb`'s default of 128 KiB.
const READ_AROUND_PAGES: u64 = 32;

/// The cgroup's counts a [`FileRoom`] follows, from one look.
#[derive(Debug, Clone, Copy, Default)]
struct FileCounts {
    refaults: Option<u64>,
    major_faults: Option<u64>,
}

impl FileRoom {
    /// Update from a look's counts and droppable page cache; returns the room to keep.
    /// While the engine is still evicting down to a budget already cut (`catching_up`),
    /// refaults are the cut not having taken effect yet, not a sign that more room is needed:
    /// they are not counted again.
    fn update(&mut self, counts: FileCounts, cache: u64, cap: u64, catching_up: bool) -> u64 {
        let since = |now: Option<u64>, before: Option<u64>| match (now, before) {
            (Some(now), Some(before)) => Some(now.saturating_sub(before)),
            _ => None,
        };
        let new = since(counts.refaults, self.seen).unwrap_or(0);
        let new_major = since(counts.major_faults, self.seen_major);
        if counts.refaults.is_some() {
            self.seen = counts.refaults;
        }
        if counts.major_faults.is_some() {
            self.seen_major = counts.major_faults;
        }
        if catching_up {
            return self.bytes;
        }
        // Without a count of major faults (never seen on a kernel with refault counts) every
        // refault counts as a read of its own.
        let by_faults = new_major.map_or(new, |major| new.min(major));
        self.batch_carry += new - by_faults;
        let batched = self.batch_carry / READ_AROUND_PAGES;
        self.batch_carry %= READ_AROUND_PAGES;
        FILE_REFAULTS.fetch_add(new, Ordering::Relaxed);
        FILE_FAULT_REFAULTS.fetch_add(by_faults, Ordering::Relaxed);
        let pages = by_faults + batched;
        if pages > 0 {
            self.bytes = (self.bytes + pages * tiermem_sys::PAGE_SIZE as u64).min(cap);
            PEAK_FILE_ROOM.fetch_max(self.bytes, Ordering::Relaxed);
        } else {
            self.bytes -= self.bytes / 1024;
            self.bytes = self.bytes.min(cache);
        }
        self.bytes
    }
}

pub(crate) fn read_number(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Keep the budget inside the cgroup: the room left is the limit minus everything charged that
/// the engine does not manage (the program's unmanaged memory, the runtime, our own buffers,
/// kernel memory such as page tables) minus a margin for growth between two looks.
///
/// A device that keeps evicted pages in this process's memory (`mem`, far memory emulated in
/// DRAM) is charged to the cgroup as well, so such a cgroup must be larger than the local
/// memory; then the configured limit is the local memory, and it counts everything else charged
/// just as the cgroup does for a file device (what makes `mem` a fair ideal for `file`).
///
/// `margin` is the room kept free (see [`base_margin`] and [`watch_cgroup`]).
pub(crate) fn fit_budget_to_cgroup(engine: &Engine, cgroup: &CgroupRoom, configured: u64, margin: u64) {
    if let Some(look) = cgroup.look() {
        fit_budget_to_look(engine, cgroup, configured, margin, look);
    }
}

/// [`fit_budget_to_cgroup`] with the cgroup already read.
fn fit_budget_to_look(engine: &Engine, cgroup: &CgroupRoom, configured: u64, margin: u64, look: CgroupLook) {
    let local = local_room(engine, cgroup, configured);
    let held = engine.device_memory_held();
    let managed = engine.resident_pages() * tiermem_sys::PAGE_SIZE as u64;
    let unmanaged = look.charged.saturating_sub(managed + held.unwrap_or(0));
    let room = local.saturating_sub(unmanaged + margin);
    let budget = engine.set_limit_bytes(room.min(configured));
    LOWEST_BUDGET.fetch_min(budget, Ordering::Relaxed);
}

/// Room kept free for growth between two looks: a 50th of the room, at least 1 MiB, or a 16th
/// of a room under 16 MiB (proportional, so a small cgroup still leaves the engine most of its
/// room).
pub(crate) fn base_margin(engine: &Engine, cgroup: &CgroupRoom, configured: u64) -> u64 {
    let room = local_room(engine, cgroup, configured);
    (room / 50).max(small_share(room, 1 << 20))
}

/// Most the margin may take under the OOM guard, which holds it as its ballast: a burst larger
/// than this is what the guard's pause and budget cut are for. A 50th of a large cgroup was
/// memory no program could use (327 MiB of a 16 GiB cgroup); without the guard a burst past the
/// margin is an OOM kill, so there it stays a 50th.
const GUARDED_MARGIN_CAP: u64 = 64 << 20;

/// [`base_margin`], capped at [`GUARDED_MARGIN_CAP`] under the OOM guard.
pub(crate) fn kept_margin(engine: &Engine, cgroup: &CgroupRoom, configured: u64, guarded: bool) -> u64 {
    let base = base_margin(engine, cgroup, configured);
    if guarded {
        base.min(GUARDED_MARGIN_CAP)
    } else {
        base
    }
}

/// Budgets (4 KiB pages) below which tiermem's fixed memory shrinks with the budget: 16 MiB.
pub(crate) const SMALL_BUDGET_PAGES: u64 = 4096;

/// `bytes`, or a 16th of `room` if that is less: what a fixed margin may take of a small room.
pub(crate) fn small_share(room: u64, bytes: u64) -> u64 {
    bytes.min(room / 16)
}

/// The memory the cgroup leaves the program: its limit, or for a device that keeps evicted
/// pages in this process's memory the configured limit (see [`fit_budget_to_cgroup`]).
pub(crate) fn local_room(engine: &Engine, cgroup: &CgroupRoom, configured: u64) -> u64 {
    match engine.device_memory_held() {
        Some(held) => cgroup.limit.saturating_sub(held).min(configured),
        None => cgroup.limit,
    }
}

/// Follow the cgroup: fit the budget every 20 ms, and at once when the cgroup runs out of
/// memory (the OOM guard's event, or a page copy the kernel refused for want of memory).
///
/// Unmanaged memory can grow faster than one look in 20 ms can follow: 4 MiB filled in a few
/// milliseconds next to a full budget under a 48 MiB limit was enough for the OOM killer. With
/// the guard the kernel pauses the program instead. The guard's ballast, held as the margin, is
/// released at once, and the next look fits the budget to what grew. If the cgroup runs out
/// again before the ballast is back, or cannot be read meanwhile, the budget is cut to a step
/// (a 16th of the room, at least 2 MiB or an 8th of a smaller room) below what is resident, without reading anything
/// (reading cgroup files needs memory the cgroup does not have), and that step stays as extra margin, shrinking
/// by a 256th per look (about half in 3.5 s), so a program that bursts again finds the room
/// free. If the budget is already at its floor, tiermem has nothing left to give: the guard
/// turns the killer back on.
pub(crate) fn watch_cgroup(engine: &'static Engine, cgroup: CgroupRoom, mut guard: Option<OomGuard>) {
    if let Some(dir) = &cgroup.v1_dir {
        // Its reads of the cgroup's files are charged to the parent: in a full cgroup they
        // waited in the kernel's reclaim throttling while the watch was the thread meant to
        // make room (docs/running-programs.md).
        let moved = tiermem_sys::cgroup::move_thread_to_parent_v1(dir);
        // Said only with the guard, which needs root anyway: a user who may not move threads
        // need not hear about it on every run.
        if let (Err(why), Some(_)) = (moved, &guard) {
            say(&["tiermem: the cgroup watch stays in the limited cgroup (", &why, ")"]);
        }
    }
    let configured = engine.config().limit_bytes;
    let mut extra_margin = 0u64;
    // Looks since the cgroup was last out of memory.
    let mut calm_looks = 0u32;
    let mut memory_waits = engine.memory_waits();
    // Since when the cgroup has been out of memory without a break, while the guard holds.
    let mut out_since: Option<std::time::Instant> = None;
    let mut file_room = FileRoom::default();
    loop {
        let look = if out_since.is_some() { Duration::from_millis(5) } else { Duration::from_millis(20) };
        let out_of_memory = match &guard {
            Some(g) => g.wait(look),
            None => {
                std::thread::sleep(look);
                false
            }
        };
        if let (Some(since), Some(g)) = (out_since, &guard) {
            // The program's tasks are still waiting for memory: if the engine's own threads
            // wait too (they can need a new page as well), nothing will free any; after two
            // seconds give up the guard rather than hang. Not readable (no memory even for
            // that) counts as still out.
            if g.under_oom().unwrap_or(true) {
                if since.elapsed() > Duration::from_secs(2) {
                    if let Some(g) = guard.take() {
                        // The killer first: describing the threads allocates, and a first
                        // touch of a fresh page here waited with everyone else for the 10 s
                        // until `tiermem run` killed the program (2026-12-07).
                        g.disarm();
                        say(&[
                            "tiermem: the cgroup stayed out of memory for 2 s: OOM killer back on; the threads were in",
                        ]);
                        say_where_threads_wait();
                    }
                    out_since = None;
                }
            } else {
                out_since = None;
            }
        }
        let waits = engine.memory_waits();
        if out_of_memory || waits != memory_waits {
            memory_waits = waits;
            calm_looks = 0;
            if let Some(g) = &mut guard {
                out_since.get_or_insert_with(std::time::Instant::now);
                // Room at once, for whoever needs a page first: the program, or one of the
                // engine's threads, which must not wait for memory while it is the one to free
                // some (seen: reclaim stuck on a first touch of its own data).
                if g.ballast_held() {
                    // The ballast is the margin, held for this moment: released, it is the
                    // room, and the next look fits the budget to what grew. Only running out
                    // again before it is back cuts the budget. (A cut at the first event took
                    // a step of a 16th of the room, at least 2 MiB, for seconds: quick
                    // quicksort at 20% on the file device ran on 11.0 MiB instead of 12–13.)
                    g.release_ballast();
                    BALLAST_RELEASES.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
            }
            cut_budget_a_step(engine, &cgroup, configured, &mut guard, &mut extra_margin);
            continue;
        }
        extra_margin -= extra_margin / 256;
        calm_looks = calm_looks.saturating_add(1);
        // The ballast is the margin, held rather than left free; taken back after a calm second
        // (a refused attempt, for want of room, is tried again later).
        let ballast_held = guard.as_mut().is_some_and(|g| {
            if calm_looks >= 50 {
                g.restore_ballast();
            }
            g.ballast_held()
        });
        let margin = if ballast_held { 0 } else { kept_margin(engine, &cgroup, configured, guard.is_some()) };
        if let Some(look) = cgroup.look() {
            let catching_up = engine.resident_pages() > engine.limit_pages();
            let cap = local_room(engine, &cgroup, configured) / 2;
            let counts = FileCounts { refaults: look.file_refaults, major_faults: look.major_faults };
            let files = file_room.update(counts, look.droppable, cap, catching_up);
            fit_budget_to_look(engine, &cgroup, configured, margin + extra_margin + files, look);
        } else if out_since.is_some() {
            // The cgroup could not be read while it is out of memory (reading it needs memory
            // too): the ballast's room is gone already, so cut as for a second event.
            cut_budget_a_step(engine, &cgroup, configured, &mut guard, &mut extra_margin);
        }
    }
}

/// Say where each thread of this process is: its kernel stack's innermost frames (readable by
/// root), else the kernel function it sleeps in. Said when the OOM guard gives up, it names
/// what kept the engine from making room (a thread waiting for memory itself, and where).
fn say_where_threads_wait() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for task in tasks.flatten() {
        let read = |name: &str| std::fs::read_to_string(task.path().join(name)).unwrap_or_default();
        let stack = read("stack");
        // Lines like "[<0>] reclaim_throttle+0x1a3/0x2e0": the function's name only.
        let frames: Vec<&str> =
            stack.lines().filter_map(|l| l.split_whitespace().nth(1)?.split('+').next()).take(8).collect();
        let place = if frames.is_empty() { read("wchan") } else { frames.join(" < ") };
        say(&["tiermem:   ", read("comm").trim(), ": ", &place]);
    }
}

/// Cut the budget to a step (a 16th of the room, at least 2 MiB or an 8th) below what is resident,
/// without reading anything, and keep the step as extra margin (see [`watch_cgroup`]); with the
/// budget at its floor, turn the guard's OOM killer back on instead.
fn cut_budget_a_step(
    engine: &Engine,
    cgroup: &CgroupRoom,
    configured: u64,
    guard: &mut Option<OomGuard>,
    extra_margin: &mut u64,
) {
    let room = local_room(engine, cgroup, configured);
    let step = (room / 16).max((2 << 20).min(room / 8));
    let page = tiermem_sys::PAGE_SIZE as u64;
    let (limit, resident) = (engine.limit_pages() * page, engine.resident_pages() * page);
    if resident > limit {
        // Reclaim is still getting down to the last cut: wait for it, cut no further.
    } else if limit <= 16 * page {
        if let Some(g) = guard.take() {
            g.disarm();
            say(&["tiermem: the cgroup is out of memory and the budget is at its floor: OOM killer back on"]);
        }
    } else {
        OOM_RESCUES.fetch_add(1, Ordering::Relaxed);
        let budget = engine.set_limit_bytes(resident.saturating_sub(step));
        LOWEST_BUDGET.fetch_min(budget, Ordering::Relaxed);
        *extra_margin = (*extra_margin + step).min(room / 4);
    }
}

/// The cgroup v1 OOM killer turned off for the program's run, and an eventfd the kernel signals
/// when the cgroup runs out of memory: its tasks then wait in their page faults until memory is
/// uncharged (here, by the engine evicting) instead of one being killed.
#[derive(Debug)]
pub(crate) struct OomGuard {
    event: Guarded<rustix::fd::OwnedFd>,
    /// Memory held for the moment the cgroup runs out: released at once then (see
    /// [`watch_cgroup`]), taken back when there is room again.
    ballast: tiermem_sys::mem::Mapping,
    ballast_held: bool,
    /// `memory.oom_control`, open for reading and writing for as long as the registration
    /// lasts: read and written through this descriptor, whose read buffer the kernel allocated
    /// at the first read, so neither needs memory the cgroup no longer has.
    control: Guarded<std::fs::File>,
}

impl OomGuard {
    pub(crate) fn arm(cgroup: &CgroupRoom, ballast_bytes: u64) -> Result<Self, String> {
        use rustix::fd::AsRawFd;
        let dir = cgroup.v1_dir.as_ref().ok_or("the memory cgroup is not v1: no memory.oom_control")?;
        let control_path = dir.join("memory.oom_control");
        let control = std::fs::File::options()
            .read(true)
            .write(true)
            .open(&control_path)
            .map(Guarded::new)
            .map_err(|e| format!("cannot open {}: {e}", control_path.display()))?;
        let event =
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)
                .map(Guarded::new)
                .map_err(|e| format!("eventfd: {e}"))?;
        let register = dir.join("cgroup.event_control");
        std::fs::write(&register, format!("{} {}", event.as_raw_fd(), control.as_raw_fd()))
            .map_err(|e| format!("cannot register for OOM events in {}: {e}", register.display()))?;
        let len = usize::try_from(ballast_bytes).unwrap_or(1 << 20).next_multiple_of(tiermem_sys::PAGE_SIZE);
        let ballast = tiermem_sys::mem::Mapping::anonymous(len, false).map_err(|e| format!("ballast: {e}"))?;
        BALLAST_BYTES.store(len as u64, Ordering::Relaxed);
        let mut guard = Self { event, control, ballast, ballast_held: false };
        guard
            .set_killer(false)
            .map_err(|e| format!("cannot turn the OOM killer off in {}: {e}", control_path.display()))?;
        guard.under_oom().ok_or_else(|| format!("cannot read {}", control_path.display()))?;
        pin_own_code();
        guard.restore_ballast();
        Ok(guard)
    }

    fn ballast_held(&self) -> bool {
        self.ballast_held
    }

    /// Give the ballast's memory back to the cgroup.
    fn release_ballast(&mut self) {
        if self.ballast_held {
            // SAFETY: the ballast is our own mapping; its contents mean nothing.
            let _ = unsafe { tiermem_sys::mem::discard(self.ballast.as_ptr(), self.ballast.len()) };
            self.ballast_held = false;
        }
    }

    /// Take the ballast's memory again if the cgroup has room. A system call, not a touch: with
    /// the killer off a touch would wait for memory, while the call fails (ENOMEM).
    fn restore_ballast(&mut self) {
        if !self.ballast_held {
            // SAFETY: populating our own mapping changes no contents.
            let populated = unsafe {
                rustix::mm::madvise(
                    self.ballast.as_ptr().cast(),
                    self.ballast.len(),
                    rustix::mm::Advice::LinuxPopulateWrite,
                )
            };
            self.ballast_held = populated.is_ok();
        }
    }

    fn set_killer(&self, on: bool) -> std::io::Result<()> {
        use std::io::Write;
        (&*self.control).write_all(if on { b"0" } else { b"1" })
    }

    /// Whether a task of the cgroup waits for memory now (None: cannot tell).
    fn under_oom(&self) -> Option<bool> {
        tiermem_sys::cgroup::read_oom_control(&self.control).map(|c| c.under_oom)
    }

    /// Wait up to `timeout` for the cgroup to run out of memory; true if it did.
    fn wait(&self, timeout: Duration) -> bool {
        let mut fds = [rustix::event::PollFd::new(&self.event, rustix::event::PollFlags::IN)];
        let timeout = rustix::event::Timespec::try_from(timeout).ok();
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(n) if n > 0 => {
                let mut count = [0u8; 8];
                // Non-blocking: clears the count the kernel added (one per event).
                let _ = rustix::io::read(&self.event, &mut count);
                true
            }
            _ => false,
        }
    }

    /// Turn the killer back on: tiermem cannot make more room.
    fn disarm(self) {
        let _ = self.set_killer(true);
    }
}

/// Lock the code and data of this library and of the C library in memory. Under the OOM guard
/// the watch must run while the cgroup has no memory left; the kernel reclaims file pages to
/// make room, and a page of our own code read back in then would wait for memory like the
/// program does (seen: the watch stuck in a fault on its own code). About 3 MiB, charged once.
fn pin_own_code() {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
    let here = pin_own_code as *const () as usize;
    let own_path = maps.lines().find_map(|line| {
        let (range, rest) = line.split_once(' ')?;
        let (start, end) = range.split_once('-')?;
        let (start, end) = (usize::from_str_radix(start, 16).ok()?, usize::from_str_radix(end, 16).ok()?);
        (start <= here && here < end).then(|| rest.rsplit(' ').next().unwrap_or("").to_string())
    });
    for line in maps.lines() {
        let Some(path) = line.rsplit(' ').next().filter(|p| p.starts_with('/')) else { continue };
        let libc = std::path::Path::new(path).file_name().is_some_and(|n| n.to_string_lossy().starts_with("libc.so"));
        if !(libc || own_path.as_deref() == Some(path)) {
            continue;
        }
        let Some((start, end)) = line.split_once(' ').and_then(|(r, _)| r.split_once('-')) else { continue };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16)) else { continue };
        // SAFETY: locking pages of a mapping this process has; mlock changes no contents.
        let rc = unsafe { libc::mlock(start as *const libc::c_void, end - start) };
        if rc != 0 {
            say(&["tiermem: cannot lock ", path, " in memory: ", &std::io::Error::last_os_error().to_string()]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CgroupLook, FileCounts, FileRoom, READ_AROUND_PAGES};

    const PAGE: u64 = tiermem_sys::PAGE_SIZE as u64;

    /// Counts where every refault came with a major fault of its own (code read back page by page).
    fn faults(refaults: u64) -> FileCounts {
        FileCounts { refaults: Some(refaults), major_faults: Some(refaults) }
    }

    #[test]
    fn file_room_grows_by_a_page_a_refault_up_to_its_cap_and_shrinks_when_calm() {
        // A page cache larger than any room here: only the decay and the cap act.
        let full = 1 << 40;
        let mut room = FileRoom::default();
        assert_eq!(room.update(faults(500), full, 1 << 30, false), 0, "the first look only learns the count");
        assert_eq!(room.update(faults(600), full, 1 << 30, false), 100 * PAGE);
        assert_eq!(room.update(faults(600), full, 1 << 30, true), 100 * PAGE, "catching up: kept as it is");
        assert_eq!(
            room.update(faults(700), full, 1 << 30, true),
            100 * PAGE,
            "refaults while catching up do not count"
        );
        assert_eq!(
            room.update(faults(700), full, 1 << 30, false),
            100 * PAGE - 100 * PAGE / 1024,
            "a calm look gives some back"
        );
        assert_eq!(room.update(faults(1_000_000), full, 64 * PAGE, false), 64 * PAGE, "never more than the cap");
        let mut calm = 64 * PAGE;
        for _ in 0..1024 * 14 / 10 {
            calm = room.update(faults(1_000_000), full, 64 * PAGE, false);
        }
        assert!(calm < 64 * PAGE / 3 && calm > 64 * PAGE / 8, "about halved every 14 s of 20 ms looks: {calm}");
        assert_eq!(
            FileRoom::default().update(FileCounts::default(), full, 1 << 30, false),
            0,
            "a kernel that counts no refaults"
        );
    }

    #[test]
    fn file_room_the_page_cache_leaves_empty_goes_back_at_the_first_calm_look() {
        let mut room = FileRoom::default();
        room.update(faults(0), 0, 1 << 30, false);
        // A burst of refaults while the program starts, with little in the cache at that look:
        // refaults count in full, whatever the cache holds.
        assert_eq!(room.update(faults(3000), 10 * PAGE, 1 << 30, false), 3000 * PAGE);
        // Calm, and the cache holds 600 pages: the rest of the room protects nothing.
        assert_eq!(room.update(faults(3000), 600 * PAGE, 1 << 30, false), 600 * PAGE);
        // The cache shrinks further without refaults (the kernel dropped pages nobody used).
        assert_eq!(room.update(faults(3000), 200 * PAGE, 1 << 30, false), 200 * PAGE);
        // The program needs some back: they return as refaults and win their room again.
        assert_eq!(room.update(faults(3050), 200 * PAGE, 1 << 30, false), 250 * PAGE);
        // A cache that grows does not grow the room: only refaults do.
        let grown = room.update(faults(3050), 4000 * PAGE, 1 << 30, false);
        assert_eq!(grown, 250 * PAGE - 250 * PAGE / 1024);
        // Catching up keeps the room as it is, even above the cache.
        assert_eq!(room.update(faults(3050), 0, 1 << 30, true), grown);
    }

    #[test]
    fn file_room_grows_by_a_page_a_major_fault_and_a_page_a_read_around_of_other_refaults() {
        let full = 1 << 40;
        let counts = |refaults, major_faults| FileCounts { refaults: Some(refaults), major_faults: Some(major_faults) };
        let mut room = FileRoom::default();
        assert_eq!(room.update(counts(0, 0), full, 1 << 30, false), 0);
        // 3,200 refaults and no major fault: a program reading its input file again.
        assert_eq!(room.update(counts(3200, 0), full, 1 << 30, false), 3200 / READ_AROUND_PAGES * PAGE);
        // 10 major faults that read 340 refaulted pages around them: 10, and 330 by the dozen
        // (10 pages, 10 carried over).
        assert_eq!(room.update(counts(3540, 10), full, 1 << 30, false), 120 * PAGE);
        // The carried 10 and 22 more make another page.
        assert_eq!(room.update(counts(3562, 10), full, 1 << 30, false), 121 * PAGE);
        // Major faults that were not refaults (code read for the first time) count for nothing.
        assert_eq!(room.update(counts(3567, 30), full, 1 << 30, false), 126 * PAGE);
        // A few batched refaults that make no page yet: a calm look, the room decays.
        assert_eq!(room.update(counts(3570, 30), full, 1 << 30, false), 126 * PAGE - 126 * PAGE / 1024);
        // A kernel without a count of major faults: every refault counts as a read.
        let mut room = FileRoom::default();
        room.update(FileCounts { refaults: Some(0), major_faults: None }, full, 1 << 30, false);
        assert_eq!(
            room.update(FileCounts { refaults: Some(500), major_faults: None }, full, 1 << 30, false),
            500 * PAGE
        );
    }

    use super::{V1_KEYS, V2_KEYS};

    #[test]
    fn a_look_counts_shared_memory_as_charged_and_the_rest_of_the_page_cache_as_droppable() {
        // v1, abridged from a real memory.stat: the cgroup's own fields first, the hierarchical
        // `total_` ones the look reads after them; 30 MiB of page cache of which 16 MiB shmem.
        let v1 = "cache 1\nrss 2\nshmem 3\nmapped_file 4\nworkingset_refault_file 5\n\
                  total_cache 31457280\ntotal_rss 8388608\ntotal_shmem 16777216\n\
                  total_mapped_file 2097152\ntotal_workingset_refault_file 77\npgmajfault 6\n\
                  total_pgmajfault 12\n";
        let look = CgroupLook::from_stat(40 << 20, v1, &V1_KEYS).unwrap();
        assert_eq!(
            look,
            CgroupLook { charged: 26 << 20, droppable: 14 << 20, file_refaults: Some(77), major_faults: Some(12) },
            "40 MiB used, 14 MiB droppable"
        );
        // v2: `file` is the page cache (shmem in it); `file_mapped` and the like must not be
        // taken for it.
        let v2 = "anon 8388608\nfile_mapped 2097152\nfile 31457280\nfile_dirty 0\nshmem 16777216\n\
                  workingset_refault_file 9\npgmajfault 3\n";
        let look = CgroupLook::from_stat(40 << 20, v2, &V2_KEYS).unwrap();
        assert_eq!(
            look,
            CgroupLook { charged: 26 << 20, droppable: 14 << 20, file_refaults: Some(9), major_faults: Some(3) }
        );
        // A kernel without a shmem count: all of the page cache is droppable, as before.
        let look = CgroupLook::from_stat(40 << 20, "total_cache 31457280\n", &V1_KEYS).unwrap();
        assert_eq!(
            look,
            CgroupLook { charged: 10 << 20, droppable: 30 << 20, file_refaults: None, major_faults: None }
        );
        assert_eq!(CgroupLook::from_stat(40 << 20, "total_rss 5\n", &V1_KEYS), None, "no page cache count, no look");
        // Counts that disagree for a moment (read one after the other) never underflow.
        let look = CgroupLook::from_stat(1 << 20, "total_cache 4194304\ntotal_shmem 8388608\n", &V1_KEYS).unwrap();
        assert_eq!(look.charged, 1 << 20);
    }

    #[test]
    fn locked_pages_are_charged_not_droppable() {
        // The stuck state of a 6.2 MiB cgroup, from its memory.stat: 1.5 MiB of the page cache
        // was the code the shim locks, 64 KiB droppable; the cgroup's own `unevictable` line
        // (a smaller number here) must not be taken for the hierarchical one.
        let v1 = "cache 1576960\nunevictable 4096\ntotal_cache 1576960\ntotal_rss 4182016\n\
                  total_unevictable 1511424\n";
        let look = CgroupLook::from_stat(6_496_256, v1, &V1_KEYS).unwrap();
        assert_eq!((look.charged, look.droppable), (6_496_256 - 65_536, 65_536));
        let v2 = "anon 4182016\nfile 1576960\nshmem 0\nunevictable 1511424\n";
        let look = CgroupLook::from_stat(6_496_256, v2, &V2_KEYS).unwrap();
        assert_eq!((look.charged, look.droppable), (6_496_256 - 65_536, 65_536));
        // Locked and shared counted together never take more than the page cache.
        let look = CgroupLook::from_stat(
            8 << 20,
            "total_cache 1048576\ntotal_shmem 1048576\ntotal_unevictable 4194304\n",
            &V1_KEYS,
        )
        .unwrap();
        assert_eq!((look.charged, look.droppable), (8 << 20, 0));
    }
}
