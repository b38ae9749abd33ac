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
//!   with one), changing nothing of it, and starts a [`DamonPaddr`] only when no kdamond exists.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// A running kdamond this process created; stopped and removed on drop.
#[derive(Debug)]
pub struct DamonPaddr {
    kdamond: PathBuf,
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
    /// Start monitoring physical memory with the given sampling and aggregation intervals.
    pub fn start(sample: Duration, aggregate: Duration) -> Result<Self> {
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
        let me = Self { kdamond: admin.join("kdamonds/0") };
        let ctx = me.kdamond.join("contexts/0");
        write(&me.kdamond.join("contexts/nr_contexts"), "1")?;
        write(&ctx.join("operations"), "paddr")?;
        let attrs = ctx.join("monitoring_attrs/intervals");
        write(&attrs.join("sample_us"), &sample.as_micros().to_string())?;
        write(&attrs.join("aggr_us"), &aggregate.as_micros().to_string())?;
        write(&ctx.join("targets/nr_targets"), "1")?;
        write(&ctx.join("schemes/nr_schemes"), "1")?;
        write(&ctx.join("schemes/0/action"), "stat")?;
        write(&me.kdamond.join("state"), "on")?;
        Ok(me)
    }

    /// The kdamond's thread id.
    pub fn pid(&self) -> Result<u32> {
        let text = read(&self.kdamond.join("pid"))?;
        text.parse().map_err(|_| Error::new(ErrorKind::Io, format!("kdamond pid '{text}' is not a number")))
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
        let _ = fs::write(self.kdamond.join("state"), "off");
        let _ = fs::write(Path::new(ADMIN).join("kdamonds/nr_kdamonds"), "0");
    }
}

/// Where tracefs is mounted on current systems.
pub const TRACEFS: &str = "/sys/kernel/tracing";

/// A window's regions stay together: a line more than this after the previous one of its
/// kdamond starts a new window (the kernel writes a window's lines in one go; a partial window
/// is left behind when the trace buffer overflowed).
const WINDOW_GAP: Duration = Duration::from_millis(500);

/// DAMON's regions of physical memory as each aggregation window ends, from the
/// `damon:damon_aggregated` tracepoint; see the module docs. Its tracefs instance (and a
/// kdamond it started, and a tracefs mount it made) go away on drop.
#[derive(Debug)]
pub struct DamonEvents {
    instance: PathBuf,
    /// The instance's trace_pipe (None only while dropping: the instance goes once it is closed).
    pipe: Option<File>,
    /// Bytes after the last whole line read.
    partial: Vec<u8>,
    /// Thread ids of the kdamonds monitoring physical memory: lines of others are ignored.
    kdamonds: Vec<u32>,
    /// Windows being gathered, per kdamond thread and target.
    windows: HashMap<(u32, u64), Window>,
    /// Finished windows not yet returned.
    ready: std::collections::VecDeque<Vec<DamonRegion>>,
    own: Option<DamonPaddr>,
    mounted: bool,
}

#[derive(Debug)]
struct Window {
    expected: usize,
    regions: Vec<DamonRegion>,
    last: Instant,
}

/// One `damon_aggregated` line: (kdamond thread id, target id, regions in its window, region).
fn parse_aggregated(line: &str) -> Option<(u32, u64, usize, DamonRegion)> {
    // "  kdamond.0-77  [000] ..... 36079.267702: damon_aggregated: target_id=0 nr_regions=1288 4294967296-4300320768: 0 1"
    let (head, fields) = line.split_once(" damon_aggregated: ")?;
    let task = head.split_whitespace().next()?;
    let pid = task.rsplit_once('-')?.1.parse().ok()?;
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
    Some((pid, target, count, region))
}

