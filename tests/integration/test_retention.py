"""Retention against the real stack: the contract on Redis, and expiry → `show` → `replay`.

The contract (tests/contract_retention.py) runs here against `RedisProjectionStore`, under a key
prefix of each test's own; the end-to-end test ends sessions through a worker, sweeps with a
clock it passes in (no real TTL is waited for), and restores one with `replay --session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner

from deploy.harness import wait_for
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from processors.scheduler import RetentionSweep
from producers.kafka_log import KafkaEventLog
from projections.indexes import ceil_ms
from projections.keys import Keys
from projections.redis_client import SyncCluster, async_client
from projections.redis_store import AsyncRedisProjectionStore, RedisProjectionStore
from projections.requests import Retired, parse_retired
from schemas import events as ev
from schemas.events import Event
from session_model.fold import fold
from session_model.partitioning import partition_for
from session_model.projection import Record
from session_model.signing import TrustedKeys
from tests.contract_projection import _project
from tests.contract_retention import PARTITIONS, RETENTION, TTL, PartitionedLog, RetentionContract
from tests.contract_waiting import ask
from tests.integration.conftest import with_keys
from tests.integration.expected import assert_projection_matches, expected_projections
from tests.integration.test_scale_and_crash import dump

pytestmark = pytest.mark.integration


@pytest.fixture(
    params=[
        "single",
        pytest.param("cluster", marks=(pytest.mark.plain_stack, pytest.mark.redis_cluster)),
    ]
)
def projection_store(
    request: pytest.FixtureRequest, secured: Settings
) -> Iterator[RedisProjectionStore]:
    """A Redis projection store under a unique prefix, empty before and after the test: on the
    single Redis, and on the Redis Cluster (plain stack only: `up --secure` starts none)."""
    keys = Keys(f"itr{uuid.uuid4().hex[:10]}", partitions=secured.partitions)
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        store = RedisProjectionStore.from_url(url, keys, cluster=True)
    else:
        store = RedisProjectionStore.from_url(secured.redis_url, keys, auth=secured.redis_auth())
    store.clear()
    yield store
    store.clear()
    store.client.close()


class TestRedisRetention(RetentionContract):
    """Every retention contract test against `RedisProjectionStore` (the commit and drop
    scripts keep the retention index, the tombstones, the waiting index and fleet counts)."""


def _ended_while_tracked(
    projection_store: RedisProjectionStore, sid: str, asked: str | None = None
) -> tuple[RedisProjectionStore, Record]:
    """A store taking snapshots (`track`) and keeping ended sessions `RETENTION`, with `sid`
    started, asked a question of reason `asked` (if given) and ended; the store and the ending."""
    store = dataclasses.replace(projection_store, track=True)
    log = PartitionedLog()
    log.started(sid)
    if asked is not None:
        ask(log, sid, "q1", reason=asked)  # type: ignore[arg-type]
    ending = log.ended(sid)
    store.retention = RETENTION
    _project(store, log.records)
    return store, ending


def test_an_ended_session_is_not_expired_before_a_snapshot_round_took_its_last_state(
    projection_store: RedisProjectionStore,
) -> None:
    """With snapshots taken, the sweep leaves an ended session in its partition's unsnapshotted
    index (a rebuild from snapshots would miss its last events); once a round took it, it goes."""
    store, ending = _ended_while_tracked(projection_store, "done")
    index = store.keys.unsnapshotted(ending.position.partition)
    assert store.client.zscore(index, "done") == 0
    later = ending.event.occurred_at + timedelta(days=1)
    assert store.expire_due(later) == []
    assert store.load("done") is not None
    store.client.zrem(index, "done")  # what a round's `snapped` does once its snapshot is acked
    assert store.expire_due(later) == []  # looked at again a minute later, not at each sweep
    assert store.expire_due(later + timedelta(minutes=1)) == ["done"]
    assert store.load("done") is None and store.expired("done") is not None


def test_a_session_waiting_for_its_snapshot_does_not_hold_back_those_due_after_it(
    projection_store: RedisProjectionStore,
) -> None:
    """The sweep reads the earliest due sessions first, a few at a time: one that may not go yet
    (its last state not in a snapshot, or too large for one) must not stall the rest."""
    store = dataclasses.replace(projection_store, track=True)
    ids = (f"s{n}" for n in itertools.count())
    one, other = next(ids), ""
    while partition_for(other := next(ids), PARTITIONS) != partition_for(one, PARTITIONS):
        pass  # two sessions of one partition: the sweep reads `limit` per partition
    log = PartitionedLog()
    log.started(one)
    first = log.ended(one)
    log.started(other)
    second = log.ended(other)
    store.retention = RETENTION
    _project(store, log.records)
    # The second one's snapshot was taken; the first one's was not.
    store.client.zrem(store.keys.unsnapshotted(second.position.partition), other)
    later = second.event.occurred_at + timedelta(days=1)
    assert store.expire_due(later, limit=1) == []  # the first, earliest due, may not go yet
    assert store.expire_due(later, limit=1) == [other]
    assert store.load(one) is not None and first.position.partition == second.position.partition


def test_an_expired_session_leaves_no_deadline_or_compaction_entry_behind(
    projection_store: RedisProjectionStore,
) -> None:
    """A session that ended with a timed question open keeps its deadline while projected; once
    the sweep dropped it, the scheduler must not read it again at every poll."""
    log = PartitionedLog()
    log.started("timed")
    ask(log, "timed", "q1", minutes=120, reason="permission")  # type: ignore[arg-type]
    ending = log.ended("timed")
    projection_store.retention = RETENTION
    _project(projection_store, log.records)
    p = ending.position.partition
    deadlines = projection_store.keys.deadlines(p)
    assert projection_store.client.zscore(deadlines, "timed") is not None
    assert projection_store.expire_due(ending.event.occurred_at + TTL) == ["timed"]
    assert projection_store.expired("timed") is not None
    assert projection_store.client.zscore(deadlines, "timed") is None
    assert not projection_store.client.sismember(projection_store.keys.compaction_due(p), "timed")


def test_the_sweep_retires_an_expired_session_with_its_counters_and_a_rebuild_brings_them_back(
    projection_store: RedisProjectionStore, secured: Settings
) -> None:
    """With snapshots taken, the sweep leaves a retired entry (its tombstone and what the session
    added to the fleet's counters) for the next snapshot round's stub; a rebuild restoring the
    stub writes the tombstone and adds the counters, once; a restore of the session forgets it."""
    store, ending = _ended_while_tracked(projection_store, "gone", asked="signature")
    p = ending.position.partition
    state = store.keys.session("gone", p).state
    own = {k.decode()[2:]: int(v) for k, v in store.client.hgetall(state).items() if k[:2] == b"c:"}
    assert own, "the session's own counters (kept while snapshots are taken)"
    stats = {k: v for k, v in dump(store).items() if ":stats:" in k}
    store.client.zrem(store.keys.unsnapshotted(p), "gone")  # its last state is in a snapshot
    assert store.expire_due(ending.event.occurred_at + TTL) == ["gone"]
    tombstone = store.expired("gone")
    assert tombstone is not None and tombstone.mark == ending.position
    cursor, entries = asyncio.run(_retired_page(store, secured, p))
    found = [parse_retired(raw, sid) for sid, raw in entries]
    assert (cursor, found) == (0, [Retired(tombstone, own)])

    # A rebuild restores the stub into cleared keys: the tombstone, and the counters once.
    store.clear()
    assert store.restore_retired(found) == []
    assert store.expired("gone") == tombstone and store.load("gone") is None
    assert {k: v for k, v in dump(store).items() if ":stats:" in k} == stats
    assert store.restore_retired(found) == ["gone"]  # a second time: refused, nothing added
    assert {k: v for k, v in dump(store).items() if ":stats:" in k} == stats

    # A restore (`replay --session`) drops the session: its retired entry goes with the rest;
    # its tombstone stays for the restore's own first commit to take away (a worker's commit
    # meanwhile finds it expired, and writes nothing).
    store.client.hset(store.keys.retired(p), "gone", "1 0:1 {}")
    store.drop("gone", restoring=True)
    assert store.client.hlen(store.keys.retired(p)) == 0 and store.expired("gone") == tombstone


def test_a_retired_session_without_counters_reads_back_with_none(
    projection_store: RedisProjectionStore, secured: Settings
) -> None:
    """An empty Lua table, as the script's cjson writes it, reads back as no counters; and the
    round's delete takes only the entry it read."""
    store, ending = _ended_while_tracked(projection_store, "bare")
    p = ending.position.partition
    state = store.keys.session("bare", p).state
    own = [k for k in store.client.hkeys(state) if k[:2] == b"c:"]
    if own:
        store.client.hdel(state, *own)
    store.client.zrem(store.keys.unsnapshotted(p), "bare")
    assert store.expire_due(ending.event.occurred_at + TTL) == ["bare"]
    _, entries = asyncio.run(_retired_page(store, secured, p))
    ((sid, raw),) = entries
    assert raw.endswith(" {}") and parse_retired(raw, sid).counters == {}

    async def unretire(entries: list[tuple[str, str]]) -> None:
        async with _worker_store(store, secured) as worker:
            await worker.unretire(p, entries)

    asyncio.run(unretire([(sid, raw + " ")]))  # not the entry as stored: it stays
    assert store.client.hlen(store.keys.retired(p)) == 1
    asyncio.run(unretire([(sid, raw)]))
    assert store.client.hlen(store.keys.retired(p)) == 0


def test_without_snapshots_the_sweep_leaves_no_retired_entry(
    projection_store: RedisProjectionStore,
) -> None:
    log = PartitionedLog()
    log.started("gone")
    ending = log.ended("gone")
    projection_store.retention = RETENTION
    _project(projection_store, log.records)
    assert projection_store.expire_due(ending.event.occurred_at + TTL) == ["gone"]
    assert (
        projection_store.client.hlen(projection_store.keys.retired(ending.position.partition)) == 0
    )


def _worker_store(
    store: RedisProjectionStore, settings: Settings
) -> contextlib.AbstractAsyncContextManager[AsyncRedisProjectionStore]:
    """A worker's asyncio store on the same Redis (or Redis Cluster) and keys as `store`."""

    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[AsyncRedisProjectionStore]:
        if isinstance(store.client, SyncCluster):
            nodes = store.client.get_nodes()  # type: ignore[no-untyped-call]
            client = async_client(f"redis://{nodes[0].host}:{nodes[0].port}/0", cluster=True)
        else:
            client = async_client(settings.redis_url, auth=settings.redis_auth())
        try:
            yield AsyncRedisProjectionStore(client, store.keys)
        finally:
            await client.aclose()

    return opened()


async def _retired_page(
    store: RedisProjectionStore, settings: Settings, partition: int
) -> tuple[int, list[tuple[str, str]]]:
    """The worker's read of a partition's retired entries (its asyncio store), from cursor 0."""
    async with _worker_store(store, settings) as worker:
        return await worker.retired(partition)


def test_the_worker_s_sweep_leaves_a_session_whose_last_batch_is_not_settled(
    projection_store: RedisProjectionStore, secured: Settings
) -> None:
    """Its last batch's decisions may not be published yet (a worker killed between the commit
    and their acks): dropped first, the redelivery would find a tombstone and publish nothing.
    The drop script compares its last event's offset with the partition's settled offset."""
    store = projection_store
    log = PartitionedLog()
    log.started("late")
    ending = log.ended("late")
    store.retention = RETENTION
    _project(store, log.records)
    p, offset = ending.position.partition, ending.position.offset
    later = ending.event.occurred_at + timedelta(days=1)

    async def sweep(settled: int, now: datetime) -> list[str]:
        async with _worker_store(store, secured) as worker:
            return await worker.expire_due({p: settled}, now)

    assert asyncio.run(sweep(offset, later)) == []  # its own record is not settled yet
    assert store.load("late") is not None and store.expired("late") is None
    assert asyncio.run(sweep(offset + 1, later)) == []  # looked at again a minute later
    assert asyncio.run(sweep(offset + 1, later + timedelta(minutes=1))) == ["late"]
    assert store.load("late") is None and store.expired("late") is not None


# -- end to end: a worker indexes, a sweep expires, `show` says so, `replay --session` restores --

TTL_S = 3600.0


def _event(sid: str, n: int, type_: str, payload: dict[str, Any], at: datetime) -> Event:
    return Event(f"{sid}-e{n}", sid, type_, at, "it-agent", payload)


def _run(settings: Settings, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=settings.to_env())
    return result.exit_code, result.output


def _sweep(settings: Settings, now: datetime) -> list[str]:
    """The worker's sweep (`RetentionSweep` on the asyncio store), at a clock of the test's."""

    async def run() -> list[str]:
        client = async_client(settings.redis_url, auth=settings.redis_auth())
        try:
            store = AsyncRedisProjectionStore(client, settings.redis_keys())
            # Every record read settled (the test's worker has published what they made).
            settled = dict.fromkeys(range(settings.partitions), 2**62)
            return await RetentionSweep(store.expire_due, lambda: settled).sweep(now)
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_an_ended_session_expires_shows_how_to_restore_and_comes_back_whole(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    ttl = with_keys(settings, projection_ttl_s=TTL_S)
    start_worker(with_keys(ttl, snapshot_interval_s=0.2))  # rounds take the ended session soon
    now = datetime.now(UTC)
    now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # what the wire carries
    done, live = "ret-done", "ret-live"
    events = [
        _event(done, 1, ev.STARTED, {"goal": "ship the report", "mode": "ask"}, now),
        _event(done, 2, ev.TURN, {"role": "user", "content": "write it"}, now),
        _event(done, 3, ev.TOOL_CALLED, {"tool": "make", "result": "ok"}, now),
        _event(done, 4, ev.ENDED, {"because": "shipped"}, now),
        _event(live, 1, ev.STARTED, {"goal": "wait for a human", "mode": "ask"}, now),
    ]
    positions = [kafka_log.append(e) for e in events]
    asked = kafka_log.append(
        _event(
            live,
            2,
            ev.QUESTION_ASKED,
            {"question_id": "q1", "question": "deploy?", "reason": "permission"},
            now,
        )
    )
    assert projections.load(done, at_least=positions[3], timeout=60) is not None
    assert projections.load(live, at_least=asked, timeout=60) is not None
    assert projections.fleet() == {("ended", "ask"): 1, ("waiting", "ask"): 1}
    p = partition_for(done, settings.partitions)
    retention = projections.keys.retention(p)
    deadline_ms = int(projections.client.zscore(retention, done))
    assert deadline_ms == ceil_ms(now) + int(TTL_S * 1000)  # the ending's occurred_at + TTL

    assert _sweep(settings, now + timedelta(seconds=TTL_S / 2)) == []
    # Not before a snapshot round took its last state (then it leaves the unsnapshotted index).
    index = projections.keys.unsnapshotted(p)
    wait_for(lambda: projections.client.zscore(index, done) is None, timeout=30)
    assert _sweep(settings, now + timedelta(seconds=2 * TTL_S)) == [done]

    assert projections.client.exists(*projections.keys.session(done).every()) == 0
    assert projections.client.zscore(retention, done) is None
    assert projections.ids() == [live]
    assert projections.fleet() == {("waiting", "ask"): 1}
    assert projections.waiting_by_reason() == {"permission": 1}
    assert [w.session_id for w in projections.waiting().items] == [live]
    tombstone = projections.expired(done)
    assert tombstone is not None and tombstone.mark == positions[3]

    code, out = _run(ttl, "show", done)
    assert code == 2
    (line,) = out.strip().splitlines()
    assert line.startswith(f"error: session '{done}' ended and its projection expired at ")
    assert line.endswith(f"restore it with `milpa-sessions replay --session {done}`")
    code, out = _run(ttl, "show", "ret-never")
    assert (code, out.strip()) == (2, "error: no session 'ret-never'")

    restoring = datetime.now(UTC)
    code, out = _run(ttl, "replay", "--session", done, "--force")
    assert code == 0, out
    assert projections.expired(done) is None
    assert_projection_matches(projections, expected_projections(events[:4], TrustedKeys.none()))
    assert projections.load(done) == fold(done, events[:4])
    assert projections.fleet() == {("ended", "ask"): 1, ("waiting", "ask"): 1}
    assert projections.waiting_by_reason() == {"permission": 1}
    # Kept a TTL from the restore: the next sweep leaves it.
    assert int(projections.client.zscore(retention, done)) >= ceil_ms(restoring) + int(TTL_S * 1000)
    assert _sweep(settings, restoring + timedelta(seconds=TTL_S / 2)) == []
    code, out = _run(ttl, "--json", "show", done)
    assert code == 0 and json.loads(out)["status"] == "ended"


def test_the_workers_own_sweep_expires_an_ended_session(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    """The worker runs the sweep in its loop for its partitions (TTL 1 s: a sweep a second)."""
    start_worker(with_keys(settings, projection_ttl_s=1.0, snapshot_interval_s=0.2))
    long_ago = datetime.now(UTC) - timedelta(minutes=5)
    sid = "ret-swept"
    kafka_log.append(_event(sid, 1, ev.STARTED, {"goal": "g", "mode": "ask"}, long_ago))
    kafka_log.append(_event(sid, 2, ev.ENDED, {"because": "done"}, long_ago))
    wait_for(lambda: projections.expired(sid) is not None, timeout=60)
    assert projections.load(sid) is None and projections.fleet() == {}
