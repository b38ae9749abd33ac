//! `tiermem probe --machine`: the facts about the machine that decide what paging costs on it,
//! and four of those costs measured. On a VM they differ from bare metal by an order of
//! magnitude (an inter-processor interrupt is a VM exit on both sides; a halted vCPU takes a
//! host wake-up), and they explain figures that would otherwise look like engine faults: each
//! eviction of a scattered page pays one TLB shootdown, each fault a handler thread serves pays
//! two thread wake-ups, each fault served on the faulting thread the kernel's own signal round trip.
//! The benchmark harness records this next to its results.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tiermem_sys::{Error, Result, PAGE_SIZE};

/// What `/proc` and `/sys` say about the machine (nothing measured). `None`: not exposed here.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MachineFacts {
    /// CPUs this process may run on.
    pub cpus: usize,
    /// MemTotal.
    pub memory_bytes: Option<u64>,
    /// The CPU reports running under a hypervisor (the `hypervisor` flag of /proc/cpuinfo).
    pub virtual_machine: bool,
    /// The cpuidle driver in use (`haltpoll` in a KVM guest that polls before halting).
    pub cpuidle_driver: Option<String>,
    /// How long an idle vCPU polls before it halts (haltpoll's guest_halt_poll_ns); 0 means
    /// every wake-up of an idle CPU goes through the host.
    pub guest_halt_poll_ns: Option<u64>,
    /// Free page reporting to the host (virtio-balloon): the smallest order of free blocks given
    /// back. Memory given back costs a host fault when the guest uses it again.
    pub free_page_reporting_order: Option<u32>,
    /// Transparent huge pages mode (`always`, `madvise`, `never`).
    pub transparent_hugepages: Option<String>,
    /// Swap areas active now (/proc/swaps).
    pub active_swap_areas: Option<usize>,
    /// zswap compressing swapped pages in memory.
    pub zswap: Option<bool>,
    /// DAMON sysfs kdamonds running now (someone else's keep the sysfs interface busy).
    pub damon_kdamonds_running: Option<usize>,
}

/// Costs measured on this machine, in µs. `None`: not measurable here (one CPU).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MachineCosts {
    /// MADV_DONTNEED of one present page, nothing else of the process running.
    pub unmap_alone_us: f64,
    /// The same while another thread of the process runs on another CPU, whose TLB must then be
    /// flushed by an inter-processor interrupt.
    pub unmap_with_busy_thread_us: Option<f64>,
    /// The difference: what one TLB shootdown adds.
    pub tlb_shootdown_us: Option<f64>,
    /// One thread waking another that sleeps on an eventfd on another CPU: half the median
    /// round trip.
    pub thread_wakeup_us: Option<f64>,
    /// UFFDIO_COPY of a 4 KiB page into a fresh registered mapping: the kernel's part of every
    /// page-in.
    pub page_map_us: f64,
    /// A fault served on the faulting thread with nothing but the kernel's work in it (None:
    /// not measured: no worker to measure it in, or the worker failed, which a note on stderr
    /// explains).
    pub fault_round_trip: Option<FaultRoundTrip>,
}

/// What the kernel alone makes a fault served on the faulting thread cost (`sigbus` mode): the
/// access to a missing page of a userfaultfd region registered for SIGBUS, the signal's
/// delivery, a handler that only maps a page with UFFDIO_COPY, and the return into the retried
/// access. No user-space pager can serve a fault this way for less, so it is the floor under
/// every critical fault besides its device read.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct FaultRoundTrip {
    /// The whole round trip as the faulting code sees it, median, µs.
    pub p50_us: f64,
    /// The same, mean, µs.
    pub mean_us: f64,
    /// Of it, the UFFDIO_COPY inside the handler (mean, µs).
    pub copy_us: f64,
    /// The rest (mean, µs): the kernel's fault entry, the signal frame and delivery, the return
    /// through sigreturn.
    pub delivery_us: f64,
    /// Faults timed.
    pub faults: usize,
}

/// Read the facts. Never fails: what cannot be read is `None`.
pub fn facts() -> MachineFacts {
    MachineFacts { cpus: allowed_cpus().len(), ..facts_from(Path::new("/")) }
}

