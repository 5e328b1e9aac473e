"""Read-only opens of fxgraph and AOTAutograd entries: how the daemon sees cache hits.

A plain inotify instance (ctypes, one thread) with an IN_CLOSE_NOWRITE watch on each fxgraph
and AOTAutograd key directory only. Why not the recursive watchdog watch: read events on every
directory would include every directory *listing* (each scan, watchdog's own walk when it adds
watches), four events per directory, which overflows the kernel queue (16,384 events by
default) on a large cache. Key directories hold only entry files, so here a listing is two
events and every file event is a real read. IN_CLOSE_NOWRITE (not IN_OPEN) is sent to readers
only, never to the writer of a new file.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger("cachemgr.watcher")

IN_CLOSE_NOWRITE, IN_Q_OVERFLOW, IN_IGNORED, IN_ONLYDIR, IN_ISDIR = 0x10, 0x4000, 0x8000, 0x01000000, 0x40000000
HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len


class ReadWatcher:
    def __init__(self, root: str, put: Callable[[str], None], on_limit: Callable[[], None]) -> None:
        self.root, self.put, self.on_limit = root, put, on_limit
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1: " + os.strerror(ctypes.get_errno()))
        self.lock = threading.Lock()
        self.by_wd: dict[int, str] = {}
        self.by_dir: dict[str, int] = {}
        self.stop_r, self.stop_w = os.pipe()
        self.thread = threading.Thread(target=self._run, name="cachemgr-reads", daemon=True)
        self.thread.start()

    def watch(self, reldirs: Iterable[str]) -> None:
        """Watch these key directories (relative to the root) for reads; known ones are skipped."""
        for rel in reldirs:
            if rel in self.by_dir:
                continue
            wd = self.libc.inotify_add_watch(self.fd, os.fsencode(os.path.join(self.root, rel)),
                                             IN_CLOSE_NOWRITE | IN_ONLYDIR)
            if wd < 0:
                if ctypes.get_errno() == errno.ENOSPC:
                    self.on_limit()
                    return
                continue  # gone already, or not a directory
            with self.lock:
                self.by_wd[wd], self.by_dir[rel] = rel, wd

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 2.0) -> None:
        os.write(self.stop_w, b"x")
        self.thread.join(timeout)
        for fd in (self.fd, self.stop_r, self.stop_w):
            os.close(fd)

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd, self.stop_r], [], [])
            if self.stop_r in ready:
                return
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            i = 0
            while i + HEADER.size <= len(buf):
                wd, mask, _cookie, n = HEADER.unpack_from(buf, i)
                name = buf[i + HEADER.size:i + HEADER.size + n].rstrip(b"\0").decode(errors="surrogateescape")
                i += HEADER.size + n
                if mask & IN_Q_OVERFLOW:
                    log.warning("inotify read queue overflowed: some cache hits were not counted")
                    continue
                with self.lock:
                    rel = self.by_wd.get(wd)
                    if mask & IN_IGNORED:  # the directory went away (evicted)
                        self.by_wd.pop(wd, None)
                        if rel is not None:
                            self.by_dir.pop(rel, None)
                        continue
                if rel is not None and name and not mask & IN_ISDIR:
                    self.put(f"{rel}/{name}")
