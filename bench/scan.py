"""Benchmark: scan a 100,000-file cache against `find` over the same tree, in one run.

Prints, as ratios to `find ROOT -type f -printf '%s\\n'`: the first `cachemgr scan`, a rescan with
nothing changed (directory mtimes: no directory is read), the same with `--full` (every file
stat'ed), and `cachemgr stats --json`; and the peak RSS of each cachemgr process. Floors for comparison:
`python -c pass`, and a bare os.scandir walk (with and without a bulk SQLite insert per file).
Targets (issue 2): first scan <= 2x find, rescan <= 1.2x, stats < 0.2 s, peak RSS < 150 MB.

    python bench/scan.py [--files 100000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synth import REPO, build_tree  # noqa: E402


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    elapsed = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return elapsed, ru.ru_maxrss * 1024, out.decode()


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


def best_of(n: int, cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    runs = [timed(cmd, env) for _ in range(n)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--keep", help="build the tree here and keep it")
    args = ap.parse_args()

    base = Path(args.keep or tempfile.mkdtemp(prefix="cachemgr-bench-"))
    root = base / "cache"
    if not root.exists():
        t = time.perf_counter()
        n = build_tree(root, args.files)
        print(f"built {n} files under {root} in {time.perf_counter() - t:.1f} s")
    db = base / "index.db"
    for suffix in ("", "-wal", "-shm"):
        Path(str(db) + suffix).unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cm = [sys.executable, "-m", "cachemgr", "--cache-dir", str(root), "--db", f"sqlite:///{db}"]
    find = ["find", str(root), "-type", "f", "-printf", "%s\\n"]

    timed(find, env)  # warm the dentry and inode caches for both sides alike
    t_find, _, out = best_of(3, find, env)
    find_bytes = sum(int(x) for x in out.split())
    t_scan, rss_scan, out = timed([*cm, "scan", "--json"], env)
    first = json.loads(out)
    t_rescan, rss_rescan, out = best_of(3, [*cm, "scan", "--json"], env)
    again = json.loads(out)
    t_full, rss_full, out = best_of(3, [*cm, "scan", "--full", "--json"], env)
    full = json.loads(out)
    t_stats, rss_stats, out = best_of(5, [*cm, "stats", "--json"], env)
    stats = json.loads(out)
    t_python, _, _ = best_of(5, [sys.executable, "-c", "pass"], env)
    t_walk, _, _ = best_of(3, [sys.executable, "-c", BARE_WALK, str(root)], env)
    t_walk_db, _, _ = best_of(3, [sys.executable, "-c", BARE_WALK, str(root), str(base / "bare.db")], env)

    assert stats["bytes"] == find_bytes, (stats["bytes"], find_bytes)
    assert again["added"] == again["changed"] == again["removed"] == 0
    assert full["added"] == full["changed"] == full["removed"] == 0
    mb = 1 << 20
    print(f"tree: {stats['files']} files, {stats['entries']} entries, {find_bytes / mb:.0f} MiB "
          f"({stats['by_kind']['fxgraph']['files']} fxgraph files); index bytes == find bytes")
    print(f"{'measure':28} {'seconds':>8} {'x find':>7} {'peak RSS':>9}  target")
    print(f"{'find -type f -printf %s':28} {t_find:8.3f} {1:7.2f} {'':>9}")
    print(f"{'cachemgr scan (first)':28} {t_scan:8.3f} {t_scan / t_find:7.2f} {rss_scan / mb:7.0f}MB  <= 2x, < 150 MB"
          f"  ({first['added']} entries added)")
    print(f"{'cachemgr scan (unchanged)':28} {t_rescan:8.3f} {t_rescan / t_find:7.2f} {rss_rescan / mb:7.0f}MB  <= 1.2x")
    print(f"{'cachemgr scan --full (unch.)':28} {t_full:8.3f} {t_full / t_find:7.2f} {rss_full / mb:7.0f}MB  "
          "(stats every file)")
    print(f"{'cachemgr stats --json':28} {t_stats:8.3f} {t_stats / t_find:7.2f} {rss_stats / mb:7.0f}MB  < 0.2 s")
    print(f"{'python -c pass (floor)':28} {t_python:8.3f} {t_python / t_find:7.2f}")
    print(f"{'bare scandir walk (floor)':28} {t_walk:8.3f} {t_walk / t_find:7.2f}")
    print(f"{'  + sqlite insert per file':28} {t_walk_db:8.3f} {t_walk_db / t_find:7.2f}")


if __name__ == "__main__":
    main()
