"""torch 2.5: FxGraphCachePickler hashes through classmethods (`get_hash`, `debug_lines`), with no
GraphModule of its own; entries record no hash components, but this host's side of them (and its
fingerprint) is computed the same way. No mega-cache: bundles need torch 2.7+."""

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

FIRST = (2, 5)


def _pickler() -> Any:
    from torch._inductor.codecache import FxGraphCachePickler

    return FxGraphCachePickler


def fingerprint(torch: Any) -> dict:
    return _shared.fingerprint(torch, _pickler().get_hash)


def components(torch: Any, patch: dict) -> list[str]:
    return _shared.components(torch, patch, _pickler().debug_lines)


__all__ = ["FIRST", "components", "config_values", "fingerprint", "known_option", "mode_options", "record_artifacts"]
