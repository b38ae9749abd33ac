//! Memory cgroup helpers shared by the preload shim and the CLI.

use std::path::Path;

/// Where cgroup v1 mounts its memory controller.
const V1_MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// This process's v1 memory cgroup's directory (None without a v1 memory controller).
pub fn own_v1_memory_dir() -> Option<std::path::PathBuf> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroups.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| Path::new(V1_MEMORY_ROOT).join(path.trim_start_matches('/')))
    })
}

/// The parent of v1 memory cgroup `dir`, if it has one in the hierarchy.
pub fn v1_parent(dir: &Path) -> Option<&Path> {
    dir.parent().filter(|p| p.starts_with(V1_MEMORY_ROOT))
}

/// Move this whole process (every thread) to the parent of its v1 memory cgroup `dir`.
pub fn move_process_to_parent_v1(dir: &Path) -> Result<(), String> {
    let procs = v1_parent(dir).ok_or("it has no parent")?.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string()).map_err(|e| format!("cannot write {}: {e}", procs.display()))
}

/// Write this process's pid to `procs_file` (a cgroup's `cgroup.procs`), without allocating:
/// for a child between fork and exec, joining the cgroup its program is to run in.
pub fn join_cgroup_in_child(procs_file: &std::ffi::CStr) -> std::io::Result<()> {
    let mut digits = [0u8; 20];
    let pid = crate::messages::decimal(i64::from(rustix::process::getpid().as_raw_nonzero().get()), &mut digits);
    let file = rustix::fs::open(
        procs_file,
        rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    rustix::io::write(&file, pid.as_bytes())?;
    Ok(())
}

/// Move the calling thread, alone, to the parent of its v1 memory cgroup `dir`.
///
/// For a thread that watches a full cgroup: the kernel charges the kernel memory a thread
/// allocates (the buffer of a file read, an open file) to the thread's own cgroup, so in the
/// cgroup it watches such a read can wait for memory that the watcher itself is meant to free.
/// Only that kernel memory moves out: the thread's stack and heap belong to its process,
/// which v1 charges to the cgroup of the process's main thread. v2 moves whole processes only.
pub fn move_thread_to_parent_v1(dir: &Path) -> Result<(), String> {
    let tasks = v1_parent(dir).ok_or("it has no parent")?.join("tasks");
    std::fs::write(&tasks, rustix::thread::gettid().as_raw_nonzero().to_string())
        .map_err(|e| format!("cannot write {}: {e}", tasks.display()))
}

/// What a v1 `memory.oom_control` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomControl {
    /// `oom_kill_disable`: the cgroup's OOM killer is off.
    pub killer_off: bool,
    /// `under_oom`: a task of the cgroup waits for memory now.
    pub under_oom: bool,
}

/// Read an open v1 `memory.oom_control` from its start, into a buffer on the stack: the
/// kernel reuses the buffer of the first read, so a read allocates nothing, in the kernel or
/// here, even while the cgroup has no memory left.
pub fn read_oom_control(control: &std::fs::File) -> Option<OomControl> {
    use std::os::unix::fs::FileExt;
    let mut text = [0u8; 256];
    let n = control.read_at(&mut text, 0).ok()?;
    let text = std::str::from_utf8(&text[..n]).ok()?;
    let field = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)).map(|v| v.trim() != "0");
    Some(OomControl { killer_off: field("oom_kill_disable ")?, under_oom: field("under_oom ")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_control_is_read_from_its_start_every_time() {
        let path = std::env::temp_dir().join(format!("tiermem-oom-control-{}", std::process::id()));
        std::fs::write(&path, "oom_kill_disable 1\nunder_oom 0\noom_kill 3\n").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let read = read_oom_control(&file);
        // A second read of the same descriptor sees the same text (no offset carried over).
        let again = read_oom_control(&file);
        std::fs::write(&path, "under_oom 1\n").unwrap();
        let partial = read_oom_control(&std::fs::File::open(&path).unwrap());
        std::fs::remove_file(&path).unwrap();
        assert_eq!(read, Some(OomControl { killer_off: true, under_oom: false }));
        assert_eq!(again, read);
        assert_eq!(partial, None, "a text without oom_kill_disable is not a reading");
    }
}
