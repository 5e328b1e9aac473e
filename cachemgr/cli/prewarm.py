"""shapes, prewarm, export, import: make a new host or container start with a warm cache.

torch is never imported here: replays, exports and imports run in worker processes
(cachemgr.prewarm.worker).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, suppress

import click

from cachemgr.cli.common import (
    Col,
    clean,
    emit_json,
    exit_codes,
    fit,
    ingest_spool,
    json_option,
    pass_app,
    say,
    table,
    terminal_width,
)
from cachemgr.errors import PrewarmError, UsageError
from cachemgr.prewarm import MAX_BUNDLE_BYTES
from cachemgr.units import format_size

MAX_BUNDLE = format_size(MAX_BUNDLE_BYTES)


def _recorded(app, model: str | None = None) -> list[dict]:
    from cachemgr.prewarm.spool import list_shapes

    ingest_spool(app)
    return list_shapes(app.db, model)


def worker_env(app, target: str = "local") -> dict[str, str]:
    """The worker's environment: this cache dir, cachemgr importable, remote tiers if asked."""
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = app.settings.cache_dir
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.getcwd(), env.get("PYTHONPATH")) if p)
    if target == "redis":
        from cachemgr.fleet.remote import configured_url

        env.update(
            TORCHINDUCTOR_REDIS_URL=configured_url(app.settings.redis_url, what="prewarm --target redis"),
            TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
            TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
        )
    return env


def _search_path(env: dict[str, str]) -> list[str]:
    """Where the worker will look for factory modules: its PYTHONPATH, then this interpreter's path."""
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [p or os.getcwd() for p in sys.path]


def _artifacts(counts: dict | None) -> str:
    """`{"inductor": 12, "aot_autograd": 3}` as people read it: `12 inductor, 3 aot_autograd`."""
    return ", ".join(f"{n} {kind}" for kind, n in (counts or {}).items()) or "no artifacts"


def _check_line(doc: dict) -> str:
    """The cache check of a bundle, in one line: 'check: 8 of 10 graphs will hit here (...)'."""
    causes = "; ".join(s["text"] for s in doc.get("summary", []) if s["verdict"] != "hit")
    partial = f"; partial: {len(doc['missing'])} missing" if doc.get("missing") else ""
    return (
        f"check: {doc.get('hit', 0)} of {doc.get('graphs', 0)} graphs will hit here"
        + (f" ({causes})" if causes else "")
        + partial
    )


@click.command()
@click.option("--model", metavar="NAME", help="Only this model's shapes.")
@json_option
@pass_app
@exit_codes(0, 2, (3, "the model named has no recorded shapes"), 5)
def shapes(app, model: str | None, as_json: bool) -> None:
    """List the input signatures cachemgr.record captured, per model, in first-seen order.

    The recorder's spool is ingested into the index first. `processes` counts the workload
    processes that saw a signature (a recorder writes each one once per process, not per call).

    \b
    Example:
        cachemgr shapes
        cachemgr shapes --model ranker --json | jq '.[].signature'
    """
    from cachemgr.cli.common import age, emit_json_list, streamed_table
    from cachemgr.index.store import Store
    from cachemgr.prewarm.spool import each_shape

    # The rows are read from the index as they are printed, never all held: how many there are
    # is up to the spool's writers (each up to 64 KiB). The table is not held for its columns'
    # widths either (piped, its cells are printed whole: options alone take up to 64 KiB): it is
    # read twice, once for the widths and once to print, its ages both times as of `now`.
    ingest_spool(app)
    store = Store.of_index(app.db)
    if model is not None and model not in store.models():  # ('' too: no model has that name)
        raise store.no_model(model)
    if as_json:
        emit_json_list(each_shape(app.db, model))
        return
    now = time.time()
    printed = streamed_table(
        (
            Col("model", cut=True, min=6),
            Col("signature", cut=True, min=12),
            Col("hash"),
            Col("processes", right=True),
            Col("varied", cut=True, min=6),
            Col("options", cut=True, min=7),
            Col("last seen", right=True),
        ),
        lambda: (
            (
                r["model"],
                r["signature"],
                r["signature_hash"],
                r["count"],
                ",".join(r["varied"]) or "-",
                ",".join(f"{k}={v}" for k, v in r["options"].items()) or "-",
                age(r["last_seen"], now),
            )
            for r in each_shape(app.db, model)
        ),
    )
    if not printed:
        click.echo(
            "no shapes recorded" + (f" for model {model!r}" if model else "") + f" (spool: {app.settings.spool_dir})"
        )


