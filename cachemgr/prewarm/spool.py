"""Ingest the recorder's spool files into the `shapes` table. No torch here.

Protocol (crash-safe, idempotent):

1. take a file: rename `X.jsonl` -> `X.jsonl.ingesting` (atomic: one ingester wins; the
   recorder checks the inode under its lock, so it never writes into a taken file);
2. lock it (flock; a writer that held the lock before the rename finishes its line first);
3. upsert every line into `shapes` (model, signature_hash) in one transaction, commit;
4. unlink it.

A crash before 3 commits leaves `.ingesting`; the next run processes it first. A crash between 3
and 4 would count the same lines twice, so a left-over file only adds to `count` for lines newer
than the row's `last_seen`: the rows are exact, counts never double. Lines that are not valid JSON
(a torn write), or whose fields are not what the recorder writes, are skipped and reported,
never fatal: one bad line never stops a scan.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # SQLAlchemy is imported where rows are written: a scan with an empty spool needs none of it
    from cachemgr.index.db import Database

SPOOL_SUFFIX = ".jsonl"  # cachemgr.record.SPOOL_SUFFIX (not imported: record is the workload's module)
TAKEN = ".ingesting"
REQUIRED = ("model", "signature_hash", "spec")


@dataclass(frozen=True)
class IngestResult:
    files: int = 0
    lines: int = 0
    new_shapes: int = 0
    updated_shapes: int = 0
    bad_lines: list[str] = field(default_factory=list)  # "file:line: reason"
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"files": self.files, "lines": self.lines, "new_shapes": self.new_shapes,
                "updated_shapes": self.updated_shapes, "bad_lines": self.bad_lines, "seconds": round(self.seconds, 3)}


def ingest(db: Database, spool_dir: str) -> IngestResult:
    """Move every spool file's lines into the index. Safe to call concurrently and after a crash."""
    t0 = time.monotonic()
    leftovers, fresh = _spooled(spool_dir)
    totals = {"files": 0, "lines": 0, "new": 0, "updated": 0}
    bad: list[str] = []
    for name, recovering in [(n, True) for n in leftovers] + [(n, False) for n in fresh]:
        path = os.path.join(spool_dir, name)
        if not recovering:
            taken = path + TAKEN
            try:
                os.rename(path, taken)
            except FileNotFoundError:  # another ingester took it
                continue
            path = taken
        done = _ingest_file(db, path, recovering, bad)
        if done is None:
            continue
        totals["files"] += 1
        totals["lines"] += done[0]
        totals["new"] += done[1]
        totals["updated"] += done[2]
    return IngestResult(totals["files"], totals["lines"], totals["new"], totals["updated"], bad,
                        time.monotonic() - t0)


def waiting(spool_dir: str) -> bool:
    """Whether the spool holds anything to ingest."""
    return any(_spooled(spool_dir))


def _spooled(spool_dir: str) -> tuple[list[str], list[str]]:
    """(files a crashed ingest left taken, fresh files), by name."""
    try:
        names = sorted(os.listdir(spool_dir))
    except OSError:  # none yet, or not a directory we can read: nothing to ingest
        return [], []
    leftovers = [n for n in names if n.endswith(SPOOL_SUFFIX + TAKEN)]
    return leftovers, [n for n in names if n.endswith(SPOOL_SUFFIX) and not n.startswith(".")]


def _ingest_file(db: Database, path: str, recovering: bool, bad: list[str]) -> tuple[int, int, int] | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            # A left-over file may be another ingester's live one: skip it if locked.
            fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if recovering else 0))
        except BlockingIOError:
            return None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read()
        except OSError as e:  # a directory or an unreadable file with a spool name: set aside
            bad.append(f"{os.path.basename(path)}: cannot read it ({e.strerror}); renamed to .bad")
            os.rename(path, path + ".bad")
            return None
        lines = _parse_lines(os.path.basename(path), raw, bad)
        new, updated = _upsert(db, lines, recovering)
        os.unlink(path)  # while holding the lock: nobody else processes it again
        return len(lines), new, updated
    finally:
        os.close(fd)


def _parse_lines(name: str, raw: bytes, bad: list[str]) -> list[dict]:
    out = []
    for i, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            bad.append(f"{name}:{i}: not JSON (torn write?)")
            continue
        missing = [k for k in REQUIRED if not isinstance(doc, dict) or k not in doc]
        problem = f"missing {', '.join(missing)}" if missing else _line_problem(doc)
        if problem:
            bad.append(f"{name}:{i}: {problem}")
            continue
        out.append(doc)
    return out


_SCALARS = {"bool": bool, "int": int, "float": (int, float), "str": str}


