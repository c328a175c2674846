"""Redis requests built once, run by a synchronous or an asynchronous executor.

A `Request` is the commands of one pipelined round trip and how to read their replies. The sync
store (readers, replay) and the async store (the worker, the scheduler) build the same requests
and differ only in the executor: `execute` or `execute_async`. Both load the scripts once when
the server lost them (a restart, `SCRIPT FLUSH`) and wrap driver errors in `ProjectionError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, Literal, TypeVar

import orjson
import redis
import redis.asyncio as aioredis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    TryAgainError,
)

from projections import scripts
from projections.cards import index_entry
from projections.codec import (
    check_version,
    decisions_from_json,
    entry_from_json,
    entry_to_json,
    fact_to_json,
    pack_event_ids,
    session_from_blob,
    session_to_blob,
    summary_from_stored,
    summary_to_stored,
    turn_from_json,
    turn_to_json,
    unpack_event_ids,
)
from projections.indexes import ceil_ms, index_changes
from projections.keys import Keys
from projections.layout import ELSEWHERE, WHOLE
from projections.redis_client import (
    REDIS_ERRORS,
    AsyncClient,
    AsyncCluster,
    SyncClient,
    SyncCluster,
)
from schemas import events as ev
from schemas.errors import (
    ConfigurationError,
    CorruptProjectionError,
    ProjectionError,
    ReplicationLagError,
)
from session_model.dedupe import CHUNK, RecentIds
from session_model.fold import Kind
from session_model.ports import CommitResult
from session_model.projection import Expired, Folded, Position, SessionUpdate
from session_model.session import HISTORY_KINDS, Decision, HistoryRecord
from session_model.timeline import TimelineEntry

T = TypeVar("T")
Call = tuple[list[str], list[str | int | bytes]]
"""A script call's KEYS and ARGV."""

# Sessions per commit script call: the per-call cost (KEYS and ARGV tables, the call itself) and
# the counters are paid once per group, while Redis still serves other clients between groups
# (a group of 64 runs for ~1-2 ms).
COMMIT_GROUP = 64
# Sessions per read script call: most reads of a busy worker are of sessions it has never seen,
# where the script call itself was most of the cost (≈ 4 µs of Redis each).
READ_GROUP = 64


@dataclass(frozen=True, slots=True)
class Request(Generic[T]):
    """The commands of one pipelined round trip and how to read their replies."""

    commands: list[tuple[Any, ...]]
    parse: Callable[[list[Any]], T]
    failure: str  # what failed, for the error message
    writes: bool = False  # it changes projections: made durable (`Durability`) before it returns


@dataclass(frozen=True, slots=True)
class Durability:
    """How many replicas of a master must hold a write before the write counts as done.

    Redis replicates asynchronously: a master that fails over after acknowledging a commit can
    lose it, after the worker let Kafka commit the offsets past it. With `replicas` > 0 every
    write request ends, on each master it wrote to and on the connection that wrote, with
    `WAIT replicas timeout_ms`; a shortfall is waited out again (after a write that moves the
    connection's replication offset to the master's) up to `attempts` times, then raises
    `ReplicationLagError`, and the caller does not move its offsets.
    """

    replicas: int = 0
    timeout_ms: int = 1000
    attempts: int = 5

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms < 1 or self.attempts < 1:
            raise ConfigurationError(
                f"durability: replicas={self.replicas} (>= 0), timeout_ms={self.timeout_ms} "
                f"(>= 1), attempts={self.attempts} (>= 1)"
            )


NOT_DURABLE = Durability()
_REROUTED = (
    MovedError,
    AskError,
    ClusterDownError,
    TryAgainError,
    redis.ConnectionError,
    RedisClusterException,  # e.g. a slot no master serves (yet) during a failover
)


def key_of(command: tuple[Any, ...]) -> str:
    """The (first) key a command touches: where Redis Cluster routes it."""
    key = command[3] if command[0] == "EVALSHA" else command[1]
    return key.decode() if isinstance(key, bytes) else str(key)


def _marker(command: tuple[Any, ...]) -> str:
    """A key in the command's hash slot that a durability check may write to."""
    key = key_of(command)
    end = key.find("}")
    return (key[: end + 1] if end >= 0 else key) + ":durable"


def _wait_for(command: tuple[Any, ...], durability: Durability) -> list[tuple[Any, ...]]:
    return [("INCR", _marker(command)), ("WAIT", durability.replicas, durability.timeout_ms)]


def _replicated(replies: list[Any], durability: Durability) -> bool:
    return int(replies[-1]) >= durability.replicas


def _pipeline(
    client: redis.Redis, commands: list[tuple[Any, ...]], durability: Durability
) -> list[Any]:
    """Run commands on one server in one round trip (loading the scripts if it lost them), then
    wait for its replicas when `durability` asks for it."""
    wait = _wait_for(commands[0], durability) if durability.replicas else []
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for command in (*commands, *wait):
            pipe.execute_command(*command)  # type: ignore[no-untyped-call]
        try:
            replies: list[Any] = pipe.execute()
        except NoScriptError:
            if attempt == 2:
                raise
            for script in scripts.ALL:
                client.script_load(script.source)
            continue
        for _ in range(durability.attempts - 1):
            if not wait or _replicated(replies, durability):
                break
            pipe = client.pipeline(transaction=False)
            for command in wait:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            replies[-2:] = pipe.execute()
        if wait and not _replicated(replies, durability):
            raise _ShortOfReplicas(_short(replies, durability))
        return replies[: len(commands)]
    raise AssertionError("unreachable")


