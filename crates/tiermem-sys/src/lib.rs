//! Thin safe wrappers over the Linux interfaces tiermem stands on, and the project's error type.
//!
//! Everything `unsafe` that talks to the kernel about memory lives here, so the engine above can be
//! written in safe code wherever possible.

pub mod cgroup;
pub mod child;
pub mod error;
pub mod guarded_fd;
pub mod mem;
pub mod messages;
pub mod page_pipe;
pub mod pagemap;
pub mod probe;
pub mod threads;
pub mod uffd;

pub use error::{Error, ErrorKind, Result, ResultExt};

/// The page size tiermem manages (the base page size of x86-64 and of most Linux systems).
pub const PAGE_SIZE: usize = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
