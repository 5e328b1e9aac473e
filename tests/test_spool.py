"""Hostile inputs that any workload can write and every ingest or prewarm reads: spool files (a
file grown or locked by another process, a line naming another shape's hash) and manifests (a
value the worker cannot be sent). No torch: real files, real processes, a real SQLite index."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import tomllib

import pytest

from cachemgr.index.db import Database
from cachemgr.prewarm import manifest as mf
from cachemgr.prewarm import spool as spooling
from cachemgr.prewarm.spool import TAKEN, ingest, list_shapes
from cachemgr.record import signature_hash
from tests.conftest import REPO


def tensor(*shape: int) -> dict:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.insert(0, acc)
        acc *= d
    return {"t": "tensor", "shape": list(shape), "dtype": "float32", "device": "cpu", "stride": stride}


def line(model: str, *shapes: tuple[int, ...], hash_of: tuple[int, ...] | None = None, ts: float = 1e9) -> bytes:
    """A spool line as the recorder writes it; `hash_of`: the hash of another input's spec."""
    spec = {"args": [tensor(*s) for s in shapes], "kwargs": {}, "grad": True}
    forged = {"args": [tensor(*hash_of)], "kwargs": {}, "grad": True} if hash_of else spec
    doc = {"model": model, "signature_hash": signature_hash(forged, {}), "spec": spec, "options": {}, "ts": ts}
    return (json.dumps(doc) + "\n").encode()


@pytest.fixture
def db(tmp_path):
    d = Database(f"sqlite:///{tmp_path / 'idx.db'}")
    yield d
    d.close()


@pytest.fixture
def spool_dir(tmp_path):
    d = tmp_path / "spool"
    d.mkdir()
    return d


def test_a_line_naming_another_shapes_hash_cannot_take_its_row(db, spool_dir):
    """The row key was the line's own `signature_hash`: a line with the hash of f32[8,16] and the
    spec f32[1,1], read first, made that row f32[1,1] for good (later real lines only counted), and
    prewarm replayed f32[1,1]. The hash is now made from the spec and options at ingest."""
    (spool_dir / "a-evil.jsonl").write_bytes(line("lin", (1, 1), hash_of=(8, 16), ts=1e9))
    (spool_dir / "b-real.jsonl").write_bytes(line("lin", (8, 16), ts=1e9 + 1))
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.new_shapes, r.bad_lines) == (2, 2, 2, [])
    rows = {d["signature"]: d["signature_hash"] for d in list_shapes(db, "lin")}
    real = {"args": [tensor(8, 16)], "kwargs": {}, "grad": True}
    forged = {"args": [tensor(1, 1)], "kwargs": {}, "grad": True}
    assert rows == {"(f32[8,16])": signature_hash(real, {}), "(f32[1,1])": signature_hash(forged, {})}


