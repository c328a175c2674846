"""Reading the waiting-questions index and the fleet counts: one pipelined round trip each.

The index is kept per partition (`projections.keys`, the partition's hash tag) by the commit
script. A page asks every partition for its next `limit + 1` entries after the cursor and merges
them: O(P · (log n + limit)), never a scan of the sessions' states.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from projections import scripts
from projections.cards import card_from_json, fleet_key
from projections.keys import Keys
from projections.requests import Request, text
from schemas.errors import CorruptProjectionError
from session_model.questions import Cursor, WaitingPage, WaitingQuestion

K = TypeVar("K")

MAX_PAGE = 500


def page(
    keys: Keys,
    partitions: Sequence[int],
    reason: str | None,
    after: Cursor | None,
    limit: int,
) -> Request[WaitingPage]:
    """A page of waiting questions (all, or of one reason), soonest deadline first."""
    limit = max(1, min(limit, MAX_PAGE))
    low = "-inf" if after is None else str(after.score)
    member = "" if after is None else after.session_id
    sha = scripts.WAITING.sha
    commands = [
        (
            "EVALSHA",
            sha,
            2,
            keys.waiting(p) if reason is None else keys.waiting_reason(p, reason),
            keys.waiting_cards(p),
            low,
            member,
            limit + 1,
        )
        for p in partitions
    ]

    def parse(replies: list[Any]) -> WaitingPage:
        total = 0
        runs: list[list[tuple[int, str, bytes]]] = []
        for count, flat in replies:
            total += int(count)
            run = [
                (int(float(flat[i + 1])), text(flat[i]), flat[i + 2])
                for i in range(0, len(flat), 3)
            ]
            runs.append(run)
        merged = list(heapq.merge(*runs))  # each run is in (score, member) order already
        items: list[WaitingQuestion] = []
        unreadable: list[tuple[str, str]] = []
        for _, sid, card in merged[:limit]:
            if not card:
                continue
            try:
                items.append(card_from_json(sid, card))
            except CorruptProjectionError as e:  # one damaged entry: not the whole page
                unreadable.append((sid, str(e)))
        last = merged[limit - 1] if len(merged) > limit else None
        cursor = None if last is None else Cursor(last[0], last[1])
        return WaitingPage(tuple(items), total, cursor, tuple(unreadable))

    return Request(commands, parse, "reading waiting questions failed")


def by_reason(keys: Keys, partitions: Sequence[int]) -> Request[dict[str, int]]:
    """Waiting questions per reason, over every partition."""
    commands = [("HGETALL", keys.waiting_counts(p)) for p in partitions]
    return Request(commands, _summed(text), "reading waiting counts failed")


def fleet(keys: Keys, partitions: Sequence[int]) -> Request[dict[tuple[str, str], int]]:
    """Sessions per (status, mode), over every partition."""

    commands = [("HGETALL", keys.fleet_counts(p)) for p in partitions]
    return Request(
        commands, _summed(lambda raw: fleet_key(text(raw))), "reading fleet counts failed"
    )


def _summed(name: Callable[[Any], K]) -> Callable[[list[Any]], dict[K, int]]:
    """Parse HGETALL replies into one count per field (as `name` reads it), zeros left out."""

    def parse(replies: list[Any]) -> dict[K, int]:
        out: dict[K, int] = {}
        for reply in replies:
            pairs = (
                reply.items()
                if isinstance(reply, dict)
                else zip(reply[::2], reply[1::2], strict=True)
            )
            for f, n in pairs:
                key = name(f)
                out[key] = out.get(key, 0) + int(n)
        return {k: n for k, n in out.items() if n > 0}

    return parse
