"""Why did this compile not hit? Diff the hash components of fxgraph entries.

Every fxgraph entry records the components its key was hashed from (the graph code `gm`, each
input's TensorMetadata, `fx_kwargs[...]`, every `inductor_config[...]`, torch version, system
info, ...). The scanner stores them as deduplicated sets, one per part (code, inputs, options,
environment); here they are read through the index's Store once per set and compared in Python,
never re-parsed from the pickles. Two entries that share a set share all of its components, so
most comparisons are one identity test per part. torch 2.5 and 2.6 record no components: their
entries are "not recorded", and only what they do record is compared.

This module is also the one definition of what the cache's activity counts (`activity`): a
*compile* is a new fxgraph entry that was not loaded; a *recompile* is a compile of a graph
compiled before in another form (verdict `recompile`: the nearest earlier entry is the same
graph with something changed, or `guards`: the same key for another guard set); a *hit* is a
read of an fxgraph entry; entries written by `cachemgr import` or copied from elsewhere are
*loaded*. `stats`, `explain --summary` and the daemon's metrics all count through it.

Two entries that differ in exactly one thing differ in exactly one component (checked on real
CPU caches: an inductor option, an input dtype, an input stride, the code). A few components
move *because* of another change and are marked `derived` rather than named as a cause:
`fx_kwargs[static_input_idxs]` and `inputs_to_check[i]` renumber when inputs are added or
removed, and the graph code gains symbolic arguments when shapes become dynamic. A forward and
its backward graph differ in `fx_kwargs[is_backward]` and more: the nearest earlier entry is
looked for with the same graph code first, so a backward is compared with a backward.
"""

from __future__ import annotations

import difflib
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cachemgr.errors import NotFound, UsageError
from cachemgr.index.store import CompileEvent, GraphEntry, Store
from cachemgr.vocab import Event, Kind

GROUPS = ("code", "inputs", "options", "environment", "other", "entry")  # entry: fields outside the key
ENVIRONMENT = {
    "torch_version",
    "cuda_matmul_settings",
    "deterministic_algorithms_settings",
    "default_dtype",
    "cache_key_tag",
    "cpp_runtime_thread_count",
}
# A forward and its backward, or an inference graph and a training forward, are other graphs.
GRAPH_ROLES = {
    "fx_kwargs[is_backward]": ("a backward", "a forward"),
    "fx_kwargs[is_inference]": ("an inference", "a training"),
}
NEW_GRAPH_RATIO = 0.5  # below this line similarity the nearest code is another graph, not an edit
NEAREST = 3


def group_of(name: str) -> str:
    if name == "gm":
        return "code"
    if name.startswith(("example_inputs[", "inputs_to_check[")):
        return "inputs"
    if name in ENVIRONMENT or name.startswith("system_info["):
        return "environment"
    if (
        name.startswith(("fx_kwargs[", "inductor_config"))
        or "pass" in name
        or "partitioner" in name
        or name in ("precompile_enabled", "provenance_tracking_level")
    ):
        return "options"
    return "other"


# -- inputs: TensorMetadata(...) values -------------------------------------------------------

MAIN_FIELDS = ("dtype", "shape", "stride", "device")
_SYMBOL = re.compile(r"\b[a-z]+\d+\b")
_INDEX = re.compile(r"\[(\d+)\]$")


