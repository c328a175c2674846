"""The timeline: each event translated together with the fold's result for it, for screens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schemas import events as ev
from session_model.deadlines import format_instant
from session_model.fold import Kind, Step
from session_model.session import OpenCard, Session

TimelineEntry = dict[str, Any]


def open_card_record(card: OpenCard) -> dict[str, Any]:
    """The record form of one open-work element."""
    record: dict[str, Any] = {
        "id": card.id,
        "status": card.status,
        "version": card.version,
        "disposition": card.disposition,
        "mutations_since": card.mutations_since,
    }
    if card.to is not None:
        record["to"] = card.to
    return record


def translate(step: Step) -> list[TimelineEntry]:
    """The timeline entries of one folded event (none for rejections, no-ops and duplicates)."""
    outcome = step.outcome
    if outcome.kind is not Kind.APPLIED or outcome.seq is None:
        return []
    e, s, seq = step.event, step.state, outcome.seq
    p: Mapping[str, Any] = e.payload

    def entry(kind: str, **fields: Any) -> TimelineEntry:
        return {"session": e.session_id, "kind": kind, "seq": seq, **fields}

    match e.type:
        case ev.TURN:
            role = p.get("role")
            state = "ready" if role == "assistant" else "thinking"
            return [entry("activity", state=state, role=role, content=p.get("content", ""))]
        case ev.TOOL_CALLED:
            return [
                entry(
                    "activity",
                    state="tool",
                    tool=p.get("tool"),
                    ok=p.get("ok", True) is True,
                    mutating=p.get("mutating") is True,
                    result=p.get("result", ""),
                )
            ]
        case ev.MESSAGE_SENT:
            return [entry("message", sender=p.get("from"), content=p.get("content", ""))]
        case ev.PLAN_SET:
            plan = {
                "text": s.plan,
                "version": s.plan_version,
                "supersedes": outcome.plan_supersedes,
            }
            return [entry("plan", plan=plan)]
        case ev.TODO_CHANGED if outcome.card is not None:
            c = outcome.card
            inherited = c.inherited_from
            card = {
                "id": c.id,
                "text": c.text,
                "to": c.status,
                "from": c.from_status,
                "version": c.version,
                "origin": c.origin,
                "inherited_from": None
                if inherited is None
                else {
                    "session": inherited.session,
                    "version": inherited.version,
                    "origin": inherited.origin,
                },
            }
            return [entry("card", card=card)]
        case ev.QUESTION_ASKED if s.question is not None:
            q = s.question
            question = {
                "id": q.id,
                "question": q.question,
                "options": list(q.options),
                "why": q.why,
                "reason": q.reason,
                "expires_at": q.expires_at,
            }
            return [entry("waiting", question=question)]
        case ev.QUESTION_ANSWERED if outcome.decision is not None:
            d = outcome.decision
            return [
                entry(
                    "answered",
                    question_id=d.question_id,
                    answer=d.answer,
                    by=d.by.to_record() if d.by else None,
                    executor=d.executor,
                )
            ]
        case ev.ANSWER_WINDOW_CLOSED if outcome.decision is not None:
            d = outcome.decision
            at = format_instant(d.expired_at) if d.expired_at else None
            expired = entry("expired", question_id=d.question_id, question=d.question, at=at)
            return [expired, *_ending(s, entry)]
        case ev.OPTION_REMOVED:
            reason = p.get("reason") or {}
            return [
                entry(
                    "option-removed",
                    option=p.get("option"),
                    code=reason.get("code"),
                    message=reason.get("message"),
                )
            ]
        case ev.PREREQUISITE_SET:
            return [entry("prerequisite-set", tools=list(s.run_first))]
        case ev.TODOS_TRANSFERRED:
            todos = [dict(t) for t in p.get("todos", [])]
            return [entry("transferred", to=p.get("to"), todos=todos)]
        case ev.ENDED:
            return _ending(s, entry)
    return []


def _ending(s: Session, entry: Any) -> list[TimelineEntry]:
    entries: list[TimelineEntry] = []
    if s.open_work:
        entries.append(entry("open-work", todos=[open_card_record(c) for c in s.open_work]))
    entries.append(entry("ended", because=s.ended_because))
    return entries
