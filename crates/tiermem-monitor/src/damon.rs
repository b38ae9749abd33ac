//! DAMON as a source: the kernel samples accessed bits over physical memory (the `paddr`
//! operations set, what this kernel offers) and reports regions with their access frequency;
//! the reverse page table turns their pages into {pid, virtual page}.
//!
//! Two ways in:
//! - [`DamonPaddr`] drives the sysfs interface under /sys/kernel/mm/damon/admin: one kdamond
//!   with one paddr context and one `stat` scheme matching every region, whose `tried_regions`
//!   directory lists the regions with their `nr_accesses` after `update_schemes_tried_regions`.
//!   It only ever drives a kdamond it created: when another user's kdamond exists (DAMON sysfs
//!   cannot add one while any runs), it refuses with [`ErrorKind::Unsupported`] rather than
//!   disturb it.
//! - [`DamonEvents`] listens to the `damon:damon_aggregated` tracepoint, which every kdamond
//!   fires for each region at the end of each aggregation window, in a tracefs instance of its
//!   own. It reads what a kdamond already running for physical memory finds (this VM boots
//!   with one), changing nothing of it; [`ensure_paddr_kdamond`] starts a [`DamonPaddr`] when
//!   no kdamond exists.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tiermem_sys::guarded_fd::Guarded;
use tiermem_sys::{Error, ErrorKind, Result};

/// DAMON's sysfs root.
pub const ADMIN: &str = "/sys/kernel/mm/damon/admin";

/// One region DAMON reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DamonRegion {
    /// First physical address.
    pub start: u64,
    /// End physical address (exclusive).
    pub end: u64,
    /// Sampling intervals in the last aggregation window that found the region accessed.
    pub nr_accesses: u32,
    /// Aggregation windows the region kept its access frequency.
    pub age: u32,
}

/// The kernel's map of physical memory.
const IOMEM: &str = "/proc/iomem";
/// RAM ranges smaller than this (the 640 KiB below 1 MiB on a PC) are left out of DAMON's.
const MIN_RAM_RANGE: u64 = 1 << 20;

/// The top-level "System RAM" ranges of `/proc/iomem` text, as [start, end) physical
/// addresses, in address order; ranges under [`MIN_RAM_RANGE`] are left out. The file shows
/// zeros to a reader without CAP_SYS_ADMIN, which is refused.
fn system_ram(iomem: &str) -> Result<Vec<(u64, u64)>> {
    let mut ranges = Vec::new();
    for line in iomem.lines() {
        // Nested resources are indented; only top-level ones are RAM ranges.
        if line.starts_with(' ') {
            continue;
        }
        let Some((span, name)) = line.split_once(" : ") else { continue };
        if name.trim() != "System RAM" {
            continue;
        }
        let Some((first, last)) = span.split_once('-') else { continue };
        let (Ok(first), Ok(last)) = (u64::from_str_radix(first.trim(), 16), u64::from_str_radix(last.trim(), 16))
        else {
            continue;
        };
        if last > first && last - first + 1 >= MIN_RAM_RANGE {
            ranges.push((first, last + 1));
        }
    }
    if ranges.is_empty() {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "{IOMEM} shows no System RAM range of 1 MiB or more (its addresses read as zero without CAP_SYS_ADMIN)"
            ),
        ));
    }
    ranges.sort_unstable();
    Ok(ranges)
}

/// The physical address ranges of the given page frames, for [`DamonPaddr::watch`]: runs of
/// adjacent frames, the largest `most` of them (DAMON takes at most its maximum number of
/// regions, 1,000 by default), in address order.
pub fn frame_ranges(frames: &[u64], most: usize) -> Vec<(u64, u64)> {
    let mut frames = frames.to_vec();
    frames.sort_unstable();
    frames.dedup();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for pfn in frames {
        match runs.last_mut() {
            Some(run) if run.1 == pfn => run.1 += 1,
            _ => runs.push((pfn, pfn + 1)),
        }
    }
    runs.sort_by_key(|&(a, b)| (std::cmp::Reverse(b - a), a));
    runs.truncate(most);
    let page = tiermem_sys::PAGE_SIZE as u64;
    let mut ranges: Vec<(u64, u64)> = runs.into_iter().map(|(a, b)| (a * page, b * page)).collect();
    ranges.sort_unstable();
    ranges
}

