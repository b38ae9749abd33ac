//! The small-object heap: the program's allocations below the threshold, served from managed
//! chunks by a TLSF allocator (rlsf), so a program made of many small objects (a Python or Java
//! runtime, a hash table of strings) pages like one made of big arrays instead of pinning its
//! heap in memory.
//!
//! - Chunks are engine regions (4 MiB first, then as large as that kind's chunks so far, up to
//!   256 MiB), of one of two kinds: blocks of at most 1 KiB come from slabs ([`crate::slab`]:
//!   one size class a page, no header, never across a page boundary), larger ones from one
//!   TLSF pool. By size class, the tiny objects a program walks on every lookup (hash-table
//!   entries, object headers, short keys) pack densely into pages that stay hot, instead of
//!   each sitting next to a kilobyte payload that goes cold (jemalloc's size classes do the
//!   same). Every block is 16-byte aligned
//!   (malloc's guarantee); requests for a larger alignment go to the C library, so a pointer is
//!   freed without knowing its alignment.
//! - Only program threads use it. The engine's own threads (which serve faults and must never
//!   take one) and anything allocated while the engine starts go to the C library, as does
//!   everything in a forked child. Chunks are kernel regions
//!   ([`tiermem_engine::Engine::create_kernel_region`]): in sigbus fault mode, where the kernel
//!   cannot wait for a missing page of an ordinary region, a handler thread serves theirs, since
//!   glibc's own read/write calls on stdio buffers (which live here) are not ours to wrap.
//! - One lock: a program thread may fault while holding it; the fault is served by a handler
//!   thread, which never takes it. A request from the thread that holds it (the shim's own code
//!   reaching malloc while inside the heap, or around fork) goes to the C library instead of
//!   waiting for itself.

use std::alloc::Layout;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use tiermem_engine::Region;
use tiermem_sys::PAGE_SIZE;

use crate::slab::{self, BadBlock, Slabs};

type Pools = rlsf::Tlsf<'static, u32, u32, 24, 16>;

/// malloc's alignment on x86-64; every heap block has it.
const ALIGN: usize = 16;
const FIRST_CHUNK: usize = 4 << 20;
/// Chunk kinds ([`chunk_of`]).
const SLAB_CHUNK: usize = 0;
const TLSF_CHUNK: usize = 1;
const LARGEST_CHUNK: usize = 256 << 20;
/// Chunks the fast pointer check knows; the heap stops growing there (and the C library serves).
const MAX_CHUNKS: usize = 64;
/// Engine threads recognised (completion, reclaim, monitor, DAMON, handlers, the cgroup watch).
const MAX_ENGINE_THREADS: usize = 16;

pub struct Heap {
    /// Blocks above [`slab::MAX_SIZE`].
    pools: Pools,
    /// Blocks of at most [`slab::MAX_SIZE`].
    slabs: Slabs,
    /// Keeps the chunks' regions alive for the life of the process, with their kind.
    chunks: Vec<(Region, usize)>,
}

// SAFETY: the TLSF structure holds raw pointers into chunks this heap owns for the life of the
// process; it is only reached under HEAP's lock.
unsafe impl Send for Heap {}

static HEAP: Mutex<Heap> = Mutex::new(Heap { pools: Pools::new(), slabs: Slabs::new(), chunks: Vec::new() });
static ENABLED: AtomicBool = AtomicBool::new(false);
/// Chunk bounds for `contains`, published before a chunk's first block is handed out.
static CHUNK_START: [AtomicUsize; MAX_CHUNKS] = [const { AtomicUsize::new(0) }; MAX_CHUNKS];
static CHUNK_END: [AtomicUsize; MAX_CHUNKS] = [const { AtomicUsize::new(0) }; MAX_CHUNKS];
static CHUNK_COUNT: AtomicUsize = AtomicUsize::new(0);
/// Each chunk's kind (slab or TLSF), published with its bounds.
static CHUNK_KIND: [AtomicUsize; MAX_CHUNKS] = [const { AtomicUsize::new(0) }; MAX_CHUNKS];
static LOWEST: AtomicUsize = AtomicUsize::new(usize::MAX);
static HIGHEST: AtomicUsize = AtomicUsize::new(0);
static ENGINE_THREADS: [AtomicU64; MAX_ENGINE_THREADS] = [const { AtomicU64::new(0) }; MAX_ENGINE_THREADS];
static ENGINE_THREAD_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Heap allocations made (for the statistics).
pub static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Bytes of chunks the heap holds.
pub static CHUNK_BYTES: AtomicU64 = AtomicU64::new(0);
/// Evicted pages of freed blocks given up (see [`forget_dead`]).
pub static DEAD_PAGES_FORGOTTEN: AtomicU64 = AtomicU64::new(0);

