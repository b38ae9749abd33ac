//! Slabs for the small-object heap's blocks of at most 1 KiB: each 4 KiB page of a slab chunk
//! holds blocks of one size class (16 to 128 bytes in steps of 16, then four classes per
//! doubling up to 1024, as jemalloc's) with no header. So a Redis key, its object header and
//! its hash-table entry take 80 bytes instead of the 160 TLSF blocks with headers take, and no
//! block of 1 KiB or less straddles two pages: a 1000-byte value in a TLSF pool did, and every
//! read of it faulted both pages in (and looked sequential to the prefetcher).
//!
//! The bookkeeping (which class a page has, which of its blocks are in use) lives outside the
//! chunks, in this structure: allocating or freeing never touches a page the program is not
//! touching itself, so freeing a cold object costs no page-in. Pure address arithmetic, no
//! memory access: the heap owns the chunks.

use tiermem_sys::PAGE_SIZE;

/// Block sizes, one class each.
pub const CLASS_SIZES: [usize; 20] =
    [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024];
/// Largest request the slabs serve.
pub const MAX_SIZE: usize = 1024;

/// Why a pointer given back is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadBlock {
    /// Not the start of a block in any slab page.
    Unknown,
    /// The block is not in use (freed already).
    Free,
}

#[derive(Debug)]
struct Chunk {
    start: usize,
    pages: usize,
    /// Per page handed out so far (pages are taken front to back): class ([`EMPTY`] for a page
    /// given back, which any class may take) and blocks in use.
    class: Vec<u8>,
    used: Vec<u16>,
    /// Bit set: block in use (at most 256 blocks of 16 bytes a page).
    bits: Vec<[u64; 4]>,
    /// Links of the page's class list of pages with a free block ([`NONE`] at the ends, and for
    /// a page on no list).
    next: Vec<u32>,
    prev: Vec<u32>,
    /// Whether the page is on its class's list.
    listed: Vec<bool>,
}

/// Class of a page none of whose blocks is in use: back in the pool for any class.
const EMPTY: u8 = u8::MAX;
/// No page.
const NONE: u32 = u32::MAX;
/// A page's id: its chunk in the top bits, its index in the chunk below (chunks hold at most
/// 2^24 pages: 64 GiB).
const PAGE_BITS: u32 = 24;

fn page_id(chunk: usize, page: usize) -> u32 {
    (chunk as u32) << PAGE_BITS | page as u32
}

fn split(id: u32) -> (usize, usize) {
    ((id >> PAGE_BITS) as usize, (id & ((1 << PAGE_BITS) - 1)) as usize)
}

/// The slab pages of every slab chunk.
#[derive(Debug)]
pub struct Slabs {
    chunks: Vec<Chunk>,
    /// Per class: the first page of its list of pages with a free block (the one used first).
    partial: [u32; CLASS_SIZES.len()],
    /// Pages whose blocks were all given back, for whichever class needs a page next.
    empty: Vec<u32>,
}

fn class_index(size: usize) -> Option<usize> {
    (size <= MAX_SIZE).then(|| CLASS_SIZES.partition_point(|&c| c < size.max(1)))
}

fn blocks_per_page(class: usize) -> usize {
    PAGE_SIZE / CLASS_SIZES[class]
}

impl Slabs {
    /// No chunks yet.
    pub const fn new() -> Self {
        Self { chunks: Vec::new(), partial: [NONE; CLASS_SIZES.len()], empty: Vec::new() }
    }

    /// Take the page-aligned range `start..start + len` as a new chunk of slab pages.
    pub fn add_chunk(&mut self, start: usize, len: usize) {
        debug_assert!(start.is_multiple_of(PAGE_SIZE) && len.is_multiple_of(PAGE_SIZE));
        debug_assert!(len / PAGE_SIZE <= 1 << PAGE_BITS);
        self.chunks.push(Chunk {
            start,
            pages: len / PAGE_SIZE,
            class: Vec::new(),
            used: Vec::new(),
            bits: Vec::new(),
            next: Vec::new(),
            prev: Vec::new(),
            listed: Vec::new(),
        });
    }

    /// A block of at least `size` bytes (at most [`MAX_SIZE`]), or None when every page is
    /// taken (the heap adds a chunk and asks again).
    pub fn alloc(&mut self, size: usize) -> Option<usize> {
        let class = class_index(size)?;
        if self.partial[class] == NONE {
            let id = self.empty.pop().or_else(|| self.fresh_page())?;
            self.assign(id, class);
            self.link(id, class);
        }
        let (c, page) = split(self.partial[class]);
        let n = blocks_per_page(class);
        let chunk = &mut self.chunks[c];
        let bits = &mut chunk.bits[page];
        let block = (0..4).find_map(|w| {
            let free = !bits[w];
            (free != 0).then(|| w * 64 + free.trailing_zeros() as usize)
        })?;
        debug_assert!(block < n, "a listed page has a free block");
        bits[block / 64] |= 1 << (block % 64);
        chunk.used[page] += 1;
        let start = chunk.start;
        if usize::from(chunk.used[page]) == n {
            self.unlink(page_id(c, page), class);
        }
        Some(start + page * PAGE_SIZE + block * CLASS_SIZES[class])
    }

