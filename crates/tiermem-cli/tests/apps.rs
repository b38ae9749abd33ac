//! `tiermem bench limited-run` (the helper the application benchmarks run every program through)
//! and `tiermem bench apps` (which starts the Python harness). The cgroup tests need root and a
//! memory cgroup; without them they print "SKIPPED: <reason>".

use std::process::{Command, Output};

use tiermem_cli::bench::apps::LimitedRunReport;
use tiermem_cli::bench::linux_swap::memory_hierarchy;

fn tiermem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tiermem")).args(args).output().expect("running tiermem")
}

fn skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (cgroup creation)".into());
    }
    memory_hierarchy().err().map(|e| e.to_string())
}

macro_rules! skip_unless_privileged {
    () => {
        if let Some(reason) = skip_reason() {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

fn limited_run(options: &[&str], program: &[&str]) -> (Output, LimitedRunReport) {
    let dir = tempfile::tempdir().unwrap();
    let result = dir.path().join("report.json");
    let mut args = vec!["bench", "limited-run", "--cgroup-prefix", "tiermem-apps-test", "--result"];
    let result_str = result.to_str().unwrap().to_owned();
    args.push(&result_str);
    args.extend_from_slice(options);
    args.push("--");
    args.extend_from_slice(program);
    let out = tiermem(&args);
    assert!(out.status.success(), "limited-run failed: {}", String::from_utf8_lossy(&out.stderr));
    let report = serde_json::from_str(&std::fs::read_to_string(&result).expect("a report")).expect("valid JSON");
    (out, report)
}

#[test]
fn bad_limited_run_arguments_fail_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "limited-run", "--no-swap", "--", "true"], "--no-swap needs --limit"),
        (&["bench", "limited-run", "--limit", "0", "--", "true"], "--limit must be positive"),
        (&["bench", "limited-run", "--timeout", "0", "--", "true"], "must be a positive number of seconds"),
        (&["bench", "limited-run", "--timeout", "1e99", "--", "true"], "at most a year"),
        (&["bench", "limited-run", "--swap-dir", "/tmp", "--", "true"], "--swap-bytes"),
        (&["bench", "limited-run", "--limit", "lots", "--", "true"], "'lots' is not a size"),
    ];
    for (args, needle) in cases {
        let out = tiermem(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: expected '{needle}' in: {err}");
    }
}

