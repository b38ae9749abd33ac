//! `tiermem run` and `tiermem profile`: run an unmodified program with its large allocations in
//! managed memory (through the preload shim), or measure its peak footprint for later
//! percentage limits.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tiermem_engine::stats::StatsSnapshot;
use tiermem_engine::RunSettings;
use tiermem_sys::cgroup;
use tiermem_sys::probe::KernelFeatures;
use tiermem_sys::{Error, ErrorKind, Result};

/// File name of the preload shim, looked for next to the `tiermem` executable.
pub const SHIM_NAME: &str = "libtiermem_preload.so";

/// How the program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Exited with this status.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

/// What one run produced.
#[derive(Debug)]
pub struct RunOutcome {
    /// How the program ended.
    pub ending: Ending,
    /// Wall-clock time.
    pub elapsed: Duration,
    /// The kernel's peak resident set of the largest process (wait4's ru_maxrss).
    pub peak_rss_bytes: u64,
    /// Per-process statistics the shim wrote (one per managed process).
    pub processes: Vec<serde_json::Value>,
    /// Processes that started an engine but wrote no statistics, not even a snapshot: they
    /// ended (a signal, `exec`, a raw `exit_group`) before their first snapshot.
    pub unreported: usize,
    /// The settings the program ran with.
    pub settings: RunSettings,
    /// Whether this user's userfaultfd serves faults taken inside the kernel (see
    /// `tiermem_sys::uffd::Uffd::handles_kernel_faults`): without, the small heap stays with glibc.
    pub kernel_faults: bool,
    /// The program is a statically linked executable, which no preload reaches.
    pub static_program: bool,
}

/// Where `program` would be run from: a path with a slash as given, else the first executable
/// of that name on PATH.
fn resolve_program(program: &std::ffi::OsStr) -> Option<PathBuf> {
    let given = Path::new(program);
    if program.as_encoded_bytes().contains(&b'/') {
        return Some(given.to_path_buf());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(given))
        .find(|path| std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Whether `path` is a 64-bit little-endian ELF executable without a program interpreter
/// (PT_INTERP): statically linked, so the dynamic loader never runs and LD_PRELOAD is ignored.
fn statically_linked(path: &Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut file) = std::fs::File::open(path) else { return false };
    let mut header = [0u8; 64];
    if file.read_exact(&mut header).is_err() || &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return false; // not ELF64 LE: a script, or something this check does not know
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]) as u64;
    let phoff = u64::from_le_bytes(header[32..40].try_into().expect("8 bytes"));
    let (entry_size, count) = (u16_at(&header, 54), u16_at(&header, 56));
    if entry_size < 4 || count == 0 || count > 4096 || file.seek(SeekFrom::Start(phoff)).is_err() {
        return false;
    }
    let mut table = vec![0u8; (entry_size * count) as usize];
    if file.read_exact(&mut table).is_err() {
        return false;
    }
    const PT_INTERP: u32 = 3;
    !table.chunks_exact(entry_size as usize).any(|e| u32::from_le_bytes([e[0], e[1], e[2], e[3]]) == PT_INTERP)
}

/// Find the preload shim: TIERMEM_PRELOAD_LIB, else next to this executable (and one directory
/// up, where cargo puts libraries when the executable is a test's `deps/` build).
pub fn locate_shim() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("TIERMEM_PRELOAD_LIB") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::new(ErrorKind::NotFound, format!("TIERMEM_PRELOAD_LIB={} is not a file", path.display())))
        };
    }
    let exe = std::env::current_exe().map_err(|e| Error::os(e, "locating the tiermem executable"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    for candidate in [dir.join(SHIM_NAME), dir.join("..").join(SHIM_NAME)] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(Error::new(
        ErrorKind::NotFound,
        format!(
            "the preload shim {SHIM_NAME} is not next to {}; build it with `cargo build --release -p tiermem-preload` \
             (or set TIERMEM_PRELOAD_LIB)",
            exe.display()
        ),
    ))
}

/// A directory for a temporary device file: the first of $TIERMEM_TMPDIR, /var/tmp, $TMPDIR,
/// /tmp and the current directory that is on a disk file system (not tmpfs: that is DRAM) and
/// accepts unnamed O_DIRECT files.
pub fn default_device_dir() -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    candidates.extend(std::env::var_os("TIERMEM_TMPDIR").map(PathBuf::from));
    candidates.push(PathBuf::from("/var/tmp"));
    candidates.extend(std::env::var_os("TMPDIR").map(PathBuf::from));
    candidates.push(PathBuf::from("/tmp"));
    candidates.extend(std::env::current_dir().ok());
    let mut reasons = Vec::new();
    for dir in candidates {
        match usable_device_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(why) => reasons.push(format!("{}: {why}", dir.display())),
        }
    }
    Err(Error::new(
        ErrorKind::Unsupported,
        format!("no directory can hold a temporary device file ({}); give --device file:PATH", reasons.join("; ")),
    ))
}

fn usable_device_dir(dir: &Path) -> std::result::Result<(), String> {
    let fs = rustix::fs::statfs(dir).map_err(|e| e.to_string())?;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    if fs.f_type as i64 == TMPFS_MAGIC || fs.f_type as i64 == RAMFS_MAGIC {
        return Err("in memory (tmpfs)".into());
    }
    tiermem_device::FileDevice::create_temporary(dir, 1 << 20).map(drop).map_err(|e| e.to_string())
}

/// Where `tiermem profile` remembers footprints.
pub fn profile_store() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tiermem").join("footprints.json")
}

/// The key a program's footprint is remembered under: its command line.
pub fn profile_key(program: &[OsString]) -> String {
    program.iter().map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
}

/// The footprints remembered in `store`: none if it does not exist yet, an error if it cannot be
/// read or is not what `tiermem profile` writes (it is never silently replaced).
fn read_profile_store(store: &Path) -> Result<BTreeMap<String, u64>> {
    match std::fs::read_to_string(store) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| {
            Error::invalid(format!(
                "{} is not a footprint store written by tiermem profile ({e}); fix or remove it",
                store.display()
            ))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
        Err(e) => Err(Error::os(e, format!("reading {}", store.display()))),
    }
}

/// The remembered footprint of `program`, if `tiermem profile` measured it.
pub fn remembered_footprint(store: &Path, program: &[OsString]) -> Result<Option<u64>> {
    Ok(read_profile_store(store)?.get(&profile_key(program)).copied())
}

/// Remember `footprint` for `program`.
pub fn remember_footprint(store: &Path, program: &[OsString], footprint: u64) -> Result<()> {
    let mut map = read_profile_store(store)?;
    map.insert(profile_key(program), footprint);
    if let Some(dir) = store.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::os(e, format!("creating {}", dir.display())))?;
    }
    let text = serde_json::to_string_pretty(&map).map_err(|e| Error::new(ErrorKind::Internal, e.to_string()))?;
    std::fs::write(store, text).map_err(|e| Error::os(e, format!("writing {}", store.display())))
}

