"""Benchmark the daemon over a large real cache: idle CPU, RSS, and index lag under a burst.

The cache is built from the shared H200 fixture's real entries (fxgraph, aotautograd, Triton
kernels, code, autotune), replicated under new keys with hard links until it holds --files
files. Then, with the daemon running as a real process:

  * idle CPU over --idle seconds (utime+stime from /proc) and RSS (VmRSS, peak VmHWM);
  * a burst of --burst new entries written as Inductor writes them (temp file or temp
    directory, then rename), and for each the lag until its row is visible in the index.

Baseline, measured in the same run: `cachemgr scan` of the same cache without the daemon, cold
(every entry parsed) and warm (nothing changed: stat only), which is what keeping an index
current by periodic scans costs per refresh.

    python bench/daemon.py                 # 100,000 files, 60 s idle, 1,000-entry burst
    python bench/daemon.py --files 1000000 --idle 10 --keep .bench/s1m   # a tree bench/scan.py built
    python bench/daemon.py --quick         # 10,000 files, 10 s idle, 200-entry burst
Targets: idle CPU < 1 %, peak RSS < 150 MB at 1,000,000 files, lag p99 < 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from synth import build_tree, child_env, extract_fixture, renamed

from cachemgr import layout

HOST = "bench"


def load_entries(dst: Path) -> tuple[Path, dict[str, list[str]]]:
    """Extract the fixture; its entries as {entry key: [relative file paths]} (no locks/transients)."""
    root = extract_fixture(dst)
    entries: dict[str, list[str]] = defaultdict(list)
    for e in layout.walk(str(root)):
        if e.kind != "lock":
            entries[e.key] = e.paths
    return root, dict(entries)


def write_entry(src: Path, dst: Path, paths: list[str], i: int) -> str:
    """Write one new entry as Inductor does (temp name, then rename); return its new entry key."""
    c = layout.classify(paths[0])
    new_key = layout.classify(renamed(paths[0], i)).key
    if c.kind == "triton":  # Triton: tmp.pid_<pid>_<uuid>/ then os.replace to the kernel dir
        final = dst / new_key
        tmp = final.parent / f"tmp.pid_{os.getpid()}_{uuid.uuid4().hex}"  # unique per write, as Triton's
        tmp.mkdir(parents=True, exist_ok=True)
        for p in paths:
            shutil.copyfile(src / p, tmp / Path(p).name)
        os.replace(tmp, final)
        return new_key
    for p in paths:  # write_atomic: .<pid>.<tid>.tmp beside the target, then rename
        out = dst / renamed(p, i)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{os.getpid()}.{i}.tmp"
        shutil.copyfile(src / p, tmp)
        os.replace(tmp, out)
    return new_key


def cachemgr(cache: Path, db: str, *args: str, **kw) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", "--cache-dir", str(cache), "--db", db, "--host", HOST, *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        **kw,
    )


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_mem(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--idle", type=float, default=60.0, help="seconds of idle measurement")
    ap.add_argument("--burst", type=int, default=1000, help="new entries written in one burst")
    ap.add_argument("--quick", action="store_true", help="10,000 files, 10 s idle, 200-entry burst")
    ap.add_argument(
        "--keep",
        help="build the cache tree in DIR/cache, or use the one there (bench/scan.py's), "
        "and keep it (the burst's entries stay in it)",
    )
    a = ap.parse_args()
    if a.quick:
        a.files, a.idle, a.burst = 10_000, 10.0, 200
    work = Path(tempfile.mkdtemp(prefix="cachemgr-bench-"))
    try:
        run(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a, work: Path) -> None:
    src, entries = load_entries(work / "fixture")
    cache = Path(a.keep) / "cache" if a.keep else work / "cache"
    t0 = time.monotonic()
    if not cache.exists():
        build_tree(cache, a.files)
    nfiles = len(
        subprocess.run(["find", str(cache), "-type", "f", "-printf", "."], capture_output=True, check=True).stdout
    )
    copies = nfiles // sum(len(p) for p in entries.values()) + 2  # past every copy number the tree uses
    print(
        f"cache: {nfiles:,} files (copies of the fixture's {len(entries)} entries, hard links), "
        f"ready in {time.monotonic() - t0:.1f} s; {os.cpu_count()} cores; "
        f"fs.inotify.max_user_watches {Path('/proc/sys/fs/inotify/max_user_watches').read_text().strip()}",
        flush=True,
    )

    dbfile = work / "index.db"
    db = f"sqlite:///{dbfile}"
    t0 = time.monotonic()
    cachemgr(cache, db, "scan", "--json")
    cold = time.monotonic() - t0
    t0 = time.monotonic()
    cachemgr(cache, db, "scan", "--json")
    warm = time.monotonic() - t0
    print(f"baseline: cachemgr scan cold {cold:.2f} s, warm (no change) {warm:.2f} s")

    sock_path = str(work / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    env = child_env(NOTIFY_SOCKET=sock_path)
    log = open(work / "daemon.log", "w")
    t0 = time.monotonic()
    d = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", "--cache-dir", str(cache), "--db", db, "--host", HOST, "daemon", "-v"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        sock.settimeout(600)
        while b"READY=1" not in sock.recv(4096):
            pass
        startup = time.monotonic() - t0
        print(f"daemon ready in {startup:.2f} s (migrate check, warm full scan, {nfiles} files watched)")

        time.sleep(2)  # let start-up garbage settle
        c0, w0 = proc_cpu(d.pid), time.monotonic()
        time.sleep(a.idle)
        idle_cpu = (proc_cpu(d.pid) - c0) / (time.monotonic() - w0) * 100
        mem = proc_mem(d.pid)
        print(
            f"idle: CPU {idle_cpu:.3f} % over {a.idle:.0f} s (target < 1 %), RSS {mem['VmRSS'] / 2**20:.1f} MiB, "
            f"peak {mem['VmHWM'] / 2**20:.1f} MiB (target < 150 MB)",
            flush=True,
        )

        lag = burst(a, src, entries, cache, dbfile, copies)
        p50, p99, worst = pct(lag, 0.5), pct(lag, 0.99), max(lag)
        mem2 = proc_mem(d.pid)
        print(
            f"burst of {len(lag)} entries: lag p50 {p50:.3f} s, p99 {p99:.3f} s (target < 2 s), max {worst:.3f} s; "
            f"RSS after {mem2['VmRSS'] / 2**20:.1f} MiB, peak {mem2['VmHWM'] / 2**20:.1f} MiB"
        )
        print(
            f"ratios: lag p99 / warm scan {p99 / warm:.2f}x, lag p99 / cold scan {p99 / cold:.3f}x, "
            f"idle CPU / target {idle_cpu / 1:.3f}, peak RSS / target {mem2['VmHWM'] / 150e6:.2f}"
        )

        t0 = time.monotonic()
        d.send_signal(signal.SIGTERM)
        rc = d.wait(30)
        print(f"SIGTERM: exit {rc} in {time.monotonic() - t0:.2f} s")
    finally:
        if d.poll() is None:
            d.kill()
        sock.close()
        log.close()
    lines = (work / "daemon.log").read_text().splitlines()
    notes = [line for line in lines if " ERROR " in line or " WARNING " in line or "burst of" in line]
    if notes:
        print(f"daemon log: {len(notes)} warnings/errors/burst rescans, e.g.", *notes[:5], sep="\n  ")


def burst(a, src: Path, entries: dict[str, list[str]], cache: Path, dbfile: Path, copies: int) -> list[float]:
    """Write a.burst new entries as fast as possible; per entry, seconds until its row is visible."""
    items = list(entries.items())
    written: dict[str, float] = {}
    seen: dict[str, float] = {}
    done = threading.Event()

    def poll() -> None:
        # by key on the (cache_id, key) index: a poll must not cost a table scan of the big index
        conn = sqlite3.connect(f"file:{dbfile}?mode=ro", uri=True, timeout=30)
        (cache_id,) = conn.execute("SELECT id FROM caches WHERE host = ?", (HOST,)).fetchone()
        while True:
            finished = done.is_set()
            now = time.monotonic()
            pending = [k for k in list(written) if k not in seen]
            for i in range(0, len(pending), 500):
                chunk = pending[i : i + 500]
                q = f"SELECT key FROM entries WHERE cache_id = ? AND key IN ({','.join('?' * len(chunk))})"
                for (key,) in conn.execute(q, (cache_id, *chunk)):
                    seen.setdefault(key, now)
            if finished and all(k in seen for k in written) or (finished and now - last[0] > 60):
                break
            time.sleep(0.02)
        conn.close()

    # copy numbers no entry has yet: a tree kept with --keep holds the bursts of earlier runs
    base, span = copies + 1, -(-a.burst // len(items))
    while any(
        (cache / layout.classify(renamed(paths[0], base + n // len(items))).key).exists()
        for n in range(a.burst)
        for paths in (items[n % len(items)][1],)
    ):
        base += span
    last = [time.monotonic()]
    t = threading.Thread(target=poll)
    t.start()
    for n in range(a.burst):
        _, paths = items[n % len(items)]
        new_key = write_entry(src, cache, paths, base + n // len(items))
        written[new_key] = last[0] = time.monotonic()
    done.set()
    t.join()
    missing = [k for k in written if k not in seen]
    if missing:
        print(f"  {len(missing)} entries never became visible, e.g. {missing[:3]}")
    print(f"  burst written in {last[0] - min(written.values()):.2f} s")
    return [seen[k] - w for k, w in written.items() if k in seen]


if __name__ == "__main__":
    main()
