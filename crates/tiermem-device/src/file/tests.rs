use super::*;
use crate::testing::{self, eventfd_is_readable, read_eventfd, wait_for, PageModel, RoundTrip};
use std::os::unix::fs::PermissionsExt;
use tempfile::TempDir;

/// A scratch directory on /tmp, which is a disk file system (ext4) with O_DIRECT here.
fn scratch() -> TempDir {
    TempDir::new_in("/tmp").unwrap()
}

fn device_of(dir: &TempDir, slots: u64) -> FileDevice {
    FileDevice::open(&dir.path().join("device"), Some(slots * SLOT_BYTES)).unwrap()
}

fn message_of(result: Result<FileDevice>) -> (ErrorKind, String) {
    let err = result.unwrap_err();
    (err.kind(), err.to_string())
}

#[test]
fn random_round_trips_through_both_queue_kinds_check_every_byte_and_the_counters() {
    let dir = scratch();
    let device = device_of(&dir, 1024);
    println!("{}", device.describe());
    let runs = [
        RoundTrip::new(QueueKind::Polled, 1, 400, 1, 0..1024),
        RoundTrip::new(QueueKind::Completion, 1, 400, 2, 0..1024),
        RoundTrip::new(QueueKind::Polled, 8, 2000, 3, 0..1024),
        RoundTrip::new(QueueKind::Completion, 5, 2000, 4, 0..1024),
        RoundTrip::new(QueueKind::Polled, 64, 2000, 5, 0..1024),
        RoundTrip::new(QueueKind::Completion, 128, 2000, 6, 0..1024),
    ];
    testing::round_trips_with_counters(&device, &runs);
}

#[test]
fn data_outlives_the_device_and_is_read_back_after_reopening() {
    let dir = scratch();
    let path = dir.path().join("device");
    let mut model = PageModel::new();
    {
        let device = FileDevice::open(&path, Some(256 * SLOT_BYTES)).unwrap();
        RoundTrip::new(QueueKind::Completion, 16, 1000, 7, 0..256).run(&device, &mut model);
    }
    let device = FileDevice::open(&path, None).unwrap();
    assert_eq!(device.capacity_slots(), 256);
    model.verify_all(&device, QueueKind::Polled);
}

#[test]
fn reap_hands_out_at_most_max() {
    let dir = scratch();
    testing::reap_hands_out_at_most_max(&device_of(&dir, 64));
}

#[test]
fn runs_move_consecutive_slots_in_one_request() {
    let dir = scratch();
    testing::runs_move_consecutive_slots_in_one_request(&device_of(&dir, 256));
}

#[test]
fn queues_on_several_threads_share_one_device() {
    let dir = scratch();
    testing::concurrent_round_trips(Arc::new(device_of(&dir, 3 * 256)));
}

#[test]
fn queue_limits_and_bad_requests_are_refused() {
    let dir = scratch();
    let device = device_of(&dir, 16);
    testing::check_queue_limits(&device, QueueKind::Polled);
    testing::check_queue_limits(&device, QueueKind::Completion);
}

#[test]
fn wait_modes_follow_the_probe_and_describe_names_them() {
    let dir = scratch();
    let device = device_of(&dir, 4);
    let arena = Arc::new(BufferArena::new(1).unwrap());
    let polled = device.open_queue(QueueKind::Polled, 2, &arena).unwrap();
    let completion = device.open_queue(QueueKind::Completion, 2, &arena).unwrap();
    assert_eq!(polled.wait_mode(), device.polled_wait_mode());
    assert!(polled.notify_fd().is_none());
    assert_eq!(completion.wait_mode(), WaitMode::Interrupt);
    assert!(completion.notify_fd().is_some());
    let description = device.describe();
    assert!(description.starts_with(&format!("file:{}", dir.path().join("device").display())), "{description}");
    match device.polled_wait_mode() {
        WaitMode::KernelPoll => assert!(description.contains("IOPOLL"), "{description}"),
        mode => {
            assert_eq!(mode, WaitMode::SpinOnCompletionRing);
            assert!(description.contains("spin on the completion ring because"), "{description}");
        }
    }
    println!("polled wait mode on /tmp: {:?}; {description}", device.polled_wait_mode());
}

