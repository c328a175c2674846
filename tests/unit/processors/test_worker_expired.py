"""The worker publishes nothing for an update the store did not write: a session whose projection
expired (retention) and whose id a writer reused is neither decided, nor asked, nor timed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from processors.ports import RawRecord
from processors.worker import ProjectionWorker
from projections.memory import InMemoryProjectionStore
from projections.requests import Retention
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event
from session_model.cycle import ProjectionCycle, run
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from session_model.session import Decision
from tests.unit.builders import answer, ask, make_event, started

CODEC = EventCodec()


class _AsyncStore:
    """The worker's asynchronous store calls, answered by an in-memory store."""

    def __init__(self, inner: InMemoryProjectionStore) -> None:
        self.inner = inner

    async def folded(
        self,
        session_ids: Sequence[str],
        *,
        unreadable: dict[str, str] | None = None,
        rebuilding: set[str] | None = None,
    ) -> dict[str, Folded]:
        return self.inner.folded(session_ids)

    async def commit(self, updates: Sequence[SessionUpdate]) -> Any:
        return self.inner.commit(updates)

    async def decisions(
        self, session_ids: Sequence[str], latest: Sequence[int]
    ) -> dict[str, tuple[Decision, ...]]:
        return {
            s: self.inner.facts(s).decisions[-n:] for s, n in zip(session_ids, latest, strict=True)
        }


class _Sink:
    def __init__(self) -> None:
        self.published: list[tuple[bytes | None, bytes]] = []

    async def publish_many(self, records: Sequence[Any]) -> None:
        self.published.extend((key, value) for key, value, _ in records)


def _raw(event: Event, offset: int) -> RawRecord:
    return RawRecord(event.session_id.encode(), CODEC.encode(event), 0, offset, "sessions.events")


def _asked_and_answered(sid: str) -> list[Event]:
    return [
        started(session_id=sid),
        ask("q1", expires_at="2999-01-01T00:00:00Z", session_id=sid),
        answer("q1", "yes", session_id=sid),
        ask("q2", expires_at="2999-01-01T00:00:00Z", session_id=sid),  # left open: a deadline
    ]


def test_a_reused_id_of_an_expired_session_publishes_no_decision_change_or_deadline() -> None:
    store = InMemoryProjectionStore(retention=Retention(1000))
    ended = [started(session_id="x"), make_event(ev.ENDED, {"because": "done"}, session_id="x")]
    run(
        ProjectionCycle(BatchFolder()).project(
            [Record(e, Position(0, i)) for i, e in enumerate(ended)]
        ),
        store,
    )
    assert store.expire_due(ended[-1].occurred_at + timedelta(seconds=1)) == ["x"]

    decisions, questions = _Sink(), _Sink()
    worker = ProjectionWorker(
        _AsyncStore(store),  # type: ignore[arg-type]
        BatchFolder(),
        _Sink(),
        decisions,
        questions=questions,
    )
    offered: list[str] = []  # what the timer feed (a listener) is offered
    worker.listeners.append(lambda updates: offered.extend(u.session_id for u in updates))
    events = [*_asked_and_answered("x"), *_asked_and_answered("y")]  # x: a writer reused it
    raws = [_raw(e, len(ended) + i) for i, e in enumerate(events)]

    committed = asyncio.run(worker.process(raws))

    assert [u.session_id for u in committed] == ["y"]
    assert offered == ["y"]
    assert {CODEC.decode_decision(v)["session_id"] for _, v in decisions.published} == {"y"}
    assert len(decisions.published) == 1
    changed = {CODEC.decode_question_change(v)["session_id"] for _, v in questions.published}
    assert changed == {"y"}
    assert worker.stats.decisions == 1
    assert store.load("x") is None and store.expired("x") is not None


class _RepliesLost(_AsyncStore):
    """Applies each commit, then loses the first reply: the client sends it again."""

    def __init__(self, inner: InMemoryProjectionStore) -> None:
        super().__init__(inner)
        self.lost = False

    async def commit(self, updates: Sequence[SessionUpdate]) -> Any:
        result = self.inner.commit(updates)
        if not self.lost:
            self.lost = True
            return self.inner.commit(updates)  # the retry: it finds its own write (a conflict)
        return result


def test_a_commit_whose_reply_was_lost_still_tells_the_listeners_its_deadlines() -> None:
    """Sent again after it was applied, the commit conflicts with itself; the re-fold finds every
    record applied. The timer must still hear of the question asked, or it never closes."""
    store = _RepliesLost(InMemoryProjectionStore())
    worker = ProjectionWorker(
        store,  # type: ignore[arg-type]
        BatchFolder(),
        _Sink(),
        _Sink(),
        questions=_Sink(),
    )
    heard: list[tuple[str, Any]] = []
    worker.listeners.append(lambda updates: heard.extend((u.session_id, u.state) for u in updates))
    events = [started(session_id="z"), ask("q1", expires_at="2999-01-01T00:00:00Z", session_id="z")]

    committed = asyncio.run(worker.process([_raw(e, i) for i, e in enumerate(events)]))

    assert committed == ()  # nothing this worker wrote, as far as its commit can tell
    assert [sid for sid, _ in heard] == ["z"]
    assert heard[0][1].question is not None and heard[0][1].question.id == "q1"
