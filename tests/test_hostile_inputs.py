"""Hostile inputs to what cachemgr reads besides the cache itself (issue 14): spool lines, Redis
values, config values; and what keeps processes in check: one daemon per cache dir and index,
workers that die with the CLI. Every case runs the real command as a process and asserts its exit
code, what it says, and what is left behind."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import OWN_PEAK_RSS_PROGRAM, PROGRAMS, REPO, Cli, subprocess_env
from test_daemon import start, wait_until  # noqa: F401 - start: a fixture (daemon processes)
from test_fleet import pg_url  # noqa: F401 - fixture: a throwaway PostgreSQL database

from cachemgr import procs

PREWARM_ENV = {"PYTHONPATH": os.pathsep.join((str(REPO), str(PROGRAMS)))}


def run(*argv: str, timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachemgr", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(**(env or {})),
        **kw,
    )


def one_error_line(r: subprocess.CompletedProcess, code: int, *parts: str) -> str:
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == code and len(lines) == 1, f"exit {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    for p in parts:
        assert p in lines[0], (p, lines[0])
    assert "Traceback" not in r.stderr
    return lines[0]


# -- 1. the spool ----------------------------------------------------------------------------------


def spool_line(model: str = "good", batch: int = 2, **fields) -> bytes:
    """A line as cachemgr.record writes it."""
    from cachemgr.record import signature_hash, signature_text

    spec = {
        "args": [
            {
                "t": "tensor",
                "shape": [batch, 4],
                "dtype": "float32",
                "device": "cpu",
                "requires_grad": False,
                "stride": [4, 1],
            }
        ],
        "kwargs": {},
        "grad": True,
    }
    doc = {
        "v": 1,
        "model": model,
        "kind": "module",
        "ts": time.time(),
        "host": "h",
        "pid": 1,
        "signature_hash": signature_hash(spec, {}),
        "signature": signature_text(spec),
        "spec": spec,
        "options": {},
    }
    doc.update(fields)
    return json.dumps(doc).encode() + b"\n"


def _with(line: bytes, old: bytes, new: bytes) -> bytes:
    assert old in line
    return line.replace(old, new, 1)


GOOD = spool_line()
# what each poisoned line is, and a part of the reason the ingest must give for skipping it
POISON: dict[str, tuple[bytes, str]] = {
    "ts 1e400": (_with(GOOD, b'"ts": ', b'"ts": 1e400, "x": '), "out of range"),
    "ts NaN": (_with(GOOD, b'"ts": ', b'"ts": NaN, "x": '), "NaN is not a number"),
    "ts in the future": (spool_line(ts=1e15), "ts is not a time"),
    "100k [": (b"[" * 100_000 + b"\n", "nested deeper than"),
    "100k { in a field": (b'{"model": "m", "spec": ' + b'{"a": ' * 100_000 + b"\n", "nested deeper than"),
    "deep but valid JSON": (spool_line(options=json.loads("[" * 40 + "]" * 40)), "nested deeper than"),
    "lone surrogate": (spool_line(model="\ud800"), "lone surrogate"),
    "escaped NUL": (spool_line(model="a\u0000b"), "a NUL"),
    "raw NUL bytes": (_with(GOOD, b'"good"', b'"go\x00od"'), "not JSON"),
    "terminal escape": (spool_line(host="\x1b]0;owned\x07"), "control character"),
    "not UTF-8": (_with(GOOD, b'"good"', b'"go\xff\xfeod"'), "not UTF-8"),
    "huge line": (spool_line(signature="x" * 200_000), "longer than 64 KiB"),
    "model not a string": (spool_line(model=["x"]), "model is not a non-empty string"),
    "model too long": (spool_line(model="m" * 300), "model longer than 255"),
    "shape of bools": (
        spool_line(spec={"args": [{"t": "tensor", "shape": [True], "dtype": "float32"}], "kwargs": {}}),
        "a tensor without an integer shape",
    ),
    "negative dim": (
        spool_line(spec={"args": [{"t": "tensor", "shape": [-1], "dtype": "float32"}], "kwargs": {}}),
        "a tensor without an integer shape",
    ),
    "dtype that is a path": (
        spool_line(spec={"args": [{"t": "tensor", "shape": [1], "dtype": "../os.system"}], "kwargs": {}}),
        "a tensor without an integer shape",
    ),
    "int that is a bool": (
        spool_line(spec={"args": [{"t": "int", "v": True}], "kwargs": {}}),
        "a int without its value",
    ),
    "huge integer": (_with(GOOD, b'"ts": ', b'"ts": ' + b"9" * 5000 + b', "x": '), "not JSON"),
    "not an object": (b"[1, 2]\n", "missing model"),
}


def write_spool(spool: Path, lines: list[bytes], name: str = "w-1-abcd.jsonl") -> Path:
    spool.mkdir(parents=True, exist_ok=True)
    path = spool / name
    path.write_bytes(b"".join(lines))
    return path


def config_for(tmp_path: Path, spool: Path, extra: str = "") -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'spool_dir = "{spool}"\n{extra}')
    return cfg


def skipped_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("cachemgr: spool: skipped")]


SPOOL_COMMANDS = {
    "scan": ["scan"],
    "shapes": ["shapes", "--json"],
    "evict": ["evict", "--max-size", "1TiB", "--dry-run"],
    "purge": ["purge", "--older-than", "3650d", "--dry-run"],
}


@pytest.mark.slow  # real processes (torch or cachemgr), several per case
@pytest.mark.parametrize("command", list(SPOOL_COMMANDS))
def test_poisoned_spool_lines_are_skipped_with_their_reason(command, gpu_cache, tmp_path, db_url):
    """One poisoned line among good ones: the command succeeds, names each bad line and why, the
    good lines are ingested, and nothing is left `.ingesting` to fail on again."""
    spool = tmp_path / "spool"
    write_spool(spool, [GOOD] + [line for line, _ in POISON.values()] + [spool_line(batch=3)])
    cli = Cli(gpu_cache, db_url)
    cfg = ["--config", str(config_for(tmp_path, spool))]
    r = cli.proc(*cfg, *SPOOL_COMMANDS[command])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    reported = skipped_lines(r.stderr)
    assert len(reported) == len(POISON), "\n".join(reported)
    for what, (_, reason) in POISON.items():
        assert any(reason in x for x in reported), f"{what}: no {reason!r} in\n" + "\n".join(reported)
    assert all(len(x) < 400 and x.isprintable() for x in reported)
    assert os.listdir(spool) == []  # nothing left `.ingesting`
    shapes = json.loads(cli.proc(*cfg, "shapes", "--json").stdout)
    assert [(s["model"], s["signature"]) for s in shapes] == [("good", "(f32[2,4])"), ("good", "(f32[3,4])")]
    again = cli.proc(*cfg, "scan")
    assert again.returncode == 0 and skipped_lines(again.stderr) == []


def test_poisoned_spool_on_postgresql(gpu_cache, tmp_path, pg_url):  # noqa: F811 - pg_url: the fixture
    """What reaches the index is text PostgreSQL takes (no NUL, no lone surrogate, names within
    the column widths): a poisoned spool ingests there as on SQLite."""
    spool = tmp_path / "spool"
    write_spool(spool, [GOOD] + [line for line, _ in POISON.values()])
    cli = Cli(gpu_cache, pg_url)
    cfg = ["--config", str(config_for(tmp_path, spool))]
    r = cli.proc(*cfg, "shapes", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [s["model"] for s in json.loads(r.stdout)] == ["good"] and len(skipped_lines(r.stderr)) == len(POISON)


@pytest.mark.slow  # real processes (torch or cachemgr), several per case
def test_a_left_over_ingesting_file_with_poison_is_ingested_and_removed(gpu_cache, tmp_path, db_url):
    """A file a crashed (or failing) ingest left taken is processed first, poison and all, and goes."""
    spool = tmp_path / "spool"
    write_spool(spool, [POISON["ts 1e400"][0], GOOD, POISON["100k ["][0]], "w-2-beef.jsonl.ingesting")
    cli = Cli(gpu_cache, db_url)
    cfg = ["--config", str(config_for(tmp_path, spool))]
    r = cli.proc(*cfg, "scan")
    assert r.returncode == 0 and len(skipped_lines(r.stderr)) == 2, r.stderr
    assert os.listdir(spool) == []
    assert [s["model"] for s in json.loads(cli.proc(*cfg, "shapes", "--json").stdout)] == ["good"]


@pytest.mark.slow  # real processes (torch or cachemgr), several per case
def test_spool_entries_that_are_no_regular_files_are_set_aside_without_blocking(gpu_cache, tmp_path, db_url):
    """A FIFO would block a reader for ever, a link to /dev/zero never ends, a directory cannot be
    read, a file over the size cap is not read: each is set aside with its reason."""
    spool = tmp_path / "spool"
    write_spool(spool, [GOOD])
    os.mkfifo(spool / "fifo.jsonl")
    (spool / "zero.jsonl").symlink_to("/dev/zero")
    (spool / "dir.jsonl").mkdir()
    with open(spool / "big.jsonl", "wb") as f:
        f.truncate(300 * 1024 * 1024)  # sparse: 300 MiB of NULs
    cli = Cli(gpu_cache, db_url)
    cfg = ["--config", str(config_for(tmp_path, spool))]
    r = cli.proc(*cfg, "scan", timeout=120)
    assert r.returncode == 0, r.stderr
    said = "\n".join(skipped_lines(r.stderr))
    for name, reason in (
        ("fifo", "not a regular file"),
        ("zero", "a symbolic link (never followed)"),
        ("dir", "not a regular file"),
        ("big", "314572800 bytes, over the 256 MiB"),
    ):
        assert f"{name}.jsonl.ingesting: {reason}" in said, said
    assert not [n for n in os.listdir(spool) if n.endswith((".jsonl", ".ingesting"))]
    assert os.readlink(next(spool.glob("zero.jsonl.ingesting.bad-*"))) == "/dev/zero"  # set aside, not followed
    assert [s["model"] for s in json.loads(cli.proc(*cfg, "shapes", "--json").stdout)] == ["good"]


def _rss_of(argv: list[str], env: dict) -> tuple[int, int, str]:
    """(exit code, peak RSS in MiB of that process, stderr), measured by wait4 on it alone."""
    with subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as p:
        stderr = p.stderr.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss // 1024, stderr


@pytest.mark.slow  # real processes (torch or cachemgr), several per case
def test_a_huge_spool_line_is_read_in_bounded_memory(gpu_cache, tmp_path, db_url):
    """128 MiB in one line (no newline until the end): skipped, and the scan's peak RSS is within
    32 MiB of the same scan with a small spool (the file is never held whole; a whole read and a
    split, as before, cost 256 MiB more)."""

    def scan(spool: Path, db: str) -> tuple[int, str]:
        argv = [
            sys.executable,
            "-m",
            "cachemgr",
            *Cli(gpu_cache, db).base(),
            "--config",
            str(config_for(tmp_path, spool)),
            "scan",
        ]
        code, rss, stderr = _rss_of(argv, subprocess_env())
        assert code == 0, stderr
        return rss, stderr

    write_spool(tmp_path / "small", [GOOD])
    base, _ = scan(tmp_path / "small", f"sqlite:///{tmp_path / 'base.db'}")
    path = write_spool(tmp_path / "spool", [])
    with open(path, "wb") as f:
        f.write(b'{"model": "')
        f.seek(128 * 1024 * 1024)
        f.write(b'x"}\n' + GOOD)
    rss, stderr = scan(tmp_path / "spool", db_url)
    assert rss - base < 32, f"peak RSS {rss} MiB, {base} MiB with a small spool"
    assert skipped_lines(stderr) == [f"cachemgr: spool: skipped {path.name}.ingesting:1: longer than 64 KiB"]


def test_bad_rows_an_older_ingest_stored_do_not_break_shapes(gpu_cache, tmp_path, db_url):
    """Rows written before these checks (deep JSON, a surrogate, a spec that is no spec) are left
    out of `shapes` and of prewarm's plan, instead of failing them."""
    from sqlalchemy import insert

    from cachemgr.index.db import Database
    from cachemgr.index.models import Shape

    db = Database(db_url)
    now = time.time()
    rows = [
        ("deep", "[" * 5000 + "]" * 5000),
        ("surrogate", json.dumps({"args": [{"t": "str", "v": "\ud800"}]})),
        ("nospec", "7"),
        ("notjson", "{"),
    ]
    with db.engine.begin() as conn:
        conn.execute(
            insert(Shape),
            [
                {
                    "model": m,
                    "signature_hash": f"{i:016x}",
                    "signature": "(x)",
                    "spec": spec,
                    "options": "{}",
                    "first_seen": now,
                    "last_seen": now,
                }
                for i, (m, spec) in enumerate(rows)
            ],
        )
    db.close()
    spool = tmp_path / "spool"
    write_spool(spool, [GOOD])
    cli = Cli(gpu_cache, db_url)
    r = cli.proc("--config", str(config_for(tmp_path, spool)), "shapes", "--json")
    assert r.returncode == 0, r.stderr
    assert [s["model"] for s in json.loads(r.stdout)] == ["good"]


