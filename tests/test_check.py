"""`cachemgr check`: predictions checked against what torch then does.

Each case predicts, with the real CLI in its own process, which graphs of a real cache this host
will hit; then the workload that cache came from runs in a fresh process with TORCH_TRACE on, and
torch's own `fx_graph_cache_hit` artifacts name the keys it hit. A graph predicted to hit must hit,
one predicted to miss must not, and an unknown is never counted as a hit. The counters of
torch._dynamo.utils.counters must agree with the trace.

Bundles: completeness (a kernel, a graph or an autotune result removed is caught), and import's
check (--check-only writes nothing; a partial bundle or one that cannot hit here is refused).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachemgr import check
from cachemgr.fingerprint import component_hash
from cachemgr.prewarm import adapters, bundle
from tests.conftest import FIXTURES, OWN_PEAK_RSS_PROGRAM, PROGRAMS, Builds, Cli, subprocess_env

pytestmark = pytest.mark.slow
MAKE_CACHE = FIXTURES / "make_cache.py"
WORKLOAD = PROGRAMS / "check_workload.py"
# Workloads whose C++ builds a later compile of the same may be seeded with (conftest.Builds);
# seeded only after the prediction, so `check` sees each cache as it came. The outcome compared
# with the prediction is torch's: fxgraph hits and misses, in its trace and counters, which no
# C++ build changes.
MAKE_CACHE_BUILDS = "make_cache"
MLP_BUILDS = "check_workload mlp"
ENV = {"PYTHONPATH": os.pathsep.join((str(Path(__file__).resolve().parent.parent), str(PROGRAMS)))}

# The fixtures' workload (tests/fixtures/make_cache.py): what each function is compiled with.
FIXTURE_MANIFEST = """
[[model]]
name = "train"
factory = "make_cache:train_loss"
train = true
compile = {}

[[model]]
name = "infer"
factory = "make_cache:infer"
compile = {}

[[model]]
name = "opt_fn_no_epilogue"
factory = "make_cache:opt_fn"
compile = { options = { epilogue_fusion = false } }

[[model]]
name = "opt_fn"
factory = "make_cache:opt_fn"
compile = {}
"""

WORKLOAD_MANIFEST = """
[[model]]
name = "mlp"
factory = "compile_models:MLP"
train = true
compile = {}

[[model]]
name = "infer"
factory = "compile_models:infer"
compile = {}

[[model]]
name = "scaled"
factory = "compile_models:scaled"
compile = { options = %s }
"""


# -- running things ---------------------------------------------------------------------------------


def run_traced(program: list[str], cache_dir: Path, trace: Path, **env: str) -> tuple[dict, set[str], int]:
    """Run a workload in a fresh process: (its counters, the keys torch hit, how many it missed)."""
    out = subprocess.run(
        [sys.executable, *program],
        capture_output=True,
        text=True,
        timeout=1200,
        env=subprocess_env(cache_dir, TORCH_TRACE=str(trace), **env),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    counters = line.get("counters", {}).get("inductor") if "counters" in line else line
    hits, misses = outcome(trace)
    return counters, hits, misses


def outcome(trace: Path) -> tuple[set[str], int]:
    """torch's structured trace: the fxgraph keys it hit, and how many lookups missed."""
    hits: set[str] = set()
    misses = 0
    for f in trace.iterdir():
        lines = f.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            for kind in ("hit", "miss"):
                if (
                    f'{{"artifact": {{"name": "fx_graph_cache_{kind}"' in line
                    and not line.startswith("\t")
                    and i + 1 < len(lines)
                    and lines[i + 1].startswith("\t")
                ):
                    body = []  # the payload: the lines after the artifact's, each after a tab
                    for nxt in lines[i + 1 :]:
                        if not nxt.startswith("\t"):
                            break
                        body.append(nxt[1:])
                    payload = json.loads("\n".join(body))
                    if kind == "hit":
                        hits.add(payload["key"])
                    else:
                        misses += 1
    return hits, misses


def predict(cli: Cli, *args: str, env: dict | None = None) -> dict:
    r = cli.proc("check", *args, "--json", timeout=900, env={**ENV, **(env or {})})
    assert r.returncode == 0, f"stdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return json.loads(r.stdout)


