"""Carry out a Plan: the only code in cachemgr that deletes files.

Nothing is deleted under a directory that does not look like an Inductor cache (`/`, a home
directory named by mistake: eviction takes unreferenced files as orphans). Everything goes
through `safefs.Root`: the root is opened once, every directory below it is reached by
descriptor without following symlinks, and each file or kernel directory is deleted only if it
is still the one (device, inode) that was looked at. A unit is kept whole if any file of it (or
of an entry that bundles it) was written or read within the grace period, if a lock that guards
it is held, or if anything in it changed between the look and the delete.

A unit is renamed into `<root>/.cachemgr-trash/` (same file system: atomic, and the files leave
Inductor's view at once), its index rows are deleted and 'evict' events recorded in one
transaction, and only then is the trash unlinked. Where the trash cannot take it (a full disk:
no room for a new name; a trash that is not a directory; another file system) the unit is
deleted in place and its rows deleted right after. Either way, a failure half way through a
batch commits what did go (with its events) and puts back what did not; and a kill -9 at any
point leaves a state the next scan repairs (the trash is a dotdir, never walked or indexed, and
emptied by the next run).

One eviction at a time per cache: `exclusive()` holds a lock on the root directory itself (no
file to create, so it works on a full disk too) from planning to the last delete, so two runs
never take, or count, the same entry.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import SupportsInt, cast

from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError

from cachemgr import layout, safefs
from cachemgr.errors import UnsafePath
from cachemgr.evict.policy import Evicted, Plan, Table, Unit
from cachemgr.index.db import Database
from cachemgr.index.models import Cache, Dir, Entry, Event
from cachemgr.index.scan import delete_entries, insert_rows
from cachemgr.vocab import Event as Ev
from cachemgr.vocab import Held, Kind, Reason

ENTRIES, EVENTS, CACHES, DIRS = Entry.__table__, Event.__table__, Cache.__table__, Dir.__table__
BATCH = 500  # units per transaction
# One thread looks at the units of a batch and moves them (lstat, lock probes, renames) while this
# one commits the batch before; one more empties the trash. More threads only fought over the GIL
# (100,000 files: 3.4 s with one looker, 4.1-5.0 s with 2-8 on a 16-core host; 2.2 s against
# 2.8-3.0 s on 2 cores). Each thread reaches directories by descriptors of its own (safefs.Root).
LOOK_THREADS = 1
UNLINK_THREADS = 1
LOOK_CHUNK = 16  # units per looker task (a future per unit costs more than looking at a small one)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EMLINK, errno.EXDEV)  # the trash cannot take it: delete in place
Hook = Callable[[str], None]  # crash-test hook: called with 'renamed' / 'committed' per batch


def refuse_foreign_root(root: str, refusing: str = "delete anything under it") -> None:
    """Raise UnsafePath unless `root` looks like an Inductor cache directory (layout.foreign_root)."""
    reason = layout.foreign_root(root)
    if reason:
        raise UnsafePath(f"{reason}: refusing to {refusing}")


@contextmanager
def exclusive(root: str, waiting: Callable[[], None] | None = None) -> Iterator[safefs.Root]:
    """The cache root, checked to be an Inductor cache, opened and locked for eviction until the
    block ends. Another eviction or purge of the same cache waits (`waiting` is called first)."""
    refuse_foreign_root(root)
    try:
        r = safefs.Root(root)
    except OSError as e:
        from cachemgr.errors import CacheDirError

        raise CacheDirError(f"cannot open cache directory {root}: {e.strerror}") from e
    with r:
        try:
            fcntl.flock(r.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                waiting()
            fcntl.flock(r.fd, fcntl.LOCK_EX)
        yield r  # closing the descriptor releases the lock


@dataclass(frozen=True)
class Outcome:
    removed: Evicted
    skipped: tuple[tuple[str, str], ...]
    freed_bytes: int
    freed_files: int
    recreatable_bytes: int  # of what left: modules and kernels a kept graph writes again on its next hit
    in_place: bool = False  # the trash could not be used for some units (full disk, odd trash)


def lock_is_held(root: safefs.Root, key: str) -> bool:
    """Is a filelock (flock-based, as Inductor's torch.utils._filelock) held on `key` now?"""
    parent, name = safefs.split(layout.fs_path(key))
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root.dir_fd(parent))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: treat it as held
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
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
    """One entry's files as they are now, or a reason to keep it."""

    paths: list[tuple[str, os.stat_result]] = field(default_factory=list)  # (key, lstat) of each regular file
    move: list[tuple[str, safefs.Identity]] = field(default_factory=list)  # what goes: files, or a kernel dir whole
    problem: Held | None = None

    @property
    def newest(self) -> float:
        return max((max(st.st_atime, st.st_mtime) for _, st in self.paths), default=0.0)

    @property
    def bytes(self) -> int:
        return sum(st.st_size for _, st in self.paths)


