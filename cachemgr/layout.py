"""TorchInductor's cache directory layout: the only module that knows its paths.

An *entry* is the unit cachemgr indexes and evicts:

| kind        | entry key (relative to the root)   | ref (what other entries name it by) |
| ----------- | ---------------------------------- | ----------------------------------- |
| fxgraph     | fxgraph/<2ch>/<graph key>/<file>   | graph key                           |
| aotautograd | aotautograd/<aot key>/<file>       | aot key                             |
| triton      | triton/<device>/<kernel hash>/     | kernel hash (a directory, whole)    |
| code        | <2ch>/c<hash>  (.py .cpp .so ...)  | c<hash> (module / source stem)      |
| autotune    | <2ch>/<sha256>.best_config         | sha256                              |
| lock        | locks/<name>.lock                  | name                                |
| precompile  | dynamo/<sha256>/entry              | sha256 (of the function's name)     |
| pgo         | dynamo/code_state_<job>.pkl        | file name (its lock: kind lock)     |
| tuning      | cache/... (benchmark timings)      | -                                   |
| other       | the file's own path                | -                                   |

Which torch writes which, and what each costs to lose, read off the wheels' own source:
docs/formats.md.

Names that start with '.' and names containing '.tmp' or starting with 'tmp.' are writes in
progress (Inductor's write_atomic, Triton's tmp.pid_* directories) or cachemgr's own trash: never
entries. Symlinks are never followed and never indexed; only regular files are.

Keys are text: a file name that is not UTF-8, holds a control character or a '%' is
percent-escaped in its key (`key_of`), and `fs_path` turns a key back into the name on disk.
"""

from __future__ import annotations

import errno
import operator
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes

from cachemgr import safefs
from cachemgr.vocab import Kind

KINDS = tuple(k.value for k in Kind)  # plain strings (click shows an enum by its name)
TRASH_DIR = ".cachemgr-trash"  # inside the root, same file system: rename there, then unlink
LOCKS_DIR = "locks"
HIT_FOLDERS = frozenset({"fxgraph", "aotautograd"})  # top folders of the entries whose reads are cache hits

_TWO_CHAR = re.compile(r"^[a-z0-9]{2}$")
_CODE_NAME = re.compile(r"^(c[a-z0-9]{20,})(\..+)$")
_AOT_KEY = re.compile(r"^a[a-z0-9]{51}$")
# The keys torch's artifact loader joins onto the root (a bundle's: import checks each), as
# Inductor makes them: what another name would write (fxgraph/-/, a dot folder) no scan indexes,
# no eviction takes, or makes eviction refuse the whole cache (foreign_root).
ARTIFACT_KEYS = {
    "inductor": re.compile(r"f[a-z0-9]{51}"),  # -> fxgraph/<key[1:3]>/<key>/
    "aot_autograd": re.compile(r"a[a-z0-9]{51}"),  # -> aotautograd/<key>/
    "autotune": re.compile(r"[a-z0-9]{2}/[A-Za-z0-9_]{1,200}\.best_config"),  # -> <2ch>/<hash>.best_config
    "precompile": re.compile(r"[A-Za-z0-9_-]{1,200}"),  # -> dynamo/<key> (a sha256's hex in torch 2.13)
    # -> dynamo/code_state_<key>.pkl, '/' and more replaced (a newline made a name of two lines)
    "pgo": re.compile(r"[^\x00-\x1f\x7f/\\]{1,200}"),
}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_DEVICE = re.compile(r"^\d{1,3}$")


# -- keys and names ---------------------------------------------------------------------------------


def key_of(rel: str) -> str:
    """The index key of a path relative to the root (as os functions give it: str, surrogate-
    escaped). Plain names are their own key; other characters become %XX of their bytes."""
    if rel.isprintable() and "%" not in rel:
        return rel
    out = []
    for ch in rel:
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:  # a byte that is not UTF-8 (os.fsdecode's surrogateescape)
            out.append(f"%{o - 0xDC00:02X}")
        elif ch == "%" or not ch.isprintable():
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
        else:
            out.append(ch)
    return "".join(out)


def fs_path(key: str) -> str:
    """The path on disk (relative to the root) that an index key names: key_of's inverse."""
    return os.fsdecode(unquote_to_bytes(key)) if "%" in key else key


def is_transient(name: str) -> bool:
    """A write in progress or cachemgr's own bookkeeping: never an entry, never deleted."""
    return name.startswith(".") or name.startswith("tmp.") or ".tmp" in name


# -- classifying ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Classified:
    kind: Kind
    key: str  # entry key, relative to the root, '/'-separated
    ref: str | None


