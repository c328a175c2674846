"""What the worker tells its timer process: the deadlines of its partitions, as it learns them.

The projector calls `observe` with every committed batch: a question with a deadline is offered
as a `Closing` (once; again only if it changed), and a session whose question went away
(answered, closed, replaced without a deadline, ended) is cleared. `assign` tells the timer which
partitions are the worker's now and then reads those partitions' index, and their sessions in
chunks, earliest first, in a task of its own (the rebalance does not wait for it): what it reads
replaces what was offered for them before (a worker that missed a rebalance offered what may
have changed since), and a failed read is tried again until it succeeds or another assignment
starts. What a batch observed meanwhile is newer than what that task read, so it wins. Offers
and clears go in frames well under the timer's `MAX_FRAME`, however many there are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Protocol, TypeVar

from processors import timer as wire  # its MAX_FRAME read at each send (tests shrink it)
from processors.scheduler import DueIndex, States
from processors.timer import Assign, Clear, Closing, Message, Offer
from schemas.errors import CorruptProjectionError
from session_model.projection import Folded, SessionUpdate
from session_model.session import Session

log = logging.getLogger(__name__)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_RETRY_FIRST_S = 0.1  # a failed read of the load is tried again after this, doubling
_RETRY_MAX_S = 5.0
# A frame's worst case, in bytes: a closing's brackets, quotes, commas and three 64-bit integers,
# a cleared id's quotes and comma, and six per character of an id (a JSON `\uXXXX` escape).
_CLOSING_BYTES = 72
_CLEARED_BYTES = 3
_CHAR_BYTES = 6

T = TypeVar("T")


class TimerPort(Protocol):
    """Where the feed's messages go (the timer process's pipe)."""

    def send(self, message: Message) -> None:
        """Hand over one message without blocking."""
        ...


def closing_of(session: Session, partition: int) -> Closing | None:
    """The closing this session's open question needs, or None (no deadline, or ended)."""
    question = session.question
    if session.ended or question is None:
        return None
    deadline = question.deadline()
    if deadline is None:
        return None
    deadline_us = (deadline - _EPOCH) // _US
    return Closing(session.id, partition, deadline_us, question.id, question.seq)


def closing_bytes(closing: Closing) -> int:
    """The most bytes this closing takes in an `Offer` frame."""
    return _CLOSING_BYTES + _CHAR_BYTES * (len(closing.session_id) + len(closing.question_id))


def cleared_bytes(session_id: str) -> int:
    """The most bytes this session id takes in a `Clear` frame."""
    return _CLEARED_BYTES + _CHAR_BYTES * len(session_id)


def runs(items: Sequence[T], size: Callable[[T], int], limit: int) -> Iterator[Sequence[T]]:
    """The items in order, in runs whose sizes add up to at most `limit` (or of one item)."""
    start = used = 0
    for i, item in enumerate(items):
        n = size(item)
        if used + n > limit and i > start:
            yield items[start:i]
            start, used = i, 0
        used += n
    if start < len(items):
        yield items[start:]


