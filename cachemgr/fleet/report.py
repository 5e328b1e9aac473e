"""What one index of many hosts says about the fleet: per host totals, graphs many hosts hold,
torch versions in use and the bytes still held by versions no host runs any more.

The figures come from the index's Store (cachemgr.index.store), which runs the same SQL on SQLite
and PostgreSQL; this module adds them up. The fleet's own sums are asked here, through the Store's
driver, with each row's number bounded first: every host's rows are summed together, so one odd
row must read as unknown, not overflow or swamp the sums of all.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from cachemgr.index.store import Store, Usage, iso_time, moment
from cachemgr.vocab import Event

# A shared index holds other hosts' rows as they wrote them, or as someone edited them. A number
# no real cache has reads as unknown for that row only, so that it cannot zero, negate or swamp
# the fleet's figures: a size of 1 TiB or more (of one entry), a time outside 1970 to the year
# 33658 (what `age` shows), a compile of 1e9 s or more (the parser records none), a hit count
# past PostgreSQL's INTEGER.
MAX_BYTES = 1 << 40
MAX_TIME = 1e12
MAX_SECONDS = 1e9
MAX_HITS = 1 << 31


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


def _known(column: str, top: float) -> str:
    """SQL: `column` where it is a number in [0, top), else NULL. NaN (PostgreSQL sorts it above
    every number), infinities, and text or bytes in a hand-edited SQLite index (SQLite sorts them
    above every number) all fail `< top`."""
    return f"CASE WHEN {column} >= 0 AND {column} < {top!r} THEN {column} END"


def _sum(known: str) -> str:
    """SQL: the sum of known values as a float, 0 for none: SQLite's integer SUM fails past
    int64, and PostgreSQL's is exact but no plain int. (Sizes below 1 TiB add exactly in a float
    up to 8 PiB.)"""
    return f"COALESCE(SUM(CAST({known} AS DOUBLE PRECISION)), 0)"


def known_time(v: Any) -> float | None:
    """A time as stored, None where it reads as unknown."""
    t = moment(v, math.nan)
    return t if 0 <= t < MAX_TIME else None


BYTES = _known("e.bytes", MAX_BYTES)


def _hosts(store: Store) -> list[tuple[str, int, int, int, int, int, float | None]]:
    """(host, caches, entries, bytes, entries of unknown size, hit count, last scan) of every host."""
    rows = store.driver.rows(
        f"SELECT c.host, COUNT(DISTINCT c.id), COUNT(e.id), {_sum(BYTES)}, COUNT(e.id) - COUNT({BYTES}), "
        f"{_sum(_known('e.hit_count', MAX_HITS))}, MAX({_known('c.last_scan', MAX_TIME)}) "
        "FROM caches c LEFT JOIN entries e ON e.cache_id = c.id GROUP BY c.host ORDER BY c.host",
        {},
    )
    return [
        (h, int(c), int(n), int(b), int(unknown), int(hits), known_time(last))
        for h, c, n, b, unknown, hits, last in rows
    ]


def _hits(store: Store, since: float) -> dict[str, int]:
    """host -> fxgraph hits at or after `since` (an unknown time is in no window)."""
    rows = store.driver.rows(
        "SELECT c.host, COUNT(*) FROM events v JOIN caches c ON c.id = v.cache_id WHERE v.kind = :hit "
        f"AND v.entry_kind = 'fxgraph' AND v.ts >= :since AND v.ts < {MAX_TIME!r} GROUP BY c.host",
        {"hit": Event.HIT.value, "since": since},
    )
    return {h: int(n) for h, n in rows}


def _torch_version(store: Store, host: str) -> str | None:
    """The torch version of a host's newest fxgraph entry (one of unknown mtime is the oldest)."""
    rows = store.driver.rows(
        "SELECT e.torch_version FROM entries e JOIN caches c ON c.id = e.cache_id WHERE c.host = :host "
        "AND e.kind = 'fxgraph' AND e.torch_version IS NOT NULL "
        f"ORDER BY COALESCE({_known('e.mtime', MAX_TIME)}, -1) DESC LIMIT 1",
        {"host": host},
    )
    return rows[0][0] if rows else None


def _shared_graphs(store: Store, min_hosts: int, limit: int) -> list[dict[str, Any]]:
    """Graphs that `min_hosts` or more hosts hold, most hosts first; bytes of their known sizes."""
    rows = store.driver.rows(
        f"SELECT e.graph_key, COUNT(DISTINCT c.host), COUNT(*), {_sum(BYTES)}, COALESCE(MAX({BYTES}), 0), "
        f"MAX({_known('e.compile_seconds', MAX_SECONDS)}), MAX(e.torch_version) "
        "FROM entries e JOIN caches c ON c.id = e.cache_id "
        "WHERE e.kind = 'fxgraph' AND e.graph_key IS NOT NULL GROUP BY e.graph_key "
        "HAVING COUNT(DISTINCT c.host) >= :min_hosts ORDER BY 2 DESC, 4 DESC, 1",
        {"min_hosts": min_hosts},
    )
    return [
        {
            "graph_key": g,
            "hosts": int(nh),
            "entries": int(n),
            "bytes": int(size),
            "redundant_bytes": int(size) - int(biggest),
            "compile_seconds": None if cost is None else round(float(cost), 3),
            "torch_version": tv,
        }
        for g, nh, n, size, biggest, cost, tv in rows[:limit]
    ]


def _torch_versions(store: Store) -> list[tuple[str, int, int, int]]:
    """(version, fxgraph entries, their known bytes, hosts) of every torch version in the index."""
    rows = store.driver.rows(
        f"SELECT e.torch_version, COUNT(*), {_sum(BYTES)}, COUNT(DISTINCT c.host) FROM entries e "
        "JOIN caches c ON c.id = e.cache_id WHERE e.kind = 'fxgraph' AND e.torch_version IS NOT NULL "
        "GROUP BY e.torch_version",
        {},
    )
    return sorted(((v, int(n), int(size), int(nh)) for v, n, size, nh in rows), key=lambda r: str(r[0]))


def fleet_report(
    source: Store | Any,
    min_hosts: int = 2,
    limit: int = 20,
    window: float = 86400.0,
    keep_torch: list[str] | tuple[str, ...] = (),
) -> FleetReport:
    store = _store(source)
    hits = _hits(store, time.time() - window)
    hosts: list[dict[str, Any]] = [
        {
            "host": host,
            "caches": caches,
            "entries": entries,
            "bytes": size,
            "unknown_sizes": unknown,  # entries whose size reads as unknown, not in `bytes`
            "hit_count": hit_count,
            "hits_in_window": hits.get(host, 0),
            "torch_version": _torch_version(store, host),
            "last_scan": iso_time(last_scan),
            "last_scan_ts": last_scan,
        }
        for host, caches, entries, size, unknown, hit_count, last_scan in _hosts(store)
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
    for version, n, size, nh in _torch_versions(store):
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
    return FleetReport(hosts, _shared_graphs(store, min_hosts, limit), versions, in_use, stale)


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
