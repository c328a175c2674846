"""The timeline: each event translated together with the fold's result for it, for screens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from schemas import events as ev
from schemas.errors import InvalidCall
from session_model.canonical import canonical_json
from session_model.deadlines import format_instant
from session_model.fold import Kind, Outcome, Step
from session_model.modes import Mode
from session_model.session import OpenCard, Session

TimelineEntry = dict[str, Any]

_APPLIED = Kind.APPLIED  # an enum member looked up once (each lookup costs 70 ns)


def last(entries: list[TimelineEntry], latest: int) -> list[TimelineEntry]:
    """The last `latest` entries (InvalidCall for a negative count)."""
    if latest < 0:
        raise InvalidCall(f"latest must be 0 or more, not {latest}")
    return entries[max(len(entries) - latest, 0) :]


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
    if outcome.kind is not _APPLIED or outcome.seq is None:
        return []
    e = step.event
    translator = _TRANSLATORS.get(e.type)
    if translator is None:  # started, compacted, grants, revokes, mode changes: nothing to show
        return []
    return translator(e.session_id, outcome.seq, e.payload, step.state, outcome)


# -- one translator per event type that shows on a board -------------------------------------------
# Each entry is `{session, kind, seq, ...}`, built as one dict display (the keys in this order).

_Translator = Callable[[str, int, Mapping[str, Any], Session, Outcome], list[TimelineEntry]]


def _turn(sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome) -> list[TimelineEntry]:
    role = p.get("role")
    state = "ready" if role == "assistant" else "thinking"
    content = p.get("content", "")
    return [
        {
            "session": sid,
            "kind": "activity",
            "seq": seq,
            "state": state,
            "role": role,
            "content": content,
        }
    ]


def _tool_called(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    mutating = p.get("mutating") is True
    entries: list[TimelineEntry] = [
        {
            "session": sid,
            "kind": "activity",
            "seq": seq,
            "state": "tool",
            "tool": p.get("tool"),
            "ok": p.get("ok", True) is True,
            "mutating": mutating,
            "result": p.get("result", ""),
        }
    ]
    if mutating and s.mode is Mode.ACKNOWLEDGE:
        # `acknowledge` announces and continues: what the agent did without asking, shown apart.
        arguments = p.get("arguments")
        entries.append(
            {
                "session": sid,
                "kind": "announced",
                "seq": seq,
                "operation": p.get("tool"),
                "arguments": canonical_json(arguments if isinstance(arguments, Mapping) else {}),
            }
        )
    return entries


def _message_sent(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    return [
        {
            "session": sid,
            "kind": "message",
            "seq": seq,
            "sender": p.get("from"),
            "content": p.get("content", ""),
        }
    ]


def _plan_set(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    plan = {"text": s.plan, "version": s.plan_version, "supersedes": o.plan_supersedes}
    return [{"session": sid, "kind": "plan", "seq": seq, "plan": plan}]


def _todo_changed(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    c = o.card
    if c is None:
        return []
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
    return [{"session": sid, "kind": "card", "seq": seq, "card": card}]


def _question_asked(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    q = s.question
    if q is None:
        return []
    question = {
        "id": q.id,
        "question": q.question,
        "options": list(q.options),
        "why": q.why,
        "reason": q.reason,
        "expires_at": q.expires_at,
    }
    return [{"session": sid, "kind": "waiting", "seq": seq, "question": question}]


def _question_answered(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    d = o.decision
    if d is None:
        return []
    return [
        {
            "session": sid,
            "kind": "answered",
            "seq": seq,
            "question_id": d.question_id,
            "answer": d.answer,
            "by": d.by.to_record() if d.by else None,
            "executor": d.executor,
        }
    ]


def _window_closed(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    d = o.decision
    if d is None:
        return []
    expired = {
        "session": sid,
        "kind": "expired",
        "seq": seq,
        "question_id": d.question_id,
        "question": d.question,
        "at": format_instant(d.expired_at) if d.expired_at else None,
    }
    return [expired, *_ending(sid, seq, p, s, o)]


def _option_removed(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    reason = p.get("reason") or {}
    return [
        {
            "session": sid,
            "kind": "option-removed",
            "seq": seq,
            "option": p.get("option"),
            "code": reason.get("code"),
            "message": reason.get("message"),
        }
    ]


def _prerequisite_set(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    return [{"session": sid, "kind": "prerequisite-set", "seq": seq, "tools": list(s.run_first)}]


def _todos_transferred(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    todos = [dict(t) for t in p.get("todos", [])]
    return [{"session": sid, "kind": "transferred", "seq": seq, "to": p.get("to"), "todos": todos}]


def _ending(
    sid: str, seq: int, p: Mapping[str, Any], s: Session, o: Outcome
) -> list[TimelineEntry]:
    entries: list[TimelineEntry] = []
    if s.open_work:
        todos = [open_card_record(c) for c in s.open_work]
        entries.append({"session": sid, "kind": "open-work", "seq": seq, "todos": todos})
    entries.append({"session": sid, "kind": "ended", "seq": seq, "because": s.ended_because})
    return entries


_TRANSLATORS: dict[str, _Translator] = {
    ev.TURN: _turn,
    ev.TOOL_CALLED: _tool_called,
    ev.MESSAGE_SENT: _message_sent,
    ev.PLAN_SET: _plan_set,
    ev.TODO_CHANGED: _todo_changed,
    ev.QUESTION_ASKED: _question_asked,
    ev.QUESTION_ANSWERED: _question_answered,
    ev.ANSWER_WINDOW_CLOSED: _window_closed,
    ev.OPTION_REMOVED: _option_removed,
    ev.PREREQUISITE_SET: _prerequisite_set,
    ev.TODOS_TRANSFERRED: _todos_transferred,
    ev.ENDED: _ending,
}
