"""Batch delivery inside Faust: every fetched batch of a topic goes to one handler, in one call.

Why: Faust streams deliver record by record. Its fetch loop awaits each record's callback (wrapped
in `wait_first`, i.e. futures per record), builds an `Event`, queues it and iterates it through the
stream; measured here, a Faust agent that does nothing but ack peaks at ~11.7k records/s on one
core, below the projector's 15k target before any decoding or folding. The projector works on
whole batches anyway, so this consumer hands it what the fetch returned, as it came.

What stays Faust's: the app and its services, group membership and partition assignment (its
rebalance signals reach the projector as before), the fetcher thread, the producer, offset commits
on Faust's cadence (`broker_commit_interval` / `broker_commit_every`). What changes: for a topic
registered with `BatchApp.batch_topic`, offsets are committed from what the handler finished — an
offset becomes committable only after the handler returned for the batch that held it, which the
projector does only after Redis applied the batch. Topics not registered take Faust's own path.

This subclasses private parts of faust-streaming's consumer (`_drain_messages`, `_new_offset`,
`_filter_tps_with_pending_acks`): the version is pinned below 0.16 in pyproject.toml, and the
integration tests check commits, redelivery and rebalances against a real broker.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import faust
from aiokafka.consumer.group_coordinator import GroupCoordinator
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from processors.ports import Consumed

log = logging.getLogger(__name__)

# A handler works on a batch when awaited. It may return a second phase (e.g. the Redis commit)
# that the consumer runs after the previous batch's second phase, while it fetches and hands over
# the next batch: folding overlaps with committing, and batches still finish in order. The second
# phase may return a third (e.g. publishing what the commit decided): it runs after the previous
# batch's third phase, and the batch's offsets move once it is done, but the next batch's second
# phase does not wait for it (a commit does not wait for the previous batch's produce acks).
Published = Awaitable[None] | None
Completion = Awaitable[Published] | None
BatchHandler = Callable[[Sequence[Consumed]], Awaitable[Completion]]


def leave_group_supported() -> bool:
    """Whether the installed aiokafka has the coordinator's LeaveGroup call `leave_group` makes.

    It is private API (`GroupCoordinator._maybe_leave_group`): an upgrade may drop it, and the
    worker says so when it starts instead of finding out in a stalled revocation.
    """
    return inspect.iscoroutinefunction(getattr(GroupCoordinator, "_maybe_leave_group", None))


class BatchConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer thread, with the broker's wait for a fetch bounded by the app's setting.

    Faust fixes aiokafka's `fetch_max_wait_ms` at 1,500 ms. aiokafka sends no new fetch to a
    broker while one is in flight to it, so a fetch that names only partitions already read to
    their end is held by the broker that long while the other partitions' records wait: with two
    workers each sat idle half of the time (docs/PERFORMANCE.md, "Two workers").
    """

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Both are read when the consumer starts its fetcher.
        wait_ms: int | None = getattr(self.app, "fetch_max_wait_ms", None)
        if wait_ms is not None:
            consumer._fetch_max_wait_ms = wait_ms
        min_bytes: int | None = getattr(self.app, "fetch_min_bytes", None)
        if min_bytes is not None:
            consumer._fetch_min_bytes = min_bytes
        return consumer


