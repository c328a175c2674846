"""The worker's snapshot rounds (`processors.snapshots.Snapshotter`) against fakes."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from click.testing import CliRunner

import processors.replay
from milpa_sessions import wiring
from milpa_sessions.cli import main
from processors.replay import ReplayReport
from processors.snapshots import Snapshotter, snapshot_partitions
from projections.codec import session_to_blob
from projections.requests import Retired
from projections.snapshots import CHECKPOINT_KEY, checkpoint_key, recovered, snapshot_record
from schemas.codec import EventCodec
from schemas.errors import LogError
from session_model.authority import Cutover, trust_fingerprint
from session_model.modes import Mode
from session_model.projection import Expired, Position
from session_model.session import Session
from session_model.signing import TrustedKeys

CODEC = EventCodec()
TRUST = trust_fingerprint(TrustedKeys.none(), Mode.ASK, Cutover())


@dataclass
class FakeStore:
    """Marks per session and an unsnapshotted index, as the commit script keeps them."""

    marks: dict[str, int]
    index: dict[str, int]
    commit_between: dict[str, int] = field(default_factory=dict)  # applied after the read
    half_built: set[str] = field(default_factory=set)  # a restore of them has not ended
    reads: int = 0
    retiring: dict[str, str] = field(default_factory=dict)  # the sweep's retired entries
    scan: list[str] = field(default_factory=list)

    async def retired(
        self, partition: int, cursor: int = 0, limit: int = 500
    ) -> tuple[int, list[tuple[str, str]]]:
        # As HSCAN: a cursor to go on from, 0 once the scan has ended; an entry there all
        # along is returned whatever is deleted meanwhile.
        if cursor == 0:
            self.scan = sorted(self.retiring)
        found = [s for s in self.scan[cursor : cursor + limit] if s in self.retiring]
        after = cursor + limit
        return (after if after < len(self.scan) else 0), [(s, self.retiring[s]) for s in found]

    async def unretire(self, partition: int, entries: Sequence[tuple[str, str]]) -> None:
        for sid, raw in entries:  # as lua/unretire.lua: only the entry as read
            if self.retiring.get(sid) == raw:
                del self.retiring[sid]

    async def unsnapshotted(self, partition: int, limit: int = 500) -> list[tuple[str, int]]:
        return sorted(self.index.items(), key=lambda kv: kv[1])[:limit]

    async def raw_states(self, partition: int, session_ids: Sequence[str]) -> dict[str, Any]:
        self.reads += 1
        marks = self.marks
        out: dict[str, Any] = {
            sid: None if sid in self.half_built else _raw(sid, marks[sid], partition)
            for sid in session_ids
            if sid in marks or sid in self.half_built
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


def _raw(sid: str, offset: int, partition: int = 0) -> Any:
    """A session's stored state as `raw_states` returns it."""
    return (session_to_blob(Session(sid)), f"{partition}:{offset}".encode(), [], [], None, {}, None)


@dataclass
class FakeSink:
    """Records what each round's writer published, and when writers were opened and closed."""

    sent: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    refuse_after: int | None = None  # pages published before the writer counts as fenced

    @contextlib.asynccontextmanager
    async def fenced(self, partition: int) -> AsyncIterator[FakeWriter]:
        self.log.append(f"open {partition}")
        try:
            yield FakeWriter(self, partition)
        finally:
            self.log.append(f"close {partition}")


