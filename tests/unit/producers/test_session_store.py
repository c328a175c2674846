"""SessionStore over the in-memory backend: what each writer appends, and what it refuses.

Spec: the event table (payloads), "Rejections and no-ops", "Writes that span two sessions"; the
writer API refuses calls with a specific `InvalidCall` before anything is appended.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from producers.store import SessionStore
from projections.memory import InMemoryProjectionStore
from projections.requests import Retention
from schemas import events as ev
from schemas.errors import (
    InvalidAnswerError,
    InvalidCall,
    LateAnswerError,
    LogError,
    MilpaError,
    NoOpenQuestionError,
    ProjectionError,
    QuestionOpenError,
    SessionAlreadyStartedError,
    SessionEndedError,
    UnauthorizedError,
    UnknownSessionError,
)
from schemas.events import Event
from session_model.canonical import argument_digest
from session_model.deadlines import format_instant
from session_model.fold import fold
from session_model.modes import Mode
from session_model.policy import APPROVAL, signature_question, target_question
from session_model.principal import Principal
from session_model.session import OTHER_NAMES, Question, Turn
from tests.unit.builders import OPERATOR

T0 = datetime(2026, 1, 1, 10, 0, 0, 123456, tzinfo=UTC)
T0_MS = datetime(2026, 1, 1, 10, 0, 0, 123000, tzinfo=UTC)


def _store(**kwargs: Any) -> SessionStore:
    counter = itertools.count(1)
    kwargs.setdefault("signer", OPERATOR)
    return SessionStore.in_memory(clock=lambda: T0, new_id=lambda: f"ev-{next(counter)}", **kwargs)


def _started(**kwargs: Any) -> SessionStore:
    store = _store(**kwargs)
    store.start("s1", "ship it", "ask")
    return store


def _last(store: SessionStore) -> Event:
    return store.log.records[-1].event


def _q(qid: str = "q1") -> Question:
    return Question(qid, "Deploy?", ("yes", "no"), why="{}", reason="permission")


# -- the envelope ---------------------------------------------------------------------------------


def test_injected_clock_and_ids_make_the_envelope_deterministic() -> None:
    store = _store(producer="agent-7")
    store.start("s1", "ship it")
    store.record_turn("s1", "user", "hi")
    first, second = (r.event for r in store.log.records)
    assert (first.event_id, second.event_id) == ("ev-1", "ev-2")
    assert first.occurred_at == T0_MS  # UTC, millisecond precision
    assert first.producer == "agent-7"
    assert first.session_id == "s1"
    assert first.expected_seq is None


def test_clock_reading_is_converted_to_utc() -> None:
    plus_two = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    store = SessionStore.in_memory(clock=lambda: plus_two, new_id=lambda: "x")
    store.start("s1", "g")
    assert _last(store).occurred_at == datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert _last(store).occurred_at.utcoffset() == timedelta(0)


def test_event_builder_carries_expected_seq_and_event_id() -> None:
    store = _started()
    e = store.event("s1", ev.TURN, {"role": "user", "content": "x"}, expected_seq=1, event_id="e")
    assert (e.event_id, e.expected_seq, e.type, dict(e.payload)) == (
        "e",
        1,
        ev.TURN,
        {"role": "user", "content": "x"},
    )


def test_positions_returned_are_log_positions() -> None:
    store = _store()
    p1 = store.start("s1", "g")
    p2 = store.record_turn("s1", "user", "x")
    assert p1 == store.log.records[0].position
    assert p2 == store.log.records[1].position
    assert p1 < p2


# -- what each writer appends ---------------------------------------------------------------------


def test_start_appends_started_with_goal_mode_parent() -> None:
    store = _store()
    store.start("s1", "ship it", "auto", parent_id="p0")
    e = _last(store)
    assert e.type == ev.STARTED
    assert _unsigned(e) == {"goal": "ship it", "mode": "auto", "parent_id": "p0"}
    assert e.payload["authority"]["key_id"] == OPERATOR.key_id  # auto is less than ask: signed


def test_start_defaults_to_ask_and_no_parent() -> None:
    store = _store()
    store.start("s1", "ship it")
    assert dict(_last(store).payload) == {"goal": "ship it", "mode": "ask", "parent_id": None}
    s = store.load("s1")
    assert (s.goal, s.mode, s.parent_id, s.started) == ("ship it", Mode.ASK, None, True)


def test_start_accepts_a_mode_value() -> None:
    store = _store()
    store.start("s1", "g", Mode.ACKNOWLEDGE)
    assert _last(store).payload["mode"] == "acknowledge"


def test_record_turn_appends_turn() -> None:
    store = _started()
    store.record_turn("s1", "assistant", "on it")
    e = _last(store)
    assert e.type == ev.TURN
    assert dict(e.payload) == {"role": "assistant", "content": "on it"}
    assert store.load("s1").turns == (Turn("assistant", "on it", 2),)


def test_record_tool_call_appends_every_field() -> None:
    store = _started()
    store.record_tool_call(
        "s1",
        "pytest",
        {"k": "x"},
        "1 passed",
        ok=False,
        mutating=True,
        artifact="file:a.py",
        verdict="fail",
        effect_observation_id="obs-1",
    )
    e = _last(store)
    assert e.type == ev.TOOL_CALLED
    assert dict(e.payload) == {
        "tool": "pytest",
        "arguments": {"k": "x"},
        "result": "1 passed",
        "ok": False,
        "mutating": True,
        "artifact": "file:a.py",
        "verdict": "fail",
        "effect_observation_id": "obs-1",
    }
    s = store.load("s1")
    assert s.turns[-1] == Turn("tool", "pytest → 1 passed", 2)
    assert (s.tool_calls, s.mutations) == (1, 1)


def test_record_tool_call_defaults() -> None:
    store = _started()
    store.record_tool_call("s1", "ls", {}, "a.py")
    assert dict(_last(store).payload) == {
        "tool": "ls",
        "arguments": {},
        "result": "a.py",
        "ok": True,
        "mutating": False,
        "artifact": None,
        "verdict": None,
        "effect_observation_id": None,
    }


def test_message_writes_only_to_the_recipient() -> None:
    store = _store()
    store.start("sender", "g")
    store.start("recipient", "g")
    sender_before = store.load("sender")
    n = len(store.log.records)
    store.message("recipient", "sender", "the build is green")
    assert len(store.log.records) == n + 1
    e = _last(store)
    assert e.session_id == "recipient"
    assert e.type == ev.MESSAGE_SENT
    assert dict(e.payload) == {"from": "sender", "content": "the build is green"}
    assert store.load("sender") == sender_before
    assert store.load("recipient").turns[-1] == Turn(
        "user", "■ message from «sender»: the build is green", 2
    )


def test_message_grants_nothing_and_answers_nothing() -> None:
    store = _started()
    store.ask("s1", _q())
    store.message("s1", "boss", "yes, granted: deploy")
    s = store.load("s1")
    assert s.question is not None
    assert s.permissions == ()
    assert s.decisions == ()


def test_set_plan_appends_plan_set() -> None:
    store = _started()
    store.set_plan("s1", "build then ship")
    assert _last(store).type == ev.PLAN_SET
    assert dict(_last(store).payload) == {"plan": "build then ship"}
    s = store.load("s1")
    assert (s.plan, s.plan_version) == ("build then ship", 1)


def test_set_todo_appends_todo_changed() -> None:
    store = _started()
    store.set_todo("s1", "t2", "redo build", "in_progress", replaces="t1")
    e = _last(store)
    assert e.type == ev.TODO_CHANGED
    assert dict(e.payload) == {
        "id": "t2",
        "text": "redo build",
        "status": "in_progress",
        "replaces": "t1",
    }


def test_set_todo_defaults_to_pending_without_replaces() -> None:
    store = _started()
    store.set_todo("s1", "t1", "build")
    assert dict(_last(store).payload) == {
        "id": "t1",
        "text": "build",
        "status": "pending",
        "replaces": None,
    }


def test_ask_appends_question_asked() -> None:
    store = _started()
    q = Question(
        "q1",
        "Deploy?",
        ("yes", "no"),
        why='{"a":1}',
        expires_at="2026-01-02T00:00:00Z",
        reason="permission",
    )
    store.ask("s1", q)
    e = _last(store)
    assert e.type == ev.QUESTION_ASKED
    assert dict(e.payload) == {
        "question_id": "q1",
        "question": "Deploy?",
        "options": ["yes", "no"],
        "why": '{"a":1}',
        "expires_at": "2026-01-02T00:00:00Z",
        "reason": "permission",
    }
    s = store.load("s1")
    assert s.is_runnable() is False
    assert s.question == Question(
        "q1", "Deploy?", ("yes", "no"), '{"a":1}', "2026-01-02T00:00:00Z", "permission", 2, T0_MS
    )


def test_answer_appends_question_answered() -> None:
    store = _started()
    store.ask("s1", _q())
    store.answer("s1", "q1", "yes", by=Principal("cli:rod@laptop"), executor="runner-1")
    e = _last(store)
    assert e.type == ev.QUESTION_ANSWERED
    assert dict(e.payload) == {
        "question_id": "q1",
        "answer": "yes",
        "by": {"id": "cli:rod@laptop", "verified": False},
        "executor": "runner-1",
        "signature": None,
        "approval": None,
        "asked_seq": 2,  # the asking answered: the question's seq as this store read it
    }
    s = store.load("s1")
    assert s.is_runnable() is True
    d = s.decisions[-1]
    assert (d.question_id, d.answer, d.by, d.executor, d.reason, d.why) == (
        "q1",
        "yes",
        Principal("cli:rod@laptop", verified=False),
        "runner-1",
        "permission",
        "{}",
    )
    assert s.turns[-1] == Turn("user", "yes", 3)


def test_answer_without_principal_keeps_by_none() -> None:
    store = _started()
    store.ask("s1", _q())
    store.answer("s1", "q1", "no")
    assert _last(store).payload["by"] is None
    assert store.load("s1").decisions[-1].by is None


def test_grant_and_revoke_append_their_events_and_the_grant_stays_in_the_log() -> None:
    store = _started()
    store.grant("s1", "deploy")
    assert (_last(store).type, _unsigned(_last(store))) == (
        ev.PERMISSION_GRANTED,
        {"operation": "deploy"},
    )
    assert _last(store).payload["authority"]["key_id"] == OPERATOR.key_id
    assert store.load("s1").permissions == ("deploy",)
    store.revoke("s1", "deploy")
    assert (_last(store).type, dict(_last(store).payload)) == (
        ev.PERMISSION_REVOKED,
        {"operation": "deploy"},
    )
    assert store.load("s1").permissions == ()
    assert [r.event.type for r in store.log.records] == [
        ev.STARTED,
        ev.PERMISSION_GRANTED,
        ev.PERMISSION_REVOKED,
    ]


def test_set_mode_appends_mode_changed() -> None:
    store = _started()
    store.set_mode("s1", "auto")
    assert (_last(store).type, _unsigned(_last(store))) == (ev.MODE_CHANGED, {"mode": "auto"})
    assert store.load("s1").mode is Mode.AUTO
    store.set_mode("s1", "ask")  # stricter: needs no signature
    assert dict(_last(store).payload) == {"mode": "ask"}


def _unsigned(e: Event) -> dict[str, object]:
    return {k: v for k, v in e.payload.items() if k != "authority"}


def test_remove_option_appends_option_removed_with_reason() -> None:
    store = _started()
    store.remove_option("s1", "force-push", "unsafe", "it rewrites history")
    e = _last(store)
    assert e.type == ev.OPTION_REMOVED
    assert dict(e.payload) == {
        "option": "force-push",
        "reason": {"code": "unsafe", "message": "it rewrites history"},
    }
    assert store.load("s1").removed_options == ("force-push",)


def test_remove_option_message_is_optional() -> None:
    store = _started()
    store.remove_option("s1", "force-push", "unsafe")
    assert _last(store).payload["reason"] == {"code": "unsafe", "message": None}


def test_require_first_appends_prerequisite_set_without_blanks() -> None:
    store = _started()
    store.require_first("s1", ["plan", " ", "", "pytest"])
    e = _last(store)
    assert e.type == ev.PREREQUISITE_SET
    assert dict(e.payload) == {"tools": ["plan", "pytest"]}
    s = store.load("s1")
    assert (s.run_first, s.obligation_declared) == (("plan", "pytest"), True)


def test_require_first_empty_list_lifts() -> None:
    store = _started()
    store.require_first("s1", ["plan"])
    store.require_first("s1", [])
    assert dict(_last(store).payload) == {"tools": []}
    s = store.load("s1")
    assert (s.run_first, s.obligation_declared) == ((), False)


def test_compact_appends_compacted() -> None:
    store = _started()
    for i in range(3):
        store.record_turn("s1", "user", f"t{i}")
    store.compact("s1", "summary text", 3)
    assert (_last(store).type, dict(_last(store).payload)) == (
        ev.COMPACTED,
        {"summary": "summary text", "through": 3},
    )
    s = store.load("s1")
    assert (s.summary, s.compacted_through) == ("summary text", 3)


def test_end_appends_ended() -> None:
    store = _started()
    store.end("s1", "shipped")
    assert (_last(store).type, dict(_last(store).payload)) == (ev.ENDED, {"because": "shipped"})
    s = store.load("s1")
    assert (s.ended, s.ended_because, s.is_runnable()) == (True, "shipped", False)


def test_record_effect_observation_appends_and_returns_its_event_id() -> None:
    store = _started()
    obs = store.record_effect_observation(
        "s1", known=False, artifacts=("a",), evidence=["b"], observer="probe"
    )
    e = _last(store)
    assert obs == e.event_id == "ev-2"
    assert e.type == ev.EFFECT_OBSERVED
    assert dict(e.payload) == {
        "known": False,
        "artifacts": ["a"],
        "evidence": ["b"],
        "observer": "probe",
    }


def test_record_execution_appends_the_digest_of_the_canonical_arguments() -> None:
    store = _started()
    store.record_execution(
        "s1", "deploy", {"replicas": 3, "target": "prod"}, artifact="svc:web", executor="r-1"
    )
    e = _last(store)
    assert e.type == ev.EXECUTION_RECORDED
    assert dict(e.payload) == {
        "operation": "deploy",
        "argument_digest": argument_digest({"target": "prod", "replicas": 3}),
        "artifact": "svc:web",
        "executor": "r-1",
    }
    assert e.payload["argument_digest"] == (
        hashlib.sha256(b'{"replicas":3,"target":"prod"}').hexdigest()
    )
    x = store.load("s1").executions[-1]
    assert (x.operation, x.artifact, x.executor, x.seq) == ("deploy", "svc:web", "r-1", 2)


# -- transfers ------------------------------------------------------------------------------------


def _with_open_cards(**kwargs: Any) -> SessionStore:
    store = _store(**kwargs)
    store.start("src", "g")
    store.start("dst", "g")
    store.set_todo("src", "t1", "build", "done")
    store.set_todo("src", "t2", "test", "in_progress")
    store.set_todo("src", "t3", "ship", "blocked")
    return store


def test_transfer_appends_to_target_first_then_the_source() -> None:
    store = _with_open_cards()
    n = len(store.log.records)
    assert store.transfer_open_todos("src", "dst") == 2
    appended = [r.event for r in store.log.records[n:]]
    assert [(e.session_id, e.type) for e in appended] == [
        ("dst", ev.TODO_CHANGED),
        ("dst", ev.TODO_CHANGED),
        ("src", ev.TODOS_TRANSFERRED),
    ]
    assert dict(appended[0].payload) == {
        "id": "t2",
        "text": "test",
        "status": "in_progress",
        "replaces": None,
        "inherited_from": {"session": "src", "version": 1, "origin": "planned"},
    }
    assert dict(appended[2].payload) == {
        "to": "dst",
        "todos": [{"id": "t2", "version": 1}, {"id": "t3", "version": 1}],
    }
    assert store.open_todos("src") == ()
    assert [t.id for t in store.open_todos("dst")] == ["t2", "t3"]


def test_transfer_with_nothing_open_returns_zero_and_appends_nothing() -> None:
    store = _store()
    store.start("src", "g")
    store.start("dst", "g")
    store.set_todo("src", "t1", "build", "done")
    n = len(store.log.records)
    assert store.transfer_open_todos("src", "dst") == 0
    assert len(store.log.records) == n


def test_transfer_does_not_move_a_card_twice() -> None:
    store = _with_open_cards()
    store.transfer_open_todos("src", "dst")
    n = len(store.log.records)
    assert store.transfer_open_todos("src", "dst") == 0
    assert len(store.log.records) == n


def test_transfer_rerun_after_interruption_completes_without_duplicates() -> None:
    # A run that was interrupted after the target half: replay only those events. The re-run is
    # another store's, with the same id key (the deployment's MILPA_ID_KEY_FILE).
    key = b"deployment id key"
    full = _with_open_cards(id_key=key)
    n = len(full.log.records)
    full.transfer_open_todos("src", "dst")
    target_half = [r.event for r in full.log.records[n:] if r.event.session_id == "dst"]
    store = _with_open_cards(id_key=key)
    for e in target_half:
        store.append(e)
    assert store.transfer_open_todos("src", "dst") == 2
    rerun = [r.event for r in store.log.records[n + len(target_half) :]]
    # The target holds both cards as the source has them: the re-run sends it nothing again.
    assert [e.session_id for e in rerun] == ["src"]
    dst = store.load("dst")
    assert [(t.id, t.version) for t in dst.todos] == [("t2", 1), ("t3", 1)]
    assert dst.seq == 3  # started + two cards; the duplicates take no seq
    assert store.open_todos("src") == ()
    assert store.load("src") == full.load("src")


def test_a_session_id_with_a_control_character_is_refused_before_anything_is_appended() -> None:
    store = _store()
    with pytest.raises(InvalidCall, match="control character"):
        store.start("\x00checkpoint:0", "goal")
    assert store.log.records == []


@pytest.mark.parametrize("session_id", ["job/1", "x/../victim", ".", ".."])
def test_a_session_id_no_url_path_segment_can_carry_is_refused(session_id: str) -> None:
    """The console names a session by one path segment: `/` would split it, and browsers take
    `.` and `..` away before sending the request."""
    store = _store()
    with pytest.raises(InvalidCall, match="no `/`, and not only dots"):
        store.start(session_id, "goal")
    assert store.log.records == []


def test_the_name_the_overflow_is_counted_under_is_refused_as_a_tool_or_a_reason_code() -> None:
    """A session counts its first tools and reason codes apart and the rest under `(other)`: a
    tool or a code so named would be counted with them."""
    store = _store()
    store.start("s1", "goal")
    before = len(store.log.records)
    with pytest.raises(InvalidCall, match=r"tool '\(other\)' is reserved"):
        store.record_tool_call("s1", OTHER_NAMES, {}, "ok")
    with pytest.raises(InvalidCall, match=r"reason code '\(other\)' is reserved"):
        store.ask("s1", Question("q1", "go?", ("yes",), reason=OTHER_NAMES))
    assert len(store.log.records) == before
    store.record_tool_call("s1", "(others)", {}, "ok")
    store.ask("s1", Question("q1", "go?", ("yes",), reason="other"))
    assert store.load("s1").tools == {"(others)": 1} and store.load("s1").pauses == {"other": 1}


def test_a_session_id_with_dots_among_other_characters_is_fine() -> None:
    store = _store()
    store.start("release.v1..2", "goal")
    assert store.load("release.v1..2").started


def test_transfer_to_the_same_session_is_invalid() -> None:
    store = _with_open_cards()
    n = len(store.log.records)
    with pytest.raises(InvalidCall):
        store.transfer_open_todos("src", "src")
    assert len(store.log.records) == n


# -- reads ----------------------------------------------------------------------------------------


def test_load_of_an_unknown_session_raises() -> None:
    with pytest.raises(UnknownSessionError):
        _store().load("ghost")


def test_find_of_an_unknown_session_is_none() -> None:
    assert _store().find("ghost") is None


def test_ids_are_sorted() -> None:
    store = _store()
    for sid in ["zeta", "alpha", "mid"]:
        store.start(sid, "g")
    assert store.ids() == ["alpha", "mid", "zeta"]


def test_open_todos_reads_cards_not_done_and_not_transferred() -> None:
    store = _with_open_cards()
    assert [t.id for t in store.open_todos("src")] == ["t2", "t3"]


def test_timeline_since_filters_by_seq() -> None:
    store = _started()
    store.record_turn("s1", "user", "a")
    store.record_turn("s1", "assistant", "b")
    assert [e["seq"] for e in store.timeline("s1")] == [2, 3]
    assert [e["seq"] for e in store.timeline("s1", since=2)] == [3]
    assert store.timeline("s1", since=2)[0] == {
        "session": "s1",
        "kind": "activity",
        "seq": 3,
        "state": "ready",
        "role": "assistant",
        "content": "b",
    }


def test_projection_equals_a_direct_fold_of_the_log() -> None:
    store = _started()
    store.set_plan("s1", "p")
    store.record_tool_call("s1", "make", {}, "ok", mutating=True)
    store.ask("s1", _q())
    store.answer("s1", "q1", "yes")
    events = [r.event for r in store.log.records]
    assert store.load("s1") == fold("s1", events)


# -- refusals: a specific error, and nothing appended ---------------------------------------------


def _refused(store: SessionStore, call: Callable[[], object], error: type[Exception]) -> None:
    before = list(store.log.records)
    with pytest.raises(error):
        call()
    assert store.log.records == before


def test_error_hierarchy() -> None:
    for error in (
        UnknownSessionError,
        SessionAlreadyStartedError,
        SessionEndedError,
        NoOpenQuestionError,
        QuestionOpenError,
    ):
        assert issubclass(error, InvalidCall)
    assert issubclass(InvalidCall, MilpaError)


@pytest.mark.parametrize(
    ("option", "code"), [("", "unsafe"), ("   ", "unsafe"), ("force-push", ""), ("x", "  ")]
)
def test_remove_option_with_empty_option_or_code_is_invalid(option: str, code: str) -> None:
    store = _started()
    _refused(store, lambda: store.remove_option("s1", option, code), InvalidCall)


def test_second_start_raises_already_started() -> None:
    store = _started()
    _refused(store, lambda: store.start("s1", "again"), SessionAlreadyStartedError)


def test_start_refuses_the_id_of_a_session_whose_projection_expired() -> None:
    """Retention dropped the ended session's projection (`find` says None, a tombstone says
    why): its id is still the session's, and a second start is refused before it is appended."""
    store = _store()
    projections = store.projections
    assert isinstance(projections, InMemoryProjectionStore)
    projections.retention = Retention(1000)
    store.start("s1", "ship it")
    store.end("s1", "done")
    assert projections.expire_due(T0 + timedelta(seconds=1)) == ["s1"]
    other = SessionStore(store.log, projections, signer=OPERATOR)  # another writer: no wait
    assert other.find("s1") is None
    with pytest.raises(SessionAlreadyStartedError, match=r"expired .*replay --session s1"):
        other.start("s1", "again")
    _refused(other, lambda: other.start("s1", "again"), SessionAlreadyStartedError)
    # The writer that wrote it waits for a projection that is gone: refused alike.
    _refused(store, lambda: store.start("s1", "again"), SessionAlreadyStartedError)
    # Without checks the writer reads nothing: appended, and folded by no one.
    loose = SessionStore(store.log, projections, signer=OPERATOR, checks=False)
    loose.start("s1", "again")
    assert projections.load("s1") is None and projections.expired("s1") is not None


