//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use tiermem_device::{Device, MemDevice};
use tiermem_engine::{Engine, EngineConfig};
use tiermem_sys::probe::KernelFeatures;

/// Engines in one process share the SIGBUS handler and the machine has two cores: run one at a
/// time.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// `None` (after printing SKIPPED) when userfaultfd cannot be used here.
pub fn features_or_skip(test: &str) -> Option<KernelFeatures> {
    let f = KernelFeatures::probe();
    if !f.userfaultfd {
        eprintln!("SKIPPED {test}: userfaultfd unavailable: {}", f.error.clone().unwrap_or_default());
        return None;
    }
    if !f.wp {
        eprintln!("SKIPPED {test}: userfaultfd write-protect unsupported by kernel {}", f.kernel);
        return None;
    }
    Some(f)
}

/// The devices to run each test on.
pub fn devices(capacity: u64) -> Vec<(&'static str, Arc<dyn Device>)> {
    let mut v: Vec<(&'static str, Arc<dyn Device>)> = vec![("mem", Arc::new(MemDevice::new(capacity).unwrap()))];
    if let Some(file) = file_device(capacity) {
        v.push(("file", file));
    }
    v
}

/// A file device on the system temp dir, if this build has one.
pub fn file_device(capacity: u64) -> Option<Arc<dyn Device>> {
    let dir = std::env::temp_dir().join(format!("tiermem-test-{}-{}", std::process::id(), rand_u64()));
    std::fs::create_dir_all(&dir).ok()?;
    let path = dir.join("device");
    let spec = tiermem_device::DeviceSpec::File(path);
    let dev = spec.open(capacity);
    // The file stays open through the device; the directory entry can go now.
    let _ = std::fs::remove_dir_all(&dir);
    match dev {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED file device: {e}");
            None
        }
    }
}

fn rand_u64() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
}

/// Start an engine with a limit of `limit_pages`.
pub fn engine(device: Arc<dyn Device>, limit_pages: u64, tweak: impl FnOnce(&mut EngineConfig)) -> Engine {
    let mut config = EngineConfig { limit_bytes: limit_pages * 4096, io_buffers: 256, ..EngineConfig::default() };
    tweak(&mut config);
    Engine::new(config, device).expect("engine starts")
}

/// Resident memory of this process, from /proc/self/statm.
pub fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    statm.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

/// xorshift64*: deterministic, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The word a page holds at `word` for `version` (0 = never written, reads as zero).
pub fn pattern(page: usize, version: u64, word: usize) -> u64 {
    if version == 0 {
        return 0;
    }
    (page as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version.rotate_left(32) ^ word as u64
}

/// The records of a binary trace file (docs/trace-format.md), after checking its magic.
pub fn trace_records(path: &std::path::Path) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert_eq!(&bytes[..8], tiermem_monitor::trace_format::MAGIC, "{}", path.display());
    let header = tiermem_monitor::trace_format::HEADER_LEN;
    bytes[header..].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}
