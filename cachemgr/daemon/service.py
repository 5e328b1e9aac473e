"""The daemon: start-up in order, the main loop (signals, supervision, systemd watchdog), stop.

Start-up: config (given) -> database (migrated) -> inotify watches -> full reconcile (on the
watcher's consumer thread: nothing written meanwhile is missed) -> scheduler -> READY=1; pending
entries are read after READY, between batches of file events. The main thread only waits and
supervises: SIGTERM/SIGINT stop it, SIGHUP reloads the
config, and every tick it checks that the cache root is still there (a missing, removed or
unreadable root is logged once; the daemon keeps running and recovers when the root comes back).
Index writes happen on the watcher's consumer thread; eviction on the scheduler's.

One daemon per cache dir and index (DaemonLocks): before anything else it takes exclusive flocks
on lock files in its state dir, one named by a hash of (cache dir, index URL) and one by the
cache dir alone (two daemons on one cache with different indexes would both evict it), plus,
once the root is checked, a flock on the root's trash folder, which every user and state dir
share. A second daemon exits at once with AlreadyRunning (exit 10), naming the PID that holds
the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import faulthandler
import fcntl
import functools
import hashlib
import logging
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from cachemgr import layout, safefs
from cachemgr.config import Settings, redact_url, state_dir
from cachemgr.daemon import systemd
from cachemgr.daemon.watcher import Watcher
from cachemgr.errors import AlreadyRunning, CacheDirError, CachemgrError, UsageError
from cachemgr.index.db import Database
from cachemgr.index.pending import ParseResult
from cachemgr.index.result import check_root

if TYPE_CHECKING:
    from cachemgr.daemon.metrics import Metrics
    from cachemgr.index.result import ScanResult

log = logging.getLogger("cachemgr.daemon")
SPOOL_INTERVAL = 30.0  # seconds between spool ingests: recorded shapes reach the index this fast

STOP_DEADLINE = 3.5  # seconds for jobs to finish after SIGTERM; systemd's stop timeout is longer
TRIGGER_GAP = 5.0  # seconds between evictions started by crossing max_size / max_files
MOUNT_RESCANS = 16  # folders read again for changed mount points, past which the whole cache is
RESTART_KEYS = ("cache_dir", "db", "host")  # a reload that changes these reopens everything


def _exit_now(why: str) -> NoReturn:
    """Exit at once, not waiting for work that cannot be interrupted (crash-safe, repaired by the
    next start's full scan), rather than be killed by systemd's stop timeout."""
    log.warning("%s; exiting anyway (the next start reconciles)", why)
    logging.shutdown()
    os._exit(0)


def _check_usable(root: str) -> None:
    """CacheDirError unless `root` is there, readable and an Inductor cache: checked at every
    (re)start of watching, not only at start (the root replaced by a symlink to a home dir, or
    a reload naming another folder, was watched and indexed)."""
    from cachemgr.errors import UnsafePath
    from cachemgr.evict.execute import refuse_foreign_root

    check_root(root)
    try:
        refuse_foreign_root(root, "watch and evict it")
    except UnsafePath as e:
        raise CacheDirError(str(e)) from e


def _identity(root: str) -> tuple[int, int, int]:
    st = os.stat(root)  # (a root that is a symlink: the directory it names)
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _opened(s: Settings) -> tuple[Database, int]:
    """The index of `s` (migrated; a named one is not made) and the id of its cache's row."""
    db = Database(s.db, create_folder=s.defaulted("db"))
    try:
        return db, db.cache_id(s.host, s.cache_dir)
    except BaseException:
        db.close()
        raise


def setup_logging(level: int = logging.INFO) -> None:
    """One line per event with its level. Under journald (JOURNAL_STREAM) no timestamp, and a
    <N> syslog priority prefix that journald turns into the entry's priority."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(journald=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)  # libraries (alembic, apscheduler): warnings only
    logging.getLogger("cachemgr").setLevel(level)


class _OneLine(logging.Formatter):
    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self, journald: bool) -> None:
        super().__init__("%(message)s" if journald else "%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record).replace("\n", " | ")
        return f"<{self.PRIORITY.get(record.levelno, 6)}>{line}" if self.journald else line


def tune_malloc() -> None:
    """Entry pickles run to several MB. glibc raises its mmap threshold after the first such
    buffer is freed, so later ones land on the heap and fragment it: RSS stays at the peak of a
    burst (150 MB after 1,000 new entries, measured). A fixed threshold and few arenas keep big
    buffers in mmap (returned to the OS when freed) and RSS near its idle size."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass  # not glibc


def release_memory(db: Database) -> None:
    """After the start-up scan: its garbage is freed but stays mapped (glibc keeps freed heap
    pages), and each pooled SQLite connection keeps up to 8 MB of the pages the scan read. Both
    go back to the OS; connections are opened again as needed. Idle RSS is then that of the
    watches, not of the scan's peak."""
    db.engine.dispose()  # (a connection checked out now is closed when it is given back)
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


class DaemonLocks:
    """The flocks that make one daemon per cache dir and index. Each is held by an open file
    description of this process (O_CLOEXEC: no child keeps it), so it goes when the process does,
    however it dies; a lock file left behind with an old PID in it blocks nobody."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory if directory is not None else state_dir() / "locks"
        self.held: dict[str, int] = {}  # what the lock is on -> its fd

    def hold(self, cache_dir: str, db: str, in_root: bool = False) -> None:
        """Hold the locks of (cache_dir, db), keeping those already held and letting go of the
        rest; AlreadyRunning (and nothing changed) when another process holds one. `in_root`: the
        root has been checked (an Inductor cache, there and readable), so the lock inside it is
        taken too; without it, one already held on the same root is kept."""
        root = os.path.realpath(cache_dir)
        wanted = {f"pair-{_digest(root, db)}": self._file, f"cache-{_digest(root)}": self._file}
        inside = f"trash-{_digest(root)}-"
        if in_root:
            trash = os.path.join(root, layout.TRASH_DIR)
            try:
                os.mkdir(trash, 0o700)  # the evictor's own folder: made ahead of time is no harm
            except OSError:
                pass
            try:
                st = os.lstat(trash)
                if stat.S_ISDIR(st.st_mode):
                    wanted[f"{inside}{st.st_dev}-{st.st_ino}"] = self._trash
            except OSError:
                pass  # no room, no permission, or not a folder: the state dir's locks stand alone
        else:
            wanted.update((n, self._trash) for n in self.held if n.startswith(inside))
        taken: dict[str, int] = {}
        try:
            for name, opener in wanted.items():
                if name not in self.held:
                    fd = opener(name, root)
                    if fd is not None:
                        taken[name] = fd
        except BaseException:
            for fd in taken.values():
                os.close(fd)
            raise
        for name in [n for n in self.held if n not in wanted]:
            os.close(self.held.pop(name))
        self.held.update(taken)

    def release(self) -> None:
        for fd in self.held.values():
            os.close(fd)
        self.held.clear()

    def _file(self, name: str, root: str) -> int | None:
        path = self.directory / f"daemon-{name}.lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            # no writable state dir: the lock on the cache directory itself still stands
            log.warning(
                "cannot use the lock file %s (%s); relying on the cache directory's lock", path, e.strerror or e
            )
            return None
        if not _try_flock(fd):
            pid = _pid_in(fd) or _flock_holder(os.fstat(fd))
            os.close(fd)
            raise AlreadyRunning(self._message(name, root, pid, path))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{root}\n".encode(), 0)
        return fd

    def _trash(self, name: str, root: str) -> int | None:
        """A flock on the root's trash folder: every user and state dir sees it. Not on the root
        itself, which the evictor flocks for each run (a CLI evict beside the daemon waits on it)."""
        try:
            fd = os.open(
                os.path.join(root, layout.TRASH_DIR), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError:
            return None  # gone meanwhile: the next hold takes the new one
        st = os.fstat(fd)
        if not name.endswith(f"-{st.st_dev}-{st.st_ino}"):
            os.close(fd)
            return None  # replaced between lstat and open: the next hold takes it
        if not _try_flock(fd):
            pid = _flock_holder(st)
            os.close(fd)
            raise AlreadyRunning(self._message(name, root, pid, None))
        return fd

    @staticmethod
    def _message(name: str, root: str, pid: int | None, path: Path | None) -> str:
        who = f"PID {pid}" if pid else "a process whose PID cannot be read"
        what = {
            "pair": f"cache dir {root} and this index",
            "cache": f"cache dir {root} (with another index: two daemons would both evict it)",
            "trash": f"cache dir {root} (perhaps as another user)",
        }[name.split("-")[0]]
        where = f" (lock {path})" if path else ""
        return f"another cachemgr daemon ({who}) already serves {what}{where}"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:20]


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def _pid_in(fd: int) -> int | None:
    """The PID the holder wrote into its lock file (the first line), if it did yet."""
    try:
        first = os.pread(fd, 64, 0).split(b"\n", 1)[0]
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def _flock_holder(st: os.stat_result) -> int | None:
    """Who holds a flock on this inode, from /proc/locks (Linux); None if it cannot be told."""
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" in fields and ident in fields:
                    pid = fields[fields.index(ident) - 1]
                    return int(pid) if pid.isdigit() else None
    except OSError:
        pass
    return None


class Jobs:
    """The scheduler's jobs, counted while they run: stopping waits for them with a deadline
    (APScheduler's own shutdown waits without one), and none starts once closed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.running: list[str] = []  # what each running job does, as a log line names it
        self.closed = False

    def wrap(self, fn: Callable[[], None], what: str) -> Callable[[], None]:
        @functools.wraps(fn)
        def job() -> None:
            with self.cond:
                if self.closed:
                    return
                self.running.append(what)
            try:
                fn()
            finally:
                with self.cond:
                    self.running.remove(what)
                    self.cond.notify_all()

        return job

    def close(self, deadline: float) -> list[str]:
        """No job starts from now on; wait until none runs or the deadline. What still runs then."""
        with self.cond:
            self.closed = True
            self.cond.wait_for(lambda: not self.running, max(0.0, deadline - time.monotonic()))
            return list(self.running)


class Waker:
    """Wakes the daemon's main loop, from its signal handlers and from other threads.

    Not a `threading.Event`: a handler runs on the main thread between two bytecodes, and if those
    are inside the loop's own `Event.wait` or `clear`, which hold the event's lock, the handler's
    `set` waits for that lock for ever (a SIGHUP or SIGTERM hung the daemon). A pipe has no lock.
    Its two descriptors live as long as the process: a late `set` from a thread never writes to a
    descriptor that was closed and reused."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        try:
            os.write(self.w, b"!")
        except BlockingIOError:  # the pipe is full: the loop has wake-ups enough
            pass

    def wait(self, timeout: float) -> None:
        """Return after `timeout` seconds, or sooner once `set` was called (since the last wait)."""
        select.select([self.r], [], [], timeout)
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:  # drained
            pass


class Daemon:
    """`cachemgr daemon`. `load` re-reads the effective settings (at start and on SIGHUP)."""

    def __init__(self, load: Callable[[], Settings]) -> None:
        self.load = load
        self.wake = Waker()
        self.stopping = self.reload_asked = False
        self.root_lost = threading.Event()
        # The root as it was last checked to be an Inductor cache ((device, inode, mtime) and the
        # refusal, or None): that check lists its folders, a second at a million files, so it runs
        # again only for another directory (or, while not watching, one changed since).
        self.root_checked: tuple[tuple[int, int, int], str | None] | None = None
        self.settings: Settings  # set by run() before anything reads it
        self.db: Database  # opened by run() (migrated) before anything reads it
        self.cache_id = 0
        self.watcher: Watcher | None = None
        self.scheduler = None
        self.scheduler_thread: threading.Thread | None = None
        self.jobs = Jobs()
        self.metrics: Metrics | None = None
        self.last_problem: str | None = None
        self.evict_pending = False
        self.last_trigger = -1e9  # monotonic time eviction was last started by crossing a cap
        self.locks = DaemonLocks()
        self.mounts: frozenset[str] = frozenset()  # below the cache root, at the last look (_follow_mounts)

    # -- the process ---------------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1` dumps every thread's stack
        tune_malloc()
        self.settings = self.load()
        s = self.settings
        self.locks.hold(s.cache_dir, s.db)  # a second daemon stops here: AlreadyRunning, exit 10
        from cachemgr.evict.execute import refuse_foreign_root

        refuse_foreign_root(s.cache_dir, "watch and evict it")  # `/` or a home dir by mistake: never walked
        self.locks.hold(s.cache_dir, s.db, in_root=True)  # an Inductor cache: the lock inside it (other users)
        with contextlib.suppress(OSError):  # (a root missing at start is waited for)
            self.root_checked = (_identity(s.cache_dir), None)  # (checked just now: not again before the watch)
        log.info(
            "starting: cache %s, index %s, max_size %s, evict every %gs, full scan every %gs",
            s.cache_dir,
            redact_url(s.db),
            s.max_size,
            s.evict_interval,
            s.scan_interval,
        )
        self._open(s)
        self._start_metrics(s)
        self._start_watching()
        self._start_scheduler(s)
        if self.watcher is not None:
            self._check_limits()  # already over a cap at start: evict now, not in evict_interval
        systemd.notify("READY=1", f"STATUS={self._status()}")
        log.info("ready: %s", self._status())
        try:
            self._loop()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        period = systemd.watchdog_period()
        tick = min(1.0, period) if period else 1.0
        next_ping = 0.0
        while not self.stopping:
            self.wake.wait(tick)
            if self.stopping:
                break
            if self.reload_asked:
                self.reload_asked = False
                self._reload()
            self._supervise()
            if period and time.monotonic() >= next_ping:
                problem = self._health()
                if problem is None:
                    systemd.notify("WATCHDOG=1")
                else:
                    log.error("not pinging the systemd watchdog: %s", problem)
                next_ping = time.monotonic() + period

    def _on_stop(self, signum, _frame) -> None:
        self.stopping = True
        self.wake.set()

    def _on_hup(self, _signum, _frame) -> None:
        self.reload_asked = True
        self.wake.set()

    def _shutdown(self) -> None:
        systemd.notify("STOPPING=1")
        log.info("stopping")
        deadline = time.monotonic() + STOP_DEADLINE
        self._stop_watching()
        busy = self._stop_scheduler(deadline)
        if self.metrics is not None:
            self.metrics.close()
        if busy:
            # An eviction (a scan, an ingest) cannot be interrupted; each is crash-safe (trash
            # rename, index in the same step; a taken spool file is ingested again, never counted
            # twice) and the next start's full scan repairs the index. Do not hold up systemd.
            _exit_now(f"{' and '.join(busy)} still running at stop")
        self.db.close()
        self.locks.release()
        log.info("stopped")

    # -- components ----------------------------------------------------------------------------------

    def _open(self, s: Settings) -> None:
        self.db, self.cache_id = _opened(s)

    def _start_metrics(self, s: Settings) -> None:
        if s.metrics == "off":
            return
        from cachemgr.daemon.metrics import Metrics

        if self.metrics is None:
            self.metrics = Metrics()
        self.metrics.watch(self.db, self.cache_id)
        try:
            self.metrics.serve(s.metrics)
        except OSError as e:  # (a port taken, an address not this host's: the config's to change)
            raise UsageError(
                f"cannot serve metrics on {s.metrics}: {e.strerror or e} (set --metrics or metrics)"
            ) from e

    def _start_watching(self) -> bool:
        """Watches, then a full reconcile. False (and a clear log line) when the root is not usable."""
        s = self.settings
        try:
            problem = self._root_problem(s.cache_dir)  # (the folder check: not again for the same, unchanged)
            if problem is not None:
                raise CacheDirError(problem)
            try:
                self.locks.hold(s.cache_dir, s.db, in_root=True)  # the lock inside it too
            except AlreadyRunning as e:
                if self.scheduler is None:
                    raise  # at start: another daemon (exit 10)
                # (a daemon of another state dir, or whoever swapped the trash folder and locked
                # it: not watched, nor evicted, while it holds it; tried again every tick)
                raise CacheDirError(f"{e}: it holds the cache's trash folder") from e
            self.root_lost.clear()
            w = Watcher(
                self.db,
                self.cache_id,
                s.cache_dir,
                s.debounce,
                s.max_wait,
                on_batch=self._after_batch,
                on_root_lost=self._on_root_lost,
            )
            w.start()
            try:
                self.mounts = safefs.mounts_below(s.cache_dir)  # (those made from now on: _follow_mounts)
                # full: every file stat'ed, since anything may have happened while no daemon watched.
                # Phase one only (READY after it); its pending entries are read on the consumer thread.
                r = self._scanned(w.request_scan("", full=True))
            except BaseException:
                w.stop()
                raise
            log.info(
                "full scan: %d added, %d changed, %d removed, %d unchanged (%.2f s, %d directories watched)",
                r.added,
                r.changed,
                r.removed,
                r.unchanged,
                r.seconds,
                w.tree.watches() if w.tree else 0,
            )
            if self.metrics is not None:
                self.metrics.scanned(r.seconds)
                self.metrics.watch(self.db, self.cache_id)  # a backlog found at start is no activity
            release_memory(self.db)
            self.watcher = w
        except CacheDirError as e:
            self._problem(f"{e}; waiting for it (checked every second)")
            return False
        except OSError as e:  # (out of descriptors, say)
            self._problem(f"cannot watch {s.cache_dir} now: {e.strerror or e}; trying again every second")
            return False
        self.last_problem = None
        self._check_limits()
        return True

    def _scanned(self, scan: Future) -> ScanResult:
        """The start's full scan's result, waited for while no stop is asked: at a million files
        on a slow disk it takes minutes, and systemd would kill a daemon that did not stop."""
        scan.add_done_callback(lambda _f: self.wake.set())
        period = systemd.watchdog_period()
        next_ping = time.monotonic() + (period or 0)
        while not scan.done():
            self.wake.wait(1.0)
            if period and time.monotonic() >= next_ping:  # the scan is the daemon's work: it is alive
                systemd.notify("WATCHDOG=1")
                next_ping = time.monotonic() + period
            if self.stopping:  # (a scan's transactions roll back when the process ends; the next start scans)
                systemd.notify("STOPPING=1")
                _exit_now("stop asked during the full scan at start")
        return scan.result()

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    def _start_scheduler(self, s: Settings) -> None:
        """APScheduler's BlockingScheduler on a thread of ours: its liveness is ours to check."""
        from apscheduler.events import EVENT_SCHEDULER_STARTED  # type: ignore[import-untyped]
        from apscheduler.executors.pool import ThreadPoolExecutor  # type: ignore[import-untyped]
        from apscheduler.schedulers.blocking import BlockingScheduler  # type: ignore[import-untyped]

        self.jobs = jobs = Jobs()
        sched = BlockingScheduler(
            executors={"default": ThreadPoolExecutor(2)},
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": 60},
        )
        sched.add_job(jobs.wrap(self._evict_job, "eviction"), "interval", seconds=s.evict_interval, id="evict")
        sched.add_job(jobs.wrap(self._scan_job, "the full scan"), "interval", seconds=s.scan_interval, id="scan")
        sched.add_job(jobs.wrap(self._spool_job, "the spool's ingest"), "interval", seconds=SPOOL_INTERVAL, id="spool")
        started = threading.Event()
        sched.add_listener(lambda _event: started.set(), EVENT_SCHEDULER_STARTED)
        thread = threading.Thread(target=sched.start, name="cachemgr-scheduler", daemon=True)
        thread.start()
        while not started.wait(0.05):  # the jobs are added once it runs: modify_job works from then on
            if not thread.is_alive():
                raise CachemgrError("the job scheduler did not start (see the error above)")
        self.scheduler, self.scheduler_thread = sched, thread

    def _stop_scheduler(self, deadline: float) -> list[str]:
        """Shut the scheduler down; what jobs still run at the deadline."""
        if self.scheduler is None:
            return []
        sched, self.scheduler = self.scheduler, None
        sched.shutdown(wait=False)  # no new runs; its own wait has no deadline
        busy = self.jobs.close(deadline)
        if self.scheduler_thread is not None:
            self.scheduler_thread.join(max(0.0, deadline - time.monotonic()))
        return busy

    # -- jobs ----------------------------------------------------------------------------------------

    def _evict_job(self) -> None:
        self.evict_pending = False
        s, w = self.settings, self.watcher
        if w is None:
            log.info("eviction skipped: %s is not being watched", s.cache_dir)
            return
        try:
            from cachemgr.evict import Limits, evict
        except ImportError as e:
            log.error("eviction unavailable: %s", e)
            return
        self._follow_mounts(w)
        limits = Limits.from_settings(s)
        try:
            t0 = time.monotonic()
            result = evict(self.db, self.cache_id, s.cache_dir, limits, policy=s.policy).as_dict()
        except CachemgrError as e:
            log.error("eviction failed: %s", e)
            return
        if result.get("evicted"):
            log.info(
                "evicted %d of %d planned entries, freed %d bytes, %d bytes remain (%.2f s)",
                result.get("evicted", 0),
                result.get("planned", 0),
                result.get("freed_bytes", 0),
                result.get("remaining_bytes", 0),
                time.monotonic() - t0,
            )
        else:
            log.debug("eviction: nothing to evict (%d bytes indexed)", result.get("remaining_bytes", 0))
        if self.metrics is not None:
            self.metrics.eviction(result)

    def _follow_mounts(self, w: Watcher) -> None:
        """Mounting or unmounting inside the cache moves no mtime and makes no inotify event: the
        folder holding each mount point made or gone since the last look is read again, whole,
        before eviction counts the index (what a new mount hides leaves it; what an old one hid
        comes back). Many at once: the whole cache is."""
        now = safefs.mounts_below(self.settings.cache_dir)
        changed, self.mounts = now ^ self.mounts, now
        if not changed:
            return
        folders = {p.rpartition("/")[0] for p in changed}
        for sub in sorted(folders) if len(folders) <= MOUNT_RESCANS else [""]:
            try:
                w.request_scan(sub, full=True).result(timeout=max(600.0, self.settings.scan_interval))
            except Exception as e:  # noqa: BLE001 - logged; eviction goes on with the index as it is
                log.error("rescan of %s/ after a mount change failed: %s", sub, e)
        log.info("mount points inside the cache changed (%s): read again", ", ".join(sorted(changed)[:5]))

    def _scan_job(self) -> None:
        w = self.watcher
        if w is None:
            return
        self._follow_mounts(w)
        try:
            r = w.request_scan("").result(timeout=max(600.0, self.settings.scan_interval))
        except (CachemgrError, TimeoutError) as e:
            log.error("rescan failed: %s", e)
            return
        log.info(
            "rescan (directories whose mtime moved): %d added, %d changed, %d removed, %d unchanged (%.2f s)",
            r.added,
            r.changed,
            r.removed,
            r.unchanged,
            r.seconds,
        )
        if self.metrics is not None:
            self.metrics.scanned(r.seconds)
        from cachemgr.index.live import prune_events

        try:
            with self.db.engine.begin() as conn:  # (evictions' and compiles' events age out too)
                prune_events(conn, self.cache_id, time.time())
        except Exception as e:  # noqa: BLE001 - kept events are no failure of the scan
            log.error("pruning old events failed: %s", e)

    def _spool_job(self) -> None:
        """Move the shapes cachemgr.record spooled into the index (the workload never waits on it)."""
        from cachemgr.prewarm.spool import ingest

        try:
            r = ingest(self.db, self.settings.spool_dir)
        except CachemgrError as e:
            log.error("spool ingest failed: %s", e)
            return
        if r.lines:
            log.info("spool: %d recorded signatures ingested (%d new shapes)", r.lines, r.new_shapes)
        for bad in r.bad_lines:
            log.warning("spool: skipped %s", bad)

    def _after_batch(self, result) -> None:
        """Consumer thread, after each applied batch, scan or parse step: evict at once
        (debounced) when over a cap."""
        if isinstance(result, ParseResult) or getattr(result, "added", None) or getattr(result, "changed", None):
            self._check_limits()

    def _check_limits(self) -> None:
        s = self.settings
        if s.max_size is None and s.max_files is None:
            return
        if self.watcher is not None and not self.watcher.parsed.is_set():
            return  # entries not read yet are never evicted: the parse step that reads the last ones checks
        from cachemgr.evict.execute import usage

        size, files = usage(self.db, self.cache_id)
        over = (s.max_size is not None and size > s.max_size) or (s.max_files is not None and files > s.max_files)
        # at most every TRIGGER_GAP: entries inside the grace period may keep the total over the cap
        if (
            over
            and not self.evict_pending
            and self.scheduler is not None
            and time.monotonic() - self.last_trigger > TRIGGER_GAP
        ):
            self.evict_pending, self.last_trigger = True, time.monotonic()
            log.info("index total %d bytes / %d files is over the limit: evicting now", size, files)
            # debounced: a compile writes many files in a burst; evict once it settles
            self.scheduler.modify_job(
                "evict", next_run_time=datetime.now().astimezone() + timedelta(seconds=max(s.debounce, 0.5))
            )

    # -- supervision ---------------------------------------------------------------------------------

    def _on_root_lost(self) -> None:
        self.root_lost.set()
        self.wake.set()

    def _supervise(self) -> None:
        root = self.settings.cache_dir
        try:
            problem = self._root_problem(root)
        except OSError as e:  # (out of descriptors, say: the next tick looks again)
            log.warning("cannot check %s now: %s", root, e.strerror or e)
            return
        if self.watcher is not None:
            if problem is None and not self.root_lost.is_set():
                try:
                    self.locks.hold(root, self.settings.db, in_root=True)  # a trash folder made anew: lock it too
                    return
                except AlreadyRunning as e:  # another process holds the new one: one daemon per cache
                    problem = f"{e}: it holds the cache's trash folder"
            gone = problem is None or not os.path.exists(root)
            log.error(
                "%s; index kept, watching stopped until it is back",
                f"cache directory {root} was removed" if gone else problem,
            )
            self.last_problem = f"{problem}; waiting for it"  # said just now: not again next tick
            self._stop_watching()
            systemd.notify(f"STATUS={self._status()}")
            return
        if problem is not None:
            self._problem(f"{problem}; waiting for it")
            return
        log.info("cache directory %s is usable again: reconciling and watching", root)
        if self._start_watching():
            systemd.notify(f"STATUS={self._status()}")

    def _root_problem(self, root: str) -> str | None:
        """Why the root cannot be watched now (missing, unreadable, replaced by what is no
        Inductor cache), or None. The directory being watched is not checked for Inductor's
        folders again (one stray file would stop the watch; eviction checks before it deletes);
        another one (a symlink swapped in, the root made anew), or one that changed while none
        was watched, is."""
        try:
            check_root(root)
            ident = _identity(root)
        except CacheDirError as e:
            return str(e)
        checked = self.root_checked
        same = checked is not None and (
            ident[:2] == checked[0][:2] if self.watcher is not None else ident == checked[0]
        )
        if not same:
            try:
                _check_usable(root)
                refusal = None
            except CacheDirError as e:
                refusal = str(e)
            self.root_checked = checked = (ident, refusal)
        assert checked is not None
        return checked[1]

    def _problem(self, message: str) -> None:
        if message != self.last_problem:  # once per problem, not once per tick
            log.error("%s", message)
            self.last_problem = message

    def _health(self) -> str | None:
        """None when observer (if watching), scheduler and database answer; else what does not."""
        if self.watcher is not None and not self.watcher.alive():
            return "the file watcher has stopped"
        sched, thread = self.scheduler, self.scheduler_thread
        if sched is None or not sched.running or thread is None or not thread.is_alive():
            return "the scheduler has stopped"
        try:
            from sqlalchemy import text

            with self.db.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            return f"the index database does not answer: {e}"
        return None

    def _status(self) -> str:
        s = self.settings
        return (f"watching {s.cache_dir}" if self.watcher is not None else f"waiting for {s.cache_dir}") + (
            f", metrics on {s.metrics}" if s.metrics != "off" else ""
        )

    # -- reload ----------------------------------------------------------------------------------------

    def _reload(self) -> None:
        systemd.notify(*systemd.reloading())
        old = self.settings
        try:
            new = self.load()
        except CachemgrError as e:
            log.error("reload failed, keeping the running config: %s", e)
            systemd.notify("READY=1", f"STATUS={self._status()}")
            return
        changed = sorted(k for k, v in new.values().items() if old.values()[k] != v)
        restart = any(k in changed for k in RESTART_KEYS)
        # What can fail is tried before anything is switched: a reload never stops the daemon.
        opened = None
        try:
            if restart:
                opened = _opened(new)  # an index that cannot be opened or migrated (not SQLite, no server)
            if "cache_dir" in changed or "db" in changed:
                self.locks.hold(new.cache_dir, new.db)
        except Exception as e:  # noqa: BLE001 - whatever it was, the running config goes on
            if opened is not None:
                opened[0].close()
            log.error("reload failed, keeping the running config: %s", e)
            systemd.notify("READY=1", f"STATUS={self._status()}")
            return
        log.info("reloading config: %s", ", ".join(changed) or "nothing changed")
        if "metrics" in changed:
            if self.metrics is not None:
                self.metrics.close()
            try:
                self._start_metrics(new)
            except CachemgrError as e:  # a port in use, an address not of this host: the old one again
                log.error("reload: %s; metrics stay on %s", e, old.metrics)
                new = dataclasses.replace(new, metrics=old.metrics)
                try:
                    self._start_metrics(old)
                except CachemgrError as e2:
                    log.error("metrics off: %s", e2)
        self.settings = new
        if opened is not None:
            self._stop_watching()
            self.db.close()
            self.db, self.cache_id = opened
            if self.metrics is not None:
                self.metrics.watch(self.db, self.cache_id)
            self._start_watching()
        elif self.watcher is not None:
            self.watcher.debounce, self.watcher.max_wait = new.debounce, new.max_wait
        if self.scheduler is not None:  # (rescheduling restarts the interval: only when it changed)
            if "evict_interval" in changed:
                self.scheduler.reschedule_job("evict", trigger="interval", seconds=new.evict_interval)
            if "scan_interval" in changed:
                self.scheduler.reschedule_job("scan", trigger="interval", seconds=new.scan_interval)
        self.last_trigger = -1e9
        if self.watcher is not None:
            self._check_limits()
        systemd.notify("READY=1", f"STATUS={self._status()}")
