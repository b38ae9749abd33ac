//! Parsing `--device` values.

/// A device named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// DRAM (the ideal).
    Mem,
    /// A file or block device.
    File(std::path::PathBuf),
}
