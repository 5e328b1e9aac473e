"""Hash components: the named parts an fxgraph key is hashed from (`_fx_graph_cache_debug_lines`).

Each debug line is '[<hash>] <name>: <value>'. Components are grouped into parts (code, inputs,
options, environment) that `diff` and `explain` compare; each part gets a digest so the index
stores a part shared by hundreds of graphs once.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal, NamedTuple

from cachemgr.parse.unpickle import clean
from cachemgr.vocab import Part

VALUE_CHARS = 200  # short value kept per component (inputs 4x); the graph code ('gm') is kept whole
MAX_LINES = 20_000  # debug lines read from one entry (a graph has a few hundred)
MAX_NAME = 255


class Component(NamedTuple):  # a tuple: hashed and compared in C, as the digest memo below needs
    name: str  # e.g. 'gm', 'example_inputs[0]', 'inductor_config[max_autotune]', 'torch_version'
    hash: str
    value: str
    part: str  # code | inputs | options | environment: what `explain` groups differences by


def component_part(name: str) -> Part:
    if name == "gm":
        return Part.CODE
    if name.startswith(("example_inputs[", "inputs_to_check[")):
        return Part.INPUTS
    if name.startswith(("fx_kwargs[", "inductor_config[")):
        return Part.OPTIONS
    return Part.ENVIRONMENT


# Most debug lines (hundreds of inductor_config values) repeat verbatim across every entry of a
# cache: parse each distinct line once.
_LINE_CACHE: dict[str, Component | None] = {}


def _component(line: str) -> Component | None:
    # Every search is bounded and only the graph code is copied whole: a hostile entry's
    # megabyte lines cost no more than their first few hundred characters.
    if not line.startswith("["):
        return None
    end = line.find("] ", 1, 132)
    if end < 0:
        return None
    colon = line.find(":", end + 2, end + 1 + MAX_NAME)
    if colon < 0:
        return None
    h, name = clean(line[1:end]), clean(line[end + 2 : colon])
    if name == "gm":
        value = line[colon + 1 :].lstrip(" ")
    else:
        keep = 4 * VALUE_CHARS if name.startswith("example_inputs[") else VALUE_CHARS
        value = line[colon + 1 : colon + 65 + keep].lstrip(" ")[:keep]
        if name == "torch_version" or not value.isprintable():
            value = ""  # torch hashes its version as raw bytes: the hash says all there is
    return Component(name, h, clean(value), component_part(name))


def components_of(debug_lines: Any) -> list[Component]:
    """Parse '[<hash>] <name>: <value>' lines; the last line of a name wins."""
    if not isinstance(debug_lines, (list, tuple)):
        return []
    if len(_LINE_CACHE) > 200_000:
        _LINE_CACHE.clear()
    out: dict[str, Component] = {}
    long: dict[Any, Component | None] = {}  # long lines of this entry by identity (a pickle may repeat one)
    for line in debug_lines[:MAX_LINES]:
        if not isinstance(line, str):
            continue
        # the graph code is one long line per graph: kept for this entry only, by identity
        cache: dict[Any, Component | None] = long if len(line) >= 4096 else _LINE_CACHE
        key = id(line) if cache is long else line
        c: Component | None | Literal[False] = cache.get(key, False)
        if c is False:
            c = cache[key] = _component(line)
        if c is not None:
            out[c.name] = c
    return list(out.values())


def component_named(debug_lines: Any, name: str) -> Component | None:
    """The component `components_of` would give for `name` (the last line of that name), read
    from that line alone: an AOT entry wants one of its graphs' hundreds (the torch version)."""
    if not isinstance(debug_lines, (list, tuple)):
        return None
    mark = "] " + name + ":"
    found = None
    for line in debug_lines[:MAX_LINES]:
        # (a header's hash ends within 132 characters: `_component`)
        if isinstance(line, str) and line.find(mark, 1, 132 + len(mark)) >= 0:
            c = _component(line)
            if c is not None and c.name == name:
                found = c
    return found


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


def options_hash(parts: dict[str, tuple[str, list[Component]]]) -> str | None:
    """Hash over the compile options (every fx_kwargs[...] and inductor_config[...] component),
    from `part_digests`: the first 16 hex digits of the sha256 its options digest is made of."""
    options = parts.get(Part.OPTIONS)
    return options[0][1:17] if options else None


def short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
