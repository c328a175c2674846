"""The sans-I/O projection cycle: which requests it yields, and what it makes of the replies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from projections.memory import InMemoryProjectionStore
from schemas.errors import ProjectionError
from session_model.cycle import PAUSE, Committed, Folding, ProjectionCycle, Read, Steps, Write, run
from session_model.fold import fold
from session_model.ports import CommitResult
from session_model.projection import BatchFolder, Folded, Position, Record
from tests.unit.builders import started, turn


def _records(events: Sequence[Any], partition: int = 0, start: int = 0) -> list[Record]:
    return [Record(e, Position(partition, start + i)) for i, e in enumerate(events)]


def _script(steps: Steps[Any], replies: Sequence[Any]) -> tuple[list[Any], Any]:
    """Feed `replies` to the cycle in order; the requests it made and its result."""
    requests: list[Any] = []
    reply: Any = None
    answers = iter(replies)
    while True:
        try:
            requests.append(steps.send(reply))
        except StopIteration as done:
            return requests, done.value
        reply = next(answers)


def test_a_batch_of_new_sessions_reads_once_and_commits_once() -> None:
    events = [started(session_id="a"), started(session_id="b"), turn("user", "x", session_id="a")]
    cycle = ProjectionCycle(BatchFolder())
    requests, (folding, committed) = _script(
        cycle.project(_records(events)), [{}, CommitResult(("a", "b"))]
    )
    assert requests[0] == Read(("a", "b"))
    assert type(requests[1]) is Write
    assert [u.session_id for u in requests[1].updates] == ["a", "b"]
    assert len(requests) == 2
    assert [len(u.steps) for u in folding.updates] == [2, 1]
    assert committed == Committed(folding.updates)
    assert cycle.cache["a"].state == fold("a", [events[0], events[2]])


def test_slices_pause_between_them_and_still_give_one_update_per_session() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(6)]]
    cycle = ProjectionCycle(BatchFolder(), slice_size=3)
    requests, folding = _script(cycle.fold(_records(events)), [{}, None, None])
    assert requests == [Read(("s1",)), PAUSE, PAUSE]
    assert len(folding.updates) == 1
    assert folding.updates[0].state == fold("s1", events)
    assert folding.updates[0].base is None


def test_a_conflict_rereads_the_session_and_folds_again_onto_the_stored_state() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(4)]]
    records = _records(events)
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records[:3]), store)  # another writer's work
    stale = ProjectionCycle(BatchFolder())
    stale.cache["s1"] = Folded(fold("s1", events[:1]), records[0].position)
    folding, committed = run(stale.project(records), store)
    assert committed.conflicts == 1
    assert [len(u.steps) for u in committed.updates] == [2]
    assert store.load("s1") == fold("s1", events)
    # Record 0 was below the stale mark; the re-fold found records 0 to 2 applied: 3 in all.
    assert folding.redelivered == 1
    assert folding.redelivered + committed.redelivered == 3


def test_a_session_that_keeps_conflicting_gives_up_after_max_rounds() -> None:
    cycle = ProjectionCycle(BatchFolder(), max_rounds=2)
    steps = cycle.project(_records([started()]))
    with pytest.raises(ProjectionError, match="kept conflicting"):
        _script(steps, [{}, CommitResult((), ("s1",)), {}, CommitResult((), ("s1",))])


def test_records_at_or_below_the_mark_are_redelivered_and_their_decisions_returned() -> None:
    events = [started(), turn("user", "a")]
    records = _records(events)
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(records), store)
    folding, committed = run(ProjectionCycle(BatchFolder()).project(records), store)
    assert folding == Folding(tuple(records), (), redelivered=2)
    assert committed == Committed(())


def test_a_record_of_a_session_projected_from_another_partition_is_foreign() -> None:
    store = InMemoryProjectionStore()
    run(ProjectionCycle(BatchFolder()).project(_records([started()], partition=0)), store)
    stray = _records([turn("user", "x")], partition=3, start=7)
    folding, committed = run(ProjectionCycle(BatchFolder()).project(stray), store)
    assert folding.foreign == tuple(stray)
    assert folding.records == ()
    assert committed.updates == ()


def test_keep_false_forgets_after_each_batch_and_a_limit_trims_the_older_half() -> None:
    batch = _records([started(session_id=f"s{i}") for i in range(4)])
    store = InMemoryProjectionStore()
    once = ProjectionCycle(BatchFolder(), keep=False)
    run(once.project(batch[:2]), store)
    assert once.cache == {}
    bounded = ProjectionCycle(BatchFolder(), cache_limit=3)
    run(bounded.project(batch), store.__class__())
    assert list(bounded.cache) == ["s2", "s3"]


def test_states_reads_only_what_it_does_not_know() -> None:
    cycle = ProjectionCycle(BatchFolder())
    known = Folded(fold("a", [started(session_id="a")]), Position(0, 0))
    cycle.cache["a"] = known
    requests, found = _script(cycle.states(["a", "b"]), [{}])
    assert requests == [Read(("b",))]
    assert found == {"a": known}
