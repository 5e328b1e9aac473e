"""Compile one small function in one variant, so a test can explain the miss between variants.

Each variant changes exactly one thing against `base`:

    base     f(x), x float32 (8, 16) contiguous, default options
    option   the same with options={"epilogue_fusion": False}   -> inductor_config[epilogue_fusion]
    dtype    x float64                                          -> example_inputs[0] dtype
    stride   x non-contiguous (a transposed (16, 8))            -> example_inputs[0] stride
    code     the function body changed                          -> gm (the graph code)

    TORCHINDUCTOR_CACHE_DIR=DIR python explain_variants.py VARIANT [--train]

Run each variant in a fresh process. Prints the cache counters as one JSON line.
"""

import argparse
import json

import torch
from torch._dynamo.utils import counters


def f(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() + 1).cos() * 2


def f_changed(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() + 1).tanh() * 2


VARIANTS = ("base", "option", "dtype", "stride", "code")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--train", action="store_true", help="also compile a backward graph")
    args = ap.parse_args()
    torch.manual_seed(0)
    fn, options = f, None
    x = torch.randn(8, 16)
    if args.variant == "option":
        options = {"epilogue_fusion": False}
    elif args.variant == "dtype":
        x = x.double()
    elif args.variant == "stride":
        x = torch.randn(16, 8).t()
        assert not x.is_contiguous()
    elif args.variant == "code":
        fn = f_changed
    compiled = torch.compile(fn, options=options)
    if args.train:
        x.requires_grad_(True)
        compiled(x).sum().backward()
    else:
        with torch.no_grad():
            assert torch.allclose(compiled(x), fn(x), atol=1e-5)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
            }
        )
    )


if __name__ == "__main__":
    main()
