//! The shim's process-wide state: settings, the engine (started at the first large allocation),
//! fork handling, and starting the cgroup watch ([`crate::cgroup_watch`]) and the report
//! ([`crate::report`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use tiermem_engine::{Engine, FaultMode, ForkHold, RunSettings};
use tiermem_sys::guarded_fd::Guarded;
use tiermem_sys::ErrorKind;

use crate::cgroup_watch::{
    base_margin, fit_budget_to_cgroup, kept_margin, watch_cgroup, CgroupLook, CgroupRoom, OomGuard, SMALL_BUDGET_PAGES,
};
use crate::registry;

pub(crate) static SETTINGS: OnceLock<RunSettings> = OnceLock::new();
pub(crate) static ENGINE: OnceLock<Engine> = OnceLock::new();
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
/// Managed mappings the program placed itself (mmap with MAP_FIXED, [`crate::mmap`]).
pub static FIXED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Pieces of such mappings a live managed region took back ([`crate::mmap`]).
pub static TAKEN_BACK: AtomicU64 = AtomicU64::new(0);
/// Reserved memory the program made accessible with mprotect, managed ([`crate::mmap`]).
pub static COMMITTED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
pub static COMMITTED_BYTES: AtomicU64 = AtomicU64::new(0);
pub static SYSCALLS_WRAPPED: AtomicU64 = AtomicU64::new(0);
/// Calls that failed for want of memory in the cgroup and were tried again after room was made
/// ([`memory_refused`]).
pub static CALLS_RETRIED: AtomicU64 = AtomicU64::new(0);
/// The budget follows a memory cgroup's room (the watch thread runs).
pub(crate) static CGROUP_WATCHED: AtomicBool = AtomicBool::new(false);
static CHILD_PAGES_COPIED: AtomicU64 = AtomicU64::new(0);
/// The memory cgroup the budget follows, when it has no swap: what [`fork_cannot_fit`] weighs
/// a fork's copy against.
pub(crate) static CGROUP_WITHOUT_SWAP: OnceLock<CgroupRoom> = OnceLock::new();
/// Forks refused because the child's copy could not fit in the cgroup.
pub(crate) static FORKS_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Set this thread's errno.
pub fn set_errno(value: i32) {
    // SAFETY: __errno_location returns this thread's errno variable, always valid.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    unsafe { *errno = value };
}

pub use tiermem_sys::messages::decimal;

/// This thread's errno.
pub fn errno() -> i32 {
    // SAFETY: __errno_location returns this thread's errno variable, always valid.
    let errno = unsafe { libc::__errno_location() };
    // SAFETY: as above.
    unsafe { *errno }
}

/// Write a message to stderr without allocating (usable anywhere, even inside malloc); see
/// [`tiermem_sys::messages::say`].
pub fn say(parts: &[&str]) {
    tiermem_sys::messages::say(parts);
}

/// Report a condition the program cannot survive and stop it (no unwinding, no atexit, no
/// statistics: it may be called with any of the shim's locks held).
pub fn die(parts: &[&str]) -> ! {
    say(parts);
    crate::report::exit_now(1)
}

/// This process's pid, as of its load or its fork: a vfork child (no fork handlers run there)
/// has another, and shares this one's memory, so it must not start an engine of its own.
static OWN_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

pub(crate) extern "C" fn note_own_pid() {
    OWN_PID.store(rustix::process::getpid().as_raw_nonzero().get(), Ordering::Release);
}

pub(crate) fn in_vfork_child() -> bool {
    rustix::process::getpid().as_raw_nonzero().get() != OWN_PID.load(Ordering::Acquire)
}

/// When this image first named its files (CLOCK_MONOTONIC, ns; 0: not yet).
static IMAGE_KEY: AtomicU64 = AtomicU64::new(0);

/// This image's key: the monotonic clock when it first named a file of the run. An image that
/// replaced another by `exec` has the same pid and a later key; a forked child keeps its
/// parent's key under a pid of its own.
pub(crate) fn image_key() -> u64 {
    let now = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64).max(1)
    };
    match IMAGE_KEY.load(Ordering::Acquire) {
        0 => match IMAGE_KEY.compare_exchange(0, now(), Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => IMAGE_KEY.load(Ordering::Acquire),
            Err(earlier) => earlier,
        },
        key => key,
    }
}

