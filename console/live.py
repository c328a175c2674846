"""The live feed: question changes fanned out to browsers as Server-Sent Events.

A lifespan task drains the questions feed (`QuestionSource`, e.g. a Kafka consumer of the questions
topic) into a `Hub`, which drops what a subscriber already saw (the feed is at least once: per
session it keeps the last `QuestionChange.order()`) and hands each change to every subscriber's
bounded queue. A subscriber too slow to keep up loses what was queued and is told to `resync`
(reload what it shows) instead of blocking the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from console.views import change_record
from session_model.questions import QuestionChange

log = logging.getLogger(__name__)

QuestionSource = Callable[[], AsyncIterator[QuestionChange]]
KEEPALIVE_SECONDS: Final = 15.0
SIGN_OUT_RECHECK_SECONDS: Final = 1.0  # a live stream asks whether its session was signed out
QUEUE_SIZE: Final = 256
SEEN_SESSIONS: Final = 100_000  # sessions whose last change the hub remembers (oldest dropped)


@dataclass(frozen=True, slots=True)
class _Signal:
    name: str


RESYNC: Final = _Signal("resync")  # what was queued was dropped: reload
CLOSED: Final = _Signal("closed")  # the hub is shutting down: end the stream

Item = QuestionChange | _Signal


class TooManyStreamsError(Exception):
    """The caller already holds as many live streams as it may."""


class Subscription:
    """One subscriber's bounded queue of changes and signals."""

    def __init__(self, size: int, owner: str | None = None) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue(maxsize=max(size, 2))
        self.dropped = 0  # changes lost because this subscriber fell behind
        self.owner = owner  # who holds it (counted against `Hub.subscribe`'s limit)

    def offer(self, item: Item) -> None:
        """Queue an item; when full, drop everything queued and queue a resync instead."""
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            while not self.queue.empty():
                self.queue.get_nowait()
                self.dropped += 1
            self.queue.put_nowait(RESYNC)
            if item is CLOSED:
                self.queue.put_nowait(CLOSED)
            elif not isinstance(item, _Signal):
                self.dropped += 1

    async def get(self) -> Item:
        """The next item (waits)."""
        return await self.queue.get()


class Hub:
    """Fans question changes out to subscribers (used from the event loop only)."""

    def __init__(self, queue_size: int = QUEUE_SIZE, seen_sessions: int = SEEN_SESSIONS) -> None:
        self.queue_size = queue_size
        self.seen_sessions = seen_sessions
        self._subscribers: set[Subscription] = set()
        self._held: Counter[str] = Counter()  # streams attached, per owner
        self._seen: dict[str, tuple[int, int]] = {}
        self.closed = False

    @property
    def subscribers(self) -> int:
        """How many subscribers are attached."""
        return len(self._subscribers)

    def held(self, owner: str) -> int:
        """How many subscribers `owner` has attached."""
        return self._held[owner]

    def subscribe(self, owner: str | None = None, limit: int = 0) -> Subscription:
        """Attach a new subscriber (a closed hub hands out one that ends at once);
        `TooManyStreamsError` when `owner` already holds `limit` of them (0: no limit)."""
        if owner is not None and limit > 0 and self._held[owner] >= limit:
            raise TooManyStreamsError(f"{owner} holds {self._held[owner]} live streams already")
        sub = Subscription(self.queue_size, owner)
        if self.closed:
            sub.offer(CLOSED)
        else:
            self._subscribers.add(sub)
            if owner is not None:
                self._held[owner] += 1
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Detach a subscriber (again: nothing)."""
        if sub not in self._subscribers:
            return
        self._subscribers.discard(sub)
        if sub.owner is not None:
            self._held[sub.owner] -= 1
            if not self._held[sub.owner]:
                del self._held[sub.owner]

    def publish(self, change: QuestionChange) -> bool:
        """Hand a change to every subscriber; False when it was seen already (a redelivery)."""
        order = change.order()
        last = self._seen.get(change.session_id)
        if last is not None and order <= last:
            return False
        self._seen.pop(change.session_id, None)  # re-inserted last: the oldest go first
        self._seen[change.session_id] = order
        if len(self._seen) > self.seen_sessions:
            del self._seen[next(iter(self._seen))]
        for sub in tuple(self._subscribers):
            sub.offer(change)
        return True

    def resync(self) -> None:
        """Tell every subscriber to reload (changes may have been missed)."""
        for sub in tuple(self._subscribers):
            sub.offer(RESYNC)

    def close(self) -> None:
        """End every subscriber's stream."""
        self.closed = True
        for sub in tuple(self._subscribers):
            sub.offer(CLOSED)
        self._subscribers.clear()
        self._held.clear()


