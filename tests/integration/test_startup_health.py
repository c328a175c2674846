"""The health port answers from the moment a worker starts, not only once it reached the stack.

While it waits for Kafka and Redis it is alive and not ready, saying what it waits for; the app
then takes the same socket over, so that a probe is never refused between the two.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from deploy.harness import free_port, wait_for
from milpa_sessions.settings import Settings
from tests.integration.conftest import health, with_keys

pytestmark = pytest.mark.integration


def test_a_worker_waiting_for_redis_is_alive_and_says_what_it_waits_for(
    settings: Settings, start_worker: Any
) -> None:
    port = free_port()
    # Nothing listens there (the stack's URL with another port: TLS and credentials kept).
    absent = re.sub(r":\d+(/|$)", f":{free_port()}\\1", settings.redis_url, count=1)
    waiting = start_worker(with_keys(settings, metrics_port=port, redis_url=absent))

    def waits_for_redis() -> bool:  # (first for Kafka, which may take a moment: TLS)
        problems = health(port, "/readyz")[1].get("problems", [])
        return bool(problems) and problems[0].startswith("starting: waiting for Redis at ")

    try:
        wait_for(waits_for_redis, timeout=60)
    except TimeoutError:
        raise AssertionError(f"{health(port, '/readyz')}\n{waiting.log()[-4000:]}") from None
    status, body = health(port, "/readyz")
    assert status == 503 and body["live"] is True, body
    assert len(body["problems"]) == 1, body
    assert health(port, "/livez")[0] == 200 and waiting.alive()
    time.sleep(3)  # still waiting, still alive
    assert health(port, "/livez")[0] == 200 and health(port, "/readyz")[0] == 503
    waiting.stop()


def test_from_its_first_answer_the_port_answers_every_probe_until_the_worker_is_ready(
    settings: Settings, start_worker: Any
) -> None:
    port = free_port()
    worker = start_worker(with_keys(settings, metrics_port=port))
    seen: list[tuple[int, tuple[str, ...]]] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        status, body = health(port, "/readyz")
        if status or seen:
            seen.append((status, tuple(body.get("problems", ()))))
        if status == 200:
            break
        time.sleep(0.02)
    assert seen and seen[-1][0] == 200, (seen[-5:], worker.log()[-4000:])
    refused = [i for i, (status, _) in enumerate(seen) if status == 0]
    assert refused == [], seen  # the app took the socket over: no moment without an answer
    assert any(p and p[0].startswith("starting: ") for _, p in seen), seen[:5]
