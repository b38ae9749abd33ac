//! The `exec` family: the image about to be replaced writes its statistics first.
//!
//! An `exec` ends the image without running its exit handlers, so its statistics would be only
//! the last snapshot, up to 2 s old, or none at all for an image that ran less than that, and
//! the tail of its fault trace (`tiermem trace record`) would be lost. The
//! functions a program calls by name are interposed here, and the `execve` and `execveat` system
//! calls by number in `syscall`. The C library's `execl`, `execlp` and `execle` call the system
//! call directly, so on x86-64 they are interposed too ([`list`]); elsewhere an image replaced
//! through them keeps its last snapshot. An `exec` that fails leaves the process running, and
//! its later snapshots and final report replace the statistics written, and its faults go
//! unrecorded.

use std::ffi::{c_char, c_int};

type ExecveFn = unsafe extern "C" fn(*const c_char, *const *const c_char, *const *const c_char) -> c_int;
type ExecvFn = unsafe extern "C" fn(*const c_char, *const *const c_char) -> c_int;
type FexecveFn = unsafe extern "C" fn(c_int, *const *const c_char, *const *const c_char) -> c_int;
type ExecveatFn =
    unsafe extern "C" fn(c_int, *const c_char, *const *const c_char, *const *const c_char, c_int) -> c_int;

/// # Safety
/// The C contract of `execve`.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execve", ExecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execve).
    unsafe { real(path, argv, envp) }
}

/// # Safety
/// The C contract of `execv`.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execv", ExecvFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execv).
    unsafe { real(path, argv) }
}

/// # Safety
/// The C contract of `execvp`.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execvp", ExecvFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execvp).
    unsafe { real(file, argv) }
}

/// # Safety
/// The C contract of `execvpe`.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execvpe", ExecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execvpe).
    unsafe { real(file, argv, envp) }
}

/// # Safety
/// The C contract of `fexecve`.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("fexecve", FexecveFn);
    // SAFETY: the caller's arguments, passed on (the C contract of fexecve).
    unsafe { real(fd, argv, envp) }
}

/// # Safety
/// The C contract of `execveat`.
#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    flags: c_int,
) -> c_int {
    crate::report::before_exec();
    let real = crate::alloc::real!("execveat", ExecveatFn);
    // SAFETY: the caller's arguments, passed on (the C contract of execveat).
    unsafe { real(dirfd, path, argv, envp, flags) }
}

/// `execl`, `execlp` and `execle`: their arguments are a variable list, which stable Rust cannot
/// take, so each is a few instructions that store the five arguments that came in registers
/// after the first (x86-64 System V: rsi, rdx, rcx, r8, r9) beside the ones the caller put on
/// the stack, and hand both to [`list::exec_list`], which walks them as `va_arg` would: a
/// pointer argument of a variadic call travels exactly as a fixed one does.
#[cfg(target_arch = "x86_64")]
mod list {
    use std::ffi::{c_char, c_int};

    /// Most arguments collected on the stack (512 bytes, little even on a signal stack); a
    /// longer list goes into a mapping of its own.
    const ON_STACK: usize = 64;

    const EXECL: c_int = 0;
    const EXECLP: c_int = 1;
    const EXECLE: c_int = 2;

    macro_rules! list_entry {
        ($name:ident, $kind:expr) => {
            /// # Safety
            /// The C contract of the function of this name: a null-terminated list of
            /// arguments (for `execle`, then the environment).
            #[unsafe(naked)]
            #[no_mangle]
            pub unsafe extern "C" fn $name() {
                core::arch::naked_asm!(
                    // 40 bytes for the register arguments keep the stack 16-byte aligned at the
                    // call (8 mod 16 on entry, after the return address).
                    "sub rsp, 40",
                    "mov [rsp], rsi",
                    "mov [rsp + 8], rdx",
                    "mov [rsp + 16], rcx",
                    "mov [rsp + 24], r8",
                    "mov [rsp + 32], r9",
                    "mov rsi, rsp",
                    // The caller's stack arguments start past our 40 bytes and its return address.
                    "lea rdx, [rsp + 48]",
                    "mov ecx, {kind}",
                    "call {walk}",
                    "add rsp, 40",
                    "ret",
                    kind = const $kind,
                    walk = sym exec_list,
                )
            }
        };
    }

