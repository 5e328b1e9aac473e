"""What a scan found, and the checks before one. Light: no SQLAlchemy, so the quick rescan of
an unchanged tree (`store.rescan_unchanged`) can answer without it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from cachemgr.errors import CacheDirError

if TYPE_CHECKING:
    from cachemgr.index.pending import ParseResult


@dataclass(frozen=True)
class ScanResult:
    """What a scan did, as counts (a first scan of a million files lists no million keys)."""

    root: str
    added: int = 0
    changed: int = 0
    removed: int = 0
    unchanged: int = 0
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) of entries parsed now (capped)
    seconds: float = 0.0
    unreadable: list[str] = field(default_factory=list)  # directories not listed: their entries kept as they were
    pending: int = 0  # entries indexed from their names, not read yet (scan phase two)
    parsed: int = 0  # entries read in this scan (phase two, and the autotune results a first fill's walk read)
    new_keys: list[str] = field(default_factory=list)  # graph and AOT entries added or changed (capped)
    mounted: list[str] = field(default_factory=list)  # mount points inside the cache: not walked (not the cache's)

    def with_parsed(self, p: ParseResult) -> ScanResult:
        """This result after phase two read `p.parsed` pending entries."""
        return replace(
            self,
            corrupt=p.corrupt,
            parsed=self.parsed + p.parsed,
            pending=max(0, self.pending - p.parsed),
            seconds=self.seconds + p.seconds,
        )

    def as_dict(self) -> dict:
        return {
            "root": self.root,
            "added": self.added,
            "changed": self.changed,
            "removed": self.removed,
            "unchanged": self.unchanged,
            "parsed": self.parsed,
            "pending": self.pending,
            "corrupt": [{"key": k, "reason": r} for k, r in self.corrupt],
            "unreadable": self.unreadable,
            "mounted": self.mounted,
            "seconds": round(self.seconds, 3),
        }


def check_root(root: str) -> None:
    if not os.path.exists(root):
        raise CacheDirError(f"cache directory {root} does not exist (set --cache-dir or TORCHINDUCTOR_CACHE_DIR)")
    if not os.path.isdir(root):
        raise CacheDirError(f"cache directory {root} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise CacheDirError(f"cache directory {root} is not readable by this user")