/// Thread ids of the running kdamonds with a `paddr` context, and how many kdamonds exist.
fn paddr_kdamonds() -> Result<(Vec<u32>, usize)> {
    let admin = Path::new(ADMIN).join("kdamonds");
    let count: usize = read(&admin.join("nr_kdamonds"))?.parse().unwrap_or(0);
    let mut pids = Vec::new();
    for k in 0..count {
        let dir = admin.join(k.to_string());
        if read(&dir.join("state")).ok().as_deref() != Some("on") {
            continue;
        }
        let contexts: usize = read(&dir.join("contexts/nr_contexts")).ok().and_then(|t| t.parse().ok()).unwrap_or(0);
        let paddr =
            (0..contexts).any(|c| read(&dir.join(format!("contexts/{c}/operations"))).ok().as_deref() == Some("paddr"));
        if let (true, Ok(pid)) = (paddr, read(&dir.join("pid")).and_then(|t| t.parse().map_err(|_| Error::invalid(t))))
        {
            pids.push(pid);
        }
    }
    Ok((pids, count))
}

/// Mount tracefs at [`TRACEFS`] unless it is there; true if this call mounted it.
fn mount_tracefs() -> Result<bool> {
    if Path::new(TRACEFS).join("instances").is_dir() {
        return Ok(false);
    }
    rustix::mount::mount("tracefs", TRACEFS, "tracefs", rustix::mount::MountFlags::empty(), None).map_err(|e| {
        Error::new(ErrorKind::Unsupported, format!("tracefs is not mounted at {TRACEFS} and mounting it failed: {e}"))
    })?;
    Ok(true)
}

/// Names of this module's tracefs instances start with this, then the owner's process id.
const INSTANCE_PREFIX: &str = "tiermem-damon-";

/// Remove the instances of processes that no longer run (killed before they could).
fn remove_abandoned_instances() {
    let Ok(entries) = fs::read_dir(Path::new(TRACEFS).join("instances")) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(|n| n.strip_prefix(INSTANCE_PREFIX)) else { continue };
        let Some(pid) = owner.split('-').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let gone = rustix::process::Pid::from_raw(pid)
            .is_none_or(|pid| rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH));
        if gone {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

impl DamonEvents {
    /// Listen to the kdamond(s) monitoring physical memory; start one (sampling every
    /// `sample`, a window every `aggregate`) if no kdamond exists at all.
    pub fn open(sample: Duration, aggregate: Duration) -> Result<Self> {
        if !Path::new(ADMIN).exists() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("{ADMIN} is missing: this kernel has no DAMON sysfs"),
            ));
        }
        let (mut kdamonds, count) = paddr_kdamonds()?;
        let own = if kdamonds.is_empty() {
            if count > 0 {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("{count} kdamond(s) exist and none monitors physical memory; DAMON sysfs cannot add one beside them"),
                ));
            }
            let own = DamonPaddr::start(sample, aggregate)?;
            kdamonds.push(own.pid()?);
            Some(own)
        } else {
            None
        };
        let mounted = mount_tracefs()?;
        remove_abandoned_instances();
        static OPENED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let instance = Path::new(TRACEFS).join(format!("instances/{INSTANCE_PREFIX}{}-{n}", std::process::id()));
        fs::create_dir(&instance)
            .map_err(|e| Error::os(e, format!("creating tracefs instance {}", instance.display())))?;
        let opened = (|| {
            let event = instance.join("events/damon/damon_aggregated/enable");
            if !event.exists() {
                return Err(Error::new(ErrorKind::Unsupported, "this kernel has no damon:damon_aggregated tracepoint"));
            }
            write(&event, "1")?;
            fs::OpenOptions::new()
                .read(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(instance.join("trace_pipe"))
                .map_err(|e| Error::os(e, format!("opening {}/trace_pipe", instance.display())))
        })();
        let pipe = match opened {
            Ok(pipe) => pipe,
            Err(e) => {
                let _ = fs::remove_dir(&instance);
                return Err(e);
            }
        };
        Ok(Self {
            instance,
            pipe: Some(pipe),
            partial: Vec::new(),
            kdamonds,
            windows: HashMap::new(),
            ready: Default::default(),
            own,
            mounted,
        })
    }

    /// Whether the kdamond listened to is one this process started.
    pub fn started_own(&self) -> bool {
        self.own.is_some()
    }

    /// The regions of the next aggregation window that ends, sorted by address; None if none
    /// ends within `timeout`.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Vec<DamonRegion>>> {
        let deadline = Instant::now() + timeout;
        let mut buf = [0u8; 16384];
        loop {
            if let Some(window) = self.ready.pop_front() {
                return Ok(Some(window));
            }
            let Some(pipe) = self.pipe.as_mut() else { return Ok(None) };
            match pipe.read(&mut buf) {
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
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // The pipe wakes a poller when events arrive; a short cap keeps a missed wake-up cheap.
            let wait = left.min(Duration::from_millis(100));
            let mut fds = [rustix::event::PollFd::new(pipe, rustix::event::PollFlags::IN)];
            let ts = rustix::event::Timespec { tv_sec: wait.as_secs() as i64, tv_nsec: i64::from(wait.subsec_nanos()) };
            let _ = rustix::event::poll(&mut fds, Some(&ts));
        }
    }

    /// Parse the whole lines read so far into windows.
    fn take_lines(&mut self) {
        let Some(last_newline) = self.partial.iter().rposition(|&b| b == b'\n') else { return };
        let rest = self.partial.split_off(last_newline + 1);
        let text = std::mem::replace(&mut self.partial, rest);
        let now = Instant::now();
        for line in String::from_utf8_lossy(&text).lines() {
            let Some((pid, target, expected, region)) = parse_aggregated(line) else { continue };
            if !self.kdamonds.contains(&pid) || expected == 0 {
                continue;
            }
            let window =
                self.windows.entry((pid, target)).or_insert(Window { expected, regions: Vec::new(), last: now });
            if window.expected != expected || now.duration_since(window.last) > WINDOW_GAP {
                *window = Window { expected, regions: Vec::new(), last: now };
            }
            window.regions.push(region);
            window.last = now;
            if window.regions.len() == window.expected {
                let mut regions = std::mem::take(&mut window.regions);
                regions.sort_by_key(|r| r.start);
                self.ready.push_back(regions);
            }
        }
    }
}

