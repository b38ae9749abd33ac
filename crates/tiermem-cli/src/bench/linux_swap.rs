//! The Linux-swap baseline: an active swap file and a memory cgroup, both as guards that remove
//! themselves on drop, on panic and on Ctrl-C/SIGTERM (see [`crate::bench::cleanup`]), and a way to
//! run a child process inside the cgroup from its first allocation on.
//!
//! The swap header is written by this module rather than by util-linux `mkswap`, so the benchmark
//! needs no external binary; its layout is the kernel's `union swap_header` (include/linux/swap.h).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::fs::FallocateFlags;
use serde::{Deserialize, Serialize};
use tiermem_sys::{Error, ErrorKind, Result};

use super::cleanup::{self, CleanupId, Teardown};

/// Unique suffixes for the swap files and cgroups this process creates.
static NEXT_RESOURCE_SEQ: AtomicU64 = AtomicU64::new(0);

/// `SWAP_FLAG_PREFER` from <sys/swap.h>: the priority in the low bits is used.
const SWAP_FLAG_PREFER: libc::c_int = 0x8000;
/// The highest swap priority, so the benchmark's swap file is used before any other swap area.
const SWAP_PRIORITY_MAX: libc::c_int = 0x7fff;
/// Offset of `info.version` in the swap header (after 1024 bytes of boot block).
const SWAP_HEADER_INFO_OFFSET: usize = 1024;
/// The kernel refuses tiny swap areas; stay comfortably above its minimum.
const SWAP_MIN_PAGES: u64 = 16;
/// Chunk size for writing the swap file with zeros.
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// How long cgroup teardown keeps killing tasks and retrying rmdir.
const CGROUP_TEARDOWN_TIMEOUT: Duration = Duration::from_secs(10);
const CGROUP_TEARDOWN_POLL: Duration = Duration::from_millis(20);

// statfs(2) magic numbers of the file systems the error messages name.
const TMPFS_MAGIC: u32 = 0x0102_1994;
const RAMFS_MAGIC: u32 = 0x8584_58f6;
const OVERLAYFS_MAGIC: u32 = 0x794c_7630;
const SQUASHFS_MAGIC: u32 = 0x7371_7368;
const EXT4_MAGIC: u32 = 0xef53;
const XFS_MAGIC: u32 = 0x5846_5342;
const BTRFS_MAGIC: u32 = 0x9123_683e;
const F2FS_MAGIC: u32 = 0xf2f5_2010;
const NFS_MAGIC: u32 = 0x6969;
const FUSE_MAGIC: u32 = 0x6573_5546;
const ZFS_MAGIC: u32 = 0x2fc1_2fc1;

fn file_system_name(magic: u32) -> &'static str {
    match magic {
        TMPFS_MAGIC => "tmpfs",
        RAMFS_MAGIC => "ramfs",
        OVERLAYFS_MAGIC => "overlayfs",
        SQUASHFS_MAGIC => "squashfs",
        EXT4_MAGIC => "ext2/3/4",
        XFS_MAGIC => "xfs",
        BTRFS_MAGIC => "btrfs",
        F2FS_MAGIC => "f2fs",
        NFS_MAGIC => "nfs",
        FUSE_MAGIC => "fuse",
        ZFS_MAGIC => "zfs",
        _ => "an unrecognised file system",
    }
}

fn path_cstring(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::invalid(format!("path {} contains a NUL byte", path.display())))
}

/// Create something at `path_for(seq)` for the next free sequence number. A name can be taken by a
/// leftover of an earlier process with the same pid that was SIGKILLed, so a few are tried.
fn create_uniquely_named<T>(
    path_for: impl Fn(u64) -> PathBuf,
    create: impl Fn(&Path) -> io::Result<T>,
) -> io::Result<(PathBuf, T)> {
    const ATTEMPTS: u32 = 64;
    let mut attempt = 0;
    loop {
        let path = path_for(NEXT_RESOURCE_SEQ.fetch_add(1, Ordering::Relaxed));
        match create(&path) {
            Ok(created) => return Ok((path, created)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempt + 1 < ATTEMPTS => attempt += 1,
            Err(e) => return Err(e),
        }
    }
}

fn require_root(what: &str) -> Result<()> {
    if rustix::process::geteuid().is_root() {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Permission, format!("{what} needs root (CAP_SYS_ADMIN); run tiermem as root")))
    }
}

