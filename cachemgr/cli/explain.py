"""diff, explain: why a compile missed the cache. Reads the index only; never imports torch."""

from __future__ import annotations

import textwrap

import click

from cachemgr.cli.common import (
    COUNT,
    DURATION,
    KEY,
    age,
    clean,
    emit_json,
    exit_codes,
    fit,
    json_option,
    model_option,
    pass_app,
    plural,
    say,
    text_width,
)
from cachemgr.units import format_duration

INDENT = "    "
CODE_LINES = 12


def _wrap(line: str, width: int, indent: str = "", sub: str | None = None) -> list[str]:
    return textwrap.wrap(
        clean(line),
        width,
        initial_indent=indent,
        subsequent_indent=indent + "  " if sub is None else sub,
        break_on_hyphens=False,
    ) or [indent]


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
                body = list(d.code_diff[2:])  # skip the ---/+++ header
                for ln in body[:CODE_LINES]:
                    out.append(fit(f"{indent}{INDENT}{ln}", width) or indent)
                if len(body) > CODE_LINES:
                    out.append(f"{indent}{INDENT}... {len(body) - CODE_LINES} more diff lines (--json has all)")
                continue
            out.extend(_wrap(c.name + _fields_text(c), w, indent + "  "))
            for label, value in zip(labels, (c.a, c.b), strict=True):
                shown = "(absent)" if value is None else value
                out.append(fit(f"{indent}{INDENT}{label}: {shown}", width))
    if derived:
        reasons = sorted({c.derived for c in derived if c.derived})
        names = ", ".join(c.name for c in derived)
        out.extend(_wrap(f"also changed, because {' and '.join(reasons)}: {names}", w, indent))
    return out


def _fields_text(c) -> str:
    """': dtype and stride changed', ': shape became dynamic', ': added' (inputs only)."""
    if not c.fields or c.group != "inputs":
        return ""
    if c.fields[0] in ("added", "removed"):
        return ": " + c.fields[0]
    words = ["shape became dynamic" if f == "shape (dynamic)" else f for f in c.fields]
    changed = [f for f in words if f != "shape became dynamic"]
    parts = ([" and ".join(changed) + " changed"] if changed else []) + (
        ["shape became dynamic"] if "shape became dynamic" in words else []
    )
    return ": " + ", ".join(parts)


def _explainer(app):
    from cachemgr import explain as X
    from cachemgr.cli.inspect import scanned_store

    return X.Explainer(scanned_store(app))


@click.command(name="diff")
@click.argument("key_a", type=KEY)
@click.argument("key_b", type=KEY)
@json_option
@pass_app
@exit_codes(0, 2, 3, 4, 5)
def diff_cmd(app, key_a: str, key_b: str, as_json: bool) -> None:
    """The hash components that differ between two fxgraph entries.

    Grouped as code (the graph changed), inputs (which input, and whether its shape, dtype,
    stride or device changed), options (fx_kwargs / inductor_config keys) and environment
    (torch version, system info, matmul and determinism settings). KEY is any key a command
    prints (a graph key names its newest entry; keys that begin with '-' go after `--`).
    Entries of torch 2.5 and 2.6 record no hash components: for them only the fields they
    record are compared.

    \b
    Example:
        cachemgr diff fz5q6oeb fswx4xl7
        cachemgr diff fz5q6oeb fswx4xl7 --json | jq .causes
    """
    x = _explainer(app)
    (a, na), (b, nb) = x.resolve(key_a), x.resolve(key_b)
    d = x.diff(a, b)
    shorts = x.shorts(diffs=[d])
    if as_json:
        emit_json(d.as_dict(shorts))
        return
    width = text_width()
    for label, e, n in (("A", a, na), ("B", b, nb)):
        more = f", newest of {n}" if n > 1 else ""
        click.echo(fit(f"{label}  {shorts[e.key]}  compiled {age(e.mtime)} ago{more}", width))
    if a.key == b.key:
        click.echo("A and B are the same entry: nothing to compare")
        return
    if d.not_recorded:
        for line in _wrap(
            f"hash components: not recorded by {d.not_recorded}; only what both record is compared"
            + ("" if d.changes else ", and it is the same"),
            width,
        ):
            click.echo(line)
    elif d.same:
        say("same hash components: the two entries are one key compiled for different guard sets")
        return
    else:
        click.echo(_counts(d))
    for line in render_diff(d, width, indent=""):
        click.echo(line)


