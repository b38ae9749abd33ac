//! Anonymous private mmap, munmap and mremap. Only plain read-write anonymous private mappings
//! of at least the threshold are managed, also where the program places them itself (MAP_FIXED:
//! runtimes that reserve address space and map into it as they grow, such as a Java heap) or
//! makes a reservation usable with mprotect (V8's heap); shared, locked, huge-page, stack,
//! executable and PROT_NONE reservations go to the kernel unchanged, as do all file mappings.
//! The real calls are made as system calls, so nothing recurses into the shim.

use std::ffi::c_void;

use tiermem_engine::Advice;
use tiermem_sys::PAGE_SIZE;

use crate::alloc::managed_alloc;
use crate::registry::{self, Origin};
use crate::runtime;

// MAP_LOCKED memory is the program's to keep resident: the kernel's.
const UNMANAGED_FLAGS: i32 = libc::MAP_FIXED
    | libc::MAP_FIXED_NOREPLACE
    | libc::MAP_LOCKED
    | libc::MAP_HUGETLB
    | libc::MAP_GROWSDOWN
    | libc::MAP_STACK
    | libc::MAP_32BIT;

/// The bits of `flags` that say shared or private: a value, not a set of bits
/// (MAP_SHARED_VALIDATE is MAP_SHARED | MAP_PRIVATE), so it is compared, not masked.
const MAP_SHARING_TYPE: i32 = 0x0f;

fn manageable(len: usize, prot: i32, flags: i32, fd: i32) -> bool {
    flags & UNMANAGED_FLAGS == 0 && plain_anonymous(len, prot, flags, fd)
}

/// Read-write, private, anonymous, at least the threshold (flags outside UNMANAGED_FLAGS and
/// MAP_POPULATE aside).
fn plain_anonymous(len: usize, prot: i32, flags: i32, fd: i32) -> bool {
    flags & libc::MAP_ANONYMOUS != 0
        && flags & MAP_SHARING_TYPE == libc::MAP_PRIVATE
        && fd == -1
        && prot == libc::PROT_READ | libc::PROT_WRITE
        && len >= runtime::threshold()
}

/// A mapping the engine can take over once the kernel has placed it where the program said:
/// as [`manageable`] but with MAP_FIXED or MAP_FIXED_NOREPLACE, and not populated (the
/// engine must see every page's first touch).
fn manageable_in_place(len: usize, prot: i32, flags: i32, fd: i32) -> bool {
    let placed = libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE;
    flags & placed != 0
        && flags & (UNMANAGED_FLAGS & !placed) == 0
        && flags & libc::MAP_POPULATE == 0
        && plain_anonymous(len, prot, flags, fd)
}

fn syscall_result(rc: libc::c_long) -> *mut c_void {
    rc as *mut c_void
}

