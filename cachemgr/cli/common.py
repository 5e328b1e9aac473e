"""What every command shares: the App context, parameter types, options, and output for people
(tables that fit the terminal, keys in one short form) and for programs (--json)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
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
        self._store = None
        self._quick = None

    @property
    def settings(self) -> config.Settings:
        if self._settings is None:
            self._settings = config.load(self.config_file, self.flags)
        return self._settings

    def with_flags(self, **flags: Any) -> config.Settings:
        """Settings with a command's own flags on top (e.g. evict --max-size)."""
        return config.load(self.config_file, {**self.flags, **flags})

    @property
    def db(self):  # -> cachemgr.index.Database
        if self._db is None:
            from cachemgr.index import Database

            # --db (flag, variable, file) names a database to use, not one to make a place for
            self._db = Database(self.settings.db, create_folder=self.settings.defaulted("db"))
        return self._db

    @property
    def cache_id(self) -> int:
        return self.store.cache_id

    @property
    def store(self):  # -> cachemgr.index.Store
        """The index of this cache, read through SQLAlchemy (any database)."""
        if self._store is None:
            from cachemgr.index import Store

            self._store = Store.of(self.db, self.settings.host, self.settings.cache_dir)
        return self._store

    @property
    def index_store(self):  # -> cachemgr.index.Store
        """The whole index, for views over every cache of it (the fleet's): no cache's row is made
        for this host, which has none when it never scanned (`store` would list it as a host)."""
        from cachemgr.index import Store

        return Store.of_index(self.db)

    def quick_store(self):  # -> cachemgr.index.Store | None
        """The embedded SQLite index of a scanned cache, read without SQLAlchemy (None otherwise)."""
        from cachemgr.index.revision import HEAD_REVISION
        from cachemgr.index.store import Store, sqlite_path

        path = sqlite_path(self.settings.db)
        if self._quick is None and path is not None:
            self._quick = Store.sqlite(path, HEAD_REVISION, self.settings.host, self.settings.cache_dir)
        return self._quick

    def close(self) -> None:
        if self._quick is not None:
            self._quick.close()
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


class KeyType(click.ParamType):
    """A key as any command prints it; the shell completes the short keys of the index."""

    name = "KEY"

    def convert(self, value, param, ctx):
        """A name typed or pasted with bytes that are not UTF-8 (the shell hands them on as
        surrogates, which no database takes: exit 70) is looked up as the index keys it. An empty
        one is a usage error (`--graph ""` listed every graph, as if no key were given)."""
        if value == "":
            self.fail("a key must not be empty", param, ctx)
        if isinstance(value, str) and any("\udc80" <= c <= "\udcff" for c in value):
            from cachemgr import layout

            return layout.key_of(value)
        return value

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list:
        from click.shell_completion import CompletionItem

        from cachemgr.index import Filters

        # completing, click parses without running the group's callback: the App is made here
        root = ctx.find_root().params
        app = App(root.get("config_file"), {k: root.get(k) for k in ("cache_dir", "db", "host")})
        try:
            store = app.quick_store()
            if store is None:
                return []  # only a scanned embedded index is read: completing must be quick and write nothing
            entries = store.entries(Filters(sort="name", locks=True))
            shorts = store.short_keys(entries)
        except Exception:  # noqa: BLE001 - completion must never print an error into the shell
            return []
        finally:
            app.close()
        return [CompletionItem(s, help=e.kind) for e in entries if (s := shorts[e.key]).startswith(incomplete)][:200]


class CountType(click.ParamType):
    """A count a query takes (a LIMIT): a whole number from 1 to a database's largest integer."""

    name = "N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        try:
            n = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a whole number", param, ctx)
        if not 1 <= n < 2**63:
            self.fail(f"{value} is not a count from 1 to {2**63 - 1}", param, ctx)
        return n


SIZE, DURATION, KEY, COUNT = SizeType(), DurationType(), KeyType(), CountType()

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for programs instead of a table.")
quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="Print keys only, one a line (to pipe into pin, unpin, show or purge --key)."
)
wide_option = click.option(
    "--wide", "--no-truncate", "wide", is_flag=True, help="Full keys, and no column cut to fit the terminal."
)
model_option = click.option(
    "--model", metavar="NAME", help="Only the graphs of this model (its shapes recorded by cachemgr.record)."
)