def test_a_file_written_while_it_is_read_is_read_up_to_its_size_when_locked(db, spool_dir, monkeypatch):
    """A writer that ignores the lock (an fd opened before the ingest took the file) kept the file
    growing while it was read: the ingest never ended, past MAX_FILE. Now only the bytes the file
    held once locked are read, and the rest is named."""
    path = spool_dir / "g.jsonl"
    path.write_bytes(line("lin", (2, 4)) * 3)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # before the ingest renames it
    reading, written, stop = threading.Event(), threading.Event(), threading.Event()
    chunk = line("grown", (9, 9)) * 1000

    def grow() -> None:  # as long as the ingest reads (at most 8 MB: a test without the fix ends)
        reading.wait(60)
        for _ in range(8 * 1024 * 1024 // len(chunk)):
            os.write(fd, chunk)
            written.set()
            if stop.is_set():
                break

    real_lines = spooling._ingest_lines

    def lines_once_grown(*a):  # the file has grown past its size at the lock before a line is read
        reading.set()
        assert written.wait(60)
        return real_lines(*a)

    monkeypatch.setattr(spooling, "_ingest_lines", lines_once_grown)
    writer = threading.Thread(target=grow)
    writer.start()
    try:
        r = ingest(db, str(spool_dir))
    finally:
        stop.set()
        writer.join(60)
        os.close(fd)
    assert (r.files, r.lines, r.new_shapes) == (1, 3, 1)
    assert [d["model"] for d in list_shapes(db)] == ["lin"]  # nothing written after the lock was read
    assert len(r.bad_lines) == 1 and r.bad_lines[0].startswith(f"g.jsonl{TAKEN}: ")
    assert r.bad_lines[0].endswith("bytes added while it was read, by a writer that ignores its lock: not read")
    assert os.listdir(spool_dir) == []


_HOLD = """
import fcntl, os, sys
fds = [os.open(p, os.O_RDONLY) for p in sys.argv[1:]]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
sys.stdin.read()  # until the test closes it
"""


def test_locked_files_cost_one_short_wait_in_all_and_are_named(db, spool_dir, monkeypatch):
    """Each spool file whose lock another process held cost the ingest LOCK_WAIT (5 s), unsaid:
    six such files, 30 s of `shapes`, and any workload can hold more. Now one ingest waits
    LOCK_WAIT in all, names each file it left, and ingests the others; a later ingest, the locks
    gone, takes the files left."""
    locked = [spool_dir / f"a{i}.jsonl" for i in range(6)]
    for i, p in enumerate(locked):  # (a file left taken is read as after a crash: its lines are newer)
        p.write_bytes(line("lin", (2, 4), ts=1e9 + i))
    (spool_dir / "z-free.jsonl").write_bytes(line("lin", (3, 4)))
    monkeypatch.setattr(spooling, "LOCK_WAIT", 0.2)
    waits: list[float] = []
    real_lock = spooling._lock
    monkeypatch.setattr(spooling, "_lock", lambda fd, wait: waits.append(wait) or real_lock(fd, wait))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, *map(str, locked)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        r = ingest(db, str(spool_dir))
    finally:
        holder.communicate("", timeout=60)
    assert (r.files, r.lines) == (1, 1)
    assert r.bad_lines == [f"a{i}.jsonl{TAKEN}: locked by another process; left for a later ingest" for i in range(6)]
    assert sum(waits) <= 0.2  # the budget shared, not a wait per file
    assert sorted(os.listdir(spool_dir)) == [f"a{i}.jsonl{TAKEN}" for i in range(6)]
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.bad_lines) == (6, 6, [])
    assert {d["signature"]: d["count"] for d in list_shapes(db, "lin")} == {"(f32[2,4])": 6, "(f32[3,4])": 1}


def test_a_hard_link_in_the_spool_is_never_read_and_a_locked_leftover_is_named(db, spool_dir, tmp_path):
    """Anyone who can write the spool can link a file of someone else's into it (the daemon reads
    as root): it was read as spool lines, and only the link removed. It is set aside, unread, as
    the recorder refuses such a file. A file a dead ingest left taken, locked by another process,
    was skipped without a word by every later ingest, for as long as the lock was held."""
    outside = tmp_path / "secret.jsonl"
    outside.write_bytes(line("lin", (5, 5)))
    os.link(outside, spool_dir / "linked.jsonl")
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines) == (0, 0) and list_shapes(db, "lin") == []
    assert any("hard link" in b and "linked.jsonl" in b for b in r.bad_lines), r.bad_lines
    assert outside.read_bytes() == line("lin", (5, 5))
    left = spool_dir / f"b.jsonl{TAKEN}"
    left.write_bytes(line("lin", (2, 4)))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(left)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        r = ingest(db, str(spool_dir))
    finally:
        holder.communicate("", timeout=60)
    assert r.bad_lines == [f"b.jsonl{TAKEN}: locked by another process; left for a later ingest"], r.bad_lines
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.bad_lines) == (1, 1, [])


