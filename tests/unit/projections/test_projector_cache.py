"""The caching projector (used by rebuilds) reads each session once and still honours the marks."""

from __future__ import annotations

from collections.abc import Sequence

from projections.memory import InMemoryProjectionStore
from projections.projector import Projector
from session_model.fold import fold
from session_model.projection import BatchFolder, Folded, Position, Record
from tests.unit.builders import started, turn


class CountingStore(InMemoryProjectionStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        self.reads.extend(session_ids)
        return super().folded(session_ids)


def _records(events: list, start: int = 0) -> list[Record]:
    return [Record(e, Position(0, start + i)) for i, e in enumerate(events)]


def test_a_caching_projector_reads_a_session_once_and_ends_equal_to_the_fold() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(9)]]
    store = CountingStore()
    projector = Projector(store, BatchFolder(), cache=True)
    for i in range(0, len(events), 3):
        projector.project(_records(events[i : i + 3], i))
    assert store.reads == ["s1"]
    assert store.load("s1") == fold("s1", events)


def test_a_caching_projector_recovers_when_another_writer_moved_the_mark() -> None:
    events = [started(), *[turn("user", f"t{i}") for i in range(5)]]
    store = CountingStore()
    mine = Projector(store, BatchFolder(), cache=True)
    mine.project(_records(events[:2]))
    Projector(store, BatchFolder()).project(_records(events[:4]))  # someone else applied 2..3
    mine.project(_records(events[2:], 2))  # my cache is stale: conflict, reload, fold again
    assert store.load("s1") == fold("s1", events)
    assert [t.content for t in store.history("s1")] == [f"t{i}" for i in range(5)]
