"""The Redis tier against the real Redis and real torch.compile processes: what cachemgr pushes,
Inductor reads as a remote hit; eviction; failures as one line and an exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import OWN_PEAK_RSS_PROGRAM, Cli, run_program, subprocess_env
from test_daemon import start, wait_until  # noqa: F401 - start: a fixture (daemon processes)
from test_fleet import pg_url  # noqa: F401 - fixture: a throwaway PostgreSQL database
from test_index import INSPECT_WITHOUT_TORCH

# The caches of the hosts that compile (or hit in Redis) start with the C++ builds this venv made
# for the same compile_models.py workload (conftest.Builds): no entry, so every hit and miss
# below is torch's own.


@pytest.fixture
def rconn(redis_url):
    import redis

    return redis.Redis.from_url(redis_url)


def remote_cli(cli: Cli, url: str):
    """`cachemgr remote --redis URL ...` through the Cli helper, in process."""
    return lambda *args, code=0: cli("remote", "--redis", url, *args, code=code)


def remote_json(cli: Cli, url: str, *args):
    return json.loads(cli("remote", "--redis", url, *args, "--json").stdout)


def torch_keys(r) -> list[str]:
    return sorted(k.decode() for k in r.scan_iter(match="pt2:*"))


def test_key_and_value_are_torchs_own(tmp_path):
    """The format comes from the installed torch: its RedisRemoteCache key and JSON serde."""
    from torch._inductor.remote_cache import RemoteAOTAutogradCache, RemoteCacheJsonSerde, RemoteFxGraphCache

    from cachemgr.fleet.remote import AOT_CACHE_ID, FX_CACHE_ID, decode_value, encode_value, parse_key, redis_key

    fx, aot = "fabcdefghijklmnopqrstuvwxyz234567abcdefghijklmnopqrs", "a" + "b" * 51
    assert redis_key(FX_CACHE_ID, fx) == RemoteFxGraphCache(FX_CACHE_ID)._get_key(fx)
    assert redis_key(AOT_CACHE_ID, aot) == RemoteAOTAutogradCache(AOT_CACHE_ID)._get_key(aot)
    assert parse_key(redis_key(FX_CACHE_ID, fx)) == ("fxgraph", FX_CACHE_ID, fx)
    assert parse_key(redis_key("0123abcd", "k"))[0] == "autotune" and parse_key("other:key") is None
    content = bytes(range(256)) * 3
    import base64

    torch_value = RemoteCacheJsonSerde().encode(
        {"data": base64.b64encode(content).decode("ascii"), "time_taken_ms": 42}
    )
    assert encode_value(content, 42) == torch_value and decode_value(torch_value) == content


def test_push_gives_a_fresh_host_remote_hits(cpu_cache, cli_for, redis_url, rconn, tmp_path, cpp_builds):
    """Process A compiled into cache A (the session's cache); `cachemgr remote push` publishes it;
    process B with an empty cache B and the remote FX graph cache on hits every graph."""
    a = cli_for(cpu_cache, host="host-a")
    r = a.proc("remote", "--redis", redis_url, "push", "--json")
    assert r.returncode == 0, r.stderr
    pushed = json.loads(r.stdout)
    fx_keys = {e["graph_key"] for e in a.json("ls", "--kind", "fxgraph")}
    assert pushed["pushed"] == len(fx_keys) + len(a.json("ls", "--kind", "aotautograd")) and pushed["present"] == 0
    assert {k for k in torch_keys(rconn) if k.startswith("pt2:fx-graph-v1::")} == {
        f"pt2:fx-graph-v1::{k}:c1" for k in fx_keys
    }
    # exactly what Inductor reads: the local entry file's bytes, base64 in JSON
    entry = a.json("ls", "--kind", "fxgraph")[0]
    doc = json.loads(rconn.get(f"pt2:fx-graph-v1::{entry['graph_key']}:c1"))
    import base64

    assert base64.b64decode(doc["data"]) == (cpu_cache / entry["key"]).read_bytes()
    assert doc["time_taken_ms"] == int(entry["compile_seconds"] * 1000)

    cache_b = tmp_path / "cache-b"
    cpp_builds.seed(cache_b, "compile_models")  # the session's cache's workload
    counters = run_program(cache_b, TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_REDIS_URL=redis_url)
    assert counters["fxgraph_cache_hit"] == len(fx_keys) and counters["fxgraph_cache_miss"] == 0, counters
    # the hits came from Redis: a remote hit writes no local fxgraph entry, and B had none
    assert not list(cache_b.glob("fxgraph/*/*/*"))
    # pushing again changes nothing
    again = json.loads(a("remote", "--redis", redis_url, "push", "--json").stdout)
    assert again["pushed"] == 0 and again["present"] == pushed["pushed"]


def test_push_one_graph(cpu_cache, cli_for, redis_url, rconn, tmp_path, cpp_builds):
    """--graph KEY publishes that graph alone; a fresh host running only that function hits it."""
    a = cli_for(cpu_cache)
    a("scan")
    infer = [e for e in a.json("ls", "--kind", "fxgraph") if e["signature"].startswith("f32[10]")]
    assert len(infer) == 1, [e["signature"] for e in a.json("ls", "--kind", "fxgraph")]
    key = infer[0]["graph_key"]
    # the AOT entry that names this graph travels with it (an AOT hit needs its graphs, and the
    # other way round a graph's AOT entry is what a fresh host looks up first)
    aot = [k.split("/")[1] for k in a.json("show", infer[0]["key"])["referenced_by"]]
    assert len(aot) == 1
    # a second guard set under the same key: Redis holds one value per key, the newest goes
    entry = cpu_cache / infer[0]["key"]
    # (another name: an entry's name is its content's hash, and 1 in 32 of them begins with "z")
    newer = entry.with_name(("z" if entry.name[0] != "z" else "y") + entry.name[1:])
    newer.write_bytes(entry.read_bytes())
    os.utime(newer, (entry.stat().st_atime, entry.stat().st_mtime + 10))
    out = a("remote", "--redis", redis_url, "push", "--graph", key).stdout
    assert out.startswith("pushed 2 entries (") and "0 already there" in out and "1 extra guard sets not pushed" in out
    meta = json.loads(rconn.hget("cachemgr:meta", f"pt2:fx-graph-v1::{key}:c1"))
    assert meta["source"] == str(newer.relative_to(cpu_cache))
    assert torch_keys(rconn) == sorted([f"pt2:fx-graph-v1::{key}:c1", f"pt2:autograd-experimental::{aot[0]}:c1"])
    had = cpp_builds.seed(tmp_path / "b", "compile_models --only infer")
    counters = run_program(
        tmp_path / "b", "--only", "infer", TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1", TORCHINDUCTOR_REDIS_URL=redis_url
    )
    cpp_builds.keep("compile_models --only infer", tmp_path / "b", had)
    assert counters["fxgraph_cache_hit"] == 1 and counters["fxgraph_cache_miss"] == 0, counters
    r = a.proc("remote", "--redis", redis_url, "push", "--graph", "fnosuchgraph")
    assert r.returncode == 3 and r.stderr.startswith(
        "cachemgr: error: no fxgraph or aotautograd entry for graph 'fnosuchgraph'"
    )


def test_push_aot_entries_with_their_graphs(tmp_path, cli_for, redis_url, rconn, cpp_builds):
    """AOTAutograd keys hash torch._functorch.config, which holds enable_remote_autograd_cache:
    the entries a fresh host with TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE=1 looks up are those a
    compile with that same setting wrote. Here A compiles so (its Redis unreachable: torch
    itself writes nothing), cachemgr pushes, B hits in both tiers."""
    cache_a = tmp_path / "a"
    had = cpp_builds.seed(cache_a, "compile_models --only mlp")
    counters = run_program(
        cache_a,
        "--only",
        "mlp",
        TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
        TORCHINDUCTOR_REDIS_URL="redis://127.0.0.1:1/0",
    )
    assert counters["autograd_cache_miss"] > 0 and torch_keys(rconn) == []
    cpp_builds.keep("compile_models --only mlp", cache_a, had)
    a = cli_for(cache_a)
    a("scan")
    aot = a.json("ls", "--kind", "aotautograd")
    # --graph with one AOT key takes the graphs it needs along
    needs = {r["ref"] for r in a.json("show", aot[0]["key"])["references"] if r["kind"] == "fxgraph"}
    one = json.loads(a("remote", "--redis", redis_url, "push", "--graph", aot[0]["key"].split("/")[1], "--json").stdout)
    assert one["pushed"] >= 1 + len(needs)
    assert {f"pt2:fx-graph-v1::{k}:c1" for k in needs} <= set(torch_keys(rconn))
    a("remote", "--redis", redis_url, "push")
    cpp_builds.seed(tmp_path / "b", "compile_models --only mlp")
    counters = run_program(
        tmp_path / "b",
        "--only",
        "mlp",
        TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE="1",
        TORCHINDUCTOR_REDIS_URL=redis_url,
    )
    assert counters["autograd_cache_hit"] == len(aot) and counters["autograd_cache_miss"] == 0, counters
    assert counters["fxgraph_cache_miss"] == 0, counters
    stats = remote_json(a, redis_url, "stats")
    assert stats["by_kind"]["aotautograd"]["entries"] == len(aot)


def test_remote_stats_by_kind(cpu_cache, cli_for, redis_url, rconn):
    a = cli_for(cpu_cache, host="host-a")
    empty = remote_json(a, redis_url, "stats")
    assert empty["entries"] == 0 and empty["bytes"] == 0
    rconn.set("unrelated", "x")
    a("remote", "--redis", redis_url, "push")
    s = remote_json(a, redis_url, "stats")
    assert s["by_kind"]["fxgraph"]["entries"] == len({e["graph_key"] for e in a.json("ls", "--kind", "fxgraph")})
    assert s["by_kind"]["aotautograd"]["entries"] == len(a.json("ls", "--kind", "aotautograd"))
    assert s["entries"] == len(torch_keys(rconn)) == s["pushed_by_cachemgr"]
    assert s["bytes"] == sum(rconn.memory_usage(k, samples=0) for k in torch_keys(rconn))
    assert s["other_keys"] == 2  # 'unrelated' and the test's claim key; cachemgr:meta is ours
    out = a("remote", "--redis", redis_url, "stats").stdout
    assert "fxgraph" in out and "aotautograd" in out and "total" in out


def _age(r, key: str, seconds: int) -> None:
    """Make a key look unread for `seconds` (RESTORE ... IDLETIME sets Redis's own LRU clock)."""
    dump = r.dump(key)
    r.restore(key, 0, dump, replace=True, idletime=seconds)


def test_remote_evict_age_and_size(cpu_cache, cli_for, redis_url, rconn):
    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    keys = torch_keys(rconn)
    fx = [k for k in keys if k.startswith("pt2:fx-graph-v1::")]
    aot = [k for k in keys if k.startswith("pt2:autograd-experimental::")]
    for k in keys:
        _age(rconn, k, 3600)  # everything read an hour ago...
    old_fx = fx[0]
    _age(rconn, old_fx, 40 * 86400)  # ...but one graph not for 40 days
    meta = {k.decode(): json.loads(v) for k, v in rconn.hgetall("cachemgr:meta").items()}
    needs_old = [k for k in aot if old_fx.split("::")[1][:-3] in meta[k]["refs"]]

    dry = remote_json(a, redis_url, "evict", "--max-age", "30d", "--dry-run")
    assert {v["rkey"] for v in dry["plan"]["victims"]} == {old_fx, *needs_old} and dry["result"] is None
    assert torch_keys(rconn) == keys  # a dry run deletes nothing
    done = remote_json(a, redis_url, "evict", "--max-age", "30d")
    assert done["result"]["deleted"] == 1 + len(needs_old)
    assert set(torch_keys(rconn)) == set(keys) - {old_fx, *needs_old}
    assert old_fx.encode() not in rconn.hkeys("cachemgr:meta")

    # size: least recently read first, down to low_water x max-size; AOT entries read longest ago
    left = torch_keys(rconn)
    order = [k for k in left if "fx-graph" in k] + [k for k in left if "autograd" in k]
    idle = {k: 7200 + 60 * i for i, k in enumerate(order)}
    for k, seconds in idle.items():
        _age(rconn, k, seconds)
    sizes = {k: rconn.memory_usage(k, samples=0) for k in left}
    cap = int(sum(sizes.values()) * 0.7)
    done = remote_json(a, redis_url, "evict", "--max-size", str(cap))
    remaining = torch_keys(rconn)
    assert remaining and sum(sizes[k] for k in remaining) <= cap * 0.9
    gone = [k for k in left if k not in remaining]
    assert done["result"]["freed_bytes"] == sum(sizes[k] for k in gone)
    size_victims = [v["rkey"] for v in done["plan"]["victims"] if v["reason"] == "size"]
    assert size_victims and min(idle[k] for k in size_victims) > max(idle[k] for k in remaining)
    assert "freed" in a("remote", "--redis", redis_url, "evict", "--max-age", "90d").stdout


def test_remote_evict_keeps_a_key_read_meanwhile(cpu_cache, cli_for, redis_url, rconn):
    from cachemgr.fleet.remote import Remote, plan_eviction

    cli_for(cpu_cache)("remote", "--redis", redis_url, "push")
    for k in torch_keys(rconn):
        _age(rconn, k, 10 * 86400)
    rem = Remote(redis_url)
    keys = rem.inspect()
    plan = plan_eviction(keys, rem.aot_refs(keys), max_size=None, max_age=86400)
    assert len(plan.victims) == len(keys)
    read = plan.victims[0].rkey
    rconn.get(read)  # an Inductor lookup between plan and delete
    result = rem.execute(plan)
    assert result.skipped_in_use == [read] and torch_keys(rconn) == [read]


def test_remote_evict_takes_the_aot_entries_of_the_graphs_it_deletes(cpu_cache, cli_for, redis_url, rconn):
    """AOT entries whose graphs cachemgr has not seen them need are read to learn it (as if
    Inductor had written them), which resets their idle time: the delete then took that for a
    read meanwhile, and kept every AOT entry of the graphs it deleted (they could only miss)."""
    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    keys = torch_keys(rconn)
    assert any("autograd" in k for k in keys) and any("fx-graph" in k for k in keys)
    rconn.delete("cachemgr:meta")
    for k in keys:
        _age(rconn, k, 7200)
    fx = [k for k in keys if "fx-graph" in k]
    for k in fx:
        _age(rconn, k, 3 * 86400)
    done = remote_json(a, redis_url, "evict", "--max-age", "1d")
    assert done["result"]["deleted"] == len(keys) and done["result"]["skipped_in_use"] == [], done
    assert torch_keys(rconn) == []


def test_remote_evict_parses_values_in_bounded_workers(cpu_cache, cli_for, redis_url, rconn):
    """An AOT value whose pickle takes about 800 MB to unpickle (14M one-item tuples: a 56 MB
    value) is parsed in a parse worker, under its memory bound: a skipped item with its reason,
    while a real AOT value beside it is read (its graphs learned). The command's own peak RSS
    stays far below what unpickling takes (1.1 GB when the command unpickled values itself)."""
    import base64

    from cachemgr.fleet.remote import AOT_CACHE_ID, encode_value, redis_key

    cli = cli_for(cpu_cache)
    aot = cli.json("ls", "--kind", "aotautograd")[0]
    needs = sorted(r["ref"] for r in cli.json("show", aot["key"])["references"] if r["kind"] == "fxgraph")
    real = redis_key(AOT_CACHE_ID, aot["key"].split("/")[1])
    rconn.set(real, encode_value((cpu_cache / aot["key"]).read_bytes(), 5))
    bomb = "pt2:autograd-experimental::bomb:c1"
    pickled = b"\x80\x02](" + b"K\x01\x85" * 14_000_000 + b"e."  # [(1,), (1,), ...]: 3 bytes each
    rconn.set(bomb, json.dumps({"data": base64.b64encode(pickled).decode(), "time_taken_ms": 5}))
    del pickled
    out = subprocess.run(
        [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *cli.base()]
        # (not a dry run, which reads no value: the grace period keeps these keys just written)
        + ["remote", "--redis", redis_url, "evict", "--max-size", "0", "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    why = {x["key"]: x["reason"] for x in json.loads(out.stdout)["skipped"]}
    assert list(why) == [bomb] and why[bomb].startswith("cannot read it: ") and "memory" in why[bomb], why
    meta = {k.decode(): json.loads(v) for k, v in rconn.hgetall("cachemgr:meta").items()}
    assert sorted(meta[real]["refs"]) == needs and needs and meta[bomb]["unreadable"] in why[bomb], meta
    rss = int(out.stderr.split("peak-rss-mib ")[-1].split()[0])
    assert rss < 400, f"the command itself peaked at {rss} MiB; {why}"


def test_remote_evict_keeps_young_keys(cpu_cache, cli_for, redis_url, rconn):
    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    n = len(torch_keys(rconn))
    plan = remote_json(a, redis_url, "evict", "--max-size", "1", "--dry-run")["plan"]
    assert plan["victims"] == [] and plan["kept_young"] == n  # just written: inside the grace period


@pytest.mark.parametrize(
    "url,message",
    [
        (
            "redis://127.0.0.1:1/0",
            "cannot reach Redis at redis://127.0.0.1:1/0: Error 111 connecting to 127.0.0.1:1. Connection refused.",
        ),
        (
            "redis://nobody:hunter2@127.0.0.1:6379/0",
            "Redis at redis://nobody:***@127.0.0.1:6379/0 refused our credentials: "
            "invalid username-password pair or user is disabled.",
        ),
    ],
)
@pytest.mark.parametrize("args", [["stats"], ["push"], ["evict", "--max-age", "1d"]])
def test_remote_failures_are_one_line(cpu_cache, cli_for, url, message, args):
    r = cli_for(cpu_cache).proc("remote", "--redis", url, *args)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 6 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"cachemgr: error: {message}") and "hunter2" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "url,why",
    [
        ("redis://{server}/abc", "'abc' is not a database number"),  # redis-py: db 0
        ("redis://{server}/1/3", "'1/3' is not a database number"),  # redis-py: db 13
        ("redis://{server}/-1", "'-1' is not a database number"),
        ("redis://{server}/0?db=x", "'x' is not a database number"),
        ("redis://{server}/1?db=2", "it names two databases"),
        ("redis://nobody:hunter2@{server}/x", "its database is not a database number"),
        ("http://{server}", "give redis://HOST:PORT/DB"),
        ("redis://127.0.0.1:port/0", "Port could not be cast to integer value"),
        # options that make redis-py hand back text, or that only rediss:// takes (each was exit 70)
        ("redis://{server}/13?decode_responses=true", "leave out decode_responses"),
        ("redis://{server}/13?Encoding=latin-1", "leave out encoding"),
        ("redis://{server}/13?encoding_errors=bogus", "leave out encoding_errors"),
        ("redis://{server}/13?ssl_cert_reqs=x", "ssl options need rediss://"),
        # options redis-py hands on as they are (each was exit 70, or 6 for protocol)
        ("redis://{server}/13?foo=bar", "unknown option 'foo' (cachemgr takes db, "),
        ("redis://{server}/13?DB=4", "unknown option 'DB'"),
        ("redis://{server}/13?password=hunter2&Db=3", "unknown option 'Db'"),
        ("redis://{server}/13?socket_timeout=-1", "socket_timeout: '-1' is not a number of seconds over 0"),
        ("redis://{server}/13?socket_timeout=nan", "socket_timeout: 'nan' is not a number of seconds"),
        ("redis://{server}/13?socket_connect_timeout=1e308", "'1e308' is not a number of seconds"),
        ("redis://{server}/13?protocol=9", "protocol: '9' is not 2 or 3"),
        ("redis://{server}/13?socket_keepalive=maybe", "socket_keepalive: 'maybe' is not true or false"),
    ],
)
def test_a_bad_redis_url_is_a_usage_error(tmp_path, db_url, redis_url, url, why):
    """A Redis URL redis-py would read as another database than it says (or not at all) is a
    one-line usage error before anything connects: `/abc` was db 0 (so `remote evict` with that
    typo deleted there). Only `stats` meets the real server here; `evict` an unreachable port."""
    from conftest import REDIS_HOST

    cli = Cli(tmp_path / "cache", db_url)
    for args, server in ((["stats"], REDIS_HOST), (["evict", "--max-age", "1d"], "127.0.0.1:1")):
        bad = url.format(server=server)
        for r in (
            cli.proc("remote", "--redis", bad, *args),
            cli.proc("remote", *args, env={"TORCHINDUCTOR_REDIS_URL": bad}),
        ):
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert r.returncode == 2 and len(lines) == 1 and not r.stdout, (bad, r.stdout, r.stderr)
            assert lines[0].startswith(f"cachemgr: error: bad Redis URL {bad.replace('hunter2', '***')}: "), lines
            assert why in lines[0] and "hunter2" not in r.stderr, lines
    # a db named twice, the same both times, is one database
    db = redis_url.rsplit("/", 1)[1]
    assert remote_json(cli, f"{redis_url}?db={db}", "stats")["url"] == f"{redis_url}?db={db}"
    # options cachemgr takes, their values as redis-py reads them
    good = f"{redis_url}?socket_timeout=5&socket_keepalive=True&protocol=2&client_name=cm"
    assert remote_json(cli, good, "stats")["url"] == good


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2/xyz@127.0.0.1:6379/13",  # read as a port
        "redis://:1234/Zx9hunter2@127.0.0.1:6379/13",  # read as the path: a database
        "redis://:1234?Zx9=hunter2@127.0.0.1:6379/13",  # read as an option
        "redis://:1234?socket_timeout=hunter2@127.0.0.1:6379/13",  # read as an option's value
        "redis://user:abc#hunter2@127.0.0.1:6379/13",  # read as a fragment, and the port
    ],
)
def test_a_bad_redis_url_never_quotes_its_password(tmp_path, db_url, url):
    """A password holding '/', '?' or '#' is parsed in part as the port, the path or an option:
    the reason quoted that part (the URL itself was redacted)."""
    r = Cli(tmp_path / "cache", db_url).proc("remote", "--redis", url, "stats")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("cachemgr: error: bad Redis URL"), r.stderr
    assert "hunter2" not in r.stderr and "percent-encoded" in r.stderr, r.stderr