def _split_top(body: str) -> list[str]:
    """'a=1, b=f(x, y)' -> ['a=1', 'b=f(x, y)']: split on commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in body:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_input(value: str, truncated_at: int = 200) -> dict[str, str]:
    """The fields of one example input. A tensor gives dtype/shape/stride/device/...; a scalar
    (a SymInt such as ('s33',), or a literal) gives {'scalar': ...}."""
    value = value or ""
    if not value.startswith("TensorMetadata("):
        return {"scalar": value.strip().strip("(),").strip("'\"") or "?"}
    body = value[len("TensorMetadata(") :]
    complete = len(value) < truncated_at
    if complete and body.endswith(")"):
        body = body[:-1]
    parts = _split_top(body)
    if not complete and parts:
        parts = parts[:-1]  # the stored value was cut: its last field may be partial
    out: dict[str, str] = {}
    for p in parts:
        k, sep, v = p.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    if "dtype" in out:
        out["dtype"] = out["dtype"].removeprefix("torch.")
    if "shape" in out:
        out["shape"] = out["shape"].removeprefix("torch.Size(").removesuffix(")")
    if "device" in out:
        m = re.match(r"device\(type='(\w+)'(?:, index=(\d+))?\)", out["device"])
        if m:
            out["device"] = m[1] + (f":{m[2]}" if m[2] is not None else "")
    return out


def input_text(fields: dict[str, str]) -> str:
    """One input, short: 'float32[8, 16] stride (16, 1) cpu' or the scalar."""
    if "scalar" in fields:
        return fields["scalar"]
    return (
        f"{fields.get('dtype', '?')}{fields.get('shape', '[?]')} stride {fields.get('stride', '?')} "
        f"{fields.get('device', '?')}"
    )


def changed_fields(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """Which fields of an input differ: dtype, shape (or 'shape (dynamic)'), stride, device, ..."""
    if ("scalar" in a) != ("scalar" in b):
        return ["kind (tensor vs scalar)"]
    if "scalar" in a:
        return ["value"] if a["scalar"] != b["scalar"] else []
    out = []
    for k in MAIN_FIELDS:
        if a.get(k) != b.get(k):
            if k == "shape" and _SYMBOL.search(b.get(k) or "") and not _SYMBOL.search(a.get(k) or ""):
                out.append("shape (dynamic)")
            else:
                out.append(k)
    for k in sorted(set(a) & set(b)):  # a field missing on one side was cut off, not changed
        if k in MAIN_FIELDS or a[k] == b[k]:
            continue
        if k in ("memory_format", "storage_bytes") and out:
            continue  # read off the shape and strides: not a cause of their own
        out.append(k)
    return out


def _coarse(fields: dict[str, str]) -> str:
    """What an input is, for aligning two input lists of different lengths."""
    if "scalar" in fields:
        return "scalar"
    rank = fields.get("shape", "").count(",") + 1 if fields.get("shape") not in (None, "[]") else 0
    return f"{fields.get('dtype')}/{rank}/{fields.get('device')}"


# -- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    group: str
    name: str
    a: str | None  # value in A (None: A has no such component)
    b: str | None
    fields: tuple[str, ...] = ()  # inputs: which fields changed
    derived: str | None = None  # why this is a consequence of another change, not a cause

    def cause(self) -> str | None:
        if self.derived:
            return None
        if self.group == "code":
            return "the graph code changed"
        if self.name.startswith("example_inputs["):
            if self.a is None or self.b is None:
                return "inputs were added or removed"
            if any(f.startswith("shape (dynamic)") for f in self.fields):
                return "input shapes became dynamic"
            return "an input's " + " and ".join(self.fields or ("metadata",)) + " changed"
        return f"{self.name} changed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "a": self.a,
            "b": self.b,
            "fields": list(self.fields),
            "derived": self.derived,
        }


def entry_dict(e: GraphEntry, shorts: dict[str, str]) -> dict[str, Any]:
    return {"key": e.key, "graph_key": e.graph_key, "mtime": e.mtime, "short": shorts.get(e.key, e.key)}


@dataclass(frozen=True)
class Diff:
    a: GraphEntry
    b: GraphEntry
    shared: int
    changes: tuple[Change, ...]
    code_diff: tuple[str, ...] = ()
    code_similarity: float | None = None  # line similarity of the two graph codes, when they differ
    dynamic: bool = False  # B takes symbolic sizes where A took fixed ones
    not_recorded: str | None = None  # who records no hash components: then only recorded fields are compared

    def weight(self) -> int:
        """How much differs: one per component, one per changed field of an input."""
        return sum(max(1, len(c.fields)) for c in self.changes if not c.derived)

    def other_graph(self) -> str | None:
        """Why A and B are different graphs, not one graph edited (None when they are one): a
        forward and a backward, or code with little in common (and not just made dynamic)."""
        for c in self.changes:
            if c.name in GRAPH_ROLES:
                yes, no = GRAPH_ROLES[c.name]
                this, other = (yes, no) if c.b == "True" else (no, yes)
                return f"{this} graph; the nearest earlier entry is {other} graph"
        if not self.dynamic and self.code_similarity is not None and self.code_similarity < NEW_GRAPH_RATIO:
            return f"no earlier entry has similar code ({self.code_similarity:.0%} of lines alike)"
        return None

    @property
    def same(self) -> bool:
        """Both record their hash components, and these are the same."""
        return not self.changes and self.not_recorded is None

    def causes(self) -> list[str]:
        return list(dict.fromkeys(c for ch in self.changes if (c := ch.cause())))

    def by_group(self) -> dict[str, list[Change]]:
        out: dict[str, list[Change]] = {g: [] for g in GROUPS}
        for c in self.changes:
            out[c.group].append(c)
        return {g: cs for g, cs in out.items() if cs}

    def as_dict(self, shorts: dict[str, str]) -> dict[str, Any]:
        return {
            "a": entry_dict(self.a, shorts),
            "b": entry_dict(self.b, shorts),
            "same": self.same,
            "not_recorded": self.not_recorded,
            "shared": self.shared,
            "differ": len(self.changes),
            "causes": self.causes(),
            "groups": {g: [c.as_dict() for c in cs] for g, cs in self.by_group().items()},
            "code_diff": list(self.code_diff),
            "code_similarity": self.code_similarity,
        }


@dataclass(frozen=True)
class Candidate:
    entry: GraphEntry
    same_code: bool
    shared: int
    differ: int

    def as_dict(self, shorts: dict[str, str]) -> dict[str, Any]:
        return {
            **entry_dict(self.entry, shorts),
            "same_code": self.same_code,
            "shared": self.shared,
            "differ": self.differ,
        }


# Why a compile happened when no component change says it, as the summary words it after "N graphs".
VERDICT_CAUSES = {
    "first": "compiled for the first time in this cache",
    "new-graph": "compiled, unlike any earlier graph",
    "guards": "compiled again under the same key for another guard set",
    "unrecorded": "compiled; why is not recorded (their torch records no hash components)",
    "gone": "compiled; their entries are no longer in the index",
}
RECOMPILED = frozenset({"recompile", "guards"})  # the verdicts that make a compile a recompile


@dataclass(frozen=True)
class Miss:
    """One compile (a new fxgraph entry) and why no earlier entry served it."""

    event: CompileEvent
    entry: GraphEntry | None  # None once the entry is gone from the index
    verdict: str  # first | new-graph | guards | recompile | unrecorded | gone
    nearest: tuple[Candidate, ...] = ()
    diff: Diff | None = None
    guards: tuple[str | None, str | None] = (None, None)  # (nearest's, this one's) for 'guards'
    note: str | None = None  # new-graph: why it counts as another graph

    @property
    def key(self) -> str:
        return self.event.key

    @property
    def recompiled(self) -> bool:
        return self.verdict in RECOMPILED

    def causes(self) -> list[str]:
        if self.verdict in VERDICT_CAUSES:
            return [VERDICT_CAUSES[self.verdict]]
        return (self.diff.causes() if self.diff else []) or ["its hash components changed"]

    def cause(self) -> str:
        """All its causes in one phrase: the summary counts each compile once."""
        return " and ".join(self.causes())

    def as_dict(self, shorts: dict[str, str]) -> dict[str, Any]:
        ev = self.event
        return {
            "key": ev.key,
            "graph_key": ev.graph_key,
            "short": shorts.get(ev.key, ev.key),
            "ts": ev.ts,
            "mtime": self.entry.mtime if self.entry else None,
            "compile_seconds": ev.seconds,
            "verdict": self.verdict,
            "recompile": self.recompiled,
            "causes": self.causes(),
            "nearest": [c.as_dict(shorts) for c in self.nearest],
            "diff": self.diff.as_dict(shorts) if self.diff else None,
            "guards": {"nearest": self.guards[0], "this": self.guards[1]} if self.verdict == "guards" else None,
            "note": self.note,
        }


@dataclass(frozen=True)
class SummaryLine:
    cause: str
    graphs: int
    seconds: float
    recompile: bool

    def text(self) -> str:
        s = "" if self.graphs == 1 else "s"
        secs = f" ({self.seconds:.1f} s compiling)" if self.seconds else ""
        if not self.recompile or self.cause == VERDICT_CAUSES["guards"]:
            return f"{self.graphs} graph{s} {self.cause}{secs}"
        return f"{self.graphs} graph{s} recompiled because {self.cause}{secs}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "graphs": self.graphs,
            "compile_seconds": round(self.seconds, 3),
            "recompile": self.recompile,
            "text": self.text(),
        }


# -- comparing entries ---------------------------------------------------------------------------------


class Explainer:
    """explain and diff over one cache: its fxgraph entries read once, their component sets read
    as needed (hashes to compare, values only to show a difference) and compared in Python."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.entries = store.graph_entries()  # oldest first
        self.position = {e.id: i for i, e in enumerate(self.entries)}
        self.by_key = {e.key: e for e in self.entries}
        self.same_code: dict[int, list[GraphEntry]] = defaultdict(list)
        for e in self.entries:
            if "code" in e.sets:
                self.same_code[e.sets["code"]].append(e)
        self._hashes: dict[int, dict[str, str]] = {}
        self._values: dict[int, dict[str, str]] = {}
        self._pairs: dict[tuple[int, int], tuple[int, int]] = {}

    # -- component sets --------------------------------------------------------------------------

    def _load(self, set_ids: Iterable[int], values: bool = False) -> None:
        cache = self._values if values else self._hashes
        missing = {s for s in set_ids if s not in cache}
        for set_id, items in self.store.component_sets(missing, values=values).items():
            self._hashes[set_id] = {n: h for n, (h, _) in items.items()}
            if values:
                self._values[set_id] = {n: v or "" for n, (_, v) in items.items()}
        for s in missing:  # a set with no items
            self._hashes.setdefault(s, {})
            if values:
                self._values.setdefault(s, {})

    def hashes(self, e: GraphEntry) -> dict[str, str]:
        """name -> hash of every component of E."""
        self._load(e.sets.values())
        return {n: h for s in e.sets.values() for n, h in self._hashes[s].items()}

    def values(self, e: GraphEntry, parts: Iterable[str]) -> dict[str, str]:
        """name -> value of E's components in these parts."""
        sets = [e.sets[p] for p in parts if p in e.sets]
        self._load(sets, values=True)
        return {n: v for s in sets for n, v in self._values[s].items()}

    def _pair(self, sa: int | None, sb: int | None) -> tuple[int, int]:
        """(shared, differing) components of two sets of one part (None: the part is absent)."""
        if sa == sb:
            return (len(self._hashes[sa]) if sa is not None else 0), 0
        key = (sa if sa is not None else -1, sb if sb is not None else -1)
        if key not in self._pairs:
            a = self._hashes[sa] if sa is not None else {}
            b = self._hashes[sb] if sb is not None else {}
            both = a.keys() & b.keys()
            shared = sum(1 for n in both if a[n] == b[n])
            self._pairs[key] = self._pairs[key[::-1]] = (shared, len(a) - shared + len(b) - len(both))
        return self._pairs[key]

    def distance(self, a: GraphEntry, b: GraphEntry) -> tuple[int, int]:
        """(shared, differing) components of two entries, as if compared name by name."""
        shared = differ = 0
        for part in a.sets.keys() | b.sets.keys():
            s, d = self._pair(a.sets.get(part), b.sets.get(part))
            shared += s
            differ += d
        return shared, differ

    # -- finding entries ---------------------------------------------------------------------------

    def resolve(self, spec: str) -> tuple[GraphEntry, int]:
        """The fxgraph entry KEY names (any form `Store.resolve` takes), and how many it named:
        the newest of them is taken."""
        try:
            match = self.store.resolve(spec)
        except NotFound:
            raise NotFound(
                f"no fxgraph entry {spec!r} in the index (only fxgraph entries have hash components; "
                "try: cachemgr ls --kind fxgraph)"
            ) from None
        found = [self.by_key[e.key] for e in match.entries if e.key in self.by_key]
        if not found:
            e = match.entries[0]
            why = (
                f"it is a {e.kind} entry; only fxgraph entries have hash components"
                if e.kind != Kind.FXGRAPH
                else "it is not parsed yet (run: cachemgr scan)"
                if not e.parsed
                else f"it is corrupt: {e.corrupt}"
            )
            raise UsageError(f"cannot compare {spec!r}: {why}")
        return max(found, key=lambda e: e.order), len(found)

    def graphs(self, spec: str) -> set[str]:
        """The graph key(s) KEY names."""
        return {self.store.resolve(spec).graph}

    def earlier(self, e: GraphEntry) -> list[GraphEntry]:
        return self.entries[: self.position[e.id]]

    def nearest(self, e: GraphEntry, k: int = NEAREST) -> list[Candidate]:
        """The earlier entries closest to E: with the same graph code if any, ranked by the
        components they share, then by how few differ, then the newest."""
        pos = self.position[e.id]
        same = [o for o in self.same_code.get(e.sets.get("code", -1), []) if self.position[o.id] < pos]
        pool = same or [o for o in self.entries[:pos] if o.sets]
        self._load({s for o in pool for s in o.sets.values()} | set(e.sets.values()))
        out = [Candidate(o, o in same, *self.distance(o, e)) for o in pool]
        out.sort(key=lambda c: (not c.same_code, -c.shared, c.differ, -c.entry.mtime))
        return out[:k]

    # -- diff ----------------------------------------------------------------------------------------

    def diff(self, a: GraphEntry, b: GraphEntry) -> Diff:
        """The components that differ between entries A and B, grouped, with derived ones marked."""
        if not a.sets or not b.sets:
            return self._unrecorded(a, b)
        ha, hb = self.hashes(a), self.hashes(b)
        differing = [n for n in ha.keys() | hb.keys() if ha.get(n) != hb.get(n)]
        shared = len(ha.keys() & hb.keys()) - sum(1 for n in differing if n in ha and n in hb)
        parts = {p for p in a.sets.keys() | b.sets.keys() if a.sets.get(p) != b.sets.get(p)}  # sets that differ
        va, vb = self.values(a, parts), self.values(b, parts)
        plain: list[Change] = []
        inputs_a: dict[int, str] = {}
        inputs_b: dict[int, str] = {}
        gm: tuple[str, str] | None = None
        for name in differing:
            xa, xb = va.get(name), vb.get(name)
            if name.startswith("example_inputs[") and (m := _INDEX.search(name)):
                if name in ha:
                    inputs_a[int(m[1])] = xa or ""
                if name in hb:
                    inputs_b[int(m[1])] = xb or ""
                continue
            if name == "gm":
                gm = (xa or "", xb or "")
            plain.append(Change(group_of(name), name, _show(xa, ha.get(name)), _show(xb, hb.get(name))))
        inputs, reshaped = _input_changes(_inputs(va), _inputs(vb), inputs_a, inputs_b)
        dynamic = any(
            any(f.startswith("shape (dynamic)") for f in c.fields)
            or (c.a is None and c.b is not None and _SYMBOL.fullmatch(c.b or ""))
            for c in inputs
        )
        changes = []
        for c in plain + inputs:
            derived = c.derived
            if reshaped and (c.name == "fx_kwargs[static_input_idxs]" or c.name.startswith("inputs_to_check[")):
                derived = "the inputs were renumbered"
            elif dynamic and (c.name == "gm" or c.a is None and _SYMBOL.fullmatch(c.b or "")):
                derived = "the shapes became dynamic"  # new code with symbolic sizes, a size argument
            changes.append(Change(c.group, c.name, c.a, c.b, c.fields, derived))
        changes.sort(key=lambda c: (GROUPS.index(c.group), c.derived is not None, _natural(c.name)))
        code_diff: tuple[str, ...] = ()
        similarity = None
        if gm is not None:
            ratio, code_diff = diff_code(gm[0].splitlines(), gm[1].splitlines())
            similarity = round(ratio, 3)
        # the gm change's values: the whole code is in code_diff
        changes = [
            Change(
                c.group,
                c.name,
                None if c.a is None else "(graph code)",
                None if c.b is None else "(graph code)",
                c.fields,
                c.derived,
            )
            if c.name == "gm"
            else c
            for c in changes
        ]
        return Diff(a, b, shared, tuple(changes), code_diff, similarity, dynamic)

    def _unrecorded(self, a: GraphEntry, b: GraphEntry) -> Diff:
        """Entries whose torch records no hash components: compare what both do record."""
        ea, eb = self.store.entry_by_key(a.key), self.store.entry_by_key(b.key)
        who = " and ".join(f"{label} ({_torch(e)})" for label, e, g in (("A", ea, a), ("B", eb, b)) if not g.sets)
        changes = []
        for name, field_ in UNRECORDED_FIELDS:
            x, y = (getattr(ea, field_, None) if ea else None), (getattr(eb, field_, None) if eb else None)
            if x is not None and y is not None and x != y:
                changes.append(Change("entry", name, str(x), str(y)))
        return Diff(a, b, 0, tuple(changes), not_recorded=who)

    # -- explaining compiles ---------------------------------------------------------------------------

    def explain(self, ev: CompileEvent) -> Miss:
        e = self.by_key.get(ev.key)
        if e is None:
            return Miss(ev, None, "gone")
        earlier = self.earlier(e)
        if not earlier:
            return Miss(ev, e, "first")
        twin = next((o for o in reversed(earlier) if e.graph_key and o.graph_key == e.graph_key), None)
        if not e.sets or not any(o.sets for o in earlier):
            if twin is not None:  # one key again: another guard set, whatever is recorded
                return Miss(ev, e, "guards", (Candidate(twin, True, 0, 0),), None, (twin.guards, e.guards))
            return Miss(ev, e, "unrecorded", note=self._unrecorded(earlier[-1], e).not_recorded)
        cands = self.nearest(e)
        # Ties on the component counts are broken by what differs inside them (an input's fields):
        # a stride-only change is nearer the contiguous original than a dtype+stride one.
        top = (cands[0].same_code, cands[0].shared, cands[0].differ)
        tied = [c for c in cands if (c.same_code, c.shared, c.differ) == top]
        best, d = min(((c, self.diff(c.entry, e)) for c in tied), key=lambda cd: cd[1].weight())
        cands = [best] + [c for c in cands if c is not best]
        if d.same:
            return Miss(ev, e, "guards", tuple(cands), d, (best.entry.guards, e.guards))
        if not best.same_code and d.other_graph():
            return Miss(ev, e, "new-graph", tuple(cands), d, note=d.other_graph())
        return Miss(ev, e, "recompile", tuple(cands), d)

    def misses(self, events: Iterable[CompileEvent], graphs: set[str] | None = None) -> list[Miss]:
        """Explain each compile (loaded entries are no compiles), of `graphs` only if given."""
        return [self.explain(ev) for ev in events if not ev.loaded and (graphs is None or ev.graph_key in graphs)]

    def shorts(self, misses: Sequence[Miss] = (), diffs: Sequence[Diff] = ()) -> dict[str, str]:
        """Short keys of every entry these name."""
        named = [m.entry for m in misses if m.entry] + [c.entry for m in misses for c in m.nearest]
        named += [e for d in diffs for e in (d.a, d.b)] + [e for m in misses if m.diff for e in (m.diff.a, m.diff.b)]
        return self.store.short_keys({e.key: e for e in named}.values())


