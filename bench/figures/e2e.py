"""The end-to-end figures: produce at a fixed rate with a worker running; time until the event's
mark is visible in Redis, seen by a watcher in a process of its own."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import math
import multiprocessing
import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from bench import infra, workload
from bench.figures.calibration import calibrate
from bench.figures.common import (
    ROUND_SETTLE_MAX_S,
    TARGETS,
    FoldCounter,
    Run,
    lag_between,
    paced,
)
from bench.stats import by_slice, median_item, ratio, summary
from deploy.host import cpu_report
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog, ProducerConfig
from projections.keys import Keys
from projections.redis_client import SyncCluster
from projections.requests import Request, execute_async
from schemas.events import Event

# The marks of many sessions of one partition in one command (cheaper for the watcher than a
# pipeline of HGETs). One call per partition: on a Redis Cluster a partition is one hash slot.
_MARKS_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'mark') or '' end
return out
"""
_MARKS_SHA = hashlib.sha1(_MARKS_SCRIPT.encode()).hexdigest()
ACK_DRAIN_S = 0.002  # the watcher takes the acks handed to it at least this often
# Before the measured rounds, throwaway rounds until the broker has stopped compiling: a freshly
# started broker's JIT compiled ~11 s of code in its first ~40 s at this load, and the rounds
# that ran meanwhile were the slowest (PERFORMANCE.md, "What made the first e2e round slow").
WARM_JIT_SHARE = 0.05  # warm: the broker(s) compiled for under 5 % of the round's window
WARM_ROUNDS_MAX = 3


def marks_calls(
    keys: Keys, sessions: Mapping[str, int]
) -> tuple[list[list[str]], list[tuple[Any, ...]]]:
    """The marks script's calls for these sessions (id -> partition): one per partition, so
    each call's keys share a hash slot; the sessions of each call, and the calls (EVALSHA)."""
    groups: dict[int, list[str]] = {}
    for sid, partition in sessions.items():
        groups.setdefault(partition, []).append(sid)
    sids = list(groups.values())
    calls = [
        (
            "EVALSHA",
            _MARKS_SHA,
            len(group),
            *(keys.session(sid, partition).state for sid in group),
        )
        for partition, group in groups.items()
    ]
    return sids, calls


# Keyspace notifications of hash commands ("K": a message on `__keyspace@<db>__:<key>`, "h": for
# HSET and the like): the commit script's write of a session's state hash tells the watcher to
# read that session's mark, so it reads only what changed instead of every pending mark each poll.
NOTIFY_EVENTS = "Kh"
NOTIFY_SETTING = "notify-keyspace-events"


def masters(settings: Settings) -> list[dict[str, Any]]:
    """How to connect to each Redis master of the projections (one on a single Redis).

    Not the product's clients (`settings.redis_async()`, `node_client`): they carry the settings'
    read timeout, and a subscription would fail at the first quiet spell that long.
    """
    client = settings.redis_sync()
    try:
        if isinstance(client, SyncCluster):
            primaries = client.get_primaries()  # type: ignore[no-untyped-call]
            nodes = [node.redis_connection for node in primaries]
        else:
            nodes = [client]
        wanted = ("host", "port", "db", "username", "password")
        return [
            {k: v for k, v in n.connection_pool.connection_kwargs.items() if k in wanted}
            for n in nodes
            if n is not None
        ]
    finally:
        client.close()


def enable_notifications(settings: Settings) -> Callable[[], None]:
    """Turn keyspace notifications of hash commands on, on every master; returns the undo."""
    before: list[tuple[redis.Redis, str]] = []
    for master in masters(settings):
        client = redis.Redis(**master)
        old = str(client.config_get(NOTIFY_SETTING).get(NOTIFY_SETTING, ""))
        client.config_set(NOTIFY_SETTING, "".join(sorted(set(old) | set(NOTIFY_EVENTS))))
        before.append((client, old))

    def undo() -> None:
        for client, old in before:
            client.config_set(NOTIFY_SETTING, old)
            client.close()

    return undo


