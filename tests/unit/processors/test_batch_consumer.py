"""Batch delivery inside Faust: one handler call per fetch, offsets committable only after it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.consumer.group_coordinator import GroupCoordinator
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from milpa_sessions.settings import Settings
from processors.app import create_app
from processors.batch_consumer import (
    BatchApp,
    BatchConsumer,
    BatchConsumerThread,
    _finish,
    leave_group_supported,
)
from processors.ports import RawRecord
from session_model.signing import TrustedKeys

EV0 = TP("ev", 0)
EV1 = TP("ev", 1)


def record(tp: TP, offset: int) -> Any:
    """What aiokafka's getmany returns per record (the fields the consumer reads)."""
    return SimpleNamespace(
        key=b"s1", value=b"v%d" % offset, partition=tp.partition, offset=offset, topic=tp.topic
    )


_made: list[Harness] = []


@pytest.fixture(autouse=True)
def _close_harnesses() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


class Harness:
    """A BatchApp with one registered topic; nothing connects to a broker."""

    def __init__(
        self,
        fail: bool = False,
        fetch_max_wait: float | None = None,
        fetch_min_bytes: int | None = None,
    ) -> None:
        _made.append(self)
        self.app = BatchApp(
            "test-batch",
            broker="kafka://127.0.0.1:1",
            autodiscover=False,
            web_enabled=False,
            fetch_max_wait=fetch_max_wait,
            fetch_min_bytes=fetch_min_bytes,
        )
        self.calls: list[list[RawRecord]] = []
        self.offsets_seen_during_call: list[int | None] = []
        self.fail = fail
        topic = self.app.topic("ev", key_serializer="raw", value_serializer="raw")
        self.app.batch_topic(topic, self.handler)
        self.consumer: BatchConsumer = self.app.consumer
        self.assigned = {EV0, EV1}
        self.consumer.assignment = lambda: self.assigned  # type: ignore[method-assign]

    def close(self) -> None:
        """Close the event loop Faust made for its consumer thread (it never started)."""
        self.consumer._thread.thread_loop.close()

    async def handler(self, raws: Sequence[RawRecord]) -> None:
        self.offsets_seen_during_call.append(self.consumer._new_offset(EV0))
        self.calls.append(list(raws))
        if self.fail:
            raise RuntimeError("redis down")

    async def deliver(self, fetched: dict[TP, list[Any]]) -> None:
        """One round of the fetch loop, then wait for the batch's commit phase."""
        await self.consumer._deliver(fetched, self.app.batch_handlers)
        await self.consumer.settle()


class TwoPhase:
    """A handler that logs each batch's fold and commit (`fold 0`, `commit 0`: by the batch's
    first offset); a fold waits for `fold_gate`, a commit for its batch's gate, when given."""

    def __init__(
        self,
        log: list[str],
        commit_gates: dict[int, asyncio.Event] | None = None,
        fold_gate: asyncio.Event | None = None,
    ) -> None:
        self.log, self.commit_gates, self.fold_gate = log, commit_gates or {}, fold_gate

    async def __call__(self, raws: Sequence[RawRecord]) -> Any:
        first = raws[0].offset
        if self.fold_gate is not None:
            await self.fold_gate.wait()
        self.log.append(f"fold {first}")

        async def commit() -> None:
            gate = self.commit_gates.get(first)
            if gate is not None:
                await gate.wait()
            self.log.append(f"commit {first}")

        return commit()