impl Drop for DamonEvents {
    fn drop(&mut self) {
        let _ = fs::write(self.instance.join("events/damon/damon_aggregated/enable"), "0");
        // The instance can be removed only once nothing has it open.
        drop(self.pipe.take());
        let _ = fs::remove_dir(&self.instance);
        let instances = Path::new(TRACEFS).join("instances");
        let empty = fs::read_dir(&instances).map(|mut d| d.next().is_none()).unwrap_or(false);
        if self.mounted && empty {
            let _ = rustix::mount::unmount(TRACEFS, rustix::mount::UnmountFlags::DETACH);
        }
        // `own` (a kdamond started here) stops when dropped after this.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregated_lines_parse_and_others_do_not() {
        let line = "       kdamond.0-77      [000] ..... 36079.267702: damon_aggregated: target_id=0 nr_regions=1288 4294967296-4300320768: 3 17";
        assert_eq!(
            parse_aggregated(line),
            Some((77, 0, 1288, DamonRegion { start: 4294967296, end: 4300320768, nr_accesses: 3, age: 17 }))
        );
        assert_eq!(parse_aggregated("  <idle>-0  [001] d.... 1.0: sched_switch: prev_comm=x"), None);
        assert_eq!(parse_aggregated(&line.replace("3 17", "3")), None, "a cut-off line");
    }

    #[test]
    fn events_give_whole_windows_of_physical_regions_and_leave_nothing_behind() {
        let mut events = match DamonEvents::open(Duration::from_millis(5), Duration::from_millis(100)) {
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

    #[test]
    fn paddr_regions_show_accesses_when_damon_is_ours_to_use() {
        let damon = match DamonPaddr::start(Duration::from_millis(5), Duration::from_millis(100)) {
            Ok(d) => d,
            Err(e) => {
                println!("SKIPPED: DAMON paddr unavailable: {e}");
                return;
            }
        };
        // Keep 64 MiB busy while DAMON samples.
        let mut data = vec![1u8; 64 << 20];
        let deadline = std::time::Instant::now() + Duration::from_millis(600);
        while std::time::Instant::now() < deadline {
            for i in (0..data.len()).step_by(4096) {
                data[i] = data[i].wrapping_add(1);
            }
        }
        let regions = damon.regions().unwrap();
        assert!(!regions.is_empty(), "DAMON reported no region");
        assert!(regions.iter().all(|r| r.start < r.end));
        assert!(regions.iter().any(|r| r.nr_accesses > 0), "some memory was accessed");
    }
}
