"""Snapshots of sessions' hot state on `sessions.snapshots`, and what a rebuild makes of them.

The topic is compacted and keyed by session id: per session its latest `Snapshot` (the state as
the projection stored it after one of its offsets, its window, its dedupe window and what it
added to the fleet's counters), and per partition its latest `SnapshotCheckpoint` under the key
`CHECKPOINT_KEY + partition`. A checkpoint at offset C promises that every event of its partition
at or below C that a worker applied is covered by its session's latest snapshot; it is written
only after those snapshots were acknowledged (`processors.snapshots`). So a rebuild of the
partition restores every snapshot, and folds the log from C + 1 on, skipping each session's
records at or below its snapshot's mark.

What a snapshot does not hold is what only grows: the history lists (every call, observation,
execution, decision and rejection), the turns before the window and the timeline before it. A
session rebuilt from its snapshot has those from the snapshot on; `replay --full` (or `replay
--session X --full`) folds them from the whole log.

Every snapshot and checkpoint names the trust it was folded under: the fingerprint of the fold's
trust inputs (`session_model.authority.trust_fingerprint`: the trusted keys, the cut-over, the
unsigned start mode). A state folded under other keys may hold grants a key no longer trusted
signed; a rebuild believes only snapshots of its own trust, so after any change to those inputs
the log is folded again, whether or not every snapshot was replaced since (a snapshotting that
failed, a partition no round has visited, a session too large to snapshot).

A session whose projection expired (retention) has a stub for its latest snapshot once a round
has replaced it (`stub_record`, schema v6: `expired_at_ms` set, no state): a rebuild restores its
tombstone and what it added to the fleet's counters, not the session (`recovered`).

Unusable snapshots are counted, never fatal (`Plan.ignored`, by reason): an undecodable record
(`corrupt`), another layout (`layout`: after an upgrade the log is folded whole), another trust
(`trust`: or none named, written before schema v5), a state that does not read (`unreadable`),
or one compacted away between the plan and the restore (`gone`: a live rebuild, with workers
snapshotting meanwhile). A session whose snapshot is unusable, and a partition without a usable
checkpoint, are folded from offset 0.

A rebuild reads the topic twice. The plan (`plan`) keeps, per session, only where its latest
snapshot is and what it covers (`Chosen`), never its state: a fleet of a million sessions would
otherwise hold every state in memory at once, several GB. Each rebuild process then reads its
partitions' chosen records again and restores them page by page (`chosen_snapshots`); a state
that does not read is found then, and its partition is folded from 0 before any of it is read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from projections.codec import STATE_VERSION, summary_from_stored
from projections.requests import (
    RawState,
    Restored,
    Retired,
    floor_ms,
    instant_ms,
    pairs,
    parse_read,
    text,
)
from schemas.codec import EventCodec
from schemas.errors import MilpaError
from session_model.projection import Expired, Position

CHECKPOINT_KEY: Final = b"\x00checkpoint:"
# The largest record the topic takes (its `max.message.bytes`) and its writers send.
SNAPSHOT_MAX_BYTES: Final = 8 * 1024 * 1024
CORRUPT: Final = "corrupt"
LAYOUT: Final = "layout"
TRUST: Final = "trust"
UNREADABLE: Final = "unreadable"
GONE: Final = "gone"


def checkpoint_key(partition: int) -> bytes:
    """The key of a partition's checkpoint record."""
    return CHECKPOINT_KEY + str(partition).encode()


def snapshot_writer_prefix(topic: str) -> str:
    """What every snapshot writer's transactional id of this topic starts with (for ACLs)."""
    return f"{topic}.writer-"


def snapshot_writer_id(topic: str, partition: int) -> str:
    """The transactional id of a partition's snapshot writer: one per partition, whoever owns
    it, so that a new owner's writer fences off every earlier one (`processors.sinks`)."""
    return f"{snapshot_writer_prefix(topic)}{partition}"


