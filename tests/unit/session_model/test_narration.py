"""Narration: every timeline entry kind the translator produces reads as one plain sentence."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

from producers.store import SessionStore
from session_model.narration import principal_text, quote, sentence, short_instant
from session_model.principal import Principal
from session_model.session import Question
from session_model.timeline import TimelineEntry
from tests.unit.builders import OPERATOR

T0 = datetime(2026, 1, 1, 10, 0, tzinfo=UTC)


def _store() -> SessionStore:
    counter = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR, clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}"
    )


def _entries(store: SessionStore, sid: str = "s1") -> list[TimelineEntry]:
    return store.timeline(sid)


def _only(entries: list[TimelineEntry], kind: str) -> TimelineEntry:
    (found,) = [e for e in entries if e["kind"] == kind]
    return found


def _a_full_session() -> SessionStore:
    store = _store()
    store.start("s1", "ship the release")
    store.start("s2", "take over")
    store.record_turn("s1", "user", "please ship it")
    store.record_turn("s1", "assistant", "on it")
    store.record_tool_call("s1", "ls", {}, "a.txt b.txt")
    store.set_plan("s1", "build, test, ship")
    store.set_plan("s1", "build, ship")
    store.set_todo("s1", "t1", "build", "pending")
    store.set_todo("s1", "t1", "build", "done")
    store.set_todo("s1", "t2", "ship", "pending")
    store.message("s1", "s9", "the registry is down")
    store.remove_option("s1", "force", "unsafe", "never force-push")
    store.require_first("s1", ["tests", "lint"])
    q = Question(
        "q1", "Deploy?", ("yes", "no"), expires_at="2026-01-01T12:00:00Z", reason="permission"
    )
    store.ask("s1", q)
    store.answer("s1", "q1", "yes", Principal("cli:rod@laptop", verified=True), executor="cli")
    store.set_mode("s1", "acknowledge")
    store.record_tool_call("s1", "deploy", {"env": "prod"}, "deployed", mutating=True)
    return store


def test_turns_read_as_who_said_what() -> None:
    activity = [e for e in _entries(_a_full_session()) if e["kind"] == "activity"]
    said = [sentence(e) for e in activity]
    assert said[0] == "The user said «please ship it»"
    assert said[1] == "The agent said «on it»"
    assert said[2] == "The agent called «ls» and it succeeded: «a.txt b.txt»"
    assert said[3] == "The agent called «deploy» (mutating) and it succeeded: «deployed»"


def test_a_failed_tool_call_says_so() -> None:
    store = _store()
    store.start("s1", "g")
    store.record_tool_call("s1", "make", {}, "error 2", ok=False)
    (entry,) = _entries(store)
    assert sentence(entry) == "The agent called «make» and it failed: «error 2»"


def test_announced_call_names_the_operation_and_its_canonical_arguments() -> None:
    entry = _only(_entries(_a_full_session()), "announced")
    assert sentence(entry) == (
        'The agent announced the mutating call «deploy» with {"env":"prod"} and went on '
        "(mode acknowledge)"
    )


def test_plan_versions_read_as_set_then_changed() -> None:
    plans = [sentence(e) for e in _entries(_a_full_session()) if e["kind"] == "plan"]
    assert plans == [
        "The plan was set (version 1): «build, test, ship»",
        "The plan was changed to version 2 (replacing version 1): «build, ship»",
    ]


def test_cards_read_as_their_status_and_moves() -> None:
    cards = [sentence(e) for e in _entries(_a_full_session()) if e["kind"] == "card"]
    assert cards == [
        "Todo «t1» is pending (version 1): «build»",
        "Todo «t1» moved from pending to done (version 2): «build»",
        "Todo «t2» is pending (version 1): «ship»",
    ]


def test_message_option_removed_and_prerequisites() -> None:
    entries = _entries(_a_full_session())
    assert sentence(_only(entries, "message")) == (
        "Session «s9» sent a message: «the registry is down»"
    )
    assert sentence(_only(entries, "option-removed")) == (
        "Option «force» was removed for good (code unsafe: never force-push)"
    )
    assert sentence(_only(entries, "prerequisite-set")) == (
        "Before anything else the agent must run: tests, lint"
    )


def test_question_reads_with_reason_deadline_and_options() -> None:
    entry = _only(_entries(_a_full_session()), "waiting")
    assert sentence(entry) == (
        "The agent asked «Deploy?» (reason: permission; expires 2026-01-01 12:00Z); "
        "options: yes, no"
    )


def test_answer_names_who_whether_verified_and_the_question_when_known() -> None:
    entry = _only(_entries(_a_full_session()), "answered")
    assert sentence(entry, {"q1": "Deploy?"}) == (
        "cli:rod@laptop (verified) answered «Deploy?» with «yes», via cli"
    )
    assert sentence(entry) == "cli:rod@laptop (verified) answered question «q1» with «yes», via cli"


def test_an_unverified_or_anonymous_answer_says_so() -> None:
    base: TimelineEntry = {"kind": "answered", "seq": 3, "question_id": "q1", "answer": "no"}
    unverified = {**base, "by": {"id": "actor:7", "verified": False}, "executor": None}
    assert sentence(unverified) == "actor:7 (unverified) answered question «q1» with «no»"
    assert sentence({**base, "by": None}) == (
        "Someone unidentified answered question «q1» with «no»"
    )


def test_questions_without_or_with_an_unreadable_deadline() -> None:
    entry: TimelineEntry = {
        "kind": "waiting",
        "seq": 2,
        "question": {"question": "Sign?", "options": [], "reason": None, "expires_at": None},
    }
    assert sentence(entry) == "The agent asked «Sign?» (reason: unspecified; no deadline)"
    entry["question"]["expires_at"] = "tomorrow"
    assert sentence(entry) == (
        "The agent asked «Sign?» (reason: unspecified; unreadable deadline «tomorrow», "
        "never expires)"
    )


def test_a_closed_window_reads_as_expiry_then_the_end_with_open_work() -> None:
    store = _store()
    store.start("s1", "g")
    store.set_todo("s1", "t1", "build", "in_progress")
    store.ask("s1", Question("q1", "Deploy?", ("yes", "no"), expires_at="2026-01-01T10:00:00Z"))
    assert store.expire_if_due("s1", datetime(2026, 1, 1, 10, 0, 5, tzinfo=UTC))
    entries = _entries(store)
    assert sentence(_only(entries, "expired")) == (
        "Nobody answered «Deploy?»: its window closed at 2026-01-01 10:00:05Z"
    )
    assert sentence(_only(entries, "open-work")) == (
        "The session ended with 1 open todo: t1 (in_progress)"
    )
    assert sentence(_only(entries, "ended")).startswith(
        "The session ended: the window to answer «Deploy?» closed"
    )


def test_transfer_and_end() -> None:
    store = _a_full_session()
    assert store.transfer_open_todos("s1", "s2") == 1
    store.end("s1", "handed over")
    entries = _entries(store)
    assert sentence(_only(entries, "transferred")) == "1 open todo (t2) handed over to session «s2»"
    assert sentence(_only(entries, "open-work")) == (
        "The session ended with 1 open todo: t2 (pending, transferred to s2)"
    )
    assert sentence(_only(entries, "ended")) == "The session ended: handed over"
    inherited = _only(_entries(store, "s2"), "card")
    assert (
        sentence(inherited)
        == "Todo «t2» arrived from session «s1» (its version 1) as pending: «ship»"
    )


def test_unknown_or_malformed_entries_fall_back_to_their_kind_and_seq() -> None:
    assert sentence({"kind": "mode-changed", "seq": 7}) == (
        "Something of kind «mode-changed» happened (seq 7)"
    )
    assert sentence({"kind": "plan", "seq": 4, "plan": None}) == (
        "Something of kind «plan» happened (seq 4)"
    )


def test_helpers() -> None:
    assert quote("a\n  b") == "«a b»"
    assert quote("x" * 10, limit=5) == "«xxxx…»"
    assert short_instant("2026-01-01T12:00:00.000Z") == "2026-01-01 12:00Z"
    assert short_instant("2026-01-01T14:00:30+02:00") == "2026-01-01 12:00:30Z"
    assert short_instant("soon") == "soon"
    assert principal_text({"id": "operator:alice", "verified": True}) == (
        "operator:alice (verified)"
    )
