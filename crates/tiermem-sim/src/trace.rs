//! Trace input: the simulator's own binary format (docs/trace-format.md), Valgrind lackey
//! `--trace-mem=yes` text, and plain page-number lists; plus deterministic synthetic traces.
//!
//! Everything becomes a list of page-level [`Event`]s. Byte-address inputs (lackey, binary with
//! byte addresses) go through an optional LLC filter and the hot-page table first, the way a
//! memory controller would see them: LLC fills and write-backs become page accesses, and pages
//! the table finds hot become report events.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use tiermem_monitor::hot_table::HotPageTable;
use tiermem_monitor::llc::LlcFilter;
use tiermem_sys::{Error, ErrorKind, Result};

pub use tiermem_monitor::trace_format::{discard_records, split_discard, BinaryWriter, MAGIC, OLDEST_VERSION, VERSION};
/// Page size the simulator models.
pub const PAGE_SHIFT: u32 = 12;
/// Largest page number a trace may hold (page ids carry a region above bit 40; traces use 0).
pub const MAX_PAGE: u64 = (1 << 40) - 1;

/// One page-level event, packed as `page << 2 | kind`.
pub type Event = u64;

/// What an event is, and how one is packed: the same kinds and packing as the binary trace
/// format's records, so a trace loads without translation.
pub use tiermem_monitor::trace_format::{record as event, RecordKind as EventKind};

/// Unpack an event.
#[inline]
pub fn split_event(e: Event) -> (u64, EventKind) {
    let kind = match e & 3 {
        0 => EventKind::Read,
        1 => EventKind::Write,
        2 => EventKind::Report,
        _ => EventKind::Compute,
    };
    (e >> 2, kind)
}

/// Input formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Decide from the file's first bytes.
    Auto,
    /// The simulator's binary format.
    Binary,
    /// `valgrind --tool=lackey --trace-mem=yes` output.
    Lackey,
    /// One page number per line (decimal or 0x-hex), optionally followed by `w` for a write.
    Pages,
}

impl std::str::FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Format::Auto),
            "binary" => Ok(Format::Binary),
            "lackey" => Ok(Format::Lackey),
            "pages" => Ok(Format::Pages),
            other => {
                Err(Error::invalid(format!("unknown trace format '{other}' (expected auto, binary, lackey, pages)")))
            }
        }
    }
}

/// How byte-address inputs reach the page level.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LineOptions {
    /// LLC size in bytes and ways; None: every access reaches memory.
    pub llc: Option<(u64, usize)>,
    /// Hot-page threshold N of the monitor's table (1..=64).
    pub threshold: u32,
    /// Count instruction fetches (lackey `I` lines) as reads.
    pub instructions: bool,
}

impl Default for LineOptions {
    fn default() -> Self {
        Self { llc: Some((1 << 20, 16)), threshold: 8, instructions: false }
    }
}

/// A loaded trace.
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The events in order.
    pub events: Vec<Event>,
    /// The events carry monitor reports (byte-address inputs), so replay need not invent them.
    pub has_reports: bool,
    /// Byte-level accesses read before the LLC filter (0 for page-level inputs).
    pub raw_accesses: u64,
}

/// Turns byte-level accesses into page events through the LLC and the hot-page table.
struct LinePipeline {
    llc: Option<LlcFilter>,
    table: HotPageTable,
    events: Vec<Event>,
    raw: u64,
    /// Accesses since the last one that reached memory.
    cached: u64,
}

impl LinePipeline {
    fn new(options: &LineOptions) -> Result<Self> {
        let llc = options.llc.map(|(bytes, ways)| LlcFilter::new(bytes, ways)).transpose()?;
        Ok(Self { llc, table: HotPageTable::new(options.threshold)?, events: Vec::new(), raw: 0, cached: 0 })
    }

