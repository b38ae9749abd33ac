/* An integer sort in the style of NPB IS (class W-like: 2^20 keys below 2^16), for a
 * page-level trace. Keys come from the NPB linear congruential generator (x = 5^13 x mod 2^46),
 * each the mean of four draws, so they bunch in the middle. Each of ten iterations ranks the
 * keys the NPB way: bucket sizes from the high bits, keys scattered into their buckets (1024
 * write streams), a count per key within each bucket, prefix sums. The last ranking is checked
 * by placing every key at its rank. Prints the keys' checksum and "sorted". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define TOTAL_KEYS (1 << 20)
#define MAX_KEY (1 << 16)
#define BUCKETS_LOG2 10
#define BUCKETS (1 << BUCKETS_LOG2)
#define SHIFT (16 - BUCKETS_LOG2)
#define ITERATIONS 10

static double draw(uint64_t *x) {
    const uint64_t a = 1220703125ULL; /* 5^13 */
    *x = (*x * a) & ((1ULL << 46) - 1);
    return (double)*x / (double)(1ULL << 46);
}

int main(void) {
    int32_t *keys = malloc(sizeof(int32_t) * TOTAL_KEYS);
    int32_t *scattered = malloc(sizeof(int32_t) * TOTAL_KEYS);
    int32_t *counts = malloc(sizeof(int32_t) * MAX_KEY);
    int32_t *bucket_size = calloc(BUCKETS, sizeof(int32_t));
    int32_t *bucket_ptr = malloc(sizeof(int32_t) * BUCKETS);
    if (!keys || !scattered || !counts || !bucket_size || !bucket_ptr) {
        fputs("out of memory\n", stderr);
        return 1;
    }
    uint64_t x = 314159265;
    for (int i = 0; i < TOTAL_KEYS; i++) {
        double sum = draw(&x) + draw(&x) + draw(&x) + draw(&x);
        keys[i] = (int32_t)(sum * (MAX_KEY / 4));
    }
    for (int it = 1; it <= ITERATIONS; it++) {
        /* NPB changes two keys per iteration so that no ranking can be reused. */
        keys[it] = it;
        keys[it + ITERATIONS] = MAX_KEY - it;
        for (int b = 0; b < BUCKETS; b++) bucket_size[b] = 0;
        for (int i = 0; i < TOTAL_KEYS; i++) bucket_size[keys[i] >> SHIFT]++;
        bucket_ptr[0] = 0;
        for (int b = 1; b < BUCKETS; b++) bucket_ptr[b] = bucket_ptr[b - 1] + bucket_size[b - 1];
        for (int i = 0; i < TOTAL_KEYS; i++) scattered[bucket_ptr[keys[i] >> SHIFT]++] = keys[i];
        /* Count each key within its bucket's key range, then turn counts into ranks. */
        int start = 0;
        for (int b = 0; b < BUCKETS; b++) {
            int lo = b << SHIFT, hi = lo + (1 << SHIFT);
            for (int k = lo; k < hi; k++) counts[k] = 0;
            int end = start + bucket_size[b];
            for (int i = start; i < end; i++) counts[scattered[i]]++;
            int rank = start;
            for (int k = lo; k < hi; k++) {
                rank += counts[k];
                counts[k] = rank;
            }
            start = end;
        }
    }
    /* Full verification: each key goes to its rank (counts[k] = ranks below k+1). */
    for (int i = 0; i < TOTAL_KEYS; i++) scattered[--counts[keys[i]]] = keys[i];
    uint64_t checksum = 0;
    for (int i = 0; i < TOTAL_KEYS; i++) {
        if (i > 0 && scattered[i - 1] > scattered[i]) {
            fprintf(stderr, "not sorted at %d\n", i);
            return 1;
        }
        checksum = checksum * 31 + (uint64_t)scattered[i];
    }
    printf("%016llx sorted\n", (unsigned long long)checksum);
    return 0;
}
