"""cachemgr.record and the spool ingest: real torch.compile (eager backend: no Inductor compile
needed to see signatures), real spool files, a real SQLite index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest

torch = pytest.importorskip("torch")

import cachemgr.record as record  # noqa: E402
from cachemgr.index.db import Database  # noqa: E402
from cachemgr.prewarm.spool import TAKEN, ingest, list_shapes  # noqa: E402
from tests.conftest import REPO, subprocess_env  # noqa: E402


def spool_lines(d) -> list[dict]:
    out = []
    for p in sorted(os.listdir(d)):
        with open(os.path.join(d, p)) as f:
            out += [json.loads(x) for x in f if x.strip()]
    return out


@pytest.fixture
def spool(tmp_path):
    return record.Spool(str(tmp_path / "spool"))


@pytest.mark.slow  # torch.compile in a real process
def test_module_records_each_distinct_signature_once(spool, tmp_path):
    lin = torch.nn.Linear(4, 2)
    m = record.compile(lin, name="lin", spool=spool, backend="eager")
    assert isinstance(m, torch.nn.Module) and m.weight is lin.weight  # still the compiled module
    for b in (2, 3, 2, 3, 5):
        m(torch.randn(b, 4))
    with torch.no_grad():
        m(torch.randn(2, 4))
    m(torch.randn(2, 4, requires_grad=True))
    lines = spool_lines(spool.directory)
    assert [ln["signature"] for ln in lines] == [
        "(f32[2,4])",
        "(f32[3,4])",
        "(f32[5,4])",
        "(f32[2,4]) no_grad",
        "(f32[2,4]*)",
    ]
    assert {ln["model"] for ln in lines} == {"lin"} and lines[0]["options"] == {"backend": "eager"}
    assert len({ln["signature_hash"] for ln in lines}) == 5
    t = lines[0]["spec"]["args"][0]
    assert t == {
        "t": "tensor",
        "shape": [2, 4],
        "dtype": "float32",
        "device": "cpu",
        "requires_grad": False,
        "stride": [4, 1],
    }


def test_function_decorator_nested_inputs_and_scalars(spool):
    @record.compile(name="f", spool=spool, backend="eager", dynamic=False)
    def f(xs, cfg, scale=1.0):
        return xs[0] * scale + cfg["b"].sum()

    a, b = torch.randn(3), torch.randn(2, dtype=torch.float64)
    f([a, a], {"b": b}, scale=2.0)
    f([a, a], {"b": b}, scale=2.0)  # seen
    f([a, a], {"b": b}, scale=3.0)  # a new scalar value: dynamo specializes, so a new signature
    f((a,), {"b": b[:1]}, scale=2.0)
    lines = spool_lines(spool.directory)
    assert [ln["signature"] for ln in lines] == [
        "([f32[3], f32[3]], {b: f64[2]}, scale=2.0)",
        "([f32[3], f32[3]], {b: f64[2]}, scale=3.0)",
        "((f32[3]), {b: f64[1]}, scale=2.0)",
    ]
    assert lines[0]["options"] == {"backend": "eager", "dynamic": False}
    assert f.__name__ == "f"


def test_a_nan_argument_is_one_signature_recorded_once(spool):
    """NaN equals no NaN, so a call with a NaN scalar was never found in the seen set: each call
    wrote a spool line (2,000 calls, 2,000 lines of one hash) and grew the set. Now it is one
    signature, recorded once, nested or not."""
    f = record.compile(lambda x, s, cfg: x * s, name="f", spool=spool, backend="eager")
    rec = vars(f)["_cachemgr_recorder"]
    x = torch.randn(2)
    for _ in range(200):
        f(x, float("nan"), {"eps": [float("nan")]})
    lines = spool_lines(spool.directory)
    assert [ln["signature"] for ln in lines] == ["(f32[2], nan, {eps: [nan]})"]
    assert len(rec.seen) == 1


def test_the_seen_set_is_bounded_and_says_so_once(spool, monkeypatch):
    """A scalar that is new on every call (a step counter) made a new signature each call: the seen
    set and the spool grew without bound. Past MAX_SEEN signatures nothing more is recorded, with
    one warning, and the model runs on."""
    monkeypatch.setattr(record, "MAX_SEEN", 5)
    f = record.compile(lambda x, step: x * step, name="f", spool=spool, backend="eager")
    x = torch.randn(2)
    with pytest.warns(UserWarning, match="5 distinct input signatures seen; no more are recorded") as w:
        for step in range(20):
            assert f(x, step).shape == (2,)
    assert len([m for m in w if "no more are recorded" in str(m.message)]) == 1
    assert [ln["spec"]["args"][1]["v"] for ln in spool_lines(spool.directory)] == [0, 1, 2, 3, 4]
    assert len(vars(f)["_cachemgr_recorder"].seen) == 5


def test_the_seen_set_keeps_no_call_s_arguments(spool):
    """A signature too large to record (a list of 20,000 token ids, new on each call) was kept
    whole in the seen set, a copy of the list per call: 2,000 calls took the workload from 208 MB
    to 2.9 GB. What the set keeps of a signature no longer grows with its arguments."""
    import gc
    import tracemalloc

    f = record.compile(lambda ids: len(ids), name="f", spool=spool, backend="eager")
    rec = vars(f)["_cachemgr_recorder"]  # (its per-call hook, called as the model's __call__ does)
    rec.observe(([0],), {})
    gc.collect()
    tracemalloc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (each line is refused, over the spool's line limit)
            for i in range(30):
                rec.observe(([i] + [0] * 20_000,), {})
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rec.seen) == 31
    assert kept < 4 << 20, f"{kept / 2**20:.1f} MiB kept by 30 calls"  # (a copy kept by each: 38 MB)


def test_a_dict_with_keys_that_are_not_strings_is_not_recorded_saying_why(spool):
    """`{0: a, '0': b}` was recorded as `{'0': b}` (keys made text, one input lost), so prewarm
    replayed another dict. A spec keeps only text keys; a dict with any other is not recorded,
    with a warning, and a dict of text keys still is."""
    f = record.compile(lambda d: d["0"].sum(), name="f", spool=spool, backend="eager")
    a, b = torch.randn(2), torch.randn(3)
    with pytest.warns(UserWarning, match=r"not recorded: ValueError: a dict with a key that is not a string \(0\)"):
        f({0: a, "0": b})
    f({"0": b})
    assert [ln["signature"] for ln in spool_lines(spool.directory)] == ["({0: f32[3]})"]


def test_a_spool_that_cannot_be_written_warns_once_and_never_breaks_the_model(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    m = record.compile(torch.nn.Linear(2, 2), name="x", spool=record.Spool(str(blocker / "spool")), backend="eager")
    with pytest.warns(UserWarning, match="cannot write the spool"):
        m(torch.randn(1, 2))
        m(torch.randn(3, 2))
    assert m(torch.randn(1, 2)).shape == (1, 2)


def test_a_bad_config_warns_once_and_never_breaks_the_model(tmp_path, monkeypatch):
    """The spool named by the settings, and the settings cannot be read (a config file that is
    not TOML, a state directory whose name is not UTF-8): a warning, not an exception in the
    user's forward pass."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("max_size = [\n")
    monkeypatch.delenv("CACHEMGR_SPOOL_DIR", raising=False)
    monkeypatch.setenv("CACHEMGR_CONFIG", str(cfg))
    m = record.compile(torch.nn.Linear(2, 2), name="x", spool=record.Spool(), backend="eager")
    with pytest.warns(UserWarning, match="cannot write the spool of the settings: config file"):
        m(torch.randn(1, 2))
        m(torch.randn(3, 2))
    assert m(torch.randn(1, 2)).shape == (1, 2)


