"""Retention: the setting, the deadline a commit declares, and the worker's sweep loop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta

import pytest

from processors.scheduler import RetentionSweep, sweep_interval
from producers.settings import StackSettings
from projections.indexes import ceil_ms
from projections.memory import InMemoryProjectionStore
from projections.requests import Retention
from schemas.errors import ConfigurationError, ProjectionError
from session_model.projection import BatchFolder
from tests.contract_retention import PartitionedLog

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_the_ttl_is_read_from_the_environment_and_kept_for_ever_by_default() -> None:
    assert StackSettings().projection_ttl_s is None
    assert StackSettings.from_env({"MILPA_PROJECTION_TTL_S": "86400"}).projection_ttl_s == 86400.0
    with pytest.raises(ConfigurationError, match="MILPA_PROJECTION_TTL_S"):
        StackSettings.from_env({"MILPA_PROJECTION_TTL_S": "a day"})
    assert Retention.after(None) is None
    assert Retention.after(1.5) == Retention(1500)
    with pytest.raises(ConfigurationError, match="MILPA_PROJECTION_TTL_S"):
        Retention.after(0)


def test_the_deadline_is_the_last_event_from_the_ending_on_plus_the_ttl() -> None:
    log = PartitionedLog()
    log.started("s")
    log.turn("s", "hello")
    ending = log.ended("s")
    late = log.turn("s", "late")
    retention = Retention(60_000)
    (running,) = BatchFolder().fold({}, log.records[:2])
    assert retention.deadline_ms(running) is None
    (ended,) = BatchFolder().fold({}, log.records)
    assert retention.deadline_ms(ended) == ceil_ms(late.event.occurred_at) + 60_000
    (upto,) = BatchFolder().fold({}, log.records[:3])
    assert retention.deadline_ms(upto) == ceil_ms(ending.event.occurred_at) + 60_000
    floor = retention.restored(NOW)
    assert floor.deadline_ms(ended) == ceil_ms(NOW) + 60_000


def test_sweep_intervals_are_a_tenth_of_the_ttl_within_bounds() -> None:
    assert (sweep_interval(1), sweep_interval(300), sweep_interval(86400)) == (1.0, 30.0, 60.0)


class FakeExpire:
    """Hands out due ids `batch` at a time, recording the partitions and instants asked."""

    def __init__(self, due: list[str], batch: int) -> None:
        self.due, self.batch = due, batch
        self.calls: list[tuple[dict[int, int], datetime]] = []

    async def __call__(self, partitions: Mapping[int, int], now: datetime) -> list[str]:
        self.calls.append((dict(partitions), now))
        out, self.due = self.due[: self.batch], self.due[self.batch :]
        return out


def test_a_sweep_drains_the_backlog_of_the_owned_partitions_at_its_clock() -> None:
    expire = FakeExpire([f"s{i}" for i in range(5)], batch=2)
    sweep = RetentionSweep(expire, lambda: {3: 70, 1: 12}, clock=lambda: NOW)
    assert asyncio.run(sweep.sweep()) == ["s0", "s1", "s2", "s3", "s4"]
    assert expire.calls == [({1: 12, 3: 70}, NOW)] * 4  # the last one finds nothing more
    assert sweep.expired == 5
    later = NOW + timedelta(days=1)
    assert asyncio.run(sweep.sweep(later)) == []
    assert expire.calls[-1] == ({1: 12, 3: 70}, later)


def test_a_worker_owning_nothing_settled_sweeps_nothing() -> None:
    """Owned partitions whose settled offset is not known yet (nothing finished, nothing
    committed) are left out: `settled` names none."""
    expire = FakeExpire(["s0"], batch=1)
    assert asyncio.run(RetentionSweep(expire, dict).sweep(NOW)) == []
    assert expire.calls == []


def test_the_loop_survives_a_redis_failure_and_sweeps_again() -> None:
    store = InMemoryProjectionStore(retention=Retention(1000))
    log = PartitionedLog()
    log.started("s")
    log.ended("s")
    store.commit(BatchFolder().fold({}, log.records))
    failures = [ProjectionError("redis down")]

    async def expire(partitions: Mapping[int, int], now: datetime) -> list[str]:
        if failures:
            raise failures.pop()
        return store.expire_due(now)

    async def run() -> None:
        sweep = RetentionSweep(expire, lambda: {0: 2}, every=0.01, clock=lambda: NOW)
        task = asyncio.ensure_future(sweep.run())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if sweep.expired:
                break
        task.cancel()
        assert sweep.expired == 1

    asyncio.run(run())
    assert store.load("s") is None and store.expired("s") is not None