@click.command()
@click.option(
    "--since",
    type=DURATION,
    default="1d",
    show_default=True,
    help="Explain the compiles (new entries) of this window: 6h, 1d, 2w.",
)
@click.option("--graph", type=KEY, metavar="KEY", help="Only the compiles of this graph (any key form of it).")
@model_option
@click.option("--summary", is_flag=True, help="Only one line per cause across the cache.")
@click.option(
    "--limit",
    type=COUNT,
    default=20,
    show_default=True,
    help="Show at most this many compiles, the most recent (the summary counts all).",
)
@json_option
@pass_app
@exit_codes(0, 2, 3, 4, 5)
def explain(app, since: float, graph: str | None, model: str | None, summary: bool, limit: int, as_json: bool) -> None:
    """Why recent compiles missed the cache: which hash component changed.

    For each new fxgraph entry in the window, the nearest earlier entries (same graph code
    first, else the most hash components shared) and the components that differ from the
    nearest. When the graph code changed, the first lines of the code diff. Ends with one line
    per cause, each compile counted once, e.g. "12 graphs recompiled because
    inductor_config[max_autotune] changed". Entries `cachemgr import` loaded are no compiles.

    \b
    Example:
        cachemgr explain --since 6h
        cachemgr explain --summary --since 7d
        cachemgr explain --graph fz5q6oeb --json   # one graph
    """
    from cachemgr import explain as X
    from cachemgr.cli.inspect import graph_filter

    x = _explainer(app)
    graphs = graph_filter(app, x.store, graph, model)
    events = x.store.compile_events(X.since_epoch(since))
    misses = x.misses(events, graphs)
    act = X.activity(x.store, since, misses=misses) if graphs is None else None
    loaded = sum(1 for ev in events if ev.loaded and (graphs is None or ev.graph_key in graphs))
    lines = X.summarize(misses)
    splits = X.fragmentation(x.store) if summary and graphs is None else []  # a fleet index: what splits it
    shown = misses[-limit:]
    recompiles = sum(1 for m in misses if m.recompiled)
    if as_json:
        shorts = x.shorts(shown)
        doc = {
            "since_seconds": since,
            "compiles": len(misses),
            "recompiles": recompiles,
            "loaded": loaded,
            "summary": [s.as_dict() for s in lines],
        }
        if act is not None:
            doc["activity"] = act.as_dict()
        if splits:
            doc["fragmentation"] = [s.as_dict() for s in splits]
        if not summary:
            doc["misses"] = [m.as_dict(shorts) for m in shown]
        emit_json(doc)
        return
    width = text_width()
    if splits:
        click.echo("fleet: components that differ between hosts for the same graph code")
        for s in splits:
            for line in _wrap(s.text(), width - 2, "  ", "      "):
                click.echo(line)
    if not misses:
        click.echo(
            f"no compiles in the last {format_duration(since)}"
            + (" for that graph" if graph else "")
            + (f" for model {model}" if model else "")
            + (f" ({loaded:,} entries loaded)" if loaded else "")
            + " (try a longer --since)"
        )
        return
    if not summary:
        shorts = x.shorts(shown)
        if len(shown) < len(misses):
            click.echo(f"the last {len(shown)} of {len(misses)} compiles (--limit for more):")
        for m in shown:
            for line in render_miss(m, shorts, width):
                click.echo(line)
            click.echo()
    head = (
        f"summary: {plural(len(misses), 'compile')} in the last {format_duration(since)}, "
        f"{plural(recompiles, 'recompile')}"
    )
    if loaded:
        head += f"; {loaded:,} entries loaded, not compiled"
    for line in _wrap(head, width, "", "  "):
        click.echo(line)
    for cause in lines:
        for line in _wrap(cause.text(), width - 2, "  ", "      "):
            click.echo(line)


def _counts(d) -> str:
    """'634 components shared, 2 differ (+3 as a consequence)': what diff and explain say of a Diff."""
    n = sum(1 for c in d.changes if not c.derived)
    return f"{d.shared} components shared, {n} differ{'s' if n == 1 else ''}" + (
        f" (+{len(d.changes) - n} as a consequence)" if n < len(d.changes) else ""
    )


def render_miss(m, shorts: dict[str, str], width: int) -> list[str]:
    secs = "" if m.event.seconds is None else f", {m.event.seconds:.2f} s to compile"
    out = [fit(f"{shorts.get(m.key, m.key)}  compiled {age(m.event.ts)} ago{secs}", width)]
    if m.verdict == "first":
        out.append("  first compile in this cache: no earlier entry to compare with")
        return out
    if m.verdict == "gone":
        out.extend(_wrap("its entry is no longer in the index: nothing to compare", width - 2, "  "))
        return out
    if m.verdict == "unrecorded":
        out.extend(
            _wrap(f"not recorded: {m.note} records no hash components, so why it missed is unknown", width - 2, "  ")
        )
        return out
    best = m.nearest[0]
    if m.diff is None:  # the same key, where no hash components are recorded
        out.append(fit(f"  same graph key as {shorts.get(best.entry.key, best.entry.key)}", width))
    else:
        how = "same graph code" if best.same_code else "nearest"
        out.append(fit(f"  {how}: {shorts.get(best.entry.key, best.entry.key)}, {_counts(m.diff)}", width))
    if len(m.nearest) > 1:
        others = ", ".join(f"{shorts.get(c.entry.key, c.entry.key)} ({c.differ})" for c in m.nearest[1:])
        out.append(fit(f"  next nearest (components differing by name): {others}", width))
    if m.verdict == "guards":
        out.extend(
            _wrap(
                "same hash components: one key compiled again for another guard set"
                if m.diff is not None
                else "one key compiled again for another guard set",
                width - 2,
                "  ",
            )
        )
        for label, g in zip(("earlier", "this"), m.guards, strict=True):
            out.append(fit(f"    {label} guards: {g or '(none)'}", width))
        return out
    if m.verdict == "new-graph":
        out.extend(_wrap(f"a new graph: {m.note}", width - 2, "  "))
        return out
    assert m.diff is not None
    out.extend(_wrap("missed because " + "; ".join(m.causes()), width - 2, "  "))
    out.extend(render_diff(m.diff, width, "  ", labels=("was", "now")))
    return out


COMMANDS = (diff_cmd, explain)