/// # Safety
/// The C contract of mmap.
#[no_mangle]
pub unsafe extern "C" fn mmap(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void {
    let mapped = map(addr, len, prot, flags, fd, off);
    // After the call: a first managed mapping starts the engine, and the libraries loaded until
    // then are taken over before the program goes on.
    let errno = runtime::errno();
    crate::library_data::at_safe_point();
    runtime::set_errno(errno);
    mapped
}

fn map(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void {
    if manageable(len, prot, flags, fd) {
        // The address is only a hint without MAP_FIXED; the engine picks its own.
        let p = managed_alloc(len, PAGE_SIZE, Origin::Mmap);
        if !p.is_null() {
            return p;
        }
    }
    if manageable_in_place(len, prot, flags, fd) {
        return map_managed_in_place(addr, len, prot, flags, off);
    }
    let mapped = map_as_asked(addr, len, prot, flags, fd, off);
    if prot == libc::PROT_NONE && flags & (libc::MAP_STACK | libc::MAP_GROWSDOWN) != 0 && mapped != libc::MAP_FAILED {
        // A stack reserved to be made usable later (a coroutine's, a fiber's).
        keep_for_kernel(mapped as usize, len);
    }
    mapped
}

/// Reservations never taken over when made usable with mprotect (see [`commit_managed`]):
/// stacks (a fault on an evicted stack page could not be served on that stack), memory the
/// program asked to be wiped in a forked child (the engine would copy evicted pages into it)
/// and memory under a protection key (reclaim's threads hold only the default key's rights).
/// PROCMAP_QUERY does not tell any of these. A range the program unmaps whole is dropped; a
/// stale entry (a range moved by mremap, or unmapped in part) only leaves memory the kernel's;
/// past 1024 the oldest go.
static KEPT_FOR_KERNEL: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

fn keep_for_kernel(start: usize, len: usize) {
    // A forked child takes nothing over (and its copy of the lock may be held for good).
    if runtime::in_forked_child() {
        return;
    }
    let end = start.saturating_add(len.next_multiple_of(PAGE_SIZE));
    let mut kept = KEPT_FOR_KERNEL.lock().unwrap_or_else(|e| e.into_inner());
    if kept.len() >= 1024 {
        kept.remove(0);
    }
    kept.push((start, end));
}

/// The program unmapped `[start, end)`: ranges wholly inside it are gone (so a program that
/// makes and drops many fiber stacks does not push live ones out). Skipped while the list is
/// busy (a signal handler interrupting its holder), which only leaves a stale range kept.
fn forget_kept(start: usize, end: usize) {
    if runtime::in_forked_child() {
        return;
    }
    if let Ok(mut kept) = KEPT_FOR_KERNEL.try_lock() {
        kept.retain(|&(a, b)| !(start <= a && b <= end));
    }
}

/// Busy (a signal handler interrupting its holder): kept, the safe answer.
fn kept_for_kernel(start: usize, end: usize) -> bool {
    match KEPT_FOR_KERNEL.try_lock() {
        Ok(kept) => kept.iter().any(|&(a, b)| a < end && start < b),
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner().iter().any(|&(a, b)| a < end && start < b),
        Err(std::sync::TryLockError::WouldBlock) => true,
    }
}

/// The program's mmap, unmanaged: by the kernel, handing over any managed memory it replaces.
fn map_as_asked(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void {
    // MAP_FIXED_NOREPLACE (alone or with MAP_FIXED) fails over existing mappings: nothing to
    // forget, unless all it meets are pieces of managed memory the program has unmapped.
    let noreplace = flags & libc::MAP_FIXED_NOREPLACE != 0;
    // Regions being released count in `may_overlap` until their range is unmapped: the table's
    // lock then waits for them (`registry::lock_clear_of`).
    if (noreplace || flags & libc::MAP_FIXED != 0) && registry::may_overlap(addr as usize, len) {
        return map_fixed_over_managed(addr, len, prot, flags, fd, off);
    }
    // The caller's own mmap, passed to the kernel unchanged. Its mapping's bookkeeping is kernel
    // memory the cgroup charges, which a cgroup tiermem keeps full refuses at once (ENOMEM)
    // where Linux swap would have reclaimed: seen for a memfd mapped right after a full budget
    // under the OOM guard (`tests/run_programs.rs`, the burst test). Made room for and tried
    // again, as for a socket buffer.
    let rc = crate::io::retrying_refused(|| crate::io::sys!(libc::SYS_mmap, addr, len, prot, flags, fd, off));
    syscall_result(rc as libc::c_long)
}

/// The program's fresh anonymous mapping at its own address, managed: the kernel maps it as
/// asked, then where it lies in live managed regions (a heap grown again where it gave memory
/// back) they take those pieces back, and the engine takes the rest over as regions of their
/// own. Whatever the engine cannot take stays the kernel's, mapped. The result of the call.
fn map_managed_in_place(addr: *mut c_void, len: usize, prot: i32, flags: i32, off: i64) -> *mut c_void {
    let start = addr as usize;
    let Some(end) = len.checked_next_multiple_of(PAGE_SIZE).and_then(|n| start.checked_add(n)) else {
        // Past the address space: the kernel refuses it.
        return map_as_asked(addr, len, prot, flags, -1, off);
    };
    // Started (if this is the first managed memory) before the registry is locked, as for
    // any other allocation.
    let engine = runtime::engine();
    let map = |flags: i32| crate::io::sys!(libc::SYS_mmap, addr, len, prot, flags, -1i32, off) as libc::c_long;
    let mut table = registry::lock_clear_of(start, end);
    if registry::overlapping(&table, start, end - start).is_empty() {
        let mapped = map(flags);
        if mapped as usize != start {
            return syscall_result(mapped);
        }
    } else {
        // Over managed memory: handed over first, as for any mapping there (regions it
        // replaces whole go), then taken back below with the registry locked again (its
        // regions may have changed meanwhile; the new mapping, which the program has not seen
        // yet, has not). A failure returns before that lock, which could change errno. With
        // MAP_FIXED_NOREPLACE, only into pieces the program has unmapped (else the kernel
        // answers EEXIST).
        drop(table);
        let mapped = replace_managed(start, end, |table| fixed_unless_taken(table, start, end, flags, map));
        if mapped as usize != start {
            return syscall_result(mapped);
        }
        table = registry::lock();
    }
    // Said once the registry is unlocked: a message may go through the shim's own write().
    let mut errors = Vec::new();
    let mut outside = vec![(start, end)];
    for base in registry::overlapping(&table, start, end - start) {
        let entry = table.get_mut(&base).expect("listed above");
        let (from, to) = (base.max(start), (base + entry.len()).min(end));
        tiermem_sys::mem::remove_range(&mut outside, from, to);
        // Only into an mmap'd region, and only inside what the program has mapped of it: a
        // malloc'd block is released by free() alone (the program's own munmap or mremap of
        // the piece must reach the kernel), and a piece past the end of a region shrunk by
        // mremap must not be grown over in place.
        let within = to - base <= entry.size.next_multiple_of(PAGE_SIZE);
        if entry.origin != Origin::Mmap || !within {
            errors.push("it lies in a malloc'd block or past the end of a mapping shrunk by mremap".to_string());
            continue;
        }
        // SAFETY: `from..to` is part of the fresh mapping the kernel has just made for the
        // program's call, which has not returned: nothing uses it yet.
        match unsafe { entry.adopt_back(from - base, to - base) } {
            Ok(()) => _ = runtime::TAKEN_BACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            Err(e) => errors.push(e),
        }
    }
    for (from, to) in outside {
        // SAFETY: as above, and no region holds `from..to`.
        match unsafe { adopt_mapping(engine, &mut table, from, to) } {
            Ok(()) => _ = runtime::FIXED_ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            Err(e) => errors.push(e),
        }
    }
    drop(table);
    for e in &errors {
        crate::alloc::note_unmanaged("memory the program mapped at its own address stays the kernel's", e);
    }
    addr
}

/// The engine takes `[from, to)` over as a region of its own, listed in the registry as an
/// mmap'd one (released once the program has unmapped all of it).
///
/// # Safety
/// As [`tiermem_engine::Engine::adopt_region`]: fresh private anonymous read-write memory of the
/// program's, just mapped or made usable, with no page holding data, which no region holds.
unsafe fn adopt_mapping(
    engine: &tiermem_engine::Engine,
    table: &mut std::collections::BTreeMap<usize, registry::Entry>,
    from: usize,
    to: usize,
) -> Result<(), String> {
    // SAFETY: forwarded to the caller.
    let region = unsafe { engine.adopt_region(from as *mut u8, to - from) }.map_err(|e| e.to_string())?;
    registry::insert(table, registry::Entry::new(region, from, to - from, Origin::Mmap));
    runtime::count_allocation(to - from);
    Ok(())
}

/// mmap(MAP_FIXED) over managed memory. The kernel replaces the pages there with the program's
/// new mapping; the regions hand those pieces over: the engine forgets its pages there (else
/// it would go on paging the new mapping's pages as its own, reading old data over them,
/// dropping them), and calls on them go to the kernel from then on. All under the registry's
/// lock, so no munmap of the rest releases a region in between.
fn map_fixed_over_managed(addr: *mut c_void, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut c_void {
    let start = addr as usize;
    let end = start.saturating_add(len.next_multiple_of(PAGE_SIZE));
    // The caller's own mmap, passed to the kernel unchanged, but for MAP_FIXED_NOREPLACE into a
    // hole (see `fixed_unless_taken`), and that only where the kernel maps `[start, end)`
    // exactly: huge pages round the length up, over memory the check never looked at.
    let map = |flags: i32| crate::io::sys!(libc::SYS_mmap, addr, len, prot, flags, fd, off) as libc::c_long;
    let base_pages = in_base_pages(flags, fd);
    syscall_result(replace_managed(start, end, |table| {
        if base_pages {
            fixed_unless_taken(table, start, end, flags, map)
        } else {
            map(flags)
        }
    }))
}

/// Whether an mmap with these flags and descriptor maps 4 KiB pages, its length rounded to
/// them: not huge pages (MAP_HUGETLB, or a file on hugetlbfs, whose lengths round up to the
/// huge page size).
fn in_base_pages(flags: i32, fd: i32) -> bool {
    if flags & libc::MAP_HUGETLB != 0 {
        return false;
    }
    if flags & libc::MAP_ANONYMOUS != 0 || fd < 0 {
        return true;
    }
    // SAFETY: a zeroed statfs is a valid buffer for fstatfs to fill (a bad descriptor is an error).
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = crate::io::sys!(libc::SYS_fstatfs, fd, &mut fs as *mut libc::statfs);
    rc == 0 && fs.f_type != libc::HUGETLBFS_MAGIC
}

/// The kernel call of an mmap with a fixed address over managed memory (`map` makes it with
/// the flags it is given): as asked, but MAP_FIXED_NOREPLACE becomes MAP_FIXED where the
/// program has nothing mapped in `[start, end)`: pieces of managed memory it unmapped, which
/// the region or a reservation still holds in the kernel, and free space beside them (a heap
/// that gave back its end and now grows past where it ended, say). The free pieces are claimed
/// first with inaccessible placeholders made with MAP_FIXED_NOREPLACE (if anything took one,
/// EEXIST stands, as the kernel would answer, and the placeholders go again), then the call is
/// made whole with MAP_FIXED over holes and placeholders: one mapping, as without tiermem.
/// Elsewhere the kernel answers (EEXIST where anything is mapped).
fn fixed_unless_taken(
    table: &std::collections::BTreeMap<usize, registry::Entry>,
    start: usize,
    end: usize,
    flags: i32,
    map: impl FnOnce(i32) -> libc::c_long,
) -> libc::c_long {
    if flags & libc::MAP_FIXED_NOREPLACE == 0 {
        return map(flags);
    }
    let fixed = (flags & !libc::MAP_FIXED_NOREPLACE) | libc::MAP_FIXED;
    let Some(pieces) = holes_and_free_space(table, start, end) else {
        return map(flags);
    };
    let mut claimed: Vec<(usize, usize)> = Vec::new();
    // Gives back the placeholders, leaving `errno` as it was (the answer to the call).
    let give_back = |claimed: &[(usize, usize)], errno: i32| {
        for &(from, to) in claimed {
            let _ = crate::io::sys!(libc::SYS_munmap, from, to - from);
        }
        runtime::set_errno(errno);
    };
    for &(from, to, _) in pieces.iter().filter(|p| !p.2) {
        let placeholder = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE;
        let got =
            crate::io::sys!(libc::SYS_mmap, from, to - from, libc::PROT_NONE, placeholder, -1i32, 0i64) as libc::c_long;
        if got as usize != from {
            let errno = if got == -1 {
                runtime::errno()
            } else {
                // A kernel that takes NOREPLACE for a hint (before 4.17) placed it elsewhere.
                let _ = crate::io::sys!(libc::SYS_munmap, got, to - from);
                libc::EEXIST
            };
            give_back(&claimed, errno);
            return -1;
        }
        claimed.push((from, to));
    }
    let mapped = map(fixed);
    if mapped as usize != start {
        give_back(&claimed, runtime::errno());
    }
    mapped
}

/// `[start, end)` cut into pieces `(from, to, hole)` when all of it is either holes the program
/// unmapped in mmap'd regions (`hole`) or free of regions (not `hole`), with at least one hole;
/// None otherwise (a piece of it is the program's, or a piece it mapped over a region's).
fn holes_and_free_space(
    table: &std::collections::BTreeMap<usize, registry::Entry>,
    start: usize,
    end: usize,
) -> Option<Vec<(usize, usize, bool)>> {
    let mut pieces = Vec::new();
    for (from, to, managed) in registry::segments(table, start, end) {
        let hole = match managed {
            Some(_) => registry::unmapped_by_program(table, from, to).then_some(true)?,
            // Between regions; inside one it is a piece handed over: the program's mapping.
            None => registry::spanning(table, from).is_none().then_some(false)?,
        };
        pieces.push((from, to, hole));
    }
    pieces.iter().any(|p| p.2).then_some(pieces)
}

type Ranges = Vec<(usize, usize)>;

/// Put the program's new mapping over `[start, end)`, which holds managed memory, by
/// `kernel_call` (an mmap or mremap with a fixed address; its result is the address, or -1).
/// The engine first stops filling pages there and gives them up; once the kernel has replaced
/// them the regions hand those pieces over. All under the registry's lock, so no munmap of
/// the rest releases a region in between.
fn replace_managed(
    start: usize,
    end: usize,
    kernel_call: impl FnOnce(&std::collections::BTreeMap<usize, registry::Entry>) -> libc::c_long,
) -> libc::c_long {
    let mut table = registry::lock_clear_of(start, end);
    // (region base, piece from, piece to, what its preparation marked)
    let pieces: Vec<(usize, usize, usize, Ranges)> = registry::overlapping(&table, start, end - start)
        .into_iter()
        .map(|base| {
            let entry = &table[&base];
            let (from, to) = (base.max(start) - base, (base + entry.len()).min(end) - base);
            (base, from, to, entry.prepare_hand_over(from, to))
        })
        .collect();
    let mapped = kernel_call(&table);
    if mapped as usize != start {
        // As the kernel does, a failed call leaves the memory as it was.
        for (base, _, _, marked) in &pieces {
            table[base].cancel_hand_over(marked);
        }
        return mapped;
    }
    let mut released = Vec::new();
    for (base, from, to, _) in pieces {
        let entry = table.get_mut(&base).expect("listed above");
        entry.hand_over(from, to);
        crate::lock::forget(base + from, base + to);
        // An mmap'd region goes once the program has unmapped or replaced all of it (its
        // release leaves the pieces handed over mapped); a malloc'd one when it is freed.
        if entry.origin == Origin::Mmap && entry.note_unmapped(from, to) {
            released.push(registry::take_for_release(&mut table, base).expect("listed above"));
        }
    }
    release_outside_lock(table, released);
    mapped
}

/// Release `released` (taken out of `table` with [`registry::take_for_release`]) once the
/// table's lock is let go, their span marked as being released meanwhile (see
/// [`registry::ReleaseMark`]).
fn release_outside_lock(
    mut table: std::sync::MutexGuard<'static, std::collections::BTreeMap<usize, registry::Entry>>,
    released: Vec<registry::Entry>,
) {
    let start = released.iter().map(registry::Entry::base).min();
    let end = released.iter().map(|e| e.base() + e.len()).max();
    let mark = start.zip(end).map(|(start, end)| registry::ReleaseMark::new(&mut table, start, end, released.len()));
    drop(table);
    for entry in released {
        runtime::release(entry);
    }
    drop(mark);
}

/// Reserve `[start, end)` again (PROT_NONE, as unmapped memory faults) where the program
/// unmapped or moved its own mapping inside a managed region: a new mapping must not appear
/// inside the region's range while the region lives.
///
/// `over` says how: `Replace` puts the reservation over the program's mapping at once (an
/// munmap of it); `IfFree` only where nothing is mapped (after an mremap moved it away, the
/// kernel may have placed another mapping there meanwhile, which must be left alone).
fn reserve_again(start: usize, end: usize, over: Reserve) -> i32 {
    let fixed = match over {
        Reserve::Replace => libc::MAP_FIXED,
        Reserve::IfFree => libc::MAP_FIXED_NOREPLACE,
    };
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed | libc::MAP_NORESERVE;
    // Replaces only the caller's own mapping, which it asked to unmap or move.
    let r = crate::io::sys!(libc::SYS_mmap, start, end - start, libc::PROT_NONE, flags, -1i32, 0i64) as libc::c_long;
    if r as usize == start {
        0
    } else {
        -1
    }
}

#[derive(Clone, Copy)]
enum Reserve {
    Replace,
    IfFree,
}

/// The program unmapped or moved away its own mapping at `[from, to)`, a piece `base`'s region
/// handed over: reserve it again and take it back. Where it cannot be reserved, it stays
/// handed over (the region's release leaves it alone).
fn take_back(
    table: &mut std::collections::BTreeMap<usize, registry::Entry>,
    base: usize,
    from: usize,
    to: usize,
    over: Reserve,
) -> i32 {
    let rc = reserve_again(from, to, over);
    if rc == 0 {
        if let Some(entry) = table.get_mut(&base) {
            entry.take_back(from - base, to - base);
        }
    }
    rc
}

/// # Safety
/// The C contract of mmap64 (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: usize,
    prot: i32,
    flags: i32,
    fd: i32,
    off: i64,
) -> *mut c_void {
    // SAFETY: forwarded with the same contract.
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

/// Drop the pages of `[offset, offset + len)` of a managed region: the engine's discard, or in
/// a forked child (which has no engine, and whose copy of the regions' lock is held for good)
/// the kernel's MADV_DONTNEED on what is plain memory there. Either way the range stays
/// mapped, reading as zeros, as unmapped pieces of a region do.
fn drop_pages(region: &tiermem_engine::Region, offset: usize, len: usize) -> tiermem_engine::Result<()> {
    if runtime::in_forked_child() {
        let addr = region.as_ptr() as usize + offset;
        let _ = crate::io::sys!(libc::SYS_madvise, addr, len, libc::MADV_DONTNEED);
        return Ok(());
    }
    region.discard(offset, len)
}

/// Unmap `[start, end)` in the kernel (no managed memory inside).
fn kernel_munmap(start: usize, end: usize) -> i32 {
    if end <= start {
        return 0;
    }
    // The caller's own munmap of memory that is not managed.
    let rc = crate::io::sys!(libc::SYS_munmap, start, end - start) as i32;
    if rc == 0 {
        forget_kept(start, end);
    }
    rc
}

/// # Safety
/// The C contract of munmap.
#[no_mangle]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> i32 {
    crate::library_data::at_safe_point();
    let start = addr as usize;
    if !registry::may_overlap(start, len) {
        // The kernel's own checks for memory that is not managed: a length of 0, or one that
        // rounds past the end of the address space, is EINVAL there.
        let rc = crate::io::sys!(libc::SYS_munmap, start, len) as i32;
        if rc == 0 {
            forget_kept(start, start.saturating_add(len.checked_next_multiple_of(PAGE_SIZE).unwrap_or(usize::MAX)));
        }
        return rc;
    }
    // The kernel's checks first: nothing is done to a range it would refuse (a length past the
    // end of the address space unmapped every region and gap above `start` before failing on
    // the last, and one that rounds past 2^64 wrapped to nothing unmapped and success).
    let end = len.checked_next_multiple_of(PAGE_SIZE).and_then(|n| start.checked_add(n));
    let within = |end: usize| end <= FOUR_LEVEL_END || end <= user_space_end();
    let Some(end) = end.filter(|&end| start.is_multiple_of(PAGE_SIZE) && len > 0 && within(end)) else {
        runtime::set_errno(libc::EINVAL);
        return -1;
    };
    let mut table = registry::lock_clear_of(start, end);
    // Managed mmap regions are released when the program has unmapped all of them (a piece
    // unmapped twice counts once). A piece unmapped before then loses its pages at once, but
    // its addresses stay reserved until the whole region goes: the engine works on the region's
    // range as a whole. munmap of malloc'd managed memory is refused, as the kernel would refuse
    // nothing and the heap would be corrupt. What lies between regions, or in pieces handed
    // over to the program's own MAP_FIXED mappings, is the kernel's to unmap.
    let mut released = Vec::new();
    let mut rc = 0;
    for (from, to, managed) in registry::segments(&table, start, end) {
        let Some(base) = managed else {
            rc |= match registry::handed_over_at(&table, from) {
                Some((base, _, _)) => take_back(&mut table, base, from, to, Reserve::Replace),
                None => kernel_munmap(from, to),
            };
            continue;
        };
        let entry = table.get_mut(&base).expect("listed above");
        if entry.origin == Origin::Malloc {
            runtime::say(&["tiermem: munmap() of memory that came from malloc is ignored"]);
            continue;
        }
        if entry.note_unmapped(from - base, to - base) {
            released.push(registry::take_for_release(&mut table, base).expect("listed above"));
            continue;
        }
        crate::lock::forget(from, to);
        if let Err(e) = drop_pages(&entry.region, from - base, to - from) {
            runtime::say(&["tiermem: munmap() of part of a managed mapping: ", &e.to_string()]);
        }
    }
    release_outside_lock(table, released);
    if rc != 0 {
        -1
    } else {
        0
    }
}

/// The end of the user address space (the kernel's TASK_SIZE): 2^47 - 4 KiB with four-level
/// page tables, 2^56 - 4 KiB with five. Which one is probed once, when a range reaches past
/// the lower: the kernel maps a page at 2^47 only with five levels.
fn user_space_end() -> usize {
    const FIVE_LEVELS: usize = (1 << 56) - PAGE_SIZE;
    static END: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let known = END.load(std::sync::atomic::Ordering::Relaxed);
    if known != 0 {
        return known;
    }
    // The probe's failure must not show in the caller's errno.
    let saved = runtime::errno();
    let at = FOUR_LEVEL_END + PAGE_SIZE;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE;
    let probe = crate::io::sys!(libc::SYS_mmap, at, PAGE_SIZE, libc::PROT_NONE, flags, -1i32, 0i64) as usize;
    let end = if probe == at {
        let _ = crate::io::sys!(libc::SYS_munmap, at, PAGE_SIZE);
        FIVE_LEVELS
    } else {
        FOUR_LEVEL_END
    };
    runtime::set_errno(saved);
    END.store(end, std::sync::atomic::Ordering::Relaxed);
    end
}

/// The end of the user address space with four-level page tables (see [`user_space_end`]).
const FOUR_LEVEL_END: usize = (1 << 47) - PAGE_SIZE;

/// mremap is variadic in C (the fifth argument only with MREMAP_FIXED); on x86-64 the fifth
/// argument arrives in the same register either way, so it is declared and only read then.
///
/// # Safety
/// The C contract of mremap.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_len: usize,
    new_len: usize,
    flags: i32,
    new_addr: *mut c_void,
) -> *mut c_void {
    let start = old as usize;
    let fail = |errno: i32| {
        runtime::set_errno(errno);
        libc::MAP_FAILED
    };
    if registry::may_overlap(start, old_len.max(1)) {
        let mut table = registry::lock_clear_of(start, start.saturating_add(old_len));
        if let Some(base) = registry::containing(&table, start) {
            let entry = table.get_mut(&base).expect("found above");
            let dont_unmap = flags & libc::MREMAP_DONTUNMAP != 0;
            let bad_dont_unmap = dont_unmap && (flags & libc::MREMAP_MAYMOVE == 0 || old_len != new_len);
            // Lengths the kernel refuses: zero, or so large that rounding up to a page wraps
            // (or that no address space holds).
            let rounded =
                |len: usize| len.checked_next_multiple_of(PAGE_SIZE).filter(|&l| l != 0 && l <= isize::MAX as usize);
            let (Some(old_end), Some(new_end)) = (rounded(old_len), rounded(new_len)) else {
                return fail(libc::EINVAL);
            };
            let fixed = flags & libc::MREMAP_FIXED != 0;
            let target = new_addr as usize;
            // A fixed target needs MREMAP_MAYMOVE, a page-aligned address and no overlap with
            // the range it leaves.
            let bad_fixed = fixed
                && (flags & libc::MREMAP_MAYMOVE == 0
                    || !target.is_multiple_of(PAGE_SIZE)
                    || (target < start.saturating_add(old_end) && start < target.saturating_add(new_end)));
            let known = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP;
            let bad_flags = flags & !known != 0;
            if entry.origin != Origin::Mmap
                || !start.is_multiple_of(PAGE_SIZE)
                || bad_dont_unmap
                || bad_fixed
                || bad_flags
            {
                return fail(libc::EINVAL);
            }
            // The start itself must be mapped (the program may have unmapped it, moved it away
            // with an earlier mremap of a piece, or mapped over it and then unmapped that).
            let offset = start - base;
            if entry.unmapped.iter().any(|&(a, b)| a <= offset && offset < b)
                || entry.meets_foreign(offset, offset + PAGE_SIZE)
            {
                return fail(libc::EFAULT);
            }
            // Part of the mapping (what lies outside the range stays where it is), a range with
            // holes or other mappings in it, the mapping's pages moved and its range kept, or a
            // mapping that cannot resize in place: handled as an unmap of the end (shrinking),
            // or a copy and an unmap (or a drop) of the range alone (moving). Only a whole,
            // unbroken mapping resizes in place below, within its region and not over pieces
            // the program mapped over (or unmapped after that) beyond it.
            let broken = entry.unmapped.iter().any(|&(a, _)| a < old_end) || entry.meets_foreign(0, old_end);
            let in_place = new_len <= entry.len() && !entry.meets_foreign(old_end, new_end);
            // The range as the kernel maps it: the program's mprotect or fork advice may have
            // split it, and a lock on part of it would have. A resize or MREMAP_DONTUNMAP needs
            // one mapping (the kernel's EFAULT otherwise); a move of the same size keeps each
            // part as it is (Linux >= 6.17), and a shrink just unmaps the end.
            let kernel = KernelParts::of(start, start + old_end);
            let locked = crate::lock::locked_parts(start, start + old_end);
            let partly_locked = !locked.is_empty() && locked != [(start, start + old_end)];
            if (kernel.n > 1 || partly_locked) && (new_end > old_end || dont_unmap) {
                return fail(libc::EFAULT);
            }
            // In a forked child a move makes plain memory (see `remap_piece`).
            let child = runtime::in_forked_child();
            if offset != 0 || dont_unmap || fixed || broken || child || !in_place || entry.maps_beyond(old_end) {
                let piece = Piece { start, offset, len: old_end };
                let to = fixed.then_some(target);
                return remap_piece(table, piece, new_end, flags, to, &kernel).unwrap_or_else(fail);
            }
            // In place: everything up to the new length is mapped (again, if an earlier shrink
            // had unmapped it), and the tail beyond it is unmapped, its pages gone. A wholly
            // locked mapping grows locked, as VM_LOCKED does, if the quota has room (EAGAIN
            // otherwise, before anything changes, as the kernel's check past RLIMIT_MEMLOCK).
            let grows_locked = new_end > old_end && locked == [(base, base + old_end)];
            let mut reservation = if grows_locked {
                let Some(r) = crate::lock::reserve(0, new_end - old_end) else { return fail(libc::EAGAIN) };
                Some(r)
            } else {
                None
            };
            let keep = new_end;
            entry.unmapped.retain_mut(|(from, to)| {
                *from = (*from).max(keep);
                from < to
            });
            if keep < entry.len() {
                let len = entry.len();
                crate::lock::forget(base + keep, base + len);
                entry.note_unmapped(keep, len);
                if let Err(e) = drop_pages(&entry.region, keep, len - keep) {
                    runtime::say(&["tiermem: mremap() shrinking a managed mapping: ", &e.to_string()]);
                }
            }
            entry.size = new_len;
            // What grows takes the mapping's protection and fork advice, as the kernel's
            // mapping would grow with its own.
            let advice = whole_piece_advice(&entry.fork_advice, 0, old_end);
            drop(table);
            if new_end > old_end {
                kernel.extend_to(base + old_end, base + new_end);
                for a in advice.iter().flatten() {
                    // SAFETY: advice the program gave the whole mapping, for the part it grew by.
                    unsafe { madvise((base + old_end) as *mut c_void, new_end - old_end, *a) };
                }
            }
            if let Some(reservation) = reservation.as_mut() {
                // Locking takes the registry's lock itself.
                crate::lock::relock(base + old_end, base + new_end, reservation);
            }
            return old;
        }
    }
    if let Some(result) = shrink_into_managed(start, old_len, new_len, flags) {
        return result;
    }
    // The program's own mapping, possibly one inside a managed region (what it leaves there is
    // reserved again, see `take_back`), possibly moved onto managed memory (which it replaces,
    // as MAP_FIXED does).
    let from_piece = registry::may_overlap(start, 1) && registry::handed_over_at(&registry::lock(), start).is_some();
    let target = new_addr as usize;
    let onto_managed = flags & libc::MREMAP_FIXED != 0 && registry::may_overlap(target, new_len.max(1));
    // The caller's own mremap of memory that is not managed.
    let call = || crate::io::sys!(libc::SYS_mremap, old, old_len, new_len, flags, new_addr) as libc::c_long;
    let moved = if onto_managed {
        replace_managed(target, target.saturating_add(new_len.next_multiple_of(PAGE_SIZE)), |_| call())
    } else {
        call()
    };
    if moved != -1 && from_piece && flags & libc::MREMAP_DONTUNMAP == 0 {
        let old_end = start.saturating_add(old_len.next_multiple_of(PAGE_SIZE));
        let left_from =
            if moved as usize == start { start.saturating_add(new_len.next_multiple_of(PAGE_SIZE)) } else { start };
        take_back_all(left_from, old_end);
    }
    syscall_result(moved)
}

/// mremap shrinking a mapping that is not managed with an old length that runs on into managed
/// memory: the kernel's shrink unmaps whatever lies in the tail it drops, as munmap does, so
/// the tail goes through munmap here. Left to the kernel, the engine kept those pages as its
/// own and, once the program mapped something new there, evicted that mapping's pages (read
/// back as zeros). None when the call is not such a shrink.
fn shrink_into_managed(start: usize, old_len: usize, new_len: usize, flags: i32) -> Option<*mut c_void> {
    let rounded = |len: usize| len.checked_next_multiple_of(PAGE_SIZE).filter(|&l| l != 0);
    let (old_end, new_end) = (rounded(old_len)?, rounded(new_len)?);
    let end = start.checked_add(old_end)?;
    let tail = start + new_end;
    // Any flag but MREMAP_MAYMOVE: moves, and flags the kernel refuses, are the kernel's.
    if flags & !libc::MREMAP_MAYMOVE != 0
        || !start.is_multiple_of(PAGE_SIZE)
        || new_end >= old_end
        || !registry::may_overlap(tail, end - tail)
        || !registry::segments(&registry::lock(), tail, end).iter().any(|&(_, _, managed)| managed.is_some())
    {
        return None;
    }
    // The kernel's check first: the mapping at the start must exist (mincore: ENOMEM if not).
    let mut resident = 0u8;
    if crate::io::sys!(libc::SYS_mincore, start, 1usize, &mut resident as *mut u8) != 0
        && runtime::errno() == libc::ENOMEM
    {
        runtime::set_errno(libc::EFAULT);
        return Some(libc::MAP_FAILED);
    }
    // SAFETY: the tail the program's own mremap would have unmapped, page-aligned.
    let rc = unsafe { munmap(tail as *mut c_void, end - tail) };
    Some(if rc == 0 { start as *mut c_void } else { libc::MAP_FAILED })
}

/// A page-aligned range of a managed mmap region: `len` bytes from `start`, `offset` bytes into
/// the region.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    offset: usize,
    len: usize,
}

/// mremap of part of a managed mapping, or with MREMAP_DONTUNMAP (`new_end`: the new length,
/// page-rounded): shrinking unmaps the end of the range (whatever lies there, as the kernel's
/// shrink does); growing moves it into a new managed mapping, which gets its contents and its
/// locks, and the old range is then unmapped, or with MREMAP_DONTUNMAP left mapped, empty and
/// unlocked, as the kernel does. Growing in place is not tried: the pages after the range are
/// mostly the mapping's own, and where they are not the call fails with ENOMEM without
/// MREMAP_MAYMOVE (the kernel may grow into a hole there). With MREMAP_FIXED (`fixed`: the
/// target address) the range always moves there, into an ordinary mapping of the program's
/// that tiermem does not manage (the engine places its regions itself), replacing whatever
/// was mapped there as the kernel does; its locks are the kernel's then. The rest of the
/// mapping is untouched. Err: the errno.
fn remap_piece(
    table: std::sync::MutexGuard<'static, std::collections::BTreeMap<usize, registry::Entry>>,
    piece: Piece,
    new_end: usize,
    flags: i32,
    fixed: Option<usize>,
    kernel: &KernelParts,
) -> Result<*mut c_void, i32> {
    let Piece { start, offset, len } = piece;
    let dont_unmap = flags & libc::MREMAP_DONTUNMAP != 0;
    if new_end <= len && !dont_unmap && fixed.is_none() {
        drop(table);
        if new_end < len {
            // SAFETY: unmapping the end of the caller's own range is what it asked for.
            if unsafe { munmap((start + new_end) as *mut c_void, len - new_end) } != 0 {
                return Err(runtime::errno());
            }
        }
        return Ok(start as *mut c_void);
    }
    // A range to move must be mapped all through (the kernel fails one with a hole in it or
    // one running past the mapping).
    let entry = &table[&(start - offset)];
    let mapped_end = entry.size.next_multiple_of(PAGE_SIZE).min(entry.len());
    let end = offset.checked_add(len).filter(|&end| end <= mapped_end).ok_or(libc::EFAULT)?;
    if entry.unmapped.iter().any(|&(a, b)| a < end && b > offset) || entry.meets_foreign(offset, end) {
        return Err(libc::EFAULT);
    }
    let advice = whole_piece_advice(&entry.fork_advice, offset, end);
    drop(table);
    // The lock quota first, as the kernel checks RLIMIT_MEMLOCK before anything else.
    let locked = crate::lock::locked_parts(start, start + len);
    let mut reservation = match fixed {
        // Its locks go to the kernel, which checks them itself.
        Some(_) => None,
        None => Some(
            crate::lock::reserve(locked_bytes(&locked), moved_lock_bytes(&locked, start, len, new_end))
                .ok_or(libc::EAGAIN)?,
        ),
    };
    if flags & libc::MREMAP_MAYMOVE == 0 {
        return Err(libc::ENOMEM);
    }
    let new = match fixed {
        Some(target) => {
            let (prot, map) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
            // A fixed anonymous mapping, the kernel's (not adopted: its locks and advice are
            // the kernel's below), where the caller asked its range to go, which replaces what
            // is there, as its mremap would (managed pieces are handed over).
            let p = map_as_asked(target as *mut c_void, new_end, prot, map | libc::MAP_FIXED, -1, 0);
            if p == libc::MAP_FAILED {
                return Err(runtime::errno());
            }
            p
        }
        // A forked child has no engine to manage memory: its new mapping is plain.
        None if runtime::in_forked_child() => {
            let (prot, map) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
            let p = crate::io::sys!(libc::SYS_mmap, 0usize, new_end, prot, map, -1i32, 0i64) as *mut c_void;
            if p == libc::MAP_FAILED {
                return Err(runtime::errno());
            }
            p
        }
        None => managed_alloc(new_end, PAGE_SIZE, Origin::Mmap),
    };
    if new.is_null() {
        return Err(libc::ENOMEM);
    }
    // Parts the program made unreadable are read for the copy, and every part gets its
    // protection back at its new place (growth takes the last part's).
    kernel.readable();
    // SAFETY: `start..start + len` is managed, mapped and readable (see above), `new` was just
    // mapped at least `new_end` long, and the two do not overlap (a fixed target was checked).
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, new.cast::<u8>(), len.min(new_end)) };
    kernel.protect_moved(start, new as usize, new as usize + new_end);
    if fixed.is_none() && !runtime::in_forked_child() {
        for a in advice.iter().flatten() {
            // SAFETY: the program's own fork advice on the range, now at its new place.
            unsafe { madvise(new, new_end, *a) };
        }
    }
    crate::lock::forget(start, start + len);
    let left = if dont_unmap {
        // SAFETY: the range was copied; dropping its pages is what MREMAP_DONTUNMAP does.
        unsafe { madvise(start as *mut c_void, len, libc::MADV_DONTNEED) }
    } else {
        // SAFETY: the range was copied; unmapping it is what mremap does.
        unsafe { munmap(start as *mut c_void, len) }
    };
    if left != 0 {
        runtime::say(&["tiermem: mremap() could not take the old range away"]);
    } else if dont_unmap {
        // The range left behind keeps its protection, as the kernel's does.
        kernel.protect_moved(start, start, start + len);
    }
    if fixed.is_some() {
        // The kernel's own mapping now: its locks are the kernel's (best effort, as a move).
        for &(a, b) in &locked {
            let (from, to) = (new as usize + (a - start), (new as usize + (b - start)).min(new as usize + new_end));
            if from < to {
                // Locking part of the mapping just made; no memory is changed.
                let _ = crate::io::sys!(libc::SYS_mlock, from, to - from);
            }
        }
    } else if let Some(reservation) = reservation.as_mut() {
        relock_moved(&locked, start, len, new as usize, new_end, reservation);
    }
    Ok(new)
}

