"""One definition of compile, recompile, loaded and hit: `stats`, `explain --summary` and the
daemon's Prometheus metrics agree over one real workload (a compile, a hit, a recompile after an
option change, an import), and agree with what torch itself counted."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest
from conftest import PROGRAMS, Cli, free_port
from test_daemon import Daemon, wait_until
from test_explain import compile_variant, explain_variants

pytestmark = pytest.mark.slow
ENV = {"PYTHONPATH": os.pathsep.join((str(Path(__file__).resolve().parent.parent), str(PROGRAMS)))}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_stats_explain_and_metrics_agree(tmp_path, db_url, cpp_builds):
    # another cache of the same index (another host of a fleet index, say) compiled a graph; its bundle
    # (compile_variant(builds=): C++ builds of earlier compiles of a variant are copied in first;
    # compiles, hits and loads are of fxgraph entries, which are never copied)
    other = tmp_path / "other"
    assert compile_variant(other, "dtype", builds=cpp_builds)["fxgraph_cache_miss"] == 1
    Cli(other, db_url)("scan")
    bundle = tmp_path / "seed.bundle"
    r = Cli(other, db_url).proc("export", "--out", str(bundle), timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr

    cache = tmp_path / "cache"
    cache.mkdir()
    port = free_port()
    daemon = Daemon(cache, db_url, "--metrics", str(port))
    try:
        daemon.wait_message("READY=1")
        daemon.wait_log(f"metrics on http://127.0.0.1:{port}/metrics")
        # three fresh processes, one after another (explain_variants.py --each): a compile, a hit,
        # a recompile (the same graph, another option)
        cpp_builds.seed(cache, "explain_variants base", "explain_variants option")
        torch_counts = explain_variants(cache, "--each", "base", "base", "option", builds=cpp_builds)
        assert [(c["fxgraph_cache_miss"], c["fxgraph_cache_hit"]) for c in torch_counts] == [(1, 0), (0, 1), (1, 0)]
        cli = Cli(cache, db_url)
        r = cli.proc("import", str(bundle), timeout=600, env=ENV)  # a load: no compile
        assert r.returncode == 0, r.stderr

        def settled():
            a = cli.json("stats")["activity"]
            return a["compiles"] == 2 and a["loaded"] == 1 and a["hits"] >= 1 and a

        stats = wait_until(settled, timeout=60)
        summary = cli.json("explain", "--summary")
        m = wait_until(lambda: (m := scrape(port))["cachemgr_loaded_total"] == 1 and m, timeout=30)
        assert daemon.stop() == 0, daemon.logs()
        assert "Traceback" not in daemon.logs()
    finally:
        daemon.close()

    assert stats["compiles"] == summary["compiles"] == m["cachemgr_compiles_total"] == 2  # torch: 2 misses
    assert stats["recompiles"] == summary["recompiles"] == m["cachemgr_recompilations_total"] == 1
    assert stats["loaded"] == summary["loaded"] == m["cachemgr_loaded_total"] == 1
    assert stats["hits"] == m["cachemgr_cache_hits_total"] >= 1  # torch: 1 hit (a read per lookup)
    assert stats["hit_ratio"] == pytest.approx(m["cachemgr_cache_hit_ratio"], abs=1e-4)
    assert m["cachemgr_compile_seconds_count"] == 2 and m["cachemgr_compile_seconds_sum"] == pytest.approx(
        stats["compile_seconds"], abs=1e-3
    )
    assert {s["cause"]: s["graphs"] for s in summary["summary"]} == {
        "compiled for the first time in this cache": 1,
        "inductor_config[epilogue_fusion] changed": 1,
    }
    text = " ".join(cli("stats").stdout.split())
    assert f"2 compiles (1 recompile), {stats['hits']} hit" in text and ", 1 loaded: hit ratio" in text
