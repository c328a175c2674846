"""The CLI's rebuilds start no thread of their own: `processors.replay` forks its processes only
from a process that runs none, and rich's progress bar used to redraw from one."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from click.testing import CliRunner

import processors.generations
import processors.replay
from milpa_sessions.cli import main
from processors.generations import LiveReport
from processors.replay import ReplayReport

ENV = {
    # Nothing here is reached: the rebuild is replaced, and the clients connect when first used.
    "MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "MILPA_REDIS_URL": "redis://127.0.0.1:1/0",
    "MILPA_SNAPSHOT_INTERVAL_S": "0",
}


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def test_replay_runs_with_no_thread_of_the_clis(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[set[int]] = []

    def fake_replay(*args: Any, progress: Any, **kwargs: Any) -> ReplayReport:
        seen.append(_threads())
        for done in (0, 500, 1000):
            progress(done, 1000)  # the bar is fed (and redrawn) from the caller's thread
        seen.append(_threads())
        return ReplayReport(1000, 10)

    monkeypatch.setattr(processors.replay, "replay", fake_replay)
    before = _threads()
    result = CliRunner().invoke(main, ["replay", "--force", "--full"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "replayed 1000 records into 10 sessions" in result.output
    # No thread the CLI started (one another test left may have ended meanwhile).
    assert len(seen) == 2 and all(threads <= before for threads in seen)


def test_a_live_rebuild_runs_with_no_thread_of_the_clis(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[set[int]] = []

    def fake_rebuild_live(*args: Any, progress: Any, **kwargs: Any) -> LiveReport:
        seen.append(_threads())
        progress(10, 10)
        return LiveReport(1, ReplayReport(10, 1), 0, 1, 0)

    monkeypatch.setattr(processors.generations, "rebuild_live", fake_rebuild_live)
    before = _threads()
    result = CliRunner().invoke(main, ["replay", "--live"], env=ENV)
    assert result.exit_code == 0, result.output
    assert "rebuilt generation 1 live" in result.output
    assert len(seen) == 1 and seen[0] <= before


@pytest.mark.parametrize("live", [False, True])
def test_processes_reach_the_rebuild_as_given(monkeypatch: pytest.MonkeyPatch, live: bool) -> None:
    asked: list[int | None] = []

    def fake_replay(*args: Any, processes: int | None, **kwargs: Any) -> ReplayReport:
        asked.append(processes)
        return ReplayReport(10, 1, processes=processes or 1)

    def fake_rebuild_live(*args: Any, processes: int | None, **kwargs: Any) -> LiveReport:
        return LiveReport(1, fake_replay(processes=processes), 0, 1, 0)

    monkeypatch.setattr(processors.replay, "replay", fake_replay)
    monkeypatch.setattr(processors.generations, "rebuild_live", fake_rebuild_live)
    command = ["--json", "replay", *(["--live"] if live else ["--force"])]
    for given in ([], ["--processes", "1"], ["--processes", "3"]):
        result = CliRunner().invoke(main, [*command, *given], env=ENV)
        assert result.exit_code == 0, result.output
    assert asked == [None, 1, 3]  # None: the rebuild's own choice, one per CPU


def test_processes_below_one_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processors.replay, "replay", lambda *a, **k: pytest.fail("ran"))
    result = CliRunner().invoke(main, ["replay", "--force", "--processes", "0"], env=ENV)
    assert result.exit_code == 2
    assert "--processes" in result.output and "0 is not in the range x>=1" in result.output
