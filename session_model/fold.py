"""The fold: `apply(state, event) -> state`, pure, in log order, the only place facts are derived.

`step()` is the same fold returning, besides the new state, what the event did (`Outcome`): the
timeline translation, the projector's appends and indexes, and the decisions topic all read it, so
none of them re-derives a rule.

Checks run in the order of the model (first match wins): duplicate id (no seq) → unknown type
(skipped) → `expected_seq` → not started / second start → after the end → question state →
payload invariants. The order matters: a stale writer must learn `seq_conflict` before anything
else, and a late answer is told apart from any other write to an ended session.

How it is made cheap (it runs once per event in the worker and the rebuild): every handler reads
the state before the event and returns only the fields it changes; `step` adds `seq` and
`event_ids` and makes the next `Session` once, with one dictionary copy (`Session._derive`), instead
of one copy per helper. Lists only ever grow by one element and are only rebuilt when the event
changes them, and none is longer than its bound (`session_model.session`, `session_model.dedupe`):
an event's cost does not grow with its session's age.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Final

from schemas import events as ev
from schemas.events import Event
from schemas.frozen import fast_init
from session_model.authority import Authority, signed_by_operator
from session_model.canonical import argument_digest
from session_model.deadlines import format_instant
from session_model.modes import Mode, less_strict, parse_mode
from session_model.principal import Principal
from session_model.session import (
    PAUSE_REASONS,
    RECENT_DECISIONS,
    RECENT_FACTS,
    RECENT_REJECTIONS,
    ROLES,
    TODO_STATUSES,
    TOOL_NAMES,
    Approval,
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
    confirmation_of,
    counted,
    with_latest,
)
from session_model.signing import CallSignature, TrustedKeys, verify_answer_claim, verify_call

_NO_AUTHORITY = Authority()
Trust = TrustedKeys | Authority
"""What the fold trusts: keys alone (default start mode, no legacy records) or an `Authority`."""
UNSPECIFIED_REASON = "unspecified"


class Kind(StrEnum):
    """What an event did to its session."""

    APPLIED = "applied"
    NOOP = "noop"
    DUPLICATE = "duplicate"
    REJECTED = "rejected"
    SKIPPED = "skipped"


@fast_init
@dataclass(frozen=True, slots=True)
class Outcome:
    """What one event did, as derived by the fold."""

    kind: Kind
    seq: int | None
    rejection: Rejection | None = None
    turn: Turn | None = None
    decision: Decision | None = None
    fact: CallFact | Observation | ExecutionFact | None = None  # appended to the history
    card: Todo | None = None
    plan_supersedes: int | None = None
    pause_reason: str | None = None
    downgraded: bool = False
    ended: bool = False


@fast_init
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


# What a handler raises on a value in an agent's payload it did not foresee (an instant at the
# calendar's edge, a number or a text it cannot take): the event is refused as `invalid` instead
# of parking its partition on every worker and ending every rebuild that reads it, alike on each
# (the fold is pure). Not the
# errors a bug in a handler raises (TypeError, AttributeError, LookupError): those must surface
# (a worker parks the record's partition until a fixed fold reads it: `BatchFolder.parked`).
# Not RecursionError either: where it strikes depends on the caller's stack, which differs between
# a worker and a rebuild; inputs are bounded before they can nest that deep.
_UNFOLDABLE = (ArithmeticError, ValueError)

Changes = dict[str, Any]
"""The fields of `Session` an event changes (besides `seq` and `event_ids`), by name."""

_Handler = Callable[[Session, Event, int, Authority], tuple[Changes, Outcome]]

# Enum members are looked up through a descriptor (70 ns each): the fold uses these names.
_APPLIED, _NOOP, _SKIPPED, _REJECTED = Kind.APPLIED, Kind.NOOP, Kind.SKIPPED, Kind.REJECTED
_STARTED, _CLOSED, _ANSWERED = ev.STARTED, ev.ANSWER_WINDOW_CLOSED, ev.QUESTION_ANSWERED

# The outcomes that carry nothing but their kind and seq, made once for the first seqs of every
# session (values, so sharing them is invisible) instead of once per event.
_SHARED_SEQS = 1024
_MILLISECOND = timedelta(milliseconds=1)  # a closing's `at` is cut to the millisecond
_PLAIN: dict[Kind, tuple[Outcome, ...]] = {
    kind: tuple(Outcome(kind, seq) for seq in range(_SHARED_SEQS))
    for kind in (_APPLIED, _NOOP, _SKIPPED)
}
_PLAIN_APPLIED = _PLAIN[_APPLIED]
_DUPLICATE = Outcome(Kind.DUPLICATE, None)


def _plain(kind: Kind, seq: int) -> Outcome:
    return _PLAIN[kind][seq] if seq < _SHARED_SEQS else Outcome(kind, seq)


def _applied(seq: int) -> Outcome:
    return _PLAIN_APPLIED[seq] if seq < _SHARED_SEQS else Outcome(_APPLIED, seq)


def apply(state: Session, event: Event, keys: Trust = _NO_AUTHORITY) -> Session:
    """Fold one event into the session."""
    return step(state, event, keys).state


def fold(session_id: str, events: Iterable[Event], keys: Trust = _NO_AUTHORITY) -> Session:
    """Fold a whole stream from nothing."""
    state = Session(session_id)
    auth = _authority(keys)
    for event in events:
        state = step(state, event, auth).state
    return state


def _authority(keys: Trust) -> Authority:
    return keys if type(keys) is Authority else Authority(keys)  # type: ignore[arg-type]


def step(state: Session, event: Event, keys: Trust = _NO_AUTHORITY) -> Step:
    """Fold one event and report what it did (`keys`: trusted keys, or a whole `Authority`)."""
    auth = _authority(keys)
    event_id = event.event_id
    event_ids = state.event_ids
    if (
        event_id in event_ids.current
        or (event_ids.older and event_ids.in_older(event_id))
        or event_id in state.signed_ids  # a signed act is never applied twice (see Session)
    ):
        return Step(state, event, _DUPLICATE)
    seq = state.seq + 1
    event_type = event.type
    handler = _HANDLERS.get(event_type)
    changes: Changes
    if handler is None or not event.payload_readable:
        changes = {"skipped": state.skipped + 1}
        outcome = _plain(_SKIPPED, seq)
    else:
        try:
            try:
                # The checks every known event passes, in the model's order; then its handler.
                if event.expected_seq is not None and event.expected_seq != state.seq:
                    raise _Reject("seq_conflict")
                if not state.started:
                    if event_type != _STARTED:
                        raise _Reject("unknown_session")
                elif event_type == _STARTED:
                    raise _Reject("already_started")
                if state.ended_because is not None or event_type == _CLOSED:
                    handler = _closing_or_ended(state, event, auth)
                changes, outcome = handler(state, event, seq, auth)
            except _UNFOLDABLE as e:
                raise _Reject("invalid") from e
        except _Reject as rejected:
            rejection = _rejection(event, seq, rejected.code, rejected.by)
            changes = _rejected(state, rejection)
            if _signed_although_refused(state, event, auth):
                # Remembered as a signed act although refused: the same record sent again once
                # its id left the dedupe window must not be applied later (to a later asking, or
                # a grant after its revocation), at a time its operator did not choose.
                changes.update(_signed(state, event))
            outcome = Outcome(_REJECTED, seq, rejection=rejection)
    changes["seq"] = seq
    changes["event_ids"] = event_ids.add(event_id)
    return Step(state._derive(changes), event, outcome)


def _recent(items: tuple[Any, ...], item: Any, bound: int) -> tuple[Any, ...]:
    """`items` with `item` appended, keeping the last `bound` (a copy of at most `bound`)."""
    return (*items, item) if len(items) < bound else (*items[len(items) - bound + 1 :], item)


def _rejected(s: Session, rejection: Rejection) -> Changes:
    """The recent rejections and the counts by code, with one more."""
    counts = dict(s.rejected)
    counts[rejection.code] = counts.get(rejection.code, 0) + 1
    return {"rejections": _recent(s.rejections, rejection, RECENT_REJECTIONS), "rejected": counts}


def _decided(s: Session, decision: Decision) -> Changes:
    """The recent decisions, the questions resolved and the confirmations, with one more."""
    changes: Changes = {
        "decisions": _recent(s.decisions, decision, RECENT_DECISIONS),
        "decided": s.decided | {decision.question_id},
        "decision_count": s.decision_count + 1,
    }
    confirmation = confirmation_of(decision)
    if confirmation is not None:
        changes["confirmations"] = s.confirmations | {confirmation}
    return changes


def _rejection(e: Event, seq: int, code: str, by: Principal | None = None) -> Rejection:
    return Rejection(
        seq=seq,
        event_id=e.event_id,
        type=e.type,
        code=code,
        producer=e.producer,
        occurred_at=e.occurred_at,
        by=by,
    )


def _authorized(e: Event, auth: Authority) -> bool:
    """A legacy record (before the cut-over), or one a trusted operator key signed."""
    return auth.legacy or signed_by_operator(e, auth)


_SIGNED_ACTS: Final = frozenset({ev.PERMISSION_GRANTED, ev.MODE_CHANGED})


def _signed_although_refused(s: Session, e: Event, auth: Authority) -> bool:
    """Whether a refused event carries a trusted signature (an answer's, or a grant's or a mode
    change's authority): an ended session applies nothing again, so there it is not checked."""
    if e.type == _ANSWERED:
        return _signed_answer(e, auth.keys)
    if e.type not in _SIGNED_ACTS or s.ended_because is not None or "authority" not in e.payload:
        return False
    try:
        return signed_by_operator(e, auth)
    except _UNFOLDABLE:  # a payload its handler would have refused as `invalid`
        return False


def _signed(s: Session, e: Event) -> Changes:
    """The event's id among those a signature authorised (never to be applied again)."""
    return {"signed_ids": s.signed_ids | {e.event_id}}


def _closing_or_ended(s: Session, e: Event, auth: Authority) -> _Handler:
    """A closing before the end closes the window; at the end, one of a question already
    resolved is a no-op (it lost the race), never applied: an ended session changes no more.
    Else an ended session refuses."""
    p = e.payload
    qid = p.get("question_id")
    if e.type == _CLOSED and s.ended_because is None:
        return _window_closed
    if e.type == _CLOSED and _already_decided(s, p.get("question_id")):
        # A closing of a question resolved before: it lost the race. One naming the asking still
        # open when the session ended is refused below, as any closing of an open one is.
        question, asked = s.question, p.get("asked_seq")
        if question is None or type(asked) is not int or not question.named_by(qid, asked):
            return _lost_the_race
    if e.type == _ANSWERED and (late := s.late_for(p.get("question_id"), p.get("asked_seq"))):
        by, _ = _principal(e, late.id, auth.keys)
        raise _Reject("late_answer", by=by)
    raise _Reject("session_ended")


def _lost_the_race(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    return {}, _plain(_NOOP, seq)


def _already_decided(s: Session, question_id: object) -> bool:
    """A closing for a question that an answer or an earlier closing already resolved."""
    return question_id in s.decided


def _signed_answer(e: Event, keys: TrustedKeys) -> bool:
    """Whether a refused answer carries a human's verified claim that a trusted key signed."""
    question_id = e.payload.get("question_id")
    if not isinstance(question_id, str):
        return False
    by, downgraded = _principal(e, question_id, keys)
    return by is not None and by.verified and not downgraded


def _principal(e: Event, question_id: str, keys: TrustedKeys) -> tuple[Principal | None, bool]:
    """Who answered, believed verified only with a trusted signature; and whether it was lowered."""
    claimed = Principal.from_record(e.payload.get("by"))
    if claimed is None or not claimed.verified:
        return claimed, False
    asked = e.payload.get("asked_seq")
    trusted = verify_answer_claim(
        keys,
        e.payload.get("signature"),
        session_id=e.session_id,
        question_id=question_id,
        answer=_text(e.payload, "answer"),
        principal_id=claimed.id,
        event_id=e.event_id,
        asked_seq=asked if type(asked) is int else None,
    )
    return (claimed, False) if trusted else (Principal(claimed.id, verified=False), True)


def _text(p: Mapping[str, Any], name: str, default: str = "") -> str:
    value = p.get(name)
    return value if isinstance(value, str) else default


def _optional_text(p: Mapping[str, Any], name: str) -> str | None:
    value = p.get(name)
    return value if isinstance(value, str) else None


def _required(p: Mapping[str, Any], name: str) -> str:
    value = p.get(name)
    if not isinstance(value, str) or not value.strip():
        raise _Reject("invalid")
    return value


def _strings(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(v for v in value if isinstance(v, str))


def _without(items: tuple[str, ...], name: str) -> tuple[str, ...]:
    # Most events remove nothing (an obligation is rare): keep the same tuple then.
    return tuple(i for i in items if i != name) if name in items else items


# -- one handler per event type: (state before, event, seq) -> (changed fields, outcome) --------


def _started(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    mode = parse_mode(p.get("mode")) or Mode.ASK
    changes: Changes = {
        "started": True,
        "goal": _text(p, "goal"),
        "mode": mode,
        "parent_id": _optional_text(p, "parent_id") or None,
    }
    if less_strict(mode, auth.start_mode):
        if not _authorized(e, auth):
            # Started, but no less supervised than an unsigned start may be; refusal recorded.
            refused = _rejection(e, seq, "unauthorized")
            changes["mode"] = auth.start_mode
            changes.update(_rejected(s, refused))
            return changes, Outcome(_APPLIED, seq, rejection=refused)
        changes.update(_signed(s, e))
    return changes, _applied(seq)


def _turn(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    role = p.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _Reject("invalid")
    content = p.get("content")
    turn = Turn(role, content if isinstance(content, str) else "", seq)
    changes = {"turns": (*s.turns, turn), "turn_count": s.turn_count + 1}
    return changes, Outcome(_APPLIED, seq, turn=turn)


def _tool_called(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    tool = _required(p, "tool")
    result = _text(p, "result")
    mutating = p.get("mutating") is True
    call = CallFact(
        seq,
        tool,
        result,
        p.get("ok", True) is True,
        mutating,
        _optional_text(p, "artifact"),
        _optional_text(p, "verdict"),
        _optional_text(p, "effect_observation_id"),
    )
    turn = Turn("tool", f"{tool} → {result}", seq)
    changes = {
        "turns": (*s.turns, turn),
        "turn_count": s.turn_count + 1,
        "tool_calls": s.tool_calls + 1,
        "mutations": s.mutations + 1 if mutating else s.mutations,
        "run_first": _without(s.run_first, tool),
        "calls": _recent(s.calls, call, RECENT_FACTS),
        "tools": counted(s.tools, tool, TOOL_NAMES),
    }
    if call.artifact is not None:  # the index keeps no result: the turn and the history do
        latest = CallFact(seq, tool, "", call.ok, mutating, call.artifact, call.verdict)
        changes["artifacts"] = with_latest(s.artifacts, call.artifact, latest)
    if s.approvals and any(a.consumed_at is None and a.operation == tool for a in s.approvals):
        digest = argument_digest(p.get("arguments") or {})
        used = s.approval_for(tool, digest)
        if used is not None:  # single use: this call consumes its approval
            changes["approvals"] = tuple(
                replace(a, consumed_at=seq) if a is used else a for a in s.approvals
            )
    return changes, Outcome(_APPLIED, seq, turn=turn, fact=call)


def _message_sent(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    sender = _required(e.payload, "from")
    content = _text(e.payload, "content")
    turn = Turn("user", f"■ message from «{sender}»: {content}", seq)
    changes = {"turns": (*s.turns, turn), "turn_count": s.turn_count + 1}
    return changes, Outcome(_APPLIED, seq, turn=turn)


def _plan_set(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    plan = _text(e.payload, "plan")
    run_first = _without(s.run_first, "plan")
    if plan == s.plan:
        return {"run_first": run_first}, _applied(seq)
    supersedes = s.plan_version if s.plan_version > 0 else None
    changes = {"plan": plan, "plan_version": s.plan_version + 1, "run_first": run_first}
    return changes, Outcome(_APPLIED, seq, plan_supersedes=supersedes)


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


def _todo_changed(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    todo_id = _required(p, "id")
    text = _text(p, "text")
    status = _text(p, "status")
    if status not in TODO_STATUSES:
        raise _Reject("invalid")
    replaces = _optional_text(p, "replaces") or None
    todos = s.todos
    index = next((i for i, t in enumerate(todos) if t.id == todo_id), None)
    if index is None:
        inherited = _inherited(p.get("inherited_from"))
        card = Todo(
            todo_id,
            text,
            status,
            1,
            None,
            None,
            inherited.origin if inherited else _origin(status, s.tool_calls),
            s.mutations,
            s.plan_version,
            s.plan_version,
            replaces,
            inherited,
        )
        todos = (*todos, card)
    else:
        current = todos[index]
        changed = current.text != text or current.status != status
        card = Todo(
            current.id,
            text,
            status,
            current.version + 1 if changed else current.version,
            current.version if changed else None,
            current.status if changed else None,
            current.origin,
            s.mutations,
            s.plan_version,
            current.born_in_plan,
            replaces if replaces is not None else current.replaces,
            current.inherited_from,
            current.transferred_to,
        )
        todos = (*todos[:index], card, *todos[index + 1 :])
    changes = {"todos": todos, "run_first": _without(s.run_first, "todo")}
    return changes, Outcome(_APPLIED, seq, card=card)


def _question_asked(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
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
    if any(option in s.removed_options for option in question.options):
        raise _Reject("invalid")  # a removed option never comes back in this session
    reason = question.reason or UNSPECIFIED_REASON
    changes = {"question": question, "pauses": counted(s.pauses, reason, PAUSE_REASONS)}
    return changes, Outcome(_APPLIED, seq, pause_reason=reason)


def _question_answered(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    question = s.question
    if question is None:
        raise _Reject("no_open_question")
    if not question.named_by(p.get("question_id"), p.get("asked_seq")):
        raise _Reject("stale_question")
    answer = _text(p, "answer")
    approval = _approval(s, e, question, seq, auth) if question.reason == "signature" else None
    by, downgraded = _principal(e, question.id, auth.keys)
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
        affirmative=approval is not None
        or (bool(question.options) and answer == question.options[0]),
        decided_at=e.occurred_at,
        asked_at=question.asked_at,
        asked_seq=question.seq,
    )
    turn = Turn("user", answer, seq)
    changes: Changes = {
        "turns": (*s.turns, turn),
        "turn_count": s.turn_count + 1,
        "question": None,
        "downgrades": s.downgrades + 1 if downgraded else s.downgrades,
        **_decided(s, decision),
    }
    if approval is not None:
        changes["approvals"] = (*s.approvals, approval)
    if approval is not None or (by is not None and by.verified):
        changes.update(_signed(s, e))
    outcome = Outcome(_APPLIED, seq, turn=turn, decision=decision, downgraded=downgraded)
    return changes, outcome


def _approval(s: Session, e: Event, question: Question, seq: int, auth: Authority) -> Approval:
    """The approval an answer to a signature question must carry (else `unauthorized`).

    A trusted key's signature over exactly the call asked about, answering this asking of the
    question (its seq), and never seen before in this session.
    """
    raw = e.payload.get("approval")
    if not isinstance(raw, Mapping):
        raise _Reject("unauthorized")
    operation, digest = question.signed_call()
    key_id, signature = raw.get("key_id"), raw.get("signature")
    if (
        raw.get("operation") != operation
        or raw.get("argument_digest") != digest
        or not isinstance(key_id, str)
        or not isinstance(signature, bytes | bytearray)
    ):
        raise _Reject("unauthorized")
    signed = CallSignature(key_id, bytes(signature))
    if not verify_call(
        auth.keys,
        signed,
        session_id=e.session_id,
        operation=operation,
        argument_digest=digest,
        question_seq=question.seq,
    ):
        raise _Reject("unauthorized")
    signature_id = hashlib.sha256(signed.signature).hexdigest()[:32]
    if any(a.signature_id == signature_id for a in s.approvals):
        raise _Reject("unauthorized")  # a replayed approval
    return Approval(operation, digest, key_id, signature_id, seq)


def _window_closed(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    question = s.question
    p = e.payload
    if question is None or not question.named_by(p.get("question_id"), p.get("asked_seq")):
        # The answer (or an earlier closing) won the race, or it names an earlier asking of the
        # same id (answered, then asked again before the closing landed): nothing to close.
        return {}, _plain(_NOOP, seq)
    at = p.get("at")
    deadline = question.deadline()
    if deadline is not None and isinstance(at, datetime) and deadline - at > _MILLISECOND:
        # Noticed before this asking's deadline: a closing written before closings named their
        # asking (v4), of an earlier asking. (A difference, not `deadline - 1 ms`: a deadline at
        # the calendar's first instant has nothing before it.)
        return {}, _plain(_NOOP, seq)
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
        asked_seq=question.seq,
    )
    because = f"the window to answer «{question.question}» closed at {at_text} and nobody answered"
    changes = {
        "question": None,
        "closed_question": question,
        **_decided(s, decision),
        **_end(s, because),
    }
    return changes, Outcome(_APPLIED, seq, decision=decision, ended=True)


def _end(s: Session, because: str) -> Changes:
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
    return {"ended_because": because, "open_work": open_work}


def _permission_granted(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    operation = _required(e.payload, "operation")
    if not _authorized(e, auth):
        raise _Reject("unauthorized")
    if operation in s.permissions:
        return _signed(s, e), _applied(seq)
    return {"permissions": (*s.permissions, operation), **_signed(s, e)}, _applied(seq)


def _permission_revoked(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    operation = _required(e.payload, "operation")
    return {"permissions": _without(s.permissions, operation)}, _applied(seq)


def _mode_changed(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    mode = parse_mode(e.payload.get("mode"))
    if mode is None:
        raise _Reject("invalid")
    if not less_strict(mode, s.mode):
        if e.payload.get("authority") is not None and signed_by_operator(e, auth):
            # Signed, though it applies as no relaxation here (written from a stale read): a
            # copy arriving once the session is stricter again must not relax it.
            return {"mode": mode, **_signed(s, e)}, _applied(seq)
        return {"mode": mode}, _applied(seq)
    if not _authorized(e, auth):
        raise _Reject("unauthorized")
    return {"mode": mode, **_signed(s, e)}, _applied(seq)


def _option_removed(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    option = _required(e.payload, "option")
    reason = e.payload.get("reason")
    code = reason.get("code") if isinstance(reason, Mapping) else None
    if not isinstance(code, str) or not code.strip():
        raise _Reject("invalid")
    if option in s.removed_options:
        return {}, _applied(seq)
    return {"removed_options": (*s.removed_options, option)}, _applied(seq)


def _prerequisite_set(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    tools = tuple(t for t in _strings(e.payload.get("tools")) if t.strip())
    return {"run_first": tools, "obligation_declared": bool(tools)}, _applied(seq)


def _compacted(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    through = e.payload.get("through")
    if not isinstance(through, int) or isinstance(through, bool):
        raise _Reject("invalid")
    if through <= s.compacted_through:
        return {}, _plain(_NOOP, seq)
    if through >= seq:
        raise _Reject("invalid")
    changes = {
        "summary": _text(e.payload, "summary"),
        "compacted_through": through,
        "turns": tuple(t for t in s.turns if t.seq > through),
        # What the summary covers leaves the hot state (the history keeps it).
        "calls": tuple(c for c in s.calls if c.seq > through),
        "observations": tuple(o for o in s.observations if o.seq > through),
        "executions": tuple(x for x in s.executions if x.seq > through),
    }
    return changes, _applied(seq)


def _todos_transferred(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    target = _required(e.payload, "to")
    moved = set()
    raw = e.payload.get("todos")
    for item in raw if isinstance(raw, list | tuple) else ():
        if isinstance(item, Mapping) and isinstance(item.get("id"), str):
            moved.add(item["id"])
    todos = tuple(replace(t, transferred_to=target) if t.id in moved else t for t in s.todos)
    return {"todos": todos}, _applied(seq)


def _effect_observed(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    observation = Observation(
        event_id=e.event_id,
        seq=seq,
        known=p.get("known") is True,
        artifacts=_strings(p.get("artifacts")),
        evidence=_strings(p.get("evidence")),
        observer=_optional_text(p, "observer"),
    )
    changes = {"observations": _recent(s.observations, observation, RECENT_FACTS)}
    return changes, Outcome(_APPLIED, seq, fact=observation)


def _execution_recorded(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    p = e.payload
    receipt = ExecutionFact(
        seq=seq,
        operation=_required(p, "operation"),
        argument_digest=_required(p, "argument_digest"),
        artifact=_optional_text(p, "artifact"),
        executor=_optional_text(p, "executor"),
    )
    changes = {"executions": _recent(s.executions, receipt, RECENT_FACTS)}
    return changes, Outcome(_APPLIED, seq, fact=receipt)


def _ended(s: Session, e: Event, seq: int, auth: Authority) -> tuple[Changes, Outcome]:
    return _end(s, _text(e.payload, "because")), Outcome(_APPLIED, seq, ended=True)


_HANDLERS: dict[str, _Handler] = {
    ev.STARTED: _started,
    ev.TURN: _turn,
    ev.TOOL_CALLED: _tool_called,
    ev.MESSAGE_SENT: _message_sent,
    ev.PLAN_SET: _plan_set,
    ev.TODO_CHANGED: _todo_changed,
    ev.QUESTION_ASKED: _question_asked,
    ev.QUESTION_ANSWERED: _question_answered,
    ev.ANSWER_WINDOW_CLOSED: _window_closed,  # also after the end: see `_closing_or_ended`
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
assert _HANDLERS.keys() == set(ev.EVENT_TYPES), "every event type of the vocabulary has a handler"