@dataclass
class _Batch:
    looks: list[Future | None]  # each chunk's look, None once collected
    taken: list[_Taken] = field(default_factory=list)


@dataclass
class _Taken:
    """A unit whose files left the cache: into the trash (`trashed`, reversible) or deleted."""

    unit: Unit
    files: list[_Files]
    trashed: list[tuple[str, str]] = field(default_factory=list)  # (key, name in the trash)
    deleted: bool = False


class Executor:
    def __init__(
        self,
        db: Database,
        cache_id: int,
        root: safefs.Root,
        grace: float,
        now: float | None = None,
        hook: Hook | None = None,
    ) -> None:
        self.db, self.cache_id, self.root, self.grace, self.hook = db, cache_id, root, grace, hook
        self.now = time.time() if now is None else now
        self.folders: dict[str, dict[str, list[str]]] = {}  # <2ch> folder -> planned stem -> names (listed once a run)
        self.code_stems: dict[str, set[str]] = {}  # <2ch> folder -> stems of the planned code entries in it
        self.locks = self._lock_names()
        self.trash: int | None = None
        self.in_place = False
        self.rows = Table()  # the entries the plan `run` carries out was made from
        self._names = itertools.count()

    # -- looking --------------------------------------------------------------------------------

    def _lock_names(self) -> set[str]:
        try:
            return {n for n in self.root.listdir(layout.LOCKS_DIR) if n.endswith(".lock")}
        except OSError:
            return set()

    def _guarding_locks(self, kind: str, key: str, ref: str | None) -> list[str]:
        out = []
        if kind == Kind.LOCK:
            out.append(key)
        elif ref and (ref + ".lock") in self.locks:
            out.append(f"{layout.LOCKS_DIR}/{ref}.lock")
        elif kind == Kind.CODE and ref:
            out.append(f"{layout.LOCKS_DIR}/{ref}.lock")  # a build may have just made it
        if kind in (Kind.TRITON, Kind.PGO):
            out.append(key + ".lock")  # Triton's bundler locks <kernel dir>.lock, dynamo's PGO <profile>.lock
        return out

    def _stem_names(self, folder: str, stem: str) -> list[str]:
        """Names in a <2ch>/ folder that belong to code entry `stem`: the folder is listed once per
        run, and only the planned entries' names kept (each given out once), so each entry costs
        its own files, not the whole folder, and the run holds no listing of the cache."""
        by_stem = self.folders.get(folder)
        if by_stem is None:  # two threads may both list it: each gives out its own, the same names
            wanted = self.code_stems.get(folder, set())
            by_stem = {}
            try:
                names = self.root.listdir(layout.fs_path(folder))
            except OSError:
                names = []
            for n in names:
                n = layout.key_of(n)
                s = n.partition(".")[0]
                if s in wanted and not layout.is_transient(n):
                    by_stem.setdefault(s, []).append(n)
            self.folders[folder] = by_stem  # published whole: other threads read it as they find it
        return by_stem.pop(stem, [])

    def files_of(self, kind: str, key: str) -> _Files:
        f = _Files()
        try:
            if kind == Kind.TRITON:
                return self._kernel_files(key)
            if kind == Kind.CODE:
                folder, stem = key.split("/", 1)
                rels = [f"{folder}/{n}" for n in self._stem_names(folder, stem)]
            else:
                rels = [key]
            for rel in rels:
                try:
                    st = self.root.lstat(layout.fs_path(rel))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):  # a symlink stays, and so does what it points at
                    f.paths.append((rel, st))
                    f.move.append((rel, safefs.identity(st)))
        except safefs.Refused:
            f.problem = Held.UNSAFE
        except OSError as e:
            f.problem = Held.UNSAFE if e.errno in (errno.ELOOP, errno.ENOTDIR) else Held.FAILED
        return f

    def _kernel_files(self, key: str) -> _Files:
        """A Triton kernel directory, moved whole: it must be a real directory holding only
        finished regular files (a temporary file: a write in progress; a symlink: refused)."""
        f = _Files()
        parent, name = safefs.split(layout.fs_path(key))
        try:  # O_NOFOLLOW | O_DIRECTORY: a symlink (ELOOP) or a file (ENOTDIR) is refused by files_of
            fd = os.open(name, safefs.O_DIR, dir_fd=self.root.dir_fd(parent))
        except FileNotFoundError:
            return f
        try:
            st = os.fstat(fd)
            with os.scandir(fd) as it:
                for d in it:
                    s = d.stat(follow_symlinks=False)
                    if layout.is_transient(d.name):
                        f.problem = Held.IN_PROGRESS
                        return f
                    if not stat.S_ISREG(s.st_mode):
                        f.problem = Held.UNSAFE
                        return f
                    f.paths.append((f"{key}/{layout.key_of(d.name)}", s))
        finally:
            os.close(fd)
        f.move = [(key, safefs.identity(st))]
        return f

    # -- carrying out -----------------------------------------------------------------------------

    def run(self, plan: Plan, rows: Table, dry_run: bool = False) -> Outcome:
        """Carry out `plan`, made from `rows` (its units' watch lists are positions in it)."""
        self.rows = rows
        for i in plan.positions():
            if rows.kind[i] == Kind.CODE:
                folder, _, stem = rows.key[i].partition("/")
                self.code_stems.setdefault(folder, set()).add(stem)
        removed = Evicted(rows)
        skipped: dict[str, str] = {}
        freed = nfiles = again = 0
        if not dry_run:
            self.trash = self._open_trash()
        # unlinking is the file system's slow part (freeing blocks, journal): in the background
        unlinker = None if dry_run else ThreadPoolExecutor(max_workers=UNLINK_THREADS)
        looker = ThreadPoolExecutor(max_workers=LOOK_THREADS)
        units = plan.units  # (a plan's Units make each when sliced: a batch at a time)
        batch = self._look(looker, units[:BATCH], dry_run) if units else None
        following = None
        try:
            at = 0
            while batch is not None:
                failure = _collect(batch.looks, batch.taken, skipped)
                if failure is not None:
                    raise failure
                at += BATCH
                # the next batch is looked at (and moved) while this one commits
                following = self._look(looker, units[at : at + BATCH], dry_run) if at < len(units) else None
                if batch.taken and not dry_run:
                    if self.hook:
                        self.hook("renamed")
                    self._commit(batch.taken)
                    if self.hook:
                        self.hook("committed")
                done, batch, following = batch.taken, following, None
                for t in done:
                    for e, f in zip(t.unit.entries, t.files, strict=True):
                        if not f.paths:
                            continue  # an entry of the unit that was gone already: not ours to count
                        removed.add(e.at, f.bytes, e.reason)
                        if e.recreatable and t.unit.reason == Reason.RECREATABLE:
                            again += f.bytes
                        freed += f.bytes
                        nfiles += len(f.paths)
                if unlinker is not None:
                    unlinker.submit(_remove_quietly, self.trash, [name for t in done for _, name in t.trashed])
            if not dry_run:
                self._drop_empty_dirs(rows)
                with self.db.engine.begin() as conn:  # when eviction last ran, whatever it took
                    conn.execute(update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time()))
        finally:
            for b in (batch, following):  # looked at, not committed: what moved goes back
                if b is not None:
                    self._settle(b, skipped, dry_run)
            looker.shutdown(wait=True)
            if unlinker is not None:
                unlinker.shutdown(wait=True)
            if self.trash is not None:
                os.close(self.trash)
                self.trash = None
        return Outcome(removed, tuple(sorted(skipped.items())), freed, nfiles, again, self.in_place)

    def _look(self, looker: ThreadPoolExecutor, units: Sequence[Unit], dry_run: bool) -> _Batch:
        """A batch of units handed to the looker threads: each unit looked at and, unless it must
        stay, moved out of the cache. Its rows and events are committed by `run`."""
        ids = self.rows.id
        fresh = self._index_access([e.id for u in units for e in u.entries] + [ids[w] for u in units for w in u.watch])
        looks: list[Future | None] = [
            looker.submit(self._look_and_take, units[i : i + LOOK_CHUNK], fresh, dry_run)
            for i in range(0, len(units), LOOK_CHUNK)
        ]
        return _Batch(looks)

    def _settle(self, b: _Batch, skipped: dict[str, str], dry_run: bool) -> None:
        """A batch that will not be committed (a failure, an interrupt): no look of it may move
        anything more; what was moved goes back (what was deleted in place is committed)."""
        pending = [f for f in b.looks if f is not None]
        for f in pending:
            f.cancel()
        wait(pending)
        _collect(b.looks, b.taken, skipped)
        if b.taken and not dry_run:
            self._rescue(b.taken)

    def _look_and_take(
        self, units: Sequence[Unit], fresh: dict[int, float], dry_run: bool
    ) -> list[tuple[Unit, _Taken | str | Exception]]:
        """(In a looker thread.) Each unit as it is now, moved out of the cache unless it must stay
        (then the reason). A failure ends the chunk: what moved before it is still returned."""
        out: list[tuple[Unit, _Taken | str | Exception]] = []
        for u in units:
            try:
                out.append((u, self._look_and_take_one(u, fresh, dry_run)))
            except Exception as e:  # noqa: BLE001 - raised by run once every move is accounted for
                out.append((u, e))
                break
        return out

    def _look_and_take_one(self, u: Unit, fresh: dict[int, float], dry_run: bool) -> _Taken | str:
        files = [self.files_of(e.kind, e.key) for e in u.entries]
        why = self._keep(u, files, fresh)
        if why is None and not any(f.paths for f in files):
            why = Held.GONE  # another process deleted it first: nothing of ours to count
        if why:
            return why
        t = _Taken(u, files)
        if not dry_run:
            why = self._take(t)
            if why:
                return why
        return t

    def _take(self, t: _Taken) -> Held | None:
        """Move a unit's files into the trash, or delete them in place where the trash cannot take
        them. On a refusal, what was moved goes back and the unit is kept."""
        for f in t.files:
            for key, ident in f.move:
                try:
                    if self.trash is not None:
                        name = f"{os.getpid()}-{next(self._names)}"
                        try:
                            self.root.move(layout.fs_path(key), ident, self.trash, name)
                            t.trashed.append((key, name))
                            continue
                        except OSError as e:
                            if e.errno not in NO_ROOM:
                                raise
                    self.root.delete(layout.fs_path(key), ident)
                    t.deleted = self.in_place = True
                except FileNotFoundError:
                    continue  # gone meanwhile
                except OSError as e:
                    why = (
                        Held.CHANGED
                        if isinstance(e, safefs.Refused)
                        else (Held.UNSAFE if e.errno in (errno.ELOOP, errno.ENOTDIR) else Held.FAILED)
                    )
                    if t.deleted:  # part of it is gone already: the rest goes in the commit's repair
                        return None
                    self._restore(t)
                    return why
        return None

    def _commit(self, taken: list[_Taken]) -> None:
        events = [
            {
                "cache_id": self.cache_id,
                "ts": self.now,
                "kind": Ev.EVICT,
                "entry_kind": e.kind,
                "entry_key": e.key,
                "graph_key": e.graph_key,
                "recompile": False,
                "bytes": f.bytes,
                "seconds": e.compile_seconds,
            }
            for t in taken
            for e, f in zip(t.unit.entries, t.files, strict=True)
            if f.paths
        ]
        try:
            self._write(taken, events)
        except OperationalError:
            # The index may live on the very disk that is full: free the space first, then retry.
            if not any(t.trashed for t in taken):
                raise
            for t in taken:
                for _, name in t.trashed:
                    _remove_quietly(self.trash, [name])
                t.trashed, t.deleted = [], True
            self._write(taken, events)

    def _write(self, taken: list[_Taken], events: list[dict]) -> None:
        with self.db.engine.begin() as conn:
            # this write first: on SQLite it takes the write lock before anything is read
            conn.execute(update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time()))
            delete_entries(conn, [e.id for t in taken for e in t.unit.entries])
            insert_rows(conn, EVENTS, events)

    def _rescue(self, taken: list[_Taken]) -> None:
        """The batch failed before its commit: record what was deleted in place, put back what is
        in the trash (so index and disk agree)."""
        gone = [t for t in taken if t.deleted]
        for t in taken:
            if not t.deleted:
                self._restore(t)
        if gone:
            try:
                self._commit(gone)
            except Exception:  # noqa: BLE001 - the first failure is what the caller sees; a scan repairs this
                pass

    def _restore(self, t: _Taken) -> None:
        for key, name in reversed(t.trashed):
            parent, base = safefs.split(layout.fs_path(key))
            try:
                os.rename(name, base, src_dir_fd=self.trash, dst_dir_fd=self.root.dir_fd(parent))
            except OSError:
                pass  # its place was taken meanwhile: it stays in the trash, the next scan drops its row
        t.trashed = []

    def _keep(self, u: Unit, files: list[_Files], fresh: dict[int, float]) -> str | None:
        cutoff = self.now - self.grace
        for e, f in zip(u.entries, files, strict=True):
            if f.problem:
                return f.problem
            if f.newest > cutoff or fresh.get(e.id, 0.0) > cutoff:
                return Held.GRACE
            for lock in self._guarding_locks(e.kind, e.key, e.ref):
                if lock_is_held(self.root, lock):
                    return Held.LOCK
        t = self.rows
        for w in u.watch:  # the graph that bundles a module/kernel was just used: it is about to load it
            if fresh.get(t.id[w], 0.0) > cutoff or self.files_of(t.kind[w], t.key[w]).newest > cutoff:
                return Held.GRACE
        return None

    def _index_access(self, ids: list[int]) -> dict[int, float]:
        """last_access as the index has it now (the daemon bumps it on every open)."""
        out: dict[int, float] = {}
        with self.db.engine.connect() as conn:
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                out.update(
                    conn.execute(select(ENTRIES.c.id, ENTRIES.c.last_access).where(ENTRIES.c.id.in_(chunk))).all()
                )
        return out

    # -- trash ----------------------------------------------------------------------------------

    def _open_trash(self) -> int | None:
        """The trash folder's descriptor, emptied of what dead runs left; None (delete in place)
        when there is none and no room to make one, or its name is taken by something else."""
        root = self.root
        try:
            os.mkdir(layout.TRASH_DIR, 0o700, dir_fd=root.fd)
        except FileExistsError:
            pass
        except OSError:
            return None  # a full disk, a read-only root, no permission: delete in place
        try:
            fd = os.open(layout.TRASH_DIR, safefs.O_DIR, dir_fd=root.fd)
        except OSError:
            return None  # a file or symlink of that name: not ours to remove, not a place to move to
        try:
            for name in os.listdir(fd):  # we hold the eviction lock: what is here belongs to a run that died
                _remove_quietly(fd, [name])
        except OSError:
            pass
        return fd

    def _drop_empty_dirs(self, rows: Table) -> None:
        """Remove graph-key directories that hold no entry, once they have been empty a grace
        period (Inductor makes the directory, then writes into it): the directories the last scan
        recorded that no index row lives in. This run's own leave to the next."""
        heads = (Kind.FXGRAPH, Kind.AOTAUTOGRAD)
        homes = {key.rpartition("/")[0] for key, kind in zip(rows.key, rows.kind, strict=True) if kind in heads}
        with self.db.engine.connect() as conn:
            dirs = (
                conn.execute(
                    select(DIRS.c.path).where(
                        DIRS.c.cache_id == self.cache_id,
                        (DIRS.c.path.startswith("fxgraph/") | DIRS.c.path.startswith("aotautograd/")),
                    )
                )
                .scalars()
                .all()
            )
        cutoff = self.now - self.grace
        for d in dirs:
            if d in homes or d.count("/") != (2 if d.startswith("fxgraph/") else 1):
                continue
            parent, name = safefs.split(layout.fs_path(d))
            try:
                pfd = self.root.dir_fd(parent)
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff:
                    os.rmdir(name, dir_fd=pfd)  # fails unless empty
            except OSError:
                pass


def _collect(looks: list[Future | None], taken: list[_Taken], skipped: dict[str, str]) -> Exception | None:
    """Gather a batch's looks (waiting for each), in plan order, each once: what was taken into
    `taken`, what stays into `skipped`. The first failure is returned, not raised."""
    failure = None
    for i, f in enumerate(looks):
        if f is None:
            continue
        try:
            got = f.result()
        except CancelledError:
            got = []
        looks[i] = None
        for u, what in got:
            if isinstance(what, _Taken):
                taken.append(what)
            elif isinstance(what, Exception):
                failure = failure or what
            else:
                skipped.setdefault(u.entries[0].key, what)
    return failure


def _remove_quietly(dir_fd: int | None, names: list[str]) -> None:
    if dir_fd is None:
        return
    for name in names:
        try:
            safefs.remove_at(dir_fd, name)
        except OSError:
            pass


def remaining_bytes(db: Database, cache_id: int) -> int:
    with db.engine.connect() as conn:
        total = conn.execute(
            select(func.coalesce(func.sum(ENTRIES.c.bytes), 0)).where(ENTRIES.c.cache_id == cache_id)
        ).scalar()
        return int(cast(SupportsInt, total))  # never NULL (coalesce): an int, or on PostgreSQL a Decimal
