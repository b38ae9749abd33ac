//! The malloc family. Requests of at least the threshold become managed regions; everything else
//! (and every pointer that is not ours) goes to glibc unchanged.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use tiermem_sys::PAGE_SIZE;

use crate::heap;
use crate::libc_alloc::{
    __libc_calloc, __libc_free, __libc_malloc, __libc_memalign, __libc_pvalloc, __libc_realloc, __libc_valloc,
    libc_usable_size,
};
use crate::registry::{self, Entry, Origin};
use crate::runtime;

/// Look a C library function up once and call it through `$ty`: past this library (RTLD_NEXT),
/// or with `glibc` first, in glibc itself ([`crate::libc_alloc::glibc_handle`]), for functions
/// another library in the program may define too (an allocator's `malloc_usable_size`).
macro_rules! real {
    (glibc $name:literal, $ty:ty) => {
        $crate::alloc::real!(@in $crate::libc_alloc::glibc_handle(), $name, $ty)
    };
    ($name:literal, $ty:ty) => {
        $crate::alloc::real!(@in libc::RTLD_NEXT, $name, $ty)
    };
    (@in $handle:expr, $name:literal, $ty:ty) => {{
        static ADDRESS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut address = ADDRESS.load(std::sync::atomic::Ordering::Relaxed);
        if address == 0 {
            // SAFETY: dlsym with a NUL-terminated name in a handle that names the C library (or
            // RTLD_NEXT, which finds its definition past this library).
            address = unsafe { libc::dlsym($handle, concat!($name, "\0").as_ptr().cast()) } as usize;
            if address == 0 {
                $crate::runtime::die(&["tiermem: the C library has no ", $name]);
            }
            ADDRESS.store(address, std::sync::atomic::Ordering::Relaxed);
        }
        // SAFETY: the symbol is the C library's function of this name, whose C signature $ty states.
        unsafe { std::mem::transmute::<usize, $ty>(address) }
    }};
}
pub(crate) use real;

use runtime::set_errno;

/// A managed allocation of `size` bytes aligned to `align` that reads as zeros, or null (the
/// caller falls back to the C library) when the engine cannot take it.
pub fn managed_alloc(size: usize, align: usize, origin: Origin) -> *mut c_void {
    allocate(size, align, origin, false)
}

/// As [`managed_alloc`], for malloc and its kin, which promise nothing about the contents: a
/// kept freed region of about the size serves it if there is one.
fn managed_alloc_any(size: usize, align: usize) -> *mut c_void {
    allocate(size, align, Origin::Malloc, runtime::reuse_freed())
}

fn allocate(size: usize, align: usize, origin: Origin, reuse: bool) -> *mut c_void {
    let extra = if align > PAGE_SIZE { align } else { 0 };
    let Some(len) = size.checked_add(extra).and_then(|n| n.checked_next_multiple_of(PAGE_SIZE)) else {
        return std::ptr::null_mut();
    };
    let engine = runtime::engine();
    let kept = if reuse && extra == 0 { crate::recycle::take(len) } else { None };
    let reused = kept.is_some();
    let mut table = registry::lock();
    match kept.map_or_else(|| engine.create_region(len), Ok) {
        Ok(region) => {
            let base = region.as_ptr() as usize;
            let user = if extra > 0 { base.next_multiple_of(align) } else { base };
            let len = region.len();
            registry::insert(&mut table, Entry::new(region, user, size, origin));
            drop(table);
            runtime::count_allocation(len);
            if reused {
                runtime::REUSED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            }
            user as *mut c_void
        }
        Err(e) => {
            drop(table);
            note_unmanaged("an allocation is served by the C library", &e);
            std::ptr::null_mut()
        }
    }
}

/// The engine could not take an allocation (`what`: how it is served instead, unmanaged):
/// counted, and said once.
pub fn note_unmanaged(what: &str, e: &dyn std::fmt::Display) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    runtime::FALLBACK_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    if !WARNED.swap(true, Ordering::Relaxed) {
        runtime::say(&["tiermem: ", what, ", unmanaged (further ones are counted, not shown): ", &e.to_string()]);
    }
}

fn is_large(size: usize) -> bool {
    size >= runtime::threshold()
}