/// [`facts`] with `/proc` and `/sys` under `root` (tests give a made-up tree).
pub fn facts_from(root: &Path) -> MachineFacts {
    let read = |path: &str| std::fs::read_to_string(root.join(path)).ok();
    let trimmed = |path: &str| read(path).map(|s| s.trim().to_string()).filter(|s| !s.is_empty());
    let number = |path: &str| trimmed(path).and_then(|s| s.parse::<u64>().ok());
    let cpuinfo = read("proc/cpuinfo").unwrap_or_default();
    let kdamonds = std::fs::read_dir(root.join("sys/kernel/mm/damon/admin/kdamonds")).ok().map(|dir| {
        dir.flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("state")).is_ok_and(|s| s.trim() == "on"))
            .count()
    });
    MachineFacts {
        // The machine's CPUs; `facts` narrows this to the ones this process may use.
        cpus: cpuinfo_processors(&cpuinfo),
        memory_bytes: read("proc/meminfo").and_then(|m| meminfo_bytes(&m, "MemTotal")),
        virtual_machine: cpuinfo_has_flag(&cpuinfo, "hypervisor"),
        cpuidle_driver: trimmed("sys/devices/system/cpu/cpuidle/current_driver"),
        guest_halt_poll_ns: number("sys/module/haltpoll/parameters/guest_halt_poll_ns"),
        free_page_reporting_order: number("sys/module/page_reporting/parameters/page_reporting_order")
            .map(|o| o as u32),
        transparent_hugepages: read("sys/kernel/mm/transparent_hugepage/enabled").and_then(|s| bracketed(&s)),
        active_swap_areas: read("proc/swaps").map(|s| s.lines().skip(1).filter(|l| !l.trim().is_empty()).count()),
        zswap: trimmed("sys/module/zswap/parameters/enabled").map(|s| s == "Y" || s == "1"),
        damon_kdamonds_running: kdamonds,
    }
}

fn cpuinfo_has_flag(cpuinfo: &str, flag: &str) -> bool {
    cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_once(':').is_some_and(|(_, flags)| flags.split_whitespace().any(|f| f == flag)))
}

fn cpuinfo_processors(cpuinfo: &str) -> usize {
    cpuinfo.lines().filter(|l| l.starts_with("processor")).count()
}

/// A /proc/meminfo field (`MemTotal`, `MemAvailable`) in bytes.
pub(crate) fn meminfo_bytes(meminfo: &str, key: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The selected value of a sysfs choice list: `always [madvise] never` gives `madvise`.
fn bracketed(choices: &str) -> Option<String> {
    let start = choices.find('[')? + 1;
    let end = start + choices[start..].find(']')?;
    Some(choices[start..end].to_string())
}

/// The CPUs this thread may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; the size and pointer describe `set`.
    let ok = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } == 0;
    if !ok {
        return vec![0];
    }
    // SAFETY: CPU_ISSET reads a bit of the initialised set, for an index below CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Keep the calling thread on `cpus` (best effort: a failure only makes a figure less exact).
