"""Long sessions on the real stack: a session of 100k events through Kafka, a worker and Redis is
the pure fold, its hot state stays small, and a producer's retry is folded once even after the
worker that saw the original is gone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.memory import InMemoryEventLog
from producers.store import SessionStore
from projections.memory import InMemoryProjectionStore
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.compaction import Compactor
from session_model.dedupe import HORIZON
from session_model.fold import Kind, step
from session_model.scheduled import compacted
from session_model.session import Session
from session_model.signing import TrustedKeys
from tests.integration.conftest import with_keys
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import assert_equals_the_fold, send_all, wait_for_all

pytestmark = pytest.mark.integration

BASE_TIME = datetime(2026, 6, 1, 8, 0, tzinfo=UTC)


def _writer() -> tuple[SessionStore, InMemoryEventLog]:
    collecting = InMemoryEventLog()
    ticks = iter(range(10**9))
    store = SessionStore(
        collecting,
        InMemoryProjectionStore(),
        producer="long-agent",
        checks=False,
        clock=lambda: BASE_TIME + timedelta(milliseconds=next(ticks)),
    )
    return store, collecting


def long_session(sid: str, n: int) -> list[Event]:
    """`n` events of tool calls and turns, compacted where the scheduler would compact."""
    store, collecting = _writer()
    store.start(sid, "keep the build green for a week", mode="ask")
    for i in range(1, n):
        if i % 2:
            store.record_tool_call(
                sid,
                ("pytest", "make", "ruff")[i % 3],
                {"i": i},
                f"step {i}: ok",
                mutating=i % 8 == 1,
                artifact=f"file:m{i % 23}.py" if i % 5 == 0 else None,
            )
        else:
            store.record_turn(sid, "assistant", f"step {i}")
    events = [r.event for r in collecting.records]
    return list(_with_compactions(sid, events))


def _with_compactions(sid: str, events: list[Event]) -> Iterator[Event]:
    """The events, and a `compacted` right after each event that makes a compaction due."""
    compactor, state, auth = Compactor(), Session(sid), TrustedKeys.none()
    for event in events:
        yield event
        state = step(state, event, auth).state
        plan = compactor.plan(state)
        if plan is not None:
            summary = compacted(
                sid,
                plan,
                event.occurred_at,
                "long-scheduler",
                event_id=_compaction_id(sid, plan.through),
            )
            state = step(state, summary, auth).state
            yield summary


def _compaction_id(sid: str, through: int) -> str:
    """A compaction's id, the same in every run (the scheduler's are keyed per process)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{sid}/compact/{through}"))


def _hot_bytes(store: RedisProjectionStore, sid: str) -> int:
    k = store.keys.session(sid)
    return sum(int(store.client.memory_usage(key, samples=0) or 0) for key in k.all()[::3])


@pytest.mark.fault_load
def test_a_hundred_thousand_event_session_through_a_worker_equals_the_fold(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    """With a producer's retries in it: within the dedupe horizon each is folded once."""
    sid = "long-100k"
    events = long_session(sid, 100_000)
    for at in (5_000, 50_000, 99_000):  # the agent re-sends an event it did not see acknowledged
        events.insert(at, events[at - HORIZON // 2])
    expected = expected_projections(events, TrustedKeys.none())
    assert expected[sid].state.seq == len(events) - 3  # the three copies take no seq
    worker = start_worker(with_keys(settings, scheduler_enabled=False))  # the log is the reference
    last = send_all(kafka_log, events)
    wait_for_all(projections, last, timeout=240, why="100k events", workers=(worker,))
    assert_equals_the_fold(projections, expected)
    history = projections.facts(sid)
    assert len(history.calls) == 50_000 > len(expected[sid].state.calls)
    # The hot state of a compacted 100k-event session: its state hash and its event-id list.
    assert _hot_bytes(projections, sid) < 32_768


def test_a_retry_after_the_worker_restarted_is_still_folded_once(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    """The id window comes back from Redis: a new worker knows the ids the old one folded."""
    sid = "long-retry"
    events = long_session(sid, 400)
    quiet = with_keys(settings, scheduler_enabled=False)
    first = start_worker(quiet)
    wait_for_all(projections, send_all(kafka_log, events), 60, "first worker", (first,))
    before = projections.load(sid)
    assert before is not None
    first.stop()
    second = start_worker(quiet)
    retry = events[-(HORIZON - 10)]
    last = send_all(kafka_log, [retry])
    wait_for_all(projections, last, 60, "second worker", (second,))
    after = projections.load(sid)
    assert after == before  # nothing changed but the mark
    assert step(before, retry).outcome.kind is Kind.DUPLICATE