def test_start_with_unknown_mode_is_invalid() -> None:
    store = _store()
    _refused(store, lambda: store.start("s1", "g", "yolo"), InvalidCall)
    assert store.find("s1") is None


def test_start_with_empty_id_is_invalid() -> None:
    store = _store()
    _refused(store, lambda: store.start("", "g"), InvalidCall)


def test_set_mode_with_unknown_mode_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.set_mode("s1", "turbo"), InvalidCall)
    assert store.load("s1").mode is Mode.ASK


@pytest.mark.parametrize("role", ["tool", "admin", ""])
def test_record_turn_with_unknown_role_is_invalid(role: str) -> None:
    store = _started()
    _refused(store, lambda: store.record_turn("s1", role, "x"), InvalidCall)


@pytest.mark.parametrize("status", ["closed", "DONE", ""])
def test_set_todo_with_unknown_status_is_invalid(status: str) -> None:
    store = _started()
    _refused(store, lambda: store.set_todo("s1", "t1", "x", status), InvalidCall)


def test_set_todo_with_empty_id_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.set_todo("s1", " ", "x"), InvalidCall)


def test_record_tool_call_with_empty_tool_or_bad_verdict_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.record_tool_call("s1", "", {}, "x"), InvalidCall)
    _refused(
        store, lambda: store.record_tool_call("s1", "pytest", {}, "x", verdict="meh"), InvalidCall
    )