def test_strides_no_tensor_has_are_refused_at_ingest(db, spool_dir):
    """A stride per dimension, none negative, or prewarm cannot make the tensor (`stride [1] does
    not match shape [2, 2]`, `Storage size calculation overflowed`): such lines were stored,
    listed by `shapes` beside the real one under the same signature text, and failed prewarm."""
    good = json.loads(line("lin", (2, 2)))
    lines = [json.dumps(good)]
    for stride in ([1], [2, 1, 1], [-2, 1], [2, True]):
        doc = json.loads(json.dumps(good))
        doc["spec"]["args"][0]["stride"] = stride
        doc["signature_hash"] = signature_hash(doc["spec"], {})
        lines.append(json.dumps(doc))
    (spool_dir / "a.jsonl").write_text("\n".join(lines) + "\n")
    r = ingest(db, str(spool_dir))
    assert (r.lines, r.new_shapes) == (1, 1), r
    assert [b.split(": ", 1)[1] for b in r.bad_lines] == [
        "spec: a tensor whose strides are not one whole number from 0 up per dimension"
    ] * 4, r.bad_lines
    assert [d["signature"] for d in list_shapes(db, "lin")] == ["(f32[2,2])"]


@pytest.mark.parametrize("junk", [b"{}\n", b"\n"])
def test_a_file_of_lines_no_recorder_writes_is_set_aside_past_a_bound(db, spool_dir, junk):
    """16 MiB of `{}` lines took 29 s of `shapes` (256 MiB of blank lines 75 s), each line read,
    checked and counted: any workload can write such files. Past MAX_JUNK such lines the rest of
    the file is set aside unread, what came before it ingested."""
    body = line("lin", (2, 4)) + junk * (spooling.MAX_JUNK + 500) + line("lin", (3, 4))
    (spool_dir / "a.jsonl").write_bytes(body)
    r = ingest(db, str(spool_dir))
    assert [d["signature"] for d in list_shapes(db, "lin")] == ["(f32[2,4])"]
    assert any(f"over {spooling.MAX_JUNK} lines no recorder writes" in b for b in r.bad_lines), r.bad_lines
    (aside,) = os.listdir(spool_dir)
    assert ".bad-" in aside and (spool_dir / aside).read_bytes() == body
    (spool_dir / "b.jsonl").write_bytes(junk * spooling.MAX_JUNK + line("lin", (3, 4)))  # up to the bound: read
    r = ingest(db, str(spool_dir))
    assert sorted(d["signature"] for d in list_shapes(db, "lin")) == ["(f32[2,4])", "(f32[3,4])"]


LONG = "a" * 249 + ".jsonl"  # 255 bytes: taken, it is shortened to fit


def test_a_long_named_file_left_taken_is_ingested_by_a_later_ingest(db, spool_dir):
    """A 255-byte name, taken, was shortened to `aaa...-PID-0.ingesting`: without `.jsonl`, no
    later ingest looked at it. Left taken while a recorder held its lock, it stayed for ever,
    its lines never ingested. The shortened name keeps `.jsonl.ingesting`."""
    (spool_dir / LONG).write_bytes(line("lin", (8, 16)))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(spool_dir / LONG)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        r = ingest(db, str(spool_dir))
    finally:
        holder.communicate("", timeout=60)
    assert (r.files, len(r.bad_lines)) == (0, 1) and "locked by another process" in r.bad_lines[0], r
    (left,) = os.listdir(spool_dir)
    assert left.startswith("a" * 200) and left.endswith(".jsonl" + TAKEN) and len(left) <= 255, left
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.new_shapes, r.bad_lines) == (1, 1, 1, []), r
    assert os.listdir(spool_dir) == []


def test_a_long_named_file_a_crash_left_taken_is_recovered(db, spool_dir, monkeypatch):
    """An ingest that dies after taking a long-named file, and a file an earlier version shortened
    without `.jsonl`: later ingests recover both."""
    (spool_dir / LONG).write_bytes(line("lin", (8, 16)))
    (spool_dir / ("b" * 236 + f"-123-0{TAKEN}")).write_bytes(line("lin", (2, 4)))  # (the earlier version's)
    real = spooling._ingest_file

    def dies_once_it_took_one(db, path, recovering, *a):
        if not recovering:
            raise SystemExit("killed")
        return real(db, path, recovering, *a)

    with monkeypatch.context() as m:
        m.setattr(spooling, "_ingest_file", dies_once_it_took_one)
        with pytest.raises(SystemExit):
            ingest(db, str(spool_dir))
    (left,) = os.listdir(spool_dir)
    assert left.endswith(".jsonl" + TAKEN), left
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.new_shapes, r.bad_lines) == (1, 1, 1, []), r
    assert os.listdir(spool_dir) == []
    assert sorted(d["signature"] for d in list_shapes(db, "lin")) == ["(f32[2,4])", "(f32[8,16])"]


