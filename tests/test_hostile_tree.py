"""Hostile trees: what a cache root can hold or become that must never make cachemgr delete
outside the root, stop indexing, or run out of memory. Every case runs cachemgr as a real
process on a real cache and checks its exit code, that nothing outside the root changed, and
that the index agrees with the disk afterwards."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hostile import (
    AOT_CLASS,
    AOT_MODULE,
    busy_pickle,
    fake_entry,
    find_totals,
    fxgraph_state,
    many_classes,
    memo_bomb,
    slow_source,
    snapshot,
    victim_tree,
)
from hypothesis import given
from hypothesis import strategies as st
from test_daemon import start  # noqa: F401 - a fixture (daemon processes)

HOUR = 3600
ROOTLESS = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []


def age(root: Path, seconds: float = HOUR) -> None:
    t = time.time() - seconds
    for p in [root, *root.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def run(cli, *args: str, timeout: float = 300, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    from conftest import subprocess_env

    cmd = [*(prefix or []), sys.executable, "-m", "cachemgr", *cli.base(), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=subprocess_env())
    assert "Traceback" not in r.stderr, r.stderr
    return r


def agrees_with_disk(cli) -> dict:
    """After a full rescan the index holds what `find` sees: files and bytes alike."""
    r = run(cli, "scan", "--full")
    assert r.returncode == 0, r.stderr
    doc = json.loads(run(cli, "stats", "--json").stdout)
    assert (doc["files"], doc["bytes"]) == find_totals(cli.cache_dir)
    return doc


# -- deletion never leaves the root ------------------------------------------------------------------


@pytest.mark.slow  # the race, many times over
def test_kernel_dirs_swapped_for_symlinks_mid_eviction(gpu_cache_master, tmp_path, cli_for):
    """A racer keeps swapping kernel directories (and the triton/0 folder above them) for symlinks
    into a victim tree while `evict --max-size 0` runs: at different moments, over many runs, the
    victim tree never changes (eviction goes by directory descriptors and (device, inode))."""
    victim = victim_tree(tmp_path / "victim")
    mirror = victim / "triton0"  # the names eviction looks for under triton/0, outside the root
    for k in (gpu_cache_master / "triton" / "0").iterdir():
        (mirror / k.name).mkdir(parents=True)
        (mirror / k.name / "k.cubin").write_bytes(b"victim")
    before = snapshot(victim)
    rng = random.Random(7)
    for attempt in range(8):
        cache = tmp_path / f"cache{attempt}"
        shutil.copytree(gpu_cache_master, cache, symlinks=True)
        age(cache)
        cli = cli_for(cache, db=f"sqlite:///{tmp_path}/idx{attempt}.db")
        kernels = sorted((cache / "triton" / "0").iterdir())
        stop = threading.Event()
        pause = [0, 1e-4, 1e-3, 5e-3][attempt % 4]

        def racer(stop=stop, cache=cache, kernels=kernels, pause=pause) -> None:
            time.sleep(rng.random() * 0.5)  # the swap lands at a different moment each run
            while not stop.is_set():
                if rng.random() < 0.5:  # the folder above the kernels, for a mirror of it
                    top, aside, target = cache / "triton" / "0", cache / "triton" / ".aside0", mirror
                else:
                    top = rng.choice(kernels)
                    aside, target = top.parent / (".aside-" + top.name), mirror / top.name
                try:
                    os.rename(top, aside)
                except OSError:
                    continue
                os.symlink(target, top)
                time.sleep(pause)
                os.unlink(top)
                os.rename(aside, top)

        t = threading.Thread(target=racer)
        t.start()
        try:
            r = run(cli, "evict", "--max-size", "0", "--grace", "0", "--json")
        finally:
            stop.set()
            t.join()
        assert r.returncode == 0, r.stderr
        assert snapshot(victim) == before, f"run {attempt} changed the victim tree"
        agrees_with_disk(cli)


def test_symlinked_top_level_folder_refuses_the_root(cpu_cache, tmp_path, cli_for):
    """fxgraph/ a symlink to a folder outside: the root is refused (exit 7), nothing out there moves."""
    outside = tmp_path / "outside"
    shutil.move(str(cpu_cache / "fxgraph"), outside)
    (outside / "empty-key-dir").mkdir()
    (cpu_cache / "fxgraph").symlink_to(outside)
    age(outside)
    before = snapshot(outside)
    cli = cli_for(cpu_cache)
    for args in (["evict", "--max-size", "0", "--grace", "0"], ["purge", "--all", "--yes", "--grace", "0"]):
        r = run(cli, *args)
        assert r.returncode == 7, r.stderr
        assert "fxgraph is not a folder Inductor makes" in r.stderr
    assert snapshot(outside) == before


def _victim(tmp_path: Path) -> Path:
    """A folder of someone's files, no cache, aged past any grace period."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "notes.txt").write_text("important")
    (victim / "sub" / "doc.txt").write_text("d")
    age(victim)
    return victim


