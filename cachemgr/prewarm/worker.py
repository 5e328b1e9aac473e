"""Replay recorded shapes through torch.compile in worker processes.

The parent side (plan, run) never imports torch; the child side (`python -m
cachemgr.prewarm.worker`, function `child_main`) is the only place that does. One worker per
device; a job is the models' shapes in their recorded order (automatic dynamic shapes depend on
that order: the first shape compiles a static graph, the next a dynamic one, as in the workload).
The child reports JSON lines on a pipe of its own (the model may print on stdout); the parent
enforces the per-shape timeout, and a worker that dies or hangs is replaced for the shapes left.
A call's inputs are measured before any is built (recorded shapes are anyone's): over the model's
`max_input_bytes`, or holding more elements than that (a stride of 0 spans a huge shape with one),
that shape fails, naming its size, and nothing is allocated.

Workers live in process groups of their own (cachemgr.procs): a terminal's Ctrl-C reaches only the
CLI, which kills every worker group and waits for it, then removes what an import or export was
writing, before it exits 130; a worker (and the compile processes torch starts in its group) also
dies with the CLI when that is killed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cachemgr import procs
from cachemgr.prewarm.manifest import MAX_INPUT_BYTES, Manifest, ModelSpec
from cachemgr.units import format_size

COUNTERS = (
    ("inductor", "fxgraph_cache_hit"),
    ("inductor", "fxgraph_cache_miss"),
    ("inductor", "fxgraph_cache_bypass"),
    ("aot_autograd", "autograd_cache_hit"),
    ("aot_autograd", "autograd_cache_miss"),
    ("aot_autograd", "autograd_cache_saved"),
    ("aot_autograd", "autograd_cache_bypass"),
)


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    index: int
    signature_hash: str
    signature: str
    spec: dict


@dataclass(frozen=True)
class ModelPlan:
    spec: ModelSpec
    compile: dict  # torch.compile kwargs
    shapes: list[Shape]

    @property
    def automatic_dynamic(self) -> bool:
        return "dynamic" not in self.compile


@dataclass(frozen=True)
class ShapeResult:
    model: str
    index: int
    signature: str
    device: str
    phase: str  # prewarm | verify | export
    ok: bool
    seconds: float | None = None
    counters: dict = field(default_factory=dict)
    error: str | None = None
    lead_in: bool = False  # replayed only so later shapes compile what the workload compiles
    worker: int | None = None  # pid of the worker process

    @property
    def aot_misses(self) -> int:
        """AOTAutograd misses a prewarm should have prevented. One that saved nothing is not: torch
        saves a graph that needs a backward only once its backward compiles, so a forward-only call
        with grad enabled misses in every process (its Inductor graphs hit)."""
        return self.counters.get("autograd_cache_miss", 0) if self.counters.get("autograd_cache_saved", 0) else 0

    @property
    def misses(self) -> int:
        """Cache misses a prewarm should have prevented."""
        return self.counters.get("fxgraph_cache_miss", 0) + self.aot_misses


@dataclass(frozen=True)
class RunResult:
    shapes: list[ShapeResult]
    model_errors: list[tuple[str, str]]  # (model, message)
    imported: dict | None = None
    exported: dict | None = None
    seconds: float = 0.0
    host_side: dict | None = None  # phase 'check': this host's side of the hash components
    fingerprints: list[dict] = field(default_factory=list)  # what each worker's torch is (worker_ready)

    def failures(self, verify: bool = False) -> list[str]:
        out = [msg for _, msg in self.model_errors]
        for r in self.shapes:
            if not r.ok:
                out.append(f"model {r.model!r} shape #{r.index} {r.signature} on {r.device}: {r.error}")
            elif verify and r.phase == "verify" and r.misses:
                out.append(
                    f"model {r.model!r} shape #{r.index} {r.signature} on {r.device}: verify saw "
                    f"{r.counters.get('fxgraph_cache_miss', 0)} fxgraph and "
                    f"{r.aot_misses} autograd cache misses "
                    "(expected only hits)"
                )
        return out

    def as_dict(self) -> dict:
        return {
            "shapes": [asdict(r) for r in self.shapes],
            "model_errors": [{"model": m, "error": e} for m, e in self.model_errors],
            "imported": self.imported,
            "exported": self.exported,
            "seconds": round(self.seconds, 3),
        }

    def learned(self) -> list[tuple[str, str, str]]:
        """(kind, hash, name) the workers' torch reported: 'torch' (the torch_version component hash
        -> torch.__version__) and 'system' (system_info's hash -> 'NVIDIA H200, CUDA 13.0, ...')."""
        out = []
        for fp in self.fingerprints:
            if fp.get("torch_version_hash") and fp.get("torch"):
                out.append(("torch", fp["torch_version_hash"], fp["torch"]))
            if fp.get("system_hash") and fp.get("system"):
                out.append(("system", fp["system_hash"], fp["system"]))
        return list(dict.fromkeys(out))


def plan(manifest: Manifest, recorded: list[dict]) -> tuple[list[ModelPlan], list[tuple[str, str]]]:
    """Resolve `shapes = "recorded"` against the index's rows; errors name the model and field."""
    by_model: dict[str, list[dict]] = {}
    for r in recorded:
        by_model.setdefault(r["model"], []).append(r)
    plans, errors = [], list(manifest.errors)
    for m in manifest.models:
        if m.shapes == "recorded":
            rows = by_model.get(m.name, [])
            if not rows:
                errors.append(
                    (
                        m.name,
                        f"manifest {manifest.path}: model {m.name!r}: field 'shapes': \"recorded\" but "
                        "no shapes are recorded for this name (did the workload run with "
                        "cachemgr.record.compile(name=...), and was the spool ingested by scan?)",
                    )
                )
                continue
            shapes = [Shape(i, r["signature_hash"], r["signature"], r["spec"]) for i, r in enumerate(rows)]
            compile_kw = m.compile if m.compile is not None else _recorded_options(rows)
        else:
            from cachemgr.record import signature_hash, signature_text

            compile_kw = m.compile or {}
            shapes = [Shape(i, signature_hash(s, compile_kw), signature_text(s), s) for i, s in enumerate(m.shapes)]
        bad = [k for k, v in compile_kw.items() if isinstance(v, str) and v.startswith("<")]
        if bad:
            errors.append(
                (
                    m.name,
                    f"manifest {manifest.path}: model {m.name!r}: field 'compile': the recorded "
                    f"option(s) {', '.join(bad)} are Python objects; give them in the manifest",
                )
            )
            continue
        plans.append(ModelPlan(m, compile_kw, shapes))
    return plans, errors


def _recorded_options(rows: list[dict]) -> dict:
    return dict(rows[-1]["options"])  # the latest; rows of one model share them in practice


# -- what can be checked before torch starts -----------------------------------------------------


def precheck(
    plans: list[ModelPlan],
    search_path: list[str],
    devices: list[str] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> tuple[list[ModelPlan], list[tuple[str, str]]]:
    """Drop the models that cannot run, naming why, without importing torch or the models: a
    factory module that is nowhere on the worker's path, or a CUDA device this host lacks (each
    model's own device; `devices` from --devices are checked by the caller)."""
    ok, errors = [], []
    for p in plans:
        m = p.spec
        problem = factory_problem(m.factory, search_path)
        if problem is None and devices is None:
            dev = cuda_problem(m.device, environ)
            problem = None if dev is None else f"field 'device' {m.device!r}: {dev}"
        if problem is None:
            ok.append(p)
        else:
            errors.append((m.name, f"model {m.name!r}: {problem}"))
    return ok, errors


def factory_problem(factory: str, search_path: list[str]) -> str | None:
    """Why `pkg.module:function`'s module cannot be imported by a worker, or None. Finds it as the
    import system would, but runs nothing: no package's __init__ is executed."""
    import importlib.util
    from importlib.machinery import PathFinder

    mod = factory.partition(":")[0]
    missing = f"field 'factory' {factory!r}: cannot import module {mod!r}: no module named {{!r}} on the worker's path"
    parts = mod.split(".")
    try:
        spec = PathFinder.find_spec(parts[0], search_path) or importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    for i in range(1, len(parts) + 1):
        if spec is None:
            return missing.format(".".join(parts[:i]))
        if i == len(parts):
            return None
        locations = spec.submodule_search_locations
        try:
            spec = PathFinder.find_spec(".".join(parts[: i + 1]), list(locations)) if locations else None
        except (ImportError, ValueError):
            spec = None
    return None


NO_CUDA = "this host has no CUDA device"


def cuda_problem(device: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why `device` cannot be used on this host, judged without torch (the worker confirms with
    torch.cuda); None for the CPU and for a CUDA device that may well be there."""
    if not device.startswith("cuda"):
        return None
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return f"{NO_CUDA} (CUDA_VISIBLE_DEVICES={visible!r} hides them all)"
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")):
        return f"{NO_CUDA} (no NVIDIA driver: /proc/driver/nvidia/version is missing)"
    index = int(device.partition(":")[2] or 0)
    if visible is not None:
        count: int | None = len([x for x in visible.split(",") if x.strip()])
    else:
        try:
            count = len(os.listdir("/proc/driver/nvidia/gpus"))
        except OSError:
            count = None  # cannot tell here: the worker will
    if count is not None and index >= count:
        return f"this host has {count} CUDA device(s): cuda:0 to cuda:{count - 1}" if count else NO_CUDA
    return None


@dataclass(frozen=True)
class Slice:
    model: ModelPlan
    indices: list[int]  # into model.shapes, in order
    lead_in: int | None = None  # index replayed first and flagged


Jobs = list[tuple[str, list[Slice]]]  # one worker process each: (device, its slices); a device may repeat


def distribute(plans: list[ModelPlan], devices: list[str], replicate: bool = False) -> Jobs:
    """Share the shapes among the devices (round robin, order kept), or give every device all.
    One worker per item of `devices`: 'cpu,cpu' is two workers.

    A slice of an automatic-dynamic model that does not start with the model's first shape
    replays that shape first, so the rest compile the same dynamic graph the workload will."""
    jobs: Jobs = [(d, []) for d in devices]
    for p in plans:
        for w, (_, slices) in enumerate(jobs):
            idx = [s.index for s in p.shapes] if replicate else [s.index for s in p.shapes][w :: len(devices)]
            if idx:
                slices.append(_slice(p, idx))
    return jobs


def _slice(p: ModelPlan, idx: list[int]) -> Slice:
    first = p.shapes[0].index
    lead = first if p.automatic_dynamic and idx and idx[0] != first and len(p.shapes) > 1 else None
    return Slice(p, idx, lead)


# -- the parent: run workers -------------------------------------------------------------------

Event = dict[str, Any]


class _Workers:
    """The live worker processes of one run. `stop()` (on Ctrl-C or any error in the caller) kills
    every worker's process group, and no replacement worker starts after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen] = set()
        self.stopped = False

    def add(self, proc: subprocess.Popen) -> bool:
        with self.lock:
            if not self.stopped:
                self.live.add(proc)
                return True
        procs.kill_group(proc)  # started just as the run was stopped
        return False

    def discard(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.live.discard(proc)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            live = list(self.live)
        for proc in live:
            procs.kill_group(proc)
        for proc in live:
            proc.wait()
            procs.wait_group_gone(proc.pid)  # torch's compile workers in the group too


def run(
    jobs: Jobs,
    env: dict[str, str],
    *,
    phase: str = "prewarm",
    timeout: float | None = None,
    on_event: Callable[[Event], None] | None = None,
    import_bundle: str | None = None,
    export: dict | None = None,
    check: dict | None = None,
) -> RunResult:
    """Run the jobs' workers concurrently (at least one, on the CPU); return every shape's result.

    The cache directory (the env's TORCHINDUCTOR_CACHE_DIR) is made first where missing.
    Interrupted (KeyboardInterrupt, or any exception in this thread), it kills every worker's
    process group and waits until nothing of them runs, then re-raises: no compile and no cache
    write happens after it returns. What the import or export was writing through (its staging
    folder, the bundle's temporary file) is named here and removed once the workers are gone: a
    worker killed (interrupted, timed out, out of memory) leaves it behind."""
    t0 = time.monotonic()
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        _make_cache_dir(env["TORCHINDUCTOR_CACHE_DIR"])
    imp = {"path": import_bundle, "staging": staging_name()} if import_bundle else None
    if export is not None:
        from cachemgr.prewarm import bundle

        export = {**export, "tmp": bundle.temp_path(export["out"])}
    results: list[ShapeResult] = []
    model_errors: list[tuple[str, str]] = []
    extra: dict[str, Any] = {}
    fingerprints: list[dict] = []
    lock = threading.Lock()
    workers = _Workers()

    def emit(ev: Event) -> None:
        with lock:
            if ev["e"] == "shape":
                results.append(ShapeResult(**{k: ev[k] for k in ShapeResult.__dataclass_fields__ if k in ev}))
            elif ev["e"] == "model_error":
                model_errors.append((ev["model"], ev["error"]))
            elif ev["e"] in ("imported", "exported", "host_side"):
                extra[ev["e"]] = ev
            elif ev["e"] == "worker_ready" and ev.get("fingerprint"):
                fingerprints.append(ev["fingerprint"])
            if on_event and not workers.stopped:
                on_event(ev)

    threads = []
    failed: list[str] = []  # a driver thread's own failure (a bug, a recursion): the run fails with it

    def drive(*args) -> None:
        try:
            _drive(*args)
        except Exception as e:  # noqa: BLE001 - said by run(), never lost with the thread
            failed.append(f"{args[0]}: {_first_line(e)}")
            workers.stop()

    try:
        for i, (d, slices) in enumerate(jobs or [("cpu", [])]):
            # daemon threads: an interrupted run never waits at exit for a thread whose worker is dead
            t = threading.Thread(
                target=drive,
                daemon=True,
                args=(
                    d,
                    slices,
                    env,
                    phase,
                    timeout,
                    emit,
                    workers,
                    imp if i == 0 else None,
                    export if i == 0 else None,
                    check if i == 0 else None,
                ),
            )
            t.start()
            threads.append(t)
        for t in threads:
            # a timed join: the kernel may hand Ctrl-C to another thread, and Python then runs its
            # handler here only once this thread runs again (an untimed join waited for the worker)
            while t.is_alive():
                t.join(0.2)
    except BaseException:
        workers.stop()
        raise
    finally:
        _remove_leftovers(env.get("TORCHINDUCTOR_CACHE_DIR"), imp, export)
    if failed:
        from cachemgr.errors import PrewarmError

        raise PrewarmError(f"the run on {failed[0]}: stopped")
    results.sort(key=lambda r: (r.model, r.phase, r.index, r.device, not r.lead_in))
    return RunResult(
        results,
        model_errors,
        extra.get("imported"),
        extra.get("exported"),
        time.monotonic() - t0,
        extra.get("host_side"),
        fingerprints,
    )


def _make_cache_dir(root: str) -> None:
    """Make the cache directory the workers' torch uses, where missing (torch would: one it cannot
    make fails its import, and the worker reported nothing). CacheDirError (exit 4), the same for
    every command, where it cannot be made."""
    import errno

    from cachemgr.errors import CacheDirError

    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        why = os.strerror(errno.ENOTDIR) if isinstance(e, FileExistsError) else e.strerror  # (a file of that name)
        raise CacheDirError(f"cannot create cache directory {root}: {why}") from None


def _job_doc(
    device: str,
    slices: list[Slice],
    phase: str,
    imp: dict | None,
    export: dict | None,
    check: dict | None = None,
) -> dict:
    return {
        "device": device,
        "phase": phase,
        "import": imp,
        "export": export,
        "check": check,
        "models": [
            {
                "spec": s.model.spec.as_dict(),
                "compile": s.model.compile,
                "shapes": ([{**asdict(s.model.shapes[s.lead_in]), "lead_in": True}] if s.lead_in is not None else [])
                + [asdict(s.model.shapes[i]) for i in s.indices],
            }
            for s in slices
        ],
    }


def _drive(
    device: str,
    slices: list[Slice],
    env: dict[str, str],
    phase: str,
    timeout: float | None,
    emit: Callable[[Event], None],
    workers: _Workers,
    imp: dict | None,
    export: dict | None,
    check: dict | None = None,
) -> None:
    """One device: run a worker; if it dies or hangs, fail that shape and start another for the rest."""
    remaining = list(slices)
    first = True
    while (remaining or first) and not workers.stopped:
        job = _job_doc(
            device,
            remaining,
            phase,
            imp if first else None,
            export if first else None,
            check if first else None,
        )
        first = False
        done: set[tuple[str, int]] = set()
        current: list[Any] = [None]

        # `on` runs only within this iteration (one worker's events): the loop's names are its own
        def on(
            ev: Event,
            done: set[tuple[str, int]] = done,
            current: list[Any] = current,
            remaining: list[Slice] = remaining,
        ) -> None:
            if ev["e"] == "shape_start":
                current[0] = ev
            elif ev["e"] == "shape":
                current[0] = None
                if not ev.get("lead_in"):
                    done.add((ev["model"], ev["index"]))
            elif ev["e"] == "model_error":
                done.update((ev["model"], i) for s in remaining if s.model.spec.name == ev["model"] for i in s.indices)
            emit(ev)

        status = _one_worker(job, env, timeout, on, workers)
        if status is None or workers.stopped:
            return
        cur = current[0]
        if cur is None:  # died between shapes, or before the first: blame the next one
            nxt = next(
                ((s.model.spec.name, i) for s in remaining for i in s.indices if (s.model.spec.name, i) not in done),
                None,
            )
            if nxt is None:
                return
            cur = {"model": nxt[0], "index": nxt[1], "signature": _sig(remaining, *nxt), "lead_in": False}
        emit(
            {
                "e": "shape",
                "model": cur["model"],
                "index": cur["index"],
                "signature": cur["signature"],
                "device": device,
                "phase": phase,
                "ok": False,
                "error": status,
                "lead_in": cur.get("lead_in", False),
            }
        )
        if not cur.get("lead_in"):
            done.add((cur["model"], cur["index"]))
        else:  # the lead-in itself failed: the model's slice cannot be replayed faithfully
            done.update((cur["model"], i) for s in remaining if s.model.spec.name == cur["model"] for i in s.indices)
        remaining = [r for r in (_rest(s, done) for s in remaining) if r is not None]


def _sig(slices: list[Slice], model: str, index: int) -> str:
    for s in slices:
        if s.model.spec.name == model:
            return s.model.shapes[index].signature
    return "?"


def _rest(s: Slice, done: set[tuple[str, int]]) -> Slice | None:
    idx = [i for i in s.indices if (s.model.spec.name, i) not in done]
    return _slice(s.model, idx) if idx else None


# Bytes of one event line from a worker; more is not ours (a model writing to the fd). The largest
# of ours is `imported`: the check of a bundle names each of its graphs (bundle.MAX_ARTIFACTS at
# most), about 0.5 KB for one that will hit and 6 KB for one that misses by another torch's options
# (each differing component listed, its values cut to 200 characters), and the keys the load wrote:
# 64 MiB holds 10,000 such misses or 100,000 hits. Parsed, a line takes several times its size in
# this process (a line of '{},' 27x): the bound is that process's memory, not the bundle's size (a
# larger check is refused: "the import worker reported nothing").
MAX_EVENT = 64 << 20


def _one_worker(
    job: dict, env: dict[str, str], timeout: float | None, on: Callable[[Event], None], workers: _Workers
) -> str | None:
    """Run one child to the end. None when it finished; else why it did not."""
    r, w = os.pipe()
    try:
        proc = procs.spawn(
            [sys.executable, "-m", "cachemgr.prewarm.worker"],
            env={**env, "CACHEMGR_WORKER_FD": str(w)},
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(w,),
        )
    finally:
        os.close(w)
    if not workers.add(proc):
        os.close(r)
        proc.wait()
        return "stopped"
    on(
        {
            "e": "worker_start",
            "device": job["device"],
            "pid": proc.pid,
            "phase": job["phase"],
            "models": len(job["models"]),
            "shapes": sum(1 for m in job["models"] for s in m["shapes"] if not s.get("lead_in")),
        }
    )
    stderr_tail: list[bytes] = []
    t_err = threading.Thread(target=_tail, args=(proc.stderr, stderr_tail), daemon=True)
    t_err.start()
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    buf = bytearray()  # the line being read, grown in place (bytes `+=` copied all of it per chunk)
    finished = False
    deadline = None
    try:
        with os.fdopen(r, "rb", buffering=0) as pipe:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([pipe], [], [], wait)
                if not ready:
                    procs.kill_group(proc)
                    proc.wait()
                    return f"timed out after {timeout:g} s (worker killed)"
                chunk = pipe.read(1 << 20)
                if not chunk:
                    break
                *ends, rest = chunk.split(b"\n")  # each of `ends` ends a line
                for end in ends:
                    buf += end
                    line, buf = buf, bytearray()
                    try:
                        ev = json.loads(line)
                        ev["e"]
                    except (ValueError, TypeError, KeyError, RecursionError):
                        continue  # not one of our events
                    if ev["e"] == "done":
                        finished = True
                    if ev["e"] in ("shape_start", "import_start", "export_start"):
                        deadline = time.monotonic() + timeout if timeout else None
                    elif ev["e"] in ("shape", "imported", "exported", "host_side"):
                        deadline = None
                    on(ev)
                buf += rest
                if len(buf) > MAX_EVENT:
                    buf = bytearray()
    finally:
        code = proc.wait()
        workers.discard(proc)
        t_err.join(timeout=5)
    if finished and code == 0:
        return None
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    tail = b"".join(stderr_tail).decode(errors="replace").strip().splitlines()
    return f"worker died ({how}){': ' + tail[-1][:300] if tail else ''}"


def _tail(stream, out: list[bytes]) -> None:
    while line := stream.readline(4096):  # bounded: a worker may write anything there
        out.append(line)
        del out[:-20]


# -- the child: torch lives here ---------------------------------------------------------------


def host_info() -> dict:
    import importlib
    import socket

    import torch

    try:
        # (by name: CPU wheels of torch come without Triton, so it has no stubs to check against)
        triton_version = importlib.import_module("triton").__version__
    except Exception:  # noqa: BLE001 - no Triton (CPU wheel) or a broken one: either way, none
        triton_version = None
    archs = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            archs.append(f"sm_{major}{minor}")
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "gpu_arch": sorted(set(archs)) or None,
        "cuda": torch.version.cuda,
        "host": socket.gethostname(),
    }


class _Out:
    def __init__(self, fd: int) -> None:
        self.f = os.fdopen(fd, "w", buffering=1)

    def __call__(self, **ev: Any) -> None:
        self.f.write(json.dumps(ev, default=str) + "\n")
        self.f.flush()


def child_main() -> None:
    import warnings

    # torch without NumPy warns so at import, in two lines of stderr: noise, which the CLI would
    # report as the cause when this worker dies (it names the last line of a dead worker's stderr)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if sys.argv[1:] == ["--probe"]:  # this torch's defaults, in the environment it was started with
        import torch

        from cachemgr.prewarm import adapters

        print(json.dumps({"lines": adapters.load(torch.__version__).components(torch, {})}))
        return
    procs.die_with_parent_from_env()  # the CLI killed (or gone before this line): so are we
    out = _Out(int(os.environ["CACHEMGR_WORKER_FD"]))
    job = json.loads(sys.stdin.read())
    import torch

    device = job["device"]
    adapter, fingerprint = _adapter(torch)
    counters = adapter.counters()
    out(
        e="worker_ready",
        pid=os.getpid(),
        device=device,
        phase=job["phase"],
        torch=torch.__version__,
        fingerprint=fingerprint,
    )
    unusable = _device_problem(torch, device)
    imp = job.get("import")
    if job.get("check") and not imp:
        out(e="host_side", **host_side(torch, adapter, fingerprint, job["check"]))
    if imp:
        out(e="import_start")
        out(e="imported", **_import_bundle(imp, torch, adapter, fingerprint, job.get("check") or {}))
    replay_models = job["models"]
    for m in replay_models:
        if unusable:
            name = m["spec"]["name"]
            out(e="model_error", model=name, error=f"model {name!r}: device {device!r}: {unusable}")
            continue
        _replay_model(m, device, job["phase"], out, torch, counters)
    if job.get("export"):
        out(e="export_start")
        out(
            e="exported",
            **_export(job["export"], [m["spec"]["name"] for m in replay_models], device, adapter, fingerprint),
        )
    out(e="done")


def _adapter(torch) -> tuple[Any, dict | None]:
    """The adapter for this torch (cachemgr.prewarm.adapters) and its fingerprint; (None, None)
    for a torch no adapter knows, or one whose private names moved."""
    from cachemgr.prewarm import adapters

    try:
        adapter = adapters.load(torch.__version__)
    except adapters.Unsupported:
        return None, None
    try:
        return adapter, adapter.fingerprint(torch)
    except Exception:  # noqa: BLE001 - a torch whose internals moved: no fingerprint, the rest still runs
        return adapter, None


MIRRORED_OPTIONS = ["cpp_wrapper", "fx_wrapper"]  # options compile_fx also passes as fx_kwargs


def host_side(torch, adapter, fingerprint: dict | None, spec: dict) -> dict:
    """This host's side of every hash component that does not depend on the graph, under its
    defaults and under each option set of `spec` (cachemgr.check.option_sets): the first set's
    debug lines in full, the others' as the lines that differ. With TORCHINDUCTOR_* variables
    set, also torch's defaults without them (a second process, `--probe`)."""
    from cachemgr.check import option_variables

    if adapter is None:
        raise RuntimeError(f"torch {torch.__version__}: cachemgr has no adapter for it")
    base = adapter.components(torch, {})
    have = set(base)
    configs = [
        {
            "label": "defaults",
            "options": {},
            "lines": base,
            "mirrors": adapter.config_values(torch, {}, MIRRORED_OPTIONS),
        }
    ]
    seen, errors = {"{}"}, []
    for s in spec.get("option_sets") or []:
        try:
            patch = dict(adapter.mode_options(torch, s.get("mode"), s.get("dynamic")))
            for k, v in (s.get("options") or {}).items():
                if not adapter.known_option(torch, k):
                    raise ValueError(f"{k!r} is not an Inductor option of torch {torch.__version__}")
                patch[k.replace("-", "_")] = v
            sig = json.dumps(patch, sort_keys=True, default=str)
            if sig in seen:
                continue
            seen.add(sig)
            lines = adapter.components(torch, patch)
            configs.append(
                {
                    "label": s["label"],
                    "options": patch,
                    "lines": [ln for ln in lines if ln not in have],
                    "mirrors": adapter.config_values(torch, patch, MIRRORED_OPTIONS),
                }
            )
        except Exception as e:  # noqa: BLE001 - one bad option set is that set's error
            errors.append(f"{s.get('label')}: {_first_line(e)}")
    env = option_variables(os.environ)
    pristine = None
    if env:
        clean = {k: v for k, v in os.environ.items() if k not in env and k != "CACHEMGR_WORKER_FD"}
        r = subprocess.run(
            [sys.executable, "-m", "cachemgr.prewarm.worker", "--probe"],
            env=clean,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if r.returncode == 0 and r.stdout.strip():
            pristine = [ln for ln in json.loads(r.stdout.strip().splitlines()[-1])["lines"] if ln not in have]
        else:
            errors.append(f"torch's own defaults (without {', '.join(sorted(env))}): the probe failed")
    info = host_info()
    return {
        "torch": torch.__version__,
        "fingerprint": fingerprint,
        "configs": configs,
        "pristine": pristine,
        "env": env,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "triton": info["triton"],
        "gpu_arch": info["gpu_arch"],
        "errors": errors,
    }


def _device_problem(torch, device: str) -> str | None:
    """Confirm with torch what cuda_problem judged without it; select the GPU when it is there."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return f"{NO_CUDA} (torch {torch.__version__} sees none: torch.cuda.is_available() is False)"
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        return f"this host has {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
    torch.cuda.set_device(torch.device(device))  # kernels build and launch on this GPU
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400]}" if text else type(e).__name__


def _reason(e: BaseException) -> str:
    """What went wrong, as the innermost exception of the chain says it: torch.compile wraps the
    real error (`a and b must have same reduction dim, but got [8, 3] X [16, 32]`) in a generic
    one (`RuntimeError when making fake tensor call`), keeping it as __cause__ or __context__."""
    inner, seen = e, {id(e)}
    while len(seen) < 50:
        nxt = inner.__cause__ or inner.__context__  # a suppressed context is still where it came from
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        inner = nxt
    if inner is e:
        return _first_line(e)
    outer = _first_line(e)
    return f"{_first_line(inner)} (raised as {outer[:200]})"


def _resolve_factory(factory: str):
    import importlib

    mod_name, _, attr = factory.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the model's error
        raise LookupError(f"cannot import module {mod_name!r}: {_first_line(e)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LookupError(f"module {mod_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise LookupError(f"{factory} is not callable")
    return obj


def _replay_model(m: dict, device: str, phase: str, out: _Out, torch, counters) -> None:
    spec, name = m["spec"], m["spec"]["name"]
    try:
        factory = _resolve_factory(spec["factory"])
    except LookupError as e:
        out(e="model_error", model=name, error=f"model {name!r}: field 'factory' {spec['factory']!r}: {e}")
        return
    try:
        obj = factory(**spec.get("factory_kwargs", {}))
        if isinstance(obj, torch.nn.Module):
            obj = obj.to(device)
            obj.train(spec["train"])
        compiled = torch.compile(obj, **m["compile"])
    except Exception as e:  # noqa: BLE001 - a model that raises does not stop the others
        out(
            e="model_error",
            model=name,
            error=f"model {name!r}: factory {spec['factory']} or torch.compile raised {_reason(e)}",
        )
        return
    out(e="model", model=name, device=device, phase=phase, shapes=sum(1 for s in m["shapes"] if not s.get("lead_in")))
    for s in m["shapes"]:
        base = {
            "model": name,
            "index": s["index"],
            "signature": s["signature"],
            "lead_in": bool(s.get("lead_in")),
            "worker": os.getpid(),
        }
        out(e="shape_start", **base)
        before = {c: counters[g][c] for g, c in COUNTERS}
        t0 = time.perf_counter()
        try:
            _call(torch, compiled, s["spec"], device, spec)
            seconds = time.perf_counter() - t0
            delta = {c: counters[g][c] - before[c] for g, c in COUNTERS}
            out(e="shape", device=device, phase=phase, ok=True, seconds=round(seconds, 4), counters=delta, **base)
        except Exception as e:  # noqa: BLE001 - one shape failing is that shape's result
            out(
                e="shape",
                device=device,
                phase=phase,
                ok=False,
                seconds=round(time.perf_counter() - t0, 4),
                error=_reason(e),
                **base,
            )


class InputsTooLarge(ValueError):
    """A shape whose inputs would take more than the model's max_input_bytes, or hold more
    elements than it has bytes: never allocated."""


def _call(torch, compiled, spec: dict, device: str, model: dict) -> None:
    cap = model.get("max_input_bytes") or MAX_INPUT_BYTES
    need, elements = input_size(torch, spec)
    if need > cap:
        raise InputsTooLarge(
            f"the inputs would take {format_size(need)}, over the model's max_input_bytes "
            f"({format_size(cap)}) for one replayed call: not built"
        )
    if elements > cap:  # (an element takes a byte at least: an input of more is a hostile shape, hours of work)
        raise InputsTooLarge(
            f"the inputs hold {elements:,} elements, more than the model's max_input_bytes "
            f"({format_size(cap)}) allows for one replayed call: not built"
        )
    args = [_build(torch, a, device) for a in spec["args"]]
    kwargs = {k: _build(torch, v, device) for k, v in spec["kwargs"].items()}
    grad = bool(spec.get("grad", True)) or model["train"]
    dev_type = torch.device(device).type
    autocast = torch.autocast(dev_type, dtype=getattr(torch, model["autocast"])) if model.get("autocast") else _null()
    with torch.set_grad_enabled(grad), autocast:
        result = compiled(*args, **kwargs)
        if model["train"]:
            loss = sum(t.float().sum() for t in _tensors(torch, result) if t.requires_grad)
            if isinstance(loss, torch.Tensor):
                loss.backward()
    if dev_type == "cuda":
        torch.cuda.synchronize(device)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _tensors(torch, obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(torch, o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(torch, o)


def input_size(torch, spec: dict) -> tuple[int, int]:
    """Bytes and elements the inputs of one call take once built, before any is: each tensor's
    storage as its shape and stride span it (a stride alone can make a small shape need a huge
    storage), and the elements its shape holds (a stride of 0 makes a huge shape take one
    element's storage, and the call then goes through every element)."""
    total = elements = 0
    stack = [*spec["args"], *spec["kwargs"].values()]
    while stack:
        s = stack.pop()
        t = s["t"]
        if t == "tensor":
            shape = s["shape"]
            stride = s.get("stride") or _contig(shape)
            if len(stride) != len(shape):
                raise ValueError(f"stride {stride} does not match shape {shape}")
            total += _span(shape, stride) * _dtype(torch, s["dtype"]).itemsize
            elements += math.prod(shape)
        elif t in ("tuple", "list"):
            stack.extend(s["items"])
        elif t == "dict":
            stack.extend(s["items"].values())
    return total, elements


def _span(shape: list[int], stride: list[int]) -> int:
    """Elements of the storage a tensor of this shape and stride takes."""
    if 0 in shape:
        return 0
    return 1 + sum((d - 1) * abs(st) for d, st in zip(shape, stride, strict=True))


def _dtype(torch, name: str):
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):  # a name from the index: only a dtype is taken from torch
        raise TypeError(f"unknown dtype {name!r}")
    return dtype


def _build(torch, s: dict, device: str):
    t = s["t"]
    if t == "tensor":
        dtype = _dtype(torch, s["dtype"])
        shape, stride = s["shape"], s.get("stride") or _contig(s["shape"])
        x = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        # Its storage is filled, not the tensor: the elements of an expanded input (a stride of 0,
        # as `arange(n).expand(b, n)` makes) share memory, which no in-place op writes through.
        storage = x.as_strided([_span(shape, stride)], [1])
        if dtype.is_floating_point or dtype.is_complex:
            storage.normal_()
        elif dtype == torch.bool:
            storage.zero_()
        else:
            storage.random_(0, 2)  # small ints: safe as indices and as counts
        if s.get("requires_grad"):
            x.requires_grad_(True)
        return x
    if t in ("tuple", "list"):
        items = [_build(torch, i, device) for i in s["items"]]
        return tuple(items) if t == "tuple" else items
    if t == "dict":
        return {k: _build(torch, v, device) for k, v in s["items"].items()}
    if t == "none":
        return None
    if t == "object":
        raise TypeError(f"cannot rebuild an argument of type {s['type']} (give explicit shapes in the manifest)")
    if t == "float" and isinstance(s["v"], str):  # nan, inf and -inf: JSON has no such numbers
        return float(s["v"])
    return s["v"]


def _contig(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    return list(reversed(stride))


def check_bundle(path: str, b, arts, torch, adapter, fingerprint: dict | None, spec: dict) -> dict:
    """The cache check of a bundle on this host (cachemgr.check): which of its graphs (`arts`: its
    payload's artifacts) will hit, and whether it holds all that its entries name."""
    from cachemgr import check
    from cachemgr.prewarm import bundle

    contents = bundle.read_contents(b.header, arts)
    host = check.Host.of(host_side(torch, adapter, fingerprint, spec), spec.get("devices"), bool(spec.get("complete")))
    report = check.check(bundle.graphs(contents), host, path)
    return {**report.as_dict(), "missing": bundle.completeness(contents, b.header.get("expects"))}


def _import_bundle(imp: dict, torch, adapter, fingerprint: dict | None, spec: dict) -> dict:
    """Check the bundle (`imp["path"]`) first; load it (torch.compiler.load_cache_artifacts,
    through the staging folder `imp["staging"]`) unless none of its graphs would hit here, or it
    is partial (and `allow_partial` is not set), or `check_only`. `written_graphs`: the fxgraph
    entries the load added (files that were not there before)."""
    from cachemgr import layout
    from cachemgr.prewarm import bundle

    path = imp["path"]
    try:
        b = bundle.read(path)
        arts = bundle.artifacts(b.payload, path)  # (read once: each artifact is a copy of its bytes)
        doc = check_bundle(path, b, arts, torch, adapter, fingerprint, spec)
        base = {"header": b.header, "check": doc}
        unsafe = bundle.unsafe_keys(arts)
        if unsafe:  # torch joins each key onto the cache directory: '../x' or '/x' would be written there
            more = f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
            return {**base, "ok": False, "error": f"bundle {path}: refusing to import it: {unsafe[0]}{more}"}
        if doc["graphs"] and not doc["hit"]:
            causes = "; ".join(s["text"] for s in doc["summary"])
            return {
                **base,
                "ok": False,
                "error": f"bundle {path}: none of its {doc['graphs']} graphs would hit here "
                f"({causes}): refusing to import it (export a bundle on a host with "
                "this image and GPU, or run `cachemgr prewarm` here)",
            }
        if doc["missing"] and not spec.get("allow_partial"):
            n = len(doc["missing"])
            return {
                **base,
                "ok": False,
                "error": f"bundle {path} is partial: {n} thing(s) its entries name are not "
                f"in it (first: {doc['missing'][0]}): refusing to import it "
                "(cachemgr import --allow-partial imports it anyway)",
            }
        if spec.get("check_only"):
            return {**base, "ok": True, "loaded": False}
        root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        graphs = (layout.fxgraph_entry_key(key, content) for key, content in arts.get("inductor", []))
        fresh = [k for k in graphs if not os.path.lexists(os.path.join(root, k))]  # what the load writes
        info, refused = load_staged(torch, b.payload, root, imp["staging"])
        if info is None:
            return {**base, "ok": False, "error": f"bundle {path}: torch could not read its artifacts"}
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            return {
                **base,
                "ok": False,
                "error": f"cache directory {root}: {refused[0]}{more}: not moved in (the rest of the bundle was)",
            }
        artifacts = {k: len(v) for k, v in info.artifacts.items()}
        return {**base, "ok": True, "loaded": True, "artifacts": artifacts, "written_graphs": fresh}
    except Exception as e:  # noqa: BLE001 - reported to the parent as the import's failure
        return {"ok": False, "error": str(e) if hasattr(e, "exit_code") else _first_line(e)}


def load_staged(torch, payload: bytes, root: str, name: str | None = None) -> tuple[Any, list[str]]:
    """torch.compiler.load_cache_artifacts into a folder of the cache's own, then each file it
    wrote moved into place under `root` through its descriptors: torch follows any symlink on its
    way, and one made in the cache after the command's check took entries out of it; a move
    follows none (a file whose way holds one stays out, and is named). The folder is
    tempfile-named (`staging_name`), as Inductor's own temporary folders are: scans and eviction
    leave it be; `name` is given where another process removes it should this one be killed.
    Returns torch's answer and what was not moved in, and why."""
    from cachemgr import layout, safefs

    _remove_dead_stagings(root)
    name = name or staging_name()
    staging = os.path.join(root, name)
    os.mkdir(staging, 0o700)  # (as tempfile makes it)
    try:
        open(os.path.join(staging, STAGING_MARK), "x").close()
        before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = staging  # (torch reads it on every write)
        try:
            info = torch.compiler.load_cache_artifacts(payload)
        finally:
            if before is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        refused: list[str] = []
        with safefs.Root(root) as into, safefs.Root(staging) as made:
            for folder, _, names in os.walk(staging):
                rel_folder = "" if folder == staging else os.path.relpath(folder, staging)
                if rel_folder.split("/")[0] == layout.LOCKS_DIR:
                    continue  # (torch's locks of the load: its own)
                rels = [f"{rel_folder}/{n}" if rel_folder else n for n in names if not layout.is_transient(n)]
                rels = [rel for rel in rels if stat.S_ISREG(made.lstat(rel).st_mode)]
                try:
                    src, dst = made.dir_fd(rel_folder), _made_dir(into, rel_folder)
                except OSError as e:  # (its way into the cache holds a symlink, a file: none of them goes)
                    refused.extend(f"{layout.key_of(rel)}: {e.strerror or e}" for rel in rels)
                    continue
                for rel in rels:
                    leaf = rel.rpartition("/")[2]
                    try:
                        os.rename(leaf, leaf, src_dir_fd=src, dst_dir_fd=dst)
                    except OSError as e:
                        refused.append(f"{layout.key_of(rel)}: {e.strerror or e}")
        return info, refused
    finally:
        _remove_staging(root, name)


STAGING_MARK = ".cachemgr-import"  # in the folder a bundle is loaded into (a dotfile: never moved in)
STAGING_DEAD = 6 * 3600  # seconds after which such a folder is an import's that was killed


def staging_name() -> str:
    """A name for the folder an import loads a bundle into, as tempfile names its folders
    (layout.TEMP_NAME), and as hard to guess."""
    import secrets
    import string

    return "tmp" + "".join(secrets.choice(string.ascii_lowercase + string.digits + "_") for _ in range(8))


def _remove_dead_stagings(root: str) -> None:
    """Remove the folders killed imports left (eviction keeps every tempfile-named folder, as
    Inductor's): those that hold STAGING_MARK, made over STAGING_DEAD seconds ago. One with a
    mount point inside it stays whole (docs/safety.md: nothing at, below or above one goes)."""
    from cachemgr import layout, safefs

    try:
        r = safefs.Root(root)
    except OSError:
        return
    with r:
        try:
            names = [n for n in r.listdir("") if layout.TEMP_FOLDER.fullmatch(n)]
        except OSError:
            return
        mounts = safefs.mounts_below(r)
        for name in names:
            if safefs.at_or_above_a_mount(name, mounts):
                continue
            try:
                st = r.lstat(f"{name}/{STAGING_MARK}")  # (its folder reached without following a symlink)
            except OSError:
                continue  # (not ours)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > STAGING_DEAD:
                safefs.remove_tree(r.fd, name, r.mount)


def _remove_staging(root: str, name: str) -> None:
    """Remove folder `name` of cache directory `root` through descriptors (safefs.remove_tree), if
    it holds STAGING_MARK (a folder of that name the worker did not make, or made anew by another
    after the worker removed its own, is not ours): a mount made inside it meanwhile stays, and so
    does what is above it."""
    from cachemgr import safefs

    with contextlib.suppress(OSError), safefs.Root(root) as r:
        if stat.S_ISREG(r.lstat(f"{name}/{STAGING_MARK}").st_mode):
            safefs.remove_tree(r.fd, name, r.mount)


def _remove_leftovers(root: str | None, imp: dict | None, export: dict | None) -> None:
    """Remove what an import or export was writing through (its staging folder, the bundle's
    temporary file), where its worker was killed before it removed or renamed it. Called once
    the workers are gone."""
    if imp and root:
        _remove_staging(root, imp["staging"])
    if export:
        with contextlib.suppress(OSError):
            os.unlink(export["tmp"])


def _made_dir(root, rel: str) -> int:
    """The descriptor of folder `rel` below `root` (a safefs.Root), each missing part made first;
    OSError where a part is not a real folder (a symlink: ELOOP)."""
    if not rel:
        return root.fd
    parts = rel.split("/")
    for i in range(len(parts)):
        here = "/".join(parts[: i + 1])
        try:
            os.mkdir(parts[i], dir_fd=root.dir_fd("/".join(parts[:i])))
        except FileExistsError:
            pass
        root.dir_fd(here)  # (O_NOFOLLOW: refuses a symlink, a file)
    return root.dir_fd(rel)


def _export(export: dict, models: list[str], device: str, adapter, fingerprint: dict | None) -> dict:
    """Write a bundle: the artifacts this process's replays produced or hit, or (no models) the
    whole local cache's fxgraph / aotautograd / autotune entries handed to torch's manager. Its
    header says whether it is complete (bundle.completeness)."""
    import torch

    from cachemgr.prewarm import bundle

    skipped: list[str] = []  # cache files import would refuse (a name not UTF-8, a .best_config in the trash)
    try:
        if not models:
            if adapter is None:
                raise RuntimeError(f"torch {torch.__version__}: cachemgr has no adapter for it")
            adapter.record_artifacts(bundle.exportable(_disk_artifacts(export["cache_dir"]), skipped))
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return {"ok": False, "error": "nothing to export: no cache artifacts were produced or found"}
        payload, info = saved
        contents = bundle.read_contents({}, bundle.artifacts(payload))
        expects = {"autotune": bundle.expected_autotune(export["cache_dir"], contents.kernel_hashes())}
        missing = bundle.completeness(contents, expects)
        host = host_info()
        cpu_only = bool(models) and not device.startswith("cuda")  # replayed on CPU: no GPU entries
        header = {
            **host,
            "format": 1,
            "created": time.time(),
            "models": models or None,
            "gpu_arch": None if cpu_only else host["gpu_arch"],
            "fingerprint": fingerprint,
            "artifacts": {k: len(v) for k, v in info.artifacts.items()},
            "expects": expects,
            "complete": not missing,
            "missing": missing[:100],
        }
        written = bundle.write(export["out"], header, payload, export["tmp"])
        out = {"ok": True, "header": written, "out": export["out"]}
        return {**out, "skipped": skipped[:20], "skipped_count": len(skipped)}
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": _first_line(e)}


MAX_ENTRY = 1 << 30  # bytes: a bigger file under fxgraph/ or aotautograd/ is no entry torch wrote


def _read_regular(path: str, limit: int = MAX_ENTRY) -> bytes | None:
    """A cache file's bytes, or None for anything that is not a regular file of sane size (a
    symlink, a FIFO, a device): opened without following links and without blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def _disk_artifacts(root: str):
    """(kind, key, content) of the cache's fxgraph, aotautograd and autotune entries, as torch's
    mega-cache records them."""
    for kind, typ in (("fxgraph", "inductor"), ("aotautograd", "aot_autograd")):
        base = os.path.join(root, kind)
        if os.path.islink(base):  # never read outside the cache
            continue
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if f.startswith(".") or ".tmp" in f:
                    continue
                data = _read_regular(os.path.join(dirpath, f))
                if data is not None:
                    yield typ, os.path.basename(dirpath), data
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(".best_config"):
                p = os.path.join(dirpath, f)
                data = _read_regular(p, 1 << 20)
                try:
                    config = json.loads(data) if data is not None else None
                except (ValueError, RecursionError):
                    config = None
                if isinstance(config, dict):
                    yield "autotune", os.path.relpath(p, root), config


if __name__ == "__main__":
    child_main()
