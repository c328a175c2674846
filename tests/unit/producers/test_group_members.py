"""`group_members` (the replay guard's question) reads kafka-python's description strictly."""

from __future__ import annotations

from typing import Any

import pytest

from producers import topics
from producers.settings import StackSettings as Settings
from schemas.errors import LogError


def _admin(described: dict[str, Any] | None) -> type:
    class FakeAdmin:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def describe_groups(self, groups: list[str]) -> dict[str, Any]:
            return {} if described is None else {groups[0]: described}

        def close(self) -> None:
            pass

    return FakeAdmin


@pytest.mark.parametrize(
    ("described", "members"),
    [
        ({"error": None, "group_state": "Dead", "members": []}, []),
        ({"error": "[Error 69] GroupIdNotFoundError: g", "members": []}, []),
        (
            {
                "error": None,
                "group_state": "Stable",
                "members": [
                    {"client_id": "faust-0.15.3", "client_host": "/10.0.0.2"},
                    {"client_id": "faust-0.15.3", "client_host": "/10.0.0.1"},
                ],
            },
            ["faust-0.15.3@10.0.0.1", "faust-0.15.3@10.0.0.2"],
        ),
    ],
)
def test_members_of_a_described_group(
    monkeypatch: pytest.MonkeyPatch, described: dict[str, Any], members: list[str]
) -> None:
    monkeypatch.setattr(topics, "KafkaAdminClient", _admin(described))
    assert topics.group_members(Settings()) == members


@pytest.mark.parametrize(
    "described",
    [None, {"error": "[Error 14] CoordinatorLoadInProgressError: g", "members": []}],
)
def test_a_group_the_broker_could_not_describe_is_an_error_not_an_empty_group(
    monkeypatch: pytest.MonkeyPatch, described: dict[str, Any] | None
) -> None:
    monkeypatch.setattr(topics, "KafkaAdminClient", _admin(described))
    with pytest.raises(LogError):
        topics.group_members(Settings())


def test_a_description_gives_each_members_partitions_by_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    described = {
        "error": None,
        "group_state": "Stable",
        "members": [
            {
                "member_id": "m-1",
                "client_id": "faust",
                "client_host": "/10.0.0.1",
                "member_assignment": {
                    "assigned_partitions": [
                        {"topic": "events", "partitions": [0, 2]},
                        {"topic": "other", "partitions": [1]},
                    ]
                },
            },
            {"member_id": "m-2", "client_id": "faust", "client_host": "/10.0.0.2"},
        ],
    }
    monkeypatch.setattr(topics, "KafkaAdminClient", _admin(described))
    group = topics.describe_group(Settings(), "g")
    assert group.state == "Stable"
    assert [(m.member_id, m.client, m.partitions) for m in group.members] == [
        ("m-1", "faust@10.0.0.1", {"events": {0, 2}, "other": {1}}),
        ("m-2", "faust@10.0.0.2", {}),
    ]
