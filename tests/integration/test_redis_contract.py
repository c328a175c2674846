"""The ProjectionStore contract (tests/contract_projection.py) run against the real Redis store.

The same contract class `tests/unit/test_projection_contract.py` runs against the in-memory store;
here every test gets a fresh, empty `RedisProjectionStore` under a key prefix of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from milpa_sessions.settings import Settings
from projections.codec import DEFLATED, session_to_blob, summary_to_stored
from projections.keys import Keys
from projections.layout import STATE_INLINE, stored_sizes
from projections.redis_client import SyncCluster, async_client
from projections.redis_store import AsyncRedisProjectionStore, RedisProjectionStore
from projections.requests import COMMIT_GROUP, Durability
from projections.sign_ins import RedisSignInFailures
from projections.sign_outs import RedisSignOuts
from schemas import events as ev
from schemas.errors import ProjectionError, ReplicationLagError
from schemas.events import Event
from session_model.dedupe import CHUNK, HORIZON, KEPT
from session_model.fold import fold
from session_model.projection import BatchFolder, Folded, Position, Record
from session_model.session import HISTORY_KINDS
from tests.contract_projection import ProjectionStoreContract
from tests.contract_waiting import WaitingIndexContract
from tests.integration.conftest import damage_state

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, tzinfo=UTC)
# 1,500 random characters: a state holding them stays longer than STATE_INLINE once deflated.
_NOISE = base64.b85encode(random.Random(0).randbytes(1200)).decode()


_ON_THE_CLUSTER = (pytest.mark.plain_stack, pytest.mark.redis_cluster)


@pytest.fixture(params=["single", pytest.param("cluster", marks=_ON_THE_CLUSTER)])
def projection_store(
    request: pytest.FixtureRequest, secured: Settings
) -> Iterator[RedisProjectionStore]:
    """A Redis projection store under a unique prefix, empty before and after the test: on the
    single Redis, and on the Redis Cluster (plain stack only: `up --secure` starts none)."""
    keys = Keys(f"itc{uuid.uuid4().hex[:10]}", partitions=1)
    if request.param == "cluster":
        url = request.getfixturevalue("redis_cluster_url")
        store = RedisProjectionStore.from_url(url, keys, cluster=True)
    else:
        store = RedisProjectionStore.from_url(secured.redis_url, keys, auth=secured.redis_auth())
    store.clear()
    yield store
    store.clear()
    store.client.close()


class TestRedisProjectionStoreContract(ProjectionStoreContract):
    """Every contract test against `RedisProjectionStore`."""


class TestRedisWaitingIndexContract(WaitingIndexContract):
    """The waiting index's contract against `RedisProjectionStore` (kept by the commit script)."""


def test_the_contract_prefix_is_isolated(projection_store: RedisProjectionStore) -> None:
    """The fixture's store starts empty and its keys live under its own prefix only."""
    assert projection_store.ids() == []
    assert projection_store.keys.prefix.startswith("itc")
    assert list(projection_store.client.scan_iter(match=projection_store.keys.pattern())) == []


# -- the layout: what only the Redis store promises ----------------------------------------------


def _commit(store: RedisProjectionStore, records: list[Record], size: int) -> None:
    """Commit `records` in batches of `size`, as a worker with a cache would."""
    known = store.folded(list(dict.fromkeys(r.event.session_id for r in records)))
    for i in range(0, len(records), size):
        updates = BatchFolder().fold(known, records[i : i + size])
        assert not store.commit(updates).conflicts
        known.update({u.session_id: Folded(u.state, u.mark) for u in updates})


def _records(sid: str, specs: list[tuple[str, dict[str, Any]]]) -> list[Record]:
    return [
        Record(
            Event(
                event_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{sid}/{i}")),
                session_id=sid,
                type=type_,
                occurred_at=T0 + timedelta(seconds=i),
                producer="layout-test",
                payload=payload,
            ),
            Position(0, i),
        )
        for i, (type_, payload) in enumerate(specs)
    ]


