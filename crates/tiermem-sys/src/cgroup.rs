//! Memory cgroup helpers shared by the preload shim and the CLI.

use std::path::Path;

/// Where cgroup v1 mounts its memory controller.
const V1_MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";

/// Move the calling thread, alone, to the parent of its v1 memory cgroup `dir`.
///
/// For a thread that watches a full cgroup: the kernel charges the kernel memory a thread
/// allocates (the buffer of a file read, an open file) to the thread's own cgroup, so in the
/// cgroup it watches such a read can wait for memory that the watcher itself is meant to free.
/// Only that kernel memory moves out: the thread's stack and heap belong to its process,
/// which v1 charges to the cgroup of the process's main thread. v2 moves whole processes only.
pub fn move_thread_to_parent_v1(dir: &Path) -> Result<(), String> {
    let parent = dir.parent().filter(|p| p.starts_with(V1_MEMORY_ROOT)).ok_or("it has no parent")?;
    let tasks = parent.join("tasks");
    std::fs::write(&tasks, rustix::thread::gettid().as_raw_nonzero().to_string())
        .map_err(|e| format!("cannot write {}: {e}", tasks.display()))
}