#[test]
fn completion_queue_eventfd_becomes_readable_after_a_submit() {
    let dir = scratch();
    let device = device_of(&dir, 8);
    let arena = Arc::new(BufferArena::new(2).unwrap());
    let mut queue = device.open_queue(QueueKind::Completion, 4, &arena).unwrap();
    let fd = queue.notify_fd().unwrap().try_clone_to_owned().unwrap();
    assert!(!eventfd_is_readable(&fd));
    arena.bytes_mut(0).fill(0x42);
    queue.push(Request::Write { slot: 5, buf: 0 }, 1).unwrap();
    assert!(!eventfd_is_readable(&fd), "nothing was submitted yet");
    queue.submit().unwrap();
    // A blocking read sleeps until the kernel posts the completion.
    assert!(read_eventfd(&fd) >= 1);
    let done = wait_for(&mut *queue, 1);
    assert_eq!(done[0].tag, 1);
    done.into_iter().for_each(|c| c.result.unwrap());

    // A thread sleeping on the eventfd without the queue wakes, then reaps under the lock.
    let queue = std::sync::Mutex::new(queue);
    std::thread::scope(|s| {
        let sleeper = s.spawn(|| {
            read_eventfd(&fd);
            let mut tags = Vec::new();
            while tags.is_empty() {
                queue.lock().unwrap().reap(usize::MAX, &mut |c| {
                    c.result.unwrap();
                    tags.push(c.tag)
                });
            }
            tags
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        {
            let mut q = queue.lock().unwrap();
            q.push(Request::Read { slot: 5, buf: 1 }, 2).unwrap();
            q.submit().unwrap();
        }
        assert_eq!(sleeper.join().unwrap(), [2]);
    });
    assert!(arena.bytes(1).iter().all(|&b| b == 0x42));
}

#[test]
fn dropping_a_queue_waits_for_its_requests() {
    let dir = scratch();
    let device = device_of(&dir, 8);
    let arena = Arc::new(BufferArena::new(8).unwrap());
    for kind in [QueueKind::Polled, QueueKind::Completion] {
        let before = device.counters().snapshot().writes;
        let mut queue = device.open_queue(kind, 8, &arena).unwrap();
        for i in 0..8 {
            arena.bytes_mut(i).fill(i as u8 + 1);
            queue.push(Request::Write { slot: u64::from(i), buf: i }, 0).unwrap();
        }
        queue.submit().unwrap();
        drop(queue);
        assert_eq!(device.counters().snapshot().writes - before, 8);
    }
    let mut queue = device.open_queue(QueueKind::Polled, 8, &arena).unwrap();
    for i in 0..8 {
        queue.push(Request::Read { slot: u64::from(i), buf: 7 - i }, 0).unwrap();
    }
    wait_for(&mut *queue, 8).into_iter().for_each(|c| c.result.unwrap());
    for i in 0..8u32 {
        assert!(arena.bytes(7 - i).iter().all(|&b| b == i as u8 + 1));
    }
}

#[test]
fn reading_past_a_truncated_end_is_a_short_transfer_error() {
    let dir = scratch();
    let path = dir.path().join("device");
    let device = FileDevice::open(&path, Some(4 * SLOT_BYTES)).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(SLOT_BYTES).unwrap();
    let arena = Arc::new(BufferArena::new(1).unwrap());
    for kind in [QueueKind::Polled, QueueKind::Completion] {
        let mut queue = device.open_queue(kind, 1, &arena).unwrap();
        queue.push(Request::Read { slot: 2, buf: 0 }, 9).unwrap();
        let done = wait_for(&mut *queue, 1);
        assert_eq!(done[0].tag, 9);
        let err = done.into_iter().next().unwrap().result.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        let text = err.to_string();
        assert!(text.contains(&format!("reading slot 2 of {}", path.display())), "{text}");
        assert!(text.contains("only 0 of 4096 bytes"), "{text}");
    }
    let counters = device.counters().snapshot();
    assert_eq!((counters.errors, counters.reads), (2, 0));
}

#[test]
fn negative_results_become_os_errors_naming_slot_and_path() {
    let dir = scratch();
    let device = device_of(&dir, 8);
    let mut ledger = Ledger { pending: vec![None, None].into(), free_ids: vec![], shared: device.shared.clone() };
    ledger.pending[0] = Some((Request::Read { slot: 6, buf: 0 }, 60));
    ledger.pending[1] = Some((Request::Write { slot: 7, buf: 0 }, 70));
    let eio = ledger.finish(0, -libc::EIO);
    assert_eq!(eio.tag, 60);
    let err = eio.result.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io);
    assert_eq!(err.os_error().unwrap().raw_os_error(), Some(libc::EIO));
    assert!(err.to_string().starts_with(&format!("reading slot 6 of {}: ", device.path().display())), "{err}");
    let enospc = ledger.finish(1, -libc::ENOSPC).result.unwrap_err();
    assert_eq!(enospc.kind(), ErrorKind::NoSpace);
    assert!(enospc.to_string().contains("writing slot 7 of"), "{enospc}");
    assert_eq!(ledger.free_ids.len(), 2);
    assert_eq!(device.counters().snapshot().errors, 2);
}

#[test]
fn a_missing_file_without_a_size_is_not_found_and_says_how_to_fix_it() {
    let dir = scratch();
    let path = dir.path().join("absent");
    let (kind, text) = message_of(FileDevice::open(&path, None));
    assert_eq!(kind, ErrorKind::NotFound);
    assert!(text.contains(&format!("device file {} does not exist", path.display())), "{text}");
    assert!(text.contains("fallocate -l") && text.contains("give a size"), "{text}");
    assert!(!path.exists());
}

#[test]
fn a_missing_directory_is_named() {
    let dir = scratch();
    let missing = dir.path().join("no-such-dir");
    let path = missing.join("device");
    for size in [None, Some(SLOT_BYTES)] {
        let (kind, text) = message_of(FileDevice::open(&path, size));
        assert_eq!(kind, ErrorKind::NotFound);
        assert!(text.contains(&format!("its directory {} does not exist", missing.display())), "{text}");
    }
    let under_a_file = dir.path().join("plain");
    std::fs::write(&under_a_file, b"x").unwrap();
    let (kind, text) = message_of(FileDevice::open(&under_a_file.join("device"), Some(SLOT_BYTES)));
    assert_eq!(kind, ErrorKind::NotFound);
    assert!(text.contains("not a directory"), "{text}");
}

#[test]
fn a_size_is_a_non_zero_multiple_of_the_page_size() {
    let dir = scratch();
    let path = dir.path().join("device");
    for bad in [0, 1, 4095, 4097] {
        let (kind, text) = message_of(FileDevice::open(&path, Some(bad)));
        assert_eq!(kind, ErrorKind::InvalidInput);
        assert!(text.contains(&format!("{bad} bytes")) && text.contains("multiple of 4096"), "{text}");
    }
    assert!(!path.exists());
}

#[test]
fn a_size_creates_a_missing_file_and_extends_a_smaller_one() {
    let dir = scratch();
    let path = dir.path().join("device");
    let device = FileDevice::open(&path, Some(32 * SLOT_BYTES)).unwrap();
    assert_eq!(device.capacity_slots(), 32);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 32 * SLOT_BYTES);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    drop(device);

    // Existing bytes survive the extension.
    let smaller = dir.path().join("smaller");
    std::fs::write(&smaller, vec![0x77u8; 2 * PAGE_SIZE]).unwrap();
    let device = FileDevice::open(&smaller, Some(16 * SLOT_BYTES)).unwrap();
    assert_eq!(device.capacity_slots(), 16);
    assert_eq!(std::fs::metadata(&smaller).unwrap().len(), 16 * SLOT_BYTES);
    let arena = Arc::new(BufferArena::new(2).unwrap());
    let mut queue = device.open_queue(QueueKind::Polled, 2, &arena).unwrap();
    queue.push(Request::Read { slot: 1, buf: 0 }, 0).unwrap();
    queue.push(Request::Read { slot: 15, buf: 1 }, 1).unwrap();
    wait_for(&mut *queue, 2).into_iter().for_each(|c| c.result.unwrap());
    assert!(arena.bytes(0).iter().all(|&b| b == 0x77));
    assert!(arena.bytes(1).iter().all(|&b| b == 0));

    // A larger file keeps its size and all its slots; the last partial page is not a slot.
    let larger = dir.path().join("larger");
    std::fs::write(&larger, vec![0u8; 10 * PAGE_SIZE + 100]).unwrap();
    assert_eq!(FileDevice::open(&larger, Some(4 * SLOT_BYTES)).unwrap().capacity_slots(), 10);
    assert_eq!(FileDevice::open(&larger, None).unwrap().capacity_slots(), 10);
}

