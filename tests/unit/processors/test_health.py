"""`/livez` and `/readyz`: a loop that stopped turning, and records that wait with no batch done."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from processors.health import Heartbeat, Probe, Starting, Troubles, judge, parked_partitions
from processors.metrics import Metrics, serve_starting
from processors.worker import WorkerStats
from schemas.errors import ConfigurationError
from session_model.projection import UNREADABLE, Fault, Position


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _probe(
    clock: Clock, lag: dict[int, int], progressed: list[float | None], assigned: list[bool]
) -> Probe:
    return Probe(
        Heartbeat(clock), lambda: lag, lambda: progressed[0], lambda: assigned[0], stall_s=30.0
    )


def test_a_fresh_heartbeat_with_nothing_waiting_is_live_and_ready() -> None:
    health = judge(now=10.0, beat=9.5, assigned=True, lag=0, waiting_since=None, stall_s=30.0)
    assert health.live and health.ready and health.problems == ()
    assert health.as_json() == {
        "live": True,
        "ready": True,
        "problems": [],
        "notes": [],
        "loop_s": 0.5,
        "lag": 0,
        "waiting_s": None,
    }


def test_a_loop_that_stopped_turning_is_neither_live_nor_ready() -> None:
    health = judge(now=50.0, beat=19.0, assigned=True, lag=0, waiting_since=None, stall_s=30.0)
    assert not health.live and not health.ready
    assert health.problems == ("the event loop has not run for 31.0s",)


def test_before_its_first_assignment_a_worker_is_live_but_not_ready() -> None:
    health = judge(now=10.0, beat=10.0, assigned=False, lag=0, waiting_since=None, stall_s=30.0)
    assert health.live and not health.ready


def test_records_waiting_with_no_batch_finished_make_it_unready_after_the_stall_time() -> None:
    clock, lag, progressed, assigned = Clock(), {0: 0, 1: 0}, [None], [True]
    probe = _probe(clock, lag, progressed, assigned)
    assert probe.check().ready
    lag[1] = 40  # records arrive; no batch finishes from here on
    clock.now += 1
    first = probe.check()
    assert first.ready and first.lag == 40 and first.waiting_s == 0.0
    clock.now += 30
    probe.heartbeat.at = clock.now  # the loop still turns (Redis hangs, say)
    assert probe.check().ready  # 30 s: not yet past the stall time
    clock.now += 1
    stalled = probe.check()
    assert stalled.live and not stalled.ready
    assert stalled.problems == ("40 records have waited 31.0s with no batch finished",)
    progressed[0] = clock.now  # a batch finishes: the wait starts again from this probe
    clock.now += 1
    again = probe.check()
    assert again.ready and again.waiting_s == 0.0
    lag[1] = 0
    clock.now += 100
    probe.heartbeat.at = clock.now
    assert probe.check().ready and probe.check().waiting_s is None


def test_a_busy_worker_whose_batches_keep_finishing_stays_ready() -> None:
    clock, lag, progressed, assigned = Clock(), {0: 5000}, [None], [True]
    probe = _probe(clock, lag, progressed, assigned)
    for _ in range(10):
        clock.now += 20
        progressed[0] = clock.now - 1  # a batch finished within the last probe interval
        probe.heartbeat.at = clock.now
        assert probe.check().ready


def test_the_heartbeat_stamps_the_time_while_the_loop_turns() -> None:
    clock = Clock()
    heartbeat = Heartbeat(clock)

    async def main() -> None:
        task = asyncio.create_task(heartbeat.run(every=0.001))
        try:
            clock.now = 200.0
            for _ in range(100):
                await asyncio.sleep(0.005)
                if heartbeat.at == 200.0:
                    break
        finally:
            task.cancel()

    asyncio.run(main())
    assert heartbeat.at == 200.0


def _get(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_metrics_endpoint_serves_the_probe_s_verdicts() -> None:
    clock, lag, progressed, assigned = Clock(), {0: 0}, [None], [False]
    probe = _probe(clock, lag, progressed, assigned)
    metrics = Metrics(WorkerStats, lambda: None, dict, probe=probe)
    port = metrics.serve(0)
    try:
        status, body = _get(port, "/metrics")
        assert status == 200 and b"milpa_batches_total" in body
        status, body = _get(port, "/livez")
        assert status == 200 and json.loads(body)["live"] is True
        status, body = _get(port, "/readyz")
        assert status == 503
        assert json.loads(body)["problems"] == ["no partition assignment yet (joining the group)"]
        assigned[0] = True
        assert _get(port, "/readyz")[0] == 200
        clock.now += 31  # the heartbeat is not stamped: its loop is blocked
        status, body = _get(port, "/livez")
        assert status == 503 and json.loads(body)["live"] is False
        status, body = _get(port, "/nothing-here")
        assert status == 404 and json.loads(body) == {"error": "not found"}  # (no echo)
    finally:
        metrics.stop()


@pytest.mark.parametrize("path", ["/livez", "/readyz"])
def test_without_a_probe_there_is_no_health_endpoint(path: str) -> None:
    metrics = Metrics(WorkerStats, lambda: None, dict)
    port = metrics.serve(0)
    try:
        assert _get(port, path)[0] == 404
    finally:
        metrics.stop()


def test_a_parked_partition_makes_the_worker_unready_but_not_dead() -> None:
    clock, troubles = Clock(), ["partition 3 parked at offset 12 (session 's'): the fold raised X"]
    probe = Probe(
        Heartbeat(clock),
        dict,
        lambda: None,
        lambda: True,
        30.0,
        troubles=lambda: Troubles(tuple(troubles)),
    )
    health = probe.check()
    assert health.live and not health.ready and health.problems == tuple(troubles)
    troubles.clear()
    assert probe.check().ready


def test_a_progress_that_cannot_be_read_makes_it_unready_and_leaves_it_live() -> None:
    def mid_rebalance() -> dict[int, int]:
        raise KeyError("the assignment changed under the probe")

    probe = Probe(Heartbeat(Clock()), mid_rebalance, lambda: None, lambda: True, 30.0)
    health = probe.check()
    assert health.live and not health.ready
    assert health.problems == ("could not read the consumer's progress: KeyError",)


@pytest.mark.parametrize("stall_s", [0.0, 1.5, float("nan")])
def test_a_stall_time_shorter_than_two_heartbeats_is_refused(stall_s: float) -> None:
    with pytest.raises(ConfigurationError, match="MILPA_STALL_S"):
        Probe(Heartbeat(), dict, lambda: None, lambda: True, stall_s)


def test_while_starting_it_is_alive_never_ready_and_says_what_it_does() -> None:
    starting = Starting()
    starting.waiting_for("Kafka at 127.0.0.1:9092")
    health = starting.check()
    assert health.live and not health.ready
    assert health.problems == ("starting: waiting for Kafka at 127.0.0.1:9092",)
    starting.waited()  # the group join may wait for a dead member's session timeout: still live
    health = starting.check()
    assert health.live and not health.ready
    assert health.problems == ("starting: starting the app and joining the consumer group",)


def test_the_app_takes_over_the_start_up_s_endpoint_without_a_gap() -> None:
    starting = Starting()
    starting.waiting_for("Redis at redis://127.0.0.1:1/0")
    endpoint = serve_starting(0, "127.0.0.1", starting)
    try:
        port = endpoint.port
        status, body = _get(port, "/readyz")
        assert status == 503
        assert json.loads(body)["problems"] == [
            "starting: waiting for Redis at redis://127.0.0.1:1/0"
        ]
        assert _get(port, "/livez")[0] == 200
        assert _get(port, "/metrics") == (503, b'{"error": "starting"}')  # scraped: not up yet

        probe = Probe(Heartbeat(Clock()), dict, lambda: None, lambda: True, 30.0)
        metrics = Metrics(WorkerStats, lambda: None, dict, probe=probe)
        assert metrics.serve(port, endpoint=endpoint) == port  # the same socket, never closed
        assert _get(port, "/readyz")[0] == 200
        status, body = _get(port, "/metrics")
        assert status == 200 and b"milpa_batches_total" in body
        metrics.stop()
        with pytest.raises(urllib.error.URLError):
            _get(port, "/livez")
    finally:
        endpoint.stop()


def _fault(partition: int, offset: int, sid: str, *, unreadable: bool) -> Fault:
    if unreadable:
        return Fault(Position(partition, offset), sid, UNREADABLE, f"{sid}: why", unreadable=True)
    return Fault(Position(partition, offset), sid, "TypeError", "TypeError('a bug')")


def test_a_partition_waiting_for_a_rebuild_is_a_note_until_the_stall_time_then_a_problem() -> None:
    faults = {
        1: _fault(1, 10, "bug", unreadable=False),
        2: _fault(2, 20, "damaged", unreadable=True),
        3: _fault(3, 30, "rebuilt", unreadable=True),
    }
    held = {2: {"damaged"}, 3: {"rebuilt"}}
    unreadable = {"damaged", "rebuilt"}
    since = {"rebuilt": 100.0, "bug": 100.0}  # (a fold's fault is no rebuild, whatever it says)
    found = parked_partitions(faults, held, unreadable, since, now=112.0, stall_s=30.0)
    assert found.problems == (
        "partition 1 parked at offset 10: the fold raised TypeError (a bug: see the worker's log)",
        "partition 2 parked at offset 20: what is stored of a session cannot be read now (see "
        "the worker's log)",
    )
    assert found.notes == (
        "partition 3 parked at offset 30: a `replay --session` rebuilds a session (12.0s)",
    )
    found = parked_partitions(faults, held, unreadable, since, now=131.0, stall_s=30.0)
    assert found.problems[2] == (
        "partition 3 parked at offset 30: a session has been half rebuilt for 31s (a `replay "
        "--session` still running, or one that died: see the worker's log)"
    )
    assert found.notes == ()
    assert all("rebuilt" not in p.split(":")[0] for p in found.problems)  # no session id is said


def test_a_damaged_session_held_behind_a_rebuild_is_a_problem_at_once() -> None:
    # The fault names the rebuilt session (its record came first); the partition holds a
    # damaged one's records too.
    faults = {3: _fault(3, 30, "rebuilt", unreadable=True)}
    held = {3: {"rebuilt", "damaged"}}
    since = {"rebuilt": 100.0}
    found = parked_partitions(faults, held, {"rebuilt", "damaged"}, since, now=101.0, stall_s=30)
    assert found.notes == () and "cannot be read now" in found.problems[0]
    # The damaged one reads now (rebuilt with --force): the rebuild's wait is routine again.
    found = parked_partitions(faults, held, {"rebuilt"}, since, now=101.0, stall_s=30)
    assert found.problems == () and "rebuilds a session" in found.notes[0]


def test_a_partition_whose_sessions_all_read_now_is_a_note_until_it_is_read_again() -> None:
    # A rebuild that ended: the session was read whole (by the timer feed, say) before the
    # worker's next retry lets the partition go. Not a problem, and no longer a rebuild.
    faults = {3: _fault(3, 30, "rebuilt", unreadable=True)}
    found = parked_partitions(faults, {3: {"rebuilt"}}, set(), {}, now=500.0, stall_s=30)
    assert found.problems == ()
    assert found.notes == (
        "partition 3 parked at offset 30: what it waited for reads now (read again at the next "
        "retry)",
    )


def test_notes_leave_the_worker_ready_and_are_in_the_verdict() -> None:
    notes = ("partition 3 parked at offset 30: a `replay --session` rebuilds",)
    probe = Probe(
        Heartbeat(Clock()),
        dict,
        lambda: None,
        lambda: True,
        30.0,
        troubles=lambda: Troubles(notes=notes),
    )
    health = probe.check()
    assert health.ready and health.problems == () and health.notes == notes
    assert health.as_json()["notes"] == list(notes)
