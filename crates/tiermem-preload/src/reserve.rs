//! Memory set aside for the engine's own threads, charged to the cgroup before it is needed.
//!
//! Under the OOM guard (`--cgroup guard`) a task that touches a new page while the cgroup is full
//! waits in the kernel until memory is uncharged. The engine's threads are the ones that
//! uncharge it (by evicting), so they must never wait that way: seen with a cold page cache, the
//! reclaim thread growing a queue, the completion thread's malloc arena reaching a fresh page and
//! the program's burst all waiting together until the guard gave up and the OOM killer struck.
//!
//! So the Rust allocations of the engine's threads come from this reserve: one mapping populated
//! up front, cut into power-of-two blocks (16 B to 64 KiB) with a free list per size. Larger
//! requests and requests once the reserve is used up go to the C library and are made resident
//! at once ([`after_fallback`], counted in [`FALLBACKS`]); other threads' requests go to the C
//! library as before. A small request the C library refuses one of tiermem's threads (a thread
//! start's own, before the engine knows the thread) is served here too ([`rescue`]). The top of
//! the threads' stacks is made resident for the same reason ([`populate_stack`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Smallest block: malloc's alignment.
const MIN_SHIFT: u32 = 4;
/// Largest block served from the reserve.
const MAX_SHIFT: u32 = 16;
const CLASSES: usize = (MAX_SHIFT - MIN_SHIFT + 1) as usize;

/// The reserve's bounds (0..0 until [`arm`]).
static START: AtomicUsize = AtomicUsize::new(0);
static END: AtomicUsize = AtomicUsize::new(0);
/// Where fresh blocks are cut from next.
static BUMP: AtomicUsize = AtomicUsize::new(0);
/// Head of each size's free list (0: empty); the link is the first word of a free block.
static FREE: [AtomicUsize; CLASSES] = [const { AtomicUsize::new(0) }; CLASSES];
/// Guards the free lists and the bump pointer. A spin lock, not a mutex: a forked child resets
/// it ([`after_fork_in_child`]), and the engine's threads hold it for a few instructions.
static LOCK: AtomicBool = AtomicBool::new(false);

/// Allocations of the engine's threads that went to the C library (too large, or the reserve
/// was used up), made resident at once.
pub static FALLBACKS: AtomicU64 = AtomicU64::new(0);
/// Requests the C library refused one of tiermem's threads, served here (see [`rescue`]).
pub static RESCUES: AtomicU64 = AtomicU64::new(0);
/// Bytes of the reserve cut into blocks so far (its high-water mark).
pub static USED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of the reserve (0 before [`arm`] or if it failed).
pub fn size() -> usize {
    END.load(Ordering::Acquire) - START.load(Ordering::Acquire)
}

/// Set the reserve up: `len` bytes, populated now (a system call that fails for want of memory
/// rather than waiting for it). Once only; a failure leaves the engine on the C library.
pub fn arm(len: usize) -> Result<(), String> {
    if START.load(Ordering::Acquire) != 0 {
        return Ok(());
    }
    let len = len.next_multiple_of(tiermem_sys::PAGE_SIZE);
    let mapping = tiermem_sys::mem::Mapping::anonymous(len, false).map_err(|e| format!("reserve: {e}"))?;
    // SAFETY: populating our own fresh mapping changes no contents.
    let populated =
        unsafe { rustix::mm::madvise(mapping.as_ptr().cast(), mapping.len(), rustix::mm::Advice::LinuxPopulateWrite) };
    populated.map_err(|e| format!("cannot populate the engine's reserve of {len} bytes: {e}"))?;
    let start = mapping.as_ptr() as usize;
    // The reserve lives as long as the process: blocks may be freed at any time.
    std::mem::forget(mapping);
    BUMP.store(start, Ordering::Relaxed);
    END.store(start + len, Ordering::Relaxed);
    START.store(start, Ordering::Release);
    Ok(())
}

/// The size class of a request, if the reserve serves it.
fn class_of(size: usize, align: usize) -> Option<usize> {
    // Blocks are aligned to their size up to a page only: a larger alignment goes elsewhere.
    if align > tiermem_sys::PAGE_SIZE {
        return None;
    }
    let block = size.max(align).max(1 << MIN_SHIFT).next_power_of_two();
    let shift = block.trailing_zeros();
    (shift <= MAX_SHIFT).then(|| (shift - MIN_SHIFT) as usize)
}

struct Locked;

