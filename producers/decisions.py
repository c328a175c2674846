"""Decisions for downstream services: the published record, and a subscriber that de-duplicates.

A decision is published after the Redis commit that accepted it, at least once: the marks skip a
redelivered batch, but the worker publishes again the decisions the sessions' states recorded for
its records (`session_model.projection.redelivered_decisions`), since a worker may have stopped
between the commit and the broker's acknowledgement. Each record carries its source event id and
seq, and `DecisionSubscriber` drops any decision whose seq is not beyond the last one it yielded
for that session, or that its group handed out before a restart or a rebalance (within its
look-back: `producers.subscription`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from producers.subscription import Subscription
from session_model.principal import Principal
from session_model.session import Decision


def decision_record(session_id: str, d: Decision) -> dict[str, Any]:
    """The Avro `Decision` record of one accepted decision."""
    return {
        "session_id": session_id,
        "question_id": d.question_id,
        "question": d.question,
        "reason": d.reason,
        "why": d.why,
        "answer": d.answer,
        "by": d.by.to_record() if d.by else None,
        "executor": d.executor,
        "decided_at": d.decided_at if d.expired_at is None else None,
        "expired_at": d.expired_at,
        "seq": d.seq,
        "event_id": d.event_id,
    }


@dataclass(frozen=True, slots=True)
class PublishedDecision:
    """A decision as a downstream service receives it."""

    session_id: str
    question_id: str
    question: str
    reason: str | None
    why: str | None
    answer: str
    by: Principal | None
    executor: str | None
    decided_at: datetime | None
    expired_at: datetime | None
    seq: int
    event_id: str

    @property
    def expired(self) -> bool:
        """True when nobody answered and the window closed."""
        return self.expired_at is not None

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> PublishedDecision:
        """Read a decoded Avro `Decision` record."""
        return cls(
            session_id=r["session_id"],
            question_id=r["question_id"],
            question=r["question"],
            reason=r.get("reason"),
            why=r.get("why"),
            answer=r["answer"],
            by=Principal.from_record(r.get("by")),
            executor=r.get("executor"),
            decided_at=r.get("decided_at"),
            expired_at=r.get("expired_at"),
            seq=r["seq"],
            event_id=r["event_id"],
        )


class DecisionSubscriber(Subscription[PublishedDecision]):
    """Iterate decisions with your own consumer group; duplicates are dropped for you."""

    def decode(self, raw: bytes) -> PublishedDecision:
        """A `Decision` record, read."""
        return PublishedDecision.from_record(self.codec.decode_decision(raw))

    def order(self, item: PublishedDecision) -> tuple[str, tuple[int, ...]]:
        """Per session, by the deciding event's seq."""
        return item.session_id, (item.seq,)
