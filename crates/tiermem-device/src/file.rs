//! File or block device through io_uring with O_DIRECT and registered buffers.
//!
//! Slot `n` is the 4 KiB at byte offset `n * 4096`. Every queue is its own io_uring instance with
//! the device file registered as fixed file 0 and the whole [`BufferArena`] registered as fixed
//! buffer 0 (an arena beyond 1 GiB, the kernel's limit for one fixed buffer, as one per GiB), so
//! a request neither looks up the file nor pins memory. One request is one 4 KiB `READ_FIXED` or
//! `WRITE_FIXED`; nothing is merged or reordered.
//!
//! Polled queues use `IORING_SETUP_IOPOLL` when a probe read at open succeeds through such a
//! ring, and otherwise an ordinary ring whose completion queue the waiter spins on in user space.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};
use rustix::event::{eventfd, EventfdFlags};
use tiermem_sys::guarded_fd::{self, Guard, Guarded};

use crate::backing::Backing;
use crate::{
    check_blocking_read, check_queue_depth, check_request, BufferArena, Completion, Device, DeviceCounters, Error,
    ErrorKind, IoQueue, QueueKind, Request, Result, WaitMode, PAGE_SIZE,
};

/// Bytes per slot, as a file offset type.
const SLOT_BYTES: u64 = PAGE_SIZE as u64;

/// The largest buffer the kernel lets one io_uring fixed-buffer entry cover.
const FIXED_BUFFER_MAX_BYTES: usize = 1 << 30;

/// `IORING_ENTER_GETEVENTS` (the io-uring crate keeps its constants private).
const ENTER_GETEVENTS: u32 = 1;

/// A file or block device holding slots, accessed with O_DIRECT through io_uring.
#[derive(Debug)]
pub struct FileDevice {
    shared: Arc<OpenFile>,
}

/// What the device and its queues share.
#[derive(Debug)]
struct OpenFile {
    /// Guarded from the program's closes under the preload (see [`tiermem_sys::guarded_fd`]).
    file: Guarded<File>,
    path: PathBuf,
    slots: u64,
    counters: DeviceCounters,
    polled_wait: PolledWait,
    /// Set once a queue could not register the arena (RLIMIT_MEMLOCK) and reads and writes
    /// through plain buffers instead, said by `describe`.
    plain_buffers: std::sync::atomic::AtomicBool,
    /// The slots with blocks set aside: a regular file's grow as slots are handed out.
    backing: Backing,
}

/// How polled queues of this file wait, decided by the probe at open.
#[derive(Debug, Clone)]
enum PolledWait {
    /// IOPOLL rings work on this file.
    KernelPoll,
    /// IOPOLL failed for the stated reason; spin on an ordinary ring's completion queue.
    Spin { why_not_iopoll: String },
}

