"""diff, explain: why a compile missed the cache. Reads the index only; never imports torch."""

from __future__ import annotations

import shutil
import textwrap

import click

from cachemgr.cli.common import DURATION, age, emit_json, json_option, pass_app, short
from cachemgr.errors import UsageError
from cachemgr.units import format_duration

INDENT = "    "


def _width() -> int:
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def _wrap(line: str, width: int, indent: str = "", sub: str | None = None) -> list[str]:
    return textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent + "  " if sub is None else sub,
                         break_on_hyphens=False) or [indent]


def _ensure_scanned(app) -> None:
    from sqlalchemy import text

    with app.db.engine.connect() as conn:
        last = conn.execute(text("SELECT last_scan FROM caches WHERE id = :c"), {"c": app.cache_id}).scalar()
    if last is None:
        from cachemgr.cli.inspect import run_scan

        click.echo(f"cachemgr: {app.settings.cache_dir} was never scanned; scanning it now", err=True)
        run_scan(app)


def render_diff(d, width: int, indent: str = "  ", labels: tuple[str, str] = ("A", "B")) -> list[str]:
    """The changes of a Diff, grouped, each line at most `width` columns."""
    out: list[str] = []
    w = width - len(indent)
    derived = [c for c in d.changes if c.derived]
    for group, changes in d.by_group().items():
        changes = [c for c in changes if not c.derived]
        if not changes:
            continue
        out.append(f"{indent}{group}")
        for c in changes:
            if c.name == "gm":
                sim = "" if d.code_similarity is None else f" ({d.code_similarity:.0%} of lines alike)"
                out.extend(_wrap(f"the graph code (gm) changed{sim}:", w, indent + "  "))
                body = [ln for ln in d.code_diff[2:]]  # skip the ---/+++ header
                for ln in body[:CODE_LINES]:
                    out.append(short(f"{indent}{INDENT}{ln}", width) or indent)
                if len(body) > CODE_LINES:
                    out.append(f"{indent}{INDENT}... {len(body) - CODE_LINES} more diff lines (--json has all)")
                continue
            out.extend(_wrap(c.name + _fields_text(c), w, indent + "  "))
            for label, value in zip(labels, (c.a, c.b)):
                shown = "(absent)" if value is None else value
                out.append(short(f"{indent}{INDENT}{label}: {shown}", width))
    if derived:
        reasons = sorted({c.derived for c in derived if c.derived})
        names = ", ".join(c.name for c in derived)
        out.extend(_wrap(f"also changed, because {' and '.join(reasons)}: {names}", w, indent))
    return out


CODE_LINES = 12


def _fields_text(c) -> str:
    """': dtype and stride changed', ': shape became dynamic', ': added' (inputs only)."""
    if not c.fields or c.group != "inputs":
        return ""
    if c.fields[0] in ("added", "removed"):
        return ": " + c.fields[0]
    words = ["shape became dynamic" if f == "shape (dynamic)" else f for f in c.fields]
    changed = [f for f in words if f != "shape became dynamic"]
    parts = ([" and ".join(changed) + " changed"] if changed else []) + (
        ["shape became dynamic"] if "shape became dynamic" in words else [])
    return ": " + ", ".join(parts)


@click.command(name="diff")
@click.argument("key_a")
@click.argument("key_b")
@json_option
@pass_app
def diff_cmd(app, key_a: str, key_b: str, as_json: bool) -> None:
    """The hash components that differ between two fxgraph entries.

    Grouped as code (the graph changed), inputs (which input, and whether its shape, dtype,
    stride or device changed), options (fx_kwargs / inductor_config keys) and environment
    (torch version, system info, matmul and determinism settings). KEY is an entry key, a graph
    key (its newest entry), a unique prefix, or the short 'graph/file' form explain prints.

    \b
    Example:
        cachemgr diff fz5q6oebaq3sx/r5b6tx fswx4xl7jl56x/va5lrg
        cachemgr diff fz5q6oebaq3sx fswx4xl7jl56x --json | jq .causes
    """
    from cachemgr import explain as X

    _ensure_scanned(app)
    with app.db.engine.connect() as conn:
        (a, na), (b, nb) = X.resolve(conn, app.cache_id, key_a), X.resolve(conn, app.cache_id, key_b)
        d = X.diff(conn, a, b)
    if as_json:
        emit_json(d.as_dict())
        return
    width = _width()
    for label, e, n in (("A", a, na), ("B", b, nb)):
        more = f", newest of {n}" if n > 1 else ""
        click.echo(short(f"{label}  {e.short}  compiled {age(e.mtime)} ago{more}", width))
        click.echo(short(f"   {e.key}", width))
    if a.key == b.key:
        click.echo("A and B are the same entry: nothing to compare")
        return
    if d.same:
        click.echo("same hash components: the two entries are one key compiled for different guard sets")
        return
    n = sum(1 for c in d.changes if not c.derived)
    click.echo(f"{d.shared} components shared, {n} differ{'s' if n == 1 else ''}" + (f" (+{len(d.changes) - n} as a consequence)"
                                                             if n < len(d.changes) else ""))
    for line in render_diff(d, width, indent=""):
        click.echo(line)


