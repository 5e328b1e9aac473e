"""Every table and block for people, rendered at 80 and at 120 columns (and once in a real
pseudo-terminal): lines fit, and keys, bytes, ages, hit counts and compile times are whole in
every row (only a signature, path or reason is cut, with '…'). Real caches, no compile."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import sqlite3
import struct
import subprocess
import sys
import termios
import time

import pytest
from conftest import subprocess_env

from cachemgr.units import format_size

AGE = re.compile(r"^\d+(\.\d)?[smhd]$")
SECONDS = re.compile(r"^(\d+\.\d\ds|\d+(\.\d)?[mhd])$")
WIDTHS = (80, 120)


def cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def fits(text: str, width: int) -> list[str]:
    lines = text.splitlines()
    assert lines and all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    return lines


@pytest.fixture
def gpu(fixture_cache, cli_for, db_url):
    root = fixture_cache("h200-2.11")
    cli = cli_for(root)
    cli("scan")
    fx = cli.json("ls", "--kind", "fxgraph")
    sig = next(e["signature"] for e in fx if e["signature"].startswith("f32[8, 256]"))
    with sqlite3.connect(db_url.split(":///", 1)[1]) as c:  # a recorded model, as cachemgr.record leaves it
        c.execute(
            "INSERT INTO shapes (model, signature_hash, signature, spec, options, count, first_seen, last_seen) "
            "VALUES ('a-model-with-a-rather-long-name-for-its-column', 'x', ?, ?, '{}', 2, ?, ?)",
            (sig.split(";")[0].split("(")[0], '{"args": [], "kwargs": {}}', time.time() - 60, time.time() - 30),
        )
    return cli


@pytest.mark.parametrize("width", WIDTHS)
def test_ls(gpu, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    rows = {e["short"]: e for e in gpu.json("ls")}
    lines = fits(gpu("ls").stdout, width)
    assert cells(lines[0]) == ["key", "kind", "bytes", "idle", "hits", "compile", "signature"]
    body = lines[1:-1]
    total = format_size(sum(e["bytes"] for e in rows.values()))
    assert len(body) == len(rows) and lines[-1] == f"{len(rows)} entries, {total}"
    cut = 0
    for line in body:
        c = cells(line)
        e = rows[c[0]]  # the short key, whole
        assert (c[1], c[2], c[4]) == (e["kind"], format_size(e["bytes"]), f"{e['hit_count']:,}") and AGE.match(c[3])
        if e["compile_seconds"] is not None:
            assert SECONDS.match(c[5]) and c[5] == f"{e['compile_seconds']:.2f}s"
        sig = e["signature"] or ""
        if sig:
            shown = c[-1]
            assert shown == sig or (shown.endswith("…") and sig.startswith(shown[:-1]))
            cut += shown != sig
    assert cut > 0  # at these widths the resnet signatures are cut, nothing else


@pytest.mark.parametrize("width", WIDTHS)
def test_a_key_longer_than_the_terminal_takes_a_line_of_its_own(fixture_cache, cli_for, monkeypatch, width):
    """A hostile 250-character name (an entry with no short form) is shown whole on a line of
    its own, its values on the next, as df does with a long device name: every other row keeps
    the table's width (one such key had widened every row of `ls` to 280 columns)."""
    root = fixture_cache("h200-2.11")
    key = "ab/" + "q" * 240 + ".odd"
    (root / "ab").mkdir(exist_ok=True)
    (root / key).write_text("{}")
    cli = cli_for(root)
    cli("scan")
    monkeypatch.setenv("COLUMNS", str(width))
    lines = cli("ls").stdout.splitlines()
    at = lines.index(key)
    assert cells(lines[at + 1])[:2] == ["other", "2 B"] and lines[at + 1].startswith(" ")
    fits("\n".join(lines[:at] + lines[at + 1 :]), width)
    assert len(lines) == len(cli.json("ls")) + 3  # a header, the long key's extra line, the total


