//! The preload shim: loaded with LD_PRELOAD into an unmodified program, it places every
//! allocation of at least the threshold (default 1 MiB) — from the malloc family or anonymous
//! private mmap — in a region managed by the tiermem paging engine, and hands everything smaller
//! to the C library untouched.
//!
//! - The shim's own memory (and the engine's) comes from glibc's `__libc_*` entry points, never
//!   through the interposed functions ([`libc_alloc`]).
//! - The engine starts at the first large allocation, configured from `TIERMEM_*` variables
//!   ([`tiermem_engine::RunSettings`]); a bad value stops the program before `main` with a message.
//! - fork: the child gets a private, unmanaged copy of all managed memory ([`runtime`]).
//! - In sigbus fault mode, system calls that read or write managed memory are wrapped so the
//!   pages are resident while the kernel touches them ([`io`]), and the program cannot displace
//!   or block the engine's SIGBUS handler ([`signals`]).
//! - At exit each managed process writes its statistics to `TIERMEM_STATS_DIR/<pid>.json`.

mod alloc;
mod io;
mod libc_alloc;
mod mmap;
mod registry;
mod runtime;
mod signals;

#[global_allocator]
static SHIM_ALLOCATOR: libc_alloc::LibcAllocator = libc_alloc::LibcAllocator;

/// Runs when the library is loaded, before the program's `main`: reads the settings so a bad
/// value is reported before the program does anything.
extern "C" fn on_load() {
    runtime::load_settings();
}

#[used]
#[link_section = ".init_array"]
static ON_LOAD: extern "C" fn() = on_load;
