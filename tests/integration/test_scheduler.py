"""The scheduled processor on the real stack: expiry, races, compaction, replicas."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kafka import KafkaConsumer

from deploy.harness import free_port, wait_for
from milpa_sessions.settings import Settings
from processors.scheduler import Scheduler
from processors.scheduler_app import WholeStates
from processors.sinks import LazyProducer, ProducerSink
from producers.kafka_log import KafkaEventLog
from producers.store import SessionStore, deadline_in
from projections.indexes import ceil_ms
from projections.redis_client import async_client
from projections.redis_store import AsyncRedisProjectionStore, RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import ProjectionError
from session_model.compaction import Compactor
from session_model.deadlines import format_instant, parse_deadline
from session_model.partitioning import partition_for
from session_model.policy import permission_question
from session_model.principal import Principal
from session_model.projection import BatchFolder, Folded, Position, Record
from tests.integration.conftest import damage_state, health, with_keys
from tests.unit.builders import ask, started, turn

pytestmark = pytest.mark.integration


def _agent(kafka_log: KafkaEventLog, projections: RedisProjectionStore) -> SessionStore:
    return SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60)


@pytest.fixture(params=["scheduler in the worker", "standalone scheduler"])
def pipeline(request: pytest.FixtureRequest, settings: Settings, start_worker: Any) -> Any:
    """Starts the projector with the scheduler in either deployment (the tests run for both)."""

    def start(s: Settings = settings) -> None:
        if request.param == "standalone scheduler":
            s = with_keys(s, scheduler_enabled=False)
            start_worker(s)
            start_worker(s, command="scheduler")
        else:
            start_worker(s)

    return start


def test_a_standalone_scheduler_answers_its_health_probes(
    settings: Settings, start_worker: Any
) -> None:
    port = free_port()
    start_worker(with_keys(settings, metrics_port=port), command="scheduler")
    wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=60)
    status, body = health(port, "/livez")
    assert status == 200 and body["live"] and body["ready"] and body["lag"] == 0, body


def _ended(projections: RedisProjectionStore, sid: str) -> bool:
    session = projections.load(sid)
    return session is not None and session.ended


def test_a_question_with_a_one_second_deadline_closes_the_window_and_ends_the_session(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    pipeline: Any,
) -> None:
    pipeline()
    agent = _agent(kafka_log, projections)
    agent.start("exp-1", "wait for a human")
    agent.load("exp-1")
    asked = datetime.now(UTC)
    question = permission_question("deploy", {"env": "prod"}, expires_at=deadline_in(asked, 1))
    agent.ask("exp-1", question)
    agent.load("exp-1")
    wait_for(lambda: _ended(projections, "exp-1"), timeout=30)
    session = projections.load("exp-1")
    assert session is not None
    decision = session.decisions[-1]
    assert (decision.answer, decision.by, decision.reason) == ("", None, "permission")
    assert decision.expired_at is not None
    deadline = parse_deadline(question.expires_at)
    assert deadline is not None and deadline >= asked + timedelta(milliseconds=999)
    assert decision.expired_at >= deadline  # never before the deadline (ms precision)
    assert session.ended_because == (
        f"the window to answer «{question.question}» closed at "
        f"{format_instant(decision.expired_at)} and nobody answered"
    )
    closings = [e for e in projections.timeline("exp-1") if e["kind"] == "expired"]
    assert len(closings) == 1


def test_a_question_answered_before_its_deadline_never_expires(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    pipeline: Any,
) -> None:
    pipeline()
    agent = _agent(kafka_log, projections)
    agent.start("exp-2", "answered in time")
    agent.load("exp-2")  # the worker is up and projecting
    q = permission_question("deploy", {}, expires_at=deadline_in(datetime.now(UTC), 2))
    agent.ask("exp-2", q)
    agent.answer("exp-2", q.id, "yes", Principal("cli:rod@laptop"))
    agent.load("exp-2")
    time.sleep(3.5)  # well past the deadline: a closing would have been appended by now
    session = projections.load("exp-2")
    assert session is not None and not session.ended
    assert [d.answer for d in session.decisions] == ["yes"]
    assert session.rejections == ()


def test_answer_racing_the_expiry_yields_exactly_one_decision(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    pipeline: Any,
) -> None:
    pipeline()
    agent = SessionStore(kafka_log, projections, producer="it-agent", checks=False, read_timeout=60)
    sessions = [f"race-{i}" for i in range(20)]
    for sid in sessions:
        agent.start(sid, "race")
    for sid in sessions:
        wait_for(lambda s=sid: projections.load(s) is not None, timeout=60)
    deadline = datetime.now(UTC) + timedelta(seconds=2)
    for sid in sessions:
        agent.ask(sid, permission_question("deploy", {}, expires_at=format_instant(deadline)))
    while datetime.now(UTC) < deadline:
        time.sleep(0.001)
    for sid in sessions:  # answers land right around the closings
        agent.answer(sid, "perm:deploy", "yes", Principal("cli:ops"))
    time.sleep(3)
    for sid in sessions:
        session = projections.load(sid)
        assert session is not None
        assert len(session.decisions) == 1, sid
        decision = session.decisions[0]
        if decision.expired_at is None:  # the answer won: no closing, session still live
            assert not session.ended
        else:  # the closing won: the answer is on record as late
            assert session.ended
            assert [r.code for r in session.rejections] == ["late_answer"]


def test_a_hundred_turn_session_is_compacted_and_keeps_every_turn_in_history(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    pipeline: Any,
) -> None:
    settings = with_keys(settings, compactor_max_turns=40, compactor_keep_recent=12)
    pipeline(settings)
    agent = SessionStore(kafka_log, projections, producer="it-agent", checks=False, read_timeout=60)
    agent.start("long-1", "a long conversation")
    for i in range(100):
        agent.record_turn("long-1", "user" if i % 2 == 0 else "assistant", f"turn {i}")
    agent.load("long-1")
    # Turns arrive in several batches, so the scheduler may compact more than once; it keeps
    # going until the unsummarised turns are back within the threshold.
    wait_for(
        lambda: (
            (s := projections.load("long-1")) is not None
            and s.summary is not None
            and len(s.turns) <= 40
        ),
        timeout=30,
    )
    session = projections.load("long-1")
    assert session is not None and session.summary is not None
    assert len(session.turns) <= 40
    assert session.window()[0].content.startswith(
        "Summary of what already happened in this session:\n"
    )
    assert "the full record remains in session long-1" in session.summary
    history = projections.history("long-1")
    assert [t.content for t in history] == [f"turn {i}" for i in range(100)]


class _Recorder:
    def __init__(self, log: KafkaEventLog) -> None:
        self.log = log
        self.sent: list[bytes] = []

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        self.sent.append(value)
        await asyncio.to_thread(self.log.append, EventCodec().decode(value))

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        for key, value, headers in records:
            await self.publish(key, value, headers)


def test_two_schedulers_closing_the_same_question_make_one_effective_closing(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: object,
) -> None:
    """Two replicas that both believe they own the partition both emit; the fold keeps one.

    The worker is stopped while they tick: a worker folding the first replica's closing before the
    second reads the session would leave the second nothing to close (it did, on a loaded CI run),
    and the test is about what the fold makes of two closings.
    """
    settings = with_keys(settings, scheduler_enabled=False)
    worker = start_worker(settings)  # type: ignore[operator]
    agent = SessionStore(kafka_log, projections, producer="it-agent", read_timeout=60)
    agent.start("dup-1", "two schedulers")
    q = permission_question("deploy", {}, expires_at=deadline_in(datetime.now(UTC), 0.5))
    agent.ask("dup-1", q)
    agent.load("dup-1")
    worker.stop()
    time.sleep(0.6)

    async def two_replicas() -> int:
        client = async_client(settings.redis_url, auth=settings.redis_auth())
        store = AsyncRedisProjectionStore(client, settings.redis_keys())
        recorders = [_Recorder(kafka_log), _Recorder(kafka_log)]

        async def states(ids: Sequence[str]) -> dict[str, Folded]:
            return await store.folded(ids)

        replicas = [Scheduler(states, store.due_work, r, Compactor()) for r in recorders]
        for replica in replicas:
            await replica.assign(range(settings.partitions))
            await replica.loaded()
        await asyncio.gather(*(replica.tick() for replica in replicas))
        await client.aclose()
        return sum(len(r.sent) for r in recorders)

    assert asyncio.run(two_replicas()) == 2
    start_worker(settings)  # type: ignore[operator]
    wait_for(lambda: _ended(projections, "dup-1"), timeout=30)
    time.sleep(1)
    session = projections.load("dup-1")
    assert session is not None
    assert len(session.decisions) == 1 and session.decisions[0].expired_at is not None
    assert [e["kind"] for e in projections.timeline("dup-1")].count("expired") == 1
    assert session.rejections == ()


def test_the_schedulers_read_leaves_out_the_event_ids_and_keeps_question_and_turns(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """The standalone scheduler reads states without their (long) event-id sets."""
    deadline = format_instant(datetime.now(UTC) + timedelta(hours=1))
    events = [
        started(session_id="light-1"),
        *[turn("user", f"t{i}", session_id="light-1") for i in range(40)],
        ask("q1", session_id="light-1", expires_at=deadline),
    ]
    p = projections.keys.partition_of("light-1")  # where its keys live
    records = [Record(e, Position(p, i)) for i, e in enumerate(events)]
    projections.commit(BatchFolder().fold({}, records))

    async def read(with_ids: bool) -> Folded:
        client = async_client(settings.redis_url, auth=settings.redis_auth())
        try:
            store = AsyncRedisProjectionStore(client, settings.redis_keys())
            return (await store.folded(["light-1"], event_ids=with_ids))["light-1"]
        finally:
            await client.aclose()

    full, light = asyncio.run(read(True)), asyncio.run(read(False))
    assert len(full.state.event_ids) == len(events)
    assert len(light.state.event_ids) == 0
    assert light.state.question == full.state.question is not None
    assert light.state.turns == full.state.turns and len(light.state.turns) == 40
    assert light.mark == full.mark == Position(p, len(events) - 1)


def test_due_work_reads_all_deadlines_or_a_window_and_survives_a_script_flush(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    now = datetime.now(UTC)
    # As written to the topic (millisecond precision): what the index is keyed on.
    soon = parse_deadline(format_instant(now + timedelta(seconds=30)))
    later = parse_deadline(format_instant(now + timedelta(hours=2)))
    assert soon is not None and later is not None
    records = []
    for i, (sid, deadline) in enumerate([("due-soon", soon), ("due-later", later)]):
        events = [
            started(session_id=sid),
            ask("q1", session_id=sid, expires_at=format_instant(deadline)),
        ]
        records += [Record(e, Position(0, 2 * i + j)) for j, e in enumerate(events)]
    long_session = [
        started(session_id="due-long"),
        *[turn("user", f"t{i}", session_id="due-long") for i in range(5)],
    ]
    records += [Record(e, Position(0, 10 + j)) for j, e in enumerate(long_session)]
    store = RedisProjectionStore(projections.client, projections.keys, compact_after=3)
    store.commit(BatchFolder().fold({}, records))
    projections.client.script_flush()  # the store loads its scripts again when Redis lost them

    async def read(until_ms: int | None) -> tuple[dict, dict]:
        client = async_client(settings.redis_url, auth=settings.redis_auth())
        try:
            due = AsyncRedisProjectionStore(client, settings.redis_keys())
            return await due.due_work(range(settings.partitions), until_ms)
        finally:
            await client.aclose()

    everything, compaction = asyncio.run(read(None))
    window, _ = asyncio.run(read(ceil_ms(now + timedelta(minutes=1))))
    assert everything == {"due-soon": (ceil_ms(soon), 0), "due-later": (ceil_ms(later), 0)}
    assert window == {"due-soon": (ceil_ms(soon), 0)}
    assert compaction == {"due-long": 0}


def test_the_schedulers_own_producer_puts_a_closing_in_its_sessions_partition(
    settings: Settings,
) -> None:
    """Closings go out on a producer of their own: keyed like every writer, by murmur2."""
    producer = LazyProducer(settings.kafka_access())
    sink = ProducerSink(producer, settings.events_topic)
    sids = [f"own-producer-{i}" for i in range(24)]

    async def send() -> None:
        try:
            await sink.publish_many([(sid.encode(), sid.encode(), ()) for sid in sids])
        finally:
            await producer.stop()

    asyncio.run(send())
    consumer = KafkaConsumer(
        settings.events_topic,
        **settings.kafka_access().kafka_python(),
        auto_offset_reset="earliest",
        consumer_timeout_ms=10_000,
    )
    try:
        seen = {r.key.decode(): r.partition for r in itertools.islice(consumer, len(sids))}
    finally:
        consumer.close()
    assert seen == {sid: partition_for(sid, settings.partitions) for sid in sids}
    assert len(set(seen.values())) > 1  # spread over partitions, not all in one


class _Kept:
    """A sink that keeps the events sent to it."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        self.events += [EventCodec().decode(value) for _, value, _ in records]


