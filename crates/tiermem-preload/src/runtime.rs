//! The shim's process-wide state: settings, the engine (started at the first large allocation),
//! fork handling, the cgroup watch and the statistics written at exit.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tiermem_engine::{Engine, FaultMode, ForkHold, RunSettings};
use tiermem_sys::ErrorKind;

use crate::registry;

static SETTINGS: OnceLock<RunSettings> = OnceLock::new();
static ENGINE: OnceLock<Engine> = OnceLock::new();
static START: Mutex<()> = Mutex::new(());
/// Smallest managed allocation; usize::MAX (nothing managed) until the settings are read, in a
/// forked child, and when the engine cannot run.
static THRESHOLD: AtomicUsize = AtomicUsize::new(usize::MAX);
/// This process is the child of a fork of a managed process: its managed memory is plain memory.
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);
/// The engine runs in sigbus mode (system calls on managed memory must be wrapped).
static SIGBUS_MODE: AtomicBool = AtomicBool::new(false);

/// Counts the engine does not keep.
pub static MANAGED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
pub static MANAGED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static LIVE_MANAGED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static PEAK_MANAGED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static FALLBACK_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Managed allocations served by a kept freed region ([`crate::recycle`]).
pub static REUSED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
pub static SYSCALLS_WRAPPED: AtomicU64 = AtomicU64::new(0);
static LOWEST_BUDGET: AtomicU64 = AtomicU64::new(u64::MAX);
static CHILD_PAGES_COPIED: AtomicU64 = AtomicU64::new(0);

/// Set this thread's errno.
pub fn set_errno(value: i32) {
    // SAFETY: __errno_location returns this thread's errno variable, always valid.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    unsafe { *errno = value };
}

/// Write a message to stderr without allocating (usable anywhere, even inside malloc).
pub fn say(parts: &[&str]) {
    for part in parts.iter().chain(std::iter::once(&"\n")) {
        let mut rest = part.as_bytes();
        while !rest.is_empty() {
            match rustix::io::write(rustix::stdio::stderr(), rest) {
                Ok(n) if n > 0 => rest = &rest[n..],
                Ok(_) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => break,
            }
        }
    }
}

/// Report a condition the program cannot survive and stop it (no unwinding, no atexit).
pub fn die(parts: &[&str]) -> ! {
    say(parts);
    // SAFETY: _exit ends the process immediately; nothing is left half-done that matters.
    unsafe { libc::_exit(1) }
}

/// Read `TIERMEM_*` once, at load. A bad value stops the program with the reason.
pub fn load_settings() {
    if SETTINGS.get().is_some() {
        return;
    }
    match RunSettings::from_env() {
        Ok(settings) => {
            SIGBUS_MODE.store(settings.engine.fault_mode == FaultMode::Sigbus, Ordering::Release);
            THRESHOLD.store(usize::try_from(settings.threshold).unwrap_or(usize::MAX), Ordering::Release);
            let _ = SETTINGS.set(settings);
        }
        Err(e) => {
            let message = e.to_string();
            die(&["tiermem: bad configuration: ", &message]);
        }
    }
}

/// Smallest size that is managed (usize::MAX when nothing is).
pub fn threshold() -> usize {
    THRESHOLD.load(Ordering::Acquire)
}

pub fn sigbus_mode() -> bool {
    SIGBUS_MODE.load(Ordering::Acquire)
}

pub fn in_forked_child() -> bool {
    FORKED_CHILD.load(Ordering::Acquire)
}

/// The running engine, if it has been started.
pub fn running_engine() -> Option<&'static Engine> {
    ENGINE.get()
}

/// The engine, started on first use. A failure to start is fatal: the program asked to run
/// under tiermem, and silently running unmanaged would break its memory limit.
pub fn engine() -> &'static Engine {
    if let Some(engine) = ENGINE.get() {
        return engine;
    }
    let guard = START.lock().unwrap_or_else(|e| e.into_inner());
    start_engine(guard)
}

/// Start the engine unless it is starting right now (None then: on this thread that is the
/// start itself allocating, which must not wait for itself).
pub fn try_start_engine() -> Option<&'static Engine> {
    if let Some(engine) = ENGINE.get() {
        return Some(engine);
    }
    let guard = match START.try_lock() {
        Ok(guard) => guard,
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return None,
    };
    Some(start_engine(guard))
}

