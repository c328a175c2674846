"""The fold effect of every event type (spec: "Event vocabulary", "The session value", trust)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from schemas import events as ev
from session_model import fold as fold_module
from session_model.fold import Kind, step
from session_model.modes import Mode
from session_model.principal import Principal
from session_model.session import (
    Decision,
    ExecutionFact,
    Message,
    Observation,
    OpenCard,
    Session,
    Turn,
)
from session_model.signing import Signer, TrustedKeys
from tests.unit.builders import (
    CLOSED_AT,
    answer,
    ask,
    ended,
    fold_all,
    make_event,
    plan,
    started,
    todo,
    tool,
    trusted,
    turn,
    window_closed,
)


def _steps(events, keys=None):
    state = Session(events[0].session_id)
    out = []
    for e in events:
        result = step(state, e, trusted(keys))
        out.append(result)
        state = result.state
    return state, out


# -- session.started ------------------------------------------------------------------------------


def test_started_sets_goal_mode_and_marks_session_started():
    s = fold_all([started(goal="ship it", mode="auto")])
    assert s.started is True
    assert s.goal == "ship it"
    assert s.mode is Mode.AUTO
    assert s.parent_id is None
    assert s.seq == 1


def test_started_with_unknown_mode_reads_as_ask():
    s = fold_all([started(mode="yolo")])
    assert s.mode is Mode.ASK
    assert s.rejections == ()


def test_started_without_mode_defaults_to_ask():
    s = fold_all([started(mode=None)])
    assert s.mode is Mode.ASK


def test_started_acknowledge_mode_is_kept():
    assert fold_all([started(mode="acknowledge")]).mode is Mode.ACKNOWLEDGE


def test_started_records_parent_id():
    s = fold_all([started(parent_id="parent-7")])
    assert s.parent_id == "parent-7"


def test_a_fresh_session_is_not_started():
    s = Session("s1")
    assert s.started is False
    assert s.seq == 0


# -- session.turn ---------------------------------------------------------------------------------


def test_turn_appends_role_content_and_seq():
    s = fold_all([started(), turn("user", "hello"), turn("assistant", "hi")])
    assert s.turns == (Turn("user", "hello", 2), Turn("assistant", "hi", 3))
    assert s.turn_count == 2


def test_system_turn_is_appended():
    s = fold_all([started(), turn("system", "be brief")])
    assert s.turns == (Turn("system", "be brief", 2),)


# -- session.tool_called --------------------------------------------------------------------------


def test_tool_called_appends_tool_turn_with_arrow_text():
    s = fold_all([started(), tool("make", result="built 3 targets")])
    assert s.turns == (Turn("tool", "make → built 3 targets", 2),)


def test_tool_called_counts_calls_and_only_mutating_calls_as_mutations():
    s = fold_all([started(), tool("ls"), tool("rm", mutating=True), tool("write", mutating=True)])
    assert s.tool_calls == 3
    assert s.mutations == 2


def test_tool_called_with_mutating_not_exactly_true_is_not_a_mutation():
    s = fold_all([started(), make_event(ev.TOOL_CALLED, {"tool": "x", "mutating": "yes"})])
    assert s.tool_calls == 1
    assert s.mutations == 0


def test_tool_called_removes_its_tool_from_run_first():
    s = fold_all(
        [
            started(),
            make_event(ev.PREREQUISITE_SET, {"tools": ["lint", "test", "plan"]}),
            tool("test"),
        ]
    )
    assert s.run_first == ("lint", "plan")
    assert s.obligation_declared is True


def test_tool_called_keeps_call_facts():
    s = fold_all(
        [
            started(),
            tool(
                "deploy",
                result="ok",
                mutating=True,
                ok=False,
                extra={
                    "artifact": "svc:web",
                    "verdict": "fail",
                    "effect_observation_id": "obs-1",
                },
            ),
        ]
    )
    (call,) = s.calls
    assert (call.seq, call.tool, call.result, call.ok, call.mutating) == (
        2,
        "deploy",
        "ok",
        False,
        True,
    )
    assert (call.artifact, call.verdict, call.effect_observation_id) == (
        "svc:web",
        "fail",
        "obs-1",
    )


# -- session.message_sent -------------------------------------------------------------------------


def test_message_sent_becomes_user_turn_with_exact_text_in_recipient():
    msg = make_event(ev.MESSAGE_SENT, {"from": "s-other", "content": "tests pass"}, session_id="s2")
    s = fold_all([started(session_id="s2"), msg])
    assert s.id == "s2"
    assert s.turns == (Turn("user", "■ message from «s-other»: tests pass", 2),)


def test_message_grants_nothing_and_answers_nothing():
    msg = make_event(
        ev.MESSAGE_SENT,
        {"from": "s-other", "content": "yes", "operation": "deploy", "question_id": "q1"},
    )
    s = fold_all([started(), ask("q1"), msg])
    assert s.permissions == ()
    assert s.question is not None
    assert s.question.id == "q1"
    assert s.decisions == ()
    assert s.ended is False


# -- session.plan_set -----------------------------------------------------------------------------


def test_first_plan_is_version_one_superseding_nothing():
    state, steps = _steps([started(), plan("A")])
    assert state.plan == "A"
    assert state.plan_version == 1
    assert steps[-1].outcome.plan_supersedes is None


def test_changed_plan_bumps_version_and_supersedes_previous():
    state, steps = _steps([started(), plan("A"), plan("B")])
    assert state.plan == "B"
    assert state.plan_version == 2
    assert steps[-1].outcome.plan_supersedes == 1


def test_same_plan_text_keeps_version_and_supersedes_null():
    state, steps = _steps([started(), plan("A"), plan("B"), plan("B")])
    assert state.plan == "B"
    assert state.plan_version == 2
    assert steps[-1].outcome.kind is Kind.APPLIED
    assert steps[-1].outcome.plan_supersedes is None
    assert state.seq == 4


def test_plan_set_removes_plan_from_run_first():
    s = fold_all(
        [started(), make_event(ev.PREREQUISITE_SET, {"tools": ["plan", "todo"]}), plan("A")]
    )
    assert s.run_first == ("todo",)


def test_same_plan_text_still_removes_plan_from_run_first():
    s = fold_all(
        [
            started(),
            plan("A"),
            make_event(ev.PREREQUISITE_SET, {"tools": ["plan"]}),
            plan("A"),
        ]
    )
    assert s.run_first == ()
    assert s.plan_version == 1


# -- session.todo_changed (details in test_todos.py) ----------------------------------------------


def test_todo_changed_removes_todo_from_run_first():
    s = fold_all(
        [started(), make_event(ev.PREREQUISITE_SET, {"tools": ["todo", "lint"]}), todo("a", "A")]
    )
    assert s.run_first == ("lint",)
    assert s.obligation_declared is True


# -- session.question_asked / question_answered ---------------------------------------------------


def test_question_asked_opens_question_and_pauses_session():
    s = fold_all(
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
    q = s.question
    assert q is not None
    assert (q.id, q.question, q.options, q.why, q.expires_at, q.reason, q.seq) == (
        "q1",
        "Deploy?",
        ("yes", "no"),
        '{"env":"prod"}',
        "2025-01-01T13:00:00Z",
        "permission",
        2,
    )
    assert s.is_runnable() is False


def test_question_pause_is_counted_under_its_reason():
    s = fold_all(
        [
            started(),
            ask("q1", reason="permission"),
            answer("q1"),
            ask("q2", reason="permission"),
            answer("q2"),
            ask("q3", reason="signature"),
        ]
    )
    assert dict(s.pauses) == {"permission": 2, "signature": 1}


def test_question_pause_without_reason_is_counted_as_unspecified():
    s = fold_all([started(), ask("q1", reason=None)])
    assert dict(s.pauses) == {"unspecified": 1}


def test_answer_records_decision_with_inherited_reason_and_why():
    a = answer("q1", "yes", by={"id": "cli:rod@laptop", "verified": False}, executor="runner-3")
    s = fold_all(
        [
            started(),
            ask("q1", "Deploy?", ("yes", "no"), why='{"env":"prod"}', reason="permission"),
            a,
        ]
    )
    (d,) = s.decisions
    assert (d.question_id, d.question, d.answer, d.by, d.executor, d.reason, d.why) == (
        "q1",
        "Deploy?",
        "yes",
        Principal("cli:rod@laptop", verified=False),
        "runner-3",
        "permission",
        '{"env":"prod"}',
    )
    assert d.seq == 3
    assert d.expired_at is None


def test_answer_closes_question_and_session_is_runnable_again():
    s = fold_all([started(), ask("q1"), answer("q1", "no")])
    assert s.question is None
    assert s.is_runnable() is True
    assert s.ended is False


def test_answer_is_appended_as_user_turn():
    s = fold_all([started(), turn("assistant", "may I?"), ask("q1"), answer("q1", "go ahead")])
    assert s.turns[-1] == Turn("user", "go ahead", 4)


def test_answer_without_by_has_no_principal():
    s = fold_all([started(), ask("q1"), answer("q1", "yes", by=None)])
    assert s.decisions[0].by is None


# -- session.answer_window_closed -----------------------------------------------------------------


def test_window_closed_records_decision_with_empty_answer_and_no_principal():
    s = fold_all(
        [
            started(),
            ask("q1", "Deploy?", why='{"env":"prod"}', reason="permission"),
            window_closed("q1", at=CLOSED_AT),
        ]
    )
    (d,) = s.decisions
    assert (d.question_id, d.question, d.answer, d.by, d.executor, d.reason, d.why) == (
        "q1",
        "Deploy?",
        "",
        None,
        None,
        "permission",
        '{"env":"prod"}',
    )
    assert d.expired_at == CLOSED_AT


def test_window_closed_ends_session_with_exact_reason_text():
    s = fold_all([started(), ask("q1", "Deploy to prod?"), window_closed("q1", at=CLOSED_AT)])
    assert s.ended_because == (
        "the window to answer «Deploy to prod?» closed at 2025-01-02T00:00:00.000Z "
        "and nobody answered"
    )
    assert s.ended is True
    assert s.question is None
    assert s.is_runnable() is False


def test_window_closed_appends_no_user_turn():
    s = fold_all([started(), turn("user", "hi"), ask("q1"), window_closed("q1")])
    assert s.turns == (Turn("user", "hi", 2),)


def test_window_closed_after_answer_is_a_noop():
    events = [started(), ask("q1"), answer("q1", "yes")]
    before = fold_all(events)
    after_state, steps = _steps([*events, window_closed("q1")])
    assert steps[-1].outcome.kind is Kind.NOOP
    assert after_state.seq == 4
    assert after_state.ended is False
    assert after_state.decisions == before.decisions
    assert after_state.rejections == ()


# -- permissions, mode, options -------------------------------------------------------------------


def test_grant_adds_operation_without_duplicates():
    s = fold_all(
        [
            started(),
            make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}),
            make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}),
            make_event(ev.PERMISSION_GRANTED, {"operation": "rm"}),
        ]
    )
    assert s.permissions == ("deploy", "rm")
    assert s.allows("deploy") is True
    assert s.allows("push") is False


def test_revoke_removes_the_grant_completely():
    s = fold_all(
        [
            started(),
            make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}),
            make_event(ev.PERMISSION_GRANTED, {"operation": "deploy"}),
            make_event(ev.PERMISSION_REVOKED, {"operation": "deploy"}),
        ]
    )
    assert s.permissions == ()
    assert s.allows("deploy") is False


def test_revoking_an_ungranted_operation_changes_no_permissions():
    s = fold_all(
        [
            started(),
            make_event(ev.PERMISSION_GRANTED, {"operation": "rm"}),
            make_event(ev.PERMISSION_REVOKED, {"operation": "deploy"}),
        ]
    )
    assert s.permissions == ("rm",)


def test_mode_changed_replaces_mode():
    s = fold_all([started(mode="ask"), make_event(ev.MODE_CHANGED, {"mode": "auto"})])
    assert s.mode is Mode.AUTO


def test_mode_changed_can_make_mode_stricter():
    s = fold_all([started(mode="auto"), make_event(ev.MODE_CHANGED, {"mode": "acknowledge"})])
    assert s.mode is Mode.ACKNOWLEDGE


def test_option_removed_is_added_once():
    removal = {"option": "force-push", "reason": {"code": "policy", "message": "never"}}
    s = fold_all(
        [
            started(),
            make_event(ev.OPTION_REMOVED, removal),
            make_event(ev.OPTION_REMOVED, removal),
            make_event(ev.OPTION_REMOVED, {"option": "rebase", "reason": {"code": "policy"}}),
        ]
    )
    assert s.removed_options == ("force-push", "rebase")
    assert s.rejections == ()


# -- session.prerequisite_set ---------------------------------------------------------------------


def _prereq(tools):
    return make_event(ev.PREREQUISITE_SET, {"tools": tools})


def test_prerequisite_set_declares_run_first_and_obligation():
    s = fold_all([started(), _prereq(["lint", "test"])])
    assert s.run_first == ("lint", "test")
    assert s.obligation_declared is True


def test_prerequisite_set_replaces_instead_of_accumulating():
    s = fold_all([started(), _prereq(["lint", "test"]), _prereq(["build"])])
    assert s.run_first == ("build",)


def test_prerequisite_set_drops_blank_names():
    s = fold_all([started(), _prereq(["lint", "", "   ", "test"])])
    assert s.run_first == ("lint", "test")


def test_prerequisite_set_with_only_blanks_lifts_obligation():
    s = fold_all([started(), _prereq(["lint"]), _prereq(["", " "])])
    assert s.run_first == ()
    assert s.obligation_declared is False


def test_empty_prerequisite_list_lifts_and_clears_obligation():
    s = fold_all([started(), _prereq(["lint"]), _prereq([])])
    assert s.run_first == ()
    assert s.obligation_declared is False


def test_meeting_prerequisites_empties_list_but_obligation_stays_declared():
    s = fold_all(
        [started(), _prereq(["lint", "plan", "todo"]), tool("lint"), plan("P"), todo("a", "A")]
    )
    assert s.run_first == ()
    assert s.obligation_declared is True


# -- session.compacted ----------------------------------------------------------------------------


def _compacted(summary, through, **kw):
    return make_event(ev.COMPACTED, {"summary": summary, "through": through}, **kw)


def test_compacted_sets_summary_and_through_and_drops_summarised_turns():
    s = fold_all(
        [
            started(),
            turn("user", "one"),  # 2
            turn("assistant", "two"),  # 3
            turn("user", "three"),  # 4
            _compacted("it began", 3),  # 5
        ]
    )
    assert s.summary == "it began"
    assert s.compacted_through == 3
    assert s.turns == (Turn("user", "three", 4),)


def test_compacted_window_starts_with_summary_then_unsummarised_turns():
    s = fold_all(
        [
            started(),
            turn("user", "one"),
            turn("assistant", "two"),
            _compacted("it began", 3),
            turn("user", "four"),
        ]
    )
    assert s.window() == (
        Message("system", "Summary of what already happened in this session:\nit began"),
        Message("user", "four"),
    )


def test_duplicate_compaction_is_a_noop():
    events = [started(), turn("user", "a"), turn("user", "b"), _compacted("first", 3)]
    before = fold_all(events)
    state, steps = _steps([*events, _compacted("again", 3)])
    assert steps[-1].outcome.kind is Kind.NOOP
    assert state.summary == "first"
    assert state.compacted_through == 3
    assert state.rejections == ()
    assert replace(state, seq=before.seq, event_ids=before.event_ids) == before


def test_older_compaction_is_a_noop():
    events = [started(), turn("user", "a"), turn("user", "b"), _compacted("first", 3)]
    state, steps = _steps([*events, _compacted("older", 2)])
    assert steps[-1].outcome.kind is Kind.NOOP
    assert state.summary == "first"
    assert state.compacted_through == 3


def test_compaction_through_own_seq_is_rejected_invalid():
    # The compaction is event 3: through=3 is not below its own seq.
    s = fold_all([started(), turn("user", "a"), _compacted("bad", 3)])
    assert [r.code for r in s.rejections] == ["invalid"]
    assert s.summary is None
    assert s.compacted_through == 0
    assert s.turns == (Turn("user", "a", 2),)


def test_compaction_through_beyond_own_seq_is_rejected_invalid():
    s = fold_all([started(), turn("user", "a"), _compacted("bad", 10)])
    assert [r.code for r in s.rejections] == ["invalid"]
    assert s.compacted_through == 0


def test_compaction_keeps_turn_count_of_all_turns():
    s = fold_all([started(), turn("user", "a"), turn("user", "b"), _compacted("x", 2)])
    assert s.turn_count == 2
    assert s.turns == (Turn("user", "b", 3),)


# -- effects and executions -----------------------------------------------------------------------


def test_effect_observed_is_recorded():
    e = make_event(
        ev.EFFECT_OBSERVED,
        {"known": True, "artifacts": ["a:1"], "evidence": ["t:1", "t:2"], "observer": "probe"},
        event_id="obs-1",
    )
    s = fold_all([started(), e])
    assert s.observations == (
        Observation(
            event_id="obs-1",
            seq=2,
            known=True,
            artifacts=("a:1",),
            evidence=("t:1", "t:2"),
            observer="probe",
        ),
    )


def test_effect_observed_known_not_exactly_true_reads_unknown():
    e = make_event(ev.EFFECT_OBSERVED, {"known": "true", "artifacts": [], "evidence": []})
    s = fold_all([started(), e])
    assert s.observations[0].known is False


def test_execution_recorded_is_kept_as_receipt():
    e = make_event(
        ev.EXECUTION_RECORDED,
        {
            "operation": "deploy",
            "argument_digest": "ab" * 32,
            "artifact": "svc:web",
            "executor": "runner-1",
        },
    )
    s = fold_all([started(), e])
    assert s.executions == (
        ExecutionFact(
            seq=2,
            operation="deploy",
            argument_digest="ab" * 32,
            artifact="svc:web",
            executor="runner-1",
        ),
    )


# -- session.ended and the derived open work ------------------------------------------------------


def test_ended_sets_reason_and_session_is_not_runnable():
    s = fold_all([started(), ended("goal reached")])
    assert s.ended_because == "goal reached"
    assert s.ended is True
    assert s.is_runnable() is False


def test_ended_derives_one_open_card_per_unfinished_todo():
    s = fold_all(
        [
            started(),
            todo("a", "A"),  # mutations_at 0
            tool("w", mutating=True),
            todo("b", "B", "in_progress"),  # mutations_at 1
            tool("w", mutating=True),
            todo("c", "C", "blocked"),  # mutations_at 2
            todo("d", "D", "done"),
            tool("w", mutating=True),
            ended("stop"),
        ]
    )
    assert s.open_work == (
        OpenCard(id="a", status="pending", version=1, disposition="open", mutations_since=3),
        OpenCard(id="b", status="in_progress", version=1, disposition="open", mutations_since=2),
        OpenCard(id="c", status="blocked", version=1, disposition="open", mutations_since=1),
    )


def test_ended_with_every_card_done_derives_no_open_work():
    s = fold_all([started(), todo("a", "A"), todo("a", "A", "done"), ended("ok")])
    assert s.open_work == ()


def test_open_work_uses_current_version_of_the_card():
    s = fold_all([started(), todo("a", "A"), todo("a", "A", "in_progress"), ended("x")])
    assert s.open_work == (
        OpenCard(id="a", status="in_progress", version=2, disposition="open", mutations_since=0),
    )


def test_open_work_marks_transferred_card_with_target():
    s = fold_all(
        [
            started(),
            todo("a", "A"),
            todo("b", "B"),
            make_event(ev.TODOS_TRANSFERRED, {"to": "s2", "todos": [{"id": "a", "version": 1}]}),
            ended("handed over"),
        ]
    )
    assert s.open_work == (
        OpenCard(
            id="a",
            status="pending",
            version=1,
            disposition="transferred",
            mutations_since=0,
            to="s2",
        ),
        OpenCard(id="b", status="pending", version=1, disposition="open", mutations_since=0),
    )


def test_window_closed_also_derives_open_work():
    s = fold_all([started(), todo("a", "A"), ask("q1"), window_closed("q1")])
    assert s.open_work == (
        OpenCard(id="a", status="pending", version=1, disposition="open", mutations_since=0),
    )


# -- seq numbering --------------------------------------------------------------------------------


def test_seq_is_position_in_stream():
    s = fold_all([started(), turn("user", "a"), turn("user", "b")])
    assert s.seq == 3


def test_duplicate_event_id_takes_no_seq():
    t = turn("user", "a", event_id="dup")
    state, steps = _steps([started(), t, turn("user", "again", event_id="dup"), turn("user", "b")])
    assert steps[2].outcome.kind is Kind.DUPLICATE
    assert steps[2].outcome.seq is None
    assert state.seq == 3
    assert state.turns == (Turn("user", "a", 2), Turn("user", "b", 3))


def test_unknown_type_takes_a_seq_and_is_skipped():
    state, steps = _steps(
        [started(), make_event("session.future_thing", {"x": 1}), turn("user", "a")]
    )
    assert steps[1].outcome.kind is Kind.SKIPPED
    assert steps[1].outcome.seq == 2
    assert state.skipped == 1
    assert state.turns == (Turn("user", "a", 3),)


def test_unreadable_payload_is_skipped_like_unknown_type():
    e = replace(turn("user", "a"), payload_readable=False)
    state, steps = _steps([started(), e])
    assert steps[1].outcome.kind is Kind.SKIPPED
    assert state.seq == 2
    assert state.turns == ()


def test_noop_takes_a_seq():
    state, steps = _steps(
        [started(), ask("q1"), answer("q1"), window_closed("q1"), turn("user", "x")]
    )
    assert steps[3].outcome.seq == 4
    assert state.turns[-1] == Turn("user", "x", 5)


def test_rejected_event_takes_a_seq():
    state, steps = _steps([started(), answer("q1"), turn("user", "x")])
    assert steps[1].outcome.kind is Kind.REJECTED
    assert steps[1].outcome.seq == 2
    assert state.turns == (Turn("user", "x", 3),)


# -- window() and state_briefing() ----------------------------------------------------------------


def test_state_briefing_is_none_without_plan_or_todos():
    s = fold_all([started(), turn("user", "hi")])
    assert s.state_briefing() is None
    assert s.window() == (Message("user", "hi"),)


def test_state_briefing_lists_plan_and_every_card_with_its_box():
    s = fold_all(
        [
            started(),
            plan("Fix the build"),
            todo("a", "read logs", "done"),
            todo("b", "patch", "in_progress"),
            todo("c", "deploy", "blocked"),
            todo("d", "announce", "pending"),
        ]
    )
    assert s.state_briefing() == (
        "Plan of this session: Fix the build\n"
        "Todos:\n"
        "[x] a: read logs\n"
        "[~] b: patch\n"
        "[!] c: deploy\n"
        "[ ] d: announce"
    )


def test_state_briefing_with_plan_only():
    s = fold_all([started(), plan("P")])
    assert s.state_briefing() == "Plan of this session: P"


def test_state_briefing_with_todos_only():
    s = fold_all([started(), todo("a", "A")])
    assert s.state_briefing() == "Todos:\n[ ] a: A"


def test_window_is_summary_then_briefing_then_unsummarised_turns():
    s = fold_all(
        [
            started(),
            turn("user", "old"),  # 2
            plan("P"),  # 3
            _compacted("S", 2),  # 4
            todo("a", "A", "done"),  # 5
            turn("assistant", "new"),  # 6
            tool("ls", result="2 files"),  # 7
        ]
    )
    assert s.window() == (
        Message("system", "Summary of what already happened in this session:\nS"),
        Message("system", "Plan of this session: P\nTodos:\n[x] a: A"),
        Message("assistant", "new"),
        Message("tool", "ls → 2 files"),
    )


# -- is_runnable ----------------------------------------------------------------------------------


def test_started_session_without_question_is_runnable():
    assert fold_all([started()]).is_runnable() is True


def test_session_with_open_question_is_not_runnable():
    assert fold_all([started(), ask("q1")]).is_runnable() is False


def test_ended_session_is_not_runnable():
    assert fold_all([started(), ended()]).is_runnable() is False


# -- confirmed() ----------------------------------------------------------------------------------


def _target_q(qid, operation, target, reason="target_not_named"):
    why = json.dumps({"operation": operation, "target": target})
    return ask(qid, f"{operation} on {target}?", ("yes", "no"), why=why, reason=reason)


def test_yes_to_target_question_confirms_that_operation_and_target():
    s = fold_all([started(), _target_q("q1", "deploy", "prod"), answer("q1", "yes")])
    assert s.confirmed("deploy", "prod") is True


def test_yes_to_one_target_names_no_other():
    s = fold_all([started(), _target_q("q1", "deploy", "prod"), answer("q1", "yes")])
    assert s.confirmed("deploy", "staging") is False
    assert s.confirmed("delete", "prod") is False


def test_no_to_target_question_confirms_nothing():
    s = fold_all([started(), _target_q("q1", "deploy", "prod"), answer("q1", "no")])
    assert s.confirmed("deploy", "prod") is False


def test_yes_to_question_with_other_reason_confirms_nothing():
    s = fold_all(
        [started(), _target_q("q1", "deploy", "prod", reason="permission"), answer("q1", "yes")]
    )
    assert s.confirmed("deploy", "prod") is False


def test_a_why_that_names_a_key_twice_confirms_nothing():
    """A person reads the first `target` (staging); `json.loads` keeps the last (prod)."""
    why = '{"operation": "deploy", "target": "staging"' + " " * 200 + ', "target": "prod"}'
    q = ask("q1", "deploy on staging?", ("yes", "no"), why=why, reason="target_not_named")
    s = fold_all([started(), q, answer("q1", "yes")])
    assert s.decisions[-1].answer == "yes"
    assert s.confirmed("deploy", "prod") is False
    assert s.confirmed("deploy", "staging") is False


def test_yes_to_a_target_question_whose_why_nests_past_the_parser_s_depth_confirms_nothing():
    # json.loads raises RecursionError there, not ValueError: it must not escape the fold.
    deep = "[" * 5000 + "]" * 5000
    q = ask("t1", "deploy?", ("yes", "no"), why=deep, reason="target_not_named")
    s = fold_all([started(), q, answer("t1", "yes")])
    assert s.question is None and s.decisions[-1].answer == "yes"
    assert s.confirmed("deploy", "prod") is False


@pytest.mark.parametrize("error", [OverflowError, ZeroDivisionError, ValueError])
def test_an_error_a_handler_raises_on_a_payload_refuses_that_event_only(monkeypatch, error):
    # The poison-pill guard: what a handler did not foresee in an agent's payload refuses the
    # event as `invalid` (a seq, a rejection, no other change); the next event applies.
    def broken(s, e, seq, auth):
        raise error("a payload nobody foresaw")

    monkeypatch.setitem(fold_module._HANDLERS, ev.PLAN_SET, broken)
    s = fold_all([started(), plan("x"), turn("user", "after")])
    assert [r.code for r in s.rejections] == ["invalid"]
    assert s.seq == 3 and s.plan is None and s.turns[-1].content == "after"


@pytest.mark.parametrize("error", [TypeError, AttributeError, KeyError, RecursionError])
def test_an_error_a_handler_s_bug_raises_is_not_taken_for_a_bad_payload(monkeypatch, error):
    # A bug must surface (the worker parks the partition at it, commits nothing past it), not
    # refuse every event of its type as `invalid` for good.
    def broken(s, e, seq, auth):
        raise error("a bug")

    monkeypatch.setitem(fold_module._HANDLERS, ev.PLAN_SET, broken)
    with pytest.raises(error):
        fold_all([started(), plan("x")])


def test_a_why_nested_deeper_than_the_bound_confirms_nothing_whatever_the_stack():
    # Decided by the text, not by how much stack the caller left json.loads: a worker (deep in
    # its event loop) and a rebuild must fold it alike.
    nested = '{"operation":"deploy","target":"prod","pad":' + "[" * 200 + "]" * 200 + "}"
    shallow = '{"operation":"deploy","target":"prod","pad":' + "[" * 100 + "]" * 100 + "}"
    many = '{"operation":"deploy","target":"prod","pad":' + "[[]]," * 300 + '"[[[[["}'
    many = many.replace(',"[[[[["}', ',"[[[[["]}').replace('"pad":', '"pad":[', 1)

    def confirmed(why):
        q = ask("t1", "deploy?", ("yes", "no"), why=why, reason="target_not_named")
        return fold_all([started(), q, answer("t1", "yes")]).confirmed("deploy", "prod")

    def deep_in_the_stack(depth, why):
        return confirmed(why) if depth == 0 else deep_in_the_stack(depth - 1, why)

    assert confirmed(nested) is False and deep_in_the_stack(300, nested) is False
    assert confirmed(shallow) is True and deep_in_the_stack(300, shallow) is True
    assert confirmed(many) is True  # many brackets, few levels: an object of ours


def test_closed_window_confirms_nothing():
    s = fold_all([started(), _target_q("q1", "deploy", "prod"), window_closed("q1")])
    assert s.confirmed("deploy", "prod") is False


def test_two_confirmed_targets_each_confirmed():
    s = fold_all(
        [
            started(),
            _target_q("q1", "deploy", "prod"),
            answer("q1", "yes"),
            _target_q("q2", "deploy", "eu"),
            answer("q2", "yes"),
        ]
    )
    assert s.confirmed("deploy", "prod") is True
    assert s.confirmed("deploy", "eu") is True
    assert s.confirmed("deploy", "us") is False


# -- principals and trust -------------------------------------------------------------------------


def _signed_answer(signer, *, sid="s1", qid="q1", answer_="yes", principal_id="actor:member:42"):
    event_id = "ans-1"
    sig = signer.sign_answer(
        session_id=sid,
        question_id=qid,
        answer=answer_,
        principal_id=principal_id,
        event_id=event_id,
    )
    return answer(
        qid,
        answer_,
        by={"id": principal_id, "verified": True},
        extra={"signature": sig},
        event_id=event_id,
        session_id=sid,
    )


def _by(events, keys=None):
    s = fold_all(events, keys)
    return s.decisions[0].by, s.downgrades


def test_verified_string_true_stays_unverified():
    by, _ = _by(
        [started(), ask("q1"), answer("q1", by={"id": "actor:member:42", "verified": "true"})]
    )
    assert by == Principal("actor:member:42", verified=False)


def test_verified_one_stays_unverified():
    by, _ = _by([started(), ask("q1"), answer("q1", by={"id": "actor:member:42", "verified": 1})])
    assert by == Principal("actor:member:42", verified=False)


def test_unverified_claim_stays_unverified_and_is_not_a_downgrade():
    by, downgrades = _by(
        [started(), ask("q1"), answer("q1", by={"id": "cli:rod@laptop", "verified": False})]
    )
    assert by == Principal("cli:rod@laptop", verified=False)
    assert downgrades == 0


def test_verified_claim_without_signature_is_downgraded_and_counted():
    by, downgrades = _by(
        [started(), ask("q1"), answer("q1", by={"id": "actor:member:42", "verified": True})]
    )
    assert by == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_verified_claim_signed_by_untrusted_key_is_downgraded():
    trusted = Signer.generate("human-surface")
    rogue = Signer.generate("human-surface")  # same key id, different key
    by, downgrades = _by([started(), ask("q1"), _signed_answer(rogue)], keys=trusted.trusted_keys())
    assert by == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_verified_claim_signed_by_unknown_key_id_is_downgraded():
    trusted = Signer.generate("human-surface")
    other = Signer.generate("agent-key")
    by, downgrades = _by([started(), ask("q1"), _signed_answer(other)], keys=trusted.trusted_keys())
    assert by == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_verified_claim_with_signature_over_other_answer_is_downgraded():
    signer = Signer.generate("human-surface")
    good = _signed_answer(signer, answer_="no")
    tampered = replace(good, payload={**good.payload, "answer": "yes"})
    by, downgrades = _by([started(), ask("q1"), tampered], keys=signer.trusted_keys())
    assert by == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_verified_claim_with_garbage_signature_is_downgraded():
    signer = Signer.generate("human-surface")
    bad = answer(
        "q1",
        "yes",
        by={"id": "actor:member:42", "verified": True},
        extra={"signature": {"key_id": "human-surface", "signature": b"\x00" * 64}},
    )
    by, downgrades = _by([started(), ask("q1"), bad], keys=signer.trusted_keys())
    assert by == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_verified_claim_with_valid_trusted_signature_stays_verified():
    signer = Signer.generate("human-surface")
    by, downgrades = _by([started(), ask("q1"), _signed_answer(signer)], keys=signer.trusted_keys())
    assert by == Principal("actor:member:42", verified=True)
    assert downgrades == 0


def test_removing_the_key_and_refolding_reads_the_answer_unverified():
    signer = Signer.generate("human-surface")
    events = [started(), ask("q1"), _signed_answer(signer)]
    by_trusted, _ = _by(events, keys=signer.trusted_keys())
    by_after_removal, downgrades = _by(events, keys=TrustedKeys.none())
    assert by_trusted.verified is True
    assert by_after_removal == Principal("actor:member:42", verified=False)
    assert downgrades == 1


def test_rotating_adds_a_key_and_old_signatures_still_verify():
    old = Signer.generate("k-2024")
    new = Signer.generate("k-2025")
    keys = TrustedKeys({**old.trusted_keys().keys, **new.trusted_keys().keys})
    by, _ = _by([started(), ask("q1"), _signed_answer(old)], keys=keys)
    assert by == Principal("actor:member:42", verified=True)


def test_principal_without_id_is_none():
    by, _ = _by([started(), ask("q1"), answer("q1", by={"verified": True})])
    assert by is None


def test_principal_with_empty_id_is_none():
    by, _ = _by([started(), ask("q1"), answer("q1", by={"id": "", "verified": False})])
    assert by is None


def test_principal_from_record_only_exact_true_is_verified():
    assert Principal.from_record({"id": "x", "verified": True}) == Principal("x", True)
    assert Principal.from_record({"id": "x", "verified": "true"}) == Principal("x", False)
    assert Principal.from_record({"id": "x", "verified": 1}) == Principal("x", False)
    assert Principal.from_record({"id": "x"}) == Principal("x", False)
    assert Principal.from_record(None) is None
    assert Principal.from_record({"verified": True}) is None


def test_principal_from_terminal_is_never_verified():
    assert Principal.from_terminal("rod", "laptop") == Principal("cli:rod@laptop", verified=False)


def test_decision_is_the_value_produced_for_an_answer():
    a = answer("q1", "yes", by={"id": "cli:rod@laptop", "verified": False}, event_id="ans-9")
    q = ask("q1", "Q?", ("yes", "no"), why="w", reason="permission")
    s = fold_all([started(), q, a])
    assert s.decisions[0] == Decision(
        question_id="q1",
        question="Q?",
        answer="yes",
        by=Principal("cli:rod@laptop", False),
        executor=None,
        reason="permission",
        why="w",
        seq=3,
        event_id="ans-9",
        affirmative=True,
        decided_at=a.occurred_at,
        asked_at=q.occurred_at,
        asked_seq=2,
    )


def test_unreadable_deadline_is_kept_as_written_and_never_expires():
    s = fold_all([started(), ask("q1", expires_at="next tuesday")])
    assert s.question is not None
    assert s.question.expires_at == "next tuesday"
    assert s.question.deadline() is None
    assert s.question.has_expired(CLOSED_AT.replace(year=2999)) is False


def test_deadline_without_offset_is_unreadable():
    s = fold_all([started(), ask("q1", expires_at="2025-01-01T13:00:00")])
    assert s.question is not None
    assert s.question.deadline() is None


def test_deadline_with_offset_is_read_and_compared_strictly():
    s = fold_all([started(), ask("q1", expires_at="2025-01-01T14:00:00+01:00")])
    q = s.question
    assert q is not None
    assert q.deadline() == datetime(2025, 1, 1, 13, 0, tzinfo=UTC)
    assert q.has_expired(datetime(2025, 1, 1, 13, 0, tzinfo=UTC)) is False
    assert q.has_expired(datetime(2025, 1, 1, 13, 0, 0, 1000, tzinfo=UTC)) is True


def test_asking_does_not_compare_with_now_or_end_anything_by_itself():
    s = fold_all([started(), ask("q1", expires_at="2000-01-01T00:00:00Z"), turn("user", "x")])
    assert s.ended is False
    assert s.question is not None
    assert s.rejections == ()
