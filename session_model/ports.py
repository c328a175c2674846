"""The ports the core is written against: an event log, a projection store, the waiting index."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas.events import Event
from session_model.projection import Expired, Folded, Position, SessionUpdate
from session_model.questions import Cursor, WaitingPage
from session_model.session import History, Session, Turn
from session_model.timeline import TimelineEntry


class EventLog(Protocol):
    """Where events are appended; the source of truth."""

    def append(self, event: Event) -> Position:
        """Append one event and return its position once the log acknowledged it."""
        ...

    def append_many(self, events: Sequence[Event]) -> list[Position]:
        """Append several events (in order per session) and return their positions."""
        ...

    def close(self, timeout: float = 10.0) -> None:
        """Send what is buffered (waiting at most `timeout` s) and release the connections."""
        ...


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What a projection store did with a batch of updates: each session is in one of the three.

    `expired`: the session's projection was dropped by retention (a tombstone exists) and nothing
    was written; its events stay in the log until `replay --session` restores it. Not applied:
    nothing of the update may be published as if it were.
    """

    applied: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = field(default=())
    expired: tuple[str, ...] = field(default=())


class ProjectionStore(Protocol):
    """Materialised session state: written by a projector, read by everyone else."""

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """The stored state and mark of each known session among `session_ids` (one round trip)."""
        ...

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply each update atomically with its mark iff the stored mark equals its base."""
        ...

    def load(
        self, session_id: str, at_least: Position | None = None, timeout: float = 5.0
    ) -> Session | None:
        """The session, waiting (bounded) until the projection has applied `at_least`."""
        ...

    def ids(self) -> list[str]:
        """Every session id with a projection, sorted."""
        ...

    def expired(self, session_id: str) -> Expired | None:
        """The session's tombstone if its projection expired by retention, else None: its id is
        taken, its events are in the log."""
        ...

    def facts(self, session_id: str, kinds: Iterable[str] | None = None) -> History:
        """Every call, observation, execution, decision and rejection (the complete history);
        only the lists of `kinds` (of `HISTORY_KINDS`) if given, the others left empty."""
        ...

    def history(self, session_id: str) -> list[Turn]:
        """Every turn of the session, summarised ones included."""
        ...

    def timeline(
        self, session_id: str, since: int = 0, latest: int | None = None
    ) -> list[TimelineEntry]:
        """Timeline entries with `seq > since`, in order; only the last `latest` of them if given
        (read without reading the rest: a page of an old session costs what a young one's does)."""
        ...

    def clear(self) -> None:
        """Drop every projection (before a rebuild)."""
        ...

    def close(self) -> None:
        """Release the connections; the store is not used after."""
        ...


class WaitingIndex(Protocol):
    """What the fleet waits for, kept by the projection store's commit (never a scan of states)."""

    def waiting(
        self, reason: str | None = None, after: Cursor | None = None, limit: int = 50
    ) -> WaitingPage:
        """Waiting questions, soonest deadline first (those without one last), from `after` on."""
        ...

    def waiting_by_reason(self) -> dict[str, int]:
        """How many questions wait, per reason code (reasons with none are left out)."""
        ...

    def fleet(self) -> dict[tuple[str, str], int]:
        """Sessions per (status, mode): `SessionStatus` and `Mode` values."""
        ...
