//! The preload shim: loaded with LD_PRELOAD into an unmodified program, it places every
//! allocation of at least the threshold (default 1 MiB) — from the malloc family or anonymous
//! private mmap — in a region managed by the tiermem paging engine, and hands everything smaller
//! to the C library untouched.
//!
//! - The shim's own memory (and the engine's) comes from glibc's `__libc_*` entry points, never
//!   through the interposed functions ([`libc_alloc`]).
//! - Once the engine runs, allocations below the threshold come from a managed small-object
//!   heap ([`heap`]; `TIERMEM_SMALL_HEAP=off` turns it off), so a
//!   program's small objects page too instead of pinning memory.
//! - The engine starts at the first large allocation (or once small ones add up to as much),
//!   configured from `TIERMEM_*` variables
//!   ([`tiermem_engine::RunSettings`]); a bad value stops the program before `main` with a message.
//! - A freed large malloc allocation is kept (bounded) for the next malloc of about its size,
//!   as glibc keeps freed memory in its heap, sparing the first-touch faults of a fresh region
//!   ([`recycle`]; `TIERMEM_REUSE_FREED=off` turns it off).
//! - fork: the child gets a private, unmanaged copy of all managed memory ([`runtime`]).
//! - In sigbus fault mode, system calls that read or write managed memory are wrapped so the
//!   pages are resident while the kernel touches them ([`io`], [`messages`], [`process_vm`],
//!   [`paths`], their fortified
//!   variants in [`fortified`], and by number through `syscall()`), and the program cannot
//!   displace or block the engine's SIGBUS handler ([`signals`]).
//! - With `TIERMEM_LIBRARY_DATA=on`, while the program has one thread of its own, the pages
//!   the libraries it has loaded wrote are paged too ([`library_data`]).
//! - While the program has one thread of its own, the streams it opens skip the stdio locks the
//!   engine's threads would otherwise switch on ([`stdio`]).
//! - At exit each managed process writes its statistics to `TIERMEM_STATS_DIR/<pid>-<image>.json`,
//!   also one that ends through `_exit`, and a snapshot of them every 2 s ([`report`]).

#![recursion_limit = "256"]

mod alloc;
mod cgroup_watch;
mod exec;
mod fds;
mod fortified;
mod heap;
mod io;
mod last_thread;
mod libc_alloc;
mod library_data;
mod lock;
mod messages;
mod mmap;
mod other_forks;
mod paths;
mod privileges;
mod process_vm;
mod recycle;
mod registry;
mod report;
mod reserve;
mod runtime;
mod signals;
mod slab;
mod stdio;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod syscall;
mod terminating;

#[global_allocator]
static SHIM_ALLOCATOR: libc_alloc::LibcAllocator = libc_alloc::LibcAllocator;

/// Runs when the library is loaded, before the program's `main`: reads the settings so a bad
/// value is reported before the program does anything.
extern "C" fn on_load() {
    fds::resolve_real_functions();
    library_data::resolve_real_dlopen();
    stdio::note_load();
    runtime::load_settings();
}

// Not run in the crate's own unit-test binary, which has no TIERMEM_* settings.
#[cfg_attr(not(test), used, link_section = ".init_array")]
#[cfg_attr(test, allow(dead_code))]
static ON_LOAD: extern "C" fn() = on_load;
