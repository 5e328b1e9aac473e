"""Benchmark: scan a large cache against `find` over the same tree, in one run.

Prints, as ratios to `find ROOT -type f -printf '%s\\n'` measured in the same run (best of 3 after
a warming run; every measure below is the best of as many runs, a first scan's each into a new
index):

  first scan, index usable   `cachemgr scan` until phase one is committed: every file counted,
                             `stats`/`ls` answer (seen from outside: the cache row's last_scan
                             appears in the index, polled every 5 ms)
  first scan, fully parsed   the same process until it exits (every pickle read)
  ... distinct content       the same two, on the same tree after `synth.distinct_names` gave every
                             fxgraph/AOT entry file a name of its own: no parse result is reused
                             (see bench/synth.py: the plain tree holds ~10 distinct pickles)
  unchanged rescan           nothing changed (directory mtimes: no directory is read)
  scan --full, unchanged     every file stat'ed
  stats --json               seconds (target < 0.2 s at 1,000,000 files)

and the peak RSS of each cachemgr process. Floors for comparison: `python -c pass`, and a bare
os.scandir walk (with and without a bulk SQLite insert per file).
Targets (issue 17): index usable <= 1.5x find on a 16-core GPU host, 2x on 2 cores; fully parsed
<= 2x / 4x; unchanged rescan <= 1x; stats < 0.2 s; peak RSS < 150 MB at 1,000,000 files.

    python bench/scan.py [--files 100000] [--keep DIR] [--repeat 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]
from synth import build_tree, child_env, distinct_names, shared_names  # noqa: E402

from cachemgr.layout import RACY_NS  # noqa: E402

MB = 1 << 20


def timed(cmd: list[str], env: dict[str, str], watch: Path | None = None) -> tuple[float, int, str, float | None]:
    """Wall seconds, peak RSS (bytes) and stdout of one child process; with `watch` (an index
    file), also the seconds until a cache row of that index has a last_scan (phase one done)."""
    usable: list[float] = []
    stop = threading.Event()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if watch is not None:
        threading.Thread(target=_poll_last_scan, args=(watch, t0, usable, stop), daemon=True).start()
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    elapsed = time.perf_counter() - t0
    stop.set()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return elapsed, ru.ru_maxrss * 1024, out.decode(), (usable[0] if usable else None)


def _poll_last_scan(db: Path, t0: float, out: list[float], stop: threading.Event) -> None:
    conn = None
    while not stop.is_set():
        try:
            if conn is None and db.exists():
                conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.05)
            if conn is not None and conn.execute("SELECT 1 FROM caches WHERE last_scan IS NOT NULL").fetchone():
                out.append(time.perf_counter() - t0)
                break
        except sqlite3.Error:
            pass
        time.sleep(0.005)
    if conn is not None:
        conn.close()


# The yardstick, run here: a bare os.scandir walk that lstats every file, then the same
# with a bulk SQLite insert of one row per file. No classification, no parsing, no ORM: the
# floor a Python scan stands on, against the same `find`.
BARE_WALK = """
import os, sqlite3, sys
rows, stack = [], [sys.argv[1]]
while stack:
    with os.scandir(stack.pop()) as it:
        for d in it:
            if d.is_dir(follow_symlinks=False):
                stack.append(d.path)
            else:
                st = d.stat(follow_symlinks=False)
                rows.append((d.path, st.st_size, st.st_mtime))
if len(sys.argv) > 2:
    db = sqlite3.connect(sys.argv[2])
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE IF NOT EXISTS f (path TEXT PRIMARY KEY, size INTEGER, mtime REAL)")
    db.execute("DELETE FROM f")
    db.executemany("INSERT INTO f VALUES (?, ?, ?)", rows)
    db.commit()
