"""File system access below a cache root through directory descriptors.

The root is opened once. Every path below it is reached one component at a time with
`O_NOFOLLOW | O_DIRECTORY` relative to its parent's descriptor, so no symlink is ever followed
and a path string is never resolved twice: a directory swapped for a symlink mid-run is refused
(ELOOP), not followed out of the root. Only regular files are opened (lstat first, then
`O_NOFOLLOW | O_NONBLOCK`, then the descriptor's identity checked against the lstat), so a FIFO,
a device node or a symlink to /dev/zero is never read. Deletions name what they expect to delete
by (device, inode), and refuse anything that changed since it was looked at. A kept directory
descriptor follows its directory wherever it is moved, so before anything goes through one it is
checked to be still reachable by its name from the root, and a rename is checked after it (and
undone) rather than before only.

This module knows no Inductor paths (cachemgr.layout does); it only makes them safe to use.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
O_NOATIME = getattr(os, "O_NOATIME", 0)
OPEN_DIRS = 64  # directory descriptors a Root keeps open per thread (least recently used go first)
MAX_DEPTH = 32  # deeper paths are not Inductor's: refused, never walked

Identity = tuple[int, int]  # (st_dev, st_ino)
# The process is short of descriptors or memory: no fault of the path it was opening, so no path
# is reported unreadable, refused or replaced for it; the command fails, one line (exit 1).
SHORT = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class Refused(OSError):
    """A path cachemgr will not touch: not a regular file, a symlink, changed since it was seen."""

    def __init__(self, why: str, path: str = "") -> None:
        super().__init__(errno.EPERM, why, path)
        self.why = why

    def __reduce__(self):  # sent back by eviction's worker processes
        return type(self), (self.why, self.filename)


class TooLarge(Refused):
    def __init__(self, size: int, limit: int, path: str = "") -> None:
        super().__init__(f"too large to read ({size} bytes, limit {limit})", path)
        self.size, self.limit = size, limit

    def __reduce__(self):
        return type(self), (self.size, self.limit, self.filename)


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino


def mounts_below(root: Root | str) -> frozenset[str]:
    """The mount points strictly below `root` (paths relative to it), from /proc/self/mountinfo.
    A file system, or a bind mount of any directory, mounted inside the cache is not the cache's:
    nothing at or below one is moved or deleted (a descriptor walk crosses a mount point as it
    crosses any directory; a bind mount of the same file system even keeps its device number).
    Empty where mountinfo cannot be read (no /proc: `mount_id` then cannot tell either)."""
    try:
        top = os.readlink(f"/proc/self/fd/{root.fd}") if isinstance(root, Root) else os.path.realpath(root)
        top = top.rstrip("/") + "/"
        out = set()
        with open("/proc/self/mountinfo", "rb") as f:
            for line in f:  # (binary lines end at b"\n" alone: the kernel escapes it in a path, not "\r")
                fields = line.split(b" ", 5)
                if len(fields) > 4:  # (the mount point is the fifth, with space, tab, newline, backslash as \ooo)
                    point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), fields[4]))
                    if point.startswith(top):
                        out.add(point[len(top) :])
    except OSError:
        return frozenset()
    return frozenset(out)


_OCTAL = re.compile(rb"\\([0-7]{3})")


def mount_id(fd: int) -> int | None:
    """The id of the mount a descriptor's file is on (/proc/self/fdinfo), None where it cannot be
    read. A directory reached through the root's descriptors that is on another mount than the
    root's was mounted there since the run read the mount table."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class OtherMount(OSError):
    """A directory on another mount than the root's (mounted during the run): nothing there goes."""

    def __init__(self, rel: str) -> None:
        super().__init__(errno.EXDEV, "a mount point (another file system's)", rel)


def at_or_below_a_mount(rel: str, mounts: frozenset[str]) -> bool:
    """Is `rel` (a path relative to the root) a mount point, or below one?"""
    return any(rel == m or rel.startswith(m + "/") for m in mounts)


