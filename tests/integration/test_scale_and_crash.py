"""Scale and crashes on the real stack: many sessions, two workers, kill -9, redelivered batches.

Every test compares what Redis holds with the pure fold of exactly the events appended (the
reference in `expected.py`): state, full history and timeline, so anything applied twice or lost
shows up as a difference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaError

from bench.workload import Console
from deploy.harness import end_offsets, read_topic, wait_for
from milpa_sessions.settings import Settings
from processors import worker as worker_module
from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from producers.kafka_log import KafkaEventLog
from producers.memory import InMemoryEventLog
from producers.store import SessionStore, deadline_in
from projections.analytics import Analytics
from projections.memory import InMemoryProjectionStore
from projections.redis_client import async_client
from projections.redis_store import AsyncRedisProjectionStore, RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import LogError, ProducerStoppedError
from schemas.events import Event
from session_model.partitioning import partition_for
from session_model.policy import (
    APPROVAL,
    SIGNATURE,
    permission_question,
    signature_question,
    target_question,
)
from session_model.principal import Principal
from session_model.projection import BatchFolder, Position
from session_model.session import HISTORY_KINDS, RECENT_DECISIONS, Question, Rejection
from session_model.signing import TrustedKeys
from tests.integration.conftest import committed_offsets, with_keys
from tests.integration.expected import (
    assert_counters_exact,
    assert_projection_matches,
    decided,
    expected_feed,
    expected_projections,
)
from tests.unit.builders import OPERATOR

pytestmark = pytest.mark.integration

BASE_TIME = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)
FAR_FUTURE = 50 * 365 * 86400  # seconds
# A worker killed with -9 leaves a dead member in the group until its session times out; Faust's
# default (60 s) would make every restart wait a minute. Faust reads these from the environment.
FAST_GROUP_ENV = {
    "BROKER_SESSION_TIMEOUT": "6",
    "BROKER_HEARTBEAT_INTERVAL": "1",
    "BROKER_REBALANCE_TIMEOUT": "20",
}


# -- a deterministic generator of realistic sessions ---------------------------------------------


def _question(rng: random.Random, n: int, now: datetime) -> Question:
    # Far in the future: the worker's scheduler must not close these windows (it would append
    # events of its own to the topic, beyond the reference this test folds).
    expires = deadline_in(now, FAR_FUTURE)
    kind = rng.randrange(4)
    if kind == 0:
        return permission_question(f"deploy-{n}", {"env": "prod", "n": n}, expires_at=expires)
    if kind == 1:
        return signature_question(f"sign-{n}", {"doc": f"d{n}"}, expires_at=expires)
    if kind == 2:
        return target_question(f"rm-{n}", f"/tmp/x{n}", f"Remove /tmp/x{n}?", expires_at=expires)
    return Question(id=f"q{n}", question=f"Which way, {n}?", options=("left", "right"))


def session_script(store: SessionStore, console: Console, sid: str, i: int) -> None:
    """About twenty events of session `sid`, every kind of event, a few of them rejected.

    What the operator signs (see `generate`) stands only where the fold trusts `OPERATOR`; the
    comments say what a fold that trusts no key, as this module's tests, does instead.
    """
    rng = random.Random(i)
    now = BASE_TIME
    store.start(sid, f"goal of {sid}", mode=rng.choice(["ask", "acknowledge", "auto"]))
    store.record_turn(sid, "user", f"please do task {i}")
    store.set_plan(sid, f"plan {i}: look, change, check")
    store.set_todo(sid, "t1", "look around", "in_progress")
    store.record_tool_call(sid, "grep", {"pattern": f"p{i}"}, f"{i % 7} hits")
    store.record_turn(sid, "assistant", f"found {i % 7} places")
    first = _question(rng, i, now)
    store.ask(sid, first)
    variant = i % 10
    if variant == 7:
        # Nobody answered: the window closes and the session ends; a late answer is rejected
        # (`late_answer`: judged before its content, an approval would not save it). Closed at the
        # deadline: one noticed before it would close an earlier asking, a no-op for this one.
        at = first.deadline() or now
        closed = store.event(sid, ev.ANSWER_WINDOW_CLOSED, {"question_id": first.id, "at": at})
        store.append(closed)
        late = first.options[0] if first.options else APPROVAL
        store.answer(sid, first.id, late, Principal("actor:late", verified=False))
        store.record_turn(sid, "user", "anyone there?")  # rejected: session_ended
        return
    if i % 50 == 3:
        store.ask(sid, _question(rng, i + 1, now))  # rejected: question_open
    # Claims of `verified`, signed by `OPERATOR`: downgraded by a fold that does not trust it.
    by = Principal(f"actor:member:{i % 13}", verified=variant in (2, 5))
    if first.reason == SIGNATURE:
        # Answered only by the operator's approval of the call. A fold that trusts no key refuses
        # it (`unauthorized`): the question stays open, the session paused until it ends.
        console.approve(sid, first.id, by, executor="it-agent")
    else:
        store.answer(sid, first.id, first.options[0], by, executor="it-agent")
    if i % 50 == 1:
        # rejected: no_open_question (`unauthorized` where a refused approval left it open)
        store.answer(sid, first.id, "again", by)
    store.grant(sid, f"deploy-{i}")
    store.record_tool_call(
        sid, "make", {"target": f"t{i}"}, "ok", mutating=True, artifact=f"repo:{i}"
    )
    store.set_todo(sid, "t1", "look around", "done")
    store.set_todo(sid, "t2", "change it", "in_progress")
    store.record_turn(sid, "system", f"reminder {i}: keep it small")
    store.record_tool_call(
        sid, "sed", {"file": f"f{i}.py"}, "edited", mutating=True, ok=i % 11 != 0
    )
    store.record_turn(sid, "user", "thanks")
    if variant in (1, 4):
        store.message(sid, "lead", f"status of {i}?")
        store.remove_option(sid, "force-push", "policy", "never on main")
    if variant == 4:
        # Hand the open card to a child session (its events go to the child's own stream).
        child = f"{sid}c"
        store.start(child, f"continue {sid}", mode="ask", parent_id=sid)
        inherited = {"session": sid, "version": 1, "origin": "discovered"}
        card = {"id": "t2", "text": "change it", "status": "in_progress"}
        store.append(store.event(child, ev.TODO_CHANGED, {**card, "inherited_from": inherited}))
        moved = {"to": child, "todos": [{"id": "t2", "version": 1}]}
        store.append(store.event(sid, ev.TODOS_TRANSFERRED, moved))
        store.end(child, "handed back")
    if i % 50 == 5:
        twice = store.event(sid, ev.TURN, {"role": "user", "content": "said twice"})
        store.append(twice)
        store.append(twice)  # the same event id again: a duplicate, no seq
    store.revoke(sid, f"deploy-{i}")
    store.set_mode(sid, rng.choice(["ask", "acknowledge", "auto"]))
    if variant in (3, 8):
        store.require_first(sid, ["plan"])
        store.set_plan(sid, f"plan {i} v2")
        observation = store.record_effect_observation(sid, known=True, artifacts=[f"repo:{i}"])
        store.record_tool_call(
            sid, "pytest", {}, "ok", verdict="pass", effect_observation_id=observation
        )
        store.record_execution(sid, "deploy", {"env": "prod"}, executor="it-agent")
    if variant == 9:
        store.compact(sid, f"summary of {sid}", through=3)
    if i % 50 == 2:
        store.start(sid, "again")  # rejected: already_started
    if i % 50 == 4:
        store.append(store.event(sid, ev.TURN, {"role": "tool", "content": "x"}))  # rejected
    store.record_turn(sid, "assistant", "done")
    if variant == 6:
        # Left open: the session stays paused (`question_open` where a refused approval left the
        # signature question open: paused on that one).
        store.ask(sid, _question(rng, i + 2, now))
    else:
        store.end(sid, f"finished {i}")
        if i % 50 == 0:
            store.record_turn(sid, "user", "one more thing")  # rejected: session_ended


def generate(
    count: int, prefix: str = "s", group: int | None = None
) -> tuple[list[str], list[Event]]:
    """`count` scripted sessions' events (and their children's), interleaved round-robin.

    Returns every session id (sorted) and the events in the order they are to be appended; each
    session's own events keep their order.

    The operator's acts are signed by `OPERATOR`, as an operator's would be: grants, less strict
    modes and starts, claims of a verified principal, and the approvals (`APPROVAL`, through an
    operator's `Console`) that answer signature questions. Whether they stand is for the fold's
    trusted keys to say: this module's workers and reference fold trust none
    (`TrustedKeys.none()`), so every one of them is refused `unauthorized` (a claim is
    downgraded) and each signature question stays open; the rebalance storm's trust `OPERATOR`,
    so all of them stand. `test_generator_covers_every_kind_of_event_and_some_rejections` counts
    both.

    With `group`, sessions are interleaved `group` at a time and the groups follow each other, so
    sessions complete all along the stream instead of all at its end.
    """
    ticks = itertools.count()
    ids = itertools.count()

    def clock() -> datetime:
        return BASE_TIME + timedelta(milliseconds=next(ticks))

    def new_id() -> str:
        return f"e{next(ids):08d}"

    collecting = InMemoryEventLog()  # it only records (and the console notes whose each record is)
    store = SessionStore(
        collecting,
        InMemoryProjectionStore(),
        producer="it-agent",
        signer=OPERATOR,  # grants and relaxed modes are signed, as an operator's would be
        checks=False,
        clock=clock,
        new_id=new_id,
    )
    console = Console(collecting, OPERATOR, producer="it-console", clock=clock, new_id=new_id)
    per_session: list[list[Event]] = []
    for i in range(count):
        first = len(collecting.records)
        session_script(store, console, f"{prefix}{i:05d}", i)
        per_session.append([r.event for r in collecting.records[first:]])
    size = group or count
    interleaved = [
        e
        for start in range(0, count, size)
        for round_ in itertools.zip_longest(*per_session[start : start + size])
        for e in round_
        if e is not None
    ]
    return sorted({e.session_id for e in interleaved}), interleaved


def send_all(log: KafkaEventLog, events: Sequence[Event]) -> dict[str, Position]:
    """Queue every event without waiting per record, flush once; the last position per session."""
    futures: dict[str, Any] = {}
    for event in events:
        futures[event.session_id] = log.send(event)
    log.flush(timeout=60)
    out: dict[str, Position] = {}
    for sid, future in futures.items():
        metadata = future.get(timeout=10)
        out[sid] = Position(metadata.partition, metadata.offset)
    return out


# -- comparing with the fold ---------------------------------------------------------------------


def assert_equals_the_fold(store: RedisProjectionStore, expected: dict[str, Any]) -> None:
    """`assert_projection_matches`, and on failure which fields of which sessions differ."""
    try:
        assert_projection_matches(store, expected)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{explain(store, expected)}") from None


def explain(store: RedisProjectionStore, expected: dict[str, Any], limit: int = 3) -> str:
    """Where the state of the first `limit` differing sessions differs: path, Redis, fold."""
    lines: list[str] = []
    shown = 0
    for sid, exp in expected.items():
        actual = store.load(sid)
        if actual is None or actual == exp.state or shown >= limit:
            continue
        shown += 1
        lines.extend(
            f"  {where}: redis {a!r} != fold {b!r}" for where, a, b in _diff(actual, exp.state, sid)
        )
    return "\n".join(lines)


def _diff(a: Any, b: Any, where: str) -> Iterator[tuple[str, Any, Any]]:
    """The innermost differing values of two (nested) dataclass values."""
    if a == b:
        return
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            yield from _diff(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _diff(x, y, f"{where}[{i}]")
    else:
        yield where, a, b


# -- watching the marks --------------------------------------------------------------------------


def reached(store: RedisProjectionStore, last: dict[str, Position]) -> int:
    """How many sessions' stored marks reached their last position (one pipelined round trip)."""
    done = 0
    for sid, mark in store.marks(list(last)).items():
        want = last[sid]
        if mark.partition == want.partition and mark.offset >= want.offset:
            done += 1
    return done


def wait_for_all(
    store: RedisProjectionStore,
    last: dict[str, Position],
    timeout: float,
    why: str,
    workers: Sequence[Any] = (),
) -> None:
    """Wait until every session's mark reached its last position; fail saying how far it got.

    Fails at once, with its log, if one of `workers` died.
    """
    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        done = reached(store, last)
        if done == len(last):
            return
        for w in workers:
            assert w.alive(), (
                f"{why}: a worker died ({done} of {len(last)} done)\n{w.log()[-4000:]}"
            )
        time.sleep(0.2)
    logs = "".join(w.log()[-2000:] for w in workers)
    raise AssertionError(
        f"{why}: only {done} of {len(last)} sessions reached their last position in {timeout}s"
        f"\n{logs}"
    )


def records_in(settings: Settings, topic: str) -> int:
    """How many records `topic` holds (sum of its partitions' end offsets)."""
    ends = end_offsets(settings.kafka_access().kafka_python(), topic)
    assert ends, f"topic {topic} does not exist"
    return sum(ends.values())


def feed_in(settings: Settings) -> list[tuple[str, int, str]]:
    """(session, question seq, status) of every record of the questions topic, repeats kept."""
    codec = EventCodec()
    out = []
    for record in read_topic(settings.kafka_access().kafka_python(), settings.questions_topic):
        c = codec.decode_question_change(record.value)
        assert record.key == c["session_id"].encode()
        out.append((c["session_id"], c["seq"], c["status"]))
    return out


def decisions_in(settings: Settings) -> set[tuple[str, int, str]]:
    """(session, seq, source event id) of every record of the decisions topic (repeats merged)."""
    codec = EventCodec()
    return {
        (d["session_id"], d["seq"], d["event_id"])
        for d in (
            codec.decode_decision(r.value)
            for r in read_topic(settings.kafka_access().kafka_python(), settings.decisions_topic)
        )
    }


def events_in(settings: Settings, timeout: float = 120) -> tuple[list[Event], dict[str, Position]]:
    """Every event of the events topic in log order, and where each session's last one sits."""
    codec = EventCodec()
    events: list[Event] = []
    last: dict[str, Position] = {}
    access = settings.kafka_access().kafka_python()
    for record in read_topic(access, settings.events_topic, timeout=timeout):
        event = codec.decode(record.value)
        events.append(event)
        last[event.session_id] = Position(record.partition, record.offset)
    return events, last


def ids_by_session(events: Iterable[Event]) -> dict[str, list[str]]:
    """Each session's event ids, in the order given."""
    out: dict[str, list[str]] = defaultdict(list)
    for e in events:
        out[e.session_id].append(e.event_id)
    return dict(out)


# -- the consumer group --------------------------------------------------------------------------


def group_assignment(settings: Settings) -> dict[str, set[int]]:
    """member id → partitions of the events topic, as the group coordinator reports them."""
    admin = KafkaAdminClient(**settings.kafka_access().kafka_python())
    try:
        group = admin.describe_groups([settings.consumer_group])[settings.consumer_group]
    except KafkaError as e:  # no coordinator yet (a fresh broker's offsets topic), or moving
        if not e.retriable:
            raise
        return {}
    finally:
        admin.close()
    if group.get("group_state") != "Stable":
        return {}
    out: dict[str, set[int]] = {}
    for member in group["members"]:
        assignment = member.get("member_assignment") or {}
        out[member["member_id"]] = {
            p
            for topic in assignment.get("assigned_partitions", [])
            if topic["topic"] == settings.events_topic
            for p in topic["partitions"]
        }
    return out


_JOINED = re.compile(r"Joined group '[^']+' \(generation (\d+)\) with member_id (\S+)")


def joins(log_text: str) -> list[tuple[int, str]]:
    """(generation, member id) of every group join a worker logged."""
    return [(int(g), m) for g, m in _JOINED.findall(log_text)]


# -- the tests -----------------------------------------------------------------------------------


def _rejected(expected: dict[str, Any]) -> Counter[tuple[str, str]]:
    """(event type without `session.`, code) of every rejection the fold recorded."""
    return Counter(
        (f.type.removeprefix("session."), f.code)
        for exp in expected.values()
        for f in exp.facts
        if isinstance(f, Rejection)
    )


def _paused_on_signature(expected: dict[str, Any]) -> int:
    """How many sessions end the workload waiting on a signature question."""
    return sum(
        exp.state.question is not None and exp.state.question.reason == SIGNATURE
        for exp in expected.values()
    )


def test_generator_covers_every_kind_of_event_and_some_rejections() -> None:
    _, events = generate(100)
    kinds = {e.type for e in events}
    missing = set(ev.EVENT_TYPES) - kinds
    assert not missing, f"the generator never emits {sorted(missing)}"
    # Of its 100 sessions, 21 are asked a signature question first: 2 of them (variant 7) let
    # its window close, the other 19 have it approved by the operator.
    first_asked: dict[str, Event] = {}
    for e in events:
        if e.type == ev.QUESTION_ASKED:
            first_asked.setdefault(e.session_id, e)
    assert sum(e.payload["reason"] == SIGNATURE for e in first_asked.values()) == 21
    approvals = [
        e for e in events if e.type == ev.QUESTION_ANSWERED and e.payload["approval"] is not None
    ]
    assert len(approvals) == 19
    assert {e.payload["answer"] for e in approvals} == {APPROVAL}
    assert {e.producer for e in approvals} == {"it-console"}

    # As this module's workers fold them (no trusted key): every act the operator signed is
    # refused (its claims of `verified` downgraded), so each signature question stays open after
    # its approval (s00051's second answer lands on one; s00026's second question finds one).
    expected = expected_projections(events, TrustedKeys.none())
    assert _rejected(expected) == {
        ("started", "unauthorized"): 64,  # a less strict start than `ask`
        ("permission_granted", "unauthorized"): 90,  # every session but variant 7's
        ("mode_changed", "unauthorized"): 63,  # to a less strict mode
        ("question_answered", "unauthorized"): 20,  # the 19 approvals, and s00051's "again"
        ("question_answered", "late_answer"): 10,  # variant 7
        ("question_answered", "no_open_question"): 1,  # s00001's "again"
        ("question_asked", "question_open"): 3,  # s00003's, s00053's, and s00026's second one
        ("started", "already_started"): 2,
        ("turn", "invalid"): 2,
        ("turn", "session_ended"): 12,  # variant 7, and i % 50 == 0
    }
    # Variants 2 and 5, but for the 6 of them whose answer is a refused approval.
    assert sum(exp.state.downgrades for exp in expected.values()) == 14
    assert not any(exp.state.approvals for exp in expected.values())
    # Paused on a signature question: the 19 refused approvals', and three variant 6 sessions'
    # second question (s00026's second one was refused: it is paused on its first).
    assert _paused_on_signature(expected) == 19 + 3

    # As a fold that trusts `OPERATOR` does (the rebalance storm's): all of them stand.
    trusting = expected_projections(events, OPERATOR.trusted_keys())
    assert _rejected(trusting) == {
        ("question_answered", "late_answer"): 10,
        ("question_answered", "no_open_question"): 2,  # s00001's and s00051's "again"
        ("question_asked", "question_open"): 2,
        ("started", "already_started"): 2,
        ("turn", "invalid"): 2,
        ("turn", "session_ended"): 12,
    }
    assert sum(exp.state.downgrades for exp in trusting.values()) == 0
    approved = [
        d for exp in trusting.values() for d in exp.state.decisions if d.reason == SIGNATURE
    ]
    assert (
        sorted((d.answer, d.affirmative, d.expired_at is None) for d in approved)
        == [("", False, False)] * 2 + [(APPROVAL, True, True)] * 19
    )
    assert sum(len(exp.state.approvals) for exp in trusting.values()) == 19
    assert _paused_on_signature(trusting) == 4  # variant 6's second questions, s00026's too

    assert {r for exp in expected.values() for r in exp.state.pauses} == {
        "permission",
        "signature",
        "target_not_named",
        "unspecified",
    }
    assert 18 <= len(events) / 100 <= 24
    assert sum(1 for exp in expected.values() if exp.state.parent_id is not None) == 10
    assert any(t.transferred_to for exp in expected.values() for t in exp.state.todos)
    assert any(t.inherited_from for exp in expected.values() for t in exp.state.todos)
    assert all(exp.state.started for exp in expected.values())


@pytest.mark.fault_load
def test_two_thousand_sessions_over_six_partitions_with_two_workers_equal_the_fold(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FAST_GROUP_ENV.items():
        monkeypatch.setenv(name, value)
    first, second = start_worker(), start_worker()
    sids, events = generate(2000)
    expected = expected_projections(events, TrustedKeys.none())  # while the workers start
    assert len(events) >= 2000 * 19

    # Both workers in a stable group, sharing the six partitions, before anything is produced.
    shared: dict[str, set[int]] = {}

    def both_hold_partitions() -> bool:
        shared.clear()
        shared.update(group_assignment(settings))
        owned = [p for parts in shared.values() for p in parts]
        return len(shared) == 2 and all(shared.values()) and sorted(owned) == list(range(6))

    def ready() -> bool:
        assert first.alive() and second.alive(), first.log()[-3000:] + second.log()[-3000:]
        return both_hold_partitions()

    wait_for(ready, timeout=45, interval=0.5)
    joins_before = (joins(first.log()), joins(second.log()))

    started = time.monotonic()
    last = send_all(kafka_log, events)
    produced_in = time.monotonic() - started
    assert produced_in < 30, f"producing {len(events)} events took {produced_in:.1f}s"
    wait_for_all(projections, last, timeout=60, why="two workers", workers=(first, second))
    assert first.alive() and second.alive(), first.log()[-3000:] + second.log()[-3000:]

    # Nobody joined or left while the stream was processed: each member folded its own partitions.
    assert (joins(first.log()), joins(second.log())) == joins_before
    assert group_assignment(settings) == shared
    member_of = {joins_before[0][-1][1]: first, joins_before[1][-1][1]: second}
    assert set(member_of) == set(shared), (member_of, shared)
    with_records = {p.partition for p in last.values()}
    for member, partitions in shared.items():
        assert partitions & with_records, f"{member} owned no partition with records"
        projected = [sid for sid, p in last.items() if p.partition in partitions]
        assert projected, f"{member} projected no session"

    # Nobody else (the scheduler included) appended to the log: the reference is the whole log.
    assert records_in(settings, settings.events_topic) == len(events)
    assert sorted(projections.ids()) == sids
    assert_equals_the_fold(projections, expected)


def stats(store: RedisProjectionStore, name: str) -> dict[str, int]:
    """An analytics counter hash (e.g. pauses by reason code), its partitions' shards added up."""
    return Analytics(store.client, store.keys).counter(name)


def assert_counts_are_exact(
    settings: Settings, projections: RedisProjectionStore, expected: dict[str, Any]
) -> None:
    """The fleet-wide figures equal the fold's: every counter counted once per step, the waiting
    index and fleet counts exact (`assert_counters_exact`), and the questions feed holds every
    question's changes, none invented."""
    assert_counters_exact(projections, expected)
    feed = feed_in(settings)
    truth = expected_feed(expected)
    assert any(status == "open" for _, _, status in truth)
    assert set(feed) == truth, (sorted(truth - set(feed))[:5], sorted(set(feed) - truth)[:5])


def highest_marks(store: RedisProjectionStore, sids: Sequence[str]) -> dict[int, int]:
    """partition → the highest offset any session's stored mark reached."""
    out: dict[int, int] = {}
    for mark in store.marks(sids).values():
        out[mark.partition] = max(out.get(mark.partition, -1), mark.offset)
    return out


@pytest.mark.fault_load
def test_kill_minus_nine_mid_stream_and_restart_still_equals_the_fold_and_counts_nothing_twice(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FAST_GROUP_ENV.items():
        monkeypatch.setenv(name, value)
    sids, events = generate(3000, prefix="k", group=100)
    last = send_all(kafka_log, events)  # the whole stream is in the log before any worker runs
    expected = expected_projections(events, TrustedKeys.none())

    # Offsets are committed rarely here, so the kill always leaves an applied, uncommitted tail.
    worker = start_worker(with_keys(settings, commit_interval=60.0, commit_every=1_000_000))
    low, high = len(sids) // 20, len(sids) * 3 // 4
    deadline = time.monotonic() + 60
    done = 0
    while time.monotonic() < deadline:
        done = reached(projections, last)
        if done >= low:
            break
        assert worker.alive(), f"the worker died before the kill\n{worker.log()[-4000:]}"
        time.sleep(0.02)
    assert low <= done < high, (
        f"could not catch the worker mid-stream: {done} of {len(sids)} sessions done"
        f"\n{worker.log()[-3000:]}"
    )
    worker.kill9()
    assert not worker.alive()
    done_at_kill = reached(projections, last)
    assert done_at_kill < len(sids), "the worker finished before it was killed"
    # Redis is ahead of the group's committed offsets: the restart re-reads applied records.
    committed = committed_offsets(settings)
    applied = highest_marks(projections, sids)
    redelivered = {p for p, off in applied.items() if committed.get(p, 0) <= off}
    assert redelivered, f"no uncommitted tail to redeliver: committed {committed}, marks {applied}"

    restarted = start_worker()
    wait_for_all(
        projections, last, timeout=75, why="after kill -9 and restart", workers=(restarted,)
    )
    assert restarted.alive(), restarted.log()[-3000:]

    assert records_in(settings, settings.events_topic) == len(events)
    assert sorted(projections.ids()) == sids
    assert_equals_the_fold(projections, expected)  # history and timeline: nothing twice
    for sid in sids[:: len(sids) // 50]:
        assert len(projections.history(sid)) == len(expected[sid].history), sid
        assert len(projections.timeline(sid)) == len(expected[sid].timeline), sid
    assert_counts_are_exact(settings, projections, expected)


# -- the batch step in-process: redelivery, restart, a stale owner -------------------------------


@dataclass
class RecordingSink:
    """A Sink that keeps what was published (decisions or dead letters)."""

    published: list[tuple[bytes | None, bytes, tuple[tuple[str, bytes], ...]]] = field(
        default_factory=list
    )

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        self.published.append((key, value, tuple(headers)))

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        for key, value, headers in records:
            await self.publish(key, value, headers)

    def decisions(self) -> list[tuple[str, int, str]]:
        """(session, seq, source event id) of every published decision."""
        codec = EventCodec()
        out = []
        for _, value, _ in self.published:
            d = codec.decode_decision(value)
            out.append((d["session_id"], d["seq"], d["event_id"]))
        return out


@dataclass
class CountingStore:
    """The async Redis store, remembering what every commit returned."""

    inner: AsyncRedisProjectionStore
    results: list[Any] = field(default_factory=list)

    async def folded(self, session_ids: Sequence[str]) -> Any:
        return await self.inner.folded(session_ids)

    async def commit(self, updates: Sequence[Any]) -> Any:
        result = await self.inner.commit(updates)
        self.results.append(result)
        return result


def raw_records(events: Sequence[Event], partitions: int = 6) -> list[RawRecord]:
    """The records as Kafka would hand them over: keyed, encoded, at per-partition offsets."""
    codec = EventCodec()
    next_offset = dict.fromkeys(range(partitions), 0)
    out = []
    for e in events:
        p = partition_for(e.session_id, partitions)
        out.append(RawRecord(e.session_id.encode(), codec.encode(e), p, next_offset[p], "events"))
        next_offset[p] += 1
    return out


def dump(store: RedisProjectionStore) -> dict[str, Any]:
    """Every key under the store's prefix with its whole value (state, lists, sets, counters)."""
    c = store.client
    out: dict[str, Any] = {}
    for key in sorted(c.scan_iter(match=store.keys.pattern(), count=1000)):
        kind = c.type(key).decode()
        if kind == "hash":
            out[key.decode()] = dict(sorted(c.hgetall(key).items()))
        elif kind == "list":
            out[key.decode()] = c.lrange(key, 0, -1)
        elif kind == "set":
            out[key.decode()] = sorted(c.smembers(key))
        elif kind == "zset":
            out[key.decode()] = c.zrange(key, 0, -1, withscores=True)
        else:
            out[key.decode()] = c.get(key)
    return out


async def _with_store(settings: Settings, body: Any) -> Any:
    client = async_client(settings.redis_url, auth=settings.redis_auth())
    try:
        return await body(AsyncRedisProjectionStore(client, settings.redis_keys()))
    finally:
        await client.aclose()


def _worker(
    store: Any,
    decisions: RecordingSink,
    deadletter: RecordingSink,
    questions: RecordingSink | None = None,
) -> ProjectionWorker:
    return ProjectionWorker(store, BatchFolder(), deadletter, decisions, questions=questions)


def test_a_redelivered_batch_changes_nothing_and_publishes_its_decisions_again(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    _, events = generate(40)
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    first, again, fresh, dead = RecordingSink(), RecordingSink(), RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> dict[str, Any]:
        worker = _worker(store, first, dead)
        applied = await worker.process(raws)
        assert {u.session_id for u in applied} == set(expected)
        before = dump(projections)
        # The same batch again (Kafka redelivered it: the offsets were not committed yet).
        worker.decisions = again
        assert await worker.process(raws) == ()
        assert worker.stats.redelivered == len(raws)
        assert dump(projections) == before
        # And to a fresh worker whose cache is empty, as after a restart: it reads the marks.
        restarted = _worker(store, fresh, dead)
        assert await restarted.process(raws) == ()
        assert restarted.stats.redelivered == len(raws)
        assert restarted.stats.conflicts == 0
        assert restarted.stats.decisions == 0
        assert restarted.stats.decisions_republished == len(decided(expected))
        assert dump(projections) == before
        return before

    asyncio.run(_with_store(settings, run))
    assert not dead.published
    assert sorted(first.decisions()) == decided(expected)
    # Published again, the very same records (subscribers drop them by seq).
    assert sorted(again.published) == sorted(first.published)
    assert sorted(fresh.published) == sorted(first.published)
    assert_equals_the_fold(projections, expected)


@dataclass
class FailingSink(RecordingSink):
    """Refuses every publish as a stopped producer does: the worker stops after its Redis commit,
    before any decision left (as when it is stopped, or dies, mid-batch; a refusal that may pass
    would be retried instead)."""

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        raise ProducerStoppedError("the producer to the broker was stopped")


def test_decisions_lost_between_the_commit_and_the_publish_are_published_after_a_restart(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    _, events = generate(40)
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    restarted, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        with pytest.raises(LogError):
            await _worker(store, FailingSink(), dead).process(raws)
        assert_equals_the_fold(projections, expected)  # Redis has the batch, nobody the decisions
        # Kafka redelivers the batch (its offsets were never committed) to the next worker.
        assert await _worker(store, restarted, dead).process(raws) == ()

    asyncio.run(_with_store(settings, run))
    assert sorted(restarted.decisions()) == decided(expected)
    assert decided(expected), "the workload answers or closes questions"


def _many_answers(sid: str, count: int) -> list[Event]:
    """A session asked and answered `count` questions."""
    at = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    events = [Event(f"{sid}-start", sid, ev.STARTED, at, "it", {"goal": "g", "mode": "ask"})]
    for n in range(count):
        q = {"question_id": f"q{n}", "question": f"Go on with step {n}?", "options": ["y", "n"]}
        events.append(Event(f"{sid}-ask{n}", sid, ev.QUESTION_ASKED, at, "it", q))
        a = {"question_id": f"q{n}", "answer": "y", "by": None, "executor": "it"}
        events.append(Event(f"{sid}-answer{n}", sid, ev.QUESTION_ANSWERED, at, "it", a))
    return events


def test_a_decisions_history_that_does_not_decode_parks_only_its_partition_until_it_reads(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """A redelivery that must read a session's decisions history, damaged in Redis, parks that
    session's partition at its first redelivered record (before: every partition of the worker
    waited on the read); once the history reads (rebuilt), the partition is read again and every
    decision is published."""
    sid, count = "s-history-damaged", RECENT_DECISIONS + 5
    many = raw_records(_many_answers(sid, count))
    home = many[0].partition
    other = next(f"s-other-{i}" for i in range(100) if partition_for(f"s-other-{i}", 6) != home)
    at = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    on = raw_records([Event(f"{other}-start", other, ev.STARTED, at, "it", {"goal": "g"})])
    history = projections.keys.session(sid).history[HISTORY_KINDS.index("decisions")]
    republished, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        await _worker(store, RecordingSink(), dead).process(many)  # its offsets never committed
        entry = projections.client.lindex(history, -3)
        projections.client.lset(history, -3, b"{damaged")
        restarted = ProjectionWorker(
            store, BatchFolder(parked={}), dead, republished, questions=RecordingSink()
        )
        prepared = await restarted.prepare([*many, *on])
        assert prepared.ends == {on[0].partition: 0}  # the damaged session's partition waits
        await restarted.finish(prepared)
        (fault,) = restarted.stats.parked.values()
        assert fault.position.partition == home and fault.position.offset == 0
        assert fault.unreadable and "stored decisions cannot be read" in fault.error
        assert projections.load(other) is not None  # the other partition went on
        assert republished.decisions() == []
        assert await restarted.unparkable() == {}
        projections.client.lset(history, -3, entry)  # rebuilt
        ready = await restarted.unparkable()
        assert ready == {home: fault} and restarted.unpark(ready) == {home}
        assert await restarted.process(many) == ()  # read again from the record it waited at

    asyncio.run(_with_store(settings, run))
    assert [event_id for _, _, event_id in republished.decisions()] == [
        f"{sid}-answer{n}" for n in range(count)
    ]
    assert dead.published == []


def test_a_session_s_decisions_beyond_the_state_s_recent_ones_are_republished_after_a_restart(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    # One batch answers more questions of one session than its state keeps decisions of: the
    # decisions a restarted worker republishes come from the session's history list in Redis.
    sid, count = "s-many-answers", RECENT_DECISIONS + 5
    events = _many_answers(sid, count)
    raws = raw_records(events)
    restarted, dead, changes = RecordingSink(), RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        with pytest.raises(LogError):
            await _worker(store, FailingSink(), dead).process(raws)
        stored = projections.load(sid)
        assert stored is not None and len(stored.decisions) == RECENT_DECISIONS
        assert await _worker(store, restarted, dead, changes).process(raws) == ()

    asyncio.run(_with_store(settings, run))
    republished = restarted.decisions()
    assert [event_id for _, _, event_id in republished] == [
        f"{sid}-answer{n}" for n in range(count)
    ]
    assert [seq for _, seq, _ in republished] == sorted(seq for _, seq, _ in republished)
    feed = [EventCodec().decode_question_change(v) for _, v, _ in changes.published]
    answered = [c["question_id"] for c in feed if c["status"] == "answered"]
    assert answered == [f"q{n}" for n in range(count)]


def test_question_changes_lost_before_the_publish_are_published_after_a_restart(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """The feed is at least once: a redelivered batch publishes what its records did, exactly."""
    _, events = generate(40)
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    codec = EventCodec()
    first, again, dead, decisions = (
        RecordingSink(),
        RecordingSink(),
        RecordingSink(),
        RecordingSink(),
    )

    def feed(sink: RecordingSink) -> list[dict[str, Any]]:
        return [codec.decode_question_change(value) for _, value, _ in sink.published]

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = _worker(store, decisions, dead, first)
        await worker.process(raws)
        assert worker.stats.question_changes == len(first.published)
        # Kafka redelivers the batch (never acknowledged) to a restarted worker: its changes were
        # committed in Redis, and are published again from what the states recorded.
        restarted = _worker(store, RecordingSink(), dead, again)
        assert await restarted.process(raws) == ()
        assert restarted.stats.question_changes == 0
        assert restarted.stats.question_changes_republished == len(again.published)

    asyncio.run(_with_store(settings, run))
    truth = expected_feed(expected)
    assert {s for _, _, s in truth} >= {"open", "answered"}, "the workload opens and answers"
    for sink in (first, again):
        assert {(c["session_id"], c["seq"], c["status"]) for c in feed(sink)} == truth
    # Republished opens carry the question as it was asked.
    asked = {(c["session_id"], c["seq"]): c for c in feed(first) if c["status"] == "open"}
    for c in feed(again):
        if c["status"] == "open":
            was = asked[(c["session_id"], c["seq"])]
            for name in ("question_id", "question", "options", "reason", "why", "asked_at"):
                assert c[name] == was[name], (name, c, was)


@dataclass
class FlakySink(RecordingSink):
    """Refuses its first `failures` sends as the broker would (then `error` each time)."""

    failures: int = 0
    error: type[LogError] = LogError
    cause: Exception = dataclasses.field(default_factory=KafkaTimeoutError)

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        if self.failures:
            self.failures -= 1
            raise self.error(f"publishing to decisions failed: {self.cause!r}") from self.cause
        await super().publish_many(records)


def test_a_refused_publish_is_sent_again_and_the_worker_goes_on(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """A broker that refuses a batch's decisions and question changes for a while delays the
    batch; it no longer ends the worker (whose restart would republish the same)."""
    _, events = generate(40)
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    decisions, questions, dead = FlakySink(failures=3), FlakySink(failures=2), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = ProjectionWorker(
            store, BatchFolder(), dead, decisions, questions=questions, retry_initial=0.01
        )
        applied = await worker.process(raws)
        assert len(applied) == len(expected)
        assert worker.stats.publish_retries == 5
        assert worker.stats.decisions == len(decided(expected))

    asyncio.run(_with_store(settings, run))
    assert sorted(decisions.decisions()) == decided(expected)  # each once: none was half-sent
    assert questions.published
    assert_equals_the_fold(projections, expected)


def test_a_publish_refused_because_the_producer_stopped_is_not_retried(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    _, events = generate(10)
    decisions = FlakySink(failures=1, error=ProducerStoppedError)

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = _worker(store, decisions, RecordingSink())
        with pytest.raises(ProducerStoppedError):
            await worker.process(raw_records(events))
        assert worker.stats.publish_retries == 0

    asyncio.run(_with_store(settings, run))
    assert decisions.published == []


def test_a_publish_refused_for_good_is_not_retried(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """No rights on the decisions topic (a setting to fix): the error ends the batch at once."""
    _, events = generate(10)
    decisions = FlakySink(failures=1, cause=TopicAuthorizationFailedError())

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = _worker(store, decisions, RecordingSink())
        with pytest.raises(LogError, match="TopicAuthorizationFailed"):
            await worker.process(raw_records(events))
        assert worker.stats.publish_retries == 0

    asyncio.run(_with_store(settings, run))


def test_a_batch_folded_in_many_slices_equals_the_fold(
    settings: Settings, projections: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slices of 7 records: sessions span many slices, each still gets one update."""
    monkeypatch.setattr(worker_module, "SLICE", 7)
    _, events = generate(40)
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    decisions, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = _worker(CountingStore(store), decisions, dead)
        applied = await worker.process(raws)
        assert len(applied) == len({u.session_id for u in applied}) == len(expected)
        assert worker.stats.redis_round_trips == 2  # one read, one commit: slices are local

    asyncio.run(_with_store(settings, run))
    assert sorted(decisions.decisions()) == decided(expected)
    assert_equals_the_fold(projections, expected)


def test_trimming_the_cache_while_the_next_batch_folds_refuses_nothing(
    settings: Settings, projections: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch N's commit overlaps batch N+1's fold (as in the app), and the cache is full."""
    monkeypatch.setattr(worker_module, "SLICE", 10)  # many yields, each slice reading new ids
    _, old = generate(40)
    _, fresh = generate(40, prefix="n")
    half = len(old) // 2
    mixed = itertools.zip_longest(old[half:], fresh)
    events = old[:half] + [e for pair in mixed for e in pair if e is not None]
    raws = raw_records(events)
    cut = half
    expected = expected_projections(events, TrustedKeys.none())
    decisions, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        worker = ProjectionWorker(store, BatchFolder(), dead, decisions, cache_limit=30)
        first = await worker.prepare(raws[:cut])
        committing = asyncio.ensure_future(worker.finish(first))
        second = await worker.prepare(raws[cut:])
        await committing
        await worker.finish(second)
        assert worker.stats.conflicts == 0, "a session trimmed mid-fold was folded from nothing"

    asyncio.run(_with_store(settings, run))
    assert_equals_the_fold(projections, expected)


class EvictingWorker(ProjectionWorker):
    """At its `at`-th yield, the cache loses every session (as to a trim or a conflict)."""

    at = 0
    pauses = 0
    evicted = False

    async def _pause(self) -> None:
        self.pauses += 1
        if self.pauses == self.at:
            self.evicted = True
            self.forget()
        await super()._pause()


@pytest.mark.parametrize("known_before", [False, True])
def test_sessions_leaving_the_cache_between_slices_are_folded_again(
    settings: Settings,
    projections: RedisProjectionStore,
    monkeypatch: pytest.MonkeyPatch,
    known_before: bool,
) -> None:
    """Sessions folded in one slice and gone from the cache at the next: one consistent update."""
    monkeypatch.setattr(worker_module, "SLICE", 7)
    _, events = generate(20)
    raws = raw_records(events)
    head = 3 * 20 if known_before else 0  # the first three events of each session, applied before
    expected = expected_projections(events, TrustedKeys.none())
    decisions, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        if head:
            await _worker(store, RecordingSink(), dead).process(raws[:head])
        worker = EvictingWorker(store, BatchFolder(), dead, decisions)
        batch = raws[head:]
        worker.at = (len(batch) - 1) // 7 + 1  # the decode's yields, then the fold's first
        await worker.process(batch)
        assert worker.evicted
        assert worker.stats.conflicts == 0

    asyncio.run(_with_store(settings, run))
    assert sorted(decisions.decisions()) == decided(expected)
    assert_equals_the_fold(projections, expected)


def test_a_fresh_worker_continues_sessions_another_folded_with_an_overlapping_batch(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """A restart mid-session: the new owner loads the state from Redis and gets the tail again."""
    scripted = 40
    _, events = generate(scripted)
    raws = raw_records(events)
    # Every scripted session asks its first question in its 7th event and answers (or closes) it
    # later: the cut leaves every first question open for the next worker.
    cut = 7 * scripted
    assert all(e.type == ev.QUESTION_ASKED for e in events[cut - scripted : cut])
    expected = expected_projections(events, TrustedKeys.none())
    before_crash, after_restart, dead = RecordingSink(), RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        await _worker(store, before_crash, dead).process(raws[:cut])
        # Kafka redelivers from the last committed offset, which is behind what Redis holds.
        await _worker(store, after_restart, dead).process(raws[cut - 3 * scripted :])

    asyncio.run(_with_store(settings, run))
    published = before_crash.decisions() + after_restart.decisions()
    assert sorted(published) == decided(expected), "a decision was lost or published twice"
    assert_equals_the_fold(projections, expected)


def test_a_stale_update_from_a_second_worker_is_refused_and_it_refolds(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    _, all_events = generate(10)
    sid = "s00002"  # answered by a downgraded "verified" claim; a grant, a revoke, an end
    events = [e for e in all_events if e.session_id == sid]
    raws = raw_records(events)
    assert len(raws) >= 18
    expected = expected_projections(events, TrustedKeys.none())
    from_a, from_b, dead = RecordingSink(), RecordingSink(), RecordingSink()
    seen_by_b: list[Any] = []

    async def run(store: AsyncRedisProjectionStore) -> None:
        a = _worker(CountingStore(store), from_a, dead)
        b_store = CountingStore(store)
        b = _worker(b_store, from_b, dead)
        await a.process(raws[:5])
        assert await b.process(raws[:5]) == ()  # b caches the session at a's mark (0:4)
        await a.process(raws[5:10])  # a moves on; b's cache is now stale
        b_store.results.clear()
        # b still believes it owns the partition and folds 5.. onto its old state.
        updates = await b.process(raws[5:])
        seen_by_b.extend(updates)
        assert [r.conflicts for r in b_store.results] == [(sid,), ()]
        assert b.stats.conflicts == 1

    asyncio.run(_with_store(settings, run))
    (update,) = seen_by_b
    assert update.base == Position(raws[9].partition, raws[9].offset)
    assert [s.event.event_id for s in update.steps] == [e.event_id for e in events[10:]]
    # b's re-fold found a's records applied and published their decisions again (a may not have).
    assert from_a.decisions() and set(from_a.decisions()) <= set(from_b.decisions())
    assert sorted(set(from_a.decisions() + from_b.decisions())) == decided(expected)
    assert len(from_b.decisions()) == len(set(from_b.decisions())), "b published one twice"
    assert_equals_the_fold(projections, expected)
    assert [t.seq for t in projections.history(sid)] == [t.seq for t in expected[sid].history]


def test_a_stale_owner_that_committed_but_never_published_loses_no_decision(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    """The stale owner commits a batch and fails before its decisions leave; the new owner, whose
    commit of the same records conflicts, publishes them from the state it re-reads."""
    _, all_events = generate(10)
    sid = "s00002"
    events = [e for e in all_events if e.session_id == sid]
    raws = raw_records(events)
    expected = expected_projections(events, TrustedKeys.none())
    from_b, dead = RecordingSink(), RecordingSink()

    async def run(store: AsyncRedisProjectionStore) -> None:
        b = _worker(store, from_b, dead)
        assert await b.process(raws[:5])  # b caches the session at 0:4
        stale = _worker(store, FailingSink(), dead)
        with pytest.raises(LogError):
            await stale.process(raws[:12])  # commits 5..11 to Redis, publishes nothing
        await b.process(raws[5:])  # conflicts on 5..11, re-reads, applies the rest
        assert b.stats.conflicts == 1

    asyncio.run(_with_store(settings, run))
    assert decided(expected)
    assert sorted(from_b.decisions()) == decided(expected), "a decision was lost"
    assert_equals_the_fold(projections, expected)