@pytest.mark.slow  # real processes (torch or cachemgr), several per case
def test_the_recorder_refuses_what_the_ingester_would_skip(tmp_path):
    """A signature whose line could never be ingested is a warning in the workload, not a line
    that poisons the spool; a float argument of nan or inf is recorded (JSON has no such numbers)."""
    code = """
import math, warnings, json, sys, torch, cachemgr.record as r
sp = r.Spool(sys.argv[1])
f = r.compile(lambda x, s: x * 2, name="f", backend="eager", spool=sp)
f(torch.randn(2), float("nan"))
f(torch.randn(2), float("-inf"))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    f(torch.randn(2), "\\x1b[2J")
    f(torch.randn(2), "y" * 100_000)
print(json.dumps([str(x.message) for x in w]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "spool")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(warned) == 2 and "control character" in warned[0] and "longer than 4096" in warned[1], warned
    from cachemgr.prewarm.spool import parse_line

    (name,) = os.listdir(tmp_path / "spool")
    lines = (tmp_path / "spool" / name).read_bytes().splitlines(keepends=True)
    docs = [parse_line(x) for x in lines]  # every line written is one the ingester takes
    assert [d["signature"] for d in docs] == ["(f32[2], nan)", "(f32[2], -inf)"]


# -- 2. Redis values -------------------------------------------------------------------------------


@pytest.fixture
def own_redis(redis_url):
    """(URL, client) of the session's own Redis database, emptied for this test."""
    import redis

    yield redis_url, redis.Redis.from_url(redis_url)


ATTACK = "pickle-ran"  # a file the hostile pickle would create if anything executed it