fn set_affinity(cpus: &[usize]) {
    // SAFETY: cpu_set_t is plain data, for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: sets one bit of `set`, for an index below CPU_SETSIZE (filtered above).
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: pid 0 is this thread; the size and pointer describe `set`.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

fn pin_to(cpu: usize) {
    set_affinity(&[cpu]);
}

/// Pages dropped one by one per unmapping figure.
const UNMAP_PAGES: usize = 2000;
/// Round trips timed for the wake-up figure.
const WAKEUPS: usize = 2000;
/// Pages mapped for the page-map figure.
const MAPPED_PAGES: usize = 2000;

/// Measure the costs (well under a second). Runs threads of its own; the calling thread's CPU
/// affinity is restored afterwards. With `worker` (a `tiermem` executable), the fault round trip
/// is measured in a process of its own started from it ([`fault_round_trip_in_worker`]).
pub fn costs(worker: Option<&Path>) -> Result<MachineCosts> {
    let cpus = allowed_cpus();
    let (here, there) = (cpus[0], cpus.get(1).copied());
    let unmap_alone_us = on_cpu_then_restore(&cpus, here, || mean_unmap_us(None))?;
    let unmap_with_busy_thread_us = match there {
        Some(other) => Some(on_cpu_then_restore(&cpus, here, || mean_unmap_us(Some(other)))?),
        None => None,
    };
    let thread_wakeup_us = match there {
        Some(other) => Some(on_cpu_then_restore(&cpus, here, || wakeup_us(other))?),
        None => None,
    };
    Ok(MachineCosts {
        unmap_alone_us,
        unmap_with_busy_thread_us,
        tlb_shootdown_us: unmap_with_busy_thread_us.map(|busy| (busy - unmap_alone_us).max(0.0)),
        thread_wakeup_us,
        page_map_us: crate::bench::micro_tiermem::page_map_latency_us(MAPPED_PAGES)?,
        fault_round_trip: worker.and_then(|w| match fault_round_trip_in_worker(w) {
            Ok(trip) => Some(trip),
            Err(e) => {
                eprintln!("tiermem: note: the fault round trip was not measured: {e}");
                None
            }
        }),
    })
}

/// The hidden subcommand of `tiermem` that runs [`measure_fault_round_trip`] and prints it as
/// JSON.
pub const FAULT_WORKER_COMMAND: &str = "fault-round-trip-worker";
/// Faults timed for the round-trip figure.
pub const ROUND_TRIP_FAULTS: usize = 4000;

/// How long the worker may take (it needs well under a second) before it is killed.
const ROUND_TRIP_WORKER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// [`measure_fault_round_trip`] in a fresh process started from `worker` (a `tiermem`
/// executable): its SIGBUS handler then cannot meet an engine's, or a test's running alongside.
/// A worker that has not finished after 30 s is killed, and that is an error.
pub fn fault_round_trip_in_worker(worker: &Path) -> Result<FaultRoundTrip> {
    fault_round_trip_in_worker_within(worker, ROUND_TRIP_WORKER_DEADLINE)
}

/// [`fault_round_trip_in_worker`] with a deadline of `deadline`.
pub fn fault_round_trip_in_worker_within(worker: &Path, deadline: std::time::Duration) -> Result<FaultRoundTrip> {
    use std::io::Read;
    let mut child = std::process::Command::new(worker)
        .arg(FAULT_WORKER_COMMAND)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::os(e, format!("starting {} {FAULT_WORKER_COMMAND}", worker.display())))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::new(
                    tiermem_sys::ErrorKind::Internal,
                    format!("the fault round-trip worker did not finish in {deadline:?}: killed"),
                ));
            }
            Err(e) => return Err(Error::os(e, "waiting for the fault round-trip worker")),
        }
    };
    // Its output is a line of JSON or a short error: it fits the pipes, so nothing waited on them.
    let (mut stdout, mut stderr) = (Vec::new(), String::new());
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_end(&mut stdout);
    }
    if let Some(mut err) = child.stderr.take() {
        let _ = err.read_to_string(&mut stderr);
    }
    if !status.success() {
        return Err(Error::new(
            tiermem_sys::ErrorKind::Internal,
            format!("the fault round-trip worker ended with {status}: {}", stderr.trim()),
        ));
    }
    serde_json::from_slice(&stdout)
        .map_err(|e| Error::new(tiermem_sys::ErrorKind::Internal, format!("the fault round-trip worker's output: {e}")))
}

/// The descriptor, the registered range, the source page and the time spent copying of
/// [`measure_fault_round_trip`], for its signal handler (set only while it runs).
static ROUND_TRIP_UFFD: AtomicPtr<tiermem_sys::uffd::Uffd> = AtomicPtr::new(std::ptr::null_mut());
static ROUND_TRIP_SOURCE: AtomicPtr<u8> = AtomicPtr::new(std::ptr::null_mut());
static ROUND_TRIP_START: AtomicUsize = AtomicUsize::new(0);
static ROUND_TRIP_END: AtomicUsize = AtomicUsize::new(0);
static ROUND_TRIP_COPY_NS: AtomicU64 = AtomicU64::new(0);

