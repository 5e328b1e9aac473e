"""Record the input signatures a compiled model really sees, for `cachemgr prewarm` to replay.

One line in the workload:

    model = cachemgr.record.compile(model, name="ranker", dynamic=None)   # torch.compile kwargs

or, for a function:

    @cachemgr.record.compile(name="score", fullgraph=True)
    def score(x, y): ...

Every call computes a cheap signature tuple (shape, dtype, device, requires_grad and stride of
each tensor, nested containers walked, plain scalars by value, grad mode) and looks it up in a
set. Only a signature not seen before in this process costs more: it is described as JSON and
appended as one line to a spool file (settings.spool_dir, env CACHEMGR_SPOOL_DIR) that the daemon
and `cachemgr scan` ingest into the index (cachemgr.prewarm.spool). The hot path never touches
the database, and recording never breaks the workload: a spool that cannot be written is a
warning, once.

torch is imported lazily: importing this module costs nothing in a process without torch.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import math
import os
import socket
import stat
import threading
import time
import uuid
import warnings
from typing import Any

from cachemgr.errors import CachemgrError

SPOOL_VERSION = 1
SPOOL_SUFFIX = ".jsonl"
MAX_LINE = 64 * 1024  # cachemgr.prewarm.spool.MAX_LINE: a longer line is never ingested
MAX_SEEN = 10_000  # distinct signatures one recorder keeps (and spools); more is a scalar that changes each call

_Tensor: Any = None  # torch.Tensor, bound on first compile()


def spool_dir() -> str:
    """The spool directory the recorder appends to: $CACHEMGR_SPOOL_DIR, else the settings'."""
    env = os.environ.get("CACHEMGR_SPOOL_DIR")
    if env:
        return os.path.abspath(env)
    from cachemgr import config

    return config.load().spool_dir


# -- signatures --------------------------------------------------------------------------------


def _key(obj: Any) -> Any:
    """The per-call signature of one argument: cheap, hashable, exact enough to tell compiles apart."""
    if isinstance(obj, _Tensor):
        return (obj.shape, obj.dtype, obj.device, obj.requires_grad, obj.stride())
    t = type(obj)
    if t is int or t is bool or t is str or obj is None:
        return (t, obj)  # dynamo specializes on (most) Python scalars: part of the signature
    if t is float:
        return (t, obj) if obj == obj else _NAN  # a NaN equals no NaN: it would never be seen again
    if t is tuple or t is list:
        return (t, *[_key(o) for o in obj])
    if t is dict:
        return (t, *[(k, _key(v)) for k, v in obj.items()])
    return t  # other objects: their type is all we can replay (and usually all dynamo guards)


_NAN = (float, "nan")


def call_key(args: tuple, kwargs: dict, grad: bool) -> tuple:
    if kwargs:
        return (grad, *[_key(a) for a in args], *[(k, _key(v)) for k, v in kwargs.items()])
    return (grad, *[_key(a) for a in args])


def _spec(obj: Any) -> Any:
    """A JSON description of one argument that prewarm can rebuild (see prewarm.worker)."""
    if isinstance(obj, _Tensor):
        return {
            "t": "tensor",
            "shape": list(obj.shape),
            "dtype": str(obj.dtype).removeprefix("torch."),
            "device": str(obj.device),
            "requires_grad": bool(obj.requires_grad),
            "stride": list(obj.stride()),
        }
    if obj is None:
        return {"t": "none"}
    t = type(obj)
    if t is float and not math.isfinite(obj):
        return {"t": "float", "v": str(obj)}  # 'nan', 'inf', '-inf': JSON has no such numbers
    if t in (bool, int, float, str):
        return {"t": t.__name__, "v": obj}
    if t in (tuple, list):
        return {"t": t.__name__, "items": [_spec(o) for o in obj]}
    if t is dict:
        # JSON keys are text, and prewarm rebuilds a dict with them: another key (0, or 0 and '0')
        # would be replayed as a different dict
        for k in obj:
            if type(k) is not str:
                raise ValueError(f"a dict with a key that is not a string ({k!r:.40}): prewarm could not replay it")
        return {"t": "dict", "items": {k: _spec(v) for k, v in obj.items()}}
    return {"t": "object", "type": f"{t.__module__}.{t.__qualname__}"}


def input_spec(args: tuple, kwargs: dict, grad: bool) -> dict:
    return {"args": [_spec(a) for a in args], "kwargs": {k: _spec(v) for k, v in kwargs.items()}, "grad": grad}


def signature_text(spec: dict) -> str:
    """A short human line for one input spec: `(f32[8,32], i64[8]) grad` ."""

    def one(s: dict) -> str:
        t = s["t"]
        if t == "tensor":
            dims = ",".join(str(d) for d in s["shape"])
            rg = "*" if s.get("requires_grad") else ""
            dev = "" if s.get("device") in ("cpu", None) else "@" + s["device"]
            return f"{_DTYPE_SHORT.get(s['dtype'], s['dtype'])}[{dims}]{rg}{dev}"
        if t in ("tuple", "list"):
            inner = ", ".join(one(i) for i in s["items"])
            return f"({inner})" if t == "tuple" else f"[{inner}]"
        if t == "dict":
            return "{" + ", ".join(f"{k}: {one(v)}" for k, v in s["items"].items()) + "}"
        if t == "none":
            return "None"
        if t == "object":
            return s["type"]
        if t == "float" and isinstance(s["v"], str):
            return s["v"]
        return repr(s["v"])

    parts = [one(a) for a in spec["args"]] + [f"{k}={one(v)}" for k, v in spec["kwargs"].items()]
    return "(" + ", ".join(parts) + ")" + ("" if spec.get("grad", True) else " no_grad")


