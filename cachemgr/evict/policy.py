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
import itertools
import math
from array import array
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar, cast, overload

from cachemgr import layout
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
    """One index entry as the policy sees it: what a caller builds to plan over (tests, purge's
    selectors), and what `Table[i]` gives back."""

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
        if to > self.value and math.isfinite(to):  # (an infinite L would stop every later rise)
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
    ref: str | None = None  # the name its lock files go by
    at: int = -1  # its position in the Table the plan was made from


@dataclass(frozen=True, slots=True)
class Unit:
    """What the executor deletes as one: all of it, or (if any part is in use) none of it."""

    entries: tuple[Planned, ...]
    reason: str
    last_access: float
    watch: tuple[int, ...] = ()  # entries outside it whose use also protects it (positions in the plan's Table)

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)


@dataclass(frozen=True)
class Plan:
    policy: str
    units: Sequence[Unit]  # in order (a plan's own: Units, made one at a time when asked for)
    expected_freed_bytes: int
    expected_freed_files: int
    recreatable_bytes: int
    total_bytes: int
    total_files: int
    skipped: tuple[tuple[str, str], ...]  # (key, reason) wanted but kept: pinned, grace
    clock: Clock | None = None  # the cost policy's clock after this plan (to be kept when it is carried out)

    @property
    def entries(self) -> Iterator[Planned]:
        return (e for u in self.units for e in u.entries)

    @property
    def planned(self) -> int:
        """How many entries the plan takes."""
        units = self.units
        return units.entry_count() if isinstance(units, Units) else sum(len(u.entries) for u in units)

    def positions(self) -> Iterator[int]:
        """The positions (in the Table it was made from) of the entries the plan takes, no Unit
        made for them."""
        units = self.units
        return iter(units.members) if isinstance(units, Units) else (e.at for u in units for e in u.entries)


# -- the entries, as columns ----------------------------------------------------------------------

PINNED, LAUNCHER, PARSED = 1, 2, 4  # Table.flags bits
UNKNOWN = math.nan  # compile_seconds not known


T = TypeVar("T")


