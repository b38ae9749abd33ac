//! What this kernel offers tiermem, found out at start-up by trying each feature.

use crate::mem::Mapping;
use crate::pagemap::{category, PageRegion, Pagemap, ScanQuery};
use crate::uffd::{Features, RegisterMode, Uffd};
use crate::PAGE_SIZE;

/// The userfaultfd-related features tiermem can use, each probed for real.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct KernelFeatures {
    /// Kernel release (uname -r).
    pub kernel: String,
    /// userfaultfd(2) works for this process; `false` with `error` explaining why not.
    pub userfaultfd: bool,
    /// Why userfaultfd could not be used, if it could not.
    pub error: Option<String>,
    /// Raw feature bits offered by the handshake.
    pub feature_bits: u64,
    /// Faults taken inside the kernel (a system call touching a missing page) can be served:
    /// false when this process may open only a user-mode-only userfaultfd (no CAP_SYS_PTRACE,
    /// vm.unprivileged_userfaultfd = 0), which leaves sigbus fault mode.
    pub kernel_faults: bool,
    /// Missing-page faults on anonymous memory.
    pub missing: bool,
    /// Write-protect faults on anonymous memory.
    pub wp: bool,
    /// UFFDIO_COPY can install pages write-protected.
    pub copy_mode_wp: bool,
    /// Asynchronous write protection (kernel resolves WP faults).
    pub wp_async: bool,
    /// PAGEMAP_SCAN ioctl on /proc/PID/pagemap.
    pub pagemap_scan: bool,
    /// Faults delivered as SIGBUS to the faulting thread.
    pub sigbus: bool,
    /// UFFDIO_MOVE.
    pub move_pages: bool,
    /// Minor faults on shared memory.
    pub minor: bool,
}

impl KernelFeatures {
    /// Probe the running kernel. Never fails: what does not work is reported as absent.
    pub fn probe() -> Self {
        let mut f = Self { kernel: kernel_release(), ..Self::default() };
        let offered = match Uffd::open(Features::default(), false) {
            Ok(uffd) => {
                f.kernel_faults = uffd.handles_kernel_faults();
                uffd.offered_features()
            }
            Err(e) => {
                f.error = Some(e.to_string());
                return f;
            }
        };
        f.userfaultfd = true;
        f.feature_bits = offered.0;
        f.sigbus = offered.contains(Features::SIGBUS);
        f.wp_async = offered.contains(Features::WP_ASYNC);
        f.move_pages = offered.contains(Features::MOVE);
        f.minor = offered.contains(Features::MINOR_SHMEM);
        f.missing = try_missing_fill().is_ok();
        if offered.contains(Features::WP) {
            f.wp = try_register_wp().is_ok();
            f.copy_mode_wp = f.wp && try_copy_mode_wp().unwrap_or(false);
        }
        f.pagemap_scan = try_pagemap_scan().is_ok();
        f
    }

    /// One line per feature, for people.
    pub fn summary_lines(&self) -> Vec<String> {
        let yn = |b: bool| if b { "yes" } else { "no" };
        let mut lines = vec![format!("kernel          {}", self.kernel)];
        match &self.error {
            Some(e) => lines.push(format!("userfaultfd     unavailable: {e}")),
            None if self.kernel_faults => {
                lines.push(format!("userfaultfd     yes (feature bits {:#x})", self.feature_bits))
            }
            None => lines.push(format!(
                "userfaultfd     user-mode faults only (feature bits {:#x}): fault mode sigbus; thread mode needs \
                 root, CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1",
                self.feature_bits
            )),
        }
        for (name, v) in [
            ("MISSING", self.missing),
            ("WP", self.wp),
            ("COPY_MODE_WP", self.copy_mode_wp),
            ("WP_ASYNC", self.wp_async),
            ("PAGEMAP_SCAN", self.pagemap_scan),
            ("SIGBUS", self.sigbus),
            ("MOVE", self.move_pages),
            ("MINOR", self.minor),
        ] {
            lines.push(format!("{name:<15} {}", yn(v)));
        }
        lines
    }
}

fn kernel_release() -> String {
    rustix::system::uname().release().to_string_lossy().into_owned()
}

fn try_missing_fill() -> crate::Result<()> {
    let uffd = Uffd::open(Features::empty(), true)?;
    let map = Mapping::anonymous(PAGE_SIZE, false)?;
    uffd.register(map.as_ptr(), PAGE_SIZE, RegisterMode { missing: true, write_protect: false })?;
    uffd.zeropage(map.as_ptr(), PAGE_SIZE)?;
    Ok(())
}

fn try_register_wp() -> crate::Result<()> {
    let uffd = Uffd::open(Features::WP, true)?;
    let map = Mapping::anonymous(PAGE_SIZE, false)?;
    uffd.register(map.as_ptr(), PAGE_SIZE, RegisterMode { missing: true, write_protect: true })?;
    Ok(())
}

fn try_copy_mode_wp() -> crate::Result<bool> {
    let uffd = Uffd::open(Features::WP, true)?;
    let map = Mapping::anonymous(PAGE_SIZE, false)?;
    uffd.register(map.as_ptr(), PAGE_SIZE, RegisterMode { missing: true, write_protect: true })?;
    let src = Mapping::anonymous(PAGE_SIZE, true)?;
    // SAFETY: src is a readable page; dst is registered above.
    let ok = unsafe { uffd.copy(map.as_ptr(), src.as_ptr(), PAGE_SIZE, true, false) }.is_ok();
    Ok(ok)
}

fn try_pagemap_scan() -> crate::Result<()> {
    let pm = Pagemap::open_self()?;
    let map = Mapping::anonymous(PAGE_SIZE, true)?;
    let mut out = [PageRegion::default(); 1];
    let q = ScanQuery { required: category::PRESENT, report: category::PRESENT, ..Default::default() };
    let start = map.as_ptr() as usize;
    pm.scan(start, start + PAGE_SIZE, &q, &mut out)?;
    Ok(())
}
