"""Why did this compile not hit? Diff the hash components of fxgraph entries.

Every fxgraph entry records the components its key was hashed from (the graph code `gm`, each
input's TensorMetadata, `fx_kwargs[...]`, every `inductor_config[...]`, torch version, system
info, ...). The scanner stores them in `entry_components`; everything here is SQL over that
table, never a re-parse of the pickles.

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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from cachemgr.errors import NotFound, UsageError

GROUPS = ("code", "inputs", "options", "environment", "other")
ENVIRONMENT = {"torch_version", "cuda_matmul_settings", "deterministic_algorithms_settings", "default_dtype",
               "cache_key_tag", "cpp_runtime_thread_count"}
# A forward and its backward, or an inference graph and a training forward, are other graphs.
GRAPH_ROLES = {"fx_kwargs[is_backward]": ("a backward", "a forward"),
               "fx_kwargs[is_inference]": ("an inference", "a training")}
NEW_GRAPH_RATIO = 0.5  # below this line similarity the nearest code is another graph, not an edit
CODE_DIFF_LINES = 12
NEAREST = 3


def group_of(name: str) -> str:
    if name == "gm":
        return "code"
    if name.startswith(("example_inputs[", "inputs_to_check[")):
        return "inputs"
    if name in ENVIRONMENT or name.startswith("system_info["):
        return "environment"
    if name.startswith(("fx_kwargs[", "inductor_config")) or "pass" in name or "partitioner" in name \
            or name in ("precompile_enabled", "provenance_tracking_level"):
        return "options"
    return "other"


# -- inputs: TensorMetadata(...) values -------------------------------------------------------

MAIN_FIELDS = ("dtype", "shape", "stride", "device")
_SYMBOL = re.compile(r"\b[a-z]+\d+\b")
_INDEX = re.compile(r"\[(\d+)\]$")


def _split_top(body: str) -> list[str]:
    """'a=1, b=f(x, y)' -> ['a=1', 'b=f(x, y)']: split on commas outside brackets."""
    parts, depth, cur = [], 0, []
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
    body = value[len("TensorMetadata("):]
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
    return f"{fields.get('dtype', '?')}{fields.get('shape', '[?]')} stride {fields.get('stride', '?')} " \
           f"{fields.get('device', '?')}"


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
        return {"group": self.group, "name": self.name, "a": self.a, "b": self.b, "fields": list(self.fields),
                "derived": self.derived}


@dataclass(frozen=True)
class EntryRef:
    id: int
    key: str
    graph_key: str | None
    mtime: float

    @property
    def short(self) -> str:
        return short_key(self.key, self.graph_key)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "graph_key": self.graph_key, "mtime": self.mtime, "short": self.short}


@dataclass(frozen=True)
class Diff:
    a: EntryRef
    b: EntryRef
    shared: int
    changes: tuple[Change, ...]
    code_diff: tuple[str, ...] = ()
    code_similarity: float | None = None  # line similarity of the two graph codes, when they differ
    dynamic: bool = False  # B takes symbolic sizes where A took fixed ones

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
                return f"{this} graph; the nearest earlier entry is {other}"
        if not self.dynamic and self.code_similarity is not None and self.code_similarity < NEW_GRAPH_RATIO:
            return f"no earlier entry has similar code ({self.code_similarity:.0%} of lines alike)"
        return None

    @property
    def same(self) -> bool:
        return not self.changes

    def causes(self) -> list[str]:
        return list(dict.fromkeys(c for ch in self.changes if (c := ch.cause())))

    def by_group(self) -> dict[str, list[Change]]:
        out: dict[str, list[Change]] = {g: [] for g in GROUPS}
        for c in self.changes:
            out[c.group].append(c)
        return {g: cs for g, cs in out.items() if cs}

    def as_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.as_dict(), "b": self.b.as_dict(), "same": self.same, "shared": self.shared,
            "differ": len(self.changes), "causes": self.causes(),
            "groups": {g: [c.as_dict() for c in cs] for g, cs in self.by_group().items()},
            "code_diff": list(self.code_diff), "code_similarity": self.code_similarity,
        }


@dataclass(frozen=True)
class Candidate:
    entry: EntryRef
    same_code: bool
    shared: int
    differ: int

    def as_dict(self) -> dict[str, Any]:
        return {**self.entry.as_dict(), "same_code": self.same_code, "shared": self.shared, "differ": self.differ}


# Causes that are no component change, as the summary words them after "N graphs".
VERDICT_CAUSES = {
    "first": "compiled for the first time in this cache",
    "new-graph": "compiled, unlike any earlier graph",
    "guards": "compiled again under the same key for another guard set",
}


@dataclass(frozen=True)
class Miss:
    """One new fxgraph entry (a compile) and why no earlier entry served it."""

    entry: EntryRef
    ts: float
    seconds: float | None
    verdict: str  # first | new-graph | guards | recompile
    nearest: tuple[Candidate, ...] = ()
    diff: Diff | None = None
    guards: tuple[str | None, str | None] = (None, None)  # (nearest's, this one's) for 'guards'
    note: str | None = None  # new-graph: why it counts as another graph

    def causes(self) -> list[str]:
        if self.verdict in VERDICT_CAUSES:
            return [VERDICT_CAUSES[self.verdict]]
        return self.diff.causes() if self.diff else []

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.entry.as_dict(), "ts": self.ts, "compile_seconds": self.seconds, "verdict": self.verdict,
            "causes": self.causes(), "nearest": [c.as_dict() for c in self.nearest],
            "diff": self.diff.as_dict() if self.diff else None,
            "guards": {"nearest": self.guards[0], "this": self.guards[1]} if self.verdict == "guards" else None,
            "note": self.note,
        }


@dataclass(frozen=True)
class SummaryLine:
    cause: str
    graphs: int
    seconds: float

    def text(self) -> str:
        s = "" if self.graphs == 1 else "s"
        secs = f" ({self.seconds:.1f} s compiling)" if self.seconds else ""
        if self.cause in VERDICT_CAUSES.values():
            return f"{self.graphs} graph{s} {self.cause}{secs}"
        return f"{self.graphs} graph{s} recompiled because {self.cause}{secs}"

    def as_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "graphs": self.graphs, "compile_seconds": round(self.seconds, 3),
                "text": self.text()}


def short_key(key: str, graph_key: str | None) -> str:
    """'fz5q6oebaq3sx/r5b6tx': graph key and entry file prefixes; `resolve` accepts it back."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "fxgraph":
        return f"{parts[2][:13]}/{parts[3][:6]}"
    return key