_DTYPE_SHORT = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int64": "i64",
    "int32": "i32",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
}


def signature_hash(spec: dict, options: dict) -> str:
    """16 hex chars over the canonical JSON of the inputs and the compile options."""
    doc = json.dumps({"spec": spec, "options": options}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


def jsonable_options(kwargs: dict) -> dict:
    """torch.compile kwargs as JSON; what cannot be (a callable backend) becomes its name."""

    def conv(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        return f"<{getattr(v, '__module__', '?')}.{getattr(v, '__qualname__', type(v).__name__)}>"

    return {k: conv(v) for k, v in sorted(kwargs.items())}


# -- the spool writer --------------------------------------------------------------------------


class Spool:
    """Appends JSON lines to this process's own file in the spool directory.

    Each append opens, locks (flock), checks the path still names the file it opened (the
    ingester renames files away), writes one line and closes: new signatures are rare, so
    this costs nothing that matters, and a line is never written into a file already taken.
    Only a regular file of one link is written: a symlink, FIFO or hard link planted at the
    name (the spool is every workload's) is left alone, and the line goes to a new name.
    """

    def __init__(self, directory: str | None = None) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._warned = False
        self.name = self._fresh_name()

    @staticmethod
    def _fresh_name() -> str:
        return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{SPOOL_SUFFIX}"

    @property
    def directory(self) -> str:
        if self._directory is None:
            self._directory = spool_dir()
        return self._directory

    def append_checked(self, doc: dict) -> bool:
        """Append `doc` if the ingester will take it; else ValueError saying why (the recorder
        turns it into a warning): too large, nested too deep, or text no index can hold. False:
        it could not be written (warned once)."""
        from cachemgr.prewarm.spool import LineError, parse_line

        line = (json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            parse_line(line)
        except LineError as e:
            raise ValueError(f"the ingester would refuse this signature: {e}") from None
        if len(line) > MAX_LINE:
            raise ValueError(
                f"the signature is {len(line)} bytes, over the {MAX_LINE // 1024} KiB a spool line may hold"
            )
        return self.append(doc, line)

    def append(self, doc: dict, line: bytes | None = None) -> bool:
        """Append one line; False (warned once) if it cannot be written."""
        if line is None:
            line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                self._write(line)
            return True
        except (OSError, CachemgrError) as e:  # (a bad config file names no spool: the model runs on)
            if not self._warned:
                self._warned = True
                where = self._directory or "of the settings"
                warnings.warn(f"cachemgr.record: cannot write the spool {where}: {e}", stacklevel=3)
            return False

    def _write(self, line: bytes) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for _ in range(10):
            path = os.path.join(self.directory, self.name)
            try:
                # never through a link, never blocked by a FIFO: every workload can plant one here
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as e:
                if e.errno not in _PLANTED:
                    raise
                self.name = self._fresh_name()  # left where it is: a file of our own, under a new name
                continue
            try:
                if not _own_file(fd):
                    self.name = self._fresh_name()
                    continue
                if not _locked(fd):
                    # An ingester took the file and holds it for its whole ingest (index writes):
                    # never wait for that in the model's forward pass, open the new one. Still
                    # named, it is a forked child's line (the same name), or anyone's lock (the
                    # file is world-readable): never waited on either, a new file of our own.
                    if _still_named(path, fd):
                        self.name = self._fresh_name()
                    continue
                if _still_named(path, fd):
                    _write_whole(fd, line)
                    return
            finally:
                os.close(fd)
        raise OSError(f"spool file {path} keeps being taken away")


def _locked(fd: int) -> bool:
    """Take the file's lock, trying a few times over a millisecond or two (a forked child's line
    holds it for microseconds); False if someone holds it longer: never waited for."""
    import fcntl

    for attempt in range(LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < LOCK_TRIES:
                time.sleep(0.0002)
    return False


LOCK_TRIES = 8

# what opening our name finds where something else was planted: a symlink, a FIFO no one reads, a directory
_PLANTED = (errno.ELOOP, errno.ENXIO, errno.EISDIR)


def _own_file(fd: int) -> bool:
    """Whether `fd` is a file only the spool names: regular (a FIFO someone reads opens), one link
    (another name for it may be anyone's file, outside the spool)."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and st.st_nlink < 2  # (0: an ingester unlinked it since our open)


def _still_named(path: str, fd: int) -> bool:
    """Whether `path` itself (not what a link there points to) is still the file `fd` opened: an
    ingester renames files away, and anyone may put something else in their place."""
    try:
        named, opened = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _write_whole(fd: int, line: bytes) -> None:
    """Append the whole line or nothing (the caller holds the file's lock): a short write on a
    nearly full disk is cut back off, so the next line, written once there is room, does not
    join a torn one and both are lost to the ingester."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        written = os.write(fd, line)
    except OSError:
        os.ftruncate(fd, start)  # (a failed write may have left part of the line)
        raise
    if written != len(line):
        os.ftruncate(fd, start)
        raise OSError(errno.ENOSPC, "no room for a whole line")


_SPOOL: Spool | None = None


def _default_spool() -> Spool:
    global _SPOOL
    if _SPOOL is None:
        _SPOOL = Spool()
    return _SPOOL


# -- the recorder ------------------------------------------------------------------------------


class Recorder:
    """The state behind one recorded model: the seen set and what a new signature writes."""

    def __init__(self, name: str, kind: str, options: dict, spool: Spool | None = None) -> None:
        import torch

        self.name, self.kind, self.options = name, kind, jsonable_options(options)
        self.seen: set[int] = set()  # hashes of call_key
        self.spool = spool or _default_spool()
        self._grad = torch.is_grad_enabled
        self._lock = threading.Lock()
        self._warned_full = False

    def observe(self, args: tuple, kwargs: dict) -> None:
        """The per-call hook. Never raises into the workload."""
        try:
            grad = self._grad()
            # kept by its hash alone: a key copies the call's lists and holds its strings (20,000
            # token ids a call kept 1.4 MB a signature alive); two signatures of one hash in 10,000
            # (MAX_SEEN) come about once in 10^11 processes, and cost that signature's line
            k = hash(call_key(args, kwargs, grad))
            if k in self.seen:
                return
            with self._lock:
                if k in self.seen or self._full():
                    return
                self.seen.add(k)
            if not self._new(args, kwargs, grad):
                self.seen.discard(k)  # not written (a full disk): a later call with it tries again
        except Exception as e:  # noqa: BLE001 - recording must never break the model
            warnings.warn(f"cachemgr.record({self.name}): not recorded: {type(e).__name__}: {e}", stacklevel=3)

    def _full(self) -> bool:
        """Whether the seen set holds MAX_SEEN signatures (warned once): memory and the spool stay
        bounded when a call's signature is new each time (a step counter, a timestamp)."""
        if len(self.seen) < MAX_SEEN:
            return False
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(
                f"cachemgr.record({self.name}): {MAX_SEEN} distinct input signatures seen; no more are recorded",
                stacklevel=4,
            )
        return True

    def _new(self, args: tuple, kwargs: dict, grad: bool) -> bool:
        spec = input_spec(args, kwargs, grad)
        return self.spool.append_checked(
            {
                "v": SPOOL_VERSION,
                "model": self.name,
                "kind": self.kind,
                "ts": time.time(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "signature_hash": signature_hash(spec, self.options),
                "signature": signature_text(spec),
                "spec": spec,
                "options": self.options,
            }
        )


def compile(model: Any = None, *, name: str, spool: Spool | None = None, **torch_compile_kwargs: Any) -> Any:
    """`torch.compile(model, **kwargs)` that also records each new input signature under `name`.

    For an nn.Module it returns the compiled module itself (an OptimizedModule whose class is a
    recording subclass, so attributes, state_dict and isinstance all work); for a function, a
    wrapper. Without `model` it is a decorator: `@compile(name="f", dynamic=True)`.
    """
    if model is None:
        return lambda fn: compile(fn, name=name, spool=spool, **torch_compile_kwargs)
    if not name or not isinstance(name, str):
        raise ValueError("cachemgr.record.compile needs name='model name'")
    import torch

    global _Tensor
    _Tensor = torch.Tensor
    compiled = torch.compile(model, **torch_compile_kwargs)
    if isinstance(model, torch.nn.Module):
        rec = Recorder(name, "module", torch_compile_kwargs, spool)
        # In the compiled module's own __dict__: OptimizedModule's __setattr__ would put it on the
        # original module, and every call would then find it through its __getattr__ (Python, a
        # few µs), after a failed lookup.
        object.__setattr__(compiled, "_cachemgr_recorder", rec)
        compiled.__class__ = _recorded_class(type(compiled))
        return compiled
    rec = Recorder(name, "function", torch_compile_kwargs, spool)
    observe = rec.observe

    @functools.wraps(model)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        observe(args, kwargs)
        return compiled(*args, **kwargs)

    vars(recorded)["_cachemgr_recorder"] = rec
    return recorded


_CLASSES: dict[type, type] = {}


def _recorded_class(base: type) -> type:
    """A subclass of the OptimizedModule class whose __call__ records first. Cheaper than a
    forward pre-hook (which sends nn.Module down its slow path) and it runs outside dynamo."""
    cls = _CLASSES.get(base)
    if cls is None:

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self._cachemgr_recorder.observe(args, kwargs)
            return base.__call__(self, *args, **kwargs)

        cls = type(f"Recorded{base.__name__}", (base,), {"__call__": __call__, "__module__": __name__})
        globals()[cls.__name__] = cls  # picklable by name
        _CLASSES[base] = cls
    return cls
