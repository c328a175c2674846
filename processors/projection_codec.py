"""The projection's stored form: a `Session` as JSON (turns and event ids are stored apart)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from session_model.modes import Mode
from session_model.principal import Principal
from session_model.session import (
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

STATE_VERSION = 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _ms(moment: datetime | None) -> int | None:
    # Integer arithmetic: float timestamps can lose the last millisecond.
    return None if moment is None else (moment - _EPOCH) // _MS


def _dt(ms: int | None) -> datetime | None:
    return None if ms is None else _EPOCH + timedelta(milliseconds=ms)


def _principal(p: Principal | None) -> dict[str, Any] | None:
    return None if p is None else p.to_record()


def _question(q: Question | None) -> dict[str, Any] | None:
    if q is None:
        return None
    return {
        "id": q.id,
        "question": q.question,
        "options": list(q.options),
        "why": q.why,
        "expires_at": q.expires_at,
        "reason": q.reason,
        "seq": q.seq,
        "asked_at": _ms(q.asked_at),
    }


def _question_from(d: dict[str, Any] | None) -> Question | None:
    if d is None:
        return None
    return Question(
        d["id"],
        d["question"],
        tuple(d["options"]),
        d["why"],
        d["expires_at"],
        d["reason"],
        d["seq"],
        _dt(d["asked_at"]),
    )


def turn_to_json(t: Turn) -> bytes:
    """One history entry."""
    return orjson.dumps([t.role, t.content, t.seq])


def turn_from_json(raw: str | bytes) -> Turn:
    """Read one history entry."""
    role, content, seq = orjson.loads(raw)
    return Turn(role, content, seq)


def session_to_json(s: Session) -> bytes:
    """Everything but `turns` and `event_ids`, which have their own keys."""
    return orjson.dumps(
        {
            "v": STATE_VERSION,
            "id": s.id,
            "started": s.started,
            "goal": s.goal,
            "parent_id": s.parent_id,
            "mode": s.mode.value,
            "turn_count": s.turn_count,
            "plan": s.plan,
            "plan_version": s.plan_version,
            "tool_calls": s.tool_calls,
            "mutations": s.mutations,
            "todos": [
                [
                    t.id,
                    t.text,
                    t.status,
                    t.version,
                    t.supersedes,
                    t.from_status,
                    t.origin,
                    t.mutations_at,
                    t.plan_version,
                    t.born_in_plan,
                    t.replaces,
                    None
                    if t.inherited_from is None
                    else [
                        t.inherited_from.session,
                        t.inherited_from.version,
                        t.inherited_from.origin,
                    ],
                    t.transferred_to,
                ]
                for t in s.todos
            ],
            "permissions": list(s.permissions),
            "removed_options": list(s.removed_options),
            "run_first": list(s.run_first),
            "obligation_declared": s.obligation_declared,
            "summary": s.summary,
            "compacted_through": s.compacted_through,
            "question": _question(s.question),
            "closed_question": _question(s.closed_question),
            "decisions": [
                {
                    "question_id": d.question_id,
                    "question": d.question,
                    "answer": d.answer,
                    "by": _principal(d.by),
                    "executor": d.executor,
                    "reason": d.reason,
                    "why": d.why,
                    "seq": d.seq,
                    "event_id": d.event_id,
                    "affirmative": d.affirmative,
                    "decided_at": _ms(d.decided_at),
                    "expired_at": _ms(d.expired_at),
                    "asked_at": _ms(d.asked_at),
                }
                for d in s.decisions
            ],
            "ended_because": s.ended_because,
            "open_work": [
                [c.id, c.status, c.version, c.disposition, c.mutations_since, c.to]
                for c in s.open_work
            ],
            "seq": s.seq,
            "rejections": [
                [
                    r.seq,
                    r.event_id,
                    r.type,
                    r.code,
                    r.producer,
                    _ms(r.occurred_at),
                    _principal(r.by),
                ]
                for r in s.rejections
            ],
            "pauses": dict(s.pauses),
            "skipped": s.skipped,
            "downgrades": s.downgrades,
            "calls": [
                [
                    c.seq,
                    c.tool,
                    c.result,
                    c.ok,
                    c.mutating,
                    c.artifact,
                    c.verdict,
                    c.effect_observation_id,
                ]
                for c in s.calls
            ],
            "executions": [
                [x.seq, x.operation, x.argument_digest, x.artifact, x.executor]
                for x in s.executions
            ],
            "observations": [
                [o.event_id, o.seq, o.known, list(o.artifacts), list(o.evidence), o.observer]
                for o in s.observations
            ],
        }
    )


def session_from_json(
    raw: str | bytes, turns: tuple[Turn, ...], event_ids: frozenset[str]
) -> Session:
    """Rebuild the `Session` from its stored form plus its unsummarised turns and event ids."""
    d = orjson.loads(raw)
    return Session(
        id=d["id"],
        started=d["started"],
        goal=d["goal"],
        parent_id=d["parent_id"],
        mode=Mode(d["mode"]),
        turns=turns,
        turn_count=d["turn_count"],
        plan=d["plan"],
        plan_version=d["plan_version"],
        tool_calls=d["tool_calls"],
        mutations=d["mutations"],
        todos=tuple(
            Todo(
                t[0],
                t[1],
                t[2],
                t[3],
                t[4],
                t[5],
                t[6],
                t[7],
                t[8],
                t[9],
                t[10],
                None if t[11] is None else InheritedFrom(*t[11]),
                t[12],
            )
            for t in d["todos"]
        ),
        permissions=tuple(d["permissions"]),
        removed_options=tuple(d["removed_options"]),
        run_first=tuple(d["run_first"]),
        obligation_declared=d["obligation_declared"],
        summary=d["summary"],
        compacted_through=d["compacted_through"],
        question=_question_from(d["question"]),
        closed_question=_question_from(d["closed_question"]),
        decisions=tuple(
            Decision(
                question_id=x["question_id"],
                question=x["question"],
                answer=x["answer"],
                by=Principal.from_record(x["by"]),
                executor=x["executor"],
                reason=x["reason"],
                why=x["why"],
                seq=x["seq"],
                event_id=x["event_id"],
                affirmative=x["affirmative"],
                decided_at=_dt(x["decided_at"]),
                expired_at=_dt(x["expired_at"]),
                asked_at=_dt(x["asked_at"]),
            )
            for x in d["decisions"]
        ),
        ended_because=d["ended_because"],
        open_work=tuple(OpenCard(*c) for c in d["open_work"]),
        seq=d["seq"],
        rejections=tuple(
            Rejection(
                r[0], r[1], r[2], r[3], r[4], _dt(r[5]) or _EPOCH, Principal.from_record(r[6])
            )
            for r in d["rejections"]
        ),
        pauses=dict(d["pauses"]),
        skipped=d["skipped"],
        downgrades=d["downgrades"],
        calls=tuple(CallFact(*c) for c in d["calls"]),
        executions=tuple(ExecutionFact(*x) for x in d["executions"]),
        observations=tuple(
            Observation(o[0], o[1], o[2], tuple(o[3]), tuple(o[4]), o[5]) for o in d["observations"]
        ),
        event_ids=event_ids,
    )
