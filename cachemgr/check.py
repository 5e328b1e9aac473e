"""Will it hit here? Predict, before a cache or bundle is used, which graphs this host will reuse.

An fxgraph key is a hash of named components (docs/formats.md, section 3); most of them do not
depend on the graph: the torch build (`torch_version`), the system (`system_info[...]`: GPU
name, CUDA/ROCm and Triton versions), every Inductor option (`inductor_config[...]`), the matmul
and determinism settings, the C++ thread count. A worker process running this host's torch
computes this host's side of each of those (cachemgr.prewarm.worker, through the adapter for its
torch); here, without torch, each entry's stored components are compared with it:

- **hit**: every graph-independent component is this host's, and the device the graph ran on is
  here; the same calls (same graph, inputs and per-call options) find the entry;
- **miss**: a component differs in a way the workload cannot undo: another torch build, another
  GPU or driver stack, an Inductor option this host's environment sets, an option set the
  manifest no longer uses, a device this host does not have. Each difference is named with both
  values, grouped as `diff` groups them (code, inputs, options, environment);
- **unknown**: the entry records no components (torch 2.5 and 2.6), or it differs only where
  the workload itself may decide: options given to `torch.compile(options=...)` that cachemgr
  does not know, matmul / determinism / default-dtype settings a program sets at run time, or a
  component this torch does not compute. Never a guessed "hit".

Per-call options: `torch.compile(options=P, mode=M)` patches the Inductor config while the graph
compiles, so an entry compiled with options has option values that differ from this host's
defaults without being a miss. The candidate configurations are this host's defaults and the
defaults patched by each option set cachemgr knows: the manifest's `compile` tables, and the
options `cachemgr.record` recorded per model (the `shapes` table). An entry whose options one
candidate reproduces exactly is matched to it. An entry no candidate reproduces is a miss when
the manifest was given (it is taken as every compile this host makes), or when every option in
which it differs is one this host's environment changed (a `TORCHINDUCTOR_*` variable: the
worker computes torch's own defaults without them too); otherwise it is unknown.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachemgr.parse import components_of
from cachemgr.vocab import Part

HIT, MISS, UNKNOWN = "hit", "miss", "unknown"
VERDICTS = (HIT, MISS, UNKNOWN)

Comp = tuple[str, str | None]  # (hash, value); value None: not loaded (the graph code)

# Components a graph decides (its code, inputs, role): the same workload computes them again.
GRAPH_PREFIXES = (
    "example_inputs[",
    "inputs_to_check[",
    "fx_kwargs[",
    "user_defined_triton_source[",
    "var_to_hint_override[",
)
GRAPH_NAMES = frozenset({"gm", "cudagraph_override", "cudagraph_annotation"})
# Present only for some graphs (a CPU graph's C++ thread count; a graph without tensor inputs'
# device index): compared when the entry has them, never required of it.
CONDITIONAL = frozenset({"cpp_runtime_thread_count", "default_cuda_device_index"})
# Settings a program may change at run time (torch.backends..., use_deterministic_algorithms,
# set_default_dtype): this host's defaults say nothing certain about what the workload sets.
WORKLOAD_SET = frozenset({"cuda_matmul_settings", "deterministic_algorithms_settings", "default_dtype"})
# Facts of the host that no program setting changes (set_num_threads aside).
HOST_FACTS = ("torch_version", "system_info[", "cpp_runtime_thread_count", "default_cuda_device_index")
# fx_kwargs that copy an Inductor option (compile_fx passes config.<name>): compared by value.
FX_MIRRORS = {"fx_kwargs[cpp_wrapper]": "cpp_wrapper", "fx_kwargs[fx_wrapper]": "fx_wrapper"}
DEVICE = "device"  # the pseudo-component of an input's device index

_DEVICE = re.compile(r"device=device\(type='(\w+)'(?:, index=(\d+))?\)")


def group_of(name: str) -> str:
    """code | inputs | options | environment, as `diff` groups components."""
    if name == "gm":
        return Part.CODE
    if name.startswith(("example_inputs[", "inputs_to_check[")) or name == DEVICE:
        return Part.INPUTS
    if (
        name.startswith(("fx_kwargs[", "inductor_config"))
        or "pass" in name
        or "partitioner" in name
        or name in ("precompile_enabled", "provenance_tracking_level", "cache_key_tag")
    ):
        return Part.OPTIONS
    return Part.ENVIRONMENT


def graph_dependent(name: str) -> bool:
    return name in GRAPH_NAMES or name.startswith(GRAPH_PREFIXES)


def is_host_fact(name: str) -> bool:
    return name.startswith(HOST_FACTS)


# -- the two sides -------------------------------------------------------------------------------

NOT_READ_YET = "its entry is not read yet (the next scan reads it)"  # a Graph's `corrupt` till then


@dataclass(frozen=True)
class Graph:
    """One fxgraph entry as the check sees it: its stored components (empty: not recorded)."""

    key: str  # the entry's path under the cache dir, or its key in a bundle
    graph_key: str | None
    components: Mapping[str, Comp]
    torch_version: str | None = None  # version string, or a family ('2.5.*') where nothing records it
    torch_version_hash: str | None = None
    corrupt: str | None = None  # why its entry does not read (a bundle's: its parse result says)

    @property
    def recorded(self) -> bool:
        return bool(self.components)

    def devices(self) -> list[str]:
        """The devices its inputs are on ('cpu', 'cuda:0'), from its example inputs."""
        out = []
        for name, (_, value) in self.components.items():
            if name.startswith("example_inputs[") and value:
                m = _DEVICE.search(value)
                if m:
                    out.append(m[1] + (f":{m[2]}" if m[2] is not None else ""))
        return sorted(set(out))


@dataclass(frozen=True)
class Candidate:
    """This host's graph-independent components under one option set."""

    label: str  # 'defaults', 'model ranker', 'recorded ranker'
    options: Mapping[str, Any]  # the config patch (mode options and options), {} for defaults
    components: Mapping[str, Comp]
    mirrors: Mapping[str, str] = field(default_factory=dict)  # fx_kwargs[...] -> value


