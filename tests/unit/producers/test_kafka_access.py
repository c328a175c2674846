"""One access value gives every Kafka client library its security options."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from producers.kafka_access import KafkaAccess
from producers.settings import StackSettings
from schemas.errors import ConfigurationError


def test_a_bare_bootstrap_is_a_plaintext_cluster() -> None:
    access = KafkaAccess.of("a:9092,b:9092")
    assert access.kafka_python() == {
        "bootstrap_servers": ["a:9092", "b:9092"],
        "security_protocol": "PLAINTEXT",
    }
    assert access.aiokafka()["security_protocol"] == "PLAINTEXT"
    assert "ssl_context" not in access.aiokafka()


def test_sasl_ssl_gives_scram_credentials_and_a_verifying_tls_context(tmp_path: Path) -> None:
    secret = tmp_path / "worker.password"
    secret.write_text("s3cret\n")
    settings = StackSettings.from_env(
        {
            "MILPA_KAFKA_BOOTSTRAP": "127.0.0.1:9093",
            "MILPA_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
            "MILPA_KAFKA_USERNAME": "worker",
            "MILPA_KAFKA_PASSWORD_FILE": str(secret),
        }
    )
    access = settings.kafka_access()
    assert "s3cret" not in repr(access)
    options = access.kafka_python()
    assert options["security_protocol"] == "SASL_SSL"
    assert (options["sasl_mechanism"], options["sasl_plain_username"]) == (
        "SCRAM-SHA-512",
        "worker",
    )
    assert options["sasl_plain_password"] == "s3cret"
    assert options["ssl_check_hostname"] is True
    context = access.aiokafka()["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname and context.verify_mode is ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"protocol": "SASL_TLS"}, "security protocol"),
        ({"protocol": "SASL_SSL"}, "username and password"),
        ({"protocol": "SASL_SSL", "username": "u", "password": "p", "mechanism": "MD5"}, "MD5"),
    ],
)
def test_an_incomplete_or_unknown_security_setting_is_a_configuration_error(
    changes: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        KafkaAccess("h:1", **changes)  # type: ignore[arg-type]


def test_an_unreadable_password_file_names_its_setting(tmp_path: Path) -> None:
    settings = StackSettings(kafka_password_file=tmp_path / "missing")
    with pytest.raises(ConfigurationError, match="MILPA_KAFKA_PASSWORD_FILE"):
        settings.kafka_access()