def snapshot_record(
    session_id: str, raw: RawState, taken_at_ms: int, *, trust: str
) -> dict[str, Any]:
    """The Snapshot record of a session's stored state (`requests.raw_states`), folded under
    `trust` (the fingerprint of the fold's trust inputs)."""
    state, mark, turns, groups, summary, counters, retain_until = raw
    position = Position.parse(text(mark))
    return {
        "session_id": session_id,
        "partition": position.partition,
        "offset": position.offset,
        "layout": state[0] if state else -1,
        "taken_at_ms": taken_at_ms,
        "state": bytes(state),
        "turns": [bytes(t) for t in turns],
        "event_ids": [bytes(g) for g in groups],
        # The text: the record's schema says string, and a restore stores it again.
        "summary": None if summary is None else summary_from_stored(summary, session_id),
        "retain_until_ms": retain_until,
        "counters": [{"name": text(k), "count": int(v)} for k, v in pairs(counters)],
        "trust": trust,
        "expired_at_ms": None,
    }


def stub_record(retired: Retired, taken_at_ms: int, *, trust: str) -> dict[str, Any]:
    """The Snapshot record that replaces a retired session's (its projection expired): its
    tombstone and counters, no state (`expired_at_ms` set), written by a worker under `trust`."""
    mark = retired.expired.mark
    return {
        "session_id": retired.session_id,
        "partition": mark.partition,
        "offset": mark.offset,
        "layout": STATE_VERSION,
        "taken_at_ms": taken_at_ms,
        "state": b"",
        "turns": [],
        "event_ids": [],
        "summary": None,
        "retain_until_ms": None,
        "counters": [{"name": k, "count": v} for k, v in retired.counters.items()],
        "trust": trust,
        "expired_at_ms": floor_ms(retired.expired.at),
    }


def checkpoint_record(
    partition: int, offset: int, taken_at_ms: int, *, trust: str
) -> dict[str, Any]:
    """The SnapshotCheckpoint record of a partition covered through `offset` by snapshots folded
    under `trust`."""
    return {
        "partition": partition,
        "offset": offset,
        "layout": STATE_VERSION,
        "taken_at_ms": taken_at_ms,
        "trust": trust,
    }


def restored(record: Mapping[str, Any], trust: str) -> Restored:
    """The session a Snapshot record holds, for a rebuild folding under `trust` (its
    fingerprint): `UnusableSnapshot` with the reason if none."""
    sid = _believed(record, trust)
    mark = f"{record['partition']}:{record['offset']}"
    summary = record["summary"]  # its UTF-8 text reads back as itself (never deflated)
    raw = [
        record["state"],
        mark,
        record["turns"],
        record["event_ids"],
        None if summary is None else summary.encode(),
    ]
    try:
        folded = parse_read(raw, sid)
    except (MilpaError, ValueError, TypeError, KeyError, IndexError) as e:
        raise UnusableSnapshot(UNREADABLE, f"{sid}: {type(e).__name__}: {e}") from e
    if folded is None:
        raise UnusableSnapshot(UNREADABLE, f"{sid}: no state")
    return Restored(
        folded,
        tuple(record["event_ids"]),
        _counters(record),
        record["taken_at_ms"],
        record.get("retain_until_ms"),
    )


def recovered(record: Mapping[str, Any], trust: str) -> Restored | Retired:
    """The session a Snapshot record holds, or a retired one's stub (`UnusableSnapshot` if
    neither can be used under `trust`)."""
    expired_at: int | None = record.get("expired_at_ms")
    if expired_at is None:
        return restored(record, trust)
    sid = _believed(record, trust)
    mark = Position(record["partition"], record["offset"])
    return Retired(Expired(sid, instant_ms(expired_at), mark), _counters(record))


def _believed(record: Mapping[str, Any], trust: str) -> str:
    """The session of a Snapshot record of this layout and trust (`UnusableSnapshot` if not)."""
    sid: str = record["session_id"]
    if record["layout"] != STATE_VERSION:
        raise UnusableSnapshot(LAYOUT, f"{sid}: layout {record['layout']}, not {STATE_VERSION}")
    if record.get("trust") != trust:
        raise UnusableSnapshot(TRUST, f"{sid}: {_folded_under(record)}, not {trust}")
    return sid