/// How [`spawn_and_wait`] leaves the program: its ending, its time, its peak resident set, and
/// the signals `tiermem run` reacts to ignored from the moment the program ended, until the
/// caller has cleaned up and drops this (the dispositions then go back as they were).
struct Waited {
    ending: Ending,
    elapsed: Duration,
    peak_rss_bytes: u64,
    ignoring: SignalActions<6>,
}

/// Run `program` and wait for it, collecting the kernel's peak RSS; `prepare` adjusts the command.
fn spawn_and_wait(program: &[OsString], prepare: impl FnOnce(&mut Command)) -> Result<Waited> {
    let (name, args) = program.split_first().ok_or_else(|| Error::invalid("no program given after --"))?;
    let mut command = Command::new(name);
    command.args(args);
    prepare(&mut command);
    // If tiermem is killed outright (SIGKILL: nothing to forward), the program goes with it
    // rather than run on, unmanaged by anyone and unreported.
    let us = rustix::process::getpid();
    // The child inherits the signals blocked below (this std's Command keeps the parent's mask);
    // the program starts with them unblocked.
    let unblocked = SignalMask::set_of(&HANDLED_SIGNALS);
    let hook = move || {
        tiermem_sys::child::die_with_parent(us)?;
        // SAFETY: a valid set made before the fork; sigprocmask is async-signal-safe.
        unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, &unblocked, std::ptr::null_mut()) };
        Ok(())
    };
    // SAFETY: the hook makes raw system calls only (prctl, getppid, sigprocmask), between fork
    // and exec, and allocates nothing.
    unsafe { std::os::unix::process::CommandExt::pre_exec(&mut command, hook) };
    // Blocked until the forwarder is armed (the program may send or cause one at once);
    // delivered, and passed on, right after.
    let blocked = SignalMask::block(&HANDLED_SIGNALS);
    // Signals that came during setup, before the program existed, taken off before the fork
    // and passed on once it exists: a Ctrl-C or a SIGTERM during setup ends the program as it
    // would have ended `tiermem run`. (Taken after the fork, a Ctrl-C to the process group in
    // between would reach the program twice; one that comes then is the program's own, and
    // the forwarder's SIG_IGN drops our copy, as while the program runs.)
    let held = SignalMask::take_pending(&HANDLED_SIGNALS);
    let started = Instant::now();
    let child = command.spawn().map_err(|e| {
        // Not started: the held signals are ours again (pending, acted on when unblocked).
        for sig in held.into_iter().flatten() {
            // SAFETY: raising a valid signal in this thread, where it is blocked.
            unsafe { libc::raise(sig) };
        }
        let kind = if e.kind() == std::io::ErrorKind::NotFound { ErrorKind::NotFound } else { ErrorKind::Io };
        Error::os_kind(kind, e, format!("{CANNOT_START}{}", name.to_string_lossy()))
    })?;
    // Ctrl-C reaches the program (same process group); we stay to report and pass its status on.
    // A SIGTERM or SIGHUP sent to us alone goes on to the program, which ends as it would.
    let pid = child.id() as libc::pid_t;
    let signals = ForwardSignals::new(pid);
    for sig in held.into_iter().flatten() {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(pid, sig) };
    }
    SignalMask::unblock(&HANDLED_SIGNALS);
    // Wait without reaping first: until the program is reaped its pid cannot be reused, so the
    // forwarder never signals a stranger. Then disarm it, then reap (with the rusage).
    let retry = |what: &str, rc: libc::c_int| -> Result<bool> {
        if rc >= 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EINTR) {
            Ok(false)
        } else {
            Err(Error::os(e, what.to_string()))
        }
    };
    // SAFETY: a zeroed siginfo_t is valid for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waiting, without reaping, for our own child with a valid out-pointer.
    while !retry("waiting for the program", unsafe {
        libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, libc::WEXITED | libc::WNOWAIT)
    })? {}
    // Straight from forwarding to ignoring: a signal in between (a second Ctrl-C, a SIGTERM)
    // would find the default disposition and end `tiermem run` before its cleanup.
    let ignoring = signals.ignoring();
    // The mask as the caller had it (blocked again under `tiermem run`: they are ignored now).
    drop(blocked);
    let mut status = 0;
    // SAFETY: zeroed rusage is valid for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: reaping our own child, which has ended, with valid out-pointers.
    while !retry("reaping the program", unsafe { libc::wait4(pid, &mut status, 0, &mut usage) })? {}
    let elapsed = started.elapsed();
    let exit = std::process::ExitStatus::from_raw(status);
    let ending = match (exit.code(), exit.signal()) {
        (Some(code), _) => Ending::Exited(code),
        (None, Some(sig)) => Ending::Signaled(sig),
        _ => Ending::Exited(1),
    };
    Ok(Waited { ending, elapsed, peak_rss_bytes: usage.ru_maxrss as u64 * 1024, ignoring })
}

/// How a program that cannot be started is reported (the CLI exits 127 or 126 for it, as a
/// shell does).
pub const CANNOT_START: &str = "cannot start ";

/// The program `tiermem run` waits for: where [`forward_to_program`] sends a signal (0: none).
static PROGRAM_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_to_program(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // A hangup from the terminal (sent by the kernel) reaches the program's process group by
    // itself: passing it on would deliver it twice.
    // SAFETY: the kernel hands an SA_SIGINFO handler a valid siginfo_t.
    if !info.is_null() && unsafe { (*info).si_code } == libc::SI_KERNEL {
        return;
    }
    let pid = PROGRAM_PID.load(std::sync::atomic::Ordering::Relaxed);
    if pid > 0 {
        // The interrupted code must find errno as it left it; kill may change it.
        // SAFETY: __errno_location gives this thread's errno, valid for the thread's life.
        let errno = unsafe { libc::__errno_location() };
        // SAFETY: reading this thread's errno (see above).
        let saved = unsafe { *errno };
        // SAFETY: kill is async-signal-safe. The pid is our child, not yet reaped (the forwarder
        // is disarmed before it is), so it cannot belong to another process.
        unsafe { libc::kill(pid, sig) };
        // SAFETY: writing this thread's errno back (see above).
        unsafe { *errno = saved };
    }
}

/// While the program runs: SIGINT and SIGQUIT ignored (as a shell does while it waits for a
/// foreground job: the terminal sends them to the program too), SIGTERM, SIGHUP, SIGUSR1 and
/// SIGUSR2 passed on to the program (sent to `tiermem run` alone they would otherwise kill it and leave the program
/// running without it, and its statistics directory behind). A signal sent to the whole process
/// group reaches the program twice, once from us (a terminal's hangup excepted). Restored on drop.
struct ForwardSignals {
    actions: Option<SignalActions<6>>,
}

/// The signals [`ForwardSignals`] handles, and [`ignore_signals`] ignores.
const HANDLED_SIGNALS: [libc::c_int; 6] =
    [libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1, libc::SIGUSR2];

