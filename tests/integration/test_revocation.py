"""A worker whose output the broker keeps refusing does not hold up the group's rebalance.

A revocation waits for the batch being committed, and a batch waits (retrying) until its
decisions are published. Without a bound, a worker whose decisions topic refuses every send would
never finish its revocation, and since a rebalance waits for every member, no other worker could
take its partitions. With `revoke_grace` the batch is cancelled and its records are delivered
again to their partitions' next owner, which publishes their decisions. A batch being folded
when the revocation begins (stuck sending a dead letter, or reading Redis) is cancelled at once:
it was fetched before the revocation, so nothing of it would be written anyway.
"""

from __future__ import annotations

from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaProducer

from deploy.harness import wait_for
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.signing import TrustedKeys
from tests.integration.conftest import with_keys
from tests.integration.expected import decided, expected_projections
from tests.integration.test_scale_and_crash import (
    FAST_GROUP_ENV,
    decisions_in,
    generate,
    group_assignment,
    highest_marks,
    joins,
    send_all,
)

pytestmark = pytest.mark.integration


def _delete(settings: Settings, name: str) -> None:
    admin = KafkaAdminClient(**settings.kafka_access().kafka_python())
    try:
        admin.delete_topics([name])
    finally:
        admin.close()


@pytest.mark.parametrize("refused", ["decisions", "dead letters"])
def test_a_worker_stuck_publishing_lets_its_partitions_go_to_another(  # noqa: PLR0917
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    refused: str,
) -> None:
    for name, value in FAST_GROUP_ENV.items():  # rebalance timeout 20 s
        monkeypatch.setenv(name, value)
    # The stuck worker's output topic is deleted once it started (the broker creates no topic
    # on a send): every send to it waits for metadata in vain, then is retried.
    field = "decisions_topic" if refused == "decisions" else "deadletter_topic"
    gone = f"{getattr(settings, field)}-gone"
    stuck = start_worker(with_keys(settings, revoke_grace=2.0, **{field: gone}))
    sids, events = generate(120)
    expected = expected_projections(events, TrustedKeys.none())
    wait_for(lambda: len(group_assignment(settings)) == 1, timeout=45, interval=0.5)
    _delete(settings, gone)
    if refused == "dead letters":
        # Unreadable: the fold of the batch holding it waits for its dead letter to leave.
        raw_producer.send(settings.events_topic, key=b"poison", value=b"\x00 not avro")
        raw_producer.flush(timeout=30)
        wait_for(lambda: "dead-lettering" in stuck.log(), timeout=60, interval=0.5)
    last = send_all(kafka_log, events)
    if refused == "decisions":
        # A batch is in Redis; its decisions cannot leave, so no offset is committed.
        wait_for(lambda: highest_marks(projections, sids), timeout=60, interval=0.5)
    assert decisions_in(settings) == set()

    other = start_worker()
    shared: dict[str, set[int]] = {}

    def both_hold_partitions() -> bool:
        assert stuck.alive() and other.alive(), stuck.log()[-3000:] + other.log()[-3000:]
        shared.clear()
        shared.update(group_assignment(settings))
        return len(shared) == 2 and all(shared.values())

    # Without the grace the stuck worker never ends its revocation: the group stays rebalancing
    # until the coordinator drops it (20 s), and it never joins again.
    wait_for(both_hold_partitions, timeout=60, interval=0.5)
    if refused == "decisions":
        assert "was cancelled: its records go to their next owner" in stuck.log()
    mine = shared[joins(other.log())[-1][1]]
    # Their records came to the other worker again: it projects them and publishes their
    # decisions, and only theirs (the stuck worker still cannot publish those it kept).
    ours = {sid for sid in sids if last[sid].partition in mine}
    want = {d for d in decided(expected) if d[0] in ours}
    assert want, f"partitions {sorted(mine)} hold sessions with decisions"
    wait_for(lambda: decisions_in(settings) >= want, timeout=60, interval=1.0)
    assert decisions_in(settings) == want
    assert {sid: projections.load(sid) for sid in ours} == {
        sid: expected[sid].state for sid in ours
    }