def _idle(sid: str) -> list[Record]:
    return _records(
        sid,
        [
            (ev.STARTED, {"goal": "goal of session 0: migrate module 0", "mode": "ask"}),
            (ev.PLAN_SET, {"plan": "plan 0: read, change, test"}),
            (ev.TODO_CHANGED, {"id": "t1", "text": "read the module", "status": "pending"}),
        ],
    )


def _plan(sid: str, plan: str, offset: int) -> Record:
    """A `plan_set` of `sid` at offset `offset` of partition 0."""
    event = Event(
        event_id=str(uuid.uuid4()),
        session_id=sid,
        type=ev.PLAN_SET,
        occurred_at=T0,
        producer="layout-test",
        payload={"plan": plan},
    )
    return Record(event, Position(0, offset))


def _busy(sid: str, n: int) -> list[Record]:
    specs: list[tuple[str, dict[str, Any]]] = [(ev.STARTED, {"goal": "g", "mode": "ask"})]
    for i in range(n):
        if i % 2:
            specs.append((ev.TURN, {"role": "user", "content": f"turn {i} 🙂\n" * 3}))
        else:
            specs.append((ev.TODO_CHANGED, {"id": f"t{i}", "text": f"c{i}", "status": "pending"}))
    return _records(sid, specs)


def _compacted(sid: str, n: int) -> list[Record]:
    """A session of `n` turns compacted through its turn n - 5, with a long summary."""
    facts = ",".join(f'{{"tool":"make","result":"step {i}: ok","seq":{i}}}' for i in range(n))
    return _records(
        sid,
        [
            (ev.STARTED, {"goal": "g", "mode": "ask"}),
            *[(ev.TURN, {"role": "user", "content": f"turn {i}"}) for i in range(n)],
            (ev.COMPACTED, {"summary": f"Goal: g 🙂\n\nfacts:\n[{facts}]", "through": n - 5}),
        ],
    )


def _raw(store: RedisProjectionStore, sid: str) -> dict[str, Any]:
    """Every key of one session, by kind of key, with its whole value."""
    c, out = store.client, {}
    names = ("state", "turns", "timeline", "ids", *(f"h:{k}" for k in HISTORY_KINDS))
    for name, key in zip(names, store.keys.session(sid).every(), strict=True):
        kind = c.type(key).decode()
        if kind == "hash":
            out[name] = (kind, c.object("encoding", key), dict(sorted(c.hgetall(key).items())))
        elif kind == "list":
            out[name] = (kind, c.lrange(key, 0, -1))
        elif kind == "string":
            out[name] = (kind, c.get(key))
    return out


def _values(store: RedisProjectionStore, sid: str) -> dict[str, Any]:
    return {name: (v[0], v[-1]) for name, v in _raw(store, sid).items()}


def test_an_idle_session_is_one_small_listpack_hash(
    projection_store: RedisProjectionStore,
) -> None:
    sid = str(uuid.uuid4())
    _commit(projection_store, _idle(sid), 3)
    raw = _raw(projection_store, sid)
    assert list(raw) == ["state"]
    _, encoding, fields = raw["state"]
    assert encoding == b"listpack"
    assert sorted(fields) == [b"f", b"i1", b"mark", b"n", b"s1", b"s2", b"t1", b"t2"]
    # 2 chunks of state, 1 of event ids (3 UUIDs: 48 bytes), 2 of timeline entries, and the
    # session's entry in its partition's fleet counts
    assert fields[b"n"] == b"212" and len(fields[b"i1"]) == 48
    assert fields[b"f"] == b"ra"  # running, ask
    held = stored_sizes(fields)
    assert held["fields"] == 8 and held["event_ids"] == 48 and held["timeline_entries"] == 2
    assert 63 < held["state"] <= 126 and 63 < held["timeline"] <= 126
    used = projection_store.client.memory_usage(projection_store.keys.session(sid).state, samples=0)
    # A cluster node also links every key into its slot's index: 16 bytes more per key.
    assert used is not None and used <= (
        456 if isinstance(projection_store.client, SyncCluster) else 440
    )
    keys = sorted(projection_store.client.scan_iter(match=projection_store.keys.pattern()))
    shared = (  # and the partition's generation hash (its highest offset committed)
        projection_store.keys.stat("events", 0),
        projection_store.keys.fleet_counts(0),
        projection_store.keys.generation_key(0),
    )
    assert keys == sorted(  # the session's one key, and the counters shared by all
        k.encode() for k in (projection_store.keys.session(sid).state, *shared)
    )