impl Locked {
    fn take() -> Self {
        let mut spins = 0u32;
        while LOCK.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            spins += 1;
            if spins.is_multiple_of(64) {
                // The holder may be descheduled on the other core's run queue: let it run.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Self
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        LOCK.store(false, Ordering::Release);
    }
}

/// A block for `size` bytes aligned to `align`, or None: not an engine thread's request the
/// reserve can serve.
pub fn alloc(size: usize, align: usize) -> Option<*mut u8> {
    if START.load(Ordering::Acquire) == 0 || !crate::heap::on_engine_thread() {
        return None;
    }
    take(size, align)
}

/// After the C library refused one of tiermem's own threads a block (None: not one of ours, or
/// the reserve cannot serve it either). Under the OOM guard a full cgroup fails the system calls
/// that grow glibc's arenas instead of waiting, and a thread's first request creates its arena.
/// The engine registers its threads only once they run, and they allocate before that: Rust's
/// thread start itself has glibc allocate the thread's list of destructors, and glibc aborts
/// when that is refused (with a message the full cgroup would not let through either). Seen in
/// one run of eight of a sort in a 6.2 MiB cgroup: SIGABRT 0.02 s after the start, no message.
/// So a thread named as tiermem names its threads counts as an engine thread here.
pub fn rescue(size: usize, align: usize) -> Option<*mut u8> {
    if START.load(Ordering::Acquire) == 0 || !(crate::heap::on_engine_thread() || named_as_ours()) {
        return None;
    }
    let block = take(size, align);
    if block.is_some() {
        RESCUES.fetch_add(1, Ordering::Relaxed);
    }
    block
}

/// Whether the calling thread's name starts with `tiermem-` (all of tiermem's threads do; the
/// name is set before the thread's start allocates anything). A system call: refused requests only.
fn named_as_ours() -> bool {
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes the name and its NUL, at most 16 bytes, into the buffer.
    let rc = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
    rc == 0 && name.starts_with(b"tiermem-")
}

/// Bytes ahead of a block handed out through the C functions (see [`rescue_c`]): its size
/// class, which `free` and `realloc`, given no size, need. 16 keeps malloc's alignment.
const C_HEADER: usize = 16;

/// [`rescue`] for a request through the C functions (malloc, calloc): the block carries its
/// size class in a header, for [`free_c`] and [`usable_c`].
pub fn rescue_c(size: usize) -> Option<*mut u8> {
    // At least a byte past the header: malloc(0) gets a block of its own too.
    let total = size.max(1).checked_add(C_HEADER)?;
    let class = class_of(total, C_HEADER)?;
    let block = rescue(total, C_HEADER)?;
    // SAFETY: the block holds at least `total` bytes, C_HEADER-aligned; the header is its first word.
    unsafe { (block as *mut usize).write(class) };
    // SAFETY: within the block (total > C_HEADER).
    Some(unsafe { block.add(C_HEADER) })
}

/// The header's size class of a block [`rescue_c`] returned.
///
/// # Safety
/// `ptr` must be such a block, still live.
unsafe fn class_c(ptr: *mut u8) -> usize {
    let header = ptr.wrapping_sub(C_HEADER) as *const usize;
    // SAFETY: the header sits C_HEADER bytes before the pointer handed out (the caller's contract).
    unsafe { header.read() }
}

/// Bytes usable at a block [`rescue_c`] returned.
///
/// # Safety
/// As [`class_c`].
pub unsafe fn usable_c(ptr: *mut u8) -> usize {
    // SAFETY: the caller's contract.
    (1usize << (unsafe { class_c(ptr) } as u32 + MIN_SHIFT)) - C_HEADER
}

/// Give back a block [`rescue_c`] returned.
///
/// # Safety
/// As [`class_c`]; not used afterwards.
pub unsafe fn free_c(ptr: *mut u8) {
    // SAFETY: the caller's contract.
    let class = unsafe { class_c(ptr) };
    // SAFETY: the block starts at its header and is given up.
    unsafe { free_class(ptr.wrapping_sub(C_HEADER), class) };
}

/// A block for `size` bytes aligned to `align` from the free lists or the untouched rest.
fn take(size: usize, align: usize) -> Option<*mut u8> {
    let class = class_of(size, align)?;
    let block = 1usize << (class as u32 + MIN_SHIFT);
    let _locked = Locked::take();
    let head = FREE[class].load(Ordering::Relaxed);
    if head != 0 {
        // SAFETY: a free block of this class holds its successor's address in its first word
        // (written by `free`), and lies inside the reserve, which is never unmapped.
        let next = unsafe { (head as *const usize).read() };
        FREE[class].store(next, Ordering::Relaxed);
        return Some(head as *mut u8);
    }
    // Blocks are aligned to their size up to a page, which covers every alignment they serve.
    let at = BUMP.load(Ordering::Relaxed).next_multiple_of(block.min(tiermem_sys::PAGE_SIZE));
    if at + block > END.load(Ordering::Relaxed) {
        return None;
    }
    BUMP.store(at + block, Ordering::Relaxed);
    USED_BYTES.store((at + block - START.load(Ordering::Relaxed)) as u64, Ordering::Relaxed);
    Some(at as *mut u8)
}

/// After the C library served an engine thread's request the reserve did not (too large, or
/// the reserve used up): make the block resident now, while that can fail instead of wait.
/// (Seen: the replacement policy's table of recent victims, 544 KiB, allocated at a budget
/// change and touched page by page on the reclaim path.)
pub fn after_fallback(ptr: *mut u8, size: usize) {
    if ptr.is_null() || START.load(Ordering::Acquire) == 0 || !crate::heap::on_engine_thread() {
        return;
    }
    FALLBACKS.fetch_add(1, Ordering::Relaxed);
    let page = tiermem_sys::PAGE_SIZE;
    let start = ptr as usize / page * page;
    let end = (ptr as usize + size).next_multiple_of(page);
    // SAFETY: populating pages that hold (part of) a live allocation changes no contents; a
    // failure (no memory now) leaves them to fault in later, as they would have anyway.
    let _ = unsafe {
        rustix::mm::madvise(start as *mut std::ffi::c_void, end - start, rustix::mm::Advice::LinuxPopulateWrite)
    };
}

/// Whether `ptr` is a block of the reserve.
pub fn owns(ptr: *mut u8) -> bool {
    // START first: `arm` publishes it last, so a reader that sees it sees END too. Read the
    // other way round, a call racing the arming (C `free` asks this of every pointer) could see
    // END and a START of 0, and take any pointer below END for a block of the reserve.
    let start = START.load(Ordering::Acquire);
    let p = ptr as usize;
    start != 0 && p >= start && p < END.load(Ordering::Acquire)
}

/// Give back a block [`alloc`] returned for `size` and `align`.
///
/// # Safety
/// `ptr` must be such a block, not used afterwards.
pub unsafe fn free(ptr: *mut u8, size: usize, align: usize) {
    let Some(class) = class_of(size, align) else { return };
    // SAFETY: the caller's contract.
    unsafe { free_class(ptr, class) };
}

/// Put a block of size class `class` on its free list.
///
/// # Safety
/// `ptr` must be a block of the reserve of that class, not used afterwards.
unsafe fn free_class(ptr: *mut u8, class: usize) {
    let _locked = Locked::take();
    // SAFETY: the caller gives the block up; its first word now links the free list.
    unsafe { (ptr as *mut usize).write(FREE[class].load(Ordering::Relaxed)) };
    FREE[class].store(ptr as usize, Ordering::Relaxed);
}

/// The size of the block that serves a request (a realloc within it needs no copy).
pub fn block_size(size: usize, align: usize) -> Option<usize> {
    class_of(size, align).map(|c| 1usize << (c as u32 + MIN_SHIFT))
}

/// In a forked child: the lock may have been held by an engine thread, which is not there.
pub fn after_fork_in_child() {
    LOCK.store(false, Ordering::Release);
}

/// The top of each engine thread's stack, made resident under the OOM guard: a thread that
/// grows its stack into a new page while the cgroup is full would wait for memory it is
/// the one to free. Measured without the guard (quicksort quick at a 12 MiB budget): 8–36 KiB
/// of each engine thread's stack in use; 64 KiB keeps room above that (128 KiB did before,
/// 2026-11-27, charged to the cgroup for nothing).
const STACK_BYTES: usize = 64 << 10;

/// Make the top [`STACK_BYTES`] of a thread's stack resident (populated by a system call, which
/// fails rather than waits when the cgroup is full).
pub fn populate_stack(thread: u64) -> Result<(), String> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: `thread` is a live thread of this process (an engine thread, never joined while
    // the engine runs); glibc fills `attr`, destroyed below.
    let rc = unsafe { libc::pthread_getattr_np(thread as libc::pthread_t, attr.as_mut_ptr()) };
    if rc != 0 {
        return Err(format!("cannot find an engine thread's stack: {}", std::io::Error::from_raw_os_error(rc)));
    }
    let (mut base, mut size) = (std::ptr::null_mut(), 0usize);
    // SAFETY: attr was initialised by pthread_getattr_np; base and size are out-parameters.
    let rc = unsafe { libc::pthread_attr_getstack(attr.as_ptr(), &mut base, &mut size) };
    // SAFETY: attr was initialised by pthread_getattr_np and is not used afterwards.
    unsafe { libc::pthread_attr_destroy(attr.as_mut_ptr()) };
    if rc != 0 {
        return Err(format!("cannot read an engine thread's stack: {}", std::io::Error::from_raw_os_error(rc)));
    }
    let top = base as usize + size;
    let start = top.saturating_sub(STACK_BYTES).max(base as usize) / tiermem_sys::PAGE_SIZE * tiermem_sys::PAGE_SIZE;
    // SAFETY: populating pages of the thread's own stack mapping changes no contents.
    let populated = unsafe {
        rustix::mm::madvise(start as *mut std::ffi::c_void, top - start, rustix::mm::Advice::LinuxPopulateWrite)
    };
    populated.map_err(|e| format!("cannot make an engine thread's stack resident: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one test that arms the reserve (it is process-wide, armed once): blocks come from
    /// inside it, aligned to their size, only for engine threads; a freed block is handed out
    /// again; a used-up reserve declines.
    #[test]
    fn engine_threads_get_aligned_reused_blocks_until_the_reserve_is_used_up() {
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() } as u64;
        assert!(alloc(64, 8).is_none(), "served before the reserve was armed");
        arm(64 << 10).expect("arming the reserve");
        let other = std::thread::spawn(|| alloc(64, 8).is_none()).join().unwrap();
        assert!(other, "served a thread that is not the engine's");
        // A refused request: rescued for a thread named as tiermem's (not registered yet),
        // never for another; a C block carries its class for free and malloc_usable_size.
        let unnamed = std::thread::spawn(|| rescue_c(24).is_none()).join().unwrap();
        assert!(unnamed, "rescued a thread that is not tiermem's");
        let named = std::thread::Builder::new().name("tiermem-test".into()).spawn(|| {
            let block = rescue_c(24).expect("a rescued block for a tiermem thread");
            assert!(owns(block));
            assert_eq!(block as usize % 16, 0, "malloc's alignment");
            // SAFETY: a live block rescue_c returned.
            let usable = unsafe { usable_c(block) };
            assert_eq!(usable, 64 - C_HEADER, "24 bytes and the header in a 64-byte block");
            // SAFETY: the usable bytes are the caller's.
            unsafe { std::ptr::write_bytes(block, 0xa5, usable) };
            // SAFETY: a live block rescue_c returned, given up.
            unsafe { free_c(block) };
            assert_eq!(rescue_c(20), Some(block), "the freed block of that class comes back");
            block as usize
        });
        named.unwrap().join().unwrap();
        assert!(RESCUES.load(Ordering::Relaxed) >= 2);
        assert!(crate::heap::register_engine_threads(&[me]));
        let a = alloc(24, 8).expect("a small block");
        let b = alloc(4000, 64).expect("a page-sized block");
        assert!(owns(a) && owns(b));
        assert_eq!(a as usize % 32, 0, "a 32-byte block aligned to its size");
        assert_eq!(b as usize % 4096, 0, "a 4 KiB block aligned to its size");
        assert!(alloc((1 << 16) + 1, 8).is_none(), "larger than the largest block");
        // SAFETY: `a` is a block of this layout, not used again.
        unsafe { free(a, 24, 8) };
        assert_eq!(alloc(30, 16), Some(a), "the freed block of that size comes back first");
        let mut taken = 0;
        while alloc(4096, 8).is_some() {
            taken += 1;
            assert!(taken <= 16, "more 4 KiB blocks than 64 KiB hold");
        }
        assert!(taken >= 10, "only {taken} 4 KiB blocks from a 64 KiB reserve");
        assert!(USED_BYTES.load(Ordering::Relaxed) <= 64 << 10);
        // This thread's own Rust allocations now go through the reserve too (the crate's global
        // allocator): with the reserve used up, this vector is already a counted fallback.
        let mut spill = vec![0u8; 8192];
        let before = FALLBACKS.load(Ordering::Relaxed);
        assert!(before >= 1, "the vector, allocated with the reserve used up, was not counted");
        after_fallback(spill.as_mut_ptr(), spill.len());
        assert_eq!(FALLBACKS.load(Ordering::Relaxed), before + 1, "a fallback of an engine thread is counted");
    }

    #[test]
    fn size_classes_cover_size_and_alignment() {
        assert_eq!(class_of(1, 1), Some(0));
        assert_eq!(class_of(16, 8), Some(0));
        assert_eq!(class_of(17, 8), Some(1));
        assert_eq!(class_of(24, 64), Some(2));
        assert_eq!(class_of(1 << 16, 8), Some(CLASSES - 1));
        assert_eq!(class_of((1 << 16) + 1, 8), None);
        assert_eq!(block_size(100, 8), Some(128));
        // Blocks are aligned to at most a page: a larger alignment is not served here.
        assert_eq!(class_of(4096, 4096), Some(8));
        assert_eq!(class_of(16, 8192), None);
    }
}
