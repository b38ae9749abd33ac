/* Random updates to a table, in the style of HPCC RandomAccess (GUPS): a 16 MiB table of
 * 64-bit words, 4 updates per word, each XORing a pseudo-random value into the word it
 * selects, so nearly every update touches a different page. The updates are then applied
 * again, which restores the table; the program checks that and prints the table's checksum.
 * -DTABLE_LOG2=N and -DUPDATES=N change the table's size and the number of updates a pass. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef TABLE_LOG2
#define TABLE_LOG2 21
#endif
#define TABLE (1UL << TABLE_LOG2)
#ifndef UPDATES
#define UPDATES (4 * TABLE)
#endif

/* The polynomial shift register HPCC uses (x^63 + x^2 + x + 1), one step per update. */
static uint64_t next(uint64_t r) { return (r << 1) ^ ((int64_t)r < 0 ? 7 : 0); }

static void update(uint64_t *table) {
    uint64_t r = 1;
    for (uint64_t i = 0; i < UPDATES; i++) {
        r = next(r);
        table[r & (TABLE - 1)] ^= r;
    }
}

int main(void) {
    uint64_t *table = malloc(sizeof(uint64_t) * TABLE);
    if (!table) {
        fputs("out of memory\n", stderr);
        return 1;
    }
    for (uint64_t i = 0; i < TABLE; i++) table[i] = i;
    update(table);
    uint64_t checksum = 0;
    for (uint64_t i = 0; i < TABLE; i++) checksum ^= table[i] * (2 * i + 1);
    update(table);
    for (uint64_t i = 0; i < TABLE; i++) {
        if (table[i] != i) {
            fprintf(stderr, "word %llu not restored\n", (unsigned long long)i);
            return 1;
        }
    }
    printf("%016llx restored\n", (unsigned long long)checksum);
    return 0;
}
