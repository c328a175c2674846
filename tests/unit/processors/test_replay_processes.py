"""How many processes a rebuild forks: one per CPU when nothing else runs, or only guarded
threads; one when any other thread runs (a child could inherit a lock it holds)."""

from __future__ import annotations

import pytest

import processors.replay as replay_module
from processors.replay import _groups

PARTITIONS = list(range(6))


@pytest.fixture
def two_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay_module.os, "sched_getaffinity", lambda _: {0, 1})


def _threads(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(replay_module.threading, "active_count", lambda: count)


@pytest.mark.usefixtures("two_cpus")
def test_alone_it_forks_one_process_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _threads(monkeypatch, 1)
    assert _groups(PARTITIONS, None) == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.usefixtures("two_cpus")
def test_another_thread_keeps_it_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _threads(monkeypatch, 2)
    assert _groups(PARTITIONS, None) == [PARTITIONS]


@pytest.mark.usefixtures("two_cpus")
def test_guarded_threads_do_not_keep_it_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    _threads(monkeypatch, 2)
    assert _groups(PARTITIONS, None, guarded=1) == [[0, 2, 4], [1, 3, 5]]
    _threads(monkeypatch, 3)  # one guarded, one not
    assert _groups(PARTITIONS, None, guarded=1) == [PARTITIONS]


def test_an_explicit_count_is_taken_as_given() -> None:
    assert _groups(PARTITIONS, 3) == [[0, 3], [1, 4], [2, 5]]
    assert _groups([0], 4) == [[0]]  # at most one per partition
