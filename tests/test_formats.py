"""Every cache torch 2.5 to 2.14 writes, read right: the fixture matrix in tests/fixtures.

For each fixture (real caches, made by real torch: tests/fixtures/README.md) the index must count
what `find` counts, kind by kind; extract every field the format records and say which it does
not; leave no C++ build, module or kernel an entry uses looking like an orphan; and, for every
mixed cache of two versions, `purge --stale --keep-torch <one>` must select exactly the other
version's graphs, AOT entries and the builds only they use. What each expectation is checked
against is read here independently (tests/fixtures/stub_pickle.py, and the files themselves).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from stub_pickle import state_of, stub_load  # noqa: E402

CPU = sorted(p.name.removesuffix(".tar.gz") for p in (FIXTURES / "caches").glob("*.tar.gz"))
GPU = sorted(p.name.removesuffix(".tar.gz").removesuffix(".tgz") for p in (FIXTURES / "gpu").glob("*.t*gz"))
SINGLE = [n for n in CPU if n.startswith("torch-")]
MIXED = [n for n in CPU if n.startswith("mixed-")]


def _archive(name: str) -> tuple[Path, dict]:
    for folder in ("caches", "gpu"):
        for ext in (".tar.gz", ".tgz"):
            p = FIXTURES / folder / (name + ext)
            if p.exists():
                return p, json.loads((FIXTURES / folder / (name + ".json")).read_text())
    raise FileNotFoundError(name)


@pytest.fixture(scope="session")
def extracted(tmp_path_factory):
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            archive, _ = _archive(name)
            dst = tmp_path_factory.mktemp("fx-" + name)
            with tarfile.open(archive) as t:
                t.extractall(dst, filter="data")
            dirs = [p for p in dst.iterdir() if p.is_dir()]
            # the shared H200 archive nests its cache one folder down; the others are the cache itself
            done[name] = dirs[0] if len(dirs) == 1 and not (dst / "fxgraph").exists() else dst
        return done[name]

    return get


@pytest.fixture
def cache_of(extracted, tmp_path):
    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(extracted(name), dst, symlinks=True)
        return dst

    return copy


GPU_NAMES = {
    "files": "total files",
    "bytes": "total bytes",
    "fxgraph": "fxgraph files",
    "aotautograd": "aotautograd files",
    "triton_kernel_dirs": "triton kernel dirs",
    "cache/*": "cache/ files",
}


def _find(meta: dict, name: str) -> int:
    """A `find` count from a fixture's sidecar (the CPU and GPU makers wrote two layouts)."""
    if "find" in meta:
        return meta["find"][name]["count"]
    return next(c["value"] for c in meta["counts"] if c["what"] == GPU_NAMES[name])


def _has(meta: dict, name: str) -> bool:
    return name in meta.get("find", {}) or name in GPU_NAMES


# -- counts ---------------------------------------------------------------------------------------


def _scanned(name: str, cache_of, cli_for):
    """A fresh copy of fixture `name`, scanned, nothing pending or corrupt: (root, sidecar, CLI)."""
    root = cache_of(name)
    cli = cli_for(root)
    scan = cli.json("scan")
    assert scan["pending"] == 0 and scan["corrupt"] == []
    return root, _archive(name)[1], cli


@pytest.mark.parametrize("name", CPU + GPU)
def test_counts_per_kind_equal_find(name, cache_of, cli_for):
    _, meta, cli = _scanned(name, cache_of, cli_for)
    stats = cli.json("stats")
    kinds = stats["by_kind"]
    assert (stats["files"], stats["bytes"]) == (_find(meta, "files"), _find(meta, "bytes"))
    assert kinds["fxgraph"]["entries"] == _find(meta, "fxgraph")
    assert kinds["aotautograd"]["entries"] == _find(meta, "aotautograd")
    assert kinds["triton"]["entries"] == _find(meta, "triton_kernel_dirs")
    if _has(meta, "dynamo/*/entry"):
        assert kinds["precompile"]["entries"] == _find(meta, "dynamo/*/entry")
        assert kinds["pgo"]["entries"] == _find(meta, "dynamo/code_state_*.pkl")
    if _has(meta, "cache/*"):
        assert kinds["tuning"]["files"] == _find(meta, "cache/*")
    assert kinds["other"]["entries"] == 0, "every file of a kind torch writes has its kind"


