"""daemon, config show: run the service; print the effective configuration and where it came from."""

from __future__ import annotations

from typing import Any

import click

from cachemgr.cli.common import DURATION, SIZE, clean, emit_json, exit_codes, json_option, pass_app
from cachemgr.config import BY_NAME
from cachemgr.units import format_duration, format_size


@click.command()
@click.option(
    "--max-size", type=SIZE, help="Size cap enforced as soon as the index crosses it, e.g. 20GiB (default: none)."
)
@click.option("--max-files", type=click.IntRange(min=0), help="File-count cap.")
@click.option("--policy", type=click.Choice(["lru", "cost"]), help="Eviction policy (default: lru).")
@click.option("--grace", type=DURATION, help="Never delete files younger than this since write or last access.")
@click.option("--evict-interval", type=DURATION, help="Run eviction this often (default 5m).")
@click.option("--scan-interval", type=DURATION, help="Full reconcile this often; heals dropped events (default 1h).")
@click.option("--debounce", type=DURATION, help="Quiet period before a batch of file events is applied (0.3s).")
@click.option("--max-wait", type=DURATION, help="Apply a batch at the latest this long after its first event (1s).")
@click.option("--metrics", metavar="HOST:PORT", help="Serve Prometheus metrics here (or a bare port on 127.0.0.1).")
@click.option("-v", "--verbose", is_flag=True, help="Log every applied batch (debug level).")
@pass_app
@exit_codes(
    (0, "stopped by SIGTERM or SIGINT"),
    (2, "a bad flag, variable or config value"),
    (5, "the index database cannot be opened"),
    7,
    (10, "another daemon already serves this cache dir or index (named by PID)"),
)
def daemon(app, verbose: bool, **flags) -> None:
    """Keep the index current and the cache within its limits, as a service.

    Start-up: load the config, lock the cache dir and index (one daemon each), migrate the index,
    reconcile with a full scan, watch the cache (inotify), start the eviction and rescan jobs,
    then tell systemd READY=1. SIGTERM or SIGINT stop it; SIGHUP reloads the config (a bad one is
    logged and the running config kept). Logs go to stderr, one line per event (journald-friendly).

    \b
    Example:
        cachemgr --cache-dir /var/cache/inductor daemon --max-size 200GiB
        systemctl reload cachemgr          # re-read /etc/cachemgr/config.toml
    """
    import logging

    from cachemgr.daemon.service import Daemon, setup_logging

    setup_logging(logging.DEBUG if verbose else logging.INFO)
    Daemon(lambda: app.with_flags(**flags)).run()


@click.group(name="config")
def config_group() -> None:
    """Inspect the effective configuration."""


@config_group.command(name="show")
@json_option
@pass_app
@exit_codes(0, (2, "a bad variable or config value (named)"))
def config_show(app, as_json: bool) -> None:
    """Print every option's effective value and where it came from.

    Precedence, lowest first: built-in default, the TOML file (/etc/cachemgr/config.toml or
    --config; keys at the top level or under [cachemgr]), CACHEMGR_<OPTION> environment
    variables, command-line flags.

    \b
    Example:
        cachemgr config show
        CACHEMGR_MAX_SIZE=50GiB cachemgr config show --json | jq .options.max_size
    """
    from cachemgr.config import redact_url

    s = app.settings
    values = s.values()
    values["db"] = redact_url(values["db"])
    if values.get("redis_url"):
        values["redis_url"] = redact_url(values["redis_url"])
    if as_json:
        emit_json(
            {
                "config_file": s.config_file,
                "options": {k: {"value": v, "source": s.sources[k]} for k, v in values.items()},
            }
        )
        return
    # plain aligned lines, never wrapped: paths and URLs are long and this output gets grepped
    click.echo(f"# config file: {clean(s.config_file or 'none')}")  # (a path is anyone's: escaped)
    shown = {k: clean(_show(v, BY_NAME[k].unit)) for k, v in values.items()}  # (a config file's text: escaped)
    sources = {k: clean(s.sources[k]) for k in shown}  # (one may name the file: its path escaped too)
    # values padded to a column that fits 80 with the sources: a longer one (a path) goes past it
    # on its own line only, not every line with it
    room = max(24, 80 - 16 - 2 - max(len(x) for x in sources.values()))
    width = max((len(v) for v in shown.values() if len(v) <= room), default=0)
    for k, v in shown.items():
        click.echo(f"{k:<15} {v:<{width}}  {sources[k]}")


def _show(v: Any, unit: str | None) -> str:  # any option's value
    """An option's value as people write it: sizes in KiB/MiB/GiB, durations in s/m/h/d."""
    if v is None:
        return "-"
    if isinstance(v, list):
        return ",".join(map(str, v)) or "-"
    if unit == "size":
        return format_size(v)
    if unit == "duration":
        return format_duration(v)
    return str(v)


COMMANDS = (daemon, config_group)
