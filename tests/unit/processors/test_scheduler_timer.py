"""The worker's timer path without Kafka or Redis: timetable, frames, feed, service, priority."""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from processors import timer
from processors.histogram import LATENESS_MS_BUCKETS, Histogram
from processors.priority import elevate
from processors.scheduler import SchedulerStats
from processors.timer import Assign, Clear, Closing, Frames, Message, Offer, Timetable, frame
from processors.timer_feed import TimerFeed, closing_of
from processors.timer_link import START_GRACE_S, TimerLink, combined
from processors.timer_process import TimerConfig, TimerCounters, TimerService
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import (
    CodecError,
    ConfigurationError,
    CorruptProjectionError,
    ProjectionError,
)
from schemas.events import Event
from session_model.deadlines import format_instant
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from tests.unit.builders import answer, ask, started

DEADLINE = datetime(2026, 1, 1, 12, 0, 0, 500000, tzinfo=UTC)
DEADLINE_US = int(DEADLINE.timestamp()) * 1_000_000 + DEADLINE.microsecond


def _closing(
    sid: str = "s1", partition: int = 0, at_us: int = DEADLINE_US, seq: int = 1
) -> Closing:
    return Closing(sid, partition, at_us, f"q-{sid}", seq)


# -- frames --------------------------------------------------------------------------------------


def test_messages_survive_the_pipe_in_any_pieces() -> None:
    messages: list[Message] = [
        Assign(frozenset({0, 3})),
        Offer((_closing("s1"), _closing("s2", 3, DEADLINE_US + 7, 4))),
        Clear(("s1",)),
        Offer(()),
    ]
    stream = b"".join(frame(m) for m in messages)
    frames = Frames()
    got = [m for i in range(0, len(stream), 5) for m in frames.feed(stream[i : i + 5])]
    assert got == messages


def test_a_broken_frame_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        list(Frames().feed(b"\x00\x00\x00\x05hello"))
    short = b'["offer",[["s1",0]]]'
    with pytest.raises(CodecError):
        list(Frames().feed(struct.pack("!I", len(short)) + short))
    with pytest.raises(CodecError):
        list(Frames().feed(struct.pack("!I", 1 << 30)))


# -- the timetable -------------------------------------------------------------------------------


def test_a_closing_is_due_only_once_its_deadline_has_strictly_passed() -> None:
    table = Timetable()
    table.offer(_closing())
    assert table.pop_due(DEADLINE_US) == []
    assert table.pop_due(DEADLINE_US + 1) == [_closing()]
    assert table.next_us() is None and len(table) == 0


def test_every_closing_due_comes_out_together_earliest_first() -> None:
    table = Timetable()
    for i in (3, 1, 2):
        table.offer(_closing(f"s{i}", at_us=DEADLINE_US + i))
    table.offer(_closing("later", at_us=DEADLINE_US + 10_000))
    due = table.pop_due(DEADLINE_US + 5)
    assert [c.session_id for c in due] == ["s1", "s2", "s3"]
    assert table.next_us() == DEADLINE_US + 10_000


def test_an_assignment_keeps_only_its_partitions_and_refuses_the_others() -> None:
    table = Timetable()
    table.offer(_closing("a", partition=0))
    table.offer(_closing("b", partition=1))
    table.assign({1, 2})
    table.offer(_closing("c", partition=0))
    table.offer(_closing("d", partition=2))
    due = table.pop_due(DEADLINE_US + 1)
    assert sorted(c.session_id for c in due) == ["b", "d"]


def test_a_cleared_session_is_not_closed_and_a_changed_deadline_replaces_the_old() -> None:
    table = Timetable()
    table.offer(_closing("a"))
    table.offer(_closing("b"))
    table.clear("a")
    table.offer(_closing("b", at_us=DEADLINE_US + 5_000, seq=2))  # re-asked, later
    table.offer(_closing("b", seq=1))  # stale news of the first question: ignored
    assert table.pop_due(DEADLINE_US + 1) == []
    assert [c.question_seq for c in table.pop_due(DEADLINE_US + 5_001)] == [2]


def test_a_sent_closing_is_not_offered_again_until_its_session_is_cleared() -> None:
    table = Timetable()
    table.offer(_closing())
    assert len(table.pop_due(DEADLINE_US + 1)) == 1
    table.offer(_closing())  # a rebalance re-offers it before the projector folded it
    assert table.pop_due(DEADLINE_US + 2) == []
    table.clear("s1")  # folded: the question is gone
    table.offer(_closing())
    assert len(table.pop_due(DEADLINE_US + 3)) == 1


