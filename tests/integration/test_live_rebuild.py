"""`replay --live`: a rebuild while a worker serves and a producer appends (issue #16, item 4).

The rebuild writes the next projection generation, catches up, and moves each partition over
(`processors/generations.py`); a reader polling all along must never see a half-built projection,
and afterwards everything equals the fold, the counters are exact and the old generation is gone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import pytest

from milpa_sessions.settings import Settings
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from session_model.projection import Folded, Position
from session_model.signing import TrustedKeys
from tests.integration.conftest import run_cli
from tests.integration.expected import expected_projections
from tests.integration.test_scale_and_crash import (
    assert_counts_are_exact,
    assert_equals_the_fold,
    generate,
    send_all,
    wait_for_all,
)

pytestmark = [pytest.mark.integration, pytest.mark.fault_load]


class Reader(threading.Thread):
    """Reads some finished sessions over and over, as a reader of the projections would, and
    keeps what it saw that was not their final state."""

    def __init__(self, settings: Settings, expected: dict[str, Any], last: dict[str, Position]):
        super().__init__(daemon=True)
        self.store = RedisProjectionStore(settings.redis_sync(), settings.redis_keys())
        self.expected = {sid: Folded(e.state, last[sid]) for sid, e in expected.items()}
        self.stop = threading.Event()
        self.reads = 0
        self.generations: set[tuple[int, ...]] = set()
        self.wrong: list[str] = []

    def run(self) -> None:
        sids = sorted(self.expected)
        while not self.stop.is_set():
            got = self.store.folded(sids)
            self.generations.add(self.store.keys.generations or (0,))
            self.reads += 1
            for sid in sids:
                if got.get(sid) != self.expected[sid]:
                    self.wrong.append(f"{sid}: {'missing' if sid not in got else 'differs'}")
            if len(self.wrong) > 20:
                return
            time.sleep(0.01)


def test_a_live_rebuild_switches_readers_and_workers_to_a_complete_new_generation(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    worker = start_worker()
    before_sids, before = generate(150, prefix="a", group=50)
    last_before = send_all(kafka_log, before)
    wait_for_all(projections, last_before, timeout=90, why="before", workers=(worker,))
    finished = expected_projections(before, TrustedKeys.none())

    reader = Reader(settings, finished, last_before)
    reader.start()
    during_sids, during = generate(150, prefix="b", group=50)
    sent: dict[str, Position] = {}

    def produce() -> None:  # about 1,500 events a second, through the whole rebuild
        for at in range(0, len(during), 150):
            sent.update(send_all(kafka_log, during[at : at + 150]))
            time.sleep(0.1)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        done = run_cli(settings, "replay", "--live", timeout=240)
    finally:
        producer.join(timeout=120)
        reader.stop.set()
        reader.join(timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["generation"] == 1
    assert report["records"] > 0 and report["rounds"] >= 1
    assert report["old_keys_dropped"] > 0
    # Its first pass forked one process per CPU: the lease renewer is the only other thread,
    # and it is guarded.
    assert report["processes"] == min(len(os.sched_getaffinity(0)), settings.partitions)

    assert reader.wrong == [], reader.wrong[:5]
    assert reader.reads > 10
    assert reader.generations >= {(0,), (1,) * settings.partitions}, reader.generations

    wait_for_all(projections, sent, timeout=90, why="after the live rebuild", workers=(worker,))
    assert worker.alive(), worker.log()[-3000:]
    expected = expected_projections([*before, *during], TrustedKeys.none())
    assert projections.refresh_generations() == (1,) * settings.partitions
    assert sorted(projections.ids()) == sorted([*before_sids, *during_sids])
    assert_equals_the_fold(projections, expected)
    assert_counts_are_exact(settings, projections, expected)
    # Nothing of generation 0 is left.
    left = list(projections.client.scan_iter(match=projections.keys.generation_pattern(0)))
    assert left == []