impl ForwardSignals {
    /// Stop forwarding: every handled signal ignored from now on, until the returned
    /// dispositions are dropped and put back what was there before [`ForwardSignals::new`].
    fn ignoring(mut self) -> SignalActions<6> {
        for sig in HANDLED_SIGNALS {
            // SAFETY: SIG_IGN for a valid signal of this process; the previous disposition is
            // the forwarder's, which `actions` replaces with the original one when dropped.
            unsafe { libc::signal(sig, libc::SIG_IGN) };
        }
        PROGRAM_PID.store(0, std::sync::atomic::Ordering::Relaxed);
        self.actions.take().expect("taken only here, once")
    }

    fn new(program: libc::pid_t) -> Self {
        PROGRAM_PID.store(program, std::sync::atomic::Ordering::Relaxed);
        let forward = forward_to_program as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);
        let forward = (forward as libc::sighandler_t, libc::SA_SIGINFO | libc::SA_RESTART);
        let ignore = (libc::SIG_IGN, 0);
        // The handler only calls kill(2). In the order of HANDLED_SIGNALS.
        let actions = SignalActions::set([
            (libc::SIGINT, ignore),
            (libc::SIGQUIT, ignore),
            (libc::SIGTERM, forward),
            (libc::SIGHUP, forward),
            (libc::SIGUSR1, forward),
            (libc::SIGUSR2, forward),
        ]);
        Self { actions: Some(actions) }
    }
}

impl Drop for ForwardSignals {
    fn drop(&mut self) {
        // The dispositions go back when `actions` drops, right after.
        PROGRAM_PID.store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The signals `tiermem run` handles ignored until dropped, then as they were.
fn ignore_signals() -> SignalActions<6> {
    SignalActions::set(HANDLED_SIGNALS.map(|sig| (sig, (libc::SIG_IGN, 0))))
}

/// This thread's signal mask as it was before [`SignalMask::block`], put back when dropped.
struct SignalMask {
    previous: libc::sigset_t,
}

impl SignalMask {
    fn set_of(signals: &[libc::c_int]) -> libc::sigset_t {
        // SAFETY: an all-zero sigset_t is valid storage for sigemptyset to initialise.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is valid storage for a sigset_t.
        unsafe { libc::sigemptyset(&mut set) };
        for &sig in signals {
            // SAFETY: `set` is an initialised sigset_t; `sig` is a valid signal number.
            unsafe { libc::sigaddset(&mut set, sig) };
        }
        set
    }

    /// Block `signals` in this thread (and threads it starts from now on).
    fn block(signals: &[libc::c_int]) -> Self {
        let set = Self::set_of(signals);
        // SAFETY: as in `set_of`: valid storage for the previous mask.
        let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid set and out-pointer; changes only this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut previous) };
        Self { previous }
    }

    /// Take the pending ones among `signals` (blocked) off, without handling them: each signal
    /// at most once, as the kernel keeps it.
    fn take_pending(signals: &[libc::c_int; 6]) -> [Option<libc::c_int>; 6] {
        let set = Self::set_of(signals);
        let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        let mut taken = [None; 6];
        for slot in &mut taken {
            // SAFETY: a valid set and timeout; no siginfo wanted.
            let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &zero) };
            if sig <= 0 {
                break;
            }
            *slot = Some(sig);
        }
        taken
    }

    /// Unblock `signals` in this thread now, whatever guards are held; pending ones are
    /// delivered before this returns.
    fn unblock(signals: &[libc::c_int]) {
        let set = Self::set_of(signals);
        // SAFETY: valid set; changes only this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

impl Drop for SignalMask {
    fn drop(&mut self) {
        // SAFETY: restoring the mask saved in `block`; changes only this thread's mask.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.previous, std::ptr::null_mut()) };
    }
}

/// Signal dispositions (handler, flags) set for `N` signals, each put back as it was when this
/// is dropped.
struct SignalActions<const N: usize> {
    previous: [(libc::c_int, libc::sigaction); N],
}

impl<const N: usize> SignalActions<N> {
    fn set(actions: [(libc::c_int, (libc::sighandler_t, libc::c_int)); N]) -> Self {
        let previous = actions.map(|(sig, (handler, flags))| {
            // SAFETY: all-zero is a valid sigaction (empty mask) that is filled in before use.
            let (mut action, mut previous): (libc::sigaction, libc::sigaction) = unsafe { std::mem::zeroed() };
            action.sa_sigaction = handler;
            action.sa_flags = flags;
            // SAFETY: setting the disposition of a valid signal in this process to SIG_IGN or a
            // handler the caller vouches for, saving the old one, restored on drop.
            unsafe { libc::sigaction(sig, &action, &mut previous) };
            (sig, previous)
        });
        Self { previous }
    }
}

impl<const N: usize> Drop for SignalActions<N> {
    fn drop(&mut self) {
        for (sig, previous) in &self.previous {
            // SAFETY: restoring a disposition saved in `set`.
            unsafe { libc::sigaction(*sig, previous, std::ptr::null_mut()) };
        }
    }
}

/// `tiermem profile`: run the program unmanaged and return its peak footprint (the kernel's
/// peak resident set), remembered for later `--limit N%`.
pub fn profile(program: &[OsString]) -> Result<(Ending, u64)> {
    // A store that cannot be updated is an error before the program runs, not after.
    read_profile_store(&profile_store())?;
    let Waited { ending, peak_rss_bytes: peak, .. } = spawn_and_wait(program, |_| {})?;
    if ending == Ending::Exited(0) {
        remember_footprint(&profile_store(), program, peak)?;
    }
    Ok((ending, peak))
}

/// Resolve the settings for `tiermem run` from `TIERMEM_*` variables overridden by `flags`,
/// filling in the footprint from the profile store and the default device. Every bad value is
/// an error here, before the program starts.
pub fn resolve_settings(
    env: impl IntoIterator<Item = (String, String)>,
    flags: &[(&str, String)],
    program: &[OsString],
) -> Result<RunSettings> {
    let mut vars: BTreeMap<String, String> = env.into_iter().filter(|(k, _)| k.starts_with("TIERMEM_")).collect();
    // Where each value came from, so an error names what the user wrote.
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in flags {
        // A flag's value may also have come from its variable (clap reads both): then the
        // variable is what to name.
        if vars.insert((*k).to_string(), v.clone()).as_ref() != Some(v) {
            sources.insert((*k).to_string(), format!("{}=", flag_of(k)));
        }
    }
    let limit_is_percent = vars.get("TIERMEM_LIMIT").is_some_and(|v| v.trim().ends_with('%'));
    if limit_is_percent {
        // A share out of range is the error to report, before any about the footprint.
        let limit = &vars["TIERMEM_LIMIT"];
        limit.parse::<tiermem_engine::config::Limit>().map_err(|e| {
            let source = sources.get("TIERMEM_LIMIT").map_or_else(|| "TIERMEM_LIMIT=".to_string(), Clone::clone);
            e.context(format!("{source}{limit}"))
        })?;
    }
    if limit_is_percent && !vars.contains_key("TIERMEM_FOOTPRINT") {
        let store = profile_store();
        match remembered_footprint(&store, program)? {
            Some(f) => {
                vars.insert("TIERMEM_FOOTPRINT".into(), f.to_string());
                sources
                    .insert("TIERMEM_FOOTPRINT".into(), format!("the footprint remembered in {} is ", store.display()));
            }
            None => {
                return Err(Error::invalid(format!(
                    "--limit {} is a share of the footprint, which is not known: give --footprint, or measure it \
                     once with `tiermem profile -- {}`",
                    vars["TIERMEM_LIMIT"],
                    profile_key(program)
                )))
            }
        }
    }
    if !vars.contains_key("TIERMEM_DEVICE") {
        vars.insert("TIERMEM_DEVICE".into(), format!("file:{}", default_device_dir()?.display()));
    }
    let settings = RunSettings::from_vars(vars).map_err(|e| {
        // The settings name the variable; a value given by a flag or taken from the profile
        // store is reported as that.
        let text = e.to_string();
        let renamed = sources.iter().find_map(|(var, source)| {
            let rest = text.strip_prefix(var.as_str())?.strip_prefix('=')?;
            Some(format!("{source}{rest}"))
        });
        match renamed {
            Some(message) => Error::new(e.kind(), message),
            None => e,
        }
    })?;
    check_device(&settings)?;
    Ok(settings)
}

/// The command-line flag that sets variable `var` (`TIERMEM_EVICT_WATERMARK` → `--evict-watermark`).
fn flag_of(var: &str) -> String {
    format!("--{}", var.trim_start_matches("TIERMEM_").to_ascii_lowercase().replace('_', "-"))
}

/// Make sure the device can be opened, so the program does not start only to fail.
fn check_device(settings: &RunSettings) -> Result<()> {
    match &settings.device {
        tiermem_device::DeviceSpec::Mem => Ok(()),
        tiermem_device::DeviceSpec::File(path) if path.is_dir() => {
            tiermem_device::FileDevice::create_temporary(path, 1 << 20).map(drop).map_err(|e| e.context("--device"))
        }
        tiermem_device::DeviceSpec::File(path) => {
            tiermem_device::file::refuse_foreign_data(path).map_err(|e| e.context("--device"))?;
            let existed = path.exists();
            let opened = tiermem_device::FileDevice::open(path, if existed { None } else { Some(1 << 20) });
            if !existed {
                let _ = std::fs::remove_file(path);
            }
            opened.map(drop).map_err(|e| e.context("--device"))
        }
    }
}

/// A v1 memory cgroup's `memory.oom_control` and whether its OOM killer is off.
fn v1_oom_control(dir: &Path) -> Option<(PathBuf, bool)> {
    let path = dir.join("memory.oom_control");
    let off = oom_killer_off(&path)?;
    Some((path, off))
}

/// Whether the cgroup's OOM killer is switched off (`oom_kill_disable 1` in `path`).
fn oom_killer_off(path: &Path) -> Option<bool> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.lines().find_map(|l| l.strip_prefix("oom_kill_disable "))?.trim() == "1")
}

