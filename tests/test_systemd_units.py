"""The unit files pass `systemd-analyze verify` (no warnings at all) and say what the issue asks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parent.parent / "systemd"
ANALYZE = shutil.which("systemd-analyze")


def _verify(tmp_path: Path, *names: str) -> subprocess.CompletedProcess:
    # verify insists that ExecStart= exists: point it at this Python instead of /usr/bin/cachemgr
    for n in names:
        (tmp_path / n).write_text((UNITS / n).read_text().replace("/usr/bin/cachemgr", sys.executable))
    return subprocess.run(
        [ANALYZE, "verify", *(str(tmp_path / n) for n in names)], capture_output=True, text=True, timeout=60
    )


def _service(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = None
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(f"{section}.{k}", []).append(v)
    return out


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze missing: apt-get install -y systemd")
def test_units_verify_clean(tmp_path):
    r = _verify(tmp_path, "cachemgr.service", "cachemgr-prewarm.service")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze missing: apt-get install -y systemd")
def test_verify_catches_a_broken_unit(tmp_path):
    (tmp_path / "cachemgr.service").write_text(
        (UNITS / "cachemgr.service")
        .read_text()
        .replace("/usr/bin/cachemgr", sys.executable)
        .replace("Type=notify", "Type=notifyy")
    )
    r = subprocess.run([ANALYZE, "verify", str(tmp_path / "cachemgr.service")], capture_output=True, text=True)
    assert "notifyy" in r.stderr  # the clean run above is clean because the units are, not by accident


def test_daemon_unit_shape():
    s = _service("cachemgr.service")
    assert s["Service.Type"] == ["notify"]
    assert s["Service.WatchdogSec"] and s["Service.StateDirectory"] == ["cachemgr"]
    cache = s["Service.Environment"][0].split("=", 1)[1]
    assert cache in s["Service.ReadWritePaths"]
    assert s["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    # every hardening line carries a comment: each run of directives follows a comment, and is short
    lines = (UNITS / "cachemgr.service").read_text().split("--- hardening", 1)[1].split("[Install]")[0].splitlines()[1:]
    run = 0
    for prev, line in zip(["#"] + lines, lines, strict=False):  # (the last line is no line's prev)
        if line.strip() and not line.startswith("#"):
            run = run + 1 if not prev.startswith("#") else 1
            assert prev.startswith("#") or run > 1, f"hardening line without a comment: {line}"
            assert run <= 4, f"too many hardening lines under one comment: {line}"


def test_prewarm_unit_shape():
    s = _service("cachemgr-prewarm.service")
    assert s["Service.Type"] == ["oneshot"] and s["Service.RemainAfterExit"] == ["yes"]
    assert s["Unit.Before"], "ordered before the workload"
    assert "prewarm" in s["Service.ExecStart"][0]