def hostile_redis(r, tmp_path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Write every kind of hostile remote-cache key and value; return, for the keys and for the
    values, key (as shown) -> a part of the reason it is skipped."""
    import base64
    import pickle

    marker = tmp_path / ATTACK
    bomb = b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."  # os.system('touch ...') on load
    assert pickle.dumps(0) and not marker.exists()

    def value(data) -> bytes:
        return json.dumps({"data": data, "time_taken_ms": 5}).encode()

    aot = "pt2:autograd-experimental::{}:c1"
    r.set(b"pt2:fx-graph-v1::\xff\xfe:c1", value("AAAA"))
    r.set("pt2:fx-graph-v1::\x1b[2J:c1", value("AAAA"))
    r.set("pt2:fx-graph-v1::" + "k" * 2000 + ":c1", value("AAAA"))
    r.set("pt2:nonsense", b"x")
    r.rpush("pt2:fx-graph-v1::flist:c1", b"a", b"b")
    r.hset("pt2:autograd-experimental::ahash:c1", "data", "x")
    r.set(aot.format("apickle"), value(base64.b64encode(bomb).decode()))
    r.set(aot.format("adeep"), b"[" * 100_000)
    r.set(aot.format("anotb64"), value("!!! not base64 !!!"))
    r.set(aot.format("anodata"), b'{"time_taken_ms": 1}')
    r.set(aot.format("ahuge"), b"x" * (65 * 1024 * 1024))
    r.set(aot.format("ameta"), value("AAAA"))
    r.hset("cachemgr:meta", aot.format("ameta"), b"[" * 5000)
    return {
        "pt2:fx-graph-v1::\\xff\\xfe:c1": "key is not UTF-8",
        "pt2:fx-graph-v1::\\x1b[2J:c1": "not printable",
        "pt2:fx-graph-v1::" + "k" * 283: "key of 2020 bytes",
        "pt2:nonsense": "not a torch remote-cache key",
        "pt2:fx-graph-v1::flist:c1": "a Redis list under a torch key",
        "pt2:autograd-experimental::ahash:c1": "a Redis hash under a torch key",
    }, {
        aot.format("apickle"): "cannot read it",
        aot.format("adeep"): "nested JSON",
        aot.format("anotb64"): "'data' is not base64",
        aot.format("anodata"): "no base64 'data' field",
        aot.format("ahuge"): "cachemgr reads",
        aot.format("ameta"): "cachemgr:meta: not a remote-cache meta field: nested JSON",
    }


def _age(r, key: str | bytes, seconds: int) -> None:
    r.restore(key, 0, r.dump(key), replace=True, idletime=seconds)


def test_hostile_redis_values_are_skipped_items_with_reasons(own_redis, tmp_path, db_url):
    """stats, evict --dry-run and evict: each hostile key or value is a skipped item with its
    reason (in the text and in --json), nothing executes, the command exits 0, and eviction
    deletes only values Inductor could have written."""
    url, r = own_redis
    key_problems, value_problems = hostile_redis(r, tmp_path)
    r.set("pt2:fx-graph-v1::fgood:c1", json.dumps({"data": "AAAA", "time_taken_ms": 5}))
    cli = Cli(tmp_path / "cache", db_url)

    stats = run(*cli.base(), "remote", "--redis", url, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    doc = json.loads(stats.stdout)
    shown = {x["key"]: x["reason"] for x in doc["skipped"]}
    for key, reason in key_problems.items():
        assert any(k.startswith(key[:60]) and reason in why for k, why in shown.items()), (key, shown)
    # the values that are strings under well-formed keys are entries (stats reads no values)
    assert doc["entries"] == 1 + len(value_problems) and doc["other_keys"] == 1  # the claim key
    text = run(*cli.base(), "remote", "--redis", url, "stats")
    assert text.returncode == 0 and f"{len(shown)} skipped" in text.stdout, text.stderr
    assert all(x.isprintable() for x in text.stderr.splitlines())
    assert sum(1 for x in text.stderr.splitlines() if x.startswith("cachemgr: remote: skipped ")) == len(shown)

    def reasons(out: str) -> dict[str, str]:
        why: dict[str, str] = {}
        for x in json.loads(out)["skipped"]:
            why[x["key"]] = why.get(x["key"], "") + " | " + x["reason"]
        return why

    dry = run(*cli.base(), "remote", "--redis", url, "evict", "--max-age", "1d", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    why = reasons(dry.stdout)  # (a dry run reads no value: those it would read are named as not read)
    for key, reason in value_problems.items():
        assert reason in why.get(key, "") or "a dry run reads no value" in why.get(key, ""), (key, why)
    assert not (tmp_path / ATTACK).exists()

    for k in r.scan_iter(match="pt2:*"):
        _age(r, k, 40 * 86400)
    done = run(*cli.base(), "remote", "--redis", url, "evict", "--max-age", "30d", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["result"]["deleted"], done.stderr
    why = reasons(done.stdout)
    for key, reason in value_problems.items():
        assert reason in why.get(key, ""), (key, why.get(key), why)
    # (an AOT value read by that run was read: it stays, as one read by a workload would; once
    # aged again, the next run takes it without reading it again, what it needs known)
    for k in r.scan_iter(match="pt2:*"):
        _age(r, k, 40 * 86400)
    done = run(*cli.base(), "remote", "--redis", url, "evict", "--max-age", "30d")
    assert done.returncode == 0 and "freed" in done.stdout, done.stderr
    left = {k for k in r.scan_iter(match="pt2:*")}
    # every string value under a torch key went; what is not Inductor's (bad names, other types) stayed
    assert left == {
        b"pt2:fx-graph-v1::\xff\xfe:c1",
        b"pt2:fx-graph-v1::\x1b[2J:c1",
        ("pt2:fx-graph-v1::" + "k" * 2000 + ":c1").encode(),
        b"pt2:nonsense",
        b"pt2:fx-graph-v1::flist:c1",
        b"pt2:autograd-experimental::ahash:c1",
    }
    assert not (tmp_path / ATTACK).exists()


def test_a_meta_key_of_the_wrong_type_is_ignored(own_redis, tmp_path, db_url):
    url, r = own_redis
    r.set("pt2:fx-graph-v1::fgood:c1", json.dumps({"data": "AAAA", "time_taken_ms": 5}))
    r.rpush("cachemgr:meta", "x")
    cli = Cli(tmp_path / "cache", db_url)
    for args in (["stats"], ["evict", "--max-age", "1d", "--dry-run"]):
        res = run(*cli.base(), "remote", "--redis", url, *args, "--json")
        assert res.returncode == 0, res.stderr
    doc = json.loads(run(*cli.base(), "remote", "--redis", url, "stats", "--json").stdout)
    assert (
        doc["entries"] == 1
        and {"key": "cachemgr:meta", "reason": "a Redis list, not cachemgr's hash: ignored"} in doc["skipped"]
    )


def test_push_skips_a_key_that_holds_another_type(own_redis, gpu_cache, tmp_path, db_url):
    url, r = own_redis
    cli = Cli(gpu_cache, db_url)
    assert cli.proc("scan").returncode == 0
    fx = json.loads(cli.proc("ls", "--kind", "fxgraph", "--json").stdout)
    taken = f"pt2:fx-graph-v1::{fx[0]['graph_key']}:c1"
    r.rpush(taken, "not a value")
    res = cli.proc("remote", "--redis", url, "push", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert {
        "key": taken,
        "reason": "a Redis list is stored under this key; left as it is (--force overwrites it)",
    } in doc["skipped"]
    assert r.type(taken) == b"list" and doc["pushed"] > 0 and taken not in doc["keys"]
    text = cli.proc("remote", "--redis", url, "push")
    assert text.returncode == 0 and "1 skipped" in text.stdout and f"skipped {taken}: a Redis list" in text.stderr


def test_no_redis_configured_is_a_usage_error(tmp_path, db_url):
    """Without --redis, redis_url or Inductor's variables, `remote` does not guess localhost (it
    did, while `prewarm --target redis` refused): one line, exit 2."""
    cli = Cli(tmp_path / "cache", db_url)
    for args in (["stats"], ["push"], ["evict", "--max-age", "1d"]):
        one_error_line(run(*cli.base(), "remote", *args), 2, "no Redis is configured", "--redis URL", "redis_url")


# -- 3. config values ------------------------------------------------------------------------------

BAD_TOML = {  # a TOML line -> what the message must say beside key and source
    "max_size = true": "not true/false",
    "max_size = -5": "must not be negative",
    "max_size = 1.5e9": "whole number of bytes",
    "grace = -100": "must be at least 0s",
    "evict_interval = inf": "finite",
    "scan_interval = 0": "at least 1s",
    "max_age = 1e30": "at most 10 years",
    "debounce = inf": "finite",
    "debounce = nan": "finite",
    "max_wait = 86400": "at most 3600s",
    "low_water = nan": "finite",
    "low_water = true": "not true/false",
    "max_files = 1.5": "whole number",
    "max_files = true": "whole number",
    "max_files = -1": "whole number >= 0",
    "keep_torch = [1]": "torch version string",
    'keep_torch = [""]': "empty version",
    'keep_torch = "2.1,,2.2"': "empty version",
    'cache_dir = "/tmp/a\\u0000b"': "NUL",
    "cache_dir = 5": "must be a string",
    "policy = true": "'lru' or 'cost'",
    "metrics = false": "'off' or HOST:PORT",
    'host = ""': "must not be empty",
    "min_free = true": "not true/false",
    "redis_url = [1]": "must be a string",
}


@pytest.mark.parametrize("line", list(BAD_TOML))
def test_toml_values_go_through_the_same_checks_as_variables(line, tmp_path):
    """Every TOML type (bool, negative, inf, nan, fractions, lists) meets the parse and range
    checks CACHEMGR_* strings meet: a ConfigError naming key and file, exit 2."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(line + "\n")
    key = line.split(" ")[0]
    one_error_line(run("--config", str(cfg), "config", "show"), 2, f"{key} from file {cfg}", BAD_TOML[line])