# -- fields -----------------------------------------------------------------------------------------

# What each format records (the README table "Fields per torch version" says the same).
RECORDS = {
    "2.5.1": {"components": False, "version_string": False, "version_hash": False, "aot_time": False},
    "2.6.0": {"components": False, "version_string": False, "version_hash": False, "aot_time": True},
    "2.9.1": {"components": True, "version_string": True, "version_hash": True, "aot_time": True},
    "2.13.0": {"components": True, "version_string": True, "version_hash": True, "aot_time": True},
    "2.14.1": {"components": True, "version_string": False, "version_hash": True, "aot_time": True},
}


def _rows(db_url: str) -> list[dict]:
    """Every index row, read from the database itself (the schema is cachemgr.index.models)."""
    import sqlite3

    conn = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    conn.row_factory = sqlite3.Row
    try:
        rows = [dict(r) for r in conn.execute("SELECT * FROM entries")]
        refs = conn.execute(
            "SELECT e.key, r.kind, r.ref, EXISTS (SELECT 1 FROM entries t WHERE t.kind = r.kind AND "
            "(t.ref = r.ref OR t.alias = r.ref)) FROM entry_refs r JOIN entries e ON e.id = r.entry_id"
        )
        by_key: dict[str, list] = {}
        for key, kind, ref, present in refs:
            by_key.setdefault(key, []).append((kind, ref, bool(present)))
        for r in rows:
            r["refs"] = by_key.get(r["key"], [])
        return rows
    finally:
        conn.close()


@pytest.mark.parametrize("name", SINGLE)
def test_every_recorded_field_is_read_and_the_rest_named(name, cache_of, cli_for, db_url):
    version = name.split("-")[1]
    rec = RECORDS[version]
    root = cache_of(name)
    cli_for(root)("scan")
    rows = _rows(db_url)
    fx = [r for r in rows if r["kind"] == "fxgraph"]
    aot = [r for r in rows if r["kind"] == "aotautograd"]
    assert fx and aot
    for r in fx:
        assert r["graph_key"] == r["key"].split("/")[2]
        assert r["compile_seconds"] and r["compile_seconds"] > 0
        assert bool(r["signature"]) == rec["components"] == bool(r["options_hash"])
        unrecorded = r["unrecorded"] or ""
        assert ("hash components" in unrecorded) == (not rec["components"])
        assert ("torch version string" in unrecorded) == (not rec["version_string"])
        if rec["version_string"]:
            assert r["torch_version"].startswith(version)
        elif not rec["version_hash"]:
            assert r["torch_version"] == version.rsplit(".", 1)[0] + ".*"  # the release family
        assert bool(r["torch_version_hash"]) == rec["version_hash"]
    for r in aot:  # (a bundled AOT entry of caching precompile holds its graphs inline: it names their builds)
        assert r["refs"] and all(present for _, _, present in r["refs"])
        assert ("graph references" in (r["unrecorded"] or "")) == (r["refs"][0][0] != "fxgraph")
        assert bool(r["compile_seconds"]) == rec["aot_time"]
        assert bool(r["torch_version_hash"]) == rec["version_hash"]


# -- nothing in use is an orphan --------------------------------------------------------------------


def _fx_states(root: Path):
    for p in sorted(root.glob("fxgraph/*/*/*")):
        yield p, state_of(stub_load(p.read_bytes()))
    for p in sorted(root.glob("dynamo/*/entry")):  # precompile entries hold their graphs inline
        for st in _inline_graphs(stub_load(p.read_bytes())):
            yield p, st


