"""The end-to-end figures: produce at a fixed rate with a worker running; time until the event's
mark is visible in Redis, seen by a poller in a process of its own."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import multiprocessing
import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bench import infra, workload
from bench.figures.common import TARGETS, FoldCounter, Run, paced
from bench.stats import by_slice, ratio, summary
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog, ProducerConfig
from projections.keys import Keys
from projections.requests import Request, execute_async
from schemas.events import Event

# The marks of many sessions of one partition in one command (cheaper for the poller than a
# pipeline of HGETs). One call per partition: on a Redis Cluster a partition is one hash slot.
_MARKS_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'mark') or '' end
return out
"""
_MARKS_SHA = hashlib.sha1(_MARKS_SCRIPT.encode()).hexdigest()


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


def poll_marks(settings: Settings, interval: float, acked: Any, results: Any) -> None:
    """The e2e poller (its own process): time from send and from ack to the mark being visible.

    Reads `(session, partition, offset, sent, acked)` items from `acked` until a None, polls
    every `interval` seconds the marks of the sessions with a pending event (one script call per
    partition, in one pipelined round trip per Redis master: the product's asyncio client and
    executor), and puts `(send times, ms from send, ms from ack, polls, seconds the polls' round
    trips took)` on `results` once
    nothing is pending (or after 30 s).
    """
    asyncio.run(_poll_marks(settings, interval, acked, results))


async def _poll_marks(settings: Settings, interval: float, acked: Any, results: Any) -> None:
    keys = settings.redis_keys()
    client = settings.redis_async()
    await client.script_load(_MARKS_SCRIPT)  # on a cluster: on every master
    results.put("ready")
    pending: dict[str, collections.deque[tuple[int, float, float]]] = {}
    partition_of: dict[str, int] = {}
    sent_at: list[float] = []
    from_send: list[float] = []
    from_ack: list[float] = []
    polls = 0
    polling = 0.0
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
                sid, partition, offset, sent, ack = item
                partition_of[sid] = partition
                pending.setdefault(sid, collections.deque()).append((offset, sent, ack))
            if pending:
                groups, calls = marks_calls(keys, {sid: partition_of[sid] for sid in pending})
                asked = time.perf_counter()
                replies = await execute_async(client, Request(calls, list, "reading the marks"))
                seen = time.perf_counter()
                polls += 1
                polling += seen - asked
                for sids, marks in zip(groups, replies, strict=True):
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
            await asyncio.sleep(max(interval - (time.perf_counter() - t0), 0))
    finally:
        await client.aclose()
    results.put((sent_at, from_send, from_ack, polls, polling))


def _end_process(process: Any) -> None:
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)


@dataclass
class _Poller:
    """The poller process (`poll_marks`), its input queue and its output queue."""

    process: Any
    acked: Any
    results: Any


@dataclass
class _Measured:
    """What the measured phase saw: the sends, the acks and the poller's samples (ms)."""

    started: float  # time.perf_counter() of the first send
    produced_in: float
    behind: int
    usage: dict[str, Any]
    ack_times: list[float] = field(default_factory=list)  # seconds from send to ack
    sent_at: list[float] = field(default_factory=list)
    from_send: list[float] = field(default_factory=list)
    from_ack: list[float] = field(default_factory=list)
    polls: int = 0
    polling_s: float = 0.0  # the polls' round trips, in all


@dataclass(frozen=True)
class E2e:
    """What one e2e measurement saw: latency from the send call and from the ack (summaries),
    the produce-ack latency, and the figure's params."""

    send: dict[str, Any]
    ack: dict[str, Any]
    produce: dict[str, Any]
    rest_p99: float | None  # after the window's first seconds
    params: dict[str, Any]


