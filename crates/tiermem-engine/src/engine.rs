//! The engine: owns the userfaultfd, the device queues, the regions, the policies and the
//! background threads, and hands out [`Region`]s.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::thread::JoinHandle;

use rustix::event::{eventfd, EventfdFlags};
use std::os::fd::OwnedFd;
use tiermem_device::{BufferArena, Device, SlotAllocator};
use tiermem_sys::guarded_fd::Guarded;
use tiermem_sys::mem::Mapping;
use tiermem_sys::probe::KernelFeatures;
use tiermem_sys::uffd::{Features, RegisterMode, Uffd};
use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

use crate::config::{DirtyTracking, EngineConfig, FaultMode, ReclaimMode};
use crate::io::Queues;
use crate::page::{Kind, PageState};
use crate::policy::{build_policies, PolicyOptions, Prefetcher, Replacement};
use crate::region::{RegionInner, RegionTable};
use crate::stats::{Stats, StatsSnapshot};

/// An event descriptor a thread sleeps on (a counter, so no wake-up is lost), guarded from the
/// program's closes (see [`tiermem_sys::guarded_fd`]).
pub(crate) type WakeFd = Guarded<OwnedFd>;

pub(crate) fn wake_eventfd() -> Result<WakeFd> {
    let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK).map_err(|e| Error::os(e.into(), "eventfd"))?;
    Ok(Guarded::new(fd))
}

/// Milliseconds of the monotonic clock (a vDSO call: usable in the SIGBUS handler).
pub(crate) fn monotonic_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1000) + t.tv_nsec as u64 / 1_000_000
}

/// State shared by the engine's threads and the fault handlers.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: EngineConfig,
    pub(crate) device: Arc<dyn Device>,
    pub(crate) arena: Arc<BufferArena>,
    pub(crate) slots: SlotAllocator,
    pub(crate) uffd: Uffd,
    /// Sigbus fault mode only: a second userfaultfd, without SIGBUS delivery, for regions the
    /// kernel itself may fault on (see [`Engine::create_kernel_region`]), served by a handler
    /// thread; with its own staging areas under async WP (UFFDIO_MOVE moves into memory
    /// registered on the userfaultfd it is issued on).
    pub(crate) threaded: Option<(Uffd, Option<crate::capture::Capture>)>,
    pub(crate) regions: RwLock<RegionTable>,
    pub(crate) prefetcher: Box<dyn Prefetcher>,
    pub(crate) replacement: Box<dyn Replacement>,
    pub(crate) stats: Stats,
    pub(crate) queues: Queues,
    /// Resident managed pages, counted before they are mapped and after they are dropped, so
    /// the kernel's count never exceeds it.
    pub(crate) resident: AtomicU64,
    /// The budget in pages now: the configured limit, or less while the cgroup leaves less room
    /// (see [`Engine::set_limit_bytes`]).
    limit_pages: AtomicU64,
    /// Residency that wakes the reclaim thread, derived from the current limit.
    watermark_pages: AtomicU64,
    /// Residency from which the reclaim thread drops pages, derived from the current limit.
    evict_pages: AtomicU64,
    /// Pages taken from the replacement policy and written back ahead of need, still resident:
    /// the first dropped when room is needed (see [`crate::reclaim`]). Pages here are not in
    /// the policy; ids may be stale (the page left meanwhile), which eviction checks anyway.
    pub(crate) cleaned: std::sync::Mutex<std::collections::VecDeque<crate::policy::PageId>>,
    /// Length of `cleaned`, readable without its lock.
    pub(crate) cleaned_pages: AtomicU64,
    /// Resident pages the program advised cold, newest first: evicted before the cleaned list
    /// and the policy's choices. Hints only: each page keeps its policy entry, so the list may
    /// lose its oldest entries (it holds at most the budget's pages; advising the same pages
    /// over and over grew it without bound) and a page touched since is simply passed over.
    pub(crate) cold: std::sync::Mutex<std::collections::VecDeque<crate::policy::PageId>>,
    /// Length of `cold`, readable without its lock.
    pub(crate) cold_pages: AtomicU64,
    /// The reclaim thread is about to sleep or sleeping: the next thread that finds work for it
    /// writes `reclaim_wake` (others need not, which saves a system call per fault).
    pub(crate) reclaim_asleep: AtomicBool,
    /// The last cleaning round found nothing to clean: faults stop waking the reclaim thread
    /// for cleaning until its next timed wake-up.
    pub(crate) clean_stalled: AtomicBool,
    /// When the device's file system last refused a slot (see `reclaim::take_slots`), in
    /// milliseconds of the monotonic clock; 0 once a slot past what it held was granted. For a
    /// while after, pages that would need a new slot are not taken as victims, and a fault
    /// finding no room is let in over the budget rather than wait for room that will not come.
    pub(crate) device_refused_at_ms: AtomicU64,
    /// When the last extension of the device was refused memory (ENOMEM: a full cgroup whose
    /// OOM killer is off refuses the file system the little an extension needs), in the same
    /// clock; 0 once one went through. Unlike a full file system this passes as soon as
    /// reclaim or the OOM guard's ballast makes room, so it holds victims back only briefly
    /// ([`DEVICE_MEMORY_RETRY_MS`]) and never lets a fault in over the budget.
    pub(crate) device_memory_refused_at_ms: AtomicU64,
    /// Prefetch reads queued and not yet processed, in pages: they will land in the budget's
    /// room, so the room left for more is the background room less these.
    pub(crate) prefetches_in_flight: AtomicU64,
    /// That refusal was said on stderr (once per engine).
    pub(crate) said_no_device_room: AtomicBool,
    /// Pages come in write-protected (for sync or async WP).
    pub(crate) write_protect: bool,
    /// Async WP: writes never fault; eviction takes pages out with UFFDIO_MOVE.
    pub(crate) capture: Option<crate::capture::Capture>,
    /// Touch each new region's page table when it is made (see
    /// [`Engine::keep_metadata_resident`]).
    pub(crate) prefault_metadata: AtomicBool,
    /// This process's pagemap, to tell a page dropped behind the engine's back from a racing
    /// fault (see [`crate::fault::handle_fault`]); none where it cannot be opened.
    pub(crate) pagemap: Option<tiermem_sys::pagemap::Pagemap>,
    /// Held (read) while reclaim takes out pages the program made read-only or inaccessible,
    /// which UFFDIO_MOVE refuses, by copying them; a protection change takes it (write) through
    /// [`Engine::protection_change`], so none can become writable between copy and drop.
    pub(crate) protection: std::sync::RwLock<()>,
    /// Every protection change of managed memory goes through [`Engine::protection_change`]
    /// (the preload's mprotect does): only then are such pages taken out.
    pub(crate) protection_guarded: AtomicBool,
    /// /proc/self/mem, to read pages the program made inaccessible.
    pub(crate) self_mem: Option<tiermem_sys::guarded_fd::Guarded<std::fs::File>>,
    /// Zeros to copy into untouched pages (enough for one zero-fill-around).
    pub(crate) zero_page: Mapping,
    /// Written to wake the reclaim thread (an eventfd: safe to write from a signal handler).
    pub(crate) reclaim_wake: WakeFd,
    /// Written at shutdown to wake handler threads sleeping in poll.
    pub(crate) stop_event: WakeFd,
    pub(crate) shutdown: AtomicBool,
    /// Slots reserved by live regions' pages, to refuse regions the device cannot hold.
    pub(crate) reserved_pages: AtomicU64,
    /// When (monotonic ms) the current spell of faults refused their pages by the full cgroup
    /// began, and the last refusal (0: none yet; see `fault::map_in_fault`).
    pub(crate) memory_refused_since_ms: AtomicU64,
    pub(crate) memory_refused_last_ms: AtomicU64,
    /// Ranges held resident for system calls; reclaim skips them.
    pub(crate) pins: std::sync::Mutex<Vec<(usize, usize)>>,
    /// Where faults are recorded, if asked ([`EngineConfig::trace_path`]).
    pub(crate) trace: Option<crate::trace_sink::TraceSink>,
    /// Which prefetched pages wait for a fault, to measure accuracy (see `prefetch_sample`).
    pub(crate) prefetch_sampler: crate::prefetch_sample::PrefetchSampler,
    /// The cap on pages per prefetcher call, from the samples (see `prefetch_governor`).
    pub(crate) prefetch_governor: crate::prefetch_governor::PrefetchGovernor,
    /// Evicted pages kept in DRAM a while (see [`crate::victim`]).
    pub(crate) victims: crate::victim::VictimTier,
    /// Reports from sources off the fault path, for the monitor thread (see [`crate::monitor`]).
    pub(crate) monitor: crate::monitor::LiveMonitor,
    /// Indirect prefetching's learned instructions, if it is on (see [`crate::indirect`]).
    pub(crate) indirect: Option<crate::indirect::Indirect>,
    /// DAMON's events while the DAMON source runs (see [`crate::damon`]); taken to stop it.
    pub(crate) damon: std::sync::Mutex<Option<tiermem_monitor::damon::DamonEvents>>,
    /// Set to stop the DAMON source: its thread stops taking `damon` once it sees it.
    pub(crate) damon_stop: AtomicBool,
    /// The descriptor of the DAMON source's pipe (-1: none), for a forked child to close.
    pub(crate) damon_fd: std::sync::atomic::AtomicI32,
}

