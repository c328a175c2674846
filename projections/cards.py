"""What the commit script stores in the waiting index and the fleet hash for one session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from projections.codec import from_millis, to_millis
from schemas.errors import CorruptProjectionError
from session_model.projection import SessionUpdate
from session_model.questions import WaitingQuestion, score_of, session_status, waiting_question

# A session's fleet entry is two letters, its status and its mode, then while it waits the reason
# (`wapermission`): it is kept in every session's state hash, so it is short.
STATUS_CODES: dict[str, str] = {"unstarted": "u", "running": "r", "waiting": "w", "ended": "e"}
MODE_CODES: dict[str, str] = {"ask": "a", "acknowledge": "k", "auto": "u"}
_STATUSES = {code: name for name, code in STATUS_CODES.items()}
_MODES = {code: name for name, code in MODE_CODES.items()}


def fleet_key(code: str) -> tuple[str, str]:
    """(status, mode) of a fleet counts field (two letters); unknown letters are kept as read."""
    return _STATUSES.get(code[:1], code[:1]), _MODES.get(code[1:2], code[1:2])


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """A session's fleet entry (status and mode letters, the reason while it waits) and, while it
    waits, its card and score."""

    fleet: str
    card: bytes  # b"" when the session does not wait
    score: int


def index_entry(update: SessionUpdate, deadline_ms: int | None) -> IndexEntry:
    """The fleet entry and waiting card of an update's state."""
    state = update.state
    item = waiting_question(state, deadline_ms)
    code = STATUS_CODES[session_status(state).value] + MODE_CODES[state.mode.value]
    if item is None:
        return IndexEntry(code, b"", 0)
    return IndexEntry(code + item.reason, card_to_json(item), score_of(item))


def card_to_json(item: WaitingQuestion) -> bytes:
    """A waiting question as stored (compact JSON; the session id is the hash field)."""
    record: dict[str, Any] = {
        "q": item.question_id,
        "t": item.question,
        "r": item.reason,
        "s": item.seq,
        "m": item.mode,
        "g": item.goal,
    }
    if item.options:
        record["o"] = list(item.options)
    if item.why is not None:
        record["w"] = item.why
    if item.expires_at is not None:
        record["e"] = item.expires_at
    if item.deadline_ms is not None:
        record["d"] = item.deadline_ms
    if item.asked_at is not None:
        record["a"] = to_millis(item.asked_at)
    return orjson.dumps(record)


def card_from_json(session_id: str, raw: bytes | str) -> WaitingQuestion:
    """Read a stored card back; `CorruptProjectionError` if it is not one (whatever is wrong)."""
    try:
        r = orjson.loads(raw)
        card = WaitingQuestion(
            session_id=session_id,
            question_id=_typed(r["q"], str),
            question=_typed(r["t"], str),
            options=tuple(_typed(o, str) for o in _typed(r.get("o", []), list)),
            reason=_typed(r["r"], str),
            why=_typed(r.get("w"), str, optional=True),
            expires_at=_typed(r.get("e"), str, optional=True),
            deadline_ms=_typed(r.get("d"), int, optional=True),
            asked_at=from_millis(_typed(r.get("a"), int, optional=True)),
            seq=_typed(r["s"], int),
            mode=_typed(r["m"], str),
            goal=_typed(r["g"], str),
        )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise CorruptProjectionError(
            f"{session_id}: its waiting-questions entry cannot be read: {type(e).__name__}: {e}"
        ) from e
    return card


def _typed(value: Any, kind: type, *, optional: bool = False) -> Any:
    """`value` if it is a `kind` (or None, if `optional`); `TypeError` otherwise."""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if value is None and optional:
        return None
    raise TypeError(f"{value!r} is not a {kind.__name__}")
