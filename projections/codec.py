"""The projection's stored forms: a `Session`'s state, its event ids and its timeline entries.

Built for memory (an idle session must cost under 537 bytes of Redis, `docs/PERFORMANCE.md`):

- **State**: one version byte (`STATE_VERSION`), then a JSON array: a presence bitmap, then the
  value of every field that differs from `Session`'s default, in `_FIELDS` order (a flag is its bit
  alone). Records are positional arrays with trailing nulls trimmed; todo statuses and origins are
  small integers. The session id (the key), the unsummarised turns and the event ids are not in it.
  A state too long to be kept in chunks (`layout.STATE_INLINE`) has the array deflated instead
  when that is shorter (`DEFLATED` after the version byte): what an old session keeps (the calls
  since its summary, the latest call of each artifact) shrinks about sixfold. The benchmarks'
  idle and 19-event sessions stay below that length (at most 970 bytes): they never deflate.
- **Summary** (the latest compaction's, field `m` of the state hash, written only by the commit that
  applies a compaction): its UTF-8 text, or, when that is at least `DEFLATE_FROM` bytes and deflate
  makes it shorter, the byte `DEFLATED` and the text deflated (zlib). Two thirds of what an old
  session keeps hot was its summary: the facts block of 30-odd calls and of the latest call of
  each artifact called last, JSON that compresses about tenfold.
- **Event ids**: a byte string of records. A canonical (lowercase, hyphenated) RFC 4122 UUID takes
  16 bytes; any other id takes its UTF-8 bytes behind a length. Exact: nothing is hashed away.
- **Timeline entries**: JSON arrays `[shape, seq, values...]` for the entry shapes the timeline
  makes today, without the `session` field (it is the key), trailing nulls trimmed; an entry of any
  other shape is kept as a JSON object (minus `session`), so nothing is ever lost. None contains a
  raw newline (JSON escapes it), so entries can be stored one per line.

Every format here is part of the stored layout: change one and bump `STATE_VERSION`, so that a
projection of another layout is refused (`CorruptProjectionError`) rather than misread.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import MISSING, fields
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import orjson

from projections.layout import STATE_INLINE
from schemas.errors import CorruptProjectionError
from session_model.dedupe import EMPTY as NO_IDS
from session_model.dedupe import RecentIds
from session_model.modes import Mode
from session_model.principal import Principal
from session_model.session import (
    PAUSE_REASONS,
    TOOL_NAMES,
    Approval,
    CallFact,
    Decision,
    ExecutionFact,
    History,
    HistoryRecord,
    InheritedFrom,
    Observation,
    OpenCard,
    Question,
    Rejection,
    Session,
    Todo,
    Turn,
    bounded_counts,
    latest_artifacts,
)
from session_model.timeline import TimelineEntry

# 5: the sessions' own counters (`c:` fields) and the unsnapshotted index, which snapshots rely
# on: projections of layout 4 lack them, so they are rebuilt (`replay --full`) on upgrade.
# 6: long values deflated (the summary, a long state): layout 5 would misread them.
STATE_VERSION = 6
_HEADER = bytes([STATE_VERSION])
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)

# Vocabularies stored as their index; a value outside them is stored as itself (a string).
# Append only: an index, once written, must keep meaning the same value.
_STATUSES = ("pending", "in_progress", "done", "blocked")
_ORIGINS = ("planned", "discovered", "retrospective", "unsupported")
_STATUS_CODE = {v: i for i, v in enumerate(_STATUSES)}
_ORIGIN_CODE = {v: i for i, v in enumerate(_ORIGINS)}


def to_millis(moment: datetime | None) -> int | None:
    """Milliseconds since the epoch of `moment`, floored (None stays None)."""
    # Integer arithmetic: float timestamps can lose the last millisecond.
    return None if moment is None else (moment - _EPOCH) // _MS


def from_millis(ms: int | None) -> datetime | None:
    """The instant `ms` milliseconds after the epoch (None stays None)."""
    return None if ms is None else _EPOCH + timedelta(milliseconds=ms)


def _name(names: tuple[str, ...], value: Any) -> Any:
    return names[value] if type(value) is int else value


def _trim(values: list[Any]) -> list[Any]:
    """Drop trailing nulls: the decoder pads them back."""
    while values and values[-1] is None:
        values.pop()
    return values


def _pad(values: list[Any], size: int) -> list[Any]:
    return values + [None] * (size - len(values)) if len(values) < size else values


def _principal(p: Principal | None) -> list[Any] | None:
    if p is None:
        return None
    return [p.id, True] if p.verified else [p.id]


def _principal_from(v: list[Any] | None) -> Principal | None:
    if v is None:
        return None
    return Principal(v[0], verified=len(v) > 1 and v[1] is True)


def _question(q: Question | None) -> list[Any] | None:
    if q is None:
        return None
    return _trim(
        [
            q.id,
            q.question,
            list(q.options),
            q.why,
            q.expires_at,
            q.reason,
            q.seq,
            to_millis(q.asked_at),
        ]
    )


def _question_from(v: list[Any] | None) -> Question | None:
    if v is None:
        return None
    i, text, options, why, expires_at, reason, seq, asked_at = _pad(v, 8)
    return Question(i, text, tuple(options), why, expires_at, reason, seq, from_millis(asked_at))


def _todo(t: Todo) -> list[Any]:
    inherited = t.inherited_from
    return _trim(
        [
            t.id,
            t.text,
            _STATUS_CODE.get(t.status, t.status),
            t.version,
            _ORIGIN_CODE.get(t.origin, t.origin),
            t.mutations_at,
            t.plan_version,
            t.born_in_plan,
            t.supersedes,  # the fields usually null last: trimmed
            None if t.from_status is None else _STATUS_CODE.get(t.from_status, t.from_status),
            t.replaces,
            None if inherited is None else [inherited.session, inherited.version, inherited.origin],
            t.transferred_to,
        ]
    )


def _todo_from(v: list[Any]) -> Todo:
    (
        i,
        text,
        status,
        version,
        origin,
        mutations_at,
        plan_version,
        born_in_plan,
        supersedes,
        from_status,
        replaces,
        inherited,
        transferred_to,
    ) = _pad(v, 13)
    return Todo(
        i,
        text,
        _name(_STATUSES, status),
        version,
        supersedes,
        _name(_STATUSES, from_status),
        _name(_ORIGINS, origin),
        mutations_at,
        plan_version,
        born_in_plan,
        replaces,
        None if inherited is None else InheritedFrom(*inherited),
        transferred_to,
    )


def _decision(d: Decision) -> list[Any]:
    return _trim(
        [
            d.question_id,
            d.question,
            d.answer,
            _principal(d.by),
            d.executor,
            d.reason,
            d.why,
            d.seq,
            d.event_id,
            d.affirmative,
            to_millis(d.decided_at),
            to_millis(d.expired_at),
            to_millis(d.asked_at),
            d.asked_seq,
        ]
    )


def _decision_from(v: list[Any]) -> Decision:
    (
        question_id,
        question,
        answer,
        by,
        executor,
        reason,
        why,
        seq,
        event_id,
        affirmative,
        decided_at,
        expired_at,
        asked_at,
        asked_seq,
    ) = _pad(v, 14)
    return Decision(
        question_id=question_id,
        question=question,
        answer=answer,
        by=_principal_from(by),
        executor=executor,
        reason=reason,
        why=why,
        seq=seq,
        event_id=event_id,
        affirmative=affirmative is True,
        decided_at=from_millis(decided_at),
        expired_at=from_millis(expired_at),
        asked_at=from_millis(asked_at),
        asked_seq=asked_seq or 0,
    )


def _rejection(r: Rejection) -> list[Any]:
    return _trim(
        [r.seq, r.event_id, r.type, r.code, r.producer, to_millis(r.occurred_at), _principal(r.by)]
    )


def _rejection_from(v: list[Any]) -> Rejection:
    seq, event_id, type_, code, producer, occurred_at, by = _pad(v, 7)
    return Rejection(
        seq,
        event_id,
        type_,
        code,
        producer,
        from_millis(occurred_at) or _EPOCH,
        _principal_from(by),
    )


def _calls(calls: tuple[CallFact, ...]) -> list[list[Any]]:
    # The most numerous records of a busy session: no call per record for the usual short form.
    return [
        [c.seq, c.tool, c.result, c.ok, c.mutating]
        if c.artifact is None and c.verdict is None and c.effect_observation_id is None
        else _trim(
            [
                c.seq,
                c.tool,
                c.result,
                c.ok,
                c.mutating,
                c.artifact,
                c.verdict,
                c.effect_observation_id,
            ]
        )
        for c in calls
    ]


def _execution(x: ExecutionFact) -> list[Any]:
    return _trim([x.seq, x.operation, x.argument_digest, x.artifact, x.executor])


def _observation(o: Observation) -> list[Any]:
    return _trim([o.event_id, o.seq, o.known, list(o.artifacts), list(o.evidence), o.observer])


def _observation_from(v: list[Any]) -> Observation:
    return Observation(v[0], v[1], v[2], tuple(v[3]), tuple(v[4]), *v[5:])


def _open_card(c: OpenCard) -> list[Any]:
    return _trim([c.id, c.status, c.version, c.disposition, c.mutations_since, c.to])


# -- deflated values -------------------------------------------------------------------------------
#
# A long value read and written whole is stored deflated when that makes it shorter: the byte
# DEFLATED, then zlib's stream (with its checksum). No UTF-8 text contains the byte 0xFF and no JSON
# begins with it, so a reader tells the two forms apart by the first byte. zlib's output is a pure
# function of its input and level (same library), so a rebuild stores the same bytes.

DEFLATED = 0xFF
DEFLATE_FROM = 64  # shorter values are stored as they are (a listpack keeps values up to 63 bytes)
_DEFLATED = bytes([DEFLATED])
# Written once per compaction (itself ~120 µs to plan): level 6 deflates the 9.5 KB summary of the
# 100k-event session to 965 bytes in ~41 µs (level 9: 932 in ~50, the same allocation; 1: 1,135).
_SUMMARY_LEVEL = 6
# Written by every commit of its session: level 1 deflates the 4.8 KB state of the 100k-event
# session to 741 bytes, and `session_to_blob` then takes ~20 µs instead of ~11 (level 6: 636
# bytes, ~10 µs more); reading it back takes ~45 µs instead of ~40.
_STATE_LEVEL = 1


def _deflated(raw: bytes, level: int) -> bytes | None:
    """`DEFLATED` and `raw` deflated, or None when that is not shorter than `raw`."""
    if len(raw) < DEFLATE_FROM:
        return None
    packed = _DEFLATED + zlib.compress(raw, level)
    return packed if len(packed) < len(raw) else None


def _inflated(stored: bytes) -> bytes:
    """What `_deflated` deflated (`stored` without its first byte, `DEFLATED`)."""
    try:
        return zlib.decompress(stored[1:])
    except zlib.error as e:
        raise ValueError(f"a deflated value cannot be inflated: {e}") from e


def summary_to_stored(summary: str) -> bytes:
    """The stored form of a compaction summary (field `m`)."""
    raw = summary.encode()
    return _deflated(raw, _SUMMARY_LEVEL) or raw


def summary_from_stored(stored: bytes, session_id: str) -> str:
    """The summary a stored form holds."""
    try:
        if stored[:1] == _DEFLATED:
            return _inflated(stored).decode()
        return stored.decode()
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptProjectionError(f"{session_id}: the stored summary cannot be read: {e}") from e


# -- state -----------------------------------------------------------------------------------------


# The state is `[presence, values...]`: bit k of `presence` says whether field k of `_FIELDS` is
# stored (it is left out when it equals `Session`'s default); a flag (a bool field) is its bit
# alone. (field, flag, to stored form or None, from stored form or None). Append only.
_FIELDS: tuple[tuple[str, bool, Any, Any], ...] = (
    # What an idle session holds first: its presence bitmap stays one or two digits.
    ("started", True, None, None),
    ("goal", False, None, None),
    ("plan", False, None, None),
    ("plan_version", False, None, None),
    ("todos", False, lambda v: [_todo(t) for t in v], lambda v: tuple(map(_todo_from, v))),
    ("seq", False, None, None),
    ("mode", False, lambda m: m.value, Mode),
    ("question", False, _question, _question_from),
    ("pauses", False, None, lambda v: bounded_counts(v, PAUSE_REASONS)),
    ("turn_count", False, None, None),
    ("tool_calls", False, None, None),
    ("mutations", False, None, None),
    ("parent_id", False, None, None),
    ("permissions", False, None, tuple),
    ("removed_options", False, None, tuple),
    ("run_first", False, None, tuple),
    ("obligation_declared", True, None, None),
    ("compacted_through", False, None, None),
    ("closed_question", False, _question, _question_from),
    (
        "decisions",
        False,
        lambda v: [_decision(d) for d in v],
        lambda v: tuple(map(_decision_from, v)),
    ),
    ("ended_because", False, None, None),
    (
        "open_work",
        False,
        lambda v: [_open_card(c) for c in v],
        lambda v: tuple(OpenCard(*c) for c in v),
    ),
    (
        "rejections",
        False,
        lambda v: [_rejection(r) for r in v],
        lambda v: tuple(map(_rejection_from, v)),
    ),
    ("skipped", False, None, None),
    ("downgrades", False, None, None),
    ("calls", False, _calls, lambda v: tuple(CallFact(*c) for c in v)),
    (
        "executions",
        False,
        lambda v: [_execution(x) for x in v],
        lambda v: tuple(ExecutionFact(*x) for x in v),
    ),
    (
        "observations",
        False,
        lambda v: [_observation(o) for o in v],
        lambda v: tuple(map(_observation_from, v)),
    ),
    (
        "approvals",
        False,
        lambda v: [
            _trim([a.operation, a.argument_digest, a.key_id, a.signature_id, a.seq, a.consumed_at])
            for a in v
        ],
        lambda v: tuple(Approval(*a) for a in v),
    ),
    ("decided", False, sorted, frozenset),
    (
        "confirmations",
        False,
        lambda v: sorted(map(list, v)),
        lambda v: frozenset(tuple(p) for p in v),
    ),
    ("rejected", False, None, dict),
    ("decision_count", False, None, None),
    ("tools", False, None, lambda v: bounded_counts(v, TOOL_NAMES)),
    (
        "artifacts",
        False,
        lambda v: _calls(tuple(v.values())),
        lambda v: latest_artifacts(CallFact(*c) for c in v),
    ),
    ("signed_ids", False, sorted, frozenset),
)
STORED_FIELDS = tuple(name for name, *_ in _FIELDS)
# Stored apart: the id is the key; turns and event ids have their own streams; the summary (the
# largest value of an old session) is written only by the commit that changes it.
NOT_IN_STATE = frozenset({"id", "turns", "event_ids", "summary"})
_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]
    for f in fields(Session)
    if f.name not in NOT_IN_STATE and (f.default is not MISSING or f.default_factory is not MISSING)
}
_FLAG: Any = object()
_ENCODE = tuple(
    (1 << bit, name, _FLAG if flag else encode, _DEFAULTS[name])
    for bit, (name, flag, encode, _) in enumerate(_FIELDS)
)


def session_to_blob(s: Session) -> bytes:
    """The stored state: every field but `NOT_IN_STATE`, defaults left out."""
    presence = 0
    out: list[Any] = [0]
    append = out.append
    values = s.__dict__
    for bit, name, encode, default in _ENCODE:
        value = values[name]
        if value != default:
            presence |= bit
            if encode is None:
                append(value)
            elif encode is not _FLAG:
                append(encode(value))
    out[0] = presence
    raw = orjson.dumps(out)
    if len(raw) >= STATE_INLINE:  # a state stored whole (`layout`): deflated when shorter
        packed = _deflated(raw, _STATE_LEVEL)
        if packed is not None:
            return _HEADER + packed
    return _HEADER + raw


def check_version(blob: bytes, session_id: str) -> None:
    """Raise `CorruptProjectionError` unless `blob` is a state of this layout."""
    if not blob:
        raise CorruptProjectionError(
            f"{session_id}: no state of layout {STATE_VERSION} is stored (written by an older "
            "version?); drop the projections and rebuild them with `replay`"
        )
    if blob[0] != STATE_VERSION:
        raise CorruptProjectionError(
            f"{session_id}: the stored state has layout {blob[0]}, this version reads layout "
            f"{STATE_VERSION}; drop the projections and rebuild them with `replay`"
        )


def session_from_blob(
    blob: bytes,
    session_id: str,
    turns: tuple[Turn, ...],
    event_ids: RecentIds = NO_IDS,
    summary: str | None = None,
) -> Session:
    """Rebuild the `Session` from its stored state, unsummarised turns, event ids and summary."""
    check_version(blob, session_id)
    try:
        body = blob[1:]
        presence, *stored = orjson.loads(_inflated(body) if body[:1] == _DEFLATED else body)
        kwargs: dict[str, Any] = {
            "id": session_id,
            "turns": turns,
            "event_ids": event_ids,
            "summary": summary,
        }
        values = iter(stored)
        for name, flag, _, decode in _FIELDS:
            if presence & 1:
                if flag:
                    kwargs[name] = True
                else:
                    value = next(values)
                    kwargs[name] = value if decode is None else decode(value)
            presence >>= 1
        return Session(**kwargs)  # the fields left out take their defaults
    except (orjson.JSONDecodeError, TypeError, ValueError, IndexError, StopIteration) as e:
        raise CorruptProjectionError(f"{session_id}: the stored state cannot be read: {e}") from e


# -- history ---------------------------------------------------------------------------------------
#
# What only grows is appended to one list per session and kind, an entry per record, in the
# state's record forms. `Fact` is what the fold's outcomes carry (`Outcome.fact`).

_KIND_OF: dict[type, int] = {
    CallFact: 0,
    Observation: 1,
    ExecutionFact: 2,
    Decision: 3,
    Rejection: 4,
}
_TO_JSON: tuple[Any, ...] = (
    lambda c: _calls((c,))[0],
    _observation,
    _execution,
    _decision,
    _rejection,
)
_FROM_JSON: tuple[Any, ...] = (
    lambda v: CallFact(*v),
    _observation_from,
    lambda v: ExecutionFact(*v),
    _decision_from,
    _rejection_from,
)


def decisions_from_json(session_id: str, entries: Iterable[bytes | str]) -> tuple[Decision, ...]:
    """A session's decisions history list, read back."""
    try:
        return tuple(_decision_from(orjson.loads(raw)) for raw in entries)
    except (orjson.JSONDecodeError, TypeError, ValueError, IndexError) as e:
        raise CorruptProjectionError(
            f"{session_id}: the stored decisions cannot be read: {e}"
        ) from e


