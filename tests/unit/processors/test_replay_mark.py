"""A rebuild that clears every projection marks them half built until its fold has ended: one that
dies after the clear leaves the mark (workers refuse to start on it), one that ends takes it
away, and one run over it (the remedy) proceeds. One session's rebuild marks that session alone
(`Keys.restoring`) the same way. No broker: the log's ends and the fold are
faked; Redis is a dict."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from unittest.mock import ANY

import pytest

import processors.replay as replay_module
from processors.replay import ReplayReport, replay
from projections import scripts
from projections.keys import Keys
from projections.redis_store import RedisProjectionStore
from schemas.errors import LogError
from session_model.signing import TrustedKeys


class DictRedis:
    """The few commands the rebuild's bookkeeping sends (GET, SET, DEL, EXISTS, SCAN, UNLINK,
    HSET, HDEL, and the EVAL that takes a restore's mark away)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def pipeline(self, transaction: bool = False) -> DictRedis._Pipe:
        return DictRedis._Pipe(self)

    def scan_iter(self, match: str, count: int = 10) -> Iterator[str]:
        yield from [k for k in self.data if fnmatch.fnmatchcase(k, match)]

    def unlink(self, *keys: str) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    class _Pipe:
        def __init__(self, redis: DictRedis) -> None:
            self.redis, self.commands = redis, []  # type: list[tuple[Any, ...]]

        def execute_command(self, *command: Any) -> None:
            self.commands.append(command)

        def execute(self) -> list[Any]:
            data, replies = self.redis.data, []
            for name, key, *args in self.commands:
                if name == "GET":
                    replies.append(data.get(key))
                elif name == "SET":
                    data[key] = args[0]
                    replies.append(True)
                elif name == "DEL":
                    replies.append(int(data.pop(key, None) is not None))
                elif name == "EXISTS":
                    replies.append(int(key in data))
                elif name == "HSET":
                    data.setdefault(key, {})[args[0]] = args[1]
                    replies.append(1)
                elif name == "EVALSHA" and key == scripts.UNMARK.sha:  # lua/unmark.lua
                    hashed, field, mark = args[1:4]
                    same = data.get(hashed, {}).get(field) == mark
                    replies.append(int(same))
                    if same:
                        del data[hashed][field]
                        if not data[hashed]:
                            del data[hashed]
                elif name == "HDEL":
                    replies.append(int(data.get(key, {}).pop(args[0], None) is not None))
                    if not data.get(key, True):
                        del data[key]
                else:
                    raise AssertionError(f"unexpected command {name}")
            return replies


KEYS = Keys("t", partitions=2)


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> RedisProjectionStore:
    monkeypatch.setattr(replay_module, "_end_offsets", lambda *a: ({0: 3, 1: 2}, 2))
    redis: Any = DictRedis()
    redis.data[KEYS.session("a").state] = "a projection"
    return RedisProjectionStore(redis, KEYS, follow=False)


def _mark(store: RedisProjectionStore) -> str | None:
    return store.client.data.get(KEYS.rebuild_incomplete())  # type: ignore[union-attr]


def _fold(store: RedisProjectionStore, fails: bool) -> Any:
    """A fold that finds the projections cleared and the mark set, then fails or ends."""

    def run(job: Any, ends: Any, progress: Any, grow: Any = None) -> ReplayReport:
        assert KEYS.session("a").state not in store.client.data  # type: ignore[operator]
        assert _mark(store) is not None
        if fails:
            raise LogError("reading t.events got no further for 60s")
        return ReplayReport(5, 1)

    return run


