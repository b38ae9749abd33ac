//! Mean latency of single 4 KiB reads: each one pushed, submitted and waited for alone.
//!
//! `cargo run --release -p tiermem-device --example latency [DIR] [READS]` puts a 64 MiB device
//! file in DIR (default /tmp), writes every slot so reads reach the disk (never-written slots
//! are answered by the file system without I/O), then times READS (default 10000) reads of random
//! slots through a polled queue and a completion queue, and through the mem device.

use std::sync::Arc;
use std::time::Instant;

use tiermem_device::file::FileDevice;
use tiermem_device::mem::MemDevice;
use tiermem_device::{BufferArena, Device, QueueKind, Request, Result};

const SLOTS: u64 = 16 * 1024;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "/tmp".to_string());
    let reads: usize = args.next().map_or(10_000, |n| n.parse().expect("READS must be a number"));
    let scratch = tempfile::TempDir::new_in(&dir).expect("creating a scratch directory");
    let device = FileDevice::open(&scratch.path().join("device"), Some(SLOTS * 4096))?;
    println!("{}", device.describe());
    fill(&device)?;
    for kind in [QueueKind::Polled, QueueKind::Completion] {
        time_reads(&device, kind, reads)?;
    }
    let mem = MemDevice::new(SLOTS * 4096)?;
    fill(&mem)?;
    time_reads(&mem, QueueKind::Polled, reads)?;
    Ok(())
}

/// Write every slot, 64 at a time.
fn fill(device: &dyn Device) -> Result<()> {
    let arena = Arc::new(BufferArena::new(64)?);
    let mut queue = device.open_queue(QueueKind::Completion, 64, &arena)?;
    for batch in 0..SLOTS / 64 {
        for buf in 0..64u32 {
            let slot = batch * 64 + u64::from(buf);
            arena.bytes_mut(buf).fill(slot as u8);
            queue.push(Request::Write { slot, buf }, slot)?;
        }
        let mut done = 0;
        while done < 64 {
            done += queue.wait(64 - done, &mut |c| c.result.expect("write failed"))?;
        }
    }
    Ok(())
}

fn time_reads(device: &dyn Device, kind: QueueKind, reads: usize) -> Result<()> {
    let arena = Arc::new(BufferArena::new(1)?);
    let mut queue = device.open_queue(kind, 1, &arena)?;
    let mut micros = Vec::with_capacity(reads);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..reads {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let slot = seed % SLOTS;
        let start = Instant::now();
        queue.push(Request::Read { slot, buf: 0 }, slot)?;
        queue.submit()?;
        queue.wait(1, &mut |c| c.result.expect("read failed"))?;
        micros.push(start.elapsed().as_secs_f64() * 1e6);
        assert_eq!(arena.bytes(0)[0], slot as u8, "slot {slot} read back wrong data");
    }
    let mean = micros.iter().sum::<f64>() / micros.len() as f64;
    micros.sort_by(f64::total_cmp);
    let percentile = |p: f64| micros[((micros.len() - 1) as f64 * p) as usize];
    println!(
        "{:<5} {kind:?} queue ({:?}): {reads} reads, mean {mean:.1} µs, p50 {:.1} µs, p99 {:.1} µs",
        device.describe().split(' ').next().unwrap_or(""),
        queue.wait_mode(),
        percentile(0.5),
        percentile(0.99),
    );
    Ok(())
}
