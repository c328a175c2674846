"""Snapshots on the real stack: the worker writes them, `replay` starts from them.

A rebuild from snapshots must give every session the state, indexes and counters a full rebuild
gives (its history lists from the snapshot on only: `projections.snapshots`), and survive a
worker killed while snapshotting and a corrupt or foreign snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench.infra import trusted_keys_dir
from deploy.harness import wait_for
from milpa_sessions import wiring
from milpa_sessions.cli import main
from milpa_sessions.settings import Settings
from processors.replay import CACHE_LIMIT, ReplayReport, _snapshot_ends, _snapshot_plan, replay
from processors.sinks import FencedSnapshotSink
from producers.kafka_log import KafkaEventLog
from projections.codec import STATE_VERSION, session_to_blob
from projections.redis_store import RedisProjectionStore
from projections.snapshots import (
    CHECKPOINT_KEY,
    checkpoint_key,
    checkpoint_record,
    plan,
    snapshot_record,
)
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.errors import LogError
from schemas.events import Event
from session_model.authority import Cutover, trust_fingerprint
from session_model.modes import Mode
from session_model.partitioning import partition_for
from session_model.projection import Position
from session_model.session import Session
from session_model.signing import TrustedKeys
from tests.integration.conftest import with_keys
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import (
    FAST_GROUP_ENV,
    assert_equals_the_fold,
    dump,
    generate,
    send_all,
    stats,
    wait_for_all,
)
from tests.unit.builders import OPERATOR, make_event, started, turn

pytestmark = pytest.mark.integration
# The trust of a fold that trusts no key, starts unsigned sessions in `ask`, has no cut-over: the
# workers' and the rebuilds' here, unless a test says otherwise.
NONE = trust_fingerprint(TrustedKeys.none(), Mode.ASK, Cutover())


def snapshot_records(
    settings: Settings,
) -> list[tuple[int, int, bytes | None, bytes | None]]:
    """Every record of the snapshots topic now: (partition, offset, key, value), in log order."""
    consumer = KafkaConsumer(
        **settings.kafka_access().kafka_python(),
        enable_auto_commit=False,
        isolation_level="read_committed",  # as `replay` reads it
    )
    try:
        parts = [
            TopicPartition(settings.snapshots_topic, p)
            for p in consumer.partitions_for_topic(settings.snapshots_topic) or ()
        ]
        assert parts, f"topic {settings.snapshots_topic} not in the metadata"
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        out: list[tuple[int, int, bytes | None, bytes | None]] = []
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < end for tp, end in ends.items()):
            assert time.monotonic() < deadline, "could not read the snapshots topic"
            for tp, messages in consumer.poll(timeout_ms=500).items():
                out.extend(
                    (tp.partition, m.offset, m.key, m.value)
                    for m in messages
                    if m.offset < ends[tp]
                )
        return out
    finally:
        consumer.close()


def checkpoints(settings: Settings) -> dict[int, int]:
    """partition -> the offset its latest checkpoint covers."""
    codec = EventCodec()
    out: dict[int, int] = {}
    for partition, _, key, value in snapshot_records(settings):
        if key is not None and key.startswith(CHECKPOINT_KEY) and value is not None:
            out[partition] = codec.decode_checkpoint(value)["offset"]
    return out


def rebuild(
    settings: Settings,
    *,
    snapshots: bool = True,
    keys: TrustedKeys | None = None,
    processes: int | None = None,
    cache_limit: int = CACHE_LIMIT,
) -> ReplayReport:
    """`replay` as the command runs it (its store), from the snapshots or the whole log, trusting
    `keys` (default: none, as the workers of `settings` do), in `processes` (default: replay's),
    each keeping at most `cache_limit` sessions' states."""
    store = wiring.projection_store_for_rebuild(settings)
    try:
        return replay(
            settings.kafka_access(),
            settings.events_topic,
            store,
            TrustedKeys.none() if keys is None else keys,
            snapshots_topic=settings.snapshots_topic if snapshots else None,
            processes=processes,
            cache_limit=cache_limit,
        )
    finally:
        store.client.close()


def fleet_wide(store: RedisProjectionStore) -> dict[str, Any]:
    """Every key that is not one session's own (counters, indexes, waiting questions), but the
    unsnapshotted index (a restored session is covered by its snapshot: not in it) and the
    generation hashes (each generation's highest offset committed: bookkeeping of the writers)."""
    return {
        k: v
        for k, v in dump(store).items()
        if "}:s:" not in k and not k.endswith(":unsnapshotted") and ":generation:{" not in k
    }


def assert_states_equal_the_fold(store: RedisProjectionStore, expected: dict[str, Any]) -> None:
    """Every session's state (what `load` returns, window and dedupe window included)."""
    differ = [sid for sid, exp in expected.items() if store.load(sid) != exp.state]
    assert not differ, f"{len(differ)} of {len(expected)} states differ: {differ[:5]}"


def wait_for_checkpoints(
    settings: Settings, partitions: int, timeout: float = 60
) -> dict[int, int]:
    """Wait until every partition has a checkpoint past offset 0."""
    deadline = time.monotonic() + timeout
    while True:
        found = checkpoints(settings)
        if len(found) == partitions and all(c > 0 for c in found.values()):
            return found
        assert time.monotonic() < deadline, f"checkpoints: {found}"
        time.sleep(0.3)


@pytest.mark.forks_in_process  # (see pyproject.toml)
def test_a_rebuild_from_snapshots_equals_the_full_rebuild_and_skips_what_they_cover(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    taking = with_keys(settings, snapshot_interval_s=0.3, snapshot_every=200)
    worker = start_worker(taking)
    sids, events = generate(600, prefix="n", group=100)
    expected = expected_projections(events, TrustedKeys.none())
    cut = len(events) * 2 // 3
    first = send_all(kafka_log, events[:cut])
    wait_for_all(projections, first, timeout=60, why="the first part", workers=(worker,))
    covered = wait_for_checkpoints(settings, settings.partitions)
    last = send_all(kafka_log, events[cut:])
    wait_for_all(projections, {**first, **last}, timeout=60, why="the rest", workers=(worker,))
    worker.stop()
    incremental = fleet_wide(projections)
    assert any(k.endswith(":stats:pauses") for k in incremental)

    projections.clear()
    report = rebuild(settings)
    assert report.ignored == {}
    assert report.restored > 0 and report.skipped >= sum(c + 1 for c in covered.values())
    assert report.records < len(events), "the rebuild read the whole log"
    assert report.applied_sessions == len(sids)
    assert_states_equal_the_fold(projections, expected)
    assert fleet_wide(projections) == incremental  # counters, waiting index, fleet counts
    # The history lists hold what came after the snapshot: the newest entries are the fold's.
    for sid in sids[::60]:
        history, exp = projections.history(sid), expected[sid].history
        assert history == exp[len(exp) - len(history) :], sid

    # A rebuild process keeps no restored state: each session with events after its snapshot is
    # read back from Redis. With a cache smaller than the sessions it folds, those it drops are
    # read back again when their next events come: the same result.
    projections.clear()
    again = rebuild(settings, cache_limit=10)
    assert (again.restored, again.records) == (report.restored, report.records)
    assert_states_equal_the_fold(projections, expected)
    assert fleet_wide(projections) == incremental

    # A corrupt snapshot, one of another layout and one whose state does not read (found only
    # when the rebuild's processes read their snapshots again to restore them) are ignored,
    # counted, and their sessions folded from the log (their partitions from offset 0): the
    # result is the same.
    codec = EventCodec()
    bad, foreign, garbled = sids[3], sids[7], sids[11]

    def latest_snapshot(sid: str) -> dict[str, Any]:
        return next(
            codec.decode_snapshot(v)
            for _, _, k, v in reversed(snapshot_records(settings))
            if k == sid.encode() and v is not None
        )

    record, garbled_record = latest_snapshot(foreign), latest_snapshot(garbled)
    unreadable = {**garbled_record, "state": bytes([STATE_VERSION]) + b"[not json"}
    producer = KafkaProducer(**settings.kafka_access().kafka_python(), acks="all")
    try:
        for sid, value in (
            (bad, b"\xc3\x01 not a snapshot"),
            (foreign, codec.encode_snapshot({**record, "layout": STATE_VERSION + 1})),
            (garbled, codec.encode_snapshot(unreadable)),
        ):
            partition = partition_for(sid, settings.partitions)
            producer.send(settings.snapshots_topic, value, sid.encode(), partition=partition)
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)
    projections.clear()
    report = rebuild(settings, processes=2)  # each process restores its partitions' snapshots
    assert report.ignored == {"corrupt": 1, "layout": 1, "unreadable": 1}
    whole = {partition_for(sid, settings.partitions) for sid in (bad, foreign, garbled)}
    assert report.skipped == sum(c + 1 for p, c in checkpoints(settings).items() if p not in whole)
    assert_states_equal_the_fold(projections, expected)
    assert fleet_wide(projections) == incremental
    for sid in (bad, garbled):
        assert projections.history(sid) == expected[sid].history  # folded whole
    projections.clear()
    assert rebuild(settings, processes=1) == dataclasses.replace(report, processes=1)

    # And the whole log, ignoring snapshots: every history list too.
    projections.clear()
    report = rebuild(settings, snapshots=False)
    assert (report.records, report.restored, report.skipped) == (len(events), 0, 0)
    assert_equals_the_fold(projections, expected)
    assert fleet_wide(projections) == incremental

    # What `replay` does after a full rebuild: snapshot everything it applied. The next rebuild
    # then reads no event at all, and still equals the fold. (With MILPA_PARTITIONS saying 3:
    # where the sessions' keys are depends on the topic's count, 6, as the rebuild used it.)
    misset = dataclasses.replace(settings, partitions=3)
    taken = wiring.take_snapshots(misset, report.applied_through(), report.trust)
    assert taken == len(sids)
    assert checkpoints(settings) == report.applied_through()
    projections.clear()
    report = rebuild(settings)
    assert (report.records, report.restored, report.ignored) == (0, len(sids), {})
    assert_states_equal_the_fold(projections, expected)
    assert fleet_wide(projections) == incremental


@pytest.mark.fault_load
def test_a_worker_killed_while_snapshotting_leaves_snapshots_a_rebuild_can_start_from(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in FAST_GROUP_ENV.items():
        monkeypatch.setenv(name, value)
    _, events = generate(2000, prefix="q", group=100)
    expected = expected_projections(events, TrustedKeys.none())
    # Rounds all the time (every 50 events of a partition), so the kill lands in or near one.
    taking = with_keys(settings, snapshot_interval_s=0.05, snapshot_every=50)
    worker = start_worker(with_keys(taking, commit_interval=60.0, commit_every=1_000_000))
    # Sent a chunk at a time, paced (about 4,000 events/s, below what a worker folds): whenever
    # it is killed, however fast it folds, the worker is folding sessions sent a moment before
    # and taking rounds of them, with more still to come.
    chunks = [events[i : i + 1_000] for i in range(0, len(events), 1_000)]
    last: dict[str, Position] = {}
    sent = 0
    deadline = time.monotonic() + 60
    # A third of the chunks sent, and a round done (its writer's start takes a moment), so the
    # kill lands among rounds with checkpoints behind it.
    while sent < len(chunks) // 3 or not checkpoints(settings):
        assert worker.alive(), worker.log()[-3000:]
        assert time.monotonic() < deadline, f"in 60 s: checkpoints {checkpoints(settings)}"
        assert sent < len(chunks) - 1, "no checkpoint before the last chunk: raise the events"
        last.update(send_all(kafka_log, chunks[sent]))
        sent += 1
        time.sleep(0.25)
    worker.kill9()
    for chunk in chunks[sent:]:
        last.update(send_all(kafka_log, chunk))
    restarted = start_worker(taking)
    wait_for_all(projections, last, timeout=90, why="after the restart", workers=(restarted,))
    restarted.stop()
    pauses_live = stats(projections, "pauses")

    projections.clear()
    report = rebuild(settings)
    assert report.ignored == {}
    assert report.restored > 0 and report.skipped > 0
    assert_states_equal_the_fold(projections, expected)
    pauses: dict[str, int] = {}
    for exp in expected.values():
        for reason, n in exp.state.pauses.items():
            pauses[reason] = pauses.get(reason, 0) + n
    assert stats(projections, "pauses") == pauses == pauses_live  # nothing counted twice


def test_the_rebuild_plan_of_the_topic_names_every_session_once(settings: Settings) -> None:
    """Nothing snapshotted yet: every partition from offset 0, nothing restored."""
    got = plan(snapshot_records(settings), range(settings.partitions), EventCodec(), trust=NONE)
    assert got.starts == dict.fromkeys(range(settings.partitions), 0)
    assert got.restored_count() == 0 and not got.ignored


def test_a_writer_that_lost_its_partition_cannot_land_an_older_snapshot_after_the_new_owners(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A zombie (a worker that lost the partition but still runs) read a session at offset 40
    and publishes late, after the new owner's round wrote the session at offset 90 and a
    checkpoint at 95. Compaction keeps a key's last record: had the zombie's landed last, a
    rebuild would restore the session at 40 and start the partition at 96, skipping 41..95."""
    codec = EventCodec()
    sid = "zombie-target"
    sink = FencedSnapshotSink(settings.kafka_access(), settings.snapshots_topic)

    def snapshot(offset: int) -> tuple[bytes, bytes]:
        state = session_to_blob(Session(sid))
        raw = (state, f"0:{offset}".encode(), [], [], None, {}, None)
        return sid.encode(), codec.encode_snapshot(snapshot_record(sid, raw, 0, trust=NONE))

    def checkpoint(offset: int) -> tuple[bytes, bytes]:
        record = checkpoint_record(0, offset, 0, trust=NONE)
        return checkpoint_key(0), codec.encode_checkpoint(record)

    async def rounds() -> None:
        async with sink.fenced(0) as zombie:  # its round began (and read) first
            async with sink.fenced(0) as owner:  # the new owner's round, after the rebalance
                await owner.publish([snapshot(90)])
                await owner.publish([checkpoint(95)])
            with pytest.raises(LogError, match="fenced"):
                await zombie.publish([snapshot(40)])
        async with sink.fenced(0) as owner:
            await owner.publish([snapshot(120)])
        # A round killed after it sent, before it committed (a worker killed mid-round): the
        # next writer's opening aborts it, which leaves the partition ending in aborted records.
        async with sink.fenced(0) as killed:
            await killed.producer.begin_transaction()
            await (await killed.producer.send(settings.snapshots_topic, b"x", b"k", partition=0))
            async with sink.fenced(0):
                pass

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(rounds())
        gc.collect()  # an unretrieved failed future logs when it is collected
    # The fenced round failed through `publish` alone: aiokafka's own futures it failed with it
    # were retrieved, and logged nothing.
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    records = [(k, v) for _, _, k, v in snapshot_records(settings)]
    assert [codec.decode_snapshot(v)["offset"] for k, v in records if k == sid.encode() and v] == [
        90,
        120,
    ]  # the zombie's record was never committed: readers never see it
    assert all(k != b"k" for k, _ in records)  # nor the killed round's
    # The rebuild's plan reads the partition to its end, past the aborted records.
    # (The snapshots were written by hand: as if the events topic's partition 0 held 1,000.)
    access = settings.kafka_access()
    topic = settings.snapshots_topic
    ends = _snapshot_ends(access, topic)
    plan = _snapshot_plan(access, topic, ends, {0: 1_000}, codec, session_id=None, trust=NONE)
    assert plan.sessions[0][sid].mark == 120 and plan.starts[0] == 96


def test_a_snapshot_folded_under_a_key_no_longer_trusted_does_not_bring_its_grants_back(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
    tmp_path: Path,
) -> None:
    """The workers trust the operator's key K and snapshot what they fold, grants K signed and
    all. K is then removed (compromised): a rebuild that trusts it no more folds the log, where
    those grants are `unauthorized`, instead of restoring them from the snapshots (which name
    the trust they were folded under), whether or not any snapshot was taken since."""
    sids, events = generate(60, prefix="k", group=20)
    # A session whose grant, signed by K, stands to the end where K is trusted.
    kept = [
        started("deploy when allowed", session_id="k-granted", event_id="k-granted-1"),
        make_event(
            ev.PERMISSION_GRANTED,
            {"operation": "deploy"},
            session_id="k-granted",
            event_id="k-granted-2",
        ),  # signed by OPERATOR, K
        turn("assistant", "deploying", session_id="k-granted", event_id="k-granted-3"),
    ]
    sids, events = sorted([*sids, "k-granted"]), [*events, *kept]
    trusting = OPERATOR.trusted_keys()
    with_k = expected_projections(events, trusting)
    without_k = expected_projections(events, TrustedKeys.none())
    granted = [
        sid for sid in sids if with_k[sid].state.permissions != without_k[sid].state.permissions
    ]
    assert granted == ["k-granted"]
    assert with_k["k-granted"].state.permissions == ("deploy",)
    last = send_all(kafka_log, events)
    taking = with_keys(
        settings,
        trusted_keys_dir=trusted_keys_dir(tmp_path, OPERATOR),
        snapshot_interval_s=0.3,
        snapshot_every=50,
    )
    worker = start_worker(taking)
    wait_for_all(projections, last, timeout=60, why="the fold under K", workers=(worker,))
    assert_states_equal_the_fold(projections, with_k)
    ends: dict[int, int] = {}
    for position in last.values():
        ends[position.partition] = max(ends.get(position.partition, -1), position.offset)
    deadline = time.monotonic() + 60
    while any(checkpoints(settings).get(p, -1) < end for p, end in ends.items()):
        assert time.monotonic() < deadline, f"checkpoints {checkpoints(settings)}, ends {ends}"
        time.sleep(0.3)  # every session snapshotted
    worker.stop()
    # Every session of the rebuild under the same trust comes from its snapshot, K's grants too.
    projections.clear()
    report = rebuild(settings, keys=trusting)
    assert (report.restored, report.ignored) == (len(sids), {})
    assert_states_equal_the_fold(projections, with_k)

    # K removed (and no snapshot taken since): the grant K signed is gone (it came back from
    # its snapshot before they named their trust), and so is every other act K signed. Nothing
    # is restored; each snapshot and checkpoint is counted.
    projections.clear()
    report = rebuild(settings)
    state = projections.load("k-granted")
    assert state is not None and state.permissions == ()
    assert [r.code for r in state.rejections] == ["unauthorized"]
    assert_states_equal_the_fold(projections, without_k)
    assert report.restored == 0 and report.skipped == 0
    assert report.ignored == {"trust": len(sids) + len(ends)}  # snapshots, checkpoints

    # `replay` snapshots what it rebuilt under its own trust: the next rebuild starts from those,
    # and one that trusts K again folds the log once more.
    assert wiring.take_snapshots(settings, report.applied_through(), report.trust) == len(sids)
    projections.clear()
    report = rebuild(settings)
    assert (report.records, report.restored, report.ignored) == (0, len(sids), {})
    assert_states_equal_the_fold(projections, without_k)
    projections.clear()
    report = rebuild(settings, keys=trusting)
    assert report.restored == 0 and report.ignored == {"trust": len(sids) + len(ends)}
    assert_states_equal_the_fold(projections, with_k)


def test_a_session_a_restore_left_half_built_is_not_snapshotted(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    """A snapshot of it would be restored by the next rebuild as if whole: it stays in its
    partition's unsnapshotted index, and the checkpoint below it, until a restore ends."""
    sids, events = generate(120, prefix="hb", group=20)
    send_all(kafka_log, events)
    report = rebuild(settings, snapshots=False)
    half = sids[0]
    p = partition_for(half, settings.partitions)
    mark = projections.begin_restore(half, datetime.now(UTC))
    taken = wiring.take_snapshots(settings, report.applied_through(), report.trust)
    assert taken == len(sids) - 1
    assert half.encode() not in {key for _, _, key, _ in snapshot_records(settings)}
    assert projections.client.zscore(projections.keys.unsnapshotted(p), half) is not None
    assert checkpoints(settings)[p] < report.applied_through()[p]

    projections.end_restore(half, mark)
    assert wiring.take_snapshots(settings, report.applied_through(), report.trust) == 1
    assert checkpoints(settings)[p] == report.applied_through()[p]


def test_a_session_dropped_for_a_restore_holds_its_partitions_checkpoint_at_the_start(
    settings: Settings, kafka_log: KafkaEventLog, projections: RedisProjectionStore
) -> None:
    """Until a snapshot of it, whole again, is taken: a restore that dies between its drop and
    its first commit must not let a checkpoint pass events its older snapshot lacks."""
    sids, events = generate(120, prefix="hd", group=20)
    send_all(kafka_log, events)
    report = rebuild(settings, snapshots=False)
    assert wiring.take_snapshots(settings, report.applied_through(), report.trust) == len(sids)
    half = sids[0]
    p = partition_for(half, settings.partitions)
    store = wiring.projection_store_for_rebuild(settings)  # as `replay --session` drops it
    try:
        assert store.track
        store.begin_restore(half, datetime.now(UTC))
        store.drop(half, restoring=True)  # and it dies here
    finally:
        store.client.close()
    assert projections.client.zscore(projections.keys.unsnapshotted(p), half) == 0
    wiring.take_snapshots(settings, report.applied_through(), report.trust)
    found = checkpoints(settings)
    assert found[p] == -1  # nothing of the partition is taken as covered
    assert all(c == report.applied_through()[q] for q, c in found.items() if q != p)


@pytest.mark.forks_in_process  # (see pyproject.toml)
def test_an_expired_session_s_snapshot_becomes_a_stub_a_rebuild_restores_as_its_tombstone(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    """Once the worker's sweep dropped an ended session, its next snapshot round replaces the
    session's snapshot with a stub (no state: its tombstone and counters). A rebuild from the
    snapshots then brings back the tombstone (`show` says it expired) and what it added to the
    fleet's counters, and restores no projection of it."""
    taking = with_keys(settings, projection_ttl_s=1.0, snapshot_interval_s=0.2)
    worker = start_worker(taking)
    long_ago = datetime.now(UTC) - timedelta(minutes=5)  # its retention deadline has passed
    done, live = "stub-done", "stub-live"

    def event(sid: str, n: int, type_: str, payload: dict[str, Any]) -> Any:
        return Event(f"{sid}-e{n}", sid, type_, long_ago, "it-agent", payload)

    question = {"question_id": "q1", "question": "deploy?", "reason": "signature"}
    answer = {"question_id": "q1", "answer": "yes", "by": {"id": "ops", "verified": False}}
    sent = [
        event(done, 1, ev.STARTED, {"goal": "ship it", "mode": "ask"}),
        event(done, 2, ev.QUESTION_ASKED, question),
        event(done, 3, ev.QUESTION_ANSWERED, answer),
        event(done, 4, ev.ENDED, {"because": "shipped"}),
        event(live, 1, ev.STARTED, {"goal": "wait", "mode": "ask"}),
        event(live, 2, ev.QUESTION_ASKED, question),
    ]
    positions = [kafka_log.append(e) for e in sent]
    assert projections.load(live, at_least=positions[-1], timeout=60) is not None
    p = partition_for(done, settings.partitions)
    codec = EventCodec()

    def latest(sid: str) -> dict[str, Any] | None:
        return next(
            (
                codec.decode_snapshot(v)
                for _, _, k, v in reversed(snapshot_records(settings))
                if k == sid.encode() and v is not None
            ),
            None,
        )

    wait_for(lambda: projections.expired(done) is not None, timeout=60)
    wait_for(lambda: projections.client.hlen(projections.keys.retired(p)) == 0, timeout=60)
    stub = latest(done)
    assert stub is not None and stub["expired_at_ms"] is not None
    assert (stub["state"], stub["turns"], stub["event_ids"]) == (b"", [], [])
    assert stub["offset"] == positions[3].offset and stub["counters"]
    assert latest(live) is not None  # (a session of its own, not retired)
    worker.stop()
    incremental = fleet_wide(projections)  # the tombstone, the live session's indexes, counters
    tombstone = projections.expired(done)

    projections.clear()
    report = rebuild(taking)
    assert report.retired == 1 and report.ignored == {}
    assert projections.expired(done) == tombstone and projections.load(done) is None
    assert projections.load(live) is not None
    assert fleet_wide(projections) == incremental
    assert projections.ids() == [live]
    projections.clear()
    assert rebuild(taking, processes=2) == dataclasses.replace(report, processes=2)
    assert fleet_wide(projections) == incremental

    # `replay --session` folds it whole from the log; its next snapshot replaces the stub.
    result = CliRunner().invoke(main, ["replay", "--session", done, "--force"], env=taking.to_env())
    assert result.exit_code == 0, result.output
    assert projections.load(done) is not None and projections.expired(done) is None
    wiring.take_snapshots(taking, report.applied_through(), report.trust)
    whole = latest(done)
    assert whole is not None and whole["expired_at_ms"] is None and whole["state"]
    projections.clear()
    again = rebuild(taking)
    assert again.retired == 0 and projections.load(done) is not None
