"""First-call times of a resnet18-size model over three recorded shapes, each in a fresh process:
a cold cache, a cache prewarmed by `cachemgr prewarm`, a cache filled by `cachemgr import`, and
a warm cache, as ratios to warm, with the cache misses each saw.

    PYTHONPATH=. python bench/prewarm.py --quick                 # CPU smoke run (small images)
    PYTHONPATH=. python bench/prewarm.py --device cuda:0 --out prewarm.json
    PYTHONPATH=. python bench/prewarm.py --devices cuda:0,cuda:1 # issue 8: 1 vs 2 GPUs, >= 8 shapes

Needs only torch, click and cachemgr's pure-Python dependencies. The model is resnet18's
topology built by hand (no torchvision); inference under no_grad (bf16 autocast on CUDA), compiled
with dynamic=False so every batch size is its own compile. Target (issue 5): prewarmed and
imported within 1.2x of warm, zero misses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# -- the model (imported by the worker as factory "prewarm:resnet18") --------------------------


def resnet18(width: int = 64, classes: int = 1000):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            idt = x if self.down is None else self.down(x)
            y = torch.relu(self.b1(self.c1(x)))
            return torch.relu(self.b2(self.c2(y)) + idt)

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = width
            self.stem = nn.Sequential(
                nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
            chans, layers, cin = [w, 2 * w, 4 * w, 8 * w], [], w
            for i, c in enumerate(chans):
                layers += [Block(cin, c, 1 if i == 0 else 2), Block(c, c, 1)]
                cin = c
            self.layers = nn.Sequential(*layers)
            self.fc = nn.Linear(cin, classes)

        def forward(self, x):
            x = self.layers(self.stem(x))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    return ResNet18().eval()


# -- the workload (a fresh process per measurement) ---------------------------------------------


def workload(a) -> None:
    import torch
    from torch._dynamo.utils import counters

    import cachemgr.record

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = resnet18(a.width).to(device)
    compiled = cachemgr.record.compile(model, name="resnet18", dynamic=False)
    times = []
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else _Null()
    with torch.no_grad(), autocast:
        for b in (int(x) for x in a.batches.split(",")):
            x = torch.randn(b, 3, a.image, a.image, device=device)
            t = time.perf_counter()
            compiled(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "first_calls_s": sum(times),
                "per_shape_s": times,
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
                "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
            }
        )
    )


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# -- the driver ---------------------------------------------------------------------------------


def env_for(cache: Path | None, spool: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "CACHEMGR_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(HERE), env.get("PYTHONPATH")) if p)
    env["CACHEMGR_SPOOL_DIR"] = str(spool)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return env


def run_workload(a, cache: Path, spool: Path, device: str | None = None, batches: str | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--workload",
        "--device",
        device or a.device,
        "--width",
        str(a.width),
        "--image",
        str(a.image),
        "--batches",
        batches or a.batches,
    ]
    out = subprocess.run(cmd, env=env_for(cache, spool), capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"workload failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cachemgr(a, work: Path, cache: Path, *args: str, ok=(0,)) -> tuple[float, dict | None]:
    cmd = [sys.executable, "-m", "cachemgr", "--cache-dir", str(cache), "--db", f"sqlite:///{work / 'idx.db'}", *args]
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env_for(None, work / "spool"), capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - t
    if out.returncode not in ok:
        sys.exit(f"{' '.join(args[:1])} failed (exit {out.returncode}):\n{out.stderr[-3000:]}\n{out.stdout[-2000:]}")
    try:
        return wall, json.loads(out.stdout)
    except ValueError:
        return wall, None


def write_manifest(work: Path, a, device: str) -> Path:
    p = work / "manifest.toml"
    p.write_text(f"""[[model]]