/// The limited v1 memory cgroup `tiermem run` was started in and has left for its parent, so
/// that the limit holds the program (with the engine inside it) and not the launcher, which only
/// waits: its heap, stacks and page tables (about 0.8 MiB) came out of the program's room before,
/// and the backstop's wake-ups faulted the launcher's code back into a full cgroup, where on a
/// 6.2 MiB limit those refaults made a 2 s sort take 16 s and once starved it of pages for 2 s.
/// `bench limited-run` starts Linux swap's program the same way, from outside its cgroup.
struct LeftCgroup {
    dir: PathBuf,
    /// `cgroup.procs` of `dir`, for the program to join between fork and exec.
    procs: std::ffi::CString,
}

/// Leave this process's v1 memory cgroup for its parent if the cgroup sets a limit of its own;
/// None (staying, as a cgroup v2 leaf must) when it does not or the move is refused.
fn leave_limited_v1_cgroup() -> Option<LeftCgroup> {
    let dir = cgroup::own_v1_memory_dir()?;
    let limit_of = |d: &Path| -> Option<u64> {
        std::fs::read_to_string(d.join("memory.limit_in_bytes")).ok()?.trim().parse().ok()
    };
    if limit_of(&dir)? >= limit_of(cgroup::v1_parent(&dir)?)? {
        return None;
    }
    let procs = std::ffi::CString::new(dir.join("cgroup.procs").into_os_string().into_encoded_bytes()).ok()?;
    cgroup::move_process_to_parent_v1(&dir).ok()?;
    // What the launcher's heap held before the move stays charged to the limited cgroup until
    // it is given back: give back what is free now.
    // SAFETY: malloc_trim has no preconditions; it only returns free heap memory to the kernel.
    unsafe { libc::malloc_trim(0) };
    Some(LeftCgroup { dir, procs })
}

/// How long the cgroup may stay out of memory, without a break `tiermem run` sees, before it
/// turns the OOM killer back on itself: well past the shim's own 2 s (see [`OomBackstop`]).
const OOM_BACKSTOP_AFTER: Duration = Duration::from_secs(10);

/// The backstop of `--cgroup guard`: a thread of `tiermem run` itself that turns the cgroup's
/// OOM killer back on once the cgroup has been out of memory for [`OOM_BACKSTOP_AFTER`], for
/// when the shim's guard, inside the program, cannot. Seen: a program forked just under its
/// limit, whose engine threads, the guard's among them, all waited in the cgroup's OOM wait
/// for a page of their own stack or heap that the fork had left shared with the child; the run
/// hung for good. `tiermem run` shares no memory with the program (it exec'ed), reads the
/// control file through a descriptor opened up front, and its thread moves to the parent
/// cgroup on v1 (as the shim's watch does), so nothing it does needs the cgroup's memory.
struct OomBackstop {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OomBackstop {
    /// Start watching the v1 `memory.oom_control` at `path`; None if it cannot be opened.
    /// Returns once the thread has moved and read the file once: everything it allocates (its
    /// stack, the kernel's read buffer, its message) is taken before the program starts, while
    /// the cgroup has room. A thread first scheduled later, with the cgroup full, aborted.
    fn start(path: &Path) -> Option<Self> {
        let control = std::fs::File::options().read(true).write(true).open(path).ok()?;
        let dir = path.parent()?.to_path_buf();
        let message = format!(
            "tiermem: the cgroup stayed out of memory for {} s and the program's OOM guard did not give up: OOM killer back on\n",
            OOM_BACKSTOP_AFTER.as_secs()
        );
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = std::sync::Arc::clone(&done);
        let (ready, started) = std::sync::mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("tiermem-oom-backstop".into())
            .spawn(move || {
                use std::io::Write;
                let _ = tiermem_sys::cgroup::move_thread_to_parent_v1(&dir);
                let _ = tiermem_sys::cgroup::read_oom_control(&control);
                // The thread's move does not move its page faults: a new page of this process
                // (its stack too) is charged to the cgroup of the process, the limited one. A
                // first touch of a deeper stack page when it came to act left it waiting in the
                // OOM wait with the program (seen once, in a debug build). So the stack it will
                // use is touched now, and the write that turns the killer back on is made once
                // (the killer is on at this point, as the backstop starts only then).
                touch_stack();
                let _ = (&control).write_all(b"0");
                let _ = ready.send(());
                // From here nothing allocates: with the killer off, a new page of this process
                // in a full cgroup would wait like the program's.
                let mut out_since: Option<Instant> = None;
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    // Parked rather than asleep: the run's end unparks it at once.
                    std::thread::park_timeout(Duration::from_millis(100));
                    let Some(state) = tiermem_sys::cgroup::read_oom_control(&control) else { continue };
                    if !(state.killer_off && state.under_oom) {
                        out_since = None;
                        continue;
                    }
                    let since = *out_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= OOM_BACKSTOP_AFTER {
                        let _ = std::io::stderr().write_all(message.as_bytes());
                        if (&control).write_all(b"0").is_err() {
                            let _ = std::io::stderr().write_all(b"tiermem: cannot turn the OOM killer back on\n");
                        }
                        return;
                    }
                }
            })
            .ok()?;
        let _ = started.recv_timeout(Duration::from_secs(5));
        Some(Self { done, thread: Some(thread) })
    }
}