/// Serve one fault of the round-trip measurement: map the source page there. Anything else
/// (a SIGBUS sent by someone, a fault outside the registered range, a copy the kernel refuses)
/// gets the default action back, so the retried access or the signal ends the worker instead of
/// faulting forever; the parent reports how it ended. Only atomics, clock_gettime and two
/// system calls here, nothing that allocates or locks.
extern "C" fn on_round_trip_fault(_sig: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    let started = Instant::now();
    let give_up = || {
        // SAFETY: resetting SIGBUS to its default disposition (async-signal-safe).
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    };
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let info = unsafe { &*info };
    // A sent signal (si_code <= 0) carries no fault address.
    if info.si_code <= 0 {
        return give_up();
    }
    // SAFETY: a fault's SIGBUS siginfo carries the faulting address.
    let addr = unsafe { info.si_addr() } as usize & !(PAGE_SIZE - 1);
    let uffd = ROUND_TRIP_UFFD.load(Ordering::Acquire);
    let source = ROUND_TRIP_SOURCE.load(Ordering::Acquire);
    let ours = (ROUND_TRIP_START.load(Ordering::Acquire)..ROUND_TRIP_END.load(Ordering::Acquire)).contains(&addr);
    if uffd.is_null() || source.is_null() || !ours {
        return give_up();
    }
    // SAFETY: both pointers are published only while the measurement's descriptor and source
    // page live, and `addr` was checked to lie in its registered mapping.
    let uffd = unsafe { &*uffd };
    // SAFETY: `source` is one readable page; `addr` is the faulting page of the registered
    // mapping, which is missing (that is why it faulted).
    if unsafe { uffd.copy(addr as *mut u8, source, PAGE_SIZE, false, false) }.is_err() {
        return give_up();
    }
    ROUND_TRIP_COPY_NS.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Time `faults` faults served on the faulting thread by a handler that only maps the page
/// (see [`FaultRoundTrip`]). Installs a SIGBUS handler for the duration and puts the previous
/// disposition back; meant for a process of its own ([`fault_round_trip_in_worker`]), since an
/// engine in `sigbus` mode in the same process would lose its faults meanwhile.
pub fn measure_fault_round_trip(faults: usize) -> Result<FaultRoundTrip> {
    use tiermem_sys::uffd::{Features, RegisterMode, Uffd};
    let faults = faults.max(1);
    let uffd = Uffd::open(Features::SIGBUS, true)?;
    let target = tiermem_sys::mem::Mapping::anonymous(faults * PAGE_SIZE, false)?;
    uffd.register(target.as_ptr(), target.len(), RegisterMode { missing: true, write_protect: false })?;
    let source = vec![0x5au8; PAGE_SIZE];
    let mut samples = Vec::with_capacity(faults);
    let unpublish = || {
        ROUND_TRIP_UFFD.store(std::ptr::null_mut(), Ordering::Release);
        ROUND_TRIP_SOURCE.store(std::ptr::null_mut(), Ordering::Release);
        ROUND_TRIP_END.store(0, Ordering::Release);
    };
    ROUND_TRIP_COPY_NS.store(0, Ordering::Relaxed);
    ROUND_TRIP_START.store(target.as_ptr() as usize, Ordering::Release);
    ROUND_TRIP_END.store(target.as_ptr() as usize + target.len(), Ordering::Release);
    ROUND_TRIP_SOURCE.store(source.as_ptr().cast_mut(), Ordering::Release);
    ROUND_TRIP_UFFD.store(std::ptr::from_ref(&uffd).cast_mut(), Ordering::Release);
    // SAFETY: sigaction is plain data; all zeroes is no flags and (on Linux) an empty mask.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_round_trip_fault as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: empties the mask of the action owned here.
    unsafe { libc::sigemptyset(&mut action.sa_mask) };
    // SAFETY: as above, filled in by the call.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: installs a handler for SIGBUS with a valid action; the previous one is kept.
    if unsafe { libc::sigaction(libc::SIGBUS, &action, &mut previous) } != 0 {
        unpublish();
        return Err(Error::os(std::io::Error::last_os_error(), "sigaction(SIGBUS)"));
    }
    for page in 0..faults {
        let byte = target.as_ptr().wrapping_add(page * PAGE_SIZE);
        let started = Instant::now();
        // SAFETY: a never-touched page of `target`: the read faults, the handler maps the source
        // page there, and the read runs again and returns its first byte.
        let value = unsafe { byte.read_volatile() };
        samples.push(started.elapsed().as_nanos() as u64);
        std::hint::black_box(value);
    }
    // SAFETY: puts back the disposition saved above.
    unsafe { libc::sigaction(libc::SIGBUS, &previous, std::ptr::null_mut()) };
    unpublish();
    let total: u64 = samples.iter().sum();
    samples.sort_unstable();
    let mean_us = total as f64 / faults as f64 / 1e3;
    let copy_us = ROUND_TRIP_COPY_NS.load(Ordering::Relaxed) as f64 / faults as f64 / 1e3;
    Ok(FaultRoundTrip {
        p50_us: samples[faults / 2] as f64 / 1e3,
        mean_us,
        copy_us,
        delivery_us: (mean_us - copy_us).max(0.0),
        faults,
    })
}

fn on_cpu_then_restore<T>(allowed: &[usize], cpu: usize, f: impl FnOnce() -> Result<T>) -> Result<T> {
    pin_to(cpu);
    let out = f();
    set_affinity(allowed);
    out
}

/// Mean µs of MADV_DONTNEED on one present page, with a thread of this process spinning on
/// `busy_cpu` meanwhile (or none).
fn mean_unmap_us(busy_cpu: Option<usize>) -> Result<f64> {
    let region = tiermem_sys::mem::Mapping::anonymous(UNMAP_PAGES * PAGE_SIZE, false)?;
    let base = region.as_ptr();
    for page in 0..UNMAP_PAGES {
        let byte = base.wrapping_add(page * PAGE_SIZE);
        // SAFETY: inside the fresh private mapping; a write makes the page present.
        unsafe { byte.write_volatile(1) };
    }
    let stop = AtomicBool::new(false);
    let running = AtomicBool::new(false);
    std::thread::scope(|scope| {
        if let Some(cpu) = busy_cpu {
            let (stop, running) = (&stop, &running);
            scope.spawn(move || {
                pin_to(cpu);
                running.store(true, Ordering::Release);
                while !stop.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            while !running.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
        }
        let started = Instant::now();
        let mut result = Ok(());
        for page in 0..UNMAP_PAGES {
            // SAFETY: a page of `region`, which nothing else uses; dropping it loses nothing.
            if let Err(e) = unsafe { tiermem_sys::mem::discard(base.wrapping_add(page * PAGE_SIZE), PAGE_SIZE) } {
                result = Err(e);
                break;
            }
        }
        let elapsed = started.elapsed();
        stop.store(true, Ordering::Relaxed);
        result.map(|()| elapsed.as_secs_f64() * 1e6 / UNMAP_PAGES as f64)
    })
}

/// Half the median round trip of an eventfd ping-pong with a thread on `other_cpu`.
fn wakeup_us(other_cpu: usize) -> Result<f64> {
    use rustix::event::{eventfd, EventfdFlags};
    let ping = eventfd(0, EventfdFlags::CLOEXEC).map_err(|e| Error::os(e.into(), "eventfd"))?;
    let pong = eventfd(0, EventfdFlags::CLOEXEC).map_err(|e| Error::os(e.into(), "eventfd"))?;
    let mut rounds = Vec::with_capacity(WAKEUPS);
    std::thread::scope(|scope| -> Result<()> {
        let echo = scope.spawn(|| -> rustix::io::Result<()> {
            pin_to(other_cpu);
            let mut buf = [0u8; 8];
            for _ in 0..WAKEUPS {
                rustix::io::read(&ping, &mut buf)?;
                rustix::io::write(&pong, &1u64.to_ne_bytes())?;
            }
            Ok(())
        });
        let mut buf = [0u8; 8];
        for _ in 0..WAKEUPS {
            let started = Instant::now();
            let sent = rustix::io::write(&ping, &1u64.to_ne_bytes()).and_then(|_| rustix::io::read(&pong, &mut buf));
            if let Err(e) = sent {
                // Unblock the echo thread before reporting.
                let _ = rustix::io::write(&ping, &(WAKEUPS as u64).to_ne_bytes());
                return Err(Error::os(e.into(), "eventfd ping-pong"));
            }
            rounds.push(started.elapsed().as_nanos() as u64);
        }
        echo.join()
            .map_err(|_| Error::new(tiermem_sys::ErrorKind::Internal, "the wake-up echo thread panicked"))?
            .map_err(|e| Error::os(e.into(), "eventfd echo"))
    })?;
    rounds.sort_unstable();
    Ok(rounds[rounds.len() / 2] as f64 / 2000.0)
}

/// The lines `tiermem probe --machine` prints.
pub fn summary_lines(facts: &MachineFacts, costs: &MachineCosts) -> Vec<String> {
    let mut first = format!("{} CPU{}", facts.cpus, if facts.cpus == 1 { "" } else { "s" });
    if let Some(bytes) = facts.memory_bytes {
        first += &format!(", {:.1} GiB", bytes as f64 / (1u64 << 30) as f64);
    }
    first += if facts.virtual_machine { ", a virtual machine" } else { ", no hypervisor reported" };
    if let Some(driver) = &facts.cpuidle_driver {
        first += &format!("; cpuidle {driver}");
    }
    match facts.guest_halt_poll_ns {
        Some(0) => first += ", guest halt polling off (an idle vCPU halts at once: wake-ups go through the host)",
        Some(ns) => first += &format!(", guest halt polling {ns} ns"),
        None => {}
    }
    let mut second = match facts.free_page_reporting_order {
        Some(order) => format!(
            "free page reporting on (free blocks of {} KiB and up go back to the host; reusing them costs a host fault)",
            (PAGE_SIZE << order) >> 10
        ),
        None => "free page reporting off".to_string(),
    };
    if let Some(thp) = &facts.transparent_hugepages {
        second += &format!("; THP {thp}");
    }
    match facts.active_swap_areas {
        Some(0) => second += "; no swap active",
        Some(n) => second += &format!("; {n} swap area{} active", if n == 1 { "" } else { "s" }),
        None => {}
    }
    if facts.zswap == Some(true) {
        second += "; zswap on";
    }
    if let Some(n) = facts.damon_kdamonds_running.filter(|&n| n > 0) {
        second += &format!("; {n} DAMON kdamond{} running", if n == 1 { "" } else { "s" });
    }
    let shootdown = match (costs.tlb_shootdown_us, costs.unmap_with_busy_thread_us) {
        (Some(ipi), Some(busy)) => format!(
            "TLB shootdown {ipi:.1} µs (MADV_DONTNEED of a page: {busy:.1} µs with a thread of the process busy on another CPU, {:.1} µs without; each eviction of a scattered page pays it)",
            costs.unmap_alone_us
        ),
        _ => format!("TLB shootdown: not measured (one CPU); MADV_DONTNEED of a page {:.1} µs", costs.unmap_alone_us),
    };
    let wakeup = match costs.thread_wakeup_us {
        Some(us) => format!(
            "thread wake-up {us:.1} µs across CPUs (eventfd, median; a fault served by a handler thread pays two)"
        ),
        None => "thread wake-up: not measured (one CPU)".to_string(),
    };
    let mut lines = vec![
        format!("machine         {first}"),
        format!("                {second}"),
        format!("costs           {shootdown}"),
        format!("                {wakeup}"),
        format!(
            "                UFFDIO_COPY of a fresh page {:.2} µs (the kernel's part of every page-in)",
            costs.page_map_us
        ),
    ];
    if let Some(trip) = &costs.fault_round_trip {
        lines.push(format!("                {}", round_trip_line(trip)));
    }
    lines
}

/// One line on [`FaultRoundTrip`], for `probe --machine` and `bench micro`.
pub fn round_trip_line(trip: &FaultRoundTrip) -> String {
    format!(
        "fault served on the faulting thread {:.2} µs median, {:.2} mean (SIGBUS delivery and return {:.2}, UFFDIO_COPY {:.2}): \
         the kernel's floor under every critical fault besides its read",
        trip.p50_us, trip.mean_us, trip.delivery_us, trip.copy_us
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let full = root.path().join(path);
            std::fs::create_dir_all(full.parent().expect("a parent")).expect("mkdir");
            std::fs::write(full, text).expect("write");
        }
        root
    }

    #[test]
    fn facts_are_read_from_proc_and_sys() {
        let root = tree(&[
            ("proc/cpuinfo", "processor\t: 0\nflags\t\t: fpu sse2 hypervisor avx\n\nprocessor\t: 1\nflags\t\t: fpu sse2 hypervisor avx\n"),
            ("proc/meminfo", "MemTotal:       24576000 kB\nMemFree:         1000 kB\n"),
            ("proc/swaps", "Filename\tType\tSize\tUsed\tPriority\n/swapfile file 1048572 0 -2\n"),
            ("sys/devices/system/cpu/cpuidle/current_driver", "haltpoll\n"),
            ("sys/module/haltpoll/parameters/guest_halt_poll_ns", "0\n"),
            ("sys/module/page_reporting/parameters/page_reporting_order", "9\n"),
            ("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n"),
            ("sys/module/zswap/parameters/enabled", "N\n"),
            ("sys/kernel/mm/damon/admin/kdamonds/0/state", "on\n"),
            ("sys/kernel/mm/damon/admin/kdamonds/1/state", "off\n"),
        ]);
        let facts = facts_from(root.path());
        assert_eq!(
            facts,
            MachineFacts {
                cpus: 2,
                memory_bytes: Some(24_576_000 * 1024),
                virtual_machine: true,
                cpuidle_driver: Some("haltpoll".into()),
                guest_halt_poll_ns: Some(0),
                free_page_reporting_order: Some(9),
                transparent_hugepages: Some("madvise".into()),
                active_swap_areas: Some(1),
                zswap: Some(false),
                damon_kdamonds_running: Some(1),
            }
        );
    }

    #[test]
    fn what_a_machine_does_not_expose_stays_unknown() {
        let root = tree(&[("proc/cpuinfo", "processor\t: 0\nflags\t\t: fpu sse2\n")]);
        let facts = facts_from(root.path());
        assert_eq!(facts.cpus, 1);
        assert!(!facts.virtual_machine, "no hypervisor flag");
        assert_eq!(facts.memory_bytes, None);
        assert_eq!(facts.guest_halt_poll_ns, None);
        assert_eq!(facts.free_page_reporting_order, None);
        assert_eq!(facts.transparent_hugepages, None);
        assert_eq!(facts.active_swap_areas, None);
        assert_eq!(facts.damon_kdamonds_running, None);
        let costs = MachineCosts {
            unmap_alone_us: 1.0,
            unmap_with_busy_thread_us: None,
            tlb_shootdown_us: None,
            thread_wakeup_us: None,
            page_map_us: 1.0,
            fault_round_trip: None,
        };
        let text = summary_lines(&facts, &costs).join("\n");
        assert!(text.contains("1 CPU, no hypervisor") && text.contains("not measured (one CPU)"), "{text}");
        assert!(text.contains("free page reporting off"), "{text}");
    }

    #[test]
    fn the_measured_costs_are_positive_and_a_shootdown_needs_a_second_cpu() {
        let costs = costs(None).expect("costs");
        assert!(costs.unmap_alone_us > 0.0 && costs.page_map_us > 0.0, "{costs:?}");
        if allowed_cpus().len() < 2 {
            println!("SKIPPED shootdown and wake-up figures: this process may use one CPU only");
            assert!(costs.tlb_shootdown_us.is_none() && costs.thread_wakeup_us.is_none());
            return;
        }
        let (busy, ipi, wake) = (
            costs.unmap_with_busy_thread_us.expect("two CPUs"),
            costs.tlb_shootdown_us.expect("two CPUs"),
            costs.thread_wakeup_us.expect("two CPUs"),
        );
        assert!(busy > 0.0 && wake > 0.0, "{costs:?}");
        // The shootdown is what a busy second CPU adds to an unmap: never negative, never more
        // than the whole unmap with that CPU busy.
        assert!((0.0..=busy).contains(&ipi), "{costs:?}");
        // The affinity this thread had is given back.
        assert!(allowed_cpus().len() >= 2, "the test thread is still allowed every CPU");
    }
}
