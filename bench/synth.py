"""Build a large cache tree from real entries: the repository's H200 fixture replicated under new keys.

Every replica keeps the fixture's proportions (about 0.5 % fxgraph files, most files in Triton
kernel directories) and its real bytes; files are hard links to one extracted copy, so a
100,000-file tree costs seconds and no extra disk. Used by the benchmarks under bench/.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "inductor-cache-h200-torch2.11.tgz"  # a real H200 cache


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
            new = renamed(rel, i)
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