/// The stem of this image's files in the run's statistics and trace directories, `PID-KEY`
/// (see [`image_key`]): after an `exec` the new image's files go beside the old one's, not
/// over them.
pub(crate) fn image_file_stem() -> String {
    format!("{}-{:x}", std::process::id(), image_key())
}

/// Read `TIERMEM_*` once, at load. A bad value stops the program with the reason.
pub fn load_settings() {
    note_own_pid();
    if SETTINGS.get().is_some() {
        return;
    }
    // Every fork child notes its pid, also one forked before the engine starts.
    // SAFETY: registering a plain extern "C" function with pthread_atfork.
    unsafe { libc::pthread_atfork(None, None, Some(note_own_pid)) };
    // Before anything can go wrong: messages go to the stderr the program started with, even
    // if it later puts a file of its own at fd 2.
    tiermem_sys::messages::keep_stderr();
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

/// Smallest reserved range made accessible with mprotect that is managed: the threshold, but
/// at most 256 KiB, the pieces V8 commits its heap in (one large heap, not a lone small mapping).
/// usize::MAX when nothing is managed (before the settings are read, in a forked child).
pub fn commit_threshold() -> usize {
    match threshold() {
        usize::MAX => usize::MAX,
        t => t.min(256 << 10),
    }
}

pub fn sigbus_mode() -> bool {
    SIGBUS_MODE.load(Ordering::Acquire)
}

pub fn in_forked_child() -> bool {
    FORKED_CHILD.load(Ordering::Acquire)
}

/// A call of the program failed with ENOMEM or ENOBUFS. Where the budget follows a memory
/// cgroup, tiermem keeps that cgroup nearly full of managed pages, and a kernel allocation the
/// call needed (a socket buffer) may have been refused for it: Linux swap would have reclaimed
/// anonymous memory to make room, here nothing can but tiermem. So shed some budget, give
/// reclaim a moment, and say to try again (true). False where no cgroup is followed: the
/// failure is the program's own.
pub fn memory_refused() -> bool {
    if !CGROUP_WATCHED.load(Ordering::Acquire) || in_forked_child() {
        return false;
    }
    let Some(engine) = running_engine() else { return false };
    engine.relieve_refused_call(std::time::Duration::from_millis(20));
    CALLS_RETRIED.fetch_add(1, Ordering::Relaxed);
    true
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
    // Room for the engine's descriptors (about 25) even in a program at its descriptor limit;
    // the limit is raised for the moment only there, since a program's other threads could get
    // numbers past it meanwhile.
    // (Also below guarded_fd::FLOOR plus the room: the descriptors could not move up there.)
    let floor = tiermem_sys::guarded_fd::FLOOR as u64;
    let near_the_limit = descriptor_limit().is_some_and(|limit| {
        let open = std::fs::read_dir("/proc/self/fd").map(|fds| fds.count() as u64);
        limit < floor + ENGINE_DESCRIPTOR_ROOM || open.map_or(true, |open| open + ENGINE_DESCRIPTOR_ROOM > limit)
    });
    // With every signal but SIGBUS held: the threads started here keep that mask, so a signal
    // sent to the process goes to one of the program's threads, never to tiermem's (where a
    // program that blocks SIGTERM everywhere to take it with sigwait would have been ended by
    // it, and where the stand-in for its default action could have waited on itself, the
    // reporter: see `terminating`).
    let engine = crate::signals::holding_signals(|| {
        crate::stdio::starting_engine(|| {
            if near_the_limit {
                let room = descriptor_limit().map_or(floor, |limit| limit.max(floor)) + ENGINE_DESCRIPTOR_ROOM;
                with_descriptor_room(room, || start_engine_threads(guard))
            } else {
                start_engine_threads(guard)
            }
        })
    });
    crate::stdio::activate(SETTINGS.get().is_some_and(|s| s.single_thread_stdio));
    crate::library_data::engine_started();
    engine
}

/// The least a device file tiermem makes is given, however little free space its file system has.
const DEVICE_FLOOR: u64 = 64 << 20;

/// Open the device, start the engine and the cgroup watch (the threads created here are the
/// engine's own).
fn start_engine_threads(_guard: std::sync::MutexGuard<'_, ()>) -> &'static Engine {
    let Some(settings) = SETTINGS.get() else {
        die(&["tiermem: the engine was needed before the settings were read"]);
    };
    let mut capacity = settings.device_capacity(machine_memory());
    if let (None, tiermem_device::DeviceSpec::File(path)) = (settings.device_bytes, &settings.device) {
        // A file tiermem makes (a temporary one in a directory, or a new named one) can grow to
        // at most the free space left in its file system: it sets its blocks aside only as
        // pages are written out (see tiermem_device's `backing`), so each process of a run may
        // count on all of it. An existing file or block device keeps its size.
        let dir = if path.is_dir() {
            Some(path.as_path())
        } else if !path.exists() {
            path.parent().map(|p| if p.as_os_str().is_empty() { std::path::Path::new(".") } else { p })
        } else {
            match std::fs::metadata(path) {
                // An existing file of some size (made by an earlier process of this run, or by
                // the user) keeps it: extending it to the default could fail for want of space.
                Ok(m) if m.is_file() && m.len() >= 64 << 20 => {
                    capacity = capacity.min(m.len() / 4096 * 4096);
                    None
                }
                // A small one grows as a new one would, within the free space.
                Ok(m) if m.is_file() => path.parent(),
                _ => None,
            }
        };
        if let Some(fs) = dir.and_then(|d| rustix::fs::statvfs(d).ok()) {
            let free = fs.f_bavail.saturating_mul(fs.f_frsize);
            if free > 0 {
                capacity = capacity.min(free.max(DEVICE_FLOOR) / 4096 * 4096);
            }
        }
    }
    // Other processes of the run may be making theirs from the same free space at this moment.
    let open = |spec: &tiermem_device::DeviceSpec| {
        let (device, room) = spec.open_within_free_space(capacity, DEVICE_FLOOR)?;
        if room < capacity {
            let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
            say(&[
                "tiermem: the device got ",
                decimal((room >> 20) as i64, &mut a),
                " MiB instead of ",
                decimal((capacity >> 20) as i64, &mut b),
                " MiB: its file system had no room for more",
            ]);
        }
        Ok::<_, tiermem_sys::Error>(device)
    };
    // A process of the run whose engine starts after the run has ended (a descendant that
    // outlived the program: the run's statistics directory is gone) must not make the named
    // file the run has removed, which nobody would remove after it: an unnamed one beside it.
    // If that fails (a file system without unnamed files), or the directory is gone too, the
    // named path as before: a leftover file is better than a process that no longer runs.
    let straggler_dir = match (&settings.device, &settings.stats_dir) {
        (tiermem_device::DeviceSpec::File(path), Some(stats)) if !path.exists() && !stats.is_dir() => {
            let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
            dir.is_dir().then(|| dir.to_path_buf())
        }
        _ => None,
    };
    let unnamed = straggler_dir.and_then(|dir| open(&tiermem_device::DeviceSpec::File(dir)).ok());
    let device = match unnamed.map(Ok).unwrap_or_else(|| open(&settings.device)) {
        Ok(d) => d,
        Err(e)
            if e.kind() == ErrorKind::Busy
                && matches!(&settings.device, tiermem_device::DeviceSpec::File(p) if p.is_file()) =>
        {
            // Another process (our parent, before it exec'ed us) holds the named file: use a
            // private file beside it instead. Not for a block device: beside it is /dev, memory.
            let dir = match &settings.device {
                tiermem_device::DeviceSpec::File(path) => {
                    path.parent().filter(|p| !p.as_os_str().is_empty()).map(std::path::Path::to_path_buf)
                }
                tiermem_device::DeviceSpec::Mem => None,
            }
            .unwrap_or_else(std::env::temp_dir);
            match open(&tiermem_device::DeviceSpec::File(dir)) {
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
    // slower: docs/running-programs.md, *I/O buffers*. A floor of 128 left will-need advice over 8 MiB reading
    // only half of it ahead, `madvise_willneed_on_managed_memory_reads_the_pages_ahead`.)
    //
    // Below a 16 MiB budget that floor, the page pipes' scratch pages and the OOM guard's
    // ballast would be most of the cgroup (the tiny scale's quicksort at 20%, a 6.2 MiB limit:
    // 5.4 MiB held by tiermem and the program's runtime left the budget nothing, and the run
    // was killed or crawled), so each shrinks with the budget there (see [`SMALL_BUDGET_PAGES`]).
    //
    // A budget above the cgroup's limit could never be reached (it is fitted into the cgroup's
    // room below), and the tables sized by it would take room from it (a `--limit 64MiB` run
    // in a 6.2 MiB cgroup: 0.7 MiB more heap than with the cgroup's limit).
    if let Some(cgroup) = settings.respect_cgroup.then(CgroupRoom::of_self).flatten() {
        let page = tiermem_sys::PAGE_SIZE as u64;
        config.limit_bytes = config.limit_bytes.min(cgroup.limit / page * page);
    }
    let budget_pages = config.limit_pages();
    let most = config.io_buffers;
    let floor = (budget_pages / 16).clamp(64, 256) as u32;
    config.io_buffers = u32::try_from(budget_pages / 64).unwrap_or(u32::MAX).clamp(most.min(floor), most);
    if budget_pages < SMALL_BUDGET_PAGES {
        // Evicted pages go out by UFFDIO_MOVE instead: no 512 KiB of scratch pages held.
        config.evict_pipe = false;
    }
    if let Some(dir) = &settings.trace_dir {
        config.trace_path = Some(dir.join(format!("{}.trace", image_file_stem())));
    }
    // The reserve before the engine's threads: they allocate from their first instruction
    // (see `reserve::rescue`). Armed where the OOM guard is asked for, which is what makes a
    // full cgroup refuse memory rather than wait for it (it stays, 128 KiB, if the guard then
    // cannot be armed).
    if settings.respect_cgroup && settings.oom_guard && CgroupRoom::of_self().is_some() {
        if let Err(why) = crate::reserve::arm(ENGINE_RESERVE_BYTES) {
            say(&["tiermem: ", &why, "; the engine's threads allocate from the C library"]);
        }
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
    unsafe { libc::atexit(crate::report::at_exit) };
    crate::report::start_reporting(settings);
    let mut engine_threads = engine.thread_ids();
    if settings.respect_cgroup {
        if let Some(cgroup) = CgroupRoom::of_self() {
            use std::os::unix::thread::JoinHandleExt;
            // Before the first managed page: the room is known from the start.
            let configured = engine.config().limit_bytes;
            fit_budget_to_cgroup(engine, &cgroup, configured, base_margin(engine, &cgroup, configured));
            if cgroup.no_swap {
                let _ = CGROUP_WITHOUT_SWAP.set(cgroup.clone());
            }
            // The watch runs before the guard goes on, and gets it then: its thread start
            // touches fresh memory, which with the guard on and the cgroup full would wait for
            // room only the watch can make (seen: the run hung until `tiermem run`'s backstop).
            let (give_guard, guard_given) = std::sync::mpsc::sync_channel::<Option<OomGuard>>(1);
            let watched = cgroup.clone();
            let watch = tiermem_sys::threads::spawn_running("tiermem-cgroup", None, move || {
                let guard = guard_given.recv().ok().flatten();
                watch_cgroup(engine, watched, guard);
            });
            let guard = if settings.oom_guard && watch.is_ok() {
                match OomGuard::arm(&cgroup, kept_margin(engine, &cgroup, configured, true)) {
                    Ok(guard) => {
                        engine.keep_metadata_resident();
                        Some(guard)
                    }
                    Err(why) => {
                        say(&[
                            "tiermem: no OOM guard (",
                            &why,
                            "); the budget follows the cgroup by looking every 20 ms",
                        ]);
                        None
                    }
                }
            } else {
                None
            };
            let guarded = guard.is_some();
            if let Ok(handle) = watch {
                let _ = give_guard.send(guard);
                engine_threads.push(handle.as_pthread_t());
                CGROUP_WATCHED.store(true, Ordering::Release);
            }
            if guarded {
                for &thread in &engine_threads {
                    if let Err(why) = crate::reserve::populate_stack(thread) {
                        say(&["tiermem: ", &why]);
                    }
                }
            }
        }
    }
    // Unknown engine threads could be handed managed memory: then the heap serves nobody.
    if crate::heap::register_engine_threads(&engine_threads) && small_heap_wanted() {
        crate::heap::enable();
    }
    engine
}

/// Memory for the Rust allocations of the engine's threads under the OOM guard
/// ([`crate::reserve`]), charged to the cgroup whether used or not. Measured: 15–80 KiB in use
/// (`engine_reserve_bytes` in the statistics) in runs of the OOM-guard test; what does not fit
/// goes to the C library, made resident at once. (256 KiB until 2026-11-27: a small cgroup's
/// budget paid for the unused half.)
const ENGINE_RESERVE_BYTES: usize = 128 << 10;

/// The settings ask for the small heap and the fault mode allows it (see [`crate::heap`]).
/// Whether freed large allocations are kept for reuse ([`crate::recycle`]).
pub fn reuse_freed() -> bool {
    SETTINGS.get().is_some_and(|s| s.reuse_freed) && !in_forked_child()
}

pub fn small_heap_wanted() -> bool {
    SETTINGS.get().is_some_and(|s| s.small_heap) && !in_forked_child()
}

/// The settings ask for libraries' data to be paged ([`crate::library_data`]).
pub fn library_data_wanted() -> bool {
    SETTINGS.get().is_some_and(|s| s.library_data) && !in_forked_child()
}

/// The calling thread's id.
pub fn thread_id() -> usize {
    crate::io::sys!(libc::SYS_gettid) as usize
}

fn machine_memory() -> u64 {
    rustix::system::sysinfo().totalram as u64
}

// ---- fork ---------------------------------------------------------------------------------

struct ForkState {
    _heap: crate::heap::HeapGuard,
    _table: std::sync::MutexGuard<'static, std::collections::BTreeMap<usize, registry::Entry>>,
    _kept: std::sync::MutexGuard<'static, Vec<tiermem_engine::Region>>,
    hold: ForkHold,
    done_read: Guarded<std::os::fd::OwnedFd>,
    done_write: Guarded<std::os::fd::OwnedFd>,
}

/// What the forking thread holds from the prepare handler to the parent or child handler. Not a
/// thread-local: initialising one registers its destructor with a calloc, which would reach the
/// small heap while the prepare handler holds the heap's lock.
struct ForkSlot(std::cell::UnsafeCell<Option<ForkState>>);

// SAFETY: the slot is filled only by a thread holding the small heap's fork lock (taken in
// `before_fork`, given back when the state leaves the slot), and read or emptied only by the
// thread FORK_OWNER names, which it names from after the slot is filled until it is emptied: so
// two threads never touch it at once, also when one forks through glibc (serialised by its
// atfork lock) and another past it (`crate::other_forks`), or one forks before the engine
// started and fills nothing.
unsafe impl Sync for ForkSlot {}

static FORK_STATE: ForkSlot = ForkSlot(std::cell::UnsafeCell::new(None));

/// The thread (`pthread_self`, which a forked child keeps) whose fork state the slot holds; 0:
/// none.
static FORK_OWNER: AtomicUsize = AtomicUsize::new(0);

fn this_thread() -> usize {
    // SAFETY: pthread_self has no preconditions.
    unsafe { libc::pthread_self() as usize }
}

/// The fork state this thread put in the slot, if it did.
fn take_own_fork_state() -> Option<ForkState> {
    if FORK_OWNER.load(Ordering::Acquire) != this_thread() {
        return None;
    }
    let state = fork_state().take();
    FORK_OWNER.store(0, Ordering::Release);
    state
}

fn fork_state() -> &'static mut Option<ForkState> {
    // SAFETY: see ForkSlot: only the forking thread reaches the slot, one handler at a time.
    unsafe { &mut *FORK_STATE.0.get() }
}

/// Whether a fork now could not give its child the parent's data, so that it should fail with
/// ENOMEM instead, as the kernel's fork does where memory cannot be committed. A child copies
/// every managed page that is not resident into its own memory (see
/// [`Engine::copy_into_forked_child`]), charged to the same cgroup, while the parent holds its
/// engine still: nothing is evicted for the copy meanwhile. So when those pages are more than
/// the cgroup has free (its page cache aside, which the kernel drops) and it cannot swap, the
/// child would die part way through its copy, or the cgroup's killer end one of them, or the
/// parent, resuming in a full cgroup, would die of SIGSEGV (all three seen; the last most
/// likely the kernel finding no page for its next signal frame). Python's `multiprocessing.Pool` forked again and
/// again and never returned; now its `os.fork()` raises "Cannot allocate memory" at once. A
/// note says why on stderr.
pub(crate) fn fork_cannot_fit() -> bool {
    let (Some(engine), Some(cgroup)) = (ENGINE.get(), CGROUP_WITHOUT_SWAP.get()) else { return false };
    if in_forked_child() || in_vfork_child() {
        return false;
    }
    let copy = {
        let table = registry::lock();
        let skip = |addr: usize| {
            registry::containing(&table, addr).is_some_and(|base| table[&base].excluded_from_fork(addr - base))
        };
        engine.pages_a_forked_child_copies(&skip) * tiermem_sys::PAGE_SIZE as u64
    };
    if copy == 0 {
        return false;
    }
    // Read now: the program may have filled memory since the watch last looked (20 ms). The
    // child needs some memory besides the copy (its page tables, the pages it writes), and
    // while it lives the parent's evictions free nothing it still shares: the margin the
    // budget keeps ([`base_margin`]) is kept out of the room too.
    let resident = engine.resident_pages() * tiermem_sys::PAGE_SIZE as u64;
    let margin = base_margin(engine, cgroup, engine.config().limit_bytes);
    let room = room_for_fork(cgroup.limit, cgroup.look(), resident, margin);
    if copy <= room {
        return false;
    }
    FORKS_REFUSED.fetch_add(1, Ordering::Relaxed);
    let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
    say(&[
        "tiermem: fork refused (ENOMEM): the child would copy ",
        decimal((copy >> 20) as i64, &mut a),
        " MiB of evicted managed memory, and its memory cgroup, without swap, has ",
        decimal((room >> 20) as i64, &mut b),
        " MiB free for it (a forked child's copy does not page, and the parent's pages stay while it \
         copies; docs/running-programs.md, fork)",
    ]);
    true
}

/// The room a forked child's copy has in the cgroup: its limit less what is charged and
/// `margin`. A cgroup that cannot be read (reading its files needs memory too, which a full
/// cgroup may refuse this thread) is judged by what is certainly charged, the managed pages
/// `resident` now, rather than taken to have room: a fork let through there copies into a full
/// cgroup.
fn room_for_fork(limit: u64, look: Option<CgroupLook>, resident: u64, margin: u64) -> u64 {
    let charged = look.map_or(resident, |look| look.charged);
    limit.saturating_sub(charged + margin)
}

pub(crate) extern "C" fn before_fork() {
    let Some(engine) = ENGINE.get() else { return };
    if in_forked_child() {
        return;
    }
    // Kept freed regions would be copied into the child for nothing.
    crate::recycle::clear();
    let pipe = || rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC);
    let (done_read, done_write) = match pipe() {
        Ok(p) => p,
        // A program out of descriptors may still fork (a server at its limit): the handshake's
        // two come from just above the limit.
        Err(rustix::io::Errno::MFILE) => match with_spare_descriptors(pipe) {
            Ok(p) => p,
            Err(_) => die(&[
                "tiermem: cannot fork: the program has used every descriptor RLIMIT_NOFILE allows, and tiermem needs two for the fork",
            ]),
        },
        Err(e) => die(&["tiermem: cannot create a pipe for fork: ", &e.to_string()]),
    };
    // Guarded: another thread's close_range must not end the parent's wait early. Made before
    // the locks below are taken (guarding may allocate).
    let (done_read, done_write) = (Guarded::new(done_read), Guarded::new(done_write));
    // Lock order: the small heap, the registry, then the engine's regions (as allocation does).
    let heap = crate::heap::lock_for_fork();
    let table = registry::lock();
    // After the registry: a thread holding the kept regions' lock never waits for the registry.
    let kept = crate::recycle::lock_for_fork();
    let hold = engine.hold_for_fork();
    *fork_state() = Some(ForkState { _heap: heap, _table: table, _kept: kept, hold, done_read, done_write });
    FORK_OWNER.store(this_thread(), Ordering::Release);
}

/// The soft RLIMIT_NOFILE (None: unlimited).
fn descriptor_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// `make()` run with the soft RLIMIT_NOFILE raised to at least `wanted` (within the hard
/// limit), restored after. Descriptors made above a restored limit stay valid: a program that
/// has used every descriptor it may have (a server at its limit) still gets tiermem's, and
/// they leave its own count alone.
/// Descriptors the engine may take above the limit when it starts in a program at its limit.
const ENGINE_DESCRIPTOR_ROOM: u64 = 64;

/// `make()` run with a few descriptors free however many the program uses: above the limit and
/// past what the engine took there when it started.
pub(crate) fn with_spare_descriptors<T>(make: impl FnOnce() -> T) -> T {
    with_descriptor_room(descriptor_limit().unwrap_or(0) + ENGINE_DESCRIPTOR_ROOM + 8, make)
}

fn with_descriptor_room<T>(wanted: u64, make: impl FnOnce() -> T) -> T {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    // One raise at a time: two overlapping ones could leave the limit raised.
    static RAISING: Mutex<()> = Mutex::new(());
    let _one_at_a_time = RAISING.lock().unwrap_or_else(|e| e.into_inner());
    let before = getrlimit(Resource::Nofile);
    let raised = match (before.current, before.maximum) {
        (Some(current), max) if current < wanted => max.map_or(wanted, |max| wanted.min(max)).max(current),
        _ => return make(),
    };
    let changed = Some(raised) != before.current
        && setrlimit(Resource::Nofile, Rlimit { current: Some(raised), maximum: before.maximum }).is_ok();
    let made = make();
    // Restored unless the program set a limit of its own meanwhile.
    if changed && getrlimit(Resource::Nofile).current == Some(raised) {
        let _ = setrlimit(Resource::Nofile, before);
    }
    made
}

pub(crate) extern "C" fn after_fork_in_parent() {
    let Some(state) = take_own_fork_state() else { return };
    let ForkState { _heap, _table, _kept, hold, done_read, done_write } = state;
    drop(done_write);
    // Wait until the child has copied what it needs from our device: until then our slots must
    // not change. EOF (the child wrote its byte and closed, or died) ends the wait.
    let mut byte = [0u8; 1];
    while let Err(rustix::io::Errno::INTR) = rustix::io::read(&done_read, &mut byte) {}
    drop(hold);
    drop(_kept);
    drop(_table);
}

pub(crate) extern "C" fn after_fork_in_child() {
    let Some(state) = take_own_fork_state() else { return };
    let ForkState { _heap, _table, _kept, hold, done_read, done_write } = state;
    drop(done_read);
    FORKED_CHILD.store(true, Ordering::Release);
    // Emptied before the fork, and the only thread now is this one.
    drop(_kept);
    crate::reserve::after_fork_in_child();
    // The child's heap blocks are plain memory now: they can be freed, but no new ones come.
    crate::heap::disable();
    THRESHOLD.store(usize::MAX, Ordering::Release);
    SIGBUS_MODE.store(false, Ordering::Release);
    let Some(engine) = ENGINE.get() else { return };
    engine.close_damon_in_forked_child();
    // Pages the program's fork advice keeps from the child (see registry::Entry::fork_advice).
    let skip = |addr: usize| {
        registry::containing(&_table, addr).is_some_and(|base| _table[&base].excluded_from_fork(addr - base))
    };
    match engine.copy_into_forked_child(&hold, &skip) {
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
        let own_parts = entry.own_parts();
        std::mem::forget(entry);
        for (start, end) in own_parts {
            // SAFETY: the child's private copy of a region nobody else refers to now (the
            // pieces handed over are the program's own mappings, left alone).
            let _ = crate::io::sys!(libc::SYS_munmap, start, end - start);
        }
    } else {
        crate::lock::forget(entry.base(), entry.base() + entry.len());
        LIVE_MANAGED_BYTES.fetch_sub(entry.len() as u64, Ordering::Relaxed);
        // A region with fork advice keeps the kernel's flags on its mapping, and one the program
        // changed the protection of keeps that: not for another allocation, which would not
        // know of them.
        let reusable = entry.origin == registry::Origin::Malloc
            && entry.user == entry.base()
            && entry.unmapped.is_empty()
            && entry.handed_over.is_empty()
            && entry.reserved.is_empty()
            && entry.fork_advice.is_empty()
            && !entry.protection_changed;
        match ENGINE.get() {
            Some(engine) if reusable && reuse_freed() => crate::recycle::keep(engine, entry.region),
            _ => drop(entry),
        }
    }
}

/// Note a new managed allocation of `len` bytes.
pub fn count_allocation(len: usize) {
    MANAGED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
    let live = LIVE_MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
    PEAK_MANAGED_BYTES.fetch_max(live, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::room_for_fork;
    use crate::cgroup_watch::CgroupLook;

    #[test]
    fn a_fork_s_room_is_judged_by_the_resident_pages_when_the_cgroup_cannot_be_read() {
        const MIB: u64 = 1 << 20;
        let look = CgroupLook { charged: 30 * MIB, droppable: 4 * MIB, file_refaults: None, major_faults: None };
        assert_eq!(room_for_fork(48 * MIB, Some(look), 20 * MIB, MIB), 17 * MIB, "limit less charged and margin");
        assert_eq!(room_for_fork(48 * MIB, None, 40 * MIB, MIB), 7 * MIB, "unreadable: the resident pages count");
        assert_eq!(room_for_fork(48 * MIB, None, 48 * MIB, MIB), 0, "no room, never a wrap-around");
    }
}
