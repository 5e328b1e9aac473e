"""Prewarm end to end on CPU: a real workload records its shapes, `cachemgr prewarm` replays them
into a fresh cache in worker processes, and a fresh process running the workload then misses
nothing. Bad manifests, factories that do not import, shapes that raise or hang, and bundles from
another torch each fail by name while the rest is still prewarmed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachemgr.prewarm import bundle
from cachemgr.prewarm import manifest as mf
from tests.conftest import PROGRAMS, Builds, Cli, subprocess_env

pytestmark = pytest.mark.slow
ENV = {"PYTHONPATH": os.pathsep.join((str(Path(__file__).resolve().parent.parent), str(PROGRAMS)))}
# C++ builds (conftest.Builds) of the workload (prewarm_models.py as a program: prewarm compiles the
# very graphs it recorded, so the same kernels) and of a prewarm of the manifest's `head` alone.
# Seeded caches still hold no graph: what is tested is which graphs hit or miss, and those counts
# are torch's own, which no C++ build changes.
WORKLOAD_BUILDS = "prewarm_models"
HEAD_BUILDS = "prewarm --model head"

MANIFEST = """
[[model]]
name = "mlp"
factory = "prewarm_models:mlp"
train = true

[[model]]
name = "head"
factory = "prewarm_models:gelu_head"
compile = { dynamic = false }

[[model]]
name = "scorer"
factory = "prewarm_models:scorer"

[[model]]
name = "gone"
factory = "no_such_pkg.models:build"
shapes = [["f32[2,3]"]]

[[model]]
name = "bad"
factory = "prewarm_models:mlp"
compile = { mode = "fastest" }

[[model]]
name = "broken"
factory = "prewarm_models:broken"
shapes = [["f32[2,3]"]]