#[test]
fn a_file_smaller_than_one_slot_is_too_small() {
    let dir = scratch();
    let path = dir.path().join("tiny");
    std::fs::write(&path, [0u8; 100]).unwrap();
    let (kind, text) = message_of(FileDevice::open(&path, None));
    assert_eq!(kind, ErrorKind::TooSmall);
    assert!(text.contains("is 100 bytes") && text.contains("4096-byte slot"), "{text}");
    // A file that existed is never removed on failure.
    assert!(path.exists());
}

#[test]
fn a_directory_is_refused() {
    let dir = scratch();
    let (kind, text) = message_of(FileDevice::open(dir.path(), None));
    assert_eq!(kind, ErrorKind::InvalidInput);
    assert!(text.contains("is a directory"), "{text}");
}

/// Clears the immutable flag of a file on drop, so the scratch directory can be removed even if
/// the test fails.
struct ImmutableFile(File);

impl Drop for ImmutableFile {
    fn drop(&mut self) {
        let _ = rustix::fs::ioctl_setflags(&self.0, rustix::fs::IFlags::empty());
    }
}

#[test]
fn no_permission_is_a_permission_error() {
    let dir = scratch();
    let path = dir.path().join("locked");
    std::fs::write(&path, vec![0u8; PAGE_SIZE]).unwrap();
    let _guard;
    if rustix::process::geteuid().is_root() {
        // Root ignores file modes, but not the immutable attribute.
        let file = File::open(&path).unwrap();
        if let Err(e) = rustix::fs::ioctl_setflags(&file, rustix::fs::IFlags::IMMUTABLE) {
            println!("SKIPPED: running as root and cannot set the immutable attribute on /tmp: {e}");
            return;
        }
        _guard = ImmutableFile(file);
    } else {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
    }
    let (kind, text) = message_of(FileDevice::open(&path, None));
    assert_eq!(kind, ErrorKind::Permission);
    assert!(text.contains(&format!("no permission to open device file {}", path.display())), "{text}");
}

