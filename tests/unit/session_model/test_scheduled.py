"""The scheduler's events: one builder; ids derived from what they close under a scheduler's
key, or a writer's own."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from schemas import events as ev
from session_model.compaction import CompactionPlan
from session_model.fold import Kind, step
from session_model.scheduled import ScheduledIds, compacted, window_closed
from tests.unit.builders import ask, fold_all, started

NOW = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


IDS = ScheduledIds(b"k" * 32)


def test_a_closing_is_the_same_event_whenever_one_scheduler_builds_it_for_the_same_asking() -> None:
    one = window_closed("s1", "q1", 7, NOW, "scheduler-a", event_id=IDS.closing("s1", 7))
    two = window_closed("s1", "q1", 7, NOW, "scheduler-a", event_id=IDS.closing("s1", 7))
    assert one.event_id == two.event_id  # a send tried again: a duplicate the fold drops
    assert IDS.closing("s1", 9) != one.event_id  # re-asked: new id
    assert IDS.closing("s2", 7) != one.event_id
    assert one.type == ev.ANSWER_WINDOW_CLOSED
    assert one.payload == {"question_id": "q1", "at": one.occurred_at, "asked_seq": 7}
    assert one.occurred_at.microsecond == 678000  # millisecond precision, as on the wire


def test_a_scheduler_s_ids_cannot_be_told_without_its_key() -> None:
    """An agent that knew a closing's id could append an event under it first: the fold would
    drop the closing as a duplicate, and the deadline would never end the session."""
    other = ScheduledIds(b"o" * 32)
    assert other.closing("s1", 7) != IDS.closing("s1", 7)
    assert other.compaction("s1", 12) != IDS.compaction("s1", 12)
    assert IDS.closing("s1", 12) != IDS.compaction("s1", 12)
    assert uuid.UUID(IDS.closing("s1", 7)).version == 4  # reads as any random id
    with pytest.raises(ValueError, match="16 bytes"):
        ScheduledIds(b"short")


def test_a_compaction_is_identified_by_its_cut_and_a_writer_gives_its_own_id() -> None:
    plan = CompactionPlan("summary", 12)
    event = compacted("s1", plan, NOW, "scheduler", event_id=IDS.compaction("s1", 12))
    assert event.event_id == IDS.compaction("s1", 12) != IDS.compaction("s1", 13)
    assert event.payload == {"summary": "summary", "through": 12}
    assert event.type == ev.COMPACTED
    assert compacted("s1", plan, NOW, "cli", event_id="mine").event_id == "mine"


def test_closings_of_one_asking_by_two_schedulers_end_the_session_once() -> None:
    """Around a rebalance two schedulers (keys of their own) may both close a window: the
    second closing is folded as a no-op, not refused, and the session ended once."""
    asked = fold_all([started(), ask("q1", expires_at="2026-01-01T00:00:00Z")])
    assert asked.question is not None
    seq = asked.question.seq
    first, second = (
        window_closed("s1", "q1", seq, NOW, "scheduler", event_id=ids.closing("s1", seq))
        for ids in (IDS, ScheduledIds(b"o" * 32))
    )
    closed = step(asked, first)
    assert closed.outcome.kind is Kind.APPLIED and closed.state.ended
    again = step(closed.state, second)
    assert again.outcome.kind is Kind.NOOP
    assert again.state.rejected == closed.state.rejected
    assert again.state.decision_count == closed.state.decision_count == 1