@pytest.mark.parametrize("width", WIDTHS)
def test_stats(gpu, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    doc = gpu.json("stats")
    lines = fits(gpu("stats", "--window", "3650d").stdout, width)
    head = dict((line[:12].strip(), line[12:]) for line in lines if line[:1] != " " and line[:12].strip())
    assert head["size"] == f"{format_size(doc['bytes'])} (no max_size)" and head["entries"] == "262"
    shown = head["cache"]
    assert shown == doc["cache_dir"] or (
        len(shown) == width - 12
        and "…" in shown
        and doc["cache_dir"].endswith(shown.split("…")[1])
        and doc["cache_dir"].startswith(shown.split("…")[0])
    )
    assert "6 compiles (3 recompiles)" in " ".join(lines)
    table = lines[lines.index(next(x for x in lines if x.startswith("kind"))) :]
    for line in table[1:]:
        kind, entries, files, size = cells(line)
        u = doc if kind == "total" else doc["by_kind"][kind]
        assert (entries, files, size) == (f"{u['entries']:,}", f"{u['files']:,}", format_size(u["bytes"]))
    for name, value in (("MAX_SIZE", "20GiB"), ("MAX_FILES", "500000"), ("MAX_AGE", "14d"), ("MIN_FREE", "1%")):
        monkeypatch.setenv(f"CACHEMGR_{name}", value)
    limited = fits(gpu("stats").stdout, width)
    assert any(x.startswith("size") and f"{format_size(doc['bytes'])} of 20.0 GiB (0.1%)" in x for x in limited)
    assert any(x.startswith("files") and "1,200 of 500,000 (0.2%)" in x for x in limited)
    assert any(x.startswith("max age") and "idle longer" in x for x in limited)


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_by_model_and_fleet(gpu, fixture_cache, cli_for, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    (m,) = gpu.json("stats", "--by", "model")["by_model"]
    lines = fits(gpu("stats", "--by", "model").stdout, width)
    row = cells(lines[-1])
    assert row[0].startswith("a-model") and row[1:6] == [
        str(m["signatures"]),
        str(m["graphs"]),
        str(m["entries"]),
        format_size(m["bytes"]),
        str(m["hits"]),
    ]
    cli_for(fixture_cache("torch-2.13.0-cpu"), host="a-second-host-with-a-long-name-indeed")("scan")
    doc = gpu.json("stats", "--fleet")
    lines = fits(gpu("stats", "--fleet").stdout, width)
    assert cells(lines[0]) == ["host", "entries", "files", "bytes", "scanned", "cache dir"]
    for c, line in zip(doc["caches"], lines[1:3], strict=True):
        x = cells(line)
        assert x[1:4] == [f"{c['entries']:,}", f"{c['files']:,}", format_size(c["bytes"])] and AGE.match(x[4])
    assert cells(lines[3])[:4] == ["total", f"{doc['entries']:,}", f"{doc['files']:,}", format_size(doc["bytes"])]
    assert "2 hosts, 2 caches" in lines[3]


@pytest.mark.parametrize("width", WIDTHS)
def test_evict_and_purge_plans(gpu, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    gpu("pin", gpu.json("ls", "--kind", "fxgraph")[0]["short"], "--reason", "a reason long enough to be cut " * 4)
    rows = {e["short"]: e for e in gpu.json("ls")}
    for args in (
        ["evict", "--max-size", "1MiB", "--dry-run", "--grace", "0"],
        ["purge", "--kind", "triton", "--dry-run", "--grace", "0"],
    ):
        lines = fits(gpu(*args).stdout, width)
        start = next(i for i, x in enumerate(lines) if x.startswith("key"))
        assert cells(lines[start]) == ["key", "kind", "bytes", "why"]
        body = [x for x in lines[start + 1 :] if not x.startswith(("...", "dry run", "kept", "cannot", "  "))]
        assert len(body) == 20
        for line in body:
            key, kind, size, why = cells(line)
            assert rows[key]["kind"] == kind and format_size(rows[key]["bytes"]) == size and why
    evicting = gpu("evict", "--max-size", "1MiB", "--dry-run", "--grace", "0").stdout
    assert "cannot get under max_size 1.0 MiB" in evicting and "pinned" in evicting
    lines = fits(gpu("pin").stdout, width)
    key, entries, when, reason = cells(lines[1])
    assert key in rows and entries == "1" and when.endswith("ago") and reason.endswith("…")


@pytest.mark.parametrize("width", WIDTHS)
def test_show_explain_diff_and_candidates(gpu, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    fx = gpu.json("ls", "--kind", "fxgraph", "--sort", "cost")
    lines = fits(gpu("show", fx[0]["short"]).stdout, width)  # the key line too (117 columns, was whole)
    head, _, tail = lines[0].removeprefix("key           ").partition("…")
    assert fx[0]["key"].startswith(head) and fx[0]["key"].endswith(tail) and lines[1].endswith(fx[0]["short"])
    assert gpu("show", fx[0]["short"], "--wide").stdout.splitlines()[0] == f"key           {fx[0]['key']}"
    assert f"compile time  {fx[0]['compile_seconds']:.2f}s" in lines
    out = fits(gpu("explain", "--since", "3650d").stdout, width)
    assert {e["short"] for e in fx} <= {line.split()[0] for line in out if line and not line.startswith(" ")}
    fits(gpu("diff", fx[0]["short"], fx[1]["short"]).stdout, width)
    r = gpu.proc("show", "fxgr", env={"COLUMNS": str(width)})
    candidates = fits(r.stderr, width)[2:]
    assert r.returncode == 2 and {cells(x)[0] for x in candidates} == {e["short"] for e in fx}
    assert all(
        cells(x)[2] == format_size(next(e["bytes"] for e in fx if e["short"] == cells(x)[0])) for x in candidates
    )


def test_ls_in_a_real_terminal(gpu):
    """A pseudo-terminal of 80 columns, no $COLUMNS: the width comes from the terminal itself."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in subprocess_env().items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", *gpu.base(), "ls"],
        stdin=secondary,
        stdout=secondary,
        stderr=subprocess.PIPE,
        env=env,
        close_fds=True,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=60) == 0, p.stderr.read()
    os.close(primary)
    lines = b"".join(chunks).decode().replace("\r\n", "\n").splitlines()
    assert lines[0].split() == ["key", "kind", "bytes", "idle", "hits", "compile", "signature"]
    assert all(len(line) <= 80 for line in lines), [x for x in lines if len(x) > 80]
    shorts = {e["short"]: e for e in gpu.json("ls")}
    for line in lines[1:-1]:
        c = cells(line)
        assert c[0] in shorts and c[2] == format_size(shorts[c[0]]["bytes"])


def test_wide_cuts_nothing(gpu, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    rows = {e["key"]: e for e in gpu.json("ls")}
    for line in gpu("ls", "--wide").stdout.splitlines()[1:-1]:
        c = cells(line)
        e = rows[c[0]]
        assert "…" not in line and (not e["signature"] or line.endswith(e["signature"]))


def test_check_wide_cuts_nothing(fixture_cache, cli_for, monkeypatch):
    """check cut its causes at 80 columns ("(induct…") and had no --wide to see them whole."""
    monkeypatch.setenv("COLUMNS", "80")
    cli = cli_for(fixture_cache("torch-2.13.0-cpu"))
    graphs = {e["graph_key"] for e in cli.json("ls", "--kind", "fxgraph")}
    lines = cli("check", "--wide").stdout.splitlines()
    assert not [line for line in lines if "…" in line]
    (unknown,) = [line.split(None, 2) for line in lines if line.split()[1:2] == ["unknown"]]
    assert unknown[0] in graphs and unknown[2].endswith("does not know (inductor_config[epilogue_fusion])")


@pytest.mark.parametrize("width", WIDTHS)
def test_shapes_fleet_report_and_a_prewarm_run(gpu, cli_for, monkeypatch, capsys, tmp_path, width):
    monkeypatch.setenv("COLUMNS", str(width))
    lines = fits(gpu("shapes").stdout, width)
    assert cells(lines[0]) == ["model", "signature", "hash", "processes", "varied", "options", "last seen"]
    row = cells(lines[1])
    assert row[0].startswith("a-model") and row[2:4] == ["x", "2"] and AGE.match(row[-1])

    # two hosts sharing graphs: hosts, shared graphs and torch versions, each table whole where it counts
    import shutil

    second = shutil.copytree(gpu.cache_dir, tmp_path / "second-host-cache", symlinks=True)
    cli_for(second, host="a-second-host-with-a-long-name-indeed")("scan")
    doc = gpu.json("fleet", "report", "--min-hosts", "2")
    lines = fits(gpu("fleet", "report", "--min-hosts", "2").stdout, width)
    hosts = [cells(x) for x in lines[2:4]]
    assert sorted(h[1:5] for h in hosts) == sorted(
        [str(h["caches"]), str(h["entries"]), format_size(h["bytes"]), str(h["hit_count"])] for h in doc["hosts"]
    )
    assert doc["shared_graphs"] and any(x.startswith("graphs on 2+ hosts") for x in lines)

    from types import SimpleNamespace

    from cachemgr.cli.prewarm import _print_run

    shape = SimpleNamespace(
        model="a-model-with-a-rather-long-name",
        index=3,
        signature="f32[8, 256](256, 1)cpu; f32[256, 256](256, 1)cpu; i64[8](1)cpu",
        lead_in=False,
        device="cpu",
        phase="cold",
        seconds=12.5,
        counters={"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 1, "autograd_cache_hit": 0, "autograd_cache_miss": 1},
        ok=False,
        error="RuntimeError: a and b must have same reduction dim, but got [8, 3] X [16, 32]",
    )
    _print_run(SimpleNamespace(shapes=[shape]), "cold")
    lines = fits(capsys.readouterr().out, width)
    assert cells(lines[1])[:2] == ["model", "#"]
    row = cells(lines[2])
    assert (
        row[1] == "3" and row[3:8] == ["cpu", "cold", "12.50", "2/1", "0/1"] and row[8].startswith("RuntimeErr")
    )  # a reason may be cut


def test_an_age_no_clock_gives_is_unknown():
    """last_access 0 (a kernel folder with no file to date it by) read '20792d' idle."""
    import time

    from cachemgr.cli.common import age

    assert [age(v) for v in (None, 0, -5, float("inf"), float("nan"), "x", True, 1e300)] == ["-"] * 8
    assert age(time.time() - 90) == "1.5m" and age(time.time() + 30) == "0s"


@pytest.mark.parametrize("width", WIDTHS)
def test_scan_s_corrupt_lines_wrap_to_the_terminal(fixture_cache, cli_for, monkeypatch, width):
    """A corrupt entry's line is wrapped (its key, one word, whole): a real fxgraph key with its
    reason ran to 200 columns."""
    root = fixture_cache("h200-2.11")
    entry = next((root / "fxgraph").rglob("*/*/*"))
    entry.write_bytes(b"not a pickle at all, " * 20)
    monkeypatch.setenv("COLUMNS", str(width))
    err = cli_for(root)("scan").stderr
    assert "corrupt:" in err
    for line in err.splitlines():
        assert len(line) <= width or " " not in line.strip(), line


def test_a_narrow_terminal_keeps_columns_after_the_key_aligned(gpu, monkeypatch):
    """Only the key column gives way to a narrow terminal (each key then on a line of its own):
    a kind or size column is never narrowed below its cells, so the columns after it stay aligned."""
    monkeypatch.setenv("COLUMNS", "40")
    lines = gpu("ls").stdout.splitlines()
    header, values = lines[0], [line for line in lines[1:-1] if line.startswith(" ")]
    assert values
    bytes_end = header.index("bytes") + len("bytes")
    for line in values:  # values under their headers: the bytes right-aligned under 'bytes'
        assert line[bytes_end - 1] != " " and line[bytes_end] == " ", (header, line)