/// Physical address ranges DAMON accepts: some, each non-empty, in address order, not
/// overlapping.
fn check_ranges(ranges: &[(u64, u64)]) -> Result<()> {
    if ranges.is_empty() || ranges.iter().any(|&(a, b)| a >= b) || ranges.windows(2).any(|w| w[0].1 > w[1].0) {
        return Err(Error::invalid("DAMON ranges must be non-empty, in address order and not overlapping"));
    }
    Ok(())
}

/// A running kdamond this process created; stopped and removed on drop.
#[derive(Debug)]
pub struct DamonPaddr {
    kdamond: PathBuf,
    /// This object turned the kdamond on (only then is it this object's to turn off: another
    /// process's, started between our check and ours, must not be stopped by our failed start).
    started: bool,
}

fn write(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|e| {
        let kind = if e.kind() == std::io::ErrorKind::PermissionDenied { ErrorKind::Permission } else { ErrorKind::Io };
        Error::os_kind(kind, e, format!("writing '{value}' to {}", path.display()))
    })
}

fn read(path: &Path) -> Result<String> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::os(e, format!("reading {}", path.display())))
}

impl DamonPaddr {
    /// Start monitoring the machine's RAM with the given sampling and aggregation intervals.
    pub fn start(sample: Duration, aggregate: Duration) -> Result<Self> {
        let ram = system_ram(&read(Path::new(IOMEM))?)?;
        Self::start_over(sample, aggregate, &ram)
    }

    /// Start monitoring the given physical address ranges ([start, end), in address order, not
    /// overlapping). Each sample checks one page per region, so a few busy megabytes among
    /// gigabytes of idle RAM are found only by chance: a caller that knows where its frames lie
    /// can watch just those.
    pub fn start_over(sample: Duration, aggregate: Duration, ranges: &[(u64, u64)]) -> Result<Self> {
        check_ranges(ranges)?;
        let admin = Path::new(ADMIN);
        if !admin.exists() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{ADMIN} is missing: this kernel has no DAMON sysfs"),
            ));
        }
        let count = read(&admin.join("kdamonds/nr_kdamonds"))?;
        if count != "0" {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{count} kdamond(s) already exist, owned by someone else; DAMON sysfs cannot add one without stopping them"),
            ));
        }
        write(&admin.join("kdamonds/nr_kdamonds"), "1")?;
        let mut me = Self { kdamond: admin.join("kdamonds/0"), started: false };
        let ctx = me.kdamond.join("contexts/0");
        write(&me.kdamond.join("contexts/nr_contexts"), "1")?;
        write(&ctx.join("operations"), "paddr")?;
        let attrs = ctx.join("monitoring_attrs/intervals");
        write(&attrs.join("sample_us"), &sample.as_micros().to_string())?;
        write(&attrs.join("aggr_us"), &aggregate.as_micros().to_string())?;
        write(&ctx.join("targets/nr_targets"), "1")?;
        // A paddr target without regions monitors nothing (kernel 6.18 picks none itself).
        me.write_ranges(ranges)?;
        write(&ctx.join("schemes/nr_schemes"), "1")?;
        write(&ctx.join("schemes/0/action"), "stat")?;
        // A new scheme's access pattern has every maximum at 0 (kernel 6.18), which matches no
        // region: open every bound.
        let pattern = ctx.join("schemes/0/access_pattern");
        write(&pattern.join("sz/max"), &u64::MAX.to_string())?;
        write(&pattern.join("nr_accesses/max"), &u32::MAX.to_string())?;
        write(&pattern.join("age/max"), &u32::MAX.to_string())?;
        write(&me.kdamond.join("state"), "on")?;
        me.started = true;
        Ok(me)
    }

    /// Watch other physical address ranges from now on (as [`DamonPaddr::start_over`] takes
    /// them), committed to the running kdamond.
    pub fn watch(&self, ranges: &[(u64, u64)]) -> Result<()> {
        check_ranges(ranges)?;
        self.write_ranges(ranges)?;
        write(&self.kdamond.join("state"), "commit")
    }

    fn write_ranges(&self, ranges: &[(u64, u64)]) -> Result<()> {
        let regions = self.kdamond.join("contexts/0/targets/0/regions");
        write(&regions.join("nr_regions"), &ranges.len().to_string())?;
        // (The kernel checks the regions when they are committed, not at each write.)
        for (i, (start, end)) in ranges.iter().enumerate() {
            write(&regions.join(format!("{i}/start")), &start.to_string())?;
            write(&regions.join(format!("{i}/end")), &end.to_string())?;
        }
        Ok(())
    }

    /// The regions as of the last aggregation window.
    pub fn regions(&self) -> Result<Vec<DamonRegion>> {
        write(&self.kdamond.join("state"), "update_schemes_tried_regions")?;
        let dir = self.kdamond.join("contexts/0/schemes/0/tried_regions");
        let mut out = Vec::new();
        let entries = fs::read_dir(&dir).map_err(|e| Error::os(e, format!("listing {}", dir.display())))?;
        for entry in entries.flatten() {
            let p = entry.path();
            if !p.is_dir() {
                continue;
            }
            let num = |name: &str| -> Result<u64> {
                let text = read(&p.join(name))?;
                text.parse()
                    .map_err(|_| Error::new(ErrorKind::Io, format!("{}/{name}: '{text}' is not a number", p.display())))
            };
            out.push(DamonRegion {
                start: num("start")?,
                end: num("end")?,
                nr_accesses: num("nr_accesses")? as u32,
                age: num("age")? as u32,
            });
        }
        out.sort_by_key(|r| r.start);
        Ok(out)
    }
}

