/*
 * tiermem.h - C API of tiermem, user-space paging on Linux (userfaultfd + io_uring).
 *
 * Link with libtiermem.so or libtiermem.a (built by `cargo build -p tiermem-capi`).
 * C99. Linux only.
 *
 * Conventions
 *  - Functions returning a pointer return NULL on failure; functions returning int return -1 on
 *    failure. After a failure, tiermem_last_error() describes it.
 *  - Every pointer argument is checked: passing NULL where an object is required is reported as
 *    an error (never a crash). Pointers that were already freed, or that did not come from this
 *    library, cannot be detected and are undefined behaviour.
 *  - A Rust panic never unwinds into C: it is turned into an error return with a message saying
 *    "internal error (panic)". (A library built with panic=abort, such as the release profile of
 *    this workspace, aborts the process instead.)
 *  - An engine may be used from several threads at once. Freeing an object while another thread
 *    still uses it is undefined behaviour.
 *
 * Lifetimes
 *  - Free regions (tiermem_region_free) before their engine. If an engine is freed while some
 *    of its regions are still alive, tiermem_engine_free frees those regions itself first: their
 *    memory is unregistered and unmapped, so it must no longer be accessed. Their handles stay
 *    valid and must still be passed to tiermem_region_free, which then only releases the handle;
 *    tiermem_region_ptr returns NULL and tiermem_region_len returns 0 for such a handle.
 *  - Pins (tiermem_prepare_kernel_access) should be released before the region and engine; a
 *    pin released later is harmless.
 */
#ifndef TIERMEM_H
#define TIERMEM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A running paging engine: a page budget, a backing device and background threads. Opaque. */
typedef struct tiermem_engine tiermem_engine;

/* A managed region: anonymous memory whose pages the engine moves between DRAM and the
 * device. Opaque. */
typedef struct tiermem_region tiermem_region;

/* A range held resident for a system call (see tiermem_prepare_kernel_access). Opaque. */
typedef struct tiermem_pin tiermem_pin;

/*
 * Message describing the last failure of a tiermem function on the calling thread, or "" if
 * none has failed yet. Never NULL. Successful calls leave it unchanged. The string is owned by
 * the library and stays valid until the next tiermem call on this thread; copy it to keep it.
 */
const char *tiermem_last_error(void);

/*
 * Start an engine. `options` is a comma-separated list of key=value pairs, every key optional
 * ("" gives all defaults):
 *   limit=SIZE            most bytes resident at once (default 256MiB; at least 16 pages)
 *   device=mem|file:PATH  where evicted pages go (default mem)
 *   device_size=SIZE      device capacity, rounded up to pages (default 4 x limit)
 *   fault_mode=thread|sigbus
 *   dirty_tracking=auto|sync-wp|async-wp|none
 *   io_mode=hybrid|poll-only|interrupt-only
 *   reclaim_mode=background|on-fault-path
 *   prefetch=NAME         prefetcher (default stride)
 *   replace=NAME          replacement policy (default seq-balance)
 *   prefetch_governor=on|off  cap the pages each prefetcher call reads while few sampled
 *                         prefetched pages are used (default on)
 *   watermark=FRACTION    background reclaim starts at this share of the limit, in (0, 1]
 *                         (default 0.7): it writes cold dirty pages back from there
 *   evict_watermark=FRACTION  background reclaim drops pages from this share (default 0.98)
 *   prefetch_room=N       pages background reclaim keeps free for prefetches, at least,
 *                         dropping from below evict_watermark where it leaves fewer (default
 *                         256; 0: evict_watermark alone)
 *   io_buffers=N, victim_pages=N (evicted pages kept in DRAM, unmapped; 0 = none, the default),
 *   queue_depth=N, reclaim_batch=N, handler_threads=N, handler_spin_us=N,
 *   hot_threshold=N (1..=64: read faults that make a page hot in the access monitor),
 *   damon=on|off (also feed the access monitor from DAMON's physical-memory monitoring;
 *                 needs root and a running kdamond with a paddr context; default off),
 *   indirect=on|off (fault_mode=sigbus on x86-64: learn which array a faulting load's index
 *                 was read from and read ahead the pages its next elements name; default off)
 * SIZE is bytes or a number with a K/KiB/M/MiB/G/GiB/T suffix, e.g. 64MiB or 1.5GiB.
 * Example: "limit=64MiB,device=mem,device_size=1GiB,fault_mode=thread,watermark=0.7".
 *
 * Returns NULL on failure: NULL or non-UTF-8 `options`, an unknown key, a repeated key or a bad
 * value (the message names the key), a device that cannot be opened, or a kernel without a
 * usable userfaultfd (the message then contains "userfaultfd").
 */
tiermem_engine *tiermem_engine_new(const char *options);

