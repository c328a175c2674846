"""The projector's batch step, framework-free: decode → fold → commit with marks → publish.

The Faust agent (processors/app.py) only feeds it batches and acks them after it returns. It never
returns before every record of the batch is either applied in Redis (with its mark), written to
the dead-letter topic, or left unapplied in a parked partition (a record the fold raised on, or
of a session whose stored state or needed history does not read, and the partition's later ones:
their offsets are kept out of the batch's), so an ack never commits past an event that was not
applied. Redis failures are retried with backoff for as long as it takes; the consumer stalls
instead of skipping.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka import errors as kafka_errors

from processors.fitting import fit, fit_dead_letter, fit_key
from processors.histogram import BATCH_SIZE_BUCKETS, LAG_MS_BUCKETS, Histogram
from processors.ports import Consumed, OutRecord, Sink
from producers.decisions import decision_record
from producers.questions import change_record
from projections.redis_store import AsyncRedisProjectionStore
from schemas.codec import EventCodec
from schemas.errors import (
    BackendError,
    CorruptProjectionError,
    LogError,
    ProducerStoppedError,
    ProjectionError,
)
from session_model.cycle import Folding, ProjectionCycle, Read, ReadDecisions, Steps, Write
from session_model.fold import Kind
from session_model.intake import WRONG_PARTITION, Intake, Refusal
from session_model.ports import CommitResult
from session_model.projection import BatchFolder, Fault, Folded, Record, SessionUpdate
from session_model.questions import QuestionChange, update_changes
from session_model.session import OTHER_NAMES, PAUSE_REASONS, Decision

log = logging.getLogger(__name__)

SLICE = 500  # records decoded or folded between two yields to the event loop
# A batch timestamped further ahead of this worker's clock is counted (`timestamps_ahead`): a
# producer's clock ahead (CreateTime) would otherwise hide a lag as 0.
CLOCK_AHEAD_MS = 1_000
T = TypeVar("T")

# Dead-letter headers. `milpa-source` (topic:partition:offset of the refused record) is the dead
# letter's stable id: a redelivered batch dead-letters its refusals again; consumers dedupe on it.
DEADLETTER_REASON = "milpa-error"
DEADLETTER_CODE = "milpa-refusal"
DEADLETTER_SOURCE = "milpa-source"
# Present when the refused record (key and value) was cut to fit a produce request: the sizes it
# had, `key:<bytes>,value:<bytes>`. The whole record stays in the events topic at `milpa-source`.
DEADLETTER_CUT = "milpa-cut"
REASON_BYTES = 4096  # of a refusal's reason (UTF-8), in the header and the log


@dataclass(frozen=True, slots=True)
class Prepared:
    """A batch decoded and folded, not yet committed."""

    folding: Folding
    ends: dict[int, int]  # partition -> last offset of the batch
    raws: tuple[Consumed, ...] = ()  # as consumed (a refusal found by the fold is dead-lettered)
    oldest_ms: int = -1  # the oldest record's timestamp (ms since the epoch); -1: none known


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
    records_cut: int = 0  # decisions, question changes and dead letters cut to fit a request
    question_changes: int = 0
    question_changes_republished: int = 0  # of redelivered records (see redelivered_changes)
    conflicts: int = 0
    redis_round_trips: int = 0
    redis_retries: int = 0
    corrupt_reads: int = 0  # stored states that did not decode (parked at, or retried)
    rebuilding_reads: int = 0  # sessions read while a `replay --session` rebuilt them
    publish_retries: int = 0  # decisions, question changes and dead letters sent again
    outcomes: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    # by reason code, which agents choose: a metric label, so a worker counts `PAUSE_REASONS` apart
    pauses: Counter[str] = field(default_factory=Counter)
    downgrades: int = 0
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))
    # From a batch's oldest record's timestamp (CreateTime: its producer's send; LogAppendTime: the
    # broker's append) to the worker holding the batch, and to its commit making it readable: how
    # far the projection trails the log.
    fetched_lag_ms: Histogram = field(default_factory=lambda: Histogram(LAG_MS_BUCKETS))
    visible_lag_ms: Histogram = field(default_factory=lambda: Histogram(LAG_MS_BUCKETS))
    # Batches whose oldest timestamp was over `CLOCK_AHEAD_MS` ahead of this worker's clock: their
    # lags read 0, so a clock skew would hide a lag without this count.
    timestamps_ahead: int = 0
    last_offsets: dict[int, int] = field(default_factory=dict)  # partition -> offset processed
    # Sessions whose state was read from Redis, the cache not holding it (a session new to this
    # worker, or dropped past `cache_limit`), and how many the cache holds after the last batch.
    state_reads: int = 0
    cached_sessions: int = 0
    progressed_at: float | None = None  # monotonic seconds when a batch last finished
    parked: Mapping[int, Fault] = field(default_factory=dict)  # partitions the fold parked
    # For `/readyz` (the folder's own, read from the probe's thread): the sessions whose stored
    # state cannot be read now, and per parked partition those of them whose records it holds.
    unreadable: Mapping[str, str] = field(default_factory=dict)
    unreadable_held: Mapping[int, set[str]] = field(default_factory=dict)
    # Those of them a `replay --session` rebuilds: since when (monotonic seconds), for `/readyz`
    # (a routine wait for `stall_s`, then a problem). Each leaves both at once. Stamped before a
    # session enters `unreadable` and dropped after it leaves: the probe, which copies this
    # before and after `unreadable`, then never sees a rebuilding session as damaged.
    rebuilding_since: dict[str, float] = field(default_factory=dict)

    def count_pause(self, reason: str) -> None:
        """One more pause under `reason`, or under `OTHER_NAMES` past `PAUSE_REASONS` reasons."""
        if reason not in self.pauses and len(self.pauses) >= PAUSE_REASONS:
            reason = OTHER_NAMES
        self.pauses[reason] += 1


# What a retry cannot cure: the worker ends with it (as it did with every failed send before).
_PERMANENT = (
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.ClusterAuthorizationFailedError,
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordTooLargeError,
    kafka_errors.InvalidTopicError,
)


def _redis_retry(e: Exception, stats: WorkerStats) -> str | None:
    """Every Redis failure is retried (what it says, counted), none other."""
    if not isinstance(e, ProjectionError):
        return None
    stats.redis_retries += 1
    if isinstance(e, CorruptProjectionError):
        # Folding on would build on a state nobody can read, skipping it would commit past its
        # events: the worker waits, and says what ends the wait. (Only without parking: a
        # worker that parks reads states and histories apart, `_read_parking` and
        # `_read_decisions`, and only their partitions wait.)
        stats.corrupt_reads += 1
        return (
            f"a stored state cannot be read ({e}): rebuild that session with "
            "`milpa-sessions replay --session <id> --force`"
        )
    return f"redis unavailable ({e})"


def _publish_retry(e: Exception, stats: WorkerStats) -> str | None:
    """A refused send is retried (counted) unless the producer stopped or no retry cures it."""
    if not isinstance(e, LogError) or isinstance(e, ProducerStoppedError):
        return None
    if isinstance(e.__cause__, _PERMANENT):
        return None  # a setting to fix (rights, sizes): a retry would stall the partition
    stats.publish_retries += 1
    return str(e)


class ProjectionWorker:
    """Applies batches of raw records to the Redis projections."""

    def __init__(
        self,
        store: AsyncRedisProjectionStore,
        folder: BatchFolder,
        deadletter: Sink,
        decisions: Sink,
        *,
        questions: Sink | None = None,
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
        self.questions = questions
        self.codec = codec or EventCodec()
        self.intake = Intake(self.codec, partitions)
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.stats = WorkerStats()
        self.listeners: list[Callable[[Sequence[SessionUpdate]], None]] = []
        self.cycle = ProjectionCycle(folder, cache_limit=cache_limit, slice_size=SLICE)
        # Told of partitions the fold parked (`BatchFolder.parked`): the consumer stops reading
        # them and never commits past the record parked at.
        self.on_park: Callable[[Sequence[int]], None] = lambda partitions: None
        self._announced: dict[int, Fault] = {}  # the fault logged per parked partition
        self._rebuilt: dict[str, Folded] = {}  # read by `unparkable`, for `unpark`
        self._to_tell: list[SessionUpdate] = []  # rebuilt states, for `tell_rebuilt`
        # Sessions in the folder's `unreadable` for their decisions history (their state reads):
        # how many of its latest decisions a redelivery needed. A state read does not clear them.
        self._histories: dict[str, int] = {}
        if folder.parked is not None:
            self.stats.parked = folder.parked
        self.stats.unreadable = folder.unreadable
        self.stats.unreadable_held = folder.unreadable_held

    def forget(self) -> None:
        """Drop the cache (on rebalance: another worker may have advanced these sessions), and
        the parked partitions (their next owner, this worker again perhaps, reads them anew)."""
        self.cycle.forget()
        self.stats.cached_sessions = 0
        if self.folder.parked:
            self.folder.parked.clear()
        self.folder.unreadable.clear()
        self.folder.unreadable_held.clear()
        self.stats.rebuilding_since.clear()
        self._histories.clear()
        self._rebuilt.clear()
        self._to_tell.clear()
        self._announced.clear()

    def _announce_parked(self) -> None:
        """Log the partitions the fold parked since the last call, and tell `on_park` of every
        parked one (each time: the consumer forgets them at a rebalance, and a batch fetched
        before it may park one again after `forget`)."""
        parked = self.folder.parked
        if not parked:
            return
        announced = self._announced
        for partition in sorted(p for p, f in parked.items() if announced.get(p) is not f):
            fault = parked[partition]  # new, or earlier than the one logged (a re-fold's)
            announced[partition] = fault
            if fault.unreadable:
                log.error(
                    "partition %d parked at offset %d: what is stored of session %r cannot be "
                    "read (%s). This partition's records wait, unapplied and uncommitted, while "
                    "the others go on. A damaged state: rebuild the session with `milpa-sessions "
                    "replay --session %s --force`; one being rebuilt: let its replay end. The "
                    "partition is read again from that record once the session reads whole "
                    "(tried every MILPA_PARK_RETRY_S)",
                    partition,
                    fault.position.offset,
                    fault.session_id,
                    fault.error,
                    fault.session_id,
                )
                continue
            log.error(
                "partition %d parked at offset %d (session %r): the fold raised %s. That is a "
                "bug in the fold, not bad input (bad input is rejected or dead-lettered): this "
                "partition's records wait, unapplied and uncommitted, while the others go on. "
                "Deploy a fixed worker: it reads them again from the committed offset",
                partition,
                fault.position.offset,
                fault.session_id,
                fault.error,
            )
        self.on_park(sorted(parked))

    async def unparkable(self) -> dict[int, Fault]:
        """The faults of the partitions parked at a session whose state (or needed decisions
        history) could not be read and now can, whole (an operator rebuilt it): each partition
        is to be read again from at most its fault's record (`unpark`).

        A session being rebuilt (`replay --session`, under way or died: what is stored is half
        rebuilt), or still absent (its keys dropped: folded onto nothing it would lose its past),
        keeps its partition parked.
        """
        faults = {p: f for p, f in (self.folder.parked or {}).items() if f.unreadable}
        whole = await self._whole([f.session_id for f in faults.values()])
        self._rebuilt.update(whole)
        return {p: f for p, f in faults.items() if f.session_id in whole}

    async def _whole(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """Those of these sessions stored whole now: readable, present, not being rebuilt, and
        their decisions history readable where a redelivery found it not. One round trip (two
        with such histories), not retried (Redis away: none; the caller asks again later)."""
        if not session_ids:
            return {}
        try:
            self.stats.redis_round_trips += 1
            found = await self.store.folded(session_ids, unreadable={}, rebuilding=set())
            whole = {sid: f for sid, f in found.items() if f.mark is not None}
            histories = self._histories
            if histories and (ids := [s for s in whole if s in histories]):
                bad: dict[str, str] = {}
                self.stats.redis_round_trips += 1
                await self.store.decisions(ids, [histories[s] for s in ids], unreadable=bad)
                for sid in bad:
                    del whole[sid]
        except ProjectionError:
            return {}
        return whole

    def unpark(self, faults: Mapping[int, Fault]) -> set[int]:
        """Fold these partitions' records again (the consumer reads them again from where they
        were parked, or before), if each is still parked at that same fault; `tell_rebuilt`
        then tells the listeners of the states the faults waited on (`unparkable` read them).
        The partitions let go."""
        parked = self.folder.parked
        if parked is None:
            return set()
        done: set[int] = set()
        rebuilt: list[SessionUpdate] = []
        for partition, fault in faults.items():
            if parked.get(partition) is not fault:
                continue  # parked again meanwhile (an earlier record, or after a rebalance)
            del parked[partition]
            self.folder.unreadable_held.pop(partition, None)
            done.add(partition)
            self._announced.pop(partition, None)
            sid = fault.session_id
            self._reads_again(sid)
            log.warning(
                "partition %d is read again from offset %d or before: what is stored of session "
                "%r reads now",
                partition,
                fault.position.offset,
                sid,
            )
            folded = self._rebuilt.pop(sid, None)
            if folded is not None and folded.mark is not None:
                rebuilt.append(SessionUpdate(sid, folded.mark, folded.mark, folded.state, ()))
        self._rebuilt.clear()
        self._to_tell.extend(rebuilt)
        return done

    def _reads_again(self, sid: str) -> str | None:
        """This session's stored state and decisions history read: it leaves the unreadable
        ones (the reason it was there, if it was)."""
        self._histories.pop(sid, None)
        was = self.folder.unreadable.pop(sid, None)
        self.stats.rebuilding_since.pop(sid, None)  # after it left them: see `WorkerStats`
        return was

    def tell_rebuilt(self) -> None:
        """Tell the listeners of the rebuilt states `unpark` and `reread` let go (once the
        consumer reads their partitions again: a listener that raises must not leave one
        parked on one side only): their deadlines and due compaction are theirs to time again."""
        rebuilt, self._to_tell = self._to_tell, []
        if rebuilt:
            for listener in self.listeners:
                listener(rebuilt)

    async def reread(self, most: int = 100) -> None:
        """Read again sessions whose stored state did not decode and that parked nothing (the
        scheduler or the timer feed read them; no record of theirs came), `most` at a time, in
        turn: those that read whole now (rebuilt) are readable again, and `tell_rebuilt` tells
        the listeners of them."""
        faulted = {f.session_id for f in (self.folder.parked or {}).values()}
        unreadable = self.folder.unreadable
        ids = [s for s in unreadable if s not in faulted][:most]
        whole = await self._whole(ids)
        for sid in ids:
            folded = whole.get(sid)
            if folded is None:  # still not whole: to the back, so the next call reads others
                if sid in unreadable:
                    unreadable[sid] = unreadable.pop(sid)
                continue
            was = self._reads_again(sid)  # (`_whole` keeps only states with a mark)
            if was is not None and folded.mark is not None:
                self._to_tell.append(SessionUpdate(sid, folded.mark, folded.mark, folded.state, ()))

    async def process(self, raws: Sequence[Consumed]) -> tuple[SessionUpdate, ...]:
        """Apply one batch; returns the updates committed."""
        return await self.finish(await self.prepare(raws))

    async def prepare(self, raws: Sequence[Consumed]) -> Prepared:
        """Decode (dead-lettering what cannot be read) and fold; nothing is committed yet.

        The folded states enter the cache at once, so the next batch can be folded while this
        one is committed (see `ProjectionCycle`).
        """
        self.stats.batches += 1
        self.stats.records += len(raws)
        self.stats.batch_sizes.observe(len(raws))
        oldest = min([t for r in raws if (t := r.timestamp) is not None and t >= 0], default=-1)
        if oldest >= 0:
            lag = time.time() * 1000 - oldest
            if lag < -CLOCK_AHEAD_MS:  # a producer's clock ahead of ours (CreateTime)
                self.stats.timestamps_ahead += 1
            self.stats.fetched_lag_ms.observe(max(0.0, lag))
        folding = await self._drive(self.cycle.fold(await self._decode(raws)))
        self.stats.redelivered += folding.redelivered
        await self._refuse_foreign(raws, folding.foreign)
        self._announce_parked()
        parked = self.folder.parked or {}
        ends = {r.partition: r.offset for r in raws if r.partition not in parked}
        return Prepared(folding, ends, tuple(raws), oldest)

    async def finish(self, prepared: Prepared) -> tuple[SessionUpdate, ...]:
        """Commit a prepared batch (re-folding conflicts), then count and publish its decisions.

        Batches must be finished in the order they were prepared.
        """
        updates, published = await self.commit(prepared)
        await published
        return updates

    async def commit(
        self, prepared: Prepared
    ) -> tuple[tuple[SessionUpdate, ...], Coroutine[Any, Any, None]]:
        """Commit a prepared batch (re-folding conflicts) and count it; its updates, and the
        publishing of its decisions and question changes, which ends the batch.

        Batches must be committed in the order they were prepared, and their publishing awaited
        in that order too (a session's decisions reach the topic in seq order: a subscriber drops
        one not beyond the last it handed out), but a commit need not wait for the publishing
        of the batch before it.
        """
        committed = await self._drive(self.cycle.commit(prepared.folding))
        if prepared.oldest_ms >= 0:  # readable now (its decisions are published after)
            self.stats.visible_lag_ms.observe(max(0.0, time.time() * 1000 - prepared.oldest_ms))
        self.stats.conflicts += committed.conflicts
        self.stats.redelivered += committed.redelivered
        await self._refuse_foreign(prepared.raws, committed.foreign)
        updates = committed.updates
        self._count(updates)
        # The listeners (the timer feed, the scheduler) also hear of sessions whose records a
        # conflict found applied already (a commit sent again after its reply was lost): else a
        # deadline asked in them would never be timed.
        observed = (*updates, *committed.settled) if committed.settled else updates
        for listener in self.listeners:
            listener(observed)
        again = (*prepared.folding.again, *committed.again)
        reasked = (*prepared.folding.reasked, *committed.reasked)
        return updates, self._published(prepared, updates, again, reasked)

    async def _published(
        self,
        prepared: Prepared,
        updates: Sequence[SessionUpdate],
        again: Sequence[tuple[str, Decision]],
        reasked: Sequence[QuestionChange],
    ) -> None:
        """Publish a committed batch's decisions and question changes, then mark it finished.

        The sends are made here, not by `commit`: a publishing closed before it starts (the
        batch before it refused for good) then leaves no send behind, never awaited.
        """
        sends = [
            sent
            for sent in (self._decisions_out(updates, again), self._questions_out(updates, reasked))
            if sent is not None
        ]
        await _together(sends)
        # Before this batch is marked finished (the consumer reads its parked partitions right
        # after this returns, with no await between): a conflict's re-fold may have parked one,
        # and one parked before a rebalance is told again.
        self._announce_parked()
        parked = self.folder.parked
        ends = prepared.ends
        if parked:
            ends = {p: offset for p, offset in ends.items() if p not in parked}
        self.stats.last_offsets.update(ends)
        self.stats.cached_sessions = len(self.cycle.cache)
        self.stats.progressed_at = time.monotonic()  # for the health probe (`processors/health`)

    async def states(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """The latest folded state of these sessions (cache first, one round trip for misses);
        one whose stored state does not decode is left out, as an unknown one is."""
        return await self._drive(self.cycle.states(session_ids))

    async def readable_states(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """As `states`, but `CorruptProjectionError` names one whose stored state does not
        decode: for a reader that must not take it for unknown (the timer feed would clear its
        deadline), and leaves it out itself."""
        found = await self.states(session_ids)
        unreadable = self.folder.unreadable
        for sid in session_ids:
            if sid not in found and sid in unreadable:
                raise CorruptProjectionError(unreadable[sid])
        return found

    def set_partitions(self, partitions: int | None) -> None:
        """The events topic's partition count: records outside their key's partition are refused."""
        if partitions != self.intake.partitions:
            self.intake = Intake(self.codec, partitions)
        keys = self.store.keys
        if partitions is not None and partitions != keys.partitions:
            # Where a session's keys live depends on the count (`projections.keys`): the topic's
            # wins over a setting that disagrees, which readers will then also get wrong.
            log.warning(
                "the events topic has %d partitions, the settings say %d (MILPA_PARTITIONS)",
                partitions,
                keys.partitions,
            )
            self.store.use_partitions(partitions)

    async def _drive(self, steps: Steps[T]) -> T:
        """Answer the cycle's requests: Redis calls retried until they succeed, pauses yielded."""
        store = self.store
        stats = self.stats

        def read(ids: tuple[str, ...]) -> Awaitable[dict[str, Folded]]:
            stats.state_reads += len(ids)
            if self.folder.parked is None:  # a state that does not read stalls every partition
                return self._retrying(functools.partial(store.folded, ids))
            return self._read_parking(ids)

        return await drive(
            steps,
            read,
            lambda updates: self._retrying(functools.partial(store.commit, updates)),
            self._pause,
            self._read_decisions,
        )

    async def _read_decisions(
        self, ids: tuple[str, ...], latest: tuple[int, ...]
    ) -> dict[str, tuple[Decision, ...]]:
        """A redelivery's decisions from the sessions' histories; a history that does not decode
        (with parking) is left out and its session put in the folder's `unreadable`, whose
        records then park their partition (the others go on)."""
        if self.folder.parked is None:  # a history that does not read stalls every partition
            return await self._retrying(functools.partial(self.store.decisions, ids, latest))
        bad: dict[str, str] = {}

        async def read() -> dict[str, tuple[Decision, ...]]:
            bad.clear()
            return await self.store.decisions(ids, latest, unreadable=bad)

        found = await self._retrying(read)
        for sid, n in zip(ids, latest, strict=True):
            why = bad.get(sid)
            if why is not None:
                self._histories[sid] = max(n, self._histories.get(sid, 0))
                self._hold_damaged(sid, why, "a stored decisions history", "redelivered")
        return found

    async def _read_parking(self, ids: tuple[str, ...]) -> dict[str, Folded]:
        """The states of these sessions; one that does not decode is left out and put in the
        folder's `unreadable`, whose first record then parks its partition (the others go on)."""
        bad: dict[str, str] = {}
        rebuilding: set[str] = set()

        async def read() -> dict[str, Folded]:
            bad.clear()
            rebuilding.clear()
            return await self.store.folded(ids, unreadable=bad, rebuilding=rebuilding)

        found = await self._retrying(read)
        unreadable = self.folder.unreadable
        for sid in ids:
            why = bad.get(sid)
            if why is None:
                if sid in self._histories:  # its history is read again apart (`_whole`)
                    continue
                folded = found.get(sid)
                if (folded is None or folded.mark is None) and self._holding(sid):
                    # Absent, its records held: its keys were dropped. Folded onto nothing it
                    # would lose its past, so it stays unreadable (`/readyz`: a problem, no
                    # replay being under way) until an operator rebuilds it.
                    self.stats.rebuilding_since.pop(sid, None)
                    continue
                self._reads_again(sid)  # rebuilt (or never held)
                continue
            if sid in unreadable:
                continue  # said already
            if sid in rebuilding:  # a routine restore, not damage
                self.stats.rebuilding_since[sid] = time.monotonic()  # (before: `WorkerStats`)
                unreadable[sid] = why
                self.stats.rebuilding_reads += 1
                log.warning("%s: its partition waits at the session's next record", why)
                continue
            self._hold_damaged(sid, why, "a stored state", "next")
        return found

    def _holding(self, sid: str) -> bool:
        """Whether a parked partition holds records of this session (one that could not be
        read when they came)."""
        return any(sid in held for held in self.folder.unreadable_held.values())

    def _hold_damaged(self, sid: str, why: str, what: str, record: str) -> None:
        """Put a session whose `what` does not decode in the folder's `unreadable` (its
        `record` record parks its partition), counted and logged once."""
        unreadable = self.folder.unreadable
        if sid in unreadable:
            return
        unreadable[sid] = why
        self.stats.corrupt_reads += 1
        log.error(
            "%s cannot be read (%s): its partition waits at the session's %s record until it "
            "reads (rebuild the session with `milpa-sessions replay --session <id> --force`)",
            what,
            why,
            record,
        )

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
        await self._dead_letter(refused)
        return records

    async def _dead_letter(self, refused: Sequence[tuple[Consumed, Refusal]]) -> None:
        """Send these refused records to the dead-letter topic, in one publish: a batch of bad
        records must not cost an acknowledged round trip each (4,000 of them held the fold
        for longer than a revocation waits)."""
        if not refused:
            return
        await self._publishing(self.deadletter, [self._refused(r, f) for r, f in refused])
        self.stats.dead_lettered += len(refused)
        self.stats.refused.update(refusal.code for _, refusal in refused)

    def _refused(self, raw: Consumed, refusal: Refusal) -> OutRecord:
        source = f"{raw.topic}:{raw.partition}:{raw.offset}"
        key, value, cut = fit_dead_letter(raw.key, raw.value or b"")
        # Whole characters only, at most REASON_BYTES: with the other headers well inside the
        # room `fit_dead_letter` leaves beside a record cut to fit.
        reason = refusal.reason.encode()[:REASON_BYTES].decode("utf-8", "ignore")
        headers = [
            (DEADLETTER_REASON, reason.encode()),
            (DEADLETTER_CODE, refusal.code.encode()),
            (DEADLETTER_SOURCE, source.encode()),
        ]
        if cut:
            headers.append((DEADLETTER_CUT, cut.encode()))
            self.stats.records_cut += 1
        log.warning("dead-lettering %s: %s", source, reason)
        return key, value, headers

    async def _pause(self) -> None:
        """Let other tasks (the scheduler's deadlines) run between two slices of a batch."""
        await asyncio.sleep(0)

    async def _refuse_foreign(self, raws: Sequence[Consumed], foreign: Sequence[Record]) -> None:
        """Dead-letter the records of sessions projected from another partition (as consumed)."""
        if not foreign:
            return
        by_position = {(raw.partition, raw.offset): raw for raw in raws}
        refused = []
        for record in foreign:
            sid, p = record.event.session_id, record.position
            why = f"session {sid!r} is projected from another partition than {p.partition}"
            refused.append((by_position[(p.partition, p.offset)], Refusal(WRONG_PARTITION, why)))
        await self._dead_letter(refused)

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        """A Redis call, retried until Redis answers."""

        async def attempt() -> T:
            self.stats.redis_round_trips += 1
            return await call()

        return await self._backing_off(attempt, _redis_retry)

    async def _publishing(self, sink: Sink, records: Sequence[OutRecord]) -> None:
        """Publish, retried while the broker refuses for a reason that may pass.

        A batch's records go out after its commit and before its offsets: a failed send is sent
        again here (its decisions may then be published twice, as after a redelivery) instead of
        ending the worker, whose restart would redeliver and republish the same. A stopped
        producer (shutting down) and a refusal no retry cures (`_PERMANENT`: rights, sizes) are
        not retried: the batch stays unacknowledged and the error ends the worker.
        """
        await self._backing_off(functools.partial(sink.publish_many, records), _publish_retry)

    async def _backing_off(
        self,
        call: Callable[[], Awaitable[T]],
        retry: Callable[[Exception, WorkerStats], str | None],
    ) -> T:
        """`call`, again after pauses that double (`retry_initial` to `retry_max`) for as long as
        `retry` names the failure (counting it in the stats); any other failure is raised."""
        delay = self.retry_initial
        while True:
            try:
                return await call()
            except BackendError as e:
                what = retry(e, self.stats)
                if what is None:
                    raise
                log.error("%s; retrying in %.2fs", what, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.retry_max)

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
                    stats.count_pause(o.pause_reason)
                if o.downgraded:
                    stats.downgrades += 1
        for kind, n in kinds.items():
            stats.outcomes[kind.value] += n
        stats.applied += kinds[Kind.APPLIED]

    def _decisions_out(
        self, updates: Sequence[SessionUpdate], again: Sequence[tuple[str, Decision]] = ()
    ) -> Coroutine[Any, Any, None] | None:
        """Publishing the batch's decisions (republished ones first), one wait; None if none."""
        made = [(u.session_id, d) for u in updates for d, _ in u.decisions]
        if again:  # each once, older first: per session the seqs keep increasing
            again = list({(sid, d.seq): (sid, d) for sid, d in again}.values())
        if not made and not again:
            return None
        records: list[OutRecord] = [
            (fit_key(sid), self._fitted(decision_record(sid, d), self.codec.encode_decision), ())
            for sid, d in (*again, *made)
        ]

        def counted() -> None:
            self.stats.decisions += len(made)
            self.stats.decisions_republished += len(again)

        return self._sent(self.decisions, records, counted)

    def _fitted(
        self, record: dict[str, Any], encode: Callable[[Mapping[str, Any]], bytes]
    ) -> bytes:
        value, cut = fit(record, encode)
        if cut:
            self.stats.records_cut += 1
            log.warning(
                "%s %s: cut to %d bytes to fit a produce request",
                record.get("session_id"),
                record.get("question_id"),
                len(value),
            )
        return value

    def _questions_out(
        self, updates: Sequence[SessionUpdate], again: Sequence[QuestionChange] = ()
    ) -> Coroutine[Any, Any, None] | None:
        """Publishing the questions feed: republished changes first (older), then this batch's,
        one wait; None if there is none (or no feed)."""
        if self.questions is None:
            return None
        made = [c for u in updates for c in update_changes(u)]
        if again:  # each once
            again = list({(c.session_id, c.order()): c for c in again}.values())
        if not made and not again:
            return None
        encode = self.codec.encode_question_change
        records: list[OutRecord] = [
            (fit_key(c.session_id), self._fitted(change_record(c), encode), ())
            for c in (*again, *made)
        ]

        def counted() -> None:
            self.stats.question_changes += len(made)
            self.stats.question_changes_republished += len(again)

        return self._sent(self.questions, records, counted)

    async def _sent(
        self, sink: Sink, records: Sequence[OutRecord], counted: Callable[[], None]
    ) -> None:
        """Publish `records` (retried as `_publishing` does), then count them."""
        await self._publishing(sink, records)
        counted()


