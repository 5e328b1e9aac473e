"""check: will this host hit a cache or a bundle? Predicted before anything compiles or loads.

torch is never imported here: this host's side of the hash components is computed in a worker
process (cachemgr.prewarm.worker), the comparison in cachemgr.check.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING

import click

from cachemgr.cli.common import (
    emit_json,
    exit_codes,
    fit,
    json_option,
    pass_app,
    plural,
    say,
    terminal_width,
    wide_option,
)
from cachemgr.errors import PrewarmError, UsageError
from cachemgr.prewarm import MAX_BUNDLE_BYTES
from cachemgr.units import format_size

if TYPE_CHECKING:
    from cachemgr.check import Host

SHOWN_DIFFERENCES = 12  # differences shown per group of graphs (--json has all)


def learn(app, result) -> None:
    """Record what the workers' torch reported (torch_version hash -> torch.__version__, system
    hash -> 'NVIDIA H200, CUDA 13.0, Triton 3.6.0') in the index's fingerprints, for this host."""
    learned = result.learned()
    if not learned:
        return
    try:
        store = app.store
        for kind, h, name in learned:
            store.record_fingerprint(kind, h, name)
    except Exception as e:  # noqa: BLE001 - learning is a side effect: a read-only index does not fail the command
        click.echo(f"cachemgr: could not record this host's torch fingerprint in the index: {e}", err=True)


def check_spec(app, manifest, devices: list[str] | None, **extra) -> dict:
    """What the worker needs for the check: the option sets cachemgr knows (the manifest's, and
    those cachemgr.record recorded per model), the devices, whether the manifest is complete."""
    from cachemgr import check
    from cachemgr.cli.common import ingest_spool
    from cachemgr.prewarm.spool import each_recorded

    try:
        ingest_spool(app)
        # a row at a time: a spool's writers may have made any number (holding them all decoded
        # took gigabytes); each model's latest options are all that is kept
        sets = check.option_sets(manifest, each_recorded(app.db))
    except Exception:  # noqa: BLE001 - no index (or an unreachable one): no recorded options
        sets = check.option_sets(manifest)
    return {
        "option_sets": sets,
        "devices": devices,
        # (a model the manifest could not give is a workload cachemgr does not know)
        "complete": manifest is not None and not manifest.errors,
        **extra,
    }


def worker_device(devices: list[str] | None) -> str:
    """Where the check's worker runs: the first GPU named (its index is the current device)."""
    return next((d for d in devices or () if d.startswith("cuda")), "cpu")


def host_of(app, spec: dict, env: dict) -> Host:
    from cachemgr import check
    from cachemgr.cli.prewarm import _progress
    from cachemgr.prewarm import worker

    with _progress(sys.stderr.isatty(), "check") as on:
        result = worker.run([(worker_device(spec["devices"]), [])], env, phase="check", on_event=on, check=spec)
    learn(app, result)
    if result.host_side is None:
        why = "; ".join(result.failures()) or "the worker reported nothing"
        raise PrewarmError(f"check: this host's side could not be computed: {why}")
    side = {k: v for k, v in result.host_side.items() if k != "e"}
    return check.Host.of(side, spec["devices"], spec["complete"])


def render(report, width: int | None, shorts: dict[str, str] | None = None, show_hits: bool = False) -> list[str]:
    """Per graph its verdict and cause; the differences once per group of graphs that share them
    (both values, grouped as `diff` groups them); then one line per cause."""
    from cachemgr import check

    shorts = shorts or {}
    h = report.host
    out = [
        fit(
            f"host: torch {h.torch} ({(h.torch_version_hash or '?')[:12]}), {h.system}; devices "
            f"{', '.join(h.devices)}; option sets: {', '.join(c.label for c in h.candidates)}"
            + (" (the manifest's: complete)" if h.complete else ""),
            width,
        )
    ]
    if h.env:
        out.append(fit("environment: " + ", ".join(f"{k}={v}" for k, v in sorted(h.env.items())), width))
    for e in h.errors:
        out.append(fit(f"option set refused by torch: {e}", width))
    out.append(fit(f"{report.source}: {plural(len(report.predictions), 'graph')}", width))
    groups: dict[tuple, list] = defaultdict(list)
    for p in report.predictions:
        name = shorts.get(p.graph.key) or (p.graph.graph_key or p.graph.key)[:12]
        if p.verdict != check.HIT or show_hits:
            verdict = {"hit": "will hit", "miss": "will miss", "unknown": "unknown"}[p.verdict]
            note = p.cause() if p.verdict != check.HIT else (f"options of {p.options}" if p.options else "")
            out.append(fit(f"  {name:<14} {verdict:<9} {note}", width))
        if p.differences:  # a miss by what makes it one; an unknown by all it differs in
            key = tuple(d for d in p.differences if d.certain or p.verdict != check.MISS)
            groups[key].append((name, len(p.differences) - len(key)))
    for diffs, members in groups.items():
        names = [n for n, _ in members]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        differ = "differs" if len(names) == 1 else "differ"
        out.append(fit(f"{plural(len(names), 'graph')} ({shown}) {differ} from this host in:", width))
        certain = [d for d in diffs if d.certain]
        listed = (certain or list(diffs))[:SHOWN_DIFFERENCES]
        by_group: dict[str, list] = defaultdict(list)
        for d in listed:
            by_group[d.group].append(d)
        for group in ("code", "inputs", "options", "environment"):
            for d in by_group.get(group, []):
                out.append(fit(f"  {group}: {d.name}" + (f" ({d.why})" if d.why else ""), width))
                out.append(fit(f"      cache: {'(absent)' if d.cache is None else d.cache}", width))
                out.append(fit(f"      here:  {'(absent)' if d.host is None else d.host}", width))
        rest = len(diffs) - len(listed) + max(more for _, more in members)
        if rest:
            out.append(fit(f"  ... and {rest} more component(s) that differ (--json lists them)", width))
    out.append(
        "summary: "
        + ", ".join(
            f"{report.count(v)} {w}" for v, w in (("hit", "will hit"), ("miss", "will miss"), ("unknown", "unknown"))
        )
    )
    out.extend(fit("  " + s.text(), width) for s in check.summarize(report.predictions))
    return out