name = "resnet18"
factory = "prewarm:resnet18"
factory_kwargs = {{ width = {a.width} }}
compile = {{ dynamic = false }}
device = "{device.split(":")[0]}"
{'autocast = "bfloat16"' if device.startswith("cuda") else ""}
shapes = "recorded"
""")
    return p


def misses(r: dict) -> int:
    return r["fxgraph_cache_miss"] + r["autograd_cache_miss"]


def repeated(a, cache: Path) -> dict:
    """The workload `a.repeat` times on one cache: the median first-call time (fresh processes
    on the same warm cache vary by 10-20 % run to run), the misses of the first run."""
    runs = [run_workload(a, cache, cache.parent / "spool-x") for _ in range(a.repeat)]
    first = dict(runs[0])
    first["first_calls_s"] = statistics.median(r["first_calls_s"] for r in runs)
    first["runs_s"] = [round(r["first_calls_s"], 2) for r in runs]
    return first


def single(a, work: Path) -> dict:
    m = write_manifest(work, a, a.device)
    cold = run_workload(a, work / "cold", work / "spool")  # also records the three shapes
    warm = repeated(a, work / "cold")
    pre_s, pre_doc = cachemgr(
        a, work, work / "prewarmed", "prewarm", "--manifest", str(m), "--devices", a.device, "--json"
    )
    prewarmed = repeated(a, work / "prewarmed")
    exp_s, _ = cachemgr(a, work, work / "cold", "export", "--out", str(work / "cache.bundle"), "--json")
    imp_s, imp_doc = cachemgr(a, work, work / "imported", "import", str(work / "cache.bundle"), "--json")
    imported = repeated(a, work / "imported")
    rows = {"cold": cold, "prewarmed": prewarmed, "imported": imported, "warm": warm}
    w = warm["first_calls_s"]
    print(
        f"resnet18 (width {a.width}, {a.image}x{a.image}) on {a.device}, batches {a.batches}; "
        f"first calls of the three shapes, fresh process each (median of {a.repeat} for the warm kinds)"
    )
    print(f"{'cache':<12}{'first calls s':>14}{'x warm':>8}{'fx miss':>9}{'aot miss':>10}")
    for k, r in rows.items():
        print(
            f"{k:<12}{r['first_calls_s']:>14.2f}{r['first_calls_s'] / w:>8.2f}{r['fxgraph_cache_miss']:>9}"
            f"{r['autograd_cache_miss']:>10}  {' '.join(map(str, r.get('runs_s', [])))}"
        )
    size = (work / "cache.bundle").stat().st_size
    print(
        f"prewarm took {pre_s:.1f} s ({len([s for s in pre_doc['shapes'] if s['ok']])} shapes); export {exp_s:.1f} s; "
        f"import {imp_s:.1f} s; bundle {size / 1e6:.1f} MB"
    )
    ok = all(misses(rows[k]) == 0 for k in ("prewarmed", "imported", "warm"))
    print(
        f"target: prewarmed {rows['prewarmed']['first_calls_s'] / w:.2f}x and imported "
        f"{rows['imported']['first_calls_s'] / w:.2f}x of warm (<= 1.2x), misses {'zero' if ok else 'NOT zero'}"
    )
    return {
        "scenarios": rows,
        "ratios": {k: r["first_calls_s"] / w for k, r in rows.items()},
        "prewarm_s": pre_s,
        "export_s": exp_s,
        "import_s": imp_s,
        "bundle_bytes": size,
        "config": vars(a),
    }


def multi(a, work: Path, devices: list[str]) -> dict:
    """Issue 8: prewarm the same >= 8-shape manifest with one GPU and with all, then check each GPU."""
    batches = a.batches
    m = write_manifest(work, a, devices[0])
    cold = run_workload(a, work / "cold", work / "spool", device=devices[0], batches=batches)
    out: dict = {"batches": batches, "cold_first_calls_s": cold["first_calls_s"], "runs": {}}
    print(
        f"resnet18 (width {a.width}, {a.image}x{a.image}), {len(batches.split(','))} shapes {batches}; "
        f"cold workload on {devices[0]}: {cold['first_calls_s']:.1f} s"
    )
    print(f"{'prewarm with':<34}{'wall s':>8}  fresh-process check per GPU (first calls s / misses)")
    for label, devs, extra in (
        (f"1 GPU ({devices[0]})", devices[:1], []),
        (f"{len(devices)} GPUs, shapes shared", devices, []),
        (f"{len(devices)} GPUs, --replicate", devices, ["--replicate"]),
    ):
        cache = work / f"pw-{len(devs)}-{'r' if extra else 's'}"
        wall, doc = cachemgr(
            a, work, cache, "prewarm", "--manifest", str(m), "--devices", ",".join(devs), *extra, "--json", ok=(0, 8)
        )
        checks = {d: run_workload(a, cache, work / "spool-x", device=d, batches=batches) for d in devices}
        out["runs"][label] = {"wall_s": wall, "failures": doc and doc.get("failures"), "checks": checks}
        print(
            f"{label:<34}{wall:>8.1f}  "
            + "  ".join(f"{d}: {c['first_calls_s']:.1f} s / {misses(c)}" for d, c in checks.items())
        )
    one, shared = (out["runs"][k]["wall_s"] for k in list(out["runs"])[:2])
    print(
        f"speed-up of sharing the shapes over {len(devices)} GPUs: {one / shared:.2f}x "
        "(Inductor keys embed the device index: a GPU misses the shapes compiled on the other)"
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--devices", help="issue 8 mode: e.g. cuda:0,cuda:1")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: narrow model, small images")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32; --quick 1,2,4; --devices 8 sizes)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh-process runs per warm cache (median)")
    ap.add_argument("--work", help="keep the caches here (default: a temporary directory)")
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    if a.workload:
        workload(a)  # the driver always passes --batches
        return
    if a.quick:
        a.width, a.image = 8, 32
    if a.batches is None:
        a.batches = (
            ("1,2,3,4,5,6,7,8" if a.quick else "1,2,4,8,12,16,24,32")
            if a.devices
            else ("1,2,4" if a.quick else "1,8,32")
        )
    work = Path(a.work or tempfile.mkdtemp(prefix="cachemgr-bench-prewarm-"))
    work.mkdir(parents=True, exist_ok=True)
    doc = multi(a, work, a.devices.split(",")) if a.devices else single(a, work)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