async def _pipeline_async(
    client: aioredis.Redis, commands: list[tuple[Any, ...]], durability: Durability
) -> list[Any]:
    """`_pipeline` on an asyncio client."""
    wait = _wait_for(commands[0], durability) if durability.replicas else []
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for command in (*commands, *wait):
            pipe.execute_command(*command)
        try:
            replies: list[Any] = await pipe.execute()
        except NoScriptError:
            if attempt == 2:
                raise
            for script in scripts.ALL:
                await client.script_load(script.source)
            continue
        for _ in range(durability.attempts - 1):
            if not wait or _replicated(replies, durability):
                break
            pipe = client.pipeline(transaction=False)
            for command in wait:
                pipe.execute_command(*command)
            replies[-2:] = await pipe.execute()
        if wait and not _replicated(replies, durability):
            raise _ShortOfReplicas(_short(replies, durability))
        return replies[: len(commands)]
    raise AssertionError("unreachable")


def _short(replies: list[Any], durability: Durability) -> str:
    return (
        f"the write reached {int(replies[-1])} of the {durability.replicas} replicas asked for "
        f"within {durability.attempts} × {durability.timeout_ms} ms"
    )


def _by_node(
    client: SyncCluster | AsyncCluster, commands: list[tuple[Any, ...]]
) -> list[tuple[Any, list[int]]]:
    """The commands' indexes grouped by the master that serves their slot."""
    nodes: dict[str, tuple[Any, list[int]]] = {}
    for i, command in enumerate(commands):
        node = client.get_node_from_key(key_of(command))
        if node is None:
            raise ClusterDownError(f"no master serves the slot of {key_of(command)}")
        nodes.setdefault(node.name, (node, []))[1].append(i)
    return list(nodes.values())


def execute(client: SyncClient, request: Request[T], durability: Durability = NOT_DURABLE) -> T:
    """Run a request on a synchronous client (on a cluster: one pipeline per master)."""
    wait = durability if request.writes else NOT_DURABLE
    try:
        if not isinstance(client, SyncCluster):
            return request.parse(_pipeline(client, request.commands, wait))
        for attempt in (1, 2):
            try:
                replies: list[Any] = [None] * len(request.commands)
                for node, at in _by_node(client, request.commands):
                    got = _pipeline(
                        client.node_client(node), [request.commands[i] for i in at], wait
                    )
                    for i, reply in zip(at, got, strict=True):
                        replies[i] = reply
                return request.parse(replies)
            except _REROUTED:
                # A failover or a moved slot: learn the cluster's slots again, then once more
                # (a commit already applied answers "conflict" and is folded again).
                client.nodes_manager.initialize()
                if attempt == 2:
                    raise
    except REDIS_ERRORS as e:
        raise _wrapped(request, e) from e
    raise AssertionError("unreachable")


async def execute_async(
    client: AsyncClient,
    request: Request[T],
    durability: Durability = NOT_DURABLE,
    *,
    settle: bool = False,
) -> T:
    """Run a request on an asyncio client (never blocks the event loop; on a cluster: one
    pipeline per master, all at once). `settle`: a read waits for the replicas like a write, for
    a caller that acts on what it read as if it were durable."""
    wait = durability if request.writes or settle else NOT_DURABLE
    try:
        if not isinstance(client, AsyncCluster):
            return request.parse(await _pipeline_async(client, request.commands, wait))
        try:
            await client.initialize()  # learns the slots on first use only
            groups = _by_node(client, request.commands)
            got = await asyncio.gather(
                *(
                    _pipeline_async(
                        client.node_client(node), [request.commands[i] for i in at], wait
                    )
                    for node, at in groups
                )
            )
        except _REROUTED:
            # A failover or a moved slot: learn the cluster's slots again; the caller retries.
            await client.nodes_manager.initialize()
            raise
        replies: list[Any] = [None] * len(request.commands)
        for (_, at), node_replies in zip(groups, got, strict=True):
            for i, reply in zip(at, node_replies, strict=True):
                replies[i] = reply
        return request.parse(replies)
    except REDIS_ERRORS as e:
        raise _wrapped(request, e) from e


def _wrapped(request: Request[Any], e: Exception) -> ProjectionError:
    if isinstance(e, _ShortOfReplicas):
        return ReplicationLagError(f"{request.failure}: {e}")
    return ProjectionError(f"{request.failure}: {e}")


class _ShortOfReplicas(redis.RedisError):
    """A write was not acknowledged by as many replicas as `Durability` asks for."""


# -- reading folded states ---------------------------------------------------------------------


def by_partition(keys: Keys, session_ids: Sequence[str]) -> list[tuple[int, list[str]]]:
    """The sessions grouped by partition (each partition's keys are one hash slot), partitions
    in the order they first appear, sessions in their order."""
    groups: dict[int, list[str]] = {}
    for sid in session_ids:
        groups.setdefault(keys.partition_of(sid), []).append(sid)
    return list(groups.items())


def read_groups(
    keys: Keys, session_ids: Sequence[str], size: int = READ_GROUP
) -> list[tuple[list[str], list[str]]]:
    """The sessions and KEYS of read script calls reading them: up to `size` sessions of one
    partition per call (one hash slot each, as Redis Cluster requires)."""
    groups: list[tuple[list[str], list[str]]] = []
    for partition, sids in by_partition(keys, session_ids):
        for at in range(0, len(sids), size):
            chunk = sids[at : at + size]
            group: list[str] = []
            for sid in chunk:
                k = keys.session(sid, partition)
                group += (k.state, k.turns, k.event_ids)
            groups.append((chunk, group))
    return groups


