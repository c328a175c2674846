"""The scheduler's decisions, with a fake clock and fake sinks (no Kafka, no Redis)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from processors import scheduler as scheduler_module
from processors.scheduler import Scheduler
from projections.indexes import ceil_ms
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import ProjectionError
from session_model.compaction import Compactor
from session_model.deadlines import format_instant
from session_model.fold import Kind, step
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from tests.unit.builders import answer, ask, started, turn

DEADLINE = datetime(2026, 1, 1, 12, 0, 0, 500000, tzinfo=UTC)


class Clock:
    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.events: list = []

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        self.events.append(EventCodec().decode(value))

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        for key, value, headers in records:
            await self.publish(key, value, headers)


def _scheduler(states: dict[str, Folded], clock: Clock, sink: Sink, **kw: object) -> Scheduler:
    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        return {i: states[i] for i in ids if i in states}

    async def no_index(parts: Iterable[int]) -> tuple[dict, dict]:
        return {}, {}

    return Scheduler(lookup, no_index, sink, Compactor(**kw), clock=clock)  # type: ignore[arg-type]


def _update(events: list, partition: int = 0) -> SessionUpdate:
    records = [Record(e, Position(partition, i)) for i, e in enumerate(events)]
    return BatchFolder().fold({}, records)[0]


def test_a_deadline_due_to_the_millisecond_but_not_yet_passed_is_kept_not_dropped() -> None:
    u = _update([started(), ask("q1", expires_at=format_instant(DEADLINE))])
    states = {"s1": Folded(u.state, u.mark)}
    clock, sink = Clock(DEADLINE + timedelta(microseconds=0)), Sink()
    scheduler = _scheduler(states, clock, sink)
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    assert sink.events == []  # exactly at the deadline: not expired yet (now > deadline)
    assert scheduler.next_deadline_ms() is not None
    clock.now = DEADLINE + timedelta(microseconds=400)
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.ANSWER_WINDOW_CLOSED]
    assert sink.events[0].payload["question_id"] == "q1"


def test_an_answered_question_is_not_closed() -> None:
    u = _update([started(), ask("q1", expires_at=format_instant(DEADLINE))])
    clock, sink = Clock(DEADLINE + timedelta(seconds=5)), Sink()
    # The projection has moved on: the question was answered after it was scheduled.
    states = {"s1": Folded(replace(u.state, question=None), u.mark)}
    scheduler = _scheduler(states, clock, sink)
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    assert sink.events == []
    assert scheduler.next_deadline_ms() is None


def test_two_replicas_closings_of_one_asking_end_the_session_once() -> None:
    """Each replica derives its ids under a key of its own (nobody else can tell them in
    advance): the later closing is folded as a no-op."""
    u = _update([started(), ask("q1", expires_at=format_instant(DEADLINE))])
    states = {"s1": Folded(u.state, u.mark)}
    sinks = [Sink(), Sink()]
    for sink in sinks:
        scheduler = _scheduler(states, Clock(DEADLINE + timedelta(seconds=1)), sink)
        scheduler.observe([u])
        asyncio.run(scheduler.tick())
    first, second = [e for sink in sinks for e in sink.events]
    assert first.event_id != second.event_id
    closed = step(u.state, first)
    assert closed.outcome.kind is Kind.APPLIED and closed.state.ended
    assert step(closed.state, second).outcome.kind is Kind.NOOP


def test_a_session_over_the_threshold_is_compacted_once_per_cut() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(10)]]
    u = _update(events)
    states = {"s1": Folded(u.state, u.mark)}
    sink = Sink()
    scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.COMPACTED]
    assert sink.events[0].payload["through"] == u.state.turns[-3].seq
    asyncio.run(scheduler.tick())
    assert len(sink.events) == 1  # nothing new observed: nothing more to do


def test_observing_an_earlier_deadline_wakes_the_sleeping_loop() -> None:
    async def scenario() -> int:
        later = _update([started(), ask("q1", expires_at=format_instant(DEADLINE))])
        clock, sink = Clock(DEADLINE - timedelta(hours=1)), Sink()
        scheduler = _scheduler({}, clock, sink)
        scheduler.observe([later])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.05)  # asleep until DEADLINE, an hour away
        woken = scheduler.stats.wakeups
        sooner = DEADLINE - timedelta(minutes=30)
        u2 = _update(
            [
                started(session_id="s2"),
                ask("q2", session_id="s2", expires_at=format_instant(sooner)),
            ]
        )
        scheduler.observe([u2])
        await asyncio.sleep(0.05)
        task.cancel()
        return scheduler.stats.wakeups - woken

    assert asyncio.run(scenario()) >= 1


def test_a_wall_clock_stepped_forward_does_not_leave_a_closing_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop sleeps at most `REARM_S` before it reads the wall clock again: a clock stepped
    past a deadline an hour away closes it then, not an hour later."""
    monkeypatch.setattr(scheduler_module, "REARM_S", 0.02)

    async def scenario() -> list[str]:
        asked = _update([started(), ask("q1", expires_at=format_instant(DEADLINE))])
        clock, sink = Clock(DEADLINE - timedelta(hours=1)), Sink()
        scheduler = _scheduler({"s1": Folded(asked.state, asked.mark)}, clock, sink)
        scheduler.observe([asked])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.05)
        clock.now = DEADLINE + timedelta(milliseconds=1)  # stepped, nobody wakes the loop
        for _ in range(100):
            if sink.events:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        return [e.type for e in sink.events]

    assert asyncio.run(scenario()) == [ev.ANSWER_WINDOW_CLOSED]