# -- manifests ------------------------------------------------------------------------------------


def test_a_spool_file_whose_name_leaves_no_room_for_a_suffix_is_taken_once(db, spool_dir, tmp_path):
    """A file named 249 characters (`.ingesting` makes it 259, over a file name's 255 bytes) could
    not be taken, a symlink so named not set aside either: each was reported again by every ingest,
    for ever. They are taken (and set aside) under a shortened name of their own."""
    (spool_dir / ("b" * 243 + ".jsonl")).write_bytes(line("lin", (8, 16)))
    (tmp_path / "elsewhere").write_text("someone's")
    (spool_dir / ("c" * 243 + ".jsonl")).symlink_to(tmp_path / "elsewhere")
    r = ingest(db, str(spool_dir))
    assert (r.files, r.lines, r.new_shapes) == (1, 1, 1), r
    assert len(r.bad_lines) == 1 and "renamed to " + "c" * 40 in r.bad_lines[0], r.bad_lines
    assert (tmp_path / "elsewhere").read_text() == "someone's"
    again = ingest(db, str(spool_dir))
    assert (again.files, again.lines, again.bad_lines) == (0, 0, []), again


def test_a_manifest_shape_nested_too_deep_is_refused(tmp_path, cli_for):
    """Shapes nested 300 lists deep killed the run's driver thread (RecursionError): a traceback,
    then '0 shape(s) prewarmed, 0 problem(s)' and exit 0; 400 levels, exit 70. The manifest is
    refused as it loads (exit 2), and a driver thread's failure fails the run (exit 8)."""
    manifest = tmp_path / "m.toml"
    deep = "[" * 300 + "1" + "]" * 300
    manifest.write_text(f'[[model]]\nname = "m"\nfactory = "prewarm_models:mlp"\nshapes = [[{deep}]]\n')
    (tmp_path / "cache").mkdir()
    r = cli_for(tmp_path / "cache").proc("prewarm", "--manifest", str(manifest))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "lists nested deeper than 16" in r.stderr, r.stderr


def test_a_driver_thread_that_fails_fails_the_run(monkeypatch):
    from cachemgr.errors import PrewarmError
    from cachemgr.prewarm import worker

    def broken(*args):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(worker, "_drive", broken)
    with pytest.raises(
        PrewarmError, match=r"^the run on cpu: RecursionError: maximum recursion depth exceeded: stopped$"
    ):
        worker.run([("cpu", [])], {})


DATETIME_IN = {
    "factory_kwargs": "factory_kwargs = { when = 1979-05-27T07:32:00Z, t = 07:32:00 }\n",
    "compile.options": "compile = { options = { x = 1979-05-27 } }\n",
}


