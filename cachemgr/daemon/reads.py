"""Read-only opens of fxgraph and AOTAutograd entries: how the daemon sees cache hits.

An inotify instance of its own (`inotify.Reader`: one thread) with an IN_CLOSE_NOWRITE watch on
each fxgraph and AOTAutograd key directory only. Why not the tree watcher's instance: read events
on every directory would include every directory *listing* (each scan, each resync walk), which
would fill the kernel queue that the tree's changes share; an overflow there costs a full rescan,
here only some hits. Key directories hold only entry files, so here a listing is one event (on
the directory itself, ignored) and every file event is a real read. IN_CLOSE_NOWRITE (not
IN_OPEN) is sent to readers only, never to the writer of a new file.

Directories are named as on disk, relative to the root (not as index keys, which %-escape odd
names): the tree watcher hands them over as it watches them.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterable

from cachemgr.daemon.inotify import IN_CLOSE_NOWRITE, IN_IGNORED, IN_ISDIR, IN_ONLYDIR, IN_Q_OVERFLOW, Event, Reader

log = logging.getLogger("cachemgr.watcher")


def is_key_dir(rel: str) -> bool:
    """fxgraph/<2ch>/<graph key> or aotautograd/<key>: a directory of entries whose reads are hits."""
    parts = rel.split("/")
    return (parts[0] == "fxgraph" and len(parts) == 3) or (parts[0] == "aotautograd" and len(parts) == 2)


class ReadWatcher:
    def __init__(self, root: str, put: Callable[[str], None], on_limit: Callable[[], None]) -> None:
        self.root, self.put, self.on_limit = root, put, on_limit
        self.lock = threading.Lock()  # watch() runs on the tree watcher's thread and the consumer's
        self.by_wd: dict[int, str] = {}
        self.by_dir: dict[str, int] = {}
        self.reader = Reader("cachemgr-reads", self._handle)

    def start(self) -> None:
        self.reader.start()

    def watch(self, reldirs: Iterable[str]) -> None:
        """Watch these directories (relative to the root, as on disk) for reads. A name watched
        already is asked again: it may be a new directory in place of an evicted one."""
        for rel in reldirs:
            with self.lock:
                try:
                    wd = self.reader.ino.watch_dir(self.root, rel, IN_CLOSE_NOWRITE | IN_ONLYDIR)
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        self.on_limit()
                        return
                    continue  # gone already, or not a directory
                old = self.by_wd.get(wd)
                if old is not None and old != rel and self.by_dir.get(old) == wd:
                    del self.by_dir[old]  # the same directory, moved: one watch, the new name
                self.by_wd[wd], self.by_dir[rel] = rel, wd

    def unwatch(self, rel: str) -> None:
        """Stop counting reads in the directory that was at `rel` (the tree watcher let it go:
        moved out of the root, its reads are no cache hits). Told late (a move out is settled
        after a delay), the path may name another directory by then: that one is watched again."""
        with self.lock:
            wd = self.by_dir.pop(rel, None)
            if wd is None:
                return
            if self.by_wd.get(wd) == rel:
                del self.by_wd[wd]
                self.reader.ino.rm_watch(wd)
        self.watch([rel])  # (nothing there now, or no directory: nothing is watched)

    def alive(self) -> bool:
        return self.reader.alive()

    def stop(self, timeout: float = 2.0) -> None:
        self.reader.stop(timeout)

    def _handle(self, events: list[Event]) -> None:
        for wd, mask, _cookie, name in events:
            if mask & IN_Q_OVERFLOW:
                log.warning("inotify read queue overflowed: some cache hits were not counted")
                continue
            with self.lock:
                rel = self.by_wd.get(wd)
                if mask & IN_IGNORED:  # the directory went away (evicted)
                    self.by_wd.pop(wd, None)
                    if rel is not None and self.by_dir.get(rel) == wd:
                        del self.by_dir[rel]
                    continue
            if rel is not None and name and not mask & IN_ISDIR:
                self.put(f"{rel}/{name}")
