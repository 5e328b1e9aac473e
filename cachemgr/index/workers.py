"""Parse worker processes: where every pickle is read, under hard bounds.

An entry pickle is hostile input. The safe unpickler executes nothing, but the C unpickler
itself can be made to allocate without bound (a 9-byte pickle with a memo index of 2^28 asks
for 4 GB) or to spin. So pickles are only ever unpickled here, in a `python -m
cachemgr.index.workers` process (a plain command: no `multiprocessing` re-import of the
caller's `__main__`), which:
- reads the file itself, through `safefs` (regular files only, size checked first);
- runs with its address space limited (RLIMIT_AS: its start-up size + WORKER_MEMORY), so an
  allocation bomb is a MemoryError in the worker, reported as a corrupt entry;
- is killed by the parent when one entry takes longer than PARSE_SECONDS, and replaced;
- dies with its parent (PR_SET_PDEATHSIG), and keeps the garbage collector off while parsing.
A worker that dies (killed, out of memory) costs the entry it held a `corrupt` reason, nothing more
(a batch it held is read again an entry a job by the caller: cachemgr.index.pending).

Besides one entry to describe, a job can be a batch of entries (graph pickles a few at a time;
autotune results and C++ sources, read and hashed, by the dozen), a list of directories to
walk (scan phase one: `layout.walk_units`), or bytes read from no file (a Redis value) handed to
a function under the same bounds (BYTES: see `run_bytes`). `Stream` keeps the workers busy from
a background thread while the caller writes earlier results to the index.

Protocol on the worker's stdin/stdout: 8-byte little-endian length, then a pickle (made and
read only by cachemgr's own code on both ends): jobs in, (job id, result) out.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, cast

PARSE_SECONDS = 30.0  # one entry; a worker still at it then is killed and the entry marked corrupt
CLOSE_SECONDS = 5.0  # a stream's thread sees it is closed within 0.1 s; it is waited for this long at most
WORKER_MEMORY = 512 << 20  # address space a worker may take beyond its start-up size
MAX_WORKERS = 64
HEADER = struct.Struct("<Q")


WALK = "walk"  # Job.kind: walk the directories in `items`
WALK_READ = "walk-read"  # Job.kind: WALK, and read the plain-data entries found (describe.READ_WITH_WALK)
BATCH = "batch"  # Job.kind: describe the (kind, key, ref) entries in `items`
BYTES = "bytes"  # Job.kind: call `key` ("module:function") with `items` (bytes read from no file first)


@dataclass(frozen=True, slots=True)
class Job:
    """One entry to describe (its kind, key and ref, under `root`), or a WALK or BATCH of `items`."""

    id: int
    run: int  # a describer sends each component set's items once per run
    root: str
    kind: str
    key: str
    ref: str | None
    items: tuple = ()
    root_id: tuple[int, int] | None = None  # (st_dev, st_ino) the caller opened `root` as: checked


def default_workers() -> int:
    from cachemgr import procs

    return max(1, min(procs.cores(), MAX_WORKERS))


# -- the parent side ------------------------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        from cachemgr import procs

        self.proc, self.stdin, self.stdout = procs.spawn_module("cachemgr.index.workers")
        self.job: Job | None = None
        self.started = 0.0
        self.buf = bytearray()  # grows in place: a walk result is megabytes, read 64 KiB at a time
        self.thread = threading.get_ident()  # it gets SIGKILL when this thread ends (procs: PDEATHSIG)

    def send(self, job: Job) -> None:
        send(self.stdin, job)
        self.job, self.started = job, time.monotonic()

    def current(self) -> Job:
        """The job this busy worker holds (`send` gave it one)."""
        assert self.job is not None
        return self.job

    def read(self) -> tuple[int, object] | None:
        """A finished result, or None when more bytes are needed. Raises EOFError if it died."""
        chunk = os.read(self.stdout.fileno(), 1 << 20)
        if not chunk:
            raise EOFError
        self.buf += chunk
        if len(self.buf) < HEADER.size:
            return None
        (n,) = HEADER.unpack_from(self.buf)
        if len(self.buf) < HEADER.size + n:
            return None
        with memoryview(self.buf)[HEADER.size : HEADER.size + n] as data:
            result = pickle.loads(data)  # noqa: S301 - our own worker's output
        del self.buf[: HEADER.size + n]
        return result

    def kill(self) -> str:
        """Stop it; say how it ended."""
        from cachemgr import procs

        procs.kill_group(self.proc)
        code = self.proc.wait()
        for f in (self.stdin, self.stdout):
            try:
                f.close()
            except OSError:
                pass
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"

    def close(self) -> None:
        try:
            self.stdin.close()  # EOF: it exits
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        else:
            self.stdout.close()


class Pool:
    """Parse workers, started on first use, as many as asked (and jobs need)."""

    def __init__(self, workers: int | None = None) -> None:
        self.size = workers or default_workers()
        self.idle: list[_Worker] = []
        self.last_used = time.monotonic()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()

    def start(self) -> None:
        """Start every worker now, from this thread (they boot while it goes on, and live as
        long as it does: the jobs of every later run and stream are theirs)."""
        while len(self.idle) < self.size:
            self.idle.append(_Worker())

    def run(self, jobs: Iterable[Job], failed: Callable[[Job, str], object]) -> _Run:
        """(job, result) for every job, in the order they finish; the first jobs are handed out
        at once, so the caller can do other work before it iterates. A job whose worker died or
        ran out of time gets `failed(job, why)` as its result."""
        return _Run(self, jobs, failed)

    def stream(self, failed: Callable[[Job, str], object], backlog: int | None = None) -> Stream:
        """Jobs handed out by a background thread as they are submitted; see Stream."""
        return Stream(self, failed, backlog)


class _Run:
    def __init__(self, pool: Pool, jobs: Iterable[Job], failed: Callable[[Job, str], object]) -> None:
        self.pool, self.failed = pool, failed
        self.pending = deque(jobs)
        self.busy: dict[int, _Worker] = {}
        self.ready: deque[tuple[Job, object]] = deque()
        self.dispatch()

    def __iter__(self) -> _Run:
        return self

    def __next__(self) -> tuple[Job, object]:
        while not self.ready:
            if not self.busy:
                self.pool.last_used = time.monotonic()
                raise StopIteration
            try:
                self.wait()
                self.dispatch()
            except BaseException:  # interrupted (Ctrl-C, a dead pipe): stop every worker of this run
                self.close()
                raise
        return self.ready.popleft()

    def close(self) -> None:
        """Interrupted: what is running is not ours any more."""
        for w in self.busy.values():
            w.kill()
        self.busy.clear()
        self.pending.clear()

    def dispatch(self, limit: int | None = None) -> None:
        pool = self.pool
        most = pool.size if limit is None else min(pool.size, limit)
        while self.pending and len(self.busy) < most:
            w = pool.idle.pop() if pool.idle else _Worker()
            try:
                w.send(self.pending[0])
            except OSError:  # it died while idle: a fresh one takes the job
                w.kill()
                continue
            self.pending.popleft()
            self.busy[w.stdout.fileno()] = w

    def wait(self, most: float = PARSE_SECONDS) -> None:
        timeout = max(0.0, min(w.started for w in self.busy.values()) + PARSE_SECONDS - time.monotonic())
        timeout = min(timeout, most)
        ready, _, _ = select.select(list(self.busy), [], [], timeout)
        for fd in ready:
            w = self.busy[fd]
            try:
                out = w.read()
            except (EOFError, OSError):
                del self.busy[fd]
                job = w.current()
                self.ready.append((job, self.failed(job, f"the parse worker died ({w.kill()}): too much memory?")))
                continue
            if out is not None:
                del self.busy[fd]
                job, w.job = w.current(), None
                self.pool.idle.append(w)
                self.ready.append((job, out[1]))
        now = time.monotonic()
        for fd, w in list(self.busy.items()):
            if now - w.started > PARSE_SECONDS:
                del self.busy[fd]
                w.kill()
                job = w.current()
                self.ready.append((job, self.failed(job, f"took longer than {PARSE_SECONDS:g} s to parse")))


class Stream:
    """Jobs run by a pool's workers while the caller does other work (a scan writes earlier
    results to the index meanwhile). `submit` adds jobs; a background thread hands them out in
    order, reads results, and enforces PARSE_SECONDS; `get` returns the next finished (job,
    result), in the order they finish. At most `backlog` jobs are running or finished and not
    yet taken, so memory stays bounded whatever the caller submits. Use it in a with block: on
    the way out the thread stops, and any worker still busy (an interrupted caller) is killed."""

    def __init__(self, pool: Pool, failed: Callable[[Job, str], object], backlog: int | None = None) -> None:
        self.run = _Run(pool, (), failed)
        self.backlog = backlog or 4 * pool.size
        self.cv = threading.Condition()
        self.done: deque[tuple[Job, object]] = deque()
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._drive, name="cachemgr-parse-pool", daemon=True)
        self.thread.start()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, jobs: Iterable[Job]) -> None:
        with self.cv:
            self.run.pending.extend(jobs)
            self.cv.notify_all()

    def get(self) -> tuple[Job, object]:
        """The next finished job and its result (blocks until there is one)."""
        with self.cv:
            while not self.done:
                if self.error is not None:
                    raise self.error
                if self.stopping:
                    raise RuntimeError("the parse stream is closed")
                self.cv.wait()
            self.cv.notify_all()  # room for another job
            return self.done.popleft()

    def close(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        # A Ctrl-C that lands after a `with self.cv` took the lock and before its block began
        # leaves the lock held by this thread (CPython does not promise a `with` its exit then):
        # the thread would wait for it for ever, and so would an unbounded join.
        self.thread.join(CLOSE_SECONDS)
        self.run.close()  # a worker still busy holds a job nobody waits for any more
        pool = self.run.pool
        # The workers this stream's thread started die with it (PR_SET_PDEATHSIG is per thread):
        # closed here, not handed to the pool's next job (which then read a dead worker's EOF).
        ours = [w for w in pool.idle if w.thread == self.thread.ident]
        pool.idle[:] = [w for w in pool.idle if w.thread != self.thread.ident]
        for w in ours:
            w.close()
        pool.last_used = time.monotonic()

    def _drive(self) -> None:
        run = self.run
        try:
            while True:
                with self.cv:
                    while not self.stopping and not run.busy and not (run.pending and len(self.done) < self.backlog):
                        self.cv.wait()
                    if self.stopping:
                        return
                    run.dispatch(limit=max(0, self.backlog - len(self.done)))
                if run.busy:
                    run.wait(most=0.1)  # (short: a close is noticed soon)
                if run.ready:
                    with self.cv:
                        self.done.extend(run.ready)
                        run.ready.clear()
                        self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's get()
            with self.cv:
                self.error = e
                self.cv.notify_all()


# -- the worker side ------------------------------------------------------------------------------


def _limit_memory() -> None:
    import resource

    try:
        with open("/proc/self/statm") as f:
            vsz = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        vsz = 256 << 20
    limit = vsz + WORKER_MEMORY
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass


def read_exactly(f: IO[bytes], n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def send(f: IO[bytes], obj: object) -> None:
    """Write one message of the protocol (length, pickle) and flush it."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(HEADER.pack(len(data)) + data)
    f.flush()