def watch_marks(settings: Settings, sweep_s: float, acked: Any, results: Any) -> None:
    """The e2e watcher (its own process): time from send and from ack to the mark being visible.

    Reads `(session, partition, offset, sent, acked)` items from `acked` until a None. A session
    with a pending event has its mark read when a keyspace notification says its state hash was
    written (or, if one came after the send but before the ack, as soon as the ack arrives), and
    every `sweep_s` all pending marks are read (a safety net, counted apart). Each read is one
    script call per partition, in one pipelined round trip per Redis master (the product's
    asyncio client and executor). Puts `(send times, ms from send, ms from ack, reads, seconds
    the reads' round trips took, samples the sweeps resolved)` on `results` once nothing is
    pending (or after 30 s).
    """
    asyncio.run(_watch_marks(settings, sweep_s, acked, results))


async def _subscribe(settings: Settings, keys: Keys) -> list[Any]:
    """A pattern subscription to the state hashes' notifications on every master."""
    pattern = f"__keyspace@*__:{keys.state_pattern()}"
    subscriptions = []
    for master in masters(settings):
        pubsub = aioredis.Redis(**master).pubsub(ignore_subscribe_messages=True)
        await pubsub.psubscribe(pattern)
        subscriptions.append(pubsub)
    return subscriptions


async def _listen(pubsub: Any, keys: Keys, notified: dict[str, float], wake: asyncio.Event) -> None:
    """Note when each session's state hash was written (perf_counter), and wake the watcher."""
    async for message in pubsub.listen():
        if message.get("type") != "pmessage":
            continue
        key = message["channel"].decode().split(":", 1)[1]  # `__keyspace@0__:<key>`
        sid = keys.session_of(key)
        if sid is not None:
            notified[sid] = time.perf_counter()
            wake.set()


async def _watch_marks(settings: Settings, sweep_s: float, acked: Any, results: Any) -> None:
    keys = settings.redis_keys()
    client = settings.redis_async()
    await client.script_load(_MARKS_SCRIPT)  # on a cluster: on every master
    notified: dict[str, float] = {}
    wake = asyncio.Event()
    subscriptions = await _subscribe(settings, keys)
    listeners = [asyncio.create_task(_listen(p, keys, notified, wake)) for p in subscriptions]
    results.put("ready")
    pending: dict[str, collections.deque[tuple[int, float, float]]] = {}
    partition_of: dict[str, int] = {}
    sent_at: list[float] = []
    from_send: list[float] = []
    from_ack: list[float] = []
    reads, reading, swept = 0, 0.0, 0
    read_at: dict[str, float] = {}  # when each pending session's mark was last read
    done_at: float | None = None
    last_sweep = time.perf_counter()
    try:
        while True:
            t0 = time.perf_counter()
            due: set[str] = set()
            while True:
                try:
                    item = acked.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    done_at = t0
                    continue
                sid, partition, offset, sent, ack = item
                partition_of[sid] = partition
                pending.setdefault(sid, collections.deque()).append((offset, sent, ack))
                read_at.setdefault(sid, sent)  # a write notified before the send is not this one
            due.update(sid for sid in pending if notified.get(sid, -math.inf) > read_at[sid])
            notified_due = frozenset(due)
            if t0 - last_sweep >= sweep_s:
                due = set(pending)
                last_sweep = t0
            if due:
                groups, calls = marks_calls(keys, {sid: partition_of[sid] for sid in due})
                asked = time.perf_counter()
                replies = await execute_async(client, Request(calls, list, "reading the marks"))
                seen = time.perf_counter()
                reads += 1
                reading += seen - asked
                for sids, marks in zip(groups, replies, strict=True):
                    for sid, raw in zip(sids, marks, strict=True):
                        read_at[sid] = asked
                        if not raw:
                            continue
                        mark = int(raw.split(b":", 1)[1])
                        waiting = pending[sid]
                        while waiting and waiting[0][0] <= mark:
                            _, sent, ack = waiting.popleft()
                            sent_at.append(sent)
                            from_send.append((seen - sent) * 1000)
                            from_ack.append((seen - ack) * 1000)
                            swept += sid not in notified_due
                        if not waiting:
                            del pending[sid]
                            del read_at[sid]
            if done_at is not None and (not pending or t0 - done_at > 30):
                break
            # Woken by a notification; otherwise the acks are drained every `ACK_DRAIN_S`.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), ACK_DRAIN_S)
            wake.clear()
    finally:
        for task in listeners:
            task.cancel()
        for pubsub in subscriptions:
            await pubsub.aclose()
        await client.aclose()
    results.put((sent_at, from_send, from_ack, reads, reading, swept))


