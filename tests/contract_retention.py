"""The retention contract: an ended session's projection expires after its TTL, exactly.

Like `tests/contract_projection.py`: subclass `RetentionContract` in a `test_*.py` module that
provides a `projection_store` fixture yielding a fresh, empty store with a settable `retention`,
`expire_due(now)`, `expired(id)`, `drop(id)`, `fleet()` and `waiting_by_reason()`
(`InMemoryProjectionStore` in tests/unit, `RedisProjectionStore` in tests/integration).

Records are placed in the partition the default partitioner gives their session among
`PARTITIONS`, as the worker's are, so the Redis store's per-partition indexes are the real ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from projections.requests import Retention
from schemas import events as ev
from schemas.events import Event
from session_model.fold import fold
from session_model.partitioning import partition_for
from session_model.projection import BatchFolder, Expired, Position, Record
from tests.contract_projection import BASE_TIME, _project
from tests.contract_waiting import ask

PARTITIONS = 6  # the stores' default
TTL = timedelta(minutes=10)
RETENTION = Retention(int(TTL.total_seconds() * 1000))


class PartitionedLog:
    """Deterministic events, one second apart, each in its session's partition."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._n: Iterator[int] = itertools.count(1)
        self._offsets: dict[int, int] = {}

    def add(self, session_id: str, type_: str, payload: dict[str, Any]) -> Record:
        n = next(self._n)
        partition = partition_for(session_id, PARTITIONS)
        offset = self._offsets.get(partition, 0)
        self._offsets[partition] = offset + 1
        event = Event(
            f"{session_id}-r{n}",
            session_id,
            type_,
            BASE_TIME + timedelta(seconds=n),
            "retention-contract",
            payload,
        )
        record = Record(event, Position(partition, offset))
        self.records.append(record)
        return record

    def of(self, sid: str) -> list[Record]:
        return [r for r in self.records if r.event.session_id == sid]

    # The contract's `ask` helper writes through `log.add` with these signatures.
    def started(self, sid: str) -> Record:
        return self.add(sid, ev.STARTED, {"goal": f"goal of {sid}", "mode": "ask"})

    def ended(self, sid: str) -> Record:
        return self.add(sid, ev.ENDED, {"because": "done"})

    def turn(self, sid: str, content: str) -> Record:
        return self.add(sid, ev.TURN, {"role": "user", "content": content})


def _fleet_of(store: Any) -> dict[tuple[str, str], int]:
    return dict(store.fleet())


def _three_sessions(store: Any) -> tuple[PartitionedLog, Record]:
    """`done` ended (its ending returned), `busy` running, `asks` waiting on a question."""
    log = PartitionedLog()
    for sid in ("done", "busy", "asks"):
        log.started(sid)
    log.turn("done", "finish it")
    ask(log, "asks", "q1", minutes=120, reason="permission")  # type: ignore[arg-type]
    ending = log.ended("done")
    store.retention = RETENTION
    _project(store, log.records)
    return log, ending


def _deadline(record: Record) -> datetime:
    return record.event.occurred_at + TTL


