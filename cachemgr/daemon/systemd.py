"""sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET. A no-op outside systemd."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


def notify(*states: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send e.g. notify('READY=1', 'STATUS=watching /x'). False when not run under systemd, or
    when the message was dropped.

    Never blocks: a datagram to a socket whose queue is full (nobody reads it: systemd hung, or
    a NOTIFY_SOCKET left from elsewhere) would wait for room forever, and with it the main loop,
    which then answers neither SIGTERM nor SIGHUP. Such a message is dropped instead."""
    addr = environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
            s.sendto("\n".join(states).encode(), addr)
        return True
    except OSError:
        return False  # queue full (EAGAIN), systemd gone or socket not ours: never fatal


def reloading() -> tuple[str, str]:
    """RELOADING=1 with the MONOTONIC_USEC newer systemd (Type=notify-reload) asks for."""
    return "RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"


def watchdog_period(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when no watchdog is asked for."""
    usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