def test_redis_url_from_inductors_env(cpu_cache, cli_for, redis_url):
    """With no --redis, cachemgr finds the Redis Inductor would use."""
    host, port_db = redis_url.removeprefix("redis://").split(":")
    port, db = port_db.split("/")
    cli = cli_for(cpu_cache)
    r = cli.proc("remote", "stats", "--json", env={"TORCHINDUCTOR_REDIS_URL": redis_url})
    assert r.returncode == 0 and json.loads(r.stdout)["url"] == redis_url, r.stderr
    r = cli.proc("remote", "stats", "--json", env={"TORCHINDUCTOR_REDIS_HOST": host, "TORCHINDUCTOR_REDIS_PORT": "1"})
    assert r.returncode == 6 and f"redis://{host}:1/0" in r.stderr
    # as Inductor reads them: int() takes ' 1 '; a '/' or '#' in either named another database
    r = cli.proc("remote", "stats", env={"TORCHINDUCTOR_REDIS_HOST": host, "TORCHINDUCTOR_REDIS_PORT": " 1 "})
    assert r.returncode == 6 and f"redis://{host}:1/0" in r.stderr
    odd = (("TORCHINDUCTOR_REDIS_PORT", f"{port}/{db}#"), ("TORCHINDUCTOR_REDIS_HOST", f"{host}:{port}/{db}#"))
    for name, value in odd:
        r = cli.proc("remote", "stats", env={name: value})
        assert r.returncode == 2 and r.stderr.startswith(f"cachemgr: error: {name} '{value}' is not a"), r.stderr
    r = cli.proc(
        "remote", "stats", "--json", env={"CACHEMGR_REDIS_URL": redis_url, "TORCHINDUCTOR_REDIS_URL": "redis://x:1"}
    )
    assert r.returncode == 0 and json.loads(r.stdout)["url"] == redis_url, r.stderr


