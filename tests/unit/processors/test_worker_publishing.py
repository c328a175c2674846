"""A batch's decisions and question changes are published together: one wait, not two."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Sequence
from typing import Any

import pytest

from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from schemas.errors import ProducerStoppedError
from session_model.projection import BatchFolder
from tests.unit.processors.test_worker_expired import _asked_and_answered, _AsyncStore, _raw, _Sink


class _Acked(_Sink):
    """A sink whose acknowledgement comes when the test says (`ack`); it notes when it queued."""

    def __init__(self, log: list[str], name: str, fails: bool = False) -> None:
        super().__init__()
        self.log, self.name, self.fails = log, name, fails
        self.ack = asyncio.Event()

    async def publish_many(self, records: Sequence[Any]) -> None:
        self.log.append(f"{self.name} queued")
        await self.ack.wait()
        if self.fails:
            raise ProducerStoppedError(f"publishing to {self.name} failed")  # not retried
        await super().publish_many(records)
        self.log.append(f"{self.name} acked")


def _worker(decisions: _Sink, questions: _Sink) -> ProjectionWorker:
    store = _AsyncStore(InMemoryProjectionStore())
    return ProjectionWorker(  # type: ignore[arg-type]
        store, BatchFolder(), _Sink(), decisions, questions=questions
    )


def test_both_are_queued_before_either_is_acknowledged() -> None:
    log: list[str] = []
    decisions, questions = _Acked(log, "decisions"), _Acked(log, "questions")
    worker = _worker(decisions, questions)

    async def run() -> None:
        batch = asyncio.ensure_future(
            worker.process([_raw(e, i) for i, e in enumerate(_asked_and_answered("a"))])
        )
        for _ in range(1_000):  # one after the other, the second would wait for the first's ack
            if len(log) >= 2:
                break
            await asyncio.sleep(0)
        assert log == ["decisions queued", "questions queued"]
        questions.ack.set()
        decisions.ack.set()
        await batch

    asyncio.run(run())
    assert len(decisions.published) == 1 and len(questions.published) == 3  # q1 asked, answered; q2
    assert worker.stats.decisions == 1 and worker.stats.question_changes == 3


def test_a_failure_no_retry_cures_is_raised_without_waiting_for_the_other() -> None:
    # The questions never acknowledged (a sink retrying without end, say): the decisions'
    # refusal must still end the batch, as it did when they were published in turn.
    log: list[str] = []
    decisions, questions = _Acked(log, "decisions", fails=True), _Acked(log, "questions")
    worker = _worker(decisions, questions)
    decisions.ack.set()

    async def run() -> None:
        batch = worker.process([_raw(e, i) for i, e in enumerate(_asked_and_answered("a"))])
        with pytest.raises(ProducerStoppedError, match="publishing to decisions failed"):
            await asyncio.wait_for(batch, 10)
        assert len(asyncio.all_tasks()) == 1  # the questions' publish was cancelled, not left

    asyncio.run(run())
    assert log == ["decisions queued", "questions queued"]
    assert worker.stats.question_changes == 0 and worker.stats.decisions == 0


def test_a_commit_returns_its_publishing_and_the_batch_ends_with_it() -> None:
    """The consumer runs the next batch's commit while this one publishes: the commit only
    returns the publishing, and the batch's offsets count as finished once it is done."""
    decisions, questions = _Sink(), _Sink()
    store = InMemoryProjectionStore()
    worker = ProjectionWorker(  # type: ignore[arg-type]
        _AsyncStore(store), BatchFolder(), _Sink(), decisions, questions=questions
    )

    async def run() -> None:
        prepared = await worker.prepare(
            [_raw(e, i) for i, e in enumerate(_asked_and_answered("a"))]
        )
        assert store.ids() == []
        updates, published = await worker.commit(prepared)
        assert [u.session_id for u in updates] == ["a"]
        assert store.ids() == ["a"]  # committed: readable before anything is published
        assert decisions.published == [] and questions.published == []
        assert worker.stats.last_offsets == {}
        await published
        assert len(decisions.published) == 1 and len(questions.published) == 3
        assert worker.stats.last_offsets == {0: 3}

    asyncio.run(run())


def test_a_publishing_closed_before_it_starts_leaves_no_send_never_awaited() -> None:
    """The consumer closes a batch's publishing when the batch before it was refused for good:
    nothing of it may be left behind never awaited (an error under the tests' warning filter)."""
    decisions, questions = _Sink(), _Sink()
    worker = _worker(decisions, questions)

    async def run() -> None:
        prepared = await worker.prepare(
            [_raw(e, i) for i, e in enumerate(_asked_and_answered("a"))]
        )
        _, published = await worker.commit(prepared)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            published.close()
            del published
            gc.collect()
        assert [str(w.message) for w in caught] == []

    asyncio.run(run())
    assert decisions.published == [] and questions.published == []
    assert worker.stats.last_offsets == {}
