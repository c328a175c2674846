"""A stored state that does not decode parks its session's partition, not the whole worker.

Before, the worker retried the read of every batch holding such a session: every partition it
owned waited until an operator rebuilt the one session. Now only that partition waits, from the
session's first record on, uncommitted; once the state reads again (rebuilt), the worker reads the
partition again from that record, without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest

from processors.health import parked_partitions
from processors.worker import ProjectionWorker
from projections import requests
from projections.codec import session_to_blob
from projections.keys import Keys
from projections.memory import InMemoryProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import CorruptProjectionError
from schemas.events import Event
from session_model.projection import UNREADABLE, BatchFolder, Fault, Folded, Position, Record
from session_model.session import RECENT_DECISIONS, Decision, Session
from tests.unit.builders import answer, ask, started, turn
from tests.unit.processors.test_worker_expired import _AsyncStore, _Sink
from tests.unit.processors.test_worker_parked import _raw, _seq


def _damaged_read(
    session_ids: Sequence[str], damaged: set[str], unreadable: dict[str, str] | None, what: str
) -> None:
    """As the Redis store's reads: a `damaged` session fails the read, or is put in
    `unreadable` when it is given (`f"{sid}: the stored {what}"`)."""
    bad = [sid for sid in session_ids if sid in damaged]
    if bad and unreadable is None:
        raise CorruptProjectionError(f"{bad[0]}: the stored {what}")
    for sid in bad:
        assert unreadable is not None
        unreadable[sid] = f"{sid}: the stored {what}"


class _Corrupting(_AsyncStore):
    """Answers as the Redis store does for sessions whose stored state does not decode
    (`corrupt`) and for sessions whose keys were dropped (`dropped`)."""

    def __init__(self, inner: InMemoryProjectionStore) -> None:
        super().__init__(inner)
        self.corrupt: set[str] = set()
        self.dropped: set[str] = set()
        self.restoring: dict[str, str] = {}  # session -> when its `replay --session` began

    async def folded(
        self,
        session_ids: Sequence[str],
        *,
        unreadable: dict[str, str] | None = None,
        rebuilding: set[str] | None = None,
    ) -> dict[str, Folded]:
        _damaged_read(session_ids, self.corrupt, unreadable, "state cannot be read: bad zlib")
        marked = [sid for sid in session_ids if sid in self.restoring]
        for sid in marked:
            assert unreadable is not None and rebuilding is not None
            unreadable[sid] = f"{sid}: half rebuilt, by a `replay --session` of it"
            rebuilding.add(sid)
        gone = self.dropped | self.corrupt | set(marked)
        found = await super().folded(session_ids)
        return {sid: f for sid, f in found.items() if sid not in gone}


def _worker(store: _Corrupting) -> tuple[ProjectionWorker, list[list[int]], list[list[str]]]:
    worker = ProjectionWorker(
        store,  # type: ignore[arg-type]
        BatchFolder(parked={}),
        _Sink(),
        _Sink(),
        questions=_Sink(),
    )
    told: list[list[int]] = []
    heard: list[list[str]] = []
    worker.on_park = lambda partitions: told.append(list(partitions))
    worker.listeners.append(lambda updates: heard.append([u.session_id for u in updates]))
    return worker, told, heard


def _applied_before(inner: InMemoryProjectionStore) -> None:
    """Sessions a (partition 0) and b (partition 1), applied by an earlier worker."""
    earlier, _, _ = _worker(_Corrupting(inner))
    asyncio.run(
        earlier.process(
            [
                _raw(started(session_id="a"), 0, 0),
                _raw(turn("user", "hi", session_id="a"), 0, 1),
                _raw(started(session_id="b"), 1, 0),
            ]
        )
    )
    assert (_seq(inner, "a"), _seq(inner, "b")) == (2, 1)


def _damaged() -> tuple[
    InMemoryProjectionStore, _Corrupting, ProjectionWorker, list[list[int]], list[list[str]]
]:
    """Sessions a and b applied by an earlier worker, a's stored state then damaged, and a worker
    new to them (what it tells the consumer, and its listeners hear)."""
    inner = InMemoryProjectionStore()
    _applied_before(inner)
    store = _Corrupting(inner)
    store.corrupt.add("a")
    return inner, store, *_worker(store)


def test_the_partition_waits_at_the_session_s_first_record_and_the_others_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner, _store, worker, told, _ = (
        _damaged()
    )  # a worker new to these sessions: it reads their states
    batch = [
        _raw(started(session_id="c"), 0, 2),  # before it in its partition: applied
        _raw(turn("user", "lost?", session_id="a"), 0, 3),
        _raw(started(session_id="d"), 0, 4),  # after it in its partition: waits
        _raw(turn("user", "on", session_id="b"), 1, 1),
    ]
    with caplog.at_level(logging.ERROR, logger="processors.worker"):
        prepared = asyncio.run(worker.prepare(batch))
        assert prepared.ends == {1: 1}  # nothing of partition 0 is to be committed
        asyncio.run(worker.finish(prepared))

    assert (_seq(inner, "a"), _seq(inner, "b"), _seq(inner, "c"), _seq(inner, "d")) == (
        2,
        2,
        1,
        None,
    )
    (fault,) = worker.stats.parked.values()
    assert fault.position == Position(0, 3) and fault.session_id == "a"
    assert fault.kind == UNREADABLE and fault.unreadable and "bad zlib" in fault.error
    assert told and all(t == [0] for t in told)
    assert worker.stats.corrupt_reads == 1 and worker.stats.redelivered == 0
    assert "replay --session a --force" in caplog.text
    assert caplog.text.count("partition 0 parked at offset 3") == 1

    # A later batch: the parked partition's records wait (fetched before the consumer paused
    # it), and the others go on; the same state failing again is not counted or logged again.
    asyncio.run(
        worker.process(
            [
                _raw(turn("user", "more", session_id="a"), 0, 5),
                _raw(turn("user", "more", session_id="b"), 1, 2),
            ]
        )
    )
    assert (_seq(inner, "a"), _seq(inner, "b")) == (2, 3)
    assert worker.stats.corrupt_reads == 1


def test_once_the_state_reads_again_the_partition_is_read_again_from_where_it_waited() -> None:
    inner, store, worker, _, heard = _damaged()
    waiting = [
        _raw(turn("user", "one", session_id="a"), 0, 2),
        _raw(started(session_id="c"), 0, 3),
    ]
    asyncio.run(worker.process(waiting))
    assert set(worker.stats.parked) == {0}

    assert asyncio.run(worker.unparkable()) == {}  # still unreadable
    store.corrupt.discard("a")
    store.dropped.add("a")
    assert asyncio.run(worker.unparkable()) == {}  # absent: folded onto nothing it loses its past
    assert set(worker.stats.parked) == {0}

    store.dropped.discard("a")
    store.restoring["a"] = "2026-12-07T09:00:00+00:00 beef"  # a rebuild under way: half rebuilt
    assert asyncio.run(worker.unparkable()) == {}
    del store.restoring["a"]  # rebuilt (`replay --session a --force`)
    ready = asyncio.run(worker.unparkable())
    (fault,) = worker.stats.parked.values()
    assert ready == {0: fault} and fault.position == Position(0, 2)
    heard.clear()
    assert worker.unpark(ready) == {0}
    assert worker.stats.parked == {} and worker.folder.unreadable == {}
    assert heard == []  # told once the consumer reads the partition again
    worker.tell_rebuilt()
    assert heard == [["a"]]  # the listeners time the rebuilt state's deadlines again
    worker.tell_rebuilt()
    assert heard == [["a"]]  # once

    asyncio.run(worker.process(waiting))  # read again from offset 2
    assert (_seq(inner, "a"), _seq(inner, "c")) == (3, 1)


def test_a_rebuilt_session_that_parked_nothing_is_told_to_the_listeners() -> None:
    _inner, store, worker, _, heard = _damaged()
    assert asyncio.run(worker.states(["a"])) == {}  # the scheduler's read left it out
    asyncio.run(worker.reread())
    worker.tell_rebuilt()
    assert heard == [] and set(worker.folder.unreadable) == {"a"}  # still unreadable
    store.corrupt.discard("a")
    store.restoring["a"] = "2026-12-07T09:00:00+00:00 beef"
    asyncio.run(worker.reread())
    worker.tell_rebuilt()
    assert heard == [] and set(worker.folder.unreadable) == {"a"}  # half rebuilt
    del store.restoring["a"]
    asyncio.run(worker.reread())
    worker.tell_rebuilt()
    assert heard == [["a"]] and worker.folder.unreadable == {}


def test_a_fault_moved_earlier_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    inner = InMemoryProjectionStore()
    _applied_before(inner)
    store = _Corrupting(inner)
    store.corrupt.update({"a", "c"})
    worker, _, _ = _worker(store)
    with caplog.at_level(logging.ERROR, logger="processors.worker"):
        asyncio.run(worker.process([_raw(turn("user", "x", session_id="a"), 0, 5)]))
        # A re-fold of an earlier batch meets another unreadable session before it.
        asyncio.run(worker.process([_raw(started(session_id="c"), 0, 3)]))
    assert worker.stats.parked[0].position == Position(0, 3)
    assert "partition 0 parked at offset 5" in caplog.text
    assert "partition 0 parked at offset 3" in caplog.text


def test_a_session_that_reads_again_before_its_record_comes_parks_nothing() -> None:
    inner, store, worker, _, _ = _damaged()
    assert asyncio.run(worker.states(["a", "b"])).keys() == {"b"}  # the scheduler's read
    assert set(worker.folder.unreadable) == {"a"}
    store.corrupt.discard("a")
    asyncio.run(worker.states(["a"]))
    assert worker.folder.unreadable == {}
    asyncio.run(worker.process([_raw(turn("user", "on", session_id="a"), 0, 2)]))
    assert worker.stats.parked == {} and _seq(inner, "a") == 3


def test_a_rebalance_forgets_what_did_not_read() -> None:
    _inner, _store, worker, _, _ = _damaged()
    asyncio.run(worker.process([_raw(turn("user", "one", session_id="a"), 0, 2)]))
    assert worker.stats.parked and worker.folder.unreadable
    worker.forget()
    assert worker.stats.parked == {} and worker.folder.unreadable == {}


def test_the_fold_parks_at_the_first_record_of_an_unreadable_session() -> None:
    folder = BatchFolder(parked={}, unreadable={"a": "a: bad"})
    a = started(session_id="a")
    records = [
        _record(started(session_id="c"), 0, 0),
        _record(a, 0, 1),
        _record(started(session_id="d"), 0, 2),
        _record(started(session_id="e"), 1, 0),
    ]
    updates = folder.fold({}, records)
    assert sorted(u.session_id for u in updates) == ["c", "e"]
    assert folder.parked is not None and folder.parked[0].position == Position(0, 1)
    assert folder.held == 2
    # A rebuild's folder (no `parked`) never reads `unreadable`: its store raises instead.
    rebuild = BatchFolder(unreadable={"a": "a: bad"})
    assert [u.session_id for u in rebuild.fold({}, [_record(a, 0, 1)])] == ["a"]


def _record(event: Event, partition: int, offset: int) -> Record:
    return Record(event, Position(partition, offset))


def test_the_redis_read_puts_apart_a_session_that_does_not_decode_or_is_being_rebuilt() -> None:
    keys = Keys("t", partitions=2)
    ids = ["good", "bad-blob", "bad-mark", "restoring"]
    groups = requests.read_groups(keys, ids)
    raws = {
        "good": [session_to_blob(Session("good")), b"0:4", [], [], None],
        "bad-blob": [b"\x00not a state", b"0:1", [], [], None],
        "bad-mark": [session_to_blob(Session("bad-mark")), b"not a mark", [], [], None],
        "restoring": [session_to_blob(Session("restoring")), b"1:2", [], [], None],
    }
    began = {"restoring": b"2026-12-07T09:00:00+00:00 beef"}
    replies: list[object] = [[raws[sid] for sid in sids] for sids, _ in groups]
    with pytest.raises(CorruptProjectionError):
        requests.read(keys, ids).parse(replies)  # type: ignore[arg-type]

    unreadable: dict[str, str] = {}
    lenient = requests.read(keys, ids, unreadable=unreadable)
    marks = lenient.commands[len(groups) :]
    assert [c[0] for c in marks] == ["HMGET"] * len(groups)  # one per group, in its slot
    assert all(c[1] == keys.restoring(keys.partition_of(str(c[2]))) for c in marks)
    replies += [[began.get(sid) for sid in sids] for sids, _ in groups]
    found = lenient.parse(replies)  # type: ignore[arg-type]
    assert found.keys() == {"good"} and found["good"].mark == Position(0, 4)
    assert unreadable.keys() == {"bad-blob", "bad-mark", "restoring"}
    assert unreadable["bad-mark"].startswith("bad-mark: the stored projection cannot be read")
    assert unreadable["restoring"].startswith("restoring: half rebuilt, by a `replay --session`")
    assert "2026-12-07T09:00:00+00:00" in unreadable["restoring"]


def test_a_partition_parked_again_meanwhile_is_not_let_go() -> None:
    _inner, store, worker, _, _ = _damaged()
    asyncio.run(worker.process([_raw(turn("user", "one", session_id="a"), 0, 2)]))
    store.corrupt.discard("a")
    ready = asyncio.run(worker.unparkable())
    assert set(ready) == {0}
    worker.forget()  # a rebalance; a batch fetched before it parks the partition again
    store.corrupt.add("a")
    asyncio.run(worker.process([_raw(turn("user", "one", session_id="a"), 0, 2)]))
    assert worker.unpark(ready) == set()  # not the fault it was read for: it stays
    assert set(worker.stats.parked) == {0}


def test_the_timer_feed_s_read_names_a_state_that_does_not_decode() -> None:
    _inner, _store, worker, _, _ = _damaged()
    assert asyncio.run(worker.states(["a", "b"])).keys() == {"b"}
    with pytest.raises(CorruptProjectionError, match=r"^a: the stored state cannot be read"):
        asyncio.run(worker.readable_states(["a", "b"]))
    assert asyncio.run(worker.readable_states(["b"])).keys() == {"b"}


def test_records_before_the_fault_are_folded_again_after_a_conflict_and_it_moves_earlier() -> None:
    at = Position(0, 5)
    folder = BatchFolder(parked={0: Fault(at, "x", "TypeError", "TypeError('a bug')")})
    records = [_record(started(session_id=f"s{o}"), 0, o) for o in (3, 4, 5, 6)]
    updates = folder.fold({}, records)  # a re-fold of a batch with records before the fault
    assert sorted(u.session_id for u in updates) == ["s3", "s4"] and folder.held == 2
    folder.unreadable["u"] = "u: bad"
    folder.fold({}, [_record(turn("user", "x", session_id="u"), 0, 1)])
    assert folder.parked == {0: Fault(Position(0, 1), "u", UNREADABLE, "u: bad", unreadable=True)}


def test_a_session_being_rebuilt_parks_its_partition_and_is_counted_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner, store, worker, _, _ = _damaged()
    store.corrupt.discard("a")
    store.restoring["a"] = "2026-12-07T09:00:00+00:00 beef"
    with caplog.at_level(logging.WARNING, logger="processors.worker"):
        asyncio.run(worker.process([_raw(turn("user", "x", session_id="a"), 0, 2)]))
    assert set(worker.stats.parked) == {0} and _seq(inner, "a") == 2
    assert worker.stats.rebuilding_reads == 1 and worker.stats.corrupt_reads == 0
    (read,) = [r for r in caplog.records if "half rebuilt" in r.getMessage()][:1]
    assert read.levelno == logging.WARNING  # a routine restore, not damage
    since = worker.stats.rebuilding_since["a"]  # for `/readyz`: a note, for a while
    assert 0 <= time.monotonic() - since < 60
    assert worker.stats.unreadable_held == {0: {"a"}} and "a" in worker.stats.unreadable
    asyncio.run(worker.process([_raw(turn("user", "y", session_id="a"), 0, 3)]))
    assert worker.stats.rebuilding_since["a"] == since  # since the first read that found it so
    assert asyncio.run(worker.unparkable()) == {}
    del store.restoring["a"]
    ready = asyncio.run(worker.unparkable())
    assert set(ready) == {0}
    assert worker.unpark(ready) == {0}
    assert worker.stats.rebuilding_since == {}  # let go: no longer waiting
    assert worker.stats.unreadable_held == {} and worker.stats.unreadable == {}


def test_a_rebuild_that_turns_out_damaged_is_no_longer_a_routine_wait() -> None:
    _inner, store, worker, _, _ = _damaged()
    store.corrupt.discard("a")
    store.restoring["a"] = "2026-12-07T09:00:00+00:00 beef"
    asyncio.run(worker.process([_raw(turn("user", "x", session_id="a"), 0, 2)]))
    assert "a" in worker.stats.rebuilding_since
    worker.forget()  # a rebalance: read anew, now damaged
    assert worker.stats.rebuilding_since == {} and worker.stats.unreadable_held == {}
    del store.restoring["a"]
    store.corrupt.add("a")
    asyncio.run(worker.process([_raw(turn("user", "x", session_id="a"), 0, 2)]))
    assert set(worker.stats.parked) == {0} and worker.stats.rebuilding_since == {}


class _DamagedHistory(_Corrupting):
    """As `_Corrupting`, and the decisions history lists of `histories` do not decode."""

    def __init__(self, inner: InMemoryProjectionStore) -> None:
        super().__init__(inner)
        self.histories: set[str] = set()

    async def decisions(
        self,
        session_ids: Sequence[str],
        latest: Sequence[int],
        *,
        unreadable: dict[str, str] | None = None,
    ) -> dict[str, tuple[Decision, ...]]:
        _damaged_read(session_ids, self.histories, unreadable, "decisions cannot be read: [")
        found = await super().decisions(session_ids, latest)
        return {sid: d for sid, d in found.items() if sid not in self.histories}


def _published(sink: _Sink) -> list[str]:
    """The event ids of the decisions published to `sink`, in order."""
    codec = EventCodec()
    return [codec.decode_decision(value)["event_id"] for _, value in sink.published]


def test_a_redelivery_whose_decisions_history_does_not_decode_parks_only_its_partition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before, the worker retried the history read for ever: every partition it owned waited.
    inner = InMemoryProjectionStore()
    many = [started(session_id="a")]
    for n in range(RECENT_DECISIONS + 3):
        many += [ask(f"q{n}", session_id="a"), answer(f"q{n}", "yes", session_id="a")]
    redelivered = [_raw(e, 0, offset) for offset, e in enumerate(many)]
    earlier, _, _ = _worker(_Corrupting(inner))
    asyncio.run(earlier.process(redelivered))  # applied; its offsets never committed
    answers = [e.event_id for e in many if e.type == ev.QUESTION_ANSWERED]
    store = _DamagedHistory(inner)
    store.histories.add("a")
    decisions = _Sink()
    worker = ProjectionWorker(
        store,  # type: ignore[arg-type]
        BatchFolder(parked={}),
        _Sink(),
        decisions,
        questions=_Sink(),
    )
    told: list[list[int]] = []
    worker.on_park = lambda partitions: told.append(list(partitions))
    on = [_raw(started(session_id="b"), 1, 0), _raw(turn("user", "on", session_id="b"), 1, 1)]

    with caplog.at_level(logging.ERROR, logger="processors.worker"):
        # (Before, the history read was retried for ever: bounded here, that fails fast.)
        prepared = asyncio.run(asyncio.wait_for(worker.prepare([*redelivered, *on]), 30))
        assert prepared.ends == {1: 1}  # nothing of partition 0 is to be committed
        asyncio.run(worker.finish(prepared))
    (fault,) = worker.stats.parked.values()
    assert fault.position == Position(0, 0) and fault.session_id == "a" and fault.unreadable
    assert "stored decisions cannot be read" in fault.error
    assert told and all(t == [0] for t in told)
    assert _seq(inner, "b") == 2  # the other partition went on
    assert _published(decisions) == []  # none half published: all once it reads again
    assert worker.stats.corrupt_reads == 1 and worker.stats.redelivered == 0
    assert "a stored decisions history cannot be read (a: the stored decisions" in caplog.text
    assert "replay --session a --force" in caplog.text

    # A read of its state (readable) does not let the partition go: the history is read apart.
    worker.cycle.forget()
    assert set(asyncio.run(worker.readable_states(["a"]))) == {"a"}
    assert "a" in worker.folder.unreadable
    assert asyncio.run(worker.unparkable()) == {}

    store.histories.clear()  # rebuilt
    ready = asyncio.run(worker.unparkable())
    assert ready == {0: fault}
    assert worker.unpark(ready) == {0} and worker.folder.unreadable == {}
    asyncio.run(worker.process(redelivered))  # read again from offset 0
    assert _published(decisions) == answers  # every decision, in order
    assert worker.stats.parked == {} and worker.stats.redelivered == len(redelivered)


def test_sessions_that_stay_unreadable_do_not_keep_the_others_from_being_read_again() -> None:
    _inner, store, worker, _, heard = _damaged()
    store.corrupt.add("b")
    assert asyncio.run(worker.states(["a", "b"])) == {}  # the scheduler's read left both out
    store.corrupt.discard("b")  # b rebuilt, a still damaged
    for _ in range(2):
        asyncio.run(worker.reread(most=1))
    worker.tell_rebuilt()
    assert heard == [["b"]] and set(worker.folder.unreadable) == {"a"}


def test_a_held_session_whose_keys_are_dropped_stays_a_problem_until_it_is_rebuilt() -> None:
    # Damaged, its record held; then its keys dropped instead of rebuilt. A read (the timer
    # feed's, say) finds it absent: folded onto nothing it would lose its past, so it stays
    # unreadable, and `/readyz` keeps answering the problem, not "reads now".
    inner, store, worker, _, _ = _damaged()
    asyncio.run(worker.process([_raw(turn("user", "x", session_id="a"), 0, 2)]))
    store.corrupt.discard("a")
    store.dropped.add("a")
    asyncio.run(worker.states(["a"]))
    assert "a" in worker.stats.unreadable
    verdict = parked_partitions(
        dict(worker.stats.parked),
        worker.stats.unreadable_held,
        set(worker.stats.unreadable),
        worker.stats.rebuilding_since,
        now=time.monotonic(),
        stall_s=30.0,
    )
    assert verdict.notes == () and "cannot be read now" in verdict.problems[0]
    assert asyncio.run(worker.unparkable()) == {}
    store.dropped.discard("a")  # rebuilt: it reads whole, and is let go
    asyncio.run(worker.states(["a"]))
    assert "a" not in worker.stats.unreadable
    assert set(asyncio.run(worker.unparkable())) == {0}
    assert _seq(inner, "a") == 2