def compare(case: str, report: dict, hits: set[str], counters: dict, exact: bool = True) -> dict:
    """Prediction against outcome, graph by graph; a row for the table."""
    seen = {"hit": 0, "miss": 0}
    for p in report["predictions"]:
        outcome_ = "hit" if p["graph_key"] in hits else "miss"
        seen[outcome_] += 1
        assert p["verdict"] != "hit" or outcome_ == "hit", f"{case}: {p['graph_key']} predicted hit, missed"
        assert p["verdict"] != "miss" or outcome_ == "miss", f"{case}: {p['graph_key']} predicted miss, hit"
        if exact:
            assert p["verdict"] != "unknown", f"{case}: {p['graph_key']} unknown: {p['cause']}"
    assert counters["fxgraph_cache_hit"] == len(hits) >= seen["hit"]
    row = {
        "case": case,
        "graphs": report["graphs"],
        "predicted": {v: report[v] for v in ("hit", "miss", "unknown")},
        "seen": seen,
        "counters": {k: counters.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
        "causes": [s["text"] for s in report["summary"]],
    }
    table = os.environ.get("CACHEMGR_CHECK_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def causes(report: dict) -> list[str]:
    return [s["text"] for s in report["summary"]]


def named(report: dict, verdict: str) -> set[str]:
    """The component names the predictions of a verdict differ in."""
    return {
        d["name"]
        for p in report["predictions"]
        if p["verdict"] == verdict
        for ds in p["groups"].values()
        for d in ds
        if d["certain"] or verdict != "miss"
    }


# -- the cases ------------------------------------------------------------------------------------------


def test_same_host_every_graph_hits(fixture_cache, tmp_path, db_url, cpp_builds: Builds):
    root = fixture_cache("torch-2.13.0-cpu")  # written by this very torch build (its fingerprint is checked below)
    (tmp_path / "m.toml").write_text(FIXTURE_MANIFEST)
    cli = Cli(root, db_url)
    report = predict(cli, "--manifest", str(tmp_path / "m.toml"))
    assert (report["graphs"], report["hit"]) == (8, 8), causes(report)
    assert causes(report) == [
        "7 graphs will hit",
        "1 graph will hit (compiled with the options of model opt_fn_no_epilogue)",
    ]
    # without the manifest the option set of one graph is not known: unknown, never a guessed hit
    bare = predict(cli)
    assert (bare["hit"], bare["unknown"]) == (7, 1)
    (p,) = [p for p in bare["predictions"] if p["verdict"] == "unknown"]
    assert p["groups"]["options"][0]["name"] == "inductor_config[epilogue_fusion]"
    assert (p["groups"]["options"][0]["cache"], p["groups"]["options"][0]["host"]) == ("False", "True")
    # the fixture's kernels were built by another venv (another g++ command: other names): this
    # venv builds them again on a hit, unless an earlier compile of the workload here did. Its
    # vector-ISA probes are this torch's and g++'s already (else the run builds them).
    had = cpp_builds.seed(root, MAKE_CACHE_BUILDS, probes=False)
    counters, hits, misses = run_traced([str(MAKE_CACHE)], root, tmp_path / "trace")
    cpp_builds.keep(MAKE_CACHE_BUILDS, root, had)
    counters = {
        "fxgraph_cache_hit": counters.get("fxgraph_cache_hit", 0),
        "fxgraph_cache_miss": counters.get("fxgraph_cache_miss", 0),
    }
    assert misses == 0 and counters == {"fxgraph_cache_hit": 8, "fxgraph_cache_miss": 0}
    compare("same host (torch-2.13.0-cpu fixture, manifest)", report, hits, counters)
    compare("same host, no manifest", bare, hits, counters, exact=False)
    # the worker learned this host's fingerprints
    from cachemgr.index import Database, Store

    db = Database(db_url)
    try:
        fps = {(f["kind"], f["hash"]): f["name"] for f in Store.of(db, "testhost", str(root)).fingerprints()}
    finally:
        db.close()
    fp = json.loads((FIXTURES / "caches" / "torch-2.13.0-cpu.json").read_text())["fingerprint"]["2.13.0+cpu"]
    assert fps[("torch", fp["torch_version_hash"])] == "2.13.0+cpu"
    assert fps[("system", fp["system_info"]["hash"])] == "no GPU"


@pytest.fixture(scope="module")
def workload_cache(tmp_path_factory, cpp_builds: Builds) -> Path:
    """A cache of check_workload.py's `mlp` workload, written by this host (from an empty dir:
    predictions are made on copies of it)."""
    root = tmp_path_factory.mktemp("wl") / "cache"
    counters, _, _ = run_traced([str(WORKLOAD), "mlp"], root, root.parent / "trace0")
    assert counters["fxgraph_cache_miss"] > 0 and counters["fxgraph_cache_hit"] == 0
    cpp_builds.keep(MLP_BUILDS, root)
    return root


def test_a_changed_inductor_option_misses_the_changed_graphs_named(workload_cache, tmp_path, db_url):
    root = tmp_path / "cache"
    shutil.copytree(workload_cache, root)
    (tmp_path / "same.toml").write_text(WORKLOAD_MANIFEST % "{ epilogue_fusion = false }")
    (tmp_path / "changed.toml").write_text(WORKLOAD_MANIFEST % "{ epilogue_fusion = true, shape_padding = false }")
    cli = Cli(root, db_url)
    same = predict(cli, "--manifest", str(tmp_path / "same.toml"))
    assert same["hit"] == same["graphs"] > 3, causes(same)
    changed = predict(cli, "--manifest", str(tmp_path / "changed.toml"))
    assert (changed["miss"], changed["hit"]) == (1, changed["graphs"] - 1), causes(changed)
    (p,) = [p for p in changed["predictions"] if p["verdict"] == "miss"]
    diffs = {d["name"]: d for d in p["groups"]["options"]}
    assert set(diffs) == {"inductor_config[epilogue_fusion]"}  # nearest: the defaults (mlp's and infer's)
    assert (diffs["inductor_config[epilogue_fusion]"]["cache"], diffs["inductor_config[epilogue_fusion]"]["host"]) == (
        "False",
        "True",
    )
    counters, hits, misses = run_traced(
        [str(WORKLOAD), "mlp", "--scaled-options", '{"epilogue_fusion": true, "shape_padding": false}'],
        root,
        tmp_path / "t",
    )
    assert misses == 1 == counters["fxgraph_cache_miss"]
    compare("changed inductor option (manifest: scaled's options)", changed, hits, counters)


def test_an_option_this_hosts_environment_sets_is_named(workload_cache, tmp_path, db_url):
    root = tmp_path / "cache"
    shutil.copytree(workload_cache, root)
    (tmp_path / "same.toml").write_text(WORKLOAD_MANIFEST % "{ epilogue_fusion = false }")
    env = {"TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1"}
    cli = Cli(root, db_url)
    report = predict(cli, "--manifest", str(tmp_path / "same.toml"), env=env)
    assert report["miss"] == report["graphs"], causes(report)
    assert causes(report) == [
        f"{report['graphs']} graphs will miss because inductor_config[max_autotune_pointwise] differs"
    ]
    assert report["host"]["environment"] == env
    # without the manifest: the graph compiled with options of its own differs in one more option,
    # which a per-call option may explain: unknown, never a hit
    bare = predict(cli, env=env)
    assert (bare["miss"], bare["unknown"], bare["hit"]) == (bare["graphs"] - 1, 1, 0), causes(bare)
    counters, hits, _ = run_traced([str(WORKLOAD), "mlp"], root, tmp_path / "t", **env)
    assert counters["fxgraph_cache_hit"] == 0
    compare("option set by this host's environment (TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE=1)", report, hits, counters)
    compare("the same, no manifest", bare, hits, counters, exact=False)


@pytest.mark.parametrize("name", ["torch-2.14.1-cpu", "torch-2.9.1-cpu"])
def test_another_torch_versions_cache_misses_by_torch_version(
    name, fixture_cache, tmp_path, db_url, cpp_builds: Builds
):
    root = fixture_cache(name)
    (tmp_path / "m.toml").write_text(FIXTURE_MANIFEST)
    report = predict(Cli(root, db_url), "--manifest", str(tmp_path / "m.toml"))
    assert report["miss"] == report["graphs"] == 8
    assert causes(report) == ["8 graphs will miss because torch_version differs"]
    tv = next(d for p in report["predictions"] for d in p["groups"]["environment"] if d["name"] == "torch_version")
    assert tv["host"].startswith("2.13.0+cpu (hash sjldm5hyfytk")
    had = cpp_builds.seed(root, MAKE_CACHE_BUILDS)  # after the prediction; the graphs still all miss
    counters, hits, _ = run_traced([str(MAKE_CACHE)], root, tmp_path / "trace")
    cpp_builds.keep(MAKE_CACHE_BUILDS, root, had)
    counters = {k: counters.get(k, 0) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    assert counters == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 8}
    compare(f"another torch's cache ({name})", report, hits, counters)


@pytest.mark.parametrize("name", ["torch-2.5.1-cpu", "torch-2.6.0-cpu"])
def test_a_format_without_components_is_unknown_never_a_hit(name, fixture_cache, db_url):
    """No compile to compare with: an "unknown" is never wrong, and no graph is predicted to hit."""
    root = fixture_cache(name)
    report = predict(Cli(root, db_url))
    assert report["unknown"] == report["graphs"] == 8
    family = name.split("-")[1].rsplit(".", 1)[0]
    assert causes(report) == [
        f"8 graphs unknown: torch {family}.* records no hash components: what it was compiled for cannot be compared"
    ]
    assert report["hit"] == report["miss"] == 0 and all(p["verdict"] == "unknown" for p in report["predictions"])


def test_the_gpu_fixture_on_this_cpu_host_misses_by_device_and_system(
    fixture_masters, tmp_path, db_url, cpp_builds: Builds
):
    root = tmp_path / "gpu"
    with __import__("tarfile").open(FIXTURES / "gpu" / "torch-2.11-h200-triton.tar.gz") as t:
        t.extractall(root, filter="data")
    report = predict(Cli(root, db_url))
    assert report["miss"] == report["graphs"] == 10
    assert causes(report) == ["10 graphs will miss because torch_version, system_info and device differ"]
    env = {d["name"]: d for d in report["predictions"][0]["groups"]["environment"]}
    assert env["system_info[device]"]["cache"] == "{'name': 'NVIDIA H200'}"
    assert env["system_info[device]"]["host"] == "(absent)"
    (dev,) = report["predictions"][0]["groups"]["inputs"]
    assert (dev["name"], dev["cache"], dev["host"]) == ("device", "cuda:0", "no CUDA device")
    cpp_builds.seed(root)  # the vector-ISA probes; the kernels of this workload on a CPU are built here
    counters, hits, _ = run_traced([str(WORKLOAD), "gpu-triton", "--device", "cpu"], root, tmp_path / "trace")
    assert counters["fxgraph_cache_hit"] == 0
    compare("the GPU fixture (H200, torch 2.11) on this CPU host", report, hits, counters)


# -- bundles: completeness and import's check -----------------------------------------------------------


def _export(cache: Path, out: Path, db_url: str) -> dict:
    r = Cli(cache, db_url).proc("export", "--out", str(out), "--json", timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["exported"]["header"]


def _rewrite(src: Path, dst: Path, edit) -> None:  # edit(arts) changes the artifacts
    b = bundle.read(str(src))
    arts = bundle.artifacts(b.payload)
    edit(arts)
    bundle.write(str(dst), b.header, bundle.payload_of(arts))


def _missing(path: Path, expects: dict) -> list[str]:
    b = bundle.read(str(path))
    return bundle.completeness(bundle.read_contents(b.header, bundle.artifacts(b.payload)), expects)


def test_a_bundle_missing_a_kernel_a_graph_or_an_autotune_result_is_caught(tmp_path, db_url):
    root = tmp_path / "gpu"
    with __import__("tarfile").open(FIXTURES / "gpu" / "torch-2.11-h200-triton.tar.gz") as t:
        t.extractall(root, filter="data")
    whole = tmp_path / "whole.bundle"
    header = _export(root, whole, db_url)
    assert header["complete"] and header["missing"] == [] and len(header["expects"]["autotune"]) == 9
    assert _missing(whole, header["expects"]) == []

    # one kernel removed: every file of one kernel the first graph launches gets another (same-length) name
    def drop_kernel(arts):
        key, content = arts["inductor"][0]
        names, files, _ = bundle.kernels_of(content)
        name = names[0]
        other = "x" * len(name)
        for suffix in sorted(files[name]):
            content = content.replace(f"{name}{suffix}".encode(), f"{other}{suffix}".encode())
        arts["inductor"][0] = (key, content)
        drop_kernel.name = (key, name)

    partial = tmp_path / "partial.bundle"
    _rewrite(whole, partial, drop_kernel)
    key, name = drop_kernel.name
    problems = _missing(partial, header["expects"])
    assert problems == [f"graph {key}: Triton kernel {name} is not in the bundle"]

    # one kernel's binary dropped (torch#172542): the kernel is there, its .cubin is not
    def drop_cubin(arts):
        k, content = arts["inductor"][0]
        name = bundle.kernels_of(content)[0][0]
        arts["inductor"][0] = (k, content.replace(f"{name}.cubin".encode(), f"{name}.cubix".encode()))
        drop_cubin.name = (k, name)

    _rewrite(whole, partial, drop_cubin)
    k, name = drop_cubin.name
    problems = _missing(partial, header["expects"])
    assert f"graph {k}: Triton kernel {name} has no binary (.cubin, .hsaco, .zebin, .spv) in the bundle" in problems

    # a graph an AOTAutograd entry names, and an autotune result
    def drop_graph_and_tuning(arts):
        from cachemgr.parse import parse_aotautograd

        ref = parse_aotautograd(arts["aot_autograd"][0][1]).refs[0][1]
        arts["inductor"] = [(k, c) for k, c in arts["inductor"] if k != ref]
        drop_graph_and_tuning.gone = (arts["aot_autograd"][0][0], ref, arts["autotune"][0][0])
        arts["autotune"] = arts["autotune"][1:]

    _rewrite(whole, partial, drop_graph_and_tuning)
    aot, ref, tuning = drop_graph_and_tuning.gone
    problems = _missing(partial, header["expects"])
    assert f"aotautograd entry {aot}: its graph {ref} is not in the bundle" in problems
    assert f"autotune result {tuning} is not in the bundle" in problems
    r = Cli(root, db_url).proc("check", "--bundle", str(partial), timeout=900, env=ENV)
    assert r.returncode == 0 and "partial bundle:" in r.stdout and f"its graph {ref} is not in the bundle" in r.stdout


def test_import_checks_first(fixture_cache, tmp_path, db_url):
    ours = tmp_path / "ours.bundle"
    assert _export(fixture_cache("torch-2.13.0-cpu"), ours, db_url)["complete"]
    other = tmp_path / "other.bundle"
    _export(fixture_cache("torch-2.14.1-cpu"), other, db_url)
    target = Cli(tmp_path / "empty", db_url)
    r = target.proc("import", str(ours), "--check-only", timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr
    assert (
        "check: 7 of 8 graphs will hit here (1 graph unknown: compiled with options cachemgr does not know" in r.stdout
        and "check only: nothing written" in r.stdout
    )
    assert not (tmp_path / "empty").exists()
    r = target.proc("import", str(other), timeout=900, env=ENV)
    assert (
        r.returncode == 9
        and "none of its 8 graphs would hit here (8 graphs will miss because torch_version "
        "differs): refusing to import it"
        in r.stderr
    ), r.stderr
    assert not (tmp_path / "empty" / "fxgraph").exists()

    # a partial bundle: refused, or imported with --allow-partial
    def drop_graph(arts):
        from cachemgr.parse import parse_aotautograd

        ref = parse_aotautograd(arts["aot_autograd"][0][1]).refs[0][1]
        arts["inductor"] = [(k, c) for k, c in arts["inductor"] if k != ref]

    partial = tmp_path / "partial.bundle"
    _rewrite(ours, partial, drop_graph)
    r = target.proc("import", str(partial), timeout=900, env=ENV)
    assert r.returncode == 9 and "is partial: 1 thing(s) its entries name are not in it" in r.stderr, r.stderr
    assert "(cachemgr import --allow-partial imports it anyway)" in r.stderr  # (prewarm --bundle has no such flag)
    r = target.proc("import", str(partial), "--allow-partial", "--json", timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["loaded"] and doc["check"]["graphs"] == 7 and len(doc["check"]["missing"]) == 1


def test_what_import_writes_counts_as_loaded_not_compiled(fixture_cache, tmp_path, db_url):
    """stats and explain counted the graphs a bundle's import wrote as compiles ("8 compiles (4
    recompiles)"): import indexes them and marks them loaded. The target's index is its own (one
    that read the exporting cache knows the bytes: a copy is loaded anyway). An import into a
    cache that holds the same files already marks none of them."""
    ours = tmp_path / "ours.bundle"
    _export(fixture_cache("torch-2.13.0-cpu"), ours, db_url)
    (tmp_path / "target").mkdir()
    target = Cli(tmp_path / "empty", f"sqlite:///{tmp_path / 'target' / 'index.db'}")
    for _ in range(2):
        r = target.proc("import", str(ours), timeout=900, env=ENV)
        assert r.returncode == 0, r.stderr
        activity = json.loads(target.proc("stats", "--json").stdout)["activity"]
        assert (activity["loaded"], activity["compiles"], activity["recompiles"]) == (8, 0, 0)
    assert "no compiles in the last 1d (8 entries loaded)" in target.proc("explain", "--summary").stdout


def test_a_bundle_is_never_let_write_outside_the_cache(fixture_cache, tmp_path, db_url):
    """torch's loader joins each artifact's key onto the cache directory and checks nothing: a
    bundle (another host's) with a key of '../x' or '/x' wrote there, one without graphs even
    skipped the hit check, and a cache whose fxgraph/ is a symlink took the entries through it.
    Each is refused before torch is handed anything (exit 9, exit 7); a FIFO is not waited on."""
    ours = tmp_path / "ours.bundle"
    _export(fixture_cache("torch-2.13.0-cpu"), ours, db_url)
    outside = tmp_path / "outside"
    outside.mkdir()
    target = Cli(tmp_path / "target", db_url)

    def traversal(arts):
        content = arts["autotune"][0][1] if arts.get("autotune") else b'{"XBLOCK": 8}'
        arts.setdefault("autotune", []).append(("../../outside/x.best_config", content))
        arts["inductor"].append((str(outside / "abs"), arts["inductor"][0][1]))

    def graphless(arts):
        arts.clear()
        arts["autotune"] = [(str(outside / "pwn.pth"), b"import os\n")]

    for edit in (traversal, graphless):
        bad = tmp_path / f"{edit.__name__}.bundle"
        _rewrite(ours, bad, edit)
        r = target.proc("import", str(bad), timeout=900, env=ENV)
        assert r.returncode == 9 and "refusing to import it:" in r.stderr, r.stderr
        assert "is not a name inside the cache" in r.stderr, r.stderr
        assert list(outside.iterdir()) == []
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "fxgraph").symlink_to(outside)
    r = Cli(linked, db_url).proc("import", str(ours), timeout=900, env=ENV)
    assert r.returncode == 7 and "refusing to import a bundle into it" in r.stderr, r.stderr
    assert list(outside.iterdir()) == []
    fifo = tmp_path / "fifo.bundle"
    os.mkfifo(fifo)
    r = target.proc("check", "--bundle", str(fifo), timeout=120, env=ENV)
    assert r.returncode == 9 and "is not a regular file" in r.stderr, r.stderr


EXPECTED_AUTOTUNE = """
import sys
from cachemgr.prewarm import bundle
print(bundle.expected_autotune(sys.argv[1], {"K"}))  # (a graph naming kernel K: the cache is looked at)
"""


def test_export_neither_waits_on_a_fifo_nor_writes_through_a_planted_symlink(tmp_path):
    """export's look at the cache's autotune results opened a FIFO there and waited for ever;
    its temporary file had a guessable name, and a symlink planted there took the bundle."""
    cache = tmp_path / "cache" / "ab"
    cache.mkdir(parents=True)
    os.mkfifo(cache / ("ab" + "c" * 62 + ".best_config"))
    r = subprocess.run(
        [sys.executable, "-c", EXPECTED_AUTOTUNE, str(cache.parent)],
        capture_output=True,
        text=True,
        timeout=60,
        env=subprocess_env(),
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    victim = tmp_path / "victim"
    victim.write_text("mine")
    out = tmp_path / "out.bundle"
    (tmp_path / f"out.bundle.{os.getpid()}.tmp").symlink_to(victim)
    bundle.write(str(out), {"torch": "x"}, b"payload")
    assert victim.read_text() == "mine" and bundle.read(str(out)).payload == b"payload"
    assert not out.is_symlink() and oct(out.stat().st_mode & 0o777) != oct(0o600)


# -- the adapters -------------------------------------------------------------------------------------


def test_each_fixture_version_gets_its_adapter_and_its_hashes():
    """Live on this host's torch (2.13); the other versions by the values their fixtures stored:
    the component hash the adapters rely on (a fast pickle of torch_key(), sha256, base32) gives
    each version's stored torch_version and system_info[hash] components."""
    import torch

    seen = 0
    for path in sorted((FIXTURES / "caches").glob("torch-*-cpu.json")):
        doc = json.loads(path.read_text())
        for version, fp in doc["fingerprint"].items():
            assert adapters.name_for(version) == ("torch_2_5" if version.startswith("2.5.") else "torch_2_6_plus")
            assert component_hash(bytes.fromhex(fp["torch_key_hex"])) == fp["torch_version_hash"]
            assert component_hash(fp["system_info"]["hash"]) == fp["system_info_hash_hash"]
            seen += 1
    assert seen == 5  # 2.5.1, 2.6.0, 2.9.1, 2.13.0, 2.14.1
    assert adapters.name_for("2.4.1") is None and adapters.name_for("3.0.0") == "torch_2_6_plus"
    live = adapters.load(torch.__version__).fingerprint(torch)
    fp = json.loads((FIXTURES / "caches" / "torch-2.13.0-cpu.json").read_text())["fingerprint"]["2.13.0+cpu"]
    assert (live["torch_version_hash"], live["system_component"]) == (
        fp["torch_version_hash"],
        fp["system_info_hash_hash"],
    )
    assert live["torch_key"] == fp["torch_key_hex"] and live["system"] == "no GPU"
    gpu = json.loads((FIXTURES / "gpu" / "torch-2.11-h200-triton.json").read_text())["fingerprint"]
    assert component_hash(gpu["system_info"]["hash"]) == gpu["system_info_hash_component"]


def test_graph_independent_components_of_this_torch_equal_its_entries(fixture_masters):
    """The adapter's components for no graph are the ones this torch wrote into the fixture's
    entries: every one that does not depend on the graph, name and hash."""
    import torch

    from cachemgr.parse import components_of, parse_fxgraph

    ours = {c.name: c.hash for c in components_of(adapters.load(torch.__version__).components(torch, {}))}
    root = fixture_masters("torch-2.13.0-cpu")
    compared = 0
    for f in sorted((root / "fxgraph").glob("*/*/*")):
        p = parse_fxgraph(f.read_bytes())
        for c in p.components:
            if check.graph_dependent(c.name) or c.name == "inductor_config[epilogue_fusion]":
                continue
            assert ours.get(c.name) == c.hash, c.name
            compared += 1
    assert compared > 8 * 500


# -- the fleet: what splits one graph's cache between hosts ------------------------------------------------


def test_explain_summary_names_what_splits_the_fleet(workload_cache, tmp_path, cpp_builds: Builds):
    from test_fleet import _admin  # the fleet tests' PostgreSQL server

    name = f"cachemgr_t_check_{os.getpid()}"
    with _admin() as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://{os.environ.get('CACHEMGR_TEST_PG', 'root@127.0.0.1:5432')}/{name}"
    try:
        a, b = tmp_path / "a", tmp_path / "b"
        shutil.copytree(workload_cache, a)
        # max_autotune_pointwise changes no C++ kernel (it tunes Triton's): the same builds as a's
        cpp_builds.seed(b, MLP_BUILDS)
        run_traced([str(WORKLOAD), "mlp"], b, tmp_path / "trace", TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE="1")
        for host, root in (("gpu-a", a), ("gpu-b", b)):
            r = Cli(root, url, host=host).proc("scan", timeout=300, env=ENV)
            assert r.returncode == 0, r.stderr
        r = Cli(a, url, host="gpu-a").proc("explain", "--summary", "--since", "30d", "--json", timeout=300, env=ENV)
        assert r.returncode == 0, r.stderr
        splits = {s["component"]: s for s in json.loads(r.stdout)["fragmentation"]}
        assert list(splits) == ["inductor_config[max_autotune_pointwise]"], splits
        s = splits["inductor_config[max_autotune_pointwise]"]
        assert s["graphs"] >= 4 and s["hosts"] == ["gpu-a", "gpu-b"]
        assert s["values"] == [{"host": "gpu-a", "value": "False"}, {"host": "gpu-b", "value": "True"}]
        text = Cli(a, url, host="gpu-a").proc("explain", "--summary", "--since", "30d", timeout=300, env=ENV).stdout
        text = " ".join(text.split())  # wrapped to the terminal's width
        assert (
            f"{s['graphs']} graphs split between 2 hosts because inductor_config[max_autotune_pointwise] "
            "differs (gpu-a: False; gpu-b: True)" in text
        )
    finally:
        with _admin() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_bundle_s_names_reach_the_screen_escaped():
    """Names out of a bundle (another host's) in what check and import say: a newline or a
    terminal escape is %XX, as an index key shows it (they were printed raw)."""
    contents = bundle.read_contents({}, {"autotune": [("ab/x.best_config", b"{}")], "inductor": []})
    problems = bundle.completeness(contents, {"autotune": ["ab/evil\x1b]0;pwned\x07\nsecond.best_config"]})
    assert problems == ["autotune result ab/evil%1B]0;pwned%07%0Asecond.best_config is not in the bundle"]


def test_a_bundle_s_entries_are_read_in_bounded_workers(fixture_cache, tmp_path, db_url):
    """A bundle is a file from anywhere: an fxgraph entry whose pickle takes about 800 MB to
    unpickle (14M one-item tuples, 42 MB) and an AOT entry that is no pickle are each read in a
    parse worker, under its memory bound, and named as entries that do not read, while a real
    graph beside them is checked. The command's own peak RSS stays far below what unpickling
    takes (check unpickled every entry itself, 1 GB and more)."""
    cache = fixture_cache("torch-2.13.0-cpu")
    real = next(p for p in sorted((cache / "fxgraph").rglob("*")) if p.is_file())
    arts = {
        "inductor": [
            (real.parent.name, real.read_bytes()),
            ("f" + "b" * 51, b"\x80\x02](" + b"K\x01\x85" * 14_000_000 + b"e."),  # [(1,), (1,), ...]
        ],
        "aot_autograd": [("a" + "n" * 51, b"\x00" * 64)],
    }
    path = tmp_path / "hostile.bundle"
    bundle.write(str(path), {"torch": "2.13.0"}, bundle.payload_of(arts))
    del arts
    out = subprocess.run(
        [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *Cli(cache, db_url).base(), "check", "--bundle", str(path)]
        + ["--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    assert doc["graphs"] == 2 and not doc["complete"], doc
    bomb = "graph f" + "b" * 51 + ": its entry does not read: out of memory (a parse worker may take 512 MiB)"
    assert bomb in doc["missing"], doc["missing"]
    # (its prediction says so too: it said "its torch records no hash components")
    why = {p["graph_key"] or p["key"]: p["reason"] for p in doc["predictions"] if p["verdict"] == "unknown"}
    assert why["f" + "b" * 51].startswith("its entry does not read: unpickle failed: needs more memory"), why
    aot = "aotautograd entry a" + "n" * 51 + ": its entry does not read: unpickle failed"
    assert any(m.startswith(aot) for m in doc["missing"]), doc["missing"]
    peak = int(out.stderr.split("peak-rss-mib")[1].split()[0])
    assert peak < 450, f"check's own peak RSS {peak} MiB"


def test_a_bundle_s_entries_share_a_worker_per_core(monkeypatch):
    """A bundle of many entries is read by as many parse workers as the host has cores (here
    made 2), each taking entry after entry: one worker per entry started hundreds of processes
    at once, each allowed its 512 MiB."""
    from cachemgr.index import workers

    started = []
    real_init = workers._Worker.__init__

    def counting_init(self):
        started.append(1)
        real_init(self)

    monkeypatch.setattr(workers, "default_workers", lambda: 2)
    monkeypatch.setattr(workers._Worker, "__init__", counting_init)
    arts = {"inductor": [(f"g{i}", b"\x80\x02N.") for i in range(12)], "aot_autograd": [("a", b"\x80\x02N.")]}
    contents = bundle.read_contents({}, arts)
    assert len(contents.graphs) == 12 and len(contents.aot) == 1
    assert len(started) == 2, f"{len(started)} workers started"


# -- bundles from anywhere: what import would refuse, check refuses; nothing leaves the root ------------


@pytest.fixture(scope="module")
def cpu_bundle(fixture_masters, tmp_path_factory) -> Path:
    """A bundle exported from a copy of the torch 2.13 CPU fixture (read only by the tests)."""
    base = tmp_path_factory.mktemp("cpu-bundle")
    shutil.copytree(fixture_masters("torch-2.13.0-cpu"), base / "cache", symlinks=True)
    (base / "state").mkdir()
    _export(base / "cache", base / "cpu.bundle", f"sqlite:///{base / 'state' / 'index.db'}")
    return base / "cpu.bundle"


def _with_header(src: Path, dst: Path, **fields) -> None:
    b = bundle.read(str(src))
    bundle.write(str(dst), {**b.header, **fields}, b.payload)


def test_import_and_prewarm_never_write_through_a_symlink_below_the_top_level(cpu_bundle, tmp_path, db_url):
    """Only a symlinked fxgraph/ itself was refused: torch followed `fxgraph/<2ch>` or
    `aotautograd/<key>` pointing elsewhere and import wrote the entries there, exit 0. Every
    directory on each artifact's way is now looked at from the root: exit 7, one line naming
    it, nothing written anywhere."""
    arts = bundle.artifacts(bundle.read(str(cpu_bundle)).payload)
    graph, aot = arts["inductor"][0][0], arts["aot_autograd"][0][0]
    outside = tmp_path / "outside"
    outside.mkdir()
    for where in (f"fxgraph/{graph[1:3]}", f"aotautograd/{aot}"):
        cache = tmp_path / where.replace("/", "-")
        (cache / where).parent.mkdir(parents=True)
        (cache / where).symlink_to(outside)
        before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
        r = Cli(cache, db_url).proc("import", str(cpu_bundle), timeout=900, env=ENV)
        assert r.returncode == 7, r.stderr
        assert r.stderr == (
            f"cachemgr: error: cache directory {cache}: {where} is a symlink, not a directory: torch would "
            "write the bundle's entries through it: refusing to import a bundle into it\n"
        )
        assert list(outside.iterdir()) == [] and sorted(p.relative_to(cache) for p in cache.rglob("*")) == before
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "m"\nfactory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'
        'shapes = [["f32[2,16]"]]\n'
    )
    r = Cli(cache, db_url).proc(
        "prewarm", "--manifest", str(tmp_path / "m.toml"), "--bundle", str(cpu_bundle), timeout=900, env=ENV
    )
    assert r.returncode == 7 and f"{where} is a symlink, not a directory" in r.stderr, r.stderr
    assert list(outside.iterdir()) == []


def _retyped(src: Path, dst: Path, kind: str) -> None:
    """A payload whose `kind` record comes twice, the second empty (torch keeps only the last)."""
    import base64
    import zlib

    body = bytearray(bundle.payload_of(bundle.artifacts(bundle.read(str(src)).payload))[4:])
    name = base64.b64encode(kind.encode())
    body += len(name).to_bytes(8, "big") + name + (0).to_bytes(8, "big")
    bundle.write(str(dst), bundle.read(str(src)).header, zlib.crc32(body).to_bytes(4, "big") + bytes(body))


def test_check_bundle_refuses_what_import_refuses(cpu_bundle, tmp_path, db_url):
    """`check --bundle` said 7 graphs will hit of a bundle import refuses (a key of '../x'), and of
    one that lists `inductor` twice (cachemgr counted both lists, torch loads only the last: no
    graph at all); a header whose `expects` was a list crashed it (exit 70) and showed import a
    raw exception. Each is now exit 9, one line, from both. A refused import leaves no cache dir."""

    def traversal(arts):
        arts["aot_autograd"].append(("../../../outside", arts["aot_autograd"][0][1]))

    bad = tmp_path / "traversal.bundle"
    _rewrite(cpu_bundle, bad, traversal)
    twice = tmp_path / "twice.bundle"
    _retyped(cpu_bundle, twice, "inductor")
    cases = [
        (bad, "import refuses it: aot_autograd artifact key '../../../outside' is not a name inside the cache"),
        (twice, "torch's artifacts do not read: artifact type 'inductor' is listed twice"),
    ]
    for name, expects in (("list", ["x"]), ("int", {"autotune": 5}), ("str", {"autotune": "abcdef"})):
        path = tmp_path / f"expects-{name}.bundle"
        _with_header(cpu_bundle, path, expects=expects)
        cases.append((path, "its header is not one cachemgr writes (field 'expects')"))
    cli = Cli(tmp_path / "cache", db_url)
    for path, why in cases:
        r = cli("check", "--bundle", str(path), code=9)
        assert r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
        if path is not bad:  # (import's own check of keys is test_a_bundle_is_never_let_write_outside_the_cache)
            r = cli("import", str(path), code=9)
            assert r.stderr.count("\n") == 1 and why in r.stderr, r.stderr
    r = cli.proc("import", str(bad), timeout=900, env=ENV)  # refused in its worker, after torch made the dir
    assert r.returncode == 9 and "refusing to import it" in r.stderr, r.stderr
    assert not cli.cache_dir.exists()


def test_a_bundle_is_never_held_whole_before_it_is_known_good(tmp_path, db_url):
    """A bundle was read whole, at about twice its size, before its checksum was compared: a
    3 GiB sparse file cost 6.6 GB. A file over MAX_BYTES is refused before anything is read, and
    a payload's checksum is taken as it is read (a corrupt one is never held)."""
    big = tmp_path / "big.bundle"
    header = {"bytes": bundle.MAX_BYTES, "sha256": "0" * 64}
    with open(big, "wb") as f:
        f.write(bundle.MAGIC + json.dumps(header).encode() + b"\n")
        f.truncate(f.tell() + bundle.MAX_BYTES)  # sparse: nothing is on disk
    r = Cli(tmp_path / "cache", db_url)("check", "--bundle", str(big), code=9)
    assert r.stderr == f"cachemgr: error: bundle {big} is larger than a bundle may be (4.0 GiB, at most 4.0 GiB)\n"
    corrupt = tmp_path / "corrupt.bundle"
    size = 600 << 20
    with open(corrupt, "wb") as f:
        f.write(bundle.MAGIC + json.dumps({"bytes": size, "sha256": "0" * 64}).encode() + b"\n")
        f.truncate(f.tell() + size)
    out = subprocess.run(
        [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *Cli(tmp_path / "cache", db_url).base()]
        + ["check", "--bundle", str(corrupt)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 9 and "payload does not match its header" in out.stderr, out.stderr
    peak = int(out.stderr.split("peak-rss-mib")[1].split()[0])
    assert peak < 300, f"check's own peak RSS {peak} MiB for a 600 MiB bundle"


def test_export_never_replaces_what_is_not_a_regular_file(tmp_path, db_url):
    """`export --out` renamed its bundle over whatever was there: a device node (as root,
    --out /dev/null replaced /dev/null with a file), a FIFO, a symlink. Refused, exit 2."""
    (tmp_path / "cache").mkdir()
    fifo, link, target = tmp_path / "fifo", tmp_path / "link", tmp_path / "target"
    os.mkfifo(fifo)
    target.write_text("mine")
    link.symlink_to(target)
    odd = [(fifo, "a FIFO"), (link, "a symlink")]
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        odd.append((tmp_path / "null", "a character device"))
    for path, kind in odd:
        r = Cli(tmp_path / "cache", db_url)("export", "--out", str(path), code=2)
        assert r.stderr == (
            f"cachemgr: error: export --out {path}: it is {kind}, not a regular file: refusing to replace it\n"
        )
        with pytest.raises(bundle.BundleError, match=f"is {kind}, not a regular file"):
            bundle.write(str(path), {}, b"x")  # (the export worker's write: made there meanwhile)
    assert fifo.is_fifo() and link.is_symlink() and target.read_text() == "mine"
    assert all(not p.is_file() or p.is_symlink() for p, _ in odd)


def test_export_keeps_out_what_import_refuses():
    """export handed torch every file it found: a directory name that is not UTF-8 made torch's
    save fail whole ("nothing to export", exit 8), a .best_config in the trash made a bundle that
    import refuses. `exportable` (the export worker's filter) keeps the rest and says why; a PGO
    key with a newline (a file name of two lines) is not a name inside the cache either."""
    good = "fr6kj" + "g" * 47
    records = [
        ("inductor", good, b"g"),
        ("inductor", "fr6\udcff\udcfebad", b"g"),
        ("autotune", "ab/" + "c" * 62 + ".best_config", {"XBLOCK": 8}),
        ("autotune", ".cachemgr-trash/x/abc.best_config", {"XBLOCK": 8}),
        ("pgo", "mast:x\nline", b"p"),
        ("inductor", "a-", b"g"),  # (a stray fxgraph/zz/a-/: torch writes fxgraph/-/, which eviction refuses)
    ]
    skipped: list[str] = []
    kept = list(bundle.exportable(records, skipped))
    assert [key for _, key, _ in kept] == [good, "ab/" + "c" * 62 + ".best_config"]
    tail = "is not a name inside the cache that Inductor makes"
    assert skipped == [
        f"inductor artifact key 'fr6\\udcff\\udcfebad' {tail}",
        f"autotune artifact key '.cachemgr-trash/x/abc.best_config' {tail}",
        f"pgo artifact key 'mast:x\\nline' {tail}",
        f"inductor artifact key 'a-' {tail}",
    ]


@pytest.mark.parametrize(
    "kind, key",
    [
        ("inductor", "a"),  # torch writes fxgraph/a/ (key[1:3] is empty): eviction refuses the cache
        ("inductor", "a-"),  # fxgraph/-/
        ("inductor", "a:b"),
        ("inductor", "a.b"),  # fxgraph/.b/: a dot folder no scan indexes
        ("inductor", "fab.tmp"),  # a write in progress for ever
        ("aot_autograd", "a:b"),
        ("autotune", "ab/x"),  # no .best_config: "ab/ holds no generated modules"
        ("autotune", "ab/x.tmp"),
        ("pgo", "k" * 250),  # code_state_<key>.pkl.lock over 255 bytes: torch failed half way
    ],
)
def test_a_bundle_key_inductor_never_makes_is_refused(kind, key):
    """Keys far looser than Inductor's were let in: torch wrote them where no scan sees them, or
    where eviction, purge, the daemon and import then refused the whole cache (exit 7) for good."""
    assert bundle.key_problem(kind, key) is not None
    real = {"inductor": "f" + "a" * 51, "aot_autograd": "a" + "b" * 51, "autotune": "2t/" + "9e" * 32 + ".best_config"}
    if kind in real:
        assert bundle.key_problem(kind, real[kind]) is None


def test_a_bundle_of_too_many_artifacts_is_refused(monkeypatch):
    """1,000,000 artifacts of 21 bytes (a 21 MB bundle) took check --bundle 4 GB and two minutes:
    a bundle holds at most MAX_ARTIFACTS."""
    monkeypatch.setattr(bundle, "MAX_ARTIFACTS", 10)
    arts = {"autotune": [(f"ab/{i:064x}.best_config", b"{}") for i in range(11)]}
    with pytest.raises(bundle.BundleError, match="over 10 artifacts"):
        bundle.artifacts(bundle.payload_of(arts))
    arts["autotune"].pop()
    assert len(bundle.artifacts(bundle.payload_of(arts))["autotune"]) == 10


def test_a_hard_link_at_torch_s_pgo_file_is_a_write_hazard(tmp_path):
    """torch opens dynamo/code_state_<key>.pkl.tmp (and .lock) for writing: a hard link planted
    there made an import write a file outside the cache."""
    from cachemgr import safefs

    root = tmp_path / "cache"
    (root / "dynamo").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("important")
    os.link(victim, root / "dynamo" / "code_state_k.pkl.tmp")
    with safefs.Root(str(root)) as r:
        hazards = bundle.write_hazards(r, {"pgo": [("k", b"p")]})
    assert hazards == ["dynamo/code_state_k.pkl.tmp is a hard link (another name of a file elsewhere)"]


def test_recorded_options_are_read_a_row_at_a_time_and_bounded(monkeypatch):
    """check, import and prewarm --bundle held every recorded row decoded (4,000 rows of a hostile
    spool: 4.2 GB and ten minutes) to keep each model's latest options: the rows now stream by,
    and at most MAX_RECORDED_MODELS models' options are kept."""
    from cachemgr import check

    monkeypatch.setattr(check, "MAX_RECORDED_MODELS", 3)
    taken = []

    def rows():
        for i in range(10_000):
            taken.append(i)
            yield {"model": f"m{i % 5}", "options": {"options": {"max_autotune": i % 2 == 0}, "mode": None}}

    sets = check.option_sets(None, rows())
    assert len(taken) == 10_000 and sorted(s["label"] for s in sets) == ["recorded m0", "recorded m1", "recorded m2"]


def test_export_onto_a_name_too_long_is_a_usage_error(fixture_cache, tmp_path, db_url):
    r = Cli(fixture_cache("torch-2.13.0-cpu"), db_url).proc("export", "--out", str(tmp_path / ("a" * 260)))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "File name too long" in r.stderr, r.stderr


def test_an_import_moves_what_torch_wrote_in_without_following_a_symlink(cpu_bundle, tmp_path):
    """The command looks for symlinks on torch's way before the worker starts; one made in
    between (`fxgraph/<2ch>` -> elsewhere) took the bundle's entry out of the cache, torch follows
    it. torch now writes into a folder of the cache's own, and each file is moved into place
    through descriptors that follow no symlink: the entry stays out, named; the rest goes in."""
    import torch

    from cachemgr.prewarm import worker

    payload = bundle.read(str(cpu_bundle)).payload
    keys = [k for k, _ in bundle.artifacts(payload)["inductor"]]
    root, outside = tmp_path / "cache", tmp_path / "outside"
    (root / "fxgraph").mkdir(parents=True)
    outside.mkdir()
    (root / "fxgraph" / keys[0][1:3]).symlink_to(outside)
    info, refused = worker.load_staged(torch, payload, str(root))
    assert info is not None and list(outside.iterdir()) == []
    assert refused and all(r.startswith(f"fxgraph/{keys[0][1:3]}/") for r in refused), refused
    written = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and not p.is_symlink()}
    others = {k for k in keys if k[1:3] != keys[0][1:3]}
    assert others and all(any(w.startswith(f"fxgraph/{k[1:3]}/{k}/") for w in written) for k in others), written
    assert [p.name for p in root.iterdir() if p.name.startswith("tmp")] == []  # (the folder torch wrote into is gone)
    # a killed import's folder (eviction keeps tempfile-named folders) goes at the next import;
    # Inductor's own, and a live import's, stay
    for name, marked, hours in (("tmpdead0001", True, 7), ("tmplive0001", True, 0), ("tmpindu0001", False, 7)):
        (root / name).mkdir()
        (root / name / "x.py").write_text("x")
        if marked:
            (root / name / worker.STAGING_MARK).touch()
        t = time.time() - hours * 3600
        for p in (root / name).iterdir():
            os.utime(p, (t, t))
    worker.load_staged(torch, payload, str(root))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("tmp")) == ["tmpindu0001", "tmplive0001"]


def test_import_says_which_autotune_results_it_replaced(cpu_bundle, tmp_path, db_url):
    """An autotune result the cache held was replaced by the bundle's without a word."""
    key = "ab/" + "d" * 62 + ".best_config"

    def tuned(arts):
        arts["autotune"] = [(key, b'{"XBLOCK": 999, "num_warps": 1}')]

    path = tmp_path / "tuned.bundle"
    _rewrite(cpu_bundle, path, tuned)
    (tmp_path / "cache" / "ab").mkdir(parents=True)
    (tmp_path / "cache" / key).write_text('{"XBLOCK": 1, "num_warps": 4}')
    r = Cli(tmp_path / "cache", db_url).proc("import", str(path), timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr
    assert f"cachemgr: the bundle's autotune results replaced 1 this cache held (first: {key})\n" in r.stderr


def test_graphs_that_do_not_read_or_are_not_read_yet_count_as_unknown(fixture_cache, db_url):
    """check counted the graphs that parsed only: a cache whose every entry was corrupt said "0
    graphs: 0 will hit, 0 will miss, 0 unknown", and the entries an interrupted phase two left
    were not counted at all. What came from the index (a corrupt reason, a component's name: a
    BLOB of a hand edit, which also failed explain and check with a TypeError, exit 70) reached
    the terminal unescaped."""
    import sqlite3

    root = fixture_cache("torch-2.13.0-cpu")
    cli = Cli(root, db_url)
    cli("scan")
    with sqlite3.connect(db_url.split(":///", 1)[1]) as c:
        ids = [i for (i,) in c.execute("SELECT id FROM entries WHERE kind = 'fxgraph' ORDER BY id")]
        c.execute("UPDATE entries SET parse_state = 2 WHERE id IN (?, ?)", ids[:2])
        c.execute("UPDATE entries SET corrupt = ? WHERE id = ?", ("bad \x1b]0;title\x07 pickle", ids[2]))
        c.execute(
            "UPDATE component_set_items SET name = ? WHERE name = 'inductor_config[epilogue_fusion]'",
            (b"inductor_config[\x1b[1mepilogue\xff]",),
        )
    report = json.loads(cli("check", "--json").stdout)
    assert report["graphs"] == len(ids) == 8
    reasons = [p.get("reason") for p in report["predictions"]]
    assert reasons.count(check.NOT_READ_YET) == 2, reasons
    assert reasons.count("its entry does not read: bad \x1b]0;title\x07 pickle") == 1, reasons
    assert report["unknown"] >= 3 and report["hit"] + report["miss"] + report["unknown"] == 8
    text = cli("check", "--all").stdout
    assert "\x1b" not in text and "\x07" not in text and "bad \\x1b]0;title\\x07 pickle" in text
    assert "2 graphs unknown: its entry is not read yet (the next scan reads it)" in text
    assert "inductor_config[\\x1b[1mepilogue\\xff]" in text  # (a BLOB read as text, then escaped)
    cli("explain", "--since", "10000d")
    cli("diff", report["predictions"][3]["key"], report["predictions"][4]["key"])