/// Most parts [`KernelParts`] tells apart; in a range split into more, what lies past them
/// takes the last one's protection when it moves.
const MAX_PARTS: usize = 16;

/// How the kernel maps a range of managed memory: the parts the program split it into with
/// mprotect or fork advice, each with its protection, clipped to the range. Unknown (no
/// descriptor left to read /proc/self/maps) reads as one read-write part, which is what the
/// engine made.
struct KernelParts {
    parts: [tiermem_sys::mem::Vma; MAX_PARTS],
    n: usize,
    start: usize,
    end: usize,
}

const READ_WRITE: i32 = libc::PROT_READ | libc::PROT_WRITE;

impl KernelParts {
    fn of(start: usize, end: usize) -> Self {
        let mut parts = [tiermem_sys::mem::Vma::default(); MAX_PARTS];
        let n = match tiermem_sys::mem::vmas(start, end, &mut parts) {
            Ok(n) if n > 0 => n,
            _ => {
                parts[0] = tiermem_sys::mem::Vma { start, end, prot: READ_WRITE, ..Default::default() };
                1
            }
        };
        for p in &mut parts[..n] {
            p.start = p.start.max(start);
            p.end = p.end.min(end);
        }
        Self { parts, n, start, end }
    }

    fn parts(&self) -> &[tiermem_sys::mem::Vma] {
        &self.parts[..self.n]
    }

