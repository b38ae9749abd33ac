//! How faults reach the engine: handler threads reading the userfaultfd, or a SIGBUS handler
//! running on the faulting thread itself.

use std::sync::atomic::{AtomicPtr, Ordering};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::io::Errno;
use tiermem_sys::guarded_fd::Guarded;
use tiermem_sys::uffd::{Event, Uffd};
use tiermem_sys::{Error, ErrorKind, Result, PAGE_SIZE};

use crate::engine::Shared;
use crate::fault::{handle_fault, Outcome};

/// How an idle handler thread waits for the next fault.
pub(crate) struct FaultWait {
    /// This thread's epoll set, holding the userfaultfd as an exclusive waiter (a fault wakes one
    /// idle handler thread; with plain poll() every idle one woke for every fault), and the stop
    /// event as a shared one (all wake). None if epoll is unavailable: poll() then.
    epoll: Option<Guarded<rustix::fd::OwnedFd>>,
}

impl FaultWait {
    /// Made by the thread that starts the handler (its descriptor is then made while the
    /// engine starts, see the preload's descriptor room).
    pub(crate) fn new(shared: &Shared, uffd: &Uffd) -> Self {
        use rustix::event::epoll;
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).ok().map(Guarded::new).filter(|set| {
            epoll::add(set, uffd, epoll::EventData::new_u64(0), epoll::EventFlags::IN | epoll::EventFlags::EXCLUSIVE)
                .is_ok()
                && epoll::add(set, &shared.stop_event, epoll::EventData::new_u64(1), epoll::EventFlags::IN).is_ok()
        });
        Self { epoll }
    }

    fn wait(&self, shared: &Shared, uffd: &Uffd) {
        match &self.epoll {
            Some(set) => {
                let mut events = [std::mem::MaybeUninit::<rustix::event::epoll::Event>::uninit(); 2];
                let _ = rustix::event::epoll::wait(set, &mut events, None);
            }
            None => {
                let mut fds = [PollFd::new(uffd, PollFlags::IN), PollFd::new(&shared.stop_event, PollFlags::IN)];
                let _ = poll(&mut fds, None);
            }
        }
    }
}

/// Reads fault messages from `uffd` and resolves them until shutdown.
pub(crate) fn handler_thread(shared: &Shared, uffd: &Uffd, lane: usize, idle: FaultWait) {
    let spin = std::time::Duration::from_micros(u64::from(shared.config.handler_spin_us));
    let mut last_fault = std::time::Instant::now();
    loop {
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        match uffd.read_event() {
            Ok(Some(Event::PageFault { addr, write, wp, tid })) => {
                if !spin.is_zero() {
                    last_fault = std::time::Instant::now();
                }
                match handle_fault(shared, addr, write || wp, !wp, lane, true) {
                    Outcome::Resolved => {}
                    Outcome::NotOurs | Outcome::Retry | Outcome::NoRoomYet => {
                        // A region going away under a faulting thread, or a page being mapped
                        // over: let it retry and find out.
                        let _ = uffd.wake((addr & !(PAGE_SIZE - 1)) as *mut u8, PAGE_SIZE);
                    }
                    Outcome::Failed(e) => fail_faulting_thread(shared, addr, tid, e),
                }
            }
            Ok(Some(_)) => {}
            // Soon after a fault, poll instead of sleeping: the next one is likely on its way.
            Ok(None) if !spin.is_zero() && last_fault.elapsed() < spin => std::hint::spin_loop(),
            Ok(None) => idle.wait(shared, uffd),
            Err(Errno::INTR) => {}
            Err(e) => {
                tracing::error!(errno = %e, "reading the userfaultfd failed; fault handler stops");
                return;
            }
        }
    }
}

/// The page cannot be delivered. Like the kernel after a swap-in I/O error, kill the faulting
/// thread with SIGBUS rather than hand it wrong data.
#[allow(clippy::multiple_unsafe_ops_per_block)] // one signal sent one of two ways
fn fail_faulting_thread(shared: &Shared, addr: usize, tid: u32, e: Errno) {
    report_failure(shared, addr, e);
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    // SAFETY: plain signal delivery to a thread of this process.
    unsafe {
        if tid != 0 {
            libc::syscall(libc::SYS_tgkill, pid, tid as libc::c_int, libc::SIGBUS);
        } else {
            libc::kill(pid, libc::SIGBUS);
        }
    }
}