def test_a_busy_session_is_spread_over_keys_of_its_own(
    projection_store: RedisProjectionStore,
) -> None:
    sid = "busy"
    records = _busy(sid, 30)
    _commit(projection_store, records, 4)
    raw = _raw(projection_store, sid)
    assert [(k, v[0]) for k, v in raw.items()] == [
        ("state", "hash"),
        ("turns", "list"),
        ("timeline", "list"),
        ("ids", "list"),
    ]
    fields = raw["state"][2]
    assert sorted(fields) == [b"f", b"mark", b"n", b"s"]
    assert fields[b"n"] == b"wxx15"  # whole state, ids and timeline apart, 15 unsummarised turns
    assert [len(group) for group in raw["ids"][1]] == [16 * len(records)]  # one dedupe chunk
    assert projection_store.load(sid) == fold(sid, [r.event for r in records])


def test_a_long_session_keeps_only_the_recent_ids(projection_store: RedisProjectionStore) -> None:
    """The id list holds the dedupe window's chunks only: the current one and KEPT full ones."""
    sid = "long"
    records = _busy(sid, HORIZON + 2 * CHUNK + 10)
    _commit(projection_store, records, 50)
    groups = _raw(projection_store, sid)["ids"][1]
    assert [len(g) for g in groups] == [16 * CHUNK] * KEPT + [16 * 11]
    state = projection_store.load(sid)
    assert state == fold(sid, [r.event for r in records])
    assert state is not None and len(state.event_ids) == KEPT * CHUNK + 11


@pytest.mark.parametrize("size", [1, 2, 7, 100])
def test_the_layout_does_not_depend_on_the_batches(secured: Settings, size: int) -> None:
    """A rebuild in other batches gives byte-identical keys (the replay test compares dumps)."""
    sessions = {
        "idle": _idle("idle"),
        "busy": _busy("busy", 40),
        "edge": _busy("edge", 15),  # 16 ids: exactly the inline bound
        "long": _busy("long", HORIZON + CHUNK + 3),  # the id list trimmed
        "facts": _records(
            "facts",
            [
                (ev.STARTED, {"goal": "g", "mode": "ask"}),
                *[(ev.TOOL_CALLED, {"tool": "make", "result": f"r{i}"}) for i in range(80)],
                (ev.QUESTION_ASKED, {"question_id": "q", "question": "?"}),
                (ev.QUESTION_ANSWERED, {"question_id": "q", "answer": "yes"}),
                (ev.QUESTION_ANSWERED, {"question_id": "q", "answer": "late"}),
            ],
        ),
        "compacted": _compacted("compacted", 50),
        "deflated": _records(
            "deflated",
            [
                (ev.STARTED, {"goal": "g", "mode": "ask"}),
                (ev.PLAN_SET, {"plan": "p" * 2000}),  # deflated: back into chunks at once
                (ev.TODO_CHANGED, {"id": "t", "text": "x", "status": "pending"}),
            ],
        ),
        "big": _records(
            "big",
            [
                (ev.STARTED, {"goal": "g", "mode": "ask"}),
                (ev.PLAN_SET, {"plan": _NOISE}),  # the state is stored whole ...
                (ev.TODO_CHANGED, {"id": "t", "text": "x", "status": "pending"}),
                (ev.PLAN_SET, {"plan": "short"}),  # ... then in chunks again
            ],
        ),
    }
    stores = [
        RedisProjectionStore.from_url(
            secured.redis_url,
            Keys(f"itl{uuid.uuid4().hex[:10]}", partitions=1),
            auth=secured.redis_auth(),
        )
        for _ in range(2)
    ]
    try:
        for records in sessions.values():
            _commit(stores[0], records, len(records))
            _commit(stores[1], records, size)
        for sid, records in sessions.items():
            # The values, not Redis's encoding: a hash that once held a long value stays a
            # hashtable ("big" here, when its state had to be whole).
            assert _values(stores[1], sid) == _values(stores[0], sid), sid
            for store in stores:
                assert store.load(sid) == fold(sid, [r.event for r in records])
    finally:
        for store in stores:
            store.clear()
            store.client.close()