def test_grant_revoke_record_execution_with_empty_operation_are_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.grant("s1", ""), InvalidCall)
    _refused(store, lambda: store.revoke("s1", " "), InvalidCall)
    _refused(store, lambda: store.record_execution("s1", "", {}), InvalidCall)


def test_message_with_empty_sender_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.message("s1", "", "hi"), InvalidCall)


def test_ask_with_empty_question_id_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.ask("s1", Question("", "?")), InvalidCall)


def test_compact_through_below_one_is_invalid() -> None:
    store = _started()
    _refused(store, lambda: store.compact("s1", "s", 0), InvalidCall)


WRITES_TO_S1: dict[str, Callable[[SessionStore], object]] = {
    "record_turn": lambda st: st.record_turn("s1", "user", "x"),
    "record_tool_call": lambda st: st.record_tool_call("s1", "make", {}, "ok"),
    "message": lambda st: st.message("s1", "other", "hi"),
    "set_plan": lambda st: st.set_plan("s1", "p"),
    "set_todo": lambda st: st.set_todo("s1", "t1", "x"),
    "ask": lambda st: st.ask("s1", _q("q9")),
    "grant": lambda st: st.grant("s1", "deploy"),
    "revoke": lambda st: st.revoke("s1", "deploy"),
    "set_mode": lambda st: st.set_mode("s1", "auto"),
    "remove_option": lambda st: st.remove_option("s1", "o", "c"),
    "require_first": lambda st: st.require_first("s1", ["plan"]),
    "compact": lambda st: st.compact("s1", "s", 1),
    "end": lambda st: st.end("s1", "again"),
    "record_effect_observation": lambda st: st.record_effect_observation("s1", known=True),
    "record_execution": lambda st: st.record_execution("s1", "deploy", {}),
    "answer": lambda st: st.answer("s1", "q1", "yes"),
    "expire_if_due": lambda st: st.expire_if_due("s1", datetime(2999, 1, 1, tzinfo=UTC)),
}