/// `Some(reason)` when /dev/shm is not a tmpfs this test can use.
fn dev_shm_unusable() -> Option<String> {
    match rustix::fs::statfs("/dev/shm") {
        Ok(fs) if fs.f_type == libc::TMPFS_MAGIC => None,
        Ok(fs) => Some(format!("/dev/shm is not tmpfs (f_type {:#x})", fs.f_type)),
        Err(e) => Some(format!("/dev/shm: {e}")),
    }
}

#[test]
fn tmpfs_without_o_direct_is_unsupported() {
    // The message, whatever this kernel's tmpfs does.
    let path = Path::new("/dev/shm/tiermem-device");
    let err = open_error(io::Error::from_raw_os_error(libc::EINVAL), path);
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(
        err.to_string().starts_with(
            "file system of /dev/shm/tiermem-device does not support O_DIRECT (tmpfs?); put the device file on a \
             disk file system or use --device mem"
        ),
        "{err}"
    );

    if let Some(reason) = dev_shm_unusable() {
        println!("SKIPPED: {reason}");
        return;
    }
    let dir = TempDir::new_in("/dev/shm").unwrap();
    let path = dir.path().join("device");
    match FileDevice::open(&path, Some(4 * SLOT_BYTES)) {
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
            assert!(err.to_string().contains("does not support O_DIRECT (tmpfs?)"), "{err}");
            assert!(!path.exists(), "a file created only to fail must be removed");
        }
        Ok(device) => {
            // tmpfs takes O_DIRECT since Linux 6.6; then it must simply work.
            println!("SKIPPED: tmpfs on this kernel accepts O_DIRECT, so it is a working device here");
            let mut model = PageModel::new();
            RoundTrip::new(QueueKind::Completion, 4, 200, 8, 0..4).run(&device, &mut model);
            model.verify_all(&device, QueueKind::Polled);
        }
    }
}

#[test]
fn no_space_to_extend_is_no_space_with_both_sizes() {
    // tmpfs refuses an fallocate larger than the whole file system at once, without filling it
    // first; a disk file system would fill up (and this disk is shared), so only tmpfs is used.
    if let Some(reason) = dev_shm_unusable() {
        println!("SKIPPED: {reason}");
        return;
    }
    let dir = TempDir::new_in("/dev/shm").unwrap();
    let fs = rustix::fs::statvfs("/dev/shm").unwrap();
    let too_big = (fs.f_blocks * fs.f_frsize + (1 << 30)).next_multiple_of(SLOT_BYTES);
    for existing in [false, true] {
        let path = dir.path().join("device");
        if existing {
            std::fs::write(&path, vec![0u8; PAGE_SIZE]).unwrap();
        }
        match FileDevice::open(&path, Some(too_big)) {
            Err(err) if err.kind() == ErrorKind::Unsupported => {
                println!("SKIPPED: tmpfs here does not take O_DIRECT: {err}");
                return;
            }
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::NoSpace, "{err}");
                let from = if existing { SLOT_BYTES } else { 0 };
                let text = err.to_string();
                assert!(text.contains(&format!("no space to extend device file {}", path.display())), "{text}");
                assert!(text.contains(&format!("from {from} to {too_big} bytes")), "{text}");
                assert_eq!(path.exists(), existing, "only a file this call created is removed");
            }
            Ok(_) => panic!("a {too_big}-byte device fitted on a smaller tmpfs"),
        }
    }
}

