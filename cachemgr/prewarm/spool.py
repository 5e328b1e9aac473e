"""Ingest the recorder's spool files into the `shapes` table. No torch here.

Protocol (crash-safe, idempotent):

1. take a file: rename `X.jsonl` -> `X.jsonl.ingesting` (atomic: one ingester wins; the
   recorder checks the inode under its lock, so it never writes into a taken file);
2. lock it (flock; a writer that held the lock before the rename finishes its line first). One
   ingest waits at most LOCK_WAIT for all its files together: a file still locked is named and
   left `.ingesting` for a later ingest;
3. upsert its lines (those in the bytes it held once locked) into `shapes` (model, signature_hash),
   BATCH lines per transaction;
4. unlink it.

A crash before 4 leaves `.ingesting`; the next run processes it first. Lines committed before the
crash would count twice, so a left-over file only adds to `count` for lines newer than the row's
`last_seen`: the rows are exact, counts never double.

Every input is hostile (the spool directory is writable by every workload): a line that is not
UTF-8, not JSON, longer than MAX_LINE, nested deeper than MAX_DEPTH, holding more than MAX_VALUES
JSON values, or whose fields are not what the recorder writes (wrong types, a time that is no time,
text with NUL, control characters or lone surrogates, which neither a terminal nor PostgreSQL
takes, a spec prewarm could not replay), or whose row `list_shapes` would not read back (one check,
`_decoded`, on both sides), is skipped and reported with its reason, never fatal. Only regular
files are opened (no symlink is followed, a FIFO never blocks, no hard link is read); a file that
cannot be read, is over MAX_FILE, or holds over MAX_JUNK lines the recorder never writes (read up
to there) is set aside as `.bad-*` with its reason. Files are read line by line, and a batch
holds only the texts it stores (at most BATCH lines and BATCH_BYTES), never the parsed lines, so
memory stays bounded whatever their size. A taken file always ends unlinked or set aside: nothing
stays `.ingesting` for ever. Only the database failing as a whole (DatabaseError) stops an ingest,
and leaves the file for the next run.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import math
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # SQLAlchemy is imported where rows are written: a scan with an empty spool needs none of it
    from cachemgr.index.db import Database

SPOOL_SUFFIX = ".jsonl"  # cachemgr.record.SPOOL_SUFFIX (not imported: record is the workload's module)
TAKEN = ".ingesting"
SET_ASIDE = ".bad"
REQUIRED = ("model", "signature_hash", "spec")

MAX_LINE = 64 * 1024  # bytes in one line; the recorder writes a few hundred (cachemgr.record checks too)
MAX_DEPTH = 32  # JSON nesting of one line; a recorded spec is a few levels deep
MAX_VALUES = 16384  # JSON values (containers, items, keys' values) in one line: a real one has ~1 per 8 bytes
MAX_FILE = 256 * 1024 * 1024  # a bigger spool file is set aside unread
MAX_REPORTED = 20  # bad lines named per file; the rest are counted in one more line
# Lines the recorder never writes (bad or blank) in one file past which it is no recorder's: the
# rest is set aside unread (16 MiB of `{}` lines took 29 s to read and report, line by line)
MAX_JUNK = 1000
BATCH = 1000  # lines per transaction
BATCH_BYTES = 4 * 1024 * 1024  # and at most this much text to store per transaction
MAX_NAME = 255  # model and host: String(255) in the index
MAX_HASH = 16  # signature_hash: String(16)
MAX_TEXT = 4096  # any other string in a line
MAX_DIM = 1 << 62  # a tensor dimension or stride
LOCK_WAIT = 1.0  # seconds, in all, one ingest waits for recorders to finish their lines in files it took
FUTURE = 86400.0  # a line's time may be this far ahead of ours (clocks differ), no more

_BAD_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
# a string, or one never closed up to the end of the line (possessive: each character looked at
# once; an unclosed string backtracked to every quote in it, quadratic in the line)
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.S)
_BRACKETS = re.compile(r"[\[\]{}]")
_DTYPE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class LineError(ValueError):
    """What is wrong with one line (or one stored row): the reason reported."""


@dataclass(frozen=True)
class IngestResult:
    files: int = 0
    lines: int = 0
    new_shapes: int = 0
    updated_shapes: int = 0
    bad_lines: list[str] = field(default_factory=list)  # "file:line: reason" (and "file: reason")
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "lines": self.lines,
            "new_shapes": self.new_shapes,
            "updated_shapes": self.updated_shapes,
            "bad_lines": self.bad_lines,
            "seconds": round(self.seconds, 3),
        }


def ingest(db: Database, spool_dir: str) -> IngestResult:
    """Move every spool file's lines into the index. Safe to call concurrently and after a crash.
    Raises only DatabaseError (the index as a whole failing); everything else is reported."""
    t0 = time.monotonic()
    leftovers, fresh = _spooled(spool_dir)
    # one budget for the whole ingest: a recorder's line takes microseconds, and a file whose lock
    # is held longer (anyone can hold any number) must not stall the ingest for each of them
    lock_by = time.monotonic() + LOCK_WAIT
    totals = {"files": 0, "lines": 0, "new": 0, "updated": 0}
    bad: list[str] = []
    for name, recovering in [(n, True) for n in leftovers] + [(n, False) for n in fresh]:
        path = os.path.join(spool_dir, name)
        if not recovering:
            # shortened, a name keeps `.jsonl.ingesting`: a later ingest must find it if this one leaves it
            taken = os.path.join(spool_dir, _fitting(name.removesuffix(SPOOL_SUFFIX), SPOOL_SUFFIX + TAKEN))
            try:
                os.rename(path, taken)
            except FileNotFoundError:  # another ingester took it
                continue
            except OSError as e:  # a read-only spool directory, ...: not ours to take
                bad.append(f"{shown(name)}: cannot take it ({e.strerror}); left as it is")
                continue
            path = taken
        wait = 0.0 if recovering else max(0.0, lock_by - time.monotonic())
        done = _ingest_file(db, path, recovering, wait, bad)
        if done is None:
            continue
        totals["files"] += 1
        totals["lines"] += done[0]
        totals["new"] += done[1]
        totals["updated"] += done[2]
    return IngestResult(totals["files"], totals["lines"], totals["new"], totals["updated"], bad, time.monotonic() - t0)


def waiting(spool_dir: str) -> bool:
    """Whether the spool holds anything to ingest."""
    return any(_spooled(spool_dir))


def _spooled(spool_dir: str) -> tuple[list[str], list[str]]:
    """(files a crashed ingest left taken, fresh files), by name."""
    try:
        names = sorted(os.listdir(spool_dir))
    except (OSError, ValueError):  # none yet, or not a directory we can read: nothing to ingest
        return [], []
    leftovers = [n for n in names if n.endswith(TAKEN)]  # (an earlier version shortened a long name without `.jsonl`)
    return leftovers, [n for n in names if n.endswith(SPOOL_SUFFIX) and not n.startswith(".")]


def shown(name: str) -> str:
    """A file name fit for a terminal or a log line: what is not printable is escaped."""
    name = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in name)


_NAME_MAX = 255  # bytes in a file name
_shortened = itertools.count()


def _fitting(name: str, suffix: str) -> str:
    """`name + suffix`, or where that is longer than a file name may be, the start of `name` made
    this process's own and then `suffix`: a name with no room for the suffix was never taken, and
    reported again by every ingest."""
    if len(os.fsencode(name + suffix)) <= _NAME_MAX:
        return name + suffix
    own = f"-{os.getpid()}-{next(_shortened)}"
    room = _NAME_MAX - len(os.fsencode(own + suffix))
    return os.fsdecode(os.fsencode(name)[:room]) + own + suffix


def _set_aside(path: str, reason: str, bad: list[str]) -> None:
    """Rename a file (or anything) that cannot be ingested out of the spool's way, saying why."""
    folder, name = os.path.split(path)
    aside = os.path.join(folder, _fitting(name, f"{SET_ASIDE}-{int(time.time())}-{os.getpid()}"))
    try:
        os.rename(path, aside)
        bad.append(f"{shown(os.path.basename(path))}: {reason}; renamed to {shown(os.path.basename(aside))}")
    except FileNotFoundError:
        pass
    except OSError as e:
        bad.append(f"{shown(os.path.basename(path))}: {reason}; cannot rename it either ({e.strerror})")


