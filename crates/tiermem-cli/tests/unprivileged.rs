//! tiermem as an ordinary user: the microbenchmark run as uid 65534 (nobody) through setpriv,
//! with a locked-memory limit too small to register the I/O buffers. Without CAP_SYS_PTRACE and
//! with vm.unprivileged_userfaultfd = 0 (the kernel's default) such a process may only open a
//! userfaultfd for faults taken in user mode, which sigbus mode needs, and its file device
//! reads and writes through plain buffers. Needs root (to switch users) and setpriv/prlimit;
//! without them it prints "SKIPPED: <reason>".

use std::path::Path;
use std::process::{Command, Output};

/// One test at a time: the kernel counts an io_uring's locked memory per user, across every
/// process of nobody's, against each process's own 2 MiB limit, so two tests run side by side
/// (`cargo test` without `--test-threads=1`) failed each other's io_uring with ENOMEM.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why the test cannot run here, if it cannot.
fn skip_reason(binary: &Path) -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root to run tiermem as another user".into());
    }
    for tool in ["setpriv", "prlimit"] {
        if Command::new(tool).arg("--version").output().map(|o| !o.status.success()).unwrap_or(true) {
            return Some(format!("no {tool} (util-linux)"));
        }
    }
    // Every directory above the binary must let `nobody` through.
    let mut dir = binary.parent();
    while let Some(d) = dir {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d).map(|m| m.permissions().mode()).unwrap_or(0);
        if mode & 0o001 == 0 {
            return Some(format!("{} is not searchable by other users", d.display()));
        }
        dir = d.parent();
    }
    None
}

/// The tiermem binary, or None after printing why the test cannot run here.
fn tiermem_or_skip() -> Option<&'static Path> {
    let binary = Path::new(env!("CARGO_BIN_EXE_tiermem"));
    match skip_reason(binary) {
        Some(reason) => {
            eprintln!("SKIPPED: {reason}");
            None
        }
        None => Some(binary),
    }
}

/// `tiermem bench micro ARGS --json` as nobody, locked memory limited to 2 MiB (the I/O buffer
/// arena alone is 1 MiB or more and each queue would pin it again).
fn micro_as_nobody(binary: &Path, args: &[&str]) -> Output {
    Command::new("prlimit")
        .args(["--memlock=2097152:2097152", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(binary)
        .args(["bench", "micro", "--size-mb", "16", "--limit-mb", "8", "--dir", "/tmp", "--json"])
        .args(args)
        // Not the machine's bench lock: the test may run while a real benchmark holds it. A path
        // nobody cannot create, so the run goes on without a lock (and leaves no file behind).
        .env("TIERMEM_BENCH_LOCK", "/nonexistent-tiermem/bench.lock")
        .current_dir("/tmp")
        .output()
        .expect("running tiermem through prlimit and setpriv")
}

#[test]
fn an_ordinary_user_pages_through_a_user_mode_only_userfaultfd_and_plain_buffers() {
    let _alone = one_at_a_time();
    let Some(binary) = tiermem_or_skip() else { return };
    let out = micro_as_nobody(binary, &["--system", "tiermem-file,tiermem-mem"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tiermem bench micro as nobody failed: {stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = report["rows"].as_array().expect("rows");
    let systems: Vec<&str> = rows.iter().filter_map(|r| r["system"].as_str()).collect();
    assert_eq!(systems, ["tiermem-file", "tiermem-mem"], "{stderr}");
    for row in rows {
        assert_eq!(row["mismatched_pages"], 0, "{row}");
    }
    let engine = report["details"][0]["tiermem"]["engine"].as_str().expect("the file engine's description");
    assert!(engine.contains("plain buffers"), "2 MiB of locked memory cannot hold the fixed buffers: {engine}");

    // Handler-thread mode promises that system calls into evicted memory work; a user-mode-only
    // userfaultfd cannot keep that promise, so it is refused with the ways out.
    let unprivileged = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    if unprivileged.trim() != "0" {
        eprintln!("SKIPPED (thread-mode refusal): vm.unprivileged_userfaultfd is {}", unprivileged.trim());
        return;
    }
    // The probe says what such a user gets.
    let probe = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(binary)
        .arg("probe")
        .current_dir("/tmp")
        .output()
        .expect("running tiermem probe through setpriv");
    let said = String::from_utf8_lossy(&probe.stdout);
    assert!(said.contains("user-mode faults only"), "tiermem probe as nobody: {said}");
    let out = micro_as_nobody(binary, &["--system", "tiermem-mem", "--fault-mode", "thread"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "nothing could be measured: {stderr}");
    assert!(
        stderr.contains("fault mode thread") && stderr.contains("vm.unprivileged_userfaultfd=1"),
        "a refusal naming the fix: {stderr}"
    );
}

#[test]
fn an_ordinary_user_runs_a_program_under_tiermem_run() {
    let _alone = one_at_a_time();
    let Some(binary) = tiermem_or_skip() else { return };
    // 48 MiB touched page by page under a 16 MiB budget: most of it goes to the device and
    // comes back for the sum. Python's bytearray is one malloc, so the shim manages it.
    let job = "b = bytearray(48 << 20)\n\
               for i in range(0, len(b), 4096): b[i] = i // 4096 % 251\n\
               print('sum', sum(b[i] for i in range(0, len(b), 4096)))";
    let expected: u64 = (0..(48u64 << 20) / 4096).map(|page| page % 251).sum();
    let out = Command::new("prlimit")
        .args(["--memlock=8388608:8388608", "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"])
        .args(["env", "HOME=/tmp"])
        .arg(binary)
        .args(["run", "--limit", "16MiB", "--footprint", "64MiB", "--device", "file:/tmp", "--cgroup", "guard"])
        .args(["--", "python3", "-c", job])
        .current_dir("/tmp")
        .output()
        .expect("running tiermem run through prlimit and setpriv");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if stderr.contains("No such file or directory") && stderr.contains("python3") {
        eprintln!("SKIPPED: no python3 for uid 65534");
        return;
    }
    assert!(out.status.success(), "tiermem run as nobody failed: {stderr}");
    assert_eq!(stdout.trim(), format!("sum {expected}"), "{stderr}");
    assert!(stderr.contains("out ") && !stderr.contains("out 0.0 MiB"), "pages went to the device: {stderr}");
    // The OOM guard asked for could not change the cgroup for this user; nothing to put back.
    assert!(!stderr.contains("cannot restore"), "{stderr}");
    let unprivileged = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    if unprivileged.trim() == "0" {
        assert!(stderr.contains("left to glibc"), "the summary says where small allocations went: {stderr}");
    }
}
