"""Read Inductor cache entries into plain dataclasses, without importing torch.

The entries are pickles (`CompiledFxGraph`, `AOTAutogradCacheEntry` / `AOTAutogradResult`),
read by `unpickle.safe_load`, which executes nothing. Field names move between torch releases;
each reader takes what the entry's own format records and names what it does not (`missing`),
so `show`, `diff` and `explain` can say "not recorded" instead of guessing. A file that cannot be
read becomes a `corrupt` reason, never an exception.

Formats (read off real caches, see docs/formats.md):
- fxgraph, torch 2.5-2.6: no hash components (`_fx_graph_cache_debug_lines`) and no torch
  version string; the C++ kernel of a CPU graph builds as c<hash>.cpp/.so;
- fxgraph, torch 2.9+: hash components; the version string in `runnable_graph_str` (2.14 fills
  it only under structured tracing); C++ kernels build as c<hash>.main.cpp beside the .cpp;
- aotautograd, torch 2.5-2.6: `compiled_fw/compiled_bw.fx_graph_cache_key`; 2.5 has no time fields;
- aotautograd, torch 2.9+: `compiled_fw/compiled_bw.fx_graph_cache_info` = (key, debug lines).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cachemgr import signatures
from cachemgr.parse.components import (
    Component,
    component_named,
    components_of,
    options_hash,
    part_digests,
    short_hash,
)
from cachemgr.parse.unpickle import Stub, class_name, items, safe_load, seconds, state_of, text
from cachemgr.vocab import Kind

MAX_ENTRY_BYTES = 1 << 30  # larger entry files are corrupt, never read (checked before reading)
MAX_GUARDS = 64 * 1024  # characters of a guard expression kept
MAX_REFS = 100_000  # references read from one entry


@dataclass(slots=True)
class Parsed:
    """What an fxgraph or aotautograd entry says about itself. Every field may be missing."""

    kind: str
    graph_key: str | None = None
    module: str | None = None  # generated wrapper module 'c<hash>' (fxgraph)
    signature: str | None = None
    signature_hash: str | None = None
    options_hash: str | None = None
    guards: str | None = None
    device_types: str | None = None
    compile_seconds: float | None = None
    torch_version: str | None = None
    torch_version_hash: str | None = None
    system_hash: str | None = None
    components: list[Component] = field(default_factory=list)
    parts: dict[str, tuple[str, list[Component]]] = field(default_factory=dict)  # part_digests(components)
    # references to other entries: (kind, ref) pairs
    refs: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # what this entry's format does not record
    corrupt: str | None = None


# What each field means to a reader, for `missing`.
COMPONENTS = "hash components"
VERSION = "torch version string"
COMPILE_TIME = "compile time"
GRAPH_REFS = "graph references"


_TORCH_VERSION = re.compile(r"# torch version: ([^\s]{1,64})")
_BINDING_MARK = "\n// Python bindings to call kernel"


def cpp_source_ref(source: str) -> str:
    """How an fxgraph entry and a `c<hash>.main.cpp` file name the same C++ kernel source.

    The .main.cpp Inductor builds is the kernel source the entry embeds, plus a Python binding
    appended after a fixed marker line.
    """
    return "src-" + short_hash(source.split(_BINDING_MARK, 1)[0].strip())


def cpp_sources(source: str) -> Iterator[str]:
    """The C++ kernel sources a generated wrapper module embeds: the text of each
    `cpp_pybinding([...], '''<source>''')` call. Found with plain string search (linear time:
    a regular expression with two lazy groups was quadratic on a hostile entry)."""
    at = 0
    while (start := source.find("cpp_pybinding(", at)) >= 0:
        open_ = source.find("'''\n", start)
        if open_ < 0:
            break
        close = source.find("'''", open_ + 4)
        if close < 0:
            break
        yield source[open_ + 4 : close]
        at = close + 3


def included_headers(source: str) -> list[str]:
    """The c<h> stems of the cache's own headers a C++ kernel includes: torch 2.5/2.6 include their
    prefix header by absolute path (`#include "<root>/<2ch>/c<h>.h"`), and a hit whose header is
    gone crashes instead of recompiling. Matched by the last two path parts (the root may move)."""
    out = []
    at = 0
    while (start := source.find('#include "', at)) >= 0:
        end = source.find('"', start + 10, start + 4096)
        if end < 0:
            break
        path = source[start + 10 : end]
        at = end
        folder, _, name = path.rpartition("/")
        if name.startswith("c") and name.endswith(".h") and len(folder) >= 2 and folder[-3:-2] in ("/", ""):
            out.append(text(name[:-2], 128) or "")
    return [h for h in out if h]


def _string_set(obj: Any) -> list[str]:
    """OrderedSet/set stand-ins hold their items in constructor args or state."""
    for cand in (getattr(obj, "args", None), getattr(obj, "state", None), obj):
        if isinstance(cand, tuple) and cand and isinstance(cand[0], (list, tuple, set)):
            cand = cand[0]
        if isinstance(cand, dict):
            cand = cand.get("_dict") or cand.get("_items") or list(cand)
        if isinstance(cand, (list, tuple, set, frozenset)) and all(isinstance(x, str) for x in cand):
            return sorted(text(x, 32) or "" for x in list(cand)[:16])
    return []


def parse_fxgraph(data: bytes, graph_key: str | None = None) -> Parsed:
    p = Parsed(Kind.FXGRAPH, graph_key=graph_key)
    obj, st = _load(data, p)
    if st is None:
        return p
    _fx_fields(p, obj, st, graph_key)
    if not p.graph_key:
        p.corrupt = "no graph key in entry"
    return p


def _fx_fields(p: Parsed, obj: Any, st: dict[str, Any], graph_key: str | None) -> None:
    """A CompiledFxGraph's fields (an fxgraph entry's, or one inside a precompile entry)."""
    p.graph_key = text(st.get("_fx_graph_cache_key"), 64) or graph_key
    p.module = text(st.get("cache_key"), 128)
    p.guards = text(st.get("guards_expr"), MAX_GUARDS)
    p.compile_seconds = seconds(st.get("_time_taken_ns"))
    p.device_types = ",".join(_string_set(st.get("device_types"))) or None
    lines = st.get("_fx_graph_cache_debug_lines")
    p.components = components_of(lines)
    if not p.components:
        p.missing.append(COMPONENTS)
    inputs = []
    for c in p.components:
        if c.name.startswith("example_inputs["):
            idx = c.name[len("example_inputs[") : -1]
            if idx.isdigit():
                inputs.append((int(idx), c.value))
        elif c.name == "torch_version":
            p.torch_version_hash = c.hash[:64]
        elif c.name == "system_info[hash]":
            p.system_hash = c.value.strip()[:64] or c.hash[:64]
    p.signature = signatures.entry_signature(inputs)
    p.signature_hash = short_hash(p.signature) if p.signature else None
    p.parts = part_digests(p.components)
    p.options_hash = options_hash(p.parts)
    runnable = st.get("runnable_graph_str")
    m = _TORCH_VERSION.search(runnable, 0, 4096) if isinstance(runnable, str) else None
    p.torch_version = text(m.group(1), 64) if m else None
    if p.torch_version is None:
        p.missing.append(VERSION)
        if not p.components:  # torch 2.5/2.6 record neither: their field sets still tell them apart
            p.torch_version = _fx_family(obj, st)
    if p.compile_seconds is None:
        p.missing.append(COMPILE_TIME)
    refs: list[tuple[str, str]] = []
    if p.module:
        refs.append((Kind.CODE, p.module))
    source = st.get("source_code")
    if isinstance(source, str):
        for src in cpp_sources(source):
            refs.append((Kind.CODE, cpp_source_ref(src)))
            refs.extend((Kind.CODE, h) for h in included_headers(src))
            if len(refs) >= MAX_REFS:  # a hostile entry of a million kernels: its memory stays bounded
                break
    bundle = state_of(st.get("_triton_bundle"))
    for art in items(bundle.get("kernel_artifacts"))[:MAX_REFS]:
        h = text(state_of(art).get("kernel_hash"), 128)
        if h:
            refs.append((Kind.TRITON, h))
    for tuner in items(bundle.get("static_autotuners"))[:MAX_REFS]:
        key = text(state_of(tuner).get("cache_key"), 128)
        if key:
            refs.append((Kind.CODE, key))  # the kernel's own c<hash>.py module
    p.refs = list(dict.fromkeys(refs))[:MAX_REFS]


def _fx_family(obj: Any, st: dict[str, Any]) -> str | None:
    """The torch release family of an entry that records no version (docs/formats.md, section 7)."""
    if getattr(type(obj), "pickled_module", "") == "torch._inductor.codecache" and "_fx_graph_cache_key" not in st:
        return "2.5.*"
    if "allocated_constant_name" in st:
        return "2.6.*"
    return None


def parse_aotautograd(data: bytes) -> Parsed:
    p = Parsed(Kind.AOTAUTOGRAD)
    _, st = _load(data, p)
    if st is None:
        return p
    p.guards = text(st.get("guards_expr"), MAX_GUARDS)
    p.compile_seconds = _aot_seconds(st)
    if p.compile_seconds is None:
        p.missing.append(COMPILE_TIME)
    old_format = False
    for name in ("compiled_fw", "compiled_bw"):
        graph = state_of(st.get(name))
        info = items(graph.get("fx_graph_cache_info"))  # 2.9+: (key, debug lines)
        if info:
            key = text(info[0], 64)
            if p.torch_version_hash is None and len(info) > 1:
                tv = component_named(info[1], "torch_version")
                p.torch_version_hash = tv.hash[:64] if tv else None
        else:
            key = text(graph.get("fx_graph_cache_key"), 64)  # 2.5-2.6
            old_format = old_format or key is not None
        if key:
            p.refs.append((Kind.FXGRAPH, key))
    if old_format:  # 2.5 records no compile times
        p.torch_version = "2.6.*" if p.compile_seconds is not None else "2.5.*"
    if p.torch_version is None:
        p.missing.append(VERSION)
    if not p.refs:
        if "compiled_fw" not in st:
            p.corrupt = f"not an AOTAutograd entry ({class_name(st)})"
        else:  # a bundled entry (caching precompile) holds its graphs inline: it needs what they load
            p.missing.append(GRAPH_REFS)
            _take_inline(p, st)
    return p


def _aot_seconds(st: dict[str, Any]) -> float | None:
    """An AOTAutograd result's compile seconds: `forward_time_taken_ns + backward_time_taken_ns`,
    what torch counts as the time a hit saves (autograd_cache.py). The forward time runs from the
    start of AOT tracing through the forward graph's Inductor compile; the backward time is the
    backward graph's Inductor compile (`_time_taken_ns`), 0 for inference. None: neither recorded."""
    times = [
        s for name in ("forward_time_taken_ns", "backward_time_taken_ns") if (s := seconds(st.get(name))) is not None
    ]
    return sum(times) if times else None


