"""The Redis tier: PyTorch's own remote cache, read and written in exactly the form Inductor uses.

What torch's source says (torch 2.11 and 2.13, `torch/_inductor/remote_cache.py`, `codecache.py`,
`_functorch/_aot_autograd/autograd_cache.py`):

- key `pt2:<cache id>::<key>:c1`, where the cache id is `fx-graph-v1` (FxGraphCache; key = the
  fxgraph key, the directory name under fxgraph/<2ch>/), `autograd-experimental` (AOTAutograd;
  key = the directory name under aotautograd/), `bundled-autotune-v1`, `dynamo-pgo`, or a
  hash of the kernel configs (per-kernel autotune results);
- value: JSON `{"data": base64(pickle), "time_taken_ms": N}`, where the pickle is byte for byte
  the local entry file; plain SET/GET, no TTL, one value per key (a local key with several
  guard sets can publish only one of them);
- the Redis database comes from `TORCHINDUCTOR_REDIS_URL` (its /N picks the db number), else
  `TORCHINDUCTOR_REDIS_HOST`/`_PORT` (db 0). There is no key prefix to set.

Redis has no access times of ours, so eviction reads Redis's own: `OBJECT IDLETIME` (seconds
since the last command touched the key: an Inductor GET resets it) and `MEMORY USAGE`; neither
touches the key (STRLEN or GET would). What only cachemgr knows (who pushed a key, and which
fxgraph keys an AOT entry needs) is kept in one side hash, META_KEY, under the `cachemgr:` prefix.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from cachemgr.errors import NotFound, RemoteError, UsageError
from cachemgr.index.describe import read_unseen

KEY_VERSION = 1  # the `:c1` suffix: remote_cache.RedisRemoteCache's `version`
FX_CACHE_ID = "fx-graph-v1"
AOT_CACHE_ID = "autograd-experimental"
CACHE_KINDS = {  # cache id -> kind; any other id is a per-kernel autotune result
    FX_CACHE_ID: "fxgraph",
    AOT_CACHE_ID: "aotautograd",
    "bundled-autotune-v1": "bundled-autotune",
    "dynamo-pgo": "dynamo-pgo",
}
REMOTE_KINDS = ("fxgraph", "aotautograd", "autotune", "bundled-autotune", "dynamo-pgo")
META_KEY = "cachemgr:meta"  # hash: redis key -> JSON {host, ts, bytes, torch, source, refs}
_KEY = re.compile(r"^pt2:(?P<id>.+?)::(?P<key>.*):c(?P<v>\d+)$")
BATCH = 500  # keys per pipeline / script call


# -- keys and values ------------------------------------------------------------------------

def redis_key(cache_id: str, key: str) -> str:
    return f"pt2:{cache_id}::{key}:c{KEY_VERSION}"


def parse_key(rkey: str) -> tuple[str, str, str] | None:
    """(kind, cache id, inductor key) of a remote-cache key; None for keys that are not torch's."""
    m = _KEY.match(rkey)
    if not m:
        return None
    return CACHE_KINDS.get(m.group("id"), "autotune"), m.group("id"), m.group("key")


def encode_value(content: bytes, time_taken_ms: int) -> bytes:
    """What FxGraphCache._save_graph / AOTAutogradCache.save put: RemoteCacheJsonSerde of this dict."""
    return json.dumps({"data": base64.b64encode(content).decode("ascii"), "time_taken_ms": int(time_taken_ms)}).encode("ascii")


