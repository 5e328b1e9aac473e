"""The command line loads a command's module only when that command runs (click's lazy group):
the table that says where each command lives must name every command, each where it is."""

from __future__ import annotations

import importlib
import subprocess
import sys

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