impl FileDevice {
    /// Open `path` with O_DIRECT as a device.
    ///
    /// With `size`, a missing regular file is created (sized, its blocks set aside as slots are
    /// used: see [`Device::back_slots`]) and a smaller one extended (fallocate, then zeros
    /// written) to `size` bytes, which must be a non-zero multiple of 4096; a block device must
    /// be at least that large. Without `size`, the file must exist. Either way the device has
    /// one slot per whole 4 KiB of the file or block device as it then is.
    pub fn open(path: &Path, size: Option<u64>) -> Result<Self> {
        if let Some(size) = size {
            if size == 0 || !size.is_multiple_of(SLOT_BYTES) {
                return Err(Error::invalid(format!(
                    "device size of {size} bytes for {} is not a non-zero multiple of {PAGE_SIZE} (one slot)",
                    path.display()
                )));
            }
        }
        let (file, created) = open_direct(path, size.is_some())?;
        if file.metadata().is_ok_and(|m| m.is_file()) {
            // Marks the file as a device file: `tiermem run` refuses to page into a file holding
            // data without this mark (someone's file, named by mistake). Set on every open, so
            // a file the user made for tiermem (`fallocate`) is reusable after its first run.
            // Best effort: where the file system keeps no user attributes, such a file is
            // refused once it holds data, with a message that says so.
            let _ = rustix::fs::fsetxattr(&file, OWNER_XATTR, b"tiermem", rustix::fs::XattrFlags::empty());
        }
        // One engine per device file: two would hand out the same slots. A device just closed
        // may hold the lock a moment longer (the kernel tears io_uring rings down, and their
        // registered file, asynchronously), so a busy lock is retried for up to two seconds.
        let mut tries = 0;
        let locked = loop {
            match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Err(rustix::io::Errno::WOULDBLOCK) if tries < 200 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other,
            }
        };
        if let Err(e) = locked {
            return Err(if e == rustix::io::Errno::WOULDBLOCK {
                Error::new(
                    ErrorKind::Busy,
                    format!("device file {} is in use by another tiermem engine", path.display()),
                )
            } else {
                Error::os(e.into(), format!("locking device file {}", path.display()))
            });
        }
        // A file that existed is extended with zeros written (see `write_zeros`: every slot then
        // a plain block, as a swap file's are, which the microbenchmark's fairness needs). One
        // this call created is only sized, as a temporary device file is: `tiermem run` sizes
        // it for the program's worst case (the machine's memory by default), and writing that
        // much would hold the program up for seconds (see `backing` for its blocks).
        let device = Self::set_up(file, path, size, !created);
        if created && device.is_err() {
            // Leave nothing behind from a failed attempt.
            let _ = std::fs::remove_file(path);
        }
        device
    }

    /// A private device of `size` bytes in directory `dir`: an unnamed file (O_TMPFILE) that
    /// disappears with its last descriptor, so nothing is left behind even if the process is
    /// killed. Its blocks are set aside as slots are used (see [`Device::back_slots`]) and not
    /// zero-filled: the first write of each slot pays the file system's extent conversion,
    /// which is cheaper than writing the whole file up front when the device is sized for a
    /// program's worst case.
    pub fn create_temporary(dir: &Path, size: u64) -> Result<Self> {
        Self::temporary(dir, size, false)
    }

    /// [`FileDevice::create_temporary`] with every slot written with zeros first, as a named
    /// file [`FileDevice::open`] creates is: for a measurement, in which the first write of a
    /// slot must not pay the file system's extent conversion. Unnamed from the start, so a
    /// process killed during the fill leaves nothing (a named file made for it was left behind).
    pub fn create_temporary_zeroed(dir: &Path, size: u64) -> Result<Self> {
        Self::temporary(dir, size, true)
    }

    fn temporary(dir: &Path, size: u64, zero_fill: bool) -> Result<Self> {
        if size == 0 || !size.is_multiple_of(SLOT_BYTES) {
            return Err(Error::invalid(format!(
                "device size of {size} bytes is not a non-zero multiple of {PAGE_SIZE} (one slot)"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_TMPFILE)
            .mode(0o600)
            .open(dir)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EISDIR) | Some(libc::EOPNOTSUPP) => Error::os_kind(
                    ErrorKind::Unsupported,
                    e,
                    format!(
                        "the file system of {} cannot create unnamed files (O_TMPFILE); name a device file",
                        dir.display()
                    ),
                ),
                _ => open_error(e, &dir.join("<temporary device file>")),
            })?;
        Self::set_up(file, &dir.join("<temporary device file>"), Some(size), zero_fill)
    }

    fn set_up(file: File, path: &Path, size: Option<u64>, zero_fill: bool) -> Result<Self> {
        let shown = path.display();
        let metadata = file.metadata().map_err(|e| Error::os(e, format!("reading the size of {shown}")))?;
        let file_type = metadata.file_type();
        let bytes = if file_type.is_block_device() {
            // A block device's size is where its end is; st_size is 0.
            let bytes = rustix::fs::seek(&file, rustix::fs::SeekFrom::End(0))
                .map_err(|e| Error::os(e.into(), format!("reading the size of block device {shown}")))?;
            if let Some(size) = size {
                if bytes < size {
                    return Err(Error::new(
                        ErrorKind::TooSmall,
                        format!("block device {shown} holds {bytes} bytes, less than the {size} bytes asked for"),
                    ));
                }
            }
            bytes
        } else if file_type.is_file() {
            match size {
                Some(size) if metadata.len() < size => {
                    extend(&file, path, metadata.len(), size, zero_fill)?;
                    size
                }
                _ => metadata.len(),
            }
        } else {
            return Err(not_a_device(path));
        };
        let slots = bytes / SLOT_BYTES;
        if slots == 0 {
            return Err(Error::new(
                ErrorKind::TooSmall,
                format!("device file {shown} is {bytes} bytes, less than one {PAGE_SIZE}-byte slot; give a size to extend it"),
            ));
        }
        // A file written with zeros from its start holds all its blocks already.
        let written_in_full = file_type.is_file() && zero_fill && size.is_some() && metadata.len() == 0;
        let backing = if file_type.is_block_device() || written_in_full {
            Backing::complete(slots)
        } else {
            Backing::growing(slots)
        };
        // A first step now: a file system without room for even one slot fails the open.
        backing.back(&file, 1, 1).map_err(|e| match e.raw_os_error() {
            Some(libc::ENOSPC) => Error::os_kind(
                ErrorKind::NoSpace,
                e,
                format!("no space in the file system of device file {shown} for its first slot"),
            ),
            _ => Error::os(e, format!("setting aside the first slots of device file {shown} (fallocate)")),
        })?;
        let block_device = if file_type.is_block_device() { metadata.rdev() } else { metadata.dev() };
        // sysfs first: the probe read proves nothing when slot 0 was never written.
        let iopoll = match block_device_without_poll_queues(block_device) {
            Some(why_not) => Err(why_not),
            None => probe_kernel_poll(&file, path),
        };
        let polled_wait = match iopoll {
            Ok(()) => PolledWait::KernelPoll,
            Err(why_not_iopoll) => PolledWait::Spin { why_not_iopoll },
        };
        let shared = OpenFile {
            file: Guarded::new(file),
            path: path.to_owned(),
            slots,
            counters: DeviceCounters::default(),
            polled_wait,
            plain_buffers: std::sync::atomic::AtomicBool::new(false),
            backing,
        };
        Ok(Self { shared: Arc::new(shared) })
    }

    /// The path the device was opened at.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// How [`QueueKind::Polled`] queues of this device wait: [`WaitMode::KernelPoll`] when
    /// IOPOLL works on this file, else [`WaitMode::SpinOnCompletionRing`].
    pub fn polled_wait_mode(&self) -> WaitMode {
        match self.shared.polled_wait {
            PolledWait::KernelPoll => WaitMode::KernelPoll,
            PolledWait::Spin { .. } => WaitMode::SpinOnCompletionRing,
        }
    }
}