def decode_value(raw: bytes) -> bytes:
    """The pickle inside a value, as GuardedCache.iterate_over_candidates reads it."""
    try:
        return base64.b64decode(json.loads(raw)["data"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"not a remote-cache value: {e}") from e


# -- connecting -----------------------------------------------------------------------------

def resolve_url(url: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The Redis Inductor would use: the configured URL, else TORCHINDUCTOR_REDIS_URL, else
    TORCHINDUCTOR_REDIS_HOST/_PORT (Inductor's defaults: localhost:6379, db 0)."""
    if url:
        return url
    if environ.get("TORCHINDUCTOR_REDIS_URL"):
        return environ["TORCHINDUCTOR_REDIS_URL"]
    host = environ.get("TORCHINDUCTOR_REDIS_HOST", "localhost")
    port = environ.get("TORCHINDUCTOR_REDIS_PORT", "6379")
    return f"redis://{host}:{port}/0"


def redact_url(url: str) -> str:
    """The URL fit for messages: any password replaced."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def inductor_env(url: str) -> dict[str, str]:
    """Environment that turns Inductor's remote FX graph and AOTAutograd caches on against `url`."""
    return {"TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_REDIS_URL": url}


T = TypeVar("T")


class Remote:
    """One Redis remote cache. Every redis-py error leaves as a one-line RemoteError."""

    def __init__(self, url: str, connect_timeout: float = 3.0, timeout: float = 30.0) -> None:
        try:
            import redis
        except ImportError as e:
            raise RemoteError("the Redis tier needs redis-py: pip install 'cachemgr[fleet]'") from e
        self.url = url
        self.shown = redact_url(url)
        try:
            self.r = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                                          retry_on_timeout=False)
        except ValueError as e:
            raise RemoteError(f"bad Redis URL {self.shown}: {e}") from e

    def call(self, fn: Callable[[], T]) -> T:
        import redis

        try:
            return fn()
        except redis.exceptions.AuthenticationError as e:
            raise RemoteError(f"Redis at {self.shown} refused our credentials: {_line(e)}") from e
        except redis.exceptions.TimeoutError as e:
            raise RemoteError(f"Redis at {self.shown} timed out: {_line(e)}") from e
        except redis.exceptions.ConnectionError as e:
            raise RemoteError(f"cannot reach Redis at {self.shown}: {_line(e)}") from e
        except redis.exceptions.ResponseError as e:
            if str(e).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise RemoteError(f"Redis at {self.shown} refused us: {_line(e)}") from e
            raise RemoteError(f"Redis at {self.shown} answered an error: {_line(e)}") from e
        except redis.exceptions.RedisError as e:
            raise RemoteError(f"Redis at {self.shown}: {type(e).__name__}: {_line(e)}") from e

    def ping(self) -> None:
        self.call(self.r.ping)

    def close(self) -> None:
        self.r.close()

    # -- reading without touching ----------------------------------------------------------

    def torch_keys(self) -> list[str]:
        return self.call(lambda: [k.decode() for k in self.r.scan_iter(match="pt2:*", count=1000)])

    def inspect(self, keys: list[str] | None = None) -> list[RemoteKey]:
        """Size and idle time of every remote-cache key, read without moving its idle time."""
        keys = self.torch_keys() if keys is None else keys
        out: list[RemoteKey] = []
        for chunk in _chunks(keys):
            def read(chunk=chunk):
                p = self.r.pipeline(transaction=False)
                for k in chunk:
                    p.memory_usage(k, samples=0)
                    p.object("idletime", k)
                return p.execute(raise_on_error=False)
            res = self.call(read)
            for i, k in enumerate(chunk):
                size, idle = res[2 * i], res[2 * i + 1]
                parsed = parse_key(k)
                if parsed is None or not isinstance(size, int) or not isinstance(idle, int):
                    continue  # gone between SCAN and now
                out.append(RemoteKey(k, parsed[0], parsed[1], parsed[2], size, idle))
        return out

    def meta(self) -> dict[str, dict]:
        raw = self.call(lambda: self.r.hgetall(META_KEY))
        out = {}
        for k, v in raw.items():
            try:
                out[k.decode()] = json.loads(v)
            except ValueError:
                continue
        return out

    def stats(self) -> RemoteStats:
        keys = self.inspect()
        meta = self.meta()
        by_kind = {k: {"entries": 0, "bytes": 0} for k in REMOTE_KINDS}
        for k in keys:
            row = by_kind.setdefault(k.kind, {"entries": 0, "bytes": 0})
            row["entries"] += 1
            row["bytes"] += k.bytes
        dbsize = self.call(self.r.dbsize)
        cachemgr_keys = len(self.call(lambda: list(self.r.scan_iter(match="cachemgr:*", count=1000))))
        return RemoteStats(
            url=self.shown, entries=len(keys), bytes=sum(k.bytes for k in keys), by_kind=by_kind,
            pushed_by_cachemgr=sum(1 for k in keys if meta.get(k.rkey, {}).get("host")),
            max_idle_seconds=max((k.idle for k in keys), default=None),
            other_keys=dbsize - len(keys) - cachemgr_keys,
        )

    def get(self, cache_id: str, key: str) -> bytes | None:
        """The pickle Inductor would read for `key` (a GET: this counts as an access)."""
        raw = self.call(lambda: self.r.get(redis_key(cache_id, key)))
        return None if raw is None else decode_value(raw)

    # -- writing -----------------------------------------------------------------------------

    def push(self, items: list[PushItem], root: str, host: str, force: bool = False) -> PushResult:
        """Publish local entries. Existing keys are kept unless `force` (another host's entry for
        the same key is as good as ours: same key, same inputs)."""
        pushed, present, missing = [], [], []
        nbytes = 0
        now = time.time()
        for chunk in _chunks(items, 50):  # values are megabytes: small pipelines
            payload = []
            for it in chunk:
                try:
                    content = read_unseen(root, it.path)  # our read, not a hit
                except OSError:
                    missing.append(it.path)
                    continue
                payload.append((it, encode_value(content, it.time_taken_ms)))

            def write(payload=payload):
                p = self.r.pipeline(transaction=False)
                for it, value in payload:
                    p.set(it.rkey, value, nx=not force)
                return p.execute()
            done = self.call(lambda: write()) if payload else []
            meta = {}
            for (it, value), ok in zip(payload, done):
                if ok:
                    pushed.append(it.rkey)
                    nbytes += len(value)
                    meta[it.rkey] = json.dumps({"host": host, "ts": now, "bytes": len(value), "torch": it.torch_version,
                                                "source": it.path, "refs": it.refs})
                else:
                    present.append(it.rkey)
            if meta:
                self.call(lambda: self.r.hset(META_KEY, mapping=meta))
        return PushResult(pushed=pushed, present=present, missing=missing, bytes=nbytes)

    # -- eviction ----------------------------------------------------------------------------

    def aot_refs(self, keys: list[RemoteKey]) -> dict[str, list[str]]:
        """fxgraph keys each AOT entry needs: from META_KEY, else read once and remembered there.

        Reading an entry Inductor wrote itself resets its idle time once (a GET touches); that
        errs on the side of keeping it.
        """
        from cachemgr import parse

        meta = self.meta()
        out: dict[str, list[str]] = {}
        learn: dict[str, str] = {}
        for k in keys:
            if k.kind != "aotautograd":
                continue
            m = meta.get(k.rkey)
            if m is not None and "refs" in m:
                out[k.rkey] = list(m["refs"])
                continue
            raw = self.call(lambda k=k: self.r.get(k.rkey))
            if raw is None:
                continue
            try:
                refs = [ref for kind, ref in parse.parse_aotautograd(decode_value(raw)).refs if kind == "fxgraph"]
            except ValueError:
                refs = []
            out[k.rkey] = refs
            learn[k.rkey] = json.dumps({**(m or {}), "seen": time.time(), "refs": refs})
        if learn:
            self.call(lambda: self.r.hset(META_KEY, mapping=learn))
        return out

    def execute(self, plan: EvictPlan) -> EvictResult:
        """Delete the plan's keys, each only if nothing read it since the plan (idle not reset)."""
        script = self.r.register_script(_EVICT_LUA)
        deleted: list[str] = []
        for chunk in _chunks(list(plan.victims)):
            done = self.call(lambda chunk=chunk: script(keys=[META_KEY, *(v.rkey for v in chunk)],
                                                        args=[v.idle for v in chunk]))
            deleted.extend(d.decode() if isinstance(d, bytes) else d for d in done)
        gone = set(deleted)
        freed = sum(v.bytes for v in plan.victims if v.rkey in gone)
        kept = [v.rkey for v in plan.victims if v.rkey not in gone]
        return EvictResult(deleted=deleted, skipped_in_use=kept, freed_bytes=freed)


# OBJECT IDLETIME does not touch the key; a key read since the plan has a smaller idle time now.
_EVICT_LUA = """
local out = {}
for i = 2, #KEYS do
  local idle = redis.call('OBJECT', 'IDLETIME', KEYS[i])
  if idle and idle >= tonumber(ARGV[i - 1]) then
    redis.call('UNLINK', KEYS[i])
    redis.call('HDEL', KEYS[1], KEYS[i])
    table.insert(out, KEYS[i])
  end
end
return out
"""


# -- results --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RemoteKey:
    rkey: str
    kind: str
    cache_id: str
    key: str
    bytes: int  # MEMORY USAGE: what the key costs Redis, value and overhead
    idle: int  # seconds since last access (OBJECT IDLETIME)


@dataclass(frozen=True)
class RemoteStats:
    url: str
    entries: int
    bytes: int
    by_kind: dict[str, dict[str, int]]
    pushed_by_cachemgr: int
    max_idle_seconds: int | None
    other_keys: int  # keys in this Redis db that are neither torch's nor ours

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "entries": self.entries, "bytes": self.bytes, "by_kind": self.by_kind,
                "pushed_by_cachemgr": self.pushed_by_cachemgr, "max_idle_seconds": self.max_idle_seconds,
                "other_keys": self.other_keys}


@dataclass(frozen=True)
class PushItem:
    rkey: str
    kind: str
    key: str  # the inductor key
    path: str  # the local entry file, relative to the root
    time_taken_ms: int
    torch_version: str | None = None
    refs: list[str] = field(default_factory=list)  # fxgraph keys an AOT entry needs


@dataclass(frozen=True)
class PushResult:
    pushed: list[str]
    present: list[str]  # already in Redis: left as they are
    missing: list[str]  # in the index but gone from disk
    bytes: int
    skipped_guard_sets: int = 0  # extra local entries of one key (Redis holds one per key)

    def as_dict(self) -> dict[str, Any]:
        return {"pushed": len(self.pushed), "present": len(self.present), "missing": self.missing,
                "bytes": self.bytes, "skipped_guard_sets": self.skipped_guard_sets, "keys": self.pushed}


@dataclass(frozen=True)
class Victim:
    rkey: str
    kind: str
    bytes: int
    idle: int
    reason: str  # age | size | needs-evicted-graph


@dataclass(frozen=True)
class EvictPlan:
    victims: tuple[Victim, ...]
    total_bytes: int
    expected_freed_bytes: int
    kept_young: int  # keys the size cap wanted but the grace period protects

    def as_dict(self) -> dict[str, Any]:
        return {"total_bytes": self.total_bytes, "expected_freed_bytes": self.expected_freed_bytes,
                "victims": [v.__dict__ for v in self.victims], "kept_young": self.kept_young}


@dataclass(frozen=True)
class EvictResult:
    deleted: list[str]
    skipped_in_use: list[str]  # read between plan and delete: kept
    freed_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"deleted": len(self.deleted), "skipped_in_use": self.skipped_in_use, "freed_bytes": self.freed_bytes}


