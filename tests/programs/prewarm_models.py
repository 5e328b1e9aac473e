"""Small real models for prewarm manifests, and the workload that records them.

Factories (for `factory = "prewarm_models:NAME"`): `mlp` (an nn.Module, trained: forward and
backward), `scorer` (an nn.Module called forward-only with grad enabled: never a backward),
`gelu_head` (a plain function, inference), `broken` (raises), `picky` (raises on one input
shape), `sleepy` (hangs on one). Run as a program it is the workload: it compiles them with
cachemgr.record over several batch sizes and prints the cache counters as one JSON line.

    TORCHINDUCTOR_CACHE_DIR=DIR CACHEMGR_SPOOL_DIR=SPOOL python prewarm_models.py [--batches 4,8,16]
"""

import argparse
import json

import torch


class MLP(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(width, 32)
        self.l2 = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def mlp(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(width)


class Scorer(torch.nn.Module):  # its own forward: dynamo's recompiles of MLP.forward stay the mlp's own
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.l1(x))


def scorer() -> torch.nn.Module:
    torch.manual_seed(0)
    return Scorer()


def _gelu_head(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * scale + x.mean(dim=-1, keepdim=True)


def gelu_head():
    return _gelu_head


def broken():
    raise RuntimeError("this factory is broken on purpose")


def _picky(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 3:
        raise ValueError("picky refuses batch 3")
    return x.cos() + 1


def picky():
    return _picky


def _sleepy(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 2:
        import time

        time.sleep(600)  # hangs: prewarm --timeout must kill it and go on
    return x + 1


def sleepy():
    return _sleepy


def main() -> None:
    from cache_counters import cache_counters

    import cachemgr.record

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="4,8,16")
    args = ap.parse_args()
    model = cachemgr.record.compile(mlp(), name="mlp")
    head = cachemgr.record.compile(gelu_head(), name="head", dynamic=False)
    score = cachemgr.record.compile(scorer(), name="scorer")  # forward only, grad enabled: never a backward
    checksum = 0.0
    for i, b in enumerate(int(x) for x in args.batches.split(",")):
        x = torch.randn(b, 16)
        if i == 0:
            checksum += float(score(torch.randn(b, 8)).sum())
        loss = model(x).square().mean()
        loss.backward()
        checksum += float(loss.detach())
        with torch.no_grad():
            checksum += float(head(torch.randn(b, 8), 0.5).sum())
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