def receive(f: IO[bytes]) -> object:
    """Read one message of the protocol (from our own parent or worker); EOFError at the end."""
    header = read_exactly(f, HEADER.size)
    data = None if header is None else read_exactly(f, HEADER.unpack(header)[0])
    if data is None:
        raise EOFError
    return pickle.loads(data)  # noqa: S301 - cachemgr's own process on the other end


def run_bytes(job: Job) -> tuple[bool, object]:
    """A BYTES job's answer: (True, what `key`'s function returned for the bytes), or (False, the
    first line of what it raised: a MemoryError is the worker's bound). The pool's `failed` reason
    is the caller's for a worker killed or out of time."""
    import importlib

    module, _, name = job.key.partition(":")
    try:
        return True, getattr(importlib.import_module(module), name)(*job.items)
    except Exception as e:  # noqa: BLE001 - the bytes' problem is that job's, never the worker's
        lines = str(e).strip().splitlines()
        return False, lines[0][:300] if lines else type(e).__name__


def failure(value: object) -> str:
    """A BYTES job's failed answer (`run_bytes`'s, or the pool's `failed` reason) as a reason to
    show: a MemoryError is the worker's bound."""
    if value == "MemoryError":
        return f"out of memory (a parse worker may take {WORKER_MEMORY >> 20} MiB)"
    return str(value)[:200]


def main() -> None:
    import gc

    from cachemgr import procs
    from cachemgr.index.describe import Describer

    procs.die_with_parent_from_env()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    _limit_memory()
    gc.disable()  # parse results are trees (no cycles); the collector only costs time here
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    describer = Describer()
    while True:
        try:
            job = cast(Job, receive(stdin))  # (as `-m`, this module is __main__: Job is the package's)
        except EOFError:
            return
        send(stdout, (job.id, run_bytes(job) if job.kind == BYTES else describer.run_job(job)))
        gc.collect(0)


if __name__ == "__main__":
    main()