def _bind_mounts(tmp_path: Path, points: dict[str, Path]) -> tuple[dict[str, Path], list[Path]]:
    """Someone's folders (three files each, named as Inductor names its files: each would be an
    entry) bind-mounted at `points` (by name), or someone's file where the point has a suffix (a
    file mounted on a file); skips the test where bind mounts are not allowed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a folder")
    victims, mounted = {}, []
    for name, point in points.items():
        v = victims[name] = tmp_path / f"someones-{name}"
        v.mkdir()
        if point.suffix:
            source = v / point.name
            source.write_text("someone's file")
            point.parent.mkdir(parents=True, exist_ok=True)
            point.touch()
        else:
            source = v
            for i in range(3):
                (v / (f"czz{i:050d}.py" if name == "module" else f"triton_{i}.cubin")).write_text("someone's")
            point.mkdir(parents=True, exist_ok=True)
        age(v)
        if subprocess.run(["mount", "--bind", str(source), str(point)], capture_output=True).returncode:
            _unmount(mounted)
            pytest.skip("bind mounts are not allowed here")
        mounted.append(point)
    return victims, mounted


def _unmount(mounted: list[Path]) -> None:
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def test_a_scan_stops_at_a_mount_point_inside_the_cache(gpu_cache, tmp_path, cli_for):
    """Another file system, or a bind mount of someone's folder, mounted inside the cache is not
    the cache's (as for `find -xdev`): its files were indexed and counted against the limits,
    though eviction never deletes there, so a large mounted folder made eviction take the rest of
    the cache instead. Now a scan walks none of it and says so; the mount point is tried again by
    every rescan, so once unmounted what it hid is indexed."""
    cli = cli_for(gpu_cache)
    cli("scan")  # (indexed before the mounts: a kernel directory's rows must go)
    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    kernel_key = kernel.relative_to(gpu_cache).as_posix()
    points = {"module": gpu_cache / "zz", "kernel": kernel, "trash": gpu_cache / ".cachemgr-trash" / "m"}
    victims, mounted = _bind_mounts(tmp_path, points)
    try:
        age(gpu_cache)
        before = {name: snapshot(v) for name, v in victims.items()}
        for args in (["scan"], ["scan"], ["scan", "--full"]):  # a rescan, an unchanged one, a full one
            r = cli(*args)
            assert f"warning: {kernel_key}/ under {gpu_cache} is a mount point" in r.stderr, r.stderr
            assert f"warning: zz/ under {gpu_cache}" in r.stderr
        assert sorted(cli.json("scan")["mounted"]) == sorted([kernel_key, "zz"])
        keys = {e["key"] for e in cli.json("ls")}
        assert not {k for k in keys if k.startswith(("zz/", kernel_key))}
        doc = cli.json("stats")
        assert (doc["files"], doc["bytes"]) == find_totals(gpu_cache, tuple(mounted))
        out = cli.json("evict", "--max-size", "0", "--grace", "0")
        assert out["evicted"] > 0 and not out["in_place"]
        assert {name: snapshot(v) for name, v in victims.items()} == before
        assert cli.json("stats")["files"] == 0
        _unmount([kernel])  # what the mount hid comes back: the next rescan finds it
        mounted.remove(kernel)
        assert cli.json("scan")["mounted"] == ["zz"]
        assert kernel_key in {e["key"] for e in cli.json("ls")}
    finally:
        _unmount(mounted)


def test_a_first_scan_spread_over_workers_stops_at_a_mount_point_too(gpu_cache, tmp_path, cli_for):
    """A first scan of a cache with hundreds of kernel directories hands them to worker
    processes to walk: a worker that meets a mount point reports it, and walks none of it."""
    from cachemgr.index.fill import PARALLEL_WALK

    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    for i in range(PARALLEL_WALK + 50):
        shutil.copytree(kernel, kernel.with_name(f"{kernel.name[:-4]}{i:04d}"))
    point = kernel.with_name(f"{kernel.name[:-4]}0123")
    _, mounted = _bind_mounts(tmp_path, {"kernel": point})
    try:
        cli = cli_for(gpu_cache)
        out = cli.json("scan")
        assert out["added"] > PARALLEL_WALK and out["mounted"] == [point.relative_to(gpu_cache).as_posix()]
        doc = cli.json("stats")
        assert (doc["files"], doc["bytes"]) == find_totals(gpu_cache, (point,))
    finally:
        _unmount(mounted)


def test_what_is_mounted_inside_a_kernel_directory_or_on_a_file_is_left_out_and_found_again(
    gpu_cache, tmp_path, cli_for
):
    """Mounting moves no directory's mtime: a folder mounted inside a kernel directory after a
    scan, or a file mounted on a module's file, went unseen by the next plain scan (the hidden
    file stayed indexed; the mounted one was counted, and planned: its rename failed), and once
    unmounted, what it hid was never found again by a plain scan. The directory holding one is
    now read again by every rescan."""
    cli = cli_for(gpu_cache)
    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    (kernel / "sub").mkdir()
    (kernel / "sub" / "hidden.bin").write_bytes(b"x" * 1000)
    (gpu_cache / "lf").mkdir()
    module = gpu_cache / "lf" / f"clf{0:049d}.py"
    module.write_text("the cache's")
    (gpu_cache / "lf" / f"clf{1:049d}.py").write_text("the cache's")
    age(gpu_cache)
    cli("scan")
    points = {"kernel": kernel / "sub", "file": module}
    victims, mounted = _bind_mounts(tmp_path, points)
    keys = {"kernel": (kernel / "sub").relative_to(gpu_cache).as_posix(), "file": f"lf/clf{0:049d}.py"}
    try:
        before = {name: snapshot(v) for name, v in victims.items()}
        for args in (["scan"], ["scan"]):
            out = cli.json(*args)
            assert sorted(out["mounted"]) == sorted(keys.values())
            doc = cli.json("stats")
            assert (doc["files"], doc["bytes"]) == find_totals(gpu_cache, tuple(mounted))
        out = cli.json("evict", "--max-size", "0", "--grace", "0")
        assert not [s for s in out["skipped"] if s["reason"] != "another mount"], out["skipped"]
        assert {name: snapshot(v) for name, v in victims.items()} == before
        _unmount(mounted)
        mounted.clear()
        assert cli.json("scan")["mounted"] == []
        doc = cli.json("stats")
        assert (doc["files"], doc["bytes"]) == find_totals(gpu_cache)
    finally:
        _unmount(mounted)


def test_a_trash_folder_that_is_a_mount_point_is_not_used(gpu_cache, tmp_path, cli_for):
    """The trash folder itself mounted from someone's folder: every rename into it failed across
    the mount, and eviction kept the whole cache ("at or by a mount point"). It is not a place to
    move to: units are deleted in place, as where no trash can be made, and it is never emptied."""
    victims, mounted = _bind_mounts(tmp_path, {"trash": gpu_cache / ".cachemgr-trash"})
    try:
        age(gpu_cache)
        before = snapshot(victims["trash"])
        out = cli_for(gpu_cache).json("evict", "--max-size", "0", "--grace", "0")
        assert out["evicted"] > 0 and out["in_place"] and out["skipped"] == []
        assert snapshot(victims["trash"]) == before
    finally:
        _unmount(mounted)


def db_files(db, key: str) -> int:
    from sqlalchemy import text

    with db.engine.connect() as conn:
        return conn.execute(text("SELECT files FROM entries WHERE key = :k"), {"k": key}).scalar_one()


def test_the_daemons_batch_leaves_out_what_is_mounted(gpu_cache, tmp_path, db_url):
    """The watcher hands over files written below a mount point inside the cache, or a module's
    file that a file is mounted on: the daemon's batch indexes none of them, and what the mounts
    now hide leaves the index (a module keeps its other files)."""
    from cachemgr.index import live
    from cachemgr.index.db import Database

    db = Database(db_url)
    cid = db.cache_id("h", str(gpu_cache))
    (gpu_cache / "zz").mkdir()
    ours = [f"zz/czz{i:050d}.py" for i in range(3)]
    for rel in ours:
        (gpu_cache / rel).write_text("the cache's")
    (gpu_cache / "yy").mkdir()
    module = f"yy/cyy{0:049d}"
    for ext in (".py", ".cpp"):
        (gpu_cache / f"{module}{ext}").write_text("the cache's")
    assert len(live.apply_batch(db, cid, str(gpu_cache), paths=[*ours, f"{module}.py"]).added) == 4
    files_before = db_files(db, module)
    _, mounted = _bind_mounts(tmp_path, {"module": gpu_cache / "zz", "file": gpu_cache / f"{module}.py"})
    try:
        theirs = [f"zz/{p.name}" for p in (gpu_cache / "zz").iterdir()]
        r = live.apply_batch(db, cid, str(gpu_cache), paths=ours + theirs + [f"{module}.py"], dirs=["zz"])
        assert (r.added, sorted(r.removed)) == ([], sorted(k.removesuffix(".py") for k in ours))
        assert r.changed == [module] and (files_before, db_files(db, module)) == (2, 1)  # (its .cpp alone)
    finally:
        _unmount(mounted)


def test_eviction_keeps_what_was_mounted_after_the_scan(gpu_cache, tmp_path, db_url):
    """A folder mounted between the index's scan and the eviction (a module folder, a kernel
    directory, a folder of the trash), or a file on a module's file: the rename into the trash
    failed across the mount (EXDEV) and the unit was deleted in place, and emptying the trash
    emptied the mounted folder. Now nothing at, below or above a mount point is moved or
    deleted: such a unit stays, "another mount", and the rest of the cache goes as planned."""
    from cachemgr.evict import Limits, evict
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    for folder in ("zz", "yy"):  # (module folders of the cache, indexed; then someone's folder or file over one)
        (gpu_cache / folder).mkdir()
        for i in range(3):
            (gpu_cache / folder / f"c{folder}{i:049d}.py").write_text("the cache's")
    age(gpu_cache)
    db = Database(db_url)
    cid = db.cache_id("h", str(gpu_cache))
    reconcile(db, cid, str(gpu_cache))
    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    points = {
        "module": gpu_cache / "zz",
        "kernel": kernel,
        "trash": gpu_cache / ".cachemgr-trash" / "m",
        "file": gpu_cache / "yy" / f"cyy{0:049d}.py",  # (its key has no '.py': the look checks each file)
    }
    victims, mounted = _bind_mounts(tmp_path, points)
    try:
        before = {name: snapshot(v) for name, v in victims.items()}
        r = evict(db, cid, str(gpu_cache), Limits(max_size=0, grace=0))
        assert r.evicted > 0 and not r.in_place
        held = {k for k, reason in r.skipped if reason == "another mount"}
        mine = {f"zz/czz{i:049d}" for i in range(3)} | {f"yy/cyy{0:049d}", kernel.relative_to(gpu_cache).as_posix()}
        assert held == mine, r.skipped
        assert not (gpu_cache / "yy" / f"cyy{1:049d}.py").exists()  # (the rest of that folder went)
        assert {name: snapshot(v) for name, v in victims.items()} == before
    finally:
        _unmount(mounted)


def test_a_mount_whose_source_path_holds_a_carriage_return_is_seen(gpu_cache, tmp_path):
    """/proc/self/mountinfo was split at every line end Python knows: a '\\r' in a bind mount's
    source (the kernel escapes only space, tab, newline and backslash) cut its line before the
    mount point, which was then indexed and counted, and emptied by an eviction deleting in place."""
    from cachemgr import safefs

    source = tmp_path / "someone\rs-folder"
    source.mkdir()
    (gpu_cache / "zz").mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(source), str(gpu_cache / "zz")]).returncode:
        pytest.skip("needs root to bind-mount a folder")
    try:
        assert safefs.mounts_below(str(gpu_cache)) == {"zz"}
    finally:
        _unmount([gpu_cache / "zz"])


def test_a_first_scan_with_a_file_mounted_on_a_cache_file_succeeds(gpu_cache, tmp_path, cli_for):
    """A file mounted on a module's file (or anything inside a kernel directory) before the first
    scan: its folder was written with its batch, then again, RACY, when the walk settled: UNIQUE
    constraint failed, exit 5 for every command until the mount went."""
    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    (gpu_cache / "lf").mkdir()
    for i in range(2):
        (gpu_cache / "lf" / f"clf{i:049d}.py").write_text("the cache's")
    points = {"file": gpu_cache / "lf" / f"clf{0:049d}.py", "kernel": kernel / "sub"}
    _, mounted = _bind_mounts(tmp_path, points)
    try:
        cli = cli_for(gpu_cache)
        for args in (["scan"], ["stats"], ["scan"]):
            r = run(cli, *args)
            assert r.returncode == 0, r.stderr
        doc = cli.json("stats")
        assert (doc["files"], doc["bytes"]) == find_totals(gpu_cache, tuple(mounted))
    finally:
        _unmount(mounted)


def test_a_folder_mounted_while_eviction_deletes_in_place_is_left_whole(gpu_cache, tmp_path, db_url, monkeypatch):
    """Eviction reads the mount table once: a folder mounted on a kernel directory after that was
    looked at (its files and inodes are those confirmed) and emptied where the trash could not be
    used, and an empty folder of someone's mounted on an fxgraph folder lost its empty subfolder.
    What is deleted in place, and each empty folder dropped, is checked to be on the root's mount."""
    from cachemgr.evict import Limits, evict, look
    from cachemgr.index.db import Database
    from cachemgr.index.scan import reconcile

    kernel = sorted(p for p in (gpu_cache / "triton" / "0").iterdir() if p.is_dir())[0]
    empty = gpu_cache / "fxgraph" / "zq" / ("fzq" + "a" * 49)
    empty.mkdir(parents=True)
    (gpu_cache / ".cachemgr-trash").write_text("not a folder: units are deleted in place")
    age(gpu_cache)
    db = Database(db_url)
    cid = db.cache_id("h", str(gpu_cache))
    reconcile(db, cid, str(gpu_cache))
    victims = {"kernel": tmp_path / "someones-kernel", "fx": tmp_path / "someones-fx"}
    for i in range(3):
        (victims["kernel"] / f"triton_{i}.cubin").parent.mkdir(exist_ok=True)
        (victims["kernel"] / f"triton_{i}.cubin").write_text("someone's")
    (victims["fx"] / empty.name).mkdir(parents=True)
    for v in victims.values():
        age(v)
    before = {name: snapshot(v) for name, v in victims.items()}
    mounted: list[Path] = []
    init = look.Looker.__init__

    def mount_after_the_table_is_read(self, *a, **kw):
        init(self, *a, **kw)
        for point, source in ((kernel, victims["kernel"]), (empty.parent, victims["fx"])):
            if not mounted or point not in mounted:
                if subprocess.run(["mount", "--bind", str(source), str(point)]).returncode:
                    pytest.skip("bind mounts are not allowed here")
                mounted.append(point)

    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a folder")
    monkeypatch.setattr(look.Looker, "__init__", mount_after_the_table_is_read)
    try:
        r = evict(db, cid, str(gpu_cache), Limits(max_size=0, grace=0))
        assert r.evicted > 0 and r.in_place
        assert (kernel.relative_to(gpu_cache).as_posix(), "another mount") in r.skipped, r.skipped
        assert {name: snapshot(v) for name, v in victims.items()} == before
        assert (victims["fx"] / empty.name).is_dir()
    finally:
        _unmount(mounted)


