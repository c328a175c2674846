"""Shared, deterministic event builders for the unit tests of the pure core.

Small and stable on purpose (several test files import it):

- `make_event(type_, payload=None, *, session_id="s1", event_id=None, expected_seq=None,
  producer="agent-1", occurred_at=None) -> Event` — ids `e1, e2, ...` from a module counter when
  not given, timestamps derived from the counter (one second apart, UTC, millisecond precision).
- `fresh_ids()` resets the counter (call it at the start of a test that compares ids).
- `started`, `turn`, `tool`, plus a few one-liners for the other types; all accept the keyword
  arguments of `make_event` (`session_id`, `event_id`, `expected_seq`, `producer`, `occurred_at`).
- `fold_all(events, keys=None) -> Session` folds a list (session id taken from the first event).
- Events that raise authority (`started`, `permission_granted`, `mode_changed`) are signed by
  `OPERATOR` unless `signed=False`; `fold_all` trusts `OPERATOR` (and any `keys` given).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from schemas import events as ev
from schemas.events import Event
from session_model.authority import authority_fields
from session_model.fold import fold
from session_model.session import Session
from session_model.signing import Signer, TrustedKeys

BASE_TIME = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)

# The operator of the unit tests: a fixed key, so signed events are deterministic.
OPERATOR = Signer("operator-test", Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
AUTHORITY_TYPES = frozenset({ev.STARTED, ev.PERMISSION_GRANTED, ev.MODE_CHANGED})


def trusted(keys: TrustedKeys | None = None) -> TrustedKeys:
    """`keys` (default: none) plus the tests' operator key."""
    return TrustedKeys({**(keys.keys if keys else {}), **OPERATOR.trusted_keys().keys})


def sign(event: Event, signer: Signer = OPERATOR) -> Event:
    """The event with `signer`'s authority signature over its authority fields."""
    signature = signer.sign_authority(
        session_id=event.session_id,
        event_id=event.event_id,
        event_type=event.type,
        fields=authority_fields(event),
    )
    return replace(event, payload={**event.payload, "authority": signature})


_counter = itertools.count(1)


def fresh_ids() -> None:
    """Restart the deterministic id/timestamp counter at `e1`."""
    global _counter  # noqa: PLW0603 - a module counter is the documented API
    _counter = itertools.count(1)


def make_event(
    type_: str,
    payload: Mapping[str, Any] | None = None,
    *,
    session_id: str = "s1",
    event_id: str | None = None,
    expected_seq: int | None = None,
    producer: str = "agent-1",
    occurred_at: datetime | None = None,
    signed: bool = True,
) -> Event:
    """One event with deterministic defaults (authority events signed by `OPERATOR`)."""
    n = next(_counter)
    event = Event(
        event_id=event_id if event_id is not None else f"e{n}",
        session_id=session_id,
        type=type_,
        occurred_at=occurred_at if occurred_at is not None else BASE_TIME + timedelta(seconds=n),
        producer=producer,
        payload=dict(payload or {}),
        expected_seq=expected_seq,
    )
    return sign(event) if signed and type_ in AUTHORITY_TYPES else event


def started(
    goal: str = "g", mode: str | None = "ask", parent_id: str | None = None, **kw: Any
) -> Event:
    payload: dict[str, Any] = {"goal": goal}
    if mode is not None:
        payload["mode"] = mode
    if parent_id is not None:
        payload["parent_id"] = parent_id
    return make_event(ev.STARTED, payload, **kw)


def turn(role: str, content: str, **kw: Any) -> Event:
    return make_event(ev.TURN, {"role": role, "content": content}, **kw)


def tool(
    tool: str,
    result: str = "ok",
    mutating: bool = False,
    *,
    arguments: Mapping[str, Any] | None = None,
    ok: bool = True,
    extra: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Event:
    payload: dict[str, Any] = {
        "tool": tool,
        "arguments": dict(arguments or {}),
        "result": result,
        "ok": ok,
        "mutating": mutating,
    }
    payload.update(extra or {})
    return make_event(ev.TOOL_CALLED, payload, **kw)


def plan(text: str, **kw: Any) -> Event:
    return make_event(ev.PLAN_SET, {"plan": text}, **kw)


def todo(
    id_: str, text: str, status: str = "pending", *, replaces: str | None = None, **kw: Any
) -> Event:
    payload: dict[str, Any] = {"id": id_, "text": text, "status": status}
    if replaces is not None:
        payload["replaces"] = replaces
    return make_event(ev.TODO_CHANGED, payload, **kw)


def ask(
    qid: str = "q1",
    question: str = "Proceed?",
    options: Sequence[str] = ("yes", "no"),
    *,
    why: str | None = None,
    expires_at: str | None = None,
    reason: str | None = None,
    **kw: Any,
) -> Event:
    payload = {
        "question_id": qid,
        "question": question,
        "options": list(options),
        "why": why,
        "expires_at": expires_at,
        "reason": reason,
    }
    return make_event(ev.QUESTION_ASKED, payload, **kw)


def answer(
    qid: str = "q1",
    answer_: str = "yes",
    *,
    by: Mapping[str, Any] | None = None,
    executor: str | None = None,
    extra: Mapping[str, Any] | None = None,
    **kw: Any,
) -> Event:
    payload: dict[str, Any] = {
        "question_id": qid,
        "answer": answer_,
        "by": dict(by) if by is not None else None,
        "executor": executor,
    }
    payload.update(extra or {})
    return make_event(ev.QUESTION_ANSWERED, payload, **kw)


CLOSED_AT = datetime(2025, 1, 2, 0, 0, 0, tzinfo=UTC)


def window_closed(
    qid: str = "q1", at: datetime | str = CLOSED_AT, *, asked_seq: int | None = None, **kw: Any
) -> Event:
    """`answer_window_closed`; `at` is a datetime on the wire (Avro timestamp-millis); without
    `asked_seq`, as written before closings named their asking (v4)."""
    payload: dict[str, Any] = {"question_id": qid, "at": at}
    if asked_seq is not None:
        payload["asked_seq"] = asked_seq
    return make_event(ev.ANSWER_WINDOW_CLOSED, payload, **kw)


def ended(because: str = "done", **kw: Any) -> Event:
    return make_event(ev.ENDED, {"because": because}, **kw)


def fold_all(events: Iterable[Event], keys: TrustedKeys | None = None) -> Session:
    """Fold a list of events from nothing (session id of the first event, `s1` when empty)."""
    events = list(events)
    session_id = events[0].session_id if events else "s1"
    return fold(session_id, events, trusted(keys))


def interrupted_transfer(store: Any, monkeypatch: Any, source: str, target: str) -> None:
    """`store.transfer_open_todos(source, target)` dying after the target's cards were sent, before
    the source's record (its writer lost): the store appends as before afterwards."""
    real_append = store.append

    def dies_before_the_source(event: Event) -> Any:
        if event.type == ev.TODOS_TRANSFERRED:
            raise ConnectionError("the writer died")
        return real_append(event)

    monkeypatch.setattr(store, "append", dies_before_the_source)
    try:
        store.transfer_open_todos(source, target)
    except ConnectionError:
        pass
    else:
        raise AssertionError("the transfer was not interrupted")
    finally:
        monkeypatch.setattr(store, "append", real_append)
