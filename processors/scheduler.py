"""The scheduled processor: it appends `answer_window_closed` and `compacted` events when due.

It runs inside each worker and works only for the partitions that worker owns (Kafka's assignment
is the only coordination: no locks). By default the worker's closings come from its timer process
(`processors.timer_process`, fed by `processors.timer_feed`) and this loop, built with
`closes=False`, only compacts; with `MILPA_SCHEDULER_TIMER_PROCESS=false`, and in the standalone
scheduler (`processors.scheduler_app`), it closes too. It sleeps until the next deadline and is
woken early when the projector sees an earlier one, so no polling interval adds to the lateness.
Its events go to the events topic like any writer's; a tick does not wait for the previous tick's
acks (a task awaits them, and puts back on the schedule whatever the broker refused). Two
schedulers emitting for the same question (a rebalance, a restart at the tick) are harmless: the
event ids are derived from the question, so a second closing is a duplicate, and even with another
id the fold ignores a second closing or an older compaction.

`RetentionSweep` runs beside it in the worker's loop when a TTL is configured: it drops the
projections of ended sessions whose retention deadline has passed, for the owned partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from processors.histogram import LATENESS_MS_BUCKETS, Histogram
from processors.ports import Sink
from projections.indexes import ceil_ms
from schemas.codec import EventCodec
from schemas.errors import ProjectionError
from schemas.events import Event
from session_model.compaction import Compactor, compaction_due
from session_model.projection import Folded, SessionUpdate
from session_model.scheduled import ScheduledIds, compacted, window_closed
from session_model.session import Session

log = logging.getLogger(__name__)

States = Callable[[Sequence[str]], Awaitable[dict[str, Folded]]]
# (sid -> (deadline ms, partition), sid -> partition) for the given partitions.
DueIndex = Callable[[Iterable[int]], Awaitable[tuple[dict[str, tuple[int, int]], dict[str, int]]]]


def _now() -> datetime:
    return datetime.now(UTC)


def _partition_of(update: SessionUpdate) -> int:
    return update.mark.partition


_RETRY_FIRST_S = 0.05  # a failed tick's first retry waits this long; each next one twice as long
_RETRY_MAX_S = 5.0
# Standalone: a session still indexed at a deadline whose closing was sent this long ago has its
# state read again (the closing may have named an asking since answered and asked again).
_RECHECK_CLOSED_S = 1.0
REARM_S = 1.0  # the longest sleep before the wall clock is read again (see `_sleep`)


@dataclass
class SchedulerStats:
    """What the scheduler emitted and how late the closings were."""

    closings: int = 0
    compactions: int = 0
    lateness: Histogram = field(default_factory=lambda: Histogram(LATENESS_MS_BUCKETS))
    wakeups: int = 0
    timer_restarts: int = 0  # the worker's timer process started again: it died or hung
    timer_hangs: int = 0  # of those, ended by the worker for want of a heartbeat


class Scheduler:
    """Closes answer windows at their deadlines and compacts long sessions, for owned partitions."""

    def __init__(
        self,
        states: States,
        due_index: DueIndex,
        events: Sink,
        compactor: Compactor,
        *,
        codec: EventCodec | None = None,
        producer: str = "milpa-scheduler",
        clock: Callable[[], datetime] = _now,
        prepare_chunk: int = 32,
        max_unacknowledged_ticks: int = 256,
        closes: bool = True,
        ids: ScheduledIds | None = None,
    ) -> None:
        self._states = states
        # Its own key unless given: see `ScheduledIds` for why nobody else may know its ids.
        self.ids = ids or ScheduledIds.random()
        self._due_index = due_index
        self._events = events
        self.compactor = compactor
        self.codec = codec or EventCodec()
        self.producer = producer
        self._clock = clock
        self.prepare_chunk = prepare_chunk
        self.max_unacknowledged_ticks = max_unacknowledged_ticks
        # False: closings are another path's (the worker's timer process); compaction only.
        self.closes = closes
        self.stats = SchedulerStats()
        self.owned: set[int] = set()
        self._deadlines: dict[str, tuple[int, int]] = {}  # sid -> (deadline ms, partition)
        self._heap: list[tuple[int, str]] = []
        self._compact: dict[str, int] = {}  # sid -> partition
        # sid -> `through` of the last compaction emitted: no other is emitted for the session
        # while its state does not show that one folded (the index still says "due" until it is,
        # and every new turn moves the cut: each batch would otherwise send another summary).
        self._compacted: dict[str, int] = {}
        # Standalone mode: sid -> (deadline, question id, question seq) checked ahead of time,
        # and sid -> (deadline ms, asked seq, ms of the next re-read) of the closings sent.
        self._prepared: dict[str, tuple[datetime, str, int]] = {}
        self._closed: dict[str, tuple[int, int, int]] = {}
        self._wake = asyncio.Event()
        self._sending: set[asyncio.Future[None]] = set()  # ticks whose acks are awaited
        self._sleeping_until: int | None = None  # ms; None = until woken
        self._retry_s = 0.0  # the pause before a failed tick's closings are sent again
        self._compact_retry_s = 0.0  # the same for compactions (they never hold closings back)
        self._read_retry_s = 0.0  # the same for due work whose states could not be read
        self._later: set[asyncio.Future[None]] = set()  # due work waiting to be put back
        self._summarizing: asyncio.Future[None] | None = None  # summaries being written
        self._loading: asyncio.Future[None] | None = None  # the last assignment's index read
        self._observed: set[str] | None = None  # sessions `observe` saw while it reads

    # -- fed by the projector --------------------------------------------------------------------

    async def assign(self, partitions: Iterable[int]) -> None:
        """Take over exactly these partitions: reload their due work from the indexes, in the
        background (`loaded` waits for it).

        Never raises: it runs in the consumer's rebalance, where an exception ends the worker,
        and with Redis away every member's rebalance would (each exit starts another). The load
        retries until Redis answers, or until the next assignment replaces it.
        """
        self.owned = set(partitions)
        self._deadlines = {}
        self._heap = []
        self._compact = {}
        await self._stop_loading()
        self._observed = set()
        self._loading = asyncio.ensure_future(self._load(frozenset(self.owned)))

    async def loaded(self) -> None:
        """Wait until the last assignment's due work was read from the indexes."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def _stop_loading(self) -> None:
        loading, self._loading = self._loading, None
        if loading is not None and not loading.done():
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading

    async def _load(self, owned: frozenset[int]) -> None:
        pause = 0.0
        while True:
            try:
                deadlines, due = await self._due_index(owned)
                break
            except Exception as e:  # whatever the read raised: the due work must be read
                if not pause:
                    log.error(
                        "could not read the due work of partitions %s, retrying: %r",
                        sorted(owned),
                        e,
                    )
                pause = _backoff(pause)
                await asyncio.sleep(pause)
        if pause:
            log.info("read the due work of partitions %s", sorted(owned))
        # What a batch committed meanwhile (`observe`) is at least as new as the index read: a
        # deadline it set or cleared, compaction it found due or not, stands.
        observed, self._observed = self._observed, None
        for sid, (ms, partition) in deadlines.items() if self.closes else ():
            if observed is None or sid not in observed:
                self._schedule(sid, ms, partition)
        for sid, partition in due.items():
            if observed is None or sid not in observed:
                self._compact.setdefault(sid, partition)
        self._wake.set()

    def observe(self, updates: Sequence[SessionUpdate]) -> None:
        """Learn new deadlines and compaction work from a committed batch; wake if earlier."""
        earliest: int | None = None
        observed = self._observed
        for u in updates:
            partition = _partition_of(u)
            if self.owned and partition not in self.owned:
                continue
            if observed is not None:
                observed.add(u.session_id)
            question = u.state.question if self.closes else None
            deadline = question.deadline() if question is not None else None
            if deadline is None:
                self._deadlines.pop(u.session_id, None)
            else:
                ms = ceil_ms(deadline)
                self._schedule(u.session_id, ms, partition)
                earliest = ms if earliest is None else min(earliest, ms)
            if compaction_due(u.state, self.compactor.max_turns):
                if not self._awaiting_fold(u.state):
                    self._compact[u.session_id] = partition
            else:
                self._compact.pop(u.session_id, None)
                self._compacted.pop(u.session_id, None)
        self._wake_if_earlier(earliest)

    async def prepare(
        self, deadlines: Mapping[str, tuple[int, int]], due: Mapping[str, int]
    ) -> None:
        """Learn due work read from the indexes (the standalone scheduler polls them).

        New deadlines are checked against their sessions' states now, ahead of time (one read for
        all of them), so that when one comes due the closing goes out without reading anything.
        An answer that arrives in between wins the race in the fold, which makes the closing a
        no-op. A deadline already closed is not offered again while the projector catches up;
        but the index cannot tell one asking from the next: if the question was answered and
        asked again with the same id and deadline, the closing sent named the earlier asking and
        the fold ignored it. So a session still indexed at a closed deadline is read again, once
        every `_RECHECK_CLOSED_S`, and a later asking found there is prepared like a new one.
        """
        now_ms = _epoch_ms(self._clock())
        self._closed = {sid: c for sid, c in self._closed.items() if sid in deadlines}
        for sid in [sid for sid in self._prepared if sid not in deadlines]:
            # Gone from the index within the horizon: answered (or closed) meanwhile.
            del self._prepared[sid]
            self._deadlines.pop(sid, None)
        fresh: list[str] = []
        recheck_ms = now_ms + round(_RECHECK_CLOSED_S * 1000)
        for sid, (ms, _) in deadlines.items():
            if self._deadlines.get(sid, (None,))[0] == ms:
                continue  # scheduled already
            closed = self._closed.get(sid)
            if closed is not None and closed[0] == ms:
                if closed[2] > now_ms:
                    continue  # closed a moment ago: the projector is catching up
                self._closed[sid] = (ms, closed[1], recheck_ms)
            fresh.append(sid)
        earliest: int | None = None
        fresh.sort(key=lambda sid: deadlines[sid][0])
        for at in range(0, len(fresh), self.prepare_chunk):
            # In small reads, earliest first: the loop stays free to send what is due meanwhile.
            chunk = fresh[at : at + self.prepare_chunk]
            states = await self._states(chunk)
            for sid in chunk:
                ms, partition = deadlines[sid]
                folded = states.get(sid)
                question = folded.state.question if folded is not None else None
                deadline = question.deadline() if question is not None else None
                if folded is None or folded.state.ended or question is None or deadline is None:
                    continue
                if ceil_ms(deadline) != ms:
                    continue  # the index is behind the state; the next poll sees the new one
                closed = self._closed.get(sid)
                if closed is not None and closed[:2] == (ms, question.seq):
                    continue  # this asking's closing was sent and is not folded yet
                self._prepared[sid] = (deadline, question.id, question.seq)
                self._schedule(sid, ms, partition)
                earliest = ms if earliest is None else min(earliest, ms)
            self._wake_if_earlier(earliest)
        self._compact.update(due)
        self._wake_if_earlier(None)

    def _wake_if_earlier(self, earliest: int | None) -> None:
        sleeping = self._sleeping_until
        if self._compact_ready() or (
            earliest is not None and (sleeping is None or earliest < sleeping)
        ):
            self._wake.set()

    def _schedule(self, sid: str, ms: int, partition: int) -> None:
        if self._deadlines.get(sid) == (ms, partition):
            return
        self._deadlines[sid] = (ms, partition)
        heapq.heappush(self._heap, (ms, sid))

    # -- the loop --------------------------------------------------------------------------------

    def next_deadline_ms(self) -> int | None:
        """The earliest live deadline, dropping entries that were replaced or cleared."""
        while self._heap:
            ms, sid = self._heap[0]
            live = self._deadlines.get(sid)
            if live is not None and live[0] == ms:
                return ms
            heapq.heappop(self._heap)
        return None

    async def run(self) -> None:
        """Forever: emit what is due, then sleep until the next deadline or an earlier arrival."""
        try:
            while True:
                await self._send_due()
                await self._sleep()
        finally:
            for sending in [*self._sending, *self._later]:
                sending.cancel()  # queued records are flushed when the app stops the producer
            if self._loading is not None:
                self._loading.cancel()

    async def _sleep(self) -> None:
        """Until the next deadline, or until woken by an earlier one or by compaction work."""
        nxt = self.next_deadline_ms()
        # At most `REARM_S` between reads of the wall clock the deadlines are instants of (the
        # sleep is monotonic): a clock stepped forward must not leave closings late by the step.
        timeout = (
            None if nxt is None else min(max(nxt - _epoch_ms(self._clock()), 0) / 1000, REARM_S)
        )
        self._wake.clear()
        if self._compact_ready() or (timeout is not None and timeout <= 0):
            return
        self._sleeping_until = nxt
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._sleeping_until = None
        self.stats.wakeups += 1

    async def tick(self) -> None:
        """Emit every closing and compaction due now and wait until they are acknowledged."""
        await self._send_due()
        await self.drain()

    async def _send_due(self) -> None:
        """Send every closing and compaction due now (one state read for all of them)."""
        now = self._clock()
        now_ms = _epoch_ms(now)
        due: list[tuple[str, int, int]] = []  # (sid, deadline ms, partition)
        while (nxt := self.next_deadline_ms()) is not None and nxt <= now_ms:
            _, sid = heapq.heappop(self._heap)
            due.append((sid, *self._deadlines.pop(sid)))
        compact: dict[str, int] = {}
        if self._compact_ready():  # (else they wait for the summaries being written)
            compact = dict(self._compact)
            self._compact.clear()
        if not due and not compact:
            return
        closings: list[tuple[Event, datetime, int]] = []
        unprepared: list[tuple[str, int, int]] = []
        for sid, ms, partition in due:
            prepared = self._prepared.pop(sid, None)
            if prepared is None:
                unprepared.append((sid, ms, partition))
            elif (prepared_ms := ceil_ms(prepared[0])) > now_ms:
                # Prepared for a later asking than the deadline that came due (a failed send put
                # an older deadline back): that asking is closed at its own time, not now.
                self._prepared[sid] = prepared
                self._schedule(sid, prepared_ms, partition)
            else:
                closings.append((*self._prepared_closing(sid, prepared, now), partition))
        to_read = list(dict.fromkeys([*(sid for sid, _, _ in unprepared), *compact]))
        try:
            states = await self._states(to_read) if to_read else {}
        except ProjectionError as e:
            # Redis is away: what needed a read waits for it; the prepared closings go out now.
            self._read_failed(e, unprepared, compact)
            states, unprepared, compact = {}, [], {}
        else:
            if to_read and self._read_retry_s:
                log.info("the states of due work can be read again")
                self._read_retry_s = 0.0
        for sid, _, _ in unprepared:
            folded = states.get(sid)
            if folded is not None:
                partition = self._partition(folded)
                closing = self._closing(folded.state, now, partition)
                if closing is not None:
                    closings.append((*closing, partition))
        candidates = [
            folded.state
            for sid in compact
            if (folded := states.get(sid)) is not None and not self._awaiting_fold(folded.state)
        ]
        # Marked before the send: a poll that runs while the acks are awaited must not prepare
        # these deadlines again (their sessions still show the question open until folded).
        if len(self._closed) > 100_000:  # only ever a guard against waste: forget freely
            self._closed.clear()
        recheck_ms = now_ms + round(_RECHECK_CLOSED_S * 1000)
        self._closed.update(
            (e.session_id, (ceil_ms(d), e.payload["asked_seq"], recheck_ms)) for e, d, _ in closings
        )
        # The closings go out first, and the next tick does not wait for their acks: a deadline
        # that comes due while they are awaited would otherwise be late by a broker round trip
        # (the producer keeps per-partition order across requests).
        if closings:
            self._start_emit(closings, (), {})
        if candidates:
            self._summarizing = asyncio.ensure_future(self._summarize(candidates, compact, now))
            self._track(self._summarizing)
        if len(self._sending) >= self.max_unacknowledged_ticks:
            await asyncio.wait(self._sending, return_when=asyncio.FIRST_COMPLETED)

    def _start_emit(
        self,
        closings: Sequence[tuple[Event, datetime, int]],
        compactions: Sequence[Event],
        compact_partitions: Mapping[str, int],
    ) -> None:
        """Send these without waiting for their acks (`drain` waits for them)."""
        self._track(asyncio.ensure_future(self._emit(closings, compactions, compact_partitions)))

    def _track(self, sending: asyncio.Future[None]) -> None:
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    def _compact_ready(self) -> bool:
        """Whether compaction work waits and no summaries are being written (one batch at a
        time: the next waits in `_compact` meanwhile)."""
        return bool(self._compact) and self._summarizing is None

    async def _summarize(
        self, sessions: Sequence[Session], partitions: Mapping[str, int], now: datetime
    ) -> None:
        """Write these sessions' summaries on a thread, then send them (not awaiting the acks).

        Off the loop and out of the tick: many sessions due at once, or a summarizer that takes
        its time (a model), must hold up neither the closings falling due meanwhile nor what
        else the loop runs (the worker's fold). A summarizer that raises puts the work back
        after the compactions' backoff; it never ends the loop.
        """
        try:
            compactions = await asyncio.to_thread(self._compactions, sessions, now)
        except Exception as e:  # a summarizer's failure is the summaries', not the scheduler's
            self._compact_retry_s = pause = _backoff(self._compact_retry_s)
            log.error(
                "could not write %d summar(ies), retrying in %.2fs: %r", len(sessions), pause, e
            )
            waiting = {s.id: partitions[s.id] for s in sessions}
            self._after(pause, lambda: self._put_back_compactions(waiting))
            return
        finally:
            self._summarizing = None
            if self._compact:
                self._wake.set()  # what came due meanwhile
        if len(self._compacted) > 100_000:
            self._compacted.clear()
        self._compacted.update((e.session_id, e.payload["through"]) for e in compactions)
        if compactions:
            self._start_emit((), compactions, partitions)

    def _put_back_compactions(self, partitions: Mapping[str, int]) -> None:
        for sid, partition in partitions.items():
            if not self.owned or partition in self.owned:  # (it may have moved meanwhile)
                self._compact.setdefault(sid, partition)

    def _compactions(self, sessions: Sequence[Session], now: datetime) -> list[Event]:
        """The `compacted` events due of these sessions (in a worker thread: pure)."""
        return [event for s in sessions if (event := self._compaction(s, now)) is not None]

    async def drain(self) -> None:
        """Wait until every tick sent so far was acknowledged (or failed and was rescheduled)."""
        while self._sending or self._later:
            await asyncio.wait(self._sending | self._later)

    @staticmethod
    def _partition(folded: Folded) -> int:
        return folded.mark.partition if folded.mark is not None else 0

    def _closing(
        self, session: Session, now: datetime, partition: int
    ) -> tuple[Event, datetime] | None:
        """The `answer_window_closed` to append and its deadline, or None if nothing is due."""
        question = session.question
        deadline = question.deadline() if question is not None else None
        if session.ended or question is None or deadline is None:
            return None  # answered (or re-asked without a deadline) since it was scheduled
        if not question.has_expired(now):
            # Due to the millisecond but not yet past it, or re-asked with a later deadline.
            self._schedule(session.id, ceil_ms(deadline), partition)
            return None
        return self._closing_event(session.id, question.id, question.seq, now), deadline

    def _prepared_closing(
        self, sid: str, prepared: tuple[datetime, str, int], now: datetime
    ) -> tuple[Event, datetime]:
        deadline, question_id, seq = prepared
        return self._closing_event(sid, question_id, seq, now), deadline

    def _closing_event(self, sid: str, question_id: str, seq: int, now: datetime) -> Event:
        event_id = self.ids.closing(sid, seq)
        return window_closed(sid, question_id, seq, now, self.producer, event_id=event_id)

    def _awaiting_fold(self, session: Session) -> bool:
        """Whether a compaction emitted for this session is not folded into this state yet."""
        through = self._compacted.get(session.id)
        return through is not None and session.compacted_through < through

    def _compaction(self, session: Session, now: datetime) -> Event | None:
        """The `compacted` event to append, or None when nothing is due."""
        plan = self.compactor.plan(session)
        if plan is None:
            return None
        event_id = self.ids.compaction(session.id, plan.through)
        return compacted(session.id, plan, now, self.producer, event_id=event_id)

    async def _emit(
        self,
        closings: Sequence[tuple[Event, datetime, int]],
        compactions: Sequence[Event],
        compact_partitions: Mapping[str, int],
    ) -> None:
        """Send one tick's events, wait for their acks; on failure, schedule them again.

        Closings and compactions are sent side by side, each failing on its own: a compaction
        the broker keeps refusing never delays (or re-sends) a closing.
        """
        closed, compacted = await asyncio.gather(
            self._send([event for event, _, _ in closings]), self._send(compactions)
        )
        if compacted is not None:
            self._compaction_failed(compactions, compact_partitions, compacted)
        elif compactions:  # (an empty half of a tick says nothing of the broker: no reset)
            self._compact_retry_s = 0.0
            self.stats.compactions += len(compactions)
        if closed is None:
            if closings:
                self._retry_s = 0.0
            acked_ms = time.time() * 1000
            self.stats.closings += len(closings)
            self.stats.lateness.observe_many(
                acked_ms - d.timestamp() * 1000 for _, d, _ in closings
            )
            return
        # Retried after a pause that doubles while failures go on (a failure that does not
        # pass would otherwise be retried as fast as the loop turns).
        self._retry_s = _backoff(self._retry_s)
        log.error(
            "could not append %d closing(s), retrying in %.2fs: %s",
            len(closings),
            self._retry_s,
            closed,
        )
        await asyncio.sleep(self._retry_s)
        for event, deadline, partition in closings:
            sid, ms = event.session_id, ceil_ms(deadline)
            sent = self._closed.get(sid)
            if sent is not None and sent[:2] == (ms, event.payload["asked_seq"]):
                del self._closed[sid]
            if sid not in self._deadlines:  # a deadline learned meanwhile is the newer one
                self._schedule(sid, ms, partition)
        self._wake.set()

    async def _send(self, events: Sequence[Event]) -> Exception | None:
        """Send and wait for the acks; what the producer raised, or None."""
        if not events:
            return None
        try:
            await self._events.publish_many(
                [(e.session_id.encode(), self.codec.encode(e), ()) for e in events]
            )
        except Exception as e:  # whatever the producer raised: nothing due may be dropped
            return e
        return None

    def _compaction_failed(
        self, compactions: Sequence[Event], partitions: Mapping[str, int], error: Exception
    ) -> None:
        """Put failed compactions back after a pause, without holding a tick's slot meanwhile."""
        self._compact_retry_s = pause = _backoff(self._compact_retry_s)
        log.error(
            "could not append %d compaction(s), retrying in %.2fs: %s",
            len(compactions),
            pause,
            error,
        )

        def again() -> None:
            for event in compactions:
                sid, partition = event.session_id, partitions[event.session_id]
                if self._compacted.get(sid) == event.payload["through"]:
                    del self._compacted[sid]  # (a newer one sent meanwhile stays marked)
                if not self.owned or partition in self.owned:  # (it may have moved meanwhile)
                    self._compact[sid] = partition

        self._after(pause, again)

    def _read_failed(
        self,
        error: ProjectionError,
        closings: Sequence[tuple[str, int, int]],
        compact: Mapping[str, int],
    ) -> None:
        """Put due work whose states could not be read back after a pause (logged once a streak)."""
        if not self._read_retry_s:
            log.error("could not read the states of due work, retrying until it can: %s", error)
        self._read_retry_s = pause = _backoff(self._read_retry_s)

        def again() -> None:
            for sid, ms, partition in closings:
                # A deadline learned meanwhile is the newer one; a partition may have moved away.
                if sid not in self._deadlines and (not self.owned or partition in self.owned):
                    self._schedule(sid, ms, partition)
            for sid, partition in compact.items():
                if not self.owned or partition in self.owned:
                    self._compact[sid] = partition

        self._after(pause, again)

    def _after(self, pause: float, put_back: Callable[[], None]) -> None:
        """Run `put_back` after `pause` seconds and wake the loop, without holding it meanwhile."""

        async def later() -> None:
            await asyncio.sleep(pause)
            put_back()
            self._wake.set()

        waiting = asyncio.ensure_future(later())
        self._later.add(waiting)
        waiting.add_done_callback(self._later.discard)