def test_the_daemon_reads_again_what_a_mount_made_while_it_runs_hides(gpu_cache, tmp_path, start, cli_for):  # noqa: F811
    """Mounting makes no inotify event and moves no mtime: what a folder mounted while the daemon
    ran hid stayed indexed, and counted against max_size (eviction took other entries for it),
    until the full rescan an hour later. The daemon reads the mount table before each eviction
    and rescan, and reads the folder of each mount point made or gone since, whole."""
    from test_daemon import index_keys, wait_until

    (gpu_cache / "zz").mkdir()
    for i in range(3):
        (gpu_cache / "zz" / f"czz{i:049d}.py").write_text("the cache's")
    age(gpu_cache)
    d = start(gpu_cache, env={"CACHEMGR_EVICT_INTERVAL": "1"})
    cli = cli_for(gpu_cache)
    ours = {f"zz/czz{i:049d}" for i in range(3)}
    assert ours <= index_keys(cli)
    _, mounted = _bind_mounts(tmp_path, {"module": gpu_cache / "zz"})
    try:
        wait_until(lambda: not {k for k in index_keys(cli) if k.startswith("zz/")}, timeout=30)
        d.wait_log("mount points inside the cache changed (zz): read again")
        _unmount(mounted)
        mounted.clear()
        wait_until(lambda: ours <= index_keys(cli), timeout=30)
    finally:
        _unmount(mounted)


