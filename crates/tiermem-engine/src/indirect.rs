//! Indirect prefetching (`EngineConfig::indirect`): misses at `data[index[i]]`, where `index`
//! is an array the program walks in order, predicted from the index array itself.
//!
//! No address pattern predicts such misses: igraph's conversion of a graph for PageRank reads
//! each edge's weight, source and target at the positions an edge order array lists, at
//! random, and at 20% of its footprint nearly every one is a critical read. The pattern is in
//! the faulting instruction instead (the idea of hardware indirect-memory prefetchers, Yu et
//! al., MICRO 2015), which a SIGBUS delivers with the fault: its registers.
//!
//! - **The access.** A load `data[k]` compiles to an address `base + k × scale`: among the
//!   general registers at the fault, a pair and a scale (1, 2, 4, 8) that give the exact
//!   faulting address, the index small, the base inside the same region, and the offset past
//!   the base's first page (an offset within it is a structure's field as often as an element).
//! - **Where `k` came from.** A search of memory the registers point at for the value `k` (or
//!   `k / unit` where the compiler scaled the index into a byte offset already): next to a
//!   register (`*p`, `p[±1]`, a pointer walking the index array), in a managed array a register
//!   holds, at a loop counter another holds (`p[j]`, `p[j ± 1]`), or in one reached through a
//!   descriptor (`(*p)[j]`, as igraph's vectors are); only index arrays in managed memory are
//!   followed. It runs for a critical fault at an instruction that has missed [`SEARCH_AFTER`]
//!   times and is not learned yet, once per [`LEARN_EVERY`] faults at most, since it costs up
//!   to a few hundred system calls. After [`LEARN_TRIES`] failed searches in a row the
//!   instruction is given up on, until [`RETRY_AFTER`] more critical faults there earn it one
//!   more (a search fails while the index array is evicted, and one instruction may gather
//!   through several arrays in turn: giving up for good lost PageRank at 20% a quarter of its
//!   read-ahead in 3 of 10 runs, each then 1.3–1.7x as slow).
//! - **Trust.** A source is used once [`CONFIRMATIONS`] faults in a row, each with a new index,
//!   found their index where it says, and forgotten after [`MISSES_TO_FORGET`] that did not, or
//!   when most of the elements it leads to would fall outside the data (a counter that happened
//!   to equal the index leads to whatever lies next to it).
//! - **Prediction.** The next [`AHEAD`] elements of the index array, in the direction it is
//!   walked (igraph's radix sort walks one downwards), are read and the pages they name read
//!   ahead on the prefetch queue, nearest first. A later fault at the same instruction goes on
//!   from where that stopped: the end of the window, or the first page the budget had no room
//!   for (where background reclaim left less than [`MIN_ROOM`] pages of room, the faulting
//!   thread evicts a batch or two first).
//!
//! All memory is read with `process_vm_readv` on the process itself: a page that is not there
//! (evicted, or not mapped at all) fails the read with EFAULT instead of faulting, so the search
//! is safe from the SIGBUS handler. Pages of the regions a handler thread serves (the
//! small-object heap) are read only while resident: for those the kernel would wait for that
//! thread to read the page in ([`Memory`]). It runs after the fault is resolved, with no engine lock held;
//! one thread at a time (others faulting meanwhile go without: the table is only tried).
//! x86-64 only (the register file of the signal context), and only in `sigbus` fault mode, where
//! the faulting thread runs the handler; a userfaultfd message carries no registers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::engine::Shared;
use crate::page::Kind;
use crate::policy::PageList;
use crate::stats::{Path, Stats};

