"""Eviction, purge and pins on real caches (a CPU cache compiled in this session, the H200 fixture)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NO_TORCH_PROGRAM, REPO, run_program, subprocess_env
from test_fleet import pg_url  # noqa: F401 - fixture: a throwaway PostgreSQL database

from cachemgr import layout
from cachemgr.errors import UnsafePath
from cachemgr.units import format_size as human_size

HOUR = 3600


def age_files(root: Path, seconds: float, paths=None) -> None:
    """Set atime and mtime of every regular file (or of `paths`) to `seconds` ago."""
    t = time.time() - seconds
    for p in paths if paths is not None else root.rglob("*"):
        p = Path(p)
        if p.is_file() and not p.is_symlink():
            os.utime(p, (t, t))


def disk(root: Path) -> dict[str, int]:
    """Every regular file under the root (symlinks and transient files excluded): relpath -> size."""
    out = {}
    for e in layout.walk(str(root)):
        for p in e.paths:
            out[p] = os.lstat(root / p).st_size
    return out


def find_bytes(root: Path) -> int:
    """What `find` sees: every regular file, trash included (the trash must be empty after a run)."""
    out = subprocess.run(
        ["find", str(root), "-type", "f", "-printf", "%s\\n"], capture_output=True, text=True, check=True
    )
    return sum(int(x) for x in out.stdout.split())


def assert_index_matches_disk(cli, root: Path) -> None:
    rows = {e["key"]: e for e in cli.json("ls")}
    on_disk = {e.key: e for e in layout.walk(str(root))}
    assert set(rows) == set(on_disk), set(rows) ^ set(on_disk)
    for k, e in on_disk.items():
        assert rows[k]["bytes"] == e.bytes and rows[k]["files"] == e.files, k
    assert cli.json("stats")["bytes"] == sum(disk(root).values())


def db_path(db_url: str) -> str:
    return db_url.split(":///", 1)[1]


@pytest.fixture
def aged_cpu(cpu_cache):
    age_files(cpu_cache, HOUR)
    return cpu_cache


@pytest.fixture
def aged_gpu(gpu_cache):
    age_files(gpu_cache, HOUR)
    return gpu_cache


def test_a_name_that_only_looks_like_a_module_s_is_not_taken_with_it(aged_gpu, cli_for):
    """'c<hash>.' (nothing after the dot) beside module 'c<hash>.py' is another entry to the walk
    (`classify`); eviction's look grouped it with the module by its stem, so the module was kept
    for the other file's recent write (or the other file went with it). Now each goes as itself."""
    module = next(p for p in aged_gpu.glob("*/c*.py"))
    odd = module.with_name(module.name.removesuffix("py"))  # 'c<hash>.'
    odd.write_text("someone's")  # written now: within the grace period
    cli = cli_for(aged_gpu)
    cli("scan")
    key = module.relative_to(aged_gpu).as_posix().removesuffix(".py")
    out = cli.json("evict", "--max-size", "0", "--grace", "1m")
    assert key in {e["key"] for e in out["entries"]}
    assert not module.exists() and odd.read_text() == "someone's"


# -- size, files, age, free space ----------------------------------------------------------------


@pytest.fixture(params=["thread", "processes"])
def lookers(request, monkeypatch):
    """Units looked at and moved by a thread of the evicting process (a small plan), or by two
    worker processes (a large one: every plan here, for the test)."""
    from cachemgr.evict import execute

    if request.param == "processes":
        monkeypatch.setattr(execute, "PROCESSES_FROM", 0)
        monkeypatch.setattr(execute, "LOOK_PROCESSES", 2)
    return request.param


@pytest.mark.parametrize("which", ["aged_cpu", "aged_gpu"])
def test_max_size_bytes_on_disk_and_stats_agree(which, request, cli_for, db_url, lookers):
    root = request.getfixturevalue(which)
    cli = cli_for(root)
    cli("scan")
    total = cli.json("stats")["bytes"]
    cap = total // 2
    r = cli.json("evict", "--max-size", str(cap))
    assert r["evicted"] > 0 and r["evicted"] == r["planned"] and r["skipped"] == []
    assert find_bytes(root) <= cap
    assert find_bytes(root) == sum(disk(root).values()) == r["remaining_bytes"] == total - r["freed_bytes"]
    assert sum(e["bytes"] for e in r["entries"]) == r["freed_bytes"] == r["expected_freed_bytes"]
    stats = cli.json("stats")
    assert stats["bytes"] == find_bytes(root)  # to the byte
    assert stats["activity"]["evictions"] == r["evicted"] and stats["last_eviction"]
    again = cli.json("scan")
    assert (again["added"], again["changed"], again["removed"]) == (0, 0, 0)
    assert_index_matches_disk(cli, root)
    # one 'evict' event per entry, with its key and bytes
    conn = sqlite3.connect(db_path(db_url))
    events = dict(conn.execute("SELECT entry_key, bytes FROM events WHERE kind = 'evict'").fetchall())
    assert events == {e["key"]: e["bytes"] for e in r["entries"]}
    assert not any((root / layout.TRASH_DIR).iterdir())


def test_recreatable_go_first_and_are_reported(aged_gpu, cli_for):
    cli = cli_for(aged_gpu)
    cli("scan")
    total = cli.json("stats")["bytes"]
    kernels = sum(e["bytes"] for e in cli.json("ls", "--kind", "triton"))
    # a cap one kernel's worth under the total: no graph needs to go
    r = cli.json("evict", "--max-size", str(int((total - 1) / 0.9) - 1))
    kinds = {e["kind"] for e in r["entries"]}
    assert kinds <= {"code", "triton", "autotune"}, kinds
    assert all(e["kind"] == "code" for e in r["entries"][:1])  # unreferenced modules (orphans) first
    r = cli.json("evict", "--max-size", str(int((total - kernels / 2) / 0.9)))  # half the kernels' worth
    assert r["recreatable_freed_bytes"] > 0
    assert {e["kind"] for e in cli.json("ls")} >= {"fxgraph", "aotautograd"}  # every graph kept
    assert len(cli.json("ls", "--kind", "fxgraph")) == 6


def test_dry_run_deletes_nothing(aged_gpu, cli_for):
    cli = cli_for(aged_gpu)
    cli("scan")
    before, rows = disk(aged_gpu), cli.json("ls")
    r = cli.json("evict", "--max-size", "0", "--dry-run")
    assert r["dry_run"] and r["planned"] == len(rows) and r["evicted"] == len(rows)
    assert r["remaining_bytes"] == 0 and r["freed_bytes"] == sum(before.values())
    assert disk(aged_gpu) == before and cli.json("ls") == rows
    assert cli.json("stats")["activity"]["evictions"] == 0 and cli.json("stats")["last_eviction"] is None
    out = cli("evict", "--max-size", "0", "--dry-run").stdout
    assert "dry run: would free" in out and "nothing deleted" in out and "plan: evict" in out
    p = cli.json("purge", "--all", "--dry-run")
    assert p["evicted"] == len(rows) and disk(aged_gpu) == before


def test_max_files(aged_gpu, cli_for):
    cli = cli_for(aged_gpu)
    cli("scan")
    r = cli.json("evict", "--max-files", "500")
    assert r["freed_files"] > 0 and len(disk(aged_gpu)) <= 500 and cli.json("stats")["files"] == len(disk(aged_gpu))


def test_max_age_takes_only_old_groups(aged_cpu, cli_for):
    age_files(aged_cpu, 3 * 86400)
    cli = cli_for(aged_cpu)
    cli("scan")
    aot = cli.json("ls", "--kind", "aotautograd")
    young = aot[0]
    age_files(aged_cpu, HOUR, [aged_cpu / young["key"]])  # one AOT entry was hit an hour ago
    graphs = [r["ref"] for r in cli.json("show", young["key"])["references"] if r["kind"] == "fxgraph"]
    its_fx = [e["key"] for g in graphs for e in cli.json("ls", "--graph", g)]
    assert its_fx
    r = cli.json("evict", "--max-age", "2d")
    assert r["evicted"] > 0 and {e["reason"] for e in []} == set()
    # its graphs' files are three days old, but a group shares its newest access: they stay
    assert (aged_cpu / young["key"]).exists() and all((aged_cpu / k).exists() for k in its_fx)
    assert [e["key"] for e in cli.json("ls", "--kind", "aotautograd")] == [young["key"]]
    assert all(not (aged_cpu / e["key"]).exists() for e in aot[1:])
    assert cli.json("evict", "--max-age", "2d")["evicted"] == 0
    assert_index_matches_disk(cli, aged_cpu)


def test_min_free(aged_gpu, cli_for, db_url):
    cli = cli_for(aged_gpu)
    cli("scan")
    assert cli.json("evict", "--min-free", "0%")["evicted"] == 0
    r = cli.json("evict", "--min-free", "99%")  # cannot be met: everything evictable goes
    assert r["evicted"] > 0 and disk(aged_gpu) == {}
    conn = sqlite3.connect(db_path(db_url))  # the hash components of evicted graphs went with them
    assert conn.execute("SELECT COUNT(*) FROM component_sets").fetchone() == (0,)
    assert conn.execute("SELECT COUNT(*) FROM component_set_items").fetchone() == (0,)


def test_a_free_space_floor_that_cannot_be_reached_is_said(aged_gpu, cli_for):
    """`--min-free` past what emptying the cache frees planned everything and said nothing of the
    floor (`"unreachable": null`), as max_size and max_files say theirs; an empty cache is not
    "within the limits" then."""
    cli = cli_for(aged_gpu)
    cli("scan")
    plan = cli.json("evict", "--min-free", "1000000TiB", "--dry-run")
    assert plan["evicted"] > 0 and plan["unreachable"].startswith("cannot reach min_free 1000000TiB (")
    out = cli("evict", "--min-free", "1000000TiB", "--dry-run").stdout
    assert out.splitlines()[-1].startswith("cannot reach min_free 1000000TiB (") and "would be free" in out
    assert cli.json("evict", "--min-free", "0%", "--dry-run")["unreachable"] is None
    cli("purge", "--all", "--yes")
    out = cli("evict", "--min-free", "1000000TiB").stdout
    assert out.startswith("cannot reach min_free 1000000TiB (") and "within the limits" not in out


def test_no_limit_is_a_usage_error(aged_cpu, cli_for):
    r = cli_for(aged_cpu).proc("evict")
    assert (
        r.returncode == 2
        and r.stderr.startswith("cachemgr: error: no limit to evict to")
        and "Traceback" not in r.stderr
    )


# -- policies --------------------------------------------------------------------------------------


