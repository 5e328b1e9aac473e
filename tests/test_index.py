"""The index on real caches: a CPU cache compiled in this session and the shared H200 fixture."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import NO_TORCH_PROGRAM, REPO, Cli, run_program, subprocess_env

from cachemgr import layout
from cachemgr.vocab import READER


def disk_counts(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return len(files), sum(p.stat().st_size for p in files)


def find_bytes(root: Path) -> int:
    out = subprocess.run(
        ["find", str(root), "-type", "f", "-printf", "%s\\n"], capture_output=True, text=True, check=True
    )
    return sum(int(x) for x in out.stdout.split())


@pytest.mark.parametrize("which", ["cpu_cache", "gpu_cache"])
def test_scan_counts_match_disk(which, request, cli_for):
    root = request.getfixturevalue(which)
    cli = cli_for(root)
    res = cli.json("scan")
    assert res["added"] > 0 and res["removed"] == 0 and res["corrupt"] == []
    stats = cli.json("stats")
    n_files, n_bytes = disk_counts(root)
    assert stats["files"] == n_files
    assert stats["bytes"] == n_bytes == find_bytes(root)
    assert stats["corrupt"] == 0

    # per kind: the files the layout assigns to each kind, counted independently on disk
    per_kind: Counter = Counter()
    per_kind_bytes: Counter = Counter()
    for p in root.rglob("*"):
        if p.is_file():
            c = layout.classify(p.relative_to(root).as_posix())
            assert c is not None
            per_kind[c.kind] += 1
            per_kind_bytes[c.kind] += p.stat().st_size
    for kind, row in stats["by_kind"].items():
        assert row["files"] == per_kind[kind], kind
        assert row["bytes"] == per_kind_bytes[kind], kind
    fx_files = list(root.glob("fxgraph/*/*/*"))
    assert stats["by_kind"]["fxgraph"]["entries"] == len(fx_files) > 0
    assert stats["by_kind"]["aotautograd"]["entries"] == len(list(root.glob("aotautograd/*/*"))) > 0
    if which == "gpu_cache":
        kernels = list(root.glob("triton/*/*"))
        assert stats["by_kind"]["triton"]["entries"] == len(kernels) > 100
        assert stats["by_kind"]["autotune"]["entries"] == len(list(root.glob("*/*.best_config"))) > 0
    else:
        assert stats["by_kind"]["code"]["files"] == len(list(root.glob("??/c*.*")))
        assert stats["by_kind"]["lock"]["entries"] == len(list(root.glob("locks/*.lock"))) > 0

    for e in cli.json("ls", "--kind", "fxgraph"):
        assert e["graph_key"] and e["graph_key"].startswith("f") and len(e["graph_key"]) == 52
        assert e["signature"] and e["signature_hash"] and e["options_hash"]
        assert e["compile_seconds"] > 0
        assert e["torch_version"] == ("2.11.0+cu130" if which == "gpu_cache" else __import__("torch").__version__)
        assert e["path"] == e["key"] and (root / e["key"]).is_file()
        assert e["key"].split("/")[2] == e["graph_key"]


def test_cpu_cache_content(cpu_cache, cli_for):
    cli = cli_for(cpu_cache)
    cli("scan")
    fx = cli.json("ls", "--kind", "fxgraph")
    sigs = {e["signature"] for e in fx}
    # the dynamic-batch training graphs carry a symbolic batch dim, renumbered from s0
    assert any("f32[s0, 32](32, 1)cpu" in s for s in sigs), sigs
    assert any(s == "f32[10](1)cpu" for s in sigs), sigs  # the inference function
    assert {e["device_types"] for e in fx} == {"cpu"}
    assert any(e["guards"] and "L['t0']" in e["guards"] for e in fx)
    # custom options= give another options hash than the default-option graphs
    assert len({e["options_hash"] for e in fx}) >= 2
    for e in fx:
        shown = cli.json("show", e["key"])
        needs = {(r["kind"], r["ref"]): r["present"] for r in shown["references"]}
        assert ("code", next(iter(x for k, x in needs if k == "code"))) in needs
        assert all(needs.values()), needs
        assert any(ref.startswith("src-") for kind, ref in needs), "C++ kernel builds are tied to their graph"
        assert shown["files_on_disk"] == [{"path": e["key"], "bytes": e["bytes"]}]
        assert shown["referenced_by"], "every fxgraph entry here is named by an aotautograd entry"


def test_gpu_fixture_links(gpu_cache, cli_for):
    cli = cli_for(gpu_cache)
    cli("scan")
    for e in cli.json("ls", "--kind", "fxgraph"):
        shown = cli.json("show", e["key"])
        kernels = [r for r in shown["references"] if r["kind"] == "triton"]
        assert kernels and all(r["present"] for r in kernels)
        assert e["device_types"] == "cuda" and "cuda:0" in e["signature"]
    tuned = cli.json("ls", "--kind", "autotune")
    shown = cli.json("show", tuned[0]["key"])
    assert [r["kind"] for r in shown["references"]] == ["triton"] and shown["references"][0]["present"]


def age_dirs(root: Path, seconds: float = 3600) -> None:
    """Set every directory's mtime back: a scan then trusts them (a just-moved mtime is read again)."""
    t = time.time() - seconds
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        os.utime(d, (t, t))


# Scan in a fresh process and report whether SQLAlchemy was imported on the way.
SCAN_PROGRAM = """
import json, sys
from cachemgr.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print(json.dumps({"sqlalchemy": "sqlalchemy" in sys.modules}))
"""