# What an exit code means for every command that can end with it (cachemgr.errors); a command
# gives its own words where it says more.
EXIT_MEANINGS = {
    0: "done",
    1: "short of memory or descriptors, or an eviction worker died",
    2: "bad command line, variable or config file",
    3: "a key, model or file it names does not exist",
    4: "the cache dir is missing, not a directory, or unreadable",
    5: "the index database cannot be opened or used",
    7: "the cache dir does not look like an Inductor cache",
    130: "interrupted (Ctrl-C)",
}


def exit_codes(*codes: int | tuple[int, str]) -> Callable[[Callable], Callable]:
    """Decorates a command's function (below @pass_app) to end its --help with its exit codes:
    each a code of EXIT_MEANINGS, or (code, meaning) in the command's own words (a newline in
    them goes on under the meaning); a meaning of at most 68 characters keeps help in 80 columns."""
    pairs = [c if isinstance(c, tuple) else (c, EXIT_MEANINGS[c]) for c in codes]
    width = max(len(str(c)) for c, _ in pairs)
    lines = [f"        {c:<{width}}  {m}".replace("\n", "\n" + " " * (10 + width)) for c, m in pairs]
    text = "\n\n    \b\n    Exit codes:\n" + "\n".join(lines) + "\n"

    def add(f: Callable) -> Callable:
        f.__doc__ = (f.__doc__ or "").rstrip() + text
        return f

    return add


def emit_json(doc: Any) -> None:
    click.echo(json_text(doc))


def json_text(doc: Any) -> str:
    """`doc` as strict JSON: a NaN or an infinity (from a hostile index, Redis value or bundle
    header) is null, as JSON has no such number and strict parsers refuse the document."""
    try:
        return json.dumps(doc, indent=2, sort_keys=False, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), indent=2, sort_keys=False, default=str, allow_nan=False)


def _finite(doc: Any) -> Any:
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [_finite(v) for v in doc]
    return doc


def emit_json_list(items: Iterable[Any]) -> None:
    """emit_json(list(items)), the same text, written an item at a time: the list is never held.
    (json.dumps escapes a newline in a string: every line of an item's text is one to indent.)"""
    first = True
    for item in items:
        text = json_text(item)
        click.echo(("[\n" if first else ",\n") + "\n".join("  " + line for line in text.split("\n")), nl=False)
        first = False
    click.echo("[]" if first else "\n]")


# -- text for people ----------------------------------------------------------------------------------


def clean(text: Any) -> str:
    """Text safe to print: control characters and escape sequences shown as \\x.., never sent."""
    s = "" if text is None else str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in s)


def terminal_width() -> int | None:
    """Columns to fit output into: $COLUMNS, else the terminal's; None when stdout is not a
    terminal (a pipe or a file): then nothing is cut."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def text_width() -> int:
    """Columns for wrapped prose (explain, diff): the terminal's, or 80."""
    return max(40, terminal_width() or 80)


@dataclass(frozen=True)
class Col:
    """A table column. Only `cut` columns are shortened (with …) to fit the terminal: keys,
    sizes, ages and counts are always shown whole."""

    header: str
    right: bool = False
    cut: bool = False
    min: int = 10  # a cut column keeps at least this many characters


GAP = "  "


def render_table(columns: Sequence[Col | str], rows: Sequence[Sequence[Any]], width: int | None) -> list[str]:
    """The lines of a table at most `width` columns wide (None: as wide as its cells). A column
    given as a plain header is shown whole."""
    cols = [c if isinstance(c, Col) else Col(str(c)) for c in columns]
    cells = [[clean(v) for v in row] for row in rows]
    return list(_table_lines(cols, _table_widths(cols, cells, width), cells))