/// Stack the backstop's thread writes at start, far more than its loop and its last message
/// take (a debug build's frames included).
const BACKSTOP_STACK_BYTES: usize = 256 << 10;

/// Write [`BACKSTOP_STACK_BYTES`] of stack below the caller's frame, so later calls as deep
/// find their pages already there.
#[inline(never)]
fn touch_stack() {
    let mut pad = [0u8; BACKSTOP_STACK_BYTES];
    // The reference escapes, so the zeroing above is kept: every page of it is written.
    std::hint::black_box(&mut pad);
}

impl Drop for OomBackstop {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

/// Start of the name of a run's statistics directory, followed by the pid of its `tiermem run`.
const STATS_DIR_PREFIX: &str = "tiermem-stats-";

/// Longest wait, once the program has ended, for the processes of the run still ending.
const LATE_REPORTS_WAIT: Duration = Duration::from_secs(2);

/// Wait, at most `limit`, until no process image whose engine started (`PID-IMAGE.started` in
/// `dir`) is still alive without its final statistics. Helpers a program leaves behind end just
/// after it (Python's multiprocessing resource tracker and fork server, when the program's end
/// closes their pipe) and used to write their reports into a directory already gone (`cannot
/// write statistics ...: No such file or directory`), counted as unreported. One that lives on
/// (a daemon) costs the launcher `limit` once.
fn wait_for_late_reports(dir: &Path, limit: Duration) {
    let started = Instant::now();
    let final_report = |path: &Path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|report| report["final"] != false)
    };
    let alive = |pid: u32| {
        // A zombie has ended: its report, if any, is written.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next().map(str::to_owned))
            })
            .is_some_and(|state| state != "Z" && state != "X")
    };
    loop {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        let pending = entries.flatten().any(|entry| {
            let path = entry.path();
            let pid = path.file_stem().and_then(|s| s.to_str()).and_then(|s| s.split('-').next()?.parse::<u32>().ok());
            path.extension().is_some_and(|e| e == "started")
                && pid.is_some_and(alive)
                && !final_report(&path.with_extension("json"))
        });
        if !pending || started.elapsed() >= limit {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Hold `dir` locked (flock) while its run lasts: the lock goes with the process, however it
/// ends, which is what tells a later run that the directory is nobody's.
fn lock_stats_dir(dir: &Path) -> Option<std::fs::File> {
    let file = std::fs::File::open(dir).ok()?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive).ok()?;
    Some(file)
}

/// Remove the statistics directories in `tmp` that runs killed before they could remove their
/// own left behind (SIGKILL at a time limit, the OOM killer, a test's watchdog): those named
/// after a pid no process has any more and not locked by a live run (one in another pid
/// namespace sharing `tmp`), if they are this user's. A directory whose pid is alive again
/// (reused) stays until a later run finds it dead.
fn remove_stale_stats_dirs(tmp: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(tmp) else { return };
    let uid = rustix::process::getuid().as_raw();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(STATS_DIR_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if Path::new("/proc").join(pid.to_string()).exists() {
            continue;
        }
        // Not followed if a link: only a real directory of ours goes.
        let Ok(meta) = std::fs::symlink_metadata(entry.path()) else { continue };
        if !meta.is_dir() || meta.uid() != uid {
            continue;
        }
        let Ok(dir) = std::fs::File::open(entry.path()) else { continue };
        if rustix::fs::flock(&dir, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// `path` joined to the current directory if relative (symbolic links left as they are).
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).map_err(|e| Error::os(e, format!("making {} an absolute path", path.display())))
}

/// `tiermem run`: run `program` under the shim with `settings` and collect what it measured.
pub fn run(settings: RunSettings, program: &[OsString]) -> Result<RunOutcome> {
    let features = KernelFeatures::probe();
    if !features.userfaultfd {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("this kernel offers no userfaultfd to this user: {}", features.summary_lines().join("; ")),
        ));
    }
    let shim = locate_shim()?;
    // From before the first file or thread this run makes until it has cleaned up, the signals
    // it handles are blocked except while they can be passed on to the program: one arriving
    // before the program runs waits for it (and ends it) instead of ending `tiermem run` with
    // its statistics directory, or a device file the program made, left behind. Threads
    // started from here inherit the mask, so such signals only ever reach this thread.
    let blocked = SignalMask::block(&HANDLED_SIGNALS);
    let left_cgroup = if settings.respect_cgroup { leave_limited_v1_cgroup() } else { None };
    // Every path handed to the program absolute: its processes may run elsewhere (a shell that
    // changes directory, a daemon in `/`), where a relative device path made a file there that
    // the run never removed, as large as the device.
    let mut settings = settings;
    settings.device = match settings.device {
        tiermem_device::DeviceSpec::File(path) => tiermem_device::DeviceSpec::File(absolute(&path)?),
        other => other,
    };
    settings.trace_dir = settings.trace_dir.as_deref().map(absolute).transpose()?;
    let tmp = absolute(&std::env::temp_dir())?;
    remove_stale_stats_dirs(&tmp);
    let stats_dir = tempfile::Builder::new()
        .prefix(&format!("{STATS_DIR_PREFIX}{}-", std::process::id()))
        .tempdir_in(&tmp)
        .map_err(|e| Error::os(e, "creating a directory for statistics"))?;
    let _stats_dir_lock = lock_stats_dir(stats_dir.path());
    settings.stats_dir = Some(stats_dir.path().to_path_buf());
    let preload = match std::env::var_os("LD_PRELOAD") {
        Some(existing) if !existing.is_empty() => {
            let mut joined = shim.clone().into_os_string();
            joined.push(":");
            joined.push(existing);
            joined
        }
        _ => shim.clone().into_os_string(),
    };
    let vars = settings.to_vars();
    // The shim's OOM guard turns the cgroup's OOM killer off; put back what was there.
    let program_cgroup = left_cgroup.as_ref().map(|c| c.dir.clone()).or_else(cgroup::own_v1_memory_dir);
    let oom_control = program_cgroup.filter(|_| settings.oom_guard).and_then(|dir| v1_oom_control(&dir));
    let static_program = program.first().and_then(|p| resolve_program(p)).is_some_and(|p| statically_linked(&p));
    if static_program {
        eprintln!(
            "tiermem: warning: {} is statically linked: LD_PRELOAD cannot reach it, so none of its memory will be managed",
            program[0].to_string_lossy()
        );
    }
    // A device file the run creates holds nothing of use once it ends: it goes with the run
    // (a file named by mistake would otherwise stay behind, as large as the machine's memory).
    let created_device = match &settings.device {
        tiermem_device::DeviceSpec::File(path) if !path.exists() => Some(path.clone()),
        _ => None,
    };
    // The engines only listen to a kdamond monitoring physical memory: one is started for the
    // run when none exists, and stopped when it ends.
    // The engines mount tracefs if it is not; one that exec'ed cannot unmount it: done here.
    let tracefs_was_mounted = settings.engine.damon && tiermem_monitor::damon::tracefs_mounted();
    let own_kdamond = if settings.engine.damon {
        tiermem_monitor::damon::ensure_paddr_kdamond(
            tiermem_engine::damon::OWN_SAMPLE,
            tiermem_engine::damon::OWN_WINDOW,
        )
        .map_err(|e| e.context("the DAMON source (--damon; it needs root)"))?
    } else {
        None
    };
    // Not where the killer was off before the run: whoever turned it off handles the cgroup's
    // OOM, and `tiermem run` puts that setting back.
    let backstop = oom_control.as_ref().filter(|(_, was_off)| !was_off).and_then(|(path, _)| OomBackstop::start(path));
    let waited = spawn_and_wait(program, |command| {
        for (k, v) in &vars {
            command.env(k, v);
        }
        command.env("LD_PRELOAD", &preload);
        if let Some(cgroup) = &left_cgroup {
            let procs = cgroup.procs.clone();
            // SAFETY: the hook runs between fork and exec and only makes raw system calls
            // without allocating (see `join_cgroup_in_child`).
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(command, move || cgroup::join_cgroup_in_child(&procs))
            };
        }
    });
    // The program has ended: a Ctrl-C or SIGTERM now must not cut short what is put back below
    // (the OOM killer of a guarded cgroup, DAMON, tracefs, the device file, the statistics
    // directory). Ignored since the program ended, or from here if it could not be run.
    let (ending, cleaning_up) = match waited {
        Ok(w) => (Ok((w.ending, w.elapsed, w.peak_rss_bytes)), w.ignoring),
        Err(e) => (Err(e), ignore_signals()),
    };
    drop(backstop);
    if settings.engine.damon {
        drop(own_kdamond);
        // Those of processes that were killed or exec'ed before their exit could remove them.
        tiermem_monitor::damon::remove_abandoned_instances();
        tiermem_monitor::damon::unmount_tracefs_if_unused(!tracefs_was_mounted);
    }
    // Only if the shim changed it: a user who may not write the file (whose guard could not
    // arm) need not hear about it.
    if let Some((path, killer_was_off)) = oom_control.filter(|(path, was)| oom_killer_off(path) != Some(*was)) {
        if let Err(e) = std::fs::write(&path, if killer_was_off { "1" } else { "0" }) {
            crate::say(&format!("tiermem: cannot restore the OOM killer setting in {}: {e}", path.display()));
        }
    }
    wait_for_late_reports(stats_dir.path(), LATE_REPORTS_WAIT);
    let mut processes: Vec<serde_json::Value> = Vec::new();
    // Each process image whose engine started left `PID-IMAGE.started` (the shim's
    // `start_engine_threads`); those without a readable `PID-IMAGE.json` beside it never
    // reported (not even a snapshot).
    let mut started = Vec::new();
    let mut read = std::collections::HashSet::new();
    if let Ok(entries) = std::fs::read_dir(stats_dir.path()) {
        for entry in entries.flatten() {
            let path = entry.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("started") => started.push(path.with_extension("json")),
                Some("json") => {
                    let report = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str(&t).ok());
                    if let Some(report) = report {
                        read.insert(path);
                        processes.push(report);
                    }
                }
                _ => {}
            }
        }
    }
    let unreported = started.iter().filter(|report| !read.contains(*report)).count();
    // An image that replaced another by exec shares its pid and has a later key.
    processes.sort_by_key(|p| (p["pid"].as_u64(), p["image"].as_u64()));
    drop(_stats_dir_lock);
    drop(stats_dir);
    // After the statistics directory: a process of the run whose engine starts later (a
    // descendant that outlived the program) sees it gone and makes no named file of its own
    // where this one was (the preload shim's `start_engine_threads`).
    if let Some(path) = created_device {
        let _ = std::fs::remove_file(path);
    }
    // Nothing is left to put back. Before any exit: one passing on the program's signal
    // raises it here.
    drop(blocked);
    drop(cleaning_up);
    let (ending, elapsed, peak_rss_bytes) = ending?;
    Ok(RunOutcome {
        ending,
        elapsed,
        peak_rss_bytes,
        processes,
        unreported,
        settings,
        kernel_faults: features.kernel_faults,
        static_program,
    })
}