impl Shared {
    /// Drop the DAMON source's events (its instance goes), held under `damon`'s lock. Its pipe's
    /// descriptor is forgotten first: a later fork's child would otherwise close whatever
    /// reuses that number.
    /// (A fork between the two leaves the child holding the pipe: the instance then goes with
    /// a sweep after the child ends, never a wrong descriptor.)
    pub(crate) fn drop_damon(&self, events: &mut Option<tiermem_monitor::damon::DamonEvents>) {
        self.damon_fd.store(-1, Ordering::Release);
        drop(events.take());
    }

    /// The userfaultfd `region` is registered on.
    pub(crate) fn uffd_of(&self, region: &RegionInner) -> &Uffd {
        self.uffd_for(region.threaded)
    }

    /// The userfaultfd for a region served by the handler thread of sigbus mode (`threaded`),
    /// or for any other.
    fn uffd_for(&self, threaded: bool) -> &Uffd {
        match &self.threaded {
            Some((uffd, _)) if threaded => uffd,
            _ => &self.uffd,
        }
    }

    /// The staging areas for evicting pages of `region` under async WP.
    pub(crate) fn capture_of(&self, region: &RegionInner) -> Option<&crate::capture::Capture> {
        match &self.threaded {
            Some((_, capture)) if region.threaded => capture.as_ref(),
            _ => self.capture.as_ref(),
        }
    }

    /// Put `ids` (resident pages advised cold) at the front of the cold list, in order, and
    /// drop the oldest entries past the budget's size.
    pub(crate) fn push_cold(&self, ids: &[crate::policy::PageId]) {
        let mut cold = self.cold.lock().unwrap_or_else(|e| e.into_inner());
        ids.iter().rev().for_each(|&id| cold.push_front(id));
        cold.truncate(self.limit_pages().max(1) as usize);
        self.cold_pages.store(cold.len() as u64, Ordering::Relaxed);
        drop(cold);
        Stats::add(&self.stats.counters.cold_listed, ids.len() as u64);
    }

    /// Whether regions keep a hash of what each page's slot holds: async WP judges a moved page
    /// by it, and sync WP with write fault-around the neighbours it made writable.
    fn keeps_slot_hashes(&self) -> bool {
        self.capture.is_some() || (self.write_protect && self.config.write_fault_around > 1)
    }

    pub(crate) fn regions(&self) -> RwLockReadGuard<'_, RegionTable> {
        self.regions.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn limit_pages(&self) -> u64 {
        self.limit_pages.load(Ordering::Relaxed)
    }

    pub(crate) fn watermark_pages(&self) -> u64 {
        self.watermark_pages.load(Ordering::Relaxed)
    }

    pub(crate) fn evict_pages(&self) -> u64 {
        self.evict_pages.load(Ordering::Relaxed)
    }

    /// Pages the reclaim thread should have cleaned ahead at residency `resident`: everything
    /// above the watermark.
    pub(crate) fn clean_target(&self, resident: u64) -> u64 {
        resident.saturating_sub(self.watermark_pages())
    }

    /// Where the reclaim thread starts dropping pages: the evict watermark in background mode.
    /// In on-fault-path mode the faulting threads do all the reclaim the design asks for, and
    /// the thread only drops what a cut of the budget (the OOM guard's, a shrinking cgroup's)
    /// left above the limit: the program may then be paused in the kernel, waiting for memory
    /// with no fault to reclaim on.
    pub(crate) fn drop_threshold(&self) -> u64 {
        match self.config.reclaim_mode {
            ReclaimMode::Background => self.evict_pages(),
            ReclaimMode::OnFaultPath => self.limit_pages(),
        }
    }

    /// Whether residency `resident` gives the reclaim thread work: dropping pages past the
    /// [drop threshold](Shared::drop_threshold), or (background mode) cleaning past the
    /// watermark while too few pages are cleaned.
    pub(crate) fn reclaim_wanted(&self, resident: u64) -> bool {
        resident > self.drop_threshold()
            || (self.config.reclaim_mode == ReclaimMode::Background
                && resident > self.watermark_pages()
                && !self.clean_stalled.load(Ordering::Relaxed)
                && self.cleaned_pages.load(Ordering::Relaxed) < self.clean_target(resident))
    }

    /// Set the limit and the two watermarks derived from it.
    fn set_limit_pages(&self, limit_pages: u64) {
        let (watermark, evict) = watermarks(&self.config, limit_pages);
        self.watermark_pages.store(watermark, Ordering::Relaxed);
        self.evict_pages.store(evict, Ordering::Relaxed);
        self.limit_pages.store(limit_pages, Ordering::Relaxed);
    }

    pub(crate) fn resident(&self) -> u64 {
        self.resident.load(Ordering::Acquire)
    }

    /// Whether the device's file system refused a slot within the last second (the device asks
    /// it again no sooner: see tiermem_device's `backing`).
    pub(crate) fn device_refusing(&self) -> bool {
        let at = self.device_refused_at_ms.load(Ordering::Relaxed);
        at != 0 && monotonic_ms().saturating_sub(at) < 1000
    }

    /// Whether a page needing a new slot past what the device holds would be refused now: its
    /// file system refused room within the last second, or memory within the last few
    /// milliseconds.
    pub(crate) fn device_cannot_extend(&self) -> bool {
        let at = self.device_memory_refused_at_ms.load(Ordering::Relaxed);
        self.device_refusing() || (at != 0 && monotonic_ms().saturating_sub(at) < DEVICE_MEMORY_RETRY_MS)
    }

    /// Note that the device refused to set storage aside, with `errno`.
    pub(crate) fn note_device_refusal(&self, errno: i32) {
        let clock = if errno == libc::ENOMEM { &self.device_memory_refused_at_ms } else { &self.device_refused_at_ms };
        clock.store(monotonic_ms().max(1), Ordering::Relaxed);
    }