def test_where_the_redis_url_comes_from_and_a_bad_config_with_redis_named(cpu_cache, cli_for, redis_url, tmp_path):
    """$CACHEMGR_REDIS_URL, then the config's redis_url, then $TORCHINDUCTOR_REDIS_URL (as help
    says: it said the config came first). A config file that is wrong is exit 2 whatever names the
    Redis: with --redis, `remote stats` never read it."""
    cli = cli_for(cpu_cache)
    config = tmp_path / "config.toml"
    config.write_text(f'redis_url = "{redis_url}"\n')
    elsewhere = "redis://127.0.0.1:1/13"
    r = cli.proc("--config", str(config), "remote", "stats", env={"CACHEMGR_REDIS_URL": elsewhere})
    assert r.returncode == 6 and "127.0.0.1:1" in r.stderr, r.stderr
    r = cli.proc("--config", str(config), "remote", "stats", "--json", env={"TORCHINDUCTOR_REDIS_URL": elsewhere})
    assert r.returncode == 0 and json.loads(r.stdout)["url"] == redis_url, r.stderr
    help_text = " ".join(cli.proc("remote", "--help").stdout.split())
    assert "$CACHEMGR_REDIS_URL, redis_url in the config, $TORCHINDUCTOR_REDIS_URL" in help_text, help_text
    config.write_text('max_size = "bogus"\n')
    for args in (["--redis", redis_url, "stats"], ["--redis", redis_url, "evict", "--max-age", "1d", "--dry-run"]):
        r = cli.proc("--config", str(config), "remote", *args)
        assert r.returncode == 2 and "invalid size 'bogus'" in r.stderr and not r.stdout, (args, r.stderr)