UNRECORDED_FIELDS = (
    ("torch version", "torch_version"),
    ("torch build (hash)", "torch_version_hash"),
    ("system", "system_hash"),
    ("signature", "signature"),
    ("options hash", "options_hash"),
    ("device types", "device_types"),
    ("guards", "guards"),
)


def _torch(e: Any) -> str:
    version = getattr(e, "torch_version", None)
    return f"torch {version}" if version else "an older torch"


def _inputs(values: dict[str, str]) -> list[str]:
    """Every example input's value, in input order."""
    return [values[n] or "" for n in sorted((n for n in values if n.startswith("example_inputs[")), key=_natural)]


def _input_changes(
    all_a: list[str], all_b: list[str], da: dict[int, str], db: dict[int, str]
) -> tuple[list[Change], bool]:
    """Input changes; True when inputs were added or removed (the rest renumbered)."""
    if len(all_a) == len(all_b):
        out = []
        for i in sorted(set(da) | set(db)):
            fa, fb = parse_input(da.get(i, "")), parse_input(db.get(i, ""))
            out.append(
                Change(
                    "inputs",
                    f"example_inputs[{i}]",
                    input_text(fa),
                    input_text(fb),
                    tuple(changed_fields(fa, fb) or ["beyond the stored value"]),
                )
            )
        return out, False
    # Different lengths: align the two lists by what each input is.
    pa, pb = [parse_input(v) for v in all_a], [parse_input(v) for v in all_b]
    out = []
    sm = difflib.SequenceMatcher(None, [_coarse(f) for f in pa], [_coarse(f) for f in pb], autojunk=False)
    for _, i1, i2, j1, j2 in sm.get_opcodes():
        pairs = list(zip(range(i1, i2), range(j1, j2), strict=False))  # the shorter side's length
        for i, j in pairs:
            if all_a[i] != all_b[j]:
                name = f"example_inputs[{j}]" + ("" if i == j else f" (was [{i}])")
                out.append(
                    Change(
                        "inputs",
                        name,
                        input_text(pa[i]),
                        input_text(pb[j]),
                        tuple(changed_fields(pa[i], pb[j]) or ["beyond the stored value"]),
                    )
                )
        for i in range(i1 + len(pairs), i2):
            out.append(Change("inputs", f"example_inputs[{i}] (A only)", input_text(pa[i]), None, ("removed",)))
        for j in range(j1 + len(pairs), j2):
            out.append(Change("inputs", f"example_inputs[{j}]", None, input_text(pb[j]), ("added",)))
    return out, True