/// An active swap file, created for the benchmark: swapoff and removed on drop.
#[derive(Debug)]
pub struct SwapFile {
    path: PathBuf,
    size_bytes: u64,
    file_system: &'static str,
    cleanup: Option<CleanupId>,
}

/// How the swap file's blocks were allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Allocation {
    Fallocate,
    ZeroWrites,
}

impl SwapFile {
    /// Create a swap file of `size` bytes (rounded up to whole pages) in `dir`, write a swap
    /// header into it and activate it with the highest swap priority.
    ///
    /// Blocks are allocated with fallocate, which ext4 and xfs accept for swap; where fallocate is
    /// unsupported, or the kernel rejects the fallocated file, the file is written with zeros.
    pub fn create(dir: &Path, size: u64) -> Result<SwapFile> {
        require_root("activating a swap file")?;
        let dir = std::fs::canonicalize(dir).map_err(|e| Error::os(e, format!("swap directory {}", dir.display())))?;
        if !dir.is_dir() {
            return Err(Error::invalid(format!("swap directory {} is not a directory", dir.display())));
        }
        let magic = rustix::fs::statfs(&dir)
            .map_err(|e| Error::os(e.into(), format!("statfs of {}", dir.display())))?
            .f_type as u32;
        let file_system = file_system_name(magic);
        if matches!(magic, TMPFS_MAGIC | RAMFS_MAGIC | OVERLAYFS_MAGIC | SQUASHFS_MAGIC) {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{} is on {file_system}, which cannot hold a swap file (the kernel needs a file system that maps file blocks \
                     to disk blocks); pass a directory on a disk-backed file system such as ext4 or xfs",
                    dir.display()
                ),
            ));
        }

        let page_size = rustix::param::page_size() as u64;
        let pages = size.div_ceil(page_size).max(SWAP_MIN_PAGES);
        if pages > u64::from(u32::MAX) {
            return Err(Error::invalid(format!("swap file of {size} bytes is larger than a swap header can describe")));
        }
        let size_bytes = pages * page_size;
        let space =
            rustix::fs::statvfs(&dir).map_err(|e| Error::os(e.into(), format!("statvfs of {}", dir.display())))?;
        let available = space.f_bavail.saturating_mul(space.f_frsize);
        if available < size_bytes {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "{} has {} MiB free, not enough for a {} MiB swap file",
                    dir.display(),
                    available >> 20,
                    size_bytes >> 20
                ),
            ));
        }

        let ((path, file), cleanup) = cleanup::create_registered(|| {
            let (path, file) = create_uniquely_named(
                |seq| dir.join(format!("tiermem-swap-{}-{seq}.swap", std::process::id())),
                |path| OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path),
            )
            .map_err(|e| Error::os(e, format!("creating a swap file in {}", dir.display())))?;
            let label = format!("swap file {}", path.display());
            let teardown_path = path.clone();
            let teardown: Teardown = Box::new(move || teardown_swap_file(&teardown_path));
            Ok(((path, file), label, teardown))
        })?;
        // From here on, an early return drops the guard, which deactivates and removes the file.
        let swap = SwapFile { path, size_bytes, file_system, cleanup: Some(cleanup) };

        let allocation = match rustix::fs::fallocate(&file, FallocateFlags::empty(), 0, size_bytes) {
            Ok(()) => Allocation::Fallocate,
            Err(rustix::io::Errno::OPNOTSUPP) => {
                swap.write_zeros(&file)?;
                Allocation::ZeroWrites
            }
            Err(e) => return Err(swap.allocation_error(e.into())),
        };
        swap.write_header(&file, page_size, pages)?;

        match swap.activate() {
            Err(e)
                if allocation == Allocation::Fallocate
                    && e.os_error().and_then(io::Error::raw_os_error) == Some(libc::EINVAL) =>
            {
                // Some file systems accept fallocate but not unwritten extents as swap: write it out.
                swap.write_zeros(&file)?;
                swap.write_header(&file, page_size, pages)?;
                swap.activate()?;
            }
            other => other?,
        }
        Ok(swap)
    }

    fn allocation_error(&self, e: io::Error) -> Error {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            Error::os_kind(
                ErrorKind::NoSpace,
                e,
                format!("no space for the {} MiB swap file {}", self.size_bytes >> 20, self.path.display()),
            )
        } else {
            Error::os(e, format!("allocating swap file {}", self.path.display()))
        }
    }

    fn write_zeros(&self, file: &File) -> Result<()> {
        let zeros = vec![0u8; ZERO_CHUNK_BYTES];
        let mut offset = 0u64;
        while offset < self.size_bytes {
            let chunk = (self.size_bytes - offset).min(ZERO_CHUNK_BYTES as u64) as usize;
            file.write_all_at(&zeros[..chunk], offset).map_err(|e| self.allocation_error(e))?;
            offset += chunk as u64;
        }
        Ok(())
    }

    fn write_header(&self, file: &File, page_size: u64, pages: u64) -> Result<()> {
        file.write_all_at(&swap_header(page_size as usize, pages as u32), 0).map_err(|e| self.allocation_error(e))?;
        // swapon maps the file's extents once; they must be on disk, not only in the journal.
        file.sync_all().map_err(|e| Error::os(e, format!("fsync of swap file {}", self.path.display())))
    }

    fn activate(&self) -> Result<()> {
        let path = path_cstring(&self.path)?;
        let cleanup = self.cleanup.as_ref().expect("an open SwapFile is registered");
        // Under the registry lock: a signal-triggered teardown cannot run between our swapon and
        // its own swapoff + unlink, which would leave an active swap file with no name.
        let rc = cleanup::while_registered(cleanup, || {
            // SAFETY: `path` is a valid NUL-terminated string; swapon does not retain it.
            unsafe { libc::swapon(path.as_ptr(), SWAP_FLAG_PREFER | SWAP_PRIORITY_MAX) }
        });
        match rc {
            None => Err(Error::new(ErrorKind::Internal, "swap file was removed by signal cleanup before swapon")),
            Some(0) => Ok(()),
            Some(_) => Err(self.swapon_error(io::Error::last_os_error())),
        }
    }

    fn swapon_error(&self, e: io::Error) -> Error {
        let path = self.path.display();
        match e.raw_os_error() {
            Some(libc::EPERM) => Error::os_kind(
                ErrorKind::Permission,
                e,
                format!(
                    "swapon {path}: needs CAP_SYS_ADMIN, or the system already has the maximum number of swap areas"
                ),
            ),
            Some(libc::EINVAL) => Error::os_kind(
                ErrorKind::Unsupported,
                e,
                format!(
                    "swapon {path}: the kernel rejected the file as swap; {} may not support swap files{}",
                    self.file_system,
                    if self.file_system == "btrfs" {
                        " unless the file is NOCOW (chattr +C) on a single device"
                    } else {
                        ""
                    }
                ),
            ),
            Some(libc::EBUSY) => Error::os(e, format!("swapon {path}: already in use as swap")),
            _ => Error::os(e, format!("swapon {path}")),
        }
    }

    /// Where the swap file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size in bytes, header page included.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The name of the file system holding it ("ext2/3/4", "xfs", ...).
    pub fn file_system(&self) -> &'static str {
        self.file_system
    }

    /// Deactivate and remove the swap file now, reporting failure (dropping does the same but can
    /// only print errors).
    pub fn close(mut self) -> Result<()> {
        match self.cleanup.take() {
            Some(cleanup) => cleanup::release(cleanup),
            None => Ok(()),
        }
    }
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        if let Some(cleanup) = self.cleanup.take() {
            if let Err(e) = cleanup::release(cleanup) {
                eprintln!("tiermem: error: {e}");
            }
        }
    }
}

