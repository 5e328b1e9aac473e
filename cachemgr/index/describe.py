"""Read new and changed entries into index row values: the CPU-heavy half of a scan.

Kept free of SQLAlchemy: the parse workers (cachemgr.index.workers) run this and start in
milliseconds. Files are read through `safefs` (regular files only, sizes checked first), and
every problem with one entry becomes its `corrupt` reason. Hash components come back already
split into parts with their digests; a describer sends a part's items only the first time in a
run it meets its digest, since hundreds of graphs share one options part.
"""

from __future__ import annotations

import gc
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from cachemgr import layout, parse, safefs
from cachemgr.index.workers import BATCH, WALK, WALK_READ, Job, Pool
from cachemgr.vocab import PICKLED, Kind

MAX_SMALL_FILE = 16 << 20  # an autotune result or a C++ source read for its hash (the real ones are KBs)

Parts = dict[str, tuple[str, list[parse.Component] | None]]  # part -> (digest, items or None if sent before)


READ_WITH_WALK = frozenset({Kind.AUTOTUNE})  # read by a first fill's walk, not in phase two: not pickles
READ_WITH_WALK_BYTES = 64 << 10  # larger ones (none real: a few hundred bytes) are left to phase two's workers


@dataclass(slots=True)
class Described:
    row: dict
    refs: list[tuple[str, str]]
    parts: Parts


def unreadable(e: Exception) -> Described:
    """An entry whose reading raised `e`: corrupt, saying why."""
    if isinstance(e, MemoryError):  # (its message is empty)
        from cachemgr.index.workers import failure

        return failed(f"cannot be read: {failure('MemoryError')}")
    return failed(parse.clean(f"cannot be read: {type(e).__name__}: {e}", 300))


def failed(why: str) -> Described:
    return Described({"alias": None, "corrupt": why}, [], {})


