//! Any bytes as a trace file: `tiermem sim` must load them or refuse them with an error, in
//! every format, never panic, hang or run out of memory.
#![no_main]

use std::io::Write as _;

use libfuzzer_sys::fuzz_target;
use tiermem_sim::{load, Format, LineOptions};

fuzz_target!(|data: &[u8]| {
    let mut file = tempfile_in_shm();
    file.write_all(data).expect("write the input");
    let path = file.path().to_owned();
    for format in [Format::Auto, Format::Binary, Format::Lackey, Format::Pages] {
        for lines in [LineOptions::default(), LineOptions { llc: None, threshold: 1, instructions: true }] {
            if let Ok(trace) = load(&path, format, &lines) {
                // Whatever loads can be replayed.
                let _ = tiermem_sim::footprint(&trace.events);
            }
        }
    }
});

/// A file that goes away with its handle, in memory where /dev/shm exists.
fn tempfile_in_shm() -> NamedFile {
    let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    let path = dir.join(format!("tiermem-fuzz-{}.trace", std::process::id()));
    NamedFile { file: std::fs::File::create(&path).expect("create the input file"), path }
}

struct NamedFile {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl NamedFile {
    fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl std::io::Write for NamedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl Drop for NamedFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