def test_a_root_symlink_swapped_after_its_check_deletes_nothing_out_there(cpu_cache, tmp_path, monkeypatch):
    """The cache dir named through a symlink that is swapped to another folder at the worst
    moment, as the evicting process opens it: the folder opened is the one checked (it was
    checked by its name first, and an adversarial run emptied a folder of someone's files)."""
    from cachemgr import safefs
    from cachemgr.errors import UnsafePath
    from cachemgr.evict.execute import exclusive

    victim = _victim(tmp_path)
    before = snapshot(victim)
    link = tmp_path / "rootlink"
    link.symlink_to(cpu_cache)
    opened = safefs.Root.__init__

    def swapped_then_opened(self, path: str) -> None:
        if path == str(link):  # (the name, not the resolved path: what the evicting process opens)
            tmp = tmp_path / "rootlink.new"
            tmp.symlink_to(victim)
            os.replace(tmp, link)
        opened(self, path)

    monkeypatch.setattr(safefs.Root, "__init__", swapped_then_opened)
    with pytest.raises(UnsafePath, match="does not look like an Inductor cache directory"):
        with exclusive(str(link)):
            pass
    assert snapshot(victim) == before


def test_a_root_symlink_swapped_during_evict_s_scan_deletes_nothing(cpu_cache, tmp_path, cli_for, monkeypatch):
    """Swapped while evict scans (by the name): the scan indexed another folder than the one
    locked; evict stops (exit 4), nothing deleted on either side."""
    from cachemgr.cli import inspect

    victim = _victim(tmp_path)
    link = tmp_path / "rootlink"
    link.symlink_to(cpu_cache)
    age(cpu_cache)
    cli = cli_for(link)
    cli("scan")
    before, cache_before = snapshot(victim), snapshot(cpu_cache)
    scanned = inspect.run_scan

    def scan_then_swap(app, **kw):
        out = scanned(app, **kw)
        tmp = tmp_path / "rootlink.new"
        tmp.symlink_to(victim)
        os.replace(tmp, link)
        return out

    monkeypatch.setattr(inspect, "run_scan", scan_then_swap)
    r = cli("evict", "--max-size", "0", "--grace", "0", code=4)
    assert "was replaced during the scan: nothing deleted" in r.stderr
    assert snapshot(victim) == before and snapshot(cpu_cache) == cache_before


@pytest.mark.slow  # real cachemgr processes, several per case
@pytest.mark.parametrize("shape", ["site-packages", "home", "stray-file"])
def test_roots_that_are_no_cache_are_refused(tmp_path, cli_for, shape):
    root = tmp_path / shape
    if shape == "site-packages":  # a triton/ folder, but Triton's package, not its cache
        (root / "triton").mkdir(parents=True)
        (root / "triton" / "__init__.py").write_text("x = 1\n")
        (root / "numpy").mkdir()
        (root / "numpy" / "core.py").write_text("y = 2\n")
        (root / "six.py").write_text("z = 3\n")
    elif shape == "home":  # only dotfiles
        root.mkdir()
        (root / ".bashrc").write_text("alias ll='ls -l'\n")
        (root / ".ssh").mkdir()
        (root / ".ssh" / "id_ed25519").write_text("secret")
    else:  # a real-looking cache with one foreign file at the top
        (root / "ab").mkdir(parents=True)
        (root / "ab" / ("c" + "a" * 51 + ".py")).write_text("pass\n")
        (root / "notes.txt").write_text("mine")
    age(root)
    before = snapshot(root)
    cli = cli_for(root)
    for args in (
        ["evict", "--max-size", "0", "--grace", "0"],
        ["purge", "--all", "--yes", "--grace", "0"],
        ["evict", "--max-size", "0", "--dry-run"],
    ):
        r = run(cli, *args)
        assert r.returncode == 7, r.stderr
        assert "does not look like an Inductor cache directory (" in r.stderr
    assert snapshot(root) == before