impl RunOutcome {
    /// The engine statistics of all managed processes added up.
    pub fn merged_engine_stats(&self) -> Option<StatsSnapshot> {
        let mut merged: Option<StatsSnapshot> = None;
        for p in &self.processes {
            let Ok(stats) = serde_json::from_value::<StatsSnapshot>(p["engine"].clone()) else { continue };
            match &mut merged {
                Some(m) => m.merge(&stats),
                None => merged = Some(stats),
            }
        }
        merged
    }

    fn sum(&self, key: &str) -> u64 {
        self.processes.iter().filter_map(|p| p[key].as_u64()).sum()
    }

    /// The one-screen summary printed at exit.
    pub fn summary(&self) -> String {
        use std::fmt::Write;
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let mut s = String::new();
        let ending = match self.ending {
            Ending::Exited(code) => format!("exited with status {code}"),
            Ending::Signaled(sig) => format!("was killed by signal {sig}"),
        };
        let _ = writeln!(s, "tiermem: the program {ending} after {:.2} s", self.elapsed.as_secs_f64());
        // The processes' engines start from the cgroup's limit where `--limit` was larger.
        let asked = self.settings.engine.limit_bytes;
        let budget = self.processes.iter().filter_map(|p| p["limit_bytes"].as_u64()).min().unwrap_or(asked).min(asked);
        let lowest = self.processes.iter().filter_map(|p| p["lowest_budget_bytes"].as_u64()).min();
        let file_room = self.processes.iter().filter_map(|p| p["peak_file_room_bytes"].as_u64()).max().unwrap_or(0);
        // Every process of the run watches the same cgroup, so each saw the same refaults.
        let file_refaults = self.processes.iter().filter_map(|p| p["file_refaults"].as_u64()).max().unwrap_or(0);
        let fault_refaults = self.processes.iter().filter_map(|p| p["file_fault_refaults"].as_u64()).max().unwrap_or(0);
        let _ = writeln!(
            s,
            "budget          {:.1} MiB{}{}  device {}  fault mode {}  dirty tracking {}  prefetch {}  replace {}",
            mib(budget),
            // Said only when it shows: a --limit the kernel rounded down to pages is the same.
            if format!("{:.1}", mib(budget)) != format!("{:.1}", mib(asked)) {
                format!(" (the cgroup's limit; --limit {:.1} MiB)", mib(asked))
            } else {
                String::new()
            },
            lowest
                .filter(|&l| l < budget)
                .map(|l| {
                    let files = (file_room > 0).then(|| {
                        format!(
                            "; up to {:.1} MiB left to the program's file pages after {file_refaults} refaults, \
                             {fault_refaults} of them read back by page faults",
                            mib(file_room)
                        )
                    });
                    format!(" (cgroup room: down to {:.1} MiB{})", mib(l), files.unwrap_or_default())
                })
                .unwrap_or_default(),
            self.settings.device,
            self.settings.engine.fault_mode,
            // What the engine picked (auto resolves to what the kernel offers).
            self.processes.iter().find_map(|p| p["dirty_tracking"].as_str()).unwrap_or("unknown"),
            self.settings.engine.prefetch,
            self.settings.engine.replace
        );
        let _ = writeln!(
            s,
            "managed         {}, {} allocations ({} reusing freed ones, {} mapped where the program said, {} pieces mapped again taken back, {} reservations made usable with mprotect), {:.1} MiB allocated, {:.1} MiB at peak; {} left unmanaged",
            processes(self.processes.len()),
            self.sum("managed_allocations"),
            self.sum("reused_allocations"),
            self.sum("fixed_allocations"),
            self.sum("pieces_taken_back"),
            self.sum("committed_allocations"),
            mib(self.sum("managed_bytes")),
            mib(self.processes.iter().filter_map(|p| p["peak_managed_bytes"].as_u64()).max().unwrap_or(0)),
            self.sum("fallback_allocations")
        );
        let _ = writeln!(
            s,
            "small heap      {} allocations below the threshold served from {:.1} MiB of managed chunks, {} evicted pages of freed blocks given up{}",
            self.sum("small_heap_allocations"),
            mib(self.sum("small_heap_bytes")),
            self.sum("small_heap_dead_pages_forgotten"),
            match (self.settings.small_heap, self.settings.engine.fault_mode) {
                (false, _) => " (off)",
                // The heap's chunks are regions the kernel may fault on, which a process limited
                // to user-mode faults cannot have: glibc keeps the small allocations then.
                (true, _) if self.sum("small_heap_bytes") == 0 && !self.kernel_faults => {
                    " (left to glibc: this user's userfaultfd takes user-mode faults only)"
                }
                (true, tiermem_engine::FaultMode::Sigbus) => " (faults there served by a handler thread)",
                _ => "",
            }
        );
        if self.settings.library_data {
            let _ = writeln!(
                s,
                "library data    {} runs of pages libraries wrote ({:.1} MiB, {} pages holding data) paged with the rest, {} given back when the program started a thread or called dlclose; {} segments left to the kernel",
                self.sum("library_data_runs"),
                mib(self.sum("library_data_bytes")),
                self.sum("library_data_pages_with_data"),
                self.sum("library_data_runs_given_back"),
                self.sum("library_data_segments_left"),
            );
        }
        let _ = writeln!(
            s,
            "stdio           {} streams used without locks while the program had one thread ({} locked again when it started threads){}",
            self.sum("stdio_streams_unlocked"),
            self.sum("stdio_streams_relocked"),
            if self.settings.single_thread_stdio { "" } else { " (off)" }
        );
        let _ = writeln!(
            s,
            "peak RSS        {:.1} MiB (the kernel's count for the largest process)",
            mib(self.peak_rss_bytes)
        );
        // What tiermem itself holds beside the budget (inside a cgroup, the budget makes room).
        let own = ["own_heap_peak_bytes", "io_buffer_bytes", "guard_ballast_bytes", "engine_reserve_size_bytes"]
            .map(|key| self.sum(key));
        if own.iter().any(|&b| b > 0) {
            let _ = writeln!(
                s,
                "own memory      {:.1} MiB: heap {:.1} allocated at most (page state, policy tables, slot bitmap, statistics; not all of it touched), I/O buffers {:.1}, OOM-guard ballast {:.1}, reserve {:.1}",
                mib(own.iter().sum()),
                mib(own[0]),
                mib(own[1]),
                mib(own[2]),
                mib(own[3])
            );
        }
        match self.merged_engine_stats() {
            Some(stats) => {
                let _ = writeln!(s, "fault path      {:.1} ms in total on faulting threads", stats.fault_path_ms());
                s.push_str(&stats.summary());
                let snapshots = self.snapshot_processes();
                if snapshots > 0 {
                    let _ = writeln!(
                        s,
                        "snapshot        {} ended without final statistics (a signal, exec or a raw exit_group): the counts above are from the last snapshot, written every {} s",
                        processes(snapshots),
                        SNAPSHOT_SECONDS
                    );
                }
                if self.unreported > 0 {
                    let _ = writeln!(
                        s,
                        "unreported      {} more managed memory but ended before writing statistics (a signal, exec or a raw exit_group within {} s of starting); the counts above leave them out",
                        processes(self.unreported),
                        SNAPSHOT_SECONDS
                    );
                }
            }
            // A process that ends by a signal, `exec` or a raw `exit_group` before its first
            // snapshot runs nothing that writes its statistics.
            None if self.unreported > 0 => {
                let _ = writeln!(
                    s,
                    "no statistics: {} managed memory but ended before writing them (a signal, exec or a raw exit_group within {} s of starting), so the counts above are unknown, not zero",
                    processes(self.unreported),
                    SNAPSHOT_SECONDS
                );
            }
            // Each process writes its statistics as it exits; one killed outright (SIGKILL,
            // the OOM killer) writes none, which says nothing about what it allocated.
            None if matches!(self.ending, Ending::Signaled(_)) => s.push_str(
                "no statistics: the program was killed before its processes could write them (so the counts above are unknown, not zero)\n",
            ),
            None if self.static_program => s.push_str(
                "no managed memory: the program is statically linked, so the preload that manages memory never loaded\n",
            ),
            None => s.push_str("no managed memory: the program made no allocation above the threshold\n"),
        }
        s
    }