/// Write a message to stderr without allocating (usable in a signal handler). With the budget
/// and what the engine held of it: a copy refused for want of memory with the budget at its
/// floor means the rest of the cgroup was full of memory tiermem does not manage.
fn report_failure(shared: &Shared, addr: usize, e: Errno) {
    let mut msg = [0u8; 240];
    let mut w = Writer { buf: &mut msg, len: 0 };
    let (resident, budget) = (shared.resident() * 4, shared.limit_pages() * 4);
    let _ = std::fmt::Write::write_fmt(
        &mut w,
        format_args!(
            "tiermem: cannot bring in page at {addr:#x}: errno {} ({resident} KiB of managed pages in memory, budget {budget} KiB); raising SIGBUS\n",
            // The number: an errno's text comes through std's io::Error, which allocates, and
            // this runs in the SIGBUS handler, maybe over code holding malloc's lock.
            e.raw_os_error()
        ),
    );
    let len = w.len;
    tiermem_sys::messages::write(&msg[..len]);
}

struct Writer<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl std::fmt::Write for Writer<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

pub(crate) fn wake_handler_threads(shared: &Shared) {
    let _ = rustix::io::write(&shared.stop_event, &1u64.to_ne_bytes());
}

/// The engine whose regions the SIGBUS handler serves (one per process).
static SIGBUS_ENGINE: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
/// The SIGBUS action in place before ours, to chain to for faults that are not ours.
static PREVIOUS_ACTION: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
/// The default action, for PREVIOUS_ACTION once a one-shot (SA_RESETHAND) handler has run.
// SAFETY: a zeroed sigaction is SIG_DFL with an empty mask and no flags.
static RESET_TO_DEFAULT: libc::sigaction = unsafe { std::mem::zeroed() };

thread_local! {
    static LANE_HINT: std::cell::Cell<u32> = const { std::cell::Cell::new(u32::MAX) };
}

fn lane_hint() -> usize {
    LANE_HINT.with(|h| {
        if h.get() == u32::MAX {
            h.set(rustix::thread::gettid().as_raw_nonzero().get() as u32);
        }
        h.get() as usize
    })
}

#[allow(clippy::multiple_unsafe_ops_per_block)] // FFI reads of kernel-provided signal structs
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: errno is thread-local; saving and restoring it keeps the interrupted code's view.
    let saved_errno = unsafe { *libc::__errno_location() };
    let engine = SIGBUS_ENGINE.load(Ordering::Acquire);
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    if !engine.is_null() && code == libc::BUS_ADRERR {
        // SAFETY: the kernel passes the interrupted context; on x86-64 REG_ERR holds the page
        // fault error code, whose bit 1 is set for writes.
        let write =
            unsafe { (*(context as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_ERR as usize] & 2 != 0 };
        // SAFETY: the pointer is published only while the engine is alive (uninstall clears it
        // before the engine is dropped).
        let shared = unsafe { &*engine };
        // Read only when indirect prefetching wants to know whether this fault read critically.
        let reads_before =
            shared.indirect.as_ref().map(|_| shared.stats.counters.critical_reads.load(Ordering::Relaxed));
        let outcome = handle_fault(shared, addr, write, true, lane_hint(), false);
        if let (Outcome::Resolved, Some(indirect), Some(reads_before)) = (&outcome, &shared.indirect, reads_before) {
            // Another thread's critical read may be counted in between: a search more, no harm.
            let critical = shared.stats.counters.critical_reads.load(Ordering::Relaxed) != reads_before;
            // SAFETY: as above; the general registers of the interrupted context.
            let regs = unsafe { (*(context as *const libc::ucontext_t)).uc_mcontext.gregs };
            crate::indirect::after_fault(shared, indirect, addr, &regs.map(|r| r as u64), critical);
        }
        match outcome {
            // Retry: the access runs again and meets the program's new mapping (or, with no
            // room yet, faults again once this fault's lock of the region table is let go).
            Outcome::Resolved | Outcome::Retry | Outcome::NoRoomYet => {
                // SAFETY: as above.
                unsafe { *libc::__errno_location() = saved_errno };
                return;
            }
            Outcome::NotOurs => {}
            Outcome::Failed(e) => report_failure(shared, addr, e),
        }
    }
    // The program's handler (or the default action) sees errno as the interrupted code left it,
    // whatever the engine's calls above did to it.
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved_errno };
    chain_to_previous(sig, info, context);
}

/// The kernel's `struct sigaction` for rt_sigaction(2) on x86-64 (not glibc's layout).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

