"""Effective settings: built-in defaults < TOML file < CACHEMGR_* environment < command-line flags.

Every value remembers where it came from (`cachemgr config show`). An unknown key or a bad value
is a ConfigError naming the key and the source.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cachemgr.errors import ConfigError, UsageError
from cachemgr.units import parse_duration, parse_size, parse_size_or_percent

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


def _min_free(v: Any) -> str:
    parse_size_or_percent(str(v))
    return str(v)


def _fraction(v: Any) -> float:
    f = float(v)
    if not 0 < f <= 1:
        raise ValueError("must be in (0, 1]")
    return f


def _policy(v: Any) -> str:
    if v not in ("lru", "cost"):
        raise ValueError("must be 'lru' or 'cost'")
    return str(v)


def _metrics(v: Any) -> str:
    v = str(v)
    if v.lstrip(":").isdigit():  # a bare port: loopback only, the safe default
        v = "127.0.0.1:" + v.lstrip(":")
    if v != "off":
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be 'off' or HOST:PORT (port 1-65535), e.g. 127.0.0.1:9464")
    return v


def _nonempty(v: Any) -> str:
    if not str(v).strip():
        raise ValueError("must not be empty")
    return str(v).strip()


def _at_least(low: float) -> Callable[[Any], float]:
    """A duration of at least `low` seconds (an interval of 0 would spin)."""
    def parse(v: Any) -> float:
        d = parse_duration(v)
        if d < low:
            raise ValueError(f"must be at least {low:g} s")
        return d
    return parse


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v in (None, "", "none", "off") else parse(v)


def _positive_int(v: Any) -> int:
    i = int(v)
    if i < 0:
        raise ValueError("must be >= 0")
    return i


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Callable[[Mapping[str, str]], Any]  # from the environment loading uses
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("cache_dir", lambda v: os.path.abspath(os.path.expanduser(str(v))), _default_cache_dir,
           "TorchInductor cache directory to manage"),
    Option("db", str, lambda env: f"sqlite:///{state_dir(env) / 'index.db'}", "index database URL (SQLite or PostgreSQL)"),
    Option("host", _nonempty, _default_host, "host name recorded on every row (fleet tier)"),
    Option("spool_dir", lambda v: os.path.abspath(str(v)), lambda env: str(state_dir(env) / "spool"),
           "where cachemgr.record appends recorded shapes"),
    Option("max_size", _optional(parse_size), lambda env: None, "size cap, e.g. 20GiB"),
    Option("low_water", _fraction, lambda env: 0.9, "evict down to this fraction of max_size / max_files"),
    Option("max_age", _optional(parse_duration), lambda env: None, "evict entries not accessed for this long, e.g. 14d"),
    Option("max_files", _optional(_positive_int), lambda env: None, "file-count cap (inode quotas)"),
    Option("min_free", _optional(_min_free), lambda env: None, "free-space floor on the cache's file system, 10% or 50GiB"),
    Option("policy", _policy, lambda env: "lru", "eviction policy: lru or cost"),
    Option("grace", parse_duration, lambda env: 60.0, "never delete files younger than this (since write or last access)"),
    Option("evict_interval", _at_least(1.0), lambda env: 300.0, "daemon: run eviction this often"),
    Option("scan_interval", _at_least(1.0), lambda env: 3600.0, "daemon: reconcile the whole tree this often (heals lost events)"),
    Option("debounce", parse_duration, lambda env: 0.3, "daemon: quiet period before applying a batch of file events"),
    Option("max_wait", _at_least(0.01), lambda env: 1.0, "daemon: apply a batch at the latest after this long"),
    Option("metrics", _metrics, lambda env: "off", "daemon: Prometheus endpoint HOST:PORT (a bare PORT binds 127.0.0.1), or off"),
    Option("redis_url", _optional(str), lambda env: env.get("TORCHINDUCTOR_REDIS_URL"),
           "Redis of the shared remote cache (fleet tier)"),
    Option("keep_torch", lambda v: [str(x) for x in (v if isinstance(v, list) else str(v).split(","))],
           lambda env: [], "torch versions that purge --stale must keep"),
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

    def values(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sources", "config_file")}


def load(config_file: str | None = None, flags: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None) -> Settings:
    """Resolve every option. `config_file` None means /etc/cachemgr/config.toml if it exists."""
    environ = os.environ if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    path = config_file or environ.get("CACHEMGR_CONFIG") or (DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None)
    if path:
        for k, v in _read_toml(path).items():
            if k not in BY_NAME:
                raise ConfigError(f"{path}: unknown key {k!r} (known: {', '.join(BY_NAME)})")
            raw[k] = (v, f"file {path}")
    for o in OPTIONS:
        env = "CACHEMGR_" + o.name.upper()
        if environ.get(env) is not None:
            raw[o.name] = (environ[env], f"env {env}")
    for k, v in (flags or {}).items():
        if v is not None:
            if k not in BY_NAME:
                raise ConfigError(f"unknown option {k!r}")
            raw[k] = (v, "flag")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if o.name in raw:
            v, src = raw[o.name]
            try:
                values[o.name] = o.parse(v)
            except UsageError as e:
                raise ConfigError(f"{o.name} from {src}: {e}") from e
            except (TypeError, ValueError) as e:
                raise ConfigError(f"{o.name} from {src}: invalid value {v!r}: {e}") from e
            sources[o.name] = src
        else:
            values[o.name] = o.default(environ)
            sources[o.name] = "default"
    return Settings(**values, sources=sources, config_file=path)


def read_toml(path: str, what: str, error: type[UsageError]) -> dict[str, Any]:
    """A TOML file as a dict; a missing, unreadable or malformed file is one `error` line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} {path}: not valid TOML: {e}") from None


def _read_toml(path: str) -> dict[str, Any]:
    doc = read_toml(path, "config file", ConfigError)
    flat = dict(doc.pop("cachemgr", {})) if isinstance(doc.get("cachemgr"), dict) else {}
    flat.update(doc)
    return flat
