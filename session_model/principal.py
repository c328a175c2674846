"""Who answered a question, and whether that identity was verified."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schemas.frozen import fast_init


@fast_init
@dataclass(frozen=True, slots=True)
class Principal:
    """An identity with its channel prefix (`cli:rod@laptop`, `actor:member:42`)."""

    id: str
    verified: bool = False

    @classmethod
    def from_terminal(cls, user: str, host: str) -> Principal:
        """A terminal reports an OS user that anyone holding the terminal can be: never verified."""
        return cls(f"cli:{user}@{host}", verified=False)

    @classmethod
    def from_record(cls, record: object) -> Principal | None:
        """Read a stored principal without ever raising trust: only an exact `True` is verified."""
        if not isinstance(record, Mapping):
            return None
        principal_id = record.get("id")
        if not isinstance(principal_id, str) or not principal_id:
            return None
        return cls(principal_id, verified=record.get("verified") is True)

    def to_record(self) -> dict[str, Any]:
        """The wire/projection form `{id, verified}`."""
        return {"id": self.id, "verified": self.verified}