@pytest.mark.parametrize("name", sorted(WRITES_TO_S1))
def test_writes_to_an_unknown_session_raise_unknown_session(name: str) -> None:
    store = _store()
    store.start("other", "g")
    _refused(store, lambda: WRITES_TO_S1[name](store), UnknownSessionError)


@pytest.mark.parametrize("name", sorted(set(WRITES_TO_S1) - {"expire_if_due"}))
def test_writes_after_end_raise_session_ended(name: str) -> None:
    store = _started()
    store.start("other", "g")
    store.end("s1", "shipped")
    _refused(store, lambda: WRITES_TO_S1[name](store), SessionEndedError)
    assert store.load("s1").rejections == ()


def test_expire_if_due_after_end_appends_nothing() -> None:
    store = _started()
    store.ask("s1", Question("q1", "?", expires_at="2026-01-01T00:00:00Z"))
    store.end("s1", "shipped")
    n = len(store.log.records)
    assert store.expire_if_due("s1", datetime(2999, 1, 1, tzinfo=UTC)) is False
    assert len(store.log.records) == n


def test_transfer_to_an_ended_target_raises_session_ended() -> None:
    store = _with_open_cards()
    store.end("dst", "closed")
    _refused(store, lambda: store.transfer_open_todos("src", "dst"), SessionEndedError)