[[model]]
name = "picky"
factory = "prewarm_models:picky"
compile = { dynamic = false }
shapes = [["f32[2,4]"], ["f32[3,4]"], ["f32[5,4]"]]
"""


class ConfCli(Cli):
    """The CLI with a config file (it names the spool the workload records into)."""

    def __init__(self, cache_dir: Path, db_url: str, config: Path) -> None:
        super().__init__(cache_dir, db_url)
        self.config = config

    def base(self) -> list[str]:
        return [*super().base(), "--config", str(self.config)]


def workload(cache_dir: Path, spool: Path) -> dict:
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "prewarm_models.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(cache_dir, CACHEMGR_SPOOL_DIR=str(spool)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def proc_json(cli: Cli, *args: str, code: int, timeout: float = 900) -> tuple[dict, str]:
    r = cli.proc(*args, "--json", timeout=timeout, env=ENV)
    assert r.returncode == code, f"exit {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return json.loads(r.stdout), r.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory, cpp_builds: Builds):
    base = tmp_path_factory.mktemp("prewarm")
    (base / "m.toml").write_text(MANIFEST)
    (base / "config.toml").write_text(f'spool_dir = "{base / "spool"}"\n')
    had = cpp_builds.seed(base / "orig-cache")
    first = workload(base / "orig-cache", base / "spool")  # the workload records its shapes
    assert first["fxgraph_cache_miss"] > 0
    cpp_builds.keep(WORKLOAD_BUILDS, base / "orig-cache", had)
    cli = ConfCli(base / "fresh-cache", f"sqlite:///{base / 'idx.db'}", base / "config.toml")
    cpp_builds.seed(cli.cache_dir, WORKLOAD_BUILDS)  # no graph: prewarm compiles every one
    doc, err = proc_json(cli, "prewarm", "--manifest", str(base / "m.toml"), "--verify", code=8)
    return {"base": base, "cli": cli, "doc": doc, "stderr": err, "first": first}


def test_fresh_process_of_the_workload_misses_nothing_after_prewarm(world):
    doc, ours = world["doc"], ("mlp", "head", "scorer")
    pre = {(r["model"], r["index"]): r for r in doc["shapes"]}
    assert {k for k in pre if k[0] in ours} == {
        ("mlp", 0),
        ("mlp", 1),
        ("mlp", 2),
        ("head", 0),
        ("head", 1),
        ("head", 2),
        ("scorer", 0),
    }
    assert all(pre[k]["ok"] and pre[k]["seconds"] > 0 for k in pre if k[0] in ours)
    assert (
        sum(r["counters"]["fxgraph_cache_miss"] for r in doc["shapes"] if r["model"] in ours)
        == world["first"]["fxgraph_cache_miss"]
    )
    assert pre[("mlp", 0)]["counters"]["autograd_cache_saved"] >= 1  # train = true ran the backward
    ver = {r["model"]: r for r in doc["verify"]["shapes"] if r["model"] in ours}
    ver_rows = [r for r in doc["verify"]["shapes"] if r["model"] in ours]
    assert len(ver_rows) == 7 and all(r["counters"]["fxgraph_cache_miss"] == 0 for r in ver_rows)
    assert sum(r["counters"]["fxgraph_cache_hit"] for r in ver_rows) == world["first"]["fxgraph_cache_miss"]
    # A forward with grad enabled and no backward: torch saves its AOTAutograd entry only once a
    # backward compiles, so every process misses it while its Inductor graph hits. Verify passes it.
    scorer = ver["scorer"]["counters"]
    assert scorer["autograd_cache_miss"] == 1 and scorer["autograd_cache_saved"] == 0
    assert not any("scorer" in f for f in doc["failures"])
    again = workload(world["cli"].cache_dir, world["base"] / "spool-2")
    assert again["fxgraph_cache_miss"] == 0 and again["autograd_cache_miss"] == 1  # the scorer's, as above
    assert again["fxgraph_cache_hit"] == world["first"]["fxgraph_cache_miss"]
    assert again["checksum"] == pytest.approx(world["first"]["checksum"])


def test_every_failure_is_named_and_the_rest_still_prewarmed(world):
    doc, err = world["doc"], world["stderr"]
    failures = "\n".join(doc["failures"])
    assert "model 'bad': field 'compile.mode': must be one of" in failures and "'fastest'" in failures
    assert (
        "model 'gone': field 'factory' 'no_such_pkg.models:build': cannot import module 'no_such_pkg.models'"
        in failures
    )
    assert "model 'broken'" in failures and "this factory is broken on purpose" in failures
    picky = {r["index"]: r for r in doc["shapes"] if r["model"] == "picky"}
    assert picky[0]["ok"] and picky[2]["ok"] and not picky[1]["ok"]
    assert "ValueError: picky refuses batch 3" in picky[1]["error"]
    assert "model 'picky' shape #1 (f32[3,4])" in failures
    assert len(doc["failures"]) == 4
    assert "cachemgr: error: 4 problem(s) during prewarm" in err


def test_export_then_import_into_an_empty_cache_is_warm(world, tmp_path, fixture_cache, cpp_builds: Builds):
    cli = world["cli"]
    out = tmp_path / "cache.bundle"
    doc, _ = proc_json(cli, "export", "--out", str(out), code=0)
    h = bundle.read(str(out)).header
    import torch

    assert h["torch"] == torch.__version__ and h["artifacts"]["inductor"] >= world["first"]["fxgraph_cache_miss"]
    target = Cli(tmp_path / "imported", cli.db_url)
    imp, _ = proc_json(target, "import", str(out), code=0)
    assert imp["ok"] and imp["artifacts"]["inductor"] == h["artifacts"]["inductor"]
    cpp_builds.seed(tmp_path / "imported", WORKLOAD_BUILDS)  # after the import: its graphs are the bundle's
    counters = workload(tmp_path / "imported", tmp_path / "spool")
    assert counters["fxgraph_cache_miss"] == 0 and counters["fxgraph_cache_hit"] > 0

    # a bundle from another torch (its entries record it): refused by the cache check, by import
    # and by prewarm --bundle (which still prewarms the rest)
    other = tmp_path / "other.bundle"
    proc_json(Cli(fixture_cache("torch-2.14.1-cpu"), cli.db_url), "export", "--out", str(other), code=0)
    r = target.proc("import", str(other), env=ENV, timeout=300)
    assert r.returncode == 9, r.stderr
    assert "none of its 8 graphs would hit here (8 graphs will miss because torch_version differs)" in r.stderr
    assert "refusing to import it" in r.stderr
    fresh = ConfCli(tmp_path / "fresh2", cli.db_url, cli.config)
    had = cpp_builds.seed(fresh.cache_dir, HEAD_BUILDS)
    doc, err = proc_json(
        fresh, "prewarm", "--manifest", str(world["base"] / "m.toml"), "--model", "head", "--bundle", str(other), code=9
    )
    cpp_builds.keep(HEAD_BUILDS, fresh.cache_dir, had)
    assert "torch_version differs" in doc["failures"][0]
    assert [r["ok"] for r in doc["shapes"]] == [True, True, True]


def test_two_cpu_workers_share_the_shapes_and_a_hang_times_out(world, tmp_path):
    (tmp_path / "s.toml").write_text("""