def _natural(name: str) -> tuple:
    m = _INDEX.search(name.split(" ")[0])
    return (name.split("[")[0], int(m[1]) if m else -1, name)


def _show(value: str | None, h: str | None) -> str | None:
    if h is None:
        return None
    return value if value else f"(hash {h[:12]})"


# -- the summary and the activity counts ------------------------------------------------------------


def summarize(misses: Sequence[Miss]) -> list[SummaryLine]:
    """One line per cause, each compile counted once (a compile with two causes is one line of
    both): the lines add up to the compiles."""
    groups: dict[str, list[Miss]] = defaultdict(list)
    for m in misses:
        groups[m.cause()].append(m)
    return sorted(
        (
            SummaryLine(c, len(ms), sum(m.event.seconds or 0.0 for m in ms), ms[0].recompiled)
            for c, ms in groups.items()
        ),
        key=lambda s: (-s.graphs, -s.seconds, s.cause),
    )


@dataclass(frozen=True)
class Activity:
    """What happened in the cache over a window (or a range of events): the figures `stats`,
    `explain --summary` and the daemon's metrics print."""

    window: float | None
    hits: int
    compiles: int
    recompiles: int
    loaded: int
    compile_seconds: float
    evictions: int
    compile_times: tuple[float, ...] = ()  # each compile's seconds, where recorded

    @property
    def hit_ratio(self) -> float | None:
        lookups = self.hits + self.compiles
        return self.hits / lookups if lookups else None

    def as_dict(self) -> dict[str, Any]:
        ratio = self.hit_ratio
        return {
            "window_seconds": self.window,
            "hits": self.hits,
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "loaded": self.loaded,
            "hit_ratio": None if ratio is None else round(ratio, 4),
            "compile_seconds": round(self.compile_seconds, 3),
            "evictions": self.evictions,
        }