def _inline_graphs(obj, depth: int = 0):
    st = state_of(obj) if hasattr(obj, "__dict__") else None
    if isinstance(st, dict) and "source_code" in st and "cache_key" in st:
        yield st
        return
    if depth > 12:
        return
    children = []
    if isinstance(st, dict):
        children = list(st.values()) + list(obj.__dict__.get("_args", ()))
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    for c in children:
        yield from _inline_graphs(c, depth + 1)


def _bodies(source: str) -> list[str]:
    return re.findall(r"cpp_pybinding\(\s*\[[^\]]*\],\s*r?'''\n(.*?)'''", source, re.S)


def used_code(root: Path) -> dict[str, set[str]]:
    """Entry file -> the code entries (<2ch>/c<h>) it uses: its wrapper module (cache_key), the C++
    builds whose source starts with a kernel body it embeds, the prefix headers those include."""
    sources = {}
    for p in root.glob("??/c*.cpp"):
        stem = p.name.split(".")[0]
        sources[f"{p.parent.name}/{stem}"] = p.read_text(errors="replace").strip()
    out: dict[str, set[str]] = {}
    for p, st in _fx_states(root):
        rel = p.relative_to(root).as_posix()
        used = out.setdefault(rel, set())
        mod = st.get("cache_key")
        if isinstance(mod, str) and mod.startswith("c"):
            used.add(f"{mod[1:3]}/{mod}")
        for body in _bodies(st.get("source_code") or ""):
            used.update(k for k, text in sources.items() if text.startswith(body.strip()))
            used.update(f"{m[0]}/{m[1]}" for m in re.findall(r'#include "[^"]*/(\w\w)/(c\w+)\.h"', body))
        bundle = state_of(st.get("_triton_bundle")) or {}
        for art in bundle.get("kernel_artifacts") or []:
            h = state_of(art).get("kernel_hash")
            used.update(p.relative_to(root).as_posix() for p in root.glob(f"triton/*/{h}"))
    return out


@pytest.mark.parametrize("name", CPU + GPU)
def test_no_build_module_or_kernel_in_use_is_an_orphan(name, cache_of, cli_for):
    root = cache_of(name)
    cli = cli_for(root)
    cli("scan")
    plan = cli.json("evict", "--max-size", "0", "--grace", "0", "--dry-run")
    orphans = {e["key"] for e in plan["entries"] if e["reason"] == "orphan"}
    used = set().union(*used_code(root).values())
    assert used, "the fixture's graphs use builds, modules or kernels"
    present = {e["key"] for e in cli.json("ls")}
    assert used <= present, sorted(used - present)[:5]
    assert not used & orphans, sorted(used & orphans)[:5]


# -- mixed caches: purge --stale keeps exactly one version ------------------------------------------


def _writer(p: Path, st: dict, fingerprints: dict[str, str]) -> str | None:
    """Which release wrote an fxgraph or AOT entry, read off the entry (docs/formats.md, 6 and 7)."""
    lines = st.get("_fx_graph_cache_debug_lines")
    if lines is None:
        for side in ("compiled_fw", "compiled_bw"):
            info = state_of(st.get(side)).get("fx_graph_cache_info") if st.get(side) is not None else None
            if info:
                lines = info[1]
                break
    for line in lines or []:
        m = re.match(r"\[(\w+)\] torch_version:", line)
        if m:
            return fingerprints.get(m.group(1))
    if "compiled_fw" in st:  # an AOT entry of 2.5/2.6
        return "2.6" if "forward_time_taken_ns" in st else "2.5"
    return "2.6" if "allocated_constant_name" in st else "2.5"