def test_a_long_summary_is_stored_deflated(projection_store: RedisProjectionStore) -> None:
    records = _compacted("c1", 60)
    _commit(projection_store, records, 7)
    stored = _raw(projection_store, "c1")["state"][2][b"m"]
    state = fold("c1", [r.event for r in records])
    assert state.summary is not None
    assert stored == summary_to_stored(state.summary) and stored[0] == DEFLATED
    assert len(stored) < len(state.summary.encode()) // 4
    assert projection_store.load("c1") == state


def test_an_old_sessions_state_is_stored_whole_and_deflated(
    projection_store: RedisProjectionStore,
) -> None:
    specs: list[tuple[str, dict[str, Any]]] = [(ev.STARTED, {"goal": "g", "mode": "ask"})]
    for i in range(60):
        artifact = {"artifact": f"file:src/m_{i % 37}.py"} if i % 3 == 0 else {}
        specs.append((ev.TOOL_CALLED, {"tool": "make", "result": f"step {i}: ok", **artifact}))
    records = _records("old", specs)
    _commit(projection_store, records, 9)
    fields = _raw(projection_store, "old")["state"][2]
    state = fold("old", [r.event for r in records])
    assert fields[b"n"][:1] == b"w" and fields[b"s"] == session_to_blob(state)
    assert fields[b"s"][1] == DEFLATED
    assert projection_store.load("old") == state


def test_the_big_state_goes_back_into_chunks(projection_store: RedisProjectionStore) -> None:
    records = _records(
        "s1",
        [
            (ev.STARTED, {"goal": "g", "mode": "ask"}),
            (ev.PLAN_SET, {"plan": "ü" + _NOISE}),
        ],
    )
    _commit(projection_store, records, 1)
    fields = _raw(projection_store, "s1")["state"][2]
    assert fields[b"n"][:1] == b"w" and b"s" in fields and b"s1" not in fields
    assert fields[b"s"][1] == DEFLATED and len(fields[b"s"]) > STATE_INLINE
    shorter = [*records, _plan("s1", "short", 2)]
    _commit(projection_store, shorter, 1)
    fields = _raw(projection_store, "s1")["state"][2]
    assert fields[b"n"][:1] == b"1" and b"s" not in fields and b"s1" in fields
    assert projection_store.load("s1") == fold("s1", [r.event for r in shorter])


def test_a_projection_of_another_layout_is_a_clear_error(
    projection_store: RedisProjectionStore,
) -> None:
    k = projection_store.keys.session("old")
    projection_store.client.hset(
        k.state, mapping={"mark": "0:3", "state": '{"v":1,"id":"old"}', "window": "0"}
    )
    with pytest.raises(ProjectionError, match="layout"):
        projection_store.load("old")
    with pytest.raises(ProjectionError, match="layout"):
        projection_store.timeline("old")
    sid = "new"
    _commit(projection_store, _idle(sid), 3)
    state_key = projection_store.keys.session(sid).state
    chunk = projection_store.client.hget(state_key, "s1")
    assert chunk is not None
    projection_store.client.hset(state_key, "s1", b"\x09" + chunk[1:])
    with pytest.raises(ProjectionError, match="layout 9"):
        projection_store.folded([sid])


def test_drop_removes_every_key_of_a_session(projection_store: RedisProjectionStore) -> None:
    _commit(projection_store, _busy("busy", 30), 5)
    _commit(projection_store, _idle("idle"), 3)
    projection_store.drop("busy")
    assert projection_store.ids() == ["idle"]
    assert _raw(projection_store, "busy") == {}
    assert projection_store.timeline("busy") == [] and projection_store.history("busy") == []