[[model]]
name = "sleepy"
factory = "prewarm_models:sleepy"
compile = { backend = "eager", dynamic = false }
shapes = [["f32[1,2]"], ["f32[2,2]"], ["f32[3,2]"], ["f32[4,2]"]]
""")
    cli = Cli(tmp_path / "c", world["cli"].db_url)
    doc, _ = proc_json(
        cli, "prewarm", "--manifest", str(tmp_path / "s.toml"), "--devices", "cpu,cpu", "--timeout", "20", code=8
    )
    res = {r["index"]: r for r in doc["shapes"]}
    assert sorted(res) == [0, 1, 2, 3]
    assert not res[1]["ok"] and "timed out after 20 s" in res[1]["error"]
    assert res[0]["ok"] and res[2]["ok"] and res[3]["ok"]  # the shape after the hang ran in a new worker
    # 'cpu,cpu' is two workers: shapes 0 and 2 in one, 1 (which hangs) in the other, 3 in its successor
    assert res[0]["worker"] == res[2]["worker"] and res[0]["worker"] is not None
    assert res[3]["worker"] not in (res[0]["worker"], None)


def test_a_missing_bundle_or_a_manifest_with_nothing_to_run_is_named_before_any_worker_starts(tmp_path, db_url):
    (tmp_path / "m.toml").write_text(MANIFEST)
    r = Cli(tmp_path / "c", db_url).proc(
        "prewarm", "--manifest", str(tmp_path / "m.toml"), "--bundle", str(tmp_path / "nope.bundle")
    )
    assert r.returncode == 3 and r.stderr == f"cachemgr: error: bundle {tmp_path / 'nope.bundle'} does not exist\n"
    (tmp_path / "bad.toml").write_text('[[model]]\nname = "a"\nshapes = [["f32[2,x]"]]\n')
    r = Cli(tmp_path / "c", db_url).proc("prewarm", "--manifest", str(tmp_path / "bad.toml"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "model 'a': field 'factory'" in r.stderr, r.stderr
    for command in ("prewarm", "check"):  # a manifest named that is not there: exit 3, as help says
        r = Cli(tmp_path / "c", db_url).proc(command, "--manifest", str(tmp_path / "none.toml"))
        assert r.returncode == 3, r.stderr
        assert r.stderr == f"cachemgr: error: manifest {tmp_path / 'none.toml'} does not exist\n"


def test_manifest_errors_name_model_and_field(tmp_path):
    m = mf.parse(
        {
            "model": [
                {"name": "a", "factory": "pkg.mod:fn", "shapes": [["f32[2,x]"]]},
                {"name": "b", "factory": "nocolon"},
                {"name": "c", "factory": "p:f", "compile": {"dynamic": "sometimes"}},
                {"name": "d", "factory": "p:f", "device": "tpu"},
                {"name": "e", "factory": "p:f", "colour": "red"},
                {
                    "name": "ok",
                    "factory": "p:f",
                    "shapes": [["bf16[4,8]*", 3], {"args": [{"shape": [2], "dtype": "int64"}]}],
                },
            ]
        },
        "x.toml",
    )
    msgs = dict(m.errors)
    assert "model 'a': field 'shapes[0][0]': tensor spec must look like" in msgs["a"]
    assert "model 'b': field 'factory': required, 'package.module:function'" in msgs["b"]
    assert "field 'compile.dynamic'" in msgs["c"] and "field 'device'" in msgs["d"] and "field 'colour'" in msgs["e"]
    (ok,) = m.models
    assert ok.shapes[0]["args"][0] == {
        "t": "tensor",
        "shape": [4, 8],
        "dtype": "bfloat16",
        "device": None,
        "requires_grad": True,
        "stride": [8, 1],
    }
    assert ok.shapes[0]["args"][1] == {"t": "int", "v": 3}
    (tmp_path / "bad.toml").write_text("[[model]\nname=")
    with pytest.raises(mf.ManifestError, match="not valid TOML"):
        mf.load(str(tmp_path / "bad.toml"))
    with pytest.raises(mf.ManifestError, match="no \\[\\[model\\]\\] tables"):
        mf.parse({}, "empty.toml")


def test_recorded_inputs_over_max_input_bytes_fail_by_name_and_are_never_allocated(tmp_path, db_url):
    """A spool line is anyone's: one `f32[67108864,8]` made a worker allocate 2 GiB (4.5 GB at its
    peak). A replayed call's inputs are now measured first, storage as shape and stride span it
    (a stride alone can ask for GiBs), against the model's `max_input_bytes` (1 GiB unless the
    manifest says): a shape over it fails by name, exit 8, and the model's other shapes still run."""
    spool = tmp_path / "spool"
    spool.mkdir()
    t0 = time.time() - 100

    def line(model: str, i: int, shape: list[int], stride: list[int]) -> str:
        arg = {"t": "tensor", "shape": shape, "dtype": "float32", "device": "cpu", "stride": stride}
        spec = {"args": [arg], "kwargs": {}, "grad": False}
        return json.dumps({"model": model, "signature_hash": f"{model[:4]}{i}", "spec": spec, "ts": t0 + i}) + "\n"

    (spool / "w.jsonl").write_text(
        line("capped", 0, [2, 16], [16, 1])
        + line("capped", 1, [512, 1024], [1024, 1])  # 2 MiB, over its manifest's 1 MiB
        + line("strided", 2, [2, 16], [16, 1])
        + line("strided", 3, [2, 16], [1 << 29, 1])  # 32 numbers spread over 2 GiB: over the default
    )
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "capped"\nfactory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'
        'max_input_bytes = "1MiB"\n\n'
        '[[model]]\nname = "strided"\nfactory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'
    )
    (tmp_path / "config.toml").write_text(f'spool_dir = "{spool}"\n')
    cli = ConfCli(tmp_path / "cache", db_url, tmp_path / "config.toml")
    doc, _ = proc_json(cli, "prewarm", "--manifest", str(tmp_path / "m.toml"), code=8)
    ok = {(r["model"], r["index"]): r["ok"] for r in doc["shapes"]}
    assert ok == {("capped", 0): True, ("capped", 1): False, ("strided", 0): True, ("strided", 1): False}
    assert sorted(doc["failures"]) == [
        "model 'capped' shape #1 (f32[512,1024]) no_grad on cpu: InputsTooLarge: the inputs would take "
        "2.0 MiB, over the model's max_input_bytes (1.0 MiB) for one replayed call: not built",
        "model 'strided' shape #1 (f32[2,16]) no_grad on cpu: InputsTooLarge: the inputs would take "
        "2.0 GiB, over the model's max_input_bytes (1.0 GiB) for one replayed call: not built",
    ]
    bad = mf.parse({"model": [{"name": "a", "factory": "p:f", "max_input_bytes": "lots"}]}, "x.toml")
    assert "model 'a': field 'max_input_bytes': invalid size 'lots'" in bad.errors[0][1]


