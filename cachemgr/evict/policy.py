"""Eviction policy: pure functions from index rows to a frozen Plan. Nothing here touches disk.

Units of deletion (see DESIGN.md, "Rules for deleting"):

- a *group*: a head entry that nothing references (an aotautograd entry, an fxgraph entry no
  AOT entry names, an unreferenced `other`) plus every entry whose referrers all lie inside the
  group (the AOT entry's fxgraph entries, their modules, C++ builds, Triton kernels and the
  autotune results of those kernels);
- an *orphan*: a module, kernel or autotune result nothing references, a corrupt entry, or an
  AOT entry whose fxgraph entries are all gone. Reclaimed first: nothing can hit through it;
- a *recreatable* entry: a `c*.py` module or a Triton kernel an fxgraph entry bundles. A hit on
  that entry writes it again, so under pressure it goes before any graph does. A compiled C++
  build (code entry with a `src-...` alias) is not recreatable: a hit rebuilds it.

Order under pressure: orphans (least recently used first), recreatable entries (those of the
coldest graphs first), then groups by policy: `lru` (oldest last access first) or `cost`
(GreedyDual-Size-Frequency, below). Entries shared between groups go once every referrer goes.

GreedyDual-Size-Frequency (Cherkasova 1998): a group's priority is H = L + hits x cost / bytes,
where cost is its compile seconds and L is the cache's clock as it stood when the group was
last used. The victim is the lowest H, and the clock rises to it. So a graph that took long to
compile per byte, or is hit often, stays; and recency counts, because a group used after the
clock rose got the higher L. The clock and its history are kept across runs (`Clock`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from cachemgr.units import parse_size_or_percent
from cachemgr.vocab import Held, Kind

if TYPE_CHECKING:
    from cachemgr.config import Settings

POLICIES = ("lru", "cost")
DEFAULT_COST = 1.0  # seconds, for a group whose compile time is unknown
UNIT_HEADS = ("aotautograd", "fxgraph")


@dataclass(frozen=True)
class Limits:
    max_size: int | None = None
    max_age: float | None = None
    max_files: int | None = None
    min_free: str | None = None  # '10%' or '50GiB'
    low_water: float = 0.9
    grace: float = 60.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(
            settings.max_size,
            settings.max_age,
            settings.max_files,
            settings.min_free,
            settings.low_water,
            settings.grace,
        )

    @property
    def any(self) -> bool:
        return any(x is not None for x in (self.max_size, self.max_age, self.max_files, self.min_free))


@dataclass(frozen=True, slots=True)
class Row:
    """One index entry as the policy sees it (slots: a plan holds one per entry, 1,000,000s)."""

    id: int
    key: str
    kind: str
    ref: str | None
    alias: str | None
    bytes: int
    files: int
    mtime: float
    last_access: float
    compile_seconds: float | None = None
    graph_key: str | None = None
    torch_version: str | None = None
    system_hash: str | None = None
    corrupt: str | None = None
    pinned: bool = False
    hit_count: int = 0
    launcher: bool = False  # a triton dir holding a built .so (cuda_utils), not a kernel
    refs: tuple[tuple[str, str], ...] = ()
    torch_version_hash: str | None = None
    parsed: bool = True  # False: indexed from its names only (scan phase one); its refs are unknown

    @property
    def touched(self) -> float:
        return max(self.mtime, self.last_access)


@dataclass
class Clock:
    """GreedyDual's inflation value L, kept across runs with the times it rose, so a group's L is
    the clock as it stood at the group's last use."""

    value: float = 0.0
    history: list[tuple[float, float]] = field(default_factory=list)  # (time, L from then on), ascending

    HISTORY = 512  # rises kept: older uses than the oldest kept count as L = 0

    def at(self, ts: float) -> float:
        i = bisect.bisect_right(self.history, (ts, float("inf")))
        return self.history[i - 1][1] if i else 0.0

    def rise(self, to: float, now: float) -> None:
        if to > self.value:
            self.value = to
            self.history.append((now, to))
            del self.history[: -self.HISTORY]


@dataclass(frozen=True)
class DiskState:
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class Planned:
    id: int
    key: str
    kind: str
    bytes: int
    files: int
    reason: str  # age | orphan | recreatable | size | files | free | dependent | purge
    recreatable: bool
    graph_key: str | None
    compile_seconds: float | None


@dataclass(frozen=True, slots=True)
class Unit:
    """What the executor deletes as one: all of it, or (if any part is in use) none of it."""

    entries: tuple[Planned, ...]
    reason: str
    last_access: float
    watch: tuple[int, ...] = ()  # ids of entries outside the unit whose use also protects it

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)