    /// The next untouched page of the newest chunk with one (class still to assign).
    fn fresh_page(&mut self) -> Option<u32> {
        let (c, chunk) = self.chunks.iter_mut().enumerate().rev().find(|(_, ch)| ch.class.len() < ch.pages)?;
        let page = chunk.class.len();
        chunk.class.push(EMPTY);
        chunk.used.push(0);
        chunk.bits.push([0; 4]);
        chunk.next.push(NONE);
        chunk.prev.push(NONE);
        chunk.listed.push(false);
        Some(page_id(c, page))
    }

    /// Give the empty page `id` to `class`.
    fn assign(&mut self, id: u32, class: usize) {
        let (c, page) = split(id);
        let chunk = &mut self.chunks[c];
        debug_assert!(chunk.class[page] == EMPTY && chunk.used[page] == 0);
        chunk.class[page] = class as u8;
        // Bits past the page's blocks (48-byte class: 85 blocks, 16 bytes left over) count as in
        // use, so they are never handed out.
        let mut bits = [0u64; 4];
        for b in blocks_per_page(class)..256 {
            bits[b / 64] |= 1 << (b % 64);
        }
        chunk.bits[page] = bits;
    }

    /// Put page `id` first on `class`'s list.
    fn link(&mut self, id: u32, class: usize) {
        let head = self.partial[class];
        let (c, page) = split(id);
        let chunk = &mut self.chunks[c];
        debug_assert!(!chunk.listed[page]);
        chunk.listed[page] = true;
        chunk.prev[page] = NONE;
        chunk.next[page] = head;
        if head != NONE {
            let (hc, hp) = split(head);
            self.chunks[hc].prev[hp] = id;
        }
        self.partial[class] = id;
    }

    /// Take page `id` off `class`'s list.
    fn unlink(&mut self, id: u32, class: usize) {
        let (c, page) = split(id);
        let chunk = &mut self.chunks[c];
        debug_assert!(chunk.listed[page]);
        chunk.listed[page] = false;
        let (prev, next) = (chunk.prev[page], chunk.next[page]);
        chunk.prev[page] = NONE;
        chunk.next[page] = NONE;
        if prev == NONE {
            self.partial[class] = next;
        } else {
            let (pc, pp) = split(prev);
            self.chunks[pc].next[pp] = next;
        }
        if next != NONE {
            let (nc, np) = split(next);
            self.chunks[nc].prev[np] = prev;
        }
    }

    fn locate(&self, addr: usize) -> Option<(usize, usize)> {
        let c = self.chunks.iter().position(|ch| ch.start <= addr && addr < ch.start + ch.pages * PAGE_SIZE)?;
        Some((c, (addr - self.chunks[c].start) / PAGE_SIZE))
    }

    /// The page, class and block of the live block starting at `addr`.
    fn live(&self, addr: usize) -> Result<(usize, usize, usize, usize), BadBlock> {
        let (c, page) = self.locate(addr).ok_or(BadBlock::Unknown)?;
        let chunk = &self.chunks[c];
        let class = *chunk.class.get(page).ok_or(BadBlock::Unknown)?;
        if class == EMPTY {
            // Every block of the page was given back.
            return Err(BadBlock::Free);
        }
        let class = usize::from(class);
        let offset = addr - chunk.start - page * PAGE_SIZE;
        let size = CLASS_SIZES[class];
        if !offset.is_multiple_of(size) || offset / size >= blocks_per_page(class) {
            return Err(BadBlock::Unknown);
        }
        let block = offset / size;
        if chunk.bits[page][block / 64] & (1 << (block % 64)) == 0 {
            return Err(BadBlock::Free);
        }
        Ok((c, page, class, block))
    }

    /// Bytes usable in the live block at `addr`.
    pub fn usable_size(&self, addr: usize) -> Result<usize, BadBlock> {
        self.live(addr).map(|(_, _, class, _)| CLASS_SIZES[class])
    }

