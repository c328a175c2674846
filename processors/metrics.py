"""Prometheus metrics of a worker, read from its `WorkerStats`, `SchedulerStats` and
`SnapshotStats` when scraped.

The batch path only bumps the plain counters it already keeps; this collector turns them into
metric families when `/metrics` is scraped (in the HTTP server's thread), so serving metrics adds
no work per event. Histograms are kept in place by the stats (`processors/histogram.py`) and copied
when scraped. The registry is dedicated (never the global
one), so several apps in one process, or tests, do not collide.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from processors.health import Checks, Starting
from processors.histogram import Histogram
from processors.scheduler import SchedulerStats
from processors.snapshots import SnapshotStats
from processors.worker import WorkerStats
from schemas.errors import ConfigurationError
from session_model.intake import CODES

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger(__name__)
K = TypeVar("K")


def consumer_lag(highwaters: Mapping[int, int], last_offsets: Mapping[int, int]) -> dict[int, int]:
    """Records behind per partition: highwater − last processed offset − 1 (never below zero).

    Only partitions with both a known highwater and a processed record are reported.
    """
    return {
        p: max(hw - last_offsets[p] - 1, 0)
        for p, hw in sorted(highwaters.items())
        if p in last_offsets
    }


def _snapshot(counts: Mapping[K, int]) -> list[tuple[K, int]]:
    """A consistent copy of a dict the event loop may be growing concurrently."""
    while True:
        try:
            return sorted(counts.items(), key=lambda kv: str(kv[0]))
        except RuntimeError:  # "dictionary changed size during iteration": copy again
            continue


def histogram_family(name: str, documentation: str, h: Histogram) -> HistogramMetricFamily:
    """The histogram as a metric family (cumulative `le` buckets, `+Inf` last)."""
    counts, total = h.snapshot()
    cumulative: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*h.bounds, float("inf")), counts, strict=True):
        running += n
        cumulative.append((_le(bound), running))
    return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=total)


def _le(bound: float) -> str:
    """A bucket bound as client libraries write `le` (`2.0`, `7.5`, `+Inf`)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _labelled(
    name: str,
    documentation: str,
    label: str,
    counts: Mapping[str, int],
    every: Iterable[str] = (),
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, n in sorted((dict.fromkeys(every, 0) | dict(_snapshot(counts))).items()):
        family.add_metric([key], n)
    return family


class StatsCollector(Collector):
    """Builds the metric families from the live stats objects when scraped."""

    def __init__(
        self,
        worker: Callable[[], WorkerStats | None],
        scheduler: Callable[[], SchedulerStats | None],
        highwaters: Callable[[], Mapping[int, int]],
        snapshots: Callable[[], SnapshotStats | None] = lambda: None,
    ) -> None:
        self._worker = worker
        self._scheduler = scheduler
        self._highwaters = highwaters
        self._snapshots = snapshots
        self._lock = threading.Lock()  # scrapes may run concurrently (threaded HTTP server)

    def collect(self) -> Iterator[Metric]:
        """Every metric, read now."""
        with self._lock:
            yield from self._worker_metrics(self._worker() or WorkerStats())
            yield from self._scheduler_metrics(self._scheduler() or SchedulerStats())
            yield from self._snapshot_metrics(self._snapshots() or SnapshotStats())

    def _worker_metrics(self, w: WorkerStats) -> Iterator[Metric]:
        yield _labelled("milpa_events", "Events folded, by outcome kind.", "outcome", w.outcomes)
        yield _counter(
            "milpa_records",
            "Records consumed from the events topic (counted when their batch is taken, before "
            "its fold and commit count their outcomes in the other counters).",
            w.records,
        )
        yield _counter(
            "milpa_redelivered",
            "Records skipped as already applied (at or below the mark).",
            w.redelivered,
        )
        yield _counter("milpa_batches", "Batches processed.", w.batches)
        yield histogram_family("milpa_batch_size", "Records per batch.", w.batch_sizes)
        yield histogram_family(
            "milpa_batch_fetched_lag_ms",
            "Milliseconds from a batch's oldest record's timestamp (CreateTime: its producer's "
            "send; LogAppendTime: the broker's append) to the worker holding the batch.",
            w.fetched_lag_ms,
        )
        yield histogram_family(
            "milpa_batch_visible_lag_ms",
            "Milliseconds from a batch's oldest record's timestamp (CreateTime: its producer's "
            "send; LogAppendTime: the broker's append) to its commit making it readable in Redis.",
            w.visible_lag_ms,
        )
        yield _counter(
            "milpa_batch_timestamps_ahead",
            "Batches whose oldest record's timestamp was over a second ahead of the worker's "
            "clock (CreateTime: a producer's clock ahead): their lags read 0.",
            w.timestamps_ahead,
        )
        yield _counter("milpa_redis_round_trips", "Redis round trips.", w.redis_round_trips)
        yield _counter(
            "milpa_redis_retries", "Redis calls retried after a failure.", w.redis_retries
        )
        yield _counter(
            "milpa_corrupt_state_reads",
            "Stored states (or a redelivery's decisions histories) found not to decode: their "
            "partitions wait (see the log: replay --session).",
            w.corrupt_reads,
        )
        yield _counter(
            "milpa_rebuilding_state_reads",
            "Sessions read while a replay --session rebuilt them: their partitions wait for it.",
            w.rebuilding_reads,
        )
        yield _counter(
            "milpa_publish_retries",
            "Sends of decisions, question changes or dead letters retried after a failure.",
            w.publish_retries,
        )
        yield _counter(
            "milpa_dead_lettered", "Records sent to the dead-letter topic.", w.dead_lettered
        )
        yield _labelled(
            "milpa_refused",
            "Records dead-lettered, by refusal code (decoder_failed: a decoding bug, not input).",
            "code",
            w.refused,
            every=CODES,  # from the start: an alert sees 0, then 1
        )
        yield _counter("milpa_decisions_published", "Decisions published.", w.decisions)
        yield _counter(
            "milpa_decisions_republished",
            "Decisions published again for redelivered records (subscribers drop repeats).",
            w.decisions_republished,
        )
        yield _counter(
            "milpa_records_cut",
            "Decisions, question changes and dead letters cut to fit a produce request.",
            w.records_cut,
        )
        yield _labelled("milpa_rejections", "Rejected events, by code.", "code", w.rejections)
        yield _labelled("milpa_pauses", "Questions asked, by reason code.", "reason", w.pauses)
        yield _counter(
            "milpa_principal_downgrades", "Verified claims downgraded by the fold.", w.downgrades
        )
        yield _counter(
            "milpa_commit_conflicts", "Commits refused: the mark had moved.", w.conflicts
        )
        yield _counter(
            "milpa_state_reads",
            "Sessions whose state was read from Redis, not held in the worker's cache (new to "
            "this worker, or dropped past MILPA_CACHE_SESSIONS).",
            w.state_reads,
        )
        yield GaugeMetricFamily(
            "milpa_parked_partitions",
            "Partitions parked (see the log): at a record the fold raised on (a bug: their "
            "records wait, uncommitted, for a fixed worker), or of a session whose stored state "
            "cannot be read (damaged, or being rebuilt: they go on once it reads).",
            value=len(w.parked),
        )
        yield GaugeMetricFamily(
            "milpa_cached_sessions",
            "Sessions whose folded state the worker holds (at most MILPA_CACHE_SESSIONS).",
            value=w.cached_sessions,
        )
        lag = GaugeMetricFamily(
            "milpa_consumer_lag",
            "Records behind the highwater, per partition.",
            labels=["partition"],
        )
        for partition, behind in consumer_lag(
            self._highwaters(), dict(_snapshot(w.last_offsets))
        ).items():
            lag.add_metric([str(partition)], behind)
        yield lag

    def _scheduler_metrics(self, s: SchedulerStats) -> Iterator[Metric]:
        yield _counter("milpa_scheduler_closings", "Answer windows closed.", s.closings)
        yield _counter("milpa_scheduler_compactions", "Compactions emitted.", s.compactions)
        yield _counter(
            "milpa_timer_restarts",
            "The worker's timer process started again (it died, or hung: see the next).",
            s.timer_restarts,
        )
        yield _counter(
            "milpa_timer_hangs",
            "Timer processes the worker ended because their heartbeat stopped "
            "(MILPA_SCHEDULER_TIMER_HANG_S).",
            s.timer_hangs,
        )
        yield histogram_family(
            "milpa_expiry_lateness_ms",
            "Milliseconds from a deadline to its closing being emitted.",
            s.lateness,
        )

    def _snapshot_metrics(self, s: SnapshotStats) -> Iterator[Metric]:
        yield _counter("milpa_snapshot_rounds", "Snapshot rounds completed.", s.rounds)
        yield _counter("milpa_snapshots", "Session snapshots published.", s.snapshots)
        yield _counter(
            "milpa_snapshot_bytes", "Bytes of session snapshots (and stubs) published.", s.bytes
        )
        yield _counter(
            "milpa_snapshot_failures",
            "Snapshot rounds that failed (fenced by a newer writer, or Kafka or Redis refused), "
            "tried again at the next interval.",
            s.failures,
        )
        yield _counter(
            "milpa_snapshots_too_large",
            "Sessions left unsnapshotted because their record would exceed the topic's limit "
            "(their partition's checkpoint stays below them).",
            s.too_large,
        )
        yield _counter(
            "milpa_snapshots_half_built",
            "Sessions left unsnapshotted because a `replay --session` of them has not ended "
            "(their partition's checkpoint stays below them: run it again).",
            s.half_built,
        )
        yield _counter(
            "milpa_snapshot_stubs",
            "Snapshots of retired sessions (their projections expired) replaced with stubs.",
            s.stubs,
        )
        lag = GaugeMetricFamily(
            "milpa_snapshot_checkpoint_lag",
            "Offsets applied beyond the partition's last checkpoint (what a rebuild would fold "
            "from the log), as of its last round.",
            labels=["partition"],
        )
        for partition, behind in _snapshot(s.checkpoint_lag):
            lag.add_metric([str(partition)], behind)
        yield lag


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per request (a slow scrape does not hold up a probe); daemon threads."""

    daemon_threads = True


class _Server6(_Server):
    """The same on an IPv6 address."""

    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    """No access log line per scrape or probe."""

    def log_message(self, format: str, *args: Any) -> None:
        """Say nothing."""


def _json(start_response: StartResponse, status: str, body: Mapping[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
    start_response(status, headers)
    return [data]


def endpoints(metrics: WSGIApplication, probe: Checks | None) -> WSGIApplication:
    """`/metrics` (Prometheus text), `/livez` and `/readyz` (JSON; 503 when not so), else 404."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path in {"/livez", "/readyz"} and probe is not None:
            health = probe.check()
            good = health.live if path == "/livez" else health.ready
            status = "200 OK" if good else "503 Service Unavailable"
            return _json(start_response, status, health.as_json())
        return _json(start_response, "404 Not Found", {"error": "not found"})

    return app


class Endpoint:
    """An HTTP server on a daemon thread, whose WSGI app can be replaced while it listens."""

    def __init__(self, app: WSGIApplication, port: int, addr: str = "127.0.0.1") -> None:
        try:
            family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
            kind = _Server6 if family == socket.AF_INET6 else _Server
            server: WSGIServer = make_server(addr, port, app, kind, handler_class=_Quiet)
        except OSError as e:
            raise ConfigurationError(f"cannot serve metrics on {addr}:{port}: {e}") from e
        self.addr = addr
        self.port: int = server.server_port
        self._server: WSGIServer | None = server
        self._thread: threading.Thread | None = threading.Thread(
            target=server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def use(self, app: WSGIApplication) -> None:
        """Answer the next requests with `app`."""
        if self._server is not None:
            self._server.set_app(app)

    def stop(self) -> None:
        """Stop listening (blocks up to the server's poll interval)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _starting_metrics(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    return _json(start_response, "503 Service Unavailable", {"error": "starting"})


def serve_starting(port: int, addr: str, starting: Starting) -> Endpoint:
    """Answer `/livez` and `/readyz` with `starting`'s verdicts (and `/metrics` with 503) on
    `addr:port` until the app's metrics take the endpoint over (`Metrics.serve`)."""
    endpoint = Endpoint(endpoints(_starting_metrics, starting), port, addr)
    log.info("health while starting on http://%s:%d/livez and /readyz", addr, endpoint.port)
    return endpoint


class Metrics:
    """A dedicated registry holding the stats collector, and its HTTP endpoint (with the health
    probe's, when given one)."""

    def __init__(
        self,
        worker: Callable[[], WorkerStats | None],
        scheduler: Callable[[], SchedulerStats | None],
        highwaters: Callable[[], Mapping[int, int]] = dict,
        snapshots: Callable[[], SnapshotStats | None] = lambda: None,
        probe: Checks | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = StatsCollector(worker, scheduler, highwaters, snapshots)
        self.registry.register(self.collector)
        self.probe = probe
        self._endpoint: Endpoint | None = None

    def serve(self, port: int, addr: str = "127.0.0.1", *, endpoint: Endpoint | None = None) -> int:
        """Serve `/metrics` (and `/livez`, `/readyz`) on `addr:port` in a daemon thread, or on
        `endpoint`, already listening there (the start-up's: no request is refused between the
        two); returns the bound port."""
        app = endpoints(make_wsgi_app(self.registry), self.probe)
        if endpoint is None:
            endpoint = Endpoint(app, port, addr)
        else:
            endpoint.use(app)
        self._endpoint = endpoint
        log.info(
            "metrics on http://%s:%d/metrics (health: /livez, /readyz)",
            endpoint.addr,
            endpoint.port,
        )
        return endpoint.port

    def stop(self) -> None:
        """Stop the HTTP endpoint (blocks up to the server's poll interval)."""
        if self._endpoint is not None:
            self._endpoint.stop()
            self._endpoint = None