def _take_inline(p: Parsed, root: Any) -> None:
    """What the CompiledFxGraphs held inline in an entry load (modules, C++ builds, kernels), and
    the torch build they name."""
    refs: list[tuple[str, str]] = []
    for graph in _instances(root, "CompiledFxGraph"):
        inner = Parsed(Kind.FXGRAPH)
        _fx_fields(inner, graph, state_of(graph), None)
        refs.extend(inner.refs)
        p.torch_version_hash = p.torch_version_hash or inner.torch_version_hash
        p.system_hash = p.system_hash or inner.system_hash
        if p.torch_version is None and inner.torch_version and not inner.torch_version.endswith(".*"):
            p.torch_version = inner.torch_version
            if VERSION in p.missing:
                p.missing.remove(VERSION)
    p.refs = list(dict.fromkeys(refs))[:MAX_REFS]


def parse_precompile(data: bytes) -> Parsed:
    """A dynamo precompile entry (`dynamo/<hash>/entry`): a function's whole compile, its graphs
    held inline; it names the version string of the torch that wrote it, and the generated
    modules and C++ builds its graphs load."""
    p = Parsed(Kind.PRECOMPILE)
    obj, st = _load(data, p)
    if st is None:
        return p
    dynamo = state_of(st.get("dynamo"))
    info = dynamo.get("system_info")
    info = info if isinstance(info, dict) else state_of(info)
    version = info.get("torch_version")
    if isinstance(version, Stub):  # a TorchVersion: a str subclass, built by NEWOBJ from the string
        version = next(iter(items(version.args)), None)
    p.torch_version = text(version, 64)
    if p.torch_version is None:
        p.missing.append(VERSION)
    p.compile_seconds = _backend_seconds(st.get("backends"))
    if p.compile_seconds is None:
        p.missing.append(COMPILE_TIME)
    _take_inline(p, st.get("backends"))
    if not dynamo:
        p.corrupt = f"not a precompile entry ({class_name(obj)})"
    return p


