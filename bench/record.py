"""Overhead of cachemgr.record on a call whose signature was already seen, against a bare call
of the same compiled model, measured in the same run. Bare and recorded calls alternate in short
chunks (--calls each, --rounds pairs), so drift and noise hit both alike; the overhead is the
median over pairs of (recorded - bare) per call. The best and median of each are printed too.

    python bench/record.py [--quick] [--calls 200] [--rounds 300]

Target (issue 17): under 5 µs per call, median of repeats.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cachemgr.record as record


def per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="eager backend, fewer calls: a smoke run")
    ap.add_argument("--calls", type=int, default=200, help="calls per chunk")
    ap.add_argument("--rounds", type=int, default=300, help="pairs of chunks")
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    calls, backend = (a.calls, "eager") if a.quick else (a.calls, "inductor")
    torch.manual_seed(0)
    spool = record.Spool(tempfile.mkdtemp(prefix="cachemgr-bench-spool-"))
    lin = torch.nn.Linear(32, 8)
    bare = torch.compile(lin, backend=backend)
    rec = record.compile(lin, name="bench", backend=backend, spool=spool)
    x, y = torch.randn(8, 32), torch.randn(4, 8)
    f = record.compile(lambda u, v, k=1: (u.sum() + v.sum()) * k, name="fn", backend=backend, spool=spool)
    bare_f = torch.compile(lambda u, v, k=1: (u.sum() + v.sum()) * k, backend=backend)
    observe = vars(rec)["_cachemgr_recorder"].observe
    figures: dict[str, list[float]] = {k: [] for k in ("bare", "recorded", "bare_fn", "recorded_fn", "observe")}
    with torch.no_grad():
        for fn in (lambda: bare(x), lambda: rec(x), lambda: bare_f(x, y, k=2), lambda: f(x, y, k=2)):
            fn(), fn()  # compile and settle
        for _ in range(a.rounds):
            figures["bare"].append(per_call(lambda: bare(x), calls))
            figures["recorded"].append(per_call(lambda: rec(x), calls))
            figures["bare_fn"].append(per_call(lambda: bare_f(x, y, k=2), calls))
            figures["recorded_fn"].append(per_call(lambda: f(x, y, k=2), calls))
            figures["observe"].append(per_call(lambda: observe((x,), {}), calls))
    best = {k: min(v) for k, v in figures.items()}
    med = {k: statistics.median(v) for k, v in figures.items()}

    def overhead(rec_key: str, bare_key: str) -> float:  # per round, recorded against its own bare round
        return statistics.median(r - b for r, b in zip(figures[rec_key], figures[bare_key], strict=True))

    doc = {
        "backend": backend,
        "calls": calls,
        "rounds": a.rounds,
        "best_us": best,
        "median_us": med,
        "module_overhead_us": overhead("recorded", "bare"),
        "function_overhead_us": overhead("recorded_fn", "bare_fn"),
        "signature_check_us": med["observe"],
        "target_us": 5.0,
    }
    print(f"{'call':<28}{'best µs':>10}{'median µs':>12}")
    for k in figures:
        print(f"{k:<28}{best[k]:>10.2f}{med[k]:>12.2f}")
    print(
        f"overhead of a seen signature, median of {a.rounds} rounds: module {doc['module_overhead_us']:.2f} µs/call "
        f"({med['recorded'] / med['bare']:.3f}x bare), function {doc['function_overhead_us']:.2f} µs/call "
        f"({med['recorded_fn'] / med['bare_fn']:.3f}x bare); signature check alone {med['observe']:.2f} µs "
        f"(target < 5 µs)"
    )
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