@click.command()
@click.option("--since", type=DURATION, default="1d", show_default=True,
              help="Explain the compiles (new entries) of this window: 6h, 1d, 2w.")
@click.option("--graph", metavar="KEY", help="Only the compiles of this graph key (or entry key).")
@click.option("--model", metavar="NAME", help="Only the graphs of this model (from recorded shapes).")
@click.option("--summary", is_flag=True, help="Only one line per cause across the cache.")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Show at most this many compiles, the most recent (the summary counts all).")
@json_option
@pass_app
def explain(app, since: float, graph: str | None, model: str | None, summary: bool, limit: int,
            as_json: bool) -> None:
    """Why recent compiles missed the cache: which hash component changed.

    For each new fxgraph entry in the window, the nearest earlier entries (same graph code
    first, else the most hash components shared) and the components that differ from the
    nearest. When the graph code changed, the first lines of the code diff. Ends with one line
    per cause, e.g. "12 graphs recompiled because inductor_config[max_autotune] changed".

    \b
    Example:
        cachemgr explain --since 6h
        cachemgr explain --summary --since 7d
        cachemgr explain --graph fz5q6oebaq3sx/r5b6tx --json   # one graph
    """
    from cachemgr import explain as X

    if graph and model:
        raise UsageError("give --graph or --model, not both")
    _ensure_scanned(app)
    with app.db.engine.connect() as conn:
        graphs = None
        if graph:
            e, _ = X.resolve(conn, app.cache_id, graph)
            graphs = {e.graph_key}
        elif model:
            from cachemgr.index.queries import model_graphs

            graphs = model_graphs(conn, app.cache_id, model)
        misses = X.recent_misses(conn, app.cache_id, X.since_epoch(since), graphs=graphs)
    lines = X.summarize(misses)
    shown = misses[-limit:]
    if as_json:
        doc = {"since_seconds": since, "compiles": len(misses), "summary": [s.as_dict() for s in lines]}
        if not summary:
            doc["misses"] = [m.as_dict() for m in shown]
        emit_json(doc)
        return
    width = _width()
    if not misses:
        click.echo(f"no compiles in the last {format_duration(since)}" + (" for that graph" if graph else "") +
                   (f" for model {model}" if model else "") + " (try a longer --since)")
        return
    if not summary:
        if len(shown) < len(misses):
            click.echo(f"the last {len(shown)} of {len(misses)} compiles (--limit for more):")
        for m in shown:
            for line in render_miss(m, width):
                click.echo(line)
            click.echo()
    click.echo(f"summary: {len(misses)} compiles in the last {format_duration(since)}")
    for s in lines:
        for line in _wrap(s.text(), width - 2, "  ", "      "):
            click.echo(line)


def render_miss(m, width: int) -> list[str]:
    secs = "" if m.seconds is None else f", {m.seconds:.2f} s to compile"
    out = [short(f"{m.entry.short}  compiled {age(m.ts)} ago{secs}", width)]
    if m.verdict == "first":
        out.append("  first compile in this cache: no earlier entry to compare with")
        return out
    best = m.nearest[0]
    how = "same graph code" if best.same_code else "nearest"
    out.append(short(f"  {how}: {best.entry.short} ({best.shared} components shared, {best.differ} differ)",
                     width))
    if len(m.nearest) > 1:
        others = ", ".join(f"{c.entry.short} ({c.differ})" for c in m.nearest[1:])
        out.append(short(f"  next nearest (differ): {others}", width))
    if m.verdict == "guards":
        out.extend(_wrap("same hash components: one key compiled again for another guard set", width - 2, "  "))
        for label, g in zip(("earlier", "this"), m.guards):
            out.append(short(f"    {label} guards: {g or '(none)'}", width))
        return out
    if m.verdict == "new-graph":
        out.extend(_wrap(f"a new graph: {m.note}", width - 2, "  "))
        return out
    assert m.diff is not None
    out.extend(_wrap("missed because " + "; ".join(m.diff.causes()), width - 2, "  "))
    out.extend(render_diff(m.diff, width, "  ", labels=("was", "now")))
    return out


COMMANDS = (diff_cmd, explain)