def test_cost_keeps_the_expensive_graph_where_lru_does_not(aged_cpu, db_url):
    from cachemgr.evict import Limits, evict, load_rows
    from cachemgr.evict.policy import plan
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("testhost", str(aged_cpu))
    reconcile(db, cid, str(aged_cpu))
    rows = load_rows(db, cid, str(aged_cpu))
    first = plan(rows, Limits(max_size=0, grace=0), "cost", time.time()).units
    order = [u for u in first if u.reason == "size"]
    assert len(order) >= 2, "the CPU workload makes several graph groups"
    heads = [u.entries[0].key for u in order]
    cheapest, dearest = order[0], order[-1]
    per_byte = [sum(e.compile_seconds or 0 for e in u.entries if e.kind == "fxgraph") / u.bytes for u in order]
    assert per_byte[-1] > per_byte[0]
    # the dearest graph is the least recently used: lru takes it first, cost keeps it. (Access
    # times only move forward in the index: every other group is used more recently instead.)
    dear = {e.key for u in [dearest, *(u for u in first if u.reason in ("orphan", "recreatable"))] for e in u.entries}
    age_files(
        aged_cpu,
        HOUR / 2,
        [p for p in aged_cpu.rglob("*") if not any(p.relative_to(aged_cpu).as_posix().startswith(k) for k in dear)],
    )
    reconcile(db, cid, str(aged_cpu), full=True)  # (times set by hand move no directory mtime)
    recreatable = sum(
        u.bytes
        for u in plan(rows, Limits(max_size=0, grace=0), "lru", time.time()).units
        if u.reason in ("orphan", "recreatable")
    )
    total = sum(r.bytes for r in load_rows(db, cid, str(aged_cpu)))
    limits = Limits(max_size=total - recreatable - 1, low_water=1.0)  # one graph group must go
    lru = evict(db, cid, str(aged_cpu), limits, "lru", dry_run=True)
    cost = evict(db, cid, str(aged_cpu), limits, "cost", dry_run=True)
    lru_keys, cost_keys = {k for k, *_ in lru.entries}, {k for k, *_ in cost.entries}
    assert dearest.entries[0].key in lru_keys and dearest.entries[0].key not in cost_keys
    assert cheapest.entries[0].key in cost_keys
    assert heads[0] != heads[-1]
    # and for real: the cost policy deletes the cheap group, the dear one stays on disk
    done = evict(db, cid, str(aged_cpu), limits, "cost")
    assert (aged_cpu / dearest.entries[0].key).exists() and not (aged_cpu / cheapest.entries[0].key).exists()
    assert done.freed_bytes == cost.freed_bytes


def test_the_cost_policy_reads_numbers_no_cache_has_as_unknown(aged_cpu, cli_for, tmp_path, pg_url):  # noqa: F811
    """A compile of 1e308 s (a full scan does not rewrite it), a hit count near PostgreSQL's
    INTEGER's top, negative counts: GreedyDual's priority and clock became infinite or NaN. On
    SQLite an infinite clock was kept (and read back as none); on PostgreSQL its history was
    refused as JSON after the deletions were committed, and the run failed, exit 5."""
    from test_fleet import pg_query

    copy = shutil.copytree(aged_cpu, tmp_path / "twin", symlinks=True)
    for cache, url in ((aged_cpu, None), (copy, pg_url)):
        cli = cli_for(cache, **({"db": url} if url else {}))
        cli("scan")
        edits = (
            "UPDATE entries SET compile_seconds = 1e308, hit_count = 2000000000"
            " WHERE id = (SELECT MIN(id) FROM entries WHERE kind = 'aotautograd')",
            "UPDATE entries SET hit_count = -5, compile_seconds = -3 WHERE id = (SELECT MIN(id) FROM entries"
            " WHERE kind = 'fxgraph')",
        )
        for sql in edits:
            if url:
                pg_query(url, sql)
            else:
                with sqlite3.connect(db_path(cli.db_url)) as c:
                    c.execute(sql)
        out = cli.json("evict", "--policy", "cost", "--max-size", "200KiB", "--grace", "0")
        assert out["evicted"] > 0 and out["unreachable"] is None
        query = "SELECT gds_clock, CAST(gds_history AS TEXT) FROM caches"
        if url:
            ((clock, history),) = pg_query(url, query)
        else:
            with sqlite3.connect(db_path(cli.db_url)) as c:
                ((clock, history),) = c.execute(query).fetchall()
        rises = json.loads(history, parse_constant=pytest.fail)  # (Infinity, NaN: not JSON)
        assert rises and 0 < clock < 1e12 and rises[-1][1] == clock, (clock, history)