@dataclass(frozen=True)
class Host:
    """This host's side, as the worker computed it (`Host.of(report)`)."""

    torch: str
    torch_version_hash: str | None
    system: str  # 'NVIDIA H200, CUDA 13.0, Triton 3.6.0' | 'no GPU'
    candidates: tuple[Candidate, ...]  # [0]: this host's defaults
    pristine: Mapping[str, Comp] | None = None  # torch's defaults without this host's TORCHINDUCTOR_* variables
    env: Mapping[str, str] = field(default_factory=dict)  # those variables
    cuda_devices: int = 0
    devices: tuple[str, ...] = ()  # where the workload runs: --devices, else every device here
    complete: bool = False  # the option sets are every compile this host makes (a manifest was given)
    errors: tuple[str, ...] = ()  # option sets torch refused

    @property
    def defaults(self) -> Candidate:
        return self.candidates[0]

    @classmethod
    def of(cls, report: Mapping[str, Any], devices: Sequence[str] | None = None, complete: bool = False) -> Host:
        """From the worker's `host_side` report: lines per option set (the first full, the others
        as the lines that differ from it)."""
        base = _parse(report["configs"][0]["lines"])
        cands = []
        for i, c in enumerate(report["configs"]):
            comps = base if i == 0 else {**base, **_parse(c["lines"])}
            cands.append(Candidate(c["label"], c.get("options") or {}, comps, c.get("mirrors") or {}))
        pristine = None
        if report.get("pristine"):
            pristine = {**base, **_parse(report["pristine"])}
        fp = report.get("fingerprint") or {}
        n = int(report.get("cuda_devices") or 0)
        devs = tuple(devices) if devices else ("cpu", *(f"cuda:{i}" for i in range(n)))
        return cls(
            report.get("torch") or fp.get("torch") or "?",
            fp.get("torch_version_hash"),
            fp.get("system") or "?",
            tuple(cands),
            pristine,
            dict(report.get("env") or {}),
            n,
            tuple(_canonical_device(d) for d in devs),
            complete,
            tuple(report.get("errors") or ()),
        )


