"""A torch.compile loop for the eviction race test: fresh shapes and repeats, a fresh dynamo each
iteration so every repeat goes back to the on-disk cache (AOT entry, fxgraph entry, module).

    TORCHINDUCTOR_CACHE_DIR=DIR python compile_loop.py --steps main:3,main:4,main:3,other:3 [--wait]

Checks every result (forward and gradient) against eager and prints one JSON line of counters.
With --wait it reads one line from stdin before the loop, so a test can line up its evictor.
"""

import argparse
import json
import sys

import torch
from cache_counters import cache_counters


def main_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sin().sum()


def other_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) * 3).cos().sum()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="main:3,main:4,main:3", help="function:batch, ...")
    ap.add_argument("--wait", action="store_true")
    args = ap.parse_args()
    fns = {"main": main_fn, "other": other_fn}
    if args.wait:
        print("ready", flush=True)
        sys.stdin.readline()
    torch.manual_seed(0)
    done = 0
    for step in args.steps.split(","):
        name, n = step.split(":")
        fn, n = fns[name], int(n)
        torch._dynamo.reset()
        x = torch.randn(n, 8)
        w = torch.randn(8, 4, requires_grad=True)
        y = torch.compile(fn, dynamic=False)(x, w)
        y.backward()
        g = w.grad.clone()
        w.grad = None
        ref = fn(x, w)
        ref.backward()
        assert torch.allclose(y, ref, atol=1e-4), (n, y, ref)
        assert torch.allclose(g, w.grad, atol=1e-4), n
        done += 1
    print(
        json.dumps(
            {
                "iterations": done,
                **cache_counters(),
            }
        )
    )


if __name__ == "__main__":
    main()