/// The first page of a swap area: version-1 header, no bad pages, "SWAPSPACE2" signature at the
/// end of the page. Native byte order, as the kernel reads it.
fn swap_header(page_size: usize, pages: u32) -> Vec<u8> {
    const VOLUME_LABEL: &[u8] = b"tiermem-bench";
    let mut header = vec![0u8; page_size];
    let info = SWAP_HEADER_INFO_OFFSET;
    header[info..info + 4].copy_from_slice(&1u32.to_ne_bytes()); // version
    header[info + 4..info + 8].copy_from_slice(&(pages - 1).to_ne_bytes()); // last_page
                                                                            // nr_badpages = 0 (already zero); the 16-byte UUID is left zero: the kernel never reads it.
    let volume = info + 12 + 16;
    header[volume..volume + VOLUME_LABEL.len()].copy_from_slice(VOLUME_LABEL);
    header[page_size - 10..].copy_from_slice(b"SWAPSPACE2");
    header
}

/// swapoff(2), tried again when a signal interrupted it: the kernel gives up bringing the
/// area's pages back with EINTR whenever a signal is pending (a Ctrl-C during a run's last
/// swapoff), and the swap file would stay active, the top-priority area, until a later run.
fn swapoff(path: &Path) -> io::Result<()> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut interrupted = 0;
    loop {
        // SAFETY: swapoff(2) takes a NUL-terminated path, which `path` is, and does not retain it.
        let rc = unsafe { libc::syscall(libc::SYS_swapoff, path.as_ptr()) };
        if rc == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EINTR) || interrupted == SWAPOFF_INTERRUPTIONS {
            return Err(error);
        }
        interrupted += 1;
    }
}