def _parse(lines: Iterable[str]) -> dict[str, Comp]:
    return {c.name: (c.hash, c.value) for c in components_of(list(lines))}


def _canonical_device(d: str) -> str:
    return "cuda:0" if d == "cuda" else d


# -- one graph ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    group: str
    name: str
    cache: str | None  # the entry's value (None: it has no such component)
    host: str | None  # this host's (None: this torch computes no such component)
    certain: bool  # True: a workload cannot make this match; False: it may (unknown)
    why: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "name": self.name,
            "cache": self.cache,
            "host": self.host,
            "certain": self.certain,
            "why": self.why,
        }


@dataclass(frozen=True)
class Prediction:
    graph: Graph
    verdict: str  # hit | miss | unknown
    differences: tuple[Difference, ...] = ()
    options: str | None = None  # the option set that reproduces its options (None: defaults)
    reason: str | None = None  # unknown: why

    def causes(self) -> list[str]:
        """What makes it miss (certain differences), or why it is unknown; coarse names."""
        if self.verdict == HIT:
            return []
        diffs = (
            [d for d in self.differences if d.certain]
            if self.verdict == MISS
            else [d for d in self.differences if not d.certain]
        )
        names = list(dict.fromkeys(_coarse(d.name) for d in diffs))
        if not names:
            return [self.reason] if self.reason else []
        return names

    def cause(self) -> str:
        """All its causes in one phrase: the summary counts each graph once."""
        names = self.causes()
        if self.verdict == UNKNOWN:
            return self.reason or ("it differs only where the workload decides: " + ", ".join(names))
        if not names:
            return "its components differ"
        if names == ["device"]:
            return "its device is not where the workload runs here"
        return (", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]) + (
            " differ" if len(names) > 1 else " differs"
        )

    def as_dict(self) -> dict[str, Any]:
        by: dict[str, list[dict]] = defaultdict(list)
        for d in self.differences:
            by[d.group].append(d.as_dict())
        return {
            "key": self.graph.key,
            "graph_key": self.graph.graph_key,
            "verdict": self.verdict,
            "cause": None if self.verdict == HIT else self.cause(),
            "options": self.options,
            "reason": self.reason,
            "torch_version": self.graph.torch_version,
            "groups": dict(by),
            "devices": self.graph.devices(),
        }


def _coarse(name: str) -> str:
    return "system_info" if name.startswith("system_info[") else name


def _show(comp: Comp | None, name: str, torch_name: str | None = None) -> str | None:
    if comp is None:
        return None
    h, value = comp
    if name == "torch_version":
        return f"{torch_name or 'torch'} (hash {h[:12]})" if torch_name else f"(hash {h[:12]})"
    return value if value else f"(hash {h[:12]})"


def _fact_rank(name: str) -> int:
    return next(i for i, prefix in enumerate(HOST_FACTS) if name.startswith(prefix))


def _options_names(graph: Graph, host: Host) -> set[str]:
    names = set()
    for n in set(graph.components) | set(host.defaults.components):
        if graph_dependent(n) or is_host_fact(n) or n in WORKLOAD_SET:
            continue
        names.add(n)
    return names


def _option_diff(graph: Graph, cand: Candidate, names: set[str]) -> list[str]:
    out = []
    for n in names:
        mine, theirs = graph.components.get(n), cand.components.get(n)
        if mine is None and theirs is not None and n in CONDITIONAL:
            continue
        if (mine[0] if mine else None) != (theirs[0] if theirs else None):
            out.append(n)
    for n, opt in FX_MIRRORS.items():
        mine = graph.components.get(n)
        if mine is not None and opt in cand.mirrors and (mine[1] or "") != cand.mirrors[opt]:
            out.append(n)
    return sorted(out)


