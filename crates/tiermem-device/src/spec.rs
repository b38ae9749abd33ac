//! Parsing `--device` values.

/// A device named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// DRAM (the ideal).
    Mem,
    /// A file or block device.
    File(std::path::PathBuf),
}

impl DeviceSpec {
    /// Open the device, `capacity_bytes` large.
    pub fn open(&self, capacity_bytes: u64) -> crate::Result<std::sync::Arc<dyn crate::Device>> {
        match self {
            DeviceSpec::Mem => Ok(std::sync::Arc::new(crate::MemDevice::new(capacity_bytes)?)),
            DeviceSpec::File(_) => Err(crate::Error::new(crate::ErrorKind::Unsupported, "file device not built yet")),
        }
    }
}