@dataclass
class FakeWriter:
    sink: FakeSink
    partition: int

    async def publish(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        pages = sum(1 for entry in self.sink.log if entry.startswith("publish"))
        if self.sink.refuse_after is not None and pages >= self.sink.refuse_after:
            raise LogError("fenced by a newer writer")
        self.sink.log.append(f"publish {len(records)}")
        self.sink.sent.extend((self.partition, k, v) for k, v in records)


def _checkpoints(sink: FakeSink) -> list[int]:
    return [
        CODEC.decode_checkpoint(v)["offset"]
        for _, k, v in sink.sent
        if k.startswith(CHECKPOINT_KEY)
    ]


def _taker(store: FakeStore, sink: FakeSink, applied: int | None) -> Snapshotter:
    return Snapshotter(store, sink, lambda: {0}, lambda p: applied, page=2, trust=TRUST)


def _entry(gone: Retired) -> str:
    """A retired entry as lua/drop.lua writes it."""
    ms = int(gone.expired.at.timestamp() * 1000)
    return f"{ms} {gone.expired.mark} {json.dumps(dict(gone.counters))}"


def test_a_round_replaces_retired_sessions_snapshots_with_stubs_after_its_checkpoint() -> None:
    at = datetime(2026, 3, 1, 12, 0, 0, 250_000, tzinfo=UTC)
    gone = {
        sid: Retired(Expired(sid, at, Position(0, offset)), {"pauses\tpermission": offset})
        for sid, offset in (("r1", 4), ("r2", 6), ("r3", 8))
    }
    store = FakeStore({"a": 10}, {"a": 9}, retiring={s: _entry(g) for s, g in gone.items()})
    sink = FakeSink()
    taker = _taker(store, sink, applied=12)
    asyncio.run(taker.round(0))
    assert store.retiring == {}  # three stubs over two pages (page=2), then taken out
    keys = [k.decode() for _, k, _ in sink.sent]
    assert keys == ["a", CHECKPOINT_KEY.decode() + "0", "r1", "r2", "r3"]
    assert _checkpoints(sink) == [12]  # stubs cover nothing new: the checkpoint is as before
    assert taker.stats.stubs == 3
    for _, k, v in sink.sent[2:]:
        record = CODEC.decode_snapshot(v)
        assert record["state"] == b"" and record["turns"] == [] and record["event_ids"] == []
        assert recovered(record, TRUST) == gone[k.decode()]  # tombstone and counters come back


def test_an_entry_that_does_not_read_is_forgotten_and_the_others_get_their_stubs() -> None:
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    good = Retired(Expired("ok", at, Position(0, 3)), {})
    store = FakeStore({}, {}, retiring={"bad": "not an entry", "ok": _entry(good)})
    sink = FakeSink()
    taker = _taker(store, sink, applied=12)
    asyncio.run(taker.round(0))
    assert store.retiring == {}
    assert [k for _, k, _ in sink.sent] == [checkpoint_key(0), b"ok"]
    assert taker.stats.stubs == 1


def test_a_stub_that_was_not_acknowledged_keeps_its_entry() -> None:
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    store = FakeStore({}, {}, retiring={"r": _entry(Retired(Expired("r", at, Position(0, 3)), {}))})
    sink = FakeSink(refuse_after=1)  # the checkpoint goes, the stubs' page is refused
    taker = _taker(store, sink, applied=12)
    asyncio.run(taker.round_safely(0))
    assert list(store.retiring) == ["r"] and taker.stats.failures == 1
    assert _checkpoints(sink) == [12]  # the checkpoint moved all the same


def test_an_entry_renewed_while_its_stub_was_published_stays() -> None:
    """A session restored and expired again meanwhile has a newer entry: its own stub is due."""
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    store = FakeStore({}, {}, retiring={"r": _entry(Retired(Expired("r", at, Position(0, 3)), {}))})
    read = store.unretire

    async def renewed_first(partition: int, entries: Sequence[tuple[str, str]]) -> None:
        store.retiring["r"] = "1 0:9 {}"  # expired again between the read and the delete
        await read(partition, entries)

    store.unretire = renewed_first  # type: ignore[method-assign]
    asyncio.run(_taker(store, FakeSink(), applied=12).round(0))
    assert store.retiring == {"r": "1 0:9 {}"}


def test_a_partition_with_nothing_applied_still_gets_its_stubs() -> None:
    """A quiet partition whose sessions all ended sees no batch after a restart or hand-over:
    its rounds write the stubs of what the sweep retired there, and no checkpoint."""
    at = datetime(2026, 3, 1, 12, tzinfo=UTC)
    store = FakeStore({}, {}, retiring={"r": _entry(Retired(Expired("r", at, Position(0, 3)), {}))})
    sink = FakeSink()
    assert asyncio.run(_taker(store, sink, applied=None).round(0)) == 0
    assert [k for _, k, _ in sink.sent] == [b"r"] and store.retiring == {}
    idle = FakeSink()
    asyncio.run(_taker(store, idle, applied=None).round(0))
    assert idle.log == []  # nothing retired, nothing applied: no writer opened


def test_a_round_without_retired_sessions_writes_no_stub() -> None:
    store = FakeStore({"a": 10}, {"a": 9})
    sink = FakeSink()
    taker = _taker(store, sink, applied=12)
    asyncio.run(taker.round(0))
    assert [k for _, k, _ in sink.sent] == [b"a", checkpoint_key(0)]
    assert taker.stats.stubs == 0


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
    asyncio.run(Snapshotter(store, sink, lambda: {0}, lambda p: 16, trust=TRUST).round(0))
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


def test_a_round_publishes_through_one_writer_opened_before_it_reads_anything() -> None:
    store = FakeStore({"a": 10, "b": 12, "c": 7}, {"a": 3, "b": 11, "c": 5})
    sink = FakeSink()
    reads_when_opened: list[int] = []
    opening = sink.fenced

    def fenced(partition: int) -> Any:
        reads_when_opened.append(store.reads)
        return opening(partition)

    sink.fenced = fenced  # type: ignore[method-assign]
    asyncio.run(_taker(store, sink, applied=12).round(0))
    # Opened (earlier writers fenced off) before the first state was read; two pages and the
    # checkpoint, each published once; closed at the end.
    assert reads_when_opened == [0]
    assert sink.log == ["open 0", "publish 2", "publish 1", "publish 1", "close 0"]


def test_a_fenced_writer_fails_the_round_and_leaves_what_it_did_not_publish_in_the_index() -> None:
    store = FakeStore({"a": 10, "b": 12, "c": 7}, {"a": 3, "b": 11, "c": 5})
    sink = FakeSink(refuse_after=1)  # the first page lands, then a newer writer takes over
    taker = _taker(store, sink, applied=12)
    asyncio.run(taker.round_safely(0))
    assert taker.stats.failures == 1
    assert store.index == {"b": 11}  # the page it could not publish stays to be snapshotted
    assert _checkpoints(sink) == []  # and no checkpoint vouches for it
    assert sink.log[-1] == "close 0"


def test_a_failed_round_is_due_again_after_retry_s_not_a_whole_interval() -> None:
    now = [1000.0]
    store = FakeStore({"a": 10}, {"a": 3})
    sink = FakeSink(refuse_after=0)  # every publish is refused
    taker = Snapshotter(
        store,
        sink,
        lambda: {0},
        lambda p: 10,
        interval_s=300,
        retry_s=10,
        clock=lambda: now[0],
        trust=TRUST,
    )
    asyncio.run(taker.round_safely(0))
    assert taker.stats.failures == 1
    now[0] += 9
    assert not taker.due(0)
    now[0] += 1
    assert taker.due(0)
    sink.refuse_after = None
    asyncio.run(taker.round_safely(0))  # succeeds: the next one is a whole interval away
    assert taker.stats.rounds == 1
    now[0] += 299
    assert not taker.due(0)


def test_no_writer_is_opened_for_a_partition_not_owned_or_with_nothing_applied() -> None:
    store = FakeStore({"a": 10}, {"a": 3})
    sink = FakeSink()
    assert (
        asyncio.run(Snapshotter(store, sink, lambda: {1}, lambda p: 10, trust=TRUST).round(0)) == 0
    )
    assert asyncio.run(_taker(store, sink, applied=None).round(0)) == 0
    assert sink.log == [] and store.index == {"a": 3}


def test_a_session_too_large_for_one_record_is_left_out_and_holds_the_checkpoint_below_it() -> None:
    store = FakeStore({"a": 10, "b": 12, "c": 7}, {"a": 3, "b": 11, "c": 5})
    sink = FakeSink()
    taker = _taker(store, sink, applied=12)
    small = len(CODEC.encode_snapshot(snapshot_record("a", _raw("a", 10), 0, trust=TRUST)))
    big = "b" * 200  # a longer id: a record larger than the others
    store.marks[big], store.index[big] = 9, 4
    taker.max_record_bytes = small + 100
    assert asyncio.run(taker.round(0)) == 3
    assert taker.stats.too_large == 1
    assert store.index == {big: 4}  # left to be snapshotted, uncovered
    assert _checkpoints(sink) == [3]  # below its first uncovered offset; a, b, c published


def test_a_half_built_session_stays_in_the_index_uncovered_even_without_a_state() -> None:
    # "b": a restore died after its drop (no state yet, held at 0); "c": during its fold.
    store = FakeStore({"a": 10, "c": 7}, {"a": 3, "b": 0, "c": 5}, half_built={"b", "c"})
    sink = FakeSink()
    taker = _taker(store, sink, applied=10)
    assert asyncio.run(taker.round(0)) == 1
    assert taker.stats.half_built == 2
    assert store.index == {"b": 0, "c": 5}  # neither covered nor gone
    assert _checkpoints(sink) == [-1]  # below "b"'s offset 0: nothing is taken as covered


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
        trust=TRUST,
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
        trust=TRUST,
    )
    assert not taker2.due(1)

    @dataclass
    class U:
        mark: Position
        steps: tuple[int, ...]

    taker2.observe([U(Position(1, 9), (1, 2, 3, 4, 5))])  # type: ignore[list-item]
    assert taker2.due(1)