class ThreePhase(TwoPhase):
    """A TwoPhase handler whose commit returns a third phase (`publish 0`), which waits for its
    batch's gate in `publish_gates` when given and raises `RuntimeError` for a batch in `fail`."""

    def __init__(
        self,
        log: list[str],
        publish_gates: dict[int, asyncio.Event],
        fail: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(log)
        self.publish_gates, self.fail = publish_gates, fail
        self.made: list[Any] = []

    async def __call__(self, raws: Sequence[RawRecord]) -> Any:
        first = raws[0].offset
        committing = await super().__call__(raws)

        async def publish() -> None:
            gate = self.publish_gates.get(first)
            if gate is not None:
                await gate.wait()
            if first in self.fail:
                raise RuntimeError(f"publishing batch {first} refused")
            self.log.append(f"publish {first}")

        async def commit() -> Any:
            await committing
            self.made.append(publish())
            return self.made[-1]

        return commit()


async def _two_handed_over(
    fail: frozenset[int] = frozenset(),
) -> tuple[Harness, list[str], asyncio.Event, ThreePhase]:
    """Batches 0 and 1 handed over to a `ThreePhase` handler whose batch 0 publishing waits for
    its acks (the event returned)."""
    h = Harness()
    log: list[str] = []
    acked = asyncio.Event()
    handler = ThreePhase(log, {0: acked}, fail=fail)
    h.app.batch_handlers["ev"] = handler
    for offset in (0, 1):
        await h.consumer._deliver({EV0: [record(EV0, offset)]}, h.app.batch_handlers)
    return h, log, acked, handler


async def _revocation(h: Harness, log: list[str]) -> None:
    """What a revocation waits for before it lets the partitions go, logged once it may."""
    assert await h.app.settle_within(5.0)
    log.append("let go")


def test_registering_a_topic_subscribes_it_and_names_its_handler() -> None:
    async def main() -> None:
        h = Harness()
        assert set(h.app.batch_handlers) == {"ev"}
        assert any("ev" in t.topics for t in h.app.topics)
        assert isinstance(h.consumer, BatchConsumer)

    asyncio.run(main())


def test_a_fetch_reaches_the_handler_in_one_call_with_every_partition() -> None:
    async def main() -> None:
        h = Harness()
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)], EV1: [record(EV1, 7)]})
        assert len(h.calls) == 1
        assert [(r.partition, r.offset, r.value) for r in h.calls[0]] == [
            (0, 0, b"v0"),
            (0, 1, b"v1"),
            (1, 7, b"v7"),
        ]
        assert h.calls[0][0].topic == "ev" and h.calls[0][0].key == b"s1"

    asyncio.run(main())


def test_offsets_become_committable_only_after_the_handler_returned() -> None:
    async def main() -> None:
        h = Harness()
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)], EV1: [record(EV1, 7)]})
        assert h.offsets_seen_during_call == [
            None
        ]  # nothing committable while the batch is applied
        assert h.consumer._new_offset(EV0) == 2
        assert h.consumer._new_offset(EV1) == 8
        assert set(h.consumer._filter_tps_with_pending_acks()) == {EV0, EV1}
        assert set(h.consumer._filter_tps_with_pending_acks({"other"})) == set()

    asyncio.run(main())


def test_a_failing_handler_leaves_its_offsets_uncommitted() -> None:
    async def main() -> None:
        h = Harness(fail=True)
        with pytest.raises(RuntimeError):
            await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)]})
        assert h.consumer._new_offset(EV0) is None

    asyncio.run(main())


def test_records_before_the_read_offset_are_not_delivered_again() -> None:
    async def main() -> None:
        h = Harness()
        h.consumer._read_offset[EV0] = 5  # after a seek: the next record to read
        await h.deliver({EV0: [record(EV0, 3), record(EV0, 4), record(EV0, 5), record(EV0, 6)]})
        assert [r.offset for r in h.calls[0]] == [5, 6]
        assert h.consumer._read_offset[EV0] == 6
        assert h.consumer._new_offset(EV0) == 7

    asyncio.run(main())


def test_a_fetch_of_only_old_records_calls_nothing() -> None:
    async def main() -> None:
        h = Harness()
        h.consumer._read_offset[EV0] = 10
        await h.deliver({EV0: [record(EV0, 3)]})
        assert h.calls == []
        assert h.consumer._new_offset(EV0) is None

    asyncio.run(main())


def test_a_partition_revoked_during_the_batch_is_not_marked() -> None:
    async def main() -> None:
        h = Harness()

        async def revoke_meanwhile(raws: Sequence[RawRecord]) -> None:
            h.assigned = {EV1}

        h.app.batch_handlers["ev"] = revoke_meanwhile
        await h.deliver({EV0: [record(EV0, 0)], EV1: [record(EV1, 3)]})
        assert h.consumer._new_offset(EV0) is None
        assert h.consumer._new_offset(EV1) == 4

    asyncio.run(main())


