"""The Redis projection store: one Lua call per session per batch, all pipelined in one round trip.

Commit path: for each session an update carries the mark its state was folded from (`base`) and the
mark it reaches. The script applies state, appends turns, timeline entries and event ids, and moves
the mark only if the stored mark still equals `base`; otherwise it writes nothing and reports a
conflict (the projector reloads and folds again). A redelivered batch never reaches the script: the
folder skips records at or below the mark. Global indexes are updated after, idempotently.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from processors.indexes import index_changes
from processors.keys import Keys
from processors.projection_codec import (
    session_from_json,
    session_to_json,
    turn_from_json,
    turn_to_json,
)
from producers.ports import CommitResult
from schemas.errors import NotYetVisibleError, ProjectionError
from session_model.projection import Folded, Position, SessionUpdate
from session_model.session import Session, Turn
from session_model.timeline import TimelineEntry

# KEYS: state hash, turns list, timeline list, event-id set, deadlines zset, compaction-due set,
#       then one key per counter hash.
# ARGV: base mark ("" = none), new mark, state JSON, window, session id, deadline ms ("" = none),
#       compaction due ("1"/"0"), n_turns, turns..., n_tl, entries..., n_ids, ids...,
#       n_counters, (key index, field, increment)...
COMMIT_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'mark') or ''
if current ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'mark', ARGV[2], 'state', ARGV[3], 'window', ARGV[4])
local sid = ARGV[5]
if ARGV[6] == '' then
  redis.call('ZREM', KEYS[5], sid)
else
  redis.call('ZADD', KEYS[5], ARGV[6], sid)
end
if ARGV[7] == '1' then
  redis.call('SADD', KEYS[6], sid)
else
  redis.call('SREM', KEYS[6], sid)
end
local i = 8
for k = 2, 4 do
  local n = tonumber(ARGV[i])
  if n > 0 then
    local cmd = (k == 4) and 'SADD' or 'RPUSH'
    for j = i + 1, i + n, 4000 do
      redis.call(cmd, KEYS[k], unpack(ARGV, j, math.min(j + 3999, i + n)))
    end
  end
  i = i + n + 1
end
local counters = tonumber(ARGV[i])
for c = 1, counters do
  local base = i + (c - 1) * 3
  redis.call('HINCRBY', KEYS[tonumber(ARGV[base + 1])], ARGV[base + 2], ARGV[base + 3])
end
return 1
"""

# KEYS: state hash, turns list, event-id set. ARGV: "1" to include event ids.
READ_SCRIPT = """
local h = redis.call('HMGET', KEYS[1], 'state', 'mark', 'window')
if not h[1] then return false end
local window = tonumber(h[3])
local turns = {}
if window > 0 then turns = redis.call('LRANGE', KEYS[2], -window, -1) end
local ids = {}
if ARGV[1] == '1' then ids = redis.call('SMEMBERS', KEYS[3]) end
return {h[1], h[2], turns, ids}
"""


COMMIT_SHA = hashlib.sha1(COMMIT_SCRIPT.encode()).hexdigest()
READ_SHA = hashlib.sha1(READ_SCRIPT.encode()).hexdigest()


def commit_call(
    keys: Keys, update: SessionUpdate, compact_after: int | None, count: bool = True
) -> tuple[list[str], list[str | int | bytes]]:
    """The KEYS and ARGV of one session's commit (state, appends, indexes, counters)."""
    k = keys.session(update.session_id)
    partition = update.mark.partition
    turns = [turn_to_json(t) for t in update.turns]
    timeline = [orjson.dumps(e, default=str) for e in update.timeline]
    ids = [s.event.event_id for s in update.steps]
    changes = index_changes(update, keys, compact_after)
    counters = changes.counters if count else ()
    script_keys = [*k.all(), keys.deadlines(partition), keys.compaction_due(partition)]
    counter_args: list[str | int | bytes] = []
    for key, field_, increment in counters:
        if key not in script_keys[6:]:
            script_keys.append(key)
        counter_args.extend((script_keys.index(key, 6) + 1, field_, increment))
    args: list[str | int | bytes] = [
        "" if update.base is None else str(update.base),
        str(update.mark),
        session_to_json(update.state),
        len(update.state.turns),
        update.session_id,
        "" if changes.deadline_ms is None else changes.deadline_ms,
        "1" if changes.compaction_due else "0",
        len(turns),
        *turns,
        len(timeline),
        *timeline,
        len(ids),
        *ids,
        len(counters),
        *counter_args,
    ]
    return script_keys, args


