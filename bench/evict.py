"""Evict half of a large cache, against `find -delete` over the same files, in one run.

The cache is the repository's H200 fixture (real fxgraph, AOT, Triton, module and autotune
entries) replicated under new keys, so its proportions are the fixture's; every file is a hard
link to one extracted copy (a 1,000,000-file cache costs directory entries, not data). Its index
is the fixture's scanned index with every key, ref and alias renamed the same way (checked by a
rescan that must find every entry unchanged). Then, on two trees of links to the same files:

  cachemgr: plan + carry out eviction down to half the files (rename into the trash, index rows
            and events committed, unlink), `cachemgr.evict.evict` in a process of its own, whose
            peak RSS is reported (target < 150 MB at 1,000,000 files), and the largest peak
            (VmHWM) of its worker processes (a large plan is looked at and moved by those);
  baseline: `find <the same entries' paths> -delete` (fed by xargs), on the other tree.

Both unlink directory entries only (the files' data stays, held by the other tree's links).

    python bench/evict.py                  # 100,000 files
    python bench/evict.py --files 1000000
    python bench/evict.py --quick          # 10,000 files
    python bench/evict.py --processes 0    # one looker thread, whatever the plan's size
    python bench/evict.py --profile ev.prof  # where the evicting process's time goes (pstats)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from sqlalchemy import func, select, update
from synth import check_room, child_env, extract_fixture, link_copies, renamed_key, tag

from cachemgr import layout, parse
from cachemgr.index.db import Database
from cachemgr.index.models import Cache, Entry, EntryRef
from cachemgr.index.scan import insert_rows, reconcile

MB = 1 << 20
EVICT = """
import json, resource, sys, time
from cachemgr.evict import Limits
from cachemgr.index.db import Database
from cachemgr.evict import execute
db, cid, root, keep = Database(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
from cachemgr.evict import look
worker_peak = [0]  # the largest VmHWM of a worker process, read before it is closed
_close = look._Process.close
def _measured(self):
    try:
        with open(f"/proc/{self.proc.pid}/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
        worker_peak[0] = max(worker_peak[0], int(hwm.split()[1]) * 1024)
    except (OSError, StopIteration):
        pass
    _close(self)
look._Process.close = _measured
processes = int(sys.argv[5])
if processes >= 0:  # 0: one looker thread, whatever the plan's size
    execute.PROCESSES_FROM, execute.LOOK_PROCESSES = (0, processes) if processes else (1 << 62, 1)
profile = None
if sys.argv[6]:  # --profile: the evicting process under cProfile (its time is then not the measure)
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
# evict() as it is (under one lock: plan, then carry out), its two halves timed, and the main
# thread's share of the carrying out: handing looks out, waiting for them, committing
from cachemgr.evict import carry_out, make_plan
spent = {"look": 0.0, "wait": 0.0, "commit": 0.0}
def _timed(name, f):
    def run(*a, **kw):
        t0 = time.perf_counter()
        try:
            return f(*a, **kw)
        finally:
            spent[name] += time.perf_counter() - t0
    return run
execute.Executor._look = _timed("look", execute.Executor._look)
execute.Executor._commit = _timed("commit", execute.Executor._commit)
execute._collect = _timed("wait", execute._collect)
limits = Limits(max_files=keep, low_water=1.0, grace=60)
t = time.perf_counter()
with execute.exclusive(root) as opened:
    now = time.time()
    p, rows = make_plan(db, cid, opened, limits, "lru", now)
    planned = time.perf_counter() - t
    res = carry_out(db, cid, opened, p, rows, limits.grace, False, now)
took = time.perf_counter() - t
if profile is not None:
    profile.disable()
    profile.dump_stats(sys.argv[6])
print(json.dumps({"seconds": took, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "worker_rss": worker_peak[0], "plan": planned, **spent,
                  "evicted": res.evicted, "freed_files": res.freed_files, "freed_bytes": res.freed_bytes,
                  "recreatable": res.recreatable_freed_bytes, "skipped": len(res.skipped)}))
"""


def build(work: Path, files: int, fixture: Path | None) -> tuple[Path, Database, int, int]:
    src = extract_fixture(work / "fixture", fixture)
    fixture_files = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and not p.is_symlink()]
    times = {rel: os.lstat(src / rel).st_mtime for rel in fixture_files}
    template = Database(f"sqlite:///{work / 'template.db'}")
    tcid = template.cache_id("bench", str(src))
    reconcile(template, tcid, str(src))
    for rel, m in times.items():  # reading entries may have moved atimes: as old as the fixture again,
        os.utime(src / rel, (m, m))  # past the grace period (the links share these inodes)
    copies = max(1, round(files / len(fixture_files)))
    check_room(work, 2 * copies * len(fixture_files))

    root, twin = work / "cache", work / "twin"
    link_copies(src, [root, twin], fixture_files, copies)

    e, r = Entry.__table__, EntryRef.__table__
    with template.engine.connect() as conn:
        rows = [dict(m) for m in conn.execute(select(e).where(e.c.cache_id == tcid)).mappings()]
        refs = [tuple(x) for x in conn.execute(select(r.c.entry_id, r.c.kind, r.c.ref))]
    db = Database(f"sqlite:///{work / 'index.db'}")
    cid = db.cache_id("bench", str(root))
    with db.engine.begin() as conn:  # read by today's readers: the check below must not read every entry again
        conn.execute(update(Cache).where(Cache.id == cid).values(reader=parse.READER))
    by_id = {row["id"]: row for row in rows}
    with db.engine.begin() as conn:
        for c in range(copies):
            new_rows = []
            for row in rows:
                row = dict(row)
                row.pop("id")
                key = renamed_key(row["key"], row["kind"], c)
                row.update(
                    cache_id=cid,
                    key=key,
                    dir=layout.home_dir(key, row["kind"]),
                    ref=row["ref"] and tag(row["ref"], c),
                    alias=row["alias"] and tag(row["alias"], c),
                    graph_key=row["graph_key"] and tag(row["graph_key"], c),
                    last_access=row["mtime"],
                )
                new_rows.append(row)
            last = conn.execute(select(func.coalesce(func.max(e.c.id), 0))).scalar()
            insert_rows(conn, e, new_rows)
            ids = {k: i for i, k in conn.execute(select(e.c.id, e.c.key).where(e.c.id > last))}
            insert_rows(
                conn,
                r,
                [
                    {
                        "entry_id": ids[renamed_key(by_id[eid]["key"], by_id[eid]["kind"], c)],
                        "kind": kind,
                        "ref": tag(ref, c),
                    }
                    for eid, kind, ref in refs
                ],
            )
    check = reconcile(db, cid, str(root))
    assert not (check.added or check.changed or check.removed or check.parsed), check.as_dict()
    return root, db, cid, copies * len(fixture_files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="10,000 files")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument(
        "--fixture",
        default=None,
        help="the fixture .tgz (default: tests/fixtures/gpu/inductor-cache-h200-torch2.11.tgz)",
    )
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--processes",
        type=int,
        default=-1,
        help="look and move in this many worker processes (0: in one thread; default: the executor's own choice)",
    )
    ap.add_argument("--profile", default="", help="write the evicting process's cProfile stats here (pstats)")
    args = ap.parse_args()
    if args.profile:
        args.profile = os.path.abspath(args.profile)
    files = 10_000 if args.quick else args.files
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-evict-", dir=args.dir))
    try:
        t = time.perf_counter()
        root, db, cid, n = build(work, files, Path(args.fixture) if args.fixture else None)
        twin = work / "twin"
        print(f"built {n:,} files x2 (hard links) and their index in {time.perf_counter() - t:.1f} s", flush=True)

        os.sync()
        out = subprocess.run(
            [sys.executable, "-c", EVICT, db.url, str(cid), str(root), str(n // 2), str(args.processes), args.profile],
            env=child_env(),
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        res = json.loads(out)
        assert res["skipped"] == 0, res["skipped"]

        # what went, from the index's evict events (not printed by the child: its RSS is the measure)
        with sqlite3.connect(work / "index.db") as conn:
            gone = conn.execute("SELECT entry_key, entry_kind FROM events WHERE kind = 'evict'").fetchall()
        assert len(gone) == res["evicted"], (len(gone), res["evicted"])
        paths = [str(twin / k) for k, kind in gone for k in _entry_paths(twin, k, kind)]
        listing = work / "paths"
        listing.write_bytes(b"\0".join(p.encode() for p in paths) + b"\0")
        os.sync()
        t = time.perf_counter()
        subprocess.run(["xargs", "-0", "-a", str(listing), "sh", "-c", 'find "$@" -delete', "sh"], check=True)
        theirs = time.perf_counter() - t

        left_ours, left_theirs = _files(root), _files(twin)
        assert left_ours == left_theirs, "both runs must leave the same files"
        ours = res["seconds"]
        print(
            f"evicted {res['evicted']:,} entries, {res['freed_files']:,} files, {res['freed_bytes'] / 1e6:,.0f} MB "
            f"({res['recreatable'] / 1e6:,.0f} MB recreatable); {len(left_ours):,} files left; "
            f"{os.cpu_count()} cores"
        )
        print(
            f"cachemgr evict (plan + trash + index + unlink): {ours:.2f} s, peak RSS {res['rss'] / MB:.0f} MB "
            f"(target < 150 MB; its worker processes' largest {res['worker_rss'] / MB:.0f} MB)"
        )
        print(
            f"  of which: plan {res['plan']:.2f} s; carrying out {ours - res['plan']:.2f} s, its main thread "
            f"handing looks out {res['look']:.2f} s, waiting for them {res['wait']:.2f} s, committing "
            f"{res['commit']:.2f} s"
        )
        print(f"find -delete over the same paths:               {theirs:.2f} s")
        print(f"ratio: {ours / theirs:.2f}x (target <= 2x)")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "files": n,
                        "evicted_files": res["freed_files"],
                        "seconds": ours,
                        "find_delete": theirs,
                        "rss": res["rss"],
                        "worker_rss": res["worker_rss"],
                        "split": {k: res[k] for k in ("plan", "look", "wait", "commit")},
                    },
                    indent=1,
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _files(root: Path) -> list[str]:
    """Every regular file under `root`, relative, sorted (os.walk: pathlib cost minutes at 1,000,000)."""
    out = []
    for top, _, names in os.walk(root):
        rel = os.path.relpath(top, root)
        out.extend(n if rel == "." else f"{rel}/{n}" for n in names)
    return sorted(out)


def _entry_paths(root: Path, key: str, kind: str) -> list[str]:
    """The paths find gets: a Triton kernel directory whole, else each file of the entry."""
    if kind == "triton":
        return [key]
    folder, _, stem = key.rpartition("/")
    if kind == "code":
        return [f"{folder}/{n}" for n in os.listdir(root / folder) if n.startswith(stem + ".")]
    return [key]


if __name__ == "__main__":
    main()
