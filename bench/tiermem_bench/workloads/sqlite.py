"""SQLite: an in-memory database loaded from a file, indexed, grouped, sorted and probed.

The database engine is the system's libsqlite3 through Python's sqlite3 module. `prepare` writes
the input once as a database file (rows from a fixed-seed Park-Miller generator, computed inside
SQLite). A run copies the table into an in-memory database (temporary structures in memory too),
builds an index on it, then runs three queries: a GROUP BY over every row, a window over the rows
in text order (an in-memory sort of the whole table), and range probes through the index in
random key order. The first two walk the data; the third is random access into the B-tree.
"""

import argparse
import os
import sqlite3

from tiermem_bench.workloads._common import Timer, digest, emit, generator_tag, write_atomically

# What the input file depends on, and which of those only it needs (not the run's options).
INPUT_PARAMS = ("rows", "seed")
INPUT_ONLY = ("rows",)

# Park-Miller minimal standard generator: products stay below 2^63, so SQLite keeps integers.
MODULUS = 2_147_483_647
MULTIPLIER = 48_271


def input_args(cache_dir, rows, seed):
    """The run's options naming its input file."""
    return ["--db-file", db_file(cache_dir, rows, seed)]


def db_file(cache_dir, rows, seed):
    tag = generator_tag(prepare)
    return os.path.join(cache_dir, f"sqlite-{rows}-{seed}-{tag}.db")


def prepare(cache_dir, rows, seed):
    """Write the input database unless it is already there; returns the file's path."""
    path = db_file(cache_dir, rows, seed)
    if os.path.exists(path):
        return path
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t(a INTEGER, b INTEGER, c TEXT)")
    # a: a key (not unique), b: one of 1000 groups, c: text of 20-59 letters starting at a
    # pseudo-random letter, then the key.
    db.execute(f"""
        INSERT INTO t
        WITH RECURSIVE g(i, x) AS (
            SELECT 1, {seed % (MODULUS - 1) + 1}
            UNION ALL SELECT i + 1, x * {MULTIPLIER} % {MODULUS} FROM g WHERE i < {int(rows)})
        SELECT x, (x / 7) % 1000,
               substr('abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz',
                      1 + x % 26, 20 + (x / 26) % 40) || '-' || x
        FROM g""")
    db.commit()
    image = db.serialize()
    db.close()
    write_atomically(path, lambda out: out.write(image))
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--db-file", required=True, help="written by prepare()")
    parser.add_argument("--probes", type=int, default=100_000, help="range lookups through the index")
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)
    if not os.path.exists(args.db_file):
        parser.error(f"input database {args.db_file} does not exist (the harness's prepare step writes it)")

    with Timer() as timer:
        db = sqlite3.connect(":memory:")
        db.execute("PRAGMA temp_store = MEMORY")
        db.execute("ATTACH DATABASE ? AS input", (f"file:{args.db_file}?mode=ro",))
        db.execute("CREATE TABLE t AS SELECT a, b, c FROM input.t")
        db.execute("DETACH DATABASE input")
        db.execute("CREATE INDEX t_a ON t(a)")
        groups = db.execute("""
            SELECT b, count(*), sum(a) % 1000003, max(length(c)) FROM t
            GROUP BY b ORDER BY 2 DESC, 1 LIMIT 20""").fetchall()
        # Every row's place in text order weighs its key: the sum changes if any two rows swap.
        ordered = db.execute("""
            SELECT count(*), sum((a % 1000003) * (n % 7919)) FROM (
                SELECT a, row_number() OVER (ORDER BY c, a) AS n FROM t)""").fetchone()
        # Probes in pseudo-random key order, each reading the rows of a short key range.
        probed = db.execute(f"""
            WITH RECURSIVE k(i, x) AS (
                SELECT 1, {args.seed % (MODULUS - 1) + 7}
                UNION ALL SELECT i + 1, x * {MULTIPLIER} % {MODULUS} FROM k WHERE i < {args.probes})
            SELECT count(*), sum(t.b) FROM k JOIN t ON t.a BETWEEN k.x AND k.x + 20000""").fetchone()
        db.close()
    emit(digest(groups, list(ordered), list(probed)), timer.seconds, rows=ordered[0], probed_rows=probed[0])


if __name__ == "__main__":
    main()