#[test]
fn reap_submits_what_a_refused_submission_left_on_the_ring() {
    // A submission the kernel refuses (io_uring charges its requests to the memory cgroup,
    // which may be full) leaves the entries on the ring. The next reap must submit them, or a
    // thread waiting for one of them waits forever. Pushed and never submitted is the same state.
    let dir = scratch();
    let device = device_of(&dir, 64);
    let arena = Arc::new(BufferArena::new(8).unwrap());
    let mut queue = device.open_queue(QueueKind::Completion, 8, &arena).unwrap();
    for buf in 0..8 {
        queue.push(Request::Read { slot: u64::from(buf), buf }, u64::from(buf)).unwrap();
    }
    let mut tags = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while tags.len() < 8 {
        assert!(
            std::time::Instant::now() < deadline,
            "reap did not submit the queued requests: {} of 8 came back in 10 s",
            tags.len()
        );
        queue.reap(usize::MAX, &mut |c| {
            c.result.unwrap();
            tags.push(c.tag)
        });
    }
    tags.sort();
    assert_eq!(tags, (0..8).collect::<Vec<_>>());
    assert_eq!(queue.submit().unwrap(), 0, "nothing was left on the ring");
}

#[test]
fn kernel_poll_queues_poll_in_reap_and_wait() {
    // No device here may have poll queues, but an IOPOLL read of never-written slots completes
    // without device I/O, which is enough to drive the KernelPoll code paths. FileDevice writes
    // every slot of a file it creates or extends, so make an fallocated (unwritten) file here and
    // open it as it is.
    let dir = scratch();
    let path = dir.path().join("device");
    let file = std::fs::File::create(&path).unwrap();
    rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, 64 * SLOT_BYTES).unwrap();
    drop(file);
    let mut device = FileDevice::open(&path, None).unwrap();
    let natural = device.polled_wait_mode();
    Arc::get_mut(&mut device.shared).unwrap().polled_wait = PolledWait::KernelPoll;
    let arena = Arc::new(BufferArena::new(16).unwrap());
    let mut queue = device.open_queue(QueueKind::Polled, 16, &arena).unwrap();
    assert_eq!(queue.wait_mode(), WaitMode::KernelPoll);
    for buf in 0..16 {
        arena.bytes_mut(buf).fill(0xEE);
        queue.push(Request::Read { slot: u64::from(buf) * 4, buf }, u64::from(buf)).unwrap();
    }
    let mut tags = Vec::new();
    // Reap alone must make progress: it submits what is queued and polls once when the ring
    // is empty.
    while tags.is_empty() {
        queue.reap(usize::MAX, &mut |c| {
            c.result.unwrap();
            tags.push(c.tag)
        });
    }
    let rest = 16 - tags.len();
    let waited = queue.wait(rest, &mut |c| {
        c.result.unwrap();
        tags.push(c.tag)
    });
    assert_eq!(waited.unwrap(), rest);
    tags.sort();
    assert_eq!(tags, (0..16).collect::<Vec<_>>());
    assert!((0..16).all(|buf| arena.bytes(buf).iter().all(|&b| b == 0)));

    if natural == WaitMode::SpinOnCompletionRing {
        // Without poll queues, a read that must reach the device is refused by an IOPOLL ring (on
        // 6.18; a kernel that falls back to interrupts may serve it): a real negative result.
        let mut writer = device.open_queue(QueueKind::Completion, 1, &arena).unwrap();
        arena.bytes_mut(0).fill(0x3C);
        writer.push(Request::Write { slot: 3, buf: 0 }, 0).unwrap();
        wait_for(&mut *writer, 1).into_iter().for_each(|c| c.result.unwrap());
        arena.bytes_mut(0).fill(0);
        queue.push(Request::Read { slot: 3, buf: 0 }, 99).unwrap();
        let done = wait_for(&mut *queue, 1).into_iter().next().unwrap();
        assert_eq!(done.tag, 99);
        match done.result {
            Ok(()) => {
                println!("an IOPOLL read without poll queues succeeded here");
                assert!(arena.bytes(0).iter().all(|&b| b == 0x3C));
            }
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
                assert!(
                    err.to_string().starts_with(&format!("reading slot 3 of {}", device.path().display())),
                    "{err}"
                );
                assert_eq!(device.counters().snapshot().errors, 1);
                println!("an IOPOLL read without poll queues failed as expected: {err}");
            }
        }
    }
}

