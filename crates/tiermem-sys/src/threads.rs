//! Threads that have started by the time their spawn returns.
//!
//! A thread's start touches fresh memory before its function runs: glibc makes it a malloc arena
//! on its first call (even a `free`) and a list for its thread-local destructors. Under the
//! preload's OOM guard, with its memory cgroup full, that first touch waits for memory the
//! engine's threads are there to free, or the arena's mapping is refused and glibc aborts. Seen:
//! the cgroup watch, spawned just after the guard went on, stuck in its own thread start, so the
//! guard never gave up and the run hung until `tiermem run`'s backstop killed it. Spawned this
//! way, a thread is past that before anything that could fill the cgroup happens.

use std::time::Duration;

/// How long [`spawn_running`] waits for the thread to start: far longer than a start takes (well
/// under a millisecond), short enough not to matter where the start cannot finish before the
/// caller goes on: glibc registers a thread's first thread-local destructor under the dynamic
/// loader's lock, which a caller inside `dlopen` (a library's constructor that starts the
/// engine) holds until it returns.
const START_WAIT: Duration = Duration::from_millis(200);

/// Spawn `f` on a thread named `name` (with `stack` bytes of stack if given) and return once it
/// runs (or after [`START_WAIT`] if it has not started by then).
pub fn spawn_running<F, T>(name: &str, stack: Option<usize>, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (started, running) = std::sync::mpsc::sync_channel::<()>(1);
    let mut builder = std::thread::Builder::new().name(name.into());
    if let Some(bytes) = stack {
        builder = builder.stack_size(bytes);
    }
    let handle = builder.spawn(move || {
        // Running our function: the thread's start is behind it.
        let _ = started.send(());
        drop(started);
        f()
    })?;
    let _ = running.recv_timeout(START_WAIT);
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names of this process's threads, from /proc.
    fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .expect("/proc/self/task")
            .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
            .map(|name| name.trim_end().to_owned())
            .collect()
    }

    /// The thread's start (here: its name, which Rust's start sets before the function runs) is
    /// done when spawn returns, every time.
    #[test]
    fn the_thread_has_started_by_the_time_spawn_returns() {
        for round in 0..50 {
            let (finish, wait) = std::sync::mpsc::channel::<()>();
            let handle = spawn_running("tiermem-started", Some(256 << 10), move || {
                let _ = wait.recv();
                7
            })
            .expect("spawn");
            assert!(
                thread_names().iter().any(|n| n == "tiermem-started"),
                "round {round}: no thread of that name yet: {:?}",
                thread_names()
            );
            finish.send(()).unwrap();
            assert_eq!(handle.join().unwrap(), 7);
        }
    }
}
