"""The worker's timer process on the real stack: closings while folding, across rebalances.

No timing assertions here (the benchmark measures lateness): only what is closed, by whom, and
that the fold's state holds each closing once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from deploy.harness import free_port, read_topic, wait_for
from deploy.metrics import parse_counter
from milpa_sessions.settings import Settings
from processors.scheduler import SchedulerStats
from processors.timer import Assign, Closing, Offer
from processors.timer_link import TimerLink
from processors.timer_process import TimerConfig
from producers.kafka_log import KafkaEventLog
from projections.redis_store import RedisProjectionStore
from schemas import events as ev
from schemas.codec import EventCodec
from session_model.deadlines import format_instant
from session_model.partitioning import partition_for
from tests.integration.conftest import with_keys
from tests.unit.builders import ask, started, turn

pytestmark = pytest.mark.integration


def _closed_once(projections: RedisProjectionStore, sid: str) -> bool:
    session = projections.load(sid)
    return session is not None and session.ended


def _assert_closed_once(projections: RedisProjectionStore, sids: Sequence[str]) -> None:
    for sid in sids:
        session = projections.load(sid)
        assert session is not None and session.ended, sid
        assert len(session.decisions) == 1 and session.decisions[0].expired_at is not None, sid
        kinds = [e["kind"] for e in projections.timeline(sid)]
        assert kinds.count("expired") == 1, (sid, kinds)


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    return body.decode()


def _closings(port: int) -> float:
    return parse_counter(_metrics(port), "milpa_scheduler_closings") or 0.0


def _records(port: int) -> float:
    try:
        return parse_counter(_metrics(port), "milpa_records") or 0.0
    except OSError:
        return 0.0  # not serving yet


def _ask(log: KafkaEventLog, sids: Sequence[str], deadline: datetime) -> None:
    for sid in sids:
        log.send(ask(f"q-{sid}", session_id=sid, expires_at=format_instant(deadline)))
    log.flush(timeout=30)


def _start(log: KafkaEventLog, sids: Sequence[str]) -> None:
    for sid in sids:
        log.send(started(session_id=sid))
    log.flush(timeout=30)


def test_deadlines_close_while_the_worker_is_busy_folding_other_sessions(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    port = free_port()
    start_worker(with_keys(settings, metrics_port=port))
    waiting = [f"busy-q-{i}" for i in range(60)]
    others = [f"busy-o-{i}" for i in range(200)]
    _start(kafka_log, [*waiting, *others])
    wait_for(lambda: all(projections.load(s) is not None for s in waiting[-1:]), timeout=60)
    _ask(kafka_log, waiting, datetime.now(UTC) + timedelta(seconds=2))
    wait_for(lambda: projections.load(waiting[-1]) is not None, timeout=60)
    # Other sessions' turns keep the worker folding from before the deadline to well after it.
    loading = threading.Event()
    load = KafkaEventLog(settings.kafka_access(), settings.events_topic)

    def send_load() -> None:
        try:
            for i in range(60):
                if not loading.is_set():
                    return
                for sid in others:
                    load.send(turn("user", f"turn {i}", session_id=sid))
                time.sleep(0.1)
        finally:
            load.close(timeout=10)

    loading.set()
    sender = threading.Thread(target=send_load, daemon=True)
    sender.start()
    try:
        wait_for(lambda: all(_closed_once(projections, s) for s in waiting), timeout=60)
        still_loading = sender.is_alive()
    finally:
        loading.clear()
        sender.join(timeout=30)
    assert still_loading  # the windows closed while the worker was folding the load
    _assert_closed_once(projections, waiting)
    assert _closings(port) >= len(waiting)
    producers = {
        e.producer
        for m in read_topic(settings.kafka_access().kafka_python(), settings.events_topic)
        if (e := EventCodec().decode(m.value)).type == ev.ANSWER_WINDOW_CLOSED
    }
    assert producers == {"milpa-scheduler"}


@pytest.mark.fault_load
def test_a_rebalance_moves_which_partitions_each_workers_timer_closes(
    settings: Settings,
    kafka_log: KafkaEventLog,
    projections: RedisProjectionStore,
    start_worker: Any,
) -> None:
    ports = free_port(), free_port()
    start_worker(with_keys(settings, metrics_port=ports[0]))
    _start(kafka_log, ["probe-a"])
    wait_for(lambda: projections.load("probe-a") is not None, timeout=60)
    second = start_worker(with_keys(settings, metrics_port=ports[1]))
    # Both consume once the group has settled: each then owns half of the partitions.
    probes = [f"probe-b-{i}" for i in range(24)]
    _start(kafka_log, probes)

    def both_consuming() -> bool:
        if _records(ports[1]) > 0 and _records(ports[0]) > 1:
            return True
        _start(kafka_log, [f"probe-c-{time.monotonic_ns()}"])
        return False

    wait_for(both_consuming, timeout=90, interval=1.0)
    sids = [f"rebal-{i}" for i in range(36)]
    assert len({partition_for(s, settings.partitions) for s in sids}) == settings.partitions
    _start(kafka_log, sids)
    wait_for(lambda: all(projections.load(s) is not None for s in sids), timeout=60)
    _ask(kafka_log, sids, datetime.now(UTC) + timedelta(seconds=1.5))
    wait_for(lambda: all(_closed_once(projections, s) for s in sids), timeout=60)
    _assert_closed_once(projections, sids)
    by_first, by_second = _closings(ports[0]), _closings(ports[1])
    assert by_first > 0 and by_second > 0  # each closed its own partitions' windows
    assert by_first + by_second >= len(sids)

    # The second leaves: the first takes every partition over and closes them all.
    second.stop()
    again = [f"rebal-again-{i}" for i in range(36)]
    _start(kafka_log, again)
    wait_for(lambda: all(projections.load(s) is not None for s in again), timeout=90)
    _ask(kafka_log, again, datetime.now(UTC) + timedelta(seconds=1.5))
    wait_for(lambda: all(_closed_once(projections, s) for s in again), timeout=60)
    _assert_closed_once(projections, again)
    assert _closings(ports[0]) >= by_first + len(again)


def _disturbed_timer(
    settings: Settings,
    sids: list[str],
    config: TimerConfig,
    *,
    due_in_s: float,
    after_s: float,
    sig: signal.Signals,
) -> tuple[set[int], SchedulerStats]:
    """A TimerLink against the real broker, offered closings for `sids` due in `due_in_s`; its
    process sent `sig` `after_s` after it started. The processes it ran, and its stats once every
    closing was acknowledged (or time ran out)."""

    async def scenario() -> tuple[set[int], SchedulerStats]:
        link = TimerLink(config, restart_delay=0.1)
        deadline_us = int((time.time() + due_in_s) * 1_000_000)
        closings = [
            Closing(s, partition_for(s, settings.partitions), deadline_us, f"q-{s}", 1)
            for s in sids
        ]
        owned = frozenset(range(settings.partitions))

        def replay() -> None:
            link.send(Assign(owned))
            link.send(Offer(tuple(closings)))

        link.restarted.append(replay)
        await link.start()
        replay()
        first = link.pid
        assert first is not None
        await asyncio.sleep(after_s)
        os.kill(first, sig)
        for _ in range(400):
            if link.stats().closings >= len(sids):
                break
            await asyncio.sleep(0.05)
        pids = {first, link.pid or 0}
        stats = link.stats()
        await link.stop()
        return pids, stats

    return asyncio.run(scenario())


def _closed_sessions(settings: Settings) -> dict[str, int]:
    """Session id -> the partition of its closing, for every closing on the events topic."""
    return {
        e.session_id: m.partition
        for m in read_topic(settings.kafka_access().kafka_python(), settings.events_topic)
        if (e := EventCodec().decode(m.value)).type == ev.ANSWER_WINDOW_CLOSED
    }


def test_a_timer_process_that_hangs_is_ended_and_replaced_and_the_deadlines_close(
    settings: Settings,
) -> None:
    """A stopped timer (SIGSTOP: alive, silent) would let every deadline pass unclosed."""
    sids = [f"hung-{i}" for i in range(6)]
    config = TimerConfig(settings.kafka_access(), settings.events_topic, hang_s=2.0)
    # Stopped once started and beating.
    pids, stats = _disturbed_timer(
        settings, sids, config, due_in_s=4, after_s=1.0, sig=signal.SIGSTOP
    )
    assert len(pids) == 2 and stats.closings == len(sids)
    assert stats.timer_hangs >= 1 and stats.timer_restarts >= 1
    assert set(_closed_sessions(settings)) == set(sids)


def test_a_timer_process_that_dies_is_replaced_and_told_everything_again(
    settings: Settings,
) -> None:
    """TimerLink against the real broker: the closings offered before a crash still go out."""
    sids = [f"crash-{i}" for i in range(12)]
    config = TimerConfig(settings.kafka_access(), settings.events_topic)
    pids, stats = _disturbed_timer(
        settings, sids, config, due_in_s=3, after_s=0.5, sig=signal.SIGKILL
    )
    assert len(pids) == 2 and stats.closings == len(sids)
    assert _closed_sessions(settings) == {s: partition_for(s, settings.partitions) for s in sids}