def test_a_line_the_disk_has_no_room_for_is_cut_off_whole_and_written_again(spool, monkeypatch):
    """A nearly full disk takes part of a line (a short write). The part is cut back off, so the
    line written once there is room does not join a torn one (both lost to the ingester), and the
    signature that was not written is recorded by a later call that sees it."""
    real_write, full = os.write, [False]

    def short_write(fd, data):
        if full[0] and data.startswith(b"{"):
            return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(record.os, "write", short_write)
    m = record.compile(torch.nn.Linear(2, 2), name="x", spool=spool, backend="eager")
    spool.append({"first": 1})  # (a line already there stays whole)
    full[0] = True
    with pytest.warns(UserWarning, match="cannot write the spool"):
        m(torch.randn(1, 2))
    full[0] = False
    m(torch.randn(1, 2))  # the same signature, now with room
    assert [d.get("signature") for d in spool_lines(spool.directory)] == [None, "(f32[1,2])"]


def _plant(kind: str, path: str, outside: str) -> int | None:
    """Put `kind` where the recorder's file was; a FIFO's reader's fd, if any, to read back."""
    if kind == "symlink":
        os.symlink(outside, path)
    elif kind == "hard link":
        os.link(outside, path)
    else:
        os.mkfifo(path)
        if kind == "FIFO read by someone":
            return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    return None


