"""How many processes a rebuild forks: one per CPU when nothing else runs, or only guarded
threads; one when any other thread runs (a child could inherit a lock it holds); and that it
forks them holding the guard's lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import processors.replay as replay_module
from processors.replay import ForkGuard, ReplayReport, _groups, _in_processes

PARTITIONS = list(range(6))


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_module.os, "sched_getaffinity", lambda _: {0, 1})


@contextmanager
def running_thread() -> Iterator[threading.Thread]:
    """A thread that runs until the block ends."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()


def _only(monkeypatch: pytest.MonkeyPatch, *threads: threading.Thread) -> None:
    """The threads the rebuild sees besides its own: these (not those another test left)."""
    here = threading.current_thread()
    monkeypatch.setattr(replay_module.threading, "enumerate", lambda: [here, *threads])


@pytest.mark.usefixtures("two_cpus")
def test_alone_it_forks_one_process_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch)
    assert _groups(PARTITIONS, None) == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.usefixtures("two_cpus")
def test_another_thread_keeps_it_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_thread() as other:
        _only(monkeypatch, other)
        assert _groups(PARTITIONS, None) == [PARTITIONS]


@pytest.mark.usefixtures("two_cpus")
def test_guarded_threads_do_not_keep_it_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_thread() as guarded:
        _only(monkeypatch, guarded)
        assert _groups(PARTITIONS, None, (guarded,)) == [[0, 2, 4], [1, 3, 5]]
        with running_thread() as other:  # one guarded, one not
            _only(monkeypatch, guarded, other)
            assert _groups(PARTITIONS, None, (guarded,)) == [PARTITIONS]


@pytest.mark.usefixtures("two_cpus")
def test_a_guarded_thread_is_known_by_identity_not_by_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The guarded thread has ended; another one runs: that one is not guarded.
    with running_thread() as ended:
        pass
    with running_thread() as other:
        _only(monkeypatch, other)
        assert _groups(PARTITIONS, None, (ended,)) == [PARTITIONS]


def test_an_explicit_count_is_taken_as_given(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _only(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="milpa_sessions.replay"):
        assert _groups(PARTITIONS, 3) == [[0, 3], [1, 4], [2, 5]]
        assert _groups([0], 4) == [[0]]  # at most one per partition
    assert caplog.records == []


def test_an_explicit_count_with_other_threads_running_is_taken_and_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A child waits for ever on a lock another thread held at the fork (OpenSSL's, with TLS):
    the caller asked for it, and is told."""
    with running_thread() as other, caplog.at_level(logging.WARNING, "milpa_sessions.replay"):
        _only(monkeypatch, other)
        assert _groups(PARTITIONS, 2) == [[0, 2, 4], [1, 3, 5]]
        assert _groups(PARTITIONS, 1) == [PARTITIONS]  # no fork: nothing to say
    [warned] = caplog.records
    assert "forking 2 rebuild processes while other threads run" in warned.getMessage()
    assert other.name in warned.getMessage()


class _LockSeenByChild:
    """A rebuild job whose forked process reports whether the guard's lock was held when it
    was forked (its copy of the lock is as the fork found it)."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def run(
        self, ends: dict[int, int], progress: Callable[[int], None], grow: Callable[[int], None]
    ) -> ReplayReport:
        return ReplayReport(records=int(self.lock.locked()), applied_sessions=len(ends))


def test_the_processes_are_forked_holding_the_guards_lock() -> None:
    guard = ForkGuard(threading.Lock())
    job: Any = _LockSeenByChild(guard.lock)

    report = _in_processes(job, [{0: 1}, {1: 1}], 2, None, guard)

    assert report.processes == 2
    assert report.records == 2  # each child found the lock held
    assert not guard.lock.locked()  # and the parent let it go

    unguarded = _in_processes(job, [{0: 1}, {1: 1}], 2, None, None)
    assert unguarded.records == 0


class _FoldsAPartitionWhole:
    """A rebuild process that finds a snapshot unusable: it reads 10 more records than planned."""

    def run(
        self, ends: dict[int, int], progress: Callable[[int], None], grow: Callable[[int], None]
    ) -> ReplayReport:
        grow(10)
        progress(sum(ends.values()) + 10)
        return ReplayReport(records=sum(ends.values()) + 10, applied_sessions=1, skipped=0)


def test_the_progress_total_grows_by_what_a_process_reads_beyond_the_plan() -> None:
    seen: list[tuple[int, int]] = []
    job: Any = _FoldsAPartitionWhole()
    report = _in_processes(job, [{0: 4}, {1: 6}], 10, lambda *at: seen.append(at))
    assert report.records == 30
    assert seen[-1] == (30, 30)  # never more read than the total says
    assert all(read <= total for read, total in seen)
