"""The bounded window of event ids the fold recognises duplicates by.

Why a window and not every id: keeping every id made each event cost more than the one before
(the set was copied per event) and made a long session's stored state grow without end. Kafka's
idempotent producer already drops its own retries at the broker; what reaches the log twice is an
application retrying an append whose outcome it did not learn (a time-out, a crash before the
acknowledgement), and such a retry follows its original closely. So the fold remembers the ids of
its session's last events, in chunks of `CHUNK` by seq: the current chunk (1 to `CHUNK` ids) and
the `KEPT` full chunks before it. The guarantee, exact and independent of batching: **an event
whose id equals the id of one of the last `KEPT * CHUNK` (= 256) events of its session is a
duplicate** (and so is one within the current chunk). A copy that arrives later than that takes
a seq like any new event. 256 is ample for what retries: an agent's append that fails raises only
once kafka-python gave up on the record (after its delivery time-out, two minutes by default:
`producers.kafka_log`), so it retries after that, and while it waits only the other writers of
its session (an operator, the scheduler) add events.
A deterministic id re-sent much later (a transfer run again a day after) is not recognised; its
effect is idempotent anyway. Not so for a signed act re-sent after a revocation or a stricter
mode: the fold keeps those events' ids for good apart from this window (`Session.signed_ids`).
Everything here is a pure function of the stream: the event of seq
`n` lives in chunk `(n - 1) // CHUNK`, so a rebuild, a reload and the live worker hold the same
window.

Adding an id copies the current chunk only (at most `CHUNK` entries); older chunks are shared
between states, so the cost per event does not grow with the session.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from schemas.frozen import fast_init

CHUNK: Final = 64
KEPT: Final = 4  # full chunks kept behind the current one
HORIZON: Final = CHUNK * KEPT  # a retry within this many events of its original is recognised


@fast_init
@dataclass(frozen=True, slots=True)
class RecentIds:
    """The ids of a session's last events: the current chunk and up to `KEPT` full ones."""

    current: frozenset[str] = frozenset()
    older: tuple[frozenset[str], ...] = ()

    def __contains__(self, event_id: object) -> bool:
        return event_id in self.current or self.in_older(event_id)

    def in_older(self, event_id: object) -> bool:
        """Whether the id is in one of the full chunks behind the current one."""
        for chunk in self.older:  # noqa: SIM110 - a loop, not a generator, per event
            if event_id in chunk:
                return True
        return False

    def __len__(self) -> int:
        return len(self.current) + sum(len(chunk) for chunk in self.older)

    def __iter__(self) -> Iterator[str]:
        for chunk in self.older:
            yield from chunk
        yield from self.current

    def add(self, event_id: str) -> RecentIds:
        """The window after one more event (the `len`-th id of its session so far plus one)."""
        current = self.current
        if len(current) < CHUNK:
            return RecentIds(current | {event_id}, self.older)
        older = self.older if len(self.older) < KEPT else self.older[1:]
        return RecentIds(frozenset((event_id,)), (*older, current))

    @classmethod
    def of(cls, chunks: Iterable[Iterable[str]]) -> RecentIds:
        """The window from its chunks in order, the last one current (as stored)."""
        sets = [frozenset(c) for c in chunks]
        if not sets:
            return EMPTY
        return cls(sets[-1], tuple(sets[-KEPT - 1 : -1]))

    @classmethod
    def from_ids(cls, ids: Iterable[str]) -> RecentIds:
        """The window after these ids, the first being its session's first event's."""
        window = EMPTY
        for event_id in ids:
            window = window.add(event_id)
        return window

    def chunks(self) -> tuple[frozenset[str], ...]:
        """The chunks in order, the current one last (empty when no event was folded)."""
        return (*self.older, self.current) if self.current else self.older


EMPTY: Final = RecentIds()


def chunk_of(seq: int) -> int:
    """The chunk the event of this seq belongs to (0-based)."""
    return (seq - 1) // CHUNK
