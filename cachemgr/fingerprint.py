"""Which torch wrote an entry, and which torch builds a host still runs: without importing torch.

An fxgraph key is hashed from a `torch_version` component: base32(sha256(pickle(torch_key()))),
where `torch_key()` hashes torch's own version string and source files (docs/formats.md,
section 6). So an entry of torch 2.9+ names the exact build that wrote it (2.14 records only this
hash, no version string), and the same hash can be computed here for any torch installed on this
host by reading its files. Torch 2.5 and 2.6 record neither: their field sets still tell the
release family ('2.5.*', '2.6.*').

`Keep` says which builds stay: an entry is stale when its build is known not to be one of them.
An entry whose hash names no build cachemgr knows is kept while some version to keep could be it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import os
import pickle
import pkgutil
import re
from dataclasses import dataclass, field
from typing import Protocol

FAMILY_ONLY = ("2.5.", "2.6.")  # releases whose entries record no torch_version hash


class _Hash(Protocol):
    """A hashlib object."""

    def update(self, data: bytes, /) -> None: ...


def _code_hash(roots: list[str], prefix: str, h: _Hash) -> None:
    for lib in sorted(pkgutil.iter_modules(roots, prefix), key=lambda m: m.name):
        spec = lib.module_finder.find_spec(lib.name, None)  # a directory scan: nothing is imported
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            continue
        with open(spec.origin, "rb") as f:
            h.update(spec.name.encode())
            h.update(f.read())
        if lib.ispkg and spec.submodule_search_locations:
            _code_hash(list(spec.submodule_search_locations), spec.name + ".", h)


def torch_key_of(torch_dir: str) -> tuple[str, bytes]:
    """(torch.__version__, torch_key()) of the torch installed at `torch_dir`, read from its files
    as `torch._inductor.codecache.torch_key` computes it (checked against 2.5.1 to 2.14.1)."""
    with open(os.path.join(torch_dir, "version.py")) as f:
        version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M).group(1)  # type: ignore[union-attr]
    with open(os.path.join(torch_dir, "_inductor", "codecache.py")) as f:
        src = f.read()
    body = src[src.index("def torch_key()") :]
    listed = re.search(r"extra_files = \((.*?)\)", body, re.S)
    extra = re.findall(r'"([^"]+)"', listed.group(1)) if listed else []
    h = hashlib.sha256(version.encode())
    _code_hash([torch_dir], "", h)
    for rel in extra:
        p = os.path.join(torch_dir, "_inductor", rel)
        if os.path.exists(p):
            with open(p, "rb") as f:
                h.update(f.read())
    return version, h.digest()


def component_hash(obj: object) -> str:
    """The [<hash>] Inductor writes for one hash component: base32(sha256(pickle, fast mode))."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf)
    p.fast = True
    p.dump(obj)
    return base64.b32encode(hashlib.sha256(buf.getvalue()).digest())[:51].decode().lower()


@dataclass(frozen=True)
class Build:
    version: str  # torch.__version__, e.g. '2.13.0+cpu'
    hash: str  # the torch_version component hash its entries record


def installed_torch() -> Build | None:
    """The torch this Python would import, fingerprinted from its files (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    torch_dir = list(spec.submodule_search_locations)[0]
    try:
        version, key = torch_key_of(torch_dir)
    except (OSError, ValueError, AttributeError):
        return None
    return Build(version, component_hash(key))


# -- matching ---------------------------------------------------------------------------------------


def release(version: str) -> str:
    """'2.13.0+cpu' -> '2.13.0' (the local build label dropped)."""
    return version.split("+", 1)[0]


def version_matches(entry_version: str | None, wanted: str) -> bool:
    """Does an entry written by `entry_version` ('2.13.0+cpu', or a family '2.5.*') count as
    torch `wanted` ('2.13.0', '2.13.0+cpu', '2.13', '2.5.1')? A wanted label must match exactly."""
    if not entry_version:
        return False
    if entry_version.endswith(".*"):
        return (wanted + ".").startswith(entry_version[:-1]) or wanted == entry_version
    if "+" in wanted:
        return entry_version == wanted
    ours = release(entry_version)
    return ours == wanted or ours.startswith(wanted + ".")


@dataclass
class Keep:
    """The torch builds to keep: versions named by people, resolved to the hashes their entries
    record where a version string, a learned fingerprint or the installed torch tells it."""

    versions: list[str]
    hashes: dict[str, str] = field(default_factory=dict)  # torch_version hash -> version (known builds)

    def kept_hashes(self) -> set[str]:
        return {h for h, v in self.hashes.items() if any(version_matches(v, k) for k in self.versions)}

    def unresolved(self) -> list[str]:
        """Versions to keep whose builds' hashes are unknown (and whose entries record one)."""
        known = {v for v in self.hashes.values()}
        return [
            k for k in self.versions if not k.startswith(FAMILY_ONLY) and not any(version_matches(v, k) for v in known)
        ]

    def is_stale(self, version: str | None, version_hash: str | None) -> bool | None:
        """True: written by a build not kept. False: kept. None: cannot tell (no version at all)."""
        if version and any(version_matches(version, k) for k in self.versions):
            return False
        if version_hash:
            if version_hash in self.kept_hashes():
                return False
            if version_hash not in self.hashes and not version and self.unresolved():
                return False  # a build nobody named yet: it may be one of those to keep
            return True
        if version:
            return True
        return None


def learn(keep: Keep, pairs: list[tuple[str | None, str | None]]) -> None:
    """Learn hash -> version from entries that record both (torch 2.9 to 2.13 do)."""
    for version, h in pairs:
        if version and h and not version.endswith(".*"):
            keep.hashes.setdefault(h, version)


def keep_for(
    rows,
    versions: list[str],
    recent: set[str] | None = None,
    known: dict[str, str] | None = None,
    installed: Build | None = None,
) -> Keep:
    """What `purge --stale` keeps: the `versions` given, else the torch installed here and those
    used recently (`recent`); hashes resolved from `known` fingerprints, the installed torch, and
    entries that record a version beside their hash. `rows` need .torch_version, .torch_version_hash."""
    keep = Keep([v for v in versions if v])
    if installed is not None:
        keep.hashes[installed.hash] = installed.version
    keep.hashes.update(known or {})
    learn(keep, [(r.torch_version, r.torch_version_hash) for r in rows])
    if not keep.versions:
        keep.versions = sorted({installed.version} if installed else set()) + sorted(recent or ())
    return keep
