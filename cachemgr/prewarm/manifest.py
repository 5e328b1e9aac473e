"""The prewarm manifest (TOML): which models to compile, how, on what, with which inputs. No torch.

    [[model]]
    name = "ranker"                          # the name given to cachemgr.record.compile
    factory = "myapp.models:build_ranker"    # returns the nn.Module or callable (weights need not be real)
    factory_kwargs = { hidden = 512 }        # optional
    compile = { mode = "max-autotune-no-cudagraphs", dynamic = false, fullgraph = true, options = {} }
    device = "cuda"                          # default "cpu"; `prewarm --devices` overrides
    autocast = "bfloat16"                    # optional
    train = false                            # true: forward and backward
    max_input_bytes = "1GiB"                 # default; one replayed call's inputs may take no more
    shapes = "recorded"                      # or explicit inputs, one list of arguments per call:
    # shapes = [["f32[8,512]"], ["f32[16,512]", 3], [{shape = [4, 512], dtype = "bfloat16"}]]

A problem in one model's table is that model's error (naming model and field); the other models
still load. Only a file that is not TOML at all, or holds a value JSON has no form for (a TOML date
or time: the worker gets its job as JSON), fails as a whole.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass, field
from typing import Any

from cachemgr.errors import ConfigError, NotFound, UsageError

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
AUTOCAST = ("float16", "bfloat16")
DTYPES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "i64": "int64",
    "i32": "int32",
    "i16": "int16",
    "i8": "int8",
    "u8": "uint8",
    "b8": "bool",
}
DTYPE_NAMES = set(DTYPES.values()) | {"complex64"}
# each matched whole (fullmatch: `$` takes a trailing newline), digits ASCII (int() reads '١٤' too)
FACTORY_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
SHAPE_RE = re.compile(
    r"(?P<dtype>[a-z0-9]+)\[(?P<dims>(?:[0-9]{1,18}(?:,[0-9]{1,18})*)?)\](?P<grad>\*?)"
)  # spaces removed first
DEVICE_RE = re.compile(r"(cpu|cuda|xpu|mps)(:[0-9]+)?")
MODEL_KEYS = {
    "name",
    "factory",
    "factory_kwargs",
    "compile",
    "device",
    "autocast",
    "train",
    "shapes",
    "max_input_bytes",
}
# What the inputs of one replayed call may take, their tensors' storage counted before any is
# allocated: recorded shapes come from the spool, which every workload can write.
MAX_INPUT_BYTES = 1 << 30
COMPILE_KEYS = {"mode", "dynamic", "fullgraph", "options", "backend"}


class ManifestError(ConfigError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    factory: str
    factory_kwargs: dict = field(default_factory=dict)
    compile: dict | None = None  # torch.compile kwargs; None: take the recorded ones
    device: str = "cpu"
    autocast: str | None = None
    train: bool = False
    shapes: str | list = "recorded"  # "recorded" or a list of input specs (record.input_spec form)
    max_input_bytes: int = MAX_INPUT_BYTES

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "factory": self.factory,
            "factory_kwargs": self.factory_kwargs,
            "compile": self.compile,
            "device": self.device,
            "autocast": self.autocast,
            "train": self.train,
            "shapes": self.shapes,
            "max_input_bytes": self.max_input_bytes,
        }


@dataclass(frozen=True)
class Manifest:
    path: str
    models: list[ModelSpec]
    errors: list[tuple[str, str]]  # (model name or '#i', message) of tables that did not load

    def select(self, name: str | None) -> Manifest:
        if name is None:
            return self
        models = [m for m in self.models if m.name == name]
        errors = [e for e in self.errors if e[0] == name]
        if not models and not errors:
            known = ", ".join(m.name for m in self.models) or "none"
            raise NotFound(f"manifest {self.path}: no model {name!r} (models: {known})")
        return Manifest(self.path, models, errors)


def load(path: str) -> Manifest:
    from cachemgr.config import read_toml

    return parse(read_toml(path, "manifest", ManifestError, NotFound), path)  # (a file named that is not: exit 3)


def parse(doc: dict, path: str = "<manifest>") -> Manifest:
    unknown = set(doc) - {"model"}
    if unknown:
        raise ManifestError(
            f"manifest {path}: unknown top-level key(s) {', '.join(sorted(unknown))} (models go in [[model]] tables)"
        )
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise ManifestError(f"manifest {path}: no [[model]] tables")
    models: list[ModelSpec] = []
    errors: list[tuple[str, str]] = []
    names: set[str] = set()
    for i, t in enumerate(tables, 1):
        name = t.get("name") if isinstance(t, dict) else None
        label = name if isinstance(name, str) else f"#{i}"
        where = _not_json(t)
        if where is not None:
            raise ManifestError(
                f"manifest {path}: model {label!r}: field {where[0]!r}: a TOML {where[1]}, which prewarm cannot "
                "pass on (JSON has none): write it as a string"
            )
        try:
            m = _model(t)
            if m.name in names:
                raise _FieldError("name", f"duplicate model name {m.name!r}")
            names.add(m.name)
            models.append(m)
        except _FieldError as e:
            errors.append((label, f"manifest {path}: model {label!r}: field {e.field!r}: {e.message}"))
    return Manifest(path, models, errors)


_JSON_TYPES = (str, int, float, bool)


def _not_json(doc: Any) -> tuple[str, str] | None:
    """(dotted key, TOML type) of the first value in `doc` that JSON cannot carry, or None. A
    date, time or datetime is the only one TOML has. Iterative: TOML nests as deep as it likes."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif not isinstance(v, _JSON_TYPES):
            return where, "date or time" if isinstance(v, (datetime.date, datetime.time)) else type(v).__name__
    return None


