"""Settings values that were taken though wrong: a file's value hidden by a variable, a size under
one byte, digits of other scripts. Each is a ConfigError naming key and source
(one line, exit 2)."""

from __future__ import annotations

import pytest

from cachemgr import config
from cachemgr.errors import ConfigError, UsageError
from cachemgr.units import parse_size


def load(tmp_path, toml: str, **environ: str) -> config.Settings:
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml + "\n")
    return config.load(config_file=str(cfg), environ=environ)


def test_a_file_value_a_variable_or_flag_overrides_is_still_checked(tmp_path, cli_for):
    """`max_size = "garbage"` in the file, CACHEMGR_MAX_SIZE=1GB set: exit 0, and a daemon later
    restarted without the variable failed to start. Every value set is checked, the winner's
    source still named in `config show`."""
    cfg = tmp_path / "config.toml"
    with pytest.raises(ConfigError, match=f"^max_size from file {cfg}: invalid size 'garbage'"):
        load(tmp_path, 'max_size = "garbage"', CACHEMGR_MAX_SIZE="1GB")
    with pytest.raises(ConfigError, match="^grace from env CACHEMGR_GRACE: invalid duration 'soon'"):
        config.load(config_file=None, environ={"CACHEMGR_GRACE": "soon"}, flags={"grace": "1m"})
    s = load(tmp_path, 'max_size = "2GB"', CACHEMGR_MAX_SIZE="1GB")
    assert (s.max_size, s.sources["max_size"]) == (10**9, "env CACHEMGR_MAX_SIZE")
    cfg.write_text('max_size = "garbage"\n')
    (tmp_path / "cache").mkdir()
    env = {"CACHEMGR_CONFIG": str(cfg), "CACHEMGR_MAX_SIZE": "1GB"}
    r = cli_for(tmp_path / "cache").proc("config", "show", env=env)
    assert (r.returncode, r.stderr.count("\n")) == (2, 1) and "max_size from file" in r.stderr, r.stderr


def test_config_show_escapes_the_config_files_path(tmp_path, cli_for):
    """The path of the config file is anyone's name: `config show` printed it raw on its first line
    (a window title, a cleared screen); its errors already escaped it."""
    folder = tmp_path / "c\x1b]0;PWNED\x07\x1b[2J"
    folder.mkdir()
    cfg = folder / "config.toml"
    cfg.write_text('max_size = "2GB"\n')
    (tmp_path / "cache").mkdir()
    r = cli_for(tmp_path / "cache").proc("config", "show", env={"CACHEMGR_CONFIG": str(cfg)})
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout, r.stdout
    assert r.stdout.splitlines()[0] == "# config file: " + str(cfg).replace("\x1b", "\\x1b").replace("\x07", "\\x07")


@pytest.mark.parametrize("size", ["0.4B", "0.5", "0.0001KB"])
def test_a_size_under_one_byte_is_refused(size, tmp_path):
    """`max_size = "0.4B"` (or "0.5") was cut down to 0 bytes: a cap that evicts everything."""
    with pytest.raises(ConfigError, match=f"^max_size from file .*: invalid size '{size}': less than one byte"):
        load(tmp_path, f'max_size = "{size}"')


def test_sizes_are_exact_and_drop_a_fraction_of_a_byte():
    sizes = ("1.5GiB", "1.1GB", "0.5KB", "2.25KiB", "1.1KiB", "0", "0.0B")
    assert [parse_size(s) for s in sizes] == [3 << 29, 1_100_000_000, 500, 2304, 1126, 0, 0]
    with pytest.raises(UsageError, match="too many digits"):
        parse_size("1." + "0" * 5000 + "1")  # (past the 4,300 digits Python converts)


@pytest.mark.parametrize(
    "line,says",
    [
        ('max_size = "\uff11\uff10GB"', "invalid size"),  # fullwidth 10
        ('max_age = "\u0661\u0664d"', "invalid duration"),  # Arabic-Indic 14
        ('low_water = "\u0660.\u0669"', "must be a number in (0, 1]"),
        ('min_free = "\u0661\u0660%"', "invalid percentage"),
    ],
)
def test_digits_of_other_scripts_are_refused(line, says, tmp_path):
    """`\\d` and float() take any script's digits: "１０GB" was 10 GB and "١٤d" 14 days. Only ASCII
    digits are numbers here, as in every other setting."""
    key = line.split(" ")[0]
    with pytest.raises(ConfigError, match=f"^{key} from file ") as e:
        load(tmp_path, line)
    assert says in str(e.value)


def test_numbers_are_read_as_float_reads_them_in_ascii():
    """'.5%' and '5.' were taken before digits were held to ASCII (a min_free = ".5%" that
    loaded then must load now)."""
    from cachemgr.units import parse_size_or_percent

    assert [parse_size_or_percent(s) for s in (".5%", "5.%")] == [(None, 0.005), (None, 0.05)]
    assert [parse_size(s) for s in (".5KB", "5.KB")] == [500, 5000]
