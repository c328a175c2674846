"""Reading a page of the waiting-questions index: one damaged entry does not fail the page."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

from projections import waiting
from projections.cards import card_from_json, card_to_json
from projections.keys import Keys
from schemas.errors import CorruptProjectionError
from session_model.questions import Cursor, WaitingQuestion


def _card(sid: str, deadline_ms: int) -> WaitingQuestion:
    return WaitingQuestion(
        sid,
        "q1",
        "Go on?",
        ("yes", "no"),
        "permission",
        None,
        None,
        deadline_ms,
        None,
        3,
        "ask",
        "g",
    )


def test_an_entry_that_does_not_decode_is_named_apart_and_the_others_are_read() -> None:
    request = waiting.page(Keys(partitions=2), [0, 1], None, None, 2)
    first, third = _card("s1", 1000), _card("s3", 3000)
    replies = [
        (2, [b"s1", b"1000", card_to_json(first), b"s3", b"3000", card_to_json(third)]),
        (1, [b"s2", b"2000", b"{damaged"]),
    ]
    page = request.parse(replies)
    assert page.items == (first,) and [sid for sid, _ in page.unreadable] == ["s2"]
    assert (
        "s2: its waiting-questions entry cannot be read: JSONDecodeError" in page.unreadable[0][1]
    )
    assert page.total == 3 and page.next == Cursor(2000, "s2")  # the cursor goes past it


_ASKED = b'{"q": "q1", "t": "Go on?", "r": "permission", "s": 3, "m": "ask", "g": "g", "a": %s}'


@pytest.mark.parametrize(
    "stored",
    [
        b"[]",  # JSON, not an object
        b"null",
        _ASKED % b"1e300",  # not an int
        _ASKED % b"true",
        _ASKED % b"9000000000000000000",  # past what a datetime holds
        b'{"q": 5, "t": "Go on?", "r": "permission", "s": 3, "m": "ask", "g": "g"}',
        b'{"q": "q1", "t": "Go on?", "o": "yes", "r": "permission", "s": 3, "m": "ask", "g": "g"}',
        b'{"q": "q1", "t": "Go on?", "r": "permission", "s": "3", "m": "ask", "g": "g"}',
    ],
)
def test_an_entry_of_any_wrong_shape_is_a_corrupt_projection(stored: bytes) -> None:
    with pytest.raises(CorruptProjectionError, match=r"^s1: its waiting-questions entry"):
        card_from_json("s1", stored)


def test_a_card_reads_back_as_written() -> None:
    card = replace(_card("s1", 1000), why="w", expires_at="2030-01-01T00:00:00Z")
    card = replace(card, asked_at=datetime(2026, 12, 7, 12, 0, 0, 123000, tzinfo=UTC))
    assert card_from_json("s1", card_to_json(card)) == card