def test_clear_keeps_the_consoles_sign_outs_and_sign_in_counters_and_the_lease(
    projection_store: RedisProjectionStore,
) -> None:
    """A rebuild's clear deletes every projection (every generation, and their hashes), never
    what a rebuild of the log cannot bring back: a signed-out cookie stays refused."""
    store = projection_store
    _commit(store, _idle("idle"), 3)
    other = dataclasses.replace(store, keys=store.keys.in_generations((2,)), follow=False)
    assert not other.commit(BatchFolder().fold({}, _idle("left"))).conflicts  # a live rebuild's
    assert other.switch_generation(0, 0, 2) == 1
    sign_outs = RedisSignOuts(store.client, store.keys)
    sign_ins = RedisSignInFailures(store.client, store.keys)
    sign_outs.add("leaked", 3600)
    assert sign_ins.attempt("b1", 5, 60) == 0
    assert store.lease("token", 60_000, "take")
    try:
        store.clear()
        left = sorted(k.decode() for k in store.client.scan_iter(match=store.keys.pattern()))
        assert left == sorted(
            (
                store.keys.signed_out("leaked"),
                store.keys.sign_in_failures("b1"),
                store.keys.rebuild_lease(),
            )
        )
        assert store.ids() == [] and store.refresh_generations() == (0,)
        assert "leaked" in sign_outs
        assert store.client.get(store.keys.sign_in_failures("b1")) == b"1"
        assert store.rebuild_running()
    finally:
        store.client.delete(store.keys.signed_out("leaked"))
        store.client.delete(store.keys.sign_in_failures("b1"))
        store.client.delete(store.keys.rebuild_lease())


def test_a_commit_of_many_sessions_applies_each_alone_and_counts_only_those_applied(
    projection_store: RedisProjectionStore,
) -> None:
    """150 sessions go in three script calls; the three already applied conflict, wherever."""
    store = projection_store
    sids = [f"many-{i:03d}" for i in range(150)]
    updates = BatchFolder().fold({}, [r for sid in sids for r in _idle(sid)])
    stale = [3, 70, 140]  # one in each group of 64
    assert not store.commit([updates[i] for i in stale]).conflicts
    folded = store.keys.stat("events", 0)
    before = int(store.client.hget(folded, "folded"))

    result = store.commit(updates)

    assert result.conflicts == tuple(sids[i] for i in stale)
    assert result.applied == tuple(sid for i, sid in enumerate(sids) if i not in stale)
    assert int(store.client.hget(folded, "folded")) == before + 147 * 3
    stored = store.folded(sids)
    assert all(stored[u.session_id] == Folded(u.state, u.mark) for u in updates)


def test_a_read_of_many_sessions_returns_each_as_read_alone(
    projection_store: RedisProjectionStore, secured: Settings, request: pytest.FixtureRequest
) -> None:
    """Reads go 64 sessions per script call: every layout, and unknown ids, across the groups."""
    store = projection_store
    known: dict[str, list[Record]] = {}
    for i in range(100):
        sid = f"read-{i:03d}"
        known[sid] = _busy(sid, 40) if i % 7 == 0 else _idle(sid)
        _commit(store, known[sid], 50)
    big = _records("read-big", [(ev.STARTED, {"goal": "g", "mode": "ask"})])
    big.append(_plan("read-big", "ü" * 1500, 1))
    _commit(store, big, 2)
    known["read-big"] = big
    assert "ids" in _raw(store, "read-000") and "ids" not in _raw(store, "read-001")
    unknown = [f"unknown-{i}" for i in range(101)]
    asked = [sid for pair in zip(known, unknown, strict=True) for sid in pair]
    assert len(asked) == 202  # four calls, the last one short

    together = store.folded(asked)

    assert set(together) == set(known)
    for sid, records in known.items():
        assert together[sid] == store.folded([sid])[sid]
        assert together[sid].state == fold(sid, [r.event for r in records])

    async def read_async() -> dict[str, Folded]:
        async with _worker_store(store, secured, request) as worker:
            return await worker.folded(asked)

    assert asyncio.run(read_async()) == together


