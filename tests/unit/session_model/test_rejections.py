"""Rejections and no-ops (spec: "Rejections and no-ops", the check order, late answers)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schemas import events as ev
from session_model.fold import Kind, fold, step
from session_model.modes import Mode
from session_model.principal import Principal
from session_model.session import Rejection, Session
from session_model.signing import Signer
from tests.unit.builders import (
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


def _run(events):
    state = Session(events[0].session_id)
    steps = []
    for e in events:
        result = step(state, e, trusted())
        steps.append(result)
        state = result.state
    return state, steps


def _codes(session):
    return [r.code for r in session.rejections]


def _unchanged_but_bookkeeping(after: Session, before: Session, event_id: str = "") -> bool:
    """True when `after` equals `before` except for seq, seen ids, the rejection record and, for
    a refused event whose signature verified (`event_id`), the signed ids remembering it."""
    return (
        after.signed_ids <= before.signed_ids | {event_id}
        and replace(
            after,
            seq=before.seq,
            event_ids=before.event_ids,
            rejections=before.rejections,
            rejected=before.rejected,
            signed_ids=before.signed_ids,
        )
        == before
    )


def _assert_rejected_without_effect(prefix, event, code):
    before = fold_all(prefix)
    after, steps = _run([*prefix, event])
    outcome = steps[-1].outcome
    assert outcome.kind is Kind.REJECTED
    assert outcome.rejection is not None
    assert outcome.rejection.code == code
    assert after.seq == before.seq + 1
    assert _codes(after) == [*_codes(before), code]
    assert _unchanged_but_bookkeeping(after, before, event.event_id)
    return after


# -- the record -----------------------------------------------------------------------------------


def test_rejection_record_keeps_seq_event_id_type_code_producer_and_occurred_at():
    bad = answer("q1", "yes", event_id="ans-x", producer="agent-9")
    s = fold_all([started(), turn("user", "hi"), bad])
    assert s.rejections == (
        Rejection(
            seq=3,
            event_id="ans-x",
            type=ev.QUESTION_ANSWERED,
            code="no_open_question",
            producer="agent-9",
            occurred_at=bad.occurred_at,
            by=None,
        ),
    )


def test_rejections_are_counted_by_code():
    s = fold_all(
        [
            started(),
            answer("q1"),
            answer("q2"),
            make_event(ev.MODE_CHANGED, {"mode": "reckless"}),
            started(),
        ]
    )
    assert s.rejection_counts() == {"no_open_question": 2, "invalid": 1, "already_started": 1}


def test_rejected_event_takes_a_seq_and_the_next_event_follows_it():
    s = fold_all([started(), answer("q1"), turn("user", "x")])
    assert s.rejections[0].seq == 2
    assert s.turns[-1].seq == 3
    assert s.seq == 3


# -- 1. seq_conflict ------------------------------------------------------------------------------


def test_expected_seq_mismatch_is_seq_conflict():
    _assert_rejected_without_effect(
        [started(), turn("user", "a")], turn("user", "b", expected_seq=1), "seq_conflict"
    )


def test_expected_seq_matching_current_seq_applies():
    s = fold_all([started(), turn("user", "a"), turn("user", "b", expected_seq=2)])
    assert s.rejections == ()
    assert s.turns[-1].content == "b"


def test_expected_seq_zero_on_first_started_applies():
    s = fold_all([started(expected_seq=0)])
    assert s.started is True
    assert s.rejections == ()


def test_seq_conflict_is_checked_before_unknown_session():
    s = fold_all([turn("user", "a", expected_seq=5)])
    assert _codes(s) == ["seq_conflict"]


def test_seq_conflict_is_checked_before_already_started():
    s = fold_all([started(), started(expected_seq=0)])
    assert _codes(s) == ["seq_conflict"]


def test_seq_conflict_is_checked_before_session_ended():
    s = fold_all([started(), ended(), turn("user", "a", expected_seq=0)])
    assert _codes(s) == ["seq_conflict"]


def test_seq_conflict_is_checked_before_question_state():
    s = fold_all([started(), answer("q1", expected_seq=0)])
    assert _codes(s) == ["seq_conflict"]


def test_seq_conflict_is_checked_before_invalid_payload():
    s = fold_all([started(), make_event(ev.MODE_CHANGED, {"mode": "??"}, expected_seq=7)])
    assert _codes(s) == ["seq_conflict"]


def test_seq_conflict_on_a_late_answer_wins_over_late_answer():
    s = fold_all([started(), ask("q1"), window_closed("q1"), answer("q1", expected_seq=1)])
    assert _codes(s) == ["seq_conflict"]


# -- 2. unknown_session / already_started ---------------------------------------------------------


@pytest.mark.parametrize(
    "event_factory",
    [
        lambda: turn("user", "a"),
        lambda: tool("ls"),
        lambda: plan("P"),
        lambda: todo("a", "A"),
        lambda: ask("q1"),
        lambda: answer("q1"),
        ended,
        lambda: make_event(ev.PERMISSION_GRANTED, {"operation": "x"}),
        lambda: make_event(ev.MODE_CHANGED, {"mode": "bogus"}),
        lambda: window_closed("q1"),
    ],
)
def test_any_event_before_started_is_unknown_session(event_factory):
    s = fold_all([event_factory()])
    assert _codes(s) == ["unknown_session"]
    assert s.started is False
    assert s.seq == 1


def test_second_started_is_rejected_already_started():
    s = _assert_rejected_without_effect(
        [started(goal="first", mode="ask")],
        started(goal="second", mode="auto", parent_id="p"),
        "already_started",
    )
    assert s.goal == "first"
    assert s.mode is Mode.ASK
    assert s.parent_id is None


def test_started_after_end_is_already_started_not_session_ended():
    s = fold_all([started(), ended(), started()])
    assert _codes(s) == ["already_started"]


def test_started_after_unknown_session_rejection_still_starts():
    s = fold_all([turn("user", "early"), started(goal="g")])
    assert s.started is True
    assert _codes(s) == ["unknown_session"]
    assert s.turns == ()


# -- 3. late_answer / session_ended ---------------------------------------------------------------


def test_answer_after_window_closed_is_late_answer_keeping_by_and_time():
    late = answer("q1", "yes", by={"id": "cli:rod@laptop", "verified": False}, producer="surface-1")
    s = _assert_rejected_without_effect(
        [started(), ask("q1", "Deploy?"), window_closed("q1")], late, "late_answer"
    )
    rejection = s.rejections[-1]
    assert rejection.by == Principal("cli:rod@laptop", verified=False)
    assert rejection.occurred_at == late.occurred_at
    assert rejection.producer == "surface-1"
    assert rejection.seq == 4


def test_late_answer_does_not_record_a_decision_or_turn():
    s = fold_all([started(), ask("q1"), window_closed("q1"), answer("q1", "yes")])
    assert [d.answer for d in s.decisions] == [""]
    assert s.turns == ()


def test_late_answer_claiming_verified_without_signature_is_stored_unverified():
    # Trust is never raised: a claim of verified is believed only with a trusted signature.
    late = answer("q1", "yes", by={"id": "actor:member:42", "verified": True})
    s = fold_all([started(), ask("q1"), window_closed("q1"), late])
    assert _codes(s) == ["late_answer"]
    assert s.rejections[0].by == Principal("actor:member:42", verified=False)


def test_answer_to_another_question_after_window_closed_is_session_ended():
    s = fold_all([started(), ask("q1"), window_closed("q1"), answer("q9")])
    assert _codes(s) == ["session_ended"]
    assert s.rejections[0].by is None


def test_answer_after_explicit_end_is_session_ended():
    s = fold_all([started(), ask("q1"), ended("stop"), answer("q1")])
    assert _codes(s) == ["session_ended"]


@pytest.mark.parametrize(
    "event_factory",
    [
        lambda: turn("user", "a"),
        lambda: tool("ls"),
        lambda: plan("P"),
        lambda: todo("a", "A"),
        lambda: ask("q2"),
        lambda: ended("again"),
        lambda: make_event(ev.PERMISSION_GRANTED, {"operation": "x"}),
        lambda: make_event(ev.PERMISSION_REVOKED, {"operation": "x"}),
        lambda: make_event(ev.MODE_CHANGED, {"mode": "auto"}),
        lambda: make_event(ev.OPTION_REMOVED, {"option": "o", "reason": {"code": "c"}}),
        lambda: make_event(ev.PREREQUISITE_SET, {"tools": ["x"]}),
        lambda: make_event(ev.MESSAGE_SENT, {"from": "s9", "content": "hi"}),
        lambda: make_event(ev.EXECUTION_RECORDED, {"operation": "x", "argument_digest": "d"}),
        lambda: make_event(ev.EFFECT_OBSERVED, {"known": True}),
        lambda: make_event(ev.TODOS_TRANSFERRED, {"to": "s2", "todos": []}),
    ],
)
@pytest.mark.parametrize("ending", ["ended", "window_closed"])
def test_anything_after_the_end_is_session_ended(event_factory, ending):
    if ending == "ended":
        prefix = [started(), turn("user", "hi"), ended("stop")]
    else:
        prefix = [started(), turn("user", "hi"), ask("q1"), window_closed("q1")]
    _assert_rejected_without_effect(prefix, event_factory(), "session_ended")


def test_compaction_after_end_is_session_ended():
    prefix = [started(), turn("user", "a"), turn("user", "b"), ended()]
    _assert_rejected_without_effect(
        prefix, make_event(ev.COMPACTED, {"summary": "s", "through": 2}), "session_ended"
    )


def test_session_ended_is_checked_before_question_state():
    s = fold_all([started(), ended(), answer("q1")])
    assert _codes(s) == ["session_ended"]


def test_session_ended_is_checked_before_invalid_payload():
    s = fold_all([started(), ended(), make_event(ev.MODE_CHANGED, {"mode": "nope"})])
    assert _codes(s) == ["session_ended"]


def test_window_closed_after_explicit_end_is_session_ended():
    # The question is still open when the session is ended explicitly; a later closing of its
    # window is "anything else after the end", not a race an answer won.
    prefix = [started(), ask("q1", "Deploy?"), ended("operator stopped it")]
    s = _assert_rejected_without_effect(prefix, window_closed("q1"), "session_ended")
    assert s.ended_because == "operator stopped it"


# -- 4. question state ----------------------------------------------------------------------------


def test_answer_without_open_question_is_no_open_question():
    _assert_rejected_without_effect([started()], answer("q1"), "no_open_question")


def test_second_answer_to_the_same_question_is_no_open_question():
    s = fold_all([started(), ask("q1"), answer("q1", "yes"), answer("q1", "no")])
    assert _codes(s) == ["no_open_question"]
    assert [d.answer for d in s.decisions] == ["yes"]


def test_answer_to_another_question_is_stale_question():
    s = _assert_rejected_without_effect(
        [started(), ask("q2")], answer("q1", "yes"), "stale_question"
    )
    assert s.question is not None
    assert s.question.id == "q2"


def test_question_while_one_is_open_is_question_open():
    s = _assert_rejected_without_effect(
        [started(), ask("q1", "first?")], ask("q2", "second?"), "question_open"
    )
    assert s.question is not None
    assert s.question.id == "q1"
    assert dict(s.pauses) == {"unspecified": 1}


def test_question_open_is_checked_before_invalid_payload():
    s = fold_all([started(), ask("q1"), ask("")])
    assert _codes(s) == ["question_open"]


def test_stale_question_is_checked_before_invalid_payload():
    s = fold_all([started(), ask("q1"), answer("")])
    assert _codes(s) == ["stale_question"]


def test_no_open_question_is_checked_before_invalid_payload():
    s = fold_all([started(), answer("")])
    assert _codes(s) == ["no_open_question"]


# -- 5. invalid -----------------------------------------------------------------------------------


def test_unknown_mode_in_mode_changed_is_invalid_and_mode_stays():
    s = _assert_rejected_without_effect(
        [started(mode="acknowledge")], make_event(ev.MODE_CHANGED, {"mode": "turbo"}), "invalid"
    )
    assert s.mode is Mode.ACKNOWLEDGE


def test_missing_mode_in_mode_changed_is_invalid():
    _assert_rejected_without_effect(
        [started(mode="auto")], make_event(ev.MODE_CHANGED, {}), "invalid"
    )


def test_compaction_through_not_below_own_seq_is_invalid():
    _assert_rejected_without_effect(
        [started(), turn("user", "a")],
        make_event(ev.COMPACTED, {"summary": "s", "through": 3}),
        "invalid",
    )


@pytest.mark.parametrize(
    ("type_", "payload"),
    [
        (ev.OPTION_REMOVED, {"option": "", "reason": {"code": "policy"}}),
        (ev.OPTION_REMOVED, {"option": "   ", "reason": {"code": "policy"}}),
        (ev.OPTION_REMOVED, {"option": "push", "reason": {"code": ""}}),
        (ev.OPTION_REMOVED, {"option": "push", "reason": {"message": "no code"}}),
        (ev.OPTION_REMOVED, {"option": "push"}),
        (ev.PERMISSION_GRANTED, {"operation": ""}),
        (ev.PERMISSION_GRANTED, {}),
        (ev.PERMISSION_REVOKED, {"operation": " "}),
        (ev.QUESTION_ASKED, {"question_id": "", "question": "Q?", "options": ["yes"]}),
        (ev.QUESTION_ASKED, {"question": "Q?"}),
        (ev.TOOL_CALLED, {"tool": "", "result": "x"}),
        (ev.TODO_CHANGED, {"id": "", "text": "A", "status": "pending"}),
        (ev.EXECUTION_RECORDED, {"operation": "", "argument_digest": "d"}),
        (ev.EXECUTION_RECORDED, {"operation": "deploy", "argument_digest": ""}),
        (ev.TODOS_TRANSFERRED, {"to": "", "todos": []}),
    ],
)
def test_empty_required_field_is_invalid(type_, payload):
    prefix = [started(), todo("t", "T"), make_event(ev.PERMISSION_GRANTED, {"operation": "op"})]
    _assert_rejected_without_effect(prefix, make_event(type_, payload), "invalid")


def test_todo_with_unknown_status_is_invalid():
    _assert_rejected_without_effect([started()], todo("a", "A", "finished"), "invalid")


def test_compaction_through_not_a_number_is_invalid():
    _assert_rejected_without_effect(
        [started(), turn("user", "a"), turn("user", "b")],
        make_event(ev.COMPACTED, {"summary": "s", "through": "2"}),
        "invalid",
    )


# -- no-ops are not rejections --------------------------------------------------------------------


def test_duplicate_event_id_is_a_noop_not_a_rejection():
    start, first = started(), turn("user", "a", event_id="same")
    before = fold_all([start, first])
    after, steps = _run([start, first, turn("user", "DIFFERENT", event_id="same")])
    assert steps[-1].outcome.kind is Kind.DUPLICATE
    assert steps[-1].outcome.rejection is None
    assert after.rejections == ()
    assert after == before


def test_duplicate_of_a_rejected_event_is_not_rejected_twice():
    bad = answer("q1", event_id="bad-1")
    s = fold_all([started(), bad, bad])
    assert _codes(s) == ["no_open_question"]
    assert s.seq == 2


def test_window_closed_losing_the_race_is_a_noop_not_a_rejection():
    prefix = [started(), ask("q1"), answer("q1", "yes")]
    before = fold_all(prefix)
    after, steps = _run([*prefix, window_closed("q1")])
    assert steps[-1].outcome.kind is Kind.NOOP
    assert after.rejections == ()
    assert replace(after, seq=before.seq, event_ids=before.event_ids) == before


def test_second_window_closed_for_the_same_question_is_harmless():
    prefix = [started(), ask("q1", "Deploy?"), window_closed("q1")]
    before = fold_all(prefix)
    after, steps = _run([*prefix, window_closed("q1")])
    assert steps[-1].outcome.kind is not Kind.APPLIED
    assert after.seq == before.seq + 1
    assert replace(after, seq=before.seq, event_ids=before.event_ids) == before


def test_window_closed_for_another_question_is_a_noop():
    prefix = [started(), ask("q1")]
    before = fold_all(prefix)
    after, steps = _run([*prefix, window_closed("q0")])
    assert steps[-1].outcome.kind is Kind.NOOP
    assert after.question is not None
    assert after.ended is False
    assert replace(after, seq=before.seq, event_ids=before.event_ids) == before


def test_window_closed_wins_then_answer_is_late_in_either_order():
    # window first: the answer is late; answer first: the window closing is a no-op.
    window_first = fold_all([started(), ask("q1"), window_closed("q1"), answer("q1", "yes")])
    answer_first = fold_all([started(), ask("q1"), answer("q1", "yes"), window_closed("q1")])
    assert window_first.ended is True
    assert _codes(window_first) == ["late_answer"]
    assert answer_first.ended is False
    assert answer_first.rejections == ()


# -- unknown types are skipped, never rejected ----------------------------------------------------


def test_unknown_type_before_started_is_skipped_not_unknown_session():
    s = fold_all([make_event("session.from_the_future", {}), started()])
    assert s.rejections == ()
    assert s.skipped == 1
    assert s.seq == 2
    assert s.started is True


def test_unknown_type_after_end_is_skipped_not_session_ended():
    s = fold_all([started(), ended(), make_event("session.from_the_future", {})])
    assert s.rejections == ()
    assert s.skipped == 1
    assert s.seq == 3


def test_turn_with_role_outside_user_assistant_system_is_invalid():
    _assert_rejected_without_effect([started()], turn("tool", "sneaky"), "invalid")


def test_late_answer_signed_by_trusted_key_keeps_verified_principal():
    signer = Signer.generate("surface")
    sig = signer.sign_answer(
        session_id="s1", question_id="q1", answer="yes", principal_id="actor:m:1", event_id="late"
    )
    late = answer(
        "q1",
        "yes",
        by={"id": "actor:m:1", "verified": True},
        extra={"signature": sig},
        event_id="late",
    )
    s = fold(
        "s1", [started(), ask("q1"), window_closed("q1"), late], trusted(signer.trusted_keys())
    )
    assert _codes(s) == ["late_answer"]
    assert s.rejections[0].by == Principal("actor:m:1", verified=True)
    assert s.downgrades == 0