def test_a_batch_finished_while_its_partitions_are_revoked_leaves_them_unmarked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def revocation_handlers(consumer: BatchConsumer, revoked: set[TP]) -> None:
        await consumer.settle()  # as the worker's on_revoked does, the assignment still the old

    monkeypatch.setattr(faust_aiokafka.Consumer, "on_partitions_revoked", revocation_handlers)

    async def main() -> None:
        h = Harness()
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        assert h.consumer._new_offset(EV0) is None  # being committed
        await h.consumer.on_partitions_revoked({EV0})
        # A mark left for EV0 would be committed over its next owner's.
        assert EV0 not in h.consumer._finished

    asyncio.run(main())


def test_a_partition_parked_by_its_handler_is_neither_committed_nor_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def revocation_handlers(consumer: BatchConsumer, revoked: set[TP]) -> None:
        """Faust's part of a revocation, without a broker."""

    async def assignment_handlers(
        consumer: BatchConsumer, assigned: set[TP], generation_id: int = 0
    ) -> None:
        """Faust's part of an assignment, without a broker."""

    monkeypatch.setattr(faust_aiokafka.Consumer, "on_partitions_revoked", revocation_handlers)
    monkeypatch.setattr(faust_aiokafka.Consumer, "on_partitions_assigned", assignment_handlers)

    async def main() -> None:
        h = Harness()

        async def parks_ev0(raws: Sequence[RawRecord]) -> None:
            h.calls.append(list(raws))
            if any(r.partition == 0 and r.value == b"v1" for r in raws):
                h.app.park({EV0})  # as the worker does when the fold raised on EV0's record 1

        h.app.batch_handlers["ev"] = parks_ev0
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)], EV1: [record(EV1, 7)]})
        assert h.consumer._new_offset(EV0) is None  # nothing of EV0 is committed past record 1
        assert h.consumer._new_offset(EV1) == 8  # the other partition goes on
        assert EV0 in h.consumer._paused_partitions  # and EV0 is no longer fetched
        await h.deliver({EV0: [record(EV0, 2)], EV1: [record(EV1, 8)]})  # fetched before that
        assert [(r.partition, r.offset) for r in h.calls[-1]] == [(1, 8)]
        assert h.consumer._new_offset(EV0) is None and h.consumer._new_offset(EV1) == 9
        await h.consumer.on_partitions_revoked({EV0, EV1})
        assert h.consumer._parked == set()  # its next owner, this worker perhaps, reads it anew

        # A batch fetched before the revocation parks EV0 again after it: the next assignment
        # still reads it anew (the handler parks it again if its fold still cannot take it).
        h.app.park({EV0})
        h.consumer._read_offset.pop(EV0, None)  # as Faust's revocation does (stubbed here)
        await h.consumer.on_partitions_assigned({EV0, EV1})
        assert h.consumer._parked == set() and EV0 not in h.consumer._paused_partitions
        await h.deliver({EV0: [record(EV0, 0)]})
        assert [(r.partition, r.offset) for r in h.calls[-1]] == [(0, 0)]

    asyncio.run(main())


def _seeks(h: Harness, during: Any = None) -> list[dict[TP, int]]:
    """Stub the consumer thread's seek (aiokafka's): record each, run `during` while it waits."""
    seeks: list[dict[TP, int]] = []

    async def seek_wait(partitions: dict[TP, int]) -> None:
        seeks.append(dict(partitions))
        if during is not None:
            await during()

    h.consumer._thread.seek_wait = seek_wait  # type: ignore[method-assign]
    return seeks


def _accept_all(tps: set[TP]) -> set[TP]:
    return set(tps)