def _backoff(previous_s: float) -> float:
    """The pause after one more failure: 0.05 s, then twice the previous, at most 5 s."""
    return min(max(previous_s * 2, _RETRY_FIRST_S), _RETRY_MAX_S)


# (partitions, now) -> the ids of the ended sessions dropped (at most a batch per partition).
# (partition -> its settled offset, now) -> the sessions dropped.
Expire = Callable[[Mapping[int, int], datetime], Awaitable[list[str]]]


class RetentionSweep:
    """Drops the projections of ended sessions past their TTL, for the owned partitions.

    The deadlines are declared, not derived here: the commit script indexes each ended session
    at its last event's `occurred_at` (the writers' clock) plus the TTL, so every worker and a
    rebuild agree on them; this sweep only compares them with its own clock (`clock`, passed in:
    tests drive it with a clock of their own, no TTL is waited for). A projection kept a sweep
    interval longer than its TTL is harmless; one dropped early would not be, and a writer whose
    clock runs fast can only make its sessions last longer. Each drop re-checks its deadline in
    the script (lua/drop.lua), so a second worker's sweep after a rebalance drops nothing twice,
    and removes the session from its partition's waiting index and fleet counts in the same call.

    Each partition is swept with its settled offset (`settled`: the owned partitions whose one is
    known), before which everything of it is applied and what that made published: a session
    whose last event is at or past it is left for a later sweep. Dropped before its batch's
    decisions were acknowledged (a worker killed in between), its records would be read again
    onto a tombstone, and those decisions never published.
    """

    def __init__(
        self,
        expire: Expire,
        settled: Callable[[], Mapping[int, int]],
        *,
        every: float = 60.0,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self._expire = expire
        self._settled = settled
        self.every = every
        self._clock = clock
        self.expired = 0  # projections dropped so far

    async def sweep(self, now: datetime | None = None) -> list[str]:
        """Drop everything due at `now` (default: the clock's), batch after batch; the ids."""
        at = self._clock() if now is None else now
        dropped: list[str] = []
        while partitions := dict(sorted(self._settled().items())):
            batch = await self._expire(partitions, at)
            if not batch:
                break
            dropped += batch
            self.expired += len(batch)
            await asyncio.sleep(0)  # a long backlog never holds the loop from folding
        return dropped

    async def run(self) -> None:
        """Forever: sweep, then sleep `every` seconds (a Redis failure waits for the next)."""
        while True:
            try:
                dropped = await self.sweep()
                if dropped:
                    log.info("retention: %d ended session(s) expired", len(dropped))
            except ProjectionError as e:
                log.error("retention sweep failed, trying again in %.0fs: %s", self.every, e)
            await asyncio.sleep(self.every)


def sweep_interval(ttl_s: float) -> float:
    """Seconds between retention sweeps for a TTL: a tenth of it, between 1 s and a minute."""
    return min(60.0, max(1.0, ttl_s / 10))


def _epoch_ms(moment: datetime) -> int:
    # Floor: "now" is never rounded past a deadline it has not reached.
    return ceil_ms(moment) - (1 if moment.microsecond % 1000 else 0)