def _backend_seconds(backends: Any) -> float | None:
    """A precompile entry's compile seconds: the sum over its backends (one per compiled graph
    of the function, each a BundledAOTAutogradCacheArtifact holding an AOT result) of the AOT
    result's forward + backward time (`_aot_seconds`); a backend that records neither counts the
    `_time_taken_ns` of the CompiledFxGraphs it holds inline (those are looked for in one walk,
    within one budget). Dynamo's own tracing time is recorded nowhere. None: no backend records
    any time."""
    if not isinstance(backends, dict):
        return None
    times, bare = [], []
    for backend in itertools.islice(backends.values(), MAX_REFS):
        spent = _aot_seconds(state_of(state_of(backend).get("content")))
        if spent is None:
            bare.append(backend)
        else:
            times.append(spent)
    for graph in _instances(bare, "CompiledFxGraph") if bare else []:
        if (spent := seconds(state_of(graph).get("_time_taken_ns"))) is not None:
            times.append(spent)
    return sum(times) if times else None


def _instances(root: Any, name: str, budget: int = 200_000) -> list[Any]:
    """Stand-in objects of class `name` anywhere below `root`: each object looked at once, and
    at most `budget` of them (a hostile tree costs bounded time and memory: a list that held
    itself a thousand times queued a thousand copies of itself at each visit, 1.6 GB)."""
    out: list[Any] = []
    queue, seen = [root], {id(root)}
    while queue:
        node = queue.pop()
        kids: Iterable[Any] = ()
        if isinstance(node, Stub):
            if node.pickled_name == name:
                out.append(node)
                continue
            kids = itertools.chain(node.args, (node.state,))
        elif isinstance(node, dict):
            kids = node.values()
        elif isinstance(node, (list, tuple)):
            kids = node
        for kid in kids:
            if id(kid) not in seen:
                if len(seen) >= budget:
                    return out
                seen.add(id(kid))
                queue.append(kid)
    return out


