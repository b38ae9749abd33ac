// Every C-library way a program hands a large buffer to the kernel, on buffers whose pages are
// not resident: never touched, or written and then pushed out by touching other memory. Under
// tiermem's sigbus fault mode the kernel cannot wait for such a page, so each of these calls only
// works if the shim makes the buffer resident first. Prints one line per call ("ok" or what went
// wrong) on stdout, which must read the same with and without tiermem, and on stderr how many
// buffer pages were not resident right before the calls (mincore).
//
// Usage: syscalls_into_managed_buffers DIR   (DIR: where to put the data files)

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <string>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <thread>
#include <unistd.h>

extern "C" ssize_t __read_chk(int, void*, size_t, size_t);
extern "C" ssize_t __pread64_chk(int, void*, size_t, off_t, size_t);
extern "C" ssize_t __recv_chk(int, void*, size_t, size_t, int);
extern "C" size_t __fread_chk(void*, size_t, size_t, size_t, FILE*);

static const size_t BUF = 4 << 20;      // each buffer: managed (above the 1 MiB threshold)
static const size_t SPILL = 40 << 20;   // touched to push the others out of a 16 MiB limit
static unsigned char* spill;
static size_t not_resident_before_calls = 0;
static int failures = 0;

static unsigned char pattern(size_t i) { return (unsigned char)(i * 131 + (i >> 12) * 7 + 1); }

static uint64_t fnv(const unsigned char* p, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

static uint64_t pattern_hash() {
    static unsigned char* p = nullptr;
    if (!p) {
        p = (unsigned char*)malloc(BUF);
        for (size_t i = 0; i < BUF; i++) p[i] = pattern(i);
    }
    return fnv(p, BUF);
}

static size_t count_not_resident(unsigned char* buf) {
    unsigned char vec[BUF / 4096];
    if (mincore(buf, BUF, vec) != 0) return 0;
    size_t n = 0;
    for (unsigned char v : vec) n += !(v & 1);
    return n;
}

// A buffer whose pages are not resident: `fresh` never touched; otherwise written with `fill`
// (the pattern or a junk byte) and then displaced by writing the spill area.
static unsigned char* buffer(bool fresh, bool with_pattern) {
    unsigned char* b = (unsigned char*)malloc(BUF);
    if (!fresh) {
        for (size_t i = 0; i < BUF; i++) b[i] = with_pattern ? pattern(i) : 0x5a;
        for (size_t i = 0; i < SPILL; i += 4096) spill[i]++;
    }
    not_resident_before_calls += count_not_resident(b);
    return b;
}

static void report(const std::string& name, bool ok, const char* why) {
    if (ok) {
        printf("%s ok\n", name.c_str());
    } else {
        printf("%s FAILED: %s\n", name.c_str(), why);
        failures++;
    }
}

static void check_read(const std::string& name, unsigned char* b, ssize_t got) {
    if (got < 0) return report(name, false, strerror(errno));
    if ((size_t)got != BUF) return report(name, false, "short transfer");
    report(name, fnv(b, BUF) == pattern_hash(), "wrong contents");
}

// Feeds the pattern into a socket from a small (unmanaged) buffer, then closes it.
static std::thread feeder(int fd) {
    return std::thread([fd] {
        unsigned char chunk[8192];
        for (size_t at = 0; at < BUF;) {
            size_t n = BUF - at < sizeof chunk ? BUF - at : sizeof chunk;
            for (size_t i = 0; i < n; i++) chunk[i] = pattern(at + i);
            ssize_t w = send(fd, chunk, n, MSG_NOSIGNAL);
            if (w <= 0) break;
            at += (size_t)w;
        }
        close(fd);
    });
}

// Receives into `b` with `recv_some` until the buffer is full or the peer is done.
template <class F>
static ssize_t receive_all(unsigned char* b, F recv_some) {
    size_t at = 0;
    while (at < BUF) {
        ssize_t r = recv_some(b + at, BUF - at);
        if (r < 0) return -1;
        if (r == 0) break;
        at += (size_t)r;
    }
    return (ssize_t)at;
}

template <class F>
static void socket_read_case(const std::string& name, bool fresh, F recv_some) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return report(name, false, strerror(errno));
    unsigned char* b = buffer(fresh, false);
    std::thread t = feeder(sv[1]);
    ssize_t got = receive_all(b, [&](unsigned char* p, size_t n) { return recv_some(sv[0], p, n); });
    int saved = errno;
    close(sv[0]);  // a feeder still writing (after a failed receive) stops with EPIPE
    t.join();
    errno = saved;
    check_read(name, b, got);
    free(b);
}