def classify(key: str) -> Classified | None:
    """The entry a file belongs to, or None for transient files. `key` is a '/'-separated key."""
    parts = key.split("/")
    if any(is_transient(p) for p in parts) or not parts[-1]:
        return None
    top, n = parts[0], len(parts)
    if top == "fxgraph" and n == 4:
        return Classified(Kind.FXGRAPH, key, parts[2])
    if top == "aotautograd" and n == 3:
        return Classified(Kind.AOTAUTOGRAD, key, parts[1])
    if top == "triton" and n >= 4:
        return Classified(Kind.TRITON, "/".join(parts[:3]), parts[2])
    if top == LOCKS_DIR and n == 2:
        return Classified(Kind.LOCK, key, parts[1].removesuffix(".lock"))
    if top == "dynamo":
        if n == 3 and parts[2] == "entry" and _HEX64.match(parts[1]):
            return Classified(Kind.PRECOMPILE, key, parts[1])
        if n == 2 and parts[1].startswith("code_state_"):
            if parts[1].endswith(".lock"):
                return Classified(Kind.LOCK, key, parts[1].removesuffix(".lock"))
            return Classified(Kind.PGO, key, parts[1])
    if top == "cache" and n >= 2:
        return Classified(Kind.TUNING, key, None)
    if n == 2 and _TWO_CHAR.match(top):
        name = parts[1]
        if name.endswith(".best_config"):
            return Classified(Kind.AUTOTUNE, key, name.removesuffix(".best_config"))
        code = _CODE_NAME.match(name)
        if code:
            return Classified(Kind.CODE, f"{top}/{code.group(1)}", code.group(1))
    return Classified(Kind.OTHER, key, None)


def is_code_file(key: str, name: str) -> bool:
    """Is `name` (in the code entry's folder) one of code entry `key`'s files, as a walk files it
    (`classify`: 'c<hash>.' with nothing after the dot is another entry's, a temporary one none)?"""
    c = classify(f"{key.partition('/')[0]}/{name}")
    return c is not None and c.kind == Kind.CODE and c.key == key


def ref_of(key: str, kind: str) -> str | None:
    """An entry's ref read off its key (what `classify` gave it from its files' names)."""
    parts = key.split("/")
    if kind in (Kind.FXGRAPH, Kind.TRITON) and len(parts) >= 3:
        return parts[2]
    if len(parts) < 2:
        return None
    if kind in (Kind.AOTAUTOGRAD, Kind.CODE, Kind.PRECOMPILE, Kind.PGO):
        return parts[1]
    if kind == Kind.AUTOTUNE:
        return parts[1].removesuffix(".best_config")
    if kind == Kind.LOCK:
        return parts[-1].removesuffix(".lock")
    return None


def fxgraph_entry_key(graph_key: str, content: bytes) -> str:
    """The entry torch's loader writes for an fxgraph artifact (FxGraphCache._write_to_local_cache):
    the file under its graph's folder named by the lowercase base32 of its bytes' SHA-256."""
    import base64
    import hashlib

    name = base64.b32encode(hashlib.sha256(content).digest())[:51].decode().lower()
    return f"fxgraph/{graph_key[1:3]}/{graph_key}/{name}"


def home_dir(key: str, kind: str) -> str:
    """The directory whose listing holds an entry: a kernel directory is its own home."""
    return key if kind == Kind.TRITON else key.rpartition("/")[0]


# The C++ source a kernel module is built from (the kernel plus its Python binding): c<h>.main.cpp
# since torch 2.9, c<h>.cpp before (where 2.9+ writes a c<h>.cpp alone, it is a CPU-feature probe).
KERNEL_SOURCES = (".main.cpp", ".cpp")
READ_KINDS = frozenset({Kind.FXGRAPH, Kind.AOTAUTOGRAD, Kind.AUTOTUNE, Kind.PRECOMPILE})  # kinds whose files are read


def kernel_sources(code_key: str) -> list[str]:
    """The files that may hold a code entry's C++ kernel source, the one to read first."""
    return [code_key + suffix for suffix in KERNEL_SOURCES]


