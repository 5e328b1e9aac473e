"""Prewarm, export and import against what they must not trust or must not leave: a mount point in
an import's staging folder, recorded shapes no replay can build as they are, a bundle's header and
size, an interrupted run's temporary files, text that reaches the terminal."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cachemgr import safefs
from cachemgr.prewarm import bundle, worker
from tests.conftest import REPO, Cli, subprocess_env
from tests.test_prewarm import ENV, ConfCli, proc_json


@pytest.fixture
def bind_mount():
    """mount(src, dst): `mount --bind` (root only: skipped otherwise); unmounted after the test."""
    made: list[Path] = []

    def mount(src: Path, dst: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("mount --bind needs root")
        r = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"mount --bind failed: {r.stderr.strip()}")
        made.append(dst)

    yield mount
    for dst in reversed(made):
        subprocess.run(["umount", str(dst)], check=True)


def test_a_dead_import_staging_is_removed_but_nothing_at_or_above_a_mount_point(tmp_path, bind_mount):
    """An import removes the staging folders killed imports left; shutil.rmtree crossed into a
    folder bind-mounted inside one and emptied it. One holding a mount point now stays whole; and
    the remover itself enters no directory of another mount (one mounted after the table was read)."""
    root = tmp_path / "cache"
    (root / "fxgraph").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("x")
    dead = time.time() - worker.STAGING_DEAD - 3600

    def staging(name: str) -> Path:
        folder = root / name
        folder.mkdir()
        (folder / worker.STAGING_MARK).touch()
        os.utime(folder / worker.STAGING_MARK, (dead, dead))
        return folder

    mounted = staging("tmpabcdefgh")
    (mounted / "m").mkdir()
    bind_mount(victim, mounted / "m")
    left = staging("tmpdeadbeef")
    (left / "fxgraph" / "ab").mkdir(parents=True)
    (left / "fxgraph" / "ab" / "entry").write_text("y")
    (left / "elsewhere").symlink_to(victim)  # unlinked, never followed

    worker._remove_dead_stagings(str(root))
    assert not left.exists()
    assert (victim / "f").read_text() == "x"
    assert sorted(p.name for p in mounted.iterdir()) == [worker.STAGING_MARK, "m"]

    with safefs.Root(str(root)) as r:  # the remover alone: the mount is skipped, the rest goes
        assert safefs.remove_tree(r.fd, "tmpabcdefgh", r.mount) is False
    assert (victim / "f").read_text() == "x"
    assert [p.name for p in mounted.iterdir()] == ["m"]


def _graphs(cache: Path) -> list[tuple[str, bytes]]:
    """A cache's fxgraph entries as a bundle holds them: (key, bytes)."""
    files = (f for f in sorted((cache / "fxgraph").rglob("*")) if f.is_file() and not f.name.startswith("."))
    return [(f.parent.name, f.read_bytes()) for f in files]


@pytest.mark.slow  # an import worker starts torch
def test_the_check_of_a_bundle_of_thousands_of_graphs_reaches_the_cli(fixture_cache, tmp_path, db_url):
    """The worker's `imported` event names every graph of the bundle's check: at about 3,500 graphs
    it was over the 1 MiB an event line could be, was dropped, and a good import (or check) was
    reported as failed, "the import worker reported nothing" (exit 9). A bundle may hold 50,000."""
    cache = fixture_cache("torch-2.13.0-cpu")
    junk = [("f" + hashlib.sha256(str(i).encode()).hexdigest()[:51], b"not a pickle") for i in range(5000)]
    path = tmp_path / "many.bundle"
    bundle.write(str(path), {"torch": "2.13.0+cpu"}, bundle.payload_of({"inductor": _graphs(cache) + junk}))
    r = Cli(cache, db_url).proc("import", str(path), "--check-only", "--allow-partial", "--json", timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout) > 1 << 20
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["check"]["graphs"] == 5008 and doc["check"]["hit"] > 0
    assert len(doc["check"]["missing"]) == 5000  # each junk entry: it does not read


