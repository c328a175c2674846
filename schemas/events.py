"""The event vocabulary and the envelope every session event travels in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from schemas.frozen import fast_init

STARTED: Final = "session.started"
TURN: Final = "session.turn"
TOOL_CALLED: Final = "session.tool_called"
MESSAGE_SENT: Final = "session.message_sent"
PLAN_SET: Final = "session.plan_set"
TODO_CHANGED: Final = "session.todo_changed"
QUESTION_ASKED: Final = "session.question_asked"
QUESTION_ANSWERED: Final = "session.question_answered"
ANSWER_WINDOW_CLOSED: Final = "session.answer_window_closed"
PERMISSION_GRANTED: Final = "session.permission_granted"
PERMISSION_REVOKED: Final = "session.permission_revoked"
MODE_CHANGED: Final = "session.mode_changed"
OPTION_REMOVED: Final = "session.option_removed"
PREREQUISITE_SET: Final = "session.prerequisite_set"
COMPACTED: Final = "session.compacted"
TODOS_TRANSFERRED: Final = "session.todos_transferred"
EFFECT_OBSERVED: Final = "session.effect_observed"
EXECUTION_RECORDED: Final = "session.execution_recorded"
ENDED: Final = "session.ended"

EVENT_TYPES: Final[tuple[str, ...]] = (
    STARTED,
    TURN,
    TOOL_CALLED,
    MESSAGE_SENT,
    PLAN_SET,
    TODO_CHANGED,
    QUESTION_ASKED,
    QUESTION_ANSWERED,
    ANSWER_WINDOW_CLOSED,
    PERMISSION_GRANTED,
    PERMISSION_REVOKED,
    MODE_CHANGED,
    OPTION_REMOVED,
    PREREQUISITE_SET,
    COMPACTED,
    TODOS_TRANSFERRED,
    EFFECT_OBSERVED,
    EXECUTION_RECORDED,
    ENDED,
)


def utc_millis(moment: datetime) -> datetime:
    """Return `moment` in UTC truncated to whole milliseconds (the wire's precision)."""
    if moment.tzinfo is None:
        raise ValueError("occurred_at must be timezone-aware")
    moment = moment.astimezone(UTC)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000)


@fast_init
@dataclass(frozen=True, slots=True)
class Event:
    """One session event: the envelope plus its type's payload (a plain mapping).

    The payload is a mapping rather than a class per type on purpose: the fold reads every field
    with its documented default, which is exactly the "missing optional field" rule of the model,
    and an event of a type this build does not know still round-trips untouched.
    `payload_readable` is False when the payload's writer schema is unknown to this reader; the
    fold then skips the event like an unknown type.
    """

    event_id: str
    session_id: str
    type: str
    occurred_at: datetime
    producer: str
    payload: Mapping[str, Any] = field(default_factory=dict)
    expected_seq: int | None = None
    payload_readable: bool = True
