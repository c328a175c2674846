"""In-memory adapters: an event log that projects synchronously, and a projection store.

For unit tests and quick local use. They implement the same ports, and the projection store passes
the same contract tests, as the Kafka log and the Redis store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from producers.ports import CommitResult
from producers.projector import Projector
from schemas.errors import NotYetVisibleError
from schemas.events import Event
from session_model.projection import BatchFolder, Folded, Position, Record, SessionUpdate
from session_model.session import Session, Turn
from session_model.signing import TrustedKeys
from session_model.timeline import TimelineEntry


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

    def read(self, from_offset: int = 0) -> list[Record]:
        """Records from `from_offset` on, for replays."""
        return self.records[from_offset:]


@dataclass
class InMemoryProjectionStore:
    """Projections in dicts, with the same compare-and-set rule as the Redis store."""

    _states: dict[str, Folded] = field(default_factory=dict)
    _history: dict[str, list[Turn]] = field(default_factory=dict)
    _timeline: dict[str, list[TimelineEntry]] = field(default_factory=dict)

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """Stored state and mark for the known ids."""
        return {sid: self._states[sid] for sid in session_ids if sid in self._states}

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply each update iff its base is the stored mark."""
        applied: list[str] = []
        conflicts: list[str] = []
        for u in updates:
            stored = self._states.get(u.session_id)
            if (stored.mark if stored else None) != u.base:
                conflicts.append(u.session_id)
                continue
            self._states[u.session_id] = Folded(u.state, u.mark)
            self._history.setdefault(u.session_id, []).extend(u.turns)
            self._timeline.setdefault(u.session_id, []).extend(u.timeline)
            applied.append(u.session_id)
        return CommitResult(tuple(applied), tuple(conflicts))

    def load(
        self, session_id: str, at_least: Position | None = None, timeout: float = 5.0
    ) -> Session | None:
        """The session; in memory a position is visible as soon as it was appended."""
        folded = self._states.get(session_id)
        if at_least is not None and (
            folded is None or folded.mark is None or folded.mark < at_least
        ):
            raise NotYetVisibleError(f"{session_id} has not applied {at_least}")
        return folded.state if folded else None

    def ids(self) -> list[str]:
        """Every projected session id."""
        return sorted(self._states)

    def history(self, session_id: str) -> list[Turn]:
        """Every turn, summarised ones included."""
        return list(self._history.get(session_id, []))

    def timeline(self, session_id: str, since: int = 0) -> list[TimelineEntry]:
        """Entries after `since`."""
        return [e for e in self._timeline.get(session_id, []) if e["seq"] > since]

    def clear(self) -> None:
        """Forget everything."""
        self._states.clear()
        self._history.clear()
        self._timeline.clear()


def in_memory_backend(
    keys: TrustedKeys | None = None,
) -> tuple[InMemoryEventLog, InMemoryProjectionStore]:
    """A log wired to a projection store that is updated synchronously on every append."""
    log = InMemoryEventLog()
    store = InMemoryProjectionStore()
    projector = Projector(store, BatchFolder(keys or TrustedKeys.none()))
    log.subscribers.append(projector.project)
    return log, store
