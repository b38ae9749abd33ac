//! A small safe wrapper over userfaultfd(2): creation with the API handshake, registration, the
//! resolving ioctls (COPY, ZEROPAGE, WRITEPROTECT, WAKE, MOVE) and reading fault messages.
//!
//! The resolving calls sit on the fault path (possibly in a signal handler), so they return a bare
//! [`Errno`] and never allocate.

use std::mem::size_of;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use linux_raw_sys::general as uapi;
use rustix::io::Errno;
use rustix::mm::UserfaultfdFlags;

use crate::{Error, ErrorKind, Result, ResultExt};

/// userfaultfd feature bits (`UFFD_FEATURE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features(pub u64);

impl Features {
    /// Write-protect faults are reported (`UFFD_FEATURE_PAGEFAULT_FLAG_WP`).
    pub const WP: Self = Self(uapi::UFFD_FEATURE_PAGEFAULT_FLAG_WP as u64);
    /// Faults raise SIGBUS in the faulting thread instead of queueing a message.
    pub const SIGBUS: Self = Self(uapi::UFFD_FEATURE_SIGBUS as u64);
    /// Fault messages carry the faulting thread's id.
    pub const THREAD_ID: Self = Self(uapi::UFFD_FEATURE_THREAD_ID as u64);
    /// munmap of a registered range is reported.
    pub const EVENT_UNMAP: Self = Self(uapi::UFFD_FEATURE_EVENT_UNMAP as u64);
    /// MADV_DONTNEED/REMOVE of a registered range is reported.
    pub const EVENT_REMOVE: Self = Self(uapi::UFFD_FEATURE_EVENT_REMOVE as u64);
    /// mremap of a registered range is reported.
    pub const EVENT_REMAP: Self = Self(uapi::UFFD_FEATURE_EVENT_REMAP as u64);
    /// fork copies the registration into the child with a new userfaultfd.
    pub const EVENT_FORK: Self = Self(uapi::UFFD_FEATURE_EVENT_FORK as u64);
    /// Minor faults on shared memory are reported.
    pub const MINOR_SHMEM: Self = Self(uapi::UFFD_FEATURE_MINOR_SHMEM as u64);
    /// Write-protect faults are resolved by the kernel; written pages are found with PAGEMAP_SCAN.
    pub const WP_ASYNC: Self = Self(uapi::UFFD_FEATURE_WP_ASYNC as u64);
    /// Never-populated pages count as write-protected too.
    pub const WP_UNPOPULATED: Self = Self(uapi::UFFD_FEATURE_WP_UNPOPULATED as u64);
    /// UFFDIO_MOVE moves pages between addresses without copying.
    pub const MOVE: Self = Self(uapi::UFFD_FEATURE_MOVE as u64);
    /// Fault addresses are exact, not rounded to the page.
    pub const EXACT_ADDRESS: Self = Self(uapi::UFFD_FEATURE_EXACT_ADDRESS as u64);

    /// The empty set.
    pub const fn empty() -> Self {
        Self(0)
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// Union.
    #[must_use]
    pub const fn with(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
}

/// What a registration watches for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegisterMode {
    /// Faults on pages with no mapping.
    pub missing: bool,
    /// Writes to write-protected pages.
    pub write_protect: bool,
}

/// A page fault (or other event) read from a userfaultfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A thread faulted at `addr`.
    PageFault {
        /// Faulting address (page-aligned unless EXACT_ADDRESS was asked for).
        addr: usize,
        /// The access was a write.
        write: bool,
        /// A write-protect fault rather than a missing-page fault.
        wp: bool,
        /// Faulting thread id, 0 unless THREAD_ID was asked for.
        tid: u32,
    },
    /// `[start, end)` was dropped with MADV_DONTNEED/REMOVE.
    Remove {
        /// First address.
        start: usize,
        /// One past the last address.
        end: usize,
    },
    /// `[start, end)` was unmapped.
    Unmap {
        /// First address.
        start: usize,
        /// One past the last address.
        end: usize,
    },
    /// A registered range moved.
    Remap {
        /// Old start.
        from: usize,
        /// New start.
        to: usize,
        /// Length.
        len: usize,
    },
    /// An event this wrapper does not decode.
    Other(u8),
}