    /// Make the range readable where the program made it unreadable: it is about to be copied
    /// and left (or, with MREMAP_DONTUNMAP, emptied and protected again).
    fn readable(&self) {
        let listed = self.parts().last().is_some_and(|p| p.end == self.end);
        if !listed || self.parts().iter().any(|p| p.prot & libc::PROT_READ == 0) {
            protect(self.start, self.end - self.start, libc::PROT_READ);
        }
    }

    /// Give the range copied from these parts, now at `new..new_end`, their protection, part by
    /// part; what lies beyond them (growth) takes the last part's.
    fn protect_moved(&self, old: usize, new: usize, new_end: usize) {
        let Some(last) = self.parts().last() else { return };
        for p in self.parts() {
            let (from, to) = (new + (p.start - old), (new + (p.end - old)).min(new_end));
            let to = if p.end == last.end { new_end } else { to };
            if from < to && p.prot != READ_WRITE {
                protect(from, to - from, p.prot);
            }
        }
    }

    /// The range grew in place from `from` to `to`: give that the (one) part's protection.
    fn extend_to(&self, from: usize, to: usize) {
        if let Some(p) = self.parts().last().filter(|p| p.prot != READ_WRITE) {
            protect(from, to - from, p.prot);
        }
    }
}

/// The fork advice (up to one of each pair) in force on all of `offset..end` of a mapping:
/// what the kernel's mapping of that range carries along when it moves or grows. Advice is
/// recorded per call (a mapping grown twice holds it in pieces); at each point the latest of a
/// pair that covers it is in force. Advice on part of it split the kernel's mapping, which a
/// resize refuses before this is asked.
fn whole_piece_advice(advice: &[(usize, usize, i32)], offset: usize, end: usize) -> [Option<i32>; 2] {
    let pair_of = |a: i32| usize::from(!matches!(a, libc::MADV_WIPEONFORK | libc::MADV_KEEPONFORK));
    let mut out = [None; 2];
    for (pair, on) in [(0, libc::MADV_WIPEONFORK), (1, libc::MADV_DONTFORK)] {
        let of_pair = || advice.iter().filter(move |&&(_, _, a)| pair_of(a) == pair);
        // Every point where the advice in force may change, then each stretch between two.
        let mut cuts: Vec<usize> = of_pair().flat_map(|&(f, t, _)| [f, t]).filter(|&c| offset < c && c < end).collect();
        cuts.extend([offset, end]);
        cuts.sort_unstable();
        cuts.dedup();
        let all_on = cuts
            .windows(2)
            .all(|w| of_pair().rfind(|&&(f, t, _)| f <= w[0] && w[1] <= t).is_some_and(|&(_, _, a)| a == on));
        if all_on && offset < end {
            out[pair] = Some(on);
        }
    }
    out
}

