"""The in-memory event log, and a backend that projects every append synchronously.

For unit tests and quick local use. The log implements the same port as the Kafka log; its
projection store (`projections.memory`) passes the same contract tests as the Redis store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from projections.memory import InMemoryProjectionStore
from projections.projector import Projector
from schemas.events import Event
from session_model.projection import BatchFolder, Position, Record
from session_model.signing import TrustedKeys


@dataclass
class InMemoryEventLog:
    """An append-only list of events (one partition); subscribers see each append in order."""

    records: list[Record] = field(default_factory=list)
    subscribers: list[Callable[[Sequence[Record]], object]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def append(self, event: Event) -> Position:
        """Append one event."""
        return self.append_many([event])[0]

    def append_many(self, events: Sequence[Event]) -> list[Position]:
        """Append events in order and hand them to every subscriber."""
        with self._lock:
            start = len(self.records)
            batch = [Record(e, Position(0, start + i)) for i, e in enumerate(events)]
            self.records.extend(batch)
            for subscriber in self.subscribers:
                subscriber(batch)
        return [r.position for r in batch]

    def close(self, timeout: float = 10.0) -> None:
        """Nothing to release."""

    def read(self, from_offset: int = 0) -> list[Record]:
        """Records from `from_offset` on, for replays."""
        return self.records[from_offset:]


def in_memory_backend(
    keys: TrustedKeys | None = None,
) -> tuple[InMemoryEventLog, InMemoryProjectionStore]:
    """A log wired to a projection store that is updated synchronously on every append."""
    log = InMemoryEventLog()
    store = InMemoryProjectionStore()
    projector = Projector(store, BatchFolder(keys or TrustedKeys.none()))
    log.subscribers.append(projector.project)
    return log, store
