// What it costs to take pages away from a running process, the way tiermem's eviction can.
//
// Every way of unmapping a page flushes the TLB of each other CPU that runs the process at that
// moment: an inter-processor interrupt, which in a VM is a VM exit on both sides. This probe
// measures, with a second thread of the process busy on another CPU (as the program is while
// tiermem's reclaim thread evicts):
//   - UFFDIO_MOVE of runs of 1..64 contiguous pages (async-WP eviction moves each run of victims
//     out in one call), and the same with the other thread asleep;
//   - process_madvise(MADV_DONTNEED) of 32 scattered pages in one call (sync-WP eviction);
//   - MADV_FREE then MADV_PAGEOUT (the kernel drops each page unless written after the FREE),
//     scattered and in 32-page runs, and whether a write racing between the two survives.
// Usage: unmap_cost [pages]   (default 16384; a multiple of 128)
// Build: gcc -O2 -pthread -o unmap_cost unmap_cost.c
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define PG 4096UL
// Newer than some distributions' headers.
#define FEATURE_WP_ASYNC (1 << 15)
#define FEATURE_MOVE (1 << 16)
struct move_arg { uint64_t dst, src, len, mode; int64_t move; };
#define IOCTL_MOVE _IOWR(UFFDIO, 0x05, struct move_arg)
#define PIDFD_SELF_THREAD (-10000)
#ifndef MADV_PAGEOUT
#define MADV_PAGEOUT 21
#endif

static int uffd;
static volatile int spin_stop, spin_sleep;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

// The "program": keeps this process's address space live on CPU 1 unless asked to sleep.
static void *busy(void *arg) {
    static char buf[1 << 18];
    volatile uint64_t sum = 0;
    (void)arg;
    pin(1);
    while (!spin_stop) {
        if (spin_sleep) {
            usleep(1000);
            continue;
        }
        for (size_t i = 0; i < sizeof buf; i += 64) sum += buf[i]++;
    }
    return NULL;
}