def test_a_rebuild_raises_a_failed_round_only_once_every_other_round_has_ended() -> None:
    """None is left running against the store and sink the caller closes next."""
    store = FakeStore({"a": 10}, {"a": 3})
    ended: list[int] = []

    @dataclass
    class SlowOrRefusing:
        partition: int

        async def publish(self, records: Sequence[tuple[bytes, bytes]]) -> None:
            if self.partition == 1:
                raise LogError("fenced by a newer writer")
            await asyncio.sleep(0.05)
            ended.append(self.partition)

    class Sink:
        @contextlib.asynccontextmanager
        async def fenced(self, partition: int) -> AsyncIterator[SlowOrRefusing]:
            yield SlowOrRefusing(partition)

    with pytest.raises(LogError, match="fenced"):
        asyncio.run(snapshot_partitions(store, Sink(), {0: 10, 1: 10}, trust=TRUST))
    assert ended == [0, 0]  # partition 0's page and its checkpoint, both published


def test_the_checkpoint_lag_of_a_partition_handed_over_is_no_longer_reported() -> None:
    owned = {0}
    taker = Snapshotter(
        FakeStore({}, {}), FakeSink(), lambda: owned, lambda p: None, interval_s=0.5, trust=TRUST
    )
    taker.stats.checkpoint_lag.update({0: 5, 3: 7})

    async def a_tick() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(taker.run(), 0.3)  # ticks every 0.05 s

    asyncio.run(a_tick())
    assert taker.stats.checkpoint_lag == {0: 5}


