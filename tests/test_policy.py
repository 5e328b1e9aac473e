"""The eviction policy on synthetic rows (pure functions: no disk, no database, no torch)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachemgr.evict.policy import Clock, Limits, Row, plan, priority

MB = 1 << 20
NOW = 1_000_000.0


def graph(i: int, key: str, cost: float, hits: int = 0, used: float = NOW - 3600, size: int = MB) -> list[Row]:
    """An fxgraph entry and the C++ build only it uses (one eviction group)."""
    stem = f"c{key}"
    return [
        Row(
            i,
            f"fxgraph/{key[:2]}/f{key}/e",
            "fxgraph",
            f"f{key}",
            None,
            size,
            1,
            used,
            used,
            cost,
            f"f{key}",
            hit_count=hits,
            refs=(("code", f"src-{key}"),),
        ),
        Row(i + 1, f"{key[:2]}/{stem}", "code", stem, f"src-{key}", size, 2, used, used),
    ]


def heads(p) -> list[str]:
    return [
        u.entries[0].key.split("/")[2][1:] for u in p.units if u.reason == "size" and u.entries[0].kind == "fxgraph"
    ]


def test_cost_policy_keeps_what_is_dear_per_byte_and_what_is_hit():
    rows = [*graph(1, "dear", cost=10.0), *graph(3, "cheap", cost=1.0), *graph(5, "popular", cost=1.0, hits=20)]
    # LRU would take the least recently used first, whatever it cost:
    rows_lru = [
        *graph(1, "dear", 10.0, used=NOW - 9000),
        *graph(3, "cheap", 1.0, used=NOW - 60),
        *graph(5, "popular", 1.0, hits=20, used=NOW - 300),
    ]
    limits = Limits(max_size=0, grace=0)
    assert heads(plan(rows_lru, limits, "lru", NOW)) == ["dear", "popular", "cheap"]
    # GreedyDual-Size-Frequency: H = L + (1 + hits) x seconds / bytes; the lowest goes first
    p = plan(rows, limits, "cost", NOW)
    assert heads(p) == ["cheap", "dear", "popular"]  # 1 s/2 MB, then 10 s/2 MB, then 21 x 1 s/2 MB
    assert p.clock is not None and p.clock.value > 0  # the clock rose to each victim's H in turn


def test_cost_counts_a_precompile_entrys_own_compile_time():
    """A precompile entry heads a group of its own (nothing names it): its compile seconds (a whole
    function's compile, held inline) are the group's cost, not the 1 s of an unknown one."""

    def precompile(i: int, name: str, cost: float, used: float) -> Row:
        return Row(i, f"dynamo/{name * 8}/entry", "precompile", name * 8, None, MB, 1, used, used, cost)

    rows = [precompile(1, "dear", 30.0, NOW - 9000), precompile(2, "chea", 0.1, NOW - 60)]
    limits = Limits(max_size=MB, low_water=1.0, grace=0)
    assert [u.entries[0].key for u in plan(rows, limits, "lru", NOW).units] == [rows[0].key]
    assert [u.entries[0].key for u in plan(rows, limits, "cost", NOW).units] == [rows[1].key]


def test_the_clock_makes_recency_count_across_runs():
    """Two groups of the same cost and size: the one used after the clock last rose (in an
    earlier run) has the higher L, so it stays; without the clock they would tie."""
    clock = Clock()
    clock.rise(5.0, NOW - 1000)  # an earlier eviction run raised the clock
    rows = [*graph(1, "before", 1.0, used=NOW - 2000), *graph(3, "after", 1.0, used=NOW - 500)]
    p = plan(rows, Limits(max_size=3 * MB, low_water=1.0, grace=0), "cost", NOW, clock=clock)
    assert heads(p) == ["before"]
    assert p.clock.value == 5.0, "the clock never falls (the victim's H was below it)"
    rows.append(Row(20, "zz/cbig", "other", None, None, 8 * MB, 1, NOW - 10, NOW - 10))  # pressure: all go
    p = plan(rows, Limits(max_size=0, grace=0), "cost", NOW, clock=clock)
    assert heads(p)[:2] == ["before", "after"] and p.clock.value > 5.0
    assert clock.value == 5.0, "the plan works on a copy: the stored clock moves only when carried out"


def test_priority_is_clock_at_last_use_plus_frequency_cost_per_byte():
    from cachemgr.evict.policy import Graph, candidates

    clock = Clock(2.0, [(NOW - 100, 2.0)])
    rows = graph(1, "g", cost=4.0, hits=3, used=NOW - 50)
    g = Graph.build(rows)
    (group,) = candidates(g)[2]
    assert priority(group, g, clock) == 2.0 + (1 + 3) * 4.0 / (2 * MB)


def test_unparsed_entries_hold_what_they_might_name():
    """Scan phase one indexed an entry from its name only: it is kept, and so is every module or
    build it might use, until it is read."""
    rows = [
        *graph(1, "known", 1.0),
        Row(9, "fxgraph/xx/fxx/e", "fxgraph", "fxx", None, MB, 1, NOW - 3600, NOW - 3600, parsed=False),
    ]
    rows.append(Row(10, "ab/corphan", "code", "corphan", None, MB, 1, NOW - 3600, NOW - 3600))
    p = plan(rows, Limits(max_size=0, grace=0), "lru", NOW)
    taken = {e.key for e in p.entries}
    assert "fxgraph/kn/fknown/e" in taken
    assert not taken & {"fxgraph/xx/fxx/e", "ab/corphan", "kn/cknown"}
    assert dict(p.skipped)["ab/corphan"] == "not parsed yet"


def _grow_by_definition(g, seeds, inside, taken):
    """The closure's growth as first written: each joining entry asks all of its neighbours'
    other neighbours again (quadratic in a shared child's referrers, but plainly the definition)."""
    kind, children, parents = g.rows.kind, g.children, g.parents

    def has(x):
        return x in inside or x in taken

    grown = []
    for todo in (seeds, grown):
        for m in todo:
            for c in children[m]:
                if not has(c) and all(has(p) for p in parents[c]):
                    inside.add(c)
                    grown.append(c)
            for p in parents[m]:
                if not has(p) and kind[p] == "aotautograd" and not parents.count(p):
                    if all(has(c) for c in children[p]):
                        inside.add(p)
                        grown.append(p)
    return grown


KINDS = ("fxgraph", "aotautograd", "code", "triton", "autotune")


def _linked(kinds, pairs, links=None):
    """A Graph of entries of these kinds, linked parent -> child by `pairs` (Links of the class
    `links`, Links itself by default)."""
    from array import array

    from cachemgr.evict.policy import Graph, Links, Table

    links = links or Links
    n = len(kinds)
    src, dst = array("q", [a for a, _ in pairs]), array("q", [b for _, b in pairs])
    t = Table()
    t.kind.extend(kinds)
    return Graph(t, links(n, src, dst), links(n, dst, src), bytearray(n), bytearray(n))


@settings(max_examples=300, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=40),
    links=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 39)), max_size=160),
    seeds=st.lists(st.integers(0, 39), max_size=10),
    taken=st.lists(st.integers(0, 39), max_size=10),
)
def test_closure_and_dependents_are_the_definitions_on_any_graph(kinds, links, seeds, taken):
    """Closure and dependents, grown by counting each entry's neighbours still out, give the
    entries (in the order) that asking every neighbour again at each join gives: on random
    graphs, shared children, cycles and AOT entries included."""
    from cachemgr.evict.policy import Marks

    n = len(kinds)
    g = _linked(kinds, list(dict.fromkeys((a % n, b % n) for a, b in links if a % n != b % n)))
    seeds = list(dict.fromkeys(s % n for s in seeds))
    marks = Marks(n)
    for i in taken:
        marks.add(i % n)
    assert g.closure(seeds, marks) == seeds + _grow_by_definition(g, seeds, set(seeds), marks)
    assert g.dependents(marks) == _grow_by_definition(g, marks, set(), marks)


def test_a_child_shared_by_entries_that_join_one_by_one_costs_its_links_not_their_square():
    """A chain of P entries, each the only referrer of the next, that all share one child: they
    join the closure one at a time, and the shared child is counted once, then lowered at each
    join (asking its P referrers again at each join read P²/2 of them: 2,000,000 at P = 2,000)."""
    from cachemgr.evict.policy import Links

    p = 2000  # the chain 0..1999, the shared child 2000
    n = p + 1
    pairs = [(i, i + 1) for i in range(p - 1)] + [(i, p) for i in range(p)]
    read = 0

    class Counting(Links):
        __slots__ = ()

        def __getitem__(self, i):
            for x in super().__getitem__(i):
                nonlocal read
                read += 1
                yield x

    g = _linked(["fxgraph"] * n, pairs, Counting)
    assert g.closure([0]) == list(range(n))
    assert read < 5 * len(pairs), read  # each link read a few times (the old growth: 2,000,000)
