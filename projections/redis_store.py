"""The Redis projection stores: the synchronous one (readers, replay) and the asyncio one (worker).

Both build their round trips with `projections.requests` (one Lua call per 64 sessions of a batch,
pipelined in one round trip) and differ only in the executor. The layout of a session's keys is
described in `projections.layout`; the scripts are `projections/lua/*.lua`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from projections import requests
from projections import waiting as index
from projections.codec import history_from_json, turn_from_json
from projections.keys import Keys
from projections.redis_client import (
    NO_AUTH,
    REDIS_ERRORS,
    AsyncClient,
    RedisAuth,
    SyncClient,
    sync_client,
)
from projections.requests import (
    COMMIT_GROUP,
    EXPIRE_BATCH,
    NOT_DURABLE,
    Durability,
    RawState,
    Restored,
    Retention,
    Retired,
    RetiredEntry,
    commit_call,
    drop_command,
    execute,
    execute_async,
    floor_ms,
    parse_timeline,
    restore_call,
    text,
)
from schemas.errors import NotYetVisibleError, ProjectionError, SessionRestoringError
from session_model.ports import CommitResult
from session_model.projection import Expired, Folded, Position, SessionUpdate
from session_model.questions import Cursor, WaitingPage
from session_model.session import HISTORY_KINDS, Decision, History, Session, Turn, history_kinds
from session_model.timeline import TimelineEntry, last

# How often a store reads the partitions' generations again (a live rebuild moves them; a
# commit in a generation left behind is refused anyway, and makes its writer read them at once).
GENERATIONS_TTL_S = 1.0


def _key_text(key: bytes | str) -> str:
    # Any key SCAN finds (one not of this project's may be no UTF-8).
    return key.decode(errors="replace") if isinstance(key, bytes) else key


def _mark_reached(raw: Any, at_least: Position) -> bool:
    if raw is None:
        return False
    mark = Position.parse(raw.decode() if isinstance(raw, bytes) else raw)
    return mark.partition == at_least.partition and mark.offset >= at_least.offset


@dataclass
class RedisProjectionStore:
    """The projection store on a (synchronous) Redis client; readers and replay use this one."""

    client: SyncClient
    keys: Keys  # the events topic's partitions too: every key lives in its partition's slot
    poll_interval: float = 0.005
    compact_after: int | None = None
    count_stats: bool = True
    retention: Retention | None = None  # ended sessions' TTL, indexed by commits (None: none)
    track: bool = False  # note committed sessions for the next snapshot (snapshots are taken)
    durability: Durability = NOT_DURABLE  # replicas a write must reach before it is done
    follow: bool = True  # follow the partitions' generations (False: a rebuild's own target)
    # Its commits restore expired sessions (`replay --session`): a tombstone does not refuse
    # them, they take it away (the drop before them keeps it: `drop(restoring=True)`).
    restores: bool = False
    _generations_at: float = field(default=float("-inf"), repr=False, compare=False)

    def refresh_generations(self) -> tuple[int, ...]:
        """Read the generation each partition's keys are in, and use those keys from now on."""
        found = execute(self.client, requests.generations(self.keys))
        self.keys = self.keys.in_generations(found)
        self._generations_at = time.monotonic()
        return found

    def _fresh(self) -> None:
        if self.follow and time.monotonic() - self._generations_at >= GENERATIONS_TTL_S:
            self.refresh_generations()

    @classmethod
    def from_url(
        cls,
        url: str,
        keys: Keys,
        compact_after: int | None = None,
        timeout: float | None = None,
        auth: RedisAuth = NO_AUTH,
        *,
        cluster: bool = False,
    ) -> RedisProjectionStore:
        """A store on `url` (`timeout`: seconds a connect or a reply may take; one retry;
        `cluster`: `url` is a node of a Redis Cluster)."""
        client = sync_client(url, timeout, auth, cluster=cluster)
        return cls(client, keys, compact_after=compact_after)

    @property
    def partitions(self) -> int:
        """The events topic's partitions (the indexes and counters are kept per partition)."""
        return self.keys.partitions

    def waiting(
        self, reason: str | None = None, after: Cursor | None = None, limit: int = 50
    ) -> WaitingPage:
        """Waiting questions, soonest deadline first, from `after` on (one round trip)."""
        self._fresh()
        request = index.page(self.keys, range(self.partitions), reason, after, limit)
        return execute(self.client, request)

    def waiting_by_reason(self) -> dict[str, int]:
        """Waiting questions per reason."""
        self._fresh()
        return execute(self.client, index.by_reason(self.keys, range(self.partitions)))

    def fleet(self) -> dict[tuple[str, str], int]:
        """Sessions per (status, mode)."""
        self._fresh()
        return execute(self.client, index.fleet(self.keys, range(self.partitions)))

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip."""
        self._fresh()
        return execute(self.client, requests.read(self.keys, session_ids))

    def marks(self, session_ids: Sequence[str]) -> dict[str, Position]:
        """The stored mark of each known session, in one round trip."""
        self._fresh()
        return execute(self.client, requests.marks(self.keys, session_ids))

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip."""
        self._fresh()
        if not updates:
            return CommitResult()
        retention = self.retention
        calls = [
            commit_call(
                self.keys,
                u,
                self.compact_after,
                self.count_stats,
                retention=retention,
                track=self.track,
                restore=self.restores,
            )
            for u in updates
        ]
        request = requests.commit(
            self.keys, [u.session_id for u in updates], calls, [u.mark.partition for u in updates]
        )
        return self._committed(execute(self.client, request, self.durability))

    def restore(self, sessions: Sequence[Restored]) -> CommitResult:
        """Write sessions from their snapshots, in one pipelined round trip (a session that
        already has a mark is refused: `conflicts`)."""
        self._fresh()
        if not sessions:
            return CommitResult()
        calls = [
            restore_call(
                self.keys,
                r,
                self.compact_after,
                self.count_stats,
                retention=self.retention,
                restore=self.restores,
            )
            for r in sessions
        ]
        sids = [r.folded.state.id for r in sessions]
        request = requests.commit(self.keys, sids, calls, [r.mark.partition for r in sessions])
        return self._committed(execute(self.client, request, self.durability))

    def restore_retired(self, sessions: Sequence[Retired]) -> list[str]:
        """Write retired sessions' tombstones and counters from their stubs (one round trip);
        those refused, a tombstone or a projection being there already."""
        self._fresh()
        if not sessions:
            return []
        request = requests.retire(self.keys, sessions, self.count_stats)
        return execute(self.client, request, self.durability)

    def _committed(self, done: requests.Committed) -> CommitResult:
        if done.stale_generation:  # the refused sessions are read again in the new generation
            self.refresh_generations()
        return done.result

    def load(
        self, session_id: str, at_least: Position | None = None, timeout: float = 5.0
    ) -> Session | None:
        """The session; with `at_least`, wait (bounded) until the projection applied it.

        `SessionRestoringError` while a `replay --session` of it is under way or died
        (`begin_restore`): what is stored is half rebuilt.
        """
        if at_least is not None:
            self._wait(session_id, at_least, timeout)
        self._fresh()
        found, restoring = execute(self.client, requests.loaded(self.keys, session_id))
        if restoring is not None:
            began = restoring.partition(" ")[0]
            raise SessionRestoringError(
                f"session {session_id!r} is half rebuilt: a `replay --session` of it began at "
                f"{began} and has not ended; wait for it to end, or run `milpa-sessions "
                f"replay --session {session_id}` again"
            )
        return found.state if found else None

    def _wait(self, session_id: str, at_least: Position, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = self.poll_interval
        while True:
            self._fresh()  # a live rebuild may move the session's partition meanwhile
            try:
                raw = self.client.hget(self.keys.session(session_id).state, "mark")
            except REDIS_ERRORS as e:
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
        """Every projected session id, sorted (a SCAN over the state hashes: no index is kept)."""
        self._fresh()
        found: set[str] = set()
        keys = self.keys
        try:
            for generation in keys.in_use():
                for key in self.client.scan_iter(
                    match=keys.state_pattern(generation), count=1000, _type="hash"
                ):
                    sid = keys.session_of(text(key))
                    if sid is not None and keys.generation(keys.partition_of(sid)) == generation:
                        found.add(sid)
        except REDIS_ERRORS as e:
            raise ProjectionError(f"listing sessions failed: {e}") from e
        return sorted(found)

    def history(self, session_id: str) -> list[Turn]:
        """Every turn, summarised ones included."""
        self._fresh()
        try:
            raw = self.client.lrange(self.keys.session(session_id).turns, 0, -1)
        except REDIS_ERRORS as e:
            raise ProjectionError(f"reading history failed: {e}") from e
        return [turn_from_json(t) for t in raw]

    def facts(self, session_id: str, kinds: Iterable[str] | None = None) -> History:
        """Every call, observation, execution, decision and rejection (one round trip); only
        the lists of `kinds` are read, if given."""
        wanted = history_kinds(kinds)
        self._fresh()
        k = self.keys.session(session_id)
        read = [kind in wanted for kind in HISTORY_KINDS]
        try:
            pipe = self.client.pipeline(transaction=True)  # a commit may move them in between
            pipe.hget(k.state, "mark")
            for key, reading in zip(k.history, read, strict=True):
                if reading:
                    pipe.lrange(key, 0, -1)
            mark, *found = pipe.execute()
        except REDIS_ERRORS as e:
            raise ProjectionError(f"reading the history failed: {e}") from e
        replies = iter(found)
        lists = [next(replies) if reading else [] for reading in read]
        # (not `load`: a replay reading a session it is restoring must not be refused)
        folded = self.folded([session_id]).get(session_id) if mark is not None else None
        return history_from_json(session_id, folded.state.seq if folded else 0, lists)

    def timeline(
        self, session_id: str, since: int = 0, latest: int | None = None
    ) -> list[TimelineEntry]:
        """Entries with `seq > since` (the last `latest` of them if given: only those are read
        from the list, whose older entries precede them; the state hash holds the first ones)."""
        if latest is not None and latest <= 0:
            return last([], latest)  # nothing to read (or InvalidCall, below 0)
        self._fresh()
        k = self.keys.session(session_id)
        try:
            pipe = self.client.pipeline(transaction=True)  # a commit may move them in between
            pipe.hgetall(k.state)
            pipe.lrange(k.timeline, 0 if latest is None else -latest, -1)
            raw = pipe.execute()
        except REDIS_ERRORS as e:
            raise ProjectionError(f"reading the timeline failed: {e}") from e
        entries = parse_timeline(raw, session_id, since)
        return entries if latest is None else last(entries, latest)

    def drop(self, session_id: str, *, restoring: bool = False) -> None:
        """Delete one session's projection, its entries in the waiting index and counts, the
        deadlines and compaction-due indexes, its retention entry and its tombstone (a rebuild
        of it follows: `replay --session`).

        `restoring`: keep its tombstone, which the restore's first commit takes away (`restores`):
        a worker's commit of an event of it meanwhile still finds it expired instead of writing
        it from nothing. And (snapshots taken: `track`) in the same script call, hold it in its
        partition's unsnapshotted index at offset 0, so that no checkpoint passes its events
        before a snapshot of it, whole again, is taken (a restore that dies before its first
        commit would otherwise leave a rebuild from snapshots its older snapshot for whole).
        """
        self._fresh()
        p = self.keys.partition_of(session_id)
        call = drop_command(
            self.keys, session_id, p, hold=restoring and self.track, keep_tombstone=restoring
        )
        request = requests.Request([call], lambda _: None, f"dropping {session_id} failed", True)
        execute(self.client, request, self.durability)

    def expired(self, session_id: str) -> Expired | None:
        """The session's tombstone if its projection expired (None: projected, or unknown)."""
        self._fresh()
        p = self.keys.partition_of(session_id)
        return execute(self.client, requests.expired(self.keys, session_id, p))

    def expire_due(self, now: datetime, limit: int = EXPIRE_BATCH) -> list[str]:
        """Drop the ended sessions of every partition whose retention deadline is at or before
        `now` (up to `limit` per partition), leaving tombstones (and with `track`, retired
        entries for the snapshot rounds' stubs); the ids dropped."""
        self._fresh()
        now_ms = floor_ms(now)
        request = requests.retention_due(self.keys, range(self.partitions), now_ms, limit)
        due = execute(self.client, request)
        if not due:
            return []
        expire = requests.expire(self.keys, due, now_ms, retire=self.track)
        return execute(self.client, expire, self.durability)

    def switch_generation(self, partition: int, current: int, new: int) -> int:
        """Move a partition to generation `new` if it committed at least as far there as in
        `current` (lua/switch.lua): 1 moved, 0 the current one is ahead, -1 not in `current`."""
        return execute(
            self.client, requests.switch(self.keys, partition, current, new), self.durability
        )

    def lease(self, token: str, ttl_ms: int, action: requests.LeaseAction) -> bool:
        """Take, renew or give up the live-rebuild lease as `token`: whether it happened."""
        return execute(self.client, requests.lease(self.keys, token, ttl_ms, action))

    def rebuild_running(self) -> bool:
        """Whether a live rebuild holds the lease on these projections now."""
        return execute(self.client, requests.lease_held(self.keys))

    def begin_restore(self, session_id: str, at: datetime) -> str:
        """Mark one session half rebuilt, from before a `replay --session` drops it until
        `end_restore` (`Keys.restoring`): `load` refuses it meanwhile. The mark, for
        `end_restore`."""
        self._fresh()  # in the generation readers read
        mark = f"{at.isoformat()} {secrets.token_hex(4)}"
        key = self.keys.restoring(self.keys.partition_of(session_id))
        self._write(("HSET", key, session_id, mark), f"marking {session_id} failed")
        return mark

    def end_restore(self, session_id: str, mark: str) -> None:
        """Take the mark of `begin_restore` away (the session is whole again), unless another
        restore of it has set its own since."""
        self._fresh()
        p = self.keys.partition_of(session_id)
        command = requests.unmark_command(self.keys, session_id, p, mark)
        self._write(command, f"unmarking {session_id} failed")

    def begin_rebuild(self, what: str, at: datetime) -> None:
        """Mark these projections half built by `what` (e.g. "replay --full"), begun `at`, until
        `end_rebuild` (`Keys.rebuild_incomplete`; a clear leaves the mark)."""
        command = ("SET", self.keys.rebuild_incomplete(), f"{at.isoformat()} {what}")
        self._write(command, "marking the rebuild under way failed")

    def end_rebuild(self) -> None:
        """Take the mark of `begin_rebuild` away: the projections are whole again."""
        self._write(("DEL", self.keys.rebuild_incomplete()), "unmarking the rebuild failed")

    def incomplete_rebuild(self) -> tuple[str, str] | None:
        """(when it began, what) of a rebuild that cleared these projections and has not
        finished (`begin_rebuild`), or None."""
        request = requests.Request(
            [("GET", self.keys.rebuild_incomplete())],
            lambda replies: None if replies[0] is None else text(replies[0]),
            "reading the rebuild mark failed",
        )
        found = execute(self.client, request)
        if found is None:
            return None
        began, _, what = found.partition(" ")
        return began, what

    def _write(self, command: tuple[str, ...], failing: str) -> None:
        request = requests.Request([command], lambda _: None, failing, writes=True)
        execute(self.client, request, self.durability)

    def drop_generation(self, generation: int) -> int:
        """Delete every key of a generation and what the generation hashes note of it (its
        highest offsets committed); the keys deleted."""
        field_ = f"a{generation}"
        request = requests.Request(
            [("HDEL", self.keys.generation_key(p), field_) for p in range(self.partitions)],
            lambda _: None,
            f"forgetting generation {generation} failed",
            writes=True,
        )
        execute(self.client, request, self.durability)
        return self._unlink(self.keys.generation_pattern(generation))

    def clear(self) -> None:
        """Delete every projection under this store's prefix (every generation, and their
        hashes: `Keys.rebuilds`), never the console's sign-outs and sign-in counters nor the
        rebuild lease."""
        self._unlink(self.keys.pattern(), self.keys.rebuilds)
        self.keys = self.keys.in_generations(())

    def close(self) -> None:
        """Close the client's connections; the store is not used after."""
        try:
            self.client.close()
        except REDIS_ERRORS as e:
            raise ProjectionError(f"closing the Redis client failed: {e}") from e

    def _unlink(self, pattern: str, only: Callable[[str], bool] | None = None) -> int:
        """Delete the keys matching `pattern` (and `only`, if given); how many."""
        deleted = 0
        try:
            batch: list[Any] = []
            for key in self.client.scan_iter(match=pattern, count=1000):
                if only is not None and not only(_key_text(key)):
                    continue
                batch.append(key)
                if len(batch) >= 1000:
                    deleted += self.client.unlink(*batch)
                    batch = []
            if batch:
                deleted += self.client.unlink(*batch)
        except REDIS_ERRORS as e:
            raise ProjectionError(f"deleting projections ({pattern}) failed: {e}") from e
        return deleted


@dataclass
class AsyncRedisProjectionStore:
    """The projector's side of the store on `redis.asyncio` (never blocks the event loop)."""

    client: AsyncClient
    keys: Keys  # the events topic's partitions too: every key lives in its partition's slot
    compact_after: int | None = None
    retention: Retention | None = None  # ended sessions' TTL, indexed by commits (None: none)
    track: bool = False  # note committed sessions for the next snapshot (snapshots are taken)
    durability: Durability = NOT_DURABLE  # replicas a write must reach before it is done
    follow: bool = True  # follow the partitions' generations (a live rebuild moves them)
    _generations_at: float = field(default=float("-inf"), repr=False, compare=False)

    async def refresh_generations(self) -> tuple[int, ...]:
        """Read the generation each partition's keys are in, and use those keys from now on."""
        found = await execute_async(self.client, requests.generations(self.keys))
        self.keys = self.keys.in_generations(found)
        self._generations_at = time.monotonic()
        return found

    def use_partitions(self, partitions: int) -> None:
        """Name keys for a topic of `partitions` partitions (the generations read at next use)."""
        self.keys = Keys(self.keys.prefix, partitions=partitions)
        self._generations_at = float("-inf")

    async def _fresh(self) -> None:
        if self.follow and time.monotonic() - self._generations_at >= GENERATIONS_TTL_S:
            await self.refresh_generations()

    async def folded(
        self,
        session_ids: Sequence[str],
        *,
        event_ids: bool = True,
        unreadable: dict[str, str] | None = None,
        rebuilding: set[str] | None = None,
    ) -> dict[str, Folded]:
        """State, mark and event ids of the known sessions, in one round trip.

        `event_ids=False` leaves `Session.event_ids` empty, for readers that never fold (the
        scheduler): a session's ids are most of what a read carries once it has a long life.
        With `unreadable`, a session whose projection does not decode, or that a `replay
        --session` is rebuilding (also put in `rebuilding`), is put there (id -> why) instead of
        failing the read (`requests.read`).

        With `durability` on, the read waits for the replicas as a write does. A worker that finds
        events already applied moves its Kafka offsets past them: a commit whose own `WAIT` came
        up short (or whose worker died before it) must be on the replicas before that happens,
        or a failover could still lose it.
        """
        await self._fresh()
        request = requests.read(
            self.keys,
            session_ids,
            event_ids=event_ids,
            unreadable=unreadable,
            rebuilding=rebuilding,
        )
        return await execute_async(self.client, request, self.durability, settle=True)

    async def decisions(
        self,
        session_ids: Sequence[str],
        latest: Sequence[int] | None = None,
        *,
        unreadable: dict[str, str] | None = None,
    ) -> dict[str, tuple[Decision, ...]]:
        """The decisions of these sessions, from their history lists (one round trip): every one,
        or the latest `latest[i]` of session i. With `unreadable`, a history that does not
        decode is left out and put there (id -> why) instead of failing the read."""
        await self._fresh()
        request = requests.decisions(self.keys, session_ids, latest, unreadable=unreadable)
        return await execute_async(self.client, request)

    async def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply every update (compare-and-set on its mark) in one pipelined round trip.

        The arguments are built a script call's worth of sessions at a time, with a yield to the
        event loop between (a big batch's took ≈ 30 ms: a deadline would have waited as long).
        """
        await self._fresh()
        if not updates:
            return CommitResult()
        # One generation for every call: the pauses below may let the worker's other work read
        # the generations again (`self.keys` changes). Calls built before with the new
        # generation's number would name the old one's keys, which the fence lets through, and
        # their writes would land where a live rebuild is about to drop. With the keys read
        # once, a partition that moved meanwhile refuses them (3) and they are folded again.
        keys = self.keys
        calls = []
        for at in range(0, len(updates), COMMIT_GROUP):
            if at:
                await asyncio.sleep(0)
            calls += [
                commit_call(keys, u, self.compact_after, retention=self.retention, track=self.track)
                for u in updates[at : at + COMMIT_GROUP]
            ]
        sids = [u.session_id for u in updates]
        request = requests.commit(keys, sids, calls, [u.mark.partition for u in updates])
        done = await execute_async(self.client, request, self.durability)
        if done.stale_generation:  # the refused sessions are read again in the new generation
            await self.refresh_generations()
        return done.result

    async def due_work(
        self, partitions: Iterable[int], until_ms: int | None = None
    ) -> requests.DueWork:
        """Deadlines (all, or up to `until_ms`) and compaction-due sessions of these partitions.

        One round trip. The in-worker scheduler reads everything when it takes over partitions;
        the standalone scheduler polls a window ahead.
        """
        await self._fresh()
        return await execute_async(self.client, requests.due_work(self.keys, partitions, until_ms))

    async def expire_due(
        self, settled: Mapping[int, int], now: datetime, limit: int = EXPIRE_BATCH
    ) -> list[str]:
        """Drop the ended sessions of these partitions (each with its settled offset) whose
        retention deadline is at or before `now` and whose last event is below the settled
        offset (up to `limit` per partition, two round trips), leaving tombstones (and with
        `track`, retired entries for the snapshot rounds' stubs); the ids dropped.

        Each drop checks inside the script: a session restored meanwhile, expired by another
        worker's sweep (a rebalance), or whose last batch is not settled yet, is left as it is
        (the last looked at again a minute later).
        """
        await self._fresh()
        now_ms = floor_ms(now)
        due = await execute_async(
            self.client, requests.retention_due(self.keys, settled, now_ms, limit)
        )
        if not due:
            return []
        expire = requests.expire(self.keys, due, now_ms, retire=self.track, settled=settled)
        return await execute_async(self.client, expire, self.durability)

    async def unsnapshotted(
        self, partition: int, limit: int = requests.SNAPSHOT_PAGE
    ) -> list[tuple[str, int]]:
        """Sessions of a partition applied since their latest snapshot, with the first offset
        applied since, lowest first (up to `limit`)."""
        await self._fresh()
        return await execute_async(self.client, requests.unsnapshotted(self.keys, partition, limit))

    async def raw_states(
        self, partition: int, session_ids: Sequence[str]
    ) -> dict[str, RawState | None]:
        """The stored state of these sessions of a partition as a snapshot holds it (one round
        trip)."""
        await self._fresh()
        request = requests.raw_states(self.keys, partition, session_ids)
        return await execute_async(self.client, request)

    async def retired(
        self, partition: int, cursor: int = 0, limit: int = requests.SNAPSHOT_PAGE
    ) -> tuple[int, list[RetiredEntry]]:
        """A page of the partition's retired entries, as stored: the cursor to go on from (0:
        done) and the entries."""
        await self._fresh()
        return await execute_async(
            self.client, requests.retired(self.keys, partition, cursor, limit)
        )

    async def unretire(self, partition: int, entries: Sequence[RetiredEntry]) -> None:
        """Forget retired entries whose stubs were acknowledged (each only if unchanged)."""
        if not entries:
            return
        await self._fresh()
        request = requests.unretire(self.keys, partition, entries)
        await execute_async(self.client, request, self.durability)

    async def snapped(
        self, partition: int, covered: Sequence[tuple[str, Position | None]]
    ) -> int | None:
        """Take sessions whose snapshots were acknowledged out of the partition's unsnapshotted
        index; the lowest first offset left in it (None: none)."""
        await self._fresh()
        request = requests.snapped(self.keys, partition, covered)
        return await execute_async(self.client, request, self.durability)
