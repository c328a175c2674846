"""What a projection may fold from `sessions.events`: one rule for the worker, replay and tools.

A record is admitted when it decodes, carries a session id without control characters, is
keyed by that session id (so the partitioner kept the session's events in order) and, when the
topic's partition count is known, sits in the partition that key maps to. Everything else is
refused with a stable code: the worker dead-letters it, a rebuild counts it, and neither ever
folds it, so a rebuild applies exactly what the live path applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from schemas.codec import EventCodec
from schemas.errors import CodecError
from session_model.partitioning import partition_for
from session_model.projection import Position, Record

# The stable refusal codes (dead-letter header `milpa-refusal`, replay's report, metrics).
UNDECODABLE: Final = "undecodable"
# The decoder raised something other than a `CodecError`: a bug in this version's decoding, not a
# malformed record; its own code so that a codec regression is not taken for bad input.
DECODER_FAILED: Final = "decoder_failed"
NO_VALUE: Final = "no_value"
NO_SESSION_ID: Final = "no_session_id"
BAD_SESSION_ID: Final = "bad_session_id"
KEY_MISMATCH: Final = "key_mismatch"
WRONG_PARTITION: Final = "wrong_partition"
CODES: Final = (
    UNDECODABLE,
    DECODER_FAILED,
    NO_VALUE,
    NO_SESSION_ID,
    BAD_SESSION_ID,
    KEY_MISMATCH,
    WRONG_PARTITION,
)
# A session id is a name: no control characters. Besides what they would do to logs and pages,
# the snapshots topic keys its partitions' checkpoints with a NUL-led key (`projections.snapshots`)
# that a session's id must never equal.
CONTROL_CHARACTER: Final = re.compile("[\x00-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a record is not folded: a stable code and a sentence for people."""

    code: str
    detail: str

    @property
    def reason(self) -> str:
        """`code: detail`, as written to the dead-letter header."""
        return f"{self.code}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Intake:
    """Decodes and validates raw records; `partitions` is the topic's count (None: unknown)."""

    codec: EventCodec
    partitions: int | None = None

    def admit(
        self, key: bytes | None, value: bytes | None, partition: int, offset: int
    ) -> Record | Refusal:
        """The record to fold, or why it must not be folded."""
        if value is None:
            return Refusal(NO_VALUE, "the record has no value")
        try:
            event = self.codec.decode(value)
        except CodecError as e:
            return Refusal(UNDECODABLE, f"{type(e).__name__}: {e}")
        except Exception as e:
            # A reader never dies on one record (redelivered to every worker in turn, it would
            # stop the partition): refused, with what it raised.
            return Refusal(DECODER_FAILED, f"{type(e).__name__} while decoding: {e}")
        sid = event.session_id
        if not sid:
            return Refusal(NO_SESSION_ID, "the event has an empty session_id")
        if CONTROL_CHARACTER.search(sid):
            return Refusal(BAD_SESSION_ID, f"session_id {sid[:64]!r} holds a control character")
        if key is None or key != sid.encode():
            shown = "no key" if key is None else f"key {key[:64]!r}"
            return Refusal(
                KEY_MISMATCH,
                f"{shown} is not session_id {sid!r}: the event would lose its ordering",
            )
        partitions = self.partitions
        if partitions is not None and (home := partition_for(sid, partitions)) != partition:
            return Refusal(
                WRONG_PARTITION,
                f"session {sid!r} belongs to partition {home} of {partitions}, not {partition}",
            )
        return Record(event, Position(partition, offset))