@pytest.mark.parametrize(
    "name,value,says",
    [
        ("GRACE", "-100", "invalid duration"),
        ("EVICT_INTERVAL", "inf", "invalid duration"),
        ("DEBOUNCE", "2h", "at most 3600s"),
        ("LOW_WATER", "nan", "(0, 1]"),
        ("LOW_WATER", "inf", "(0, 1]"),
        ("MAX_FILES", "1.5", "whole number"),
        ("MAX_SIZE", "-5", "invalid size"),
        ("KEEP_TORCH", "a,,b", "empty version"),
        ("DB", "sqlite:////tmp/%00x.db", "must not contain a NUL byte (%00)"),  # (it was exit 70)
    ],
)
def test_variables_and_flags_meet_the_same_checks(name, value, says, tmp_path):
    r = run("config", "show", env={f"CACHEMGR_{name}": value})
    one_error_line(r, 2, f"{name.lower()} from env CACHEMGR_{name}", says)


@pytest.mark.parametrize(
    "variable,name",
    [("CACHEMGR_CACHE_DIR", "cache_dir"), ("TORCHINDUCTOR_CACHE_DIR", "cache_dir"), ("XDG_STATE_HOME", "db")],
)
def test_a_name_that_is_not_utf8_is_a_usage_error(variable, name, tmp_path):
    """A cache dir, or the state dir under a default index, named by bytes that are not UTF-8 (they
    reach Python as lone surrogates): the index keeps names as text, and every command stopped
    with exit 70 at its first write of the name."""
    bad = str(tmp_path / "c_\udcff")  # (the byte 0xff in the environment)
    env = {variable: bad}
    if variable == "XDG_STATE_HOME":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    one_error_line(run("stats", env=env), 2, f"{name} from env {variable}", "must be UTF-8")


