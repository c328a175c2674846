"""The long-session bytes figure never reports a session it did not find as one of 0 bytes."""

from __future__ import annotations

from typing import Any

import pytest

from bench.figures.longevity import _bytes
from projections.keys import Keys


class Usage:
    """MEMORY USAGE of a fixed set of keys (what a Redis holding them would answer)."""

    def __init__(self, used: dict[str, int]) -> None:
        self.used = used

    def memory_usage(self, key: str, samples: int = 0) -> int | None:
        return self.used.get(key)


def test_the_bytes_of_the_keys_the_session_has_are_summed_hot_and_history() -> None:
    keys = Keys("bench", partitions=6)
    k = keys.session("s-1")
    client: Any = Usage({k.state: 2000, k.event_ids: 500, k.turns: 9000})
    held = _bytes(client, keys, "s-1")
    assert (held.hot, held.history) == (2500, 9000)


def test_a_session_whose_state_is_not_where_it_is_read_is_an_error() -> None:
    keys = Keys("bench", partitions=6)
    elsewhere = Keys("bench", partitions=6).session(
        "s-1", partition=(keys.partition_of("s-1") + 1) % 6
    )
    client: Any = Usage({elsewhere.state: 2000})
    with pytest.raises(RuntimeError, match="read the wrong keys"):
        _bytes(client, keys, "s-1")
