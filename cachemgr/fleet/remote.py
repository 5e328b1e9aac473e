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

Everything in Redis is hostile input (any client of that Redis can write there): a key that is not
UTF-8, too long or not printable, a list or hash under a `pt2:` name, a value that is not JSON,
nests deeply, carries no base64 `data`, is too large to read, or whose pickle cannot be read (or
is built to attack a reader) each becomes a `Skipped` item with its reason in the command's
output, never an abort. Only Redis failing as a whole is a RemoteError.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlparse

from cachemgr import layout, safefs
from cachemgr.config import redact_url
from cachemgr.errors import NotFound, RemoteError, UsageError
from cachemgr.index.dbapi import chunks
from cachemgr.index.describe import read_unseen

if TYPE_CHECKING:  # redis is imported where it is used: an optional dependency
    from redis.typing import EncodableT, FieldT

    from cachemgr.index.store import Store

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
MAX_AOT_GRAPHS = 64  # graphs a remembered AOT entry needs (torch's: a forward and a backward)
MAX_KEY = 1024  # bytes in a key; torch's are under 100
MAX_VALUE = 64 * 1024 * 1024  # bytes of a value cachemgr reads (an AOT entry, to learn its graphs)
MAX_PUSH = 256 * 1024 * 1024  # bytes of a local entry file pushed (base64 must stay under Redis's 512 MB)
MAX_META = 64 * 1024  # bytes of one META_KEY field
# bytes one round trip may bring: the largest answer of ours is a value (MAX_VALUE) or a pipeline
# of BATCH meta fields; a server that sends more (a bulk string of gigabytes) is not Redis
MAX_ANSWER = MAX_VALUE + BATCH * MAX_META + (1 << 20)
READERS = 4  # parse workers reading AOT values at once (each may take WORKER_MEMORY)
BUDGET = 3600.0  # seconds a command may spend waiting on Redis in all (an endless SCAN cursor ends here)


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
    return json.dumps({"data": base64.b64encode(content).decode("ascii"), "time_taken_ms": int(time_taken_ms)}).encode(
        "ascii"
    )


def decode_value(raw: bytes) -> bytes:
    """The pickle inside a value, as GuardedCache.iterate_over_candidates reads it. ValueError
    says why a value is not one: not JSON, nested JSON, no `data`, `data` not base64."""
    doc = small_json(raw, MAX_VALUE, "value")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, str):
        raise ValueError("not a remote-cache value: no base64 'data' field")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not a remote-cache value: 'data' is not base64") from None


def aot_value_refs(raw: bytes) -> list[str]:
    """The fxgraph keys an AOT entry's remote value needs. Run in a parse worker (a BYTES job,
    under its memory and time bounds), never in the command's own process: a value is hostile,
    and its pickle can be built to make the unpickler allocate without bound. ValueError says
    why a value is not one."""
    from cachemgr import parse

    parsed = parse.parse_aotautograd(decode_value(raw))
    if parsed.corrupt:
        raise ValueError(parsed.corrupt)
    return [ref for kind, ref in parsed.refs if kind == "fxgraph"]


def small_json(raw: bytes, limit: int, what: str, max_brackets: int = 16) -> Any:
    """JSON that cachemgr or torch wrote: a flat document (base64 has no brackets, so a value with
    more than a few is not theirs, and is never handed to a recursive parser), at most `limit` bytes."""
    if len(raw) > limit:
        raise ValueError(f"{what} of {len(raw)} bytes, over the {limit} cachemgr reads")
    if raw.count(b"[") + raw.count(b"{") > max_brackets:
        raise ValueError(f"not a remote-cache {what}: nested JSON")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"not a remote-cache {what}: not JSON") from None


def shown_key(raw: bytes | str) -> str:
    """A key fit for a terminal, a log line and JSON: not UTF-8 or not printable, escaped; cut."""
    text = raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:300])
    return text + ("..." if len(raw) > 300 else "")


def check_key(raw: bytes) -> tuple[str | None, str | None]:
    """(the key as text, None) for a torch remote-cache key; (None, why not) for anything else."""
    if len(raw) > MAX_KEY:
        return None, f"key of {len(raw)} bytes, over the {MAX_KEY} a torch key may have"
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "key is not UTF-8"
    if not key.isprintable():
        return None, "key holds characters that are not printable"
    if parse_key(key) is None:
        return None, "not a torch remote-cache key (pt2:<cache id>::<key>:c<N>)"
    return key, None


# -- connecting -----------------------------------------------------------------------------


