"""explain / diff on real caches: each variant compiled by torch.compile in a fresh process.

One cache dir gets `base` and then variants that each change one thing (tests/programs/
explain_variants.py); `explain` must name exactly that component, and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import PROGRAMS, Builds, subprocess_env

# (variant, program args) in compile order (a pause between: distinct mtimes, the compile order is
# the events' order); train-* compile a forward and a backward graph
RUNS = [
    ("base", ["base"]),
    ("option", ["option"]),
    ("dtype", ["dtype"]),
    ("stride", ["stride"]),
    ("code", ["code"]),
    ("train-base", ["base", "--train"]),
    ("train-option", ["option", "--train"]),
]


def explain_variants(cache_dir, *args: str, builds: Builds | None = None) -> list[dict]:
    """Run explain_variants.py (each variant in a fresh process): the JSON line of each. With
    `builds` (conftest.Builds), the cache dir is given the C++ builds earlier runs with these
    arguments made first (no graph: its fxgraph hits and misses are its own), and this run's are
    kept."""
    label = " ".join(("explain_variants", *args))
    had = builds.seed(cache_dir, label) if builds else set()
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "explain_variants.py"), *args],
        env=subprocess_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    if builds:
        builds.keep(label, cache_dir, had)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def compile_variant(cache_dir, *args: str, builds: Builds | None = None) -> dict:
    """Compile a variant in a fresh process (`base`, `base --train`, ...)."""
    return explain_variants(cache_dir, *args, builds=builds)[-1]


@pytest.fixture(scope="module")
def variants_master(tmp_path_factory, cpp_builds):  # compiles: every test that uses it is in the slow tier
    """Every variant compiled in a fresh process of its own, in order, into one cache dir
    (explain_variants.py --each: each process forked from one that has imported torch and
    compiled nothing; the same files as one `python explain_variants.py VARIANT` each)."""
    root = tmp_path_factory.mktemp("explain-cache") / "inductor"
    cpp_builds.seed(root, *(" ".join(("explain_variants", *args)) for _, args in RUNS))
    lines = explain_variants(root, "--each", *(name for name, _ in RUNS), builds=cpp_builds)
    assert [c["variant"] for c in lines] == [name for name, _ in RUNS]
    for name, counters in zip((name for name, _ in RUNS), lines, strict=True):
        # every variant is a real miss: nothing it compiled was in the cache already
        assert counters["fxgraph_cache_hit"] == 0, (name, counters)
        assert counters["fxgraph_cache_miss"] == (2 if name.startswith("train") else 1), (name, counters)
    return root


@pytest.fixture
def variants(variants_master, tmp_path):
    dst = tmp_path / "inductor"
    shutil.copytree(variants_master, dst, symlinks=True)
    return dst


def explained(cli) -> dict:
    cli("scan")
    doc = cli.json("explain", "--since", "1d", "--limit", "100")
    assert doc["compiles"] == 9 and len(doc["misses"]) == 9
    return doc


def by_run(doc) -> dict[str, list[dict]]:
    """Misses in compile order, grouped by the run that made them (train runs made two)."""
    out, it = {}, iter(doc["misses"])
    for name, _ in RUNS:
        out[name] = [next(it) for _ in range(2 if name.startswith("train") else 1)]
    return out


def changes(miss) -> list[dict]:
    return [c for cs in miss["diff"]["groups"].values() for c in cs]


@pytest.mark.slow
def test_each_variant_names_exactly_its_component(variants, cli_for):
    cli = cli_for(variants)
    runs = by_run(explained(cli))
    base = runs["base"][0]
    assert base["verdict"] == "first" and base["diff"] is None

    expected = {
        "option": ("options", "inductor_config[epilogue_fusion]", [], "True", "False"),
        "dtype": ("inputs", "example_inputs[0]", ["dtype"], "float32[8, 16]", "float64[8, 16]"),
        "stride": ("inputs", "example_inputs[0]", ["stride"], "stride (16, 1)", "stride (1, 8)"),
        "code": ("code", "gm", [], "(graph code)", "(graph code)"),
    }
    for name, (group, component, fields, a, b) in expected.items():
        (m,) = runs[name]
        assert m["verdict"] == "recompile", (name, m)
        assert m["nearest"][0]["key"] == base["key"], name  # compared with base, not a sibling variant
        assert m["nearest"][0]["same_code"] is (name != "code")
        (c,) = changes(m)  # exactly one component differs, nothing derived
        assert (c["group"], c["name"], c["fields"], c["derived"]) == (group, component, fields, None), (name, c)
        assert a in c["a"] and b in c["b"], (name, c)
        assert m["nearest"][0]["differ"] == 1 and list(m["diff"]["groups"]) == [group]
        assert len(m["causes"]) == 1

    assert runs["option"][0]["causes"] == ["inductor_config[epilogue_fusion] changed"]
    assert runs["dtype"][0]["causes"] == ["an input's dtype changed"]
    assert runs["stride"][0]["causes"] == ["an input's stride changed"]
    code = runs["code"][0]
    assert code["causes"] == ["the graph code changed"]
    lines = code["diff"]["code_diff"]
    assert "-    cos = torch.ops.aten.cos.default(add);  add = None" in lines
    assert "+    tanh = torch.ops.aten.tanh.default(add);  add = None" in lines


@pytest.mark.slow
def test_training_graphs_compare_forward_with_forward(variants, cli_for):
    runs = by_run(explained(cli_for(variants)))
    fwd, bwd = runs["train-base"]
    # a training forward is another graph than the inference one; its backward another again
    assert fwd["verdict"] == bwd["verdict"] == "new-graph"
    assert "a training graph" in fwd["note"] and "a backward graph" in bwd["note"]
    for m, twin in zip(runs["train-option"], runs["train-base"], strict=True):
        assert m["verdict"] == "recompile" and m["nearest"][0]["key"] == twin["key"]
        assert m["nearest"][0]["same_code"] is True
        assert [c["name"] for c in changes(m)] == ["inductor_config[epilogue_fusion]"]


@pytest.mark.slow
def test_summary_one_line_per_cause(variants, cli_for):
    cli = cli_for(variants)
    cli("scan")
    doc = cli.json("explain", "--summary", "--since", "1d")
    assert "misses" not in doc
    counts = {s["cause"]: s["graphs"] for s in doc["summary"]}
    assert counts == {
        "inductor_config[epilogue_fusion] changed": 3,  # the inference graph and the training pair
        "an input's dtype changed": 1,
        "an input's stride changed": 1,
        "the graph code changed": 1,
        "compiled, unlike any earlier graph": 2,
        "compiled for the first time in this cache": 1,
    }
    assert sum(counts.values()) == doc["compiles"] == 9  # each compile counted once
    assert doc["recompiles"] == 6 == sum(s["graphs"] for s in doc["summary"] if s["recompile"])
    text = cli("explain", "--summary", "--since", "1d").stdout
    assert "summary: 9 compiles in the last 1d, 6 recompiles" in text
    assert "3 graphs recompiled because inductor_config[epilogue_fusion] changed" in text
    assert "1 graph recompiled because an input's stride changed" in text
    # stats counts the same compiles and recompiles
    act = cli.json("stats")["activity"]
    assert (act["compiles"], act["recompiles"], act["loaded"]) == (9, 6, 0)


@pytest.mark.slow
def test_diff_command(variants, cli_for):
    cli = cli_for(variants)
    runs = by_run(explained(cli))
    base, dtype, code = runs["base"][0], runs["dtype"][0], runs["code"][0]
    d = cli.json("diff", base["key"], dtype["key"])
    assert d["differ"] == 1 and d["causes"] == ["an input's dtype changed"] and d["shared"] > 100
    # short forms and graph keys name the same entries
    assert cli.json("diff", base["short"], dtype["graph_key"])["groups"] == d["groups"]
    assert cli.json("diff", base["key"], base["key"])["same"] is True
    assert "A and B are the same entry" in cli("diff", base["key"], base["key"]).stdout
    out = cli("diff", base["short"], code["short"]).stdout
    assert "1 differs" in out and "the graph code (gm) changed" in out and "+    tanh" in out
    r = cli.proc("diff", base["key"], "fnosuchgraph")
    assert r.returncode == 3 and r.stderr.count("\n") == 1 and "no fxgraph entry 'fnosuchgraph'" in r.stderr
    aot = cli.json("ls", "--kind", "aotautograd")[0]
    r = cli.proc("diff", base["key"], aot["short"])
    assert r.returncode == 2 and "it is a aotautograd entry; only fxgraph entries have hash components" in r.stderr


@pytest.mark.slow
def test_explain_one_graph(variants, cli_for):
    cli = cli_for(variants)
    runs = by_run(explained(cli))
    dtype = runs["dtype"][0]
    doc = cli.json("explain", "--since", "1d", "--graph", dtype["graph_key"])
    assert [m["key"] for m in doc["misses"]] == [dtype["key"]]
    out = cli("explain", "--since", "1d", "--graph", dtype["short"]).stdout
    assert "example_inputs[0]: dtype changed" in out and "float64[8, 16]" in out
    assert "no entry 'fnosuchgraph'" in cli("explain", "--graph", "fnosuchgraph", code=3).stderr
    assert "no compiles in the last 1s" in cli("explain", "--since", "1s", "--graph", dtype["short"]).stdout


@pytest.mark.slow
def test_explain_model_through_recorded_shapes(variants, cli_for, db_url):
    cli = cli_for(variants)
    runs = by_run(explained(cli))
    r = cli.proc("explain", "--model", "ranker")
    assert r.returncode == 3 and "no recorded shapes for model 'ranker'" in r.stderr and "Traceback" not in r.stderr
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    with engine.begin() as conn:  # what cachemgr.record writes: one row per call signature seen
        conn.execute(
            text(
                "INSERT INTO shapes (model, signature_hash, signature, spec, options, count, first_seen, "
                "last_seen) VALUES ('ranker', 'x', '(f64[8,16])', '[]', '{}', 1, 0, 0)"
            )
        )
    engine.dispose()
    doc = cli.json("explain", "--since", "1d", "--model", "ranker")
    assert [m["key"] for m in doc["misses"]] == [runs["dtype"][0]["key"]]


@pytest.mark.slow
def test_same_key_new_guard_set(variants, cli_for):
    """A second entry under one graph key (another guard set) has the same components."""
    cli = cli_for(variants)
    runs = by_run(explained(cli))
    key = runs["option"][0]["key"]
    src = variants / key
    twin = src.with_name("zz" + src.name[2:])
    shutil.copy2(src, twin)
    os.utime(twin, (time.time(), time.time()))
    cli("scan")
    (m,) = cli.json("explain", "--since", "1d", "--graph", runs["option"][0]["graph_key"])["misses"][-1:]
    assert m["verdict"] == "guards" and m["nearest"][0]["key"] == key
    assert "another guard set" in cli("explain", "--since", "1d", "--summary").stdout


def test_gpu_fixture_readable_in_80_columns(gpu_cache, cli_for):
    cli = cli_for(gpu_cache)
    cli("scan")
    r = cli.proc("explain", "--since", "3650d", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) > 20
    too_wide = [line for line in lines if len(line) > 80]
    assert not too_wide, too_wide
    # the fixture: an MLP training step (static, then dynamic batch) and a resnet18 (static, dynamic)
    assert "3 graphs recompiled because input shapes became dynamic" in r.stdout
    assert "shape became dynamic" in r.stdout and "cuda:0" in r.stdout
    doc = cli.json("explain", "--since", "3650d")
    assert doc["compiles"] == 6
    dyn = [m for m in doc["misses"] if m["verdict"] == "recompile"]
    for m in dyn:
        causes = [c for cs in m["diff"]["groups"].values() for c in cs if not c["derived"]]
        assert causes and all(c["fields"] == ["shape (dynamic)"] for c in causes), causes
    a, b = dyn[0]["nearest"][0]["short"], dyn[0]["short"]
    r = cli.proc("diff", a, b, env={"COLUMNS": "80"})
    assert r.returncode == 0 and all(len(line) <= 80 for line in r.stdout.splitlines()), r.stdout
    assert "shape became dynamic" in r.stdout
    for command in ("diff", "explain"):
        r = cli.proc(command, "--help", env={"COLUMNS": "80"})
        assert r.returncode == 0 and "Example:" in r.stdout
        assert all(len(line) <= 80 for line in r.stdout.splitlines()), r.stdout


def test_parse_input_and_groups():
    from cachemgr.explain import changed_fields, group_of, parse_input

    cut = (
        "TensorMetadata(dtype=torch.float32, shape=torch.Size([s33, 256]), stride=(256, 1), device=device("
        "type='cuda', index=0), layout=torch.strided, memory_format=None, storage_offset=0, storage_bytes=None, "
    )
    f = parse_input(cut[:200])  # stored values are cut at 200 characters
    assert (f["dtype"], f["shape"], f["stride"], f["device"]) == ("float32", "[s33, 256]", "(256, 1)", "cuda:0")
    assert "storage_bytes" not in f  # the cut-off last field is dropped, not misread
    static = dict(f, shape="[8, 256]", memory_format="torch.contiguous_format")
    assert changed_fields(static, f) == ["shape (dynamic)"]
    assert changed_fields(dict(f, device="cuda:1"), f) == ["device"]
    assert parse_input("('s33',)") == {"scalar": "s33"}
    names = (
        "gm",
        "example_inputs[3]",
        "fx_kwargs[is_backward]",
        "inductor_config[debug]",
        "torch_version",
        "system_info[device]",
        "cuda_matmul_settings",
        "post_grad_custom_pre_pass",
    )
    assert [group_of(n) for n in names] == [
        "code",
        "inputs",
        "options",
        "options",
        "environment",
        "environment",
        "environment",
        "options",
    ]


def test_not_recorded_is_said_never_guessed(fixture_cache, cli_for, tmp_path):
    """torch 2.5.1 records no hash components: diff says so and compares only what both record;
    explain says why is not recorded. Never 'same hash components' for such entries."""
    import re

    from cachemgr.vocab import LOSS, Kind

    cli = cli_for(fixture_cache("mixed-2.5.1-2.13.0-cpu"))
    cli("scan")
    fx = cli.json("ls", "--kind", "fxgraph")
    old = [e for e in fx if e["unrecorded"] and "hash components" in e["unrecorded"]]
    new = [e for e in fx if not e["unrecorded"]]
    assert old and new
    shown = cli("show", old[0]["short"]).stdout
    assert "not recorded  hash components, torch version string" in shown
    # show also says what losing it costs, and what eviction would do with it: no limit is set ...
    assert f"if lost {LOSS[Kind.FXGRAPH]}" in " ".join(shown.split())
    assert re.search(r"^eviction +not planned: no limit is set\b", shown, re.M), shown
    # ... and under a size cap of 0 it goes, as `evict --dry-run` plans it
    config = tmp_path / "config.toml"
    config.write_text('max_size = "0"\ngrace = "0s"\n')
    planned = {
        e["key"]: e["reason"] for e in cli.json("evict", "--max-size", "0", "--grace", "0", "--dry-run")["entries"]
    }
    shown = cli("--config", str(config), "show", old[0]["short"]).stdout
    assert re.search(rf"^eviction +would be evicted now: {planned[old[0]['key']]}$", shown, re.M), shown
    d = cli.json("diff", old[0]["short"], old[1]["short"])
    assert d["same"] is False and d["not_recorded"] and d["shared"] == 0
    assert all(g == "entry" for g in d["groups"])
    out = cli("diff", old[0]["short"], old[1]["short"]).stdout
    assert "not recorded by A" in out and "same hash components" not in out
    out = " ".join(cli("diff", old[0]["short"], new[0]["short"]).stdout.split())  # as one line: prose wraps
    assert "hash components: not recorded by A (torch " in out and "only what both record is compared" in out
    assert "torch version" in out and "B: 2.13.0+cpu" in out
    doc = cli.json("explain", "--since", "3650d", "--limit", "100")
    verdicts = {m["key"]: m["verdict"] for m in doc["misses"]}
    assert {verdicts[e["key"]] for e in old} <= {"first", "unrecorded", "guards"}
    assert "unrecorded" in verdicts.values()
    assert all(not m["recompile"] for m in doc["misses"] if m["verdict"] == "unrecorded")
    text = " ".join(cli("explain", "--since", "3650d").stdout.split())
    assert "records no hash components, so why it missed is unknown" in text


def test_a_copied_entry_is_loaded_not_compiled(fixture_cache, cli_for):
    """An entry whose bytes the index knew before it appeared (an import, a remote fill, a copy)
    is loaded: no compile, in stats and explain alike."""
    import shutil

    root = fixture_cache("torch-2.13.0-cpu")
    cli = cli_for(root)
    cli("scan")
    before = cli.json("stats", "--window", "3650d")["activity"]
    fx = cli.json("ls", "--kind", "fxgraph")[0]
    other = root.parent / "other"  # the same entry file in another cache of the index
    (other / fx["key"]).parent.mkdir(parents=True)
    shutil.copy2(root / fx["key"], other / fx["key"])
    twin = cli_for(other)
    twin("scan")
    act = twin.json("stats", "--window", "3650d")["activity"]
    assert (act["compiles"], act["loaded"]) == (0, 1), act
    doc = twin.json("explain", "--since", "3650d")
    assert doc["compiles"] == 0 and doc["loaded"] == 1
    assert "1 entries loaded" in twin("explain", "--since", "3650d").stdout
    assert cli.json("stats", "--window", "3650d")["activity"] == before  # the first cache's compiles stay


def test_explain_counts_the_nearest_as_diff_does(fixture_cache, cli_for):
    """explain said '634 components shared, 7 differ' where diff of the same two entries said
    '634 components shared, 2 differ (+3 as a consequence)'."""
    cli = cli_for(fixture_cache("torch-2.13.0-cpu"))
    cli("scan")
    doc = cli.json("explain", "--since", "3650d")
    text = cli("explain", "--since", "3650d").stdout
    pairs = [(m["short"], m["nearest"][0]["short"]) for m in doc["misses"] if m["verdict"] == "recompile"]
    assert pairs
    for key, nearest in pairs:
        counts = cli("diff", nearest, key).stdout.splitlines()[2]
        assert f": {nearest}, {counts}\n" in text, (key, counts)  # "nearest:" or "same graph code:"


def test_a_hand_edited_index_is_read_and_nothing_of_it_reaches_the_terminal_raw(fixture_cache, cli_for, db_url):
    """A set id that is no number (a hand edit; `check` and `explain` sorted it with the others:
    exit 70), a ref stored as a BLOB (compared with text: exit 70), and refs that carry escape
    sequences and a BEL (printed raw by explain's and diff's lines): each is read as what it is,
    and every line printed is escaped."""
    import sqlite3

    cli = cli_for(fixture_cache("torch-2.13.0-cpu"))
    cli("scan")
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as c:
        ids = [i for (i,) in c.execute("SELECT id FROM entries WHERE kind = 'fxgraph' ORDER BY id")]
        c.execute("UPDATE entry_component_sets SET set_id = 'abc' WHERE entry_id = ? AND part = 'options'", (ids[0],))
        c.execute("UPDATE entries SET ref = CAST(ref AS BLOB) WHERE id = ?", (ids[1],))
        c.execute("UPDATE entries SET ref = char(27) || '[2J' || char(7) || ref WHERE id > ?", (ids[1],))
    doc = cli.json("explain", "--since", "3650d", "--limit", "100")
    text = cli("explain", "--since", "3650d", "--limit", "100").stdout
    assert doc["misses"] and "\x1b" not in text and "\x07" not in text and "\\x1b[2J\\x07" in text
    keys = [m["key"] for m in doc["misses"]]
    out = cli("diff", keys[-1], keys[-2]).stdout
    assert "\x1b" not in out and "\x07" not in out


def test_graph_codes_too_far_apart_to_diff_are_said_so_and_a_long_one_is_numbered_whole():
    """Two graph codes of 20,000 repeated lines each (hand made: the graph code is kept to 1 MiB)
    kept `explain`, `diff`, `stats` and the daemon's metrics busy for ever in difflib: what differs
    is diffed only up to a bound, beyond it the diff says why it is missing. A long code with one
    line changed is diffed as difflib diffs it, hunks numbered from the codes' start."""
    import difflib

    from cachemgr.explain import diff_code

    a, b = ["x = y"] * 20_000 + ["z"], ["z"] + ["x = y"] * 20_000
    alike, lines = diff_code(a, b)
    assert lines == ("(the codes differ in 20,001 and 20,001 lines: too many to diff here)",)
    assert 0.99 < alike <= 1.0
    a = [f"line {i}" for i in range(50_000)]
    b = [*a[:30_000], "changed", *a[30_001:]]
    alike, lines = diff_code(a, b)
    assert lines == tuple(difflib.unified_diff(a, b, "A", "B", n=1, lineterm=""))
    assert lines[2] == "@@ -30000,3 +30000,3 @@" and 0.99 < alike < 1
    assert diff_code(a, list(a)) == (1.0, ())