    list_entry!(execl, EXECL);
    list_entry!(execlp, EXECLP);
    list_entry!(execle, EXECLE);

    /// The list's `i`-th pointer after the first argument.
    ///
    /// # Safety
    /// `regs` holds five pointers and `stack` as many as the caller passed beyond them; `i` is
    /// at most the index of the list's terminating null (or of `execle`'s environment after it).
    unsafe fn nth(regs: *const *const c_char, stack: *const *const c_char, i: usize) -> *const c_char {
        let slot = if i < 5 { regs.wrapping_add(i) } else { stack.wrapping_add(i - 5) };
        // SAFETY: one of the five register arguments or of the caller's stack arguments, as the
        // caller promises.
        unsafe { slot.read() }
    }

    /// Collect the list (`arg0`, …, null; for `execle` the environment after it) and exec.
    ///
    /// # Safety
    /// Called only from the entries above, with their caller's arguments.
    unsafe extern "C" fn exec_list(
        path: *const c_char,
        regs: *const *const c_char,
        stack: *const *const c_char,
        kind: c_int,
    ) -> c_int {
        // Counted first, then copied: on the stack while it fits, else into a mapping made
        // straight with the kernel. Never the heap: a vfork child shares its parent's, and
        // execle may be called from a signal handler; glibc's own execl allocates nothing either.
        let mut argc = 0;
        // SAFETY: the list ends with a null pointer (the C contract of the execl family).
        while !unsafe { nth(regs, stack, argc) }.is_null() {
            argc += 1;
        }
        let env = if kind == EXECLE {
            // SAFETY: execle's environment follows the null.
            unsafe { nth(regs, stack, argc + 1) }.cast::<*const c_char>()
        } else {
            std::ptr::null()
        };
        let mut short = [std::ptr::null::<c_char>(); ON_STACK];
        let mut long = (argc >= ON_STACK).then(|| Mapped::new((argc + 1) * std::mem::size_of::<*const c_char>()));
        let argv: &mut [*const c_char] = match &mut long {
            None => &mut short[..=argc],
            Some(Ok(mapped)) => mapped.pointers(argc + 1),
            Some(Err(_)) => {
                crate::runtime::set_errno(libc::E2BIG);
                return -1;
            }
        };
        for (i, slot) in argv.iter_mut().take(argc).enumerate() {
            // SAFETY: i < argc, within the list.
            *slot = unsafe { nth(regs, stack, i) };
        }
        let argv = argv.as_ptr();
        // The caller's path and list as an array ending in null, as execv, execvp and execve
        // take them (execl passes the current environment on, as execv does).
        match kind {
            // SAFETY: as above.
            EXECLP => unsafe { super::execvp(path, argv) },
            // SAFETY: as above, with execle's environment.
            EXECLE => unsafe { super::execve(path, argv, env) },
            // SAFETY: as above.
            _ => unsafe { super::execv(path, argv) },
        }
    }

    /// Zeroed anonymous memory mapped straight with the kernel (not through the shim's mmap),
    /// unmapped when dropped.
    struct Mapped(*mut std::ffi::c_void, usize);

    impl Mapped {
        fn new(len: usize) -> rustix::io::Result<Self> {
            use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
            // SAFETY: a new private anonymous mapping at an address the kernel chooses.
            let at = unsafe {
                mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
            }?;
            Ok(Self(at, len))
        }

        /// The mapping as `n` pointers (null, as mapped); `n` of them fit.
        fn pointers(&mut self, n: usize) -> &mut [*const c_char] {
            debug_assert!(n * std::mem::size_of::<*const c_char>() <= self.1);
            // SAFETY: the mapping is ours alone, page-aligned, zeroed (null pointers) and holds
            // n pointers; it lives as long as self.
            unsafe { std::slice::from_raw_parts_mut(self.0.cast::<*const c_char>(), n) }
        }
    }

    impl Drop for Mapped {
        fn drop(&mut self) {
            // SAFETY: the mapping this value made, no longer used.
            let _ = unsafe { rustix::mm::munmap(self.0, self.1) };
        }
    }
}
