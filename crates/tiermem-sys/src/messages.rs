//! Where tiermem's own messages go: the standard error the process started with, kept on a
//! descriptor of its own. A program that closes its fd 2 and opens a data file there (daemons
//! do) would otherwise find tiermem's warnings inside that file.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

/// The descriptor messages are written to: 2 until [`keep_stderr`] has run.
static MESSAGE_FD: AtomicI32 = AtomicI32::new(2);
/// Device and inode of the kept copy: a program that closed it (closefrom) may have reused the
/// number for a file of its own, which must not receive tiermem's messages.
static KEPT_DEV: AtomicU64 = AtomicU64::new(0);
static KEPT_INO: AtomicU64 = AtomicU64::new(0);

fn identity(fd: i32) -> Option<(u64, u64)> {
    // SAFETY: an all-zero stat is valid for fstat to fill; fstat is async-signal-safe.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of a descriptor number into a valid struct.
    (unsafe { libc::fstat(fd, &mut st) } == 0).then_some((st.st_dev, st.st_ino))
}

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
    if let Some((dev, ino)) = (copy >= 0).then(|| identity(copy)).flatten() {
        KEPT_DEV.store(dev, Ordering::Release);
        KEPT_INO.store(ino, Ordering::Release);
    }
    if copy >= 0 && MESSAGE_FD.compare_exchange(2, copy, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // SAFETY: closing the copy this call made and did not publish.
        unsafe { libc::close(copy) };
    }
}

/// Write all of `bytes` to the message descriptor (async-signal-safe: write(2) only).
///
/// The system call itself (rustix's raw one), not libc's `write`: inside the preload shim that
/// symbol is the shim's own wrapper, which may take the shim's registry lock to check the
/// buffer, and messages are said with that lock held (a bad free, a failed unmap).
pub fn write(mut bytes: &[u8]) {
    let fd = MESSAGE_FD.load(Ordering::Acquire);
    if fd != 2 && identity(fd) != Some((KEPT_DEV.load(Ordering::Acquire), KEPT_INO.load(Ordering::Acquire))) {
        return; // the copy is gone, and the number may be the program's now: say nothing
    }
    // SAFETY: the number is only borrowed for the calls below; a descriptor closed meanwhile
    // makes them fail with EBADF, nothing worse.
    let fd = unsafe { rustix::fd::BorrowedFd::borrow_raw(fd) };
    while !bytes.is_empty() {
        match rustix::io::write(fd, bytes) {
            Ok(n) if n > 0 => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => continue,
            _ => break,
        }
    }
}

/// Write `parts` and a newline as one message without allocating (usable anywhere, even inside
/// malloc or a signal handler). A message up to 1 KiB goes out in one write, so messages from
/// several threads do not mix; a longer one goes out part by part.
pub fn say(parts: &[&str]) {
    let mut line = [0u8; 1024];
    let mut len = 0;
    let mut fits = true;
    for part in parts.iter().chain(std::iter::once(&"\n")) {
        let bytes = part.as_bytes();
        if len + bytes.len() > line.len() {
            fits = false;
            break;
        }
        line[len..len + bytes.len()].copy_from_slice(bytes);
        len += bytes.len();
    }
    if fits {
        write(&line[..len]);
    } else {
        parts.iter().chain(std::iter::once(&"\n")).for_each(|part| write(part.as_bytes()));
    }
}

/// Say `parts` (see [`say`]) and abort: for a state the process cannot go on from without
/// returning wrong data. Said here, not through `tracing`: the preload shim installs no
/// subscriber, and its aborts were silent.
pub fn fatal(parts: &[&str]) -> ! {
    say(parts);
    std::process::abort()
}

/// `n` in decimal, written into the end of `buf`: for messages where allocating is not safe
/// (a signal handler, a fork handler, a child between fork and exec).
pub fn decimal(n: i64, buf: &mut [u8; 20]) -> &str {
    let mut at = buf.len();
    let mut v = n.unsigned_abs();
    loop {
        at -= 1;
        buf[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    if n < 0 {
        at -= 1;
        buf[at] = b'-';
    }
    std::str::from_utf8(&buf[at..]).unwrap_or("?")
}

#[cfg(test)]
mod tests {
    #[test]
    fn numbers_print_in_decimal_without_allocating() {
        for n in [0i64, 7, 512, -1, i64::MAX, i64::MIN] {
            assert_eq!(super::decimal(n, &mut [0; 20]), n.to_string());
        }
    }

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
        assert_eq!(
            super::identity(fd),
            Some((
                super::KEPT_DEV.load(std::sync::atomic::Ordering::Acquire),
                super::KEPT_INO.load(std::sync::atomic::Ordering::Acquire)
            )),
            "the copy's identity is kept, so a reused number is told apart"
        );
    }
}