def test_an_integer_longer_than_python_converts_is_a_bad_config_file(tmp_path):
    """tomllib raises a plain ValueError past 4,300 digits (it was exit 70, and a daemon reloading
    such a file died); the same file as a manifest is refused alike."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("unknown_key = " + "9" * 4301 + "\n")
    one_error_line(run("--config", str(cfg), "config", "show"), 2, f"config file {cfg}: not valid TOML")
    one_error_line(run("--config", str(cfg), "stats"), 2, "not valid TOML")


def test_a_key_set_at_the_top_level_and_under_cachemgr_is_refused(tmp_path):
    """Both places set: which was meant? (the top level used to win, with no word)"""
    cfg = tmp_path / "config.toml"
    cfg.write_text('grace = "1m"\nmax_size = "1GiB"\n[cachemgr]\ngrace = "2m"\n')
    one_error_line(run("--config", str(cfg), "config", "show"), 2, f"config file {cfg}: grace set both")
    cfg.write_text('max_size = "1GiB"\n[cachemgr]\ngrace = "2m"\n')  # each once: both kept
    assert "2m" in run("--config", str(cfg), "config", "show").stdout


def test_a_daemon_refuses_a_bad_config_at_start(tmp_path, db_url):
    cfg = tmp_path / "config.toml"
    cfg.write_text("grace = -100\n")
    (tmp_path / "cache").mkdir()
    r = run("--config", str(cfg), *Cli(tmp_path / "cache", db_url).base(), "daemon", timeout=60)
    one_error_line(r, 2, f"grace from file {cfg}")


def test_sighup_with_hostile_values_keeps_the_running_config(tmp_path, start):  # noqa: F811 - the fixture
    """Values that used to kill the daemon at reload (inf intervals) or silently kill its consumer
    thread (an infinite debounce) are refused; the daemon keeps the config it runs."""
    cache = tmp_path / "cache"
    cache.mkdir()
    cfg = tmp_path / "config.toml"
    cfg.write_text('evict_interval = "10m"\ndebounce = "0.3s"\n')
    d = start(cache, config=cfg)
    for bad in (
        "evict_interval = inf",
        "debounce = nan",
        "debounce = inf",
        "grace = -100",
        "max_size = true",
        "low_water = nan",
        "scan_interval = 1e400",
    ):
        cfg.write_text(bad + "\n")
        n = len(d.messages)
        d.proc.send_signal(signal.SIGHUP)
        d.wait_message("READY=1", since=n)  # reading the notify socket also keeps it from filling up
        assert f"reload failed, keeping the running config: {bad.split()[0]} from file {cfg}" in d.logs()
        assert d.proc.poll() is None
    cfg.write_text('evict_interval = "2m"\ndebounce = "0.3s"\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("reloading config: evict_interval")  # from the 10m it kept running with
    assert d.stop() == 0
    assert "Traceback" not in d.logs()


# -- 4. one daemon per cache dir and index ---------------------------------------------------------


def second_daemon(start, cache: Path, **kw):  # noqa: F811 - start: the fixture's function
    d = start(cache, wait_ready=False, **kw)
    assert d.proc.wait(60) == 10, d.logs()
    lines = [x for x in d.logs().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("cachemgr: error: another cachemgr daemon (PID "), d.logs()
    return lines[0]


def test_a_second_daemon_on_the_same_cache_and_index_exits_10(tmp_path, start):  # noqa: F811
    cache = tmp_path / "cache"
    cache.mkdir()
    first = start(cache)
    line = second_daemon(start, cache)
    assert f"(PID {first.proc.pid}) already serves cache dir {cache} and this index" in line
    assert first.proc.poll() is None
    assert first.stop() == 0
    again = start(cache)  # the lock went with the process; its file (with the old PID) blocks nobody
    assert again.stop() == 0


def test_exit_10_is_documented():
    r = run("daemon", "--help")
    assert r.returncode == 0 and "10  another daemon already serves this cache dir or index" in r.stdout
    assert "10 another daemon already serves the cache dir or index" in (REPO / "README.md").read_text()


def test_a_second_daemon_with_another_index_exits_10(tmp_path, start):  # noqa: F811
    """Two daemons on one cache with different indexes would both evict it."""
    cache = tmp_path / "cache"
    cache.mkdir()
    first = start(cache)
    line = second_daemon(start, cache, db=f"sqlite:///{tmp_path / 'other.db'}")
    assert f"(PID {first.proc.pid}) already serves cache dir {cache} (with another index" in line
    assert first.stop() == 0


def test_a_second_daemon_with_another_state_dir_exits_10(tmp_path, start):  # noqa: F811
    """Another user, or the service beside a shell: other state dirs, other indexes. The lock on
    the cache directory itself is what they share; /proc/locks names the holder."""
    cache = tmp_path / "cache"
    cache.mkdir()
    first = start(cache)
    line = second_daemon(
        start, cache, db=f"sqlite:///{tmp_path / 'other.db'}", env={"XDG_STATE_HOME": str(tmp_path / "other-state")}
    )
    assert f"(PID {first.proc.pid}) already serves cache dir {cache} (perhaps as another user)" in line
    assert first.stop() == 0


def test_daemons_on_different_caches_share_one_index(tmp_path, start):  # noqa: F811
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = start(tmp_path / "a"), start(tmp_path / "b")
    assert a.stop() == 0 and b.stop() == 0


def test_reload_onto_a_cache_another_daemon_serves_keeps_the_running_config(tmp_path, start, db_url):  # noqa: F811
    """SIGHUP with a config whose cache_dir another daemon holds: refused, the daemon goes on."""
    from test_daemon import Daemon

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start(tmp_path / "a")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'cache_dir = "{tmp_path / "b"}"\n')
    d = Daemon(tmp_path / "b", db_url, config=cfg)
    try:
        # no --cache-dir flag: the config names the cache, so a reload can move it
        d.proc.kill()
        d.proc.wait()
        d.log.truncate(0)
        d.proc = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", "--db", db_url, "--host", "testhost", "--config", str(cfg), "daemon"],
            env=subprocess_env(NOTIFY_SOCKET=d.sock_path),
            stdout=d.log,
            stderr=subprocess.STDOUT,
        )
        d.wait_message("READY=1")
        cfg.write_text(f'cache_dir = "{tmp_path / "a"}"\n')
        n = len(d.messages)
        d.proc.send_signal(signal.SIGHUP)
        d.wait_message("READY=1", since=n)
        assert (
            f"reload failed, keeping the running config: another cachemgr daemon (PID {first.proc.pid}) "
            f"already serves cache dir {tmp_path / 'a'}"
        ) in d.logs()
        assert f"STATUS=watching {tmp_path / 'b'}" in d.messages[-1]
        assert d.stop() == 0 and first.stop() == 0
    finally:
        d.close()


# -- 5. child processes die with their parent ------------------------------------------------------

HANGING = """
model = [
    { name = "mlp", factory = "prewarm_models:mlp", train = true, shapes = [["f32[4,16]"], ["f32[8,16]"]] },
    { name = "sleepy", factory = "prewarm_models:sleepy", compile = { backend = "eager" }, shapes = [["f32[2,2]"]] },
]
"""  # a run left alone would compile the mlp, then hang for 600 s in sleepy


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Running:
    """A `cachemgr prewarm` process whose stderr is read line by line as it comes."""

    def __init__(self, cli: Cli, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", *cli.base(), "prewarm", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(**PREWARM_ENV),
            # Ctrl-C as a terminal delivers it: a test run started in the background (`cmd &` in a
            # script) hands its children SIGINT ignored, and Python then never raises KeyboardInterrupt
            preexec_fn=_default_sigint,
        )
        self.queue: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.queue.put(line.rstrip("\n"))
        self.queue.put(None)

    def wait_line(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, f"no line matching {pattern!r} before exit: {self.seen}"
            self.seen.append(line)
            if m := re.search(pattern, line):
                return m

    def rest(self) -> list[str]:
        while (line := self.queue.get(timeout=60)) is not None:
            self.seen.append(line)
        return self.seen


def tree(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _cleanup(worker: int | None, run: Running) -> None:
    if worker and procs.group_members(worker):
        os.killpg(worker, signal.SIGKILL)
    if run.proc.poll() is None:
        run.proc.kill()
        run.proc.wait()


@pytest.mark.slow  # a prewarm worker starts torch
def test_ctrl_c_during_prewarm_stops_the_worker(tmp_path, db_url):
    """SIGINT while the worker compiles: the CLI kills the worker's process group (torch's compile
    processes in it too) and waits for it, then exits 130; nothing compiles or writes after."""
    (tmp_path / "m.toml").write_text(HANGING)
    cache = tmp_path / "cache"
    p = Running(Cli(cache, db_url), "--manifest", str(tmp_path / "m.toml"))
    worker = None
    try:
        worker = int(p.wait_line(r"worker (\d+) started on cpu").group(1))
        p.wait_line(r"model 'mlp' shape #0 \(f32\[4,16\]\): compiling")
        p.proc.send_signal(signal.SIGINT)
        assert p.proc.wait(120) == 130
        assert procs.group_members(worker) == []  # the worker and everything it started: gone
        assert "cachemgr: interrupted" in p.rest()
        before = tree(cache)
        time.sleep(2)  # an observation window, not a synchronisation: nothing is left to write
        assert tree(cache) == before
    finally:
        _cleanup(worker, p)


@pytest.mark.slow  # a prewarm worker starts torch
def test_a_killed_prewarm_takes_its_worker_with_it(tmp_path, db_url):
    """SIGKILL of the CLI (no chance to clean up): the worker dies too (PR_SET_PDEATHSIG)."""
    (tmp_path / "m.toml").write_text(HANGING)
    p = Running(Cli(tmp_path / "cache", db_url), "--manifest", str(tmp_path / "m.toml"))
    worker = None
    try:
        worker = int(p.wait_line(r"worker (\d+) started on cpu").group(1))
        p.wait_line(r"model 'mlp' shape #0 \(f32\[4,16\]\): compiling")
        p.proc.kill()
        p.proc.wait()
        wait_until(lambda: not procs.group_members(worker), timeout=60)
    finally:
        _cleanup(worker, p)


POOL = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from cachemgr import procs

def pid(_):
    return os.getpid()

if __name__ == "__main__":
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                               initializer=procs.die_with_parent, initargs=(os.getpid(),))
    print(" ".join(str(p) for p in set(pool.map(pid, range(20)))), flush=True)
    time.sleep(600)
"""