def test_transfer_from_an_ended_source_raises_session_ended() -> None:
    # After the end every write to the session is rejected, so the writer refuses up front
    # instead of copying the cards into the target and having the source's record rejected.
    store = _with_open_cards()
    store.end("src", "closed")
    _refused(store, lambda: store.transfer_open_todos("src", "dst"), SessionEndedError)


def test_transfer_from_an_unknown_source_raises_unknown_session() -> None:
    store = _with_open_cards()
    _refused(store, lambda: store.transfer_open_todos("ghost", "dst"), UnknownSessionError)


def test_ask_while_a_question_is_open_raises_question_open() -> None:
    store = _started()
    store.ask("s1", _q("q1"))
    _refused(store, lambda: store.ask("s1", _q("q2")), QuestionOpenError)
    assert store.load("s1").question is not None
    assert store.load("s1").question.id == "q1"  # type: ignore[union-attr]


def test_answer_with_no_open_question_raises_no_open_question() -> None:
    store = _started()
    _refused(store, lambda: store.answer("s1", "q1", "yes"), NoOpenQuestionError)


def test_answer_to_another_question_raises_no_open_question() -> None:
    store = _started()
    store.ask("s1", _q("q1"))
    _refused(store, lambda: store.answer("s1", "q2", "yes"), NoOpenQuestionError)