/// Instructions remembered (learned, being learned, or given up on; the least recently
/// faulting one makes room).
const SITES: usize = 128;
/// Faults between two searches for an index source, at least: a search reads memory with up to
/// a few hundred system calls, and a program may fault at many instructions that index nothing.
const LEARN_EVERY: u64 = 16;
/// Index elements read ahead of the current one.
pub(crate) const AHEAD: usize = 128;
/// Critical faults at an instruction before its index source is searched for: a gather misses
/// at one instruction again and again, while an interpreter's collector misses once each at
/// hundreds (each of which would cost a search).
const SEARCH_AFTER: u8 = 4;
/// Failed searches in a row for an instruction's index source before it is given up on (a
/// source that was trusted once gives the instruction its tries back).
const LEARN_TRIES: u8 = 6;
/// Critical faults at an instruction given up on before it gets one more search: the same
/// instruction may gather through another index array later (igraph's radix sort, once by
/// source and once by target), or have missed only while its index array was evicted.
const RETRY_AFTER: u16 = 512;
/// Faults in a row with a new index each, found where the source says, before it is used.
const CONFIRMATIONS: u8 = 2;
/// Faults in a row whose index was not where the source said before the source is forgotten.
const MISSES_TO_FORGET: u8 = 4;
/// Room for read-ahead pages a fault makes by evicting, where background reclaim left less.
const MIN_ROOM: usize = 32;
/// Indexes above this are taken for addresses, not indexes.
const MAX_INDEX: u64 = 1 << 36;
/// The general registers of the x86-64 signal context (`gregs` indices), all but RSP and RIP:
/// R8–R15, RDI, RSI, RBP, RBX, RDX, RAX, RCX.
const GPRS: [usize; 15] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
/// `gregs` index of the instruction pointer.
pub(crate) const REG_RIP: usize = 16;

/// The registers of a fault: `gregs` of the signal context.
pub(crate) type Registers = [u64; 23];

/// Where an instruction's index value lies, relative to its registers at the fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Source {
    /// The register holding the array's address (or, `through`, the address of a pointer to it;
    /// without a `position`, the element's own address).
    pointer: u8,
    /// The array's address is read from where `pointer` points (a vector's descriptor).
    through: bool,
    /// The register holding the element number in the array.
    position: Option<u8>,
    /// Elements from the register's element to the current one.
    offset: i8,
    /// Bytes an element takes (4 or 8).
    width: u8,
    /// The faulting access's index is the element's value times this (1, 2, 4 or 8).
    unit: u8,
}

/// How an instruction forms its address: `regs[base] + regs[index] × scale`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Access {
    base: u8,
    index: u8,
    scale: u8,
}

#[derive(Debug, Clone, Copy)]
struct Site {
    ip: u64,
    access: Option<Access>,
    source: Option<Source>,
    /// Faults in a row, each with an index other than the one before, that found their index
    /// where the source says: the source is used from [`CONFIRMATIONS`] on.
    confirmations: u8,
    /// The index of the last fault here.
    last_index: u64,
    /// Trusted once already (counted in the statistics).
    counted: bool,
    learn_tries: u8,
    /// Critical faults since the instruction was given up on (up to [`RETRY_AFTER`]).
    given_up_faults: u16,
    /// Critical faults here so far (up to [`SEARCH_AFTER`]).
    critical_faults: u8,
    misses: u8,
    /// The index element of the last fault the source was trusted at.
    last_at: u64,
    /// The program walks the index array downwards (the last two trusted faults say so).
    backward: bool,
    /// The edge of what was read ahead: the address just past it going up, its first going down.
    read_until: u64,
    last_used: u64,
}

impl Site {
    fn new(ip: u64) -> Self {
        Self {
            ip,
            access: None,
            source: None,
            confirmations: 0,
            last_index: u64::MAX,
            counted: false,
            learn_tries: 0,
            given_up_faults: 0,
            critical_faults: 0,
            misses: 0,
            last_at: 0,
            backward: false,
            read_until: 0,
            last_used: 0,
        }
    }

    /// Count a critical fault here: towards the first search, and, once the instruction has
    /// been given up on, towards one more.
    fn critical_fault(&mut self) {
        self.critical_faults = (self.critical_faults + 1).min(SEARCH_AFTER);
        if self.learn_tries >= LEARN_TRIES {
            self.given_up_faults += 1;
            if self.given_up_faults >= RETRY_AFTER {
                self.given_up_faults = 0;
                self.learn_tries = LEARN_TRIES - 1;
            }
        }
    }