/// What [`take_malloc_entry`] found at a pointer.
enum Found {
    /// Taken out of the registry, to be released under its mark (see `registry::ReleaseMark`).
    Ours(Entry, registry::ReleaseMark),
    NotOurs,
}

/// `ptr`, in no live managed allocation, is one freed earlier: kept for reuse (still mapped), or
/// freed recently and unmapped since.
fn freed_managed(ptr: usize) -> bool {
    crate::recycle::holds(ptr) || registry::is_double_free(ptr)
}

/// Remove and return the managed malloc allocation starting at `ptr`, stopping the program on
/// a pointer into the middle of one, into mapped memory, or freed twice.
fn take_malloc_entry(ptr: usize, what: &str) -> Found {
    // Only page-aligned pointers are looked up: an unaligned one is never a managed start, and
    // glibc reports most bad frees of its own.
    if !registry::may_be_managed_pointer(ptr) {
        return Found::NotOurs;
    }
    let mut table = registry::lock();
    let Some(base) = registry::spanning(&table, ptr) else {
        drop(table);
        if freed_managed(ptr) {
            runtime::die(&["tiermem: ", what, "(): double free of a managed allocation"]);
        }
        return Found::NotOurs;
    };
    let entry = &table[&base];
    if entry.origin == Origin::Mmap {
        runtime::die(&["tiermem: ", what, "() of memory that came from mmap"]);
    }
    if entry.user != ptr {
        runtime::die(&["tiermem: ", what, "() of a pointer inside a managed allocation, not its start"]);
    }
    // Released under a mark, as munmap releases: the program may have mapped over part of the
    // block and unmapped that again, and another thread may map there while the region goes.
    let entry = registry::take_for_release(&mut table, base).expect("entry found above");
    let mark = registry::ReleaseMark::new(&mut table, base, base + entry.len(), 1);
    drop(table);
    registry::remember_freed(ptr);
    Found::Ours(entry, mark)
}

/// # Safety
/// The C contract of malloc.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    if is_large(size) {
        let p = managed_alloc_any(size, 16);
        if !p.is_null() {
            return p;
        }
    } else if let Some(p) = small_alloc(size, 16) {
        return p;
    }
    // SAFETY: forwarding the caller's request.
    let p = unsafe { __libc_malloc(size) };
    if p.is_null() {
        return rescued(size, false);
    }
    p
}

/// A block from the engine's reserve for a small request the C library refused one of tiermem's
/// threads (see [`crate::reserve::rescue`]), zeroed if `zero`; else null, as refused.
fn rescued(size: usize, zero: bool) -> *mut c_void {
    let Some(block) = crate::reserve::rescue_c(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if zero {
        // SAFETY: the block holds at least `size` bytes (it may be a reused one).
        unsafe { std::ptr::write_bytes(block, 0, size) };
    }
    block.cast()
}

/// A small allocation from the managed heap, if it serves this request. A program that makes
/// many small allocations and no large one starts the engine once they add up to the threshold
/// (what one large allocation would have started it with): everything allocated before stays
/// in glibc's heap, unmanaged for good. It was 16 MiB, which left a Redis server (all small
/// objects) 16 MiB short of its budget; short-lived tools that allocate less still run without
/// an engine.
fn small_alloc(size: usize, align: usize) -> Option<*mut c_void> {
    static SMALL_BYTES: AtomicUsize = AtomicUsize::new(0);
    if runtime::running_engine().is_none() {
        let threshold = runtime::threshold();
        if threshold == usize::MAX
            || SMALL_BYTES.fetch_add(size, Ordering::Relaxed) < threshold
            || !runtime::small_heap_wanted()
        {
            return None;
        }
        runtime::try_start_engine()?;
    }
    heap::alloc(size, align)
}

/// # Safety
/// The C contract of free.
#[no_mangle]
pub unsafe extern "C" fn free(ptr: *mut c_void) {
    if ptr.is_null() {
        return;
    }
    if heap::contains(ptr as usize) {
        // SAFETY: a heap block, live by the caller's contract.
        return unsafe { heap::free(ptr) };
    }
    if crate::reserve::owns(ptr.cast()) {
        // SAFETY: only `rescued` hands reserve blocks to C callers; live by the caller's contract.
        return unsafe { crate::reserve::free_c(ptr.cast()) };
    }
    match take_malloc_entry(ptr as usize, "free") {
        Found::Ours(entry, mark) => {
            runtime::release(entry);
            drop(mark);
        }
        // SAFETY: not ours, so the C library's (or a bug the C library reports).
        Found::NotOurs => unsafe { __libc_free(ptr) },
    }
}

/// # Safety
/// The C contract of calloc.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if is_large(total) {
        // Fresh managed pages read as zeros without being written.
        let p = managed_alloc(total, 16, Origin::Malloc);
        if !p.is_null() {
            return p;
        }
    } else if let Some(p) = small_alloc(total, 16) {
        // SAFETY: the block holds at least `total` bytes; a reused one holds old data.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, total) };
        return p;
    }
    // SAFETY: forwarding the caller's request.
    let p = unsafe { __libc_calloc(n, size) };
    if p.is_null() {
        return rescued(total, true);
    }
    p
}