def _table_widths(cols: Sequence[Col], cells: Iterable[Sequence[str]], width: int | None) -> list[int]:
    """The columns' widths, in one pass over the rows' cleaned cells (none of them held)."""
    from rich.cells import cell_len

    natural = [cell_len(c.header) for c in cols]
    firsts: set[int] = set()  # the first column's cell widths: one per width, not per row
    for r in cells:
        for i in range(len(cols)):
            natural[i] = max(natural[i], cell_len(r[i]))
        if cols:
            firsts.add(cell_len(r[0]))
    widths = list(natural)
    if width is not None:
        gaps = len(GAP) * (len(cols) - 1)
        # A whole first column (the key) is as wide as its cells that fit beside the rest: a longer
        # one (a hostile 250-character key) goes on a line of its own, below, and leaves the
        # table's width alone. Other whole columns (sizes, counts, kinds) keep their width.
        if cols and not cols[0].cut:
            others = sum(min(c.min, natural[j]) if c.cut else natural[j] for j, c in enumerate(cols) if j)
            room = width - others - gaps
            widths[0] = max([cell_len(cols[0].header)] + [n for n in firsts if n <= room])
        over = sum(widths) + gaps - width
        cut = [i for i, c in enumerate(cols) if c.cut]
        while over > 0:  # a character at a time from the widest cut column, down to its minimum
            shrinkable = [i for i in cut if widths[i] > min(cols[i].min, natural[i])]
            if not shrinkable:
                break
            widths[max(shrinkable, key=lambda i: widths[i])] -= 1
            over -= 1
    return widths


def _table_lines(cols: Sequence[Col], widths: list[int], cells: Iterable[Sequence[str]]) -> Iterator[str]:
    from rich.cells import cell_len

    def fit(text: str, i: int) -> str:
        if cols[i].cut:
            text = short(text, widths[i])
        pad = " " * (widths[i] - cell_len(text))
        return pad + text if cols[i].right else text + pad

    yield GAP.join(fit(c.header, i) for i, c in enumerate(cols)).rstrip()
    for r in cells:
        if cols and not cols[0].cut and cell_len(r[0]) > widths[0]:  # as df does: the long key on a
            yield r[0].rstrip()  # line of its own, its row's values under their headers on the next
            r = ["", *r[1:]]
        yield GAP.join(fit(r[i], i) for i in range(len(cols))).rstrip()


def table(
    cols: Sequence[Col | str], rows: Sequence[Sequence[Any]], wide: bool = False, title: str | None = None
) -> None:
    """Print a table fitted to the terminal (whole when `wide` or piped)."""
    width = None if wide else terminal_width()
    if title:
        click.echo(fit(title, width))
    for line in render_table(cols, rows, width):
        click.echo(line)


def streamed_table(cols: Sequence[Col], rows: Callable[[], Iterable[Sequence[Any]]]) -> bool:
    """table(cols, rows()) for rows too many to hold: `rows()` is read twice, once for the
    columns' widths and once to print, and memory holds a row, not the table. Prints nothing and
    returns False when there is no row."""
    seen = 0

    def cells() -> Iterator[list[str]]:
        return ([clean(v) for v in row] for row in rows())

    def counted() -> Iterator[list[str]]:
        nonlocal seen
        for row in cells():
            seen += 1
            yield row

    widths = _table_widths(cols, counted(), terminal_width())
    if not seen:
        return False
    for line in _table_lines(cols, widths, cells()):
        click.echo(line)
    return True


def fields_block(pairs: Sequence[tuple[str, Any]], wrap: bool = True, whole: Sequence[str] = ()) -> list[str]:
    """'label   value' lines, labels aligned (empty values left out). To fit the terminal a long
    value wraps under its column, and a word too long for a line (a path) loses its middle;
    the values of the labels in `whole` (keys) are never cut."""
    pairs = [(k, clean(v)) for k, v in pairs if v not in (None, "")]
    if not pairs:
        return []
    pad = max(len(k) for k, _ in pairs) + 2
    width = terminal_width() if wrap else None
    out = []
    for k, v in pairs:
        if width is None or cells(v) + pad <= width:
            out.append(f"{k:<{pad}}{v}")
            continue
        room = max(10, width - pad)
        if k not in whole:
            v = " ".join(w if cells(w) <= room else _middle_out(w, room) for w in v.split(" "))
        out.extend(wrap_lines(v, pad + room, initial_indent=f"{k:<{pad}}", subsequent_indent=" " * pad) or [k])
    return out


