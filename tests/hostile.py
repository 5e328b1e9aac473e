"""Building blocks for hostile trees: victim trees outside the root, snapshots that show any change
to them, crafted entry pickles, and the corpus `bench/hostile.py` measures memory over.

Nothing here imports cachemgr: the same corpus serves the tests and the benchmark.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
import struct
import subprocess
from pathlib import Path

FX_MODULE, FX_CLASS = "torch._inductor.output_code", "CompiledFxGraph"
AOT_MODULE, AOT_CLASS = "torch._functorch._aot_autograd.autograd_cache", "AOTAutogradCacheEntry"


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything under `root` as it is: type, size, mtime and content hash of every file,
    target of every symlink, every directory. Symlinks are not followed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mtime_ns)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


def victim_tree(root: Path, dirs: int = 64, files: int = 3) -> Path:
    """A tree outside the cache that nothing may touch, shaped like cache folders (kernel-named
    directories, module-named files) so a path that leaks out of the root would find matches."""
    for i in range(dirs):
        d = root / ("A" * 48 + f"{i:04d}")
        d.mkdir(parents=True, exist_ok=True)
        for j in range(files):
            (d / f"k{j}.cubin").write_bytes(os.urandom(64))
    (root / "precious.txt").write_text("keep me")
    old = 1_600_000_000
    for p in [root, *root.rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)
    return root


def find_totals(root: Path, mounts: tuple[Path, ...] = ()) -> tuple[int, int]:
    """(files, bytes) as `find` counts them, leaving out what cachemgr never indexes: dot-names
    (writes in progress, its own trash), Triton's tmp.* directories and mount points (`mounts`:
    a bind mount keeps the device number that `find -xdev` goes by)."""
    out = subprocess.run(
        [
            "find",
            str(root),
            *(a for m in mounts for a in ("-path", str(m), "-prune", "-o")),
            "-name",
            ".*",
            "-prune",
            "-o",
            "-name",
            "tmp.*",
            "-prune",
            "-o",
            "-name",
            "*.tmp*",
            "-prune",
            "-o",
            "-type",
            "f",
            "-printf",
            "%s\\n",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return len(out), sum(map(int, out))


def fake_entry(state: dict, module: str = FX_MODULE, name: str = FX_CLASS, build: bool = True) -> bytes:
    """A pickle shaped as torch writes an entry (a class instance made with NEWOBJ, then BUILD
    with its state), naming `module.name` without needing it importable. Without `build`, the
    object never gets a state (NEWOBJ alone)."""

    def short(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE

    head = b"\x80\x04" + short(module) + short(name) + b"\x93" + b")" + b"\x81"  # STACK_GLOBAL, EMPTY_TUPLE, NEWOBJ
    if not build:
        return head + b"."
    body = pickle.dumps(state, protocol=2)[2:-1]  # the state's own opcodes, without PROTO and STOP
    return head + body + b"b."  # BUILD, STOP


def fxgraph_state(key: str, **extra) -> dict:
    """A minimal but well-formed CompiledFxGraph state."""
    return {
        "_fx_graph_cache_key": key,
        "cache_key": "c" + "q" * 51,
        "guards_expr": None,
        "_time_taken_ns": 1_500_000_000,
        "_fx_graph_cache_debug_lines": [],
        **extra,
    }


def memo_bomb() -> bytes:
    """Nine bytes that ask the C unpickler for a memo table of 2^28 slots (4 GB touched)."""
    return b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 28) + b"."  # LONG_BINPUT 2^28


def many_classes(n: int = 200_000) -> bytes:
    """A pickle naming `n` distinct classes (each a stand-in class object for a naive reader)."""
    parts = [b"\x80\x04("]  # MARK
    for i in range(n):
        mod, name = b"m", f"C{i}".encode()
        parts.append(b"\x8c" + bytes([len(mod)]) + mod + b"\x8c" + bytes([len(name)]) + name + b"\x93")
    parts.append(b"l.")  # LIST, STOP
    return b"".join(parts)


def slow_source(n: int = 20_000) -> str:
    """A generated module source with many unterminated C++ bindings: a regular expression with
    two lazy groups takes quadratic time over it."""
    return "cpp_pybinding(['x'], r'''\n" + "y" * 30 + "\n" + "cpp_pybinding([" * n


def slow_pickle(keys: int = 30_000) -> bytes:
    """A small valid pickle (390 KB) that takes the C unpickler seconds however fast the machine
    (3.5 s on a fast one): a dict of int keys that all hash alike (multiples of 2^61 - 1, Python's
    int hash modulus), so each insertion probes past every key before it."""
    parts = [b"\x80\x02}("]  # EMPTY_DICT, MARK
    for k in range(1, keys + 1):
        n = k * ((1 << 61) - 1)
        raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        parts.append(b"\x8a" + bytes([len(raw)]) + raw + b"N")  # LONG1 key, None
    return b"".join(parts) + b"u."  # SETITEMS, STOP


def busy_pickle(items: int = 5_000_000) -> bytes:
    """A valid pickle that takes the C unpickler a while (a long list of Nones): keeps a parse
    worker busy."""
    return b"\x80\x02](" + b"N" * items + b"e."
