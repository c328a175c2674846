"""What the fleet waits for: question changes (the questions feed) and waiting-question entries.

Both are derived from a committed update alone. A change is published at least once, like a
decision: a redelivered batch publishes again what its records did, as the session's state
recorded it (`redelivered_changes`). A question is identified in its session by the seq its
asking took (`QuestionChange.seq`); a subscriber keeps, per session, the last (seq, rank) it has
seen and drops anything not beyond it (`QuestionChange.order`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from schemas import events as ev
from schemas.events import Event
from schemas.frozen import fast_init
from session_model.fold import Kind, Step
from session_model.principal import Principal
from session_model.projection import Folded, Record, SessionUpdate, applied_state
from session_model.session import Decision, Question, Session


class QuestionStatus(StrEnum):
    """Where a question stands."""

    OPEN = "open"  # asked; the session waits for a human
    MOOT = "moot"  # the session ended while it was open (its window may still close later)
    ANSWERED = "answered"
    EXPIRED = "expired"  # nobody answered before the deadline


# Per question: opened, then possibly made moot by the end, then answered or expired.
_RANK: Mapping[QuestionStatus, int] = {
    QuestionStatus.OPEN: 0,
    QuestionStatus.MOOT: 1,
    QuestionStatus.ANSWERED: 2,
    QuestionStatus.EXPIRED: 2,
}


class SessionStatus(StrEnum):
    """A session as the fleet overview counts it."""

    UNSTARTED = "unstarted"  # events arrived before its start (all rejected)
    RUNNING = "running"
    WAITING = "waiting"  # a question is open
    ENDED = "ended"


def session_status(state: Session) -> SessionStatus:
    """The overview status of a session."""
    if state.ended_because is not None:
        return SessionStatus.ENDED
    if state.question is not None:
        return SessionStatus.WAITING
    return SessionStatus.RUNNING if state.started else SessionStatus.UNSTARTED


@fast_init
@dataclass(frozen=True, slots=True)
class QuestionChange:
    """One record of the questions feed: a question opened, or how it stopped being open."""

    session_id: str
    status: QuestionStatus
    question_id: str
    question: str
    options: tuple[str, ...]
    reason: str | None
    why: str | None
    expires_at: str | None
    asked_at: datetime | None
    seq: int  # the seq of the question's asking: its identity in the session
    mode: str  # the session's mode when the change happened
    goal: str
    event_id: str  # the event that made the change
    at: datetime  # when that event occurred
    answer: str | None = None  # answered only
    by: Principal | None = None  # answered only

    def order(self) -> tuple[int, int]:
        """Position in its session's feed: a subscriber drops what is not beyond the last seen."""
        return self.seq, _RANK[self.status]


@fast_init
@dataclass(frozen=True, slots=True)
class WaitingQuestion:
    """An entry of the waiting-questions index: an open question of a session that has not ended."""

    session_id: str
    question_id: str
    question: str
    options: tuple[str, ...]
    reason: str  # `unspecified` when the question named none
    why: str | None
    expires_at: str | None
    deadline_ms: int | None  # the readable deadline (epoch ms), else None: never expires
    asked_at: datetime | None
    seq: int
    mode: str
    goal: str


@fast_init
@dataclass(frozen=True, slots=True, order=True)
class Cursor:
    """Where a page of waiting questions ends: deadline order, then session id."""

    score: int  # deadline epoch ms; `NO_DEADLINE` for questions without one
    session_id: str

    def __str__(self) -> str:
        return f"{self.score}:{self.session_id}"

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """Read `score:session_id` (raises ValueError)."""
        score, sep, sid = text.partition(":")
        if not sep or not sid:
            raise ValueError(f"not a cursor: {text!r}")
        return cls(int(score), sid)


NO_DEADLINE = 2**53 - 1  # sorts after every deadline; exact as a Redis score (a double)


@fast_init
@dataclass(frozen=True, slots=True)
class WaitingPage:
    """One page of waiting questions, soonest deadline first."""

    items: tuple[WaitingQuestion, ...]
    total: int  # waiting questions matching the filter, over every page
    next: Cursor | None  # pass as `after` for the next page; None on the last
    # (session, why) of this page's entries that do not decode: left out of `items`, not hidden
    unreadable: tuple[tuple[str, str], ...] = ()


def score_of(item: WaitingQuestion) -> int:
    """The index score of a waiting question."""
    return NO_DEADLINE if item.deadline_ms is None else item.deadline_ms


UNSPECIFIED_REASON = "unspecified"


def waiting_question(state: Session, deadline_ms: int | None) -> WaitingQuestion | None:
    """The index entry of a session, or None unless it waits for an answer."""
    q = state.question
    if q is None or state.ended_because is not None:
        return None
    return WaitingQuestion(
        session_id=state.id,
        question_id=q.id,
        question=q.question,
        options=q.options,
        reason=q.reason or UNSPECIFIED_REASON,
        why=q.why,
        expires_at=q.expires_at,
        deadline_ms=deadline_ms,
        asked_at=q.asked_at,
        seq=q.seq,
        mode=state.mode.value,
        goal=state.goal,
    )