    fn access(&mut self, addr: u64, write: bool) {
        self.raw += 1;
        let (fill, writeback) = match &mut self.llc {
            Some(llc) => {
                let r = llc.access(addr, write);
                (r.fill, r.writeback)
            }
            None => (Some(addr), None),
        };
        if fill.is_none() && writeback.is_none() {
            self.cached += 1;
            return;
        }
        if self.cached > 0 {
            self.events.push(event(self.cached, EventKind::Compute));
            self.cached = 0;
        }
        if let Some(line) = writeback {
            self.events.push(event(line >> PAGE_SHIFT, EventKind::Write));
            self.table.access(line >> PAGE_SHIFT, true);
        }
        if let Some(line) = fill {
            let page = line >> PAGE_SHIFT;
            // The report comes from the same request: the table sees it as it reaches memory.
            if let Some(hot) = self.table.access(page, false) {
                self.events.push(event(hot, EventKind::Report));
            }
            self.events.push(event(page, if write { EventKind::Write } else { EventKind::Read }));
        }
    }

    fn finish(mut self) -> Trace {
        if self.cached > 0 {
            self.events.push(event(self.cached, EventKind::Compute));
        }
        Trace { events: self.events, has_reports: true, raw_accesses: self.raw }
    }
}

fn bad_line(path: &Path, line_no: usize, text: &str, why: &str) -> Error {
    let shown: String = text.chars().take(80).collect();
    Error::invalid(format!("{}:{line_no}: {why}: '{shown}'", path.display()))
}

/// Read a trace file (`-`: standard input, which needs an explicit format). A trace compressed
/// with xz is decompressed first (the repository stores its example traces that way).
pub fn load(path: &Path, format: Format, lines: &LineOptions) -> Result<Trace> {
    let stdin = path.as_os_str() == "-";
    if stdin && format == Format::Auto {
        return Err(Error::invalid("reading a trace from standard input needs --format (binary, lackey, pages)"));
    }
    let mut input = open_input(path, stdin)?;
    // The format is told from the first bytes of the (decompressed) input, which are then read
    // again in front of the rest.
    let mut head = vec![0u8; DETECT_BYTES];
    let n = read_up_to(&mut input, &mut head).map_err(|e| read_error(path, e))?;
    head.truncate(n);
    let format = match format {
        Format::Auto => detect(path, &head)?,
        f => f,
    };
    let input: Box<dyn Read> = Box::new(std::io::Cursor::new(head).chain(input));
    let trace = match format {
        Format::Binary => read_binary(path, input, lines)?,
        Format::Lackey => read_lackey(path, input, lines)?,
        _ => read_pages(path, input)?,
    };
    if !trace.events.iter().any(|&e| e & 3 < 2) {
        return Err(Error::invalid(format!("trace {} has no accesses", path.display())));
    }
    Ok(trace)
}

/// Bytes read ahead to tell the format: a few thousand lines of text, past any header a tool
/// wrote (Valgrind's `==PID==` lines).
const DETECT_BYTES: usize = 256 << 10;

/// Magic bytes of an xz stream.
const XZ_MAGIC: &[u8] = &[0xFD, b'7', b'z', b'X', b'Z', 0];

/// Compressions recognised only to say so: (magic, name, the command that decompresses to
/// standard output).
const OTHER_COMPRESSIONS: &[(&[u8], &str, &str)] = &[
    (&[0x1F, 0x8B], "gzip", "gzip -dc"),
    (&[0x28, 0xB5, 0x2F, 0xFD], "zstd", "zstd -dc"),
    (b"BZh", "bzip2", "bzip2 -dc"),
];

fn read_error(path: &Path, e: std::io::Error) -> Error {
    Error::os(e, format!("reading {}", path.display()))
}

/// The trace's bytes: the file or standard input, decompressed first if it is xz.
///
/// Decompressed whole, in this thread: the decoder (lzma-rs) holds a whole xz block in memory
/// before it hands any of it out, and `xz` writes one block unless told to write several, so
/// reading as it decodes would save no memory; a trace then needs its decompressed size in
/// memory once besides its events. An error of the decoder is reported as such, before any
/// parsing.
fn open_input(path: &Path, stdin: bool) -> Result<Box<dyn Read>> {
    let raw: Box<dyn Read> = if stdin {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(File::open(path).map_err(|e| Error::os(e, format!("opening trace {}", path.display())))?)
    };
    let mut raw = BufReader::with_capacity(1 << 16, raw);
    let mut magic = [0u8; 6];
    let n = read_up_to(&mut raw, &mut magic).map_err(|e| read_error(path, e))?;
    let magic = &magic[..n];
    let mut raw = std::io::Cursor::new(magic.to_vec()).chain(raw);
    if magic.starts_with(XZ_MAGIC) {
        let mut decompressed = Vec::new();
        lzma_rs::xz_decompress(&mut raw, &mut decompressed).map_err(|e| {
            Error::invalid(format!(
                "{}: cannot decompress the xz data (corrupt, truncated, or using a feature the decoder lacks): {e}",
                path.display()
            ))
        })?;
        return Ok(Box::new(std::io::Cursor::new(decompressed)));
    }
    for &(bytes, name, command) in OTHER_COMPRESSIONS {
        if magic.starts_with(bytes) {
            let how = if stdin {
                format!("decompress it in the pipe ({command} FILE | tiermem sim - --format ...)")
            } else {
                format!("decompress it first ({command} {} > TRACE)", path.display())
            };
            return Err(Error::invalid(format!(
                "{}: compressed with {name}, which tiermem does not read (it reads xz): {how}",
                path.display()
            )));
        }
    }
    Ok(Box::new(raw))
}