def fact_to_json(fact: HistoryRecord) -> tuple[int, bytes]:
    """The history a record goes to (an index of `HISTORY_KINDS`) and its stored form."""
    kind = _KIND_OF[type(fact)]
    return kind, orjson.dumps(_TO_JSON[kind](fact))


def history_from_json(session_id: str, seq: int, lists: Iterable[Iterable[bytes | str]]) -> History:
    """A `History` from its lists' entries, in `HISTORY_KINDS` order."""
    try:
        records = [
            tuple(decode(orjson.loads(raw)) for raw in entries)
            for decode, entries in zip(_FROM_JSON, lists, strict=True)
        ]
    except (orjson.JSONDecodeError, TypeError, ValueError, IndexError) as e:
        raise CorruptProjectionError(f"{session_id}: the stored history cannot be read: {e}") from e
    return History(session_id, seq, *records)


# -- turns -----------------------------------------------------------------------------------------


def turn_to_json(t: Turn) -> bytes:
    """One history entry."""
    return orjson.dumps([t.role, t.content, t.seq])


def turn_from_json(raw: str | bytes) -> Turn:
    """Read one history entry."""
    role, content, seq = orjson.loads(raw)
    return Turn(role, content, seq)


# -- event ids -------------------------------------------------------------------------------------
#
# Records, back to back. The first byte tells the kind:
#   0x80-0xBF  a UUID: 16 bytes, its byte 8 (the RFC 4122 variant byte, 0b10xxxxxx) moved first;
#   0x00-0x7F  an id of that many UTF-8 bytes (0-127), which follow;
#   0xC0       an id whose UTF-8 length follows as 4 bytes big-endian, then the bytes.
# Only the canonical text of an RFC 4122 UUID (lowercase, hyphenated) takes the 16-byte form, so
# decoding gives back exactly the string that was stored.

