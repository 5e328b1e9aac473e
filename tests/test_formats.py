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
import re
import shutil
import sys
import tarfile
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


@pytest.mark.parametrize("name", CPU + GPU)
def test_counts_per_kind_equal_find(name, cache_of, cli_for):
    root = cache_of(name)
    _, meta = _archive(name)
    cli = cli_for(root)
    scan = cli.json("scan")
    assert scan["pending"] == 0 and scan["corrupt"] == []
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
