"""A session whose stored state does not decode parks its partition, not the worker.

The state is damaged in Redis while no worker runs; a worker started then, new to the session,
reads it at the session's next record. That partition waits there, uncommitted, and says so on
`/readyz`, while the worker applies the other partitions. Once an operator rebuilds the session
(`replay --session ID --force`), the same worker process reads the partition again from that record
and applies everything, without a restart.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from deploy.harness import free_port, wait_for
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.partitioning import partition_for
from tests.integration.conftest import (
    PacedProducer,
    committed_offsets,
    damage_state,
    health,
    run_cli,
    with_keys,
)
from tests.integration.test_parked_partition import (
    _in_partition,
    _seq,
    around,
    parked_while_others_go_on,
)
from tests.unit.builders import started, turn

pytestmark = pytest.mark.integration


def _turns(projections: RedisProjectionStore, sid: str) -> int | None:
    """The session's turns so far (its seq also counts the scheduler's compactions)."""
    session = projections.load(sid)
    return None if session is None else session.turn_count


def test_an_unreadable_state_parks_its_partition_until_the_session_is_rebuilt(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    partitions = settings.partitions
    victim = "s-damaged"
    parked, neighbour, others = around(victim, partitions)
    port = free_port()
    worker_settings = with_keys(settings, metrics_port=port, park_retry_s=0.5)

    first = start_worker(worker_settings)
    kafka_log.append(started("to be damaged", session_id=victim))
    applied = kafka_log.append(turn("user", "before", session_id=victim))
    wait_for(lambda: committed_offsets(settings).get(parked, 0) > applied.offset, timeout=60)
    first.stop()
    damage_state(projections, victim)

    worker = start_worker(worker_settings)
    waits_at = kafka_log.append(turn("user", "after", session_id=victim))
    problems = parked_while_others_go_on(
        kafka_log, projections, port, worker, neighbour=neighbour, others=others
    )
    assert problems == [
        f"partition {parked} parked at offset {waits_at.offset}: what is stored of a session "
        "cannot be read now (see the worker's log)"
    ]
    assert _seq(projections, neighbour) is None  # after it in its partition: waiting
    elsewhere = {partition_for(sid, partitions) for sid in others}
    wait_for(lambda: all(committed_offsets(settings).get(p, 0) > 0 for p in elsewhere), timeout=30)
    assert committed_offsets(settings).get(parked, 0) <= waits_at.offset  # never past it
    assert f"replay --session {victim} --force" in worker.log()

    rebuilt = run_cli(settings, "replay", "--session", victim, "--force")
    assert rebuilt.returncode == 0, rebuilt.stderr
    try:
        wait_for(lambda: _seq(projections, neighbour) == 1, timeout=60)
        wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=30)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{worker.log()[-4000:]}") from None
    assert worker.alive()  # the same process: no restart
    assert _seq(projections, victim) == 3
    assert f"partition {parked} is read again from offset {waits_at.offset}" in worker.log()
    last = kafka_log.append(turn("user", "later", session_id=neighbour))
    wait_for(lambda: committed_offsets(settings).get(parked, 0) > last.offset, timeout=30)
    assert _seq(projections, neighbour) == 2


def test_a_session_rebuilt_while_a_worker_folds_its_events_loses_none(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    """`replay --session ID --force` with the worker running and the session's events coming:
    the worker never folds them onto the half-rebuilt state, nor onto nothing once the replay has
    dropped it (its partition waits while the replay runs, then goes on), and nothing is lost.
    `/readyz` says so in a note and stays ready while the wait is routine (`stall_s`), then
    answers 503 (a replay that long, or one that died, wants an operator).

    A replay of a short partition is over in a moment: its first steps (mark the session as
    being rebuilt, drop it) are taken here by hand, a few seconds before the replay itself, to
    hold the window open while events come."""
    partitions = settings.partitions
    live = "s-rebuilt-live"
    p = partition_for(live, partitions)
    port = free_port()
    stall_s = 4.0
    worker = start_worker(with_keys(settings, metrics_port=port, park_retry_s=0.5, stall_s=stall_s))
    neighbour = _in_partition(p, partitions, "s-neighbour")
    kafka_log.append_many(
        [
            started("live", session_id=live),
            *(turn("user", f"b{i}", session_id=live) for i in range(49)),
            started("neighbour", session_id=neighbour),
        ]
    )
    try:
        wait_for(lambda: _turns(projections, live) == 49, timeout=120)
    except TimeoutError:
        raise AssertionError(f"{_turns(projections, live)}\n{worker.log()[-4000:]}") from None

    ours = projections.begin_restore(live, datetime.now(UTC))  # as the replay begins
    projections.drop(live, restoring=True)
    state_key = projections.keys.session(live).state
    during = [turn("user", f"d{i}", session_id=live) for i in range(200)]
    producer = PacedProducer(kafka_log, during, seconds=4)
    producer.start()
    routine = f"partition {p} parked at offset"

    def noted() -> bool:
        status, body = health(port, "/readyz")
        return status == 200 and any(routine in n and "rebuilds" in n for n in body["notes"])

    try:
        wait_for(noted, timeout=30)  # waiting, and still ready
        wait_for(lambda: health(port, "/readyz")[0] == 503, timeout=30)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{worker.log()[-4000:]}") from None
    problems = health(port, "/readyz")[1]["problems"]
    assert any(routine in x and "half rebuilt for" in x for x in problems), problems
    for _ in range(10):  # events keep coming: none is folded onto nothing
        assert not projections.client.exists(state_key), worker.log()[-3000:]
        time.sleep(0.2)
    rebuilt = run_cli(settings, "replay", "--session", live, "--force")
    assert rebuilt.returncode == 0, rebuilt.stderr
    projections.end_restore(live, ours)  # (the replay's own mark replaced ours, and is gone)
    producer.join(timeout=60)
    assert producer.error is None
    kafka_log.append(turn("user", "after", session_id=neighbour))
    try:
        wait_for(lambda: _turns(projections, live) == 249, timeout=90)
        wait_for(lambda: _turns(projections, neighbour) == 1, timeout=30)
        wait_for(lambda: health(port, "/readyz")[0] == 200, timeout=30)
    except TimeoutError:
        raise AssertionError(
            f"{_turns(projections, live)}; {health(port, '/readyz')}\n{worker.log()[-4000:]}"
        ) from None
    assert worker.alive()
    assert "half rebuilt, by a `replay --session`" in worker.log()  # its partition waited