def test_a_parked_partition_let_go_is_read_again_from_where_it_was_parked() -> None:
    async def main() -> None:
        h = Harness()
        seeks = _seeks(h)
        log: list[str] = []
        release = asyncio.Event()  # the parking batch is still committing when `unpark` comes

        async def parks_ev0(raws: Sequence[RawRecord]) -> Any:
            phase = await TwoPhase(log, {0: release})(raws)
            if any(r.partition == 0 and r.offset == 1 for r in raws):
                h.app.park({EV0})  # the fold could not take EV0's record 1
            return phase

        h.app.batch_handlers["ev"] = parks_ev0
        await h.consumer._deliver(
            {EV0: [record(EV0, 0), record(EV0, 1), record(EV0, 2)]}, h.app.batch_handlers
        )
        told: list[set[TP]] = []

        def accept(tps: set[TP]) -> set[TP]:
            told.append(set(tps))
            return set(tps)

        since = h.app.rebalances()
        unparking = asyncio.ensure_future(h.app.unpark({EV0: 1, EV1: 4}, accept, since=since))
        await asyncio.sleep(0.01)
        assert seeks == [] and told == []  # the parking batch first: it must not mark EV0
        release.set()
        assert await unparking == {EV0}  # EV1 was not parked: not sought
        assert seeks == [{EV0: 1}] and told == [{EV0}]
        assert h.consumer._new_offset(EV0) is None  # never past the record it was parked at
        assert EV0 not in h.consumer._parked and EV0 not in h.consumer._paused_partitions
        assert h.consumer._read_offset[EV0] == 1

        h.app.batch_handlers["ev"] = TwoPhase(log)
        await h.deliver({EV0: [record(EV0, 1), record(EV0, 2)]})
        assert log[-2:] == ["fold 1", "commit 1"]
        assert h.consumer._new_offset(EV0) == 3

    asyncio.run(main())


def test_it_is_read_again_from_what_was_finished_when_that_is_before_the_fault() -> None:
    async def main() -> None:
        h = Harness()
        seeks = _seeks(h)
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)]})  # finished: EV0 settled at 2
        h.app.park({EV0})
        # Parked at 5, records 2-4 of EV0 held by a re-fold (none of them marked finished).
        assert await h.app.unpark({EV0: 5}, _accept_all, since=h.app.rebalances()) == {EV0}
        assert seeks == [{EV0: 2}] and h.consumer._read_offset[EV0] == 2

    asyncio.run(main())


def test_a_partition_the_handler_keeps_parked_stays_parked() -> None:
    async def main() -> None:
        h = Harness()
        _seeks(h)
        h.app.park({EV0, EV1})
        kept = await h.app.unpark({EV0: 3, EV1: 4}, lambda tps: {EV1}, since=h.app.rebalances())
        assert kept == {EV1} and h.consumer._parked == {EV0}
        assert EV0 in h.consumer._paused_partitions and EV1 not in h.consumer._paused_partitions

    asyncio.run(main())


def test_a_failed_batch_in_flight_is_raised_and_left_for_the_fetch_loop() -> None:
    async def main() -> None:
        h = Harness()
        seeks = _seeks(h)

        async def handler(raws: Sequence[RawRecord]) -> Any:
            async def commit() -> None:
                raise RuntimeError("redis gone for good")

            return commit()

        h.app.batch_handlers["ev"] = handler
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        h.app.park({EV0})
        with pytest.raises(RuntimeError, match="redis gone"):
            await h.app.unpark({EV0: 0}, _accept_all, since=h.app.rebalances())
        assert seeks == [] and EV0 in h.consumer._parked
        with pytest.raises(RuntimeError, match="redis gone"):
            await h.consumer.settle()  # what the fetch loop does next: it ends on it too

    asyncio.run(main())


def test_a_partition_parked_but_no_longer_assigned_is_not_sought() -> None:
    async def main() -> None:
        h = Harness()
        seeks = _seeks(h)
        h.app.park({EV0})  # by a batch fetched before a revocation took EV0 away
        h.assigned = {EV1}
        assert await h.app.unpark({EV0: 3}, _accept_all, since=h.app.rebalances()) == set()
        assert seeks == []

    asyncio.run(main())


def test_no_partition_is_let_go_across_a_rebalance(monkeypatch: pytest.MonkeyPatch) -> None:
    async def revocation_handlers(consumer: BatchConsumer, revoked: set[TP]) -> None:
        """Faust's part of a revocation, without a broker."""

    monkeypatch.setattr(faust_aiokafka.Consumer, "on_partitions_revoked", revocation_handlers)

    async def main() -> None:
        h = Harness()
        h.app.park({EV0, EV1})

        async def revoked_meanwhile() -> None:
            await h.consumer.on_partitions_revoked({EV1})

        seeks = _seeks(h, revoked_meanwhile)
        told: list[set[TP]] = []

        def accept(tps: set[TP]) -> set[TP]:
            told.append(tps)
            return tps

        since = h.app.rebalances()
        assert await h.app.unpark({EV0: 3}, accept, since=since) == set()
        assert seeks == [{EV0: 3}] and told == []
        assert EV0 in h.consumer._parked  # left to the rebalance, which reads it anew
        # Asked with a count from before a rebalance (the faults read then may be stale): no.
        h.assigned = {EV0}
        assert await h.app.unpark({EV0: 3}, accept, since=since) == set()
        assert len(seeks) == 1 and told == []

    asyncio.run(main())


