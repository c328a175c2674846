"""The figures: each function measures one thing on the real stack and emits its `Figure`s.

Every figure gets its own topics, consumer group and Redis key prefix (named after the run's tag)
and undoes them when it ends; worker processes are always stopped (see `infra.Cleanup`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import multiprocessing
import os
import queue
import random
import resource
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from kafka import KafkaProducer
from redis import Redis as SyncRedis

from bench import infra, workload
from bench.infra import Procs
from bench.profiling import summarize
from bench.stats import Figure, Target, extrapolate, rate, summary
from deploy.harness import Cleanup, Proc, Stack, group_members, read_topic, wait_for
from deploy.host import CpuMeter, PySpy, others_cpu, redis_cpu_seconds
from deploy.metrics import histogram_bucket, histogram_quantile, parse_counter, parse_histogram
from processors.replay import replay
from producers.kafka_log import KafkaEventLog, ProducerConfig
from producers.settings import Settings
from producers.topics import delete_topics
from projections.indexes import ceil_ms
from projections.keys import Keys
from projections.redis_client import async_client
from projections.redis_store import (
    COMMIT_SCRIPT,
    READ_SCRIPT,
    RedisProjectionStore,
    commit_call,
    grouped,
    read_groups,
)
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Folded, Position, Record
from session_model.signing import TrustedKeys

TARGETS = {
    "producer": Target(">=", 12_000),
    "projector_per_worker": Target(">=", 15_000),
    "projector_vs_naive": Target(">=", 10),
    "two_vs_one": Target(">=", 1.7),
    "e2e_p99": Target("<=", 40),
    "replay": Target(">=", 25_000),
    "expiry_p99": Target("<=", 10),
    "memory": Target("<=", 0.5),
}
GIB = 1024**3
MAX_BUCKET_WIDTH_MS = 5.0  # expiry: widest histogram bucket whose interpolation is reported
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
    e2e_poll_s: float = 0.002
    expiry_deadlines: int = 10_000
    expiry_spread_s: float = 5.0
    # The same again while other sessions' events arrive at this rate (0: not measured).
    expiry_load_per_s: int = 12_000
    memory_sessions: int = 100_000

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
            memory_sessions=25_000,
        )


@dataclass
class Run:
    """What every figure needs: the stack, names, sizes, cleanup, output."""

    stack: Stack
    tag: str
    sizes: Sizes
    cleanup: Cleanup  # this figure's (undone when it ends)
    root: Cleanup  # the run's (the pre-filled topic outlives one figure)
    procs: Procs
    log: Callable[[str], None]
    emit: Callable[[Figure], None]
    profile_dir: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # --set: Settings fields for all
    prefill: Prefill | None = None
    results: dict[str, Figure] = field(default_factory=dict)

    def settings(self, name: str, **changes: Any) -> Settings:
        """The product's default settings (plus `--set`) with this figure's own names."""
        return infra.figure_settings(self.stack, self.tag, name, **{**self.overrides, **changes})

    def redis(self) -> redis.Redis:
        """A synchronous client (closed at cleanup)."""
        client = redis.Redis.from_url(self.stack.redis_url)
        self.cleanup.push("close redis client", client.close)
        return client

    def kafka_pids(self) -> dict[str, int]:
        return {"kafka": self.stack.kafka_pid} if self.stack.kafka_pid else {}

    def cpu(self, pids: dict[str, int], client: SyncRedis | None = None) -> CpuMeter:
        """A CPU meter over these processes, the broker, Redis, the harness and the machine."""
        quiet = {self.stack.redis_pid} if self.stack.redis_pid else set()
        return CpuMeter({**pids, **self.kafka_pids()}, client, quiet)

    def put(self, figure: Figure) -> Figure:
        others = others_cpu(figure.params)
        if others >= DISTURBED_PCT:
            figure.params["disturbed"] = (
                f"other processes used {others:.0f}% of a core while this was measured"
            )
        if self.overrides:
            figure.params["settings_overrides"] = {k: str(v) for k, v in self.overrides.items()}
        self.results[figure.figure] = figure
        self.emit(figure)
        return figure


@dataclass
class Prefill:
    """The pre-filled events topic shared by the projector and replay figures."""

    settings: Settings
    events: list[Event]
    sessions: int
    record_bytes: float


def folded_count(client: redis.Redis, prefix: str) -> int:
    """The `folded` counter of a key prefix (every event the projector folded)."""
    raw = client.hget(Keys(prefix).stat("events"), "folded")
    return int(raw) if raw is not None else 0


# -- producer ------------------------------------------------------------------------------------


def _produce_all(log: KafkaEventLog, events: Sequence[Event]) -> float:
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


def ensure_prefill(run: Run) -> Prefill:
    """The pre-filled topic (made by the producer figure, or here untimed if it did not run)."""
    if run.prefill is None:
        run.log("pre-filling the projector topic (untimed: the producer figure did not run)")
        prefill = _make_prefill(run)
        with KafkaEventLog(run.stack.kafka_bootstrap, prefill.settings.events_topic) as log:
            _produce_all(log, prefill.events)
    return run.prefill  # type: ignore[return-value]


def _make_prefill(run: Run) -> Prefill:
    s = run.sizes
    settings = run.settings("prefill")
    infra.create_topics(settings, run.root)
    t = time.perf_counter()
    work = workload.sessions_workload(
        s.prefill_sessions, f"p{run.tag}", s.concurrency, partitions=settings.partitions
    )
    codec = EventCodec()
    sample = work.events[:: max(len(work.events) // 2000, 1)]
    record_bytes = sum(len(codec.encode(e)) for e in sample) / len(sample)
    run.log(
        f"generated {len(work.events)} events of {s.prefill_sessions} sessions "
        f"in {time.perf_counter() - t:.1f}s"
    )
    run.prefill = Prefill(settings, work.events, s.prefill_sessions, record_bytes)
    return run.prefill


def producer(run: Run) -> None:
    """KafkaEventLog events/s (acks=all, idempotent, keyed) vs a naive `send().get()` loop."""
    prefill = _make_prefill(run)
    events = prefill.events
    config = ProducerConfig()
    cpu = run.cpu({})
    with KafkaEventLog(run.stack.kafka_bootstrap, prefill.settings.events_topic) as log:
        cpu.start()
        elapsed = _produce_all(log, events)
        usage = cpu.stop()
    produced = len(events) - 1
    run.log(f"producer: {produced} events in {elapsed:.2f}s")

    # The baseline: the obvious loop, one acknowledged keyed send at a time (same Avro encoding).
    naive_settings = run.settings("naiveprod")
    infra.create_topics(naive_settings, run.cleanup)
    codec = EventCodec()
    n = min(run.sizes.naive_producer_events, len(events) - 1)
    kp = KafkaProducer(bootstrap_servers=run.stack.kafka_bootstrap.split(","), acks="all")
    try:
        first = events[0]
        kp.send(
            naive_settings.events_topic, key=first.session_id.encode(), value=codec.encode(first)
        ).get(timeout=30)
        started = time.perf_counter()
        for e in events[1 : n + 1]:
            kp.send(
                naive_settings.events_topic, key=e.session_id.encode(), value=codec.encode(e)
            ).get(timeout=30)
        naive_elapsed = time.perf_counter() - started
    finally:
        kp.close(timeout=10)
    naive_rate = rate(n, naive_elapsed)
    run.log(f"naive producer: {n} events in {naive_elapsed:.2f}s")
    run.put(
        Figure(
            "producer_events_per_s",
            rate(produced, elapsed),
            "events/s",
            baseline=naive_rate,
            target=TARGETS["producer"],
            params={
                "processes": 1,
                "events": produced,
                "sessions": prefill.sessions,
                "mean_record_bytes": prefill.record_bytes,
                "seconds": elapsed,
                "api": "KafkaEventLog.send per event, then flush (timed: encode + send + all acks)",
                "acks": "all",
                "idempotence": True,
                "keyed": True,
                "linger_ms": config.linger_ms,
                "batch_size": config.batch_size,
                "compression": config.compression_type,
                "partitions": prefill.settings.partitions,
                "baseline": "kafka-python KafkaProducer(acks=all), keyed send(...).get() per event",
                "baseline_events": n,
                "baseline_seconds": naive_elapsed,
                **usage,
            },
        )
    )


# -- projector -----------------------------------------------------------------------------------


@dataclass
class ProjectorRun:
    """What one projector measurement saw."""

    total_rate: float | None
    per_process: float | None
    params: dict[str, Any]
    profile: str | None = None


def _watch_group(
    *,
    bootstrap: str,
    group: str,
    topic: str,
    members: int,
    stop: threading.Event,
    out: dict[str, Any],
) -> None:
    while not stop.is_set():
        try:
            state, assigned = group_members(bootstrap, group, topic)
        except Exception:  # the group may not exist yet
            state, assigned = "", {}
        if state == "Stable" and len(assigned) == members and all(assigned.values()):
            out["stable_at"] = time.monotonic()
            out["assignment"] = sorted(len(p) for p in assigned.values())
            return
        stop.wait(0.2)


def measure_projector(
    run: Run,
    name: str,
    workers: int,
    *,
    module: str = "milpa_sessions.cli",
    window_s: float | None = None,
    profile: bool = False,
) -> ProjectorRun:
    """Start `workers` processes on a fresh group over the pre-filled topic; time the fold.

    The clock runs from the first poll that sees the `folded` counter move to the first poll that
    sees it reach the topic's record count (polled every 20 ms); with several workers it starts
    at the first poll that sees it move after the group is stable with every worker owning
    partitions, so the rebalance when the second worker joins is not counted (and the restart in
    the new assignment is timed like the 1-worker run's start). With `window_s` (the naive
    baseline) it stops after that many seconds instead and reports the rate over the window.
    """
    prefill = ensure_prefill(run)
    total = len(prefill.events)
    settings = replace(
        run.settings(name),
        events_topic=prefill.settings.events_topic,
        scheduler_enabled=True,
    )
    client = run.redis()
    with run.cleanup.scope() as scope:
        scope.push(
            f"delete topics of {name}",
            lambda: delete_topics(settings, [settings.decisions_topic, settings.deadletter_topic]),
        )
        infra.register_prefix(settings, scope)
        procs = Procs(scope, run.procs.workdir)
        started = [procs.start(f"{name}-{i}", settings, module=module) for i in range(workers)]
        group: dict[str, Any] = {}
        stop_watch = threading.Event()
        watcher = None
        if workers > 1:
            watcher = threading.Thread(
                target=_watch_group,
                kwargs={
                    "bootstrap": run.stack.kafka_bootstrap,
                    "group": settings.consumer_group,
                    "topic": settings.events_topic,
                    "members": workers,
                    "stop": stop_watch,
                    "out": group,
                },
                daemon=True,
            )
            watcher.start()
            scope.push("stop the group watcher", stop_watch.set)
        pids = {f"worker{i}": p.pid for i, p in enumerate(started)}
        cpu = run.cpu(pids, client)
        spy: PySpy | None = None
        poll = 0.02
        launch = time.monotonic()
        timeout = 60 + total / 1000
        first: tuple[float, int] | None = None
        window_start: tuple[float, int] | None = None
        stable_n: int | None = None
        at_90: tuple[float, int] | None = None
        last: tuple[float, int] = (launch, 0)
        stalled_since = launch
        while True:
            now = time.monotonic()
            n = folded_count(client, settings.redis_prefix)
            if n > last[1]:
                stalled_since = now
            last = (now, n)
            if first is None and n > 0:
                first = (now, n)
                run.log(f"{name}: first events folded {now - launch:.1f}s after launch")
                if profile:
                    spy = _start_profile(run, name, started[0].pid)
            if window_start is None and first is not None:
                if workers == 1:
                    window_start = first
                    cpu.start()
                elif "stable_at" in group:
                    # As the 1-worker run: from the first events folded, here in the new
                    # assignment (fetch positions, cold caches and all start from there).
                    stable_n = n if stable_n is None else stable_n
                    if n > stable_n:
                        window_start = (now, n)
                        cpu.start()
            if at_90 is None and n >= 0.9 * total:
                at_90 = (now, n)
            if n >= total:
                break
            if (
                window_s is not None
                and window_start is not None
                and now - window_start[0] >= window_s
            ):
                break
            for p in started:
                if not p.alive():
                    raise RuntimeError(f"{p.name} died\n{p.log(4000)}")
            if now - launch > timeout or now - stalled_since > 30:
                raise TimeoutError(
                    f"{name}: {n} of {total} events folded after {now - launch:.0f}s"
                    + "".join(f"\n--- {p.name}\n{p.log(1500)}" for p in started)
                )
            time.sleep(poll)
        usage = cpu.stop() if window_start is not None else {}
        profile_text = _profile_summary(run, name, spy)
        worker_metrics = _scrape(started)
    assert window_start is not None and first is not None
    end_t, end_n = last
    seconds = end_t - window_start[0]
    counted = end_n - window_start[1]
    total_rate = rate(counted, seconds)
    params: dict[str, Any] = {
        "workers": workers,
        "events_in_topic": total,
        "sessions": prefill.sessions,
        "concurrent_sessions": run.sizes.concurrency,
        "sessions_per_partition": "equal (ids picked by the murmur2 partitioner)",
        "partitions": settings.partitions,
        "events_timed": counted,
        "seconds": seconds,
        "total_events_per_s": total_rate,
        "poll_interval_s": poll,
        "startup_s": first[0] - launch,
        "batch_max_records": settings.batch_max_records,
        "scheduler_enabled": settings.scheduler_enabled,
        **usage,
        **worker_metrics,
    }
    if at_90 is not None and at_90[0] > window_start[0]:
        # Without the tail, where workers whose partitions are drained wait for the others.
        params["events_per_s_to_90pct"] = rate(
            at_90[1] - window_start[1], at_90[0] - window_start[0]
        )
    if workers > 1:
        params["timed_from"] = (
            "first events folded after the group is stable with every worker owning partitions"
        )
        params["folded_before_stable"] = window_start[1]
        params["partitions_per_worker"] = group.get("assignment")
    else:
        params["timed_from"] = "first folded event"
    if window_s is not None:
        params["window_s"] = window_s
    return ProjectorRun(
        total_rate, None if total_rate is None else total_rate / workers, params, profile_text
    )


def _start_profile(run: Run, name: str, pid: int) -> PySpy | None:
    """py-spy `pid` into the profile directory, if profiling was asked for."""
    if run.profile_dir is None:
        return None
    spy = PySpy.start(pid, run.profile_dir / f"{name}.raw.txt")
    if spy is None:
        run.log("--profile: py-spy not found (pip install py-spy)")
    else:
        run.cleanup.push(f"stop py-spy of {name}", functools.partial(spy.stop))
    return spy


def _profile_summary(run: Run, name: str, spy: PySpy | None) -> str | None:
    """Stop py-spy, write and log the summary of where the time went."""
    if spy is None or run.profile_dir is None:
        return None
    raw = spy.stop()
    if raw is None:
        run.log(f"py-spy wrote nothing for {name}: see {spy.log}")
        return None
    text = summarize(raw.read_text()).render()
    (run.profile_dir / f"{name}.summary.txt").write_text(text + "\n")
    run.log(f"profile of {name} (also in {run.profile_dir}/{name}.summary.txt):\n{text}")
    return text


def _scrape(procs: Sequence[Proc]) -> dict[str, Any]:
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


def _median_run(runs: Sequence[ProjectorRun]) -> ProjectorRun:
    """The run with the median total rate (the lower of the middle two), every round's in params."""
    done = sorted((r for r in runs if r.total_rate is not None), key=lambda r: r.total_rate or 0)
    if not done:
        return runs[0]
    chosen = done[(len(done) - 1) // 2]
    totals = [r.total_rate for r in runs]
    return replace(chosen, params={**chosen.params, "rounds_total_events_per_s": totals})


def projector(run: Run) -> None:
    """Events/s per worker process with 1 and 2 workers, the naive baseline, the Redis ceiling.

    The 1-worker and 2-worker runs alternate `projector_rounds` times and each figure is the
    median round: on this shared two-core VM one worker's CPU per event moved by up to 18 %
    between runs minutes apart (35.5–41.9 µs), which a single pair turned into a two-vs-one ratio
    anywhere from 1.58× to 1.86× for the same code.
    """
    ceiling = redis_ceiling(run)
    naive = measure_projector(
        run, "naive", 1, module="bench.naive_projector", window_s=run.sizes.naive_projector_window_s
    )
    run.log(f"naive projector: {naive.total_rate:.0f} events/s")
    ones: list[ProjectorRun] = []
    twos: list[ProjectorRun] = []
    for i in range(run.sizes.projector_rounds):
        profile = i == 0 and run.profile_dir is not None
        ones.append(measure_projector(run, f"proj1r{i}", 1, profile=profile))
        run.log(f"projector, 1 worker, round {i + 1}: {ones[-1].total_rate:.0f} events/s")
        twos.append(measure_projector(run, f"proj2r{i}", 2))
        run.log(f"projector, 2 workers, round {i + 1}: {twos[-1].total_rate:.0f} events/s")
    one, two = _median_run(ones), _median_run(twos)
    run.log(f"projector, medians: 1 worker {one.total_rate:.0f}, 2 workers {two.total_rate:.0f}")

    naive_params = {f"naive_{k}": v for k, v in naive.params.items() if k in _NAIVE_KEYS}
    run.put(
        Figure(
            "projector_events_per_s_per_worker_1w",
            one.per_process,
            "events/s",
            baseline=naive.per_process,
            target=TARGETS["projector_per_worker"],
            params={
                **one.params,
                "baseline": "bench/naive_projector.py: commit script per event, awaited",
                **naive_params,
                "redis_ceiling_events_per_s": ceiling,
                "share_of_redis_ceiling": None
                if ceiling in (None, 0) or one.total_rate is None
                else one.total_rate / ceiling,
                "profiled": one.profile is not None,
            },
        )
    )
    run.put(
        Figure(
            "projector_vs_naive_ratio",
            None
            if naive.per_process in (None, 0) or one.per_process is None
            else one.per_process / naive.per_process,
            "×",
            target=TARGETS["projector_vs_naive"],
            params={"worker": one.per_process, "naive": naive.per_process},
        )
    )
    run.put(
        Figure(
            "projector_events_per_s_per_worker_2w",
            two.per_process,
            "events/s",
            baseline=one.per_process,
            target=TARGETS["projector_per_worker"],
            params=two.params,
        )
    )
    run.put(
        Figure(
            "projector_events_per_s_total_2w",
            two.total_rate,
            "events/s",
            baseline=one.total_rate,
            params={"workers": 2, "baseline": "the same with 1 worker (total events/s)"},
        )
    )
    run.put(
        Figure(
            "projector_two_vs_one_ratio",
            None
            if one.total_rate in (None, 0) or two.total_rate is None
            else two.total_rate / one.total_rate,
            "×",
            target=TARGETS["two_vs_one"],
            params={
                "one_worker_total": one.total_rate,
                "two_workers_total": two.total_rate,
                "of": "median 2-worker total / median 1-worker total",
                "rounds_ratio": [
                    None
                    if o.total_rate in (None, 0) or t.total_rate is None
                    else round(t.total_rate / o.total_rate, 3)
                    for o, t in zip(ones, twos, strict=True)
                ],
            },
        )
    )
    run.put(
        Figure(
            "projector_naive_events_per_s",
            naive.per_process,
            "events/s",
            params=naive.params,
        )
    )


_NAIVE_KEYS = {"events_timed", "seconds", "window_s", "worker0_cpu_pct", "redis_cpu_pct"}


def redis_ceiling(run: Run) -> float | None:
    """Same-run ceiling of the worker's Redis pattern without Kafka: events/s it can commit.

    The first `ceiling_events` records of the pre-filled topic are folded and their commit
    arguments built ahead (untimed), batched as the worker batches them (up to
    `batch_max_records` consecutive records of one partition). Timed: per batch, one pipelined
    round trip of READ scripts (64 sessions per call) for the sessions first seen (as the worker's
    cache misses on a fresh prefix) and one of COMMIT scripts (one call per 64 sessions of the
    batch, as the worker makes them), on `redis.asyncio` like the worker — so client-side command
    packing is included, fold and argument building are not.
    """
    prefill = ensure_prefill(run)
    settings = run.settings("ceiling")
    infra.register_prefix(settings, run.cleanup)
    keys = Keys(settings.redis_prefix)
    events = prefill.events[: run.sizes.ceiling_events]
    partitions = settings.partitions
    per_partition: dict[int, list[Record]] = collections.defaultdict(list)
    for e in events:
        p = partition_for(e.session_id, partitions)
        per_partition[p].append(Record(e, Position(p, len(per_partition[p]))))
    size = settings.batch_max_records
    chunks = [
        per_partition[p][i : i + size]
        for i in range(0, max(len(v) for v in per_partition.values()), size)
        for p in sorted(per_partition)
        if per_partition[p][i : i + size]
    ]
    folder = BatchFolder()
    cache: dict[str, Folded] = {}
    batches: list[tuple[list[str], list[tuple[list[str], list[Any]]], list[str], int]] = []
    t = time.perf_counter()
    for chunk in chunks:
        misses = list(
            dict.fromkeys(r.event.session_id for r in chunk if r.event.session_id not in cache)
        )
        updates = folder.fold(cache, chunk)
        calls = [commit_call(keys, u, settings.compactor_max_turns) for u in updates]
        for u in updates:
            cache[u.session_id] = Folded(u.state, u.mark)
        batches.append(
            (misses, calls, [u.session_id for u in updates], sum(len(u.steps) for u in updates))
        )
    prepared = time.perf_counter() - t
    folded = sum(b[3] for b in batches)

    sync = run.redis()

    async def commit_all() -> tuple[float, float]:
        client = async_client(run.stack.redis_url)  # the worker's client (hiredis packing)
        try:
            read_sha = await client.script_load(READ_SCRIPT)
            commit_sha = await client.script_load(COMMIT_SCRIPT)
            cpu0 = redis_cpu_seconds(sync)
            started = time.perf_counter()
            for misses, calls, _, _ in batches:
                if misses:
                    pipe = client.pipeline(transaction=False)
                    for ks in read_groups(keys, misses):
                        pipe.evalsha(read_sha, len(ks), *ks, "1")
                    await pipe.execute()
                pipe = client.pipeline(transaction=False)
                for ks, args in grouped(calls):
                    pipe.evalsha(commit_sha, len(ks), *ks, *args)
                replies = await pipe.execute()
                if any(r != 1 for group in replies for r in group):
                    raise RuntimeError("a ceiling commit was refused (mark conflict)")
            elapsed = time.perf_counter() - started
            cpu1 = redis_cpu_seconds(sync)
            return elapsed, (cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else math.nan
        finally:
            await client.aclose()

    cpu = run.cpu({})
    cpu.start()
    elapsed, redis_cpu = asyncio.run(commit_all())
    usage = cpu.stop()
    ceiling = rate(folded, elapsed)
    run.log(f"redis ceiling: {folded} events in {elapsed:.2f}s (prepared in {prepared:.1f}s)")
    n_calls = sum(len(b[1]) for b in batches)
    run.put(
        Figure(
            "redis_ceiling_events_per_s",
            ceiling,
            "events/s",
            params={
                "what": "the worker's Redis pattern alone: per batch one pipeline of READ scripts "
                "(cache misses) and one of COMMIT scripts, 64 sessions per call each, "
                "redis.asyncio, one connection",
                "events": folded,
                "batches": len(batches),
                "commit_calls": n_calls,
                "events_per_commit_call": folded / n_calls if n_calls else None,
                "seconds": elapsed,
                "redis_cpu_pct": 100 * redis_cpu / elapsed if elapsed else None,
                **usage,
            },
        )
    )
    return ceiling


# -- replay --------------------------------------------------------------------------------------


def rebuild(run: Run) -> None:
    """`processors.replay.replay` of the pre-filled topic into a fresh prefix: events/s.

    With the product's default, the partitions are rebuilt in forked processes (one per CPU,
    since the harness runs no other thread then); their CPU is measured apart (they are this
    process's children). Under `--profile` it rebuilds in this process, the one py-spy samples.
    """
    prefill = ensure_prefill(run)
    settings = run.settings("replay")
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    store = RedisProjectionStore(client, Keys(settings.redis_prefix))
    cpu = run.cpu({}, client)
    spy = _start_profile(run, "replay", os.getpid())
    processes = 1 if spy is not None else None
    threads = threading.active_count()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.start()
    started = time.perf_counter()
    report = replay(
        run.stack.kafka_bootstrap,
        prefill.settings.events_topic,
        store,
        TrustedKeys.none(),
        processes=processes,
    )
    elapsed = time.perf_counter() - started
    usage = cpu.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_s = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    _profile_summary(run, "replay", spy)
    folded = folded_count(client, settings.redis_prefix)
    run.log(f"replay: {report.records} records in {elapsed:.2f}s")
    harness_s = (usage.get("harness_cpu_pct") or 0.0) * elapsed / 100
    run.put(
        Figure(
            "rebuild_events_per_s",
            rate(report.records, elapsed),
            "events/s",
            target=TARGETS["replay"],
            params={
                "records": report.records,
                "folded": folded,
                "sessions": report.applied_sessions,
                "seconds": elapsed,
                "what": "processors.replay.replay(...) called in the harness process (which forks "
                "the rebuild processes), timed from the call (consumer connect included) to its "
                "return",
                "processes": "default (one per CPU)" if processes is None else processes,
                "harness_threads_at_call": threads,
                "rebuild_processes_cpu_pct": round(100 * children_s / elapsed, 1),
                "cpu_us_per_event": round((harness_s + children_s) / report.records * 1e6, 1)
                if report.records
                else None,
                "profiled": spy is not None,
                **usage,
            },
        )
    )


# -- end-to-end latency ----------------------------------------------------------------------------


# The marks of many sessions in one command (cheaper for the poller than a pipeline of HGETs).
_MARKS_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'mark') or '' end
return out
"""


def _paced(
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


def poll_marks(url: str, prefix: str, interval: float, acked: Any, results: Any) -> None:
    """The e2e poller (its own process): time from send and from ack to the mark being visible.

    Reads `(session, offset, sent, acked)` items from `acked` until a None, polls every
    `interval` seconds the marks of the sessions with a pending event (one Lua call), and puts
    `(send times, ms from send, ms from ack, polls)` on `results` once nothing is pending (or
    after 30 s).
    """
    client = redis.Redis.from_url(url)
    marks_of = client.register_script(_MARKS_SCRIPT)
    marks_of(keys=[])  # loads the script
    keys = Keys(prefix)
    results.put("ready")
    pending: dict[str, collections.deque[tuple[int, float, float]]] = {}
    sent_at: list[float] = []
    from_send: list[float] = []
    from_ack: list[float] = []
    polls = 0
    done_at: float | None = None
    try:
        while True:
            t0 = time.perf_counter()
            while True:
                try:
                    item = acked.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    done_at = t0
                    continue
                sid, offset, sent, ack = item
                pending.setdefault(sid, collections.deque()).append((offset, sent, ack))
            if pending:
                sids = list(pending)
                marks = marks_of(keys=[keys.session(sid).state for sid in sids])
                seen = time.perf_counter()
                polls += 1
                for sid, raw in zip(sids, marks, strict=True):
                    if not raw:
                        continue
                    mark = int(raw.split(b":", 1)[1])
                    waiting = pending[sid]
                    while waiting and waiting[0][0] <= mark:
                        _, sent, ack = waiting.popleft()
                        sent_at.append(sent)
                        from_send.append((seen - sent) * 1000)
                        from_ack.append((seen - ack) * 1000)
                    if not waiting:
                        del pending[sid]
            if done_at is not None and (not pending or t0 - done_at > 30):
                break
            time.sleep(max(interval - (time.perf_counter() - t0), 0))
    finally:
        client.close()
    results.put((sent_at, from_send, from_ack, polls))


def _end_process(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)


def e2e(run: Run) -> None:
    """Produce at a fixed rate with a worker running; time produce → mark visible in Redis."""
    s = run.sizes
    settings = run.settings("e2e")
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    total = int(s.e2e_rate * (s.e2e_warmup_s + s.e2e_seconds))
    sessions = math.ceil(total / 19) + 1
    work = workload.sessions_workload(sessions, f"e{run.tag}", concurrency=max(sessions // 5, 50))
    events = work.events[:total]
    client = run.redis()
    worker = run.procs.start("e2e-0", settings)
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push("close e2e producer", lambda: log.close(timeout=5))
    warm = workload.starts([f"e{run.tag}-warmup"])[0]
    log.append(warm)
    wait_for(
        lambda: folded_count(client, settings.redis_prefix) >= 1,
        90,
        "e2e worker ready",
        0.05,
        [worker],
    )
    # Warm-up at the same rate (every path: decisions, scheduler, caches), then wait until it is
    # all visible, so a start-up stall cannot leak into the measured seconds.
    n_warm = int(s.e2e_rate * s.e2e_warmup_s)
    warm_events, measured_events = events[:n_warm], events[n_warm:]
    t_warm = time.perf_counter()
    _paced(log, warm_events, s.e2e_rate)
    log.flush(timeout=30)
    wait_for(
        lambda: folded_count(client, settings.redis_prefix) >= 1 + n_warm,
        60,
        "e2e warm-up visible",
        0.01,
        [worker],
    )
    warmup_visible_after_s = time.perf_counter() - t_warm

    # The poller runs in a process of its own (spawned): the producer's threads in this one would
    # otherwise delay its timestamps through the GIL. Both use time.perf_counter (CLOCK_MONOTONIC,
    # one clock for the whole machine).
    ctx = multiprocessing.get_context("spawn")
    acked: Any = ctx.Queue()
    results: Any = ctx.Queue()
    poll = s.e2e_poll_s
    poller = ctx.Process(
        target=poll_marks,
        args=(run.stack.redis_url, settings.redis_prefix, poll, acked, results),
        daemon=True,
    )
    poller.start()
    run.cleanup.push("stop the e2e poller", lambda: _end_process(poller))
    try:
        ready = results.get(timeout=60)
    except queue.Empty:
        ready = None
    if ready != "ready":
        raise RuntimeError("the e2e poller did not start")
    ack_times: list[float] = []

    def on_ack(sid: str, sent: float, metadata: Any) -> None:
        now = time.perf_counter()
        ack_times.append(now - sent)
        acked.put((sid, metadata.offset, sent, now))

    cpu = run.cpu({"worker0": worker.pid, "poller": poller.pid or 0}, client)
    cpu.start()
    started = time.perf_counter()
    produced_in, behind = _paced(log, measured_events, s.e2e_rate, on_ack)
    log.flush(timeout=30)
    usage = cpu.stop()
    acked.put(None)  # no more: the poller drains what is pending (30 s at most) and reports
    try:
        sent_at, latencies_send, latencies_ack, polls = results.get(timeout=45)
    except queue.Empty:
        raise RuntimeError(f"the e2e poller reported nothing\n{worker.log(4000)}") from None
    poller.join(timeout=10)
    if not worker.alive():
        raise RuntimeError(f"the e2e worker died\n{worker.log(4000)}")
    worker.stop()
    send = summary(latencies_send)
    ack = summary(latencies_ack)
    by_second: dict[int, list[float]] = collections.defaultdict(list)
    for t, latency in zip(sent_at, latencies_send, strict=True):
        by_second[int(t - started)].append(latency)
    per_second = [
        [second, len(v), summary(v)["p50"], summary(v)["p99"], max(v)]
        for second, v in sorted(by_second.items())
    ]
    produce = summary([a * 1000 for a in ack_times])
    common = {
        "rate_events_per_s": s.e2e_rate,
        "seconds": s.e2e_seconds,
        "produced_in_s": produced_in,
        "warmup_s": s.e2e_warmup_s,
        "warmup_all_visible_after_s": warmup_visible_after_s,
        "events": len(measured_events),
        "measured": len(latencies_send),
        "unresolved": len(measured_events) - len(latencies_send),
        "sends_late_over_5ms": behind,
        "workers": 1,
        "poll_interval_ms": poll * 1000,
        "resolution": "the marks of every session with a pending event are read every "
        "poll_interval_ms (one Lua call: HGET mark per session); a sample is the reply time of "
        "the first poll that saw it, so each can be late by up to one poll interval plus one "
        "Redis round trip",
        "measured_from": "the KafkaEventLog.send call (a pending entry is polled from its ack on)",
        "polls": polls,
        "poller": "a separate process (one Lua call per poll reading every pending session's mark)",
        "from_ack_ms": ack,
        "produce_ack_ms": produce,
        "batch_max_records": settings.batch_max_records,
        "linger_ms": ProducerConfig().linger_ms,
        "per_second": per_second,
        "per_second_columns": ["second", "events", "p50_ms", "p99_ms", "max_ms"],
        **usage,
    }
    run.log(f"e2e: p50 {send['p50']} ms, p99 {send['p99']} ms, max {send['max']} ms")
    run.put(Figure("e2e_latency_p50_ms", send["p50"], "ms", params=common))
    run.put(
        Figure(
            "e2e_latency_p99_ms",
            send["p99"],
            "ms",
            target=TARGETS["e2e_p99"],
            params={"from_ack_p99_ms": ack["p99"], "see": "e2e_latency_p50_ms params"},
        )
    )
    run.put(Figure("e2e_latency_max_ms", send["max"], "ms", params={"from_ack_max_ms": ack["max"]}))


# -- expiry lateness -------------------------------------------------------------------------------


def expiry(run: Run) -> None:
    """10k answer windows closing over ~5 s with a worker folding them: how late the closings are.

    Twice: with the scheduler inside the worker (the default deployment: the figure with the
    target) and, as its baseline, in a process of its own (`milpa-sessions scheduler`).
    """
    alone = _expiry_run(run, standalone=True)
    inside = _expiry_run(run, standalone=False)
    run.log(f"expiry lateness: in the worker p99 {inside['p99']} ms, standalone {alone['p99']} ms")
    if run.sizes.expiry_load_per_s:
        _expiry_loaded(run)
    run.put(Figure("expiry_lateness_p50_ms", inside["p50"], "ms", params=inside["params"]))
    run.put(
        Figure(
            "expiry_lateness_p99_ms",
            inside["p99"],
            "ms",
            baseline=alone["p99"],
            target=TARGETS["expiry_p99"],
            params={
                "scheduler": "inside the worker (MILPA_SCHEDULER_ENABLED=true, the default)",
                "baseline": "the same with the scheduler as a process of its own (see "
                "expiry_lateness_standalone_p50_ms)",
                "value_source": inside["params"]["value_source"]["p99"],
                "from_topic_p99_ms": inside["params"]["from_topic_ms"]["p99"],
                "see": "expiry_lateness_p50_ms",
            },
        )
    )
    run.put(Figure("expiry_lateness_standalone_p50_ms", alone["p50"], "ms", params=alone["params"]))
    run.put(
        Figure(
            "expiry_lateness_standalone_p99_ms",
            alone["p99"],
            "ms",
            params={
                "scheduler": "standalone process (milpa-sessions scheduler; workers with "
                "MILPA_SCHEDULER_ENABLED=false)",
                "value_source": alone["params"]["value_source"]["p99"],
                "from_topic_p99_ms": alone["params"]["from_topic_ms"]["p99"],
                "see": "expiry_lateness_standalone_p50_ms",
            },
        )
    )


def _expiry_loaded(run: Run) -> None:
    """Expiry lateness while the worker also folds other sessions' events (not a target).

    The scheduler in the worker shares its event loop with folding; a deadline falling due while a
    batch is decoded and folded waits for it. Standalone, the scheduler only shares the cores.
    """
    inside = _expiry_run(run, standalone=False, load=True)
    alone = _expiry_run(run, standalone=True, load=True)
    rate = run.sizes.expiry_load_per_s
    run.log(
        f"expiry lateness under {rate} events/s of load: in the worker p99 {inside['p99']} ms, "
        f"standalone {alone['p99']} ms"
    )
    run.put(
        Figure(
            "expiry_lateness_loaded_p99_ms",
            inside["p99"],
            "ms",
            baseline=alone["p99"],
            params={
                "scheduler": "inside the worker",
                "baseline": "the same with the scheduler as a process of its own",
                "load": f"{rate} events/s of other sessions (the projector workload) sent "
                "through the same topic from 1 s before the first deadline to the last",
                "p50_ms": inside["p50"],
                "standalone_p50_ms": alone["p50"],
                "in_worker": inside["params"],
                "standalone": alone["params"],
            },
        )
    )


def _load(
    run: Run, settings: Settings, events: Sequence[Event], start_at: float, per_second: int
) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that sends `events` at `per_second` from `start_at` (time.time()) on."""
    out: dict[str, Any] = {}
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)

    def send() -> None:
        try:
            time.sleep(max(0.0, start_at - time.time()))
            seconds, behind = _paced(log, events, per_second)
            log.flush(timeout=60)
            out.update(sent=len(events), seconds=seconds, late_sends=behind)
            out["events_per_s"] = rate(len(events), seconds)
        finally:
            log.close(timeout=5)

    thread = threading.Thread(target=send, name="expiry-load", daemon=True)
    thread.start()
    return thread, out


