"""The daemon's inotify layer on its own (no daemon, no index): the recursive tree of watches
follows creates, renames (one node moves, whatever is below it), moves out of the root and
deletions, and reports a queue overflow. Conditions are polled, never slept on."""

from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest

from cachemgr.daemon import inotify
from cachemgr.daemon.inotify import TreeWatcher, _Dir
from cachemgr.daemon.reads import ReadWatcher

QUEUED = Path("/proc/sys/fs/inotify/max_queued_events")


def until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)
    return value


class Tree:
    """A TreeWatcher on `root` whose items and calls are collected."""

    def __init__(self, root: Path) -> None:
        self.items: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self.seen: list[tuple[str, str]] = []
        self.dirs: list[str] = []
        self.overflows = self.limits = self.lost = 0
        self.w = TreeWatcher(
            str(root), lambda k, r: self.items.put((k, r)), self.dirs.append, self._overflow, self._limit, self._lost
        )
        self.w.start()

    def _overflow(self) -> None:
        self.overflows += 1

    def _limit(self) -> None:
        self.limits += 1

    def _lost(self) -> None:
        self.lost += 1

    def saw(self, item: tuple[str, str], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while item not in self.seen:
            try:
                self.seen.append(self.items.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                return False
        return True

    def watched(self) -> set[str]:
        with self.w.lock:
            return {d.rel() for d in self.w.by_wd.values()}


@pytest.fixture
def tree(tmp_path):
    made: list[Tree] = []

    def _make(root: Path) -> Tree:
        t = Tree(root)
        made.append(t)
        return t

    yield _make
    for t in made:
        t.w.stop()


def test_existing_and_new_directories_are_watched_but_not_writes_in_progress(tmp_path, tree):
    root = tmp_path / "c"
    (root / "fxgraph" / "ab" / "fkey").mkdir(parents=True)
    (root / ".cachemgr-trash").mkdir()
    t = tree(root)
    assert t.watched() == {"", "fxgraph", "fxgraph/ab", "fxgraph/ab/fkey"}
    # a directory made with subdirectories before its own watch exists: all watched
    (root / "triton" / "0" / "k1").mkdir(parents=True)
    until(lambda: {"triton", "triton/0", "triton/0/k1"} <= t.watched())
    (root / "triton" / "0" / "k1" / "x.cubin").write_bytes(b"x")
    assert t.saw(("p", "triton/0/k1/x.cubin"))
    # Triton's temporary directory is not watched; renamed into place, it is
    tmp = root / "triton" / "0" / "tmp.pid_1_abc"
    tmp.mkdir()
    (tmp / "k.cubin").write_bytes(b"k")
    os.replace(tmp, root / "triton" / "0" / "k2")
    assert t.saw(("d", "triton/0/k2"))
    until(lambda: "triton/0/k2" in t.watched())
    assert not any("tmp." in rel for _, rel in t.seen) and not any("tmp." in d for d in t.watched())
    assert "triton/0/k2" in t.dirs
    (root / "triton" / "0" / "k2" / "k.cubin").unlink()
    assert t.saw(("p", "triton/0/k2/k.cubin"))


def test_a_renamed_directory_keeps_its_watches_below_it(tmp_path, tree):
    root = tmp_path / "c"
    (root / "a" / "b" / "c").mkdir(parents=True)
    t = tree(root)
    wds = dict(t.w.by_wd)
    os.rename(root / "a", root / "z")
    assert t.saw(("d", "z"))
    until(lambda: t.watched() == {"", "z", "z/b", "z/b/c"})
    assert dict(t.w.by_wd).keys() == wds.keys()  # the same watches, not new ones
    (root / "z" / "b" / "c" / "f").write_bytes(b"")
    assert t.saw(("p", "z/b/c/f"))


def test_moved_out_of_the_root_and_deleted_directories_lose_their_watches(tmp_path, tree):
    root = tmp_path / "c"
    (root / "a" / "b").mkdir(parents=True)
    (root / "d" / "e").mkdir(parents=True)
    t = tree(root)
    os.rename(root / "a", tmp_path / "outside")
    assert t.saw(("d", "a"))
    until(lambda: t.watched() == {"", "d", "d/e"})  # an unpaired move: dropped after the pairing delay
    (tmp_path / "outside" / "b" / "f").write_bytes(b"")  # no longer ours: no item
    (root / "d" / "e").rmdir()
    (root / "d").rmdir()
    assert t.saw(("d", "d"))
    until(lambda: t.watched() == {""})
    assert not any(rel.startswith(("outside", "a/")) for _, rel in t.seen)


def test_resync_watches_what_has_no_watch_and_forgets_what_is_gone(tmp_path, tree):
    root = tmp_path / "c"
    (root / "a").mkdir(parents=True)
    t = tree(root)
    with t.w.lock:  # as after lost events: a directory the tree does not know, one it knows that is gone
        node = t.w.top.children.pop("a")  # type: ignore[union-attr]
        del t.w.by_wd[node.wd]
        t.w.ino.rm_watch(node.wd)
    (root / "ghost").mkdir()
    until(lambda: "ghost" in t.watched())
    os.rmdir(root / "ghost")
    until(lambda: "ghost" not in t.watched())
    assert t.w.resync() == 0
    assert t.watched() == {"", "a"}
    (root / "a" / "f").write_bytes(b"")
    assert t.saw(("p", "a/f"))


def test_resync_watches_a_large_folder_in_steps_and_forgets_stray_watches(tmp_path, tree, monkeypatch):
    """A listing is watched RESYNC_STEP names per hold of the lock, each new directory told once;
    a watch in no directory of the tree (its IN_IGNORED lost) is forgotten."""
    monkeypatch.setattr(inotify, "RESYNC_STEP", 2)
    root = tmp_path / "c"
    for i in range(7):
        (root / "k" / f"d{i}" / "s").mkdir(parents=True)
    t = tree(root)
    want = {"", "k"} | {f"k/d{i}" for i in range(7)} | {f"k/d{i}/s" for i in range(7)}
    assert t.watched() == want
    assert sorted(t.dirs) == sorted(want - {""})
    with t.w.lock:
        stray = _Dir(1 << 30, t.w.top, "gone")  # under the root by its parent, but not its child
        t.w.by_wd[stray.wd] = stray
    assert t.w.resync() == 0
    assert stray.wd not in t.w.by_wd
    assert t.watched() == want
    (root / "k" / "d6" / "s" / "f").write_bytes(b"")
    assert t.saw(("p", "k/d6/s/f"))


def test_the_root_removed_is_reported(tmp_path, tree):
    root = tmp_path / "c"
    root.mkdir()
    t = tree(root)
    root.rmdir()
    until(lambda: t.lost)


@pytest.mark.inotify_limits
@pytest.mark.skipif(not os.access(QUEUED, os.W_OK), reason="lowers fs.inotify.max_queued_events (root)")
def test_a_queue_overflow_is_reported(tmp_path, tree):
    root = tmp_path / "c"
    root.mkdir()
    old = QUEUED.read_text()
    QUEUED.write_text("16")
    try:
        t = tree(root)  # the queue's size is fixed when the instance is made
    finally:
        QUEUED.write_text(old)
    with t.w.lock:  # the reader waits for the tree: the kernel queue fills meanwhile
        for i in range(100):
            (root / str(i)).write_bytes(b"")
    until(lambda: t.overflows)
    assert t.w.alive()
    (root / "after").write_bytes(b"")
    assert t.saw(("p", "after"))


def test_read_watcher_names_files_as_on_disk(tmp_path):
    root = tmp_path / "c"
    odd = "fkey %41\x01"  # an index key %-escapes this name; inotify and the disk do not
    (root / "fxgraph" / "ab" / odd).mkdir(parents=True)
    (root / "fxgraph" / "ab" / odd / "entry").write_bytes(b"x")
    got: queue.SimpleQueue[str] = queue.SimpleQueue()
    r = ReadWatcher(str(root), got.put, lambda: None)
    r.start()
    try:
        r.watch([f"fxgraph/ab/{odd}"])
        (root / "fxgraph" / "ab" / odd / "entry").read_bytes()
        assert got.get(timeout=10) == f"fxgraph/ab/{odd}/entry"
    finally:
        r.stop()


def _watched_inodes(ino: inotify.Inotify) -> set[int]:
    """The inodes an inotify instance watches, as the kernel lists them."""
    lines = Path(f"/proc/self/fdinfo/{ino.fd}").read_text().splitlines()
    return {
        int(w.split(":", 1)[1], 16)
        for line in lines
        if line.startswith("inotify")
        for w in line.split()
        if w.startswith("ino:")
    }


def test_a_directory_swapped_for_a_symlink_never_puts_watches_outside_the_root(tmp_path, monkeypatch):
    """A directory of the cache is renamed and a symlink to a directory outside takes its name
    before the watchers hear of it (events not read yet): watching or listing by that path would
    follow the symlink. Neither the tree (a directory made below it, a resync) nor the read
    watcher places a watch outside."""
    root, outside = tmp_path / "c", tmp_path / "outside"
    (root / "fxgraph" / "ab" / "fkey").mkdir(parents=True)
    for d in ("fkey", "fother", "fother/deeper"):
        (outside / d).mkdir(parents=True)
    outside_inodes = {p.stat().st_ino for p in [outside, *outside.rglob("*")]}
    monkeypatch.setattr(inotify.Reader, "start", lambda self: None)  # events stay unread
    w = TreeWatcher(str(root), lambda k, r: None, lambda r: None, lambda: None, lambda: None, lambda: None)
    r = ReadWatcher(str(root), lambda rel: None, lambda: None)
    w.start()
    r.start()
    try:
        os.rename(root / "fxgraph" / "ab", root / "fxgraph" / "ab.moved")
        (root / "fxgraph" / "ab").symlink_to(outside)
        with w.lock:  # a directory made in it, its event handled after the swap
            w._watch_tree(w.top.children["fxgraph"].children["ab"], "fother", [])  # type: ignore[union-attr]
        w.resync()
        r.watch(["fxgraph/ab/fother", "fxgraph/ab/fkey"])
        assert not _watched_inodes(w.ino) & outside_inodes
        assert not _watched_inodes(r.reader.ino) & outside_inodes
        assert _watched_inodes(w.ino)  # (the root and what is really in it are watched)
    finally:
        w.stop()
        r.stop()


def test_a_directory_moved_out_and_back_before_its_move_settles_stays_watched(tmp_path, tree):
    """`mv fxgraph/xx /backup; mv /backup/xx fxgraph/` within the pairing delay: it comes back
    as a directory already watched. It is attached again, not left to be dropped (with every
    watch below it) when its move out expires: what is written in it later is seen."""
    root = tmp_path / "c"
    (root / "fxgraph" / "xx" / "g").mkdir(parents=True)
    t = tree(root)
    for i in range(2):
        os.rename(root / "fxgraph" / "xx", tmp_path / "xx")
        time.sleep(0.1)
        os.rename(tmp_path / "xx", root / "fxgraph" / "xx")
        time.sleep(inotify.MOVE_PAIRING + 0.5)
        assert {"fxgraph/xx", "fxgraph/xx/g"} <= t.watched()
        (root / "fxgraph" / "xx" / "g" / f"entry{i}").write_bytes(b"x")
        assert t.saw(("p", f"fxgraph/xx/g/entry{i}"))


def test_a_key_directory_moved_out_of_the_root_no_longer_counts_reads(tmp_path):
    """A key directory moved out of the root (a backup): the tree lets it go, and tells the read
    watcher, whose reads there would be counted as hits of the entries still in the cache."""
    root = tmp_path / "c"
    key_dir = root / "fxgraph" / "ab" / "fkey"
    key_dir.mkdir(parents=True)
    (key_dir / "entry").write_bytes(b"x")
    hits: queue.SimpleQueue[str] = queue.SimpleQueue()
    r = ReadWatcher(str(root), hits.put, lambda: None)
    w = TreeWatcher(
        str(root), lambda k, rel: None, lambda rel: None, lambda: None, lambda: None, lambda: None, r.unwatch
    )
    r.start()
    w.start()
    try:
        r.watch(["fxgraph/ab/fkey"])
        os.rename(key_dir, tmp_path / "backup")
        until(lambda: "fxgraph/ab/fkey" not in r.by_dir)  # once its move out is settled
        (tmp_path / "backup" / "entry").read_bytes()
        time.sleep(0.5)
        assert hits.empty()
    finally:
        w.stop()
        r.stop()


def test_a_late_drop_of_a_key_directory_keeps_counting_reads_of_the_one_now_in_its_place(tmp_path):
    """The tree settles a move out of the root a second later, by path: a key directory put at
    that path meanwhile (restored from a backup) is the one watched for reads after it."""
    root = tmp_path / "c"
    key_dir = root / "fxgraph" / "ab" / "fkey"
    key_dir.mkdir(parents=True)
    hits: queue.SimpleQueue[str] = queue.SimpleQueue()
    r = ReadWatcher(str(root), hits.put, lambda: None)
    r.start()
    try:
        r.watch(["fxgraph/ab/fkey"])
        os.rename(key_dir, tmp_path / "old")
        key_dir.mkdir()
        (key_dir / "entry").write_bytes(b"x")
        r.unwatch("fxgraph/ab/fkey")  # the tree dropping the one that left
        (key_dir / "entry").read_bytes()
        assert hits.get(timeout=10) == "fxgraph/ab/fkey/entry"
    finally:
        r.stop()


def test_without_proc_each_directory_gets_its_own_watch(tmp_path, tree, monkeypatch):
    """Where /proc is not mounted, a watch goes by the directory's full path (a parent's
    descriptor in hand or not): every nested directory is watched, each by its own watch."""
    monkeypatch.setattr(inotify, "_PROC_FDS", False)
    root = tmp_path / "c"
    (root / "fxgraph" / "ab" / "fkey").mkdir(parents=True)
    (root / "ab").mkdir()
    t = tree(root)
    assert t.watched() == {"", "fxgraph", "fxgraph/ab", "fxgraph/ab/fkey", "ab"}
    watched = _watched_inodes(t.w.ino)
    assert {(root / d).stat().st_ino for d in ("fxgraph/ab", "fxgraph/ab/fkey", "ab")} <= watched


def _inotify_instances() -> set[int]:
    """This process's open inotify descriptors."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify":
                out.add(int(fd))
        except OSError:
            pass
    return out


def test_a_reader_stopped_inside_a_slow_handle_closes_its_descriptors_when_it_returns(tmp_path):
    """`stop` gives up on a thread still in `handle`: the descriptors stay open while that thread
    may read them (closed, their numbers could go to the next Reader's), and the thread closes
    them as it leaves (left open, the instance would keep every watch it holds)."""
    import threading

    inside, leave = threading.Event(), threading.Event()

    def slow(_events):
        inside.set()
        leave.wait(30)

    before = _inotify_instances()
    r = inotify.Reader("test-slow", slow)
    r.ino.add_watch(str(tmp_path), inotify.IN_CREATE)
    r.start()
    (tmp_path / "x").write_text("")
    assert inside.wait(10)
    r.stop(timeout=0.1)
    assert r.thread.is_alive()
    assert r.ino.fd in _inotify_instances() - before  # still the thread's, not given away
    leave.set()
    r.thread.join(10)
    assert not r.thread.is_alive()
    assert _inotify_instances() - before == set()
    for fd in (r.stop_r, r.stop_w):
        with pytest.raises(OSError):
            os.fstat(fd)


def test_a_reader_stopped_while_idle_closes_its_descriptors(tmp_path):
    before = _inotify_instances()
    r = inotify.Reader("test-idle", lambda _events: None)
    r.start()
    r.stop()
    assert not r.thread.is_alive()
    assert _inotify_instances() - before == set()


def test_a_mount_point_inside_the_root_is_not_watched(tmp_path, tree):
    """A file system (or a bind mount of any folder) mounted inside the cache is not the cache's:
    the scan walks none of it, and the watcher puts no watch on it or below (a mounted tree of
    100,000 folders would take as many watches from the host's limit)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a folder")
    root, theirs = tmp_path / "c", tmp_path / "someones"
    (root / "triton" / "0").mkdir(parents=True)
    (theirs / "a" / "b").mkdir(parents=True)
    (root / "zz").mkdir()
    if subprocess.run(["mount", "--bind", str(theirs), str(root / "zz")], capture_output=True).returncode:
        pytest.skip("bind mounts are not allowed here")
    try:
        t = tree(root)
        assert t.watched() == {"", "triton", "triton/0"}
        t.w.resync()
        assert t.watched() == {"", "triton", "triton/0"}
    finally:
        subprocess.run(["umount", "-l", str(root / "zz")], check=False)