def test_die_with_parent_as_a_pool_initializer_leaves_no_workers(tmp_path):
    """A SIGKILLed scan used to leave its parse workers running: with the initializer they go."""
    (tmp_path / "pool.py").write_text(POOL)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "pool.py")], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert pids and all(Path(f"/proc/{p}").exists() for p in pids)
    finally:
        proc.kill()
        proc.wait()
    wait_until(lambda: not any(_alive(p) for p in pids), timeout=30)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_die_with_parent_exits_when_the_parent_is_already_gone():
    """The race the kernel cannot see (the parent died before the prctl) is closed by the check."""
    r = subprocess.run(
        [sys.executable, "-c", "from cachemgr import procs; procs.die_with_parent(1); print('alive')"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert r.returncode == 1 and r.stdout == ""


# -- 6. prewarm checks what it can before torch, and says what it does -----------------------------


@pytest.mark.slow  # a prewarm worker starts torch
def test_cuda_on_a_host_without_cuda_is_exit_2_before_any_worker(tmp_path, db_url, cpp_builds):
    if os.path.exists("/proc/driver/nvidia/version"):
        pytest.skip("this host has an NVIDIA driver")
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "g"\nfactory = "prewarm_models:mlp"\ndevice = "cuda"\nshapes = [["f32[2,16]"]]\n'
    )
    cli = Cli(tmp_path / "cache", db_url)
    r = run(*cli.base(), "prewarm", "--manifest", str(tmp_path / "m.toml"), env=PREWARM_ENV)
    one_error_line(r, 2, "model 'g': field 'device' 'cuda': this host has no CUDA device")
    (tmp_path / "c.toml").write_text(
        '[[model]]\nname = "c"\nfactory = "prewarm_models:mlp"\nshapes = [["f32[2,16]"]]\n'
    )
    r = run(*cli.base(), "prewarm", "--manifest", str(tmp_path / "c.toml"), "--devices", "cuda:0", env=PREWARM_ENV)
    one_error_line(r, 2, "--devices cuda:0: this host has no CUDA device")
    cpp_builds.seed(tmp_path / "cache")  # the vector-ISA probes a first compile builds (conftest.Builds)
    r = run(
        *cli.base(),
        "prewarm",
        "--manifest",
        str(tmp_path / "c.toml"),
        env={**PREWARM_ENV, "CUDA_VISIBLE_DEVICES": ""},
        timeout=600,
    )  # a CPU model runs whatever CUDA_VISIBLE_DEVICES says
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_factory_nowhere_to_import_is_exit_2_before_any_worker(tmp_path, db_url):
    """Found as the import system would find it, but without running anything: a package whose
    __init__ has side effects is not imported by the check."""
    pkg = tmp_path / "pkgs" / "sidefx"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    factories = {
        "gone": "no_such_pkg.models:build",
        "flat": "prewarm_models.nope:build",
        "side": "sidefx.missing:build",
    }
    (tmp_path / "m.toml").write_text(
        "".join(
            f'[[model]]\nname = "{name}"\nfactory = "{factory}"\nshapes = [["f32[2,3]"]]\n'
            for name, factory in factories.items()
        )
    )
    env = {"PYTHONPATH": os.pathsep.join((PREWARM_ENV["PYTHONPATH"], str(tmp_path / "pkgs")))}
    r = run(*Cli(tmp_path / "cache", db_url).base(), "prewarm", "--manifest", str(tmp_path / "m.toml"), env=env)
    one_error_line(
        r,
        2,
        "model 'gone': field 'factory' 'no_such_pkg.models:build': cannot import module "
        "'no_such_pkg.models': no module named 'no_such_pkg'",
        "no module named 'prewarm_models.nope'",
        "no module named 'sidefx.missing'",
    )
    assert not (tmp_path / "ran").exists()


def test_manifest_shapes_with_empty_dims_are_refused(tmp_path, db_url):
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "a"\nfactory = "prewarm_models:mlp"\nshapes = [["f32[8,,32]"]]\n'
    )
    r = run(*Cli(tmp_path / "cache", db_url).base(), "prewarm", "--manifest", str(tmp_path / "m.toml"), env=PREWARM_ENV)
    one_error_line(r, 2, "field 'shapes[0][0]'", "whole numbers between the commas", "'f32[8,,32]'")


@pytest.mark.slow  # a prewarm worker starts torch
def test_progress_from_the_start_the_real_cause_of_a_shape_failure_and_human_bundle_lines(tmp_path, db_url, cpp_builds):
    """A line when the worker starts (before torch is up), per model and per shape; a wrong input
    shape names the mismatch, not torch's wrapper; export and import print lines, not dicts;
    export into a missing folder is one line, exit 2."""
    (tmp_path / "m.toml").write_text("""
[[model]]
name = "head"
factory = "prewarm_models:gelu_head"
compile = { dynamic = false }
shapes = [["f32[2,8]", 0.5]]

[[model]]
name = "wrong"
factory = "prewarm_models:mlp"
shapes = [["f32[8,3]"]]
""")
    cache = tmp_path / "cache"
    cpp_builds.seed(cache)  # the vector-ISA probes a first compile builds (conftest.Builds); no graph
    cli = Cli(cache, db_url)
    p = Running(cli, "--manifest", str(tmp_path / "m.toml"), "--json")
    try:
        p.wait_line(r"^prewarm: worker \d+ started on cpu \(2 model\(s\), 2 shape\(s\)\); starting torch$")
        p.wait_line(r"^prewarm: worker \d+: torch \S+ ready on cpu$")
        p.wait_line(r"^prewarm: model 'head': 1 shape\(s\) on cpu$")
        p.wait_line(r"^prewarm: model 'head' shape #0 \(f32\[2,8\], 0.5\) no_grad: compiling$")
        p.wait_line(r"^prewarm: model 'head' shape #0: ok in \d+\.\d s \(\d+ fxgraph hit\(s\), \d+ miss\(es\)\)$")
        failed = p.wait_line(r"^prewarm: model 'wrong' shape #0: failed: (.*)$").group(1)
        assert p.proc.wait(600) == 8
    finally:
        _cleanup(None, p)
    assert failed.startswith("RuntimeError: a and b must have same reduction dim, but got [8, 3] X [16, 32]"), failed
    assert "RuntimeError when making fake tensor call" in failed  # what torch raised it as, after the cause
    doc = json.loads(p.proc.stdout.read())
    assert any("[8, 3] X [16, 32]" in f for f in doc["failures"])

    missing = tmp_path / "nope" / "x.bundle"
    one_error_line(
        run(*cli.base(), "export", "--out", str(missing), env=PREWARM_ENV),
        2,
        f"export --out {missing}: folder {missing.parent} does not exist",
    )
    out = tmp_path / "cache.bundle"
    r = run(*cli.base(), "export", "--out", str(out), env=PREWARM_ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.fullmatch(
        rf"wrote {re.escape(str(out))}: [\d.]+ (B|KiB|MiB), \d+ inductor.*; torch \S+, Triton .*, GPU -\n", r.stdout
    ), r.stdout
    r = run(*Cli(tmp_path / "other", db_url).base(), "import", str(out), env=PREWARM_ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        re.fullmatch(
            rf"check: 1 of 1 graphs will hit here\nimported {re.escape(str(out))} "
            rf"into {re.escape(str(tmp_path / 'other'))}: \d+ inductor.*\n",
            r.stdout,
        )
        and "{" not in r.stdout
    ), r.stdout


def test_prewarm_target_redis_without_a_redis_is_a_usage_error(tmp_path, db_url):
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "a"\nfactory = "prewarm_models:mlp"\nshapes = [["f32[2,16]"]]\n'
    )
    r = run(
        *Cli(tmp_path / "cache", db_url).base(),
        "prewarm",
        "--manifest",
        str(tmp_path / "m.toml"),
        "--target",
        "redis",
        env=PREWARM_ENV,
    )
    line = one_error_line(r, 2, "prewarm --target redis: no Redis is configured", "set redis_url")
    assert "--redis" not in line  # (an option of `remote`, not of prewarm)


