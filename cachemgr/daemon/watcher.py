"""The file watcher: a watchdog handler that only enqueues, and one consumer that takes batches.

The consumer waits for a quiet period (`debounce`) but never longer than `max_wait` after the
first event, then applies the batch with `index.live.apply_batch` in one transaction. A batch of
more than `burst` paths becomes a rescan of the top-level folders it touched. Full and subtree
rescans asked for by the scheduler run on the same thread, so index writes never race and the
watcher can tell its own reads of entry files (parsing them) from the workload's.

The recursive watchdog watch asks for changes only (create, delete, move, close-after-write):
no event for a directory listing, so scans and watchdog's own walks cost no queue space. Hits
(read-only opens of fxgraph / AOTAutograd entries) come from `reads.ReadWatcher`, which watches
the key directories only, and reach the consumer through the same queue.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from watchdog import events as ev
from watchdog.observers import Observer

from cachemgr import layout
from cachemgr.daemon.reads import ReadWatcher
from cachemgr.errors import CacheDirError, CachemgrError
from cachemgr.index import live, scan
from cachemgr.index.db import Database
from cachemgr.index.workers import Pool, default_workers

log = logging.getLogger("cachemgr.watcher")

EVENT_FILTER = [
    ev.FileCreatedEvent, ev.FileDeletedEvent, ev.FileMovedEvent, ev.FileClosedEvent,
    ev.DirCreatedEvent, ev.DirDeletedEvent, ev.DirMovedEvent,
]
# Changed paths in one batch above which rescanning the top-level folders they are in is cheaper
# than per-entry work (about 1,000 entries a second); below it, a rescan of triton/ on a large
# cache costs more than the batch itself.
BURST = 20000
BATCH = 1000  # paths that close a batch early: under a steady stream, entries appear in smaller steps
SYSCTL = "fs.inotify.max_user_watches"
PARSE_STEP = 500  # pending entries read between two batches of file events
IDLE = 60.0  # seconds without work after which the parse workers are let go

Item = tuple  # ("p"|"d"|"r", relpath) | ("scan", subtree, Future) | ("parse",) | ("stop",)


class Handler(ev.FileSystemEventHandler):
    """Runs on watchdog's thread: turn events into queue items, nothing else."""

    def __init__(self, root: str, q: queue.SimpleQueue, on_root_lost: Callable[[], None]) -> None:
        self.root, self.cut, self.q, self.on_root_lost = root, len(root) + 1, q, on_root_lost

    def _rel(self, path: str | bytes) -> str:
        return os.fsdecode(path)[self.cut:]

    def dispatch(self, event: ev.FileSystemEvent) -> None:
        t = type(event)
        if event.is_directory and os.fsdecode(event.src_path) == self.root:
            if t is ev.DirDeletedEvent:
                self.on_root_lost()
            return
        kind = "d" if event.is_directory else "p"
        if event.src_path:
            self.q.put((kind, self._rel(event.src_path)))
        if t in (ev.FileMovedEvent, ev.DirMovedEvent) and event.dest_path:
            self.q.put((kind, self._rel(event.dest_path)))


