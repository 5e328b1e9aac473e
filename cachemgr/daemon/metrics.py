"""Prometheus exposition for the daemon (opt-in: `metrics = "127.0.0.1:9464"`).

The activity figures are read from the index's events table at scrape time ('new' and 'hit'
rows since the daemon started), so every path that indexes an entry — a watched batch, a burst
rescan, the periodic full scan — feeds the same counters. Sizes by kind are one GROUP BY per
scrape. Eviction figures come from the eviction job's results.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from sqlalchemy import func, select

from cachemgr.index.models import Entry, Event

log = logging.getLogger("cachemgr.metrics")

COMPILE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
ENTRIES, EVENTS = Entry.__table__, Event.__table__


class Metrics:
    """The daemon's figures, exposed by a collector on a private registry."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.source = None  # (db, cache_id)
        self.last_event_id = 0
        self.hits = self.compiles = self.recompilations = 0
        self.compile_counts = [0] * len(COMPILE_BUCKETS)
        self.compile_sum = 0.0
        self.eviction_runs = self.evicted_entries = self.freed_bytes = 0
        self.last_eviction: float | None = None
        self.scan_seconds: float | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.server = None

    # -- wiring ------------------------------------------------------------------------------------

    def watch(self, db, cache_id: int) -> None:
        """Read figures from this index from now on (events before now are not counted)."""
        with db.engine.connect() as conn:
            last = conn.scalar(select(func.max(EVENTS.c.id)).where(EVENTS.c.cache_id == cache_id)) or 0
        with self.lock:
            self.source, self.last_event_id = (db, cache_id), last

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.server, _thread = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        log.info("metrics on http://%s/metrics", address)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def eviction(self, result: dict) -> None:
        with self.lock:
            self.eviction_runs += 1
            self.evicted_entries += int(result.get("evicted") or 0)
            self.freed_bytes += int(result.get("freed_bytes") or 0)
            self.last_eviction = time.time()

    def scanned(self, seconds: float) -> None:
        self.scan_seconds = seconds

    # -- the collector -------------------------------------------------------------------------

    def _read_events(self, conn, cache_id: int) -> None:
        rows = conn.execute(
            select(EVENTS.c.id, EVENTS.c.kind, EVENTS.c.recompile, EVENTS.c.seconds)
            .where(EVENTS.c.cache_id == cache_id, EVENTS.c.id > self.last_event_id).order_by(EVENTS.c.id))
        for eid, kind, recompile, seconds in rows:
            self.last_event_id = eid
            if kind == "hit":
                self.hits += 1
            elif kind == "new":
                self.compiles += 1
                self.recompilations += int(bool(recompile))
                if seconds is not None:
                    self.compile_sum += seconds
                    self.compile_counts[next(i for i, b in enumerate(COMPILE_BUCKETS) if seconds <= b)] += 1

    def collect(self):
        sizes = []
        with self.lock:
            if self.source is not None:
                db, cache_id = self.source
                try:
                    with db.engine.connect() as conn:
                        self._read_events(conn, cache_id)
                        sizes = conn.execute(select(ENTRIES.c.kind, func.count(), func.sum(ENTRIES.c.bytes))
                                             .where(ENTRIES.c.cache_id == cache_id).group_by(ENTRIES.c.kind)).all()
                except Exception as e:  # noqa: BLE001 - a scrape must answer even if the index does not
                    log.warning("metrics: index unavailable: %s", e)
            yield CounterMetricFamily("cachemgr_cache_hits", "Cache hits seen (reads of fxgraph entries)", self.hits)
            yield CounterMetricFamily("cachemgr_compiles", "New fxgraph entries (cache misses that compiled)",
                                      self.compiles)
            total = self.hits + self.compiles
            yield GaugeMetricFamily("cachemgr_cache_hit_ratio", "hits / (hits + compiles) since the daemon started",
                                    self.hits / total if total else float("nan"))
            yield CounterMetricFamily("cachemgr_recompilations",
                                      "New entries for a graph key already in the index", self.recompilations)
            cum, buckets = 0, []
            for bound, n in zip(COMPILE_BUCKETS, self.compile_counts):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            yield HistogramMetricFamily("cachemgr_compile_seconds", "Compile time of new entries",
                                        buckets=buckets, sum_value=self.compile_sum)
            b = GaugeMetricFamily("cachemgr_bytes", "Indexed bytes by entry kind", labels=["kind"])
            n = GaugeMetricFamily("cachemgr_entries", "Indexed entries by kind", labels=["kind"])
            for kind, count, size in sizes:
                b.add_metric([kind], int(size or 0))
                n.add_metric([kind], count)
            yield b
            yield n
            yield CounterMetricFamily("cachemgr_eviction_runs", "Eviction runs", self.eviction_runs)
            yield CounterMetricFamily("cachemgr_evicted_entries", "Entries evicted", self.evicted_entries)
            yield CounterMetricFamily("cachemgr_freed_bytes", "Bytes freed by eviction", self.freed_bytes)
            if self.last_eviction is not None:
                yield GaugeMetricFamily("cachemgr_last_eviction_timestamp_seconds", "When eviction last ran",
                                        self.last_eviction)
            if self.scan_seconds is not None:
                yield GaugeMetricFamily("cachemgr_scan_duration_seconds", "Duration of the last full scan",
                                        self.scan_seconds)
