"""Records the worker publishes (decisions, question changes), cut to what a produce request holds.

A decision carries its question (text, `reason`, `why`, id) and the answer (text, `executor`,
`by`); a question change also the session's goal and the options. Each comes from an event of at
most the broker's record size and none of these strings is bounded by the writer, so together
they can exceed what one produce request may carry (aiokafka's `max_request_size`, 1 MiB by
default). Such a record would fail on every redelivery and, since a redelivered batch publishes
its decisions again, stop the partition for good; instead it is cut (`fit`), so that it always
fits:

- the texts first, every string but the ids (`question`, `reason`, `why`, `answer`, `executor`,
  `goal`, `expires_at`, the options, any field added later): the longest first, each to the same
  number of characters, the most up to `KEPT_CHARS` that fits (shorter ones stay whole), with a
  marker saying how long it was; the options keep their first `KEPT_OPTIONS`;
- the ids (`session_id`, `question_id`, `event_id`, `by`) only if that is not enough with every
  text at `FLOOR_CHARS` (ids of hundreds of KiB): then an id longer than `KEPT_CHARS` is cut to
  it, with the marker. The records that need it carry the cut id (the same cut wherever it
  happens), the session's other records the whole one. Subscribers de-duplicate on the session
  and the seq (and the event id), never on the texts, and a record is cut alike each time it is
  published, so a republished one is still recognised;
- `status` and `mode`, which the fold takes from a fixed set, stay whole: only a record no fold
  makes could need them cut, and then every string is cut to `FLOOR_CHARS`.

Every string at `FLOOR_CHARS` (at most 4 bytes a character, plus the marker) and at most
`KEPT_OPTIONS` options make a record of a few hundred KiB at most: `fit` never returns one larger
than `MAX_RECORD_BYTES`. Its key, the session id, is cut to `KEPT_KEY_BYTES` (`fit_key`). The whole
texts stay in the session's history and in the events topic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from session_model.cutting import cut_text

# aiokafka's default max_request_size, less room for the key (at most KEPT_KEY_BYTES), the headers
# and the batch framing.
MAX_RECORD_BYTES: Final = 1_048_576 - 16_384
KEPT_CHARS: Final = 16_384  # at most, of each long text of a record cut to fit (and of a long id)
FLOOR_CHARS: Final = 256  # at least, of each text of a record the fold made
KEPT_OPTIONS: Final = 64
# Cut only when the texts cannot make room (see the module's docstring).
IDS: Final = frozenset({"session_id", "question_id", "event_id", "by"})
WHOLE: Final = frozenset({"status", "mode"})  # cut only in a record no fold makes
KEPT_KEY_BYTES: Final = 1024  # of a key that is too long: a published record's, a refused record's

_Caps = tuple[int | None, int | None, int | None]  # kept characters: texts, ids, whole (None: all)


def fit(
    record: Mapping[str, Any], encode: Callable[[Mapping[str, Any]], bytes]
) -> tuple[bytes, bool]:
    """The record encoded within `MAX_RECORD_BYTES`, its strings cut if needed; whether cut."""
    value = encode(record)
    if len(value) <= MAX_RECORD_BYTES:
        return value, False

    def at(caps: _Caps) -> bytes | None:
        encoded = encode(_cut(record, caps))
        return encoded if len(encoded) <= MAX_RECORD_BYTES else None

    best = at((KEPT_CHARS, None, None))
    if best is not None:
        return best, True
    best = at((FLOOR_CHARS, None, None))
    if best is not None:
        # The most characters each text may keep, between FLOOR_CHARS (fits) and KEPT_CHARS (not).
        low, high = FLOOR_CHARS, KEPT_CHARS
        while high - low > 1:
            middle = (low + high) // 2
            found = at((middle, None, None))
            if found is None:
                high = middle
            else:
                low, best = middle, found
        return best, True
    best = at((FLOOR_CHARS, KEPT_CHARS, None))
    if best is not None:
        return best, True
    return encode(_cut(record, (FLOOR_CHARS, FLOOR_CHARS, FLOOR_CHARS))), True


def fit_key(session_id: str) -> bytes:
    """A published record's key: the session id, cut to its first `KEPT_KEY_BYTES` bytes.

    The same for every record of a session, so they stay in one partition, in order; only an id
    longer than any writer makes is cut (its sessions may then share a partition with another).
    """
    return session_id.encode()[:KEPT_KEY_BYTES]


def fit_dead_letter(key: bytes | None, value: bytes) -> tuple[bytes | None, bytes, str]:
    """A refused record's key and value as its dead letter carries them, and what was cut.

    A record the broker took for the events topic may be within a few bytes of the largest one a
    produce request carries; with the dead letter's headers it would no longer fit, fail on every
    redelivery and stop the partition. Then the key is cut to `KEPT_KEY_BYTES` and the value to
    what is left; the third item names the sizes they had (`key:<bytes>,value:<bytes>`), else "".
    """
    key_bytes = len(key) if key is not None else 0
    if key_bytes + len(value) <= MAX_RECORD_BYTES:
        return key, value, ""
    kept_key = key[:KEPT_KEY_BYTES] if key is not None else None
    room = MAX_RECORD_BYTES - (len(kept_key) if kept_key is not None else 0)
    return kept_key, value[:room], f"key:{key_bytes},value:{len(value)}"


def _cut(record: Mapping[str, Any], caps: _Caps) -> dict[str, Any]:
    """The record with each string cut to its field's cap (`IDS`, `WHOLE`, else a text's)."""
    cut: dict[str, Any] = {}
    for name, value in record.items():
        kept = caps[1] if name in IDS else caps[2] if name in WHOLE else caps[0]
        cut[name] = value if kept is None else _cut_value(value, kept)
    return cut


def _cut_value(value: Any, kept: int) -> Any:
    if isinstance(value, str):
        return cut_text(value, kept)
    if isinstance(value, list):  # the options
        return [_cut_value(v, kept) for v in value[:KEPT_OPTIONS]]
    if isinstance(value, Mapping):  # `by`: its id
        return {name: _cut_value(v, kept) for name, v in value.items()}
    return value