impl Drop for DamonPaddr {
    fn drop(&mut self) {
        if self.started {
            let _ = fs::write(self.kdamond.join("state"), "off");
        }
        // Refused (EBUSY) while any kdamond runs: then the directories stay for their owner.
        let _ = fs::write(Path::new(ADMIN).join("kdamonds/nr_kdamonds"), "0");
    }
}

/// Where tracefs is mounted on current systems.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// A window's regions stay together: a line stamped (trace clock `mono`) more than this after
/// the previous one of its kdamond starts a new window (the kernel writes a window's lines in one loop, within a
/// millisecond here), as does a region below the previous one (it writes them in address order)
/// and a report of lost events.
const WINDOW_GAP_SECONDS: f64 = 0.05;

/// Names of this module's tracefs instances start with this, then the owner's process id.
const INSTANCE_PREFIX: &str = "tiermem-damon-";

/// DAMON's regions of physical memory as each aggregation window ends, from the
/// `damon:damon_aggregated` tracepoint; see the module docs. It only listens: a kdamond
/// monitoring physical memory must be running ([`ensure_paddr_kdamond`] starts one). Its
/// tracefs instance (and a tracefs mount it made) go away on drop.
#[derive(Debug)]
pub struct DamonEvents {
    instance: PathBuf,
    /// The instance's trace_pipe (None only while dropping: the instance goes once it is
    /// closed), guarded: a program closing every descriptor it did not open leaves it alone.
    pipe: Option<Guarded<File>>,
    /// Bytes after the last whole line read.
    partial: Vec<u8>,
    /// The kdamonds monitoring physical memory: lines of others are ignored.
    kdamonds: Vec<Kdamond>,
    /// Windows being gathered, per kdamond thread and target.
    windows: HashMap<(u32, u64), Window>,
    /// Finished windows not yet returned.
    ready: std::collections::VecDeque<Vec<DamonRegion>>,
    mounted: bool,
    /// The process that opened it: a forked child's copy must not tear the instance down.
    owner: u32,
}

/// A running kdamond with a `paddr` context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kdamond {
    /// Its thread id, as the tracepoint names it.
    pub pid: u32,
    /// Bytes per unit of the addresses it reports (`addr_unit`, 1 unless set).
    pub addr_unit: u64,
}

#[derive(Debug)]
struct Window {
    expected: usize,
    regions: Vec<DamonRegion>,
    /// Trace time of its last line, in seconds.
    last: f64,
}