def is_kernel_dir(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "triton" and not any(is_transient(p) for p in parts)


MAX_PATHS = 1000  # file keys a DiskEntry keeps (its sums count every file)


@dataclass(slots=True)
class DiskEntry:
    """One entry as found on disk: its files and their summed sizes."""

    kind: Kind
    key: str
    ref: str | None
    bytes: int = 0
    files: int = 0
    mtime: float = 0.0
    atime: float = 0.0
    paths: list[str] = field(default_factory=list)  # keys of its regular files (if kept: MAX_PATHS at most)
    has_source: bool = False  # a code entry with a C++ kernel source: reading it names the kernel (alias)

    def __reduce__(self) -> tuple:
        # By position: a walk worker sends its parent 200,000 of these at a million files, and the
        # slots dataclass's own __getstate__/__setstate__ pickled them in twice the time (2.5 -> 1.4 s).
        fields = (self.kind, self.key, self.ref, self.bytes, self.files, self.mtime, self.atime, self.paths)
        return (DiskEntry, (*fields, self.has_source))

    @property
    def needs_reading(self) -> bool:
        """Is there more to learn from its files than their names (scan phase two)?"""
        return self.kind in READ_KINDS or self.has_source

    def add(self, key: str, st: os.stat_result, keep_path: bool = True) -> None:
        """Count one of its files (`key`, its lstat); keep its key too, up to MAX_PATHS of them."""
        self.count(st.st_size, 1, st.st_mtime, st.st_atime)
        if self.kind == Kind.CODE and key.endswith(".cpp"):
            self.has_source = True
        if keep_path and len(self.paths) < MAX_PATHS:
            self.paths.append(key)

    def count(self, nbytes: int, nfiles: int, mtime: float, atime: float) -> None:
        """Count `nfiles` of its files: their bytes, and their latest mtime and atime."""
        self.bytes += nbytes
        self.files += nfiles
        if mtime > self.mtime:
            self.mtime = mtime
        if atime > self.atime:
            self.atime = atime


# -- walking ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class DirWalk:
    """What a walk found: how many directories it listed, every directory's mtime, and (for
    `walk_dirs`) the entries of the listed directories."""

    entries: dict[str, DiskEntry]  # entry key -> entry, for entries whose home is a listed directory
    listed: int  # directories read (new or changed since `known`): their entries are all in `entries`
    mtimes: dict[str, int]  # every directory seen -> st_mtime_ns (RACY where it may still change unseen)
    unreadable: list[str] = field(default_factory=list)  # directories that could not be listed
    # A directory's mtime is recorded once everything below it is walked: a scan stopped midway
    # (killed) must leave a folder's old mtime, or the next one would trust it and never look
    # for the subfolders it had not reached. Those of containers whose subfolders went out as
    # units (`iter_dirs(units=...)`) are held here until the caller has walked them (`settle`).
    held: dict[str, int] = field(default_factory=dict)
    # Directories a subfolder of which vanished between their listing and its walk (moved away
    # and back leaves a folder's own mtime as it was), or that hold a mount point (mounting moves
    # no mtime either): recorded RACY, so the next walk lists them.
    lost: set[str] = field(default_factory=set)
    # Mount points inside the root (another file system, a bind mount of any folder) are not the
    # cache's, as for `find -xdev`: never walked, so nothing below one is indexed or counted
    # against the limits (eviction would never delete it, and took the rest of the cache instead).
    mounts: frozenset[str] | None = None  # those below the root, as keys: read once, at the walk's start
    mounted: list[str] = field(default_factory=list)  # those the walk met (recorded RACY: tried again)

    def settle(self) -> None:
        """The walk is whole: record the held mtimes, and RACY for every directory that lost one."""
        self.mtimes.update(self.held)
        self.held.clear()
        self.mtimes.update(dict.fromkeys(self.lost, RACY))
        self.lost.clear()


@dataclass(slots=True)
class Listing:
    """One directory read by `iter_dirs`: the entries whose home it is (complete)."""

    dir: str
    entries: list[DiskEntry]

    def __reduce__(self) -> tuple:
        return (Listing, (self.dir, self.entries))  # by position, as DiskEntry: unpickled in 4/5 the time


RACY = -1  # a directory mtime too recent (or a directory unreadable): the next walk reads it again
RACY_NS = 2_000_000_000  # file systems with coarse timestamps (1 s) can hide a change within this
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)  # not there, or not a real directory: nothing to walk
_NAME = operator.attrgetter("name")


def walk(root: str | safefs.Root, subtree: str = "") -> Iterator[DiskEntry]:
    """Every entry under `root` (or under `root/subtree`), grouped as `classify` groups files."""
    yield from walk_dirs(root, subtree).entries.values()


def walk_dirs(
    root: str | safefs.Root, subtree: str = "", known: dict[str, int] | None = None, keep_paths: bool = True
) -> DirWalk:
    """`iter_dirs`, collected: every entry of every directory read, in one DirWalk."""
    state = DirWalk({}, 0, {})
    for listing in iter_dirs(root, subtree, known, keep_paths, state):
        for e in listing.entries:
            state.entries[e.key] = e
    return state


