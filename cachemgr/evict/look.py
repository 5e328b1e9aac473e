"""Looking at planned units and moving them out of the cache: the part of eviction that touches
files one at a time (lstat, lock probes, renames into the trash, unlinks).

It runs beside the evicting process's index commits: in a thread of that process for a small
plan, and in worker processes for a large one (`Lookers`), so that its Python work per file uses
the cores a host has instead of taking turns with the commits for one. A worker is spawned (it
inherits nothing but what `start` is given), opens the root and the trash itself, and works only
if both are the very directories (device, inode) the evicting process holds locked; it dies with
that process (PDEATHSIG) and leaves Ctrl-C to it. What goes in and out is plain data: a unit to
look at is a `Look`, and the answer for it a `Took` or the reason it stays.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import signal
import stat
import sys
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple, cast

from cachemgr import layout, procs, safefs
from cachemgr.errors import CachemgrError
from cachemgr.index.workers import receive, send
from cachemgr.vocab import Held, Kind

# The trash cannot take it (a full disk; a trash another user made, or made immutable): delete
# in place. (EXDEV, another file system, is a mount point inside the root: never ours to delete.)
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EMLINK, errno.EACCES, errno.EPERM)

Planned = tuple[int, str, str, str | None]  # an entry of a unit: (id, kind, key, ref)
Watched = tuple[int, str, str]  # an entry whose use protects a unit: (id, kind, key)


class Look(NamedTuple):  # (a tuple: 100,000s are pickled for worker processes)
    """A unit to look at and take: all of its entries, or none of them."""

    entries: tuple[Planned, ...]
    watch: tuple[Watched, ...] = ()


@dataclass(slots=True)
class Took:
    """A unit whose files left the cache: into the trash (`trashed`, reversible) or deleted."""

    sizes: list[tuple[int, int]]  # (bytes, files) of each entry as it was taken; (0, 0): gone already
    trashed: list[tuple[str, str]] = field(default_factory=list)  # (key, name in the looker's bin)
    deleted: bool = False
    bin: int = 0  # the bin (the looker) its trashed names are in


@dataclass(slots=True)
class _Files:
    """One entry's files as they are now (summed as they are seen: a kernel folder may hold
    200,000), or a reason to keep it."""

    newest: float = 0.0  # the latest access or write of any of them
    nbytes: int = 0
    nfiles: int = 0
    move: list[tuple[str, safefs.Identity]] = field(default_factory=list)  # what goes: files, or a kernel dir whole
    problem: Held | None = None
    inodes: frozenset[int] | None = None  # of the files in a directory moved whole, as looked at

    def add(self, st: os.stat_result) -> None:
        # (not ctime: a scan's own reads link each entry they read (describe.read_unseen), and a
        # copy that keeps its times is in use only once read, which moves its atime past the
        # copy's ctime even on a relatime mount)
        self.newest = max(self.newest, st.st_atime, st.st_mtime)
        self.nbytes += st.st_size
        self.nfiles += 1

    @property
    def size(self) -> tuple[int, int]:
        return self.nbytes, self.nfiles


def lock_is_held(root: safefs.Root, key: str) -> bool:
    """Is a filelock (flock-based, as Inductor's torch.utils._filelock) held on `key` now?"""
    try:
        parent, name = safefs.split(layout.fs_path(key))
    except safefs.Refused:  # a ref of an edited index no file can be named after (a NUL, a '..'):
        return False  # no lock is held on it (it stopped the whole eviction, as an unsafe path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root.dir_fd(parent))
    except FileNotFoundError:
        return False
    except OSError as e:  # a name too long to exist (a 250-character entry's .lock) is no lock; else
        return e.errno != errno.ENAMETOOLONG  # cannot tell: treat it as held
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


def remove_quietly(dir_fd: int | None, names: Sequence[str]) -> None:
    if dir_fd is None:
        return
    for name in names:
        try:
            safefs.remove_at(dir_fd, name)
        except OSError:
            pass


class Looker:
    """Looks at units under an open root and moves what may go into the trash: into `trash`, the
    descriptor of its own bin there, number `bin` (None: delete in place). `code_stems`: the stems
    of the plan's code entries, by <2ch> folder (each folder is listed once, and only their names
    kept)."""

    def __init__(
        self, root: safefs.Root, trash: int | None, code_stems: dict[str, set[str]], cutoff: float, bin: int = 0
    ) -> None:
        self.root, self.trash, self.code_stems, self.bin = root, trash, code_stems, bin
        self.cutoff = cutoff  # what was written or read after it stays (now less the grace period)
        self.folders: dict[str, dict[str, list[str]]] = {}  # <2ch> folder -> planned stem -> names
        self.locks = self._lock_names()
        self.mounts = safefs.mounts_below(root)  # (nothing at, below or above one is moved or deleted)
        self._names = itertools.count()

    def look_and_take(
        self, looks: Sequence[Look], fresh: dict[int, float], dry_run: bool
    ) -> list[Took | str | Exception]:
        """Each unit as it is now, moved out of the cache unless it must stay (then the reason).
        A failure ends the list: what moved before it is still returned, and the failure last."""
        out: list[Took | str | Exception] = []
        for u in looks:
            try:
                out.append(self._look_and_take(u, fresh, dry_run))
            except Exception as e:  # noqa: BLE001 - raised by the caller once every move is accounted for
                out.append(e)
                break
        return out

    def _look_and_take(self, u: Look, fresh: dict[int, float], dry_run: bool) -> Took | str:
        files = [self.files_of(kind, key) for _, kind, key, _ in u.entries]
        why = self._keep(u, files, fresh)
        if why is None and not any(f.nfiles for f in files):
            why = Held.GONE  # another process deleted it first: nothing of ours to count
        if why:
            return why
        took = Took([f.size for f in files], bin=self.bin)
        if not dry_run:
            why = self.take(took, files)
            if why:
                return why
        return took

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

    def _keep(self, u: Look, files: list[_Files], fresh: dict[int, float]) -> str | None:
        cutoff = self.cutoff
        for (eid, kind, key, ref), f in zip(u.entries, files, strict=True):
            if f.problem:
                return f.problem
            if f.newest > cutoff or fresh.get(eid, 0.0) > cutoff:
                return Held.GRACE
            for lock in self._guarding_locks(kind, key, ref):
                if lock_is_held(self.root, lock):
                    return Held.LOCK
        for wid, kind, key in u.watch:  # the graph that bundles a module/kernel was just used: it is about to load it
            if fresh.get(wid, 0.0) > cutoff or self.files_of(kind, key).newest > cutoff:
                return Held.GRACE
        return None

    def _stem_names(self, folder: str, stem: str) -> list[str]:
        """Names in a <2ch>/ folder that belong to code entry `stem`: the folder is listed once per
        run, and only the planned entries' names kept (each given out once), so each entry costs
        its own files, not the whole folder, and the run holds no listing of the cache."""
        by_stem = self.folders.get(folder)
        if by_stem is None:  # two threads may both list it: each gives out its own, the same names
            wanted = self.code_stems.get(folder, set())
            by_stem = {}
            names = self.root.listdir(layout.fs_path(folder))  # (OSError: files_of keeps the entry)
            for n in names:
                n = layout.key_of(n)
                s = n.partition(".")[0]
                if s in wanted and layout.is_code_file(f"{folder}/{s}", n):
                    by_stem.setdefault(s, []).append(n)
            self.folders[folder] = by_stem  # published whole: other threads read it as they find it
        return by_stem.pop(stem, [])

    def files_of(self, kind: str, key: str) -> _Files:
        f = _Files()
        if self.mounts and safefs.at_or_above_a_mount(layout.fs_path(key), self.mounts):
            f.problem = Held.MOUNTED
            return f
        try:
            if kind == Kind.TRITON:
                return self._kernel_files(key)
            if kind == Kind.CODE:
                folder, stem = key.split("/", 1)
                rels = [f"{folder}/{n}" for n in self._stem_names(folder, stem)]
                if self.mounts and any(layout.fs_path(rel) in self.mounts for rel in rels):
                    f.problem = Held.MOUNTED  # (a file mounted on one of its files)
                    return f
            else:
                rels = [key]
            for rel in rels:
                parent, name = safefs.split(layout.fs_path(rel))
                pfd = self.root.dir_fd(parent)  # (its folder gone: moved away meanwhile, below)
                try:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # the file alone is gone: deleted by another process
                if stat.S_ISREG(st.st_mode):  # a symlink stays, and so does what it points at
                    f.add(st)
                    f.move.append((rel, safefs.identity(st)))
        except safefs.Refused:
            f.problem = Held.UNSAFE
        except FileNotFoundError:  # a folder on its way moved away meanwhile (and may come back): it
            f.problem = Held.CHANGED  # stays, and keeps its unit whole; a scan drops it if it is gone
        except OSError as e:
            f.problem = Held.UNSAFE if e.errno in (errno.ELOOP, errno.ENOTDIR) else Held.FAILED
        return f

    def _kernel_files(self, key: str) -> _Files:
        """A Triton kernel directory, moved whole: it must be a real directory holding only
        finished regular files (a temporary file: a write in progress; a symlink: refused)."""
        f = _Files()
        parent, name = safefs.split(layout.fs_path(key))
        pfd = self.root.dir_fd(parent)  # (its folder gone: files_of keeps it, changed)
        try:  # O_NOFOLLOW | O_DIRECTORY: a symlink (ELOOP) or a file (ENOTDIR) is refused by files_of
            fd = os.open(name, safefs.O_DIR, dir_fd=pfd)
        except FileNotFoundError:
            return f
        inodes = set()
        newest, nbytes, nfiles = f.newest, 0, 0
        try:
            st = os.fstat(fd)
            with os.scandir(fd) as it:
                for d in it:  # (_Files.add inlined: this loop runs once per kernel file)
                    s = d.stat(follow_symlinks=False)
                    if layout.is_transient(d.name):
                        f.problem = Held.IN_PROGRESS
                        return f
                    if not stat.S_ISREG(s.st_mode):
                        f.problem = Held.UNSAFE
                        return f
                    if s.st_atime > newest:
                        newest = s.st_atime
                    if s.st_mtime > newest:
                        newest = s.st_mtime
                    nbytes += s.st_size
                    nfiles += 1  # (not len(inodes): two links to one file are two files)
                    inodes.add(s.st_ino)
        finally:
            os.close(fd)
        f.newest, f.nbytes, f.nfiles = newest, nbytes, nfiles
        f.move = [(key, safefs.identity(st))]
        f.inodes = frozenset(inodes)
        return f

    def _same_files(self, name: str, inodes: frozenset[int]) -> bool:
        """Does directory `name` in the trash hold exactly the files that were looked at? A file
        written into a kernel directory between the look and the move (a new kernel file, a write
        in progress) must not go with it."""
        try:
            fd = os.open(name, safefs.O_DIR, dir_fd=self.trash)
        except OSError:
            return False
        try:
            with os.scandir(fd) as it:
                return {d.inode() for d in it} == inodes
        finally:
            os.close(fd)

    # -- moving ---------------------------------------------------------------------------------

    def take(self, took: Took, files: list[_Files]) -> Held | None:
        """Move a unit's files into the trash, or delete them in place where the trash cannot take
        them. On a refusal, what was moved goes back and the unit is kept."""
        for f in files:
            for key, ident in f.move:
                try:
                    if self.trash is not None:
                        name = f"{os.getpid()}-{next(self._names)}"
                        try:
                            self.root.move(layout.fs_path(key), ident, self.trash, name)
                            if f.inodes is not None and not self._same_files(name, f.inodes):
                                put_back(self.root, self.trash, key, name)
                                raise safefs.Refused("written to since it was looked at", key)
                            took.trashed.append((key, name))
                            continue
                        except OSError as e:
                            if isinstance(e, safefs.Refused) or e.errno not in NO_ROOM:
                                raise
                    self.root.delete(layout.fs_path(key), ident, f.inodes)
                    took.deleted = True
                except FileNotFoundError:
                    continue  # gone meanwhile
                except OSError as e:
                    why = (
                        Held.CHANGED
                        if isinstance(e, safefs.Refused)
                        else Held.MOUNTED
                        if e.errno in (errno.EXDEV, errno.EBUSY)  # (mounted since the look; EBUSY: a mount point)
                        else (Held.UNSAFE if e.errno in (errno.ELOOP, errno.ENOTDIR) else Held.FAILED)
                    )
                    if took.deleted:  # part of it is gone already: the rest goes in the commit's repair
                        return None
                    restore(self.root, self.trash, took)
                    return why
        return None


def restore(root: safefs.Root, trash: int | None, took: Took) -> None:
    """Put back what a unit moved into the trash (`trash`: the descriptor of its bin)."""
    if trash is not None:
        for key, name in reversed(took.trashed):
            put_back(root, trash, key, name)
    took.trashed = []


def put_back(root: safefs.Root, trash: int, key: str, name: str) -> None:
    parent, base = safefs.split(layout.fs_path(key))
    try:
        safefs.rename_back(trash, name, root.dir_fd(parent), base)
    except OSError:
        pass  # its place was taken meanwhile: it stays in the trash, the next scan drops its row


# -- the trash's bins -----------------------------------------------------------------------------

BIN_PREFIX = "bin."


@dataclass(frozen=True)
class Bin:
    """A looker's own folder in the trash. Every rename into a folder and every unlink from it
    holds that folder's lock in the kernel: two worker processes moving into one trash folder
    were no faster than one (20,000 files and 2,800 kernel folders each: 1.9-2.1 s; in a bin
    each: 1.3-1.4 s)."""

    name: str
    fd: int
    id: safefs.Identity


def make_bins(trash: int, n: int) -> list[Bin]:
    """`n` new bins in the trash (descriptor `trash`). Where no folder can be made there (a full
    disk, a quota: a rename into a folder that has held names needs no new block), a looker's bin
    is the trash itself ('.')."""
    out: list[Bin] = []
    names = (f"{BIN_PREFIX}{os.getpid()}.{i}" for i in itertools.count())
    try:
        while len(out) < n:
            name = next(names)
            try:
                os.mkdir(name, 0o700, dir_fd=trash)
            except FileExistsError:
                continue  # a dead run's of the same pid that could not be emptied
            except OSError as e:
                if e.errno in safefs.SHORT:
                    raise
                name = "."
            try:
                fd = os.open(name, safefs.O_DIR, dir_fd=trash)
            except BaseException:
                if name != ".":
                    remove_quietly(trash, [name])
                raise
            out.append(Bin(name, fd, safefs.identity(os.fstat(fd))))
    except BaseException:
        close_bins(trash, out)
        raise
    return out


def close_bins(trash: int, bins: Sequence[Bin]) -> None:
    """Close the bins, and remove those that are empty (what is left in one: the next run's)."""
    for b in bins:
        os.close(b.fd)
        if b.name != ".":
            try:
                os.rmdir(b.name, dir_fd=trash)
            except OSError:
                pass


def _ours(st: os.stat_result) -> bool:
    """A folder of this user's that no one else may write to: nothing in it was put there by
    another user (a folder can only be moved in by one who may write to it)."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def empty_trash(trash: int, mounts: frozenset[str]) -> None:
    """Remove what dead runs left in the trash: their bins, with the files and kernel folders they
    moved (each of those emptied one level: a folder put into a kernel folder since stays), names
    older versions moved straight into the trash, links of readers that died. A folder is
    emptied only if no other user can have put it there: a bin of ours, or anything in a trash of
    ours (another user's `.cachemgr-trash`, or a folder of theirs named like a bin, could hold
    what they may not delete themselves). Nothing at or above a mount."""
    trusted = _ours(os.fstat(trash))
    for name in os.listdir(trash):
        at = f"{layout.TRASH_DIR}/{name}"
        if mounts and safefs.at_or_above_a_mount(at, mounts):
            continue
        try:
            fd = os.open(name, safefs.O_DIR, dir_fd=trash)
        except OSError:
            remove_quietly(trash, [name])  # not a folder (a file, a link): only its name goes
            continue
        try:
            st = os.fstat(fd)
            if name.startswith(BIN_PREFIX) and _ours(st):
                for inner in os.listdir(fd):
                    if not (mounts and safefs.at_or_above_a_mount(f"{at}/{inner}", mounts)):
                        remove_quietly(fd, [inner])
            elif not trusted:
                continue  # another user's folder in their trash: not ours to empty
        finally:
            os.close(fd)
        remove_quietly(trash, [name])


# -- where the looks run --------------------------------------------------------------------------


class Lookers:
    """Looks and unlinks run beside the caller: in a thread each (`processes` 0: `looker` does
    them), or in that many worker processes, each with a Looker of its own made like `looker`,
    moving into bin number i of `bins` in the trash (`trash`: its identity; None: no trash)."""

    def __init__(
        self,
        looker: Looker,
        processes: int = 0,
        trash: safefs.Identity | None = None,
        bins: Sequence[Bin] = (),
    ) -> None:
        self.looker, self.bins = looker, bins
        self.workers: list[_Process] = []
        self.threads: list[ThreadPoolExecutor] = []
        if processes:
            root = looker.root
            given: list[Bin | None] = [*bins, *[None] * (processes - len(bins))]  # (none: no trash, in place)
            starts = [
                (
                    os.getpid(),
                    root.path,
                    root.id,
                    None if b is None or trash is None else (trash, b.name, b.id),
                    looker.code_stems,
                    looker.cutoff,
                    i,
                )
                for i, b in enumerate(given)
            ]
            # all spawned before any is sent its start: they boot side by side (the start is
            # larger than a pipe holds, so each send waits until that worker has booted and reads)
            try:
                while len(self.workers) < processes:
                    self.workers.append(_Process())
            except BaseException:  # (no more processes or descriptors): those spawned end before we raise
                for w in self.workers:
                    w.end_unstarted()
                raise
            for w, start in zip(self.workers, starts, strict=True):
                w.start(start)
        else:
            self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"cachemgr-{n}") for n in ("look", "unlink")]

    def look(self, looks: Sequence[Look], fresh: dict[int, float], dry_run: bool) -> Future:
        """Look at (and take) these units; the Future's result is `Looker.look_and_take`'s."""
        if self.workers:
            return self._worker().submit((LOOK, looks, fresh, dry_run))
        return self.threads[0].submit(self.looker.look_and_take, looks, fresh, dry_run)

    def unlink(self, taken: Sequence[Took]) -> None:
        """Empty what these units moved out of the trash, in the background, each bin by its own
        looker (a failure leaves a name to the next run, which empties the trash first)."""
        by_bin: dict[int, list[str]] = {}
        for t in taken:
            if t.trashed:
                by_bin.setdefault(t.bin, []).extend(name for _, name in t.trashed)
        for b, names in by_bin.items():
            if not self.workers:
                self.threads[1].submit(remove_quietly, self.looker.trash, names)
            elif self.workers[b].ended is not None:  # it died (the run stops at its next look, or
                remove_quietly(self.bins[b].fd, names)  # at its end): its bin is emptied here
            else:
                self.workers[b].submit((UNLINK, names))  # (if it dies first, the next run empties it)

    def _worker(self) -> _Process:
        """The least loaded worker, or one that has died: a run stops at its first dead worker
        (the job sent to it fails at once), whatever the others could still do."""
        return min(self.workers, key=_Process.load)

    def close(self) -> None:
        """Wait for what was handed out (looks and unlinks) to finish, and stop the workers."""
        for w in self.workers:
            w.close()
        for t in self.threads:
            t.shutdown(wait=True)

    @property
    def died(self) -> str | None:
        """How a worker process that ended before it was told to (killed, out of memory) ended.
        Its last jobs may all have been answered (it was idle; the rest went to its bin's
        neighbours): a death is reported all the same."""
        return next((w.ended for w in self.workers if w.ended is not None and w.code != 0), None)


LOOK, UNLINK = "look", "unlink"


class _Process:
    """One worker process (`python -m cachemgr.evict.look`: a plain command, so no caller's
    `__main__` is imported again), fed jobs on its stdin in the index workers' protocol. Each job
    has a Future, answered in order by a reader thread; a job sent is never cancelled (what it
    moves must be accounted for), and a worker that dies fails every job it held, and every job
    sent to it after (it is chosen first: the run stops at the first failed job)."""

    def __init__(self) -> None:
        import threading

        self.proc, self.stdin, self.stdout = procs.spawn_module("cachemgr.evict.look")
        self.jobs: deque[Future] = deque()
        self.ended: str | None = None  # set by the reader once the worker is gone: no job may wait on it
        self.code: int | None = None  # its exit status, once ended (negative: the signal)
        self.lock = threading.Lock()  # (a job is queued before, or refused after, the reader's last drain)
        self.reader = threading.Thread(target=self._read, name="cachemgr-look-reader", daemon=True)

    def start(self, start: tuple) -> None:
        """Send the worker what it opens (its first message), and read its answers from now on."""
        try:
            send(self.stdin, start)
        except OSError:
            pass  # it died booting: the reader finds it gone and fails its jobs
        self.reader.start()

    def end_unstarted(self) -> None:
        """A worker never sent its start: EOF instead, and it exits."""
        self.stdin.close()
        self.proc.wait()
        self.stdout.close()

    def load(self) -> int:
        return len(self.jobs) if self.ended is None else -1  # (a dead worker is chosen first, so the run stops)

    def submit(self, job: tuple) -> Future:
        f: Future = Future()
        f.set_running_or_notify_cancel()  # cannot be cancelled: the worker has it
        with self.lock:
            if self.ended is not None:  # its reader is done: nothing would ever answer this job
                f.set_exception(WorkerDied(self.ended))
                return f
            self.jobs.append(f)
        try:
            send(self.stdin, job)
        except OSError:
            pass  # it died: the reader fails this job with the others
        return f

    def _read(self) -> None:
        try:
            while True:
                ok, value = cast(tuple, receive(self.stdout))
                f = self.jobs.popleft()
                if ok:
                    f.set_result(value)
                else:
                    f.set_exception(value)
        except Exception:  # noqa: BLE001 - EOF (it died), or an answer that cannot be read: it is done for
            self.proc.kill()
        code = self.proc.wait()
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        with self.lock:
            self.code = code
            self.ended = f"an eviction worker process ended ({why})"
            held, self.jobs = self.jobs, deque()
        for f in held:
            f.set_exception(WorkerDied(self.ended))

    def close(self) -> None:
        try:
            self.stdin.close()  # EOF: it finishes what it has, then exits
        except OSError:
            pass
        self.reader.join()
        self.stdout.close()


class WorkerDied(CachemgrError):
    """An eviction worker process ended while it held work (killed, out of memory): the run
    stops; what it had moved into the trash is emptied by the next run, its rows by the next scan."""


# -- a worker process's side ------------------------------------------------------------------------


def _start(
    parent: int,
    path: str,
    root_id: safefs.Identity,
    bin: tuple[safefs.Identity, str, safefs.Identity] | None,
    code_stems: dict[str, set[str]],
    cutoff: float,
    number: int,
) -> Looker:
    """Open the root, the trash and the bin in it the evicting process holds and made (the very
    same directories): `bin` is (the trash's identity, the bin's name, the bin's identity)."""
    try:
        root = safefs.Root(path)
    except OSError as e:
        if e.errno in safefs.SHORT:
            raise  # (short of descriptors: exit 1, as anywhere)
        raise safefs.Refused(f"the cache directory cannot be opened again ({e.strerror})", path) from e
    if root.id != root_id:
        raise safefs.Refused("the cache directory was replaced during eviction", path)
    fd = None
    if bin is not None:
        trash_id, name, bin_id = bin
        trash = _open_same(root.fd, layout.TRASH_DIR, trash_id, "the trash folder")
        try:
            fd = _open_same(trash, name, bin_id, "the trash folder's bin", f"{layout.TRASH_DIR}/{name}")
        finally:
            os.close(trash)  # (only its bin is used)
    return Looker(root, fd, code_stems, cutoff, number)


def _open_same(dir_fd: int, name: str, want: safefs.Identity, what: str, path: str | None = None) -> int:
    """Directory `name` in `dir_fd`, if it is the very one (`want`) the evicting process made
    (else `what`, at `path` in the root, was replaced)."""
    try:
        fd = os.open(name, safefs.O_DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in safefs.SHORT:
            raise  # (short of descriptors: exit 1, as anywhere)
        raise safefs.Refused(f"{what} was replaced during eviction", path or name) from e
    if safefs.identity(os.fstat(fd)) != want:
        os.close(fd)
        raise safefs.Refused(f"{what} was replaced during eviction", path or name)
    return fd


def main() -> None:
    import pickle

    procs.die_with_parent_from_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the evicting process handles Ctrl-C and waits for us
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    looker: Looker | None = None
    refused: Exception | None = None
    try:
        looker = _start(*cast(tuple, receive(stdin)))
    except EOFError:
        return  # never started: the parent is gone, or ended us before it began
    except OSError as e:
        refused = e
    while True:
        try:
            kind, *args = cast(tuple, receive(stdin))
        except EOFError:
            return
        answer: tuple[bool, object]
        try:
            if looker is None:
                raise refused or RuntimeError("the eviction worker did not start")
            if kind == LOOK:
                answer = True, looker.look_and_take(*args)
            else:
                remove_quietly(looker.trash, *args)
                answer = True, None
        except Exception as e:  # noqa: BLE001 - raised by the caller
            answer = False, e
        try:
            send(stdout, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle: its text
            send(stdout, (False, RuntimeError(repr(answer[1]))))


if __name__ == "__main__":  # run as the module itself, so what it sends back names cachemgr.evict.look's classes
    from cachemgr.evict import look

    look.main()