def _middle_out(word: str, room: int) -> str:
    """`word` (a path) in `room` columns: its start and end, an ellipsis for its middle."""
    return _head(word, room // 2 - 1) + "…" + _head(word[::-1], room - room // 2)[::-1]


def _head(text: str, columns: int) -> str:
    """The start of `text` that fits in `columns` (one short where a wide character is split)."""
    if text.isascii():
        return text[:columns]
    from rich.cells import set_cell_size

    return set_cell_size(text, columns).rstrip(" ")  # (it pads a split wide character with a space)


def say(text: str, err: bool = False) -> None:
    """A line of prose, escaped (what it quotes, a path or a key, is anyone's) and wrapped to fit
    the terminal (whole when piped, for grep)."""
    text = clean(text)
    width = terminal_width()
    if width is None or cells(text) <= width:
        click.echo(text, err=err)
        return
    for line in wrap_lines(text, width, subsequent_indent="  "):
        click.echo(line, err=err)


def wrap_lines(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "") -> list[str]:
    """textwrap.wrap's lines (words kept whole, hyphens too), measured in the columns they take:
    a CJK character takes two."""
    if (text + initial_indent + subsequent_indent).isascii():
        import textwrap

        return textwrap.wrap(
            text,
            width,
            initial_indent=initial_indent,
            subsequent_indent=subsequent_indent,
            break_on_hyphens=False,
            break_long_words=False,
        )
    lines: list[str] = []
    line, used, empty = initial_indent, cells(initial_indent), True
    for word in text.split():
        if not empty and used + 1 + cells(word) > width:
            lines.append(line)
            line, used, empty = subsequent_indent, cells(subsequent_indent), True
        if not empty:
            line, used = line + " ", used + 1
        line, used, empty = line + word, used + cells(word), False
    if not empty:
        lines.append(line)
    return lines


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 entry', '2 entries', '1 host', '0 hosts'."""
    if n == 1:
        return f"1 {word}"
    return f"{n:,} {many or (word[:-1] + 'ies' if word.endswith('y') else word + 's')}"


def human_size(n: int | None) -> str:
    return format_size(n)


def age(ts: float | None, now: float | None = None) -> str:
    """How long ago `ts` was (before `now`, default now), in whole seconds; '-' when unknown (None,
    0: a kernel folder with no file to date it by; a value no clock gives, from an index edited by
    hand)."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 < ts < 1e12:
        return "-"
    return format_duration(max(0, round((time.time() if now is None else now) - ts)))


def seconds(s: float | None) -> str:
    """A compile time as people read it: '0.96s', '11.84s', '2.3m'."""
    if s is None:
        return "-"
    return f"{s:.2f}s" if s < 60 else format_duration(s)


def short(text: str | None, width: int | None) -> str:
    """`text` cut to `width` columns with an ellipsis (whole when width is None)."""
    if not text:
        return ""
    return text if width is None or cells(text) <= width else _head(text, width - 1) + "…"


def fit(text: str, width: int | None) -> str:
    """A line of what came from a cache, an index or a host: escaped, then cut to `width`."""
    return short(clean(text), width)


def cells(text: str) -> int:
    """Columns `text` takes on a terminal (a CJK character takes two)."""
    if text.isascii():
        return len(text)
    from rich.cells import cell_len

    return cell_len(text)


def ingest_spool(app) -> None:
    """Move the shapes `cachemgr.record` spooled into the index; report lines it skipped."""
    from cachemgr.prewarm import spool  # no torch, and no SQLAlchemy when nothing is waiting

    if spool.waiting(app.settings.spool_dir):
        for bad in spool.ingest(app.db, app.settings.spool_dir).bad_lines:
            click.echo(f"cachemgr: spool: skipped {bad}", err=True)


@contextmanager
def progress_bar(label: str, enabled: bool | None = None) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback (done, total) drawn on stderr when it is a terminal; None otherwise.
    The bar (and rich's import) starts at the first call: work that reports none pays nothing."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield None
        return
    with ExitStack() as stack:
        bar: list = []  # [Progress, task id] once started

        def update(done: int, total: int) -> None:
            if not bar:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

                p = stack.enter_context(
                    Progress(
                        f"[bold]{label}",
                        BarColumn(),
                        MofNCompleteColumn(),
                        TimeElapsedColumn(),
                        console=Console(stderr=True),
                        transient=True,
                    )
                )
                bar.extend((p, p.add_task(label, total=total)))
            bar[0].update(bar[1], completed=done, total=total)

        yield update
