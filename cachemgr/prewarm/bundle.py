"""Portable cache bundles: a header line naming the build environment, then PyTorch's own
mega-cache bytes (torch.compiler.save_cache_artifacts / load_cache_artifacts).

    CACHEMGR-BUNDLE 1\\n
    {"torch": "2.11.0+cu128", "triton": "3.6.0", "gpu_arch": ["sm_90"], ...}\\n
    <save_cache_artifacts() bytes>

The header can be read without torch; so can the payload (`artifacts`), whose entries record
what their keys were hashed from. What this host will hit is not judged from the header but from
the entries (cachemgr.check, run by `import`, `prewarm --bundle` and `check --bundle`); the
header's `torch` names the writer only of entries that record nothing themselves. A bundle is
*complete* when every graph, kernel and autotune result its entries name is in it
(`completeness`); `export` names a partial bundle, `import` refuses one unless told otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from cachemgr import layout, safefs
from cachemgr.errors import CachemgrError, NotFound
from cachemgr.prewarm import MAX_BUNDLE_BYTES
from cachemgr.units import format_size

MAGIC = b"CACHEMGR-BUNDLE 1\n"


class BundleError(CachemgrError):
    exit_code = 9


@dataclass(frozen=True)
class Bundle:
    header: dict
    payload: bytes


def temp_path(path: str) -> str:
    """Where `write` writes a bundle before it renames it to `path`: beside it, a dotfile of a name
    nobody can guess (a symlink planted at a guessable one took the write)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")


