"""A pickle reader that executes nothing and stays within stated bounds.

`find_class` hands back an inert stand-in class for *every* global: no constructor, no
`__reduce__` callable, no `__setstate__` of a real class ever runs, so a hostile file can do
nothing but describe itself. Object state comes back as plain dicts, lists and strings.

Bounds, per load (the rest are kept by the parse worker process, cachemgr.parse.pool):
- at most MAX_CLASSES distinct class names (stand-in classes, shared by the loads of a process);
- values taken out of the state are checked for type, size and range (`text`, `seconds`, ...):
  an out-of-range number, a non-list where a list belongs, a lone surrogate or a NUL in a
  string never reaches the index.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from typing import Any, cast

MAX_CLASSES = 2048  # distinct globals in one entry (a CompiledFxGraph names about 40)
MAX_TEXT = 1 << 20  # characters kept of one string value (the graph code can be long)
_SURROGATE = re.compile("[\ud800-\udfff]")


class Stub(BaseException):  # noqa: N818 - never raised: BaseException for its C constructor (below)
    """Stand-in for any class a pickle names. Keeps constructor args and state as plain data.

    The args are kept however the pickle builds the object: REDUCE calls the class
    (`cls(*args)`), NEWOBJ and NEWOBJ_EX call `cls.__new__(cls, *args, **kwargs)` without
    `__init__` (how a str or tuple subclass pickles, e.g. torch's TorchVersion). BaseException's
    own constructor, in C, keeps them as `args` (a Python `__new__` cost a tenth of a graph
    entry's unpickling); keyword args (NEWOBJ_EX only) are dropped: no reader needs them. The
    args are the objects the pickle already built, kept by reference: nothing is copied or grown.
    """

    pickled_module = ""  # the global the pickle named (set on each stand-in class)
    pickled_name = ""
    args: tuple  # (BaseException's: no class attribute may shadow it)
    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:  # (BaseException's would print the args, recursively and whole)
        return f"<stand-in {self.pickled_module[:100]}.{self.pickled_name[:100]}>"

    __str__ = __repr__

    # pickle's BUILD and APPENDS may also call these on odd objects: accept quietly.
    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


# Stand-ins are shared by every load of a process: making a class costs more than the rest of
# unpickling a graph entry (33 classes: 300 of 600 us). Inert and never changed by a load (BUILD on
# a class calls the unbound __setstate__, a TypeError), so a hostile entry cannot reach another's.
# Bounded: short names only, and at most MAX_SHARED of them (then the set starts again).
_SHARED: dict[tuple[str, str], type[Stub]] = {}
MAX_SHARED = 4096
MAX_SHARED_NAME = 256


def _stand_in(module: str, name: str) -> type[Stub]:
    cls = type(str(name)[:200], (Stub,), {"pickled_module": module, "pickled_name": name})
    if len(module) + len(name) <= MAX_SHARED_NAME:
        if len(_SHARED) >= MAX_SHARED:  # (entries that name thousands of made-up classes: the next real one is kept)
            _SHARED.clear()
        _SHARED[(module, name)] = cls
    return cast(type[Stub], cls)


class SafeUnpickler(pickle.Unpickler):
    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.stubs: dict[tuple[str, str], type[Stub]] = {}

    def find_class(self, module: str, name: str) -> type[Stub]:
        key = (module, name)
        cls = self.stubs.get(key)
        if cls is None:
            if len(self.stubs) >= MAX_CLASSES:
                raise pickle.UnpicklingError(f"names more than {MAX_CLASSES} classes")
            cls = self.stubs[key] = _SHARED.get(key) or _stand_in(module, name)
        return cls

    def persistent_load(self, pid: Any) -> None:
        return None


def safe_load(data: bytes) -> Any:
    return SafeUnpickler(io.BytesIO(data)).load()


def state_of(obj: Any) -> dict[str, Any]:
    """The attribute dict of a stand-in object (dataclass pickles carry (dict, slots) at times)."""
    st = obj.state if isinstance(obj, Stub) else obj
    if isinstance(st, tuple):
        merged: dict[str, Any] = {}
        for part in st:
            if isinstance(part, dict):
                merged.update(part)
        return merged
    return st if isinstance(st, dict) else {}


def class_name(obj: Any) -> str:
    return text(type(obj).pickled_name, 200) or "?" if isinstance(obj, Stub) else type(obj).__name__


# -- values out of hostile state: checked, bounded, fit for any database ---------------------------


def clean(s: str, limit: int = MAX_TEXT) -> str:
    """`s` cut to `limit` characters, with NULs dropped and lone surrogates replaced: storable as
    UTF-8 text in SQLite and PostgreSQL alike."""
    s = s[:limit]
    if "\0" in s:
        s = s.replace("\0", "")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = _SURROGATE.sub("\ufffd", s)
    return s


def text(v: Any, limit: int = MAX_TEXT) -> str | None:
    """A non-empty string value, cleaned; anything else is None."""
    return clean(v, limit) or None if isinstance(v, str) and v else None


def seconds(ns: Any) -> float | None:
    """Nanoseconds as seconds, when they are a plausible duration (finite, 0 to about 30 years)."""
    if isinstance(ns, bool) or not isinstance(ns, (int, float)):
        return None
    if isinstance(ns, int) and not 0 <= ns < 10**18:
        return None
    s = float(ns) / 1e9
    return s if math.isfinite(s) and 0 <= s < 1e9 else None


def items(v: Any) -> list:
    """A list or tuple's items; anything else is no items."""
    return list(v) if isinstance(v, (list, tuple)) else []
