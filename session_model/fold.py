"""The fold: `apply(state, event) -> state`, pure, in log order, the only place facts are derived.

`step()` is the same fold returning, besides the new state, what the event did (`Outcome`): the
timeline translation, the projector's appends and indexes, and the decisions topic all read it, so
none of them re-derives a rule.

Checks run in the order of the model (first match wins): duplicate id (no seq) → unknown type
(skipped) → `expected_seq` → not started / second start → after the end → question state →
payload invariants. The order matters: a stale writer must learn `seq_conflict` before anything
else, and a late answer is told apart from any other write to an ended session.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from schemas import events as ev
from schemas.events import Event
from session_model.deadlines import format_instant
from session_model.modes import Mode, parse_mode
from session_model.principal import Principal
from session_model.session import (
    ROLES,
    TODO_STATUSES,
    CallFact,
    Decision,
    ExecutionFact,
    InheritedFrom,
    Observation,
    OpenCard,
    Question,
    Rejection,
    Session,
    Todo,
    Turn,
)
from session_model.signing import TrustedKeys, verify_answer_claim

_KNOWN_TYPES = frozenset(ev.EVENT_TYPES)
_NO_KEYS = TrustedKeys.none()
UNSPECIFIED_REASON = "unspecified"


class Kind(StrEnum):
    """What an event did to its session."""

    APPLIED = "applied"
    NOOP = "noop"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one event did, as derived by the fold."""

    kind: Kind
    seq: int | None
    rejection: Rejection | None = None
    turn: Turn | None = None
    decision: Decision | None = None
    card: Todo | None = None
    plan_supersedes: int | None = None
    pause_reason: str | None = None
    downgraded: bool = False
    ended: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """The state after one event, with the event and its outcome."""

    state: Session
    event: Event
    outcome: Outcome


class _Reject(Exception):  # noqa: N818 - internal control flow, never escapes this module
    def __init__(self, code: str, by: Principal | None = None) -> None:
        super().__init__(code)
        self.code = code
        self.by = by


def apply(state: Session, event: Event, keys: TrustedKeys = _NO_KEYS) -> Session:
    """Fold one event into the session."""
    return step(state, event, keys).state


def fold(session_id: str, events: Iterable[Event], keys: TrustedKeys = _NO_KEYS) -> Session:
    """Fold a whole stream from nothing."""
    state = Session(session_id)
    for event in events:
        state = step(state, event, keys).state
    return state


def step(state: Session, event: Event, keys: TrustedKeys = _NO_KEYS) -> Step:
    """Fold one event and report what it did."""
    if event.event_id in state.event_ids:
        return Step(state, event, Outcome(Kind.DUPLICATE, None))
    seq = state.seq + 1
    base = state.evolve(seq=seq, event_ids=state.event_ids | {event.event_id})
    if event.type not in _KNOWN_TYPES or not event.payload_readable:
        return Step(base.evolve(skipped=base.skipped + 1), event, Outcome(Kind.SKIPPED, seq))
    try:
        new_state, outcome = _apply_known(state, base, event, seq, keys)
    except _Reject as rejected:
        rejection = Rejection(
            seq=seq,
            event_id=event.event_id,
            type=event.type,
            code=rejected.code,
            producer=event.producer,
            occurred_at=event.occurred_at,
            by=rejected.by,
        )
        new_state = base.evolve(rejections=(*base.rejections, rejection))
        outcome = Outcome(Kind.REJECTED, seq, rejection=rejection)
    return Step(new_state, event, outcome)


