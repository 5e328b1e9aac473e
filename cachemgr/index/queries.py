"""Read-side queries: stats, listing, one entry in full, pins.

`stats` is plain SQL so that on the embedded SQLite default it runs on the standard library's
sqlite3 alone (`stats_fast`): importing SQLAlchemy costs more than the whole query. So does the
rescan of an unchanged tree (`rescan_fast`).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

from cachemgr.layout import KINDS

STATS_SQL = """
SELECT kind, COUNT(*), SUM(files), SUM(bytes), SUM(CASE WHEN corrupt IS NULL THEN 0 ELSE 1 END),
       MIN(mtime), MAX(mtime)
FROM entries WHERE cache_id = :cache_id GROUP BY kind
"""
ACTIVITY_SQL = """
SELECT kind, COUNT(*), SUM(CASE WHEN recompile THEN 1 ELSE 0 END), SUM(seconds)
FROM events WHERE cache_id = :cache_id AND ts >= :since GROUP BY kind
"""
PINS_SQL = "SELECT COUNT(*) FROM pins WHERE cache_id = :cache_id"
CACHE_SQL = "SELECT id, last_scan, last_eviction FROM caches WHERE host = :host AND root = :root"


def stats_from_rows(root: str, kind_rows: list, activity_rows: list, pins: int, window: float,
                    last_scan: float | None, last_eviction: float | None) -> dict[str, Any]:
    by_kind = {k: {"entries": 0, "files": 0, "bytes": 0} for k in KINDS}
    total = {"entries": 0, "files": 0, "bytes": 0}
    corrupt, oldest, newest = 0, None, None
    for kind, n, files, size, bad, lo, hi in kind_rows:
        row = by_kind.setdefault(kind, {"entries": 0, "files": 0, "bytes": 0})
        row.update(entries=n, files=int(files or 0), bytes=int(size or 0))
        for k in total:
            total[k] += row[k]
        corrupt += int(bad or 0)
        oldest = lo if oldest is None else min(oldest, lo)
        newest = hi if newest is None else max(newest, hi)
    act = {kind: (n, int(rec or 0), float(sec or 0.0)) for kind, n, rec, sec in activity_rows}
    hits, compiles = act.get("hit", (0, 0, 0.0))[0], act.get("new", (0, 0, 0.0))[0]
    return {
        "cache_dir": root, **total, "corrupt": corrupt, "pinned": pins,
        "oldest": _iso(oldest), "newest": _iso(newest), "by_kind": by_kind,
        "activity": {
            "window_seconds": window,
            "hits": hits,
            "compiles": compiles,
            "hit_ratio": round(hits / (hits + compiles), 4) if hits + compiles else None,
            "recompilations": act.get("new", (0, 0, 0.0))[1],
            "compile_seconds": round(act.get("new", (0, 0, 0.0))[2], 3),
            "evictions": act.get("evict", (0, 0, 0.0))[0],
        },
        "last_scan": _iso(last_scan), "last_eviction": _iso(last_eviction),
    }


def _sqlite_index(sqlite_path: str, head: str, host: str, root: str, write: bool = False):
    """(stdlib sqlite3 connection, cache row) of a current, scanned index, or None. The caller
    closes the connection."""
    import sqlite3

    if not os.path.exists(sqlite_path):
        return None
    try:
        conn = sqlite3.connect(f"file:{sqlite_path}?mode={'rw' if write else 'ro'}", uri=True, timeout=30)
    except sqlite3.Error:
        return None
    try:
        if conn.execute("SELECT version_num FROM alembic_version").fetchone() == (head,):
            cache = conn.execute(CACHE_SQL, {"host": host, "root": root}).fetchone()
            if cache is not None and cache[1] is not None:
                return conn, cache
    except sqlite3.Error:
        pass
    conn.close()
    return None


def stats_fast(sqlite_path: str, head: str, host: str, root: str, window: float) -> dict[str, Any] | None:
    """stats over stdlib sqlite3, read-only; None when the index is missing, old, or never scanned."""
    import sqlite3

    found = _sqlite_index(sqlite_path, head, host, root)
    if found is None:
        return None
    conn, cache = found
    try:
        return _stats(lambda sql, p: conn.execute(sql, p).fetchall(), cache, root, window)
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def rescan_fast(sqlite_path: str, head: str, host: str, root: str) -> int | None:
    """The rescan of a tree in which no directory changed since the last scan, over stdlib sqlite3:
    the number of entries, or None when anything changed (then `scan.reconcile` does the work).

    Importing SQLAlchemy costs about as much as `find` over a 100,000-file cache; a tree whose
    directories all kept their mtimes (`layout.walk_dirs` reads none of them) needs none of it.
    """
    import sqlite3

    from cachemgr.layout import walk_dirs

    found = _sqlite_index(sqlite_path, head, host, root, write=True)
    if found is None:
        return None
    conn, (cache_id, _, _) = found
    try:
        stored = dict(conn.execute("SELECT path, mtime_ns FROM dirs WHERE cache_id = ?", (cache_id,)))
        walked = walk_dirs(root, "", stored) if stored else None
        if walked is None or walked.listed or len(walked.mtimes) != len(stored):
            return None
        with conn:
            conn.execute("UPDATE caches SET last_scan = ? WHERE id = ?", (time.time(), cache_id))
        return conn.execute("SELECT COUNT(*) FROM entries WHERE cache_id = ?", (cache_id,)).fetchone()[0]
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def stats(conn, host: str, root: str, window: float) -> dict[str, Any] | None:
    """stats over a SQLAlchemy connection (any database)."""
    from sqlalchemy import text

    cache = conn.execute(text(CACHE_SQL), {"host": host, "root": root}).fetchone()
    if cache is None:
        return None
    return _stats(lambda sql, p: conn.execute(text(sql), p).fetchall(), cache, root, window)


def _stats(run, cache, root: str, window: float) -> dict[str, Any]:
    cid, last_scan, last_eviction = cache
    kinds = run(STATS_SQL, {"cache_id": cid})
    activity = run(ACTIVITY_SQL, {"cache_id": cid, "since": time.time() - window})
    pins = run(PINS_SQL, {"cache_id": cid})[0][0]
    return stats_from_rows(root, kinds, activity, pins, window, last_scan, last_eviction)


# -- listing --------------------------------------------------------------------------------

ENTRY_FIELDS = (
    "key", "kind", "bytes", "files", "mtime", "last_access", "hit_count", "graph_key", "signature",
    "signature_hash", "options_hash", "guards", "device_types", "compile_seconds", "torch_version", "corrupt",
)


@dataclass(frozen=True)
class Filters:
    kind: str | None = None
    older_than: float | None = None  # seconds since last access
    larger_than: int | None = None
    graph: str | None = None
    pinned: bool = False
    corrupt: bool = False
    sort: str = "size"  # size | age | cost
    limit: int | None = None


def list_entries(conn, cache_id: int, f: Filters) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from cachemgr.index.models import Entry

    t = Entry.__table__
    q = select(*(t.c[n] for n in ENTRY_FIELDS), t.c.ref).where(t.c.cache_id == cache_id)
    if f.kind:
        q = q.where(t.c.kind == f.kind)
    if f.older_than is not None:
        q = q.where(t.c.last_access <= time.time() - f.older_than)
    if f.larger_than is not None:
        q = q.where(t.c.bytes > f.larger_than)
    if f.graph:
        q = q.where((t.c.graph_key == f.graph) | (t.c.ref == f.graph))
    if f.corrupt:
        q = q.where(t.c.corrupt.is_not(None))
    order = {"size": t.c.bytes.desc(), "age": t.c.last_access.asc(), "cost": t.c.compile_seconds.desc()}[f.sort]
    q = q.order_by(order.nulls_last() if f.sort == "cost" else order, t.c.key)
    pins = pin_keys(conn, cache_id)
    out = []
    for r in conn.execute(q):
        d = entry_dict(r._mapping, pins)
        if f.pinned and not d["pinned"]:
            continue
        out.append(d)
        if f.limit is not None and len(out) >= f.limit:
            break
    return out


def entry_dict(m, pins: dict[str, str | None]) -> dict[str, Any]:
    d = {n: m[n] for n in ENTRY_FIELDS}
    d["path"] = d["key"]
    pin = pinned_by(m, pins)
    d["pinned"] = pin is not None
    d["pin_reason"] = pins[pin] if pin is not None else None
    return d


def pinned_by(m, pins: dict[str, str | None]) -> str | None:
    """The pinned key (the entry's own key, its graph key or its ref) that covers an entry, or None."""
    return next((k for k in (m["key"], m["graph_key"], m["ref"]) if k and k in pins), None) if pins else None


def pin_keys(conn, cache_id: int) -> dict[str, str | None]:
    """Pinned keys (entry keys, graph keys or refs) -> the reason given."""
    from sqlalchemy import select

    from cachemgr.index.models import Pin

    return dict(conn.execute(select(Pin.key, Pin.reason).where(Pin.cache_id == cache_id)).all())


def find_entries(conn, cache_id: int, key: str) -> list:
    """Entries named by KEY: an entry key, a graph key / ref (every entry of it), or a unique prefix
    of an entry key. A prefix of several entries is a usage error: never act on all of them."""
    from sqlalchemy import or_, select

    from cachemgr.errors import UsageError
    from cachemgr.index.models import Entry

    t = Entry.__table__
    base = select(t).where(t.c.cache_id == cache_id)
    rows = conn.execute(base.where(or_(t.c.key == key, t.c.graph_key == key, t.c.ref == key)).order_by(t.c.key)).fetchall()
    if not rows and len(key) >= 4:
        rows = conn.execute(base.where(t.c.key.startswith(key, autoescape=True)).order_by(t.c.key).limit(51)).fetchall()
        if len(rows) > 1:
            n = len(rows) if len(rows) <= 50 else "more than 50"
            raise UsageError(f"{key!r} is a prefix of {n} entries (e.g. {rows[0].key}): give more of it")
    return rows


def entry_detail(conn, root: str, cache_id: int, row) -> dict[str, Any]:
    """One entry in full: its fields, its files on disk, what it needs and what needs it."""
    from sqlalchemy import or_, select

    from cachemgr.index.models import Entry, EntryComponent, EntryRef
    from cachemgr import safefs
    from cachemgr.layout import entry_files

    e, r, c = Entry.__table__, EntryRef.__table__, EntryComponent.__table__
    pins = pin_keys(conn, cache_id)
    d = entry_dict(row._mapping, pins)
    try:
        with safefs.Root(root) as opened:
            d["files_on_disk"] = [{"path": p, "bytes": st.st_size} for p, st in entry_files(opened, row.key, row.kind)]
    except OSError:
        d["files_on_disk"] = []
    d["first_seen"] = row.first_seen
    d["references"] = [
        {"kind": k, "ref": ref, "present": bool(conn.execute(
            select(e.c.key).where(e.c.cache_id == cache_id, e.c.kind == k, or_(e.c.ref == ref, e.c.alias == ref)).limit(1)
        ).first())}
        for k, ref in conn.execute(select(r.c.kind, r.c.ref).where(r.c.entry_id == row.id))
    ]
    names = [x for x in (row.ref, row.alias) if x]
    d["referenced_by"] = sorted(set(conn.execute(
        select(e.c.key).join(r, r.c.entry_id == e.c.id).where(e.c.cache_id == cache_id, r.c.kind == row.kind, r.c.ref.in_(names))
    ).scalars())) if names else []
    d["components"] = len(conn.execute(select(c.c.name).where(c.c.entry_id == row.id)).fetchall())
    return d


def model_graphs(conn, cache_id: int, model: str) -> set[str]:
    """Graph keys of a model, through the input signatures cachemgr.record wrote to `shapes`.

    A recorded signature names the model's call inputs ('(f32[8,16])'); an fxgraph entry's
    signature names the graph's inputs, parameters included ('f32[32, 16](16, 1)cpu; f32[8, 16]...').
    An entry belongs to the model when it holds every recorded tensor (dtype[shape]) of one
    signature. A graph that went dynamic (symbolic dims) no longer matches concrete shapes.
    """
    from sqlalchemy import text

    from cachemgr.errors import NotFound

    rows = conn.execute(text("SELECT signature FROM shapes WHERE model = :m"), {"m": model}).scalars().all()
    if not rows:
        known = conn.execute(text("SELECT COUNT(DISTINCT model) FROM shapes")).scalar() or 0
        raise NotFound(f"no recorded shapes for model {model!r}" + (
            f" ({known} other models are recorded: cachemgr shapes lists them)" if known else
            " (the shapes table is empty: record the model with cachemgr.record, or use --graph KEY)"))
    tensor_sets = [set(_TENSOR.findall((sig or "").replace(" ", ""))) for sig in rows]
    found: set[str] = set()
    for gk, sig in conn.execute(text("SELECT graph_key, signature FROM entries WHERE cache_id = :c AND "
                                     "kind = 'fxgraph' AND graph_key IS NOT NULL"), {"c": cache_id}):
        have = set(_TENSOR.findall((sig or "").replace(" ", "")))
        if any(ts and ts <= have for ts in tensor_sets):
            found.add(gk)
    if not found:
        raise NotFound(f"model {model!r} has {len(rows)} recorded signatures, but no fxgraph entry "
                       "has those inputs (run: cachemgr scan)")
    return found


_TENSOR = re.compile(r"[a-z]+\d*\[[^\]]*\]")


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def add_pin(conn, cache_id: int, key: str, reason: str | None, now: float) -> bool:
    """Pin `key` (entry key, graph key or ref); False when it was pinned already (then a reason
    given replaces the old one; none given keeps it)."""
    from sqlalchemy import insert, select, update

    from cachemgr.index.models import Pin

    t = Pin.__table__
    if conn.execute(select(t.c.id).where(t.c.cache_id == cache_id, t.c.key == key)).first():
        if reason is not None:
            conn.execute(update(t).where(t.c.cache_id == cache_id, t.c.key == key).values(reason=reason))
        return False
    conn.execute(insert(t).values(cache_id=cache_id, key=key, reason=reason, created=now))
    return True


def remove_pin(conn, cache_id: int, key: str) -> bool:
    from sqlalchemy import delete

    from cachemgr.index.models import Pin

    t = Pin.__table__
    return conn.execute(delete(t).where(t.c.cache_id == cache_id, t.c.key == key)).rowcount > 0
