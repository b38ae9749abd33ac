//! One measuring command on the machine at a time. Two benchmarks running at once time each
//! other (two CPUs, one disk, machine-wide swap counters), so `tiermem bench micro` holds an
//! exclusive flock on one file while it runs, the same file `tiermem bench apps` holds
//! (`bench/tiermem_bench/exclusive.py`); the lock goes with the process however it ends, and
//! the file names the holder for whoever comes next.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use tiermem_sys::{Error, ErrorKind, Result};

/// Put the lock file elsewhere (tests, or machines where /run/lock is not shared).
pub const LOCK_ENV: &str = "TIERMEM_BENCH_LOCK";

/// The machine's bench lock file.
pub fn lock_path() -> PathBuf {
    if let Some(path) = std::env::var_os(LOCK_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let run_lock = Path::new("/run/lock");
    let dir = if run_lock.is_dir() { run_lock.to_path_buf() } else { std::env::temp_dir() };
    dir.join("tiermem-bench.lock")
}

/// The lock, held until dropped (None: the lock file could not be opened, see [`lock_at`]).
#[derive(Debug)]
pub struct MachineLock(Option<File>);

impl MachineLock {
    /// Whether the lock is really held (false: the run goes on without one).
    pub fn held(&self) -> bool {
        self.0.is_some()
    }
}

/// Hold the machine's bench lock for `what` (the command, for the message another one gets).
pub fn machine_to_ourselves(what: &str) -> Result<MachineLock> {
    lock_at(&lock_path(), what)
}

/// Hold the lock at `path`, or fail with [`ErrorKind::Busy`] naming the holder. A lock file that
/// cannot be opened (another user's, a read-only directory) does not stop the run: it goes on
/// without the lock, after a note.
pub fn lock_at(path: &Path, what: &str) -> Result<MachineLock> {
    // Created only when missing: with fs.protected_regular, O_CREAT on a file someone else made
    // in a sticky directory such as /run/lock is refused even to root.
    let open = |create: bool| OpenOptions::new().read(true).write(true).create(create).mode(0o644).open(path);
    let opened = open(false).or_else(|e| if e.kind() == std::io::ErrorKind::NotFound { open(true) } else { Err(e) });
    let mut file = match opened {
        Ok(file) => file,
        Err(e) => {
            eprintln!(
                "NOTE: cannot open the bench lock {} ({e}); not checking for another benchmark running",
                path.display()
            );
            return Ok(MachineLock(None));
        }
    };
    if let Err(e) = rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        if e != rustix::io::Errno::WOULDBLOCK {
            return Err(Error::os(e.into(), format!("locking {}", path.display())));
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim();
        return Err(Error::new(
            ErrorKind::Busy,
            format!(
                "another benchmark is measuring on this machine ({}; lock {}): two at once would time each other; \
                 wait for it to end, or stop it first",
                if holder.is_empty() { "a process" } else { holder },
                path.display()
            ),
        ));
    }
    // Best effort: who holds it is only for the message of a command refused meanwhile.
    let _ = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "pid {}: {what}", std::process::id()));
    Ok(MachineLock(Some(file)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_named_until_the_first_lets_go() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("tiermem-bench.lock");
        let first = lock_at(&path, "tiermem bench apps --scale full").expect("a free lock");
        assert!(first.held());
        // flock locks belong to the open file, so a second open in this process conflicts too.
        let refused = lock_at(&path, "tiermem bench micro").expect_err("held by the first");
        assert_eq!(refused.kind(), ErrorKind::Busy);
        let message = refused.to_string();
        assert!(message.contains(&format!("pid {}: tiermem bench apps --scale full", std::process::id())), "{message}");
        assert!(message.contains("would time each other"), "{message}");
        drop(first);
        let _second = lock_at(&path, "tiermem bench micro").expect("free again");
        let text = std::fs::read_to_string(&path).expect("the lock file");
        assert_eq!(text, format!("pid {}: tiermem bench micro\n", std::process::id()));
    }

    #[test]
    fn a_lock_file_that_cannot_be_opened_does_not_stop_the_run() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let lock = lock_at(&dir.path().join("no-such-dir").join("lock"), "tiermem bench micro").expect("no refusal");
        assert!(!lock.held());
    }
}
