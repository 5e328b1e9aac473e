"""Every command takes every key form any command prints (entry key, graph key, short key, unique
prefix, explain's old 'graph/file' form): show, pin, unpin, purge --key/--graph, ls --graph, diff,
explain --graph. Real caches (the H200 fixture, plus a second guard set and a second device), no
compile."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.slow  # every command as a real process, for every key form


@pytest.fixture
def world(fixture_cache, cli_for):
    root = fixture_cache("h200-2.11")
    fx = sorted(root.glob("fxgraph/*/*/*"))[0]
    shutil.copy2(fx, fx.with_name("zz" + fx.name[2:]))  # one graph, two guard sets
    kernel = sorted((root / "triton" / "0").iterdir())[0]
    shutil.copytree(kernel, root / "triton" / "1" / kernel.name)  # one kernel, two devices
    cli = cli_for(root)
    cli("scan")
    return cli, fx.parent.name


def printed_forms(cli, graph: str) -> dict[str, set[str]]:
    """key -> every form of it some command printed."""
    forms: dict[str, set[str]] = {}

    def saw(key: str, form: str) -> None:
        forms.setdefault(key, set()).add(form)

    rows = cli.json("ls")
    for e in rows:  # ls --json: key, short, graph key
        saw(e["key"], e["key"])
        saw(e["key"], e["short"])
    table = cli("ls").stdout.splitlines()[1:-1]  # ls for people, -q, --wide: the same keys
    quiet = cli("ls", "-q").stdout.split()
    wide = [line.split()[0] for line in cli("ls", "--wide").stdout.splitlines()[1:-1]]
    by_short = {e["short"]: e["key"] for e in rows}
    assert [line.split()[0] for line in table] == quiet and set(quiet) == set(by_short)
    assert set(wide) == {e["key"] for e in rows if e["kind"] != "lock"}
    doc = cli.json("explain", "--since", "3650d", "--limit", "100")
    for m in doc["misses"]:  # explain: the short key, the nearest's, and the old 'graph/file' form
        saw(m["key"], m["short"])
        gk, file = m["key"].split("/")[2:]
        saw(m["key"], f"{gk[:13]}/{file[:6]}")
        for c in m["nearest"]:
            saw(c["key"], c["short"])
    shown = cli.json("show", graph)  # a graph key: every entry of it
    assert len(shown["entries"]) == 2 and shown["key"] == shown["entries"][0]["key"]
    for d in shown["entries"]:
        saw(d["key"], d["short"])
    cli("pin", graph)
    (p,) = cli.json("pin")
    assert p["key"] == graph and p["entries"] == 2 and p["short"] == graph[:8]
    cli("unpin", p["short"])
    return forms


def test_each_command_takes_every_printed_form(world):
    cli, graph = world
    forms = printed_forms(cli, graph)
    rows = {e["key"]: e for e in cli.json("ls")}
    fxgraph = [k for k in forms if rows[k]["kind"] == "fxgraph"]
    twin = [k for k in fxgraph if rows[k]["graph_key"] == graph]
    single = next(k for k in fxgraph if rows[k]["graph_key"] != graph)
    other_kinds = [next(k for k in forms if rows[k]["kind"] == kind) for kind in ("triton", "code", "aotautograd")]
    other = rows[single]["short"]
    for key in [*twin, single, *other_kinds]:
        e = rows[key]
        for form in sorted(forms[key]):
            shown = cli.json("show", form)
            assert key in [d["key"] for d in shown["entries"]], form
            assert "pinned" in cli("pin", form).stdout
            assert "unpinned" in cli("unpin", form).stdout
            plan = cli.json("purge", "--key", form, "--dry-run", "--grace", "0")
            assert key in {x["key"] for x in plan["entries"]}, form
            graph_of = e["graph_key"] or e["ref"]
            listed = cli.json("ls", "--graph", form)
            assert key in {x["key"] for x in listed} and {x["graph_key"] or x["ref"] for x in listed} == {graph_of}
            plan = cli.json("purge", "--graph", form, "--dry-run", "--grace", "0")
            assert key in {x["key"] for x in plan["entries"]}, form
            if e["kind"] == "fxgraph":
                d = cli.json("diff", form, other)
                assert d["a"]["graph_key"] == e["graph_key"]
                doc = cli.json("explain", "--since", "3650d", "--graph", form)
                assert {m["graph_key"] for m in doc["misses"]} == {e["graph_key"]}
            else:
                r = cli.proc("diff", form, other)
                assert r.returncode == 2 and "only fxgraph entries have hash components" in r.stderr
    assert cli.json("ls") == list(rows.values())  # dry runs and pin/unpin changed nothing


def test_ambiguous_and_unknown(world):
    cli, graph = world
    r = cli.proc("show", "triton/0/")
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert lines[0] == "cachemgr: error: 'triton/0/' is ambiguous: it is a prefix of more than 10 keys; give more of it"
    assert lines[1] == "cachemgr: the candidates are:" and len(lines) == 2 + 10 + 1 and lines[-1] == "  ..."
    shorts = {e["short"] for e in json.loads(cli.proc("ls", "--json").stdout)}
    assert all(line.split()[0] in shorts for line in lines[2:-1])
    for args in (["show"], ["pin"], ["purge", "--dry-run", "--key"], ["ls", "--graph"], ["explain", "--graph"]):
        r = cli.proc(*args, "fzzzzzzzzzzzzz")
        assert r.returncode == 3 and "no entry 'fzzzzzzzzzzzzz'" in r.stderr and r.stderr.count("\n") == 1, args
        r = cli.proc(*args, "triton/0/")
        assert r.returncode == 2 and "is ambiguous" in r.stderr, args
    assert cli.proc("diff", "fzzzzzzzzzzzzz", graph).returncode == 3
    assert cli.proc("unpin", graph).returncode == 3  # not pinned