def test_shapes_are_shared_in_order_and_automatic_dynamic_slices_lead_in_with_the_first():
    from cachemgr.prewarm import worker

    m = mf.parse(
        {
            "model": [
                {"name": "auto", "factory": "p:f", "shapes": [[f"f32[{b},4]"] for b in (1, 2, 3, 4, 5)]},
                {
                    "name": "static",
                    "factory": "p:f",
                    "compile": {"dynamic": False},
                    "shapes": [["f32[1,4]"], ["f32[2,4]"]],
                },
                {"name": "rec", "factory": "p:f"},
            ]
        },
        "x.toml",
    )
    recorded = [
        {
            "model": "rec",
            "signature_hash": "h1",
            "signature": "(f32[9])",
            "spec": {"args": [], "kwargs": {}},
            "options": {"mode": "max-autotune"},
        }
    ]
    plans, errors = worker.plan(m, recorded)
    assert errors == [] and [p.compile for p in plans] == [{}, {"dynamic": False}, {"mode": "max-autotune"}]
    jobs = worker.distribute(plans, ["cuda:0", "cuda:1"])
    (d0, (a0, s0, r0)), (d1, (a1, s1)) = jobs
    assert (d0, d1) == ("cuda:0", "cuda:1")
    assert (a0.indices, a0.lead_in, a1.indices, a1.lead_in) == ([0, 2, 4], None, [1, 3], 0)
    assert (s0.indices, s1.indices, s1.lead_in) == ([0], [1], None)  # explicit dynamic: no lead-in needed
    assert r0.indices == [0]
    rep = worker.distribute(plans, ["cuda:0", "cuda:1"], replicate=True)
    assert [s.indices for s in rep[1][1]] == [[0, 1, 2, 3, 4], [0, 1], [0]]
    twice = worker.distribute(plans[1:2], ["cpu", "cpu"])  # one worker per listed device, repeats too
    assert [(d, [s.indices for s in slices]) for d, slices in twice] == [("cpu", [[0]]), ("cpu", [[1]])]
    _, errors = worker.plan(mf.parse({"model": [{"name": "new", "factory": "p:f"}]}, "y.toml"), recorded)
    assert "model 'new': field 'shapes': \"recorded\" but no shapes are recorded" in errors[0][1]


