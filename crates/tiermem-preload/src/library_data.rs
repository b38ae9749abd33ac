//! The writable data of the libraries the program loads, paged by the engine.
//!
//! A shared library's data segment (`.data`, `.bss`, the relocated GOT and `.data.rel.ro`) is a
//! private mapping of its file: every page written — by the dynamic linker's relocations or by
//! the library — becomes anonymous memory. Without swap nothing can evict it, so in a memory
//! cgroup it pins its share of the limit: CPython after importing scikit-learn holds 4.9 MiB of
//! it in 476 mappings of 214 libraries, a tenth of k-means' 20% cgroup, most of it touched once.
//! Here the runs of such pages (present and anonymous in /proc/self/pagemap; pages never written
//! stay the file's) are taken over: copied aside, replaced by an anonymous mapping at the same
//! address that the engine adopts as a region, and written back (all-zero pages are left to be
//! zero-filled); what RELRO had made read-only is made read-only again.
//!
//! Replacing memory another thread could write meanwhile would lose that write, so this is done
//! only while the program has one thread of its own (`stdio::program_single_threaded`), on that
//! thread, with its signals held, and only where it is in the shim outside the dynamic linker
//! (which maps and unmaps with its own system calls): after its `mmap`, before its `munmap` and
//! its `dlopen`. An object whose RELRO is not read-only yet (a signal handler's `mmap` that
//! interrupted the dynamic linker) waits for a later point. (Not `malloc`, which the dynamic
//! linker calls in the middle of loading and unloading: an object taken over there could be
//! unmapped by a `dlopen` that fails or a `dlclose`.) The C library, the dynamic linker, libm, the
//! unwinder and the shim (whose data the engine's own threads use) are left alone, as are the
//! program's own executable (its data lies next to the C library's heap) and a segment the
//! kernel does not map as its program headers say.
//!
//! When the program starts a thread of its own, every run goes back to the kernel (resident,
//! as before) and nothing is taken over again: threads wait on lock words in libraries' data,
//! and in `sigbus` mode a futex on an evicted page fails (see [`program_thread_coming`]).
//!
//! `dlopen` is entered through a jump that keeps the program's return address, so the C library
//! still sees the program as the caller (it searches the caller's RPATH and RUNPATH); the objects
//! a `dlopen` adds are taken over at the next of those points. At the program's first `dlclose`
//! everything goes back to the kernel and nothing is taken over again: the dynamic linker would
//! unmap an unloaded object's regions behind the engine's back.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use tiermem_sys::PAGE_SIZE;

use crate::registry::{self, Origin};
use crate::runtime;

/// Objects taken over or left alone for good, by load address.
static SEEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// A `dlopen` (or the engine's start) may have added objects not looked at yet.
static PENDING: AtomicBool = AtomicBool::new(false);
/// The program has called `dlclose`: nothing is taken over any more.
static STOPPED: AtomicBool = AtomicBool::new(false);
/// The program's thread is taking objects over.
static BUSY: AtomicBool = AtomicBool::new(false);
/// Runs of pages taken over (each a region) and their bytes (for the statistics).
pub static RUNS: AtomicU64 = AtomicU64::new(0);
pub static BYTES: AtomicU64 = AtomicU64::new(0);
/// Runs given back to the kernel when the program started a thread or called `dlclose`.
pub static RUNS_GIVEN_BACK: AtomicU64 = AtomicU64::new(0);
/// The runs taken over, each with the part of it that is read-only.
static ADOPTED: Mutex<Vec<Segment>> = Mutex::new(Vec::new());
/// Pages written back into them (not all-zero).
pub static PAGES_WITH_DATA: AtomicU64 = AtomicU64::new(0);
/// Segments left alone: mapped otherwise than their headers say, or refused by the engine.
pub static SEGMENTS_LEFT: AtomicU64 = AtomicU64::new(0);

/// The program's one thread (it started the engine): no other thread takes anything over (a
/// forked child's, say, or one of the engine's should it come through the shim's `mmap`).
static PROGRAM_THREAD: AtomicUsize = AtomicUsize::new(0);

/// The C library's `dlopen`, looked up at load.
static REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);

/// Libraries whose data the engine's own threads (or a SIGBUS handler) may touch: the C library
/// and its parts, the dynamic linker, the unwinder, and the shim itself.
const LEFT_ALONE: &[&str] =
    &["ld-linux", "ld64.so", "libc.so", "libm.so", "libpthread", "libdl.so", "librt.so", "libgcc_s", "libtiermem"];