    /// Give the live block at `addr` back. A page left with no block in use goes back to the
    /// pool for any class; its address is returned then (its contents matter no more).
    pub fn free(&mut self, addr: usize) -> Result<Option<usize>, BadBlock> {
        let (c, page, class, block) = self.live(addr)?;
        let id = page_id(c, page);
        let chunk = &mut self.chunks[c];
        chunk.bits[page][block / 64] &= !(1 << (block % 64));
        chunk.used[page] -= 1;
        let (listed, used) = (chunk.listed[page], chunk.used[page]);
        if used == 0 {
            if listed {
                self.unlink(id, class);
            }
            self.chunks[c].class[page] = EMPTY;
            self.empty.push(id);
            return Ok(Some(self.chunks[c].start + page * PAGE_SIZE));
        } else if !listed {
            self.link(id, class);
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    const BASE: usize = 0x7000_0000_0000;

    #[test]
    fn classes_pack_blocks_without_headers_and_every_page_has_one_class() {
        let mut s = Slabs::new();
        s.add_chunk(BASE, 5 * PAGE_SIZE);
        let a = s.alloc(16).unwrap();
        let b = s.alloc(9).unwrap();
        assert_eq!(b - a, 16, "16-byte blocks are adjacent");
        let e = s.alloc(24).unwrap();
        assert_eq!(s.usable_size(e), Ok(32));
        assert_ne!(e / PAGE_SIZE, a / PAGE_SIZE, "another class, another page");
        // 85 blocks of 48 bytes fill a page; the 86th starts a new one.
        let first = s.alloc(48).unwrap();
        let rest: Vec<usize> = (0..84).map(|_| s.alloc(40).unwrap()).collect();
        assert!(rest.iter().all(|&x| x / PAGE_SIZE == first / PAGE_SIZE));
        assert_ne!(s.alloc(48).unwrap() / PAGE_SIZE, first / PAGE_SIZE);
        assert_eq!(s.alloc(1025), None, "larger requests are not slab requests");
        // The fifth page goes to 64-byte blocks; then the chunk is full.
        s.alloc(64).unwrap();
        assert_eq!(s.chunks[0].class.len(), 5);
        assert_eq!(s.alloc(1).map(|_| ()), Some(()), "the 16-byte page still has room");
        assert_eq!(s.alloc(20).map(|_| ()), Some(()), "and the 32-byte one");
        let mut s2 = Slabs::new();
        s2.add_chunk(BASE, PAGE_SIZE);
        s2.alloc(16).unwrap();
        assert_eq!(s2.alloc(32), None, "no fresh page left for another class");
        s2.add_chunk(BASE + 16 * PAGE_SIZE, PAGE_SIZE);
        assert_eq!(s2.alloc(32), Some(BASE + 16 * PAGE_SIZE));
    }

    #[test]
    fn every_size_gets_the_smallest_class_that_holds_it_and_blocks_never_straddle_pages() {
        for size in 0..=MAX_SIZE {
            let class = class_index(size).unwrap();
            assert!(CLASS_SIZES[class] >= size.max(1));
            assert!(class == 0 || CLASS_SIZES[class - 1] < size.max(1), "{size}");
        }
        assert_eq!(class_index(MAX_SIZE + 1), None);
        let mut s = Slabs::new();
        s.add_chunk(BASE, 64 * PAGE_SIZE);
        for _ in 0..10 {
            for &size in &CLASS_SIZES {
                let a = s.alloc(size).unwrap();
                assert_eq!(a / PAGE_SIZE, (a + size - 1) / PAGE_SIZE, "a {size}-byte block straddles a page");
            }
        }
    }

    #[test]
    fn a_page_given_back_serves_another_class() {
        let mut s = Slabs::new();
        s.add_chunk(BASE, 2 * PAGE_SIZE);
        let small: Vec<usize> = (0..256).map(|_| s.alloc(16).unwrap()).collect();
        assert!(small.iter().all(|&a| a / PAGE_SIZE == BASE / PAGE_SIZE), "one full page of 16-byte blocks");
        let other = s.alloc(1024).unwrap();
        assert_eq!(other / PAGE_SIZE, BASE / PAGE_SIZE + 1);
        assert_eq!(s.alloc(512), None, "both pages taken");
        for &a in &small[..255] {
            assert_eq!(s.free(a), Ok(None), "blocks are still in use on the page");
        }
        assert_eq!(s.free(small[255]), Ok(Some(BASE)), "the last block's free empties the page");
        assert_eq!(s.free(small[3]), Err(BadBlock::Free), "a block of a page given back");
        assert_eq!(s.alloc(512), Some(BASE), "the emptied page now holds 512-byte blocks");
        assert_eq!(s.usable_size(BASE), Ok(512));
        assert_eq!(s.usable_size(other), Ok(1024), "the other page is untouched");
    }

    #[test]
    fn bad_and_double_frees_are_refused_and_freed_blocks_come_back() {
        let mut s = Slabs::new();
        s.add_chunk(BASE, PAGE_SIZE);
        let a = s.alloc(32).unwrap();
        assert_eq!(s.free(a + 8), Err(BadBlock::Unknown), "inside a block");
        assert_eq!(s.free(a + 32), Err(BadBlock::Free), "a block never handed out");
        assert_eq!(s.free(BASE + PAGE_SIZE), Err(BadBlock::Unknown), "outside every chunk");
        assert_eq!(s.free(a), Ok(Some(BASE)));
        assert_eq!(s.free(a), Err(BadBlock::Free), "double free");
        assert_eq!(s.usable_size(a), Err(BadBlock::Free));
        assert_eq!(s.alloc(32), Some(a), "the freed block is reused");
    }

    /// Each class's list holds exactly its pages with some blocks in use and some free, once;
    /// the empty pages are exactly those with none in use.
    fn check_lists(s: &Slabs) {
        for (class, &head) in s.partial.iter().enumerate() {
            let (mut id, mut prev, mut seen) = (head, NONE, 0);
            while id != NONE {
                let (c, p) = split(id);
                let ch = &s.chunks[c];
                assert_eq!(usize::from(ch.class[p]), class);
                assert!(ch.listed[p] && ch.used[p] > 0 && usize::from(ch.used[p]) < blocks_per_page(class));
                assert_eq!(ch.prev[p], prev);
                (prev, id, seen) = (id, ch.next[p], seen + 1);
            }
            let expected = s
                .chunks
                .iter()
                .flat_map(|ch| (0..ch.class.len()).map(move |p| (ch, p)))
                .filter(|(ch, p)| {
                    usize::from(ch.class[*p]) == class && usize::from(ch.used[*p]) < blocks_per_page(class)
                })
                .count();
            assert_eq!(seen, expected, "class {class}");
        }
        let empty = s.chunks.iter().map(|ch| ch.class.iter().filter(|&&c| c == EMPTY).count()).sum::<usize>();
        assert_eq!(s.empty.len(), empty);
    }

    proptest! {
        /// Against a model: live blocks never overlap, stay inside their chunks, have their
        /// class's size, and a full page is reused once one of its blocks is freed.
        #[test]
        fn live_blocks_never_overlap(ops in proptest::collection::vec((0usize..=MAX_SIZE, any::<bool>(), any::<u16>()), 1..2000)) {
            let mut s = Slabs::new();
            s.add_chunk(BASE, 64 * PAGE_SIZE);
            let mut live: BTreeMap<usize, usize> = BTreeMap::new();
            for (size, free, pick) in ops {
                if free && !live.is_empty() {
                    let addr = *live.keys().nth(pick as usize % live.len()).unwrap();
                    live.remove(&addr);
                    // The page is given back exactly when no live block is left on it.
                    let page = addr / PAGE_SIZE * PAGE_SIZE;
                    let emptied = !live.keys().any(|&a| a / PAGE_SIZE == addr / PAGE_SIZE);
                    prop_assert_eq!(s.free(addr), Ok(emptied.then_some(page)));
                    check_lists(&s);
                    continue;
                }
                match s.alloc(size) {
                    Some(addr) => {
                        let usable = s.usable_size(addr).unwrap();
                        prop_assert_eq!(usable, CLASS_SIZES[class_index(size).unwrap()]);
                        prop_assert!(addr >= BASE && addr + usable <= BASE + 64 * PAGE_SIZE);
                        prop_assert_eq!(addr / PAGE_SIZE, (addr + usable - 1) / PAGE_SIZE, "within one page");
                        if let Some((&prev, &len)) = live.range(..addr).next_back() {
                            prop_assert!(prev + len <= addr, "overlaps the block before");
                        }
                        if let Some((&next, _)) = live.range(addr..).next() {
                            prop_assert!(addr + usable <= next, "overlaps the block after");
                        }
                        live.insert(addr, usable);
                        check_lists(&s);
                    }
                    None => {
                        // Full only when every page is taken and this class's are all full.
                        let class = class_index(size).unwrap();
                        let chunk = &s.chunks[0];
                        prop_assert_eq!(chunk.class.len(), 64, "a fresh page was left");
                        prop_assert!(s.empty.is_empty(), "an empty page was left");
                        for page in 0..64 {
                            if usize::from(chunk.class[page]) == class {
                                prop_assert_eq!(usize::from(chunk.used[page]), blocks_per_page(class));
                            }
                        }
                    }
                }
            }
            for (&addr, _) in live.iter() {
                prop_assert!(s.free(addr).is_ok());
            }
        }
    }
}