# -- SQL --------------------------------------------------------------------------------------

ENTRY_COLS = "e.id, e.key, e.graph_key, e.mtime"
FX = "e.kind = 'fxgraph' AND e.corrupt IS NULL"

DIFF_SQL = """
SELECT a.name, a.hash, a.value, b.hash, b.value
FROM entry_components a LEFT JOIN entry_components b ON b.entry_id = :b AND b.name = a.name
WHERE a.entry_id = :a AND (b.hash IS NULL OR b.hash <> a.hash)
UNION ALL
SELECT b.name, NULL, NULL, b.hash, b.value FROM entry_components b
WHERE b.entry_id = :b AND NOT EXISTS (SELECT 1 FROM entry_components a WHERE a.entry_id = :a AND a.name = b.name)
"""
SHARED_SQL = """
SELECT COUNT(*) FROM entry_components a
JOIN entry_components b ON b.entry_id = :b AND b.name = a.name AND b.hash = a.hash
WHERE a.entry_id = :a
"""
# Earlier entries of the cache, than entry :n (mtime :t). Ties in mtime go by id.
EARLIER = f"{FX} AND e.cache_id = :cid AND e.id <> :n AND (e.mtime < :t OR (e.mtime = :t AND e.id < :n))"
SAME_CODE_SQL = f"""
SELECT {ENTRY_COLS} FROM entry_components nc
JOIN entry_components oc ON oc.name = 'gm' AND oc.hash = nc.hash
JOIN entries e ON e.id = oc.entry_id
WHERE nc.entry_id = :n AND nc.name = 'gm' AND {EARLIER}
"""
# The components of :n that some entry holds with another hash: the few that vary (the graph
# code, inputs, a changed option). Two range probes per name on the (name, hash) index, so the
# hundreds of config values every entry shares cost a seek each, not a scan.
VARYING_SQL = """
SELECT a.name, a.hash FROM entry_components a WHERE a.entry_id = :n AND (
    EXISTS (SELECT 1 FROM entry_components b WHERE b.name = a.name AND b.hash < a.hash)
    OR EXISTS (SELECT 1 FROM entry_components b WHERE b.name = a.name AND b.hash > a.hash))
"""
# How many of those each earlier entry holds with another hash (an entry absent differs in none).
DIFFERING_SQL = f"""
SELECT {ENTRY_COLS}, d.differ FROM (
    SELECT oc.entry_id, COUNT(*) AS differ FROM entry_components oc WHERE {{varying}} GROUP BY oc.entry_id
) d JOIN entries e ON e.id = d.entry_id
WHERE {EARLIER}
ORDER BY d.differ, e.mtime DESC
"""
DIFFER_SQL = """
SELECT (SELECT COUNT(*) FROM entry_components a LEFT JOIN entry_components b ON b.entry_id = :b AND b.name = a.name
        WHERE a.entry_id = :a AND (b.hash IS NULL OR b.hash <> a.hash))
     + (SELECT COUNT(*) FROM entry_components b WHERE b.entry_id = :b
        AND NOT EXISTS (SELECT 1 FROM entry_components a WHERE a.entry_id = :a AND a.name = b.name))
"""
HAS_EARLIER_SQL = f"SELECT 1 FROM entries e WHERE {EARLIER} LIMIT 1"
GM_SQL = "SELECT value FROM entry_components WHERE entry_id = :n AND name = 'gm'"


