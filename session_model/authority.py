"""Who may make a session less supervised: an operator's signature, checked by the fold.

Everything that raises a session's authority (a grant, a less strict mode, a start less strict
than the deployment's unsigned start mode) is believed only when signed by a key of the fold's
trusted set, over the event's session id, event id, type and authority fields. Anything that makes
a session more supervised needs no signature. Records before the operator's configured cut-over
(a position per partition) are legacy: written before signatures existed, they are believed as
they are.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from schemas import events as ev
from schemas.events import Event
from session_model.modes import Mode
from session_model.signing import TrustedKeys, verify_authority


@dataclass(frozen=True, slots=True)
class Authority:
    """The fold's trust inputs for one event: keys, the unsigned start mode, legacy or not."""

    keys: TrustedKeys = field(default_factory=TrustedKeys.none)
    start_mode: Mode = Mode.ASK
    legacy: bool = False


@dataclass(frozen=True, slots=True)
class Cutover:
    """Per partition, the offset before which unsigned authority is legacy (accepted as is).

    An input of the fold like the trusted keys: empty (the default) means every record is held to
    the signature rule. Set it once, to the end offsets at the moment writers start signing.
    Offsets mean something only in the topic they were read from: `topic_id` names it (KIP-516),
    and the processes that fold refuse to start on a topic of another id (`wiring.checked_cutover`):
    a recreated or mirrored topic's first records would otherwise pass as legacy, unsigned.
    """

    before: Mapping[int, int] = field(default_factory=dict)
    topic_id: str | None = None

    @classmethod
    def parse(cls, text: str) -> Cutover:
        """`"<topic id>@0:1200,1:977"` (partition:offset pairs; empty: no legacy records)."""
        topic_id, sep, pairs = text.strip().rpartition("@")
        if sep and not topic_id.strip():
            raise ValueError("the topic id before '@' is empty")
        before: dict[int, int] = {}
        for part in filter(None, (p.strip() for p in pairs.split(","))):
            partition, sep, offset = part.partition(":")
            if not sep:
                raise ValueError(f"{part!r} is not partition:offset")
            before[int(partition)] = int(offset)
        return cls(before, topic_id.strip() or None)

    def is_legacy(self, partition: int, offset: int) -> bool:
        """Whether the record at this position was written before the cut-over."""
        end = self.before.get(partition)
        return end is not None and offset < end


def parse_topic_id(text: str) -> uuid.UUID:
    """A topic id as `kafka-topics --describe` prints it (22 characters of base64url) or as a
    UUID with dashes (kafka-python's form)."""
    t = text.strip()
    try:
        if len(t) == 22:
            return uuid.UUID(bytes=base64.urlsafe_b64decode(t + "=="))
        return uuid.UUID(t)
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"{text!r} is not a topic id: {e}") from e


def kafka_form(topic_id: uuid.UUID) -> str:
    """The id as Kafka's tools print it."""
    return base64.urlsafe_b64encode(topic_id.bytes).rstrip(b"=").decode("ascii")


def trust_fingerprint(keys: TrustedKeys, start_mode: Mode, cutover: Cutover) -> str:
    """A short, stable name of the fold's trust inputs (32 hex digits of a SHA-256).

    Two folds of the same events give the same states when their fingerprints are equal: the
    trusted key ids with their public keys, the unsigned start mode, and the cut-over's offsets
    (with its topic id; an empty cut-over, whatever topic it names, is no cut-over). A snapshot
    names the trust it was folded under (`projections.snapshots`), and a rebuild under another
    one folds the log instead.
    """
    # As the fold reads the cut-over: an offset of 0 or less makes nothing legacy, and a topic
    # id is one id however it is written (both forms pass `wiring.checked_cutover`).
    before = sorted((p, o) for p, o in cutover.before.items() if o > 0)
    topic = cutover.topic_id
    if topic is not None:
        # Not an id: compared as written (the processes that fold refuse it anyway).
        with contextlib.suppress(ValueError):
            topic = str(parse_topic_id(topic))
    inputs = {
        "keys": [
            [key_id, keys.keys[key_id].public_bytes(Encoding.Raw, PublicFormat.Raw).hex()]
            for key_id in keys.key_ids()
        ],
        "start_mode": str(start_mode.value),
        "cutover": {"before": before, "topic_id": topic} if before else None,
    }
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"milpa-sessions trust v1\x00" + text.encode()).hexdigest()[:32]


def authority_fields(event: Event) -> dict[str, object]:
    """The payload fields an operator signs for an event of this type."""
    p = event.payload
    if event.type == ev.PERMISSION_GRANTED:
        return {"operation": p.get("operation")}
    if event.type == ev.MODE_CHANGED:
        return {"mode": p.get("mode")}
    if event.type == ev.STARTED:
        return {"mode": p.get("mode"), "parent_id": p.get("parent_id")}
    return {}


def signed_by_operator(event: Event, authority: Authority) -> bool:
    """Whether the event carries a trusted operator key's signature over its authority fields."""
    return verify_authority(
        authority.keys,
        event.payload.get("authority"),
        session_id=event.session_id,
        event_id=event.event_id,
        event_type=event.type,
        fields=authority_fields(event),
    )