def at_or_above_a_mount(rel: str, mounts: frozenset[str]) -> bool:
    """Is `rel` (a path relative to the root) a mount point, below one, or above one?"""
    return any(rel == m or rel.startswith(m + "/") or m.startswith(rel + "/") for m in mounts)


def split(rel: str) -> tuple[str, str]:
    """(parent, name) of a '/'-separated path relative to the root; refuses '', '.', '..' parts."""
    framed = f"/{rel}/"  # (an empty part is a '//' in it: asked in C, eviction asks it of every file)
    if "//" in framed or "/./" in framed or "/../" in framed or "\0" in rel or rel.count("/") >= MAX_DEPTH:
        raise Refused("not a plain relative path", rel)
    parent, _, name = rel.rpartition("/")
    return parent, name


class Root:
    """An open cache root. Use as a context manager, or close() it."""

    def __init__(self, path: str) -> None:
        self.path = path
        # The root itself may be a symlink an operator made (/var/cache/inductor -> /data/...):
        # it is resolved once, here; nothing below it ever is.
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.id = identity(os.fstat(self.fd))
        # One descriptor cache per thread: a descriptor another thread let go (and the kernel
        # then gave to some other directory) is never used.
        self._local = threading.local()
        self._caches: list[OrderedDict[str, tuple[int, Identity]]] = []
        self._caches_lock = threading.Lock()

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.forget()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def forget(self) -> None:
        """Close the cached directory descriptors of every thread (no thread may be using them)."""
        with self._caches_lock:
            for cache in self._caches:
                for fd, _ in cache.values():
                    os.close(fd)
                cache.clear()

    @property
    def _dirs(self) -> OrderedDict[str, tuple[int, Identity]]:
        try:
            return self._local.dirs
        except AttributeError:
            dirs = self._local.dirs = OrderedDict()
            with self._caches_lock:
                self._caches.append(dirs)
            return dirs

    # -- directories ------------------------------------------------------------------------------

    def dir_fd(self, rel: str) -> int:
        """A descriptor of directory `rel` ('' is the root), owned by this Root: do not close it.
        Raises OSError (ELOOP for a symlink, ENOTDIR, ENOENT) when it is not a real directory."""
        return self._dir(rel)[0] if rel else self.fd

    def _dir(self, rel: str) -> tuple[int, Identity]:
        dirs = self._dirs
        got = dirs.get(rel)
        if got is not None:
            dirs.move_to_end(rel)
            return got
        parent, name = split(rel)
        fd = os.open(name, O_DIR, dir_fd=self.dir_fd(parent))
        got = dirs[rel] = fd, identity(os.fstat(fd))
        if len(dirs) > OPEN_DIRS:
            os.close(dirs.popitem(last=False)[1][0])
        return got

    def reachable_dir_fd(self, rel: str) -> int:
        """dir_fd(rel), checked to be the directory its name names now: a directory moved out of
        the cache while its descriptor was kept (`mv cache/fxgraph /backup` mid-eviction) is
        refused. (The descriptor is kept: what was taken from that directory goes back into it,
        wherever it is now, and every later delete through it is checked again.)"""
        fd = self.dir_fd(rel)
        if not self._reachable(rel):
            raise Refused("moved or replaced while eviction ran", rel)
        return fd

    def _reachable(self, rel: str) -> bool:
        """Is each kept descriptor on the way to `rel` the directory its name names now? One lstat
        per level, against the descriptor above (MAX_DEPTH < OPEN_DIRS: none of them is closed)."""
        while rel:
            parent, name = split(rel)
            try:
                if identity(os.stat(name, dir_fd=self.dir_fd(parent), follow_symlinks=False)) != self._dir(rel)[1]:
                    return False
            except OSError:
                return False
            rel = parent
        return True

    def lstat(self, rel: str) -> os.stat_result:
        parent, name = split(rel)
        return os.stat(name, dir_fd=self.dir_fd(parent), follow_symlinks=False)

    def listdir(self, rel: str) -> list[str]:
        """Names in directory `rel` (read through a fresh descriptor, so the listing is current)."""
        fd = os.open(".", O_DIR, dir_fd=self.dir_fd(rel))
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    # -- reading ----------------------------------------------------------------------------------

    @contextmanager
    def open_regular(self, rel: str, limit: int) -> Iterator[tuple[BinaryIO, os.stat_result]]:
        """A regular file below the root, opened for reading without moving its atime (where the
        kernel allows). Refused: anything that is not a regular file, a file over `limit` bytes,
        a file replaced between its lstat and its open."""
        parent, name = split(rel)
        pfd = self.dir_fd(parent)
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file", rel)
        if st.st_size > limit:
            raise TooLarge(st.st_size, limit, rel)
        try:
            fd = os.open(name, O_FILE | O_NOATIME, dir_fd=pfd)
        except PermissionError:  # O_NOATIME needs the file's owner
            fd = os.open(name, O_FILE, dir_fd=pfd)
        try:
            fst = os.fstat(fd)
            if identity(fst) != identity(st) or not stat.S_ISREG(fst.st_mode):
                raise Refused("replaced while being opened", rel)
            if fst.st_size > limit:
                raise TooLarge(fst.st_size, limit, rel)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
            f = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f, fst

    def read(self, rel: str, limit: int) -> bytes:
        """The bytes of a regular file below the root (see open_regular); never more than `limit`."""
        with self.open_regular(rel, limit) as (f, st):
            data = f.read(st.st_size + 1)
        if len(data) > limit:  # it grew since the fstat
            raise TooLarge(len(data), limit, rel)
        return data

    # -- deleting ---------------------------------------------------------------------------------

    def check(self, rel: str, expect: Identity, reachable: bool = False) -> tuple[int, str, os.stat_result]:
        """(parent descriptor, name, lstat) of `rel`, if it is still what was seen (`expect`);
        `reachable`: its directory checked to be still below the root (reachable_dir_fd)."""
        parent, name = split(rel)
        pfd = self.reachable_dir_fd(parent) if reachable else self.dir_fd(parent)
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        if identity(st) != expect:
            raise Refused("changed since it was looked at", rel)
        return pfd, name, st

    def move(self, rel: str, expect: Identity, dst_fd: int, dst_name: str) -> None:
        """Rename `rel` (a file, or a directory whole) to `dst_name` in directory `dst_fd`.
        A rename never follows a symlink; the parents were reached without following any. What
        left is checked after the rename (no window between a check and a rename): if it is not
        what was seen, or its directory is no longer below the root, it goes back, refused."""
        pfd, name, _ = self.check(rel, expect)
        os.rename(name, dst_name, src_dir_fd=pfd, dst_dir_fd=dst_fd)
        try:
            same = identity(os.stat(dst_name, dir_fd=dst_fd, follow_symlinks=False)) == expect
        except OSError:
            same = False
        reachable = same and self._reachable(split(rel)[0])
        if not reachable:
            try:
                rename_back(dst_fd, dst_name, pfd, name)
            except OSError:
                pass  # its place was taken meanwhile: it stays where it went (the trash, emptied later)
            raise Refused("changed since it was looked at" if not same else "moved or replaced while eviction ran", rel)

    def delete(self, rel: str, expect: Identity, inodes: frozenset[int] | None = None) -> None:
        """Delete `rel` in place: a file by unlink, a directory of files by remove_at (with
        `inodes`: only those files go; refused if others are there). OtherMount where its folder,
        or the directory itself, is on another mount than the root's now (a mount made since the
        run read the mount table: a rename would fail across it, an unlink would not)."""
        pfd, name, st = self.check(rel, expect, reachable=True)
        self.same_mount(pfd, rel)
        remove_at(pfd, name, st, inodes, mount=self.mount)

    @functools.cached_property
    def mount(self) -> int | None:
        """The mount the root is on (what is deleted in place must be on it, checked at the time);
        read when first asked: an open descriptor's mount never changes."""
        return mount_id(self.fd)

    def same_mount(self, fd: int, rel: str) -> None:
        """OtherMount unless directory descriptor `fd` is on the root's mount."""
        if self.mount is not None and mount_id(fd) != self.mount:
            raise OtherMount(rel)