// Drains a socket into a small buffer, hashing what arrives.
static std::thread drainer(int fd, uint64_t* hash, size_t* total) {
    return std::thread([fd, hash, total] {
        unsigned char chunk[8192];
        uint64_t h = 1469598103934665603ULL;
        size_t n = 0;
        ssize_t r;
        while ((r = read(fd, chunk, sizeof chunk)) > 0) {
            for (ssize_t i = 0; i < r; i++) h = (h ^ chunk[i]) * 1099511628211ULL;
            n += (size_t)r;
        }
        *hash = h;
        *total = n;
    });
}

template <class F>
static void socket_write_case(const std::string& name, F send_some) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return report(name, false, strerror(errno));
    unsigned char* b = buffer(false, true);
    uint64_t hash = 0;
    size_t total = 0;
    std::thread t = drainer(sv[1], &hash, &total);
    size_t at = 0;
    const char* why = nullptr;
    while (at < BUF) {
        ssize_t w = send_some(sv[0], b + at, BUF - at);
        if (w <= 0) {
            why = strerror(errno);
            break;
        }
        at += (size_t)w;
    }
    shutdown(sv[0], SHUT_WR);
    t.join();
    close(sv[0]);
    close(sv[1]);
    if (why) report(name, false, why);
    else report(name, total == BUF && hash == pattern_hash(), "wrong contents");
    free(b);
}

