"""Read Inductor cache entries into plain dataclasses, without importing torch.

The entries are pickles (`CompiledFxGraph`, `AOTAutogradResult`). They are read by an unpickler
whose `find_class` hands back an inert stand-in class for *every* global: no constructor, no
`__reduce__` callable, no `__setstate__` of a real class ever runs, so a hostile file can do
nothing but describe itself. Field names move between torch releases: everything is optional,
and a file that cannot be read becomes a `corrupt` reason, never an exception.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_PICKLE_BYTES = 1 << 30  # larger entries are recorded as corrupt instead of being loaded


class Stub:
    """Stand-in for any class a pickle names. Keeps constructor args and state as plain data."""

    _module = ""
    _name = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    # pickle's BUILD may also call __setitem__/append/extend on odd objects: accept quietly.
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


_STUBS: dict[tuple[str, str], type[Stub]] = {}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> type[Stub]:
        cls = _STUBS.get((module, name))
        if cls is None:
            cls = _STUBS[(module, name)] = type(name, (Stub,), {"_module": module, "_name": name})
        return cls

    def persistent_load(self, pid: Any) -> None:
        return None


def safe_load(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def state_of(obj: Any) -> dict[str, Any]:
    """The attribute dict of a stand-in object (dataclass pickles carry (dict, slots) at times)."""
    st = obj.state if isinstance(obj, Stub) else obj
    if isinstance(st, tuple):
        merged: dict[str, Any] = {}
        for part in st:
            if isinstance(part, dict):
                merged.update(part)
        return merged
    return st if isinstance(st, dict) else {}


def class_name(obj: Any) -> str:
    return type(obj)._name if isinstance(obj, Stub) else type(obj).__name__


# -- hash components ----------------------------------------------------------------------------

VALUE_CHARS = 200  # short value kept per component (inputs 4x); the graph code ('gm') is kept whole


class Component(NamedTuple):  # a tuple: hashed and compared in C, as the digest memo below needs
    name: str  # e.g. 'gm', 'example_inputs[0]', 'inductor_config[max_autotune]', 'torch_version'
    hash: str
    value: str
    part: str  # code | inputs | options | environment: what `explain` groups differences by


def component_part(name: str) -> str:
    if name == "gm":
        return "code"
    if name.startswith(("example_inputs[", "inputs_to_check[")):
        return "inputs"
    if name.startswith(("fx_kwargs[", "inductor_config[")):
        return "options"
    return "environment"


# Most debug lines (hundreds of inductor_config values) repeat verbatim across every entry of a
# cache: parse each distinct line once.
_LINE_CACHE: dict[str, Component | None] = {}


def _component(line: str) -> Component | None:
    end = line.find("] ", 1)
    colon = line.find(":", end + 2)
    if not line.startswith("[") or end < 0 or colon < 0:
        return None
    h, name, value = line[1:end], line[end + 2 : colon], line[colon + 1 :].lstrip(" ")
    if name != "gm":
        value = value[: 4 * VALUE_CHARS if name.startswith("example_inputs[") else VALUE_CHARS]
        if name == "torch_version" or not value.isprintable():
            value = ""  # torch hashes its version as raw bytes: the hash says all there is
    return Component(name, h, value, component_part(name))


def components_of(debug_lines: Any) -> list[Component]:
    """Parse '[<hash>] <name>: <value>' lines; the last line of a name wins."""
    if not isinstance(debug_lines, (list, tuple)):
        return []
    if len(_LINE_CACHE) > 200_000:
        _LINE_CACHE.clear()
    out: dict[str, Component] = {}
    for line in debug_lines:
        if not isinstance(line, str):
            continue
        c = _LINE_CACHE.get(line, False)
        if c is False:
            c = _LINE_CACHE[line] = _component(line)
        if c is not None:
            out[c.name] = c
    return list(out.values())


# The options part (hundreds of inductor_config values) is the same in most entries of a cache:
# its digest is computed once per distinct set of components.
_DIGESTS: dict[tuple[Component, ...], str] = {}


def _sha256_of(items: tuple[Component, ...]) -> str:
    """sha256 hex over the sorted 'name=hash' pairs of some components."""
    digest = _DIGESTS.get(items)
    if digest is None:
        if len(_DIGESTS) > 10_000:
            _DIGESTS.clear()
        joined = "\n".join(sorted([c.name + "=" + c.hash for c in items]))
        digest = _DIGESTS[items] = hashlib.sha256(joined.encode()).hexdigest()
    return digest


def part_digests(components: list[Component]) -> dict[str, tuple[str, list[Component]]]:
    """Split components by part; each part gets a digest of its (name, hash) pairs."""
    by_part: dict[str, list[Component]] = {}
    for c in components:
        by_part.setdefault(c.part, []).append(c)
    return {part: (part[0] + _sha256_of(tuple(items))[:31], items) for part, items in by_part.items()}


def options_hash(components: list[Component]) -> str | None:
    """Hash over the compile options: every fx_kwargs[...] and inductor_config[...] component."""
    options = tuple(c for c in components if c.part == "options")
    return _sha256_of(options)[:16] if options else None


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- input signatures -------------------------------------------------------------------------

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8",
    "complex64": "c64", "complex128": "c128",
}
_TENSOR_META = re.compile(
    r"dtype=torch\.(?P<dtype>\w+), shape=torch\.Size\(\[(?P<shape>[^\]]*)\]\), "
    r"stride=\((?P<stride>[^)]*)\), device=device\(type='(?P<dev>\w+)'(?:, index=(?P<idx>\d+))?\)"
    r"(?:.*?requires_grad=(?P<grad>True|False))?"
)
_SYMBOL = re.compile(r"\b([a-z]+)(\d+)\b")


def _canonical_symbols(text: str, names: dict[str, str]) -> str:
    """Renumber symbolic dims (s77, u3) in order of appearance so equal signatures compare equal."""

    def rename(m: re.Match[str]) -> str:
        sym = m.group(0)
        if sym not in names:
            names[sym] = f"s{len(names)}"
        return names[sym]

    return _SYMBOL.sub(rename, text)


def input_spec(value: str, names: dict[str, str]) -> str:
    """'f32[s0, 32](32, 1)cpu' for a tensor; the symbol or literal for a scalar input."""
    m = _TENSOR_META.search(value)
    if not m:
        scalar = value.strip().strip("()").strip(",").strip("'\"")
        return _canonical_symbols(scalar, names) if scalar else "?"
    dtype = _DTYPE_SHORT.get(m["dtype"], m["dtype"])
    shape = _canonical_symbols(", ".join(s.strip() for s in m["shape"].split(",") if s.strip()), names)
    stride = _canonical_symbols(", ".join(s.strip() for s in m["stride"].split(",") if s.strip()), names)
    device = m["dev"] + (f":{m['idx']}" if m["idx"] is not None else "")
    grad = "" if m["grad"] != "True" else " grad"
    return f"{dtype}[{shape}]({stride}){device}{grad}"


def signature_of(components: list[Component]) -> str | None:
    inputs = []
    for c in components:
        if c.name.startswith("example_inputs["):
            try:
                idx = int(c.name[len("example_inputs["):-1])
            except ValueError:
                continue
            inputs.append((idx, c.value))
    if not inputs:
        return None
    names: dict[str, str] = {}
    return "; ".join(input_spec(v, names) for _, v in sorted(inputs))


# -- entries ------------------------------------------------------------------------------------


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
    # references to other entries: (kind, ref) pairs
    refs: list[tuple[str, str]] = field(default_factory=list)
    corrupt: str | None = None


_TORCH_VERSION = re.compile(r"# torch version: (\S+)")
_CPP_SOURCE = re.compile(r"cpp_pybinding\(\s*\[.*?\],\s*r?'''\n(.*?)'''", re.S)


def cpp_source_ref(source: str) -> str:
    """How an fxgraph entry and a `c<hash>.main.cpp` file name the same C++ kernel source.

    The .main.cpp Inductor builds is the kernel source the entry embeds, plus a Python binding
    appended after a fixed marker line.
    """
    return "src-" + short_hash(source.split("\n// Python bindings to call kernel", 1)[0].strip())


def _string_set(obj: Any) -> list[str]:
    """OrderedSet/set stand-ins hold their items in constructor args or state."""
    for cand in (getattr(obj, "args", None), getattr(obj, "state", None), obj):
        if isinstance(cand, tuple) and cand and isinstance(cand[0], (list, tuple, set)):
            cand = cand[0]
        if isinstance(cand, dict):
            cand = cand.get("_dict") or cand.get("_items") or list(cand)
        if isinstance(cand, (list, tuple, set, frozenset)) and all(isinstance(x, str) for x in cand):
            return sorted(cand)
    return []


def parse_fxgraph(data: bytes, graph_key: str | None = None) -> Parsed:
    p = Parsed("fxgraph", graph_key=graph_key)
    st = _load_state(data, p)
    if st is None:
        return p
    p.graph_key = _str(st.get("_fx_graph_cache_key")) or graph_key
    p.module = _str(st.get("cache_key"))
    p.guards = _str(st.get("guards_expr"))
    ns = st.get("_time_taken_ns")
    p.compile_seconds = ns / 1e9 if isinstance(ns, (int, float)) else None
    types = _string_set(st.get("device_types"))
    p.device_types = ",".join(types) or None
    p.components = components_of(st.get("_fx_graph_cache_debug_lines"))
    p.signature = signature_of(p.components)
    p.signature_hash = short_hash(p.signature) if p.signature else None
    p.options_hash = options_hash(p.components)
    for c in p.components:
        if c.name == "torch_version":
            p.torch_version_hash = c.hash
        elif c.name == "system_info[hash]":
            p.system_hash = c.value.strip()[:64] or c.hash
    runnable = st.get("runnable_graph_str")
    m = _TORCH_VERSION.search(runnable) if isinstance(runnable, str) else None
    p.torch_version = m.group(1) if m else None
    if p.module:
        p.refs.append(("code", p.module))
    source = st.get("source_code")
    if isinstance(source, str):
        p.refs.extend(("code", cpp_source_ref(src)) for src in _CPP_SOURCE.findall(source))
    bundle = state_of(st.get("_triton_bundle"))
    for art in bundle.get("kernel_artifacts") or []:
        a = state_of(art)
        if isinstance(a.get("kernel_hash"), str):
            p.refs.append(("triton", a["kernel_hash"]))
    for tuner in bundle.get("static_autotuners") or []:
        key = state_of(tuner).get("cache_key")
        if isinstance(key, str):
            p.refs.append(("code", key))  # the kernel's own c<hash>.py module
    p.refs = list(dict.fromkeys(p.refs))
    if not p.graph_key:
        p.corrupt = "no graph key in entry"
    return p


def parse_aotautograd(data: bytes) -> Parsed:
    p = Parsed("aotautograd")
    st = _load_state(data, p)
    if st is None:
        return p
    p.guards = _str(st.get("guards_expr"))
    total = 0
    for name in ("forward_time_taken_ns", "backward_time_taken_ns"):
        if isinstance(st.get(name), (int, float)):
            total += st[name]
    p.compile_seconds = total / 1e9 if total else None
    for name in ("compiled_fw", "compiled_bw"):
        info = state_of(st.get(name)).get("fx_graph_cache_info")
        if isinstance(info, (tuple, list)) and info and isinstance(info[0], str):
            p.refs.append(("fxgraph", info[0]))
    if not p.refs and "compiled_fw" not in st:
        p.corrupt = f"not an AOTAutograd entry ({class_name(st)})"
    return p


def autotune_refs(data: bytes) -> list[tuple[str, str]]:
    """A .best_config names the Triton kernel it tuned."""
    import json

    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return []
    h = doc.get("triton_cache_hash") if isinstance(doc, dict) else None
    return [("triton", h)] if isinstance(h, str) else []


def _load_state(data: bytes, p: Parsed) -> dict[str, Any] | None:
    if not data:
        p.corrupt = "empty file"
        return None
    if len(data) > MAX_PICKLE_BYTES:
        p.corrupt = f"too large to parse ({len(data)} bytes)"
        return None
    try:
        obj = safe_load(data)
    except RecursionError:
        p.corrupt = "unpickle failed: nesting too deep"
        return None
    except Exception as e:  # noqa: BLE001 - any malformed byte string lands here
        p.corrupt = f"unpickle failed: {type(e).__name__}: {e}"[:300]
        return None
    st = state_of(obj)
    if not st:
        p.corrupt = f"not a cache entry (a pickled {class_name(obj)})"
        return None
    return st


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
