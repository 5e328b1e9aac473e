"""Fuzzing the readers with mutated real cache entries: no exception escapes, nothing a pickle names
is ever run, and a parse worker stays within the memory bound cachemgr states
(cachemgr.index.workers.WORKER_MEMORY above its start-up size)."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.index import describe
from cachemgr.index.workers import WORKER_MEMORY, Job, Pool


def _real_entries(root: Path) -> list[tuple[str, bytes]]:
    """(kind, bytes) of the fixture's smaller fxgraph and AOTAutograd entries."""
    out = []
    for kind in ("fxgraph", "aotautograd"):
        for p in sorted((root / kind).rglob("*")):
            if p.is_file() and p.stat().st_size < 300_000:
                out.append((kind, p.read_bytes()))
    return out


def _payload(canary: Path) -> bytes:
    """Opcodes that, run by a real unpickler, would call os.system and create `canary`."""
    cmd = f"touch {canary}".encode()
    return b"\x8c\x02os\x8c\x06system\x93" + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R"  # TUPLE1, REDUCE


def mutate(data: bytes, ops: list[tuple[int, int, int]], payload: bytes) -> bytes:
    buf = bytearray(data)
    for op, pos, val in ops:
        if not buf:
            break
        i = pos % len(buf)
        if op == 0:
            buf[i] = val & 0xFF  # overwrite a byte
        elif op == 1:
            del buf[i : i + 1 + val % 64]  # drop a run
        elif op == 2:
            buf[i:i] = bytes([val & 0xFF]) * (1 + val % 8)  # insert
        elif op == 3:
            buf[i:i] = payload  # splice in a call of os.system
        elif op == 4:
            buf[i:i] = b"r" + struct.pack("<I", (val * 7919) & 0xFFFFFFFF)  # LONG_BINPUT: a huge memo index
        else:
            del buf[i:]  # truncate
    return bytes(buf)


@pytest.fixture(scope="module")
def fuzz_root(gpu_cache_master, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz") / "cache"
    (root / "fxgraph" / "ab").mkdir(parents=True)
    return root, _real_entries(gpu_cache_master)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    pick=st.integers(min_value=0),
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(min_value=0), st.integers(0, 1 << 20)), min_size=1, max_size=6
    ),
)
def test_mutated_entries_never_escape_the_reader(fuzz_root, pick, ops, tmp_path_factory):
    root, entries = fuzz_root
    kind, data = entries[pick % len(entries)]
    canary = root.parent / "executed"
    blob = mutate(data, ops, _payload(canary))
    key = "fxgraph/ab/f" + "a" * 51 + "/entry" if kind == "fxgraph" else "aotautograd/a" + "b" * 51 + "/entry"
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    pool = _pool()
    [(job, out)] = list(
        pool.run([Job(0, 1, str(root), kind, key, key.split("/")[-2])], lambda job, why: describe.failed(why))
    )
    assert isinstance(out, describe.Described)
    assert isinstance(out.row.get("corrupt"), (str, type(None)))
    assert not canary.exists(), "a pickle ran code"
    for w in pool.idle:
        assert _peak_rss(w.proc.pid) < _START_RSS + WORKER_MEMORY


_POOL: list[Pool] = []
_START_RSS = 64 << 20  # a worker's own start-up size, generously


def _pool() -> Pool:
    if not _POOL:
        _POOL.append(Pool(1))
    return _POOL[0]


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def test_the_payload_would_run_under_a_real_unpickler(tmp_path):
    """The fuzzer's payload is real: plain pickle runs it (so the test above can fail)."""
    canary = tmp_path / "ran"
    pickle.loads(b"\x80\x04" + _payload(canary) + b".")  # proving the payload works
    assert canary.exists()
    os.unlink(canary)


def teardown_module() -> None:
    for p in _POOL:
        p.close()


# -- spool lines ------------------------------------------------------------------------------------