/// The parts of `[old, old + len)` that were locked, at their new place `new`: a range locked
/// as a whole grows locked to `new_len`, as VM_LOCKED does.
fn moved_locks(locked: &[(usize, usize)], old: usize, len: usize, new: usize, new_len: usize) -> Vec<(usize, usize)> {
    let wholly = locked == [(old, old + len)];
    let moved = |&(a, b): &(usize, usize)| (new + (a - old), if wholly { new + new_len } else { new + (b - old) });
    locked.iter().map(moved).collect()
}

fn locked_bytes(parts: &[(usize, usize)]) -> usize {
    parts.iter().map(|&(a, b)| b - a).sum()
}

/// Bytes the locks of `[old, old + len)` cover once moved and resized to `new_len`.
fn moved_lock_bytes(locked: &[(usize, usize)], old: usize, len: usize, new_len: usize) -> usize {
    locked_bytes(&moved_locks(locked, old, len, 0, new_len))
}

/// Lock again, at their new place, the parts of `[old, old + len)` that were locked, out of
/// the quota `reservation` set aside for them.
fn relock_moved(
    locked: &[(usize, usize)],
    old: usize,
    len: usize,
    new: usize,
    new_len: usize,
    reservation: &mut crate::lock::Reservation,
) {
    for (a, b) in moved_locks(locked, old, len, new, new_len) {
        crate::lock::relock(a, b, reservation);
    }
}

