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
| other       | the file's own path                | -                                   |

Names that start with '.' and names containing '.tmp' or starting with 'tmp.' are writes in
progress (Inductor's write_atomic, Triton's tmp.pid_* directories) or cachemgr's own trash: never
entries. Symlinks are never followed and never indexed.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

KINDS = ("fxgraph", "aotautograd", "triton", "code", "autotune", "lock", "other")
TRASH_DIR = ".cachemgr-trash"  # inside the root, same file system: rename there, then unlink
LOCKS_DIR = "locks"

_TWO_CHAR = re.compile(r"^[a-z0-9]{2}$")
_CODE_NAME = re.compile(r"^(c[a-z0-9]{20,})(\..+)$")


def is_transient(name: str) -> bool:
    """A write in progress or cachemgr's own bookkeeping: never an entry, never deleted."""
    return name.startswith(".") or name.startswith("tmp.") or ".tmp" in name


@dataclass(frozen=True, slots=True)
class Classified:
    kind: str
    key: str  # entry key, relative to the root, '/'-separated
    ref: str | None


def classify(relpath: str) -> Classified | None:
    """The entry a file belongs to, or None for transient files. `relpath` is '/'-separated."""
    parts = relpath.split("/")
    if any(is_transient(p) for p in parts) or not parts[-1]:
        return None
    top, n = parts[0], len(parts)
    if top == "fxgraph" and n == 4:
        return Classified("fxgraph", relpath, parts[2])
    if top == "aotautograd" and n == 3:
        return Classified("aotautograd", relpath, parts[1])
    if top == "triton" and n >= 4:
        return Classified("triton", "/".join(parts[:3]), parts[2])
    if top == LOCKS_DIR and n == 2:
        return Classified("lock", relpath, parts[1].removesuffix(".lock"))
    if n == 2 and _TWO_CHAR.match(top):
        name = parts[1]
        if name.endswith(".best_config"):
            return Classified("autotune", relpath, name.removesuffix(".best_config"))
        code = _CODE_NAME.match(name)
        if code:
            return Classified("code", f"{top}/{code.group(1)}", code.group(1))
    return Classified("other", relpath, None)


@dataclass(slots=True)
class DiskEntry:
    """One entry as found on disk: its files and their summed sizes."""

    kind: str
    key: str
    ref: str | None
    bytes: int = 0
    files: int = 0
    mtime: float = 0.0
    atime: float = 0.0
    paths: list[str] = field(default_factory=list)  # relative paths of its regular files (if kept)

    def add(self, relpath: str, st: os.stat_result) -> None:
        self.bytes += st.st_size
        self.files += 1
        self.mtime = max(self.mtime, st.st_mtime)
        self.atime = max(self.atime, st.st_atime)
        self.paths.append(relpath)


def walk(root: str, subtree: str = "") -> Iterator[DiskEntry]:
    """Every entry under `root` (or under `root/subtree`), grouped as `classify` groups files."""
    yield from walk_dirs(root, subtree).entries.values()


@dataclass(slots=True)
class DirWalk:
    """What `walk_dirs` found: the entries of the directories it listed, and every directory's mtime."""

    entries: dict[str, DiskEntry]  # entry key -> entry, for entries whose home is in `listed`
    listed: set[str]  # directories read (new or changed since `known`): their entries are all in `entries`
    mtimes: dict[str, int]  # every directory seen -> st_mtime_ns (RACY where it may still change unseen)
    unreadable: list[str] = field(default_factory=list)  # directories that could not be listed


RACY = -1  # a directory mtime too recent to trust: the next walk reads the directory again
RACY_NS = 2_000_000_000  # file systems with coarse timestamps (1 s) can hide a change within this


