//! Forks glibc's `fork()` does not make, for which it runs no atfork handlers: `_Fork`,
//! `clone()` without CLONE_VM, and the fork, clone and clone3 system calls by number (from
//! [`crate::syscall`]). Their children get a copy of the memory as a fork child does, so
//! tiermem's fork handlers (see `runtime`) must run around them too: without them the child
//! started without the managed pages the engine had evicted (it died of SIGSEGV touching them)
//! and with the engine's locks as other threads held them.
//!
//! The handlers take locks (the small heap's, the registry's, the engine's), so `_Fork` from a
//! signal handler that interrupted tiermem's own allocator would wait on itself, as glibc's
//! `fork()` with atfork handlers would.

use std::ffi::c_void;

use libc::c_long;

use crate::runtime::{
    after_fork_in_child, after_fork_in_parent, before_fork, errno, fork_cannot_fit, in_vfork_child, note_own_pid,
    set_errno,
};

/// Clone flags with which a child gets no handlers and the call goes straight to the kernel or
/// the C library: the child shares the memory and the engine (CLONE_VM: threads, vfork-like
/// children) or the descriptor table (CLONE_FILES: the fork handshake's pipe would be shared),
/// would run its handler with the caller's thread pointer (CLONE_SETTLS), or the kernel would
/// touch the caller's memory while the handlers hold the engine, which an evicted page there
/// would wait for (CLONE_PARENT_SETTID and CLONE_PIDFD write to it in the parent,
/// CLONE_CHILD_SETTID in the child before its copy overwrites that page, and with CLONE_VFORK
/// the parent waits inside the call, holding everything, until the child execs or exits).
pub(crate) const CLONE_WITHOUT_HANDLERS: u64 = (libc::CLONE_VM
    | libc::CLONE_FILES
    | libc::CLONE_SETTLS
    | libc::CLONE_PARENT_SETTID
    | libc::CLONE_PIDFD
    | libc::CLONE_CHILD_SETTID
    | libc::CLONE_VFORK) as u64;

/// Run the fork handlers around `fork`, which makes a child with a copy of the memory that goes
/// on from here, on this stack. Returns what `fork` returned, with its errno.
pub(crate) fn around(fork: impl FnOnce() -> c_long) -> c_long {
    // A vfork child shares its parent's memory and engine, and the parent is stopped, maybe
    // holding the locks the handlers take: nothing to copy, nothing to wait for.
    if in_vfork_child() {
        return fork();
    }
    if fork_cannot_fit() {
        set_errno(libc::ENOMEM);
        return -1;
    }
    before_fork();
    let pid = fork();
    let errno = errno();
    if pid == 0 {
        note_own_pid();
        after_fork_in_child();
    } else {
        after_fork_in_parent();
    }
    set_errno(errno);
    pid
}

/// glibc's `fork()`, which runs tiermem's handlers itself (registered with pthread_atfork):
/// here only the check that the child's copy can fit ([`fork_cannot_fit`]), which no atfork
/// handler can make, since none can make fork fail.
///
/// # Safety
/// The C contract of fork.
#[no_mangle]
pub unsafe extern "C" fn fork() -> libc::pid_t {
    let real = crate::alloc::real!("fork", unsafe extern "C" fn() -> libc::pid_t);
    if fork_cannot_fit() {
        set_errno(libc::ENOMEM);
        return -1;
    }
    // SAFETY: the C library's fork, called as the caller called ours.
    unsafe { real() }
}

