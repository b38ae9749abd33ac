//! The `tiermem` binary as a user meets it: bad input gives a clear message and a non-zero exit;
//! a small microbenchmark runs and verifies every page.

use std::process::{Command, Output};

fn tiermem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tiermem"))
        .args(args)
        // A bench lock of the tests' own: not the machine's, which a real benchmark may hold.
        .env("TIERMEM_BENCH_LOCK", std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench.lock"))
        .output()
        .expect("running tiermem")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_micro_arguments_fail_with_a_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "micro", "--size-mb", "0"], "size"),
        (&["bench", "micro", "--size-mb", "10", "--limit-mb", "20"], "limit"),
        (&["bench", "micro", "--limit-mb", "0"], "limit"),
        (&["bench", "micro", "--dir", "/nonexistent/tiermem"], "/nonexistent/tiermem"),
        (&["bench", "micro", "--fault-mode", "telepathy"], "unknown fault mode 'telepathy'"),
        (&["bench", "micro", "--system", "zswap"], "zswap"),
        (&["bench", "micro", "--size-mb", "lots"], "lots"),
        (&["bench", "micro", "--read-runs", "yes"], "--read-runs 'yes': expected on or off"),
        (&["bench", "micro", "--prefetch-governor", "yes"], "--prefetch-governor 'yes': expected on or off"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in cases {
        let out = tiermem(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr(&out).contains(needle), "{args:?}: expected '{needle}' in: {}", stderr(&out));
    }
}

