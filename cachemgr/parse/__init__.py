"""Read Inductor cache entries without importing torch, within stated bounds.

unpickle    a pickle reader that executes nothing (stand-in classes) and checked values
components  hash components: what an fxgraph key is hashed from, grouped into parts
entries     the per-format readers: fxgraph, aotautograd, autotune results
pool        worker processes that read entry files with memory and time limits
"""

from cachemgr.parse.components import Component, component_part, components_of, options_hash, part_digests, short_hash
from cachemgr.parse.entries import (
    MAX_ENTRY_BYTES,
    Parsed,
    autotune_refs,
    cpp_source_ref,
    cpp_sources,
    parse_aotautograd,
    parse_fxgraph,
    parse_precompile,
)
from cachemgr.parse.unpickle import clean, safe_load, state_of
from cachemgr.vocab import READER  # (kept in vocab: a rescan checks it without importing the readers)

__all__ = [
    "READER",
    "MAX_ENTRY_BYTES",
    "Component",
    "Parsed",
    "autotune_refs",
    "clean",
    "component_part",
    "components_of",
    "cpp_source_ref",
    "cpp_sources",
    "options_hash",
    "parse_aotautograd",
    "parse_fxgraph",
    "parse_precompile",
    "part_digests",
    "safe_load",
    "short_hash",
    "state_of",
]
