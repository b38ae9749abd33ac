//! Compiles `tests/c/smoke.c` against `include/tiermem.h` and the `libtiermem.so` cargo built for
//! this test run, runs it, and checks its result. The shared library is found next to this test
//! executable: cargo builds the package's library (every crate type, from the same compilation as
//! the rlib this test links) into `target/<profile>/deps` and copies it to `target/<profile>`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SKIPPED: i32 = 77;

fn find_cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test executable has a directory");
    let candidates = [deps.join("libtiermem.so"), deps.parent().map(|p| p.join("libtiermem.so")).unwrap_or_default()];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| panic!("libtiermem.so not found; looked at {candidates:?}"))
}

fn have_cc() -> bool {
    Command::new("cc").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn compile(lib: &Path, out: &Path, extra: &[&str]) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = lib.parent().expect("library has a directory");
    let status = Command::new("cc")
        .args(["-std=c99", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Wextra", "-Werror", "-g"])
        .args(extra)
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(manifest.join("tests/c/smoke.c"))
        .arg(lib)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(out)
        .status()
        .expect("running cc");
    assert!(status.success(), "compiling smoke.c failed: {status}");
}

/// Run `bin`, killing it if it takes longer than `limit`.
fn run(bin: &Path, limit: Duration) -> (Option<i32>, String, String) {
    let mut child = Command::new(bin).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning smoke");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("waiting for smoke").is_some() {
            break;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("collecting smoke output");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn evictions(stdout: &str) -> u64 {
    let json =
        stdout.lines().find_map(|l| l.strip_prefix("stats: ")).unwrap_or_else(|| panic!("no stats line in:\n{stdout}"));
    let value: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("stats are not JSON ({e}): {json}"));
    value["evictions"].as_u64().unwrap_or_else(|| panic!("no evictions counter in {json}"))
}

#[test]
fn c_smoke_program_runs_against_the_shared_library() {
    if !have_cc() {
        eprintln!("SKIPPED: no C compiler");
        return;
    }
    let lib = find_cdylib();
    let bin = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tiermem-capi-smoke-{}", std::process::id()));
    compile(&lib, &bin, &[]);
    let (code, stdout, stderr) = run(&bin, Duration::from_secs(120));
    let _ = std::fs::remove_file(&bin);
    if code == Some(SKIPPED) {
        eprintln!(
            "{}",
            stdout.lines().find(|l| l.starts_with("SKIPPED")).unwrap_or("SKIPPED: userfaultfd unavailable")
        );
        return;
    }
    assert_eq!(code, Some(0), "smoke.c failed (None = killed after 120 s)\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.lines().any(|l| l == "OK"), "{stdout}");
    let n = evictions(&stdout);
    assert!(n > 0, "a 4 MiB region under a 1 MiB limit evicted nothing: {stdout}");
    eprintln!("smoke.c passed: {n} evictions");
}

#[test]
fn header_is_valid_cxx() {
    if Command::new("c++").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_err() {
        eprintln!("SKIPPED: no C++ compiler");
        return;
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("c++")
        .args(["-x", "c++", "-std=c++11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-"])
        .arg("-I")
        .arg(manifest.join("include"))
        .stdin(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().expect("stdin").write_all(
                b"#include <tiermem.h>\n#include <tiermem.h>\nint main() { return tiermem_last_error() == nullptr; }\n",
            )?;
            child.wait()
        })
        .expect("running c++");
    assert!(status.success(), "tiermem.h does not compile as C++ (twice, for the include guard)");
}