fn not_a_device(path: &Path) -> Error {
    Error::invalid(format!(
        "{} is neither a regular file nor a block device (a character device, pipe or socket cannot hold pages)",
        path.display()
    ))
}

/// The extended attribute on regular files opened as devices (see [`FileDevice::open`]).
pub const OWNER_XATTR: &str = "user.tiermem.device";

/// Open read-write with O_DIRECT; with `may_create`, create the file if it is missing. Returns
/// the file and whether this call created it. A block device is opened exclusively (O_EXCL):
/// the kernel then refuses one that is mounted or in use by another exclusive opener.
fn open_direct(path: &Path, may_create: bool) -> Result<(File, bool)> {
    let kind = std::fs::metadata(path).map(|m| m.file_type());
    if let Ok(t) = &kind {
        if !(t.is_file() || t.is_block_device() || t.is_dir()) {
            return Err(not_a_device(path));
        }
    }
    let block_device = kind.is_ok_and(|t| t.is_block_device());
    if block_device {
        // A device this process just closed may stay held a moment (the kernel tears io_uring
        // rings and their files down asynchronously), which O_EXCL sees as EBUSY: retried for
        // up to two seconds, as the engine lock is.
        let mut tries = 0;
        loop {
            let opened =
                OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT | libc::O_EXCL).open(path);
            match opened {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && tries < 200 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Ok(file) => return Ok((file, false)),
                Err(e) => return Err(open_error(e, path)),
            }
        }
    }
    let open = |create: bool| {
        let mut options = OpenOptions::new();
        options.read(true).write(true).custom_flags(libc::O_DIRECT);
        if create {
            options.create_new(true).mode(0o600);
        }
        options.open(path)
    };
    match open(false) {
        Ok(file) => Ok((file, false)),
        Err(e) if may_create && e.raw_os_error() == Some(libc::ENOENT) => match open(true) {
            Ok(file) => Ok((file, true)),
            // Created by someone else in between: use it.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                open(false).map(|file| (file, false)).map_err(|e| open_error(e, path))
            }
            Err(e) => {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    // The kernel creates the file before it refuses O_DIRECT; O_EXCL made it ours.
                    let _ = std::fs::remove_file(path);
                }
                Err(open_error(e, path))
            }
        },
        Err(e) => Err(open_error(e, path)),
    }
}

/// Refuse a device path that holds someone's data, for callers whose device contents are
/// scratch (`tiermem run`): a regular file with data that tiermem did not create
/// (no [`OWNER_XATTR`]; sparse and fallocated files hold none), or a block device carrying a
/// partition table, file system or swap signature. A typo such as `file:/dev/vda` or
/// `file:notes.txt` must not be paged over.
pub fn refuse_foreign_data(path: &Path) -> Result<()> {
    let shown = path.display();
    let Ok(metadata) = std::fs::metadata(path) else { return Ok(()) };
    if metadata.file_type().is_block_device() {
        let mut head = vec![0u8; 72 << 10];
        let read = File::open(path).and_then(|f| read_up_to(&f, &mut head));
        if let Some(what) = read.ok().and_then(|n| signature(&head[..n])) {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "block device {shown} holds {what}; tiermem would overwrite it. If it is really free, \
                     wipe it first (wipefs -a {shown})"
                ),
            ));
        }
        return Ok(());
    }
    if !metadata.is_file() || metadata.len() == 0 {
        return Ok(());
    }
    let Ok(file) = File::open(path) else { return Ok(()) };
    let mut mark = [0u8; 16];
    if rustix::fs::fgetxattr(&file, OWNER_XATTR, &mut mark).is_ok() {
        return Ok(());
    }
    match rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(0)) {
        Err(rustix::io::Errno::NXIO) => Ok(()),
        _ => Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{shown} already holds {} bytes of data and is not marked as a device file (no {OWNER_XATTR} \
                 attribute), so paging might overwrite someone's data; name a new file, an empty one, or a \
                 directory (for a temporary device file), or if it is a device file of tiermem on a file system \
                 without user attributes, remove it (rm {shown})",
                metadata.len()
            ),
        )),
    }
}

fn read_up_to(file: &File, buf: &mut [u8]) -> io::Result<usize> {
    use std::io::Read;
    let mut done = 0;
    let mut reader = file;
    while done < buf.len() {
        match reader.read(&mut buf[done..])? {
            0 => break,
            n => done += n,
        }
    }
    Ok(done)
}

