"""Input signatures: one dtype table, one tensor spec text, and how a recorded call matches an entry.

Two sides describe the inputs of a compiled graph:
- an fxgraph entry, by its `example_inputs[i]` hash components (TensorMetadata reprs, with
  symbolic sizes for dynamic dims): `entry_signature` gives 'f32[s0, 32](32, 1)cpu; ...';
- a workload, by what `cachemgr.record` saw at a call ('(f32[8,32], i64[8])'): the model's own
  inputs, without the parameters a graph also takes.
Both name a tensor as `<short dtype>[<dims>]`, from the one table below, so `tensors_of` reads
either and a recorded call belongs to an entry whose inputs hold every tensor it had.
"""

from __future__ import annotations

import re

# torch dtype name -> the short name every signature uses (a new torch dtype falls back to its own name)
DTYPES = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e4m3fnuz": "f8e4m3fnuz",
    "float8_e5m2": "f8e5m2",
    "float8_e5m2fnuz": "f8e5m2fnuz",
    "float8_e8m0fnu": "f8e8m0fnu",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "b8",
    "complex32": "c32",
    "complex64": "c64",
    "complex128": "c128",
}
LONG = {v: k for k, v in DTYPES.items()}
# torch's other spellings of the same dtypes (torch.float is torch.float32, ...)
ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "int": "int32",
    "long": "int64",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "chalf": "complex32",
}


def short_dtype(name: str) -> str:
    """'float32' (or 'torch.float32', 'float', 'f32') -> 'f32'; an unknown dtype keeps its name."""
    name = name.removeprefix("torch.")
    name = ALIASES.get(name, name)
    return DTYPES.get(name, name)


def long_dtype(name: str) -> str | None:
    """'f32' (or 'float32', 'float') -> 'float32'; None for a name that is no dtype."""
    name = ALIASES.get(name, name)
    if name in DTYPES:
        return name
    return LONG.get(name)


def tensor_text(dtype: str, dims: list[int | str]) -> str:
    """How every signature names a tensor: 'f32[8,32]'."""
    return f"{short_dtype(dtype)}[{','.join(str(d) for d in dims)}]"


# -- the entry side ---------------------------------------------------------------------------------

_TENSOR_META = re.compile(
    r"dtype=torch\.(?P<dtype>\w+), shape=torch\.Size\(\[(?P<shape>[^\]]*)\]\), "
    r"stride=\((?P<stride>[^)]*)\), device=device\(type='(?P<dev>\w+)'(?:, index=(?P<idx>\d+))?\)"
    r"(?P<rest>[^)]*)"
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
    """One `example_inputs[i]` component value as 'f32[s0, 32](32, 1)cpu' (a tensor), or the
    symbol or literal of a scalar input."""
    parts = _SPECS.get(value)
    if parts is None:
        if len(_SPECS) >= MAX_SPECS:
            _SPECS.clear()
        parts = _SPECS[value] = _spec_parts(value)
    if len(parts) == 1:
        return parts[0]
    return "".join(_canonical_symbols(p, names) if i % 2 else p for i, p in enumerate(parts))


# An input's text is read once per distinct value (a model's weights are inputs of each of its
# graphs, and the debug line that holds one is one string shared by every entry: components.py);
# only its symbols are renumbered per entry.
_SPECS: dict[str, tuple[str, ...]] = {}
MAX_SPECS = 10_000  # (a value is at most 800 characters: components.VALUE_CHARS)


def _spec_parts(value: str) -> tuple[str, ...]:
    """`input_spec`'s text in pieces, the odd ones those that may name symbols; or the whole
    text alone, when none does."""
    m = _TENSOR_META.search(value)
    if not m:
        scalar = value.strip().strip("()").strip(",").strip("'\"")
        pieces: tuple[str, ...] = ("", scalar, "") if scalar else ("?",)
    else:
        shape = ", ".join(s.strip() for s in m["shape"].split(",") if s.strip())
        stride = ", ".join(s.strip() for s in m["stride"].split(",") if s.strip())
        device = m["dev"] + (f":{m['idx']}" if m["idx"] is not None else "")
        grad = " grad" if "requires_grad=True" in m["rest"] else ""
        pieces = (f"{short_dtype(m['dtype'])}[", shape, "](", stride, f"){device}{grad}")
    if len(pieces) > 1 and not any(_SYMBOL.search(p) for p in pieces[1::2]):
        return ("".join(pieces),)
    return pieces


def entry_signature(inputs: list[tuple[int, str]]) -> str | None:
    """The signature of an entry from its (index, example_inputs value) pairs."""
    if not inputs:
        return None
    names: dict[str, str] = {}
    return "; ".join(input_spec(v, names) for _, v in sorted(inputs))


# -- matching a recorded call to entries --------------------------------------------------------------

# a dtype word and its shape: possessive, and a word only from its start, so each character is
# looked at once (a run of letters was scanned again from each of them: quadratic in an entry's text)
_TENSOR = re.compile(r"(?<![a-z0-9])[a-z][a-z0-9]*+\[[^\[\]]*+\]")


def tensors_of(signature: str | None) -> set[str]:
    """The tensors a signature names, as 'f32[8,16]' (spaces dropped): either side's text."""
    return set(_TENSOR.findall((signature or "").replace(" ", "")))


def call_matches(recorded: set[str], entry: set[str]) -> bool:
    """A recorded call belongs to an entry that takes every tensor the call had (the entry's
    other inputs are the model's parameters and buffers)."""
    return bool(recorded) and recorded <= entry