def _lock(fd: int, wait: float) -> bool:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        except OSError:  # a file system without flock: the rename already made it ours
            return True


def _ingest_file(db: Database, path: str, recovering: bool, wait: float, bad: list[str]) -> tuple[int, int, int] | None:
    name = os.path.basename(path)
    try:
        # never follow a link, never block on a FIFO
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        _set_aside(
            path,
            "a symbolic link (never followed)" if e.errno == errno.ELOOP else f"cannot open it ({e.strerror})",
            bad,
        )
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _set_aside(path, "not a regular file", bad)
            return None
        if st.st_nlink > 1:  # (a recorder's file has one name; another may be anyone's file, outside)
            _set_aside(path, "another name of a file (a hard link): never read", bad)
            return None
        # A left-over file may be another ingest's live one: skip it if locked (and say so: a lock
        # anyone may hold). A file we just took may still have a recorder finishing its line: wait
        # for it, what is left of the budget.
        if not _lock(fd, wait):
            bad.append(f"{shown(name)}: locked by another process; left for a later ingest")
            return None
        # its size once locked: no recorder writes to it any more, and what a writer that ignores
        # the lock adds while it is read is not read (a file that keeps growing would never end)
        size = os.fstat(fd).st_size
        if size > MAX_FILE:
            _set_aside(path, f"{size} bytes, over the {MAX_FILE >> 20} MiB a spool file may hold", bad)
            return None
        try:
            lines, new, updated, junk_at = _ingest_lines(db, fd, name, recovering, size, bad)
        except OSError as e:
            _set_aside(path, f"cannot read it ({e.strerror})", bad)
            return None
        if junk_at:
            _set_aside(path, f"over {MAX_JUNK} lines no recorder writes (by line {junk_at}): the rest not read", bad)
            return lines, new, updated
        grown = os.fstat(fd).st_size - size
        if grown > 0:
            bad.append(
                f"{shown(name)}: {grown} bytes added while it was read, by a writer that ignores its lock: not read"
            )
        try:
            os.unlink(path)  # while holding the lock: nobody else processes it again
        except FileNotFoundError:
            pass
        except OSError as e:
            _set_aside(path, f"ingested, but cannot remove it ({e.strerror})", bad)
        return lines, new, updated
    finally:
        os.close(fd)