def read_keys(keys: Keys, session_id: str) -> list[str]:
    """The KEYS of one session's read."""
    k = keys.session(session_id)
    return [k.state, k.turns, k.event_ids]


def parse_read(raw: Any) -> Folded | None:
    """Turn the read script's reply into a state and its mark."""
    if not raw:
        return None
    state, mark, turns, ids = raw
    return Folded(
        session_from_json(
            state,
            tuple(turn_from_json(t) for t in turns),
            frozenset(i.decode() if isinstance(i, bytes) else i for i in ids),
        ),
        Position.parse(mark.decode() if isinstance(mark, bytes) else mark),
    )


def _mark_reached(raw: Any, at_least: Position) -> bool:
    if raw is None:
        return False
    mark = Position.parse(raw.decode() if isinstance(raw, bytes) else raw)
    return mark.partition == at_least.partition and mark.offset >= at_least.offset


@dataclass
class RedisProjectionStore:
    """The projection store on a (synchronous) Redis client; readers and replay use this one."""

    client: redis.Redis
    keys: Keys = field(default_factory=Keys)
    poll_interval: float = 0.005
    compact_after: int | None = None
    count_stats: bool = True

    @classmethod
    def from_url(
        cls, url: str, keys: Keys | None = None, compact_after: int | None = None
    ) -> RedisProjectionStore:
        """Connect to `url`."""
        return cls(redis.Redis.from_url(url), keys or Keys(), compact_after=compact_after)

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip."""

        def queue(pipe: Any) -> None:
            for sid in session_ids:
                keys = read_keys(self.keys, sid)
                pipe.evalsha(READ_SHA, len(keys), *keys, "1")

        try:
            replies = self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"reading projections failed: {e}") from e
        found = {sid: parse_read(raw) for sid, raw in zip(session_ids, replies, strict=True)}
        return {sid: f for sid, f in found.items() if f is not None}

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip."""
        if not updates:
            return CommitResult()
        calls = [commit_call(self.keys, u, self.compact_after, self.count_stats) for u in updates]

        def queue(pipe: Any) -> None:
            for keys, args in calls:
                pipe.evalsha(COMMIT_SHA, len(keys), *keys, *args)
            pipe.sadd(self.keys.sessions, *[u.session_id for u in updates])

        try:
            replies = self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"committing projections failed: {e}") from e
        return _result(updates, replies)

    def _execute(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline of EVALSHA calls; load the scripts once if the server lost them."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            try:
                replies: list[Any] = pipe.execute()
                return replies
            except NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(COMMIT_SCRIPT)
                self.client.script_load(READ_SCRIPT)
        raise AssertionError("unreachable")

    def load(
        self, session_id: str, at_least: Position | None = None, timeout: float = 5.0
    ) -> Session | None:
        """The session; with `at_least`, wait (bounded) until the projection applied it."""
        if at_least is not None:
            self._wait(session_id, at_least, timeout)
        found = self.folded([session_id]).get(session_id)
        return found.state if found else None

    def _wait(self, session_id: str, at_least: Position, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        key = self.keys.session(session_id).state
        delay = self.poll_interval
        while True:
            try:
                raw = self.client.hget(key, "mark")
            except redis.RedisError as e:
                raise ProjectionError(f"reading the mark of {session_id} failed: {e}") from e
            if _mark_reached(raw, at_least):
                return
            if time.monotonic() >= deadline:
                raise NotYetVisibleError(
                    f"{session_id}: position {at_least} not applied within {timeout}s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def ids(self) -> list[str]:
        """Every projected session id, sorted."""
        try:
            members = self.client.smembers(self.keys.sessions)
        except redis.RedisError as e:
            raise ProjectionError(f"listing sessions failed: {e}") from e
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    def history(self, session_id: str) -> list[Turn]:
        """Every turn, summarised ones included."""
        try:
            raw = self.client.lrange(self.keys.session(session_id).turns, 0, -1)
        except redis.RedisError as e:
            raise ProjectionError(f"reading history failed: {e}") from e
        return [turn_from_json(t) for t in raw]

    def timeline(self, session_id: str, since: int = 0) -> list[TimelineEntry]:
        """Entries with `seq > since`."""
        try:
            raw = self.client.lrange(self.keys.session(session_id).timeline, 0, -1)
        except redis.RedisError as e:
            raise ProjectionError(f"reading the timeline failed: {e}") from e
        entries: list[TimelineEntry] = [orjson.loads(r) for r in raw]
        return [e for e in entries if e["seq"] > since]

    def drop(self, session_id: str) -> None:
        """Delete one session's projection."""
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.unlink(*self.keys.session(session_id).all())
            pipe.srem(self.keys.sessions, session_id)
            pipe.execute()
        except redis.RedisError as e:
            raise ProjectionError(f"dropping {session_id} failed: {e}") from e

    def clear(self) -> None:
        """Delete every key under this store's prefix."""
        try:
            batch: list[Any] = []
            for key in self.client.scan_iter(match=self.keys.pattern(), count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self.client.unlink(*batch)
                    batch = []
            if batch:
                self.client.unlink(*batch)
        except redis.RedisError as e:
            raise ProjectionError(f"clearing projections failed: {e}") from e


def _result(updates: Sequence[SessionUpdate], replies: Sequence[Any]) -> CommitResult:
    applied = tuple(u.session_id for u, r in zip(updates, replies, strict=False) if r == 1)
    conflicts = tuple(u.session_id for u, r in zip(updates, replies, strict=False) if r != 1)
    return CommitResult(applied, conflicts)


@dataclass
class AsyncRedisProjectionStore:
    """The projector's side of the store on `redis.asyncio` (never blocks the event loop)."""

    client: aioredis.Redis
    keys: Keys = field(default_factory=Keys)
    compact_after: int | None = None

    async def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip."""

        def queue(pipe: Any) -> None:
            for sid in session_ids:
                keys = read_keys(self.keys, sid)
                pipe.evalsha(READ_SHA, len(keys), *keys, "1")

        try:
            replies = await self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"reading projections failed: {e}") from e
        found = {sid: parse_read(raw) for sid, raw in zip(session_ids, replies, strict=True)}
        return {sid: f for sid, f in found.items() if f is not None}

    async def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip."""
        if not updates:
            return CommitResult()
        calls = [commit_call(self.keys, u, self.compact_after) for u in updates]

        def queue(pipe: Any) -> None:
            for keys, args in calls:
                pipe.evalsha(COMMIT_SHA, len(keys), *keys, *args)
            pipe.sadd(self.keys.sessions, *[u.session_id for u in updates])

        try:
            replies = await self._execute(queue)
        except redis.RedisError as e:
            raise ProjectionError(f"committing projections failed: {e}") from e
        return _result(updates, replies)

    async def _execute(self, queue: Callable[[Any], None]) -> list[Any]:
        """Run a pipeline of EVALSHA calls; load the scripts once if the server lost them."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            queue(pipe)
            try:
                replies: list[Any] = await pipe.execute()
                return replies
            except NoScriptError:
                if attempt == 2:
                    raise
                await self.client.script_load(COMMIT_SCRIPT)
                await self.client.script_load(READ_SCRIPT)
        raise AssertionError("unreachable")

    async def due_work(
        self, partitions: Iterable[int]
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """Open deadlines and compaction-due sessions of these partitions (one round trip)."""
        owned = sorted(partitions)
        try:
            pipe = self.client.pipeline(transaction=False)
            for p in owned:
                pipe.zrange(self.keys.deadlines(p), 0, -1, withscores=True)
                pipe.smembers(self.keys.compaction_due(p))
            replies = await pipe.execute()
        except redis.RedisError as e:
            raise ProjectionError(f"reading due work failed: {e}") from e
        deadlines: dict[str, tuple[int, int]] = {}
        due: dict[str, int] = {}
        for i, p in enumerate(owned):
            for member, score in replies[2 * i]:
                deadlines[_text(member)] = (int(score), p)
            for member in replies[2 * i + 1]:
                due[_text(member)] = p
        return deadlines, due


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