def _ref(row) -> EntryRef:
    return EntryRef(int(row[0]), row[1], row[2], float(row[3]))


def resolve(conn, cache_id: int, key: str) -> tuple[EntryRef, int]:
    """The fxgraph entry KEY names, and how many it named (the newest is taken).

    KEY: an entry key, a graph key, a unique prefix of either, or the short form
    'graphprefix/fileprefix' that explain prints.
    """
    like = key.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    where = "e.key = :k OR e.graph_key = :k"
    params: dict[str, Any] = {"cid": cache_id, "k": key}
    rows = conn.execute(text(f"SELECT {ENTRY_COLS} FROM entries e WHERE {FX} AND e.cache_id = :cid AND ({where}) "
                             "ORDER BY e.mtime DESC"), params).fetchall()
    if not rows and len(key) >= 4:
        g, _, f = like.partition("/")
        if f and not key.startswith("fxgraph/"):
            cond = "e.graph_key LIKE :g ESCAPE '\\' AND e.key LIKE :f ESCAPE '\\'"
            params.update(g=g + "%", f="fxgraph/%/%/" + f + "%")
        else:
            cond = "(e.key LIKE :p ESCAPE '\\' OR e.graph_key LIKE :g ESCAPE '\\')"
            params.update(p=like + "%", g=like + "%")
        rows = conn.execute(text(f"SELECT {ENTRY_COLS} FROM entries e WHERE {FX} AND e.cache_id = :cid AND {cond} "
                                 "ORDER BY e.mtime DESC LIMIT 50"), params).fetchall()
    if not rows:
        raise NotFound(f"no fxgraph entry {key!r} in the index (only fxgraph entries have hash components; "
                       "try: cachemgr ls --kind fxgraph)")
    graphs = {r[2] for r in rows}
    if len(graphs) > 1:
        raise UsageError(f"{key!r} names {len(graphs)} different graphs: give more of the key")
    return _ref(rows[0]), len(rows)


def diff(conn, a: EntryRef, b: EntryRef) -> Diff:
    """The components that differ between entries A and B, grouped, with derived ones marked."""
    rows = conn.execute(text(DIFF_SQL), {"a": a.id, "b": b.id}).fetchall()
    shared = int(conn.execute(text(SHARED_SQL), {"a": a.id, "b": b.id}).scalar() or 0)
    plain: list[Change] = []
    inputs_a: dict[int, str] = {}
    inputs_b: dict[int, str] = {}
    gm: tuple[str, str] | None = None
    for name, ha, va, hb, vb in rows:
        if name.startswith("example_inputs["):
            m = _INDEX.search(name)
            if m:
                if ha is not None:
                    inputs_a[int(m[1])] = va
                if hb is not None:
                    inputs_b[int(m[1])] = vb
                continue
        if name == "gm":
            gm = (va or "", vb or "")
        plain.append(Change(group_of(name), name, _show(va, ha), _show(vb, hb)))
    inputs, reshaped = _input_changes(conn, a, b, inputs_a, inputs_b)
    dynamic = any(any(f.startswith("shape (dynamic)") for f in c.fields) or
                  (c.a is None and c.b is not None and _SYMBOL.fullmatch(c.b or "")) for c in inputs)
    changes = []
    for c in plain + inputs:
        derived = c.derived
        if reshaped and (c.name == "fx_kwargs[static_input_idxs]" or c.name.startswith("inputs_to_check[")):
            derived = "the inputs were renumbered"
        elif dynamic and (c.name == "gm" or c.a is None and _SYMBOL.fullmatch(c.b or "")):
            derived = "the shapes became dynamic"  # new code with symbolic sizes, a size argument
        changes.append(Change(c.group, c.name, c.a, c.b, c.fields, derived))
    changes.sort(key=lambda c: (GROUPS.index(c.group), c.derived is not None, _natural(c.name)))
    code_diff, similarity = ((), None)
    if gm is not None:
        la, lb = gm[0].splitlines(), gm[1].splitlines()
        similarity = round(difflib.SequenceMatcher(None, la, lb, autojunk=False).ratio(), 3)
        code_diff = tuple(difflib.unified_diff(la, lb, "A", "B", n=1, lineterm=""))
    # replace the gm change's values: the whole code is in code_diff
    changes = [Change(c.group, c.name, None if c.a is None else "(graph code)", None if c.b is None else "(graph code)",
                      c.fields, c.derived) if c.name == "gm" else c for c in changes]
    return Diff(a, b, shared, tuple(changes), code_diff, similarity, dynamic)