def _ingest_lines(
    db: Database, fd: int, name: str, recovering: bool, limit: int, bad: list[str]
) -> tuple[int, int, int, int]:
    """The lines in the first `limit` bytes of the file: (lines, new rows, updated rows, and the
    line at which it held over MAX_JUNK lines no recorder writes and was left unread, or 0)."""
    name = shown(name)
    lines = new = updated = skipped = size = blank = 0
    batch: list[tuple[int, _Row]] = []

    def report(lineno: int, reason: str) -> None:
        nonlocal skipped
        skipped += 1
        if skipped <= MAX_REPORTED:
            bad.append(f"{name}:{lineno}: {reason}")

    def flush() -> None:
        nonlocal new, updated, lines, size
        if batch:
            n, u, refused = _upsert(db, batch, recovering)
            new, updated, lines = new + n, updated + u, lines + len(batch) - len(refused)
            for lineno, reason in refused:
                report(lineno, reason)
            batch.clear()
            size = 0

    with os.fdopen(os.dup(fd), "rb") as f:
        lineno = junk_at = 0
        while True:
            if skipped + blank > MAX_JUNK:
                junk_at = lineno
                break
            raw = f.readline(min(MAX_LINE + 1, limit))
            limit -= len(raw)
            if not raw:
                break
            lineno += 1
            if len(raw) > MAX_LINE:
                while raw and not raw.endswith(b"\n"):  # the rest of the long line, a chunk at a time
                    raw = f.readline(min(MAX_LINE, limit))
                    limit -= len(raw)
                report(lineno, f"longer than {MAX_LINE // 1024} KiB")
                continue
            if not raw.strip():
                blank += 1
                continue
            try:
                row = read_line(raw)
            except LineError as e:
                report(lineno, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - a check this module lacks is one line skipped, never a jammed spool
                report(lineno, f"not a line the recorder writes ({type(e).__name__})")
                continue
            batch.append((lineno, row))
            size += row.size
            if len(batch) >= BATCH or size >= BATCH_BYTES:
                flush()
    flush()
    if skipped > MAX_REPORTED:
        bad.append(f"{name}: {skipped - MAX_REPORTED} more bad lines not listed")
    return lines, new, updated, junk_at


# -- one line -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Row:
    """One line as the index stores it: the texts of a `shapes` row, not the parsed line (a
    64 KiB line may parse into a megabyte of small objects; its texts are about its size)."""

    model: str
    signature_hash: str
    signature: str
    spec: str
    options: str
    host: str | None
    ts: float

    @property
    def size(self) -> int:
        return len(self.signature) + len(self.spec) + len(self.options)

    def columns(self) -> dict[str, Any]:
        """The `shapes` columns of a new row, but its count and times."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ts"}


def parse_line(raw: bytes) -> dict:
    """One spool line as the recorder wrote it, checked (its row too: what the index would store
    of it is what `shapes` reads back); LineError says what is wrong."""
    doc = _parse(raw)
    _row(doc)
    return doc


def read_line(raw: bytes) -> _Row:
    """One spool line, checked, as the row the index stores; LineError says what is wrong."""
    return _row(_parse(raw))


def _row(doc: dict) -> _Row:
    from cachemgr.record import signature_hash, signature_text

    # the signature shown and the hash that keys the row are made from the spec and options, not
    # taken from the line: what is printed is what will be replayed, and a line that names another
    # shape's hash cannot take that shape's row
    options = doc.get("options") or {}
    row = _Row(
        model=doc["model"],
        signature_hash=signature_hash(doc["spec"], options),
        signature=signature_text(doc["spec"]),
        spec=json.dumps(doc["spec"], sort_keys=True),
        options=json.dumps(options, sort_keys=True),
        host=doc.get("host"),
        ts=float(doc.get("ts") or time.time()),
    )
    _decoded(row.model, row.signature, row.host, row.spec, row.options)
    return row


def _parse(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise LineError("not UTF-8") from None
    if _too_deep(text):
        raise LineError(f"nested deeper than {MAX_DEPTH} levels")
    try:
        doc = json.loads(text, parse_constant=_no_constant)
    except LineError:
        raise
    except RecursionError:
        raise LineError(f"nested deeper than {MAX_DEPTH} levels") from None
    except ValueError:
        raise LineError("not JSON (torn write?)") from None
    missing = [k for k in REQUIRED if not isinstance(doc, dict) or k not in doc]
    if missing:
        raise LineError(f"missing {', '.join(missing)}")
    check_values(doc)
    _check_line(doc)
    return doc


def _no_constant(name: str) -> Any:
    raise LineError(f"{name} is not a number JSON has")


def _too_deep(text: str) -> bool:
    """Whether the JSON text nests deeper than MAX_DEPTH: exact, linear, and free when there are
    fewer brackets than that."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for m in _BRACKETS.finditer(_JSON_STRING.sub('""', text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > MAX_DEPTH:
            return True
    return False


def check_values(doc: Any) -> None:
    """Every string in `doc` fit for a terminal and for PostgreSQL text, every number finite,
    nesting at most MAX_DEPTH, at most MAX_VALUES values. Iterative: no recursion however deep
    `doc` is."""
    stack: list[tuple[Any, int]] = [(doc, 0)]
    values = 1
    while stack:
        v, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise LineError(f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, str):
            _check_text(v, "a string")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise LineError("a number out of range (inf or nan)")
        elif isinstance(v, int) and not isinstance(v, bool):
            if abs(v) >= 1 << 63:
                raise LineError("an integer out of range")
        elif isinstance(v, (dict, list)):
            values += len(v)
            if values > MAX_VALUES:
                raise LineError(f"more than {MAX_VALUES} JSON values")
            if isinstance(v, dict):
                for k, x in v.items():
                    _check_text(k, "a key")
                    stack.append((x, depth + 1))
            else:
                stack.extend((x, depth + 1) for x in v)


def _check_text(s: str, what: str) -> None:
    if len(s) > MAX_TEXT:
        raise LineError(f"{what} longer than {MAX_TEXT} characters")
    bad = _BAD_CHARS.search(s)
    if bad:
        c = bad.group()
        kind = "a NUL" if c == "\x00" else "a lone surrogate" if "\ud800" <= c <= "\udfff" else "a control character"
        raise LineError(f"{what} holds {kind} (U+{ord(c):04X})")


def _check_line(doc: dict) -> None:
    for k, limit in (("model", MAX_NAME), ("signature_hash", MAX_HASH)):
        if not isinstance(doc[k], str) or not doc[k]:
            raise LineError(f"{k} is not a non-empty string")
        if len(doc[k]) > limit:
            raise LineError(f"{k} longer than {limit} characters")
    for k, types in (("ts", (int, float)), ("signature", str), ("host", str), ("options", dict)):
        if doc.get(k) is not None and (not isinstance(doc[k], types) or isinstance(doc[k], bool)):
            raise LineError(f"{k} has the wrong type")
    if isinstance(doc.get("host"), str) and len(doc["host"]) > MAX_NAME:
        raise LineError(f"host longer than {MAX_NAME} characters")
    ts = doc.get("ts")
    if ts is not None and not 0 < ts <= time.time() + FUTURE:
        raise LineError("ts is not a time (seconds since 1970, not in the future)")
    problem = spec_problem(doc["spec"])
    if problem:
        raise LineError(problem)


_SCALARS: dict[str, Any] = {"bool": bool, "int": int, "float": (int, float), "str": str}
_NONFINITE = ("nan", "inf", "-inf")  # how cachemgr.record writes such a float argument


def spec_problem(spec: Any) -> str | None:
    """What is wrong with a recorded input spec (as cachemgr.record writes them), or None."""
    if not isinstance(spec, dict) or not isinstance(spec.get("args"), list) or not isinstance(spec.get("kwargs"), dict):
        return "spec is not {args: [...], kwargs: {...}}"  # both are read by signature_text and prewarm
    if not isinstance(spec.get("grad", True), bool):
        return "spec: grad is not true or false"
    stack: list[tuple[Any, int]] = [(a, 1) for a in [*spec["args"], *spec["kwargs"].values()]]
    while stack:
        a, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"spec: nested deeper than {MAX_DEPTH} levels"
        p = _arg_problem(a)
        if p is not None:
            return f"spec: {p}"
        t = a["t"]
        if t in ("tuple", "list"):
            stack.extend((x, depth + 1) for x in a["items"])
        elif t == "dict":
            stack.extend((x, depth + 1) for x in a["items"].values())
    return None


def _ints(v: Any, low: int) -> bool:
    return isinstance(v, list) and all(isinstance(n, int) and not isinstance(n, bool) and low <= n < MAX_DIM for n in v)


def _arg_problem(a: object) -> str | None:
    """One argument's own fields (not its items: spec_problem walks those)."""
    if not isinstance(a, dict) or not isinstance(a.get("t"), str):  # a list as `t` is not even looked up
        return f"unknown argument {ascii(a)[:40]}"
    t = a["t"]
    if t == "tensor":
        ok = (
            _ints(a.get("shape"), 0)
            and isinstance(a.get("dtype"), str)
            and bool(_DTYPE.match(a["dtype"]))
            and (a.get("device") is None or isinstance(a["device"], str))
            and isinstance(a.get("requires_grad", False), bool)
        )
        if not ok:
            return "a tensor without an integer shape, a dtype and a device"
        stride = a.get("stride")  # (torch has no negative strides; one per dimension, or replay fails)
        if stride is not None and not (_ints(stride, 0) and len(stride) == len(a["shape"])):
            return "a tensor whose strides are not one whole number from 0 up per dimension"
        return None
    if t in _SCALARS:
        v = a.get("v")
        if t == "float" and v in _NONFINITE:
            return None
        ok = isinstance(v, _SCALARS[t]) and (t == "bool" or not isinstance(v, bool))
        return None if ok else f"a {t} without its value"
    if t in ("tuple", "list"):
        return None if isinstance(a.get("items"), list) else f"a {t} without items"
    if t == "dict":
        return None if isinstance(a.get("items"), dict) else "a dict without items"
    if t == "none":
        return None
    if t == "object":
        return None if isinstance(a.get("type"), str) else "an object without its type"
    return f"unknown argument {ascii(a)[:40]}"


# -- into the index -------------------------------------------------------------------------------


def _upsert(db: Database, lines: list[tuple[int, _Row]], recovering: bool) -> tuple[int, int, list[tuple[int, str]]]:
    """(new rows, updated rows, lines the index refused with why). One transaction; if the index
    refuses it for a reason other than the database failing, line by line."""
    from sqlalchemy.exc import SQLAlchemyError

    from cachemgr.errors import DatabaseError

    try:
        new, updated = _upsert_batch(db, [d for _, d in lines], recovering)
        return new, updated, []
    except DatabaseError:
        raise
    except SQLAlchemyError:
        pass
    new = updated = 0
    refused = []
    for lineno, d in lines:
        try:
            n, u = _upsert_batch(db, [d], recovering)
            new, updated = new + n, updated + u
        except DatabaseError:
            raise
        except SQLAlchemyError as e:
            first = str(getattr(e, "orig", None) or e).strip().splitlines()
            refused.append((lineno, f"the index refused it: {first[0][:200] if first else type(e).__name__}"))
    return new, updated, refused


def _upsert_batch(db: Database, lines: list[_Row], recovering: bool) -> tuple[int, int]:
    from sqlalchemy import select, tuple_
    from sqlalchemy.orm import load_only

    from cachemgr.index.models import Shape

    if not lines:
        return 0, 0
    new = updated = 0
    with db.session() as s:
        keys = {(d.model, d.signature_hash) for d in lines}
        # exactly the batch's rows (not every model x hash pair), without their texts
        query = (
            select(Shape)
            .where(tuple_(Shape.model, Shape.signature_hash).in_(sorted(keys)))
            .options(load_only(Shape.model, Shape.signature_hash, Shape.count, Shape.first_seen, Shape.last_seen))
        )
        rows = {(r.model, r.signature_hash): r for r in s.scalars(query)}
        for d in lines:
            k, ts = (d.model, d.signature_hash), d.ts
            row = rows.get(k)
            if row is None:
                row = Shape(**d.columns(), count=1, first_seen=ts, last_seen=ts)
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
    """Recorded shapes, per model in first-seen order (the order prewarm replays them in). A row
    that cannot be replayed (written by an older ingest that checked less) is left out."""
    out = list(each_recorded(db, model))
    varied = varied_dims(out)
    for d in out:
        d["varied"] = varied.get(d["model"], [])
    return out


def each_recorded(db: Database, model: str | None = None) -> Iterator[dict]:
    """The rows list_shapes gives, without `varied`, a row at a time."""
    from cachemgr.index.store import Store

    return _readable(Store.of_index(db).each_shape(model))


def each_shape(db: Database, model: str | None = None) -> Iterator[dict]:
    """list_shapes, a row at a time: memory holds a few rows (and one model's dims), however many
    the spool's writers made. A model's `varied` comes from a pass over its rows before its first."""
    from cachemgr.index.store import Store

    store = Store.of_index(db)
    current, varied = None, []
    for d in _readable(store.each_shape(model)):
        if d["model"] != current:
            current = d["model"]
            varied = varied_dims(_readable(store.each_shape(current))).get(current, [])
        d["varied"] = varied
        yield d


def _readable(rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The index's `shapes` rows with their spec and options decoded, as prewarm replays them; a
    row that cannot be is left out."""
    for r in rows:
        try:
            spec, options = _decoded(r["model"], r["signature"], r["host"], r["spec"], r["options"])
        except LineError:
            continue
        yield {**r, "spec": spec, "options": options}


def _decoded(model: Any, signature: Any, host: Any, spec_text: Any, options_text: Any) -> tuple[dict, dict]:
    """A `shapes` row's spec and options as prewarm replays them; LineError says why the row cannot
    be. The ingest runs it on each line's row, so a row it stores is never dropped here."""
    for what, text in (("model", model), ("signature", signature), ("host", host or "")):
        if not isinstance(text, str):
            raise LineError(f"{what} is not text")
        _check_text(text, what)
    spec, options = _stored(spec_text, "spec"), _stored(options_text, "options")
    check_values(spec)
    check_values(options)
    problem = spec_problem(spec)
    if problem is not None:
        raise LineError(problem)
    if not isinstance(options, dict):
        raise LineError("options is not {...}")
    return spec, options


def _stored(text: Any, what: str) -> Any:
    if not isinstance(text, str):
        raise LineError(f"{what} is not a stored JSON value")
    if len(text) > MAX_LINE:
        raise LineError(f"{what} takes {len(text)} characters stored, over the {MAX_LINE // 1024} KiB a row may hold")
    if _too_deep(text):
        raise LineError(f"{what} nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise LineError(f"{what} is not a stored JSON value") from None


def varied_dims(shapes: Iterable[dict]) -> dict[str, list[str]]:
    """Per model, which tensor dims took more than one value across its signatures: `args[0].0`.
    A dim's first value is held, not every value it took."""
    first: dict[str, dict[str, Any]] = {}
    varied: dict[str, set[str]] = {}
    for d in shapes:
        per, more = first.setdefault(d["model"], {}), varied.setdefault(d["model"], set())
        for path, shape in _tensor_shapes(d["spec"]):
            for i, n in enumerate(shape):
                dim = f"{path}.{i}"
                if per.setdefault(dim, n) != n:
                    more.add(dim)
    return {m: sorted(more) for m, more in varied.items()}


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
