"""The expiry figures: how late answer windows close, with the scheduler inside the worker (the
default: its timer process) and as a process of its own, idle and while the worker folds other
sessions' events; under load, against the same run's produce-ack latency and the idle figure."""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench import infra, workload
from bench.figures.common import (
    ROUND_SETTLE_MAX_S,
    TARGETS,
    FoldCounter,
    Run,
    paced,
    scrape_workers,
)
from bench.stats import by_slice, median_item, median_low, rate, ratio, summary
from deploy.harness import read_topic, wait_for
from deploy.metrics import histogram_bucket, histogram_quantile, parse_counter, parse_histogram
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.indexes import ceil_ms
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event

# The load under load: #15's "~12k events/s" was 0.82 of a worker's rate where it was asked
# (756cb6c); on a slower machine 12k would measure a backlog, not deadlines. Never more than asked.
LOAD_SHARE_OF_CAPACITY = 12_000 / 14_718
CAPACITY_FIGURE = "projector_events_per_s_per_worker_1w"


def load_rate(asked: int, capacity: float | None) -> tuple[int, str]:
    """Events/s of load for the figures under load, and why: `asked` (the configured rate) or
    `LOAD_SHARE_OF_CAPACITY` of the same run's one-worker `capacity`, whichever is lower."""
    if capacity is None or capacity <= 0:
        return asked, f"{asked} events/s as configured (no {CAPACITY_FIGURE} in this run)"
    scaled = int(capacity * LOAD_SHARE_OF_CAPACITY)
    if scaled >= asked:
        return asked, (
            f"{asked} events/s as configured ({LOAD_SHARE_OF_CAPACITY:.2f} of this run's "
            f"one-worker capacity, {capacity:,.0f} events/s, would be more)"
        )
    return scaled, (
        f"{LOAD_SHARE_OF_CAPACITY:.2f} of this run's one-worker capacity ({CAPACITY_FIGURE}: "
        f"{capacity:,.0f} events/s), the share #15's {asked} events/s were of a worker's "
        f"capacity where it was asked; {asked} would be more"
    )