    /// Note that the device set storage aside.
    pub(crate) fn note_device_room(&self) {
        for clock in [&self.device_refused_at_ms, &self.device_memory_refused_at_ms] {
            if clock.load(Ordering::Relaxed) != 0 {
                clock.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Claim room for one more resident page, for a faulting thread: if under the limit.
    pub(crate) fn try_reserve_resident(&self) -> bool {
        self.try_reserve_resident_under(self.limit_pages())
    }

    /// Claim room for a page nobody is waiting for yet (a prefetched page, zeros mapped around
    /// a fault): only below [`Shared::background_cap`].
    pub(crate) fn try_reserve_background(&self) -> bool {
        self.try_reserve_resident_under(self.background_cap())
    }

    /// Pages a background page-in may still claim now (see [`Shared::try_reserve_background`]).
    pub(crate) fn background_room(&self) -> u64 {
        self.background_cap().saturating_sub(self.resident())
    }

    /// Pages more prefetches may read now: the background room less the prefetches in flight,
    /// which land in it. Reading past it read pages only to drop them at their completion
    /// (a streaming sort at 20% dropped one prefetched page in seven, each read again later).
    pub(crate) fn prefetch_room(&self) -> u64 {
        self.background_room().saturating_sub(self.prefetches_in_flight.load(Ordering::Relaxed))
    }

    /// Residency up to which background page-ins may go: the limit less one reclaim batch, but
    /// never below the evict watermark. The batch is kept for faults, which otherwise find the
    /// budget full whenever prefetching has just filled it and evict on the faulting thread
    /// (tens of µs each) before the reclaim thread, woken past the evict watermark, catches up.
    fn background_cap(&self) -> u64 {
        let limit = self.limit_pages();
        limit.saturating_sub(self.config.reclaim_batch as u64).max(self.evict_pages().min(limit))
    }

    fn try_reserve_resident_under(&self, cap: u64) -> bool {
        let mut cur = self.resident.load(Ordering::Relaxed);
        loop {
            if cur >= cap {
                return false;
            }
            match self.resident.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.stats.observe_resident(cur + 1);
                    if self.config.reclaim_mode == ReclaimMode::Background && self.reclaim_wanted(cur + 1) {
                        self.wake_reclaim();
                    }
                    return true;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Give back room claimed by [`Shared::try_reserve_resident`] or freed by an eviction.
    pub(crate) fn release_resident(&self) {
        self.resident.fetch_sub(1, Ordering::AcqRel);
    }

    /// Lower the limit by `pages` (not below 16) and wake reclaim: room is needed now.
    pub(crate) fn shed(&self, pages: u64) {
        self.set_limit_pages(self.limit_pages().saturating_sub(pages.max(1)).max(16.min(self.config.limit_pages())));
        self.wake_reclaim();
    }

    /// A prefetch sample's wait ended, `used` by the program or not: counted, and judged by the
    /// prefetch governor.
    pub(crate) fn prefetch_sample_ended(&self, used: bool) {
        let counter =
            if used { &self.stats.counters.prefetch_sample_used } else { &self.stats.counters.prefetch_sample_unused };
        Stats::add(counter, 1);
        self.prefetch_governor.sample_ended(used);
    }

    /// Cut a prefetcher's list to what the prefetch governor allows now, counting the cut.
    pub(crate) fn govern_prefetches(&self, wanted: &mut crate::policy::PageList) {
        let cut = self.prefetch_governor.cut(wanted);
        Stats::add(&self.stats.counters.prefetch_cut, cut as u64);
    }

    /// Give back the buffer a prefetched page holds: a prefetch sample's, or a copy in the victim
    /// tier (which then counts the page out).
    pub(crate) fn release_prefetched(&self, state: crate::page::PageState) {
        self.arena.release(state.buf());
        if state.victim() {
            self.victims.left();
        }
    }

    /// Wake the reclaim thread if it sleeps. SeqCst pairs with the thread's own store of
    /// `reclaim_asleep` and re-check of residency, so a wake-up is never lost.
    pub(crate) fn wake_reclaim(&self) {
        if self.reclaim_asleep.swap(false, Ordering::SeqCst) {
            // An eventfd write never blocks here (the counter cannot overflow in practice).
            let _ = rustix::io::write(&self.reclaim_wake, &1u64.to_ne_bytes());
        }
    }
}

/// The lowest share of the limit [`EngineConfig::prefetch_room`] moves the drop threshold to.
const LOWEST_ROOM_THRESHOLD: f64 = 0.9;

/// The watermarks in pages for a limit: (wake-up and cleaning, dropping).
fn watermarks(config: &EngineConfig, limit_pages: u64) -> (u64, u64) {
    let at = |fraction: f64| ((limit_pages as f64 * fraction) as u64).clamp(1, limit_pages);
    let watermark = at(config.watermark);
    let mut evict = at(config.evict_watermark);
    // Without a prefetcher there is nothing to keep room for.
    if config.prefetch_room > 0 && config.prefetch != "none" {
        // The room costs a tenth of the budget at most: below that, cleaning ahead between the
        // watermark and the drop threshold would have too little room to work in.
        let room_below = (config.reclaim_batch as u64).saturating_add(u64::from(config.prefetch_room));
        evict = evict.min(limit_pages.saturating_sub(room_below).max(at(LOWEST_ROOM_THRESHOLD)));
    }
    (watermark, evict.max(watermark))
}

/// Register `[addr, addr + len)` with `uffd` for missing and write-protect faults, as base pages
/// only (huge pages would be faulted in by the kernel behind the engine's back).
///
/// # Safety
/// The range is a private anonymous mapping the engine owns (a region's, or a piece given back
/// to one).
pub(crate) unsafe fn register_base_pages(uffd: &Uffd, addr: *mut u8, len: usize) -> Result<()> {
    uffd.register(addr, len, RegisterMode { missing: true, write_protect: true })?;
    // SAFETY: the caller's contract: the range is the engine's.
    let _ = unsafe { rustix::mm::madvise(addr.cast(), len, rustix::mm::Advice::LinuxNoHugepage) };
    Ok(())
}

/// A running paging engine.
#[derive(Debug)]
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    features: KernelFeatures,
}

/// A managed region: anonymous memory whose pages the engine moves between DRAM and the device.
/// Dropping it waits for its in-flight I/O, frees its slots and unmaps it.
#[derive(Debug)]
pub struct Region {
    pub(crate) shared: Arc<Shared>,
    pub(crate) inner: Arc<RegionInner>,
}

impl Engine {
    /// Start an engine on `device` with `config`.
    pub fn new(config: EngineConfig, device: Arc<dyn Device>) -> Result<Self> {
        config.validate()?;
        // Opened first: without it the engine refuses to start rather than run without a
        // source the caller asked for.
        let damon_events = if config.damon {
            Some(
                tiermem_monitor::damon::DamonEvents::open()
                    .map_err(|e| e.context("the DAMON source (--damon; it needs root)"))?,
            )
        } else {
            None
        };
        let features = KernelFeatures::probe();
        if !features.userfaultfd {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("userfaultfd is not usable: {}", features.error.clone().unwrap_or_default()),
            ));
        }
        // Eviction write-protects a page before copying it out, whatever the dirty tracking, so
        // write protection itself is required; dirty tracking only decides how pages come in.
        if !features.wp {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "race-free eviction needs userfaultfd write-protect (Linux >= 5.7); kernel {} lacks it",
                    features.kernel
                ),
            ));
        }
        let can_sync = features.wp && features.copy_mode_wp;
        let can_async = can_sync && features.wp_async && features.pagemap_scan && features.move_pages;
        let (write_protect, async_wp) = match config.dirty_tracking {
            DirtyTracking::None => (false, false),
            DirtyTracking::Auto => (can_sync, can_async),
            DirtyTracking::SyncWriteProtect => {
                if !can_sync {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        "sync-wp dirty tracking needs userfaultfd WP and COPY_MODE_WP, which this kernel lacks",
                    ));
                }
                (true, false)
            }
            DirtyTracking::AsyncWriteProtect => {
                if !can_async {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!(
                            "async-wp dirty tracking needs userfaultfd WP_ASYNC and MOVE and PAGEMAP_SCAN \
                             (Linux >= 6.8); kernel {} lacks some: use sync-wp",
                            features.kernel
                        ),
                    ));
                }
                (true, true)
            }
        };
        let mut wanted = Features::THREAD_ID.with(Features::WP);
        if config.fault_mode == FaultMode::Sigbus {
            if !features.sigbus {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    "fault mode sigbus needs UFFD_FEATURE_SIGBUS, which this kernel lacks",
                ));
            }
            wanted = wanted.with(Features::SIGBUS);
        }
        if async_wp {
            wanted = wanted.with(Features::WP_ASYNC).with(Features::MOVE);
        }
        let uffd = Uffd::open(wanted, true)?;
        // An unprivileged process under vm.unprivileged_userfaultfd = 0 gets faults taken in user
        // mode only: a system call touching an evicted page then fails with EFAULT. Sigbus mode
        // already makes such memory resident first (`prepare_kernel_access`); handler-thread
        // mode promises that system calls just work, so it is refused rather than broken.
        let kernel_faults = uffd.handles_kernel_faults();
        if !kernel_faults && config.fault_mode == FaultMode::HandlerThread {
            return Err(Error::new(
                ErrorKind::Permission,
                "fault mode thread serves faults taken inside system calls, which this process may not \
                 handle (no CAP_SYS_PTRACE and vm.unprivileged_userfaultfd = 0): use fault mode sigbus, \
                 run as root, or set the sysctl vm.unprivileged_userfaultfd=1",
            ));
        }
        let capture = if async_wp { Some(crate::capture::Capture::new(&uffd, config.evict_pipe)?) } else { None };
        let threaded = if config.fault_mode == FaultMode::Sigbus && kernel_faults {
            let uffd = Uffd::open(Features(wanted.0 & !Features::SIGBUS.0), true)?;
            let capture = if async_wp { Some(crate::capture::Capture::new(&uffd, config.evict_pipe)?) } else { None };
            Some((uffd, capture))
        } else {
            None
        };
        let runs = if config.write_runs { WRITE_RUNS } else { 0 } + if config.read_runs { READ_RUNS } else { 0 };
        let arena = Arc::new(BufferArena::with_runs(config.io_buffers + config.victim_pages, runs)?);
        let queues = Queues::open(&config, &*device, &arena)?;
        let limit_pages = config.limit_pages();
        let (watermark_pages, evict_pages) = watermarks(&config, limit_pages);
        // Built together so stream and stream-first share one training table.
        let policies =
            build_policies(&config.prefetch, &config.replace, limit_pages as usize, &PolicyOptions::default())?;
        let trace = config.trace_path.as_deref().map(crate::trace_sink::TraceSink::create).transpose()?;
        let shared = Arc::new(Shared {
            trace,
            prefetcher: policies.prefetcher,
            replacement: policies.replacement,
            // A page's state word holds a 32-bit slot: of a device past 16 TiB, the first 16 TiB.
            slots: SlotAllocator::new(device.capacity_slots().min(crate::page::MAX_SLOT + 1)),
            device,
            arena,
            uffd,
            threaded,
            regions: RwLock::new(RegionTable::default()),
            stats: Stats::default(),
            queues,
            resident: AtomicU64::new(0),
            limit_pages: AtomicU64::new(limit_pages),
            watermark_pages: AtomicU64::new(watermark_pages),
            evict_pages: AtomicU64::new(evict_pages),
            cleaned: std::sync::Mutex::new(std::collections::VecDeque::new()),
            cleaned_pages: AtomicU64::new(0),
            cold: std::sync::Mutex::new(std::collections::VecDeque::new()),
            cold_pages: AtomicU64::new(0),
            reclaim_asleep: AtomicBool::new(true),
            clean_stalled: AtomicBool::new(false),
            device_refused_at_ms: AtomicU64::new(0),
            device_memory_refused_at_ms: AtomicU64::new(0),
            prefetches_in_flight: AtomicU64::new(0),
            said_no_device_room: AtomicBool::new(false),
            write_protect,
            capture,
            prefault_metadata: AtomicBool::new(false),
            pagemap: tiermem_sys::pagemap::Pagemap::open_self().ok(),
            protection: std::sync::RwLock::new(()),
            protection_guarded: AtomicBool::new(false),
            self_mem: std::fs::File::open("/proc/self/mem").ok().map(tiermem_sys::guarded_fd::Guarded::new),
            zero_page: Mapping::zeros(PAGE_SIZE * crate::fault::ZERO_FILL_AROUND)?,
            reclaim_wake: wake_eventfd()?,
            stop_event: wake_eventfd()?,
            shutdown: AtomicBool::new(false),
            reserved_pages: AtomicU64::new(0),
            memory_refused_since_ms: AtomicU64::new(0),
            memory_refused_last_ms: AtomicU64::new(0),
            pins: std::sync::Mutex::new(Vec::new()),
            prefetch_sampler: crate::prefetch_sample::PrefetchSampler::new(config.io_buffers as usize),
            prefetch_governor: crate::prefetch_governor::PrefetchGovernor::new(config.prefetch_governor),
            victims: crate::victim::VictimTier::new(config.victim_pages as usize),
            monitor: crate::monitor::LiveMonitor::new(config.hot_threshold)?,
            // Registers come with a SIGBUS only: in handler-thread mode there is nothing to learn from.
            indirect: (config.indirect && config.fault_mode == FaultMode::Sigbus).then(crate::indirect::Indirect::new),
            damon_fd: std::sync::atomic::AtomicI32::new(
                damon_events.as_ref().and_then(tiermem_monitor::damon::DamonEvents::pipe_fd).unwrap_or(-1),
            ),
            damon: std::sync::Mutex::new(damon_events),
            damon_stop: AtomicBool::new(false),
            config,
        });
        // Made before its threads: if one cannot start, or the SIGBUS handler cannot go in, the
        // engine's drop stops and joins those already running (left running, they kept the
        // whole engine alive for good, and every failed attempt added another set).
        let mut engine = Self { shared, threads: Vec::new(), features };
        let shared = engine.shared.clone();
        let threads = &mut engine.threads;
        // Each has started by the time the next is spawned: under the preload's OOM guard, armed
        // right after this, a thread start that comes later may find the cgroup full
        // (`tiermem_sys::threads`).
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            tiermem_sys::threads::spawn_running(name, None, f)
                .map_err(|e| Error::os(e, format!("spawning thread {name}")))
        };
        {
            let s = shared.clone();
            let fds = crate::io::completion_wait_fds(&shared);
            threads.push(spawn("tiermem-completion", Box::new(move || crate::io::completion_thread(&s, fds)))?);
        }
        if let Some(consumer) = shared.monitor.take_consumer() {
            let s = shared.clone();
            threads.push(spawn("tiermem-monitor", Box::new(move || crate::monitor::monitor_thread(&s, consumer)))?);
        }
        if shared.config.damon {
            let s = shared.clone();
            threads.push(spawn("tiermem-damon", Box::new(move || crate::damon::damon_thread(&s)))?);
        }
        // In on-fault-path mode too, for budget cuts only (see `Shared::drop_threshold`).
        let s = shared.clone();
        threads.push(spawn("tiermem-reclaim", Box::new(move || crate::reclaim::reclaim_thread(&s)))?);
        match shared.config.fault_mode {
            FaultMode::HandlerThread => {
                for i in 0..shared.config.handler_threads {
                    let s = shared.clone();
                    let idle = crate::delivery::FaultWait::new(&shared, &shared.uffd);
                    threads.push(spawn(
                        &format!("tiermem-fault{i}"),
                        Box::new(move || crate::delivery::handler_thread(&s, &s.uffd, i, idle)),
                    )?);
                }
            }
            FaultMode::Sigbus => {
                crate::delivery::install_sigbus(&shared)?;
                // Faults in kernel regions: a system call may take them, which SIGBUS cannot serve.
                let s = shared.clone();
                let idle = shared.threaded.as_ref().map(|(uffd, _)| crate::delivery::FaultWait::new(&shared, uffd));
                threads.push(spawn(
                    "tiermem-fault0",
                    Box::new(move || {
                        if let (Some((uffd, _)), Some(idle)) = (&s.threaded, idle) {
                            crate::delivery::handler_thread(&s, uffd, 0, idle);
                        }
                    }),
                )?);
            }
        }
        tracing::info!(
            device = %shared.device.describe(),
            write_protect,
            fault_mode = %shared.config.fault_mode,
            "engine started"
        );
        Ok(engine)
    }

    /// Create a managed region of `len` bytes (rounded up to whole pages).
    pub fn create_region(&self, len: usize) -> Result<Region> {
        self.create_region_served(len, false)
    }

    /// Create a managed region the kernel may fault on in every fault mode: system calls can
    /// read and write it without [`Engine::prepare_kernel_access`]. In sigbus mode its faults go
    /// to a handler thread (a round trip between threads, as in handler-thread mode) instead of
    /// the faulting thread, for memory that system calls use often and unpredictably: the
    /// preload shim's small-object heap, where stdio and the C library keep their buffers. In
    /// handler-thread mode it is an ordinary region.
    pub fn create_kernel_region(&self, len: usize) -> Result<Region> {
        if !self.shared.uffd.handles_kernel_faults() {
            return Err(Error::new(
                ErrorKind::Permission,
                "a region the kernel may fault on needs a userfaultfd that handles kernel faults: \
                 root, CAP_SYS_PTRACE or the sysctl vm.unprivileged_userfaultfd=1",
            ));
        }
        self.create_region_served(len, self.shared.threaded.is_some())
    }

    fn create_region_served(&self, len: usize, threaded: bool) -> Result<Region> {
        if len == 0 {
            return Err(Error::invalid("region length must be greater than zero"));
        }
        let len = len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
        self.region_over(len, threaded, false, || Mapping::anonymous(len, false))
    }

    /// Manage `len` bytes at `addr` that the caller has just mapped itself: a program's
    /// `mmap(MAP_FIXED)` of fresh anonymous memory, as runtimes that reserve address space
    /// first and map into it later do (a Java heap), or a reservation it has just made
    /// read-write with mprotect (V8's heap). The region owns the mapping from then on
    /// (dropping it unmaps it); on failure it is left as it was, the caller's.
    ///
    /// # Safety
    /// `[addr, addr + len)` is private anonymous read-write memory the caller owns, mapped or
    /// made read-write by one call that has just returned, with no page present or swapped out
    /// and not yet used: nothing else unmaps it or uses it as its own.
    pub unsafe fn adopt_region(&self, addr: *mut u8, len: usize) -> Result<Region> {
        // SAFETY: the caller hands the mapping over whole (this function's contract).
        self.region_over(len, false, true, || unsafe { Mapping::adopt(addr, len) })
    }

    /// A region over the mapping `map` makes (`len` bytes, whole pages): device room for its
    /// pages, the userfaultfd registration, base pages only. An `adopted` mapping (the
    /// caller's) is left mapped if this fails; one made here is unmapped.
    fn region_over(
        &self,
        len: usize,
        threaded: bool,
        adopted: bool,
        map: impl FnOnce() -> Result<Mapping>,
    ) -> Result<Region> {
        let pages = (len / PAGE_SIZE) as u64;
        if pages >= 1 << crate::policy::PAGE_INDEX_BITS {
            return Err(Error::invalid(format!("region of {len} bytes is too large")));
        }
        let capacity = self.shared.slots.capacity();
        let before = self.shared.reserved_pages.fetch_add(pages, Ordering::AcqRel);
        if before + pages > capacity {
            self.shared.reserved_pages.fetch_sub(pages, Ordering::AcqRel);
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "device {} holds {} MiB; regions would need {} MiB: use a larger device",
                    self.shared.device.describe(),
                    (capacity * PAGE_SIZE as u64) >> 20,
                    ((before + pages) * PAGE_SIZE as u64) >> 20
                ),
            ));
        }
        let tables = match crate::region::PageTables::new(pages as usize, self.shared.keeps_slot_hashes()) {
            Ok(t) => t,
            Err(e) => {
                self.shared.reserved_pages.fetch_sub(pages, Ordering::AcqRel);
                return Err(e);
            }
        };
        let built = map().and_then(|mapping| {
            // SAFETY: the range is the mapping just created (or handed over) and owned here.
            if let Err(e) = unsafe { register_base_pages(self.shared.uffd_for(threaded), mapping.as_ptr(), len) } {
                if adopted {
                    // Not ours after all: it stays the caller's, mapped.
                    std::mem::forget(mapping);
                }
                return Err(e);
            }
            Ok(mapping)
        });
        let mapping = match built {
            Ok(m) => m,
            Err(e) => {
                self.shared.reserved_pages.fetch_sub(pages, Ordering::AcqRel);
                return Err(e);
            }
        };
        let inner = self
            .shared
            .regions
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(|index| RegionInner::new(index, mapping, tables, threaded));
        if self.shared.prefault_metadata.load(Ordering::Relaxed) {
            inner.prepare_metadata();
        }
        Ok(Region { shared: self.shared.clone(), inner })
    }

    /// Make the engine's own bookkeeping resident up front instead of page by page as it is
    /// first written: the replacement policy's queues and tables (sized for the budget, about
    /// 1% of it) and the latency histograms; from now on each new region's per-page state is
    /// made ready too: its page tables mapped now, each chunk of it made memory by the first
    /// fault there (see `RegionInner::prepare_metadata`). For a program whose cgroup pauses
    /// it when out of memory (the preload's OOM guard): reclaim and completions must not wait
    /// for a new page of their own while they are the ones to free memory (seen: reclaim stuck
    /// on a first store to a slot hash, and to the policy's eviction history).
    pub fn keep_metadata_resident(&self) {
        self.shared.prefault_metadata.store(true, Ordering::Relaxed);
        self.shared.replacement.reserve_now();
        self.shared.stats.touch_histograms();
    }

    /// The POSIX thread ids of the engine's own threads (completion, monitor, reclaim, fault handlers).
    /// They must never fault on managed memory: a caller that routes allocations into managed
    /// memory (the preload shim's small heap) sends theirs elsewhere.
    pub fn thread_ids(&self) -> Vec<u64> {
        use std::os::unix::thread::JoinHandleExt;
        self.threads.iter().map(|t| t.as_pthread_t()).collect()
    }

    /// Finish the fault trace ([`EngineConfig::trace_path`]): write out what is recorded and
    /// close the file. Later faults are not recorded. Dropping the engine does this too.
    pub fn finish_trace(&self) {
        if let Some(trace) = &self.shared.trace {
            trace.finish();
        }
    }

    /// Stop the DAMON source ([`EngineConfig::damon`]) and remove its tracefs instance, for a
    /// process that ends without dropping the engine (the preload shim's exit). Waits for the
    /// source's current wait on DAMON (100 ms at most), and gives up after 300 ms (called from
    /// a signal handler on the source's own thread, it could never have it); `tiermem run`
    /// then removes the instance. Dropping the engine does this too.
    pub fn stop_damon(&self) {
        self.shared.damon_stop.store(true, Ordering::Release);
        let start = std::time::Instant::now();
        loop {
            match self.shared.damon.try_lock() {
                Ok(mut events) => return self.shared.drop_damon(&mut events),
                Err(std::sync::TryLockError::Poisoned(e)) => return self.shared.drop_damon(&mut e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if start.elapsed() < std::time::Duration::from_millis(300) => {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return,
            }
        }
    }

    /// In a forked child: close the DAMON source's pipe, which the child inherited, so that the
    /// parent can remove its instance at exit while the child lives on. Nothing else of the
    /// source is touched (its lock may have been held at the fork).
    /// Call it only in a child whose engine is never used or dropped again (the preload's).
    pub fn close_damon_in_forked_child(&self) {
        // The child's copy of the events is never dropped, and would not close it again if it
        // were (`DamonEvents` leaves a copy in another process alone).
        tiermem_sys::guarded_fd::close_inherited(self.shared.damon_fd.swap(-1, Ordering::AcqRel));
    }

    /// Counters and latencies so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Pages of prefetch reads queued whose completions have not been processed yet (0 once
    /// the engine is idle).
    pub fn prefetches_in_flight(&self) -> u64 {
        self.shared.prefetches_in_flight.load(Ordering::Relaxed)
    }

    /// Pages one prefetcher call may read now (the prefetch governor's cap; the most a list
    /// holds when the governor is off or has cut nothing).
    pub fn prefetch_cap(&self) -> usize {
        self.shared.prefetch_governor.cap()
    }

    /// What the device counted.
    pub fn device_counters(&self) -> tiermem_device::CounterSnapshot {
        self.shared.device.counters().snapshot()
    }

    /// Bytes of this process's memory the device holds for evicted pages (the `mem` device's
    /// store), None for a device that keeps them elsewhere.
    pub fn device_memory_held(&self) -> Option<u64> {
        self.shared.device.memory_held()
    }

    /// Bytes of the I/O buffer arena (populated up front: resident, outside the budget).
    pub fn io_buffer_bytes(&self) -> u64 {
        u64::from(self.shared.arena.end()) * PAGE_SIZE as u64
    }

    /// Single I/O buffers free now, and how many there are: all of them once nothing is in
    /// flight, no prefetch sample waits and no victim tier holds any (a check that none is lost).
    pub fn free_io_buffers(&self) -> (u32, u32) {
        (self.shared.arena.free_count(), self.shared.arena.pages())
    }

    /// Resident managed pages now (the engine's count, never below the kernel's).
    pub fn resident_pages(&self) -> u64 {
        self.shared.resident()
    }

    /// Evicted pages whose copy waits in the victim tier now (see
    /// [`EngineConfig::victim_pages`]); not resident, not in the budget.
    pub fn victim_tier_pages(&self) -> u64 {
        self.shared.victims.held()
    }

    /// The budget in pages.
    pub fn limit_pages(&self) -> u64 {
        self.shared.limit_pages()
    }

    /// Hold this across every change of protection (mprotect) of managed memory; once asked
    /// for, pages made read-only or inaccessible are evicted by copying them while no change
    /// can happen (UFFDIO_MOVE, which eviction uses under async write protection, moves only
    /// pages of writable mappings: without this such pages stay resident, and a program
    /// keeping more of them than its budget stalls).
    pub fn protection_change(&self) -> std::sync::RwLockWriteGuard<'_, ()> {
        self.shared.protection_guarded.store(true, Ordering::Release);
        self.shared.protection.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether residency is past the watermark (background reclaim is at work).
    pub fn under_pressure(&self) -> bool {
        self.shared.resident() > self.shared.watermark_pages()
    }

    /// A system call of the program failed for want of memory in its cgroup (a socket buffer or
    /// other kernel allocation the full cgroup refused: under the OOM guard such a charge fails
    /// at once where a page fault's would wait). Shed a step of the budget, as a refused page
    /// copy does, and give reclaim up to `wait` to get residency under it, so the call can be
    /// tried again. Counted in `memory_waits`; the cgroup watch sees the count and keeps more
    /// room free for a while.
    pub fn relieve_refused_call(&self, wait: std::time::Duration) {
        Stats::add(&self.shared.stats.counters.memory_waits, 1);
        self.shared.shed(self.shared.limit_pages() / 32);
        let until = std::time::Instant::now() + wait;
        while self.shared.resident() > self.shared.limit_pages() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Page copies the kernel has refused for want of memory so far (see
    /// [`crate::stats::Counters::memory_waits`]).
    pub fn memory_waits(&self) -> u64 {
        self.shared.stats.counters.memory_waits.load(Ordering::Relaxed)
    }

    /// Change the budget while running, never above the configured limit (the policies are sized
    /// for it) nor below 16 pages more than are pinned (locked by the program, or held for a
    /// system call: with fewer, nothing could be evicted and faults would wait forever).
    /// Lowering it below residency wakes reclaim; faulting threads reclaim directly until they
    /// fit. Used to stay inside a cgroup whose room shrinks as the program's unmanaged memory
    /// grows. Returns the budget now in force, in bytes.
    pub fn set_limit_bytes(&self, bytes: u64) -> u64 {
        let configured = self.shared.config.limit_pages();
        let floor = (self.shared.pinned_pages() + 16).min(configured);
        let pages = (bytes / PAGE_SIZE as u64).clamp(floor, configured);
        self.shared.set_limit_pages(pages);
        if self.shared.reclaim_wanted(self.shared.resident()) {
            self.shared.wake_reclaim();
        }
        pages * PAGE_SIZE as u64
    }

    /// What the kernel offered at start-up.
    pub fn kernel_features(&self) -> &KernelFeatures {
        &self.features
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Whether dirty pages are tracked by write protection (else every eviction writes).
    pub fn tracks_dirty_pages(&self) -> bool {
        self.shared.write_protect
    }

    /// How writes are tracked: "sync-wp", "async-wp" or "none".
    pub fn dirty_tracking(&self) -> &'static str {
        match (self.shared.write_protect, self.shared.capture.is_some()) {
            (_, true) => "async-wp",
            (true, false) => "sync-wp",
            (false, false) => "none",
        }
    }

    /// A line saying how the engine runs, for logs and summaries.
    pub fn describe(&self) -> String {
        let config = &self.shared.config;
        let reclaim = match config.reclaim_mode {
            ReclaimMode::Background => format!(
                "background (cleans from {:.0}%, drops from {:.0}%)",
                config.watermark * 100.0,
                self.shared.evict_pages() as f64 * 100.0 / self.shared.limit_pages().max(1) as f64
            ),
            ReclaimMode::OnFaultPath => {
                format!(
                    "on the fault path from {:.0}% (a thread drops only what a budget cut leaves over)",
                    config.watermark * 100.0
                )
            }
        };
        format!(
            "device {}; fault mode {}; dirty tracking {}; I/O {} ({}); reclaim {} of {} MiB; prefetch {}; replace {}",
            self.shared.device.describe(),
            config.fault_mode,
            match self.dirty_tracking() {
                "none" => "none (every eviction writes)",
                other => other,
            },
            config.io_mode,
            self.shared.queues.describe(),
            reclaim,
            (self.shared.limit_pages() * PAGE_SIZE as u64) >> 20,
            self.shared.prefetcher.name(),
            self.shared.replacement.name(),
        )
    }

    /// Make `[addr, addr+len)` of a region resident and writable (if `write`) and keep it so
    /// until the guard drops, so a system call can access it. Needed in [`FaultMode::Sigbus`],
    /// where faults taken inside the kernel cannot be resolved and return EFAULT; harmless in
    /// the other modes.
    pub fn prepare_kernel_access(&self, addr: *const u8, len: usize, write: bool) -> Result<crate::fault::PinGuard> {
        crate::fault::pin_range(&self.shared, addr as usize, len, write)
    }
}

impl Region {
    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.mapping.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.mapping.len()
    }

    /// Always false: regions are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Give up the contents of this region's evicted pages: each becomes untouched (its next
    /// touch maps zeros, no device read) and its slot is freed. For memory whose contents no
    /// longer matter (a freed allocation kept for reuse); resident pages are left as they are.
    /// A page whose write-back is still in flight keeps its contents. Returns the pages given up.
    pub fn forget_evicted(&self) -> u64 {
        self.forget_evicted_in(0, self.len())
    }

    /// [`Region::forget_evicted`] for the pages wholly inside `[offset, offset + len)` (bytes;
    /// partial pages at either end are left alone). No system call: a free block of an
    /// allocator's can give up its evicted pages on every free.
    pub fn forget_evicted_in(&self, offset: usize, len: usize) -> u64 {
        let end = offset.saturating_add(len).min(self.len()) / PAGE_SIZE;
        let first = offset.div_ceil(PAGE_SIZE);
        if first >= end {
            return 0;
        }
        let mut forgotten = 0;
        for (index, cell) in self.inner.pages[first..end].iter().enumerate() {
            let index = first + index;
            // Evicted, or its copy waiting in the victim tier.
            let gone = |s: PageState| {
                (s.kind() == Kind::Evicted && !s.writing()) || (s.kind() == Kind::Prefetched && s.victim())
            };
            if !gone(cell.peek()) {
                continue;
            }
            let Some(mut page) = cell.try_lock() else { continue };
            if gone(page.state()) {
                crate::discard::forget_page(&self.shared, self.inner.id(index as u64), &mut page);
                forgotten += 1;
            }
        }
        forgotten
    }

    /// Pages of this region resident per the kernel (PAGEMAP_SCAN), for checking the budget
    /// from outside the engine's own bookkeeping.
    pub fn kernel_resident_pages(&self, pagemap: &tiermem_sys::pagemap::Pagemap) -> Result<u64> {
        let start = self.inner.start();
        pagemap.count_present(start, start + self.len()).map_err(|e| Error::os(e.into(), "PAGEMAP_SCAN of a region"))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // Order matters: reclaim and completions run concurrently and may touch this region
        // until it is out of the table. Stop new work, drain what is in flight, take it out
        // under the write lock (retrying if a reclaim batch that began before `closing` left
        // I/O behind), and only then count its pages and free its slots.
        self.inner.closing.store(true, Ordering::SeqCst);
        loop {
            crate::reclaim::quiesce_region(&self.shared, &self.inner);
            let mut table = self.shared.regions.write().unwrap_or_else(|e| e.into_inner());
            if self.inner.busy() {
                continue;
            }
            // A list policy drops the region's entries now, while no fault or reclaim runs and
            // before a new region can take its index (and ids): its lists are sized for the
            // budget, and full of entries of closed regions they took no new page. A queue
            // policy's entries are dropped as they come up.
            if self.shared.replacement.one_entry_per_page() {
                for (index, cell) in self.inner.pages.iter().enumerate() {
                    if cell.peek().in_policy() {
                        self.shared.replacement.on_remove(self.inner.id(index as u64));
                    }
                }
            }
            // Its cold hints and cleaned pages too, before a new region's pages could answer to
            // them (a cleaned id left behind evicted such a page out of turn, and the list's
            // count held cleaning back).
            let theirs = |id: &crate::policy::PageId| crate::policy::split_page_id(*id).0 == self.inner.index;
            if self.shared.cold_pages.load(Ordering::Relaxed) > 0 {
                let mut cold = self.shared.cold.lock().unwrap_or_else(|e| e.into_inner());
                cold.retain(|id| !theirs(id));
                self.shared.cold_pages.store(cold.len() as u64, Ordering::Relaxed);
            }
            if self.shared.cleaned_pages.load(Ordering::Relaxed) > 0 {
                let mut cleaned = self.shared.cleaned.lock().unwrap_or_else(|e| e.into_inner());
                cleaned.retain(|id| !theirs(id));
                self.shared.cleaned_pages.store(cleaned.len() as u64, Ordering::Relaxed);
            }
            table.remove(self.inner.index);
            break;
        }
        let base = self.inner.mapping.as_ptr();
        let own_parts = self.inner.mapping.own_parts();
        for &(offset, len) in &own_parts {
            let _ = self.shared.uffd_of(&self.inner).unregister(base.wrapping_add(offset), len);
            self.trace_discard(offset, len);
        }
        // Give the pages back to the kernel before they leave the resident count: the cgroup
        // watch reads the count against the cgroup's usage, and pages still charged to the
        // cgroup but no longer counted here (munmap of a large region takes milliseconds)
        // looked like the program's unmanaged memory, cutting the budget by up to the region's
        // size (intsort quick at 100%: to 110 of 248 MiB) and evicting live pages for nothing.
        for &(offset, len) in &own_parts {
            // SAFETY: the region is out of the table and unregistered; nobody uses its contents
            // (the parts handed over to the program's own mappings are not among these).
            let _ = unsafe { tiermem_sys::mem::discard(base.wrapping_add(offset), len) };
        }
        let mut freed_resident = 0;
        for cell in self.inner.pages.iter() {
            let state = cell.peek();
            if let Some(slot) = state.slot() {
                self.shared.slots.free(slot);
            }
            match state.kind() {
                Kind::Resident => freed_resident += 1,
                // A prefetch sample still waiting, or a page of the victim tier, holds its buffer.
                Kind::Prefetched => self.shared.release_prefetched(state),
                _ => {}
            }
        }
        self.shared.resident.fetch_sub(freed_resident, Ordering::AcqRel);
        self.shared.reserved_pages.fetch_sub(self.inner.page_count(), Ordering::AcqRel);
    }
}

/// How long pages needing a new slot are held back after the device was refused memory for
/// an extension: a few reclaim rounds, so a round does not ask again for every page while the
/// cgroup is full, but not the second a full file system gets.
const DEVICE_MEMORY_RETRY_MS: u64 = 20;

/// Runs of arena buffers for [`EngineConfig::write_runs`]: half a reclaim round's worth of
/// batches in flight (16 x 32 pages, 2 MiB).
const WRITE_RUNS: u32 = 16;
/// Runs of arena buffers for [`EngineConfig::read_runs`] (16 x 32 pages, 2 MiB): a dozen
/// windows of the `ondemand` prefetcher in flight.
const READ_RUNS: u32 = 16;

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake_reclaim();
        self.shared.queues.wake_completion_thread();
        self.shared.monitor.wake();
        if self.shared.config.fault_mode == FaultMode::Sigbus {
            crate::delivery::uninstall_sigbus(&self.shared);
        }
        crate::delivery::wake_handler_threads(&self.shared);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Regions still alive keep `shared`, and with it the DAMON source's tracefs instance.
        self.stop_damon();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefetch_room_lowers_the_drop_threshold_of_small_budgets_only() {
        let with_room = |room: u32| EngineConfig { prefetch_room: room, ..EngineConfig::default() };
        // 18 MiB: 98% leaves 94 pages, 62 of them past a reclaim batch of 32.
        assert_eq!(watermarks(&with_room(0), 4711), (3297, 4616));
        assert_eq!(watermarks(&with_room(256), 4711), (3297, 4711 - 32 - 256));
        // 256 MiB: 98% leaves 1,311 pages, more than asked for.
        assert_eq!(watermarks(&with_room(256), 65_536), (45_875, 64_225));
        // A tenth of the budget at most, so that cleaning ahead keeps room to work in.
        assert_eq!(watermarks(&with_room(256), 400), (280, 360));
        assert_eq!(watermarks(&with_room(16_384), 100), (70, 90));
        // Never above an evict watermark set lower, nor below the cleaning watermark.
        let paper = EngineConfig { evict_watermark: 0.7, ..with_room(256) };
        assert_eq!(watermarks(&paper, 4711), (3297, 3297));
        let high_watermark = EngineConfig { watermark: 0.95, ..with_room(256) };
        assert_eq!(watermarks(&high_watermark, 4711), (4475, 4475));
        // Nor without a prefetcher.
        let no_prefetch = EngineConfig { prefetch: "none".into(), ..with_room(256) };
        assert_eq!(watermarks(&no_prefetch, 4711), (3297, 4616));
    }

    /// A fault that needs room while every resident page belongs to a region being dropped
    /// (which reclaim leaves alone): the fault waited for room holding the region table's read
    /// lock, the drop for the write lock to take those pages out, both for ever. Now the fault
    /// is made again after a while without room, and the drop goes through first.
    #[test]
    fn a_fault_needing_room_does_not_hold_up_the_drop_of_the_region_filling_the_budget() {
        let name = "a_fault_needing_room_does_not_hold_up_the_drop_of_the_region_filling_the_budget";
        let features = KernelFeatures::probe();
        if !features.userfaultfd || !features.wp {
            eprintln!(
                "SKIPPED {name}: userfaultfd with write-protect unavailable: {}",
                features.summary_lines().join("; ")
            );
            return;
        }
        let device = Arc::new(tiermem_device::MemDevice::new(4 << 20).unwrap());
        // Evicting only at the limit: the budget full of one region's pages leaves no room.
        let config = EngineConfig {
            limit_bytes: 64 * 4096,
            io_buffers: 64,
            prefetch: "none".into(),
            evict_watermark: 1.0,
            prefetch_room: 0,
            ..EngineConfig::default()
        };
        let engine = Engine::new(config, device).unwrap();
        let full = engine.create_region(128 * PAGE_SIZE).unwrap();
        for p in 0..128 {
            let page = full.as_ptr().wrapping_add(p * PAGE_SIZE) as *mut u64;
            // SAFETY: inside the region.
            unsafe { page.write_volatile(p as u64) };
        }
        let other = engine.create_region(16 * PAGE_SIZE).unwrap();
        // As the drop begins: from here reclaim leaves the region's pages alone.
        full.inner.closing.store(true, Ordering::SeqCst);
        let at = other.as_ptr() as usize;
        let (touched, touched_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: the first page of `other`, alive until the test ends.
            unsafe { (at as *mut u64).write_volatile(7) };
            let _ = touched.send(());
        });
        // The fault is waiting for room by now.
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (dropped, dropped_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(full);
            let _ = dropped.send(());
        });
        let wait = std::time::Duration::from_secs(10);
        assert!(dropped_rx.recv_timeout(wait).is_ok(), "{name}: the region's drop waited for ever");
        assert!(touched_rx.recv_timeout(wait).is_ok(), "{name}: the fault waited for ever");
        // SAFETY: as above.
        assert_eq!(unsafe { (other.as_ptr() as *const u64).read_volatile() }, 7);
    }

    /// Under the OOM guard (`keep_metadata_resident`) a region's per-page state is memory only
    /// where the program's pages are: making an 8 GiB region takes no memory for its 32 MiB of
    /// state, and the pages of slot hashes reclaim will write are made memory by the faults
    /// first (a chunk at a time), zero-fill around's neighbours included where their hashes lie
    /// on the next page of hashes (before 2026-12-07 the whole state was written up front: 0.4%
    /// of every region).
    #[test]
    fn under_the_oom_guard_a_region_s_state_is_written_only_where_its_pages_are() {
        let name = "under_the_oom_guard_a_region_s_state_is_written_only_where_its_pages_are";
        let features = KernelFeatures::probe();
        if !features.userfaultfd || !features.wp || !features.pagemap_scan {
            eprintln!("SKIPPED {name}: userfaultfd with write-protect, or PAGEMAP_SCAN, unavailable");
            return;
        }
        let resident = || {
            let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
            statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * PAGE_SIZE as u64
        };
        // A NORESERVE mapping: the device costs what is written to it.
        let device = Arc::new(tiermem_device::MemDevice::new(16 << 30).unwrap());
        let config = EngineConfig {
            limit_bytes: 8192 * 4096,
            io_buffers: 64,
            prefetch: "none".into(),
            ..EngineConfig::default()
        };
        let engine = Engine::new(config, device).unwrap();
        engine.keep_metadata_resident();
        let before = resident();
        let region = engine.create_region(8 << 30).unwrap();
        let grown = resident().saturating_sub(before);
        assert!(grown < 4 << 20, "making an 8 GiB region took {} KiB", grown >> 10);
        let hashes = &region.inner.slot_hashes;
        if hashes.is_empty() {
            eprintln!("SKIPPED {name}: no slot hashes kept with this kernel's dirty tracking");
            return;
        }
        // The aligned windows of zero-fill around that cross from one page of hashes to the
        // next (none if the hashes start on a page boundary, which the allocator's header
        // makes unlikely; then each window's hashes share a page).
        let first = hashes.as_ptr() as usize;
        let per_page = (PAGE_SIZE / 8) as u64;
        let boundary = ((PAGE_SIZE - first % PAGE_SIZE) % PAGE_SIZE / 8) as u64;
        let window = crate::fault::ZERO_FILL_AROUND as u64;
        let windows: Vec<u64> = (1..33).map(|m| (boundary + m * 50 * per_page) / window * window).collect();
        for &w in &windows {
            // The window's first page faults; the program then writes the whole window, which
            // zero-fill around mapped (written without a fault).
            for p in w..w + window {
                let at = region.as_ptr().wrapping_add(p as usize * PAGE_SIZE) as *mut u64;
                // SAFETY: inside the region, which this test owns.
                unsafe { at.write_volatile(p ^ 0x5a5a) };
            }
        }
        assert_eq!(engine.stats().evictions, 0, "nothing may be evicted before the check: reclaim writes hashes too");
        // A page of hashes is written if present and not the shared zero page.
        let pagemap = tiermem_sys::pagemap::Pagemap::open_self().unwrap();
        let written = |index: u64| {
            use tiermem_sys::pagemap::{category, PageRegion, ScanQuery};
            let at = (first + index as usize * 8) & !(PAGE_SIZE - 1);
            let query = ScanQuery {
                required: category::PRESENT | category::PFNZERO,
                inverted: category::PFNZERO,
                report: category::PRESENT,
                ..Default::default()
            };
            let mut out = [PageRegion::default(); 1];
            pagemap.scan(at, at + PAGE_SIZE, &query, &mut out).unwrap().0 == 1
        };
        let mut crossing = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        for &w in &windows {
            // A handler thread's copy wakes the program before the pages' states are set.
            let in_memory = |p: u64| region.inner.pages[p as usize].peek().kind() == Kind::Resident;
            while (w..w + window).any(|p| !in_memory(p)) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let filled: Vec<u64> = (w..w + window).filter(|&p| in_memory(p)).collect();
            assert_eq!(filled.len() as u64, window, "window {w}: zero-fill around filled {} pages", filled.len());
            let page_of_hash = |p: u64| (first + p as usize * 8) / PAGE_SIZE;
            crossing += usize::from(page_of_hash(w) != page_of_hash(w + window - 1));
            for &p in &filled {
                assert!(written(p), "window {w}: page {p}'s slot hash lies on a page of hashes no fault wrote");
            }
            // Between the windows, the state is still the zero page.
            assert!(!written(w + 25 * per_page), "window {w}: hashes 25 pages of hashes away were written");
        }
        eprintln!("{name}: {crossing} of {} windows' hashes lie on two pages of hashes", windows.len());
        for &w in &windows {
            for p in w..w + window {
                let at = region.as_ptr().wrapping_add(p as usize * PAGE_SIZE) as *const u64;
                // SAFETY: as above.
                assert_eq!(unsafe { at.read_volatile() }, p ^ 0x5a5a, "page {p}");
            }
        }
    }
}
