"""Timeline entries as plain English sentences, for people reading a session (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from session_model.deadlines import parse_deadline
from session_model.timeline import TimelineEntry

_MAX_QUOTE = 240  # characters of free text (a turn, a tool result) quoted in one sentence

_ROLE_SPEAKERS = {"user": "The user", "system": "The system", "assistant": "The agent"}


def sentence(entry: TimelineEntry, questions: Mapping[str, str] | None = None) -> str:
    """One readable sentence for a timeline entry; `questions` maps question ids to their text."""
    narrate = _NARRATORS.get(str(entry.get("kind")))
    if narrate is None:
        return _fallback(entry)
    try:
        return narrate(entry, questions or {})
    except (AttributeError, TypeError, ValueError, KeyError):  # a malformed entry still reads
        return _fallback(entry)


def short_instant(text: object) -> str:
    """An instant as `YYYY-MM-DD HH:MMZ` (seconds shown when not zero); unreadable text as is."""
    moment = parse_deadline(text)
    if moment is None:
        return str(text)
    if moment.second or moment.microsecond:
        return moment.strftime("%Y-%m-%d %H:%M:%SZ")
    return moment.strftime("%Y-%m-%d %H:%MZ")


def quote(text: object, limit: int = _MAX_QUOTE) -> str:
    """Text in «guillemets», on one line, shortened with an ellipsis past `limit` characters."""
    flat = " ".join(str(text if text is not None else "").split())
    if len(flat) > limit:
        flat = flat[: limit - 1].rstrip() + "…"
    return f"«{flat}»"


def principal_text(by: object) -> str:
    """A principal record `{id, verified}` as `id (verified)`; None as an unidentified someone."""
    if not isinstance(by, Mapping) or not by.get("id"):
        return "someone unidentified"
    trust = "verified" if by.get("verified") is True else "unverified"
    return f"{by['id']} ({trust})"


# -- one narrator per entry kind ------------------------------------------------------------------

_Narrator = Callable[[TimelineEntry, Mapping[str, str]], str]


def _activity(e: TimelineEntry, q: Mapping[str, str]) -> str:
    if e.get("state") == "tool":
        flags = " (mutating)" if e.get("mutating") else ""
        outcome = "it succeeded" if e.get("ok", True) else "it failed"
        result = e.get("result") or ""
        tail = f": {quote(result)}" if result else ""
        return f"The agent called {quote(e.get('tool'))}{flags} and {outcome}{tail}"
    role = e.get("role")
    speaker = _ROLE_SPEAKERS.get(str(role), f"A {role} turn")
    verb = "said" if role in _ROLE_SPEAKERS else "read"
    return f"{speaker} {verb} {quote(e.get('content'))}"


def _announced(e: TimelineEntry, q: Mapping[str, str]) -> str:
    return (
        f"The agent announced the mutating call {quote(e.get('operation'))} with "
        f"{e.get('arguments') or '{}'} and went on (mode acknowledge)"
    )


def _message(e: TimelineEntry, q: Mapping[str, str]) -> str:
    return f"Session {quote(e.get('sender'))} sent a message: {quote(e.get('content'))}"


def _plan(e: TimelineEntry, q: Mapping[str, str]) -> str:
    plan = e["plan"]
    version, supersedes = plan.get("version"), plan.get("supersedes")
    if supersedes is not None:
        how = f"changed to version {version} (replacing version {supersedes})"
    elif version == 1:
        how = "set (version 1)"
    else:
        how = f"restated unchanged (version {version})"
    return f"The plan was {how}: {quote(plan.get('text'))}"


def _card(e: TimelineEntry, q: Mapping[str, str]) -> str:
    card = e["card"]
    name = f"Todo {quote(card.get('id'))}"
    text = quote(card.get("text"))
    version = card.get("version")
    inherited = card.get("inherited_from")
    if isinstance(inherited, Mapping):
        return (
            f"{name} arrived from session {quote(inherited.get('session'))} "
            f"(its version {inherited.get('version')}) as {card.get('to')}: {text}"
        )
    if card.get("from") is None:
        return f"{name} is {card.get('to')} (version {version}): {text}"
    return f"{name} moved from {card.get('from')} to {card.get('to')} (version {version}): {text}"


def _waiting(e: TimelineEntry, q: Mapping[str, str]) -> str:
    question = e["question"]
    details = [f"reason: {question.get('reason') or 'unspecified'}"]
    expires = question.get("expires_at")
    if expires is None:
        details.append("no deadline")
    elif parse_deadline(expires) is None:
        details.append(f"unreadable deadline {quote(expires)}, never expires")
    else:
        details.append(f"expires {short_instant(expires)}")
    options: Sequence[Any] = question.get("options") or ()
    offered = f"; options: {', '.join(map(str, options))}" if options else ""
    return f"The agent asked {quote(question.get('question'))} ({'; '.join(details)}){offered}"


def _answered(e: TimelineEntry, q: Mapping[str, str]) -> str:
    qid = str(e.get("question_id"))
    asked = quote(q[qid]) if qid in q else f"question {quote(qid)}"
    via = f", via {e['executor']}" if e.get("executor") else ""
    by = e.get("by")
    who = principal_text(by) if isinstance(by, Mapping) and by.get("id") else "Someone unidentified"
    return f"{who} answered {asked} with {quote(e.get('answer'))}{via}"


def _expired(e: TimelineEntry, q: Mapping[str, str]) -> str:
    at = e.get("at")
    when = f" at {short_instant(at)}" if at else ""
    return f"Nobody answered {quote(e.get('question'))}: its window closed{when}"


def _option_removed(e: TimelineEntry, q: Mapping[str, str]) -> str:
    message = f": {e['message']}" if e.get("message") else ""
    return f"Option {quote(e.get('option'))} was removed for good (code {e.get('code')}{message})"


def _prerequisite_set(e: TimelineEntry, q: Mapping[str, str]) -> str:
    tools: Sequence[Any] = e.get("tools") or ()
    if not tools:
        return "Nothing has to run first any more"
    return f"Before anything else the agent must run: {', '.join(map(str, tools))}"


def _transferred(e: TimelineEntry, q: Mapping[str, str]) -> str:
    todos: Sequence[Mapping[str, Any]] = e.get("todos") or ()
    ids = ", ".join(str(t.get("id")) for t in todos)
    count = _count(len(todos), "open todo")
    return f"{count} ({ids}) handed over to session {quote(e.get('to'))}"


def _open_work(e: TimelineEntry, q: Mapping[str, str]) -> str:
    todos: Sequence[Mapping[str, Any]] = e.get("todos") or ()
    parts = []
    for t in todos:
        where = f", transferred to {t['to']}" if t.get("to") else ""
        parts.append(f"{t.get('id')} ({t.get('status')}{where})")
    return f"The session ended with {_count(len(todos), 'open todo')}: {', '.join(parts)}"


def _ended(e: TimelineEntry, q: Mapping[str, str]) -> str:
    because = e.get("because")
    return f"The session ended: {because}" if because else "The session ended"


def _fallback(entry: TimelineEntry) -> str:
    return f"Something of kind {quote(entry.get('kind'))} happened (seq {entry.get('seq')})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


_NARRATORS: dict[str, _Narrator] = {
    "activity": _activity,
    "announced": _announced,
    "message": _message,
    "plan": _plan,
    "card": _card,
    "waiting": _waiting,
    "answered": _answered,
    "expired": _expired,
    "option-removed": _option_removed,
    "prerequisite-set": _prerequisite_set,
    "transferred": _transferred,
    "open-work": _open_work,
    "ended": _ended,
}