"""


def best_of(n: int, cmd: list[str], env: dict[str, str]) -> tuple[float, int, str, float | None]:
    runs = [timed(cmd, env) for _ in range(n)]
    return min(runs, key=lambda r: r[0])


def fresh(db: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--keep", help="build the tree here (or use the one there) and keep it")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each repeated measure (best taken)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    base = Path(args.keep or tempfile.mkdtemp(prefix="cachemgr-bench-"))
    root = base / "cache"
    built_at = 0.0  # when this run last changed the tree (a kept one: before)
    if not root.exists():
        t = time.perf_counter()
        n = build_tree(root, args.files)
        built_at = time.time()
        print(f"built {n} files under {root} in {time.perf_counter() - t:.1f} s", flush=True)
    db = base / "index.db"
    env = child_env()
    cm = [sys.executable, "-m", "cachemgr", "--cache-dir", str(root), "--db", f"sqlite:///{db}", "--host", "bench"]
    find = ["find", str(root), "-type", "f", "-printf", "%s\\n"]
    k = args.repeat

    timed(find, env)  # warm the dentry and inode caches for both sides alike
    t_find, _, out, _ = best_of(k, find, env)
    find_bytes = sum(int(x) for x in out.split())
    nfiles = out.count("\n")
    fig: dict[str, dict] = {}

    def first_scan(label: str) -> dict:
        """The best of `k` first scans (each into a new index), as `find` is the best of `k`."""
        runs = []
        for _ in range(k):
            fresh(db)
            t, rss, out, usable = timed([*cm, "scan", "--json"], env, watch=db)
            doc = json.loads(out)
            assert doc["pending"] == 0, doc
            runs.append({"usable": usable, "parsed": t, "rss": rss, "added": doc["added"], "read": doc["parsed"]})
        return {
            **runs[0],
            "usable": min((r["usable"] for r in runs if r["usable"] is not None), default=None),
            "parsed": min(r["parsed"] for r in runs),
            "rss": max(r["rss"] for r in runs),
        }

    # A directory changed less than RACY_NS before a walk is read again by the next one (its mtime
    # may still move unseen): "unchanged rescan" is of a tree that has settled, as a real cache has
    # (a tree built just now would have its first scan's directories all read again).
    settled = max(built_at, *(os.lstat(p).st_mtime for p in (root, *root.iterdir()))) + RACY_NS / 1e9 + 0.1
    time.sleep(max(0.0, settled - time.time()))
    fig["first"] = first_scan("shared")
    t, rss, out, _ = best_of(k, [*cm, "scan", "--json"], env)
    again = json.loads(out)
    fig["rescan"] = {"seconds": t, "rss": rss}
    t, rss, out, _ = best_of(k, [*cm, "scan", "--full", "--json"], env)
    full = json.loads(out)
    fig["full"] = {"seconds": t, "rss": rss}
    t, rss, out, _ = best_of(max(k, 5), [*cm, "stats", "--json"], env)
    stats = json.loads(out)
    fig["stats"] = {"seconds": t, "rss": rss}
    renames = distinct_names(root)
    try:
        fig["distinct"] = first_scan("distinct")
    finally:
        shared_names(renames)
    fresh(db)
    fig["python"] = {"seconds": best_of(5, [sys.executable, "-c", "pass"], env)[0]}
    fig["walk"] = {"seconds": best_of(k, [sys.executable, "-c", BARE_WALK, str(root)], env)[0]}
    bare = base / "bare.db"
    fig["walk_db"] = {"seconds": best_of(k, [sys.executable, "-c", BARE_WALK, str(root), str(bare)], env)[0]}
    fresh(bare)

    assert stats["bytes"] == find_bytes, (stats["bytes"], find_bytes)
    assert stats["files"] == nfiles, (stats["files"], nfiles)
    assert again["added"] == again["changed"] == again["removed"] == 0
    assert full["added"] == full["changed"] == full["removed"] == 0
    print(
        f"tree: {stats['files']:,} files, {stats['entries']:,} entries, {find_bytes / MB:,.0f} MiB "
        f"({stats['by_kind']['fxgraph']['files']:,} fxgraph files); index bytes == find bytes; "
        f"{os.cpu_count()} cores"
    )
    print(f"{'measure':40} {'seconds':>8} {'x find':>7} {'peak RSS':>9}  target (16 cores / 2 cores)")

    def line(name: str, s: float | None, rss: int | None = None, note: str = "") -> None:
        shown = f"{s:8.3f} {s / t_find:7.2f}" if s is not None else f"{'-':>8} {'-':>7}"
        mem = f"{rss / MB:7.0f}MB" if rss else f"{'':>9}"
        print(f"{name:40} {shown} {mem}  {note}")

    line("find -type f -printf %s", t_find)
    for key, what in (("first", "shared content"), ("distinct", "distinct content")):
        f = fig[key]
        line(f"first scan, index usable ({what})", f["usable"], None, "<= 1.5x / 2x")
        line(
            f"first scan, fully parsed ({what})",
            f["parsed"],
            f["rss"],
            f"<= 2x / 4x, < 150 MB  ({f['added']:,} entries, {f['read']:,} read)",
        )
    line("unchanged rescan", fig["rescan"]["seconds"], fig["rescan"]["rss"], "<= 1x")
    line("scan --full, unchanged", fig["full"]["seconds"], fig["full"]["rss"], "(stats every file)")
    line("stats --json", fig["stats"]["seconds"], fig["stats"]["rss"], "< 0.2 s")
    line("python -c pass (floor)", fig["python"]["seconds"])
    line("bare scandir walk (floor)", fig["walk"]["seconds"])
    line("  + sqlite insert per file", fig["walk_db"]["seconds"])
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "files": nfiles,
                    "bytes": find_bytes,
                    "entries": stats["entries"],
                    "cores": os.cpu_count(),
                    "find": t_find,
                    **fig,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
