"""Read new and changed entries into index row values: the CPU-heavy half of a scan.

Kept free of SQLAlchemy so that, for a large first scan, worker processes can parse pickles in
parallel and start in milliseconds. Hash components come back already split into parts with
their digests; each worker sends the items of a part only the first time it meets its digest,
since hundreds of graphs share one options part.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from cachemgr import layout, parse

PICKLED = ("fxgraph", "aotautograd")  # the kinds whose parsing costs: pickles of up to megabytes each
PARALLEL_MIN_BYTES = 64 << 20  # below this much pickle to read, worker start-up costs more than it saves

Parts = dict[str, tuple[str, list[parse.Component] | None]]  # part -> (digest, items or None if sent before)


@dataclass(slots=True)
class Described:
    row: dict
    refs: list[tuple[str, str]]
    parts: Parts


def read_noatime(path: str) -> bytes:
    """Read a file without moving its atime where the kernel allows: our reads are not hits."""
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:  # O_NOATIME needs ownership
        fd = os.open(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def read_unseen(root: str, rel: str) -> bytes:
    """Read a cache file as no workload does: through a hard link in cachemgr's trash folder, so
    the daemon's read watch on the file's own directory sees no open and counts no hit (for
    `remote push`, which reads every entry it publishes). A plain read where no link can be made."""
    path = os.path.join(root, rel)
    trash = os.path.join(root, layout.TRASH_DIR)
    link = os.path.join(trash, f"read-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(trash, exist_ok=True)
        os.link(path, link, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError:  # another file system, no write access, protected_hardlinks
        return read_noatime(path)
    try:
        return read_noatime(link)
    except FileNotFoundError:  # an eviction emptied the trash under us
        return read_noatime(path)
    finally:
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass


def describe(root: str, d: layout.DiskEntry, sent: set[str]) -> Described:
    """Row values, references and hash components of one entry, read from its files."""
    row: dict = {"alias": None}
    p: parse.Parsed | None = None
    refs: list[tuple[str, str]] = []
    try:
        if d.kind == "fxgraph":
            p = parse.parse_fxgraph(read_noatime(os.path.join(root, d.key)), graph_key=d.ref)
        elif d.kind == "aotautograd":
            p = parse.parse_aotautograd(read_noatime(os.path.join(root, d.key)))
        elif d.kind == "autotune":
            refs = parse.autotune_refs(read_noatime(os.path.join(root, d.key)))
        elif d.kind == "code":
            try:  # the C++ source of a kernel module names the kernel's own hash
                source = read_noatime(os.path.join(root, d.key + ".main.cpp")).decode("utf-8", "replace")
                row["alias"] = parse.cpp_source_ref(source)
            except FileNotFoundError:
                pass
    except OSError as e:
        row["corrupt"] = f"unreadable: {e.strerror}"
    parts: Parts = {}
    if p is not None:
        refs = p.refs
        row.update(
            graph_key=p.graph_key if d.kind == "fxgraph" else None, signature=p.signature,
            signature_hash=p.signature_hash, options_hash=p.options_hash, guards=p.guards,
            device_types=p.device_types, compile_seconds=p.compile_seconds, torch_version=p.torch_version,
            torch_version_hash=p.torch_version_hash, system_hash=p.system_hash, corrupt=p.corrupt,
        )
        for part, (digest, items) in parse.part_digests(p.components).items():
            parts[part] = (digest, None if digest in sent else items)
            sent.add(digest)
    return Described(row, refs, parts)


_worker_sent: set[str] = set()


def _worker(root: str, chunk: list[layout.DiskEntry]) -> list[tuple[str, Described]]:
    return [(d.key, describe(root, d, _worker_sent)) for d in chunk]


def describe_all(root: str, entries: list[layout.DiskEntry],
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Described]:
    """Describe every entry. When there is a lot of pickle to read, fxgraph and AOTAutograd entries
    are parsed by one worker process per core while this process describes the rest: only the
    pickles cross the process boundary, not the many small entries. If the workers cannot run
    (a caller's unguarded `__main__` re-runs in each spawned worker and kills it), the rest are
    parsed here: a broken pool fails once instead of respawning workers forever."""
    heavy = [d for d in entries if d.kind in PICKLED]
    workers = min(os.cpu_count() or 1, 8)
    out: dict[str, Described] = {}
    sent: set[str] = set()

    def done(key: str, described: Described) -> None:
        out[key] = described
        if progress:
            progress(len(out), len(entries))

    if workers < 2 or sum(d.bytes for d in heavy) < PARALLEL_MIN_BYTES:
        for d in entries:
            done(d.key, describe(root, d, sent))
        return out
    # spawn, not fork: the daemon has threads (observer, scheduler) a fork would copy mid-lock
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(_worker, root, heavy[i : i + 4]) for i in range(0, len(heavy), 4)]
        for d in entries:
            if d.kind not in PICKLED:
                done(d.key, describe(root, d, sent))
        try:
            for f in as_completed(futures):
                for key, described in f.result():
                    done(key, described)
        except BrokenProcessPool:
            for d in heavy:
                if d.key not in out:
                    done(d.key, describe(root, d, sent))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out