def test_a_compaction_is_not_sent_again_while_the_projector_has_not_folded_it() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(10)]]
    u = _update(events)
    sink = Sink()
    scheduler = _scheduler(
        {"s1": Folded(u.state, u.mark)}, Clock(DEADLINE), sink, max_turns=6, keep_recent=2
    )
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    scheduler.observe([u])  # another batch touched s1 before the compaction was folded
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.COMPACTED]


def test_a_new_turn_sends_no_other_compaction_while_the_first_is_not_folded() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(10)]]
    u = _update(events)
    states = {"s1": Folded(u.state, u.mark)}
    sink = Sink()
    scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    busier = _update([*events, turn("user", "t10")])  # one more turn: the cut moves
    states["s1"] = Folded(busier.state, busier.mark)
    scheduler.observe([busier])
    asyncio.run(scheduler.tick())
    _polled(scheduler, {}, {"s1": 0})  # (the standalone scheduler hears of it from the index)
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.COMPACTED]


def test_once_its_compaction_is_folded_a_session_is_compacted_again_when_due() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(10)]]
    u = _update(events)
    states = {"s1": Folded(u.state, u.mark)}
    sink = Sink()
    scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
    scheduler.observe([u])
    asyncio.run(scheduler.tick())
    [first] = sink.events
    more = [turn("user", f"u{i}") for i in range(7)]
    folded = _update([*events, first, *more])  # folded, and due again with the turns since
    assert folded.state.compacted_through == first.payload["through"]
    states["s1"] = Folded(folded.state, folded.mark)
    scheduler.observe([folded])
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.COMPACTED, ev.COMPACTED]
    assert sink.events[1].payload["through"] > first.payload["through"]


# -- a state read that fails (Redis away) ---------------------------------------------------------


class Flaky:
    """State reads that raise ProjectionError while `fails` is above zero (one less each)."""

    def __init__(self, states: dict[str, Folded], fails: int) -> None:
        self.states = states
        self.fails = fails

    async def __call__(self, ids: Sequence[str]) -> dict[str, Folded]:
        if self.fails:
            self.fails -= 1
            raise ProjectionError("reading the states failed: Connection refused")
        return {i: self.states[i] for i in ids if i in self.states}


def _reads_failing(reads: Flaky, sink: Sink, clock: Clock) -> Scheduler:
    async def no_index(parts: Iterable[int]) -> tuple[dict, dict]:
        return {}, {}

    compactor = Compactor(max_turns=6, keep_recent=2)
    return Scheduler(reads, no_index, sink, compactor, clock=clock)  # type: ignore[arg-type]


