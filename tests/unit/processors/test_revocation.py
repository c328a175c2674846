"""The worker's revocation (`processors.app`): bounded by `revoke_grace`, then the worker ends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from milpa_sessions.settings import Settings
from processors import running
from processors.app import ProjectorApp, create_app
from session_model.signing import TrustedKeys


class Ended(Exception):  # noqa: N818 - what `exit_now` does, raised instead in these tests
    """The process would have ended here."""


@pytest.fixture
def watchdogs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The watchdogs the revocation started and the ends it made (none really: the test
    process stays)."""
    started: list[str] = []
    monkeypatch.setattr(running, "start_watchdog", lambda grace, why: started.append(why))

    def exit_now(why: str) -> None:
        started.append(f"ended: {why}")
        raise Ended(why)

    monkeypatch.setattr(running, "exit_now", exit_now)
    return started


@pytest.fixture
def projector() -> Iterator[ProjectorApp]:
    """The worker's app with a grace of 50 ms, snapshots off; nothing connects (and with no
    consumer started, there is no group to leave)."""
    env = {"MILPA_REVOKE_GRACE": "0.05", "MILPA_SNAPSHOT_INTERVAL_S": "0"}
    made = create_app(Settings.from_env(env), TrustedKeys())
    yield made
    made.app.consumer._thread.thread_loop.close()


async def _revoke(projector: ProjectorApp) -> None:
    await projector.app.on_partitions_revoked.send(set())


def test_a_revocation_with_nothing_in_hand_forgets_and_goes_on(
    projector: ProjectorApp, watchdogs: list[str]
) -> None:
    async def main() -> None:
        worker = projector.worker()
        worker.cycle.cache["s1"] = object()  # type: ignore[assignment]
        await _revoke(projector)
        assert worker.cycle.cache == {}
        await projector.worker().store.client.aclose()

    asyncio.run(main())
    assert watchdogs == []


def test_a_batch_still_committing_after_the_grace_ends_the_worker_unwritten(
    projector: ProjectorApp, watchdogs: list[str]
) -> None:
    async def main() -> None:
        worker = projector.worker()
        stuck: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        projector.app.consumer._in_flight = stuck
        worker.cycle.cache["s1"] = object()  # type: ignore[assignment]
        with pytest.raises(Ended, match="MILPA_REVOKE_GRACE"):
            await _revoke(projector)
        assert not stuck.cancelled()  # left going: the batch after it must not be written alone
        assert "s1" in worker.cycle.cache  # not forgotten: nothing folded onto it goes stale
        stuck.cancel()
        await worker.store.client.aclose()

    asyncio.run(main())
    assert watchdogs == [
        "ended: the batches being folded, committed and published did not finish within "
        "MILPA_REVOKE_GRACE",
        "a revocation that failed",
    ]


def test_a_batch_that_failed_stops_the_worker_with_its_error(
    projector: ProjectorApp, watchdogs: list[str]
) -> None:
    async def main() -> None:
        failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        failed.set_exception(RuntimeError("decisions refused for good"))
        projector.app.consumer._in_flight = failed
        with pytest.raises(RuntimeError, match="refused for good"):
            await _revoke(projector)
        await projector.worker().store.client.aclose()

    asyncio.run(main())
    assert watchdogs == ["a revocation that failed"]


def test_no_grace_at_all_still_lets_go_of_what_is_free(watchdogs: list[str]) -> None:
    async def main() -> None:
        env = {"MILPA_REVOKE_GRACE": "0", "MILPA_SNAPSHOT_INTERVAL_S": "0"}
        made = create_app(Settings.from_env(env), TrustedKeys())
        try:
            await _revoke(made)  # a free lock, nothing in flight: nothing to wait for
            await made.worker().store.client.aclose()
        finally:
            made.app.consumer._thread.thread_loop.close()

    asyncio.run(main())
    assert watchdogs == []
