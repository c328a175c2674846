"""The long-session figures (#15): what an event costs as its session ages, and what an old
session keeps in Redis.

One session grows to `long_session_events` events of tool calls and turns, compacted as the
scheduler would (a `compacted` event as soon as `Compactor.plan` says one is due), and goes
through the worker's own path in the harness process: `BatchFolder.fold` onto the cached state,
then one commit round trip to the real Redis (`RedisProjectionStore.commit`: the commit script,
the history lists, the indexes). The cost per event is timed over the window of events that
ends at each age; the 100k-event figure is read against the 100-event one of the same run.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import redis

from bench import infra, workload
from bench.figures.common import TARGETS, Run
from milpa_sessions.settings import Settings
from producers.memory import InMemoryEventLog
from projections.keys import Keys
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.compaction import Compactor
from session_model.projection import BatchFolder, Folded, Position, Record
from session_model.scheduled import compacted
from session_model.session import HISTORY_KINDS

BATCH = 50  # one session's events per commit (a busy session in a worker's batch)
WINDOW = 1_000  # events timed at each age (fewer at ages below it)
ROUNDS = 3


def long_session(run: Run) -> None:
    """Fold + commit µs per event at ages 100, 10k and the full length; Redis bytes of the old
    session outside its history lists."""
    n = run.sizes.long_session_events
    ages = sorted({100, min(10_000, n), n})
    settings = run.settings("long")
    infra.register_prefix(settings, run.cleanup)
    client = run.redis()
    keys = settings.redis_keys()
    store = RedisProjectionStore(
        client,
        keys,
        compact_after=settings.compactor_max_turns,
        track=settings.snapshot_interval_s > 0,  # as the workers commit by default
    )
    rounds: list[dict[int, float]] = []
    cpu = run.cpu({}, client)
    cpu.start()
    for r in range(ROUNDS if n >= 10_000 else 1):
        sid = f"long-{run.tag}-{r}"
        rounds.append(_grow(store, settings, sid, n, ages))
        if r < ROUNDS - 1 and n >= 10_000:
            store.clear()
    usage = cpu.stop()
    held = _bytes(client, keys, sid)
    page_ms, whole_ms = _page_reads(store, sid)
    per_age = {age: statistics.median(r[age] for r in rounds) for age in ages}
    first, last = per_age[ages[0]], per_age[ages[-1]]
    run.log(
        "long session: "
        + ", ".join(f"{v:.1f} µs/event at {a:,}" for a, v in per_age.items())
        + f"; {held.hot:,} B hot, {held.history:,} B history"
    )
    params = {
        "session": "started, then tool calls and turns alternating (results of 40-80 chars), "
        "compacted as the scheduler would (Compactor defaults: 40 turns, keep 12)",
        "path": "BatchFolder.fold onto the cached state + RedisProjectionStore.commit (one "
        f"round trip per {BATCH}-event batch), in the harness process",
        "window": f"the {WINDOW} events ending at each age (all of them below {WINDOW})",
        "rounds": len(rounds),
        "statistic": "median of rounds",
        "us_per_event_by_age": {str(a): round(v, 2) for a, v in per_age.items()},
        "rounds_us_per_event": [{str(a): round(v, 2) for a, v in r.items()} for r in rounds],
        **usage,
    }
    run.put(
        "long_session_us_per_event_at_end",
        last,
        "µs/event",
        baseline=first,
        params={**params, "end": n, "baseline_is": f"the same session at {ages[0]} events"},
    )
    run.put(
        "long_session_cost_end_vs_start",
        last / first if first else None,
        "×",
        target=TARGETS["long_session_cost"],
        params={"what": f"µs per event at {n:,} events / at {ages[0]} events, same run"},
    )
    run.put(
        "long_session_page_read_ms",
        page_ms,
        "ms",
        baseline=whole_ms,
        params={
            "events": n,
            "what": "the console session page's reads of the old session (the latest 301 "
            "timeline entries, its decisions list) against the whole timeline and history "
            "lists it read before (b0c159d); median of 5, sync client in the harness. Both "
            "leave out the state's load (the same either way), and this scripted session asks "
            "no question, so its decisions list is empty",
        },
    )
    run.put(
        "long_session_redis_bytes_outside_history",
        held.hot,
        "bytes",
        target=TARGETS["long_session_bytes"],
        params={
            "events": n,
            "method": "MEMORY USAGE of the session's state hash and event-id list (the hot "
            "state and the dedupe window); its history lists (turns, timeline, calls, "
            "decisions, ...) are reported apart",
            "bytes_by_key": held.by_key,
            "history_bytes": held.history,
        },
    )


def _page_reads(store: RedisProjectionStore, sid: str) -> tuple[float, float]:
    """ms (median of 5) of the console page's reads of the session (its latest 301 timeline
    entries and its decisions), and of the whole timeline and history it read before."""

    def best(read: Callable[[], object]) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            read()
            times.append(1e3 * (time.perf_counter() - t))
        return statistics.median(times)

    page = best(lambda: (store.timeline(sid, latest=301), store.facts(sid, ["decisions"])))
    whole = best(lambda: (store.timeline(sid), store.facts(sid)))
    return page, whole


def _script(sid: str, n: int) -> Iterator[Event]:
    """The session's events, made by the product's writer API (nothing is sent)."""
    collecting = InMemoryEventLog()
    store = workload.writer(collecting)
    store.start(sid, "keep the build green for a week", mode="ask")
    for i in range(1, n):
        if i % 2:
            store.record_tool_call(
                sid,
                ("pytest", "make", "ruff", "git")[i % 4],
                {"i": i},
                f"step {i}: " + "ok " * (10 + i % 10),
                mutating=i % 8 == 1,
                artifact=workload.long_artifact(i),
            )
        else:
            store.record_turn(sid, "assistant", f"thinking about step {i}")
        yield from (r.event for r in collecting.records)
        collecting.records.clear()
    yield from (r.event for r in collecting.records)


def _grow(
    store: RedisProjectionStore, settings: Settings, sid: str, n: int, ages: Sequence[int]
) -> dict[int, float]:
    """Fold and commit the session batch by batch; µs per event over the window at each age."""
    folder = BatchFolder(workload.OPERATOR_KEYS)
    compactor = Compactor(settings.compactor_max_turns, settings.compactor_keep_recent)
    known: dict[str, Folded] = {}
    events = _script(sid, n)
    partition = store.keys.partition_of(sid)  # where a worker would find it, and so `_bytes`
    offset, seq, spent = 0, 0, dict.fromkeys(ages, 0.0)
    pending: list[Event] = []
    counted = dict.fromkeys(ages, 0)
    batch: list[Record] = []
    while True:
        while len(batch) < BATCH:
            event = pending.pop() if pending else next(events, None)
            if event is None:
                break
            batch.append(Record(event, Position(partition, offset)))
            offset += 1
        if not batch:
            break
        t = time.perf_counter()
        updates = folder.fold(known, batch)
        result = store.commit(updates)
        elapsed = time.perf_counter() - t
        if result.conflicts:
            raise RuntimeError(f"{sid}: a commit conflicted in a single-writer run")
        for u in updates:
            known[u.session_id] = Folded(u.state, u.mark)
        state = known[sid].state
        before, seq = seq, state.seq
        for age in ages:  # the share of this batch's events inside each age's window
            inside = max(0, min(seq, age) - max(before, age - WINDOW))
            if inside:
                spent[age] += elapsed * inside / (seq - before)
                counted[age] += inside
        batch = []
        plan = compactor.plan(state)
        if plan is not None:  # the scheduler's compaction, first in the next batch
            pending.append(
                compacted(
                    sid,
                    plan,
                    datetime.now(UTC),
                    "bench-scheduler",
                    event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{sid}/compact/{plan.through}")),
                )
            )
        if seq >= n:
            break
    return {age: 1e6 * spent[age] / max(counted[age], 1) for age in ages}


def _bytes(client: redis.Redis, keys: Keys, sid: str) -> Held:
    """MEMORY USAGE of one session's keys: the hot ones (state, event ids) and the history."""
    k = keys.session(sid)
    names = dict(zip(k.every(), ("state", "turns", "timeline", "ids", *HISTORY_KINDS), strict=True))
    by_key = {names[key]: used for key in k.every() if (used := _usage(client, key))}
    if "state" not in by_key:  # never report a session it cannot find as one that takes 0 bytes
        raise RuntimeError(f"long session {sid}: no state at {k.state}: read the wrong keys")
    hot = by_key.get("state", 0) + by_key.get("ids", 0)
    return Held(hot, sum(by_key.values()) - hot, by_key)


def _usage(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


@dataclass(frozen=True, slots=True)
class Held:
    """What one session holds in Redis, in bytes."""

    hot: int  # the state hash and the event-id list
    history: int  # the lists that only grow
    by_key: dict[str, int]