#[test]
fn a_file_holding_someone_elses_data_is_refused_and_tiermems_own_is_not() {
    let dir = scratch();
    // Missing, empty, sparse and fallocated files hold nothing to lose.
    assert!(refuse_foreign_data(&dir.path().join("missing")).is_ok());
    let sparse = dir.path().join("sparse");
    std::fs::File::create(&sparse).unwrap().set_len(1 << 20).unwrap();
    assert!(refuse_foreign_data(&sparse).is_ok());
    // Someone's notes: refused, and the message says why.
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"meeting at 10\n".repeat(400)).unwrap();
    let err = refuse_foreign_data(&notes).unwrap_err();
    let (kind, text) = (err.kind(), err.to_string());
    assert_eq!(kind, ErrorKind::InvalidInput);
    assert!(text.contains("notes.txt") && text.contains("not marked as a device file"), "{text}");
    // A device file tiermem created and wrote is its own: reusable. (Where the file system
    // keeps no user attributes the mark is missing and the file is refused: skip that part.)
    let own = dir.path().join("device");
    {
        let device = FileDevice::open(&own, Some(64 * SLOT_BYTES)).unwrap();
        RoundTrip::new(QueueKind::Completion, 8, 64, 3, 0..64).run(&device, &mut PageModel::new());
    }
    let mut mark = [0u8; 16];
    let file = std::fs::File::open(&own).unwrap();
    if rustix::fs::fgetxattr(&file, OWNER_XATTR, &mut mark).is_err() {
        eprintln!("SKIPPED the reuse part: this file system keeps no user extended attributes");
        return;
    }
    assert!(refuse_foreign_data(&own).is_ok());
    // A file the user made for tiermem (empty, as `fallocate` leaves it) is marked on its first
    // use, so it stays usable once it holds pages.
    let made = dir.path().join("made-by-the-user");
    std::fs::File::create(&made).unwrap().set_len(64 * SLOT_BYTES).unwrap();
    assert!(refuse_foreign_data(&made).is_ok());
    {
        let device = FileDevice::open(&made, None).unwrap();
        RoundTrip::new(QueueKind::Completion, 8, 64, 4, 0..64).run(&device, &mut PageModel::new());
    }
    assert!(refuse_foreign_data(&made).is_ok());
}

#[test]
fn character_devices_pipes_and_sockets_are_not_devices() {
    for path in ["/dev/null", "/dev/zero"] {
        let (kind, text) = message_of(FileDevice::open(Path::new(path), Some(16 * SLOT_BYTES)));
        assert_eq!(kind, ErrorKind::InvalidInput, "{path}: {text}");
        assert!(text.contains("neither a regular file nor a block device"), "{path}: {text}");
    }
}

#[test]
fn block_device_signatures_are_recognised() {
    let mut head = vec![0u8; 72 << 10];
    assert_eq!(signature(&head), None, "zeros are free space");
    head[1080..1082].copy_from_slice(&[0x53, 0xEF]);
    assert_eq!(signature(&head), Some("an ext2/3/4 file system"));
    let mut swap = vec![0u8; 8192];
    swap[4086..4096].copy_from_slice(b"SWAPSPACE2");
    assert_eq!(signature(&swap), Some("a swap area"));
    let mut mbr = vec![0u8; 4096];
    mbr[510..512].copy_from_slice(&[0x55, 0xAA]);
    assert!(signature(&mbr).is_some_and(|s| s.contains("boot sector")));
    // A short read (a tiny device) is not an error.
    assert_eq!(signature(&[0u8; 100]), None);
}

/// A file the device creates is only allocated (no seconds of zeros for a large default size);
/// an existing one it extends gets its new blocks written, as a swap file's are.
#[test]
fn a_created_file_is_allocated_and_an_extended_one_written() {
    let dir = scratch();
    let has_data = |path: &Path| {
        let file = std::fs::File::open(path).unwrap();
        rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(0)).is_ok()
    };
    let created = dir.path().join("created");
    drop(FileDevice::open(&created, Some(256 * SLOT_BYTES)).unwrap());
    assert_eq!(std::fs::metadata(&created).unwrap().len(), 256 * SLOT_BYTES);
    assert!(!has_data(&created), "the created file was written");
    let existing = dir.path().join("existing");
    std::fs::File::create(&existing).unwrap();
    drop(FileDevice::open(&existing, Some(256 * SLOT_BYTES)).unwrap());
    assert!(has_data(&existing), "the extended file was not written");
}