def test_the_standalone_schedulers_reads_leave_out_a_damaged_or_half_rebuilt_session(
    settings: Settings, projections: RedisProjectionStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A session whose state does not decode, or that a `replay --session` is rebuilding, waits
    alone: before, it failed the whole read, and every deadline read with it waited too."""
    deadline = format_instant(datetime.now(UTC) - timedelta(seconds=1))
    sids = ["wait-fine", "wait-damaged", "wait-rebuilding"]
    for sid in sids:
        p = projections.keys.partition_of(sid)
        events = [started(session_id=sid), ask("q1", session_id=sid, expires_at=deadline)]
        projections.commit(
            BatchFolder().fold({}, [Record(e, Position(p, i)) for i, e in enumerate(events)])
        )
    state = projections.keys.session("wait-damaged").state
    whole = projections.client.hgetall(state)
    damage_state(projections, "wait-damaged")
    restore = projections.begin_restore("wait-rebuilding", datetime.now(UTC))

    async def closed(repair: bool) -> list[str]:
        client = async_client(settings.redis_url, auth=settings.redis_auth())
        store = AsyncRedisProjectionStore(client, settings.redis_keys())
        with pytest.raises(ProjectionError, match="layout 9"):  # a read that fails on it
            await store.folded(sids, event_ids=False)
        sink = _Kept()
        scheduler = Scheduler(WholeStates(lambda: store), store.due_work, sink, Compactor())
        await scheduler.assign(range(settings.partitions))
        await scheduler.loaded()
        await scheduler.tick()
        if repair:  # rebuilt, and its replay ended: the next poll finds them
            projections.client.hset(state, mapping=whole)
            projections.end_restore("wait-rebuilding", restore)
        await scheduler.prepare(*(await store.due_work(range(settings.partitions))))
        await scheduler.tick()
        await client.aclose()
        return [e.session_id for e in sink.events if e.type == ev.ANSWER_WINDOW_CLOSED]

    with caplog.at_level(logging.WARNING, logger="processors.scheduler_app"):
        assert asyncio.run(closed(repair=False)) == ["wait-fine"]
    named = sorted(
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "processors.scheduler_app"
    )
    assert [level for level, _ in named] == [logging.WARNING, logging.ERROR]  # each once
    assert "wait-rebuilding: half rebuilt" in named[0][1]  # a routine restore, not damage
    assert "wait-damaged" in named[1][1]
    assert sorted(asyncio.run(closed(repair=True))) == sorted(sids)
