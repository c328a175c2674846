"""Topic ids in both forms operators meet: Kafka's base64url and a UUID with dashes."""

from __future__ import annotations

import uuid

import pytest

from session_model.authority import kafka_form, parse_topic_id


def test_the_two_forms_of_a_topic_id_read_as_the_same_id() -> None:
    u = uuid.UUID("427d9b50-9c6d-4355-b212-107766bd4038")
    assert kafka_form(u) == "Qn2bUJxtQ1WyEhB3Zr1AOA"
    assert parse_topic_id(kafka_form(u)) == u == parse_topic_id(f" {u} ")


@pytest.mark.parametrize("text", ["", "abc", "Qn2bUJxtQ1WyEhB3Zr1AO!", "427d9b50-9c6d"])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a topic id"):
        parse_topic_id(text)