class _Made(Sequence[T]):
    """A sequence whose items are made when asked for (`item`), from columns held compactly."""

    def item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self.item(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
            if i < 0:
                raise IndexError(i)
        elif i >= len(self):
            raise IndexError(i)
        return self.item(i)


class Table(_Made[Row]):
    """Every entry of a cache as the policy plans over it: one array or list per column, entry i
    at position i. At 1,000,000 files (200,000 entries) an object per entry, with its own numbers,
    was most of eviction's memory; here an entry is its strings and a few machine words.
    `table[i]` makes entry i's Row when asked (printing, purge's selectors)."""

    def __init__(self, full: bool = False) -> None:
        self.id = array("q")
        self.key: list[str] = []
        self.kind: list[str] = []
        self.ref: list[str | None] | KeyRefs = []
        self.alias = Sparse()  # (most entries have none of these three)
        self.graph_key = Sparse()
        self.corrupt = Sparse()
        self.bytes = array("q")
        self.files = array("q")
        self.mtime = array("d")
        self.last_access = array("d")
        self.compile_seconds = array("d")  # UNKNOWN where not known
        self.hit_count = array("q")
        self.flags = bytearray()
        # position -> the names it references (a Table that is not full lets go of them once linked)
        self.refs: dict[int, tuple[tuple[str, str], ...]] = {}
        # (torch_version, system_hash, torch_version_hash) per entry, kept only for Row views that need them
        self.versions: list[tuple[str | None, str | None, str | None]] | None = [] if full else None
        self._graph: Graph | None = None

    @classmethod
    def of(cls, rows: Iterable[Row]) -> Table:
        t = cls(full=True)
        for r in rows:
            t.add(r)
        return t

    def add(self, r: Row) -> None:
        i = len(self.id)
        self.id.append(r.id)
        self.key.append(r.key)
        self.kind.append(r.kind)
        cast(list, self.ref).append(r.ref)
        self.alias.append(r.alias)
        self.graph_key.append(r.graph_key)
        self.corrupt.append(r.corrupt)
        self.bytes.append(r.bytes)
        self.files.append(r.files)
        self.mtime.append(r.mtime)
        self.last_access.append(r.last_access)
        self.compile_seconds.append(UNKNOWN if r.compile_seconds is None else r.compile_seconds)
        self.hit_count.append(r.hit_count)
        self.flags.append(PINNED * r.pinned | LAUNCHER * r.launcher | PARSED * r.parsed)
        if r.refs:
            self.refs[i] = r.refs
        if self.versions is not None:
            self.versions.append((r.torch_version, r.system_hash, r.torch_version_hash))

    def __len__(self) -> int:
        return len(self.id)

    def item(self, i: int) -> Row:
        cs, f = self.compile_seconds[i], self.flags[i]
        tv, sh, tvh = self.versions[i] if self.versions is not None else (None, None, None)
        return Row(
            self.id[i],
            self.key[i],
            self.kind[i],
            self.ref[i],
            self.alias[i],
            self.bytes[i],
            self.files[i],
            self.mtime[i],
            self.last_access[i],
            None if math.isnan(cs) else cs,
            self.graph_key[i],
            tv,
            sh,
            self.corrupt[i],
            pinned=bool(f & PINNED),
            hit_count=self.hit_count[i],
            launcher=bool(f & LAUNCHER),
            refs=self.refs.get(i, ()),
            torch_version_hash=tvh,
            parsed=bool(f & PARSED),
        )

    def touched(self, i: int) -> float:
        return max(self.mtime[i], self.last_access[i])

    def seconds(self, i: int) -> float:
        """Compile seconds of entry i, 0 where not known."""
        cs = self.compile_seconds[i]
        return 0.0 if math.isnan(cs) else cs

    def graph(
        self,
        autotune_refs: Iterable[tuple[int, str, str]] | None = None,
        other_refs: Iterable[tuple[int, str, str]] | None = None,
    ) -> Graph:
        """The reference graph of these entries, made once (see Graph.build)."""
        if self._graph is None:
            self._graph = Graph.build(self, autotune_refs, other_refs)
            if self.versions is None:
                self.refs = {}  # linked now; only a full table's Row views show them
        return self._graph


class Sparse(_Made["str | None"]):
    """A column most entries leave empty: only the values there are, by position."""

    def __init__(self) -> None:
        self.values: dict[int, str] = {}
        self.n = 0

    def append(self, v: str | None) -> None:
        if v is not None:
            self.values[self.n] = v
        self.n += 1

    def extend(self, vs: Sequence[str | None]) -> None:
        self.values.update((self.n + j, v) for j, v in enumerate(vs) if v is not None)
        self.n += len(vs)

    def item(self, i: int) -> str | None:
        return self.values.get(i)

    def __len__(self) -> int:
        return self.n


class KeyRefs(_Made["str | None"]):
    """Each entry's ref, read off its key when asked (layout.ref_of), not held: at 1,000,000 files
    the refs were 20 MB of strings their keys already spell. `odd`: the refs that differ."""

    def __init__(self, t: Table, odd: dict[int, str | None]) -> None:
        self.t, self.odd = t, odd

    def item(self, i: int) -> str | None:
        odd = self.odd.get(i, _SPELLED)
        return layout.ref_of(self.t.key[i], self.t.kind[i]) if odd is _SPELLED else odd

    def __len__(self) -> int:
        return len(self.t.key)


_SPELLED = "(spelled by its key)"


class Evicted(_Made[tuple[str, str, int, str]]):
    """(key, kind, bytes, reason) of each entry that left the cache: a position, a byte count and
    a shared reason string each, the tuple made when asked for (100,000s at 1,000,000 files)."""

    def __init__(self, t: Table) -> None:
        self.t, self.at, self.bytes = t, array("q"), array("q")
        self.reason: list[str] = []

    def add(self, at: int, nbytes: int, reason: str) -> None:
        self.at.append(at)
        self.bytes.append(nbytes)
        self.reason.append(reason)

    def item(self, i: int) -> tuple[str, str, int, str]:
        at = self.at[i]
        return self.t.key[at], self.t.kind[at], self.bytes[i], self.reason[i]

    def __len__(self) -> int:
        return len(self.at)


def table_of(rows: Sequence[Row]) -> Table:
    return rows if isinstance(rows, Table) else Table.of(rows)


# -- the reference graph ------------------------------------------------------------------------


class Links:
    """Each entry's linked entries (children, or parents) in two arrays: entry i's are
    `to[start[i]:start[i + 1]]` (an object per link was a plan's largest part)."""

    __slots__ = ("start", "to")

    def __init__(self, n: int, src: array, dst: array) -> None:
        start = array("q", bytes(8 * (n + 1)))
        for a in src:
            start[a + 1] += 1
        for i in range(n):
            start[i + 1] += start[i]
        fill = array("q", start)
        to = array("q", bytes(8 * len(src)))
        for a, b in zip(src, dst, strict=True):
            to[fill[a]] = b
            fill[a] += 1
        self.start, self.to = start, to

    def __getitem__(self, i: int) -> array:
        return self.to[self.start[i] : self.start[i + 1]]

    def count(self, i: int) -> int:
        return self.start[i + 1] - self.start[i]


class Marks:
    """A set of positions of one Table, one byte each (a plan takes 100,000s of entries)."""

    def __init__(self, n: int) -> None:
        self.marks = bytearray(n)

    def add(self, i: int) -> None:
        self.marks[i] = 1

    def __contains__(self, i: object) -> bool:
        return isinstance(i, int) and bool(self.marks[i])

    def __iter__(self) -> Iterator[int]:
        return (i for i, m in enumerate(self.marks) if m)


class _Names:
    """The entries a (kind, name) names, by ref or alias: each name's hash and its entry's position
    packed in one sorted array (a dict of 200,000 names was 23 MB; this is under 2). A hash only
    leads: every entry it gives is checked against the name."""

    def __init__(self, t: Table) -> None:
        self.kind, self.bits = t.kind, max(1, len(t).bit_length())
        # the columns' items read without a sequence's bounds checks (a position here is the table's)
        self.ref, self.alias = _at(t.ref), _at(t.alias)
        packed = []
        shift = self.bits
        for i, kind in enumerate(self.kind):
            for name in (self.ref(i), self.alias(i)):
                if name:
                    packed.append((hash((kind, name)) >> shift) << shift | i)
        self.packed = array("q", sorted(packed))  # (same prefix: by position, as a dict's lists were)

    def __call__(self, kind: str, name: str) -> list[int]:
        packed, bits = self.packed, self.bits
        prefix, mask = (hash((kind, name)) >> bits) << bits, (1 << bits) - 1
        out = []
        at = bisect.bisect_left(packed, prefix)
        while at < len(packed) and packed[at] & ~mask == prefix:
            i = packed[at] & mask
            if self.kind[i] == kind and name in (self.ref(i), self.alias(i)):
                out.append(i)
            at += 1
        return out


def _at(column: Sequence[str | None]) -> Callable[[int], str | None]:
    """`column[i]`; for a column made on demand (_Made), its item maker itself."""
    return column.item if isinstance(column, _Made) else column.__getitem__


@dataclass
class Graph:
    rows: Table
    children: Links
    parents: Links
    dead: bytearray  # 1: an AOT entry whose every reference resolves to nothing present
    named: bytearray  # 1: some entry's reference names it

    @classmethod
    def build(
        cls,
        rows: Sequence[Row],
        autotune_refs: Iterable[tuple[int, str, str]] | None = None,
        other_refs: Iterable[tuple[int, str, str]] | None = None,
    ) -> Graph:
        """The links of `rows` (a Table, or Rows), from each entry's references: (position, kind,
        ref) of the autotune entries and of the others, by position (the table's own by default)."""
        t = table_of(rows)
        n = len(t)
        if autotune_refs is None or other_refs is None:
            mine = sorted(t.refs.items())
            autotune_refs = ((i, k, r) for i, refs in mine if t.kind[i] == "autotune" for k, r in refs)
            other_refs = ((i, k, r) for i, refs in mine if t.kind[i] != "autotune" for k, r in refs)
        names = _Names(t)
        named, dead = bytearray(n), bytearray(n)
        tuned: dict[str, list[int]] = {}  # triton kernel hash -> autotune results of it
        for i, kind, ref in autotune_refs:
            if kind == "triton":
                tuned.setdefault(ref, []).append(i)
                for x in names(kind, ref):
                    named[x] = 1
        src, dst = array("q"), array("q")
        for i, refs in itertools.groupby(other_refs, key=lambda r: r[0]):
            linked: dict[int, None] = {}
            for _, kind, ref in refs:
                targets = names(kind, ref)
                for x in targets:
                    named[x] = 1
                if kind == "triton":
                    targets = targets + tuned.get(ref, [])
                elif len(targets) > 1 and kind == "code":
                    targets = [nearest_build(t, targets, i)]
                for x in targets:
                    if x != i:
                        linked[x] = None
            src.extend([i] * len(linked))
            dst.extend(linked)
            dead[i] = t.kind[i] == "aotautograd" and not linked  # (it has references: it is here)
        del names, tuned  # (before the links are laid out: the peak of a plan's memory is here)
        return cls(t, Links(n, src, dst), Links(n, dst, src), dead, named)

    def is_orphan(self, i: int) -> bool:
        """Nothing can hit through it: a module, C++ build, kernel or autotune result no entry
        names (a C++ build no graph matches is a CPU-feature probe, or a gone graph's), a corrupt
        entry, an AOT entry whose graphs are all gone."""
        t = self.rows
        if self.parents.count(i):
            return False
        if t.corrupt[i] or self.dead[i]:
            return True
        kind = t.kind[i]
        return kind == "code" or (kind == "triton" and not t.flags[i] & LAUNCHER) or kind == "autotune"

    def is_recreatable(self, i: int) -> bool:
        t = self.rows
        parents = self.parents[i]
        if not parents or not all(t.kind[p] == "fxgraph" for p in parents):
            return False
        kind = t.kind[i]
        return (kind == "code" and not t.alias[i]) or (kind == "triton" and not t.flags[i] & LAUNCHER)

    def closure(self, start: Iterable[int], taken: Container[int] = frozenset()) -> list[int]:
        """`start` plus every entry all of whose referrers are in it (or already taken), and every
        AOT entry whose fxgraph entries all are: deleting them leaves nothing that can hit."""
        members = list(dict.fromkeys(start))
        return members + self._grow(members, set(members), taken)

    def dependents(self, taken: Marks) -> list[int]:
        """What deleting `taken` takes with it: the closure of `taken`, less `taken` itself."""
        return self._grow(taken, set(), taken)

    def _grow(self, seeds: Iterable[int], inside: set[int], taken: Container[int]) -> list[int]:
        """The entries that join `seeds` (in `inside`, or `taken`) by the closure's two rules, each
        looked at when one of its neighbours joins (a worklist: linear in the links it crosses).

        An entry's referrers still outside are counted once, when it is first looked at, and the
        count lowered as each joins: asking all of them again at each join made a module or kernel
        that P joining graphs share cost P². An AOT entry's graphs are counted once too, and that
        count never falls: a graph of an AOT entry that is out cannot join by the first rule."""
        kind, children, parents = self.rows.kind, self.children, self.parents

        def has(x: int) -> bool:
            return x in inside or x in taken

        parents_out: dict[int, int] = {}  # a child looked at -> its parents not in yet
        children_out: dict[int, int] = {}  # an AOT entry looked at -> its graphs not in (then or ever)
        grown: list[int] = []

        def join(x: int) -> None:
            inside.add(x)
            grown.append(x)
            if parents_out:  # (most closures are one entry and its few: nothing counted yet)
                for c in children[x]:
                    if c in parents_out:
                        parents_out[c] -= 1

        def ready(x: int, out: dict[int, int], others: Links) -> bool:
            """Are all of x's parents (or children) in? Counted the first time (parents: join lowers it)."""
            left = out.get(x)
            if left is None:
                left = out[x] = sum(1 for y in others[x] if not has(y))
            return not left

        for todo in (seeds, grown):  # (grown is appended to while it is walked: a queue)
            for m in todo:
                for c in children[m]:
                    if not has(c) and (parents.count(c) == 1 or ready(c, parents_out, parents)):  # (one: m)
                        join(c)
                for p in parents[m]:
                    if (
                        not has(p)
                        and kind[p] == "aotautograd"
                        and not parents.count(p)
                        and ready(p, children_out, children)
                    ):
                        join(p)
        return grown

    def descendants(self, start: Iterable[int]) -> set[int]:
        seen, stack = set(), list(start)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(self.children[i])
        return seen


class Units(_Made[Unit]):
    """A plan's units as positions in its Table: the k-th Unit (with its Planned entries) is made
    when asked for, so a plan that takes 100,000s of entries holds a few numbers for each."""

    def __init__(self, g: Graph) -> None:
        self.g = g
        self.members = array("q")  # entry positions, unit after unit
        self.start = array("q", [0])  # unit k's: members[start[k] : start[k + 1]]
        self.reason: list[str] = []
        self.last_access = array("d")
        self.watch = array("q")  # positions outside each unit whose use protects it, unit after unit
        self.watch_start = array("q", [0])

    def add(self, members: list[int], reason: str, last_access: float, watch: Iterable[int]) -> None:
        self.members.extend(members)
        self.start.append(len(self.members))
        self.reason.append(reason)
        self.last_access.append(last_access)
        self.watch.extend(watch)
        self.watch_start.append(len(self.watch))

    def __len__(self) -> int:
        return len(self.reason)

    def entry_count(self) -> int:
        return len(self.members)

    def item(self, k: int) -> Unit:
        t, g, reason = self.g.rows, self.g, self.reason[k]
        entries = []
        for i in self.members[self.start[k] : self.start[k + 1]]:
            cs = t.compile_seconds[i]
            entries.append(
                Planned(
                    t.id[i],
                    t.key[i],
                    t.kind[i],
                    t.bytes[i],
                    t.files[i],
                    reason,
                    g.is_recreatable(i),
                    t.graph_key[i],
                    None if math.isnan(cs) else cs,
                    t.ref[i],
                    i,
                )
            )
        watch = tuple(self.watch[self.watch_start[k] : self.watch_start[k + 1]])
        return Unit(tuple(entries), reason, self.last_access[k], watch)


def nearest_build(t: Table, builds: list[int], entry: int) -> int:
    """Of several C++ builds of one kernel source (two torch versions build a byte-identical
    kernel under two names), the one the entry's own compile wrote: the latest written at or
    before the entry, else the nearest. The other build belongs to the other version's graphs."""
    mtime = t.mtime
    before = [b for b in builds if mtime[b] <= mtime[entry] + 1]
    if before:
        return max(before, key=lambda b: mtime[b])
    return min(builds, key=lambda b: abs(mtime[b] - mtime[entry]))


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
        t = g.rows
        unparsed = [i for i, f in enumerate(t.flags) if not f & PARSED]
        self.unknown = set(unparsed)
        if unparsed:
            self.unknown |= {i for i, kind in enumerate(t.kind) if kind in REFERENCED}
        self.taken = Marks(len(t))
        self.units = Units(g)
        self.skipped: dict[str, str] = {}
        self.freed_bytes = self.freed_files = self.recreatable_bytes = 0

    def usable(self, c: _Candidate) -> bool:
        keys = self.g.rows.key
        if any(i in self.pinned for i in c.members):
            self.skipped.setdefault(keys[c.members[0]], "pinned")
            return False
        if c.last_access > self.now - self.grace:
            self.skipped.setdefault(keys[c.members[0]], "grace")
            return False
        return True

    def take(self, c: _Candidate, reason: str | None = None) -> bool:
        t = self.g.rows
        members = [i for i in c.members if i not in self.taken]
        held = [i for i in members if i in self.unknown]
        for i in held:
            self.skipped.setdefault(t.key[i], Held.UNPARSED)
        members = [i for i in members if i not in self.unknown]
        if not members or not self.usable(c):
            return False
        reason = reason or c.reason
        for i in members:
            self.taken.add(i)
            self.skipped.pop(t.key[i], None)
            self.freed_bytes += t.bytes[i]
            self.freed_files += t.files[i]
            if reason == "recreatable" and self.g.is_recreatable(i):
                self.recreatable_bytes += t.bytes[i]
        watch = c.watch
        if any(w in self.taken for w in watch):
            watch = tuple(w for w in watch if w not in self.taken)
        self.units.add(members, reason, c.last_access, watch)
        return True

    def sweep_dependents(self) -> None:
        """Shared entries whose every referrer is going, and AOT entries left with no graph."""
        g = self.g
        extra = g.dependents(self.taken)
        for i in extra:
            self.take(_Candidate([i], "dependent", g.rows.touched(i)))


@dataclass
class Singles:
    """Candidates of one entry each (every recreatable entry, nearly every orphan: at 1,000,000
    files half the entries), two numbers apiece: a _Candidate is made when its turn comes. An
    orphan whose closure holds more than itself keeps its members."""

    g: Graph
    reason: str
    at: array = field(default_factory=lambda: array("q"))  # positions
    near: array = field(default_factory=lambda: array("d"))  # last use (of it, or of a graph that bundles it)
    more: dict[int, list[int]] = field(default_factory=dict)

    def add(self, members: list[int], near: float) -> None:
        if len(members) > 1:
            self.more[len(self.at)] = members
        self.at.append(members[0])
        self.near.append(near)

    def oldest_first(self) -> Iterator[_Candidate]:
        for k in sorted(range(len(self.at)), key=self.near.__getitem__):
            i = self.at[k]
            if self.reason == "recreatable":
                yield _Candidate([i], self.reason, self.near[k], 0.0, tuple(sorted(self.g.parents[i])))
            else:
                yield _Candidate(self.more.get(k) or [i], self.reason, self.near[k])


def candidates(g: Graph) -> tuple[Singles, Singles, list[_Candidate]]:
    """(orphans, recreatable entries, groups), each unordered. An unknown file eviction leaves
    alone (layout.is_kept: what programs load by path, tools' state, tempfile's names) is none."""
    t = g.rows
    touched, kinds, hits = t.touched, t.kind, t.hit_count
    orphans, cheap, groups = Singles(g, "orphan"), Singles(g, "recreatable"), []
    for i in range(len(t)):
        if kinds[i] == Kind.OTHER and layout.is_kept(t.key[i]):
            continue
        if g.is_orphan(i):
            members = g.closure([i])
            orphans.add(members, max(touched(m) for m in members))
        elif not g.parents.count(i):
            members = g.closure([i])
            cost = _group_cost(t, members)
            n = sum(hits[m] for m in members if kinds[m] in (Kind.FXGRAPH, Kind.AOTAUTOGRAD))
            groups.append(_Candidate(members, "size", max(touched(m) for m in members), cost, hits=n))
        if g.is_recreatable(i):
            # a module or kernel is as recent as the graphs that bundle it: their use protects it
            cheap.add([i], max(touched(i), *(touched(p) for p in g.parents[i])))
    return orphans, cheap, groups


def _group_cost(t: Table, members: Sequence[int]) -> float:
    """Seconds to compile the group again: its AOT entry's (which includes its graphs'), its
    graphs' summed, or a precompile entry's (a function's whole compile, held inline)."""
    kind, seconds = t.kind, t.seconds
    aot = max((seconds(m) for m in members if kind[m] == "aotautograd"), default=0.0)
    fx = sum(seconds(m) for m in members if kind[m] == "fxgraph")
    whole = sum(seconds(m) for m in members if kind[m] == Kind.PRECOMPILE)
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
    return g.descendants(i for i, f in enumerate(g.rows.flags) if f & PINNED)


def priority(c: _Candidate, g: Graph, clock: Clock) -> float:
    """GreedyDual-Size-Frequency: L at the group's last use + (1 + hits) x compile seconds / bytes."""
    size = max(1, sum(g.rows.bytes[m] for m in c.members if not g.is_recreatable(m)))
    return clock.at(c.last_access) + (1 + c.hits) * c.cost / size


def plan(
    rows: Sequence[Row],
    limits: Limits,
    policy: str = "lru",
    now: float = 0.0,
    disk: DiskState | None = None,
    clock: Clock | None = None,
) -> Plan:
    """Which entries to evict, in order, to meet `limits` (`rows`: a Table, or Rows; `clock`: the
    cost policy's, kept across runs; a copy moves with the plan)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    t = table_of(rows)
    g = t.graph()
    b = _Builder(g, now, limits.grace, pinned_ids(g))
    orphans, cheap, groups = candidates(g)
    total_bytes = sum(t.bytes)
    total_files = sum(t.files)

    groups.sort(key=lambda c: c.last_access)
    if limits.max_age is not None:
        cutoff = now - limits.max_age
        for c in heapq.merge(orphans.oldest_first(), groups, key=lambda c: c.last_access):
            if c.last_access >= cutoff:
                break
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

        def frees_something(c: _Candidate) -> bool:  # a lock file frees no bytes, only an inode
            return b.freed_files < over_files or any(t.bytes[m] for m in c.members if m not in b.taken)

        for c in itertools.chain(orphans.oldest_first(), cheap.oldest_first()):
            if satisfied():
                break
            if frees_something(c):
                b.take(c, c.reason)
        if policy == "lru":
            for c in groups:
                if satisfied():
                    break
                if frees_something(c):
                    b.take(c, reason())
        else:  # GreedyDual-Size-Frequency: evict the lowest H, raise the clock to it
            heap = [(priority(c, g, clock), c.last_access, n) for n, c in enumerate(groups)]
            heapq.heapify(heap)
            while heap and not satisfied():
                h, _, n = heapq.heappop(heap)
                if frees_something(groups[n]) and b.take(groups[n], reason()):
                    clock.rise(h, now)
    del orphans, cheap, groups
    b.sweep_dependents()
    return _plan_of(b, policy, total_bytes, total_files, clock)


def select(rows: Sequence[Row], chosen: Iterable[int], now: float, grace: float, include_pinned: bool = False) -> Plan:
    """A purge plan: the chosen entries (positions in `rows`) and what goes with them."""
    t = table_of(rows)
    g = t.graph()
    b = _Builder(g, now, grace, set() if include_pinned else pinned_ids(g))
    for i in chosen:
        members = g.closure([i], b.taken)
        b.take(_Candidate(members, "purge", max(t.touched(m) for m in members)))
    b.sweep_dependents()
    return replace(_plan_of(b, "purge", sum(t.bytes), sum(t.files)), recreatable_bytes=0)


def _plan_of(b: _Builder, policy: str, total_bytes: int, total_files: int, clock: Clock | None = None) -> Plan:
    return Plan(
        policy=policy,
        units=b.units,
        expected_freed_bytes=b.freed_bytes,
        expected_freed_files=b.freed_files,
        recreatable_bytes=b.recreatable_bytes,
        total_bytes=total_bytes,
        total_files=total_files,
        skipped=tuple(sorted(b.skipped.items())),
        clock=clock,
    )