# -- planning (pure) ------------------------------------------------------------------------

def plan_eviction(keys: list[RemoteKey], aot_refs: Mapping[str, list[str]], max_size: int | None,
                  max_age: float | None, low_water: float = 0.9, grace: float = 60.0) -> EvictPlan:
    """Which keys to delete: older than max_age, then least recently used down to
    low_water * max_size; an AOT entry whose fxgraph is evicted goes with it (it could only miss)."""
    total = sum(k.bytes for k in keys)
    chosen: dict[str, Victim] = {}
    needed_by: dict[str, list[RemoteKey]] = {}  # fxgraph key -> the AOT entries that need it
    for k in keys:
        if k.kind == "aotautograd":
            for fx in aot_refs.get(k.rkey, ()):
                needed_by.setdefault(fx, []).append(k)

    def take(k: RemoteKey, reason: str) -> int:
        """Choose k and the AOT entries it leaves useless; the bytes that frees."""
        freed = 0
        if k.rkey not in chosen:
            chosen[k.rkey] = Victim(k.rkey, k.kind, k.bytes, k.idle, reason)
            freed += k.bytes
        if k.kind == "fxgraph":
            for a in needed_by.get(k.key, ()):
                if a.rkey not in chosen:
                    chosen[a.rkey] = Victim(a.rkey, a.kind, a.bytes, a.idle, "needs-evicted-graph")
                    freed += a.bytes
        return freed

    remaining = total
    for k in keys:
        if max_age is not None and k.idle > max_age and k.idle >= grace:
            remaining -= take(k, "age")
    young = 0
    if max_size is not None and remaining > max_size:
        target = int(max_size * low_water)
        for k in sorted(keys, key=lambda k: (-k.idle, -k.bytes)):
            if remaining <= target:
                break
            if k.rkey in chosen:
                continue
            if k.idle < grace:
                young += 1
                continue
            remaining -= take(k, "size")
    victims = tuple(chosen.values())
    return EvictPlan(victims, total, sum(v.bytes for v in victims), young)


