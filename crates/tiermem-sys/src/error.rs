//! The one error type of tiermem: a kind a caller can match on, a sentence of context a person can
//! act on, and the OS error underneath when there is one.

use std::fmt;
use std::io;

/// What went wrong, coarsely enough for a caller to decide what to do about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A size, path, mode or limit given by the user is not acceptable.
    InvalidInput,
    /// A path does not exist.
    NotFound,
    /// A device or file is smaller than what was asked of it.
    TooSmall,
    /// The kernel, file system or device lacks a feature tiermem needs.
    Unsupported,
    /// No room left: device slots, buffers, or the file system.
    NoSpace,
    /// Not allowed (permissions, capabilities, a sysctl).
    Permission,
    /// The device reported an I/O error.
    Io,
    /// The resource is held by someone else (a device file another engine uses).
    Busy,
    /// A block device is in use outside tiermem (mounted, or held open exclusively).
    InUse,
    /// An invariant of tiermem itself broke; a bug.
    Internal,
}

/// tiermem's error: kind + context + optional OS error.
#[derive(Debug)]
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<io::Error>,
}

/// tiermem's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with a sentence saying what was being done.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Self {
        Self { kind, context: context.into(), source: None }
    }

    /// An error from an OS error; the kind is derived from the errno.
    pub fn os(source: io::Error, context: impl Into<String>) -> Self {
        let kind = kind_of_errno(source.raw_os_error());
        Self { kind, context: context.into(), source: Some(source) }
    }

    /// An error from an OS error with an explicit kind.
    pub fn os_kind(kind: ErrorKind, source: io::Error, context: impl Into<String>) -> Self {
        Self { kind, context: context.into(), source: Some(source) }
    }

    /// Shorthand for [`ErrorKind::InvalidInput`].
    pub fn invalid(context: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidInput, context)
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The OS error underneath, if any.
    pub fn os_error(&self) -> Option<&io::Error> {
        self.source.as_ref()
    }

    /// Prefix more context ("while doing X: ...").
    #[must_use]
    pub fn context(mut self, outer: impl fmt::Display) -> Self {
        self.context = format!("{outer}: {}", self.context);
        self
    }
}

fn kind_of_errno(errno: Option<i32>) -> ErrorKind {
    match errno {
        Some(libc::ENOENT) => ErrorKind::NotFound,
        Some(libc::ENOSPC) | Some(libc::ENOMEM) | Some(libc::EDQUOT) => ErrorKind::NoSpace,
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => ErrorKind::Permission,
        Some(libc::EINVAL) => ErrorKind::InvalidInput,
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::ENOTTY) => ErrorKind::Unsupported,
        _ => ErrorKind::Io,
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(errno: rustix::io::Errno) -> Self {
        Self::os(errno.into(), "system call failed")
    }
}

/// Attach context to a `Result` whose error converts into [`Error`].
pub trait ResultExt<T> {
    /// Wrap the error with a sentence saying what was being done.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> ResultExt<T> for std::result::Result<T, io::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::os(e, what()))
    }
}

impl<T> ResultExt<T> for std::result::Result<T, rustix::io::Errno> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::os(e.into(), what()))
    }
}

impl<T> ResultExt<T> for Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| e.context(what()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_kind_and_message_keeps_context() {
        let e = Error::os(io::Error::from_raw_os_error(libc::ENOSPC), "writing slot 7");
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        let text = e.context("evicting page 0x1000").to_string();
        assert!(text.starts_with("evicting page 0x1000: writing slot 7: "), "{text}");
        assert!(text.contains("No space left"), "{text}");
    }
}