#[allow(clippy::multiple_unsafe_ops_per_block)] // calling the saved handler is one FFI act
fn chain_to_previous(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let prev = loop {
        let prev = PREVIOUS_ACTION.load(Ordering::Acquire);
        // SAFETY: prev is null or points to a leaked, never freed sigaction.
        if prev.is_null() || unsafe { (*prev).sa_flags } & libc::SA_RESETHAND == 0 {
            break prev;
        }
        // A one-shot handler: the kernel puts the default action back as it delivers to it,
        // so it runs for one delivery, the one whose thread takes it out here; a thread that
        // finds it gone (or replaced meanwhile) takes what is there now.
        let reset = std::ptr::addr_of!(RESET_TO_DEFAULT).cast_mut();
        if PREVIOUS_ACTION.compare_exchange(prev, reset, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            break prev;
        }
    };
    // SAFETY: prev is null or points to a leaked, never freed sigaction.
    let handler = if prev.is_null() { libc::SIG_DFL } else { unsafe { (*prev).sa_sigaction } };
    if handler == libc::SIG_DFL || handler == libc::SIG_IGN {
        // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
        let code = unsafe { (*info).si_code };
        // kill, tkill, sigqueue, or an asynchronous machine-check report: nothing re-executes.
        let sent = code <= 0 || code == libc::BUS_MCEERR_AO;
        if sent && handler == libc::SIG_IGN {
            return; // ignored, as it would have been without tiermem
        }
        // The default action, as without tiermem: set by the raw system call, since `signal`
        // and `sigaction` here may be the preload's own wrappers, which would only record it
        // as the program's wish and leave this handler in place (a faulting access would then
        // come back here forever). A fault's access re-executes on return and dies of it; a
        // sent signal does not re-execute, so it is raised again: blocked while this handler
        // runs, it is delivered, with the default action, as the handler returns.
        let default = KernelSigaction { handler: libc::SIG_DFL, flags: 0, restorer: 0, mask: 0 };
        // SAFETY: rt_sigaction with a valid kernel sigaction for this signal and the kernel's
        // sigset size; no old action is asked for.
        unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, &default, std::ptr::null_mut::<KernelSigaction>(), 8) };
        if sent {
            // SAFETY: raising a signal on this thread (tgkill is async-signal-safe).
            unsafe {
                libc::syscall(libc::SYS_tgkill, libc::getpid(), rustix::thread::gettid().as_raw_nonzero().get(), sig)
            };
        }
        return;
    }
    // SAFETY: non-null and not a default or ignore action: a leaked, never freed sigaction
    // saved at install time or put there by `replace_chained_sigbus_action`.
    let action = unsafe { &*prev };
    // The handler runs with the signals blocked the kernel would have blocked had it been
    // delivered to directly (the interrupted code's and its sa_mask), not with this handler's:
    // a handler that leaves by longjmp keeps that mask. Except SIGBUS itself, even without
    // SA_NODEFER: the handler may touch evicted memory like any code of the program's (the
    // preload keeps SIGBUS out of every handler's mask for the same reason). As the kernel's
    // 64-bit masks, set by the raw system call: glibc's calls would drop its own internal
    // signals, and in a program under the preload `pthread_sigmask` is the shim's wrapper,
    // which may look up the real one (dlsym) on its first call.
    // SAFETY: the kernel passes the interrupted context; it wrote the interrupted mask as the
    // first 8 bytes of `uc_sigmask` (restored when this handler returns), and the first word of
    // glibc's sigset_t holds signals 1 to 64 as the kernel's mask does.
    let (interrupted, own) = unsafe {
        let uc = context as *const libc::ucontext_t;
        (
            std::ptr::read_unaligned(std::ptr::addr_of!((*uc).uc_sigmask).cast::<u64>()),
            std::ptr::read_unaligned(std::ptr::addr_of!(action.sa_mask).cast::<u64>()),
        )
    };
    let mask: u64 = (interrupted | own) & !(1u64 << (libc::SIGBUS - 1));
    // SAFETY: rt_sigprocmask with a valid 8-byte kernel mask and no old mask asked for.
    unsafe { libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &mask, std::ptr::null_mut::<u64>(), 8) };
    // SAFETY: the previous handler was installed by this process for this signal; it is called
    // with the arguments its flags ask for.
    unsafe {
        if action.sa_flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(handler);
            f(sig, info, context);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
            f(sig);
        }
    }
}