def _change(
    state: Session, q: Question, status: QuestionStatus, event_id: str, at: datetime
) -> QuestionChange:
    return QuestionChange(
        session_id=state.id,
        status=status,
        question_id=q.id,
        question=q.question,
        options=q.options,
        reason=q.reason,
        why=q.why,
        expires_at=q.expires_at,
        asked_at=q.asked_at,
        seq=q.seq,
        mode=state.mode.value,
        goal=state.goal,
        event_id=event_id,
        at=at,
    )


def _resolved(
    state: Session, q: Question, d: Decision, event_id: str, at: datetime
) -> QuestionChange:
    """The change of a question `d` resolved; the question's text and reason as `d` recorded."""
    expired = d.expired_at is not None
    return replace(
        _change(
            state, q, QuestionStatus.EXPIRED if expired else QuestionStatus.ANSWERED, event_id, at
        ),
        question_id=d.question_id,
        question=d.question,
        reason=d.reason,
        why=d.why,
        asked_at=d.asked_at,
        answer=None if expired else d.answer,
        by=None if expired else d.by,
    )


def step_changes(step: Step, before: Question | None) -> tuple[QuestionChange, ...]:
    """The changes one folded event made; `before` is the question open before it (or None)."""
    o = step.outcome
    if o.kind is not Kind.APPLIED:
        return ()
    e, state = step.event, step.state
    if o.decision is not None:
        # The question a decision resolves is the one open before it (answered or closed).
        q = before if before is not None and before.id == o.decision.question_id else None
        q = q or _asked(o.decision, {})
        return (_resolved(state, q, o.decision, e.event_id, e.occurred_at),)
    if e.type == ev.QUESTION_ASKED and state.question is not None:
        return (_change(state, state.question, QuestionStatus.OPEN, e.event_id, e.occurred_at),)
    if e.type == ev.ENDED and state.question is not None:
        return (_change(state, state.question, QuestionStatus.MOOT, e.event_id, e.occurred_at),)
    return ()


_MAY_CHANGE = frozenset({ev.QUESTION_ASKED, ev.ENDED})  # besides any step with a decision


def update_changes(update: SessionUpdate) -> tuple[QuestionChange, ...]:
    """Every question change of an update, in order.

    Runs on every update the worker commits: a step that can change no question is passed over
    with two attribute reads.
    """
    out: list[QuestionChange] = []
    previous: Step | None = None  # the step before: its state held the question open before
    for s in update.steps:
        if s.outcome.decision is not None or s.event.type in _MAY_CHANGE:
            # Unknown before the first step: a decision tells enough of its question.
            before = previous.state.question if previous is not None else None
            out.extend(step_changes(s, before))
        previous = s
    return tuple(out)


def redelivered_changes(
    known: Mapping[str, Folded], records: Iterable[Record]
) -> tuple[QuestionChange, ...]:
    """What records at or below their session's mark had published, as the state recorded it.

    An asking is found as the open question or among the decisions (same id, asked at the
    event's time); an answer or a closing by its decision's event id; an end as a moot open
    question. Nothing is published for a record the state holds no trace of (a rejected one). A
    resolution carries its question's options and deadline when the asking is redelivered too.
    """
    out: list[QuestionChange] = []
    asked: dict[tuple[str, object], Mapping[str, object]] = {}  # (session, question id) -> payload
    for record in records:
        e = record.event
        if e.type == ev.QUESTION_ASKED:
            asked[(e.session_id, e.payload.get("question_id"))] = e.payload
        state = applied_state(known, record)
        if state is not None:
            out.extend(_recorded(state, e, asked))
    return tuple(out)


def _recorded(
    state: Session, e: Event, asked: Mapping[tuple[str, object], Mapping[str, object]]
) -> tuple[QuestionChange, ...]:
    kind, event_id, at, payload = e.type, e.event_id, e.occurred_at, e.payload
    q = state.question
    if kind == ev.QUESTION_ASKED:
        qid = payload.get("question_id")
        if q is not None and q.id == qid and q.asked_at == at:
            return (_change(state, q, QuestionStatus.OPEN, event_id, at),)
        for d in state.decisions:
            if d.question_id == qid and d.asked_at == at and d.asked_seq:
                return (_change(state, _asked(d, payload), QuestionStatus.OPEN, event_id, at),)
        return ()
    if kind in (ev.QUESTION_ANSWERED, ev.ANSWER_WINDOW_CLOSED):
        for d in state.decisions:
            if d.event_id == event_id and d.asked_seq:
                # Options and deadline only when the asking is among the records redelivered.
                q = _asked(d, asked.get((state.id, d.question_id), {}))
                return (_resolved(state, q, d, event_id, d.decided_at or d.expired_at or at),)
        return ()
    if kind == ev.ENDED and q is not None and state.ended_because is not None:
        return (_change(state, q, QuestionStatus.MOOT, event_id, at),)
    return ()


def _asked(d: Decision, payload: Mapping[str, object]) -> Question:
    """The question a decision resolved, as far as the decision and its asking event tell."""
    options = payload.get("options")
    expires_at = payload.get("expires_at")
    return Question(
        id=d.question_id,
        question=d.question,
        options=_strings(options),
        why=d.why,
        expires_at=expires_at if isinstance(expires_at, str) else None,
        reason=d.reason,
        seq=d.asked_seq,
        asked_at=d.asked_at,
    )


def _strings(value: object) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()
