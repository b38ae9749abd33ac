//! DAMON as a source: the kernel samples accessed bits over physical memory (the `paddr`
//! operations set, what this kernel offers) and reports regions with their access frequency;
//! the reverse page table turns their pages into {pid, virtual page}.
//!
//! Uses the sysfs interface under /sys/kernel/mm/damon/admin: one kdamond with one paddr context
//! and one `stat` scheme matching every region, whose `tried_regions` directory lists the
//! regions with their `nr_accesses` after `update_schemes_tried_regions`. It only ever drives a
//! kdamond it created: when another user's kdamond exists (DAMON sysfs cannot add one while any
//! runs), it refuses with [`ErrorKind::Unsupported`] rather than disturb it.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

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
