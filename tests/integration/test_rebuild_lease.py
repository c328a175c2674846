"""One live rebuild at a time: the rebuild lease (`lua/lease.lua`, `processors.generations`).

A second `replay --live` while one runs would build the same next generation beside it and move
partitions the first one is moving; a plain `replay` would clear every generation under it. Both
are refused while a rebuild holds the lease, and nothing of the projections changes.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest

from milpa_sessions.settings import Settings
from processors.generations import _lease, rebuild_live
from processors.replay import replay
from projections.redis_store import RedisProjectionStore
from schemas.errors import RebuildInProgressError
from session_model.signing import TrustedKeys

pytestmark = pytest.mark.integration


def _token() -> str:
    return uuid.uuid4().hex


def test_the_lease_has_one_holder_until_given_back_or_lapsed(
    projections: RedisProjectionStore,
) -> None:
    a, b = _token(), _token()
    assert projections.lease(a, 10_000, "take")
    assert projections.lease(a, 10_000, "take")  # its own again: renewed
    assert projections.rebuild_running()
    assert not projections.lease(b, 10_000, "take")
    assert not projections.lease(b, 10_000, "renew")
    assert not projections.lease(b, 10_000, "give")  # not b's to give
    assert projections.lease(a, 10_000, "renew")
    assert projections.lease(a, 10_000, "give")
    assert not projections.rebuild_running()
    assert not projections.lease(a, 10_000, "renew")  # given back: nothing to renew
    assert projections.lease(b, 200, "take")
    time.sleep(0.5)  # b stalled past its lease: it lapsed
    assert not projections.rebuild_running()
    assert not projections.lease(b, 200, "renew")
    assert projections.lease(a, 10_000, "take")
    projections.lease(a, 10_000, "give")


def test_a_live_rebuild_is_refused_while_another_holds_the_lease(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    other = _token()
    assert projections.lease(other, 30_000, "take")
    before = projections.refresh_generations()
    with pytest.raises(RebuildInProgressError, match="another live rebuild"):
        rebuild_live(
            settings.kafka_access(), settings.events_topic, projections, TrustedKeys.none()
        )
    assert projections.refresh_generations() == before
    assert projections.lease(other, 30_000, "give")  # still the other one's


def test_a_plain_replay_is_refused_while_a_live_rebuild_runs_and_clears_nothing(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    probe = f"{projections.keys.tag(0)}:probe"
    projections.client.set(probe, b"1")
    live = _token()
    assert projections.lease(live, 30_000, "take")
    with pytest.raises(RebuildInProgressError, match="replay --live"):
        replay(settings.kafka_access(), settings.events_topic, projections, TrustedKeys.none())
    assert projections.client.get(probe) == b"1"
    assert projections.lease(live, 30_000, "give")


def test_a_live_rebuild_gives_its_lease_back_when_it_ends(
    settings: Settings, projections: RedisProjectionStore
) -> None:
    report = rebuild_live(
        settings.kafka_access(),
        settings.events_topic,
        projections,
        TrustedKeys.none(),
        grace_s=0.0,
    )
    assert report.generation == 1
    assert not projections.rebuild_running()
    assert projections.lease(_token(), 1_000, "take")  # free for the next one


@pytest.mark.plain_stack
@pytest.mark.redis_cluster  # run with the test that kills one of its masters, not beside it
def test_on_a_redis_cluster_the_lease_has_one_holder_too(
    settings: Settings, redis_cluster_url: str
) -> None:
    on_cluster = replace(settings, redis_url=redis_cluster_url, redis_cluster=True)
    store = RedisProjectionStore(on_cluster.redis_sync(), on_cluster.redis_keys())
    a, b = _token(), _token()
    try:
        assert store.lease(a, 10_000, "take")
        assert not store.lease(b, 10_000, "take")
        assert store.rebuild_running()
        assert store.lease(a, 10_000, "give")
        assert store.lease(b, 10_000, "take")
    finally:
        store.lease(b, 10_000, "give")
        store.client.close()


def test_a_rebuild_that_loses_its_lease_learns_it_before_its_next_move(
    projections: RedisProjectionStore,
) -> None:
    with _lease(projections, 0.3) as (lost, _guard):
        assert projections.rebuild_running()
        assert not lost.is_set()
        time.sleep(0.5)  # renewed meanwhile (every 0.1 s)
        assert not lost.is_set()
        projections.client.delete(projections.keys.rebuild_lease())  # lapsed, or taken away
        deadline = time.monotonic() + 5
        while not lost.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost.is_set()
    assert not projections.rebuild_running()