class RetentionContract:
    """Contract tests of retention; subclass in a module providing `projection_store`."""

    def test_an_ended_session_expires_at_its_ttl_and_nothing_counts_it(
        self, projection_store: Any
    ) -> None:
        store = projection_store
        _, ending = _three_sessions(store)
        before_fleet = _fleet_of(store)
        assert before_fleet == {("ended", "ask"): 1, ("running", "ask"): 1, ("waiting", "ask"): 1}
        deadline = _deadline(ending)

        assert store.expire_due(deadline - timedelta(milliseconds=1)) == []
        assert store.load("done") is not None
        assert store.expired("done") is None

        assert store.expire_due(deadline) == ["done"]

        assert store.load("done") is None
        assert store.history("done") == [] and store.timeline("done") == []
        assert store.ids() == ["asks", "busy"]
        assert _fleet_of(store) == {("running", "ask"): 1, ("waiting", "ask"): 1}
        assert store.waiting_by_reason() == {"permission": 1}
        assert [w.session_id for w in store.waiting().items] == ["asks"]
        assert store.expired("done") == Expired("done", deadline, ending.position)
        assert store.expire_due(deadline + TTL) == []  # once only

    def test_without_a_ttl_nothing_expires(self, projection_store: Any) -> None:
        store = projection_store
        log = PartitionedLog()
        log.started("done")
        ending = log.ended("done")
        _project(store, log.records)
        assert store.expire_due(_deadline(ending) + timedelta(days=365)) == []
        assert store.load("done") is not None

    def test_a_later_event_of_an_ended_session_extends_its_deadline(
        self, projection_store: Any
    ) -> None:
        store = projection_store
        store.retention = RETENTION
        log = PartitionedLog()
        log.started("done")
        ending = log.ended("done")
        _project(store, log.records)
        late = log.turn("done", "too late")  # rejected: the session ended
        _project(store, [late])
        assert store.expire_due(_deadline(ending)) == []
        assert store.expire_due(_deadline(late)) == ["done"]

    def test_the_deadline_does_not_depend_on_the_batches(self, projection_store: Any) -> None:
        store = projection_store
        store.retention = RETENTION
        log = PartitionedLog()
        log.started("one")
        log.started("all")
        for i in range(3):
            log.turn("one", f"t{i}")
            log.turn("all", f"t{i}")
        log.ended("one")
        end_all = log.ended("all")
        log.turn("one", "late")
        late_all = log.turn("all", "late")
        for record in log.of("one"):
            _project(store, [record])
        _project(store, log.of("all"))
        assert late_all.event.occurred_at > end_all.event.occurred_at
        assert store.expire_due(_deadline(late_all) - timedelta(seconds=2)) == []
        assert sorted(store.expire_due(_deadline(late_all))) == ["all", "one"]

    def test_an_expired_session_takes_no_writes_until_it_is_rebuilt(
        self, projection_store: Any
    ) -> None:
        store = projection_store
        log, ending = _three_sessions(store)
        assert store.expire_due(_deadline(ending)) == ["done"]
        fleet = _fleet_of(store)

        # A late event (or a redelivery of its whole history) reaches a worker with no state.
        late = log.turn("done", "anyone there?")
        _project(store, [late])
        _project(store, log.of("done"))

        assert store.load("done") is None
        assert store.expired("done") is not None
        assert _fleet_of(store) == fleet

        # `replay --session`: drop (forgets the tombstone), then fold every event again.
        store.drop("done")
        assert store.expired("done") is None
        store.retention = RETENTION.restored(_deadline(late) + TTL)
        _project(store, log.of("done"))
        assert store.load("done") == fold("done", [r.event for r in log.of("done")])
        assert _fleet_of(store) == {
            ("ended", "ask"): 1,
            ("running", "ask"): 1,
            ("waiting", "ask"): 1,
        }
        # Restored: kept a TTL from the restore, not dropped again by the next sweep.
        assert store.expire_due(_deadline(late) + TTL) == []
        assert store.expire_due(_deadline(late) + 2 * TTL) == ["done"]

    def test_a_commit_for_an_expired_session_reports_it_expired_and_writes_nothing(
        self, projection_store: Any
    ) -> None:
        """A writer reuses an expired session's id (start, ask, answer): read as unknown, its
        events fold from empty into an update with a decision; the commit writes none of it and
        says so (`expired`, not `applied`), beside an update it does apply."""
        store = projection_store
        log, ending = _three_sessions(store)
        assert store.expire_due(_deadline(ending)) == ["done"]
        fleet, tombstone = _fleet_of(store), store.expired("done")
        reused = [log.started("done")]
        ask(log, "done", "q9", minutes=30, reason="permission")  # type: ignore[arg-type]
        reused.append(log.records[-1])
        reused.append(log.add("done", ev.QUESTION_ANSWERED, {"question_id": "q9", "answer": "y"}))
        (lost,) = BatchFolder().fold({}, reused)
        assert lost.base is None and lost.decisions  # a decision, had it been applied
        (kept,) = BatchFolder().fold(store.folded(["busy"]), [log.turn("busy", "go on")])

        result = store.commit([lost, kept])

        assert result.expired == ("done",)
        assert result.applied == ("busy",) and result.conflicts == ()
        assert store.load("done") is None and store.folded(["done"]) == {}
        assert store.history("done") == [] and store.timeline("done") == []
        assert store.facts("done").decisions == ()
        assert store.ids() == ["asks", "busy"]
        assert _fleet_of(store) == fleet
        assert [w.session_id for w in store.waiting().items] == ["asks"]
        assert store.expired("done") == tombstone
        assert store.load("busy") == kept.state

    def test_a_projector_commits_nothing_of_an_expired_session(self, projection_store: Any) -> None:
        """The cycle on each store: the reused id's update is not among those committed (nothing
        of it is published), the other sessions' are."""
        store = projection_store
        log, ending = _three_sessions(store)
        assert store.expire_due(_deadline(ending)) == ["done"]
        start = len(log.records)
        log.started("done")
        ask(log, "done", "q9", reason="permission")  # type: ignore[arg-type]
        log.add("done", ev.QUESTION_ANSWERED, {"question_id": "q9", "answer": "yes"})
        log.turn("busy", "go on")

        committed = _project(store, log.records[start:])

        assert [u.session_id for u in committed] == ["busy"]
        assert store.load("done") is None and store.expired("done") is not None

    def test_the_sweep_drops_a_backlog_in_bounded_steps(self, projection_store: Any) -> None:
        store = projection_store
        store.retention = RETENTION
        log = PartitionedLog()
        sids = [f"s{i:02d}" for i in range(12)]
        for sid in sids:
            log.started(sid)
            log.ended(sid)
        _project(store, log.records)
        later = BASE_TIME + 2 * TTL
        dropped: list[str] = []
        while step := store.expire_due(later, limit=1):
            assert len(step) <= PARTITIONS
            dropped += step
        assert sorted(dropped) == sids
        assert store.ids() == [] and _fleet_of(store) == {}