def _real_line() -> bytes:
    from test_hostile_inputs import spool_line

    return spool_line().rstrip(b"\n")


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(min_value=0), st.integers(0, 1 << 20)), min_size=1, max_size=8
    )
)
def test_mutated_spool_lines_are_read_or_refused_with_a_reason(ops):
    """A mutated spool line is either a line the ingester takes or a LineError saying why: no
    other exception, whatever the bytes (the payload splice inserts a pickle call: never run)."""
    from cachemgr.prewarm import spool

    raw = mutate(_real_line(), ops, b'{"a": [[[[[' * 50 + "\ud800".encode("utf-8", "surrogatepass"))
    try:
        doc = spool.parse_line(raw)
    except spool.LineError as e:
        assert str(e)
    else:
        assert isinstance(doc, dict) and isinstance(doc["model"], str)


def test_a_spool_file_of_mutated_lines_ingests(tmp_path):
    """A whole file of mutated lines (and good ones) goes through `ingest`: good lines land, bad
    ones are reported, nothing is left behind."""
    import random

    from cachemgr.index.db import Database
    from cachemgr.prewarm import spool

    rng = random.Random(3)
    good = _real_line()
    lines = []
    for i in range(300):
        ops = [(rng.randrange(6), rng.randrange(1 << 20), rng.randrange(1 << 20)) for _ in range(rng.randrange(1, 5))]
        lines.append(good if i % 10 == 0 else mutate(good, ops, b"\x00\xff{{{"))
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (spool_dir / "w-1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    db = Database(f"sqlite:///{tmp_path / 'index.db'}")
    r = spool.ingest(db, str(spool_dir))
    assert r.lines >= 30 and r.bad_lines
    assert not any(spool_dir.iterdir()), "the file is consumed, not left .ingesting"


def test_hash_component_lines_cost_what_is_kept_of_them(monkeypatch):
    """A hostile entry's debug lines (one megabyte string referenced thousands of times, with no
    `] ` or `:` where a header has one, or named `gm`) are read at the cost of the few hundred
    characters kept of each: a 1 MB pickle of them took 18-30 s of a worker's CPU, every search
    and copy running over the whole string. Counted in characters handed to `clean`, not seconds."""
    from cachemgr.parse import components

    handed = [0]
    cleaned = components.clean

    def counting(s: str, *args) -> str:
        handed[0] += len(s)
        return cleaned(s, *args)

    monkeypatch.setattr(components, "clean", counting)
    big = "x" * (1 << 20)
    lines = [
        *[big] * 5000,  # no header at all
        *["[" + "h" * 64 + "] " + big] * 5000,  # no colon after the name
        *["[" + "h" * 64 + "] inductor_config[x]: " + big] * 5000,  # a value far over what is kept
        *["[" + "h" * 64 + "] gm: " + big] * 5000,  # the graph code, kept whole: once, not 5,000 times
    ]
    got = {c.name: c for c in components.components_of(lines)}
    assert set(got) == {"inductor_config[x]", "gm"}
    assert got["inductor_config[x]"].value == "x" * components.VALUE_CHARS and len(got["gm"].value) == len(big)
    assert handed[0] < 4 * len(big)  # (it was 5,000 copies' worth of each)


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def test_stand_in_classes_are_shared_within_bounds_and_no_load_changes_them(monkeypatch):
    """Stand-in classes are shared by every load of a process (making them was half of a graph
    entry's unpickling), so: a hostile load cannot change one another load gets (BUILD or SETITEM
    on the class itself fails), a long name is never kept, and the shared set stops growing at
    MAX_SHARED however many names entries make up."""
    from cachemgr.parse import unpickle

    monkeypatch.setattr(unpickle, "_SHARED", {})  # (this process's other tests keep theirs)
    cfg = _global("torch._inductor.output_code", "CompiledFxGraph")
    for hostile in (
        cfg + b"}S'pickled_module'\nS'evil'\nsb.",  # BUILD with a dict, on the class
        cfg + b"S'pickled_name'\nS'evil'\ns.",  # SETITEM on the class
        cfg + b"(S'pickled_name'\nS'evil'\nS'state'\nS'evil'\nu.",  # SETITEMS on the class
    ):
        try:
            unpickle.safe_load(hostile)
        except Exception:  # noqa: BLE001, S110 - whether the load fails is not the point
            pass
    obj = unpickle.safe_load(cfg + b")\x81.")  # NEWOBJ of no args
    assert (type(obj).pickled_module, type(obj).pickled_name) == ("torch._inductor.output_code", "CompiledFxGraph")
    assert obj.state is None and obj.args == ()
    assert type(unpickle.safe_load(cfg + b")\x81.")) is type(obj)  # (shared: else this test proves nothing)

    long = "m" * unpickle.MAX_SHARED_NAME
    a, b = unpickle.safe_load(_global(long, "X") + b")\x81."), unpickle.safe_load(_global(long, "X") + b")\x81.")
    assert type(a) is not type(b) and (long, "X") not in unpickle._SHARED

    per_load = unpickle.MAX_CLASSES - 1
    for n in range(2 * unpickle.MAX_SHARED // per_load + 1):  # entries naming made-up classes by the thousand
        names = b"".join(_global(f"fuzz{n}", f"C{i}") + b"0" for i in range(per_load))  # (POP each)
        unpickle.safe_load(names + b"N.")
        assert len(unpickle._SHARED) <= unpickle.MAX_SHARED
    real = _global("torch.utils._ordered_set", "OrderedSet") + b")\x81."
    assert type(unpickle.safe_load(real)) is type(unpickle.safe_load(real))  # (a real class is still shared)

    deep = cfg * 100_000 + cfg + b")\x81" + b"\x85R" * 100_000 + b"."  # each made of the one below
    obj = unpickle.safe_load(deep)
    assert str(obj) == repr(obj) == "<stand-in torch._inductor.output_code.CompiledFxGraph>"  # (not its args)


def test_a_tree_that_holds_itself_is_searched_in_bounded_memory():
    """An entry whose tree names one list a thousand times inside itself is searched for its
    graphs in bounded memory (each object once): the queue held a thousand copies of the list at
    each of 200,000 visits, 1.6 GB, and the reader raised MemoryError in its worker."""
    import tracemalloc

    from cachemgr.parse import parse_aotautograd

    blob = b"\x80\x02}X\x0b\x00\x00\x00compiled_fw]q\x00(" + b"h\x00" * 100 + b"es."  # (100: 160 MB before)
    tracemalloc.start()
    try:
        p = parse_aotautograd(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert p.refs == [] and peak < 16 << 20, peak


_HEADER = st.sampled_from(["[abc] ", "[" + "h" * 130 + "] ", "[" + "h" * 131 + "] ", "[x]", "", "[] "])
_NAME = st.sampled_from(["torch_version", "torch_versions", "xtorch_version", "gm", "torch_version "])
_LINE = st.builds(
    lambda h, n, colon, v: h + n + colon + v,
    _HEADER,
    _NAME,
    st.sampled_from([":", ": ", "", " :"]),
    st.sampled_from(["", "2.11", "] torch_version: 9", "x" * 300, "\udc80", "a\0b"]),
)


@settings(max_examples=500, deadline=None)
@given(lines=st.lists(st.one_of(_LINE, st.integers(), st.none()), max_size=12))
def test_one_component_is_read_as_every_component_reads_it(lines):
    """`component_named` (an AOT entry's torch version, read from its one line) gives what
    `components_of` gives for that name, whatever the lines hold: the last line of the name wins,
    a name met only inside a value or as another name's prefix is no match."""
    from cachemgr.parse import components

    for name in ("torch_version", "gm"):
        every = next((c for c in components.components_of(lines) if c.name == name), None)
        assert components.component_named(lines, name) == every