/// The format of a trace whose first bytes are `head`: the binary format by its magic, else
/// text, lackey if its first access line looks like one.
fn detect(path: &Path, head: &[u8]) -> Result<Format> {
    if head.starts_with(MAGIC) {
        return Ok(Format::Binary);
    }
    // A full head may end inside a line (even inside a character): only whole lines count.
    let whole = if head.len() == DETECT_BYTES {
        head.iter().rposition(|&b| b == b'\n').map_or(&head[..0], |end| &head[..end])
    } else {
        head
    };
    for line in whole.split(|&b| b == b'\n').take(1000) {
        let Ok(line) = std::str::from_utf8(line) else {
            return Err(Error::invalid(format!("{}: neither a binary trace nor text", path.display())));
        };
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with("==") {
            continue;
        }
        let lackey = matches!(line.as_bytes().first(), Some(b'I' | b' '))
            && t.contains(',')
            && matches!(t.as_bytes().first(), Some(b'I' | b'L' | b'S' | b'M'));
        return Ok(if lackey { Format::Lackey } else { Format::Pages });
    }
    Ok(Format::Pages)
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn parse_number(text: &str) -> Option<u64> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

fn read_pages(path: &Path, file: Box<dyn Read>) -> Result<Trace> {
    let mut events = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line =
            line.map_err(|e| Error::os_kind(ErrorKind::InvalidInput, e, format!("{}:{}", path.display(), i + 1)))?;
        let t = line.split('#').next().unwrap_or("").trim();
        if t.is_empty() {
            continue;
        }
        let mut words = t.split_whitespace();
        let page_text = words.next().unwrap_or("");
        let page = parse_number(page_text).ok_or_else(|| bad_line(path, i + 1, &line, "not a page number"))?;
        if page > MAX_PAGE {
            return Err(bad_line(path, i + 1, &line, "page number above 2^40 - 1"));
        }
        let kind = match words.next() {
            None | Some("r" | "R") => EventKind::Read,
            Some("w" | "W") => EventKind::Write,
            Some(_) => return Err(bad_line(path, i + 1, &line, "expected 'r' or 'w' after the page number")),
        };
        if words.next().is_some() {
            return Err(bad_line(path, i + 1, &line, "extra text after the access"));
        }
        events.push(event(page, kind));
    }
    Ok(Trace { events, has_reports: false, raw_accesses: 0 })
}

