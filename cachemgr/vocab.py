"""The words cachemgr uses for what it finds and does: one typed vocabulary for every module.

Each is a `StrEnum`, so a member is its own string: it goes into the index, JSON and tables as
is, and rows read back compare equal to members.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """What an index entry is (cachemgr.layout says which paths make which kind)."""

    FXGRAPH = "fxgraph"  # one compiled FX graph for one guard set (a CompiledFxGraph pickle)
    AOTAUTOGRAD = "aotautograd"  # forward/backward graph refs (an AOTAutograd cache entry pickle)
    TRITON = "triton"  # one Triton kernel directory, whole
    CODE = "code"  # a generated module c<hash>.py, or a C++ kernel's .cpp/.so builds
    AUTOTUNE = "autotune"  # a Triton kernel's .best_config
    LOCK = "lock"  # an Inductor file lock under locks/ (or beside a PGO profile)
    PRECOMPILE = "precompile"  # dynamo/<hash>/entry: a whole function's compile, self-contained (caching_precompile)
    PGO = "pgo"  # dynamo/code_state_*.pkl: which dims went dynamic (profile-guided), re-learned if lost
    TUNING = "tuning"  # cache/...: benchmark timings (GEMM autotune, pad_mm), re-measured if lost
    OTHER = "other"  # anything else under the root


# The readers' version (cachemgr.parse). Bump it when a reader extracts something it did not (or
# extracts it differently): every index then reads its entries again once, and parse results kept
# by content by another version are not taken. 2: precompile entries' torch version (NEWOBJ args)
# and time.
READER = 2

# entries.parse_state: its files were read, or (scan phase one) it was indexed from its names only
# and waits to be read: again (PENDING), or as a new entry (PENDING_NEW, a 'new' event when read).
PARSED, PENDING, PENDING_NEW = 0, 1, 2

PICKLED = frozenset({Kind.FXGRAPH, Kind.AOTAUTOGRAD, Kind.PRECOMPILE})  # entries that are pickles to parse

# What losing an entry of each kind costs, read off torch's own source (docs/formats.md, section 2).
LOSS = {
    Kind.FXGRAPH: "a full Inductor compile of this graph (its compile time), and every AOT entry naming it misses",
    Kind.AOTAUTOGRAD: "AOT tracing and partitioning again (its graphs still hit while they stay)",
    Kind.TRITON: "nothing while a graph bundling it stays (a hit writes it again); else a Triton compile",
    Kind.CODE: "a module: nothing (a hit writes it again); a C++ build: a g++ run; a torch 2.5/2.6 prefix header: "
    "a crash of the hits that include it (kept while any does)",
    Kind.AUTOTUNE: "one autotuning run of its kernel",
    Kind.LOCK: "nothing while it is not held",
    Kind.PRECOMPILE: "the whole compile of one function (dynamo, AOT and Inductor): it serves a warm start alone",
    Kind.PGO: "the next run learns again which dimensions are dynamic (a recompile per dimension)",
    Kind.TUNING: "the benchmarks behind autotuning choices are measured again",
    Kind.OTHER: "unknown: not a file torch is known to write",
}


class Part(StrEnum):
    """What an fxgraph key's hash components are grouped by (`diff`, `explain`)."""

    CODE = "code"
    INPUTS = "inputs"
    OPTIONS = "options"
    ENVIRONMENT = "environment"


class Reason(StrEnum):
    """Why an entry is in an eviction or purge plan."""

    AGE = "age"  # not accessed within max_age
    ORPHAN = "orphan"  # nothing references it; nothing can hit through it
    RECREATABLE = "recreatable"  # a kept graph writes it again on its next hit
    SIZE = "size"  # over max_size
    FILES = "files"  # over max_files
    FREE = "free"  # under the free-space floor
    DEPENDENT = "dependent"  # every entry that needs it is going
    PURGE = "purge"  # chosen by `cachemgr purge`


class Held(StrEnum):
    """Why an entry a plan wanted was kept."""

    PINNED = "pinned"
    GRACE = "grace"  # written or read within the grace period
    LOCK = "lock held"  # a lock that guards it is held by a compile
    IN_PROGRESS = "write in progress"  # a temporary file inside it
    UNSAFE = "unsafe path"  # a symlink, or a path that would leave the root
    MOUNTED = "another mount"  # at or below a mount point inside the root: not the cache's to delete
    CHANGED = "changed since planned"  # a file or directory was replaced between plan and delete
    GONE = "already gone"  # another process removed it first
    FAILED = "delete failed"  # the file system refused (permissions, read-only, ...)
    UNPARSED = "not parsed yet"  # what it references is unknown until the entry is parsed


class Fate(StrEnum):
    """What eviction would do with an entry now, under the configured limits (`show`)."""

    EVICTED = "would be evicted now"  # in the plan, and no keep rule of the executor holds it
    KEPT = "kept"  # the plan wants it, but a keep rule holds it (a `Held` reason)
    NOT_PLANNED = "not planned"  # no limit takes it
    UNKNOWN = "unknown"  # the cache directory cannot be opened to ask


class Policy(StrEnum):
    LRU = "lru"
    COST = "cost"


class Event(StrEnum):
    """What happened to the cache, as the `events` table records it."""

    NEW = "new"  # a compile wrote an entry
    HIT = "hit"  # a workload read an entry
    EVICT = "evict"  # cachemgr deleted an entry
    LOADED = "loaded"  # an entry written by `cachemgr import` or filled from a remote cache: no compile