    /// Everything, for `--stats-json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "exit": match self.ending { Ending::Exited(c) => serde_json::json!({"status": c}), Ending::Signaled(s) => serde_json::json!({"signal": s}) },
            "elapsed_s": self.elapsed.as_secs_f64(),
            "peak_rss_bytes": self.peak_rss_bytes,
            "limit_bytes": self.settings.engine.limit_bytes,
            "footprint_bytes": self.settings.footprint,
            "device": self.settings.device.to_string(),
            "engine_config": self.settings.engine,
            "threshold_bytes": self.settings.threshold,
            "merged": self.merged_engine_stats(),
            "managed_allocations": self.sum("managed_allocations"),
            "fallback_allocations": self.sum("fallback_allocations"),
            "reused_allocations": self.sum("reused_allocations"),
            "fixed_allocations": self.sum("fixed_allocations"),
            "pieces_taken_back": self.sum("pieces_taken_back"),
            "committed_allocations": self.sum("committed_allocations"),
            "small_heap_allocations": self.sum("small_heap_allocations"),
            "small_heap_bytes": self.sum("small_heap_bytes"),
            "small_heap_dead_pages_forgotten": self.sum("small_heap_dead_pages_forgotten"),
            "library_data_runs": self.sum("library_data_runs"),
            "library_data_bytes": self.sum("library_data_bytes"),
            "library_data_pages_with_data": self.sum("library_data_pages_with_data"),
            "library_data_segments_left": self.sum("library_data_segments_left"),
            "library_data_runs_given_back": self.sum("library_data_runs_given_back"),
            "stdio_streams_unlocked": self.sum("stdio_streams_unlocked"),
            "stdio_streams_relocked": self.sum("stdio_streams_relocked"),
            "processes": self.processes,
            "unreported_processes": self.unreported,
            "snapshot_processes": self.snapshot_processes(),
        })
    }

    /// Processes whose statistics are a snapshot written while they ran, not their final report.
    pub fn snapshot_processes(&self) -> usize {
        self.processes.iter().filter(|p| p["final"] == false).count()
    }
}