/// An open userfaultfd after the API handshake.
#[derive(Debug)]
pub struct Uffd {
    fd: crate::guarded_fd::Guarded<OwnedFd>,
    /// What was asked for (and so is on: the handshake refuses what it cannot give).
    features: Features,
    /// What the handshake reported: every feature the kernel offers, not what is on.
    offered: Features,
    /// Opened with UFFD_USER_MODE_ONLY: faults taken inside the kernel are not delivered.
    user_mode_only: bool,
}

/// userfaultfd(2)'s UFFD_USER_MODE_ONLY (Linux >= 5.11; not in rustix): the descriptor gets
/// only faults taken in user mode, and a system call touching a missing page fails with EFAULT,
/// as under UFFD_FEATURE_SIGBUS. All an unprivileged process may open while
/// vm.unprivileged_userfaultfd is 0, that sysctl's default since 5.11.
const USER_MODE_ONLY: u32 = 1;

/// userfaultfd(2) with `flags`; when the full kind is refused (EPERM: no CAP_SYS_PTRACE and
/// vm.unprivileged_userfaultfd = 0), the user-mode-only kind. Returns the descriptor and whether
/// it is user-mode only.
fn create(flags: UserfaultfdFlags) -> Result<(OwnedFd, bool), Errno> {
    // SAFETY: userfaultfd(2) creates a new descriptor; it touches no memory of ours.
    match unsafe { rustix::mm::userfaultfd(flags) } {
        Ok(fd) => Ok((fd, false)),
        Err(Errno::PERM) => {
            let user_only = flags | UserfaultfdFlags::from_bits_retain(USER_MODE_ONLY);
            // SAFETY: as above. An older kernel refuses the flag (EINVAL): report the EPERM.
            unsafe { rustix::mm::userfaultfd(user_only) }.map(|fd| (fd, true)).map_err(|_| Errno::PERM)
        }
        Err(e) => Err(e),
    }
}

const fn iowr(nr: u32, size: usize) -> u32 {
    // _IOWR(UFFDIO, nr, size) per asm-generic/ioctl.h: dir(2 bits)|size(14)|type(8)|nr(8).
    (3 << 30) | ((size as u32) << 16) | (uapi::UFFDIO << 8) | nr
}

const UFFDIO_API: u32 = iowr(uapi::_UFFDIO_API, size_of::<uapi::uffdio_api>());
const UFFDIO_REGISTER: u32 = iowr(uapi::_UFFDIO_REGISTER, size_of::<uapi::uffdio_register>());
const UFFDIO_UNREGISTER: u32 =
    (2 << 30) | ((size_of::<uapi::uffdio_range>() as u32) << 16) | (uapi::UFFDIO << 8) | uapi::_UFFDIO_UNREGISTER;
const UFFDIO_WAKE: u32 =
    (2 << 30) | ((size_of::<uapi::uffdio_range>() as u32) << 16) | (uapi::UFFDIO << 8) | uapi::_UFFDIO_WAKE;
const UFFDIO_COPY: u32 = iowr(uapi::_UFFDIO_COPY, size_of::<uapi::uffdio_copy>());
const UFFDIO_ZEROPAGE: u32 = iowr(uapi::_UFFDIO_ZEROPAGE, size_of::<uapi::uffdio_zeropage>());
const UFFDIO_WRITEPROTECT: u32 = iowr(uapi::_UFFDIO_WRITEPROTECT, size_of::<uapi::uffdio_writeprotect>());
const UFFDIO_MOVE: u32 = iowr(uapi::_UFFDIO_MOVE, size_of::<uapi::uffdio_move>());

/// Issue an ioctl whose argument is a `T` the kernel may read and update.
///
/// # Safety
/// `request` must be an ioctl that takes a pointer to exactly a `T`, and any addresses inside
/// `arg` must satisfy that ioctl's contract.
unsafe fn ioctl_with<T>(fd: BorrowedFd<'_>, request: u32, arg: &mut T) -> Result<(), Errno> {
    // SAFETY: forwarded to the caller; `arg` is a valid, exclusive pointer to a T.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg as *mut T) };
    if rc < 0 {
        Err(Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)))
    } else {
        Ok(())
    }
}

