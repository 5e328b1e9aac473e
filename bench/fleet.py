"""Index a 100,000-entry cache into PostgreSQL and into SQLite in the same run; print the ratio.

The tree is the shared H200 fixture (real fxgraph/AOT pickles, Triton kernel dirs, modules,
autotune results) replicated under new keys with hard links, so it costs directory entries,
not disk. Both backends index the same tree with the same code (cachemgr.index.scan.reconcile);
the walk and the entry parsing are timed on their own too, so the database's share is visible.
Target: PostgreSQL within 2x of SQLite.

    python bench/fleet.py                 # 100,000 entries
    python bench/fleet.py --quick         # 5,000 entries, a smoke run
    python bench/fleet.py --entries 20000 --pg root@127.0.0.1:5432
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from synth import extract_fixture, fixture_path, renamed

from cachemgr import layout
from cachemgr.index.db import Database
from cachemgr.index.describe import describe_all
from cachemgr.index.scan import reconcile


def build_tree(src: Path, dst: Path, entries: int) -> int:
    fixture = [e for e in layout.walk(str(src)) if e.kind in ("fxgraph", "aotautograd", "triton", "code", "autotune")]
    made, files, copy = 0, 0, 0
    while made < entries:
        for e in fixture:
            if made >= entries:
                break
            for s in e.paths:
                target = dst / renamed(s, copy)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(src / s, target)
                files += 1
            made += 1
        copy += 1
    return files


def parse_only(root: str) -> tuple[float, int]:
    """What both backends pay before any SQL: the walk and reading every new entry."""
    t0 = time.perf_counter()
    disk = list(layout.walk(root))
    describe_all(root, disk)
    return time.perf_counter() - t0, len(disk)


def index_into(url: str, root: str) -> dict:
    db = Database(url)
    try:
        cid = db.cache_id("bench", root)
        t0 = time.perf_counter()
        first = reconcile(db, cid, root)
        scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = reconcile(db, cid, root)
        rescan = time.perf_counter() - t0
        from sqlalchemy import text

        from cachemgr.fleet.report import fleet_report, fleet_stats

        with db.engine.connect() as conn:
            t0 = time.perf_counter()
            fleet_report(conn)
            report = time.perf_counter() - t0
            t0 = time.perf_counter()
            fleet_stats(conn, 86400)
            fstats = time.perf_counter() - t0
            n, size = conn.execute(
                text("SELECT COUNT(*), SUM(bytes) FROM entries WHERE cache_id = :c"), {"c": cid}
            ).one()
            rows = sum(
                conn.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar() for t in ("entry_refs", "entry_components")
            )
        assert len(first.added) == n and again.unchanged == n and not again.added, (len(first.added), n)
        return {
            "scan": scan,
            "rescan": rescan,
            "report": report,
            "fstats": fstats,
            "entries": int(n),
            "bytes": int(size),
            "side_rows": int(rows),
        }
    finally:
        db.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--quick", action="store_true", help="5,000 entries: a smoke run")
    ap.add_argument(
        "--pg",
        default=os.environ.get("CACHEMGR_BENCH_PG", "root@127.0.0.1:5432"),
        help="PostgreSQL server (user@host:port); a throwaway database is created there",
    )
    ap.add_argument("--workdir", default=None, help="where to build the tree (default: a temp dir)")
    args = ap.parse_args()
    n = 5000 if args.quick else args.entries
    fixture_path()  # exits with a message when the shared fixture is missing
    import psycopg

    work = Path(tempfile.mkdtemp(prefix="cachemgr-bench-fleet-", dir=args.workdir))
    dbname = f"cachemgr_bench_{uuid.uuid4().hex[:8]}"
    admin = f"postgresql://{args.pg}/test"
    try:
        src = extract_fixture(work / "src")
        root = work / "cache"
        t0 = time.perf_counter()
        files = build_tree(src, root, n)
        print(
            f"tree: {n} entries, {files} files (hard links to the fixture), built in {time.perf_counter() - t0:.1f} s"
        )
        base, walked = parse_only(str(root))
        assert walked == n, walked
        print(f"walk + parse alone: {base:.2f} s")
        sqlite = index_into(f"sqlite:///{work / 'index.db'}", str(root))
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{dbname}"')
        pg = index_into(f"postgresql+psycopg://{args.pg}/{dbname}", str(root))
        assert (pg["entries"], pg["bytes"], pg["side_rows"]) == (
            sqlite["entries"],
            sqlite["bytes"],
            sqlite["side_rows"],
        )
        print(f"\n{'':24}{'SQLite':>10}{'PostgreSQL':>12}{'ratio':>8}")
        for what, key in (
            ("first scan (s)", "scan"),
            ("rescan, unchanged (s)", "rescan"),
            ("fleet report (s)", "report"),
            ("stats --fleet (s)", "fstats"),
        ):
            print(f"{what:24}{sqlite[key]:10.2f}{pg[key]:12.2f}{pg[key] / sqlite[key]:8.2f}")
        db_sqlite, db_pg = max(sqlite["scan"] - base, 1e-9), max(pg["scan"] - base, 1e-9)
        print(f"{'database share (s)':24}{db_sqlite:10.2f}{db_pg:12.2f}{db_pg / db_sqlite:8.2f}")
        print(
            f"\n{n} entries, {sqlite['side_rows']} ref/component rows, "
            f"{sqlite['bytes'] / 2**20:.0f} MiB indexed in each"
        )
        ratio = pg["scan"] / sqlite["scan"]
        print(f"PostgreSQL / SQLite, first scan: {ratio:.2f}x (target <= 2x: {'met' if ratio <= 2 else 'NOT met'})")
    finally:
        try:
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        except psycopg.Error as e:
            print(f"could not drop {dbname}: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