def is_container(rel: str) -> bool:
    """A folder whose subfolders are walked as separate units (`iter_dirs(units=...)`): the root,
    and the folders that hold one folder per graph prefix, AOT key, device or Triton kernel."""
    return rel in ("", "fxgraph", "aotautograd", "triton") or (rel.startswith("triton/") and rel.count("/") == 1)


def iter_dirs(
    root: str | safefs.Root,
    subtree: str = "",
    known: dict[str, int] | None = None,
    keep_paths: bool = True,
    state: DirWalk | None = None,
    units: list[str] | None = None,
) -> Iterator[Listing]:
    """Walk `root` (or `root/subtree`), reading only directories whose mtime differs from `known`,
    and yield each directory read with the entries whose home it is. `state` collects every
    directory's mtime, the directories read and those that could not be.

    A directory's mtime moves whenever a name in it is created, removed or renamed, and Inductor
    and Triton only ever write by renaming a finished file into place: so a directory whose mtime
    is what it was when it was last read still holds the same entries, and is not read again (its
    known subdirectories are still checked). Every directory is opened relative to its parent's
    descriptor without following symlinks, and its mtime is read from that descriptor before it
    is listed, so a change made while it is listed moves its mtime past the one recorded. Files
    are lstat'ed through the same descriptor; anything but a regular file or a directory is
    passed over. A Triton kernel directory is one entry: yielded once its whole subtree is read,
    or not at all. A directory that cannot be listed is reported in `unreadable` and recorded as
    RACY, so it is tried again. Memory holds one directory's names per level, not the tree.

    With `units` (a list), the subfolders of containers (`is_container`: a kernel directory, a
    graph-prefix folder, a module folder...) are not read but appended to `units`, for the caller
    to walk apart (`iter_dirs(root, unit, ...)`, in other processes too): together they cover
    the tree exactly once. Directories are read in name order, so entries come in key order.
    """
    state = state if state is not None else DirWalk({}, 0, {})
    if isinstance(root, str):
        try:
            r = safefs.Root(root)
        except OSError as e:  # a root that is gone has no entries; one out of reach is unreadable
            if e.errno in safefs.SHORT:
                raise
            if e.errno not in _GONE:
                state.unreadable.append("")
            return
        with r:
            yield from iter_dirs(r, subtree, known, keep_paths, state)
        return
    known = known or {}
    children: dict[str, list[str]] = {}
    for d in known:
        if d and _plain(d):  # (a hand-edited row that names no directory is gone: the scan drops it)
            children.setdefault(d.rpartition("/")[0], []).append(d)
    sub = subtree.strip("/")
    if state.mounts is None:
        state.mounts = frozenset(key_of(m) for m in safefs.mounts_below(root))
    if state.mounts and safefs.at_or_below_a_mount(sub, state.mounts):
        if sub in state.mounts:
            yield from _mount_point(state, sub, None)
        return
    try:
        if sub:  # (opened through its folder, which stays open for the next unit: one open a unit)
            parent, name = safefs.split(fs_path(sub))
            fd = os.open(name, safefs.O_DIR, dir_fd=root.dir_fd(parent))
        else:
            fd = os.dup(root.fd)
    except OSError as e:
        if e.errno in safefs.SHORT:
            raise
        if e.errno not in _GONE:
            state.unreadable.append(sub)
            state.mtimes[sub] = RACY
        elif sub:  # (a unit listed a moment ago, perhaps: its folder is not to be trusted)
            state.lost.add(sub.rpartition("/")[0])
        return
    yield from _Walker(state, children, known, keep_paths, units).visit(fd, sub, None)


def _mount_point(state: DirWalk, key: str, within: str | None) -> list[Listing]:
    """Mount point `key`, met by a walk: not walked, not an entry's file. A folder of its own is
    recorded RACY with no entries (every rescan tries it again: unmounted, it is walked). One
    `within` a directory whose mtime stands for it (a file mounted on a file; anything mounted in
    a kernel directory) makes that directory RACY instead: mounting moves no mtime."""
    state.mounted.append(key)
    if within is not None:
        state.lost.add(within)
        return []
    state.mtimes[key] = RACY
    return [Listing(key, [])]


def _plain(key: str) -> bool:
    """Can `key` name a directory below the root ('', '.', '..' parts, a NUL: no)? Checked in C
    first: a rescan asks it of every stored directory (130,000 at a million files)."""
    if "\0" in key or "%" in key or "." in key or "//" in key or key[0] == "/" or key[-1] == "/":
        try:
            safefs.split(fs_path(key))
        except safefs.Refused:
            return False
    return True