@contextlib.asynccontextmanager
async def _worker_store(
    store: RedisProjectionStore,
    secured: Settings,
    request: pytest.FixtureRequest,
    durability: Durability | None = None,
) -> AsyncIterator[AsyncRedisProjectionStore]:
    """The worker's asynchronous store over the same Redis (or cluster) and keys as `store`."""
    if isinstance(store.client, SyncCluster):
        client = async_client(request.getfixturevalue("redis_cluster_url"), cluster=True)
    else:
        client = async_client(secured.redis_url, auth=secured.redis_auth())
    try:
        if durability is None:
            yield AsyncRedisProjectionStore(client, store.keys)
        else:
            yield AsyncRedisProjectionStore(client, store.keys, durability=durability)
    finally:
        await client.aclose()


def test_a_workers_decisions_read_returns_the_latest_asked_for_or_every_one(
    projection_store: RedisProjectionStore, secured: Settings, request: pytest.FixtureRequest
) -> None:
    """A redelivery reads only the latest decisions it can need (`ReadDecisions.latest`)."""
    store = projection_store
    specs: list[tuple[str, dict[str, Any]]] = [(ev.STARTED, {"goal": "g", "mode": "ask"})]
    for n in range(40):
        specs += [
            (ev.QUESTION_ASKED, {"question_id": f"q{n}", "question": f"q{n}?"}),
            (ev.QUESTION_ANSWERED, {"question_id": f"q{n}", "answer": "yes"}),
        ]
    records = _records("dec-long", specs)
    _commit(store, records, 25)
    every = store.facts("dec-long").decisions
    assert [d.question_id for d in every] == [f"q{n}" for n in range(40)]

    async def read(latest: list[int] | None) -> dict[str, Any]:
        async with _worker_store(store, secured, request) as worker:
            return await worker.decisions(["dec-long", "dec-unknown"], latest)

    assert asyncio.run(read([3, 2])) == {"dec-long": every[-3:], "dec-unknown": ()}
    assert asyncio.run(read([500, 1]))["dec-long"] == every
    assert asyncio.run(read(None))["dec-long"] == every

    # A history entry that does not decode: the read fails, or a parking worker's leaves the
    # session out and names it (its partition then waits, the others go on).
    history = store.keys.session("dec-long").history[HISTORY_KINDS.index("decisions")]
    store.client.lset(history, -2, b"{not json")

    async def lenient(latest: list[int]) -> tuple[dict[str, Any], dict[str, str]]:
        bad: dict[str, str] = {}
        async with _worker_store(store, secured, request) as worker:
            with pytest.raises(ProjectionError, match="stored decisions cannot be read"):
                await worker.decisions(["dec-long"], latest[:1])
            found = await worker.decisions(["dec-long", "dec-unknown"], latest, unreadable=bad)
            return found, bad

    found, bad = asyncio.run(lenient([3, 2]))
    assert found == {"dec-unknown": ()} and set(bad) == {"dec-long"}
    assert "dec-long: the stored decisions cannot be read" in bad["dec-long"]
    assert asyncio.run(read([1, 1]))["dec-long"] == every[-1:]  # the entry is not read