#[test]
fn probe_reports_every_feature() {
    let out = tiermem(&["probe"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for feature in
        ["MISSING", "WP", "COPY_MODE_WP", "WP_ASYNC", "PAGEMAP_SCAN", "SIGBUS", "MOVE", "MINOR", "device file"]
    {
        assert!(text.contains(feature), "probe output lacks {feature}:\n{text}");
    }
}

#[test]
fn probe_describes_the_machine_and_what_paging_costs_on_it() {
    let out = tiermem(&["probe", "--machine", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("probe JSON");
    let cpus = json["machine"]["cpus"].as_u64().expect("a CPU count");
    assert!(cpus >= 1, "{json}");
    assert!(json["costs"]["page_map_us"].as_f64().is_some_and(|us| us > 0.0), "{json}");
    if cpus < 2 {
        eprintln!("SKIPPED the TLB shootdown figure: this process may use one CPU only");
    } else {
        assert!(json["costs"]["tlb_shootdown_us"].as_f64().is_some_and(|us| us >= 0.0), "{json}");
        assert!(json["costs"]["thread_wakeup_us"].as_f64().is_some_and(|us| us > 0.0), "{json}");
    }
    // The kernel's own round trip of a fault served on the faulting thread, from a worker
    // process: the whole trip holds its UFFDIO_COPY, and delivery is the rest.
    let trip = &json["costs"]["fault_round_trip"];
    let (p50, mean, copy, delivery) = (
        trip["p50_us"].as_f64().expect("p50_us"),
        trip["mean_us"].as_f64().expect("mean_us"),
        trip["copy_us"].as_f64().expect("copy_us"),
        trip["delivery_us"].as_f64().expect("delivery_us"),
    );
    assert!(p50 > 0.0 && copy > 0.0 && mean > copy, "{trip}");
    assert!((mean - copy - delivery).abs() < 1e-6, "{trip}");
    assert_eq!(trip["faults"].as_u64(), Some(tiermem_cli::machine::ROUND_TRIP_FAULTS as u64), "{trip}");
    let out = tiermem(&["probe", "--machine"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("machine ") && text.contains("TLB shootdown") && text.contains("UFFDIO_COPY"), "{text}");
    assert!(text.contains("fault served on the faulting thread"), "{text}");
}

#[test]
fn a_fault_round_trip_worker_that_cannot_start_is_an_error_not_a_figure() {
    let missing = std::path::Path::new("/nonexistent/tiermem");
    let e = tiermem_cli::machine::fault_round_trip_in_worker(missing).expect_err("no such worker");
    assert!(e.to_string().contains("/nonexistent/tiermem"), "{e}");
    // A worker that runs but prints no figure (`true` ignores its argument) is refused too.
    let e = tiermem_cli::machine::fault_round_trip_in_worker(std::path::Path::new("/bin/true")).expect_err("no JSON");
    assert!(e.to_string().contains("output"), "{e}");
    // One that never finishes is killed at its deadline, and that is an error too.
    let dir = tempfile::tempdir().unwrap();
    let stuck = dir.path().join("stuck-worker");
    std::fs::write(&stuck, "#!/bin/sh\nexec sleep 60\n").unwrap();
    std::fs::set_permissions(&stuck, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let started = std::time::Instant::now();
    let e = tiermem_cli::machine::fault_round_trip_in_worker_within(&stuck, std::time::Duration::from_millis(300))
        .expect_err("a stuck worker");
    assert!(e.to_string().contains("killed"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "the deadline was kept");
}

#[test]
fn probe_measures_the_device_latency_where_asked_and_fails_where_it_cannot() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temporary directory");
    let dir_arg = dir.path().to_str().expect("utf-8 path");
    let out = tiermem(&["probe", "--dir", dir_arg, "--latency", "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() && text.contains("\"device_read_latency_us\":null") {
        eprintln!("SKIPPED probe latency: no device file in {dir_arg}: {}", stderr(&out));
    } else {
        assert!(out.status.success(), "{}", stderr(&out));
        let json: serde_json::Value = serde_json::from_str(&text).expect("probe JSON");
        let us = json["device_read_latency_us"].as_f64().expect("a latency in the JSON");
        assert!(us > 0.0 && us < 1e6, "{us} µs");
        // The request rate with 32 reads in flight: a disk serves queued reads no slower than
        // single ones, so at least what one read at a time gives (half of it, for a disk whose
        // speed drifts between the two measurements).
        let rate = &json["device_read_rate"];
        assert_eq!(rate["depth"].as_u64(), Some(32), "{rate}");
        let per_s = rate["reads_per_s"].as_f64().expect("a rate in the JSON");
        assert!(per_s.is_finite() && per_s >= 0.5e6 / us, "{per_s} reads a second against {us} µs a read");
        // The temporary device file is gone again.
        assert_eq!(std::fs::read_dir(dir.path()).expect("listing").count(), 0);
    }
    // /proc is a directory where no device file can be made.
    let out = tiermem(&["probe", "--dir", "/proc", "--latency"]);
    assert!(!out.status.success(), "asked for a latency it cannot measure, and succeeded");
    assert!(stderr(&out).contains("--latency: no usable device file in /proc"), "{}", stderr(&out));
    // Without --latency the probe only reports the unusable directory.
    assert!(tiermem(&["probe", "--dir", "/proc"]).status.success());
    // A --dir that is not a directory at all is a mistake, with or without --latency.
    for args in [&["probe", "--dir", "/nonexistent/tiermem"][..], &["probe", "--dir", "/etc/hostname", "--latency"][..]]
    {
        let out = tiermem(args);
        assert!(!out.status.success() && stderr(&out).contains("--dir"), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn small_micro_run_verifies_every_page_on_mem_and_file() {
    let probe = tiermem_sys::probe::KernelFeatures::probe();
    if !probe.userfaultfd || !probe.wp {
        eprintln!("SKIPPED small_micro_run: userfaultfd with WP unavailable ({:?})", probe.error);
        return;
    }
    let out = tiermem(&[
        "bench",
        "micro",
        "--system",
        "tiermem-mem,tiermem-file",
        "--size-mb",
        "16",
        "--limit-mb",
        "8",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = json["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{json}");
    for row in rows {
        assert_eq!(row["mismatched_pages"], 0, "{row}");
        assert!(row["read_us"].as_f64().unwrap() > 0.0);
        // A critical fault contains its device read, at the median as on average.
        let (fault, read) = (row["critical_fault_p50_us"].as_f64(), row["critical_read_p50_us"].as_f64());
        if let (Some(fault), Some(read)) = (fault, read) {
            assert!(fault >= read && read > 0.0, "{row}");
        }
    }
    // The kernel's own cost of mapping a page, the floor of the engine share, is measured too.
    let map_us = json["page_map_us"].as_f64().expect("page_map_us");
    assert!(map_us > 0.0 && map_us < 1000.0, "{json}");
    // So is the kernel's round trip of a fault on the faulting thread (the default sigbus mode).
    let trip_us = json["fault_round_trip"]["p50_us"].as_f64().expect("fault_round_trip");
    assert!(trip_us > 0.0 && trip_us < 1000.0, "{json}");
    // And the copy from a buffer a device read has just filled (a file device was measured).
    let after_read_us = json["page_map_after_read_us"].as_f64().expect("page_map_after_read_us");
    assert!(after_read_us > 0.0 && after_read_us < 1000.0, "{json}");
    for detail in json["details"].as_array().unwrap() {
        let stats = &detail["tiermem"]["stats"];
        assert!(stats["evictions"].as_u64().unwrap() >= 2048, "8 MiB of 16 must have left: {stats}");
        assert!(stats["peak_resident_pages"].as_u64().unwrap() <= 2048, "budget exceeded: {stats}");
    }
}