def _through_failed_reads(fails: int) -> tuple[bool, list[str]]:
    """Closing and compaction work due while the first `fails` reads fail: whether the loop still
    runs once both went out, and what it sent."""

    async def scenario() -> tuple[bool, list[str]]:
        long = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        asked = _asked("s2", "q2", DEADLINE)
        states = {"s1": Folded(long.state, long.mark), "s2": Folded(asked.state, asked.mark)}
        sink = Sink()
        clock = Clock(DEADLINE + timedelta(milliseconds=5))
        scheduler = _reads_failing(Flaky(states, fails), sink, clock)
        scheduler.observe([long, asked])
        task = asyncio.create_task(scheduler.run())
        deadline = asyncio.get_running_loop().time() + 30  # (a bound for a stuck test only)
        while len(sink.events) < 2 and not task.done():
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        running = not task.done()
        task.cancel()
        return running, sorted(e.type for e in sink.events)

    return asyncio.run(scenario())


def _closed_after_assigning(
    index: Callable[[Iterable[int]], Awaitable[tuple[dict, dict]]],
    meanwhile: Callable[[Scheduler], None] = lambda scheduler: None,
) -> list[str]:
    """What a scheduler assigned partition 0 closes, its due work read by `index`: `s1` asked
    q1, due a second ago. `meanwhile` runs between the assignment and its load's end."""
    asked = _asked("s1", "q1", DEADLINE)

    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        return {"s1": Folded(asked.state, asked.mark)} if "s1" in ids else {}

    async def scenario() -> list[str]:
        sink = Sink()
        clock = Clock(DEADLINE + timedelta(seconds=1))
        scheduler = Scheduler(lookup, index, sink, Compactor(), clock=clock)  # type: ignore[arg-type]
        await scheduler.assign([0])  # returns at once, whatever Redis does
        meanwhile(scheduler)
        await scheduler.loaded()
        await scheduler.tick()
        return [e.session_id for e in sink.events]

    return asyncio.run(scenario())


def test_an_assignment_with_redis_away_neither_raises_nor_loses_the_indexed_deadlines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The assignment runs in the consumer's rebalance, where an exception ends the worker (and
    each exit rebalances the others): its index read is retried in the background instead."""
    reads = {"failures": 2}

    async def index(partitions: Iterable[int]) -> tuple[dict, dict]:
        if reads["failures"]:
            reads["failures"] -= 1
            raise ProjectionError("Redis is away")
        return {"s1": (ceil_ms(DEADLINE), 0)}, {}

    assert _closed_after_assigning(index) == ["s1"]
    assert reads["failures"] == 0
    assert caplog.text.count("could not read the due work of partitions [0], retrying") == 1


def test_an_answer_committed_while_the_assignment_reads_the_index_is_not_undone() -> None:
    """The index read began before the answer's commit: the deadline it returns is stale."""
    answered = _update(
        [
            started(session_id="s1"),
            ask("q1", expires_at=format_instant(DEADLINE), session_id="s1"),
            answer("q1", "yes", session_id="s1"),
        ]
    )
    assert answered.state.question is None
    release = asyncio.Event()

    async def index(partitions: Iterable[int]) -> tuple[dict, dict]:
        await release.wait()
        return {"s1": (ceil_ms(DEADLINE), 0)}, {}

    def answer_committed(scheduler: Scheduler) -> None:
        scheduler.observe([answered])
        release.set()

    assert _closed_after_assigning(index, answer_committed) == []


def test_a_failed_state_read_neither_ends_the_loop_nor_loses_the_due_work() -> None:
    running, sent = _through_failed_reads(fails=1)
    assert running
    assert sent == sorted([ev.ANSWER_WINDOW_CLOSED, ev.COMPACTED])


def test_failed_state_reads_are_logged_once_a_streak(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=scheduler_module.__name__):
        running, sent = _through_failed_reads(fails=3)
    assert running and len(sent) == 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "Connection refused" in errors[0].getMessage()


def test_a_failed_state_read_does_not_hold_back_a_prepared_closing() -> None:
    async def scenario() -> list[str]:
        asked = _asked("s1", "q1", DEADLINE)
        turns = [turn("user", f"t{i}", session_id="s2") for i in range(10)]
        long = _update([started(session_id="s2"), *turns])
        states = {"s1": Folded(asked.state, asked.mark), "s2": Folded(long.state, long.mark)}
        sink, clock, reads = Sink(), Clock(DEADLINE - timedelta(seconds=1)), Flaky(states, 0)
        scheduler = _reads_failing(reads, sink, clock)
        index = {"s1": (ceil_ms(DEADLINE), 0)}
        await scheduler.prepare(index, {})
        reads.fails = 1_000_000  # Redis goes away
        await scheduler.prepare(index, {"s2": 0})  # compaction work, which needs a read
        clock.now = DEADLINE + timedelta(milliseconds=5)
        await scheduler._send_due()
        await asyncio.gather(*scheduler._sending)
        return [e.session_id for e in sink.events]

    assert asyncio.run(scenario()) == ["s1"]


# -- the standalone scheduler: due work polled from the indexes, prepared ahead of time ----------


def _polled(scheduler: Scheduler, deadlines: dict, due: dict | None = None) -> None:
    asyncio.run(scheduler.prepare(deadlines, due or {}))


def _counting(states: dict[str, Folded], clock: Clock, sink: Sink) -> tuple[Scheduler, list]:
    reads: list[list[str]] = []

    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        reads.append(list(ids))
        return {i: states[i] for i in ids if i in states}

    async def no_index(parts: Iterable[int]) -> tuple[dict, dict]:
        return {}, {}

    return Scheduler(lookup, no_index, sink, Compactor(), clock=clock, prepare_chunk=2), reads


def _asked(sid: str, qid: str, deadline: datetime) -> SessionUpdate:
    return _update(
        [started(session_id=sid), ask(qid, session_id=sid, expires_at=format_instant(deadline))]
    )


def test_a_polled_deadline_is_prepared_ahead_and_closed_without_reading_the_state_again() -> None:
    u = _asked("s1", "q1", DEADLINE)
    clock, sink = Clock(DEADLINE - timedelta(seconds=1)), Sink()
    scheduler, reads = _counting({"s1": Folded(u.state, u.mark)}, clock, sink)
    _polled(scheduler, {"s1": (ceil_ms(DEADLINE), 3)})
    assert reads == [["s1"]]
    asyncio.run(scheduler.tick())
    assert sink.events == []  # not due yet
    clock.now = DEADLINE + timedelta(milliseconds=2)
    asyncio.run(scheduler.tick())
    assert reads == [["s1"]]  # no read at the deadline
    [closing] = sink.events
    assert closing.type == ev.ANSWER_WINDOW_CLOSED
    assert closing.payload["question_id"] == "q1"
    assert closing.payload["at"] == clock.now  # when it noticed, not the deadline
    assert scheduler.stats.closings == 1 and scheduler.stats.lateness.count == 1


def test_polled_deadlines_are_read_in_small_chunks_earliest_first() -> None:
    updates = {f"s{i}": _asked(f"s{i}", "q", DEADLINE + timedelta(seconds=5 - i)) for i in range(5)}
    states = {sid: Folded(u.state, u.mark) for sid, u in updates.items()}
    scheduler, reads = _counting(states, Clock(DEADLINE - timedelta(seconds=1)), Sink())
    deadlines = {sid: (ceil_ms(u.state.question.deadline()), 0) for sid, u in updates.items()}  # type: ignore[union-attr]
    _polled(scheduler, deadlines)
    assert reads == [["s4", "s3"], ["s2", "s1"], ["s0"]]
    assert scheduler.next_deadline_ms() == ceil_ms(DEADLINE + timedelta(seconds=1))


def test_the_same_polled_deadline_is_read_once_and_closed_once() -> None:
    u = _asked("s1", "q1", DEADLINE)
    clock, sink = Clock(DEADLINE - timedelta(seconds=1)), Sink()
    scheduler, reads = _counting({"s1": Folded(u.state, u.mark)}, clock, sink)
    index = {"s1": (ceil_ms(DEADLINE), 0)}
    _polled(scheduler, index)
    _polled(scheduler, index)
    assert reads == [["s1"]]
    clock.now = DEADLINE + timedelta(seconds=1)
    asyncio.run(scheduler.tick())
    _polled(scheduler, index)  # the projector has not folded the closing yet
    asyncio.run(scheduler.tick())
    assert len(sink.events) == 1


def test_a_polled_deadline_whose_question_was_answered_is_not_prepared() -> None:
    u = _asked("s1", "q1", DEADLINE)
    clock, sink = Clock(DEADLINE + timedelta(seconds=1)), Sink()
    answered = Folded(replace(u.state, question=None), u.mark)
    scheduler, _ = _counting({"s1": answered}, clock, sink)
    _polled(scheduler, {"s1": (ceil_ms(DEADLINE), 0)})
    asyncio.run(scheduler.tick())
    assert sink.events == [] and scheduler.next_deadline_ms() is None


def test_a_prepared_deadline_that_leaves_the_index_is_dropped() -> None:
    u = _asked("s1", "q1", DEADLINE)
    clock, sink = Clock(DEADLINE - timedelta(seconds=1)), Sink()
    scheduler, _ = _counting({"s1": Folded(u.state, u.mark)}, clock, sink)
    _polled(scheduler, {"s1": (ceil_ms(DEADLINE), 0)})
    _polled(scheduler, {})  # answered: the projector removed it from the deadlines index
    clock.now = DEADLINE + timedelta(seconds=1)
    asyncio.run(scheduler.tick())
    assert sink.events == [] and scheduler.next_deadline_ms() is None


def test_an_index_entry_behind_the_state_waits_for_the_next_poll() -> None:
    u = _asked("s1", "q2", DEADLINE + timedelta(minutes=5))  # re-asked with a later deadline
    scheduler, _ = _counting({"s1": Folded(u.state, u.mark)}, Clock(DEADLINE), Sink())
    _polled(scheduler, {"s1": (ceil_ms(DEADLINE), 0)})
    assert scheduler.next_deadline_ms() is None


def test_polled_compaction_work_is_emitted() -> None:
    u = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
    sink = Sink()
    states = {"s1": Folded(u.state, u.mark)}
    scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
    _polled(scheduler, {}, {"s1": 0})
    asyncio.run(scheduler.tick())
    _polled(scheduler, {}, {"s1": 0})  # still in the index until the compaction is folded
    asyncio.run(scheduler.tick())
    assert [e.type for e in sink.events] == [ev.COMPACTED]


class HeldSummarizer:
    """Writes a summary only once released, from whichever thread it was called on."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.threads: list[int] = []

    def summarize(self, session: object, through: int) -> str:
        self.threads.append(threading.get_ident())
        assert self.release.wait(10), "never released"
        return "summary"


def test_a_summary_being_written_holds_back_no_closing_that_falls_due_meanwhile() -> None:
    """Summaries are written on a thread and out of the tick: a slow summarizer (say, a model)
    delays its own compaction, not a closing due in the same tick nor one falling due while it
    writes; and the loop is not blocked (the summarizer is released from the loop itself)."""
    summarizer = HeldSummarizer()

    async def scenario() -> tuple[list[str], list[str], list[str]]:
        compacting = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        first = _asked("s2", "q2", DEADLINE)
        later = _asked("s3", "q3", DEADLINE + timedelta(seconds=5))
        states = {u.session_id: Folded(u.state, u.mark) for u in (compacting, first, later)}
        sink, clock = Sink(), Clock(DEADLINE + timedelta(seconds=1))
        scheduler = _scheduler(states, clock, sink)
        scheduler.compactor = Compactor(max_turns=6, keep_recent=2, summarizer=summarizer)
        scheduler.observe([compacting, first, later])
        task = asyncio.create_task(scheduler.run())
        while not summarizer.threads:
            await asyncio.sleep(0.001)
        in_the_same_tick = [e.session_id for e in sink.events]
        clock.now = DEADLINE + timedelta(seconds=6)  # s3's deadline passes while it writes
        scheduler._wake.set()  # (the clock is fake: nudge the sleeping loop)
        for _ in range(200):
            if len(sink.events) == 2:
                break
            await asyncio.sleep(0.005)
        while_writing = [e.session_id for e in sink.events]
        summarizer.release.set()
        for _ in range(200):
            if len(sink.events) == 3:
                break
            await asyncio.sleep(0.005)
        task.cancel()
        return in_the_same_tick, while_writing, [e.type for e in sink.events]

    in_the_same_tick, while_writing, sent = asyncio.run(scenario())
    assert in_the_same_tick == ["s2"]
    assert while_writing == ["s2", "s3"]
    assert sent == [ev.ANSWER_WINDOW_CLOSED, ev.ANSWER_WINDOW_CLOSED, ev.COMPACTED]
    assert summarizer.threads and threading.get_ident() not in summarizer.threads


class FailingOnce:
    """Fails its first summary, then writes them."""

    def __init__(self) -> None:
        self.calls = 0

    def summarize(self, session: object, through: int) -> str:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the model is down")
        return "summary"


def test_a_summarizer_that_raises_neither_ends_the_loop_nor_loses_the_compaction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> list[str]:
        compacting = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        asked = _asked("s2", "q2", DEADLINE + timedelta(seconds=5))
        states = {u.session_id: Folded(u.state, u.mark) for u in (compacting, asked)}
        sink, clock = Sink(), Clock(DEADLINE)
        scheduler = _scheduler(states, clock, sink)
        scheduler.compactor = Compactor(max_turns=6, keep_recent=2, summarizer=FailingOnce())
        scheduler.observe([compacting, asked])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.02)
        clock.now = DEADLINE + timedelta(seconds=6)
        scheduler._wake.set()
        for _ in range(200):  # retried after the backoff's first pause (0.05 s)
            if len(sink.events) == 2:
                break
            await asyncio.sleep(0.005)
        alive = not task.done()
        task.cancel()
        assert alive
        return sorted(e.type for e in sink.events)

    assert asyncio.run(scenario()) == sorted([ev.ANSWER_WINDOW_CLOSED, ev.COMPACTED])
    assert (
        "could not write 1 summar(ies), retrying in 0.05s: RuntimeError('the model is down')"
        in (caplog.text)
    )


# -- sending: the loop does not wait for acks; a failed send is retried -------------------------


class HeldSink(Sink):
    """Records what was sent at once; acknowledges only when released (or fails if told to)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.fail_next = 0

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        await super().publish_many(records)  # "sent": in the producer's queue
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("broker gone")
        await self.release.wait()


def test_the_loop_sends_the_next_deadline_while_the_previous_acks_are_awaited() -> None:
    async def scenario() -> tuple[list[str], int]:
        clock, sink = Clock(DEADLINE - timedelta(seconds=1)), HeldSink()
        first, second = _asked("s1", "q1", DEADLINE), _asked("s2", "q2", DEADLINE)
        states = {u.session_id: Folded(u.state, u.mark) for u in (first, second)}
        scheduler = _scheduler(states, clock, sink)
        scheduler.observe([first])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.01)
        clock.now = DEADLINE + timedelta(milliseconds=1)
        scheduler._wake.set()  # the clock is fake: nudge the sleeping loop
        await asyncio.sleep(0.01)
        # s1's closing is sent but not acknowledged; s2's deadline is learned now.
        scheduler.observe([second])
        await asyncio.sleep(0.01)
        sent = [e.session_id for e in sink.events]
        acked = scheduler.stats.closings
        sink.release.set()
        await scheduler.drain()
        task.cancel()
        return sent, acked

    sent, acked_before_release = asyncio.run(scenario())
    assert sent == ["s1", "s2"]
    assert acked_before_release == 0  # counted only once acknowledged


def test_a_closing_whose_send_failed_is_sent_again() -> None:
    async def scenario() -> tuple[list[str], int]:
        u = _asked("s1", "q1", DEADLINE)
        clock, sink = Clock(DEADLINE + timedelta(milliseconds=5)), HeldSink()
        sink.release.set()
        sink.fail_next = 1
        scheduler = _scheduler({"s1": Folded(u.state, u.mark)}, clock, sink)
        scheduler.observe([u])
        await scheduler.tick()  # sent, then the ack failed: scheduled again
        assert scheduler.next_deadline_ms() == ceil_ms(DEADLINE)
        await scheduler.tick()
        return [e.event_id for e in sink.events], scheduler.stats.closings

    event_ids, closings = asyncio.run(scenario())
    assert len(event_ids) == 2 and len(set(event_ids)) == 1  # the same closing, resent
    assert closings == 1


def test_a_compaction_whose_send_failed_is_sent_again() -> None:
    async def scenario() -> list[str]:
        u = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        sink = HeldSink()
        sink.release.set()
        sink.fail_next = 1
        states = {"s1": Folded(u.state, u.mark)}
        scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
        scheduler.observe([u])
        await scheduler.tick()
        await scheduler.tick()
        return [e.type for e in sink.events]

    assert asyncio.run(scenario()) == [ev.COMPACTED, ev.COMPACTED]


def test_a_send_that_keeps_failing_is_retried_after_growing_pauses_not_at_once() -> None:
    async def scenario() -> int:
        u = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        sink = HeldSink()
        sink.release.set()
        sink.fail_next = 1_000_000  # e.g. a record the broker will never take
        states = {"s1": Folded(u.state, u.mark)}
        scheduler = _scheduler(states, Clock(DEADLINE), sink, max_turns=6, keep_recent=2)
        scheduler.observe([u])
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(1.0)
        task.cancel()
        return len(sink.events)

    # Pauses of 0.05, 0.1, 0.2, 0.4 s...: five sends or so in a second (hundreds without them).
    assert 3 <= asyncio.run(scenario()) <= 8


class RefusesCompactions(Sink):
    """Takes closings; refuses every send that holds a compaction (a record it never takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        if any(EventCodec().decode(value).type == ev.COMPACTED for _, value, _ in records):
            self.refused += 1
            raise ConnectionError("record too large")
        await super().publish_many(records)


def test_a_compaction_that_keeps_failing_never_holds_back_or_repeats_a_closing() -> None:
    async def scenario() -> tuple[list[str], int, int]:
        long = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        asked = _asked("s2", "q2", DEADLINE)
        states = {"s1": Folded(long.state, long.mark), "s2": Folded(asked.state, asked.mark)}
        sink = RefusesCompactions()
        clock = Clock(DEADLINE + timedelta(milliseconds=5))
        scheduler = _scheduler(states, clock, sink, max_turns=6, keep_recent=2)
        scheduler.observe([long, asked])  # both due in the same tick
        task = asyncio.create_task(scheduler.run())
        deadline = asyncio.get_running_loop().time() + 30  # (a bound for a stuck test only)
        while sink.refused < 3 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        return (
            [e.type for e in sink.events],
            scheduler.stats.closings,
            sink.refused,
            (scheduler._compact_retry_s),
        )

    sent, closings, refused, pause = asyncio.run(scenario())
    assert refused >= 3  # the compaction alone retried, again and again
    assert sent == [ev.ANSWER_WINDOW_CLOSED] and closings == 1  # once, acknowledged at once
    assert pause > 0.05  # after its own growing pauses (the first is 0.05 s)


def test_a_tick_with_closings_only_keeps_the_compactions_backoff_growing() -> None:
    async def scenario() -> float:
        long = _update([started(), *[turn("user", f"t{i}") for i in range(10)]])
        asked = _asked("s2", "q2", DEADLINE)
        states = {"s1": Folded(long.state, long.mark), "s2": Folded(asked.state, asked.mark)}
        clock = Clock(DEADLINE - timedelta(seconds=1))
        scheduler = _scheduler(states, clock, RefusesCompactions(), max_turns=6, keep_recent=2)
        scheduler.observe([long])
        await scheduler._send_due()  # the compaction fails: its pause starts at 0.05 s
        await asyncio.sleep(0.01)
        scheduler.observe([asked])
        clock.now = DEADLINE + timedelta(milliseconds=5)
        await scheduler._send_due()  # a closing alone, acknowledged
        await asyncio.gather(*scheduler._sending)
        return scheduler._compact_retry_s

    assert asyncio.run(scenario()) == 0.05


def test_a_failed_compaction_is_not_put_back_once_its_partition_moved_away() -> None:
    async def scenario() -> dict[str, int]:
        long = _update([started(), *[turn("user", f"t{i}") for i in range(10)]], partition=0)
        states = {"s1": Folded(long.state, long.mark)}
        scheduler = _scheduler(
            states, Clock(DEADLINE), RefusesCompactions(), max_turns=6, keep_recent=2
        )
        scheduler.owned = {0}
        scheduler.observe([long])
        await scheduler._send_due()
        while scheduler._sending:  # written, then refused; to be put back after 0.05 s ...
            await asyncio.gather(*scheduler._sending)
        assert scheduler._later
        scheduler.owned = {1}  # ... but partition 0 went to another worker meanwhile
        await asyncio.gather(*scheduler._later)
        return dict(scheduler._compact)

    assert asyncio.run(scenario()) == {}


def _reasked_while_the_failed_closing_waits(sink: HeldSink) -> list[tuple[str, object]]:
    """Standalone: q1's closing is sent and fails; while it waits to be sent again, q1 is asked
    again as q2 (due in an hour) and prepared. What the scheduler then sends."""

    async def scenario() -> list[tuple[str, object]]:
        first = _asked("s1", "q1", DEADLINE)
        later = DEADLINE + timedelta(hours=1)
        second = _asked("s1", "q2", later)
        states = {"s1": Folded(first.state, first.mark)}
        clock = Clock(DEADLINE - timedelta(seconds=1))
        sink.fail_next = 1
        scheduler, _ = _counting(states, clock, sink)
        await scheduler.prepare({"s1": (ceil_ms(DEADLINE), 0)}, {})
        task = asyncio.create_task(scheduler.run())
        await asyncio.sleep(0.01)
        clock.now = DEADLINE + timedelta(milliseconds=1)
        scheduler._wake.set()
        await asyncio.sleep(0.01)  # q1's closing sent; it fails
        states["s1"] = Folded(second.state, second.mark)
        await scheduler.prepare({"s1": (ceil_ms(later), 0)}, {})
        await asyncio.sleep(0.2)
        task.cancel()
        return [(e.type, e.payload.get("question_id")) for e in sink.events]

    return asyncio.run(scenario())


def test_a_failed_send_never_closes_the_question_asked_again_meanwhile() -> None:
    sink = HeldSink()
    sink.release.set()
    sent = _reasked_while_the_failed_closing_waits(sink)
    assert (ev.ANSWER_WINDOW_CLOSED, "q1") in sent  # the first asking's closing went out
    assert (ev.ANSWER_WINDOW_CLOSED, "q2") not in sent  # the second's deadline is an hour away


class _SlowFailing(HeldSink):
    """Fails its first sends after a while (a broker's timeout), then takes everything."""

    async def publish_many(self, records: Sequence[Any]) -> None:
        for key, value, headers in records:
            await self.publish(key, value, headers)
        if self.fail_next:
            self.fail_next -= 1
            await asyncio.sleep(0.05)
            raise ConnectionError("timed out")


def test_the_same_with_a_send_that_fails_slowly_and_no_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scheduler_module, "_RETRY_FIRST_S", 0.0)
    sent = _reasked_while_the_failed_closing_waits(_SlowFailing())
    assert (ev.ANSWER_WINDOW_CLOSED, "q1") in sent
    assert (ev.ANSWER_WINDOW_CLOSED, "q2") not in sent