def test_a_workers_read_puts_apart_what_does_not_decode_and_what_is_being_rebuilt(
    projection_store: RedisProjectionStore, secured: Settings, request: pytest.FixtureRequest
) -> None:
    """A parking worker's read leaves out, and names, a state that does not decode and one a
    `replay --session` is rebuilding (its mark read in the same round trip): what it finds is
    whole, which is what lets a parked partition go on."""
    store = projection_store
    for sid in ("fine", "damaged", "rebuilding"):
        _commit(store, _idle(sid), 3)
    damage_state(store, "damaged")
    restore = store.begin_restore("rebuilding", datetime.now(UTC))
    asked = ["fine", "damaged", "rebuilding", "unknown"]

    async def read(
        unreadable: dict[str, str], rebuilding: set[str]
    ) -> tuple[dict[str, Folded], dict[str, Folded]]:
        async with _worker_store(store, secured, request) as worker:
            found = await worker.folded(asked, unreadable=unreadable, rebuilding=rebuilding)
            with pytest.raises(ProjectionError, match="layout 9"):
                await worker.folded(["fine", "damaged"])
            return found, await worker.folded(["rebuilding"], unreadable={}, rebuilding=set())

    bad: dict[str, str] = {}
    rebuilding: set[str] = set()
    found, marked = asyncio.run(read(bad, rebuilding))
    assert set(found) == {"fine"} and found["fine"] == store.folded(["fine"])["fine"]
    assert set(bad) == {"damaged", "rebuilding"} and rebuilding == {"rebuilding"}
    assert "layout 9" in bad["damaged"] and "half rebuilt" in bad["rebuilding"]
    assert marked == {}
    store.end_restore("rebuilding", restore)
    bad, rebuilding = {}, set()
    found, marked = asyncio.run(read(bad, rebuilding))
    assert set(found) == {"fine", "rebuilding"} and set(marked) == {"rebuilding"}
    assert set(bad) == {"damaged"} and rebuilding == set()


def test_a_restore_keeps_the_tombstone_until_its_own_commit_takes_it_away(
    projection_store: RedisProjectionStore,
) -> None:
    """`replay --session` of an expired session: a worker's commit of it meanwhile (base none)
    still finds it expired and writes nothing; the restore's own commit applies and takes the
    tombstone away."""
    store = projection_store
    sid = next(f"tomb-{i}" for i in range(1000) if store.keys.partition_of(f"tomb-{i}") == 0)
    records = _idle(sid)  # (at partition 0: the partition the commits name)
    _commit(store, records, 3)
    store.drop(sid)
    store.client.hset(store.keys.expired(0), sid, "1700000000000 0:2")  # as the sweep leaves it
    assert store.expired(sid) is not None
    restore = store.begin_restore(sid, datetime.now(UTC))
    store.drop(sid, restoring=True)
    assert store.expired(sid) is not None  # kept for the restore's commit
    updates = BatchFolder().fold({}, records)
    assert store.commit(updates).expired == (sid,)  # a worker's: nothing written
    assert not store.client.exists(store.keys.session(sid).state)
    assert dataclasses.replace(store, restores=True).commit(updates).applied == (sid,)
    assert store.expired(sid) is None
    store.end_restore(sid, restore)
    assert store.load(sid) == fold(sid, [r.event for r in records])


def test_a_workers_read_waits_for_the_replicas_as_its_writes_do(
    projection_store: RedisProjectionStore, secured: Settings, request: pytest.FixtureRequest
) -> None:
    """A worker moves its offsets past events it finds applied: what it read must be replicated.

    Each master of the test cluster has one replica, the single Redis none: a read asking for
    one replica more than that comes back short, which shows the read did wait.
    """
    store = projection_store
    cluster = isinstance(store.client, SyncCluster)
    replicas = 1 if cluster else 0
    _commit(store, _idle("settled"), 5)

    async def read(durability: Durability) -> dict[str, Folded]:
        async with _worker_store(store, secured, request, durability) as worker:
            return await worker.folded(["settled"])

    assert set(asyncio.run(read(Durability(replicas, 2000)))) == {"settled"}
    with pytest.raises(ReplicationLagError, match=f"reached {replicas} of the {replicas + 1}"):
        asyncio.run(read(Durability(replicas + 1, timeout_ms=50, attempts=1)))
    assert set(store.folded(["settled"])) == {"settled"}  # readers (no durability) never wait