def test_a_rebuild_that_dies_after_its_clear_leaves_the_mark(
    store: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(replay_module._Job, "run", _fold(store, fails=True))
    with pytest.raises(LogError, match="no further"):
        replay("127.0.0.1:9", "t.events", store, TrustedKeys.none(), processes=1)
    found = store.incomplete_rebuild()
    assert found is not None and found[1] == "replay --full"
    assert found[0].startswith("20")  # when it began (ISO 8601)


def test_a_rebuild_that_ends_takes_the_mark_away_even_one_run_over_it(
    store: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.client.data[KEYS.rebuild_incomplete()] = "2026-01-01T00:00:00+00:00 replay"  # type: ignore[union-attr]
    monkeypatch.setattr(replay_module._Job, "run", _fold(store, fails=False))
    report = replay("127.0.0.1:9", "t.events", store, TrustedKeys.none(), processes=1)
    assert report.records == 5
    assert _mark(store) is None
    assert store.incomplete_rebuild() is None


@pytest.mark.parametrize("kind", ["session", "live"])
def test_one_sessions_rebuild_and_a_live_one_set_no_mark(
    store: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    def run(job: Any, ends: Any, progress: Any, grow: Any = None) -> ReplayReport:
        assert _mark(store) is None
        raise LogError("reading failed")

    monkeypatch.setattr(replay_module._Job, "run", run)
    monkeypatch.setattr(RedisProjectionStore, "drop", lambda self, sid, **options: None)
    options: dict[str, Any] = {"session_id": "a"} if kind == "session" else {"clear": False}
    with pytest.raises(LogError):
        replay("127.0.0.1:9", "t.events", store, TrustedKeys.none(), processes=1, **options)
    assert _mark(store) is None


@pytest.mark.parametrize("fails", [True, False])
def test_one_sessions_rebuild_marks_that_session_until_its_fold_has_ended(
    store: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    restoring = KEYS.restoring(KEYS.partition_of("a"))
    dropped: list[str] = []

    def drop(self: RedisProjectionStore, sid: str, **options: bool) -> None:
        assert options == {"restoring": True}
        assert store.client.data[restoring] == {"a": ANY}  # type: ignore[union-attr]
        dropped.append(sid)

    def run(job: Any, ends: Any, progress: Any, grow: Any = None) -> ReplayReport:
        assert dropped == ["a"]
        if fails:
            raise LogError("reading failed")
        return ReplayReport(3, 1)

    monkeypatch.setattr(replay_module._Job, "run", run)
    monkeypatch.setattr(RedisProjectionStore, "drop", drop)
    if fails:
        with pytest.raises(LogError):
            replay(
                "127.0.0.1:9", "t.events", store, TrustedKeys.none(), session_id="a", processes=1
            )
        began = store.client.data[restoring]["a"]  # type: ignore[union-attr]
        assert began.startswith("20")  # when it began (ISO 8601)
    else:
        replay("127.0.0.1:9", "t.events", store, TrustedKeys.none(), session_id="a", processes=1)
        assert restoring not in store.client.data  # type: ignore[operator]
    assert _mark(store) is None


def test_a_restore_takes_away_its_own_mark_only(store: RedisProjectionStore) -> None:
    first = store.begin_restore("a", datetime(2026, 1, 1, tzinfo=UTC))
    second = store.begin_restore("a", datetime(2026, 1, 1, tzinfo=UTC))  # another, meanwhile
    restoring = KEYS.restoring(KEYS.partition_of("a"))
    store.end_restore("a", first)
    assert store.client.data[restoring] == {"a": second}  # type: ignore[union-attr]
    store.end_restore("a", second)
    assert restoring not in store.client.data  # type: ignore[operator]


def test_one_sessions_rebuild_reads_the_log_s_ends_again_after_its_mark_and_drop(
    store: RedisProjectionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker may apply an event of the session after a first read of the ends and before the
    # mark (or onto its cached state before the drop): the fold must reach past that event.
    steps: list[str] = []
    restoring = KEYS.restoring(KEYS.partition_of("a"))

    def ends(*args: Any) -> tuple[dict[int, int], int]:
        marked = restoring in store.client.data  # type: ignore[operator]
        steps.append("ends after the mark" if marked else "ends")
        return ({0: 3, 1: 2}, 2) if not marked else ({0: 5, 1: 2}, 2)

    def drop(self: RedisProjectionStore, sid: str, **options: bool) -> None:
        steps.append("drop")

    def run(job: Any, ends: Any, progress: Any, grow: Any = None) -> ReplayReport:
        steps.append(f"fold to {dict(ends)}")
        return ReplayReport(3, 1)

    monkeypatch.setattr(replay_module, "_end_offsets", ends)
    monkeypatch.setattr(RedisProjectionStore, "drop", drop)
    monkeypatch.setattr(replay_module._Job, "run", run)
    replay("127.0.0.1:9", "t.events", store, TrustedKeys.none(), session_id="a", processes=1)
    assert steps == ["ends", "drop", "ends after the mark", "fold to {0: 5, 1: 2}"]