/// glibc's `_Fork` (2.34 and later): fork without the atfork handlers, for callers that must
/// not run them. tiermem's run all the same. glibc's own `fork()` calls its `_Fork` directly,
/// not this.
///
/// # Safety
/// The C contract of _Fork.
#[no_mangle]
pub unsafe extern "C" fn _Fork() -> libc::pid_t {
    type ForkFn = unsafe extern "C" fn() -> libc::pid_t;
    static REAL: std::sync::OnceLock<Option<ForkFn>> = std::sync::OnceLock::new();
    let real = *REAL.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the definition past ours.
        let address = unsafe { libc::dlsym(libc::RTLD_NEXT, c"_Fork".as_ptr()) };
        // SAFETY: glibc's _Fork has this C signature.
        (!address.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, ForkFn>(address) })
    });
    around(|| match real {
        // SAFETY: the C library's _Fork, called as the caller called ours.
        Some(real) => c_long::from(unsafe { real() }),
        // A C library without one (before glibc 2.34): what it does, by number.
        None => {
            let (flags, none) = (c_long::from(libc::SIGCHLD), 0 as c_long);
            crate::io::sys!(libc::SYS_clone, flags, none, none, none, none) as c_long
        }
    }) as libc::pid_t
}

type CloneStart = extern "C" fn(*mut c_void) -> i32;
type CloneFn = unsafe extern "C" fn(
    Option<CloneStart>,
    *mut c_void,
    i32,
    *mut c_void,
    *mut libc::pid_t,
    *mut c_void,
    *mut libc::pid_t,
) -> i32;

/// Stack the child of [`clone`] runs its fork handler on before it moves to the caller's (a
/// guard page below it).
const HANDLER_STACK: usize = 256 << 10;

/// What the child of [`clone`] runs once its handler is done. It sits at the top of the handler
/// stack, unmanaged: on the caller's stack (managed memory, maybe) its page could be evicted
/// after it was written, and the child would read zeros there before its handler copied the
/// page back.
#[repr(C, align(16))]
struct CloneChild {
    start: CloneStart,
    arg: *mut c_void,
    /// The caller's stack, 16-byte aligned.
    stack: usize,
}

/// glibc's `clone()`. Without CLONE_VM the child gets a copy of the memory, as fork() gives: the
/// handlers run around it. The child starts on a stack of tiermem's (unmanaged: glibc on x86-64
/// writes the function and argument there before the call, which on an evicted page of a
/// managed stack would fault while the handlers hold the engine), runs its handler there, then
/// calls the caller's function on the caller's stack and exits with its result, as glibc's
/// child does. Straight to the C library: the flags of [`CLONE_WITHOUT_HANDLERS`], bad
/// arguments (the C library's error), architectures without the stack switch below. The
/// optional arguments are passed on as they came, as `syscall` does with its.
///
/// # Safety
/// The C contract of clone.
#[no_mangle]
pub unsafe extern "C" fn clone(
    start: Option<CloneStart>,
    stack: *mut c_void,
    flags: i32,
    arg: *mut c_void,
    parent_tid: *mut libc::pid_t,
    tls: *mut c_void,
    child_tid: *mut libc::pid_t,
) -> i32 {
    let real = crate::alloc::real!("clone", CloneFn);
    if !in_vfork_child() {
        crate::stdio::clone_coming(u64::from(flags as u32));
    }
    // SAFETY: the C library's clone, called as the caller called ours.
    let straight = || unsafe { real(start, stack, flags, arg, parent_tid, tls, child_tid) };
    let served = flags as u32 as u64 & CLONE_WITHOUT_HANDLERS == 0 && !stack.is_null() && STACK_SWITCH;
    let Some(start) = start.filter(|_| served) else {
        return straight();
    };
    if in_vfork_child() {
        return straight();
    }
    let Ok(own) = HandlerStack::new(CloneChild { start, arg, stack: stack as usize & !15 }) else {
        set_errno(libc::ENOMEM);
        return -1;
    };
    let pid = around(|| {
        // SAFETY: as above, with tiermem's start function, stack and argument (the CloneChild at
        // the stack's top, which the child has its own copy of).
        c_long::from(unsafe {
            real(Some(clone_child_start), own.top(), flags, own.child(), parent_tid, tls, child_tid)
        })
    });
    // Only the parent gets here: the child starts in `clone_child_start`, on the handler stack.
    pid as i32
}

