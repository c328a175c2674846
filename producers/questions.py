"""The questions feed for downstream services: the published record, and its subscriber.

The worker publishes a `QuestionChange` when the fold opens a question and when the question
stops being open (answered, expired, or moot: the session ended), after the Redis commit, at
least once (`session_model.questions.redelivered_changes`). `QuestionSubscriber` drops repeats.
"""

from __future__ import annotations

from typing import Any

from producers.subscription import Subscription
from session_model.principal import Principal
from session_model.questions import QuestionChange, QuestionStatus


def change_record(c: QuestionChange) -> dict[str, Any]:
    """The Avro `QuestionChange` record of a change."""
    return {
        "session_id": c.session_id,
        "status": c.status.value,
        "question_id": c.question_id,
        "question": c.question,
        "options": list(c.options),
        "reason": c.reason,
        "why": c.why,
        "expires_at": c.expires_at,
        "asked_at": c.asked_at,
        "seq": c.seq,
        "mode": c.mode,
        "goal": c.goal,
        "event_id": c.event_id,
        "at": c.at,
        "answer": c.answer,
        "by": c.by.to_record() if c.by else None,
    }


def change_from_record(r: dict[str, Any]) -> QuestionChange:
    """Read a decoded `QuestionChange` record (ValueError for a status this build does not know)."""
    return QuestionChange(
        session_id=r["session_id"],
        status=QuestionStatus(r["status"]),
        question_id=r["question_id"],
        question=r["question"],
        options=tuple(r.get("options") or ()),
        reason=r.get("reason"),
        why=r.get("why"),
        expires_at=r.get("expires_at"),
        asked_at=r.get("asked_at"),
        seq=r["seq"],
        mode=r["mode"],
        goal=r["goal"],
        event_id=r["event_id"],
        at=r["at"],
        answer=r.get("answer"),
        by=Principal.from_record(r.get("by")),
    )


class QuestionSubscriber(Subscription[QuestionChange]):
    """Iterate question changes with your own consumer group; repeats are dropped for you."""

    def decode(self, raw: bytes) -> QuestionChange:
        """A `QuestionChange` record, read."""
        return change_from_record(self.codec.decode_question_change(raw))

    def order(self, item: QuestionChange) -> tuple[str, tuple[int, ...]]:
        """Per session, by the question's seq and how far it got."""
        return item.session_id, item.order()