def predict(graph: Graph, host: Host) -> Prediction:
    """Will this host's workload find this entry?"""
    if graph.corrupt == NOT_READ_YET:
        return Prediction(graph, UNKNOWN, reason=NOT_READ_YET)
    if graph.corrupt:
        return Prediction(graph, UNKNOWN, reason=f"its entry does not read: {graph.corrupt}")
    if not graph.recorded:
        who = f"torch {graph.torch_version}" if graph.torch_version else "its torch"
        if graph.torch_version and "*" not in graph.torch_version and graph.torch_version != host.torch:
            return Prediction(
                graph,
                MISS,
                (
                    Difference(
                        Part.ENVIRONMENT,
                        "torch_version",
                        graph.torch_version,
                        host.torch,
                        True,
                        "as the bundle's header names it",
                    ),
                ),
            )
        return Prediction(
            graph, UNKNOWN, reason=f"{who} records no hash components: what it was compiled for cannot be compared"
        )
    diffs: list[Difference] = []
    base = host.defaults.components
    # 1. host facts: the torch build, the system, the thread count, the device
    names = set(graph.components) | {n for n in base if n.startswith("system_info[")}
    for name in sorted((n for n in names if is_host_fact(n)), key=lambda n: (_fact_rank(n), n)):
        mine, theirs = graph.components.get(name), base.get(name)
        if mine is None and name in CONDITIONAL:
            continue
        if (mine[0] if mine else None) == (theirs[0] if theirs else None):
            continue
        why = None
        if name == "cpp_runtime_thread_count":
            why = "torch.get_num_threads() here (cores, OMP_NUM_THREADS); unless the workload sets it"
        diffs.append(
            Difference(
                group_of(name),
                name,
                _show(mine, name, graph.torch_version) if mine else "(absent)",
                _show(theirs, name, host.torch) if theirs else "(absent)",
                True,
                why,
            )
        )
    for dev in graph.devices():
        if dev != "cpu" and dev not in host.devices:
            here = [d for d in host.devices if d != "cpu"]
            diffs.append(
                Difference(
                    Part.INPUTS,
                    DEVICE,
                    dev,
                    ", ".join(here) or "no CUDA device",
                    True,
                    "keys embed the device index" if here else "this host has no such device",
                )
            )
    # 2. what the workload may set at run time
    for name in sorted(WORKLOAD_SET & set(graph.components)):
        mine, theirs = graph.components[name], base.get(name)
        if theirs is None or mine[0] != theirs[0]:
            diffs.append(
                Difference(
                    Part.ENVIRONMENT,
                    name,
                    _show(mine, name),
                    _show(theirs, name),
                    False,
                    "a program may set it at run time; this is this host's default",
                )
            )
    # 3. options: the candidate that reproduces them, or the nearest
    names = _options_names(graph, host)
    scored = [(len(_option_diff(graph, c, names)), i, c) for i, c in enumerate(host.candidates)]
    n_diff, _, best = min(scored, key=lambda s: (s[0], s[1]))
    label = None if best is host.defaults else best.label
    if n_diff:
        options = _option_differences(graph, host, best, _option_diff(graph, best, names))
        if any(d.name == "torch_version" for d in diffs):  # another torch: its options are another set
            options = [
                Difference(d.group, d.name, d.cache, d.host, False, "another torch build's option") for d in options
            ]
        diffs.extend(options)
    certain = [d for d in diffs if d.certain]
    if certain:
        return Prediction(graph, MISS, tuple(diffs), label)
    if diffs:
        return Prediction(graph, UNKNOWN, tuple(diffs), label, _unknown_reason(diffs))
    return Prediction(graph, HIT, (), label)