class BatchConsumer(faust_aiokafka.Consumer):
    """Faust's aiokafka consumer; registered topics go to their handler a batch at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # tp -> the offset after the last record whose batch the handler finished.
        self._finished: dict[TP, int] = {}
        # The last batch handed over: done once all its phases are (and all before it: a
        # revocation waits for it alone); `_committing` once its second phase is, and `_before`
        # is the one handed over before it.
        self._in_flight: asyncio.Future[None] | None = None
        self._committing: asyncio.Future[None] | None = None
        self._before: asyncio.Future[None] | None = None
        # Partitions whose handler could not take a record (`park`): not read, not committed.
        self._parked: set[TP] = set()
        self._rebalances = 0  # revocations and assignments so far (`unpark` spans none)

    def _new_consumer_thread(self) -> BatchConsumerThread:
        return BatchConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - needs a broker
        handlers: dict[str, BatchHandler] = getattr(self.app, "batch_handlers", {})
        consumer_stopped = self._stopped.is_set
        fetcher_stopped = fetcher._stopped.is_set
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                records, _ = await self._wait_next_records(1.0)
                await asyncio.sleep(0)  # a fetch that returns at once must not starve the loop
                in_flight = self._in_flight
                if in_flight is not None and in_flight.done():
                    await self.settle()  # a batch that failed fails the loop now, records or not
                if not records or self.should_stop:
                    continue
                await self._deliver(records, handlers)
                if self._commit_every is not None and self._n_acked >= self._commit_every:
                    self._n_acked = 0
                    await self.commit()
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            await asyncio.shield(self.settle())  # the batch being committed finishes first
            if self.transport.app.should_stop:
                return
            raise

    async def _deliver(self, records: Any, handlers: dict[str, BatchHandler]) -> None:
        for tp, fetched in records.items():
            if tp.topic not in handlers:
                for record in fetched:  # Faust's own per-record route for any other topic
                    await self.callback(self._to_message(tp, record))
        # From here to the chaining below nothing awaits: a revocation that has let a partition go
        # finds its records dropped here, one that has not sees this batch in flight. (Records
        # that arrive while Faust's flow is stopped are not dropped: its seek to the committed
        # offsets may already have been made for them, and nothing would read them again.)
        batches: dict[str, list[Consumed]] = {}
        ends: dict[TP, int] = {}
        read_offset = self._read_offset
        assigned = self.assignment()
        for tp, fetched in records.items():
            if tp.topic not in handlers:
                continue
            if tp not in assigned or tp in self._parked:
                # Fetched before a rebalance took the partition away: its new owner reads it.
                # (Or parked: read again from the committed offset by its next owner.)
                continue
            # Faust's rule: after a seek the read offset is the next record to read.
            after = read_offset[tp]
            fresh = fetched if after is None else [r for r in fetched if r.offset >= after]
            if not fresh:
                continue
            batches.setdefault(tp.topic, []).extend(fresh)  # aiokafka's records, not copied
            ends[tp] = fresh[-1].offset
        for tp, last in ends.items():
            read_offset[tp] = last
        # In flight from before its fold starts: this batch is folded onto the previous one's
        # states, so whoever waits for the batch in flight (a revocation, before it lets the
        # partitions go and forgets those states) waits for both. Handed over the second phases
        # once folded, it runs them after the previous batch's, which finish first.
        previous, previous_commit, earlier = self._in_flight, self._committing, self._before
        loop = asyncio.get_running_loop()
        handed: asyncio.Future[list[Awaitable[Published]]] = loop.create_future()
        committed: asyncio.Future[None] = loop.create_future()
        n = sum(len(raws) for raws in batches.values())
        in_flight = asyncio.ensure_future(
            self._complete(previous, previous_commit, committed, handed, ends=ends, n=n)
        )
        # What they raise is raised here (the previous batch's), or by `settle`: not left unread.
        in_flight.add_done_callback(_retrieved)
        committed.add_done_callback(_retrieved)
        self._in_flight, self._committing, self._before = in_flight, committed, previous
        completions: list[Awaitable[Published]] = []
        try:
            for topic, raws in batches.items():
                completion = await _finish(handlers[topic](raws))
                if completion is not None:
                    completions.append(completion)
        except BaseException:
            handed.cancel()  # not folded whole, never written: its records are read again
            _close(completions)
            raise
        handed.set_result(completions)
        if previous_commit is not None:
            # One batch folded ahead of the one committing, no more; and no more than two
            # batches' third phases (publishing) behind the one committing.
            await asyncio.shield(previous_commit)
        if earlier is not None:
            await asyncio.shield(earlier)

    async def _complete(
        self,
        previous: asyncio.Future[None] | None,
        previous_commit: asyncio.Future[None] | None,
        committed: asyncio.Future[None],
        handed: asyncio.Future[list[Awaitable[Published]]],
        *,
        ends: dict[TP, int],
        n: int,
    ) -> None:
        try:
            published = await _second_phases(previous_commit, handed)
        except BaseException as e:
            _fail(committed, e)
            if previous is not None:  # done after the batch before it, failed or not
                await asyncio.wait([previous])
            raise
        committed.set_result(None)
        if previous is not None:
            # Shielded: this batch cancelled must not cancel the one before it. Raises what that
            # one raised; this one's third phases then never run and its offsets never move.
            try:
                await asyncio.shield(previous)
            except BaseException:
                _close(published or ())
                raise
        if published is None:
            return  # its fold failed or was cut short: nothing of it is written, no offset moves
        for i, phase in enumerate(published):
            try:
                await phase
            except BaseException:
                _close(published[i + 1 :])
                raise
        # A partition revoked meanwhile belongs to another worker now: it commits from there on.
        # A parked one keeps the offset finished before the record it was parked at.
        assigned = self.assignment()
        parked = self._parked
        for tp, last in ends.items():
            if tp in assigned and tp not in parked:
                self._finished[tp] = last + 1
        self._n_acked += n

    async def settle(self) -> None:
        """Wait until every batch in hand is committed and published (raises what the last one
        raised: a failure before it fails it too)."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        try:
            # Shielded: a cancelled waiter (the fetch loop stopping) leaves the batch to finish.
            await asyncio.shield(in_flight)
        finally:
            if self._in_flight is in_flight and in_flight.done():
                self._forget_finished()

    def _forget_finished(self) -> None:
        """The last batch and all before it are done: nothing is in flight."""
        self._in_flight = self._committing = self._before = None

    async def settle_within(self, timeout: float) -> bool:
        """Wait at most `timeout` s for every batch in hand to be committed and published: False if
        one is still going.

        It is left going, not cancelled: the batch after it was folded onto its states, and must
        never be written without it (see `ProjectionCycle.forget`). Raises what the batch raised
        when it ended in time.
        """
        in_flight = self._in_flight
        if in_flight is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(in_flight), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if self._in_flight is in_flight and in_flight.done():
                self._forget_finished()

    async def leave_group(self, timeout: float) -> bool:
        """Tell the group coordinator this member leaves (LeaveGroup), within `timeout` s.

        Whether the attempt finished in time (aiokafka logs a refusal, and sends nothing for a
        member with no generation). For a worker about to end in the middle of a rebalance:
        the coordinator would otherwise wait for it. aiokafka's client lives on Faust's consumer
        thread, whose loop runs on while the coordinator awaits the revocation's handlers: the
        request is made there.
        """
        thread = self._thread
        consumer = getattr(thread, "_consumer", None)
        coordinator = getattr(consumer, "_coordinator", None)
        if coordinator is None or not leave_group_supported():
            return False
        try:
            sent = asyncio.run_coroutine_threadsafe(
                coordinator._maybe_leave_group(), thread.thread_loop
            )
            await asyncio.wait_for(asyncio.wrap_future(sent), timeout)
        except Exception as e:  # ending anyway: the coordinator gives up on it in its own time
            log.warning("could not leave the consumer group: %r", e)
            return False
        return True

    def park(self, tps: set[TP]) -> None:
        """Stop reading these partitions and never commit past what their handler finished
        before, until the next rebalance or `unpark` (the batch handed over with the record it
        could not take is then partly finished: its other partitions are committed as usual)."""
        self._parked.update(tps)
        self.pause_partitions(tps)

    def rebalances(self) -> int:
        """Revocations and assignments so far: what `unpark` is given to span none."""
        return self._rebalances

    async def unpark(
        self,
        offsets: Mapping[TP, int],
        accept: Callable[[set[TP]], set[TP]],
        *,
        since: int,
    ) -> set[TP]:
        """Read these parked partitions again, each from its offset (the record it was parked
        at) or from before it, where every record before is applied (`settled`); `accept` is
        asked which of them may go, at the instant they do (nothing runs between), and those
        are returned. None goes when a rebalance came after `since` (`rebalances`): it reads
        every partition anew anyway, and the offsets may be another parking's.

        The batch in flight is finished first (the one that parked a partition would otherwise
        mark it past the record at its end; a later one holds none of its records): what it
        raises is raised here, and left for the fetch loop to raise too.
        """
        in_flight = self._in_flight
        if in_flight is not None and self._rebalances == since:
            await asyncio.shield(in_flight)
        if self._rebalances != since:
            return set()
        assigned = self.assignment()
        wanted: dict[TP, int] = {}
        for tp, offset in offsets.items():
            if tp in self._parked and tp in assigned:
                settled = self.settled(tp)
                wanted[tp] = offset if settled is None else min(settled, offset)
        if not wanted:
            return set()
        # On the consumer's thread, which drops what it had fetched from the old position.
        await self._thread.seek_wait(wanted)
        if self._rebalances != since:
            return set()
        assigned = self.assignment()
        ready = accept({tp for tp in wanted if tp in self._parked and tp in assigned})
        read_offset = self._read_offset
        for tp in ready:
            read_offset[tp] = wanted[tp] or None  # Faust's rule: the next record to read
        self._parked.difference_update(ready)
        self.resume_partitions(ready)
        return ready

    def _filter_tps_with_pending_acks(self, topics: Any = None) -> Iterator[TP]:
        seen = set()
        for tp in [*super()._filter_tps_with_pending_acks(topics), *self._finished]:
            if tp not in seen and (topics is None or tp in topics or tp.topic in topics):
                seen.add(tp)
                yield tp

    def settled(self, tp: TP) -> int | None:
        """The offset before which every record of `tp` is applied and what it made published:
        what this worker finished, or what the group had committed when it took the partition
        over (committed only once finished); None while neither is known."""
        known = [o for o in (self._finished.get(tp), self._committed_offset.get(tp)) if o]
        return max(known) if known else None

    def _new_offset(self, tp: TP) -> int | None:
        finished = self._finished.get(tp)
        if finished is not None:
            return finished
        result: int | None = super()._new_offset(tp)
        return result

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        """Forget what was finished on revoked partitions (their new owner commits from now).

        After the revocation's handlers ran: they wait for the batch being committed, which
        would mark its partitions again (the assignment is still the old one meanwhile), and a
        mark left for a revoked partition would be committed over its next owner's.
        """
        self._rebalances += 1
        await super().on_partitions_revoked(revoked)
        for tp in revoked:
            self._finished.pop(tp, None)
        self._parked.difference_update(revoked)  # (Faust's own pause of them ends likewise)

    async def on_partitions_assigned(self, assigned: set[TP], generation_id: int = 0) -> None:
        """A new assignment reads every partition anew: none stays parked (a batch fetched
        before the revocation may have parked one after it; its handler parks it again when
        the fold still cannot take it, before that batch is finished)."""
        self._rebalances += 1
        self._paused_partitions.difference_update(self._parked)
        self._parked.clear()
        await super().on_partitions_assigned(assigned, generation_id)