class _FieldError(Exception):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field_name, message


def _model(t: Any) -> ModelSpec:
    if not isinstance(t, dict):
        raise _FieldError("model", "must be a table")
    for k in sorted(set(t) - MODEL_KEYS):
        raise _FieldError(k, f"unknown field (known: {', '.join(sorted(MODEL_KEYS))})")
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise _FieldError("name", "required, a non-empty string")
    factory = t.get("factory")
    if not isinstance(factory, str) or not FACTORY_RE.fullmatch(factory):
        raise _FieldError("factory", f"required, 'package.module:function', got {factory!r}")
    fkw = t.get("factory_kwargs", {})
    if not isinstance(fkw, dict):
        raise _FieldError("factory_kwargs", "must be a table")
    device = t.get("device", "cpu")
    if not isinstance(device, str) or not DEVICE_RE.fullmatch(device):
        raise _FieldError("device", f"must be cpu, cuda or cuda:N, got {device!r}")
    autocast = t.get("autocast")
    if autocast is not None and autocast not in AUTOCAST:
        raise _FieldError("autocast", f"must be one of {', '.join(AUTOCAST)}, got {autocast!r}")
    train = t.get("train", False)
    if not isinstance(train, bool):
        raise _FieldError("train", f"must be true or false, got {train!r}")
    return ModelSpec(
        name=name,
        factory=factory,
        factory_kwargs=fkw,
        compile=_compile(t.get("compile")),
        device=device,
        autocast=autocast,
        train=train,
        shapes=_shapes(t.get("shapes", "recorded"), train),
        max_input_bytes=_size(t.get("max_input_bytes", MAX_INPUT_BYTES), "max_input_bytes"),
    )


def _size(v: Any, field_name: str) -> int:
    from cachemgr.units import parse_size

    try:
        n = parse_size(v) if isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) else 0
    except UsageError as e:
        raise _FieldError(field_name, str(e)) from None
    if n <= 0:
        raise _FieldError(field_name, f'must be a size such as "4GiB" or a number of bytes, got {v!r}')
    return n


def _compile(c: Any) -> dict | None:
    if c is None:
        return None
    if not isinstance(c, dict):
        raise _FieldError("compile", "must be a table {mode, dynamic, fullgraph, options}")
    for k in sorted(set(c) - COMPILE_KEYS):
        raise _FieldError(f"compile.{k}", f"unknown (known: {', '.join(sorted(COMPILE_KEYS))})")
    out: dict[str, Any] = {}
    if "mode" in c:
        if c["mode"] not in MODES:
            raise _FieldError("compile.mode", f"must be one of {', '.join(MODES)}, got {c['mode']!r}")
        if c["mode"] != "default":
            out["mode"] = c["mode"]
    if "dynamic" in c:
        d = c["dynamic"]
        if d == "auto":
            d = None
        if d is not None and not isinstance(d, bool):
            raise _FieldError("compile.dynamic", f'must be true, false or "auto", got {d!r}')
        if d is not None:
            out["dynamic"] = d
    if "fullgraph" in c:
        if not isinstance(c["fullgraph"], bool):
            raise _FieldError("compile.fullgraph", f"must be true or false, got {c['fullgraph']!r}")
        out["fullgraph"] = c["fullgraph"]
    if "backend" in c:
        if not isinstance(c["backend"], str):
            raise _FieldError("compile.backend", "must be a backend name")
        out["backend"] = c["backend"]
    if "options" in c:
        if not isinstance(c["options"], dict):
            raise _FieldError("compile.options", "must be a table of Inductor options")
        if c["options"]:
            out["options"] = c["options"]
    return out


