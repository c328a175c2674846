"""The e2e figure's breakdown: the worker's lag histograms counted between two scrapes."""

from __future__ import annotations

from typing import Any

import pytest

from bench import infra
from bench.figures.common import lag_between
from deploy.metrics import histogram_between
from milpa_sessions.settings import Settings
from schemas.errors import LogError


def _exposition(name: str, cumulative: list[tuple[str, int]]) -> str:
    lines = [f'{name}_bucket{{le="{le}"}} {count}' for le, count in cumulative]
    return "\n".join(lines) + "\n"


def test_only_what_was_counted_between_the_two_scrapes_is_summarised() -> None:
    name = "milpa_batch_fetched_lag_ms"
    before = _exposition(name, [("1.0", 100), ("5.0", 100), ("10.0", 100), ("+Inf", 100)])
    # 100 more batches: 98 within 1-5 ms, 2 within 5-10 ms.
    after = _exposition(name, [("1.0", 100), ("5.0", 198), ("10.0", 200), ("+Inf", 200)])
    assert histogram_between(before, after, name) == [
        (1.0, 0.0),
        (5.0, 98.0),
        (10.0, 100.0),
        (float("inf"), 100.0),
    ]
    lag = lag_between(before, after)
    fetched = lag["fetched"]
    assert fetched["batches"] == 100
    assert 1.0 < fetched["p50"] < 5.0  # not the 100 older sub-millisecond batches
    assert fetched["p99_bucket"] == (5.0, 10.0)
    assert lag["visible"] == {"batches": 0, "p50": None, "p99": None, "p99_bucket": None}


class _Admin:
    def __init__(self, answer: str) -> None:
        self.answer, self.closed = answer, False

    def alter_configs(self, resources: list[Any]) -> dict[str, dict[str, str]]:
        return {"topic": {resources[0].name: self.answer}}

    def close(self) -> None:
        self.closed = True


def test_a_refused_log_append_time_is_an_error_not_a_silent_create_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kafka-python returns a refusal (an ACL, a policy) instead of raising it: the figure must
    not then say its lags run from the append."""
    settings = Settings(events_topic="e2e-events")
    refused = _Admin("[Error 29] TopicAuthorizationFailedError")
    monkeypatch.setattr(infra, "admin_client", lambda s: refused)
    with pytest.raises(LogError, match=r"LogAppendTime was refused.*Error 29"):
        infra.stamp_on_append(settings)
    assert refused.closed
    accepted = _Admin("OK")
    monkeypatch.setattr(infra, "admin_client", lambda s: accepted)
    infra.stamp_on_append(settings)
    assert accepted.closed