class UnusableSnapshot(Exception):  # noqa: N818 - internal: a counted reason, never raised out
    """A snapshot a rebuild cannot start from, and why (`reason`: one of the codes above)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Chosen:
    """A session's snapshot that a rebuild restores: its offset on the snapshots topic (`at`,
    in the partition of the session's own number) and the event offset it covers (`mark`)."""

    at: int
    mark: int


@dataclass
class Plan:
    """Where a rebuild starts: per partition its start offset and the snapshots it restores."""

    starts: dict[int, int] = field(default_factory=dict)  # partition -> first offset to read
    sessions: dict[int, dict[str, Chosen]] = field(default_factory=dict)
    ignored: Counter[str] = field(default_factory=Counter)  # unusable records, by reason
    messages: list[str] = field(default_factory=list)  # one line per ignored record (a few)

    def restored_count(self) -> int:
        """Sessions to restore from snapshots."""
        return sum(len(s) for s in self.sessions.values())

    def ignore(self, reason: str, message: str) -> None:
        """Count an unusable record (its message kept for the first few)."""
        self.ignored[reason] += 1
        if len(self.messages) < 20:
            self.messages.append(message)


def plan(
    records: Iterable[tuple[int, int, bytes | None, bytes | None]],
    partitions: Iterable[int],
    codec: EventCodec,
    session_id: str | None = None,
    ends: Mapping[int, int] | None = None,
    *,
    trust: str,
) -> Plan:
    """The rebuild plan from the snapshot topic's records (partition, offset, key, value), in
    log order, for a rebuild folding under `trust` (the fingerprint of its trust inputs): a
    snapshot or a checkpoint of another trust, or of none, is unusable (`TRUST`).

    A later record of a key replaces an earlier one (the topic is compacted); a snapshot with a
    lower mark than one already seen does not (a stale owner's late write). With `session_id`,
    only that session's snapshot counts and its partition starts right after it. With `ends`
    (the events topic's end offsets), a snapshot or checkpoint past them is unreadable: it would
    skip events the log holds. So is a snapshot whose mark names another partition than the one
    it was written to (a partition's snapshots go to its own number).

    The states are not read here (`chosen_snapshots` reads them when they are restored).
    """
    wanted = set(partitions)
    # The latest record of each key decides (an unusable one is counted only if it is the latest).
    checkpoints: dict[int, int | UnusableSnapshot] = {}
    # sid -> (partition, its latest record's use, the highest mark of its snapshots that are of
    # its partition's log whatever their layout or trust: a later one with a lower mark is a
    # stale owner's, and never replaces it; -1 before any)
    latest: dict[str, tuple[int, Chosen | UnusableSnapshot, int]] = {}
    out = Plan()
    for partition, at, key, value in records:
        if key is None:
            continue
        if key.startswith(CHECKPOINT_KEY):
            if session_id is None and value is None:
                checkpoints.pop(partition, None)  # a tombstone: no checkpoint
            elif session_id is None and value is not None:
                checkpoints[partition] = _checkpoint(codec, partition, value, ends, trust)
            continue
        sid = key.decode("utf-8", "replace")
        if session_id is not None and sid != session_id:
            continue
        if value is None:  # a tombstone: no snapshot
            latest.pop(sid, None)
            continue
        highest = latest[sid][2] if sid in latest else -1
        try:
            record = codec.decode_snapshot(value)
        except MilpaError as e:
            why = f"snapshot of {sid}: {e}"
            latest[sid] = (partition, UnusableSnapshot(CORRUPT, why), highest)
            continue
        if record["session_id"] != sid:
            why = f"snapshot under key {sid!r} is of {record['session_id']!r}"
            latest[sid] = (partition, UnusableSnapshot(UNREADABLE, why), highest)
            continue
        if record["partition"] != partition or (
            ends is not None and record["offset"] >= ends.get(partition, 0)
        ):
            why = (
                f"snapshot of {sid} in partition {partition} covers {record['partition']}:"
                f"{record['offset']}, not an event of that partition's log"
            )
            latest[sid] = (partition, UnusableSnapshot(UNREADABLE, why), highest)
            continue
        mark = record["offset"]
        if highest > mark:
            continue  # a stale owner's late write: the newer one stands
        try:
            _believed(record, trust)
        except UnusableSnapshot as e:
            latest[sid] = (partition, e, mark)
            continue
        latest[sid] = (partition, Chosen(at, mark), mark)
    full: set[int] = set()  # partitions a session must be folded from 0 in
    for sid, (partition, found, _) in latest.items():
        if isinstance(found, UnusableSnapshot):
            out.ignore(found.reason, str(found))
            full.add(partition)
        elif partition in wanted:
            out.sessions.setdefault(partition, {})[sid] = found
    covered: dict[int, int] = {}
    for p, got in checkpoints.items():
        if isinstance(got, UnusableSnapshot):
            out.ignore(got.reason, str(got))
        else:
            covered[p] = got
    for p in sorted(wanted):
        if session_id is not None:
            mine = out.sessions.get(p, {}).get(session_id)
            out.starts[p] = 0 if mine is None or p in full else mine.mark + 1
        elif p in full or p not in covered:
            out.starts[p] = 0
        else:
            out.starts[p] = covered[p] + 1
    return out


