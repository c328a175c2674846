"""What the worker tells its timer process: the deadlines of its partitions, as it learns them.

The projector calls `observe` with every committed batch: a question with a deadline is offered
as a `Closing` (once; again only if it changed), and a session whose question went away
(answered, closed, replaced without a deadline, ended) is cleared. `assign` tells the timer which
partitions are the worker's now and then offers the deadlines already in those partitions'
index, reading their sessions in chunks, earliest first, in a task of its own (the rebalance does
not wait for it). What a batch observed meanwhile is newer than what that task read, so it wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Protocol

from processors.scheduler import DueIndex, States
from processors.timer import Assign, Clear, Closing, Message, Offer
from session_model.projection import SessionUpdate
from session_model.session import Session

log = logging.getLogger(__name__)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


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
        if cleared:
            self.timer.send(Clear(tuple(cleared)))
        if offers:
            self.timer.send(Offer(tuple(offers)))

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
        if self.offered:
            self.timer.send(Offer(tuple(self.offered.values())))

    async def stop(self) -> None:
        """Cancel the index load in progress, if any."""
        if self._loading is not None:
            self._loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loading

    async def _load(self, partitions: frozenset[int]) -> None:
        try:
            deadlines, _ = await self._due_index(partitions)
            order = sorted(deadlines, key=lambda sid: deadlines[sid][0])
            for at in range(0, len(order), self.chunk):
                chunk = [s for s in order[at : at + self.chunk] if s not in self.offered]
                if not chunk:
                    continue
                states = await self._states(chunk)
                observed = self._observed or set()
                offers = []
                for sid in chunk:
                    folded = states.get(sid)
                    if folded is None or sid in observed or sid in self.offered:
                        continue  # unknown, or a batch told about it after this read began
                    partition = folded.mark.partition if folded.mark is not None else 0
                    closing = closing_of(folded.state, partition)
                    if closing is not None and partition in partitions:
                        self.offered[sid] = closing
                        offers.append(closing)
                if offers:
                    self.timer.send(Offer(tuple(offers)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the projector's batches still offer what they fold
            log.error("could not load the deadlines of partitions %s: %s", sorted(partitions), e)
        finally:
            self._observed = None