/// # Safety
/// The C contract of realloc.
#[no_mangle]
pub unsafe extern "C" fn realloc(ptr: *mut c_void, size: usize) -> *mut c_void {
    if ptr.is_null() {
        // SAFETY: realloc(NULL, n) is malloc(n).
        return unsafe { malloc(size) };
    }
    let addr = ptr as usize;
    if heap::contains(addr) {
        // SAFETY: a live heap block (the caller's contract).
        return unsafe { realloc_heap_block(ptr, size) };
    }
    if crate::reserve::owns(ptr.cast()) {
        // SAFETY: a live block `rescued` handed out (the caller's contract).
        return unsafe { realloc_rescued_block(ptr, size) };
    }
    if registry::may_be_managed_pointer(addr) {
        let mut table = registry::lock();
        if let Some(base) = registry::spanning(&table, addr) {
            let entry = table.get_mut(&base).expect("found above");
            if entry.user != addr || entry.origin != Origin::Malloc {
                runtime::die(&["tiermem: realloc() of a pointer that is not the start of a managed allocation"]);
            }
            if size == 0 {
                drop(table);
                // SAFETY: glibc's realloc(p, 0) frees p and returns NULL.
                unsafe { free(ptr) };
                return std::ptr::null_mut();
            }
            if is_large(size) && size <= entry.usable() {
                entry.size = size;
                return ptr;
            }
            let old_size = entry.size;
            drop(table);
            // SAFETY: a fresh allocation (managed or not) of the new size.
            let new = unsafe { malloc(size) };
            if new.is_null() {
                return new;
            }
            // SAFETY: both ranges are valid for the smaller size and do not overlap (distinct
            // allocations); reading the old managed bytes faults them in as needed.
            unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old_size.min(size)) };
            // SAFETY: ptr is the managed allocation looked up above.
            unsafe { free(ptr) };
            return new;
        }
        drop(table);
        if freed_managed(addr) {
            runtime::die(&["tiermem: realloc() of a freed managed allocation"]);
        }
    }
    if is_large(size) {
        let new = managed_alloc_any(size, 16);
        if !new.is_null() {
            // SAFETY: ptr is a live C library allocation (the caller's contract).
            let old_size = unsafe { libc_usable_size(ptr) };
            // SAFETY: old_size bytes are readable at ptr, and new holds at least size bytes.
            unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old_size.min(size)) };
            // SAFETY: the old C library allocation is no longer referenced.
            unsafe { __libc_free(ptr) };
            return new;
        }
    }
    // SAFETY: forwarding the caller's request for a C library allocation.
    unsafe { __libc_realloc(ptr, size) }
}

/// realloc of a block of the engine's reserve that [`rescued`] handed out: moved to whatever
/// malloc gives now (glibc's again once it has room).
///
/// # Safety
/// `ptr` is such a block, live.
unsafe fn realloc_rescued_block(ptr: *mut c_void, size: usize) -> *mut c_void {
    // SAFETY: a live rescued block (the caller's contract).
    let old_size = unsafe { crate::reserve::usable_c(ptr.cast()) };
    if size != 0 && size <= old_size {
        return ptr;
    }
    let new = if size == 0 {
        std::ptr::null_mut()
    } else {
        // SAFETY: a fresh allocation of the new size.
        let new = unsafe { malloc(size) };
        if new.is_null() {
            return new; // the old block stays the caller's, as realloc promises
        }
        // SAFETY: the old block holds old_size bytes, the new one at least `size`; distinct.
        unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old_size.min(size)) };
        new
    };
    // SAFETY: the old block is no longer referenced (realloc(p, 0) frees p, as glibc's does).
    unsafe { crate::reserve::free_c(ptr.cast()) };
    new
}