async def _second_phases(
    previous_commit: asyncio.Future[None] | None,
    handed: asyncio.Future[list[Awaitable[Published]]],
) -> list[Awaitable[None]] | None:
    """Run a batch's second phases once the previous batch's are done; its third phases (None
    if it was never handed over: its fold failed or was cut short)."""
    if previous_commit is not None:
        # Shielded: this batch cancelled must not cancel the one before it. Raises what that
        # one raised, and this one is then never written (it was folded onto its states).
        try:
            await asyncio.shield(previous_commit)
        except BaseException:
            if handed.done() and not handed.cancelled():
                _close(handed.result())
            else:
                handed.add_done_callback(_close_handed)
            raise
    try:
        completions = await handed
    except asyncio.CancelledError:
        if not handed.cancelled():
            raise
        return None
    published: list[Awaitable[None]] = []
    for i, completion in enumerate(completions):
        try:
            after = await completion
        except BaseException:
            _close([*completions[i + 1 :], *published])
            raise
        if after is not None:
            published.append(after)
    return published


def _fail(future: asyncio.Future[None], e: BaseException) -> None:
    if isinstance(e, asyncio.CancelledError):
        future.cancel()
    else:
        future.set_exception(e)


def _close(phases: Sequence[Awaitable[Any]]) -> None:
    """Close phases that will never run (coroutines not yet started)."""
    for phase in phases:
        if inspect.iscoroutine(phase):
            phase.close()


