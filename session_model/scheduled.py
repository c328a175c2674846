"""The events the scheduler appends, built in one place (the scheduler and `SessionStore` use it).

Every one carries the id its writer gives: a scheduler's come from `ScheduledIds`, a writer that
means a new event (`SessionStore.compact` called twice) passes a fresh one.
"""

from __future__ import annotations

from datetime import datetime

from schemas import events as ev
from schemas.events import Event, utc_millis
from session_model.compaction import CompactionPlan
from session_model.keyed_ids import KeyedIds


class ScheduledIds(KeyedIds):
    """A scheduler's event ids: derived from what they close or compact under a key of its own.

    Derived, so that a send tried again (its ack lost) appends a duplicate the fold drops by id.
    Keyed, so that nobody else can tell them in advance: the fold drops any event whose id it has
    seen, and an agent that appended an event of its own under a closing's id first would have
    the closing dropped as a duplicate, so that its question's deadline never ended the session
    (and its late answer was taken). Two schedulers (around a rebalance), or one and its restart,
    hold different keys: the later of their two closings, or compactions, is folded as the no-op
    the fold makes of a closing of a question already resolved, or of a cut already made, and
    takes a seq like any no-op.
    """

    __slots__ = ()

    def closing(self, session_id: str, question_seq: int) -> str:
        """The id of the closing of the question asked at `question_seq`."""
        return self.derive("window", session_id, question_seq)

    def compaction(self, session_id: str, through: int) -> str:
        """The id of the compaction of the session through `through`."""
        return self.derive("compact", session_id, through)


def window_closed(
    session_id: str,
    question_id: str,
    question_seq: int,
    now: datetime,
    producer: str,
    *,
    event_id: str,
) -> Event:
    """`answer_window_closed` for the question asked at `question_seq` (named in it: the fold
    ignores it once another asking of the id is open), closed at `now`."""
    at = utc_millis(now)
    return Event(
        event_id=event_id,
        session_id=session_id,
        type=ev.ANSWER_WINDOW_CLOSED,
        occurred_at=at,
        producer=producer,
        payload={"question_id": question_id, "at": at, "asked_seq": question_seq},
    )


def compacted(
    session_id: str,
    plan: CompactionPlan,
    now: datetime,
    producer: str,
    *,
    event_id: str,
) -> Event:
    """`compacted` with the plan's summary, through the plan's seq."""
    return Event(
        event_id=event_id,
        session_id=session_id,
        type=ev.COMPACTED,
        occurred_at=utc_millis(now),
        producer=producer,
        payload={"summary": plan.summary, "through": plan.through},
    )
