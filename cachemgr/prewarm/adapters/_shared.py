"""The body the per-range adapters share; each passes what differs (how its pickler hashes).

Imports torch names that torch does not publish: only the adapters of this package use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Hasher = Callable[[Any], str]


def system_description(system: Mapping[str, Any]) -> str:
    """'NVIDIA H200, CUDA 13.0, Triton 3.6.0', or 'no GPU' (what CacheBase.get_system() names)."""
    device = system.get("device") or {}
    version = system.get("version") or {}
    parts = [str(device.get("name"))] if device.get("name") else []
    if version.get("cuda"):
        parts.append(f"CUDA {version['cuda']}")
    if version.get("hip"):
        parts.append(f"ROCm/HIP {version['hip']}")
    if version.get("triton"):  # '3.6.0' then '-'-joined sha256 hex digests of Triton's sources
        first = str(version["triton"]).split("-", 1)[0]
        parts.append(f"Triton {first[:-64] if len(first) > 64 else first[:32]}")
    return ", ".join(parts) or "no GPU"


def counters() -> Any:
    """torch's own event counters (counters['inductor']['fxgraph_cache_hit'], ...): what a
    compile did, as torch counts it."""
    from torch._dynamo.utils import counters as torch_counters

    return torch_counters


def fingerprint(torch: Any, hasher: Hasher) -> dict:
    from torch._inductor.codecache import CacheBase, torch_key

    key = torch_key()
    system = CacheBase.get_system()
    value = str(system.get("hash", ""))
    return {
        "torch": torch.__version__,
        "torch_key": key.hex() if isinstance(key, bytes) else str(key),
        "torch_version_hash": hasher(key),
        "system_hash": value,
        "system_component": hasher(value),
        "system": system_description(system),
        "cuda": getattr(torch.version, "cuda", None),
        "hip": getattr(torch.version, "hip", None),
    }


def components(torch: Any, patch: dict, lines_of: Callable[[Any], list[str]]) -> list[str]:
    """The debug lines of a key for no graph, under `patch` (torch.compile's options): every
    component that does not depend on the graph, as this torch computes it. Two probes: one with
    a CPU tensor input (the C++ thread count a CPU graph specialises on) and one with no input
    (the default device index a graph without tensor inputs is keyed on, on a host with a GPU)."""
    from torch._inductor import config
    from torch._inductor.codecache import FxGraphHashDetails

    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    out: list[str] = []
    with config.patch(patch):
        for probe in ([torch.empty(1)], []):
            out.extend(lines_of(FxGraphHashDetails(gm, probe, {}, [])))
    return out


def mode_options(torch: Any, mode: str | None, dynamic: bool | None) -> dict:
    if not mode or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def known_option(torch: Any, name: str) -> bool:
    from torch._inductor import config

    return name.replace("-", "_") in config.get_config_copy()


def config_values(torch: Any, patch: dict, names: Iterable[str]) -> dict[str, str]:
    """str() of some Inductor options under `patch` (the fx_kwargs that mirror them)."""
    from torch._inductor import config

    with config.patch(patch):
        return {n: str(getattr(config, n)) for n in names if hasattr(config, n)}


def register_artifacts() -> Any:
    """torch's mega-cache manager, with every artifact type registered (a process that compiled
    nothing has not imported them)."""
    try:
        from torch.compiler._cache import CacheArtifactManager
    except ImportError as e:  # torch < 2.7 has no mega-cache
        raise RuntimeError(f"this torch has no cache-artifact bundles (torch.compiler._cache: {e})") from None
    CacheArtifactManager._ensure_cache_artifacts_registered()  # noqa: SLF001 - what adapters are for
    return CacheArtifactManager


def record_artifacts(records: Iterable[tuple[str, str, Any]]) -> int:
    """Hand cache files to torch's mega-cache (kind 'inductor' | 'aot_autograd' | 'autotune',
    key, content): save_cache_artifacts() then bundles them."""
    manager = register_artifacts()
    n = 0
    for kind, key, content in records:
        manager.record_artifact(kind, key, content)
        n += 1
    return n
