"""Question deadlines: readable or not, never an exception, even at the calendar's ends."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from projections.keys import Keys
from projections.requests import commit_call
from session_model.deadlines import parse_deadline
from session_model.projection import BatchFolder, Position, Record
from tests.unit.builders import ask, started


@pytest.mark.parametrize(
    ("text", "instant"),
    [
        ("2026-03-01T10:00:00Z", datetime(2026, 3, 1, 10, tzinfo=UTC)),
        ("2026-03-01T10:00:00+02:00", datetime(2026, 3, 1, 8, tzinfo=UTC)),
        ("9999-12-31T23:59:59-01:00", datetime.max.replace(tzinfo=UTC)),  # past the last instant
        ("0001-01-01T00:00:00+01:00", datetime.min.replace(tzinfo=UTC)),  # before the first
        ("2026-03-01T10:00:00", None),  # no offset: a guessed zone could end a session
        ("tomorrow", None),
        (17, None),
    ],
)
def test_a_deadline_reads_as_an_instant_or_none(text: object, instant: datetime | None) -> None:
    assert parse_deadline(text) == instant


@pytest.mark.parametrize("expires_at", ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"])
def test_a_question_with_a_deadline_at_the_calendar_s_ends_is_folded_and_written(
    expires_at: str,
) -> None:
    records = [
        Record(started(), Position(0, 0)),
        Record(ask("q1", expires_at=expires_at), Position(0, 1)),
    ]
    (update,) = BatchFolder().fold({}, records)
    assert update.state.question is not None
    assert update.state.question.deadline is not None
    commit_call(Keys("t", partitions=6), update, None)  # the waiting index's score included