/// Take back every handed-over piece inside `[start, end)`, whichever regions they are of.
fn take_back_all(start: usize, end: usize) {
    if start >= end {
        return;
    }
    let mut table = registry::lock();
    for base in registry::overlapping(&table, start, end - start) {
        let pieces: Vec<(usize, usize)> = table[&base]
            .handed_over
            .iter()
            .map(|&(a, b)| ((base + a).max(start), (base + b).min(end)))
            .filter(|&(a, b)| a < b)
            .collect();
        for (a, b) in pieces {
            take_back(&mut table, base, a, b, Reserve::IfFree);
        }
    }
}

/// Apply `managed` to the managed parts of `[start, end)` (as offset and length in their
/// region) and the kernel's madvise with `advice` to the parts between them. None, doing
/// nothing, when no part is managed or in a forked child (whose memory the engine does not
/// serve): the caller then passes the whole call to the kernel. Otherwise madvise's result: 0,
/// or -1 with the errno of the first part the kernel refused (the other parts advised still,
/// as the kernel goes on past a refused mapping).
fn advise_managed(
    start: usize,
    end: usize,
    advice: i32,
    managed: impl Fn(&tiermem_engine::Region, usize, usize) -> tiermem_engine::Result<()>,
) -> Option<i32> {
    let table = registry::lock();
    let segments = registry::segments(&table, start, end);
    if segments.iter().all(|&(_, _, base)| base.is_none()) || runtime::in_forked_child() {
        return None;
    }
    let mut refused = None;
    for (from, to, managed_by) in segments {
        match managed_by {
            Some(base) => {
                if let Err(e) = managed(&table[&base].region, from - base, to - from) {
                    runtime::say(&["tiermem: madvise() on managed memory: ", &e.to_string()]);
                }
            }
            // The caller's own advice on memory that is not managed.
            None => {
                if crate::io::sys!(libc::SYS_madvise, from, to - from, advice) != 0 && refused.is_none() {
                    refused = Some(runtime::errno());
                }
            }
        }
    }
    Some(match refused {
        Some(errno) => {
            runtime::set_errno(errno);
            -1
        }
        None => 0,
    })
}

