"""Portable cache bundles: a header line naming the build environment, then PyTorch's own
mega-cache bytes (torch.compiler.save_cache_artifacts / load_cache_artifacts).

    CACHEMGR-BUNDLE 1\\n
    {"torch": "2.11.0+cu128", "triton": "3.6.0", "gpu_arch": ["sm_90"], ...}\\n
    <save_cache_artifacts() bytes>

The header can be read without torch (`cachemgr import` checks it first); the check against the
host runs in the worker, where torch is imported and the true versions are known. Cache entries
embed the torch version and the device, so a mismatched bundle could only ever miss: refuse it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from cachemgr.errors import CachemgrError, NotFound

MAGIC = b"CACHEMGR-BUNDLE 1\n"


class BundleError(CachemgrError):
    exit_code = 9


@dataclass(frozen=True)
class Bundle:
    header: dict
    payload: bytes


def write(path: str, header: dict, payload: bytes) -> dict:
    header = {**header, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
        f.write(payload)
    os.replace(tmp, path)
    return header


def read(path: str, payload: bool = True) -> Bundle:
    try:
        with open(path, "rb") as f:
            if f.readline() != MAGIC:
                raise BundleError(f"{path} is not a cachemgr bundle (made by `cachemgr export`)")
            try:
                header = json.loads(f.readline())
            except ValueError:
                raise BundleError(f"bundle {path}: header is not JSON (truncated file?)") from None
            data = f.read() if payload else b""
    except FileNotFoundError:
        raise NotFound(f"bundle {path} does not exist") from None
    except OSError as e:
        raise BundleError(f"cannot read bundle {path}: {e.strerror}") from None
    if payload:
        if len(data) != header.get("bytes") or hashlib.sha256(data).hexdigest() != header.get("sha256"):
            raise BundleError(f"bundle {path}: payload does not match its header (truncated or corrupt)")
    return Bundle(header, data)


def mismatches(header: dict, host: dict) -> list[str]:
    """Why this host cannot use the bundle; empty when it can. `host` is worker.host_info()."""
    out = []
    if header.get("torch") != host.get("torch"):
        out.append(f"torch {header.get('torch')} (this host: {host.get('torch')})")
    if header.get("gpu_arch"):
        if header.get("triton") != host.get("triton"):
            out.append(f"Triton {header.get('triton')} (this host: {host.get('triton') or 'not installed'})")
        missing = sorted(set(header["gpu_arch"]) - set(host.get("gpu_arch") or []))
        if missing:
            have = ", ".join(host.get("gpu_arch") or []) or "no GPU"
            out.append(f"GPU architecture {', '.join(missing)} (this host: {have})")
    return out


def refuse_message(path: str, header: dict, host: dict) -> str | None:
    bad = mismatches(header, host)
    if not bad:
        return None
    return (f"bundle {path} was built for {'; '.join(bad)}: refusing to import it, its entries could only miss "
            "(export a bundle on a host with this image and GPU, or run `cachemgr prewarm` here)")
