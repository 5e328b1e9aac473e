"""Linux inotify through ctypes, and the recursive tree of watches the daemon keeps on a cache.

Why not watchdog (used before, with five of its private internals replaced): its public API
meets the lag target (bench/daemon.py, watchdog 7.1), but not two jobs the daemon has. (1) A
queue overflow must reach the daemon, which then rescans: watchdog only logs it and walks the tree
again. Measured on a 100,000-file cache, 6,000 entries written while the daemon was stopped:
1,902 were still missing from the index a minute later (until the hourly rescan); here all were
indexed 4 s after it ran again. Older versions' answer (drop every watch, walk again) overflowed
the queue again with the removals, forever. (2) A directory it cannot watch (ENOSPC:
fs.inotify.max_user_watches) is skipped silently; here it is one log line, and each rescan
watches what has no watch yet.

`TreeWatcher` is what replaces it: a watch on every directory under the root except writes in
progress (Triton's `tmp.pid_*/` is watched once it is renamed into place), kept as a tree of
nodes (parent, name) so that a rename moves one node, whatever is below it. One thread reads the
kernel queue and hands ("p" | "d", relative path) items to the consumer; it never blocks on it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator

from cachemgr import safefs
from cachemgr.layout import is_transient

log = logging.getLogger("cachemgr.watcher")

# <sys/inotify.h>
IN_MODIFY, IN_CLOSE_WRITE, IN_CLOSE_NOWRITE = 0x2, 0x8, 0x10
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED = 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK, IN_ISDIR = 0x01000000, 0x02000000, 0x04000000, 0x40000000

HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name, NUL-padded)
READ_SIZE = 256 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.inotify_init1.argtypes = [ctypes.c_int]
_libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
_libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]

Event = tuple[int, int, int, str]  # wd, mask, cookie, name ('' for the watched directory itself)
_PROC_FDS = os.path.isdir("/proc/self/fd")  # (watches through a descriptor; by path where there is no /proc)


class Inotify:
    """One inotify instance (its own kernel queue, sized by fs.inotify.max_queued_events when made)."""

    def __init__(self) -> None:
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            hint = " (fs.inotify.max_user_instances)" if e == errno.EMFILE else ""
            raise OSError(e, f"inotify_init1: {os.strerror(e)}{hint}")
        self.fd = fd

    def add_watch(self, path: str, mask: int) -> int:
        """The watch descriptor (the same one again for a directory already watched); OSError if not."""
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        return wd

    def watch_dir(self, root: str, rel: str, mask: int, at: int | None = None) -> int:
        """Watch directory `rel` below `root` ('' the root itself), reached one component at a
        time without following a symlink (`at`: the descriptor of its parent, opened so). A
        watch by path would follow a symlink in every component but the last: one swapped in
        would put watches, and listings, outside the root. The watch goes through the
        descriptor's /proc name, which names the very directory opened."""
        if at is None:
            fd = safefs.open_dir(root, rel)
        else:
            fd = os.open(rel.rpartition("/")[2], safefs.O_DIR, dir_fd=at)
        try:
            return self.add_watch(f"/proc/self/fd/{fd}" if _PROC_FDS else os.path.join(root, rel), mask)
        finally:
            os.close(fd)

    def rm_watch(self, wd: int) -> None:
        _libc.inotify_rm_watch(self.fd, wd)  # EINVAL when the kernel dropped it already: nothing to do

    def read(self) -> list[Event]:
        """The events queued now ([] when none): the descriptor is non-blocking."""
        try:
            buf = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        out, i = [], 0
        while i + HEADER.size <= len(buf):
            wd, mask, cookie, n = HEADER.unpack_from(buf, i)
            i += HEADER.size
            out.append((wd, mask, cookie, os.fsdecode(buf[i : i + n].rstrip(b"\0"))))
            i += n
        return out

    def close(self) -> None:
        os.close(self.fd)