def test_remote_commands_on_postgres_index(cpu_cache, pg_url, redis_url, rconn):  # noqa: F811
    cli = Cli(cpu_cache, pg_url, host="pg-host")
    r = cli.proc("remote", "--redis", redis_url, "push", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["pushed"] == len(torch_keys(rconn)) > 0, r.stderr
    assert remote_json(cli, redis_url, "stats")["entries"] == len(torch_keys(rconn))
    assert remote_json(cli, redis_url, "evict", "--max-age", "1d")["result"]["deleted"] == 0


def test_push_by_model(cpu_cache, cli_for, redis_url, rconn, db_url):
    """--model NAME: the graphs whose input signature was recorded for that model."""
    import time

    from sqlalchemy import insert

    from cachemgr.index.db import Database
    from cachemgr.index.models import Shape

    a = cli_for(cpu_cache)
    a("scan")
    r = a.proc("remote", "--redis", redis_url, "push", "--model", "ranker")
    assert r.returncode == 3 and "no recorded shapes for model 'ranker'" in r.stderr
    scaled = [e for e in a.json("ls", "--kind", "fxgraph") if e["signature"].startswith("f32[6, 5]")]
    assert len(scaled) == 1
    db = Database(db_url)
    with db.engine.begin() as conn:
        # the call signature cachemgr.record writes for scaled(torch.randn(6, 5))
        conn.execute(
            insert(Shape),
            [
                {
                    "model": "ranker",
                    "signature_hash": "0123456789abcdef",
                    "signature": "(f32[6,5])",
                    "spec": "{}",
                    "options": "{}",
                    "first_seen": time.time(),
                    "last_seen": time.time(),
                }
            ],
        )
    db.close()
    doc = json.loads(a("remote", "--redis", redis_url, "push", "--model", "ranker", "--json").stdout)
    aot = [k.split("/")[1] for k in a.json("show", scaled[0]["key"])["referenced_by"]]
    assert doc["pushed"] == 2 and torch_keys(rconn) == sorted(
        [f"pt2:fx-graph-v1::{scaled[0]['graph_key']}:c1", f"pt2:autograd-experimental::{aot[0]}:c1"]
    )


@pytest.mark.parametrize(
    "args", [["remote", "stats"], ["remote", "evict", "--max-age", "1d"], ["fleet", "report"], ["stats", "--fleet"]]
)
def test_fleet_commands_never_import_torch(cpu_cache, db_url, redis_url, args):
    base = ["--cache-dir", str(cpu_cache), "--db", db_url]
    env = subprocess_env()
    subprocess.run([sys.executable, "-m", "cachemgr", *base, "scan"], env=env, check=True, capture_output=True)
    if args[0] == "remote":
        args = ["remote", "--redis", redis_url, *args[1:]]
    out = subprocess.run(
        [sys.executable, "-c", INSPECT_WITHOUT_TORCH, *base, *args], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


def test_push_reads_are_not_hits(gpu_cache, start, cli_for, redis_url):  # noqa: F811 - start: the fixture
    """A running daemon counts a workload's reads of fxgraph entries as hits; `remote push` reads
    every entry it publishes, and none of those may count (they would skew LRU and the hit ratio)."""
    start(gpu_cache)
    cli = cli_for(gpu_cache)  # the daemon's host and index
    fx = cli.json("ls", "--kind", "fxgraph")
    assert len(fx) == 6 and not any(r["hit_count"] for r in fx)
    assert cli("remote", "--redis", redis_url, "push").stdout.startswith("pushed ")
    # a workload's read after the push: once it is counted, the push's reads have been seen too
    (gpu_cache / fx[0]["key"]).read_bytes()
    rows = wait_until(lambda: [r for r in cli.json("ls", "--kind", "fxgraph") if r["hit_count"]], timeout=30)
    assert [(r["key"], r["hit_count"]) for r in rows] == [(fx[0]["key"], 1)]


def test_remote_evict_with_a_meta_key_that_is_not_a_hash(cpu_cache, cli_for, redis_url, rconn):
    """Any client may SET cachemgr:meta to a string: eviction leaves it alone and deletes all it
    planned (the script's HDEL failed after its first UNLINK: exit 6, one key a run)."""
    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    keys = torch_keys(rconn)
    for k in keys:
        _age(rconn, k, 3600)
    rconn.delete("cachemgr:meta")
    rconn.set("cachemgr:meta", "hostile")
    done = remote_json(a, redis_url, "evict", "--max-age", "1m")
    # (with no meta, the AOT values were read to learn their graphs: they go with them all the same)
    assert done["result"]["deleted"] == len(keys) and torch_keys(rconn) == []
    assert rconn.get("cachemgr:meta") == b"hostile"


def test_remote_memory_stays_bounded_with_huge_names_and_meta_fields(tmp_path, db_url, redis_url, rconn):
    """Redis allows names and hash fields of 512 MB. Key names over 1024 bytes stay on the server
    (only their size and first bytes come back), and a meta field's size is asked before it is
    read: `remote stats` held every name, and every field whole (peak RSS ~100 MB a 30 MB name)."""
    big = 30 << 20
    names = [f"pt2:fx-graph-v1::{c * big}:c1" for c in "abc"]
    for name in names:
        rconn.set(name, "x")
    ok = "pt2:fx-graph-v1::fshort:c1"
    rconn.set(ok, "x")
    rconn.hset("cachemgr:meta", ok, "{" + " " * (2 * big) + "}")
    cli = Cli(tmp_path / "cache", db_url)
    out = subprocess.run(
        [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *cli.base(), "remote", "--redis", redis_url, "stats", "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    rconn.delete(*names, "cachemgr:meta")
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    why = {x["key"]: x["reason"] for x in doc["skipped"]}
    assert doc["entries"] == 1 and why == {
        **{
            f"pt2:fx-graph-v1::{c * 283}...": f"key of {big + 20} bytes, over the 1024 a torch key may have"
            for c in "abc"
        },
        ok: f"cachemgr:meta: meta field of {2 * big + 2} bytes, over the 65536 cachemgr reads; ignored",
    }, why
    rss = int(out.stderr.split("peak-rss-mib ")[-1].split()[0])
    assert rss < 80, f"the command peaked at {rss} MiB"


def test_remembered_refs_beyond_an_aot_entrys_are_not_held(tmp_path, db_url, redis_url, rconn):
    """A meta field under its 64 KiB of short refs ('"07",' x 12,900) is 12,900 str objects once
    parsed, and every field was held: 1,000 such fields took `remote evict --dry-run` to 1 GB
    (16x what Redis held). A field naming more graphs than an AOT entry needs is ignored."""
    doc = '{"refs": [' + ",".join(f'"{i % 100:02d}"' for i in range(12900)) + "]}"
    keys = [f"pt2:autograd-experimental::a{i:051d}:c1" for i in range(300)]
    p = rconn.pipeline()
    for k in keys:
        p.set(k, b'{"data": "AAAA"}')
        p.hset("cachemgr:meta", k, doc)
    p.execute()
    cli = Cli(tmp_path / "cache", db_url)
    try:
        out = subprocess.run(
            [sys.executable, "-c", OWN_PEAK_RSS_PROGRAM, *cli.base(), "remote", "--redis", redis_url, "evict"]
            + ["--max-age", "30d", "--dry-run", "--json"],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        rconn.delete(*keys, "cachemgr:meta")
    assert out.returncode == 0, out.stderr[-3000:]
    why = [x["reason"] for x in json.loads(out.stdout)["skipped"] if x["key"] == keys[0]]
    assert any(w.startswith("cachemgr:meta: 'refs' lists 12900 graphs") for w in why), why
    rss = int(out.stderr.split("peak-rss-mib ")[-1].split()[0])
    assert rss < 80, f"the command peaked at {rss} MiB"


def test_a_dry_run_changes_nothing_in_redis(redis_url, rconn):
    """A dry run (learn=False) neither reads an AOT value (a read resets its idle time, and so
    what the next real run decides) nor writes cachemgr:meta (it overwrote hostile fields)."""
    from cachemgr.fleet.remote import Remote

    known, unknown = "pt2:autograd-experimental::aknown:c1", "pt2:autograd-experimental::aunknown:c1"
    for k in (known, unknown):
        rconn.set(k, "not a value")
        _age(rconn, k, 3600)
    rconn.hset("cachemgr:meta", mapping={known: json.dumps({"refs": ["fgraph"]}), unknown: "hostile"})
    before = rconn.hgetall("cachemgr:meta")
    rem = Remote(redis_url)
    skipped: list = []
    assert rem.aot_refs(rem.inspect(), skipped, learn=False) == {known: ["fgraph"], unknown: []}
    assert [x.reason for x in skipped] == [
        "cachemgr:meta: not a remote-cache meta field: not JSON; ignored",
        "the graphs it needs are not known yet: a dry run reads no value",
    ]
    assert rconn.hgetall("cachemgr:meta") == before
    assert rconn.object("idletime", known) >= 3600 and rconn.object("idletime", unknown) >= 3600
    # a real run reads it once (touched), and remembers it cannot be read
    rem.aot_refs(rem.inspect(), learn=True)
    assert rconn.object("idletime", unknown) < 3600
    assert "unreadable" in json.loads(rconn.hget("cachemgr:meta", unknown))


@pytest.fixture
def fake_redis():
    """serve_with(answer): the URL of a local server that speaks just enough RESP: each command (its
    arguments, bytes) gets what `answer` gives it, piece by piece (a number: seconds to wait)."""
    import socket
    import threading
    import time

    listeners = []

    def serve_with(answer) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)

        def serve(conn):
            with conn, conn.makefile("rb") as f:
                try:
                    while head := f.readline():
                        args = [f.read(int(f.readline()[1:]) + 2)[:-2] for _ in range(int(head[1:]))]
                        for piece in answer(args):
                            time.sleep(piece) if isinstance(piece, float) else conn.sendall(piece)
                except OSError:
                    pass  # the client went away

        def accept():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"redis://127.0.0.1:{listener.getsockname()[1]}/0"

    yield serve_with
    for listener in listeners:
        listener.close()


def test_a_trickling_redis_times_out(tmp_path, db_url, fake_redis):
    """A server that answers each command with a bulk string one byte at a time never meets a
    per-read socket timeout: `remote stats` waited forever. The URL's socket_timeout bounds the
    whole answer: exit 6 and one line."""
    url = fake_redis(lambda args: [b"$1000000\r\n"] + [0.2, b"x"] * 1000)
    cli = Cli(tmp_path / "cache", db_url)
    r = cli.proc("remote", "--redis", f"{url}?socket_timeout=1", "stats", timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 6 and len(lines) == 1 and not r.stdout, r.stderr
    assert lines[0] == f"cachemgr: error: Redis at {url}?socket_timeout=1 timed out: no whole answer within 1 s"


def test_an_endless_scan_ends_at_the_budget(fake_redis):
    """A server whose SCAN cursor never comes back to 0: the command stops when its Redis time
    is spent, with a RemoteError (exit 6), not a loop for ever."""
    from cachemgr.errors import RemoteError
    from cachemgr.fleet.remote import Remote

    answers = {b"HELLO": b"-ERR unknown command\r\n", b"EVALSHA": b"*3\r\n$1\r\n7\r\n*0\r\n*0\r\n"}  # cursor 7
    url = fake_redis(lambda args: [answers.get(args[0], b"+OK\r\n")])
    with pytest.raises(RemoteError, match=r"^Redis at .* took 0.5 s of this command in all: stopped$"):
        Remote(url, budget=0.5).stats()


def test_a_call_cut_short_by_the_commands_budget_says_the_budget(fake_redis):
    """A call whose time is what was left of the command's budget (here all of it: the budget is
    under the call's own timeout) and runs out says the budget ran out, not that Redis gave no
    whole answer within some fraction of a second (a CI run: 'within 0.0003682 s')."""
    from cachemgr.errors import RemoteError
    from cachemgr.fleet.remote import Remote

    url = fake_redis(lambda args: [b"-ERR unknown command\r\n"] if args[0] == b"HELLO" else [5.0])
    with pytest.raises(RemoteError, match=r"^Redis at .* took 0.3 s of this command in all: stopped$"):
        Remote(url, timeout=30, budget=0.3).stats()


def test_an_lfu_policy_keeps_no_idle_times(fake_redis):
    """Under an LFU maxmemory-policy OBJECT IDLETIME is an error: every key read as gone (0
    entries, nothing said). Now each counts, as just read, and one note says why. (A server of
    our own: the shared Redis's policy is not ours to change.)"""
    from cachemgr.fleet.remote import Remote, plan_eviction

    key = b"pt2:fx-graph-v1::fk:c1"
    scans = {
        b"pt2:*": b"*3\r\n$1\r\n0\r\n*1\r\n$22\r\n" + key + b"\r\n*0\r\n",
        b"cachemgr:*": b"*3\r\n$1\r\n0\r\n*0\r\n*0\r\n",
    }
    lfu = b"-ERR An LFU maxmemory policy is selected, idle time not tracked.\r\n"

    def answer(args):
        name = args[0].upper()
        if name == b"EVALSHA":
            return [scans[args[4]]]
        if name == b"TYPE":
            return [b"+none\r\n" if args[1] == b"cachemgr:meta" else b"+string\r\n"]
        return [
            {b"HELLO": b"-ERR unknown command\r\n", b"MEMORY": b":100\r\n", b"OBJECT": lfu, b"DBSIZE": b":1\r\n"}.get(
                name, b"+OK\r\n"
            )
        ]

    rem = Remote(fake_redis(answer))
    s = rem.stats()
    assert (s.entries, s.bytes, s.other_keys, s.max_idle_seconds) == (1, 100, 0, None)
    assert [(x.key, x.reason.split(":")[0]) for x in s.skipped] == [
        ("OBJECT IDLETIME", "Redis keeps no idle times under an LFU maxmemory-policy")
    ]
    keys = rem.inspect()
    assert [(k.rkey, k.idle) for k in keys] == [(key.decode(), 0)]
    plan = plan_eviction(keys, {}, max_size=0, max_age=0)
    assert plan.victims == () and plan.kept_young == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"+OK\r\n",
        b":5\r\n",
        b"*1\r\n:1\r\n",
        b"*3\r\n:0\r\n*1\r\n:1\r\n*0\r\n",
        b"*1\r\n" * 100_000 + b":1\r\n",  # nested deeper than Python recurses (redis-py's parser: RecursionError)
    ],
)
def test_a_server_that_is_not_redis_is_exit_6(tmp_path, db_url, fake_redis, answer):
    """A server answering every command with one thing Redis would not (redis-py read +OK for its
    handshake's map, or our SCAN step's list): `remote stats` was exit 70 (AttributeError)."""
    url = fake_redis(lambda args: [answer]) + ("?protocol=2" if answer.startswith(b"*3") else "?protocol=3")
    r = Cli(tmp_path / "cache", db_url).proc("remote", "--redis", url, "stats", timeout=60)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 6 and len(lines) == 1 and not r.stdout, r.stderr
    assert lines[0].startswith(f"cachemgr: error: Redis at {url} answered what Redis would not: "), lines


def test_remote_evict_dry_run_writes_nothing(tmp_path, db_url, redis_url, rconn):
    """A dry run read AOT values (resetting their idle times) and wrote what it learned into
    cachemgr:meta: the next real run then decided otherwise. It changes nothing in Redis."""
    k = "pt2:autograd-experimental::adry:c1"
    rconn.set(k, "not a value")
    _age(rconn, k, 3600)
    doc = remote_json(Cli(tmp_path / "cache", db_url), redis_url, "evict", "--max-age", "1d", "--dry-run")
    assert doc["skipped"] == [{"key": k, "reason": "the graphs it needs are not known yet: a dry run reads no value"}]
    assert rconn.object("idletime", k) >= 3600 and not rconn.exists("cachemgr:meta")


def test_an_answer_larger_than_redis_would_give_is_refused(tmp_path, db_url, fake_redis):
    """A server announcing a bulk string of 3 GB and sending it as fast as it can: redis-py read it
    all into memory (5.6 GiB before the timeout). A round trip stops at MAX_ANSWER bytes: exit 6."""
    from cachemgr.fleet.remote import MAX_ANSWER

    chunk = b"x" * (1 << 20)
    url = fake_redis(lambda args: [b"$3000000000\r\n"] + [chunk] * (MAX_ANSWER // len(chunk) + 8))
    r = Cli(tmp_path / "cache", db_url).proc("remote", "--redis", f"{url}?protocol=2", "stats", timeout=120)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 6 and len(lines) == 1, r.stderr
    assert lines[0].endswith(f"answered what Redis would not: over {MAX_ANSWER} bytes in one answer"), lines


def test_an_answer_read_into_a_buffer_is_counted_too(monkeypatch):
    """redis-py's hiredis parser reads with recv_into, not recv: the cap on one round trip's
    bytes must hold for it as well."""
    import socket

    from cachemgr.fleet import remote

    monkeypatch.setattr(remote, "MAX_ANSWER", 100)
    a, b = socket.socketpair()
    with a, b:
        counted = remote._CountingSocket(a, remote._Received())
        b.sendall(b"x" * 150)
        buf = bytearray(64)
        assert counted.recv_into(buf) == 64 and counted.recv(36) == b"x" * 36
        with pytest.raises(remote._TooLarge):
            counted.recv_into(buf)


def _one_key_server(key: bytes, scans: list[bytes], object_answer: bytes = b":100000\r\n"):
    """A server holding one 100-byte string `key`, its SCAN steps given (the cursor each step
    returns, in order), OBJECT answered with `object_answer`."""
    steps = iter(scans)

    def answer(args):
        name = args[0].upper()
        if name == b"EVALSHA":
            if args[4] != b"pt2:*":
                return [b"*3\r\n$1\r\n0\r\n*0\r\n*0\r\n"]
            return [next(steps)]
        if name == b"TYPE":
            return [b"+none\r\n" if args[1] == b"cachemgr:meta" else b"+string\r\n"]
        if name == b"OBJECT":
            return [object_answer]
        return [
            {b"HELLO": b"-ERR unknown command\r\n", b"MEMORY": b":100\r\n", b"DBSIZE": b":1\r\n"}.get(name, b"+OK\r\n")
        ]

    return answer


def test_a_key_scan_gives_twice_counts_once(fake_redis):
    """SCAN may give a key twice (a rehash between steps): it was counted twice, and a size cap it
    met was taken for one it did not (the key planned for deletion)."""
    from cachemgr.fleet.remote import Remote

    key = b"pt2:fx-graph-v1::fk:c1"
    one = b"*1\r\n$22\r\n" + key + b"\r\n"
    rem = Remote(
        fake_redis(
            _one_key_server(
                key, [b"*3\r\n$1\r\n5\r\n" + one + b"*0\r\n"] * 2 + [b"*3\r\n$1\r\n0\r\n" + one + b"*0\r\n"]
            )
        )
    )
    s = rem.stats()
    assert (s.entries, s.bytes) == (1, 100)


@pytest.mark.parametrize(
    "answer, outcome",
    [
        (b"-NOPERM this user has no permissions to run the 'object|idletime' command\r\n", "refused"),
        (b"-ERR something odd\r\n", "skipped"),
        (b"+not a number\r\n", "skipped"),
    ],
)
def test_a_key_redis_gives_no_idle_time_for_is_said(fake_redis, answer, outcome):
    """An error for OBJECT IDLETIME other than an LFU policy's read every key as gone: 0 entries,
    nothing evicted, nothing said. A refusal (an ACL) is Redis refusing us (exit 6); anything else
    is the key skipped, with Redis's answer."""
    from cachemgr.errors import RemoteError
    from cachemgr.fleet.remote import Remote

    key = b"pt2:fx-graph-v1::fk:c1"
    rem = Remote(fake_redis(_one_key_server(key, [b"*3\r\n$1\r\n0\r\n*1\r\n$22\r\n" + key + b"\r\n*0\r\n"], answer)))
    if outcome == "refused":
        with pytest.raises(RemoteError, match=r"refused us: this user has no permissions"):
            rem.stats()
        return
    skipped = []
    assert rem.inspect(skipped=skipped) == []
    assert [x.key for x in skipped] == [key.decode()] and "neither counted nor deleted" in skipped[0].reason


def test_what_redis_holds_reaches_no_terminal_as_escapes(tmp_path, db_url, redis_url, rconn):
    """cachemgr:meta is anyone's to write: its 'unreadable' text was printed as it was (a window
    title, a forged 'cachemgr:' line)."""
    k = "pt2:autograd-experimental::aesc:c1"
    rconn.set(k, "x")
    evil = "\x1b]0;PWNED\x07\r\ncachemgr: deleted everything"
    rconn.hset("cachemgr:meta", k, json.dumps({"unreadable": evil, "bytes": rconn.memory_usage(k, samples=0)}))
    r = Cli(tmp_path / "cache", db_url).proc("remote", "--redis", redis_url, "evict", "--max-age", "1d", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stderr and "\x07" not in r.stderr and "\r" not in r.stderr, r.stderr
    assert [x for x in r.stderr.splitlines() if "deleted everything" in x] == [
        f"cachemgr: remote: skipped {k}: cannot read it (seen before): "
        "\\x1b]0;PWNED\\x07\\r\\ncachemgr: deleted everything"
    ]
    long = "Z" * 300  # on a terminal the reason is cut to it, as the key is
    rconn.hset("cachemgr:meta", k, json.dumps({"unreadable": evil + long, "bytes": rconn.memory_usage(k, samples=0)}))
    args = ("remote", "--redis", redis_url, "evict", "--max-age", "1d", "--dry-run")
    r = Cli(tmp_path / "cache", db_url).proc(*args, env={"COLUMNS": "80"})
    skipped = [x for x in r.stderr.splitlines() if "skipped" in x or "ZZZ" in x]
    assert r.returncode == 0 and skipped and all(len(x) <= 80 for x in skipped), r.stderr
    assert skipped[0].startswith(f"cachemgr: remote: skipped {k}: cannot read it") and "ZZZ" not in r.stderr


def test_push_skips_what_an_edited_index_holds(cpu_cache, cli_for, redis_url, rconn, db_url):
    """One infinite compile time was exit 70 (OverflowError) for the whole push; a NULL ref was
    pushed as the key 'pt2:fx-graph-v1::None:c1', one with control characters as a key that
    `remote stats` then refused. The time reads as unknown (0 ms), the odd refs are skipped."""
    import sqlite3

    a = cli_for(cpu_cache)
    a("scan")
    fx = a.json("ls", "--kind", "fxgraph")
    assert len(fx) >= 4
    db = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    with db:
        db.execute("UPDATE entries SET compile_seconds = 9e999 WHERE key = ?", (fx[0]["key"],))
        db.execute("UPDATE entries SET ref = NULL WHERE key = ?", (fx[1]["key"],))
        db.execute("UPDATE entries SET ref = ? WHERE key = ?", ("evil\x1b]0;T\x07", fx[2]["key"]))
        # another graph's key, and newer: its file was pushed under fx[0]'s key (Inductor does not
        # check that an entry is the graph its key names: every host would have run fx[3]'s code)
        db.execute("UPDATE entries SET ref = ?, mtime = mtime + 1000 WHERE key = ?", (fx[0]["graph_key"], fx[3]["key"]))
    db.close()
    r = a.proc("remote", "--redis", redis_url, "push", "--no-scan", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    skipped = sorted(x["key"] for x in doc["skipped"])
    assert skipped == sorted([fx[1]["key"], fx[2]["key"], fx[3]["key"]]), doc["skipped"]
    from cachemgr.fleet.remote import decode_value

    pushed = decode_value(rconn.get(f"pt2:fx-graph-v1::{fx[0]['graph_key']}:c1"))
    assert pushed == (cpu_cache / fx[0]["key"]).read_bytes()
    keys = torch_keys(rconn)
    assert all(k.isprintable() and "None" not in k for k in keys), keys
    assert json.loads(rconn.get(f"pt2:fx-graph-v1::{fx[0]['graph_key']}:c1"))["time_taken_ms"] == 0


def test_remote_output_fits_80_columns_and_escapes_the_index(cpu_cache, cli_for, redis_url, rconn, db_url):
    """`remote evict --dry-run` printed each victim as 'reason size idle key' (117-127 columns a
    torch key, 265 a long CJK one); skipped lines ran to 384; push printed an index key that names
    no file as it was (a CR, a BEL: a forged line on a terminal)."""
    import sqlite3

    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    rconn.set("pt2:fx-graph-v1::f" + "漢" * 200 + ":c1", b"x")
    for k in torch_keys(rconn):
        _age(rconn, k, 3600)
    db = sqlite3.connect(db_url.removeprefix("sqlite:///"))
    with db:
        key = db.execute("SELECT key FROM entries WHERE kind = 'fxgraph' LIMIT 1").fetchone()[0]
        gone = key.rpartition("/")[0] + "/x\rFAKE\x07" + "y" * 100  # (its graph's folder, no file)
        db.execute("UPDATE entries SET key = ? WHERE key = ?", (gone, key))
    db.close()
    env = {"COLUMNS": "80"}
    lines = []
    for args in (["evict", "--max-age", "1m", "--dry-run"], ["stats"], ["push", "--no-scan", "--force"]):
        r = a.proc("remote", "--redis", redis_url, *args, env=env)
        assert r.returncode == 0, r.stderr
        lines += r.stdout.splitlines() + r.stderr.splitlines()
    from cachemgr.cli.common import cells

    assert all(cells(x) <= 80 for x in lines), [x for x in lines if cells(x) > 80]
    assert not any("\r" in x or "\x07" in x for x in lines)
    assert any(x.startswith("gone from disk, not pushed: fxgraph/") for x in lines), "\n".join(lines)
    whole = a.proc("remote", "--redis", redis_url, "push", "--no-scan").stderr.splitlines()  # (piped: whole)
    assert "gone from disk, not pushed: " + gone.replace("\r", "\\r").replace("\x07", "\\x07") in whole, whole


def test_an_unreadable_value_written_anew_is_read_again(cpu_cache, cli_for, redis_url, rconn):
    """A value that could not be read is remembered, so it is not read (and its idle time reset)
    every run; one Inductor then wrote anew was never read again: the AOT entry stayed
    'unreadable (seen before)', and was not taken with the graphs it needs."""
    a = cli_for(cpu_cache)
    a("remote", "--redis", redis_url, "push")
    k = next(k for k in torch_keys(rconn) if "autograd" in k)
    good = rconn.get(k)
    rconn.hdel("cachemgr:meta", k)
    rconn.set(k, b"torn write")
    first = remote_json(a, redis_url, "evict", "--max-age", "30d")
    assert [x["reason"] for x in first["skipped"] if x["key"] == k][0].startswith("cannot read it: "), first
    rconn.set(k, good)
    again = remote_json(a, redis_url, "evict", "--max-age", "30d")
    assert [x for x in again["skipped"] if x["key"] == k] == [], again["skipped"]
    assert json.loads(rconn.hget("cachemgr:meta", k))["refs"], rconn.hget("cachemgr:meta", k)


def test_an_aot_entry_goes_when_any_graph_it_needs_goes(redis_url, rconn):
    """An AOT entry chosen because the graphs it needs were followed the first of them only: that
    one read meanwhile (kept), the other deleted, the AOT entry stayed, though it can only miss."""
    from cachemgr.fleet.remote import Remote, plan_eviction

    fx = ["f" + c * 51 for c in "gh"]
    fx_keys = [f"pt2:fx-graph-v1::{k}:c1" for k in fx]
    aot = "pt2:autograd-experimental::a" + "b" * 51 + ":c1"
    for k in (*fx_keys, aot):
        rconn.set(k, b"x")
    rconn.hset("cachemgr:meta", aot, json.dumps({"refs": fx}))
    for k in fx_keys:
        _age(rconn, k, 10 * 86400)
    _age(rconn, aot, 3600)
    rem = Remote(redis_url)
    try:
        keys = rem.inspect()
        plan = plan_eviction(keys, rem.aot_refs(keys), max_size=None, max_age=86400)
        assert {v.rkey: v.reason for v in plan.victims} == {**dict.fromkeys(fx_keys, "age"), aot: "needs-evicted-graph"}
        first = next(k.rkey for k in keys if k.kind == "fxgraph")  # (the one the AOT entry was chosen with)
        rconn.get(first)  # an Inductor lookup of it between plan and delete
        result = rem.execute(plan)
    finally:
        rem.close()
    assert result.skipped_in_use == [first] and torch_keys(rconn) == [first]