/// A writable segment of a loaded object, in whole pages, and the part of it (if any) that is
/// read-only after relocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    start: usize,
    end: usize,
    read_only: Option<(usize, usize)>,
}

/// Look the C library's `dlopen` up (at load: the lookup may allocate).
pub(crate) fn resolve_real_dlopen() {
    // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the definition past the shim.
    let address = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlopen".as_ptr()) } as usize;
    REAL_DLOPEN.store(address, Ordering::Release);
}

/// The engine has started: the objects loaded so far are taken over at the next point where the
/// program's thread is in the shim (the start itself may be inside a malloc of the dynamic linker).
pub(crate) fn engine_started() {
    PROGRAM_THREAD.store(runtime::thread_id(), Ordering::Release);
    if wanted() {
        PENDING.store(true, Ordering::Release);
    }
}

fn wanted() -> bool {
    runtime::library_data_wanted() && crate::stdio::program_single_threaded() && !STOPPED.load(Ordering::Acquire)
}

/// A point where the program's thread is in the shim, outside the dynamic linker (after its
/// `mmap`, before its `munmap` and `dlopen`): take over what a `dlopen` (or the engine's start)
/// added since the last one.
pub(crate) fn at_safe_point() {
    if PENDING.load(Ordering::Acquire) {
        adopt_new_objects();
    }
}

/// Called by the `dlopen` entry before the C library's: objects added by an earlier `dlopen`
/// are taken over now, and those this one adds at the next safe point.
extern "C" fn before_dlopen() {
    at_safe_point();
    if wanted() && runtime::running_engine().is_some() {
        PENDING.store(true, Ordering::Release);
    }
}

type DlopenFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void;

/// The C library's `dlopen`, looked up now if it was not at load.
fn real_dlopen() -> DlopenFn {
    if REAL_DLOPEN.load(Ordering::Acquire) == 0 {
        resolve_real_dlopen();
    }
    let address = REAL_DLOPEN.load(Ordering::Acquire);
    if address == 0 {
        runtime::die(&["tiermem: the C library has no dlopen"]);
    }
    // SAFETY: dlsym found the C library's dlopen, which has this signature.
    unsafe { std::mem::transmute::<usize, DlopenFn>(address) }
}

/// `dlopen` with the C library's own not looked up yet (a constructor that ran before the
/// shim's): an ordinary call, the shim then being the caller.
///
/// # Safety
/// The C contract of dlopen.
unsafe extern "C" fn dlopen_unresolved(file: *const c_char, mode: c_int) -> *mut c_void {
    // SAFETY: the caller's arguments, passed on (the C contract of dlopen).
    unsafe { real_dlopen()(file, mode) }
}

/// # Safety
/// The C contract of dlopen.
///
/// The C library's `dlopen` is entered by a jump, so its return address (which it takes as the
/// caller, whose RPATH and RUNPATH it searches) is the program's.
#[cfg(target_arch = "x86_64")]
#[unsafe(no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        // The arguments kept; the stack aligned to 16 bytes for the call.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {before}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz {unresolved}",
        "jmp rax",
        before = sym before_dlopen,
        real = sym REAL_DLOPEN,
        unresolved = sym dlopen_unresolved,
    )
}

