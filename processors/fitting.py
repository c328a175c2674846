"""Records the worker publishes (decisions, question changes), cut to what a produce request holds.

A decision carries its question, the question's `why` and the answer; a question change also the
session's goal and the options. Each comes from an event of at most the broker's record size, so
together they can exceed what one produce request may carry (aiokafka's `max_request_size`, 1 MiB
by default). Such a record would fail on every redelivery and stop the partition; instead its
long text fields are cut, with a marker. The whole texts stay in the session's history and in the
events topic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from session_model.cutting import cut_text

# aiokafka's default max_request_size, less room for the key, the headers and the batch framing.
MAX_RECORD_BYTES: Final = 1_048_576 - 16_384
KEPT_CHARS: Final = 16_384  # of each long text of a record cut to fit
KEPT_OPTIONS: Final = 64
_LAST_RESORT_CHARS: Final = 256
# The fields that may be long prose (ids, statuses and times are left whole).
TEXTS: Final = frozenset({"question", "why", "answer", "goal"})
KEPT_KEY_BYTES: Final = 1024  # of a refused record's key, when it and its value are too large


def fit(
    record: Mapping[str, Any], encode: Callable[[Mapping[str, Any]], bytes]
) -> tuple[bytes, bool]:
    """The record encoded, its long texts (and options) cut if it would not fit; whether cut."""
    value = encode(record)
    if len(value) <= MAX_RECORD_BYTES:
        return value, False
    for kept in (KEPT_CHARS, _LAST_RESORT_CHARS):
        value = encode(_cut(record, kept))
        if len(value) <= MAX_RECORD_BYTES:
            break
    return value, True


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


def _cut(record: Mapping[str, Any], kept: int) -> dict[str, Any]:
    cut: dict[str, Any] = {}
    for name, value in record.items():
        if name in TEXTS and isinstance(value, str):
            cut[name] = cut_text(value, kept)
        elif name == "options" and isinstance(value, list):
            cut[name] = [
                cut_text(o, kept) if isinstance(o, str) else o for o in value[:KEPT_OPTIONS]
            ]
        else:
            cut[name] = value
    return cut
