"""Phase two alone, old code against new, on the 1,000,000-file bench tree with distinct content.

    python phase_two_ab.py prep ROOT           # distinct names (bench/synth.py), phase one into /tmp/p1.db
    python phase_two_ab.py new|old ROOT        # copy of /tmp/p1.db, then parse_pending over it, timed
    python phase_two_ab.py undo ROOT           # the shared names back

Run `old` from a checkout of the old code (cwd and PYTHONPATH both there: the parse workers are
`python -m cachemgr.index.workers`, which import from the working directory first).
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]  # bench/
from synth import distinct_names, shared_names  # noqa: E402

mode, root = sys.argv[1], sys.argv[2]


def fresh(db: str) -> None:
    for s in ("", "-wal", "-shm"):
        if os.path.exists(db + s):
            os.unlink(db + s)


if mode == "prep":
    Path("/tmp/renames.json").write_text(json.dumps([(str(f), a, b) for f, a, b in distinct_names(Path(root))]))
    from cachemgr.index import fill, schema
    from cachemgr.index.workers import Pool

    fresh("/tmp/p1.db")
    conn = schema.open_at_head("/tmp/p1.db", True)
    conn.execute("INSERT INTO caches (host, root) VALUES (?, ?)", ("bench", root))
    with Pool() as pool:
        r = fill.first_fill(conn, 1, root, pool)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    print("pending", r.pending)
elif mode == "undo":
    shared_names([(Path(f), a, b) for f, a, b in json.loads(Path("/tmp/renames.json").read_text())])
else:
    fresh("/tmp/p2.db")
    shutil.copy("/tmp/p1.db", "/tmp/p2.db")
    from cachemgr.index import schema
    from cachemgr.index.dbapi import OverSqlite
    from cachemgr.index.pending import parse_pending
    from cachemgr.index.workers import Pool

    conn = schema.open_at_head("/tmp/p2.db", False)
    t = time.perf_counter()
    with Pool() as pool:
        r = parse_pending(OverSqlite(conn), 1, root, None, pool)
    print(mode, f"phase two {time.perf_counter() - t:.2f} s", r.parsed, "entries")
