"""The projector on long sessions (#15 item 4): one worker's events/s over a fleet of long sessions
(200 × 5,000 events of tool calls and turns, with the compactions the scheduler appends), read
against the same worker on the short-session topic, measured the same way in the same figure.

Both are `bench.figures.projector.measure_projector` runs (1 worker, product defaults, scheduler
on, a fresh group and prefix each); only the topic differs. The compactions are in the topic
before the clock starts: right after the event that makes one due, the `compacted` event the
scheduler would append (an id derived from the session and `through`: the scheduler's own are
keyed per process), so the fold meets them where a scheduler with no lag would have put them. Over
a topic filled ahead, the worker's own scheduler could only append its compactions at the
partitions' ends, after the sessions it compacts; it still runs, and what it appends anyway
(copies of compactions already in the topic: the same cut, folded as no-ops) is folded like any
record and counted in the figure's params.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from bench import infra, workload
from bench.figures.common import TARGETS, Prefill, Run, produce_all
from bench.figures.projector import ProjectorRun, _median_run, measure_projector
from bench.stats import ratio
from deploy.harness import end_offsets
from producers.kafka_log import KafkaEventLog
from producers.memory import InMemoryEventLog
from producers.store import SessionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event
from session_model.authority import Authority
from session_model.compaction import Compactor, compaction_due
from session_model.fold import step
from session_model.scheduled import compacted
from session_model.session import Session
from session_model.signing import TrustedKeys

SCHEDULER = "milpa-scheduler"  # the producer name on the compactions put in the topic


@dataclass(frozen=True)
class LongFleet:
    """The long-session workload: events in send order, its sessions and compactions."""

    sessions: list[str]
    events: list[Event]
    compactions: int


def long_script(store: SessionStore, sid: str, k: int, n: int) -> None:
    """`n` events of a long agent session: started, then tool calls and turns alternating.

    The session of `bench/figures/longevity.py` (results of 40-80 characters, one call in eight
    mutating, a third naming an artifact: `workload.long_artifact`), shifted by the session's
    index `k`.
    """
    store.start(sid, f"keep the build green for a week ({k})", mode="ask")
    for i in range(1, n):
        if i % 2:
            store.record_tool_call(
                sid,
                ("pytest", "make", "ruff", "git")[(i + k) % 4],
                {"i": i},
                f"step {i}: " + "ok " * (10 + (i + k) % 10),
                mutating=i % 8 == 1,
                artifact=workload.long_artifact(i, k),
            )
        else:
            store.record_turn(sid, "assistant", f"thinking about step {i}")


def with_compactions(
    events: Iterable[Event], compactor: Compactor, keys: TrustedKeys, producer: str = SCHEDULER
) -> tuple[list[Event], int]:
    """One session's events with a `compacted` event right after each that makes one due.

    What a scheduler with no lag appends (`Compactor.plan` of the folded state, the scheduler's
    derived event id); stamped 1 ms after the event that made it due. Returns the events and how
    many compactions were put in.
    """
    auth = Authority(keys)
    out: list[Event] = []
    state: Session | None = None
    count = 0
    for event in events:
        if state is None:
            state = Session(event.session_id)
        state = step(state, event, auth).state
        out.append(event)
        if not compaction_due(state, compactor.max_turns):
            continue
        plan = compactor.plan(state)
        if plan is None:
            continue
        at = event.occurred_at + timedelta(milliseconds=1)
        compaction = compacted(
            state.id,
            plan,
            at,
            producer,
            event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{state.id}/compact/{plan.through}")),
        )
        state = step(state, compaction, auth).state
        out.append(compaction)
        count += 1
    return out, count


def long_fleet(
    count: int,
    length: int,
    tag: str,
    compactor: Compactor,
    *,
    partitions: int,
    base: datetime | None = None,
) -> LongFleet:
    """`count` sessions of `length` agent events plus their compactions, all live at once."""
    collecting = InMemoryEventLog()  # no subscribers: it only records
    store = workload.writer(collecting, base)
    sids = workload.balanced_ids(count, tag, partitions)
    per_session: list[list[Event]] = []
    compactions = 0
    for k, sid in enumerate(sids):
        long_script(store, sid, k, length)
        events, n = with_compactions(
            (r.event for r in collecting.records), compactor, workload.OPERATOR_KEYS
        )
        collecting.records.clear()
        per_session.append(events)
        compactions += n
    # Every session starts within the first `count` events and runs to the end: all are live at
    # once (with a concurrency of only `count`, `staggered` would ramp them up and down over the
    # whole stream, about half of them live on average).
    return LongFleet(sids, workload.staggered(per_session, count * length), compactions)


def projector_long(run: Run) -> None:
    """One worker's events/s on long sessions, and the short-session rate over it (same run)."""
    s = run.sizes
    short_topic = run.prefilled()
    fleet, prefill = _long_prefill(run)
    long_run = replace(run, prefill=prefill, sizes=replace(s, concurrency=len(fleet.sessions)))
    produced = len(fleet.events)
    shorts: list[ProjectorRun] = []
    longs: list[ProjectorRun] = []
    appended: list[int] = []
    for i in range(s.projector_long_rounds):
        shorts.append(measure_projector(run, f"plshort{i}", 1))
        run.log(f"projector, short sessions, round {i + 1}: {shorts[-1].total_rate:.0f} events/s")
        longs.append(measure_projector(long_run, f"pllong{i}", 1))
        ends = end_offsets(run.stack.kafka_bootstrap, prefill.settings.events_topic)
        appended.append(sum(ends.values()) - produced - sum(appended))
        run.log(f"projector, long sessions, round {i + 1}: {longs[-1].total_rate:.0f} events/s")
    short, long = _median_run(shorts), _median_run(longs)
    run.log(
        f"projector, medians: short sessions {short.total_rate:.0f}, "
        f"long sessions {long.total_rate:.0f} events/s"
    )
    agent_events = produced - fleet.compactions
    workload_params = {
        "sessions": len(fleet.sessions),
        "agent_events_per_session": s.projector_long_events,
        "compactions_in_topic": fleet.compactions,
        "events_in_topic": produced,
        "mean_record_bytes": prefill.record_bytes,
        "short_mean_record_bytes": short_topic.record_bytes,
        "compactions": "put in the topic ahead, right after the event that makes one due "
        "(Compactor.plan, the scheduler's event id); the workers run the scheduler as well",
        "records_appended_by_the_workers_scheduler": appended,
        "interleaving": "workload.staggered with a concurrency of sessions × events: every "
        "session starts in the first round and all are live to the end (a round robin)",
    }
    run.put(
        "projector_long_events_per_s_1w",
        long.per_process,
        "events/s",
        baseline=short.per_process,
        params={
            **long.params,
            **workload_params,
            "counted": "every record folded, compactions included",
            "agent_events_per_s": None
            if long.total_rate is None
            else long.total_rate * agent_events / produced,
            "baseline": f"the same worker on the short-session topic ({short_topic.sessions} "
            "sessions × 19 events), measured the same way in this figure",
            "short_params": short.params,
        },
    )
    run.put(
        "projector_long_vs_short_ratio",
        ratio(short.per_process, long.per_process),
        "×",
        target=TARGETS["projector_long_vs_short"],
        params={
            "of": "median short-session events/s / median long-session events/s, 1 worker each",
            "short": short.per_process,
            "long": long.per_process,
            "rounds_ratio": [
                None
                if lo.total_rate in (None, 0) or sh.total_rate is None
                else round(sh.total_rate / lo.total_rate, 3)
                for sh, lo in zip(shorts, longs, strict=True)
            ],
            **workload_params,
            "short_cpu": _cpu(short),
            "long_cpu": _cpu(long),
        },
    )


