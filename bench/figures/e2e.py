"""The end-to-end figures: produce at a fixed rate with a worker running; time until the event's
mark is visible in Redis, seen by a poller in a process of its own."""

from __future__ import annotations

import collections
import math
import multiprocessing
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from bench import infra, workload
from bench.figures.common import TARGETS, FoldCounter, Run, paced
from bench.stats import by_slice, ratio, summary
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog, ProducerConfig
from projections.keys import Keys
from schemas.events import Event

# The marks of many sessions in one command (cheaper for the poller than a pipeline of HGETs).
_MARKS_SCRIPT = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGET', key, 'mark') or '' end
return out
"""


def poll_marks(url: str, keys: Keys, interval: float, acked: Any, results: Any) -> None:
    """The e2e poller (its own process): time from send and from ack to the mark being visible.

    Reads `(session, offset, sent, acked)` items from `acked` until a None, polls every
    `interval` seconds the marks of the sessions with a pending event (one Lua call), and puts
    `(send times, ms from send, ms from ack, polls)` on `results` once nothing is pending (or
    after 30 s).
    """
    client = redis.Redis.from_url(url)
    marks_of = client.register_script(_MARKS_SCRIPT)
    marks_of(keys=[])  # loads the script
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
    worker = run.start("e2e-0", settings)
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push("close e2e producer", lambda: log.close(timeout=5))
    n_warm = int(s.e2e_rate * s.e2e_warmup_s)
    folding = FoldCounter(client, settings.redis_keys(), [worker])
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
    common = {
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
        "poll_interval_ms (one Lua call: HGET mark per session); a sample is the reply time of "
        "the first poll that saw it, so each can be late by up to one poll interval plus one "
        "Redis round trip",
        "measured_from": "the KafkaEventLog.send call (a pending entry is polled from its ack on)",
        "polls": m.polls,
        "poller": "a separate process (one Lua call per poll reading every pending session's mark)",
        "from_ack_ms": ack,
        "produce_ack_ms": produce,
        f"first_{head_s:g}s_ms": summary(head),
        f"after_first_{head_s:g}s_ms": summary(rest),
        "batch_max_records": settings.batch_max_records,
        "linger_ms": ProducerConfig().linger_ms,
        "per_second": per_second,
        "per_second_columns": ["second", "events", "p50_ms", "p99_ms", "max_ms"],
        **m.usage,
    }
    run.log(f"e2e: p50 {send['p50']} ms, p99 {send['p99']} ms, max {send['max']} ms")
    run.put("e2e_latency_p50_ms", send["p50"], "ms", params=common)
    run.put(
        "e2e_latency_p99_ms",
        send["p99"],
        "ms",
        params={"from_ack_p99_ms": ack["p99"], "see": "e2e_latency_p50_ms params"},
    )
    run.put("e2e_latency_max_ms", send["max"], "ms", params={"from_ack_max_ms": ack["max"]})
    vs_ack = ratio(send["p99"], produce["p99"])
    run.put(
        "e2e_p99_vs_produce_ack_p99",
        vs_ack,
        "×",
        target=TARGETS["e2e_vs_ack"],
        params={
            "e2e_p99_ms": send["p99"],
            "produce_ack_p99_ms": produce["p99"],
            f"e2e_p99_after_first_{head_s:g}s_ms": summary(rest)["p99"],
            "why": "a ratio to the produce-ack latency of the same run travels between machines; "
            "an absolute latency does not",
        },
    )


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
        args=(run.stack.redis_url, settings.redis_keys(), run.sizes.e2e_poll_s, acked, results),
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
        poller.acked.put((sid, metadata.offset, sent, now))

    cpu = run.cpu({"worker0": worker.pid, "poller": poller.process.pid or 0}, folding.client)
    cpu.start()
    started = time.perf_counter()
    produced_in, behind = paced(log, events, run.sizes.e2e_rate, on_ack)
    log.flush(timeout=30)
    m = _Measured(started, produced_in, behind, cpu.stop(), ack_times)
    poller.acked.put(None)  # no more: the poller drains what is pending (30 s at most) and reports
    try:
        m.sent_at, m.from_send, m.from_ack, m.polls = poller.results.get(timeout=45)
    except queue.Empty:
        raise RuntimeError(f"the e2e poller reported nothing\n{worker.log(4000)}") from None
    poller.process.join(timeout=10)
    if not worker.alive():
        raise RuntimeError(f"the e2e worker died\n{worker.log(4000)}")
    return m