def _end_process(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)


@dataclass
class _Watcher:
    """The watcher process (`watch_marks`), its input queue and its output queue."""

    process: Any
    acked: Any
    results: Any


@dataclass
class _Measured:
    """What the measured phase saw: the sends, the acks and the watcher's samples (ms)."""

    started: float  # time.perf_counter() of the first send
    produced_in: float
    behind: int
    usage: dict[str, Any]
    ack_times: list[float] = field(default_factory=list)  # seconds from send to ack
    sent_at: list[float] = field(default_factory=list)
    from_send: list[float] = field(default_factory=list)
    from_ack: list[float] = field(default_factory=list)
    reads: int = 0
    reading_s: float = 0.0  # the reads' round trips, in all
    swept: int = 0  # samples resolved by a sweep, not by a notification
    profiled: bool = False  # py-spy sampled the worker during the measured phase


@dataclass(frozen=True)
class E2e:
    """What one e2e measurement saw: latency from the send call and from the ack (summaries),
    the produce-ack latency, and the figure's params."""

    send: dict[str, Any]
    ack: dict[str, Any]
    produce: dict[str, Any]
    rest_p99: float | None  # after the window's first seconds
    params: dict[str, Any]


def _ratio_of(m: E2e) -> float | None:
    return ratio(m.send["p99"], m.produce["p99"])


def e2e(run: Run) -> None:
    """Produce at a fixed rate with a worker running; time produce → mark visible in Redis.

    `e2e_rounds` times, each on a topic of its own; the figures are the round with the median
    e2e/produce-ack ratio (the lower of the middle two), every round's in params: a p99 over one
    10-s window moves with one stall of a second or two (seconds of 30-46 ms p99 beside seconds
    of 10-17, in two of three runs of the same code).
    """
    warm = warm_broker(run, "e2ew")
    rounds = []
    speed: list[tuple[float, float]] = []  # the machine's, right before and after each round
    for i in range(max(1, run.sizes.e2e_rounds)):
        run.settle(ROUND_SETTLE_MAX_S)
        before = calibrate()[0]
        rounds.append(measure_e2e(run, f"e2e{i}" if i else "e2e"))
        speed.append((before, calibrate()[0]))
    ratios = [_ratio_of(m) for m in rounds]
    m = median_item(rounds, _ratio_of)
    median = _ratio_of(m)
    every = {
        "rounds_e2e_p99_ms": [r.send["p99"] for r in rounds],
        "rounds_produce_ack_p99_ms": [r.produce["p99"] for r in rounds],
        "rounds_ratio": ratios,
        f"rounds_p99_after_first_{run.sizes.e2e_head_s:g}s_ms": [r.rest_p99 for r in rounds],
        "rounds_worker_batch_lag_p99_ms": [
            {k: v["p99"] for k, v in r.params["worker_batch_lag_ms"].items()} for r in rounds
        ],
        # What ran during each round, not only the median one: a slow round is slow at the
        # broker and in the worker alike (PERFORMANCE.md, "The e2e window taken apart"); with
        # the broker's JIT and collector seconds (`cpu_report`).
        "rounds_cpu_pct": [cpu_report(r.params) for r in rounds],
        # Whether a slow round ran on a slower machine: the CPU calibration's fold (best of
        # three, about a second) right before and right after each round.
        "rounds_calibration_before_after": [[round(b), round(a)] for b, a in speed],
        "warmup_rounds": warm,
    }
    head_s = run.sizes.e2e_head_s
    run.put("e2e_latency_p50_ms", m.send["p50"], "ms", params=m.params)
    run.put(
        "e2e_latency_p99_ms",
        m.send["p99"],
        "ms",
        params={
            "from_ack_p99_ms": m.ack["p99"],
            **every,
            "see": "e2e_latency_p50_ms params",
        },
    )
    run.put("e2e_latency_max_ms", m.send["max"], "ms", params={"from_ack_max_ms": m.ack["max"]})
    run.put(
        "e2e_p99_vs_produce_ack_p99",
        median,
        "×",
        target=TARGETS["e2e_vs_ack"],
        params={
            "e2e_p99_ms": m.send["p99"],
            "produce_ack_p99_ms": m.produce["p99"],
            f"e2e_p99_after_first_{head_s:g}s_ms": m.rest_p99,
            "of": "the round with the median ratio (each round's p99 against its own produce-ack "
            "p99)",
            **every,
            "why": "a ratio to the produce-ack latency of the same run travels between machines; "
            "an absolute latency does not",
        },
    )