def configured_url(
    url: str | None, environ: Mapping[str, str] = os.environ, what: str = "remote", flag: str | None = None
) -> str:
    """The Redis Inductor would use: the given URL (`flag` of the command `what`, or redis_url
    from the config, CACHEMGR_REDIS_URL or TORCHINDUCTOR_REDIS_URL), else
    TORCHINDUCTOR_REDIS_HOST/_PORT when either is set (db 0, as Inductor reads them). None of
    these, or a URL that is not one (`check_url`): a UsageError, never a guess."""
    if url:
        return check_url(url)
    if environ.get("TORCHINDUCTOR_REDIS_URL"):
        return check_url(environ["TORCHINDUCTOR_REDIS_URL"])
    host, port = environ.get("TORCHINDUCTOR_REDIS_HOST"), environ.get("TORCHINDUCTOR_REDIS_PORT")
    if host or port:  # read as Inductor reads them (redis.Redis(host=..., port=int(...))), db 0
        try:
            number = int(port or "6379")
        except ValueError:
            number = 0
        if not 0 < number < 65536:
            raise UsageError(f"TORCHINDUCTOR_REDIS_PORT {shown_key(port or '')!r} is not a port number")
        host = host or "localhost"
        if not re.fullmatch(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+", host):  # (a '/', '@' or '#' would name another db)
            raise UsageError(f"TORCHINDUCTOR_REDIS_HOST {shown_key(host)!r} is not a host name or address")
        return check_url(f"redis://{f'[{host}]' if ':' in host else host}:{number}/0")
    raise UsageError(
        f"{what}: no Redis is configured: " + (f"give {flag}, or " if flag else "") + "set redis_url in the "
        "config, CACHEMGR_REDIS_URL or TORCHINDUCTOR_REDIS_URL"
    )


def check_url(url: str) -> str:
    """The URL, if it names one Redis database as redis-py reads it; else a UsageError. redis-py
    takes a scheme it knows and a port that is a number, but a db path that is not a number for db
    0 (`/abc`), and drops the slashes of others (`/1/3` is db 13): a typo would then read, and
    `remote evict` delete, in another database."""
    shown = redact_url(url)
    bad = f"bad Redis URL {shown}: "
    # With credentials, a reason never quotes the URL: a password holding '/', '?' or '#' is read
    # in part as the port, the path or the options, and their text would show it.
    secret = "@" in url.partition("://")[2]
    encode = " (a password holding '/', '?' or '#' is percent-encoded: %2F, %3F, %23)" if secret else ""
    try:
        parts = urlparse(url)
        parts.port  # noqa: B018 - raises ValueError when the port is not a number
    except ValueError as e:
        raise UsageError(bad + ("its port is not a number" + encode if secret else _line(e))) from None
    if not url.lower().startswith(("redis://", "rediss://", "unix://")):
        raise UsageError(bad + "give redis://HOST:PORT/DB, rediss://... or unix:///PATH?db=DB")
    dbs = [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "db"]
    if parts.scheme != "unix" and parts.path not in ("", "/"):
        dbs.append(unquote(parts.path)[1:])
    for db in dbs:
        if not re.fullmatch(r"[0-9]{1,9}", db):
            what = "its database" if secret else repr(shown_key(db))
            raise UsageError(bad + f"{what} is not a database number (0, 1, 2...: redis://HOST:PORT/DB){encode}")
    if len({int(db) for db in dbs}) > 1:
        raise UsageError(bad + "it names two databases (its path and ?db=)")
    query = parse_qsl(parts.query, keep_blank_values=True)
    options = {k.lower() for k, _ in query}
    for option in sorted(options & _DECODING):  # redis-py would hand back text: keys and values are bytes here
        raise UsageError(bad + f"leave out {option}: cachemgr reads Redis's bytes as they are")
    if parts.scheme.lower() != "rediss" and any(k.startswith("ssl") for k in options):
        raise UsageError(bad + "ssl options need rediss://")  # (redis-py fails on them at the first command)
    # redis-py hands an option it does not know to its connection class (a TypeError: `?DB=4`,
    # `?foo=bar`) and some values to the socket as they are (`?socket_timeout=nan`): only the
    # options below pass, each value checked. (Names are case-sensitive there, as in redis-py.)
    known = _OPTIONS if parts.scheme.lower() != "rediss" else {**_OPTIONS, **_SSL_OPTIONS}
    for name, value in query:
        if name not in known:
            what = "an option" if secret else repr(shown_key(name))
            raise UsageError(bad + f"unknown option {what} (cachemgr takes {', '.join(known)}){encode}")
        try:
            known[name](value)
        except ValueError as e:
            raise UsageError(bad + f"{name}: {'not a value it takes' + encode if secret else e}") from None
    return url


_DECODING = frozenset({"decode_responses", "encoding", "encoding_errors"})
MAX_TIMEOUT = 86400.0  # seconds: a larger socket timeout overflows (1e308), and waits for nothing useful


def _seconds(value: str) -> None:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT:  # (NaN is not)
        raise ValueError(f"{shown_key(value)!r} is not a number of seconds over 0 and at most {MAX_TIMEOUT:g}")


def _whole(value: str) -> None:
    if not re.fullmatch(r"[0-9]{1,9}", value):
        raise ValueError(f"{shown_key(value)!r} is not a whole number of seconds")


def _one_of(*allowed: str) -> Callable[[str], None]:
    def check(value: str) -> None:
        if value not in allowed:
            raise ValueError(f"{shown_key(value)!r} is not {' or '.join(allowed)}")

    return check


def _any(value: str) -> None:
    pass


def _bool(value: str) -> None:
    if value.lower() not in ("true", "false", "yes", "no", "on", "off", "1", "0"):
        raise ValueError(f"{shown_key(value)!r} is not true or false")


# URL option -> the check of its value (a ValueError says why not)
_OPTIONS: dict[str, Callable[[str], None]] = {
    "db": _any,  # (checked above)
    "username": _any,
    "password": _any,
    "client_name": _any,
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "socket_keepalive": _bool,
    "health_check_interval": _whole,
    "protocol": _one_of("2", "3"),
}
_SSL_OPTIONS: dict[str, Callable[[str], None]] = {  # rediss:// only
    "ssl_cert_reqs": _one_of("none", "optional", "required"),
    "ssl_check_hostname": _bool,
    "ssl_ca_certs": _any,
    "ssl_ca_path": _any,
    "ssl_certfile": _any,
    "ssl_keyfile": _any,
    "ssl_password": _any,
}


T = TypeVar("T")


class Remote:
    """One Redis remote cache. Every redis-py error leaves as a one-line RemoteError; a URL that
    is not one (`check_url`) is a UsageError, before any connection.

    The socket timeout (`timeout`, or the URL's ?socket_timeout=) bounds each whole answer, not
    only each read: redis-py's is per read, and a server that trickles a byte at a time would
    never meet it. All round trips together get `budget` seconds."""

    def __init__(self, url: str, connect_timeout: float = 3.0, timeout: float = 30.0, budget: float = BUDGET) -> None:
        try:
            import redis
        except ImportError as e:
            raise RemoteError("the Redis tier needs redis-py: pip install 'cachemgr[fleet]'") from e
        self.url = check_url(url)
        self.shown = redact_url(url)
        try:
            self.r = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout, socket_timeout=timeout, retry_on_timeout=False
            )
        except ValueError as e:  # a bad value of another option (?socket_timeout=x): the URL's, as above
            raise UsageError(f"bad Redis URL {self.shown}: {_line(e)}") from e
        self.timeout = float(self.r.connection_pool.connection_kwargs.get("socket_timeout") or timeout)
        self.budget, self.spent = budget, 0.0
        self.read_here: set[str] = set()  # AOT values this object read (GET resets a key's idle time)
        self.received = _Received()
        pool = self.r.connection_pool  # (no connection made yet: each one made from now on is counted)
        pool.connection_class = _counted(pool.connection_class, self.received)

    def call(self, fn: Callable[[], T]) -> T:
        import redis

        if self.spent >= self.budget:
            raise RemoteError(f"Redis at {self.shown} took {self.budget:g} s of this command in all: stopped")
        limit = min(self.timeout, self.budget - self.spent)
        started = time.monotonic()
        self.received.bytes = 0
        try:
            with _deadline(limit):
                return fn()
        except _Late:
            self.r.connection_pool.disconnect()  # (its connection stopped in the middle of an answer)
            if limit < self.timeout:  # what was left of the command's time ran out, not the call's own
                raise RemoteError(
                    f"Redis at {self.shown} took {self.budget:g} s of this command in all: stopped"
                ) from None
            raise RemoteError(f"Redis at {self.shown} timed out: no whole answer within {limit:g} s") from None
        except _TooLarge:
            self.r.connection_pool.disconnect()
            raise RemoteError(
                f"Redis at {self.shown} answered what Redis would not: over {MAX_ANSWER} bytes in one answer"
            ) from None
        except redis.exceptions.AuthenticationError as e:
            raise RemoteError(f"Redis at {self.shown} refused our credentials: {_line(e)}") from e
        except redis.exceptions.TimeoutError as e:
            raise RemoteError(f"Redis at {self.shown} timed out: {_line(e)}") from e
        except redis.exceptions.ConnectionError as e:
            raise RemoteError(f"cannot reach Redis at {self.shown}: {_line(e)}") from e
        except redis.exceptions.ResponseError as e:
            if _refusal(e):
                raise RemoteError(f"Redis at {self.shown} refused us: {_line(e)}") from e
            raise RemoteError(f"Redis at {self.shown} answered an error: {_line(e)}") from e
        except redis.exceptions.RedisError as e:
            raise RemoteError(f"Redis at {self.shown}: {type(e).__name__}: {_line(e)}") from e
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, RecursionError) as e:
            # a server that answers what Redis would not: redis-py reads its handshake's answer
            # as a map (AttributeError on +OK), and recurses once per level of a nested answer;
            # our scripts' answers are checked in the call (`_answers`)
            raise RemoteError(
                f"Redis at {self.shown} answered what Redis would not: {type(e).__name__}: {_line(e)}"
            ) from e
        finally:
            self.spent += time.monotonic() - started

    def ping(self) -> None:
        self.call(self.r.ping)

    def close(self) -> None:
        self.r.close()

    # -- reading without touching ----------------------------------------------------------

    def scan(self, match: str) -> Iterator[tuple[bytes, int]]:
        """(name, its length) of each key matching; a name over MAX_KEY bytes comes as its first
        300 bytes only. Redis allows names of 512 MB, and SCAN hands a name over whole: the Lua
        step below keeps long ones on the server, so a reply holds at most about a MiB of names."""
        step = self.r.register_script(_SCAN_LUA)

        def one(cursor: int) -> tuple[int, list[tuple[bytes, int]]]:
            cursor, short, long = step(args=[cursor, match, MAX_KEY])
            names = [(k, len(k)) for k in short] + [(k, int(n)) for k, n in long]
            if not all(isinstance(k, bytes) for k, _ in names):
                raise TypeError("a SCAN step answered names that are not strings")
            return int(cursor), names

        cursor = 0
        while True:
            cursor, names = self.call(partial(one, cursor))
            yield from names
            if cursor == 0:
                return

    def torch_keys(self, skipped: list[Skipped] | None = None) -> list[str]:
        """Every torch remote-cache key; keys under `pt2:` that are not torch's go to `skipped`."""
        keys: dict[str, None] = {}  # (SCAN may give a key twice: counted, and planned, once)
        for k, n in self.scan("pt2:*"):
            key, problem = (
                check_key(k) if n == len(k) else (None, f"key of {n} bytes, over the {MAX_KEY} a torch key may have")
            )
            if key is not None:
                keys[key] = None
            elif skipped is not None:
                skipped.append(Skipped(shown_key(k) + ("..." if n > len(k) else ""), problem or "?"))
        return list(keys)

    def inspect(self, keys: list[str] | None = None, skipped: list[Skipped] | None = None) -> list[RemoteKey]:
        """Size and idle time of every remote-cache key holding a string, read without moving its
        idle time. A list, hash, set... under a torch key goes to `skipped` (Inductor cannot read
        it, and cachemgr neither counts nor deletes what it does not understand)."""
        skipped = [] if skipped is None else skipped
        keys = self.torch_keys(skipped) if keys is None else keys
        out: list[RemoteKey] = []
        for chunk in chunks(keys, BATCH):

            def read(chunk=chunk):
                p = self.r.pipeline(transaction=False)
                for k in chunk:
                    p.type(k)
                    p.memory_usage(k, samples=0)
                    p.object("idletime", k)
                return p.execute(raise_on_error=False)

            res = self.call(read)
            for i, k in enumerate(chunk):
                typ, size, idle = res[3 * i], res[3 * i + 1], res[3 * i + 2]
                typ = typ.decode(errors="replace") if isinstance(typ, bytes) else typ
                if isinstance(idle, Exception) and "LFU" in str(idle):  # (an error under such a policy)
                    idle = 0
                    if NO_IDLE not in skipped:
                        skipped.append(NO_IDLE)
                parsed = parse_key(k)
                for answer in (typ, size, idle):
                    if isinstance(answer, Exception) and _refusal(answer):
                        raise RemoteError(f"Redis at {self.shown} refused us: {_line(answer)}")
                if typ == "none" or parsed is None or size is None or idle is None:
                    continue  # gone between SCAN and now
                problem = next((a for a in (typ, size, idle) if isinstance(a, Exception)), None)
                if problem is not None or not isinstance(size, int) or not isinstance(idle, int):
                    why = (
                        f"Redis answered an error: {_line(problem)[:200]}"
                        if problem
                        else "an answer Redis would not give"
                    )
                    skipped.append(Skipped(k, f"{why}; neither counted nor deleted"))
                    continue
                if typ != "string":
                    skipped.append(Skipped(k, f"a Redis {typ} under a torch key, not a value Inductor wrote"))
                    continue
                out.append(RemoteKey(k, parsed[0], parsed[1], parsed[2], size, idle))
        return out

    def meta(self, rkeys: list[str], skipped: list[Skipped] | None = None) -> dict[str, dict]:
        """What cachemgr remembers (META_KEY) about these keys. A field that is not our JSON is
        left out (and said in `skipped`); so is the whole hash when META_KEY is not a hash."""
        typ = self.call(lambda: self.r.type(META_KEY))
        typ = typ.decode(errors="replace") if isinstance(typ, bytes) else typ
        if typ == "none" or not rkeys:
            return {}
        if typ != "hash":
            if skipped is not None:
                skipped.append(Skipped(META_KEY, f"a Redis {typ}, not cachemgr's hash: ignored"))
            return {}
        out: dict[str, dict] = {}
        read = self.r.register_script(_META_LUA)
        for chunk in chunks(rkeys, BATCH):
            # (bytes: the client does not decode responses; a number: the size of a field too large)
            values = self.call(partial(_answers, read, len(chunk), [META_KEY], [MAX_META, *chunk]))
            for k, v in zip(chunk, values, strict=True):
                if v is None:
                    continue
                try:
                    if isinstance(v, int):
                        raise ValueError(f"meta field of {v} bytes, over the {MAX_META} cachemgr reads")
                    doc = small_json(v, MAX_META, "meta field")
                    if not isinstance(doc, dict):
                        raise ValueError("not a remote-cache meta field: not a JSON object")
                    refs = doc.get("refs")
                    if isinstance(refs, list) and len(refs) > MAX_AOT_GRAPHS:  # (each a str object: held
                        raise ValueError(f"'refs' lists {len(refs)} graphs, not an AOT entry's")  # 16x the field)
                except ValueError as e:
                    if skipped is not None:
                        skipped.append(Skipped(k, f"{META_KEY}: {e}; ignored"))
                    continue
                out[k] = doc
        return out

    def stats(self) -> RemoteStats:
        skipped: list[Skipped] = []
        keys = self.inspect(skipped=skipped)
        not_torchs = len([x for x in skipped if x is not NO_IDLE])  # keys under pt2: that are not torch's values
        meta = self.meta([k.rkey for k in keys], skipped)
        by_kind = {k: {"entries": 0, "bytes": 0} for k in REMOTE_KINDS}
        for k in keys:
            row = by_kind.setdefault(k.kind, {"entries": 0, "bytes": 0})
            row["entries"] += 1
            row["bytes"] += k.bytes
        dbsize = self.call(lambda: int(self.r.dbsize()))
        cachemgr_keys = sum(1 for _ in self.scan("cachemgr:*"))
        return RemoteStats(
            url=self.shown,
            entries=len(keys),
            bytes=sum(k.bytes for k in keys),
            by_kind=by_kind,
            pushed_by_cachemgr=sum(1 for k in keys if meta.get(k.rkey, {}).get("host")),
            max_idle_seconds=None if NO_IDLE in skipped else max((k.idle for k in keys), default=None),
            other_keys=max(0, dbsize - len(keys) - not_torchs - cachemgr_keys),
            skipped=skipped,
        )

    # -- writing -----------------------------------------------------------------------------

    def push(self, items: list[PushItem], root: str, host: str, force: bool = False) -> PushResult:
        """Publish local entries. Existing keys are kept unless `force` (another host's entry for
        the same key is as good as ours: same key, same inputs). A local file that is not a
        regular file or too large, and a key that holds something else than a value, are skipped."""
        with safefs.Root(root) as r:
            return self._push(r, items, host, force)

    def _push(self, r: safefs.Root, items: list[PushItem], host: str, force: bool) -> PushResult:
        pushed, present, missing = [], [], []
        skipped: list[Skipped] = []
        nbytes = 0
        now = time.time()
        for chunk in chunks(items, 50):  # values are megabytes: small pipelines
            taken = self.call(partial(_types, self.r, [it.rkey for it in chunk]))
            payload = []
            for it in chunk:
                if taken.get(it.rkey, "none") not in ("none", "string") and not force:
                    skipped.append(
                        Skipped(
                            it.rkey,
                            f"a Redis {taken[it.rkey]} is stored under this key; left as it is (--force overwrites it)",
                        )
                    )
                    continue
                problem = _local_problem(os.path.join(r.path, it.path))
                if problem == "missing":
                    missing.append(it.path)
                    continue
                if problem:
                    skipped.append(Skipped(it.rkey, f"local entry {it.path}: {problem}"))
                    continue
                try:
                    content = read_unseen(r, layout.fs_path(it.path), MAX_PUSH)  # not a hit
                except FileNotFoundError:
                    missing.append(it.path)
                    continue
                except OSError as e:
                    skipped.append(Skipped(it.rkey, f"local entry {it.path}: cannot read it ({e.strerror})"))
                    continue
                payload.append((it, encode_value(content, it.time_taken_ms)))

            def write(payload=payload):
                p = self.r.pipeline(transaction=False)
                for it, value in payload:
                    p.set(it.rkey, value, nx=not force)
                return p.execute()

            done = self.call(lambda: write()) if payload else []
            meta = {}
            for (it, value), ok in zip(payload, done, strict=True):
                if ok:
                    pushed.append(it.rkey)
                    nbytes += len(value)
                    meta[it.rkey] = json.dumps(
                        {
                            "host": host,
                            "ts": now,
                            "bytes": len(value),
                            "torch": it.torch_version,
                            "source": it.path,
                            "refs": it.refs,
                        }
                    )
                else:
                    present.append(it.rkey)
            if meta:
                self.call(partial(self._remember, meta))
        return PushResult(pushed=pushed, present=present, missing=missing, bytes=nbytes, skipped=skipped)

    def _remember(self, fields: dict[str, str]) -> None:
        """Write META_KEY fields; a META_KEY that is not a hash (hostile, or another tool's) is
        left alone: what cachemgr remembers is a cache, not a need."""
        typ = self.r.type(META_KEY)
        if (typ.decode(errors="replace") if isinstance(typ, bytes) else typ) in ("none", "hash"):
            # (a Mapping's key type is invariant: str keys are FieldTs all the same)
            self.r.hset(META_KEY, mapping=cast("Mapping[FieldT, EncodableT]", fields))

    # -- eviction ----------------------------------------------------------------------------

    def aot_refs(
        self, keys: list[RemoteKey], skipped: list[Skipped] | None = None, learn: bool = True
    ) -> dict[str, list[str]]:
        """fxgraph keys each AOT entry needs: from META_KEY, else read once and remembered there.
        With `learn` false (a dry run), only from META_KEY: nothing in Redis is read that a read
        touches, nor written; an entry whose graphs are not known yet goes to `skipped`.

        Reading an entry Inductor wrote itself resets its idle time once (a GET touches); that
        errs on the side of keeping it. A value that cannot be read (too large, not a value, a
        pickle that does not parse or attacks the reader) needs nothing as far as we can tell:
        it goes to `skipped` with the reason (remembered, so it is read once only), and stays
        subject to the age and size caps. Values are parsed in parse workers, under their bounds
        (see `read_aot`), never in this process.
        """
        skipped = [] if skipped is None else skipped
        aot = [k for k in keys if k.kind == "aotautograd"]
        meta = self.meta([k.rkey for k in aot], skipped)
        out: dict[str, list[str]] = {}
        learned: dict[str, str] = {}
        todo: list[RemoteKey] = []
        for k in aot:
            m = meta.get(k.rkey)
            if m is not None and isinstance(m.get("unreadable"), str):
                if m.get("bytes") != k.bytes:  # written anew since (by Inductor, perhaps): read again
                    m = None
                else:  # read once already: not again
                    skipped.append(Skipped(k.rkey, f"cannot read it (seen before): {m['unreadable'][:200]}"))
                    out[k.rkey] = []
                    continue
            if m is not None and "refs" in m:
                refs = m["refs"]
                if isinstance(refs, list) and all(
                    isinstance(r, str) and r.isprintable() and len(r) <= MAX_KEY for r in refs
                ):
                    out[k.rkey] = list(refs)
                    continue
                skipped.append(Skipped(k.rkey, f"{META_KEY}: 'refs' is not a list of keys; read again"))
            if k.bytes > MAX_VALUE:
                skipped.append(Skipped(k.rkey, f"value of about {k.bytes} bytes, over the {MAX_VALUE} cachemgr reads"))
                continue
            if not learn:
                skipped.append(Skipped(k.rkey, "the graphs it needs are not known yet: a dry run reads no value"))
                out[k.rkey] = []
                continue
            todo.append(k)
        sizes = {k.rkey: k.bytes for k in todo}
        for rkey, (refs, reason) in self.read_aot(todo).items():
            if reason is not None:
                skipped.append(Skipped(rkey, f"cannot read it: {reason}"))
                out[rkey] = []
                # remembered, so the next run does not read it again: our GET reset its idle time,
                # and one read per run would keep it from ever aging out
                doc = {"seen": time.time(), "refs": [], "unreadable": reason, "bytes": sizes[rkey]}
                learned[rkey] = json.dumps(doc)
                continue
            out[rkey] = refs
            known = {k: v for k, v in (meta.get(rkey) or {}).items() if k not in ("unreadable", "bytes")}
            learned[rkey] = json.dumps({**known, "seen": time.time(), "refs": refs})
        if learned:
            self.call(lambda: self._remember(learned))
        return out

    def read_aot(self, keys: list[RemoteKey]) -> dict[str, tuple[list[str], str | None]]:
        """rkey -> (the fxgraph keys it needs, None), or ([], why it cannot be read), for each of
        these AOT values still there. Each value is parsed in a parse worker (a BYTES job of
        cachemgr.index.workers: its address space limited, killed after PARSE_SECONDS, replaced),
        exactly as a local entry is: a pickle built to exhaust memory or time costs that worker,
        and the value gets the reason. This process holds about MAX_VALUE bytes of values at once."""
        from cachemgr.index.workers import BYTES, Job, Pool, default_workers, failure

        out: dict[str, tuple[list[str], str | None]] = {}
        if not keys:
            return out
        reader = f"{__name__}:{aot_value_refs.__name__}"
        with Pool(min(default_workers(), READERS)) as pool:
            i = 0
            while i < len(keys):
                jobs: list[Job] = []
                held = 0
                while i < len(keys) and len(jobs) < pool.size and (not jobs or held + keys[i].bytes <= MAX_VALUE):
                    k, i = keys[i], i + 1
                    raw = self.call(partial(_get_string, self.r, k.rkey))
                    self.read_here.add(k.rkey)  # (its idle time is ours now: Remote.execute)
                    if raw is None:
                        continue  # gone, or no longer a string
                    if len(raw) > MAX_VALUE:  # grown since it was sized
                        out[k.rkey] = ([], f"value grown to over the {MAX_VALUE} bytes cachemgr reads")
                        continue
                    held += len(raw)
                    jobs.append(Job(len(jobs), 0, "", BYTES, reader, k.rkey, (raw,)))
                    raw = None
                done = [(cast(str, job.ref), result) for job, result in pool.run(jobs, lambda job, why: (False, why))]
                jobs.clear()  # (the values: not held while the next batch is read)
                for rkey, result in done:
                    ok, value = cast("tuple[bool, Any]", result)
                    out[rkey] = (value, None) if ok else ([], failure(value))
        return out

    def execute(self, plan: EvictPlan) -> EvictResult:
        """Delete the plan's keys, each only if nothing read it since the plan (idle not reset).
        The graphs first, then the AOT entries chosen with them: one chosen because a graph it
        needs was stays if that graph does (read meanwhile); one this run read to learn what it
        needs (which reset its idle time) goes with its graph whatever its idle time."""
        script = self.r.register_script(_EVICT_LUA)
        deleted: list[str] = []

        def delete(victims: list[Victim], idle: Callable[[Victim], int]) -> None:
            for chunk in chunks(victims, BATCH):
                keys = [META_KEY, *(v.rkey for v in chunk)]
                done = self.call(partial(script, keys=keys, args=[idle(v) for v in chunk]))
                deleted.extend(d.decode() if isinstance(d, bytes) else d for d in done)

        delete([v for v in plan.victims if not v.graphs], lambda v: v.idle)
        went = set(deleted)
        after = [
            v for v in plan.victims if v.graphs and (went.intersection(v.graphs) or v.reason != "needs-evicted-graph")
        ]
        delete(after, lambda v: 0 if v.rkey in self.read_here and went.intersection(v.graphs) else v.idle)
        gone = set(deleted)
        freed = sum(v.bytes for v in plan.victims if v.rkey in gone)
        kept = [v.rkey for v in plan.victims if v.rkey not in gone]
        return EvictResult(deleted=deleted, skipped_in_use=kept, freed_bytes=freed)


