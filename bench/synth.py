"""Build a large cache tree from real entries: the shared H200 fixture replicated under new keys.

Every replica keeps the fixture's proportions (about 0.5 % fxgraph files, most files in Triton
kernel directories) and its real bytes; files are hard links to one extracted copy, so a
100,000-file tree costs seconds and no extra disk. Used by the benchmarks under bench/.
"""

from __future__ import annotations

import os
import shutil
import string
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE_NAME = "shared/fixtures/inductor-cache-h200-torch2.11.tgz"
_B36 = string.digits + string.ascii_lowercase


def fixture_path() -> Path:
    for p in REPO.parents:
        if (p / FIXTURE_NAME).exists():
            return p / FIXTURE_NAME
    raise SystemExit(f"cannot find {FIXTURE_NAME} beside the checkout")


def extract_fixture(dst: Path) -> Path:
    with tarfile.open(fixture_path()) as t:
        t.extractall(dst, filter="data")
    (root,) = [p for p in dst.iterdir() if p.is_dir()]
    return root


def _tag(i: int, width: int = 4) -> str:
    out = ""
    for _ in range(width):
        i, r = divmod(i, 36)
        out = _B36[r] + out
    return out


def _renamed(rel: str, i: int) -> str:
    """The fixture path `rel` under replica i's keys, in the same layout."""
    parts = rel.split("/")
    t = _tag(i)
    if parts[0] == "fxgraph":  # fxgraph/<2ch>/<key>/<file>
        parts[2] = parts[2][:-4] + t
        parts[3] = parts[3][:-4] + t
    elif parts[0] == "aotautograd":  # aotautograd/<key>/<file>
        parts[1] = parts[1][:-4] + t
        parts[2] = parts[2][:-4] + t
    elif parts[0] == "triton":  # triton/<dev>/<hash>/<file>
        parts[2] = parts[2][:-4] + t.upper()
    else:  # <2ch>/c<hash>.<ext> or <2ch>/<sha>.best_config
        stem, dot, ext = parts[-1].partition(".")
        parts[-1] = stem[:-4] + t + dot + ext
    return "/".join(parts)


def build_tree(dst: Path, files: int = 100_000) -> int:
    """Fill `dst` with about `files` files; returns the exact count."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cachemgr-fixture-", dir=dst.parent))
    src = extract_fixture(work)
    rels = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    count = 0
    i = 0
    made: set[str] = set()
    while count < files:
        for rel in rels:
            if count >= files:
                break
            new = _renamed(rel, i)
            out = dst / new
            parent = str(out.parent)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            os.link(src / rel, out)
            count += 1
        i += 1
    shutil.rmtree(work)  # the replicas are hard links: they keep the bytes
    return count
