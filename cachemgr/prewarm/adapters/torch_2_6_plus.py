"""torch 2.6 and later: FxGraphCachePickler is an instance bound to a GraphModule (its reducers
read the graph), `get_hash` and `debug_lines` are its methods."""

from __future__ import annotations

from typing import Any

from cachemgr.prewarm.adapters import _shared
from cachemgr.prewarm.adapters._shared import (  # noqa: F401 - the adapter's interface
    config_values,
    counters,
    known_option,
    mode_options,
    record_artifacts,
)

FIRST = (2, 6)


def _pickler(torch: Any) -> Any:
    from torch._inductor.codecache import FxGraphCachePickler

    return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))


def fingerprint(torch: Any) -> dict:
    return _shared.fingerprint(torch, _pickler(torch).get_hash)


def components(torch: Any, patch: dict) -> list[str]:
    pickler = _pickler(torch)
    return _shared.components(torch, patch, pickler.debug_lines)


__all__ = ["FIRST", "components", "config_values", "fingerprint", "known_option", "mode_options", "record_artifacts"]