/// Interruptions of one swapoff tried again before giving up (each is a signal handled).
const SWAPOFF_INTERRUPTIONS: u32 = 100;

fn teardown_swap_file(path: &Path) -> Result<()> {
    match swapoff(path) {
        // EINVAL: not an active swap area, i.e. cleanup before (or after a failed) swapon.
        Err(e) if e.raw_os_error() != Some(libc::EINVAL) => {
            return Err(Error::os(
                e,
                format!("swapoff {}; the file was left in place, run `swapoff {0}` and delete it", path.display()),
            ));
        }
        _ => {}
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(Error::os(e, format!("removing swap file {}", path.display())))
        }
        _ => Ok(()),
    }
}

/// Whether process `pid` is gone (signal 0 says no such process).
fn process_gone(pid: u32) -> bool {
    let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) else { return false };
    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
}

/// The pid in a name `PREFIX-PID-SEQ` that tiermem gives its swap files and cgroups, if it is one.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let mut parts = rest.trim_end_matches(".swap").rsplitn(3, '-');
    let (_seq, pid) = (parts.next()?.parse::<u64>().ok()?, parts.next()?.parse::<u32>().ok()?);
    Some(pid)
}

/// Remove what a killed run (SIGKILL, a crash of the machine's OOM killer) could not: active swap
/// files and memory cgroups tiermem made (`tiermem-swap-PID-SEQ.swap`, `tiermem-*-PID-SEQ`)
/// whose process is gone, and in `swap_dir` such swap files never swapped on (a run killed while
/// it wrote one). Each removal is reported on stderr; failures are reported and skipped.
///
/// A pid that is gone here may be alive in another PID namespace (a run in a container sharing
/// the cgroup hierarchy and the swap list), so a cgroup that still has tasks is left alone, and
/// so is a swap file whose pid still names such a cgroup.
pub fn remove_stale_leftovers(swap_dir: Option<&Path>) {
    let root = memory_hierarchy().ok().map(|(_, root)| root);
    let tiermem_cgroups: Vec<(String, bool)> = root
        .as_ref()
        .and_then(|r| std::fs::read_dir(r).ok())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let busy = std::fs::read_to_string(entry.path().join("cgroup.procs")).is_ok_and(|t| !t.trim().is_empty());
            name.starts_with("tiermem-").then_some((name, busy))
        })
        .collect();
    let busy_pid = |pid: u32| tiermem_cgroups.iter().any(|(name, busy)| *busy && owner_pid(name, "") == Some(pid));
    let active = active_swap_paths().unwrap_or_default();
    // Files in `swap_dir` not active: their run never got to swapon (the path compared as the
    // kernel lists it, the directory's own spelling canonicalised).
    let canonical = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let inactive = swap_dir
        .and_then(|dir| std::fs::read_dir(dir).ok())
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "swap") && !active.contains(&canonical(path)));
    let candidates: Vec<PathBuf> = active.iter().cloned().chain(inactive).collect();
    for path in candidates {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if owner_pid(&name, "tiermem-swap-").is_some_and(|pid| process_gone(pid) && !busy_pid(pid)) {
            match teardown_swap_file(&path) {
                Ok(()) => eprintln!("tiermem: removed swap file {} left by a killed run", path.display()),
                Err(e) => eprintln!("tiermem: warning: {e}"),
            }
        }
    }
    let Some(root) = root else { return };
    for (name, busy) in &tiermem_cgroups {
        if !busy && owner_pid(name, "").is_some_and(process_gone) {
            let path = root.join(name);
            match teardown_cgroup(&path, &root.join("cgroup.procs")) {
                Ok(()) => eprintln!("tiermem: removed memory cgroup {} left by a killed run", path.display()),
                Err(e) => eprintln!("tiermem: warning: {e}"),
            }
        }
    }
}

