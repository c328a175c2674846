"""A replicated Kafka: one broker of three killed with -9 mid-stream and started again.

The module starts a cluster of its own (`deploy/stack.py up --brokers 3`: three combined
broker+controller nodes, replication factor 3, min.insync.replicas 2) beside the shared stack, and
uses the shared Redis. Topics are made with the replication settings the cluster's stack.env
exports. While a paced producer writes many sessions and a worker folds them, the broker leading
the most partitions of the events topic is killed with SIGKILL; once the controller fenced it
(leaders moved, it left the ISRs) writes go on with two replicas; it is started again on its data
and rejoins every ISR. Then every acknowledged event is in the topic once, Redis equals the pure
fold of the topic (state, history, facts, timeline: nothing applied twice), the counters are exact
and the questions and decisions published reached their topics.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from deploy.harness import (
    Proc,
    kill_broker,
    partition_states,
    read_env,
    stack_command,
    stack_dir_env,
    start_broker,
    start_python,
    topic_config,
    wait_for,
)
from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from producers.topics import admin_client, broker_metadata, ensure_topics, topic_specs
from projections.redis_store import RedisProjectionStore
from session_model.signing import TrustedKeys
from tests.integration.conftest import PacedProducer
from tests.integration.expected import (
    decided,
    expected_projections,
)
from tests.integration.test_scale_and_crash import (
    assert_counts_are_exact,
    assert_equals_the_fold,
    decisions_in,
    events_in,
    generate,
    group_assignment,
    ids_by_session,
    wait_for_all,
)

pytestmark = [pytest.mark.integration, pytest.mark.plain_stack]  # a plaintext cluster of its own

SESSIONS = 600  # about 13k events
PRODUCE_S = 30.0  # the producer spreads them over this long, so the outage falls mid-stream


@dataclass(frozen=True)
class Cluster:
    """The module's 3-broker cluster: its state directory and what its stack.env says."""

    state: Path
    env: dict[str, str]

    @property
    def bootstrap(self) -> str:
        return self.env["MILPA_KAFKA_BOOTSTRAP"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """`deploy/stack.py up --brokers 3` in a state directory of this module's own."""
    state = tmp_path_factory.mktemp("cluster") / "stack"
    env = stack_dir_env(state)
    done = stack_command("up", "--brokers", "3", env=env, timeout=300, check=False)
    if done.returncode != 0:
        stack_command("down", env=env, timeout=120, check=False)
        message = (
            f"cannot start a 3-broker cluster (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
        # Exit 2 is a missing prerequisite (java, mvn, redis-server); anything else is a bug.
        if done.returncode != 2 or os.environ.get("MILPA_REQUIRE_SERVICES") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield Cluster(state, read_env(state / "stack.env"))
    finally:
        stack_command("down", env=env, timeout=120, check=False)


@pytest.fixture
def on_cluster(secured: Settings, cluster: Cluster) -> Settings:
    """This test's topics on the cluster, made with the replication its stack.env exports; its
    key prefix in the shared Redis."""
    tag = uuid.uuid4().hex[:10]
    s = replace(
        secured,
        kafka_bootstrap=cluster.bootstrap,
        replication_factor=int(cluster.env["MILPA_REPLICATION_FACTOR"]),
        min_insync_replicas=int(cluster.env["MILPA_MIN_INSYNC_REPLICAS"]),
        redis_prefix=f"itf{tag}",
        events_topic=f"itf-{tag}-events",
        decisions_topic=f"itf-{tag}-decisions",
        questions_topic=f"itf-{tag}-questions",
        deadletter_topic=f"itf-{tag}-deadletter",
        snapshots_topic=f"itf-{tag}-snapshots",
        consumer_group=f"itf-{tag}-projector",
        partitions=6,
        read_timeout=60.0,
        scheduler_enabled=False,  # the topic holds only what the test appended
    )
    ensure_topics(s)
    return s


@pytest.fixture
def store(on_cluster: Settings) -> Iterator[RedisProjectionStore]:
    s = on_cluster
    projections = RedisProjectionStore.from_url(s.redis_url, s.redis_keys(), auth=s.redis_auth())
    yield projections
    projections.clear()
    projections.client.close()


def _made_replicated(bootstrap: str, topic: str) -> bool:
    """The topic has 3 replicas per partition and min.insync.replicas=2 set on it."""
    replicas = {len(p.replicas) for p in partition_states(bootstrap, topic).values()}
    isr = topic_config(bootstrap, topic).get("min.insync.replicas")
    return replicas == {3} and isr == ("2", "DYNAMIC_TOPIC_CONFIG")


def _leaders(bootstrap: str, topic: str) -> Counter[int]:
    return Counter(state.leader for state in partition_states(bootstrap, topic).values())


def _fenced(bootstrap: str, topic: str, broker: int) -> bool:
    states = partition_states(bootstrap, topic).values()
    return all(s.leader not in (-1, broker) and broker not in s.isr for s in states)


def _in_sync(bootstrap: str, topic: str) -> bool:
    return all(
        len(s.isr) == len(s.replicas) == 3 for s in partition_states(bootstrap, topic).values()
    )


@pytest.fixture
def start_worker(on_cluster: Settings, tmp_path: Path) -> Iterator[Any]:
    """Start a worker on the cluster with this test's settings; stopped at teardown."""
    started: list[Proc] = []

    def start() -> Proc:
        worker = start_python(
            "worker",
            "milpa_sessions.cli",
            ["worker", "--loglevel", "info"],
            tmp_path / f"worker-{len(started)}.log",
            env=on_cluster.to_env(),
            cwd=tmp_path,  # Faust's data directory goes there, not into the checkout
            grace=30.0,
        )
        started.append(worker)
        return worker

    yield start
    for w in started:
        w.stop()


def test_topics_made_are_known_to_every_broker_when_ensure_topics_returns(
    on_cluster: Settings,
) -> None:
    """`ensure_topics` returns only once each of the three brokers serves the new topics whole:
    a client that then asks any of them is not told they do not exist."""
    for round_ in range(3):
        tag = uuid.uuid4().hex[:10]
        s = replace(
            on_cluster,
            **{f: f"itv-{tag}-{f}" for f in _TOPIC_FIELDS},
        )
        made = {spec.name: spec.partitions for spec in topic_specs(s)}
        assert set(ensure_topics(s).values()) == {"created"}
        admin = admin_client(s)
        try:
            ask = broker_metadata(admin)
            _, brokers = ask(None, sorted(made))
            assert len(brokers) == 3
            for broker in brokers:  # right away, each on its own connection
                known, _ = ask(broker, sorted(made))
                assert known == made, f"round {round_}: broker {broker} knows {known}"
        finally:
            admin.close()


_TOPIC_FIELDS = (
    "events_topic",
    "decisions_topic",
    "questions_topic",
    "deadletter_topic",
    "snapshots_topic",
)


def test_a_broker_killed_mid_stream_and_restarted_loses_and_doubles_nothing(
    on_cluster: Settings, store: RedisProjectionStore, cluster: Cluster, start_worker: Any
) -> None:
    s, bootstrap = on_cluster, cluster.bootstrap
    for name in (spec.name for spec in topic_specs(s)):
        wait_for(  # each topic made with the replication the cluster's stack.env exports
            functools.partial(_made_replicated, bootstrap, name),
            timeout=15,
            what=f"{name} on 3 replicas with min.insync.replicas=2 of its own",
        )

    _, events = generate(SESSIONS, prefix="b", group=100)
    first = store.keys.session(events[0].session_id).state
    worker = start_worker()
    # The producer's pace starts once the worker holds every partition: on a busy machine a
    # worker's start-up can take most of PRODUCE_S, and the outage must still fall mid-stream.
    wait_for(
        lambda: (
            sorted(p for ps in group_assignment(s).values() for p in ps)
            == list(range(s.partitions))
        ),
        timeout=90,
        interval=0.5,
        what="the worker holding every partition",
        procs=(worker,),
    )
    log = KafkaEventLog(s.kafka_access(), s.events_topic)
    producer = PacedProducer(log, events, PRODUCE_S)
    try:
        producer.start()
        # Mid-stream: a quarter acknowledged and the worker folding.
        wait_for(
            lambda: producer.acked() >= len(events) // 4 and store.client.exists(first),
            timeout=60,
            what="a quarter of the events acknowledged and folded",
            procs=(worker,),
        )
        victim = _leaders(bootstrap, s.events_topic).most_common(1)[0][0]
        kill_broker(cluster.state, victim)
        killed = time.monotonic()
        killed_at = producer.acked()
        wait_for(
            lambda: _fenced(bootstrap, s.events_topic, victim),
            timeout=30,
            what=f"broker {victim} fenced: its partitions led by others, out of their ISRs",
        )
        fenced_at = producer.acked()
        fenced_after = time.monotonic() - killed
        assert fenced_at + 500 < len(events), (
            f"the outage did not fall mid-stream: {fenced_at}/{len(events)} acknowledged when the "
            f"broker was fenced, {fenced_after:.1f}s after the kill"
        )
        wait_for(  # two in-sync replicas of three are enough to acknowledge (acks=all)
            lambda: producer.acked() >= fenced_at + 500,
            timeout=30,
            what="writes acknowledged with one broker down",
            procs=(worker,),
        )
        assert producer.acked() < len(events), "the producer finished before the restart"
        restarted_at = producer.acked()
        start_broker(cluster.state, victim)
        back_after = time.monotonic() - killed
        wait_for(
            lambda: _in_sync(bootstrap, s.events_topic),
            timeout=60,
            what=f"broker {victim} back in every ISR",
        )
        producer.join(timeout=PRODUCE_S + 180)
        assert not producer.is_alive(), "the producer did not finish"
        assert producer.error is None, repr(producer.error)
    finally:
        log.close(timeout=10)

    sent = [e for e, _ in producer.futures]
    failed = [(e, f.exception) for e, f in producer.futures if not f.succeeded()]
    assert len(sent) == len(events)
    assert not failed, f"{len(failed)} appends failed, e.g. {failed[:3]}"
    print(  # the outage as it happened (pytest -rA shows it)
        f"broker {victim} killed at {killed_at}/{len(events)} acknowledged, fenced after "
        f"{fenced_after:.1f}s ({fenced_at} acknowledged), restarted at {restarted_at}, back "
        f"{back_after:.1f}s after the kill"
    )

    # The topic holds exactly what was acknowledged, each session's events in the order sent.
    in_topic, last = events_in(s)
    assert len(in_topic) == len(sent)
    assert ids_by_session(in_topic) == ids_by_session(sent)

    wait_for_all(store, last, timeout=90, why="after the broker's restart", workers=(worker,))
    assert worker.alive(), worker.log()[-3000:]

    expected = expected_projections(in_topic, TrustedKeys.none())
    assert sorted(store.ids()) == sorted(expected)
    assert_equals_the_fold(store, expected)  # state, history, facts, timeline: nothing twice
    # Counters, fleet, waiting: each step once. What the worker published through the outage
    # (acks=all): every question change and every decision at least once, none invented.
    assert_counts_are_exact(s, store, expected)
    assert decisions_in(s) == set(decided(expected))
