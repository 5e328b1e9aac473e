"""What a scan found, and the checks before one. Light: no SQLAlchemy, so the quick rescan of
an unchanged tree (`queries.rescan_fast`) can answer without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cachemgr.errors import CacheDirError


@dataclass(frozen=True)
class ScanResult:
    root: str
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) of new/changed
    seconds: float = 0.0
    unreadable: list[str] = field(default_factory=list)  # directories not listed: their entries kept as they were

    def as_dict(self) -> dict:
        return {
            "root": self.root, "added": len(self.added), "changed": len(self.changed),
            "removed": len(self.removed), "unchanged": self.unchanged,
            "corrupt": [{"key": k, "reason": r} for k, r in self.corrupt], "unreadable": self.unreadable,
            "seconds": round(self.seconds, 3),
        }


def check_root(root: str) -> None:
    if not os.path.exists(root):
        raise CacheDirError(f"cache directory {root} does not exist (set --cache-dir or TORCHINDUCTOR_CACHE_DIR)")
    if not os.path.isdir(root):
        raise CacheDirError(f"cache directory {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CacheDirError(f"cache directory {root} is not readable by this user")