def test_many_large_shape_rows_are_listed_in_bounded_memory(tmp_path, db_url):
    """1,000 rows of about 60 KiB of spec and 32 KiB of options each (the spool's writers choose
    how many there are): `shapes --json` writes them out one at a time, and the table reads them
    twice, for its widths and to print, instead of holding them: the command's own peak RSS stays
    under 200 MiB (about 100; holding the rows, and the JSON document, took 510 MiB for --json and
    240 MiB for the table). The JSON is the one document it always was."""
    from sqlalchemy import insert

    from cachemgr.index.db import Database
    from cachemgr.index.models import Shape

    db = Database(db_url)
    now = time.time()

    def spec(batch: int) -> dict:
        tensor = json.loads(GOOD)["spec"]["args"][0]
        return {"args": [{**tensor, "shape": [batch, 4]}] + [{"t": "str", "v": "y" * 4000}] * 15, "kwargs": {}}

    options = json.dumps({f"k{i}": "z" * 4000 for i in range(8)})
    n = 1000
    with db.engine.begin() as conn:
        for start in range(0, n, 100):
            conn.execute(
                insert(Shape),
                [
                    {
                        "model": "big",
                        "signature_hash": f"{i:016x}",
                        "signature": f"(f32[{i + 1},4])",
                        "spec": json.dumps(spec(i + 1)),
                        "options": options,
                        "first_seen": now - n + i,
                        "last_seen": now - n + i,
                    }
                    for i in range(start, start + 100)
                ],
            )
    db.close()
    config = str(config_for(tmp_path, tmp_path / "spool"))
    for args in (["--json"], []):
        out = subprocess.run(
            [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *Cli(tmp_path / "cache", db_url).base()]
            + ["--config", config, "shapes", *args],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        peak = int(out.stderr.split("peak-rss-mib")[1].split()[0])
        assert peak < 200, f"shapes {' '.join(args)}: own peak RSS {peak} MiB"
        if args:
            doc = json.loads(out.stdout)
            assert [d["signature_hash"] for d in doc] == [f"{i:016x}" for i in range(n)]
            assert doc[0]["varied"] == ["args[0].0"] and len(doc[-1]["spec"]["args"]) == 16
            assert out.stdout.endswith("}\n]\n")
        else:
            lines = out.stdout.splitlines()
            assert len(lines) == n + 1 and lines[0].startswith("model") and lines[1].startswith("big")


@pytest.mark.parametrize("args", [["explain", "--graph"], ["ls", "--graph"], ["purge", "--key"], ["show"], ["pin"]])
def test_an_empty_key_is_a_usage_error(args, tmp_path, db_url):
    """`--graph ""` was taken as no key at all (explain and ls listed every graph); an empty key
    names nothing: exit 2, one line, nothing read or written."""
    r = Cli(tmp_path / "cache", db_url).proc(*args, "")
    one_error_line(r, 2, "a key must not be empty")
    assert not (tmp_path / "state" / "index.db").exists()


# -- odd values in the index itself --------------------------------------------------------------

INDEX_READERS = (
    ("ls",),
    ("ls", "--json", "--sort", "age"),
    ("ls", "--sort", "cost"),
    ("stats", "--json"),
    ("explain",),
    ("evict", "--dry-run", "--max-size", "1"),
    ("evict", "--dry-run", "--max-size", "1", "--policy", "cost"),
    ("purge", "--stale", "--dry-run"),
)


def _every_reader_answers(cli: Cli, key: str) -> None:
    for args in (*INDEX_READERS, ("show", key)):
        r = cli(*args)  # (Cli asserts exit 0: an odd value was exit 70)
        assert "internal error" not in r.stderr, (args, r.stderr)


def test_numbers_of_a_hand_edited_sqlite_index_that_are_no_numbers_fail_no_command(fixture_cache, cli_for, db_url):
    """SQLite keeps any value in any column: text where an entry's size, time or compile time
    belongs, or an event's time, is that entry's oddity (read as unknown), never a failed command;
    and the next scan writes the disk's values over it."""
    import sqlite3

    root = fixture_cache()
    cli = cli_for(root)
    cli("scan")
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        key = conn.execute("SELECT key FROM entries WHERE kind = 'fxgraph' ORDER BY id LIMIT 1").fetchone()[0]
        true_size = conn.execute("SELECT bytes FROM entries WHERE key = ?", (key,)).fetchone()[0]
        conn.execute("UPDATE entries SET bytes = 'abc', compile_seconds = 'x', hit_count = 'y' WHERE key = ?", (key,))
        conn.execute("UPDATE entries SET mtime = 'x', last_access = 1e999 WHERE kind = 'triton'")
        conn.execute("UPDATE entries SET files = 1e300, first_seen = -1e999 WHERE kind = 'code'")
        conn.execute("UPDATE events SET ts = 'x', seconds = 'y', bytes = 'z'")
    _every_reader_answers(cli, key)
    cli("scan")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT bytes FROM entries WHERE key = ?", (key,)).fetchone()[0] == true_size
        assert not conn.execute("SELECT 1 FROM entries WHERE typeof(mtime) = 'text'").fetchall()


def test_numbers_no_real_cache_has_read_as_unknown_and_fit_80_columns(fixture_cache, cli_for, db_url, monkeypatch):
    """A compile of 1e308 s printed a 300-digit day count, and every line of `ls` grew to 386
    columns; a negative size and a hit count of 2**63 - 1 were shown and summed as they were. They
    read as unknown (the sums already did so). A cache dir whose name holds escapes reached the
    terminal raw from `scan` and the never-scanned note."""
    import sqlite3

    root = fixture_cache()
    odd = root.rename(root.with_name("cache\x1b]0;title\x07dir"))
    cli = cli_for(odd)
    r = cli("scan")
    assert "\x1b" not in r.stdout + r.stderr and "cache\\x1b]0;title\\x07dir" in r.stdout
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        key = conn.execute("SELECT key FROM entries WHERE kind = 'fxgraph' ORDER BY id LIMIT 1").fetchone()[0]
        conn.execute(
            "UPDATE entries SET compile_seconds = 1e308, hit_count = 9223372036854775807, bytes = -5 WHERE key = ?",
            (key,),
        )
    monkeypatch.setenv("COLUMNS", "80")
    out = cli("ls").stdout
    assert max(map(len, out.splitlines())) <= 80, out
    (e,) = [e for e in cli.json("ls") if e["key"] == key]
    assert (e["compile_seconds"], e["hit_count"], e["bytes"]) == (None, 0, 0)
    shown = cli("show", key).stdout
    assert max(map(len, shown.splitlines())) <= 80 and "-5 B" not in shown, shown


def test_text_of_a_hand_edited_sqlite_index_that_is_no_utf8_is_one_line_exit_5(fixture_cache, cli_for, db_url):
    """Text that is not UTF-8 in the index (an edit) stops a command that reads it as a database
    error: exit 5 and one line, though SQLite's message quotes the column's SQL, newlines and all
    (it printed the statement's second line on a line of its own)."""
    import sqlite3

    root = fixture_cache()
    cli = cli_for(root)
    cli("scan")
    with sqlite3.connect(db_url.removeprefix("sqlite:///")) as conn:
        conn.execute("UPDATE entries SET torch_version = CAST(X'ff00fe80' AS TEXT) WHERE kind = 'fxgraph'")
    for args in (("ls",), ("ls", "--json")):
        one_error_line(cli.proc(*args), 5, "index database", "UTF-8")


def test_bytes_where_a_sqlite_index_holds_text_fail_no_command(fixture_cache, cli_for, db_url):
    """SQLite keeps a BLOB in any column (an edit, another tool): a ref or graph key of bytes is
    read as text with its odd bytes escaped (`ls`, `show` and `check` sorted bytes against text:
    exit 70; eviction made a lock name of them: exit 70). An entry whose row names another
    directory (a BLOB, or any wrong text) is found by its key and filed where it lives: taken for
    new, its key failed every full rescan, and so every `evict` and `purge`, on the unique key."""
    import sqlite3

    root = fixture_cache()
    cli = cli_for(root)
    cli("scan")
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        (key,) = conn.execute("SELECT key FROM entries WHERE kind = 'fxgraph' LIMIT 1").fetchone()
        homes = dict(conn.execute("SELECT id, dir FROM entries"))
        for column in ("ref", "graph_key"):
            conn.execute(
                f"UPDATE entries SET {column} = CAST(X'00ff41' || id AS BLOB) WHERE id IN "
                f"(SELECT id FROM entries WHERE {column} IS NOT NULL ORDER BY id LIMIT 3)"
            )
        conn.execute("UPDATE entries SET dir = CAST(X'00ff' || id AS BLOB) WHERE id % 5 = 0")
        conn.execute("UPDATE entries SET dir = 'elsewhere' WHERE id % 5 = 1")
        (blobs,) = conn.execute("SELECT COUNT(*) FROM entries WHERE typeof(ref) = 'blob'").fetchone()
    assert blobs == 3
    for args in (("ls",), ("ls", "--json"), ("show", key), ("check",), ("explain",)):
        cli(*args)
    refs = [e["ref"] for e in cli.json("ls")]
    assert sum(ref.startswith("\0\\xffA") for ref in refs if ref) == 3  # (the bytes as read, 0xff escaped)
    cli("evict", "--dry-run", "--max-size", "0")  # (a full rescan first)
    cli("purge", "--dry-run", "--kind", "code")
    with sqlite3.connect(path) as conn:
        assert dict(conn.execute("SELECT id, dir FROM entries")) == homes  # filed where they live
    cli("evict", "--max-size", "0", "--grace", "0")
    assert cli.json("scan", "--full")["added"] == 0


def test_stored_directories_that_name_no_directory_fail_no_command(fixture_cache, cli_for, db_url):
    """A `dirs` row the walk could never have written (a NUL, raw or escaped; a '..' or '.'
    part; an empty one): a rescan let the NUL reach the system (exit 70 on every `scan`) and
    eviction's tidying of empty graph folders refused it as an unsafe path after deleting (exit
    70 on every `evict`). Such a row names no directory: the next scan drops it (one with a NUL
    too: json_each, which SQLite lists of names are read through, ends a string at a NUL), and
    nothing fails."""
    import sqlite3

    root = fixture_cache()
    cli = cli_for(root)
    cli("scan")
    odd = ["aotautograd/\0", "fxgraph/a/\0", "fxgraph/zz/x%00", "aotautograd/..", "fxgraph/./x", "fxgraph//x"]
    path = db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.executemany("INSERT INTO dirs (cache_id, path, mtime_ns) VALUES (1, ?, 5)", [(d,) for d in odd])
    cli("evict", "--max-size", "20MiB", "--grace", "0")
    scan = cli.json("scan")
    assert (scan["added"], scan["changed"], scan["unreadable"]) == (0, 0, [])
    with sqlite3.connect(path) as conn:
        assert not {d for (d,) in conn.execute("SELECT path FROM dirs")} & set(odd)
    cli("evict", "--max-size", "10MiB", "--grace", "0")
    assert cli.json("scan", "--full")["added"] == 0


def test_nan_and_infinity_in_a_postgresql_index_fail_no_command(fixture_cache, pg_url):  # noqa: F811 - the fixture
    """A shared index's float columns can hold NaN and Infinity (another host's bug, an edit):
    read as unknown times, never a failed command; eviction takes no entry for a time it cannot
    read (an unknown time counts as just used)."""
    from test_fleet import pg_query

    root = fixture_cache()
    cli = Cli(root, pg_url)
    cli("scan")
    key = pg_query(pg_url, "SELECT key FROM entries WHERE kind = 'fxgraph' ORDER BY id LIMIT 1")[0][0]
    pg_query(pg_url, "UPDATE entries SET compile_seconds = 'NaN', mtime = 'Infinity' WHERE key = %s", key)
    pg_query(pg_url, "UPDATE entries SET last_access = 'NaN', first_seen = '-Infinity' WHERE kind <> 'fxgraph'")
    pg_query(pg_url, "UPDATE events SET ts = 'NaN', seconds = 'Infinity'")
    pg_query(pg_url, "UPDATE caches SET last_scan = 'Infinity', last_eviction = 'NaN'")
    _every_reader_answers(cli, key)
    planned = json.loads(cli("evict", "--dry-run", "--max-age", "1d", "--json").stdout)
    assert not any(e["key"] == key for e in planned["entries"])


def test_the_tensors_of_a_signature_are_read_in_one_pass_over_hostile_text():
    """An entry's signature is its example inputs' text, whatever length the pickle gave it: the
    tensors are read by a pattern that looks at each character once (a run of letters was read
    again from each letter: a 16 MB signature held `stats --by model` for minutes). What it reads
    of a real signature, and of a recorded one, is unchanged."""
    from cachemgr.signatures import call_matches, tensors_of

    entry = "f32[s0, 32](32, 1)cpu grad; bf16[8](1)cuda:0; 3; f8e4m3fn[2, 2](2, 1)cuda:0"
    assert tensors_of(entry) == {"f32[s0,32]", "bf16[8]", "f8e4m3fn[2,2]"}
    assert call_matches(tensors_of("f32[s0, 32]; bf16[8]"), tensors_of(entry))
    assert not call_matches(tensors_of("f32[s0, 32]; bf16[9]"), tensors_of(entry))
    assert tensors_of(("a" * 800 + " ") * 2_000) == set()
    assert tensors_of("a1" * 100_000 + "[" * 10_000 + "f32[1]") == {"f32[1]"}
    assert tensors_of("(" * 10_000 + "f32[1]" + "]" * 10_000) == {"f32[1]"}


@pytest.mark.parametrize("end", [b"", b"\\"])
def test_a_deep_line_with_a_string_never_closed_is_read_in_one_pass(end):
    """The depth check skips strings: one never closed, of escaped quotes, was looked at again
    from each quote (25 s of CPU for one 64 KiB line, a day for a full spool file). Now one pass:
    the line is refused as nested too deep, like any other."""
    from cachemgr.prewarm import spool

    line = b"[" * 33 + b'"' + b'\\"' * 30_000 + end
    with pytest.raises(spool.LineError, match="nested deeper than"):
        spool.parse_line(line)
    with pytest.raises(spool.LineError, match="not JSON"):  # shallow: the JSON parser says why
        spool.parse_line(b"[" + b'"' + b'\\"' * 30_000 + end)
