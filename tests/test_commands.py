"""The command line loads a command's module only when that command runs (click's lazy group):
the table that says where each command lives must name every command, each where it is."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click

from cachemgr.cli import COMMAND_MODULES, cli
from tests.conftest import subprocess_env


def test_every_command_is_found_where_the_table_says():
    modules = sorted(set(COMMAND_MODULES.values()))
    defined = {c.name: m for m in modules for c in importlib.import_module(f"cachemgr.cli.{m}").COMMANDS}
    assert defined == COMMAND_MODULES
    ctx = cli.make_context("cachemgr", ["--help"], resilient_parsing=True)
    assert cli.list_commands(ctx) == sorted([*COMMAND_MODULES, "completion"])
    for name in COMMAND_MODULES:
        assert cli.get_command(ctx, name).name == name


def test_stats_loads_only_the_inspection_commands(tmp_path):
    code = (
        "import sys\n"
        "from cachemgr.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m.startswith('cachemgr.cli.')))\n"
    )
    (tmp_path / "cache" / "fxgraph").mkdir(parents=True)
    out = subprocess.run(
        [sys.executable, "-c", code, "--cache-dir", str(tmp_path / "cache"), "--db", f"sqlite:///{tmp_path / 'i.db'}"]
        + ["stats", "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "['cachemgr.cli.common', 'cachemgr.cli.inspect']"


def _helps(cmd: click.Command, ctx: click.Context):
    """(command path, --help text) of a command and every subcommand under it."""
    yield ctx.command_path, cmd.get_help(ctx)
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None
            yield from _helps(sub, click.Context(sub, info_name=name, parent=ctx))


def test_help_fits_80_columns_and_says_the_exit_codes():
    """Exit-code tables, examples and a --kind listing every kind ran to 95 columns."""
    helps = dict(_helps(cli, click.Context(cli, info_name="cachemgr", terminal_width=80)))
    assert len(helps) > 20
    for path, text in helps.items():
        assert not [line for line in text.splitlines() if len(line) > 80], path
    coded = ("scan", "stats", "ls", "show", "evict", "purge", "pin", "unpin", "check", "diff", "explain")
    for name in (*coded, "daemon", "prewarm", "export", "import"):
        assert "\n  Exit codes:\n      0 " in helps[f"cachemgr {name}"], name


def test_wide_characters_are_cut_and_padded_by_the_columns_they_take(tmp_path):
    """A CJK path took two columns a character, counted as one: `stats` and `show` lines ran to
    89 and 133 columns. `config show` padded every value to the longest (a long cache dir: every
    line 226 columns wide)."""
    from cachemgr.cli.common import cells, fields_block, short

    wide, mid = "缓存目录" * 12, "缓存目录" * 6  # (96 and 48 columns)
    assert 19 <= cells(short(wide, 20)) <= 20 and cells(short("x" * 30, 20)) == 20 and short("abc", 20) == "abc"
    import os

    from click.testing import CliRunner

    from cachemgr.cli.common import say

    os.environ["COLUMNS"] = "80"
    try:
        lines = fields_block([("cache", f"/tmp/{wide} and then {wide}"), ("index", "/tmp/index.db")])
        with CliRunner().isolation() as (out, _, _):
            say(f"cachemgr: warning: cannot read {mid}/ under /tmp/{mid}: its entries are kept as last indexed")
            said = out.getvalue().decode().splitlines()
    finally:
        del os.environ["COLUMNS"]
    assert max(map(cells, lines)) <= 80 and len(lines) == 4, lines
    assert len(said) > 1 and max(map(cells, said)) <= 80 and "".join(said).count(mid) == 2, said
    long_dir = tmp_path / ("d" * 150)
    out = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--config", "/dev/null", "--cache-dir", str(long_dir), "config", "show"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines()[1:] if len(line.split()[1]) <= 40]  # (those with a short value)
    assert len(rows) > 10 and max(map(len, rows)) <= 80, out.stdout


def test_an_entry_too_large_for_a_parse_worker_says_so():
    from cachemgr.index.describe import unreadable

    assert unreadable(MemoryError()).row["corrupt"] == "cannot be read: out of memory (a parse worker may take 512 MiB)"