/// A protection change of managed memory waits while reclaim copies out pages the program made
/// read-only or inaccessible (see `Engine::protection_change`), so none becomes writable between
/// the copy and the drop. Everything else goes to the kernel as it is.
fn change_protection(addr: usize, len: usize, kernel_call: impl FnOnce() -> libc::c_long) -> i32 {
    let end = addr.saturating_add(len.max(1));
    // The registry's regions, and the small heap's chunks (regions outside it: a page of a block
    // the program protects).
    let child = runtime::in_forked_child();
    let in_registry = !child
        && registry::may_overlap(addr, len.max(1))
        && !registry::overlapping(&registry::lock(), addr, len.max(1)).is_empty();
    // (The heap's bounds are atomics: a handler's mprotect there takes no lock of the shim's.)
    let in_heap = !child && (crate::heap::contains(addr) || crate::heap::first_chunk_start_in(addr, end).is_some());
    let Some(engine) = runtime::running_engine().filter(|_| in_registry || in_heap) else {
        return kernel_call() as i32;
    };
    // No signal handler may run while the change is held: one touching evicted memory would
    // wait for reclaim, which waits for the change to end.
    crate::signals::holding_signals(|| {
        let rc = {
            let _change = engine.protection_change();
            kernel_call()
        };
        let errno = runtime::errno();
        if in_registry {
            let mut table = registry::lock();
            for base in registry::overlapping(&table, addr, len.max(1)) {
                if let Some(entry) = table.get_mut(&base) {
                    entry.protection_changed = true;
                }
            }
        }
        runtime::set_errno(errno);
        rc
    }) as i32
}

/// mprotect for tiermem's own changes to the program's managed mappings, under the same lock.
pub(crate) fn protect(start: usize, len: usize, prot: i32) {
    change_protection(start, len, || crate::io::sys!(libc::SYS_mprotect, start, len, prot) as libc::c_long);
}

/// # Safety
/// The C contract of mprotect.
#[no_mangle]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: i32) -> i32 {
    if let Some(rc) = commit_managed(addr as usize, len, prot) {
        return rc;
    }
    // The caller's own mprotect, passed to the kernel unchanged.
    change_protection(addr as usize, len, || crate::io::sys!(libc::SYS_mprotect, addr, len, prot) as libc::c_long)
}

