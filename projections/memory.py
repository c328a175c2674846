"""The in-memory projection store: same ports, same compare-and-set rule, same contract tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from projections.indexes import ceil_ms
from projections.requests import EXPIRE_BATCH, Retention, floor_ms
from schemas.errors import NotYetVisibleError
from session_model.ports import CommitResult
from session_model.projection import Expired, Folded, Position, SessionUpdate
from session_model.questions import (
    Cursor,
    WaitingPage,
    WaitingQuestion,
    score_of,
    session_status,
    waiting_question,
)
from session_model.session import History, Session, Turn, history_kinds
from session_model.timeline import TimelineEntry, last

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class InMemoryProjectionStore:
    """Projections in dicts, with the same compare-and-set rule as the Redis store."""

    _states: dict[str, Folded] = field(default_factory=dict)
    _history: dict[str, list[Turn]] = field(default_factory=dict)
    _timeline: dict[str, list[TimelineEntry]] = field(default_factory=dict)
    _waiting: dict[str, WaitingQuestion] = field(default_factory=dict)
    _facts: dict[str, History] = field(default_factory=dict)
    retention: Retention | None = None  # ended sessions' TTL (None: kept for ever)
    _retain: dict[str, int] = field(default_factory=dict)  # sid -> ms it may be dropped
    _expired: dict[str, Expired] = field(default_factory=dict)  # tombstones

    def folded(self, session_ids: Sequence[str]) -> dict[str, Folded]:
        """Stored state and mark for the known ids."""
        return {sid: self._states[sid] for sid in session_ids if sid in self._states}

    def commit(self, updates: Sequence[SessionUpdate]) -> CommitResult:
        """Apply each update iff its base is the stored mark; an expired session's writes nothing
        and is reported `expired` (as the Redis commit script does)."""
        applied: list[str] = []
        conflicts: list[str] = []
        expired: list[str] = []
        for u in updates:
            stored = self._states.get(u.session_id)
            if (stored.mark if stored else None) != u.base:
                conflicts.append(u.session_id)
                continue
            if stored is None and u.session_id in self._expired:
                expired.append(u.session_id)
                continue
            self._states[u.session_id] = Folded(u.state, u.mark)
            self._history.setdefault(u.session_id, []).extend(u.turns)
            self._timeline.setdefault(u.session_id, []).extend(u.timeline)
            self._facts[u.session_id] = self.facts(u.session_id).extended(u.state.seq, u.facts)
            self._index(u)
            retain = None if self.retention is None else self.retention.deadline_ms(u)
            if retain is not None:
                self._retain[u.session_id] = max(retain, self._retain.get(u.session_id, retain))
            applied.append(u.session_id)
        return CommitResult(tuple(applied), tuple(conflicts), tuple(expired))

    def _index(self, u: SessionUpdate) -> None:
        q = u.state.question
        deadline = q.deadline() if q is not None else None
        item = waiting_question(u.state, None if deadline is None else ceil_ms(deadline))
        if item is None:
            self._waiting.pop(u.session_id, None)
        else:
            self._waiting[u.session_id] = item

    def waiting(
        self, reason: str | None = None, after: Cursor | None = None, limit: int = 50
    ) -> WaitingPage:
        """Waiting questions, soonest deadline first, from `after` on."""
        matching = sorted(
            (Cursor(score_of(w), w.session_id), w)
            for w in self._waiting.values()
            if reason is None or w.reason == reason
        )
        rest = [(c, w) for c, w in matching if after is None or c > after]
        limit = max(1, min(limit, 500))
        more = len(rest) > limit
        return WaitingPage(
            tuple(w for _, w in rest[:limit]), len(matching), rest[limit - 1][0] if more else None
        )

    def waiting_by_reason(self) -> dict[str, int]:
        """Waiting questions per reason."""
        counts: dict[str, int] = {}
        for w in self._waiting.values():
            counts[w.reason] = counts.get(w.reason, 0) + 1
        return counts

    def fleet(self) -> dict[tuple[str, str], int]:
        """Sessions per (status, mode)."""
        counts: dict[tuple[str, str], int] = {}
        for f in self._states.values():
            key = (session_status(f.state).value, f.state.mode.value)
            counts[key] = counts.get(key, 0) + 1
        return counts

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

    def facts(self, session_id: str, kinds: Iterable[str] | None = None) -> History:
        """Every call, observation, execution, decision and rejection (of `kinds`, if given)."""
        wanted = history_kinds(kinds)
        return (self._facts.get(session_id) or History(session_id)).only(wanted)

    def timeline(
        self, session_id: str, since: int = 0, latest: int | None = None
    ) -> list[TimelineEntry]:
        """Entries after `since` (the last `latest` of them if given)."""
        entries = [e for e in self._timeline.get(session_id, []) if e["seq"] > since]
        return entries if latest is None else last(entries, latest)

    def drop(self, session_id: str) -> None:
        """Forget one session's projection, its retention entry and its tombstone."""
        self._forget(session_id)
        self._retain.pop(session_id, None)
        self._expired.pop(session_id, None)

    def _forget(self, session_id: str) -> None:
        self._states.pop(session_id, None)
        self._history.pop(session_id, None)
        self._timeline.pop(session_id, None)
        self._waiting.pop(session_id, None)
        self._facts.pop(session_id, None)

    def expired(self, session_id: str) -> Expired | None:
        """The session's tombstone if its projection expired."""
        return self._expired.get(session_id)

    def expire_due(self, now: datetime, limit: int = EXPIRE_BATCH) -> list[str]:
        """Drop the ended sessions whose retention deadline is at or before `now` (up to
        `limit`, earliest first), leaving tombstones; the ids dropped."""
        now_ms = floor_ms(now)
        due = sorted((ms, sid) for sid, ms in self._retain.items() if ms <= now_ms)[:limit]
        at = _EPOCH + timedelta(milliseconds=now_ms)
        dropped: list[str] = []
        for _, sid in due:
            del self._retain[sid]
            folded = self._states.get(sid)
            if folded is None or folded.mark is None:
                continue
            self._forget(sid)
            self._expired[sid] = Expired(sid, at, folded.mark)
            dropped.append(sid)
        return dropped

    def clear(self) -> None:
        """Forget every projection: what a rebuild clears (`Keys.rebuilds`; this store holds
        nothing else, the console's sign-outs and sign-in counts live elsewhere)."""
        self._states.clear()
        self._history.clear()
        self._timeline.clear()
        self._waiting.clear()
        self._facts.clear()
        self._retain.clear()
        self._expired.clear()

    def close(self) -> None:
        """Nothing to release."""
