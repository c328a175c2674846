"""Records at or below a session's mark are skipped by the fold, but their decisions come back."""

from __future__ import annotations

import pytest

from session_model.projection import (
    BatchFolder,
    Folded,
    Position,
    Record,
    joined,
    redelivered_decisions,
)
from tests.unit.builders import answer, ask, started, turn


def _records(events: list, partition: int = 0, start: int = 0) -> list[Record]:
    return [Record(e, Position(partition, start + i)) for i, e in enumerate(events)]


def _applied(records: list[Record]) -> dict[str, Folded]:
    (update,) = BatchFolder().fold({}, records)
    return {update.session_id: Folded(update.state, update.mark)}


def test_a_redelivered_answer_gives_back_the_decision_it_made() -> None:
    events = [started(), ask("q1"), answer("q1"), ask("q2"), answer("q2", "no"), turn("user", "x")]
    records = _records(events)
    known = _applied(records)
    decisions = known["s1"].state.decisions
    assert [d.question_id for d in decisions] == ["q1", "q2"]

    assert redelivered_decisions(known, records) == (("s1", decisions[0]), ("s1", decisions[1]))
    # Only the records redelivered count: from the second answer on.
    assert redelivered_decisions(known, records[4:]) == (("s1", decisions[1]),)
    assert redelivered_decisions(known, records[5:]) == ()


def test_records_beyond_the_mark_or_of_unknown_sessions_give_nothing() -> None:
    events = [started(), ask("q1"), answer("q1")]
    records = _records(events)
    known = _applied(records[:2])  # the answer was never applied: it is not a redelivery
    assert known["s1"].mark == Position(0, 1)
    assert redelivered_decisions(known, records) == ()
    assert redelivered_decisions({}, records) == ()
    other = [Record(started(session_id="s2"), Position(0, 0))]
    assert redelivered_decisions(_applied(records), other) == ()


def test_two_consecutive_updates_join_into_the_update_of_both() -> None:
    events = [started(), ask("q1"), turn("user", "a"), answer("q1"), turn("user", "b")]
    records = _records(events)
    folder = BatchFolder()
    (whole,) = folder.fold({}, records)
    (first,) = folder.fold({}, records[:2])
    (later,) = folder.fold({"s1": Folded(first.state, first.mark)}, records[2:])

    assert joined(first, later) == whole
    with pytest.raises(ValueError, match="does not follow"):
        joined(later, first)