def chosen_snapshots(
    records: Iterable[tuple[int, int, bytes | None, bytes | None]],
    chosen: Mapping[int, Mapping[str, Chosen]],
    codec: EventCodec,
    *,
    trust: str,
) -> Iterator[tuple[int, Restored | Retired | UnusableSnapshot]]:
    """(partition, the session restored, a retired one's stub, or why it cannot be) for each
    chosen snapshot, read from the snapshots topic's records (partition, offset, key, value) as
    they come; then each chosen one the records did not hold (`GONE`: compacted away since the
    plan)."""
    left = {(p, c.at): sid for p, found in chosen.items() for sid, c in found.items()}
    for partition, at, key, value in records:
        sid = left.pop((partition, at), None)
        if sid is None:
            continue
        if key != sid.encode() or value is None:
            yield partition, UnusableSnapshot(GONE, f"{sid}: not at {partition}:{at} any more")
            continue
        try:
            record = codec.decode_snapshot(value)
            if record["session_id"] != sid:
                raise UnusableSnapshot(UNREADABLE, f"snapshot under key {sid!r} is of another")
            yield partition, recovered(record, trust)
        except MilpaError as e:
            yield partition, UnusableSnapshot(CORRUPT, f"snapshot of {sid}: {e}")
        except UnusableSnapshot as e:
            yield partition, e
    for (partition, at), sid in left.items():
        why = f"{sid}: its snapshot at {partition}:{at} was compacted away since the plan"
        yield partition, UnusableSnapshot(GONE, why)


def _checkpoint(
    codec: EventCodec, partition: int, value: bytes, ends: Mapping[int, int] | None, trust: str
) -> int | UnusableSnapshot:
    """The offset a checkpoint record covers, or why it cannot be used."""
    try:
        got = codec.decode_checkpoint(value)
    except MilpaError as e:
        return UnusableSnapshot(CORRUPT, f"checkpoint of partition {partition}: {e}")
    if got["layout"] != STATE_VERSION or got["partition"] != partition:
        why = f"checkpoint of partition {partition}: layout {got['layout']}, of {got['partition']}"
        return UnusableSnapshot(LAYOUT, why)
    if got.get("trust") != trust:
        why = f"checkpoint of partition {partition}: {_folded_under(got)}, not {trust}"
        return UnusableSnapshot(TRUST, why)
    offset: int = got["offset"]
    if ends is not None and offset >= ends.get(partition, 0):
        why = f"checkpoint of partition {partition} at {offset}: past the log's end"
        return UnusableSnapshot(UNREADABLE, why)
    return offset


def _folded_under(record: Mapping[str, Any]) -> str:
    found = record.get("trust")
    return "of no named trust (before schema v5)" if found is None else f"folded under {found}"


def _counters(record: Mapping[str, Any]) -> dict[str, int]:
    """A Snapshot record's counters (`Keys.counter_field` -> count)."""
    return {c["name"]: c["count"] for c in record["counters"]}