    /// How this fault's address was formed: as learned, else found again (a new finding drops
    /// the source, which belonged to another index register). None once the instruction has
    /// had its searches.
    fn access_of(&mut self, regs: &Registers, addr: u64, region: (u64, u64), critical: bool) -> Option<Access> {
        if let Some(a) = self.access {
            let formed = regs[a.base as usize].wrapping_add(regs[a.index as usize].wrapping_mul(u64::from(a.scale)));
            if formed == addr {
                return Some(a);
            }
        }
        if self.learn_tries >= LEARN_TRIES {
            return None;
        }
        let Some(found) = decompose(regs, addr, region) else {
            // Only a critical fault's try counts: the others (zero fills, prefetch hits) of an
            // instruction would use its tries up before a miss shows what it indexes.
            self.learn_tries += u8::from(critical);
            return None;
        };
        if self.access != Some(found) {
            self.source = None;
            self.confirmations = 0;
        }
        self.access = Some(found);
        Some(found)
    }
}

/// The learned instructions.
#[derive(Debug)]
pub(crate) struct Indirect {
    table: Mutex<Table>,
    clock: AtomicU64,
}

#[derive(Debug)]
struct Table {
    sites: [Option<Site>; SITES],
    /// The clock at the last search for a source.
    last_search: u64,
}

/// The site of the instruction at `ip`. Only a critical fault opens one (in place of the
/// least recently used): zero fills and hits of read-ahead pages at other instructions would
/// otherwise push learned sites out of the table. Also whether a learned site made room.
fn site_for(sites: &mut [Option<Site>; SITES], ip: u64, critical: bool) -> Option<(&mut Site, bool)> {
    let (slot, displaced) = match sites.iter().position(|s| s.is_some_and(|s| s.ip == ip)) {
        Some(i) => (i, false),
        None if critical => {
            let free = sites.iter().position(Option::is_none);
            let i = free.or_else(|| (0..SITES).min_by_key(|&i| sites[i].map_or(0, |s| s.last_used))).unwrap_or(0);
            let displaced = sites[i].is_some_and(|s| s.source.is_some());
            sites[i] = Some(Site::new(ip));
            (i, displaced)
        }
        None => return None,
    };
    sites[slot].as_mut().map(|s| (s, displaced))
}

impl Indirect {
    pub(crate) fn new() -> Self {
        Self { table: Mutex::new(Table { sites: [None; SITES], last_search: 0 }), clock: AtomicU64::new(0) }
    }
}

/// Read `out.len()` bytes at `addr` of this process; the bytes read (0 if none could be).
fn read_own(addr: u64, out: &mut [u8]) -> usize {
    if addr == 0 || out.is_empty() {
        return 0;
    }
    let local = libc::iovec { iov_base: out.as_mut_ptr().cast(), iov_len: out.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: out.len() };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    // SAFETY: process_vm_readv writes at most `out.len()` bytes into `out`; the remote range is
    // only read by the kernel, which fails the call (EFAULT) where it is not readable instead
    // of faulting this thread. The pid is this process's.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    n.max(0) as usize
}

/// Reads of this process's memory that never wait for a page. The kernel fails a read of a
/// missing page of an ordinary region (its userfaultfd has the SIGBUS feature), but waits for
/// the handler thread to read in one of a region that thread serves (the small-object heap,
/// where index arrays under the threshold and vector descriptors live): such pages are read
/// only while resident.
struct Memory<'a> {
    /// Bytes from an address (of those asked for) that may be read.
    readable: &'a dyn Fn(u64, usize) -> usize,
}

impl Memory<'_> {
    /// Bytes read into `out` from `addr`.
    fn read(&self, addr: u64, out: &mut [u8]) -> usize {
        let n = (self.readable)(addr, out.len()).min(out.len());
        read_own(addr, &mut out[..n])
    }

    fn u64(&self, addr: u64) -> Option<u64> {
        self.element(addr, 8)
    }

    /// An element of `width` bytes at `addr`.
    fn element(&self, addr: u64, width: u8) -> Option<u64> {
        let mut b = [0u8; 8];
        let w = width as usize;
        (self.read(addr, &mut b[..w]) == w).then(|| u64::from_le_bytes(b))
    }
}

fn plausible_pointer(v: u64) -> bool {
    (0x10000..0x7fff_ffff_f000).contains(&v)
}