/// One `damon_aggregated` line.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Aggregated {
    kdamond: u32,
    target: u64,
    /// Trace time, in seconds.
    time: f64,
    /// Regions in its window.
    count: usize,
    region: DamonRegion,
}

fn parse_aggregated(line: &str) -> Option<Aggregated> {
    // "  kdamond.0-77  [000] ..... 36079.267702: damon_aggregated: target_id=0 nr_regions=1288 4294967296-4300320768: 0 1"
    let (head, fields) = line.split_once(" damon_aggregated: ")?;
    let task = head.split_whitespace().next()?;
    let kdamond = task.rsplit_once('-')?.1.parse().ok()?;
    let time = head.split_whitespace().last()?.strip_suffix(':')?.parse().ok()?;
    let mut words = fields.split_whitespace();
    let target = words.next()?.strip_prefix("target_id=")?.parse().ok()?;
    let count = words.next()?.strip_prefix("nr_regions=")?.parse().ok()?;
    let (start, end) = words.next()?.strip_suffix(':')?.split_once('-')?;
    let region = DamonRegion {
        start: start.parse().ok()?,
        end: end.parse().ok()?,
        nr_accesses: words.next()?.parse().ok()?,
        age: words.next()?.parse().ok()?,
    };
    Some(Aggregated { kdamond, target, time, count, region })
}

/// The running kdamonds with a `paddr` context, and how many kdamonds exist.
pub fn paddr_kdamonds() -> Result<(Vec<Kdamond>, usize)> {
    let admin = Path::new(ADMIN).join("kdamonds");
    if !admin.exists() {
        return Err(Error::new(ErrorKind::Unsupported, format!("{ADMIN} is missing: this kernel has no DAMON sysfs")));
    }
    let count: usize = read(&admin.join("nr_kdamonds"))?.parse().unwrap_or(0);
    let mut found = Vec::new();
    for k in 0..count {
        let dir = admin.join(k.to_string());
        if read(&dir.join("state")).ok().as_deref() != Some("on") {
            continue;
        }
        let contexts: usize = read(&dir.join("contexts/nr_contexts")).ok().and_then(|t| t.parse().ok()).unwrap_or(0);
        let Some(context) = (0..contexts)
            .map(|c| dir.join(format!("contexts/{c}")))
            .find(|c| read(&c.join("operations")).ok().as_deref() == Some("paddr"))
        else {
            continue;
        };
        // Kernels before addr_unit report plain bytes.
        let addr_unit = read(&context.join("addr_unit")).ok().and_then(|t| t.parse().ok()).unwrap_or(1).max(1);
        if let Some(pid) = read(&dir.join("pid")).ok().and_then(|t| t.parse().ok()) {
            found.push(Kdamond { pid, addr_unit });
        }
    }
    Ok((found, count))
}

/// Make sure a kdamond monitors physical memory: None if one runs, else one started here
/// (sampling every `sample`, a window every `aggregate`), which stops when dropped. Refuses when
/// kdamonds exist but none monitors physical memory (DAMON sysfs cannot add one beside them).
pub fn ensure_paddr_kdamond(sample: Duration, aggregate: Duration) -> Result<Option<DamonPaddr>> {
    let (running, count) = paddr_kdamonds()?;
    if !running.is_empty() {
        return Ok(None);
    }
    if count > 0 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{count} kdamond(s) exist and none is running with a paddr context; DAMON sysfs cannot add one beside them"),
        ));
    }
    DamonPaddr::start(sample, aggregate).map(Some)
}

/// Mount tracefs at [`TRACEFS`] unless it is there; true if this call mounted it.
fn mount_tracefs() -> Result<bool> {
    if tracefs_mounted() {
        return Ok(false);
    }
    rustix::mount::mount("tracefs", TRACEFS, "tracefs", rustix::mount::MountFlags::empty(), None).map_err(|e| {
        Error::new(ErrorKind::Unsupported, format!("tracefs is not mounted at {TRACEFS} and mounting it failed: {e}"))
    })?;
    Ok(true)
}

/// Whether tracefs is mounted at [`TRACEFS`].
pub fn tracefs_mounted() -> bool {
    Path::new(TRACEFS).join("instances").is_dir()
}

