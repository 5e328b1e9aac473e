"""What one index of many hosts says about the fleet: per host totals, graphs many hosts hold,
torch versions in use and the bytes still held by versions no host runs any more.

The figures come from the index's Store (cachemgr.index.store), which runs the same SQL on SQLite
and PostgreSQL, each row's number bounded first (one host's odd row reads as unknown: it cannot
overflow or swamp the sums of all); this module adds them up.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from cachemgr.index.store import MAX_BYTES, MAX_SECONDS, Store, Usage, iso_time, known_time


@dataclass(frozen=True)
class FleetReport:
    hosts: list[dict[str, Any]]
    shared_graphs: list[dict[str, Any]]
    versions: list[dict[str, Any]]
    in_use: list[str]
    stale_bytes: int  # held by versions no host runs any more (and not kept by --keep-torch)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hosts": self.hosts,
            "shared_graphs": self.shared_graphs,
            "torch_versions": self.versions,
            "versions_in_use": self.in_use,
            "stale_bytes": self.stale_bytes,
        }


def _store(source: Any) -> Store:
    """A Store, or (for callers that still hold one) an open SQLAlchemy connection."""
    return source if isinstance(source, Store) else Store.over(source)


def fleet_report(
    source: Store | Any,
    min_hosts: int = 2,
    limit: int = 20,
    window: float = 86400.0,
    keep_torch: list[str] | tuple[str, ...] = (),
) -> FleetReport:
    store = _store(source)
    hits = store.fleet_hits(time.time() - window)
    hosts: list[dict[str, Any]] = [
        {
            "host": host,
            "caches": caches,
            "entries": entries,
            "bytes": size,
            "unknown_sizes": unknown,  # entries whose size reads as unknown, not in `bytes`
            "hit_count": hit_count,
            "hits_in_window": hits.get(host, 0),
            "torch_version": store.host_torch_version(host),
            "last_scan": iso_time(last_scan),
            "last_scan_ts": last_scan,
        }
        for host, caches, entries, size, unknown, hit_count, last_scan in store.fleet_hosts()
    ]
    in_use: list[str] = sorted({str(h["torch_version"]) for h in hosts if h["torch_version"]} | set(keep_torch))

    dependents: dict[int, tuple[int, set[str]]] = {}  # entry id -> (bytes, versions it belongs to)
    for version, dep_id, size in store.version_dependents():
        prev = dependents.get(dep_id)
        dependents[dep_id] = (size if 0 <= size < MAX_BYTES else 0, (prev[1] if prev else set()) | {version})
    dep_bytes: dict[str, int] = {}
    stale = 0
    for size, owners in dependents.values():
        for v in owners:
            dep_bytes[v] = dep_bytes.get(v, 0) + size
        if not owners & set(in_use):
            stale += size
    versions: list[dict[str, Any]] = []
    for version, n, size, nh in store.torch_versions():
        used = version in in_use
        if not used:
            stale += size
        versions.append(
            {
                "torch_version": version,
                "in_use": used,
                "hosts": nh,
                "fxgraph_entries": n,
                "fxgraph_bytes": size,
                "dependent_bytes": dep_bytes.get(version, 0),
                "bytes": size + dep_bytes.get(version, 0),
            }
        )
    return FleetReport(hosts, store.shared_graphs(min_hosts, limit), versions, in_use, stale)


def fleet_stats(source: Store | Any, window: float) -> dict[str, Any]:
    """`stats` summed over every cache in the index, with each cache's own figures."""
    from cachemgr.explain import Activity, activity

    store = _store(source)
    caches = []
    total = Usage()
    by_kind: dict[str, Usage] = {}
    corrupt = pinned = 0
    acts = []
    times: list[float] = []  # each cache's oldest and newest mtime, where known
    for c in store.caches():
        cache = store.on(c)
        t = cache.totals()
        act = activity(cache, window)
        acts.append(act)
        last_scan = known_time(c.last_scan)
        caches.append({"host": c.host, **t.as_dict(), "last_scan_ts": last_scan, "activity": act.as_dict()})
        times += [x for x in (known_time(t.oldest), known_time(t.newest)) if x is not None]
        total += t.total
        for kind, u in t.by_kind.items():
            by_kind[kind] = by_kind.get(kind, Usage()) + u
        corrupt += t.corrupt
        pinned += t.pinned
    hits, compiles, recompiles, loaded, evictions = (
        sum(getattr(a, f) for a in acts) for f in ("hits", "compiles", "recompiles", "loaded", "evictions")
    )
    # each compile's known seconds: one row's 1e308 would make the whole sum that
    seconds = sum(s for a in acts for s in a.compile_times if 0 <= s < MAX_SECONDS)
    summed = Activity(window, hits, compiles, recompiles, loaded, seconds, evictions)
    return {
        "hosts": sorted({d["host"] for d in caches}),
        "caches": caches,
        **asdict(total),
        "corrupt": corrupt,
        "pinned": pinned,
        "oldest": iso_time(min(times, default=None)),
        "newest": iso_time(max(times, default=None)),
        "by_kind": {k: asdict(u) for k, u in by_kind.items()},
        "activity": summed.as_dict(),
    }
