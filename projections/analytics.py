"""Reads the analytics counters the commit script maintains (pauses, outcomes, time to answer).

The counters are exactly-once (incremented in the Lua call that moves the session's mark), so this
module only reads and combines them. A `since` window is answered from the per-hour hashes: every
UTC hour bucket that overlaps the window is read, all in one pipelined round trip, so the window is
rounded out to whole hours. Without a window the all-time hashes are read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, overload

from projections.indexes import TTA_BUCKETS, UNSPECIFIED, hour_of
from projections.keys import Keys
from projections.redis_client import REDIS_ERRORS, SyncClient
from projections.requests import Request, execute, generations
from schemas.errors import ProjectionError

Grouping = Literal["reason", "hour", "outcome"]
GROUPINGS: tuple[Grouping, ...] = ("reason", "hour", "outcome")
ANSWERED = "answered"
EXPIRED = "expired"
STILL_OPEN = "still_open"
OUTCOMES: tuple[str, ...] = (ANSWERED, EXPIRED, STILL_OPEN)
_HOUR = timedelta(hours=1)
_HOUR_FORMAT = "%Y%m%d%H"


@dataclass(frozen=True, slots=True)
class PausesByReason:
    """Pauses of one reason code and what became of them."""

    reason: str
    pauses: int
    answered: int
    expired: int
    still_open: int


@dataclass(frozen=True, slots=True)
class PausesByHour:
    """Pauses of one reason code asked in one UTC hour (`hour` is the start of that hour)."""

    hour: datetime
    reason: str
    count: int


@dataclass(frozen=True, slots=True)
class PausesByOutcome:
    """How many pauses of one reason code ended one way (answered, expired, still open)."""

    outcome: str
    reason: str
    count: int


@dataclass(frozen=True, slots=True)
class TimeToAnswer:
    """One time-to-answer histogram bucket of one reason (`le_seconds` None: above the last)."""

    reason: str
    bucket: str
    le_seconds: int | None
    count: int


@dataclass(frozen=True, slots=True)
class Count:
    """A counter field and its value (a rejection code, a downgrade kind)."""

    name: str
    count: int


PauseRow = PausesByReason | PausesByHour | PausesByOutcome


def tta_labels() -> tuple[str, ...]:
    """Every time-to-answer bucket label, shortest first (`le_1s` … `gt_86400s`)."""
    return (*(f"le_{b}s" for b in TTA_BUCKETS), f"gt_{TTA_BUCKETS[-1]}s")


def tta_bound(label: str) -> int | None:
    """The upper bound in seconds of a bucket label; None for the open-ended last bucket."""
    if label.startswith("le_") and label.endswith("s") and label[3:-1].isdigit():
        return int(label[3:-1])
    return None


def floor_hour(moment: datetime) -> datetime:
    """The start of the UTC hour containing an (aware) instant."""
    if moment.tzinfo is None:
        raise ValueError("a naive datetime has no defined UTC hour")
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def window_hours(since: timedelta, now: datetime) -> tuple[str, ...]:
    """The `YYYYMMDDHH` buckets overlapping `[now - since, now]`, oldest first."""
    if since <= timedelta(0):
        raise ValueError(f"the window must be positive, got {since}")
    hour = floor_hour(now - since)
    last = floor_hour(now)
    hours: list[str] = []
    while hour <= last:
        hours.append(hour_of(hour))
        hour += _HOUR
    return tuple(hours)


def parse_hour(bucket: str) -> datetime:
    """The start of the hour a `YYYYMMDDHH` bucket names."""
    return datetime.strptime(bucket, _HOUR_FORMAT).replace(tzinfo=UTC)


def by_reason(pauses: Mapping[str, int], outcomes: Mapping[str, int]) -> tuple[PausesByReason, ...]:
    """Combine pause and `<reason>|<outcome>` counts; still open never reads below zero."""
    answered: Counter[str] = Counter()
    expired: Counter[str] = Counter()
    for field_, n in outcomes.items():
        reason, _, outcome = field_.rpartition("|")
        if outcome == ANSWERED:
            answered[reason or UNSPECIFIED] += n
        elif outcome == EXPIRED:
            expired[reason or UNSPECIFIED] += n
    reasons = sorted({*pauses, *answered, *expired})
    return tuple(
        PausesByReason(
            reason=r,
            pauses=pauses.get(r, 0),
            answered=answered[r],
            expired=expired[r],
            still_open=max(pauses.get(r, 0) - answered[r] - expired[r], 0),
        )
        for r in reasons
    )


def by_outcome(rows: Sequence[PausesByReason]) -> tuple[PausesByOutcome, ...]:
    """The by-reason rows regrouped per outcome (zero counts left out)."""
    found: list[PausesByOutcome] = []
    for outcome in OUTCOMES:
        for row in rows:
            n = {ANSWERED: row.answered, EXPIRED: row.expired, STILL_OPEN: row.still_open}[outcome]
            if n:
                found.append(PausesByOutcome(outcome, row.reason, n))
    return tuple(found)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _counts(raw: Mapping[Any, Any] | None) -> dict[str, int]:
    """A counter hash as text → int; a field that is not an integer is a corrupt projection."""
    counts: dict[str, int] = {}
    for key, value in (raw or {}).items():
        try:
            counts[_text(key)] = int(value)
        except ValueError as e:
            raise ProjectionError(f"counter field {_text(key)!r} is not an integer") from e
    return counts


def _sum(hashes: Iterable[Mapping[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for h in hashes:
        total.update(h)
    return dict(total)


class Analytics:
    """Read-only queries over the analytics counters under one key prefix."""

    def __init__(self, client: SyncClient, keys: Keys, *, follow: bool = True) -> None:
        self.client = client
        self.keys = keys
        self.follow = follow  # read the partitions' generations first (a live rebuild moves them)

    def _fresh(self) -> None:
        if self.follow:
            found = execute(self.client, generations(self.keys))
            self.keys = self.keys.in_generations(found)

    # -- pauses ----------------------------------------------------------------------------------

    @overload
    def pauses(
        self, since: timedelta | None, now: datetime, by: Literal["reason"] = ...
    ) -> tuple[PausesByReason, ...]: ...

    @overload
    def pauses(
        self, since: timedelta | None, now: datetime, by: Literal["hour"]
    ) -> tuple[PausesByHour, ...]: ...

    @overload
    def pauses(
        self, since: timedelta | None, now: datetime, by: Literal["outcome"]
    ) -> tuple[PausesByOutcome, ...]: ...

    @overload
    def pauses(
        self, since: timedelta | None, now: datetime, by: Grouping
    ) -> tuple[PauseRow, ...]: ...

    def pauses(
        self, since: timedelta | None, now: datetime, by: Grouping = "reason"
    ) -> tuple[PauseRow, ...]:
        """Pauses in the window (None: all time), grouped by reason, hour or outcome."""
        if by == "hour":
            return self._pauses_by_hour(since, now)
        if by not in ("reason", "outcome"):
            raise ValueError(f"unknown grouping {by!r}: expected one of {', '.join(GROUPINGS)}")
        if since is None:
            pauses, outcomes = self._counters([("pauses", None), ("outcomes", None)])
        else:
            hours = window_hours(since, now)
            replies = self._counters(
                [*(("pauses", h) for h in hours), *(("outcomes", h) for h in hours)]
            )
            pauses, outcomes = _sum(replies[: len(hours)]), _sum(replies[len(hours) :])
        rows = by_reason(pauses, outcomes)
        return rows if by == "reason" else by_outcome(rows)

    def _pauses_by_hour(self, since: timedelta | None, now: datetime) -> tuple[PausesByHour, ...]:
        hours = window_hours(since, now) if since is not None else self._stored_hours("pauses")
        replies = self._counters([("pauses", h) for h in hours])
        return tuple(
            PausesByHour(parse_hour(h), reason, n)
            for h, counts in zip(hours, replies, strict=True)
            for reason, n in sorted(counts.items())
            if n
        )

    def _stored_hours(self, name: str) -> tuple[str, ...]:
        """Every hour bucket stored for a counter in any partition (SCAN: only for all-time
        hourly queries)."""
        self._fresh()
        patterns = [self.keys.stat_hour_pattern(name, g) for g in self.keys.in_use()]
        try:
            found = {
                _text(k).rpartition(":h:")[2]
                for pattern in patterns
                for k in self.client.scan_iter(match=pattern, count=1000)
            }
        except REDIS_ERRORS as e:
            raise ProjectionError(f"listing the {name} hour buckets failed: {e}") from e
        return tuple(sorted(h for h in found if len(h) == 10 and h.isdigit()))

    # -- the other counters ----------------------------------------------------------------------

    def time_to_answer(self) -> tuple[TimeToAnswer, ...]:
        """The time-to-answer histogram per reason, every bucket listed, shortest first."""
        (counts,) = self._counters([("tta", None)])
        per_reason: dict[str, dict[str, int]] = {}
        for field_, n in counts.items():
            reason, _, label = field_.rpartition("|")
            per_reason.setdefault(reason or UNSPECIFIED, {})[label] = n
        labels = tta_labels()
        return tuple(
            TimeToAnswer(reason, label, tta_bound(label), buckets.get(label, 0))
            for reason, buckets in sorted(per_reason.items())
            for label in (*labels, *sorted(set(buckets) - set(labels)))
        )

    def rejections(self) -> tuple[Count, ...]:
        """Rejected events per rejection code, most frequent first."""
        return self._ranked("rejections")

    def downgrades(self) -> tuple[Count, ...]:
        """Authority claims the fold downgraded (field `principal`)."""
        return self._ranked("downgrades")

    def counter(self, name: str, hour: str | None = None) -> dict[str, int]:
        """One counter hash (of one UTC hour `YYYYMMDDHH` with `hour`), every partition's shard
        added up: field -> count."""
        (counts,) = self._counters([(name, hour)])
        return counts

    def folded(self) -> int:
        """Events the workers folded so far (every step: applied, no-op, rejected, skipped)."""
        return self.counter("events").get("folded", 0)

    def _ranked(self, name: str) -> tuple[Count, ...]:
        counts = self.counter(name)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return tuple(Count(k, n) for k, n in ranked)

    def _counters(self, wanted: Sequence[tuple[str, str | None]]) -> list[dict[str, int]]:
        """Each counter (name, and hour or None for all time), every partition's shard added
        up, in one pipelined round trip (one per master on a cluster)."""
        if not wanted:
            return []
        self._fresh()
        shards = [self.keys.stat_shards(name, hour) for name, hour in wanted]
        commands = [("HGETALL", key) for keys in shards for key in keys]
        request = Request(commands, lambda replies: replies, "reading analytics counters failed")
        replies = execute(self.client, request)
        out: list[dict[str, int]] = []
        at = 0
        for keys in shards:
            out.append(_sum(_counts(r) for r in replies[at : at + len(keys)]))
            at += len(keys)
        return out