_LONG = 0xC0


def _uuid_bytes(event_id: str) -> bytes | None:
    """The 16-byte record of a canonical RFC 4122 UUID (variant byte first), else None."""
    e = event_id
    if len(e) != 36 or e[8] != "-" or e[13] != "-" or e[18] != "-" or e[23] != "-":
        return None
    if e[19] not in "89ab":  # the variant: 0b10xxxxxx
        return None
    digits = e[19:21] + e[:8] + e[9:13] + e[14:18] + e[21:23] + e[24:]
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        return None
    return raw if raw.hex() == digits else None  # lower case, and nothing fromhex skipped


def pack_event_ids(event_ids: Iterable[str]) -> bytes:
    """The stored form of these event ids, in order."""
    out = bytearray()
    for event_id in event_ids:
        record = _uuid_bytes(event_id)
        if record is not None:
            out += record
            continue
        text = event_id.encode()
        if len(text) < 0x80:
            out.append(len(text))
        else:
            out.append(_LONG)
            out += len(text).to_bytes(4, "big")
        out += text
    return bytes(out)


def unpack_event_ids(blob: bytes) -> list[str]:
    """The event ids of a stored form, in order."""
    out: list[str] = []
    i, n = 0, len(blob)
    try:
        while i < n:
            first = blob[i]
            if first & 0xC0 == 0x80:
                if i + 16 > n:
                    raise ValueError("a UUID record is cut short")
                h = blob[i : i + 16].hex()  # the variant byte first, then bytes 0-7, 9-15
                out.append(f"{h[2:10]}-{h[10:14]}-{h[14:18]}-{h[:2]}{h[18:20]}-{h[20:]}")
                i += 16
                continue
            if first < 0x80:
                size, i = first, i + 1
            elif first == _LONG and i + 5 <= n:
                size, i = int.from_bytes(blob[i + 1 : i + 5], "big"), i + 5
            else:
                raise ValueError(f"unknown record byte {first:#x}")
            if i + size > n:
                raise ValueError("an id record is cut short")
            out.append(blob[i : i + size].decode())
            i += size
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptProjectionError(f"the stored event ids cannot be read at byte {i}: {e}") from e
    return out