fn read_lackey(path: &Path, file: Box<dyn Read>, options: &LineOptions) -> Result<Trace> {
    let mut pipe = LinePipeline::new(options)?;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line =
            line.map_err(|e| Error::os_kind(ErrorKind::InvalidInput, e, format!("{}:{}", path.display(), i + 1)))?;
        let t = line.trim();
        if t.is_empty() || t.starts_with("==") || t.starts_with('#') {
            continue;
        }
        // The operation is the first character, which need not be one byte in a damaged file.
        let (op, rest) = t.split_at(t.chars().next().map_or(0, char::len_utf8));
        let Some((addr, size)) = rest.trim().split_once(',') else {
            return Err(bad_line(path, i + 1, &line, "expected 'OP ADDRESS,SIZE'"));
        };
        let addr = u64::from_str_radix(addr.trim(), 16).map_err(|_| bad_line(path, i + 1, &line, "bad hex address"))?;
        let size: u64 = size.trim().parse().map_err(|_| bad_line(path, i + 1, &line, "bad size"))?;
        // Lackey reports accesses of at most a vector register; anything beyond a page is garbage.
        if size > 4096 {
            return Err(bad_line(path, i + 1, &line, "size above 4096 bytes"));
        }
        // An access straddling a line boundary touches both lines; its last byte too must lie
        // in a page the binary format holds.
        let last = addr.saturating_add(size.max(1) - 1);
        if (last >> PAGE_SHIFT) > MAX_PAGE {
            return Err(bad_line(path, i + 1, &line, "address above 2^52"));
        }
        let lines = [addr, last];
        let touched = if last / 64 != addr / 64 { &lines[..] } else { &lines[..1] };
        for &a in touched {
            match op {
                "L" => pipe.access(a, false),
                "S" => pipe.access(a, true),
                "M" => {
                    pipe.access(a, false);
                    pipe.access(a, true);
                }
                "I" if options.instructions => pipe.access(a, false),
                "I" => {}
                _ => return Err(bad_line(path, i + 1, &line, "unknown operation (expected I, L, S or M)")),
            }
        }
    }
    Ok(pipe.finish())
}

fn read_binary(path: &Path, file: Box<dyn Read>, options: &LineOptions) -> Result<Trace> {
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut header = [0u8; 24];
    r.read_exact(&mut header)
        .map_err(|_| Error::invalid(format!("{}: binary trace header is truncated", path.display())))?;
    if &header[..8] != MAGIC {
        return Err(Error::invalid(format!("{}: not a tiermem binary trace (bad magic)", path.display())));
    }
    let version = u32::from_le_bytes(header[8..12].try_into().unwrap_or_default());
    if !(OLDEST_VERSION..=VERSION).contains(&version) {
        return Err(Error::invalid(format!(
            "{}: binary trace version {version}, expected {OLDEST_VERSION} to {VERSION}",
            path.display()
        )));
    }
    let unit = u32::from_le_bytes(header[12..16].try_into().unwrap_or_default());
    let count = u64::from_le_bytes(header[16..24].try_into().unwrap_or_default());
    let mut pipe = (unit == 1).then(|| LinePipeline::new(options)).transpose()?;
    if unit > 1 {
        return Err(Error::invalid(format!("{}: unknown address unit {unit} (0 pages, 1 bytes)", path.display())));
    }
    // The header's count is only a hint: a damaged or hostile file may claim any number of
    // records, so at most 1 Mi are reserved ahead (8 MiB) and the rest grows as records come.
    let mut events = Vec::with_capacity(count.min(1 << 20) as usize);
    let mut word = [0u8; 8];
    let mut n = 0u64;
    loop {
        match read_up_to(&mut r, &mut word) {
            Ok(0) => break,
            Ok(8) => {}
            Ok(_) => return Err(Error::invalid(format!("{}: record {n} is truncated", path.display()))),
            Err(e) => return Err(Error::os(e, format!("reading {}", path.display()))),
        }
        let v = u64::from_le_bytes(word);
        let (value, kind) = (v >> 2, v & 3);
        match &mut pipe {
            Some(p) => {
                // Byte addresses: their pages must fit as page-unit records' do.
                if kind < 2 && (value >> PAGE_SHIFT) > MAX_PAGE {
                    return Err(Error::invalid(format!(
                        "{}: record {n}: address {value:#x} above 2^52",
                        path.display()
                    )));
                }
                if kind < 2 {
                    p.access(value, kind == 1);
                }
            }
            None => {
                if kind < 3 && value > MAX_PAGE {
                    return Err(Error::invalid(format!(
                        "{}: record {n}: page {value:#x} above 2^40 - 1",
                        path.display()
                    )));
                }
                if kind == 3 {
                    match split_discard(value) {
                        Some(_) if version < 2 => {
                            return Err(Error::invalid(format!(
                                "{}: record {n}: a discard in a version {version} trace",
                                path.display()
                            )));
                        }
                        Some((_, 0)) => {
                            return Err(Error::invalid(format!(
                                "{}: record {n}: a discard of no pages",
                                path.display()
                            )));
                        }
                        _ => {}
                    }
                }
                events.push(v);
            }
        }
        n += 1;
    }
    if count != 0 && n != count {
        return Err(Error::invalid(format!("{}: header says {count} records, file holds {n}", path.display())));
    }
    Ok(match pipe {
        Some(p) => p.finish(),
        None => {
            let has_reports = events.iter().any(|&e| e & 3 == 2);
            Trace { events, has_reports, raw_accesses: 0 }
        }
    })
}