/// The (base, index, scale) whose address is exactly `addr`, the base a pointer at or below it
/// within `region` (start, end) and the index a small non-zero number.
fn decompose(regs: &Registers, addr: u64, region: (u64, u64)) -> Option<Access> {
    for scale in [8u8, 4, 2, 1] {
        for &b in &GPRS {
            let base = regs[b];
            if base < region.0 || base > addr || base >= region.1 {
                continue;
            }
            for &i in &GPRS {
                let index = regs[i];
                // An offset within the first page of the base is a field of a structure as
                // often as an element of an array: not taken.
                let offset = index.wrapping_mul(u64::from(scale));
                if i == b || index >= MAX_INDEX || offset < tiermem_sys::PAGE_SIZE as u64 {
                    continue;
                }
                if base.wrapping_add(offset) == addr {
                    return Some(Access { base: b as u8, index: i as u8, scale });
                }
            }
        }
    }
    None
}

/// The values an index array may hold for an access with index `index` at `scale`: the index
/// itself, or, where the compiler scaled it to bytes (scale 1), the index over the element size.
fn stored_values(index: u64, scale: u8) -> impl Iterator<Item = (u64, u8)> {
    let units: &[u8] = if scale == 1 { &[8, 4, 2, 1] } else { &[1] };
    units.iter().filter(move |&&u| index.is_multiple_of(u64::from(u))).map(move |&u| (index / u64::from(u), u))
}

/// The address of the current index element under `source`, if its registers allow one.
fn element_address(memory: &Memory, regs: &Registers, source: &Source) -> Option<u64> {
    let at = regs[source.pointer as usize];
    let array = if source.through { memory.u64(at)? } else { at };
    let element = source.position.map_or(0, |j| regs[j as usize] as i64) + i64::from(source.offset);
    Some(array.wrapping_add_signed(element.wrapping_mul(i64::from(source.width))))
}

/// Search memory the registers point at for the index value of this fault: next to a register
/// (`*p`, `p[±1]`, a pointer walking the array), or in an array inside managed memory that a
/// register holds (`p[j]`, `p[j ± 1]`, a loop counter `j`) or points to the address of
/// (`(*p)[j]`, an array reached through its descriptor).
/// Only index arrays inside managed memory are followed (`in_managed` gives a managed
/// address's region bounds).
fn learn(
    memory: &Memory,
    regs: &Registers,
    access: &Access,
    in_managed: &dyn Fn(u64) -> Option<(u64, u64)>,
) -> Option<Source> {
    let index = regs[access.index as usize];
    let matches = |value: u64| -> Option<u8> {
        stored_values(index, access.scale).find(|&(stored, _)| value == stored).map(|(_, unit)| unit)
    };
    let source = |pointer: usize, through: bool, position: Option<usize>, offset: i8, width: u8, unit: u8| Source {
        pointer: pointer as u8,
        through,
        position: position.map(|j| j as u8),
        offset,
        width,
        unit,
    };
    for &p in &GPRS {
        if p == access.index as usize || p == access.base as usize {
            continue;
        }
        let at = regs[p];
        if !plausible_pointer(at) || in_managed(at).is_none() {
            continue;
        }
        for width in [8u8, 4] {
            for offset in [-1i8, 0, 1] {
                let addr = at.wrapping_add_signed(i64::from(offset) * i64::from(width));
                if let Some(unit) = memory.element(addr, width).and_then(matches) {
                    return Some(source(p, false, None, offset, width, unit));
                }
            }
        }
    }
    for through in [false, true] {
        for &p in &GPRS {
            let at = regs[p];
            if p == access.base as usize || !plausible_pointer(at) || (through && !at.is_multiple_of(8)) {
                continue;
            }
            let array = if through { memory.u64(at).filter(|&a| plausible_pointer(a)) } else { Some(at) };
            let Some(array) = array else { continue };
            let Some((_, end)) = in_managed(array) else { continue };
            for &j in &GPRS {
                let position = regs[j];
                if j == p || position == 0 || position >= MAX_INDEX {
                    continue;
                }
                for width in [8u8, 4] {
                    for offset in [0i8, -1, 1] {
                        let Some(element) = position.checked_add_signed(i64::from(offset)) else { continue };
                        let addr = array.wrapping_add(element.wrapping_mul(u64::from(width)));
                        if addr >= end {
                            continue;
                        }
                        if let Some(unit) = memory.element(addr, width).and_then(matches) {
                            return Some(source(p, through, Some(j), offset, width, unit));
                        }
                    }
                }
            }
        }
    }
    None
}

