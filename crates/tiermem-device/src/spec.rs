//! Parsing `--device` values.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use crate::file::FileDevice;
use crate::mem::MemDevice;
use crate::{Device, Error, Result};

/// A device named on the command line: `mem` or `file:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// DRAM (the ideal).
    Mem,
    /// A file or block device, or a directory to hold a private temporary device file.
    File(PathBuf),
}

impl DeviceSpec {
    /// Parse `mem` or `file:PATH` (PATH non-empty).
    pub fn parse(text: &str) -> Result<Self> {
        if text == "mem" {
            return Ok(Self::Mem);
        }
        match text.strip_prefix("file:") {
            Some("") => Err(Error::invalid("device `file:` needs a path: file:PATH (a file, a block device, or a directory for a temporary file)")),
            Some(path) => Ok(Self::File(PathBuf::from(path))),
            None => Err(Error::invalid(format!(
                "unknown device `{text}`; accepted forms: `mem` (DRAM) or `file:PATH` (a file, a block device, or a directory for a temporary file)"
            ))),
        }
    }

    /// [`DeviceSpec::open`], with less room where the file system has not enough: while making a
    /// file of `capacity_bytes` fails for want of space, one of half the size is tried (in whole
    /// pages), down to `floor_bytes`. Several processes sizing their files from the free space
    /// at the same moment can each count the same space: the last ones used to fail. Returns the
    /// device and the room it got.
    pub fn open_within_free_space(&self, capacity_bytes: u64, floor_bytes: u64) -> Result<(Arc<dyn Device>, u64)> {
        shrink_to_fit(capacity_bytes, floor_bytes, |bytes| self.open(bytes))
    }

    /// Open the device with room for `capacity_bytes` (a non-zero multiple of 4096). A missing
    /// file is created and a smaller one extended; see [`FileDevice::open`]. A directory gets a
    /// private unnamed device file inside it; see [`FileDevice::create_temporary`].
    pub fn open(&self, capacity_bytes: u64) -> Result<Arc<dyn Device>> {
        Ok(match self {
            Self::Mem => Arc::new(MemDevice::new(capacity_bytes)?),
            Self::File(path) if path.is_dir() => Arc::new(FileDevice::create_temporary(path, capacity_bytes)?),
            Self::File(path) => Arc::new(FileDevice::open(path, Some(capacity_bytes))?),
        })
    }
}

/// `open(capacity)`, halved (in whole pages) while it fails with [`crate::ErrorKind::NoSpace`]
/// and stays at least `floor`; the last error otherwise.
fn shrink_to_fit<T>(capacity: u64, floor: u64, mut open: impl FnMut(u64) -> Result<T>) -> Result<(T, u64)> {
    let mut bytes = capacity;
    loop {
        match open(bytes) {
            Ok(made) => return Ok((made, bytes)),
            Err(e) if e.kind() == crate::ErrorKind::NoSpace && bytes / 2 / 4096 * 4096 >= floor.max(4096) => {
                bytes = bytes / 2 / 4096 * 4096;
            }
            Err(e) => return Err(e),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        Self::parse(text)
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Mem => f.write_str("mem"),
            Self::File(path) => write!(f, "file:{}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn accepted_forms_parse_and_print_back_the_same() {
        for text in ["mem", "file:/dev/nvme0n1", "file:relative/dev", "file:/tmp/with space", "file:file:x"] {
            let spec: DeviceSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
            assert_eq!(DeviceSpec::parse(&spec.to_string()).unwrap(), spec);
        }
        assert_eq!(DeviceSpec::parse("mem").unwrap(), DeviceSpec::Mem);
        assert_eq!(DeviceSpec::parse("file:/x").unwrap(), DeviceSpec::File(PathBuf::from("/x")));
    }

    #[test]
    fn anything_else_is_invalid_and_lists_the_accepted_forms() {
        for text in ["", "MEM", "mem:", " mem", "file", "/tmp/x", "nvm", "memcached://host"] {
            let err = DeviceSpec::parse(text).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput);
            let message = err.to_string();
            assert!(message.contains(&format!("`{text}`")), "{message}");
            assert!(message.contains("`mem`") && message.contains("`file:PATH`"), "{message}");
        }
        let err = DeviceSpec::parse("file:").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert!(err.to_string().contains("needs a path"), "{err}");
    }

    #[test]
    fn no_space_halves_the_room_down_to_the_floor_and_other_errors_stop_at_once() {
        fn fits_below(limit: u64, tried: &mut Vec<u64>) -> impl FnMut(u64) -> Result<u64> + '_ {
            move |bytes| {
                tried.push(bytes);
                if bytes <= limit {
                    Ok(bytes)
                } else {
                    Err(Error::new(ErrorKind::NoSpace, "no space"))
                }
            }
        }
        let mut tried = Vec::new();
        let (made, room) = shrink_to_fit(1 << 30, 64 << 20, fits_below(300 << 20, &mut tried)).unwrap();
        assert_eq!((made, room), (256 << 20, 256 << 20));
        assert_eq!(tried, [1 << 30, 512 << 20, 256 << 20]);
        // Never below the floor: the last error stands.
        tried.clear();
        let err = shrink_to_fit(1 << 30, 300 << 20, fits_below(200 << 20, &mut tried)).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        assert_eq!(tried, [1 << 30, 512 << 20]);
        // Whole pages: an odd size halves to a multiple of 4096.
        tried.clear();
        let (_, room) = shrink_to_fit(3 * 4096 * 1000 + 4096, 4096, fits_below(1 << 20, &mut tried)).unwrap();
        assert!(room % 4096 == 0 && room <= 1 << 20 && room > 1 << 19, "{room}");
        // Another error is not retried.
        let mut calls = 0;
        let err = shrink_to_fit(1 << 30, 4096, |_| -> Result<()> {
            calls += 1;
            Err(Error::new(ErrorKind::Permission, "denied"))
        })
        .unwrap_err();
        assert_eq!((err.kind(), calls), (ErrorKind::Permission, 1));
    }

    #[test]
    fn open_makes_the_device_and_creates_a_missing_file() {
        let mem = DeviceSpec::Mem.open(64 * 4096).unwrap();
        assert_eq!((mem.describe(), mem.capacity_slots()), ("mem".to_string(), 64));
        assert_eq!(DeviceSpec::Mem.open(100).unwrap_err().kind(), ErrorKind::InvalidInput);

        let dir = tempfile::TempDir::new_in("/tmp").unwrap();
        let path = dir.path().join("swap");
        let spec = DeviceSpec::parse(&format!("file:{}", path.display())).unwrap();
        let device = spec.open(32 * 4096).unwrap();
        assert_eq!(device.capacity_slots(), 32);
        assert!(device.describe().starts_with(&spec.to_string()), "{}", device.describe());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 32 * 4096);
        // Only the mem device keeps stored pages in this process's memory.
        assert_eq!((mem.memory_held(), device.memory_held()), (Some(0), None));
    }
}