class Reader:
    """A thread that waits on an Inotify and hands each read's events to `handle`; `stop` ends it."""

    def __init__(
        self, name: str, handle: Callable[[list[Event]], None], timeout: Callable[[], float | None] = lambda: None
    ) -> None:
        self.ino = Inotify()
        self.handle, self.timeout = handle, timeout
        self.stop_r, self.stop_w = os.pipe2(os.O_CLOEXEC)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.closing = threading.Lock()  # `stop` or the thread closes the descriptors: one of them
        self.exited = self.orphaned = False

    def start(self) -> None:
        self.thread.start()

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        os.write(self.stop_w, b"x")
        if self.thread.is_alive():
            self.thread.join(timeout)
        with self.closing:
            if self.thread.is_alive() and not self.exited:
                # Still in `handle` (a slow step): it closes the descriptors itself when it sees
                # the stop. Closed now, their numbers could go to the next Reader's, and this
                # thread would read that one's events; left open, the inotify instance would
                # keep every watch it holds.
                self.orphaned = True
                return
        self._close()

    def _close(self) -> None:
        for fd in (self.stop_r, self.stop_w):
            os.close(fd)
        self.ino.close()

    def _run(self) -> None:
        try:
            while True:
                ready, _, _ = select.select([self.ino.fd, self.stop_r], [], [], self.timeout())
                if self.stop_r in ready:
                    return
                try:
                    self.handle(self.ino.read())
                except Exception as e:  # one bad event must not end the watching
                    log.exception("handling inotify events failed: %s: %s", type(e).__name__, e)
        finally:
            with self.closing:
                self.exited = True
                if self.orphaned:  # `stop` gave up waiting for this thread: its descriptors are ours
                    self._close()


# -- the recursive tree of watches --------------------------------------------------------------

TREE_MASK = (
    IN_CREATE
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CLOSE_WRITE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_EXCL_UNLINK
)  # (no IN_DONT_FOLLOW: a watch is placed through /proc/self/fd/N, a link to follow; see watch_dir)
RESYNC_STEP = 1000  # directories of one listing watched per hold of the lock
MOVE_PAIRING = 1.0  # seconds an IN_MOVED_FROM of a directory waits for its IN_MOVED_TO (else: moved out)


class _Dir:
    __slots__ = ("wd", "parent", "name", "children")

    def __init__(self, wd: int, parent: _Dir | None, name: str) -> None:
        self.wd, self.parent, self.name = wd, parent, name
        self.children: dict[str, _Dir] | None = None  # most directories (entries) have none

    def rel(self) -> str:
        parts, d = [], self
        while d.parent is not None:
            parts.append(d.name)
            d = d.parent
        return "/".join(reversed(parts))

    def walk(self) -> Iterator[_Dir]:
        stack = [self]
        while stack:
            d = stack.pop()
            yield d
            if d.children:
                stack.extend(d.children.values())