def _close_handed(handed: asyncio.Future[list[Awaitable[Published]]]) -> None:
    if not handed.cancelled():
        _close(handed.result())


def _retrieved(done: asyncio.Future[None]) -> None:
    """Mark what a finished batch raised as read (whoever waits for it gets it raised)."""
    if not done.cancelled():
        done.exception()


async def _finish(work: Awaitable[Completion]) -> Completion:
    """Run the handler to its end even if the fetch loop is cancelled meanwhile (app stopping).

    A fold cut in the middle would leave the session cache half updated; the fetch loop's
    cancellation waits for the fold instead, then goes on. The commit it returns is closed: the
    batch is never handed over, so never written, and its records are read again.
    """
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        completion = await task
        if completion is not None:
            _close([completion])
        raise


class BatchTransport(faust_aiokafka.Transport):
    """The aiokafka transport with the batch-delivering consumer."""

    Consumer = BatchConsumer


class BatchApp(faust.App):
    """A Faust app whose registered topics are consumed a fetched batch at a time."""

    def __init__(
        self,
        *args: Any,
        fetch_max_wait: float | None = None,
        fetch_min_bytes: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batch_handlers: dict[str, BatchHandler] = {}
        # How long the broker may hold a fetch with no data (None: Faust's 1,500 ms), and how
        # many bytes it waits for within that (None: aiokafka's 1).
        self.fetch_max_wait_ms = None if fetch_max_wait is None else int(fetch_max_wait * 1000)
        self.fetch_min_bytes = fetch_min_bytes

    def batch_topic(self, topic: Any, handler: BatchHandler) -> None:
        """Subscribe to `topic` and give every fetched batch of it to `handler`."""
        for name in topic.topics:
            self.batch_handlers[name] = handler
        self.topics.add(topic)

    async def settle(self) -> None:
        """Wait until every batch in hand is committed and published."""
        await cast(BatchConsumer, self.consumer).settle()

    async def settle_within(self, timeout: float) -> bool:
        """Wait at most `timeout` s for every batch in hand to be committed and published: False
        if one is still going."""
        return await cast(BatchConsumer, self.consumer).settle_within(timeout)

    def settled(self, tp: TP) -> int | None:
        """The offset before which everything of `tp` is applied and published (None: unknown)."""
        return cast(BatchConsumer, self.consumer).settled(tp)

    async def leave_group(self, timeout: float) -> bool:
        """Leave the consumer group (LeaveGroup) within `timeout` s; whether it was sent."""
        return await cast(BatchConsumer, self.consumer).leave_group(timeout)

    def park(self, tps: set[TP]) -> None:
        """Stop reading these partitions, committing nothing more of them, until a rebalance or
        `unpark`."""
        cast(BatchConsumer, self.consumer).park(tps)

    def rebalances(self) -> int:
        """Revocations and assignments so far (`BatchConsumer.rebalances`)."""
        return cast(BatchConsumer, self.consumer).rebalances()

    async def unpark(
        self, offsets: Mapping[TP, int], accept: Callable[[set[TP]], set[TP]], *, since: int
    ) -> set[TP]:
        """Read these parked partitions again from these offsets (`BatchConsumer.unpark`)."""
        return await cast(BatchConsumer, self.consumer).unpark(offsets, accept, since=since)

    def _new_transport(self) -> Any:
        return BatchTransport(self.conf.broker_consumer, self)