class _Late(BaseException):
    """A round trip past its deadline (a BaseException: redis-py retries and wraps Exceptions)."""


class _TooLarge(BaseException):
    """A round trip that brought more than MAX_ANSWER bytes (a BaseException, as _Late)."""


class _Received:
    bytes = 0  # received in the round trip under way (Remote.call sets it back to 0)


def _counted(connection_class: type, received: _Received) -> type:
    """`connection_class` (plain, TLS or unix socket, as the URL chose) whose socket counts what
    it receives into `received`: past MAX_ANSWER, the read stops (_TooLarge) before memory grows
    with what a server that is not Redis sends (redis-py reads a bulk string's whole length)."""

    class Counted(connection_class):
        def _connect(self):
            return _CountingSocket(super()._connect(), received)

    return Counted


class _CountingSocket:
    def __init__(self, sock, received: _Received) -> None:
        self._sock, self._received = sock, received

    def recv(self, n: int, *flags: int) -> bytes:
        data = self._sock.recv(n, *flags)
        self._count(len(data))
        return data

    def recv_into(self, buffer, *args: int) -> int:  # (redis-py's hiredis parser reads so)
        n = self._sock.recv_into(buffer, *args)
        self._count(n)
        return n

    def _count(self, n: int) -> None:
        self._received.bytes += n
        if self._received.bytes > MAX_ANSWER:
            raise _TooLarge

    def __getattr__(self, name: str) -> Any:  # everything else as the socket does it
        return getattr(self._sock, name)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _Late in the block after `seconds` (SIGALRM: a signal ends a blocked read, whatever
    the socket timeout). In the main thread only, where signals are handled; elsewhere the
    per-read socket timeout alone applies."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def late(signum, frame):
        raise _Late

    before = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before if before is not None else signal.SIG_DFL)


