"""What one index of many hosts says about the fleet: per host totals, graphs many hosts hold,
torch versions in use and the bytes still held by versions no host runs any more.

Plain SQL that runs the same on SQLite and PostgreSQL (GROUP BY, COUNT(DISTINCT), UNION); sums
come back as Decimal on PostgreSQL, hence the int()/float() on every one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cachemgr.index.queries import _iso, _stats, stats_from_rows

HOSTS_SQL = """
SELECT c.host, COUNT(DISTINCT c.id), COUNT(e.id), SUM(e.bytes), SUM(e.hit_count), MAX(c.last_scan)
FROM caches c LEFT JOIN entries e ON e.cache_id = c.id
GROUP BY c.host ORDER BY c.host
"""
HIT_EVENTS_SQL = """
SELECT c.host, COUNT(*) FROM events v JOIN caches c ON c.id = v.cache_id
WHERE v.kind = 'hit' AND v.ts >= :since GROUP BY c.host
"""
SHARED_GRAPHS_SQL = """
SELECT e.graph_key, COUNT(DISTINCT c.host), COUNT(*), SUM(e.bytes), MAX(e.bytes), MAX(e.compile_seconds),
       MAX(e.torch_version)
FROM entries e JOIN caches c ON c.id = e.cache_id
WHERE e.kind = 'fxgraph' AND e.graph_key IS NOT NULL
GROUP BY e.graph_key HAVING COUNT(DISTINCT c.host) >= :min_hosts
ORDER BY COUNT(DISTINCT c.host) DESC, SUM(e.bytes) DESC, e.graph_key
"""
HOST_VERSION_SQL = """
SELECT e.torch_version FROM entries e JOIN caches c ON c.id = e.cache_id
WHERE c.host = :host AND e.kind = 'fxgraph' AND e.torch_version IS NOT NULL
ORDER BY e.mtime DESC LIMIT 1
"""
VERSIONS_SQL = """
SELECT e.torch_version, COUNT(*), SUM(e.bytes), COUNT(DISTINCT c.host)
FROM entries e JOIN caches c ON c.id = e.cache_id
WHERE e.torch_version IS NOT NULL GROUP BY e.torch_version
"""
# Entries that carry no version of their own (kernels, modules, AOT entries) belong to the
# versions of the fxgraph entries that name them, or that they name. `kind || ''` keeps SQLite's
# planner (no ANALYZE statistics) off the (cache_id, kind) index and on (cache_id, ref|alias):
# without it this query takes minutes on 40,000 entries instead of a second.
DEPENDENTS_SQL = """
SELECT v.torch_version, d.id, d.bytes FROM entries v
  JOIN entry_refs r ON r.entry_id = v.id
  JOIN entries d ON d.cache_id = v.cache_id AND d.ref = r.ref AND d.kind || '' = r.kind
  WHERE v.torch_version IS NOT NULL
UNION
SELECT v.torch_version, d.id, d.bytes FROM entries v
  JOIN entry_refs r ON r.entry_id = v.id
  JOIN entries d ON d.cache_id = v.cache_id AND d.alias = r.ref AND d.kind || '' = r.kind
  WHERE v.torch_version IS NOT NULL
UNION
SELECT v.torch_version, a.id, a.bytes FROM entries a
  JOIN entry_refs r ON r.entry_id = a.id AND r.kind = 'fxgraph'
  JOIN entries v ON v.cache_id = a.cache_id AND v.ref = r.ref AND v.kind || '' = 'fxgraph'
  WHERE a.kind = 'aotautograd' AND v.torch_version IS NOT NULL
