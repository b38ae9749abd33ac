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
    let _guard = START.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(engine) = ENGINE.get() {
        return engine;
    }
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
    // fewer (1/16 of it), so tiermem's own overhead does not eat the room it pages into.
    config.io_buffers = u32::try_from(config.limit_pages() / 16).unwrap_or(u32::MAX).clamp(64, config.io_buffers);
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
    if settings.respect_cgroup {
        if let Some(cgroup) = CgroupRoom::of_self() {
            let _ =
                std::thread::Builder::new().name("tiermem-cgroup".into()).spawn(move || watch_cgroup(engine, cgroup));
        }
    }
    engine
}

fn machine_memory() -> u64 {
    rustix::system::sysinfo().totalram as u64
}

// ---- fork ---------------------------------------------------------------------------------

struct ForkState {
    _table: std::sync::MutexGuard<'static, std::collections::BTreeMap<usize, registry::Entry>>,
    hold: ForkHold,
    done_read: std::os::fd::OwnedFd,
    done_write: std::os::fd::OwnedFd,
}

thread_local! {
    /// Held by the forking thread from prepare to the parent or child handler (the same thread).
    static FORK_STATE: std::cell::RefCell<Option<ForkState>> = const { std::cell::RefCell::new(None) };
}

extern "C" fn before_fork() {
    let Some(engine) = ENGINE.get() else { return };
    if in_forked_child() {
        return;
    }
    // Lock order: the registry, then the engine's regions (as allocation does).
    let table = registry::lock();
    let hold = engine.hold_for_fork();
    let (done_read, done_write) = match rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC) {
        Ok(p) => p,
        Err(_) => die(&["tiermem: cannot create a pipe for fork"]),
    };
    FORK_STATE.with(|s| *s.borrow_mut() = Some(ForkState { _table: table, hold, done_read, done_write }));
}

extern "C" fn after_fork_in_parent() {
    let Some(state) = FORK_STATE.with(|s| s.borrow_mut().take()) else { return };
    let ForkState { _table, hold, done_read, done_write } = state;
    drop(done_write);
    // Wait until the child has copied what it needs from our device: until then our slots must
    // not change. EOF (the child wrote its byte and closed, or died) ends the wait.
    let mut byte = [0u8; 1];
    while let Err(rustix::io::Errno::INTR) = rustix::io::read(&done_read, &mut byte) {}
    drop(hold);
    drop(_table);
}

extern "C" fn after_fork_in_child() {
    let Some(state) = FORK_STATE.with(|s| s.borrow_mut().take()) else { return };
    let ForkState { _table, hold, done_read, done_write } = state;
    drop(done_read);
    FORKED_CHILD.store(true, Ordering::Release);
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
        drop(entry);
    }
}

// ---- cgroup -------------------------------------------------------------------------------

/// The memory cgroup this process runs in, when it has a limit.
#[derive(Debug)]
pub struct CgroupRoom {
    limit: u64,
    stat: std::path::PathBuf,
    anon_key: &'static str,
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
                return (limit < 1 << 60).then(|| Self { limit, stat: dir.join("memory.stat"), anon_key: "total_rss" });
            }
            if controllers.is_empty() {
                let dir = std::path::Path::new("/sys/fs/cgroup").join(path);
                if let Some(limit) = read_number(&dir.join("memory.max")) {
                    return Some(Self { limit, stat: dir.join("memory.stat"), anon_key: "anon" });
                }
            }
        }
        None
    }

    fn anon_bytes(&self) -> Option<u64> {
        let stat = std::fs::read_to_string(&self.stat).ok()?;
        stat.lines().find_map(|l| l.strip_prefix(self.anon_key)?.trim().parse().ok())
    }
}

fn read_number(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Keep the budget inside the cgroup: the room left is the limit minus the anonymous memory the
/// engine does not manage (the program's small allocations, the runtime, our own buffers) minus
/// a margin for what the kernel charges besides (page tables, kernel stacks, page cache).
fn watch_cgroup(engine: &'static Engine, cgroup: CgroupRoom) {
    let configured = engine.config().limit_bytes;
    // Proportional, so a small cgroup still leaves the engine most of its room.
    let margin = (cgroup.limit / 50).max(1 << 20);
    loop {
        if let Some(anon) = cgroup.anon_bytes() {
            let managed = engine.resident_pages() * tiermem_sys::PAGE_SIZE as u64;
            let unmanaged = anon.saturating_sub(managed);
            let room = cgroup.limit.saturating_sub(unmanaged + margin);
            let budget = engine.set_limit_bytes(room.min(configured));
            LOWEST_BUDGET.fetch_min(budget, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(20));
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
        "syscalls_wrapped": SYSCALLS_WRAPPED.load(Ordering::Relaxed),
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