def autotune_refs(data: bytes) -> list[tuple[str, str]]:
    """A .best_config names the Triton kernel it tuned."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return []
    h = text(doc.get("triton_cache_hash"), 128) if isinstance(doc, dict) else None
    return [(Kind.TRITON, h)] if h else []


def _load(data: bytes, p: Parsed) -> tuple[Any, dict[str, Any] | None]:
    """(the unpickled object, its state), or (None, None) with `p.corrupt` saying why."""
    if not data:
        p.corrupt = "empty file"
        return None, None
    if len(data) > MAX_ENTRY_BYTES:
        p.corrupt = f"too large to parse ({len(data)} bytes)"
        return None, None
    try:
        obj = safe_load(data)
    except RecursionError:
        p.corrupt = "unpickle failed: nesting too deep"
        return None, None
    except MemoryError:
        p.corrupt = "unpickle failed: needs more memory than an entry may take"
        return None, None
    except Exception as e:  # noqa: BLE001 - any malformed byte string lands here
        p.corrupt = text(f"unpickle failed: {type(e).__name__}: {e}", 300)
        return None, None
    st = state_of(obj)
    if not st:
        p.corrupt = f"not a cache entry (a pickled {class_name(obj)})"
        return None, None
    if not all(isinstance(k, str) for k in st):
        p.corrupt = f"not a cache entry (a {class_name(obj)} with odd field names)"
        return None, None
    return obj, st