#[test]
fn limited_run_passes_output_through_and_reports_the_exit() {
    skip_unless_privileged!();
    // A size with a suffix, as `tiermem run --limit` takes it.
    let (out, report) = limited_run(&["--limit", "256MiB"], &["sh", "-c", "echo hello; exit 3"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n");
    assert_eq!(report.exit_code, Some(3));
    assert_eq!(report.signal, None);
    assert!(!report.timed_out);
    assert_eq!(report.limit_bytes, Some(268_435_456));
    assert!(report.wall_s > 0.0 && report.wall_s < 10.0);
}

#[test]
fn limited_run_reports_the_program_s_user_and_kernel_cpu_time() {
    skip_unless_privileged!();
    // A shell loop spends its time in user mode; dd reading 64 KiB blocks of /dev/zero spends
    // it in the kernel zeroing its buffer (with 1 KiB blocks the user-mode share of each call
    // was close to the kernel's, and one CI run measured more user than kernel time). Each runs in a child of the shell, which the shell
    // reaps, so the times are the whole tree's.
    let busy = ["sh", "-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"];
    let (_, user) = limited_run(&["--limit", "268435456"], &busy);
    let copy = ["sh", "-c", "dd if=/dev/zero of=/dev/null bs=64k count=400000 2>/dev/null"];
    let (_, kernel) = limited_run(&["--limit", "268435456"], &copy);
    let (user_s, sys_s) = (user.user_s.expect("user time"), user.sys_s.expect("kernel time"));
    assert!(user_s > 0.05 && user_s > 2.0 * sys_s, "a shell loop: {user:?}");
    assert!(user_s <= user.wall_s * 2.0 + 0.05, "at most two CPUs' worth: {user:?}");
    let (user_s, sys_s) = (kernel.user_s.expect("user time"), kernel.sys_s.expect("kernel time"));
    assert!(sys_s > 0.05 && sys_s > 3.0 * user_s, "system calls: {kernel:?}");
}

#[test]
fn limited_run_without_swap_oom_kills_a_program_over_its_limit() {
    skip_unless_privileged!();
    // 64 MiB of dirty anonymous memory in a 16 MiB cgroup without swap: the OOM killer must act.
    let program =
        ["python3", "-c", "b = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')"];
    if Command::new("python3").arg("-c").arg("pass").status().map(|s| !s.success()).unwrap_or(true) {
        eprintln!("SKIPPED: no python3 for the OOM test");
        return;
    }
    let (out, report) = limited_run(&["--limit", "16777216", "--no-swap"], &program);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("survived"));
    assert_eq!(report.signal, Some(9));
    assert!(report.oom_kills.unwrap_or(0) >= 1, "{report:?}");
}

/// A `tiermem run` stopped at the timeout passes the SIGTERM on to its program and still writes
/// its statistics: the snapshot the program wrote while it ran.
#[test]
fn a_tiermem_run_stopped_at_the_timeout_leaves_its_statistics() {
    skip_unless_privileged!();
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.json");
    let tiermem_bin = env!("CARGO_BIN_EXE_tiermem");
    let program =
        "a = bytearray(64 << 20)\nwhile True:\n    for i in range(0, len(a), 4096): a[i] = (a[i] + 1) % 256\n";
    let (_, report) = limited_run(
        &["--timeout", "4"],
        &[
            tiermem_bin,
            "run",
            "--limit",
            "16MiB",
            "--stats-json",
            stats.to_str().unwrap(),
            "--",
            "python3",
            "-c",
            program,
        ],
    );
    assert!(report.timed_out, "{report:?}");
    let text = std::fs::read_to_string(&stats).expect("statistics written after the SIGTERM");
    let stats: serde_json::Value = serde_json::from_str(&text).unwrap();
    // The program leaves SIGTERM at its default action: it writes its final statistics before
    // it ends by it (until 2026-12-07, only the snapshot it wrote at most 2 s before).
    assert_eq!(stats["exit"]["signal"], 15, "{stats}");
    assert_eq!((&stats["snapshot_processes"], &stats["unreported_processes"]), (&0.into(), &0.into()), "{stats}");
    assert_eq!(stats["processes"][0]["final"], true, "{stats}");
    let evictions = stats["merged"]["evictions"].as_u64().unwrap_or(0);
    assert!(evictions > 4096, "64 MiB swept under 16 MiB: {evictions} evictions");
}

#[test]
fn limited_run_kills_on_timeout_with_children() {
    skip_unless_privileged!();
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("child.pid");
    let script = format!("sleep 30 & echo $! > {}; wait", pid_file.display());
    let (_, report) = limited_run(&["--timeout", "0.5"], &["sh", "-c", &script]);
    assert!(report.timed_out);
    assert!(report.wall_s >= 0.5 && report.wall_s < 5.0, "{report:?}");
    let child: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    // The cgroup teardown killed the background child too (reaped by init, so no zombie stays).
    let gone = (0..100).any(|_| {
        let alive =
            std::fs::read_to_string(format!("/proc/{child}/stat")).map(|stat| !stat.contains(") Z")).unwrap_or(false);
        if alive {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        !alive
    });
    assert!(gone, "child {child} of the timed-out program survived");
}

#[test]
fn limited_run_with_a_swap_file_reports_and_removes_it() {
    skip_unless_privileged!();
    let dir = tempfile::Builder::new().prefix("tiermem-test-").tempdir_in(std::env::temp_dir()).unwrap();
    let dir_str = dir.path().to_str().unwrap().to_owned();
    let (_, report) =
        limited_run(&["--limit", "67108864", "--swap-dir", &dir_str, "--swap-bytes", "33554432"], &["true"]);
    assert_eq!(report.exit_code, Some(0));
    assert!(report.swap_file_bytes.unwrap() >= 33_554_432);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "swap file left behind");
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(!swaps.contains(&dir_str), "swap still active: {swaps}");
}

#[test]
fn bench_apps_starts_the_python_harness() {
    let out = tiermem(&["bench", "apps", "--help"]);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No module named") {
        eprintln!("SKIPPED: the harness's Python packages are not installed");
        return;
    }
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for option in ["--scale", "--systems", "--ratios", "--workloads", "--repeats", "--out"] {
        assert!(text.contains(option), "no {option} in: {text}");
    }
}

#[test]
fn bench_sim_anchor_checks_this_binary_s_simulator_against_libcachesim() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("anchor.json");
    let json_arg = json.to_str().unwrap();
    let out = tiermem(&[
        "bench",
        "sim-anchor",
        "--synthetic",
        "random:30000:600",
        "--local",
        "40%",
        "--no-stream",
        "--json",
        json_arg,
    ]);
    let (text, errors) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() && (errors.contains("No module named") || errors.contains("is not installed")) {
        eprintln!("SKIPPED: the harness's Python packages (libcachesim) are not installed");
        return;
    }
    assert!(out.status.success(), "{errors}");
    // This binary was the one measured (the harness hears of it through TIERMEM_BIN), and its
    // LRU and FIFO agree with libCacheSim's to the fault.
    for policy in ["lru ", "fifo "] {
        assert!(text.lines().any(|l| l.starts_with(policy)), "no {policy}row in: {text}");
    }
    assert!(!text.contains("DIFFER"), "{text}");
    let result: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let measured = std::fs::canonicalize(result["tiermem"].as_str().unwrap()).unwrap();
    assert_eq!(measured, std::fs::canonicalize(env!("CARGO_BIN_EXE_tiermem")).unwrap());
}