/// What the first bytes of a block device say it holds, if anything known.
fn signature(head: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, magic: &[u8]| head.get(offset..offset + magic.len()) == Some(magic);
    let known: [(usize, &[u8], &'static str); 11] = [
        (1080, &[0x53, 0xEF], "an ext2/3/4 file system"),
        (512, b"LABELONE", "an LVM physical volume"),
        (4096, &[0xFC, 0x4E, 0x2B, 0xA9], "a Linux RAID (md) member"),
        (0, b"XFSB", "an XFS file system"),
        (65600, b"_BHRfS_M", "a btrfs file system"),
        (0, b"LUKS\xba\xbe", "a LUKS container"),
        (512, b"EFI PART", "a GPT partition table"),
        (0, b"hsqs", "a squashfs image"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (4086, b"SWAP-SPACE", "a swap area"),
        (510, &[0x55, 0xAA], "a boot sector (MBR partition table or a FAT/NTFS file system)"),
    ];
    known.iter().find(|(offset, magic, _)| at(*offset, magic)).map(|&(_, _, what)| what)
}

/// An error from opening `path` that says what to do about it.
fn open_error(e: io::Error, path: &Path) -> Error {
    let shown = path.display();
    match e.raw_os_error() {
        Some(libc::ENOENT) => {
            let missing_dir = path.parent().filter(|dir| !dir.as_os_str().is_empty() && !dir.is_dir());
            match missing_dir {
                Some(dir) => Error::os_kind(
                    ErrorKind::NotFound,
                    e,
                    format!("cannot open device file {shown}: its directory {} does not exist", dir.display()),
                ),
                None => Error::os_kind(
                    ErrorKind::NotFound,
                    e,
                    format!(
                        "device file {shown} does not exist; create it (for example `fallocate -l 4G {shown}`) \
                         or give a size so tiermem creates it"
                    ),
                ),
            }
        }
        Some(libc::EINVAL) => Error::os_kind(
            ErrorKind::Unsupported,
            e,
            format!(
                "file system of {shown} does not support O_DIRECT (tmpfs?); put the device file on a disk file \
                 system or use --device mem"
            ),
        ),
        Some(libc::EACCES) | Some(libc::EPERM) => Error::os_kind(
            ErrorKind::Permission,
            e,
            format!("no permission to open device file {shown} for reading and writing"),
        ),
        Some(libc::EBUSY) => Error::os_kind(
            ErrorKind::InUse,
            e,
            format!(
                "block device {shown} is in use (mounted, or held by another program); tiermem will not write to it"
            ),
        ),
        Some(libc::EROFS) => {
            Error::os_kind(ErrorKind::Permission, e, format!("device file {shown} is on a read-only file system"))
        }
        Some(libc::EISDIR) => Error::os_kind(
            ErrorKind::InvalidInput,
            e,
            format!("{shown} is a directory; the device must be a file or a block device"),
        ),
        Some(libc::ENOTDIR) => Error::os_kind(
            ErrorKind::NotFound,
            e,
            format!("cannot open device file {shown}: a component of the path is not a directory"),
        ),
        _ => Error::os(e, format!("opening device file {shown} with O_DIRECT")),
    }
}

/// Grow a regular file from `from` to `to` bytes: with `zero_fill`, allocated and written now;
/// without, only sized, its blocks set aside later as slots are used (see `backing`), but
/// refused if its file system is not that large. (Not its free space now: other processes of
/// the run set their devices' blocks aside meanwhile, and give them back when they end.)
fn extend(file: &File, path: &Path, from: u64, to: u64, zero_fill: bool) -> Result<()> {
    let shown = path.display();
    let no_space = || {
        Error::os_kind(
            ErrorKind::NoSpace,
            rustix::io::Errno::NOSPC.into(),
            format!("no space to extend device file {shown} from {from} to {to} bytes; free space or ask for a smaller device"),
        )
    };
    if !zero_fill {
        // (Some file systems, FUSE ones without statfs among them, give no size: 0.)
        let size = rustix::fs::fstatvfs(file).map(|fs| fs.f_blocks.saturating_mul(fs.f_frsize));
        if size.is_ok_and(|size| size > 0 && to - from > size) {
            return Err(no_space());
        }
        return file
            .set_len(to)
            .map_err(|e| Error::os(e, format!("extending device file {shown} from {from} to {to} bytes")));
    }
    match rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, to) {
        Ok(()) => write_zeros(file, path, from, to),
        Err(rustix::io::Errno::NOSPC) | Err(rustix::io::Errno::DQUOT) => Err(no_space()),
        // A file system without fallocate still takes a sparse file.
        Err(rustix::io::Errno::OPNOTSUPP) => {
            file.set_len(to)
                .map_err(|e| Error::os(e, format!("extending device file {shown} from {from} to {to} bytes")))?;
            write_zeros(file, path, from, to)
        }
        Err(e) => {
            Err(Error::os(e.into(), format!("extending device file {shown} from {from} to {to} bytes with fallocate")))
        }
    }
}

/// Write zeros over `[from, to)`. fallocate leaves *unwritten* extents: the first write to each
/// block then converts its extent in the journal (slow, and io_uring hands such writes to worker
/// threads), and reads of never-written blocks cost no I/O at all. Writing once makes every slot
/// a plain allocated block, as a swap file's are, so measured latencies are the device's.
fn write_zeros(file: &File, path: &Path, from: u64, to: u64) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    let zeros = tiermem_sys::mem::Mapping::anonymous(CHUNK, false)?;
    // From the page holding `from`: O_DIRECT writes at page offsets only (an existing file whose
    // size is not a multiple of a page ends mid-page; what it holds there is zeros, checked).
    let mut at = from / PAGE_SIZE as u64 * PAGE_SIZE as u64;
    while at < to {
        let len = (to - at).min(CHUNK as u64) as usize;
        // SAFETY: the mapping is CHUNK readable bytes, len <= CHUNK; page-aligned for O_DIRECT.
        let chunk = unsafe { std::slice::from_raw_parts(zeros.as_ptr(), len) };
        let n = rustix::io::pwrite(file, chunk, at).map_err(|e| {
            Error::os(e.into(), format!("writing zeros to device file {} at offset {at}", path.display()))
        })?;
        at += n as u64;
    }
    Ok(())
}

