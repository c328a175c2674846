"""The events the scheduler appends, built in one place (the scheduler and `SessionStore` use it).

The scheduler's ids are derived from what they close or compact, so two schedulers emitting the
same closing (around a rebalance) append duplicates the fold ignores. A writer that means a new
event (`SessionStore.compact` called twice) passes its own id.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from schemas import events as ev
from schemas.events import Event, utc_millis
from session_model.compaction import CompactionPlan

_NAMESPACE = uuid.UUID("9a4c2f57-1a0e-4f3b-8d1e-6d696c706173")


def window_closed(
    session_id: str,
    question_id: str,
    question_seq: int,
    now: datetime,
    producer: str,
    *,
    event_id: str | None = None,
) -> Event:
    """`answer_window_closed` for the question asked at `question_seq` (named in it: the fold
    ignores it once another asking of the id is open), closed at `now`."""
    at = utc_millis(now)
    return Event(
        event_id=event_id or str(uuid.uuid5(_NAMESPACE, f"{session_id}:window:{question_seq}")),
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
    event_id: str | None = None,
) -> Event:
    """`compacted` with the plan's summary, through the plan's seq."""
    return Event(
        event_id=event_id or str(uuid.uuid5(_NAMESPACE, f"{session_id}:compact:{plan.through}")),
        session_id=session_id,
        type=ev.COMPACTED,
        occurred_at=utc_millis(now),
        producer=producer,
        payload={"summary": plan.summary, "through": plan.through},
    )
