"""What every command shares: the App context, parameter types, output helpers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from cachemgr import config
from cachemgr.errors import UsageError
from cachemgr.units import format_duration, format_size, parse_duration, parse_size


class App:
    """Settings and the index, opened on first use and closed once at exit."""

    def __init__(self, config_file: str | None, flags: dict[str, Any]) -> None:
        self.config_file = config_file
        self.flags = flags
        self._settings: config.Settings | None = None
        self._db = None
        self._cache_id: int | None = None

    @property
    def settings(self) -> config.Settings:
        if self._settings is None:
            self._settings = config.load(self.config_file, self.flags)
        return self._settings

    def with_flags(self, **flags: Any) -> config.Settings:
        """Settings with a command's own flags on top (e.g. evict --max-size)."""
        return config.load(self.config_file, {**self.flags, **flags})

    @property
    def db(self):  # -> cachemgr.index.db.Database
        if self._db is None:
            from cachemgr.index.db import Database

            self._db = Database(self.settings.db)
        return self._db

    @property
    def cache_id(self) -> int:
        if self._cache_id is None:
            self._cache_id = self.db.cache_id(self.settings.host, self.settings.cache_dir)
        return self._cache_id

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


pass_app = click.make_pass_decorator(App)


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            return parse_size(value)
        except UsageError as e:
            self.fail(str(e), param, ctx)


class DurationType(click.ParamType):
    name = "DURATION"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            return parse_duration(value)
        except UsageError as e:
            self.fail(str(e), param, ctx)


SIZE, DURATION = SizeType(), DurationType()

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for programs instead of a table.")


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    """A table for people (rich), sized to the terminal. Piped, nothing is cut: keys stay whole,
    to be pasted into `show` or `pin`."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    t = Table(box=None, header_style="bold", pad_edge=False)
    for h in headers:
        t.add_column(h, no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*(Text("" if v is None else str(v)) for v in r))  # Text: '[s0, 32]' is not markup
    if title:
        click.echo(title)
    if sys.stdout.isatty():
        Console(soft_wrap=False).print(t)
        return
    console = Console(soft_wrap=False, width=1 << 16)
    with console.capture() as out:
        console.print(t)
    click.echo("\n".join(line.rstrip() for line in out.get().splitlines()))


def ingest_spool(app) -> None:
    """Move the shapes `cachemgr.record` spooled into the index; report lines it skipped."""
    from cachemgr.prewarm import spool  # no torch, and no SQLAlchemy when nothing is waiting

    if spool.waiting(app.settings.spool_dir):
        for bad in spool.ingest(app.db, app.settings.spool_dir).bad_lines:
            click.echo(f"cachemgr: spool: skipped {bad}", err=True)


def human_size(n: int | None) -> str:
    return format_size(n)


def age(ts: float | None) -> str:
    return "-" if ts is None else format_duration(time.time() - ts)


def short(text: str | None, width: int | None) -> str:
    """`text` cut to `width` characters with an ellipsis (whole when width is None)."""
    if not text:
        return ""
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


@contextmanager
def progress_bar(label: str, enabled: bool | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback (done, total) drawn on stderr when it is a terminal; None otherwise."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from rich.console import Console

    with Progress(f"[bold]{label}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as p:
        task = p.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            p.update(task, completed=done, total=total)

        yield update
