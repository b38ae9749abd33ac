//! What a child does between fork and exec to stay tied to the process that started it.

use rustix::process::{getppid, set_parent_process_death_signal, Pid, Signal};

/// Between fork and exec: have the kernel kill this child (SIGKILL) when `parent`, the process
/// that forked it, dies, so a program under test does not run on, holding its cgroup and swap
/// file, after its runner was killed outright. Fails if `parent` died before the request (the
/// signal would never come). Raw system calls only, nothing allocated: safe in a pre-exec hook.
pub fn die_with_parent(parent: Pid) -> std::io::Result<()> {
    set_parent_process_death_signal(Some(Signal::KILL))?;
    if getppid() != Some(parent) {
        return Err(rustix::io::Errno::SRCH.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    #[test]
    fn a_child_tied_to_a_parent_that_is_not_its_own_does_not_start() {
        let us = rustix::process::getpid();
        // Tied to us: starts.
        let mut tied = std::process::Command::new("true");
        // SAFETY: the hook makes raw system calls only.
        unsafe { tied.pre_exec(move || die_with_parent(us)) };
        assert!(tied.status().unwrap().success());
        // Tied to a parent it does not have (pid 1): refused before exec.
        let mut wrong = std::process::Command::new("true");
        let init = Pid::from_raw(1).unwrap();
        // SAFETY: as above.
        unsafe { wrong.pre_exec(move || die_with_parent(init)) };
        let e = wrong.status().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ESRCH), "{e}");
    }
}