# Lines x lines diffed line by line where two graph codes differ: difflib's matching is quadratic
# in them (two hand-made codes of 40,000 repeated lines kept `explain` and `stats` busy for ever).
MAX_DIFF_CELLS = 1_000_000
_HUNK = re.compile(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")


def diff_code(la: list[str], lb: list[str]) -> tuple[float, tuple[str, ...]]:
    """How alike two graph codes' lines are (0-1, as difflib's ratio) and their unified diff (one
    line of context). The lines they share at the start and the end are set aside first (a
    changed graph is mostly the same code); if what is left between is over MAX_DIFF_CELLS, the
    likeness counts the lines both hold and the diff says it was not made."""
    n = min(len(la), len(lb))
    head = 0
    while head < n and la[head] == lb[head]:
        head += 1
    tail = 0
    while tail < n - head and la[-1 - tail] == lb[-1 - tail]:
        tail += 1
    if head == n and len(la) == len(lb):
        return 1.0, ()
    start = max(0, head - 1)  # (a line of context kept each side)
    ma, mb = la[start : len(la) - max(0, tail - 1)], lb[start : len(lb) - max(0, tail - 1)]
    kept = len(la) - len(ma)  # lines alike outside what is diffed
    total = len(la) + len(lb)
    if len(ma) * len(mb) > MAX_DIFF_CELLS:
        alike = kept + sum((Counter(ma) & Counter(mb)).values())
        return 2 * alike / total, (f"(the codes differ in {len(ma):,} and {len(mb):,} lines: too many to diff here)",)
    sm = difflib.SequenceMatcher(None, ma, mb, autojunk=False)
    alike = kept + sum(m.size for m in sm.get_matching_blocks())
    out = []
    for line in difflib.unified_diff(ma, mb, "A", "B", n=1, lineterm=""):
        m = _HUNK.fullmatch(line) if line.startswith("@@") else None
        if m:  # (numbered from the start of the codes, not of what was diffed)
            line = f"@@ -{int(m[1]) + start}{m[2] or ''} +{int(m[3]) + start}{m[4] or ''} @@"
        out.append(line)
    return 2 * alike / total, tuple(out)


def activity(
    store: Store,
    window: float | None = None,
    after_id: int = 0,
    upto_id: int | None = None,
    misses: Sequence[Miss] | None = None,
    since: float | None = None,
) -> Activity:
    """The activity of the last `window` seconds (or since the epoch time `since`, or of the
    events in (after_id, upto_id]). `misses`: the compiles of that range, already explained."""
    if since is None and window is not None:
        since = time.time() - window
    events = store.compile_events(since, after_id, upto_id)
    counts = store.event_counts(since, after_id, upto_id)
    compiles = [ev for ev in events if not ev.loaded]
    if misses is None:
        misses = Explainer(store).misses(compiles) if compiles else []
    return Activity(
        window,
        counts.get(Event.HIT, 0),
        len(compiles),
        sum(1 for m in misses if m.recompiled),
        len(events) - len(compiles),
        sum(ev.seconds or 0.0 for ev in compiles),
        counts.get(Event.EVICT, 0),
        tuple(ev.seconds for ev in compiles if ev.seconds is not None),
    )


def since_epoch(window: float | None) -> float:
    return 0.0 if window is None else time.time() - window


__all__ = [
    "Activity",
    "Candidate",
    "Change",
    "Diff",
    "Explainer",
    "Miss",
    "SummaryLine",
    "activity",
    "changed_fields",
    "group_of",
    "input_text",
    "parse_input",
    "since_epoch",
    "summarize",
]


# -- the fleet's fragmentation: what splits one graph's cache between hosts ---------------------------

FRAGMENT_PARTS = ("options", "environment")  # the parts a graph's code and inputs do not decide


@dataclass(frozen=True)
class Split:
    """One component whose value differs between hosts for the same graph code and inputs: the
    path-valued or per-host factor that gives every host its own key (`explain --summary` over a
    fleet index)."""

    component: str
    graphs: int  # graph codes (code + inputs) it splits
    hosts: tuple[str, ...]
    values: tuple[tuple[str, str], ...]  # (host, value) as each host records it

    def text(self) -> str:
        s = "" if self.graphs == 1 else "s"
        shown = "; ".join(f"{h}: {v}" for h, v in self.values[:4]) + ("; ..." if len(self.values) > 4 else "")
        return (
            f"{self.graphs} graph{s} split between {len(self.hosts)} hosts because {self.component} differs ({shown})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "graphs": self.graphs,
            "hosts": list(self.hosts),
            "values": [{"host": h, "value": v} for h, v in self.values],
            "text": self.text(),
        }


def fragmentation(store: Store) -> list[Split]:
    """Over every cache of the index: the fxgraph entries of one graph (same code and inputs
    component sets) that hosts hold under different keys, and the components that differ between
    those hosts. Empty for an index of one host."""
    entries: dict[int, dict[str, Any]] = {}
    for host, eid, gk, part, set_id in store.fleet_graph_sets():
        e = entries.setdefault(eid, {"host": host, "graph_key": gk, "sets": {}})
        e["sets"][part] = set_id
    if len({e["host"] for e in entries.values()}) < 2:
        return []
    groups: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in entries.values():
        if "code" in e["sets"]:
            groups[(e["sets"]["code"], e["sets"].get("inputs", -1))].append(e)
    split = [g for g in groups.values() if len({e["host"] for e in g}) > 1 and len({e["graph_key"] for e in g}) > 1]
    ids = {e["sets"][p] for g in split for e in g for p in FRAGMENT_PARTS if p in e["sets"]}
    sets = store.component_sets(ids, values=True)
    counts: dict[str, int] = defaultdict(int)
    hosts: dict[str, set[str]] = defaultdict(set)
    values: dict[str, dict[str, str]] = defaultdict(dict)
    for g in split:
        seen: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # name -> host -> hashes
        shown: dict[str, dict[str, str]] = defaultdict(dict)
        for e in g:
            comps: dict[str, tuple[str, str | None]] = {}
            for p in FRAGMENT_PARTS:
                comps.update(sets.get(e["sets"].get(p, -1), {}))
            for name, (h, v) in comps.items():
                seen[name][e["host"]].add(h)
                shown[name].setdefault(e["host"], v or f"(hash {h[:12]})")
        for name, by_host in seen.items():
            variants = {frozenset(hs) for hs in by_host.values()}
            if len(variants) > 1 or len(by_host) < len({e["host"] for e in g}):
                counts[name] += 1
                hosts[name].update(by_host)
                for h, v in shown[name].items():
                    values[name].setdefault(h, v)
    return sorted(
        (Split(n, c, tuple(sorted(hosts[n])), tuple(sorted(values[n].items()))) for n, c in counts.items()),
        key=lambda s: (-s.graphs, s.component),
    )


__all__ += ["Split", "fragmentation"]
