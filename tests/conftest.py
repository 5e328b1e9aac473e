"""Shared fixtures: real caches (one compiled here on CPU, the shared H200 fixture), a fresh
index per test, and ways to run the CLI in-process (CliRunner) and as a real subprocess."""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixture_caches import fixture_cache, fixture_masters  # noqa: F401 - the fast tier's real caches, for every test

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = REPO / "tests" / "programs"
FIXTURES = REPO / "tests" / "fixtures"
GPU_FIXTURE = FIXTURES / "gpu" / "inductor-cache-h200-torch2.11.tgz"  # a real H200 cache (torch 2.11, Triton 3.6)


# Run the CLI in-process with the given argv, then fail if torch was imported on the way.
NO_TORCH_PROGRAM = """
import sys
from cachemgr.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


# The command in-process, then its own peak RSS on stderr: VmHWM, this program's since its exec
# (ru_maxrss can hold the forking test process's, which has imported torch; nor its parse workers').
OWN_PEAK_RSS_PROGRAM = """
import sys
from cachemgr.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
with open("/proc/self/status") as f:
    kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
print("peak-rss-mib", kib // 1024, file=sys.stderr)
sys.exit(code)
"""


def subprocess_env(cache_dir: Path | str | None = None, **extra: str) -> dict[str, str]:
    # COLUMNS: pytest-xdist workers inherit one; output to a pipe is then cut as on a terminal
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEMGR_", "TORCHINDUCTOR_", "COLUMNS", "LINES"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env.update(extra)
    return env


def run_program(cache_dir: Path, *args: str, timeout: float = 600, **env: str) -> dict:
    """Run the test workload in a fresh process; return its counters line."""
    out = subprocess.run(
        [sys.executable, str(PROGRAMS / "compile_models.py"), *args],
        env=subprocess_env(cache_dir, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session", autouse=True)
def isolated_state_dir(tmp_path_factory):
    """No test may touch the user's own index ($XDG_STATE_HOME/cachemgr) or spool."""
    state = tmp_path_factory.mktemp("xdg-state")
    for name in ("COLUMNS", "LINES"):  # output is cut to fit only where a test asks for a width
        os.environ.pop(name, None)
    old = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(state)
    yield state
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


REDIS_HOST = os.environ.get("CACHEMGR_TEST_REDIS", "127.0.0.1:6379")
CLAIM = "cachemgr-test:claim"  # not under cachemgr: (that prefix is the tool's own)


@pytest.fixture(scope="session")
def redis_db():
    """A Redis db number of our own for the session (each pytest-xdist worker claims its own):
    Inductor has no key prefix, only the /N of its URL, so tests (and other users of this server)
    are kept apart by db number. Only an empty db is claimed, and the claim is a key in it."""
    import redis

    for n in range(15, 0, -1):
        r = redis.Redis.from_url(f"redis://{REDIS_HOST}/{n}")
        if r.dbsize() == 0 and r.set(CLAIM, os.getpid(), nx=True, ex=7200):
            yield n
            r.flushdb()
            return
    pytest.fail(f"no empty Redis db on {REDIS_HOST} to claim")


@pytest.fixture
def redis_url(redis_db):
    """The session's Redis db, emptied for this test (the claim key stays)."""
    import redis

    url = f"redis://{REDIS_HOST}/{redis_db}"
    r = redis.Redis.from_url(url)
    # In one transaction: between a flush and the claim, another worker would find the db empty
    # and take it too (the two then flush each other's keys).
    r.pipeline(transaction=True).flushdb().set(CLAIM, os.getpid(), ex=7200).execute()
    return url


def free_port() -> int:
    """A loopback port free now, for a daemon to bind later. Below the kernel's ephemeral range:
    a port from there (bind to 0) may meanwhile become another test's outgoing connection's."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail("no free loopback port below the ephemeral range")


def run_dir(tmp_path_factory) -> Path:
    """The test run's temp folder, which every pytest-xdist worker sees (above each one's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True)
