//! A trace file's header is not trusted for memory: a few bytes claiming billions of records
//! must be refused without first reserving room for them (found by the `trace_load` fuzz
//! target, fuzz/: a 48-byte file made `tiermem sim` ask for 2 GiB at once).
//!
//! Its own test binary, because it counts the allocations of the whole process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use tiermem_sim::{load, Format, LineOptions};

/// The system allocator, remembering the largest single request.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed on to the system allocator unchanged; only a size is recorded.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is the one `System.alloc` needs.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc` is the one `System.realloc` needs.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[test]
fn a_header_claiming_billions_of_records_reserves_no_room_for_them() {
    let mut header = Vec::new();
    header.extend_from_slice(b"TMTRACE\0");
    header.extend_from_slice(&1u32.to_le_bytes()); // version
    header.extend_from_slice(&0u32.to_le_bytes()); // unit: pages
    header.extend_from_slice(&(1u64 << 40).to_le_bytes()); // records claimed
    header.extend_from_slice(&(5u64 << 2).to_le_bytes()); // one read of page 5
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(&header).unwrap();
    let before = LARGEST.load(Ordering::Relaxed);
    let error = load(file.path(), Format::Auto, &LineOptions::default()).unwrap_err().to_string();
    assert!(error.contains("header says 1099511627776 records, file holds 1"), "{error}");
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest < 64 << 20, "a 32-byte file made one allocation of {largest} bytes (largest before: {before})");
}