class TreeWatcher:
    """Watches on every directory under `root` (writes in progress excepted), kept current.

    `put(kind, rel)`: a changed file ("p") or directory ("d", whose subtree the consumer walks),
    relative to the root. `on_dir(rel)`: a directory is watched from now on (new or moved here).
    `on_overflow()`: the kernel queue overflowed, events were lost: call `resync`, then rescan.
    `on_limit()`: a directory could not be watched (ENOSPC); `unwatched` counts them.
    `on_root_lost()`: the root itself was removed or moved.
    `on_drop(rel)`: a directory is no longer watched (removed, or moved out of the root); called
    with the tree locked, so it must not call back into the tree.
    """

    def __init__(
        self,
        root: str,
        put: Callable[[str, str], None],
        on_dir: Callable[[str], None],
        on_overflow: Callable[[], None],
        on_limit: Callable[[], None],
        on_root_lost: Callable[[], None],
        on_drop: Callable[[str], None] = lambda rel: None,
    ) -> None:
        self.root, self.put, self.on_dir, self.on_drop = root, put, on_dir, on_drop
        self.on_overflow, self.on_limit, self.on_root_lost = on_overflow, on_limit, on_root_lost
        self.lock = threading.Lock()  # the tree: the reader thread's events, the consumer's resync
        self.by_wd: dict[int, _Dir] = {}
        self.top: _Dir | None = None
        self.moving: dict[int, tuple[_Dir, float]] = {}  # cookie -> directory moved from, when
        self.unwatched = 0  # directories that got no watch (out of watches), since the last resync
        self.reader = Reader("cachemgr-inotify", self._handle, self._timeout)

    @property
    def ino(self) -> Inotify:
        return self.reader.ino

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Watch the root (OSError if it cannot be), then every directory below; start reading."""
        wd = self.ino.watch_dir(self.root, "", TREE_MASK)
        with self.lock:
            self.top = _Dir(wd, None, "")
            self.by_wd[wd] = self.top
        self.resync()
        self.reader.start()

    def stop(self, timeout: float = 2.0) -> None:
        self.reader.stop(timeout)

    def alive(self) -> bool:
        return self.reader.alive()

    def watches(self) -> int:
        return len(self.by_wd)

    def resync(self) -> int:
        """Bring the watches in line with the disk: watch every directory that has none (made
        while events were lost, or when watches ran out), forget the ones that are gone. Runs on
        the caller's thread beside the reader (the tree is locked per RESYNC_STEP directories of
        a listing, not per walk). Returns the number of directories left unwatched.

        Memory: a million-file cache has 120,000 directories, 113,000 of them in one folder; the
        walk holds nodes and one listing's names, never a path per directory (that alone was 35 MB)."""
        self.unwatched = 0
        added: list[_Dir] = []
        mounts = safefs.mounts_below(self.root)  # (not the cache's: the scan walks none of them either)
        stack = [self.top]
        while stack:
            node = stack.pop()
            with self.lock:
                if node is None or self.by_wd.get(node.wd) is not node:
                    continue  # forgotten meanwhile (deleted): its events said so
                rel = node.rel()
            try:
                fd = safefs.open_dir(self.root, rel)
            except OSError:
                continue  # gone meanwhile, a symlink now, or unreadable (then it has no watch either)
            try:
                listed = _subdirs(fd)
                for i in range(0, max(1, len(listed)), RESYNC_STEP):
                    with self.lock:
                        if self.by_wd.get(node.wd) is not node or node.rel() != rel:
                            if self.by_wd.get(node.wd) is node:
                                stack.append(node)  # moved meanwhile: listed again where it is now
                            break
                        if i == 0 and node.children:  # gone since; one still there was made after the listing
                            for name in set(node.children).difference(listed):
                                if not _is_dir(fd, name):
                                    self._drop(node.children.pop(name))
                        for name in listed[i : i + RESYNC_STEP]:
                            if mounts and (f"{rel}/{name}" if rel else name) in mounts:
                                continue
                            child = self._watch(node, name, added, at=fd)
                            if child is not None:
                                stack.append(child)
                    self._tell_added(added)
            except OSError:
                continue  # unreadable
            finally:
                os.close(fd)
        with self.lock:  # watches whose IN_IGNORED was lost in an overflow: not in the tree any more
            moving = {id(node) for node, _ in self.moving.values()}
            for wd in [wd for wd, d in self.by_wd.items() if not self._in_tree(d, moving)]:
                del self.by_wd[wd]
        return self.unwatched

    def _tell_added(self, added: list[_Dir]) -> None:
        """`on_dir` for directories watched since the last call (their paths taken under the
        lock, the calls made outside it)."""
        if not added:
            return
        with self.lock:
            rels = [d.rel() for d in added]
        added.clear()
        for rel in rels:
            self.on_dir(rel)

    def _in_tree(self, d: _Dir, moving: set[int]) -> bool:
        """Is `d` below the root or below a directory being moved, each link current (a walk up
        the parents: no set of every node)."""
        while id(d) not in moving:
            p = d.parent
            if p is None:
                return d is self.top
            if not p.children or p.children.get(d.name) is not d:
                return False
            d = p
        return True

    # -- under the lock --------------------------------------------------------------------------

    def _watch(self, parent: _Dir, name: str, added: list[_Dir], at: int | None = None) -> _Dir | None:
        """The node of parent/name, watched (a new watch if it had none); None if it cannot be.
        `at`: the parent's descriptor, where the caller has it open."""
        try:
            rel = f"{parent.rel()}/{name}" if parent.parent is not None else name
            wd = self.ino.watch_dir(self.root, rel, TREE_MASK, at=at)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ELOOP):
                # (out of watches; or of descriptors or memory, for a while: the next resync, which
                # a rescan after a failed batch runs while any is unwatched, watches it)
                self.unwatched += 1
                if e.errno == errno.ENOSPC:
                    self.on_limit()
            return None  # gone already, not a directory (any more), or not readable
        child = self.by_wd.get(wd)
        if child is not None and parent.children and parent.children.get(name) is child:
            return child  # watched already (a resync, or a create seen after a walk found it)
        if child is not None:
            # the same directory under another name (a move whose events were lost), or back in
            # its place from outside the root before its move out was settled: attached here,
            # and no longer dropped with what left the root
            self._detach(child)
            for cookie in [c for c, (d, _) in self.moving.items() if d is child]:
                del self.moving[cookie]
        else:
            child = _Dir(wd, parent, name)
            self.by_wd[wd] = child
        old = parent.children.get(name) if parent.children else None
        if old is not None:
            self._drop(old)  # another directory had the name (removed, its IN_IGNORED lost or still to come)
        self._attach(child, parent, name)
        added.append(child)
        return child

    def _watch_tree(self, parent: _Dir, name: str, added: list[_Dir]) -> None:
        """Watch a directory that appeared, and every directory already made inside it (those were
        made before its watch existed, so no event told of them)."""
        child = self._watch(parent, name, added)
        stack = [child] if child is not None else []
        while stack:
            d = stack.pop()
            try:
                fd = safefs.open_dir(self.root, d.rel())
                try:
                    names = _subdirs(fd)
                finally:
                    os.close(fd)
            except OSError:
                continue
            for n in names:
                c = self._watch(d, n, added)
                if c is not None:
                    stack.append(c)

    @staticmethod
    def _attach(node: _Dir, parent: _Dir, name: str) -> None:
        if parent.children is None:
            parent.children = {}
        node.parent, node.name = parent, name
        parent.children[name] = node

    @staticmethod
    def _detach(node: _Dir) -> None:
        p = node.parent
        if p is not None and p.children and p.children.get(node.name) is node:
            del p.children[node.name]

    def _drop(self, node: _Dir) -> None:
        """Stop watching a directory and everything below it (gone, or moved out of the root);
        `on_drop` is told of each (its path as it was)."""
        for d in node.walk():
            if self.by_wd.get(d.wd) is d:
                del self.by_wd[d.wd]
                self.ino.rm_watch(d.wd)
                self.on_drop(d.rel())

    def _forget(self, node: _Dir) -> None:
        """Its watch is gone (IN_IGNORED): the directory was removed."""
        if self.by_wd.get(node.wd) is node:
            del self.by_wd[node.wd]
        self._detach(node)

    # -- the reader thread -----------------------------------------------------------------------

    def _timeout(self) -> float | None:
        return MOVE_PAIRING if self.moving else None

    def _handle(self, events: list[Event]) -> None:
        out: list[tuple[str, str]] = []
        added: list[_Dir] = []
        overflow = lost = False
        with self.lock:
            for wd, mask, cookie, name in events:
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                    continue
                node = self.by_wd.get(wd)
                if node is None:
                    continue  # a watch dropped already
                if mask & IN_IGNORED:
                    self._forget(node)
                    lost = lost or node is self.top
                    continue
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF):
                    lost = lost or node is self.top  # others: their parent's event says it
                    continue
                if not mask & IN_ISDIR:
                    if not is_transient(name):  # a write in progress is no change yet
                        out.append(("p", f"{node.rel()}/{name}" if node.parent else name))
                    continue
                if mask & IN_MOVED_FROM:
                    child = node.children.get(name) if node.children else None
                    if child is not None:
                        self._detach(child)
                        self.moving[cookie] = (child, time.monotonic())
                elif mask & IN_MOVED_TO:
                    moved = self.moving.pop(cookie, None)
                    if moved is not None:
                        old = node.children.get(name) if node.children else None
                        if old is not None and old is not moved[0]:
                            self._drop(old)  # a directory replaced by the rename
                        self._attach(moved[0], node, name)
                        added.append(moved[0])
                    elif not is_transient(name):
                        self._watch_tree(node, name, added)  # moved in from elsewhere, or a Triton tmp dir
                elif mask & IN_CREATE:
                    if not is_transient(name):
                        self._watch_tree(node, name, added)
                elif mask & IN_DELETE:
                    child = node.children.get(name) if node.children else None
                    if child is not None:
                        self._detach(child)  # its IN_IGNORED forgets the watch
                if not is_transient(name):
                    out.append(("d", f"{node.rel()}/{name}" if node.parent else name))
            if self.moving:
                cutoff = time.monotonic() - MOVE_PAIRING
                for cookie in [c for c, (_, t) in self.moving.items() if t < cutoff]:
                    self._drop(self.moving.pop(cookie)[0])  # moved out of the root: stop watching it
        for kind, rel in out:
            self.put(kind, rel)
        self._tell_added(added)
        if overflow:
            self.on_overflow()
        if lost:
            self.on_root_lost()


def _subdirs(fd: int) -> list[str]:
    """The directories in the directory open as `fd`, writes in progress left out."""
    with os.scandir(fd) as it:  # (a duplicate, rewound: fd stays open, and can be listed again)
        return [e.name for e in it if not is_transient(e.name) and e.is_dir(follow_symlinks=False)]


def _is_dir(dir_fd: int, name: str) -> bool:
    try:
        return (os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode & 0o170000) == 0o040000
    except OSError:
        return False