/// Deterministic synthetic traces (xorshift; same name, same trace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synthetic {
    /// One sequential scan, repeated over the footprint.
    Sequential,
    /// Uniform random pages.
    Random,
    /// Eight interleaved strided streams (strides 1..=8) plus 20% uniform random accesses, every
    /// tenth access a write.
    Mixed,
    /// Locality: 90% of accesses uniform over a hot tenth of the footprint, 10% a sequential
    /// scan over all of it.
    Hot,
}

impl std::str::FromStr for Synthetic {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "seq" | "sequential" => Ok(Synthetic::Sequential),
            "random" => Ok(Synthetic::Random),
            "mixed" => Ok(Synthetic::Mixed),
            "hot" => Ok(Synthetic::Hot),
            other => {
                Err(Error::invalid(format!("unknown synthetic trace '{other}' (expected seq, random, mixed, hot)")))
            }
        }
    }
}

/// An endless deterministic generator over `footprint` pages.
#[derive(Debug, Clone)]
pub struct SyntheticGen {
    kind: Synthetic,
    footprint: u64,
    /// Remainders by the footprint and by the hot tenth of it, without a divide each.
    whole: Divisor,
    tenth: Divisor,
    rng: u64,
    cursor: [u64; 8],
    n: u64,
}

/// Remainders by a fixed divisor through two multiplications instead of a hardware divide
/// (20-40 cycles, most of what a synthetic access cost to make): Lemire, Kaser and Kurz,
/// "Faster remainder by direct computation" (2019), with a 128-bit fraction, which is exact for
/// every 64-bit dividend.
#[derive(Debug, Clone, Copy)]
struct Divisor {
    d: u64,
    /// ceil(2^128 / d) (0 for d = 1, where every remainder is 0 anyway).
    m: u128,
}

impl Divisor {
    fn new(d: u64) -> Self {
        assert!(d > 0, "a divisor of 0");
        Self { d, m: (u128::MAX / u128::from(d)).wrapping_add(1) }
    }

    /// `a % d`.
    #[inline]
    fn rem(self, a: u64) -> u64 {
        // The fractional part of a / d, times d, rounded down: the high 64 bits of a 192-bit
        // product, taken in two halves.
        let fraction = self.m.wrapping_mul(u128::from(a));
        let d = u128::from(self.d);
        let low = ((fraction as u64 as u128) * d) >> 64;
        (((fraction >> 64) * d + low) >> 64) as u64
    }
}

/// `(cursor + step) % footprint` for a cursor below the footprint and a step no larger.
#[inline]
fn advance(cursor: u64, step: u64, footprint: u64) -> u64 {
    let next = cursor + step;
    if next >= footprint {
        next - footprint
    } else {
        next
    }
}

/// The smallest footprint a synthetic trace spreads over (a smaller one is raised to it).
pub const MIN_SYNTHETIC_PAGES: u64 = 16;

impl SyntheticGen {
    /// A generator of `kind` over pages `0..footprint` (at least [`MIN_SYNTHETIC_PAGES`]).
    pub fn new(kind: Synthetic, footprint: u64) -> Self {
        let footprint = footprint.max(MIN_SYNTHETIC_PAGES);
        let cursor = std::array::from_fn(|k| footprint / 8 * k as u64);
        let (whole, tenth) = (Divisor::new(footprint), Divisor::new((footprint / 10).max(1)));
        Self { kind, footprint, whole, tenth, rng: 0x9E37_79B9_7F4A_7C15, cursor, n: 0 }
    }

    #[inline]
    fn next_random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
}

impl Iterator for SyntheticGen {
    type Item = Event;

