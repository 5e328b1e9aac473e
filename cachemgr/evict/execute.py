"""Carry out a Plan: the only code in cachemgr that deletes files.

Nothing is deleted under a directory that does not look like an Inductor cache (`/`, a home
directory named by mistake: eviction takes unreferenced files as orphans). Everything goes
through `safefs.Root`: the root is opened once, every directory below it is reached by
descriptor without following symlinks, and each file or kernel directory is deleted only if it
is still the one (device, inode) that was looked at, still below the root, and (a kernel
directory) holds only the files looked at. A unit is kept whole if any file of it (or
of an entry that bundles it) was written or read within the grace period, if a lock that guards
it is held, or if anything in it changed between the look and the delete.

A unit is renamed into `<root>/.cachemgr-trash/`, into the bin there of the looker that took it
(same file system: atomic, and the files leave Inductor's view at once), its index rows are
deleted and 'evict' events recorded in one transaction, and only then is the trash unlinked.
Where the trash cannot take it (a full disk: no room for a new name; a trash that is not a
directory) the unit is deleted in place and its rows deleted right after. Nothing at, below or
above a mount point inside the root (another file system, a bind mount) is moved or deleted: such
a unit stays, "another mount". Either way, a failure half way through a batch commits what did
go (with its events) and puts back what did not; and a kill -9 at any point leaves a state the
next scan repairs (the trash is a dotdir, never walked or indexed, and emptied by the next run).

One eviction at a time per cache: `exclusive()` holds a lock on the root directory itself (no
file to create, so it works on a full disk too) from planning to the last delete, so two runs
never take, or count, the same entry.
"""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import SupportsInt, cast

from sqlalchemy import Float, func, select, update
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from cachemgr import layout, safefs
from cachemgr.errors import UnsafePath
from cachemgr.evict.look import (
    Bin,
    Look,
    Looker,
    Lookers,
    Took,
    WorkerDied,
    close_bins,
    empty_trash,
    make_bins,
    remove_quietly,
    restore,
)
from cachemgr.evict.policy import Evicted, Plan, Table, Unit
from cachemgr.index import schema
from cachemgr.index.db import Database
from cachemgr.index.dbapi import driver_errors
from cachemgr.index.models import Cache, Dir, Entry, Event
from cachemgr.index.scan import delete_entries, insert_rows, one_of
from cachemgr.vocab import Event as Ev
from cachemgr.vocab import Kind, Reason

ENTRIES, EVENTS, CACHES, DIRS = Entry.__table__, Event.__table__, Cache.__table__, Dir.__table__
BATCH = 500  # units per transaction
# A batch's deletes touch pages all over the entries' indexes (about 14 MB of them for 500 units):
# at SQLite's default of 1,000 pages every commit also checkpointed (copied and synced) them.
# Eviction's commits checkpoint once the WAL holds this many pages (4 KiB each): less often.
CHECKPOINT_PAGES = 8192
# The units of a batch are looked at and moved (look.py) while this process commits the batch
# before: in a thread for a small plan, in worker processes for a large one (a worker costs about
# 0.1 s to start). 100,000 files on a 16-core host: 2.57 s with one thread, 2.16 s with 4 workers,
# 3.28 s with 8, 4.15 s with 16 (they contend in the kernel and for this process's commits).
# Threads did not help: with 2-8 looker threads the GIL made it slower, 4.1-5.0 s. (Those runs
# shared one trash folder; with a bin each, 8 workers took 1.60 s and 4 took 1.61-1.68 s on an
# H100 host: the evicting process's own plan and commits are the bound there.)
LOOK_PROCESSES = 4
PROCESSES_FROM = 2000  # units in a plan
LOOK_CHUNK = 16  # units per look task (a future per unit costs more than looking at a small one)
Hook = Callable[[str], None]  # crash-test hook: called with 'renamed' / 'committed' per batch


def refuse_foreign_root(
    root: str, refusing: str = "delete anything under it", opened: safefs.Root | None = None
) -> None:
    """Raise UnsafePath unless `root` looks like an Inductor cache directory (layout.foreign_root);
    with `opened`, the directory of that name already open, which is then the one checked."""
    reason = layout.foreign_root(root) if opened is None else layout.foreign_opened(root, opened)
    if reason:
        raise UnsafePath(f"{reason}: refusing to {refusing}")