def test_target_redis_fills_pytorchs_remote_cache(world, tmp_path, redis_url, cpp_builds: Builds):
    url = redis_url  # the session's own Redis database, emptied for this test
    cfg = tmp_path / "config.toml"
    cfg.write_text(world["cli"].config.read_text() + f'redis_url = "{url}"\n')
    cli = ConfCli(tmp_path / "local", world["cli"].db_url, cfg)
    had = cpp_builds.seed(cli.cache_dir, HEAD_BUILDS)
    doc, _ = proc_json(
        cli, "prewarm", "--manifest", str(world["base"] / "m.toml"), "--model", "head", "--target", "redis", code=0
    )
    assert [r["ok"] for r in doc["shapes"]] == [True, True, True]
    cpp_builds.keep(HEAD_BUILDS, cli.cache_dir, had)
    cpp_builds.seed(tmp_path / "empty", WORKLOAD_BUILDS)  # no graph: they are in Redis, or compiled
    # a process with an empty local cache finds the head's graphs in Redis
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "prewarm_models.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(
            tmp_path / "empty",
            CACHEMGR_SPOOL_DIR=str(tmp_path / "s"),
            TORCHINDUCTOR_REDIS_URL=url,
            TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
            TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
        ),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counters = json.loads(out.stdout.strip().splitlines()[-1])
    assert counters["fxgraph_cache_hit"] == 3  # the three head shapes; mlp was never prewarmed


def test_a_refused_bundle_is_exit_9_as_prewarm_help_says(fixture_cache, tmp_path, db_url):
    """prewarm --help gives 9 for a bundle that does not match this host; a bundle of another
    torch gave 8 (as a failed shape), a truncated one too. Both are 9 now; the shapes still ran."""
    other = tmp_path / "other.bundle"
    r = Cli(fixture_cache("torch-2.14.1-cpu"), db_url).proc("export", "--out", str(other), timeout=900, env=ENV)
    assert r.returncode == 0, r.stderr
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "m"\nfactory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'
        'shapes = [["f32[2,16]"]]\n'
    )
    cli = Cli(tmp_path / "cache", db_url)
    prewarm = ("prewarm", "--manifest", str(tmp_path / "m.toml"), "--bundle")
    doc, err = proc_json(cli, *prewarm, str(other), code=9)
    assert "none of its 8 graphs would hit here" in doc["failures"][0] and [s["ok"] for s in doc["shapes"]] == [True]
    truncated = tmp_path / "truncated.bundle"
    truncated.write_bytes(other.read_bytes()[:-100])
    r = cli(*prewarm, str(truncated), code=9)  # said before torch starts
    assert (
        r.stderr == f"cachemgr: error: bundle {truncated}: payload does not match its header (truncated or corrupt)\n"
    )


def test_shapes_of_an_empty_model_name_is_an_unknown_model(tmp_path, db_url):
    """`shapes --model ''` printed "no shapes recorded" with exit 0; any other unknown model is 3."""
    (tmp_path / "spool").mkdir()
    (tmp_path / "config.toml").write_text(f'spool_dir = "{tmp_path / "spool"}"\n')
    cli = ConfCli(tmp_path / "cache", db_url, tmp_path / "config.toml")
    for name in ("", "nope"):
        r = cli("shapes", "--model", name, code=3)
        assert r.stderr.count("\n") == 1 and r.stdout == "", r.stderr


def test_export_leaves_out_what_import_would_refuse_and_says_so(fixture_cache, tmp_path, db_url):
    """One fxgraph folder whose name is not UTF-8 made torch's save fail whole ("nothing to
    export", exit 8), and a .best_config in the trash made a bundle `import` refuses: each is
    left out, named, and the rest of the cache exported."""
    root = fixture_cache("torch-2.14.1-cpu")
    odd = root / "fxgraph" / os.fsdecode(b"f\xff") / os.fsdecode(b"f\xffbad")
    odd.mkdir(parents=True)
    (odd / "entry").write_bytes(b"not a pickle")
    (root / ".cachemgr-trash" / "ab").mkdir(parents=True)
    (root / ".cachemgr-trash" / "ab" / ("a" * 52 + ".best_config")).write_text('{"XBLOCK": 8}')
    out = tmp_path / "cache.bundle"
    doc, err = proc_json(Cli(root, db_url), "export", "--out", str(out), code=0)
    assert "cachemgr: left out 2 cache file(s) that import would refuse" in err, err
    b = bundle.read(str(out))
    assert b.header["artifacts"]["inductor"] >= 8 and bundle.unsafe_keys(bundle.artifacts(b.payload)) == []
