# Inputs for the recorded programs (deterministic): text lines for GNU sort, integers for
# `sort -n`, and a SQLite table for random index lookups.
import random
import sqlite3
import sys

out = sys.argv[1]
random.seed(1)
lines = ['%d %s\n' % (random.randrange(10**9), 'x' * random.randrange(5, 40)) for _ in range(60000)]
with open(f'{out}/l10k.txt', 'w') as f:
    f.writelines(lines[:10000])
random.seed(2)
with open(f'{out}/ints.txt', 'w') as f:
    f.writelines('%d\n' % random.randrange(2**31) for _ in range(25000))
random.seed(3)
db = sqlite3.connect(f'{out}/t.db')
db.execute('drop table if exists t')
db.execute('create table t(id integer primary key, k integer, pad text)')
db.executemany('insert into t values(?,?,?)', ((i, random.randrange(40000), 'p' * 100) for i in range(40000)))
db.commit()