class Describer:
    """Describes entries of one root at a time; remembers which component sets it sent this run."""

    def __init__(self) -> None:
        self.sent: set[str] = set()
        self.run: int | None = None
        self.root: safefs.Root | None = None

    def run_job(self, job: Job) -> object:
        """A worker's answer to one job: a Described, a list of them (BATCH), or what a WALK saw:
        (listings, DirWalk), with WALK_READ (listings, DirWalk, refs read: see `read_with_walk`);
        or None when the root is not the one the caller opened."""
        if job.kind in (WALK, WALK_READ):
            root = self._open(job)
            if isinstance(root, str):
                return None
            try:
                listings, seen = layout.walk_units(root, list(job.items))
                return (listings, seen) if job.kind == WALK else (listings, seen, self.read_with_walk(root, listings))
            finally:
                root.forget()
        if job.kind == BATCH:
            out = []
            for kind, key, ref in job.items:
                out.append(self.describe_job(Job(job.id, job.run, job.root, kind, key, ref, (), job.root_id)))
                if kind in PICKLED:  # (the worker's collector is off: a graph's cycles never weigh on the next's bound)
                    gc.collect(0)
            return out
        return self.describe_job(job)

    def _open(self, job: Job) -> safefs.Root | str:
        """The job's root, opened (kept across jobs); or why not, if it cannot be or is not the same
        directory the caller opened (renamed or swapped since)."""
        if job.run != self.run:
            self.run, self.sent = job.run, set()
        if self.root is None or self.root.path != job.root:
            if self.root is not None:
                self.root.close()
            try:
                self.root = safefs.Root(job.root)
            except OSError as e:
                self.root = None
                return f"unreadable: {e.strerror}"
        if job.root_id is not None and self.root.id != job.root_id:
            self.root.close()
            self.root = None
            return "the cache directory was replaced during the scan"
        return self.root

    def read_with_walk(self, root: safefs.Root, listings: list[layout.Listing]) -> dict[str, list[tuple[str, str]]]:
        """The references of the entries of `listings` whose files are plain data of a few KB
        (READ_WITH_WALK: autotune results, JSON), by key: read beside the walk of a first fill,
        which writes them with their rows. At a million files they are 84 % of the entries phase
        two would read, at a cost per entry there of several times the read. An entry that does
        not read cleanly, or is larger than any real one, is left out: phase two reads it (in a
        worker, under its bounds) and reports it."""
        out = {}
        for listing in listings:
            for e in listing.entries:
                if e.kind in READ_WITH_WALK and e.bytes <= READ_WITH_WALK_BYTES:
                    try:
                        d = self.describe(root, e.kind, e.key, e.ref)
                    except Exception:  # noqa: BLE001 - left to phase two, which says what it is
                        continue
                    if not d.row.get("corrupt"):
                        out[e.key] = d.refs
        return out

    def describe_job(self, job: Job) -> Described:
        root = self._open(job)
        if isinstance(root, str):
            return failed(root)
        try:
            return self.describe(root, job.kind, job.key, job.ref)
        except Exception as e:  # noqa: BLE001 - one entry's problem is that entry's, never the scan's
            return unreadable(e)
        finally:
            root.forget()  # directories may be replaced before the next job: no stale descriptors

    def describe(self, root: safefs.Root, kind: str, key: str, ref: str | None) -> Described:
        """Row values, references and hash components of one entry, read from its files."""
        row: dict = {"alias": None}
        p: parse.Parsed | None = None
        refs: list[tuple[str, str]] = []
        try:
            if kind == Kind.FXGRAPH:
                p = parse.parse_fxgraph(read_unseen(root, layout.fs_path(key), parse.MAX_ENTRY_BYTES), graph_key=ref)
            elif kind == Kind.AOTAUTOGRAD:
                p = parse.parse_aotautograd(read_unseen(root, layout.fs_path(key), parse.MAX_ENTRY_BYTES))
            elif kind == Kind.PRECOMPILE:
                p = parse.parse_precompile(root.read(layout.fs_path(key), parse.MAX_ENTRY_BYTES))
            elif kind == Kind.AUTOTUNE:
                refs = parse.autotune_refs(root.read(layout.fs_path(key), MAX_SMALL_FILE))
            elif kind == Kind.CODE:
                row["alias"] = _kernel_source_ref(root, key)
        except safefs.Refused as e:
            row["corrupt"] = e.why
        except OSError as e:
            row["corrupt"] = f"unreadable: {e.strerror}"
        parts: Parts = {}
        if p is not None:
            refs = p.refs
            row.update(
                graph_key=p.graph_key if kind == Kind.FXGRAPH else None,
                signature=p.signature,
                signature_hash=p.signature_hash,
                options_hash=p.options_hash,
                guards=p.guards,
                device_types=p.device_types,
                compile_seconds=p.compile_seconds,
                torch_version=p.torch_version,
                torch_version_hash=p.torch_version_hash,
                system_hash=p.system_hash,
                corrupt=p.corrupt,
                unrecorded=", ".join(p.missing) or None,
            )
            for part, (digest, items) in p.parts.items():
                parts[part] = (digest, None if digest in self.sent else items)
                self.sent.add(digest)
        return Described(row, refs, parts)


def _kernel_source_ref(root: safefs.Root, key: str) -> str | None:
    """The C++ source of a kernel module names the kernel's own hash (its alias)."""
    for name in layout.kernel_sources(key):
        try:
            source = root.read(layout.fs_path(name), MAX_SMALL_FILE)
        except FileNotFoundError:
            continue
        return parse.cpp_source_ref(source.decode("utf-8", "replace"))
    return None


