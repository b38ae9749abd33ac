//! Where tiermem's own messages go: the standard error the process started with, kept on a
//! descriptor of its own. A program that closes its fd 2 and opens a data file there (daemons
//! do) would otherwise find tiermem's warnings inside that file.

use std::sync::atomic::{AtomicI32, Ordering};

/// The descriptor messages are written to: 2 until [`keep_stderr`] has run.
static MESSAGE_FD: AtomicI32 = AtomicI32::new(2);

/// Lowest descriptor the copy may take: far above what programs use, so their own `dup2`s to
/// small numbers do not replace it.
const COPY_FROM: i32 = 512;

/// Duplicate the current standard error to a high close-on-exec descriptor and send messages
/// there from now on. Idempotent; where no copy can be made (fd 2 closed, descriptors
/// exhausted) messages keep going to fd 2.
pub fn keep_stderr() {
    if MESSAGE_FD.load(Ordering::Acquire) != 2 {
        return;
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) only creates a new descriptor.
    let copy = unsafe { libc::fcntl(2, libc::F_DUPFD_CLOEXEC, COPY_FROM) };
    if copy >= 0 && MESSAGE_FD.compare_exchange(2, copy, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // SAFETY: closing the copy this call made and did not publish.
        unsafe { libc::close(copy) };
    }
}

/// Write all of `bytes` to the message descriptor (async-signal-safe: write(2) only).
pub fn write(mut bytes: &[u8]) {
    let fd = MESSAGE_FD.load(Ordering::Acquire);
    while !bytes.is_empty() {
        // SAFETY: writing from a valid slice to a descriptor; an invalid one gives EBADF.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n > 0 {
            bytes = &bytes[n as usize..];
        } else if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        } else {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn messages_go_to_the_kept_copy_of_stderr() {
        super::keep_stderr();
        let fd = super::MESSAGE_FD.load(std::sync::atomic::Ordering::Acquire);
        assert!(fd >= super::COPY_FROM, "messages still go to fd {fd}");
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0, "the copy must not leak into exec'd programs");
        super::keep_stderr(); // idempotent
        assert_eq!(super::MESSAGE_FD.load(std::sync::atomic::Ordering::Acquire), fd);
    }
}