def parse_read(raw: Any, session_id: str) -> Folded | None:
    """Turn the read script's reply into a state and its mark."""
    if not raw:
        return None
    state, mark, turns, groups, summary = raw
    check_version(state, session_id)
    try:
        return Folded(
            session_from_blob(
                state,
                session_id,
                tuple(turn_from_json(t) for t in turns),
                RecentIds.of(unpack_event_ids(g) for g in groups),
                None if summary is None else summary_from_stored(summary, session_id),
            ),
            Position.parse(text(mark)),
        )
    except (ValueError, TypeError) as e:  # a turn or the mark as stored (the rest says so itself)
        raise CorruptProjectionError(
            f"{session_id}: the stored projection cannot be read: {e!r}"
        ) from e


def read(
    keys: Keys,
    session_ids: Sequence[str],
    *,
    event_ids: bool = True,
    unreadable: dict[str, str] | None = None,
    rebuilding: set[str] | None = None,
) -> Request[dict[str, Folded]]:
    """State, mark (and event ids) of the known sessions among `session_ids`.

    A session whose projection does not decode fails the read (`CorruptProjectionError`), or,
    with `unreadable` given, is left out of the answer and put there (id -> why), as is one a
    `replay --session` is rebuilding (`Keys.restoring`: what is stored is half rebuilt; the
    same round trip reads the marks, after the states: read before them, a mark taken away in
    between would let a half-rebuilt state through), also put in `rebuilding` when given.
    """
    flag = "1" if event_ids else "0"
    sha = scripts.READ.sha
    groups = read_groups(keys, session_ids)
    commands: list[tuple[Any, ...]] = [("EVALSHA", sha, len(ks), *ks, flag) for _, ks in groups]
    order = [sid for sids, _ in groups for sid in sids]
    if unreadable is not None:  # each group's sessions share a partition: one hash slot
        commands += [
            ("HMGET", keys.restoring(keys.partition_of(sids[0])), *sids) for sids, _ in groups
        ]

    def parse(replies: list[Any]) -> dict[str, Folded]:
        raws = [raw for group in replies[: len(groups)] for raw in group]
        if unreadable is None:
            found = {sid: parse_read(raw, sid) for sid, raw in zip(order, raws, strict=True)}
            return {sid: f for sid, f in found.items() if f is not None}
        marks = [mark for group in replies[len(groups) :] for mark in group]
        readable: dict[str, Folded] = {}
        for sid, raw, restoring in zip(order, raws, marks, strict=True):
            if restoring is not None:
                began = text(restoring).partition(" ")[0]
                unreadable[sid] = (
                    f"{sid}: half rebuilt, by a `replay --session` of it begun at {began} that "
                    "has not ended (wait for it, or run it again if it died)"
                )
                if rebuilding is not None:
                    rebuilding.add(sid)
                continue
            try:
                folded = parse_read(raw, sid)
            except CorruptProjectionError as e:
                unreadable[sid] = str(e)
                continue
            if folded is not None:
                readable[sid] = folded
        return readable

    return Request(commands, parse, "reading projections failed")


def loaded(keys: Keys, session_id: str) -> Request[tuple[Folded | None, str | None]]:
    """The session's state and mark (as `read`), and when a restore of it began if one is under
    way or died (`Keys.restoring`)."""
    partition = keys.partition_of(session_id)
    reading = read(keys, [session_id])
    commands = [*reading.commands, ("HGET", keys.restoring(partition), session_id)]

    def parse(replies: list[Any]) -> tuple[Folded | None, str | None]:
        *folded, restoring = replies
        found = reading.parse(folded).get(session_id)
        return found, None if restoring is None else text(restoring)

    return Request(commands, parse, f"reading {session_id} failed")


def decisions(
    keys: Keys,
    session_ids: Sequence[str],
    latest: Sequence[int] | None = None,
    *,
    unreadable: dict[str, str] | None = None,
) -> Request[dict[str, tuple[Decision, ...]]]:
    """The decisions each session's history holds, in seq order (one `LRANGE` each): every one,
    or the latest `latest[i]` (at least one) of session i.

    A history that does not decode fails the read (`CorruptProjectionError`), or, with
    `unreadable` given, is left out of the answer and put there (id -> why).
    """
    at = HISTORY_KINDS.index("decisions")
    firsts = [0] * len(session_ids) if latest is None else [-max(n, 1) for n in latest]
    commands = [
        ("LRANGE", keys.session(sid).history[at], first, -1)
        for sid, first in zip(session_ids, firsts, strict=True)
    ]

    def parse(replies: list[Any]) -> dict[str, tuple[Decision, ...]]:
        if unreadable is None:
            return {
                sid: decisions_from_json(sid, raw)
                for sid, raw in zip(session_ids, replies, strict=True)
            }
        found: dict[str, tuple[Decision, ...]] = {}
        for sid, raw in zip(session_ids, replies, strict=True):
            try:
                found[sid] = decisions_from_json(sid, raw)
            except CorruptProjectionError as e:
                unreadable[sid] = str(e)
        return found

    return Request(commands, parse, "reading decisions failed")


def marks(keys: Keys, session_ids: Sequence[str]) -> Request[dict[str, Position]]:
    """The stored mark of each known session among `session_ids` (one HGET each)."""
    commands = [("HGET", keys.session(sid).state, "mark") for sid in session_ids]

    def parse(replies: list[Any]) -> dict[str, Position]:
        return {
            sid: Position.parse(text(raw))
            for sid, raw in zip(session_ids, replies, strict=True)
            if raw is not None
        }

    return Request(commands, parse, "reading marks failed")


# -- retention ---------------------------------------------------------------------------------

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EXPIRE_BATCH = 500  # due sessions a sweep drops per partition and round trip


