"""Effective settings: built-in defaults < TOML file < CACHEMGR_* environment < command-line flags.

Every value remembers where it came from (`cachemgr config show`). An unknown key or a bad value
is a ConfigError naming the key and the source.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
import tomllib
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cachemgr.errors import CachemgrError, ConfigError, UsageError
from cachemgr.units import MAX_SIZE, parse_duration, parse_size, parse_size_or_percent

DEFAULT_CONFIG_FILE = "/etc/cachemgr/config.toml"


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """systemd's StateDirectory= when run as the service, else $XDG_STATE_HOME/cachemgr."""
    if environ.get("STATE_DIRECTORY"):
        return Path(environ["STATE_DIRECTORY"].split(":")[0])
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "cachemgr"


def _default_cache_dir(environ: Mapping[str, str]) -> str:
    from cachemgr.layout import default_cache_dir

    return environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()


def _default_host(environ: Mapping[str, str]) -> str:
    import socket

    return socket.gethostname()


# -- one validation path for every source ----------------------------------------------------------
#
# A value reaches a parser as TOML gave it (str, bool, int, float, including negative numbers,
# inf and nan, lists, tables), as a CACHEMGR_* variable gave it (str) or as a flag gave it (already
# converted by click). Each parser accepts every form that makes sense and refuses the rest with
# a ValueError; load() names the key and the source. bool is never a number here.

YEAR = 365.25 * 86400
MAX_DURATION = 10 * YEAR  # a longer age or interval is a typo (or inf)
MAX_BATCH_WAIT = 3600.0  # debounce / max_wait: the daemon's index lag


def _text(v: Any, what: str = "a string") -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be {what}, not {_kind(v)}")
    if "\x00" in v:
        raise ValueError("must not contain a NUL byte")
    if not v.isascii():
        try:  # (a name that is not UTF-8 comes from the environment or argv as lone surrogates)
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be UTF-8 (the index keeps it as text)") from None
    return v


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "true/false"
    if isinstance(v, float):
        return "a floating-point number"
    if isinstance(v, int):
        return "a number"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "a table"
    return type(v).__name__


