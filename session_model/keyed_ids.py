"""Event ids derived from what an event does, under a key nobody else holds.

A derived id makes a write tried again (its ack lost, or the writer restarted halfway) a duplicate
the fold drops by id. A public derivation would let anyone who can append to the session append
an event of their own under that id first, and have the real one dropped as its duplicate; a key
keeps the ids unknown until they are written.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import uuid
from typing import Self

ID_KEY_BYTES = 32  # the length of a key this module makes
ID_KEY_MIN_BYTES = 16  # the shortest key it takes


class KeyedIds:
    """Ids derived with HMAC-SHA256 under a key of at least `ID_KEY_MIN_BYTES` bytes."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) < ID_KEY_MIN_BYTES:
            raise ValueError(f"an id key needs at least {ID_KEY_MIN_BYTES} bytes")
        self._key = key

    @classmethod
    def random(cls) -> Self:
        """Ids under a fresh random key (known to this process only)."""
        return cls(secrets.token_bytes(ID_KEY_BYTES))

    def derive(self, *parts: str | int | list[object]) -> str:
        """The id of `parts`: the same for the same key and parts, unforeseeable without the key.

        The parts are encoded as one JSON array, so that no two different lists of them (a
        session id or a card id holding a separator, say) derive from the same bytes.
        """
        name = json.dumps(parts, separators=(",", ":")).encode()
        return str(
            uuid.UUID(bytes=hmac.new(self._key, name, hashlib.sha256).digest()[:16], version=4)
        )