def _cpu(measured: ProjectorRun) -> dict[str, object]:
    """The CPU meter's report of one measurement (so the ratio is flagged when it was disturbed)."""
    return {k: v for k, v in measured.params.items() if "cpu" in k or k.startswith("loadavg")}


def _long_prefill(run: Run) -> tuple[LongFleet, Prefill]:
    """Generate the long-session workload and fill its topic (untimed; deleted with the figure)."""
    s = run.sizes
    settings = run.settings("plfleet")
    infra.create_topics(settings, run.cleanup)
    compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
    t = time.perf_counter()
    fleet = long_fleet(
        s.projector_long_sessions,
        s.projector_long_events,
        f"l{run.tag}",
        compactor,
        partitions=settings.partitions,
    )
    generated = time.perf_counter() - t
    codec = EventCodec()
    record_bytes = _mean_bytes(codec, fleet.events)
    with KafkaEventLog(run.stack.kafka_bootstrap, settings.events_topic) as log:
        seconds = produce_all(log, fleet.events)
    run.log(
        f"long sessions: {len(fleet.events)} events ({fleet.compactions} compactions) of "
        f"{len(fleet.sessions)} sessions generated in {generated:.1f}s, produced in {seconds:.1f}s"
    )
    prefill = Prefill(settings, fleet.events, len(fleet.sessions), record_bytes)
    return fleet, prefill


def _mean_bytes(codec: EventCodec, events: Sequence[Event]) -> float:
    """Mean encoded size of every compaction and of a sample of the other events, weighted."""
    compactions = [e for e in events if e.type == ev.COMPACTED]
    sample = events[:: max(len(events) // 2000, 1)]
    others = [len(codec.encode(e)) for e in sample if e.type != ev.COMPACTED]
    other_mean = sum(others) / len(others) if others else 0.0
    total = float(sum(len(codec.encode(e)) for e in compactions))
    total += other_mean * (len(events) - len(compactions))
    return total / len(events) if events else 0.0