@pytest.mark.parametrize("field", DATETIME_IN)
def test_a_manifest_value_json_has_no_form_for_is_refused_by_every_command_that_reads_it(field, tmp_path, cli_for):
    """A TOML date or time in factory_kwargs made `prewarm` print a traceback (the worker's job is
    JSON), then '0 shape(s) prewarmed, 0 problem(s)' and exit 0; in compile.options, exit 70 (and
    `check` 8, `import --check-only` 9, each with a traceback). The manifest is now refused as it
    loads: one line naming model and key, exit 2, whichever command reads it."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        f'[[model]]\nname = "lin"\nfactory = "prewarm_models:mlp"\n{DATETIME_IN[field]}shapes = [["f32[8,16]"]]\n'
    )
    bundle = tmp_path / "b.bundle"
    empty = hashlib.sha256(b"").hexdigest()  # (a header is all import reads before the manifest)
    bundle.write_bytes(b'CACHEMGR-BUNDLE 1\n{"bytes": 0, "sha256": "%s"}\n' % empty.encode())
    (tmp_path / "cache").mkdir()
    cli = cli_for(tmp_path / "cache")
    key = "factory_kwargs.when" if field == "factory_kwargs" else "compile.options.x"
    expected = (
        f"cachemgr: error: manifest {manifest}: model 'lin': field '{key}': a TOML date or time, which prewarm "
        "cannot pass on (JSON has none): write it as a string\n"
    )
    for args in (
        ["prewarm", "--manifest", str(manifest)],
        ["check", "--manifest", str(manifest)],
        ["import", str(bundle), "--check-only", "--manifest", str(manifest)],
        ["export", "--manifest", str(manifest), "--out", str(tmp_path / "out.bundle")],
    ):
        r = cli.proc(*args, env={"PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "tests" / "programs")))})
        assert (r.returncode, r.stderr) == (2, expected), args


# (a model's fields, TOML) -> (the field named, what it says)
MISTYPED = {
    "dtype a list": ('shapes = [[{ shape = [2, 2], dtype = ["f32"] }]]', "shapes[0][0].dtype", "must be a dtype name"),
    "dtype a table": ("shapes = [[{ shape = [2], dtype = { f = 32 } }]]", "shapes[0][0].dtype", "must be a dtype name"),
    "dtype a number": ("shapes = [[{ shape = [2], dtype = 32 }]]", "shapes[0][0].dtype", "must be a dtype name"),
    "requires_grad a string": (
        'shapes = [[{ shape = [2], requires_grad = "false" }]]',
        "shapes[0][0].requires_grad",
        "must be true or false",
    ),
    "dims in other digits": ('shapes = [["f32[\u0661\u0664]"]]', "shapes[0][0]", "tensor spec must look like"),
    "device in other digits": ('device = "cuda:\u0661"', "device", "must be cpu, cuda or cuda:N"),
    "device and a newline": ('device = "cuda\\n"', "device", "must be cpu, cuda or cuda:N"),
    "factory and a newline": ('factory = "p:f\\n"', "factory", "required, 'package.module:function'"),
}


@pytest.mark.parametrize("case", MISTYPED)
def test_a_manifest_value_of_the_wrong_type_is_its_model_s_field_error(case):
    """A dtype given as a list or a table stopped every model (`TypeError: unhashable type`, exit
    70, in prewarm, export and check); `requires_grad = "false"` was taken as true, digits of
    other scripts as numbers, a trailing newline as part of a device or factory. Each is now a
    field error of its own model; the others load."""
    fields, field, says = MISTYPED[case]
    factory = "" if fields.startswith("factory") else 'factory = "p:f"\n'
    ok = '[[model]]\nname = "ok"\nfactory = "p:f"\nshapes = [["f32[2]"]]\n'
    m = mf.parse(tomllib.loads(f'[[model]]\nname = "bad"\n{factory}{fields}\n\n{ok}'), "m.toml")
    assert [x.name for x in m.models] == ["ok"]
    assert len(m.errors) == 1 and m.errors[0][0] == "bad", m.errors
    assert m.errors[0][1].startswith(f"manifest m.toml: model 'bad': field '{field}': {says}"), m.errors


def test_a_dtype_given_as_a_list_is_one_line_for_every_command_that_reads_the_manifest(tmp_path, cli_for):
    manifest = tmp_path / "m.toml"
    manifest.write_text(
        '[[model]]\nname = "bad"\nfactory = "prewarm_models:mlp"\nshapes = [[{ shape = [2, 2], dtype = ["f32"] }]]\n'
    )
    (tmp_path / "cache").mkdir()
    cli = cli_for(tmp_path / "cache")
    expected = (
        f"cachemgr: error: manifest {manifest}: model 'bad': field 'shapes[0][0].dtype': must be a dtype name "
        'such as "f32" or "bfloat16", got [\'f32\']'
    )
    env = {"PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "tests" / "programs")))}
    r = cli.proc("prewarm", "--manifest", str(manifest), env=env)
    assert (r.returncode, r.stderr) == (2, expected + "\n")
    r = cli.proc("export", "--manifest", str(manifest), "--out", str(tmp_path / "out.bundle"), env=env)
    assert r.returncode == 8 and expected in r.stderr.splitlines(), r.stderr
    r = cli.proc("check", "--manifest", str(manifest), "--json", env=env)  # (it reads the compile tables)
    assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr
    # said, and the manifest is not complete: that model's options are not known (it said complete)
    assert expected.replace("error: ", "", 1) in r.stderr.splitlines(), r.stderr
    assert json.loads(r.stdout)["host"]["manifest_complete"] is False