def test_finished_records_are_counted_for_commit_every() -> None:
    async def main() -> None:
        h = Harness()
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)], EV1: [record(EV1, 5)]})
        assert h.consumer._n_acked == 3

    asyncio.run(main())


def test_the_commit_phase_overlaps_the_next_batch_and_batches_finish_in_order() -> None:
    async def main() -> None:
        h = Harness()
        log: list[str] = []
        release = asyncio.Event()  # batch 0's commit is slow
        h.app.batch_handlers["ev"] = TwoPhase(log, {0: release})
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        assert h.consumer._new_offset(EV0) is None  # folded, not committed
        second = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        )
        await asyncio.sleep(0.01)
        assert log == ["fold 0", "fold 1"]  # folded while batch 0 is still committing
        assert h.consumer._new_offset(EV0) is None
        release.set()
        await second
        await h.consumer.settle()
        assert log == ["fold 0", "fold 1", "commit 0", "commit 1"]
        assert h.consumer._new_offset(EV0) == 2

    asyncio.run(main())


def test_a_failed_commit_phase_is_raised_and_its_offsets_stay_uncommitted() -> None:
    async def main() -> None:
        h = Harness()

        async def handler(raws: Sequence[RawRecord]) -> Any:
            async def commit() -> None:
                raise RuntimeError("decisions topic unavailable")

            return commit()

        h.app.batch_handlers["ev"] = handler
        with pytest.raises(RuntimeError, match="decisions topic"):
            await h.deliver({EV0: [record(EV0, 0)]})
        assert h.consumer._new_offset(EV0) is None

    asyncio.run(main())


def test_the_batch_after_a_failed_one_is_never_written_and_its_commit_is_closed() -> None:
    """Folded onto the failed batch's states, it must not be written; its second phase, never
    started, is closed (not left to warn that it was never awaited)."""

    async def main() -> None:
        h = Harness()
        made: list[Any] = []
        release = asyncio.Event()

        async def handler(raws: Sequence[RawRecord]) -> Any:
            first = raws[0].offset

            async def commit() -> None:
                await release.wait()
                if first == 0:
                    raise RuntimeError("decisions topic unavailable")

            made.append(commit())
            return made[-1]

        h.app.batch_handlers["ev"] = handler
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        second = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        )
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(RuntimeError, match="decisions topic"):
            await second
        with pytest.raises(RuntimeError, match="decisions topic"):
            await h.consumer.settle()
        assert inspect.getcoroutinestate(made[1]) == inspect.CORO_CLOSED
        assert h.consumer._new_offset(EV0) is None

    asyncio.run(main())


def test_a_commit_does_not_wait_for_the_previous_publishing_which_keeps_batch_order() -> None:
    async def main() -> None:
        h, log, acked, _ = await _two_handed_over()  # batch 0's publishing waits for its acks
        await asyncio.sleep(0.01)
        # Batch 1 committed while batch 0 waits for its acks; its own publishing waits behind.
        assert log == ["fold 0", "commit 0", "fold 1", "commit 1"]
        assert h.consumer._new_offset(EV0) is None  # no offset moves before its publishing
        acked.set()
        await h.consumer.settle()
        assert log[4:] == ["publish 0", "publish 1"]
        assert h.consumer._new_offset(EV0) == 2

    asyncio.run(main())


def test_no_more_than_two_batches_publishing_behind_the_one_committing() -> None:
    async def main() -> None:
        h, log, acked, _ = await _two_handed_over()
        third = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 2)]}, h.app.batch_handlers)
        )
        await asyncio.sleep(0.01)
        assert "commit 2" in log  # folded and committed, but the fetch loop waits for batch 0
        assert not third.done()
        acked.set()
        await asyncio.wait_for(third, 5)
        await h.consumer.settle()
        assert [e for e in log if e.startswith("publish")] == [f"publish {i}" for i in range(3)]
        assert h.consumer._new_offset(EV0) == 3

    asyncio.run(main())