class Watcher:
    """The observer and its consumer for one cache root."""

    def __init__(self, db: Database, cache_id: int, root: str, debounce: float, max_wait: float,
                 on_batch: Callable[[object], None] = lambda r: None,
                 on_root_lost: Callable[[], None] = lambda: None, on_overflow: Callable[[], None] = lambda: None,
                 burst: int = BURST) -> None:
        self.db, self.cache_id, self.root = db, cache_id, root
        self.debounce, self.max_wait, self.burst = debounce, max_wait, burst
        self.on_batch, self.on_root_lost, self.on_overflow = on_batch, on_root_lost, on_overflow
        self.reads: ReadWatcher | None = None
        self._limit_logged = False
        self.q: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self.observer = None
        self.consumer: threading.Thread | None = None
        self.pool = Pool(min(2, default_workers()))  # parse workers: started on the first entry to read
        self._parse_queued = False
        self.parsed = threading.Event()  # set once no entry is pending
        self._own: dict[str, list] = {}  # path -> [reads of ours not yet seen as events, when]

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the consumer and the observer. Raises CacheDirError when the root cannot be watched."""
        self.consumer = threading.Thread(target=self._consume, name="cachemgr-consumer", daemon=True)
        self.consumer.start()
        self.reads = ReadWatcher(self.root, lambda rel: self.q.put(("r", rel)), self._out_of_watches)
        self.reads.watch(self._key_dirs_in_index())
        _OVERFLOW_LISTENERS.append(self.on_overflow)
        obs = Observer()
        try:
            obs.schedule(Handler(self.root, self.q, self.on_root_lost), self.root, recursive=True,
                         event_filter=EVENT_FILTER)
            obs.start()
        except OSError as e:
            self.q.put(("stop",))
            self.reads.stop()
            if e.errno == errno.ENOSPC:
                log.error(watch_limit_message(self.root))
            raise CacheDirError(f"cannot watch {self.root}: {e.strerror or e}") from e
        self.observer = obs
        self.check_watches()

    def stop(self, timeout: float = 2.0) -> None:
        if self.on_overflow in _OVERFLOW_LISTENERS:
            _OVERFLOW_LISTENERS.remove(self.on_overflow)
        if self.reads is not None:
            self.reads.stop()
        if self.observer is not None:
            self.observer.stop()
        self.q.put(("stop",))
        if self.observer is not None:
            self.observer.join(timeout)
        if self.consumer is not None:
            self.consumer.join(timeout)
        self.pool.close()
        while True:  # a rescan asked for but never run: its caller must not wait forever
            try:
                item = self.q.get_nowait()
            except queue.Empty:
                break
            if item[0] == "scan":
                item[2].set_exception(CacheDirError(f"watching {self.root} stopped before the rescan ran"))

    def check_watches(self) -> bool:
        return check_watches(self.root, len(self.reads.by_dir) if self.reads else 0)

    def alive(self) -> bool:
        return bool(self.observer and self.observer.is_alive() and self.consumer and self.consumer.is_alive()
                    and self.reads and self.reads.alive())

    def request_scan(self, subtree: str = "") -> Future:
        """A rescan run on the consumer thread (after the batch in hand); the future holds its ScanResult."""
        f: Future = Future()
        self.q.put(("scan", subtree, f))
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
                self._scan(item[1], item[2])
                continue
            if item[0] == "parse":
                self._parse_step()
                continue
            paths, dirs, reads = set(), set(), []
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
                if item[0] in ("stop", "scan", "parse"):
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
        reads = self._drop_own(reads)
        try:
            if len(paths) + len(dirs) > self.burst:
                tops = sorted({p.split("/", 1)[0] for p in paths | dirs})
                log.info("burst of %d paths: rescanning %s", len(paths) + len(dirs), ", ".join(tops[:8])
                         + (f" and {len(tops) - 8} more" if len(tops) > 8 else ""))
                for top in tops:
                    self._scan(top, None)
                paths, dirs = set(), set()
            if not (paths or dirs or reads):
                return
            self._watch_reads(paths)  # before parsing: our own read of a new entry is then seen, and discounted
            r = live.apply_batch(self.db, self.cache_id, self.root, paths, dirs, reads, self.pool, self._reading)
        except CacheDirError:
            self.on_root_lost()  # the daemon's supervisor says so, once
            return
        except CachemgrError as e:
            log.error("applying %d changed paths failed: %s (the next full scan repairs the index)", len(paths), e)
            return
        except Exception as e:  # noqa: BLE001 - the consumer must outlive one bad batch
            log.exception("applying a batch failed: %s: %s", type(e).__name__, e)
            return
        if r.added or r.changed or r.removed or r.hits:
            log.debug("batch: %d added, %d changed, %d removed, %d hits (%.3f s)", len(r.added), len(r.changed),
                      len(r.removed), sum(r.hits.values()), r.seconds)
        for key, reason in r.corrupt:
            log.warning("corrupt entry %s: %s", key, reason)
        self.on_batch(r)

    def request_parse(self) -> None:
        """Read the entries a scan left pending, a step at a time between batches."""
        if not self._parse_queued:
            self._parse_queued = True
            self.q.put(("parse",))

    def _parse_step(self) -> None:
        self._parse_queued = False
        try:
            p = scan.parse_pending(self.db, self.cache_id, self.root, limit=PARSE_STEP, pool=self.pool,
                                   reading=self._reading)
        except CachemgrError as e:
            log.error("parsing pending entries failed: %s (tried again at the next scan)", e)
            return
        except Exception as e:  # noqa: BLE001 - the consumer must outlive it
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
        self.on_batch(p)

    def _reading(self, entries: list[tuple[str, str]]) -> None:
        self._mark_own(live.own_reads(entries))

    def _scan(self, subtree: str, future: Future | None) -> None:
        try:
            r = scan.reconcile(self.db, self.cache_id, self.root, subtree=subtree, parse_now=False)
        except BaseException as e:  # noqa: BLE001 - handed to whoever asked
            if isinstance(e, CacheDirError):
                self.on_root_lost()
            if future is None:
                log.error("rescan of %s failed: %s", subtree or self.root, e)
            else:
                future.set_exception(e)
            return
        for d in r.unreadable:
            log.warning("cannot read %s/ under %s: its entries are kept as last indexed", d, self.root)
        self._watch_reads(r.new_keys)
        if r.pending:
            self.request_parse()
        if future is not None:
            future.set_result(r)
        self.on_batch(r)

    # -- read watches on key directories ---------------------------------------------------------

    def _key_dirs_in_index(self) -> set[str]:
        from sqlalchemy import select

        from cachemgr.index.scan import ENTRIES

        with self.db.engine.connect() as conn:
            keys = conn.execute(select(ENTRIES.c.key).where(
                ENTRIES.c.cache_id == self.cache_id, ENTRIES.c.kind.in_(live.GUARDED))).scalars()
            return {k.rsplit("/", 1)[0] for k in keys}

    def _watch_reads(self, paths) -> None:  # noqa: ANN001 - entry keys or file paths
        if self.reads is not None:
            dirs = {k.rsplit("/", 1)[0] for k in paths if k.startswith(("fxgraph/", "aotautograd/")) and
                    k.count("/") == (3 if k.startswith("fxgraph/") else 2)}
            if dirs:
                self.reads.watch(dirs)

    def _out_of_watches(self) -> None:
        if not self._limit_logged:
            self._limit_logged = True
            log.error(watch_limit_message(self.root))

    # -- our own reads are not hits ----------------------------------------------------------------

    def _mark_own(self, paths: list[str]) -> None:
        """Reads of ours that the read watcher will report (only files in watched directories)."""
        watched = self.reads.by_dir if self.reads else {}
        now = time.monotonic()
        for p in paths:
            if p.rsplit("/", 1)[0] not in watched:
                continue
            slot = self._own.setdefault(p, [0, now])
            slot[0] += 1
            slot[1] = now

    def _drop_own(self, reads: list[str]) -> list[str]:
        if not self._own:
            return reads
        out = []
        for p in reads:
            slot = self._own.get(p)
            if slot and slot[0] > 0:
                slot[0] -= 1
                continue
            out.append(p)
        cutoff = time.monotonic() - 60
        self._own = {p: s for p, s in self._own.items() if s[0] > 0 and s[1] > cutoff}
        return out


# -- inotify queue overflow ---------------------------------------------------------------------

_OVERFLOW_LISTENERS: list[Callable[[], None]] = []


def _keep_watches_on_overflow() -> None:
    """watchdog 7 answers a queue overflow by removing every recursive watch (an IN_IGNORED event
    each) and walking the tree to add them again; over a large cache the removals alone refill
    the queue, so it overflows again, forever (seen: 95 % CPU, idle, over 14,000 directories).
    An overflow loses events, not watches: keep them, drop the half-paired moves, and let the
    daemon schedule a full rescan, which is what heals lost events."""
    try:
        from watchdog.observers.inotify import InotifyWatchGroup
    except ImportError:
        return
    if not hasattr(InotifyWatchGroup, "on_queue_overflow"):
        return

    def on_queue_overflow(self) -> None:  # noqa: ANN001 - watchdog's InotifyWatchGroup
        with self._lock:
            if self.is_active:
                self._move_event_grouper.discard_pending_events()
        log.warning("inotify queue overflowed: events were lost; a full rescan is scheduled")
        for listener in list(_OVERFLOW_LISTENERS):
            listener()

    InotifyWatchGroup.on_queue_overflow = on_queue_overflow

    # Moving a directory re-keys the watches below it by scanning every watch (a copy of the
    # whole table per move): over 14,000 watched directories a burst of Triton kernels (each a
    # tmp.pid_* directory renamed into place) spent seconds there and starved the consumer.
    # A moved directory with no subdirectories now has only its own watch to move.
    original_move = getattr(InotifyWatchGroup, "_move_watches", None)
    if original_move is None:
        return

    def _move_watches(self, move_src_path: bytes, move_dst_path: bytes) -> bool:  # noqa: ANN001
        try:
            leaf = not any(d.is_dir(follow_symlinks=False) for d in os.scandir(move_dst_path))
        except OSError:
            leaf = False
        if not leaf:
            return original_move(self, move_src_path, move_dst_path)
        wd = self._active_callbacks_by_path.pop(move_src_path, None)
        if wd is None:
            return False
        self._active_callbacks_by_watch[wd] = move_dst_path
        self._active_callbacks_by_path[move_dst_path] = wd
        return True

    InotifyWatchGroup._move_watches = _move_watches

    # Re-adding a watch that a directory has already (its create event handled after a walk that
    # watched it) made watchdog format a warning around repr(Watch), which holds the repr of the
    # whole watch group: every watched path, twice. Over a 100,000-file cache that is tens of ms
    # per re-add on the inotify thread, holding the GIL. service.py filters the warning anyway.
    from watchdog.observers.inotify_c import InotifyFD

    if hasattr(InotifyFD, "_get_or_create_watch"):
        def _add_callback(self, path, mask, callback, id_):  # noqa: ANN001, ANN202 - watchdog's signature
            watch = self._get_or_create_watch(path, mask)
            watch.callbacks[id_] = callback
            return watch.wd

        InotifyFD._add_callback = _add_callback

    # Pairing a rename's IN_MOVED_TO with its IN_MOVED_FROM scans the pending-event queue from
    # its oldest end; when a burst of renames (every write_atomic is one) queues thousands of
    # events, each rename costs the whole queue: quadratic, and the inotify thread held the GIL
    # for 3 of 7 seconds in the 1,000-entry burst. The match is almost always the newest event
    # and cookies are unique, so search from the newest end: same result, constant time.
    try:
        from watchdog.utils.delayed_queue import DelayedQueue
    except ImportError:
        return
    if hasattr(DelayedQueue, "_index_and_item"):
        def _index_and_item(self, predicate):  # noqa: ANN001, ANN202 - watchdog's signature
            n = len(self._queue)
            for j, (elem, *_) in enumerate(reversed(self._queue)):
                if predicate(elem):
                    return n - 1 - j, elem
            return None

        DelayedQueue._index_and_item = _index_and_item

        # The emitter takes events from the head of that queue. When the head was a rename's
        # IN_MOVED_FROM it slept out the whole pairing delay (0.5 s), although the IN_MOVED_TO
        # that pairs it, and takes it out of the queue, came microseconds later: every event
        # behind it waited too, so under a stream of renames events reached the handler in
        # 0.5 s steps. Wait on the queue's condition instead (put() notifies, and the pair is
        # put right after the removal) and look at the head again; an unpaired move still
        # waits its full delay.
        def get(self):  # noqa: ANN001, ANN202 - watchdog's signature
            with self._not_empty:
                while True:
                    while not self._queue and not self._closed:
                        self._not_empty.wait()
                    if self._closed:
                        return None
                    head, inserted, delay = self._queue[0]
                    left = inserted + self.delay - time.monotonic() if delay else 0
                    if left > 0:
                        self._not_empty.wait(left)
                        continue
                    self._queue.popleft()
                    return head

        DelayedQueue.get = get


_keep_watches_on_overflow()


# -- inotify watch limits ------------------------------------------------------------------------

def max_user_watches() -> int | None:
    try:
        with open("/proc/sys/fs/inotify/max_user_watches") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def watch_limit_message(root: str, dirs: int | None = None, watches: int | None = None) -> str:
    limit = max_user_watches()
    have = f" ({watches} watches for {dirs} directories)" if dirs is not None else ""
    return (f"out of inotify watches under {root}{have}: changes in unwatched directories are only seen by the "
            f"periodic full scan; raise the limit with `sysctl {SYSCTL}=<more>` (now {limit}) "
            f"and restart cachemgr")


def our_watches() -> int | None:
    """Inotify watches this process holds, read from /proc/self/fdinfo (Linux)."""
    total, found = 0, False
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != "anon_inode:inotify":
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                total += sum(1 for line in f if line.startswith("inotify wd:"))
            found = True
        except OSError:
            continue
    return total if found else None


def check_watches(root: str, others: int = 0) -> bool:
    """Log one clear line when some directories under root got no watch (the limit was hit).

    watchdog quietly skips subdirectories it cannot watch, so we count: a watch per directory.
    """
    watches = our_watches()
    if watches is None:
        return True
    watches -= others  # the read watcher's key-directory watches
    dirs = sum(1 for _ in os.walk(root))
    if watches + 1 < dirs:  # +1: a directory created between the two counts
        log.error(watch_limit_message(root, dirs, watches))
        return False
    return True