_RENAME_NOREPLACE = 1  # <linux/fs.h>
_renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # (None: glibc < 2.28)
if _renameat2 is not None:
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]


def rename_back(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename `src` to `dst` unless `dst` exists (an undo: what took the name meanwhile is
    someone's, never replaced). OSError (EEXIST) if it does."""
    if _renameat2 is not None:
        if _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL):  # (EINVAL: a file system without RENAME_NOREPLACE)
            raise OSError(e, os.strerror(e), dst)
    if stat.S_ISDIR(os.stat(src, dir_fd=src_dir_fd, follow_symlinks=False).st_mode):
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)  # (never over one holding anything)
        return
    os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)  # never replaces
    os.unlink(src, dir_fd=src_dir_fd)


def open_dir(root: str, rel: str) -> int:
    """A new descriptor (the caller closes it) of directory `rel` below the directory `root`
    names, reached one component at a time without following a symlink. Unlike a Root, nothing
    stays open between calls (inotify tells of a directory's removal only once it is closed)."""
    if rel:
        split(rel)  # refuses '', '.' and '..' parts, and paths deeper than MAX_DEPTH
    names = rel.split("/") if rel else []
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in names:
        try:
            below = os.open(name, O_DIR, dir_fd=fd)
        finally:
            os.close(fd)
        fd = below
    return fd