/// realloc of a block of the small heap.
///
/// # Safety
/// `ptr` is a live heap block.
unsafe fn realloc_heap_block(ptr: *mut c_void, size: usize) -> *mut c_void {
    if size == 0 {
        // SAFETY: glibc's realloc(p, 0) frees p and returns NULL.
        unsafe { heap::free(ptr) };
        return std::ptr::null_mut();
    }
    if !is_large(size) {
        // SAFETY: a live heap block, non-zero size.
        if let Some(p) = unsafe { heap::realloc(ptr, size) } {
            return p;
        }
    }
    // Across the threshold, or the heap cannot hold it: move the bytes to a new allocation.
    // SAFETY: a fresh allocation (managed, heap or C library) of the new size.
    let new = unsafe { malloc(size) };
    if new.is_null() {
        return new;
    }
    // SAFETY: a live heap block.
    let old_size = unsafe { heap::usable_size(ptr) };
    // SAFETY: the old block holds old_size bytes, the new one at least `size`; distinct blocks.
    unsafe { std::ptr::copy_nonoverlapping(ptr.cast::<u8>(), new.cast::<u8>(), old_size.min(size)) };
    // SAFETY: the old block is no longer referenced.
    unsafe { heap::free(ptr) };
    new
}

/// # Safety
/// The C contract of reallocarray.
#[no_mangle]
pub unsafe extern "C" fn reallocarray(ptr: *mut c_void, n: usize, size: usize) -> *mut c_void {
    match n.checked_mul(size) {
        // SAFETY: forwarding to realloc with the checked product.
        Some(total) => unsafe { realloc(ptr, total) },
        None => {
            set_errno(libc::ENOMEM);
            std::ptr::null_mut()
        }
    }
}

fn aligned(align: usize, size: usize) -> *mut c_void {
    if is_large(size) {
        let p = managed_alloc_any(size, align);
        if !p.is_null() {
            return p;
        }
    } else if let Some(p) = small_alloc(size, align) {
        return p;
    }
    // SAFETY: forwarding an aligned request to the C library.
    unsafe { __libc_memalign(align, size) }
}

/// # Safety
/// The C contract of posix_memalign.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> i32 {
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<usize>()) {
        return libc::EINVAL;
    }
    let p = aligned(align, size);
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: out is a valid pointer to a pointer (the caller's contract).
    unsafe { *out = p };
    0
}

/// # Safety
/// The C contract of aligned_alloc.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    aligned(align, size)
}

/// # Safety
/// The C contract of memalign.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    // glibc rounds a non-power-of-two alignment up; so do we.
    aligned(align.max(1).next_power_of_two(), size)
}

/// # Safety
/// The C contract of valloc.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    if is_large(size) {
        let p = managed_alloc_any(size, PAGE_SIZE);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: forwarding the caller's request.
    unsafe { __libc_valloc(size) }
}

/// # Safety
/// The C contract of pvalloc.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let rounded = size.max(1).checked_next_multiple_of(PAGE_SIZE).unwrap_or(usize::MAX);
    if is_large(rounded) {
        let p = managed_alloc_any(rounded, PAGE_SIZE);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: forwarding the caller's request.
    unsafe { __libc_pvalloc(size) }
}

/// # Safety
/// The C contract of malloc_usable_size.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(ptr: *mut c_void) -> usize {
    if ptr.is_null() {
        return 0;
    }
    if heap::contains(ptr as usize) {
        // SAFETY: a live heap block (the caller's contract).
        return unsafe { heap::usable_size(ptr) };
    }
    if crate::reserve::owns(ptr.cast()) {
        // SAFETY: a live block `rescued` handed out (the caller's contract).
        return unsafe { crate::reserve::usable_c(ptr.cast()) };
    }
    if registry::may_be_managed_pointer(ptr as usize) {
        let table = registry::lock();
        if let Some(base) = registry::spanning(&table, ptr as usize) {
            let entry = &table[&base];
            return if entry.user == ptr as usize { entry.usable() } else { 0 };
        }
    }
    // SAFETY: a C library allocation (the caller's contract).
    unsafe { libc_usable_size(ptr) }
}