/// An io_uring of `entries` entries with `file` as fixed file 0 and `arena` as fixed buffers,
/// and whether they are: where RLIMIT_MEMLOCK is too small to pin the arena (each ring pins it
/// again; an unprivileged process usually has 8 MiB), requests use plain buffers, which the
/// kernel pins per request instead.
fn build_ring(file: &File, path: &Path, arena: &BufferArena, entries: u32, iopoll: bool) -> Result<(IoUring, bool)> {
    let shown = path.display();
    let mut builder = IoUring::builder();
    if iopoll {
        builder.setup_iopoll();
    }
    let ring = builder.build(entries).map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::EPERM) {
            " (is io_uring disabled by sysctl kernel.io_uring_disabled?)"
        } else {
            ""
        };
        Error::os(e, format!("creating an io_uring of {entries} entries for {shown}{hint}"))
    })?;
    let ring = lifted(ring);
    ring.submitter()
        .register_files(&[file.as_raw_fd()])
        .map_err(|e| Error::os(e, format!("registering {shown} as an io_uring fixed file")))?;
    let (base, len) = arena.as_raw_parts();
    let iovecs: Vec<libc::iovec> = (0..len)
        .step_by(FIXED_BUFFER_MAX_BYTES)
        .map(|start| libc::iovec {
            iov_base: base.as_ptr().wrapping_add(start).cast(),
            iov_len: (len - start).min(FIXED_BUFFER_MAX_BYTES),
        })
        .collect();
    // SAFETY: the iovecs cover the arena's mapping, which outlives the ring: a queue holds an Arc
    // of its arena and drops its ring first, and the probe drops its ring before its arena.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => Ok((ring, true)),
        // Over RLIMIT_MEMLOCK (the device's description says so).
        Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => Ok((ring, false)),
        Err(e) => Err(Error::os(e, format!("registering the {len}-byte buffer arena with io_uring for {shown}"))),
    }
}

/// `ring` on a descriptor above [`guarded_fd::FLOOR`] (see [`tiermem_sys::guarded_fd`]), or as
/// it was where no such descriptor can be had.
fn lifted(ring: IoUring) -> IoUring {
    if ring.as_raw_fd() >= guarded_fd::FLOOR {
        return ring;
    }
    // SAFETY: the ring's descriptor stays open while `ring` lives, past this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(ring.as_raw_fd()) };
    let Ok(high) = rustix::io::fcntl_dupfd_cloexec(fd, guarded_fd::FLOOR) else { return ring };
    let params = ring.params().clone();
    // SAFETY: `high` is an owned duplicate of the ring's descriptor, and `params` are what the
    // kernel filled in when it set the ring up. Dropping `ring` then unmaps its own view of the
    // queues and closes the original number; the ring lives on behind `high`.
    match unsafe { IoUring::from_fd(std::os::fd::IntoRawFd::into_raw_fd(high), params) } {
        Ok(moved) => moved,
        Err(_) => ring,
    }
}

/// The io_uring entry for `request` on a ring made by [`build_ring`], through its fixed buffers
/// if it has them (`fixed`).
fn entry_for(request: Request, arena: &BufferArena, fixed: bool) -> squeue::Entry {
    let addr = arena.ptr(request.buf());
    // Which GiB-sized fixed buffer holds it; 0 unless the arena is larger than 1 GiB.
    let buf_index = (arena.offset(request.buf()) / FIXED_BUFFER_MAX_BYTES) as u16;
    let offset = request.slot() * SLOT_BYTES;
    let len = request.pages() * PAGE_SIZE as u32;
    match (request, fixed) {
        (Request::Read { .. } | Request::ReadRun { .. }, true) => {
            opcode::ReadFixed::new(types::Fixed(0), addr, len, buf_index).offset(offset).build()
        }
        (Request::Write { .. } | Request::WriteRun { .. }, true) => {
            opcode::WriteFixed::new(types::Fixed(0), addr, len, buf_index).offset(offset).build()
        }
        (Request::Read { .. } | Request::ReadRun { .. }, false) => {
            opcode::Read::new(types::Fixed(0), addr, len).offset(offset).build()
        }
        (Request::Write { .. } | Request::WriteRun { .. }, false) => {
            opcode::Write::new(types::Fixed(0), addr, len).offset(offset).build()
        }
    }
}