impl Uffd {
    /// Open a userfaultfd and ask for `features`. `nonblocking` makes `read_event` return `None`
    /// instead of sleeping. Fails with [`ErrorKind::Unsupported`] naming the missing feature bits.
    /// Where this process may not handle faults taken inside the kernel, the descriptor is
    /// user-mode only ([`Uffd::handles_kernel_faults`] says which).
    pub fn open(features: Features, nonblocking: bool) -> Result<Self> {
        let mut flags = UserfaultfdFlags::CLOEXEC;
        if nonblocking {
            flags |= UserfaultfdFlags::NONBLOCK;
        }
        let (fd, user_mode_only) = create(flags).map_err(|e| {
            let hint = if e == Errno::PERM {
                " (needs root, CAP_SYS_PTRACE, or sysctl vm.unprivileged_userfaultfd=1)"
            } else if e == Errno::NOSYS {
                " (kernel built without CONFIG_USERFAULTFD)"
            } else {
                ""
            };
            Error::os(e.into(), format!("userfaultfd(2) failed{hint}"))
        })?;
        let mut api = uapi::uffdio_api { api: uapi::UFFD_API as u64, features: features.0, ioctls: 0 };
        // SAFETY: UFFDIO_API takes a uffdio_api.
        unsafe { ioctl_with(fd.as_fd(), UFFDIO_API, &mut api) }.map_err(|e| {
            let missing = features.0 & !Self::supported_features().map(|f| f.0).unwrap_or(0);
            Error::os_kind(
                ErrorKind::Unsupported,
                e.into(),
                format!(
                    "UFFDIO_API handshake refused features {:#x} (not offered by this kernel: {missing:#x})",
                    features.0
                ),
            )
        })?;
        // The kernel answers with every feature it offers, whatever was asked for, and turns on
        // only those asked for: the answer is not what this descriptor does. WP_ASYNC also
        // turns on WP_UNPOPULATED, which it relies on.
        let features = if features.contains(Features::WP_ASYNC) {
            Features(features.0 | Features::WP_UNPOPULATED.0)
        } else {
            features
        };
        Ok(Self { fd: crate::guarded_fd::Guarded::new(fd), features, offered: Features(api.features), user_mode_only })
    }

    /// Whether faults taken inside the kernel (a system call reading or writing a missing page)
    /// reach this descriptor; false when only a user-mode-only one could be opened (see
    /// [`Uffd::open`]), where such a system call fails with EFAULT instead.
    pub fn handles_kernel_faults(&self) -> bool {
        !self.user_mode_only
    }

    /// Every feature this kernel offers: a handshake asking for none reports them all.
    pub fn supported_features() -> Result<Features> {
        let (fd, _) = create(UserfaultfdFlags::CLOEXEC).context(|| "userfaultfd(2) failed".into())?;
        let mut api = uapi::uffdio_api { api: uapi::UFFD_API as u64, features: 0, ioctls: 0 };
        // SAFETY: UFFDIO_API takes a uffdio_api.
        unsafe { ioctl_with(fd.as_fd(), UFFDIO_API, &mut api) }.context(|| "UFFDIO_API handshake".into())?;
        Ok(Features(api.features))
    }

    /// The features this descriptor was opened with (on for it).
    pub fn features(&self) -> Features {
        self.features
    }

    /// Every feature the kernel offered in this descriptor's handshake (on or not).
    pub fn offered_features(&self) -> Features {
        self.offered
    }