// Copies BUF bytes from `src` to `dst` within this process with process_vm_readv (`dst` the
// local side) or process_vm_writev (`src` the local side), by wrapper or by number, going on
// after short transfers. Returns the bytes copied, or -1.
static ssize_t copy_within_process(unsigned char* dst, unsigned char* src, bool write, bool raw) {
    ssize_t done = 0;
    while ((size_t)done < BUF) {
        size_t left = BUF - (size_t)done;
        iovec to = {dst + done, left}, from = {src + done, left};
        iovec* local = write ? &from : &to;
        iovec* remote = write ? &to : &from;
        long number = write ? SYS_process_vm_writev : SYS_process_vm_readv;
        ssize_t n = raw ? (ssize_t)syscall(number, getpid(), local, 1, remote, 1, 0)
                  : write ? process_vm_writev(getpid(), local, 1, remote, 1, 0)
                          : process_vm_readv(getpid(), local, 1, remote, 1, 0);
        if (n <= 0) return n < 0 ? -1 : done;
        done += n;
    }
    return done;
}

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    std::string dir = argv[1];
    spill = (unsigned char*)malloc(SPILL);
    memset(spill, 1, SPILL);

    // The data file the read calls fetch.
    std::string data = dir + "/data";
    {
        unsigned char* p = (unsigned char*)malloc(BUF);
        for (size_t i = 0; i < BUF; i++) p[i] = pattern(i);
        FILE* f = fopen(data.c_str(), "wb");
        if (!f || fwrite(p, 1, BUF, f) != BUF || fclose(f) != 0) {
            perror("writing the data file");
            return 2;
        }
        free(p);
    }
    int fd = open(data.c_str(), O_RDONLY);
    if (fd < 0) {
        perror("open");
        return 2;
    }
    // A symbolic link and the working directory: paths the kernel writes into a buffer.
    std::string link = dir + "/link", target = "a-target-that-need-not-exist/" + std::string(200, 't');
    unlink(link.c_str());
    if (symlink(target.c_str(), link.c_str()) != 0) {
        perror("symlink");
        return 2;
    }
    char here[4096];
    if (!getcwd(here, sizeof here)) {
        perror("getcwd");
        return 2;
    }

    for (int fresh = 1; fresh >= 0; fresh--) {
        std::string state = fresh ? " (never touched)" : " (evicted)";
        auto file_case = [&](const char* name, auto call) {
            unsigned char* b = buffer(fresh, false);
            lseek(fd, 0, SEEK_SET);
            ssize_t got = call(b);
            check_read(std::string(name) + state, b, got);
            free(b);
        };
        file_case("read", [&](unsigned char* b) { return read(fd, b, BUF); });
        file_case("pread", [&](unsigned char* b) { return pread(fd, b, BUF, 0); });
        file_case("__read_chk", [&](unsigned char* b) { return __read_chk(fd, b, BUF, BUF); });
        file_case("__pread64_chk", [&](unsigned char* b) { return __pread64_chk(fd, b, BUF, 0, BUF); });
        file_case("syscall(read)", [&](unsigned char* b) { return (ssize_t)syscall(SYS_read, fd, b, BUF); });
        file_case("syscall(pread64)", [&](unsigned char* b) { return (ssize_t)syscall(SYS_pread64, fd, b, BUF, 0); });
        auto halves = [](unsigned char* b, iovec* v) {
            v[0] = {b, BUF / 2};
            v[1] = {b + BUF / 2, BUF / 2};
        };
        file_case("readv", [&](unsigned char* b) { iovec v[2]; halves(b, v); return readv(fd, v, 2); });
        file_case("preadv", [&](unsigned char* b) { iovec v[2]; halves(b, v); return preadv(fd, v, 2, 0); });
        file_case("preadv2", [&](unsigned char* b) { iovec v[2]; halves(b, v); return preadv2(fd, v, 2, 0, 0); });
        file_case("preadv2 at the file position",
                  [&](unsigned char* b) { iovec v[2]; halves(b, v); return preadv2(fd, v, 2, -1, 0); });
        file_case("syscall(readv)",
                  [&](unsigned char* b) { iovec v[2]; halves(b, v); return (ssize_t)syscall(SYS_readv, fd, v, 2); });
        file_case("syscall(preadv)", [&](unsigned char* b) {
            iovec v[2];
            halves(b, v);
            return (ssize_t)syscall(SYS_preadv, fd, v, 2, 0, 0);
        });
        file_case("fread", [&](unsigned char* b) {
            FILE* f = fopen(data.c_str(), "rb");
            ssize_t n = f ? (ssize_t)fread(b, 1, BUF, f) : -1;
            if (f) fclose(f);
            return n;
        });
        file_case("__fread_chk", [&](unsigned char* b) {
            FILE* f = fopen(data.c_str(), "rb");
            ssize_t n = f ? (ssize_t)__fread_chk(b, BUF, 1, BUF, f) : -1;
            if (f) fclose(f);
            return n;
        });

        socket_read_case("recv" + state, fresh, [](int s, unsigned char* p, size_t n) { return recv(s, p, n, 0); });
        socket_read_case("recvfrom" + state, fresh,
                         [](int s, unsigned char* p, size_t n) { return recvfrom(s, p, n, 0, nullptr, nullptr); });
        socket_read_case("__recv_chk" + state, fresh,
                         [](int s, unsigned char* p, size_t n) { return __recv_chk(s, p, n, n, 0); });
        auto recvmsg_into = [](int s, unsigned char* p, size_t n, bool raw) {
            iovec v[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
            msghdr m{};
            m.msg_iov = v;
            m.msg_iovlen = n > 1 ? 2 : 1;
            if (n == 1) v[0].iov_len = 1;
            return raw ? (ssize_t)syscall(SYS_recvmsg, s, &m, 0) : recvmsg(s, &m, 0);
        };
        socket_read_case("recvmsg" + state, fresh,
                         [&](int s, unsigned char* p, size_t n) { return recvmsg_into(s, p, n, false); });
        socket_read_case("syscall(recvmsg)" + state, fresh,
                         [&](int s, unsigned char* p, size_t n) { return recvmsg_into(s, p, n, true); });
        socket_read_case("syscall(recvfrom)" + state, fresh, [](int s, unsigned char* p, size_t n) {
            return (ssize_t)syscall(SYS_recvfrom, s, p, n, 0, nullptr, nullptr);
        });
        auto recvmmsg_into = [](int s, unsigned char* p, size_t n, bool raw) {
            iovec v[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
            mmsghdr m{};
            m.msg_hdr.msg_iov = v;
            m.msg_hdr.msg_iovlen = n > 1 ? 2 : 1;
            if (n == 1) v[0].iov_len = 1;
            int got = raw ? (int)syscall(SYS_recvmmsg, s, &m, 1, 0, nullptr) : recvmmsg(s, &m, 1, 0, nullptr);
            return got < 0 ? (ssize_t)-1 : got == 0 ? (ssize_t)0 : (ssize_t)m.msg_len;
        };
        socket_read_case("recvmmsg" + state, fresh,
                         [&](int s, unsigned char* p, size_t n) { return recvmmsg_into(s, p, n, false); });
        socket_read_case("syscall(recvmmsg)" + state, fresh,
                         [&](int s, unsigned char* p, size_t n) { return recvmmsg_into(s, p, n, true); });

        // The kernel copying within this process: from an evicted buffer into this one.
        auto vm_read_case = [&](const char* name, bool raw) {
            unsigned char* src = buffer(false, true);
            unsigned char* b = buffer(fresh, false);
            check_read(std::string(name) + state, b, copy_within_process(b, src, false, raw));
            free(b);
            free(src);
        };
        vm_read_case("process_vm_readv", false);
        vm_read_case("syscall(process_vm_readv)", true);

        auto path_case = [&](const char* name, const std::string& expected, auto call) {
            unsigned char* b = buffer(fresh, false);
            ssize_t n = call((char*)b);
            bool ok = n == (ssize_t)expected.size() && memcmp(b, expected.data(), expected.size()) == 0;
            report(std::string(name) + state, ok, n < 0 ? strerror(errno) : "wrong path");
            free(b);
        };
        path_case("readlink", target, [&](char* b) { return readlink(link.c_str(), b, BUF); });
        path_case("syscall(readlinkat)", target,
                  [&](char* b) { return (ssize_t)syscall(SYS_readlinkat, AT_FDCWD, link.c_str(), b, BUF); });
        path_case("getcwd", here, [&](char* b) { return getcwd(b, BUF) == b ? (ssize_t)strlen(b) : (ssize_t)-1; });
        // The system call's result counts the terminating NUL.
        path_case("syscall(getcwd)", here, [&](char* b) {
            ssize_t n = (ssize_t)syscall(SYS_getcwd, b, BUF);
            return n > 0 ? n - 1 : n;
        });

        // Random bytes: the call must fill the whole buffer (its contents cannot be checked).
        auto random_case = [&](const char* name, auto call) {
            unsigned char* b = buffer(fresh, false);
            ssize_t got = call(b);
            if (got < 0) report(std::string(name) + state, false, strerror(errno));
            else report(std::string(name) + state, (size_t)got == BUF, "short transfer");
            free(b);
        };
        random_case("getrandom", [](unsigned char* b) {
            size_t at = 0;
            while (at < BUF) {
                ssize_t r = getrandom(b + at, BUF - at, 0);
                if (r < 0) return r;
                at += (size_t)r;
            }
            return (ssize_t)at;
        });
        random_case("syscall(getrandom)", [](unsigned char* b) {
            size_t at = 0;
            while (at < BUF) {
                ssize_t r = (ssize_t)syscall(SYS_getrandom, b + at, BUF - at, 0);
                if (r < 0) return r;
                at += (size_t)r;
            }
            return (ssize_t)at;
        });
        random_case("getentropy", [](unsigned char* b) {
            for (size_t at = 0; at < BUF; at += 256)
                if (getentropy(b + at, 256) != 0) return (ssize_t)-1;
            return (ssize_t)BUF;
        });
    }

    // The kernel reading evicted pages: writes to a file, then sends on sockets.
    std::string out = dir + "/out";
    auto write_case = [&](const char* name, auto call) {
        int wfd = open(out.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (wfd < 0) return report(name, false, strerror(errno));
        unsigned char* b = buffer(false, true);
        ssize_t put = call(wfd, b);
        int saved = errno;
        free(b);
        if (put < 0) {
            close(wfd);
            return report(name, false, strerror(saved));
        }
        unsigned char chunk[8192];
        uint64_t h = 1469598103934665603ULL;
        size_t n = 0;
        ssize_t r;
        lseek(wfd, 0, SEEK_SET);
        while ((r = read(wfd, chunk, sizeof chunk)) > 0) {
            for (ssize_t i = 0; i < r; i++) h = (h ^ chunk[i]) * 1099511628211ULL;
            n += (size_t)r;
        }
        close(wfd);
        report(name, (size_t)put == BUF && n == BUF && h == pattern_hash(), "wrong contents in the file");
    };
    auto halves = [](unsigned char* b, iovec* v) {
        v[0] = {b, BUF / 2};
        v[1] = {b + BUF / 2, BUF / 2};
    };
    write_case("write (evicted)", [](int w, unsigned char* b) { return write(w, b, BUF); });
    write_case("pwrite (evicted)", [](int w, unsigned char* b) { return pwrite(w, b, BUF, 0); });
    write_case("syscall(write) (evicted)", [](int w, unsigned char* b) { return (ssize_t)syscall(SYS_write, w, b, BUF); });
    write_case("writev (evicted)", [&](int w, unsigned char* b) { iovec v[2]; halves(b, v); return writev(w, v, 2); });
    write_case("pwritev (evicted)", [&](int w, unsigned char* b) { iovec v[2]; halves(b, v); return pwritev(w, v, 2, 0); });
    write_case("pwritev2 (evicted)",
               [&](int w, unsigned char* b) { iovec v[2]; halves(b, v); return pwritev2(w, v, 2, 0, 0); });
    write_case("syscall(pwritev) (evicted)", [&](int w, unsigned char* b) {
        iovec v[2];
        halves(b, v);
        return (ssize_t)syscall(SYS_pwritev, w, v, 2, 0, 0);
    });
    write_case("fwrite (evicted)", [](int w, unsigned char* b) {
        FILE* f = fdopen(dup(w), "wb");
        ssize_t n = f ? (ssize_t)fwrite(b, 1, BUF, f) : -1;
        if (f) fclose(f);
        return n;
    });
    socket_write_case("send (evicted)", [](int s, unsigned char* p, size_t n) { return send(s, p, n, 0); });
    socket_write_case("sendto (evicted)",
                      [](int s, unsigned char* p, size_t n) { return sendto(s, p, n, 0, nullptr, 0); });
    auto sendmsg_from = [](int s, unsigned char* p, size_t n, bool raw) {
        iovec v[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
        msghdr m{};
        m.msg_iov = v;
        m.msg_iovlen = 2;
        return raw ? (ssize_t)syscall(SYS_sendmsg, s, &m, 0) : sendmsg(s, &m, 0);
    };
    socket_write_case("sendmsg (evicted)",
                      [&](int s, unsigned char* p, size_t n) { return sendmsg_from(s, p, n, false); });
    socket_write_case("syscall(sendmsg) (evicted)",
                      [&](int s, unsigned char* p, size_t n) { return sendmsg_from(s, p, n, true); });
    auto sendmmsg_from = [](int s, unsigned char* p, size_t n, bool raw) {
        iovec v[2] = {{p, n / 2}, {p + n / 2, n - n / 2}};
        mmsghdr m{};
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 2;
        int sent = raw ? (int)syscall(SYS_sendmmsg, s, &m, 1, 0) : sendmmsg(s, &m, 1, 0);
        return sent <= 0 ? (ssize_t)-1 : (ssize_t)m.msg_len;
    };
    socket_write_case("sendmmsg (evicted)",
                      [&](int s, unsigned char* p, size_t n) { return sendmmsg_from(s, p, n, false); });
    socket_write_case("syscall(sendmmsg) (evicted)",
                      [&](int s, unsigned char* p, size_t n) { return sendmmsg_from(s, p, n, true); });
    // The kernel copying within this process: from an evicted buffer into a fresh one.
    for (int raw = 0; raw <= 1; raw++) {
        const char* name = raw ? "syscall(process_vm_writev) (evicted)" : "process_vm_writev (evicted)";
        unsigned char* src = buffer(false, true);
        unsigned char* b = buffer(true, false);
        check_read(name, b, copy_within_process(b, src, true, raw));
        free(b);
        free(src);
    }

    close(fd);
    unlink(data.c_str());
    unlink(out.c_str());
    unlink(link.c_str());
    fprintf(stderr, "pages not resident right before the calls: %zu\n", not_resident_before_calls);
    printf("%d failures\n", failures);
    return failures ? 1 : 0;
}