def prepare_unseen_reads(root: str) -> None:
    """Make the trash folder that read_unseen links through, before a walk records the root's
    mtime (made later, it would change that mtime and no rescan could trust the root again).
    Only in a root that holds entries to read (an fxgraph or aotautograd folder): a directory
    that is no Inductor cache gets nothing. Where it cannot be made, reads are plain reads."""
    try:
        with safefs.Root(root) as r:
            if any(
                stat.S_ISDIR(os.stat(d, dir_fd=r.fd, follow_symlinks=False).st_mode)
                for d in os.listdir(r.fd)
                if d in layout.HIT_FOLDERS
            ):
                os.mkdir(layout.TRASH_DIR, 0o700, dir_fd=r.fd)
    except OSError:  # there already (the usual case), a read-only or full file system, a root that will not open
        pass


def read_unseen(r: safefs.Root, path: str, limit: int) -> bytes:
    """Read an entry file as no workload does: through a hard link in cachemgr's trash folder.

    A running daemon counts a read of an fxgraph or AOT entry as a cache hit when the file is
    opened in its own directory (the read watch is on that directory, and the trash is never
    watched). Every read of cachemgr's own (a scan's, a daemon's, `remote push`'s) goes this way,
    so none is a hit, whichever process makes it. A plain read where no link can be made (a
    read-only or full file system, no trash folder possible): that one may count as a hit."""
    parent, name = safefs.split(path)
    link = f"read-{os.getpid()}-{threading.get_ident()}"
    try:
        try:
            trash = r.dir_fd(layout.TRASH_DIR)
        except FileNotFoundError:
            os.mkdir(layout.TRASH_DIR, 0o700, dir_fd=r.fd)
            trash = r.dir_fd(layout.TRASH_DIR)
        try:
            os.link(name, link, src_dir_fd=r.dir_fd(parent), dst_dir_fd=trash, follow_symlinks=False)
        except FileExistsError:  # left by a killed reader of the same pid and thread id
            os.unlink(link, dir_fd=trash)
            os.link(name, link, src_dir_fd=r.dir_fd(parent), dst_dir_fd=trash, follow_symlinks=False)
    except OSError:  # the entry is gone, the trash cannot be made, another file system: the plain read says
        return r.read(path, limit)
    try:
        return r.read(f"{layout.TRASH_DIR}/{link}", limit)
    except FileNotFoundError:  # an eviction emptied the trash under us
        return r.read(path, limit)
    finally:
        try:
            os.unlink(link, dir_fd=trash)
        except FileNotFoundError:
            pass


_runs = iter(range(1, 1 << 62))


def new_run() -> int:
    """A run id: a describer sends each component set's items once per run."""
    return next(_runs)


def describe_all(
    root: str,
    entries: list[layout.DiskEntry],
    progress: Callable[[int, int], None] | None = None,
    pool: Pool | None = None,
) -> dict[str, Described]:
    """Describe every entry: fxgraph and AOTAutograd pickles in parse worker processes (`pool`,
    or workers started for this call), the small rest here, meanwhile."""
    out: dict[str, Described] = {}

    def done(key: str, described: Described) -> None:
        out[key] = described
        if progress:
            progress(len(out), len(entries))

    heavy = [d for d in entries if d.kind in PICKLED]
    run = next(_runs)
    jobs = [Job(i, run, root, d.kind, d.key, d.ref) for i, d in enumerate(heavy)]
    own = pool is None
    if pool is None:
        pool = Pool(min(max(1, len(heavy) // 8), Pool().size))
    results = pool.run(jobs, lambda job, why: failed(why))
    try:
        light = [d for d in entries if d.kind not in PICKLED]
        if light:
            describer = Describer()
            try:
                with safefs.Root(root) as r:
                    for d in light:
                        try:
                            done(d.key, describer.describe(r, d.kind, d.key, d.ref))
                        except Exception as e:  # noqa: BLE001 - never the scan's problem
                            done(d.key, unreadable(e))
            except OSError as e:
                for d in light:
                    done(d.key, failed(f"unreadable: {e.strerror}"))
        for job, described in results:
            # (a worker's answer to a job of one entry is a Described: Describer.run_job)
            done(job.key, cast(Described, described))
    finally:
        results.close()  # nothing left running if we got here by an exception
        if own:
            pool.close()
    return out