    /// Watch `[addr, addr+len)`. Returns the bitmask of `_UFFDIO_*` ioctls allowed on the range.
    pub fn register(&self, addr: *mut u8, len: usize, mode: RegisterMode) -> Result<u64> {
        let mut bits = 0u64;
        if mode.missing {
            bits |= uapi::UFFDIO_REGISTER_MODE_MISSING as u64;
        }
        if mode.write_protect {
            bits |= uapi::UFFDIO_REGISTER_MODE_WP as u64;
        }
        let mut reg = uapi::uffdio_register {
            range: uapi::uffdio_range { start: addr as u64, len: len as u64 },
            mode: bits,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER takes a uffdio_register; registering changes how faults in the
        // range are handled but not what memory is valid.
        unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_REGISTER, &mut reg) }
            .map_err(|e| Error::os(e.into(), format!("UFFDIO_REGISTER of {len} bytes at {addr:p} ({mode:?})")))?;
        Ok(reg.ioctls)
    }

    /// Stop watching `[addr, addr+len)`.
    pub fn unregister(&self, addr: *mut u8, len: usize) -> Result<()> {
        let mut range = uapi::uffdio_range { start: addr as u64, len: len as u64 };
        // SAFETY: UFFDIO_UNREGISTER takes a uffdio_range.
        unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_UNREGISTER, &mut range) }
            .map_err(|e| Error::os(e.into(), format!("UFFDIO_UNREGISTER of {len} bytes at {addr:p}")))
    }

    /// Atomically fill the missing pages `[dst, dst+len)` with a copy of `src` and wake threads
    /// waiting on them (unless `dont_wake`). `write_protect` installs them write-protected.
    /// `EEXIST` means another thread mapped the page first. On failure, the bytes copied before
    /// it come with the error: the kernel fills page by page, in order, and a copy that stops
    /// part-way fails with EAGAIN whatever stopped it; the error of the page it stopped at
    /// (EEXIST, ENOMEM, ...) comes when the rest is tried again, with nothing copied.
    ///
    /// # Safety
    /// `src` must be readable for `len` bytes; `dst` must lie in a range registered here.
    pub unsafe fn copy(
        &self,
        dst: *mut u8,
        src: *const u8,
        len: usize,
        write_protect: bool,
        dont_wake: bool,
    ) -> Result<(), (usize, Errno)> {
        let mut mode = 0u64;
        if write_protect {
            mode |= uapi::UFFDIO_COPY_MODE_WP as u64;
        }
        if dont_wake {
            mode |= uapi::UFFDIO_COPY_MODE_DONTWAKE as u64;
        }
        let mut arg = uapi::uffdio_copy { dst: dst as u64, src: src as u64, len: len as u64, mode, copy: 0 };
        // SAFETY: UFFDIO_COPY takes a uffdio_copy; the caller vouches for src and dst.
        match unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_COPY, &mut arg) } {
            Ok(()) => Ok(()),
            // `copy` holds the bytes copied, or a negative errno when nothing was.
            Err(e) => Err((usize::try_from(arg.copy).unwrap_or(0), e)),
        }
    }

    /// Map the zero page at the missing pages `[dst, dst+len)` and wake waiters.
    pub fn zeropage(&self, dst: *mut u8, len: usize) -> Result<(), Errno> {
        let mut arg = uapi::uffdio_zeropage {
            range: uapi::uffdio_range { start: dst as u64, len: len as u64 },
            mode: 0,
            zeropage: 0,
        };
        // SAFETY: UFFDIO_ZEROPAGE takes a uffdio_zeropage and only fills holes in registered ranges.
        unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_ZEROPAGE, &mut arg) }
    }

    /// Set (`protect`) or clear write protection on `[addr, addr+len)`. Clearing also wakes
    /// threads blocked on a write-protect fault there, unless `dont_wake`. The kernel refuses
    /// `dont_wake` together with `protect` (EINVAL); so does this call.
    pub fn write_protect(&self, addr: *mut u8, len: usize, protect: bool, dont_wake: bool) -> Result<(), Errno> {
        if protect && dont_wake {
            return Err(Errno::INVAL);
        }
        let mut mode = 0u64;
        if protect {
            mode |= 1; // UFFDIO_WRITEPROTECT_MODE_WP
        }
        if dont_wake {
            mode |= 2; // UFFDIO_WRITEPROTECT_MODE_DONTWAKE
        }
        let mut arg =
            uapi::uffdio_writeprotect { range: uapi::uffdio_range { start: addr as u64, len: len as u64 }, mode };
        // SAFETY: UFFDIO_WRITEPROTECT takes a uffdio_writeprotect; it changes permissions only.
        unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_WRITEPROTECT, &mut arg) }
    }

    /// Wake threads waiting on faults in `[addr, addr+len)` so they retry the access.
    pub fn wake(&self, addr: *mut u8, len: usize) -> Result<(), Errno> {
        let mut range = uapi::uffdio_range { start: addr as u64, len: len as u64 };
        // SAFETY: UFFDIO_WAKE takes a uffdio_range.
        unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_WAKE, &mut range) }
    }

    /// Move the pages at `[src, src+len)` to the holes at `[dst, dst+len)` without copying.
    /// Needs [`Features::MOVE`]. Returns the bytes moved; on failure, the bytes moved before it
    /// with the error (the kernel moves page by page, in order; a move that stops part-way fails
    /// with EAGAIN, as [`Uffd::copy`] does).
    ///
    /// # Safety
    /// Both ranges must be private anonymous memory of this process; `dst` must be registered here.
    pub unsafe fn move_pages(&self, dst: *mut u8, src: *mut u8, len: usize) -> Result<usize, (usize, Errno)> {
        let mut arg = uapi::uffdio_move {
            dst: dst as u64,
            src: src as u64,
            len: len as u64,
            // UFFDIO_MOVE_MODE_DONTWAKE (linux/userfaultfd.h; not in linux-raw-sys 0.11).
            mode: 1,
            move_: 0,
        };
        // SAFETY: UFFDIO_MOVE takes a uffdio_move; the caller vouches for the ranges.
        match unsafe { ioctl_with(self.fd.as_fd(), UFFDIO_MOVE, &mut arg) } {
            Ok(()) => Ok(len),
            // `move` holds the bytes moved, or a negative errno when nothing was.
            Err(e) => Err((usize::try_from(arg.move_).unwrap_or(0), e)),
        }
    }

    /// Read one event. `Ok(None)` when the descriptor is non-blocking and nothing is queued.
    pub fn read_event(&self) -> Result<Option<Event>, Errno> {
        let mut msg = std::mem::MaybeUninit::<uapi::uffd_msg>::zeroed();
        // SAFETY: a uffd_msg is plain old data; read fills at most size_of bytes of it.
        let buf = unsafe { std::slice::from_raw_parts_mut(msg.as_mut_ptr().cast::<u8>(), size_of::<uapi::uffd_msg>()) };
        match rustix::io::read(&self.fd, buf) {
            Ok(n) if n == size_of::<uapi::uffd_msg>() => {}
            Ok(_) => return Err(Errno::IO),
            Err(Errno::AGAIN) => return Ok(None),
            Err(e) => return Err(e),
        }
        // SAFETY: fully written by the kernel above (and zeroed before).
        let msg = unsafe { msg.assume_init() };
        #[allow(clippy::multiple_unsafe_ops_per_block)] // one invariant: the tag selects the member
        // SAFETY: the union member read matches the event tag, as documented in userfaultfd(2).
        let event = unsafe {
            match u32::from(msg.event) {
                uapi::UFFD_EVENT_PAGEFAULT => {
                    let pf = msg.arg.pagefault;
                    Event::PageFault {
                        addr: pf.address as usize,
                        write: pf.flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
                        wp: pf.flags & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WP) != 0,
                        tid: pf.feat.ptid,
                    }
                }
                uapi::UFFD_EVENT_REMOVE => {
                    Event::Remove { start: msg.arg.remove.start as usize, end: msg.arg.remove.end as usize }
                }
                uapi::UFFD_EVENT_UNMAP => {
                    Event::Unmap { start: msg.arg.remove.start as usize, end: msg.arg.remove.end as usize }
                }
                uapi::UFFD_EVENT_REMAP => Event::Remap {
                    from: msg.arg.remap.from as usize,
                    to: msg.arg.remap.to as usize,
                    len: msg.arg.remap.len as usize,
                },
                other => Event::Other(other as u8),
            }
        };
        Ok(Some(event))
    }
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The handshake answers with every feature the kernel offers, whatever was asked for; a
    /// descriptor reports what it was opened with, and the offer apart. (The engine keeps its
    /// page pipe to SIGBUS-mode descriptors by `features()`, and took every descriptor for one
    /// while it returned the offer.)
    #[test]
    fn a_descriptor_s_features_are_those_asked_for_and_the_offer_is_kept_apart() {
        let test = "a_descriptor_s_features_are_those_asked_for_and_the_offer_is_kept_apart";
        let offered = match Uffd::supported_features() {
            Ok(offered) => offered,
            Err(e) => {
                eprintln!("SKIPPED {test}: userfaultfd unavailable: {e}");
                return;
            }
        };
        if !offered.contains(Features::SIGBUS) {
            eprintln!("SKIPPED {test}: this kernel offers no UFFD_FEATURE_SIGBUS");
            return;
        }
        let plain = Uffd::open(Features::default(), false).expect("a userfaultfd asking for nothing");
        assert!(!plain.features().contains(Features::SIGBUS), "asked for nothing, reports {:#x}", plain.features().0);
        assert_eq!(plain.offered_features().0, offered.0, "the offer is the kernel's");
        let sigbus = Uffd::open(Features::SIGBUS, false).expect("a userfaultfd asking for SIGBUS");
        assert_eq!(sigbus.features().0, Features::SIGBUS.0);
        assert_eq!(sigbus.offered_features().0, offered.0);
    }
}