fn start_engine(guard: std::sync::MutexGuard<'_, ()>) -> &'static Engine {
    if let Some(engine) = ENGINE.get() {
        return engine;
    }
    let engine = crate::stdio::starting_engine(|| start_engine_threads(guard));
    crate::stdio::activate(SETTINGS.get().is_some_and(|s| s.single_thread_stdio));
    engine
}

/// Open the device, start the engine and the cgroup watch (the threads created here are the
/// engine's own).
fn start_engine_threads(_guard: std::sync::MutexGuard<'_, ()>) -> &'static Engine {
    let Some(settings) = SETTINGS.get() else {
        die(&["tiermem: the engine was needed before the settings were read"]);
    };
    let mut capacity = settings.device_capacity(machine_memory());
    if let (None, tiermem_device::DeviceSpec::File(dir)) = (settings.device_bytes, &settings.device) {
        // A temporary file takes at most half the free space left in its file system.
        if let Ok(fs) = rustix::fs::statvfs(dir.as_path()) {
            let free = fs.f_bavail.saturating_mul(fs.f_frsize);
            if dir.is_dir() && free > 0 {
                capacity = capacity.min((free / 2).max(64 << 20) / 4096 * 4096);
            }
        }
    }
    let device = match settings.device.open(capacity) {
        Ok(d) => d,
        Err(e) if e.kind() == ErrorKind::Busy => {
            // Another process (our parent, before it exec'ed us) holds the named file: use a
            // private file beside it instead.
            let dir = match &settings.device {
                tiermem_device::DeviceSpec::File(path) => path.parent().map(std::path::Path::to_path_buf),
                tiermem_device::DeviceSpec::Mem => None,
            }
            .unwrap_or_else(std::env::temp_dir);
            match tiermem_device::DeviceSpec::File(dir).open(capacity) {
                Ok(d) => d,
                Err(e) => die(&["tiermem: cannot open a device: ", &e.to_string()]),
            }
        }
        Err(e) => die(&["tiermem: cannot open the device: ", &e.to_string()]),
    };
    let mut config = settings.engine.clone();
    // The I/O buffers are pinned memory charged to the program's cgroup: a small budget gets
    // fewer (a 64th of it, at least 256: two queues' depth), so tiermem's own overhead does not
    // eat the room it pages into; `io_buffers` is the most it gets. (A 16th, at least 64, was
    // slower: README, *I/O buffers*.)
    let most = config.io_buffers;
    config.io_buffers = u32::try_from(config.limit_pages() / 64).unwrap_or(u32::MAX).clamp(most.min(256), most);
    if let Some(dir) = &settings.trace_dir {
        config.trace_path = Some(dir.join(format!("{}.trace", std::process::id())));
    }
    let engine = match Engine::new(config, device) {
        Ok(engine) => engine,
        Err(e) => die(&["tiermem: cannot start the paging engine: ", &e.to_string()]),
    };
    let engine = ENGINE.get_or_init(|| engine);
    // SAFETY: registering plain extern "C" functions with pthread_atfork and atexit.
    let rc = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child)) };
    if rc != 0 {
        die(&["tiermem: pthread_atfork failed"]);
    }
    // SAFETY: as above.
    unsafe { libc::atexit(at_exit) };
    let mut engine_threads = engine.thread_ids();
    if settings.respect_cgroup {
        if let Some(cgroup) = CgroupRoom::of_self() {
            use std::os::unix::thread::JoinHandleExt;
            // Before the first managed page: the room is known from the start.
            fit_budget_to_cgroup(engine, &cgroup, engine.config().limit_bytes);
            let watch =
                std::thread::Builder::new().name("tiermem-cgroup".into()).spawn(move || watch_cgroup(engine, cgroup));
            if let Ok(handle) = watch {
                engine_threads.push(handle.as_pthread_t());
            }
        }
    }
    if small_heap_wanted() {
        crate::heap::enable(&engine_threads);
    }
    engine
}

/// The settings ask for the small heap and the fault mode allows it (see [`crate::heap`]).
/// Whether freed large allocations are kept for reuse ([`crate::recycle`]).
pub fn reuse_freed() -> bool {
    SETTINGS.get().is_some_and(|s| s.reuse_freed) && !in_forked_child()
}

pub fn small_heap_wanted() -> bool {
    SETTINGS.get().is_some_and(|s| s.small_heap && s.engine.fault_mode == FaultMode::HandlerThread)
        && !in_forked_child()
}

fn machine_memory() -> u64 {
    rustix::system::sysinfo().totalram as u64
}

// ---- fork ---------------------------------------------------------------------------------

struct ForkState {
    _heap: crate::heap::HeapGuard,
    _table: std::sync::MutexGuard<'static, std::collections::BTreeMap<usize, registry::Entry>>,
    hold: ForkHold,
    done_read: std::os::fd::OwnedFd,
    done_write: std::os::fd::OwnedFd,
}

