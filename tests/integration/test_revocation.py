"""A worker whose output the broker keeps refusing does not hold up the group's rebalance.

A revocation waits for the batches in hand, and a batch waits (retrying) until its decisions or
its dead letters are published. Without a bound, a worker whose output topic refuses every send
would never finish its revocation, and since a rebalance waits for every member, no other worker
could take its partitions until the coordinator dropped it. With `revoke_grace` the worker leaves
the group and ends instead (what it had not finished is read again from the committed offsets),
and the others go on.
"""

from __future__ import annotations

from typing import Any

import pytest
from kafka import KafkaAdminClient, KafkaProducer

from deploy.harness import read_topic, wait_for
from milpa_sessions.settings import Settings
from processors.worker import DEADLETTER_CODE
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.intake import UNDECODABLE
from session_model.signing import TrustedKeys
from tests.integration.conftest import with_keys
from tests.integration.expected import decided, expected_projections
from tests.integration.test_scale_and_crash import (
    FAST_GROUP_ENV,
    assert_equals_the_fold,
    decisions_in,
    generate,
    group_assignment,
    highest_marks,
    send_all,
    wait_for_all,
)

pytestmark = pytest.mark.integration


def _delete(settings: Settings, name: str) -> None:
    admin = KafkaAdminClient(**settings.kafka_access().kafka_python())
    try:
        admin.delete_topics([name])
    finally:
        admin.close()


@pytest.mark.fault_load  # its topic deleted under a worker: nothing TLS and ACLs change
@pytest.mark.parametrize("refused", ["decisions", "dead letters"])
def test_a_worker_stuck_publishing_leaves_and_another_takes_its_partitions(  # noqa: PLR0917
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    refused: str,
) -> None:
    # Faust's session and rebalance timeouts (60 s), longer than this test waits: the stuck
    # worker's partitions go to the other one because it left the group, not because the
    # coordinator gave up waiting for it.
    timeouts = {"BROKER_SESSION_TIMEOUT": "60", "BROKER_REBALANCE_TIMEOUT": "60"}
    for name, value in {**FAST_GROUP_ENV, **timeouts}.items():
        monkeypatch.setenv(name, value)
    # The stuck worker's output topic is deleted once it started (the broker creates no topic
    # on a send): every send to it waits for metadata in vain, then is retried.
    field = "decisions_topic" if refused == "decisions" else "deadletter_topic"
    gone = f"{getattr(settings, field)}-gone"
    stuck = start_worker(with_keys(settings, revoke_grace=2.0, shutdown_grace=5.0, **{field: gone}))
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
    # Its revocation cannot finish: after its grace (2 s) the stuck worker leaves the group and
    # ends. Without the grace it would wait for ever, and the group for it (60 s, then without
    # it); ending without leaving, the group would wait for it as long.
    wait_for(lambda: not stuck.alive(), timeout=30, interval=0.5)
    assert "has not finished 2s after the worker's partitions were revoked" in stuck.log()

    def the_other_holds_every_partition() -> bool:
        assert other.alive(), other.log()[-3000:]
        members = group_assignment(settings)
        return len(members) == 1 and set().union(*members.values()) == set(range(6))

    wait_for(the_other_holds_every_partition, timeout=30, interval=0.5)
    # Nothing the stuck worker had in hand is lost: read again from the committed offsets.
    wait_for_all(projections, last, timeout=60, why="the other worker", workers=(other,))
    assert_equals_the_fold(projections, expected)
    assert sorted(projections.ids()) == sids
    want = set(decided(expected))
    wait_for(lambda: decisions_in(settings) >= want, timeout=60, interval=1.0)
    assert decisions_in(settings) == want
    if refused == "dead letters":
        codes = [
            dict(r.headers)[DEADLETTER_CODE].decode()
            for r in read_topic(settings.kafka_access().kafka_python(), settings.deadletter_topic)
        ]
        assert UNDECODABLE in codes