@dataclass
class StuckSink(FakeSink):
    """A broker that never acknowledges a page (the writer waits for ever)."""

    waiting: asyncio.Event = field(default_factory=asyncio.Event)

    @contextlib.asynccontextmanager
    async def fenced(self, partition: int) -> AsyncIterator[Any]:
        self.log.append(f"open {partition}")
        try:
            yield self
        finally:
            self.log.append(f"close {partition}")

    async def publish(self, records: Sequence[tuple[bytes, bytes]]) -> None:
        self.waiting.set()
        await asyncio.Event().wait()


def test_a_revocation_cancels_a_round_that_holds_the_guard_past_the_grace() -> None:
    async def main() -> None:
        store = FakeStore({"a": 10}, {"a": 3})
        sink = StuckSink()
        guard = asyncio.Lock()
        taker = Snapshotter(
            store,
            sink,
            lambda: {0},
            lambda p: 10,
            interval_s=0.5,
            every_events=0,
            guard=guard,
            trust=TRUST,
        )
        running = asyncio.ensure_future(taker.run())
        try:
            await asyncio.wait_for(sink.waiting.wait(), 5)
            assert guard.locked()
            async with taker.held(0.05):
                assert taker.stats.rounds == 0 and _checkpoints(sink) == []
                assert store.index == {"a": 3}  # still to be snapshotted
            await asyncio.sleep(0.01)
            assert taker.stats.failures == 1  # cancelled: tried again `retry_s` later
            assert sink.log == ["open 0", "close 0"]  # its writer was stopped
            assert not running.done()  # the rounds go on
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

    asyncio.run(main())


def test_a_revocation_waits_for_a_round_that_ends_within_the_grace() -> None:
    async def main() -> None:
        store = FakeStore({"a": 10}, {"a": 3})
        sink = FakeSink()
        guard = asyncio.Lock()
        taker = Snapshotter(store, sink, lambda: {0}, lambda p: 10, guard=guard, trust=TRUST)
        await guard.acquire()  # as a round would, ending 20 ms later
        asyncio.get_running_loop().call_later(0.02, guard.release)
        async with taker.held(5):
            assert guard.locked()
        assert not guard.locked()
        assert taker.stats.failures == 0

    asyncio.run(main())


def test_a_stopping_worker_cancels_the_round_under_way() -> None:
    async def main() -> None:
        sink = StuckSink()
        taker = Snapshotter(
            FakeStore({"a": 10}, {"a": 3}),
            sink,
            lambda: {0},
            lambda p: 10,
            interval_s=0.5,
            every_events=0,
            trust=TRUST,
        )
        running = asyncio.ensure_future(taker.run())
        await asyncio.wait_for(sink.waiting.wait(), 5)
        round_task = taker._current
        assert round_task is not None
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await asyncio.sleep(0)
        assert round_task.cancelled()

    asyncio.run(main())