@click.command(name="check")
@click.option(
    "--bundle",
    "bundle_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Check a bundle (`cachemgr export`) instead of a cache directory.",
)
@click.option(
    "--cache-dir", "cache_dir", metavar="DIR", help="Check this cache directory (default: the one configured)."
)
@click.option(
    "--manifest",
    "manifest_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="The workload's models: their compile options are what this host compiles with (taken as all).",
)
@click.option(
    "--devices",
    metavar="LIST",
    help="Where the workload runs here (cuda:0,cuda:1 or cpu); default: every device of this host.",
)
@click.option("--all", "show_all", is_flag=True, help="List the graphs that will hit too.")
@wide_option
@json_option
@pass_app
@exit_codes(
    0,
    2,
    3,
    4,
    5,
    (8, "this host's side could not be computed (its torch worker failed)"),
    (
        9,
        f"--bundle names a file that is no bundle (or over {format_size(MAX_BUNDLE_BYTES)}), or one\n"
        "import refuses (a key not a name inside the cache)",
    ),
)
def check_cmd(
    app,
    bundle_path: str | None,
    cache_dir: str | None,
    manifest_path: str | None,
    devices: str | None,
    show_all: bool,
    wide: bool,
    as_json: bool,
) -> None:
    """Predict which graphs of a cache (or bundle) this host will reuse, before it compiles.

    A worker process with this host's torch computes every hash component that does not depend
    on the graph (torch build, GPU, CUDA/ROCm and Triton versions, each Inductor option in force,
    matmul and determinism settings, thread count, devices); each entry's stored components are
    compared with them. Per graph: will hit; will miss, with the components that differ (both
    values); or unknown, with why (torch 2.5/2.6 record no components; options given to
    torch.compile that cachemgr does not know: give them with --manifest or record the model with
    cachemgr.record). Ends with one line per cause. The worker's environment is this shell's: run
    it where the workload's TORCHINDUCTOR_* variables are set.

    \b
    Example:
        cachemgr check
        cachemgr check --bundle /seed/cache.bundle --devices cuda:0
        cachemgr check --manifest models.toml --json | jq .summary
    """
    from cachemgr import check
    from cachemgr.cli.common import App
    from cachemgr.cli.prewarm import _devices, worker_env

    if bundle_path and cache_dir:
        raise UsageError("give --bundle or --cache-dir, not both")
    devs = _devices(devices)
    manifest = None
    if manifest_path:
        from cachemgr.prewarm import manifest as mf

        manifest = mf.load(manifest_path)
        for _, error in manifest.errors:  # (its options then unknown: the manifest is not complete)
            say(f"cachemgr: {error}", err=True)
    target = app
    if cache_dir:
        target = App(app.config_file, {**app.flags, "cache_dir": cache_dir})
    try:
        shorts: dict[str, str] = {}
        missing: list[str] | None = None
        if bundle_path:
            from cachemgr.prewarm import bundle

            b = bundle.read(bundle_path)
            arts = bundle.artifacts(b.payload, bundle_path)
            unsafe = bundle.unsafe_keys(arts)  # as import refuses it: a bundle that passes here imports
            if unsafe:
                more = f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
                raise bundle.BundleError(f"bundle {bundle_path}: import refuses it: {unsafe[0]}{more}")
            contents = bundle.read_contents(b.header, arts)
            names = _torch_names(target)
            graphs = [
                replace(g, torch_version=names.get(g.torch_version_hash or "", g.torch_version))
                for g in bundle.graphs(contents)
            ]
            missing = bundle.completeness(contents, b.header.get("expects"))
            source = bundle_path
        else:
            from cachemgr.cli.inspect import scanned_store
            from cachemgr.index.result import check_root

            check_root(target.settings.cache_dir)
            store = scanned_store(target)
            graphs = check.graphs_from_store(store)
            source = target.settings.cache_dir
            keys = {g.graph_key for g in graphs if g.graph_key}
            by_graph = store.short_graph_keys(keys) if keys else {}
            shorts = {g.key: by_graph.get(g.graph_key or "", "") for g in graphs}
        if wide:
            shorts = {g.key: g.graph_key or g.key for g in graphs}
        host = host_of(target, check_spec(target, manifest, devs), worker_env(target))
        report = check.check(graphs, host, source)
    finally:
        if target is not app:
            target.close()
    if as_json:
        doc = report.as_dict()
        if missing is not None:
            doc["complete"], doc["missing"] = not missing, missing
        emit_json(doc)
        return
    width = None if wide else terminal_width()  # None (--wide, a pipe, a file): nothing is cut
    for line in render(report, width, shorts, show_all):
        click.echo(line)
    if missing:
        click.echo(f"partial bundle: {plural(len(missing), 'thing')} its entries name are not in it:")
        for m in missing[:20]:
            click.echo(fit(f"  {m}", width))


def _torch_names(app) -> dict[str, str]:
    """torch_version hash -> torch.__version__, as the index learned them (none without an index)."""
    try:
        return app.store.fingerprint_names()
    except Exception:  # noqa: BLE001 - naming is a nicety: without an index the hash is shown
        return {}


COMMANDS = (check_cmd,)