@pytest.mark.parametrize("kind", ["symlink", "hard link", "FIFO read by someone", "FIFO read by nobody"])
def test_the_recorder_writes_only_its_own_file_never_one_planted_at_its_name(spool, tmp_path, kind):
    """The spool is writable by every workload: a symlink to a file outside it, put where the
    recorder's file was (taken by an ingester), had the recorder's next line appended to that
    file, and so did a hard link; a FIFO got the line, or blocked the model's forward pass for
    good where nobody read it. What is planted is left alone, and the line goes to a file of the
    recorder's own under a new name."""
    outside = tmp_path / "someone-else.txt"
    outside.write_text("theirs\n")
    spool.append({"n": 1})
    first = os.path.join(spool.directory, spool.name)
    os.rename(first, first + TAKEN)  # as an ingester takes it
    reader = _plant(kind, first, str(outside))
    recorder = threading.Thread(target=spool.append, args=({"n": 2},), daemon=True)
    recorder.start()
    recorder.join(10)
    try:
        assert not recorder.is_alive(), "the recorder blocked on the FIFO"
        if reader is not None:
            assert os.read(reader, 100) == b""  # nothing written into it
    finally:
        if recorder.is_alive():  # (unblock it: a reader comes)
            os.close(os.open(first, os.O_RDONLY | os.O_NONBLOCK))
        if reader is not None:
            os.close(reader)
    assert outside.read_text() == "theirs\n"
    assert spool.name != os.path.basename(first)
    with open(os.path.join(spool.directory, spool.name)) as f:
        assert [json.loads(x) for x in f] == [{"n": 2}]
    assert os.path.lexists(first)  # (what was planted is not the recorder's to remove)


def test_ingest_is_idempotent_and_collects_varied_dims(spool, tmp_path):
    m = record.compile(torch.nn.Linear(4, 2), name="lin", spool=spool, backend="eager")
    for b in (2, 3, 5):
        m(torch.randn(b, 4))
    db = Database(f"sqlite:///{tmp_path / 'idx.db'}")
    r = ingest(db, spool.directory)
    assert (r.files, r.lines, r.new_shapes) == (1, 3, 0 + 3)
    assert os.listdir(spool.directory) == []
    assert ingest(db, spool.directory).lines == 0  # nothing left: a second run changes nothing
    # the same signatures from a second process add to count, not rows
    m2 = record.compile(torch.nn.Linear(4, 2), name="lin", spool=record.Spool(spool.directory), backend="eager")
    m2(torch.randn(2, 4))
    r = ingest(db, spool.directory)
    assert (r.new_shapes, r.updated_shapes) == (0, 1)
    rows = list_shapes(db, "lin")
    assert [x["signature"] for x in rows] == ["(f32[2,4])", "(f32[3,4])", "(f32[5,4])"]
    assert [x["count"] for x in rows] == [2, 1, 1]
    assert rows[0]["varied"] == ["args[0].0"]


