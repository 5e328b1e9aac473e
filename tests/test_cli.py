"""The CLI from the outside: bad input is one line and an exit code, never a traceback; --db
makes no folder and adds no table to a database that is not cachemgr's."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import pytest


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["ls", "--larger-than", "12XB"], 2, "invalid size '12XB'"),
        (["ls", "--larger-than", "99999999999999999999999TiB"], 2, "larger than 8 EiB"),
        (["evict", "--max-size", "9" * 400 + "GiB", "--dry-run"], 2, "larger than 8 EiB"),  # (a float inf: exit 70)
        (["daemon", "--metrics", "99999"], 2, "(port 1-65535)"),
        (["daemon", "--scan-interval", "0"], 2, "must be at least 1s"),
        (["--host", "", "stats"], 2, "must not be empty"),
        (["purge", "--keep-torch", "2.11.0", "--all"], 2, "give --stale too"),
        (["purge", "--keep-torch", "2.11.0"], 2, "give --stale too"),  # (was "say what to purge")
        (["prewarm", "--manifest", "m.toml", "--timeout", "0"], 2, "'--timeout'"),
        (["ls", "--older-than", "soon"], 2, "invalid duration 'soon'"),
        (["ls", "--limit", "9" * 23], 2, "is not a count from 1 to 9223372036854775807"),  # (was exit 5)
        (["ls", "--limit", "0"], 2, "0 is not a count from 1"),
        (["ls", "--kind", "bogus"], 2, "'bogus' is not one of"),
        (["stats", "--window", "1y"], 2, "invalid duration"),
        (["show", "nosuchkey"], 3, "no entry 'nosuchkey'"),
        (["pin", "nosuchkey"], 3, "no entry 'nosuchkey'"),
        (["unpin", "nosuchkey"], 3, "'nosuchkey' is not pinned"),
        (["pin", "--reason", "x"], 2, "--reason needs a KEY (pin without one lists the pins)"),  # (it listed them)
        (["pin", "--force"], 2, "--force needs a KEY"),
        (["ls", "--graph", "fnosuchgraph"], 3, "no entry 'fnosuchgraph'"),
        (["ls", "--graph", "f", "--model", "m"], 2, "give --graph or --model, not both"),
        (["explain", "--model", "nosuch"], 3, "no recorded shapes for model 'nosuch'"),
        (["purge", "--model", "nosuch", "--yes"], 3, "no recorded shapes for model 'nosuch'"),
        (["shapes", "--model", "nosuch"], 3, "no recorded shapes for model 'nosuch'"),  # (was exit 0)
        (["purge", "--all", "-q"], 2, "give --yes or --dry-run too"),
        (["stats", "--fleet", "--by", "model"], 2, "--by model is per cache"),
        (["frobnicate"], 2, "No such command"),
    ],
)
def test_bad_input_is_one_line(fixture_cache, cli_for, args, code, message):
    cli = cli_for(fixture_cache())
    cli("scan")
    r = cli.proc(*args)
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cachemgr: error:") and message in lines[0], r.stderr


def test_errors_name_only_options_the_command_has(fixture_cache, cli_for):
    """`evict --model nope` said "or use --graph KEY", an option evict lacks; ls has it."""
    cli = cli_for(fixture_cache())
    cli("scan")
    assert "--graph" not in cli("evict", "--max-age", "1d", "--model", "nope", code=3).stderr
    assert "or use --graph KEY)" in cli("ls", "--model", "nope", code=3).stderr


def test_pin_quiet_prints_nothing_but_the_listed_keys(fixture_cache, cli_for):
    cli = cli_for(fixture_cache())
    cli("scan")
    short = cli.json("ls", "--kind", "fxgraph")[0]["short"]
    assert cli("pin", short, "-q").stdout == "" and cli("pin", short, "-q", "--reason", "r").stdout == ""
    assert cli("pin", "-q").stdout == short + "\n"


def test_pin_scans_a_cache_never_scanned(fixture_cache, cli_for, tmp_path):
    """pin on a fresh index said "no entry" where every other command scans first."""
    cache = fixture_cache()
    short = cli_for(cache, db=f"sqlite:///{tmp_path / 'other.db'}").json("ls", "--kind", "fxgraph")[0]["short"]
    r = cli_for(cache)("pin", short)
    assert r.stdout == f"pinned {short}\n" and "was never scanned; scanning it now" in r.stderr


def test_check_refuses_a_cuda_device_this_host_lacks_as_prewarm_does(fixture_cache, cli_for):
    """check --devices cuda:0 on a host without CUDA went ahead and predicted hits there."""
    r = cli_for(fixture_cache()).proc("check", "--devices", "cuda:0", env={"CUDA_VISIBLE_DEVICES": ""})
    assert (r.returncode, r.stderr) == (
        2,
        "cachemgr: error: --devices cuda:0: this host has no CUDA device (CUDA_VISIBLE_DEVICES='' hides them all)\n",
    )


def test_a_device_number_of_other_digits_is_no_device(fixture_cache, cli_for):
    """`cuda:٣` (an Arabic-Indic three) passed as a device number: only ASCII digits name one."""
    r = cli_for(fixture_cache()).proc("check", "--devices", "cuda:\u0663")
    assert r.returncode == 2 and "devices are cpu, cuda or cuda:N" in r.stderr, r.stderr


def test_show_json_is_one_object_however_many_entries_a_key_names(fixture_cache, cli_for):
    """show --json was an object for one entry and an array for a graph of several."""
    root = fixture_cache()
    fx = sorted(root.glob("fxgraph/*/*/*"))[0]
    shutil.copy2(fx, fx.with_name("zz" + fx.name[2:]))  # one graph, two guard sets
    cli = cli_for(root)
    cli("scan")
    one = cli.json("show", str(fx.relative_to(root)))
    assert one["key"] == str(fx.relative_to(root)) and one == {**one["entries"][0], "entries": one["entries"]}
    both = cli.json("show", fx.parent.name)
    assert len(both["entries"]) == 2 and {**both["entries"][0], "entries": both["entries"]} == both


def test_fleet_report_counts_only_fxgraph_entries_per_torch_version(fixture_cache, cli_for):
    """torch 2.5's AOT entries carry a version (by their field set): fleet report counted them as
    fxgraph entries (14 where ls --kind fxgraph lists 8), and their bytes twice."""
    cli = cli_for(fixture_cache("mixed-2.5.1-2.13.0-cpu"))
    cli("scan")
    rows = cli.json("ls")
    versions = cli.json("fleet", "report")["torch_versions"]
    assert {v["torch_version"] for v in versions} == {"2.5.*", "2.13.0+cpu"}
    for v in versions:
        fx = [e for e in rows if e["kind"] == "fxgraph" and e["torch_version"] == v["torch_version"]]
        assert (v["fxgraph_entries"], v["fxgraph_bytes"]) == (len(fx), sum(e["bytes"] for e in fx))


def test_a_dead_worker_is_not_reported_with_torch_s_numpy_warning(tmp_path, cli_for):
    """torch without NumPy warns at import; a worker that then died was reported with the
    warning's last line ('cpu = _conversion_method_template(...)') as its cause."""
    mods = tmp_path / "mods"
    (mods / "numpy").mkdir(parents=True)
    (mods / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    (mods / "dies.py").write_text("import os\n\n\ndef factory():\n    os.kill(os.getpid(), 9)\n")
    (tmp_path / "m.toml").write_text('[[model]]\nname = "m"\nfactory = "dies:factory"\nshapes = [["f32[2]"]]\n')
    r = cli_for(tmp_path / "cache").proc(
        "prewarm", "--manifest", str(tmp_path / "m.toml"), env={"PYTHONPATH": f"{mods}{os.pathsep}{os.getcwd()}"}
    )
    assert r.returncode == 8 and "NumPy" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.stderr.splitlines()[-1].endswith("worker died (killed by signal 9))"), r.stderr


def test_what_a_pin_keeps_names_the_pinned_entry(fixture_cache, cli_for, monkeypatch):
    """A pinned C++ build keeps the graph that needs it (a group goes whole): purge said '1 pinned'
    and show named the group's AOT entry as what keeps it, neither pinned nor in ls --pinned."""
    cli = cli_for(fixture_cache())
    cli("scan")
    build = next(e for e in cli.json("ls", "--kind", "code") if e["alias"])  # a C++ build: src-...
    graph = cli.json("show", build["key"])["referenced_by"][0]
    cli("pin", build["key"])
    (pinned,) = cli.json("ls", "--pinned")
    assert pinned["key"] == build["key"]
    said = cli("purge", "--key", graph, "--dry-run", "--grace", "0").stdout
    assert said == f"nothing to purge (1 matching entry kept: 1 pinned, by the pin of {pinned['short']})\n"
    monkeypatch.setenv("CACHEMGR_MAX_SIZE", "1KiB")
    monkeypatch.setenv("CACHEMGR_GRACE", "0s")
    fate = {"verdict": "kept", "reason": "pinned", "by": pinned["key"], "by_short": pinned["short"]}
    assert cli.json("show", graph)["eviction"] == fate
    assert f"eviction      kept: pinned (by the pin of {pinned['short']})\n" in cli("show", graph).stdout


def test_missing_cache_dir(tmp_path, cli_for):
    r = cli_for(tmp_path / "nope").proc("scan")
    assert r.returncode == 4 and r.stderr.strip() == (
        f"cachemgr: error: cache directory {tmp_path / 'nope'} does not "
        "exist (set --cache-dir or TORCHINDUCTOR_CACHE_DIR)"
    )


def test_export_of_a_missing_cache_dir_is_exit_4(tmp_path, cli_for):
    """export made the missing directory, started torch and failed with exit 8 ("nothing to
    export"); like every command that reads a cache it is exit 4, before torch starts."""
    r = cli_for(tmp_path / "nope").proc("export", "--out", str(tmp_path / "b.bundle"))
    assert r.returncode == 4 and r.stderr == (
        f"cachemgr: error: cache directory {tmp_path / 'nope'} does not "
        "exist (set --cache-dir or TORCHINDUCTOR_CACHE_DIR)\n"
    )
    assert not (tmp_path / "nope").exists() and not (tmp_path / "b.bundle").exists()


def test_check_of_a_missing_cache_dir_is_exit_4(tmp_path, cli_for):
    for r in (cli_for(tmp_path / "nope").proc("check"), cli_for(tmp_path).proc("check", "--cache-dir", "nope")):
        assert r.returncode == 4 and r.stderr.startswith("cachemgr: error: cache directory "), r.stderr  # (was 2)
        assert "nope does not exist" in r.stderr


@pytest.mark.parametrize(
    "url,message",
    [
        ("notaurl", "not a database URL"),
        ("mysql://u:secret@x/y", "'mysql://' is not a database cachemgr supports"),
        ("postgres://x/y", "'postgres://' is not a database cachemgr supports"),
    ],
)
def test_a_database_cachemgr_does_not_support_is_a_usage_error(fixture_cache, cli_for, url, message):
    """Such a URL got as far as SQLAlchemy: exit 5, "No module named 'MySQLdb'". The URL itself,
    which may hold a password, is not repeated."""
    r = cli_for(fixture_cache(), db=url).proc("stats")
    assert r.returncode == 2 and r.stderr == (
        f"cachemgr: error: db from flag: {message}: give sqlite:///PATH or postgresql+psycopg://USER@HOST/DB\n"
    )


def test_bad_db_url(fixture_cache, cli_for):
    r = cli_for(fixture_cache(), db="postgresql+psycopg://nobody@127.0.0.1:1/none").proc("scan")
    assert r.returncode == 5 and "Traceback" not in r.stderr
    assert r.stderr.startswith("cachemgr: error: cannot open the index")


def test_a_database_failure_mid_command_is_one_line(gpu_cache, cli_for, db_url):
    """The index refuses a write half-way (here a trigger; in life a read-only file, a full disk or
    a lost race twice over): one line and exit 5, no SQL dump. An index a newer cachemgr migrated
    says so."""
    import sqlite3

    cli = cli_for(gpu_cache)
    cli("scan")
    path = db_url.split(":///", 1)[1]
    with sqlite3.connect(path) as c:
        c.execute(
            "CREATE TRIGGER refuse BEFORE INSERT ON entries BEGIN SELECT RAISE(ABORT, 'disk quota exceeded'); END"
        )
    (gpu_cache / "zz").mkdir()
    (gpu_cache / "zz" / ("cz" + "q" * 50 + ".py")).write_text("# a new generated module\n")
    r = cli.proc("scan")
    assert r.returncode == 5 and r.stderr == "cachemgr: error: index database: disk quota exceeded\n", r.stderr
    with sqlite3.connect(path) as c:
        c.execute("DROP TRIGGER refuse")
        c.execute("UPDATE alembic_version SET version_num = '9999'")
    r = cli.proc("stats")
    assert r.returncode == 5 and "was written by a newer cachemgr (schema revision 9999)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    for odd in ("", "@", "zzzz9999"):  # no revision at all: alembic asserted on the first two (exit 70)
        with sqlite3.connect(path) as c:
            c.execute("UPDATE alembic_version SET version_num = ?", (odd,))
        r = cli.proc("scan")
        assert r.returncode == 5 and f"names schema revision {odd!r}, which no cachemgr writes" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_stats_scans_a_never_scanned_cache(fixture_cache, cli_for):
    cli = cli_for(fixture_cache())
    r = cli("stats", "--json")
    assert "never scanned" in r.stderr
    assert json.loads(r.stdout)["entries"] > 0


def test_human_output(gpu_cache, cli_for):
    cli = cli_for(gpu_cache)
    assert "262 added" in cli("scan").stdout
    out = cli("stats").stdout
    assert "triton" in out and "total" in out and "hit ratio" in out and "(no max_size)" in out
    out = cli("ls", "--kind", "fxgraph", "--sort", "cost").stdout
    listed = cli.json("ls", "--kind", "fxgraph", "--sort", "cost")
    assert [line.split()[0] for line in out.splitlines()[1:-1]] == [e["short"] for e in listed]
    assert "cuda:0" in out and out.splitlines()[-1] == "6 entries, 13.2 MiB"
    shown = cli("show", listed[0]["short"]).stdout
    assert "needs" in shown and "triton 62" in shown and f"key           {listed[0]['key']}" in shown
    piped = cli("ls", "--wide").stdout.splitlines()  # --wide: whole keys, first on their line, to paste
    assert {line.split()[0] for line in piped[1:-1]} == {e["key"] for e in cli.json("ls")}
    assert cli("ls", "-q").stdout.split() == [e["short"] for e in cli.json("ls")]
    assert "no entries match" in cli("ls", "--larger-than", "1TiB").stdout
    assert cli("ls", "--kind", "lock").stdout.startswith("no entries match")


def test_cache_dir_precedence(tmp_path, monkeypatch):
    from cachemgr import config

    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}
    assert config.load(environ=env).cache_dir == str(tmp_path / "ind")
    env["CACHEMGR_CACHE_DIR"] = str(tmp_path / "mine")
    s = config.load(environ=env)
    assert s.cache_dir == str(tmp_path / "mine") and s.sources["cache_dir"] == "env CACHEMGR_CACHE_DIR"
    assert config.load(environ=env, flags={"cache_dir": str(tmp_path / "flag")}).cache_dir == str(tmp_path / "flag")
    assert config.load(environ={}).cache_dir.endswith("torchinductor_" + __import__("getpass").getuser())
    assert config.load(environ={"STATE_DIRECTORY": "/var/lib/cachemgr"}).db == "sqlite:////var/lib/cachemgr/index.db"
    assert config.load(environ={"XDG_STATE_HOME": "/x"}).db == "sqlite:////x/cachemgr/index.db"
    assert config.load(environ={"CACHEMGR_DB": "postgresql+psycopg:///test"}).db == "postgresql+psycopg:///test"