def _number(v: Any) -> float:
    """A finite real number from a TOML/flag number; bool is not one."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"must be a number, not {_kind(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError("must be a finite number")
    return f


def _duration(low: float = 0.0, high: float = MAX_DURATION) -> Callable[[Any], float]:
    """Seconds, from '14d' / '6h' / '30m' / '45s' / a plain number of seconds; low <= d <= high."""

    def parse(v: Any) -> float:
        d = _number(v) if not isinstance(v, str) else parse_duration(_text(v))
        if not math.isfinite(d):
            raise ValueError("must be a finite duration")
        if d < low:
            raise ValueError(f"must be at least {low:g}s")
        if d > high:
            raise ValueError(f"must be at most {'10 years' if high == MAX_DURATION else f'{high:g}s'}")
        return d

    return parse


def _size(v: Any) -> int:
    """Whole bytes >= 0, from '20GiB' / '500MB' / '1.5G' or an integer."""
    if isinstance(v, str):
        return parse_size(_text(v))
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"must be a whole number of bytes or a size like '20GiB', not {_kind(v)}")
    if v < 0:
        raise ValueError("must not be negative")
    if v > MAX_SIZE:
        raise ValueError("must be at most 8 EiB")
    return v


def _count(v: Any) -> int:
    """A whole number >= 0 (a file count)."""
    if isinstance(v, str):
        text = _text(v).strip()
        if not text.isdigit() or not text.isascii():
            raise ValueError("must be a whole number >= 0")
        v = int(text)
    elif isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"must be a whole number >= 0, not {_kind(v)}")
    if not 0 <= v <= MAX_SIZE:
        raise ValueError("must be a whole number >= 0")
    return v


def _min_free(v: Any) -> str:
    if not isinstance(v, str):
        return str(_size(v))  # a TOML integer: bytes
    parse_size_or_percent(_text(v))
    return v.strip()


def _fraction(v: Any) -> float:
    if isinstance(v, str):
        text = _text(v).strip()
        try:
            if not text.isascii():  # (float() reads '٠.٩' too)
                raise ValueError
            f = float(text)
        except ValueError:
            raise ValueError("must be a number in (0, 1], like 0.9") from None
    else:
        f = _number(v)
    if not 0 < f <= 1:  # nan and inf fail this too
        raise ValueError("must be in (0, 1], like 0.9")
    return f


def _policy(v: Any) -> str:
    if v not in ("lru", "cost"):
        raise ValueError("must be 'lru' or 'cost'")
    return str(v)


def _metrics(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)  # TOML `metrics = 9464`: a bare port
    v = _text(v, "'off' or HOST:PORT").strip()
    if v.lstrip(":").isdigit() and v.isascii():  # a bare port: loopback only, the safe default
        v = "127.0.0.1:" + v.lstrip(":")
    if v != "off":
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not port.isascii() or not 0 < int(port) < 65536:
            raise ValueError("must be 'off' or HOST:PORT (port 1-65535), e.g. 127.0.0.1:9464")
        if not _host_name(host):
            raise ValueError(f"{host[:60]!r} is not an IP address or a host name")
    return v


def _host_name(host: str) -> bool:
    """An IP address ([::1] too), or a DNS host name (letters, digits, '-', dots: not all digits)."""
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host)
        return True
    except ValueError:
        labels = host.rstrip(".").split(".")
        named = all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label) for label in labels)
        return named and len(host) <= 253 and not labels[-1].isdigit()


def _nonempty(v: Any) -> str:
    v = _text(v).strip()
    if not v:
        raise ValueError("must not be empty")
    return v


DB_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg")  # the index's databases, and their drivers


def _db_url(v: Any) -> str:
    v = _nonempty(v)
    if "\x00" in urllib.parse.unquote(v):  # (a %00 becomes one in the file name or the password)
        raise ValueError("must not contain a NUL byte (%00)")
    scheme, sep, rest = v.partition("://")
    if not sep or scheme not in DB_SCHEMES:  # (a UsageError: the URL, which may hold a password, is not shown)
        raise UsageError(
            (f"{scheme[:40] + sep!r} is not a database cachemgr supports" if sep else "not a database URL")
            + ": give sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
    parts = urllib.parse.urlsplit(v)
    options = {k for k, _ in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)}
    if scheme == "sqlite":
        # Every command may write the index: an option SQLite's driver would ignore (?mode=ro: the
        # index was written all the same) or read as a URI (file:, uri=true) is refused.
        if options - {"timeout"} or rest.startswith(("/file:", "file:")):
            raise UsageError("a SQLite index URL takes no option but ?timeout=SECONDS: give sqlite:///PATH")
    elif not parts.path.strip("/") and "dbname" not in options:
        # (libpq's default database, named after the user, would take cachemgr's tables)
        raise UsageError("name the database: postgresql+psycopg://USER@HOST/DB")
    return v


_OPTION = re.compile(r"([?&;])([^=&;#]*)=([^&;#]*)")
URL_OPTIONS = ("db", "redis_url")  # the settings that are URLs: shown only through redact_url


def redact_url(url: str) -> str:
    """A URL fit for messages and `config show`: every password replaced (USER:PASSWORD@, and
    any option whose name, percent-decoded, holds "pass": libpq's ?password= and ?sslpassword=,
    redis-py's ?ssl_password=, ?pass%77ord=) and control characters escaped. Where an '@' follows
    '://', all before the last one is taken for credentials, so a password holding '?' or '/' is
    hidden too (an '@' in an option's value may hide more than it must, never less)."""

    def hide(m: re.Match) -> str:
        secret = "pass" in urllib.parse.unquote(m.group(2)).lower()
        return f"{m.group(1)}{m.group(2)}={'***' if secret else m.group(3)}"

    url = _OPTION.sub(hide, url)
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if sep and at and ":" in creds:
        url = f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"
    return url if url.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in url)


def _host(v: Any) -> str:
    v = _nonempty(v)
    if len(v) > 255 or not v.isprintable():
        raise ValueError("must be a printable name of at most 255 characters")
    return v


def _path(v: Any) -> str:
    return os.path.abspath(os.path.expanduser(_nonempty(v)))


def _keep_torch(v: Any) -> list[str]:
    if isinstance(v, str):
        items = [] if not _text(v).strip() else v.split(",")
    elif isinstance(v, list):
        items = v
    else:
        raise ValueError(f"must be a list of torch versions (or a comma-separated string), not {_kind(v)}")
    out = []
    for x in items:
        x = _text(x, "a torch version string").strip()
        if not x:
            raise ValueError("must not hold an empty version")
        out.append(x)
    return out


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def optional(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "off")):
            return None
        return parse(v)

    return optional


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Callable[[Mapping[str, str]], Any]  # from the environment loading uses
    help: str
    unit: str | None = None  # 'size' or 'duration': how `config show` prints it for people
    read_from: tuple[str, ...] = ()  # other programs' variables the default comes from, first set wins

    def default_source(self, environ: Mapping[str, str]) -> str:
        """Where the default value came from: one of `read_from`, or cachemgr's built-in default."""
        return next((f"env {v}" for v in self.read_from if environ.get(v)), "default")


OPTIONS: tuple[Option, ...] = (
    Option(
        "cache_dir",
        _path,
        _default_cache_dir,
        "TorchInductor cache directory to manage",
        read_from=("TORCHINDUCTOR_CACHE_DIR",),
    ),
    Option(
        "db",
        _db_url,
        lambda env: f"sqlite:///{state_dir(env) / 'index.db'}",
        "index database URL (SQLite or PostgreSQL)",
        read_from=("STATE_DIRECTORY", "XDG_STATE_HOME"),
    ),
    Option("host", _host, _default_host, "host name recorded on every row (fleet tier)"),
    Option(
        "spool_dir",
        _path,
        lambda env: str(state_dir(env) / "spool"),
        "where cachemgr.record appends recorded shapes",
        read_from=("STATE_DIRECTORY", "XDG_STATE_HOME"),
    ),
    Option("max_size", _optional(_size), lambda env: None, "size cap, e.g. 20GiB", unit="size"),
    Option("low_water", _fraction, lambda env: 0.9, "evict down to this fraction of max_size / max_files"),
    Option(
        "max_age",
        _optional(_duration()),
        lambda env: None,
        "evict entries not accessed for this long, e.g. 14d",
        unit="duration",
    ),
    Option("max_files", _optional(_count), lambda env: None, "file-count cap (inode quotas)"),
    Option(
        "min_free", _optional(_min_free), lambda env: None, "free-space floor on the cache's file system, 10% or 50GiB"
    ),
    Option("policy", _policy, lambda env: "lru", "eviction policy: lru or cost"),
    Option(
        "grace",
        _duration(),
        lambda env: 60.0,
        "never delete files younger than this (since write or last access)",
        unit="duration",
    ),
    # an interval of 0 would spin
    Option("evict_interval", _duration(1.0), lambda env: 300.0, "daemon: run eviction this often", unit="duration"),
    Option(
        "scan_interval",
        _duration(1.0),
        lambda env: 3600.0,
        "daemon: reconcile the whole tree this often (heals lost events)",
        unit="duration",
    ),
    Option(
        "debounce",
        _duration(0.0, MAX_BATCH_WAIT),
        lambda env: 0.3,
        "daemon: quiet period before applying a batch of file events",
        unit="duration",
    ),
    Option(
        "max_wait",
        _duration(0.01, MAX_BATCH_WAIT),
        lambda env: 1.0,
        "daemon: apply a batch at the latest after this long",
        unit="duration",
    ),
    Option(
        "metrics",
        _metrics,
        lambda env: "off",
        "daemon: Prometheus endpoint HOST:PORT (a bare PORT binds 127.0.0.1), or off",
    ),
    Option(
        "redis_url",
        _optional(_nonempty),
        lambda env: env.get("TORCHINDUCTOR_REDIS_URL") or None,
        "Redis of the shared remote cache (fleet tier)",
        read_from=("TORCHINDUCTOR_REDIS_URL",),
    ),
    Option("keep_torch", _keep_torch, lambda env: [], "torch versions that purge --stale must keep"),
)
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    cache_dir: str
    db: str
    host: str
    spool_dir: str
    max_size: int | None
    low_water: float
    max_age: float | None
    max_files: int | None
    min_free: str | None
    policy: str
    grace: float
    evict_interval: float
    scan_interval: float
    debounce: float
    max_wait: float
    metrics: str
    redis_url: str | None
    keep_torch: list[str]
    sources: Mapping[str, str]  # option name -> 'default' | 'file PATH' | 'env NAME' | 'flag'
    config_file: str | None = None

    def defaulted(self, name: str) -> bool:
        """True when nobody set `name` for cachemgr: its built-in default, or another program's variable."""
        return self.sources[name] == "default" or self.sources[name] in {f"env {v}" for v in BY_NAME[name].read_from}

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sources", "config_file")}


