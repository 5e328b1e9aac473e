"""Phase two of a scan: read the pending entries (see cachemgr.index.scan for phase one).

A parse result is kept by the entry file's content name and size (`parsed_content`: torch names
fxgraph and AOTAutograd files by the hash of their bytes), so an entry seen before, here or on
any host of a fleet index, is not read again; the rest go through the parse workers
(cachemgr.index.workers). Fields, references and hash components are written, and a 'new' event
for each newly compiled graph.

Written over the driver's own connection (cachemgr.index.dbapi), not SQLAlchemy: `cachemgr scan`
on the embedded index runs both phases without importing it.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cachemgr import parse, procs, safefs
from cachemgr.index.dbapi import Connections, Sql, chunks, connections
from cachemgr.index.describe import Described, Parts, failed, new_run
from cachemgr.index.fill import CONTENT_NAMED, MAX_REPORTED
from cachemgr.index.workers import BATCH, Job, Pool
from cachemgr.vocab import PARSED, PENDING, PENDING_NEW, PICKLED, Kind
from cachemgr.vocab import Event as Ev

PARSE_CHUNK = 500  # pending entries read per phase-two transaction
AHEAD = 2  # chunks handed to the workers beyond the one being written
LIGHT_BATCH = 64  # entries that are not pickles (autotune results, C++ sources) per worker job
# Graph pickles per worker job: each job's round trip costs the parsing process a select, a read
# and an unpickle on the thread that trades with the workers, time its writes wait for (on 16
# cores phase two waited on that process, not on its workers). A batch that fails (its worker
# killed, out of time) is read again an entry a job, so only the entry to blame is marked.
PICKLE_BATCH = 4

Progress = Callable[[int, int], None]  # (done, total) while parsing entries

PARSED_COLUMNS = (
    "graph_key",
    "signature",
    "signature_hash",
    "options_hash",
    "guards",
    "device_types",
    "compile_seconds",
    "torch_version",
    "torch_version_hash",
    "system_hash",
    "corrupt",
    "unrecorded",
)
WRITTEN_COLUMNS = ("alias", *PARSED_COLUMNS)  # what phase two writes of each entry it reads
WRITE_ENTRY = "UPDATE entries SET parse_state = ?, " + ", ".join(f"{c} = ?" for c in WRITTEN_COLUMNS) + " WHERE id = ?"
EVENT_COLUMNS = ("cache_id", "ts", "kind", "entry_kind", "entry_key", "graph_key", "recompile", "bytes", "seconds")
KEPT_COLUMNS = ("kind", '"row"', "refs", "parts", "parsed_at", "reader")  # of parsed_content, by (name, bytes)


class Pending(NamedTuple):
    """A pending entry's row, as phase two reads it."""

    id: int
    key: str
    kind: str
    ref: str | None
    bytes: int
    content: str | None
    parse_state: int
    mtime: float


KEY = '"key"'  # (quoted: a keyword)
PENDING_SELECT = 'SELECT id, "key", kind, ref, bytes, content, parse_state, mtime FROM entries'


@dataclass
class ParseResult:
    parsed: int = 0
    from_content: int = 0  # taken from parse results kept by content, not read
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (key, reason), capped
    new_events: list[dict] = field(default_factory=list)  # the 'new' events written, for this run's caller
    seconds: float = 0.0


