"""`MILPA_CACHE_SESSIONS`: how many sessions' folded states a worker keeps between batches."""

from __future__ import annotations

import asyncio

import pytest

from milpa_sessions.settings import Settings
from processors.app import create_app
from schemas.errors import ConfigurationError
from session_model.signing import TrustedKeys


def test_the_worker_keeps_as_many_sessions_as_the_setting_says() -> None:
    env = {"MILPA_CACHE_SESSIONS": "2500", "MILPA_SNAPSHOT_INTERVAL_S": "0"}
    made = create_app(Settings.from_env(env), TrustedKeys())

    async def main() -> int | None:
        worker = made.worker()
        try:
            return worker.cycle.cache_limit
        finally:
            await worker.store.client.aclose()

    try:
        assert asyncio.run(main()) == 2500
    finally:
        made.app.consumer._thread.thread_loop.close()
    assert Settings().cache_limit() == 100_000


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_cache_of_no_session_is_refused_when_the_worker_is_built(value: str) -> None:
    settings = Settings.from_env({"MILPA_CACHE_SESSIONS": value})
    with pytest.raises(ConfigurationError, match=f"MILPA_CACHE_SESSIONS={value}: must be"):
        create_app(settings, TrustedKeys())
