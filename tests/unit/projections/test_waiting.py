"""Reading a page of the waiting-questions index: one damaged entry does not fail the page."""

from __future__ import annotations

from projections import waiting
from projections.cards import card_to_json
from projections.keys import Keys
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
    assert page.items == (first,) and page.unreadable == ("s2",)
    assert page.total == 3 and page.next == Cursor(2000, "s2")  # the cursor goes past it