def parse_pending(
    db: Any,
    cache_id: int,
    root: str,
    progress: Progress | None = None,
    pool: Pool | None = None,
    keys: Iterable[str] | None = None,
    limit: int | None = None,
) -> ParseResult:
    """Read pending entries (all of them, those of `keys`, or at most `limit`), a chunk per
    transaction (entry pickles are read as no workload does: describe.read_unseen). `db`: a
    Database, or dbapi Connections.

    Each entry file's content is read once: a parse result kept by content (`parsed_content`)
    is taken as it is, and of the pending entries that share a content name and size one is
    read and the others take its result. The workers read the next chunks while this process
    writes the last one (AHEAD chunks in flight)."""
    t0 = time.monotonic()
    conns = connections(db)
    out = ParseResult()
    wanted = None if keys is None else list(dict.fromkeys(keys))
    if wanted is None:
        with conns.reading() as sql:
            (total,) = sql.one(
                "SELECT COUNT(*) FROM entries WHERE cache_id = ? AND parse_state <> ?", (cache_id, PARSED)
            )
    else:
        total = len(wanted)
    total = min(total, limit) if limit is not None else total
    if not total:
        return out
    own = pool is None
    pool = pool or Pool(min(max(1, total // 8), Pool().size))
    try:
        with procs.collector_paused(), _Reader(pool, root) as reader:
            ahead: deque[_Chunk] = deque()
            for rows in _pending_rows(conns, cache_id, wanted, total):
                with conns.reading() as sql:
                    ahead.append(reader.start(sql, rows))
                while len(ahead) > AHEAD:
                    _finish(conns, cache_id, reader, ahead.popleft(), out, total, progress)
            while ahead:
                _finish(conns, cache_id, reader, ahead.popleft(), out, total, progress)
    finally:
        if own:
            pool.close()
    out.seconds = time.monotonic() - t0
    return out


def _pending_rows(conns: Connections, cache_id: int, wanted: list[str] | None, total: int) -> Iterator[list[Pending]]:
    """The pending rows to read, PARSE_CHUNK at a time: those of `wanted`, or new entries then
    changed ones, each in id order. (One parse state at a time, so each read is a range of the
    (cache_id, parse_state) index from the last id on: `parse_state != PARSED` made SQLite read
    every row of the cache's part of that index, and sort, for each chunk.)"""
    left = total
    if wanted is not None:
        for key_chunk in chunks(wanted, PARSE_CHUNK):
            if left <= 0:
                return
            with conns.reading() as sql:
                rows = sql.rows(
                    f"{PENDING_SELECT} WHERE cache_id = ? AND parse_state <> ? AND {sql.in_(KEY)} LIMIT ?",
                    (cache_id, PARSED, sql.values(key_chunk), min(PARSE_CHUNK, left)),
                )
            if rows:
                left -= len(rows)
                yield [Pending(*r) for r in rows]
        return
    for state in (PENDING_NEW, PENDING):
        last_id = 0
        while left > 0:
            with conns.reading() as sql:
                rows = sql.rows(
                    f"{PENDING_SELECT} WHERE cache_id = ? AND parse_state = ? AND id > ? ORDER BY id LIMIT ?",
                    (cache_id, state, last_id, min(PARSE_CHUNK, left)),
                )
            if not rows:
                break
            last_id = rows[-1][0]
            left -= len(rows)
            yield [Pending(*r) for r in rows]


@dataclass
class _Chunk:
    rows: list[Pending]
    run: int
    described: dict[int, Described]  # row id -> what is known of it so far
    jobs: dict[int, list[int]]  # job id -> the row ids its result answers (a BATCH answers several)
    copies: dict[int, list[int]]  # row id read -> row ids of the same content that take its result
    later: list[Pending] = field(default_factory=list)  # rows whose content an earlier chunk reads
    hits: int = 0


class _Reader:
    """Hands the pending entries of each chunk to the parse workers (graph pickles PICKLE_BATCH
    to a job, small entries LIGHT_BATCH) through a Stream, and gathers their results."""

    def __init__(self, pool: Pool, root: str) -> None:
        self.root = root
        try:
            with safefs.Root(root) as r:
                self.root_id: tuple[int, int] | None = r.id
        except OSError:
            self.root_id = None  # each entry is then reported unreadable by its worker
        # Room for a chunk's results while this process writes the last one: with a backlog of a
        # few jobs per worker, the workers stood idle through every write (75 ms a chunk of
        # graphs). The results held are no more than a chunk's own (`described`) already are.
        self.stream = pool.stream(lambda job, why: failed(why), backlog=max(4 * pool.size, PARSE_CHUNK))
        self.ids = itertools.count()
        self.earlier: set[tuple[str, str, int]] = set()  # contents a chunk in flight reads
        self.got: dict[int, object] = {}  # results that came before their chunk was finished

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stream.close()

    def start(self, sql: Sql, rows: list[Pending]) -> _Chunk:
        """Look the chunk's entries up by content, and send the rest to be read."""
        chunk = _Chunk(rows, new_run(), {}, {}, {})
        chunk.described, chunk.hits = _from_content(sql, rows)
        first: dict[tuple[str, str, int], int] = {}
        reads: list[Pending] = []
        light: list[Pending] = []
        for r in rows:
            if r.id in chunk.described:
                continue
            same = (r.kind, r.content, r.bytes) if r.kind in CONTENT_NAMED and r.content else None
            if same is not None and same in first:
                chunk.copies[first[same]].append(r.id)
            elif same is not None and same in self.earlier:
                chunk.later.append(r)
            else:
                if same is not None:
                    first[same] = r.id
                    chunk.copies[r.id] = []
                (reads if r.kind in PICKLED else light).append(r)
        self.earlier.update(first)
        self._send(chunk, reads, light)
        return chunk

    def _send(self, chunk: _Chunk, reads: list[Pending], light: list[Pending], alone: bool = False) -> None:
        """Jobs for the entries: pickles PICKLE_BATCH to a job, the light ones LIGHT_BATCH; with
        `alone`, each entry a job of its own (so a failure is only its own)."""
        jobs = []
        for rows, per in ((reads, 1 if alone else PICKLE_BATCH), (light, 1 if alone else LIGHT_BATCH)):
            for i in range(0, len(rows), per):
                part = rows[i : i + per]
                if len(part) == 1:
                    r = part[0]
                    jobs.append(Job(next(self.ids), chunk.run, self.root, r.kind, r.key, r.ref, (), self.root_id))
                else:
                    items = tuple((r.kind, r.key, r.ref) for r in part)
                    jobs.append(Job(next(self.ids), chunk.run, self.root, BATCH, "", None, items, self.root_id))
                chunk.jobs[jobs[-1].id] = [r.id for r in part]
        self.stream.submit(jobs)

    def finish(self, sql: Sql, chunk: _Chunk) -> set[int]:
        """Wait for the chunk's results; returns the ids of the rows whose files were read."""
        self._collect(chunk)
        again: list[Pending] = []
        for rid, others in chunk.copies.items():
            d = chunk.described[rid]
            if d.row.get("corrupt"):  # not the content's fault, perhaps (unreadable): each is read
                again.extend(r for r in chunk.rows if r.id in set(others))
            else:
                chunk.described.update((o, d) for o in others)
                chunk.hits += len(others)
        if chunk.later:  # an earlier chunk read their content and kept it (when it parsed cleanly)
            kept, n = _from_content(sql, chunk.later)
            chunk.described.update(kept)
            chunk.hits += n
            again.extend(r for r in chunk.later if r.id not in kept)
        if again:
            self._send(chunk, again, [])
            self._collect(chunk)
        return {rid for rids in chunk.jobs.values() for rid in rids}

    def _collect(self, chunk: _Chunk) -> None:
        waiting = [j for j in chunk.jobs if chunk.jobs[j][0] not in chunk.described]
        again: list[int] = []
        for j in waiting:
            while j not in self.got:
                job, result = self.stream.get()
                self.got[job.id] = result
            result = self.got.pop(j)
            rids = chunk.jobs[j]
            if isinstance(result, list) and len(result) == len(rids):
                chunk.described.update(zip(rids, result, strict=True))
            elif len(rids) > 1:  # a batch whose worker died or ran out of time: each of its entries alone
                again.extend(chunk.jobs.pop(j))
            elif isinstance(result, Described):
                chunk.described[rids[0]] = result
        if again:
            by_id = {r.id: r for r in chunk.rows}
            rows = [by_id[rid] for rid in again]
            self._send(
                chunk, [r for r in rows if r.kind in PICKLED], [r for r in rows if r.kind not in PICKLED], alone=True
            )
            self._collect(chunk)


def _finish(
    conns: Connections,
    cache_id: int,
    reader: _Reader,
    chunk: _Chunk,
    out: ParseResult,
    total: int,
    progress: Progress | None,
) -> None:
    with conns.reading() as sql:
        read = reader.finish(sql, chunk)
    with conns.writing() as sql:
        _write_parsed(sql, cache_id, chunk.rows, chunk.described, read, out)
    out.from_content += chunk.hits
    out.parsed += len(chunk.rows)
    if progress:
        progress(out.parsed, total)


def _from_content(sql: Sql, rows: list[Pending]) -> tuple[dict[int, Described], int]:
    """Described entries for the pending rows whose content was parsed before (same name and
    size), when every component set they name is still stored."""
    keyed = {(r.content, r.bytes) for r in rows if r.kind in CONTENT_NAMED and r.content}
    if not keyed:
        return {}, 0
    cached: dict[tuple[str, int], tuple] = {}
    for names in chunks(sorted({name for name, _ in keyed})):  # (by name: the other sizes are passed over)
        for name, size, *kept in sql.rows(
            f'SELECT name, bytes, kind, "row", refs, parts FROM parsed_content WHERE {sql.in_("name")} AND reader = ?',
            (sql.values(names), parse.READER),
        ):
            if (name, size) in keyed and (c := _kept(sql, *kept)) is not None:
                cached[(name, size)] = c
    digests = {d for c in cached.values() for d in c[3].values()}
    have: set[str] = set()
    for part in chunks(sorted(digests)):
        have.update(
            d for (d,) in sql.rows(f"SELECT digest FROM component_sets WHERE {sql.in_('digest')}", (sql.values(part),))
        )
    out = {}
    for r in rows:
        c = cached.get((r.content, r.bytes))  # type: ignore[arg-type]
        if c is not None and c[0] == r.kind and set(c[3].values()) <= have:
            out[r.id] = Described(dict(c[1]), list(c[2]), {p: (d, None) for p, d in c[3].items()})
    return out, len(out)


def _kept(sql: Sql, kind: str, row: Any, refs: Any, parts: Any) -> tuple | None:
    """A kept parse result as (kind, row, refs, parts), or None where it is not one this
    reader writes (a damaged row of a shared index): that entry is read instead, and its result
    kept over the damaged one."""
    try:
        row, refs, parts = sql.from_json(row), sql.from_json(refs), sql.from_json(parts)
    except (ValueError, TypeError, RecursionError):
        return None
    if not (isinstance(row, dict) and all(_fits(c, row.get(c)) for c in WRITTEN_COLUMNS)):
        return None
    if not (isinstance(refs, list) and all(isinstance(x, list) and len(x) == 2 for x in refs)):
        return None
    if not all(isinstance(v, str) for x in refs for v in x):
        return None
    parts = {} if parts is None else parts
    if not (isinstance(parts, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in parts.items())):
        return None
    return kind, row, [tuple(x) for x in refs], parts


def _fits(column: str, value: Any) -> bool:
    """Whether `value` is one phase two writes to `column`: a finite float of seconds or None for
    compile_seconds (an int is not one: 10**400 is not a float, 10**20 no SQLite integer), text or
    None for the rest."""
    if value is None:
        return True
    if column == "compile_seconds":
        return type(value) is float and math.isfinite(value)
    return isinstance(value, str)


def _write_parsed(
    sql: Sql, cache_id: int, rows: list[Pending], described: dict[int, Described], read: set[int], out: ParseResult
) -> None:
    """Write what parsing said, for the rows still pending now (another process may have
    written them, or an eviction deleted them, since they were read)."""
    # The write lock (SQLite) or the cache row's lock (PostgreSQL) first: a no-op write, not of
    # the key (whose change checks every child row). Writers of one cache then take turns.
    sql.run("UPDATE caches SET last_scan = last_scan WHERE id = ?", (cache_id,))
    still: dict[int, int] = {}  # id -> parse state now
    for ids in chunks([r.id for r in rows]):
        still.update(
            sql.rows(
                f"SELECT id, parse_state FROM entries WHERE {sql.in_('id')} AND parse_state <> ?",
                (sql.values(ids), PARSED),
            )
        )
    rows = [r for r in rows if r.id in still]
    if not rows:
        return
    seen_before = [r.id for r in rows if still[r.id] != PENDING_NEW]  # (a new row has no refs or sets yet)
    replaced = sets_of(sql, seen_before)  # sets a changed entry had: kept while still used
    for ids in chunks(seen_before):
        sql.run(f"DELETE FROM entry_refs WHERE {sql.in_('entry_id')}", (sql.values(ids),))
        sql.run(f"DELETE FROM entry_component_sets WHERE {sql.in_('entry_id')}", (sql.values(ids),))
    sql.many(WRITE_ENTRY, [(PARSED, *map(described[r.id].row.get, WRITTEN_COLUMNS), r.id) for r in rows])
    sets = ComponentSets(sql, [described[r.id].parts for r in rows])
    refs: list[tuple] = []
    entry_sets: list[tuple] = []
    for r in rows:
        d = described[r.id]
        refs.extend([(r.id, kind, ref) for kind, ref in d.refs])
        entry_sets.extend([(r.id, part, set_id) for part, set_id in sets.ids_for(d.parts).items()])
        if d.row.get("corrupt") and len(out.corrupt) < MAX_REPORTED:
            out.corrupt.append((r.key, d.row["corrupt"]))
    sets.flush()
    sql.many("INSERT INTO entry_refs (entry_id, kind, ref) VALUES (?, ?, ?)", refs)
    sql.many("INSERT INTO entry_component_sets (entry_id, part, set_id) VALUES (?, ?, ?)", entry_sets)
    drop_unused_sets(sql, replaced)
    events = _new_events(sql, cache_id, [r for r in rows if r.parse_state == PENDING_NEW], described)
    sql.many(
        f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) VALUES ({', '.join('?' * len(EVENT_COLUMNS))})",
        [tuple(e[c] for c in EVENT_COLUMNS) for e in events],
    )
    out.new_events.extend(events[: MAX_REPORTED - len(out.new_events)])
    _keep_content(sql, [r for r in rows if r.id in read], described)


def _new_events(sql: Sql, cache_id: int, new_rows: list[Pending], described: dict[int, Described]) -> list[dict]:
    """A 'new' event per newly compiled graph; a recompile when its graph key had an entry before."""
    graphs = [
        (r, d.row.get("graph_key"))
        for r in sorted(new_rows, key=lambda r: r.mtime)
        if r.kind == Kind.FXGRAPH and not (d := described[r.id]).row.get("corrupt")
    ]
    keys = list({gk for _, gk in graphs if gk})
    new_ids = sql.values([r.id for r, _ in graphs])
    known: set[str | None] = set()
    for part in chunks(keys):
        known.update(
            gk
            for (gk,) in sql.rows(
                f"SELECT DISTINCT graph_key FROM entries WHERE cache_id = ? AND {sql.in_('graph_key')} "
                f"AND NOT {sql.in_('id')}",
                (cache_id, sql.values(part), new_ids),
            )
        )
    events = []
    for r, gk in graphs:
        events.append(
            {
                "cache_id": cache_id,
                "ts": r.mtime,
                "kind": str(Ev.NEW),
                "entry_kind": r.kind,
                "entry_key": r.key,
                "graph_key": gk,
                "recompile": gk in known,
                "bytes": r.bytes,
                "seconds": described[r.id].row.get("compile_seconds"),
            }
        )
        known.add(gk)
    return events


def _keep_content(sql: Sql, rows: list[Pending], described: dict[int, Described]) -> None:
    """Keep the parse results of content-named entries that parsed cleanly, for their next copy,
    over any kept before: another reader version's, a damaged one, or one whose component sets
    are gone (an entry is read again only then, or when another writer read it meanwhile)."""
    kept: dict[tuple[str, int], tuple] = {}
    for r in rows:
        d = described[r.id]
        if r.kind in CONTENT_NAMED and r.content and not d.row.get("corrupt"):
            parts = {p: digest for p, (digest, _) in d.parts.items()}
            kept[(r.content, r.bytes)] = (
                r.content,
                r.bytes,
                r.kind,
                json.dumps(d.row),
                json.dumps(d.refs),
                json.dumps(parts),
                time.time(),
                parse.READER,
            )
    j = sql.json_mark
    sql.many(
        f"INSERT INTO parsed_content (name, bytes, {', '.join(KEPT_COLUMNS)}) VALUES (?, ?, ?, {j}, {j}, {j}, ?, ?) "
        f"ON CONFLICT (name, bytes) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in KEPT_COLUMNS)}",
        [kept[k] for k in sorted(kept)],  # (in key order, as ComponentSets: no two writers deadlock)
    )


def sets_of(sql: Sql, entry_ids: list[int]) -> set[int]:
    """The component sets these entries link to."""
    out: set[int] = set()
    for ids in chunks(entry_ids):
        out.update(
            s
            for (s,) in sql.rows(
                f"SELECT set_id FROM entry_component_sets WHERE {sql.in_('entry_id')}", (sql.values(ids),)
            )
        )
    return out


def drop_unused_sets(sql: Sql, set_ids: set[int]) -> None:
    """Of these component sets, delete those no entry links to (only these are looked at: an
    index of many thousand sets is not scanned for each batch)."""
    for ids in chunks(sorted(set_ids)):
        sql.run(
            f"DELETE FROM component_sets WHERE {sql.in_('id')} AND NOT EXISTS "
            "(SELECT 1 FROM entry_component_sets WHERE entry_component_sets.set_id = component_sets.id)",
            (sql.values(ids),),
        )


class ComponentSets:
    """Deduplicated component sets: an entry's components split by part, each part stored once
    per distinct content (digest) and shared by every entry that has the same one."""

    def __init__(self, sql: Sql, parts: list[Parts]) -> None:
        """`parts`: those of the entries about to be written (a describer sends a part's items
        with one entry only: they are gathered from all first); the index's other sets stay
        unread. The sets not stored yet are made here, in digest order: another writer (a host
        of a fleet index, in a transaction of its own) may be making some of the same ones; on
        PostgreSQL this waits for its end and takes its row, and two writers that both go in
        digest order never wait for each other in a circle (a deadlock)."""
        self.sql = sql
        items: dict[str, tuple[str, list[parse.Component]]] = {}  # digest -> (part, items)
        for entry_parts in parts:
            for part, (digest, its) in entry_parts.items():
                if its is not None:
                    items.setdefault(digest, (part, its))
        digests = sorted({digest for entry_parts in parts for digest, _ in entry_parts.values()})
        self.known: dict[str, int] = {}
        for some in chunks(digests):
            self.known.update(
                sql.rows(f"SELECT digest, id FROM component_sets WHERE {sql.in_('digest')}", (sql.values(some),))
            )
        # (a digest neither stored nor sent here: a describer counted it as sent in a run that
        # wrote nothing; it is not stored, and its entries go without it)
        self.ours = [d for d in digests if d not in self.known and d in items]
        self.items = {d: items[d][1] for d in self.ours}
        made = []
        for d in self.ours:  # (one at a time: a statement's rowcount says whether it made the row)
            if self.sql.run(
                "INSERT INTO component_sets (digest, part) VALUES (?, ?) ON CONFLICT (digest) DO NOTHING",
                (d, items[d][0]),
            ):
                made.append(d)
        for some in chunks(self.ours):
            self.known.update(
                sql.rows(f"SELECT digest, id FROM component_sets WHERE {sql.in_('digest')}", (sql.values(some),))
            )
        self.ours = made  # another writer's sets come with their items

    def ids_for(self, parts: Parts) -> dict[str, int]:
        return {part: self.known[digest] for part, (digest, _) in parts.items() if digest in self.known}

    def flush(self) -> None:
        """The items of the sets made here."""
        self.sql.many(
            "INSERT INTO component_set_items (set_id, name, hash, value) VALUES (?, ?, ?, ?)",
            [(self.known[d], c.name, c.hash, c.value) for d in self.ours for c in self.items[d]],
        )
        self.ours = []