def _option_differences(graph: Graph, host: Host, cand: Candidate, names: list[str]) -> list[Difference]:
    out = []
    env_set = []
    for n in names:
        mine, theirs = graph.components.get(n), cand.components.get(n)
        if n in FX_MIRRORS:
            mine_v, theirs_v = (mine[1] if mine else None), cand.mirrors.get(FX_MIRRORS[n])
        else:
            mine_v, theirs_v = _show(mine, n), _show(theirs, n)
        if mine is not None and theirs is None and n not in FX_MIRRORS:
            out.append(Difference(group_of(n), n, mine_v, None, False, f"torch {host.torch} computes no {n}"))
            continue
        by_env = (
            host.pristine is not None
            and n in host.pristine
            and theirs is not None
            and mine is not None
            and host.pristine[n][0] != theirs[0]
            and host.pristine[n][0] == mine[0]
        )
        if by_env:
            env_set.append(n)
        out.append(Difference(group_of(n), n, mine_v, theirs_v, False, None))
    if host.complete:
        why = f"no option set of the manifest compiles with it (nearest: {cand.label})"
        return [Difference(d.group, d.name, d.cache, d.host, True, d.why or why) for d in out]
    if env_set and len(env_set) == len(out):
        names_env = ", ".join(sorted(host.env)) or "its environment"
        return [Difference(d.group, d.name, d.cache, d.host, True, f"this host sets it ({names_env})") for d in out]
    return [
        Difference(
            d.group,
            d.name,
            d.cache,
            d.host,
            d.certain,
            d.why
            or "compiled with options cachemgr does not know (torch.compile(options=...)?); "
            "give them in a --manifest, or record the model with cachemgr.record",
        )
        for d in out
    ]


def _unknown_reason(diffs: Sequence[Difference]) -> str:
    opts = [d.name for d in diffs if d.group == Part.OPTIONS]
    other = [d.name for d in diffs if d.group != Part.OPTIONS]
    parts = []
    if opts:
        parts.append(
            "compiled with options cachemgr does not know ("
            + ", ".join(opts[:4])
            + (f" and {len(opts) - 4} more" if len(opts) > 4 else "")
            + ")"
        )
    if other:
        parts.append("settings a program may change at run time differ (" + ", ".join(other) + ")")
    return "; ".join(parts)


# -- many graphs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SummaryLine:
    verdict: str
    cause: str | None
    graphs: int

    def text(self) -> str:
        s = "" if self.graphs == 1 else "s"
        if self.verdict == HIT:
            return f"{self.graphs} graph{s} will hit" + (f" ({self.cause})" if self.cause else "")
        if self.verdict == MISS:
            return f"{self.graphs} graph{s} will miss because {self.cause}"
        return f"{self.graphs} graph{s} unknown: {self.cause}"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "cause": self.cause, "graphs": self.graphs, "text": self.text()}


def summarize(predictions: Sequence[Prediction]) -> list[SummaryLine]:
    """One line per verdict and cause, each graph counted once: the lines add up to the graphs."""
    groups: dict[tuple[str, str | None], int] = defaultdict(int)
    for p in predictions:
        cause = (f"compiled with the options of {p.options}" if p.options else None) if p.verdict == HIT else p.cause()
        groups[(p.verdict, cause)] += 1
    return sorted(
        (SummaryLine(v, c, n) for (v, c), n in groups.items()),
        key=lambda s: (VERDICTS.index(s.verdict), -s.graphs, s.cause or ""),
    )


@dataclass(frozen=True)
class Report:
    host: Host
    predictions: tuple[Prediction, ...]
    source: str  # the cache dir or bundle checked

    def count(self, verdict: str) -> int:
        return sum(1 for p in self.predictions if p.verdict == verdict)

    def as_dict(self) -> dict[str, Any]:
        h = self.host
        return {
            "source": self.source,
            "host": {
                "torch": h.torch,
                "torch_version_hash": h.torch_version_hash,
                "system": h.system,
                "devices": list(h.devices),
                "option_sets": [c.label for c in h.candidates],
                "environment": dict(h.env),
                "manifest_complete": h.complete,
                "errors": list(h.errors),
            },
            "graphs": len(self.predictions),
            "hit": self.count(HIT),
            "miss": self.count(MISS),
            "unknown": self.count(UNKNOWN),
            "summary": [s.as_dict() for s in summarize(self.predictions)],
            "predictions": [p.as_dict() for p in self.predictions],
        }


def check(graphs: Iterable[Graph], host: Host, source: str) -> Report:
    return Report(host, tuple(predict(g, host) for g in graphs), source)


