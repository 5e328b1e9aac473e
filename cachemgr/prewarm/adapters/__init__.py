"""What cachemgr asks torch that torch does not publish: one module per torch range.

The cache check (cachemgr.check) needs this host's side of every hash component an fxgraph key
is made of, computed as torch computes it; export needs torch's cache-artifact registry. Both are
private torch names (`torch_key`, `FxGraphCachePickler`, `FxGraphHashDetails`,
`CacheBase.get_system`, `config.patch`, `CacheArtifactManager`...), and their shapes move between
releases. Only the modules here name them, one per range, chosen by `torch.__version__`:

    torch_2_5        2.5.x: FxGraphCachePickler hashes through classmethods
    torch_2_6_plus   2.6 and later: a pickler instance bound to a GraphModule (checked live on
                     2.13 CPU and 2.11 CUDA; 2.6, 2.9 and 2.14 by their fixtures' stored values)

Choosing an adapter is torch-free (`name_for`); `load` imports it, and with it torch: only the
prewarm worker does that. Every adapter has the same functions:

    fingerprint(torch) -> dict          torch_version and system_info hashes, and what they name
    components(torch, patch) -> list    the debug lines of a graph-free key under a config patch
    mode_options(torch, mode, dynamic)  what torch.compile(mode=...) patches
    known_option(torch, name) -> bool   is `name` an Inductor option (as torch.compile checks)
    threads(torch) -> int               the thread count C++ kernels specialise on
    register_artifacts()                make every mega-cache artifact type known to torch
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

# (first release, module) in order: a version takes the last range that starts at or below it.
RANGES: tuple[tuple[tuple[int, int], str], ...] = (((2, 5), "torch_2_5"), ((2, 6), "torch_2_6_plus"))


class Unsupported(Exception):
    """A torch older than any adapter: its components cannot be computed here."""


def release_of(version: str) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", version or "")
    return (int(m[1]), int(m[2])) if m else None


def name_for(version: str) -> str | None:
    """The adapter module for a torch version string ('2.13.0+cpu'), or None (none fits)."""
    rel = release_of(version)
    if rel is None:
        return None
    found = None
    for first, name in RANGES:
        if rel >= first:
            found = name
    return found


def load(version: str) -> ModuleType:
    name = name_for(version)
    if name is None:
        raise Unsupported(f"torch {version}: cachemgr has no adapter for it (the oldest it knows is 2.5)")
    return importlib.import_module(f"{__name__}.{name}")


__all__ = ["RANGES", "Unsupported", "load", "name_for", "release_of"]