def test_a_recorder_never_waits_for_an_ingest_of_its_file(spool, tmp_path, monkeypatch):
    """An ingester takes (renames) a recorder's file between the recorder's open and its lock, and
    holds the file for its whole ingest (index writes: seconds on a remote index). The recorder,
    in the model's forward pass, writes its line into a new file at once, not after the ingest."""
    from cachemgr.prewarm import spool as spooling

    spool.append({"first": 1})
    db = Database(f"sqlite:///{tmp_path / 'idx.db'}")
    ingesting, finish = threading.Event(), threading.Event()
    real_lines = spooling._ingest_lines

    def slow_lines(*a):  # the ingest's index writes, held until the test lets them go
        ingesting.set()
        finish.wait(60)
        return real_lines(*a)

    monkeypatch.setattr(spooling, "_ingest_lines", slow_lines)
    ingester = threading.Thread(target=ingest, args=(db, spool.directory))
    real_open = os.open

    def opened_then_taken(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        if str(path).endswith(spool.name) and not ingester.is_alive() and not ingesting.is_set():
            ingester.start()  # takes the file just opened, and locks it for the ingest
            assert ingesting.wait(30)
        return fd

    monkeypatch.setattr(record.os, "open", opened_then_taken)
    recorder = threading.Thread(target=spool.append, args=({"second": 2},))
    recorder.start()
    recorder.join(30)
    try:
        assert not recorder.is_alive(), "the recorder waited for the ingest"
        assert ingester.is_alive()  # (still ingesting: the recorder did not wait for it)
        with open(os.path.join(spool.directory, spool.name)) as f:
            assert [json.loads(x) for x in f] == [{"second": 2}]  # in the new file, not lost
    finally:
        finish.set()
        ingester.join(60)
        recorder.join(60)
    assert spool_lines(spool.directory) == [{"second": 2}]  # the first file was ingested and removed


def test_a_recorder_never_waits_for_anyones_lock_on_its_file(spool):
    """Spool files are world-readable: anyone may hold a lock on one (`flock -s`). The recorder
    waited for it in the model's forward pass (as for a forked child's line), for as long as the
    lock was held. It now writes the line into a new file of its own."""
    import fcntl

    spool.append({"first": 1})
    taken = os.path.join(spool.directory, spool.name)
    fd = os.open(taken, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held until the end of the test
        recorder = threading.Thread(target=spool.append, args=({"second": 2},))
        recorder.start()
        recorder.join(60)  # (a hang guard: it returns at once, or never did)
        assert not recorder.is_alive(), "the recorder waited for a reader's lock"
        assert os.path.join(spool.directory, spool.name) != taken
        with open(taken) as f:
            assert [json.loads(x) for x in f] == [{"first": 1}]
        with open(os.path.join(spool.directory, spool.name)) as f:
            assert [json.loads(x) for x in f] == [{"second": 2}]
    finally:
        os.close(fd)
        recorder.join(60)


def test_ingest_recovers_a_crash_without_double_counting(spool, tmp_path):
    m = record.compile(torch.nn.Linear(4, 2), name="lin", spool=spool, backend="eager")
    m(torch.randn(2, 4))
    m(torch.randn(3, 4))
    db = Database(f"sqlite:///{tmp_path / 'idx.db'}")
    path = os.path.join(spool.directory, spool.name)
    with open(path, "rb") as f:
        content = f.read()
    ingest(db, spool.directory)
    # crash after commit, before unlink: the taken file is still there, plus a torn line
    with open(path + TAKEN, "wb") as f:
        f.write(content + b'{"model": "lin", "sig')
    r = ingest(db, spool.directory)
    assert r.files == 1 and r.updated_shapes == 0 and len(r.bad_lines) == 1 and "not JSON" in r.bad_lines[0]
    assert [x["count"] for x in list_shapes(db, "lin")] == [1, 1]
    assert os.listdir(spool.directory) == []
    # the recorder, still running, writes its next signature into a new file of the same name
    m(torch.randn(7, 4))
    assert ingest(db, spool.directory).new_shapes == 1


def test_lines_a_recorder_never_writes_are_skipped_and_the_rest_ingested(spool, tmp_path, cli_for, gpu_cache):
    """Valid JSON with wrong fields (a hand edit, another program, a bug) is reported and skipped:
    `scan` and `shapes` keep working, and a good line of the same file is ingested."""
    m = record.compile(torch.nn.Linear(4, 2), name="good", spool=spool, backend="eager")
    m(torch.randn(2, 4))
    base = {"model": "m", "signature_hash": "h", "spec": {"args": [], "kwargs": {}}}
    hostile = [
        {**base, "ts": "abc"},
        {**base, "model": ["x"]},
        {**base, "spec": [1, 2]},
        {**base, "spec": {"args": [{"t": "tensor", "shape": "big"}]}},
        {**base, "options": 7},
        [1, 2],
    ]
    with open(os.path.join(spool.directory, spool.name), "a") as f:
        f.writelines(json.dumps(h) + "\n" for h in hostile)
    os.mkdir(os.path.join(spool.directory, "dir.jsonl"))  # not a file, named like one
    cli = cli_for(gpu_cache)
    flag = ["--config", str(_config(tmp_path, spool.directory))]
    r = cli(*flag, "scan")
    reported = [line for line in r.stderr.splitlines() if line.startswith("cachemgr: spool: skipped")]
    assert len(reported) == len(hostile) + 1, r.stderr
    assert "ts has the wrong type" in r.stderr and "spec is not" in r.stderr and "not a regular file" in r.stderr
    doc = cli.json(*flag, "shapes")
    assert [d["model"] for d in doc] == ["good"]
    assert cli(*flag, "scan").stderr == ""  # nothing left over to fail on again


def test_a_line_the_ingest_cannot_store_is_skipped_not_a_jammed_spool(tmp_path, cli_for):
    """A spec without `kwargs` (or `args`), a tensor whose device is no text, an argument whose
    type tag is a list: each passed the checks and then raised in the ingest (`internal error`,
    exit 70, the file left `.ingesting` and every later scan failing on it). Now each is a skipped
    line with its reason, the good line of the same file lands, and the next scan is clean."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    tensor = {"t": "tensor", "shape": [2], "dtype": "float32"}
    lines = [
        {"model": "m", "signature_hash": "h1", "spec": {"args": []}},
        {"model": "m", "signature_hash": "h2", "spec": {"kwargs": {}}},
        *(
            {"model": "m", "signature_hash": f"d{i}", "spec": {"args": [{**tensor, "device": d}], "kwargs": {}}}
            for i, d in enumerate([0, False, {}, []])
        ),
        {"model": "m", "signature_hash": "h3", "spec": {"args": [{"t": []}], "kwargs": {}}},
        {"model": "m", "signature_hash": "ok", "spec": {"args": [{**tensor, "device": "cuda:0"}], "kwargs": {}}},
    ]
    (spool_dir / "x.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "cache").mkdir()
    cli = cli_for(tmp_path / "cache")
    flag = ["--config", str(_config(tmp_path, str(spool_dir)))]
    r = cli(*flag, "scan")
    reported = [line for line in r.stderr.splitlines() if line.startswith("cachemgr: spool: skipped")]
    assert len(reported) == len(lines) - 1, r.stderr
    assert [x.split(".ingesting:", 1)[1] for x in reported[:2]] == [
        "1: spec is not {args: [...], kwargs: {...}}",
        "2: spec is not {args: [...], kwargs: {...}}",
    ]
    assert all("a tensor without" in x for x in reported[2:6]) and "unknown argument" in reported[6]
    assert os.listdir(spool_dir) == []
    ok = record.signature_hash(lines[-1]["spec"], {})  # (made from the spec at ingest, not the line's)
    assert [(d["signature_hash"], d["signature"]) for d in cli.json(*flag, "shapes")] == [(ok, "(f32[2]@cuda:0)")]
    assert cli(*flag, "scan").stderr == ""


# `cachemgr ARGS...` that writes its peak RSS (KiB) to $PEAK_FILE as it exits. VmHWM, not
# ru_maxrss: a child started from this (torch-sized) test process inherits its high-water mark there.
_PEAK = """
import atexit, os, runpy, sys
def peak():
    with open("/proc/self/status") as f, open(os.environ["PEAK_FILE"], "w") as out:
        out.write(next(x for x in f if x.startswith("VmHWM:")).split()[1])
atexit.register(peak)
sys.argv[0] = "cachemgr"
runpy.run_module("cachemgr", run_name="__main__")
"""


def _peak_kib(tmp_path, *args: str) -> int:
    peak = tmp_path / "peak"
    r = subprocess.run(
        [sys.executable, "-c", _PEAK, *args],
        capture_output=True,
        text=True,
        env=subprocess_env(PEAK_FILE=str(peak)),
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return int(peak.read_text())


def test_ingest_memory_stays_flat_however_large_the_parsed_lines(tmp_path, cli_for):
    """100 lines of 48 KiB, each parsing into 16,000 small lists (over 1 MB of objects): the ingest
    held a whole batch of parsed lines (1,000 such lines: 1.6 GB). Now a batch holds only the texts
    it stores, and `scan` peaks a few MB above a scan that ingests one small line."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (tmp_path / "cache").mkdir()
    cli = cli_for(tmp_path / "cache")
    args = [*cli.base(), "--config", str(_config(tmp_path, str(spool_dir))), "scan"]
    spec = {"args": [], "kwargs": {}}
    (spool_dir / "one.jsonl").write_text(json.dumps({"model": "m", "signature_hash": "one", "spec": spec}) + "\n")
    one = _peak_kib(tmp_path, *args)  # the same scan ingesting one small line: the same modules loaded
    with open(spool_dir / "w.jsonl", "w") as f:
        for i in range(100):
            options = {"a": [[]] * 16000, "i": i}  # (a shape per line: its hash is made from spec and options)
            f.write(json.dumps({"model": "m", "signature_hash": f"h{i}", "spec": spec, "options": options}))
            f.write("\n")
    full = _peak_kib(tmp_path, *args)
    assert os.listdir(spool_dir) == []
    assert full - one < 50 * 1024, (one, full)  # was 128 MiB more; now about 13
    assert len(list_shapes(Database(cli.db_url), "m")) == 101


def test_a_row_shapes_would_leave_out_is_refused_at_ingest_saying_why(tmp_path, cli_for):
    """Options that take over 64 KiB once stored (non-ASCII text is escaped), over 16,384 values,
    or a signature text over 4,096 characters (a spec of 600 arguments, the line having none of its
    own): each was ingested, then silently left out of `shapes`. Now the ingest refuses each, with
    its reason, and every line it takes is listed."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    (tmp_path / "cache").mkdir()
    empty = {"args": [], "kwargs": {}}
    wide = {f"b{i}": "\u00e9" * 4000 for i in range(3)}  # 24 KB in the line, 72 KB stored (escaped)
    lines = [
        {"model": "m", "signature_hash": "wide", "spec": empty, "options": wide},
        {"model": "m", "signature_hash": "many", "spec": empty, "options": {"c": [0] * 17000}},
        {"model": "m", "signature_hash": "long", "spec": {"args": [{"t": "int", "v": 1234567}] * 600, "kwargs": {}}},
        {"model": "m", "signature_hash": "ok", "spec": empty, "options": {"mode": "max-autotune"}},
    ]
    with open(spool_dir / "v.jsonl", "w") as f:
        f.writelines(json.dumps(x, ensure_ascii=False) + "\n" for x in lines)
    cli = cli_for(tmp_path / "cache")
    flag = ["--config", str(_config(tmp_path, str(spool_dir)))]
    err = cli(*flag, "scan").stderr
    assert [x.removeprefix("cachemgr: spool: skipped v.jsonl.ingesting:") for x in err.splitlines()] == [
        "1: options takes 72030 characters stored, over the 64 KiB a row may hold",
        "2: more than 16384 JSON values",
        "3: signature longer than 4096 characters",
    ], err
    assert [d["options"] for d in cli.json(*flag, "shapes")] == [{"mode": "max-autotune"}]


def test_shapes_cli_ingests_and_lists(spool, tmp_path, cli_for):
    m = record.compile(torch.nn.Linear(4, 2), name="ranker", spool=spool, backend="eager")
    m(torch.randn(2, 4))
    m(torch.randn(6, 4))
    cli = cli_for(tmp_path / "cache")
    env_flag = ["--config", str(_config(tmp_path, spool.directory))]
    res = subprocess.run(
        [sys.executable, "-m", "cachemgr", *cli.base(), *env_flag, "shapes", "--model", "ranker", "--json"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [d["signature"] for d in doc] == ["(f32[2,4])", "(f32[6,4])"] and doc[0]["varied"] == ["args[0].0"]
    res = subprocess.run(
        [sys.executable, "-m", "cachemgr", *cli.base(), *env_flag, "shapes", "--model", "nope"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO,
        timeout=120,
    )
    assert res.returncode == 3 and res.stderr.startswith("cachemgr: error: no recorded shapes for model 'nope'")


def _config(tmp_path, spool_dir: str):
    p = tmp_path / "config.toml"
    p.write_text(f'spool_dir = "{spool_dir}"\n')
    return p


@pytest.mark.slow  # torch.compile in a real process
def test_overhead_path_does_not_import_the_database():
    # recording in a workload must not pull in SQLAlchemy (the hot path never touches the index)
    code = (
        "import torch, cachemgr.record as r, sys; m = r.compile(torch.nn.Linear(2,2), name='a', backend='eager',"
        " spool=r.Spool('/tmp/cachemgr-test-spool-unused')); m(torch.randn(1,2)); print('sqlalchemy' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
