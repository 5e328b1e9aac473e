"""The fast tier's caches: real TorchInductor caches that real torch wrote (tests/fixtures/caches,
tests/fixtures/gpu; see their READMEs), extracted once per session and copied per test. No test
that uses them compiles anything.

    from fixture_caches import fixture_cache, fixture_masters  # noqa: F401 (pytest fixtures)

    def test_x(fixture_cache):
        root = fixture_cache("torch-2.13.0-cpu")
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TARBALLS = {p.name.removesuffix(".tar.gz"): p for p in (FIXTURES / "caches").glob("*.tar.gz")}
TARBALLS["h200-2.11"] = FIXTURES / "gpu" / "inductor-cache-h200-torch2.11.tgz"  # the GPU cache (one top folder)


@pytest.fixture(scope="session")
def fixture_masters(tmp_path_factory):
    made: dict[str, Path] = {}

    def master(name: str) -> Path:
        if name not in made:
            dst = tmp_path_factory.mktemp(name.replace(".", "_"))
            with tarfile.open(TARBALLS[name]) as t:
                t.extractall(dst, filter="data")
            tops = [p for p in dst.iterdir()]
            made[name] = tops[0] if len(tops) == 1 and tops[0].is_dir() and tops[0].name == name else dst
        return made[name]

    return master


@pytest.fixture
def fixture_cache(fixture_masters, tmp_path):
    """fixture_cache(NAME): a fresh copy of that real cache, mtimes kept."""

    def copy(name: str = "torch-2.13.0-cpu") -> Path:
        dst = tmp_path / f"cache-{name}"
        shutil.copytree(fixture_masters(name), dst, symlinks=True)
        return dst

    return copy
