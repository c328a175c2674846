"""The worker's snapshots: each owned partition's changed sessions to `sessions.snapshots`.

A round of a partition (every `interval_s`, or sooner once `every_events` events of it were
applied since its last round): read the sessions its unsnapshotted index names (what commits
noted since their latest snapshot), publish each one's stored state, and once every snapshot is
acknowledged take them out of the index (`projections/lua/snapped.lua`: a session committed again
meanwhile stays, from the offset after its snapshot). Then the partition's checkpoint: the
offset through which every applied event is in a snapshot — one below the lowest offset left in
the index, and never beyond what this worker had applied when the round began (a batch being
committed may have applied part of its sessions only). A rebuild starts the partition after it
(`projections.snapshots`).

Each round publishes through a writer of its own, opened before it reads anything
(`SnapshotSink.fenced`: a transactional producer whose id is the partition's), and each page is
one committed transaction: a writer of the partition that is still running after losing it
cannot land a snapshot it read earlier after a newer owner's round (compaction keeps the last).

Every snapshot and checkpoint names `trust`, the fingerprint of the trust inputs this process folds
with (`session_model.authority.trust_fingerprint`); a rebuild under another trust ignores them
(`projections.snapshots`). Of a state in Redis that name is what the snapshotting process trusts,
not necessarily what every commit of it trusted: two workers folding under different trusts at
once (a rolling change of keys) leave states folded partly under each, which is why a change of
trust is made with every worker stopped and followed by `replay --full`.

After the checkpoint, each round replaces the snapshots of the sessions the retention sweep
dropped since (their retired entries) with stubs: their tombstones and counters, no state. A
partition with nothing applied since this worker took it over gets a round of stubs only.

Why from Redis and not the worker's cache: the index is written by the same script call as the
commit, so a worker that crashed, or a partition that moved, leaves nothing unaccounted for; the
next owner's round snapshots what the last one did not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Protocol

from processors.locks import acquire_within
from projections.requests import RawState, RetiredEntry, parse_retired
from projections.snapshots import (
    SNAPSHOT_MAX_BYTES,
    checkpoint_key,
    checkpoint_record,
    snapshot_record,
    stub_record,
)
from schemas.codec import EventCodec
from schemas.errors import MilpaError
from session_model.projection import Position, SessionUpdate

log = logging.getLogger("milpa_sessions.snapshots")


class SnapshotStore(Protocol):
    """What a round reads and marks in the projection store."""

    async def unsnapshotted(self, partition: int, limit: int = ...) -> list[tuple[str, int]]: ...

    async def raw_states(
        self, partition: int, session_ids: Sequence[str]
    ) -> dict[str, RawState | None]: ...

    async def snapped(
        self, partition: int, covered: Sequence[tuple[str, Position | None]]
    ) -> int | None: ...

    async def retired(
        self, partition: int, cursor: int = ..., limit: int = ...
    ) -> tuple[int, list[RetiredEntry]]: ...

    async def unretire(self, partition: int, entries: Sequence[RetiredEntry]) -> None: ...


class PartitionWriter(Protocol):
    """Publishes (key, value) records to one partition of the snapshots topic, acknowledged."""

    async def publish(self, records: Sequence[tuple[bytes, bytes]]) -> None: ...


class SnapshotSink(Protocol):
    """Opens a partition's writer for a round; opening it fences off every earlier writer of
    the partition, so nothing one of them read before this round lands after it."""

    def fenced(self, partition: int) -> AbstractAsyncContextManager[PartitionWriter]: ...


@dataclass
class SnapshotStats:
    """Running totals (exported as metrics)."""

    rounds: int = 0
    snapshots: int = 0
    checkpoints: int = 0
    failures: int = 0
    bytes: int = 0
    too_large: int = 0  # sessions left unsnapshotted: their record would exceed the topic's limit
    half_built: int = 0  # sessions left unsnapshotted: a `replay --session` of them has not ended
    stubs: int = 0  # retired sessions' snapshots replaced with stubs
    checkpoint_lag: dict[int, int] = field(default_factory=dict)  # partition -> applied - covered


@dataclass
class Snapshotter:
    """Takes snapshot rounds of the owned partitions, on time or after enough events."""

    store: SnapshotStore
    sink: SnapshotSink
    owned: Callable[[], set[int]]
    applied: Callable[[int], int | None]  # partition -> the last offset applied (None: unknown)
    # The fingerprint of the trust inputs the worker folds with (named in every record).
    trust: str = field(kw_only=True)
    interval_s: float = 300.0
    every_events: int = 100_000
    page: int = 500
    retry_s: float = 10.0  # after a failed round
    # The topic's record limit, less room for the key and the batch's framing.
    max_record_bytes: int = SNAPSHOT_MAX_BYTES - 64 * 1024
    codec: EventCodec = field(default_factory=EventCodec)
    clock: Callable[[], float] = time.monotonic
    now_ms: Callable[[], int] = lambda: int(time.time() * 1000)
    guard: asyncio.Lock | None = None  # held during a round (the worker's, shared with revocation)
    stats: SnapshotStats = field(default_factory=SnapshotStats)
    _since: Counter[int] = field(default_factory=Counter)  # events applied since the last round
    _last: dict[int, float] = field(default_factory=dict)  # partition -> when its round ran
    _current: asyncio.Task[None] | None = None  # the round `run` is waiting for

    def observe(self, updates: Sequence[SessionUpdate]) -> None:
        """Count the events a commit applied, per partition (a worker listener)."""
        for u in updates:
            self._since[u.mark.partition] += len(u.steps)

    def due(self, partition: int) -> bool:
        """Whether the partition's round is due now."""
        last = self._last.setdefault(partition, self.clock())
        return self._since[partition] >= self.every_events or self.clock() - last >= self.interval_s

    async def run(self) -> None:
        """Take rounds for ever (a worker task); a failed round is tried again `retry_s` later."""
        tick = max(0.05, min(1.0, self.interval_s / 10))
        while True:
            await asyncio.sleep(tick)
            owned = self.owned()
            for p in [p for p in self.stats.checkpoint_lag if p not in owned]:
                del self.stats.checkpoint_lag[p]  # handed over: the new owner reports it
            for p in sorted(owned):
                if self.due(p):
                    await self._interruptible(p)

    async def _interruptible(self, partition: int) -> None:
        """`round_safely` in a task of its own, which `held` may cancel (a failed round)."""
        task = asyncio.ensure_future(self.round_safely(partition))
        self._current = task
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # the worker is stopping: the round too
                task.cancel()
                raise
            if not task.cancelled():
                raise
            self._failed(partition)
            log.warning("snapshots of partition %d cancelled by a revocation", partition)
        finally:
            if self._current is task:
                self._current = None

    @contextlib.asynccontextmanager
    async def held(self, timeout: float) -> AsyncIterator[None]:
        """The guard, taken within `timeout` s: past that, the round holding it is cancelled.

        Why: a revocation takes the guard, and the group's rebalance waits for every member's
        revocation; a round waits up to a minute per page on a slow broker. A cancelled round
        publishes nothing more (its open transaction is aborted, its sessions stay in the index)
        and is tried again `retry_s` later, by whoever then owns the partition.
        """
        guard = self.guard
        if guard is None:
            yield
            return
        if not await acquire_within(guard, timeout):
            current = self._current
            if current is not None:
                current.cancel()  # it lets go of the guard first, then stops its writer
            await guard.acquire()
        try:
            yield
        finally:
            guard.release()

    async def round_safely(self, partition: int) -> None:
        """A round that logs and counts its failure instead of raising it."""
        try:
            await self.round(partition)
        except MilpaError as e:
            self._failed(partition)
            log.error("snapshots of partition %d failed, trying again: %s", partition, e)
        except Exception:  # a snapshot is an optimisation: it never stops the folding
            self._failed(partition)
            log.exception("snapshots of partition %d failed, trying again", partition)

    def _failed(self, partition: int) -> None:
        """Count a failed round and make the partition due again `retry_s` from now, not a
        whole interval (a round fenced by a hand-over, or a broker away for a moment)."""
        self.stats.failures += 1
        self._last[partition] = self.clock() - self.interval_s + min(self.retry_s, self.interval_s)

    async def round(self, partition: int) -> int:
        """Snapshot the partition's changed sessions, then write its checkpoint; the number of
        snapshots written."""
        self._last[partition] = self.clock()
        self._since[partition] = 0
        if partition not in self.owned():
            return 0  # not ours: opening a writer would fence off the partition's owner
        if self.applied(partition) is None:
            # Nothing applied here yet (just assigned, or revoked: the worker forgets what it
            # applied then): nothing of ours to cover. Only stubs, if the sweep retired sessions
            # (a quiet partition whose sessions all ended sees no batch); else no writer.
            cursor, found = await self.store.retired(partition, 0, 1)
            if not found and cursor == 0:
                return 0
        # The writer is opened (the broker fences earlier writers) before the guard is taken:
        # starting it takes a round trip or three, which a revocation need not wait for. A
        # partition revoked while it starts can so fence its new owner's writer once: that
        # round fails and is tried again `retry_s` later, and this one finds nothing applied.
        async with self.sink.fenced(partition) as writer:
            if self.guard is None:
                return await self._take(partition, writer)
            async with self.guard:
                if partition not in self.owned():
                    return 0  # revoked while it waited
                return await self._take(partition, writer)

    async def _take(self, partition: int, writer: PartitionWriter) -> int:
        """The round proper, or only its stubs while nothing is applied here."""
        if self.applied(partition) is None:
            await self._stubs(partition, writer)
            return 0
        return await self._round(partition, writer)

    async def _round(self, partition: int, writer: PartitionWriter) -> int:
        applied = self.applied(partition)  # before the index is read: a lower bound
        if applied is None:
            return 0  # revoked while the writer started
        seen: set[str] = set()
        written = 0
        low: int | None = None
        while True:
            pending = await self.store.unsnapshotted(partition, self.page)
            fresh = [sid for sid, _ in pending if sid not in seen]
            if not pending:
                low = None
                break
            if not fresh:
                low = pending[0][1]
                break
            seen.update(fresh)
            raws = await self.store.raw_states(partition, fresh)
            taken = self.now_ms()
            records: list[tuple[bytes, bytes]] = []
            covered: list[tuple[str, Position]] = []
            for sid in fresh:
                raw = raws.get(sid)
                if raw is None:
                    if sid in raws:  # None: half rebuilt, left in the index as it is
                        self.stats.half_built += 1
                        log.warning(
                            "%s is half rebuilt (a `replay --session` of it has not ended): not "
                            "snapshotted, and partition %d's checkpoint stays below it until a "
                            "restore of it ends",
                            sid,
                            partition,
                        )
                    continue  # (else dropped meanwhile, or of another layout: nothing to cover)
                record = snapshot_record(sid, raw, taken, trust=self.trust)
                value = self.codec.encode_snapshot(record)
                if len(value) > self.max_record_bytes:
                    # Left in the index, uncovered: the checkpoint stays below it (a rebuild folds
                    # the session from the log), and the rest of the partition goes on.
                    self.stats.too_large += 1
                    log.warning(
                        "the snapshot of %s is %d bytes, over the %d a record may have: not "
                        "published (partition %d's checkpoint stays below its events)",
                        sid,
                        len(value),
                        self.max_record_bytes,
                        partition,
                    )
                    continue
                records.append((sid.encode(), value))
                covered.append((sid, Position(record["partition"], record["offset"])))
                self.stats.bytes += len(value)
            await writer.publish(records)
            written += len(records)
            gone: list[tuple[str, Position | None]] = [
                (sid, None) for sid in fresh if sid not in raws
            ]
            low = await self.store.snapped(partition, [*covered, *gone])
            if low is None:
                break
        self.stats.rounds += 1
        self.stats.snapshots += written
        through = applied if low is None else min(applied, low - 1)
        checkpoint = checkpoint_record(partition, through, self.now_ms(), trust=self.trust)
        value = self.codec.encode_checkpoint(checkpoint)
        await writer.publish([(checkpoint_key(partition), value)])
        self.stats.checkpoints += 1
        self.stats.checkpoint_lag[partition] = applied - through
        # After the checkpoint: the stubs cover nothing it vouches for, and a failure among
        # them must not keep it from moving.
        await self._stubs(partition, writer)
        return written

    async def _stubs(self, partition: int, writer: PartitionWriter) -> None:
        """Replace the snapshots of the partition's retired sessions (the retention sweep
        dropped their projections) with stubs: their tombstones and counters, no state.

        The sweep drops a session only once it is out of the unsnapshotted index, so its last
        state's snapshot was acknowledged before, by this writer or one it fenced off: its stub
        comes after it on the topic and replaces it. A `replay --session` of a retired session
        takes its entry away before it folds; one that starts between this read and the stub's
        publication leaves the stub after the session's older snapshot but before its next one
        (a round after the restore), which replaces it. An entry that does not read is logged
        and forgotten: its session keeps its full snapshot.
        """
        cursor = 0
        while True:
            cursor, entries = await self.store.retired(partition, cursor, self.page)
            records: list[tuple[bytes, bytes]] = []
            taken = self.now_ms()
            for sid, raw in entries:
                try:
                    stub = stub_record(parse_retired(raw, sid), taken, trust=self.trust)
                except ValueError as e:
                    log.warning("no stub for %s (its full snapshot stays): %s", sid, e)
                    continue
                records.append((sid.encode(), self.codec.encode_snapshot(stub)))
            if records:
                await writer.publish(records)
                self.stats.stubs += len(records)
                self.stats.bytes += sum(len(v) for _, v in records)
            await self.store.unretire(partition, entries)
            if cursor == 0:
                return


async def snapshot_partitions(
    store: SnapshotStore,
    sink: SnapshotSink,
    applied: Mapping[int, int],
    codec: EventCodec | None = None,
    *,
    trust: str,
) -> int:
    """One round of each of these partitions, applied through the given offsets (a rebuild
    that has just applied them under `trust`, with no worker running); the snapshots written.

    The rounds run side by side: each has a writer of its own, whose start is mostly waiting.
    """
    taker = Snapshotter(
        store, sink, lambda: set(applied), applied.get, trust=trust, codec=codec or EventCodec()
    )
    # Every round runs to its end before a failure is raised: none is left running against a
    # store or a sink the caller closes once this returns.
    done = await asyncio.gather(*(taker.round(p) for p in sorted(applied)), return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome
    return sum(n for n in done if isinstance(n, int))
