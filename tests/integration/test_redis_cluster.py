"""The projections on a Redis Cluster (3 masters + 3 replicas: `stack.py up --redis-cluster`).

The same worker, readers and analytics as on one Redis, chosen by `MILPA_REDIS_CLUSTER`: each
partition's keys are one hash slot, the six partitions spread over the three masters, and a batch
goes to each master in one pipeline. With `MILPA_REDIS_WAIT_REPLICAS=1` a master killed mid-stream
loses nothing: every commit was on its replica before the worker moved its Kafka offsets.
Plain stack only (`up --secure` starts no cluster).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from deploy.harness import kill_redis_master, stack_dir, start_redis_node
from milpa_sessions.settings import Settings
from processors.replay import replay
from producers.kafka_log import KafkaEventLog
from projections.redis_client import HIREDIS_PACKER, SyncCluster
from projections.redis_store import RedisProjectionStore
from schemas.events import Event
from session_model.projection import Position
from session_model.signing import TrustedKeys
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import (
    assert_counts_are_exact,
    assert_equals_the_fold,
    generate,
    reached,
    send_all,
    wait_for_all,
)

# `./dev test` runs the tests on the shared Redis Cluster after the others, in one process: this
# module kills one of its masters.
pytestmark = [pytest.mark.integration, pytest.mark.plain_stack, pytest.mark.redis_cluster]


@pytest.fixture
def on_cluster(settings: Settings, redis_cluster_url: str) -> Settings:
    """This test's settings with the projections on the Redis Cluster, each write waiting for
    one replica."""
    return replace(
        settings,
        redis_url=redis_cluster_url,
        redis_cluster=True,
        redis_wait_replicas=1,
        redis_wait_timeout_ms=2000,
    )


@pytest.fixture
def cluster_projections(on_cluster: Settings) -> Iterator[RedisProjectionStore]:
    """The projection store of this test's prefix on the cluster (cleared afterwards)."""
    store = RedisProjectionStore(on_cluster.redis_sync(), on_cluster.redis_keys())
    assert isinstance(store.client, SyncCluster)
    yield store
    store.clear()
    store.client.close()


def _masters_holding(store: RedisProjectionStore, sids: Sequence[str]) -> set[str]:
    assert isinstance(store.client, SyncCluster)
    return {store.client.get_node_from_key(store.keys.session(sid).state).name for sid in sids}


def test_a_worker_on_the_cluster_folds_six_partitions_over_three_masters_and_equals_the_fold(
    on_cluster: Settings,
    kafka_log: KafkaEventLog,
    cluster_projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker(on_cluster)
    sids, events = generate(300, prefix="c", group=50)
    last = send_all(kafka_log, events)
    expected = expected_projections(events, TrustedKeys.none())
    wait_for_all(cluster_projections, last, timeout=90, why="on the cluster", workers=(worker,))

    assert len(_masters_holding(cluster_projections, sids)) == 3
    assert {p.partition for p in last.values()} == set(range(6))
    assert sorted(cluster_projections.ids()) == sids  # a SCAN of every master
    assert_equals_the_fold(cluster_projections, expected)
    assert_counts_are_exact(on_cluster, cluster_projections, expected)


def test_a_rebuild_on_the_cluster_writes_through_node_clients_that_hiredis_packs(
    on_cluster: Settings,
    kafka_log: KafkaEventLog,
    cluster_projections: RedisProjectionStore,
) -> None:
    sids, events = generate(120, prefix="r", group=30)
    send_all(kafka_log, events)
    expected = expected_projections(events, TrustedKeys.none())

    report = replay(
        on_cluster.kafka_access(),
        on_cluster.events_topic,
        cluster_projections,
        TrustedKeys.none(),
        processes=1,  # in this process: its node clients are the ones looked at below
    )

    assert report.records == len(events)
    assert sorted(cluster_projections.ids()) == sids
    assert_equals_the_fold(cluster_projections, expected)
    client = cluster_projections.client
    assert isinstance(client, SyncCluster)
    masters = _masters_holding(cluster_projections, sids)
    nodes = client.__dict__["_node_clients"]
    assert masters <= set(nodes) and len(masters) == 3
    for node in nodes.values():
        connection = node.connection_pool.get_connection()
        try:
            assert connection._command_packer is HIREDIS_PACKER
        finally:
            node.connection_pool.release(connection)
    pools = [node.connection_pool for node in nodes.values()]
    assert any(c._sock is not None for p in pools for c in p._available_connections)
    client.close()
    # Closing the cluster client closes the node clients' connections too.
    assert not any(c._sock is not None for p in pools for c in p._available_connections)


def _paced(log: KafkaEventLog, events: Sequence[Event], sent: list[int]) -> dict[str, Position]:
    """Send the events ~3,000 a second, counting them in `sent[0]`; the last position of each
    session."""
    last: dict[str, Position] = {}
    for at in range(0, len(events), 300):
        last.update(send_all(log, events[at : at + 300]))
        sent[0] = at + 300
        time.sleep(0.1)
    return last


@pytest.mark.fault_load
def test_a_master_killed_mid_stream_loses_nothing_once_commits_wait_for_a_replica(
    on_cluster: Settings,
    kafka_log: KafkaEventLog,
    cluster_projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker(on_cluster)
    sids, events = generate(400, prefix="f", group=50)
    expected = expected_projections(events, TrustedKeys.none())
    sent = [0]
    out: dict[str, dict[str, Position]] = {}
    producer = threading.Thread(target=lambda: out.update(last=_paced(kafka_log, events, sent)))
    producer.start()

    # Mid-stream: some sessions already folded on every master, most of the stream still to come.
    deadline = time.monotonic() + 60
    while sent[0] < len(events) // 3 or reached_any(cluster_projections, sids) < 20:
        assert time.monotonic() < deadline, f"no progress before the kill\n{worker.log()[-3000:]}"
        assert worker.alive(), worker.log()[-3000:]
        time.sleep(0.05)
    state = stack_dir()
    killed = kill_redis_master(state)
    try:
        # The replica takes over after the cluster's node timeout; until the killed node comes
        # back (as the new master's replica) a WAIT for one replica cannot be met, and the
        # worker holds those partitions' offsets where they are.
        time.sleep(6)
        assert worker.alive(), worker.log()[-3000:]
    finally:
        start_redis_node(state, killed)
    producer.join(timeout=120)
    assert not producer.is_alive()
    last = out["last"]
    wait_for_all(
        cluster_projections, last, timeout=120, why="after a master failed over", workers=(worker,)
    )

    assert "redis unavailable" in worker.log() or "replicas" in worker.log()
    assert sorted(cluster_projections.ids()) == sids
    assert_equals_the_fold(cluster_projections, expected)
    assert_counts_are_exact(on_cluster, cluster_projections, expected)
    done = reached(cluster_projections, last)
    assert done == len(sids)


def reached_any(store: RedisProjectionStore, sids: Sequence[str]) -> int:
    """How many of these sessions have a projection at all."""
    return len(store.folded(list(sids)))