def _median_round(rounds: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """The round whose `key` is the median, every round's `key` in its params."""
    picked = median_item(rounds, lambda r: r[key])
    every = [r[key] for r in rounds]
    return {**picked, "params": {**picked["params"], f"rounds_{key}_ms": every}}


def expiry(run: Run) -> None:
    """10k answer windows closing over ~5 s with a worker folding them: how late the closings are.

    Twice: with the scheduler inside the worker (the default deployment: the figure with the
    target) and, as its baseline, in a process of its own (`milpa-sessions scheduler`). The
    worker's idle and loaded runs alternate `expiry_rounds` times and each figure is the median
    round: a p99 over 5 s moves with whether one of the broker's collections (10–30 ms) fell in
    the window, and single runs of the same code gave an idle p99 anywhere from 3 to 20 ms.
    """
    alone = _expiry_run(run, standalone=True)
    per_s, why = 0, ""
    if run.sizes.expiry_load_per_s:
        capacity = run.results.get(CAPACITY_FIGURE)
        per_s, why = load_rate(
            run.sizes.expiry_load_per_s, None if capacity is None else capacity.value
        )
    idle_rounds: list[dict[str, Any]] = []
    loaded_rounds: list[dict[str, Any]] = []
    for i in range(max(1, run.sizes.expiry_rounds)):
        # What the round before left the broker to do (its load's segments, collections) is not
        # this round's to pay.
        run.settle(ROUND_SETTLE_MAX_S)
        idle_rounds.append(_expiry_run(run, standalone=False, round_=i))
        if per_s:
            run.settle(ROUND_SETTLE_MAX_S)
            loaded_rounds.append(_expiry_run(run, standalone=False, load=per_s, round_=i))
    inside = _median_round(idle_rounds, "p99")
    run.log(f"expiry lateness: in the worker p99 {inside['p99']} ms, standalone {alone['p99']} ms")
    if loaded_rounds:
        unloaded_ack_p99 = median_low([r["ack_p99"] for r in idle_rounds])
        _expiry_loaded(run, loaded_rounds, unloaded_ack_p99, per_s, why)
    run.put("expiry_lateness_p50_ms", inside["p50"], "ms", params=inside["params"])
    run.put(
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
    run.put("expiry_lateness_standalone_p50_ms", alone["p50"], "ms", params=alone["params"])
    run.put(
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


def _expiry_loaded(
    run: Run,
    rounds: Sequence[dict[str, Any]],
    unloaded_p99: float | None,
    per_s: int,
    why: str,
) -> None:
    """Expiry lateness while the worker also folds other sessions' events.

    The worker's closings come from its timer process, which shares no loop and no GIL with
    folding, only the cores (it asks for real-time scheduling). The figures with targets are
    ratios that travel between machines: the loaded p99 against the produce-ack p99 of the load
    sent meanwhile (the same broker, the same moment) and against the unloaded p99 of this run
    (each the median of its rounds).
    """
    inside = _median_round(rounds, "ack_p99")
    alone = _expiry_run(run, standalone=True, load=per_s)
    ack = inside["params"]["load"].get("produce_ack_ms", {})
    ack_p99 = ack.get("p99")
    run.log(
        f"expiry lateness under {per_s} events/s of load: in the worker p99 {inside['p99']} ms, "
        f"standalone {alone['p99']} ms; the load's produce-ack p99 {ack_p99} ms"
    )
    run.put(
        "expiry_lateness_loaded_p99_ms",
        median_low([r["p99"] for r in rounds]),
        "ms",
        baseline=alone["p99"],
        params={
            "scheduler": "inside the worker (its timer process)",
            "baseline": "the same with the scheduler as a process of its own",
            "load": f"{per_s} events/s of other sessions (the projector workload) sent "
            "through the same topic from 1 s before the first deadline to the last",
            "load_rate": why,
            "rounds_p99_ms": [r["p99"] for r in rounds],
            "p50_ms": inside["p50"],
            "produce_ack_p99_ms": ack_p99,
            "ack_p99_ms": inside["ack_p99"],
            "standalone_p50_ms": alone["p50"],
            "in_worker": inside["params"],
            "standalone": alone["params"],
        },
    )
    loaded_ack_p99 = inside["ack_p99"]
    vs_ack = median_low(
        [
            ratio(r["ack_p99"], r["params"]["load"].get("produce_ack_ms", {}).get("p99"))
            for r in rounds
        ]
    )
    compared = {
        "expiry_lateness_loaded_ack_p99_ms": loaded_ack_p99,
        "expiry_lateness_loaded_ack_p99_bucket_ms": inside["params"]["ack_p99_bucket_ms"],
        "compared": "lateness until the closing's ack (the scheduler's histogram, interpolated in "
        "its bucket however wide), as the produce-ack reference is until the ack; "
        "expiry_lateness_loaded_p99_ms follows the usual histogram/topic rule instead",
    }
    run.put(
        "expiry_loaded_p99_vs_produce_ack_p99",
        vs_ack,
        "×",
        target=TARGETS["expiry_loaded_vs_ack"],
        params={
            **compared,
            "of": "the median over the rounds of each round's loaded p99 / its own load's "
            "produce-ack p99 (the params: the median loaded round's)",
            "produce_ack_p99_ms": ack_p99,
            "produce_ack_ms": ack,
            "produce_ack": "send → acknowledgement of each load event (KafkaEventLog: "
            "kafka-python, acks=all, linger 5 ms) while the deadlines closed, in the same run",
            "cpu_while_closing": inside["params"]["cpu_while_closing"],
            "why": "a deadline is on time when it is no later than an ordinary append would be "
            "acknowledged on the same broker at the same moment",
        },
    )
    run.put(
        "expiry_loaded_p99_vs_unloaded_p99",
        ratio(loaded_ack_p99, unloaded_p99),
        "×",
        target=TARGETS["expiry_loaded_vs_unloaded"],
        params={
            **compared,
            "of": "median loaded p99 / median idle p99, the rounds alternated",
            "expiry_lateness_unloaded_ack_p99_ms": unloaded_p99,
            "cpu_while_closing": inside["params"]["cpu_while_closing"],
            "why": "folding other sessions must not make the worker's deadlines later",
        },
    )


LOAD_WARM_EVENTS = 19  # one workload session: sent before the load's window, untimed


def _load(
    run: Run, settings: Settings, events: Sequence[Event], start_at: float, per_second: int
) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that sends `events` at `per_second` from `start_at` (time.time()) on."""
    out: dict[str, Any] = {}
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    acks_ms: list[float] = []  # appended by the producer's I/O thread

    def on_ack(sid: str, sent: float, metadata: Any) -> None:
        acks_ms.append((time.perf_counter() - sent) * 1000)

    def send() -> None:
        try:
            # The first session's events before the window, untimed: the producer connects and
            # reads the topic's metadata then, not in the window (the acks of a run's first
            # second of sends once waited 1.6 s for it, and were the reference's whole p99).
            log.append_many(events[:LOAD_WARM_EVENTS])
            timed = events[LOAD_WARM_EVENTS:]
            time.sleep(max(0.0, start_at - time.time()))
            seconds, behind = paced(log, timed, per_second, on_ack)
            log.flush(timeout=60)
            out.update(sent=len(timed), warm_up_sent=len(events) - len(timed))
            out.update(seconds=seconds, late_sends=behind)
            out["events_per_s"] = rate(len(timed), seconds)
            out["produce_ack_ms"] = summary(list(acks_ms))
        finally:
            log.close(timeout=5)

    thread = threading.Thread(target=send, name="expiry-load", daemon=True)
    thread.start()
    return thread, out


@dataclass
class _Deadlines:
    """The questions' deadlines (ms since the epoch), in session order, and how they were set."""

    deadlines: list[int]
    of: dict[str, int]  # session id → its deadline
    lead_s: float  # from asking to the first deadline
    margin_ms: float  # from every question folded to the first deadline

    @property
    def first_ms(self) -> int:
        return self.deadlines[0]


def _expiry_run(run: Run, *, standalone: bool, load: int = 0, round_: int = 0) -> dict[str, Any]:
    """One expiry measurement; `load` events/s of other sessions while the windows close."""
    s = run.sizes
    name = ("expiry" if standalone else "expiryw") + ("l" if load else "")
    name += f"{round_}" if round_ else ""
    settings = run.settings(name, scheduler_enabled=not standalone)
    infra.create_topics(settings, run.cleanup)
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    n = s.expiry_deadlines
    tag = name[-2:] if round_ else name[-1]  # the round's sessions apart from the others'
    sids = [f"{tag}{run.tag}-{i:06d}" for i in range(n)]
    worker = run.start(f"{name}-0", settings)
    # The process whose metrics hold the lateness histogram: the scheduler's own, or the worker.
    measured = (
        run.start(f"{name}-scheduler", settings, command="scheduler") if standalone else worker
    )
    watched = [worker, measured] if standalone else [worker]
    log = KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic)
    run.cleanup.push("close expiry producer", lambda: log.close(timeout=5))
    folding = FoldCounter(client, settings.redis_keys(), watched)
    fold_rate = _start_sessions(folding, log, sids)
    extra: list[Event] = []
    if load:  # generated now, untimed: 19 events per session of the projector's workload
        wanted = int(load * (s.expiry_spread_s + 1.0))
        extra = workload.sessions_workload(wanted // 19 + 1, f"{name}{run.tag}").events[:wanted]
    asked = _ask_questions(run, folding, log, sids, fold_rate)
    run.log(f"expiry: {n} questions folded {asked.margin_ms:.0f} ms before the first deadline")
    loader: tuple[threading.Thread, dict[str, Any]] | None = None
    if load:
        # From 1 s before the first deadline to the last one, other sessions' events keep the
        # worker folding.
        loader = _load(run, settings, extra, asked.first_ms / 1000 - 1.0, load)

    def closings() -> float:
        text = measured.metrics()
        return parse_counter(text, "milpa_scheduler_closings") or 0.0

    spy = run.start_profile(name, measured.pid)
    pids = {"worker0": worker.pid, **_children("worker0", worker.pid)}
    if standalone:
        pids["scheduler"] = measured.pid
    cpu = run.cpu(pids, client)
    cpu.start()
    wait_s = (asked.deadlines[-1] / 1000 - time.time()) + 60
    wait_for(lambda: closings() >= n, wait_s, "expiry: every window closed", 0.25, watched)
    usage = cpu.stop()
    load_params: dict[str, Any] = {}
    if loader is not None:
        loader[0].join(timeout=120)
        load_params = {**loader[1], **scrape_workers([worker])}
    closed_after_last_deadline_s = time.time() - asked.deadlines[-1] / 1000
    run.profile_summary(name, spy)
    text = measured.metrics()
    for p in watched:
        p.stop()
    # Cross-check from the log: the closing record's CreateTime (ms) minus its deadline (ms).
    closed = _closings(run.stack.kafka_bootstrap, settings.events_topic, asked.of)
    p50, p99, lateness = _lateness(text, closed, asked.first_ms)
    params = {
        "deadlines": n,
        "profiled": spy is not None,
        "spread_s": s.expiry_spread_s,
        "lead_s": asked.lead_s,
        "questions_folded_before_first_deadline_ms": asked.margin_ms,
        "scheduler": "standalone process" if standalone else "inside the worker",
        "all_closed_s_after_last_deadline": closed_after_last_deadline_s,
        **lateness,
        "cpu_while_closing": usage,
    }
    if load:
        params["load"] = load_params
    run.log(f"expiry lateness ({params['scheduler']}): p50 ≈ {p50} ms, p99 ≈ {p99} ms")
    return {"p50": p50, "p99": p99, "ack_p99": lateness["ack_p99_ms"], "params": params}


def _children(name: str, pid: int) -> dict[str, int]:
    """The processes `pid` started (the worker's timer process), named for the CPU meter."""
    found: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(c) for c in task.read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            kind = "resource_tracker" if b"resource_tracker" in cmd else "timer"
            found[f"{name}_{kind}" if f"{name}_{kind}" not in found else f"{name}_{child}"] = child
    return found


def _start_sessions(folding: FoldCounter, log: KafkaEventLog, sids: Sequence[str]) -> float:
    """Phase 1: the sessions start (no deadlines); events/s the worker folds them at.

    It also tells when the worker is up.
    """
    for e in workload.starts(sids):
        log.send(e)
    log.flush(timeout=60)
    folding.wait(1, 90, "expiry: worker up", 0.02)
    t1, n1 = time.monotonic(), folding.read()
    folding.wait(len(sids), 120, "expiry: starts folded", 0.02)
    return (len(sids) - n1) / max(time.monotonic() - t1, 0.1)


def _ask_questions(
    run: Run, folding: FoldCounter, log: KafkaEventLog, sids: Sequence[str], fold_rate: float
) -> _Deadlines:
    """Phase 2: one question each, deadlines evenly spread over `expiry_spread_s` seconds.

    The first deadline is far enough out that every question is folded (and scheduled) before it;
    returns once they all are.
    """
    n = len(sids)
    # Questions fold slower than starts (indexes, the feed): a margin of several times the starts.
    lead = max(4.0, 6 * n / fold_rate)
    first_deadline_ms = int((time.time() + lead) * 1000)
    spread_ms = int(run.sizes.expiry_spread_s * 1000)
    deadlines = [first_deadline_ms + spread_ms * i // max(n - 1, 1) for i in range(n)]
    order = list(range(n))
    random.Random(7).shuffle(order)  # arrival order is not deadline order
    asked = workload.questions([sids[i] for i in order], [deadlines[i] for i in order])
    deadline_of = {sids[i]: deadlines[i] for i in range(n)}
    for e in asked:
        log.send(e)
    log.flush(timeout=60)
    folding.wait(2 * n, 120, "expiry: questions folded", 0.02)
    margin_ms = first_deadline_ms - time.time() * 1000
    return _Deadlines(deadlines, deadline_of, lead, margin_ms)


def _lateness(
    text: str, closed: Sequence[tuple[int, int, int]], first_deadline_ms: int
) -> tuple[float | None, float | None, dict[str, Any]]:
    """p50 and p99 of how late the windows closed, and where they come from.

    From the scheduler's histogram (`text`, its Prometheus exposition) where its buckets are
    narrow, else from the closing records (`closed`: deadline, tick time, CreateTime; ms).
    """
    buckets = parse_histogram(text, "milpa_expiry_lateness_ms")
    count = parse_counter(text, "milpa_expiry_lateness_ms_count")
    total_ms = parse_counter(text, "milpa_expiry_lateness_ms_sum")
    topic_summary = summary([float(sent - due) for due, _, sent in closed])
    # Where the lateness comes from: the tick starting late, or the tick's own work before sending;
    # and how it moves along the 5 s of deadlines (per quarter second of deadline).
    tick_late = summary([float(at - due) for due, at, _ in closed])
    tick_to_send = summary([float(sent - at) for _, at, sent in closed])
    along = by_slice(
        (((due - first_deadline_ms) // 250 * 250, float(sent - due)) for due, _, sent in closed),
        "p90",
    )
    chosen: dict[str, str] = {}

    def quantile(q: float, key: str) -> float | None:
        # Always the histogram: until the closing's acknowledgement, when it is in the log and
        # no answer can win the race any more (the topic's CreateTime is the send, earlier). Its
        # bucket is reported; a wide one makes the figure coarse, never earlier than the ack.
        bucket = histogram_bucket(q, buckets)
        chosen[key] = "histogram" + (
            "" if bucket is None else f" (bucket {bucket[0]:g}..{bucket[1]:g} ms)"
        )
        return histogram_quantile(q, buckets) if buckets else topic_summary[key]

    p50 = quantile(0.5, "p50")
    p99 = quantile(0.99, "p99")
    bucket99 = histogram_bucket(0.99, buckets)
    return (
        p50,
        p99,
        {
            # Always from the histogram (until the ack, as the produce-ack reference is), however
            # wide its bucket: what the ratios under load compare.
            "ack_p99_ms": histogram_quantile(0.99, buckets) if buckets else None,
            "ack_p99_bucket_ms": None if bucket99 is None else [bucket99[0], bucket99[1]],
            "closings": count,
            "mean_ms": None if not count else (total_ms or 0) / count,
            "source": "the scheduler's Prometheus histogram milpa_expiry_lateness_ms (time.time() "
            "after the closing's produce was acknowledged minus the deadline), interpolated "
            "linearly inside its bucket (bounds 1 to 10,000 ms, 2.5-25 ms wide up to 100 ms; see "
            "value_source for the bucket); from_topic (until the send) is given apart",
            "buckets": [[le if math.isfinite(le) else "+Inf", c] for le, c in buckets],
            "value_source": chosen,
            "from_topic_ms": topic_summary,
            "from_topic": "closing record CreateTime (ms, set when the scheduler sent it) minus "
            "the deadline (ms): both whole milliseconds, so ±1 ms",
            "tick_started_late_ms": tick_late,
            "tick_to_send_ms": tick_to_send,
            "breakdown": "from_topic = tick_started_late (the closing's `at`, the scheduler's "
            "clock when its tick began, minus the deadline) + tick_to_send (CreateTime minus `at`)",
            "along_the_deadlines": along,
            "along_the_deadlines_columns": [
                "deadline offset ms",
                "closings",
                "p50_ms",
                "p90_ms",
                "max_ms",
            ],
        },
    )


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