def sse(event: str, data: str) -> str:
    """One Server-Sent Event (`data` must be one line: JSON is)."""
    return f"event: {event}\ndata: {data}\n\n"


async def _always() -> bool:
    return True


def idle_wait(now: float, sent: float, keepalive: float, confirmed: float, recheck: float) -> float:
    """How long an idle stream waits for an item: until its next keepalive is due (`keepalive`
    seconds after it last `sent` anything), or its next sign-out check (`recheck` seconds after it
    was last `confirmed` signed in; a `recheck` of 0 asks before each item, and idle at keepalives
    only), whichever comes first."""
    due = sent + keepalive
    if recheck > 0:
        due = min(due, confirmed + recheck)
    return max(0.0, due - now)


async def event_stream(
    hub: Hub,
    is_disconnected: Callable[[], Awaitable[bool]],
    keepalive: float = KEEPALIVE_SECONDS,
    still_signed_in: Callable[[], Awaitable[bool]] = _always,
    recheck: float = SIGN_OUT_RECHECK_SECONDS,
    *,
    sub: Subscription | None = None,
) -> AsyncIterator[str]:
    """The SSE text of one subscriber (`sub`, attached to `hub` beforehand, or a new one):
    `ready`, then `question` and `resync` events, keepalives.

    It ends when the client goes, the hub closes, or the caller signs out (`still_signed_in`,
    asked before anything is sent once `recheck` seconds passed since it last said yes, and by
    an idle stream every `recheck` seconds: a stream authenticated once must not outlive its
    session by more than that, and a busy fleet's changes do not cost a sign-out read each, per
    subscriber). An idle stream sends a keepalive after `keepalive` seconds without sending
    anything, however often it wakes to ask.
    """
    loop = asyncio.get_running_loop()
    confirmed = loop.time()  # the stream was authenticated as it started

    async def signed_in() -> bool:
        nonlocal confirmed
        if loop.time() - confirmed < recheck:
            return True
        if not await still_signed_in():
            return False
        confirmed = loop.time()
        return True

    sub = hub.subscribe() if sub is None else sub
    try:
        yield "retry: 3000\n" + sse("ready", "{}")
        sent = loop.time()
        while True:
            wait = idle_wait(loop.time(), sent, keepalive, confirmed, recheck)
            try:
                item = await asyncio.wait_for(sub.get(), timeout=wait)
            except TimeoutError:
                if await is_disconnected() or not await signed_in():
                    return
                if loop.time() - sent >= keepalive:
                    yield ": keepalive\n\n"
                    sent = loop.time()
                continue
            if item is CLOSED or not await signed_in():
                return
            if isinstance(item, _Signal):
                yield sse(item.name, "{}")
            else:
                yield sse("question", json.dumps(change_record(item), separators=(",", ":")))
            sent = loop.time()
    finally:
        hub.unsubscribe(sub)


async def drain(
    source: QuestionSource,
    hub: Hub,
    *,
    first_backoff: float = 1.0,
    max_backoff: float = 30.0,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Publish every change of the source; on an error log it, back off, resync and restart."""
    backoff = first_backoff
    while True:
        try:
            async for change in source():
                hub.publish(change)
                backoff = first_backoff
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("the questions feed failed; restarting it in %.1f s", backoff)
            await sleep(backoff)
            backoff = min(backoff * 2, max_backoff)
            hub.resync()  # changes may have been missed while the feed was down
            continue
        log.info("the questions feed ended")
        return


@contextlib.asynccontextmanager
async def feeding(source: QuestionSource | None, hub: Hub) -> AsyncIterator[None]:
    """Drain `source` into `hub` while the app runs; close the hub's streams on the way out."""
    task = asyncio.create_task(drain(source, hub), name="questions-feed") if source else None
    try:
        yield
    finally:
        hub.close()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
