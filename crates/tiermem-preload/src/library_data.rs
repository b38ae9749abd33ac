//! The writable data of the libraries the program loads, paged by the engine.
//!
//! A shared library's data segment (`.data`, `.bss`, the relocated GOT and `.data.rel.ro`) is a
//! private mapping of its file: every page written — by the dynamic linker's relocations or by
//! the library — becomes anonymous memory. Without swap nothing can evict it, so in a memory
//! cgroup it pins its share of the limit: a Python program that imports scikit-learn holds about
//! 5 MiB of it over 476 mappings (214 libraries), a tenth of a 51 MiB limit, most of it touched
//! once at import. Here the engine takes such a segment over: its contents are copied aside, an
//! anonymous mapping replaces the library's at the same address, the engine adopts it as a region
//! and the contents are written back (all-zero pages are left to be zero-filled on first touch);
//! the part the dynamic linker made read-only after relocation (RELRO) is made read-only again.
//!
//! Replacing memory another thread could write meanwhile would lose that write, so this is done
//! only while the program has one thread of its own (`stdio::program_single_threaded`), and only
//! at points where the program's thread is in tiermem's code: when the engine starts, before each
//! `dlopen` and in `mmap`/`munmap` calls after one. The C library, the dynamic linker, the shim and
//! the unwinder (whose data the engine's own threads use) are left alone, as is a segment the
//! kernel does not map as the program headers say (private, not executable, without holes).
//!
//! `dlopen` is entered through a jump that keeps the program's return address, so the C library
//! still sees the program as the caller (it searches the caller's RPATH and RUNPATH); the objects
//! a `dlopen` adds are taken over at the next of those points. An object taken over is made
//! undeletable (RTLD_NODELETE): `dlclose` would unmap its regions behind the engine's back, so it
//! stays loaded, with its state, after the program's last `dlclose` of it.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use tiermem_sys::PAGE_SIZE;

use crate::registry::{self, Origin};
use crate::runtime;

/// Objects taken over or left alone for good, by load address.
static SEEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// A `dlopen` (or the engine's start) may have added objects not looked at yet.
static PENDING: AtomicBool = AtomicBool::new(false);
/// Runs of pages taken over (each a region) and their bytes (for the statistics).
pub static SEGMENTS: AtomicU64 = AtomicU64::new(0);
pub static BYTES: AtomicU64 = AtomicU64::new(0);
/// Pages written back into them (not all-zero).
pub static PAGES_WITH_DATA: AtomicU64 = AtomicU64::new(0);
/// Segments left alone: mapped otherwise than their headers say, or refused by the engine.
pub static SEGMENTS_LEFT: AtomicU64 = AtomicU64::new(0);

/// The program's one thread (it started the engine): the engine's threads come through the shim's
/// `mmap` too, and must not take anything over.
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
    runtime::library_data_wanted() && crate::stdio::program_single_threaded()
}

/// A point where the program's thread is in the shim, outside the dynamic linker: take over what
/// a `dlopen` (or the engine's start) added since the last one.
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

/// `dlopen` with the C library's own not looked up yet (a constructor that ran before the
/// shim's): an ordinary call, the shim then being the caller.
extern "C" fn dlopen_unresolved(file: *const c_char, mode: c_int) -> *mut c_void {
    resolve_real_dlopen();
    let address = REAL_DLOPEN.load(Ordering::Acquire);
    if address == 0 {
        runtime::die(&["tiermem: the C library has no dlopen"]);
    }
    // SAFETY: dlsym found the C library's dlopen, which has this signature.
    let real: unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void = unsafe { std::mem::transmute(address) };
    // SAFETY: the caller's arguments, passed on (the C contract of dlopen).
    unsafe { real(file, mode) }
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
    PENDING.store(false, Ordering::Release);
    if !wanted() || runtime::in_forked_child() || PROGRAM_THREAD.load(Ordering::Acquire) != runtime::thread_id() {
        return;
    }
    let Some(engine) = runtime::running_engine() else { return };
    let objects = {
        let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
        let mut found = Found { seen: &mut seen, objects: Vec::new() };
        // SAFETY: the callback matches dl_iterate_phdr's type and `found` outlives the call.
        unsafe { libc::dl_iterate_phdr(Some(each_object), (&raw mut found).cast()) };
        found.objects
    };
    for (name, segments) in objects {
        let mut adopted = false;
        for segment in segments {
            match adopt_segment(engine, segment) {
                Ok(runs) => adopted |= runs > 0,
                Err(()) => _ = SEGMENTS_LEFT.fetch_add(1, Ordering::Relaxed),
            }
        }
        if adopted {
            keep_loaded(&name);
        }
    }
}