    #[inline]
    fn next(&mut self) -> Option<Event> {
        self.n += 1;
        let r = self.next_random();
        let page = match self.kind {
            Synthetic::Sequential => self.whole.rem(self.n - 1),
            Synthetic::Random => self.whole.rem(r),
            Synthetic::Mixed => {
                if r.is_multiple_of(5) {
                    self.whole.rem(r >> 8)
                } else {
                    // Steps of 1..=8 pages; the footprint is at least 16.
                    let s = ((r >> 4) & 7) as usize;
                    self.cursor[s] = advance(self.cursor[s], s as u64 + 1, self.footprint);
                    self.cursor[s]
                }
            }
            Synthetic::Hot => {
                if r.is_multiple_of(10) {
                    self.cursor[0] = advance(self.cursor[0], 1, self.footprint);
                    self.cursor[0]
                } else {
                    self.tenth.rem(r >> 8)
                }
            }
        };
        let kind = if self.n.is_multiple_of(10) { EventKind::Write } else { EventKind::Read };
        Some(event(page, kind))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn page_lists_parse_with_comments_hex_and_writes_and_bad_lines_name_their_number() {
        let f = file("# a comment\n5\n0x10 w\n\n7 r # trailing\n");
        let t = load(f.path(), Format::Auto, &LineOptions::default()).unwrap();
        assert_eq!(t.events, vec![event(5, EventKind::Read), event(16, EventKind::Write), event(7, EventKind::Read)]);
        let f = file("1\n2\nbanana\n");
        let e = load(f.path(), Format::Pages, &LineOptions::default()).unwrap_err().to_string();
        assert!(e.contains(":3:") && e.contains("banana"), "{e}");
        let f = file("1 x\n");
        assert!(load(f.path(), Format::Pages, &LineOptions::default()).unwrap_err().to_string().contains(":1:"));
        let f = file("# nothing\n");
        assert!(load(f.path(), Format::Auto, &LineOptions::default()).unwrap_err().to_string().contains("no accesses"));
    }

    #[test]
    fn a_lackey_line_starting_with_a_multibyte_character_is_a_bad_line() {
        // Found by the `trace_load` fuzz target: the operation was cut at byte 1, inside 'ċ'.
        let f = file(" L 10000,8\n\u{10b} 10000,8\n");
        let e = load(f.path(), Format::Lackey, &LineOptions::default()).unwrap_err().to_string();
        assert!(e.contains(":2:") && e.contains("unknown operation"), "{e}");
    }

    #[test]
    fn lackey_goes_through_the_llc_and_the_hot_page_table() {
        let mut text = String::from("==123== Lackey\nI  04000000,3\n");
        // Page 0x10: eight distinct lines read (8 fills → hot at the 8th); then the same lines
        // again, which hit the LLC and reach nothing.
        for round in 0..2 {
            for line in 0..8u64 {
                text += &format!(" L {:x},8\n", 0x10000 + line * 64);
            }
            let _ = round;
        }
        text += " S 20000,4\n M 30000,8\n";
        let f = file(&text);
        let t = load(f.path(), Format::Auto, &LineOptions::default()).unwrap();
        let mut expect: Vec<Event> = (0..8).map(|_| event(0x10, EventKind::Read)).collect();
        expect.insert(7, event(0x10, EventKind::Report));
        // The second round hit the LLC: 8 accesses of CPU time only.
        expect.push(event(8, EventKind::Compute));
        expect.push(event(0x20, EventKind::Write));
        expect.push(event(0x30, EventKind::Read));
        expect.push(event(1, EventKind::Compute)); // the store of M hit the line its load brought
        assert_eq!(t.events, expect);
        assert_eq!(t.raw_accesses, 16 + 1 + 2);
        let no_llc = LineOptions { llc: None, ..LineOptions::default() };
        let t = load(f.path(), Format::Lackey, &no_llc).unwrap();
        assert_eq!(t.events.iter().filter(|&&e| e & 3 < 2).count(), 16 + 1 + 2, "every access reaches memory");
        let f = file(" L zz,4\n");
        assert!(load(f.path(), Format::Lackey, &LineOptions::default()).unwrap_err().to_string().contains(":1:"));
    }

    #[test]
    fn binary_round_trips_and_rejects_damage() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        use tiermem_monitor::trace_format::RecordKind;
        let mut w = BinaryWriter::new(&mut f, false).unwrap();
        w.write(3, RecordKind::Read).unwrap();
        w.write(MAX_PAGE, RecordKind::Write).unwrap();
        w.write(9, RecordKind::Report).unwrap();
        assert_eq!(w.finish().unwrap(), 3);
        let t = load(f.path(), Format::Auto, &LineOptions::default()).unwrap();
        assert_eq!(
            t.events,
            vec![event(3, EventKind::Read), event(MAX_PAGE, EventKind::Write), event(9, EventKind::Report)]
        );
        assert!(t.has_reports);
        f.write_all(&[1, 2, 3]).unwrap();
        assert!(load(f.path(), Format::Binary, &LineOptions::default()).unwrap_err().to_string().contains("truncated"));
        let g = file("TMTRACE");
        assert!(load(g.path(), Format::Binary, &LineOptions::default()).is_err());
    }

