"""Workloads whose cache outcome `cachemgr check` predicts (tests/test_check.py). Each runs in a
fresh process and prints one JSON line: the cache counters of torch._dynamo.utils.counters.
Run it with TORCH_TRACE=DIR to see, per graph, which key hit and which missed.

    TORCHINDUCTOR_CACHE_DIR=DIR python check_workload.py mlp [--scaled-options '{"epilogue_fusion": false}']
    TORCHINDUCTOR_CACHE_DIR=DIR python check_workload.py gpu-triton --device cpu

`mlp`: a training step of compile_models.py's MLP (batch 4, then 8: a static then a dynamic
graph), its inference function, and `scaled` compiled with the options given (default:
epilogue_fusion off).
`gpu-triton`: the Triton-heavy workload of tests/fixtures/gpu/make_gpu_cache.py, on `--device`
(a CPU host runs the GPU fixture's graphs on the CPU: the nearest it can come to them).
"""

import argparse
import json
import os
import sys

import torch
from cache_counters import cache_counters
from compile_models import MLP, infer, scaled


def mlp_workload(scaled_options: dict) -> None:
    torch.manual_seed(0)
    model = MLP()
    step = torch.compile(model)
    for b in (4, 8):
        step(torch.randn(b, 32)).square().mean().backward()
    with torch.no_grad():
        torch.compile(infer)(torch.randn(10))
        torch.compile(scaled, options=scaled_options)(torch.randn(6, 5))


def gpu_triton_workload(device: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "gpu"))
    import make_gpu_cache as gpu

    gpu.DEV = device
    if not device.startswith("cuda"):
        gpu.torch.cuda.synchronize = lambda *a, **k: None  # the workload ends with a GPU sync
    gpu.triton_workload()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=["mlp", "gpu-triton"])
    ap.add_argument("--scaled-options", default='{"epilogue_fusion": false}')
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.workload == "mlp":
        mlp_workload(json.loads(args.scaled_options))
    else:
        gpu_triton_workload(args.device)
    print(json.dumps({**cache_counters(), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
