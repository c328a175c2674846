"""A live rebuild's first pass folds in as many processes as it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from processors import generations
from projections.keys import Keys
from session_model.signing import TrustedKeys


class _StopError(Exception):
    """Raised by the stand-in first pass: what it was asked is all this test needs."""


@dataclass
class _Store:
    """What `rebuild_live` touches of a store before its first pass."""

    keys: Keys
    follow: bool = True
    leases: int = 0

    def lease(self, token: str, ttl_ms: int, op: str) -> bool:
        self.leases += 1
        return True

    def refresh_generations(self) -> tuple[int, ...]:
        return (0,) * self.keys.partitions

    def drop_generation(self, generation: int) -> int:
        return 0


@pytest.mark.parametrize("processes", [None, 1, 2])
def test_the_first_pass_is_given_the_processes(
    monkeypatch: pytest.MonkeyPatch, processes: int | None
) -> None:
    asked: dict[str, Any] = {}

    def first_pass(*args: Any, **kwargs: Any) -> Any:
        asked.update(kwargs)
        raise _StopError

    monkeypatch.setattr(generations, "end_offsets", lambda access, topic: ({}, 6))
    monkeypatch.setattr(generations, "replay", first_pass)
    store = _Store(Keys("t", partitions=6))
    with pytest.raises(_StopError):
        generations.rebuild_live(
            "127.0.0.1:1",
            "events",
            store,  # type: ignore[arg-type]
            TrustedKeys.none(),
            processes=processes,
        )
    assert asked["processes"] == processes
    assert asked["fork_guard"] is not None  # the lease renewer is guarded either way
    assert store.leases >= 2  # taken, then given back