class TimerFeed:
    """Keeps the timer process's timetable in step with the projector, for owned partitions."""

    def __init__(
        self, timer: TimerPort, states: States, due_index: DueIndex, *, chunk: int = 64
    ) -> None:
        self.timer = timer
        self._states = states
        self._due_index = due_index
        self.chunk = chunk
        self.owned: set[int] = set()
        self.offered: dict[str, Closing] = {}
        self.unreadable = 0  # sessions a load skipped: their state could not be decoded
        self._observed: set[str] | None = None  # sessions a batch told about since `assign`
        self._loading: asyncio.Task[None] | None = None

    def observe(self, updates: Sequence[SessionUpdate]) -> None:
        """Offer the new or changed deadlines of a committed batch, clear the ones gone."""
        offers: list[Closing] = []
        cleared: list[str] = []
        owned, offered, observed = self.owned, self.offered, self._observed
        for u in updates:
            partition = u.mark.partition
            if owned and partition not in owned:
                continue
            sid = u.session_id
            if observed is not None:
                observed.add(sid)
            closing = closing_of(u.state, partition)
            if closing is None:
                if offered.pop(sid, None) is not None:
                    cleared.append(sid)
            elif offered.get(sid) != closing:
                offered[sid] = closing
                offers.append(closing)
        self._send(offers, cleared)

    async def assign(self, partitions: Iterable[int]) -> None:
        """Close for exactly these partitions; offer their indexed deadlines in the background."""
        self.owned = set(partitions)
        self.offered = {s: c for s, c in self.offered.items() if c.partition in self.owned}
        self.timer.send(Assign(frozenset(self.owned)))
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading
        self._observed = set()
        self._loading = asyncio.get_running_loop().create_task(self._load(frozenset(self.owned)))

    async def loaded(self) -> None:
        """Wait until the deadlines of the last assignment's index were offered."""
        if self._loading is not None:
            await asyncio.shield(self._loading)

    def replay(self) -> None:
        """Send everything known again (to a timer process started anew)."""
        self.timer.send(Assign(frozenset(self.owned)))
        self._send(list(self.offered.values()), [])

    async def stop(self) -> None:
        """Cancel the index load in progress, if any."""
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading

    def _send(self, offers: Sequence[Closing], cleared: Sequence[str]) -> None:
        # A frame over MAX_FRAME would end the timer process, and its restart's replay again.
        limit = wire.MAX_FRAME // 4
        for ids in runs(cleared, cleared_bytes, limit):
            self.timer.send(Clear(tuple(ids)))
        for closings in runs(offers, closing_bytes, limit):
            self.timer.send(Offer(tuple(closings)))

    async def _load(self, partitions: frozenset[int]) -> None:
        try:
            read = functools.partial(self._due_index, partitions)
            deadlines, _ = await self._retrying("reading the deadline index", partitions, read)
            observed = self._observed or set()
            gone = [
                s
                for s, c in self.offered.items()
                if c.partition in partitions and s not in deadlines and s not in observed
            ]
            for sid in gone:
                del self.offered[sid]
            self._send([], gone)
            order = sorted(deadlines, key=lambda sid: deadlines[sid][0])
            for at in range(0, len(order), self.chunk):
                chunk = order[at : at + self.chunk]
                read_chunk = functools.partial(self._read, chunk, partitions)
                states = await self._retrying("reading sessions", partitions, read_chunk)
                self._settle(chunk, states, partitions)
        finally:
            self._observed = None

    def _settle(
        self, chunk: Sequence[str], states: dict[str, Folded | None], partitions: frozenset[int]
    ) -> None:
        """Offer or clear what this chunk's states say, where no batch told about them since."""
        offers: list[Closing] = []
        cleared: list[str] = []
        observed = self._observed or set()
        for sid in chunk:
            if sid in observed or sid not in states:
                continue  # a batch told about it after this read began, or it cannot be read
            folded = states[sid]
            closing = None
            if folded is not None:
                partition = folded.mark.partition if folded.mark is not None else 0
                closing = closing_of(folded.state, partition)
            if closing is None:
                if self.offered.pop(sid, None) is not None:
                    cleared.append(sid)
            elif closing.partition in partitions and self.offered.get(sid) != closing:
                self.offered[sid] = closing
                offers.append(closing)
        self._send(offers, cleared)

    async def _read(
        self, chunk: Sequence[str], partitions: frozenset[int]
    ) -> dict[str, Folded | None]:
        """The chunk's states (None: unknown); one that cannot be decoded is left out, counted.

        Redis away (or slow) fails the read of the chunk, which the caller tries again; one
        session that cannot be decoded fails it too, and then the chunk is read one by one, each
        read tried again on the same terms until only what cannot be decoded is left out.
        """
        try:
            got = await self._states(chunk)
        except CorruptProjectionError:
            pass
        else:
            return {sid: got.get(sid) for sid in chunk}
        states: dict[str, Folded | None] = {}
        for sid in chunk:
            read_one = functools.partial(self._read_one, sid)
            readable, folded = await self._retrying(f"reading {sid}", partitions, read_one)
            if readable:
                states[sid] = folded
        return states

    async def _read_one(self, sid: str) -> tuple[bool, Folded | None]:
        """Whether the session's state can be decoded, and the state (None: unknown)."""
        try:
            return True, (await self._states([sid])).get(sid)
        except CorruptProjectionError as e:
            self.unreadable += 1
            log.error("could not read %s, its deadline is not offered: %s", sid, e)
            return False, None

    async def _retrying(
        self, what: str, partitions: frozenset[int], call: Callable[[], Awaitable[T]]
    ) -> T:
        """`call`'s result, asked again after growing pauses until it comes (or a new `assign`)."""
        pause = _RETRY_FIRST_S
        while True:
            try:
                return await call()
            except Exception as e:  # a session waiting on a human has no batch to offer it
                log.error(
                    "%s for the deadlines of partitions %s failed, trying again in %.1fs: %s",
                    what,
                    sorted(partitions),
                    pause,
                    e,
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RETRY_MAX_S)