# -- what to push (reads the local index) ---------------------------------------------------

def push_items(conn, cache_id: int, model: str | None = None, graph: str | None = None) -> tuple[list[PushItem], int]:
    """The local fxgraph and AOT entries to publish, and how many extra guard sets were left out.

    No selector: every entry. `graph`: that fxgraph or AOT key. `model`: the fxgraph entries whose
    input signature was recorded for that model (the shapes table). Either way the AOT <-> FX
    edges are followed, so an AOT entry travels with the graphs it needs and the other way round.
    """
    from sqlalchemy import select

    from cachemgr.index.models import Entry, EntryRef

    e, r = Entry.__table__, EntryRef.__table__
    rows = conn.execute(
        select(e.c.id, e.c.key, e.c.kind, e.c.ref, e.c.mtime, e.c.compile_seconds, e.c.torch_version, e.c.signature_hash)
        .where(e.c.cache_id == cache_id, e.c.kind.in_(("fxgraph", "aotautograd")), e.c.corrupt.is_(None))
    ).fetchall()
    edges: dict[int, list[str]] = {}
    for eid, ref in conn.execute(select(r.c.entry_id, r.c.ref).join(e, e.c.id == r.c.entry_id).where(
            e.c.cache_id == cache_id, e.c.kind == "aotautograd", r.c.kind == "fxgraph")):
        edges.setdefault(eid, []).append(ref)

    if graph is None and model is None:
        wanted = {row.ref for row in rows}
    else:
        if graph is not None:
            seeds = {row.ref for row in rows if row.ref == graph}
            what = f"graph {graph!r}"
        else:
            from cachemgr.index.queries import model_graphs

            graphs = model_graphs(conn, cache_id, model)
            seeds = {row.ref for row in rows if row.kind == "fxgraph" and row.ref in graphs}
            what = f"model {model!r}"
        if not seeds:
            raise NotFound(f"no fxgraph or aotautograd entry for {what} in the index (run: cachemgr scan; "
                           "list graphs with: cachemgr ls --kind fxgraph)")
        wanted = _closure(seeds, rows, edges)

    best: dict[str, Any] = {}
    extra = 0
    for row in rows:
        if row.ref not in wanted:
            continue
        if row.ref in best:
            extra += 1
            if row.mtime <= best[row.ref].mtime:
                continue
        best[row.ref] = row  # several guard sets under one key: Redis holds one, the newest
    items = []
    for row in sorted(best.values(), key=lambda x: (x.kind != "fxgraph", x.key)):
        cache = FX_CACHE_ID if row.kind == "fxgraph" else AOT_CACHE_ID
        items.append(PushItem(redis_key(cache, row.ref), row.kind, row.ref, row.key,
                              int((row.compile_seconds or 0) * 1000), row.torch_version, edges.get(row.id, [])))
    return items, extra