@dataclass(frozen=True)
class Plan:
    policy: str
    units: tuple[Unit, ...]
    expected_freed_bytes: int
    expected_freed_files: int
    recreatable_bytes: int
    total_bytes: int
    total_files: int
    skipped: tuple[tuple[str, str], ...]  # (key, reason) wanted but kept: pinned, grace
    clock: Clock | None = None  # the cost policy's clock after this plan (to be kept when it is carried out)

    @property
    def entries(self) -> list[Planned]:
        return [e for u in self.units for e in u.entries]


# -- the reference graph ------------------------------------------------------------------------


Links = list["set[int] | frozenset[int]"]
NO_LINKS: frozenset[int] = frozenset()  # shared by every entry without children (or parents): most


def _link(links: Links, i: int, to: int) -> None:
    s = links[i]
    if not isinstance(s, set):
        s = links[i] = set()
    s.add(to)


@dataclass
class Graph:
    rows: Sequence[Row]
    children: Links = field(default_factory=list)
    parents: Links = field(default_factory=list)
    dead: list[bool] = field(default_factory=list)  # refs that resolve to nothing present

    @classmethod
    def build(cls, rows: Sequence[Row]) -> Graph:
        n = len(rows)
        # (two empty sets per entry were 2/3 of a plan's memory: a set is made on its first link)
        g = cls(rows, [NO_LINKS] * n, [NO_LINKS] * n, [False] * n)
        names: dict[tuple[str, str], list[int]] = {}
        tuned: dict[str, list[int]] = {}  # triton kernel hash -> autotune results of it
        for i, r in enumerate(rows):
            for name in (r.ref, r.alias):
                if name:
                    names.setdefault((r.kind, name), []).append(i)
            if r.kind == "autotune":
                for kind, ref in r.refs:
                    if kind == "triton":
                        tuned.setdefault(ref, []).append(i)
        for i, r in enumerate(rows):
            if r.kind == "autotune":
                continue  # attached through the graphs that name its kernel, below
            for kind, ref in r.refs:
                targets = names.get((kind, ref), [])
                if kind == "triton":
                    targets = targets + tuned.get(ref, [])
                elif len(targets) > 1 and kind == "code":
                    targets = [nearest_build(rows, targets, r)]
                for t in targets:
                    if t != i:
                        _link(g.children, i, t)
                        _link(g.parents, t, i)
            g.dead[i] = r.kind == "aotautograd" and bool(r.refs) and not g.children[i]
        return g

    def is_orphan(self, i: int) -> bool:
        """Nothing can hit through it: a module, C++ build, kernel or autotune result no entry
        names (a C++ build no graph matches is a CPU-feature probe, or a gone graph's), a corrupt
        entry, an AOT entry whose graphs are all gone."""
        r = self.rows[i]
        if self.parents[i]:
            return False
        if r.corrupt or self.dead[i]:
            return True
        return r.kind == "code" or (r.kind == "triton" and not r.launcher) or r.kind == "autotune"

    def is_recreatable(self, i: int) -> bool:
        r = self.rows[i]
        if not self.parents[i] or not all(self.rows[p].kind == "fxgraph" for p in self.parents[i]):
            return False
        return (r.kind == "code" and not r.alias) or (r.kind == "triton" and not r.launcher)

    def closure(self, start: Iterable[int], taken: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """`start` plus every entry all of whose referrers are in it (or already taken), and every
        AOT entry whose fxgraph entries all are: deleting them leaves nothing that can hit."""
        members = list(dict.fromkeys(start))
        inside = set(members) | set(taken)
        changed = True
        while changed:
            changed = False
            for m in list(members):
                for c in self.children[m]:
                    if c not in inside and self.parents[c] <= inside:
                        members.append(c)
                        inside.add(c)
                        changed = True
                for p in self.parents[m]:
                    if (
                        p not in inside
                        and self.rows[p].kind == "aotautograd"
                        and not self.parents[p]
                        and self.children[p] <= inside
                    ):
                        members.append(p)
                        inside.add(p)
                        changed = True
        return members

    def descendants(self, start: Iterable[int]) -> set[int]:
        seen, stack = set(), list(start)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(self.children[i])
        return seen


def nearest_build(rows: Sequence[Row], builds: list[int], entry: Row) -> int:
    """Of several C++ builds of one kernel source (two torch versions build a byte-identical
    kernel under two names), the one the entry's own compile wrote: the latest written at or
    before the entry, else the nearest. The other build belongs to the other version's graphs."""
    before = [b for b in builds if rows[b].mtime <= entry.mtime + 1]
    if before:
        return max(before, key=lambda b: rows[b].mtime)
    return min(builds, key=lambda b: abs(rows[b].mtime - entry.mtime))


# -- planning -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Candidate:
    members: list[int]
    reason: str
    last_access: float
    cost: float = 0.0
    watch: tuple[int, ...] = ()
    hits: int = 0


REFERENCED = frozenset({Kind.CODE, Kind.TRITON, Kind.AUTOTUNE})  # kinds other entries name


class _Builder:
    """Collects units in order, never taking an entry twice.

    Entries not parsed yet (scan phase one) are kept, and so, while any is, is every entry of a
    kind they could name: what references a module or kernel is not known until all are read."""

    def __init__(self, g: Graph, now: float, grace: float, pinned: set[int]) -> None:
        self.g, self.now, self.grace, self.pinned = g, now, grace, pinned
        unparsed = [i for i, r in enumerate(g.rows) if not r.parsed]
        self.unknown = set(unparsed)
        if unparsed:
            self.unknown |= {i for i, r in enumerate(g.rows) if r.kind in REFERENCED}
        self.taken: set[int] = set()
        self.units: list[Unit] = []
        self.skipped: dict[str, str] = {}
        self.freed_bytes = self.freed_files = 0

    def usable(self, c: _Candidate) -> bool:
        rows = self.g.rows
        if any(i in self.pinned for i in c.members):
            self.skipped.setdefault(rows[c.members[0]].key, "pinned")
            return False
        if c.last_access > self.now - self.grace:
            self.skipped.setdefault(rows[c.members[0]].key, "grace")
            return False
        return True

    def take(self, c: _Candidate, reason: str | None = None) -> bool:
        members = [i for i in c.members if i not in self.taken]
        held = [i for i in members if i in self.unknown]
        for i in held:
            self.skipped.setdefault(self.g.rows[i].key, Held.UNPARSED)
        members = [i for i in members if i not in self.unknown]
        if not members or not self.usable(c):
            return False
        rows = self.g.rows
        entries = []
        for i in members:
            r = rows[i]
            self.taken.add(i)
            self.skipped.pop(r.key, None)
            entries.append(
                Planned(
                    r.id,
                    r.key,
                    r.kind,
                    r.bytes,
                    r.files,
                    reason or c.reason,
                    self.g.is_recreatable(i),
                    r.graph_key,
                    r.compile_seconds,
                )
            )
            self.freed_bytes += r.bytes
            self.freed_files += r.files
        self.units.append(
            Unit(tuple(entries), reason or c.reason, c.last_access, tuple(w for w in c.watch if w not in self.taken))
        )
        return True

    def sweep_dependents(self) -> None:
        """Shared entries whose every referrer is going, and AOT entries left with no graph."""
        g = self.g
        extra = [i for i in g.closure(self.taken) if i not in self.taken]
        for i in extra:
            r = g.rows[i]
            self.take(_Candidate([i], "dependent", r.touched))


def candidates(g: Graph) -> tuple[list[_Candidate], list[_Candidate], list[_Candidate]]:
    """(orphans, recreatable entries, groups), each unordered."""
    rows = g.rows
    orphans, cheap, groups = [], [], []
    for i, r in enumerate(rows):
        if g.is_orphan(i):
            members = g.closure([i])
            orphans.append(_Candidate(members, "orphan", max(rows[m].touched for m in members)))
        elif not g.parents[i]:
            members = g.closure([i])
            cost = _group_cost([rows[m] for m in members])
            hits = sum(rows[m].hit_count for m in members if rows[m].kind in (Kind.FXGRAPH, Kind.AOTAUTOGRAD))
            groups.append(_Candidate(members, "size", max(rows[m].touched for m in members), cost, hits=hits))
        if g.is_recreatable(i):
            # a module or kernel is as recent as the graphs that bundle it: their use protects it
            near = max([r.touched] + [rows[p].touched for p in g.parents[i]])
            cheap.append(_Candidate([i], "recreatable", near, 0.0, tuple(sorted(g.parents[i]))))
    return orphans, cheap, groups


def _group_cost(members: Sequence[Row]) -> float:
    """Seconds to compile the group again: its AOT entry's (which includes its graphs'), its
    graphs' summed, or a precompile entry's (a function's whole compile, held inline)."""
    aot = max((r.compile_seconds or 0.0 for r in members if r.kind == "aotautograd"), default=0.0)
    fx = sum(r.compile_seconds or 0.0 for r in members if r.kind == "fxgraph")
    whole = sum(r.compile_seconds or 0.0 for r in members if r.kind == Kind.PRECOMPILE)
    return max(aot, fx, whole) or DEFAULT_COST


def needs(limits: Limits, total_bytes: int, total_files: int, disk: DiskState | None) -> tuple[int, int, int]:
    """(bytes over the size cap, files over the file cap, bytes short of the free-space floor),
    each measured down to the low-water mark so eviction does not run on every new file."""
    over_bytes = over_files = short_free = 0
    if limits.max_size is not None and total_bytes > limits.max_size:
        over_bytes = total_bytes - int(limits.max_size * limits.low_water)
    if limits.max_files is not None and total_files > limits.max_files:
        over_files = total_files - int(limits.max_files * limits.low_water)
    if limits.min_free and disk is not None:
        size, pct = parse_size_or_percent(limits.min_free)
        floor = size if size is not None else int(cast(float, pct) * disk.total_bytes)  # (one of the two is set)
        if disk.free_bytes < floor:
            short_free = floor - disk.free_bytes
    return over_bytes, over_files, short_free


def pinned_ids(g: Graph) -> set[int]:
    """Pinned entries and everything they need."""
    return g.descendants(i for i, r in enumerate(g.rows) if r.pinned)


def priority(c: _Candidate, rows: Sequence[Row], g: Graph, clock: Clock) -> float:
    """GreedyDual-Size-Frequency: L at the group's last use + (1 + hits) x compile seconds / bytes."""
    size = max(1, sum(rows[m].bytes for m in c.members if not g.is_recreatable(m)))
    return clock.at(c.last_access) + (1 + c.hits) * c.cost / size


def plan(
    rows: Sequence[Row],
    limits: Limits,
    policy: str = "lru",
    now: float = 0.0,
    disk: DiskState | None = None,
    clock: Clock | None = None,
) -> Plan:
    """Which entries to evict, in order, to meet `limits` (`clock`: the cost policy's, kept
    across runs; a copy moves with the plan)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    g = Graph.build(rows)
    b = _Builder(g, now, limits.grace, pinned_ids(g))
    orphans, cheap, groups = candidates(g)
    total_bytes = sum(r.bytes for r in rows)
    total_files = sum(r.files for r in rows)

    if limits.max_age is not None:
        cutoff = now - limits.max_age
        for c in sorted(orphans + groups, key=lambda c: c.last_access):
            if c.last_access < cutoff:
                b.take(c, "age")

    over_bytes, over_files, short_free = needs(limits, total_bytes, total_files, disk)
    want_bytes = max(over_bytes, short_free)
    clock = Clock((clock or Clock()).value, list((clock or Clock()).history))

    def satisfied() -> bool:
        return b.freed_bytes >= want_bytes and b.freed_files >= over_files

    def reason() -> str:
        if b.freed_bytes < over_bytes:
            return "size"
        return "free" if b.freed_bytes < short_free else "files"

    if not satisfied():
        ordered = sorted(orphans, key=lambda c: c.last_access) + sorted(cheap, key=lambda c: c.last_access)

        def frees_something(c: _Candidate) -> bool:  # a lock file frees no bytes, only an inode
            return b.freed_files < over_files or any(rows[m].bytes for m in c.members if m not in b.taken)

        for c in ordered:
            if satisfied():
                break
            if frees_something(c):
                b.take(c, c.reason)
        if policy == "lru":
            for c in sorted(groups, key=lambda c: c.last_access):
                if satisfied():
                    break
                if frees_something(c):
                    b.take(c, reason())
        else:  # GreedyDual-Size-Frequency: evict the lowest H, raise the clock to it
            heap = [(priority(c, rows, g, clock), c.last_access, n) for n, c in enumerate(groups)]
            heapq.heapify(heap)
            while heap and not satisfied():
                h, _, n = heapq.heappop(heap)
                if frees_something(groups[n]) and b.take(groups[n], reason()):
                    clock.rise(h, now)
    b.sweep_dependents()

    units = tuple(b.units)
    return Plan(
        policy=policy,
        units=units,
        expected_freed_bytes=sum(u.bytes for u in units),
        expected_freed_files=sum(e.files for u in units for e in u.entries),
        recreatable_bytes=sum(e.bytes for u in units for e in u.entries if e.recreatable and u.reason == "recreatable"),
        total_bytes=total_bytes,
        total_files=total_files,
        skipped=tuple(sorted(b.skipped.items())),
        clock=clock,
    )


def select(rows: Sequence[Row], chosen: Iterable[int], now: float, grace: float, include_pinned: bool = False) -> Plan:
    """A purge plan: the chosen entries (row indexes) and what goes with them."""
    g = Graph.build(rows)
    b = _Builder(g, now, grace, set() if include_pinned else pinned_ids(g))
    for i in chosen:
        members = g.closure([i], b.taken)
        b.take(_Candidate(members, "purge", max(rows[m].touched for m in members)))
    b.sweep_dependents()
    units = tuple(b.units)
    return Plan(
        policy="purge",
        units=units,
        expected_freed_bytes=sum(u.bytes for u in units),
        expected_freed_files=sum(e.files for u in units for e in u.entries),
        recreatable_bytes=0,
        total_bytes=sum(r.bytes for r in rows),
        total_files=sum(r.files for r in rows),
        skipped=tuple(sorted(b.skipped.items())),
    )