/// A fault at `addr` was resolved on this thread, with `regs` its registers: learn its
/// instruction, or read ahead what its index array says comes next. `critical`: the fault read
/// its page from the device (only such faults pay for a search).
pub(crate) fn after_fault(shared: &Shared, indirect: &Indirect, addr: usize, regs: &Registers, critical: bool) {
    let addr = addr as u64;
    let ip = regs[REG_RIP];
    // The bounds of the managed region holding `a`, if one does.
    let bounds_of = |a: u64| -> Option<(u64, u64, u32)> {
        let regions = shared.regions();
        let r = regions.find(a as usize)?;
        let start = r.start() as u64;
        Some((start, start + r.page_count() * tiermem_sys::PAGE_SIZE as u64, r.index))
    };
    let now = indirect.clock.fetch_add(1, Ordering::Relaxed);
    // One thread at a time learns and predicts; another fault meanwhile goes without (and
    // without looking up its region first).
    let Ok(mut table) = indirect.table.try_lock() else { return };
    let Some((lo, hi, region_index)) = bounds_of(addr) else { return };
    let in_managed = |a: u64| bounds_of(a).map(|(start, end, _)| (start, end));
    let readable = |a: u64, len: usize| -> usize {
        if a >= 1 << 47 {
            return 0;
        }
        let regions = shared.regions();
        let mut ok = 0;
        while ok < len {
            let at = a + ok as u64;
            let in_page = tiermem_sys::PAGE_SIZE - (at as usize % tiermem_sys::PAGE_SIZE);
            if let Some(r) = regions.find(at as usize).filter(|r| r.threaded) {
                if r.pages[r.page_index(at as usize) as usize].peek().kind() != Kind::Resident {
                    break;
                }
            }
            ok += in_page.min(len - ok);
        }
        ok
    };
    let memory = Memory { readable: &readable };
    let may_search = critical && now >= table.last_search + LEARN_EVERY;
    let Table { sites, last_search } = &mut *table;
    let Some((site, displaced)) = site_for(sites, ip, critical) else { return };
    let count = |counter: &AtomicU64| Stats::add(counter, 1);
    if displaced {
        count(&shared.stats.counters.indirect_displaced);
    }
    site.last_used = now;
    if critical {
        site.critical_fault();
    }
    let Some(access) = site.access_of(regs, addr, (lo, hi), critical) else { return };
    let index = regs[access.index as usize];
    let Some(source) = site.source else {
        if site.learn_tries < LEARN_TRIES && may_search && site.critical_faults >= SEARCH_AFTER {
            site.learn_tries += 1;
            *last_search = now;
            site.source = learn(&memory, regs, &access, &in_managed);
            site.confirmations = 0;
            if site.source.is_none() && site.learn_tries == LEARN_TRIES {
                count(&shared.stats.counters.indirect_given_up);
            }
        }
        return;
    };
    // Is this fault's index where the source says, in managed memory, and a new one?
    let at = element_address(&memory, regs, &source).filter(|&a| in_managed(a).is_some());
    let found = at.and_then(|a| memory.element(a, source.width));
    let unit = u64::from(source.unit);
    if found.is_none() || found != Some(index / unit) || !index.is_multiple_of(unit) {
        site.confirmations = 0;
        site.misses += 1;
        if site.misses >= MISSES_TO_FORGET {
            site.source = None;
            site.misses = 0;
            count(&shared.stats.counters.indirect_forgotten);
        }
        return;
    }
    site.misses = 0;
    if site.last_index != index {
        site.confirmations = site.confirmations.saturating_add(1);
    }
    site.last_index = index;
    let Some(at) = at.filter(|_| site.confirmations >= CONFIRMATIONS) else { return };
    // The source works: the tries count failed searches since.
    site.learn_tries = 0;
    // The next elements in the direction of the walk, after what an earlier fault here read
    // ahead already.
    let width = u64::from(source.width);
    if site.last_at != 0 && at != site.last_at {
        let backward = at < site.last_at;
        if backward != site.backward {
            site.read_until = 0;
        }
        site.backward = backward;
    }
    site.last_at = at;
    let span = width * AHEAD as u64;
    let backward = site.backward;
    // What is left of the window: past what an earlier fault read ahead (its edge recorded
    // once read, below).
    let (from, to) = if backward {
        let lowest = at.saturating_sub(span);
        (lowest, if (lowest..at).contains(&site.read_until) { site.read_until } else { at })
    } else {
        let (first, end) = (at + width, at + width + span);
        (if (first..=end).contains(&site.read_until) { site.read_until } else { first }, end)
    };
    let mut bytes = [0u8; AHEAD * 8];
    let want = ((to.saturating_sub(from)) as usize).min(bytes.len());
    let got = memory.read(from, &mut bytes[..want]) / width as usize;
    if got == 0 || (backward && got * width as usize != want) {
        // Nothing to read, or, going down, a short read: it holds the elements farthest away,
        // none of them next.
        if want > 0 {
            count(&shared.stats.counters.indirect_unreadable);
        }
        return;
    }
    let element = |k: usize| {
        let raw = &bytes[k * width as usize..(k + 1) * width as usize];
        if width == 8 {
            u64::from_le_bytes(raw.try_into().unwrap_or([0; 8]))
        } else {
            u64::from(u32::from_le_bytes(raw.try_into().unwrap_or([0; 4])))
        }
    };
    let base = regs[access.base as usize];
    let target_of = |k: usize| base.wrapping_add(element(k).wrapping_mul(unit).wrapping_mul(u64::from(access.scale)));
    // Values that land outside the data's region are not its indexes: a source that matched
    // by chance (a counter that equals the index) leads to whatever lies next to it.
    let inside = (0..got).filter(|&k| (lo..hi).contains(&target_of(k))).count();
    if inside * 2 < got {
        site.source = None;
        site.confirmations = 0;
        count(&shared.stats.counters.indirect_forgotten);
        return;
    }
    if !site.counted {
        site.counted = true;
        Stats::add(&shared.stats.counters.indirect_learned, 1);
    }
    // Read ahead nearest first. The table stays locked (other threads only try it): where the
    // budget has no room for the whole window, the next fault here starts where this one stopped.
    let faulting_page = addr / tiermem_sys::PAGE_SIZE as u64;
    let mut pages = PageList::default();
    // The element (in walking order) each page in `pages` came from.
    let mut elements = [0usize; PageList::CAPACITY];
    let mut last = u64::MAX;
    let mut read = 0;
    // The first element (in walking order) not read ahead for want of room.
    let mut stopped = None;
    for n in 0..got {
        let target = target_of(if backward { got - 1 - n } else { n });
        let page = target / tiermem_sys::PAGE_SIZE as u64;
        if !(lo..hi).contains(&target) || page == faulting_page || page == last {
            continue;
        }
        last = page;
        elements[pages.as_slice().len()] = n;
        pages.push((target - lo) / tiermem_sys::PAGE_SIZE as u64);
        if pages.as_slice().len() == PageList::CAPACITY {
            stopped = read_batch(shared, region_index, lo, &pages, &elements, &mut read);
            if stopped.is_some() {
                break;
            }
            pages = PageList::default();
        }
    }
    if stopped.is_none() && !pages.as_slice().is_empty() {
        stopped = read_batch(shared, region_index, lo, &pages, &elements, &mut read);
    }
    if stopped.is_some() {
        count(&shared.stats.counters.indirect_room_stops);
    }
    // The edge of what was read ahead: where room ran out, else the end of what was read.
    let covered = stopped.unwrap_or(got);
    site.read_until = if backward { to - covered as u64 * width } else { from + covered as u64 * width };
    drop(table);
    Stats::add(&shared.stats.counters.indirect_prefetched, read as u64);
}