def _inotify_limits_alone(request, tmp_path_factory):
    """A test marked `inotify_limits` lowers a system-wide inotify limit (watches per user, the
    queue of a new instance) for a while: it runs while no other test does, on any worker (the
    other worker's daemons would find no watch left, or a queue of 16). Every other test holds
    the lock shared: its daemons are stopped before it lets go (this fixture is set up first)."""
    alone = request.node.get_closest_marker("inotify_limits") is not None
    with open(run_dir(tmp_path_factory) / "inotify-limits.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


def shared_dir(tmp_path_factory, name: str, build) -> Path:
    """A folder made once per test run by build(path), whichever pytest-xdist worker asks first;
    the others wait for it (an flock) and reuse it (pytest-xdist's way to share session data).
    Built in place, at the path every worker then sees: what torch writes may name it. A build
    that failed (no .done beside it) is thrown away and made again by the next to ask."""
    base = run_dir(tmp_path_factory)
    path, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def cpu_cache_master(tmp_path_factory, cpp_builds) -> Path:
    """A real cache written by torch.compile on CPU (training step with dynamic batch,
    inference, custom options), from an empty dir (nothing seeded: its compile times are real).
    Built once per run (shared by the pytest-xdist workers); tests get copies, or only read it.
    Its C++ builds are kept as those of compile_models.py."""

    def build(path: Path) -> None:
        counters = run_program(path / "inductor")
        assert counters["fxgraph_cache_miss"] > 0

    root = shared_dir(tmp_path_factory, "cpu-cache", build) / "inductor"
    cpp_builds.keep("compile_models", root)
    return root


# -- C++ builds: what g++ made for Inductor, given to a compile that would make the same ------------
#
# A compile into a cache dir without them spends most of its time in g++: every new cache dir
# first builds Inductor's vector-ISA probes (c*.cpp/.so: small programs that test the CPU's AVX2
# / AVX-512 / VNNI / BF16), then one <key>.main.so per kernel. Each is named by a hash of its C++
# source and of the g++ command, and torch builds one only when that file is not there yet
# (codecache.write, CppCodeCache.load_async, cpu_vec_isa.check_build). So a build this venv made
# for the same source is the very file torch would make again: copied into a cache dir (a copy,
# new mtime; never a link, so a test that ages or damages its files touches only its own) it
# spares g++ and changes nothing else. Only C++ builds are given, never an fxgraph/ or
# aotautograd/ entry or a Python module: whether a graph hits or misses, what torch counts and
# traces, and what cachemgr sees of the graphs stay exactly those of a cold compile.
# Where what a compile writes is the subject (eviction under a running compile, the daemon
# indexing a compile live, the rebuild after an eviction) the kernels are never seeded.


def is_build(path: Path) -> bool:
    return path.suffix in (".cpp", ".so") and path.name.startswith("c") and len(path.parent.name) == 2


def is_probe(path: Path) -> bool:
    """A vector-ISA probe (every cache dir's first builds), not a kernel (<key>.main.cpp/.so)."""
    return ".main." not in path.name


def builds_in(cache: Path) -> set[str]:
    """The C++ builds in a cache dir, as <2ch>/<name>."""
    return {f"{f.parent.name}/{f.name}" for f in cache.glob("??/c*") if is_build(f)}


def copy_builds(src: Path, dst: Path, keep=lambda p: True, atomic: bool = False) -> int:
    """Copy the C++ builds of cache dir `src` into cache dir `dst` that it lacks; how many."""
    n = 0
    for f in sorted(src.glob("??/c*")):
        if not is_build(f) or not keep(f):
            continue
        target = dst / f.parent.name / f.name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if atomic:  # another worker may copy the same file into the same place at once
            tmp = target.with_name(f".{os.getpid()}.{f.name}.tmp")
            shutil.copyfile(f, tmp)
            os.replace(tmp, target)
        else:
            shutil.copyfile(f, target)
        n += 1
    return n


class Builds:
    """C++ builds this run's compiles made, kept by workload (shared by the pytest-xdist workers),
    to seed a later compile of the same workload.

        had = builds.seed(cache, "make_cache", master)  # before a compile: the probes, those builds
        builds.keep("make_cache", cache, had)           # after it: the builds it made, for the next

    Labels name a workload (program and arguments that choose its graphs); a Path is a cache dir
    to take builds from. The probes are the same for every compile of this venv: any kept compile
    into an empty dir has them. A seed of what nobody kept yet gives nothing, and that compile
    builds them as before (speed depends on the order tests run in, outcomes never do)."""

    def __init__(self, tmp_path_factory) -> None:
        self.root = shared_dir(tmp_path_factory, "cpp-builds", lambda path: None)

    def keep(self, label: str, src: Path, had: set[str] = frozenset()) -> None:
        """Keep the builds of cache dir `src` but those it `had` before the compile (builds a
        fixture came with were made by another venv, or for another workload)."""
        copy_builds(src, self.root / label, lambda f: f"{f.parent.name}/{f.name}" not in had, atomic=True)

    def probes(self) -> list[Path]:
        """The kept workloads' folders that hold probes (a compile into an empty dir made them all)."""
        return [d for d in self.root.iterdir() if any(is_probe(f) for f in d.glob("??/c*.so"))]

    def seed(self, dst: Path, *sources: str | Path, probes: bool = True) -> set[str]:
        """Give cache dir `dst` the probes and the builds of `sources` it lacks; the builds it has now."""
        for src in self.probes() if probes else ():
            copy_builds(src, dst, is_probe)
        for src in sources:
            copy_builds(self.root / src if isinstance(src, str) else src, dst)
        return builds_in(dst)


@pytest.fixture(scope="session")
def cpp_builds(tmp_path_factory) -> Builds:
    return Builds(tmp_path_factory)


@pytest.fixture
def cpu_cache(cpu_cache_master, tmp_path) -> Path:
    dst = tmp_path / "inductor"
    shutil.copytree(cpu_cache_master, dst, symlinks=True)
    return dst


@pytest.fixture(scope="session")
def gpu_cache_master(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("gpu-cache")
    with tarfile.open(GPU_FIXTURE) as t:
        t.extractall(dst, filter="data")
    (root,) = [p for p in dst.iterdir() if p.is_dir()]
    return root


@pytest.fixture
def gpu_cache(gpu_cache_master, tmp_path) -> Path:
    dst = tmp_path / "gpu-cache"
    shutil.copytree(gpu_cache_master, dst, symlinks=True)
    return dst


@pytest.fixture
def db_url(tmp_path) -> str:
    (tmp_path / "state").mkdir(exist_ok=True)  # --db makes no folder: only the default state folder is created
    return f"sqlite:///{tmp_path / 'state' / 'index.db'}"


class Cli:
    """`cachemgr` bound to one cache dir and index: in-process by default, `.proc()` as a subprocess."""

    def __init__(self, cache_dir: Path, db_url: str, host: str = "testhost") -> None:
        self.cache_dir, self.db_url, self.host = cache_dir, db_url, host

    def base(self) -> list[str]:
        return ["--cache-dir", str(self.cache_dir), "--db", self.db_url, "--host", self.host]

    def __call__(self, *args: str, code: int = 0, input: str | None = None):
        from cachemgr.cli import main

        with CliRunner().isolation(input=input) as (out, err, _):
            try:
                main([*self.base(), *args])
                exit_code = 0
            except SystemExit as e:
                exit_code = int(e.code or 0)
            stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
        assert exit_code == code, f"exit {exit_code} != {code}\nstdout: {stdout}\nstderr: {stderr}"
        return Result(stdout, stderr, exit_code)

    def json(self, *args: str, code: int = 0):
        return json.loads(self(*args, "--json", code=code).stdout)

    def proc(self, *args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cachemgr", *self.base(), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**subprocess_env(), **(env or {})},
        )


class Result:
    def __init__(self, stdout: str, stderr: str, exit_code: int) -> None:
        self.stdout, self.stderr, self.exit_code = stdout, stderr, exit_code


@pytest.fixture
def cli_for(db_url):
    return lambda cache_dir, **kw: Cli(cache_dir, kw.pop("db", db_url), **kw)


# -- the two tiers -----------------------------------------------------------------------------------

# A test that uses one of these is in the integration tier (`slow`): a cache compiled by
# torch.compile in this session, a daemon process, PostgreSQL, Redis. `pytest -m "not slow"` is
# the fast tier: pure functions, synthetic trees and rows, the CLI on the repository's fixtures.
INTEGRATION_FIXTURES = frozenset(
    {
        "cpu_cache",
        "cpu_cache_master",
        "cpp_builds",
        "aged_cpu",
        "start",
        "pg_url",
        "redis_db",
        "redis_url",
        "rconn",
        "own_redis",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {}).values()  # a fixture named by a parameter
        named = {p for p in params if isinstance(p, str)}
        if INTEGRATION_FIXTURES.intersection(getattr(item, "fixturenames", ())) or INTEGRATION_FIXTURES & named:
            item.add_marker(pytest.mark.slow)
    # the longest files first (each file's tests stay together, in their order)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))


# -- the order pytest-xdist hands files out in (--dist loadfile) --------------------------------------
#
# xdist's own order puts the files with the most tests first: the files of one or two long
# compiles came last (test_activity, test_evict_race: a minute each, one test), and one core
# idled while the other ran them. Longest first (the whole suite's figures: seconds of test time
# on 2 cores), the short files fill the end.
LONGEST_FIRST = (
    "test_check.py",  # 290
    "test_prewarm.py",  # 155
    "test_hostile_inputs.py",  # 150
    "test_evict.py",  # 100
    "test_explain.py",  # 75
    "test_daemon.py",  # 70
    "test_remote.py",  # 70
    "test_hostile_tree.py",  # 55
    "test_activity.py",  # 45
    "test_evict_race.py",  # 45
    "test_formats.py",  # 45
    "test_index.py",  # 40
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order made above
        config.option.loadscopereorder = False