def test_a_revocation_with_no_grace_left_takes_a_free_guard_without_cancelling_anything() -> None:
    async def main() -> None:
        sink = StuckSink()
        guard = asyncio.Lock()
        taker = Snapshotter(
            FakeStore({"a": 10}, {"a": 3}), sink, lambda: {0}, lambda p: 10, trust=TRUST
        )
        taker.guard = guard
        opening = asyncio.ensure_future(asyncio.Event().wait())  # a round opening its writer
        taker._current = opening  # type: ignore[assignment]
        async with taker.held(0.0):
            assert guard.locked()
        await asyncio.sleep(0.01)
        assert not opening.done()  # not cancelled
        opening.cancel()

    asyncio.run(main())


# -- the trust a round names -----------------------------------------------------------------------

OTHER = trust_fingerprint(TrustedKeys.none(), Mode.ACKNOWLEDGE, Cutover())


def _trusts(sink: FakeSink) -> dict[str, set[str | None]]:
    """The trusts named by the snapshots and by the checkpoints published."""
    out: dict[str, set[str | None]] = {"snapshots": set(), "checkpoints": set()}
    for _, k, v in sink.sent:
        if k.startswith(CHECKPOINT_KEY):
            out["checkpoints"].add(CODEC.decode_checkpoint(v)["trust"])
        else:
            out["snapshots"].add(CODEC.decode_snapshot(v)["trust"])
    return out


def test_every_snapshot_and_checkpoint_of_a_round_names_the_trust_the_worker_folds_with() -> None:
    for trust in (TRUST, OTHER):
        store = FakeStore({"a": 10, "b": 12, "c": 7}, {"a": 3, "b": 11, "c": 5})
        sink = FakeSink()
        asyncio.run(
            Snapshotter(store, sink, lambda: {0}, lambda p: 12, page=2, trust=trust).round(0)
        )
        assert _trusts(sink) == {"snapshots": {trust}, "checkpoints": {trust}}


def test_a_rebuilds_snapshots_name_the_trust_it_folded_under() -> None:
    """What `replay` runs after a rebuild (`wiring.take_snapshots`, with the report's trust)."""
    store = FakeStore({"a": 10, "b": 12}, {"a": 3, "b": 11})
    sink = FakeSink()
    assert asyncio.run(snapshot_partitions(store, sink, {0: 12}, trust=OTHER)) == 2
    assert _trusts(sink) == {"snapshots": {OTHER}, "checkpoints": {OTHER}}


def test_the_replay_command_snapshots_under_the_trust_its_rebuild_folded_under(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI hands `take_snapshots` the trust of the rebuild's report (its keys, start mode and
    cut-over), not one of its own."""

    def fake_replay(*args: Any, start_mode: Mode, cutover: Cutover, **kwargs: Any) -> ReplayReport:
        keys = args[3]
        folded = trust_fingerprint(keys, start_mode, cutover)
        return ReplayReport(12, 2, ends={0: 12}, trust=folded)

    taken: list[tuple[dict[int, int], str]] = []

    def fake_take(settings: Any, applied: Any, trust: str) -> int:
        taken.append((dict(applied), trust))
        return 2

    monkeypatch.setattr(processors.replay, "replay", fake_replay)
    monkeypatch.setattr(wiring, "take_snapshots", fake_take)
    env = {
        # Nothing here is reached: the rebuild and its snapshots are replaced.
        "MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1",
        "MILPA_REDIS_URL": "redis://127.0.0.1:1/0",
        "MILPA_SNAPSHOT_INTERVAL_S": "300",
        "MILPA_UNSIGNED_START_MODE": "acknowledge",
    }
    result = CliRunner().invoke(main, ["replay", "--force", "--full"], env=env)
    assert result.exit_code == 0, result.output
    assert taken == [({0: 11}, OTHER)]


def test_the_replay_command_reports_the_tombstones_it_restored_from_stubs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake_replay(*args: Any, **kwargs: Any) -> ReplayReport:
        return ReplayReport(12, 2, restored=3, retired=5, ends={0: 12}, trust=TRUST)

    monkeypatch.setattr(processors.replay, "replay", fake_replay)
    monkeypatch.setattr(wiring, "take_snapshots", lambda *args: 0)
    env = {"MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1", "MILPA_REDIS_URL": "redis://127.0.0.1:1/0"}
    result = CliRunner().invoke(main, ["replay", "--force"], env=env)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "3 restored from snapshots and 5 expired sessions' tombstones" in said
    result = CliRunner().invoke(main, ["--json", "replay", "--force"], env=env)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["restored_from_snapshots"], data["retired_from_snapshots"]) == (3, 5)