def expected_stale(root: Path, meta: dict, old: str) -> set[str]:
    """The entries of release `old` (2.13, 2.5, ...) and the builds only they use."""
    fps = {fp["torch_version_hash"]: ".".join(v.split(".")[:2]) for v, fp in meta["fingerprint"].items()}
    writer = {}
    for p in [*root.glob("fxgraph/*/*/*"), *root.glob("aotautograd/*/*")]:
        writer[p.relative_to(root).as_posix()] = _writer(p, state_of(stub_load(p.read_bytes())), fps)
    assert None not in writer.values()
    uses = used_code(root)
    old_uses = set().union(*(u for k, u in uses.items() if writer[k] == old))
    new_uses = set().union(*(u for k, u in uses.items() if writer[k] != old))
    twins = _twin_builds(root, meta)
    old_uses = {twins.get((k, old), k) for k in old_uses}
    new_uses = {twins.get((k, w), k) for k in new_uses for w in set(writer.values()) - {old}}
    return {k for k, w in writer.items() if w == old} | (old_uses - new_uses)


def _twin_builds(root: Path, meta: dict) -> dict[tuple[str, str], str]:
    """(a build, a release) -> that release's own twin, where two releases built one kernel body
    under two names: each .so names the torch install it was built against."""
    by_body: dict[str, list[str]] = {}
    for p in root.glob("??/c*.main.cpp"):
        by_body.setdefault(p.read_text(errors="replace").split("// Python bindings", 1)[0].strip(), []).append(
            f"{p.parent.name}/{p.name.split('.')[0]}"
        )
    out = {}
    for builds in by_body.values():
        if len(builds) < 2:
            continue
        for b in builds:
            so = (root / (b + ".main.so")).read_bytes()
            m = re.search(rb"/t(\d)(\d+)(\d)/lib/python[\d.]+/site-packages/torch/include", so)
            release = f"{int(m.group(1))}.{int(m.group(2))}" if m else None
            for other in builds:
                out[(other, release)] = b
    return out


@pytest.mark.parametrize("name", MIXED)
def test_purge_stale_keeps_exactly_one_version(name, cache_of, cli_for):
    _, meta = _archive(name)
    a, b = meta["torch"]
    for keep, drop in ((b, a), (a, b)):
        root = cache_of(name)
        cli = cli_for(root, db=f"sqlite:///{root.parent}/{keep}.db")
        cli("scan")
        old = ".".join(drop.split(".")[:2])
        want = expected_stale(root, meta, old)
        plan = cli.json("purge", "--stale", "--keep-torch", keep.split("+")[0], "--dry-run", "--grace", "0")
        got = {e["key"] for e in plan["entries"]}
        assert got == want, (keep, sorted(got - want)[:6], sorted(want - got)[:6])
        shutil.rmtree(root)


# -- dynamo/: caching precompile and PGO (torch 2.13, 2.14) -----------------------------------------

DYNAMO = [n for n in SINGLE if n.endswith("-dynamo")]


def _dynamo_kind(rel: str) -> str:
    """The kind of a file under dynamo/, by docs/formats.md section 2 (not by cachemgr.layout):
    `dynamo/<sha256 hex>/entry` a precompile entry, `dynamo/code_state_<job>.pkl` a PGO profile,
    and the filelock torch keeps beside it a lock."""
    parts = rel.split("/")
    if len(parts) == 3 and re.fullmatch(r"[0-9a-f]{64}", parts[1]) and parts[2] == "entry":
        return "precompile"
    if len(parts) == 2 and re.fullmatch(r"code_state_.+\.pkl", parts[1]):
        return "pgo"
    if len(parts) == 2 and re.fullmatch(r"code_state_.+\.pkl\.lock", parts[1]):
        return "lock"
    raise AssertionError(f"{rel}: a file under dynamo/ that docs/formats.md does not name")