# -- timeline entries ------------------------------------------------------------------------------
#
# A shape lists an entry's fields after `session`, `kind` and `seq`, in order. A field is a name
# (its value stored as is), a `_Dict` (a dict whose values are stored in its place, flattened) or
# a `_Word` (a string stored as its index when it is one of the words). An entry whose keys (and
# nested dicts' keys) are exactly those of a shape is stored as `[shape index, seq, values...]`
# with trailing nulls trimmed; any other entry as a JSON object without `session`.
# Append only: an index, once written, must keep meaning the same shape (or word).


class _Dict(NamedTuple):
    name: str
    fields: tuple[_Field, ...]
    stored: tuple[str, ...] | None = None  # another order to store them in: fields often null last


class _Word(NamedTuple):
    name: str
    words: tuple[str, ...]


_Field = str | _Dict | _Word

_STATE = _Word("state", ("ready", "thinking", "tool"))
_CARD = _Dict(
    "card",
    (
        "id",
        "text",
        _Word("to", _STATUSES),
        _Word("from", _STATUSES),
        "version",
        _Word("origin", _ORIGINS),
        "inherited_from",
    ),
    ("id", "text", "to", "version", "origin", "from", "inherited_from"),
)
_QUESTION = _Dict("question", ("id", "question", "options", "why", "reason", "expires_at"))
_SHAPES: tuple[tuple[str, tuple[_Field, ...]], ...] = (
    ("plan", (_Dict("plan", ("text", "version", "supersedes")),)),
    ("card", (_CARD,)),
    ("activity", (_STATE, "role", "content")),
    ("activity", (_STATE, "tool", "ok", "mutating", "result")),
    ("message", ("sender", "content")),
    ("waiting", (_QUESTION,)),
    ("answered", ("question_id", "answer", "by", "executor")),
    ("expired", ("question_id", "question", "at")),
    ("option-removed", ("option", "code", "message")),
    ("prerequisite-set", ("tools",)),
    ("open-work", ("todos",)),
    ("transferred", ("to", "todos")),
    ("ended", ("because",)),
    ("announced", ("operation", "arguments")),  # append only: a shape's index is stored
)


