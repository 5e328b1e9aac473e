"""Overhead of cachemgr.record on a call whose signature was already seen, against a bare call
of the same compiled model, measured in the same run (interleaved rounds, best of each).

    PYTHONPATH=. python bench/record.py [--quick] [--calls 20000] [--rounds 7]

Target (issue 5): under 5 µs per call.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch

import cachemgr.record as record


def per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="eager backend, fewer calls: a smoke run")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="also write the figures as JSON here")
    a = ap.parse_args()
    calls, backend = (2000, "eager") if a.quick else (a.calls, "inductor")
    torch.manual_seed(0)
    spool = record.Spool(tempfile.mkdtemp(prefix="cachemgr-bench-spool-"))
    lin = torch.nn.Linear(32, 8)
    bare = torch.compile(lin, backend=backend)
    rec = record.compile(lin, name="bench", backend=backend, spool=spool)
    x, y = torch.randn(8, 32), torch.randn(4, 8)
    f = record.compile(lambda u, v, k=1: (u.sum() + v.sum()) * k, name="fn", backend=backend, spool=spool)
    bare_f = torch.compile(lambda u, v, k=1: (u.sum() + v.sum()) * k, backend=backend)
    observe = rec._cachemgr_recorder.observe
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
    doc = {
        "backend": backend, "calls": calls, "rounds": a.rounds, "best_us": best, "median_us": med,
        "module_overhead_us": best["recorded"] - best["bare"], "function_overhead_us": best["recorded_fn"] - best["bare_fn"],
        "signature_check_us": best["observe"], "target_us": 5.0,
    }
    print(f"{'call':<28}{'best µs':>10}{'median µs':>12}")
    for k in figures:
        print(f"{k:<28}{best[k]:>10.2f}{med[k]:>12.2f}")
    print(f"overhead of a seen signature: module {doc['module_overhead_us']:.2f} µs/call "
          f"({best['recorded'] / best['bare']:.3f}x bare), function {doc['function_overhead_us']:.2f} µs/call "
          f"({best['recorded_fn'] / best['bare_fn']:.3f}x bare); signature check alone {best['observe']:.2f} µs "
          f"(target < 5 µs)")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=2)


if __name__ == "__main__":
    main()
