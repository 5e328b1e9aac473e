"""Compile one small function in one variant, so a test can explain the miss between variants.

Each variant changes exactly one thing against `base`:

    base     f(x), x float32 (8, 16) contiguous, default options
    option   the same with options={"epilogue_fusion": False}   -> inductor_config[epilogue_fusion]
    dtype    x float64                                          -> example_inputs[0] dtype
    stride   x non-contiguous (a transposed (16, 8))            -> example_inputs[0] stride
    code     the function body changed                          -> gm (the graph code)

    TORCHINDUCTOR_CACHE_DIR=DIR python explain_variants.py VARIANT [--train]
    TORCHINDUCTOR_CACHE_DIR=DIR python explain_variants.py --each base option train-base ...

Run each variant in a fresh process. Prints the cache counters as one JSON line.

--each VARIANT...: each variant (train-VARIANT: with --train) in a fresh process of its own, in
order, a pause between (distinct mtimes: the compile order is the order of the entries), one JSON
line each. The processes are forked from this one once it has done what every such process does
first and compiles nothing: `import torch`, and the hash of torch's sources that every FX graph
key includes (torch_key(), seconds of reading files). Nothing of Dynamo, AOTAutograd or Inductor
has run in it, so each child compiles as a fresh process does, into the same files.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
from torch._dynamo.utils import counters


def f(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() + 1).cos() * 2


def f_changed(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() + 1).tanh() * 2


VARIANTS = ("base", "option", "dtype", "stride", "code")


def compile_variant(variant: str, train: bool, name: str | None = None) -> None:
    torch.manual_seed(0)
    fn, options = f, None
    x = torch.randn(8, 16)
    if variant == "option":
        options = {"epilogue_fusion": False}
    elif variant == "dtype":
        x = x.double()
    elif variant == "stride":
        x = torch.randn(16, 8).t()
        assert not x.is_contiguous()
    elif variant == "code":
        fn = f_changed
    compiled = torch.compile(fn, options=options)
    if train:
        x.requires_grad_(True)
        compiled(x).sum().backward()
    else:
        with torch.no_grad():
            assert torch.allclose(compiled(x), fn(x), atol=1e-5)
    print(
        json.dumps(
            {
                "variant": name or variant,
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            }
        ),
        flush=True,
    )


def each(names: list[str]) -> int:
    from torch._inductor.codecache import torch_key

    torch_key()
    for i, name in enumerate(names):
        if i:
            time.sleep(0.05)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                compile_variant(name.removeprefix("train-"), name.startswith("train-"), name)
            except BaseException:  # noqa: BLE001 - printed: the child ends here, not in the parent's loop
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            print(f"variant {name}: exit {os.waitstatus_to_exitcode(status)}", file=sys.stderr)
            return 1
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", nargs="?", choices=VARIANTS)
    ap.add_argument("--train", action="store_true", help="also compile a backward graph")
    ap.add_argument("--each", nargs="+", choices=[*VARIANTS, *(f"train-{v}" for v in VARIANTS)])
    args = ap.parse_args()
    if args.each:
        sys.exit(each(args.each))
    if args.variant is None:
        ap.error("a variant, or --each")
    compile_variant(args.variant, args.train)


if __name__ == "__main__":
    main()