class _Op(NamedTuple):
    """One field of a shape, for reading."""

    name: str
    words: tuple[str, ...] | None = None  # a `_Word`: the words
    fields: tuple[_Op, ...] | None = None  # a `_Dict`: its fields, in the order stored ...
    keys: tuple[str, ...] = ()  # ... and the dict's own order


class _Plan(NamedTuple):
    """One shape, for writing: a shape has plain and word fields, or one `_Dict` of them."""

    shape: int  # its index
    keys: tuple[str, ...]  # the entry's keys
    inner: str | None  # the name of the one `_Dict`, if any ...
    inner_keys: tuple[str, ...]  # ... its keys ...
    order: tuple[int, ...] | None  # ... and the order its values are stored in, if another
    words: tuple[tuple[int, dict[str, int]], ...]  # (position in the flat values, word → index)


def _name_of(f: _Field) -> str:
    return f if isinstance(f, str) else f.name


def _stored(d: _Dict) -> tuple[_Field, ...]:
    """The fields of a `_Dict` in the order they are stored."""
    if d.stored is None:
        return d.fields
    by_name = {_name_of(f): f for f in d.fields}
    if sorted(by_name) != sorted(d.stored):
        raise AssertionError(f"{d.name}: `stored` must list every field once")
    return tuple(by_name[name] for name in d.stored)


