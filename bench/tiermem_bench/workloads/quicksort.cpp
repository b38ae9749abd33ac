// Quicksort workload: std::sort (introsort) over N pseudo-random 64-bit integers from a fixed seed.
// The driver only generates the input, times the sort and prints a digest of the sorted array (an
// FNV-1a hash over every element), in the result-line format of the Python workloads.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s N SEED\n", argv[0]);
        return 2;
    }
    const std::size_t n = std::strtoull(argv[1], nullptr, 10);
    const std::uint64_t seed = std::strtoull(argv[2], nullptr, 10);
    auto start = std::chrono::steady_clock::now();
    std::vector<std::int64_t> values(n);
    std::mt19937_64 rng(seed);
    for (auto& v : values) v = static_cast<std::int64_t>(rng());
    std::sort(values.begin(), values.end());
    const bool sorted = std::is_sorted(values.begin(), values.end());
    std::uint64_t hash = 1469598103934665603ULL;
    for (auto v : values) hash = (hash ^ static_cast<std::uint64_t>(v)) * 1099511628211ULL;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("TIERMEM_BENCH_RESULT {\"digest\": \"%016" PRIx64 "-%zu-%d\", \"work_s\": %.6f, \"n\": %zu}\n",
                hash, n, sorted ? 1 : 0, seconds, n);
    return sorted ? 0 : 1;
}