def _answers(script: Callable[..., Any], n: int, keys: list, args: list) -> list[bytes | int | None]:
    """The `n` answers of a script that returns a list (nil: `n` nils); TypeError if not that."""
    out = script(keys, args)
    if out is None:
        return [None] * n
    if not isinstance(out, list) or len(out) != n or not all(v is None or isinstance(v, (bytes, int)) for v in out):
        raise TypeError(f"a script answered {type(out).__name__}, not {n} strings or numbers")
    return out


def _types(r, rkeys: list[str]) -> dict[str, str]:
    p = r.pipeline(transaction=False)
    for k in rkeys:
        p.type(k)
    return {
        k: (t.decode(errors="replace") if isinstance(t, bytes) else str(t))
        for k, t in zip(rkeys, p.execute(raise_on_error=False), strict=True)
    }


def _get_string(r, rkey: str) -> bytes | None:
    """The value (at most MAX_VALUE + 1 bytes of it: more says it is too large, never read whole),
    or None when the key is gone or holds another type than a string now. Touches the key, as GET."""
    p = r.pipeline(transaction=True)
    p.type(rkey)
    p.getrange(rkey, 0, MAX_VALUE)  # (the end is inclusive)
    typ, raw = p.execute(raise_on_error=False)
    if (typ.decode(errors="replace") if isinstance(typ, bytes) else typ) != "string" or not isinstance(raw, bytes):
        return None
    return raw