/// An existing file whose size is not a multiple of a page (made with `truncate -s 10000`,
/// holding nothing) is extended with zeros from the page it ends in: O_DIRECT writes at page
/// offsets only, and the first write at byte 10,000 failed with EINVAL.
#[test]
fn an_existing_file_ending_mid_page_is_extended() {
    let dir = scratch();
    let path = dir.path().join("device");
    std::fs::File::create(&path).unwrap().set_len(10_000).unwrap();
    let device = FileDevice::open(&path, Some(16 * SLOT_BYTES)).unwrap();
    assert_eq!(device.capacity_slots(), 16);
    let mut model = PageModel::new();
    RoundTrip::new(QueueKind::Completion, 8, 100, 11, 0..16).run(&device, &mut model);
    model.verify_all(&device, QueueKind::Completion);
}

/// Bytes of blocks `path` holds (allocated or set aside), from st_blocks.
const MIN_STEP_BYTES: u64 = crate::backing::MIN_STEP_SLOTS * SLOT_BYTES;

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// A created file is sized at once but holds only a first step of blocks; more are set aside
/// in steps as slots are asked for, never past the capacity.
#[test]
fn a_created_file_sets_its_blocks_aside_in_steps_as_slots_are_asked_for() {
    let dir = scratch();
    let path = dir.path().join("device");
    let slots = 256 * 1024; // 1 GiB
    let device = FileDevice::open(&path, Some(slots * SLOT_BYTES)).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), slots * SLOT_BYTES);
    let step = crate::backing::MIN_STEP_SLOTS;
    assert_eq!(device.backed_slots(), step, "the first step at open");
    assert!(allocated_bytes(&path) <= step * SLOT_BYTES + (1 << 20), "{} bytes held", allocated_bytes(&path));

    device.back_slots(step + 1, step + 1).unwrap();
    assert_eq!(device.backed_slots(), 2 * step, "a whole step more for one slot more");
    assert!(allocated_bytes(&path) >= 2 * step * SLOT_BYTES, "{} bytes held", allocated_bytes(&path));
    device.back_slots(10, 10).unwrap();
    assert_eq!(device.backed_slots(), 2 * step, "nothing more for slots already backed");
    // Later steps are a quarter of what is held.
    device.back_slots(40 * step, 40 * step).unwrap();
    device.back_slots(40 * step + 1, 40 * step + 1).unwrap();
    assert_eq!(device.backed_slots(), 50 * step);
    let past = device.back_slots(slots + 1, slots + 1).unwrap_err();
    assert_eq!(past.raw_os_error(), Some(libc::EINVAL), "{past}");
    device.back_slots(slots, slots).unwrap();
    assert_eq!(device.backed_slots(), slots);

    let mut model = PageModel::new();
    RoundTrip::new(QueueKind::Completion, 8, 100, 12, slots - 64..slots).run(&device, &mut model);
    model.verify_all(&device, QueueKind::Completion);
}

