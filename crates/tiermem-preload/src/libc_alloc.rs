//! The C library's allocator, reached without going through the symbols this shim interposes.
//! glibc exports its implementation under `__libc_*` names; the shim's own allocations (and the
//! engine's, since it is linked in) use them, so they can never recurse into the shim.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

extern "C" {
    pub fn __libc_malloc(size: usize) -> *mut c_void;
    pub fn __libc_free(ptr: *mut c_void);
    pub fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    pub fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    pub fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    pub fn __libc_valloc(size: usize) -> *mut c_void;
    pub fn __libc_pvalloc(size: usize) -> *mut c_void;
}

/// malloc's guaranteed alignment on x86-64 glibc.
const MALLOC_ALIGN: usize = 16;

/// Rust's global allocator for the shim: glibc's malloc under its internal names.
#[derive(Debug)]
pub struct LibcAllocator;

// SAFETY: every method forwards to glibc's allocator with a size and alignment it honours
// (memalign for alignments above malloc's guarantee), and frees only what it allocated.
unsafe impl GlobalAlloc for LibcAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: plain malloc of a non-zero size (GlobalAlloc callers never ask for zero).
            unsafe { __libc_malloc(layout.size()).cast() }
        } else {
            // SAFETY: memalign with a power-of-two alignment, as Layout guarantees.
            unsafe { __libc_memalign(layout.align(), layout.size()).cast() }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: ptr came from alloc/alloc_zeroed/realloc above, all glibc allocations.
        unsafe { __libc_free(ptr.cast()) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: calloc of one object of the layout's size.
            unsafe { __libc_calloc(1, layout.size()).cast() }
        } else {
            // SAFETY: as in alloc; the result is zeroed over its whole size before it is returned.
            let ptr = unsafe { self.alloc(layout) };
            if !ptr.is_null() {
                // SAFETY: ptr points to layout.size() writable bytes just allocated.
                unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
            }
            ptr
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: ptr is a glibc allocation of this allocator; new_size is non-zero.
            unsafe { __libc_realloc(ptr.cast(), new_size).cast() }
        } else {
            let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
                return std::ptr::null_mut();
            };
            // SAFETY: a fresh allocation with the same alignment.
            let new = unsafe { self.alloc(new_layout) };
            if !new.is_null() {
                // SAFETY: both blocks hold at least the smaller size and are distinct.
                unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
                // SAFETY: ptr was allocated by this allocator with `layout`.
                unsafe { self.dealloc(ptr, layout) };
            }
            new
        }
    }
}