def _line_problem(doc: dict) -> str | None:
    """What is wrong with a recorded line (as cachemgr.record writes them), or None."""
    for k in ("model", "signature_hash"):
        if not isinstance(doc[k], str) or not doc[k]:
            return f"{k} is not a non-empty string"
    for k, types in (("ts", (int, float)), ("signature", str), ("host", str), ("options", dict)):
        if doc.get(k) is not None and (not isinstance(doc[k], types) or isinstance(doc[k], bool)):
            return f"{k} has the wrong type"
    spec = doc["spec"]
    if not isinstance(spec, dict) or not isinstance(spec.get("args", []), list) \
            or not isinstance(spec.get("kwargs", {}), dict):
        return "spec is not {args: [...], kwargs: {...}}"
    for a in [*spec.get("args", []), *spec.get("kwargs", {}).values()]:
        if (p := _arg_problem(a)) is not None:
            return f"spec: {p}"
    return None


def _arg_problem(a: object) -> str | None:
    t = a.get("t") if isinstance(a, dict) else None
    if t == "tensor":
        ok = (isinstance(a.get("shape"), list) and all(isinstance(n, int) for n in a["shape"])
              and isinstance(a.get("dtype"), str) and isinstance(a.get("device", ""), str)
              and all(isinstance(n, int) for n in a.get("stride") or []))
        return None if ok else "a tensor without an integer shape, a dtype and a device"
    if t in _SCALARS:
        return None if isinstance(a.get("v"), _SCALARS[t]) else f"a {t} without its value"
    if t in ("tuple", "list"):
        items = a.get("items")
        return next((p for x in items if (p := _arg_problem(x))), None) if isinstance(items, list) \
            else f"a {t} without items"
    if t == "dict":
        items = a.get("items")
        return next((p for x in items.values() if (p := _arg_problem(x))), None) if isinstance(items, dict) \
            else "a dict without items"
    if t in ("none", "object"):
        return None
    return f"unknown argument {str(a)[:40]}"


def _upsert(db: Database, lines: list[dict], recovering: bool) -> tuple[int, int]:
    from sqlalchemy import select

    from cachemgr.index.models import Shape

    if not lines:
        return 0, 0
    new = updated = 0
    with db.session() as s:
        keys = {(d["model"], d["signature_hash"]) for d in lines}
        rows = {(r.model, r.signature_hash): r for r in s.scalars(
            select(Shape).where(Shape.model.in_({m for m, _ in keys}),
                                Shape.signature_hash.in_({h for _, h in keys})))}
        for d in lines:
            k = (d["model"], d["signature_hash"])
            ts = float(d.get("ts") or time.time())
            row = rows.get(k)
            if row is None:
                row = Shape(model=d["model"], signature_hash=d["signature_hash"],
                            signature=str(d.get("signature") or ""), spec=json.dumps(d["spec"], sort_keys=True),
                            options=json.dumps(d.get("options") or {}, sort_keys=True), host=d.get("host"),
                            count=1, first_seen=ts, last_seen=ts)
                s.add(row)
                rows[k] = row
                new += 1
                continue
            if recovering and ts <= row.last_seen:
                continue  # already counted before the crash that left this file behind
            row.count += 1
            row.first_seen = min(row.first_seen, ts)
            row.last_seen = max(row.last_seen, ts)
            updated += 1
    return new, updated


def list_shapes(db: Database, model: str | None = None) -> list[dict]:
    """Recorded shapes, per model in first-seen order (the order prewarm replays them in)."""
    from sqlalchemy import select

    from cachemgr.index.models import Shape

    with db.session() as s:
        q = select(Shape).order_by(Shape.model, Shape.first_seen, Shape.id)
        if model is not None:
            q = q.where(Shape.model == model)
        rows = list(s.scalars(q))
    out = [{"model": r.model, "signature_hash": r.signature_hash, "signature": r.signature,
            "spec": json.loads(r.spec), "options": json.loads(r.options), "host": r.host, "count": r.count,
            "first_seen": r.first_seen, "last_seen": r.last_seen} for r in rows]
    varied = varied_dims(out)
    for d in out:
        d["varied"] = varied.get(d["model"], [])
    return out


def varied_dims(shapes: list[dict]) -> dict[str, list[str]]:
    """Per model, which tensor dims took more than one value across its signatures: `args[0].0`."""
    seen: dict[str, dict[str, set]] = {}
    for d in shapes:
        per = seen.setdefault(d["model"], {})
        for path, shape in _tensor_shapes(d["spec"]):
            for i, n in enumerate(shape):
                per.setdefault(f"{path}.{i}", set()).add(n)
    return {m: sorted(p for p, vals in per.items() if len(vals) > 1)
            for m, per in seen.items()}


def _tensor_shapes(spec: dict):
    def walk(s: dict, path: str):
        t = s.get("t")
        if t == "tensor":
            yield path, s["shape"]
        elif t in ("tuple", "list"):
            for i, x in enumerate(s["items"]):
                yield from walk(x, f"{path}[{i}]")
        elif t == "dict":
            for k, x in s["items"].items():
                yield from walk(x, f"{path}[{k!r}]")

    for i, a in enumerate(spec.get("args", [])):
        yield from walk(a, f"args[{i}]")
    for k, a in spec.get("kwargs", {}).items():
        yield from walk(a, k)