def test_dev_null_is_the_empty_config_file(fixture_cache, cli_for):
    """/dev/null, the conventional "no config", was refused: "not a regular file" (exit 2)."""
    cli = cli_for(fixture_cache())
    for args, env in ((["config", "show"], {"CACHEMGR_CONFIG": os.devnull}), (["--config", os.devnull, "stats"], {})):
        r = cli.proc(*args, env=env)
        assert r.returncode == 0 and r.stderr in ("", f"cachemgr: {cli.cache_dir} was never scanned; scanning it now\n")
    assert "# config file: /dev/null" in cli.proc("config", "show", env={"CACHEMGR_CONFIG": os.devnull}).stdout


def test_units():
    from cachemgr.errors import UsageError
    from cachemgr.units import parse_duration, parse_size

    assert parse_size("20GiB") == 20 * 1024**3 and parse_size("500MB") == 500 * 1000**2 and parse_size("0") == 0
    assert parse_duration("14d") == 14 * 86400 and parse_duration("6h") == 21600 and parse_duration("30m") == 1800
    for bad in ("", "GiB", "-1GB", "1 parsec"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_default_cache_dir_not_created_yet_is_empty(tmp_path):
    """On a fresh host Inductor's default dir does not exist until the first compile."""
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env(TMPDIR=str(tmp_path), XDG_STATE_HOME=str(tmp_path / "state"))
    r = subprocess.run([sys.executable, "-m", "cachemgr", "scan", "--json"], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "does not exist yet" in r.stderr, r.stderr
    assert __import__("json").loads(r.stdout)["added"] == 0
    assert not (tmp_path / f"torchinductor_{__import__('getpass').getuser()}").exists()  # nothing created
    # a directory the user named and mistyped is still an error
    r = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--cache-dir", str(tmp_path / "typo"), "scan"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 4


def test_readme_lists_every_setting():
    """The README's settings table names every option `config show` knows, and nothing else."""
    import re

    from conftest import REPO

    from cachemgr import config

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Settings") :]
    section = section[: section.index("\n## ", 1)]
    listed = re.findall(r"^\| `(\w+)`", section, re.MULTILINE)
    assert sorted(listed) == sorted(o.name for o in config.OPTIONS) and len(set(listed)) == len(listed)


def test_bare_command_prints_its_help():
    import subprocess
    import sys

    from conftest import subprocess_env

    r = subprocess.run(
        [sys.executable, "-m", "cachemgr"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.startswith("Usage: cachemgr") and "scan" in r.stdout and r.stderr == ""


def test_show_compile_time_and_hostile_guards(gpu_cache, cli_for, db_url):
    """Numbers as people read them; a guard string with terminal escapes is shown escaped, never sent."""
    cli = cli_for(gpu_cache)
    cli("scan")
    fx = cli.json("ls", "--kind", "fxgraph", "--sort", "cost")[0]
    with sqlite3.connect(db_url.split(":///", 1)[1]) as c:
        c.execute("UPDATE entries SET guards = ? WHERE key = ?", ("L['x'] > 2\x1b]0;pwned\x07\x1b[2J", fx["key"]))
    out = cli("show", fx["short"]).stdout
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned" in out
    assert f"compile time  {fx['compile_seconds']:.2f}s" in out and str(fx["compile_seconds"]) not in out


def test_db_never_makes_a_folder_or_joins_a_foreign_database(fixture_cache, cli_for, tmp_path):
    root = fixture_cache()
    missing = tmp_path / "no" / "such" / "dir" / "x.db"
    r = cli_for(root, db=f"sqlite:///{missing}").proc("scan")
    assert r.returncode == 5 and "does not exist: cachemgr creates only its default state folder" in r.stderr
    assert not (tmp_path / "no").exists()
    foreign = tmp_path / "app.db"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    r = cli_for(root, db=f"sqlite:///{foreign}").proc("stats")
    assert r.returncode == 5 and "holds tables that are not cachemgr's (users): refusing" in r.stderr, r.stderr
    with sqlite3.connect(foreign) as c:
        assert [t for (t,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["users"]
    # one whose table has the name of one of cachemgr's (it used to get the others added beside it)
    named_alike = tmp_path / "app2.db"
    with sqlite3.connect(named_alike) as c:
        c.execute("CREATE TABLE entries (id INTEGER PRIMARY KEY, title TEXT)")
    for command in ("stats", "scan"):
        r = cli_for(root, db=f"sqlite:///{named_alike}").proc(command)
        assert r.returncode == 5 and "holds tables that are not cachemgr's (entries): refusing" in r.stderr, r.stderr
    with sqlite3.connect(named_alike) as c:
        assert [t for (t,) in c.execute("SELECT name FROM sqlite_master")] == ["entries"]
        assert c.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    # a '#' and a '?'-free odd name in a SQLite path is part of the name: no stray file beside it
    odd = tmp_path / "odd#dir"
    odd.mkdir()
    cli = cli_for(root, db=f"sqlite:///{odd / 'i#x.db'}")
    cli("scan")
    assert json.loads(cli.proc("stats", "--json").stdout)["entries"] > 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["app.db", "app2.db"]
    assert (odd / "i#x.db").is_file()


def test_default_state_folder_is_created(fixture_cache, tmp_path):
    import subprocess
    import sys

    from conftest import subprocess_env

    env = subprocess_env(XDG_STATE_HOME=str(tmp_path / "xdg"))
    r = subprocess.run(
        [sys.executable, "-m", "cachemgr", "--cache-dir", str(fixture_cache()), "scan"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "xdg" / "cachemgr" / "index.db").is_file()


@pytest.mark.slow  # a real process per command
def test_missing_cache_dir_is_exit_4_for_every_reader(tmp_path, cli_for):
    cli = cli_for(tmp_path / "nope")
    for args in (["ls"], ["stats"], ["show", "fabcdefgh"], ["explain"]):
        r = cli.proc(*args)
        assert r.returncode == 4 and "does not exist" in r.stderr, (args, r.stderr)


def test_shell_completion(fixture_cache, cli_for):
    import subprocess
    import sys

    from conftest import subprocess_env

    cli = cli_for(fixture_cache())
    cli("scan")
    assert "_CACHEMGR_COMPLETE=bash_complete" in cli("completion", "bash").stdout
    short = cli.json("ls", "--kind", "fxgraph")[0]["short"]
    env = subprocess_env(
        _CACHEMGR_COMPLETE="bash_complete",
        COMP_WORDS=f"cachemgr {' '.join(cli.base())} show " + short[:5],
        COMP_CWORD=str(len(cli.base()) + 2),
    )
    r = subprocess.run([sys.executable, "-m", "cachemgr"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"plain,{short}" in r.stdout.splitlines(), r.stdout + r.stderr
    env["COMP_WORDS"] = "cachemgr st"
    env["COMP_CWORD"] = "1"
    r = subprocess.run([sys.executable, "-m", "cachemgr"], env=env, capture_output=True, text=True, timeout=60)
    assert {"plain,stats", "plain,show"} <= set(r.stdout.splitlines()) or "plain,stats" in r.stdout, r.stdout


def test_a_library_warning_is_one_line():
    """A library's warning printed two lines, one of them cachemgr's own source; it is one
    `cachemgr: warning:` line, without the library's link."""
    from cachemgr.cli import _one_line_warning

    message = "Query string argument(s) 'x' are ignored;\n  see (Background on this warning at: https://x)"
    line = _one_line_warning(UserWarning(message), UserWarning, "/src/cachemgr/x.py", 10)
    assert line == "cachemgr: warning: Query string argument(s) 'x' are ignored; see\n"


@pytest.mark.parametrize(
    "url,message",
    [
        # SQLite's driver ignored ?mode=ro (with a warning) and the index was written all the same
        ("sqlite:///{db}?mode=ro", "a SQLite index URL takes no option but ?timeout=SECONDS"),
        ("sqlite:///file:{db}?mode=ro&uri=true", "a SQLite index URL takes no option but ?timeout=SECONDS"),
        # libpq's default database (named after the user) took cachemgr's tables
        ("postgresql+psycopg://", "name the database"),
        ("postgresql+psycopg://postgres@127.0.0.1:5432", "name the database"),
    ],
)
def test_an_index_url_that_would_write_where_it_does_not_say_is_a_usage_error(
    fixture_cache, cli_for, tmp_path, url, message
):
    db = tmp_path / "i.db"
    r = cli_for(fixture_cache(), db=url.format(db=db)).proc("scan")
    assert r.returncode == 2 and r.stderr.startswith(f"cachemgr: error: db from flag: {message}"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and not db.exists()


def test_passwords_are_never_shown(fixture_cache, cli_for, tmp_path):
    """`config show` printed the Redis URL's password (the index's was replaced), and a password
    given as ?password= was printed by every message naming the URL."""
    cli = cli_for(fixture_cache(), db="postgresql+psycopg://nobody@127.0.0.1:1/none?password=qsecret")
    env = {"CACHEMGR_REDIS_URL": "redis://u:hunter2@127.0.0.1:6379/3"}
    for args in (["config", "show"], ["config", "show", "--json"], ["scan"]):
        r = cli.proc(*args, env=env)
        assert "hunter2" not in r.stdout + r.stderr and "qsecret" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert r.returncode == (5 if args == ["scan"] else 0), r.stderr
    assert "u:***@127.0.0.1" in cli.proc("config", "show", env=env).stdout


@pytest.mark.parametrize(
    "db, env, config",
    [
        ("postgresql://u:s3cretA@h/db%00", {}, None),  # a bad value: its message
        (None, {"CACHEMGR_REDIS_URL": "redis://u:s3cretB@h/0\udcff"}, None),  # (not UTF-8, as the shell gives it)
        (None, {}, 'redis_url = ["redis://u:s3cretC@h/0"]\n'),  # a list
        (None, {}, 'redis_url = { url = "redis://u:s3cretD@h/0" }\n'),  # a table
        (None, {"CACHEMGR_REDIS_URL": "rediss://h/0?pass%77ord=s3cretE"}, None),  # percent-encoded: redis-py's password
        ("postgresql+psycopg://u@127.0.0.1:1/db?sslpassword=s3cretF", {}, None),  # libpq's
        (None, {"CACHEMGR_REDIS_URL": "redis://u:pa?s3cretG@h/0"}, None),  # a password holding '?' (a URL that fails)
    ],
)
def test_no_password_is_shown_whatever_the_url_holds(fixture_cache, cli_for, tmp_path, db, env, config):
    """A setting refused for its value was shown whole (repr), its password too; and a password
    given percent-encoded, as libpq's sslpassword, or holding a '?' was not recognised."""
    env = dict(env)
    if config:
        (tmp_path / "c.toml").write_text(config)
        env["CACHEMGR_CONFIG"] = str(tmp_path / "c.toml")
    cli = cli_for(fixture_cache(), **({"db": db} if db else {}))
    for args in (["config", "show"], ["config", "show", "--json"], ["stats"], ["remote", "stats"]):
        r = cli.proc(*args, env=env)
        assert "s3cret" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert r.returncode in (0, 2, 5, 6), r.stderr


def test_an_error_quoting_hostile_text_sends_no_escape(fixture_cache, cli_for, tmp_path):
    """A setting (or a server's answer) holding an escape sequence reached the terminal as it was
    in the one error line: a forged line, a window title. It is shown escaped."""
    (tmp_path / "c.toml").write_text('redis_url = "redis://h/0?x=\\u001b]0;T\\u0007\\r\\ncachemgr: ok"\n')
    cli = cli_for(fixture_cache())
    r = cli.proc("remote", "stats", env={"CACHEMGR_CONFIG": str(tmp_path / "c.toml")})
    assert r.returncode == 2 and "\x1b" not in r.stderr and "\x07" not in r.stderr and "\r" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "\\x1b]0;T\\x07" in r.stderr, r.stderr
    (tmp_path / "c.toml").write_text('keep_torch = ["2.13.0\\u001b]0;T\\u0007"]\n')
    r = cli.proc("config", "show", env={"CACHEMGR_CONFIG": str(tmp_path / "c.toml")})
    assert r.returncode == 0 and "\x1b" not in r.stdout and "2.13.0\\x1b]0;T\\x07" in r.stdout, r.stdout


@pytest.mark.parametrize("value", ["a b:80", "999.1.1.1:80", "\u00fcn\u00ef:80", "-x:80"])
def test_a_metrics_address_that_names_no_host_is_a_usage_error(fixture_cache, cli_for, value):
    """It was taken, and the daemon then failed to start with exit 1 (a code its help does not list)."""
    r = cli_for(fixture_cache()).proc("config", "show", env={"CACHEMGR_METRICS": value})
    assert r.returncode == 2 and "is not an IP address or a host name" in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_json_output_is_strict_json():
    """A NaN or an infinity (a hostile index row, Redis value or bundle header) was printed as
    NaN / Infinity, which JSON has not: strict parsers refused the whole document."""
    from cachemgr.cli.common import json_text

    doc = {"a": float("nan"), "b": [1.5, float("-inf"), {"c": float("inf")}], "d": (2.0, "x")}
    assert json.loads(json_text(doc), parse_constant=lambda c: pytest.fail(c)) == {
        "a": None,
        "b": [1.5, None, {"c": None}],
        "d": [2.0, "x"],
    }


def test_a_key_given_with_bytes_that_are_not_utf8_is_looked_up_as_the_index_keys_it(fixture_cache, cli_for):
    """A name with a byte that is not UTF-8, typed or pasted raw (the shell hands it on as a
    surrogate), is the %XX key the index holds; an unknown one is 'not found' (both were exit 70)."""
    import subprocess
    import sys

    from conftest import subprocess_env

    root = fixture_cache()
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab").joinpath(os.fsdecode(b"odd-\xff.bin")).write_bytes(b"x")
    cli = cli_for(root)
    cli("scan")
    assert "ab/odd-%FF.bin" in {e["key"] for e in cli.json("ls")}
    base = [sys.executable, "-m", "cachemgr", *cli.base()]
    r = subprocess.run([*base, "show", b"ab/odd-\xff.bin", "--json"], capture_output=True, env=subprocess_env())
    assert r.returncode == 0 and json.loads(r.stdout)["key"] == "ab/odd-%FF.bin", r.stderr
    for command in ("show", "pin", "unpin"):
        r = subprocess.run([*base, command, b"\xfe\xff"], capture_output=True, env=subprocess_env())
        assert r.returncode == 3 and b"internal error" not in r.stderr, (command, r.stderr)


def test_a_key_that_begins_with_a_dash_is_named_after_double_dash(fixture_cache, cli_for):
    """Any file under the root is indexed, '-odd' too; click reads such a word as an option, so
    every command that takes a KEY says in --help that it goes after `--`, and it works there."""
    root = fixture_cache()
    (root / "-odd").write_bytes(b"x")
    cli = cli_for(root)
    cli("scan")
    assert json.loads(cli("show", "--json", "--", "-odd").stdout)["key"] == "-odd"
    assert "No such option" in cli("show", "-odd", code=2).stderr
    assert cli("pin", "--", "-odd").stdout.startswith("pinned -odd")
    assert cli("unpin", "--", "-odd").stdout.startswith("unpinned -odd")
    for command in ("show", "pin", "unpin", "diff"):
        assert "`--`" in cli(command, "--help").stdout, command


PROGRESS_ON_A_TERMINAL = """
import sys
from cachemgr.cli.common import progress_bar
with progress_bar("parsing entries", enabled=True) as update:
    assert "rich" not in sys.modules, "rich imported before the first update"
    update(1, 3)
    assert "rich" in sys.modules
    update(3, 3)
print("ok")
"""


def test_the_progress_bar_starts_at_its_first_update():
    """A scan on a terminal opens its progress bar before phase one (a first scan runs both
    phases in one call): rich's import and the bar wait for the first entry parsed, so the walk
    to a usable index never pays for them, nor does a scan that parses nothing."""
    import subprocess
    import sys

    from conftest import subprocess_env

    out = subprocess.run(
        [sys.executable, "-c", PROGRESS_ON_A_TERMINAL], env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr
