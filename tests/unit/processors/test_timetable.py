"""The timer's timetable on its own: what it keeps, what it forgets, against a naive model."""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Sequence
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from processors import timer as timer_module
from processors import timer_process
from processors.timer import Closing, Timetable
from processors.timer_process import TimerConfig, TimerCounters, TimerService

D = 1_767_268_800_000_000  # 2026-01-01, epoch µs
FAR = D + 50 * 365 * 86_400 * 1_000_000  # a deadline fifty years away


def _closing(sid: str = "s1", partition: int = 0, at_us: int = D, seq: int = 1) -> Closing:
    return Closing(sid, partition, at_us, f"q-{sid}-{seq}", seq)


def _bounded(table: Timetable) -> bool:
    return len(table._heap) <= 2 * len(table) + 64


# -- stale heap entries are pruned ---------------------------------------------------------------


def test_cleared_sessions_do_not_stay_in_the_heap_until_their_far_deadlines() -> None:
    table = Timetable()
    table.offer(_closing("kept", at_us=FAR))
    for i in range(10_000):
        table.offer(_closing(f"s{i}", at_us=FAR + i))
        table.clear(f"s{i}")
        assert _bounded(table)
    assert len(table) == 1 and table.next_us() == FAR


def test_a_session_asked_again_and_again_does_not_grow_the_heap() -> None:
    table = Timetable()
    for seq in range(1, 10_001):
        table.offer(_closing(at_us=FAR + seq, seq=seq))
        assert _bounded(table)
    assert table.pop_due(FAR + 20_000) == [_closing(at_us=FAR + 10_000, seq=10_000)]


def test_revoked_partitions_do_not_stay_in_the_heap() -> None:
    table = Timetable()
    for i in range(10_000):
        table.offer(_closing(f"s{i}", partition=i % 10, at_us=FAR + i))
    table.assign({0})
    assert _bounded(table) and len(table) == 1_000


# -- a closing in flight is never forgotten ------------------------------------------------------


def test_a_closing_whose_send_fails_after_the_sent_guard_was_forgotten_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timer_module, "FORGET_SENT_OVER", 0)
    table = Timetable()
    table.offer(_closing("a", at_us=D))
    table.offer(_closing("b", at_us=D + 10))
    first = table.pop_due(D + 1)
    assert table.pop_due(D + 11) == [_closing("b", at_us=D + 10)]  # forgets what was sent
    table.put_back(first, D + 20)  # a's send failed meanwhile
    assert table.pop_due(D + 21) == first


def test_an_acknowledged_closing_may_be_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timer_module, "FORGET_SENT_OVER", 0)
    table = Timetable()
    table.offer(_closing("a"))
    table.offer(_closing("b", at_us=D + 10))
    first = table.pop_due(D + 1)
    table.acknowledged(first)
    table.pop_due(D + 11)  # forgets a: it was sent for good
    table.offer(_closing("a"))  # so an offer after a rebalance schedules it again (harmless)
    assert table.pop_due(D + 12) == first


def test_a_closing_answered_while_its_send_was_in_flight_is_not_put_back() -> None:
    table = Timetable()
    table.offer(_closing("a"))
    first = table.pop_due(D + 1)
    table.clear("a")
    table.offer(_closing("a", at_us=D + 50, seq=2))  # asked again
    table.put_back(first, D + 20)
    assert table.pop_due(D + 30) == []
    assert [c.question_seq for c in table.pop_due(D + 51)] == [2]


class Broker:
    """A sink that refuses the first `fails` sends."""

    def __init__(self, fails: int) -> None:
        self.fails = fails

    async def publish(self, key: bytes | None, value: bytes, headers: Sequence[object]) -> None:
        await self.publish_many([(key, value, headers)])

    async def publish_many(self, records: Sequence[object]) -> None:
        if self.fails:
            self.fails -= 1
            raise ConnectionError("broker gone")


def _in_flight_after_a_send(fails: int) -> tuple[dict[str, int], int]:
    """What the timer service's timetable holds as in flight once a due closing's send ended,
    and how many closings it still has to make."""

    async def scenario() -> tuple[dict[str, int], int]:
        config = TimerConfig(None, "t", retry_initial=60)  # type: ignore[arg-type]
        counters = TimerCounters((ctypes.c_double * TimerCounters.size())())
        service = TimerService(config, -1, counters, sink=Broker(fails), clock=lambda: D + 1)  # type: ignore[arg-type]
        service.table.offer(_closing())
        service._fire()
        await asyncio.gather(*service._sending)
        if service._timer is not None:
            service._timer.cancel()
        return dict(service.table._in_flight), len(service.table)

    return asyncio.run(scenario())


def test_the_timer_service_tells_the_timetable_what_was_sent_for_good() -> None:
    assert _in_flight_after_a_send(fails=0) == ({}, 0)
    assert _in_flight_after_a_send(fails=1) == ({}, 1)  # refused: scheduled again instead


class Sent:
    """A broker that takes everything at once."""

    def __init__(self) -> None:
        self.records: list[object] = []

    async def publish(self, key: bytes | None, value: bytes, headers: Sequence[object]) -> None:
        await self.publish_many([(key, value, headers)])

    async def publish_many(self, records: Sequence[object]) -> None:
        self.records.extend(records)


def test_a_wall_clock_stepped_forward_does_not_leave_a_closing_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timer sleeps on the loop's monotonic clock towards a wall-clock deadline: it reads the
    wall clock again at least every `REARM_S`, so a step forward past the deadline closes it
    then, not an hour later."""
    monkeypatch.setattr(timer_process, "REARM_S", 0.02)
    wall = [D - 3_600_000_000]  # the deadline is an hour away

    async def scenario() -> int:
        config = TimerConfig(None, "t")  # type: ignore[arg-type]
        counters = TimerCounters((ctypes.c_double * TimerCounters.size())())
        broker = Sent()
        service = TimerService(config, -1, counters, sink=broker, clock=lambda: wall[0])
        service.table.offer(_closing())
        service._arm()
        await asyncio.sleep(0.05)
        wall[0] = D + 1  # NTP steps the clock an hour forward
        for _ in range(100):
            if broker.records:
                break
            await asyncio.sleep(0.01)
        if service._timer is not None:
            service._timer.cancel()
        await asyncio.gather(*service._sending)
        return len(broker.records)

    assert asyncio.run(scenario()) == 1


# -- the timetable behaves like a naive one ------------------------------------------------------


class Naive:
    """The timetable's rules over a plain dict, sorted when asked (no heap to prune)."""

    def __init__(self) -> None:
        self.owned: frozenset[int] | None = None
        self.entries: dict[str, tuple[int, Closing]] = {}
        self.sent: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}

    def offer(self, c: Closing) -> None:
        if self.owned is not None and c.partition not in self.owned:
            return
        if self.sent.get(c.session_id) == c.question_seq:
            return
        current = self.entries.get(c.session_id)
        if current is not None and (current[1] == c or current[1].question_seq > c.question_seq):
            return
        self.entries[c.session_id] = (c.deadline_us, c)

    def clear(self, sid: str) -> None:
        self.entries.pop(sid, None)
        self.sent.pop(sid, None)
        self.in_flight.pop(sid, None)

    def assign(self, partitions: frozenset[int]) -> None:
        self.owned = partitions
        self.entries = {s: e for s, e in self.entries.items() if e[1].partition in partitions}

    def next_us(self) -> int | None:
        return min((when for when, _ in self.entries.values()), default=None)

    def pop_due(self, now: int) -> list[Closing]:
        due = sorted((when, sid) for sid, (when, _) in self.entries.items() if when < now)
        closings = [self.entries.pop(sid)[1] for _, sid in due]
        self.sent.update((c.session_id, c.question_seq) for c in closings)
        self.in_flight.update((c.session_id, c.question_seq) for c in closings)
        return closings

    def acknowledged(self, closings: list[Closing]) -> None:
        for c in closings:
            if self.in_flight.get(c.session_id) == c.question_seq:
                del self.in_flight[c.session_id]

    def put_back(self, closings: list[Closing], at: int) -> None:
        for c in closings:
            sid = c.session_id
            if self.in_flight.get(sid) != c.question_seq:
                continue
            del self.in_flight[sid]
            if sid in self.entries or (self.owned is not None and c.partition not in self.owned):
                continue
            del self.sent[sid]
            self.entries[sid] = (at, c)


_SIDS = [f"s{i}" for i in range(6)]
_OPS = st.one_of(
    st.tuples(
        st.just("offer"),
        st.sampled_from(_SIDS),
        st.integers(0, 2),
        st.integers(0, 40),
        st.integers(1, 4),
    ),
    st.tuples(st.just("clear"), st.sampled_from(_SIDS)),
    st.tuples(st.just("assign"), st.frozensets(st.integers(0, 2))),
    st.tuples(st.just("pop"), st.integers(0, 60)),
    st.tuples(st.just("ack"), st.integers(0, 3)),
    st.tuples(st.just("fail"), st.integers(0, 3), st.integers(0, 60)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_OPS, max_size=120), slack=st.sampled_from([0, 1, 64]))
@example(  # found by it: a pop left more stale heap entries than live ones (no prune after it)
    ops=[
        ("offer", "s0", 0, 0, 1),
        ("offer", "s0", 0, 2, 1),
        ("offer", "s0", 0, 2, 2),
        ("offer", "s1", 0, 0, 1),
        ("offer", "s2", 0, 1, 1),
        ("clear", "s0"),
        ("offer", "s0", 0, 0, 1),
        ("offer", "s0", 0, 0, 1),
        ("pop", 1),
    ],
    slack=0,
)
def test_the_timetable_pops_what_a_naive_one_would(ops: list[tuple], slack: int) -> None:
    table, model = Timetable(), Naive()
    in_flight: list[list[Closing]] = []  # popped batches, neither acknowledged nor failed yet
    with mock.patch.object(timer_module, "STALE_SLACK", slack):
        for op in ops:
            kind = op[0]
            if kind == "offer":
                _, sid, partition, at, seq = op
                closing = Closing(sid, partition, D + at, f"q{seq}", seq)
                table.offer(closing)
                model.offer(closing)
            elif kind == "clear":
                table.clear(op[1])
                model.clear(op[1])
            elif kind == "assign":
                table.assign(op[1])
                model.assign(op[1])
            elif kind == "pop":
                due = table.pop_due(D + op[1])
                assert due == model.pop_due(D + op[1])
                if due:
                    in_flight.append(due)
            elif in_flight:
                batch = in_flight.pop(op[1] % len(in_flight))
                if kind == "ack":
                    table.acknowledged(batch)
                    model.acknowledged(batch)
                else:
                    table.put_back(batch, D + op[2])
                    model.put_back(batch, D + op[2])
            assert len(table) == len(model.entries)
            assert table.next_us() == model.next_us()
            assert len(table._heap) - len(table) <= max(slack, len(table))
        assert table.pop_due(D + 1_000) == model.pop_due(D + 1_000)
