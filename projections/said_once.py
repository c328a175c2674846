"""Which damaged entries a reader has named in its log already: each once, however often read."""

from __future__ import annotations

from collections.abc import Iterable


class SaidOnce:
    """Keys named once each; past `limit` of them all are forgotten (and named again): a bound
    on memory, not a cache."""

    __slots__ = ("_limit", "_said")

    def __init__(self, limit: int = 10_000) -> None:
        self._limit = limit
        self._said: set[str] = set()

    def first(self, key: str) -> bool:
        """Whether `key` is to be named now (not named since it was last forgotten)."""
        said = self._said
        if key in said:
            return False
        if len(said) >= self._limit:
            said.clear()
        said.add(key)
        return True

    def forget(self, keys: Iterable[str]) -> None:
        """These keys read fine again: named anew should they be damaged again."""
        if self._said:
            self._said.difference_update(keys)