def _local_problem(path: str) -> str | None:
    """Why a local entry file is not pushed ('missing' when it is gone), or None."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size > MAX_PUSH:
        return f"{st.st_size} bytes, over the {MAX_PUSH >> 20} MiB cachemgr pushes"
    return None


# One SCAN step; a name over ARGV[3] bytes is answered as {its first 300 bytes, its length}.
_SCAN_LUA = """
local r = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', 1000)
local short, long = {}, {}
for _, k in ipairs(r[2]) do
  if #k <= tonumber(ARGV[3]) then
    table.insert(short, k)
  else
    table.insert(long, {string.sub(k, 1, 300), #k})
  end
end
return {r[1], short, long}
"""

# META_KEY's fields ARGV[2...], each as it is if at most ARGV[1] bytes, else its size (a number);
# nil when META_KEY is not a hash (now).
_META_LUA = """
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return nil end
local out = {}
for i = 2, #ARGV do
  local n = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  if n > tonumber(ARGV[1]) then out[i - 1] = n else out[i - 1] = redis.call('HGET', KEYS[1], ARGV[i]) end
end
return out
"""

# OBJECT IDLETIME does not touch the key; a key read since the plan has a smaller idle time now,
# and one whose idle time Redis does not keep (an LFU maxmemory-policy: an error) is kept.
# A META_KEY that is not a hash is left alone (HDEL on it would fail the script after its first UNLINK).
_EVICT_LUA = """
local out = {}
local meta = redis.call('TYPE', KEYS[1]).ok == 'hash'
for i = 2, #KEYS do
  local idle = redis.pcall('OBJECT', 'IDLETIME', KEYS[i])
  if type(idle) == 'number' and idle >= tonumber(ARGV[i - 1]) then
    redis.call('UNLINK', KEYS[i])
    if meta then redis.call('HDEL', KEYS[1], KEYS[i]) end
    table.insert(out, KEYS[i])
  end
end
return out
"""


# -- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    key: str  # as shown: escaped where it is not printable text
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"key": self.key, "reason": self.reason}


# Said once where OBJECT IDLETIME fails for an LFU maxmemory-policy: no key is skipped, but none has an age.
NO_IDLE = Skipped(
    "OBJECT IDLETIME",
    "Redis keeps no idle times under an LFU maxmemory-policy: every key counts as just read, and eviction deletes none",
)


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
    skipped: list[Skipped] = field(default_factory=list)  # under pt2: (or META_KEY) but not what it should be

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "entries": self.entries,
            "bytes": self.bytes,
            "by_kind": self.by_kind,
            "pushed_by_cachemgr": self.pushed_by_cachemgr,
            "max_idle_seconds": self.max_idle_seconds,
            "other_keys": self.other_keys,
            "skipped": [x.as_dict() for x in self.skipped],
        }


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
    skipped: list[Skipped] = field(default_factory=list)  # not pushed, and why

    def as_dict(self) -> dict[str, Any]:
        return {
            "pushed": len(self.pushed),
            "present": len(self.present),
            "missing": self.missing,
            "bytes": self.bytes,
            "skipped_guard_sets": self.skipped_guard_sets,
            "keys": self.pushed,
            "skipped": [x.as_dict() for x in self.skipped],
        }


@dataclass(frozen=True)
class Victim:
    rkey: str
    kind: str
    bytes: int
    idle: int
    reason: str  # age | size | needs-evicted-graph
    graphs: tuple[str, ...] = ()  # an AOT entry's: the chosen graphs it needs (Redis keys): it follows them


@dataclass(frozen=True)
class EvictPlan:
    victims: tuple[Victim, ...]
    total_bytes: int
    expected_freed_bytes: int
    kept_young: int  # keys the size cap wanted but the grace period protects

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "expected_freed_bytes": self.expected_freed_bytes,
            "victims": [v.__dict__ for v in self.victims],
            "kept_young": self.kept_young,
        }


@dataclass(frozen=True)
class EvictResult:
    deleted: list[str]
    skipped_in_use: list[str]  # read between plan and delete: kept
    freed_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {"deleted": len(self.deleted), "skipped_in_use": self.skipped_in_use, "freed_bytes": self.freed_bytes}


# -- planning (pure) ------------------------------------------------------------------------


def plan_eviction(
    keys: list[RemoteKey],
    aot_refs: Mapping[str, list[str]],
    max_size: int | None,
    max_age: float | None,
    low_water: float = 0.9,
    grace: float = 60.0,
) -> EvictPlan:
    """Which keys to delete: older than max_age, then least recently used down to
    low_water * max_size; an AOT entry whose fxgraph is evicted goes with it (it could only miss)."""
    total = sum(k.bytes for k in keys)
    chosen: dict[str, Victim] = {}
    needed_by: dict[str, list[RemoteKey]] = {}  # fxgraph key -> the AOT entries that need it
    for k in keys:
        if k.kind == "aotautograd":
            for fx in aot_refs.get(k.rkey, ()):
                needed_by.setdefault(fx, []).append(k)

    def take(k: RemoteKey, reason: str, follow: bool = True) -> int:
        """Choose k and (`follow`) the AOT entries it leaves useless; the bytes that frees."""
        freed = 0
        if k.rkey not in chosen:
            chosen[k.rkey] = Victim(k.rkey, k.kind, k.bytes, k.idle, reason)
            freed += k.bytes
        if k.kind == "fxgraph" and follow:
            for a in needed_by.get(k.key, ()):
                if a.rkey not in chosen:
                    chosen[a.rkey] = Victim(a.rkey, a.kind, a.bytes, a.idle, "needs-evicted-graph")
                    freed += a.bytes
        return freed

    remaining = total
    aged = [k for k in keys if max_age is not None and k.idle > max_age and k.idle >= grace]
    for k in aged:  # (each its own reason first: an old AOT entry goes even if its graph is read meanwhile)
        remaining -= take(k, "age", follow=False)
    for k in aged:
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
    # An AOT entry chosen with graphs it needs is deleted after them (Remote.execute)
    fx_rkeys = {k.key: k.rkey for k in keys if k.kind == "fxgraph"}
    for a in keys:
        v = chosen.get(a.rkey)
        if v is not None and a.kind == "aotautograd":
            graphs = tuple(fx_rkeys[fx] for fx in aot_refs.get(a.rkey, ()) if fx_rkeys.get(fx) in chosen)
            chosen[a.rkey] = replace(v, graphs=graphs)
    victims = tuple(chosen.values())
    return EvictPlan(victims, total, sum(v.bytes for v in victims), young)


# -- what to push (reads the local index) ---------------------------------------------------


def push_items(
    store: Store, model: str | None = None, graph: str | None = None
) -> tuple[list[PushItem], int, list[Skipped]]:
    """The local fxgraph and AOT entries to publish, how many extra guard sets were left out, and
    the entries whose key makes no remote key.

    No selector: every entry. `graph`: that fxgraph or AOT key. `model`: the fxgraph entries whose
    input signature was recorded for that model (the shapes table). Either way the AOT <-> FX
    edges are followed, so an AOT entry travels with the graphs it needs and the other way round.
    """
    rows, edges = store.push_candidates()

    if graph is None and model is None:
        wanted = {row[3] for row in rows}
    else:
        if graph is not None:
            seeds = {row[3] for row in rows if row[3] == graph}
            what = f"graph {graph!r}"
        elif model is not None:  # (it is: not both are None)
            graphs = store.model_graphs(model, "--graph KEY")
            seeds = {row[3] for row in rows if row[2] == "fxgraph" and row[3] in graphs}
            what = f"model {model!r}"
        if not seeds:
            raise NotFound(
                f"no fxgraph or aotautograd entry for {what} in the index (run: cachemgr scan; "
                "list graphs with: cachemgr ls --kind fxgraph)"
            )
        wanted = _closure(seeds, rows, edges)

    from cachemgr.index.store import MAX_SECONDS, moment

    best: dict[str, Any] = {}
    extra = 0
    refused: list[Skipped] = []
    for eid, key, kind, ref, mtime, seconds, version, _ in rows:
        if ref not in wanted:
            continue
        # (an edited index's values: a ref no torch key is made of is not pushed; odd numbers read as unknown)
        cache = FX_CACHE_ID if kind == "fxgraph" else AOT_CACHE_ID
        rkey, why = check_key(redis_key(cache, ref).encode()) if isinstance(ref, str) else (None, "it has no key")
        home = layout.classify(key) if isinstance(key, str) else None
        if rkey is not None and (home is None or home.ref != ref):  # the file pushed is the one its path names:
            rkey, why = None, "its graph key is not its folder's"  # another graph's would be served under this key
        if rkey is None:
            refused.append(Skipped(shown_key(str(key)), f"local entry: not pushed: {why}"))
            continue
        mtime, seconds = moment(mtime), moment(seconds)
        if ref in best:
            extra += 1
            if mtime <= best[ref][4]:
                continue
        # several guard sets of one key: Redis holds one, the newest
        best[ref] = (eid, key, kind, ref, mtime, seconds, version, rkey)
    items = []
    for eid, key, kind, ref, _, seconds, version, rkey in sorted(
        best.values(), key=lambda x: (x[2] != "fxgraph", x[1])
    ):
        ms = int(seconds * 1000) if 0 <= seconds < MAX_SECONDS else 0
        items.append(PushItem(rkey, kind, ref, key, ms, version, edges.get(eid, [])))
    return items, extra, refused


def _closure(seeds: set[str], rows: list, edges: dict[int, list[str]]) -> set[str]:
    aot_needs = {row[3]: set(edges.get(row[0], ())) for row in rows if row[2] == "aotautograd"}
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


def _refusal(answer: object) -> bool:
    """Is this answer Redis refusing us (no such user, a wrong password, an ACL)? redis-py gives
    NOAUTH and NOPERM their own classes, and takes the code off their text."""
    import redis

    if isinstance(answer, (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError)):
        return True
    return isinstance(answer, Exception) and str(answer).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def iter_kinds(stats: RemoteStats) -> Iterable[tuple[str, int, int]]:
    for kind, row in stats.by_kind.items():
        if row["entries"]:
            yield kind, row["entries"], row["bytes"]
