//! The C library's allocator, reached without going through the symbols this shim interposes.
//! glibc exports its implementation under `__libc_*` names; the shim's own allocations (and the
//! engine's, since it is linked in) use them, so they can never recurse into the shim.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

extern "C" {
    pub fn __libc_malloc(size: usize) -> *mut c_void;
    pub fn __libc_free(ptr: *mut c_void);
    pub fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    pub fn __libc_realloc(ptr: *mut c_void, size: usize) -> *mut c_void;
    pub fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
    pub fn __libc_valloc(size: usize) -> *mut c_void;
    pub fn __libc_pvalloc(size: usize) -> *mut c_void;
}

/// glibc itself, as a dlsym handle: the C library this process already has mapped.
pub fn glibc_handle() -> *mut c_void {
    // SAFETY: dlopen of a NUL-terminated name with RTLD_NOLOAD only returns a library this
    // process already has mapped (every process under the shim has glibc).
    let handle = unsafe { libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        crate::runtime::die(&["tiermem: libc.so.6 is not loaded"]);
    }
    handle
}

/// glibc's own `malloc_usable_size`, for blocks from the `__libc_*` functions above. Not the next
/// definition after this library (RTLD_NEXT): a program linked with another allocator
/// (Debian's redis-server with libjemalloc) has that allocator's version next, which crashes on
/// a glibc block.
///
/// # Safety
/// `ptr` is a live block from glibc's allocator.
pub unsafe fn libc_usable_size(ptr: *mut c_void) -> usize {
    let usable = crate::alloc::real!(glibc "malloc_usable_size", unsafe extern "C" fn(*mut c_void) -> usize);
    // SAFETY: ptr is a glibc block (the caller's contract).
    unsafe { usable(ptr) }
}

/// malloc's guaranteed alignment on x86-64 glibc.
const MALLOC_ALIGN: usize = 16;

/// Rust's global allocator for the shim: [`GlibcOrReserve`], counting the bytes it holds (the
/// engine's and the shim's own tables, which the cgroup charges and the budget leaves room for).
#[derive(Debug)]
pub struct LibcAllocator;

/// Bytes the shim and the engine hold from the global allocator now, and at most so far.
pub static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
pub static PEAK_BYTES: AtomicU64 = AtomicU64::new(0);

fn count(grown: usize, shrunk: usize) {
    if grown >= shrunk {
        let live = LIVE_BYTES.fetch_add((grown - shrunk) as u64, Ordering::Relaxed) + (grown - shrunk) as u64;
        PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
    } else {
        LIVE_BYTES.fetch_sub((shrunk - grown) as u64, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `GlibcOrReserve` with the caller's arguments unchanged.
unsafe impl GlobalAlloc for LibcAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let block = unsafe { GlibcOrReserve.alloc(layout) };
        if !block.is_null() {
            count(layout.size(), 0);
        }
        block
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { GlibcOrReserve.dealloc(ptr, layout) };
        count(0, layout.size());
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let block = unsafe { GlibcOrReserve.alloc_zeroed(layout) };
        if !block.is_null() {
            count(layout.size(), 0);
        }
        block
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let block = unsafe { GlibcOrReserve.realloc(ptr, layout, new_size) };
        if !block.is_null() {
            count(new_size, layout.size());
        }
        block
    }
}

/// glibc's malloc under its internal names, and for the engine's threads under the OOM guard
/// the [`crate::reserve`].
#[derive(Debug)]
struct GlibcOrReserve;

// SAFETY: every method forwards to glibc's allocator with a size and alignment it honours
// (memalign for alignments above malloc's guarantee), and frees only what it allocated.
unsafe impl GlobalAlloc for GlibcOrReserve {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(block) = crate::reserve::alloc(layout.size(), layout.align()) {
            return block;
        }
        let block: *mut u8 = if layout.align() <= MALLOC_ALIGN {
            // SAFETY: plain malloc of a non-zero size (GlobalAlloc callers never ask for zero).
            unsafe { __libc_malloc(layout.size()).cast() }
        } else {
            // SAFETY: memalign with a power-of-two alignment, as Layout guarantees.
            unsafe { __libc_memalign(layout.align(), layout.size()).cast() }
        };
        if block.is_null() {
            return crate::reserve::rescue(layout.size(), layout.align()).unwrap_or(block);
        }
        crate::reserve::after_fallback(block, layout.size());
        block
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if crate::reserve::owns(ptr) {
            // SAFETY: a block of the reserve, allocated for this layout and given up by the caller.
            unsafe { crate::reserve::free(ptr, layout.size(), layout.align()) };
            return;
        }
        // SAFETY: ptr came from alloc/alloc_zeroed/realloc above; not the reserve's, so glibc's.
        unsafe { __libc_free(ptr.cast()) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if let Some(block) = crate::reserve::alloc(layout.size(), layout.align()) {
            // SAFETY: a fresh reserve block of at least layout.size() writable bytes.
            unsafe { std::ptr::write_bytes(block, 0, layout.size()) };
            return block;
        }
        if layout.align() <= MALLOC_ALIGN {
            // SAFETY: calloc of one object of the layout's size.
            let block: *mut u8 = unsafe { __libc_calloc(1, layout.size()).cast() };
            if block.is_null() {
                let Some(rescued) = crate::reserve::rescue(layout.size(), layout.align()) else { return block };
                // SAFETY: a reserve block of at least layout.size() writable bytes (maybe reused).
                unsafe { std::ptr::write_bytes(rescued, 0, layout.size()) };
                return rescued;
            }
            crate::reserve::after_fallback(block, layout.size());
            block
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
        let in_reserve = crate::reserve::owns(ptr);
        if in_reserve
            && crate::reserve::block_size(layout.size(), layout.align())
                == crate::reserve::block_size(new_size, layout.align())
        {
            return ptr;
        }
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return std::ptr::null_mut();
        };
        // An engine thread's block moves into the reserve (also from the C library, so a queue
        // allocated before the reserve existed stops growing there); a reserve block that
        // outgrows it moves out; glibc's realloc keeps only malloc's alignment.
        let new = match crate::reserve::alloc(new_size, layout.align()) {
            Some(block) => block,
            None if in_reserve || layout.align() > MALLOC_ALIGN => {
                // SAFETY: a fresh allocation of the new layout.
                unsafe { self.alloc(new_layout) }
            }
            None => {
                // SAFETY: ptr is a glibc allocation of this allocator; new_size is non-zero.
                let block: *mut u8 = unsafe { __libc_realloc(ptr.cast(), new_size).cast() };
                if !block.is_null() {
                    crate::reserve::after_fallback(block, new_size);
                    return block;
                }
                // Refused, and the old block is still glibc's: moved below if the reserve rescues.
                crate::reserve::rescue(new_size, layout.align()).unwrap_or(block)
            }
        };
        if !new.is_null() {
            // SAFETY: both blocks hold at least the smaller size and are distinct.
            unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
            // SAFETY: ptr was allocated by this allocator with `layout`.
            unsafe { self.dealloc(ptr, layout) };
        }
        new
    }
}