/// Take over the writable segments of the objects not looked at yet (see the module's notes).
fn adopt_new_objects() {
    if !wanted() || runtime::in_forked_child() {
        // For good: the program has threads now, or this is a forked child.
        PENDING.store(false, Ordering::Release);
        return;
    }
    if PROGRAM_THREAD.load(Ordering::Acquire) != runtime::thread_id() {
        return;
    }
    let Some(engine) = runtime::running_engine() else { return };
    // Not again from a signal handler that interrupted the program's thread here (its mmap).
    if BUSY.swap(true, Ordering::AcqRel) {
        return;
    }
    PENDING.store(false, Ordering::Release);
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let mut found = Found { seen: &seen, objects: Vec::new() };
    // SAFETY: the callback matches dl_iterate_phdr's type and `found` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each_object), (&raw mut found).cast()) };
    let objects = found.objects;
    for object in objects {
        if !object.relocated() {
            // Still being loaded (a signal handler's mmap interrupting the dynamic linker):
            // looked at again at the next point.
            PENDING.store(true, Ordering::Release);
            continue;
        }
        seen.push(object.base);
        for &segment in &object.segments {
            if adopt_segment(engine, segment).is_err() {
                SEGMENTS_LEFT.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    drop(seen);
    BUSY.store(false, Ordering::Release);
}

/// # Safety
/// The C contract of dlclose.
///
/// An object unloaded would have its regions unmapped by the dynamic linker behind the engine's
/// back, so at the program's first `dlclose` every run goes back to the kernel and nothing is
/// taken over again. (Making each object undeletable instead needs a `dlopen` from the shim,
/// which deadlocked: it holds the dynamic linker's lock while it faults, and the engine's new
/// threads wait for that lock to set up their thread-locals.)
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlclose(handle: *mut c_void) -> c_int {
    type DlcloseFn = unsafe extern "C" fn(*mut c_void) -> c_int;
    STOPPED.store(true, Ordering::Release);
    give_back_all();
    let real = crate::alloc::real!("dlclose", DlcloseFn);
    // SAFETY: the caller's handle, passed on (the C contract of dlclose).
    unsafe { real(handle) }
}

/// A loaded object not looked at yet.
struct Object {
    base: usize,
    segments: Vec<Segment>,
    /// The pages RELRO makes read-only once the object is relocated (None: none).
    relro: Option<(usize, usize)>,
}

impl Object {
    /// Whether the dynamic linker has finished relocating it: its RELRO is read-only (assumed
    /// for an object without one).
    fn relocated(&self) -> bool {
        let Some((start, end)) = self.relro else { return true };
        let mut vmas = [tiermem_sys::mem::Vma::default(); 4];
        let Ok(n) = tiermem_sys::mem::vmas(start, end, &mut vmas) else { return false };
        n > 0 && vmas[..n].iter().all(|v| v.prot & libc::PROT_WRITE == 0) && vmas[n - 1].end >= end
    }
}

struct Found<'a> {
    seen: &'a [usize],
    objects: Vec<Object>,
}

/// dl_iterate_phdr's callback: each object not seen before, with its writable segments.
unsafe extern "C" fn each_object(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the call.
    let info = unsafe { &*info };
    // SAFETY: `data` is the `Found` adopt_new_objects passed, alive and not otherwise used.
    let found = unsafe { &mut *data.cast::<Found>() };
    let base = info.dlpi_addr as usize;
    if found.seen.contains(&base) {
        return 0;
    }
    let name = if info.dlpi_name.is_null() {
        c""
    } else {
        // SAFETY: a loaded object's name, NUL-terminated, valid during the call.
        unsafe { CStr::from_ptr(info.dlpi_name) }
    };
    let text = name.to_str().unwrap_or("");
    let file = text.rsplit('/').next().unwrap_or(text);
    // SAFETY: dlpi_phdr points to dlpi_phnum program headers of the loaded object.
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    // The program itself too: its data lies next to the C library's heap, far below the
    // libraries, and a region there would widen the range every system call's buffer is
    // looked up in (`registry::may_overlap`) to take the heap in.
    let left_alone =
        text.is_empty() || LEFT_ALONE.iter().any(|prefix| file.starts_with(prefix)) || file.starts_with("linux-vdso");
    let segments = if left_alone { Vec::new() } else { writable_segments(base, headers) };
    let relro = segments.iter().find_map(|s| s.read_only);
    found.objects.push(Object { base, segments, relro });
    0
}

/// The object's writable loaded segments, in whole pages, each with the part of it RELRO covers.
fn writable_segments(base: usize, headers: &[libc::Elf64_Phdr]) -> Vec<Segment> {
    let page_down = |a: usize| a & !(PAGE_SIZE - 1);
    let page_up = |a: usize| a.next_multiple_of(PAGE_SIZE);
    // The dynamic linker makes RELRO read-only from its start's page to its end's page (the
    // last partial page stays writable).
    let relro = headers.iter().find(|h| h.p_type == libc::PT_GNU_RELRO).map(|h| {
        let start = base.wrapping_add(h.p_vaddr as usize);
        (page_down(start), page_down(start + h.p_memsz as usize))
    });
    headers
        .iter()
        .filter(|h| h.p_type == libc::PT_LOAD && h.p_flags & libc::PF_W != 0 && h.p_flags & libc::PF_X == 0)
        .filter(|h| h.p_memsz > 0)
        .map(|h| {
            let at = base.wrapping_add(h.p_vaddr as usize);
            let (start, end) = (page_down(at), page_up(at + h.p_memsz as usize));
            let read_only = relro.map(|(a, b)| (a.max(start), b.min(end))).filter(|(a, b)| a < b);
            Segment { start, end, read_only }
        })
        .collect()
}

/// Take over the pages of one segment that are anonymous memory already (written since the
/// library was loaded): each run of them is replaced with a managed region holding the same
/// contents. Pages never written stay the file's (page cache, droppable and charged to whoever
/// read them first), untouched ones stay unmapped. Ok: how many runs were taken over; Err: none
/// could be, the segment is as it was.
fn adopt_segment(engine: &'static tiermem_engine::Engine, segment: Segment) -> Result<u64, ()> {
    let Segment { start, end, read_only } = segment;
    let managed_there = || {
        registry::may_overlap(start, end - start)
            && !registry::overlapping(&registry::lock(), start, end - start).is_empty()
    };
    if !mapped_as_headers_say(start, end) || managed_there() {
        return Err(());
    }
    let runs = anonymous_runs(start, end).ok_or(())?;
    let mut adopted = 0;
    for (from, to) in runs {
        adopt_run(engine, from, to)?;
        let read_only = read_only.map(|(a, b)| (a.max(from), b.min(to))).filter(|(a, b)| a < b);
        if let Some((a, b)) = read_only {
            crate::mmap::protect(a, b - a, libc::PROT_READ);
        }
        ADOPTED.lock().unwrap_or_else(|e| e.into_inner()).push(Segment { start: from, end: to, read_only });
        adopted += 1;
    }
    Ok(adopted)
}

/// Pagemap bits: present, and file-backed or shared (clear for a private page written since).
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE: u64 = 1 << 61;

/// The runs of present anonymous pages in `[start, end)`, from /proc/self/pagemap.
fn anonymous_runs(start: usize, end: usize) -> Option<Vec<(usize, usize)>> {
    use rustix::fs::{Mode, OFlags};
    let pagemap = rustix::fs::open("/proc/self/pagemap", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).ok()?;
    let pages = (end - start) / PAGE_SIZE;
    let mut entries = vec![0u64; pages];
    // SAFETY: u64s are plain bytes; the slice covers the vector exactly.
    let bytes = unsafe { std::slice::from_raw_parts_mut(entries.as_mut_ptr().cast::<u8>(), pages * 8) };
    let mut done = 0;
    while done < bytes.len() {
        let offset = (start / PAGE_SIZE * 8 + done) as u64;
        match rustix::io::pread(&pagemap, &mut bytes[done..], offset) {
            Ok(0) | Err(_) => return None,
            Ok(n) => done += n,
        }
    }
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (k, entry) in entries.iter().enumerate() {
        if entry & PM_PRESENT == 0 || entry & PM_FILE != 0 {
            continue;
        }
        let page = start + k * PAGE_SIZE;
        match runs.last_mut() {
            Some((_, to)) if *to == page => *to += PAGE_SIZE,
            _ => runs.push((page, page + PAGE_SIZE)),
        }
    }
    Some(runs)
}

/// Replace `[start, end)` (whole pages, mapped readable) with a managed region holding the same
/// contents. Err: left as it was, or with its contents in plain anonymous memory.
fn adopt_run(engine: &'static tiermem_engine::Engine, start: usize, end: usize) -> Result<(), ()> {
    let len = end - start;
    // The contents, aside.
    let aside = map_anonymous(0, len, 0);
    if aside < 0 {
        return Err(());
    }
    let aside = aside as usize;
    // No handler of the program's may write the run between the copy and the write-back (a
    // flag set by a signal handler would be lost).
    let result = crate::signals::holding_signals(|| replace_run(engine, start, end, aside));
    crate::io::sys!(libc::SYS_munmap, aside, len);
    result
}

/// [`adopt_run`] with `aside` a mapping of the run's length: copy, replace, adopt, write back.
fn replace_run(engine: &'static tiermem_engine::Engine, start: usize, end: usize, aside: usize) -> Result<(), ()> {
    let len = end - start;
    // SAFETY: both ranges are mapped and readable (checked by the caller; `aside` just made),
    // `len` bytes, and do not overlap; the program's one thread is here, so nothing writes there.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, aside as *mut u8, len) };
    let replaced = map_anonymous(start, len, libc::MAP_FIXED);
    if replaced as usize != start {
        // A failed MAP_FIXED may have unmapped the range already: the library's data is gone.
        if !mapped_as_headers_say(start, end) {
            runtime::die(&["tiermem: a library's data could not be mapped again after it was copied aside"]);
        }
        return Err(());
    }
    let adopted = {
        let mut table = registry::lock_clear_of(start, end);
        // SAFETY: fresh private anonymous read-write memory just mapped, no page holding data,
        // which no region holds (checked by the caller, under the program's one thread).
        match unsafe { engine.adopt_region(start as *mut u8, len) } {
            Ok(region) => {
                registry::insert(&mut table, registry::Entry::new(region, start, len, Origin::Mmap));
                true
            }
            Err(_) => false,
        }
    };
    // Written back whether managed or not (a refused adoption leaves plain anonymous memory,
    // which still must hold the library's data): all-zero pages need no write.
    for page in (0..len).step_by(PAGE_SIZE) {
        // SAFETY: `aside + page` is a whole page of the copy.
        let words = unsafe { std::slice::from_raw_parts((aside + page) as *const u64, PAGE_SIZE / 8) };
        if words.iter().any(|&w| w != 0) {
            // SAFETY: both are whole pages, mapped read-write, not overlapping.
            unsafe { std::ptr::copy_nonoverlapping(words.as_ptr(), (start + page) as *mut u64, PAGE_SIZE / 8) };
            if adopted {
                PAGES_WITH_DATA.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if !adopted {
        return Err(());
    }
    RUNS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(len as u64, Ordering::Relaxed);
    runtime::LIVE_MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
    Ok(())
}

/// The program is about to start a thread of its own (`stdio`'s watch, before the thread
/// exists): every run taken over goes back to the kernel, resident, as it was before. Threads
/// wait on lock words in libraries' data (OpenBLAS's thread pool keeps its own in `.bss`), and in
/// `sigbus` mode a futex on a page the engine has evicted fails with EFAULT, which glibc's locks
/// take as fatal; a program with one thread waits on no futex of its own.
pub(crate) fn program_thread_coming() {
    give_back_all();
}

/// Every run taken over goes back to the kernel (see [`program_thread_coming`], [`dlclose`]).
fn give_back_all() {
    PENDING.store(false, Ordering::Release);
    let runs = std::mem::take(&mut *ADOPTED.lock().unwrap_or_else(|e| e.into_inner()));
    // A forked child's copy of managed memory is the kernel's already.
    if runs.is_empty() || runtime::in_forked_child() {
        return;
    }
    let errno = runtime::errno();
    for run in runs {
        give_back(run);
    }
    runtime::set_errno(errno);
}

/// Replace a run taken over with plain anonymous memory holding the same contents.
fn give_back(run: Segment) {
    let Segment { start, end, read_only } = run;
    let len = end - start;
    let aside = map_anonymous(0, len, 0);
    if aside < 0 {
        runtime::die(&["tiermem: no memory to give a library's data back to the kernel"]);
    }
    let aside = aside as usize;
    crate::signals::holding_signals(|| {
        // SAFETY: the run is mapped readable (its evicted pages come back as this reads them),
        // `aside` just made; `len` bytes, not overlapping; the program's one thread is here.
        unsafe { std::ptr::copy_nonoverlapping(start as *const u8, aside as *mut u8, len) };
        // The program's own munmap path: the registry lets the region go and the engine with it.
        // SAFETY: the run is a whole managed mapping of ours, unmapped whole.
        unsafe { crate::mmap::munmap(start as *mut c_void, len) };
        if map_anonymous(start, len, libc::MAP_FIXED) as usize != start {
            runtime::die(&["tiermem: a library's data could not be mapped again when the program started a thread"]);
        }
        // SAFETY: both are `len` bytes, mapped read-write, not overlapping.
        unsafe { std::ptr::copy_nonoverlapping(aside as *const u8, start as *mut u8, len) };
        if let Some((a, b)) = read_only {
            crate::io::sys!(libc::SYS_mprotect, a, b - a, libc::PROT_READ);
        }
    });
    crate::io::sys!(libc::SYS_munmap, aside, len);
    RUNS_GIVEN_BACK.fetch_add(1, Ordering::Relaxed);
}

/// A private anonymous read-write mapping of `len` bytes at `at` (a hint, or the place with
/// MAP_FIXED in `flags`), by the system call itself; refused for want of kernel memory in a full
/// cgroup, room is made and the call tried again. The call's result.
fn map_anonymous(at: usize, len: usize, flags: i32) -> isize {
    crate::io::retrying_refused(|| {
        crate::io::sys!(
            libc::SYS_mmap,
            at,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1i32,
            0usize
        )
    })
}

/// Whether `[start, end)` is mapped without holes, private, not executable.
fn mapped_as_headers_say(start: usize, end: usize) -> bool {
    let mut vmas = [tiermem_sys::mem::Vma::default(); 8];
    let Ok(n) = tiermem_sys::mem::vmas(start, end, &mut vmas) else { return false };
    let vmas = &vmas[..n];
    if n == 0 || n == vmas.len() && vmas[n - 1].end < end {
        return false;
    }
    let mut at = start;
    for vma in vmas {
        if vma.start > at || vma.shared || vma.prot & libc::PROT_EXEC != 0 || vma.prot & libc::PROT_READ == 0 {
            return false;
        }
        at = vma.end;
    }
    at >= end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(p_type: u32, p_flags: u32, p_vaddr: u64, p_memsz: u64) -> libc::Elf64_Phdr {
        libc::Elf64_Phdr { p_type, p_flags, p_offset: 0, p_vaddr, p_paddr: 0, p_filesz: 0, p_memsz, p_align: 4096 }
    }

    #[test]
    fn anonymous_runs_are_the_written_pages_of_a_private_file_mapping() {
        use std::io::Write;
        let mut file = tempfile_in_tmp();
        file.write_all(&vec![7u8; 6 * PAGE_SIZE]).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let len = 6 * PAGE_SIZE;
        // SAFETY: a fresh private mapping of our own file.
        let at = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, 0)
        };
        assert_ne!(at, libc::MAP_FAILED);
        let base = at as usize;
        // Pages 0 and 1 written (anonymous copies), 2 only read (the file's), 3 untouched, 4 and
        // 5 written.
        for page in [0, 1, 4, 5] {
            // SAFETY: inside the mapping, writable.
            unsafe { *((base + page * PAGE_SIZE) as *mut u8) = 1 };
        }
        // SAFETY: inside the mapping, readable.
        assert_eq!(unsafe { std::ptr::read_volatile((base + 2 * PAGE_SIZE) as *const u8) }, 7);
        let runs = anonymous_runs(base, base + len).unwrap();
        assert_eq!(runs, vec![(base, base + 2 * PAGE_SIZE), (base + 4 * PAGE_SIZE, base + 6 * PAGE_SIZE)]);
        // SAFETY: our mapping, unmapped whole.
        unsafe { libc::munmap(at, len) };
    }

    /// A file in the temporary directory, deleted already (only its descriptor is used).
    fn tempfile_in_tmp() -> std::fs::File {
        let path = std::env::temp_dir().join(format!("tiermem-library-data-{}", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file
    }

    #[test]
    fn writable_segments_cover_whole_pages_and_relro_ends_at_its_last_whole_page() {
        let base = 0x7f00_0000_0000;
        let headers = [
            header(libc::PT_LOAD, libc::PF_R | libc::PF_X, 0, 0x5000),
            // .data.rel.ro and .got from 0x6d10, .data and .bss to 0x9340.
            header(libc::PT_LOAD, libc::PF_R | libc::PF_W, 0x6d10, 0x2630),
            header(libc::PT_GNU_RELRO, libc::PF_R, 0x6d10, 0x12f0),
        ];
        assert_eq!(
            writable_segments(base, &headers),
            vec![Segment { start: base + 0x6000, end: base + 0xa000, read_only: Some((base + 0x6000, base + 0x8000)) }]
        );
        // RELRO within one page is never made read-only: nothing to protect again.
        let small = [
            header(libc::PT_LOAD, libc::PF_R | libc::PF_W, 0x1100, 0x800),
            header(libc::PT_GNU_RELRO, 4, 0x1100, 0x100),
        ];
        assert_eq!(
            writable_segments(base, &small),
            vec![Segment { start: base + 0x1000, end: base + 0x2000, read_only: None }]
        );
        // Writable and executable, or empty: left alone.
        let odd = [
            header(libc::PT_LOAD, libc::PF_W | libc::PF_X, 0x1000, 0x1000),
            header(libc::PT_LOAD, libc::PF_W, 0x3000, 0),
        ];
        assert!(writable_segments(base, &odd).is_empty());
    }
}