"""
CACHES_SQL = "SELECT id, last_scan, last_eviction, host, root FROM caches ORDER BY host, root"


@dataclass(frozen=True)
class FleetReport:
    hosts: list[dict[str, Any]]
    shared_graphs: list[dict[str, Any]]
    versions: list[dict[str, Any]]
    in_use: list[str]
    stale_bytes: int  # held by versions no host runs any more (and not kept by --keep-torch)

    def as_dict(self) -> dict[str, Any]:
        return {"hosts": self.hosts, "shared_graphs": self.shared_graphs, "torch_versions": self.versions,
                "versions_in_use": self.in_use, "stale_bytes": self.stale_bytes}


def fleet_report(conn, min_hosts: int = 2, limit: int = 20, window: float = 86400.0,
                 keep_torch: list[str] | tuple[str, ...] = ()) -> FleetReport:
    from sqlalchemy import text

    def run(sql: str, **params: Any) -> list:
        return conn.execute(text(sql), params).fetchall()

    hit_events = {h: int(n) for h, n in run(HIT_EVENTS_SQL, since=time.time() - window)}
    hosts = []
    for host, caches, entries, size, hits, last_scan in run(HOSTS_SQL):
        current = run(HOST_VERSION_SQL, host=host)
        hosts.append({
            "host": host, "caches": int(caches), "entries": int(entries), "bytes": int(size or 0),
            "hit_count": int(hits or 0), "hits_in_window": hit_events.get(host, 0),
            "torch_version": current[0][0] if current else None, "last_scan": _iso(last_scan),
        })

    shared = [
        {"graph_key": g, "hosts": int(nh), "entries": int(n), "bytes": int(size or 0),
         "redundant_bytes": int(size or 0) - int(biggest or 0),
         "compile_seconds": None if cost is None else round(float(cost), 3), "torch_version": tv}
        for g, nh, n, size, biggest, cost, tv in run(SHARED_GRAPHS_SQL, min_hosts=min_hosts)[:limit]
    ]

    in_use = sorted({h["torch_version"] for h in hosts if h["torch_version"]} | set(keep_torch))
    dependents: dict[int, tuple[int, set[str]]] = {}
    for version, dep_id, size in run(DEPENDENTS_SQL):
        prev = dependents.get(dep_id)
        dependents[dep_id] = (int(size or 0), (prev[1] if prev else set()) | {version})
    dep_bytes: dict[str, int] = {}
    exclusive_stale = 0
    for size, versions in dependents.values():
        for v in versions:
            dep_bytes[v] = dep_bytes.get(v, 0) + size
        if not versions & set(in_use):
            exclusive_stale += size
    versions = []
    stale = exclusive_stale
    for version, n, size, nh in sorted(run(VERSIONS_SQL), key=lambda r: str(r[0])):
        used = version in in_use
        if not used:
            stale += int(size or 0)
        versions.append({"torch_version": version, "in_use": used, "hosts": int(nh), "fxgraph_entries": int(n),
                         "fxgraph_bytes": int(size or 0), "dependent_bytes": dep_bytes.get(version, 0),
                         "bytes": int(size or 0) + dep_bytes.get(version, 0)})
    return FleetReport(hosts, shared, versions, in_use, stale)


def fleet_stats(conn, window: float) -> dict[str, Any]:
    """`stats` summed over every cache in the index, with each cache's own figures."""
    from sqlalchemy import text

    run = lambda sql, p: conn.execute(text(sql), p).fetchall()  # noqa: E731
    caches = []
    for cid, last_scan, last_eviction, host, root in run(CACHES_SQL, {}):
        doc = _stats(run, (cid, last_scan, last_eviction), root, window)
        caches.append({"host": host, **doc})
    total = stats_from_rows("(fleet)", [], [], 0, window, None, None)
    for doc in caches:
        for k in ("entries", "files", "bytes", "corrupt", "pinned"):
            total[k] += doc[k]
        for kind, row in doc["by_kind"].items():
            t = total["by_kind"].setdefault(kind, {"entries": 0, "files": 0, "bytes": 0})
            for k in t:
                t[k] += row[k]
        for k in ("hits", "compiles", "recompilations", "evictions"):
            total["activity"][k] += doc["activity"][k]
        total["activity"]["compile_seconds"] = round(total["activity"]["compile_seconds"]
                                                     + doc["activity"]["compile_seconds"], 3)
    a = total["activity"]
    a["hit_ratio"] = round(a["hits"] / (a["hits"] + a["compiles"]), 4) if a["hits"] + a["compiles"] else None
    dated = [d for d in caches if d["oldest"]]
    total["oldest"] = min((d["oldest"] for d in dated), default=None)
    total["newest"] = max((d["newest"] for d in dated), default=None)
    total.pop("cache_dir")
    total.pop("last_scan")
    total.pop("last_eviction")
    return {"hosts": sorted({d["host"] for d in caches}), "caches": caches, **total}