def test_after_a_refused_publishing_the_next_batchs_is_closed_and_no_offset_moves() -> None:
    """The next batch may be committed already (its records are redelivered, found applied and
    their decisions published again); its publishing, never started, is closed."""

    async def main() -> None:
        h, log, acked, handler = await _two_handed_over(fail=frozenset({0}))
        await asyncio.sleep(0.01)
        acked.set()
        with pytest.raises(RuntimeError, match="batch 0 refused"):
            await h.consumer.settle()
        assert log == ["fold 0", "commit 0", "fold 1", "commit 1"]
        assert inspect.getcoroutinestate(handler.made[1]) == inspect.CORO_CLOSED
        assert h.consumer._new_offset(EV0) is None

    asyncio.run(main())


def test_a_revocation_waits_for_the_publishing_of_every_batch_in_hand() -> None:
    async def main() -> None:
        h, log, acked, _ = await _two_handed_over()
        await asyncio.sleep(0.01)
        assert "commit 1" in log  # both committed: only the publishing is left
        assert not await h.app.settle_within(0.05)  # a revocation may not let go yet
        acked.set()
        assert await h.app.settle_within(5.0)
        assert log[-2:] == ["publish 0", "publish 1"]
        assert h.consumer._new_offset(EV0) == 2

    asyncio.run(main())


def test_a_failed_commit_is_raised_only_once_the_publishing_before_it_ended() -> None:
    """Whoever waits for the last batch (a revocation, a stopping worker) waits for all before
    it: a batch that failed is not done while the one before still publishes."""

    async def main() -> None:
        h = Harness()
        log: list[str] = []
        acked = asyncio.Event()
        handler = ThreePhase(log, {0: acked})
        h.app.batch_handlers["ev"] = handler
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)

        async def failing(raws: Sequence[RawRecord]) -> Any:
            async def commit() -> None:
                raise RuntimeError("redis refused batch 1")

            return commit()

        h.app.batch_handlers["ev"] = failing
        await h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        last = h.consumer._in_flight
        assert last is not None
        await asyncio.sleep(0.01)
        assert not last.done()  # batch 1 failed, but batch 0 is still publishing
        acked.set()
        with pytest.raises(RuntimeError, match="redis refused batch 1"):
            await h.consumer.settle()
        assert log[-1] == "publish 0"
        assert h.consumer._new_offset(EV0) == 1  # batch 0 finished; batch 1 did not

    asyncio.run(main())


def test_a_batch_still_committing_after_the_grace_is_left_going_and_the_next_waits() -> None:
    async def main() -> None:
        h = Harness()
        log: list[str] = []
        release = asyncio.Event()  # batch 0's send refused and retried
        h.app.batch_handlers["ev"] = TwoPhase(log, {0: release})
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        # The fetch loop folded the next batch onto it and waits before committing that one.
        waiting = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        )
        assert not await h.app.settle_within(0.02)
        await asyncio.sleep(0.01)
        # Neither cancelled nor skipped: the next batch must never be written without it.
        assert not waiting.done() and log == ["fold 0", "fold 1"]
        assert h.consumer._new_offset(EV0) is None
        release.set()
        await waiting
        await h.consumer.settle()
        assert log == ["fold 0", "fold 1", "commit 0", "commit 1"]
        assert h.consumer._new_offset(EV0) == 2

    asyncio.run(main())


def test_a_revocation_waits_for_the_batch_folded_next_not_only_the_one_committing() -> None:
    """Batch 1 is folded onto batch 0's states: a revocation that let the partitions go (and
    forgot those states) once batch 0 was written would leave batch 1 to be written after."""

    async def main() -> None:
        h = Harness()
        log: list[str] = []
        release = [asyncio.Event(), asyncio.Event()]
        h.app.batch_handlers["ev"] = TwoPhase(log, dict(enumerate(release)))
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        second = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        )
        await asyncio.sleep(0.01)  # batch 1 folded, waiting for batch 0
        revoked = asyncio.ensure_future(_revocation(h, log))
        await asyncio.sleep(0.01)
        release[0].set()
        await asyncio.sleep(0.02)
        assert log == ["fold 0", "fold 1", "commit 0"]  # still waiting, for batch 1
        release[1].set()
        await asyncio.gather(second, revoked)
        assert log == ["fold 0", "fold 1", "commit 0", "commit 1", "let go"]

    asyncio.run(main())