extern "C" fn clone_child_start(child: *mut c_void) -> i32 {
    // SAFETY: `clone` passed the CloneChild at the top of the handler stack, which this child
    // has its own copy of at the same address (the memory was copied, not shared), in memory
    // tiermem does not manage.
    let CloneChild { start, arg, stack } = unsafe { child.cast::<CloneChild>().read() };
    note_own_pid();
    after_fork_in_child();
    // SAFETY: the caller's function, argument and stack, as it gave them to clone.
    unsafe { call_on_stack_and_exit(start, arg, stack) }
}

/// An anonymous mapping made past the shim (never managed): a guard page, then the stack, with
/// the CloneChild at its top. Unmapped when dropped; the child has its own copy.
struct HandlerStack(*mut c_void);

impl HandlerStack {
    const LEN: usize = tiermem_sys::PAGE_SIZE + HANDLER_STACK;

    fn new(child: CloneChild) -> rustix::io::Result<Self> {
        use rustix::mm::{mmap_anonymous, mprotect, MapFlags, MprotectFlags, ProtFlags};
        let (rw, flags) = (ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE | MapFlags::STACK);
        // SAFETY: a new private anonymous mapping at an address the kernel chooses.
        let stack = Self(unsafe { mmap_anonymous(std::ptr::null_mut(), Self::LEN, rw, flags) }?);
        // SAFETY: the lowest page of our own new mapping.
        unsafe { mprotect(stack.0, tiermem_sys::PAGE_SIZE, MprotectFlags::empty()) }?;
        // SAFETY: the top of our own mapping, aligned for a CloneChild (the mapping's end is).
        unsafe { stack.child().cast::<CloneChild>().write(child) };
        Ok(stack)
    }

    /// Where the CloneChild is: the top of the mapping.
    fn child(&self) -> *mut c_void {
        self.0.cast::<u8>().wrapping_add(Self::LEN - std::mem::size_of::<CloneChild>()).cast()
    }

    /// The stack's top: just below the CloneChild, 16-byte aligned.
    fn top(&self) -> *mut c_void {
        self.child()
    }
}

impl Drop for HandlerStack {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer used in this process.
        let _ = unsafe { rustix::mm::munmap(self.0, Self::LEN) };
    }
}

const STACK_SWITCH: bool = cfg!(any(target_arch = "x86_64", target_arch = "aarch64"));

/// Move to `stack` (16-byte aligned), call `start(arg)` there and end the thread with its result
/// (SYS_exit, as glibc's clone child does).
///
/// # Safety
/// `stack` must be the top of memory this thread may use as its stack.
#[cfg(target_arch = "x86_64")]
unsafe fn call_on_stack_and_exit(start: CloneStart, arg: *mut c_void, stack: usize) -> ! {
    // SAFETY: the caller's contract; the call below gets an aligned stack and never returns here.
    unsafe {
        std::arch::asm!(
            "mov rsp, {stack}",
            // The outermost frame, as glibc's clone child has it: unwinders stop here.
            "xor ebp, ebp",
            "call {start}",
            "mov edi, eax",
            "mov eax, 60",
            "syscall",
            "ud2",
            stack = in(reg) stack,
            start = in(reg) start,
            in("rdi") arg,
            options(noreturn),
        )
    }
}

/// See the x86-64 version.
///
/// # Safety
/// `stack` must be the top of memory this thread may use as its stack.
#[cfg(target_arch = "aarch64")]
unsafe fn call_on_stack_and_exit(start: CloneStart, arg: *mut c_void, stack: usize) -> ! {
    // SAFETY: as on x86-64.
    unsafe {
        std::arch::asm!(
            "mov sp, {stack}",
            "mov x29, xzr",
            "mov x30, xzr",
            "blr {start}",
            "mov x8, #93",
            "svc #0",
            "brk #0",
            stack = in(reg) stack,
            start = in(reg) start,
            in("x0") arg,
            options(noreturn),
        )
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
unsafe fn call_on_stack_and_exit(_: CloneStart, _: *mut c_void, _: usize) -> ! {
    unreachable!("clone goes straight to the C library here (STACK_SWITCH)")
}