/// The swap areas the kernel currently has active, as listed in /proc/swaps.
pub fn active_swap_paths() -> Result<Vec<PathBuf>> {
    let table = std::fs::read_to_string("/proc/swaps").map_err(|e| Error::os(e, "reading /proc/swaps"))?;
    Ok(table
        .lines()
        .skip(1)
        .filter_map(|line| line.split_whitespace().next())
        .map(|name| PathBuf::from(unescape_proc_path(name)))
        .collect())
}

/// /proc/swaps writes space, tab, newline and backslash in paths as `\ooo` octal escapes.
fn unescape_proc_path(escaped: &str) -> std::ffi::OsString {
    let bytes = escaped.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|digits| bytes[i] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d)));
        match octal {
            Some(digits) => {
                out.push(digits.iter().fold(0u8, |value, d| value.wrapping_mul(8) + (d - b'0')));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    std::ffi::OsStr::from_bytes(&out).to_owned()
}

/// Which cgroup interface the memory controller is reached through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupVersion {
    /// The legacy per-controller hierarchy (memory.limit_in_bytes, tasks, ...).
    V1,
    /// The unified hierarchy (memory.max, memory.swap.max, ...).
    V2,
}

/// Where the memory controller is mounted on this machine, detected from /proc/self/mounts: a
/// cgroup v1 hierarchy with the `memory` option, else a cgroup2 mount whose root offers `memory`.
pub fn memory_hierarchy() -> Result<(CgroupVersion, PathBuf)> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| Error::os(e, "reading /proc/self/mounts"))?;
    let mut unified = None;
    for line in mounts.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [_, mount_point, fs_type, options, ..] = fields[..] else { continue };
        let mount_point = PathBuf::from(unescape_proc_path(mount_point));
        if fs_type == "cgroup" && options.split(',').any(|option| option == "memory") {
            return Ok((CgroupVersion::V1, mount_point));
        }
        if fs_type == "cgroup2" && unified.is_none() {
            let controllers = std::fs::read_to_string(mount_point.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|controller| controller == "memory") {
                unified = Some(mount_point);
            }
        }
    }
    unified.map(|root| (CgroupVersion::V2, root)).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            "no memory cgroup controller is mounted (neither a cgroup v1 `memory` hierarchy nor cgroup2 with `memory`)",
        )
    })
}

