"""Prometheus exposition for the daemon (opt-in: `metrics = "127.0.0.1:9464"`).

The activity figures are read from the index at scrape time (the events since the daemon started,
counted by `cachemgr.explain.activity`: the one definition of compile, recompile, loaded and hit
that `stats` and `explain --summary` print), so every path that indexes an entry — a watched
batch, a burst rescan, the periodic full scan — feeds the same counters. Sizes by kind come from
the Store's totals. Eviction figures come from the eviction job's results.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from cachemgr import explain
from cachemgr.index.store import Store

if TYPE_CHECKING:
    from cachemgr.index.db import Database

log = logging.getLogger("cachemgr.metrics")

COMPILE_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))


# prometheus_client's own server keeps a thread, and a descriptor, per connection for as long as
# the client likes: 1,100 idle connections took the daemon past its 1,024 descriptors (no batch
# applied, no directory watched). Here a connection is served for REQUEST_SECONDS at most (a
# byte every few seconds keeps no slot), and past MAX_CONNECTIONS at once a new one is closed
# unanswered.
REQUEST_SECONDS = 10
MAX_CONNECTIONS = 32


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_SECONDS  # (each read and write; the connection's whole time: _Server)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # (a scrape a line in the daemon's log: no)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # (busy: closed, the scraper tries again next interval)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        deadline = threading.Timer(REQUEST_SECONDS, _hang_up, (request,))
        deadline.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            deadline.cancel()
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # (a client that hung up, or was hung up on: one debug line, not a traceback on stderr)
        log.debug("metrics: a connection from %s failed: %s", client_address, sys.exc_info()[1])


def _hang_up(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already


def _server(host: str, port: int, app: Any) -> _Server:
    """A WSGI server for `app` on host:port (IPv4 or IPv6, as the host's address is)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": family})
    server: _Server = make_server(host, port, app, server_class, _Handler)
    return server


class Metrics:
    """The daemon's figures, exposed by a collector on a private registry."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Store | None = None
        self.last_event_id = 0
        self.since = time.time()  # a compile event is of a file written since: an old file parsed late is none
        self.hits = self.compiles = self.recompilations = self.loaded = 0
        self.compile_counts = [0] * len(COMPILE_BUCKETS)
        self.compile_sum = 0.0
        self.eviction_runs = self.evicted_entries = self.freed_bytes = 0
        self.last_eviction: float | None = None
        self.scan_seconds: float | None = None
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.server: Any = None

    # -- wiring ------------------------------------------------------------------------------------

    def watch(self, db: Database, cache_id: int) -> None:
        """Read figures from this index from now on (events before now are not counted)."""
        store = Store.of_id(db, cache_id)
        last = store.last_event_id()
        with self.lock:
            self.store, self.last_event_id, self.since = store, last, time.time()

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self.server = _server(host.strip("[]"), int(port), make_wsgi_app(self.registry))
        threading.Thread(target=self.server.serve_forever, name="cachemgr-metrics", daemon=True).start()
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

    def _read_events(self, store: Store) -> None:
        """Count the events since the last scrape, as `stats` counts them."""
        upto = store.last_event_id()
        if upto <= self.last_event_id:
            return
        act = explain.activity(store, after_id=self.last_event_id, upto_id=upto, since=self.since)
        self.hits += act.hits
        self.compiles += act.compiles
        self.recompilations += act.recompiles
        self.loaded += act.loaded
        for seconds in act.compile_times:
            self.compile_sum += seconds
            self.compile_counts[next(i for i, b in enumerate(COMPILE_BUCKETS) if seconds <= b)] += 1
        self.last_event_id = upto

    def collect(self):
        sizes = {}
        with self.lock:
            if self.store is not None:
                try:
                    self._read_events(self.store)
                    sizes = self.store.totals().by_kind
                except Exception as e:  # noqa: BLE001 - a scrape must answer even if the index does not
                    log.warning("metrics: index unavailable: %s", e)
            yield CounterMetricFamily("cachemgr_cache_hits", "Cache hits seen (reads of fxgraph entries)", self.hits)
            yield CounterMetricFamily(
                "cachemgr_compiles", "New fxgraph entries (cache misses that compiled)", self.compiles
            )
            yield CounterMetricFamily(
                "cachemgr_loaded", "New fxgraph entries loaded (cachemgr import, a copy), not compiled", self.loaded
            )
            total = self.hits + self.compiles
            yield GaugeMetricFamily(
                "cachemgr_cache_hit_ratio",
                "hits / (hits + compiles) since the daemon started",
                self.hits / total if total else float("nan"),
            )
            yield CounterMetricFamily(
                "cachemgr_recompilations",
                "Compiles of a graph compiled before in another form (explain's recompile and guards verdicts)",
                self.recompilations,
            )
            cum, buckets = 0, []
            for bound, n in zip(COMPILE_BUCKETS, self.compile_counts, strict=True):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            yield HistogramMetricFamily(
                "cachemgr_compile_seconds", "Compile time of new entries", buckets=buckets, sum_value=self.compile_sum
            )
            b = GaugeMetricFamily("cachemgr_bytes", "Indexed bytes by entry kind", labels=["kind"])
            n = GaugeMetricFamily("cachemgr_entries", "Indexed entries by kind", labels=["kind"])
            for kind, usage in sizes.items():
                if usage.entries:
                    b.add_metric([kind], usage.bytes)
                    n.add_metric([kind], usage.entries)
            yield b
            yield n
            yield CounterMetricFamily("cachemgr_eviction_runs", "Eviction runs", self.eviction_runs)
            yield CounterMetricFamily("cachemgr_evicted_entries", "Entries evicted", self.evicted_entries)
            yield CounterMetricFamily("cachemgr_freed_bytes", "Bytes freed by eviction", self.freed_bytes)
            if self.last_eviction is not None:
                yield GaugeMetricFamily(
                    "cachemgr_last_eviction_timestamp_seconds", "When eviction last ran", self.last_eviction
                )
            if self.scan_seconds is not None:
                yield GaugeMetricFamily(
                    "cachemgr_scan_duration_seconds", "Duration of the last full scan", self.scan_seconds
                )