def test_a_failed_closing_goes_back_unless_news_made_it_moot() -> None:
    table = Timetable()
    table.offer(_closing("a"))
    table.offer(_closing("b"))
    due = table.pop_due(DEADLINE_US + 1)
    table.clear("b")  # answered while the send was failing
    table.put_back(due, DEADLINE_US + 100)
    assert table.pop_due(DEADLINE_US + 50) == []
    assert [c.session_id for c in table.pop_due(DEADLINE_US + 101)] == ["a"]


# -- the feed ------------------------------------------------------------------------------------


class Pipe:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)


def _update(events: list[Event], partition: int = 0) -> SessionUpdate:
    records = [Record(e, Position(partition, i)) for i, e in enumerate(events)]
    return BatchFolder().fold({}, records)[0]


def _asked(sid: str, deadline: datetime = DEADLINE, partition: int = 0) -> SessionUpdate:
    return _update(
        [
            started(session_id=sid),
            ask(f"q-{sid}", session_id=sid, expires_at=format_instant(deadline)),
        ],
        partition,
    )


def _feed(
    states: dict[str, Folded] | None = None, index: dict[str, tuple[int, int]] | None = None
) -> tuple[TimerFeed, Pipe, list[list[str]]]:
    pipe, reads = Pipe(), []

    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        reads.append(list(ids))
        return {i: (states or {})[i] for i in ids if i in (states or {})}

    async def due(parts: Iterable[int]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        wanted = set(parts)
        return {s: v for s, v in (index or {}).items() if v[1] in wanted}, {}

    return TimerFeed(pipe, lookup, due, chunk=2), pipe, reads


def test_the_feed_offers_a_deadline_once_and_clears_it_when_answered() -> None:
    feed, pipe, _ = _feed()
    asked = _asked("s1")
    feed.observe([asked])
    feed.observe([asked])  # another batch touched the session: nothing new
    events = [
        started(session_id="s1"),
        ask("q-s1", session_id="s1", expires_at=format_instant(DEADLINE)),
        answer("q-s1", session_id="s1"),
    ]
    feed.observe([_update(events)])
    closing = closing_of(asked.state, 0)
    assert closing is not None and closing.deadline_us == DEADLINE_US
    assert pipe.sent == [Offer((closing,)), Clear(("s1",))]


def test_the_feed_offers_only_the_partitions_the_worker_owns() -> None:
    feed, pipe, _ = _feed()
    asyncio.run(feed.assign({1}))
    feed.observe([_asked("mine", partition=1), _asked("theirs", partition=2)])
    offered = [c.session_id for m in pipe.sent if isinstance(m, Offer) for c in m.closings]
    assert pipe.sent[0] == Assign(frozenset({1}))
    assert offered == ["mine"]


def test_an_assignment_offers_the_indexed_deadlines_earliest_first_in_chunks() -> None:
    updates = [_asked(f"s{i}", DEADLINE + timedelta(seconds=5 - i), partition=1) for i in range(5)]
    states = {u.session_id: Folded(u.state, u.mark) for u in updates}
    index = {u.session_id: (0, 1) for u in updates}
    index = {sid: (5 - int(sid[1:]), 1) for sid in index}  # the index's order: s4 first
    feed, pipe, reads = _feed(states, index)

    async def scenario() -> None:
        await feed.assign({1, 2})
        await feed.loaded()

    asyncio.run(scenario())
    assert reads == [["s4", "s3"], ["s2", "s1"], ["s0"]]
    assert pipe.sent[0] == Assign(frozenset({1, 2}))
    offered = [c.session_id for m in pipe.sent[1:] if isinstance(m, Offer) for c in m.closings]
    assert offered == ["s4", "s3", "s2", "s1", "s0"]


def test_what_a_batch_observed_during_the_load_wins_over_the_load() -> None:
    asked = _asked("s1", partition=1)
    answered = Folded(replace(asked.state, question=None), asked.mark)
    feed, pipe, _ = _feed({"s1": Folded(asked.state, asked.mark)}, {"s1": (1, 1)})

    async def scenario() -> None:
        await feed.assign({1})
        feed.observe([replace(asked, state=answered.state)])  # answered meanwhile
        await feed.loaded()

    asyncio.run(scenario())
    assert [m for m in pipe.sent if isinstance(m, Offer)] == []


def test_a_restarted_timer_is_told_everything_again() -> None:
    feed, pipe, _ = _feed()
    asyncio.run(feed.assign({0}))
    feed.observe([_asked("s1")])
    pipe.sent.clear()
    feed.replay()
    assert pipe.sent == [Assign(frozenset({0})), Offer((closing_of(_asked("s1").state, 0),))]  # type: ignore[arg-type]


def test_the_load_is_tried_again_until_the_index_can_be_read() -> None:
    asked = _asked("s1", partition=1)
    feed, pipe, _ = _feed({"s1": Folded(asked.state, asked.mark)}, {"s1": (1, 1)})
    index = feed._due_index
    calls = 0

    async def flaky(parts: Iterable[int]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ProjectionError("reading the due index failed: connection refused")
        return await index(parts)

    feed._due_index = flaky

    async def scenario() -> None:
        await feed.assign({1})
        await asyncio.wait_for(feed.loaded(), 10)

    asyncio.run(scenario())
    closing = closing_of(asked.state, 1)
    assert closing is not None
    assert [m for m in pipe.sent if isinstance(m, Offer)] == [Offer((closing,))]


def test_a_session_that_cannot_be_read_is_skipped_and_the_rest_of_the_load_offered() -> None:
    updates = [_asked(f"s{i}", DEADLINE + timedelta(seconds=i), partition=1) for i in range(3)]
    states = {u.session_id: Folded(u.state, u.mark) for u in updates}
    feed, pipe, _ = _feed(states, {u.session_id: (i, 1) for i, u in enumerate(updates)})
    read = feed._states

    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        if "s0" in ids:
            raise CorruptProjectionError("s0: the stored state cannot be read")
        return await read(ids)

    feed._states = lookup

    async def scenario() -> None:
        await feed.assign({1})
        await asyncio.wait_for(feed.loaded(), 10)

    asyncio.run(scenario())
    offered = [c.session_id for m in pipe.sent if isinstance(m, Offer) for c in m.closings]
    assert offered == ["s1", "s2"] and feed.unreadable == 1


def test_a_read_that_fails_while_redis_is_away_is_tried_again_not_skipped() -> None:
    """Only a state that cannot be decoded is skipped: a read that fails because Redis is away
    (the chunk's, then one session's while the chunk is read one by one) is tried again."""
    updates = [_asked(f"s{i}", DEADLINE + timedelta(seconds=i), partition=1) for i in range(3)]
    states = {u.session_id: Folded(u.state, u.mark) for u in updates}
    feed, pipe, reads = _feed(states, {u.session_id: (i, 1) for i, u in enumerate(updates)})
    read = feed._states
    away = ["the chunk", "s1"]  # what fails once with Redis away, in this order

    async def lookup(ids: Sequence[str]) -> dict[str, Folded]:
        if away and ((away[0] == "the chunk" and len(ids) > 1) or list(ids) == [away[0]]):
            away.pop(0)
            raise ProjectionError("reading the states failed: Connection reset by peer")
        if "s0" in ids:
            raise CorruptProjectionError("s0: the stored state cannot be read")
        return await read(ids)

    feed._states = lookup
    index, index_reads = feed._due_index, []

    async def counted(parts: Iterable[int]) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        index_reads.append(parts)
        return await index(parts)

    feed._due_index = counted

    async def scenario() -> None:
        await feed.assign({1})
        await asyncio.wait_for(feed.loaded(), 10)

    asyncio.run(scenario())
    offered = [c.session_id for m in pipe.sent if isinstance(m, Offer) for c in m.closings]
    assert away == [] and offered == ["s1", "s2"] and feed.unreadable == 1
    assert reads == [["s1"], ["s2"]] and len(index_reads) == 1  # (not read to see if Redis is up)


def test_a_big_replay_goes_in_frames_the_timer_can_read(monkeypatch: pytest.MonkeyPatch) -> None:
    feed, pipe, _ = _feed()
    asyncio.run(feed.assign({0}))
    feed.observe([_asked(f"s{i}") for i in range(200)])
    monkeypatch.setattr(timer, "MAX_FRAME", 2048)
    pipe.sent.clear()
    feed.replay()
    got = list(Frames().feed(b"".join(frame(m) for m in pipe.sent)))
    assert got[0] == Assign(frozenset({0})) and len(got) > 2
    offered = [c.session_id for m in got if isinstance(m, Offer) for c in m.closings]
    assert offered == [f"s{i}" for i in range(200)]


def test_a_reassignment_replaces_what_was_offered_with_what_the_index_says() -> None:
    far = DEADLINE + timedelta(days=1)
    first = [started(session_id="s1"), ask("q1", session_id="s1", expires_at=format_instant(far))]
    asked_again = ask("q2", session_id="s1", expires_at=format_instant(DEADLINE))
    again = _update([*first, answer("q1", session_id="s1"), asked_again], partition=1)
    states: dict[str, Folded] = {}
    index: dict[str, tuple[int, int]] = {}
    feed, pipe, _ = _feed(states, index)

    async def assigned() -> None:
        await feed.assign({1})
        await feed.loaded()

    asyncio.run(assigned())
    feed.observe([_update(first, partition=1), _asked("s2", partition=1)])
    # Out of the group meanwhile: another worker folded a new question of s1, an answer of s2.
    states["s1"] = Folded(again.state, again.mark)
    index["s1"] = (DEADLINE_US // 1000, 1)
    pipe.sent.clear()
    asyncio.run(assigned())
    closing = closing_of(again.state, 1)
    assert closing is not None and (closing.question_id, closing.deadline_us) == ("q2", DEADLINE_US)
    assert pipe.sent == [Assign(frozenset({1})), Clear(("s2",)), Offer((closing,))]
    pipe.sent.clear()
    asyncio.run(assigned())  # nothing changed: nothing offered again
    assert pipe.sent == [Assign(frozenset({1}))]


# -- the timer process's loop --------------------------------------------------------------------


class Sink:
    def __init__(self, fail: int = 0) -> None:
        self.sends: list[list[str]] = []
        self.fail = fail

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        await self.publish_many([(key, value, headers)])

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        self.sends.append([EventCodec().decode(v).session_id for _, v, _ in records])
        if self.fail:
            self.fail -= 1
            raise ConnectionError("broker gone")


def _counters() -> TimerCounters:
    return TimerCounters((ctypes.c_double * TimerCounters.size())())


async def _serve(
    sink: Sink, messages: list[Message], until_sends: int, clock_offset_us: int = 0
) -> TimerService:
    """Run a service on a real pipe with these messages; the clock runs from just before."""
    read_fd, write_fd = os.pipe()
    start_us = asyncio.get_running_loop().time()
    base_us = DEADLINE_US - 20_000 + clock_offset_us  # deadlines are 20 ms from the start

    def clock() -> int:
        return base_us + int((asyncio.get_running_loop().time() - start_us) * 1e6)

    config = TimerConfig(None, "t", retry_initial=0.01)  # type: ignore[arg-type]
    service = TimerService(config, read_fd, _counters(), sink=sink, clock=clock)
    running = asyncio.create_task(service.run())
    os.write(write_fd, b"".join(frame(m) for m in messages))
    for _ in range(500):
        if len(sink.sends) >= until_sends and not service._sending:
            break
        await asyncio.sleep(0.01)
    os.close(write_fd)  # end of file: the worker is gone
    await asyncio.wait_for(running, 5)
    os.close(read_fd)
    return service


def test_closings_due_together_are_sent_in_one_batch_and_counted_when_acknowledged() -> None:
    sink = Sink()
    closings = tuple(_closing(f"s{i}") for i in range(3))
    service = asyncio.run(_serve(sink, [Offer(closings)], 1))
    assert sink.sends == [["s0", "s1", "s2"]]
    stats = service.counters.snapshot()
    assert stats.closings == 3 and stats.lateness.count == 3


def test_a_closing_the_broker_refused_is_sent_again() -> None:
    sink = Sink(fail=1)
    service = asyncio.run(_serve(sink, [Offer((_closing(),))], 2))
    assert sink.sends == [["s1"], ["s1"]]
    assert service.counters.snapshot().closings == 1
    assert service.counters.array[TimerCounters.FAILED] == 1


def test_the_timer_closes_only_what_is_still_open_for_owned_partitions() -> None:
    sink = Sink()
    messages: list[Message] = [
        Offer((_closing("a", 0), _closing("b", 1), _closing("c", 1))),
        Assign(frozenset({1})),
        Clear(("c",)),
    ]
    asyncio.run(_serve(sink, messages, 1))
    assert sink.sends == [["b"]]


class Keeping(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []

    async def publish_many(
        self, records: Sequence[tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]]
    ) -> None:
        self.events.extend(EventCodec().decode(v) for _, v, _ in records)
        await super().publish_many(records)


def test_the_closing_closes_its_question_and_says_when_it_was_noticed() -> None:
    sink = Keeping()
    asyncio.run(_serve(sink, [Offer((_closing(),))], 1))
    [event] = sink.events
    assert event.type == ev.ANSWER_WINDOW_CLOSED
    assert event.payload["question_id"] == "q-s1"
    assert event.payload["at"] >= DEADLINE.replace(microsecond=500000)


# -- priority and stats --------------------------------------------------------------------------


def test_real_time_scheduling_when_permitted() -> None:
    calls: list[object] = []
    got = elevate(10, -5, set_scheduler=lambda *a: calls.append(a), set_priority=None)
    assert got.policy == "SCHED_FIFO 10" and got.notes == () and len(calls) == 1


def test_a_lower_nice_when_real_time_is_not_permitted_and_normal_when_neither_is() -> None:
    def refused(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    niced: list[object] = []
    got = elevate(10, -5, set_scheduler=refused, set_priority=lambda *a: niced.append(a))
    assert got.policy == "nice -5" and niced == [(os.PRIO_PROCESS, 0, -5)]
    assert "SCHED_FIFO 10 not permitted" in got.notes[0]
    neither = elevate(10, -5, set_scheduler=refused, set_priority=refused)
    assert neither.policy == "normal" and len(neither.notes) == 2
    assert elevate(0, 0).policy == "normal"


def test_the_workers_stats_add_the_timers_closings_to_its_loops() -> None:
    loop = SchedulerStats(closings=1, compactions=4)
    loop.lateness.observe(3)
    timer = SchedulerStats(closings=2, lateness=Histogram(LATENESS_MS_BUCKETS))
    timer.lateness.observe_many([0.5, 20])
    both = combined(loop, timer)
    assert (both.closings, both.compactions, both.lateness.count) == (3, 4, 3)
    assert both.lateness.total == 23.5


def test_the_timer_process_quiets_a_flood_of_the_same_producer_error() -> None:
    # A broker outage: aiokafka's producer in the timer process says the same thing many times
    # a second, into the worker's log. Run as the timer process sets its log up (its own process).
    script = (
        "import logging\n"
        "from processors.timer_process import setup_logging\n"
        "setup_logging()\n"
        "for _ in range(50):\n"
        "    logging.getLogger('aiokafka').error('Unable to update metadata from %s', [])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [line for line in done.stderr.splitlines() if "Unable to update metadata" in line]
    assert len(lines) == 3, done.stderr  # the burst a window lets through


def test_the_timer_s_loop_stamps_its_heartbeat_for_the_worker_to_watch() -> None:
    service = asyncio.run(_serve(Sink(), [Offer((_closing(),))], 1))
    assert service.counters.last_beat() > 0  # stamped from the loop's first turn
    assert service._beating is not None and service._beating.cancelled()  # and no more


@pytest.mark.parametrize("hang_s", [0.0, 1.5, float("nan")])
def test_a_hang_time_shorter_than_two_heartbeats_is_refused(hang_s: float) -> None:
    with pytest.raises(ConfigurationError, match="MILPA_SCHEDULER_TIMER_HANG_S"):
        TimerLink(TimerConfig(None, "t", hang_s=hang_s))  # type: ignore[arg-type]


class _Process:
    """A timer process's stand-in for the watchdog: alive until killed."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = 0

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed += 1


def test_the_watchdog_ends_a_silent_timer_once_and_gives_a_starting_one_its_grace() -> None:
    link = TimerLink(TimerConfig(None, "t", hang_s=5.0))  # type: ignore[arg-type]
    process = _Process()
    link._process = process  # type: ignore[assignment]
    now = time.monotonic()
    link.counters.beat(0.0)  # spawned, not beating yet: the start grace applies, not hang_s
    link._started_at = now - 20
    assert link._end_if_hung(None, 5.0) is None and process.killed == 0
    link._started_at = now - START_GRACE_S - 1
    assert link._end_if_hung(None, 5.0) is process and process.killed == 1
    assert link.hangs == 1

    beating = _Process()
    link._process = beating  # type: ignore[assignment]
    link.counters.beat(time.monotonic() - 4)  # beating, last 4 s ago: within hang_s
    assert link._end_if_hung(None, 5.0) is None
    link.counters.beat(time.monotonic() - 6)
    ended = link._end_if_hung(None, 5.0)
    assert ended is beating and beating.killed == 1
    assert link._end_if_hung(ended, 5.0) is None and beating.killed == 1  # not killed twice
    assert link.stats().timer_hangs == 2  # exported (`milpa_timer_hangs_total`)