/// What the forking thread holds from the prepare handler to the parent or child handler. Not a
/// thread-local: initialising one registers its destructor with a calloc, which would reach the
/// small heap while the prepare handler holds the heap's lock.
struct ForkSlot(std::cell::UnsafeCell<Option<ForkState>>);

// SAFETY: glibc runs one fork's prepare, parent and child handlers on the forking thread while it
// holds its atfork lock (forks are serialised), so two threads never touch the slot at once.
unsafe impl Sync for ForkSlot {}

static FORK_STATE: ForkSlot = ForkSlot(std::cell::UnsafeCell::new(None));

fn fork_state() -> &'static mut Option<ForkState> {
    // SAFETY: see ForkSlot: only the forking thread reaches the slot, one handler at a time.
    unsafe { &mut *FORK_STATE.0.get() }
}

extern "C" fn before_fork() {
    let Some(engine) = ENGINE.get() else { return };
    if in_forked_child() {
        return;
    }
    // Kept freed regions would be copied into the child for nothing.
    crate::recycle::clear();
    // Lock order: the small heap, the registry, then the engine's regions (as allocation does).
    let heap = crate::heap::lock_for_fork();
    let table = registry::lock();
    let hold = engine.hold_for_fork();
    let (done_read, done_write) = match rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) {
        Ok(p) => p,
        Err(_) => die(&["tiermem: cannot create a pipe for fork"]),
    };
    *fork_state() = Some(ForkState { _heap: heap, _table: table, hold, done_read, done_write });
}

extern "C" fn after_fork_in_parent() {
    let Some(state) = fork_state().take() else { return };
    let ForkState { _heap, _table, hold, done_read, done_write } = state;
    drop(done_write);
    // Wait until the child has copied what it needs from our device: until then our slots must
    // not change. EOF (the child wrote its byte and closed, or died) ends the wait.
    let mut byte = [0u8; 1];
    while let Err(rustix::io::Errno::INTR) = rustix::io::read(&done_read, &mut byte) {}
    drop(hold);
    drop(_table);
}

extern "C" fn after_fork_in_child() {
    let Some(state) = fork_state().take() else { return };
    let ForkState { _heap, _table, hold, done_read, done_write } = state;
    drop(done_read);
    FORKED_CHILD.store(true, Ordering::Release);
    // The child's heap blocks are plain memory now: they can be freed, but no new ones come.
    crate::heap::disable();
    THRESHOLD.store(usize::MAX, Ordering::Release);
    SIGBUS_MODE.store(false, Ordering::Release);
    let Some(engine) = ENGINE.get() else { return };
    match engine.copy_into_forked_child(&hold) {
        Ok(copy) => CHILD_PAGES_COPIED.store(copy.from_device + copy.from_buffers, Ordering::Relaxed),
        Err(e) => die(&["tiermem: the forked child could not copy managed memory: ", &e.to_string()]),
    }
    // The engine's locks stay taken in the child (its threads are in the parent): never release
    // them, never use the engine here again.
    std::mem::forget(hold);
    drop(_table);
    let _ = rustix::io::write(&done_write, &[1]);
}

/// Give back a managed allocation's memory. In a forked child the region is plain memory that
/// the engine (left in the parent) must not be asked about.
pub fn release(entry: registry::Entry) {
    if in_forked_child() {
        let (base, len) = (entry.base(), entry.len());
        std::mem::forget(entry);
        // SAFETY: the range is the child's private copy of a region nobody else refers to now.
        unsafe { libc::syscall(libc::SYS_munmap, base, len) };
    } else {
        LIVE_MANAGED_BYTES.fetch_sub(entry.len() as u64, Ordering::Relaxed);
        let reusable =
            entry.origin == registry::Origin::Malloc && entry.user == entry.base() && entry.unmapped.is_empty();
        match ENGINE.get() {
            Some(engine) if reusable && reuse_freed() => crate::recycle::keep(engine, entry.region),
            _ => drop(entry),
        }
    }
}

// ---- cgroup -------------------------------------------------------------------------------

/// The memory cgroup this process runs in, when it has a limit.
#[derive(Debug)]
pub struct CgroupRoom {
    limit: u64,
    usage: std::path::PathBuf,
    stat: std::path::PathBuf,
    cache_key: &'static str,
}