def _apply_known(
    before: Session, s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    p = e.payload
    if e.expected_seq is not None and e.expected_seq != before.seq:
        raise _Reject("seq_conflict")
    if not before.started:
        if e.type != ev.STARTED:
            raise _Reject("unknown_session")
    elif e.type == ev.STARTED:
        raise _Reject("already_started")
    if e.type == ev.ANSWER_WINDOW_CLOSED and (
        not before.ended or _already_decided(before, p.get("question_id"))
    ):
        return _window_closed(s, e, seq)
    if before.ended:
        if e.type == ev.QUESTION_ANSWERED and _is_closed_question(before, p):
            by, _ = _principal(e, before.closed_question.id if before.closed_question else "", keys)
            raise _Reject("late_answer", by=by)
        raise _Reject("session_ended")
    handler = _HANDLERS[e.type]
    return handler(s, e, seq, keys)


def _is_closed_question(s: Session, p: Mapping[str, Any]) -> bool:
    return s.closed_question is not None and p.get("question_id") == s.closed_question.id


def _already_decided(s: Session, question_id: object) -> bool:
    """A closing for a question that an answer or an earlier closing already resolved."""
    return any(d.question_id == question_id for d in s.decisions)


def _principal(e: Event, question_id: str, keys: TrustedKeys) -> tuple[Principal | None, bool]:
    """Who answered, believed verified only with a trusted signature; and whether it was lowered."""
    claimed = Principal.from_record(e.payload.get("by"))
    if claimed is None or not claimed.verified:
        return claimed, False
    trusted = verify_answer_claim(
        keys,
        e.payload.get("signature"),
        session_id=e.session_id,
        question_id=question_id,
        answer=_text(e.payload, "answer"),
        principal_id=claimed.id,
        event_id=e.event_id,
    )
    return (claimed, False) if trusted else (Principal(claimed.id, verified=False), True)


def _applied(state: Session, seq: int, **details: Any) -> tuple[Session, Outcome]:
    return state, Outcome(Kind.APPLIED, seq, **details)


def _text(p: Mapping[str, Any], name: str, default: str = "") -> str:
    value = p.get(name)
    return value if isinstance(value, str) else default


def _optional_text(p: Mapping[str, Any], name: str) -> str | None:
    value = p.get(name)
    return value if isinstance(value, str) else None


def _required(p: Mapping[str, Any], name: str) -> str:
    value = _text(p, name)
    if not value.strip():
        raise _Reject("invalid")
    return value


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(v for v in value if isinstance(v, str))


def _add_turn(s: Session, role: str, content: str, seq: int) -> tuple[Session, Turn]:
    turn = Turn(role, content, seq)
    return s.evolve(turns=(*s.turns, turn), turn_count=s.turn_count + 1), turn


def _without(items: tuple[str, ...], name: str) -> tuple[str, ...]:
    return tuple(i for i in items if i != name)


# -- one handler per event type ------------------------------------------------------------------


def _started(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    p = e.payload
    return _applied(
        s.evolve(
            started=True,
            goal=_text(p, "goal"),
            mode=parse_mode(p.get("mode")) or Mode.ASK,
            parent_id=_optional_text(p, "parent_id") or None,
        ),
        seq,
    )


def _turn(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    role = _text(e.payload, "role")
    if role not in ROLES:
        raise _Reject("invalid")
    state, turn = _add_turn(s, role, _text(e.payload, "content"), seq)
    return _applied(state, seq, turn=turn)


def _tool_called(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    p = e.payload
    tool = _required(p, "tool")
    result = _text(p, "result")
    mutating = p.get("mutating") is True
    call = CallFact(
        seq=seq,
        tool=tool,
        result=result,
        ok=p.get("ok", True) is True,
        mutating=mutating,
        artifact=_optional_text(p, "artifact"),
        verdict=_optional_text(p, "verdict"),
        effect_observation_id=_optional_text(p, "effect_observation_id"),
    )
    state, turn = _add_turn(s, "tool", f"{tool} → {result}", seq)
    state = state.evolve(
        tool_calls=s.tool_calls + 1,
        mutations=s.mutations + (1 if mutating else 0),
        run_first=_without(s.run_first, tool),
        calls=(*s.calls, call),
    )
    return _applied(state, seq, turn=turn)


def _message_sent(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    sender = _required(e.payload, "from")
    content = _text(e.payload, "content")
    state, turn = _add_turn(s, "user", f"■ message from «{sender}»: {content}", seq)
    return _applied(state, seq, turn=turn)


def _plan_set(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    plan = _text(e.payload, "plan")
    run_first = _without(s.run_first, "plan")
    if plan == s.plan:
        return _applied(s.evolve(run_first=run_first), seq, plan_supersedes=None)
    supersedes = s.plan_version if s.plan_version > 0 else None
    state = s.evolve(plan=plan, plan_version=s.plan_version + 1, run_first=run_first)
    return _applied(state, seq, plan_supersedes=supersedes)


def _origin(status: str, tool_calls: int) -> str:
    terminal = status == "done"
    if terminal:
        return "retrospective" if tool_calls else "unsupported"
    return "discovered" if tool_calls else "planned"


def _inherited(value: object) -> InheritedFrom | None:
    if not isinstance(value, Mapping):
        return None
    session, version, origin = value.get("session"), value.get("version"), value.get("origin")
    if not isinstance(session, str) or not isinstance(version, int) or not isinstance(origin, str):
        return None
    return InheritedFrom(session, version, origin)


def _todo_changed(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    p = e.payload
    todo_id = _required(p, "id")
    text = _text(p, "text")
    status = _text(p, "status")
    if status not in TODO_STATUSES:
        raise _Reject("invalid")
    replaces = _optional_text(p, "replaces") or None
    current = s.todo(todo_id)
    if current is None:
        inherited = _inherited(p.get("inherited_from"))
        card = Todo(
            id=todo_id,
            text=text,
            status=status,
            version=1,
            supersedes=None,
            from_status=None,
            origin=inherited.origin if inherited else _origin(status, s.tool_calls),
            mutations_at=s.mutations,
            plan_version=s.plan_version,
            born_in_plan=s.plan_version,
            replaces=replaces,
            inherited_from=inherited,
        )
        todos = (*s.todos, card)
    else:
        changed = current.text != text or current.status != status
        card = replace(
            current,
            text=text,
            status=status,
            version=current.version + 1 if changed else current.version,
            supersedes=current.version if changed else None,
            from_status=current.status if changed else None,
            mutations_at=s.mutations,
            plan_version=s.plan_version,
            replaces=replaces if replaces is not None else current.replaces,
        )
        todos = tuple(card if t.id == todo_id else t for t in s.todos)
    state = s.evolve(todos=todos, run_first=_without(s.run_first, "todo"))
    return _applied(state, seq, card=card)


def _question_asked(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    if s.question is not None:
        raise _Reject("question_open")
    p = e.payload
    question = Question(
        id=_required(p, "question_id"),
        question=_text(p, "question"),
        options=_strings(p.get("options")),
        why=_optional_text(p, "why"),
        expires_at=_optional_text(p, "expires_at"),
        reason=_optional_text(p, "reason") or None,
        seq=seq,
        asked_at=e.occurred_at,
    )
    reason = question.reason or UNSPECIFIED_REASON
    pauses = dict(s.pauses)
    pauses[reason] = pauses.get(reason, 0) + 1
    return _applied(s.evolve(question=question, pauses=pauses), seq, pause_reason=reason)


def _question_answered(
    s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    p = e.payload
    question = s.question
    if question is None:
        raise _Reject("no_open_question")
    if p.get("question_id") != question.id:
        raise _Reject("stale_question")
    answer = _text(p, "answer")
    by, downgraded = _principal(e, question.id, keys)
    decision = Decision(
        question_id=question.id,
        question=question.question,
        answer=answer,
        by=by,
        executor=_optional_text(p, "executor"),
        reason=question.reason,
        why=question.why,
        seq=seq,
        event_id=e.event_id,
        affirmative=bool(question.options) and answer == question.options[0],
        decided_at=e.occurred_at,
        asked_at=question.asked_at,
    )
    state, turn = _add_turn(s, "user", answer, seq)
    state = state.evolve(
        question=None,
        decisions=(*s.decisions, decision),
        downgrades=s.downgrades + (1 if downgraded else 0),
    )
    return _applied(state, seq, turn=turn, decision=decision, downgraded=downgraded)


def _window_closed(s: Session, e: Event, seq: int) -> tuple[Session, Outcome]:
    question = s.question
    if question is None or e.payload.get("question_id") != question.id:
        # The answer (or an earlier closing) won the race: nothing left to close.
        return s, Outcome(Kind.NOOP, seq)
    at = e.payload.get("at")
    at_text = format_instant(at) if isinstance(at, datetime) else str(at)
    decision = Decision(
        question_id=question.id,
        question=question.question,
        answer="",
        by=None,
        executor=None,
        reason=question.reason,
        why=question.why,
        seq=seq,
        event_id=e.event_id,
        expired_at=at if isinstance(at, datetime) else None,
        asked_at=question.asked_at,
    )
    because = f"the window to answer «{question.question}» closed at {at_text} and nobody answered"
    state = s.evolve(question=None, closed_question=question, decisions=(*s.decisions, decision))
    return _applied(_end(state, because), seq, decision=decision, ended=True)


def _end(s: Session, because: str) -> Session:
    open_work = tuple(
        OpenCard(
            id=t.id,
            status=t.status,
            version=t.version,
            disposition=t.disposition,
            mutations_since=s.mutations - t.mutations_at,
            to=t.transferred_to,
        )
        for t in s.todos
        if t.status != "done"
    )
    return s.evolve(ended_because=because, open_work=open_work)


def _permission_granted(
    s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    operation = _required(e.payload, "operation")
    if operation in s.permissions:
        return _applied(s, seq)
    return _applied(s.evolve(permissions=(*s.permissions, operation)), seq)


def _permission_revoked(
    s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    operation = _required(e.payload, "operation")
    return _applied(s.evolve(permissions=_without(s.permissions, operation)), seq)


def _mode_changed(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    mode = parse_mode(e.payload.get("mode"))
    if mode is None:
        raise _Reject("invalid")
    return _applied(s.evolve(mode=mode), seq)


def _option_removed(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    option = _required(e.payload, "option")
    reason = e.payload.get("reason")
    code = reason.get("code") if isinstance(reason, Mapping) else None
    if not isinstance(code, str) or not code.strip():
        raise _Reject("invalid")
    if option in s.removed_options:
        return _applied(s, seq)
    return _applied(s.evolve(removed_options=(*s.removed_options, option)), seq)


def _prerequisite_set(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    tools = tuple(t for t in _strings(e.payload.get("tools")) if t.strip())
    return _applied(s.evolve(run_first=tools, obligation_declared=bool(tools)), seq)


def _compacted(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    through = e.payload.get("through")
    if not isinstance(through, int) or isinstance(through, bool):
        raise _Reject("invalid")
    if through <= s.compacted_through:
        return s, Outcome(Kind.NOOP, seq)
    if through >= seq:
        raise _Reject("invalid")
    state = s.evolve(
        summary=_text(e.payload, "summary"),
        compacted_through=through,
        turns=tuple(t for t in s.turns if t.seq > through),
    )
    return _applied(state, seq)


def _todos_transferred(
    s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    target = _required(e.payload, "to")
    moved = set()
    raw = e.payload.get("todos")
    for item in raw if isinstance(raw, list | tuple) else ():
        if isinstance(item, Mapping) and isinstance(item.get("id"), str):
            moved.add(item["id"])
    todos = tuple(replace(t, transferred_to=target) if t.id in moved else t for t in s.todos)
    return _applied(s.evolve(todos=todos), seq)


def _effect_observed(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    p = e.payload
    observation = Observation(
        event_id=e.event_id,
        seq=seq,
        known=p.get("known") is True,
        artifacts=_strings(p.get("artifacts")),
        evidence=_strings(p.get("evidence")),
        observer=_optional_text(p, "observer"),
    )
    return _applied(s.evolve(observations=(*s.observations, observation)), seq)


def _execution_recorded(
    s: Session, e: Event, seq: int, keys: TrustedKeys
) -> tuple[Session, Outcome]:
    p = e.payload
    receipt = ExecutionFact(
        seq=seq,
        operation=_required(p, "operation"),
        argument_digest=_required(p, "argument_digest"),
        artifact=_optional_text(p, "artifact"),
        executor=_optional_text(p, "executor"),
    )
    return _applied(s.evolve(executions=(*s.executions, receipt)), seq)


def _ended(s: Session, e: Event, seq: int, keys: TrustedKeys) -> tuple[Session, Outcome]:
    return _applied(_end(s, _text(e.payload, "because")), seq, ended=True)


_HANDLERS = {
    ev.STARTED: _started,
    ev.TURN: _turn,
    ev.TOOL_CALLED: _tool_called,
    ev.MESSAGE_SENT: _message_sent,
    ev.PLAN_SET: _plan_set,
    ev.TODO_CHANGED: _todo_changed,
    ev.QUESTION_ASKED: _question_asked,
    ev.QUESTION_ANSWERED: _question_answered,
    ev.PERMISSION_GRANTED: _permission_granted,
    ev.PERMISSION_REVOKED: _permission_revoked,
    ev.MODE_CHANGED: _mode_changed,
    ev.OPTION_REMOVED: _option_removed,
    ev.PREREQUISITE_SET: _prerequisite_set,
    ev.COMPACTED: _compacted,
    ev.TODOS_TRANSFERRED: _todos_transferred,
    ev.EFFECT_OBSERVED: _effect_observed,
    ev.EXECUTION_RECORDED: _execution_recorded,
    ev.ENDED: _ended,
}
