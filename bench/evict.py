"""Evict half of a 100,000-file cache, against `find -delete` over the same files, in one run.

The cache is the shared H200 fixture (real fxgraph, AOT, Triton, module and autotune entries)
copied again and again under new keys, so its proportions are the fixture's. Its index is the
fixture's scanned index with every key, ref and alias renamed the same way (checked by a rescan
that must find every entry unchanged). Then, on two identical copies:

  cachemgr: plan + carry out `evict` down to half the files (rename into the trash, index rows
            and events committed, unlink), through cachemgr.evict.evict;
  baseline: `find <the same entries' paths> -delete` (fed by xargs), on the other copy.

    python bench/evict.py               # 100,000 files
    python bench/evict.py --files 10000 # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from sqlalchemy import insert, select  # noqa: E402
from synth import extract_fixture, renamed, renamed_key, tag  # noqa: E402

from cachemgr import layout  # noqa: E402
from cachemgr.evict import Limits, evict  # noqa: E402
from cachemgr.index.db import Database  # noqa: E402
from cachemgr.index.models import Entry, EntryRef  # noqa: E402
from cachemgr.index.scan import reconcile  # noqa: E402


def build(work: Path, files: int, fixture: Path | None) -> tuple[Path, Database, int, int]:
    src = extract_fixture(work / "fixture", fixture)
    template = Database(f"sqlite:///{work / 'template.db'}")
    tcid = template.cache_id("bench", str(src))
    reconcile(template, tcid, str(src))
    fixture_files = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file() and not p.is_symlink()]
    copies = max(1, round(files / len(fixture_files)))

    root = work / "cache"
    for c in range(copies):
        for rel in fixture_files:
            m = os.lstat(src / rel).st_mtime
            for base in (root, work / "twin"):  # written twice: copying one would read it (atime)
                dst = base / renamed(rel, c)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / rel, dst)
                os.utime(dst, (m, m))  # as old as the fixture: past the grace period

    e, r = Entry.__table__, EntryRef.__table__
    with template.engine.connect() as conn:
        rows = [dict(m._mapping) for m in conn.execute(select(e).where(e.c.cache_id == tcid))]
        refs = [tuple(x) for x in conn.execute(select(r.c.entry_id, r.c.kind, r.c.ref))]
    db = Database(f"sqlite:///{work / 'index.db'}")
    cid = db.cache_id("bench", str(root))
    with db.engine.begin() as conn:
        for c in range(copies):
            new_rows = []
            for row in rows:
                row = dict(row)
                row.pop("id")
                row.update(cache_id=cid, key=renamed_key(row["key"], row["kind"], c), ref=row["ref"] and tag(row["ref"], c),
                           alias=row["alias"] and tag(row["alias"], c),
                           graph_key=row["graph_key"] and tag(row["graph_key"], c), last_access=row["mtime"])
                new_rows.append(row)
            conn.execute(insert(e), new_rows)
        ids = {k: i for i, k in conn.execute(select(e.c.id, e.c.key).where(e.c.cache_id == cid))}
        key_of = {row["id"]: row for row in rows}
        conn.execute(insert(r), [
            {"entry_id": ids[renamed_key(key_of[eid]["key"], key_of[eid]["kind"], c)], "kind": kind, "ref": tag(ref, c)}
            for c in range(copies) for eid, kind, ref in refs
        ])
    check = reconcile(db, cid, str(root))
    assert not (check.added or check.changed or check.removed), check.as_dict()
    return root, db, cid, copies * len(fixture_files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="10,000 files")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--fixture", default=None, help="the fixture .tgz (default: tests/fixtures/gpu/inductor-cache-h200-torch2.11.tgz)")
    args = ap.parse_args()
    files = 10_000 if args.quick else args.files
    work = Path(tempfile.mkdtemp(prefix="bench-evict-", dir=args.dir))
    try:
        t = time.perf_counter()
        root, db, cid, n = build(work, files, Path(args.fixture) if args.fixture else None)
        twin = work / "twin"
        print(f"built {n} files ({sum(1 for _ in layout.walk(str(root)))} entries) x2 in {time.perf_counter() - t:.1f} s")

        os.sync()
        t = time.perf_counter()
        res = evict(db, cid, str(root), Limits(max_files=n // 2, low_water=1.0, grace=60))
        ours = time.perf_counter() - t
        assert res.skipped == (), res.skipped[:5]

        paths = [str(twin / k) for k, kind, _ in res.entries for k in _entry_paths(twin, k, kind)]
        listing = work / "paths"
        listing.write_bytes(b"\0".join(p.encode() for p in paths) + b"\0")
        os.sync()
        t = time.perf_counter()
        subprocess.run(["xargs", "-0", "-a", str(listing), "sh", "-c", 'find "$@" -delete', "sh"], check=True)
        theirs = time.perf_counter() - t

        left_ours = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        left_theirs = sorted(p.relative_to(twin).as_posix() for p in twin.rglob("*") if p.is_file())
        assert left_ours == left_theirs, "both runs must leave the same files"
        print(f"evicted {res.evicted} entries, {res.freed_files} files, {res.freed_bytes / 1e6:.0f} MB "
              f"({res.recreatable_freed_bytes / 1e6:.0f} MB recreatable); {len(left_ours)} files left")
        print(f"cachemgr evict (plan + trash + index + unlink): {ours:.2f} s")
        print(f"find -delete over the same paths:               {theirs:.2f} s")
        print(f"ratio: {ours / theirs:.2f}x (target <= 2x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