def _ops(fields: tuple[_Field, ...]) -> tuple[_Op, ...]:
    return tuple(
        _Op(f)
        if isinstance(f, str)
        else _Op(f.name, words=f.words)
        if isinstance(f, _Word)
        else _Op(f.name, fields=_ops(_stored(f)), keys=tuple(map(_name_of, f.fields)))
        for f in fields
    )


def _plan(index: int, fields: tuple[_Field, ...]) -> _Plan:
    keys = ("session", "kind", "seq", *map(_name_of, fields))
    inner = [f for f in fields if isinstance(f, _Dict)]
    if inner and (len(fields) != 1 or any(isinstance(f, _Dict) for f in inner[0].fields)):
        raise AssertionError(f"shape {index}: a _Dict must be the only field, and flat")
    flat = _stored(inner[0]) if inner else fields
    words = tuple(
        (3 + i, {w: k for k, w in enumerate(f.words)})
        for i, f in enumerate(flat)
        if isinstance(f, _Word)
    )
    if not inner:
        return _Plan(index, keys, None, (), None, words)
    inner_keys = tuple(map(_name_of, inner[0].fields))
    order = tuple(inner_keys.index(_name_of(f)) for f in flat)
    in_order = order == tuple(range(len(order)))
    return _Plan(index, keys, inner[0].name, inner_keys, None if in_order else order, words)