/// Unmount tracefs if `mounted` (the caller mounted it, or found it unmounted before its run)
/// and no instance is left in it.
pub fn unmount_tracefs_if_unused(mounted: bool) {
    let empty = fs::read_dir(Path::new(TRACEFS).join("instances")).map(|mut d| d.next().is_none()).unwrap_or(false);
    if mounted && empty {
        let _ = rustix::mount::unmount(TRACEFS, rustix::mount::UnmountFlags::DETACH);
    }
}

/// Remove the instances nobody reads any more: their process was killed, or replaced by
/// `exec` (the pipe is closed on exec), before it could (`tiermem run` calls this when the
/// program ends, and every open does). An instance whose pipe is open cannot be removed (the
/// kernel says EBUSY), so no process id is trusted (a program may run in a pid namespace of
/// its own); one whose maker has not opened its pipe yet is protected by [`InstancesLock`].
pub fn remove_abandoned_instances() {
    // Without the lock nothing is removed: an instance may be on its way.
    let Ok(Some(_lock)) = InstancesLock::take() else { return };
    let Ok(entries) = fs::read_dir(Path::new(TRACEFS).join("instances")) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.starts_with(INSTANCE_PREFIX)) {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

/// An exclusive lock (flock) on tracefs's instances directory, held from creating an instance
/// until its pipe is open, and by the sweep: the sweep never sees an instance not yet
/// protected by its open pipe. Unlocked on drop (a forked child's copy of the descriptor would
/// otherwise keep it), or when its process dies.
struct InstancesLock {
    /// Guarded: a program closing every descriptor while the engine starts leaves it alone.
    dir: Guarded<File>,
}

/// How long [`InstancesLock::take`] tries: a holder stopped (SIGSTOP, a debugger) must not stop
/// every other program's start.
const LOCK_PATIENCE: Duration = Duration::from_secs(2);

impl InstancesLock {
    /// The lock, or None if another process holds it for longer than [`LOCK_PATIENCE`].
    fn take() -> Result<Option<Self>> {
        let path = Path::new(TRACEFS).join("instances");
        let dir = File::open(&path).map_err(|e| Error::os(e, format!("opening {}", path.display())))?;
        let dir = Guarded::new(dir);
        let start = Instant::now();
        loop {
            match rustix::fs::flock(&*dir, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => return Ok(Some(Self { dir })),
                Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR) if start.elapsed() < LOCK_PATIENCE => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(rustix::io::Errno::WOULDBLOCK | rustix::io::Errno::INTR) => return Ok(None),
                Err(e) => return Err(Error::os(e.into(), format!("locking {}", path.display()))),
            }
        }
    }
}

impl Drop for InstancesLock {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(&*self.dir, rustix::fs::FlockOperation::Unlock);
    }
}

/// Create an instance with the tracepoint on and open its pipe; on failure nothing is left.
fn create_instance() -> Result<(PathBuf, File)> {
    // Without it (held elsewhere too long) no sweep runs meanwhile either: they all take it.
    let _lock = InstancesLock::take()?;
    // Unique beyond the process id: a program that exec'ed keeps its id, and its previous
    // image's instance may still be there.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let instance = Path::new(TRACEFS).join(format!("instances/{INSTANCE_PREFIX}{}-{nanos:x}", std::process::id()));
    fs::create_dir(&instance).map_err(|e| Error::os(e, format!("creating tracefs instance {}", instance.display())))?;
    let opened = (|| {
        let event = instance.join("events/damon/damon_aggregated/enable");
        if !event.exists() {
            if !instance.exists() {
                return Err(Error::new(ErrorKind::NotFound, format!("{} was removed", instance.display())));
            }
            return Err(Error::new(ErrorKind::Unsupported, "this kernel has no damon:damon_aggregated tracepoint"));
        }
        // A clock in seconds, the same on every CPU (the window gap is measured in it).
        fs::write(instance.join("trace_clock"), "mono")
            .map_err(|e| Error::os(e, format!("setting {}/trace_clock", instance.display())))?;
        fs::write(&event, "1").map_err(|e| Error::os(e, format!("enabling {}", event.display())))?;
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(instance.join("trace_pipe"))
            .map_err(|e| Error::os(e, format!("opening {}/trace_pipe", instance.display())))
    })();
    match opened {
        Ok(pipe) => Ok((instance, pipe)),
        Err(e) => {
            let _ = fs::remove_dir(&instance);
            Err(e)
        }
    }
}