def _closure(seeds: set[str], rows: list, edges: dict[int, list[str]]) -> set[str]:
    aot_needs = {row.ref: set(edges.get(row.id, ())) for row in rows if row.kind == "aotautograd"}
    wanted = set(seeds)
    while True:
        more = set()
        for aot, fx in aot_needs.items():
            if aot in wanted:
                more |= fx
            elif fx & wanted:
                more.add(aot)
        if more <= wanted:
            return wanted
        wanted |= more


# -- retry with backoff ---------------------------------------------------------------------

@dataclass
class Backoff:
    """Exponential backoff with jitter for a loop that must go on without the remote tier
    (the daemon): `ready()` says whether to try now; report each outcome."""

    base: float = 1.0
    cap: float = 300.0
    factor: float = 2.0
    jitter: float = 0.1
    failures: int = 0
    next_try: float = 0.0
    last_error: str | None = None

    def delay(self) -> float:
        d = min(self.cap, self.base * self.factor ** max(0, self.failures - 1))
        return d * (1 + random.uniform(-self.jitter, self.jitter))

    def ready(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.next_try

    def failed(self, error: BaseException | str, now: float | None = None) -> float:
        self.failures += 1
        self.last_error = str(error)
        d = self.delay()
        self.next_try = (time.monotonic() if now is None else now) + d
        return d

    def succeeded(self) -> None:
        self.failures, self.next_try, self.last_error = 0, 0.0, None


def retry(fn: Callable[[], T], attempts: int = 4, base: float = 0.5, cap: float = 30.0,
          retry_on: tuple[type[BaseException], ...] = (RemoteError,),
          sleep: Callable[[float], None] = time.sleep,
          on_retry: Callable[[int, BaseException, float], None] | None = None) -> T:
    """Call `fn`, retrying `retry_on` errors with exponential backoff; the last error propagates."""
    if attempts < 1:
        raise UsageError("attempts must be >= 1")
    b = Backoff(base=base, cap=cap)
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except retry_on as e:
            if attempt == attempts:
                raise
            d = b.failed(e, now=0.0)
            if on_retry:
                on_retry(attempt, e, d)
            sleep(d)
    raise AssertionError("unreachable")


def _chunks(items: list, n: int = BATCH) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def iter_kinds(stats: RemoteStats) -> Iterable[tuple[str, int, int]]:
    for kind, row in stats.by_kind.items():
        if row["entries"]:
            yield kind, row["entries"], row["bytes"]