def _leaves(ops: tuple[_Op, ...]) -> int:
    return sum(1 if op.fields is None else _leaves(op.fields) for op in ops)


def _rebuild(ops: tuple[_Op, ...], values: Iterator[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in ops:
        if op.fields is not None:
            inner = _rebuild(op.fields, values)
            out[op.name] = {k: inner[k] for k in op.keys}  # in the dict's own order
            continue
        value = next(values)
        out[op.name] = op.words[value] if op.words is not None and type(value) is int else value
    return out


# Per shape index: (kind, fields for reading, how many values flattened).
_READ = tuple((kind, _ops(fields), _leaves(_ops(fields))) for kind, fields in _SHAPES)
_PLANS: dict[str, list[_Plan]] = {}
for _index, (_kind, _fields) in enumerate(_SHAPES):
    _PLANS.setdefault(_kind, []).append(_plan(_index, _fields))


def _packed(entry: TimelineEntry, plans: list[_Plan]) -> list[Any] | None:
    """`[shape index, seq, values...]` for an entry of one of `plans`' shapes, else None."""
    keys = tuple(entry)
    for plan in plans:
        if keys != plan.keys:
            continue
        if plan.inner is None:
            values = list(entry.values())
        else:
            inner = entry[plan.inner]
            if type(inner) is not dict or tuple(inner) != plan.inner_keys:
                return None
            if plan.order is None:
                values = [None, None, entry["seq"], *inner.values()]
            else:
                given = list(inner.values())
                values = [None, None, entry["seq"], *[given[i] for i in plan.order]]
        values[1] = plan.shape
        for position, codes in plan.words:
            value = values[position]
            if type(value) is str:
                values[position] = codes.get(value, value)
            elif value is not None:
                return None  # an integer here would read back as a word
        del values[0]
        return _trim(values)
    return None


def entry_to_json(entry: TimelineEntry, session_id: str) -> bytes:
    """The stored form of one timeline entry of `session_id`."""
    if entry.get("session") != session_id:
        return orjson.dumps(entry, default=str)
    plans = _PLANS.get(entry["kind"])
    packed = None if plans is None else _packed(entry, plans)
    if packed is not None:
        return orjson.dumps(packed, default=str)
    return orjson.dumps({k: v for k, v in entry.items() if k != "session"}, default=str)


def entry_from_json(raw: bytes | str, session_id: str) -> TimelineEntry:
    """Read one stored timeline entry of `session_id`."""
    try:
        value = orjson.loads(raw)
        if isinstance(value, dict):
            return {"session": session_id, **value}
        index, seq, *values = value
        kind, ops, leaves = _READ[index]
        if len(values) > leaves:
            raise ValueError(f"{len(values)} values for a shape of {leaves}")
        entry = _rebuild(ops, iter(_pad(values, leaves)))
        return {"session": session_id, "kind": kind, "seq": seq, **entry}
    except (orjson.JSONDecodeError, TypeError, ValueError, IndexError, StopIteration) as e:
        raise CorruptProjectionError(
            f"{session_id}: a stored timeline entry cannot be read: {e}"
        ) from e