def _recorded(tmp_path: Path, db_url: str, shapes: list[tuple[str, list[int], list[int], str]]) -> ConfCli:
    """A CLI whose spool holds these recorded calls, one tensor each: (model, shape, stride, dtype)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    t0 = time.time() - 100
    lines = []
    for i, (model, shape, stride, dtype) in enumerate(shapes):
        arg = {"t": "tensor", "shape": shape, "dtype": dtype, "device": "cpu", "stride": stride}
        spec = {"args": [arg], "kwargs": {}, "grad": False}
        lines.append(json.dumps({"model": model, "signature_hash": f"h{i}", "spec": spec, "ts": t0 + i}) + "\n")
    (spool / "w.jsonl").write_text("".join(lines))
    (tmp_path / "config.toml").write_text(f'spool_dir = "{spool}"\n')
    return ConfCli(tmp_path / "cache", db_url, tmp_path / "config.toml")


EAGER_MLP = 'factory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'


@pytest.mark.slow  # a prewarm worker starts torch
def test_a_recorded_expanded_input_is_replayed(tmp_path, db_url):
    """An expanded input (stride 0: Hugging Face's `position_ids = arange(n).expand(b, n)`) was
    built by filling the tensor itself, which torch refuses for elements that share memory ("more
    than one element of the written-to tensor refers to a single memory location"): every such
    shape failed, exit 8. Its storage is filled now, and the call made with the recorded strides."""
    cli = _recorded(tmp_path, db_url, [("ids", [4, 16], [16, 1], "float32"), ("ids", [4, 16], [0, 1], "float32")])
    (tmp_path / "m.toml").write_text(f'[[model]]\nname = "ids"\n{EAGER_MLP}')
    doc, _ = proc_json(cli, "prewarm", "--manifest", str(tmp_path / "m.toml"), code=0)
    assert [(r["index"], r["ok"], r["error"]) for r in doc["shapes"]] == [(0, True, None), (1, True, None)]


@pytest.mark.slow  # a prewarm worker starts torch
def test_a_recorded_shape_of_more_elements_than_max_input_bytes_is_refused_not_replayed(tmp_path, db_url):
    """`b8[2**31,2**31]` of strides (0, 0) takes one byte of storage, under any max_input_bytes, and
    its fill (then its call) went through 2**62 elements: prewarm hung. An input of more elements
    than the model's max_input_bytes is refused by name now, and the model's other shapes run."""
    huge = 1 << 31
    cli = _recorded(tmp_path, db_url, [("m", [2, 16], [16, 1], "float32"), ("m", [huge, huge], [0, 0], "bool")])
    (tmp_path / "m.toml").write_text(f'[[model]]\nname = "m"\n{EAGER_MLP}')
    # (--timeout: a hang fails the test instead of stalling it)
    doc, _ = proc_json(cli, "prewarm", "--manifest", str(tmp_path / "m.toml"), "--timeout", "120", code=8)
    assert [r["ok"] for r in doc["shapes"]] == [True, False]
    assert doc["failures"] == [
        f"model 'm' shape #1 {doc['shapes'][1]['signature']} on cpu: InputsTooLarge: the inputs hold "
        "4,611,686,018,427,387,904 elements, more than the model's max_input_bytes (1.0 GiB) allows for one "
        "replayed call: not built"
    ]


def _nested_header(path: Path, levels: int) -> None:
    """A bundle at `path` whose header (an object) holds lists nested to `levels` in all."""
    bundle.write(str(path), {"torch": "2.13.0+cpu", "expects": {"autotune": []}}, bundle.payload_of({}))
    magic, header, payload = path.read_bytes().split(b"\n", 2)
    deep = b', "x": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"
    path.write_bytes(magic + b"\n" + header[:-1] + deep + b"\n" + payload)


@pytest.mark.parametrize("levels", [17, 983])
def test_a_bundle_header_nested_deep_is_refused_as_no_bundle(tmp_path, db_url, levels):
    """983 nested lists in a header parsed, and what printed the header then failed: `import
    --check-only --json` exit 70 (RecursionError); 985 and more were refused (the parser's own
    limit). A header is refused past 16 levels (cachemgr writes 3), before torch starts."""
    path = tmp_path / "deep.bundle"
    _nested_header(path, levels)
    r = Cli(tmp_path / "cache", db_url).proc("import", str(path), "--check-only", "--json")
    assert r.returncode == 9 and r.stderr == (
        f"cachemgr: error: bundle {path}: its header is not one cachemgr writes (nested deeper than 16 levels)\n"
    )
    _nested_header(path, 16)
    assert bundle.read(str(path)).header["x"] == json.loads("[" * 15 + "]" * 15)


STALL = """
import os, time
if os.environ.get("CACHEMGR_WORKER_FD"):  # in the worker, not the CLI: stall where it writes through a temporary
    def stalling(real, at):
        def call(*args, **kwargs):
            if at(*args, **kwargs):
                open(os.environ["STALLED"], "w").close()
                time.sleep(3600)
            return real(*args, **kwargs)
        return call
    # export: the rename of the written bundle; import: the first move out of the staging folder
    os.replace = stalling(os.replace, lambda src, dst, **kw: str(src).endswith(".tmp") and "bundle" in str(src))
    os.rename = stalling(os.rename, lambda src, dst, **kw: "src_dir_fd" in kw)
"""


@pytest.mark.slow  # an export or import worker starts torch
@pytest.mark.parametrize("command", ["export", "import"])
def test_ctrl_c_during_export_or_import_leaves_nothing_behind(fixture_cache, tmp_path, db_url, command):
    """Ctrl-C killed the worker (its process group, SIGKILL), whose own clean-up then never ran:
    export left its `.NAME.bundle.XXXX.tmp` in the --out folder (up to 4 GiB), import its staging
    folder in the cache (removed by an import six hours later). The CLI removes them once the
    worker is gone."""
    cache = fixture_cache("torch-2.13.0-cpu")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL)  # (run by every Python at start-up)
    stalled = tmp_path / "stalled"
    if command == "export":
        watched = tmp_path / "out"
        watched.mkdir()
        cli, args = Cli(cache, db_url), ["export", "--out", str(watched / "cache.bundle")]
    else:
        path = tmp_path / "b.bundle"
        bundle.write(str(path), {"torch": "2.13.0+cpu"}, bundle.payload_of({"inductor": _graphs(cache)}))
        watched = tmp_path / "new-cache"
        cli, args = Cli(watched, db_url), ["import", str(path)]
    p = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", *cli.base(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(PYTHONPATH=os.pathsep.join((str(hook), str(REPO))), STALLED=str(stalled)),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # Ctrl-C as a terminal sends it
    )
    try:
        deadline = time.monotonic() + 300
        while not stalled.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        made = [p.name for p in watched.iterdir() if p.name.startswith((".cache.bundle.", "tmp"))]
        assert len(made) == 1, sorted(os.listdir(watched))
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130 and err.endswith("cachemgr: interrupted\n"), err
        assert not (watched / made[0]).exists()
        assert command == "import" or os.listdir(watched) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("where", ["file/cache", "file"])
def test_a_cache_dir_that_cannot_be_made_is_exit_4_for_every_command(tmp_path, db_url, where):
    """A --cache-dir under a regular file: import said so (exit 4), but its worker's torch could
    not start there, and `import --check-only` failed with torch's "AssertionError: Artifact of
    type=precompile already registered" (exit 9), `check --bundle` with "the worker reported
    nothing" (exit 8). The directory is made before any worker starts, the same for every command."""
    (tmp_path / "file").write_text("x")
    path = tmp_path / "b.bundle"
    bundle.write(str(path), {"torch": "2.13.0+cpu"}, bundle.payload_of({}))
    cache = tmp_path / where
    for args in (["import", str(path)], ["import", str(path), "--check-only"], ["check", "--bundle", str(path)]):
        r = Cli(cache, db_url)(*args, code=4)
        assert r.stderr == f"cachemgr: error: cannot create cache directory {cache}: Not a directory\n", args


def test_export_into_the_cache_dir_is_a_usage_error(tmp_path, db_url):
    """A bundle exported into the cache dir is a file Inductor never makes there: every later
    `evict` refused the whole cache (exit 7). --out there is refused before anything runs, the
    cache dir named through a symlink too."""
    cache = tmp_path / "cache"
    (cache / "fxgraph").mkdir(parents=True)
    (tmp_path / "link").symlink_to(cache)
    for out in (cache / "x.bundle", cache / "fxgraph" / "x.bundle", tmp_path / "link" / "x.bundle"):
        r = Cli(cache, db_url)("export", "--out", str(out), code=2)
        assert r.stderr == f"cachemgr: error: export --out {out}: it is in the cache dir {cache}: write it elsewhere\n"
    assert sorted(p.name for p in cache.iterdir()) == ["fxgraph"]


def test_a_bundle_over_the_size_import_reads_is_not_written(tmp_path, monkeypatch):
    """`export` wrote a bundle of any size, and `import` then refused one over 4 GiB: the write
    fails now, naming both sizes, and leaves nothing."""
    monkeypatch.setattr(bundle, "MAX_BYTES", 1000)
    out = tmp_path / "big.bundle"
    with pytest.raises(bundle.BundleError, match=r"^the bundle would take 1\.\d KiB, over the 1000 B a bundle may be"):
        bundle.write(str(out), {"torch": "2.13.0+cpu"}, b"x" * 1000)
    assert list(tmp_path.iterdir()) == []
    bundle.write(str(out), {"torch": "2.13.0+cpu"}, b"x" * 100)
    assert bundle.read(str(out)).payload == b"x" * 100


def test_a_model_name_in_the_progress_bar_is_no_markup(monkeypatch, capsys):
    """On a terminal, the bar's label went through rich's markup: a model named `ranker[v2]`
    showed as "ranker", one named `[link=...]` sent an OSC 8 hyperlink; a control character went
    out raw. The label is shown as it is, escaped."""
    from cachemgr.cli.prewarm import _progress

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # (rich draws as on a terminal)
    monkeypatch.setenv("COLUMNS", "80")
    names = ("ranker[v2]", "[link=https://example.com/]x[/link]", "bell\x07")
    with _progress(True) as on:
        for name in names:
            on({"e": "model", "model": name, "shapes": 1, "device": "cpu"})
    err = capsys.readouterr().err
    assert "ranker[v2]" in err and "[link=https://example.com/]x[/link]" in err and "bell\\x07" in err
    assert "\x1b]" not in err and "\x07" not in err  # (no OSC sequence; rich's own CSI ones move the cursor)


EVIL = "\x1b]0;PWNED\x07"


@pytest.mark.slow  # a prewarm worker starts torch
def test_what_prewarm_prints_is_escaped_and_fits_the_terminal(tmp_path, db_url):
    """The cache dir (the table's title), a kwarg's name in a signature (each progress line, each
    `cachemgr: model ... failed` line) reached the terminal raw: an escape sequence in them was
    sent (this one retitles the window). All of it is escaped, every line fitted to 80 columns
    (but the error line the exit code comes with: one line, whole)."""
    (tmp_path / "m.toml").write_text(
        '[[model]]\nname = "ranker[v2]"\nfactory = "prewarm_models:mlp"\ncompile = { backend = "eager" }\n'
        'shapes = [{ args = ["f32[2,16]"], kwargs = { "\\u001b]0;PWNED\\u0007" = "f32[2,16]" } }]\n'
    )
    cache = tmp_path / f"cache{EVIL}"
    r = Cli(cache, db_url).proc("prewarm", "--manifest", str(tmp_path / "m.toml"), env={**ENV, "COLUMNS": "80"})
    assert r.returncode == 8, r.stderr
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout + r.stderr
    title = f"prewarm {tmp_path}/cache"[:79]  # (cut at 80 columns where tmp_path is long: xdist's)
    assert out[0].startswith(title) and err[-1].startswith("cachemgr: error: 1 problem(s)")
    assert [line for line in out + err[:-1] if len(line) > 80] == []
    assert any(line.startswith("cachemgr: model 'ranker[v2]' shape #0 ") for line in err)
    assert "\\x1b]0;PWNED\\x07" in r.stderr  # (shown, escaped)


def test_only_a_staging_folder_holding_the_mark_is_removed_by_the_parent(tmp_path):
    """The parent removes the staging folder it named once the workers are gone: a folder of that
    name the worker did not make (its mkdir failed on it, or another made it anew after the worker
    removed its own) holds no mark, and is not ours to remove."""
    from cachemgr.prewarm import worker

    theirs, ours = tmp_path / "tmpabcdefgh", tmp_path / "tmpijklmnop"
    for d in (theirs, ours):
        (d / "fxgraph").mkdir(parents=True)
        (d / "fxgraph" / "f").write_text("x")
    (ours / worker.STAGING_MARK).touch()
    worker._remove_staging(str(tmp_path), theirs.name)
    worker._remove_staging(str(tmp_path), ours.name)
    assert (theirs / "fxgraph" / "f").exists() and not ours.exists()
