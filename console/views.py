"""Presenters: the JSON-able records the API returns and the pages render (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from projections.indexes import ceil_ms
from session_model.deadlines import format_instant, parse_deadline
from session_model.narration import sentence
from session_model.policy import SIGNATURE
from session_model.principal import Principal
from session_model.questions import (
    UNSPECIFIED_REASON,
    QuestionChange,
    WaitingQuestion,
    session_status,
)
from session_model.session import Decision, History, Question, Session
from session_model.timeline import TimelineEntry


def instant(moment: datetime | None) -> str | None:
    """An instant as `YYYY-MM-DDTHH:MM:SS.mmmZ`, or None."""
    return format_instant(moment) if moment is not None else None


def deadline_ms(expires_at: str | None) -> int | None:
    """A readable deadline in epoch milliseconds (rounded up), else None: it never expires."""
    moment = parse_deadline(expires_at)
    return ceil_ms(moment) if moment is not None else None


def principal_record(by: Principal | None) -> dict[str, Any] | None:
    """`{id, verified}` or None."""
    return by.to_record() if by is not None else None


def signed_call(question: Question) -> dict[str, str] | None:
    """For a signature question: the exact call it asks to sign (operation, arguments, digest)."""
    if question.reason != SIGNATURE:
        return None
    operation, digest = question.signed_call()
    return {"operation": operation, "arguments": question.why or "", "digest": digest}


def _call_of(question_id: str, reason: str | None, why: str | None) -> dict[str, str] | None:
    return signed_call(Question(question_id, "", why=why, reason=reason))


def question_record(question: Question) -> dict[str, Any]:
    """The open question of a session (with the call to sign, for a signature question)."""
    return {
        "id": question.id,
        "question": question.question,
        "options": list(question.options),
        "why": question.why,
        "reason": question.reason or UNSPECIFIED_REASON,
        "expires_at": question.expires_at,
        "deadline_ms": deadline_ms(question.expires_at),
        "asked_at": instant(question.asked_at),
        "seq": question.seq,
        "call": signed_call(question),
    }


def waiting_record(item: WaitingQuestion) -> dict[str, Any]:
    """One entry of the waiting questions."""
    return {
        "session_id": item.session_id,
        "question_id": item.question_id,
        "question": item.question,
        "options": list(item.options),
        "reason": item.reason,
        "why": item.why,
        "expires_at": item.expires_at,
        "deadline_ms": item.deadline_ms,
        "asked_at": instant(item.asked_at),
        "seq": item.seq,
        "mode": item.mode,
        "goal": item.goal,
        "call": _call_of(item.question_id, item.reason, item.why),
    }


def change_record(change: QuestionChange) -> dict[str, Any]:
    """One record of the questions feed, as the live stream sends it."""
    reason = change.reason or UNSPECIFIED_REASON
    return {
        "session_id": change.session_id,
        "status": change.status.value,
        "question_id": change.question_id,
        "question": change.question,
        "options": list(change.options),
        "reason": reason,
        "why": change.why,
        "expires_at": change.expires_at,
        "deadline_ms": deadline_ms(change.expires_at),
        "asked_at": instant(change.asked_at),
        "seq": change.seq,
        "mode": change.mode,
        "goal": change.goal,
        "event_id": change.event_id,
        "at": instant(change.at),
        "answer": change.answer,
        "by": principal_record(change.by),
        "call": _call_of(change.question_id, reason, change.why),
    }


def decision_record(decision: Decision) -> dict[str, Any]:
    """A decision: the answer, who gave it and whether that identity was verified, and when."""
    return {
        "question_id": decision.question_id,
        "question": decision.question,
        "answer": decision.answer,
        "by": decision.by.id if decision.by else None,
        "verified": bool(decision.by and decision.by.verified),
        "executor": decision.executor,
        "reason": decision.reason or UNSPECIFIED_REASON,
        "affirmative": decision.affirmative,
        "decided_at": instant(decision.decided_at),
        "expired_at": instant(decision.expired_at),
        "expired": decision.expired_at is not None,
        "seq": decision.seq,
    }


def session_record(session: Session, history: History | None = None) -> dict[str, Any]:
    """A session as an operator reads it."""
    return {
        "id": session.id,
        "goal": session.goal,
        "parent_id": session.parent_id,
        "mode": session.mode.value,
        "status": session_status(session).value,
        "runnable": session.is_runnable(),
        "plan": session.plan,
        "plan_version": session.plan_version,
        "todos": [
            {"id": t.id, "text": t.text, "status": t.status, "version": t.version}
            for t in session.todos
        ],
        "permissions": list(session.permissions),
        "removed_options": list(session.removed_options),
        "run_first": list(session.run_first),
        "question": question_record(session.question) if session.question else None,
        "decisions": [
            decision_record(d) for d in (history.decisions if history else session.decisions)
        ],
        "ended_because": session.ended_because,
        "seq": session.seq,
        "turns": session.turn_count,
        "tool_calls": session.tool_calls,
        "mutations": session.mutations,
    }


def window_records(session: Session) -> list[dict[str, str]]:
    """What the model is sent (`Session.window()`)."""
    return [{"role": m.role, "content": m.content} for m in session.window()]


def question_texts(session: Session, entries: Iterable[TimelineEntry]) -> dict[str, str]:
    """Question ids to their text, from the session and the timeline (for narration)."""
    texts = {d.question_id: d.question for d in session.decisions}
    for entry in entries:
        question = entry.get("question")
        if entry.get("kind") == "waiting" and isinstance(question, Mapping):
            texts[str(question.get("id"))] = str(question.get("question"))
    if session.question is not None:
        texts[session.question.id] = session.question.question
    return texts


def timeline_records(
    entries: Sequence[TimelineEntry], texts: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Timeline entries, each with a readable `sentence`."""
    return [{**entry, "sentence": sentence(entry, texts)} for entry in entries]