def test_deletes_the_file_system_refuses_fail_the_run(aged_cpu, cli_for, tmp_path):
    """A read-only mount refuses every delete: evict said "evicted 0 entries", exit 0, and
    nothing of the limit it did not meet (`unreachable` came from the plan, made before the run);
    purge too. Now the run says what remains over the limit and fails, exit 1."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(aged_cpu), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        cli = cli_for(ro)
        before = disk(ro)
        r = cli("evict", "--max-size", "0", "--json", code=1)
        doc = json.loads(r.stdout)
        assert doc["evicted"] == doc["freed_bytes"] == 0 and doc["skipped"]
        assert {s["reason"] for s in doc["skipped"]} == {"delete failed"}
        assert doc["unreachable"] == f"cannot get under max_size 0 B: {human_size(doc['remaining_bytes'])} remain"
        n = len(doc["skipped"])
        refused = f"cachemgr: error: the file system refused to delete {n} planned entries (read-only, or not"
        assert r.stderr.startswith(refused)
        r = cli("evict", "--max-size", "0", code=1)
        assert r.stdout.splitlines()[-1] == doc["unreachable"] and r.stderr.startswith(refused)
        assert "dry run: would free" in cli("evict", "--max-size", "0", "--dry-run").stdout  # (exit 0: tries no delete)
        assert cli.json("purge", "--all", "--yes", "--grace", "0", code=1)["evicted"] == 0
        assert disk(ro) == before
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_recompiles_after_eviction(aged_cpu, cpu_cache_master, cli_for, tmp_path):
    reference = run_program(shutil.copytree(cpu_cache_master, tmp_path / "ref"))
    assert reference["fxgraph_cache_miss"] == 0  # the untouched cache is all hits
    cli = cli_for(aged_cpu)
    cli("scan")
    fx_before = {e["key"] for e in cli.json("ls", "--kind", "fxgraph")}
    r = cli.json("evict", "--max-size", str(cli.json("stats")["bytes"] // 2))
    evicted_fx = {e["key"] for e in r["entries"] if e["kind"] == "fxgraph"}
    assert evicted_fx and fx_before - evicted_fx, "some graphs go, some stay"
    assert any(e["kind"] == "code" and (aged_cpu / (e["key"] + ".py")).parent.exists() for e in r["entries"])
    after = run_program(aged_cpu)
    assert after["checksum"] == pytest.approx(reference["checksum"], rel=1e-6)
    assert after["fxgraph_cache_miss"] >= 1  # evicted graphs recompiled
    assert after["fxgraph_cache_hit"] >= 1  # kept ones hit, their evicted modules written again
    assert after["fxgraph_cache_hit"] + after["fxgraph_cache_miss"] == reference["fxgraph_cache_hit"]
    cli("scan")
    assert {e["key"] for e in cli.json("ls", "--kind", "fxgraph")} >= fx_before - evicted_fx


# -- safety ----------------------------------------------------------------------------------------


def test_grace_and_transient_files(aged_cpu, cli_for):
    fresh = next(aged_cpu.glob("fxgraph/*/*/*"))
    age_files(aged_cpu, 5, [fresh])  # read or written 5 s ago: inside the default 60 s
    tmp = fresh.parent / f".{os.getpid()}.77.tmp"
    tmp.write_bytes(b"a write in progress")
    age_files(aged_cpu, HOUR, [tmp])
    tdir = aged_cpu / "triton" / "0" / "tmp.pid_1_abc"
    tdir.mkdir(parents=True)
    (tdir / "k.cubin").write_bytes(b"\0" * 10)
    cli = cli_for(aged_cpu)
    r = cli.json("evict", "--max-size", "0")
    assert fresh.exists() and tmp.exists() and (tdir / "k.cubin").exists()
    assert {"key": str(fresh.relative_to(aged_cpu)), "reason": "grace"} in r["skipped"] or any(
        s["reason"] == "grace" for s in r["skipped"]
    )
    assert_index_matches_disk(cli, aged_cpu)
    left = {k for k in disk(aged_cpu)}
    assert str(fresh.relative_to(aged_cpu)) in left
    # --grace 0 takes it (the transient files still stay)
    cli.json("evict", "--max-size", "0", "--grace", "0")
    assert not fresh.exists() and tmp.exists() and (tdir / "k.cubin").exists()


def test_a_restored_copy_is_in_use_once_read(aged_cpu, cli_for, tmp_path):
    """A copy that keeps its times (cp -a, rsync -a, tar x: a cache being restored) looks an hour
    old, and what nobody reads goes by its age. What a compile reads of it is in use: the first
    read after the copy moves the file's atime even on a relatime mount (its atime is then before
    its ctime), so the grace period keeps it. (A file's ctime is not counted: every entry a scan
    reads gets a new one, linked for the read.)"""
    copy = tmp_path / "restored"
    subprocess.run(["cp", "-a", str(aged_cpu), str(copy)], check=True)
    graphs = sorted(copy.glob("fxgraph/*/*/*"))
    assert len(graphs) >= 2 and all(p.stat().st_mtime < time.time() - HOUR / 2 for p in graphs)
    graphs[0].read_bytes()  # as a compile's hit reads it
    cli = cli_for(copy)
    r = cli.json("evict", "--max-size", "0", "--grace", "1m")
    assert r["evicted"] > 0 and graphs[0].exists() and not graphs[-1].exists()
    assert {s["reason"] for s in r["skipped"]} == {"grace"}


def test_grace_counts_access_not_only_write(aged_cpu, cli_for):
    victim = next(aged_cpu.glob("fxgraph/*/*/*"))
    t = time.time()
    os.utime(victim, (t - 2, t - HOUR))  # written an hour ago, read 2 s ago
    cli = cli_for(aged_cpu)
    cli.json("evict", "--max-size", "0")
    assert victim.exists()
    # everything held back by the grace period: said so, not "within the limits"
    out = cli("evict", "--max-size", "0", "--grace", "30d").stdout
    assert "nothing can be evicted now" in out and "in use within the grace period)" in out, out


HOLD_LOCK = """
import sys, time
from filelock import FileLock
with FileLock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_held_lock_keeps_its_entry(aged_cpu, cli_for):
    cli = cli_for(aged_cpu)
    cli("scan")
    built = [
        e
        for e in cli.json("ls", "--kind", "code")
        if (aged_cpu / layout.LOCKS_DIR / (e["key"].split("/")[1] + ".lock")).exists()
    ]
    assert built, "Inductor locks each C++ build under locks/<c-hash>.lock"
    target = built[0]
    lock = aged_cpu / layout.LOCKS_DIR / (target["key"].split("/")[1] + ".lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = cli.json("evict", "--max-size", "0")
        assert lock.exists() and any(p.startswith(target["key"]) for p in disk(aged_cpu))
        assert any(s["reason"] == "lock held" for s in r["skipped"]), r["skipped"]
        assert_index_matches_disk(cli, aged_cpu)
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(timeout=30)
    cli.json("evict", "--max-size", "0")
    assert not any(p.startswith(target["key"]) for p in disk(aged_cpu))
    assert lock.exists()  # a lock frees no bytes: size eviction leaves it
    cli.json("purge", "--kind", "lock", "--yes", "--grace", "0")  # taking it touched it: grace 0
    assert not lock.exists()


def test_an_entry_whose_lock_name_would_be_too_long_is_evicted(aged_cpu, cli_for):
    """A kernel folder of 254 characters has no possible `<name>.lock` (255 at most): it was kept
    as 'lock held' for ever (ENAMETOOLONG read as 'cannot tell')."""
    kernel = aged_cpu / "triton" / "0" / ("A" * 254)
    kernel.mkdir(parents=True)
    (kernel / "k.json").write_text("{}")
    old = time.time() - 7200
    os.utime(kernel / "k.json", (old, old))
    cli = cli_for(aged_cpu)
    cli("scan")
    r = cli.json("evict", "--max-size", "0", "--grace", "0")
    assert not kernel.exists() and not any(s["reason"] == "lock held" for s in r["skipped"]), r["skipped"]


def test_symlinks_pointing_outside_survive_with_their_targets(aged_cpu, cli_for, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.so"
    precious.write_bytes(b"\x7fELF" + b"x" * 1000)
    kernel_dir = outside / "KERNEL"
    kernel_dir.mkdir()
    (kernel_dir / "k.cubin").write_bytes(b"\0" * 100)
    fx_dir = outside / "fxdir"
    (fx_dir / ("f" + "z" * 51)).mkdir(parents=True)
    (fx_dir / ("f" + "z" * 51) / "entry").write_bytes(next(aged_cpu.glob("fxgraph/*/*/*")).read_bytes())
    code = next(aged_cpu.glob("??/c*.py"))
    links = {
        code.with_suffix(".so"): precious,  # beside a real module: the module goes, the link stays
        aged_cpu / "triton" / "0" / ("A" * 52): kernel_dir,
        aged_cpu / "fxgraph" / "zz": fx_dir,
        code.parent / "other-link": precious,  # (at the top level it would make the root refused: test_hostile)
    }
    for link, target in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    age_files(outside, HOUR)
    cli = cli_for(aged_cpu)
    r = cli.json("purge", "--all", "--yes", "--grace", "0")
    assert r["evicted"] > 0 and not code.exists()
    for link, target in links.items():
        assert link.is_symlink() and target.exists(), link
    assert precious.read_bytes().startswith(b"\x7fELF") and (kernel_dir / "k.cubin").exists()
    assert (fx_dir / ("f" + "z" * 51) / "entry").exists()
    cli.json("evict", "--max-size", "0", "--grace", "0")
    assert all(link.is_symlink() for link in links) and precious.exists()


def test_executor_refuses_paths_leaving_the_root(aged_cpu, db_url, tmp_path):
    """An index row that names a path outside the root (a stale or hostile index) is never followed."""
    from cachemgr.evict import carry_out
    from cachemgr.evict.policy import Limits, Row, plan
    from cachemgr.index.db import Database

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    age_files(tmp_path, HOUR, [victim])
    folder = next(aged_cpu.glob("??/c*.py")).parent.name  # a real module folder: the root stays a cache
    (aged_cpu / folder / "escape").symlink_to(tmp_path)
    db = Database(db_url)
    cid = db.cache_id("testhost", str(aged_cpu))
    old = time.time() - HOUR
    rows = [
        Row(10**6 + i, key, "other", None, None, 7, 1, old, old)
        for i, key in enumerate([f"../{victim.name}", str(victim), f"{folder}/escape/victim.txt"])
    ]
    p = plan(rows, Limits(max_size=0), "lru", time.time())
    assert len(p.units) == 3
    r = carry_out(db, cid, str(aged_cpu), p, rows, grace=0)
    assert r.evicted == 0 and {reason for _, reason in r.skipped} == {"unsafe path"}
    assert victim.read_text() == "keep me"


def test_a_directory_that_is_no_cache_is_never_emptied(tmp_path, cli_for, db_url):
    """--cache-dir pointed at a home or project directory by mistake: evict and purge refuse it
    (exit 7, one line) before scanning, dry run or not, and the library path refuses it too."""
    from cachemgr.evict import Limits, evict
    from cachemgr.index.db import Database

    home = tmp_path / "home"
    (home / "projects" / "app").mkdir(parents=True)
    (home / "projects" / "app" / "main.py").write_text("print('mine')\n")
    (home / "go").mkdir()  # a two-character folder that holds no Inductor modules
    (home / "notes.txt").write_text("keep me")
    age_files(home, 30 * 86400)
    before = disk(home)
    cli = cli_for(home)
    for args in (["evict", "--max-size", "0"], ["evict", "--max-size", "0", "--dry-run"], ["purge", "--all", "--yes"]):
        r = cli(*args, code=7)
        assert "does not look like an Inductor cache directory" in r.stderr
        assert "notes.txt" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    db = Database(db_url)
    cid = db.cache_id("testhost", str(home))
    with pytest.raises(UnsafePath):
        evict(db, cid, str(home), Limits(max_size=0, grace=0))
    assert disk(home) == before
    assert layout.foreign_root("/") == "/ is the file system root"
    assert layout.foreign_root(str(tmp_path / "empty-yet")) is None  # missing: check_root's business
    (tmp_path / "fresh").mkdir()
    assert layout.foreign_root(str(tmp_path / "fresh")) is None  # nothing compiled yet


def test_a_failed_cpp_build_left_behind_keeps_the_cache_an_inductor_cache(aged_cpu, cli_for):
    """A C++ build that fails (a vector-ISA probe that g++ could not build, seen with torch
    2.13 on a 2-core development host) leaves <2ch>/c<hash>.cpp and the folder g++ ran in,
    <2ch>/c<hash>_CxxBuild/, with no .so. Once its source is evicted, the folder stays alone in
    its <2ch>/: every later evict had refused the cache as not Inductor's (exit 7)."""
    source = next(aged_cpu.glob("??/c*.cpp"))
    left = aged_cpu / "zz"
    left.mkdir()
    shutil.copyfile(source, left / "c0failedprobe0000000000000000000000.cpp")
    (left / "c0failedprobe0000000000000000000000_CxxBuild").mkdir()
    age_files(aged_cpu, 30 * 86400)
    cli = cli_for(aged_cpu)
    assert cli.json("evict", "--max-size", "0")["evicted"] > 0
    assert os.listdir(left) == ["c0failedprobe0000000000000000000000_CxxBuild"]
    assert cli.json("evict", "--max-size", "0")["evicted"] == 0
    cli.json("purge", "--all", "--yes")  # (exit 0: purge is refused the same way)


def test_what_aoti_cutlass_and_debug_runs_leave_keeps_the_cache_an_inductor_cache(aged_cpu, cli_for, tmp_path):
    """Names torch 2.13 / 2.14 put in a cache dir beside its usual folders (read from their
    source; the AOTI folder made by aoti_compile_and_package): each had made evict refuse the
    whole cache as not Inductor's. Eviction now runs: what programs load by path (AOTI's output,
    Halide's runtime) and tools' state stay, whatever their age; debris goes by age as any
    unknown file; CUTLASS's links, and what they point at, stay. Near misses are still refused."""
    cutlass = tmp_path / "cutlass" / "python"
    (cutlass / "cutlass_library").mkdir(parents=True)
    (cutlass / "cutlass_library" / "__init__.py").write_text("# CUTLASS's own")
    module_folder = next(aged_cpu.glob("??/c*.py")).parent
    aoti = "c5nzq3b2kxqrn7ti6wofe6hpuhbk3ssfzgj3bqmrldcdzmw2zq2z"  # code_hash(model code): its output
    kept = {
        f"{aoti}/{aoti}.pt2": "aoti package",
        "halide-runtime-host-3f2a/done": "",
        "halide-runtime-host-3f2a/standalone_halide_runtime.a": "runtime",
        "bisect/run_state.txt": "bisect",
        "quack/flex_gemm.py": "quack",
        "tmpab_cd123/output_code.py": "a fresh cache kept, or any program's mkdtemp",
        "tmpxyz12345.py": "wrapper",
    }
    debris = {
        "configs_1a2b3c4d.json": "[]",
        "memoizer_cache.json": "{}",
        "cutedsl_compile_cache/c0e4a.o": "object",
        "unhashed_kernel_inputs/triton_poi_fused_0_run_0/arg_0.pt": "tensor",
        f"{module_folder.name}/triton_poi_fused_add_0_run_1/arg_0.pt": "tensor",
    }
    made = kept | debris
    for rel, text in made.items():
        (aged_cpu / rel).parent.mkdir(parents=True, exist_ok=True)
        (aged_cpu / rel).write_text(text)
    for folder in ("torch_cutlass", "torch_cutlass_library"):
        (aged_cpu / folder).mkdir()
        (aged_cpu / folder / "cutlass_library").symlink_to(cutlass / "cutlass_library")
    age_files(aged_cpu, 30 * 86400)
    assert layout.foreign_root(str(aged_cpu)) is None
    cli = cli_for(aged_cpu)
    assert cli.json("evict", "--max-size", "0")["evicted"] > len(debris)
    assert [rel for rel in made if (aged_cpu / rel).exists()] == list(kept)
    assert all((aged_cpu / rel).read_text() == text for rel, text in kept.items())
    for folder in ("torch_cutlass", "torch_cutlass_library"):
        assert (aged_cpu / folder / "cutlass_library" / "__init__.py").read_text() == "# CUTLASS's own"
    assert cli.json("evict", "--max-size", "0")["evicted"] == 0  # (not refused: exit 0)
    for near in ("configs_backup.json", "tmpfile.py", "cnotahash", "tmp_short", "bisect\n"):
        other = tmp_path / f"near-{near.strip()}"
        shutil.copytree(aged_cpu, other, symlinks=True)
        (other / near).mkdir() if "." not in near else (other / near).write_text("mine")
        assert f"{layout.key_of(near)} is not a folder Inductor makes" in (layout.foreign_root(str(other)) or "")
    # names torch makes are no evidence alone: a folder of temporary files, a project's, a cache's debris
    alone = (["tmpa1b2c3d4/", "tmpq_w9e8r7/", "tmpzz0011yy.py"], ["bisect/", "quack/", "configurationmanagement/"])
    for names in alone:
        other = tmp_path / f"only-{names[0].strip('/')}"
        for name in names:
            (other / name.strip("/")).parent.mkdir(parents=True, exist_ok=True)
            (other / name).mkdir() if name.endswith("/") else (other / name).write_text("mine")
        assert "with no folder of Inductor's own beside them" in (layout.foreign_root(str(other)) or ""), names


# -- crashes ---------------------------------------------------------------------------------------


CRASH = """
import os, signal, sys
from cachemgr.evict import Limits, carry_out, execute, make_plan
from cachemgr.index.db import Database
root, url, stage = sys.argv[1:4]
if sys.argv[4] == "processes":  # looked at and moved by worker processes, which die with this one
    execute.PROCESSES_FROM, execute.LOOK_PROCESSES = 0, 2
db = Database(url)
cid = db.cache_id("testhost", root)
plan, rows = make_plan(db, cid, root, Limits(max_size=0, grace=0))
print("\\n".join(e.key for e in plan.entries), flush=True)
def hook(at):
    if at == stage:
        os.kill(os.getpid(), signal.SIGKILL)
carry_out(db, cid, root, plan, rows, 0, hook=hook)
"""


@pytest.mark.parametrize("looker", ["thread", "processes"])
@pytest.mark.parametrize("stage", ["renamed", "committed"])
def test_kill_9_mid_eviction_is_repaired_by_scan(stage, looker, aged_gpu, cli_for, db_url):
    cli = cli_for(aged_gpu)
    cli("scan")
    before = disk(aged_gpu)
    out = subprocess.run(
        [sys.executable, "-c", CRASH, str(aged_gpu), db_url, stage, looker],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    planned = set(out.stdout.split())
    trash = aged_gpu / layout.TRASH_DIR
    assert any(trash.rglob("*")), "killed with files in the trash"
    scan = cli.json("scan")
    assert scan["added"] == 0 and scan["changed"] == 0  # no phantom entries, nothing resurrected
    assert_index_matches_disk(cli, aged_gpu)
    after = disk(aged_gpu)
    # what is gone was being evicted; everything else is untouched
    for path in set(before) - set(after):
        c = layout.classify(path)
        assert c is not None and c.key in planned, path
    assert all(after[p] == before[p] for p in after)
    # the next eviction empties the trash the dead run left
    cli.json("evict", "--max-size", "0", "--grace", "0")
    assert not any(trash.rglob("*")) and disk(aged_gpu) == {} and find_bytes(aged_gpu) == 0
    assert_index_matches_disk(cli, aged_gpu)


INTERRUPT = """
import os, signal, sys
from cachemgr.evict import Limits, carry_out, execute, look, make_plan
from cachemgr.index.db import Database
root, url, looker, where, nth, batch = sys.argv[1:4] + [sys.argv[4], int(sys.argv[5]), int(sys.argv[6])]
policy = sys.argv[7] if len(sys.argv) > 7 else "lru"
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test run in the background ignores it)
execute.BATCH, execute.LOOK_CHUNK = batch, 2  # (at 8: four chunks a batch)
if looker == "processes":
    execute.PROCESSES_FROM, execute.LOOK_PROCESSES = 0, 2
db = Database(url)
cid = db.cache_id("testhost", root)
plan, rows = make_plan(db, cid, root, Limits(max_size=0, grace=0), policy)
print("\\n".join(e.key for e in plan.entries), flush=True)
calls = {"look": 0, "renamed": 0, "committed": 0}
def ctrl_c(at):
    calls[at] += 1
    if at == where and calls[at] == nth:
        os.kill(os.getpid(), signal.SIGINT)  # (raised by Python at its next check, right here)
send = look.Lookers.look
def looked(self, *a):  # a chunk of a batch handed to the lookers: the n-th, or the ones before it
    ctrl_c("look")
    return send(self, *a)
look.Lookers.look = looked
try:
    carry_out(db, cid, root, plan, rows, 0, hook=ctrl_c)
    print("finished", file=sys.stderr)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was
"""


@pytest.mark.parametrize("looker", ["thread", "processes"])
@pytest.mark.parametrize("where", ["look-2", "look-7", "renamed-1", "committed-1", "committed-2"])
def test_ctrl_c_mid_eviction_leaves_index_and_disk_agreeing(where, looker, aged_gpu, cli_for, db_url):
    """Ctrl-C while a chunk is handed to the lookers, before a batch's commit, and after it: the
    run stops at the next batch's edge, with what it committed gone (rows, files, events) and
    everything else in place, index and disk agreeing without a scan. A KeyboardInterrupt right
    after a COMMIT used to 'rescue' the batch: files back on disk whose rows were deleted."""
    cli = cli_for(aged_gpu)
    cli("scan")
    before, rows_before = disk(aged_gpu), {e["key"] for e in cli.json("ls")}
    planned = _interrupted(aged_gpu, db_url, looker, *where.split("-"), "8")
    after = disk(aged_gpu)
    assert set(after) < set(before) and all(after[p] == before[p] for p in after)
    gone = {c.key for c in map(layout.classify, set(before) - set(after)) if c is not None}
    assert gone <= planned and gone != planned
    _agree_after_the_interrupt(cli, aged_gpu, db_url, rows_before, gone)


@pytest.mark.parametrize("looker", ["thread", "processes"])
def test_ctrl_c_in_the_only_batch_is_not_swallowed(looker, aged_gpu, cli_for, db_url):
    """A plan of one batch (most of them: 500 units) has no next batch to stop before: the run
    finishes it, then the interrupt is raised (it used to be dropped, and a second Ctrl-C then
    landed anywhere); Python's own SIGINT handler is back."""
    cli = cli_for(aged_gpu)
    cli("scan")
    before, rows_before = disk(aged_gpu), {e["key"] for e in cli.json("ls")}
    planned = _interrupted(aged_gpu, db_url, looker, "look", "1", "100000", "cost")
    gone = {c.key for c in map(layout.classify, set(before) - set(disk(aged_gpu))) if c is not None}
    assert planned and gone == planned
    _agree_after_the_interrupt(cli, aged_gpu, db_url, rows_before, gone)
    with sqlite3.connect(db_path(db_url)) as conn:  # the whole plan went: the cost policy's clock is kept
        assert conn.execute("SELECT gds_clock FROM caches").fetchone()[0] > 0


def _interrupted(root: Path, db_url: str, *how: str) -> set[str]:
    """Run INTERRUPT (looker, where, nth, batch size); the keys it planned to evict."""
    out = subprocess.run(
        [sys.executable, "-c", INTERRUPT, str(root), db_url, *how],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.returncode == 0 and "interrupted" in out.stderr, out.stderr[-3000:]
    return set(out.stdout.split())


def _agree_after_the_interrupt(cli, root: Path, db_url: str, rows_before: set[str], gone: set[str]) -> None:
    assert_index_matches_disk(cli, root)  # no scan first
    with sqlite3.connect(db_path(db_url)) as conn:
        evicted = [k for (k,) in conn.execute("SELECT entry_key FROM events WHERE kind = 'evict'")]
    assert sorted(evicted) == sorted(rows_before - {e["key"] for e in cli.json("ls")})  # once each
    assert gone <= set(evicted)
    assert not any((root / layout.TRASH_DIR).iterdir())
    scan = cli.json("scan")
    assert scan["added"] == scan["changed"] == scan["removed"] == 0, scan


@pytest.mark.slow  # real processes killed at many moments
def test_kill_9_at_any_moment(aged_gpu, cli_for):
    """Kill a real `cachemgr evict` process after a varying delay: whatever it reached, scan repairs."""
    cli = cli_for(aged_gpu)
    cli("scan")
    before = disk(aged_gpu)
    for delay in (0.3, 0.6, 0.9, 1.2):
        p = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", *cli.base(), "evict", "--max-size", "0", "--grace", "0"],
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        cli.json("scan")
        assert_index_matches_disk(cli, aged_gpu)
        after = disk(aged_gpu)
        assert all(after[k] == before[k] for k in after)


# -- purge and pins -------------------------------------------------------------------------------


def test_pins_survive_eviction_and_purge(aged_cpu, cli_for):
    cli = cli_for(aged_cpu)
    cli("scan")
    fx = cli.json("ls", "--kind", "fxgraph")[0]
    needs = [r for r in cli.json("show", fx["key"])["references"] if r["present"]]
    assert "pinned " in cli("pin", fx["graph_key"], "--reason", "production model").stdout
    assert "already pinned" in cli("pin", fx["graph_key"]).stdout
    pinned = cli.json("ls", "--pinned")
    assert [e["key"] for e in pinned] == [fx["key"]] or fx["key"] in [e["key"] for e in pinned]
    assert {e["pin_reason"] for e in pinned} == {"production model"}
    assert cli.json("show", fx["key"])["pin_reason"] == "production model"
    # a prefix of several entries names none of them: refused, nothing pinned, shown or purged
    prefix = fx["key"][: len("fxgraph/") + 1]
    many = [e for e in cli.json("ls") if e["key"].startswith(prefix)]
    if len(many) < 2:
        prefix, many = "fxgraph/", cli.json("ls", "--kind", "fxgraph")
    assert len(many) >= 2
    for args in (["purge", "--key", prefix, "--yes"], ["show", prefix], ["pin", prefix]):
        assert "is a prefix of" in cli(*args, code=2).stderr
    assert all((aged_cpu / e["key"]).exists() for e in many if e["kind"] == "fxgraph")
    r = cli.json("evict", "--max-size", "0")
    assert r["evicted"] > 0 and any(s["reason"] == "pinned" for s in r["skipped"])
    assert (aged_cpu / fx["key"]).exists()
    shown = cli.json("show", fx["key"])
    assert all(x["present"] for x in shown["references"]) and len(shown["references"]) == len(needs)
    assert shown["referenced_by"], "the AOT entry naming a pinned graph stays with it"
    cli.json("purge", "--all", "--yes")
    assert (aged_cpu / fx["key"]).exists()
    cli.json("purge", "--all", "--include-pinned", "--yes")
    assert not (aged_cpu / fx["key"]).exists()
    assert "unpinned" in cli("unpin", fx["graph_key"]).stdout
    assert "not pinned" in cli("unpin", fx["graph_key"], code=3).stderr
    assert "no entry" in cli("pin", "nosuchkey", code=3).stderr
    assert "pinned" in cli("pin", "f" + "q" * 51, "--force").stdout


def test_purge_selectors(aged_gpu, cli_for):
    cli = cli_for(aged_gpu)
    cli("scan")
    rows = cli.json("ls")
    r = cli.json("purge", "--kind", "triton", "--yes")
    assert {e["kind"] for e in r["entries"]} == {"triton"} and r["evicted"] == len(
        [e for e in rows if e["kind"] == "triton"]
    )
    assert len(cli.json("ls", "--kind", "fxgraph")) == 6
    r = cli.json("purge", "--orphans", "--yes")
    assert r["evicted"] > 0 and all(e["kind"] in ("code", "autotune", "triton") for e in r["entries"])
    assert cli.json("purge", "--orphans", "--yes")["evicted"] == 0
    fx = cli.json("ls", "--kind", "fxgraph")[0]
    r = cli.json("purge", "--graph", fx["graph_key"], "--yes")
    assert fx["key"] in {e["key"] for e in r["entries"]} and not (aged_gpu / fx["key"]).exists()
    assert "no entry of graph" in cli("purge", "--graph", fx["graph_key"], "--yes", code=3).stderr  # gone now
    kept = cli.json("purge", "--stale", "--keep-torch", "2.11.0+cu130", "--yes")
    assert kept["evicted"] == 0
    # no --keep-torch: the torch installed here (the test's CPU build, not this cache's 2.11) is kept
    plan = cli.json("purge", "--stale", "--dry-run")
    fx_left = {r["key"] for r in cli.json("ls", "--kind", "fxgraph")}
    assert fx_left and fx_left <= {e["key"] for e in plan["entries"]}
    r = cli.json("purge", "--torch-version", "2.11.0+cu130", "--yes")
    assert r["evicted"] > 0 and cli.json("ls", "--kind", "fxgraph") == []
    assert cli.json("ls", "--kind", "aotautograd") == []  # an AOT entry with no graph left goes too
    assert_index_matches_disk(cli, aged_gpu)


def test_purge_key_and_graph_given_twice_purge_both(aged_gpu, cli_for):
    """`--key A --key B` purged only B (the last of a single-valued option); each is repeatable."""
    cli = cli_for(aged_gpu)
    cli("scan")
    a, b, c, d = (e["key"] for e in cli.json("ls", "--kind", "fxgraph")[:4])
    r = cli.json("purge", "--key", a, "--key", b, "--dry-run")
    assert {a, b} <= {e["key"] for e in r["entries"]}
    r = cli.json("purge", "--graph", c, "--graph", d, "--dry-run")
    assert {c, d} <= {e["key"] for e in r["entries"]}


def test_purge_kind_model_and_torch_version_given_twice_purge_both(aged_gpu, cli_for, db_url):
    """As --key: each choice named more than once takes entries of any of them, not the last."""
    cli = cli_for(aged_gpu)
    cli("scan")

    def planned(*args: str) -> set[str]:
        return {e["key"] for e in cli.json("purge", *args, "--dry-run")["entries"]}

    r = cli.json("purge", "--kind", "triton", "--kind", "autotune", "--dry-run")
    assert {e["kind"] for e in r["entries"]} == {"triton", "autotune"}
    ours = planned("--torch-version", "2.11.0+cu130")
    assert ours and planned("--torch-version", "2.11.0+cu130", "--torch-version", "9.9") == ours
    firsts = {e["signature"].split(";")[0].split("(")[0] for e in cli.json("ls", "--kind", "fxgraph")}
    signatures = sorted(s for s in firsts if s.startswith("f32["))  # (the mlp's, the resnet's: not dynamic)
    with sqlite3.connect(db_path(db_url)) as c:  # two models, as cachemgr.record writes them
        for model, sig in (("a", signatures[0]), ("b", signatures[1])):
            c.execute(
                "INSERT INTO shapes (model, signature_hash, signature, spec, options, count, first_seen, last_seen) "
                "VALUES (?, ?, ?, '[]', '{}', 1, 0, 0)",
                (model, model, sig),
            )
    a, b = planned("--model", "a"), planned("--model", "b")
    assert a and b and a != b and planned("--model", "a", "--model", "b") == a | b


def test_purge_says_purged(aged_gpu, cli_for):
    out = cli_for(aged_gpu)("purge", "--kind", "autotune", "--yes").stdout
    assert out.splitlines()[-1].startswith("purged ") and "evicted" not in out


def test_a_purge_with_nothing_to_purge_is_no_dry_run(aged_gpu, cli_for):
    """`purge --all --yes --json` of an empty cache said `"dry_run": true`: it ran for real."""
    cli = cli_for(aged_gpu)
    assert cli.json("purge", "--all", "--yes")["dry_run"] is False
    r = cli.json("purge", "--all", "--yes")
    assert r["planned"] == 0 and r["dry_run"] is False
    assert cli.json("purge", "--all", "--dry-run")["dry_run"] is True


def on_a_terminal(cli, answer: str, *args: str) -> subprocess.CompletedProcess:
    """`cachemgr ARGS` with a terminal (a pty) for stdin, `answer` typed ahead into it."""
    import pty

    master, slave = pty.openpty()
    try:
        os.write(master, answer.encode())
        return subprocess.run(
            [sys.executable, "-m", "cachemgr", *cli.base(), *args],
            stdin=slave,
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(),
        )
    finally:
        os.close(slave)
        os.close(master)


def test_purge_asks_first(aged_gpu, cli_for):
    cli = cli_for(aged_gpu)
    cli("scan")
    before = disk(aged_gpu)
    r = on_a_terminal(cli, "n\n", "purge", "--all")
    assert r.returncode == 130 and "delete" in r.stderr and "?" in r.stderr and disk(aged_gpu) == before
    r = on_a_terminal(cli, "y\n", "purge", "--all")
    assert r.returncode == 0 and disk(aged_gpu) == {}, r.stderr
    assert "say what to purge" in cli.proc("purge").stderr


def test_purge_without_a_terminal_to_ask_on_is_a_usage_error(aged_gpu, cli_for):
    """Without --yes and with stdin no terminal (a pipe, /dev/null, cron), purge printed its plan,
    then "aborted" (exit 130), and with --json printed nothing: it cannot ask, so it says so first."""
    cli = cli_for(aged_gpu)
    cli("scan")
    before = disk(aged_gpu)
    for args in (["--all"], ["--all", "--json"]):
        r = cli("purge", *args, code=2)
        assert r.stdout == "" and r.stderr == "cachemgr: error: stdin is not a terminal: pass --yes (or --dry-run)\n"
    closed = subprocess.run(  # no stdin at all (`<&-`): Python's sys.stdin is None
        [sys.executable, "-m", "cachemgr", *cli.base(), "purge", "--all"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        preexec_fn=lambda: os.close(0),
    )
    assert (closed.returncode, closed.stderr) == (
        2,
        "cachemgr: error: stdin is not a terminal: pass --yes (or --dry-run)\n",
    )
    assert disk(aged_gpu) == before


def test_a_purge_of_nothing_reported_as_json_touches_nothing(aged_gpu, cli_for):
    """`purge --json --yes` with nothing to purge reports a run (dry_run false) without carrying
    one out: what a dead run left in the trash stays for the next real run, as without --json."""
    cli = cli_for(aged_gpu)
    cli("scan")
    (aged_gpu / layout.TRASH_DIR).mkdir(exist_ok=True)
    (aged_gpu / layout.TRASH_DIR / "1-0").write_bytes(b"left by a dead run")
    r = cli.json("purge", "--older-than", "3650d", "--yes")
    assert r["dry_run"] is False and r["evicted"] == 0
    assert (aged_gpu / layout.TRASH_DIR / "1-0").exists()


def test_purge_corrupt(aged_cpu, cli_for):
    bad = aged_cpu / "fxgraph" / "bb" / ("f" + "b" * 51) / "truncated"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"\x80\x04garbage")
    age_files(aged_cpu, HOUR, [bad])
    cli = cli_for(aged_cpu)
    r = cli.json("purge", "--corrupt", "--yes")
    assert [e["key"] for e in r["entries"]] == [str(bad.relative_to(aged_cpu))] and not bad.exists()


@pytest.mark.parametrize("args", [["evict", "--max-size", "1MB"], ["purge", "--kind", "triton", "--yes"]])
def test_evict_never_imports_torch(aged_gpu, db_url, args):
    base = ["--cache-dir", str(aged_gpu), "--db", db_url]
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH_PROGRAM, *base, *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_evict_library_api(aged_gpu, db_url):
    from cachemgr import config
    from cachemgr.evict import Limits, evict
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    s = config.load(flags={"cache_dir": str(aged_gpu), "max_size": "10MB", "max_age": "14d"}, environ={})
    limits = Limits.from_settings(s)
    assert (limits.max_size, limits.max_age, limits.grace, limits.low_water) == (10_000_000, 14 * 86400, 60.0, 0.9)
    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    r = evict(db, cid, str(aged_gpu), limits)
    d = r.as_dict()
    assert set(d) >= {
        "planned",
        "evicted",
        "freed_bytes",
        "remaining_bytes",
        "entries",
        "recreatable_freed_bytes",
        "skipped",
    }
    assert d["remaining_bytes"] <= 9_000_000 and all(set(e) >= {"key", "bytes"} for e in d["entries"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.planned = 0  # frozen
    # eviction raises its connection's checkpoint threshold per commit, and puts it back after
    assert r.evicted and db.engine.pool.checkedin() == 1
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar_one() == 1000


def test_cost_policy_keeps_its_clock_across_cli_runs(aged_gpu, cli_for):
    """GreedyDual's clock L never falls: a run starts from the clock the last run kept (in the
    index), so recency counts across runs. Set it high, evict: it must stay at least as high."""
    import sqlite3

    cli = cli_for(aged_gpu)
    cli("scan")
    path = cli.db_url.split(":///", 1)[1]
    with sqlite3.connect(path) as c:
        c.execute("UPDATE caches SET gds_clock = 1e9")
    r = cli.json("evict", "--policy", "cost", "--max-size", "1MiB", "--grace", "0")
    assert r["evicted"] > 0
    with sqlite3.connect(path) as c:
        (clock,) = c.execute("SELECT gds_clock FROM caches").fetchone()
    assert clock >= 1e9


@pytest.mark.parametrize(
    "clock,history",
    [
        ("x", "not json"),
        ("1e999", "[[1, 2, 3]]"),
        (5.0, '{"a": 1}'),
        (5.0, '[[1, "x"], [2, 3]]'),
        (5.0, "[" * 5000 + "]" * 5000),  # deeper than the JSON reader recurses
    ],
)
def test_a_damaged_cost_clock_does_not_stop_eviction(aged_gpu, cli_for, clock, history):
    """The cost policy's clock as the index keeps it, edited or damaged: eviction goes on (with
    the clock started again where it cannot be read); it failed with exit 70 on every run, and
    the daemon's evictions with it."""
    import sqlite3

    cli = cli_for(aged_gpu)
    cli("scan")
    with sqlite3.connect(cli.db_url.split(":///", 1)[1]) as c:
        c.execute("UPDATE caches SET gds_clock = ?, gds_history = ?", (clock, history))
    r = cli.json("evict", "--policy", "cost", "--max-size", "1MiB", "--grace", "0")
    assert r["evicted"] > 0


@pytest.mark.parametrize("batch", [500, 8])
def test_a_failure_while_the_looker_moves_units_puts_every_unit_back(aged_gpu, db_url, monkeypatch, batch):
    """Units are looked at and moved off the main thread, the next batch while this one commits.
    One move fails part way (in one batch, or with batches of 8) while the looks go on: nothing
    of the failing batch or the next is committed, every file that went into the trash comes
    back, and the index still agrees with the disk."""
    from cachemgr.evict import Limits, evict, execute, look
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    take, calls = look.Looker.take, []

    def failing_take(self, took, files):
        calls.append(took)
        if len(calls) == 40:
            raise RuntimeError("the file system went away")
        return take(self, took, files)

    monkeypatch.setattr(execute, "BATCH", batch)
    monkeypatch.setattr(execute, "LOOK_CHUNK", 2)  # many tasks: the looks go on after the failure
    monkeypatch.setattr(look.Looker, "take", failing_take)
    before = disk(aged_gpu)
    with pytest.raises(RuntimeError, match="went away"):
        evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    if batch == 500:
        assert len(calls) > 40  # units were moved after the failure
        assert disk(aged_gpu) == before
    assert os.listdir(aged_gpu / layout.TRASH_DIR) == []
    monkeypatch.setattr(look.Looker, "take", take)
    check = reconcile(db, cid, str(aged_gpu))
    assert not (check.added or check.changed or check.removed), check.as_dict()


@pytest.mark.parametrize("when", ["busy", "idle", "idle-last"])
def test_a_worker_process_killed_mid_eviction(aged_gpu, db_url, monkeypatch, when):
    """A worker process dies (SIGKILL) mid-run, whether it holds units to look at or had
    answered all it was sent (before the last batch, where only the unlinks after its commit
    are left to send it): the run stops with a one-line error; what the other worker moved of
    the batches not committed comes back; what went is only what was planned; the next
    eviction empties the trash and a scan agrees. (An idle worker's death had gone unnoticed
    when the rest went to the live one: the run ended as if nothing had happened.)"""
    from cachemgr.evict import Limits, carry_out, execute, look, make_plan
    from cachemgr.evict.execute import exclusive
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    started, made = look._Process.__init__, []

    def recorded(self):
        started(self)
        made.append(self)

    renamed = []

    def hook(stage):  # after a batch was moved, before its commit: the first, or the last
        if stage != "renamed" or made[0].ended is not None:
            return
        renamed.append(stage)
        if when == "idle-last" and len(renamed) < -(-len(p.units) // execute.BATCH):  # (not the last yet)
            return
        while when != "busy" and made[0].jobs:
            time.sleep(0.001)
        os.kill(made[0].proc.pid, signal.SIGKILL)
        while made[0].ended is None:  # as the run learns of it: its reader sees the pipe close
            time.sleep(0.001)

    monkeypatch.setattr(execute, "PROCESSES_FROM", 0)
    monkeypatch.setattr(execute, "LOOK_PROCESSES", 2)
    monkeypatch.setattr(execute, "BATCH", 8)
    monkeypatch.setattr(look._Process, "__init__", recorded)
    before = disk(aged_gpu)
    with exclusive(str(aged_gpu)) as root:
        p, rows = make_plan(db, cid, root, Limits(max_size=0, grace=0))
        planned = {e.key for e in p.entries}
        with pytest.raises(look.WorkerDied, match=r"eviction worker process ended \(signal SIGKILL\)"):
            carry_out(db, cid, root, p, rows, 0, hook=hook)
    assert len(made) == 2 and all(w.proc.poll() is not None for w in made)  # none is left running
    if when != "busy":  # every job of the dead worker was answered: what went is unlinked (its bin
        # too, by the evicting process), what did not go is back
        assert not [p for p in (aged_gpu / layout.TRASH_DIR).rglob("*") if p.is_file()]
    after = disk(aged_gpu)
    assert set(after) < set(before) and all(after[k] == before[k] for k in after)
    for path in set(before) - set(after):
        c = layout.classify(path)
        assert c is not None and c.key in planned, path
    check = reconcile(db, cid, str(aged_gpu))  # rows of what the dead worker moved go
    assert not (check.added or check.changed), check.as_dict()
    r = carry_out(db, cid, str(aged_gpu), *make_plan(db, cid, str(aged_gpu), Limits(max_size=0, grace=0)), 0)
    assert (r.evicted > 0) == (when != "idle-last")  # (the last batch's commit took the rest)
    assert os.listdir(aged_gpu / layout.TRASH_DIR) == [] and disk(aged_gpu) == {}
    check = reconcile(db, cid, str(aged_gpu))
    assert not (check.added or check.changed or check.removed), check.as_dict()


def _two_workers_spawned_by(spawn_module, root, db_url, monkeypatch):
    """The index of `root`, scanned, and eviction set to look through 2 worker processes that
    `spawn_module` starts."""
    from cachemgr.evict import execute, look
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(root))
    reconcile(db, cid, str(root))
    monkeypatch.setattr(execute, "PROCESSES_FROM", 0)
    monkeypatch.setattr(execute, "LOOK_PROCESSES", 2)
    monkeypatch.setattr(look.procs, "spawn_module", spawn_module)
    return db, cid


def test_workers_that_die_while_booting_fail_the_run_and_are_never_waited_on(aged_gpu, db_url, monkeypatch):
    """Every worker process exits before it reads its start (a broken interpreter, out of
    memory): the run stops with WorkerDied, at once, and moves nothing. A look handed to a worker
    whose reader had already finished was never answered: the run hung."""
    import threading

    from cachemgr import procs
    from cachemgr.evict import Limits, carry_out, look, make_plan
    from cachemgr.evict.execute import exclusive

    def dead_on_arrival(module):
        p = procs.spawn([sys.executable, "-c", "raise SystemExit(3)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        p.wait()
        return p, p.stdin, p.stdout

    db, cid = _two_workers_spawned_by(dead_on_arrival, aged_gpu, db_url, monkeypatch)
    before = disk(aged_gpu)
    raised: list[BaseException] = []

    def run() -> None:
        with exclusive(str(aged_gpu)) as root:
            try:
                carry_out(db, cid, root, *make_plan(db, cid, root, Limits(max_size=0, grace=0)), 0)
            except BaseException as e:  # noqa: BLE001 - looked at below
                raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the eviction hung on a worker that was gone"
    assert len(raised) == 1 and isinstance(raised[0], look.WorkerDied), raised
    assert "exit 3" in str(raised[0])
    assert disk(aged_gpu) == before and not os.listdir(aged_gpu / layout.TRASH_DIR)


def test_a_worker_that_cannot_be_started_leaves_nothing_open(aged_gpu, db_url, monkeypatch):
    """The second worker cannot be spawned (no processes or descriptors left): the run fails with
    that error, moves nothing, and closes what it had opened (the trash, the first worker)."""
    import errno

    from cachemgr import procs
    from cachemgr.evict import Limits, carry_out, make_plan
    from cachemgr.evict.execute import exclusive

    spawned, real = [], procs.spawn_module

    def second_fails(module):
        if spawned:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        proc, stdin, stdout = real(module)
        spawned.append(proc)
        return proc, stdin, stdout

    db, cid = _two_workers_spawned_by(second_fails, aged_gpu, db_url, monkeypatch)
    before = disk(aged_gpu)
    with exclusive(str(aged_gpu)) as root:
        p, rows = make_plan(db, cid, root, Limits(max_size=0, grace=0))
        open_before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError, match="temporarily unavailable"):
            carry_out(db, cid, root, p, rows, 0)
        assert set(os.listdir("/proc/self/fd")) <= open_before  # the trash's descriptor is closed
    assert disk(aged_gpu) == before
    assert spawned[0].returncode == 0  # it read EOF for its start, and ended, before the error was raised


def test_a_worker_refuses_a_replaced_root_or_bin(aged_gpu, tmp_path):
    """A worker opens the root by path, and its bin in the trash by name: if either is not the
    directory the evicting process holds (replaced meanwhile), it refuses to look at anything."""
    from cachemgr import safefs
    from cachemgr.evict import look

    other = tmp_path / "other"
    other.mkdir()
    (aged_gpu / layout.TRASH_DIR).mkdir(exist_ok=True)
    with safefs.Root(str(aged_gpu)) as root:
        with pytest.raises(safefs.Refused, match="replaced"):
            look._start(os.getpid(), str(other), root.id, None, {}, 0.0, 0)
        assert look._start(os.getpid(), str(aged_gpu), root.id, None, {}, 0.0, 0).root.id == root.id
        trash = root.dir_fd(layout.TRASH_DIR)
        trash_id = safefs.identity(os.fstat(trash))
        (b,) = look.make_bins(trash, 1)
        assert b is not None
        looker = look._start(os.getpid(), str(aged_gpu), root.id, (trash_id, b.name, b.id), {}, 0.0, 3)
        assert safefs.identity(os.fstat(looker.trash)) == b.id and looker.bin == 3
        os.close(looker.trash)
        os.rmdir(b.name, dir_fd=trash)
        os.mkdir(b.name, dir_fd=trash)  # the same name, another folder
        with pytest.raises(safefs.Refused, match="trash folder's bin was replaced") as replaced:
            look._start(os.getpid(), str(aged_gpu), root.id, (trash_id, b.name, b.id), {}, 0.0, 0)
        assert replaced.value.filename == f"{layout.TRASH_DIR}/{b.name}"
        with pytest.raises(safefs.Refused, match="trash folder was replaced") as replaced:  # the trash itself
            look._start(os.getpid(), str(aged_gpu), root.id, (root.id, b.name, b.id), {}, 0.0, 0)
        assert replaced.value.filename == layout.TRASH_DIR
        look.close_bins(trash, [b])
        assert os.listdir(trash) == []


def test_each_worker_process_moves_into_a_bin_of_its_own(aged_gpu, db_url, monkeypatch):
    """Two looker processes never rename into, or unlink from, one folder (the kernel holds a
    folder's lock for each: they took turns): each has its bin in the trash, and the run leaves
    no bin behind."""
    from cachemgr.evict import Limits, evict, execute, look

    db, cid = _indexed(aged_gpu, db_url)
    trash, seen = aged_gpu / layout.TRASH_DIR, []

    def hook(stage):
        if stage == "renamed":
            seen.append({b.name: len(os.listdir(b)) for b in trash.iterdir()})

    execute_run = execute.Executor.run

    def with_hook(self, *a, **kw):
        self.hook = hook
        return execute_run(self, *a, **kw)

    monkeypatch.setattr(execute, "PROCESSES_FROM", 0)
    monkeypatch.setattr(execute, "LOOK_PROCESSES", 2)
    monkeypatch.setattr(execute, "BATCH", 8)
    monkeypatch.setattr(execute, "LOOK_CHUNK", 1)  # a batch's units go to both workers
    monkeypatch.setattr(execute.Executor, "run", with_hook)
    r = evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert r.evicted > 16 and len(seen) > 2
    bins = {name for batch in seen for name in batch}
    assert len(bins) == 2 and all(n.startswith(look.BIN_PREFIX) for n in bins)
    assert all(set(batch) == bins for batch in seen)
    assert any(all(batch.values()) for batch in seen)  # both moved units of one batch
    assert os.listdir(trash) == [] and disk(aged_gpu) == {}


def test_a_dead_runs_bins_are_emptied_one_level_and_nothing_through_a_symlink(aged_cpu, db_url, tmp_path):
    """What a killed run left in its bins goes with the next run: its files and kernel folders
    of files. A folder someone put into a kernel folder since stays (never descended into: it
    could be anyone's), and so do its kernel folder and bin; a symlink named like a bin is
    removed, never followed."""
    from cachemgr.evict import Limits, evict

    db, cid = _indexed(aged_cpu, db_url)
    trash = aged_cpu / layout.TRASH_DIR
    left = trash / "bin.4242.0"
    (left / "k" / "sub").mkdir(parents=True)
    (left / "k" / "sub" / "theirs").write_text("x")
    (left / "k" / "kernel.json").write_text("{}")
    (left / "kernel2").mkdir()
    (left / "kernel2" / "a.cubin").write_text("x")
    (left / "4242-7").write_text("module")
    (trash / "4242-8").write_text("as an older cachemgr left it")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (trash / "bin.4242.1").symlink_to(outside)
    evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert sorted(str(p.relative_to(trash)) for p in trash.rglob("*")) == [
        "bin.4242.0",
        "bin.4242.0/k",
        "bin.4242.0/k/sub",
        "bin.4242.0/k/sub/theirs",
    ]
    assert (outside / "precious").read_text() == "x"


@pytest.mark.parametrize("processes", [0, 2], ids=["thread", "workers"])
def test_with_no_room_for_a_bin_the_trash_itself_takes_the_units(aged_gpu, db_url, monkeypatch, processes):
    """A full disk (or a quota) refuses a new folder in the trash, where a rename into the trash
    needs none: each looker then moves into the trash itself, not deletes in place."""
    import errno

    from cachemgr.evict import Limits, evict, execute

    db, cid = _indexed(aged_gpu, db_url)
    mkdir, trash, seen = os.mkdir, aged_gpu / layout.TRASH_DIR, []

    def full(path, *a, **kw):
        if str(path).startswith("bin."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return mkdir(path, *a, **kw)

    execute_run = execute.Executor.run

    def with_hook(self, *a, **kw):
        self.hook = lambda stage: stage == "renamed" and seen.append(sorted(os.listdir(trash)))
        return execute_run(self, *a, **kw)

    monkeypatch.setattr(os, "mkdir", full)
    monkeypatch.setattr(execute, "PROCESSES_FROM", 0 if processes else 1 << 30)
    monkeypatch.setattr(execute, "LOOK_PROCESSES", max(processes, 1))
    monkeypatch.setattr(execute.Executor, "run", with_hook)
    r = evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert r.evicted and not r.in_place and seen and all(names for names in seen)
    assert not any(n.startswith("bin.") for names in seen for n in names)
    assert os.listdir(trash) == [] and disk(aged_gpu) == {}


def test_another_users_folder_in_the_trash_is_not_emptied(aged_cpu, db_url):
    """A folder named like a bin that another user owns, or anything in a trash another user
    owns (made by their scan; or one they put in place of ours), may hold what they could not
    delete themselves: eviction, run as root, empties neither; names that are no folder go."""
    from cachemgr.evict import Limits, evict

    if os.geteuid() != 0:
        pytest.skip("needs root to make another user's folders")
    db, cid = _indexed(aged_cpu, db_url)
    trash = aged_cpu / layout.TRASH_DIR
    planted = trash / "bin.77.0"
    (planted / "V").mkdir(parents=True)
    (planted / "V" / "theirs").write_text("x")
    (planted / "top").write_text("x")
    for p in (planted, planted / "V"):
        os.chown(p, 4321, 4321)
    evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert (planted / "V" / "theirs").exists()  # never entered: the folder one level down stays
    assert not (planted / "top").exists()  # (one level, as any folder in a trash of ours)

    os.chown(trash, 4321, 4321)  # now the trash is theirs
    (trash / "folder").mkdir()
    (trash / "folder" / "f").write_text("x")
    (trash / "read-1-2").write_text("a dead reader's link")
    evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert (trash / "folder" / "f").exists() and (planted / "V" / "theirs").exists()
    assert not (trash / "read-1-2").exists()


def _indexed(root: Path, db_url: str):
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(root))
    reconcile(db, cid, str(root))
    return db, cid


def _files_under(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file()}


def test_a_directory_moved_out_of_the_cache_mid_eviction_is_not_emptied(aged_cpu, db_url, tmp_path, monkeypatch):
    """An operator moves a folder out of the cache (`mv $CACHE/xy /backup/`) while eviction
    runs: the descriptors eviction kept of it now point outside the root. Nothing in it goes:
    what was already renamed comes back, and the rest is no longer found under the root."""
    from cachemgr.evict import Limits, evict, look

    db, cid = _indexed(aged_cpu, db_url)
    take, moved = look.Looker.take, {}

    def take_after_a_move(self, took, files):
        if not moved:
            rel = layout.fs_path(files[0].move[0][0]).rpartition("/")[0]
            moved["out"] = tmp_path / "backup" / rel.replace("/", "_")
            moved["out"].parent.mkdir()
            os.rename(aged_cpu / rel, moved["out"])
            moved["files"] = _files_under(moved["out"])
        return take(self, took, files)

    monkeypatch.setattr(look.Looker, "take", take_after_a_move)
    r = evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert r.evicted and moved["files"]
    assert _files_under(moved["out"]) == moved["files"]
    assert "changed since planned" in {why for _, why in r.skipped}


@pytest.mark.parametrize("trash", [True, False], ids=["trash", "in-place"])
@pytest.mark.parametrize("written", ["young.json", "tmp.pid_1_ab/x.json"])
def test_a_file_written_into_a_kernel_directory_mid_eviction_stays(aged_gpu, db_url, monkeypatch, written, trash):
    """A Triton kernel directory goes whole, after each of its files was looked at. A file
    written into it after the look (a new kernel file, a write in progress) keeps it: it never
    goes with the directory, whether that moves into the trash or is deleted in place."""
    from cachemgr.evict import Limits, evict, execute, look

    db, cid = _indexed(aged_gpu, db_url)
    take, wrote = look.Looker.take, []

    def take_after_a_write(self, took, files):
        kernel = next((f for f in files if f.inodes is not None), None)
        if kernel is not None and not wrote:
            p = aged_gpu / layout.fs_path(kernel.move[0][0]) / written
            p.parent.mkdir(exist_ok=True)
            p.write_text("new")
            wrote.append(p)
        return take(self, took, files)

    monkeypatch.setattr(look.Looker, "take", take_after_a_write)
    if not trash:
        monkeypatch.setattr(execute.Executor, "_open_trash", lambda self: None)
    r = evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert r.evicted and wrote and wrote[0].read_text() == "new"
    kernel_dir = wrote[0].parent if written == "young.json" else wrote[0].parent.parent
    assert len(list(kernel_dir.iterdir())) > 1  # the kernel's own files stayed with it


def test_a_trash_the_evictor_may_not_write_to_deletes_in_place(aged_cpu, db_url, monkeypatch):
    """Another user's `.cachemgr-trash` (or an immutable one): the units go in place, not nowhere."""
    import errno

    from cachemgr import safefs
    from cachemgr.evict import Limits, evict

    def refused(self, rel, expect, dst_fd, dst_name):
        raise PermissionError(errno.EACCES, "Permission denied")

    db, cid = _indexed(aged_cpu, db_url)
    monkeypatch.setattr(safefs.Root, "move", refused)
    before = sum(disk(aged_cpu).values())
    r = evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert r.evicted and not [why for _, why in r.skipped if why == "delete failed"]
    assert before - sum(disk(aged_cpu).values()) == r.freed_bytes > 0


def test_a_trash_replaced_before_the_workers_open_it_stops_with_exit_7(aged_gpu, db_url, monkeypatch):
    """Eviction's worker processes open the root and the trash themselves; one replaced between
    the evicting process's open and theirs is refused: one line, exit 7 (not an internal error),
    nothing moved, and the index still agrees with the disk."""
    from cachemgr.evict import Limits, evict, execute
    from cachemgr.index.scan import reconcile

    db, cid = _indexed(aged_gpu, db_url)
    open_trash = execute.Executor._open_trash

    def then_replaced(self):
        fd = open_trash(self)
        os.rename(aged_gpu / layout.TRASH_DIR, aged_gpu.parent / "old-trash")
        os.mkdir(aged_gpu / layout.TRASH_DIR)
        return fd

    monkeypatch.setattr(execute, "PROCESSES_FROM", 0)
    monkeypatch.setattr(execute, "LOOK_PROCESSES", 2)
    monkeypatch.setattr(execute.Executor, "_open_trash", then_replaced)
    before = disk(aged_gpu)
    with pytest.raises(UnsafePath, match="trash folder was replaced") as e:
        evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert e.value.exit_code == 7
    assert disk(aged_gpu) == before
    check = reconcile(db, cid, str(aged_gpu))
    assert not (check.added or check.changed or check.removed), check.as_dict()


def test_a_commit_that_fails_puts_back_its_batch_and_the_next(aged_gpu, db_url, monkeypatch):
    """The third batch's commit fails while the fourth is being moved: the first two stay
    evicted (committed), the third and fourth come back whole, and index and disk agree."""
    from cachemgr.evict import Limits, evict, execute
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    commit, calls = execute.Executor._commit, []

    def failing_commit(self, taken):
        calls.append(len(taken))
        if len(calls) == 3:
            raise RuntimeError("the index went away")
        return commit(self, taken)

    monkeypatch.setattr(execute, "BATCH", 8)
    monkeypatch.setattr(execute.Executor, "_commit", failing_commit)
    before = disk(aged_gpu)
    with pytest.raises(RuntimeError, match="index went away"):
        evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    after = disk(aged_gpu)
    assert len(calls) == 3 and set(after) < set(before)  # two batches went
    assert os.listdir(aged_gpu / layout.TRASH_DIR) == []
    check = reconcile(db, cid, str(aged_gpu))
    assert not (check.added or check.changed or check.removed), check.as_dict()


def test_a_failure_right_after_a_commit_puts_nothing_of_it_back(aged_gpu, db_url, monkeypatch):
    """Something raises just after a batch's commit returned (a second Ctrl-C there; here the
    test's hook): the batch is not put back (its rows and events are committed: a scan found its
    files again as new entries), the batch looked at meanwhile is, and the next run empties what
    the committed batch left in the trash."""
    from cachemgr.evict import Limits, evict, execute
    from cachemgr.index.scan import reconcile

    db, cid = _indexed(aged_gpu, db_url)
    execute_run, commit, committed = execute.Executor.run, execute.Executor._commit, []

    def recorded(self, taken):
        commit(self, taken)
        committed.append([e.key for t in taken for e in t.unit.entries])

    def hook(stage):
        if stage == "committed" and len(committed) == 2:
            raise RuntimeError("stopped right after a commit")

    def with_hook(self, *a, **kw):
        self.hook = hook
        return execute_run(self, *a, **kw)

    monkeypatch.setattr(execute, "BATCH", 8)
    monkeypatch.setattr(execute.Executor, "_commit", recorded)
    monkeypatch.setattr(execute.Executor, "run", with_hook)
    before = disk(aged_gpu)
    with pytest.raises(RuntimeError, match="right after a commit"):
        evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    after = disk(aged_gpu)
    gone = {layout.classify(path).key for path in set(before) - set(after)}  # type: ignore[union-attr]
    assert len(committed) == 2 and gone == {key for keys in committed for key in keys}
    assert all(after[p] == before[p] for p in after)
    check = reconcile(db, cid, str(aged_gpu))
    assert not (check.added or check.changed or check.removed), check.as_dict()
    monkeypatch.setattr(execute.Executor, "run", execute_run)
    evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert not [p for p in (aged_gpu / layout.TRASH_DIR).rglob("*") if not p.is_dir()]


def test_streamed_links_plan_as_the_rows_do(aged_gpu, db_url):
    """Eviction links entries as their references stream from the index (no reference is held);
    purge and tests link Rows. Both give the same graph and the same plan."""
    from cachemgr.evict import Limits, load_rows, plan
    from cachemgr.evict.policy import Graph
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    launcher = aged_gpu / "triton" / "0" / ("L" * 52)  # a launcher build: a .so in a directory nothing names
    launcher.mkdir()
    (launcher / "cuda_utils.so").write_bytes(b"\x7fELF")
    age_files(aged_gpu, HOUR, [launcher / "cuda_utils.so"])
    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    with sqlite3.connect(db_path(db_url)) as c:  # a ref its key does not spell (an older layout's, say)
        c.execute("UPDATE entries SET ref = 'odd' WHERE id = (SELECT MIN(id) FROM entries WHERE kind = 'code')")
    streamed = load_rows(db, cid, str(aged_gpu))
    assert list(streamed.ref).count("odd") == 1
    (at,) = [i for i, k in enumerate(streamed.key) if k.endswith("L" * 52)]
    assert streamed[at].launcher and not streamed.graph().is_orphan(at)
    rows = list(load_rows(db, cid, str(aged_gpu), full=True))
    assert not streamed.refs and sum(len(r.refs) for r in rows) > 100
    bare = {"refs": (), "torch_version": None, "system_hash": None, "torch_version_hash": None}
    assert [dataclasses.replace(r, **bare) for r in rows] == list(streamed)
    a, b = streamed.graph(), Graph.build(rows)
    for i in range(len(rows)):
        assert (list(a.children[i]), list(a.parents[i]), a.dead[i]) == (
            list(b.children[i]),
            list(b.parents[i]),
            b.dead[i],
        )
    assert sum(a.children.count(i) for i in range(len(rows))) > 100
    for limits in (Limits(max_size=0, grace=0), Limits(max_files=len(rows) // 2, grace=0)):
        assert list(plan(streamed, limits, "lru", time.time()).units) == list(
            plan(rows, limits, "lru", time.time()).units
        )


def test_references_of_entries_indexed_after_the_rows_are_passed_over():
    """The rows and then their references are read by two queries; the daemon may index entries
    in between. References of an entry the rows do not hold are not given to another entry."""
    from cachemgr.evict import _positioned
    from cachemgr.evict.policy import Table

    t = Table()
    t.id.extend([3, 7, 9])
    refs = [(3, "code", "a"), (5, "code", "b"), (9, "triton", "c"), (12, "code", "d")]
    assert list(_positioned(t, refs)) == [(0, "code", "a"), (2, "triton", "c")]


def test_evict_model_takes_the_aot_entries_of_its_graphs(aged_gpu, db_url):
    """With --model only the model's graphs may go, and with them the AOT entries that name them
    (read from the AOT entries' references: the plan's table must hold them for --model)."""
    from types import SimpleNamespace

    from cachemgr import safefs
    from cachemgr.cli.evict import plan_eviction
    from cachemgr.evict import Limits
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    db = Database(db_url)
    cid = db.cache_id("h", str(aged_gpu))
    reconcile(db, cid, str(aged_gpu))
    with sqlite3.connect(db_path(db_url)) as c:
        graph, aot = c.execute(
            "SELECT r.ref, e.key FROM entry_refs r JOIN entries e ON e.id = r.entry_id "
            "WHERE e.kind = 'aotautograd' AND r.kind = 'fxgraph' ORDER BY e.id LIMIT 1"
        ).fetchone()
    app = SimpleNamespace(db=db, cache_id=cid, store=SimpleNamespace(model_graphs=lambda model: {graph}))
    with safefs.Root(str(aged_gpu)) as root:
        p, _ = plan_eviction(app, root, SimpleNamespace(policy="lru"), Limits(max_size=0, grace=0), time.time(), "m")
    taken = {e.key for e in p.entries}
    assert aot in taken and any(k.startswith(f"fxgraph/{graph[1:3]}/{graph}/") for k in taken)
    assert all(not k.startswith("aotautograd/") or k == aot for k in taken)  # no other model's AOT entry


def test_a_commit_on_a_full_index_disk_gives_back_the_reserve_and_goes_through(aged_cpu, db_url, monkeypatch):
    """The index's own disk is full when eviction commits a batch, and nothing of the batch is in
    the trash to free (deleted in place): the index's reserve is given back, the commit goes
    through, and the reserve is made again once there is room."""
    import sqlite3

    from cachemgr.evict import Limits, evict, execute

    db, cid = _indexed(aged_cpu, db_url)
    assert db.reserve is not None and db.reserve.exists()
    write, calls = execute.Executor._write, []

    def full_once(self, taken, events):
        calls.append(db.reserve.exists())
        if len(calls) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return write(self, taken, events)

    monkeypatch.setattr(execute.Executor, "_open_trash", lambda self: None)
    monkeypatch.setattr(execute.Executor, "_write", full_once)
    r = evict(db, cid, str(aged_cpu), Limits(max_size=0, grace=0))
    assert r.evicted and calls[:2] == [True, False]  # retried once the reserve was given back
    assert db.reserve.exists()


def test_a_locked_index_at_commit_puts_the_batch_back(aged_gpu, db_url, monkeypatch):
    """A batch's commit fails for a reason that is no full disk (another process holds the
    index's write lock past the timeout): nothing of it is deleted from the trash to make room.
    The batch comes back whole, and index and disk agree."""
    import sqlite3

    from cachemgr.evict import Limits, evict, execute
    from cachemgr.index.scan import reconcile

    db, cid = _indexed(aged_gpu, db_url)

    def locked(self, taken, events):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(execute.Executor, "_write", locked)
    before = disk(aged_gpu)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert disk(aged_gpu) == before
    check = reconcile(db, cid, str(aged_gpu), full=True)
    assert not (check.added or check.changed or check.removed), check.as_dict()


def test_a_folder_moved_away_while_its_entry_is_looked_at_keeps_its_unit(aged_gpu, db_url, monkeypatch):
    """An fxgraph entry's folder is moved aside while eviction looks at it, and back: the entry
    is not 'gone' (its rows deleted with its unit's, its file left on disk with no row, found
    only by a full scan). Its unit stays whole, and index and disk agree after."""
    from cachemgr.evict import Limits, evict, look
    from cachemgr.index.scan import reconcile

    db, cid = _indexed(aged_gpu, db_url)
    files_of, moved = look.Looker.files_of, []

    def looked_at_while_moved(self, kind, key):
        if kind != "fxgraph" or (moved and key != moved[0]):
            return files_of(self, kind, key)
        folder = aged_gpu / layout.fs_path(key).rsplit("/", 2)[0]
        os.rename(folder, folder.with_name("aside"))
        moved[:] = [key]
        try:
            return files_of(self, kind, key)
        finally:
            os.rename(folder.with_name("aside"), folder)

    monkeypatch.setattr(look.Looker, "files_of", looked_at_while_moved)
    r = evict(db, cid, str(aged_gpu), Limits(max_size=0, grace=0))
    assert r.evicted and moved and (aged_gpu / layout.fs_path(moved[0])).exists()
    check = reconcile(db, cid, str(aged_gpu), full=True)
    assert not (check.added or check.changed or check.removed), check.as_dict()