/// How often a managed process writes a snapshot of its statistics, in seconds.
const SNAPSHOT_SECONDS: u64 = tiermem_engine::STATISTICS_SNAPSHOT_EVERY.as_secs();

/// "1 process", "2 processes".
fn processes(n: usize) -> String {
    if n == 1 {
        "1 process".into()
    } else {
        format!("{n} processes")
    }
}

/// `tiermem trace record`: run `program` like `tiermem run`, with every managed process
/// recording its faults; the first process's trace goes to `output`, any others' to
/// `output.<pid>`. Returns the run and the trace files written.
pub fn record_trace(settings: RunSettings, program: &[OsString], output: &Path) -> Result<(RunOutcome, Vec<PathBuf>)> {
    let traces = tempfile::Builder::new()
        .prefix("tiermem-traces-")
        .tempdir()
        .map_err(|e| Error::os(e, "creating a directory for traces"))?;
    let mut settings = settings;
    settings.trace_dir = Some(traces.path().to_path_buf());
    let outcome = run(settings, program)?;
    // Named `PID-IMAGE.trace` (IMAGE in hex: a later exec of the same pid, a larger one).
    let mut recorded: Vec<(u32, u64, PathBuf)> = std::fs::read_dir(traces.path())
        .map_err(|e| Error::os(e, "reading the trace directory"))?
        .flatten()
        .filter_map(|e| {
            let stem = e.path().file_stem()?.to_str()?.to_owned();
            let (pid, image) = stem.split_once('-')?;
            Some((pid.parse().ok()?, u64::from_str_radix(image, 16).ok()?, e.path()))
        })
        .collect();
    recorded.sort();
    // A process killed before it flushed its trace left an empty file: nothing to replay.
    recorded.retain(|(pid, _, path)| {
        let empty = std::fs::metadata(path).map_or(true, |m| m.len() == 0);
        if empty {
            crate::say(&format!(
                "tiermem: process {pid} ended before its trace was written (killed?); no trace for it"
            ));
        }
        !empty
    });
    let mut written = Vec::new();
    for (i, (pid, image, path)) in recorded.iter().enumerate() {
        // The n-th image of a pid (n > 1: it was started by exec) gets `-n` after the pid.
        let nth = recorded[..i].iter().filter(|(p, _, _)| p == pid).count() + 1;
        let target = match (i, nth) {
            (0, _) => output.to_path_buf(),
            (_, 1) => PathBuf::from(format!("{}.{pid}", output.display())),
            _ => PathBuf::from(format!("{}.{pid}-{nth}", output.display())),
        };
        std::fs::copy(path, &target).map_err(|e| Error::os(e, format!("writing the trace {}", target.display())))?;
        let about = recording_description(&outcome, *pid, *image, program);
        let about_path = sidecar_path(&target);
        std::fs::write(&about_path, serde_json::to_vec_pretty(&about).unwrap_or_default())
            .map_err(|e| Error::os(e, format!("writing {}", about_path.display())))?;
        written.push(target);
    }
    Ok((outcome, written))
}

/// Marks a trace's sidecar as the description of a recorded fault trace.
pub const FAULT_TRACE_KIND: &str = "tiermem fault trace";

/// Where the description of a recorded trace goes: `TRACE.json` next to it.
pub fn sidecar_path(trace: &Path) -> PathBuf {
    let mut name = trace.as_os_str().to_owned();
    name.push(".json");
    PathBuf::from(name)
}

/// What `tiermem sim` needs to know about a recorded trace: it holds the faults of one live run
/// under these policies and this budget, not every access (pages the run kept resident never
/// appear), so it replays faithfully only with that run's policies at no more local memory
/// than the run kept resident (docs/policies.md, *Replaying recorded fault traces*).
fn recording_description(outcome: &RunOutcome, pid: u32, image: u64, program: &[OsString]) -> serde_json::Value {
    let engine = &outcome.settings.engine;
    let process = outcome
        .processes
        .iter()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)) && p["image"].as_u64() == Some(image));
    let pages = |bytes: Option<u64>| bytes.map(|b| b / tiermem_sys::PAGE_SIZE as u64);
    serde_json::json!({
        "kind": FAULT_TRACE_KIND,
        "pid": pid,
        "program": program.iter().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>(),
        "replace": engine.replace,
        "prefetch": engine.prefetch,
        "budget_pages": pages(Some(engine.limit_bytes)),
        "lowest_budget_pages": pages(process.and_then(|p| p["lowest_budget_bytes"].as_u64())),
        "evict_watermark": engine.evict_watermark,
        "prefetch_room": engine.prefetch_room,
        "critical_faults": process.and_then(|p| p["engine"]["critical_reads"].as_u64()),
        "peak_resident_pages": process.and_then(|p| p["engine"]["peak_resident_pages"].as_u64()),
    })
}

/// Exit the way the program did: the same status, or the same signal.
pub fn exit_like(ending: Ending) -> ! {
    match ending {
        Ending::Exited(code) => std::process::exit(code),
        Ending::Signaled(sig) => {
            // No core of our own: the program's (if it dumped one) is the one that matters, and
            // a second would replace it where the core pattern names cores by program or not at
            // all. The parent still sees the signal.
            // Not dumpable: that holds for a core pattern piping to a handler too, where the
            // kernel ignores the core size limit.
            // SAFETY: PR_SET_DUMPABLE takes an integer and no pointer.
            unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
            // SAFETY: the default disposition for the signal the program died of...
            unsafe { libc::signal(sig, libc::SIG_DFL) };
            // SAFETY: ...then that signal, so our parent sees the same ending.
            unsafe { libc::raise(sig) };
            std::process::exit(128 + sig)
        }
    }
}