pub(crate) fn install_sigbus(shared: &std::sync::Arc<Shared>) -> Result<()> {
    let ptr = std::sync::Arc::as_ptr(shared) as *mut Shared;
    // What the chained action is before the engine is published: from then on a sigaction of
    // the program's (through the preload) replaces it instead of reaching the kernel.
    let chained_before = PREVIOUS_ACTION.load(Ordering::Acquire);
    if SIGBUS_ENGINE.compare_exchange(std::ptr::null_mut(), ptr, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            "another engine in this process already uses fault mode sigbus",
        ));
    }
    // SAFETY: a zeroed sigaction is a valid starting point; we fill handler, mask and flags.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as usize;
    // No SA_ONSTACK: the alternate stacks runtimes install (Rust's is a few KiB, for stack
    // overflow reports) are far too small for resolving a fault, which may evict a batch.
    action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
    // Other signals wait while a fault is resolved: a handler of the program's run in the middle
    // of it that touched evicted memory would raise SIGBUS while it is blocked, which kills.
    // Faults the handler itself could raise stay deliverable (blocked, they would kill too).
    // SAFETY: sa_mask is a valid sigset_t to fill.
    unsafe { libc::sigfillset(&mut action.sa_mask) };
    for synchronous in [libc::SIGSEGV, libc::SIGILL, libc::SIGFPE, libc::SIGTRAP, libc::SIGSYS] {
        // SAFETY: as above; the signal is a valid one.
        unsafe { libc::sigdelset(&mut action.sa_mask, synchronous) };
    }
    let previous = Box::into_raw(Box::new(
        // SAFETY: zeroed sigaction, filled in by the kernel below.
        unsafe { std::mem::zeroed::<libc::sigaction>() },
    ));
    // SAFETY: both pointers are valid sigaction structs.
    let rc = unsafe { libc::sigaction(libc::SIGBUS, &action, previous) };
    if rc != 0 {
        SIGBUS_ENGINE.store(std::ptr::null_mut(), Ordering::Release);
        return Err(Error::os(std::io::Error::last_os_error(), "installing the SIGBUS handler"));
    }
    // The action replaced is leaked, never freed, as every one stored there is: a handler that
    // started under an engine before may still be reading it, and so may a concurrent
    // `replace_chained_sigbus_action` (one small box per install).
    if PREVIOUS_ACTION.compare_exchange(chained_before, previous, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // The program set its action while ours went in: its action is the later one.
        // SAFETY: allocated above and never published.
        drop(unsafe { Box::from_raw(previous) });
    }
    Ok(())
}

pub(crate) fn uninstall_sigbus(shared: &Shared) {
    let ptr = shared as *const Shared as *mut Shared;
    if SIGBUS_ENGINE.compare_exchange(ptr, std::ptr::null_mut(), Ordering::AcqRel, Ordering::Acquire).is_ok() {
        let prev = PREVIOUS_ACTION.load(Ordering::Acquire);
        if !prev.is_null() {
            // SAFETY: restoring the action saved at install time.
            unsafe { libc::sigaction(libc::SIGBUS, prev, std::ptr::null_mut()) };
        }
    }
}

/// In a forked child: stop serving SIGBUS (the child's memory is no longer registered, and the
/// engine's threads stayed in the parent) and restore the action in place before the engine's.
pub(crate) fn detach_sigbus_in_child(shared: &Shared) {
    uninstall_sigbus(shared);
}

/// Replace the action the engine's SIGBUS handler chains to for faults that are not its own,
/// for a program that installs its own SIGBUS handler while the engine runs in sigbus mode (the
/// engine's handler must stay first). Writes the action it replaced to `old`. Returns false,
/// changing nothing, when no engine in this process is in sigbus mode.
pub fn replace_chained_sigbus_action(new: Option<&libc::sigaction>, old: Option<&mut libc::sigaction>) -> bool {
    if SIGBUS_ENGINE.load(Ordering::Acquire).is_null() {
        return false;
    }
    let current = PREVIOUS_ACTION.load(Ordering::Acquire);
    if let Some(old) = old {
        if current.is_null() {
            // SAFETY: a zeroed sigaction is SIG_DFL with an empty mask and no flags.
            *old = unsafe { std::mem::zeroed() };
        } else {
            // SAFETY: non-null PREVIOUS_ACTION values point to leaked, never-freed sigactions.
            *old = unsafe { *current };
        }
    }
    if let Some(new) = new {
        // Leaked on purpose: a handler on another thread may be reading the old one right now.
        PREVIOUS_ACTION.store(Box::into_raw(Box::new(*new)), Ordering::Release);
    }
    true
}

/// Whether `action` installs the engine's own SIGBUS handler (which an interposed sigaction must
/// let through).
pub fn is_engine_sigbus_action(action: &libc::sigaction) -> bool {
    action.sa_sigaction == on_sigbus as *const () as usize
}
