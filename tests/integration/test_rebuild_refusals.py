"""A rebuild applies exactly what the live worker applies (issue: rebuild folded refused records).

The reproduction: a session's valid event sent under another key (so into another partition), one
sent under its own key into the wrong partition, and one with an empty session id. The worker
dead-letters all three; `replay` and `replay --session` must refuse them too, and the session must
keep applying its later events after the rebuild.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kafka import KafkaProducer

from milpa_sessions.settings import Settings
from processors.worker import DEADLETTER_CODE, DEADLETTER_SOURCE
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from schemas.events import Event
from session_model import intake
from session_model.partitioning import partition_for
from session_model.projection import Position
from session_model.signing import TrustedKeys
from tests.integration.conftest import run_cli
from tests.integration.expected import expected_projections
from tests.integration.test_deadletter_and_replay import _consume_all, _event
from tests.integration.test_scale_and_crash import assert_equals_the_fold, dump, wait_for_all

pytestmark = pytest.mark.integration

SID = "s-rebuild"


def _other_key(settings: Settings, sid: str) -> str:
    """A session id whose partition is not `sid`'s."""
    home = partition_for(sid, settings.partitions)
    return next(
        k for i in range(100) if partition_for(k := f"stray-{i}", settings.partitions) != home
    )


def test_replay_refuses_what_the_worker_dead_letters_and_later_events_still_apply(
    settings: Settings,
    kafka_log: KafkaEventLog,
    raw_producer: KafkaProducer,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    codec = EventCodec()
    accepted: list[Event] = []
    last: dict[str, Position] = {}

    def append(event: Event) -> None:
        accepted.append(event)
        last[event.session_id] = kafka_log.append(event)

    # A session whose first record is a stray: before the fix a rebuild started it from the stray.
    first_stray = _event("s-first", 1, ev.TURN, {"role": "user", "content": "stray first"})
    other = _other_key(settings, "s-first")
    raw_producer.send(
        settings.events_topic, key=other.encode(), value=codec.encode(first_stray)
    ).get(timeout=30)

    worker = start_worker()
    append(_event(SID, 1, ev.STARTED, {"goal": "survive a rebuild", "mode": "ask"}))
    append(_event(SID, 2, ev.TURN, {"role": "user", "content": "one"}))
    append(_event(SID, 3, ev.TURN, {"role": "assistant", "content": "two"}))
    append(_event("s-first", 2, ev.STARTED, {"goal": "the real start", "mode": "ask"}))
    wait_for_all(projections, last, timeout=60, why="the first events", workers=(worker,))
    session = projections.load(SID)
    assert session is not None and session.seq == 3

    home = partition_for(SID, settings.partitions)
    elsewhere = (home + 1) % settings.partitions
    strays = {
        # A valid turn of SID keyed by another id: it lands in another partition.
        intake.KEY_MISMATCH: (
            _other_key(settings, SID).encode(),
            codec.encode(_event(SID, 4, ev.TURN, {"role": "user", "content": "stray"})),
            None,
        ),
        # Keyed by SID but written to another partition by hand.
        intake.WRONG_PARTITION: (
            SID.encode(),
            codec.encode(_event(SID, 5, ev.TURN, {"role": "user", "content": "misplaced"})),
            elsewhere,
        ),
        # An empty session id (it would become a phantom session "").
        intake.NO_SESSION_ID: (
            b"",
            codec.encode(_event("", 6, ev.STARTED, {"goal": "phantom", "mode": "ask"})),
            None,
        ),
        # A session id its partition's snapshot checkpoint is keyed by: refused, never folded
        # (its snapshot would have competed with the checkpoint under compaction).
        intake.BAD_SESSION_ID: (
            b"\x00checkpoint:0",
            codec.encode(_event("\x00checkpoint:0", 8, ev.STARTED, {"goal": "x", "mode": "ask"})),
            None,
        ),
    }
    sources = {}
    for code, (key, value, partition) in strays.items():
        meta = raw_producer.send(
            settings.events_topic, key=key, value=value, partition=partition
        ).get(timeout=30)
        sources[f"{settings.events_topic}:{meta.partition}:{meta.offset}"] = code
    append(_event(SID, 7, ev.TURN, {"role": "user", "content": "after the strays"}))
    wait_for_all(projections, last, timeout=60, why="past the strays", workers=(worker,))

    dead = _consume_all(settings, settings.deadletter_topic, len(strays) + 1, timeout=30)
    codes = {
        dict(r.headers)[DEADLETTER_SOURCE].decode(): dict(r.headers)[DEADLETTER_CODE].decode()
        for r in dead
    }
    for source, code in sources.items():
        assert codes.get(source) == code, (source, codes)
    assert sorted(codes.values()).count(intake.KEY_MISMATCH) == 2  # the first stray too
    live = dump(projections)
    expected = expected_projections(accepted, TrustedKeys.none())
    assert_equals_the_fold(projections, expected)
    assert sorted(projections.ids()) == sorted(expected)

    worker.stop()
    assert not worker.alive()
    done = run_cli(settings, "replay")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["refused"] == {
        intake.KEY_MISMATCH: 2,
        intake.WRONG_PARTITION: 1,
        intake.NO_SESSION_ID: 1,
        intake.BAD_SESSION_ID: 1,
    }, report
    # The rebuild snapshots what it built (the live worker had taken no round yet): its
    # unsnapshotted index is empty, and everything else is as the live projection had it.
    assert report["snapshots_taken"] == len(expected), report
    rebuilt = dump(projections)
    assert not [k for k in rebuilt if k.endswith(":unsnapshotted")]

    def _kept(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if not k.endswith(":unsnapshotted")}

    assert _kept(rebuilt) == _kept(live), "a full rebuild differs from the live projection"
    assert "" not in projections.ids()

    for sid in (SID, "s-first"):
        done = run_cli(settings, "replay", "--session", sid)
        assert done.returncode == 0, done.stderr
        assert _kept(dump(projections)) == _kept(live), f"rebuilding {sid} alone differs"

    # The worker continues from the rebuilt marks: later events apply.
    worker = start_worker()
    append(_event(SID, 8, ev.TURN, {"role": "assistant", "content": "after the rebuild"}))
    append(_event(SID, 9, ev.ENDED, {"because": "done"}))
    wait_for_all(projections, last, timeout=60, why="after the rebuild", workers=(worker,))
    session = projections.load(SID)
    assert session is not None and session.seq == 6 and session.ended_because == "done"
    assert_equals_the_fold(projections, expected_projections(accepted, TrustedKeys.none()))
