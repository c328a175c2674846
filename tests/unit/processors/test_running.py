"""Process helpers: repeated client log lines are rate-limited; start-up waits with backoff."""

from __future__ import annotations

import logging

import pytest

from processors.running import RepeatFilter, wait_for
from schemas.errors import LogError


def _record(msg: str, *args: object, name: str = "aiokafka.conn") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_a_burst_passes_then_repeats_are_suppressed_and_counted() -> None:
    now = [0.0]
    f = RepeatFilter(burst=3, window=10.0, clock=lambda: now[0])
    passed = [f.filter(_record("Unable connect to node %s", i)) for i in range(1000)]
    assert passed.count(True) == 3 and passed[:3] == [True] * 3
    now[0] = 10.0
    again = _record("Unable connect to node %s", 7)
    assert f.filter(again)
    assert "997 more like this were suppressed" in again.getMessage()


def test_kinds_are_counted_apart_and_ordinary_info_lines_pass() -> None:
    f = RepeatFilter(burst=1, window=10.0, clock=lambda: 0.0)
    assert f.filter(_record("a %s", 1)) and not f.filter(_record("a %s", 2))
    assert f.filter(_record("b %s", 1))
    info = logging.LogRecord("processors.worker", logging.INFO, __file__, 1, "x", (), None)
    assert all(f.filter(info) for _ in range(10))


def test_wait_for_retries_with_backoff_and_says_so_at_most_every_status_period() -> None:
    now = [0.0]
    sleeps: list[float] = []
    said: list[str] = []
    failures = [LogError("refused")] * 6

    def check() -> None:
        if failures:
            raise failures.pop()

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    wait_for(
        "Kafka at x", check, status_every=5.0, clock=lambda: now[0], sleep=sleep, say=said.append
    )
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert said[0].startswith("waiting for Kafka at x (0s so far") and "refused" in said[0]
    assert [s.split(" (")[1][:2] for s in said[:-1]] == ["0s", "8s", "12"]  # >= 5 s apart
    assert said[-1] == "Kafka at x reachable after 18s"


def test_wait_for_gives_up_after_its_timeout() -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    def down() -> None:
        raise LogError("refused")

    with pytest.raises(LogError, match="not reachable after 4s"):
        wait_for("Kafka", down, timeout=3.0, clock=lambda: now[0], sleep=sleep, say=lambda _: None)