def _expiry_run(run: Run, *, standalone: bool, load: bool = False) -> dict[str, Any]:
    s = run.sizes
    name = ("expiry" if standalone else "expiryw") + ("l" if load else "")
    settings = run.settings(name, scheduler_enabled=not standalone)
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    n = s.expiry_deadlines
    sids = [f"{name[-1]}{run.tag}-{i:06d}" for i in range(n)]
    worker = run.procs.start(f"{name}-0", settings)
    # The process whose metrics hold the lateness histogram: the scheduler's own, or the worker.
    measured = (
        run.procs.start(f"{name}-scheduler", settings, command="scheduler")
        if standalone
        else worker
    )
    watched = [worker, measured] if standalone else [worker]
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push("close expiry producer", lambda: log.close(timeout=5))

    # Phase 1: the sessions start (no deadlines); tells when the worker is up and how fast it folds.
    starts = workload.starts(sids)
    for e in starts:
        log.send(e)
    log.flush(timeout=60)
    wait_for(
        lambda: folded_count(client, settings.redis_prefix) > 0,
        90,
        "expiry: worker up",
        0.02,
        watched,
    )
    t1, n1 = time.monotonic(), folded_count(client, settings.redis_prefix)
    wait_for(
        lambda: folded_count(client, settings.redis_prefix) >= n,
        120,
        "expiry: starts folded",
        0.02,
        watched,
    )
    fold_rate = (n - n1) / max(time.monotonic() - t1, 0.1)

    extra: list[Event] = []
    if load:  # generated now, untimed: 19 events per session of the projector's workload
        wanted = int(s.expiry_load_per_s * (s.expiry_spread_s + 1.0))
        extra = workload.sessions_workload(wanted // 19 + 1, f"{name}{run.tag}").events[:wanted]

    # Phase 2: one question each, deadlines evenly spread over `spread` seconds, far enough out
    # that every question is folded (and scheduled) before the first deadline.
    lead = max(3.0, 3 * n / fold_rate)
    first_deadline_ms = int((time.time() + lead) * 1000)
    spread_ms = int(s.expiry_spread_s * 1000)
    deadlines = [first_deadline_ms + spread_ms * i // max(n - 1, 1) for i in range(n)]
    order = list(range(n))
    random.Random(7).shuffle(order)  # arrival order is not deadline order
    asked = workload.questions([sids[i] for i in order], [deadlines[i] for i in order])
    deadline_of = {sids[i]: deadlines[i] for i in range(n)}
    for e in asked:
        log.send(e)
    log.flush(timeout=60)
    wait_for(
        lambda: folded_count(client, settings.redis_prefix) >= 2 * n,
        120,
        "expiry: questions folded",
        0.02,
        watched,
    )
    folded_at_ms = time.time() * 1000
    margin_ms = first_deadline_ms - folded_at_ms
    run.log(f"expiry: {n} questions folded {margin_ms:.0f} ms before the first deadline")
    loader: tuple[threading.Thread, dict[str, Any]] | None = None
    if load:
        # From 1 s before the first deadline to the last one, other sessions' events keep the
        # worker folding.
        loader = _load(run, settings, extra, first_deadline_ms / 1000 - 1.0, s.expiry_load_per_s)

    def closings() -> float:
        text = measured.metrics()
        return parse_counter(text, "milpa_scheduler_closings") or 0.0

    spy = _start_profile(run, name, measured.pid)
    pids = {"worker0": worker.pid}
    if standalone:
        pids["scheduler"] = measured.pid
    cpu = run.cpu(pids, client)
    cpu.start()
    wait_s = (deadlines[-1] / 1000 - time.time()) + 60
    wait_for(lambda: closings() >= n, wait_s, "expiry: every window closed", 0.25, watched)
    usage = cpu.stop()
    load_params: dict[str, Any] = {}
    if loader is not None:
        loader[0].join(timeout=120)
        load_params = {**loader[1], **_scrape([worker])}
    closed_after_last_deadline_s = time.time() - deadlines[-1] / 1000
    _profile_summary(run, name, spy)
    text = measured.metrics()
    buckets = parse_histogram(text, "milpa_expiry_lateness_ms")
    count = parse_counter(text, "milpa_expiry_lateness_ms_count")
    total_ms = parse_counter(text, "milpa_expiry_lateness_ms_sum")
    for p in watched:
        p.stop()

    # Cross-check from the log: the closing record's CreateTime (ms) minus its deadline (ms).
    closed = _closings(run.stack.kafka_bootstrap, settings.events_topic, deadline_of)
    topic_summary = summary([float(sent - due) for due, _, sent in closed])
    # Where the lateness comes from: the tick starting late, or the tick's own work before sending;
    # and how it moves along the 5 s of deadlines (per quarter second of deadline).
    tick_late = summary([float(at - due) for due, at, _ in closed])
    tick_to_send = summary([float(sent - at) for _, at, sent in closed])
    slices: dict[int, list[float]] = collections.defaultdict(list)
    for due, _, sent in closed:
        slices[(due - first_deadline_ms) // 250].append(float(sent - due))
    along = [
        [k * 250, len(v), summary(v)["p50"], summary(v)["p90"], max(v)]
        for k, v in sorted(slices.items())
    ]
    chosen: dict[str, str] = {}

    def quantile(q: float, key: str) -> float | None:
        # The histogram decides where it is fine-grained (buckets up to 5 ms wide: around the
        # 10 ms target); in its wide buckets (up to seconds) the ms-precise topic value is used.
        bucket = histogram_bucket(q, buckets)
        if bucket is not None and bucket[1] - bucket[0] <= MAX_BUCKET_WIDTH_MS:
            chosen[key] = f"histogram (bucket {bucket[0]:g}..{bucket[1]:g} ms)"
            return histogram_quantile(q, buckets)
        where = (
            "" if bucket is None else f" (its bucket {bucket[0]:g}..{bucket[1]:g} ms is too wide)"
        )
        chosen[key] = f"topic{where}"
        return topic_summary[key]

    p50 = quantile(0.5, "p50")
    p99 = quantile(0.99, "p99")
    params = {
        "deadlines": n,
        "profiled": spy is not None,
        "spread_s": s.expiry_spread_s,
        "lead_s": lead,
        "questions_folded_before_first_deadline_ms": margin_ms,
        "closings": count,
        "mean_ms": None if not count else (total_ms or 0) / count,
        "scheduler": "standalone process" if standalone else "inside the worker",
        "source": "the scheduler's Prometheus histogram milpa_expiry_lateness_ms (time.time() "
        "after the closing's produce was acknowledged minus the deadline), interpolated linearly "
        "inside its bucket, when that bucket is at most 5 ms wide (bounds 1,2,5,7.5,10,15,20,30,"
        "50,100,... ms); otherwise from_topic (see value_source)",
        "buckets": [[le if math.isfinite(le) else "+Inf", c] for le, c in buckets],
        "value_source": chosen,
        "from_topic_ms": topic_summary,
        "from_topic": "closing record CreateTime (ms, set when the scheduler sent it) minus the "
        "deadline (ms): both whole milliseconds, so ±1 ms",
        "all_closed_s_after_last_deadline": closed_after_last_deadline_s,
        "tick_started_late_ms": tick_late,
        "tick_to_send_ms": tick_to_send,
        "breakdown": "from_topic = tick_started_late (the closing's `at`, the scheduler's clock "
        "when its tick began, minus the deadline) + tick_to_send (CreateTime minus `at`)",
        "along_the_deadlines": along,
        "along_the_deadlines_columns": [
            "deadline offset ms",
            "closings",
            "p50_ms",
            "p90_ms",
            "max_ms",
        ],
        "cpu_while_closing": usage,
    }
    if load:
        params["load"] = load_params
    run.log(f"expiry lateness ({params['scheduler']}): p50 ≈ {p50} ms, p99 ≈ {p99} ms")
    return {"p50": p50, "p99": p99, "params": params}


def _closings(
    bootstrap: str, topic: str, deadline_of: dict[str, int]
) -> list[tuple[int, int, int]]:
    """(deadline ms, the closing's `at` ms = the scheduler's tick time, CreateTime ms) each."""
    codec = EventCodec()
    out: list[tuple[int, int, int]] = []
    for m in read_topic(bootstrap, topic):
        event = codec.decode(m.value)
        if event.type == ev.ANSWER_WINDOW_CLOSED and event.session_id in deadline_of:
            at = event.payload.get("at")
            at_ms = ceil_ms(at) if isinstance(at, datetime) else m.timestamp
            out.append((deadline_of[event.session_id], at_ms, m.timestamp))
    return out


# -- memory ----------------------------------------------------------------------------------------


def memory(run: Run) -> None:
    """Redis memory of idle sessions through the real commit path, extrapolated to 1M sessions."""
    n = run.sizes.memory_sessions
    settings = run.settings("memory")
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    keys = Keys(settings.redis_prefix)
    store = RedisProjectionStore(client, keys, compact_after=settings.compactor_max_turns)
    work = workload.idle_sessions(n, f"m{run.tag}")
    per_session = len(work.events) // n
    folder = BatchFolder()
    partitions = settings.partitions
    offsets = dict.fromkeys(range(partitions), 0)
    records = []
    for e in work.events:
        p = partition_for(e.session_id, partitions)
        records.append(Record(e, Position(p, offsets[p])))
        offsets[p] += 1
    time.sleep(0.2)
    before = int(client.info("memory")["used_memory"])
    size = 3 * 500  # 500 sessions per commit, each with its three events
    for i in range(0, len(records), size):
        result = store.commit(folder.fold({}, records[i : i + size]))
        if result.conflicts:
            raise RuntimeError("memory fill: a commit was refused")
    time.sleep(0.2)
    after = int(client.info("memory")["used_memory"])
    delta = after - before

    # Cross-check: MEMORY USAGE of every key under the prefix, by kind of key.
    by_kind: dict[str, int] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    batch: list[bytes] = []

    def flush() -> None:
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.memory_usage(k, samples=0)
        for k, used in zip(batch, pipe.execute(), strict=True):
            kind = _key_kind(k.decode(), settings.redis_prefix)
            by_kind[kind] += int(used or 0)
            counts[kind] += 1
        batch.clear()

    for k in client.scan_iter(match=keys.pattern(), count=5000):
        batch.append(k)
        if len(batch) >= 5000:
            flush()
    if batch:
        flush()
    key_sum = sum(by_kind.values())
    # What a sample of the state hashes hold (the layout: projections/redis_store.py).
    from projections.codec import STATE_VERSION  # noqa: PLC0415 - only here
    from projections.redis_store import stored_sizes  # noqa: PLC0415 - only this figure uses it

    sample = work.sessions[:: max(n // 200, 1)]
    pipe = client.pipeline(transaction=False)
    for sid in sample:
        pipe.hgetall(keys.session(sid).state)
        pipe.object("encoding", keys.session(sid).state)
    replies = pipe.execute()
    held = [stored_sizes(r) for r in replies[0::2] if r]
    encodings = collections.Counter(e.decode() for e in replies[1::2] if e)
    entries = sum(h.get("timeline_entries", 0) for h in held)

    def mean(name: str) -> float | None:
        return sum(h[name] for h in held) / len(held) if held else None

    value = extrapolate(delta, n, 1_000_000) / GIB
    run.log(f"memory: {delta / n:.0f} B/session (used_memory), {key_sum / n:.0f} B/session (keys)")
    run.put(
        Figure(
            "redis_gib_per_1m_idle_sessions",
            value,
            "GiB",
            target=TARGETS["memory"],
            params={
                "sessions_measured": n,
                "events_per_session": per_session,
                "session": "started + plan_set + todo_changed (no turns, no open question)",
                "session_id_chars": len(work.sessions[0]),
                "key_name_chars": len(keys.session(work.sessions[0]).state),
                "excluding_turns": "no turn was written: no session has a turns list "
                f"({counts.get('turns', 0)} turns keys found)",
                "method": "INFO memory used_memory after − before the fill, / sessions × 1M",
                "used_memory_delta_bytes": delta,
                "bytes_per_session": delta / n,
                "key_memory_usage_bytes_per_session": key_sum / n,
                "key_memory_usage_gib_per_1m": extrapolate(key_sum, n, 1_000_000) / GIB,
                "bytes_per_session_by_key": {k: v / n for k, v in sorted(by_kind.items())},
                "layout": f"{STATE_VERSION}: one state hash per session holding state, event ids "
                "and timeline in chunks (projections/redis_store.py)",
                "state_hash_encodings": dict(sorted(encodings.items())),
                "state_hash_fields_mean": mean("fields"),
                "state_bytes_mean": mean("state"),
                "event_ids_bytes_mean": mean("event_ids"),
                "timeline_bytes_mean": mean("timeline"),
                "timeline_entry_bytes_mean": (sum(h["timeline"] for h in held) - entries) / entries
                if entries
                else None,
                "keys_by_kind": dict(sorted(counts.items())),
                "fill": "RedisProjectionStore.commit of BatchFolder updates (the real commit "
                "script), 500 sessions per pipelined commit, no Kafka",
            },
        )
    )


def _key_kind(key: str, prefix: str) -> str:
    rest = key[len(prefix) + 1 :]
    if rest.startswith("{s:"):
        return rest.rsplit(":", 1)[-1]
    return rest.split(":", 1)[0] if ":" in rest else rest


FIGURES: dict[str, Callable[[Run], None]] = {
    "producer": producer,
    "projector": projector,
    "replay": rebuild,
    "e2e": e2e,
    "expiry": expiry,
    "memory": memory,
}