def warm_broker(
    run: Run, name: str, measure: Callable[[Run, str], E2e] | None = None
) -> dict[str, Any]:
    """Throwaway e2e rounds until one's window found the broker(s) compiling for under
    `WARM_JIT_SHARE` of it (one round if that is not known), at most `WARM_ROUNDS_MAX`: what
    each measured, and whether the broker was still compiling after the last, for the params.

    A broker that has run for a while has compiled its hot paths; one the harness has just
    started compiles them under the first rounds' load, on the same two cores. The rounds are
    kept or dropped on the broker's compiling, never on their latency.
    """
    measure = measure or (lambda r, n: measure_e2e(r, n, profile=False))
    rounds: list[dict[str, Any]] = []
    compiling: bool | None = None
    for i in range(WARM_ROUNDS_MAX):
        if i:
            run.settle(ROUND_SETTLE_MAX_S)
        m = measure(run, f"{name}{i}")
        used = cpu_report(m.params)
        rounds.append(
            {
                "e2e_p99_ms": m.send["p99"],
                "produce_ack_p99_ms": m.produce["p99"],
                "ratio": _ratio_of(m),
                **used,
            }
        )
        jit, window = used.get("kafka_jit_s"), m.params.get("produced_in_s")
        if not isinstance(jit, int | float) or not isinstance(window, int | float) or window <= 0:
            compiling = None  # not known (a broker in a container, say)
            break
        compiling = jit / window >= WARM_JIT_SHARE
        if not compiling:
            break
    run.log(f"{name}: {len(rounds)} warm-up round(s) before the measured ones")
    return {
        "rounds": rounds,
        "broker_still_compiling": compiling,
        "rule": f"throwaway rounds until the broker(s) compiled for under {WARM_JIT_SHARE:.0%} of "
        f"a round's window (kafka_jit_s / produced_in_s), at most {WARM_ROUNDS_MAX}; one if that "
        "is not known (null)",
    }


