"""The fleet index on the real PostgreSQL: migrations, every command, several hosts at once, and
the fleet report. Each test gets a throwaway database of its own, dropped at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import Cli, subprocess_env
from test_index import find_bytes

PG_SERVER = os.environ.get("CACHEMGR_TEST_PG", "root@127.0.0.1:5432")


def _admin():
    import psycopg

    return psycopg.connect(f"postgresql://{PG_SERVER}/test", autocommit=True, connect_timeout=5)


@pytest.fixture
def pg_url():
    """A fresh PostgreSQL database for one test (the shared server has other users)."""
    name = f"cachemgr_t_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with _admin() as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://{PG_SERVER}/{name}"
    finally:
        with _admin() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def pg_query(url: str, sql: str, *params) -> list[tuple]:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as c:
        cur = c.execute(sql, params)
        return cur.fetchall() if cur.description else []


def test_migrations_run_on_postgres(pg_url):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from cachemgr.index.db import Database
    from cachemgr.index.models import Base
    from cachemgr.index.revision import HEAD_REVISION

    assert pg_query(pg_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'") == [(0,)]
    db = Database(pg_url)
    assert db.current_revision() == HEAD_REVISION
    with db.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata) == []
    db.close()
    tables = {t for (t,) in pg_query(pg_url, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {
        "alembic_version",
        "caches",
        "entries",
        "entry_refs",
        "entry_component_sets",
        "component_sets",
        "pins",
        "events",
        "shapes",
    } <= tables
    Database(pg_url).close()  # at head: a no-op
    assert pg_query(pg_url, "SELECT version_num FROM alembic_version") == [(HEAD_REVISION,)]


def test_every_command_on_postgres(cpu_cache, pg_url):
    cli = Cli(cpu_cache, pg_url, host="pg-host")
    r = cli.proc("scan")  # a real process: a fresh database is migrated at start
    assert r.returncode == 0 and "added" in r.stdout, r.stderr
    doc = cli.json("stats")
    assert doc["bytes"] == find_bytes(cpu_cache) and doc["entries"] > 0
    assert doc["activity"]["compiles"] > 0  # the events' boolean `recompile` sums on PostgreSQL too
    assert "total" in cli("stats").stdout
    fx = cli.json("ls", "--kind", "fxgraph", "--sort", "cost")
    assert fx and all(e["kind"] == "fxgraph" for e in fx)
    assert cli.json("ls", "--sort", "age", "--limit", "3") and cli.json("ls", "--older-than", "1d") == []
    shown = cli.json("show", fx[0]["key"])
    assert shown["key"] == fx[0]["key"] and all(r["present"] for r in shown["references"])
    assert cli.json("show", fx[0]["graph_key"])  # by graph key
    again = cli.json("scan")
    assert again["added"] == again["changed"] == again["removed"] == 0
    fleet = cli.json("stats", "--fleet")
    assert fleet["hosts"] == ["pg-host"] and fleet["bytes"] == doc["bytes"]
    assert [e["key"] for e in cli.json("ls", "--host", "pg-host")] == [e["key"] for e in cli.json("ls")]
    rep = cli.json("fleet", "report")
    assert rep["hosts"][0]["host"] == "pg-host" and rep["hosts"][0]["bytes"] == doc["bytes"]
    assert rep["versions_in_use"] == [fx[0]["torch_version"]]
    for args in (["stats", "--fleet"], ["fleet", "report"], ["ls", "--host", "pg-host"]):
        assert cli(*args).stdout.strip()
    # every command that reads or writes the index, not only those above (`scan --full`, evict,
    # purge and the daemon's start once all failed on PostgreSQL alone, with a TypeError)
    full = cli.json("scan", "--full")
    assert full["added"] == full["changed"] == full["removed"] == 0 and full["unchanged"] == doc["entries"]
    graphs = [e["key"] for e in fx]
    cli("pin", graphs[0], "--reason", "kept")
    assert [p["key"] for p in cli.json("pin")] == [graphs[0]]
    assert cli.json("diff", graphs[0], graphs[-1])
    cli.json("explain", "--since", "1d")
    cli.json("check")
    cli.json("shapes")
    plan = cli.json("evict", "--max-size", "0", "--grace", "0", "--dry-run")
    assert plan["entries"] and graphs[0] not in {e["key"] for e in plan["entries"]}
    gone = cli.json("purge", "--graph", graphs[-1], "--grace", "0", "--yes")
    assert gone["evicted"] > 0
    done = cli.json("evict", "--max-size", "0", "--grace", "0")
    assert done["evicted"] > 0
    cli("unpin", graphs[0])
    cli.json("evict", "--max-size", "0", "--grace", "0")
    left = cli.json("ls")
    assert {e["kind"] for e in left} == {"lock"}  # (Inductor's lock files are never evicted)
    assert sum(e["bytes"] for e in left) == find_bytes(cpu_cache)
    after = cli.json("scan", "--full")
    assert after["added"] == after["changed"] == after["removed"] == 0


CONCURRENT = """
import sys, time
start = float(sys.argv[1])
from cachemgr.cli import main
time.sleep(max(0.0, start - time.time()))  # imports done: every process starts its command at once
main(sys.argv[2:])
"""


def run_at_once(clis: list[Cli], *args: str) -> list[subprocess.CompletedProcess]:
    start = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT, str(start), *c.base(), *args],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for c in clis
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def grow(root: Path, n: int, tag: str) -> None:
    """n more real-looking entries: autotune results and generated modules under new keys."""
    for i in range(n):
        h = uuid.uuid5(uuid.NAMESPACE_OID, f"{tag}-{i}").hex
        d = root / h[:2]
        d.mkdir(exist_ok=True)
        (d / f"{h}{h[:32]}.best_config").write_text(json.dumps({"XBLOCK": 64, "num_warps": 4, "i": i}))
        (d / f"c{h}{h[:8]}.py").write_text(f"# generated module {tag} {i}\n" * (i % 7 + 1))


def test_two_hosts_index_concurrently(gpu_cache, cpu_cache, pg_url):
    grow(gpu_cache, 1500, "a")
    grow(cpu_cache, 1500, "b")
    a, b = Cli(gpu_cache, pg_url, host="host-a"), Cli(cpu_cache, pg_url, host="host-b")
    # a fresh database: both processes migrate it and create their cache rows at the same moment
    for r in run_at_once([a, b], "scan", "--json"):
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["added"] > 3000
    # then both trees change and both hosts reconcile at once again
    for root in (gpu_cache, cpu_cache):
        for p in list(root.glob("??/*.best_config"))[:200]:
            p.unlink()
    grow(gpu_cache, 300, "a2")
    grow(cpu_cache, 300, "b2")
    for r in run_at_once([a, b], "scan", "--json"):
        doc = json.loads(r.stdout)
        assert r.returncode == 0 and doc["removed"] == 200 and doc["added"] == 600, r.stderr
    fleet = a.json("stats", "--fleet")
    assert fleet["hosts"] == ["host-a", "host-b"]
    per_host = {c["host"]: c for c in fleet["caches"]}
    for cli, root in ((a, gpu_cache), (b, cpu_cache)):
        files = [p for p in root.rglob("*") if p.is_file()]
        assert per_host[cli.host]["bytes"] == find_bytes(root)
        assert per_host[cli.host]["files"] == len(files)
    assert fleet["bytes"] == find_bytes(gpu_cache) + find_bytes(cpu_cache)
    assert fleet["files"] == sum(c["files"] for c in fleet["caches"])
    # no lost or doubled rows: the database holds exactly each host's entries once
    rows = dict(
        pg_query(pg_url, "SELECT c.host, count(*) FROM entries e JOIN caches c ON c.id = e.cache_id GROUP BY c.host")
    )
    assert rows == {"host-a": per_host["host-a"]["entries"], "host-b": per_host["host-b"]["entries"]}
    assert pg_query(pg_url, "SELECT count(*) FROM caches") == [(2,)]
    # ls --host shows one host's entries, from any host
    on_b = b.json("ls", "--host", "host-a", "--kind", "fxgraph")
    assert on_b and all(e["host"] == "host-a" and e["device_types"] == "cuda" for e in on_b)
    assert {e["key"] for e in a.json("ls", "--host", "host-b")} == {e["key"] for e in b.json("ls")}


def test_one_host_many_connections_share_its_cache_row(pg_url):
    """The daemon and CLIs of one host starting at once: one cache row each, no unique-key error.
    (Without the retry in Database.cache_id this fails in most rounds.)"""
    import threading

    from cachemgr.index.db import Database

    Database(pg_url).close()
    errors, ids = [], {}
    for rnd in range(10):
        dbs = [Database(pg_url) for _ in range(6)]
        barrier = threading.Barrier(len(dbs))

        def claim(db, rnd=rnd, barrier=barrier):
            barrier.wait()
            try:
                ids.setdefault(rnd, set()).add(db.cache_id("same", f"/cache/{rnd}"))
            except Exception as e:  # noqa: BLE001 - collected, asserted below
                errors.append(repr(e)[:200])

        threads = [threading.Thread(target=claim, args=(db,)) for db in dbs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for db in dbs:
            db.close()
    assert errors == []
    assert all(len(v) == 1 for v in ids.values()) and len(ids) == 10
    assert pg_query(pg_url, "SELECT count(*) FROM caches") == [(10,)]


def test_ls_host_unknown(cpu_cache, pg_url):
    r = Cli(cpu_cache, pg_url).proc("ls", "--host", "nope")
    assert (
        r.returncode == 3
        and r.stderr.strip() == "cachemgr: error: no host 'nope' in the index (see: cachemgr stats --fleet)"
    )


def test_fleet_report(gpu_cache, cpu_cache, pg_url, tmp_path):
    # host-old upgraded torch: the 2.11 GPU entries it still holds, and newer 2.13 entries
    upgraded = tmp_path / "upgraded"
    shutil.copytree(gpu_cache, upgraded, symlinks=True)
    shutil.copytree(cpu_cache, upgraded, symlinks=True, dirs_exist_ok=True)
    twin = tmp_path / "twin"
    shutil.copytree(cpu_cache, twin, symlinks=True)
    hosts = {"host-up": upgraded, "host-cpu": cpu_cache, "host-twin": twin}
    for host, root in hosts.items():
        Cli(root, pg_url, host=host)("scan")
    pg_query(
        pg_url,
        "UPDATE entries SET hit_count = 3 WHERE kind = 'fxgraph' AND cache_id = "
        "(SELECT id FROM caches WHERE host = 'host-cpu')",
    )
    cli = Cli(cpu_cache, pg_url, host="host-cpu")
    rep = cli.json("fleet", "report")
    by_host = {h["host"]: h for h in rep["hosts"]}
    assert set(by_host) == set(hosts)
    for host, root in hosts.items():
        assert by_host[host]["bytes"] == find_bytes(root)
    n_fx = len(cli.json("ls", "--kind", "fxgraph"))
    assert by_host["host-cpu"]["hit_count"] == 3 * n_fx and by_host["host-twin"]["hit_count"] == 0
    cpu_version = cli.json("ls", "--kind", "fxgraph")[0]["torch_version"]
    assert {h["torch_version"] for h in rep["hosts"]} == {cpu_version}
    assert rep["versions_in_use"] == [cpu_version]
    # every CPU graph is on three hosts; the GPU graphs are on one host only
    shared = {g["graph_key"]: g for g in rep["shared_graphs"]}
    cpu_graphs = {e["graph_key"] for e in cli.json("ls", "--kind", "fxgraph")}
    assert set(shared) == cpu_graphs and all(g["hosts"] == 3 for g in shared.values())
    assert all(g["redundant_bytes"] * 3 == g["bytes"] * 2 for g in shared.values())
    # what the 2.11 entries hold is stale: their graphs, AOT entries, and the kernels and modules
    # those graphs name (checked here through `show` on a GPU-only index, not the report's SQL)
    gpu_only = Cli(gpu_cache, f"sqlite:///{tmp_path / 'gpu.db'}")
    gpu_only("scan")
    expected = 0
    for e in gpu_only.json("ls"):
        if e["kind"] in ("fxgraph", "aotautograd"):
            expected += e["bytes"]
        elif e["kind"] in ("triton", "code") and any(
            k.startswith("fxgraph/") for k in gpu_only.json("show", e["key"])["referenced_by"]
        ):
            expected += e["bytes"]
    old = next(v for v in rep["torch_versions"] if v["torch_version"] != cpu_version)
    assert old["torch_version"].startswith("2.11") and not old["in_use"] and old["hosts"] == 1
    assert old["fxgraph_bytes"] == gpu_only.json("stats")["by_kind"]["fxgraph"]["bytes"]
    assert rep["stale_bytes"] == old["bytes"] == expected
    # a version named in keep_torch is not stale
    kept = Cli(cpu_cache, pg_url, host="host-cpu").proc(
        "fleet", "report", "--json", env={"CACHEMGR_KEEP_TORCH": old["torch_version"]}
    )
    assert kept.returncode == 0 and json.loads(kept.stdout)["stale_bytes"] == 0, kept.stderr
    out = cli("fleet", "report").stdout
    assert "host-up" in out and "graphs on 2+ hosts" in out and "held by versions no host runs" in out


@pytest.mark.parametrize(
    "url,message",
    [
        (
            "postgresql+psycopg://root@127.0.0.1:1/test",
            "cannot open the index postgresql+psycopg://root@127.0.0.1:1/test",
        ),
        (
            "postgresql+psycopg://nobody:secret@127.0.0.1:5432/test",
            "cannot open the index postgresql+psycopg://nobody:***@",
        ),
    ],
)
@pytest.mark.parametrize("args", [["stats", "--fleet"], ["fleet", "report"], ["ls", "--host", "x"]])
def test_postgres_unreachable_is_one_line(cpu_cache, url, message, args):
    r = Cli(cpu_cache, url).proc(*args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 5 and len(lines) == 1 and lines[0].startswith(f"cachemgr: error: {message}"), r.stderr
    assert "secret" not in r.stderr


def test_a_component_set_made_by_another_host_meanwhile_is_taken(gpu_cache, pg_url):
    """Hosts of a fleet index share component sets by digest. A host whose scan meets a set that
    another host's transaction is inserting right then waits for that transaction, then takes
    its row: the scan neither fails on the unique digest nor stores the set twice."""
    import psycopg

    probe = Cli(gpu_cache, pg_url, host="probe")
    probe.json("scan")
    digest, part = pg_query(pg_url, "SELECT digest, part FROM component_sets ORDER BY digest LIMIT 1")[0]
    for table in ("caches", "component_sets", "parsed_content"):  # as new, migrated
        pg_query(pg_url, f"DELETE FROM {table}")
    other = psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))  # the other host
    try:
        (set_id,) = other.execute(
            "INSERT INTO component_sets (digest, part) VALUES (%s, %s) RETURNING id", (digest, part)
        ).fetchone()
        cli = Cli(gpu_cache, pg_url, host="h")
        scan = subprocess.Popen(
            [sys.executable, "-m", "cachemgr", *cli.base(), "scan", "--json"],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        deadline = time.monotonic() + 120
        while pg_query(pg_url, waiting) != [(1,)]:  # the scan waits on the other host's insert
            assert scan.poll() is None and time.monotonic() < deadline, scan.communicate()
            time.sleep(0.05)
        other.commit()
        out, err = scan.communicate(timeout=120)
    finally:
        other.close()
    assert scan.returncode == 0, err
    assert json.loads(out)["pending"] == 0
    assert pg_query(pg_url, "SELECT id FROM component_sets WHERE digest = %s", digest) == [(set_id,)]
    linked = "SELECT count(*) FROM entry_component_sets WHERE set_id = %s"
    assert pg_query(pg_url, linked, set_id)[0][0] > 0


# -- the fleet report over odd rows of other hosts -------------------------------------------------
#
# Hosts share one index, so a host's report reads what every other host (or a hand edit) wrote.
# A number no real cache has reads as unknown for its row only.

ODD_TIMES = {"postgresql": ("'NaN'", "'-Infinity'", "1e300"), "sqlite": ("'x'", "-1", "1e300")}
NAN = {"postgresql": "'NaN'", "sqlite": "'x'"}  # SQLite stores NaN as NULL, and keeps text as text


@pytest.fixture(params=["postgresql", "sqlite"])
def two_hosts(request, fixture_cache, tmp_path):
    """(index url, dialect, host-a's cache, host-b's cache): two copies of one real cache in one index."""
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else request.getfixturevalue("db_url")
    a = fixture_cache("torch-2.13.0-cpu")
    b = tmp_path / "host-b"
    shutil.copytree(a, b, symlinks=True)
    for host, root in (("host-a", a), ("host-b", b)):
        Cli(root, url, host=host)("scan")
    return url, request.param, a, b


def edit(url: str, sql: str) -> list[tuple]:
    """One statement on the index, as another host or a hand edit would run it."""
    if url.startswith("sqlite:///"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            with conn:
                return conn.execute(sql).fetchall()
        finally:
            conn.close()
    return pg_query(url, sql)


def strict_json(text: str):
    """JSON as any parser reads it: NaN and Infinity are no JSON."""

    def refuse(name):
        raise AssertionError(f"{name} in the JSON")

    return json.loads(text, parse_constant=refuse)


HOST_B = "SELECT id FROM caches WHERE host = 'host-b'"


def test_stats_reads_file_counts_and_idle_sizes_no_cache_has_as_unknown(two_hosts, monkeypatch):
    """Two rows edited to 2**31 - 1 files, two more to 2**63 - 1 bytes, all idle for years: SQLite's
    integer SUM of the file counts, and of the idle entries' files and bytes (the max_age line),
    went past int64 and stopped `stats` (exit 5); PostgreSQL added them up into billions of
    files. Each such value reads as unknown (0), as sizes already did."""
    url, _, a, b = two_hosts
    cli = Cli(a, url, host="host-a")
    monkeypatch.setenv("CACHEMGR_MAX_AGE", "1d")
    mine = "(SELECT id FROM caches WHERE host = 'host-a')"
    code = edit(url, f"SELECT id, files, bytes FROM entries WHERE cache_id = {mine} AND kind = 'code' ORDER BY id")
    (one, f1, _), (two, f2, _), (three, f3, b3), (four, f4, b4), *_ = code
    edit(url, f"UPDATE entries SET last_access = 1000 WHERE cache_id = {mine}")  # every entry idle for years
    was = cli.json("stats")
    edit(url, f"UPDATE entries SET files = {(1 << 31) - 1} WHERE id IN ({one}, {two})")  # (PostgreSQL's largest)
    edit(url, f"UPDATE entries SET bytes = {(1 << 63) - 1}, files = -3 WHERE id IN ({three}, {four})")
    now = cli.json("stats")
    unknown = f1 + f2 + f3 + f4
    assert now["files"] == now["limits"]["max_files"]["used"] == was["files"] - unknown
    idle = now["limits"]["max_age"]
    assert idle["idle_entries"] == was["limits"]["max_age"]["idle_entries"]
    assert idle["idle_bytes"] == was["limits"]["max_age"]["idle_bytes"] - b3 - b4
    fleet = cli.json("stats", "--fleet")
    assert fleet["files"] == was["files"] - unknown + Cli(b, url, host="host-b").json("stats")["files"]


def test_fleet_stats_reads_odd_values_of_another_host_as_unknown(two_hosts):
    url, dialect, a, b = two_hosts
    cli = Cli(a, url, host="host-a")
    before = strict_json(cli("stats", "--fleet", "--json").stdout)
    # one entry of host-b with an mtime no clock shows: `stats --fleet` once failed (exit 70); one of
    # a size past int64's sum: the kind's sum failed on SQLite (exit 5) and read 0 on PostgreSQL
    edit(url, f"UPDATE entries SET mtime = 1e308 WHERE id = (SELECT MIN(id) FROM entries WHERE cache_id = ({HOST_B}))")
    last = f"(SELECT MAX(id) FROM entries WHERE cache_id = ({HOST_B}))"
    edit(url, f"UPDATE entries SET bytes = {(1 << 63) - 1} WHERE id = {last}")
    for odd in ODD_TIMES[dialect]:
        edit(url, f"UPDATE caches SET last_scan = {odd} WHERE host = 'host-b'")
        doc = strict_json(cli("stats", "--fleet", "--json").stdout)
        by_host = {c["host"]: c for c in doc["caches"]}
        assert by_host["host-b"]["last_scan_ts"] is None and by_host["host-a"]["last_scan_ts"] > 0, odd
        assert (doc["oldest"], doc["newest"]) == (before["oldest"], before["newest"])
        assert 0 < doc["bytes"] < before["bytes"]  # (that entry's size is unknown)
        assert "host-b" in cli("stats", "--fleet").stdout
        hosts = {h["host"]: h for h in strict_json(cli("fleet", "report", "--json").stdout)["hosts"]}
        assert hosts["host-b"]["last_scan_ts"] is None and hosts["host-b"]["last_scan"] is None, odd
        assert hosts["host-a"]["last_scan_ts"] == by_host["host-a"]["last_scan_ts"]


def test_fleet_report_reads_absurd_numbers_of_one_row_as_unknown(two_hosts):
    url, dialect, a, b = two_hosts
    cli = Cli(a, url, host="host-a")
    before = strict_json(cli("fleet", "report", "--json").stdout)
    # one fxgraph entry of host-b, and one kernel or module an fxgraph entry of host-b names
    (fx, graph, fx_bytes), *_ = edit(
        url,
        f"SELECT id, graph_key, bytes FROM entries WHERE cache_id = ({HOST_B}) AND kind = 'fxgraph' ORDER BY id",
    )
    (dep, dep_bytes), *_ = edit(
        url,
        "SELECT d.id, d.bytes FROM entries v JOIN entry_refs r ON r.entry_id = v.id JOIN entries d "
        f"ON d.cache_id = v.cache_id AND d.ref = r.ref AND d.kind = r.kind WHERE v.cache_id = ({HOST_B}) "
        "AND v.torch_version IS NOT NULL ORDER BY d.id",
    )
    big = (1 << 63) - 1  # the SQL sums once went past int64 and read as 0
    edit(url, f"UPDATE entries SET bytes = {big}, compile_seconds = 1e308 WHERE id = {fx}")
    edit(url, f"UPDATE entries SET bytes = {big} WHERE id = {dep}")
    # an fxgraph entry of no known mtime is not the one that tells host-b's torch version
    edit(
        url,
        "INSERT INTO entries (cache_id, key, kind, ref, bytes, files, mtime, first_seen, last_access, hit_count, "
        f"graph_key, torch_version, dir, parse_state) SELECT id, 'fxgraph/zz/edited/x', 'fxgraph', 'edited', 0, 1, "
        f"{NAN[dialect]}, 1, 1, 0, 'edited', '0.0.1-edited', '', 0 FROM caches WHERE host = 'host-b'",
    )
    # a hit at no known time is in no window; a real one still counts
    hit = "INSERT INTO events (cache_id, ts, kind, entry_kind, recompile) SELECT id, {}, 'hit', 'fxgraph', FALSE"
    edit(url, hit.format(NAN[dialect]) + " FROM caches")
    edit(url, hit.format(time.time()) + " FROM caches WHERE host = 'host-a'")
    rep = strict_json(cli("fleet", "report", "--window", "1h", "--json").stdout)

    was = {h["host"]: h for h in before["hosts"]}
    hosts = {h["host"]: h for h in rep["hosts"]}
    assert hosts["host-b"]["bytes"] == was["host-b"]["bytes"] - fx_bytes - dep_bytes > 0
    assert (hosts["host-b"]["unknown_sizes"], hosts["host-a"]["unknown_sizes"]) == (2, 0)
    assert hosts["host-a"]["bytes"] == was["host-a"]["bytes"] == find_bytes(a)
    assert (hosts["host-a"]["hits_in_window"], hosts["host-b"]["hits_in_window"]) == (1, 0)
    assert hosts["host-b"]["torch_version"] == was["host-b"]["torch_version"]

    was_graphs = {g["graph_key"]: g for g in before["shared_graphs"]}
    graphs = {g["graph_key"]: g for g in rep["shared_graphs"]}
    assert graphs[graph]["bytes"] == was_graphs[graph]["bytes"] - fx_bytes  # host-a's bytes are kept
    assert graphs[graph]["redundant_bytes"] == 0 and graphs[graph]["hosts"] == 2
    assert graphs[graph]["compile_seconds"] == was_graphs[graph]["compile_seconds"]  # host-a's
    assert all(g == was_graphs[k] for k, g in graphs.items() if k != graph)

    ((was_v,), versions) = before["torch_versions"], {v["torch_version"]: v for v in rep["torch_versions"]}
    assert rep["versions_in_use"] == [was_v["torch_version"]] and not versions["0.0.1-edited"]["in_use"]
    v = versions[was_v["torch_version"]]
    assert v["fxgraph_bytes"] == was_v["fxgraph_bytes"] - fx_bytes
    assert v["dependent_bytes"] == was_v["dependent_bytes"] - dep_bytes
    assert v["bytes"] == was_v["bytes"] - fx_bytes - dep_bytes and rep["stale_bytes"] == 0

    out = cli("fleet", "report").stdout
    assert "e+" not in out and max(len(line) for line in out.splitlines()) < 160, out
    if dialect == "sqlite":  # the stdlib sqlite3 driver reads the same report
        from cachemgr.fleet.report import fleet_report
        from cachemgr.index.db import Database
        from cachemgr.index.revision import HEAD_REVISION
        from cachemgr.index.store import Store

        db = Database(url)
        quick = Store.sqlite(url.removeprefix("sqlite:///"), HEAD_REVISION, "host-a", str(a))
        assert quick is not None
        try:
            assert (
                fleet_report(quick, window=3600).as_dict()
                == rep
                == fleet_report(Store.of(db, "host-a", str(a)), window=3600).as_dict()
            )
        finally:
            quick.close()
            db.close()


def test_fleet_stats_sums_known_compile_seconds(two_hosts):
    url, dialect, a, b = two_hosts
    for host, seconds in (("host-a", 2.5), ("host-b", 1e308)):  # a compile of 1e308 s is an edited row
        edit(
            url,
            "INSERT INTO events (cache_id, ts, kind, entry_kind, entry_key, seconds, recompile) SELECT id, "
            f"{time.time()}, 'new', 'fxgraph', 'fxgraph/zz/gone', {seconds}, FALSE FROM caches WHERE host = '{host}'",
        )
    doc = strict_json(Cli(a, url, host="host-a")("stats", "--fleet", "--json").stdout)
    assert doc["activity"]["compiles"] == 2 and doc["activity"]["compile_seconds"] == 2.5


def test_views_of_the_whole_index_make_no_row_for_this_host(cpu_cache, pg_url, tmp_path):
    """`fleet report`, `stats --fleet` and `ls --host` read every cache of the index: run from a
    host that never scanned, each made it a cache row, and the report then listed that host
    (with 0 entries) among those that hold a cache."""
    import psycopg

    Cli(cpu_cache, pg_url, host="gpu-a")("scan")
    viewer = Cli(tmp_path / "never-scanned", pg_url, host="laptop")
    for args in (("fleet", "report", "--json"), ("stats", "--fleet", "--json"), ("ls", "--host", "gpu-a", "--json")):
        viewer(*args)
    report = viewer.json("fleet", "report")
    assert [h["host"] for h in report["hosts"]] == ["gpu-a"], report["hosts"]
    with psycopg.connect(pg_url.replace("postgresql+psycopg", "postgresql")) as conn:
        assert conn.execute("SELECT host FROM caches").fetchall() == [("gpu-a",)]