def load(
    config_file: str | None = None, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Resolve every option. `config_file` None means /etc/cachemgr/config.toml if it exists."""
    environ = os.environ if environ is None else environ
    given: dict[str, list[tuple[Any, str]]] = {}  # each value set for an option, lowest source first
    path = (
        config_file
        or environ.get("CACHEMGR_CONFIG")
        or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    )
    if path:
        for k, v in _read_toml(path).items():
            if k not in BY_NAME:
                raise ConfigError(f"{path}: unknown key {k!r} (known: {', '.join(BY_NAME)})")
            given[k] = [(v, f"file {path}")]
    for o in OPTIONS:
        env = "CACHEMGR_" + o.name.upper()
        if environ.get(env) is not None:
            given.setdefault(o.name, []).append((environ[env], f"env {env}"))
    for k, v in (flags or {}).items():
        if v is not None:
            if k not in BY_NAME:
                raise ConfigError(f"unknown option {k!r}")
            given.setdefault(k, []).append((v, "flag"))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if o.name in given:
            # every value set is checked, not only the one that wins: the file's value a variable
            # overrides now is the one a daemon restarted without the variable reads
            for v, src in given[o.name]:
                values[o.name] = _parsed(o, o.parse, v, src)
        else:
            src = o.default_source(environ)
            v = o.default(environ)  # (a default read from the environment meets the text check)
            values[o.name] = _parsed(o, _text if isinstance(v, str) else lambda x: x, v, src)
        sources[o.name] = src
    return Settings(**values, sources=sources, config_file=path)


def _parsed(o: Option, parse: Callable[[Any], Any], v: Any, src: str) -> Any:
    """`v` parsed for `o`; a ConfigError naming the option and where `v` came from if it cannot be."""
    try:
        return parse(v)
    except UsageError as e:
        raise ConfigError(f"{o.name} from {src}: {e}") from e
    except (TypeError, ValueError, OverflowError) as e:
        if o.name in URL_OPTIONS:  # (a password stays hidden, whatever is wrong with the rest)
            shown = repr(redact_url(v)) if isinstance(v, str) else f"of type {type(v).__name__}"
        else:
            shown = repr(v)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ConfigError(f"{o.name} from {src}: invalid value {shown}: {e}") from e


MAX_TOML = 4 * 1024 * 1024  # bytes: a config file or manifest is a few KiB


def read_toml(
    path: str, what: str, error: type[UsageError], missing: type[CachemgrError] | None = None
) -> dict[str, Any]:
    """A TOML file as a dict; a missing (`missing`, else `error`), unreadable or malformed file is
    one `error` line. Only a regular file of at most MAX_TOML bytes is read (a FIFO would block,
    /dev/zero never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{what} {path} is not a regular file")
            data = f.read(MAX_TOML + 1)
        if len(data) > MAX_TOML:
            raise error(f"{what} {path} is larger than {MAX_TOML >> 20} MiB")
        return tomllib.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise (missing or error)(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is not a regular file") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path}: not valid TOML: not UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} {path}: not valid TOML: {e}") from None
    except RecursionError:
        raise error(f"{what} {path}: not valid TOML: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (4,300)
        raise error(f"{what} {path}: not valid TOML: {e}") from None


def _read_toml(path: str) -> dict[str, Any]:
    if path == os.devnull:  # the conventional "no config file" (a character device, not read)
        return {}
    doc = read_toml(path, "config file", ConfigError)
    flat = dict(doc.pop("cachemgr", {})) if isinstance(doc.get("cachemgr"), dict) else {}
    both = sorted(set(flat) & set(doc))
    if both:  # which one was meant? (the top level won, silently)
        raise ConfigError(f"config file {path}: {', '.join(both)} set both at the top level and under [cachemgr]")
    flat.update(doc)
    return flat