def test_answer_to_an_already_answered_question_raises_no_open_question() -> None:
    store = _started()
    store.ask("s1", _q("q1"))
    store.answer("s1", "q1", "yes")
    _refused(store, lambda: store.answer("s1", "q1", "no"), NoOpenQuestionError)


# -- checks=False: the writer skips the projection reads, the fold records the rejection ----------


def test_unchecked_second_start_is_appended_and_rejected_by_the_fold() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    store.start("s1", "again")
    assert len(store.log.records) == 2
    s = store.load("s1")
    assert s.goal == "g"
    assert s.rejection_counts() == {"already_started": 1}


def test_unchecked_write_to_unknown_session_is_rejected_by_the_fold() -> None:
    store = _store(checks=False)
    store.record_turn("ghost", "user", "hi")
    assert len(store.log.records) == 1
    s = store.find("ghost")
    assert s is not None
    assert s.started is False
    assert s.rejection_counts() == {"unknown_session": 1}


def test_unchecked_ask_while_open_is_rejected_question_open() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    store.ask("s1", _q("q1"))
    store.ask("s1", _q("q2"))
    s = store.load("s1")
    assert s.question is not None
    assert s.question.id == "q1"
    assert s.rejection_counts() == {"question_open": 1}


def test_unchecked_answer_without_question_is_rejected_no_open_question() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    store.answer("s1", "q1", "yes")
    assert store.load("s1").rejection_counts() == {"no_open_question": 1}


