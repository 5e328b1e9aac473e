"""Eviction beside a running torch.compile loop must never break it: at worst it recompiles.

The cache is seeded by an earlier run and aged an hour, so the evictor really deletes while the
loop reads: repeats of seeded shapes race the deletion of their entries; fresh shapes write new
entries the default grace period (60 s, after the last write *and* the last access) protects, as
it protects Inductor's own just-written sources (DESIGN.md: deleting a c*.main.cpp under a build
crashed torch.compile within seconds). The evictor runs `evict --max-size 0` back to back.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PROGRAMS, subprocess_env
from test_evict import HOUR, age_files, assert_index_matches_disk

pytestmark = pytest.mark.slow  # real compiles in a loop beside eviction

LOOP = PROGRAMS / "compile_loop.py"
SEED = "main:3,main:4,other:3"
STEPS = "main:3,main:5,main:4,main:5,main:6,main:3,main:6"  # repeats of seeded, fresh, repeats of fresh


def test_compile_loop_survives_evict_max_size_0(tmp_path, cli_for, cpp_builds):
    root = tmp_path / "inductor"
    # the C++ builds earlier seeding runs made (conftest.Builds: the same files, no entry), aged
    # and evicted below with the rest
    had = cpp_builds.seed(root, "compile_loop " + SEED)
    seed = subprocess.run(
        [sys.executable, str(LOOP), "--steps", SEED],
        env=subprocess_env(root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert seed.returncode == 0, seed.stderr[-3000:]
    cpp_builds.keep("compile_loop " + SEED, root, had)
    age_files(root, HOUR)
    cli = cli_for(root)
    loop = subprocess.Popen(
        [sys.executable, str(LOOP), "--steps", STEPS, "--wait"],
        env=subprocess_env(root),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    passes = evicted = 0
    try:
        assert loop.stdout.readline().strip() == "ready"
        loop.stdin.write("go\n")
        loop.stdin.flush()
        # the loop's first steps read seeded entries the evictor is deleting at the same time
        while loop.poll() is None:
            r = cli.json("evict", "--max-size", "0")  # default grace, as the daemon runs it
            passes += 1
            evicted += r["evicted"]
        out, err = loop.communicate(timeout=600)
    finally:
        if loop.poll() is None:
            loop.kill()
    assert loop.returncode == 0, err[-4000:]
    assert "Traceback" not in err and "Error" not in err, err[-4000:]
    counters = json.loads(out.strip().splitlines()[-1])
    print(f"race: {passes} evict passes during the loop, {evicted} entries evicted, loop counters {counters}")
    assert counters["iterations"] == len(STEPS.split(","))  # every iteration, each checked against eager
    last = cli.json("evict", "--max-size", "0")  # the seeded 'other' graph nobody read: gone by now
    evicted += last["evicted"]
    assert evicted > 0 and [e for e in cli.json("ls", "--older-than", "30m") if e["kind"] != "lock"] == []
    cli("scan")
    assert_index_matches_disk(cli, root)