impl DamonEvents {
    /// Listen to the running kdamond(s) monitoring physical memory.
    pub fn open() -> Result<Self> {
        let (kdamonds, count) = paddr_kdamonds()?;
        if kdamonds.is_empty() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("no kdamond is running with a paddr context ({count} exist); `tiermem run --damon on` starts one when none exists"),
            ));
        }
        let mounted = mount_tracefs()?;
        remove_abandoned_instances();
        let (instance, pipe) = match create_instance() {
            Ok(made) => made,
            Err(e) => {
                unmount_tracefs_if_unused(mounted);
                return Err(e);
            }
        };
        Ok(Self {
            instance,
            pipe: Some(Guarded::new(pipe)),
            partial: Vec::new(),
            kdamonds,
            windows: HashMap::new(),
            ready: Default::default(),
            mounted,
            owner: std::process::id(),
        })
    }

    /// The descriptor of its pipe, for a forked child to close (the instance cannot be removed
    /// while any process has it open).
    pub fn pipe_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.pipe.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Whether a kdamond it listens to still runs (one stopped, or restarted under another
    /// thread id, sends nothing more).
    pub fn kdamond_running(&self) -> bool {
        // A failed look counts as running: only a kdamond seen gone stops the source.
        paddr_kdamonds().map_or(true, |(running, _)| running.iter().any(|k| self.kdamonds.contains(k)))
    }

    /// The regions (in bytes of physical address) of the next aggregation window that ends,
    /// sorted by address; None if none ends within `timeout`.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Vec<DamonRegion>>> {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 16384];
        loop {
            if let Some(window) = self.ready.pop_front() {
                return Ok(Some(window));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let Some(pipe) = self.pipe.as_ref() else { return Ok(None) };
            let mut file: &File = pipe;
            match file.read(&mut buf) {
                Ok(n) if n > 0 => {
                    self.partial.extend_from_slice(&buf[..n]);
                    self.take_lines();
                    continue;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::os(e, format!("reading {}/trace_pipe", self.instance.display()))),
            }
            // The pipe wakes a poller when events arrive; a short cap keeps a missed wake-up cheap.
            let wait = left.min(Duration::from_millis(100));
            let mut fds = [rustix::event::PollFd::new(file, rustix::event::PollFlags::IN)];
            let ts = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }

    /// Parse the whole lines read so far into windows.
    fn take_lines(&mut self) {
        let Some(last_newline) = self.partial.iter().rposition(|&b| b == b'\n') else { return };
        let rest = self.partial.split_off(last_newline + 1);
        let text = std::mem::replace(&mut self.partial, rest);
        for line in String::from_utf8_lossy(&text).lines() {
            // "CPU:1 [LOST 12 EVENTS]": the windows being gathered miss regions.
            if line.contains("[LOST ") {
                self.windows.clear();
                continue;
            }
            let Some(Aggregated { kdamond, target, time, count, mut region }) = parse_aggregated(line) else {
                continue;
            };
            let Some(unit) = self.kdamonds.iter().find(|k| k.pid == kdamond).map(|k| k.addr_unit) else { continue };
            if count == 0 {
                continue;
            }
            region.start = region.start.saturating_mul(unit);
            region.end = region.end.saturating_mul(unit);
            let fresh = || Window { expected: count, regions: Vec::new(), last: time };
            let window = self.windows.entry((kdamond, target)).or_insert_with(fresh);
            let out_of_order = window.regions.last().is_some_and(|last| region.start < last.end);
            if window.expected != count || out_of_order || time - window.last > WINDOW_GAP_SECONDS {
                *window = fresh();
            }
            window.regions.push(region);
            window.last = time;
            if window.regions.len() == window.expected {
                self.ready.push_back(std::mem::take(&mut window.regions));
            }
        }
    }
}

impl Drop for DamonEvents {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A forked child's copy: its descriptor may be closed already (the engine closes it
            // after a fork) and its number reused, so it is not closed again here.
            std::mem::forget(self.pipe.take());
            return;
        }
        let _ = fs::write(self.instance.join("events/damon/damon_aggregated/enable"), "0");
        // The instance can be removed only once nothing has it open.
        drop(self.pipe.take());
        let _ = fs::remove_dir(&self.instance);
        unmount_tracefs_if_unused(self.mounted);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frames of `data`'s pages (from /proc/self/pagemap).
    fn frames_of(data: &[u8]) -> Vec<u64> {
        use std::os::unix::fs::FileExt;
        let pagemap = fs::File::open("/proc/self/pagemap").unwrap();
        let (first, end) = (data.as_ptr() as u64 / 4096, (data.as_ptr() as u64 + data.len() as u64) / 4096);
        let mut bytes = vec![0u8; (end - first) as usize * 8];
        pagemap.read_exact_at(&mut bytes, first * 8).unwrap();
        bytes.chunks_exact(8).filter_map(|e| tiermem_sys::pagemap::present_frame(e.try_into().unwrap())).collect()
    }

    #[test]
    fn frame_ranges_are_the_largest_runs_of_adjacent_frames_in_address_order() {
        let frames = [9, 3, 4, 5, 20, 21, 10, 4, 40];
        assert_eq!(
            frame_ranges(&frames, 10),
            vec![(3 * 4096, 6 * 4096), (9 * 4096, 11 * 4096), (20 * 4096, 22 * 4096), (40 * 4096, 41 * 4096)]
        );
        assert_eq!(frame_ranges(&frames, 2), vec![(3 * 4096, 6 * 4096), (9 * 4096, 11 * 4096)]);
        assert!(frame_ranges(&[], 5).is_empty());
    }

    #[test]
    fn paddr_regions_show_accesses_when_damon_is_ours_to_use() {
        // 64 MiB kept busy while DAMON samples, watched where its frames are: over all of a
        // mostly idle machine's RAM a sample would rarely land on one of them.
        let mut data = vec![1u8; 64 << 20];
        let ranges = frame_ranges(&frames_of(&data), 500);
        if ranges.is_empty() {
            println!("SKIPPED: DAMON paddr: /proc/self/pagemap shows no frame numbers (needs CAP_SYS_ADMIN)");
            return;
        }
        let damon = match DamonPaddr::start_over(Duration::from_millis(5), Duration::from_millis(100), &ranges) {
            Ok(d) => d,
            Err(e) => {
                println!("SKIPPED: DAMON paddr unavailable: {e}");
                return;
            }
        };
        let deadline = std::time::Instant::now() + Duration::from_millis(600);
        while std::time::Instant::now() < deadline {
            for i in (0..data.len()).step_by(4096) {
                data[i] = data[i].wrapping_add(1);
            }
        }
        let regions = damon.regions().unwrap();
        assert!(!regions.is_empty(), "DAMON reported no region");
        let (lowest, highest) = (ranges[0].0, ranges[ranges.len() - 1].1);
        assert!(regions.iter().all(|r| lowest <= r.start && r.end <= highest), "regions within the ranges given");
        assert!(regions.iter().all(|r| r.start < r.end));
        assert!(regions.iter().any(|r| r.nr_accesses > 0), "some memory was accessed");
    }

    #[test]
    fn system_ram_is_the_top_level_ram_ranges_of_iomem() {
        let iomem = "00000000-00000fff : Reserved
00001000-0009fbff : System RAM
000a0000-000bffff : PCI Bus 0000:00
00100000-bfffffff : System RAM
  01000000-01ffffff : Kernel code
  02000000-02ffffff : System RAM
c0000000-febfffff : PCI Bus 0000:00
100000000-63fffffff : System RAM
";
        assert_eq!(system_ram(iomem).unwrap(), vec![(0x10_0000, 0xc000_0000), (0x1_0000_0000, 0x6_4000_0000)]);
        let hidden = "00000000-00000000 : System RAM\n00000000-00000000 : System RAM\n";
        assert_eq!(system_ram(hidden).unwrap_err().kind(), ErrorKind::Permission);
        assert_eq!(system_ram("").unwrap_err().kind(), ErrorKind::Permission);
        // Ranges that DAMON would refuse are refused before anything is written.
        let tick = Duration::from_millis(5);
        for bad in [&[][..], &[(8192, 4096)], &[(0, 8192), (4096, 12288)]] {
            let e = DamonPaddr::start_over(tick, tick * 20, bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{bad:?}");
        }
    }

    #[test]
    fn aggregated_lines_parse_and_others_do_not() {
        let line = "       kdamond.0-77      [000] ..... 36079.267702: damon_aggregated: target_id=0 nr_regions=1288 4294967296-4300320768: 3 17";
        assert_eq!(
            parse_aggregated(line),
            Some(Aggregated {
                kdamond: 77,
                target: 0,
                time: 36079.267702,
                count: 1288,
                region: DamonRegion { start: 4294967296, end: 4300320768, nr_accesses: 3, age: 17 }
            })
        );
        assert_eq!(parse_aggregated("  <idle>-0  [001] d.... 1.0: sched_switch: prev_comm=x"), None);
        assert_eq!(parse_aggregated(&line.replace("3 17", "3")), None, "a cut-off line");
    }

    #[test]
    fn windows_are_whole_in_address_order_and_restart_after_lost_events() {
        let line_at = |time: f64, start: u64, count: usize| {
            format!(
                " kdamond.0-77 [000] ..... {time:.6}: damon_aggregated: target_id=0 nr_regions={count} {start}-{}: 1 2\n",
                start + 10
            )
        };
        let line = |start: u64, count: usize| line_at(2.0, start, count);
        let mut events = DamonEvents {
            instance: PathBuf::new(),
            pipe: None,
            partial: Vec::new(),
            kdamonds: vec![Kdamond { pid: 77, addr_unit: 4 }],
            windows: HashMap::new(),
            ready: Default::default(),
            mounted: false,
            owner: std::process::id(),
        };
        let mut feed = |text: String| {
            events.partial.extend_from_slice(text.as_bytes());
            events.take_lines();
        };
        // A window of three, cut short by lost events, then a whole one.
        feed(line(100, 3) + &line(200, 3) + "CPU:0 [LOST 5 EVENTS]\n" + &line(300, 3));
        // Its first part in one read, the rest in the next (a line split between them).
        let whole = line(100, 3) + &line(200, 3) + &line(300, 3);
        let (a, b) = whole.split_at(whole.len() - 20);
        feed(line(500, 3) + a);
        feed(b.to_string());
        // Another kdamond's lines are not ours.
        feed(line(100, 1).replace("-77 ", "-78 "));
        // Two regions in order but a second apart: a window that lost its end, then a new one.
        feed(line_at(5.0, 100, 2) + &line_at(6.0, 200, 2) + &line_at(6.0, 300, 2));
        let windows: Vec<Vec<u64>> = events.ready.iter().map(|w| w.iter().map(|r| r.start).collect()).collect();
        assert_eq!(
            windows,
            vec![vec![400, 800, 1200], vec![800, 1200]],
            "in bytes (addr_unit 4); 300, 500 and 100 were parts of lost windows"
        );
        assert_eq!(events.ready[0][0].end, 440);
    }

    #[test]
    fn events_give_whole_windows_of_physical_regions_and_leave_nothing_behind() {
        let _own = match ensure_paddr_kdamond(Duration::from_millis(5), Duration::from_millis(100)) {
            Ok(own) => own,
            Err(e) => {
                println!("SKIPPED: no kdamond for physical memory: {e}");
                return;
            }
        };
        let mut events = match DamonEvents::open() {
            Ok(e) => e,
            Err(e) => {
                println!("SKIPPED: DAMON events unavailable: {e}");
                return;
            }
        };
        let instance = events.instance.clone();
        // A kdamond of someone else may aggregate every few seconds (this VM's: 5 s).
        let window = events.next(Duration::from_secs(15)).unwrap().expect("a window within 15 s");
        assert!(!window.is_empty());
        assert!(window.windows(2).all(|w| w[0].end <= w[1].start), "sorted, not overlapping: {window:?}");
        assert!(window.iter().all(|r| r.start < r.end));
        drop(events);
        assert!(!instance.exists(), "the tracefs instance is removed");
    }
}