def walk_dirs(
    root: str, subtree: str = "", known: dict[str, int] | None = None, keep_paths: bool = True
) -> DirWalk:
    """Walk `root` (or `root/subtree`), reading only directories whose mtime differs from `known`.

    A directory's mtime moves whenever a name in it is created, removed or renamed, and Inductor
    and Triton only ever write by renaming a finished file into place: so a directory whose mtime
    is what it was when it was last read still holds the same entries, and is not read again (its
    known subdirectories are still checked). Each directory is lstat'ed before it is listed, so a
    change made while it is listed moves its mtime past the one recorded. Files in listed
    directories are stat'ed once each (lstat: symlinks are skipped, not followed). A Triton kernel
    directory is one entry: it is read whole or not at all. Unreadable directories are skipped, so
    a walk never fails on one bad corner. With `known` empty every directory is read. Without
    `keep_paths` the entries' `paths` stay empty (a large scan needs only the totals).
    """
    known = known or {}
    children: dict[str, list[str]] = {}
    for d in known:
        if d:
            children.setdefault(d.rpartition("/")[0], []).append(d)
    racy_after = time.time_ns() - RACY_NS
    out = DirWalk({}, set(), {})
    entries = out.entries
    stack: list[tuple[str, DiskEntry | None]] = [(subtree.strip("/"), None)]  # (dir, kernel entry it is in)
    while stack:
        rel, kernel = stack.pop()
        path = os.path.join(root, rel) if rel else root
        if kernel is None:
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone: its entries leave the index
            except OSError:  # there, but out of reach (a parent without search permission)
                out.unreadable.append(rel)
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            m = st.st_mtime_ns
            out.mtimes[rel] = m if m < racy_after else RACY
            if known.get(rel) == m:
                stack.extend((child, None) for child in children.get(rel, ()))
                continue
            out.listed.add(rel)
            kernel = _kernel_entry(entries, rel)
        prefix = rel + "/" if rel else ""
        try:
            it = os.scandir(path)
        except OSError:  # unreadable: its mtime is not recorded, so it is read again once it can be
            out.mtimes.pop(rel, None)
            out.unreadable.append(rel)
            continue
        with it:
            for d in it:
                name = d.name
                if name[0] == "." or name.startswith("tmp.") or ".tmp" in name:
                    continue  # is_transient, inlined: this loop runs once per file
                try:
                    if d.is_dir(follow_symlinks=False):
                        stack.append((prefix + name, kernel))
                        continue
                    if not d.is_file(follow_symlinks=False):
                        continue
                    st = d.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished between listing and stat: an eviction or a rename
                e = kernel
                if e is None:
                    c = classify(prefix + name)
                    if c is None:
                        continue
                    e = entries.get(c.key)
                    if e is None:
                        e = entries[c.key] = DiskEntry(c.kind, c.key, c.ref)
                e.bytes += st.st_size
                e.files += 1
                if st.st_mtime > e.mtime:
                    e.mtime = st.st_mtime
                if st.st_atime > e.atime:
                    e.atime = st.st_atime
                if keep_paths:
                    e.paths.append(prefix + name)
    return out


# Top-level folders only Inductor and Triton make (and <2ch>/ folders of generated modules).
_OWN_FOLDERS = frozenset({"fxgraph", "aotautograd", "triton", "precompiled_headers", "aoti_eager", "autoheuristic"})


def foreign_root(root: str) -> str | None:
    """Why `root` is not an Inductor cache directory that files may be deleted from, or None.

    Eviction takes unreferenced files as orphans, so pointed at `/` or a home directory by
    mistake it would empty it. A cache dir holds at least one folder Inductor or Triton made
    (from the first compile on), or nothing yet.
    """
    real = os.path.realpath(root)
    if os.path.dirname(real) == real:
        return f"{root} is the file system root"
    try:
        names = [n for n in os.listdir(real) if not is_transient(n)]
    except OSError:
        return None  # missing or unreadable: check_root says so
    if not names or any(n in _OWN_FOLDERS or _TWO_CHAR.match(n) and _holds_modules(real, n) for n in names):
        return None
    shown = ", ".join(sorted(names)[:4]) + (", ..." if len(names) > 4 else "")
    return (f"{root} does not look like an Inductor cache directory: none of fxgraph/, aotautograd/, "
            f"triton/ or <2ch>/ module folders, but {shown}")


def _holds_modules(root: str, folder: str) -> bool:
    """A <2ch>/ folder holding generated modules or autotune results (not any two-letter folder)."""
    try:
        with os.scandir(os.path.join(root, folder)) as it:
            return any((c := classify(f"{folder}/{d.name}")) is not None and c.kind in ("code", "autotune")
                       for d in it)
    except OSError:
        return False


def home_dir(key: str, kind: str) -> str:
    """The directory whose listing holds an entry: a kernel directory is its own home."""
    return key if kind == "triton" else key.rpartition("/")[0]


def _kernel_entry(entries: dict[str, DiskEntry], rel: str) -> DiskEntry | None:
    """The entry of a Triton kernel directory triton/<device>/<hash>, None for any other directory."""
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != "triton" or any(is_transient(p) for p in parts):
        return None
    e = entries.get(rel)
    if e is None:
        e = entries[rel] = DiskEntry("triton", rel, parts[2])
    return e


def entry_paths(root: str, key: str, kind: str) -> list[str]:
    """The files of one entry as they are on disk now (relative paths)."""
    if kind == "triton":
        return [p for e in walk(root, key) for p in e.paths]
    if kind == "code":
        folder, stem = key.split("/", 1)
        try:
            names = os.listdir(os.path.join(root, folder))
        except OSError:
            return []
        return sorted(
            f"{folder}/{n}" for n in names
            if n.startswith(stem + ".") and not is_transient(n)
            and os.path.isfile(os.path.join(root, folder, n)) and not os.path.islink(os.path.join(root, folder, n))
        )
    full = os.path.join(root, key)
    return [key] if os.path.isfile(full) and not os.path.islink(full) else []


def stat_entry(root: str, c: Classified) -> DiskEntry | None:
    """Re-read one entry from disk (for the watcher and for eviction checks); None if gone."""
    e = DiskEntry(c.kind, c.key, c.ref)
    for p in entry_paths(root, c.key, c.kind):
        try:
            e.add(p, os.lstat(os.path.join(root, p)))
        except OSError:
            pass
    return e if e.files else None


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
