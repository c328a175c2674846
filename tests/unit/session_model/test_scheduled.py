"""The scheduler's events: one builder; ids derived from what they close, or a writer's own."""

from __future__ import annotations

from datetime import UTC, datetime

from schemas import events as ev
from session_model.compaction import CompactionPlan
from session_model.scheduled import compacted, window_closed

NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def test_a_closing_is_the_same_event_whoever_builds_it_for_the_same_question() -> None:
    one = window_closed("s1", "q1", 7, NOW, "scheduler-a")
    two = window_closed("s1", "q1", 7, NOW, "scheduler-b")
    assert one.event_id == two.event_id
    assert window_closed("s1", "q1", 9, NOW, "x").event_id != one.event_id  # re-asked: new id
    assert one.type == ev.ANSWER_WINDOW_CLOSED
    assert one.payload == {"question_id": "q1", "at": one.occurred_at, "asked_seq": 7}
    assert one.occurred_at.microsecond == 678000  # millisecond precision, as on the wire


def test_a_compaction_is_identified_by_its_cut_and_a_writer_may_give_its_own_id() -> None:
    plan = CompactionPlan("summary", 12)
    event = compacted("s1", plan, NOW, "scheduler")
    assert event.event_id == compacted("s1", plan, NOW, "other").event_id
    assert event.payload == {"summary": "summary", "through": 12}
    assert event.type == ev.COMPACTED
    assert compacted("s1", plan, NOW, "cli", event_id="mine").event_id == "mine"