/// An object whose data the engine pages is never unloaded: `dlclose` would unmap its regions
/// behind the engine's back. RTLD_NOLOAD | RTLD_NODELETE makes a loaded object undeletable.
fn keep_loaded(name: &CString) {
    if name.is_empty() {
        // The program itself.
        return;
    }
    // RTLD_NOLOAD loads nothing: a path of a loaded object.
    let handle = dlopen_unresolved(name.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NODELETE | libc::RTLD_LAZY);
    if !handle.is_null() {
        // SAFETY: the handle just returned; the object stays (NODELETE).
        unsafe { libc::dlclose(handle) };
    }
}

struct Found<'a> {
    seen: &'a mut Vec<usize>,
    /// Each new object's path and writable segments.
    objects: Vec<(CString, Vec<Segment>)>,
}

/// dl_iterate_phdr's callback: the writable segments of each object not seen before.
unsafe extern "C" fn each_object(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: dl_iterate_phdr passes a valid info for the call, and `data` is our `Found`.
    let (info, found) = unsafe { (&*info, &mut *data.cast::<Found>()) };
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
    found.seen.push(base);
    if LEFT_ALONE.iter().any(|prefix| file.starts_with(prefix)) || file.starts_with("linux-vdso") {
        return 0;
    }
    // SAFETY: dlpi_phdr points to dlpi_phnum program headers of the loaded object.
    let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
    let segments = writable_segments(base, headers);
    if !segments.is_empty() {
        found.objects.push((name.to_owned(), segments));
    }
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
            let read_only =
                relro.map(|(a, b)| (a.max(start), b.min(end))).filter(|(a, b)| a < b);
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
    let managed_there =
        || registry::may_overlap(start, end - start) && !registry::overlapping(&registry::lock(), start, end - start).is_empty();
    if !mapped_as_headers_say(start, end) || managed_there() {
        return Err(());
    }
    let runs = anonymous_runs(start, end).ok_or(())?;
    let mut adopted = 0;
    for (from, to) in runs {
        adopt_run(engine, from, to)?;
        if let Some((a, b)) = read_only.map(|(a, b)| (a.max(from), b.min(to))).filter(|(a, b)| a < b) {
            crate::mmap::protect(a, b - a, libc::PROT_READ);
        }
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
    let aside = crate::io::sys!(
        libc::SYS_mmap,
        0usize,
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
        -1i32,
        0usize
    );
    if aside < 0 {
        return Err(());
    }
    let aside = aside as usize;
    // SAFETY: both ranges are mapped and readable (checked by the caller; `aside` just made),
    // `len` bytes, and do not overlap; the program's one thread is here, so nothing writes there.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, aside as *mut u8, len) };
    let replaced = crate::io::sys!(
        libc::SYS_mmap,
        start,
        len,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
        -1i32,
        0usize
    );
    if replaced as usize != start {
        crate::io::sys!(libc::SYS_munmap, aside, len);
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
    crate::io::sys!(libc::SYS_munmap, aside, len);
    if !adopted {
        return Err(());
    }
    SEGMENTS.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(len as u64, Ordering::Relaxed);
    runtime::LIVE_MANAGED_BYTES.fetch_add(len as u64, Ordering::Relaxed);
    Ok(())
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
        let small = [header(libc::PT_LOAD, libc::PF_R | libc::PF_W, 0x1100, 0x800), header(libc::PT_GNU_RELRO, 4, 0x1100, 0x100)];
        assert_eq!(writable_segments(base, &small), vec![Segment { start: base + 0x1000, end: base + 0x2000, read_only: None }]);
        // Writable and executable, or empty: left alone.
        let odd = [header(libc::PT_LOAD, libc::PF_W | libc::PF_X, 0x1000, 0x1000), header(libc::PT_LOAD, libc::PF_W, 0x3000, 0)];
        assert!(writable_segments(base, &odd).is_empty());
    }
}
