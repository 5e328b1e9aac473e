"""Kept for the callers not yet moved to `cachemgr.index.Store` (evict.load_rows and
fleet.remote.push_items read through an open SQLAlchemy connection). New code uses the Store."""

from __future__ import annotations

from typing import Any

from cachemgr.index.store import Store


def pin_keys(conn: Any, cache_id: int) -> dict[str, str | None]:
    """Pinned keys (entry keys, graph keys or refs) -> the reason given."""
    return Store.over(conn, cache_id).pin_map()


def pinned_by(m: Any, pins: dict[str, str | None]) -> str | None:
    """The pinned key (the entry's own key, its graph key or its ref) that covers a row, or None."""
    return next((k for k in (m["key"], m["graph_key"], m["ref"]) if k and k in pins), None) if pins else None


def model_graphs(conn: Any, cache_id: int, model: str) -> set[str]:
    return Store.over(conn, cache_id).model_graphs(model)
