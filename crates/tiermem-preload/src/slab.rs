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
    /// Per page handed out so far (pages are taken front to back): class and blocks in use.
    class: Vec<u8>,
    used: Vec<u16>,
    /// Bit set: block in use (at most 256 blocks of 16 bytes a page).
    bits: Vec<[u64; 4]>,
    /// Whether the page is on its class's list of pages with a free block.
    listed: Vec<bool>,
}

/// The slab pages of every tiny chunk.
#[derive(Debug)]
pub struct Slabs {
    chunks: Vec<Chunk>,
    /// Per class: pages with at least one free block, as (chunk, page); the last is used first.
    partial: [Vec<(u32, u32)>; CLASS_SIZES.len()],
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
        Self { chunks: Vec::new(), partial: [const { Vec::new() }; CLASS_SIZES.len()] }
    }

    /// Take the page-aligned range `start..start + len` as a new chunk of slab pages.
    pub fn add_chunk(&mut self, start: usize, len: usize) {
        debug_assert!(start.is_multiple_of(PAGE_SIZE) && len.is_multiple_of(PAGE_SIZE));
        self.chunks.push(Chunk {
            start,
            pages: len / PAGE_SIZE,
            class: Vec::new(),
            used: Vec::new(),
            bits: Vec::new(),
            listed: Vec::new(),
        });
    }

    /// A block of at least `size` bytes (at most [`MAX_SIZE`]), or None when every chunk is
    /// taken (the heap adds one and asks again).
    pub fn alloc(&mut self, size: usize) -> Option<usize> {
        let class = class_index(size)?;
        let (c, p) = match self.partial[class].last() {
            Some(&page) => page,
            None => {
                let page = self.fresh_page(class)?;
                self.partial[class].push(page);
                page
            }
        };
        let chunk = &mut self.chunks[c as usize];
        let page = p as usize;
        let n = blocks_per_page(class);
        let bits = &mut chunk.bits[page];
        let block = (0..4).find_map(|w| {
            let free = !bits[w];
            (free != 0).then(|| w * 64 + free.trailing_zeros() as usize)
        })?;
        debug_assert!(block < n, "a listed page has a free block");
        bits[block / 64] |= 1 << (block % 64);
        chunk.used[page] += 1;
        if usize::from(chunk.used[page]) == n {
            chunk.listed[page] = false;
            self.partial[class].pop();
        }
        Some(chunk.start + page * PAGE_SIZE + block * CLASS_SIZES[class])
    }

    /// The next untouched page of the newest chunk with one, set up for `class`.
    fn fresh_page(&mut self, class: usize) -> Option<(u32, u32)> {
        let (c, chunk) = self.chunks.iter_mut().enumerate().rev().find(|(_, ch)| ch.class.len() < ch.pages)?;
        let page = chunk.class.len();
        let n = blocks_per_page(class);
        // Bits past the page's blocks (48-byte class: 85 blocks, 16 bytes left over) count as in
        // use, so they are never handed out.
        let mut bits = [0u64; 4];
        for b in n..256 {
            bits[b / 64] |= 1 << (b % 64);
        }
        chunk.class.push(class as u8);
        chunk.used.push(0);
        chunk.bits.push(bits);
        chunk.listed.push(true);
        Some((c as u32, page as u32))
    }

    fn locate(&self, addr: usize) -> Option<(usize, usize)> {
        let c = self.chunks.iter().position(|ch| ch.start <= addr && addr < ch.start + ch.pages * PAGE_SIZE)?;
        Some((c, (addr - self.chunks[c].start) / PAGE_SIZE))
    }

    /// The page, class and block of the live block starting at `addr`.
    fn live(&self, addr: usize) -> Result<(usize, usize, usize, usize), BadBlock> {
        let (c, page) = self.locate(addr).ok_or(BadBlock::Unknown)?;
        let chunk = &self.chunks[c];
        let class = *chunk.class.get(page).ok_or(BadBlock::Unknown)? as usize;
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

    /// Give the live block at `addr` back.
    pub fn free(&mut self, addr: usize) -> Result<(), BadBlock> {
        let (c, page, class, block) = self.live(addr)?;
        let chunk = &mut self.chunks[c];
        chunk.bits[page][block / 64] &= !(1 << (block % 64));
        chunk.used[page] -= 1;
        if !chunk.listed[page] {
            chunk.listed[page] = true;
            self.partial[class].push((c as u32, page as u32));
        }
        Ok(())
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
    fn bad_and_double_frees_are_refused_and_freed_blocks_come_back() {
        let mut s = Slabs::new();
        s.add_chunk(BASE, PAGE_SIZE);
        let a = s.alloc(32).unwrap();
        assert_eq!(s.free(a + 8), Err(BadBlock::Unknown), "inside a block");
        assert_eq!(s.free(a + 32), Err(BadBlock::Free), "a block never handed out");
        assert_eq!(s.free(BASE + PAGE_SIZE), Err(BadBlock::Unknown), "outside every chunk");
        assert_eq!(s.free(a), Ok(()));
        assert_eq!(s.free(a), Err(BadBlock::Free), "double free");
        assert_eq!(s.usable_size(a), Err(BadBlock::Free));
        assert_eq!(s.alloc(32), Some(a), "the freed block is reused");
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
                    prop_assert_eq!(s.free(addr), Ok(()));
                    live.remove(&addr);
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
                    }
                    None => {
                        // Full only when every page is taken and this class's are all full.
                        let class = class_index(size).unwrap();
                        let chunk = &s.chunks[0];
                        prop_assert_eq!(chunk.class.len(), 64, "a fresh page was left");
                        for page in 0..64 {
                            if usize::from(chunk.class[page]) == class {
                                prop_assert_eq!(usize::from(chunk.used[page]), blocks_per_page(class));
                            }
                        }
                    }
                }
            }
            for (&addr, _) in live.iter() {
                prop_assert_eq!(s.free(addr), Ok(()));
            }
        }
    }
}