/// A memory cgroup created for the benchmark at the top of the memory hierarchy, removed on drop
/// (after killing any task still in it).
#[derive(Debug)]
pub struct MemCgroup {
    dir: PathBuf,
    version: CgroupVersion,
    cleanup: Option<CleanupId>,
}

impl MemCgroup {
    /// Create `<hierarchy>/<name_prefix>-<pid>-<n>` limited to `limit_bytes` of memory; swap use is
    /// not limited.
    pub fn create(name_prefix: &str, limit_bytes: u64) -> Result<MemCgroup> {
        Self::create_with_swap_limit(name_prefix, limit_bytes, None)
    }

    /// As [`MemCgroup::create`], and when `swap_limit_bytes` is given also cap the swap the
    /// cgroup may use (v1: memory.memsw.limit_in_bytes = limit + swap; v2: memory.swap.max).
    /// On v1 memory.swappiness is set to 60, the kernel default, so a host tuned otherwise does
    /// not change the result; on v2 the global vm.swappiness applies.
    pub fn create_with_swap_limit(
        name_prefix: &str,
        limit_bytes: u64,
        swap_limit_bytes: Option<u64>,
    ) -> Result<MemCgroup> {
        if name_prefix.is_empty() || name_prefix.contains('/') || name_prefix.starts_with('.') {
            return Err(Error::invalid(format!(
                "cgroup name prefix {name_prefix:?} must be a plain, non-empty file name"
            )));
        }
        if limit_bytes == 0 {
            return Err(Error::invalid("cgroup memory limit must be positive"));
        }
        require_root("creating a memory cgroup")?;
        let (version, root) = memory_hierarchy()?;
        if version == CgroupVersion::V2 {
            let enabled = std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
            if !enabled.split_whitespace().any(|controller| controller == "memory") {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("the memory controller is not enabled for children of {0}; enable it with `echo +memory > {0}/cgroup.subtree_control`", root.display()),
                ));
            }
        }

        let parent_procs = root.join("cgroup.procs");
        let (dir, cleanup) = cleanup::create_registered(|| {
            let (dir, ()) = create_uniquely_named(
                |seq| root.join(format!("{name_prefix}-{}-{seq}", std::process::id())),
                |dir| std::fs::create_dir(dir),
            )
            .map_err(|e| Error::os(e, format!("creating a memory cgroup in {}", root.display())))?;
            let label = format!("memory cgroup {}", dir.display());
            let teardown_dir = dir.clone();
            let teardown: Teardown = Box::new(move || teardown_cgroup(&teardown_dir, &parent_procs));
            Ok((dir, label, teardown))
        })?;
        // From here on, an early return drops the guard, which removes the directory.
        let cgroup = MemCgroup { dir, version, cleanup: Some(cleanup) };
        match version {
            CgroupVersion::V1 => {
                cgroup.write_knob("memory.swappiness", "60")?;
                cgroup.write_knob("memory.limit_in_bytes", &limit_bytes.to_string())?;
                if let Some(swap) = swap_limit_bytes {
                    if !cgroup.dir.join("memory.memsw.limit_in_bytes").exists() {
                        return Err(Error::new(
                            ErrorKind::Unsupported,
                            "swap accounting is off (no memory.memsw.limit_in_bytes); boot with swapaccount=1 to limit swap",
                        ));
                    }
                    cgroup.write_knob("memory.memsw.limit_in_bytes", &limit_bytes.saturating_add(swap).to_string())?;
                }
            }
            CgroupVersion::V2 => {
                cgroup.write_knob("memory.max", &limit_bytes.to_string())?;
                if let Some(swap) = swap_limit_bytes {
                    cgroup.write_knob("memory.swap.max", &swap.to_string())?;
                }
            }
        }
        Ok(cgroup)
    }

    fn write_knob(&self, knob: &str, value: &str) -> Result<()> {
        let path = self.dir.join(knob);
        std::fs::write(&path, value).map_err(|e| Error::os(e, format!("writing {value} to {}", path.display())))
    }

    fn read_knob(&self, knob: &str) -> Result<String> {
        let path = self.dir.join(knob);
        std::fs::read_to_string(&path).map_err(|e| Error::os(e, format!("reading {}", path.display())))
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Which cgroup interface it uses.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The file a process id is written to in order to move that process into the cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Move process `pid` (all its threads) into the cgroup. Memory it already has stays charged
    /// where it was; use [`run_in_cgroup`] to start a process inside.
    pub fn add_pid(&self, pid: u32) -> Result<()> {
        self.write_knob("cgroup.procs", &pid.to_string())
    }

    /// The processes in the cgroup.
    pub fn pids(&self) -> Result<Vec<u32>> {
        Ok(parse_pids(&self.read_knob("cgroup.procs")?))
    }

    /// The highest memory usage the cgroup has seen (v1 memory.max_usage_in_bytes, v2 memory.peak).
    pub fn peak_bytes(&self) -> Result<u64> {
        let knob = match self.version {
            CgroupVersion::V1 => "memory.max_usage_in_bytes",
            CgroupVersion::V2 => "memory.peak",
        };
        let text = self.read_knob(knob)?;
        text.trim()
            .parse()
            .map_err(|_| Error::new(ErrorKind::Internal, format!("unexpected contents of {knob}: {text:?}")))
    }

    /// How many processes the OOM killer has killed in this cgroup, if the kernel reports it
    /// (v1 memory.oom_control, v2 memory.events).
    pub fn oom_kills(&self) -> Option<u64> {
        let knob = match self.version {
            CgroupVersion::V1 => "memory.oom_control",
            CgroupVersion::V2 => "memory.events",
        };
        keyed_values(&self.read_knob(knob).ok()?).remove("oom_kill")
    }

    /// The counters of memory.stat (e.g. `pgmajfault`, which counts swap-ins of the cgroup's tasks).
    pub fn memory_stat(&self) -> Result<BTreeMap<String, u64>> {
        Ok(keyed_values(&self.read_knob("memory.stat")?))
    }

    /// Remove the cgroup now (killing any task still in it), reporting failure.
    pub fn close(mut self) -> Result<()> {
        match self.cleanup.take() {
            Some(cleanup) => cleanup::release(cleanup),
            None => Ok(()),
        }
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if let Some(cleanup) = self.cleanup.take() {
            if let Err(e) = cleanup::release(cleanup) {
                eprintln!("tiermem: error: {e}");
            }
        }
    }
}

