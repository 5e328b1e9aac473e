"""cachemgr.index.Store on real caches (the fixtures torch wrote; nothing compiles here): the two
drivers give the same answers, short keys are unique and resolve back, every key form resolves,
pins, and the stdlib path imports no SQLAlchemy."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
from conftest import subprocess_env

from cachemgr import explain, layout
from cachemgr.errors import NotFound, UsageError
from cachemgr.index import AmbiguousKey, Database, Filters, Store
from cachemgr.index.revision import HEAD_REVISION
from cachemgr.index.store import unique_prefix

HOST = "testhost"


def scanned(cli_for, root, db_url):
    cli_for(root)("scan")
    db = Database(db_url)
    return db, Store.of(db, HOST, str(root)), Store.sqlite(db_url.split(":///", 1)[1], HEAD_REVISION, HOST, str(root))


def twins(root) -> tuple[str, str]:
    """A second guard set of one graph, and one kernel on a second device: names shared by two entries."""
    fx = sorted(root.glob("fxgraph/*/*/*"))[0]
    twin = fx.with_name("zz" + fx.name[2:])
    shutil.copy2(fx, twin)
    kernel = sorted((root / "triton" / "0").iterdir())[0]
    shutil.copytree(kernel, root / "triton" / "1" / kernel.name)
    return fx.parent.name, kernel.name


@pytest.mark.parametrize("name", ["h200-2.11", "mixed-2.5.1-2.13.0-cpu", "torch-2.13.0-cpu-dynamo"])
def test_both_drivers_give_the_same_answers(fixture_cache, cli_for, db_url, name):
    root = fixture_cache(name)
    if name == "h200-2.11":
        twins(root)
    db, slow, quick = scanned(cli_for, root, db_url)
    assert quick is not None and quick.dialect == "sqlite"
    slow.add_pin(slow.entries(Filters(kind="fxgraph"))[0].key, "kept")
    assert slow.totals() == quick.totals()
    for f in (
        Filters(),
        Filters(locks=True),
        Filters(kind="fxgraph", sort="cost"),
        Filters(sort="age", limit=5),
        Filters(larger_than=10_000, sort="name"),
        Filters(pinned=True),
        Filters(older_than=0.0),
    ):
        assert slow.entries(f) == quick.entries(f), f
    every = slow.entries(Filters(locks=True))
    assert slow.short_keys(every) == quick.short_keys(every)
    for short in slow.short_keys(every).values():
        assert slow.resolve(short) == quick.resolve(short)
    assert slow.compile_events() == quick.compile_events() and slow.event_counts() == quick.event_counts()
    graphs = slow.graph_entries()
    assert graphs == quick.graph_entries()
    sets = {s for g in graphs for s in g.sets.values()}
    assert slow.component_sets(sets) == quick.component_sets(sets)
    assert slow.pins() == quick.pins() and slow.model_usage() == quick.model_usage()
    assert explain.activity(slow, 3650 * 86400) == explain.activity(quick, 3650 * 86400)
    assert slow.fleet_hosts() == quick.fleet_hosts() and slow.torch_versions() == quick.torch_versions()
    streamed = [tuple(r) for rows in slow.policy_rows() for r in rows]  # (a stream: read before the next query)
    assert streamed == [tuple(r) for rows in quick.policy_rows() for r in rows]
    # eviction reads each ref off its key (layout.ref_of) rather than hold it: they must agree
    assert [(key, layout.ref_of(key, kind)) for _, key, kind, ref, *_ in streamed] == [
        (key, ref) for _, key, kind, ref, *_ in streamed
    ]
    assert len(streamed) == slow.totals().total.entries
    for autotune in (True, False):
        refs = [tuple(r) for r in slow.policy_refs(autotune)]
        assert refs == [tuple(r) for r in quick.policy_refs(autotune)] and (refs or autotune)
    db.close()


def test_short_keys_are_unique_and_resolve_back(fixture_cache, cli_for, db_url):
    root = fixture_cache("h200-2.11")
    graph, kernel = twins(root)
    db, store, _ = scanned(cli_for, root, db_url)
    every = store.entries(Filters(locks=True))
    shorts = store.short_keys(every)
    assert len(set(shorts.values())) == len(every)  # one short key per entry
    for e in every:
        s = shorts[e.key]
        head = s.split("/")[0]
        assert len(head) >= 8 or head == (e.ref or e.key)
        match = store.resolve(s)
        assert e in match.entries, s
        if "/" not in s:  # a ref of one entry: the short key names that ref (a pin of it keeps later guard sets)
            assert match.ref == e.ref and match.entries == (e,)
    # where a ref has two entries, each gets '/name' (the guard set's file, the kernel's device)
    two = [e for e in every if e.ref in (graph, kernel)]
    assert len(two) == 4 and all("/" in shorts[e.key] for e in two)
    assert {shorts[e.key].split("/")[1] for e in two if e.ref == kernel} == {"0", "1"}
    assert set(store.resolve(shorts[two[0].key].split("/")[0]).entries) == {e for e in two if e.ref == two[0].ref}
    db.close()


def test_every_key_form_resolves(fixture_cache, cli_for, db_url):
    root = fixture_cache("h200-2.11")
    graph, _ = twins(root)
    db, store, _ = scanned(cli_for, root, db_url)
    fx = [e for e in store.entries(Filters(kind="fxgraph")) if e.ref == graph]
    assert len(fx) == 2
    newest = min(fx, key=lambda e: (-e.mtime, e.key))  # the newest; a tie goes by key
    for spec in (graph, graph[:10], fx[0].key[: len("fxgraph/xx/") + 12]):  # graph key, its prefix, a path prefix
        m = store.resolve(spec)
        assert set(m.entries) == set(fx) and m.ref == graph and m.graph == graph and m.entries[0] == newest
    e = fx[0]
    file = e.key.rsplit("/", 1)[1]
    for spec in (e.key, f"{graph[:13]}/{file[:6]}", f"{graph[:8]}/{file[:8]}", e.key[: len(e.key) - 5]):
        assert store.resolve(spec).entries == (e,), spec  # explain's old 'graph/file' form included
    with pytest.raises(AmbiguousKey) as raised:
        store.resolve("triton/0/")
    assert len(raised.value.candidates) == 10 and raised.value.more and raised.value.exit_code == 2
    assert "is a prefix of more than 10 keys" in str(raised.value)
    with pytest.raises(NotFound) as unknown:
        store.resolve("fzzzzzzzzzzz")
    assert unknown.value.exit_code == 3
    with pytest.raises(NotFound, match="at least 4 characters"):
        store.resolve("f")
    with pytest.raises(UsageError):
        store.resolve("  ")
    db.close()


def test_unique_prefix():
    names = sorted(["abcdefgh12", "abcdefgh34", "abcdefgX", "zz"])
    assert unique_prefix("abcdefgh12", names) == "abcdefgh1"
    assert unique_prefix("abcdefgX", names) == "abcdefgX"
    assert unique_prefix("zz", names) == "zz"  # shorter than the minimum: whole
    assert unique_prefix("abc", ["abc", "abcdefghijkl"]) == "abc"  # a prefix of another: whole


def test_a_short_key_never_ends_inside_an_escape():
    """Keys of odd names were cut mid-escape: `fr6kjgbd/bad%FF%F`, `f%2541%F`."""
    assert unique_prefix("bad%FF%FEx", ["4ob6gdf6xl", "bad%FF%FEx"]) == "bad%FF%FE"
    assert unique_prefix("f%2541%FFx", ["f%2541%FFx", "f%2541%FFy"]) == "f%2541%FFx"
    assert unique_prefix("f%2541%FFabc", ["f%2541%FFabc", "fb"]) == "f%2541%FF"
    assert unique_prefix("abc%41%42", ["abc%41%42", "abc%41%43"]) == "abc%41%42"


def test_pins(fixture_cache, cli_for, db_url):
    root = fixture_cache()
    db, store, _ = scanned(cli_for, root, db_url)
    fx = store.entries(Filters(kind="fxgraph"))[0]
    assert store.add_pin(fx.ref, "prod", now=100.0) is None
    before = store.add_pin(fx.ref, None)
    assert before is not None and before.reason == "prod"  # kept: no reason given
    assert store.add_pin(fx.ref, "canary").reason == "prod" and store.pin_map() == {fx.ref: "canary"}
    assert store.add_pin("f" + "q" * 51, None) is None
    pins = {p.key: p for p in store.pins()}
    assert pins[fx.ref].entries == len(store.resolve(fx.ref).entries) and pins["f" + "q" * 51].entries == 0
    pinned = store.entries(Filters(pinned=True))
    assert {e.key for e in pinned} == {e.key for e in store.resolve(fx.ref).entries}
    assert all(e.pin == fx.ref and e.pin_reason == "canary" for e in pinned)
    assert store.remove_pin(fx.ref) and not store.remove_pin(fx.ref)
    db.close()


def test_filters_match_a_python_filter(fixture_cache, cli_for, db_url):
    root = fixture_cache("h200-2.11")
    db, store, _ = scanned(cli_for, root, db_url)
    every = store.entries(Filters(locks=True, sort="name"))
    now = time.time()
    assert [e.key for e in store.entries(Filters(kind="triton", larger_than=20_000, sort="name"))] == [
        e.key for e in every if e.kind == "triton" and e.bytes > 20_000
    ]
    assert [e.bytes for e in store.entries(Filters())] == sorted(
        (e.bytes for e in every if e.kind != "lock"), reverse=True
    )
    idle = [e.key for e in every if e.last_access <= now - 60]
    assert sorted(e.key for e in store.entries(Filters(older_than=60, locks=True), now=now)) == sorted(idle)
    fx = [e for e in every if e.kind == "fxgraph"]
    assert [e.key for e in store.entries(Filters(graphs=frozenset({fx[0].graph_key})))] == [fx[0].key]
    costly = store.entries(Filters(kind="fxgraph", sort="cost"))
    assert [e.compile_seconds for e in costly] == sorted((e.compile_seconds for e in fx), reverse=True)
    db.close()


def test_model_usage_and_graphs(fixture_cache, cli_for, db_url):
    root = fixture_cache("h200-2.11")
    db, store, _ = scanned(cli_for, root, db_url)
    fx = store.entries(Filters(kind="fxgraph", sort="name"))
    with pytest.raises(NotFound, match="the shapes table is empty"):
        store.model_graphs("mlp")
    sig = next(e.signature for e in fx if e.signature and e.signature.startswith("f32[8, 256]"))
    path = db_url.split(":///", 1)[1]
    with sqlite3.connect(path) as c:  # what cachemgr.record writes: one row per call signature seen
        c.execute(
            "INSERT INTO shapes (model, signature_hash, signature, spec, options, count, first_seen, last_seen) "
            "VALUES ('mlp', 'x', ?, '[]', '{}', 2, 0, 0)",
            (sig.split(";")[0].split("(")[0],),
        )
    graphs = store.model_graphs("mlp")
    assert graphs and graphs <= {e.graph_key for e in fx}
    (usage,) = store.model_usage()
    assert asdict(usage)["model"] == "mlp" and usage.graphs == len(graphs)
    own = sum(e.bytes for e in fx if e.graph_key in graphs)
    assert usage.bytes > own  # its graphs and what they need (kernels, modules, AOT entries)
    db.close()


NO_SQLALCHEMY = """
import sys
from cachemgr import explain, layout
from cachemgr.index import Filters, Store
from cachemgr.index.revision import HEAD_REVISION
store = Store.sqlite(sys.argv[1], HEAD_REVISION, sys.argv[2], sys.argv[3])
assert store is not None
store.totals(); store.entries(Filters()); explain.activity(store, 1e9); store.resolve(sys.argv[4])
assert "sqlalchemy" not in sys.modules, "sqlalchemy was imported"
print("ok")
"""


def test_the_stdlib_driver_needs_no_sqlalchemy(fixture_cache, cli_for, db_url):
    root = fixture_cache()
    cli = cli_for(root)
    cli("scan")
    short = cli.json("ls", "--kind", "fxgraph")[0]["short"]
    r = subprocess.run(
        [sys.executable, "-c", NO_SQLALCHEMY, db_url.split(":///", 1)[1], HOST, str(root), short],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_mark_loaded(fixture_cache, cli_for, db_url):
    """What `cachemgr import` wrote is loaded, not compiled, once it says so."""
    root = fixture_cache()
    db, store, _ = scanned(cli_for, root, db_url)
    before = explain.activity(store, 3650 * 86400)
    events = store.compile_events()
    assert before.compiles == len(events) > 1 and before.loaded == 0
    assert store.mark_loaded([events[0].key]) == 1 and store.mark_loaded([events[0].key]) == 0
    after = explain.activity(store, 3650 * 86400)
    assert (after.compiles, after.loaded) == (before.compiles - 1, 1)
    assert [e.loaded for e in store.compile_events()] == [True] + [False] * (len(events) - 1)
    db.close()
