"""What the processes exchange: records as consumed, records to publish, and where they go."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Consumed(Protocol):
    """A record as consumed (aiokafka's `ConsumerRecord` is one, passed through as it comes)."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def topic(self) -> str: ...
    @property
    def timestamp(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A consumed record built by hand (tests, tools): key, value and where it sits."""

    key: bytes | None
    value: bytes | None
    partition: int
    offset: int
    topic: str = ""
    timestamp: int | None = None  # ms since the epoch (CreateTime); None: not known


OutRecord = tuple[bytes | None, bytes, Sequence[tuple[str, bytes]]]


class Sink(Protocol):
    """Somewhere to publish records and wait until they are acknowledged."""

    async def publish(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]]
    ) -> None:
        """Publish and wait for the acknowledgement."""
        ...

    async def publish_many(self, records: Sequence[OutRecord]) -> None:
        """Queue every record in order, then wait for all acknowledgements together."""
        ...