@pytest.mark.slow  # real cachemgr processes, several per case
def test_a_failure_inside_a_batch_leaves_index_and_disk_in_agreement(gpu_cache, cli_for):
    """One kernel folder the process may not change (permissions, with root's override dropped):
    everything else is evicted and recorded, that one is kept with its reason, and the run
    fails (exit 1) once its result is out."""
    age(gpu_cache)
    cli = cli_for(gpu_cache)
    assert run(cli, "scan").returncode == 0
    locked = sorted((gpu_cache / "triton" / "0").iterdir())[3]
    locked.chmod(0o555)  # its files cannot leave it; it cannot be emptied
    (gpu_cache / "triton" / "0").chmod(0o555)  # and the kernel folders cannot leave triton/0
    try:
        r = run(cli, "evict", "--max-size", "0", "--grace", "0", "--json", prefix=ROOTLESS)
    finally:
        locked.chmod(0o755)
        (gpu_cache / "triton" / "0").chmod(0o755)
    assert r.returncode == 1 and r.stderr.startswith("cachemgr: error: the file system refused to delete "), r.stderr
    doc = json.loads(r.stdout)
    kept = dict((s["key"], s["reason"]) for s in doc["skipped"])
    assert doc["evicted"] > 0 and "delete failed" in kept.values()
    events = run(cli, "stats", "--json", "--window", "1d")
    assert json.loads(events.stdout)["activity"]["evictions"] == doc["evicted"]
    agrees_with_disk(cli)