# -- where graphs come from --------------------------------------------------------------------------


def graphs_from_store(store: Any) -> list[Graph]:
    """Every fxgraph entry of the index's cache: those parsed with their components (the graph
    code by hash only), then those that do not read or are not read yet (predicted unknown)."""
    entries = store.graph_entries()
    code = {e.sets["code"] for e in entries if "code" in e.sets}
    rest = {s for e in entries for p, s in e.sets.items() if p != "code"}
    values = store.component_sets(rest, values=True)
    values.update(store.component_sets(code, values=False))
    out = []
    for e in entries:
        comps: dict[str, Comp] = {}
        for s in e.sets.values():
            comps.update(values.get(s, {}))
        tv = comps.get("torch_version")
        out.append(Graph(e.key, e.graph_key, comps, e.torch_version, tv[0] if tv else None))
    for key, graph_key, why in store.unread_graphs():
        out.append(Graph(key, graph_key, {}, corrupt=why or NOT_READ_YET))
    return out


def graph_of(key: str, parsed: Any) -> Graph:
    """From a parse result (cachemgr.parse.parse_fxgraph) of an entry read directly (a bundle)."""
    comps = {c.name: (c.hash, c.value) for c in parsed.components}
    return Graph(key, parsed.graph_key, comps, parsed.torch_version, parsed.torch_version_hash, parsed.corrupt)


# -- option sets cachemgr knows -------------------------------------------------------------------


MAX_RECORDED_MODELS = 1000  # recorded models whose options a check compares (a spool's writers name any number)


def option_sets(manifest: Any | None, recorded: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The torch.compile kwargs the host's workload uses, as far as cachemgr knows: each manifest
    model's `compile` table (and, for a model that takes the recorded options, those), and the
    options recorded per model (its latest row's; the first MAX_RECORDED_MODELS models). Each:
    {"label", "mode", "dynamic", "options"}."""
    out: list[dict[str, Any]] = []
    by_model: dict[str, Mapping[str, Any]] = {}
    for r in recorded:
        opts, model = r.get("options"), str(r.get("model"))
        if isinstance(opts, Mapping) and (model in by_model or len(by_model) < MAX_RECORDED_MODELS):
            by_model[model] = opts
    named = set()
    for m in getattr(manifest, "models", ()) or ():
        kw = m.compile if m.compile is not None else by_model.get(m.name)
        named.add(m.name)
        if kw is not None:
            out.append(_option_set(f"model {m.name}", kw))
    for model, kw in sorted(by_model.items()):
        if model not in named:
            out.append(_option_set(f"recorded {model}", kw))
    return [o for o in out if o["mode"] or o["options"]]


def _option_set(label: str, kw: Mapping[str, Any]) -> dict[str, Any]:
    opts = kw.get("options")
    return {
        "label": label,
        "mode": kw.get("mode") if isinstance(kw.get("mode"), str) else None,
        "dynamic": kw.get("dynamic") if isinstance(kw.get("dynamic"), bool) else None,
        "options": dict(opts) if isinstance(opts, Mapping) else {},
    }


# Variables that choose Inductor options at import (config.py reads them); the cache and remote
# tier switches change no key.
NOT_OPTIONS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE",
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_REDIS_URL",
    "TORCHINDUCTOR_REDIS_HOST",
    "TORCHINDUCTOR_REDIS_PORT",
    "TORCHINDUCTOR_COMPILE_THREADS",
    "TORCHINDUCTOR_WORKER_START",
)


def option_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The TORCHINDUCTOR_* variables of an environment that may set Inductor options."""
    return {k: v for k, v in environ.items() if k.startswith("TORCHINDUCTOR_") and not k.startswith(NOT_OPTIONS)}


__all__ = [
    "HIT",
    "MISS",
    "UNKNOWN",
    "Candidate",
    "Difference",
    "Graph",
    "Host",
    "Prediction",
    "Report",
    "SummaryLine",
    "check",
    "graph_of",
    "graphs_from_store",
    "group_of",
    "option_sets",
    "option_variables",
    "predict",
    "summarize",
]