def walk_units(root: safefs.Root, units: list[str]) -> tuple[list[Listing], DirWalk]:
    """Walk each of `units` (as `iter_dirs` handed them out) under `root`, in this process: the
    listings in order, and what the walk saw (mtimes, listed, unreadable; no entries)."""
    state = DirWalk({}, 0, {})
    out: list[Listing] = []
    for unit in units:
        out.extend(iter_dirs(root, unit, None, False, state))
    return out, state


class _Walker:
    def __init__(
        self,
        out: DirWalk,
        children: dict[str, list[str]],
        known: dict[str, int],
        keep_paths: bool,
        units: list[str] | None = None,
    ) -> None:
        self.out, self.children, self.known, self.keep_paths, self.units = out, children, known, keep_paths, units
        self.mounts = out.mounts or frozenset()
        self.mounted_in: dict[str, set[str]] = {}  # directory -> the names in it that are (or hold) mount points
        for m in self.mounts:
            parent, _, name = m.rpartition("/")
            self.mounted_in.setdefault(parent, set()).add(name)
            parts = m.split("/")
            if len(parts) > 3 and is_kernel_dir("/".join(parts[:3])):  # (a kernel directory is read whole)
                self.mounted_in.setdefault("/".join(parts[:3]), set()).add(parts[3])
        self.racy_after = time.time_ns() - RACY_NS

    def visit(self, fd: int, rel: str, kernel: DiskEntry | None) -> Iterator[Listing]:
        """Read directory `rel` (open as `fd`, which this closes) and what is below it."""
        out = self.out
        own, m = kernel is None, 0  # (own: a directory whose mtime is recorded, not a kernel's inner folder)
        try:
            if own:
                m = os.fstat(fd).st_mtime_ns  # (read before the listing: a change during it moves it on)
                if self.known.get(rel) == m and not self._hides_a_mount(rel):
                    for child in self.children.get(rel, ()):
                        yield from self._descend(fd, child, child.rpartition("/")[2], None)
                    self._record(rel, m)
                    return
                out.listed += 1
                if is_kernel_dir(rel):
                    kernel = DiskEntry(Kind.TRITON, rel, rel.rpartition("/")[2])
            entries: dict[str, DiskEntry] = {}
            subdirs = self._list(fd, rel, kernel, entries)
            if subdirs is None:  # unreadable: the next walk tries again
                out.unreadable.append(rel)
                out.mtimes[rel] = RACY
                return
            if kernel is None:  # (an empty listing too: the entries it had are gone)
                yield Listing(rel, list(entries.values()))
            units = self.units if self.units is not None and kernel is None and is_container(rel) else None
            prefix = rel + "/" if rel else ""
            subdirs.reverse()
            while subdirs:  # each name let go once its key is made: not two copies of a 100,000-name folder
                name = subdirs.pop()
                key = prefix + name
                if units is not None and not is_container(key):
                    units.append(key)  # walked by the caller, apart
                else:
                    yield from self._descend(fd, key, name, kernel)
            if units is not None:  # its subfolders are walked apart: recorded once they are (settle)
                out.held[rel] = m if m < self.racy_after else RACY
            elif own:
                self._record(rel, m)
            if kernel is not None and rel == kernel.key:
                yield Listing(rel, [kernel])  # only once its whole subtree is read
        finally:
            os.close(fd)

    def _record(self, rel: str, m: int) -> None:
        """Directory `rel`'s mtime, now that everything below it is walked."""
        self.out.mtimes[rel] = m if m < self.racy_after and rel not in self.out.lost else RACY

    def _hides_a_mount(self, rel: str) -> bool:
        """Would trusting directory `rel`'s mtime pass over a mount point in it? Mounting moves no
        mtime: one on a file of it, or anywhere in a kernel directory, is met only by listing it
        (one on a subfolder the index knows is met as that subfolder is walked)."""
        names = self.mounted_in.get(rel)
        if not names:
            return False
        known = set(self.children.get(rel, ()))
        prefix = rel + "/" if rel else ""
        return any(prefix + n not in known for n in names)

    def _unchanged_leaf(self, parent_fd: int, key: str, name: str) -> bool:
        """A known directory with no known subdirectory whose mtime is still the known one, seen
        by an lstat through its parent and recorded without opening it (it holds the names it
        held, so nothing new is below it): a rescan of a 100,000-file tree opened and closed
        12,000 kernel directories to read the mtimes, 2/3 of its walk. Anything else: False."""
        if key not in self.known or key in self.children or key in self.mounted_in:
            return False
        try:
            st = os.stat(fs_path(name), dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            return False
        m = st.st_mtime_ns
        if not stat.S_ISDIR(st.st_mode) or self.known.get(key) != m:
            return False
        self.out.mtimes[key] = m if m < self.racy_after else RACY
        return True

    def _descend(self, parent_fd: int, key: str, name: str, kernel: DiskEntry | None) -> Iterator[Listing]:
        if key.count("/") >= safefs.MAX_DEPTH:
            self.out.unreadable.append(key)
            return
        if key in self.mounts:
            yield from _mount_point(self.out, key, None if kernel is None else kernel.key)
            return
        if kernel is None and self._unchanged_leaf(parent_fd, key, name):
            return
        try:
            fd = os.open(fs_path(name), safefs.O_DIR, dir_fd=parent_fd)
        except OSError as e:
            if e.errno in safefs.SHORT:
                raise
            if e.errno not in _GONE:  # gone, or now a symlink / a file: nothing to walk
                self.out.unreadable.append(key)
                self.out.mtimes[key] = RACY
            elif kernel is None:  # listed a moment ago, perhaps: its folder is not to be trusted
                self.out.lost.add(key.rpartition("/")[0])
            return
        yield from self.visit(fd, key, kernel)

    def _list(self, fd: int, rel: str, kernel: DiskEntry | None, entries: dict[str, DiskEntry]) -> list[str] | None:
        """Add the regular files of directory `rel` to their entries (the kernel's, or those in
        `entries`); return the key names of its subdirectories, or None when it cannot be listed.
        Both in name order: entries come in key order, so the index's B-trees fill at their ends
        (a first scan of a million files wrote its rows 1.7x faster so than in directory order)."""
        keep = self.keep_paths
        prefix = rel + "/" if rel else ""
        subdirs, files = [], []
        mounted = self.mounted_in.get(rel)  # (a file mounted on a file: not the cache's either)
        # A kernel's files are summed here as they are listed, never held (a hostile kernel folder
        # may hold 200,000), and added to it once: this loop runs once per file of the cache.
        nbytes = nfiles = 0
        mtime = atime = 0.0
        try:
            it = os.scandir(fd)
        except OSError as err:
            if err.errno in safefs.SHORT:
                raise
            return None
        with it:
            try:
                for d in it:
                    name = d.name
                    if name[0] == "." or name.startswith("tmp.") or ".tmp" in name:
                        continue  # is_transient, inlined
                    try:
                        if mounted is not None and key_of(name) in mounted and not d.is_dir(follow_symlinks=False):
                            _mount_point(self.out, prefix + key_of(name), rel if kernel is None else kernel.key)
                            continue  # (a folder's is met as it is walked)
                        if d.is_file(follow_symlinks=False):  # (most names: asked first)
                            if kernel is None:
                                files.append(d)
                                continue
                            st = d.stat(follow_symlinks=False)  # (OSError: vanished since the listing)
                            nbytes += st.st_size
                            nfiles += 1
                            if st.st_mtime > mtime:
                                mtime = st.st_mtime
                            if st.st_atime > atime:
                                atime = st.st_atime
                            if keep and len(kernel.paths) < MAX_PATHS:
                                plain = name.isprintable() and "%" not in name
                                kernel.paths.append(prefix + (name if plain else key_of(name)))
                        elif d.is_dir(follow_symlinks=False):  # (only names are kept: a folder may hold 100,000)
                            subdirs.append(name if name.isprintable() and "%" not in name else key_of(name))
                        # (a symlink, FIFO, socket or device: never an entry, never opened)
                    except OSError:
                        continue
            except OSError:
                return None
        if nfiles and kernel is not None:
            kernel.count(nbytes, nfiles, mtime, atime)
        files.sort(key=_NAME)
        for d in files:
            name = d.name
            if not (name.isprintable() and "%" not in name):
                name = key_of(name)
            c = classify(prefix + name)
            if c is None:
                continue
            try:
                st = d.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished between listing and stat: an eviction or a rename
            e = entries.get(c.key)
            if e is None:
                e = entries[c.key] = DiskEntry(c.kind, c.key, c.ref)
            e.add(prefix + name, st, keep)
        subdirs.sort()
        return subdirs


# -- one entry's files ------------------------------------------------------------------------------


def stat_entry(
    root: safefs.Root,
    c: Classified,
    mounts: frozenset[str] = frozenset(),
    folders: dict[str, dict[str, list[str]]] | None = None,
) -> DiskEntry | None:
    """One entry as it is on disk now, read as a walk reads it (for the watcher and `show`); None
    if gone. Its files are summed as they are seen and at most MAX_PATHS of their keys kept (a
    hostile kernel folder may hold millions). A kernel directory is walked through its own
    descriptor; a code entry's files are the names in its folder that share its stem, but those
    that are mount points (`mounts`, as keys). `folders`: the names of each <2ch>/ folder listed
    so far, by stem, kept across the calls of one batch (a batch of 20,000 code entries of one
    folder listed it 20,000 times: 75 entries a second)."""
    if c.kind == Kind.TRITON:
        e = walk_dirs(root, c.key).entries.get(c.key)
        return e if e is not None and e.files else None
    e = DiskEntry(c.kind, c.key, c.ref)
    try:
        if c.kind == Kind.CODE:
            folder, stem = c.key.split("/", 1)
            by_stem = None if folders is None else folders.get(folder)
            if by_stem is None:
                by_stem = {}
                for n in root.listdir(fs_path(folder)):
                    n = key_of(n)
                    by_stem.setdefault(n.partition(".")[0], []).append(n)
                if folders is not None:
                    folders[folder] = by_stem
            names = by_stem.get(stem, ())
            rels = sorted(f"{folder}/{n}" for n in names if n.startswith(stem + ".") and is_code_file(c.key, n))
            rels = [rel for rel in rels if rel not in mounts]
        else:
            rels = [c.key]
        for rel in rels:
            try:
                st = root.lstat(fs_path(rel))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                e.add(rel, st)
    except OSError:
        pass
    return e if e.files else None


# -- is this an Inductor cache? ---------------------------------------------------------------------

# Top-level folders Inductor, Triton and torch make under the cache dir (beside <2ch>/ module folders).
OWN_FOLDERS = frozenset(
    {
        "fxgraph",
        "aotautograd",
        "triton",
        LOCKS_DIR,
        "precompiled_headers",
        "aoti_eager",
        "autoheuristic",
        "cache",
        "dynamo",
        "gcc",
    }
)
# Names torch also writes at the top level (torch 2.13 / 2.14 source), too plain or too rare to
# tell a cache by: tolerated only beside an OWN_FOLDERS folder or a <2ch>/ folder of modules.
# Folders of debris and caches:
_TOLERATED_DIRS = frozenset(
    {
        "torch_cutlass",  # codegen/cutlass/utils.try_import_cutlass: links to CUTLASS's Python sources
        "torch_cutlass_library",  # the same, in older torch
        "unhashed_kernel_inputs",  # triton_heuristics._dump_launch_tensors (TORCHINDUCTOR_DUMP_LAUNCH_TENSORS)
        "cutedsl_compile_cache",  # runtime/cutedsl_cache.py
    }
)
# Files:
_TOLERATED_FILES = re.compile(
    r"configs_[0-9a-f]{8}\.json"  # CUTLASS's op configs (codegen/cutlass/cache.py)
    r"|memoizer_cache\.(json|lock)"  # runtime/caching Memoizer's dump (TORCHINDUCTOR_DUMP_MEMOIZER_CACHE)
)
# Folders whose contents eviction never plans (`is_kept`; `purge` takes them when asked): what
# programs load by path (AOTInductor's output when given no path, named code_hash(model code) in
# compile_fx: the .so / .pt2 that aot_compile and aoti_compile_and_package return; Halide's
# runtime, behind a `done` marker), tools' state (the compiler bisector's, 2.14's QuACK cache),
# and what only looks like torch's: tempfile's names, which fresh_cache(dir=cache_dir(),
# delete=False) leaves under FORCE_DISABLE_CACHES, as would any other program's mkdtemp there.
TEMP_NAME = r"tmp[a-z0-9_]{8}"  # tempfile's names (mkdtemp, NamedTemporaryFile), Inductor's and cachemgr's import's
TEMP_FOLDER = re.compile(TEMP_NAME)
_KEPT_DIRS = re.compile(rf"c[a-z0-9]{{20,}}|halide-runtime-.+|bisect|quack|{TEMP_NAME}")
_KEPT_FILES = re.compile(rf"{TEMP_NAME}\.py")  # a wrapper kept for its output_code log (codegen/wrapper.py)
# In a <2ch>/ folder, beside or after its modules: the folder g++ ran in for a C++ build (cpp_builder's
# _BUILD_TEMP_DIR, left when a build fails; a probe's is named by its bare key), a debug dump of a
# kernel's launch tensors (triton_<kernel>_run_<n>/), ROCm's kept temporaries (c<hash>-hip-...)
_MODULE_FOLDER_EXTRAS = re.compile(r"c[a-z0-9]{20,}(_CxxBuild|-.+)|triton_\w+_run_\d+")
_CHILDREN = {"fxgraph": _TWO_CHAR, "aotautograd": _AOT_KEY, "triton": _DEVICE}  # what these folders hold


def is_kept(key: str) -> bool:
    """An entry eviction must leave alone: in a _KEPT_DIRS folder, or a _KEPT_FILES file."""
    top, sep, _ = fs_path(key).partition("/")
    return (_KEPT_DIRS if sep else _KEPT_FILES).fullmatch(top) is not None


def foreign_root(root: str) -> str | None:
    """Why `root` is not an Inductor cache directory that files may be deleted from, or None.

    Eviction takes unreferenced files as orphans, so pointed at `/`, a home directory or a
    site-packages folder by mistake it would empty it. A root is accepted only by positive
    evidence: everything at its top level is a folder Inductor, Triton or torch makes (or a
    <2ch>/ folder of generated modules), those folders hold what Inductor puts there (key-shaped
    names), and nothing else is there but names torch writes that tell no cache alone (a
    tempfile-named folder, CUTLASS's, AOTInductor's output: tolerated beside the others). An
    empty directory is accepted (nothing compiled yet).
    """
    try:
        r = safefs.Root(root)
    except OSError:
        return None  # missing or unreadable: check_root says so
    with r:
        return foreign_opened(root, r)


def foreign_opened(root: str, r: safefs.Root) -> str | None:
    """`foreign_root` of the directory `r` holds open (`root`: its name, for the message). What
    deletes checks the very directory it deletes in: checked by its name, the root could be a
    symlink swapped to another directory between the check and the open."""
    try:
        if r.id == safefs.identity(os.stat("/")):
            return f"{root} is the file system root"
        names = sorted(n for n in os.listdir(r.fd) if n != TRASH_DIR)
    except OSError as e:
        if e.errno in safefs.SHORT:
            raise
        return None
    whys = [_not_inductors(r, n) for n in names]
    odd = [why for why in whys if why and why is not _TOLERATED]
    if whys and all(why is _TOLERATED for why in whys):
        odd = [f"{key_of(names[0])} and the like, with no folder of Inductor's own beside them"]
    if not odd:
        return None
    shown = "; ".join(odd[:3]) + (f"; and {len(odd) - 3} more" if len(odd) > 3 else "")
    return f"{root} does not look like an Inductor cache directory ({shown})"


_TOLERATED = "tolerated"  # (what _not_inductors says of a name that is no evidence alone)


def _not_inductors(r: safefs.Root, name: str) -> str | None:
    """Why the top-level name `name` is not something Inductor makes, or None; _TOLERATED for a
    name torch makes that tells no cache by itself."""
    shown = key_of(name)
    try:
        st = r.lstat(name)
    except OSError:
        return None  # gone meanwhile
    if not stat.S_ISDIR(st.st_mode):
        if _TOLERATED_FILES.fullmatch(name) or _KEPT_FILES.fullmatch(name):
            return _TOLERATED
        return f"{shown} is not a folder Inductor makes"
    try:
        children = [n for n in r.listdir(name) if not is_transient(n)]
    except OSError as e:
        if e.errno in safefs.SHORT:
            raise  # (this process is short of descriptors: no fault of the folder's)
        return f"{shown}/ cannot be read ({e.strerror})"
    if _TWO_CHAR.fullmatch(name):
        if any(
            (c := classify(f"{name}/{key_of(n)}")) is not None and c.kind in (Kind.CODE, Kind.AUTOTUNE)
            for n in children
        ):
            return None
        if all(_MODULE_FOLDER_EXTRAS.fullmatch(n) for n in children):
            return _TOLERATED if children else None  # (emptied by eviction; or what a failed build left)
        return f"{shown}/ holds no generated modules"
    if name in _TOLERATED_DIRS or _KEPT_DIRS.fullmatch(name):
        return _TOLERATED
    if name not in OWN_FOLDERS:
        return f"{shown} is not a folder Inductor makes"
    shape = _CHILDREN.get(name)
    if shape is not None:
        bad = [n for n in children if not shape.match(n)]
        if bad:
            return f"{shown}/ holds {key_of(bad[0])}, which Inductor does not write there"
    return None


def default_cache_dir() -> str:
    """Inductor's own default: <tmpdir>/torchinductor_<user> (torch/_inductor/runtime/cache_dir_utils.py)."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + user)