async def _together(sends: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run these publishes, all queued before any waits (one wait for a batch's decisions and
    question changes, not two: the next batch's publishing waits for this one). A failure no retry
    cures cancels the others and is raised, as it was when they ran in turn: it must not wait
    behind another's retries. A single one is awaited as it is (no task per batch)."""
    if len(sends) <= 1:
        for send in sends:
            await send
        return
    try:
        async with asyncio.TaskGroup() as publishing:
            for send in sends:
                publishing.create_task(send)
    except BaseExceptionGroup as failed:
        first = failed.exceptions[0]  # the failure itself, not the group
        raise first from first.__cause__


async def drive(
    steps: Steps[T],
    read: Callable[[tuple[str, ...]], Awaitable[dict[str, Folded]]],
    write: Callable[[tuple[SessionUpdate, ...]], Awaitable[CommitResult]],
    pause: Callable[[], Awaitable[None]],
    decisions: Callable[
        [tuple[str, ...], tuple[int, ...]], Awaitable[dict[str, tuple[Decision, ...]]]
    ],
) -> T:
    """Answer a `ProjectionCycle`'s requests asynchronously; the cycle's result."""
    reply: Any = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result
        if type(request) is Read:
            reply = await read(request.session_ids)
        elif type(request) is Write:
            reply = await write(request.updates)
        elif type(request) is ReadDecisions:
            reply = await decisions(request.session_ids, request.latest)
        else:
            await pause()
            reply = None