def scan_in_a_fresh_process(cli: Cli) -> tuple[int, bool]:
    """`scan` in a new process: (entries it found unchanged, whether it imported SQLAlchemy)."""
    out = subprocess.run(
        [sys.executable, "-c", SCAN_PROGRAM, *cli.base(), "scan", "--json"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    *scanned, probe = out.stdout.strip().splitlines()
    return json.loads("\n".join(scanned))["unchanged"], json.loads(probe)["sqlalchemy"]


def test_parallel_parse_matches_serial(gpu_cache, tmp_path, monkeypatch):
    """Several parse workers describe every entry as one worker does."""
    from cachemgr.index import describe
    from cachemgr.index.workers import Pool

    entries = [e for e in layout.walk(str(gpu_cache)) if e.kind != "lock"]
    with Pool(1) as one:
        serial = describe.describe_all(str(gpu_cache), entries, pool=one)
    ticks = []
    with Pool(2) as two:
        parallel = describe.describe_all(str(gpu_cache), entries, lambda done, total: ticks.append((done, total)), two)
    assert ticks[-1] == (len(entries), len(entries))
    assert parallel.keys() == serial.keys()
    for key, d in serial.items():
        p = parallel[key]
        assert (p.row, p.refs) == (d.row, d.refs), key
        assert {part: digest for part, (digest, _) in p.parts.items()} == {
            part: digest for part, (digest, _) in d.parts.items()
        }, key
    assert sum(e.kind == "fxgraph" for e in entries) == 6


def _index_of(db_file: Path) -> dict:
    """What an index holds, in a form two scans of one tree can be compared by."""
    conn = sqlite3.connect(db_file)
    try:
        return {
            "entries": sorted(
                conn.execute(
                    "SELECT key, kind, ref, alias, dir, bytes, files, mtime, graph_key, signature, signature_hash, "
                    "options_hash, guards, device_types, compile_seconds, torch_version, torch_version_hash, "
                    "system_hash, corrupt, unrecorded, parse_state, content FROM entries"
                )
            ),
            "refs": sorted(
                conn.execute("SELECT e.key, r.kind, r.ref FROM entry_refs r JOIN entries e ON e.id = r.entry_id")
            ),
            "sets": sorted(
                conn.execute(
                    "SELECT e.key, s.part, c.digest FROM entry_component_sets s "
                    "JOIN entries e ON e.id = s.entry_id JOIN component_sets c ON c.id = s.set_id"
                )
            ),
            "dirs": sorted(p for (p,) in conn.execute("SELECT path FROM dirs")),
            "set_items": sorted(
                conn.execute(
                    "SELECT c.digest, c.part, i.name, i.hash, i.value FROM component_set_items i "
                    "JOIN component_sets c ON c.id = i.set_id"
                )
            ),
            "events": sorted(
                conn.execute("SELECT ts, kind, entry_kind, entry_key, graph_key, recompile, bytes, seconds FROM events")
            ),
            "kept": sorted(
                (name, size, kind, *map(json.loads, (row, refs, parts)), reader)
                for name, size, kind, row, refs, parts, reader in conn.execute(
                    'SELECT name, bytes, kind, "row", refs, parts, reader FROM parsed_content'
                )
            ),
        }
    finally:
        conn.close()


FIRST_SCAN_WITHOUT_SQLALCHEMY = """
import json, sys
from cachemgr.index import fill, schema
from cachemgr.index.describe import prepare_unseen_reads
from cachemgr.index.workers import Pool
path, root, phases = sys.argv[1:]
with Pool(2) as pool:
    if phases == "both":
        r = fill.first_scan(path, "h", root, pool, create_folder=False)
    else:  # phase one only
        prepare_unseen_reads(root)
        conn = schema.open_at_head(path, False)
        conn.execute("INSERT INTO caches (host, root) VALUES ('h', ?)", (root,))
        r = fill.first_fill(conn, 1, root, pool)
        conn.close()
assert "sqlalchemy" not in sys.modules, "sqlalchemy was imported"
print(json.dumps(None if r is None else r.as_dict()))
"""


def test_a_first_scan_of_the_embedded_index_runs_without_sqlalchemy(gpu_cache, tmp_path):
    """`cachemgr scan` into a new SQLite index runs on stdlib sqlite3 (fill.first_scan): phase one
    (the schema made from head_ddl, every entry and directory written, last_scan set), then
    phase two over the same connection. Autotune results (JSON, not pickles) are read beside its
    walk, but one larger than any real one is left to phase two's workers. The index it makes is
    the one a scan through SQLAlchemy makes, whether as a first fill then phase two under the
    engine, or a row-by-row sync (an index that holds another cache), odd autotune files and
    all: entries, references, component sets, events and the parse results kept by content."""
    from cachemgr.index import scan
    from cachemgr.index.db import Database
    from cachemgr.index.describe import READ_WITH_WALK_BYTES
    from cachemgr.index.workers import Pool

    folder = next(gpu_cache.glob("*/*.best_config")).parent
    big = {"triton_cache_hash": "BIGHASH", "pad": "x" * READ_WITH_WALK_BYTES}
    (folder / "big.best_config").write_text(json.dumps(big))
    (folder / "bad.best_config").write_text("{not json")
    path = tmp_path / "phase-one.db"

    def first_scan(phases: str = "one", at: Path = path) -> dict | None:
        out = subprocess.run(
            [sys.executable, "-c", FIRST_SCAN_WITHOUT_SQLALCHEMY, str(at), str(gpu_cache), phases],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def state() -> list:
        with sqlite3.connect(path) as conn:
            return conn.execute("SELECT last_scan, reader, (SELECT COUNT(*) FROM entries) FROM caches").fetchall()

    r = first_scan()
    assert r is not None and r["added"] == 264 and 0 < r["pending"] < 264
    assert r["parsed"] > 0 and r["pending"] + r["parsed"] < 264  # autotune results read with the walk
    made = state()
    assert made[0][0] is not None and made[0][1:] == (READER, 264)
    with sqlite3.connect(path) as conn:
        pending = dict(conn.execute("SELECT kind, COUNT(*) FROM entries WHERE parse_state <> 0 GROUP BY kind"))
        assert sum(pending.values()) == r["pending"] and pending["autotune"] == 1  # big.best_config
        assert conn.execute("SELECT COUNT(*) FROM entry_refs").fetchone()[0] > 0  # the other results' kernels
    assert first_scan("both") is None and state() == made  # no first fill now: nothing written
    both = first_scan("both", tmp_path / "stdlib.db")
    assert both is not None and both["added"] == 264 and both["pending"] == 0
    assert both["parsed"] == r["parsed"] + r["pending"]

    def parsed(name: str, other_cache_first: bool = False) -> dict:
        db = Database(f"sqlite:///{tmp_path / name}")
        if other_cache_first:  # entries of another cache: this scan is no first fill
            scan.reconcile(db, db.cache_id("other", str(gpu_cache)), str(gpu_cache), parse_now=False)
        cid = db.cache_id("h", str(gpu_cache))
        with Pool(2) as pool:
            if name == "phase-one.db":  # phase two under SQLAlchemy's engine
                scan.parse_pending(db, cid, str(gpu_cache), pool=pool)
            else:
                assert scan.reconcile(db, cid, str(gpu_cache), pool=pool).added == 264
        if other_cache_first:
            with db.engine.begin() as conn:
                conn.execute(scan.delete(scan.CACHES).where(scan.CACHES.c.host == "other"))
        db.close()
        return _index_of(tmp_path / name)

    stdlib = _index_of(tmp_path / "stdlib.db")
    assert all(stdlib[part] for part in ("entries", "refs", "sets", "dirs", "set_items", "events", "kept"))
    assert all(e[-2] == 0 for e in stdlib["entries"])  # every one parsed
    assert stdlib == parsed("phase-one.db")
    assert stdlib == parsed("sqlalchemy.db")
    assert stdlib == parsed("synced.db", other_cache_first=True)


def test_a_first_scan_takes_odd_index_urls_and_indexes_as_they_are(gpu_cache, tmp_path):
    """The stdlib first fill reads the index URL as SQLAlchemy does, or leaves it to SQLAlchemy:
    `x.db?timeout=60` is x.db, never a file of that literal name beside it. An index someone gave
    an index of their own (a quoted name; one that cannot be rebuilt over a first scan's rows)
    is scanned, or refused with one line and exit 5, never exit 70, and kept as it was."""
    from cachemgr.index.db import Database

    (tmp_path / "q").mkdir()
    cli = Cli(gpu_cache, f"sqlite:///{tmp_path / 'q' / 'x.db'}?timeout=60")
    r = cli.json("scan")
    assert r["added"] == 262 and r["pending"] == 0
    assert sorted(p.name for p in (tmp_path / "q").iterdir() if "?" in p.name) == []
    stats = cli.json("stats")
    assert stats["entries"] == 262 and stats["not_parsed"] == 0

    def index_with(sql: str, name: str) -> str:
        url = f"sqlite:///{tmp_path / name}"
        Database(url).close()
        with sqlite3.connect(tmp_path / name) as conn:
            conn.execute(sql)
        return url

    quoted = index_with('CREATE INDEX "my""idx" ON entries (kind)', "quoted.db")
    assert Cli(gpu_cache, quoted).json("scan")["added"] == 262
    with sqlite3.connect(tmp_path / "quoted.db") as conn:
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'my\"idx'").fetchone() == (1,)
    unique = index_with("CREATE UNIQUE INDEX one_per_kind ON entries (kind)", "unique.db")
    out = Cli(gpu_cache, unique).proc("scan")
    assert out.returncode == 5, out.stderr
    assert (
        out.stderr.startswith("cachemgr: error: index database: UNIQUE constraint failed")
        and out.stderr.count("\n") == 1
    )
    with sqlite3.connect(tmp_path / "unique.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM entries").fetchone() == (0,)
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'one_per_kind'").fetchone() == (1,)


def test_walk_and_parse_in_workers_match_one_process(gpu_cache, tmp_path, monkeypatch):
    """A first scan whose walk and reads are shared with worker processes (walk units handed out
    and taken back in order, content read once) indexes exactly what one process indexes. The
    workers start once, for the walk and the reads after it (each stream's own ended with it)."""
    from cachemgr.index import fill, scan, workers
    from cachemgr.index.db import Database
    from cachemgr.index.workers import Pool

    booting = workers._Worker.__init__
    monkeypatch.setattr(fill, "PARALLEL_WALK", 1)  # the fixture's 137 kernel directories: share them out
    monkeypatch.setattr(fill, "WALK_JOB", (1, 3))

    def index(name: str, pool: Pool | None) -> dict:
        db = Database(f"sqlite:///{tmp_path / name}")
        cid = db.cache_id("h", str(gpu_cache))
        r = scan.index_names(db, cid, str(gpu_cache), pool=pool)
        assert r.added > 0 and r.pending > 0
        p = scan.parse_pending(db, cid, str(gpu_cache), pool=pool or Pool(1))
        assert p.parsed == r.pending and not p.corrupt
        db.close()
        return _index_of(tmp_path / name)

    here = index("here.db", None)  # layout.iter_dirs in this process
    with Pool(1) as one:
        units_here = index("units.db", one)  # walk units, walked here (one worker: no point sharing)
    started = []
    monkeypatch.setattr(workers._Worker, "__init__", lambda w: started.append(w) or booting(w))
    with Pool(3) as three:
        shared = index("shared.db", three)
    assert len(started) == 3  # started once, as the walk found enough to share: both phases use them
    assert here["entries"] and here["refs"] and here["sets"] and here["dirs"]
    assert units_here == here
    assert shared == here


def _new_kernels(root: Path, n: int) -> set[str]:
    """`n` new kernel directories in triton/0 (copies of one the fixture holds, as Triton writes
    them), older than the racy window; their keys."""
    src = sorted(p for p in (root / "triton" / "0").iterdir() if p.is_dir())[0]
    keys = set()
    for i in range(n):
        dst = src.parent / f"NEW{i:05d}{'A' * 44}"
        shutil.copytree(src, dst)
        keys.add(dst.relative_to(root).as_posix())
    old = time.time() - 10
    os.utime(src.parent, (old, old))
    return keys


def _keys(db_url: str) -> set[str]:
    return {k for (k,) in sqlite3.connect(db_url.removeprefix("sqlite:///")).execute("SELECT key FROM entries")}


def test_a_rescan_stopped_midway_leaves_nothing_the_next_one_does_not_find(gpu_cache, db_url, monkeypatch):
    """A rescan killed after some batches committed (kill -9, a full disk): a folder's mtime was
    committed with its own listing, before the subfolders below it, so the next rescan trusted
    it and never looked for the new kernel directories it had not reached (until a full scan).
    A directory's mtime is now written once everything below it is."""
    from cachemgr.index import fill, scan
    from cachemgr.index.db import Database

    db = Database(db_url)
    cid = db.cache_id("h", str(gpu_cache))
    scan.index_names(db, cid, str(gpu_cache))
    new = _new_kernels(gpu_cache, 40)
    monkeypatch.setattr(fill, "CHUNK", 4)  # a batch a few directories
    real, calls = scan._sync_dirs, []

    def killed_at_the_third_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(scan, "_sync_dirs", killed_at_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        scan.index_names(db, cid, str(gpu_cache))
    monkeypatch.setattr(scan, "_sync_dirs", real)
    had = len(new & _keys(db_url))
    assert 0 < had < len(new)  # (stopped midway)
    assert scan.index_names(db, cid, str(gpu_cache)).added == len(new) - had  # a plain rescan
    assert new <= _keys(db_url)
    db.close()


def test_a_folder_moved_away_and_back_during_a_full_scan_is_listed_again(gpu_cache, db_url, monkeypatch):
    """Kernel directories whose folder is moved away and back while a full scan walks them are
    gone to that scan (their rows go), and the folder's own mtime does not move: the next rescan
    trusted it. A folder that loses a subfolder between its listing and its walk is recorded RACY:
    the next rescan lists it again and finds them all."""
    from cachemgr import layout
    from cachemgr.index import fill, scan
    from cachemgr.index.db import Database
    from cachemgr.index.workers import Pool

    db = Database(db_url)
    cid = db.cache_id("h", str(gpu_cache))
    scan.index_names(db, cid, str(gpu_cache))
    before = _keys(db_url)
    folder, away = gpu_cache / "triton" / "0", gpu_cache / "elsewhere"
    real, walked = layout.iter_dirs, []

    def moving(root, subtree="", *a, **kw):  # the units of triton/0, walked apart: it is away for 3 of them
        if subtree.startswith("triton/0/"):
            walked.append(subtree)
            if len(walked) == 1:
                folder.rename(away)
            elif len(walked) == 4:
                away.rename(folder)
        yield from real(root, subtree, *a, **kw)

    monkeypatch.setattr(fill, "PARALLEL_WALK", 1)
    monkeypatch.setattr(layout, "iter_dirs", moving)
    with Pool(1) as one:  # (walk units, walked here)
        full = scan.index_names(db, cid, str(gpu_cache), full=True, pool=one)
    monkeypatch.setattr(layout, "iter_dirs", real)
    assert full.removed == 3
    again = scan.index_names(db, cid, str(gpu_cache))
    assert again.added == 3
    assert {
        k for (k,) in sqlite3.connect(db_url.removeprefix("sqlite:///")).execute("SELECT key FROM entries")
    } == before
    db.close()


def test_a_full_scan_removes_what_is_gone_with_its_walk_in_bounded_steps(gpu_cache, tmp_path, monkeypatch):
    """A full scan keeps the stored directories in the database (a temporary table), not in this
    process: it removes what is gone as a rescan does, leaves the index as a first scan of the
    same tree would, and runs again. Its walk hands out a few jobs at a time."""
    from cachemgr.index import fill, scan
    from cachemgr.index.db import Database
    from cachemgr.index.workers import Pool

    monkeypatch.setattr(fill, "PARALLEL_WALK", 1)
    monkeypatch.setattr(fill, "WALK_JOB", (1, 3))
    monkeypatch.setattr(fill, "WALK_AHEAD", 4)
    root = tmp_path / "cache"
    shutil.copytree(gpu_cache, root, symlinks=True)
    db = Database(f"sqlite:///{tmp_path / 'full.db'}")
    cid = db.cache_id("h", str(root))
    with Pool(2) as pool:
        first = scan.index_names(db, cid, str(root), pool=pool)
        shutil.rmtree(sorted(root.glob("triton/0/*"))[3])
        shutil.rmtree(sorted(root.glob("fxgraph/*"))[0])  # a whole <2ch> folder of graphs
        full = scan.index_names(db, cid, str(root), full=True, pool=pool)
        assert full.removed >= 2 and full.added == full.changed == 0
        assert full.unchanged == first.added - full.removed
        again = scan.index_names(db, cid, str(root), full=True, pool=pool)
        assert (again.added, again.changed, again.removed) == (0, 0, 0)
    db.close()
    fresh = Database(f"sqlite:///{tmp_path / 'fresh.db'}")
    scan.index_names(fresh, fresh.cache_id("h", str(root)), str(root))
    fresh.close()
    index, expected = _index_of(tmp_path / "full.db"), _index_of(tmp_path / "fresh.db")
    assert {k[0] for k in index["entries"]} == {e.key for e in layout.walk(str(root))}
    assert index["dirs"] == expected["dirs"]
    assert [k[:7] for k in index["entries"]] == [k[:7] for k in expected["entries"]]


def test_a_content_is_read_once_per_scan_and_never_where_hits_are_counted(gpu_cache, tmp_path):
    """Two entries with one content name and size (torch names fxgraph/AOT files by their bytes'
    hash): one is read, the other takes its result, and both say the same. Every read goes
    through a link in the trash folder: none is seen in an entry's own directory, where a running
    daemon counts reads as hits (a CLI scan beside a daemon counted every entry it read)."""
    from cachemgr.daemon.inotify import IN_CLOSE_NOWRITE, IN_CREATE, Inotify
    from cachemgr.index import scan
    from cachemgr.index.db import Database
    from cachemgr.index.workers import Pool

    root = tmp_path / "cache"
    shutil.copytree(gpu_cache, root, symlinks=True)
    src = sorted(root.glob("fxgraph/*/*/*"))[0]
    twin = src.parent.parent / (src.parent.name[:-4] + "zzzz") / src.name  # another graph key, same file
    twin.parent.mkdir()
    shutil.copy2(src, twin)
    db = Database(f"sqlite:///{tmp_path / 'index.db'}")
    cid = db.cache_id("h", str(root))
    scan.index_names(db, cid, str(root))
    pickles = sorted(root.glob("fxgraph/*/*/*")) + sorted(root.glob("aotautograd/*/*"))
    ino = Inotify()
    (root / ".cachemgr-trash").mkdir(exist_ok=True)  # index_names made it, before its walk
    ino.add_watch(str(root / ".cachemgr-trash"), IN_CREATE)
    for d in {p.parent for p in pickles}:
        ino.add_watch(str(d), IN_CLOSE_NOWRITE)
    with Pool(2) as pool:
        p = scan.parse_pending(db, cid, str(root), pool=pool)
    events = ino.read()  # the workers closed every file before they answered: all queued by now
    ino.close()
    assert [name for _, mask, _, name in events if mask & IN_CLOSE_NOWRITE and name] == []
    assert len([e for e in events if e[1] & IN_CREATE]) == len(pickles) - 1  # the twin's content: read once
    assert p.from_content >= 1 and not p.corrupt
    keys = {str(x.relative_to(root)) for x in (src, twin)}
    rows = [r for r in _index_of(tmp_path / "index.db")["entries"] if r[0] in keys]
    assert len(rows) == 2 and rows[0][8] and rows[0][8:] == rows[1][8:]  # graph key onwards: the same


UNGUARDED = """
import os, sys
from cachemgr import layout
from cachemgr.index import describe
entries = [e for e in layout.walk(sys.argv[1]) if e.kind in describe.PICKLED]
out = describe.describe_all(sys.argv[1], entries)
print(len(out), sum(bool(d.row.get("graph_key")) for d in out.values()), len(entries))
"""


def test_parallel_parse_survives_an_unguarded_main(gpu_cache, tmp_path):
    """A library caller whose script has no `if __name__ == "__main__"` (multiprocessing's spawn would
    re-run it in every worker and kill it): parse workers are plain `python -m` commands, unaffected."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    p = subprocess.run(
        [sys.executable, str(script), str(gpu_cache)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    described, with_graph_key, pickled = map(int, p.stdout.split()[-3:])
    assert described == pickled > 0
    assert with_graph_key == 6


def test_a_scan_racing_another_writer_reads_again_instead_of_failing(gpu_cache, db_url, tmp_path, monkeypatch):
    """Another process indexes the same new entries between this scan's read and its write (two
    scans at once, or the daemon): the write meets their rows, rolls back, and the scan reads again.
    (A rescan: a first scan into an empty index holds the write lock throughout, see the next test.)"""
    from sqlalchemy import text as sa_text

    from cachemgr.index import scan
    from cachemgr.index.db import Database

    db, other = Database(db_url), Database(db_url)
    cid = db.cache_id("testhost", str(gpu_cache))
    (gpu_cache / "fxgraph").rename(tmp_path / "fxgraph-aside")
    before = scan.reconcile(db, cid, str(gpu_cache)).added
    (tmp_path / "fxgraph-aside").rename(gpu_cache / "fxgraph")  # new entries, indexed by two scans at once
    real_sync, raced = scan.sync, []

    def lose_the_race_then_sync(*args, **kw):
        if not raced:
            raced.append(None)  # (the other writer's own sync must not race again)
            raced[0] = scan.reconcile(other, cid, str(gpu_cache))  # it commits first
        return real_sync(*args, **kw)

    monkeypatch.setattr(scan, "sync", lose_the_race_then_sync)
    r = scan.reconcile(db, cid, str(gpu_cache))
    assert 0 < before < 262 and raced[0].added == 262 - before
    assert not r.added and r.unchanged == 262
    with db.engine.connect() as conn:
        n, total = conn.execute(
            sa_text("SELECT COUNT(*), SUM(bytes) FROM entries WHERE cache_id = :c"), {"c": cid}
        ).one()
    assert (n, total) == (262, find_bytes(gpu_cache))


def test_a_first_scan_stopped_midway_leaves_the_index_with_its_indexes(gpu_cache, db_url, monkeypatch):
    """A first scan into an empty SQLite index drops the entries table's indexes for its bulk
    insert and makes them again at its end, in one transaction: stopped midway, the index is as
    it was (no rows, every index there); run again, it has every entry and the same indexes."""
    from sqlalchemy import text as sa_text

    from cachemgr.index import fill, scan
    from cachemgr.index.db import Database

    db = Database(db_url)
    cid = db.cache_id("testhost", str(gpu_cache))
    indexes = "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'entries' ORDER BY name"
    with db.engine.connect() as conn:
        made = conn.execute(sa_text(indexes)).all()
    assert len(made) >= 8
    real_insert, calls = fill.insert_batch, []

    def stop_after_one_batch(conn, *args, **kw):  # (conn: the sqlite3 connection under SQLAlchemy's)
        calls.append(None)
        if len(calls) == 2:
            raise KeyboardInterrupt
        kept = [tuple(r) for r in made if r.sql is None or " WHERE " in r.sql]  # the others dropped meanwhile
        assert len(kept) < len(made) and conn.execute(indexes).fetchall() == kept
        return real_insert(conn, *args, **kw)

    monkeypatch.setattr(fill, "BULK", 20)  # several batches
    monkeypatch.setattr(fill, "CHUNK", 5)
    monkeypatch.setattr(fill, "insert_batch", stop_after_one_batch)
    with pytest.raises(KeyboardInterrupt):
        scan.reconcile(db, cid, str(gpu_cache))
    with db.engine.connect() as conn:
        assert conn.execute(sa_text(indexes)).all() == made
        assert conn.execute(sa_text("SELECT COUNT(*) FROM entries")).scalar_one() == 0
        assert conn.execute(sa_text("SELECT last_scan FROM caches")).scalar_one() is None
    monkeypatch.setattr(fill, "insert_batch", real_insert)
    assert scan.reconcile(db, cid, str(gpu_cache)).added == 262
    with db.engine.connect() as conn:
        assert conn.execute(sa_text(indexes)).all() == made
        assert conn.execute(sa_text("PRAGMA integrity_check")).scalar_one() == "ok"
        plan = conn.execute(sa_text("EXPLAIN QUERY PLAN SELECT id FROM entries WHERE cache_id = 1 AND dir = 'x'")).all()
    assert "ix_entries_cache_dir" in str(plan)


def test_a_scan_started_during_a_first_fill_waits_for_it_then_adds_nothing(gpu_cache, db_url, monkeypatch):
    """A first scan into an empty SQLite index holds the write lock from its walk's start to its
    commit. A `cachemgr scan` process started meanwhile waits for that commit, then finds every
    entry indexed: it adds none, and fails on no unique key."""
    from sqlalchemy import text as sa_text

    from cachemgr.index import fill, scan
    from cachemgr.index.db import Database

    db = Database(db_url)
    cid = db.cache_id("testhost", str(gpu_cache))
    real_insert, other = fill.insert_batch, []

    def start_another_scan_then_insert(*args, **kw):
        if not other:  # inside the first fill's transaction: the other process must wait for it
            cmd = [sys.executable, "-m", "cachemgr", *Cli(gpu_cache, db_url).base(), "scan", "--json"]
            other.append(subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, text=True))
            time.sleep(3)  # (its start-up and imports: it then waits on the lock this scan holds)
            assert other[0].poll() is None
        return real_insert(*args, **kw)

    monkeypatch.setattr(fill, "insert_batch", start_another_scan_then_insert)
    assert scan.reconcile(db, cid, str(gpu_cache)).added == 262
    out, _ = other[0].communicate(timeout=120)
    assert other[0].returncode == 0
    theirs = json.loads(out)
    assert theirs["added"] == 0 and theirs["unchanged"] == 262
    with db.engine.connect() as conn:
        assert conn.execute(sa_text("SELECT COUNT(*) FROM entries")).scalar_one() == 262
        assert conn.execute(sa_text("PRAGMA integrity_check")).scalar_one() == "ok"


def test_a_daemon_batch_racing_a_scan_reads_again_instead_of_failing(gpu_cache, db_url, monkeypatch):
    """The daemon's live batch loses the same race to a `cachemgr scan`: read again, not dropped."""
    from cachemgr.index import live, scan
    from cachemgr.index.db import Database

    db, other = Database(db_url), Database(db_url)
    cid = db.cache_id("testhost", str(gpu_cache))
    paths = [p.relative_to(gpu_cache).as_posix() for p in gpu_cache.glob("fxgraph/*/*/*")]
    real_sync, raced = live.sync, []

    def lose_the_race_then_sync(*args, **kw):
        if not raced:
            raced.append(scan.reconcile(other, cid, str(gpu_cache)))  # a CLI scan commits first
        return real_sync(*args, **kw)

    monkeypatch.setattr(live, "sync", lose_the_race_then_sync)
    r = live.apply_batch(db, cid, str(gpu_cache), paths=paths)
    assert len(paths) == 6 and raced[0].added == 262 and r.added == [] and r.removed == []


ROW = "SELECT key, kind, ref, alias, graph_key, bytes, files, mtime, parse_state, corrupt FROM entries ORDER BY key"


def test_the_daemons_batch_indexes_a_cache_as_a_scan_does(cpu_cache, tmp_path):
    """Every file of a real CPU cache handed to the daemon's live batch (as the watcher hands the
    files a compile writes) gives the index a scan gives: the same rows, read alike. A C++ build
    indexed from the watcher's events once had no alias (its source never read), so no graph
    named it: an orphan to the next eviction, its graph left to rebuild it. A file named like a
    module's with nothing after its dot ('c<hash>.') is another entry to both."""
    from cachemgr.index import live, reconcile
    from cachemgr.index.db import Database

    module = next(cpu_cache.glob("*/c*.py"))
    module.with_name(module.name.removesuffix("py")).write_text("x")  # 'c<hash>.': another entry
    twin = tmp_path / "twin"
    shutil.copytree(cpu_cache, twin, symlinks=True)
    scanned, watched = Database(f"sqlite:///{tmp_path / 'scan.db'}"), Database(f"sqlite:///{tmp_path / 'live.db'}")
    reconcile(scanned, scanned.cache_id("h", str(cpu_cache)), str(cpu_cache))
    paths = [p.relative_to(twin).as_posix() for p in twin.rglob("*") if p.is_file() and not p.is_symlink()]
    live.apply_batch(watched, watched.cache_id("h", str(twin)), str(twin), paths=paths)
    by_scan, by_watch = (sqlite3.connect(tmp_path / name).execute(ROW).fetchall() for name in ("scan.db", "live.db"))
    builds = [r for r in by_scan if r[1] == "code" and r[3]]
    assert builds and all(r[3].startswith("src-") for r in builds)  # (C++ builds, each with its source's name)
    assert by_watch == by_scan


def test_cpp_builds_an_older_daemon_indexed_without_their_source_are_named_after_the_upgrade(
    cpu_cache, cli_for, db_url
):
    """An index at 0006 whose C++ builds have no alias (as the daemon's batch left them before
    it noted their sources): migration 0007 has them read again, and the next scan names them."""
    cli, path = cli_for(cpu_cache), db_url.removeprefix("sqlite:///")
    cli("scan")
    aliases = "SELECT key, alias FROM entries WHERE kind = 'code' ORDER BY key"
    named = sqlite3.connect(path).execute(aliases).fetchall()
    assert any(alias for _, alias in named)
    with sqlite3.connect(path) as conn:  # the rows an older daemon wrote, at the revision it wrote them
        conn.execute("UPDATE entries SET alias = NULL WHERE kind = 'code'")
        conn.execute("UPDATE alembic_version SET version_num = '0006'")
    assert cli.json("scan")["parsed"] == len(named)
    assert sqlite3.connect(path).execute(aliases).fetchall() == named


def test_a_kernel_folder_of_many_files_is_shown_and_watched_in_bounded_memory(gpu_cache, cli_for, db_url):
    """A kernel folder of more files than `show` lists (a hostile one may hold millions): the
    daemon's re-read and `show` count every file and keep the names of layout.MAX_PATHS of them
    (both held every name, and `show` every file's lstat: 540 MB at 500,000 files)."""
    from cachemgr import safefs
    from cachemgr.index import live
    from cachemgr.index.db import Database

    cli = cli_for(gpu_cache)
    cli("scan")
    kernel = next(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())
    had = sum(1 for _ in kernel.iterdir())
    extra = layout.MAX_PATHS + 500 - had
    for i in range(extra):
        (kernel / f"extra-{i:05d}.bin").write_bytes(b"x")
    key = kernel.relative_to(gpu_cache).as_posix()
    with safefs.Root(str(gpu_cache)) as r:
        e = layout.stat_entry(r, layout.classify(f"{key}/extra-00000.bin"))
    assert e is not None and e.files == layout.MAX_PATHS + 500 and len(e.paths) == layout.MAX_PATHS
    db = Database(db_url)
    changed = live.apply_batch(
        db, db.cache_id("testhost", str(gpu_cache)), str(gpu_cache), paths=[f"{key}/extra-00000.bin"]
    )
    assert changed.changed == [key]
    shown = cli.json("show", key)
    assert shown["files"] == layout.MAX_PATHS + 500 and shown["files_not_listed"] == 500
    listed = [f["path"] for f in shown["files_on_disk"]]
    assert len(listed) == layout.MAX_PATHS and listed == sorted(listed) and all(p.startswith(key + "/") for p in listed)
    assert "and 1,494 more (--wide)" in cli("show", key).stdout
    assert "... and 500 more, not listed" in cli("show", key, "--wide").stdout


@pytest.mark.slow  # real processes without root's capabilities
def test_an_unreadable_directory_keeps_its_entries_and_is_reported(gpu_cache, cli_for):
    """A folder the scan cannot list (permissions) is not a folder that is gone: its entries stay
    in the index as last seen, the scan says which folder, and nothing is lost once it is readable."""
    cli = cli_for(gpu_cache)
    assert cli.json("scan")["added"] == 262
    victim = next(p for p in (gpu_cache / "fxgraph").iterdir() if p.is_dir())
    inside = {e["key"] for e in cli.json("ls", "--kind", "fxgraph") if e["key"].startswith(f"fxgraph/{victim.name}/")}
    assert inside
    # as root, drop the capabilities that read past permissions (root is what CI runs as)
    unprivileged = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    victim.chmod(0)
    try:
        for full in ([], ["--full"]):
            cmd = [*unprivileged, sys.executable, "-m", "cachemgr", *cli.base(), "scan", *full]
            r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=120)
            assert r.returncode == 0, r.stderr
            assert "0 removed" in r.stdout, r.stdout
            # the folder itself, or (a rescan that trusts its mtime) the key folders it hides
            assert f"cachemgr: warning: cannot read fxgraph/{victim.name}/" in r.stderr, r.stderr
            doc = json.loads(
                subprocess.run(
                    [*cmd, "--json"], capture_output=True, text=True, env=subprocess_env(), timeout=120
                ).stdout
            )
            assert doc["unreadable"] and doc["removed"] == 0
            assert all(d.startswith(f"fxgraph/{victim.name}") for d in doc["unreadable"]), doc["unreadable"]
    finally:
        victim.chmod(0o755)
    assert inside <= {e["key"] for e in cli.json("ls", "--kind", "fxgraph")}
    again = cli.json("scan", "--full")
    assert (again["added"], again["changed"], again["removed"], again["unreadable"]) == (0, 0, 0, [])


def test_rescan_reconciles_changes(cpu_cache, cli_for):
    cli = cli_for(cpu_cache)
    first = cli.json("scan")
    age_dirs(cpu_cache)  # the trash folder the scan made (for its reads) moved the root's mtime: set back too
    again = cli.json("scan")
    assert again["added"] == again["changed"] == again["removed"] == 0
    assert again["unchanged"] == first["added"]
    # An unchanged tree is answered from directory mtimes alone, without importing SQLAlchemy.
    assert scan_in_a_fresh_process(cli) == (first["added"], False)

    victim = next(cpu_cache.glob("fxgraph/*/*/*"))
    victim.unlink()
    rewritten = next(cpu_cache.glob("??/c*.py"))  # as Inductor writes: a finished file renamed into place
    tmp = rewritten.with_name(f".{os.getpid()}.1.tmp")
    tmp.write_text(rewritten.read_text() + "\n# rewritten\n")
    os.replace(tmp, rewritten)
    (cpu_cache / "other.bin").write_bytes(b"x" * 100)
    r = cli.json("scan")
    assert (r["added"], r["changed"], r["removed"]) == (1, 1, 1)
    assert cli.json("stats")["bytes"] == find_bytes(cpu_cache)

    # A file edited in place leaves its directory's mtime alone: only --full stats every file.
    age_dirs(cpu_cache)
    assert cli.json("scan")["changed"] == 0  # the directories the last scan saw move are read once more
    edited = next(p for p in cpu_cache.glob("??/c*.py") if p.parent != rewritten.parent)
    with open(edited, "a") as f:
        f.write("# edited in place\n")
    assert cli.json("scan")["changed"] == 0
    full = cli.json("scan", "--full")
    assert (full["added"], full["changed"], full["removed"]) == (0, 1, 0)
    assert cli.json("stats")["bytes"] == find_bytes(cpu_cache)


def test_a_rescan_just_after_a_first_scan_stays_quick(cpu_cache, cli_for):
    """A first scan makes its trash folder in the root just before its walk: the root's mtime is
    too recent to trust (RACY), so the next walk reads the root again. A directory read again
    that holds no entry, then or now, with the same subdirectories, is settled by the quick
    rescan itself (no SQLAlchemy); a file that appears there is still found."""
    age_dirs(cpu_cache)
    cli = cli_for(cpu_cache)
    first = cli.json("scan")
    for _ in range(2):  # the root recorded RACY, then (moved less than 2 s ago) RACY again
        assert scan_in_a_fresh_process(cli) == (first["added"], False)
    (cpu_cache / "other.bin").write_bytes(b"x" * 100)
    (cpu_cache / "fxgraph" / "stray").write_bytes(b"y" * 10)
    r = cli.json("scan")
    assert (r["added"], r["changed"], r["removed"]) == (2, 0, 0), r
    (cpu_cache / "fxgraph" / "stray").unlink()
    r = cli.json("scan")
    assert (r["added"], r["changed"], r["removed"]) == (0, 0, 1), r
    assert cli.json("stats")["bytes"] == find_bytes(cpu_cache)


@pytest.mark.slow
def test_rescan_after_real_compile_matches_full_scan(cpu_cache, cli_for):
    """What a real torch.compile writes moves directory mtimes: the quick rescan finds all of it."""
    age_dirs(cpu_cache)
    cli = cli_for(cpu_cache)
    cli("scan")
    run_program(cpu_cache, "--batches", "3,5")  # new static shapes: new graphs, modules, kernels
    quick = cli.json("scan")
    assert quick["added"] > 0 and quick["corrupt"] == []
    full = cli.json("scan", "--full")
    assert (full["added"], full["changed"], full["removed"]) == (0, 0, 0)
    assert cli.json("stats")["bytes"] == find_bytes(cpu_cache)


def test_rescan_sees_new_and_removed_directories(gpu_cache, cli_for):
    age_dirs(gpu_cache)
    cli = cli_for(gpu_cache)
    first = cli.json("scan")
    kernel = next(gpu_cache.glob("triton/0/*"))
    copy = kernel.with_name(kernel.name[:-4] + "ZZZZ")
    shutil.copytree(kernel, copy)  # a new kernel directory (Triton renames it into place whole)
    gone = next(gpu_cache.glob("triton/0/*"))
    while gone in (kernel, copy):
        gone = next(p for p in gpu_cache.glob("triton/0/*") if p not in (kernel, copy))
    shutil.rmtree(gone)
    shutil.rmtree(next(gpu_cache.glob("fxgraph/*")))  # a whole <2ch> folder of graphs
    r = cli.json("scan")
    assert r["added"] == 1 and r["removed"] >= 2 and r["changed"] == 0
    assert r["unchanged"] == first["added"] - r["removed"]
    keys = {e["key"] for e in cli.json("ls")}
    assert copy.relative_to(gpu_cache).as_posix() in keys
    assert gone.relative_to(gpu_cache).as_posix() not in keys
    assert keys == {e.key for e in layout.walk(str(gpu_cache))}
    assert cli.json("stats")["bytes"] == find_bytes(gpu_cache)


def test_rescan_sees_a_kernel_directory_swapped_for_a_symlink(gpu_cache, tmp_path, cli_for):
    """A rescan reads a known kernel directory's mtime with an lstat through its parent, without
    opening it. One replaced by a symlink to a copy with the very same mtime (its parent's mtime
    set back too) is not trusted nor followed: its entry leaves the index, the copy is untouched."""
    age_dirs(gpu_cache)
    cli = cli_for(gpu_cache)
    cli("scan")
    age_dirs(gpu_cache)  # (the scan's trash folder moved the root's mtime)
    assert cli.json("scan")["added"] == 0
    kernel = next(p for p in sorted(gpu_cache.glob("triton/0/*")) if not any(c.is_dir() for c in p.iterdir()))
    parent, mtime = kernel.parent.stat(), kernel.stat().st_mtime_ns
    outside = tmp_path / "elsewhere"
    shutil.copytree(kernel, outside)
    os.utime(outside, ns=(mtime, mtime))
    shutil.rmtree(kernel)
    kernel.symlink_to(outside)
    os.utime(kernel.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    assert os.stat(kernel).st_mtime_ns == mtime  # followed, it would look unchanged
    r = cli.json("scan")
    assert (r["added"], r["changed"], r["removed"]) == (0, 0, 1)
    assert kernel.relative_to(gpu_cache).as_posix() not in {e["key"] for e in cli.json("ls")}
    assert sorted(p.name for p in outside.iterdir()) and cli.json("stats")["bytes"] == find_bytes(gpu_cache)


def test_component_sets_live_as_long_as_their_entries(gpu_cache, cli_for, db_url):
    cli = cli_for(gpu_cache)
    cli("scan")
    conn = sqlite3.connect(db_url.split(":///", 1)[1])
    count = lambda: conn.execute("SELECT COUNT(*) FROM component_sets").fetchone()[0]  # noqa: E731
    shared = count()
    assert shared > 0
    graphs = sorted(gpu_cache.glob("fxgraph/*/*/*"))
    graphs[0].unlink()  # one graph gone: the sets it shared with the others stay
    cli("scan")
    assert 0 < count() <= shared
    for p in [*graphs[1:], *gpu_cache.glob("aotautograd/*/*")]:
        p.unlink()
    cli("scan")
    assert count() == 0
    assert conn.execute("SELECT COUNT(*) FROM component_set_items").fetchone() == (0,)


def test_transient_files_are_not_entries(cpu_cache, cli_for):
    d = next(cpu_cache.glob("fxgraph/*/*"))
    (d / f".{os.getpid()}.1234.tmp").write_bytes(b"partial write")
    tmpdir = cpu_cache / "triton" / "0" / "tmp.pid_1_abc"
    tmpdir.mkdir(parents=True)
    (tmpdir / "k.cubin").write_bytes(b"\0" * 10)
    cli = cli_for(cpu_cache)
    cli("scan")
    keys = [e["key"] for e in cli.json("ls")]
    assert not any(".tmp" in k or "tmp.pid" in k for k in keys)


def test_hostile_pickle_executes_nothing(cpu_cache, cli_for, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class EvilOpen:
        def __reduce__(self):
            return (open, (str(marker) + "2", "w"))

    key = "f" + "a" * 51
    for i, payload in enumerate((Evil(), EvilOpen(), [EvilOpen()])):
        d = cpu_cache / "fxgraph" / key[1:3] / key
        d.mkdir(parents=True, exist_ok=True)
        (d / f"evil{i}").write_bytes(pickle.dumps(payload))
    junk = cpu_cache / "fxgraph" / "bb" / ("f" + "b" * 51)
    junk.mkdir(parents=True)
    (junk / "truncated").write_bytes(next(cpu_cache.glob("fxgraph/*/*/*")).read_bytes()[:500])
    (junk / "empty").write_bytes(b"")
    (junk / "random").write_bytes(os.urandom(4096))
    cli = cli_for(cpu_cache)
    res = cli.json("scan")
    assert not marker.exists() and not Path(str(marker) + "2").exists()
    reasons = {k.rsplit("/", 1)[1]: r for k, r in ((c["key"], c["reason"]) for c in res["corrupt"])}
    assert set(reasons) == {"evil0", "evil1", "evil2", "truncated", "empty", "random"}
    assert reasons["empty"] == "empty file"
    bad = cli.json("ls", "--corrupt")
    assert len(bad) == 6 and all(e["corrupt"] for e in bad)
    assert cli.json("stats")["corrupt"] == 6


INSPECT_WITHOUT_TORCH = NO_TORCH_PROGRAM


@pytest.mark.parametrize("args", [["scan"], ["stats"], ["stats", "--json"], ["ls", "--json"], ["show", "FXGRAPH"]])
def test_inspection_never_imports_torch(cpu_cache, db_url, args):
    base = ["--cache-dir", str(cpu_cache), "--db", db_url]
    env = subprocess_env()
    subprocess.run([sys.executable, "-m", "cachemgr", *base, "scan"], env=env, check=True, capture_output=True)
    fx = next(cpu_cache.glob("fxgraph/*/*/*")).relative_to(cpu_cache).as_posix()
    args = [fx if a == "FXGRAPH" else a for a in args]  # an fxgraph entry: its parse is the torch-shaped part
    out = subprocess.run(
        [sys.executable, "-c", INSPECT_WITHOUT_TORCH, *base, *args], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_stats_fast_path_skips_sqlalchemy(cpu_cache, db_url):
    base = ["--cache-dir", str(cpu_cache), "--db", db_url]
    env = subprocess_env()
    subprocess.run([sys.executable, "-m", "cachemgr", *base, "scan"], env=env, check=True, capture_output=True)
    code = INSPECT_WITHOUT_TORCH.replace('"torch" not in', '"sqlalchemy" not in')
    out = subprocess.run(
        [sys.executable, "-c", code, *base, "stats", "--json"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def test_alembic_head_matches_models(tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from cachemgr.index.db import Database, migrations_dir
    from cachemgr.index.models import Base
    from cachemgr.index.revision import HEAD_REVISION

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    assert ScriptDirectory.from_config(cfg).get_current_head() == HEAD_REVISION
    db = Database(f"sqlite:///{tmp_path / 'x.db'}")
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    assert db.current_revision() == HEAD_REVISION


def test_index_is_wal(cpu_cache, cli_for, db_url):
    import sqlite3

    cli_for(cpu_cache)("scan")
    conn = sqlite3.connect(db_url.split(":///", 1)[1])
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.slow  # builds a wheel
def test_migrations_ship_in_the_wheel(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 and "hatchling" in out.stderr:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(REPO)],
            capture_output=True,
            text=True,
        )
    assert out.returncode == 0, out.stderr[-2000:]
    import zipfile

    (whl,) = tmp_path.glob("cachemgr-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "cachemgr/migrations/env.py" in names
    assert any(n.startswith("cachemgr/migrations/versions/0001") for n in names)
    # installed from the wheel alone (no checkout on the path), the index still migrates
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    code = (
        "import cachemgr, sys; from cachemgr.index.db import Database, migrations_dir; "
        f"assert str(migrations_dir()).startswith({str(site)!r}), migrations_dir(); "
        f"Database('sqlite:///{tmp_path}/w.db'); print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.strip() == "ok", r.stderr


def test_entries_read_by_other_readers_are_read_again(fixture_cache, cli_for, db_url):
    """An index filled by another version of the readers (parse.READER): the next scan reads every
    entry again (an upgrade that reads more applies to what was indexed before it), and a parse
    result kept by content by another version is replaced, never taken."""
    import sqlite3

    from cachemgr import parse

    cli = cli_for(fixture_cache("torch-2.14.1-cpu-dynamo"))
    cli("scan")
    good = {e["key"]: e for e in cli.json("ls")}
    pre = next(k for k, e in good.items() if e["kind"] == "precompile")
    fx = next(k for k, e in good.items() if e["kind"] == "fxgraph")
    assert good[pre]["torch_version"]
    path = db_url.split(":///", 1)[1]
    with sqlite3.connect(path) as c:  # what an older cachemgr left: fields it did not read
        c.execute("UPDATE caches SET reader = ?", (parse.READER - 1,))
        c.execute("UPDATE entries SET torch_version = NULL, compile_seconds = NULL WHERE key IN (?, ?)", (pre, fx))
        c.execute("UPDATE parsed_content SET reader = ?, row = json_set(row, '$.compile_seconds', 0.5)", (0,))
    r = cli.json("scan")  # fx is read again, not taken from the old reader's kept result (0.5 s)
    again = {e["key"]: e for e in cli.json("ls")}
    assert r["pending"] == 0
    for k in (pre, fx):
        assert (again[k]["torch_version"], again[k]["compile_seconds"]) == (
            good[k]["torch_version"],
            good[k]["compile_seconds"],
        )
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT DISTINCT reader FROM caches").fetchall() == [(parse.READER,)]
        assert c.execute("SELECT DISTINCT reader FROM parsed_content").fetchall() == [(parse.READER,)]
    assert cli.json("scan")["unchanged"] == len(good)  # and then a rescan trusts the tree again


def test_a_streams_workers_are_not_handed_on_once_its_thread_is_gone(gpu_cache):
    """A worker gets SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG is per
    thread). A stream's thread starts workers and ends at close: none of them may wait in the
    pool for its next job (which then read a dead worker's EOF: "the parse worker died")."""
    from cachemgr.index.workers import WALK, Job, Pool

    pool = Pool(2)
    try:
        kernels = sorted(p.relative_to(gpu_cache).as_posix() for p in (gpu_cache / "triton" / "0").iterdir())
        jobs = [Job(i, 0, str(gpu_cache), WALK, "", None, (k,)) for i, k in enumerate(kernels[:8])]
        with pool.stream(lambda job, why: why) as stream:
            stream.submit(jobs)
            results = [stream.get() for _ in jobs]
        assert all(not isinstance(r, str) for _, r in results), results
        time.sleep(0.5)  # a killed worker's signal has long arrived
        assert all(w.proc.poll() is None for w in pool.idle), [w.proc.returncode for w in pool.idle]
        (job, result), *_ = list(pool.run(jobs[:1], lambda job, why: why))
        assert not isinstance(result, str), result  # the next job finds a live worker
    finally:
        pool.close()


LEAKED_LOCK = """
from cachemgr.index import workers
workers.CLOSE_SECONDS = 0.5
with workers.Pool(1) as pool:
    stream = pool.stream(lambda job, why: why)
    stream.cv.acquire()  # what a Ctrl-C between a `with stream.cv` taking the lock and its block leaves
    stream.close()
print("closed")
"""


def test_a_stream_closes_when_an_interrupt_left_its_lock_held():
    """An interrupted scan closes its walk or parse stream on the way out. If the interrupt left
    the stream's lock held (between a `with` taking it and its block), the close still returns:
    Ctrl-C once is enough (a review saw a scan hang there once in 110 interrupts)."""
    out = subprocess.run(
        [sys.executable, "-c", LEAKED_LOCK], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "closed", out.stderr


def test_a_damaged_kept_parse_result_is_read_again_and_replaced(gpu_cache, tmp_path, db_url):
    """Parse results kept by content are shared by every cache of an index (a restored cache,
    every host of a fleet's). One that does not read as this reader writes it (JSON that does not
    parse, a list where a field belongs, a field of another type, a reference that is not a pair
    of names) is no reason to fail a scan: the entry is read instead and its result kept over the damaged one."""
    first = Cli(gpu_cache, db_url)
    assert first.json("scan")["pending"] == 0
    path = db_url.removeprefix("sqlite:///")
    damage = [
        ("row", "{not json"),
        ("row", json.dumps({"graph_key": [1, 2]})),
        ("refs", json.dumps([[1, 2]])),
        ("refs", json.dumps([["triton"]])),
        ("parts", json.dumps("x")),
        ("row", json.dumps(["a list"])),
        ("row", json.dumps({"compile_seconds": "x"})),
        ("row", json.dumps({"compile_seconds": float("nan")})),
        ("row", json.dumps({"signature": 5})),
        ("row", '{"compile_seconds": 1' + "0" * 400 + "}"),
        ("row", json.dumps({"compile_seconds": 10**20})),
    ]
    with sqlite3.connect(path) as conn:
        names = [n for (n,) in conn.execute("SELECT name FROM parsed_content ORDER BY name")]
    rounds = [damage[i : i + len(names)] for i in range(0, len(damage), len(names))]
    for n, damaged in enumerate(rounds):  # (a round per restored cache: one damage per kept result)
        with sqlite3.connect(path) as conn:
            for name, (column, value) in zip(names, damaged, strict=False):
                conn.execute(f'UPDATE parsed_content SET "{column}" = ? WHERE name = ?', (value, name))
        restored = tmp_path / f"restored-{n}"
        shutil.copytree(gpu_cache, restored, symlinks=True)
        r = Cli(restored, db_url).json("scan")
        assert r["pending"] == 0 and r["corrupt"] == []
    with sqlite3.connect(path) as conn:
        fields = "kind, graph_key, signature_hash, options_hash, guards, compile_seconds, torch_version, corrupt"
        by_cache = [
            sorted(conn.execute(f"SELECT key, {fields} FROM entries WHERE cache_id = ? AND content IS NOT NULL", (c,)))
            for (c,) in conn.execute("SELECT id FROM caches ORDER BY id").fetchall()
        ]
        refs = [
            sorted(
                conn.execute(
                    "SELECT e.key, r.kind, r.ref FROM entry_refs r JOIN entries e ON e.id = r.entry_id "
                    "WHERE e.cache_id = ? AND e.content IS NOT NULL",
                    (c,),
                )
            )
            for (c,) in conn.execute("SELECT id FROM caches ORDER BY id").fetchall()
        ]
        kept = conn.execute('SELECT "row", refs, parts FROM parsed_content').fetchall()
    assert len(by_cache) == 1 + len(rounds) and all(c == by_cache[0] for c in by_cache) and by_cache[0]
    assert all(r == refs[0] for r in refs) and refs[0]
    for row, kept_refs, parts in kept:  # repaired: each as this reader writes it
        assert isinstance(json.loads(row), dict) and isinstance(json.loads(parts), dict)
        assert all(len(x) == 2 and all(isinstance(v, str) for v in x) for x in json.loads(kept_refs))


def test_a_folder_swapped_with_a_symlink_and_back_is_indexed_again_by_the_daemon_s_batches(gpu_cache, db_url):
    """`triton/0` is exchanged with a symlink (its entries leave the index), then back: the name
    comes in one batch as a file (the symlink's events) and as a directory. Its subtree is walked
    again, not passed over as the 'other' entry a file of that name would be."""
    import shutil

    from cachemgr.index import live, scan
    from cachemgr.index.db import Database
    from cachemgr.index.store import Store

    db = Database(db_url)
    cid = db.cache_id("testhost", str(gpu_cache))
    scan.reconcile(db, cid, str(gpu_cache))
    store = Store.of(db, "testhost", str(gpu_cache))
    kernels = {e.key for e in store.entries() if e.key.startswith("triton/0/")}
    outside = gpu_cache.parent / "elsewhere"
    outside.mkdir()
    shutil.move(gpu_cache / "triton" / "0", gpu_cache / "triton" / "0.away")
    (gpu_cache / "triton" / "0").symlink_to(outside)
    live.apply_batch(db, cid, str(gpu_cache), paths=["triton/0"], dirs=["triton/0"])
    assert not {e.key for e in store.entries()} & kernels
    (gpu_cache / "triton" / "0").unlink()
    shutil.move(gpu_cache / "triton" / "0.away", gpu_cache / "triton" / "0")
    live.apply_batch(db, cid, str(gpu_cache), paths=["triton/0"], dirs=["triton/0"])
    assert kernels and {e.key for e in store.entries()} >= kernels


def test_a_batch_of_graphs_whose_worker_is_killed_blames_only_the_entry_that_took_too_long(
    gpu_cache, db_url, monkeypatch
):
    """Graph pickles go to the workers several to a job. A job that runs out of time (its worker
    killed) is read again an entry a job: only the slow entry is corrupt, the others in its batch
    are read as ever."""
    from hostile import slow_pickle

    from cachemgr.index import pending, workers
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    slow = gpu_cache / "fxgraph" / "zz" / ("f" + "z" * 51)
    slow.mkdir(parents=True)
    (slow / ("s" * 51)).write_bytes(slow_pickle())  # (a list of 15M ones took 0.8 s on a fast day: under the limit)
    monkeypatch.setattr(pending, "PICKLE_BATCH", 1000)  # every graph of the cache in the slow one's job
    monkeypatch.setattr(workers, "PARSE_SECONDS", 1.0)
    db = Database(db_url)
    result = reconcile(db, db.cache_id("testhost", str(gpu_cache)), str(gpu_cache))
    corrupt = dict(result.corrupt)
    assert list(corrupt) == ["fxgraph/zz/f" + "z" * 51 + "/" + "s" * 51], corrupt
    assert "took longer than 1 s" in next(iter(corrupt.values()))


def test_a_batch_of_many_code_entries_lists_their_folder_once(tmp_path, db_url, monkeypatch):
    """The daemon's batch listed a module's <2ch>/ folder for every code entry in it: 20,000 new
    modules of one folder (a flood, or a workload's burst) were applied at 75 a second, and the
    rescan an overflow asked for waited behind them."""
    from cachemgr import safefs
    from cachemgr.index import live
    from cachemgr.index.db import Database

    root = tmp_path / "cache"
    folder = root / "zo"
    folder.mkdir(parents=True)
    stems = [f"czo{i:049d}" for i in range(300)]
    for s in stems:
        (folder / f"{s}.py").write_text("# a module\n")
    listed: list[str] = []
    real = safefs.Root.listdir
    monkeypatch.setattr(safefs.Root, "listdir", lambda self, p=".": listed.append(p) or real(self, p))
    db = Database(db_url)
    try:
        r = live.apply_batch(db, db.cache_id("h", str(root)), str(root), paths=[f"zo/{s}.py" for s in stems])
    finally:
        db.close()
    assert sorted(r.added) == sorted(f"zo/{s}" for s in stems)
    assert listed.count("zo") == 1, len(listed)
