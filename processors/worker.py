"""The projector's batch step, framework-free: decode → fold → commit with marks → publish.

The Faust agent (processors/app.py) only feeds it batches and acks them after it returns. It never
returns before every record of the batch is either applied in Redis (with its mark) or written to
the dead-letter topic, so an ack never commits past an event that was not applied. Redis failures
are retried with backoff for as long as it takes; the consumer stalls instead of skipping.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from processors.histogram import BATCH_SIZE_BUCKETS, Histogram
from producers.decisions import decision_record
from projections.redis_store import AsyncRedisProjectionStore
from schemas.codec import EventCodec
from schemas.errors import ProjectionError
from session_model.fold import Kind
from session_model.intake import WRONG_PARTITION, Intake, Refusal
from session_model.ports import CommitResult
from session_model.projection import (
    BatchFolder,
    Folded,
    Record,
    SessionUpdate,
    foreign_records,
    joined,
    redelivered_decisions,
)
from session_model.session import Decision

log = logging.getLogger(__name__)

SLICE = 500  # records decoded or folded between two yields to the event loop
T = TypeVar("T")

# Dead-letter headers. `milpa-source` (topic:partition:offset of the refused record) is the dead
# letter's stable id: a redelivered batch dead-letters its refusals again; consumers dedupe on it.
DEADLETTER_REASON = "milpa-error"
DEADLETTER_CODE = "milpa-refusal"
DEADLETTER_SOURCE = "milpa-source"


class Consumed(Protocol):
    """A record as consumed (aiokafka's `ConsumerRecord` is one, passed through as it comes)."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def topic(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A consumed record built by hand (tests, tools): key, value and where it sits."""

    key: bytes | None
    value: bytes | None
    partition: int
    offset: int
    topic: str = ""


OutRecord = tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch decoded and folded, not yet committed."""

    records: list[Record]
    updates: tuple[SessionUpdate, ...]
    ends: dict[int, int]  # partition -> last offset of the batch
    again: tuple[tuple[str, Decision], ...] = ()  # decisions of redelivered records, re-published
    raws: tuple[Consumed, ...] = ()  # as consumed (a refusal found by the fold is dead-lettered)


class Sink(Protocol):
    """Somewhere to publish records and wait until they are acknowledged."""

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        """Publish and wait for the acknowledgement."""
        ...

    async def publish_many(self, records: Sequence[OutRecord]) -> None:
        """Queue every record in order, then wait for all acknowledgements together."""
        ...


@dataclass
class WorkerStats:
    """Running totals of what the worker did (exported as metrics)."""

    batches: int = 0
    records: int = 0
    applied: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # dead-lettered, by refusal code
    decisions: int = 0
    decisions_republished: int = 0  # of redelivered records (see redelivered_decisions)
    conflicts: int = 0
    redis_round_trips: int = 0
    redis_retries: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    pauses: Counter[str] = field(default_factory=Counter)
    downgrades: int = 0
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    last_offsets: dict[int, int] = field(default_factory=dict)  # partition -> offset processed


class ProjectionWorker:
    """Applies batches of raw records to the Redis projections."""

    def __init__(
        self,
        store: AsyncRedisProjectionStore,
        folder: BatchFolder,
        deadletter: Sink,
        decisions: Sink,
        *,
        codec: EventCodec | None = None,
        partitions: int | None = None,
        cache_limit: int = 100_000,
        retry_initial: float = 0.05,
        retry_max: float = 5.0,
    ) -> None:
        self.store = store
        self.folder = folder
        self.deadletter = deadletter
        self.decisions = decisions
        self.codec = codec or EventCodec()
        self.intake = Intake(self.codec, partitions)
        self.cache_limit = cache_limit
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.stats = WorkerStats()
        self.listeners: list[Callable[[Sequence[SessionUpdate]], None]] = []
        self._cache: dict[str, Folded] = {}

    def forget(self) -> None:
        """Drop the cache (on rebalance: another worker may have advanced these sessions)."""
        self._cache.clear()

    async def process(self, raws: Sequence[Consumed]) -> tuple[SessionUpdate, ...]:
        """Apply one batch; returns the updates committed."""
        return await self.finish(await self.prepare(raws))

    async def prepare(self, raws: Sequence[Consumed]) -> Prepared:
        """Decode (dead-lettering what cannot be read) and fold; nothing is committed yet.

        The folded states enter the cache at once, so the next batch can be folded while this
        one is committed. That is safe because a state is determined by its mark: whoever folds
        a session's partition up to offset X gets the same state. If this batch's commit meets a
        conflict, `finish` re-folds it from Redis, and the next batch's commit for that session
        conflicts in turn (or finds the mark its fold expected, and the state that goes with it).
        """
        self.stats.batches += 1
        self.stats.records += len(raws)
        self.stats.batch_sizes.observe(len(raws))
        records = await self._decode(raws)
        updates, again, foreign = await self._fold(records)
        if foreign:
            await self._refuse_foreign(raws, foreign)
            strays = {id(r) for r in foreign}
            records = [r for r in records if id(r) not in strays]
        ends = {r.partition: r.offset for r in raws}
        return Prepared(records, updates, ends, again, tuple(raws))

    async def finish(self, prepared: Prepared) -> tuple[SessionUpdate, ...]:
        """Commit a prepared batch (re-folding conflicts), then count and publish its decisions.

        Batches must be finished in the order they were prepared.
        """
        updates, refolded = await self._commit(prepared)
        self._count(updates)
        for listener in self.listeners:
            listener(updates)
        await self._publish_decisions(updates, (*prepared.again, *refolded))
        self.stats.last_offsets.update(prepared.ends)
        return updates

    async def states(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """The latest folded state of these sessions (cache first, one round trip for misses)."""
        misses = [sid for sid in session_ids if sid not in self._cache]
        if misses:
            self._cache.update(await self._retrying(functools.partial(self.store.folded, misses)))
        return {sid: self._cache[sid] for sid in session_ids if sid in self._cache}

    def set_partitions(self, partitions: int | None) -> None:
        """The events topic's partition count: records outside their key's partition are refused."""
        if partitions != self.intake.partitions:
            self.intake = Intake(self.codec, partitions)

    async def _decode(self, raws: Sequence[Consumed]) -> list[Record]:
        records: list[Record] = []
        append = records.append
        admit = self.intake.admit
        refused: list[tuple[Consumed, Refusal]] = []
        for i, raw in enumerate(raws):
            if i and not i % SLICE:
                await self._pause()
            admitted = admit(raw.key, raw.value, raw.partition, raw.offset)
            if type(admitted) is Record:
                append(admitted)
            else:
                refused.append((raw, admitted))  # type: ignore[arg-type] # a Refusal
        for raw, refusal in refused:
            await self._dead_letter(raw, refusal)
        return records

    async def _dead_letter(self, raw: Consumed, refusal: Refusal) -> None:
        source = f"{raw.topic}:{raw.partition}:{raw.offset}"
        headers = [
            (DEADLETTER_REASON, refusal.reason.encode()),
            (DEADLETTER_CODE, refusal.code.encode()),
            (DEADLETTER_SOURCE, source.encode()),
        ]
        log.warning("dead-lettering %s: %s", source, refusal.reason)
        await self.deadletter.publish(raw.key, raw.value or b"", headers)
        self.stats.dead_lettered += 1
        self.stats.refused[refusal.code] += 1

    async def _fold(
        self, records: list[Record]
    ) -> tuple[tuple[SessionUpdate, ...], tuple[tuple[str, Decision], ...], list[Record]]:
        """Fold onto the cache (loading misses); also the decisions of records already applied,
        and the records left unfolded because their session is projected from another partition.

        In slices of SLICE records with a yield between them: a 4,000-record batch held the loop
        for ≈ 50 ms of folding, and a deadline of the scheduler in this loop waited as long. A
        session touched in several slices gets one update (`joined`), based on its mark before the
        batch. A slice re-reads a session that left the cache meanwhile (a conflict of the batch
        being committed drops it); the commit's compare-and-set catches a state folded on both.
        """
        ids = list(dict.fromkeys(r.event.session_id for r in records))
        new: set[str] = set()  # read and not found: sessions this batch starts
        await self._load_missing(ids, new)
        merged: dict[str, SessionUpdate] = {}
        again: list[tuple[str, Decision]] = []
        foreign: list[Record] = []
        fold, cache = self.folder.fold, self._cache
        for at in range(0, len(records), SLICE):
            chunk = records[at : at + SLICE]
            if at:
                await self._pause()
                await self._load_missing([r.event.session_id for r in chunk], new)
                self._refold_replaced(records[:at], chunk, merged)
            updates = fold(cache, chunk)
            skipped = len(chunk) - sum(len(u.steps) for u in updates)
            if skipped:  # rare (a redelivery): only then is the slice searched, before its fold
                strays = foreign_records(cache, chunk)
                foreign.extend(strays)
                self.stats.redelivered += skipped - len(strays)
                again.extend(redelivered_decisions(cache, chunk))
            for u in updates:
                sid = u.session_id
                cache[sid] = Folded(u.state, u.mark)
                before = merged.get(sid)
                merged[sid] = u if before is None else joined(before, u)
        return tuple(merged.values()), tuple(again), foreign

    def _refold_replaced(
        self, earlier: list[Record], chunk: list[Record], merged: dict[str, SessionUpdate]
    ) -> None:
        """Fold again the earlier slices' records of sessions whose cached state was replaced.

        While the batch yielded, the one being committed may have trimmed the cache or re-read a
        conflicted session: the cache then no longer holds what the earlier slices folded, and
        this slice's update would not follow theirs. Their records are folded again onto what the
        cache holds now (those at or below its mark are skipped), so the batch keeps one update
        per session that follows from one state.
        """
        cache = self._cache
        replaced = {
            sid
            for sid in {r.event.session_id for r in chunk}
            if sid in merged and ((f := cache.get(sid)) is None or f.mark != merged[sid].mark)
        }
        if not replaced:
            return
        for sid in replaced:
            del merged[sid]
        redone = self.folder.fold(cache, [r for r in earlier if r.event.session_id in replaced])
        for u in redone:
            cache[u.session_id] = Folded(u.state, u.mark)
            merged[u.session_id] = u

    async def _pause(self) -> None:
        """Let other tasks (the scheduler's deadlines) run between two slices of a batch."""
        await asyncio.sleep(0)

    async def _load_missing(self, session_ids: list[str], new: set[str]) -> None:
        """Read the sessions neither cached nor known to be new (one round trip, if any).

        Checked again after each read: while it was awaited, the batch being committed may have
        trimmed the cache or dropped a conflicted session, and the fold that follows without a
        yield must find every session it folds.
        """
        cache = self._cache
        while misses := list(
            dict.fromkeys(s for s in session_ids if s not in cache and s not in new)
        ):
            found = await self._retrying(functools.partial(self.store.folded, misses))
            cache.update(found)
            new.update(s for s in misses if s not in found)

    async def _refuse_foreign(self, raws: Sequence[Consumed], foreign: Sequence[Record]) -> None:
        """Dead-letter the records of sessions projected from another partition (as consumed)."""
        by_position = {(raw.partition, raw.offset): raw for raw in raws}
        for record in foreign:
            sid, p = record.event.session_id, record.position
            await self._dead_letter(
                by_position[(p.partition, p.offset)],
                Refusal(
                    WRONG_PARTITION,
                    f"session {sid!r} is projected from another partition than {p.partition}",
                ),
            )

    async def _commit(
        self, prepared: Prepared
    ) -> tuple[tuple[SessionUpdate, ...], list[tuple[str, Decision]]]:
        """Commit, re-folding conflicted sessions from Redis until none conflicts.

        Returns the updates applied and the decisions of records a re-fold found already applied:
        whoever applied them (a stale owner, or this worker's own earlier fold) may never have
        published them, so they are published again.
        """
        records, updates = prepared.records, prepared.updates
        done: list[SessionUpdate] = []
        again: list[tuple[str, Decision]] = []
        while updates:
            result: CommitResult = await self._retrying(
                functools.partial(self.store.commit, updates)
            )
            conflicted = set(result.conflicts)
            done.extend(u for u in updates if u.session_id not in conflicted)
            if not conflicted:
                break
            self.stats.conflicts += len(conflicted)
            for sid in conflicted:
                self._cache.pop(sid, None)  # re-read: someone else moved this session's mark
            records = [r for r in records if r.event.session_id in conflicted]
            self.stats.redelivered -= len(records) - sum(
                len(u.steps) for u in updates if u.session_id in conflicted
            )  # counted again by the re-fold
            updates, more, foreign = await self._fold(records)
            again.extend(more)
            if foreign:
                await self._refuse_foreign(prepared.raws, foreign)
                strays = {id(r) for r in foreign}
                records = [r for r in records if id(r) not in strays]
        self._trim_cache()
        return tuple(done), again

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        delay = self.retry_initial
        while True:
            try:
                self.stats.redis_round_trips += 1
                return await call()
            except ProjectionError as e:
                self.stats.redis_retries += 1
                log.error("redis unavailable (%s); retrying in %.2fs", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)

    def _trim_cache(self) -> None:
        if len(self._cache) > self.cache_limit:
            for sid in list(self._cache)[: len(self._cache) // 2]:
                del self._cache[sid]

    def _count(self, updates: Sequence[SessionUpdate]) -> None:
        stats = self.stats
        kinds: Counter[Kind] = Counter()
        for u in updates:
            for s in u.steps:
                o = s.outcome
                kinds[o.kind] += 1
                if o.rejection is not None:
                    stats.rejections[o.rejection.code] += 1
                if o.pause_reason is not None:
                    stats.pauses[o.pause_reason] += 1
                if o.downgraded:
                    stats.downgrades += 1
        for kind, n in kinds.items():
            stats.outcomes[kind.value] += n
        stats.applied += kinds[Kind.APPLIED]

    async def _publish_decisions(
        self, updates: Sequence[SessionUpdate], again: Sequence[tuple[str, Decision]] = ()
    ) -> None:
        # One wait for the whole batch, not one broker round trip per decision.
        made = [(u.session_id, d) for u in updates for d, _ in u.decisions]
        if again:  # each once, older first: per session the seqs keep increasing
            again = list({(sid, d.seq): (sid, d) for sid, d in again}.values())
        records: list[OutRecord] = [
            (sid.encode(), self.codec.encode_decision(decision_record(sid, d)), ())
            for sid, d in (*again, *made)
        ]
        if records:
            await self.decisions.publish_many(records)
            self.stats.decisions += len(made)
            self.stats.decisions_republished += len(again)
