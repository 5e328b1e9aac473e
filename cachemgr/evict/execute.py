"""Carry out a Plan: the only code in cachemgr that deletes files.

Nothing is deleted under a directory that does not look like an Inductor cache (`/`, a home
directory named by mistake: eviction takes unreferenced files as orphans). Per unit: find its
files on disk now, refuse any path that leaves the root (symlinks included: a symlink is never
followed and never deleted), keep the unit whole if any file of it (or of an entry that bundles
it) was written or read within the grace period, or if a lock that guards it is held. Then
rename its files into `<root>/.cachemgr-trash/<run>/` (same file system, so the rename is atomic
and the file leaves Inductor's view at once), delete its index rows and record 'evict' events in
one transaction, and only then unlink the trash.

A kill -9 at any point leaves a state the next scan repairs: before the commit the rows point at
files that are no longer where the index says (scan drops them: the trash is a dotdir, never
walked); after it the trash holds files no row names; every run first empties the trash of runs
that died. A failed commit renames the unit back.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from sqlalchemy import func, insert, select, update

from cachemgr import layout
from cachemgr.errors import UnsafePath
from cachemgr.evict.policy import Plan, Unit
from cachemgr.index.db import Database
from cachemgr.index.models import Cache, Entry, Event
from cachemgr.index.scan import delete_entries

ENTRIES, EVENTS, CACHES = Entry.__table__, Event.__table__, Cache.__table__
BATCH = 500  # units per transaction
UNLINK_THREADS = 4
Hook = Callable[[str], None]  # crash-test hook: called with 'renamed' / 'committed' per batch


def refuse_foreign_root(root: str, refusing: str = "delete anything under it") -> None:
    """Raise UnsafePath unless `root` looks like an Inductor cache directory (layout.foreign_root)."""
    reason = layout.foreign_root(root)
    if reason:
        raise UnsafePath(f"{reason}: refusing to {refusing}")


@dataclass(frozen=True)
class Removed:
    key: str
    kind: str
    bytes: int
    recreatable: bool


@dataclass(frozen=True)
class Outcome:
    removed: tuple[Removed, ...]
    skipped: tuple[tuple[str, str], ...]
    freed_bytes: int
    freed_files: int


def lock_is_held(path: str) -> bool:
    """Is a filelock (flock-based, as Inductor's torch.utils._filelock) held on `path` now?"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: treat it as held
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # EWOULDBLOCK: someone holds it (any other failure: cannot tell, keep it)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


@dataclass
class _Files:
    """One entry's files as they are now: (relative path, lstat) pairs, or a reason to keep it."""

    paths: list[tuple[str, os.stat_result]] = field(default_factory=list)
    move: list[str] = field(default_factory=list)  # what to rename: files, or a triton dir whole
    problem: str | None = None

    @property
    def newest(self) -> float:
        return max((max(st.st_atime, st.st_mtime) for _, st in self.paths), default=0.0)


class Executor:
    def __init__(self, db: Database, cache_id: int, root: str, grace: float, now: float | None = None,
                 hook: Hook | None = None) -> None:
        refuse_foreign_root(root)
        self.db, self.cache_id, self.grace, self.hook = db, cache_id, grace, hook
        self.root = os.path.realpath(root)
        self.now = time.time() if now is None else now
        self.safe_dirs: dict[str, bool] = {}
        self.listings: dict[str, list[str]] = {}
        self.locks = self._lock_names()

    # -- safety checks ------------------------------------------------------------------------

    def _dir_ok(self, rel_dir: str) -> bool:
        """A directory under the root reached without any symlink."""
        ok = self.safe_dirs.get(rel_dir)
        if ok is None:
            full = os.path.join(self.root, rel_dir) if rel_dir else self.root
            ok = os.path.realpath(full) == os.path.normpath(full) and (
                not rel_dir or os.path.normpath(full).startswith(self.root + os.sep))
            self.safe_dirs[rel_dir] = ok
        return ok

    def _inside(self, rel: str) -> bool:
        norm = os.path.normpath(os.path.join(self.root, rel))
        return norm.startswith(self.root + os.sep) and not os.path.isabs(rel) and ".." not in rel.split("/")

    def _lock_names(self) -> set[str]:
        try:
            return {n for n in os.listdir(os.path.join(self.root, layout.LOCKS_DIR)) if n.endswith(".lock")}
        except OSError:
            return set()

    def _guarding_locks(self, kind: str, key: str, ref: str | None) -> list[str]:
        out = []
        if kind == "lock":
            out.append(key)
        elif ref and (ref + ".lock") in self.locks:
            out.append(f"{layout.LOCKS_DIR}/{ref}.lock")
        elif kind == "code" and ref:
            out.append(f"{layout.LOCKS_DIR}/{ref}.lock")  # a build may have just made it
        if kind == "triton":
            out.append(key + ".lock")  # Triton's bundler locks <kernel dir>.lock
        return out

    def files_of(self, kind: str, key: str) -> _Files:
        f = _Files()
        if not self._inside(key):
            f.problem = "unsafe path"
            return f
        parent = key.rsplit("/", 1)[0] if "/" in key else ""
        if not self._dir_ok(parent):
            f.problem = "unsafe path"
            return f
        full = os.path.join(self.root, key)
        if kind == "triton":
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                return f
            if not stat.S_ISDIR(st.st_mode):
                f.problem = "unsafe path"
                return f
            try:
                with os.scandir(full) as it:
                    for d in it:
                        s = d.stat(follow_symlinks=False)
                        if not stat.S_ISREG(s.st_mode) or layout.is_transient(d.name):
                            f.problem = "unsafe path" if stat.S_ISLNK(s.st_mode) else "in use"
                            return f
                        f.paths.append((f"{key}/{d.name}", s))
            except OSError:
                f.problem = "unreadable"
                return f
            f.move = [key]
            return f
        if kind == "code":
            folder, stem = key.split("/", 1)
            names = self.listings.get(folder)
            if names is None:
                try:
                    names = self.listings[folder] = os.listdir(os.path.join(self.root, folder))
                except OSError:
                    names = self.listings[folder] = []
            rels = [f"{folder}/{n}" for n in names if n.startswith(stem + ".") and not layout.is_transient(n)]
        else:
            rels = [key]
        for rel in rels:
            try:
                st = os.lstat(os.path.join(self.root, rel))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):  # a symlink stays, and so does what it points at
                f.paths.append((rel, st))
        f.move = [p for p, _ in f.paths]
        return f

    # -- carrying out -------------------------------------------------------------------------

    def run(self, plan: Plan, rows_by_id: dict, dry_run: bool = False) -> Outcome:
        removed: list[Removed] = []
        skipped: dict[str, str] = {}
        freed = nfiles = 0
        trash = None if dry_run else self._open_trash()
        # unlinking is the file system's slow part (freeing blocks, journal): a few at once
        unlinker = None if dry_run else ThreadPoolExecutor(max_workers=UNLINK_THREADS)
        try:
            units = list(plan.units)
            for start in range(0, len(units), BATCH):
                batch = units[start:start + BATCH]
                fresh = self._index_access([e.id for u in batch for e in u.entries] +
                                           [w for u in batch for w in u.watch])
                moved: list[tuple[Unit, list[tuple[str, str]], list[_Files]]] = []
                for u in batch:
                    files = [self.files_of(e.kind, e.key) for e in u.entries]
                    why = self._keep(u, files, fresh, rows_by_id)
                    if why:
                        skipped.setdefault(u.entries[0].key, why)
                        continue
                    if dry_run:
                        moved.append((u, [], files))
                        continue
                    pairs = self._move(u, files, trash)
                    if pairs is None:
                        skipped.setdefault(u.entries[0].key, "rename failed")
                        continue
                    moved.append((u, pairs, files))
                if not moved:
                    continue
                if self.hook and not dry_run:
                    self.hook("renamed")
                if not dry_run:
                    try:
                        self._commit(moved)
                    except BaseException:
                        for _, pairs, _ in moved:
                            _restore(self.root, pairs)
                        raise
                    if self.hook:
                        self.hook("committed")
                for u, pairs, files in moved:
                    for e, f in zip(u.entries, files):
                        size = sum(st.st_size for _, st in f.paths)
                        removed.append(Removed(e.key, e.kind, size, e.recreatable and u.reason == "recreatable"))
                        freed += size
                        nfiles += len(f.paths)
                    if unlinker:
                        for _, dst in pairs:
                            unlinker.submit(_unlink_tree, dst)
            if not dry_run:
                self._drop_empty_dirs()
                with self.db.engine.begin() as conn:  # when eviction last ran, whatever it took
                    conn.execute(update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time()))
        finally:
            if unlinker:
                unlinker.shutdown(wait=True)
            if trash:
                shutil.rmtree(trash, ignore_errors=True)
                self._close_trash()
        return Outcome(tuple(removed), tuple(sorted(skipped.items())), freed, nfiles)

    def _keep(self, u: Unit, files: list[_Files], fresh: dict[int, float], rows_by_id: dict) -> str | None:
        cutoff = self.now - self.grace
        for e, f in zip(u.entries, files):
            if f.problem:
                return f.problem
            if f.newest > cutoff or fresh.get(e.id, 0.0) > cutoff:
                return "grace"
            row = rows_by_id.get(e.id)
            for lock in self._guarding_locks(e.kind, e.key, row.ref if row else None):
                if self._inside(lock) and lock_is_held(os.path.join(self.root, lock)):
                    return "lock held"
        for w in u.watch:  # the graph that bundles a module/kernel was just used: it is about to load it
            row = rows_by_id.get(w)
            if fresh.get(w, 0.0) > cutoff or (row and self.files_of(row.kind, row.key).newest > cutoff):
                return "grace"
        return None

    def _move(self, u: Unit, files: list[_Files], trash: str) -> list[tuple[str, str]] | None:
        pairs: list[tuple[str, str]] = []
        for f in files:
            for rel in f.move:
                dst = os.path.join(trash, str(self._seq()))
                try:
                    os.rename(os.path.join(self.root, rel), dst)
                except FileNotFoundError:
                    continue  # already gone
                except OSError:
                    _restore(self.root, pairs)
                    return None
                pairs.append((rel, dst))
        return pairs

    def _seq(self) -> int:
        self._n = getattr(self, "_n", 0) + 1
        return self._n

    def _index_access(self, ids: list[int]) -> dict[int, float]:
        """last_access as the index has it now (the daemon bumps it on every open)."""
        out: dict[int, float] = {}
        with self.db.engine.connect() as conn:
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                out.update(dict(conn.execute(select(ENTRIES.c.id, ENTRIES.c.last_access).where(ENTRIES.c.id.in_(chunk))).all()))
        return out

    def _commit(self, moved) -> None:
        ids = [e.id for u, _, _ in moved for e in u.entries]
        events = [{"cache_id": self.cache_id, "ts": self.now, "kind": "evict", "entry_kind": e.kind,
                   "entry_key": e.key, "graph_key": e.graph_key, "recompile": False,
                   "bytes": sum(st.st_size for _, st in f.paths), "seconds": e.compile_seconds}
                  for u, _, files in moved for e, f in zip(u.entries, files)]
        with self.db.engine.begin() as conn:
            delete_entries(conn, ids)
            conn.execute(insert(EVENTS), events)
            conn.execute(update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time()))

    # -- trash ----------------------------------------------------------------------------------

    def _open_trash(self) -> str:
        base = os.path.join(self.root, layout.TRASH_DIR)
        os.makedirs(base, exist_ok=True)
        if not self._dir_ok(layout.TRASH_DIR):
            raise UnsafePath(f"{base} is not a plain directory inside the cache root: refusing to evict")
        # one eviction at a time per cache: what is left in the trash belongs to a run that died
        self._lock_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)  # flock on the dir itself
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        empty_trash(self.root)
        run = os.path.join(base, f"{os.getpid()}-{int(self.now * 1000)}")
        os.mkdir(run)
        return run

    def _close_trash(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)
            self._lock_fd = None

    def _drop_empty_dirs(self) -> None:
        """Remove emptied graph-key directories, only once they have been empty a grace period
        (Inductor makes the directory, then writes into it). This run's own leave to the next."""
        cutoff = self.now - self.grace
        for top in ("fxgraph", "aotautograd"):
            base = os.path.join(self.root, top)
            depth = 2 if top == "fxgraph" else 1
            for d in _dirs_at(base, depth):
                try:
                    if os.lstat(d).st_mtime < cutoff and not os.listdir(d):
                        os.rmdir(d)
                except OSError:
                    pass


def _dirs_at(base: str, depth: int) -> Iterable[str]:
    level = [base]
    for _ in range(depth):
        nxt = []
        for d in level:
            try:
                with os.scandir(d) as it:
                    nxt.extend(e.path for e in it if e.is_dir(follow_symlinks=False) and not layout.is_transient(e.name))
            except OSError:
                pass
        level = nxt
    return level


def _restore(root: str, pairs: list[tuple[str, str]]) -> None:
    for rel, dst in reversed(pairs):
        src = os.path.join(root, rel)
        if not os.path.lexists(src):
            try:
                os.rename(dst, src)
            except OSError:
                pass


def _unlink_tree(path: str) -> None:
    try:
        os.unlink(path)
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)
    except FileNotFoundError:
        pass


def empty_trash(root: str) -> int:
    """Delete what dead runs left in the trash; returns how many items went."""
    base = os.path.join(os.path.realpath(root), layout.TRASH_DIR)
    n = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        p = os.path.join(base, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            _unlink_tree(p)
        n += 1
    return n


def remaining_bytes(db: Database, cache_id: int) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(ENTRIES.c.bytes), 0)).where(
            ENTRIES.c.cache_id == cache_id)).scalar())