/// `Some(reason)` when sysfs says block device `dev` has no poll queues, so IOPOLL cannot work.
///
/// Asked before the probe read, because that read proves nothing when slot 0 is unallocated or
/// unwritten (a fresh fallocated file): the file system then answers zeros without any device I/O,
/// while later reads of written slots fail with EOPNOTSUPP.
fn block_device_without_poll_queues(dev: u64) -> Option<String> {
    let (major, minor) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    // A partition has no queue of its own: it is its disk's, one directory up.
    for io_poll in [format!("{base}/queue/io_poll"), format!("{base}/../queue/io_poll")] {
        if let Ok(text) = std::fs::read_to_string(&io_poll) {
            return (text.trim() == "0")
                .then(|| format!("block device {major}:{minor} under it has no poll queues ({io_poll} is 0)"));
        }
    }
    // Not a plain block device (network or multi-device file systems): the probe read decides.
    None
}

/// Read slot 0 through an IOPOLL ring. `Err` says why polled queues cannot use IOPOLL.
fn probe_kernel_poll(file: &File, path: &Path) -> std::result::Result<(), String> {
    let arena = BufferArena::new(1).map_err(|e| e.to_string())?;
    let (mut ring, fixed) = build_ring(file, path, &arena, 1, true).map_err(|e| e.to_string())?;
    let read = entry_for(Request::Read { slot: 0, buf: 0 }, &arena, fixed);
    // SAFETY: the entry reads into the arena's one buffer, registered with this ring; `ring` is
    // declared after `arena`, so it is dropped before the arena. Dropping it does not wait for
    // the request (on the error paths below it may still be in flight), but the buffer's pages
    // stay pinned by the kernel until the request is done, so unmapping the arena frees
    // nothing the read still writes to.
    unsafe { ring.submission().push(&read) }.map_err(|_| "the probe ring's submission queue is full".to_string())?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => return Err(format!("io_uring_enter on an IOPOLL ring failed: {e}")),
        }
    }
    let result = ring.completion().next().map(|cqe| cqe.result());
    match result {
        Some(n) if n == PAGE_SIZE as i32 => Ok(()),
        Some(n) if n < 0 => Err(format!("an IOPOLL read failed: {}", io::Error::from_raw_os_error(-n))),
        Some(n) => Err(format!("an IOPOLL read moved {n} of {PAGE_SIZE} bytes")),
        None => Err("an IOPOLL read never completed".to_string()),
    }
}

impl Device for FileDevice {
    fn describe(&self) -> String {
        let polled = match &self.shared.polled_wait {
            PolledWait::KernelPoll => "polled queues use io_uring IOPOLL".to_string(),
            PolledWait::Spin { why_not_iopoll } => {
                format!("polled queues spin on the completion ring because {why_not_iopoll}")
            }
        };
        let buffers = if self.shared.plain_buffers.load(std::sync::atomic::Ordering::Relaxed) {
            "plain buffers (RLIMIT_MEMLOCK too small to register them)"
        } else {
            "fixed buffers"
        };
        format!(
            "file:{} (O_DIRECT, io_uring {buffers}, {} slots; {polled})",
            self.shared.path.display(),
            self.shared.slots
        )
    }

    fn capacity_slots(&self) -> u64 {
        self.shared.slots
    }

    fn backed_slots(&self) -> u64 {
        self.shared.backing.backed()
    }

    fn back_slots(&self, needed: u64, wanted: u64) -> io::Result<()> {
        self.shared.backing.back(&self.shared.file, needed, wanted)
    }