def _input_changes(conn, a: EntryRef, b: EntryRef, da: dict[int, str], db: dict[int, str]
                   ) -> tuple[list[Change], bool]:
    """Input changes; True when inputs were added or removed (the rest renumbered)."""
    count_a = _count_inputs(conn, a.id)
    count_b = _count_inputs(conn, b.id)
    if count_a == count_b:
        out = []
        for i in sorted(set(da) | set(db)):
            fa, fb = parse_input(da.get(i, "")), parse_input(db.get(i, ""))
            out.append(Change("inputs", f"example_inputs[{i}]", input_text(fa), input_text(fb),
                              tuple(changed_fields(fa, fb) or ["beyond the stored value"])))
        return out, False
    # Different lengths: align the two lists (all inputs, read in one query) by what each input is.
    va, vb = _all_inputs(conn, a.id), _all_inputs(conn, b.id)
    pa, pb = [parse_input(v) for v in va], [parse_input(v) for v in vb]
    out = []
    sm = difflib.SequenceMatcher(None, [_coarse(f) for f in pa], [_coarse(f) for f in pb], autojunk=False)
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        pairs = list(zip(range(i1, i2), range(j1, j2)))
        for i, j in pairs:
            if va[i] != vb[j]:
                name = f"example_inputs[{j}]" + ("" if i == j else f" (was [{i}])")
                out.append(Change("inputs", name, input_text(pa[i]), input_text(pb[j]),
                                  tuple(changed_fields(pa[i], pb[j]) or ["beyond the stored value"])))
        for i in range(i1 + len(pairs), i2):
            out.append(Change("inputs", f"example_inputs[{i}] (A only)", input_text(pa[i]), None, ("removed",)))
        for j in range(j1 + len(pairs), j2):
            out.append(Change("inputs", f"example_inputs[{j}]", None, input_text(pb[j]), ("added",)))
    return out, True


def _count_inputs(conn, entry_id: int) -> int:
    return int(conn.execute(text("SELECT COUNT(*) FROM entry_components WHERE entry_id = :n AND name LIKE "
                                 "'example\\_inputs[%' ESCAPE '\\'"), {"n": entry_id}).scalar() or 0)


def _all_inputs(conn, entry_id: int) -> list[str]:
    rows = conn.execute(text("SELECT name, value FROM entry_components WHERE entry_id = :n AND name LIKE "
                             "'example\\_inputs[%' ESCAPE '\\'"), {"n": entry_id}).fetchall()
    return [v for _, v in sorted(rows, key=lambda r: _natural(r[0]))]


def _natural(name: str) -> tuple:
    m = _INDEX.search(name.split(" ")[0])
    return (name.split("[")[0], int(m[1]) if m else -1, name)


def _show(value: str | None, h: str | None) -> str | None:
    if h is None:
        return None
    return value if value else f"(hash {h[:12]})"


# -- nearest earlier entries and recent misses --------------------------------------------------


