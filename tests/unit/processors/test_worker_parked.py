"""A record the fold raises on (a bug, not bad input) parks its partition, not the worker.

Before, the error ended the worker; the partition's next owner read the same record and ended
too, and so on through the fleet. Now the partition stops at that record, uncommitted, while the
others go on, until it is let go (a fixed worker then reads it again from the committed offset).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from schemas import events as ev
from schemas.events import Event
from session_model import fold as fold_module
from session_model.projection import BatchFolder, Folded, Position, Record
from tests.unit.builders import plan, started, turn
from tests.unit.processors.test_worker_expired import CODEC, _AsyncStore, _Sink

POISON = "a plan the fold cannot take"


@pytest.fixture
def broken_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the fold: `plan_set` raises TypeError on one text."""
    real = fold_module._HANDLERS[ev.PLAN_SET]

    def buggy(s: Any, e: Event, seq: int, auth: Any) -> Any:
        if e.payload.get("plan") == POISON:
            raise TypeError("unsupported operand type(s) for +: 'NoneType' and 'int'")
        return real(s, e, seq, auth)

    monkeypatch.setitem(fold_module._HANDLERS, ev.PLAN_SET, buggy)


def _raw(event: Event, partition: int, offset: int) -> RawRecord:
    return RawRecord(event.session_id.encode(), CODEC.encode(event), partition, offset, "events")


def _worker(store: InMemoryProjectionStore) -> tuple[ProjectionWorker, list[list[int]]]:
    worker = ProjectionWorker(
        _AsyncStore(store),  # type: ignore[arg-type]
        BatchFolder(parked={}),
        _Sink(),
        _Sink(),
        questions=_Sink(),
    )
    told: list[list[int]] = []
    worker.on_park = lambda partitions: told.append(list(partitions))
    return worker, told


def _seq(store: InMemoryProjectionStore, sid: str) -> int | None:
    session = store.load(sid)
    return None if session is None else session.seq


@pytest.mark.usefixtures("broken_fold")
def test_the_partition_stops_at_the_record_and_the_others_go_on() -> None:
    store = InMemoryProjectionStore()
    worker, told = _worker(store)
    batch = [
        _raw(started(session_id="a"), 0, 0),
        _raw(turn("user", "hi", session_id="a"), 0, 1),
        _raw(plan(POISON, session_id="a"), 0, 2),
        _raw(turn("user", "after", session_id="a"), 0, 3),
        _raw(started(session_id="c"), 0, 4),  # another session, later in the parked partition
        _raw(started(session_id="b"), 1, 0),
        _raw(turn("user", "hi", session_id="b"), 1, 1),
    ]

    prepared = asyncio.run(worker.prepare(batch))
    assert prepared.ends == {1: 1}  # the parked partition's offsets are not to be committed
    asyncio.run(worker.finish(prepared))

    assert (_seq(store, "a"), _seq(store, "c"), _seq(store, "b")) == (2, None, 2)
    assert told and all(t == [0] for t in told)
    before = len(told)
    (fault,) = worker.stats.parked.values()
    assert fault.position == Position(0, 2) and fault.session_id == "a"
    assert fault.kind == "TypeError" and fault.error.startswith("TypeError(")
    assert worker.stats.last_offsets == {1: 1}
    assert worker.stats.redelivered == 0  # the records left unfolded were not applied before

    # Later records of the parked partition wait too (fetched before the consumer paused it).
    later = [_raw(turn("user", "more", session_id="a"), 0, 5)]
    later.append(_raw(turn("user", "more", session_id="b"), 1, 2))
    asyncio.run(worker.process(later))
    assert (_seq(store, "a"), _seq(store, "b")) == (2, 3)
    # Told with every batch: the consumer forgets parked partitions at a rebalance, and a batch
    # fetched before it may find one parked in the fold after that.
    assert len(told) > before and all(t == [0] for t in told)
    assert worker.stats.redelivered == 0


def test_let_go_and_read_again_by_a_fixed_fold_nothing_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = InMemoryProjectionStore()
    worker, told = _worker(store)
    batch = [
        _raw(started(session_id="a"), 0, 0),
        _raw(plan(POISON, session_id="a"), 0, 1),
        _raw(turn("user", "after", session_id="a"), 0, 2),
    ]
    with monkeypatch.context() as m:
        real = fold_module._HANDLERS[ev.PLAN_SET]

        def buggy(s: Any, e: Event, seq: int, auth: Any) -> Any:
            raise TypeError("a bug")

        m.setitem(fold_module._HANDLERS, ev.PLAN_SET, buggy)
        asyncio.run(worker.process(batch))
        assert _seq(store, "a") == 1 and told and all(t == [0] for t in told)
    assert fold_module._HANDLERS[ev.PLAN_SET] is real

    worker.forget()  # the revocation: its next owner reads it from the committed offset
    assert worker.stats.parked == {}
    asyncio.run(worker.process(batch))  # the records again, from the committed offset (0)
    session = store.load("a")
    assert session is not None and session.seq == 3 and session.plan is not None


def test_a_rebuild_s_folder_raises_the_error() -> None:
    # Without `parked` the error is raised: a rebuild must not write states that stop short.
    def buggy(s: Any, e: Event, seq: int, auth: Any) -> Any:
        raise TypeError("a bug")

    record = Record(plan("x", session_id="a"), Position(0, 1))
    state = Folded(fold_module.fold("a", [started(session_id="a")]), Position(0, 0))
    with pytest.MonkeyPatch.context() as m:
        m.setitem(fold_module._HANDLERS, ev.PLAN_SET, buggy)
        with pytest.raises(TypeError, match="a bug"):
            BatchFolder().fold({"a": state}, [record])