def e2e(run: Run) -> None:
    """Produce at a fixed rate with a worker running; time produce → mark visible in Redis."""
    m = measure_e2e(run, "e2e")
    head_s = run.sizes.e2e_head_s
    run.put("e2e_latency_p50_ms", m.send["p50"], "ms", params=m.params)
    run.put(
        "e2e_latency_p99_ms",
        m.send["p99"],
        "ms",
        params={"from_ack_p99_ms": m.ack["p99"], "see": "e2e_latency_p50_ms params"},
    )
    run.put("e2e_latency_max_ms", m.send["max"], "ms", params={"from_ack_max_ms": m.ack["max"]})
    run.put(
        "e2e_p99_vs_produce_ack_p99",
        ratio(m.send["p99"], m.produce["p99"]),
        "×",
        target=TARGETS["e2e_vs_ack"],
        params={
            "e2e_p99_ms": m.send["p99"],
            "produce_ack_p99_ms": m.produce["p99"],
            f"e2e_p99_after_first_{head_s:g}s_ms": m.rest_p99,
            "why": "a ratio to the produce-ack latency of the same run travels between machines; "
            "an absolute latency does not",
        },
    )


def measure_e2e(run: Run, name: str) -> E2e:
    """One worker on a fresh topic; the warm-up, then `e2e_seconds` at `e2e_rate` events/s."""
    s = run.sizes
    settings = run.settings(name)
    infra.create_topics(settings, run.cleanup)
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
    poller = _start_poller(run, settings)
    m = _measure(run, folding, log, poller, measured_events)
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
        "poll_interval_ms": s.e2e_poll_s * 1000,
        "resolution": "the marks of every session with a pending event are read every "
        "poll_interval_ms (one Lua call per partition: HGET mark per session; one pipelined "
        "round trip per Redis master); a sample is the reply time of the first poll that saw "
        "it, so each can be late by up to one poll interval plus one Redis round trip",
        "measured_from": "the KafkaEventLog.send call (a pending entry is polled from its ack on)",
        "polls": m.polls,
        "poll_round_trip_ms_mean": 1000 * m.polling_s / m.polls if m.polls else None,
        "poller": "a separate process (one Lua call per partition per poll reading every pending "
        "session's mark)",
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


def _start_poller(run: Run, settings: Settings) -> _Poller:
    """The poller (`poll_marks`), started and ready.

    It runs in a process of its own (spawned): the producer's threads in this one would otherwise
    delay its timestamps through the GIL. Both use time.perf_counter (CLOCK_MONOTONIC, one clock
    for the whole machine).
    """
    ctx = multiprocessing.get_context("spawn")
    acked: Any = ctx.Queue()
    results: Any = ctx.Queue()
    poller = ctx.Process(
        target=poll_marks,
        args=(settings, run.sizes.e2e_poll_s, acked, results),
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
    return _Poller(poller, acked, results)


def _measure(
    run: Run, folding: FoldCounter, log: KafkaEventLog, poller: _Poller, events: list[Event]
) -> _Measured:
    """Send `events` at the rate, each ack handed to the poller; then collect its samples."""
    worker = folding.procs[0]
    ack_times: list[float] = []

    def on_ack(sid: str, sent: float, metadata: Any) -> None:
        now = time.perf_counter()
        ack_times.append(now - sent)
        poller.acked.put((sid, metadata.partition, metadata.offset, sent, now))

    pids = {"worker0": worker.pid, "poller": poller.process.pid or 0}
    cpu = run.cpu(pids, None if run.on_cluster else run.redis())
    cpu.start()
    started = time.perf_counter()
    produced_in, behind = paced(log, events, run.sizes.e2e_rate, on_ack)
    log.flush(timeout=30)
    m = _Measured(started, produced_in, behind, cpu.stop(), ack_times)
    poller.acked.put(None)  # no more: the poller drains what is pending (30 s at most) and reports
    try:
        m.sent_at, m.from_send, m.from_ack, m.polls, m.polling_s = poller.results.get(timeout=45)
    except queue.Empty:
        raise RuntimeError(f"the e2e poller reported nothing\n{worker.log(4000)}") from None
    poller.process.join(timeout=10)
    if not worker.alive():
        raise RuntimeError(f"the e2e worker died\n{worker.log(4000)}")
    return m