/*
 * Stop an engine and free it. NULL is a no-op. Regions still alive are freed first (see
 * "Lifetimes" above), then the engine's threads are stopped and joined.
 */
void tiermem_engine_free(tiermem_engine *engine);

/*
 * Create a managed region of `len` bytes (rounded up to whole 4 KiB pages). Its memory reads as
 * zeros until written. Returns NULL on failure: NULL `engine`, `len` of 0 or too large, or a
 * device too small to hold all live regions.
 */
tiermem_region *tiermem_region_new(tiermem_engine *engine, size_t len);

/*
 * First byte of the region's memory (page-aligned). Returns NULL if `region` is NULL or its
 * engine was already freed.
 */
void *tiermem_region_ptr(const tiermem_region *region);

/*
 * Length of the region in bytes (a multiple of 4096). Returns 0 if `region` is NULL or its
 * engine was already freed.
 */
size_t tiermem_region_len(const tiermem_region *region);

/*
 * Free a region: wait for its in-flight I/O, release its device slots and unmap its memory.
 * NULL is a no-op. The region's memory must not be accessed afterwards.
 */
void tiermem_region_free(tiermem_region *region);

/* Advice for tiermem_region_advise. */
#define TIERMEM_ADVICE_WILLNEED 1   /* needed soon: evicted pages are read ahead */
#define TIERMEM_ADVICE_SEQUENTIAL 2 /* walked front to back: the prefetcher hears it */
#define TIERMEM_ADVICE_COLD 3       /* not needed for a while: evicted first when room is needed */

/*
 * Advise the engine about [offset, offset + len) of a region, as madvise(2) advises the
 * kernel. Returns at once; the engine's monitor thread acts on will-need and sequential advice:
 *  - TIERMEM_ADVICE_WILLNEED: the range's evicted pages are read ahead, evicting other pages
 *    first if the budget is full; at most half the budget per call.
 *  - TIERMEM_ADVICE_SEQUENTIAL: the prefetcher is told of the first pages (the "stream"
 *    prefetcher then reads ahead of the walk before it faults; the others learn from faults).
 *  - TIERMEM_ADVICE_COLD: the range's resident pages are the first evicted when room is needed.
 *    Done by the calling thread: a look at each page of the range (about half a millisecond
 *    per GiB), a lock of each resident one; the monitor thread has no part in it.
 * `offset` must be page-aligned and the range inside the region; len 0 does nothing.
 * Returns 0, or -1 for a NULL or freed region, a bad range or an unknown advice value.
 */
int tiermem_region_advise(tiermem_region *region, size_t offset, size_t len, int advice);

/*
 * Make [addr, addr + len) resident (and writable if `write` is non-zero) and keep it resident
 * until the pin is released, so that a system call (read(2), write(2), ...) can access it. The
 * range must lie inside one region of `engine` and cover at most half of the limit, and all pins
 * held at once at most the limit less 16 pages (a pin past that fails: release one and try
 * again; tiermem_last_error says so). Needed with
 * fault_mode=sigbus, where the kernel cannot resolve faults taken inside system calls (they fail
 * with EFAULT); harmless in the other modes.
 *
 * On success returns 0 and stores the pin in *out; release it with tiermem_pin_release.
 * On failure returns -1 and stores NULL in *out (when `out` is not NULL). NULL `engine`,
 * `addr` or `out`, and `len` of 0, are failures.
 */
int tiermem_prepare_kernel_access(tiermem_engine *engine, const void *addr, size_t len,
                                  int write, tiermem_pin **out);

/* Release a pin from tiermem_prepare_kernel_access. NULL is a no-op. */
void tiermem_pin_release(tiermem_pin *pin);

/*
 * The engine's counters and latencies as one JSON object, e.g.
 * {"critical_reads":..,"evictions":..,"writebacks":..,...,"paths":[...]}.
 * The caller frees the string with tiermem_string_free. Returns NULL on failure (NULL `engine`).
 */
char *tiermem_stats_json(const tiermem_engine *engine);

/* Free a string returned by this library (tiermem_stats_json). NULL is a no-op. Do not pass
 * strings from elsewhere, nor the result of tiermem_last_error. */
void tiermem_string_free(char *s);

/*
 * Write a one-line description of the engine (device, fault mode, dirty tracking, I/O queues,
 * reclaim, policies) into `buf`, with snprintf semantics: at most len - 1 bytes plus a
 * terminating NUL are written (nothing if len is 0, in which case buf may be NULL), and the
 * return value is the length of the full description without the NUL, so a return value >= len
 * means it was truncated. Returns -1 on failure (NULL `engine`, or NULL `buf` with len > 0).
 */
int tiermem_engine_describe(const tiermem_engine *engine, char *buf, size_t len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TIERMEM_H */