impl CgroupRoom {
    /// Our memory cgroup (v2 unified or v1 memory controller) if it sets a limit.
    pub fn of_self() -> Option<Self> {
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        for line in cgroups.lines() {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let path = path.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                let dir = std::path::Path::new("/sys/fs/cgroup/memory").join(path);
                let limit = read_number(&dir.join("memory.limit_in_bytes"))?;
                return (limit < 1 << 60).then(|| Self {
                    limit,
                    usage: dir.join("memory.usage_in_bytes"),
                    stat: dir.join("memory.stat"),
                    cache_key: "total_cache ",
                });
            }
            if controllers.is_empty() {
                let dir = std::path::Path::new("/sys/fs/cgroup").join(path);
                if let Some(limit) = read_number(&dir.join("memory.max")) {
                    return Some(Self {
                        limit,
                        usage: dir.join("memory.current"),
                        stat: dir.join("memory.stat"),
                        cache_key: "file ",
                    });
                }
            }
        }
        None
    }

    /// What the cgroup is charged for that the kernel cannot simply drop: everything but the
    /// page cache (anonymous memory, page tables, kernel stacks and other kernel memory).
    fn charged_bytes(&self) -> Option<u64> {
        let usage = read_number(&self.usage)?;
        let stat = std::fs::read_to_string(&self.stat).ok()?;
        let cache: u64 = stat.lines().find_map(|l| l.strip_prefix(self.cache_key)?.trim().parse().ok())?;
        Some(usage.saturating_sub(cache))
    }
}

fn read_number(path: &std::path::Path) -> Option<u64> {
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
fn fit_budget_to_cgroup(engine: &Engine, cgroup: &CgroupRoom, configured: u64) {
    let held = engine.device_memory_held();
    let local = match held {
        Some(held) => cgroup.limit.saturating_sub(held).min(configured),
        None => cgroup.limit,
    };
    // Proportional, so a small cgroup still leaves the engine most of its room.
    let margin = (local / 50).max(1 << 20);
    if let Some(charged) = cgroup.charged_bytes() {
        let managed = engine.resident_pages() * tiermem_sys::PAGE_SIZE as u64;
        let unmanaged = charged.saturating_sub(managed + held.unwrap_or(0));
        let room = local.saturating_sub(unmanaged + margin);
        let budget = engine.set_limit_bytes(room.min(configured));
        LOWEST_BUDGET.fetch_min(budget, Ordering::Relaxed);
    }
}

fn watch_cgroup(engine: &'static Engine, cgroup: CgroupRoom) {
    let configured = engine.config().limit_bytes;
    loop {
        std::thread::sleep(Duration::from_millis(20));
        fit_budget_to_cgroup(engine, &cgroup, configured);
    }
}

// ---- statistics ---------------------------------------------------------------------------

extern "C" fn at_exit() {
    if in_forked_child() {
        return;
    }
    let (Some(engine), Some(settings)) = (ENGINE.get(), SETTINGS.get()) else { return };
    engine.finish_trace();
    let Some(dir) = &settings.stats_dir else { return };
    let lowest = LOWEST_BUDGET.load(Ordering::Relaxed);
    let report = serde_json::json!({
        "pid": std::process::id(),
        "program": std::env::args().next().unwrap_or_default(),
        "engine": engine.stats(),
        "device": engine.device_counters(),
        "limit_bytes": engine.config().limit_bytes,
        "lowest_budget_bytes": (lowest != u64::MAX).then_some(lowest),
        "fault_mode": engine.config().fault_mode.to_string(),
        "dirty_tracking": engine.dirty_tracking(),
        "device_description": engine.describe(),
        "managed_allocations": MANAGED_ALLOCATIONS.load(Ordering::Relaxed),
        "managed_bytes": MANAGED_BYTES.load(Ordering::Relaxed),
        "peak_managed_bytes": PEAK_MANAGED_BYTES.load(Ordering::Relaxed),
        "fallback_allocations": FALLBACK_ALLOCATIONS.load(Ordering::Relaxed),
        "reused_allocations": REUSED_ALLOCATIONS.load(Ordering::Relaxed),
        "small_heap_allocations": crate::heap::ALLOCATIONS.load(Ordering::Relaxed),
        "small_heap_bytes": crate::heap::CHUNK_BYTES.load(Ordering::Relaxed),
        "syscalls_wrapped": SYSCALLS_WRAPPED.load(Ordering::Relaxed),
        "stdio_streams_unlocked": crate::stdio::STREAMS_UNLOCKED.load(Ordering::Relaxed),
        "stdio_streams_relocked": crate::stdio::STREAMS_RELOCKED.load(Ordering::Relaxed),
    });
    let path = dir.join(format!("{}.json", std::process::id()));
    if let Err(e) = std::fs::write(&path, report.to_string()) {
        say(&["tiermem: cannot write statistics to ", &path.display().to_string(), ": ", &e.to_string()]);
    }
}

/// Note a new managed allocation of `len` bytes.
pub fn count_allocation(len: usize) {
    MANAGED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
    let live = LIVE_MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
    PEAK_MANAGED_BYTES.fetch_max(live, Ordering::Relaxed);
}