def test_unchecked_answer_to_another_question_is_rejected_stale() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    store.ask("s1", _q("q1"))
    store.answer("s1", "q2", "yes")
    assert store.load("s1").rejection_counts() == {"stale_question": 1}


def test_unchecked_write_after_end_is_rejected_session_ended() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    store.end("s1", "done")
    store.record_turn("s1", "user", "hello?")
    store.grant("s1", "deploy")
    s = store.load("s1")
    assert s.rejection_counts() == {"session_ended": 2}
    assert s.permissions == ()
    assert [r.seq for r in s.rejections] == [3, 4]


def test_unchecked_store_still_validates_arguments() -> None:
    store = _store(checks=False)
    store.start("s1", "g")
    _refused(store, lambda: store.remove_option("s1", "x", ""), InvalidCall)
    _refused(store, lambda: store.set_mode("s1", "turbo"), InvalidCall)
    _refused(store, lambda: store.record_turn("s1", "tool", "x"), InvalidCall)
    _refused(store, lambda: store.set_todo("s1", "t", "x", "closed"), InvalidCall)


def test_rejection_record_keeps_envelope_fields() -> None:
    store = _store(checks=False, producer="agent-9")
    store.start("s1", "g")
    store.start("s1", "again")
    r = store.load("s1").rejections[0]
    assert (r.seq, r.event_id, r.type, r.code, r.producer, r.occurred_at, r.by) == (
        2,
        "ev-2",
        ev.STARTED,
        "already_started",
        "agent-9",
        T0_MS,
        None,
    )