def _dynamo_files(root: Path) -> dict[str, str]:
    """Every file under dynamo/ on disk -> its kind."""
    return {
        p.relative_to(root).as_posix(): _dynamo_kind(p.relative_to(root).as_posix())
        for p in sorted((root / "dynamo").rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("name", DYNAMO)
def test_dynamo_entries_are_indexed_by_kind(name, cache_of, cli_for):
    root, meta, cli = _scanned(name, cache_of, cli_for)
    on_disk = _dynamo_files(root)
    kinds = list(on_disk.values())
    assert kinds.count("precompile") == _find(meta, "dynamo/*/entry") > 0
    assert kinds.count("pgo") == _find(meta, "dynamo/code_state_*.pkl") > 0
    assert len(on_disk) == _find(meta, "dynamo/*")

    # every file under dynamo/ is an entry of its own, of its kind (none `other`), whole
    entries = {e["key"]: e for e in cli.json("ls") if e["key"].startswith("dynamo/")}
    assert {k: e["kind"] for k, e in entries.items()} == on_disk
    for key, e in entries.items():
        assert (e["files"], e["bytes"]) == (1, (root / key).stat().st_size), key
        assert e["corrupt"] is None and e["parsed"], key
    by_kind = cli.json("stats")["by_kind"]
    assert by_kind["precompile"]["entries"] == by_kind["precompile"]["files"] == kinds.count("precompile")
    assert by_kind["pgo"]["entries"] == by_kind["pgo"]["files"] == kinds.count("pgo")
    assert by_kind["other"]["entries"] == 0


_AOT_TIMES = ("forward_time_taken_ns", "backward_time_taken_ns")
_INTS = ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG")


def _aot_time_ns(data: bytes) -> int:
    """The sum of every `forward_time_taken_ns` and `backward_time_taken_ns` value in a pickle, read
    off its opcode stream (pickletools: nothing is unpickled). A field name is a string pushed, or
    fetched back from the memo (a repeated name is stored once), and its value the int pushed next."""
    import pickletools

    memo: dict[int, object] = {}
    last: object = None  # the value the previous opcode pushed (for MEMOIZE / PUT)
    field: str | None = None  # a time field's name was just pushed: its value comes next
    total = 0
    for op, arg, _ in pickletools.genops(data):
        if op.name == "FRAME":
            continue
        if op.name == "MEMOIZE":
            memo[len(memo)] = last
            continue
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = last
            continue
        value = memo.get(int(arg)) if op.name in ("GET", "BINGET", "LONG_BINGET") else arg
        if field is not None and op.name in _INTS:
            total += value
        field = value if isinstance(value, str) and value in _AOT_TIMES else None
        last = value
    return total


class _Version(str):
    """Pickled as torch.torch_version.TorchVersion is: a str subclass, NEWOBJ (protocol 2+)."""


class _Reduced:
    """Pickled as torch.utils._ordered_set.OrderedSet is: REDUCE, `cls(items)`."""

    def __init__(self, items=()):
        self.items = list(items)

    def __reduce__(self):
        return (type(self), (self.items,))


class _KwOnly:
    """Pickled with NEWOBJ_EX (protocol 4+): `cls.__new__(cls, *args, **kwargs)`."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __getnewargs_ex__(self):
        return ("2.14.1", 7), {"flag": True}


def test_the_reader_keeps_constructor_args_of_every_construction():
    """REDUCE (`cls(*args)`), NEWOBJ and NEWOBJ_EX (`cls.__new__(cls, *args)`): the stand-in keeps
    the positional args whichever built it, and runs nothing of the class."""
    import pickle
    import pickletools

    from cachemgr.parse.unpickle import Stub, safe_load

    for obj, protocol, opcode, args in (
        (_Version("2.14.1+cu130"), 2, "NEWOBJ", ("2.14.1+cu130",)),
        (_KwOnly(), 4, "NEWOBJ_EX", ("2.14.1", 7)),
        (_Reduced(["cpu"]), 2, "REDUCE", (["cpu"],)),
    ):
        data = pickle.dumps(obj, protocol=protocol)
        assert opcode in {op.name for op, _, _ in pickletools.genops(data)}
        got = safe_load(data)
        assert isinstance(got, Stub) and type(got).pickled_name == type(obj).__name__
        assert got.args == args
    # keyword args are dropped whatever they are (keys no call takes: `{1: 2}`, `{"cls": 1}`)
    for kwargs in (b"}K\x01K\x02s", b"}\x8c\x03clsK\x01s"):
        got = safe_load(b"\x80\x04cm\nX\n)" + kwargs + b"\x92.")
        assert isinstance(got, Stub) and got.args == () and got.state is None


def test_the_options_hash_is_the_one_indexes_hold(gpu_cache_master):
    """An entry's options hash, now taken from its options part's digest, is the sha256 over its
    options components' sorted `name=hash` pairs that indexes written before hold (and compare)."""
    import hashlib

    from cachemgr.parse import parse_fxgraph
    from cachemgr.vocab import Part

    entries = [p for p in (gpu_cache_master / "fxgraph").rglob("*") if p.is_file()]
    assert entries
    for path in entries:
        p = parse_fxgraph(path.read_bytes())
        pairs = sorted(c.name + "=" + c.hash for c in p.components if c.part == Part.OPTIONS)
        assert pairs and p.options_hash == hashlib.sha256("\n".join(pairs).encode()).hexdigest()[:16]


def test_symbols_are_numbered_per_entry_however_often_an_input_was_read():
    """An input's text is read once per distinct value (then kept); its symbols are still numbered
    in each entry's own order (s77 is s0 in one entry and s1 in the next)."""
    from cachemgr.signatures import entry_signature

    def tensor(shape: str, stride: str) -> str:
        return (
            f"TensorMetadata(dtype=torch.float32, shape=torch.Size([{shape}]), stride=({stride}), "
            "device=device(type='cuda', index=0), layout=torch.strided, requires_grad=True)"
        )

    a = [(2, tensor("8", "1")), (0, tensor("s77, 32", "32, 1")), (1, "s5")]
    b = [(0, "s5"), (1, tensor("s77, 32", "32, 1"))]
    for _ in range(2):  # (the second time from what was kept the first)
        assert entry_signature(a) == "f32[s0, 32](32, 1)cuda:0 grad; s1; f32[8](1)cuda:0 grad"
        assert entry_signature(b) == "s0; f32[s1, 32](32, 1)cuda:0 grad"
        assert entry_signature([(0, "()"), (1, "7")]) == "?; 7"


@pytest.mark.parametrize("name", DYNAMO)
def test_a_precompile_entry_names_its_torch(name, cache_of, cli_for):
    """Its `_DynamoCacheEntry.system_info.torch_version` holds the version string (docs/formats.md,
    section 2): on 2.14 the only one any entry stores. And it records its compile time: the
    forward and backward times of the AOT results it holds inline."""
    root, meta, cli = _scanned(name, cache_of, cli_for)
    pre = cli.json("ls", "--kind", "precompile")
    assert len(pre) == _find(meta, "dynamo/*/entry")
    assert {e["key"]: e["torch_version"] for e in pre} == {e["key"]: meta["torch"][0] for e in pre}
    assert all("torch version string" not in (e["unrecorded"] or "") for e in pre)
    assert all("compile time" not in (e["unrecorded"] or "") for e in pre)
    for e in pre:
        want = _aot_time_ns((root / e["key"]).read_bytes()) / 1e9
        assert want > 0 and e["compile_seconds"] == pytest.approx(want, rel=1e-9), e["key"]


def _plan(cli, *args: str) -> tuple[dict[str, dict], dict[str, str]]:
    """An `evict --dry-run` that must evict (max_size 0): (planned key -> entry, kept key -> why)."""
    plan = cli.json("evict", "--max-size", "0", "--dry-run", *args)
    assert plan["dry_run"] and plan["evicted"] == len(plan["entries"]) > 0
    return {e["key"]: e for e in plan["entries"]}, {s["key"]: s["reason"] for s in plan["skipped"]}


@pytest.mark.parametrize("name", DYNAMO)
def test_dynamo_entries_in_an_evict_dry_run(name, cache_of, cli_for):
    root = cache_of(name)
    old = time.time() - 2 * 86400
    for p in root.rglob("*"):  # nothing used lately (a copy's atime is now) ...
        os.utime(p, (old, old), follow_symlinks=False)
    cli = cli_for(root)
    cli("scan")
    heads = {k: kind for k, kind in _dynamo_files(root).items() if kind in ("precompile", "pgo")}
    pgo = next(k for k, kind in heads.items() if kind == "pgo")
    pre = sorted(k for k, kind in heads.items() if kind == "precompile")
    assert len(pre) >= 3

    # Nothing names a precompile entry or a PGO profile, and neither is a kind that is an orphan
    # when nothing names it (code, triton, autotune: policy.Graph.is_orphan) or that a graph
    # writes again (recreatable): each heads a group of its own, which lru takes under the size
    # cap, with reason `size`. Nothing is kept.
    planned, kept = _plan(cli, "--grace", "0")
    assert kept == {}
    assert {k: (planned[k]["kind"], planned[k]["reason"]) for k in heads if k in planned} == {
        k: (kind, "size") for k, kind in heads.items()
    }
    assert all(planned[k]["bytes"] == (root / k).stat().st_size for k in heads)

    # ... but a pinned one is kept as `pinned`, one used within the grace period as `grace`, and
    # the others still go for `size`
    cli("pin", pgo)
    cli("pin", pre[0])
    os.utime(root / pre[1])  # read and written now
    planned, kept = _plan(cli, "--grace", "1h")
    assert {k: kept[k] for k in heads if k in kept} == {pgo: "pinned", pre[0]: "pinned", pre[1]: "grace"}
    assert {k: planned[k]["reason"] for k in heads if k in planned} == {k: "size" for k in pre[2:]}


@pytest.mark.parametrize("name", DYNAMO)
def test_a_pgo_profile_is_kept_while_its_lock_is_held(name, cache_of, cli_for):
    import fcntl

    root, _, cli = _scanned(name, cache_of, cli_for)
    pgo = next(k for k, kind in _dynamo_files(root).items() if kind == "pgo")
    fd = os.open(root / (pgo + ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as torch's pgo.put_local_code_state holds it while it writes
        planned, kept = _plan(cli, "--grace", "0")
    finally:
        os.close(fd)
    assert pgo not in planned and kept.get(pgo) == "lock held"


def _strings(doc, key: str = "") -> list[tuple[str, str]]:
    """Every (key, string value) pair anywhere in a JSON document."""
    if isinstance(doc, dict):
        return [kv for k, v in doc.items() for kv in _strings(v, k)]
    if isinstance(doc, list):
        return [kv for v in doc for kv in _strings(v, key)]
    return [(key, doc)] if isinstance(doc, str) else []


@pytest.mark.parametrize("name", DYNAMO)
def test_show_explains_a_dynamo_entry(name, cache_of, cli_for, tmp_path):
    from cachemgr.vocab import LOSS, Kind

    root, _, cli = _scanned(name, cache_of, cli_for)
    config = tmp_path / "config.toml"
    config.write_text('max_size = "0"\ngrace = "0s"\n')  # the limits of the dry run, for `show` too
    planned, _ = _plan(cli, "--grace", "0")
    listed = cli.json("ls")
    shorts = {e["key"]: e["short"] for e in listed}
    refs = {e["key"]: e["ref"] for e in listed}
    files = _dynamo_files(root)
    for kind in (Kind.PRECOMPILE, Kind.PGO):
        key = next(k for k, v in files.items() if v == kind)
        reason = planned[key]["reason"]
        assert reason == "size"
        for form in (key, shorts[key], refs[key]):  # every form a command prints names it
            out = cli("--config", str(config), "show", form).stdout
            assert re.search(rf"^key\s+{re.escape(key)}$", out, re.M), out
            assert re.search(rf"^kind\s+{kind}$", out, re.M), out
            text = " ".join(out.split())  # (a long value wraps)
            assert LOSS[kind] in text, out
            assert "evict" in text and re.search(rf"\b{reason}\b", text), out
        doc = cli.json("--config", str(config), "show", key)
        assert (doc["key"], doc["kind"]) == (key, kind)
        values = _strings(doc)
        assert LOSS[kind] in [v for _, v in values], doc
        assert reason in [v for k, v in values if "reason" in k], doc
