"""A real workload for the tests: torch.compile on CPU writes a real Inductor cache.

A training step of an MLP over several batch sizes (dynamic batch), an inference function, and
one compiled with custom `options=`. Prints the cache counters and a checksum of the outputs as
one JSON line, so a test can tell hits from misses and right results from wrong ones.

    TORCHINDUCTOR_CACHE_DIR=DIR python compile_models.py [--batches 4,8,16] [--only mlp|infer|options]
"""

import argparse
import json

import torch
from cache_counters import cache_counters


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(32, 64)
        self.l2 = torch.nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def infer(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() + 1).cos() * 2


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 3 + x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,8,16")
    ap.add_argument("--only", choices=["mlp", "infer", "options"])
    args = ap.parse_args()
    torch.manual_seed(0)
    checksum = 0.0
    if args.only in (None, "mlp"):
        model = MLP()
        step = torch.compile(model)
        for b in (int(x) for x in args.batches.split(",")):
            x = torch.randn(b, 32)
            loss = step(x).square().mean()
            loss.backward()
            expected = model(x).square().mean()
            assert torch.allclose(loss, expected, atol=1e-5), (loss, expected)
            checksum += float(loss)
    with torch.no_grad():
        if args.only in (None, "infer"):
            x = torch.randn(10)
            y = torch.compile(infer)(x)
            assert torch.allclose(y, infer(x), atol=1e-5)
            checksum += float(y.sum())
        if args.only in (None, "options"):
            x = torch.randn(6, 5)
            y = torch.compile(scaled, options={"epilogue_fusion": False, "max_autotune": False})(x)
            assert torch.allclose(y, scaled(x), atol=1e-5)
            checksum += float(y.sum())
    print(
        json.dumps(
            {
                **cache_counters(),
                "checksum": checksum,
            }
        )
    )


if __name__ == "__main__":
    main()