/// On a file system that fills up, slots past what it holds are refused with ENOSPC (the
/// engine then keeps their pages in memory), asking again at once is refused without asking
/// the file system, and the slots it did set aside work.
#[test]
fn a_full_file_system_refuses_slots_past_what_it_holds() {
    let name = "a_full_file_system_refuses_slots_past_what_it_holds";
    let dir = scratch();
    let Some(_unmount) = mount_or_skip(name, &["-t", "tmpfs", "-o", "size=8m", "tiermem-device-test"], dir.path())
    else {
        return;
    };
    // Sized beyond the file system (as `truncate -s` makes it): opened as it is.
    let path = dir.path().join("device");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    let device = match FileDevice::open(&path, None) {
        Err(e) if e.kind() == ErrorKind::Unsupported => {
            println!("SKIPPED {name}: tmpfs here takes no O_DIRECT: {e}");
            return;
        }
        opened => opened.unwrap(),
    };
    assert_eq!(device.capacity_slots(), 16 * 1024);
    // The first step (16 MiB) did not fit; a short one (1 MiB) for the slot asked for at open
    // did, and what the failed step took was given back.
    assert_eq!(device.backed_slots(), 256);
    assert!(allocated_bytes(&path) <= 1 << 20, "{} bytes held", allocated_bytes(&path));
    // Short steps while the file system is short of room.
    device.back_slots(1000, 1000).unwrap();
    assert_eq!(device.backed_slots(), 1024, "4 MiB fit where a step did not");
    assert!(allocated_bytes(&path) <= 4 << 20, "{} bytes held", allocated_bytes(&path));
    let refused = device.back_slots(4096, 4096).unwrap_err();
    assert_eq!(refused.raw_os_error(), Some(libc::ENOSPC), "{refused}");
    assert_eq!(device.backed_slots(), 1024);
    let again = device.back_slots(1100, 1100).unwrap_err();
    assert_eq!(again.raw_os_error(), Some(libc::ENOSPC), "asked again at once: {again}");
    // Room wanted ahead of need is no error while the need is set aside.
    device.back_slots(1024, 4096).unwrap();
    assert_eq!(device.backed_slots(), 1024);

    let mut model = PageModel::new();
    RoundTrip::new(QueueKind::Completion, 8, 200, 13, 0..1024).run(&device, &mut model);
    model.verify_all(&device, QueueKind::Completion);
    // A second later the file system is asked again: a whole step does not fit, a short one
    // does.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    device.back_slots(1100, 1100).unwrap();
    assert_eq!(device.backed_slots(), 1280);
    assert!(allocated_bytes(&path) <= 5 << 20, "{} bytes held", allocated_bytes(&path));
    // Wanting far more than fits does not make the file system look full for what does fit.
    device.back_slots(1280, 1280 + 8192).unwrap();
    device.back_slots(1300, 1300).unwrap();
    assert_eq!(device.backed_slots(), 1536);
    assert!(allocated_bytes(&path) <= 6 << 20, "{} bytes held", allocated_bytes(&path));
}

/// Mount (`mount ARGS mount_point`) for the life of the value, or say SKIPPED and `None`.
fn mount_or_skip<'a>(test: &str, args: &[&str], mount_point: &'a Path) -> Option<Unmount<'a>> {
    if !rustix::process::geteuid().is_root() {
        println!("SKIPPED {test}: mounting a small file system needs root");
        return None;
    }
    let mounted = std::process::Command::new("mount").args(args).arg(mount_point).status().is_ok_and(|s| s.success());
    if !mounted {
        println!("SKIPPED {test}: cannot mount {args:?} here");
        return None;
    }
    Some(Unmount(mount_point))
}

/// Unmounts however the test ends.
struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        if !std::process::Command::new("umount").arg(self.0).status().is_ok_and(|s| s.success()) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
}

/// ext4 keeps what a refused fallocate got: on a nearly full file system a step that does not
/// fit took all the free space, and only then failed. The device gives that back and keeps a
/// short step, leaving the rest to other processes.
#[test]
fn a_step_that_does_not_fit_gives_back_what_it_took() {
    let name = "a_step_that_does_not_fit_gives_back_what_it_took";
    let dir = scratch();
    let image = dir.path().join("ext4.img");
    std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !made {
        println!("SKIPPED {name}: cannot make an ext4 image here (mkfs.ext4)");
        return;
    }
    let mount_point = dir.path().join("mnt");
    std::fs::create_dir(&mount_point).unwrap();
    let Some(_unmount) = mount_or_skip(name, &["-o", "loop", image.to_str().unwrap()], &mount_point) else { return };
    let free = || {
        let fs = rustix::fs::statvfs(&mount_point).unwrap();
        fs.f_bavail * fs.f_frsize
    };
    // Leave about 10 MiB free: less than a step (16 MiB).
    let filler = std::fs::File::create(mount_point.join("filler")).unwrap();
    rustix::fs::fallocate(&filler, rustix::fs::FallocateFlags::empty(), 0, free() - (10 << 20)).unwrap();
    let before = free();
    assert!(before < MIN_STEP_BYTES, "{before} bytes free");
    let path = mount_point.join("device");
    std::fs::File::create(&path).unwrap().set_len(256 << 20).unwrap();
    let device = FileDevice::open(&path, None).unwrap();
    assert_eq!(device.backed_slots(), 256, "a short step (1 MiB) where a whole one did not fit");
    // (An extent block besides.)
    assert!(allocated_bytes(&path) <= (1 << 20) + (64 << 10), "{} bytes held by the device", allocated_bytes(&path));
    assert!(free() + (2 << 20) >= before, "{} of {before} bytes still free", free());
}