/// Read a batch of pages ahead (see [`read_pages`]), adding the pages read to `read`; the
/// element the first page left unread came from, if room ran out.
fn read_batch(
    shared: &Shared,
    region_index: u32,
    start: u64,
    pages: &PageList,
    elements: &[usize],
    read: &mut usize,
) -> Option<usize> {
    let done = read_pages(shared, region_index, start, pages);
    *read += done.pages;
    (done.looked_at < pages.as_slice().len()).then(|| elements[done.looked_at])
}

/// Read `pages` of the region at slot `region_index` (still the one starting at `start`) ahead.
fn read_pages(shared: &Shared, region_index: u32, start: u64, pages: &PageList) -> crate::fault::ReadAhead {
    let regions = shared.regions();
    match regions.get(region_index).filter(|r| !r.is_closing() && r.start() as u64 == start) {
        Some(region) => {
            // Background reclaim keeps about 2% of the budget free less a reclaim batch: on a
            // small budget a few pages, and the window was cut to those. Up to [`MIN_ROOM`] is
            // made here, each page evicted now sparing a critical read later; more, and the
            // pages evicted were those other windows had read ahead (PageRank at 20%: 73 s
            // against 49 with the whole window's room made on every fault).
            let room = shared.prefetch_room() as usize;
            let want = pages.as_slice().len().min(MIN_ROOM);
            if room < want {
                crate::reclaim::evict_batch(shared, &regions, want - room, Path::DirectReclaim);
            }
            crate::fault::read_ahead(shared, region, pages.as_slice(), None)
        }
        None => crate::fault::ReadAhead::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads that may touch anything (the tests' memory is the test's own).
    const ANYTHING: Memory<'static> = Memory { readable: &|_, len| len };

    fn regs_with(values: &[(usize, u64)]) -> Registers {
        let mut r = [0u64; 23];
        for &(i, v) in values {
            r[i] = v;
        }
        r
    }

    #[test]
    fn an_access_is_split_into_base_index_and_scale() {
        // movsd (%r10,%rdx,8): r10 = gregs[2], rdx = gregs[12].
        let base = 0x7f00_0000_0000u64;
        let regs = regs_with(&[(2, base), (12, 1234), (13, 7)]);
        let addr = base + 1234 * 8;
        assert_eq!(decompose(&regs, addr, (base, base + (1 << 20))), Some(Access { base: 2, index: 12, scale: 8 }));
        // A byte offset (scale 1): the index is the offset, the stored value it over a unit.
        let regs = regs_with(&[(12, base), (9, 1234 * 8)]);
        let got = decompose(&regs, addr, (base, base + (1 << 20))).expect("found");
        assert_eq!((got.base, got.index, got.scale), (12, 9, 1));
        assert_eq!(stored_values(1234 * 8, 1).collect::<Vec<_>>(), vec![(1234, 8), (2468, 4), (4936, 2), (9872, 1)]);
        // A base outside the region, or an index that is an address, is no access.
        assert_eq!(decompose(&regs_with(&[(2, base), (12, 1234)]), addr, (base + 4096, base + (1 << 20))), None);
        assert_eq!(decompose(&regs_with(&[(2, 8), (12, addr - 64)]), addr, (base, base + (1 << 20))), None);
    }

    #[test]
    fn an_index_is_found_through_a_register_or_a_descriptor() {
        // The index array and a descriptor pointing at it, in this process's memory.
        let index: Vec<u64> = (0..100u64).map(|i| (i * 7919) % 1000).collect();
        let descriptor: Box<u64> = Box::new(index.as_ptr() as u64);
        let data = vec![0u8; 8000];
        let base = data.as_ptr() as u64;
        let managed = |a: u64| -> Option<(u64, u64)> {
            let (s, e) = (index.as_ptr() as u64, index.as_ptr() as u64 + 800);
            (s..e).contains(&a).then_some((s, e))
        };
        let j = 42u64;
        let access = Access { base: 2, index: 12, scale: 8 };
        // Chained: rdx = index[j] loaded through the descriptor (r9) at position rax = j.
        let regs = regs_with(&[(2, base), (12, index[j as usize]), (1, &*descriptor as *const u64 as u64), (13, j)]);
        let source = learn(&ANYTHING, &regs, &access, &managed).expect("chained source");
        assert_eq!(source, Source { pointer: 1, through: true, position: Some(13), offset: 0, width: 8, unit: 1 });
        assert_eq!(element_address(&ANYTHING, &regs, &source), Some(index.as_ptr() as u64 + 8 * j));
        // Direct: a register walks the index array itself (one past the element read).
        let regs = regs_with(&[(2, base), (12, index[j as usize]), (11, index.as_ptr() as u64 + 8 * (j + 1))]);
        let source = learn(&ANYTHING, &regs, &access, &managed).expect("direct source");
        // Not in managed memory: not followed.
        assert_eq!(learn(&ANYTHING, &regs, &access, &|_| None), None);
        assert_eq!((source.pointer, source.through, source.position, source.offset), (11, false, None, -1));
        // Indexed: a register holds the array, another the loop counter.
        let regs = regs_with(&[(2, base), (12, index[j as usize]), (4, index.as_ptr() as u64), (13, j)]);
        let source = learn(&ANYTHING, &regs, &access, &managed).expect("indexed source");
        assert_eq!(source, Source { pointer: 4, through: false, position: Some(13), offset: 0, width: 8, unit: 1 });
        // No register leads to the value: nothing learned.
        let regs = regs_with(&[(2, base), (12, 999_999)]);
        assert_eq!(learn(&ANYTHING, &regs, &access, &managed), None);
    }

    #[test]
    fn only_a_critical_fault_opens_a_site_and_the_least_recently_used_makes_room() {
        let mut sites = [None; SITES];
        assert!(site_for(&mut sites, 0x1000, false).is_none(), "a fault that read nothing opens no site");
        assert!(sites.iter().all(Option::is_none));
        for ip in 0..SITES as u64 {
            site_for(&mut sites, 0x1000 + ip, true).expect("opened").0.last_used = ip + 1;
        }
        // Known sites are found again whatever the fault read.
        assert_eq!(site_for(&mut sites, 0x1005, false).map(|(s, _)| s.last_used), Some(6));
        // A full table: a non-critical fault elsewhere changes nothing, a critical one replaces
        // the least recently used site (0x1000, used at 1).
        assert!(site_for(&mut sites, 0x9000, false).is_none());
        assert!(sites.iter().flatten().any(|s| s.ip == 0x1000));
        // 0x1000 had no source yet: no learned site was displaced.
        let (opened, displaced) = site_for(&mut sites, 0x9000, true).expect("opened");
        assert!(!displaced);
        opened.last_used = 1000;
        assert!(!sites.iter().flatten().any(|s| s.ip == 0x1000));
        assert!(sites.iter().flatten().any(|s| s.ip == 0x9000));
        // The next least recently used (0x1001) has learned its source: making room for
        // another says so.
        let learned = Source { pointer: 1, through: false, position: None, offset: 0, width: 8, unit: 1 };
        sites.iter_mut().flatten().find(|s| s.ip == 0x1001).expect("still there").source = Some(learned);
        assert!(site_for(&mut sites, 0x9001, true).expect("opened").1, "a learned site was displaced");
        assert!(!sites.iter().flatten().any(|s| s.ip == 0x1001));
    }

    #[test]
    fn an_instruction_given_up_on_gets_one_more_search_after_many_critical_faults() {
        let mut site = Site::new(0x1000);
        (0..SEARCH_AFTER).for_each(|_| site.critical_fault());
        assert_eq!(site.critical_faults, SEARCH_AFTER);
        site.learn_tries = LEARN_TRIES;
        (1..RETRY_AFTER).for_each(|_| site.critical_fault());
        assert_eq!(site.learn_tries, LEARN_TRIES, "still given up");
        site.critical_fault();
        assert_eq!(site.learn_tries, LEARN_TRIES - 1, "one more search allowed");
        site.critical_fault();
        assert_eq!(site.learn_tries, LEARN_TRIES - 1, "and only one");
    }

    #[test]
    fn memory_that_is_not_mapped_reads_as_nothing() {
        let mut b = [0u8; 8];
        assert_eq!(read_own(8, &mut b), 0);
        assert_eq!(ANYTHING.u64(0x10), None);
        let v = 0x1122_3344_5566_7788u64;
        assert_eq!(ANYTHING.u64(&v as *const u64 as u64), Some(v));
        // A range no page of which may be read reads as nothing.
        assert_eq!(Memory { readable: &|_, _| 0 }.u64(&v as *const u64 as u64), None);
    }
}