def nearest(conn, cache_id: int, e: EntryRef, k: int = NEAREST) -> list[Candidate]:
    """The earlier entries closest to E: same graph code first, then the most components shared."""
    p: dict[str, Any] = {"n": e.id, "t": e.mtime, "cid": cache_id}
    same = {r[0]: _ref(r) for r in conn.execute(text(SAME_CODE_SQL), p)}
    varying = conn.execute(text(VARYING_SQL), p).fetchall()
    close: dict[int, tuple[EntryRef, int]] = {}
    if varying:
        conds = []
        for i, (name, h) in enumerate(varying):
            conds.append(f"(oc.name = :vn{i} AND oc.hash <> :vh{i})")
            p.update({f"vn{i}": name, f"vh{i}": h})
        sql = DIFFERING_SQL.format(varying=" OR ".join(conds))
        close = {r[0]: (_ref(r), int(r[4])) for r in conn.execute(text(sql), p)}
    if same:  # rank the same-code entries by how little else differs (absent: nothing does)
        pool = sorted(same.values(), key=lambda o: (close[o.id][1] if o.id in close else 0, -o.mtime))[: k * 3]
    else:
        pool = [o for o, _ in list(close.values())[: k * 3]]
    out = []
    for o in pool:  # exact counts for the few left
        ab = {"a": o.id, "b": e.id}
        shared = int(conn.execute(text(SHARED_SQL), ab).scalar() or 0)
        out.append(Candidate(o, o.id in same, shared, int(conn.execute(text(DIFFER_SQL), ab).scalar() or 0)))
    out.sort(key=lambda c: (not c.same_code, -c.shared, c.differ, -c.entry.mtime))
    return out[:k]


NEW_SQL = f"""
SELECT {ENTRY_COLS}, ev.ts, ev.seconds, e.guards FROM events ev
JOIN entries e ON e.cache_id = ev.cache_id AND e.key = ev.entry_key
WHERE ev.cache_id = :cid AND ev.kind = 'new' AND ev.entry_kind = 'fxgraph' AND ev.ts >= :since AND {FX}
ORDER BY ev.ts, e.id
"""


def explain_entry(conn, cache_id: int, e: EntryRef, ts: float, seconds: float | None,
                  guards: str | None = None) -> Miss:
    cands = nearest(conn, cache_id, e)
    if not cands:
        return Miss(e, ts, seconds, "first")
    # Ties on the component counts are broken by what differs inside them (an input's fields):
    # a stride-only change is nearer the contiguous original than a dtype+stride one.
    tied = [c for c in cands if (c.same_code, c.shared, c.differ) == (cands[0].same_code, cands[0].shared,
                                                                      cands[0].differ)]
    best, d = min(((c, diff(conn, c.entry, e)) for c in tied), key=lambda cd: cd[1].weight())
    if best is not cands[0]:
        cands = [best] + [c for c in cands if c is not best]
    if d.same:
        other = conn.execute(text("SELECT guards FROM entries WHERE id = :n"), {"n": best.entry.id}).scalar()
        return Miss(e, ts, seconds, "guards", tuple(cands), d, (other, guards))
    if not best.same_code and d.other_graph():
        return Miss(e, ts, seconds, "new-graph", tuple(cands), d, note=d.other_graph())
    return Miss(e, ts, seconds, "recompile", tuple(cands), d)


def recent_misses(conn, cache_id: int, since: float, graphs: set[str] | None = None) -> list[Miss]:
    """Explain every new fxgraph entry whose compile event is at or after `since` (epoch seconds)."""
    out = []
    for r in conn.execute(text(NEW_SQL), {"cid": cache_id, "since": since}).fetchall():
        e = _ref(r)
        if graphs is not None and e.graph_key not in graphs:
            continue
        out.append(explain_entry(conn, cache_id, e, float(r[4]), r[5], r[6]))
    return out


def summarize(misses: list[Miss]) -> list[SummaryLine]:
    """One line per cause: how many graphs it recompiled, and the compile time it cost."""
    graphs: dict[str, set[str]] = defaultdict(set)
    seconds: dict[str, float] = defaultdict(float)
    for m in misses:
        for c in m.causes():
            graphs[c].add(m.entry.key)
            seconds[c] += m.seconds or 0.0
    return sorted((SummaryLine(c, len(g), seconds[c]) for c, g in graphs.items()),
                  key=lambda s: (-s.graphs, -s.seconds, s.cause))


def since_epoch(window: float | None) -> float:
    return 0.0 if window is None else time.time() - window


__all__ = [
    "Candidate",
    "Change",
    "Diff",
    "EntryRef",
    "Miss",
    "SummaryLine",
    "diff",
    "explain_entry",
    "group_of",
    "nearest",
    "parse_input",
    "recent_misses",
    "resolve",
    "short_key",
    "summarize",
]