def instant_ms(ms: int) -> datetime:
    """The UTC instant of epoch milliseconds."""
    return _EPOCH + timedelta(milliseconds=ms)


def floor_ms(moment: datetime) -> int:
    """Epoch milliseconds, rounded down: "now" never passes a deadline it has not reached."""
    return ceil_ms(moment) - (1 if moment.microsecond % 1000 else 0)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long an ended session's projection is kept: `ttl_ms` after its last event, and at
    least until `floor_ms` (epoch ms; a restore's, so a restored session is not dropped at once).

    Time is declared, not derived: the commit path has no clock. The deadline comes from the
    events themselves (the latest `occurred_at` from the ending on, the writers' clock), so a
    rebuild in any batches indexes the same deadline; the sweep compares it with its own clock,
    as the scheduler compares a question's declared deadline with its own.
    """

    ttl_ms: int
    floor_ms: int = 0

    @classmethod
    def after(cls, ttl_s: float | None) -> Retention | None:
        """The retention of a TTL setting in seconds (None: keep for ever; ConfigurationError
        unless it is positive)."""
        if ttl_s is None:
            return None
        if not ttl_s > 0:
            raise ConfigurationError(f"MILPA_PROJECTION_TTL_S={ttl_s!r}: expected seconds > 0")
        return cls(max(1, round(ttl_s * 1000)))

    def restored(self, at: datetime) -> Retention:
        """This retention for a session restored at `at`: kept at least one TTL from then."""
        return Retention(self.ttl_ms, ceil_ms(at) + self.ttl_ms)

    def deadline_ms(self, update: SessionUpdate) -> int | None:
        """When the update's session may be dropped, or None while it has not ended."""
        if not update.state.ended:
            return None
        last = max(s.event.occurred_at for s in update.steps if s.state.ended)
        return max(ceil_ms(last) + self.ttl_ms, self.floor_ms)


def parse_expired(raw: bytes | str | None, session_id: str) -> Expired | None:
    """A stored tombstone (`<expired ms> <mark>`), or None."""
    if raw is None:
        return None
    ms, mark = text(raw).split(" ", 1)
    return Expired(session_id, instant_ms(int(ms)), Position.parse(mark))


def expired(keys: Keys, session_id: str, partition: int) -> Request[Expired | None]:
    """The session's tombstone, if its projection expired."""
    command = ("HGET", keys.expired(partition), session_id)
    return Request(
        [command],
        lambda replies: parse_expired(replies[0], session_id),
        f"reading the tombstone of {session_id} failed",
    )


def unmark_command(keys: Keys, session_id: str, partition: int, mark: str) -> tuple[Any, ...]:
    """lua/unmark.lua's call: take a restore's mark away if it is still that restore's."""
    return ("EVALSHA", scripts.UNMARK.sha, 1, keys.restoring(partition), session_id, mark)


def drop_command(
    keys: Keys,
    session_id: str,
    partition: int,
    now_ms: int | None = None,
    *,
    hold: bool = False,
    retire: bool = False,
    below: int | None = None,
    keep_tombstone: bool = False,
) -> tuple[Any, ...]:
    """The drop script's call for one session (lua/drop.lua).

    Without `now_ms`: forget it, its retention entry, tombstone and retired entry too (a rebuild
    follows); `hold`: keep it in the unsnapshotted index, at offset 0; `keep_tombstone` (a
    restore follows, whose first commit takes it away): a worker's commit of it meanwhile still
    finds it expired instead of writing it from nothing. With `now_ms`: expire it
    if its retention deadline is at or before `now_ms`, leaving a tombstone, and with `retire`
    (snapshots are taken) a retired entry for the next snapshot round; with `below`, only if its
    last event's offset is below it (its partition's settled offset).
    """
    k = keys.session(session_id, partition)
    return (
        "EVALSHA",
        scripts.DROP.sha,
        19,
        *k.all(),
        keys.waiting(partition),
        keys.waiting_cards(partition),
        keys.waiting_counts(partition),
        keys.fleet_counts(partition),
        *k.history,
        *keys.retention_keys(partition),
        keys.unsnapshotted(partition),
        keys.deadlines(partition),
        keys.compaction_due(partition),
        keys.retired(partition),
        session_id,
        keys.waiting_reason_prefix(partition),
        "" if now_ms is None else now_ms,
        "1" if hold else "",
        "1" if retire else "",
        "" if below is None else below,
        "1" if keep_tombstone else "",
    )


def retention_due(
    keys: Keys, partitions: Iterable[int], now_ms: int, limit: int = EXPIRE_BATCH
) -> Request[dict[str, int]]:
    """Sessions whose retention deadline is at or before `now_ms` -> their partition (up to
    `limit` per partition, earliest first)."""
    owned = sorted(partitions)
    commands = [
        ("ZRANGEBYSCORE", keys.retention(p), "-inf", now_ms, "LIMIT", 0, limit) for p in owned
    ]

    def parse(replies: list[Any]) -> dict[str, int]:
        return {text(m): p for p, members in zip(owned, replies, strict=True) for m in members}

    return Request(commands, parse, "reading the retention index failed")


def expire(
    keys: Keys,
    due: dict[str, int],
    now_ms: int,
    *,
    retire: bool = False,
    settled: Mapping[int, int] | None = None,
) -> Request[list[str]]:
    """Drop these due sessions (each only if still due, and with `settled`, partition -> its
    settled offset, only if its last event is below it), leaving tombstones (and with `retire`,
    snapshots being taken, retired entries); those dropped."""
    sids = list(due)
    bound = settled or {}
    commands = [
        drop_command(keys, sid, due[sid], now_ms, retire=retire, below=bound.get(due[sid]))
        for sid in sids
    ]

    def parse(replies: list[Any]) -> list[str]:
        return [sid for sid, r in zip(sids, replies, strict=True) if r == 1]

    return Request(commands, parse, "expiring projections failed", writes=True)


# -- committing updates ------------------------------------------------------------------------

_FIXED_KEYS = 18  # a session's keys before its counter hashes (see lua/commit.lua)


def id_groups(update: SessionUpdate) -> tuple[bytes, list[bytes]]:
    """The update's new event ids, packed: those of the dedupe chunk the stored ids end in, and
    those of each later chunk (`session_model.dedupe`; the event of seq n is in chunk
    `(n - 1) // CHUNK`)."""
    ids = [s.event.event_id for s in update.steps if s.outcome.kind is not Kind.DUPLICATE]
    before = update.state.seq - len(ids)
    split = min(len(ids), -before % CHUNK)  # how many fit in the stored last chunk
    head = pack_event_ids(ids[:split])
    return head, [pack_event_ids(ids[at : at + CHUNK]) for at in range(split, len(ids), CHUNK)]


def _summary(update: SessionUpdate) -> bytes:
    """The summary to store ("=" and its stored form) when the update applied a compaction, else
    "" (unchanged)."""
    for s in update.steps:
        if s.event.type == ev.COMPACTED and s.outcome.kind is Kind.APPLIED:
            return _stored_summary(update.state.summary or "")
    return b""


def _stored_summary(summary: str) -> bytes:
    return b"=" + summary_to_stored(summary)


def history_args(facts: Sequence[HistoryRecord], first_key: int) -> list[str | int | bytes]:
    """The history appends of an update: n, then (key index, count, entries...) per list."""
    lists: dict[int, list[bytes]] = {}
    for fact in facts:
        kind, raw = fact_to_json(fact)
        lists.setdefault(kind, []).append(raw)
    out: list[str | int | bytes] = [len(lists)]
    for kind in sorted(lists):
        out += (first_key + kind, len(lists[kind]), *lists[kind])
    return out


def commit_call(
    keys: Keys,
    update: SessionUpdate,
    compact_after: int | None,
    count: bool = True,
    *,
    retention: Retention | None = None,
    track: bool = False,
    restore: bool = False,
) -> Call:
    """The KEYS and ARGV of one session's commit (state, appends, indexes, counters).

    `count`: add its counters to the fleet's; `track` (snapshots are taken): to the session's
    own too, and note the session in its partition's unsnapshotted index. `restore` (`replay
    --session`): a tombstone does not refuse it (expired), it takes the tombstone away.
    """
    head, groups = id_groups(update)
    changes = index_changes(update, keys, compact_after)
    first = update.first if update.first is not None else update.mark.offset
    return _call(
        keys,
        update,
        deadline_ms=changes.deadline_ms,
        compaction=changes.compaction_due,
        summary=_summary(update),
        ids=(head, groups),
        turns=[turn_to_json(t) for t in update.turns],
        timeline=[entry_to_json(e, update.session_id) for e in update.timeline],
        counters=changes.counters,
        fleet_wide=count,
        own=track,
        retain=None if retention is None else retention.deadline_ms(update),
        track=first if track else None,
        history=update.facts,
        restore=restore,
    )


@dataclass(frozen=True, slots=True)
class Restored:
    """A session as its snapshot holds it: the folded state, its dedupe window as stored (packed
    chunks, the current one last) and its counters (`Keys.counter_field` -> count)."""

    folded: Folded
    event_ids: tuple[bytes, ...]
    counters: Mapping[str, int]
    taken_at_ms: int = 0
    retain_until_ms: int | None = None  # its retention deadline when the snapshot was taken

    @property
    def mark(self) -> Position:
        """The last position folded into it."""
        mark = self.folded.mark
        if mark is None:
            raise ValueError(f"{self.folded.state.id}: a snapshot without a mark")
        return mark


def restore_call(
    keys: Keys,
    snapshot: Restored,
    compact_after: int | None,
    count: bool = True,
    *,
    retention: Retention | None = None,
    restore: bool = False,
) -> Call:
    """The commit script's call that writes a session from its snapshot (no mark stored yet):
    its state, window and dedupe window, its indexes, and its counters (the fleet's too with
    `count`). Its history before the snapshot stays in Kafka only. `restore`: as `commit_call`'s."""
    state = snapshot.folded.state
    update = SessionUpdate(state.id, None, snapshot.mark, state, ())
    changes = index_changes(update, keys, compact_after)
    partition = snapshot.mark.partition
    counters = [(*keys.counter_of(f, partition), n) for f, n in snapshot.counters.items()]
    return _call(
        keys,
        update,
        deadline_ms=changes.deadline_ms,
        compaction=changes.compaction_due,
        summary=b"" if state.summary is None else _stored_summary(state.summary),
        ids=(b"", list(snapshot.event_ids)),
        turns=[turn_to_json(t) for t in state.turns],
        timeline=[],
        counters=counters,
        fleet_wide=count,
        own=True,
        retain=_restored_retention(snapshot, retention),
        track=None,
        history=(),
        restore=restore,
    )


def _restored_retention(snapshot: Restored, retention: Retention | None) -> int | None:
    """A restored ended session's retention deadline: the one indexed when the snapshot was
    taken, or one TTL after the snapshot (the events that would date it are not read)."""
    if retention is None or not snapshot.folded.state.ended:
        return None
    deadline = snapshot.retain_until_ms
    if deadline is None:
        deadline = snapshot.taken_at_ms + retention.ttl_ms
    return max(deadline, retention.floor_ms)


def _call(
    keys: Keys,
    update: SessionUpdate,
    *,
    deadline_ms: int | None,
    compaction: bool,
    summary: bytes,
    ids: tuple[bytes, list[bytes]],
    turns: list[bytes],
    timeline: list[bytes],
    counters: Sequence[tuple[str, str, int]],
    fleet_wide: bool,
    own: bool,
    retain: int | None,
    track: int | None,
    history: Sequence[HistoryRecord],
    restore: bool = False,
) -> Call:
    sid = update.session_id
    partition = update.mark.partition
    k = keys.session(sid, partition)
    head, groups = ids
    entry = index_entry(update, deadline_ms)
    script_keys = [
        *k.all(),
        *keys.partition_keys(partition),
        *k.history,
        *keys.retention_keys(partition),
        keys.unsnapshotted(partition),
    ]
    counter_args: list[str | int | bytes] = []
    for key, field_, increment in counters:
        if key not in script_keys[_FIXED_KEYS:]:
            script_keys.append(key)
        counter_args.extend(
            (
                script_keys.index(key, _FIXED_KEYS) + 1,
                field_,
                increment,
                keys.counter_field(key, field_),
            )
        )
    args: list[str | int | bytes] = [
        "" if update.base is None else str(update.base),
        str(update.mark),
        session_to_blob(update.state),
        len(update.state.turns),
        sid,
        "" if deadline_ms is None else deadline_ms,
        "1" if compaction else "0",
        summary,
        head,
        len(groups),
        *groups,
        len(turns),
        *turns,
        len(timeline),
        *timeline,
        len(counters),
        *counter_args,
        entry.fleet,
        entry.card,
        entry.score,
        keys.waiting_reason_prefix(partition),
        "" if retain is None else retain,
        "1" if fleet_wide else "0",
        "1" if own else "0",
        "" if track is None else track,
        *history_args(history, len(k.all()) + len(keys.partition_keys(partition)) + 1),
        "1" if restore else "",
    ]
    return script_keys, args


def grouped(keys: Keys, calls: Sequence[tuple[int, Call]], size: int = COMMIT_GROUP) -> list[Call]:
    """Sessions' commit calls, each with its partition, joined into calls of the commit script
    of up to `size` sessions of one partition (one hash slot: what Redis Cluster requires),
    each led by the partition's generation hash and generation, in the order the calls'
    partitions first appear."""
    by_partition: dict[int, list[Call]] = {}
    for partition, call in calls:
        by_partition.setdefault(partition, []).append(call)
    groups: list[Call] = []
    for partition, same in by_partition.items():
        for at in range(0, len(same), size):
            group_keys: list[str] = [keys.generation_key(partition)]
            args: list[str | int | bytes] = [keys.generation(partition)]
            for session_keys, session_args in same[at : at + size]:
                group_keys += session_keys
                args.append(len(session_keys))
                args.append(len(session_args))
                args += session_args
            groups.append((group_keys, args))
    return groups


EXPIRED = 2  # the commit script's answer for a session whose projection expired (a tombstone)
STALE_GENERATION = 3  # the commit script's answer for a partition that moved to a newer one


@dataclass(frozen=True, slots=True)
class Committed:
    """What a commit request did: applied, conflicting and expired sessions, and whether a
    partition had moved to a newer generation (its sessions are among the conflicts: read the
    generations again, then the sessions)."""

    result: CommitResult
    stale_generation: bool = False


def commit(
    keys: Keys, session_ids: Sequence[str], calls: Sequence[Call], partitions: Sequence[int]
) -> Request[Committed]:
    """Apply each session's update (compare-and-set on its mark); `calls`: their `commit_call`s,
    `partitions`: their partitions."""
    sha = scripts.COMMIT.sha
    commands = [
        ("EVALSHA", sha, len(ks), *ks, *args)
        for ks, args in grouped(keys, list(zip(partitions, calls, strict=True)))
    ]
    order: dict[int, list[str]] = {}
    for partition, sid in zip(partitions, session_ids, strict=True):
        order.setdefault(partition, []).append(sid)
    sids = [sid for same in order.values() for sid in same]

    def parse(replies: list[Any]) -> Committed:
        # One list per group: 1 = applied, 0 = conflict, 2 = the session's projection expired
        # (nothing written: its events stay in Kafka until `replay --session` restores it),
        # 3 = its partition is in a newer generation (nothing written).
        flags = [flag for group in replies for flag in group]
        pairs = list(zip(sids, flags, strict=True))
        result = CommitResult(
            tuple(sid for sid, r in pairs if r == 1),
            tuple(sid for sid, r in pairs if r in (0, STALE_GENERATION)),
            tuple(sid for sid, r in pairs if r == EXPIRED),
        )
        return Committed(result, any(r == STALE_GENERATION for _, r in pairs))

    return Request(commands, parse, "committing projections failed", writes=True)


# -- generations -------------------------------------------------------------------------------


def generations(keys: Keys) -> Request[tuple[int, ...]]:
    """The generation each partition's keys are in (one HGET per partition)."""
    commands = [("HGET", keys.generation_key(p), "g") for p in range(keys.partitions)]

    def parse(replies: list[Any]) -> tuple[int, ...]:
        return tuple(int(r) if r is not None else 0 for r in replies)

    return Request(commands, parse, "reading the projection generations failed")


def switch(keys: Keys, partition: int, current: int, new: int) -> Request[int]:
    """Move a partition to generation `new` if the new one has committed at least as far in it
    (lua/switch.lua): 1 moved, 0 the current one is ahead, -1 not in generation `current`."""
    command = ("EVALSHA", scripts.SWITCH.sha, 1, keys.generation_key(partition), current, new)
    return Request(
        [command],
        lambda replies: int(replies[0]),
        f"moving partition {partition} to generation {new} failed",
        writes=True,
    )


LeaseAction = Literal["take", "renew", "give"]


def lease(keys: Keys, token: str, ttl_ms: int, action: LeaseAction) -> Request[bool]:
    """Take, renew or give up the live-rebuild lease as `token` (lua/lease.lua): whether it
    happened (False: another holder has it, or it lapsed)."""
    command = ("EVALSHA", scripts.LEASE.sha, 1, keys.rebuild_lease(), token, ttl_ms, action)
    return Request([command], lambda replies: replies[0] == 1, f"{action} the rebuild lease failed")


def lease_held(keys: Keys) -> Request[bool]:
    """Whether some live rebuild holds the lease now."""
    key = keys.rebuild_lease()
    return Request([("EXISTS", key)], lambda r: bool(r[0]), "reading the rebuild lease failed")


# -- due work and timelines --------------------------------------------------------------------

DueWork = tuple[dict[str, tuple[int, int]], dict[str, int]]
"""(session id -> (deadline ms, partition), session id -> partition of its due compaction)."""


def due_work(keys: Keys, partitions: Iterable[int], until_ms: int | None) -> Request[DueWork]:
    """Deadlines (all, or up to `until_ms`) and compaction-due sessions of these partitions."""
    owned = sorted(partitions)
    until: int | str = "+inf" if until_ms is None else until_ms
    sha = scripts.DUE.sha
    commands = [
        ("EVALSHA", sha, 2, keys.deadlines(p), keys.compaction_due(p), until) for p in owned
    ]

    def parse(replies: list[Any]) -> DueWork:
        deadlines: dict[str, tuple[int, int]] = {}
        due: dict[str, int] = {}
        for p, (flat, members) in zip(owned, replies, strict=True):
            pairs = iter(flat)
            for member, score in zip(pairs, pairs, strict=True):
                deadlines[text(member)] = (int(score), p)
            for member in members:
                due[text(member)] = p
        return deadlines, due

    return Request(commands, parse, "reading due work failed")


def parse_timeline(raw: Any, session_id: str, since: int) -> list[TimelineEntry]:
    """Entries with `seq > since`, from the state hash's fields and the timeline list."""
    fields, listed = raw
    if not fields:
        return []
    header = fields.get(b"n")
    if header is None:
        check_version(b"", session_id)  # a hash of another layout
    state = fields.get(b"s", b"") if header[0] == ord(WHOLE) else fields.get(b"s1", b"")
    check_version(state, session_id)
    inline = b""
    if header[2] != ord(ELSEWHERE):
        inline = b"".join(fields[b"t%d" % k] for k in range(1, header[2] - ord("0") + 1))
    entries = [entry_from_json(e, session_id) for e in [*inline.split(b"\n")[:-1], *listed]]
    return [e for e in entries if e["seq"] > since]


def text(value: bytes | str) -> str:
    """A reply as text."""
    return value.decode() if isinstance(value, bytes) else value


# -- snapshots ---------------------------------------------------------------------------------

SNAPSHOT_PAGE = 500  # unsnapshotted sessions a snapshot round reads per partition and round trip

RawState = tuple[Any, ...]
"""The read script's reply for one session, its own counters and its retention deadline
(`projections.snapshots`)."""


def unsnapshotted(
    keys: Keys, partition: int, limit: int = SNAPSHOT_PAGE
) -> Request[list[tuple[str, int]]]:
    """The sessions of a partition applied since their latest snapshot, and the first offset
    of each since then, lowest first (up to `limit`)."""

    def parse(replies: list[Any]) -> list[tuple[str, int]]:
        got = replies[0]
        paired = got if got and isinstance(got[0], (list, tuple)) else pairs(got)  # (callback)
        return [(text(m), int(float(score))) for m, score in paired]

    return Request(
        [("ZRANGE", keys.unsnapshotted(partition), 0, limit - 1, "WITHSCORES")],
        parse,
        "reading the unsnapshotted sessions failed",
    )


def raw_states(
    keys: Keys, partition: int, session_ids: Sequence[str]
) -> Request[dict[str, RawState | None]]:
    """What a snapshot of each session (of one partition) holds, as stored: the read script's
    reply (state, mark, turns, packed id chunks, summary), its own counters (the `c:` fields of
    its state hash) and its retention deadline; sessions without a state of this layout are
    left out, and those half rebuilt (`Keys.restoring`) are None (a round leaves them in the
    unsnapshotted index as they are: neither covered nor gone)."""
    sha = scripts.READ.sha
    groups = read_groups(keys, session_ids)
    commands: list[tuple[Any, ...]] = [("EVALSHA", sha, len(ks), *ks, "1") for _, ks in groups]
    session_ids = [sid for sids, _ in groups for sid in sids]  # one partition: in this order
    n = len(session_ids)
    commands += [("HGETALL", keys.session(sid, partition).state) for sid in session_ids]
    commands += [("ZSCORE", keys.retention(partition), sid) for sid in session_ids]
    if session_ids:
        commands.append(("HMGET", keys.restoring(partition), *session_ids))

    def parse(replies: list[Any]) -> dict[str, RawState | None]:
        raws = [raw for group in replies[: len(groups)] for raw in group]
        counters = replies[len(groups) : len(groups) + n]
        retained = replies[len(groups) + n : len(groups) + 2 * n]
        restoring = replies[len(groups) + 2 * n] if session_ids else []
        out: dict[str, RawState | None] = {}
        for sid, raw, fields, until, half in zip(
            session_ids, raws, counters, retained, restoring, strict=True
        ):
            if half is not None:  # a snapshot of it would be restored as whole by a rebuild
                out[sid] = None
            # A commit between the read script and HGETALL: its state and counters would not
            # match. Left out, it stays in the unsnapshotted index for the next round.
            elif raw and raw[0] and fields.get(b"mark") == raw[1]:
                mine = {text(f)[2:]: v for f, v in fields.items() if f.startswith(b"c:")}
                out[sid] = (*raw, mine, None if until is None else int(float(until)))
        return out

    return Request(commands, parse, "reading sessions to snapshot failed")


def snapped(
    keys: Keys, partition: int, covered: Sequence[tuple[str, Position | None]]
) -> Request[int | None]:
    """Take the sessions whose snapshots were acknowledged out of the partition's unsnapshotted
    index (lua/snapped.lua); returns the lowest first offset left in it (None: none)."""
    args: list[Any] = []
    for sid, mark in covered:  # None: the session has no state to snapshot
        args += (sid, "", -1) if mark is None else (sid, str(mark), mark.offset + 1)
    session_keys = [keys.session(sid, partition).state for sid, _ in covered]
    command = (
        "EVALSHA",
        scripts.SNAPPED.sha,
        1 + len(session_keys),
        keys.unsnapshotted(partition),
        *session_keys,
        *args,
    )

    def parse(replies: list[Any]) -> int | None:
        low = replies[0]
        return None if low is None else int(float(text(low)))

    return Request([command], parse, "marking sessions snapshotted failed", writes=True)


# -- retired sessions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Retired:
    """A session whose projection expired (retention), as its snapshot stub holds it: its
    tombstone and what it added to the fleet's counters (`Keys.counter_field` -> count)."""

    expired: Expired
    counters: Mapping[str, int]

    @property
    def session_id(self) -> str:
        """The session."""
        return self.expired.session_id


def parse_retired(raw: bytes | str, session_id: str) -> Retired:
    """A retired entry (`<expired ms> <last mark> <counters JSON>`, lua/drop.lua); ValueError
    if it does not read."""
    try:
        ms, mark, counters = text(raw).split(" ", 2)
        found = orjson.loads(counters)
        if found == []:  # an empty table, as a cjson that writes arrays for them has it
            found = {}
        if not isinstance(found, dict):
            raise ValueError(f"counters {counters!r}")
        tombstone = Expired(session_id, instant_ms(int(ms)), Position.parse(mark))
        return Retired(tombstone, {str(k): int(v) for k, v in found.items()})
    except (ValueError, TypeError, orjson.JSONDecodeError) as e:
        raise ValueError(f"the retired entry of {session_id} does not read: {e}") from e


RetiredEntry = tuple[str, str]
"""A retired entry as stored: (session id, `<expired ms> <last mark> <counters JSON>`)."""


def retired(
    keys: Keys, partition: int, cursor: int = 0, limit: int = SNAPSHOT_PAGE
) -> Request[tuple[int, list[RetiredEntry]]]:
    """A page of a partition's retired entries (HSCAN from `cursor`, about `limit` of them):
    the cursor to go on from (0: the scan has ended) and the entries as stored."""

    def parse(replies: list[Any]) -> tuple[int, list[RetiredEntry]]:
        following, got = replies[0]
        return int(following), [(text(k), text(v)) for k, v in pairs(got)]

    command = ("HSCAN", keys.retired(partition), cursor, "COUNT", limit)
    return Request([command], parse, "reading retired sessions failed")


def unretire(keys: Keys, partition: int, entries: Sequence[RetiredEntry]) -> Request[None]:
    """Take these entries out of the partition's retired ones, each only if still as read (a
    session restored and expired again meanwhile has a newer one: lua/unretire.lua)."""
    args = [x for entry in entries for x in entry]
    command = ("EVALSHA", scripts.UNRETIRE.sha, 1, keys.retired(partition), *args)
    return Request([command], lambda _: None, "marking retired sessions failed", writes=True)


def pairs(reply: Any) -> Iterable[tuple[Any, Any]]:
    """A hash's fields and values from a reply: a dict (a client's callback) or a flat list."""
    if isinstance(reply, dict):
        return reply.items()
    flat = iter(reply or ())
    return zip(flat, flat, strict=True)


def retire_command(keys: Keys, retired: Retired, count: bool = True) -> tuple[Any, ...]:
    """lua/retire.lua's call: restore a retired session's tombstone and (with `count`) add its
    counters to the fleet's (a rebuild from its stub)."""
    mark = retired.expired.mark
    partition = mark.partition
    hashes: dict[str, int] = {}
    args: list[Any] = []
    for name, n in retired.counters.items():
        key, field = keys.counter_of(name, partition)
        args += (3 + hashes.setdefault(key, len(hashes)), field, n)
    tombstone = f"{floor_ms(retired.expired.at)} {mark}"
    return (
        "EVALSHA",
        scripts.RETIRE.sha,
        2 + len(hashes),
        keys.expired(partition),
        keys.session(retired.session_id, partition).state,
        *hashes,
        retired.session_id,
        tombstone,
        "1" if count else "",
        *args,
    )


def retire(keys: Keys, sessions: Sequence[Retired], count: bool = True) -> Request[list[str]]:
    """Restore these retired sessions from their stubs; those that had a tombstone or a
    projection already (nothing written for them)."""
    commands = [retire_command(keys, r, count) for r in sessions]

    def parse(replies: list[Any]) -> list[str]:
        return [r.session_id for r, got in zip(sessions, replies, strict=True) if got != 1]

    return Request(commands, parse, "restoring retired sessions failed", writes=True)