def test_a_revocation_that_comes_while_a_batch_is_handed_over_waits_for_its_fold() -> None:
    async def main() -> None:
        h = Harness()
        log: list[str] = []
        folding = asyncio.Event()  # the fold takes a while
        h.app.batch_handlers["ev"] = TwoPhase(log, fold_gate=folding)
        delivering = asyncio.ensure_future(
            h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        )
        await asyncio.sleep(0.01)
        revoked = asyncio.ensure_future(_revocation(h, log))
        await asyncio.sleep(0.01)
        assert log == []
        folding.set()
        await asyncio.gather(delivering, revoked)
        assert log == ["fold 0", "commit 0", "let go"]

    asyncio.run(main())


def test_records_of_a_partition_no_longer_assigned_are_not_handed_over() -> None:
    """Fetched before a rebalance took the partition away: they are its new owner's."""

    async def main() -> None:
        h = Harness()
        h.assigned = {EV1}
        await h.deliver({EV0: [record(EV0, 0)], EV1: [record(EV1, 3)]})
        assert [[(r.partition, r.offset) for r in call] for call in h.calls] == [[(1, 3)]]
        assert h.consumer._new_offset(EV0) is None and h.consumer._new_offset(EV1) == 4
        h.assigned = {EV0, EV1}  # assigned again: read from where its offsets say
        await h.deliver({EV0: [record(EV0, 0)]})
        assert h.consumer._new_offset(EV0) == 1

    asyncio.run(main())


def test_a_stopping_fetch_loop_leaves_the_batch_in_flight_to_finish() -> None:
    async def main() -> None:
        h = Harness()
        release = asyncio.Event()

        async def handler(raws: Sequence[RawRecord]) -> Any:
            async def commit() -> None:
                await release.wait()

            return commit()

        h.app.batch_handlers["ev"] = handler
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        waiter = asyncio.ensure_future(h.consumer.settle())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        release.set()
        assert await h.app.settle_within(5)  # it was not cancelled with its waiter
        assert h.consumer._new_offset(EV0) == 1

    asyncio.run(main())


def test_a_batch_that_ends_within_the_grace_is_waited_for_and_its_failure_raised() -> None:
    async def main() -> None:
        h = Harness()

        async def handler(raws: Sequence[RawRecord]) -> Any:
            async def commit() -> None:
                await asyncio.sleep(0.02)
                if raws[0].offset == 1:
                    raise RuntimeError("decisions topic unavailable")

            return commit()

        h.app.batch_handlers["ev"] = handler
        assert await h.app.settle_within(0.01)  # nothing in flight
        await h.consumer._deliver({EV0: [record(EV0, 0)]}, h.app.batch_handlers)
        assert await h.app.settle_within(5)
        assert h.consumer._new_offset(EV0) == 1
        await h.consumer._deliver({EV0: [record(EV0, 1)]}, h.app.batch_handlers)
        with pytest.raises(RuntimeError, match="decisions topic"):
            await h.app.settle_within(5)
        assert h.consumer._new_offset(EV0) == 1

    asyncio.run(main())


def test_topics_without_a_handler_take_fausts_per_record_route() -> None:
    async def main() -> None:
        h = Harness()
        seen: list[int] = []

        async def callback(message: Any) -> None:
            seen.append(message.offset)

        h.consumer.callback = callback
        other = TP("other", 0)
        fetched = [
            SimpleNamespace(
                key=None,
                value=b"x",
                partition=0,
                offset=o,
                topic="other",
                timestamp=None,
                timestamp_type=0,
                headers=[],
                checksum=None,
                serialized_key_size=0,
                serialized_value_size=1,
            )
            for o in (0, 1)
        ]
        await h.deliver({other: fetched})
        assert seen == [0, 1]
        assert h.calls == []

    asyncio.run(main())


