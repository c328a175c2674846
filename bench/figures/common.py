"""What the figures share: the run (stack, names, sizes, cleanup, output), the pre-filled topic,
the targets, and the steps several figures take (produce, pace, wait for the fold, profile)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import redis
from redis import Redis as SyncRedis

from bench import infra, workload
from bench.profiling import summarize
from bench.stats import Figure, Target
from deploy.harness import Cleanup, Proc, Stack, redis_roles, wait_for
from deploy.host import CpuMeter, PySpy, others_cpu, unaccounted_cpu, worst_unaccounted
from deploy.metrics import (
    histogram_between,
    histogram_bucket,
    histogram_quantile,
    parse_counter,
)
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.analytics import Analytics
from projections.keys import Keys
from projections.redis_client import SyncClient
from schemas.codec import EventCodec
from schemas.events import Event

# Every target that depends on the machine's speed is a ratio to a reference measured in the same
# run (#15): a figure's own baseline (`of_ratio`), or a ratio figure. Bytes are absolute.
TARGETS = {
    "producer": Target(">=", 10, of_ratio=True),  # vs the naive send().get() producer
    "projector_vs_naive": Target(">=", 13),
    "two_vs_one": Target(">=", 1.8),
    "e2e_vs_ack": Target("<=", 2),
    "projector_vs_consume": Target(">=", 0.6),
    "replay": Target(">=", 0.6, of_ratio=True),  # vs the calibrations around it (the pure fold)
    "expiry_p99": Target("<=", 1.2, of_ratio=True),  # vs the standalone scheduler, same run
    "expiry_loaded_vs_ack": Target("<=", 1),
    "expiry_loaded_vs_unloaded": Target("<=", 1.2),
    "memory": Target("<=", 0.5),
    "long_session_cost": Target("<=", 1.3),  # µs/event at 100k events / at 100 (#15)
    "long_session_bytes": Target("<=", 16_384),  # an old session outside its history (#15)
    "inbox_p99": Target("<=", 20, of_ratio=True),  # vs one plain ZRANGE round trip
    "live_p99": Target("<=", 2, of_ratio=True),  # vs reading the questions topic directly
    "projector_vs_peer": Target(">=", 1.5),
    "projector_long_vs_short": Target("<=", 1.3),  # short-session / long-session events/s (#15)
    "rebuild_snapshots": Target(">=", 5),  # full rebuild's seconds / from snapshots' (#15)
    # --topology cluster (#16), each against the same run's single-node figure (PERFORMANCE.md,
    # "Single node and cluster"): one worker's events/s on 3 brokers + a Redis Cluster, the same
    # with WAIT 1 against it without, a master's CPU per event against the one Redis's, and the
    # e2e p99.
    "projector_cluster": Target(">=", 0.8, of_ratio=True),
    "projector_cluster_wait": Target(">=", 0.9, of_ratio=True),
    "redis_master_per_event": Target("<=", 1.25, of_ratio=True),
    "e2e_cluster": Target("<=", 1.5, of_ratio=True),
}
# What `--topology cluster` runs the projector and e2e figures on, beside the single node (the
# figures' params say so): `deploy/stack.py up --brokers 3 --redis-cluster`.
CLUSTER_TOPOLOGY = "3 brokers (RF 3, min.insync.replicas 2) + Redis Cluster (3 masters, 3 replicas)"
# The servers' keys of a CPU report (`Run.cpu`), and how long they are measured at rest.
SERVER_CPU = ("kafka_cpu_pct", "redis_cpu_pct", "redis_masters_cpu_pct", "redis_replicas_cpu_pct")
REST_S = 2.0
# Before each figure the harness waits (at most `--settle-max-s`) until every server uses under
# this share of a core over a second (at rest: broker ~3 %, Redis < 1 %): what the figure before
# left them to do (a deleted topic's segments) is not the next figure's to pay (PERFORMANCE.md).
SETTLE_LIMIT_PCT = 12.0
SETTLE_SAMPLE_S = 1.0
# Before each round of a figure measured in rounds, the same wait, at most this long.
ROUND_SETTLE_MAX_S = 20.0
DISTURBED_PCT = 20.0  # other processes' CPU (% of a core) above which a figure is flagged


@dataclass(frozen=True)
class Sizes:
    """How much each figure does: the full run; `quick()` shrinks what takes long."""

    prefill_sessions: int = 20_000  # x 19 events: the producer, projector and replay topic
    concurrency: int = 1_000  # sessions live at once in that stream
    naive_producer_events: int = 3_000
    naive_projector_window_s: float = 15.0
    # 1-worker and 2-worker runs alternate this many times; the figures are the medians.
    projector_rounds: int = 3
    ceiling_events: int = 60_000
    e2e_seconds: float = 10.0
    e2e_warmup_s: float = 2.0
    e2e_rate: int = 1_000
    # Below saturation (`paced`): one worker at each rate, with and without fetch_min_bytes.
    paced_rates: tuple[int, ...] = (300, 1_000)
    paced_seconds: float = 15.0
    e2e_sweep_s: float = 0.1  # the e2e watcher reads every pending mark this often too
    e2e_head_s: float = 2.0  # the window's first seconds, reported apart
    e2e_rounds: int = 3  # measured this many times on topics of their own; the median round
    expiry_deadlines: int = 10_000
    expiry_spread_s: float = 5.0
    # The same again while other sessions' events arrive at this rate (0: not measured).
    expiry_load_per_s: int = 12_000
    # The worker's idle and loaded expiry runs alternate this many times; the figures are medians.
    expiry_rounds: int = 3
    memory_sessions: int = 100_000
    long_session_events: int = 100_000  # one session grown to this many events (#15)
    inbox_waiting: int = 100_000
    inbox_samples: int = 1_000
    live_questions: int = 2_000
    live_rate: int = 100  # questions asked per second
    peers_events: int = 100_000  # records of the pre-filled topic each peer is timed over (0: all)
    # The projector on long sessions (#15): this many sessions of this many agent events each
    # (plus their compactions), all live at once; short and long runs alternate this many times.
    projector_long_sessions: int = 200
    projector_long_events: int = 5_000
    projector_long_rounds: int = 2
    # The rebuild from snapshots (#15): a topic of this many long sessions of this many events.
    snapshot_rebuild_sessions: int = 400
    snapshot_rebuild_events: int = 5_000
    # The rebuild of the pre-filled topic, with a calibration between rounds; the median round.
    rebuild_rounds: int = 3

    @classmethod
    def full(cls) -> Sizes:
        return cls()

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            prefill_sessions=4_000,
            naive_producer_events=1_000,
            naive_projector_window_s=6.0,
            projector_rounds=1,
            ceiling_events=20_000,
            e2e_seconds=5.0,
            e2e_rounds=1,
            expiry_rounds=1,
            paced_seconds=5.0,
            memory_sessions=25_000,
            long_session_events=20_000,
            inbox_waiting=20_000,
            inbox_samples=300,
            live_questions=500,
            peers_events=15_000,
            projector_long_sessions=40,
            projector_long_events=2_500,
            projector_long_rounds=1,
            snapshot_rebuild_sessions=40,
            snapshot_rebuild_events=2_500,
            rebuild_rounds=1,
        )


@dataclass
class Run:
    """What every figure needs: the stack, names, sizes, cleanup, output."""

    stack: Stack
    tag: str
    sizes: Sizes
    cleanup: Cleanup  # this figure's (undone when it ends)
    root: Cleanup  # the run's (the pre-filled topic outlives one figure)
    workdir: Path  # the workers' working directories and logs
    log: Callable[[str], None]
    emit: Callable[[Figure], None]
    profile_dir: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # --set: Settings fields for all
    prefill: Prefill | None = None
    calibration: float | None = None  # this run's CPU calibration, events/s (the first figure)
    # `--topology cluster`: the other stack of the run (the replicated one, or from the
    # replicated run the single-node one), idle while this one is measured; and whether this
    # run's figures are on the replicated stack (3 brokers, the Redis Cluster: `cluster_run`).
    other_stack: Stack | None = None
    on_cluster: bool = False
    # Every figure emitted so far in the run, by name: the references of later figures.
    results: dict[str, Figure] = field(default_factory=dict)

    def settings(self, name: str, **changes: Any) -> Settings:
        """The product's default settings (plus `--set`) with this figure's own names (on the
        Redis Cluster when this run is on the replicated stack)."""
        trusted = infra.trusted_keys_dir(self.workdir, workload.OPERATOR)
        options = {"trusted_keys_dir": trusted, **self.overrides, **changes}
        return infra.figure_settings(self.stack, self.tag, name, cluster=self.on_cluster, **options)

    def cluster_run(self) -> Run:
        """The same run on the replicated stack (`--topology cluster`): same tag, sizes, output
        and references; its own pre-filled topic."""
        if self.on_cluster or self.other_stack is None:
            raise RuntimeError("no replicated stack in this run (--topology cluster)")
        return replace(
            self, stack=self.other_stack, other_stack=self.stack, on_cluster=True, prefill=None
        )

    def redis(self) -> redis.Redis:
        """A synchronous client of the stack's single Redis (closed at cleanup)."""
        client = redis.Redis.from_url(self.stack.redis_url)
        self.cleanup.push("close redis client", client.close)
        return client

    def store_client(self, settings: Settings) -> SyncClient:
        """A synchronous client of the projections' Redis of `settings` (a cluster client on
        the Redis Cluster; closed at cleanup)."""
        client = settings.redis_sync()
        self.cleanup.push("close redis client", client.close)
        return client

    def start(self, name: str, settings: Settings, **options: Any) -> Proc:
        """A worker process (`infra.start_worker`), stopped when the figure ends."""
        return infra.start_worker(self.cleanup, self.workdir, name, settings, **options)

    def kafka_pids(self) -> dict[str, int]:
        return {"kafka": self.stack.kafka_pid} if self.stack.kafka_pid else {}

    def cpu(self, pids: dict[str, int], client: SyncRedis | None = None) -> CpuMeter:
        """A CPU meter over these processes, the broker(s), Redis, the harness and the machine.

        On the replicated stack: `kafka` is the three brokers, `redis_masters` and
        `redis_replicas` the Redis Cluster's nodes by their role now (`client` is not used);
        with two stacks in the run, `idle_stack` is the other one's servers. The broker(s)' JIT
        and collector seconds are reported too (`kafka_jit_s`, `kafka_gc_s`; None if unknown).
        """
        groups: dict[str, tuple[int, ...]] = {}
        if self.other_stack is not None:
            groups["idle_stack"] = stack_pids(self.other_stack)
        if not self.on_cluster:
            quiet = {self.stack.redis_pid} if self.stack.redis_pid else set()
            jvms: dict[str, tuple[int, ...]] = {k: (p,) for k, p in self.kafka_pids().items()}
            return CpuMeter({**pids, **self.kafka_pids()}, client, quiet, groups, jvms)
        nodes = dict(self.stack.redis_cluster_nodes)
        roles = redis_roles(list(nodes))
        groups["kafka"] = self.stack.kafka_pids
        groups["redis_masters"] = tuple(p for u, p in nodes.items() if roles.get(u) == "master")
        groups["redis_replicas"] = tuple(p for u, p in nodes.items() if roles.get(u) != "master")
        quiet = {self.stack.redis_pid} if self.stack.redis_pid else set()  # idle, beside
        return CpuMeter(pids, None, quiet, groups, {"kafka": self.stack.kafka_pids})

    def servers_at_rest(
        self, seconds: float = REST_S, client: SyncRedis | None = None
    ) -> dict[str, float]:
        """% of a core the stack's servers use (keys of a `CpuMeter` report: the broker(s), Redis
        or its masters and replicas) over `seconds` while nothing is started: what they cost
        beside the events (the figures' `cpu_us_per_event_above_rest` leave it out)."""
        return self._at_rest(seconds, client)[0]

    def _at_rest(
        self, seconds: float, client: SyncRedis | None = None
    ) -> tuple[dict[str, float], float]:
        """`servers_at_rest`, and the % of a core the machine was busy with beyond them and
        this process (other processes, short-lived ones, the kernel's own work)."""
        if client is None and not self.on_cluster:
            client = self.redis()
        meter = self.cpu({}, client)
        meter.start()
        time.sleep(seconds)
        usage = meter.stop()
        servers = {k: float(usage[k]) for k in SERVER_CPU if isinstance(usage.get(k), int | float)}
        return servers, max(0.0, unaccounted_cpu(usage))  # (other processes are inside it)

    def settle(self, max_s: float) -> tuple[float, dict[str, float]]:
        """Wait until each server, and the machine beyond them and the harness, uses under
        `SETTLE_LIMIT_PCT` of a core over a second (the disk writes and deletions an earlier
        figure left, say), at most `max_s`; the seconds waited and the servers' last sample
        (with `beyond_cpu_pct`: the rest of the machine's)."""
        began = time.monotonic()
        client = None if self.on_cluster else self.redis()
        while True:
            sample, beyond = self._at_rest(SETTLE_SAMPLE_S, client)
            waited = time.monotonic() - began
            quiet = beyond < SETTLE_LIMIT_PCT
            if (quiet and all(v < SETTLE_LIMIT_PCT for v in sample.values())) or waited >= max_s:
                return waited, {**sample, "beyond_cpu_pct": round(beyond, 1)}

    def prefilled(self) -> Prefill:
        """The pre-filled topic (made by the producer figure, or here untimed if it did not run)."""
        if self.prefill is None:
            self.log("pre-filling the projector topic (untimed: the producer figure did not run)")
            prefill = self.make_prefill()
            with KafkaEventLog(self.stack.kafka_bootstrap, prefill.settings.events_topic) as log:
                produce_all(log, prefill.events)
            return prefill
        return self.prefill

    def make_prefill(self) -> Prefill:
        """Create the pre-filled topic (kept for the whole run) and generate its events."""
        s = self.sizes
        settings = self.settings("prefill")
        infra.create_topics(settings, self.root)
        t = time.perf_counter()
        work = workload.sessions_workload(
            s.prefill_sessions, f"p{self.tag}", s.concurrency, partitions=settings.partitions
        )
        codec = EventCodec()
        sample = work.events[:: max(len(work.events) // 2000, 1)]
        record_bytes = sum(len(codec.encode(e)) for e in sample) / len(sample)
        self.log(
            f"generated {len(work.events)} events of {s.prefill_sessions} sessions "
            f"in {time.perf_counter() - t:.1f}s"
        )
        self.prefill = Prefill(settings, work.events, s.prefill_sessions, record_bytes)
        return self.prefill

    def start_profile(self, name: str, pid: int) -> PySpy | None:
        """py-spy `pid` into the profile directory, if profiling was asked for."""
        if self.profile_dir is None:
            return None
        spy = PySpy.start(pid, self.profile_dir / f"{name}.raw.txt")
        if spy is None:
            self.log("--profile: py-spy not found (pip install py-spy)")
        else:
            self.cleanup.push(f"stop py-spy of {name}", functools.partial(spy.stop))
        return spy

    def profile_summary(self, name: str, spy: PySpy | None) -> str | None:
        """Stop py-spy, write and log the summary of where the time went."""
        if spy is None or self.profile_dir is None:
            return None
        raw = spy.stop()
        if raw is None:
            self.log(f"py-spy wrote nothing for {name}: see {spy.log}")
            return None
        text = summarize(raw.read_text()).render()
        (self.profile_dir / f"{name}.summary.txt").write_text(text + "\n")
        self.log(f"profile of {name} (also in {self.profile_dir}/{name}.summary.txt):\n{text}")
        return text

    def put(self, name: str, value: float | None, unit: str, **fields: Any) -> Figure:
        """Emit the figure (`Figure`'s fields), flagged if other processes disturbed it."""
        figure = Figure(name, value, unit, **fields)
        others = others_cpu(figure.params)
        unaccounted, of_which = worst_unaccounted(figure.params)
        if others >= DISTURBED_PCT:
            figure.params["disturbed"] = (
                f"other processes used {others:.0f}% of a core while this was measured"
            )
        elif unaccounted >= DISTURBED_PCT:
            parts = (
                f" (of which steal {of_which['steal_cpu_pct']:.0f}%, interrupts and softirqs "
                f"{of_which['irq_softirq_cpu_pct']:.0f}%, the rest short-lived processes or the "
                "kernel)"
                if {"steal_cpu_pct", "irq_softirq_cpu_pct"} <= of_which.keys()
                else " (short-lived processes, steal, the kernel)"
            )
            figure.params["disturbed"] = (
                f"the machine was busy {unaccounted:.0f}% of a core beyond the processes "
                f"measured{parts} while this was measured"
            )
        if self.overrides:
            figure.params["settings_overrides"] = {k: str(v) for k, v in self.overrides.items()}
        if self.on_cluster:
            figure.params["topology"] = CLUSTER_TOPOLOGY
        self.results[name] = figure
        self.emit(figure)
        return figure


def stack_pids(stack: Stack) -> tuple[int, ...]:
    """The PIDs of every server of a stack that deploy/stack.py started (brokers, Redis)."""
    pids = [stack.kafka_pid, *stack.kafka_pids, stack.redis_pid]
    pids += [pid for _, pid in stack.redis_cluster_nodes]
    return tuple(dict.fromkeys(p for p in pids if p))


@dataclass
class Prefill:
    """The pre-filled events topic shared by the projector and replay figures."""

    settings: Settings
    events: list[Event]
    sessions: int
    record_bytes: float


@dataclass(frozen=True)
class FoldCounter:
    """The `folded` counter of a key prefix: every event its workers (`procs`) folded."""

    client: SyncClient
    keys: Keys
    procs: Sequence[Proc] = ()

    def read(self) -> int:
        """Events folded so far."""
        return Analytics(self.client, self.keys).folded()

    def wait(self, count: int, timeout: float, what: str, interval: float) -> None:
        """Wait until `count` events are folded (fail if one of the workers died)."""
        wait_for(lambda: self.read() >= count, timeout, what, interval, self.procs)


def produce_all(log: KafkaEventLog, events: Sequence[Event]) -> float:
    """Send every event (non-blocking) and flush; seconds from the first send to the last ack.

    The first event is sent and acknowledged before the clock starts (metadata, connections).
    """
    log.append(events[0])
    started = time.perf_counter()
    futures = [log.send(e) for e in events[1:]]
    log.flush(timeout=300)
    elapsed = time.perf_counter() - started
    failed = [f for f in futures if f.failed()]
    if failed:
        raise RuntimeError(f"{len(failed)} sends failed, e.g. {failed[0].exception}")
    return elapsed


def paced(
    log: KafkaEventLog,
    events: Sequence[Event],
    per_second: int,
    on_ack: Callable[..., None] | None = None,
) -> tuple[float, int]:
    """Send `events` evenly spaced at `per_second`; seconds taken and sends late by > 5 ms."""
    started = time.perf_counter()
    behind = 0
    for i, e in enumerate(events):
        due = started + i / per_second
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        elif now - due > 0.005:
            behind += 1
        t_send = time.perf_counter()
        future = log.send(e)
        if on_ack is not None:
            future.add_callback(on_ack, e.session_id, t_send)
    return time.perf_counter() - started, behind


def scrape_workers(procs: Sequence[Proc]) -> dict[str, Any]:
    """The workers' record, batch, Redis round-trip and decision counters (their /metrics)."""
    out: dict[str, Any] = {}
    records, batches, trips, decisions = [], [], [], []
    for p in procs:
        try:
            text = p.metrics()
        except OSError:
            continue
        if not text:
            continue
        records.append(parse_counter(text, "milpa_records"))
        batches.append(parse_counter(text, "milpa_batches"))
        trips.append(parse_counter(text, "milpa_redis_round_trips"))
        decisions.append(parse_counter(text, "milpa_decisions_published"))
    if records:
        out["records_per_worker"] = records
        out["batches_per_worker"] = batches
        out["redis_round_trips_per_worker"] = trips
        out["decisions_published_per_worker"] = decisions
        total_batches = sum(b or 0 for b in batches)
        if total_batches:
            out["mean_batch_records"] = sum(r or 0 for r in records) / total_batches
    return out


LAG_HISTOGRAMS = {
    "fetched": "milpa_batch_fetched_lag_ms",
    "visible": "milpa_batch_visible_lag_ms",
}


def lag_between(before: str, after: str) -> dict[str, Any]:
    """The worker's batch lags between two of its expositions: how many batches, p50 and p99
    (interpolated in their buckets, each p99's bucket beside it), per histogram."""
    out: dict[str, Any] = {}
    for what, name in LAG_HISTOGRAMS.items():
        buckets = histogram_between(before, after, name)
        batches = max((count for _, count in buckets), default=0.0)
        out[what] = {
            "batches": int(batches),
            "p50": histogram_quantile(0.5, buckets) if batches else None,
            "p99": histogram_quantile(0.99, buckets) if batches else None,
            "p99_bucket": histogram_bucket(0.99, buckets) if batches else None,
        }
    return out