    fn open_queue(&self, kind: QueueKind, depth: u32, arena: &Arc<BufferArena>) -> Result<Box<dyn IoQueue>> {
        check_queue_depth(depth)?;
        let wait_mode = match (kind, &self.shared.polled_wait) {
            (QueueKind::Polled, PolledWait::KernelPoll) => WaitMode::KernelPoll,
            (QueueKind::Polled, PolledWait::Spin { .. }) => WaitMode::SpinOnCompletionRing,
            (QueueKind::Completion, _) => WaitMode::Interrupt,
        };
        let shared = &self.shared;
        let (ring, fixed) = build_ring(&shared.file, &shared.path, arena, depth, wait_mode == WaitMode::KernelPoll)?;
        let ring_guard = Guard::new(ring.as_raw_fd());
        if !fixed {
            shared.plain_buffers.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let ready_signal = match kind {
            QueueKind::Polled => None,
            QueueKind::Completion => {
                let fd = eventfd(0, EventfdFlags::CLOEXEC)
                    .map(Guarded::new)
                    .map_err(|e| Error::os(e.into(), "creating the completion eventfd of an io_uring queue"))?;
                ring.submitter()
                    .register_eventfd(fd.as_raw_fd())
                    .map_err(|e| Error::os(e, "registering the completion eventfd with io_uring"))?;
                Some(fd)
            }
        };
        Ok(Box::new(FileQueue {
            _ring_guard: ring_guard,
            ring,
            fixed,
            kind,
            wait_mode,
            ledger: Ledger {
                pending: (0..depth).map(|_| None).collect(),
                free_ids: (0..depth).rev().collect(),
                shared: shared.clone(),
            },
            ready_signal,
            arena: arena.clone(),
        }))
    }

    fn counters(&self) -> &DeviceCounters {
        &self.shared.counters
    }

    fn read_slot_blocking(&self, slot: u64, dst: &mut [u8]) -> Result<()> {
        check_blocking_read(slot, self.shared.slots, dst)?;
        let offset = slot * SLOT_BYTES;
        let n = rustix::io::pread(&self.shared.file, &mut *dst, offset).map_err(|e| {
            Error::os_kind(ErrorKind::Io, e.into(), format!("reading slot {slot} of {}", self.shared.path.display()))
        })?;
        if n != PAGE_SIZE {
            return Err(Error::new(
                ErrorKind::Io,
                format!("short read of slot {slot} of {}: {n} of {PAGE_SIZE} bytes", self.shared.path.display()),
            ));
        }
        Ok(())
    }
}

/// A queue of a [`FileDevice`]: one io_uring instance.
///
/// A completion queue's [`IoQueue::notify_fd`] is a blocking eventfd registered with the ring:
/// the kernel increments it for every completion it posts. A thread that sleeps on it (read(2)
/// or poll(2)) should read it, which resets it, and then call [`IoQueue::reap`]; wake-ups with
/// nothing left to reap happen when `wait` or an earlier `reap` already handed the completions out.
///
/// Dropping a queue first waits for its requests (including pushed, unsubmitted ones, which are
/// submitted), because the kernel would otherwise still be moving data into arena buffers that
/// their owners take back.
pub struct FileQueue {
    /// Declared before `ring`: unregistered before the ring's descriptor closes.
    _ring_guard: Guard,
    ring: IoUring,
    /// Requests go through the arena registered as fixed buffers (else plain buffers).
    fixed: bool,
    kind: QueueKind,
    wait_mode: WaitMode,
    ledger: Ledger,
    ready_signal: Option<Guarded<OwnedFd>>,
    /// Kept so the registered memory outlives the ring, which is dropped before it.
    arena: Arc<BufferArena>,
}

/// The requests of one queue, by io_uring `user_data`.
#[derive(Debug)]
struct Ledger {
    pending: Box<[Option<(Request, u64)>]>,
    free_ids: Vec<u32>,
    shared: Arc<OpenFile>,
}

impl Ledger {
    fn in_flight(&self) -> usize {
        self.pending.len() - self.free_ids.len()
    }

    /// Turn the completion entry of request `id` into a [`Completion`] and count it.
    fn finish(&mut self, id: u64, result: i32) -> Completion {
        let (request, tag) =
            self.pending[id as usize].take().expect("io_uring completed a request this queue did not submit");
        self.free_ids.push(id as u32);
        let shared = &self.shared;
        let bytes = u64::from(request.pages()) * SLOT_BYTES;
        let result = if i64::from(result) == bytes as i64 {
            if request.is_write() {
                shared.counters.record_write(bytes, bytes);
            } else {
                shared.counters.record_read(bytes, bytes);
            }
            Ok(())
        } else {
            shared.counters.record_error();
            let what = format!("{} of {}", request.describe(), shared.path.display());
            Err(if result < 0 {
                Error::os(io::Error::from_raw_os_error(-result), what)
            } else {
                Error::new(
                    ErrorKind::Io,
                    format!("{what}: only {result} of {bytes} bytes were transferred (was the file truncated?)"),
                )
            })
        };
        Completion { tag, result }
    }
}

impl fmt::Debug for FileQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileQueue")
            .field("path", &self.ledger.shared.path)
            .field("kind", &self.kind)
            .field("wait_mode", &self.wait_mode)
            .field("depth", &self.ledger.pending.len())
            .field("in_flight", &self.ledger.in_flight())
            .finish_non_exhaustive()
    }
}

impl FileQueue {
    /// Hand out what is on the completion ring, without entering the kernel.
    fn drain(&mut self, max: usize, on_done: &mut dyn FnMut(Completion)) -> usize {
        let mut handed = 0;
        // Entries not taken stay on the ring: the queue's head moves past the taken ones only.
        for cqe in self.ring.completion().take(max) {
            on_done(self.ledger.finish(cqe.user_data(), cqe.result()));
            handed += 1;
        }
        handed
    }

    /// Submit what is queued and sleep (or, on an IOPOLL ring, poll) until `want` completions are
    /// on the ring. An interrupted wait returns early; callers loop. A submission the kernel
    /// refuses (it takes request memory from the memory cgroup, refused while that is full)
    /// does not stop the wait for the requests it took before: those are waited for, and the
    /// refused entries stay on the ring for the next submission (a failed wait made a fault
    /// whose read was already in flight fail).
    fn enter_and_wait(&mut self, want: usize) -> Result<()> {
        let error = match self.ring.submit_and_wait(want) {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => return Ok(()),
            Err(e) => e,
        };
        let submitted = self.ledger.in_flight() - self.ring.submission().len();
        let refused = matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::ENOMEM | libc::EBUSY));
        if refused && submitted > 0 {
            // SAFETY: no argument pointer is passed; the flags ask only to wait for completions.
            let waited = unsafe {
                self.ring.submitter().enter::<libc::sigset_t>(0, want.min(submitted) as u32, ENTER_GETEVENTS, None)
            };
            match waited {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => return Ok(()),
                Err(_) => {}
            }
        }
        Err(Error::os(error, format!("waiting for io_uring completions on {}", self.ledger.shared.path.display())))
    }
}

impl IoQueue for FileQueue {
    fn kind(&self) -> QueueKind {
        self.kind
    }