@pytest.mark.slow  # real cachemgr processes, several per case
def test_trash_name_taken_by_a_file(gpu_cache, cli_for):
    """A regular file named like the trash folder: eviction deletes in place, and says so."""
    age(gpu_cache)
    (gpu_cache / ".cachemgr-trash").write_text("not a folder")
    cli = cli_for(gpu_cache)
    r = run(cli, "evict", "--max-size", "0", "--grace", "0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["evicted"] > 0 and doc["in_place"] is True
    assert (gpu_cache / ".cachemgr-trash").read_text() == "not a folder"
    agrees_with_disk(cli)


@pytest.mark.slow  # real cachemgr processes, several per case
def test_two_evictions_at_once_count_each_entry_once(gpu_cache, cli_for):
    age(gpu_cache)
    cli = cli_for(gpu_cache)
    assert run(cli, "scan").returncode == 0
    entries = json.loads(run(cli, "stats", "--json").stdout)["entries"]
    from conftest import subprocess_env

    cmd = [sys.executable, "-m", "cachemgr", *cli.base(), "evict", "--max-size", "0", "--grace", "0", "--json"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
        for _ in range(2)
    ]
    docs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        docs.append(json.loads(out))
    evicted = sum(d["evicted"] for d in docs)
    left = json.loads(run(cli, "stats", "--json").stdout)
    assert evicted == entries - left["entries"]
    assert left["activity"]["evictions"] == evicted


# -- one bad file stops nothing ---------------------------------------------------------------------

BAD_ENTRIES = {
    "newobj-no-build": lambda key: fake_entry({}, build=False),
    "time-10e400": lambda key: fake_entry(fxgraph_state(key, _time_taken_ns=10**400)),
    "not-a-list": lambda key: fake_entry(
        fxgraph_state(key, _fx_graph_cache_debug_lines={"a": 1}, _triton_bundle="oops", device_types=7)
    ),
    "surrogate": lambda key: fake_entry(
        fxgraph_state(key, guards_expr="L['x'] \ud800 <= 4", _fx_graph_cache_debug_lines=["[h\udfff] gm: \ud800"])
    ),
    "nul": lambda key: fake_entry(fxgraph_state(key, guards_expr="a\0b", cache_key="c\0d")),
    "memo-bomb": lambda key: memo_bomb(),
    "classes": lambda key: many_classes(),
    "slow-regex": lambda key: fake_entry(fxgraph_state(key, source_code=slow_source())),
    "odd-aot": lambda key: fake_entry(
        {"compiled_fw": 5, "compiled_bw": {"fx_graph_cache_key": ["x"]}}, AOT_MODULE, AOT_CLASS
    ),
}


def plant_bad_entries(root: Path) -> dict[str, Path]:
    """One entry file per hostile case, each in a key folder of its own (a real-shaped key)."""
    out = {}
    for i, (case, make) in enumerate(sorted(BAD_ENTRIES.items())):
        key = "f" + f"{i:02d}".replace("0", "q").replace("1", "r") + "z" * 49
        kind = "aotautograd" if case == "odd-aot" else "fxgraph"
        d = root / "aotautograd" / ("a" + key[1:]) if kind == "aotautograd" else root / "fxgraph" / key[1:3] / key
        d.mkdir(parents=True, exist_ok=True)
        p = d / ("e" * 51)
        p.write_bytes(make(key))
        out[case] = p
    return out


def plant_bad_files(root: Path) -> list[Path]:
    """Files no torch writes: a name that is not UTF-8, control characters, a symlink to
    /dev/zero and a FIFO named like a C++ source, a sparse 3 GiB entry file."""
    code = next(root.glob("??/c*.py"))
    folder = code.parent
    made = []
    bad_name = os.fsencode(str(folder)) + b"/c\xff\xfe" + b"k" * 30 + b".py"
    with open(bad_name, "wb") as f:
        f.write(b"print('x')\n")
    made.append(Path(os.fsdecode(bad_name)))
    ctl = folder / ("c" + "n" * 30 + "\x1b[31m.py")
    ctl.write_text("pass\n")
    made.append(ctl)
    stem = code.name.removesuffix(".py")
    (folder / (stem + ".main.cpp")).symlink_to("/dev/zero")
    other = next(p for p in sorted(root.glob("??/c*.py")) if p != code)
    os.mkfifo(other.parent / (other.name.removesuffix(".py") + ".main.cpp"))
    sparse_dir = root / "fxgraph" / "zz" / ("f" + "z" * 51)
    sparse_dir.mkdir(parents=True)
    with open(sparse_dir / ("s" * 51), "wb") as f:
        f.truncate(3 << 30)
    made.append(sparse_dir / ("s" * 51))
    return made


def test_bad_files_make_corrupt_rows_and_stop_nothing(cpu_cache, tmp_path, cli_for):
    planted = plant_bad_entries(cpu_cache)
    plant_bad_files(cpu_cache)
    age(cpu_cache)
    cli = cli_for(cpu_cache)
    r = run(cli, "scan", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    corrupt = {c["key"]: c["reason"] for c in json.loads(r.stdout)["corrupt"]}
    rel = {case: p.relative_to(cpu_cache).as_posix() for case, p in planted.items()}
    for case in ("memo-bomb", "classes"):
        assert rel[case] in corrupt, (case, corrupt)
    assert "more than 2048 classes" in corrupt[rel["classes"]]
    assert "too large" in corrupt["fxgraph/zz/f" + "z" * 51 + "/" + "s" * 51]
    rows = {e["key"]: e for e in json.loads(run(cli, "ls", "--json").stdout)}
    assert rows[rel["time-10e400"]]["compile_seconds"] is None and not rows[rel["time-10e400"]]["corrupt"]
    assert "\ufffd" in rows[rel["surrogate"]]["guards"]
    assert rows[rel["nul"]]["guards"] == "ab"
    assert any("%FF%FE" in k for k in rows), "a non-UTF-8 name is indexed under an escaped key"
    assert any("%1B" in k for k in rows)
    for args in (
        ["evict", "--max-size", "0", "--grace", "0", "--dry-run"],
        ["purge", "--corrupt", "--yes", "--grace", "0"],
        ["stats"],
        ["ls"],
    ):
        r = run(cli, *args, timeout=600)
        assert r.returncode == 0, (args, r.stderr)
    assert not planted["memo-bomb"].exists(), "corrupt entries are purged"
    r = run(cli, "evict", "--max-size", "0", "--grace", "0", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    assert not any(p.exists() for p in planted.values())
    agrees_with_disk(cli)


def test_bad_entries_on_postgresql(cpu_cache, cli_for, pg_url):
    """NUL bytes and lone surrogates reach PostgreSQL's text columns as nothing of either."""
    plant_bad_entries(cpu_cache)
    cli = cli_for(cpu_cache, db=pg_url)
    r = run(cli, "scan", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = json.loads(run(cli, "ls", "--json").stdout)
    assert any(e["guards"] == "ab" for e in rows)


@pytest.fixture
def pg_url():
    import psycopg

    name = f"cachemgr_hostile_{os.getpid()}_{random.randrange(1 << 30)}"
    with psycopg.connect("postgresql://127.0.0.1:5432/test", autocommit=True, connect_timeout=5) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect("postgresql://127.0.0.1:5432/test", autocommit=True, connect_timeout=5) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_daemon_indexes_good_entries_beside_bad_ones(cpu_cache, tmp_path, cli_for):
    """Daemon start-up on a hostile tree, then a batch holding hostile and valid new entries: the
    daemon stays up and the valid ones are indexed (the bad ones as corrupt)."""
    from conftest import subprocess_env

    plant_bad_entries(cpu_cache)
    cli = cli_for(cpu_cache)
    d = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", *cli.base(), "daemon", "--debounce", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        deadline = time.time() + 120
        lines = []
        while time.time() < deadline:
            line = d.stdout.readline()
            lines.append(line)
            if "ready:" in line or not line:
                break
        assert any("ready:" in x for x in lines), "".join(lines)
        fresh = cpu_cache / "fxgraph" / "yy" / ("f" + "y" * 51)
        fresh.mkdir(parents=True)
        (fresh / ("g" * 51)).write_bytes(fake_entry(fxgraph_state("f" + "y" * 51)))
        (fresh / ("b" * 51)).write_bytes(memo_bomb())
        want = {f"fxgraph/yy/f{'y' * 51}/{'g' * 51}", f"fxgraph/yy/f{'y' * 51}/{'b' * 51}"}
        while time.time() < deadline:
            keys = {e["key"] for e in json.loads(run(cli, "ls", "--json").stdout)}
            if want <= keys:
                break
            time.sleep(0.2)
        assert want <= keys
        assert d.poll() is None, "the daemon stopped"
    finally:
        d.send_signal(signal.SIGTERM)
        out, _ = d.communicate(timeout=30)
    assert d.returncode == 0, out
    assert "Traceback" not in out


@pytest.mark.slow  # real cachemgr processes, several per case
def test_unreadable_kernel_dir_heals_on_a_plain_rescan(gpu_cache, cli_for):
    if not ROOTLESS and os.geteuid() == 0:
        pytest.skip("needs setpriv to drop root's override")
    cli = cli_for(gpu_cache)
    kernel = sorted((gpu_cache / "triton" / "0").iterdir())[0]
    files = len(list(kernel.iterdir()))
    (gpu_cache / "triton" / "0").touch()  # a changed parent: the kernel folder is listed this time
    kernel.chmod(0)
    try:
        r = run(cli, "scan", prefix=ROOTLESS)
        assert r.returncode == 0 and "cannot read triton/0/" in r.stderr, r.stderr
    finally:
        kernel.chmod(0o755)
    r = run(cli, "scan", prefix=ROOTLESS)
    assert r.returncode == 0, r.stderr
    row = [e for e in json.loads(run(cli, "ls", "--json").stdout) if e["key"] == f"triton/0/{kernel.name}"]
    assert row and row[0]["files"] == files


def test_killed_scan_leaves_no_parse_workers(cpu_cache, cli_for):
    """kill -9 of a scan while its parse workers are busy: the workers die with it."""
    from conftest import subprocess_env

    for i in range(6):
        d = cpu_cache / "fxgraph" / "xx" / ("f" + "x" * 50 + str(i))
        d.mkdir(parents=True)
        (d / ("b" * 51)).write_bytes(busy_pickle(30_000_000))
    cli = cli_for(cpu_cache)
    p = subprocess.Popen(
        [sys.executable, "-m", "cachemgr", *cli.base(), "scan"],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    deadline = time.time() + 60
    while time.time() < deadline and not workers:
        workers = [pid for pid in _pids() if b"cachemgr.index.workers" in _cmdline(pid) and _ppid(pid) == p.pid]
        time.sleep(0.05)
    assert workers, "the scan started no parse workers"
    p.kill()
    p.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# -- a full disk ----------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MiB ext4 file system, loop-mounted (CI runs as root)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to mount a small file system")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(48 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path: Path) -> None:
    """Write 4 KiB blocks, then small files and folders, until the file system has none left,
    even after the kernel has flushed what it held back (delayed allocation frees reservations)."""
    with open(path / "filler", "ab") as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    i = 0
    for _ in range(20):
        os.sync()
        try:
            os.mkdir(path / "probe")
        except OSError:
            return
        os.rmdir(path / "probe")
        while True:  # the last blocks and inodes
            i += 1
            try:
                (path / f"pad{i}").mkdir()
                (path / f"pad{i}" / "x").write_bytes(b"\0" * 4096)
            except OSError:
                break
    raise AssertionError("could not fill the file system")


@pytest.mark.slow  # real cachemgr processes, several per case
@pytest.mark.parametrize("index_on_disk", [False, True])
def test_eviction_frees_a_full_disk(gpu_cache_master, small_disk, tmp_path, cli_for, index_on_disk):
    """The cache's file system is full (no block, no room for a new folder): eviction still
    frees space, and the index agrees with the disk. Also with the index on that same disk."""
    cache = small_disk / "cache"
    shutil.copytree(gpu_cache_master, cache, symlinks=True)
    age(cache)
    (small_disk / "state").mkdir()
    db = f"sqlite:///{small_disk / 'state' / 'index.db'}" if index_on_disk else f"sqlite:///{tmp_path / 'idx.db'}"
    cli = cli_for(cache, db=db)
    assert run(cli, "scan").returncode == 0
    fill(small_disk)
    free = shutil.disk_usage(small_disk).free
    with pytest.raises(OSError):
        os.mkdir(small_disk / "one-more")
    r = run(cli, "evict", "--max-size", "1MiB", "--grace", "0", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["evicted"] > 0 and doc["freed_bytes"] > 10 << 20
    assert shutil.disk_usage(small_disk).free > free + (10 << 20)
    for p in small_disk.glob("pad*"):
        shutil.rmtree(p)
    (small_disk / "filler").unlink()
    agrees_with_disk(cli)


def test_an_entry_naming_more_kernels_than_one_entry_may_keeps_the_first(monkeypatch):
    """An fxgraph entry whose source embeds a million C++ kernels (58 MB) made a million
    reference rows (120 MB of index, 350 MiB to scan it): an entry's references stop at MAX_REFS,
    however they are named (embedded sources and the headers they include, kernels, autotuners)."""
    from cachemgr.parse import entries

    monkeypatch.setattr(entries, "MAX_REFS", 50)
    source = "".join(
        f"k{i} = async_compile.cpp_pybinding(['x'], '''\n#include \"/r/ab/ch{i}.h\"\n{i}''')\n" for i in range(400)
    )
    p = entries.parse_fxgraph(fake_entry(fxgraph_state("f" + "a" * 51, source_code=source)))
    assert p.corrupt is None and len(p.refs) == 50
    assert len(set(p.refs)) == 50  # the first fifty distinct ones


@pytest.mark.parametrize("command", [["scan"], ["evict", "--max-size", "0", "--dry-run"]], ids=["scan", "evict"])
@pytest.mark.parametrize("fds", [8, 12, 14])
def test_a_process_short_of_descriptors_fails_in_one_line(fixture_cache, tmp_path, fds, command):
    """`ulimit -n` too low for a scan: one line and exit 1, not exit 70 (spawning a worker), nor
    exit 0 with directories reported unreadable and an index missing what is in them, nor (evict)
    exit 7 saying a folder of the cache cannot be read, as if the cache were not Inductor's."""
    import resource

    from conftest import subprocess_env

    cache = fixture_cache("mixed-2.5.1-2.13.0-cpu")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachemgr",
            "--cache-dir",
            str(cache),
            "--db",
            f"sqlite:///{tmp_path / 'i.db'}",
            *command,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fds, fds)),
    )
    assert (r.returncode, r.stderr.splitlines()) == (1, ["cachemgr: error: out of file descriptors (ulimit -n)"])


@pytest.mark.slow  # real processes, 100,000 files
def test_a_kernel_folder_of_a_hundred_thousand_files_is_scanned_and_looked_at_in_bounded_memory(gpu_cache, tmp_path):
    """One hostile Triton kernel folder of 100,000 files (one entry): scan and eviction's look sum
    its files as they list them. Each run's peak RSS is within 24 MiB of the same run on the cache
    without it (held per file, as before, it cost about 75 MiB more for scan and for evict)."""
    from conftest import subprocess_env
    from test_hostile_inputs import _rss_of

    def peaks(cache: Path, db: str) -> list[int]:
        out = []
        for args in (("scan",), ("evict", "--dry-run", "--max-size", "0", "--grace", "0s")):
            argv = [sys.executable, "-m", "cachemgr", "--cache-dir", str(cache), "--db", db, *args]
            code, rss, stderr = _rss_of(argv, subprocess_env())
            assert code == 0, stderr
            out.append(rss)
        return out

    base = peaks(gpu_cache, f"sqlite:///{tmp_path / 'base.db'}")
    kernel = next(gpu_cache.glob("triton/*/*/")).parent / ("K" * 52)
    kernel.mkdir()
    for i in range(100_000):
        (kernel / f"f{i}.json").touch()
    for rss, before in zip(peaks(gpu_cache, f"sqlite:///{tmp_path / 'big.db'}"), base, strict=True):
        assert rss - before < 24, f"peak RSS {rss} MiB, {before} MiB without the folder"


def test_an_index_on_a_file_system_out_of_inodes_says_so(fixture_cache, tmp_path):
    """The index's file system has space but no free inodes: SQLite cannot make its -wal and -shm
    files ('unable to open database file'), and the reserve cannot help. One line, exit 5, that
    says why."""
    from conftest import subprocess_env

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=64", "tmpfs", str(mnt)], check=True)
    try:
        cache = fixture_cache("torch-2.13.0-cpu")
        argv = [sys.executable, "-m", "cachemgr", "--cache-dir", str(cache), "--db", f"sqlite:///{mnt / 'i.db'}"]
        assert subprocess.run([*argv, "scan"], env=subprocess_env(), capture_output=True).returncode == 0
        for i in range(64):  # every inode left
            try:
                (mnt / f"f{i}").touch()
            except OSError:
                break
        r = subprocess.run([*argv, "stats"], env=subprocess_env(), capture_output=True, text=True)
        assert r.returncode == 5 and len(r.stderr.splitlines()) == 1, r.stderr
        assert f"(the file system of {mnt} has no free inodes)" in r.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_emptying_the_trash_never_descends_into_a_folder_put_there(tmp_path):
    """What eviction deletes is a file or a kernel directory of files: a folder found inside one
    in the trash was put there since, by whoever can write there (a kernel directory another user
    can write to, filled through a descriptor they kept). Emptying it as root would delete what
    that user could not: it stays, and so does the directory holding it."""
    from cachemgr import safefs

    trash = tmp_path / "trash"
    (trash / "kernel" / "planted" / "deep").mkdir(parents=True)
    (trash / "kernel" / "a.cubin").write_bytes(b"x")
    (trash / "kernel" / "planted" / "deep" / "rootfile").write_bytes(b"keep")
    fd = os.open(trash, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError):
            safefs.remove_at(fd, "kernel")
    finally:
        os.close(fd)
    assert not (trash / "kernel" / "a.cubin").exists()
    assert (trash / "kernel" / "planted" / "deep" / "rootfile").read_bytes() == b"keep"


def test_an_undone_rename_never_replaces_what_took_the_name(tmp_path, monkeypatch):
    """A rename into the trash is undone when its folder left the root meanwhile; if a new file
    took the old name by then (someone's), it is not replaced: the one moved stays in the trash."""
    from cachemgr import safefs

    root = tmp_path / "c"
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "cfile.py").write_text("old")
    (root / "trash").mkdir()
    with safefs.Root(str(root)) as r:
        expect = safefs.identity(r.lstat("ab/cfile.py"))

        def taken_meanwhile(self, rel):
            (root / "ab" / "cfile.py").write_text("someone's")
            return False

        monkeypatch.setattr(safefs.Root, "_reachable", taken_meanwhile)
        with pytest.raises(safefs.Refused):
            r.move("ab/cfile.py", expect, r.dir_fd("trash"), "1-0")
    assert (root / "ab" / "cfile.py").read_text() == "someone's"
    assert (root / "trash" / "1-0").read_text() == "old"


def test_a_unit_refused_part_way_puts_back_what_it_moved_even_into_a_folder_moved_since(tmp_path, monkeypatch):
    """A unit of two files: the first is renamed into the trash, the second's folder has left the
    root (refused), and meanwhile the first one's folder was moved aside with a symlink put in its
    place. The first file goes back into its own folder, wherever that is now: not left in the
    trash (emptied by the next run) because its folder's name is a symlink."""
    from cachemgr import safefs
    from cachemgr.evict import look

    root = tmp_path / "c"
    for d in ("da", "db", ".cachemgr-trash"):
        (root / d).mkdir(parents=True)
    (root / "da" / "a").write_text("a")
    (root / "db" / "b").write_text("b")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    real = safefs.Root._reachable

    def swap_then_refuse(self, rel):
        if rel != "db":
            return real(self, rel)
        os.rename(root / "da", root / "da.moved")
        (root / "da").symlink_to(elsewhere)
        return False

    monkeypatch.setattr(safefs.Root, "_reachable", swap_then_refuse)
    with safefs.Root(str(root)) as r:
        trash = os.open(".cachemgr-trash", safefs.O_DIR, dir_fd=r.fd)
        try:
            looker = look.Looker(r, trash, {}, 0.0)
            files = [look._Files(move=[(k, safefs.identity(r.lstat(k)))]) for k in ("da/a", "db/b")]
            took = look.Took([(1, 1), (1, 1)])
            assert looker.take(took, files) == "changed since planned"
        finally:
            os.close(trash)
    assert (root / "da.moved" / "a").read_text() == "a" and (root / "db" / "b").read_text() == "b"
    assert os.listdir(root / ".cachemgr-trash") == [] and os.listdir(elsewhere) == []


@pytest.mark.parametrize(
    "rel", ["", "/etc", "a//b", "a/", "./a", "a/.", "a/../b", "..", "a/b\0c", "/".join(["d"] * 33)]
)
def test_only_a_plain_relative_path_is_reached_below_the_root(tmp_path, rel):
    """Every path below a root goes through safefs.split: an empty, absolute, dotted or NUL-holding
    part, or a path deeper than Inductor's, is refused before any directory is opened."""
    from cachemgr import safefs

    with safefs.Root(str(tmp_path)) as r, pytest.raises(safefs.Refused, match="not a plain relative path"):
        r.lstat(rel)
    assert safefs.split("/".join(["d"] * 32)) == ("/".join(["d"] * 31), "d")
    assert safefs.split("ab/c.d..e") == ("ab", "c.d..e")


@given(
    st.text(alphabet="/.a\0", max_size=40)
    | st.builds("/".join, st.lists(st.sampled_from(["a", ".", "..", ""]), max_size=40))
)
def test_split_refuses_exactly_the_paths_that_are_not_plain(rel):
    """safefs.split's string tests (eviction asks them of every file) refuse what the rule says:
    an empty, '.' or '..' part, a NUL, or more than MAX_DEPTH parts."""
    from cachemgr import safefs

    parts = rel.split("/")
    plain = len(parts) <= safefs.MAX_DEPTH and not any(p in ("", ".", "..") or "\0" in p for p in parts)
    try:
        got = safefs.split(rel)
    except safefs.Refused:
        assert not plain
    else:
        assert plain and got == ("/".join(parts[:-1]), parts[-1])
