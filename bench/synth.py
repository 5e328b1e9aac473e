"""Build a large cache tree from real entries: the repository's H200 fixture replicated under new keys.

Every replica keeps the fixture's proportions (about 0.5 % fxgraph files, most files in Triton
kernel directories) and its real bytes; files are hard links to one extracted copy, so a
100,000-file tree costs seconds and no extra disk (a 1,000,000-file tree: about 120,000
directories and their blocks, no file data). Used by the benchmarks under bench/.

About content: an fxgraph or AOTAutograd entry file is named by the hash of its bytes, and every
copy keeps its file name, so the tree's 840 pickled entries per 100,000 files are copies of the
fixture's 10 distinct pickles. A scan keeps parse results by content name, so it reads about 10
of them. `distinct_names` renames every copy's entry file to a name of its own (same bytes), so
no parse result can be reused: the cost of a tree of distinct entries of the fixture's shape.
"""

from __future__ import annotations

import compileall
import functools
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "inductor-cache-h200-torch2.11.tgz"  # a real H200 cache


def child_env(**more: str) -> dict[str, str]:
    """The environment of cachemgr processes a bench starts: this checkout first on the path, then
    whatever the caller's path holds (dependencies installed outside the repository, as on the
    GPU host), never instead of it. The checkout's modules are compiled to bytecode first, as an
    installed cachemgr's are: where PYTHONDONTWRITEBYTECODE is set (this project's machines) each
    process compiled them again, 40-60 ms of every command's time."""
    _compiled()
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **more}


@functools.cache
def _compiled() -> None:
    compileall.compile_dir(REPO / "cachemgr", quiet=1)


def fixture_path() -> Path:
    return FIXTURE


def extract_fixture(dst: Path, tgz: Path | None = None) -> Path:
    """Extract the H200 fixture (or another cache .tgz) under `dst`; return its cache root."""
    with tarfile.open(tgz or fixture_path()) as t:
        t.extractall(dst, filter="data")
    (root,) = [p for p in dst.iterdir() if p.is_dir()]
    return root


LOWER, UPPER, HEX = "abcdefghijklmnopqrstuvwxyz234567", "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", "0123456789abcdef"


def tag(name: str, copy: int) -> str:
    """`name` with its last 4 characters replaced by the copy number, in the name's own alphabet
    (Inductor's base32 keys, Triton's upper-case hashes, sha256 hex), so replicas look real."""
    if name.startswith("src-") or all(c in HEX for c in name):
        alpha = HEX
    elif any(c.isupper() for c in name):
        alpha = UPPER
    else:
        alpha = LOWER
    digits, n = [], copy
    for _ in range(4):
        digits.append(alpha[n % len(alpha)])
        n //= len(alpha)
    return name[:-4] + "".join(reversed(digits))


def renamed(rel: str, copy: int) -> str:
    """The fixture path `rel` under copy number `copy`'s keys, in the same layout. Every file of
    one entry lands in the same new entry (a module's .py/.cpp/.so share their stem)."""
    parts = rel.split("/")
    if parts[0] in ("fxgraph", "triton") and len(parts) > 3:  # fxgraph/<2ch>/<key>/<file>, triton/<dev>/<hash>/...
        parts[2] = tag(parts[2], copy)
    elif parts[0] == "aotautograd" and len(parts) > 2:  # aotautograd/<key>/<file>
        parts[1] = tag(parts[1], copy)
    else:  # <2ch>/c<hash>.<ext>, <2ch>/<sha>.best_config, anything else: the file's stem
        stem, dot, ext = parts[-1].partition(".")
        parts[-1] = tag(stem, copy) + dot + ext
    return "/".join(parts)


def renamed_key(key: str, kind: str, copy: int) -> str:
    """An entry key (or a directory) under copy number `copy`'s keys."""
    if kind == "code":  # '<2ch>/c<hash>': an entry key without the file extension
        folder, stem = key.split("/")
        return f"{folder}/{tag(stem, copy)}"
    if kind == "triton":  # the kernel directory itself
        return renamed(key + "/x", copy)[:-2]
    return renamed(key, copy)


def check_room(dst: Path, files: int) -> None:
    """Refuse to build where the file system cannot take it: hard links take no data blocks, but
    each file a directory entry (about 100 bytes of directory blocks) and each directory an inode
    (the fixture's proportions: about one directory per 8 files). Checked with statvfs, as `df`."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(dst.parent)
    need_bytes = files * 200 + (256 << 20)  # directory blocks, the index and the fixture, with margin
    need_inodes = files // 4 + 10_000
    free_bytes, free_inodes = st.f_bavail * st.f_frsize, st.f_favail
    if free_bytes < need_bytes or (st.f_files and free_inodes < need_inodes):
        raise SystemExit(
            f"not enough room under {dst.parent} for {files:,} files: {free_bytes >> 20:,} MiB and "
            f"{free_inodes:,} inodes free, {need_bytes >> 20:,} MiB and {need_inodes:,} inodes needed"
        )


def build_tree(dst: Path, files: int = 100_000) -> int:
    """Fill `dst` with about `files` files; returns the exact count."""
    check_room(dst, files)
    work = Path(tempfile.mkdtemp(prefix="cachemgr-fixture-", dir=dst.parent))
    src = extract_fixture(work)
    rels = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    copies, extra = divmod(files, len(rels))
    link_copies(src, [dst], rels, copies)
    link_copies(src, [dst], rels[:extra], 1, first=copies)
    shutil.rmtree(work)  # the replicas are hard links: they keep the bytes
    return copies * len(rels) + extra


def link_copies(src: Path, dsts: list[Path], rels: list[str], copies: int, first: int = 0) -> None:
    """Hard-link each file `rels` under `src` into every tree of `dsts`, as copy numbers
    first .. first + copies - 1 (plain strings: pathlib cost more than the links)."""
    made: set[str] = set()
    srcs = [os.path.join(src, rel) for rel in rels]
    for c in range(first, first + copies):
        for rel, s in zip(rels, srcs, strict=True):
            new = renamed(rel, c)
            for base in dsts:
                out = os.path.join(base, new)
                parent = os.path.dirname(out)
                if parent not in made:
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
                os.link(s, out)


def _entry_files(root: Path) -> Iterator[tuple[Path, str]]:
    """(folder, file name) of every fxgraph and AOTAutograd entry file under `root`."""
    for top, depth in (("fxgraph", 2), ("aotautograd", 1)):
        base = root / top
        if not base.is_dir():
            continue
        for folder in base.glob("*/*") if depth == 2 else base.glob("*"):
            for name in os.listdir(folder):
                if not name.startswith("."):
                    yield folder, name


def distinct_names(root: Path) -> list[tuple[Path, str, str]]:
    """Give every fxgraph/AOTAutograd entry file a name of its own: its last 4 characters become
    its folder's (the copy's key tag), so no two copies share a content name. Returns what was
    renamed, for `shared_names` to put back."""
    done = []
    for folder, name in list(_entry_files(root)):
        new = name[:-4] + folder.name[-4:]
        if new != name:
            os.rename(folder / name, folder / new)
            done.append((folder, name, new))
    return done


def shared_names(renames: list[tuple[Path, str, str]]) -> None:
    """Undo `distinct_names`."""
    for folder, name, new in renames:
        os.rename(folder / new, folder / name)
