"""The questions feed and the waiting entry, derived from folded updates (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from schemas.events import Event
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from session_model.questions import (
    NO_DEADLINE,
    Cursor,
    QuestionStatus,
    redelivered_changes,
    session_status,
    update_changes,
    waiting_question,
)
from session_model.session import Session
from tests.unit.builders import answer, ask, ended, fresh_ids, started, turn, window_closed


@pytest.fixture(autouse=True)
def _ids() -> None:
    fresh_ids()


def records(events: Sequence[Event]) -> list[Record]:
    return [Record(e, Position(0, i)) for i, e in enumerate(events)]


def fold(events: Sequence[Event], known: dict[str, Folded] | None = None) -> SessionUpdate:
    (update,) = BatchFolder().fold(known or {}, records(events))
    return update


def summary(update: SessionUpdate) -> list[tuple[str, str, int]]:
    return [(c.status.value, c.question_id, c.seq) for c in update_changes(update)]


def test_asking_then_answering_opens_and_resolves_the_question() -> None:
    events = [started(goal="ship"), ask("q1", reason="permission"), answer("q1", "yes")]
    changes = update_changes(fold(events))
    assert [(c.status, c.seq) for c in changes] == [
        (QuestionStatus.OPEN, 2),
        (QuestionStatus.ANSWERED, 2),
    ]
    opened, answered = changes
    assert (opened.question, opened.options, opened.reason, opened.goal, opened.mode) == (
        "Proceed?",
        ("yes", "no"),
        "permission",
        "ship",
        "ask",
    )
    assert opened.event_id == events[1].event_id and opened.at == events[1].occurred_at
    assert answered.answer == "yes" and answered.event_id == events[2].event_id
    assert answered.options == ("yes", "no")  # the question as it was asked


def test_an_answer_in_a_later_batch_resolves_the_question_it_names() -> None:
    first = fold([started(), ask("q1", options=("a", "b"))])
    later = BatchFolder().fold(
        {"s1": Folded(first.state, first.mark)}, [Record(answer("q1", "a"), Position(0, 2))]
    )
    (c,) = update_changes(later[0])
    assert (c.status, c.question_id, c.seq, c.answer, c.asked_at) == (
        QuestionStatus.ANSWERED,
        "q1",
        2,
        "a",
        first.state.question.asked_at if first.state.question else None,
    )


def test_a_rejected_question_changes_nothing() -> None:
    update = fold([started(), ask("q1"), ask("q2")])  # q2: another question is open
    assert summary(update) == [("open", "q1", 2)]


def test_the_end_makes_the_open_question_moot_for_good() -> None:
    update = fold(
        [started(), ask("q1", expires_at="2025-01-01T00:00:00Z"), ended(), window_closed()]
    )
    assert summary(update) == [("open", "q1", 2), ("moot", "q1", 2)]  # the closing is refused


def test_an_end_without_a_question_publishes_nothing() -> None:
    assert summary(fold([started(), turn("user", "hi"), ended()])) == []


def test_order_puts_resolutions_after_the_opening_and_later_questions_after_both() -> None:
    update = fold([started(), ask("q1"), answer("q1"), ask("q2")])
    orders = [c.order() for c in update_changes(update)]
    assert orders == sorted(orders) and len(set(orders)) == 3


def test_redelivered_records_republish_what_the_state_recorded() -> None:
    events = [started(), ask("q1", options=("go", "stop"), reason="permission"), answer("q1", "go")]
    events += [ask("q2", reason="signature"), ended()]
    update = fold(events)
    known = {"s1": Folded(update.state, update.mark)}
    again = redelivered_changes(known, records(events))
    assert sorted((c.seq, c.status.value) for c in again) == sorted(
        (c.seq, c.status.value) for c in update_changes(update)
    )
    first = {(c.seq, c.status): c for c in update_changes(update)}
    for c in again:
        original = first[(c.seq, c.status)]
        assert (c.question_id, c.question, c.options, c.reason, c.asked_at) == (
            original.question_id,
            original.question,
            original.options,
            original.reason,
            original.asked_at,
        )


def test_records_beyond_the_mark_or_of_unknown_sessions_republish_nothing() -> None:
    events = [started(), ask("q1")]
    update = fold(events[:1])
    known = {"s1": Folded(update.state, update.mark)}
    assert redelivered_changes(known, records(events)) == ()  # the asking is beyond the mark
    assert redelivered_changes({}, records(events)) == ()


def test_waiting_question_and_status() -> None:
    state = fold([started(goal="g"), ask("q1")]).state
    item = waiting_question(state, 123)
    assert item is not None and (item.reason, item.deadline_ms, item.goal) == (
        "unspecified",
        123,
        "g",
    )
    assert session_status(state).value == "waiting"
    ended_state = fold([started(), ask("q1"), ended()]).state
    assert waiting_question(ended_state, None) is None
    assert session_status(ended_state).value == "ended"
    assert session_status(Session("x")).value == "unstarted"


def test_cursor_round_trips_and_refuses_garbage() -> None:
    c = Cursor(NO_DEADLINE, "s:1")
    assert Cursor.parse(str(c)) == c
    for bad in ("", "12", "x:s", ":s"):
        with pytest.raises(ValueError):
            Cursor.parse(bad)
