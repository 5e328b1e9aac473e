"""The file watcher: inotify watches that only enqueue, and one consumer that takes batches.

`inotify.TreeWatcher` keeps a watch on every directory under the cache root and asks for changes
only (create, delete, move, close-after-write): no event for a directory listing, so scans and
its own walks cost no queue space. Hits (read-only opens of fxgraph / AOTAutograd entries) come
from `reads.ReadWatcher`, which watches the key directories only. Both put items on one queue.

The consumer waits for a quiet period (`debounce`) but never longer than `max_wait` after the
first event, then applies the batch with `index.live.apply_batch` in one transaction. A batch of
more than `burst` paths becomes a rescan of the top-level folders it touched. Full and subtree
rescans (the start-up scan, the scheduler's, the one after lost events) and the reading of
pending entries run on the same thread, so index writes never race. cachemgr reads entry files
through a link in its trash folder (`describe.read_unseen`), which is never watched: no read of
its own, in this process or in a CLI's, is taken for a hit.

Events are lost when the kernel queue overflows (fs.inotify.max_queued_events): the consumer then
watches every directory that has no watch (made while events were lost) and rescans the cache,
which finds what the lost events said. Watches run out at fs.inotify.max_user_watches: that is
one log line, and every full rescan watches what has no watch yet, once there is room.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from cachemgr import layout
from cachemgr.daemon.inotify import TreeWatcher
from cachemgr.daemon.reads import ReadWatcher, is_key_dir
from cachemgr.errors import CacheDirError, CachemgrError
from cachemgr.index import live, scan
from cachemgr.index.db import Database
from cachemgr.index.workers import Pool, default_workers

log = logging.getLogger("cachemgr.watcher")

# Changed paths in one batch above which rescanning the top-level folders they are in is cheaper
# than per-entry work (about 1,000 entries a second); below it, a rescan of triton/ on a large
# cache costs more than the batch itself.
BURST = 20000
BATCH = 1000  # paths that close a batch early: under a steady stream, entries appear in smaller steps
SYSCTL = "fs.inotify.max_user_watches"
PARSE_STEP = 500  # pending entries read between two batches of file events
IDLE = 60.0  # seconds without work after which the parse workers are let go
CONTROL = ("stop", "scan", "parse", "overflow", "retry")  # queue items that are not file events

# ("p"|"d"|"r", relpath) | ("scan", subtree, full, Future) | ("parse",) | ("overflow",) | ("stop",)
Item = tuple


WALKERS = 4  # worker processes that walk the tree for a daemon's scan
RETRY = 30.0  # seconds until a rescan takes in what a failed batch (a full disk, a locked index) left out


class Watcher:
    """The inotify watches and their consumer for one cache root."""

    def __init__(
        self,
        db: Database,
        cache_id: int,
        root: str,
        debounce: float,
        max_wait: float,
        on_batch: Callable[[object], None] = lambda r: None,
        on_root_lost: Callable[[], None] = lambda: None,
        burst: int = BURST,
    ) -> None:
        self.db, self.cache_id, self.root = db, cache_id, root
        self.debounce, self.max_wait, self.burst = debounce, max_wait, burst
        self.on_batch, self.on_root_lost = on_batch, on_root_lost
        self.reads: ReadWatcher | None = None
        self.tree: TreeWatcher | None = None
        self._limit_logged = False
        self._overflow_queued = False
        self._retry: threading.Timer | None = None  # a rescan armed after a failed batch or rescan
        self._walked = False  # every directory was just watched by start(): the first rescan needs no walk
        self.q: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self.consumer: threading.Thread | None = None
        self.pool = Pool(min(2, default_workers()))  # parse workers: started on the first entry to read
        self._parse_queued = False
        self.parsed = threading.Event()  # set while no entry a scan left is waiting to be read
        self.parsed.set()

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Watch every directory, then start the consumer. Raises CacheDirError when the root
        cannot be watched. Nothing is scanned yet: `request_scan` (after this, so that nothing
        written meanwhile is missed)."""
        try:
            self.reads = ReadWatcher(self.root, lambda rel: self.q.put(("r", rel)), self._out_of_watches)
            self.tree = TreeWatcher(
                self.root,
                lambda kind, rel: self.q.put((kind, rel)),
                self._on_dir,
                self._overflowed,
                self._out_of_watches,
                self.on_root_lost,
                self.reads.unwatch,
            )
            self.reads.start()
            self.tree.start()
            self._walked = True
        except OSError as e:
            self._stop_watches()
            raise CacheDirError(
                watch_limit_message(self.root)
                if e.errno == errno.ENOSPC
                else f"cannot watch {self.root}: {e.strerror or e}"
            ) from e
        self.consumer = threading.Thread(target=self._consume, name="cachemgr-consumer", daemon=True)
        self.consumer.start()

    def _stop_watches(self, timeout: float = 2.0) -> None:
        for w in (self.tree, self.reads):
            if w is not None:
                w.stop(timeout)
        self.tree = self.reads = None

    def stop(self, timeout: float = 2.0) -> None:
        self._stop_watches(timeout)
        if self._retry is not None:
            self._retry.cancel()
        self.q.put(("stop",))
        if self.consumer is not None:
            self.consumer.join(timeout)
        self.pool.close()
        while True:  # a rescan asked for but never run: its caller must not wait forever
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if item[0] == "scan":
                item[3].set_exception(CacheDirError(f"watching {self.root} stopped before the rescan ran"))

    def alive(self) -> bool:
        return bool(
            self.consumer
            and self.consumer.is_alive()
            and self.tree
            and self.tree.alive()
            and self.reads
            and self.reads.alive()
        )

    def request_scan(self, subtree: str = "", full: bool = False) -> Future:
        """A rescan run on the consumer thread (after the batch in hand); the future holds its
        ScanResult. A rescan of the whole root watches first what has no watch yet; `full` stats
        every file, not only the directories whose mtime moved."""
        f: Future = Future()
        self.q.put(("scan", subtree, full, f))
        return f

    # -- the consumer ----------------------------------------------------------------------------

    def _consume(self) -> None:
        pending: Item | None = None
        while True:
            if pending is None:
                try:
                    item = self.q.get(timeout=IDLE)  # blocks while idle: no polling, no CPU
                except queue.Empty:
                    self.pool.close()  # idle: the parse workers go (started again on the next entry)
                    continue
            else:
                item = pending
            pending = None
            if item[0] == "stop":
                return
            if item[0] == "scan":
                self._scan(item[1], item[3], full=item[2])
                continue
            if item[0] == "parse":
                self._parse_step()
                continue
            if item[0] == "overflow":
                self._overflow_queued = False  # an overflow from now on asks again
                self._scan("", None, why="after lost events")
                continue
            if item[0] == "retry":
                # (what failed was the index; the watches are whole unless some directory got none:
                # descriptors ran out, say, which failed the batch too)
                self._walked = self.tree is None or self.tree.unwatched == 0
                self._scan("", None, why="after a failed batch")
                continue
            paths: set[str] = set()
            dirs: set[str] = set()
            reads: list[str] = []
            first = last = time.monotonic()
            while True:
                self._add(item, paths, dirs, reads)
                if len(paths) + len(dirs) >= BATCH and self.q.qsize() < self.burst:
                    break  # enough for one transaction (unless a real burst is queued: then take it whole)
                wait = min(last + self.debounce, first + self.max_wait) - time.monotonic()
                try:
                    item = self.q.get(timeout=wait) if wait > 0 else self.q.get_nowait()
                except queue.Empty:
                    break
                if item[0] in CONTROL:
                    pending = item  # apply what we hold first
                    break
                last = time.monotonic()
            self._apply(paths, dirs, reads)
            if pending and pending[0] == "stop":
                return

    @staticmethod
    def _add(item: Item, paths: set, dirs: set, reads: list) -> None:
        kind, rel = item
        if kind == "r":
            reads.append(rel)
        elif not any(layout.is_transient(part) for part in rel.split("/")):  # writes in progress
            (dirs if kind == "d" else paths).add(rel)

    def _apply(self, paths: set, dirs: set, reads: list) -> None:
        try:
            if len(paths) + len(dirs) > self.burst:
                tops = sorted({p.split("/", 1)[0] for p in paths | dirs})
                log.info(
                    "burst of %d paths: rescanning %s",
                    len(paths) + len(dirs),
                    ", ".join(tops[:8]) + (f" and {len(tops) - 8} more" if len(tops) > 8 else ""),
                )
                for top in tops:
                    self._scan(top, None)
                paths, dirs = set(), set()
            if not (paths or dirs or reads):
                return
            r = live.apply_batch(self.db, self.cache_id, self.root, paths, dirs, reads, self.pool)
        except CacheDirError:
            self.on_root_lost()  # the daemon's supervisor says so, once
            return
        except CachemgrError as e:
            log.error("applying %d changed paths failed: %s (a rescan in %.0f s takes them in)", len(paths), e, RETRY)
            self._rescan_later()
            return
        except Exception as e:  # noqa: BLE001 - the consumer must outlive one bad batch
            log.error("applying a batch failed: %s: %s (a rescan in %.0f s takes it in)", type(e).__name__, e, RETRY)
            self._rescan_later()
            return
        if r.added or r.changed or r.removed or r.hits:
            log.debug(
                "batch: %d added, %d changed, %d removed, %d hits (%.3f s)",
                len(r.added),
                len(r.changed),
                len(r.removed),
                sum(r.hits.values()),
                r.seconds,
            )
        for key, reason in r.corrupt:
            log.warning("corrupt entry %s: %s", key, reason)
        self._told(r)

    def _told(self, result: object) -> None:
        """`on_batch`, whose failure (an index that cannot sum, a scheduler gone) must not end
        the consumer thread: every later event would be lost until a restart."""
        try:
            self.on_batch(result)
        except Exception as e:  # noqa: BLE001
            log.exception("after a batch: %s: %s", type(e).__name__, e)

    def _rescan_later(self) -> None:
        """The index missed changes (consumer thread): rescan in RETRY seconds, and again after
        each rescan that fails too, until one goes through. (Lost, the daemon stood behind the
        disk until its next scan_interval: an hour, evicting by what it had last seen.)"""
        if self._retry is None or not self._retry.is_alive():
            self._retry = threading.Timer(RETRY, self.q.put, (("retry",),))
            self._retry.daemon = True
            self._retry.start()

    def request_parse(self) -> None:
        """Read the entries a scan left pending, a step at a time between batches."""
        if not self._parse_queued:
            self._parse_queued = True
            self.parsed.clear()
            self.q.put(("parse",))

    def _parse_step(self) -> None:
        self._parse_queued = False
        try:
            p = scan.parse_pending(self.db, self.cache_id, self.root, limit=PARSE_STEP, pool=self.pool)
        except CachemgrError as e:
            log.error("parsing pending entries failed: %s (tried again at the next scan)", e)
            return
        except Exception as e:  # the consumer must outlive it
            log.exception("parsing pending entries failed: %s: %s", type(e).__name__, e)
            return
        for key, reason in p.corrupt:
            log.warning("corrupt entry %s: %s", key, reason)
        if p.parsed:
            log.debug("parsed %d pending entries (%d known by content)", p.parsed, p.from_content)
        if p.parsed >= PARSE_STEP:
            self.request_parse()  # more: after the batches queued meanwhile
        else:
            self.parsed.set()
        self._told(p)

    def _scan(self, subtree: str, future: Future | None, full: bool = False, why: str = "") -> None:
        try:
            if not subtree and not self._walked:
                self._resync()  # watches first: what is made from now on is seen, what was made before is scanned
            self._walked = False
            # a few walkers, not one per core: the daemon shares its host with the work it serves,
            # and each walker's results wait in this process (its memory grows with them)
            walkers = Pool(min(WALKERS, default_workers()))
            try:
                r = scan.reconcile(
                    self.db, self.cache_id, self.root, subtree=subtree, full=full, parse_now=False, pool=walkers
                )
            finally:
                walkers.close()
        except BaseException as e:  # noqa: BLE001 - handed to whoever asked
            if isinstance(e, CacheDirError):
                self.on_root_lost()
            if future is None:
                log.error("rescan of %s failed: %s", subtree or self.root, e)
                if not isinstance(e, CacheDirError):
                    self._rescan_later()
            else:
                future.set_exception(e)
            return
        for d in r.unreadable:
            log.warning("cannot read %s/ under %s: its entries are kept as last indexed", d, self.root)
        for d in r.mounted:
            log.warning("%s/ under %s is a mount point (another file system's): not indexed", d, self.root)
        if why:
            log.info(
                "rescan %s: %d added, %d changed, %d removed, %d unchanged (%.2f s)",
                why,
                r.added,
                r.changed,
                r.removed,
                r.unchanged,
                r.seconds,
            )
        if r.pending:
            self.request_parse()
        if future is not None:
            future.set_result(r)
        self._told(r)

    # -- the watches -----------------------------------------------------------------------------

    def _on_dir(self, rel: str) -> None:
        """A directory is watched from now on (tree watcher's thread, or a resync)."""
        if self.reads is not None and is_key_dir(rel):
            self.reads.watch([rel])

    def _overflowed(self) -> None:
        """The kernel queue overflowed (reader thread): one rescan, queued behind the events in hand."""
        if not self._overflow_queued:
            self._overflow_queued = True
            log.warning(
                "inotify queue overflowed under %s: events were lost; watching new directories and rescanning",
                self.root,
            )
            self.q.put(("overflow",))

    def _resync(self) -> None:
        tree = self.tree
        if tree is None:
            return
        unwatched = tree.resync()
        if unwatched == 0 and self._limit_logged:
            self._limit_logged = False
            log.info("every directory under %s is watched again (%d watches)", self.root, tree.watches())

    def _out_of_watches(self) -> None:
        """A directory got no watch (ENOSPC): one log line until a resync watches everything."""
        if not self._limit_logged:
            self._limit_logged = True
            log.error(watch_limit_message(self.root))


# -- inotify watch limits ------------------------------------------------------------------------


def max_user_watches() -> int | None:
    try:
        with open("/proc/sys/fs/inotify/max_user_watches") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def watch_limit_message(root: str) -> str:
    return (
        f"out of inotify watches under {root} ({SYSCTL} = {max_user_watches()}, for all of this user's "
        f"processes): new entries in directories without a watch are indexed only by the rescan every "
        f"scan_interval, which also watches them once there is room; raise it with `sysctl -w {SYSCTL}=<more>` "
        f"(and in /etc/sysctl.d/ to keep it)"
    )