    fn wait_mode(&self) -> WaitMode {
        self.wait_mode
    }

    fn push(&mut self, request: Request, tag: u64) -> Result<()> {
        check_request(&request, self.ledger.shared.slots, &self.arena)?;
        let Some(id) = self.ledger.free_ids.pop() else {
            return Err(Error::new(
                ErrorKind::NoSpace,
                format!(
                    "{}: the io_uring queue is full ({} requests in flight); submit and reap first",
                    request.describe(),
                    self.ledger.pending.len()
                ),
            ));
        };
        let entry = entry_for(request, &self.arena, self.fixed).user_data(u64::from(id));
        // SAFETY: the entry moves one page between the file and an arena buffer registered with
        // this ring. The arena outlives the ring (held here, dropped after it), and the caller
        // owns the buffer until the request's completion is handed out.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            // The ring has at least `depth` entries and at most `depth` requests are queued.
            self.ledger.free_ids.push(id);
            return Err(Error::new(ErrorKind::Internal, "io_uring submission queue full below the queue depth"));
        }
        self.ledger.pending[id as usize] = Some((request, tag));
        Ok(())
    }

    fn submit(&mut self) -> Result<usize> {
        let queued = self.ring.submission().len();
        if queued == 0 {
            return Ok(0);
        }
        loop {
            match self.ring.submit() {
                Ok(started) => return Ok(started),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    let shown = self.ledger.shared.path.display();
                    return Err(Error::os(e, format!("submitting {queued} requests to io_uring for {shown}")));
                }
            }
        }
    }

    fn reap(&mut self, max: usize, on_done: &mut dyn FnMut(Completion)) -> usize {
        if !self.ring.submission().is_empty() {
            // A submission the kernel refused (io_uring takes its request memory from the
            // memory cgroup, so it fails while the cgroup is full) left entries on the ring,
            // and the caller went on. Nothing else would submit them until the next request
            // comes, and a thread waiting for one of them would wait forever (seen: a fault
            // handler spinning for a prefetch whose entry was still on the ring).
            let _ = self.submit();
        }
        let submitted = self.ledger.in_flight() - self.ring.submission().len();
        if self.wait_mode == WaitMode::KernelPoll && submitted > 0 && self.ring.completion().is_empty() {
            // An IOPOLL ring posts completions only when someone polls: poll once, without
            // waiting and without submitting what is queued.
            // SAFETY: no argument pointer is passed; the flags ask only to poll for completions.
            let polled = unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 0, ENTER_GETEVENTS, None) };
            // A failed poll (EINTR, EAGAIN) leaves completions for the next reap or wait.
            let _ = polled;
        }
        self.drain(max, on_done)
    }

    /// Submits what is queued, then waits for `min` completions as the wait mode says. `min`
    /// beyond what is in flight is capped: those requests can never finish.
    ///
    /// A failure after completions were handed out returns those (Ok): the caller has them and
    /// must process them; it learns of the failure when it waits again.
    fn wait(&mut self, min: usize, on_done: &mut dyn FnMut(Completion)) -> Result<usize> {
        let target = min.min(self.in_flight());
        let mut handed = self.drain(usize::MAX, on_done);
        let spin = self.wait_mode == WaitMode::SpinOnCompletionRing;
        let failed = |handed: usize, e: Error| if handed > 0 { Ok(handed) } else { Err(e) };
        if spin || handed >= target {
            if let Err(e) = self.submit() {
                return failed(handed, e);
            }
        }
        while handed < target {
            if spin {
                if !self.ring.submission().is_empty() {
                    // A submission the kernel took only part of (it could not allocate a
                    // request: a full memory cgroup) left entries on the ring, and nothing
                    // else submits them while this thread spins for their completions.
                    let _ = self.submit();
                }
                // The completion is posted by task work that interrupts this thread; no syscall.
                std::hint::spin_loop();
            } else if let Err(e) = self.enter_and_wait(target - handed) {
                return failed(handed, e);
            }
            handed += self.drain(usize::MAX, on_done);
        }
        Ok(handed)
    }

    fn in_flight(&self) -> usize {
        self.ledger.in_flight()
    }

    fn notify_fd(&self) -> Option<BorrowedFd<'_>> {
        self.ready_signal.as_ref().map(|fd| fd.as_fd())
    }
}

impl Drop for FileQueue {
    fn drop(&mut self) {
        while self.ledger.in_flight() > 0 {
            if self.enter_and_wait(1).is_err() {
                // Submitting what is still queued was refused: the requests already submitted
                // must still finish before the ring and the buffers they use go (entries never
                // submitted the kernel never saw).
                let submitted = self.ledger.in_flight() - self.ring.submission().len();
                // SAFETY: no argument pointer is passed; the flags ask only to wait for
                // completions, submitting nothing.
                let waited = submitted > 0
                    && unsafe { self.ring.submitter().enter::<libc::sigset_t>(0, 1, ENTER_GETEVENTS, None) }.is_ok();
                if !waited {
                    // Nothing submitted is left, or the ring is broken; closing it still
                    // cancels or finishes its requests.
                    break;
                }
            }
            self.drain(usize::MAX, &mut |_| {});
        }
    }
}

#[cfg(test)]
mod tests;