fn parse_pids(text: &str) -> Vec<u32> {
    text.split_whitespace().filter_map(|pid| pid.parse().ok()).collect()
}

/// Parse "key value" lines (memory.stat, memory.events, memory.oom_control).
fn keyed_values(text: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter_map(|line| {
            let (key, value) = line.split_once(' ')?;
            Some((key.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// Empty the cgroup and remove it: this process (if someone added it) is moved back to the
/// hierarchy root, every other task is killed, and rmdir is retried until the tasks are gone.
fn teardown_cgroup(dir: &Path, parent_procs: &Path) -> Result<()> {
    let procs = dir.join("cgroup.procs");
    let own_pid = std::process::id();
    let deadline = Instant::now() + CGROUP_TEARDOWN_TIMEOUT;
    loop {
        let pids = match std::fs::read_to_string(&procs) {
            Ok(text) => parse_pids(&text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::os(e, format!("reading {}", procs.display()))),
        };
        for pid in &pids {
            if *pid == own_pid {
                std::fs::write(parent_procs, own_pid.to_string())
                    .map_err(|e| Error::os(e, format!("moving this process out of {}", dir.display())))?;
            } else if let Some(pid) = rustix::process::Pid::from_raw(*pid as i32) {
                // ESRCH: it exited meanwhile, which is what we want anyway.
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        if pids.is_empty() {
            match std::fs::remove_dir(dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                // EBUSY: killed tasks are still exiting.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {}
                Err(e) => return Err(Error::os(e, format!("removing memory cgroup {}", dir.display()))),
            }
        }
        if Instant::now() >= deadline {
            return Err(Error::new(
                ErrorKind::Io,
                format!(
                    "memory cgroup {} still has tasks {pids:?} after {CGROUP_TEARDOWN_TIMEOUT:?}; remove it by hand",
                    dir.display()
                ),
            ));
        }
        std::thread::sleep(CGROUP_TEARDOWN_POLL);
    }
}

/// Have `command`'s child join `cgroup` between fork and exec (so everything the new program
/// allocates is charged there) and die with this process, even killed outright: left running,
/// a program kept its cgroup and the swap file, which no later sweep takes from a live cgroup.
/// Adds a pre-exec hook to `command`.
pub(crate) fn start_inside(cgroup: &MemCgroup, command: &mut Command) -> Result<()> {
    let procs_file = path_cstring(&cgroup.procs_file())?;
    let us = rustix::process::getpid();
    // SAFETY: the hook runs in the forked child before exec, where only async-signal-safe work is
    // allowed: it calls prctl, getppid, getpid, open, write and close through rustix (raw system
    // calls), formats into a stack buffer and allocates nothing (io::Error from an errno does not
    // allocate).
    unsafe {
        command.pre_exec(move || {
            tiermem_sys::child::die_with_parent(us)?;
            tiermem_sys::cgroup::join_cgroup_in_child(&procs_file)
        });
    }
    Ok(())
}

/// Run `command` to completion inside `cgroup` and return its output (stdout captured; stderr as
/// configured on `command`, captured by default).
///
/// The child joins the cgroup between fork and exec (see [`start_inside`]). Adds a pre-exec
/// hook to `command`; do not reuse it for another cgroup.
pub fn run_in_cgroup(cgroup: &MemCgroup, command: &mut Command) -> Result<Output> {
    command.stdout(Stdio::piped());
    start_inside(cgroup, command)?;
    let program = command.get_program().to_string_lossy().into_owned();
    command
        .output()
        .map_err(|e| Error::os(e, format!("running {program} in memory cgroup {}", cgroup.path().display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_header_has_signature_version_and_last_page() {
        let header = swap_header(4096, 256);
        assert_eq!(&header[4096 - 10..], b"SWAPSPACE2");
        assert_eq!(u32::from_ne_bytes(header[1024..1028].try_into().unwrap()), 1);
        assert_eq!(u32::from_ne_bytes(header[1028..1032].try_into().unwrap()), 255);
        assert_eq!(u32::from_ne_bytes(header[1032..1036].try_into().unwrap()), 0);
    }

    #[test]
    fn proc_paths_are_unescaped() {
        assert_eq!(unescape_proc_path(r"/tmp/a\040b\134c"), std::ffi::OsString::from(r"/tmp/a b\c"));
        assert_eq!(unescape_proc_path("/swapfile"), std::ffi::OsString::from("/swapfile"));
    }

    #[test]
    fn unique_names_skip_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("leftover"), b"").unwrap();
        let calls = std::cell::Cell::new(0);
        let (path, ()) = create_uniquely_named(
            |seq| {
                calls.set(calls.get() + 1);
                dir.path().join(if calls.get() == 1 { "leftover".to_owned() } else { format!("fresh-{seq}") })
            },
            |path| OpenOptions::new().write(true).create_new(true).open(path).map(drop),
        )
        .unwrap();
        assert_eq!(calls.get(), 2);
        assert!(path.file_name().unwrap().to_string_lossy().starts_with("fresh-"));
    }

    #[test]
    fn keyed_values_parse_oom_control() {
        let values = keyed_values("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n");
        assert_eq!(values.get("oom_kill"), Some(&3));
    }
}