def write(path: str, header: dict, payload: bytes, tmp: str | None = None) -> dict:
    """Write a bundle to `path` whole or not at all: into `tmp` (temp_path's, made here; named by
    the caller where another process removes it should this one be killed), then renamed."""
    header = {**header, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    line = json.dumps(header, sort_keys=True).encode() + b"\n"
    size = len(MAGIC) + len(line) + len(payload)
    if size > MAX_BYTES:  # (read refuses it)
        raise BundleError(
            f"the bundle would take {format_size(size)}, over the {format_size(MAX_BYTES)} a bundle may be: not written"
        )
    _refuse_odd_target(path)
    tmp = tmp or temp_path(path)
    # a new file (O_EXCL) as open() makes one (0666 less the umask), through no symlink
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(line)
            f.write(payload)
        _refuse_odd_target(path)  # (again: made meanwhile)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return header


def odd_target(path: str) -> str | None:
    """What is at `path` where a bundle written there would replace something that is not a
    regular file (the rename replaced a device node, FIFO or symlink: as root, /dev/null)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # (a name too long, a folder that is no folder: nothing can be written there)
        return f"a name that cannot be written ({e.strerror})"
    return None if stat.S_ISREG(st.st_mode) else _kind_of(st.st_mode)


def _refuse_odd_target(path: str) -> None:
    odd = odd_target(path)
    if odd:
        raise BundleError(f"{path} is {odd}, not a regular file: refusing to replace it")


def _kind_of(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "something else"


MAX_HEADER = 1 << 20  # bytes of the header line (a few hundred real ones)
MAX_HEADER_NESTING = 16  # levels of the header's JSON: cachemgr writes 3
MAX_BYTES = MAX_BUNDLE_BYTES


def _header_problem(h: Any) -> str | None:
    """The first field of a header that is not as cachemgr writes it (of those read), or None: a
    list for `expects` crashed the check; 983 nested lists crashed what printed it (RecursionError)."""
    if not isinstance(h, dict):
        return "not an object"
    if _nests_deeper(h, MAX_HEADER_NESTING):
        return f"nested deeper than {MAX_HEADER_NESTING} levels"

    def texts(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    size, expects = h.get("bytes"), h.get("expects")
    ok = {
        "bytes": isinstance(size, int) and not isinstance(size, bool) and size >= 0,
        "sha256": isinstance(h.get("sha256"), str),
        "torch": isinstance(h.get("torch"), (str, type(None))),
        "models": h.get("models") is None or texts(h["models"]),
        "expects": expects is None or (isinstance(expects, dict) and all(texts(v) for v in expects.values())),
    }
    return next((f"field {name!r}" for name, good in ok.items() if not good), None)


def _nests_deeper(doc: Any, levels: int) -> bool:
    """Whether `doc` (parsed JSON) holds lists and objects nested deeper than `levels`. Iterative:
    no recursion however deep it is."""
    stack = [(doc, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, (dict, list)):
            if level > levels:
                return True
            stack.extend((x, level + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def read(path: str, payload: bool = True) -> Bundle:
    """The bundle at `path`: only a regular file is opened (a FIFO would block, /dev/zero never
    ends) and one of at most MAX_BYTES, its header line read up to MAX_HEADER bytes, and its
    payload only if the file holds exactly the header's `bytes` of it (checked against its size
    before anything is read) and they match its checksum (hashed as read, before being held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BundleError(f"bundle {path} is not a regular file")
            if st.st_size > MAX_BYTES:
                raise BundleError(
                    f"bundle {path} is larger than a bundle may be ({format_size(st.st_size)}, "
                    f"at most {format_size(MAX_BYTES)})"
                )
            if f.readline(len(MAGIC)) != MAGIC:
                raise BundleError(f"{path} is not a cachemgr bundle (made by `cachemgr export`)")
            line = f.readline(MAX_HEADER + 1)
            try:
                header = json.loads(line) if len(line) <= MAX_HEADER else None
            except (ValueError, RecursionError):
                raise BundleError(f"bundle {path}: header is not JSON (truncated file?)") from None
            problem = _header_problem(header)
            if problem or not isinstance(header, dict):
                raise BundleError(f"bundle {path}: its header is not one cachemgr writes ({problem})")
            if st.st_size - f.tell() != header["bytes"]:
                raise BundleError(f"bundle {path}: payload does not match its header (truncated or corrupt)")
            data = b""
            if payload:
                start, digest = f.tell(), hashlib.sha256()
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
                if digest.hexdigest() != header["sha256"]:
                    raise BundleError(f"bundle {path}: payload does not match its header (truncated or corrupt)")
                f.seek(start)
                data = f.read(header["bytes"] + 1)
    except FileNotFoundError:
        raise NotFound(f"bundle {path} does not exist") from None
    except IsADirectoryError:
        raise BundleError(f"bundle {path} is not a regular file") from None
    except OSError as e:
        raise BundleError(f"cannot read bundle {path}: {e.strerror}") from None
    if payload and len(data) != header["bytes"]:  # (changed since it was hashed)
        raise BundleError(f"bundle {path}: payload does not match its header (truncated or corrupt)")
    return Bundle(header, data)


# The keys torch's loader joins onto the cache directory, per artifact type: a bundle is another
# host's, and a key of '../x' or '/etc/x' would be written there (torch checks nothing).
KEY_FORMS = layout.ARTIFACT_KEYS


def key_problem(kind: str, key: str) -> str | None:
    """Why an artifact's key is not one Inductor makes, a name inside the cache directory that a
    scan indexes and eviction takes (None: it is)."""
    form = KEY_FORMS.get(kind)
    if form is not None and form.fullmatch(key) and ".." not in key:
        if kind != "pgo" or len(pgo_files(key)[-1].rpartition("/")[2].encode()) <= 255:  # (its lock's name)
            return None
    return f"{kind[:40]} artifact key {key[:80]!r} is not a name inside the cache that Inductor makes"


def unsafe_keys(arts: Artifacts) -> list[str]:
    """Why torch's loader must not be handed these artifacts: a type cachemgr does not know, or a
    key that is not a name inside the cache directory."""
    out = []
    for kind, items in arts.items():
        if kind not in KEY_FORMS:
            out.append(f"{len(items)} artifact(s) of a type cachemgr does not know ({kind[:40]!r})")
            continue
        out.extend(why for key, _ in items if (why := key_problem(kind, key)))
    return out


def exportable(records: Iterable[tuple[str, str, Any]], skipped: list[str]) -> Iterator[tuple[str, str, Any]]:
    """The (type, key, content) records of cache files that `import` accepts; each other one is
    left out, its reason added to `skipped`: a name that is not UTF-8 made torch's save fail
    whole ("nothing to export"), and a .best_config in a dot folder (the trash) made a bundle
    that import refuses."""
    for kind, key, content in records:
        why = key_problem(kind, key)
        if why:
            skipped.append(why)
        else:
            yield kind, key, content


def load_dirs(arts: Artifacts) -> set[str]:
    """The directories under the cache root that torch's loader writes these artifacts into (and
    makes where missing), as torch 2.5-2.13 name them; keys must be safe (`unsafe_keys`)."""
    out = set()
    for kind, items in arts.items():
        for key, _ in items:
            if kind == "inductor":
                out.add(f"fxgraph/{key[1:3]}/{key}")
            elif kind == "aot_autograd":
                out.add(f"aotautograd/{key}")
            elif kind == "autotune":
                out.add(key.rpartition("/")[0])
            elif kind == "pgo":
                out.add("dynamo")
            elif kind == "precompile":
                out.add(f"dynamo/{key}")
    return out


def pgo_files(key: str) -> list[str]:
    """The files torch writes a PGO artifact through (its lock and temporary file are opened
    following a symlink), relative to the cache root."""
    path = "dynamo/" + re.sub(r'[<>:"/\\|?*]', "_", f"code_state_{key}.pkl")
    return [path, path + ".tmp", path + ".lock"]


def write_hazards(root: safefs.Root, arts: Artifacts) -> list[str]:
    """Where in the cache (`root`, opened once) torch would write these artifacts through
    something that is not a directory of it, one line each: a symlink below the top level
    (`fxgraph/r6` -> elsewhere) took the entries out of the root, torch follows it. Each
    directory on each artifact's path is looked at (lstat) from the root down; a missing one is
    fine (torch makes it). Kernels go into `triton/<device>/`: those present are looked at too."""
    safe = {kind: [(k, c) for k, c in items if not key_problem(kind, k)] for kind, items in arts.items()}
    dirs = {rel for rel in load_dirs(safe) if rel}  # (import refuses the others)
    if arts.get("inductor"):
        dirs.add("triton")
        with contextlib.suppress(OSError):
            dirs.update(f"triton/{d}" for d in root.listdir("triton") if d.isdigit())
    parts = {"/".join(p[: i + 1]) for rel in dirs for p in [rel.split("/")] for i in range(len(p))}
    files = [f for key, _ in safe.get("pgo", []) for f in pgo_files(key)]
    is_file = set(files)
    out: list[str] = []
    below: set[str] = set()  # missing or refused: what is below them is not looked at
    for rel in sorted(parts) + files:
        parent, _, name = rel.rpartition("/")
        if parent in below:
            below.add(rel)
            continue
        try:
            st = os.stat(name, dir_fd=root.dir_fd(parent), follow_symlinks=False)
            mode, nlinks = st.st_mode, st.st_nlink
        except FileNotFoundError:
            below.add(rel)
            continue
        except OSError as e:
            out.append(f"{_shown(rel)} cannot be looked at ({e.strerror})")
            below.add(rel)
            continue
        want, what = (stat.S_ISREG, "a regular file") if rel in is_file else (stat.S_ISDIR, "a directory")
        if not want(mode):
            out.append(f"{_shown(rel)} is {_kind_of(mode)}, not {what}")
            below.add(rel)
        elif rel in is_file and nlinks > 1:  # torch opens it for writing: a hard link writes the file it names too
            out.append(f"{_shown(rel)} is a hard link (another name of a file elsewhere)")
    return out


def replaced_autotune(root: safefs.Root, arts: Artifacts) -> list[str]:
    """The bundle's autotune results this cache holds already: torch's load replaces them."""
    out = []
    for key, _ in arts.get("autotune", []):
        if key_problem("autotune", key):
            continue
        parent, _, name = key.rpartition("/")
        with contextlib.suppress(OSError):
            os.stat(name, dir_fd=root.dir_fd(parent), follow_symlinks=False)
            out.append(key)
    return out


# -- torch's mega-cache payload, read and written without torch -----------------------------------
#
# torch/utils/_appending_byte_serializer.py (torch 2.7+): a CRC32 of the rest (4 bytes, big
# endian), a u64 version (1), then records: artifact type (a base64 string: u64 length + bytes),
# u64 count, and per artifact its key (base64 string) and content (u64 length + bytes).

PAYLOAD_VERSION = 1
MAX_ARTIFACTS = 50_000  # in one bundle: a large model's cache holds a few thousand
BINARIES = (".cubin", ".hsaco", ".zebin", ".spv")  # a Triton kernel's binary, per backend
Artifacts = dict[str, list[tuple[str, bytes]]]  # type ('inductor', 'aot_autograd', 'autotune', ...) -> (key, content)


def artifacts(payload: bytes, path: str = "bundle") -> Artifacts:
    """The artifacts of a mega-cache payload, by type (torch.compiler.save_cache_artifacts' bytes)."""
    import base64
    import zlib

    def bad(why: str) -> BundleError:
        return BundleError(f"{path}: torch's artifacts do not read: {why}")

    if len(payload) < 12:
        raise bad("too short")
    if zlib.crc32(payload[4:]).to_bytes(4, "big") != payload[:4]:
        raise bad("checksum mismatch")
    at = 4

    def u64() -> int:
        nonlocal at
        if at + 8 > len(payload):
            raise bad("truncated")
        at += 8
        return int.from_bytes(payload[at - 8 : at], "big")

    def blob() -> bytes:
        nonlocal at
        n = u64()
        if at + n > len(payload):
            raise bad("truncated")
        at += n
        return payload[at - n : at]

    def string() -> str:
        try:
            return base64.b64decode(blob(), validate=True).decode()
        except ValueError as e:
            raise bad(f"a name is not base64 text ({e})") from None

    if u64() != PAYLOAD_VERSION:
        raise bad("unknown version")
    out: Artifacts = {}
    seen = set()
    count = 0
    while at < len(payload):
        kind = string()
        if kind in seen:  # torch keeps only the last list of a type: a check of both counted what it never loads
            raise bad(f"artifact type {kind[:40]!r} is listed twice")
        seen.add(kind)
        for _ in range(u64()):
            count += 1
            if count > MAX_ARTIFACTS:  # (each costs a few KiB to check: 1,000,000 of 21 bytes took 4 GB)
                raise bad(f"over {MAX_ARTIFACTS:,} artifacts")
            key = string()
            out.setdefault(kind, []).append((key, blob()))
    return out


def payload_of(arts: Artifacts) -> bytes:
    """artifacts()'s inverse: bytes torch.compiler.load_cache_artifacts reads."""
    import base64
    import zlib

    body = bytearray(PAYLOAD_VERSION.to_bytes(8, "big"))

    def blob(b: bytes) -> None:
        body.extend(len(b).to_bytes(8, "big"))
        body.extend(b)

    for kind, items in arts.items():
        blob(base64.b64encode(kind.encode()))
        body.extend(len(items).to_bytes(8, "big"))
        for key, content in items:
            blob(base64.b64encode(key.encode()))
            blob(content)
    return zlib.crc32(body).to_bytes(4, "big") + bytes(body)


# -- reading the entries: in parse workers ---------------------------------------------------------


@dataclass(frozen=True)
class Contents:
    """What cachemgr reads of a bundle's pickled entries (`read_contents`): for each fxgraph entry
    its parse result and its kernels (`kernels_of`, or why they do not read), for each AOT entry
    the graphs it needs (or why it does not read)."""

    header: dict
    arts: Artifacts
    graphs: list[tuple[str, Any, tuple | str]]  # (key, cachemgr.parse.Parsed, kernels_of(...) or why not)
    aot: list[tuple[str, list[tuple[str, str]] | str]]  # (key, its (kind, ref) references or why not)

    def kernel_hashes(self) -> set[str]:
        return {h for _, _, k in self.graphs if not isinstance(k, str) for h in k[2]}


def read_contents(header: dict, arts: Artifacts) -> Contents:
    """Every fxgraph and AOT entry of `arts` read, each in a parse worker (a BYTES job of
    cachemgr.index.workers: its address space limited, killed after PARSE_SECONDS, replaced),
    never in this process: a bundle is a file from anywhere, and a pickle can be built to make
    the unpickler allocate without bound or spin. An entry that costs its worker gets the reason."""
    from cachemgr.index.workers import BYTES, Job, Pool, default_workers, failure

    fx, aot = arts.get("inductor", []), arts.get("aot_autograd", [])
    fx_reader, aot_reader = f"{__name__}:{graph_facts.__name__}", f"{__name__}:{aot_facts.__name__}"
    jobs = [Job(i, 0, "", BYTES, fx_reader, key, (c, key)) for i, (key, c) in enumerate(fx)]
    jobs += [Job(len(fx) + i, 0, "", BYTES, aot_reader, key, (c,)) for i, (key, c) in enumerate(aot)]
    results: dict[int, tuple[bool, Any]] = {}
    if jobs:
        with Pool(min(default_workers(), len(jobs))) as pool:  # (a worker per core, not per entry)
            for job, result in pool.run(jobs, lambda job, reason: (False, reason)):
                results[job.id] = cast("tuple[bool, Any]", result)
    graphs: list[tuple[str, Any, tuple | str]] = []
    for i, (key, _) in enumerate(fx):
        ok, value = results[i]
        if ok:
            graphs.append((key, value[0], value[1] if not isinstance(value[1], str) else failure(value[1])))
        else:
            from cachemgr.parse import Parsed
            from cachemgr.vocab import Kind

            reason = failure(value)
            graphs.append((key, Parsed(Kind.FXGRAPH, graph_key=key, corrupt=reason), reason))
    aots: list[tuple[str, list[tuple[str, str]] | str]] = []
    for i, (key, _) in enumerate(aot):
        ok, value = results[len(fx) + i]
        aots.append((key, value if ok else failure(value)))
    return Contents(header, arts, graphs, aots)


def graph_facts(content: bytes, key: str) -> tuple[Any, tuple | str]:
    """An fxgraph entry's parse result and its kernels (`kernels_of`; the exception's name if they
    do not read). Run in a parse worker (`read_contents`)."""
    from cachemgr.parse import parse_fxgraph

    parsed = parse_fxgraph(content, key)
    try:
        kernels: tuple | str = kernels_of(content)
    except Exception as e:  # noqa: BLE001 - a hostile entry is a problem of the bundle, named
        kernels = type(e).__name__
    return parsed, kernels


def aot_facts(content: bytes) -> list[tuple[str, str]]:
    """An AOT entry's references; ValueError says why it does not read. Run in a parse worker."""
    from cachemgr.parse import parse_aotautograd

    parsed = parse_aotautograd(content)
    if parsed.corrupt:
        raise ValueError(parsed.corrupt)
    return parsed.refs


# -- completeness: what an entry names is in the bundle -----------------------------------------

_KERNEL = re.compile(r"async_compile\.triton\(\s*['\"]([A-Za-z_][\w]*)['\"]")


def kernels_of(content: bytes) -> tuple[list[str], dict[str, set[str]], list[str]]:
    """An fxgraph entry's Triton kernels: the names its wrapper module launches, the files its
    bundled kernel artifacts hold per kernel name (suffixes), and the bundled kernels' hashes.
    Unpickles `content`: run it in a parse worker (`read_contents`)."""
    from cachemgr.parse.unpickle import items, safe_load, state_of, text

    st = state_of(safe_load(content))
    source = st.get("source_code")
    names = list(dict.fromkeys(_KERNEL.findall(source))) if isinstance(source, str) else []
    files: dict[str, set[str]] = {}
    hashes = []
    tb = state_of(st.get("_triton_bundle"))
    for art in items(tb.get("kernel_artifacts")):
        a = state_of(art)
        h = text(a.get("kernel_hash"), 128)
        if h:
            hashes.append(h)
        for f in items(a.get("artifacts")):
            name = text(state_of(f).get("filename"), 512) or ""
            stem, dot, suffix = name.removeprefix("__grp__").partition(".")
            if dot:
                files.setdefault(stem, set()).add("." + suffix)
    return names, files, hashes


def _shown(name: str) -> str:
    """A name out of a bundle (another host's) as a message shows it: escaped as an index key is
    (%XX for a control character: no terminal escape reaches the screen), at most 200 characters."""
    from cachemgr.layout import key_of

    return key_of(name)[:200]


def completeness(contents: Contents, expects: dict | None = None) -> list[str]:
    """What bundled entries name that the bundle lacks, one line each (empty: complete):
    - an AOTAutograd entry's forward/backward graphs (its modules): inductor artifacts;
    - each Triton kernel a graph's wrapper module launches: a bundled kernel artifact with its
      binary (a kernel compiled without `bundle_triton_into_fx_graph_cache`, or one whose binary
      was dropped, recompiles on the importing host);
    - each autotune result the exporting cache held for a bundled kernel (`expects`, written into
      the header by `cachemgr export`).
    An entry that does not read is named too. The C++ builds of CPU graphs are never in torch's
    bundles: they are rebuilt on first use."""
    from cachemgr.vocab import Kind

    out: list[str] = []
    graphs = {key for key, _, _ in contents.graphs}
    for key, refs in contents.aot:
        if isinstance(refs, str):
            out.append(f"aotautograd entry {_shown(key)}: its entry does not read: {refs}")
            continue
        for kind, ref in refs:
            if kind == Kind.FXGRAPH and ref not in graphs:
                out.append(f"aotautograd entry {_shown(key)}: its graph {_shown(ref)} is not in the bundle")
    for key, _, kernels in contents.graphs:
        if isinstance(kernels, str):
            out.append(f"graph {_shown(key)}: its entry does not read: {kernels}")
            continue
        names, files, _ = kernels
        for name in names:
            kernel = f"graph {_shown(key)}: Triton kernel {_shown(name)}"
            if name not in files:
                out.append(f"{kernel} is not in the bundle")
            elif not files[name] & set(BINARIES):
                out.append(f"{kernel} has no binary ({', '.join(BINARIES)}) in the bundle")
    have = {key for key, _ in contents.arts.get("autotune", [])}
    for key in (expects or {}).get("autotune", []):
        if key not in have:
            out.append(f"autotune result {_shown(key)} is not in the bundle")
    return out


def expected_autotune(cache_dir: str, kernels: set[str]) -> list[str]:
    """The autotune results (`<2ch>/<hash>.best_config`, keyed as the bundle keys them) that the
    cache holds for these Triton kernels (the bundled graphs': `Contents.kernel_hashes`)."""
    from cachemgr.layout import classify
    from cachemgr.parse import autotune_refs
    from cachemgr.vocab import Kind

    if not kernels:
        return []
    out = []
    try:
        root = safefs.Root(cache_dir)  # (regular files only, no symlink followed: a FIFO hung export)
    except OSError:
        return []
    with root:
        try:
            tops = sorted(os.listdir(root.fd))
        except OSError:
            return []
        for top in tops:
            if len(top) != 2:
                continue
            try:
                names = sorted(root.listdir(top))
            except OSError:  # not a folder, a symlink, gone
                continue
            for name in names:
                key = f"{top}/{name}"
                c = classify(key)
                if c is None or c.kind != Kind.AUTOTUNE:
                    continue
                try:
                    refs = autotune_refs(root.read(key, 1 << 20))
                except (OSError, safefs.Refused):
                    continue
                if any(ref in kernels for _, ref in refs):
                    out.append(key)
    return out


def graphs(contents: Contents) -> list:
    """The bundle's fxgraph entries as the cache check reads them (cachemgr.check.Graph). Where an
    entry records no components, a bundle that replayed models names the torch that wrote them
    (its header's `torch`)."""
    from dataclasses import replace

    from cachemgr.check import graph_of

    header = contents.header
    claimed = header.get("torch") if header.get("models") else None
    out = []
    for i, (key, parsed, _) in enumerate(contents.graphs):
        g = graph_of(f"{key}#{i}", parsed)
        if not g.recorded and claimed:
            g = replace(g, torch_version=_shown(str(claimed)))
        out.append(g)
    return out
