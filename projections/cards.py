"""What the commit script stores in the waiting index and the fleet hash for one session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from session_model.projection import SessionUpdate
from session_model.questions import WaitingQuestion, score_of, session_status, waiting_question

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """A session's fleet entry (`status|mode|reason`) and, while it waits, its card and score."""

    fleet: str
    card: bytes  # b"" when the session does not wait
    score: int


def index_entry(update: SessionUpdate, deadline_ms: int | None) -> IndexEntry:
    """The fleet entry and waiting card of an update's state."""
    state = update.state
    item = waiting_question(state, deadline_ms)
    status, mode = session_status(state).value, state.mode.value
    if item is None:
        return IndexEntry(f"{status}|{mode}|", b"", 0)
    return IndexEntry(f"{status}|{mode}|{item.reason}", card_to_json(item), score_of(item))


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
        record["a"] = round((item.asked_at - _EPOCH).total_seconds() * 1000)
    return orjson.dumps(record)


def card_from_json(session_id: str, raw: bytes | str) -> WaitingQuestion:
    """Read a stored card back."""
    r = orjson.loads(raw)
    asked = r.get("a")
    return WaitingQuestion(
        session_id=session_id,
        question_id=r["q"],
        question=r["t"],
        options=tuple(r.get("o", ())),
        reason=r["r"],
        why=r.get("w"),
        expires_at=r.get("e"),
        deadline_ms=r.get("d"),
        asked_at=None if asked is None else datetime.fromtimestamp(asked / 1000, UTC),
        seq=r["s"],
        mode=r["m"],
        goal=r["g"],
    )
