"""Benchmark: peak memory of `cachemgr scan` and the daemon over a hostile tree.

The tree is the repository's H200 cache plus every hostile entry the tests plant
(tests/hostile.py): a 9-byte pickle asking for a 4 GB memo, 200,000 distinct class names, a
regex-quadratic source, a sparse 3 GiB entry file, a C++ source that is a symlink to /dev/zero
and one that is a FIFO, names that are not UTF-8 or hold control characters. Prints the peak
RSS (VmHWM) of the cachemgr process and of its parse workers, against the bounds cachemgr
states: the command under 150 MB, a parse worker under its start-up size + WORKER_MEMORY.

    python bench/hostile.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import hostile
from synth import REPO, extract_fixture

MB = 1 << 20


def env() -> dict[str, str]:
    """The environment with the repository first on the path (dependencies may live anywhere)."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def plant(root: Path) -> None:
    folder = next(root.glob("??/c*.py")).parent
    entries = {
        "memo": hostile.memo_bomb(),
        "classes": hostile.many_classes(),
        "regex": hostile.fake_entry(hostile.fxgraph_state("f" + "r" * 51, source_code=hostile.slow_source())),
        "deep": b"\x80\x02" + b"(" * 100_000 + b"l" * 100_000 + b".",
    }
    for i, (name, data) in enumerate(entries.items()):
        d = root / "fxgraph" / "zz" / ("f" + "z" * 50 + "abcd"[i])
        d.mkdir(parents=True, exist_ok=True)
        (d / (name[0] * 51)).write_bytes(data)
    with open(root / "fxgraph" / "zz" / ("f" + "z" * 50 + "a") / ("s" * 51), "wb") as f:
        f.truncate(3 << 30)  # sparse: no blocks
    (folder / ("c" + "z" * 51 + ".main.cpp")).symlink_to("/dev/zero")
    (folder / ("c" + "z" * 51 + ".py")).write_text("pass\n")
    os.mkfifo(folder / ("c" + "y" * 51 + ".main.cpp"))
    (folder / ("c" + "y" * 51 + ".py")).write_text("pass\n")
    with open(os.fsencode(str(folder)) + b"/c\xff\xfe" + b"k" * 40 + b".py", "wb") as f:
        f.write(b"pass\n")


def hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def workers_of(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"cachemgr.index.workers" in cmd:
            out.append(int(name))
    return out


def watch(proc: subprocess.Popen, until) -> tuple[int, int]:  # until: a callable
    """Sample (peak RSS of the process, peak RSS of any of its parse workers) until `until()`."""
    own = worker = 0
    while not until():
        own = max(own, hwm(proc.pid))
        for w in workers_of(proc.pid):
            worker = max(worker, hwm(w))
        time.sleep(0.01)
    return own, worker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="build the tree here and keep it")
    args = ap.parse_args()
    from cachemgr.index.workers import WORKER_MEMORY

    work = Path(args.keep or tempfile.mkdtemp(prefix="cachemgr-hostile-"))
    work.mkdir(parents=True, exist_ok=True)
    root = extract_fixture(work / "src")
    plant(root)
    (work / "state").mkdir(exist_ok=True)
    base = [sys.executable, "-m", "cachemgr", "--cache-dir", str(root), "--db", f"sqlite:///{work}/state/index.db"]
    try:
        scan = subprocess.Popen([*base, "scan", "--json"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        own, worker = watch(scan, lambda: scan.poll() is not None)
        out, err = scan.communicate()
        if scan.returncode != 0:
            raise SystemExit(f"scan failed: {err.decode()[-2000:]}")
        import json

        corrupt = len(json.loads(out)["corrupt"])
        print(
            f"scan: exit 0, {corrupt} corrupt entries reported; peak RSS {own / MB:.1f} MiB (bound 150 MiB), "
            f"parse worker peak {worker / MB:.1f} MiB (bound: its start-up size + {WORKER_MEMORY // MB} MiB)"
        )
        os.unlink(f"{work}/state/index.db")
        daemon = subprocess.Popen(
            [*base, "daemon"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        started = time.monotonic()
        lines: list[str] = []

        def settled() -> bool:  # READY, then the background parse has had time to read every entry
            return time.monotonic() - started > 20 or daemon.poll() is not None

        own, worker = watch(daemon, settled)
        daemon.send_signal(signal.SIGTERM)
        rest, _ = daemon.communicate(timeout=30)
        lines = rest.splitlines()
        ok = daemon.returncode == 0 and any("ready:" in x for x in lines)
        print(
            f"daemon: {'ready and stopped cleanly' if ok else 'FAILED'}; peak RSS {own / MB:.1f} MiB "
            f"(bound 150 MiB; the unit caps it at 512M), parse worker peak {worker / MB:.1f} MiB"
        )
        if not ok:
            print("\n".join(lines[-20:]))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