/// The thread holding the heap's lock (0: none). A request from that thread (the shim's own
/// code reaching malloc while it holds the lock) goes to the C library instead of deadlocking.
static HOLDER: AtomicU64 = AtomicU64::new(0);

fn this_thread() -> u64 {
    // SAFETY: pthread_self has no preconditions and reads only the thread register.
    unsafe { libc::pthread_self() as u64 }
}

/// The heap, locked; the holder is recorded until the guard goes.
pub struct HeapGuard(MutexGuard<'static, Heap>);

impl Drop for HeapGuard {
    fn drop(&mut self) {
        HOLDER.store(0, Ordering::Release);
    }
}

impl std::ops::Deref for HeapGuard {
    type Target = Heap;
    fn deref(&self) -> &Heap {
        &self.0
    }
}

impl std::ops::DerefMut for HeapGuard {
    fn deref_mut(&mut self) -> &mut Heap {
        &mut self.0
    }
}

fn lock() -> HeapGuard {
    let guard = HEAP.lock().unwrap_or_else(|e| e.into_inner());
    HOLDER.store(this_thread(), Ordering::Release);
    HeapGuard(guard)
}

/// Record the engine's threads (POSIX thread ids): their requests never get managed memory
/// (see [`on_engine_thread`]). False if there are more than this heap can tell apart.
pub fn register_engine_threads(engine_threads: &[u64]) -> bool {
    for &id in engine_threads {
        let i = ENGINE_THREAD_COUNT.fetch_add(1, Ordering::AcqRel);
        if i >= MAX_ENGINE_THREADS {
            return false;
        }
        ENGINE_THREADS[i].store(id, Ordering::Release);
    }
    true
}

/// Start serving small allocations, once [`register_engine_threads`] has recorded them all.
pub fn enable() {
    ENABLED.store(true, Ordering::Release);
}

/// Whether the calling thread is one of the engine's.
pub fn on_engine_thread() -> bool {
    let this = this_thread();
    let n = ENGINE_THREAD_COUNT.load(Ordering::Acquire).min(MAX_ENGINE_THREADS);
    ENGINE_THREADS[..n].iter().any(|t| t.load(Ordering::Relaxed) == this)
}

/// Stop serving new allocations (a forked child); frees of heap blocks keep working.
pub fn disable() {
    ENABLED.store(false, Ordering::Release);
}

fn on_engine_thread_or_holder() -> bool {
    HOLDER.load(Ordering::Acquire) == this_thread() || on_engine_thread()
}

/// Whether this request should come from the heap.
fn serves_here(align: usize) -> bool {
    align <= ALIGN && ENABLED.load(Ordering::Acquire) && !on_engine_thread_or_holder()
}

/// Whether `ptr` is a heap block (false is certain for anything outside every chunk).
pub fn contains(ptr: usize) -> bool {
    chunk_of(ptr).is_some()
}

/// Start and end of the chunk (a managed region) holding `ptr`.
pub fn chunk_bounds(ptr: usize) -> Option<(usize, usize)> {
    chunk_of(ptr).map(|(start, end, _)| (start, end))
}

/// The lowest start of a chunk beginning inside `[from, to)`.
pub fn first_chunk_start_in(from: usize, to: usize) -> Option<usize> {
    if to <= LOWEST.load(Ordering::Acquire) || from >= HIGHEST.load(Ordering::Acquire) {
        return None;
    }
    (0..CHUNK_COUNT.load(Ordering::Acquire))
        .map(|i| CHUNK_START[i].load(Ordering::Acquire))
        .filter(|&start| from <= start && start < to)
        .min()
}

/// The bounds and kind of the chunk holding `ptr`.
fn chunk_of(ptr: usize) -> Option<(usize, usize, usize)> {
    if ptr < LOWEST.load(Ordering::Acquire) || ptr >= HIGHEST.load(Ordering::Acquire) {
        return None;
    }
    let n = CHUNK_COUNT.load(Ordering::Acquire);
    (0..n)
        .map(|i| {
            (
                CHUNK_START[i].load(Ordering::Acquire),
                CHUNK_END[i].load(Ordering::Acquire),
                CHUNK_KIND[i].load(Ordering::Acquire),
            )
        })
        .find(|&(start, end, _)| start <= ptr && ptr < end)
}

/// The kind of chunk a request of `size` bytes comes from.
fn kind_of(size: usize) -> usize {
    if size <= slab::MAX_SIZE {
        SLAB_CHUNK
    } else {
        TLSF_CHUNK
    }
}

/// The kind of chunk holding `ptr`; stops the program, naming `what`, when no chunk does.
fn kind_of_block(ptr: usize, what: &str) -> usize {
    match chunk_of(ptr) {
        Some((_, _, kind)) => kind,
        None => never_returned(what),
    }
}

/// Stop the program over a pointer `what` was given that no heap block starts at.
fn never_returned(what: &str) -> ! {
    crate::runtime::die(&["tiermem: ", what, "() of a pointer the small-object heap never returned"])
}

/// Stop the program over a slab block the program has no right to pass.
fn bad_slab_block(what: &str, bad: BadBlock) -> ! {
    match bad {
        BadBlock::Free if what == "free" => {
            crate::runtime::die(&["tiermem: free(): double free of a small-heap block"])
        }
        BadBlock::Free => crate::runtime::die(&["tiermem: ", what, "() of a freed small-heap block"]),
        BadBlock::Unknown => never_returned(what),
    }
}

/// A block of at least `size` bytes, or None when the heap does not serve this request (the
/// caller asks the C library).
pub fn alloc(size: usize, align: usize) -> Option<*mut c_void> {
    if !serves_here(align) {
        return None;
    }
    let layout = Layout::from_size_align(size.max(1), ALIGN).ok()?;
    let mut heap = lock();
    let block = if kind_of(layout.size()) == SLAB_CHUNK {
        match heap.slabs.alloc(layout.size()) {
            Some(addr) => addr,
            None => {
                grow(&mut heap, SLAB_CHUNK, layout.size())?;
                heap.slabs.alloc(layout.size())?
            }
        }
    } else {
        let block = match heap.pools.allocate(layout) {
            Some(block) => block,
            None => {
                grow(&mut heap, TLSF_CHUNK, layout.size())?;
                heap.pools.allocate(layout)?
            }
        };
        block.as_ptr() as usize
    };
    drop(heap);
    ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    Some(block as *mut c_void)
}

/// Add a chunk of `kind` that can hold `size` more bytes. None when the engine cannot give one.
fn grow(heap: &mut HeapGuard, kind: usize, size: usize) -> Option<()> {
    let index = CHUNK_COUNT.load(Ordering::Acquire);
    // Disabled: a forked child, whose engine (left in the parent) must not be used.
    if index == MAX_CHUNKS || !ENABLED.load(Ordering::Acquire) {
        return None;
    }
    let engine = crate::runtime::running_engine()?;
    // Room for the block, its header and the pool's own sentinel.
    let held: usize = heap.chunks.iter().filter(|(_, k)| *k == kind).map(|(r, _)| r.len()).sum();
    let len = held.clamp(FIRST_CHUNK, LARGEST_CHUNK).max(size.checked_add(4096)?.next_multiple_of(4096));
    // A kernel region: glibc's own system calls read and write stdio buffers kept here, which
    // the shim does not wrap, so in sigbus mode a handler thread serves this memory's faults.
    let region = engine.create_kernel_region(len).ok()?;
    let (start, len) = (region.as_ptr() as usize, region.len());
    CHUNK_START[index].store(start, Ordering::Release);
    CHUNK_END[index].store(start + len, Ordering::Release);
    CHUNK_KIND[index].store(kind, Ordering::Release);
    LOWEST.fetch_min(start, Ordering::AcqRel);
    HIGHEST.fetch_max(start + len, Ordering::AcqRel);
    CHUNK_COUNT.store(index + 1, Ordering::Release);
    if kind == SLAB_CHUNK {
        heap.slabs.add_chunk(start, len);
    } else {
        let pool = NonNull::slice_from_raw_parts(NonNull::new(start as *mut u8)?, len);
        // SAFETY: the chunk is a fresh region owned by the heap (kept in `chunks`) for the life
        // of the process, and no other pool covers it.
        unsafe { heap.pools.insert_free_block_ptr(pool) }?;
    }
    heap.chunks.push((region, kind));
    CHUNK_BYTES.fetch_add(len as u64, Ordering::Relaxed);
    Some(())
}

/// rlsf 0.2.2's block layout (the version is pinned): a block of alignment 16 has a two-word
/// header right before the pointer, whose first word is the block's size (a multiple of 32, as
/// blocks start 32-byte aligned) with bit 0 set while it is in use and bit 1 on the pool's
/// closing sentinel. Reading it makes a double or invalid free a clear stop instead of a
/// corrupted heap, as the C library's checks would have made it.
const HEADER: usize = 16;
const BLOCK_ALIGN: usize = 32;
const USED: usize = 1;
const SENTINEL: usize = 2;

/// The header of the live block at `ptr`; stops the program, naming `what`, when `ptr` is not
/// one (freed already, or never returned by the heap).
fn live_header(ptr: usize, what: &str) -> *mut usize {
    let Some((start, end, _)) = chunk_of(ptr) else {
        never_returned(what);
    };
    let header = ptr.wrapping_sub(HEADER);
    if ptr % BLOCK_ALIGN != HEADER || header < start {
        never_returned(what);
    }
    let word = header as *mut usize;
    // SAFETY: header..ptr lies inside a chunk (mapped for the life of the process) and is
    // word-aligned; a racing change can only come from a program already freeing the block
    // twice at once, which this check cannot make worse.
    let size_and_flags = unsafe { word.read_volatile() };
    let size = size_and_flags & !(BLOCK_ALIGN - 1);
    if size_and_flags & USED == 0 {
        let freed =
            if what == "free" { "(): double free of a small-heap block" } else { "() of a freed small-heap block" };
        crate::runtime::die(&["tiermem: ", what, freed]);
    }
    if size_and_flags & SENTINEL != 0 || size < BLOCK_ALIGN || size > end - header {
        never_returned(what);
    }
    word
}

/// Bytes of a free block's payload the pool keeps its free-list links in (rlsf 0.2.2's
/// `FreeBlockHdr`: two pointers after the two-word header).
const FREE_LINKS: usize = 16;

/// The end of the live block whose header is `word` (one [`live_header`] checked, or one the
/// pool has just returned), under the heap's lock.
fn block_end(word: *mut usize) -> usize {
    // SAFETY: a live block's header, inside a chunk mapped for the life of the process.
    word as usize + (unsafe { word.read_volatile() } & !(BLOCK_ALIGN - 1))
}

/// `[from, to)` of a chunk holds only freed memory, which the program may no longer read and the
/// pool never reads (its headers and links lie outside): the evicted pages wholly inside it are
/// given up, so reusing one maps zeros instead of reading garbage back, and its slot is free at
/// once. Resident pages are left alone (giving them back would cost a TLB shootdown a page). Not
/// in a forked child, whose engine is the parent's.
fn forget_dead(heap: &Heap, from: usize, to: usize) {
    if to.saturating_sub(from) < PAGE_SIZE || !ENABLED.load(Ordering::Acquire) {
        return;
    }
    let holding = heap.chunks.iter().map(|(region, _)| region).find(|region| {
        let start = region.as_ptr() as usize;
        (start..start + region.len()).contains(&from)
    });
    if let Some(region) = holding {
        let offset = from - region.as_ptr() as usize;
        let forgotten = region.forget_evicted_in(offset, to - from);
        DEAD_PAGES_FORGOTTEN.fetch_add(forgotten, Ordering::Relaxed);
    }
}

/// After a block was given back: when it merged into the free block before it, its old header
/// is left inside that block still marked used; clear it so a second free of the same pointer
/// is seen. (A header the pool rewrote as a free block's is not marked used.)
///
/// # Safety
/// `word` is the header of a block just freed, under the heap's lock, and no live block holds
/// that word (see [`overlaps_old_block`]).
unsafe fn forget_header(word: *mut usize) {
    // SAFETY: the caller's contract: a word of a chunk, under the heap's lock.
    let marked_used = unsafe { word.read_volatile() } & USED != 0;
    if marked_used {
        // SAFETY: a merged block's old header lies in the payload of a free block, which
        // nothing reads. (Within the first 32 bytes of a free block lie only its size, without
        // the used bit, and 16-byte-aligned links, so a word found marked used is never those.)
        unsafe { word.write_volatile(0) };
    }
}

/// Give a block back; stops the program on a double or invalid free.
///
/// # Safety
/// [`contains`] said `ptr` is inside the heap.
pub unsafe fn free(ptr: *mut c_void) {
    let Some(block) = NonNull::new(ptr.cast::<u8>()) else { return };
    let mut heap = lock();
    if kind_of_block(ptr as usize, "free") == SLAB_CHUNK {
        match heap.slabs.free(ptr as usize) {
            Ok(Some(page)) => forget_dead(&heap, page, page + PAGE_SIZE),
            Ok(None) => {}
            Err(bad) => bad_slab_block("free", bad),
        }
        return;
    }
    let word = live_header(ptr as usize, "free");
    let end = block_end(word);
    // SAFETY: a live block of the TLSF pool (checked above), allocated with ALIGN.
    unsafe { heap.pools.deallocate(block, ALIGN) };
    // SAFETY: its header, just freed, under the lock.
    unsafe { forget_header(word) };
    forget_dead(&heap, ptr as usize + FREE_LINKS, end);
}

/// Bytes usable at `ptr`; stops the program if it is not a live block.
///
/// # Safety
/// [`contains`] said `ptr` is inside the heap.
pub unsafe fn usable_size(ptr: *mut c_void) -> usize {
    let Some(block) = NonNull::new(ptr.cast::<u8>()) else { return 0 };
    if kind_of_block(ptr as usize, "malloc_usable_size") == SLAB_CHUNK {
        return lock().slabs.usable_size(ptr as usize).unwrap_or_else(|bad| bad_slab_block("malloc_usable_size", bad));
    }
    live_header(ptr as usize, "malloc_usable_size");
    // SAFETY: a live block of this heap (checked above); the size sits in its header.
    unsafe { Pools::allocation_usable_size(block) }
}

/// Resize a heap block, in place when it can be; None when the heap cannot hold the new size
/// or a block of that size comes from the other kind of chunk (the block is then untouched and
/// still live; the caller moves it). Stops the program if it is not a live block.
///
/// # Safety
/// [`contains`] said `ptr` is inside the heap; `size` is non-zero.
pub unsafe fn realloc(ptr: *mut c_void, size: usize) -> Option<*mut c_void> {
    let block = NonNull::new(ptr.cast::<u8>())?;
    let layout = Layout::from_size_align(size, ALIGN).ok()?;
    let mut heap = lock();
    if kind_of_block(ptr as usize, "realloc") == SLAB_CHUNK {
        let usable = heap.slabs.usable_size(ptr as usize).unwrap_or_else(|bad| bad_slab_block("realloc", bad));
        // A slab block keeps its place while the new size fits its class; else it moves.
        return (size <= usable).then_some(ptr);
    }
    let word = live_header(ptr as usize, "realloc");
    let old_end = block_end(word);
    if kind_of(layout.size()) == SLAB_CHUNK {
        // Shrunk to a slab size: moved to a slab, where it packs with its class.
        return None;
    }
    // SAFETY: a live block of the TLSF pool (checked above) allocated with ALIGN.
    let mut moved = unsafe { heap.pools.reallocate(block, layout) };
    if moved.is_none() {
        grow(&mut heap, TLSF_CHUNK, size)?;
        // SAFETY: as above; the failed attempt left the block as it was.
        moved = unsafe { heap.pools.reallocate(block, layout) };
    }
    let moved = moved?;
    if moved != block && !overlaps_old_block(moved.as_ptr() as usize, word as usize, old_end) {
        // SAFETY: the old block was freed by the move, under the lock, and no part of it is
        // the new block's.
        unsafe { forget_header(word) };
        forget_dead(&heap, ptr as usize + FREE_LINKS, old_end);
    }
    Some(moved.as_ptr().cast())
}

/// Whether the live block at `moved` (just returned by the pool's reallocate) lies partly where
/// the old block `[old_header, old_end)` was. rlsf moves a block that cannot grow where it is
/// down into the free block before it when the two together fit, copying the data down: the
/// old block is then mostly the new one's data, and its old header a word of that data.
fn overlaps_old_block(moved: usize, old_header: usize, old_end: usize) -> bool {
    let header = moved - HEADER;
    header < old_end && block_end(header as *mut usize) > old_header
}

/// Held across fork so the child never sees the heap half-changed.
pub fn lock_for_fork() -> HeapGuard {
    lock()
}
