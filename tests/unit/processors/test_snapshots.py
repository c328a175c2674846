"""The worker's snapshot rounds (`processors.snapshots.Snapshotter`) against fakes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from processors.snapshots import Snapshotter
from projections.codec import session_to_blob
from projections.snapshots import CHECKPOINT_KEY
from schemas.codec import EventCodec
from session_model.projection import Position
from session_model.session import Session

CODEC = EventCodec()


@dataclass
class FakeStore:
    """Marks per session and an unsnapshotted index, as the commit script keeps them."""

    marks: dict[str, int]
    index: dict[str, int]
    commit_between: dict[str, int] = field(default_factory=dict)  # applied after the read

    async def unsnapshotted(self, partition: int, limit: int = 500) -> list[tuple[str, int]]:
        return sorted(self.index.items(), key=lambda kv: kv[1])[:limit]

    async def raw_states(self, partition: int, session_ids: Sequence[str]) -> dict[str, Any]:
        out = {
            sid: (
                session_to_blob(Session(sid)),
                f"{partition}:{self.marks[sid]}".encode(),
                [],
                [],
                None,
                {},
                None,
            )
            for sid in session_ids
            if sid in self.marks
        }
        for sid, offset in self.commit_between.items():  # a commit lands while it publishes
            self.marks[sid] = offset
        return out

    async def snapped(
        self, partition: int, covered: Sequence[tuple[str, Position | None]]
    ) -> int | None:
        for sid, mark in covered:
            stored = self.marks.get(sid)
            if (mark is None and stored is None) or (mark is not None and stored == mark.offset):
                self.index.pop(sid, None)
            elif mark is not None and sid in self.index:
                self.index[sid] = max(self.index[sid], mark.offset + 1)
        return min(self.index.values()) if self.index else None


@dataclass
class FakeSink:
    sent: list[tuple[int, bytes, bytes]] = field(default_factory=list)

    async def publish_to(self, records: Sequence[tuple[int, bytes, bytes]]) -> None:
        self.sent.extend(records)


def _checkpoints(sink: FakeSink) -> list[int]:
    return [
        CODEC.decode_checkpoint(v)["offset"]
        for _, k, v in sink.sent
        if k.startswith(CHECKPOINT_KEY)
    ]


def _taker(store: FakeStore, sink: FakeSink, applied: int | None) -> Snapshotter:
    return Snapshotter(store, sink, lambda: {0}, lambda p: applied, page=2)


def test_a_round_snapshots_every_changed_session_then_vouches_for_what_was_applied() -> None:
    store = FakeStore({"a": 10, "b": 12, "c": 7}, {"a": 3, "b": 11, "c": 5})
    sink = FakeSink()
    assert asyncio.run(_taker(store, sink, applied=12).round(0)) == 3  # over two pages
    assert store.index == {}
    assert _checkpoints(sink) == [12]
    snapped = {
        k.decode(): CODEC.decode_snapshot(v)["offset"]
        for _, k, v in sink.sent
        if not k.startswith(CHECKPOINT_KEY)
    }
    assert snapped == {"a": 10, "b": 12, "c": 7}


def test_a_session_committed_during_the_round_holds_the_checkpoint_below_it() -> None:
    store = FakeStore({"a": 10, "b": 12}, {"a": 3, "b": 11}, commit_between={"a": 15})
    sink = FakeSink()
    asyncio.run(Snapshotter(store, sink, lambda: {0}, lambda p: 16).round(0))
    assert store.index == {"a": 11}  # from the offset after its snapshot
    assert _checkpoints(sink) == [10]


def test_no_checkpoint_beyond_what_this_worker_applied_and_none_before_it_applied_anything() -> (
    None
):
    store = FakeStore({"a": 10}, {"a": 3})
    sink = FakeSink()
    asyncio.run(_taker(store, sink, applied=8).round(0))
    assert _checkpoints(sink) == [8]  # a batch may have applied part of its sessions only
    store = FakeStore({"a": 10}, {"a": 3})
    sink = FakeSink()
    assert asyncio.run(_taker(store, sink, applied=None).round(0)) == 0
    assert sink.sent == [] and store.index == {"a": 3}


def test_a_session_without_a_state_leaves_the_index() -> None:
    store = FakeStore({"a": 10}, {"a": 3, "gone": 4})
    sink = FakeSink()
    asyncio.run(_taker(store, sink, applied=10).round(0))
    assert store.index == {} and _checkpoints(sink) == [10]


def test_a_round_is_due_on_time_or_after_enough_events() -> None:
    now = [0.0]
    taker = Snapshotter(
        FakeStore({}, {}),
        FakeSink(),
        set,
        lambda p: None,
        interval_s=60,
        every_events=5,
        clock=lambda: now[0],
    )
    assert not taker.due(0)
    now[0] = 61.0
    assert taker.due(0)
    now[0] = 0.0
    taker2 = Snapshotter(
        FakeStore({}, {}),
        FakeSink(),
        set,
        lambda p: None,
        interval_s=60,
        every_events=5,
        clock=lambda: now[0],
    )
    assert not taker2.due(1)

    @dataclass
    class U:
        mark: Position
        steps: tuple[int, ...]

    taker2.observe([U(Position(1, 9), (1, 2, 3, 4, 5))])  # type: ignore[list-item]
    assert taker2.due(1)
