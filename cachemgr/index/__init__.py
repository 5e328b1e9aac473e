"""The index: its database (`Database`), the scanner that fills it (`reconcile`) and the one API
everything else reads it through (`Store`).

Names are loaded on first use, so `from cachemgr.index import Store` does not import SQLAlchemy
(the `stats` fast path on the embedded SQLite index runs without it).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_WHERE = {
    "Database": "cachemgr.index.db",
    "reconcile": "cachemgr.index.scan",
    "parse_pending": "cachemgr.index.pending",
    "AmbiguousKey": "cachemgr.index.store",
    "CacheRow": "cachemgr.index.store",
    "CompileEvent": "cachemgr.index.store",
    "Entry": "cachemgr.index.store",
    "Filters": "cachemgr.index.store",
    "GraphEntry": "cachemgr.index.store",
    "Match": "cachemgr.index.store",
    "ModelUsage": "cachemgr.index.store",
    "Pin": "cachemgr.index.store",
    "Store": "cachemgr.index.store",
    "Totals": "cachemgr.index.store",
    "Usage": "cachemgr.index.store",
}

__all__ = [
    "AmbiguousKey",
    "CacheRow",
    "CompileEvent",
    "Database",
    "Entry",
    "Filters",
    "GraphEntry",
    "Match",
    "ModelUsage",
    "Pin",
    "Store",
    "Totals",
    "Usage",
    "parse_pending",
    "reconcile",
]

if TYPE_CHECKING:
    from cachemgr.index.db import Database
    from cachemgr.index.pending import parse_pending
    from cachemgr.index.scan import reconcile
    from cachemgr.index.store import (
        AmbiguousKey,
        CacheRow,
        CompileEvent,
        Entry,
        Filters,
        GraphEntry,
        Match,
        ModelUsage,
        Pin,
        Store,
        Totals,
        Usage,
    )


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