@contextmanager
def exclusive(root: str, waiting: Callable[[], None] | None = None) -> Iterator[safefs.Root]:
    """The cache root, checked to be an Inductor cache, opened and locked for eviction until the
    block ends. Another eviction or purge of the same cache waits (`waiting` is called first)."""
    try:
        r = safefs.Root(root)
    except OSError as e:
        from cachemgr.errors import CacheDirError

        raise CacheDirError(f"cannot open cache directory {root}: {e.strerror}") from e
    with r:
        refuse_foreign_root(root, opened=r)  # the directory opened, not the name (a symlink swapped meanwhile)
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


@dataclass
class _Batch:
    looks: list[tuple[Sequence[Unit], Future] | None]  # each chunk's units and look, None once collected
    taken: list[_Taken] = field(default_factory=list)


@dataclass
class _Taken:
    unit: Unit
    took: Took


def default_processes() -> int:
    from cachemgr import procs

    return max(1, min(procs.cores(), LOOK_PROCESSES))


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
        self.trash: int | None = None
        self.bins: list[Bin] = []  # each looker's own folder in the trash (none: no trash, in place)
        self.looker = Looker(root, None, {}, self.now - grace)
        self.in_place = False
        self.completed = False  # every batch of the plan went through (an interrupt may follow)
        self.rows = Table()  # the entries the plan `run` carries out was made from

    # -- carrying out -----------------------------------------------------------------------------

    def run(self, plan: Plan, rows: Table, dry_run: bool = False) -> Outcome:
        """Carry out `plan`, made from `rows` (its units' watch lists are positions in it)."""
        self.rows = rows
        code_stems = self.looker.code_stems
        for i in plan.positions():
            if rows.kind[i] == Kind.CODE:
                folder, _, stem = rows.key[i].partition("/")
                code_stems.setdefault(folder, set()).add(stem)
        removed = Evicted(rows)
        skipped: dict[str, str] = {}
        freed = nfiles = again = 0
        if not dry_run:
            self.trash = self._open_trash()
        units = plan.units  # (a plan's Units make each when sliced: a batch at a time)
        processes = default_processes() if len(units) >= PROCESSES_FROM and not dry_run else 0
        lookers: Lookers | None = None
        batch = following = None
        ctrl_c = _CtrlC()
        try:  # (from the first worker on: a failure closes what was opened, the trash included)
            trash = None
            if self.trash is not None:
                trash = safefs.identity(os.fstat(self.trash))
                self.bins = make_bins(self.trash, max(1, processes))
                self.looker.trash = self._bin_fd(0)  # (with no worker processes, this looker moves)
            lookers = Lookers(self.looker, processes, trash, self.bins)
            batch = self._look(lookers, units[:BATCH], dry_run) if units else None
            at = 0
            while batch is not None:
                failure = _collect(batch.looks, batch.taken, skipped)
                if isinstance(failure, safefs.Refused):  # a worker found the root or the trash replaced
                    raise UnsafePath(f"{failure.filename}: {failure.why}: eviction stopped") from failure
                if failure is not None:
                    raise failure
                at += BATCH
                # the next batch is looked at (and moved) while this one commits
                following = self._look(lookers, units[at : at + BATCH], dry_run) if at < len(units) else None
                committing = bool(batch.taken) and not dry_run
                if committing:
                    if self.hook:
                        self.hook("renamed")
                    self._commit(batch.taken)
                # committed: whatever is raised from here on, nothing of it goes back (what it moved
                # stays in the bins, for the next run to empty)
                done, batch, following = batch.taken, following, None
                if committing and self.hook:
                    self.hook("committed")
                for t in done:
                    self.in_place = self.in_place or t.took.deleted
                    for e, (nbytes, n) in zip(t.unit.entries, t.took.sizes, strict=True):
                        if not n:
                            continue  # an entry of the unit that was gone already: not ours to count
                        removed.add(e.at, nbytes, e.reason)
                        if e.recreatable and t.unit.reason == Reason.RECREATABLE:
                            again += nbytes
                        freed += nbytes
                        nfiles += n
                if not dry_run:
                    lookers.unlink([t.took for t in done])
                if ctrl_c.seen and batch is not None:
                    raise KeyboardInterrupt  # between batches: the one in flight is settled below
            if not dry_run:
                self._drop_empty_dirs(rows)
                try:  # when eviction last ran, whatever it took (each batch's commit said so already)
                    with self.db.engine.begin() as conn:
                        conn.execute(
                            update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time())
                        )
                except SQLAlchemyError:
                    pass  # (a locked index: everything is committed, the run stands)
            self.completed = True  # (an interrupt seen during the last batch is raised below)
        finally:
            try:  # (a second Ctrl-C may interrupt this too: the handler is put back whatever happens)
                for b in (batch, following):  # looked at, not committed: what moved goes back
                    if b is not None:
                        self._settle(b, skipped, dry_run)
                if lookers is not None:
                    lookers.close()
                if self.trash is not None:
                    close_bins(self.trash, self.bins)
                    os.close(self.trash)
                    self.trash = self.looker.trash = None
                    self.bins = []
            finally:
                ctrl_c.release()
        if ctrl_c.seen:  # during the last batch: everything is settled; the caller stops here
            raise KeyboardInterrupt
        if lookers is not None and lookers.died:  # (each job it held was answered: everything is committed)
            raise WorkerDied(lookers.died)
        return Outcome(removed, tuple(sorted(skipped.items())), freed, nfiles, again, self.in_place)

    def _look(self, lookers: Lookers, units: Sequence[Unit], dry_run: bool) -> _Batch:
        """A batch of units handed to the lookers: each unit looked at and, unless it must stay,
        moved out of the cache. Its rows and events are committed by `run`."""
        t = self.rows
        fresh = self._index_access([e.id for u in units for e in u.entries] + [t.id[w] for u in units for w in u.watch])
        looks: list[tuple[Sequence[Unit], Future] | None] = []
        for i in range(0, len(units), LOOK_CHUNK):
            chunk = units[i : i + LOOK_CHUNK]
            plain = [
                Look(
                    tuple((e.id, e.kind, e.key, e.ref) for e in u.entries),
                    tuple((t.id[w], t.kind[w], t.key[w]) for w in u.watch),
                )
                for u in chunk
            ]
            ids = [e[0] for u in plain for e in u.entries] + [w[0] for u in plain for w in u.watch]
            seen = {i: fresh[i] for i in ids if i in fresh}
            looks.append((chunk, lookers.look(plain, seen, dry_run)))
        return _Batch(looks)

    def _settle(self, b: _Batch, skipped: dict[str, str], dry_run: bool) -> None:
        """A batch that will not be committed (a failure, an interrupt): no look of it may move
        anything more; what was moved goes back (what was deleted in place is committed)."""
        pending = [look[1] for look in b.looks if look is not None]
        for f in pending:
            f.cancel()
        wait(pending)
        _collect(b.looks, b.taken, skipped)
        if b.taken and not dry_run:
            self._rescue(b.taken)

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
                "bytes": nbytes,
                "seconds": e.compile_seconds,
            }
            for t in taken
            for e, (nbytes, n) in zip(t.unit.entries, t.took.sizes, strict=True)
            if n
        ]
        try:
            self._write(taken, events)
        except driver_errors("OperationalError", OperationalError) as e:  # (delete_entries runs the driver's SQL too)
            # The index may live on the very disk that is full: free the space first (what the
            # batch moved, and the index's reserve), then retry. Any other failure (a locked
            # index) frees nothing: the batch goes back (run's rescue).
            if not schema.disk_full(e):
                raise
            trashed = any(t.took.trashed for t in taken)
            if trashed:
                for t in taken:
                    remove_quietly(self._bin_fd(t.took.bin), [name for _, name in t.took.trashed])
                    t.took.trashed, t.took.deleted = [], True
            reserve = self.db.reserve is not None and schema.release_reserve(self.db.reserve)
            if not (trashed or reserve):
                raise
            self._write(taken, events)

    def _write(self, taken: list[_Taken], events: list[dict]) -> None:
        with self.db.engine.connect() as conn:
            pages = None
            if self.db.is_sqlite:  # (the connection goes back to the pool as it came: restored below)
                pages = int(conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar_one())
                conn.exec_driver_sql(f"PRAGMA wal_autocheckpoint={max(pages, CHECKPOINT_PAGES)}")
                conn.commit()  # (ends the transaction those began: the batch's is its own)
            try:
                with conn.begin():
                    # this write first: on SQLite it takes the write lock before anything is read
                    conn.execute(update(CACHES).where(CACHES.c.id == self.cache_id).values(last_eviction=time.time()))
                    delete_entries(conn, [e.id for t in taken for e in t.unit.entries])
                    insert_rows(conn, EVENTS, events)
            finally:
                if pages is not None:
                    try:
                        conn.exec_driver_sql(f"PRAGMA wal_autocheckpoint={pages}")
                        conn.commit()
                    except SQLAlchemyError:  # (the batch is committed, or its own error is on its way)
                        conn.invalidate()  # not back into the pool with eviction's threshold

    def _rescue(self, taken: list[_Taken]) -> None:
        """The batch failed before its commit: record what was deleted in place, put back what is
        in the trash (so index and disk agree)."""
        gone = [t for t in taken if t.took.deleted]
        for t in taken:
            if not t.took.deleted:
                restore(self.root, self._bin_fd(t.took.bin), t.took)
        if gone:
            try:
                self._commit(gone)
            except Exception:  # noqa: BLE001 - the first failure is what the caller sees; a scan repairs this
                pass

    def _index_access(self, ids: list[int]) -> dict[int, float]:
        """last_access as the index has it now (the daemon bumps it on every open)."""
        out: dict[int, float] = {}
        with self.db.engine.connect() as conn:
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                q = select(ENTRIES.c.id, ENTRIES.c.last_access).where(one_of(conn, ENTRIES.c.id, chunk))
                out.update(conn.execute(q).all())
        return out

    # -- trash ----------------------------------------------------------------------------------

    def _open_trash(self) -> int | None:
        """The trash folder's descriptor, emptied of what dead runs left; None (delete in place)
        when there is none and no room to make one, its name is taken by something else, or it is
        a mount point."""
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
        mounts = safefs.mounts_below(root)
        if layout.TRASH_DIR in mounts:  # someone's folder (another file system's): not a place to move to
            os.close(fd)
            return None
        try:
            empty_trash(fd, mounts)  # we hold the eviction lock: what is here belongs to a run that died
        except OSError:
            pass
        return fd

    def _bin_fd(self, number: int) -> int | None:
        return self.bins[number].fd if number < len(self.bins) else None

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
            try:  # (Refused: a hand-edited row that names no directory)
                parent, name = safefs.split(layout.fs_path(d))
                pfd = self.root.reachable_dir_fd(parent)
                self.root.same_mount(pfd, d)  # (a folder mounted over its parent since the scan: not ours)
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode) and st.st_mtime < cutoff:
                    os.rmdir(name, dir_fd=pfd)  # fails unless empty
            except OSError:
                pass