def measure_e2e(run: Run, name: str, *, profile: bool = True) -> E2e:
    """One worker on a fresh topic; the warm-up, then `e2e_seconds` at `e2e_rate` events/s
    (profiled under `name` with `--profile`, if `profile`)."""
    s = run.sizes
    settings = run.settings(name)
    infra.create_topics(settings, run.cleanup)
    infra.stamp_on_append(settings)  # the worker's lag histograms: from the broker's append
    infra.register_prefix(settings, run.cleanup)
    total = int(s.e2e_rate * (s.e2e_warmup_s + s.e2e_seconds))
    sessions = math.ceil(total / 19) + 1
    work = workload.sessions_workload(sessions, f"e{run.tag}", concurrency=max(sessions // 5, 50))
    events = work.events[:total]
    worker = run.start(f"{name}-0", settings)
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push(f"close {name} producer", lambda: log.close(timeout=5))
    n_warm = int(s.e2e_rate * s.e2e_warmup_s)
    folding = FoldCounter(run.store_client(settings), settings.redis_keys(), [worker])
    warmup_visible_after_s = _warm_up(run, folding, log, events[:n_warm])
    measured_events = events[n_warm:]
    watcher = _start_watcher(run, settings)
    lag_before = worker.metrics()
    m = _measure(run, folding, log, watcher, measured_events, profile_as=name if profile else None)
    lag = lag_between(lag_before, worker.metrics())
    worker.stop()
    send = summary(m.from_send)
    ack = summary(m.from_ack)
    per_second = by_slice(
        ((int(t - m.started), latency) for t, latency in zip(m.sent_at, m.from_send, strict=True)),
        "p99",
    )
    produce = summary([a * 1000 for a in m.ack_times])
    # The window's first seconds apart: they were slower than the rest in earlier runs.
    head_s = s.e2e_head_s
    head = [lat for t, lat in zip(m.sent_at, m.from_send, strict=True) if t - m.started < head_s]
    rest = [lat for t, lat in zip(m.sent_at, m.from_send, strict=True) if t - m.started >= head_s]
    params = {
        "rate_events_per_s": s.e2e_rate,
        "seconds": s.e2e_seconds,
        "produced_in_s": m.produced_in,
        "warmup_s": s.e2e_warmup_s,
        "warmup_all_visible_after_s": warmup_visible_after_s,
        "events": len(measured_events),
        "measured": len(m.from_send),
        "unresolved": len(measured_events) - len(m.from_send),
        "sends_late_over_5ms": m.behind,
        "workers": 1,
        "sweep_interval_ms": s.e2e_sweep_s * 1000,
        "resolution": "a session's mark is read when a keyspace notification says its state hash "
        "was written (one Lua call per partition: HGET mark per session; one pipelined round trip "
        "per Redis master); a sample is the reply time of the first read that saw it, so each is "
        "late by the notification's delivery plus one Redis round trip; every sweep_interval_ms "
        "all pending marks are read too (a safety net: `resolved_by_sweep`)",
        "measured_from": "the KafkaEventLog.send call (a pending entry is read from its ack on)",
        "reads": m.reads,
        "read_round_trip_ms_mean": 1000 * m.reading_s / m.reads if m.reads else None,
        "resolved_by_sweep": m.swept,
        "watcher": "a separate process subscribed to the state hashes' keyspace notifications "
        "(the measured phase only; notify-keyspace-events Kh, set back after the figure)",
        "from_ack_ms": ack,
        "produce_ack_ms": produce,
        f"first_{head_s:g}s_ms": summary(head),
        f"after_first_{head_s:g}s_ms": summary(rest),
        "batch_max_records": settings.batch_max_records,
        "linger_ms": ProducerConfig().linger_ms,
        "replication_factor": settings.replication_factor,
        "min_insync_replicas": settings.min_insync_replicas,
        "redis_cluster": settings.redis_cluster,
        "per_second": per_second,
        "per_second_columns": ["second", "events", "p50_ms", "p99_ms", "max_ms"],
        "worker_batch_lag_ms": lag,
        "worker_batch_lag": "the worker's own histograms over the measured window, per batch: "
        "from its oldest record's timestamp (the broker's append: the topic is made "
        "LogAppendTime for this figure) to the worker holding the batch (`fetched`: the fetch's "
        "delivery and the consumer's part) and to its commit making it readable (`visible`: the "
        "fold and the commit added); the e2e samples add before them the producer's linger and "
        "send, and after them the watcher's notification and read",
        "profiled": m.profiled,
        **m.usage,
    }
    run.log(f"{name}: p50 {send['p50']} ms, p99 {send['p99']} ms, max {send['max']} ms")
    return E2e(send, ack, produce, summary(rest)["p99"], params)


def _warm_up(run: Run, folding: FoldCounter, log: KafkaEventLog, warm_events: list[Event]) -> float:
    """Wait for the worker, then send the warm-up; seconds until all of it was visible.

    The warm-up runs at the measured rate (every path: decisions, scheduler, caches), and is all
    visible before the measurement starts, so a start-up stall cannot leak into it.
    """
    log.append(workload.starts([f"e{run.tag}-warmup"])[0])
    folding.wait(1, 90, "e2e worker ready", 0.05)
    t_warm = time.perf_counter()
    paced(log, warm_events, run.sizes.e2e_rate)
    log.flush(timeout=30)
    folding.wait(1 + len(warm_events), 60, "e2e warm-up visible", 0.01)
    return time.perf_counter() - t_warm


def _start_watcher(run: Run, settings: Settings) -> _Watcher:
    """The watcher (`watch_marks`), started and ready, with the notifications it needs on.

    It runs in a process of its own (spawned): the producer's threads in this one would otherwise
    delay its timestamps through the GIL. Both use time.perf_counter (CLOCK_MONOTONIC, one clock
    for the whole machine).
    """
    run.cleanup.push("keyspace notifications back off", enable_notifications(settings))
    ctx = multiprocessing.get_context("spawn")
    acked: Any = ctx.Queue()
    results: Any = ctx.Queue()
    watcher = ctx.Process(
        target=watch_marks,
        args=(settings, run.sizes.e2e_sweep_s, acked, results),
        daemon=True,
    )
    watcher.start()
    run.cleanup.push("stop the e2e watcher", lambda: _end_process(watcher))
    try:
        ready = results.get(timeout=60)
    except queue.Empty:
        ready = None
    if ready != "ready":
        raise RuntimeError("the e2e watcher did not start")
    return _Watcher(watcher, acked, results)


def _measure(
    run: Run,
    folding: FoldCounter,
    log: KafkaEventLog,
    watcher: _Watcher,
    events: list[Event],
    *,
    profile_as: str | None = None,
) -> _Measured:
    """Send `events` at the rate, each ack handed to the watcher; then collect its samples.

    With `profile_as` (and `--profile`), py-spy samples the worker under that name meanwhile.
    """
    worker = folding.procs[0]
    ack_times: list[float] = []

    def on_ack(sid: str, sent: float, metadata: Any) -> None:
        now = time.perf_counter()
        ack_times.append(now - sent)
        watcher.acked.put((sid, metadata.partition, metadata.offset, sent, now))

    pids = {"worker0": worker.pid, "watcher": watcher.process.pid or 0}
    cpu = run.cpu(pids, None if run.on_cluster else run.redis())
    spy = None if profile_as is None else run.start_profile(profile_as, worker.pid)
    cpu.start()
    started = time.perf_counter()
    produced_in, behind = paced(log, events, run.sizes.e2e_rate, on_ack)
    log.flush(timeout=30)
    m = _Measured(started, produced_in, behind, cpu.stop(), ack_times)
    if profile_as is not None:
        run.profile_summary(profile_as, spy)
    m.profiled = spy is not None
    watcher.acked.put(None)  # no more: it drains what is pending (30 s at most) and reports
    try:
        reported = watcher.results.get(timeout=45)
    except queue.Empty:
        raise RuntimeError(f"the e2e watcher reported nothing\n{worker.log(4000)}") from None
    m.sent_at, m.from_send, m.from_ack, m.reads, m.reading_s, m.swept = reported
    watcher.process.join(timeout=10)
    if not worker.alive():
        raise RuntimeError(f"the e2e worker died\n{worker.log(4000)}")
    return m
