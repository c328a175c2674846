"""Topic settings come from the project's settings: replication factor and min.insync.replicas."""

from __future__ import annotations

import pytest

from producers.settings import StackSettings
from producers.topics import topic_specs
from schemas.errors import ConfigurationError


def test_min_insync_replicas_is_read_from_the_environment_and_unset_by_default() -> None:
    assert StackSettings().min_insync_replicas is None
    env = {"MILPA_REPLICATION_FACTOR": "3", "MILPA_MIN_INSYNC_REPLICAS": "2"}
    settings = StackSettings.from_env(env)
    assert (settings.replication_factor, settings.topic_min_insync()) == (3, 2)
    assert settings.to_env()["MILPA_MIN_INSYNC_REPLICAS"] == "2"
    assert "MILPA_MIN_INSYNC_REPLICAS" not in StackSettings().to_env()


def test_every_topic_gets_the_replication_and_min_insync_replicas_when_set() -> None:
    specs = topic_specs(StackSettings(replication_factor=3, min_insync_replicas=2))
    assert specs
    for spec in specs:
        assert spec.replication_factor == 3
        assert spec.config["min.insync.replicas"] == "2"
        assert spec.config["retention.ms"] == "-1"
    for spec in topic_specs(StackSettings()):  # unset: the brokers' default applies
        assert spec.replication_factor == 1
        assert "min.insync.replicas" not in spec.config


@pytest.mark.parametrize(("rf", "isr"), [(1, 2), (3, 4), (3, 0)])
def test_min_insync_replicas_outside_one_to_the_replication_factor_is_refused(
    rf: int, isr: int
) -> None:
    settings = StackSettings(replication_factor=rf, min_insync_replicas=isr)
    with pytest.raises(ConfigurationError, match="MILPA_MIN_INSYNC_REPLICAS"):
        topic_specs(settings)


def test_a_min_insync_replicas_that_is_no_number_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="MILPA_MIN_INSYNC_REPLICAS"):
        StackSettings.from_env({"MILPA_MIN_INSYNC_REPLICAS": "two"})