def test_a_closing_that_named_an_asking_answered_and_asked_again_does_not_stop_the_new_one() -> (
    None
):
    """Standalone: between two polls q1 is answered and asked again with the same id and the same
    deadline (the index never drops the session). The closing prepared for the first asking is a
    no-op once folded; the second asking is still closed at its deadline."""
    events = [started(), ask("q1", expires_at=format_instant(DEADLINE))]
    first = _update(events)
    again = [*events, answer("q1"), ask("q1", expires_at=format_instant(DEADLINE))]
    reasked = _update(again)
    assert first.state.question is not None and reasked.state.question is not None
    old_seq, new_seq = first.state.question.seq, reasked.state.question.seq
    assert old_seq != new_seq
    states = {"s1": Folded(first.state, first.mark)}
    clock, sink = Clock(DEADLINE - timedelta(seconds=1)), Sink()
    scheduler, _ = _counting(states, clock, sink)
    index = {"s1": (ceil_ms(DEADLINE), 0)}
    _polled(scheduler, index)  # prepared for the first asking
    states["s1"] = Folded(reasked.state, reasked.mark)  # answered and asked again
    _polled(scheduler, index)  # the same deadline in the index: nothing read
    clock.now = DEADLINE + timedelta(milliseconds=5)
    asyncio.run(scheduler.tick())
    [stale] = sink.events
    assert stale.payload["asked_seq"] == old_seq
    folded = _update([*again, stale])  # the projector folds it: a no-op, q1 is still open
    assert folded.state.question is not None and folded.state.question.seq == new_seq
    states["s1"] = Folded(folded.state, folded.mark)
    for _ in range(3):  # the index still lists the session at the same deadline
        clock.now += timedelta(seconds=scheduler_module._RECHECK_CLOSED_S)
        _polled(scheduler, index)
        asyncio.run(scheduler.tick())
    assert [e.payload["asked_seq"] for e in sink.events] == [old_seq, new_seq]
