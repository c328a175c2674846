"""The timeline: each event translated with the fold's result for it (spec: "Timeline")."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest

from producers.store import SessionStore
from schemas import events as ev
from session_model.fold import step
from session_model.session import Question, Session
from session_model.signing import Signer, TrustedKeys
from session_model.timeline import translate
from tests.unit.builders import (
    CLOSED_AT,
    OPERATOR,
    answer,
    ask,
    ended,
    make_event,
    plan,
    started,
    todo,
    tool,
    turn,
    window_closed,
)


def _timeline(events, keys=None):
    """Every entry of every event, in order."""
    state = Session(events[0].session_id)
    entries = []
    for e in events:
        result = step(state, e, keys or TrustedKeys.none())
        entries.extend(translate(result))
        state = result.state
    return entries


def _last(events, keys=None):
    """The entries of the last event only."""
    state = Session(events[0].session_id)
    result = None
    for e in events:
        result = step(state, e, keys or TrustedKeys.none())
        state = result.state
    assert result is not None
    return translate(result)


# -- card -----------------------------------------------------------------------------------------


def test_card_entry_at_birth_carries_fold_derived_fields():
    assert _last([started(), tool("ls"), todo("a", "A")]) == [
        {
            "session": "s1",
            "kind": "card",
            "seq": 3,
            "card": {
                "id": "a",
                "text": "A",
                "to": "pending",
                "from": None,
                "version": 1,
                "origin": "discovered",
                "inherited_from": None,
            },
        }
    ]


def test_card_entry_on_a_move_has_from_and_version_from_the_fold():
    entries = _last([started(), todo("a", "A"), tool("x"), todo("a", "A", "done")])
    assert entries == [
        {
            "session": "s1",
            "kind": "card",
            "seq": 4,
            "card": {
                "id": "a",
                "text": "A",
                "to": "done",
                "from": "pending",
                "version": 2,
                "origin": "planned",
                "inherited_from": None,
            },
        }
    ]


def test_card_entry_ignores_writer_supplied_derived_fields():
    forged = make_event(
        ev.TODO_CHANGED,
        {
            "id": "a",
            "text": "A",
            "status": "done",
            "version": 9,
            "from": "in_progress",
            "origin": "retrospective",
        },
    )
    (entry,) = _last([started(), todo("a", "A"), forged])
    assert entry["card"]["version"] == 2
    assert entry["card"]["from"] == "pending"
    assert entry["card"]["origin"] == "planned"


def test_card_entry_for_unchanged_touch_has_null_from_and_same_version():
    (entry,) = _last([started(), todo("a", "A"), todo("a", "A")])
    assert entry["card"]["from"] is None
    assert entry["card"]["version"] == 1


def test_card_entry_of_inherited_card_shows_inheritance():
    inherited = make_event(
        ev.TODO_CHANGED,
        {
            "id": "a",
            "text": "A",
            "status": "pending",
            "inherited_from": {"session": "src", "version": 3, "origin": "discovered"},
        },
    )
    (entry,) = _last([started(), inherited])
    assert entry["card"] == {
        "id": "a",
        "text": "A",
        "to": "pending",
        "from": None,
        "version": 1,
        "origin": "discovered",
        "inherited_from": {"session": "src", "version": 3, "origin": "discovered"},
    }


# -- plan -----------------------------------------------------------------------------------------


def test_plan_entries_carry_version_and_supersedes():
    entries = _timeline([started(), plan("A"), plan("B"), plan("B")])
    assert entries == [
        {
            "session": "s1",
            "kind": "plan",
            "seq": 2,
            "plan": {"text": "A", "version": 1, "supersedes": None},
        },
        {
            "session": "s1",
            "kind": "plan",
            "seq": 3,
            "plan": {"text": "B", "version": 2, "supersedes": 1},
        },
        {
            "session": "s1",
            "kind": "plan",
            "seq": 4,
            "plan": {"text": "B", "version": 2, "supersedes": None},
        },
    ]


# -- waiting / answered ---------------------------------------------------------------------------


def test_waiting_entry_carries_the_question():
    entries = _last(
        [
            started(),
            ask(
                "q1",
                "Deploy?",
                ("yes", "no"),
                why='{"env":"prod"}',
                expires_at="2025-01-01T13:00:00Z",
                reason="permission",
            ),
        ]
    )
    assert entries == [
        {
            "session": "s1",
            "kind": "waiting",
            "seq": 2,
            "question": {
                "id": "q1",
                "question": "Deploy?",
                "options": ["yes", "no"],
                "why": '{"env":"prod"}',
                "reason": "permission",
                "expires_at": "2025-01-01T13:00:00Z",
            },
        }
    ]


def test_answered_entry_keeps_answer_by_and_executor_whole():
    a = answer("q1", "yes", by={"id": "cli:rod@laptop", "verified": False}, executor="runner-2")
    assert _last([started(), ask("q1"), a]) == [
        {
            "session": "s1",
            "kind": "answered",
            "seq": 3,
            "question_id": "q1",
            "answer": "yes",
            "by": {"id": "cli:rod@laptop", "verified": False},
            "executor": "runner-2",
        }
    ]


def test_answered_entry_shows_the_downgraded_principal():
    a = answer("q1", "yes", by={"id": "actor:member:42", "verified": True})
    (entry,) = _last([started(), ask("q1"), a])
    assert entry["by"] == {"id": "actor:member:42", "verified": False}


def test_answered_entry_shows_a_verified_principal_when_signed_by_trusted_key():
    signer = Signer.generate("surface")
    sig = signer.sign_answer(
        session_id="s1", question_id="q1", answer="yes", principal_id="actor:m:1", event_id="a-1"
    )
    a = answer(
        "q1",
        "yes",
        by={"id": "actor:m:1", "verified": True},
        extra={"signature": sig},
        event_id="a-1",
    )
    (entry,) = _last([started(), ask("q1"), a], keys=signer.trusted_keys())
    assert entry["by"] == {"id": "actor:m:1", "verified": True}


def test_answered_entry_without_principal_has_null_by():
    (entry,) = _last([started(), ask("q1"), answer("q1", "no")])
    assert entry["by"] is None
    assert entry["executor"] is None


# -- activity -------------------------------------------------------------------------------------


def test_assistant_turn_is_activity_ready():
    assert _last([started(), turn("assistant", "done thinking")]) == [
        {
            "session": "s1",
            "kind": "activity",
            "seq": 2,
            "state": "ready",
            "role": "assistant",
            "content": "done thinking",
        }
    ]


@pytest.mark.parametrize("role", ["user", "system"])
def test_other_turns_are_activity_thinking(role):
    (entry,) = _last([started(), turn(role, "x")])
    assert entry["kind"] == "activity"
    assert entry["state"] == "thinking"
    assert entry["role"] == role


def test_tool_call_is_activity_tool_with_name_ok_mutating_and_result():
    assert _last([started(), tool("rm", result="removed 2", mutating=True, ok=False)]) == [
        {
            "session": "s1",
            "kind": "activity",
            "seq": 2,
            "state": "tool",
            "tool": "rm",
            "ok": False,
            "mutating": True,
            "result": "removed 2",
        }
    ]


# -- message, option-removed, prerequisite-set ----------------------------------------------------


def test_message_entry_names_its_sender():
    msg = make_event(ev.MESSAGE_SENT, {"from": "s-other", "content": "hello"})
    assert _last([started(), msg]) == [
        {"session": "s1", "kind": "message", "seq": 2, "sender": "s-other", "content": "hello"}
    ]


def test_option_removed_entry_keeps_code_apart_from_message():
    removal = make_event(
        ev.OPTION_REMOVED,
        {"option": "force-push", "reason": {"code": "policy", "message": "never on main"}},
    )
    assert _last([started(), removal]) == [
        {
            "session": "s1",
            "kind": "option-removed",
            "seq": 2,
            "option": "force-push",
            "code": "policy",
            "message": "never on main",
        }
    ]


def test_option_removed_entry_without_message_has_null_message():
    removal = make_event(ev.OPTION_REMOVED, {"option": "x", "reason": {"code": "c"}})
    (entry,) = _last([started(), removal])
    assert (entry["code"], entry["message"]) == ("c", None)


def test_prerequisite_set_entry_lists_the_tools_declared():
    e = make_event(ev.PREREQUISITE_SET, {"tools": ["lint", " ", "test"]})
    assert _last([started(), e]) == [
        {"session": "s1", "kind": "prerequisite-set", "seq": 2, "tools": ["lint", "test"]}
    ]


# -- transferred, expired, open-work, ended -------------------------------------------------------


def test_transferred_entry_names_target_and_cards():
    e = make_event(ev.TODOS_TRANSFERRED, {"to": "s2", "todos": [{"id": "a", "version": 2}]})
    entries = _last([started(), todo("a", "A"), todo("a", "A", "in_progress"), e])
    assert entries == [
        {
            "session": "s1",
            "kind": "transferred",
            "seq": 4,
            "to": "s2",
            "todos": [{"id": "a", "version": 2}],
        }
    ]


def test_window_closed_gives_expired_then_open_work_then_ended():
    entries = _last(
        [started(), todo("a", "A"), ask("q1", "Deploy?"), window_closed("q1", at=CLOSED_AT)]
    )
    because = (
        "the window to answer «Deploy?» closed at 2025-01-02T00:00:00.000Z and nobody answered"
    )
    assert entries == [
        {
            "session": "s1",
            "kind": "expired",
            "seq": 4,
            "question_id": "q1",
            "question": "Deploy?",
            "at": "2025-01-02T00:00:00.000Z",
        },
        {
            "session": "s1",
            "kind": "open-work",
            "seq": 4,
            "todos": [
                {
                    "id": "a",
                    "status": "pending",
                    "version": 1,
                    "disposition": "open",
                    "mutations_since": 0,
                }
            ],
        },
        {"session": "s1", "kind": "ended", "seq": 4, "because": because},
    ]


def test_ended_with_open_cards_gives_one_open_work_entry_then_ended():
    entries = _last(
        [
            started(),
            todo("a", "A"),
            todo("b", "B", "blocked"),
            todo("c", "C", "done"),
            tool("w", mutating=True),
            ended("out of budget"),
        ]
    )
    assert entries == [
        {
            "session": "s1",
            "kind": "open-work",
            "seq": 6,
            "todos": [
                {
                    "id": "a",
                    "status": "pending",
                    "version": 1,
                    "disposition": "open",
                    "mutations_since": 1,
                },
                {
                    "id": "b",
                    "status": "blocked",
                    "version": 1,
                    "disposition": "open",
                    "mutations_since": 1,
                },
            ],
        },
        {"session": "s1", "kind": "ended", "seq": 6, "because": "out of budget"},
    ]


def test_ended_with_every_card_done_has_no_open_work_entry():
    entries = _last([started(), todo("a", "A", "done"), ended("all done")])
    assert entries == [{"session": "s1", "kind": "ended", "seq": 3, "because": "all done"}]


def test_ended_without_cards_has_only_ended_entry():
    assert [e["kind"] for e in _last([started(), ended("bye")])] == ["ended"]


# -- what translates to nothing -------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        lambda: make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}),
        lambda: make_event(ev.PERMISSION_REVOKED, {"operation": "deploy"}),
        lambda: make_event(ev.MODE_CHANGED, {"mode": "auto"}),
        lambda: make_event(ev.COMPACTED, {"summary": "s", "through": 2}),
    ],
)
def test_board_silent_events_translate_to_nothing(factory):
    assert _last([started(), turn("user", "a"), factory()]) == []


def test_started_translates_to_nothing():
    assert _last([started()]) == []


@pytest.mark.parametrize(
    "events",
    [
        lambda: [started(), answer("q1")],  # no_open_question
        lambda: [started(), started()],  # already_started
        lambda: [turn("user", "x")],  # unknown_session
        lambda: [started(), ended(), turn("user", "x")],  # session_ended
        lambda: [started(), ended(), ended("again")],  # session_ended for an end
        lambda: [started(), ask("q1"), ask("q2")],  # question_open
        lambda: [started(), make_event(ev.MODE_CHANGED, {"mode": "zzz"})],  # invalid
        lambda: [started(), turn("user", "x", expected_seq=0)],  # seq_conflict
        lambda: [started(), ask("q1"), window_closed("q1"), answer("q1")],  # late_answer
    ],
)
def test_rejected_events_translate_to_nothing(events):
    assert _last(events()) == []


def test_noops_duplicates_and_unknown_types_translate_to_nothing():
    t = turn("user", "x", event_id="dup")
    assert _last([started(), t, t]) == []
    assert _last([started(), ask("q1"), answer("q1"), window_closed("q1")]) == []
    assert _last([started(), make_event("session.from_the_future", {"a": 1})]) == []


# -- SessionStore.timeline(since=) ----------------------------------------------------------------


def _store():
    ids = itertools.count(1)
    return SessionStore.in_memory(
        signer=OPERATOR,
        clock=lambda: datetime(2025, 1, 1, 12, 0, tzinfo=UTC),
        new_id=lambda: f"id-{next(ids)}",
    )


def test_store_timeline_since_returns_only_entries_after_that_seq():
    store = _store()
    store.start("s1", "g")  # 1 (nothing)
    store.record_turn("s1", "user", "hi")  # 2
    store.set_plan("s1", "P")  # 3
    store.grant("s1", "deploy")  # 4 (nothing)
    store.set_todo("s1", "a", "A")  # 5
    store.ask("s1", Question("q1", "ok?", ("yes", "no")))  # 6
    store.answer("s1", "q1", "yes")  # 7
    store.end("s1", "bye")  # 8: open-work + ended
    everything = store.timeline("s1")
    assert [(e["seq"], e["kind"]) for e in everything] == [
        (2, "activity"),
        (3, "plan"),
        (5, "card"),
        (6, "waiting"),
        (7, "answered"),
        (8, "open-work"),
        (8, "ended"),
    ]
    assert store.timeline("s1", since=0) == everything
    assert [(e["seq"], e["kind"]) for e in store.timeline("s1", since=5)] == [
        (6, "waiting"),
        (7, "answered"),
        (8, "open-work"),
        (8, "ended"),
    ]
    assert [(e["seq"], e["kind"]) for e in store.timeline("s1", since=7)] == [
        (8, "open-work"),
        (8, "ended"),
    ]
    assert store.timeline("s1", since=8) == []


def test_store_timeline_since_a_silent_seq_returns_the_following_entries():
    store = _store()
    store.start("s1", "g")
    store.record_turn("s1", "user", "a")  # 2
    store.grant("s1", "x")  # 3 (silent)
    store.record_turn("s1", "assistant", "b")  # 4
    assert [e["seq"] for e in store.timeline("s1", since=3)] == [4]
    assert [e["seq"] for e in store.timeline("s1", since=2)] == [4]


def test_store_timeline_matches_the_pure_translation():
    store = _store()
    store.start("s1", "g")
    store.record_tool_call("s1", "make", {"t": 1}, "ok", mutating=True)
    store.set_todo("s1", "a", "A", "done")
    events = [r.event for r in store.log.records]
    assert store.timeline("s1") == _timeline(events)