def remove_at(
    dir_fd: int,
    name: str,
    st: os.stat_result | None = None,
    inodes: frozenset[int] | None = None,
    mount: int | None = None,
) -> None:
    """Remove `name` in directory `dir_fd`: unlink a file or symlink (never what it points at),
    or a directory of files (one level: a folder inside it stays, and so does the directory).
    Without `st`, whatever `name` is now goes (an unlink first: one call for a file). With
    `inodes`, only the files of a directory that are among them go: the directory stays,
    refused, if anything else is in it. With `mount`, a directory on another mount (a mount
    point) is not emptied (OtherMount)."""
    if st is None:
        try:
            os.unlink(name, dir_fd=dir_fd)
            return
        except IsADirectoryError:
            pass
    elif not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, O_DIR, dir_fd=dir_fd)
    try:
        if st is not None and identity(os.fstat(fd)) != identity(st):
            raise Refused("changed since it was looked at", name)
        if mount is not None and mount_id(fd) != mount:
            raise OtherMount(name)
        with os.scandir(fd) as it:
            found = [(d.name, d.inode()) for d in it]
        if inodes is not None and not inodes.issuperset(ino for _, ino in found):
            raise Refused("written to since it was looked at", name)
        for n, _ in found:
            try:
                os.unlink(n, dir_fd=fd)
            except IsADirectoryError:
                # Never descended into: what cachemgr deletes (a file, a kernel directory of files)
                # holds no folder, so one in it was put there since, by whoever can write there;
                # emptying it as root could delete what its owner could not. It stays (and so does
                # the directory: the rmdir below fails).
                pass
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def remove_tree(dir_fd: int, name: str, mount: int | None, depth: int = 0) -> bool:
    """Remove directory `name` in directory `dir_fd` and everything below it, through descriptors:
    each directory opened relative to its parent without following a symlink (a symlink is
    unlinked, never followed), none deeper than MAX_DEPTH entered, and none on another mount than
    `mount` (the root's: `mount_id`) entered. A mount point stays, with every directory above it.
    True when all of it went."""
    try:
        fd = os.open(name, O_DIR, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if depth >= MAX_DEPTH or (mount is not None and mount_id(fd) != mount):
            return False
        with os.scandir(fd) as it:
            found = [(d.name, d.is_dir(follow_symlinks=False)) for d in it]
        whole = True
        for n, is_dir in found:
            if is_dir:
                whole = remove_tree(fd, n, mount, depth + 1) and whole
                continue
            try:
                os.unlink(n, dir_fd=fd)
            except OSError:  # (made a folder since the listing, or a file bind-mounted there: EBUSY)
                whole = False
    finally:
        os.close(fd)
    if whole:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError:
            return False
    return whole