def test_cancelling_the_fetch_loop_waits_for_the_batch_in_flight() -> None:
    finished: list[str] = []

    async def batch() -> None:
        await asyncio.sleep(0.05)
        finished.append("redis and decisions done")

    async def main() -> None:
        loop_task = asyncio.ensure_future(_finish(batch()))
        await asyncio.sleep(0.01)
        loop_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop_task
        assert finished == ["redis and decisions done"]

    asyncio.run(main())


def test_a_fold_that_ends_after_the_fetch_loop_was_cancelled_has_its_commit_closed() -> None:
    made: list[Any] = []

    async def fold() -> Any:
        await asyncio.sleep(0.05)

        async def commit() -> None:
            raise AssertionError("never run")

        made.append(commit())
        return made[-1]

    async def main() -> None:
        loop_task = asyncio.ensure_future(_finish(fold()))
        await asyncio.sleep(0.01)
        loop_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop_task
        assert inspect.getcoroutinestate(made[0]) == inspect.CORO_CLOSED

    asyncio.run(main())


def test_the_brokers_wait_for_a_fetch_is_the_apps_setting() -> None:
    async def main() -> None:
        h = Harness(fetch_max_wait=0.02, fetch_min_bytes=16384)
        thread = h.consumer._thread
        assert isinstance(thread, BatchConsumerThread)
        consumer = thread._create_worker_consumer(h.app.transport)
        try:
            assert consumer._fetch_max_wait_ms == 20
            assert consumer._fetch_min_bytes == 16384
        finally:
            await consumer.stop()

    asyncio.run(main())


def test_without_the_setting_fausts_wait_stays() -> None:
    async def main() -> None:
        h = Harness()
        consumer = h.consumer._thread._create_worker_consumer(h.app.transport)
        try:
            assert consumer._fetch_max_wait_ms == 1500
            assert consumer._fetch_min_bytes == 1
        finally:
            await consumer.stop()

    asyncio.run(main())


def test_the_workers_fetch_settings_reach_its_consumer_from_the_environment() -> None:
    async def main() -> None:
        env = {"MILPA_FETCH_MIN_BYTES": "16384", "MILPA_FETCH_MAX_WAIT": "0.05"}
        projector = create_app(Settings.from_env(env), TrustedKeys())
        app = projector.app
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        try:
            assert (consumer._fetch_min_bytes, consumer._fetch_max_wait_ms) == (16384, 50)
        finally:
            await consumer.stop()
            app.consumer._thread.thread_loop.close()

    asyncio.run(main())


def test_the_installed_aiokafka_has_the_leave_group_call_a_stalled_revocation_makes() -> None:
    """A tripwire for upgrades: `leave_group` calls aiokafka's private coordinator API."""
    assert leave_group_supported()


def test_without_aiokafkas_leave_group_call_the_worker_warns_at_start_and_sends_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delattr(GroupCoordinator, "_maybe_leave_group")
    assert not leave_group_supported()
    with caplog.at_level("WARNING", logger="processors.app"):
        create_app(Settings(), TrustedKeys.none())
    assert "_maybe_leave_group" in caplog.text
    sent: list[Any] = []
    coordinator = SimpleNamespace(_maybe_leave_group=lambda: sent.append(1))
    thread = SimpleNamespace(_consumer=SimpleNamespace(_coordinator=coordinator))
    consumer = BatchConsumer.__new__(BatchConsumer)
    consumer._thread = thread  # type: ignore[assignment]
    assert asyncio.run(consumer.leave_group(1.0)) is False
    assert sent == []


def test_a_partition_is_settled_through_what_was_finished_or_committed_before() -> None:
    """What the retention sweep may drop: applied and published by this worker (finished), or
    by whoever committed before it took the partition over."""

    async def main() -> None:
        h = Harness()
        assert h.consumer.settled(EV0) is None  # nothing known: nothing is swept there
        await h.deliver({EV0: [record(EV0, 0), record(EV0, 1)]})
        assert h.consumer.settled(EV0) == 2
        h.consumer._committed_offset[EV1] = 9  # read when it was assigned
        assert h.consumer.settled(EV1) == 9 == h.app.settled(EV1)
        await h.deliver({EV1: [record(EV1, 9), record(EV1, 10)]})
        assert h.consumer.settled(EV1) == 11

    asyncio.run(main())
