"""What a committed update changes outside the session's own keys: due-work indexes and counters.

Derived from the update alone and applied by the same Lua call that moves the session's mark, so a
refused (stale) update changes no index and a redelivered batch never counts a pause twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from projections.keys import Keys
from session_model.compaction import compaction_due
from session_model.projection import SessionUpdate

# Upper bounds (seconds) of the time-to-answer histogram buckets.
TTA_BUCKETS: tuple[int, ...] = (1, 5, 30, 60, 300, 1800, 3600, 21600, 86400)
UNSPECIFIED = "unspecified"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class IndexChanges:
    """Index state after the update and the counters it increments."""

    deadline_ms: int | None
    compaction_due: bool
    counters: tuple[tuple[str, str, int], ...]


def ceil_ms(moment: datetime) -> int:
    """Epoch milliseconds, rounded up: a deadline is never scheduled before it has passed."""
    return -((_EPOCH - moment) // _MS)


def hour_of(moment: datetime) -> str:
    """The UTC hour bucket `YYYYMMDDHH` of an instant."""
    return moment.astimezone(UTC).strftime("%Y%m%d%H")


def tta_bucket(seconds: float) -> str:
    """The histogram bucket label of a time-to-answer."""
    for bound in TTA_BUCKETS:
        if seconds <= bound:
            return f"le_{bound}s"
    return f"gt_{TTA_BUCKETS[-1]}s"


def index_changes(update: SessionUpdate, keys: Keys, max_turns: int | None) -> IndexChanges:
    """Everything the update does to global indexes and counters."""
    state = update.state
    deadline = state.question.deadline() if state.question is not None else None
    # Events folded (every step: applied, no-op, rejected, skipped); what benchmarks and
    # operators watch to see a projector keep up.
    p = update.mark.partition  # each counter's shard is the session's partition's
    counters: list[tuple[str, str, int]] = [(keys.stat("events", p), "folded", len(update.steps))]
    for s in update.steps:
        o = s.outcome
        if o.pause_reason is not None:
            counters.append((keys.stat("pauses", p), o.pause_reason, 1))
            hour = hour_of(s.event.occurred_at)
            counters.append((keys.stat_hour("pauses", hour, p), o.pause_reason, 1))
        if o.decision is not None:
            d = o.decision
            reason = d.reason or UNSPECIFIED
            outcome = "expired" if d.expired_at is not None else "answered"
            counters.append((keys.stat("outcomes", p), f"{reason}|{outcome}", 1))
            if d.asked_at is not None:
                asked_hour = hour_of(d.asked_at)
                counted = f"{reason}|{outcome}"
                counters.append((keys.stat_hour("outcomes", asked_hour, p), counted, 1))
                if d.expired_at is None and d.decided_at is not None:
                    seconds = max((d.decided_at - d.asked_at).total_seconds(), 0.0)
                    counters.append((keys.stat("tta", p), f"{reason}|{tta_bucket(seconds)}", 1))
        if o.rejection is not None:
            counters.append((keys.stat("rejections", p), o.rejection.code, 1))
        if o.downgraded:
            counters.append((keys.stat("downgrades", p), "principal", 1))
        if o.kind.value == "skipped":
            counters.append((keys.stat("skipped", p), "unknown_type", 1))
    return IndexChanges(
        deadline_ms=None if deadline is None else ceil_ms(deadline),
        compaction_due=compaction_due(state, max_turns),
        counters=tuple(counters),
    )
