"""Child processes that cannot outlive cachemgr, and process groups whose Ctrl-C is ours.

Two helpers, both Linux-first and harmless elsewhere:

- `die_with_parent(parent_pid)`, called *in the child*: asks the kernel to SIGKILL this process
  when its parent dies (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), then checks that the parent is
  still `parent_pid`: a parent that died before the prctl (the race the kernel cannot see) makes
  the child exit at once. Use it as a process pool's initializer, so a SIGKILLed scan or daemon
  leaves no parse workers behind:

      ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                          initializer=procs.die_with_parent, initargs=(os.getpid(),))

  Linux sends the signal when the parent *thread* that created the child exits, not only the
  process: create such children from a thread that outlives them (the pool's caller does).

- `spawn(argv, ...)`: `subprocess.Popen` of a child in a session (and so a process group) of its
  own, with `CACHEMGR_PARENT_PID` set for its `die_with_parent_from_env()`. A terminal's Ctrl-C
  reaches only the foreground group (cachemgr), which then stops the child's whole group with
  `kill_group` and waits for it with `wait_group_gone`: nothing of it runs after cachemgr exits.

And one for this process: `collector_paused()`, the cyclic garbage collector off for a bulk step.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

PR_SET_PDEATHSIG = 1
PARENT_ENV = "CACHEMGR_PARENT_PID"


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a bulk step makes and drops millions of acyclic
    objects (walk listings, rows, plans): each of its full collections walks every live object,
    and unpickling a walk worker's listings took 3.5x as long with it on. Cycles made meanwhile
    are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Make this process get `sig` when its parent dies; exit now if the parent is already not
    `parent_pid`. True when the kernel took the request (False off Linux: then only the check)."""
    armed = False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux / no prctl
        pass
    if parent_pid is not None and os.getppid() != parent_pid:  # the parent died before the prctl
        os._exit(1)
    return armed


def die_with_parent_from_env(environ: Mapping[str, str] = os.environ) -> bool:
    """`die_with_parent` with the parent `spawn` named in CACHEMGR_PARENT_PID (none: no check)."""
    raw = environ.get(PARENT_ENV, "")
    return die_with_parent(int(raw) if raw.isdigit() else None)


def spawn(argv: Sequence[str], env: Mapping[str, str] | None = None, **popen_kw) -> subprocess.Popen:
    """Start a child in a process group of its own (its pid is the group id), told who its parent
    is: the child calls `die_with_parent_from_env()` first thing."""
    env = {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(list(argv), env=env, start_new_session=True, **popen_kw)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the child's whole process group (the compile workers torch started in it too)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already (or reaped and the id reused)
        pass


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group `pgid` (Linux /proc)."""
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def wait_group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """Wait until no live process is left in group `pgid` (after `kill_group`); False on timeout."""
    deadline = time.monotonic() + timeout
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def cores() -> int:
    """How many cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spawn_module(module: str) -> tuple[subprocess.Popen, IO[bytes], IO[bytes]]:
    """`python -m <module>` started by `spawn`, with its stdin and stdout piped to us (stderr dropped)."""
    import sys

    proc = spawn(
        [sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdin is not None and proc.stdout is not None  # (PIPE)
    return proc, proc.stdin, proc.stdout
