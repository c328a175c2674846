"""A bug in the fold parks one partition of one worker; nothing is lost, no worker ends.

A worker whose fold raises on a record (`buggy_worker`: a planted TypeError) keeps going: the
record's partition stops there, uncommitted, and says so on `/readyz` and in the metrics, while
the other partitions are applied. A fixed worker then applies the parked records from the
committed offset.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from deploy.harness import Proc, free_port, wait_for
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.partitioning import partition_for
from tests.integration.buggy_worker import POISON
from tests.integration.conftest import committed_offsets, health, with_keys
from tests.unit.builders import ended, plan, started, turn

pytestmark = pytest.mark.integration


def _seq(projections: RedisProjectionStore, sid: str) -> int | None:
    session = projections.load(sid)
    return None if session is None else session.seq


def _in_partition(partition: int, partitions: int, prefix: str, avoid: int | None = None) -> str:
    """A session id of `prefix` whose records go to `partition` (or, with `avoid`, not there)."""
    for i in range(10_000):
        sid = f"{prefix}-{i}"
        p = partition_for(sid, partitions)
        if (avoid is None and p == partition) or (avoid is not None and p != avoid):
            return sid
    raise AssertionError("no such session id")


def around(sid: str, partitions: int) -> tuple[int, str, list[str]]:
    """The partition of `sid`, a session of that partition, and four sessions of others."""
    partition = partition_for(sid, partitions)
    neighbour = _in_partition(partition, partitions, "s-neighbour")
    others = [_in_partition(0, partitions, f"s-other{i}", avoid=partition) for i in range(4)]
    return partition, neighbour, others


def parked_while_others_go_on(
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    port: int,
    worker: Proc,
    *,
    neighbour: str,
    others: list[str],
) -> list[str]:
    """Start `neighbour` (after the record its partition parks at) and the `others`; once they
    are applied and the worker unready (but live), its `/readyz` problems."""
    kafka_log.append(started("after it, in its partition", session_id=neighbour))
    for sid in others:
        kafka_log.append(started("elsewhere", session_id=sid))
        kafka_log.append(turn("user", "on", session_id=sid))
    try:
        wait_for(lambda: all(_seq(projections, sid) == 2 for sid in others), timeout=60)
        wait_for(lambda: health(port, "/readyz")[0] == 503, timeout=30)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{worker.log()[-4000:]}") from None
    status, body = health(port, "/readyz")
    assert status == 503 and body["live"] is True, body
    problems: list[str] = body["problems"]
    return problems


def test_a_record_the_fold_raises_on_parks_its_partition_until_a_fixed_worker_takes_it(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    partitions = settings.partitions
    poisoned = "s-poisoned"
    parked, neighbour, others = around(poisoned, partitions)
    port = free_port()
    ttl = 10.0  # retention: the sweep must leave the parked partition's sessions alone
    buggy = start_worker(
        # (A session is dropped once a snapshot round took its last state: rounds come soon.)
        with_keys(settings, metrics_port=port, projection_ttl_s=ttl, snapshot_interval_s=0.2),
        module="tests.integration.buggy_worker",
    )
    # Ended before the bad record, in its partition, and committed: the sweep would drop it.
    ended_here = _in_partition(parked, partitions, "s-ended-here")
    ended_elsewhere = _in_partition(0, partitions, "s-ended-elsewhere", avoid=parked)
    # Due together, `ttl` from now: well after the bad record parks its partition.
    now = datetime.now(UTC)
    kafka_log.append(started("ends", session_id=ended_elsewhere))
    kafka_log.append(ended(session_id=ended_elsewhere, occurred_at=now))
    kafka_log.append(started("ends", session_id=ended_here))
    ended_at = kafka_log.append(ended(session_id=ended_here, occurred_at=now))
    wait_for(lambda: committed_offsets(settings).get(parked, 0) > ended_at.offset, timeout=30)

    kafka_log.append(started("poisoned", session_id=poisoned))
    kafka_log.append(turn("user", "before", session_id=poisoned))
    poison_at = kafka_log.append(plan(POISON, session_id=poisoned))
    kafka_log.append(turn("user", "after", session_id=poisoned))
    (problem,) = parked_while_others_go_on(
        kafka_log, projections, port, buggy, neighbour=neighbour, others=others
    )
    assert problem == (
        f"partition {parked} parked at offset {poison_at.offset}: the fold raised TypeError "
        "(a bug: see the worker's log)"
    ), problem
    assert health(port, "/livez")[0] == 200 and buggy.alive()
    assert _seq(projections, poisoned) == 2  # up to the record before it
    assert _seq(projections, neighbour) is None  # after it in its partition: waiting
    elsewhere = {partition_for(sid, partitions) for sid in others}
    wait_for(lambda: all(committed_offsets(settings).get(p, 0) > 0 for p in elsewhere), timeout=30)
    assert committed_offsets(settings).get(parked, 0) <= poison_at.offset  # never past it
    assert f"partition {parked} parked at offset {poison_at.offset} (session {poisoned!r})" in (
        buggy.log()
    )

    # The sweep drops the session ended elsewhere, not the one in the parked partition (one
    # sweep would have dropped both: they are due at the same instant).
    wait_for(lambda: projections.expired(ended_elsewhere) is not None, timeout=ttl + 30)
    assert projections.expired(ended_here) is None and projections.load(ended_here) is not None

    buggy.stop()
    fixed = start_worker(with_keys(settings, metrics_port=port))
    try:
        wait_for(lambda: _seq(projections, neighbour) == 1, timeout=60)
        wait_for(lambda: _seq(projections, poisoned) == 4, timeout=30)
        wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=30)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{fixed.log()[-4000:]}") from None
    session = projections.load(poisoned)
    assert session is not None and session.plan is not None
    assert all(_seq(projections, sid) == 2 for sid in others)