    /// Version 2 adds discard records; a version 1 file may not hold one, and versions past 2
    /// are refused.
    #[test]
    fn discards_load_from_version_2_only() {
        use tiermem_monitor::trace_format::{discard_records, header, RecordKind};
        let body: Vec<u8> = [event(5, RecordKind::Write)]
            .into_iter()
            .chain(discard_records(5, 3))
            .chain([event(5, RecordKind::Read)])
            .flat_map(u64::to_le_bytes)
            .collect();
        let with_version = |version: u32| {
            let mut bytes = header(false, 3).to_vec();
            bytes[8..12].copy_from_slice(&version.to_le_bytes());
            bytes.extend_from_slice(&body);
            file_of(&bytes)
        };
        let t = load(with_version(2).path(), Format::Binary, &LineOptions::default()).unwrap();
        assert_eq!(t.events.len(), 3);
        assert_eq!(split_discard(t.events[1] >> 2), Some((5, 3)));
        for (version, needle) in [(1, "a discard in a version 1 trace"), (3, "version 3, expected 1 to 2")] {
            let e = load(with_version(version).path(), Format::Binary, &LineOptions::default()).unwrap_err();
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    fn xz(bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        lzma_rs::xz_compress(&mut &bytes[..], &mut out).unwrap();
        out
    }

    fn file_of(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    /// Compressed or not, a trace loads to the same events, in every format, including text
    /// longer than the part read ahead to tell its format.
    #[test]
    fn xz_compressed_traces_load_like_the_plain_ones() {
        let options = LineOptions::default();
        // Several times the read-ahead, with lines of varying length so one is cut at its end.
        let pages: String = (0..150_000u64)
            .map(|i| format!("{} {}\n", i * 7919 % 100_003, ["r", "w"][(i % 3 == 0) as usize]))
            .collect();
        assert!(pages.len() > 3 * DETECT_BYTES);
        let mut lackey = String::from("==1== Lackey\n");
        for i in 0..5000u64 {
            lackey += &format!(" L {:x},8\n S {:x},4\n", 0x10000 + i * 4096, 0x900000 + i * 64);
        }
        let mut binary = Vec::new();
        let mut w = BinaryWriter::new(&mut binary, false).unwrap();
        for i in 0..30_000u64 {
            w.write(i % 977, if i % 5 == 0 { EventKind::Write } else { EventKind::Read }).unwrap();
        }
        w.finish().unwrap();
        for (name, bytes, format) in [
            ("pages", pages.as_bytes(), Format::Pages),
            ("lackey", lackey.as_bytes(), Format::Lackey),
            ("binary", &binary[..], Format::Binary),
        ] {
            let plain = load(file_of(bytes).path(), Format::Auto, &options).unwrap();
            let packed = file_of(&xz(bytes));
            let unpacked = load(packed.path(), Format::Auto, &options).unwrap();
            assert_eq!(unpacked.events, plain.events, "{name}");
            assert_eq!(unpacked.raw_accesses, plain.raw_accesses, "{name}");
            assert_eq!(load(packed.path(), format, &options).unwrap().events, plain.events, "{name} named");
        }
        // Absolute counts too: both sides above share the read-ahead.
        let count = |bytes: &[u8]| load(file_of(&xz(bytes)).path(), Format::Auto, &options).unwrap();
        assert_eq!(count(pages.as_bytes()).events.len(), 150_000, "every line, also across the read-ahead");
        assert_eq!(count(lackey.as_bytes()).raw_accesses, 10_000, "every lackey access");
        assert_eq!(count(&binary).events.len(), 30_000, "every binary record");
    }

    #[test]
    fn damaged_xz_and_other_compressions_fail_with_a_message() {
        let options = LineOptions::default();
        let pages: String = (0..50_000u64).map(|i| format!("{}\n", i * 31 % 65_537)).collect();
        let packed = xz(pages.as_bytes());
        // Cut short: an error, never a shorter trace.
        let cut = file_of(&packed[..packed.len() / 2]);
        let e = load(cut.path(), Format::Auto, &options).unwrap_err().to_string();
        assert!(e.contains("cannot decompress the xz data"), "{e}");
        // A real `xz` file (CRC64-checked, as the stored traces are) damaged inside.
        let stored = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/figures/policies/traces/sort.tmtrace.xz");
        let mut damaged = std::fs::read(stored).expect("the stored sort trace");
        let middle = damaged.len() / 2;
        damaged[middle] ^= 0x55;
        let e = load(file_of(&damaged).path(), Format::Auto, &options).unwrap_err().to_string();
        assert!(e.contains("cannot decompress the xz data"), "{e}");
        for (magic, name) in
            [(&[0x1F, 0x8B, 8, 0][..], "gzip"), (&[0x28, 0xB5, 0x2F, 0xFD][..], "zstd"), (b"BZh9", "bzip2")]
        {
            let e = load(file_of(magic).path(), Format::Auto, &options).unwrap_err().to_string();
            assert!(e.contains(&format!("compressed with {name}")) && e.contains("decompress it first"), "{e}");
        }
    }

    #[test]
    fn synthetic_traces_are_deterministic_and_stay_in_the_footprint() {
        let a: Vec<Event> = SyntheticGen::new(Synthetic::Mixed, 1000).take(5000).collect();
        let b: Vec<Event> = SyntheticGen::new(Synthetic::Mixed, 1000).take(5000).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|&e| (e >> 2) < 1000));
        let seq: Vec<u64> = SyntheticGen::new(Synthetic::Sequential, 20).take(25).map(|e| e >> 2).collect();
        assert_eq!(&seq[18..22], &[18, 19, 0, 1]);
    }

    /// The generators as first written, with a hardware divide for every remainder: the
    /// multiply-only remainders must give the very same traces (results stored in the docs
    /// depend on them).
    fn reference(kind: Synthetic, footprint: u64, n: usize) -> Vec<Event> {
        let f = footprint.max(16);
        let mut cursor: [u64; 8] = std::array::from_fn(|k| f / 8 * k as u64);
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        (1..=n as u64)
            .map(|i| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let r = rng;
                let page = match kind {
                    Synthetic::Sequential => (i - 1) % f,
                    Synthetic::Random => r % f,
                    Synthetic::Mixed if r.is_multiple_of(5) => (r >> 8) % f,
                    Synthetic::Mixed => {
                        let s = ((r >> 4) & 7) as usize;
                        cursor[s] = (cursor[s] + s as u64 + 1) % f;
                        cursor[s]
                    }
                    Synthetic::Hot if r.is_multiple_of(10) => {
                        cursor[0] = (cursor[0] + 1) % f;
                        cursor[0]
                    }
                    Synthetic::Hot => (r >> 8) % (f / 10).max(1),
                };
                event(page, if i % 10 == 0 { EventKind::Write } else { EventKind::Read })
            })
            .collect()
    }

    #[test]
    fn synthetic_traces_are_those_of_the_divide_based_generators() {
        for kind in [Synthetic::Sequential, Synthetic::Random, Synthetic::Mixed, Synthetic::Hot] {
            for footprint in [0, 16, 17, 100, 65_536, 1_000_003, 1 << 40, u64::MAX] {
                let fast: Vec<Event> = SyntheticGen::new(kind, footprint).take(20_000).collect();
                assert_eq!(fast, reference(kind, footprint, 20_000), "{kind:?} over {footprint}");
            }
        }
    }

    mod remainders {
        use proptest::prelude::*;

        use super::super::Divisor;

        proptest! {
            #[test]
            fn without_a_divide_are_exact(
                a in prop_oneof![any::<u64>(), 0u64..1000, (u64::MAX - 1000)..=u64::MAX],
                d in prop_oneof![
                    1u64..100,
                    any::<u64>().prop_map(|d| d.max(1)),
                    (0u32..64).prop_map(|k| 1u64 << k),
                    (u64::MAX - 10)..=u64::MAX,
                ],
            ) {
                prop_assert_eq!(Divisor::new(d).rem(a), a % d);
            }
        }
    }
}