/// The program making reserved address space usable: mprotect to read-write of at least the
/// commit threshold, all inside one private anonymous PROT_NONE mapping that no region holds.
/// V8 (Node's JavaScript heap) commits its heap this way, in 256 KiB pieces. The kernel changes
/// the protection; then, if no page there holds data (kept while inaccessible, or brought in
/// because the range is locked) and the range is not locked, the engine takes it over as a
/// region of its own, as for memory mapped at the program's own address. None: not such a
/// call, which the caller passes on as it is. Else the call's result.
fn commit_managed(start: usize, len: usize, prot: i32) -> Option<i32> {
    if prot != libc::PROT_READ | libc::PROT_WRITE
        || len < runtime::commit_threshold()
        || !start.is_multiple_of(PAGE_SIZE)
    {
        return None;
    }
    let end = start.checked_add(len.checked_next_multiple_of(PAGE_SIZE)?)?;
    if runtime::in_forked_child() {
        return None;
    }
    // Asked before any lock is taken (a signal handler's mprotect of memory that is not a
    // reservation must not wait on the registry).
    let mut vma = [tiermem_sys::mem::Vma::default(); 2];
    let reserved = matches!(tiermem_sys::mem::vmas(start, end, &mut vma), Ok(1))
        && vma[0].start <= start
        && end <= vma[0].end
        && vma[0].prot == libc::PROT_NONE
        && !vma[0].shared
        && !vma[0].file;
    if !reserved || kept_for_kernel(start, end) {
        return None;
    }
    // Started (if this is the first managed memory) before the registry is locked, as for any
    // other allocation.
    let engine = runtime::engine();
    let mut table = registry::lock();
    // Regions are looked for here, not with `may_overlap` (a bounding range, which V8's heap
    // pages, placed at random, soon cover); the small heap's chunks are regions outside the
    // registry (a block of it the program protected and opens again).
    let managed = !registry::overlapping(&table, start, end - start).is_empty()
        || crate::heap::contains(start)
        || crate::heap::first_chunk_start_in(start, end).is_some();
    if managed {
        drop(table);
        return None;
    }
    // The caller's own mprotect, passed to the kernel unchanged.
    let rc = crate::io::sys!(libc::SYS_mprotect, start, len, prot) as i32;
    if rc != 0 {
        return Some(rc);
    }
    let adopted = empty_and_unlocked(start, end).and_then(|()| {
        // SAFETY: `start..end` is private anonymous read-write memory the program made usable
        // with the call that has not returned yet, no region holds it, and no page of it
        // holds data.
        unsafe { adopt_mapping(engine, &mut table, start, end) }
    });
    match adopted {
        Ok(()) => {
            runtime::COMMITTED_ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            runtime::COMMITTED_BYTES.fetch_add((end - start) as u64, std::sync::atomic::Ordering::Relaxed);
        }
        Err(e) => {
            // Said once the registry is unlocked: a message may go through the shim's own write().
            drop(table);
            crate::alloc::note_unmanaged("reserved memory the program made accessible stays the kernel's", &e);
        }
    }
    Some(0)
}

/// Ok when no page of `[start, end)` holds data (the engine must see every page's first touch;
/// PAGEMAP_SCAN, Linux >= 6.7) and the range is not locked: with nothing there to lose,
/// MADV_DONTNEED tells, failing on a lock (MLOCK_ONFAULT brings no page in, and the engine
/// could never evict a locked one).
fn empty_and_unlocked(start: usize, end: usize) -> Result<(), String> {
    // Kept open once opened (a failure, such as no descriptor left, is tried again next time).
    static PAGEMAP: std::sync::OnceLock<tiermem_sys::pagemap::Pagemap> = std::sync::OnceLock::new();
    if PAGEMAP.get().is_none() {
        let opened = tiermem_sys::pagemap::Pagemap::open_self().map_err(|e| e.to_string())?;
        let _ = PAGEMAP.set(opened);
    }
    let Some(pagemap) = PAGEMAP.get() else { return Err("/proc/self/pagemap is not open".to_string()) };
    match pagemap.any_mapped(start, end) {
        Ok(false) => {}
        Ok(true) => return Err("some of its pages hold data".to_string()),
        Err(e) => return Err(format!("PAGEMAP_SCAN: {e}")),
    }
    // No page holds data (just checked): the advice drops nothing.
    if crate::io::sys!(libc::SYS_madvise, start, end - start, libc::MADV_DONTNEED) != 0 {
        return Err("it is locked".to_string());
    }
    Ok(())
}

/// # Safety
/// The C contract of pkey_mprotect.
#[no_mangle]
pub unsafe extern "C" fn pkey_mprotect(addr: *mut c_void, len: usize, prot: i32, pkey: i32) -> i32 {
    // The caller's own pkey_mprotect, passed to the kernel unchanged.
    let rc = change_protection(addr as usize, len, || {
        crate::io::sys!(libc::SYS_pkey_mprotect, addr, len, prot, pkey) as libc::c_long
    });
    if rc == 0 && pkey > 0 {
        keep_for_kernel(addr as usize, len);
    }
    rc
}

/// # Safety
/// The C contract of madvise.
#[no_mangle]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: i32) -> i32 {
    let rc = madvise_call(addr, len, advice);
    if rc == 0 && advice == libc::MADV_WIPEONFORK {
        keep_for_kernel(addr as usize, len);
    }
    rc
}

fn madvise_call(addr: *mut c_void, len: usize, advice: i32) -> i32 {
    let start = addr as usize;
    if registry::may_overlap(start, len) && start.is_multiple_of(PAGE_SIZE) {
        let end = start.saturating_add(len.next_multiple_of(PAGE_SIZE));
        match advice {
            // Huge pages would bring in and pin 512 pages behind the engine's back.
            libc::MADV_HUGEPAGE | libc::MADV_NOHUGEPAGE | libc::MADV_COLLAPSE => {
                let table = registry::lock();
                if registry::segments(&table, start, end).iter().any(|&(_, _, base)| base.is_some()) {
                    return 0;
                }
            }
            // Locked pages refuse these (MADV_DONTNEED_LOCKED is the one meant for them).
            libc::MADV_DONTNEED | libc::MADV_FREE if crate::lock::any_locked(start, end) => {
                runtime::set_errno(libc::EINVAL);
                return -1;
            }
            // Managed memory is private and anonymous, which MADV_REMOVE (shared memory only)
            // refuses, as the kernel would, doing nothing.
            libc::MADV_REMOVE if !runtime::in_forked_child() => {
                let table = registry::lock();
                if registry::segments(&table, start, end).iter().any(|&(_, _, base)| base.is_some()) {
                    runtime::set_errno(libc::EINVAL);
                    return -1;
                }
            }
            // "These pages may be dropped and read as zeros": tell the engine.
            libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_DONTNEED_LOCKED => {
                if let Some(rc) = advise_managed(start, end, advice, |region, offset, len| region.discard(offset, len))
                {
                    return rc;
                }
            }
            // Fork advice: the kernel applies it to the mapping (below); the region remembers
            // it too, so a forked child's copy of evicted pages leaves those pages out.
            libc::MADV_WIPEONFORK | libc::MADV_KEEPONFORK | libc::MADV_DONTFORK | libc::MADV_DOFORK
                if !runtime::in_forked_child() =>
            {
                // The caller's own advice, passed to the kernel unchanged.
                let rc = crate::io::sys!(libc::SYS_madvise, addr, len, advice) as i32;
                if rc == 0 {
                    // Only advice the kernel took: the child's mapping follows it.
                    let mut table = registry::lock();
                    for base in registry::overlapping(&table, start, end - start) {
                        let entry = table.get_mut(&base).expect("listed above");
                        let (from, to) = (base.max(start) - base, (base + entry.len()).min(end) - base);
                        // Earlier advice of the same pair that this covers says nothing any more.
                        let pair = |a: i32| match a {
                            libc::MADV_WIPEONFORK | libc::MADV_KEEPONFORK => 0,
                            _ => 1,
                        };
                        entry.fork_advice.retain(|&(f, t, a)| !(pair(a) == pair(advice) && from <= f && t <= to));
                        entry.fork_advice.push((from, to, advice));
                    }
                }
                return rc;
            }
            // Hints about use: the engine's access monitor acts on them (reads will-need pages
            // ahead, tells the prefetcher of a sequential walk, evicts cold pages first).
            // MADV_PAGEOUT counts as cold: the engine evicts only when it needs room.
            libc::MADV_WILLNEED | libc::MADV_SEQUENTIAL | libc::MADV_COLD | libc::MADV_PAGEOUT => {
                let hint = match advice {
                    libc::MADV_WILLNEED => Advice::WillNeed,
                    libc::MADV_SEQUENTIAL => Advice::Sequential,
                    _ => Advice::Cold,
                };
                if let Some(rc) =
                    advise_managed(start, end, advice, |region, offset, len| region.advise(offset, len, hint))
                {
                    return rc;
                }
            }
            _ => {}
        }
    }
    // The caller's own advice, passed to the kernel unchanged.
    crate::io::sys!(libc::SYS_madvise, addr, len, advice) as i32
}
