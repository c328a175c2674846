"""The in-memory projection store: same ports, same compare-and-set rule, same contract tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.errors import NotYetVisibleError
from session_model.ports import CommitResult
from session_model.projection import Folded, Position, SessionUpdate
from session_model.session import Session, Turn
from session_model.timeline import TimelineEntry


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
