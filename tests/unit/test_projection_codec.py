"""The stored form of a session: every field survives the round trip through JSON."""

from __future__ import annotations

from dataclasses import fields

from hypothesis import given, settings

from processors.projection_codec import session_from_json, session_to_json
from session_model.fold import fold
from session_model.session import Session
from tests.unit.test_properties import event_sequences


def _round_trip(s: Session) -> Session:
    return session_from_json(session_to_json(s), s.turns, s.event_ids)


@settings(max_examples=150, deadline=None)
@given(event_sequences())
def test_any_folded_session_survives_the_stored_form_unchanged(events: list) -> None:
    state = fold("s1", events)
    assert _round_trip(state) == state


def test_the_stored_form_covers_every_field_of_session() -> None:
    stored = session_to_json(Session("s1"))
    # turns and event ids live in their own Redis keys; every other field is in the blob.
    missing = (
        {f.name for f in fields(Session)}
        - {"turns", "event_ids"}
        - set(__import__("json").loads(stored))
    )
    assert missing == set()