def test_a_partition_moved_to_a_new_generation_refuses_commits_in_the_old_one(
    projection_store: RedisProjectionStore,
) -> None:
    """The live rebuild's switch (lua/switch.lua) and the commit script's fence, in one slot."""
    worker = projection_store
    records = [*_idle("g"), _plan("g", "second plan", 3), _plan("g", "third plan", 4)]
    _commit(worker, records[:3], 3)  # the worker, in generation 0
    rebuild = dataclasses.replace(worker, keys=worker.keys.in_generations((1,)), follow=False)
    # The rebuild has folded less than the worker committed: the switch waits.
    rebuilt = BatchFolder().fold({}, records[:2])
    assert not rebuild.commit(rebuilt).conflicts
    assert rebuild.switch_generation(0, 0, 1) == 0
    # It catches up: the partition moves.
    caught = BatchFolder().fold({"g": Folded(rebuilt[0].state, rebuilt[0].mark)}, records[2:3])
    assert not rebuild.commit(caught).conflicts
    assert rebuild.switch_generation(0, 0, 1) == 1
    assert rebuild.switch_generation(0, 0, 1) == -1  # no longer in generation 0
    # The worker has not read the generations since: its next commit, in generation 0, is
    # refused whole, and it reads the generations again.
    known = {"g": Folded(caught[0].state, caught[0].mark)}
    update = BatchFolder().fold(known, records[3:4])
    assert worker.keys.generation(0) == 0
    worker._generations_at = time.monotonic()  # as if it had just read them
    result = worker.commit(update)
    assert result.conflicts == ("g",) and not result.applied
    assert worker.keys.generation(0) == 1
    # Folded again onto the new generation's state, it applies there.
    assert worker.folded(["g"]) == known
    assert worker.commit(update).applied == ("g",)
    assert worker.folded(["g"])["g"].mark == Position(0, 3)
    # Nothing reached generation 0 after the switch; dropping it leaves generation 1 whole.
    assert worker.drop_generation(0) > 0
    assert worker.folded(["g"])["g"].mark == Position(0, 3)
    assert worker.ids() == ["g"]


def test_a_workers_commit_names_one_generation_though_it_reads_them_again_meanwhile(
    projection_store: RedisProjectionStore, secured: Settings, request: pytest.FixtureRequest
) -> None:
    """A commit of more than one script call's worth of sessions builds its calls with pauses
    between them, where the worker's other work may read the generations again (a live rebuild
    moved the partition). Every call must name the generation its keys are in: the calls built
    before must not carry the new generation's number with the old generation's keys, which the
    fence would let through, writing where the rebuild is about to drop."""
    store = projection_store
    sids = [f"w{i:03d}" for i in range(COMMIT_GROUP + 6)]
    updates = BatchFolder().fold({}, [r for sid in sids for r in _idle(sid)])
    rebuild = dataclasses.replace(store, keys=store.keys.in_generations((1,)), follow=False)
    assert rebuild.switch_generation(0, 0, 1) == 1  # nothing committed yet: it moves at once

    async def commit() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        if isinstance(store.client, SyncCluster):
            client = async_client(request.getfixturevalue("redis_cluster_url"), cluster=True)
        else:
            client = async_client(secured.redis_url, auth=secured.redis_auth())
        worker = AsyncRedisProjectionStore(client, store.keys)  # still in generation 0
        worker._generations_at = time.monotonic()  # as if it had just read them

        async def read_again() -> None:  # what `refresh_generations` does once answered
            worker.keys = worker.keys.in_generations((1,))

        try:
            meanwhile = asyncio.ensure_future(read_again())
            first = await worker.commit(updates)
            await meanwhile
            second = await worker.commit(updates)
            return first.applied, first.conflicts, second.applied
        finally:
            await client.aclose()

    applied, conflicts, applied_again = asyncio.run(commit())
    # Refused whole (its keys are generation 0's), then applied in generation 1 once read again.
    assert applied == () and sorted(conflicts) == sids
    assert sorted(applied_again) == sids
    assert sorted(rebuild.folded(sids)) == sids
    old = dataclasses.replace(store, keys=store.keys.in_generations((0,)), follow=False)
    assert old.folded(sids) == {}  # nothing written in generation 0