class _CtrlC:
    """Ctrl-C held off while an eviction runs, and acted on between its batches.

    A KeyboardInterrupt raised anywhere else could land after a batch's COMMIT returned and
    before the run knew (its rescue then put back files whose rows and events were committed),
    inside `_look` (a half-sent batch, never settled, that the workers went on to move), or
    inside a future's lock (a reader thread, then the close, waiting for ever). The handler only
    records: it takes no lock. A second Ctrl-C interrupts at once (a worker that hangs). Off the
    main thread (the daemon's scheduler) nothing changes."""

    def __init__(self) -> None:
        self.seen = False
        self.held = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        )
        self.previous = signal.signal(signal.SIGINT, self._seen) if self.held else None

    def _seen(self, _signum, _frame) -> None:
        if self.seen:
            raise KeyboardInterrupt
        self.seen = True

    def release(self) -> None:
        if self.held:
            # (None: a handler not set from Python; Python's own then, not one that kills the process)
            signal.signal(signal.SIGINT, signal.default_int_handler if self.previous is None else self.previous)
            self.held = False


def _collect(
    looks: list[tuple[Sequence[Unit], Future] | None], taken: list[_Taken], skipped: dict[str, str]
) -> Exception | None:
    """Gather a batch's looks (waiting for each), in plan order, each once: what was taken into
    `taken`, what stays into `skipped`. The first failure is returned, not raised."""
    failure = None
    for i, look in enumerate(looks):
        if look is None:
            continue
        units, f = look
        try:
            got = f.result()
        except CancelledError:
            got = []
        except Exception as e:  # noqa: BLE001 - a worker process that died (or would not start)
            got = [e]
        looks[i] = None
        for u, what in zip(units, got, strict=False):  # a failure ends a chunk early
            if isinstance(what, Took):
                taken.append(_Taken(u, what))
            elif isinstance(what, Exception):
                failure = failure or what
            else:
                skipped.setdefault(u.entries[0].key, what)
    return failure


def remaining_bytes(db: Database, cache_id: int) -> int:
    return usage(db, cache_id)[0]


def usage(db: Database, cache_id: int) -> tuple[int, int]:
    """(bytes, files) the index holds for the cache. Summed as floats: SQLite's integer SUM fails
    past int64, which a few sparse files of 4 EiB apparent size reach (exact below 2**53 bytes)."""
    with db.engine.connect() as conn:
        row = conn.execute(
            select(*(func.coalesce(func.sum(sql_cast(c, Float)), 0) for c in (ENTRIES.c.bytes, ENTRIES.c.files))).where(
                ENTRIES.c.cache_id == cache_id
            )
        ).one()
    # (never NULL: coalesce; a float, or on PostgreSQL a Decimal)
    return int(cast(SupportsInt, row[0])), int(cast(SupportsInt, row[1]))