@pytest.mark.parametrize("answer", ["no", "decline", "yes", ""])
def test_a_signature_question_takes_no_answer_but_the_approval(answer: str) -> None:
    """Answering it signs the call: any other answer, from any writer, is refused unappended."""
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "drop the table")
    store.ask("s1", signature_question("drop_db", {"db": "prod"}))
    before = len(store.log.records)  # type: ignore[attr-defined]
    verified = Principal("operator:alice", verified=True)
    with pytest.raises(InvalidAnswerError, match="to decline, let its window close"):
        store.answer("s1", "sign:drop_db", answer, verified)
    assert len(store.log.records) == before  # type: ignore[attr-defined]
    store.answer("s1", "sign:drop_db", APPROVAL, verified)
    assert [a.operation for a in store.load("s1").approvals] == ["drop_db"]


def test_a_late_answer_to_a_signature_question_is_recorded_and_refused_as_late() -> None:
    """Its window closed: the attempt is on record (LateAnswerError), whatever it says."""
    store = SessionStore.in_memory(signer=OPERATOR)
    store.start("s1", "drop the table")
    asked = datetime(2026, 1, 1, tzinfo=UTC)
    store.ask("s1", signature_question("drop_db", {"db": "prod"}, format_instant(asked)))
    store.expire_if_due("s1", asked + timedelta(seconds=1))
    before = len(store.log.records)  # type: ignore[attr-defined]
    with pytest.raises(LateAnswerError):
        store.answer("s1", "sign:drop_db", "no", Principal("operator:alice", verified=True))
    assert len(store.log.records) == before + 1  # type: ignore[attr-defined]
    assert store.load("s1").approvals == ()


def test_closing_the_store_closes_the_projections_even_when_the_log_fails_to() -> None:
    store = SessionStore.in_memory()
    closed: list[object] = []

    def failing(timeout: float = 10.0) -> None:
        closed.append(timeout)
        raise LogError("close failed: the broker went away")

    store.log.close = failing  # type: ignore[method-assign]
    store.projections.close = lambda: closed.append("projections")  # type: ignore[method-assign]
    with pytest.raises(LogError, match="went away"):
        store.close(timeout=2.5)
    assert closed == [2.5, "projections"]


def test_when_both_fail_to_close_the_logs_error_is_raised() -> None:
    store = SessionStore.in_memory()

    def failing_log(timeout: float = 10.0) -> None:
        raise LogError("close failed: the broker went away")

    def failing_projections() -> None:
        raise ProjectionError("closing the Redis client failed")

    store.log.close = failing_log  # type: ignore[method-assign]
    store.projections.close = failing_projections  # type: ignore[method-assign]
    with pytest.raises(LogError, match="went away"):
        store.close()


@pytest.mark.parametrize(
    ("question", "relaxing", "other"),
    [
        (Question("perm:rm", "Allow «rm»?", ("yes", "no"), None, None, "permission"), "yes", "no"),
        (target_question("deploy", "prod", "Deploy to prod?"), "yes", "no"),
        (Question("q", "Which tone?", ("formal", "casual"), None, None, "style"), None, "formal"),
    ],
    ids=["permission", "target", "other"],
)
def test_a_caller_that_may_not_relax_cannot_say_the_yes_that_would(
    question: Question, relaxing: str | None, other: str
) -> None:
    """A yes to a permission question grants; a yes to a target question is what
    `Session.confirmed` reads: both make the session less supervised, an operator's act."""
    store = _started()
    store.ask("s1", question)
    before = len(store.log.records)
    if relaxing is not None:
        with pytest.raises(UnauthorizedError, match="less supervised"):
            store.answer("s1", question.id, relaxing, Principal("service:bridge"), may_relax=False)
        assert len(store.log.records) == before
    store.answer("s1", question.id, other, Principal("service:bridge"), may_relax=False)
    assert store.load("s1").decisions[-1].answer == other