def _shapes(s: Any, train: bool) -> str | list:
    if s == "recorded":
        return s
    if not isinstance(s, list) or not s:
        raise _FieldError("shapes", f'must be "recorded" or a non-empty list of input lists, got {s!r}')
    out = []
    for i, call in enumerate(s):
        where = f"shapes[{i}]"
        if isinstance(call, dict):
            args, kwargs = call.get("args", []), call.get("kwargs", {})
            if set(call) - {"args", "kwargs"} or not isinstance(args, list) or not isinstance(kwargs, dict):
                raise _FieldError(where, "a table must be {args = [...], kwargs = {...}}")
        elif isinstance(call, list):
            args, kwargs = call, {}
        else:
            raise _FieldError(where, f"must be a list of arguments, got {call!r}")
        out.append(
            {
                "args": [_arg(a, f"{where}[{j}]") for j, a in enumerate(args)],
                "kwargs": {k: _arg(v, f"{where}.{k}") for k, v in kwargs.items()},
                "grad": train,
            }
        )
    return out


MAX_NESTING = 16  # lists in lists of one argument (a replay, a signature, a job recurse over them)


def _arg(a: Any, where: str, depth: int = 0) -> dict:
    """One argument: 'f32[8,32]' ('*' after: requires_grad), a tensor table, a scalar, a list."""
    if isinstance(a, bool):
        return {"t": "bool", "v": a}
    if isinstance(a, float) and not math.isfinite(a):
        return {"t": "float", "v": str(a)}  # nan, inf, -inf: JSON has no such numbers
    if isinstance(a, (int, float)):
        return {"t": type(a).__name__, "v": a}
    if isinstance(a, list):
        if depth >= MAX_NESTING:
            raise _FieldError(where, f"lists nested deeper than {MAX_NESTING}")
        return {"t": "list", "items": [_arg(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(a)]}
    if isinstance(a, str):
        m = SHAPE_RE.fullmatch(a.replace(" ", ""))
        if not m:
            raise _FieldError(
                where,
                f"tensor spec must look like 'f32[8,32]' or 'bfloat16[4,3,224,224]' "
                f"(whole numbers between the commas), got {a!r}",
            )
        dims = [int(d) for d in m["dims"].split(",") if d]
        return _tensor(m["dtype"], dims, bool(m["grad"]), where)
    if isinstance(a, dict):
        extra = set(a) - {"shape", "dtype", "requires_grad"}
        if (
            extra
            or not isinstance(a.get("shape"), list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in a["shape"])
        ):
            raise _FieldError(where, 'a tensor table is {shape = [..ints..], dtype = "float32", requires_grad = false}')
        grad = a.get("requires_grad", False)
        if not isinstance(grad, bool):  # (bool("false") is True)
            raise _FieldError(f"{where}.requires_grad", f"must be true or false, got {grad!r}")
        return _tensor(a.get("dtype", "float32"), a["shape"], grad, where)
    raise _FieldError(where, f"unsupported argument {a!r}")


def _tensor(dtype: Any, dims: list[int], grad: bool, where: str) -> dict:
    if not isinstance(dtype, str):  # (a list or table is no key to look up: TypeError)
        raise _FieldError(f"{where}.dtype", f'must be a dtype name such as "f32" or "bfloat16", got {dtype!r}')
    dtype = DTYPES.get(dtype, dtype)
    if dtype not in DTYPE_NAMES:
        raise _FieldError(where, f"unknown dtype {dtype!r} (e.g. f32, bf16, float16, int64)")
    stride, acc = [], 1
    for d in reversed(dims):
        stride.append(acc)
        acc *= max(d, 1)
    return {
        "t": "tensor",
        "shape": dims,
        "dtype": dtype,
        "device": None,
        "requires_grad": grad,
        "stride": list(reversed(stride)),
    }