def _devices(value: str | None) -> list[str] | None:
    """--devices of prewarm, import and check: each a device name, and one this host has (a CUDA
    device where there is none is refused before torch starts)."""
    if value is None:
        return None
    devs = [d.strip() for d in value.split(",") if d.strip()]
    import re

    from cachemgr.prewarm.worker import cuda_problem

    if not devs:
        raise click.BadParameter("name at least one device (cpu, cuda or cuda:N)", param_hint="--devices")
    for d in devs:
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", d):  # (ASCII digits: `\d` takes '٣')
            raise click.BadParameter(f"{d!r}: devices are cpu, cuda or cuda:N", param_hint="--devices")
        problem = cuda_problem(d)
        if problem:
            raise UsageError(f"--devices {d}: {problem}")
    return devs


@contextmanager
def _progress(tty: bool, label: str = "prewarm"):
    """Progress on stderr from the first second: a line when a worker starts and when torch is up
    in it, per model, per shape (compiling, then its result). On a terminal, with per-model bars
    under the lines. Yields the event callback. What a line quotes (a signature, an error) is
    anyone's: escaped, and cut to the terminal."""
    if not tty:

        def on_line(ev: dict) -> None:
            line = _progress_line(ev, label)
            if line:
                click.echo(fit(line, terminal_width()), err=True)

        yield on_line
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
    from rich.text import Text

    with Progress(
        TextColumn("{task.description}", style="bold", markup=False),  # (a model named `a[b]` is no markup)
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as p:
        tasks: dict[str, TaskID] = {}

        def on(ev: dict) -> None:
            line = _progress_line(ev, label)
            if line:
                p.console.print(Text(fit(line, terminal_width())))  # Text: a signature like '[s0, 32]' is not markup
            if ev["e"] == "model":
                if ev["model"] not in tasks:
                    tasks[ev["model"]] = p.add_task(clean(ev["model"]), total=0)
                task = tasks[ev["model"]]
                p.update(task, total=(p.tasks[task].total or 0) + ev["shapes"])
            elif ev["e"] == "shape" and not ev.get("lead_in") and ev["model"] in tasks:
                p.advance(tasks[ev["model"]])

        yield on


def _progress_line(ev: dict, label: str) -> str | None:
    e = ev["e"]
    if e == "worker_start":
        return (
            f"{label}: worker {ev['pid']} started on {ev['device']} ({ev['models']} model(s), "
            f"{ev['shapes']} shape(s)); starting torch"
        )
    if e == "worker_ready":
        return f"{label}: worker {ev['pid']}: torch {ev['torch']} ready on {ev['device']}"
    if e == "model":
        return f"{label}: model {ev['model']!r}: {ev['shapes']} shape(s) on {ev.get('device', '?')}"
    if e == "shape_start":
        lead = " (lead-in)" if ev.get("lead_in") else ""
        return f"{label}: model {ev['model']!r} shape #{ev['index']} {ev['signature']}{lead}: compiling"
    if e == "shape":
        c = ev.get("counters") or {}
        if ev.get("ok"):
            return (
                f"{label}: model {ev['model']!r} shape #{ev['index']}: ok in {ev.get('seconds') or 0:.1f} s "
                f"({c.get('fxgraph_cache_hit', 0)} fxgraph hit(s), {c.get('fxgraph_cache_miss', 0)} miss(es))"
            )
        return f"{label}: model {ev['model']!r} shape #{ev['index']}: failed: {ev.get('error')}"
    if e == "model_error":
        return f"{label}: {ev['error']}"
    if e == "import_start":
        return f"{label}: loading the bundle"
    if e == "export_start":
        return f"{label}: writing the bundle"
    return None


def _print_run(result, title: str) -> None:
    def hm(c: dict, kind: str) -> str:  # 'hits/misses' of one of torch's caches
        return f"{c.get(kind + '_cache_hit', '-')}/{c.get(kind + '_cache_miss', '-')}"

    rows = [
        (
            r.model,
            r.index,
            r.signature + (" (lead-in)" if r.lead_in else ""),
            r.device,
            r.phase,
            "-" if r.seconds is None else f"{r.seconds:.2f}",
            hm(r.counters, "fxgraph"),
            hm(r.counters, "autograd"),
            "ok" if r.ok else r.error,
        )
        for r in result.shapes
    ]
    if rows:
        table(
            (
                Col("model", cut=True, min=6),
                Col("#", right=True),
                Col("signature", cut=True, min=10),
                Col("device", cut=True, min=6),
                Col("phase"),
                Col("seconds", right=True),
                Col("fx h/m", right=True),
                Col("aot h/m", right=True),
                Col("result", cut=True, min=6),
            ),
            rows,
            title=fit(title, terminal_width()),
        )


@click.command()
@click.option(
    "--manifest",
    "manifest_path",
    required=True,
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="TOML manifest of the models to compile (see cachemgr.prewarm.manifest).",
)
@click.option("--model", metavar="NAME", help="Only this model of the manifest.")
@click.option(
    "--devices",
    metavar="LIST",
    help="Comma-separated devices, one worker each (cuda:0,cuda:1 or cpu,cpu); default: each model's own device.",
)
@click.option(
    "--replicate",
    is_flag=True,
    help="Every device replays every shape (cache keys embed the device index) "
    "instead of sharing the shapes among them.",
)
@click.option("--verify", is_flag=True, help="Afterwards replay again in fresh workers; any cache miss fails.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    metavar="S",
    help="Give up on a shape after S seconds (its worker is killed).",
)
@click.option(
    "--bundle",
    "bundle_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Import this bundle first, then replay (what the bundle had now hits).",
)
@click.option(
    "--target",
    type=click.Choice(["local", "redis"]),
    default="local",
    show_default=True,
    help="redis: also fill PyTorch's remote FX graph / autograd cache at redis_url.",
)
@json_option
@pass_app
@exit_codes(
    (0, "every shape compiled (with --verify: a fresh process saw only hits)"),
    (2, "bad command line, manifest or config file"),
    (3, "a model, manifest or bundle named does not exist"),
    (4, "the cache dir cannot be made"),
    5,
    (
        7,
        "the cache dir a bundle goes into is not an Inductor cache (a symlink\n"
        "where torch would write an entry of the bundle)",
    ),
    (8, "a shape or model failed, or verify missed"),
    (
        9,
        f"the bundle was refused: not a bundle or over {MAX_BUNDLE} (nothing is\n"
        "replayed), or none of its graphs would hit here, partial, or a key\n"
        "Inductor never makes (the shapes are still replayed)",
    ),
)
def prewarm(
    app,
    manifest_path: str,
    model: str | None,
    devices: str | None,
    replicate: bool,
    verify: bool,
    timeout: float | None,
    bundle_path: str | None,
    target: str,
    as_json: bool,
) -> None:
    """Compile every recorded (or listed) shape of the manifest's models into the cache.

    Each shape is replayed through torch.compile in a worker process, in the order the workload
    first saw them; the result per shape is the compile time and the cache counters. A model that
    cannot be imported or raises is reported and the others go on. Use it as a container's init
    step with TORCHINDUCTOR_CACHE_DIR on a volume the workload shares. A manifest's factory is code
    that prewarm imports and runs: trust a manifest as you would the workload itself.

    Factories that are nowhere to import and CUDA devices this host lacks are named before torch
    starts; progress (a line per worker, model and shape) goes to stderr from the first second.

    \b
    Example:
        cachemgr prewarm --manifest /etc/cachemgr/models.toml --verify
        cachemgr prewarm --manifest m.toml --devices cuda:0,cuda:1 --timeout 900
        cachemgr prewarm --manifest m.toml --bundle /seed/cache.bundle --verify
    """
    from cachemgr.prewarm import manifest as mf
    from cachemgr.prewarm import worker

    m = mf.load(manifest_path).select(model)
    devs = _devices(devices)
    env = worker_env(app, target)
    if bundle_path:
        from cachemgr.prewarm import bundle

        bundle.read(bundle_path, payload=False)  # missing (3), not a bundle or truncated (9): said before torch starts
    plans, errors = worker.plan(m, _recorded(app) if any(x.shapes == "recorded" for x in m.models) else [])
    # factories that are nowhere to import, CUDA on a host without it: said before torch starts
    plans, unrunnable = worker.precheck(plans, _search_path(env), devs)
    errors += unrunnable
    if errors and not plans and not bundle_path:  # nothing to run: a bad manifest (2), said before torch starts
        raise UsageError("; ".join(e for _, e in errors))
    replaced = _cache_to_write(app.settings.cache_dir, bundle_path)

    def jobs_for() -> worker.Jobs:
        if devs:
            return worker.distribute(plans, devs, replicate)
        by_dev: dict[str, list] = {}
        for p in plans:  # each model on its own device: one worker per device
            for d, slices in worker.distribute([p], [p.spec.device]):
                by_dev.setdefault(d, []).extend(slices)
        return list(by_dev.items())

    tty = sys.stderr.isatty()
    from cachemgr.cli.check import check_spec, learn

    # the whole manifest's options (not only --model's): what this host compiles with
    spec = check_spec(app, mf.load(manifest_path), devs) if bundle_path else None
    with _progress(tty) as on:
        result = worker.run(
            jobs_for(),
            env,
            timeout=timeout,
            on_event=on,
            import_bundle=os.path.abspath(bundle_path) if bundle_path else None,
            check=spec,
        )
    learn(app, result)
    _index_loaded(app, result.imported)
    results = [result]
    failures = [msg for _, msg in errors] + result.failures()
    if result.imported is not None and not result.imported.get("ok"):
        failures.insert(0, result.imported["error"])
    if verify and plans:
        with _progress(tty, "verify") as on:
            v = worker.run(jobs_for(), env, phase="verify", timeout=timeout, on_event=on)
        results.append(v)
        failures += [f for f in v.failures(verify=True) if f not in failures]
    if as_json:
        doc = results[0].as_dict()
        doc["manifest_errors"] = [{"model": n, "error": e} for n, e in errors]
        if verify:
            doc["verify"] = results[1].as_dict() if len(results) > 1 else None
        doc["failures"] = failures
        emit_json(doc)
    else:
        _print_run(result, f"prewarm {app.settings.cache_dir}")
        if len(results) > 1:
            _print_run(results[1], "verify (fresh workers)")
        if result.imported and result.imported.get("check"):
            say(_check_line(result.imported["check"]))
        if result.imported and result.imported.get("ok"):
            say(f"imported {bundle_path}: {_artifacts(result.imported.get('artifacts'))}")
        n = sum(1 for r in result.shapes if r.ok and not r.lead_in)
        click.echo(f"{n} shape(s) prewarmed in {result.seconds:.1f} s, {len(failures)} problem(s)")
    if result.imported and result.imported.get("loaded"):
        _say_replaced(replaced)
    if failures:
        for f in failures:
            say(f"cachemgr: {f}", err=True)
        refused = result.imported is not None and not result.imported.get("ok")  # (the first failure)
        from cachemgr.prewarm.bundle import BundleError

        error = BundleError if refused else PrewarmError
        raise error(f"{len(failures)} problem(s) during prewarm (first: {failures[0]})")


@click.command("export")
@click.option("--out", required=True, metavar="FILE", type=click.Path(dir_okay=False), help="Bundle to write.")
@click.option("--model", metavar="NAME", help="Only this model's artifacts (needs --manifest).")
@click.option(
    "--manifest",
    "manifest_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="Replay the manifest's models and bundle exactly what they use; default: the whole cache.",
)
@json_option
@pass_app
@exit_codes(
    (0, "the bundle was written"),
    (
        2,
        "bad command line or manifest file, --out in a missing folder or in\n"
        "the cache dir, or an --out that is not a regular file (a device, FIFO\n"
        "or symlink is never replaced)",
    ),
    (3, "a model named does not exist"),
    (4, "the cache dir does not exist (without --manifest) or cannot be read"),
    5,
    (8, "a model failed to replay, or writing failed"),
)
def export_(app, out: str, model: str | None, manifest_path: str | None, as_json: bool) -> None:
    """Write a portable bundle (torch.compiler.save_cache_artifacts) with a header naming torch,
    Triton and the GPU architecture, for `cachemgr import` on another host or image.

    \b
    Example:
        cachemgr export --out /seed/cache.bundle
        cachemgr export --out ranker.bundle --manifest models.toml --model ranker
    """
    from cachemgr.prewarm import bundle, worker

    if model and not manifest_path:
        raise UsageError("export --model needs --manifest: which entries a model uses is only known by replaying it")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise UsageError(f"export --out {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"export --out {out}: folder {folder} is not writable")
    # a bundle in the cache is no file Inductor makes there: every later evict refused the cache
    root = os.path.realpath(app.settings.cache_dir)
    if os.path.commonpath([os.path.realpath(folder), root]) == root:
        raise UsageError(f"export --out {out}: it is in the cache dir {app.settings.cache_dir}: write it elsewhere")
    odd = bundle.odd_target(out)  # the bundle is renamed over it: /dev/null would become a file
    if odd:
        raise UsageError(f"export --out {out}: it is {odd}, not a regular file: refusing to replace it")
    if not manifest_path:  # the whole cache, as it is (a replay fills a new one, as prewarm does)
        from cachemgr.index.result import check_root

        check_root(app.settings.cache_dir)
    jobs: worker.Jobs = [("cpu", [])]
    env = worker_env(app)
    if manifest_path:
        from cachemgr.prewarm import manifest as mf

        m = mf.load(manifest_path).select(model)
        plans, errors = worker.plan(m, _recorded(app) if any(x.shapes == "recorded" for x in m.models) else [])
        plans, unrunnable = worker.precheck(plans, _search_path(env))
        errors += unrunnable
        if errors:
            raise PrewarmError("; ".join(e for _, e in errors))
        dev = plans[0].spec.device if plans else "cpu"
        jobs = worker.distribute(plans, [dev])
    with _progress(sys.stderr.isatty(), "export") as on:
        result = worker.run(
            jobs,
            env,
            phase="export",
            on_event=on,
            export={"out": os.path.abspath(out), "cache_dir": app.settings.cache_dir},
        )
    from cachemgr.cli.check import learn

    learn(app, result)
    ex = result.exported or {"ok": False, "error": "the export worker reported nothing"}
    failures = result.failures() + ([] if ex.get("ok") else [ex["error"]])
    if as_json:
        emit_json({"exported": ex, "replay": result.as_dict(), "failures": failures})
    elif ex.get("ok"):
        from cachemgr.units import format_size

        h = ex["header"]
        say(
            f"wrote {out}: {format_size(h['bytes'])}, {_artifacts(h['artifacts'])}; torch {h['torch']}, "
            f"Triton {h['triton'] or '-'}, GPU {','.join(h['gpu_arch'] or []) or '-'}"
            + ("" if h.get("complete", True) else "; PARTIAL")
        )
    if ex.get("ok") and not ex["header"].get("complete", True):
        missing = ex["header"].get("missing") or []
        say(
            f"cachemgr: {out} is a partial bundle: {len(missing)} thing(s) its entries name are not in it "
            f"(first: {missing[0] if missing else '?'}); `import` refuses it without --allow-partial",
            err=True,
        )
    if ex.get("skipped"):  # cache files that import would refuse: left out, the rest exported
        say(
            f"cachemgr: left out {ex.get('skipped_count', len(ex['skipped']))} cache file(s) that import would "
            f"refuse (first: {ex['skipped'][0]})",
            err=True,
        )
    if failures:
        raise PrewarmError("; ".join(failures))


def _index_loaded(app, imported: dict | None) -> None:
    """Index what a bundle's load wrote (the worker's `imported`): the graphs it added are loaded,
    not compiled, as stats and explain count them."""
    if imported and imported.get("loaded"):
        from cachemgr.cli.inspect import run_scan

        run_scan(app, quiet_progress=True)
        app.store.mark_loaded(imported.pop("written_graphs", []))


def _cache_to_write(cache_dir: str, bundle_path: str | None) -> list[str]:
    """Check the cache directory torch will write into (worker.run makes it where missing, exit 4
    where it cannot be). One a bundle goes into must hold Inductor's own layout (exit 7
    otherwise): torch writes a bundle's entries by path, through a symlinked `fxgraph/` to
    wherever it points, or one below it (`_refuse_write_hazards`, whose autotune results replaced
    are returned). Refused, the directory is not made."""
    if not bundle_path:
        return []
    from cachemgr.evict.execute import refuse_foreign_root

    refuse_foreign_root(cache_dir, "import a bundle into it")
    return _refuse_write_hazards(cache_dir, bundle_path)


def _refuse_write_hazards(cache_dir: str, bundle_path: str) -> list[str]:
    """Refuse (exit 7) a cache in which torch would write the bundle's entries through a symlink or
    a file below the top level: torch follows `fxgraph/r6` -> elsewhere out of the root. Nothing is
    written then. Returns the bundle's autotune results the cache holds already (the load
    replaces them). Reads the bundle (its keys) here, before torch starts."""
    from cachemgr import safefs
    from cachemgr.errors import CacheDirError, UnsafePath
    from cachemgr.prewarm import bundle

    arts = bundle.artifacts(bundle.read(bundle_path).payload, bundle_path)
    try:
        root = safefs.Root(cache_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []  # (made empty next, or worker.run says why it cannot be: as for --check-only)
    except OSError as e:
        raise CacheDirError(f"cannot open cache directory {cache_dir}: {e.strerror}") from None
    with root:
        problems = bundle.write_hazards(root, arts)
        replaced = bundle.replaced_autotune(root, arts)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UnsafePath(
            f"cache directory {cache_dir}: {problems[0]}{more}: torch would write the bundle's entries "
            "through it: refusing to import a bundle into it"
        )
    return replaced


def _say_replaced(replaced: list[str]) -> None:
    if replaced:
        say(
            f"cachemgr: the bundle's autotune results replaced {len(replaced)} this cache held (first: {replaced[0]})",
            err=True,
        )


@click.command("import")
@click.argument("bundle_path", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--check-only", is_flag=True, help="Only say which of its graphs would hit here; write nothing.")
@click.option("--allow-partial", is_flag=True, help="Import a bundle that lacks some of what its entries name.")
@click.option(
    "--manifest",
    "manifest_path",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="The workload's models: their compile options are what this host compiles with.",
)
@click.option("--devices", metavar="LIST", help="Where the workload runs here (cuda:0,cuda:1 or cpu).")
@json_option
@pass_app
@exit_codes(
    (0, "the bundle was loaded (--check-only: it would be)"),
    (2, "bad command line"),
    (3, "no such bundle file"),
    (4, "the cache dir cannot be made"),
    5,
    (7, "the cache dir is not an Inductor cache (a symlink where torch would\nwrite an entry of the bundle)"),
    (
        9,
        f"not a bundle, or over {MAX_BUNDLE}; none of its graphs would hit here;\n"
        "partial (without --allow-partial); or a key not a name inside the cache",
    ),
)
def import_(
    app,
    bundle_path: str,
    check_only: bool,
    allow_partial: bool,
    manifest_path: str | None,
    devices: str | None,
    as_json: bool,
) -> None:
    """Load a bundle into the cache (torch.compiler.load_cache_artifacts), after checking it.

    First the same check as `cachemgr check --bundle` runs in the worker: which of the bundle's
    graphs this host would hit (each entry's hash components against this host's torch, GPU,
    options and devices) and whether the bundle holds every graph, kernel and autotune result its
    entries name. A bundle of which no graph would hit, or a partial one, is refused.

    \b
    Example:
        cachemgr --cache-dir /cache import /seed/cache.bundle
        cachemgr import /seed/cache.bundle --check-only --json | jq .check.summary
    """
    from cachemgr.cli.check import check_spec, learn, worker_device
    from cachemgr.prewarm import bundle, worker

    bundle.read(bundle_path, payload=False)  # not a bundle / missing: say so before starting torch
    devs = _devices(devices)
    manifest = None
    if manifest_path:
        from cachemgr.prewarm import manifest as mf

        manifest = mf.load(manifest_path)
    spec = check_spec(app, manifest, devs, check_only=check_only, allow_partial=allow_partial)
    existed = os.path.isdir(app.settings.cache_dir)
    replaced = [] if check_only else _cache_to_write(app.settings.cache_dir, bundle_path)
    with _progress(sys.stderr.isatty(), "import") as on:
        result = worker.run(
            [(worker_device(devs), [])],
            worker_env(app),
            phase="import",
            on_event=on,
            import_bundle=os.path.abspath(bundle_path),
            check=spec,
        )
    imp = result.imported or {"ok": False, "error": "the import worker reported nothing"}
    if not existed and (check_only or not imp.get("ok")):
        with suppress(OSError):  # torch makes its cache dir when it starts: a check or a refusal leaves none
            os.rmdir(app.settings.cache_dir)
    learn(app, result)
    _index_loaded(app, imp)
    if as_json:
        emit_json(imp)
    else:
        if imp.get("check"):
            say(_check_line(imp["check"]))
        if imp.get("ok") and imp.get("loaded"):
            say(f"imported {bundle_path} into {app.settings.cache_dir}: {_artifacts(imp['artifacts'])}")
        elif imp.get("ok"):
            say(f"check only: nothing written to {app.settings.cache_dir}")
    if imp.get("loaded"):
        _say_replaced(replaced)
    if not imp.get("ok"):
        raise bundle.BundleError(imp["error"])


COMMANDS = (shapes, prewarm, export_, import_)