static char *region(size_t pages) {
    char *p = mmap(NULL, pages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    madvise(p, pages * PG, MADV_NOHUGEPAGE);
    struct uffdio_register r = { .range = { (uintptr_t)p, pages * PG },
                                 .mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP };
    if (ioctl(uffd, UFFDIO_REGISTER, &r)) { perror("UFFDIO_REGISTER"); exit(1); }
    return p;
}

// Page in every page the way tiermem does: UFFDIO_COPY, write-protected.
static void fill(char *base, size_t pages) {
    static char page[PG];
    for (size_t i = 0; i < pages; i++) {
        memset(page, (int)(i % 251) + 1, PG);
        struct uffdio_copy c = { .dst = (uintptr_t)(base + i * PG), .src = (uintptr_t)page, .len = PG,
                                 .mode = UFFDIO_COPY_MODE_WP };
        if (ioctl(uffd, UFFDIO_COPY, &c)) { perror("UFFDIO_COPY"); exit(1); }
    }
}

static long madvise_many(struct iovec *v, int n, int advice) {
    return syscall(SYS_process_madvise, PIDFD_SELF_THREAD, v, n, advice, 0);
}

static int resident(char *p) {
    unsigned char v = 0;
    mincore(p, PG, &v);
    return v & 1;
}

// UFFDIO_MOVE of every other run of `run` pages; µs per call.
static double move_runs(char *src, char *dst, size_t pages, size_t run) {
    fill(src, pages);
    size_t calls = 0;
    double t = now();
    for (size_t i = 0; i + run <= pages; i += 2 * run) {
        struct move_arg m = { (uintptr_t)(dst + i * PG), (uintptr_t)(src + i * PG), run * PG, 0, 0 };
        if (ioctl(uffd, IOCTL_MOVE, &m)) { perror("UFFDIO_MOVE"); exit(1); }
        calls++;
    }
    double us = (now() - t) / calls * 1e6;
    madvise(src, pages * PG, MADV_DONTNEED);
    madvise(dst, pages * PG, MADV_DONTNEED);
    return us;
}

int main(int argc, char **argv) {
    size_t pages = argc > 1 ? strtoul(argv[1], NULL, 10) : 16384;
    if (pages < 128 || pages % 128) { fprintf(stderr, "unmap_cost: pages must be a positive multiple of 128\n"); return 2; }
    pin(0);
    uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    struct uffdio_api api = { .api = UFFD_API, .features = FEATURE_WP_ASYNC | FEATURE_MOVE };
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api)) {
        printf("SKIPPED: userfaultfd with WP_ASYNC and MOVE unavailable (%s)\n", strerror(errno));
        return 0;
    }
    struct iovec probe = { NULL, 0 };
    if (madvise_many(&probe, 1, MADV_DONTNEED) < 0 && errno == EBADF) {
        printf("SKIPPED: process_madvise on oneself (PIDFD_SELF) unavailable\n");
        return 0;
    }
    char *src = region(pages), *dst = region(pages);
    pthread_t t;
    pthread_create(&t, NULL, busy, NULL);
    usleep(20000);

    printf("UFFDIO_MOVE, other thread %-7s  run  us/call  us/page\n", "busy");
    for (size_t run = 1; run <= 64; run *= 2) {
        double us = move_runs(src, dst, pages, run);
        printf("%36zu %8.2f %8.2f\n", run, us, us / run);
    }
    spin_sleep = 1;
    usleep(20000);
    double alone = move_runs(src, dst, pages, 1);
    printf("UFFDIO_MOVE, other thread asleep     1 %8.2f %8.2f\n", alone, alone);
    spin_sleep = 0;
    usleep(20000);

    // 32 scattered pages (every other one) per call.
    fill(src, pages);
    size_t n = 0;
    double tt = now();
    for (size_t base = 0; base + 64 <= pages; base += 64, n += 32) {
        struct iovec v[32];
        for (int k = 0; k < 32; k++) v[k] = (struct iovec){ src + (base + 2 * k) * PG, PG };
        if (madvise_many(v, 32, MADV_DONTNEED) < 0) { perror("process_madvise(DONTNEED)"); return 1; }
    }
    printf("process_madvise(DONTNEED), 32 scattered pages a call: %.2f us/page\n", (now() - tt) / n * 1e6);
    madvise(src, pages * PG, MADV_DONTNEED);

    // FREE + PAGEOUT, 32 scattered pages a call; in every eighth batch a write lands on one page
    // between the two calls and must survive.
    fill(src, pages);
    size_t raced = 0, lost = 0, dropped = 0;
    double t_free = 0, t_out = 0;
    n = 0;
    for (size_t base = 0; base + 64 <= pages; base += 64, n += 32) {
        struct iovec v[32];
        for (int k = 0; k < 32; k++) v[k] = (struct iovec){ src + (base + 2 * k) * PG, PG };
        double a = now();
        if (madvise_many(v, 32, MADV_FREE) < 0) { perror("process_madvise(FREE)"); return 1; }
        double b = now();
        int race = (base / 64) % 8 == 0;
        if (race) src[(base + 6) * PG + 5] = 0x55;
        double c = now();
        if (madvise_many(v, 32, MADV_PAGEOUT) < 0) { perror("process_madvise(PAGEOUT)"); return 1; }
        t_free += b - a;
        t_out += now() - c;
        for (int k = 0; k < 32; k++) dropped += !resident(src + (base + 2 * k) * PG);
        if (race) {
            raced++;
            lost += !resident(src + (base + 6) * PG) || src[(base + 6) * PG + 5] != 0x55;
        }
    }
    printf("MADV_FREE + MADV_PAGEOUT, 32 scattered pages a call: %.2f + %.2f us/page, %zu of %zu dropped\n",
           t_free / n * 1e6, t_out / n * 1e6, dropped, n);
    printf("racing writes between FREE and PAGEOUT: %zu, lost: %zu\n", raced, lost);
    madvise(src, pages * PG, MADV_DONTNEED);

    fill(src, pages);
    tt = now();
    for (size_t i = 0; i < pages; i += 32) {
        struct iovec v = { src + i * PG, 32 * PG };
        madvise_many(&v, 1, MADV_FREE);
        madvise_many(&v, 1, MADV_PAGEOUT);
    }
    printf("MADV_FREE + MADV_PAGEOUT, 32-page runs: %.2f us/page\n", (now() - tt) / pages * 1e6);

    spin_stop = 1;
    pthread_join(t, NULL);
    return 0;
}
